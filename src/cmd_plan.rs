//! `parc plan FILE [--set PATH=VALUE]... [--rank R] [--emit text|json|trace]`: check the spec,
//! lower it to per-rank programs, verify them and print them.
//!
//! - `text` (default): a summary (programs, instructions, verified peak memory and the memory
//!   plan's arena per program, simulated step time and bubble, the predicted memory per GPU on
//!   the CUDA backend) then the plan's stable text form; with `--rank R` only rank R's program.
//! - `json`: the plan as JSON with its memory plans (`memory_plans`, one per program); with
//!   `--rank R`, that rank's program only, with its `memory_plan`.
//! - `trace`: the simulated timeline as Chrome trace-event JSON (open it in Perfetto).
//!
//! Exit codes: 0 success, 1 the spec, lowering or verification failed, 2 usage or unreadable
//! input.

use crate::cmd_check::{parse_overrides, read_spec};
use crate::diagnostics;
use crate::SpecArgs;
use parc_compiler::diag::{Diagnostics, Sources};
use parc_compiler::ir::text::PlanText;
use parc_compiler::ir::{Plan, Program};
use parc_compiler::memplan::PlanSummary;
use std::fmt::Write as _;
use std::io::Write as _;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emit {
    Text,
    Json,
    Trace,
}

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The .par file.
    pub file: std::path::PathBuf,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Show only this global rank's program.
    #[arg(long, value_name = "R")]
    pub rank: Option<u32>,
    /// What to print.
    #[arg(long, value_enum, default_value = "text")]
    pub emit: Emit,
}

pub fn main(args: PlanArgs) -> u8 {
    let text = match read_spec(&args.file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let overrides = match parse_overrides(&args.spec.set) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let mut sources = Sources::default();
    let main_file = sources.add(args.file.display().to_string(), text);
    let (spec, diags) = parc_compiler::check(&mut sources, main_file, &overrides);
    eprint!("{}", render(&sources, &diags));
    let Some(spec) = spec else {
        return 1;
    };
    let plan = match parc_compiler::lower::lower(&spec) {
        Ok(p) => p,
        Err(d) => {
            eprint!("{}", render(&sources, &d));
            return 1;
        }
    };
    let report = match parc_compiler::verify::verify_spec(&plan, &spec) {
        Ok(r) => r,
        Err(d) => {
            eprint!("{}", render(&sources, &d));
            return 1;
        }
    };
    let memory = match memory_plans(&plan, &report) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    let only = match args.rank {
        None => None,
        Some(r) => match plan.rank_program.get(r as usize) {
            Some(p) => Some(*p),
            None => {
                eprintln!(
                    "error: --rank {r} is outside the plan's {} ranks (0..{})",
                    plan.world,
                    plan.world.saturating_sub(1)
                );
                return 2;
            }
        },
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let written = match args.emit {
        Emit::Text => {
            let names: Vec<String> = spec.model.nodes.iter().map(|n| n.name.clone()).collect();
            let mut text = PlanText::new(&plan).with_names(&names);
            if let Some(p) = only {
                text = text.only(p);
            }
            let timeline = parc_compiler::timeline::simulate(&plan, &spec);
            let half = spec.train.precision != parc_compiler::spec::Precision::Fp32;
            let device = parc_compiler::memplan::device_memory(&plan, &memory, half);
            let roles: Vec<String> = plan.programs.iter().map(|p| p.role.clone()).collect();
            write!(
                out,
                "{}{}{text}",
                summary(&plan, &report, &memory, &timeline),
                crate::report::render_device_memory(&roles, &device)
            )
        }
        Emit::Json => {
            let json = match only.and_then(|p| Some((p, plan.programs.get(p.0 as usize)?))) {
                Some((id, program)) => serde_json::to_writer_pretty(
                    &mut out,
                    &ProgramJson {
                        program,
                        memory_plan: memory.get(id.0 as usize),
                    },
                ),
                None => serde_json::to_writer_pretty(
                    &mut out,
                    &PlanJson {
                        plan: &plan,
                        memory_plans: &memory,
                    },
                ),
            };
            json.map_err(std::io::Error::from)
                .and_then(|()| writeln!(out))
        }
        Emit::Trace => {
            let timeline = parc_compiler::timeline::simulate(&plan, &spec);
            writeln!(out, "{}", timeline.to_chrome_trace())
        }
    };
    match written.and_then(|()| out.flush()) {
        Ok(()) => 0,
        // The reader went away (`parc plan … | head`): not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => 0,
        Err(e) => {
            eprintln!("error: cannot write the plan: {e}");
            1
        }
    }
}

/// The plan as JSON: its fields, then each program's memory plan.
#[derive(serde::Serialize)]
struct PlanJson<'a> {
    #[serde(flatten)]
    plan: &'a Plan,
    memory_plans: &'a [PlanSummary],
}

/// One program as JSON: its fields, then its memory plan.
#[derive(serde::Serialize)]
struct ProgramJson<'a> {
    #[serde(flatten)]
    program: &'a Program,
    memory_plan: Option<&'a PlanSummary>,
}

/// Plan every program's memory (`parc_compiler::memplan`) and compare it with the verified
/// liveness peaks.
pub(crate) fn memory_plans(
    plan: &Plan,
    report: &parc_compiler::verify::VerifyReport,
) -> Result<Vec<PlanSummary>, parc_compiler::memplan::MemPlanError> {
    let layouts = parc_compiler::memplan::plan_all(plan)?;
    Ok(parc_compiler::memplan::summarize(&layouts, report))
}

/// Per-program verified memory and memory plan, and the simulated step.
pub(crate) fn summary(
    plan: &Plan,
    report: &parc_compiler::verify::VerifyReport,
    memory: &[PlanSummary],
    t: &parc_compiler::timeline::Timeline,
) -> String {
    let instrs: usize = plan.programs.iter().map(|p| p.instrs.len()).sum();
    let mut out = format!(
        "# {} ranks, {} programs, {instrs} instructions; verified ({} ranks simulated)\n",
        plan.world,
        plan.programs.len(),
        report.ranks_simulated
    );
    for m in &report.programs {
        let _ = writeln!(
            out,
            "# program {} ({}): peak {} = {} persistent + {} transient, {} microbatches in flight",
            m.program.0,
            m.role,
            crate::report::bytes(m.peak_bytes as f64),
            crate::report::bytes(m.persistent_bytes as f64),
            crate::report::bytes(m.peak_transient_bytes as f64),
            m.peak_microbatches_in_flight
        );
        if let Some(p) = memory.get(m.program.0 as usize) {
            let _ = writeln!(
                out,
                "#   memory plan: arena {} (liveness peak {}, {:+.1}%), {} of {} allocations \
                 need zeroing",
                crate::report::bytes(p.arena_bytes as f64),
                crate::report::bytes(p.liveness_peak_bytes as f64),
                p.overhead * 100.0,
                p.zeroed_allocs,
                p.allocs
            );
            let o = &p.comm_overlap;
            if o.collectives > 0 {
                let _ = writeln!(
                    out,
                    "#   collective overlap: {} collectives, {} waited for by the next \
                     instruction, {} waiting instruction(s), median run-ahead {} instructions",
                    o.collectives,
                    o.waited_at_once,
                    o.waiting_instructions,
                    o.median_run_ahead()
                );
            }
        }
    }
    let _ = writeln!(
        out,
        "# simulated step {:.3} s, bubble {:.1}%, exposed communication {:.1}%",
        t.step_seconds,
        t.bubble_fraction * 100.0,
        t.exposed_comm_fraction * 100.0
    );
    out
}

fn render(sources: &Sources, diags: &Diagnostics) -> String {
    let color = diagnostics::stderr_color();
    diags
        .items
        .iter()
        .map(|d| diagnostics::render(sources, d, color))
        .collect()
}
