//! Linear layers: `y = x Wᵀ (+ b)` with `W` `[out, in]` (optionally plus a residual and
//! followed by an activation), and its data and weight gradients (the data gradient optionally
//! times an activation's derivative), as dense products (`dense`) on the current rayon pool.
use super::args::{dim, expect_len, expect_shape, first_write, op_error, rows_of};
use super::args::{Inputs, Outputs};
use super::dense::{gemm_checked, Strided, Threads};
use super::elementwise::{activation, activation_bwd_in_place, add_in_place};
use super::par::{accumulate_rows, rows_per_task};
use crate::backend::StepScalars;
use crate::error::Result;
use parc_compiler::ir::op::Op;
use rayon::prelude::*;

/// The matmul family's entry point (see `dispatch`).
pub(crate) fn run(
    op: &Op,
    ins: &Inputs,
    outs: &mut Outputs,
    _: &StepScalars,
    threads: Threads,
) -> Result<()> {
    let name = ins.op;
    match op {
        Op::Matmul {
            in_dim,
            out_dim,
            bias,
            act,
            residual,
        } => {
            let b = if *bias { Some(ins.f32(2)?) } else { None };
            let r = if *residual {
                Some(ins.f32(2 + usize::from(*bias))?)
            } else {
                None
            };
            let (i, o) = (
                dim(name, "in_dim", *in_dim)?,
                dim(name, "out_dim", *out_dim)?,
            );
            let (x, w) = (ins.f32(0)?, ins.f32(1)?);
            // y = x Wᵀ + b, then + r (what an `Add` after it computes), then the activation
            // from y's f32 value (before a bf16 y is rounded).
            let product = |y: &mut [f32]| -> Result<()> {
                matmul(name, threads, i, o, x, w, b, y)?;
                match r {
                    Some(r) => add_in_place(name, r, y),
                    None => Ok(()),
                }
            };
            match act {
                None => {
                    let [y] = outs.f32s()?;
                    product(y)
                }
                Some(act) => {
                    let [y, a] = outs.f32s()?;
                    product(y)?;
                    activation(name, *act, y, a)
                }
            }
        }
        Op::MatmulBwdData {
            in_dim,
            out_dim,
            accumulate,
            act_grad,
        } => {
            let [dx] = outs.f32s()?;
            let (i, o) = (
                dim(name, "in_dim", *in_dim)?,
                dim(name, "out_dim", *out_dim)?,
            );
            let (dy, w) = (ins.f32(0)?, ins.f32(1)?);
            matmul_bwd_data(name, threads, i, o, dy, w, dx, *accumulate)?;
            match act_grad {
                None => Ok(()),
                Some(_) if *accumulate => Err(op_error(
                    name,
                    "an activation-gradient product (act_grad) cannot accumulate into dx \
                     (the verifier rejects it, E0822)",
                )),
                // The product's f32 value times act'(pre), rounded once when dx is written.
                Some(act) => activation_bwd_in_place(name, *act, ins.f32(2)?, dx),
            }
        }
        Op::MatmulBwdWeight {
            in_dim,
            out_dim,
            bias,
            accumulate_param_grad,
        } => {
            let (i, o) = (
                dim(name, "in_dim", *in_dim)?,
                dim(name, "out_dim", *out_dim)?,
            );
            let (dy, x) = (ins.f32(0)?, ins.f32(1)?);
            if *bias {
                let [dw, db] = outs.f32s()?;
                first_write(*accumulate_param_grad, [&mut *dw, &mut *db]);
                matmul_bwd_weight(name, threads, i, o, dy, x, dw, Some(db))
            } else {
                let [dw] = outs.f32s()?;
                first_write(*accumulate_param_grad, [&mut *dw]);
                matmul_bwd_weight(name, threads, i, o, dy, x, dw, None)
            }
        }
        _ => Err(ins.unrouted("matmul")),
    }
}

/// `y = x Wᵀ (+ b)`: x `[rows, in]`, w `[out, in]`, b `[out]`, y `[rows, out]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    op: &str,
    threads: Threads,
    in_dim: usize,
    out_dim: usize,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    y: &mut [f32],
) -> Result<()> {
    let rows = rows_of(op, "x", x.len(), in_dim)?;
    expect_shape(op, "w", w.len(), &[out_dim, in_dim])?;
    expect_shape(op, "y", y.len(), &[rows, out_dim])?;
    if let Some(b) = b {
        expect_len(op, "b", b.len(), out_dim)?;
    }
    gemm_checked(
        op,
        (y, Strided::row_major(rows, out_dim)),
        false,
        (x, Strided::row_major(rows, in_dim)),
        (w, Strided::transposed(in_dim, out_dim)),
        threads,
    )?;
    if let Some(b) = b {
        y.par_chunks_mut(out_dim)
            .with_min_len(rows_per_task(out_dim))
            .for_each(|row| {
                for (y, &b) in row.iter_mut().zip(b) {
                    *y += b;
                }
            });
    }
    Ok(())
}

/// `dx = dy W`, or with `accumulate` `dx += dy W`: dy `[rows, out]`, w `[out, in]`, dx
/// `[rows, in]`. Accumulating adds the finished product to each element once (the product is
/// formed apart first: the GEMM's own accumulation would add it in k-blocks), so the result
/// is bit-identical to an `Add` of the old dx and a separate product.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_bwd_data(
    op: &str,
    threads: Threads,
    in_dim: usize,
    out_dim: usize,
    dy: &[f32],
    w: &[f32],
    dx: &mut [f32],
    accumulate: bool,
) -> Result<()> {
    let rows = rows_of(op, "dy", dy.len(), out_dim)?;
    expect_shape(op, "w", w.len(), &[out_dim, in_dim])?;
    expect_shape(op, "dx", dx.len(), &[rows, in_dim])?;
    let product_into = |out: &mut [f32]| {
        gemm_checked(
            op,
            (out, Strided::row_major(rows, in_dim)),
            false,
            (dy, Strided::row_major(rows, out_dim)),
            (w, Strided::row_major(out_dim, in_dim)),
            threads,
        )
    };
    if !accumulate {
        return product_into(dx);
    }
    let mut part = vec![0.0f32; dx.len()];
    product_into(&mut part)?;
    dx.par_chunks_mut(in_dim)
        .zip(part.par_chunks(in_dim))
        .with_min_len(rows_per_task(in_dim))
        .for_each(|(dx, part)| {
            for (d, &p) in dx.iter_mut().zip(part) {
                *d += p;
            }
        });
    Ok(())
}

/// `dw += dyᵀ x`, `db += Σ_rows dy`: dy `[rows, out]`, x `[rows, in]`, dw `[out, in]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_bwd_weight(
    op: &str,
    threads: Threads,
    in_dim: usize,
    out_dim: usize,
    dy: &[f32],
    x: &[f32],
    dw: &mut [f32],
    db: Option<&mut [f32]>,
) -> Result<()> {
    let rows = rows_of(op, "dy", dy.len(), out_dim)?;
    expect_shape(op, "x", x.len(), &[rows, in_dim])?;
    expect_shape(op, "dw", dw.len(), &[out_dim, in_dim])?;
    if let Some(db) = &db {
        expect_len(op, "db", db.len(), out_dim)?;
    }
    gemm_checked(
        op,
        (dw, Strided::row_major(out_dim, in_dim)),
        true,
        (dy, Strided::transposed(out_dim, rows)),
        (x, Strided::row_major(rows, in_dim)),
        threads,
    )?;
    if let Some(db) = db {
        accumulate_rows(rows, db, |row, partial| {
            for (p, &g) in partial
                .iter_mut()
                .zip(&dy[row * out_dim..(row + 1) * out_dim])
            {
                *p += f64::from(g);
            }
        });
    }
    Ok(())
}
