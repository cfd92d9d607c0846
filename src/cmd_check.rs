//! `parc check FILE... [--set PATH=VALUE]... [--format human|json]`: parse and check specs, then
//! show the cost model's report. When the plan is small enough to lower in a blink (or with
//! `--lower always`), it is also lowered, verified and simulated, and the report adds the
//! verifier's measured peak memory per program and the timeline's bubble. Exit 0 when every file is clean (warnings allowed), 1 when any
//! has an error, 2 for usage errors and unreadable files.

use crate::diagnostics;
use crate::SpecArgs;
use parc_compiler::cost;
use parc_compiler::diag::{Diagnostics, Sources};
use parc_compiler::spec::Spec;
use parc_compiler::verify::VerifyReport;
use parc_compiler::Override;
use serde_json::json;
use std::path::{Path, PathBuf};

/// Files larger than this are refused before parsing.
const MAX_BYTES: u64 = 16 * 1024 * 1024;

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
    /// Also lower, verify and simulate the plan: `auto` does it when the plan is small
    /// (layers × microbatches ≤ 2,048, so `check` stays instant), `always`, or `never`.
    #[arg(long, value_enum, default_value = "auto")]
    pub lower: LowerWhen,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LowerWhen {
    Auto,
    Always,
    Never,
}

/// Largest layers × microbatches that `--lower auto` lowers (about 0.1 s on a laptop core).
const AUTO_LOWER_LIMIT: u64 = 2048;

/// Read a spec file: UTF-8, at most 16 MiB. The error is a full sentence.
pub fn read_spec(path: &Path) -> Result<String, String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    if meta.is_dir() {
        return Err(format!("{shown} is a folder, not a .par file"));
    }
    if meta.len() > MAX_BYTES {
        return Err(format!(
            "{shown} is {:.1} MiB; parc reads spec files up to 16 MiB",
            meta.len() as f64 / (1024.0 * 1024.0)
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    String::from_utf8(bytes).map_err(|e| {
        format!(
            "{shown} is not UTF-8 text (invalid byte at offset {}); .par files are UTF-8",
            e.utf8_error().valid_up_to()
        )
    })
}

/// Parse every `--set` flag; the message names the bad flag.
pub fn parse_overrides(set: &[String]) -> Result<Vec<Override>, String> {
    set.iter()
        .map(|s| parc_compiler::parse_override(s))
        .collect()
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
    /// The simulated share of the step the report rank (a pipeline's last stage) waits: idle
    /// plus exposed communication (what `parc run --profile` measures there as p2p time).
    report_rank_stall_fraction: Option<f64>,
    #[serde(skip)]
    summary: String,
}

fn wants_lowering(spec: &Spec, when: LowerWhen) -> bool {
    match when {
        LowerWhen::Always => true,
        LowerWhen::Never => false,
        LowerWhen::Auto => {
            u64::from(spec.model.layers.max(1)) * u64::from(spec.parallel.microbatches)
                <= AUTO_LOWER_LIMIT
        }
    }
}

/// Lower, verify and simulate; lowering and verification errors join the diagnostics.
fn lower_and_measure(spec: &Spec, diags: &mut Diagnostics) -> Option<Lowered> {
    let plan = parc_compiler::lower::lower(spec)
        .map_err(|d| diags.extend(d))
        .ok()?;
    let verified = parc_compiler::verify::verify_spec(&plan, spec)
        .map_err(|d| diags.extend(d))
        .ok()?;
    let memory_plans = match crate::cmd_plan::memory_plans(&plan, &verified) {
        Ok(m) => m,
        Err(e) => {
            diags.push(
                parc_compiler::diag::Diagnostic::error("E0818", e.to_string())
                    .help("this is a bug in parc's memory planner: please report it with the spec"),
            );
            return None;
        }
    };
    let timeline = parc_compiler::timeline::simulate(&plan, spec);
    let half = spec.train.precision != parc_compiler::spec::Precision::Fp32;
    let device_memory = parc_compiler::memplan::device_memory(&plan, &memory_plans, half);
    let mut summary = crate::cmd_plan::summary(&plan, &verified, &memory_plans, &timeline);
    let roles: Vec<String> = plan.programs.iter().map(|p| p.role.clone()).collect();
    summary.push_str(&crate::report::render_device_memory(&roles, &device_memory));
    let report_program = plan.rank_program.get(plan.report_rank as usize).copied();
    let report_rank_stall_fraction = timeline
        .ranks
        .iter()
        .find(|r| Some(r.program) == report_program && timeline.step_seconds > 0.0)
        .map(|r| (r.idle_seconds + r.exposed_comm_seconds) / timeline.step_seconds);
    Some(Lowered {
        verified,
        memory_plans,
        device_memory,
        report_rank_stall_fraction,
        step_seconds: timeline.step_seconds,
        bubble_fraction: timeline.bubble_fraction,
        exposed_comm_fraction: timeline.exposed_comm_fraction,
        summary,
    })
}

fn check_one(path: &Path, text: String, overrides: &[Override], lower: LowerWhen) -> Checked {
    let mut sources = Sources::default();
    let main = sources.add(path.display().to_string(), text);
    let (spec, mut diags) = parc_compiler::check(&mut sources, main, overrides);
    let report = spec.as_ref().map(|s| {
        let r = cost::estimate(s);
        diags.extend(cost::diagnose(s, &r));
        r
    });
    let lowered = match &spec {
        Some(s) if !diags.has_errors() && wants_lowering(s, lower) => {
            lower_and_measure(s, &mut diags)
        }
        _ => None,
    };
    Checked {
        file: path.display().to_string(),
        sources,
        diags,
        report,
        lowered,
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
    let mut results = Vec::new();
    for path in &args.files {
        match read_spec(path) {
            Ok(text) => results.push(check_one(path, text, &overrides, args.lower)),
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
                print!("{}", crate::report::render_human(report));
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
