//! Token embedding (vocab-parallel: a rank holds table rows `[vocab_start, vocab_start +
//! vocab_local)` and writes zero rows for other ids) and learned position embedding (indexed by
//! each row's global position), forward and backward. The backward scatters add rows in row
//! order, so repeated ids accumulate deterministically.
use super::args::{positions_for, Inputs, Outputs};
use super::par::rows_per_task;
use crate::error::Result;
use parc_compiler::ir::op::{Op, PositionAttrs};
use rayon::prelude::*;

/// The embedding family's entry point (see `dispatch`).
pub(crate) fn run(op: &Op, ins: &Inputs, outs: &mut Outputs) -> Result<()> {
    match op {
        Op::Embedding(a) | Op::EmbeddingBwd(a) => {
            let (d, v) = (
                ins.dim("dim", a.dim)?,
                ins.dim("vocab_local", a.vocab_local)?,
            );
            let ids = ins.i32("ids")?;
            if let Op::Embedding(_) = op {
                embedding(a.vocab_start, v, d, ids, ins.f32("table")?, outs.f32("y")?);
            } else {
                let (dy, dtable) = (ins.f32("dy")?, outs.accumulator("dtable")?);
                embedding_bwd(a.vocab_start, v, d, ids, dy, dtable);
            }
            Ok(())
        }
        Op::PositionAdd(p) => {
            let (x, table) = (ins.f32("x")?, ins.f32("table")?);
            let (d, rows) = row_positions(ins, p, ("x", x.len()), table.len())?;
            position_add(d, &rows, x, table, outs.f32("y")?);
            Ok(())
        }
        Op::PositionAddBwd { pos: p, .. } => {
            let (dy, dtable) = (ins.f32("dy")?, outs.accumulator("dtable")?);
            let (d, rows) = row_positions(ins, p, ("dy", dy.len()), dtable.len())?;
            position_add_bwd(d, &rows, dy, dtable);
            Ok(())
        }
        _ => Err(ins.unrouted("embedding")),
    }
}

/// A position op's row width, and the global position of every row (`row = s · batch + b`)
/// of its activation `what` of `len` elements, checked against the rows of the position
/// table of `table_len` elements.
fn row_positions(
    ins: &Inputs,
    p: &PositionAttrs,
    (what, len): (&str, usize),
    table_len: usize,
) -> Result<(usize, Vec<usize>)> {
    let (batch, dim) = (ins.dim("batch", p.batch)?, ins.dim("dim", p.dim)?);
    let table_rows = table_len / dim;
    let global = positions_for(ins.name(), &p.positions, what, len / dim / batch)?;
    if let Some(&last) = global.iter().max() {
        if last as usize >= table_rows {
            return Err(ins.err(format!(
                "position {last} is past the {table_rows} rows of the position table"
            )));
        }
    }
    let rows = global
        .iter()
        .flat_map(|&p| std::iter::repeat_n(p as usize, batch));
    Ok((dim, rows.collect()))
}

/// The index of `token` in this rank's vocabulary slice `[vocab_start, vocab_start +
/// vocab_local)`, if the slice holds it (its table row here; its logit column in
/// `cross_entropy`).
pub(crate) fn local_index(token: i32, vocab_start: u64, vocab_local: usize) -> Option<usize> {
    let offset = i64::from(token) - i64::try_from(vocab_start).ok()?;
    usize::try_from(offset).ok().filter(|&i| i < vocab_local)
}

/// `table[row] += g`, rows of `g.len()` elements.
fn add_row(table: &mut [f32], row: usize, g: &[f32]) {
    let dim = g.len();
    for (t, &g) in table[row * dim..(row + 1) * dim].iter_mut().zip(g) {
        *t += g;
    }
}

/// `y[r] = table[ids[r] − vocab_start]`, or zero when the id is not in this rank's range.
pub(crate) fn embedding(
    vocab_start: u64,
    vocab_local: usize,
    dim: usize,
    ids: &[i32],
    table: &[f32],
    y: &mut [f32],
) {
    y.par_chunks_mut(dim)
        .zip(ids.par_iter())
        .with_min_len(rows_per_task(dim))
        .for_each(|(y, &id)| match local_index(id, vocab_start, vocab_local) {
            Some(row) => y.copy_from_slice(&table[row * dim..(row + 1) * dim]),
            None => y.fill(0.0),
        });
}

/// `dtable[ids[r] − vocab_start] += dy[r]` for the ids this rank holds.
pub(crate) fn embedding_bwd(
    vocab_start: u64,
    vocab_local: usize,
    dim: usize,
    ids: &[i32],
    dy: &[f32],
    dtable: &mut [f32],
) {
    for (&id, dy) in ids.iter().zip(dy.chunks(dim)) {
        if let Some(row) = local_index(id, vocab_start, vocab_local) {
            add_row(dtable, row, dy);
        }
    }
}

/// `y[r] = x[r] + table[rows[r]]`: every row plus the table row of its position.
pub(crate) fn position_add(dim: usize, rows: &[usize], x: &[f32], table: &[f32], y: &mut [f32]) {
    y.par_chunks_mut(dim)
        .zip(x.par_chunks(dim).zip(rows.par_iter()))
        .with_min_len(rows_per_task(dim))
        .for_each(|(y, (x, &pos))| {
            let t = &table[pos * dim..(pos + 1) * dim];
            for ((y, &x), &t) in y.iter_mut().zip(x).zip(t) {
                *y = x + t;
            }
        });
}

/// `dtable[rows[r]] += dy[r]`.
pub(crate) fn position_add_bwd(dim: usize, rows: &[usize], dy: &[f32], dtable: &mut [f32]) {
    for (&pos, dy) in rows.iter().zip(dy.chunks(dim)) {
        add_row(dtable, pos, dy);
    }
}
