//! Data movement: copy, zero, copy of a flat range, and the column split and concatenation of
//! a `[rows, Σ widths]` matrix (which packed attention also uses). Values move unchanged.
use super::args::{expect_len, op_error, Inputs, Outputs};
use super::dense::Threads;
use super::memory::{View, ViewMut};
use crate::backend::StepScalars;
use crate::error::Result;
use parc_compiler::ir::op::Op;
use std::ops::Range;

/// The data-movement family's entry point (see `dispatch`).
pub(crate) fn run(
    op: &Op,
    ins: &Inputs,
    outs: &mut Outputs,
    _: &StepScalars,
    _: Threads,
) -> Result<()> {
    let name = ins.op;
    match op {
        Op::Copy => copy(name, ins.tensor(0)?, outs.tensor(0)?),
        Op::Zero => {
            outs.tensor(0)?.fill_zero();
            Ok(())
        }
        Op::SplitColumns { widths } => {
            let mut parts = outs.f32_vec()?;
            split_columns(name, widths, ins.f32(0)?, &mut parts)
        }
        Op::ConcatColumns { widths } => {
            let parts = (0..ins.tensors.len())
                .map(|i| ins.f32(i))
                .collect::<Result<Vec<_>>>()?;
            let [y] = outs.f32s()?;
            concat_columns(name, widths, &parts, y)
        }
        Op::CopyRange {
            src_offset,
            dst_offset,
            len,
        } => copy_range(
            name,
            *src_offset,
            *dst_offset,
            *len,
            ins.tensor(0)?,
            outs.tensor(0)?,
        ),
        _ => Err(ins.unrouted("data movement")),
    }
}

/// `y = x` for tensors of one dtype and length.
pub(crate) fn copy(op: &str, x: View<'_>, y: &mut ViewMut<'_>) -> Result<()> {
    expect_len(op, "y", y.len(), x.len())?;
    match (x, y) {
        (View::F32(x), ViewMut::F32(y)) => y.copy_from_slice(x),
        (View::I32(x), ViewMut::I32(y)) => y.copy_from_slice(x),
        _ => return Err(op_error(op, "x and y have different dtypes")),
    }
    Ok(())
}

/// Checks a `[rows, Σ widths]` matrix of `whole_len` elements against its column blocks
/// (`part_lens[i]` = rows × `widths[i]`), then calls `copy(i, whole range, part range)` for
/// every row of every block: `SplitColumns` and `ConcatColumns` differ only in the direction.
fn column_blocks(
    op: &str,
    widths: &[u64],
    whole_len: usize,
    part_lens: &[usize],
    mut copy: impl FnMut(usize, Range<usize>, Range<usize>),
) -> Result<()> {
    let total = widths.iter().sum::<u64>() as usize;
    if total == 0 || !whole_len.is_multiple_of(total) {
        return Err(op_error(
            op,
            format!("{whole_len} elements are not rows of {total} columns (widths {widths:?})"),
        ));
    }
    if part_lens.len() != widths.len() {
        return Err(op_error(
            op,
            format!("{} parts for {} widths", part_lens.len(), widths.len()),
        ));
    }
    let rows = whole_len / total;
    for (&len, &w) in part_lens.iter().zip(widths) {
        expect_len(op, "part", len, rows * w as usize)?;
    }
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
    let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    column_blocks(op, widths, x.len(), &lens, |i, whole, part| {
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
    let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    column_blocks(op, widths, y.len(), &lens, |i, whole, part| {
        y[whole].copy_from_slice(&parts[i][part]);
    })
}

/// `dst[dst_offset + i] = src[src_offset + i]` for `i < len`.
pub(crate) fn copy_range(
    op: &str,
    src_offset: u64,
    dst_offset: u64,
    len: u64,
    src: View<'_>,
    dst: &mut ViewMut<'_>,
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
    match (src, dst) {
        (View::F32(s), ViewMut::F32(d)) => d[dst_range].copy_from_slice(&s[src_range]),
        (View::I32(s), ViewMut::I32(d)) => d[dst_range].copy_from_slice(&s[src_range]),
        _ => return Err(op_error(op, "src and dst have different dtypes")),
    }
    Ok(())
}
