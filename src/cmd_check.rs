//! `parc check FILE... [--set PATH=VALUE]... [--format human|json] [--lower always|never]`:
//! parse and check specs, lower each plan (one program per class of tp/cp ranks), verify it,
//! plan its memory and simulate it, then show the cost model's report with the lowered plan's
//! memory per GPU, which is the memory verdict (E0701, `parc_compiler::fit`). `--lower never`
//! stops after the cost formulas, whose memory table and E0701 are then labelled as estimates.
//! Exit 0 when every file is clean (warnings allowed), 1 when any has an error, 2 for usage
//! errors and unreadable files.

use crate::calibration::{self, CalibrationArgs, Chosen, PricedBy};
use crate::diagnostics;
use crate::input::{parse_overrides, read_spec};
use crate::resume_check;
use crate::SpecArgs;
use parc_compiler::cost;
use parc_compiler::diag::{Diagnostics, Sources};
use parc_compiler::driver::{self, Analysis, CompileOptions, Compiled, Stage};
use parc_compiler::ir::Plan;
use parc_compiler::spec::Spec;
use parc_compiler::timeline::Timeline;
use parc_compiler::verify::VerifyReport;
use parc_compiler::Override;
use parc_runtime::checkpoint::Consent;
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
    #[command(flatten)]
    pub calibration: CalibrationArgs,
    /// A checkpoint (a `step-N` folder or a checkpoint folder) to resume under this spec: shows
    /// what each rank of the plan reads from it, or refuses a change it cannot follow.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    #[command(flatten)]
    pub consent: crate::run_args::ConsentArgs,
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
            calibration: None,
            trace: false,
        }
    }
}

struct Checked {
    file: String,
    sources: Sources,
    diags: Diagnostics,
    report: Option<cost::CostReport>,
    lowered: Option<Lowered>,
    resume: Option<resume_check::Moves>,
    /// With `train.fp8`: each linear layer's precision and why.
    fp8: Vec<parc_compiler::fp8::Choice>,
    /// Delayed FP8 scaling's amax history length.
    fp8_history: Option<u32>,
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
    /// The simulated step, priced as `priced_by` says.
    step_seconds: f64,
    /// Tokens of the global batch over the step.
    tokens_per_second: f64,
    /// Model FLOPs (no recompute) over the step times every GPU's peak.
    mfu: f64,
    priced_by: PricedBy,
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
fn lowered(
    spec: Option<&Spec>,
    plan: Option<Plan>,
    analysis: Analysis,
    chosen: &Chosen,
) -> Option<Lowered> {
    let (spec, plan) = (spec?, plan?);
    let Analysis {
        verified: Some(verified),
        memory: Some(memory),
        timeline: Some(timeline),
        fit: Some(memory_per_gpu),
    } = analysis
    else {
        return None;
    };
    let step = timeline.step_seconds.max(f64::MIN_POSITIVE);
    let tokens = spec.train.global_batch as f64 * spec.model.seq as f64;
    Some(Lowered {
        tokens_per_second: tokens / step,
        mfu: cost::mfu(spec, step),
        priced_by: calibration::priced_by(chosen, spec, &plan),
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

/// Check one file; `Err` is a calibration profile that cannot price it.
fn check_one(
    path: &Path,
    text: String,
    overrides: &[Override],
    options: &CompileOptions,
    calibration: &CalibrationArgs,
    resume: Option<(&Path, Consent)>,
) -> Result<Checked, String> {
    let file = path.display().to_string();
    let (options, chosen) =
        calibration::with_profile(calibration, &file, &text, overrides, options)?;
    let resume_text = resume.map(|_| text.clone());
    let Compiled {
        sources,
        diagnostics,
        cost,
        spec,
        fp8,
        plan,
        analysis,
    } = driver::compile(&file, text, overrides, &options);
    let mut diagnostics = diagnostics;
    let spec_dir = crate::run_args::spec_folder(path);
    if let Some(spec) = spec.as_ref().filter(|_| !diagnostics.has_errors()) {
        for d in crate::data_check::diagnose(spec, &spec_dir) {
            diagnostics.push(d);
        }
        for d in crate::init_check::diagnose(spec, &spec_dir) {
            diagnostics.push(d);
        }
        if let Some(d) = plan
            .as_ref()
            .and_then(|p| crate::cuda_support::diagnose(spec, p))
        {
            diagnostics.push(d);
        }
    }
    let mut moves = None;
    if let (Some((dir, consent)), Some(text)) = (resume, resume_text) {
        if !diagnostics.has_errors() {
            let fusion = options.fusion;
            let checked =
                resume_check::diagnose(&file, text, overrides, fusion, dir, &spec_dir, consent);
            match checked {
                Ok(m) => moves = Some(m),
                Err(d) => diagnostics.push(d),
            }
        }
    }
    Ok(Checked {
        file,
        sources,
        diags: diagnostics,
        fp8,
        fp8_history: (spec.as_ref())
            .and_then(|s| s.train.fp8.as_ref())
            .and_then(|f| f.history),
        report: cost,
        lowered: lowered(spec.as_ref(), plan, analysis, &chosen),
        resume: moves,
    })
}

pub fn main(args: CheckArgs) -> u8 {
    let overrides = match parse_overrides(&args.spec.set) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    if let Err(e) = args.consent.needs_resume(args.resume.as_deref()) {
        eprintln!("error: {e}");
        return 2;
    }
    let options = args.lower.options(args.spec.fusion());
    let resume = args
        .resume
        .as_deref()
        .map(|dir| (dir, args.consent.consent()));
    let mut results = Vec::new();
    let mut unreadable = false;
    for path in &args.files {
        // A file that cannot be read is reported and skipped: the others' verdicts still come
        // (`parc check configs/*.par` with one broken link reported none of them).
        let text = match read_spec(path) {
            Ok(text) => text,
            Err(e) => {
                eprintln!("error: {e}");
                unreadable = true;
                continue;
            }
        };
        match check_one(path, text, &overrides, &options, &args.calibration, resume) {
            Ok(checked) => results.push(checked),
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
    if unreadable {
        2
    } else {
        u8::from(failed)
    }
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
                let measured = r.lowered.as_ref().map(|l| crate::report::Measured {
                    needs: &l.memory_per_gpu,
                    bubble: l.bubble_fraction,
                });
                print!("{}", crate::report::render_human(report, measured));
            }
            if let Some(lowered) = &r.lowered {
                println!("\nlowered plan (verified; buffers at their stored sizes):");
                print!("{}", lowered.summary.replace("# ", "  "));
                println!(
                    "  predicted step {:.2} ms, {} tokens/s, MFU {:.1}%\n  {}",
                    lowered.step_seconds * 1e3,
                    human_count(lowered.tokens_per_second),
                    lowered.mfu * 100.0,
                    lowered.priced_by.note
                );
            }
            if !r.fp8.is_empty() {
                print!("{}", crate::report::render_fp8(&r.fp8, r.fp8_history));
            }
            if let Some(moves) = &r.resume {
                print!("{}", resume_check::render(moves));
            }
            eprintln!("{}: ok, {}", r.file, plural(w, "warning"));
        }
    }
}

/// `12.3k`, `4.56M`: a rate for people.
fn human_count(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.2}G", x / 1e9),
        x if x >= 1e6 => format!("{:.2}M", x / 1e6),
        x if x >= 1e3 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.0}"),
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
                "resume": r.resume,
                "fp8": r.fp8,
            })
        })
        .collect();
    let doc = json!({ "version": 1, "files": files });
    match serde_json::to_string_pretty(&doc) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("error: cannot encode the JSON report: {e}"),
    }
}
