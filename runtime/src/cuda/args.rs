//! What the family modules hand a kernel: the bound operands (`crate::bind::Bound`, checked
//! against the op table before any family code runs) turned into kernel arguments (`p`, `fv`,
//! `n`; an activation's kernel code is `Act::code`), and the limits that are the CUDA kernels' own rather than the op's: a
//! dimension or a row count that a launch indexes in 32 bits must stay below 2^31 ([`Limits`]).
use super::{Arg, Buf, FloatArg};
use crate::error::Result;

/// An op's buffers bound to its signature (`crate::bind`), as the family modules read them.
pub(super) type Bound<'a> = crate::bind::Bound<'a, Buf>;

/// The device pointer of `b` (an f32 or i32 operand).
pub(super) fn p(b: Buf) -> Arg {
    Arg::Ptr(b.ptr)
}

/// A Float operand (f32 or bf16) as its kernel takes it.
pub(super) fn fv(b: Buf) -> Arg {
    Arg::Float(FloatArg::at(b, 0))
}

/// A count or size as the kernels' `long long`.
pub(super) fn n(v: usize) -> Arg {
    Arg::I64(v as i64)
}

/// An activation as the kernels' `act` argument (kernels/elementwise.cu).
/// The most a launch indexes in 32 bits (grid extents, the kernels' `int` row counters).
const LAUNCH_MAX: usize = i32::MAX as usize;

/// The CUDA kernels' own limits on an op `bind` already checked against its signature.
pub(super) trait Limits {
    /// A dimension attribute, positive and below 2^31.
    fn launch_dim(&self, name: &str, value: u64) -> Result<usize>;
    /// `rows` rows of buffer `b` (named `what`), no more than one launch covers.
    fn launch_rows(&self, b: Buf, what: &str, rows: usize) -> Result<usize>;
}

impl Limits for Bound<'_> {
    fn launch_dim(&self, name: &str, value: u64) -> Result<usize> {
        let v = self.dim(name, value)?;
        if v > LAUNCH_MAX {
            return Err(self.err(format!("{name} = {value} must be in 1..2^31")));
        }
        Ok(v)
    }

    fn launch_rows(&self, b: Buf, what: &str, rows: usize) -> Result<usize> {
        if rows > LAUNCH_MAX {
            return Err(self.err(format!(
                "{what} (buffer {}) has {rows} rows, more than one launch covers (2^31 - 1)",
                b.id.0
            )));
        }
        Ok(rows)
    }
}
