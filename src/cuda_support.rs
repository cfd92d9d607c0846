//! What the CUDA backend cannot run yet of a lowered plan, in one place for the three commands
//! that act on it: `parc run --backend cuda` refuses such a plan before any rank starts
//! (`run_prepare`), `parc check` of a GPU spec warns of it (W1202), and `parc plan --search` on
//! a GPU cluster rejects the candidates it refuses (`cmd_search`), so the verdict of `check` and
//! the search's advice are the ones the runtime acts on.
//!
//! The CUDA backend runs tensorwise FP8 GEMMs, current or delayed (equal to the CPU's exact
//! emulation in every case of `tests/cuda_ops/fp8.rs`, and a delayed Llama-style run in
//! `tests/cuda_train.rs`, on an H200, 2026-12-05/06), with their amaxes or histories reduced
//! across ranks (tp, cp, and dp for histories: `tests/cuda_train.rs`'s plans of several ranks
//! on one GPU against the CPU's emulation of the same plan); rowwise and blockwise run on
//! parc's own FP8 kernel on Hopper (cuBLASLt's algorithm search refuses their scales there),
//! blockwise with blocks that are multiples of its step along K (128): smaller blocks run on
//! the CPU backend only. An attention its kernels do not take (`parc_runtime::cuda_limits`:
//! heads above 256, Gemma's size, or more (batch, head) pairs than one launch covers) is
//! refused here too, rather than at the run's first attention op.
use parc_compiler::diag::Diagnostic;
use parc_compiler::fp8::{cuda_runs_block, CUDA_BLOCK};
use parc_compiler::ir::fp8::Fp8Scaling;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::Plan;
use parc_compiler::spec::{NodeId, Spec};

/// Why the CUDA backend cannot run `plan`, with what to do instead; None where it can.
pub(crate) fn refusal(plan: &Plan) -> Option<String> {
    refused(plan).map(|r| r.why)
}

/// Whether `spec` trains on GPUs, where the CUDA backend's rule applies (not to a CPU spec).
pub(crate) fn applies(spec: &Spec) -> bool {
    spec.cluster.gpu.name != "cpu"
}

/// W1202 for a GPU spec whose lowered plan the CUDA backend refuses (`refusal`), at the
/// attention it refuses; None for a CPU spec, a plan it runs, or blockwise blocks the FP8
/// kernel does not take (W1201 says that one).
pub(crate) fn diagnose(spec: &Spec, plan: &Plan) -> Option<Diagnostic> {
    if !applies(spec) {
        return None;
    }
    let Refused { why, at } = refused(plan)?;
    // The one FP8 refusal, a block the kernel does not take, is W1201's to say.
    let At::Attention(node) = at else {
        return None;
    };
    let d = Diagnostic::warning(
        "W1202",
        "`parc run --backend cuda` refuses this plan: the CUDA backend does not run it yet",
    )
    .help(why);
    let layer = node.and_then(|n| spec.model.nodes.get(n.0 as usize));
    Some(match layer {
        Some(n) => d.label(n.span, "this attention"),
        None => d,
    })
}

/// What the backend refuses first, and where.
struct Refused {
    why: String,
    at: At,
}

/// Where a refusal points: an attention (its layer, where the instruction names one), or the
/// FP8 recipe.
enum At {
    Attention(Option<NodeId>),
    Recipe,
}

/// The one order of the rule: the attention the kernels cannot run, then the FP8 scalings.
fn refused(plan: &Plan) -> Option<Refused> {
    if let Some((why, node)) = attention_refused(plan) {
        return Some(Refused {
            why,
            at: At::Attention(node),
        });
    }
    scalings(plan).map(|why| Refused {
        why,
        at: At::Recipe,
    })
}

fn computes(plan: &Plan) -> impl Iterator<Item = parc_compiler::ir::Compute<'_>> {
    (plan.programs.iter().flat_map(|p| &p.instrs)).filter_map(|i| i.as_compute())
}

/// The first attention the CUDA kernels cannot run (`parc_runtime::cuda_limits`): why, with
/// what to do instead, and its layer.
fn attention_refused(plan: &Plan) -> Option<(String, Option<NodeId>)> {
    let (why, node) = computes(plan).find_map(|c| match c.op {
        Op::Attention(a) => parc_runtime::cuda_limits::attention_refusal(a).map(|w| (w, c.node)),
        _ => None,
    })?;
    Some((format!("this plan's attention does not fit: {why}"), node))
}

/// The FP8 GEMMs the backend cannot run: blockwise with a block that is not a multiple of its
/// kernel's step along K (`parc_compiler::fp8::cuda_runs_block`).
fn scalings(plan: &Plan) -> Option<String> {
    let mut blocks = computes(plan).filter_map(|c| match c.op.fp8()?.scaling {
        Fp8Scaling::Blockwise { block } if !cuda_runs_block(block) => Some(block),
        _ => None,
    });
    let block = blocks.next()?;
    let count = 1 + blocks.count();
    Some(format!(
        "this plan runs {count} GEMMs in blockwise({block}) FP8 (`train.fp8`), which the CUDA \
         backend does not run: its FP8 kernel scales K in steps of {CUDA_BLOCK}, so blocks are \
         multiples of {CUDA_BLOCK}; only the CPU backend runs them (an exact emulation). Use \
         `blockwise {{ block_size: {CUDA_BLOCK} }}` on the GPU, or run `--backend cpu`"
    ))
}
