//! `parc plan --search FILE [--gpus N] [--nodes K] [--top K]`: search the spec's plans on its
//! cluster (or N GPUs over K nodes) with `parc_compiler::search` and print the fastest that
//! fit: tokens/s, MFU, memory per GPU, bubble and exposed communication, how many plans each
//! rule rejected, and the winner as `--set` flags and as a `parallel` section to paste. A
//! progress line on a terminal when the search takes over a second.
//!
//! Exit codes: 0 a plan fits, 1 the spec fails or no plan fits, 2 usage or unreadable input.

use crate::diagnostics;
use crate::input::{parse_overrides, read_spec};
use crate::report::bytes;
use parc_compiler::search::{self, Candidate, Outcome, Progress, Ranked, SearchOptions};
use parc_compiler::spec::{Balance, PipelineSchedule};
use std::fmt::Write as _;
use std::io::IsTerminal as _;

/// What `--search` reads from the command line.
pub struct SearchArgs<'a> {
    pub file: &'a std::path::Path,
    pub set: &'a [String],
    pub fusion: bool,
    pub gpus: Option<u32>,
    pub nodes: Option<u32>,
    pub top: usize,
    pub calibration: &'a crate::calibration::CalibrationArgs,
}

pub fn main(args: SearchArgs) -> u8 {
    let usage = |message: String| {
        eprintln!("error: {message}");
        2
    };
    let text = match read_spec(args.file) {
        Ok(t) => t,
        Err(e) => return usage(e),
    };
    let overrides = match parse_overrides(args.set) {
        Ok(o) => o,
        Err(e) => return usage(e),
    };
    let (nodes, gpus_per_node) = match cluster_shape(args.gpus, args.nodes) {
        Ok(shape) => shape,
        Err(e) => return usage(e),
    };
    let name = args.file.display().to_string();
    // The profile that prices the timeline, chosen for the spec's GPU as `check` chooses it.
    let through =
        parc_compiler::driver::CompileOptions::through(parc_compiler::driver::Stage::Timeline);
    let chosen = match crate::calibration::with_profile(
        args.calibration,
        &name,
        &text,
        &overrides,
        &through,
    ) {
        Ok((_, chosen)) => chosen,
        Err(e) => return usage(e),
    };
    let priced = match &chosen.file {
        Some(file) => format!("step times priced by the calibration profile {file}"),
        None => "step times priced by the GPU's peak numbers (no calibration profile for this \
                 GPU; `parc calibrate` makes one)"
            .to_string(),
    };
    let options = SearchOptions {
        nodes,
        gpus_per_node,
        top: args.top.max(1),
        lower_at_least: 8,
        lower_at_most: (3 * args.top).max(12),
        fusion: args.fusion,
        calibration: chosen.calibration,
    };
    let started = std::time::Instant::now();
    let tty = std::io::stderr().is_terminal();
    let progress = |p: Progress| {
        if tty && started.elapsed().as_secs_f64() > 1.0 {
            let (what, done, total) = match p {
                Progress::Checking { done, total } => ("checking", done, total),
                Progress::Lowering { done, total } => ("lowering", done, total),
            };
            eprint!("\rsearching: {what} {done}/{total} plans   ");
        }
    };
    let outcome = search::search(&name, &text, &overrides, &options, &progress);
    if tty && started.elapsed().as_secs_f64() > 1.0 {
        eprint!("\r{:60}\r", "");
    }
    match outcome {
        Ok(outcome) => {
            print!("{}", render(&outcome, started.elapsed().as_secs_f64()));
            println!("({priced})");
            u8::from(outcome.ranked.is_empty())
        }
        Err(compiled) => {
            let color = diagnostics::stderr_color();
            for d in &compiled.diagnostics.items {
                eprint!("{}", diagnostics::render(&compiled.sources, d, color));
            }
            1
        }
    }
}

/// `(nodes, gpus per node)` overrides from `--gpus N` and `--nodes K`.
fn cluster_shape(
    gpus: Option<u32>,
    nodes: Option<u32>,
) -> Result<(Option<u32>, Option<u32>), String> {
    match (gpus, nodes) {
        (Some(0), _) | (_, Some(0)) => Err("--gpus and --nodes must be at least 1".to_string()),
        (Some(n), Some(k)) if !n.is_multiple_of(k) => Err(format!(
            "--gpus {n} does not split evenly over --nodes {k}: give a multiple of {k}"
        )),
        (Some(n), Some(k)) => Ok((Some(k), Some(n / k))),
        // `--gpus N` alone: N GPUs on one node.
        (Some(n), None) => Ok((Some(1), Some(n))),
        (None, k) => Ok((k, None)),
    }
}

fn render(outcome: &Outcome, seconds: f64) -> String {
    let mut out = String::new();
    let fit = outcome.ranked.len();
    let _ = writeln!(
        out,
        "searched {} plans on {} GPUs ({} each) in {:.1} s: {} estimated to fit loosely, {} lowered, {} shown",
        outcome.candidates,
        outcome.gpus,
        bytes(outcome.gpu_memory_bytes as f64),
        seconds,
        outcome.considered,
        outcome.lowered,
        fit
    );
    if fit > 0 {
        out.push_str(&ranking(&outcome.ranked));
    }
    out.push_str(&rejections(outcome));
    if let Some(best) = outcome.ranked.first() {
        out.push_str(&winner(&best.candidate));
    } else {
        out.push_str(&no_fit(outcome));
    }
    out
}

fn ranking(ranked: &[Ranked]) -> String {
    let mut out =
        String::from("\n #  step      tokens/s  MFU   memory/GPU  bubble  exposed  plan\n");
    for (i, r) in ranked.iter().enumerate() {
        let memory = r.memory.iter().map(|(_, b)| *b).max().unwrap_or(0);
        let _ = writeln!(
            out,
            "{:>2}  {:<8}  {:>8}  {:>3.0}%  {:>10}  {:>5.1}%  {:>6.1}%  {}",
            i + 1,
            format!("{:.3} s", r.step_seconds),
            format!("{:.1}k", r.tokens_per_second / 1e3),
            r.mfu * 100.0,
            bytes(memory as f64),
            r.bubble_fraction * 100.0,
            r.exposed_comm_fraction * 100.0,
            r.candidate.describe()
        );
    }
    out.push_str(
        "(step, bubble and exposed communication from the simulated timeline; memory per GPU \
         from the lowered plan, the largest over its programs)\n",
    );
    out
}

fn rejections(outcome: &Outcome) -> String {
    let mut out = String::from("\nrejected:\n");
    for r in &outcome.rejected {
        let _ = writeln!(out, "  {:>7}  {}", r.count, r.rule);
    }
    out
}

fn winner(best: &Candidate) -> String {
    let flags: Vec<String> = best
        .settings()
        .iter()
        .map(|(p, v)| format!("--set {p}={v}"))
        .collect();
    let mut out = format!("\nthe fastest as flags:\n  {}\n", flags.join(" "));
    let _ = writeln!(out, "\nas sections to paste:\n{}", sections(best));
    out
}

/// The candidate's `parallel` section and the `train` line it changes.
fn sections(c: &Candidate) -> String {
    let balance = if c.pp > 1 && c.balance == Balance::Auto {
        ", balance: auto"
    } else {
        ""
    };
    let pipeline = match c.schedule {
        PipelineSchedule::Interleaved { virtual_stages } => format!(
            "interleaved {{ microbatches: {}, virtual: {virtual_stages}{balance} }}",
            c.microbatches
        ),
        PipelineSchedule::Gpipe => format!("gpipe {{ microbatches: {}{balance} }}", c.microbatches),
        PipelineSchedule::OneFOneB => {
            format!("1f1b {{ microbatches: {}{balance} }}", c.microbatches)
        }
    };
    let settings = c.settings();
    let get = |path: &str| {
        settings
            .iter()
            .find(|(p, _)| p == path)
            .map_or(String::new(), |(_, v)| v.clone())
    };
    format!(
        "parallel {{\n  mesh = {{ dp: {}, pp: {}, cp: {}, tp: {} }}\n  zero = {}\n  pipeline = {pipeline}\n  recompute = {}\n  sequence_parallel = {}\n}}\nand in `train`: micro_batch = {}\n",
        c.dp,
        c.pp,
        c.cp,
        c.tp,
        c.zero.level(),
        get("parallel.recompute"),
        c.tp > 1,
        c.micro_batch
    )
}

/// Why nothing fits: the rule that rejected the most, and the plan closest to fitting.
fn no_fit(outcome: &Outcome) -> String {
    let mut out = String::from("\nno plan fits");
    if let Some(most) = outcome.rejected.first() {
        let _ = write!(
            out,
            ": most were rejected by `{}` ({})",
            most.rule, most.count
        );
    }
    out.push('\n');
    let closest = outcome
        .rejected
        .iter()
        .filter_map(|r| r.closest.as_ref())
        .min_by_key(|(_, need)| *need);
    if let Some((c, need)) = closest {
        let _ = writeln!(
            out,
            "closest to fitting: {} needs {} per GPU, {} over the GPU's {}; use more GPUs \
             (--gpus), a larger GPU (--set cluster.gpu=…) or a smaller global batch",
            c.describe(),
            bytes(*need as f64),
            bytes(need.saturating_sub(outcome.gpu_memory_bytes) as f64),
            bytes(outcome.gpu_memory_bytes as f64)
        );
    }
    out
}
