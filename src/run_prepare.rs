//! What every way of running does before training: resolve the backend and compile the spec to
//! a plan with its diagnostics on stderr ([`backend_and_plan`], [`compile`]), and how a run's
//! errors reach stderr ([`print_error`], [`exit_code`]).
use crate::calibration::CalibrationArgs;
use crate::diagnostics;
use crate::input::{parse_overrides, read_spec};
use crate::run_args::{resolve_backend, Resolved, RunArgs};
use crate::SpecArgs;
use parc_compiler::diag::Diagnostic;
use parc_compiler::driver::{self, CompileOptions, Compiled, Stage};
use parc_compiler::ir::Plan;
use parc_compiler::spec::Spec;
use parc_runtime::checkpoint::SpecSource;
use std::path::Path;

/// Set by `--nproc-per-node`'s launcher for its ranks: it has shown the spec's warnings.
pub(crate) const WARNINGS_SHOWN_VAR: &str = "PARC_SPEC_WARNINGS_SHOWN";

/// Which of the spec's diagnostics a process shows: all, or only errors (a rank of a
/// multi-process job other than the one that shows the job's warnings once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shown {
    All,
    Errors,
}

/// The backend `args` asks for and its spec compiled to a plan, its diagnostics as `shown`
/// says. `Err` is the exit code, the error already on stderr: 2 for a backend that cannot
/// run, else as [`compile`].
pub(crate) fn backend_and_plan(
    args: &RunArgs,
    quiet: bool,
    shown: Shown,
) -> Result<(Resolved, Spec, Plan), u8> {
    let backend = resolve_backend(args.backend, quiet).map_err(|message| {
        print_error(&message);
        2
    })?;
    let (spec, plan) = compile_showing(&args.file, &args.spec, &args.calibration, shown)?;
    if let Some(message) = unsupported_on(backend, &plan) {
        print_error(&message);
        return Err(2);
    }
    Ok((backend, spec, plan))
}

/// What `backend` cannot run of the plan, said before any rank starts
/// (`cuda_support::refusal`).
fn unsupported_on(backend: Resolved, plan: &Plan) -> Option<String> {
    match backend.name() {
        "cpu" => None,
        _ => crate::cuda_support::refusal(plan),
    }
}

/// A run's exit code: 0, or 1 with its error on stderr.
pub(crate) fn exit_code(outcome: Result<(), String>) -> u8 {
    match outcome {
        Ok(()) => 0,
        Err(message) => {
            print_error(&message);
            1
        }
    }
}

/// `error: message` on stderr in one write, so that a launcher reading several ranks at once
/// gets it whole (`eprintln!` writes each piece of its format separately).
pub(crate) fn print_error(message: &str) {
    use std::io::Write;
    let text = format!("error: {message}\n");
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// Read, check and lower the spec, rendering every diagnostic on stderr. `Err` is the exit
/// code: 2 for unreadable input or a bad `--set`, 1 for a spec with errors. (The runtime
/// verifies the plan before it trains.)
pub(crate) fn compile(
    file: &Path,
    spec_args: &SpecArgs,
    calibration: &CalibrationArgs,
) -> Result<(Spec, Plan), u8> {
    compile_showing(file, spec_args, calibration, Shown::All)
}

/// [`compile`], showing the diagnostics `diagnostics` picks.
fn compile_showing(
    file: &Path,
    spec_args: &SpecArgs,
    calibration: &CalibrationArgs,
    diagnostics: Shown,
) -> Result<(Spec, Plan), u8> {
    let fail = |message: String| {
        print_error(&message);
        2
    };
    let overrides = parse_overrides(&spec_args.set).map_err(fail)?;
    let text = read_spec(file).map_err(fail)?;
    let shown = file.display();
    let options = CompileOptions {
        fusion: spec_args.fusion(),
        ..CompileOptions::through(Stage::Lower)
    };
    let name = shown.to_string();
    let (options, _) =
        crate::calibration::with_profile(calibration, &name, &text, &overrides, &options)
            .map_err(fail)?;
    let compiled = driver::compile(&name, text, &overrides, &options);
    show(&compiled, |d| diagnostics == Shown::All || d.is_error());
    match compiled {
        Compiled {
            spec: Some(spec),
            plan: Some(plan),
            ..
        } => Ok((spec, plan)),
        Compiled { spec: None, .. } => {
            eprintln!("error: {shown} has errors; `parc check` shows them all");
            Err(1)
        }
        Compiled { plan: None, .. } => {
            eprintln!("error: the plan of {shown} cannot be lowered");
            Err(1)
        }
    }
}

/// Check the spec a model file records (or `--spec` gives for one), its errors on stderr:
/// `Err` is a `--set` override that does not parse, `Ok(None)` a spec with errors. Warnings
/// are left out: they are about training the spec (its recipe, plan and data), which `parc
/// sample` and `parc export` do not do, and the run that wrote the file already gave them.
pub(crate) fn check_recorded(source: &SpecSource) -> Result<Option<Spec>, String> {
    let overrides = parse_overrides(&source.overrides)?;
    let options = CompileOptions::through(Stage::Check);
    let compiled = driver::compile(&source.file, source.text.clone(), &overrides, &options);
    show(&compiled, |d| d.is_error());
    Ok(compiled.spec)
}

/// The diagnostics of the compilation that `shown` picks on stderr, each followed by an empty
/// line.
fn show(compiled: &Compiled, shown: impl Fn(&Diagnostic) -> bool) {
    let color = diagnostics::stderr_color();
    for d in compiled.diagnostics.items.iter().filter(|d| shown(d)) {
        eprint!("{}", diagnostics::render(&compiled.sources, d, color));
        eprintln!();
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;

    fn tiny_llama_plan(sets: &[&str]) -> Plan {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(root.join("examples/tiny-llama.par"))
            .unwrap_or_else(|e| panic!("the tiny Llama example: {e}"));
        let overrides: Vec<_> = sets
            .iter()
            .map(|s| parc_compiler::parse_override(s).unwrap_or_else(|e| panic!("{s}: {e:?}")))
            .collect();
        let compiled = driver::compile(
            "tiny-llama.par",
            text,
            &overrides,
            &CompileOptions::through(Stage::Lower),
        );
        compiled
            .plan
            .unwrap_or_else(|| panic!("not lowered: {:?}", compiled.diagnostics.items))
    }

    /// Rowwise and blockwise(128) FP8 run on parc's own Hopper kernel; blockwise with a block
    /// that is not a multiple of its step along K (128) is refused before any rank starts.
    #[test]
    fn cuda_refuses_fp8_blocks_its_kernel_does_not_take_before_any_rank_starts() {
        let mlp = "train.fp8.fp8=[MLP]";
        let small = tiny_llama_plan(&["train.fp8=blockwise", "train.fp8.block_size=64", mlp]);
        let message = unsupported_on(Resolved::Cuda, &small).unwrap_or_default();
        assert!(
            message.contains("blockwise(64)") && message.contains("--backend cpu"),
            "{message}"
        );
        assert_eq!(unsupported_on(Resolved::Cpu, &small), None);
        for recipe in ["tensorwise", "rowwise", "blockwise"] {
            let fp8 = tiny_llama_plan(&[&format!("train.fp8={recipe}"), mlp]);
            assert_eq!(unsupported_on(Resolved::Cuda, &fp8), None, "{recipe}");
        }
        let tp = tiny_llama_plan(&[
            "train.fp8=tensorwise",
            mlp,
            "parallel.tp=2",
            "cluster.gpus_per_node=2",
        ]);
        assert_eq!(unsupported_on(Resolved::Cuda, &tp), None);
        assert_eq!(unsupported_on(Resolved::Cuda, &tiny_llama_plan(&[])), None);
    }

    /// An attention head above 256 is refused before any rank starts on CUDA, where the
    /// attention kernels would refuse it at the first step; the CPU runs it. Gemma's 256 runs.
    #[test]
    fn cuda_refuses_heads_its_attention_kernels_do_not_take() {
        let wide = tiny_llama_plan(&["model.d=512", "model.heads=1", "model.kv_heads=1"]);
        let message = unsupported_on(Resolved::Cuda, &wide).unwrap_or_default();
        assert!(
            message.contains("head_dim = 512") && message.contains("--backend cpu"),
            "{message}"
        );
        assert_eq!(unsupported_on(Resolved::Cpu, &wide), None);
        let gemma = tiny_llama_plan(&["model.d=512", "model.heads=2", "model.kv_heads=2"]);
        assert_eq!(unsupported_on(Resolved::Cuda, &gemma), None);
    }

    /// Delayed scaling's histories reduced across ranks run on CUDA (tests/cuda_train.rs runs
    /// such plans on a GPU against the CPU's emulation).
    #[test]
    fn cuda_runs_delayed_fp8_on_one_rank_and_with_histories_reduced_across_ranks() {
        let delayed = [
            "train.fp8=tensorwise",
            "train.fp8.scaling=delayed",
            "train.fp8.fp8=[MLP]",
        ];
        assert_eq!(
            unsupported_on(Resolved::Cuda, &tiny_llama_plan(&delayed)),
            None
        );
        let mut dp2 = delayed.to_vec();
        dp2.extend(["parallel.dp=2", "cluster.gpus_per_node=2"]);
        let dp2 = tiny_llama_plan(&dp2);
        assert_eq!(unsupported_on(Resolved::Cuda, &dp2), None);
        assert_eq!(unsupported_on(Resolved::Cpu, &dp2), None);
    }
}
