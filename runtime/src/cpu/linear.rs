//! Linear layers: `y = x Wᵀ (+ b)` with `W` `[out, in]`, and its data and weight gradients, as
//! dense products (`dense`) on the current rayon pool.
use super::args::{expect_len, expect_shape, rows_of};
use super::dense::{gemm_checked, Strided, Threads};
use super::par::{accumulate_rows, rows_per_task};
use crate::error::Result;
use rayon::prelude::*;

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
