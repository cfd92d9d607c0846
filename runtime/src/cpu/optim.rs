//! Optimizer ops: the squared-gradient-norm partial sum, the global-norm clip coefficient, and the
//! AdamW and SGD updates (in place on the master tensor and its state). The learning rate and the
//! 1-based step come from the executor's `StepScalars`.
use super::args::{expect_len, op_error};
use super::par::{sum_chunks, TASK_ELEMENTS};
use crate::backend::StepScalars;
use crate::error::Result;
use rayon::prelude::*;

/// Elements per rayon task for the updates.
const CHUNK: usize = TASK_ELEMENTS;

/// `sumsq[0] += Σ g²`.
pub(crate) fn sum_squares(op: &str, g: &[f32], sumsq: &mut [f32]) -> Result<()> {
    expect_len(op, "sumsq", sumsq.len(), 1)?;
    let total = sum_chunks(g.len(), |i| f64::from(g[i]).powi(2));
    sumsq[0] = (f64::from(sumsq[0]) + total) as f32;
    Ok(())
}

/// `coef = min(1, max_norm / (√sumsq + 1e-6))`, or 1 without clipping.
pub(crate) fn clip_coef(
    op: &str,
    max_norm: Option<f64>,
    sumsq: &[f32],
    coef: &mut [f32],
) -> Result<()> {
    expect_len(op, "sumsq", sumsq.len(), 1)?;
    expect_len(op, "coef", coef.len(), 1)?;
    coef[0] = match max_norm {
        None => 1.0,
        Some(max_norm) => (max_norm / (f64::from(sumsq[0]).sqrt() + 1e-6)).min(1.0) as f32,
    };
    Ok(())
}

fn check_step(op: &str, scalars: &StepScalars) -> Result<()> {
    if scalars.step == 0 {
        return Err(op_error(
            op,
            "the optimizer step count is 1-based; got step 0",
        ));
    }
    Ok(())
}

/// AdamW hyper-parameters (from the op).
pub(crate) struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// One AdamW step on `param` with moments `m`, `v` (see `Op::AdamW` for the formula).
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw(
    op: &str,
    config: &AdamWConfig,
    scalars: &StepScalars,
    g: &[f32],
    coef: &[f32],
    param: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
) -> Result<()> {
    check_step(op, scalars)?;
    expect_len(op, "coef", coef.len(), 1)?;
    for (what, len) in [("param", param.len()), ("m", m.len()), ("v", v.len())] {
        expect_len(op, what, len, g.len())?;
    }
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
    Ok(())
}

/// One SGD step: `g' = coef·g + wd·param`; with momentum `buf = momentum·buf + g'` (`buf = g'`
/// at step 1) and `param −= lr·buf`, else `param −= lr·g'`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgd(
    op: &str,
    momentum: f64,
    weight_decay: f64,
    scalars: &StepScalars,
    g: &[f32],
    coef: &[f32],
    param: &mut [f32],
    buf: Option<&mut [f32]>,
) -> Result<()> {
    check_step(op, scalars)?;
    expect_len(op, "coef", coef.len(), 1)?;
    expect_len(op, "param", param.len(), g.len())?;
    let (coef, wd, lr) = (coef[0], weight_decay as f32, scalars.lr as f32);
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
            expect_len(op, "momentum", buf.len(), g.len())?;
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
    Ok(())
}
