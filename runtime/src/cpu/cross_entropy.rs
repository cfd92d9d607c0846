//! Cross-entropy: the vocab-parallel pieces (Megatron's decomposition: per-row max, sum of
//! exponentials and target logit over this rank's vocab slice, which the lowering all-reduces
//! over tp in between, then the scaled loss and the logits gradient) and the fused loss of an
//! unsplit vocabulary, which is defined as those pieces run back to back (so plans with either
//! agree exactly). Row sums are accumulated in f64; the loss sums rows in fixed chunks
//! (deterministic).
use super::args::{dim, expect_len, rows_of, Inputs, Outputs};
use super::dense::Threads;
use super::par::{rows_per_task, sum_chunks};
use crate::backend::StepScalars;
use crate::error::Result;
use parc_compiler::ir::op::Op;
use rayon::prelude::*;

/// The loss family's entry point (see `dispatch`). The gradients are scaled by the step's fp16
/// loss scale as well as the op's.
pub(crate) fn run(
    op: &Op,
    ins: &Inputs,
    outs: &mut Outputs,
    scalars: &StepScalars,
    _: Threads,
) -> Result<()> {
    let name = ins.op;
    let loss_scale = scalars.loss_scale.unwrap_or(1.0);
    match op {
        Op::CrossEntropy { vocab, scale } => {
            let [dlogits, loss] = outs.f32s()?;
            let vocab = dim(name, "vocab", *vocab)?;
            let (logits, targets) = (ins.f32(0)?, ins.i32(1)?);
            let grad_scale = *scale * loss_scale;
            cross_entropy(
                name, vocab, *scale, grad_scale, logits, targets, dlogits, loss,
            )
        }
        Op::CeMax { vocab_local } => {
            let [max] = outs.f32s()?;
            let v = dim(name, "vocab_local", *vocab_local)?;
            ce_max(name, v, ins.f32(0)?, max)
        }
        Op::CeSumExp { vocab_local } => {
            let [sumexp] = outs.f32s()?;
            let v = dim(name, "vocab_local", *vocab_local)?;
            ce_sum_exp(name, v, ins.f32(0)?, ins.f32(1)?, sumexp)
        }
        Op::CeTargetLogit {
            vocab_start,
            vocab_local,
        } => {
            let [target_logit] = outs.f32s()?;
            let v = dim(name, "vocab_local", *vocab_local)?;
            let (logits, targets) = (ins.f32(0)?, ins.i32(1)?);
            ce_target_logit(name, *vocab_start, v, logits, targets, target_logit)
        }
        Op::CeLoss { scale } => {
            let [loss] = outs.f32s()?;
            let (max, sumexp, target_logit) = (ins.f32(0)?, ins.f32(1)?, ins.f32(2)?);
            ce_loss(name, *scale, max, sumexp, target_logit, loss)
        }
        Op::CeGrad {
            vocab_start,
            vocab_local,
            scale,
        } => {
            let [dlogits] = outs.f32s()?;
            let v = dim(name, "vocab_local", *vocab_local)?;
            let (logits, targets) = (ins.f32(0)?, ins.i32(1)?);
            let (max, sumexp) = (ins.f32(2)?, ins.f32(3)?);
            let grad_scale = *scale * loss_scale;
            ce_grad(
                name,
                *vocab_start,
                v,
                grad_scale,
                logits,
                targets,
                max,
                sumexp,
                dlogits,
            )
        }
        _ => Err(ins.unrouted("loss")),
    }
}

/// The column of `target` in this rank's slice, if it holds it.
fn local_column(target: i32, vocab_start: u64, vocab_local: usize) -> Option<usize> {
    let offset = i64::from(target) - i64::try_from(vocab_start).ok()?;
    usize::try_from(offset).ok().filter(|&c| c < vocab_local)
}

/// `max[r] = max_j logits[r, j]`.
pub(crate) fn ce_max(op: &str, vocab_local: usize, logits: &[f32], max: &mut [f32]) -> Result<()> {
    let rows = rows_of(op, "logits", logits.len(), vocab_local)?;
    expect_len(op, "max", max.len(), rows)?;
    max.par_iter_mut()
        .zip(logits.par_chunks(vocab_local))
        .with_min_len(rows_per_task(vocab_local))
        .for_each(|(m, row)| *m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    Ok(())
}

/// `sumexp[r] = Σ_j exp(logits[r, j] − max[r])`.
pub(crate) fn ce_sum_exp(
    op: &str,
    vocab_local: usize,
    logits: &[f32],
    max: &[f32],
    sumexp: &mut [f32],
) -> Result<()> {
    let rows = rows_of(op, "logits", logits.len(), vocab_local)?;
    expect_len(op, "max", max.len(), rows)?;
    expect_len(op, "sumexp", sumexp.len(), rows)?;
    sumexp
        .par_iter_mut()
        .zip(logits.par_chunks(vocab_local).zip(max.par_iter()))
        .with_min_len(rows_per_task(vocab_local))
        .for_each(|(s, (row, &m))| {
            *s = row.iter().map(|&l| f64::from((l - m).exp())).sum::<f64>() as f32;
        });
    Ok(())
}

/// `target_logit[r] = logits[r, targets[r] − vocab_start]`, 0 when another rank holds it.
pub(crate) fn ce_target_logit(
    op: &str,
    vocab_start: u64,
    vocab_local: usize,
    logits: &[f32],
    targets: &[i32],
    target_logit: &mut [f32],
) -> Result<()> {
    let rows = rows_of(op, "logits", logits.len(), vocab_local)?;
    expect_len(op, "targets", targets.len(), rows)?;
    expect_len(op, "target_logit", target_logit.len(), rows)?;
    for (row, (out, &target)) in target_logit.iter_mut().zip(targets).enumerate() {
        *out = local_column(target, vocab_start, vocab_local)
            .map_or(0.0, |c| logits[row * vocab_local + c]);
    }
    Ok(())
}

/// `loss[0] += scale · Σ_r (ln sumexp[r] + max[r] − target_logit[r])`.
pub(crate) fn ce_loss(
    op: &str,
    scale: f64,
    max: &[f32],
    sumexp: &[f32],
    target_logit: &[f32],
    loss: &mut [f32],
) -> Result<()> {
    expect_len(op, "sumexp", sumexp.len(), max.len())?;
    expect_len(op, "target_logit", target_logit.len(), max.len())?;
    expect_len(op, "loss", loss.len(), 1)?;
    let total = sum_chunks(max.len(), |r| {
        f64::from(sumexp[r]).ln() + f64::from(max[r]) - f64::from(target_logit[r])
    });
    loss[0] = (f64::from(loss[0]) + scale * total) as f32;
    Ok(())
}

/// `dlogits[r, j] = scale · (exp(logits[r, j] − max[r]) / sumexp[r] − [j is the target])`;
/// in an fp16 run `scale` is the op's scale times the step's loss scale (the caller multiplies).
#[allow(clippy::too_many_arguments)]
pub(crate) fn ce_grad(
    op: &str,
    vocab_start: u64,
    vocab_local: usize,
    scale: f64,
    logits: &[f32],
    targets: &[i32],
    max: &[f32],
    sumexp: &[f32],
    dlogits: &mut [f32],
) -> Result<()> {
    let rows = rows_of(op, "logits", logits.len(), vocab_local)?;
    expect_len(op, "targets", targets.len(), rows)?;
    expect_len(op, "max", max.len(), rows)?;
    expect_len(op, "sumexp", sumexp.len(), rows)?;
    expect_len(op, "dlogits", dlogits.len(), logits.len())?;
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
            if let Some(c) = local_column(targets[r], vocab_start, vocab_local) {
                d[c] -= scale;
            }
        });
    Ok(())
}

/// `Op::CrossEntropy`: `loss[0] += scale · Σ_r (ln sumexp[r] + max[r] − target_logit[r])` and
/// `dlogits = grad_scale · (softmax − onehot(target))` over an unsplit vocabulary, computed as
/// the split pieces compute them (`vocab_start` 0). `logits` is the op's input as it was before
/// the op (the backend hands a copy when `dlogits` is the same buffer); `grad_scale` is the op's
/// scale times the step's loss scale.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy(
    op: &str,
    vocab: usize,
    scale: f64,
    grad_scale: f64,
    logits: &[f32],
    targets: &[i32],
    dlogits: &mut [f32],
    loss: &mut [f32],
) -> Result<()> {
    let rows = rows_of(op, "logits", logits.len(), vocab)?;
    expect_len(op, "targets", targets.len(), rows)?;
    expect_len(op, "dlogits", dlogits.len(), logits.len())?;
    expect_len(op, "loss", loss.len(), 1)?;
    let (mut max, mut sumexp, mut target_logit) =
        (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
    ce_max(op, vocab, logits, &mut max)?;
    ce_sum_exp(op, vocab, logits, &max, &mut sumexp)?;
    ce_target_logit(op, 0, vocab, logits, targets, &mut target_logit)?;
    ce_loss(op, scale, &max, &sumexp, &target_logit, loss)?;
    ce_grad(
        op, 0, vocab, grad_scale, logits, targets, &max, &sumexp, dlogits,
    )
}
