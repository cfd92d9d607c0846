//! Dense matrix products `dst (+)= lhs · rhs` on strided views, through the `gemm` crate
//! (blocked, SIMD, optionally multithreaded on the current rayon pool). gemm's reduction order
//! along `k` depends only on the problem shape, never on the thread count, so results are
//! bit-identical whatever the parallelism.
//!
//! `gemm` takes raw pointers and strides; [`Strided`] checks every operand's extent against its
//! slice before the call, which is what makes the one `unsafe` block sound.
use super::args::op_error;
use crate::error::Result;

/// A `rows × cols` matrix view with element `(i, j)` at `i * row_stride + j * col_stride`.
#[derive(Clone, Copy)]
pub(crate) struct Strided {
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl Strided {
    pub(crate) fn row_major(rows: usize, cols: usize) -> Strided {
        Strided {
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major `cols × rows` matrix, viewed as `rows × cols`.
    pub(crate) fn transposed(rows: usize, cols: usize) -> Strided {
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

/// Where a product runs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Threads {
    /// Split over the current rayon pool.
    Pool,
    /// On the calling thread (inside an already parallel task).
    Caller,
}

/// `dst (+)= lhs · rhs` with `dst` `m × n`, `lhs` `m × k`, `rhs` `k × n`.
pub(crate) fn gemm_checked(
    op: &str,
    dst: (&mut [f32], Strided),
    accumulate: bool,
    lhs: (&[f32], Strided),
    rhs: (&[f32], Strided),
    threads: Threads,
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
    let parallelism = match threads {
        Threads::Pool => ::gemm::Parallelism::Rayon(0),
        Threads::Caller => ::gemm::Parallelism::None,
    };
    // SAFETY: every operand's extent was checked against its slice above; `dst` is a unique
    // borrow that does not alias `lhs` or `rhs` (shared borrows).
    unsafe {
        ::gemm::gemm(
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
            parallelism,
        );
    }
    Ok(())
}
