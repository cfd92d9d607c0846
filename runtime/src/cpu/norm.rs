//! LayerNorm and RMSNorm, forward and backward, over the last dimension of `[rows, dim]`.
//! Row statistics are accumulated in f64; rows run in parallel; the weight/bias gradients are
//! deterministic fixed-block column sums (`par::accumulate_rows`).
use super::args::{dim, expect_len, first_write, op_error, rows_of, Inputs, Outputs};
use super::dense::Threads;
use super::par::{accumulate_rows, rows_per_task};
use crate::backend::StepScalars;
use crate::error::Result;
use parc_compiler::ir::op::Op;
use rayon::prelude::*;

/// The norm family's entry point (see `dispatch`).
pub(crate) fn run(
    op: &Op,
    ins: &Inputs,
    outs: &mut Outputs,
    _: &StepScalars,
    _: Threads,
) -> Result<()> {
    let name = ins.op;
    match op {
        Op::LayerNorm { dim: d, eps, bias } => {
            let b = if *bias { Some(ins.f32(2)?) } else { None };
            let [y, mean, rstd] = outs.f32s()?;
            let d = dim(name, "dim", *d)?;
            layer_norm(name, d, *eps, ins.f32(0)?, ins.f32(1)?, b, y, mean, rstd)
        }
        Op::LayerNormBwd {
            dim: d,
            bias,
            accumulate,
            accumulate_param_grad,
        } => {
            let d = dim(name, "dim", *d)?;
            let (dy, x, w) = (ins.f32(0)?, ins.f32(1)?, ins.f32(2)?);
            let (mean, rstd) = (ins.f32(3)?, ins.f32(4)?);
            if *bias {
                let [dx, dw, db] = outs.f32s()?;
                first_write(*accumulate_param_grad, [&mut *dw, &mut *db]);
                let dx = (dx, *accumulate);
                layer_norm_bwd(name, d, dy, x, w, mean, rstd, dx, dw, Some(db))
            } else {
                let [dx, dw] = outs.f32s()?;
                first_write(*accumulate_param_grad, [&mut *dw]);
                layer_norm_bwd(name, d, dy, x, w, mean, rstd, (dx, *accumulate), dw, None)
            }
        }
        Op::RmsNorm { dim: d, eps } => {
            let [y, rstd] = outs.f32s()?;
            let d = dim(name, "dim", *d)?;
            rms_norm(name, d, *eps, ins.f32(0)?, ins.f32(1)?, y, rstd)
        }
        Op::RmsNormBwd {
            dim: d,
            accumulate,
            accumulate_param_grad,
        } => {
            let [dx, dw] = outs.f32s()?;
            first_write(*accumulate_param_grad, [&mut *dw]);
            let d = dim(name, "dim", *d)?;
            let (dy, x, w, rstd) = (ins.f32(0)?, ins.f32(1)?, ins.f32(2)?, ins.f32(3)?);
            rms_norm_bwd(name, d, dy, x, w, rstd, (dx, *accumulate), dw)
        }
        _ => Err(ins.unrouted("norm")),
    }
}

/// LayerNorm: `y = (x − mean)·rstd·w (+ b)`, `rstd = 1/√(var + eps)` (biased variance).
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm(
    op: &str,
    dim: usize,
    eps: f64,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
) -> Result<()> {
    let rows = rows_of(op, "x", x.len(), dim)?;
    expect_len(op, "w", w.len(), dim)?;
    if let Some(b) = b {
        expect_len(op, "b", b.len(), dim)?;
    }
    expect_len(op, "y", y.len(), x.len())?;
    expect_len(op, "mean", mean.len(), rows)?;
    expect_len(op, "rstd", rstd.len(), rows)?;
    if eps.is_nan() || eps < 0.0 {
        return Err(op_error(op, format!("eps = {eps} must be non-negative")));
    }
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
    Ok(())
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
    op: &str,
    dim: usize,
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    mean: &[f32],
    rstd: &[f32],
    (dx, accumulate): (&mut [f32], bool),
    dw: &mut [f32],
    db: Option<&mut [f32]>,
) -> Result<()> {
    let rows = rows_of(op, "x", x.len(), dim)?;
    expect_len(op, "dy", dy.len(), x.len())?;
    expect_len(op, "w", w.len(), dim)?;
    expect_len(op, "mean", mean.len(), rows)?;
    expect_len(op, "rstd", rstd.len(), rows)?;
    expect_len(op, "dx", dx.len(), x.len())?;
    expect_len(op, "dw", dw.len(), dim)?;
    if let Some(db) = &db {
        expect_len(op, "db", db.len(), dim)?;
    }
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
        accumulate_rows(rows, db, |row, partial| {
            for (p, &g) in partial.iter_mut().zip(&dy[row * dim..(row + 1) * dim]) {
                *p += f64::from(g);
            }
        });
    }
    Ok(())
}

/// RMSNorm: `y = x·rstd·w`, `rstd = 1/√(mean(x²) + eps)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm(
    op: &str,
    dim: usize,
    eps: f64,
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    rstd: &mut [f32],
) -> Result<()> {
    let rows = rows_of(op, "x", x.len(), dim)?;
    expect_len(op, "w", w.len(), dim)?;
    expect_len(op, "y", y.len(), x.len())?;
    expect_len(op, "rstd", rstd.len(), rows)?;
    if eps.is_nan() || eps < 0.0 {
        return Err(op_error(op, format!("eps = {eps} must be non-negative")));
    }
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
    Ok(())
}

/// RMSNorm backward: `dx = rstd·(ĝ − x̂·mean(ĝ·x̂))` with `ĝ = dy·w`, `x̂ = x·rstd`;
/// `dw += Σ dy·x̂`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_bwd(
    op: &str,
    dim: usize,
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    (dx, accumulate): (&mut [f32], bool),
    dw: &mut [f32],
) -> Result<()> {
    let rows = rows_of(op, "x", x.len(), dim)?;
    expect_len(op, "dy", dy.len(), x.len())?;
    expect_len(op, "w", w.len(), dim)?;
    expect_len(op, "rstd", rstd.len(), rows)?;
    expect_len(op, "dx", dx.len(), x.len())?;
    expect_len(op, "dw", dw.len(), dim)?;
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
    Ok(())
}
