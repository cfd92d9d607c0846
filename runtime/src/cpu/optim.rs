//! Optimizer ops: the squared-gradient-norm partial sum, the global-norm clip coefficient, and the
//! AdamW and SGD updates (in place on the master tensor and its state). The learning rate, the
//! 1-based step and the fp16 loss scale come from the executor's `StepScalars`: with a loss scale
//! the clip coefficient also unscales the gradients. It is NaN for a step whose gradient norm is
//! not finite (an fp16 overflow, or diverged values), which the updates then skip (parameters and
//! state untouched).
use super::args::{Inputs, Outputs};
use super::par::{sum_chunks, TASK_ELEMENTS};
use crate::backend::StepScalars;
use crate::error::Result;
use parc_compiler::ir::op::Op;
use rayon::prelude::*;

/// The optimizer family's entry point (see `dispatch`).
pub(crate) fn run(op: &Op, ins: &Inputs, outs: &mut Outputs, scalars: &StepScalars) -> Result<()> {
    if matches!(op, Op::AdamW { .. } | Op::Sgd { .. }) && scalars.step == 0 {
        return Err(ins.err("the optimizer step count is 1-based; got step 0"));
    }
    match op {
        Op::SumSquares => sum_squares(ins.f32("g")?, outs.accumulator("sumsq")?),
        Op::ClipCoef { max_norm } => {
            let (sumsq, coef) = (ins.f32("sumsq")?, outs.f32("coef")?);
            clip_coef(*max_norm, scalars.loss_scale, sumsq, coef);
        }
        Op::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay: wd,
        } => {
            let config = AdamWConfig {
                beta1: *beta1,
                beta2: *beta2,
                eps: *eps,
                weight_decay: *wd,
            };
            let (g, coef) = (ins.f32("g")?, ins.f32("coef")?);
            let (param, m, v) = (outs.f32("param")?, outs.f32("m")?, outs.f32("v")?);
            adamw(&config, scalars, g, coef, param, m, v);
        }
        Op::Sgd {
            momentum,
            weight_decay,
        } => {
            let (g, coef) = (ins.f32("g")?, ins.f32("coef")?);
            let (param, buf) = (outs.f32("param")?, outs.optional_f32("momentum")?);
            sgd(*momentum, *weight_decay, scalars, g, coef, param, buf);
        }
        _ => return Err(ins.unrouted("optimizer")),
    }
    Ok(())
}

/// Elements per rayon task for the updates.
const CHUNK: usize = TASK_ELEMENTS;

/// `sumsq[0] += Σ g²`.
pub(crate) fn sum_squares(g: &[f32], sumsq: &mut [f32]) {
    let total = sum_chunks(g.len(), |i| f64::from(g[i]).powi(2));
    sumsq[0] = (f64::from(sumsq[0]) + total) as f32;
}

/// `coef = min(1, max_norm / (√sumsq + 1e-6))`, or 1 without clipping. With a loss scale `s`:
/// `coef = min(1, max_norm / (√sumsq / s + 1e-6)) / s` (or `1 / s`). NaN when sumsq is not
/// finite, with or without a loss scale: the updates skip that step (fp16's overflow, or
/// `train.on_nonfinite`'s). A power-of-two `s` makes the unscaled update bit-identical to an
/// unscaled run's.
pub(crate) fn clip_coef(
    max_norm: Option<f64>,
    loss_scale: Option<f64>,
    sumsq: &[f32],
    coef: &mut [f32],
) {
    let sumsq = f64::from(sumsq[0]);
    let scale = loss_scale.unwrap_or(1.0);
    if !sumsq.is_finite() {
        coef[0] = f32::NAN;
        return;
    }
    let clip = match max_norm {
        None => 1.0,
        Some(max_norm) => (max_norm / (sumsq.sqrt() / scale + 1e-6)).min(1.0),
    };
    coef[0] = (clip / scale) as f32;
}

/// AdamW hyper-parameters (from the op).
pub(crate) struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// One AdamW step on `param` with moments `m`, `v` (see `Op::AdamW` for the formula); the
/// step count is 1-based.
pub(crate) fn adamw(
    config: &AdamWConfig,
    scalars: &StepScalars,
    g: &[f32],
    coef: &[f32],
    param: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let step = i32::try_from(scalars.step).unwrap_or(i32::MAX);
    let bias1 = (1.0 - config.beta1.powi(step)) as f32;
    let bias2 = (1.0 - config.beta2.powi(step)) as f32;
    let (beta1, beta2) = (config.beta1 as f32, config.beta2 as f32);
    let (eps, wd, lr) = (
        config.eps as f32,
        config.weight_decay as f32,
        scalars.lr as f32,
    );
    let coef = coef[0];
    if !coef.is_finite() {
        // A step whose gradient norm is not finite: skipped.
        return;
    }
    param
        .par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .zip(g.par_chunks(CHUNK))
        .for_each(|((param, (m, v)), g)| {
            for (((p, m), v), &g) in param.iter_mut().zip(m).zip(v).zip(g) {
                let g = coef * g;
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                let m_hat = *m / bias1;
                let v_hat = *v / bias2;
                *p -= lr * (m_hat / (v_hat.sqrt() + eps) + wd * *p);
            }
        });
}

/// One SGD step: `g' = coef·g + wd·param`; with momentum `buf = momentum·buf + g'` (`buf = g'`
/// at step 1) and `param −= lr·buf`, else `param −= lr·g'`.
pub(crate) fn sgd(
    momentum: f64,
    weight_decay: f64,
    scalars: &StepScalars,
    g: &[f32],
    coef: &[f32],
    param: &mut [f32],
    buf: Option<&mut [f32]>,
) {
    let (coef, wd, lr) = (coef[0], weight_decay as f32, scalars.lr as f32);
    if !coef.is_finite() {
        // A step whose gradient norm is not finite: skipped.
        return;
    }
    match buf {
        None => {
            param
                .par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .for_each(|(param, g)| {
                    for (p, &g) in param.iter_mut().zip(g) {
                        *p -= lr * (coef * g + wd * *p);
                    }
                });
        }
        Some(buf) => {
            let first = scalars.step == 1;
            let momentum = momentum as f32;
            param
                .par_chunks_mut(CHUNK)
                .zip(buf.par_chunks_mut(CHUNK))
                .zip(g.par_chunks(CHUNK))
                .for_each(|((param, buf), g)| {
                    for ((p, b), &g) in param.iter_mut().zip(buf).zip(g) {
                        let g = coef * g + wd * *p;
                        *b = if first { g } else { momentum * *b + g };
                        *p -= lr * *b;
                    }
                });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCALARS: StepScalars = StepScalars {
        lr: 0.1,
        step: 3,
        loss_scale: Some(1024.0),
    };

    fn coef(max_norm: Option<f64>, loss_scale: Option<f64>, sumsq: f32) -> f32 {
        let mut out = [7.0];
        clip_coef(max_norm, loss_scale, &[sumsq], &mut out);
        out[0]
    }

    #[test]
    fn a_power_of_two_loss_scale_divides_out_of_the_clip_coefficient_exactly() {
        for max_norm in [None, Some(1.0), Some(100.0)] {
            for sumsq in [0.0f32, 0.37, 7.3, 5e4] {
                let plain = coef(max_norm, None, sumsq);
                let scaled = coef(max_norm, Some(1024.0), sumsq * 1024.0 * 1024.0);
                assert_eq!(
                    scaled.to_bits(),
                    (plain / 1024.0).to_bits(),
                    "{max_norm:?} {sumsq}"
                );
            }
        }
    }

    #[test]
    fn a_sum_that_is_not_finite_marks_the_step_with_or_without_loss_scaling() {
        for bad in [f32::INFINITY, f32::NAN] {
            for (max_norm, loss_scale) in [
                (None, Some(65536.0)),
                (Some(1.0), Some(65536.0)),
                (None, None),
                (Some(1.0), None),
            ] {
                assert!(
                    coef(max_norm, loss_scale, bad).is_nan(),
                    "{max_norm:?} {loss_scale:?}"
                );
            }
        }
        // A finite sum without clipping or scaling: exactly 1, as before.
        assert_eq!(coef(None, None, 1e30).to_bits(), 1.0f32.to_bits());
    }

    #[test]
    fn updates_with_a_non_finite_coefficient_leave_everything_untouched() {
        let g = [1.0f32, -2.0, f32::INFINITY];
        let config = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let (mut p, mut m, mut v) = ([0.5f32, 1.5, -2.5], [0.1f32, 0.2, 0.3], [0.01f32; 3]);
        let before = (p, m, v);
        adamw(&config, &SCALARS, &g, &[f32::NAN], &mut p, &mut m, &mut v);
        assert_eq!((p, m, v), before);
        let (mut p, mut buf) = ([0.5f32, 1.5, -2.5], [0.1f32, 0.2, 0.3]);
        sgd(0.9, 0.1, &SCALARS, &g, &[f32::NAN], &mut p, Some(&mut buf));
        assert_eq!((p, buf), ([0.5, 1.5, -2.5], [0.1, 0.2, 0.3]));
        sgd(0.0, 0.0, &SCALARS, &g, &[f32::INFINITY], &mut p, None);
        assert_eq!(p, [0.5, 1.5, -2.5]);
        // A finite coefficient still updates.
        sgd(0.0, 0.0, &SCALARS, &g[..2], &[0.5], &mut p[..2], None);
        assert_eq!(p[..2], [0.45, 1.6]);
    }
}
