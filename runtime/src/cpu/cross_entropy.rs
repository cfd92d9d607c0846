//! Cross-entropy: the vocab-parallel pieces (Megatron's decomposition: per-row max, sum of
//! exponentials and target logit over this rank's vocab slice, which the lowering all-reduces
//! over tp in between, then the scaled loss and the logits gradient) and the fused loss of an
//! unsplit vocabulary, which is defined as those pieces run back to back (so plans with either
//! agree exactly). Row sums are accumulated in f64; the loss sums rows in fixed chunks
//! (deterministic).
use super::args::{Inputs, Outputs};
use super::embed::local_index;
use super::par::{rows_per_task, sum_chunks};
use crate::backend::StepScalars;
use crate::error::Result;
use parc_compiler::ir::op::Op;
use rayon::prelude::*;

/// The loss family's entry point (see `dispatch`). The gradients are scaled by the step's fp16
/// loss scale as well as the op's.
pub(crate) fn run(op: &Op, ins: &Inputs, outs: &mut Outputs, scalars: &StepScalars) -> Result<()> {
    let loss_scale = scalars.loss_scale.unwrap_or(1.0);
    match op {
        Op::CrossEntropy { vocab: v, scale } => {
            let v = ins.dim("vocab", *v)?;
            let (logits, targets) = (ins.f32("logits")?, ins.i32("targets")?);
            let (dlogits, loss) = (outs.f32("dlogits")?, outs.accumulator("loss")?);
            let grad_scale = *scale * loss_scale;
            cross_entropy(v, *scale, grad_scale, logits, targets, dlogits, loss);
        }
        Op::CeMax { vocab_local } => {
            let v = ins.dim("vocab_local", *vocab_local)?;
            ce_max(v, ins.f32("logits")?, outs.f32("max")?);
        }
        Op::CeSumExp { vocab_local } => {
            let v = ins.dim("vocab_local", *vocab_local)?;
            let (logits, max) = (ins.f32("logits")?, ins.f32("max")?);
            ce_sum_exp(v, logits, max, outs.f32("sumexp")?);
        }
        Op::CeTargetLogit {
            vocab_start,
            vocab_local,
        } => {
            let v = ins.dim("vocab_local", *vocab_local)?;
            let (logits, targets) = (ins.f32("logits")?, ins.i32("targets")?);
            let target_logit = outs.f32("target_logit")?;
            ce_target_logit(*vocab_start, v, logits, targets, target_logit);
        }
        Op::CeLoss { scale } => {
            let (max, sumexp) = (ins.f32("max")?, ins.f32("sumexp")?);
            let target_logit = ins.f32("target_logit")?;
            ce_loss(*scale, max, sumexp, target_logit, outs.accumulator("loss")?);
        }
        Op::CeGrad {
            vocab_start,
            vocab_local,
            scale,
        } => {
            let v = ins.dim("vocab_local", *vocab_local)?;
            let (logits, targets) = (ins.f32("logits")?, ins.i32("targets")?);
            let (max, sumexp) = (ins.f32("max")?, ins.f32("sumexp")?);
            let (grad_scale, dlogits) = (*scale * loss_scale, outs.f32("dlogits")?);
            ce_grad(
                *vocab_start,
                v,
                grad_scale,
                logits,
                targets,
                max,
                sumexp,
                dlogits,
            );
        }
        _ => return Err(ins.unrouted("loss")),
    }
    Ok(())
}

/// `max[r] = max_j logits[r, j]`.
pub(crate) fn ce_max(vocab_local: usize, logits: &[f32], max: &mut [f32]) {
    max.par_iter_mut()
        .zip(logits.par_chunks(vocab_local))
        .with_min_len(rows_per_task(vocab_local))
        .for_each(|(m, row)| *m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max));
}

/// `sumexp[r] = Σ_j exp(logits[r, j] − max[r])`.
pub(crate) fn ce_sum_exp(vocab_local: usize, logits: &[f32], max: &[f32], sumexp: &mut [f32]) {
    sumexp
        .par_iter_mut()
        .zip(logits.par_chunks(vocab_local).zip(max.par_iter()))
        .with_min_len(rows_per_task(vocab_local))
        .for_each(|(s, (row, &m))| {
            *s = row.iter().map(|&l| f64::from((l - m).exp())).sum::<f64>() as f32;
        });
}

/// `target_logit[r] = logits[r, targets[r] − vocab_start]`, 0 when another rank holds it.
pub(crate) fn ce_target_logit(
    vocab_start: u64,
    vocab_local: usize,
    logits: &[f32],
    targets: &[i32],
    target_logit: &mut [f32],
) {
    for (row, (out, &target)) in target_logit.iter_mut().zip(targets).enumerate() {
        *out = local_index(target, vocab_start, vocab_local)
            .map_or(0.0, |c| logits[row * vocab_local + c]);
    }
}

/// `loss[0] += scale · Σ_r (ln sumexp[r] + max[r] − target_logit[r])`.
pub(crate) fn ce_loss(
    scale: f64,
    max: &[f32],
    sumexp: &[f32],
    target_logit: &[f32],
    loss: &mut [f32],
) {
    let total = sum_chunks(max.len(), |r| {
        f64::from(sumexp[r]).ln() + f64::from(max[r]) - f64::from(target_logit[r])
    });
    loss[0] = (f64::from(loss[0]) + scale * total) as f32;
}

/// `dlogits[r, j] = scale · (exp(logits[r, j] − max[r]) / sumexp[r] − [j is the target])`;
/// in an fp16 run `scale` is the op's scale times the step's loss scale (the caller
/// multiplies).
#[allow(clippy::too_many_arguments)]
pub(crate) fn ce_grad(
    vocab_start: u64,
    vocab_local: usize,
    scale: f64,
    logits: &[f32],
    targets: &[i32],
    max: &[f32],
    sumexp: &[f32],
    dlogits: &mut [f32],
) {
    let scale = scale as f32;
    dlogits
        .par_chunks_mut(vocab_local)
        .zip(logits.par_chunks(vocab_local))
        .enumerate()
        .with_min_len(rows_per_task(vocab_local))
        .for_each(|(r, (d, l))| {
            let factor = scale / sumexp[r];
            for (d, &l) in d.iter_mut().zip(l) {
                *d = factor * (l - max[r]).exp();
            }
            if let Some(c) = local_index(targets[r], vocab_start, vocab_local) {
                d[c] -= scale;
            }
        });
}

/// `Op::CrossEntropy`: `loss[0] += scale · Σ_r (ln sumexp[r] + max[r] − target_logit[r])` and
/// `dlogits = grad_scale · (softmax − onehot(target))` over an unsplit vocabulary, computed as
/// the split pieces compute them (`vocab_start` 0). `logits` is the op's input as it was before
/// the op (the backend hands a copy when `dlogits` is the same buffer); `grad_scale` is the op's
/// scale times the step's loss scale.
pub(crate) fn cross_entropy(
    vocab: usize,
    scale: f64,
    grad_scale: f64,
    logits: &[f32],
    targets: &[i32],
    dlogits: &mut [f32],
    loss: &mut [f32],
) {
    let rows = targets.len();
    let (mut max, mut sumexp, mut target_logit) =
        (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
    ce_max(vocab, logits, &mut max);
    ce_sum_exp(vocab, logits, &max, &mut sumexp);
    ce_target_logit(0, vocab, logits, targets, &mut target_logit);
    ce_loss(scale, &max, &sumexp, &target_logit, loss);
    ce_grad(
        0, vocab, grad_scale, logits, targets, &max, &sumexp, dlogits,
    );
}
