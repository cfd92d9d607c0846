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
//! - `--search`: search the plans instead (`cmd_search`).
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
    /// Search the plans of the spec's model and recipe instead: every dp × pp × cp × tp, ZeRO
    /// stage, schedule, micro batch and recompute that fits, fastest first.
    #[arg(long)]
    pub search: bool,
    /// With --search: this many GPUs (on one node unless --nodes says how many).
    #[arg(long, value_name = "N", requires = "search")]
    pub gpus: Option<u32>,
    /// With --search: over this many nodes.
    #[arg(long, value_name = "K", requires = "search")]
    pub nodes: Option<u32>,
    /// With --search: how many plans to show.
    #[arg(long, value_name = "K", default_value_t = 5)]
    pub top: usize,
    #[command(flatten)]
    pub calibration: crate::calibration::CalibrationArgs,
}

/// A plan that went through the stages `--emit` needs (the timeline only for text and trace).
struct Planned {
    spec: Spec,
    /// Each linear layer's precision under `train.fp8`, as the plan was lowered with.
    fp8: Vec<parc_compiler::fp8::Choice>,
    plan: Plan,
    verified: VerifyReport,
    memory: MemoryPlans,
    timeline: Option<Timeline>,
    /// With `--rank R`: R's exact program, shown instead of its class's.
    view: Option<View>,
    /// The compile found errors after lowering (E0701: a program does not fit its GPU): the
    /// plan is still written, for a look at where its memory goes, but the exit code is 1, as
    /// `parc check`'s.
    errors: bool,
}

/// One rank's exact program as a plan of its own, with the id and memory plan it has in the
/// full plan.
struct View {
    first_id: u32,
    plan: Plan,
    memory: Option<PlanSummary>,
}

pub fn main(args: PlanArgs) -> u8 {
    if args.search {
        return crate::cmd_search::main(crate::cmd_search::SearchArgs {
            file: &args.file,
            set: &args.spec.set,
            fusion: args.spec.fusion(),
            gpus: args.gpus,
            nodes: args.nodes,
            top: args.top,
            calibration: &args.calibration,
        });
    }
    let planned = match compile(&args) {
        Ok(planned) => planned,
        Err(code) => return code,
    };
    let mut planned = planned;
    let only = match selected_program(&planned.plan, args.rank) {
        Ok(only) => only,
        Err(message) => {
            eprintln!("error: {message}");
            return 2;
        }
    };
    if let (Some(rank), Some(class)) = (args.rank, only) {
        if let Err(code) = show_exact_program(&mut planned, &args, rank, class) {
            return code;
        }
    }
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let written = write_plan(&mut out, &planned, args.emit);
    match written.and_then(|()| out.flush()) {
        Ok(()) if planned.errors => {
            eprintln!(
                "error: {} has errors (above); its plan is written for a look, not to run",
                args.file.display()
            );
            1
        }
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
    // With `--rank`, the plan is analysed one program per class of ranks (as `check` does) and
    // only the rank's own program is lowered exactly (`show_exact_program`).
    let options = CompileOptions {
        fusion: args.spec.fusion(),
        representatives: args.rank.is_some(),
        trace: args.emit == Emit::Trace,
        ..CompileOptions::through(through)
    };
    let (options, chosen) =
        crate::calibration::with_profile(&args.calibration, &name, &text, &overrides, &options)
            .map_err(usage)?;
    let mut compiled = driver::compile(&name, text, &overrides, &options);
    eprint!("{}", render(&compiled.sources, &compiled.diagnostics));
    if let (Some(spec), Some(plan), Some(_)) =
        (&compiled.spec, &compiled.plan, &compiled.analysis.timeline)
    {
        let priced = crate::calibration::priced_by(&chosen, spec, plan);
        eprintln!("note: {}", priced.note);
    }
    let fp8 = std::mem::take(&mut compiled.fp8);
    let errors = compiled.diagnostics.has_errors();
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
        fp8,
        plan,
        verified,
        memory,
        timeline,
        view: None,
        errors,
    })
}

/// Lower rank `rank`'s exact program (the plan was lowered one program per class) and keep it
/// as the plan's view: a plan of that one program, run by the ranks of its role, numbered as in
/// the full plan, with its class's memory plan (equal to its own: the class invariant,
/// `tests/ir/classes.rs`).
fn show_exact_program(
    planned: &mut Planned,
    args: &PlanArgs,
    rank: u32,
    class: ProgramId,
) -> Result<(), u8> {
    let options = parc_compiler::lower::LowerOptions {
        fusion: args.spec.fusion(),
        ..parc_compiler::lower::LowerOptions::default()
    };
    let lowered = parc_compiler::lower::lower_rank(&planned.spec, options, rank, &planned.fp8);
    let program = lowered.map_err(|d| {
        for item in &d.items {
            eprintln!("error[{}]: {}", item.code, item.message);
        }
        1u8
    })?;
    let plan = &planned.plan;
    let mesh = &plan.mesh;
    let same_role = |r: u32| {
        program
            .coords
            .iter()
            .all(|&(axis, c)| mesh.coord(r, axis) == c)
    };
    let first_id = parc_compiler::lower::full_program_id(&planned.spec, rank).map_or(0, |id| id.0);
    let rank_program = (0..plan.world)
        .map(|r| ProgramId(if same_role(r) { 0 } else { u32::MAX }))
        .collect();
    let memory = planned.memory.programs.get(class.0 as usize).cloned();
    planned.view = Some(View {
        first_id,
        plan: Plan {
            programs: vec![program],
            rank_program,
            representative: false,
            ..plan.header()
        },
        memory,
    });
    Ok(())
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

fn write_plan(out: &mut impl std::io::Write, planned: &Planned, emit: Emit) -> std::io::Result<()> {
    let Planned {
        spec,
        plan,
        verified,
        memory,
        timeline,
        view,
        fp8,
        errors: _,
    } = planned;
    match (emit, timeline) {
        (Emit::Json, _) => match view {
            Some(view) => write_program_json(out, &view.plan.programs, view.memory.as_ref()),
            None => write_json(out, plan, &memory.programs),
        },
        (Emit::Text, Some(timeline)) => {
            let names: Vec<String> = spec.model.nodes.iter().map(|n| n.name.clone()).collect();
            let mut summary = crate::plan_summary::render(plan, verified, memory, timeline);
            if !fp8.is_empty() {
                for line in
                    crate::report::render_fp8(fp8, spec.train.fp8.as_ref().and_then(|f| f.history))
                        .lines()
                        .filter(|l| !l.is_empty())
                {
                    summary.push_str(&format!("# {line}\n"));
                }
            }
            let text = match view {
                Some(view) => PlanText::new(&view.plan).first_id(view.first_id),
                None => PlanText::new(plan),
            };
            write!(out, "{summary}{}", text.with_names(&names))
        }
        (Emit::Trace, Some(timeline)) => writeln!(out, "{}", timeline.to_chrome_trace()),
        (Emit::Text | Emit::Trace, None) => Err(std::io::Error::other(
            "the plan was not simulated (a bug in `parc plan`)",
        )),
    }
}

/// A view's one program as JSON with its memory plan.
fn write_program_json(
    out: &mut impl std::io::Write,
    programs: &[Program],
    memory_plan: Option<&PlanSummary>,
) -> std::io::Result<()> {
    let Some(program) = programs.first() else {
        return Err(std::io::Error::other(
            "no program to show (a bug in `parc plan`)",
        ));
    };
    serde_json::to_writer_pretty(
        &mut *out,
        &ProgramJson {
            program,
            memory_plan,
        },
    )
    .map_err(std::io::Error::from)
    .and_then(|()| writeln!(out))
}

/// The plan as JSON, with its memory plans.
fn write_json(
    out: &mut impl std::io::Write,
    plan: &Plan,
    memory: &[PlanSummary],
) -> std::io::Result<()> {
    serde_json::to_writer_pretty(
        &mut *out,
        &PlanJson {
            plan,
            memory_plans: memory,
        },
    )
    .map_err(std::io::Error::from)
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
