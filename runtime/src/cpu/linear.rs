//! Linear layers: `y = x Wᵀ (+ b)` with `W` `[out, in]`, and its data and weight gradients,
//! through the `gemm` crate (blocked, SIMD, multithreaded on the current rayon pool). gemm's
//! reduction order along `k` depends only on the problem shape, so results are bit-identical
//! whatever the thread count.
//!
//! `gemm` takes raw pointers and strides; [`Strided`] checks every operand's extent against its
//! slice before the call, which is what makes the one `unsafe` block sound.
use super::args::{expect_len, op_error, product, rows_of};
use super::par::{accumulate_rows, rows_per_task};
use crate::error::Result;
use rayon::prelude::*;

/// A `rows × cols` matrix view with element `(i, j)` at `i * row_stride + j * col_stride`.
#[derive(Clone, Copy)]
struct Strided {
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl Strided {
    fn row_major(rows: usize, cols: usize) -> Strided {
        Strided {
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major `cols × rows` matrix, viewed as `rows × cols`.
    fn transposed(rows: usize, cols: usize) -> Strided {
        Strided {
            rows,
            cols,
            row_stride: 1,
            col_stride: rows,
        }
    }

    /// Whether every element lies inside a slice of `len` elements.
    fn fits(self, len: usize) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        let last = (self.rows - 1).checked_mul(self.row_stride).and_then(|a| {
            (self.cols - 1)
                .checked_mul(self.col_stride)
                .and_then(|b| a.checked_add(b))
        });
        matches!(last, Some(last) if last < len && isize::try_from(last).is_ok())
    }

    fn strides(self) -> (isize, isize) {
        // `fits` proved both products fit in isize, so the strides do too.
        (self.row_stride as isize, self.col_stride as isize)
    }
}

/// `dst (+)= lhs · rhs` with `dst` `m × n`, `lhs` `m × k`, `rhs` `k × n`.
fn gemm_checked(
    op: &str,
    dst: (&mut [f32], Strided),
    accumulate: bool,
    lhs: (&[f32], Strided),
    rhs: (&[f32], Strided),
) -> Result<()> {
    let (dst, dst_view) = dst;
    let (lhs, lhs_view) = lhs;
    let (rhs, rhs_view) = rhs;
    let (m, n, k) = (dst_view.rows, dst_view.cols, lhs_view.cols);
    if lhs_view.rows != m || rhs_view.rows != k || rhs_view.cols != n {
        return Err(op_error(op, "internal gemm shape mismatch"));
    }
    if !dst_view.fits(dst.len()) || !lhs_view.fits(lhs.len()) || !rhs_view.fits(rhs.len()) {
        return Err(op_error(op, "internal gemm operand out of bounds"));
    }
    let (dst_rs, dst_cs) = dst_view.strides();
    let (lhs_rs, lhs_cs) = lhs_view.strides();
    let (rhs_rs, rhs_cs) = rhs_view.strides();
    // SAFETY: every operand's extent was checked against its slice above; `dst` is a unique
    // borrow that does not alias `lhs` or `rhs` (shared borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_cs,
            dst_rs,
            accumulate,
            lhs.as_ptr(),
            lhs_cs,
            lhs_rs,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
    Ok(())
}

/// `y = x Wᵀ (+ b)`: x `[rows, in]`, w `[out, in]`, b `[out]`, y `[rows, out]`.
pub(crate) fn matmul(
    op: &str,
    in_dim: usize,
    out_dim: usize,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    y: &mut [f32],
) -> Result<()> {
    let rows = rows_of(op, "x", x.len(), in_dim)?;
    expect_len(op, "w", w.len(), product(op, "w", &[out_dim, in_dim])?)?;
    expect_len(op, "y", y.len(), product(op, "y", &[rows, out_dim])?)?;
    if let Some(b) = b {
        expect_len(op, "b", b.len(), out_dim)?;
    }
    gemm_checked(
        op,
        (y, Strided::row_major(rows, out_dim)),
        false,
        (x, Strided::row_major(rows, in_dim)),
        (w, Strided::transposed(in_dim, out_dim)),
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

/// `dx = dy W`: dy `[rows, out]`, w `[out, in]`, dx `[rows, in]`.
pub(crate) fn matmul_bwd_data(
    op: &str,
    in_dim: usize,
    out_dim: usize,
    dy: &[f32],
    w: &[f32],
    dx: &mut [f32],
) -> Result<()> {
    let rows = rows_of(op, "dy", dy.len(), out_dim)?;
    expect_len(op, "w", w.len(), product(op, "w", &[out_dim, in_dim])?)?;
    expect_len(op, "dx", dx.len(), product(op, "dx", &[rows, in_dim])?)?;
    gemm_checked(
        op,
        (dx, Strided::row_major(rows, in_dim)),
        false,
        (dy, Strided::row_major(rows, out_dim)),
        (w, Strided::row_major(out_dim, in_dim)),
    )
}

/// `dw += dyᵀ x`, `db += Σ_rows dy`: dy `[rows, out]`, x `[rows, in]`, dw `[out, in]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_bwd_weight(
    op: &str,
    in_dim: usize,
    out_dim: usize,
    dy: &[f32],
    x: &[f32],
    dw: &mut [f32],
    db: Option<&mut [f32]>,
) -> Result<()> {
    let rows = rows_of(op, "dy", dy.len(), out_dim)?;
    expect_len(op, "x", x.len(), product(op, "x", &[rows, in_dim])?)?;
    expect_len(op, "dw", dw.len(), product(op, "dw", &[out_dim, in_dim])?)?;
    if let Some(db) = &db {
        expect_len(op, "db", db.len(), out_dim)?;
    }
    gemm_checked(
        op,
        (dw, Strided::row_major(out_dim, in_dim)),
        true,
        (dy, Strided::transposed(out_dim, rows)),
        (x, Strided::row_major(rows, in_dim)),
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
