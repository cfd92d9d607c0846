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

use crate::diagnostics;
use crate::input::{parse_overrides, read_spec};
use crate::SpecArgs;
use parc_compiler::diag::{Diagnostics, Sources};
use parc_compiler::driver::{self, Analysis, CompileOptions, Compiled, MemoryPlans, Stage};
use parc_compiler::ir::text::PlanText;
use parc_compiler::ir::{Plan, Program, ProgramId};
use parc_compiler::memplan::PlanSummary;
use parc_compiler::spec::Spec;
use parc_compiler::timeline::Timeline;
use parc_compiler::verify::VerifyReport;
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

/// A plan that went through the stages `--emit` needs (the timeline only for text and trace).
struct Planned {
    spec: Spec,
    plan: Plan,
    verified: VerifyReport,
    memory: MemoryPlans,
    timeline: Option<Timeline>,
}

pub fn main(args: PlanArgs) -> u8 {
    let planned = match compile(&args) {
        Ok(planned) => planned,
        Err(code) => return code,
    };
    let only = match selected_program(&planned.plan, args.rank) {
        Ok(only) => only,
        Err(message) => {
            eprintln!("error: {message}");
            return 2;
        }
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let written = write_plan(&mut out, &planned, only, args.emit);
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

/// Read the spec and compile it through the stages `--emit` needs, every diagnostic on
/// stderr. `Err` is the exit code: 2 for unreadable input or a bad `--set`, 1 for a spec that
/// fails a stage.
fn compile(args: &PlanArgs) -> Result<Planned, u8> {
    let usage = |message: String| {
        eprintln!("error: {message}");
        2
    };
    let text = read_spec(&args.file).map_err(usage)?;
    let overrides = parse_overrides(&args.spec.set).map_err(usage)?;
    let through = match args.emit {
        Emit::Json => Stage::MemoryPlan,
        Emit::Text | Emit::Trace => Stage::Timeline,
    };
    let name = args.file.display().to_string();
    let options = CompileOptions {
        fusion: args.spec.fusion(),
        ..CompileOptions::through(through)
    };
    let compiled = driver::compile(&name, text, &overrides, &options);
    eprint!("{}", render(&compiled.sources, &compiled.diagnostics));
    let Compiled {
        spec: Some(spec),
        plan: Some(plan),
        analysis:
            Analysis {
                verified: Some(verified),
                memory: Some(memory),
                timeline,
                ..
            },
        ..
    } = compiled
    else {
        return Err(1);
    };
    Ok(Planned {
        spec,
        plan,
        verified,
        memory,
        timeline,
    })
}

/// The program `--rank R` selects (`None`: all of them); the error names the plan's ranks.
fn selected_program(plan: &Plan, rank: Option<u32>) -> Result<Option<ProgramId>, String> {
    let Some(r) = rank else {
        return Ok(None);
    };
    match plan.rank_program.get(r as usize) {
        Some(p) => Ok(Some(*p)),
        None => Err(format!(
            "--rank {r} is outside the plan's {} ranks (0..{})",
            plan.world,
            plan.world.saturating_sub(1)
        )),
    }
}

fn write_plan(
    out: &mut impl std::io::Write,
    planned: &Planned,
    only: Option<ProgramId>,
    emit: Emit,
) -> std::io::Result<()> {
    let Planned {
        spec,
        plan,
        verified,
        memory,
        timeline,
    } = planned;
    match (emit, timeline) {
        (Emit::Json, _) => write_json(out, plan, &memory.programs, only),
        (Emit::Text, Some(timeline)) => {
            let names: Vec<String> = spec.model.nodes.iter().map(|n| n.name.clone()).collect();
            let mut text = PlanText::new(plan).with_names(&names);
            if let Some(p) = only {
                text = text.only(p);
            }
            let summary = crate::plan_summary::render(plan, verified, memory, timeline);
            write!(out, "{summary}{text}")
        }
        (Emit::Trace, Some(timeline)) => writeln!(out, "{}", timeline.to_chrome_trace()),
        (Emit::Text | Emit::Trace, None) => Err(std::io::Error::other(
            "the plan was not simulated (a bug in `parc plan`)",
        )),
    }
}

/// The plan (or the `only` program) as JSON, with its memory plans.
fn write_json(
    out: &mut impl std::io::Write,
    plan: &Plan,
    memory: &[PlanSummary],
    only: Option<ProgramId>,
) -> std::io::Result<()> {
    let json = match only.and_then(|p| Some((p, plan.programs.get(p.0 as usize)?))) {
        Some((id, program)) => serde_json::to_writer_pretty(
            &mut *out,
            &ProgramJson {
                program,
                memory_plan: memory.get(id.0 as usize),
            },
        ),
        None => serde_json::to_writer_pretty(
            &mut *out,
            &PlanJson {
                plan,
                memory_plans: memory,
            },
        ),
    };
    json.map_err(std::io::Error::from)
        .and_then(|()| writeln!(out))
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

fn render(sources: &Sources, diags: &Diagnostics) -> String {
    let color = diagnostics::stderr_color();
    diags
        .items
        .iter()
        .map(|d| diagnostics::render(sources, d, color))
        .collect()
}
