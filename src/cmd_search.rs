//! `parc plan --search FILE [--gpus N] [--nodes K] [--top K]`: search the spec's plans on its
//! cluster (or N GPUs over K nodes) with `parc_compiler::search` and print the fastest that
//! fit: tokens/s, MFU, memory per GPU, bubble and exposed communication, how many plans each
//! rule rejected, and the winner as `--set` flags and as a `parallel` section to paste; with
//! none that fits, why (the rule that rejected the most, the least a plan needs against the
//! GPU's memory) and what to change (the nearest GPU counts where one fits, a larger GPU). A
//! spec whose own plan fails is searched on its own cluster all the same (the report's first
//! line says why its plan was not the start). A progress line on a terminal when the search
//! takes over a second.
//!
//! Exit codes: 0 a plan fits, 1 the spec fails or no plan fits, 2 usage or unreadable input.

use crate::diagnostics;
use crate::input::{parse_overrides, read_spec};
use crate::report::bytes;
use parc_compiler::search::{self, Candidate, Outcome, Progress, Ranked, Rejection, SearchOptions};
use parc_compiler::spec::{Balance, PipelineSchedule};
use std::fmt::Write as _;
use std::io::IsTerminal as _;

/// Instructions the search lowers before it stops going on for merely promising candidates
/// (`SearchOptions::lower_work`): about eight sampled lowerings of the 70B/64-GPU example,
/// which the 2-core dev box does in under 10 s; a few hundred of a 7B model's.
const LOWER_WORK: u64 = 8_000_000;

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
    let mut options = SearchOptions {
        nodes,
        gpus_per_node,
        top: args.top.max(1),
        lower_at_least: 8,
        lower_at_most: (3 * args.top).max(12),
        extend_at_most: (16 * args.top).max(64),
        lower_work: LOWER_WORK,
        fusion: args.fusion,
        calibration: None,
        refuse: None,
    };
    let base = match search::prepare(&name, &text, &overrides, &options) {
        Ok(base) => base,
        Err(compiled) => {
            let color = diagnostics::stderr_color();
            for d in &compiled.diagnostics.items {
                eprint!("{}", diagnostics::render(&compiled.sources, d, color));
            }
            return 1;
        }
    };
    // The profile that prices the timeline, chosen for the searched spec's GPU as `check`
    // chooses it (from the base: the spec's own plan may not check).
    let chosen = match crate::calibration::choose(args.calibration, &base.spec) {
        Ok(chosen) => chosen,
        Err(e) => return usage(e),
    };
    let gpu = &base.spec.cluster.gpu.name;
    let priced = match (&chosen.file, &chosen.passed_over) {
        (Some(file), _) => format!("step times priced by the calibration profile {file}"),
        (None, Some(why)) => format!("step times priced by the GPU's peak numbers: {why}"),
        (None, None) => format!(
            "step times priced by the GPU's peak numbers: no calibration profile for {gpu} \
             (`parc calibrate` makes one)"
        ),
    };
    options.calibration = chosen.calibration;
    // On a GPU cluster the plans `parc run --backend cuda` refuses are not recommended.
    if crate::cuda_support::applies(&base.spec) {
        options.refuse = Some(crate::cuda_support::refusal);
    }
    let started = std::time::Instant::now();
    let tty = std::io::stderr().is_terminal();
    let progress = |p: Progress| {
        if tty && started.elapsed().as_secs_f64() > 1.0 {
            let (what, done, total) = match p {
                Progress::Checking { done, total } => ("estimating", done, total),
                Progress::Lowering { done, total } => ("lowering", done, total),
            };
            eprint!("\rsearching: {what} {done}/{total} plans   ");
        }
    };
    let outcome = search::search_from(&base, &name, &text, &overrides, &options, &progress);
    if tty && started.elapsed().as_secs_f64() > 1.0 {
        eprint!("\r{:60}\r", "");
    }
    // Searched on the spec's own cluster although its own plan fails: say why its plan is not
    // the starting point. (On a cluster given by --gpus/--nodes its plan is expected not to fit.)
    if let (Some(why), None, None) = (&base.own_plan, nodes, gpus_per_node) {
        println!("the spec's own plan does not check ({why}); searching its model and recipe on its cluster instead");
    }
    print!("{}", render(&outcome, started.elapsed().as_secs_f64()));
    if !outcome.ranked.is_empty() {
        println!("({priced})");
    }
    u8::from(outcome.ranked.is_empty())
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
    let shown = if fit > 0 {
        format!("{fit} shown")
    } else {
        "none fits".to_string()
    };
    let _ = writeln!(
        out,
        "searched {} plans on {} in {:.1} s: {} past the arithmetic rules, {} estimated to fit \
         loosely, {} lowered, {shown}",
        outcome.plans,
        cluster(outcome),
        seconds,
        outcome.candidates,
        outcome.considered,
        outcome.lowered,
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

/// `64 GPUs (8 nodes × 8, 79.2 GiB each)`, `1 GPU (79.2 GiB)`.
fn cluster(outcome: &Outcome) -> String {
    let memory = bytes(outcome.gpu_memory_bytes as f64);
    match (outcome.gpus, outcome.nodes) {
        (1, _) => format!("1 GPU ({memory})"),
        (g, 1) => format!("{g} GPUs ({memory} each)"),
        (g, n) => format!(
            "{g} GPUs ({n} nodes × {}, {memory} each)",
            outcome.gpus_per_node
        ),
    }
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
    if let Some((m1, m2)) = ranked.first().and_then(|r| r.sampled) {
        let _ = writeln!(
            out,
            "(#1 extrapolated from its plan at {m1} and {m2} microbatches, as the others are: \
             lowering it whole was past the search's work; `parc check` with its flags gives its \
             whole numbers)"
        );
    }
    out
}

fn rejections(outcome: &Outcome) -> String {
    if outcome.rejected.is_empty() {
        return String::new();
    }
    let mut out = String::from("\nrejected:\n");
    for r in &outcome.rejected {
        let _ = writeln!(out, "  {:>7}  {}", r.count, rule(r));
    }
    out
}

/// A rule as shown: its words, or a code with its first message.
fn rule(r: &Rejection) -> String {
    match &r.example {
        Some(message) => format!("{}, e.g. {message}", r.rule),
        None => r.rule.clone(),
    }
}

fn winner(best: &Candidate) -> String {
    let flags: Vec<String> = best
        .settings()
        .iter()
        .map(|(p, v)| format!("--set {}", shell_word(&format!("{p}={v}"))))
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

/// `word` as one shell word: quoted when it holds anything but letters, digits and `._=-+/:`
/// (a mesh record's braces, commas and spaces).
fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "._=-+/:".contains(c);
    if word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// Why nothing fits and what to change: the rule that rejected the most plans and how many;
/// for memory, the least any plan needs against the GPU's and whether the closest plan already
/// uses every way the search has to save memory; then the nearest clusters where the formulas
/// put a plan under the GPU's memory, and GPUs with enough of it.
fn no_fit(outcome: &Outcome) -> String {
    let gpus = match outcome.gpus {
        1 => "1 GPU".to_string(),
        g => format!("{g} GPUs"),
    };
    let mut out = format!("\nno plan fits on {gpus}: ");
    // The verdicts on plans that could be (the checker's, memory's) before the arithmetic's on
    // plans that cannot: a tp over nodes says less about why nothing fits than memory does.
    let judged = |r: &&Rejection| !r.arithmetic && r.rule != search::UNTRIED_RULE;
    let most = match outcome.rejected.iter().find(judged) {
        Some(most) => {
            let _ = write!(
                out,
                "of the {} plans the arithmetic rules allow, `{}` rejected the most, {}",
                outcome.candidates,
                rule(most),
                most.count
            );
            Some(most)
        }
        None => {
            let _ = write!(
                out,
                "the arithmetic rules allow none of its {} plans",
                outcome.plans
            );
            let most = outcome.rejected.first();
            if let Some(most) = most {
                let _ = write!(out, "; `{}` rejected the most, {}", rule(most), most.count);
            }
            most
        }
    };
    if let Some(most) = most.filter(|m| m.is_memory()) {
        let memory: u64 = (outcome.rejected.iter())
            .filter(|r| r.is_memory())
            .map(|r| r.count)
            .sum();
        if memory > most.count {
            let _ = write!(out, " ({memory} over the GPU's memory in all)");
        }
    }
    out.push('\n');
    out.push_str(&refused_line(outcome));
    let capacity = outcome.gpu_memory_bytes;
    // The lowered plans' need when any was lowered (the verdict), else the formulas' (low).
    let closest = |rule: &str| {
        (outcome.rejected.iter())
            .find(|r| r.rule == rule)
            .and_then(|r| r.closest.as_ref())
    };
    let best = match (closest(search::MEMORY_RULE), closest(search::FORMULA_RULE)) {
        (Some((c, need)), _) => Some((c, *need, true)),
        (None, Some((c, need))) => Some((c, *need, false)),
        (None, None) => None,
    };
    if let Some((c, need, lowered)) = best {
        let how = if lowered {
            "its lowered plan"
        } else {
            "by the cost formulas, which err low"
        };
        let _ = writeln!(
            out,
            "memory: a plan needs {} per GPU at best ({how}), the GPU has {}: {}",
            bytes(need as f64),
            bytes(capacity as f64),
            c.describe()
        );
        if let Some(all) = every_saving(c) {
            let _ = writeln!(out, "it already {all}");
        }
    }
    out.push_str(&what_to_change(
        outcome,
        best.map(|(_, need, lowered)| (need, lowered)),
    ));
    out
}

/// With no plan that fits, the lowered plans the backend refused, which the rule that rejected
/// the most may not name: how many of those lowered, and why.
fn refused_line(outcome: &Outcome) -> String {
    let refused = (outcome.rejected.iter()).find(|r| r.rule == search::BACKEND_RULE);
    let Some(refused) = refused else {
        return String::new();
    };
    let why = refused.example.as_deref().unwrap_or("");
    format!(
        "`parc run --backend cuda` does not run {} of the {} plans lowered: {why}\n",
        refused.count, outcome.lowered
    )
}

/// The ways to save memory the candidate already takes, when it takes them all: recompute
/// full, micro batch 1, ZeRO-3 (or nothing for ZeRO to shard over).
fn every_saving(c: &Candidate) -> Option<String> {
    let full = c.recompute == parc_compiler::spec::Recompute::Full;
    let sharded = c.zero == parc_compiler::spec::ZeroStage::Zero3;
    let unshardable = c.dp * c.cp == 1;
    if !full || c.micro_batch != 1 || !(sharded || unshardable) {
        return None;
    }
    let zero = if sharded {
        "shards its weights, gradients and optimizer states with ZeRO-3"
    } else {
        "has no dp or cp ranks for ZeRO to shard over"
    };
    Some(format!(
        "recomputes every layer, runs micro batches of 1 and {zero}"
    ))
}

/// What to change when no cluster of the GPU fits a plan. The search keeps the global batch,
/// and a small one caps the GPUs a plan spreads over: dp × pp is at most the global batch
/// (each dp rank runs at least pp microbatches of one sequence or more) and tp × cp stay
/// inside a node, so Llama 3.1 405B at `global_batch = 8` fits no cluster while at 16 it does.
fn no_cluster_fits(outcome: &Outcome) -> String {
    const MOST: u64 = 65_536;
    let batch = outcome.global_batch;
    let node = u64::from(outcome.gpus_per_node.max(8));
    if batch.saturating_mul(node) >= MOST {
        return "no cluster of this GPU up to 65,536 GPUs has a plan the cost formulas fit: a \
                smaller model or a shorter sequence"
            .to_string();
    }
    format!(
        "no cluster of this GPU up to 65,536 GPUs has a plan the cost formulas fit at \
         global_batch = {batch}, which caps dp × pp at {batch} (each dp rank runs at least pp \
         microbatches), so a plan spans at most about {} GPUs (tp × cp inside a node of {node}): a \
         larger global_batch (`--set train.global_batch=…`) lets the model spread over more \
         GPUs; or a smaller model or a shorter sequence",
        batch * node
    )
}

/// The line that says what to change: the nearest GPU counts where the formulas fit a plan,
/// and the GPUs parc knows with more memory than `need` (the least a plan needs, when known,
/// and whether a lowered plan measured it rather than the formulas).
fn what_to_change(outcome: &Outcome, need: Option<(u64, bool)>) -> String {
    let flags = |(n, g): (u32, u32)| match n {
        1 => format!("--gpus {g}"),
        n => format!("--gpus {} --nodes {n}", n * g),
    };
    let gpus = |(n, g): (u32, u32)| n * g;
    let counts: Vec<String> = [outcome.fits_on.fewer, outcome.fits_on.more]
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, s)| {
            let unit = if i == 0 { " GPUs" } else { "" };
            format!("{}{unit} ({})", gpus(s), flags(s))
        })
        .collect();
    let mut ways = Vec::new();
    if counts.is_empty() {
        ways.push(no_cluster_fits(outcome));
    } else {
        ways.push(format!(
            "by the cost formulas a plan fits on {}; search there to be sure",
            counts.join(" or ")
        ));
    }
    if let Some((need, lowered)) = need {
        // The formulas err low: ask for as much more as the lowered plans ran over them.
        let want = if lowered {
            need
        } else {
            (need as f64 * outcome.underestimate) as u64
        };
        let mut larger: Vec<(u64, &str)> = (parc_compiler::check::GPU_NAMES.iter())
            .filter(|n| **n != "cpu")
            .filter_map(|n| parc_compiler::check::gpu_named(n).map(|g| (g.memory_bytes, *n)))
            .filter(|(m, _)| *m >= want && *m > outcome.gpu_memory_bytes)
            .collect();
        larger.sort_unstable();
        if let Some((memory, name)) = larger.first() {
            ways.push(format!(
                "a GPU with more memory: {name}, {} (--set cluster.gpu={name})",
                bytes(*memory as f64)
            ));
        }
    }
    let untried = (outcome.rejected.iter())
        .find(|r| r.rule == search::UNTRIED_RULE)
        .map_or(0, |r| r.count);
    if untried > 0 {
        // `--top K` lowers up to 3K candidates.
        let top = (outcome.lowered as u64 + untried).div_ceil(3);
        ways.push(format!(
            "lower the {untried} candidates the formulas put within the GPU's memory that the \
             search did not reach: --top {top}"
        ));
    }
    format!("to fit: {}\n", ways.join("; or "))
}
