//! The embedding family on the GPU (kernels/elementwise.cu): token embedding lookup and its
//! gradient (`Embedding`, `EmbeddingBwd`: ids outside this rank's `vocab_start..+vocab_local`
//! shard give zero rows and no gradient), and the learned position table added to every
//! sequence of the batch and its gradient (`PositionAdd`, `PositionAddBwd`, at the op's global
//! positions, uploaded once per list by `CudaBackend::positions`).
use super::args::{fv, n, p, Bound, Limits};
use super::kernel::Kernel;
use super::{Arg, CudaBackend};
use crate::error::Result;
use parc_compiler::ir::op::{EmbeddingAttrs, Op, PositionAttrs, Segment};

/// Run an op of the embedding family.
pub(super) fn run(be: &mut CudaBackend, b: &Bound) -> Result<()> {
    match b.op {
        Op::Embedding(attrs) => embedding(be, b, attrs, true),
        Op::EmbeddingBwd(attrs) => embedding(be, b, attrs, false),
        Op::PositionAdd(attrs) => position_add(be, b, attrs, None),
        Op::PositionAddBwd {
            pos,
            accumulate_param_grad,
        } => position_add(be, b, pos, Some(*accumulate_param_grad)),
        _ => Err(b.err("is not an embedding op")),
    }
}

/// y = table[ids] (`forward`), or dtable[ids] += dy.
fn embedding(be: &mut CudaBackend, b: &Bound, a: &EmbeddingAttrs, forward: bool) -> Result<()> {
    let d = b.launch_dim("dim", a.dim)?;
    let v = b.launch_dim("vocab_local", a.vocab_local)?;
    let ids = b.input(0)?;
    let rows = ids.len;
    let start = i64::try_from(a.vocab_start).map_err(|_| b.err("vocab_start too large"))?;
    let shard = [n(rows), n(d), Arg::I64(start), n(v)];
    if forward {
        let (table, y) = (b.input(1)?, b.output(0)?);
        let mut args = vec![p(ids), fv(table), fv(y)];
        args.extend(shard);
        be.launch_vec(Kernel::EmbeddingFwd, rows * d, &args)
    } else {
        let (dy, dtable) = (b.input(1)?, b.output(0)?);
        let mut args = vec![p(ids), fv(dy), p(dtable)];
        args.extend(shard);
        be.launch_n(Kernel::EmbeddingBwd, rows * d, &args)
    }
}

/// The largest global position of `segments`, if any.
fn max_position(segments: &[Segment]) -> Option<u64> {
    segments
        .iter()
        .filter(|s| s.len > 0)
        .map(|s| u64::from(s.start) + u64::from(s.len) - 1)
        .max()
}

/// y = x + table[position] (`accumulate` None: the forward), or the table's gradient: each
/// position's column sums of dy, added into dtable (`accumulate`) or into a dtable cleared
/// first.
fn position_add(
    be: &mut CudaBackend,
    b: &Bound,
    a: &PositionAttrs,
    accumulate: Option<bool>,
) -> Result<()> {
    let (batch, d) = (b.launch_dim("batch", a.batch)?, b.launch_dim("dim", a.dim)?);
    let x = b.input(0)?;
    let table = match accumulate {
        None => b.input(1)?,
        Some(_) => b.output(0)?,
    };
    let what = if accumulate.is_none() { "x" } else { "dy" };
    let rows = b.launch_rows(x, what, b.rows)?;
    let table_rows = b.launch_rows(table, "table", table.len / d)?;
    if max_position(&a.positions).is_some_and(|m| m >= table_rows as u64) {
        return Err(b.err(format!(
            "positions reach {:?} but the table has {table_rows} rows",
            max_position(&a.positions)
        )));
    }
    let (pos, _) = be.positions(&a.positions)?;
    let Some(accumulate) = accumulate else {
        let y = b.output(0)?;
        let args = [
            fv(x),
            fv(table),
            fv(y),
            Arg::Ptr(pos),
            n(rows),
            n(batch),
            n(d),
        ];
        return be.launch_vec(Kernel::PositionAddFwd, rows * d, &args);
    };
    // The kernel adds each position's column sums atomically: a first contribution
    // (`accumulate_param_grad` false) clears the table first (rows at no position stay zero).
    if !accumulate {
        be.zero_bytes(table.ptr, table.len * table.elem_bytes())?;
    }
    let seq = rows / batch;
    let args = [fv(x), p(table), Arg::Ptr(pos), n(seq), n(batch), n(d)];
    be.launch_n(Kernel::PositionAddBwd, seq * d, &args)
}
