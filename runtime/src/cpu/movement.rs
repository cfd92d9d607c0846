//! Data movement: copy, zero, copy of a flat range, and the column split and concatenation of
//! a `[rows, Σ widths]` matrix (which packed attention also uses). Values move unchanged; every
//! operand is a float one (`parc_compiler::ir::storage`), so bf16 arrives staged as f32 and
//! leaves rounded from the same value, bit for bit.
use super::args::{op_error, Inputs, Outputs};
use crate::error::Result;
use parc_compiler::ir::op::Op;
use std::ops::Range;

/// The data-movement family's entry point (see `dispatch`).
pub(crate) fn run(op: &Op, ins: &Inputs, outs: &mut Outputs) -> Result<()> {
    let name = ins.name();
    match op {
        Op::Copy => outs.f32("y")?.copy_from_slice(ins.f32("x")?),
        Op::Zero => outs.f32("buffer")?.fill(0.0),
        Op::SplitColumns { widths } => {
            split_columns(name, widths, ins.f32("x")?, &mut outs.all_f32()?)?;
        }
        Op::ConcatColumns { widths } => {
            concat_columns(name, widths, &ins.all_f32()?, outs.f32("y")?)?;
        }
        Op::CopyRange {
            src_offset,
            dst_offset,
            len,
        } => {
            let (src, dst) = (ins.f32("src")?, outs.f32("dst")?);
            copy_range(name, (*src_offset, *dst_offset, *len), src, dst)?;
        }
        _ => return Err(ins.unrouted("data movement")),
    }
    Ok(())
}

/// Calls `copy(i, whole range, part range)` for every row of every column block of a
/// `[rows, Σ widths]` matrix of `whole_len` elements (block `i` `[rows, widths[i]]`):
/// `SplitColumns` and `ConcatColumns` differ only in the direction. Fails unless there is a
/// part for every width (binding checked each part's rows against the whole's).
fn column_blocks(
    op: &str,
    widths: &[u64],
    whole_len: usize,
    parts: usize,
    mut copy: impl FnMut(usize, Range<usize>, Range<usize>),
) -> Result<()> {
    if parts != widths.len() {
        return Err(op_error(
            op,
            format!("{parts} parts for {} widths {widths:?}", widths.len()),
        ));
    }
    let total = widths.iter().sum::<u64>() as usize;
    let rows = whole_len / total.max(1);
    let mut col = 0usize;
    for (i, &w) in widths.iter().enumerate() {
        let w = w as usize;
        for r in 0..rows {
            copy(i, r * total + col..r * total + col + w, r * w..(r + 1) * w);
        }
        col += w;
    }
    Ok(())
}

/// `parts[i] = x[:, columns of block i]` for a `[rows, Σ widths]` x (`Op::SplitColumns`).
pub(crate) fn split_columns(
    op: &str,
    widths: &[u64],
    x: &[f32],
    parts: &mut [&mut [f32]],
) -> Result<()> {
    column_blocks(op, widths, x.len(), parts.len(), |i, whole, part| {
        parts[i][part].copy_from_slice(&x[whole]);
    })
}

/// `y[:, columns of block i] = parts[i]` for a `[rows, Σ widths]` y (`Op::ConcatColumns`).
pub(crate) fn concat_columns(
    op: &str,
    widths: &[u64],
    parts: &[&[f32]],
    y: &mut [f32],
) -> Result<()> {
    column_blocks(op, widths, y.len(), parts.len(), |i, whole, part| {
        y[whole].copy_from_slice(&parts[i][part]);
    })
}

/// `dst[dst_offset + i] = src[src_offset + i]` for `i < len`; both ranges must lie inside
/// their buffers.
pub(crate) fn copy_range(
    op: &str,
    (src_offset, dst_offset, len): (u64, u64, u64),
    src: &[f32],
    dst: &mut [f32],
) -> Result<()> {
    let range = |offset: u64, buffer_len: usize, what: &str| {
        let end = offset.checked_add(len);
        match end {
            Some(end) if end <= buffer_len as u64 => Ok(offset as usize..end as usize),
            _ => Err(op_error(
                op,
                format!(
                    "{what} range {offset}..{offset}+{len} is outside its {buffer_len} elements"
                ),
            )),
        }
    };
    let src_range = range(src_offset, src.len(), "src")?;
    let dst_range = range(dst_offset, dst.len(), "dst")?;
    dst[dst_range].copy_from_slice(&src[src_range]);
    Ok(())
}
