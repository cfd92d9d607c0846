//! `parc check FILE... [--set PATH=VALUE]... [--format human|json] [--lower always|never]`:
//! parse and check specs, lower each plan (one program per class of tp/cp ranks), verify it,
//! plan its memory and simulate it, then show the cost model's report with the lowered plan's
//! memory per GPU, which is the memory verdict (E0701, `parc_compiler::fit`). `--lower never`
//! stops after the cost formulas, whose memory table and E0701 are then labelled as estimates.
//! Exit 0 when every file is clean (warnings allowed), 1 when any has an error, 2 for usage
//! errors and unreadable files.

use crate::diagnostics;
use crate::input::{parse_overrides, read_spec};
use crate::SpecArgs;
use parc_compiler::cost;
use parc_compiler::diag::{Diagnostics, Sources};
use parc_compiler::driver::{self, Analysis, CompileOptions, Compiled, Stage};
use parc_compiler::ir::Plan;
use parc_compiler::timeline::Timeline;
use parc_compiler::verify::VerifyReport;
use parc_compiler::Override;
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Human,
    Json,
}

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The .par files to check.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Output format: `human` (diagnostics on stderr, report on stdout) or `json` (one document
    /// on stdout; schema in docs/check-json.md).
    #[arg(long, value_enum, default_value = "human")]
    pub format: Format,
    /// Lower, verify, memory-plan and simulate the plan (`always`), or stop after the cost
    /// formulas for a quick estimate (`never`).
    #[arg(long, value_enum, default_value = "always")]
    pub lower: LowerWhen,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LowerWhen {
    Always,
    Never,
}

impl LowerWhen {
    /// The stages `check` runs: always the cost model, the rest as `--lower` says.
    fn options(self, fusion: bool) -> CompileOptions {
        CompileOptions {
            fusion,
            through: match self {
                LowerWhen::Never => Stage::Check,
                LowerWhen::Always => Stage::Timeline,
            },
            cost_model: true,
            max_plan_size: None,
            representatives: true,
        }
    }
}

struct Checked {
    file: String,
    sources: Sources,
    diags: Diagnostics,
    report: Option<cost::CostReport>,
    lowered: Option<Lowered>,
}

/// What lowering, verifying and simulating the plan measured.
#[derive(serde::Serialize)]
struct Lowered {
    /// The verifier's liveness analysis (buffers counted as the backends store them: f32).
    verified: VerifyReport,
    /// Each program's memory plan beside its liveness peak.
    memory_plans: Vec<parc_compiler::memplan::PlanSummary>,
    /// Each program's predicted memory per GPU on the CUDA backend: the plan, the backend's
    /// scratch and casts, the CUDA context and NCCL.
    device_memory: Vec<parc_compiler::memplan::DeviceMemory>,
    step_seconds: f64,
    bubble_fraction: f64,
    exposed_comm_fraction: f64,
    /// Each program's memory per GPU by term: what the memory verdict (E0701) judges.
    memory_per_gpu: Vec<parc_compiler::fit::Need>,
    /// The simulated share of the step the report rank (a pipeline's last stage) waits: idle
    /// plus exposed communication (what `parc run --profile` measures there as p2p time).
    report_rank_stall_fraction: Option<f64>,
    #[serde(skip)]
    summary: String,
}

/// The measurements of a plan that went through every stage; `None` when a stage did not run
/// or failed.
fn lowered(plan: Option<Plan>, analysis: Analysis) -> Option<Lowered> {
    let plan = plan?;
    let Analysis {
        verified: Some(verified),
        memory: Some(memory),
        timeline: Some(timeline),
        fit: Some(memory_per_gpu),
    } = analysis
    else {
        return None;
    };
    Some(Lowered {
        summary: crate::plan_summary::render(&plan, &verified, &memory, &timeline),
        report_rank_stall_fraction: report_rank_stall_fraction(&plan, &timeline),
        verified,
        memory_plans: memory.programs,
        device_memory: memory.device,
        memory_per_gpu,
        step_seconds: timeline.step_seconds,
        bubble_fraction: timeline.bubble_fraction,
        exposed_comm_fraction: timeline.exposed_comm_fraction,
    })
}

/// The simulated share of the step the report rank waits: idle plus exposed communication.
fn report_rank_stall_fraction(plan: &Plan, timeline: &Timeline) -> Option<f64> {
    let report_program = plan.rank_program.get(plan.report_rank as usize).copied();
    timeline
        .ranks
        .iter()
        .find(|r| Some(r.program) == report_program && timeline.step_seconds > 0.0)
        .map(|r| (r.idle_seconds + r.exposed_comm_seconds) / timeline.step_seconds)
}

fn check_one(
    path: &Path,
    text: String,
    overrides: &[Override],
    options: CompileOptions,
) -> Checked {
    let file = path.display().to_string();
    let Compiled {
        sources,
        diagnostics,
        cost,
        plan,
        analysis,
        ..
    } = driver::compile(&file, text, overrides, &options);
    Checked {
        file,
        sources,
        diags: diagnostics,
        report: cost,
        lowered: lowered(plan, analysis),
    }
}

pub fn main(args: CheckArgs) -> u8 {
    let overrides = match parse_overrides(&args.spec.set) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let options = args.lower.options(args.spec.fusion());
    let mut results = Vec::new();
    for path in &args.files {
        match read_spec(path) {
            Ok(text) => results.push(check_one(path, text, &overrides, options)),
            Err(e) => {
                eprintln!("error: {e}");
                return 2;
            }
        }
    }
    let failed = results.iter().any(|r| r.diags.has_errors());
    match args.format {
        Format::Human => human(&results),
        Format::Json => print_json(&results),
    }
    u8::from(failed)
}

fn human(results: &[Checked]) {
    let color = diagnostics::stderr_color();
    for r in results {
        for d in &r.diags.items {
            eprint!("{}", diagnostics::render(&r.sources, d, color));
            eprintln!();
        }
        let (e, w) = (r.diags.error_count(), r.diags.warning_count());
        let plural = |n: usize, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
        if e > 0 {
            eprintln!(
                "{}: {}, {}",
                r.file,
                plural(e, "error"),
                plural(w, "warning")
            );
        } else {
            if let Some(report) = &r.report {
                let needs = r.lowered.as_ref().map(|l| l.memory_per_gpu.as_slice());
                print!("{}", crate::report::render_human(report, needs));
            }
            if let Some(lowered) = &r.lowered {
                println!("\nlowered plan (verified; buffers at their stored sizes):");
                print!("{}", lowered.summary.replace("# ", "  "));
            }
            eprintln!("{}: ok, {}", r.file, plural(w, "warning"));
        }
    }
}

fn print_json(results: &[Checked]) {
    let files: Vec<serde_json::Value> = results
        .iter()
        .map(|r| {
            json!({
                "file": r.file,
                "ok": !r.diags.has_errors(),
                "errors": r.diags.error_count(),
                "warnings": r.diags.warning_count(),
                "diagnostics": r.diags.items.iter().map(|d| diagnostics::to_json(&r.sources, d)).collect::<Vec<_>>(),
                "report": r.report,
                "lowered": r.lowered,
            })
        })
        .collect();
    let doc = json!({ "version": 1, "files": files });
    match serde_json::to_string_pretty(&doc) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("error: cannot encode the JSON report: {e}"),
    }
}
