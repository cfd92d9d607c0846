//! LayerNorm and RMSNorm, forward and backward, over the last dimension of `[rows, dim]`.
//! Row statistics are accumulated in f64; rows run in parallel; the weight/bias gradients are
//! deterministic fixed-block column sums (`par::accumulate_rows`).
use super::args::{Inputs, Outputs};
use super::par::{accumulate_column_sums, accumulate_rows, rows_per_task};
use crate::error::Result;
use parc_compiler::ir::op::Op;
use rayon::prelude::*;

/// The norm family's entry point (see `dispatch`).
pub(crate) fn run(op: &Op, ins: &Inputs, outs: &mut Outputs) -> Result<()> {
    match op {
        Op::LayerNorm { dim, eps, .. } => {
            let (d, eps) = (ins.dim("dim", *dim)?, checked_eps(ins, *eps)?);
            let (x, w, b) = (ins.f32("x")?, ins.f32("w")?, ins.optional_f32("b")?);
            let (y, mean, rstd) = (outs.f32("y")?, outs.f32("mean")?, outs.f32("rstd")?);
            layer_norm(d, eps, x, w, b, y, mean, rstd);
        }
        Op::LayerNormBwd {
            dim, accumulate, ..
        } => {
            let d = ins.dim("dim", *dim)?;
            let (dy, x, w) = (ins.f32("dy")?, ins.f32("x")?, ins.f32("w")?);
            let (mean, rstd) = (ins.f32("mean")?, ins.f32("rstd")?);
            let dx = (outs.f32("dx")?, *accumulate);
            let (dw, db) = (outs.accumulator("dw")?, outs.optional_accumulator("db")?);
            layer_norm_bwd(d, dy, x, w, mean, rstd, dx, dw, db);
        }
        Op::RmsNorm { dim, eps } => {
            let (d, eps) = (ins.dim("dim", *dim)?, checked_eps(ins, *eps)?);
            let (x, w) = (ins.f32("x")?, ins.f32("w")?);
            rms_norm(d, eps, x, w, outs.f32("y")?, outs.f32("rstd")?);
        }
        Op::RmsNormBwd {
            dim, accumulate, ..
        } => {
            let d = ins.dim("dim", *dim)?;
            let (dy, x, w, rstd) = (
                ins.f32("dy")?,
                ins.f32("x")?,
                ins.f32("w")?,
                ins.f32("rstd")?,
            );
            let dx = (outs.f32("dx")?, *accumulate);
            rms_norm_bwd(d, dy, x, w, rstd, dx, outs.accumulator("dw")?);
        }
        _ => return Err(ins.unrouted("norm")),
    }
    Ok(())
}

/// A norm's `eps`, which must be non-negative.
fn checked_eps(ins: &Inputs, eps: f64) -> Result<f64> {
    if eps.is_nan() || eps < 0.0 {
        return Err(ins.err(format!("eps = {eps} must be non-negative")));
    }
    Ok(eps)
}

/// LayerNorm: `y = (x − mean)·rstd·w (+ b)`, `rstd = 1/√(var + eps)` (biased variance).
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm(
    dim: usize,
    eps: f64,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
) {
    y.par_chunks_mut(dim)
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .zip(x.par_chunks(dim))
        .with_min_len(rows_per_task(dim))
        .for_each(|((y, (mean, rstd)), x)| {
            let m = x.iter().map(|&v| f64::from(v)).sum::<f64>() / dim as f64;
            let var = x.iter().map(|&v| (f64::from(v) - m).powi(2)).sum::<f64>() / dim as f64;
            *mean = m as f32;
            *rstd = (1.0 / (var + eps).sqrt()) as f32;
            for (j, (y, &x)) in y.iter_mut().zip(x).enumerate() {
                let shift = b.map_or(0.0, |b| b[j]);
                *y = (x - *mean) * *rstd * w[j] + shift;
            }
        });
}

/// `dst` set to `v`, or `v` added to it (the op's `accumulate`: one f32 addition of the
/// finished value, as an `Add` of the old dx and a separate dx would compute).
fn store(dst: &mut f32, v: f32, accumulate: bool) {
    if accumulate {
        *dst += v;
    } else {
        *dst = v;
    }
}

/// LayerNorm backward: `dx (+)= rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂))` with `ĝ = dy·w`,
/// `x̂ = (x − mean)·rstd`; `dw += Σ dy·x̂`, `db += Σ dy`. `accumulate`: dx is added into.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_bwd(
    dim: usize,
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    mean: &[f32],
    rstd: &[f32],
    (dx, accumulate): (&mut [f32], bool),
    dw: &mut [f32],
    db: Option<&mut [f32]>,
) {
    let rows = x.len() / dim;
    let xhat = |row: usize, j: usize| (x[row * dim + j] - mean[row]) * rstd[row];
    dx.par_chunks_mut(dim)
        .enumerate()
        .with_min_len(rows_per_task(dim))
        .for_each(|(row, dx)| {
            let dy = &dy[row * dim..(row + 1) * dim];
            let mut sum_g = 0.0f64;
            let mut sum_gx = 0.0f64;
            for j in 0..dim {
                let g = f64::from(dy[j] * w[j]);
                sum_g += g;
                sum_gx += g * f64::from(xhat(row, j));
            }
            let mean_g = (sum_g / dim as f64) as f32;
            let mean_gx = (sum_gx / dim as f64) as f32;
            for (j, dx) in dx.iter_mut().enumerate() {
                let v = rstd[row] * (dy[j] * w[j] - mean_g - xhat(row, j) * mean_gx);
                store(dx, v, accumulate);
            }
        });
    accumulate_rows(rows, dw, |row, partial| {
        for (j, p) in partial.iter_mut().enumerate() {
            *p += f64::from(dy[row * dim + j] * xhat(row, j));
        }
    });
    if let Some(db) = db {
        accumulate_column_sums(db, dy);
    }
}

/// RMSNorm: `y = x·rstd·w`, `rstd = 1/√(mean(x²) + eps)`.
pub(crate) fn rms_norm(
    dim: usize,
    eps: f64,
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    rstd: &mut [f32],
) {
    y.par_chunks_mut(dim)
        .zip(rstd.par_iter_mut())
        .zip(x.par_chunks(dim))
        .with_min_len(rows_per_task(dim))
        .for_each(|((y, rstd), x)| {
            let ms = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / dim as f64;
            *rstd = (1.0 / (ms + eps).sqrt()) as f32;
            for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                *y = x * *rstd * w;
            }
        });
}

/// RMSNorm backward: `dx = rstd·(ĝ − x̂·mean(ĝ·x̂))` with `ĝ = dy·w`, `x̂ = x·rstd`;
/// `dw += Σ dy·x̂`.
pub(crate) fn rms_norm_bwd(
    dim: usize,
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    (dx, accumulate): (&mut [f32], bool),
    dw: &mut [f32],
) {
    let rows = x.len() / dim;
    dx.par_chunks_mut(dim)
        .enumerate()
        .with_min_len(rows_per_task(dim))
        .for_each(|(row, dx)| {
            let dy = &dy[row * dim..(row + 1) * dim];
            let x = &x[row * dim..(row + 1) * dim];
            let r = rstd[row];
            let sum_gx: f64 = (0..dim)
                .map(|j| f64::from(dy[j] * w[j]) * f64::from(x[j] * r))
                .sum();
            let mean_gx = (sum_gx / dim as f64) as f32;
            for (j, dx) in dx.iter_mut().enumerate() {
                store(dx, r * (dy[j] * w[j] - x[j] * r * mean_gx), accumulate);
            }
        });
    accumulate_rows(rows, dw, |row, partial| {
        for (j, p) in partial.iter_mut().enumerate() {
            *p += f64::from(dy[row * dim + j] * x[row * dim + j] * rstd[row]);
        }
    });
}
