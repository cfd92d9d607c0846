//! Linear layers: `y = x Wᵀ (+ b)` with `W` `[out, in]` (optionally plus a residual and
//! followed by an activation), and its data and weight gradients (the data gradient optionally
//! times an activation's derivative), as dense products (`dense`) on the current rayon pool.
use super::args::{Inputs, Outputs};
use super::dense::{gemm_checked, Strided, Threads};
use super::elementwise::{activation, activation_bwd_in_place, add_in_place};
use super::par::{accumulate_column_sums, rows_per_task};
use crate::error::Result;
use parc_compiler::ir::op::Op;
use rayon::prelude::*;

/// The matmul family's entry point (see `dispatch`).
pub(crate) fn run(op: &Op, ins: &Inputs, outs: &mut Outputs, threads: Threads) -> Result<()> {
    let name = ins.name();
    let dims = |in_dim: u64, out_dim: u64| -> Result<(usize, usize)> {
        Ok((ins.dim("in_dim", in_dim)?, ins.dim("out_dim", out_dim)?))
    };
    match op {
        Op::Matmul {
            in_dim,
            out_dim,
            act,
            ..
        } => {
            let (i, o) = dims(*in_dim, *out_dim)?;
            let (x, w, b) = (ins.f32("x")?, ins.f32("w")?, ins.optional_f32("b")?);
            let y = outs.f32("y")?;
            // y = x Wᵀ + b, then + r (what an `Add` after it computes), then the activation
            // from y's f32 value (before a bf16 y is rounded).
            matmul(name, threads, i, o, x, w, b, y)?;
            if let Some(r) = ins.optional_f32("r")? {
                add_in_place(r, y);
            }
            if let Some(act) = act {
                activation(*act, y, outs.f32("a")?);
            }
        }
        Op::MatmulBwdData {
            in_dim,
            out_dim,
            accumulate,
            act_grad: act,
        } => {
            let (i, o) = dims(*in_dim, *out_dim)?;
            if act.is_some() && *accumulate {
                return Err(ins.err(
                    "an activation-gradient product (act_grad) cannot accumulate into dx \
                     (the verifier rejects it, E0822)",
                ));
            }
            let (dy, w, dx) = (ins.f32("dy")?, ins.f32("w")?, outs.f32("dx")?);
            matmul_bwd_data(name, threads, i, o, dy, w, dx, *accumulate)?;
            if let Some(act) = act {
                // The product's f32 value times act'(pre), rounded once when dx is written.
                activation_bwd_in_place(*act, ins.f32("pre")?, dx);
            }
        }
        Op::MatmulBwdWeight {
            in_dim, out_dim, ..
        } => {
            let (i, o) = dims(*in_dim, *out_dim)?;
            let (dy, x) = (ins.f32("dy")?, ins.f32("x")?);
            let (dw, db) = (outs.accumulator("dw")?, outs.optional_accumulator("db")?);
            matmul_bwd_weight(name, threads, i, o, dy, x, dw, db)?;
        }
        _ => return Err(ins.unrouted("matmul")),
    }
    Ok(())
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
    let rows = x.len() / in_dim;
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
    let rows = dy.len() / out_dim;
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
    add_in_place(&part, dx);
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
    let rows = dy.len() / out_dim;
    gemm_checked(
        op,
        (dw, Strided::row_major(out_dim, in_dim)),
        true,
        (dy, Strided::transposed(out_dim, rows)),
        (x, Strided::row_major(rows, in_dim)),
        threads,
    )?;
    if let Some(db) = db {
        accumulate_column_sums(db, dy);
    }
    Ok(())
}
