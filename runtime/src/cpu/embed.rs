//! Token embedding (vocab-parallel: a rank holds table rows `[vocab_start, vocab_start +
//! vocab_local)` and writes zero rows for other ids) and learned position embedding (indexed by
//! each row's global position), forward and backward. The backward scatters add rows in row
//! order, so repeated ids accumulate deterministically.
use super::args::{dim, expect_len, expect_shape, first_write, op_error, positions_for, rows_of};
use super::args::{Inputs, Outputs};
use super::dense::Threads;
use super::par::rows_per_task;
use crate::backend::StepScalars;
use crate::error::Result;
use parc_compiler::ir::op::{EmbeddingAttrs, Op, PositionAttrs, Segment};
use rayon::prelude::*;

/// The embedding family's entry point (see `dispatch`).
pub(crate) fn run(
    op: &Op,
    ins: &Inputs,
    outs: &mut Outputs,
    _: &StepScalars,
    _: Threads,
) -> Result<()> {
    let name = ins.op;
    match op {
        Op::Embedding(a) | Op::EmbeddingBwd(a) => {
            let EmbeddingAttrs {
                vocab_start,
                vocab_local,
                dim: d,
            } = a;
            let d = dim(name, "dim", *d)?;
            let v = dim(name, "vocab_local", *vocab_local)?;
            let [out] = outs.f32s()?;
            let (ids, table_or_dy) = (ins.i32(0)?, ins.f32(1)?);
            if matches!(op, Op::Embedding(_)) {
                embedding(name, *vocab_start, v, d, ids, table_or_dy, out)
            } else {
                embedding_bwd(name, *vocab_start, v, d, ids, table_or_dy, out)
            }
        }
        Op::PositionAdd(PositionAttrs {
            batch,
            dim: d,
            positions,
        }) => {
            let [y] = outs.f32s()?;
            let (batch, d) = (dim(name, "batch", *batch)?, dim(name, "dim", *d)?);
            position_add(name, batch, d, positions, ins.f32(0)?, ins.f32(1)?, y)
        }
        Op::PositionAddBwd {
            pos:
                PositionAttrs {
                    batch,
                    dim: d,
                    positions,
                },
            accumulate_param_grad,
        } => {
            let [dtable] = outs.f32s()?;
            first_write(*accumulate_param_grad, [&mut *dtable]);
            let (batch, d) = (dim(name, "batch", *batch)?, dim(name, "dim", *d)?);
            position_add_bwd(name, batch, d, positions, ins.f32(0)?, dtable)
        }
        _ => Err(ins.unrouted("embedding")),
    }
}

/// The local table row of token `id`, if this rank holds it.
fn local_row(id: i32, vocab_start: u64, vocab_local: usize) -> Option<usize> {
    let offset = i64::from(id) - i64::try_from(vocab_start).ok()?;
    usize::try_from(offset)
        .ok()
        .filter(|&row| row < vocab_local)
}

/// `y[r] = table[ids[r] − vocab_start]`, or zero when the id is not in this rank's range.
pub(crate) fn embedding(
    op: &str,
    vocab_start: u64,
    vocab_local: usize,
    dim: usize,
    ids: &[i32],
    table: &[f32],
    y: &mut [f32],
) -> Result<()> {
    expect_shape(op, "table", table.len(), &[vocab_local, dim])?;
    expect_shape(op, "y", y.len(), &[ids.len(), dim])?;
    y.par_chunks_mut(dim)
        .zip(ids.par_iter())
        .with_min_len(rows_per_task(dim))
        .for_each(|(y, &id)| match local_row(id, vocab_start, vocab_local) {
            Some(row) => y.copy_from_slice(&table[row * dim..(row + 1) * dim]),
            None => y.fill(0.0),
        });
    Ok(())
}

/// `dtable[ids[r] − vocab_start] += dy[r]` for the ids this rank holds.
pub(crate) fn embedding_bwd(
    op: &str,
    vocab_start: u64,
    vocab_local: usize,
    dim: usize,
    ids: &[i32],
    dy: &[f32],
    dtable: &mut [f32],
) -> Result<()> {
    expect_shape(op, "dtable", dtable.len(), &[vocab_local, dim])?;
    expect_shape(op, "dy", dy.len(), &[ids.len(), dim])?;
    for (&id, dy) in ids.iter().zip(dy.chunks(dim)) {
        if let Some(row) = local_row(id, vocab_start, vocab_local) {
            for (d, &g) in dtable[row * dim..(row + 1) * dim].iter_mut().zip(dy) {
                *d += g;
            }
        }
    }
    Ok(())
}

/// Global position of every row (`row = s · batch + b`) of buffer `what` with `rows` rows,
/// checked against the table's rows.
fn row_positions(
    op: &str,
    batch: usize,
    positions: &[Segment],
    (what, rows): (&str, usize),
    table_rows: usize,
) -> Result<Vec<usize>> {
    if rows % batch != 0 {
        return Err(op_error(
            op,
            format!("{what} has {rows} rows, not a multiple of batch = {batch}"),
        ));
    }
    let global = positions_for(op, positions, what, rows / batch)?;
    if let Some(&last) = global.iter().max() {
        if last as usize >= table_rows {
            return Err(op_error(
                op,
                format!("position {last} is past the {table_rows} rows of the position table"),
            ));
        }
    }
    Ok(global
        .iter()
        .flat_map(|&p| std::iter::repeat_n(p as usize, batch))
        .collect())
}

/// `y[r] = x[r] + table[position(r)]`.
pub(crate) fn position_add(
    op: &str,
    batch: usize,
    dim: usize,
    positions: &[Segment],
    x: &[f32],
    table: &[f32],
    y: &mut [f32],
) -> Result<()> {
    let table_rows = rows_of(op, "table", table.len(), dim)?;
    let x_rows = rows_of(op, "x", x.len(), dim)?;
    let rows = row_positions(op, batch, positions, ("x", x_rows), table_rows)?;
    expect_len(op, "y", y.len(), x.len())?;
    y.par_chunks_mut(dim)
        .zip(x.par_chunks(dim).zip(rows.par_iter()))
        .with_min_len(rows_per_task(dim))
        .for_each(|(y, (x, &pos))| {
            let t = &table[pos * dim..(pos + 1) * dim];
            for ((y, &x), &t) in y.iter_mut().zip(x).zip(t) {
                *y = x + t;
            }
        });
    Ok(())
}

/// `dtable[position(r)] += dy[r]`.
pub(crate) fn position_add_bwd(
    op: &str,
    batch: usize,
    dim: usize,
    positions: &[Segment],
    dy: &[f32],
    dtable: &mut [f32],
) -> Result<()> {
    let table_rows = rows_of(op, "dtable", dtable.len(), dim)?;
    let dy_rows = rows_of(op, "dy", dy.len(), dim)?;
    let rows = row_positions(op, batch, positions, ("dy", dy_rows), table_rows)?;
    for (&pos, dy) in rows.iter().zip(dy.chunks(dim)) {
        for (d, &g) in dtable[pos * dim..(pos + 1) * dim].iter_mut().zip(dy) {
            *d += g;
        }
    }
    Ok(())
}
