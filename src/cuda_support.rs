//! What the CUDA backend cannot run yet of a lowered plan, in one place for the three commands
//! that act on it: `parc run --backend cuda` refuses such a plan before any rank starts
//! (`run_prepare`), `parc check` of a GPU spec warns of it (W1202), and `parc plan --search` on
//! a GPU cluster rejects the candidates it refuses (`cmd_search`), so the verdict of `check` and
//! the search's advice are the ones the runtime acts on.
//!
//! The CUDA backend runs tensorwise FP8 GEMMs, current or delayed (equal to the CPU's exact
//! emulation in every case of `tests/cuda_ops/fp8.rs`, and a delayed Llama-style run in
//! `tests/cuda_train.rs`, on an H200, 2026-12-05/06); rowwise (cuBLASLt refused its
//! outer-vector scales there), blockwise (cuBLASLt refused its block scales there), and amaxes
//! or amax histories reduced across ranks (tp, cp, and dp for histories: not yet run on GPUs)
//! run on the CPU backend only.
use parc_compiler::diag::Diagnostic;
use parc_compiler::ir::fp8::Fp8Scaling;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{BufferId, BufferKind, Instr, Plan};
use parc_compiler::spec::Spec;

/// Why the CUDA backend cannot run `plan`, with what to do instead; None where it can.
pub(crate) fn refusal(plan: &Plan) -> Option<String> {
    history_reductions(plan)
        .or_else(|| amax_reductions(plan))
        .or_else(|| scalings(plan))
}

/// Whether `spec` trains on GPUs, where the CUDA backend's rule applies (not to a CPU spec).
pub(crate) fn applies(spec: &Spec) -> bool {
    spec.cluster.gpu.name != "cpu"
}

/// W1202 for a GPU spec whose lowered plan the CUDA backend refuses (`refusal`), at the FP8
/// recipe; None for a CPU spec, a plan it runs, or blockwise blocks other than the backend's
/// (W1201 says that one).
pub(crate) fn diagnose(spec: &Spec, plan: &Plan) -> Option<Diagnostic> {
    let other_block = spec.train.fp8.as_ref().is_some_and(|f| {
        matches!(f.scaling, Fp8Scaling::Blockwise { block } if block != parc_compiler::fp8::CUDA_BLOCK)
    });
    if !applies(spec) || other_block {
        return None;
    }
    let why = refusal(plan)?;
    let d = Diagnostic::warning(
        "W1202",
        "`parc run --backend cuda` refuses this plan: the CUDA backend does not run it yet",
    )
    .help(why);
    Some(match spec.train.fp8.as_ref() {
        Some(fp8) => d.label(fp8.span, "this FP8 recipe"),
        None => d,
    })
}

fn computes(plan: &Plan) -> impl Iterator<Item = parc_compiler::ir::Compute<'_>> {
    (plan.programs.iter().flat_map(|p| &p.instrs)).filter_map(|i| i.as_compute())
}

fn history_reductions(plan: &Plan) -> Option<String> {
    let count = (plan.programs.iter())
        .flat_map(|p| p.instrs.iter().map(move |i| (p, i)))
        .filter(|(p, i)| match i {
            Instr::Collective { input, .. } => p
                .buffer(*input)
                .is_some_and(|b| b.kind == BufferKind::Fp8History),
            _ => false,
        })
        .count();
    (count > 0).then(|| {
        format!(
            "this plan reduces {count} FP8 amax histories across ranks (`train.fp8 = tensorwise \
             {{ scaling: delayed }}` under dp, tp or cp), which the CUDA backend does not run \
             yet (not yet tested on GPUs): train delayed scaling on one GPU, use `scaling: \
             current` under data parallelism, or run `--backend cpu`"
        )
    })
}

/// The FP8 amaxes reduced across ranks: `Fp8Amax` outputs a collective reads (an `Fp8Amax`
/// of a tensor quantized once for several GEMMs stays on its rank).
fn amax_reductions(plan: &Plan) -> Option<String> {
    let reduced: std::collections::HashSet<(usize, BufferId)> = (plan.programs.iter().enumerate())
        .flat_map(|(k, p)| {
            p.instrs.iter().filter_map(move |i| match i {
                Instr::Collective { input, .. } => Some((k, *input)),
                _ => None,
            })
        })
        .collect();
    let count = (plan.programs.iter().enumerate())
        .flat_map(|(k, p)| p.computes().map(move |(_, c)| (k, c)))
        .filter(|(k, c)| {
            matches!(c.op, Op::Fp8Amax(_))
                && c.outputs
                    .first()
                    .is_some_and(|o| reduced.contains(&(*k, *o)))
        })
        .count();
    (count > 0).then(|| {
        format!(
            "this plan reduces {count} FP8 amaxes across ranks (`train.fp8` under tp or cp), \
             which the CUDA backend does not run yet (not yet tested on GPUs): train FP8 without \
             tensor or context parallelism on the GPU, or run `--backend cpu`"
        )
    })
}

fn scalings(plan: &Plan) -> Option<String> {
    let mut refused: Vec<(Fp8Scaling, usize)> = Vec::new();
    let scalings = computes(plan)
        .filter_map(|c| c.op.fp8())
        .map(|f| f.scaling)
        .filter(|s| *s != Fp8Scaling::Tensorwise);
    for scaling in scalings {
        match refused.iter_mut().find(|(s, _)| *s == scaling) {
            Some((_, n)) => *n += 1,
            None => refused.push((scaling, 1)),
        }
    }
    let (scaling, count) = refused.first()?;
    let why = match scaling {
        Fp8Scaling::Rowwise => "cuBLASLt refuses its outer-vector scales on Hopper",
        _ => {
            "cuBLASLt refused its block scales on an H200 (128 × 128 weight blocks as the \
             product's A, 1 × 128 tiles as B, CUBLAS_STATUS_INVALID_VALUE)"
        }
    };
    Some(format!(
        "this plan runs {count} GEMMs in {} FP8 (`train.fp8`), which the CUDA backend does not \
         run yet ({why}): only the CPU backend runs them (an exact emulation). Use `train.fp8 = \
         tensorwise` on the GPU, train without `train.fp8`, or run `--backend cpu`",
        scaling.name()
    ))
}
