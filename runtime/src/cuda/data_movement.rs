//! The data-movement family on the GPU: `Copy`, `CopyRange` and `Zero` (stream-ordered byte
//! copies and memsets where source and destination share a dtype, else the `convert` kernel),
//! and `SplitColumns` / `ConcatColumns` (`copy_columns`, one launch a part, strided rows).
use super::args::{n, Bound, Limits};
use super::kernel::Kernel;
use super::{Arg, Buf, CudaBackend, FloatArg};
use crate::error::Result;
use parc_compiler::ir::op::Op;

/// Run an op of the data-movement family.
pub(super) fn run(be: &mut CudaBackend, b: &Bound) -> Result<()> {
    match b.op {
        Op::Copy => {
            let x = b.input(0)?;
            copy_elements(be, x, 0, b.output(0)?, 0, x.len)
        }
        Op::Zero => {
            let y = b.output(0)?;
            be.zero_bytes(y.ptr, y.bytes())
        }
        Op::SplitColumns { widths } => columns(be, b, widths, true),
        Op::ConcatColumns { widths } => columns(be, b, widths, false),
        Op::CopyRange {
            src_offset,
            dst_offset,
            len,
        } => {
            let (src, dst) = (b.input(0)?, b.output(0)?);
            for (what, offset, buf) in [("src", *src_offset, src), ("dst", *dst_offset, dst)] {
                if offset
                    .checked_add(*len)
                    .is_none_or(|end| end > buf.len as u64)
                {
                    return Err(b.err(format!(
                        "{what} range {offset}..{offset}+{len} is outside its {} elements",
                        buf.len
                    )));
                }
            }
            // In range of both buffers (checked above), so each fits a usize.
            let (src_at, dst_at) = (*src_offset as usize, *dst_offset as usize);
            copy_elements(be, src, src_at, dst, dst_at, *len as usize)
        }
        _ => Err(b.err("is not a data-movement op")),
    }
}

/// Splits the whole matrix (input 0, `split`) into column blocks of `widths` (the outputs), or
/// concatenates the inputs into it (output 0).
fn columns(be: &mut CudaBackend, b: &Bound, widths: &[u64], split: bool) -> Result<()> {
    let whole = if split { b.input(0)? } else { b.output(0)? };
    let cols = b.launch_dim("total width", widths.iter().sum())?;
    let rows = b.launch_rows(whole, "the whole matrix", b.rows)?;
    let mut col = 0usize;
    for (i, &w) in widths.iter().enumerate() {
        let w = b.launch_dim("width", w)?;
        let (x, x_ld, y, y_ld) = if split {
            let part = b.output(i)?;
            (FloatArg::at(whole, col), cols, FloatArg::at(part, 0), w)
        } else {
            let part = b.input(i)?;
            (FloatArg::at(part, 0), w, FloatArg::at(whole, col), cols)
        };
        let args = [
            Arg::Float(x),
            n(x_ld),
            Arg::Float(y),
            n(y_ld),
            n(rows),
            n(w),
        ];
        be.launch_vec(Kernel::CopyColumns, rows * w, &args)?;
        col += w;
    }
    Ok(())
}

/// y[dst..dst+len] = x[src..src+len] (element offsets): a byte copy where both have one
/// dtype, else a conversion (f32 → bf16 rounds to nearest-even, bf16 → f32 widens exactly).
fn copy_elements(
    be: &mut CudaBackend,
    x: Buf,
    src: usize,
    y: Buf,
    dst: usize,
    len: usize,
) -> Result<()> {
    if x.dtype == y.dtype {
        let bytes = x.elem_bytes();
        return be.copy_bytes(
            y.ptr + (dst * bytes) as u64,
            x.ptr + (src * bytes) as u64,
            len * bytes,
        );
    }
    let args = [
        Arg::Float(FloatArg::at(x, src)),
        Arg::Float(FloatArg::at(y, dst)),
        n(len),
    ];
    be.launch_vec(Kernel::Convert, len, &args)
}
