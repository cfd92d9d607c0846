//! Dispatch of one `Op` onto the CUDA kernels and cuBLASLt: checks the buffer count, dtypes and
//! every length against the op's attributes (a bad program is an error, never an
//! out-of-bounds kernel), then launches. Operand dtypes follow `parc_compiler::ir::storage`:
//! a *float* operand (`Bound::float_in`/`float_out`) is f32 or bf16 and reaches its kernel as
//! a `FloatArg` (pointer + bf16 flag); *fp32* operands (`f32_in`/`f32_out`) are f32 only.
//! Row-major GEMMs map onto cuBLAS's column-major view: a row-major `[r, c]` matrix is a
//! column-major `c × r` one with leading dimension `c`.
use super::norm_variants::{self, NormBwd, NormFwd};
use super::{attention, cross_entropy, matmul, Arg, Buf, CudaBackend, FloatArg};
use crate::backend::StepScalars;
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::{Act, Op, Segment};
use parc_compiler::ir::op::{ActAttrs, EmbeddingAttrs, PositionAttrs, RopeAttrs};
use parc_compiler::ir::DType;
use parc_compiler::memplan::REDUCTION_CHUNKS;

const NORM_THREADS: u32 = 256;
/// Rows a norm kernel's block covers: one warp per row.
const NORM_ROWS_PER_BLOCK: usize = NORM_THREADS as usize / 32;

/// The op's bound buffers and checks on them.
pub(super) struct Bound<'a> {
    op: &'static str,
    ins: &'a [Buf],
    outs: &'a [Buf],
}

impl Bound<'_> {
    pub(super) fn err(&self, what: impl Into<String>) -> RuntimeError {
        RuntimeError::Op {
            op: self.op.into(),
            what: what.into(),
        }
    }

    fn typed(&self, b: Buf, dtype: DType, role: &str) -> Result<Buf> {
        if b.dtype != dtype {
            return Err(self.err(format!(
                "{role} (buffer {}) is {:?}, expected {dtype:?}",
                b.id.0, b.dtype
            )));
        }
        Ok(b)
    }

    pub(super) fn f32_in(&self, i: usize) -> Result<Buf> {
        self.typed(self.ins[i], DType::F32, &format!("input {i}"))
    }

    /// Input `i`, f32 or bf16 (a `Float` operand of `parc_compiler::ir::storage`).
    pub(super) fn float_in(&self, i: usize) -> Result<Buf> {
        self.float(self.ins[i], &format!("input {i}"))
    }

    /// Output `i`, f32 or bf16 (a `Float` operand of `parc_compiler::ir::storage`).
    pub(super) fn float_out(&self, i: usize) -> Result<Buf> {
        self.float(self.outs[i], &format!("output {i}"))
    }

    fn float(&self, b: Buf, role: &str) -> Result<Buf> {
        if !matches!(b.dtype, DType::F32 | DType::Bf16) {
            return Err(self.err(format!(
                "{role} (buffer {}) is {:?}, expected f32 or bf16",
                b.id.0, b.dtype
            )));
        }
        Ok(b)
    }

    pub(super) fn i32_in(&self, i: usize) -> Result<Buf> {
        self.typed(self.ins[i], DType::I32, &format!("input {i}"))
    }

    pub(super) fn f32_out(&self, i: usize) -> Result<Buf> {
        self.typed(self.outs[i], DType::F32, &format!("output {i}"))
    }

    pub(super) fn dim(&self, name: &str, value: u64) -> Result<usize> {
        usize::try_from(value)
            .ok()
            .filter(|&v| v > 0 && v <= i32::MAX as usize)
            .ok_or_else(|| self.err(format!("{name} = {value} must be in 1..2^31")))
    }

    pub(super) fn expect(&self, b: Buf, what: &str, len: usize) -> Result<()> {
        if b.len != len {
            return Err(self.err(format!(
                "{what} (buffer {}) holds {} elements, expected {len}",
                b.id.0, b.len
            )));
        }
        Ok(())
    }

    pub(super) fn rows(&self, b: Buf, what: &str, cols: usize) -> Result<usize> {
        if !b.len.is_multiple_of(cols) {
            return Err(self.err(format!(
                "{what} (buffer {}) holds {} elements, not a multiple of {cols}",
                b.id.0, b.len
            )));
        }
        let rows = b.len / cols;
        if rows > i32::MAX as usize {
            return Err(self.err(format!(
                "{what} (buffer {}) has {rows} rows, more than one launch covers (2^31 - 1)",
                b.id.0
            )));
        }
        Ok(rows)
    }

    pub(super) fn same(&self, bufs: &[(Buf, &str)], len: usize) -> Result<()> {
        bufs.iter()
            .try_for_each(|(b, what)| self.expect(*b, what, len))
    }
}

pub(super) fn p(b: Buf) -> Arg {
    Arg::Ptr(b.ptr)
}

/// A Float operand (f32 or bf16) as its kernel takes it.
pub(super) fn fv(b: Buf) -> Arg {
    Arg::Float(FloatArg::at(b, 0))
}

pub(super) fn n(v: usize) -> Arg {
    Arg::I64(v as i64)
}

pub(super) fn act_code(act: Act) -> i32 {
    match act {
        Act::Gelu => 0,
        Act::GeluTanh => 1,
        Act::Relu => 2,
    }
}

pub(super) fn segments_len(segments: &[Segment]) -> u64 {
    segments.iter().map(|s| u64::from(s.len)).sum()
}

fn max_position(segments: &[Segment]) -> Option<u64> {
    segments
        .iter()
        .filter(|s| s.len > 0)
        .map(|s| u64::from(s.start) + u64::from(s.len) - 1)
        .max()
}

/// Run `op` (buffers already looked up; aliased inputs already copied).
pub(crate) fn run(
    be: &mut CudaBackend,
    op: &Op,
    ins: &[Buf],
    outs: &[Buf],
    scalars: &StepScalars,
) -> Result<()> {
    // Counts, dtypes and element counts against the op table (`crate::bind`).
    let bound = crate::bind::Bound::bind(op, ins, outs)?;
    let b = Bound {
        op: bound.name(),
        ins,
        outs,
    };
    match op {
        Op::Embedding(EmbeddingAttrs {
            vocab_start,
            vocab_local,
            dim,
        })
        | Op::EmbeddingBwd(EmbeddingAttrs {
            vocab_start,
            vocab_local,
            dim,
        }) => {
            let d = b.dim("dim", *dim)?;
            let v = b.dim("vocab_local", *vocab_local)?;
            let ids = b.i32_in(0)?;
            let rows = ids.len;
            let start = i64::try_from(*vocab_start).map_err(|_| b.err("vocab_start too large"))?;
            if matches!(op, Op::Embedding { .. }) {
                let (table, out) = (b.f32_in(1)?, b.float_out(0)?);
                b.expect(table, "table", v * d)?;
                b.expect(out, "y", rows * d)?;
                let args = [
                    p(ids),
                    p(table),
                    fv(out),
                    n(rows),
                    n(d),
                    Arg::I64(start),
                    n(v),
                ];
                be.launch_vec("embedding_fwd", rows * d, &args)
            } else {
                let (dy, out) = (b.float_in(1)?, b.f32_out(0)?);
                b.expect(dy, "dy", rows * d)?;
                b.expect(out, "dtable", v * d)?;
                let args = [p(ids), fv(dy), p(out), n(rows), n(d), Arg::I64(start), n(v)];
                be.launch_n("embedding_bwd", rows * d, &args)
            }
        }
        Op::PositionAdd(PositionAttrs {
            batch,
            dim,
            positions,
        })
        | Op::PositionAddBwd {
            pos:
                PositionAttrs {
                    batch,
                    dim,
                    positions,
                },
            ..
        } => {
            let forward = matches!(op, Op::PositionAdd { .. });
            let (batch, d) = (b.dim("batch", *batch)?, b.dim("dim", *dim)?);
            let (x, table) = if forward {
                (b.float_in(0)?, b.f32_in(1)?)
            } else {
                (b.float_in(0)?, b.f32_out(0)?)
            };
            let rows = b.rows(x, if forward { "x" } else { "dy" }, d)?;
            let table_rows = b.rows(table, "table", d)?;
            let seq = rows / batch;
            if seq * batch != rows || segments_len(positions) != seq as u64 {
                return Err(b.err(format!(
                    "{rows} rows are not {} positions x batch {batch}",
                    segments_len(positions)
                )));
            }
            if max_position(positions).is_some_and(|m| m >= table_rows as u64) {
                return Err(b.err(format!(
                    "positions reach {:?} but the table has {table_rows} rows",
                    max_position(positions)
                )));
            }
            let (pos, _) = be.positions(positions)?;
            if forward {
                let y = b.float_out(0)?;
                b.expect(y, "y", rows * d)?;
                let args = [
                    fv(x),
                    p(table),
                    fv(y),
                    Arg::Ptr(pos),
                    n(rows),
                    n(batch),
                    n(d),
                ];
                be.launch_vec("position_add_fwd", rows * d, &args)
            } else {
                // The kernel adds each position's column sums atomically: a first
                // contribution (`accumulate_param_grad` false) clears the table first (rows
                // at no position stay zero).
                if matches!(
                    op,
                    Op::PositionAddBwd {
                        accumulate_param_grad: false,
                        ..
                    }
                ) {
                    be.zero_bytes(table.ptr, table.len * table.elem_bytes())?;
                }
                let args = [fv(x), p(table), Arg::Ptr(pos), n(seq), n(batch), n(d)];
                be.launch_n("position_add_bwd", seq * d, &args)
            }
        }
        Op::LayerNorm { dim, eps, bias } => {
            let d = b.dim("dim", *dim)?;
            if eps.is_nan() || *eps < 0.0 {
                return Err(b.err(format!("eps = {eps} must be non-negative")));
            }
            let (x, w) = (b.float_in(0)?, b.f32_in(1)?);
            let rows = b.rows(x, "x", d)?;
            b.expect(w, "w", d)?;
            let bias_ptr = if *bias {
                let bb = b.f32_in(2)?;
                b.expect(bb, "b", d)?;
                bb.ptr
            } else {
                0
            };
            let (y, mean, rstd) = (b.float_out(0)?, b.f32_out(1)?, b.f32_out(2)?);
            b.expect(y, "y", rows * d)?;
            b.same(&[(mean, "mean"), (rstd, "rstd")], rows)?;
            let variant = NormFwd {
                x,
                w,
                bias: bias_ptr,
                y,
                mean: mean.ptr,
                rstd,
                rows,
                d,
                eps: *eps,
            };
            if norm_variants::forward(be, &variant)? {
                return Ok(());
            }
            let args = [
                fv(x),
                p(w),
                Arg::Ptr(bias_ptr),
                fv(y),
                p(mean),
                p(rstd),
                n(rows),
                n(d),
                Arg::F64(*eps),
            ];
            launch_rows(be, "layer_norm_fwd", rows, &args)
        }
        Op::LayerNormBwd {
            dim,
            bias,
            accumulate,
            accumulate_param_grad,
        } => {
            let d = b.dim("dim", *dim)?;
            let (dy, x, w, mean, rstd) = (
                b.float_in(0)?,
                b.float_in(1)?,
                b.f32_in(2)?,
                b.f32_in(3)?,
                b.f32_in(4)?,
            );
            let rows = b.rows(x, "x", d)?;
            b.same(&[(dy, "dy")], rows * d)?;
            b.expect(w, "w", d)?;
            b.same(&[(mean, "mean"), (rstd, "rstd")], rows)?;
            let (dx, dw) = (b.float_out(0)?, b.f32_out(1)?);
            b.expect(dx, "dx", rows * d)?;
            b.expect(dw, "dw", d)?;
            let db = if *bias {
                let db = b.f32_out(2)?;
                b.expect(db, "db", d)?;
                Some(db)
            } else {
                None
            };
            let variant = NormBwd {
                dy,
                x,
                w,
                mean: mean.ptr,
                rstd,
                dx,
                dw,
                db,
                rows,
                d,
                accumulate_dx: *accumulate,
                accumulate_param: *accumulate_param_grad,
            };
            if norm_variants::backward(be, &variant)? {
                return Ok(());
            }
            // The last argument: accumulate into dx (0: overwrite).
            let args = [
                fv(dy),
                fv(x),
                p(w),
                p(mean),
                p(rstd),
                fv(dx),
                n(rows),
                n(d),
                Arg::I32(i32::from(*accumulate)),
            ];
            launch_rows(be, "layer_norm_bwd_dx", rows, &args)?;
            norm_dw(
                be,
                dy,
                x,
                mean.ptr,
                rstd,
                (dw, *accumulate_param_grad),
                rows,
                d,
            )?;
            if let Some(db) = db {
                col_sum_into(be, dy, (db, *accumulate_param_grad), rows, d)?;
            }
            Ok(())
        }
        Op::RmsNorm { dim, eps } => {
            let d = b.dim("dim", *dim)?;
            if eps.is_nan() || *eps < 0.0 {
                return Err(b.err(format!("eps = {eps} must be non-negative")));
            }
            let (x, w) = (b.float_in(0)?, b.f32_in(1)?);
            let rows = b.rows(x, "x", d)?;
            b.expect(w, "w", d)?;
            let (y, rstd) = (b.float_out(0)?, b.f32_out(1)?);
            b.expect(y, "y", rows * d)?;
            b.expect(rstd, "rstd", rows)?;
            let variant = NormFwd {
                x,
                w,
                bias: 0,
                y,
                mean: 0,
                rstd,
                rows,
                d,
                eps: *eps,
            };
            if norm_variants::forward(be, &variant)? {
                return Ok(());
            }
            let args = [fv(x), p(w), fv(y), p(rstd), n(rows), n(d), Arg::F64(*eps)];
            launch_rows(be, "rms_norm_fwd", rows, &args)
        }
        Op::RmsNormBwd {
            dim,
            accumulate,
            accumulate_param_grad,
        } => {
            let d = b.dim("dim", *dim)?;
            let (dy, x, w, rstd) = (b.float_in(0)?, b.float_in(1)?, b.f32_in(2)?, b.f32_in(3)?);
            let rows = b.rows(x, "x", d)?;
            b.expect(dy, "dy", rows * d)?;
            b.expect(w, "w", d)?;
            b.expect(rstd, "rstd", rows)?;
            let (dx, dw) = (b.float_out(0)?, b.f32_out(1)?);
            b.expect(dx, "dx", rows * d)?;
            b.expect(dw, "dw", d)?;
            let variant = NormBwd {
                dy,
                x,
                w,
                mean: 0,
                rstd,
                dx,
                dw,
                db: None,
                rows,
                d,
                accumulate_dx: *accumulate,
                accumulate_param: *accumulate_param_grad,
            };
            if norm_variants::backward(be, &variant)? {
                return Ok(());
            }
            // The last argument: accumulate into dx (0: overwrite).
            let args = [
                fv(dy),
                fv(x),
                p(w),
                p(rstd),
                fv(dx),
                n(rows),
                n(d),
                Arg::I32(i32::from(*accumulate)),
            ];
            launch_rows(be, "rms_norm_bwd_dx", rows, &args)?;
            norm_dw(be, dy, x, 0, rstd, (dw, *accumulate_param_grad), rows, d)
        }
        Op::Matmul { .. } | Op::MatmulBwdData { .. } | Op::MatmulBwdWeight { .. } => {
            matmul::run(be, &b, op)
        }
        Op::Rope(RopeAttrs {
            batch,
            heads,
            head_dim,
            theta,
            positions,
        })
        | Op::RopeBwd(RopeAttrs {
            batch,
            heads,
            head_dim,
            theta,
            positions,
        }) => {
            let (batch, heads, hd) = (
                b.dim("batch", *batch)?,
                b.dim("heads", *heads)?,
                b.dim("head_dim", *head_dim)?,
            );
            if hd % 2 != 0 {
                return Err(b.err(format!("head_dim = {hd} must be even to rotate pairs")));
            }
            if theta.is_nan() || *theta <= 0.0 {
                return Err(b.err(format!("theta = {theta} must be positive")));
            }
            let x = b.float_in(0)?;
            let rows = b.rows(x, "x", heads * hd)?;
            if !rows.is_multiple_of(batch) || segments_len(positions) != (rows / batch) as u64 {
                return Err(b.err(format!(
                    "{rows} rows are not {} positions x batch {batch}",
                    segments_len(positions)
                )));
            }
            let y = b.float_out(0)?;
            b.expect(y, "y", x.len)?;
            let (pos, _) = be.positions(positions)?;
            let sign = if matches!(op, Op::Rope { .. }) {
                1.0
            } else {
                -1.0
            };
            let args = [
                fv(x),
                fv(y),
                Arg::Ptr(pos),
                n(rows),
                n(batch),
                n(heads),
                n(hd),
                Arg::F64(*theta),
                Arg::F64(sign),
            ];
            be.launch_n("rope_fwd", rows * heads * hd / 2, &args)
        }
        Op::Attention { .. } | Op::AttentionBwd { .. } => attention::run(be, &b, op),
        Op::Activation(ActAttrs { act }) => {
            let (x, y) = (b.float_in(0)?, b.float_out(0)?);
            b.expect(y, "y", x.len)?;
            be.launch_vec(
                "activation_fwd",
                x.len,
                &[Arg::I32(act_code(*act)), fv(x), fv(y), n(x.len)],
            )
        }
        Op::ActivationBwd(ActAttrs { act }) => {
            let (dy, x) = (b.float_in(0)?, b.float_in(1)?);
            let dx = b.float_out(0)?;
            b.same(&[(dy, "dy"), (dx, "dx")], x.len)?;
            let args = [Arg::I32(act_code(*act)), fv(dy), fv(x), fv(dx), n(x.len)];
            be.launch_vec("activation_bwd", x.len, &args)
        }
        Op::SwiGlu => {
            let (gate, up) = (b.float_in(0)?, b.float_in(1)?);
            let y = b.float_out(0)?;
            b.same(&[(up, "up"), (y, "y")], gate.len)?;
            let args = [fv(gate), fv(up), fv(y), n(gate.len)];
            be.launch_vec("swiglu_fwd", gate.len, &args)
        }
        Op::SwiGluBwd => {
            let (dy, gate, up) = (b.float_in(0)?, b.float_in(1)?, b.float_in(2)?);
            let (dg, du) = (b.float_out(0)?, b.float_out(1)?);
            b.same(
                &[(dy, "dy"), (up, "up"), (dg, "dgate"), (du, "dup")],
                gate.len,
            )?;
            let args = [fv(dy), fv(gate), fv(up), fv(dg), fv(du), n(gate.len)];
            be.launch_vec("swiglu_bwd", gate.len, &args)
        }
        Op::Add => {
            let (x, y_in) = (b.float_in(0)?, b.float_in(1)?);
            let y = b.float_out(0)?;
            b.same(&[(y_in, "b"), (y, "y")], x.len)?;
            be.launch_vec("add_fwd", x.len, &[fv(x), fv(y_in), fv(y), n(x.len)])
        }
        Op::Scale { factor } => {
            let (x, y) = (b.float_in(0)?, b.float_out(0)?);
            b.expect(y, "y", x.len)?;
            be.launch_vec(
                "scale_fwd",
                x.len,
                &[fv(x), fv(y), Arg::F32(*factor as f32), n(x.len)],
            )
        }
        Op::Copy => {
            let (x, y) = (b.float_in(0)?, b.float_out(0)?);
            b.expect(y, "y", x.len)?;
            copy_elements(be, x, 0, y, 0, x.len)
        }
        Op::Zero => {
            let y = b.float_out(0)?;
            be.zero_bytes(y.ptr, y.bytes())
        }
        Op::SplitColumns { widths } | Op::ConcatColumns { widths } => {
            let split = matches!(op, Op::SplitColumns { .. });
            let total: u64 = widths.iter().sum();
            let whole = if split {
                b.float_in(0)?
            } else {
                b.float_out(0)?
            };
            let cols = b.dim("total width", total)?;
            let rows = b.rows(whole, "the whole matrix", cols)?;
            let mut col = 0usize;
            for (i, &w) in widths.iter().enumerate() {
                let w = b.dim("width", w)?;
                let part = if split {
                    b.float_out(i)?
                } else {
                    b.float_in(i)?
                };
                b.expect(part, "part", rows * w)?;
                let (x, x_ld, y, y_ld) = if split {
                    (FloatArg::at(whole, col), cols, FloatArg::at(part, 0), w)
                } else {
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
                be.launch_vec("copy_columns", rows * w, &args)?;
                col += w;
            }
            Ok(())
        }
        Op::CopyRange {
            src_offset,
            dst_offset,
            len,
        } => {
            let (src, dst) = (b.float_in(0)?, b.float_out(0)?);
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
            copy_elements(
                be,
                src,
                *src_offset as usize,
                dst,
                *dst_offset as usize,
                *len as usize,
            )
        }
        Op::CrossEntropy { .. } => cross_entropy::run(be, &b, op, scalars),
        Op::CeMax { vocab_local } | Op::CeSumExp { vocab_local } => {
            let v = b.dim("vocab_local", *vocab_local)?;
            let logits = b.float_in(0)?;
            let rows = b.rows(logits, "logits", v)?;
            let out = b.f32_out(0)?;
            b.expect(
                out,
                if matches!(op, Op::CeMax { .. }) {
                    "max"
                } else {
                    "sumexp"
                },
                rows,
            )?;
            let grid = (rows as u32, 1, 1);
            if matches!(op, Op::CeMax { .. }) {
                be.launch(
                    "ce_max",
                    grid,
                    (NORM_THREADS, 1, 1),
                    0,
                    &[fv(logits), p(out), n(v)],
                )
            } else {
                let max = b.f32_in(1)?;
                b.expect(max, "max", rows)?;
                let args = [fv(logits), p(max), p(out), n(v)];
                be.launch("ce_sum_exp", grid, (NORM_THREADS, 1, 1), 0, &args)
            }
        }
        Op::CeTargetLogit {
            vocab_start,
            vocab_local,
        } => {
            let v = b.dim("vocab_local", *vocab_local)?;
            let (logits, targets) = (b.float_in(0)?, b.i32_in(1)?);
            let rows = b.rows(logits, "logits", v)?;
            b.expect(targets, "targets", rows)?;
            let out = b.f32_out(0)?;
            b.expect(out, "target_logit", rows)?;
            let start = i64::try_from(*vocab_start).map_err(|_| b.err("vocab_start too large"))?;
            let args = [
                fv(logits),
                p(targets),
                p(out),
                n(rows),
                Arg::I64(start),
                n(v),
            ];
            be.launch(
                "ce_target_logit",
                (rows.div_ceil(256) as u32, 1, 1),
                (256, 1, 1),
                0,
                &args,
            )
        }
        Op::CeLoss { scale } => {
            let (max, sumexp, target) = (b.f32_in(0)?, b.f32_in(1)?, b.f32_in(2)?);
            b.same(&[(sumexp, "sumexp"), (target, "target_logit")], max.len)?;
            let loss = b.f32_out(0)?;
            b.expect(loss, "loss", 1)?;
            let args = [
                p(max),
                p(sumexp),
                p(target),
                p(loss),
                n(max.len),
                Arg::F64(*scale),
            ];
            be.launch("ce_loss", (1, 1, 1), (NORM_THREADS, 1, 1), 0, &args)
        }
        Op::CeGrad {
            vocab_start,
            vocab_local,
            scale,
        } => {
            let v = b.dim("vocab_local", *vocab_local)?;
            let (logits, targets, max, sumexp) =
                (b.float_in(0)?, b.i32_in(1)?, b.f32_in(2)?, b.f32_in(3)?);
            let rows = b.rows(logits, "logits", v)?;
            b.same(
                &[(targets, "targets"), (max, "max"), (sumexp, "sumexp")],
                rows,
            )?;
            let d = b.float_out(0)?;
            b.expect(d, "dlogits", logits.len)?;
            let start = i64::try_from(*vocab_start).map_err(|_| b.err("vocab_start too large"))?;
            let args = [
                fv(logits),
                p(targets),
                p(max),
                p(sumexp),
                fv(d),
                n(rows),
                Arg::I64(start),
                n(v),
                // fp16: the loss gradient carries the step's loss scale.
                Arg::F32((*scale * scalars.loss_scale.unwrap_or(1.0)) as f32),
            ];
            be.launch_vec("ce_grad", logits.len, &args)
        }
        Op::SumSquares => {
            let g = b.f32_in(0)?;
            let out = b.f32_out(0)?;
            b.expect(out, "sumsq", 1)?;
            let blocks = super::sum_squares::blocks_for(g.len);
            let part = be.scratch(blocks * 8)?;
            be.launch(
                "sum_squares_partial",
                (blocks as u32, 1, 1),
                (256, 1, 1),
                0,
                &[p(g), Arg::Ptr(part), n(g.len)],
            )?;
            be.launch(
                "sum_partials_into",
                (1, 1, 1),
                (256, 1, 1),
                0,
                &[Arg::Ptr(part), p(out), n(blocks)],
            )
        }
        Op::ClipCoef { max_norm } => {
            let (sumsq, coef) = (b.f32_in(0)?, b.f32_out(0)?);
            b.expect(sumsq, "sumsq", 1)?;
            b.expect(coef, "coef", 1)?;
            match (max_norm, scalars.loss_scale) {
                // No clipping, no loss scale: coef = 1 (written directly, no kernel needed).
                (None, None) => {
                    let one = [1.0f32];
                    // SAFETY: coef holds exactly one f32; synchronous copy.
                    unsafe { cudarc::driver::result::memcpy_htod_sync(coef.ptr, &one) }
                        .map_err(|e| super::device::driver_error("writing the clip coefficient", e))
                }
                // A negative max norm means no clipping; a loss scale also unscales and marks
                // an overflowed step with a NaN coefficient.
                (max_norm, loss_scale) => be.launch(
                    "clip_coef",
                    (1, 1, 1),
                    (32, 1, 1),
                    0,
                    &[
                        p(sumsq),
                        p(coef),
                        Arg::F64(max_norm.unwrap_or(-1.0)),
                        Arg::F64(loss_scale.unwrap_or(1.0)),
                        Arg::I32(i32::from(loss_scale.is_some())),
                    ],
                ),
            }
        }
        Op::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            if scalars.step == 0 {
                return Err(b.err("the optimizer step count is 1-based; got step 0"));
            }
            let (g, coef) = (b.f32_in(0)?, b.f32_in(1)?);
            b.expect(coef, "coef", 1)?;
            let (param, m, v) = (b.f32_out(0)?, b.f32_out(1)?, b.f32_out(2)?);
            b.same(&[(param, "param"), (m, "m"), (v, "v")], g.len)?;
            let (bias1, bias2) =
                super::optimizer::adam_bias_corrections(*beta1, *beta2, scalars.step);
            let args = [
                p(g),
                p(coef),
                p(param),
                p(m),
                p(v),
                n(g.len),
                Arg::F32(*beta1 as f32),
                Arg::F32(*beta2 as f32),
                Arg::F32(*eps as f32),
                Arg::F32(*weight_decay as f32),
                Arg::F32(scalars.lr as f32),
                Arg::F32(bias1),
                Arg::F32(bias2),
            ];
            be.launch_n("adamw", g.len, &args)
        }
        Op::Sgd {
            momentum,
            weight_decay,
        } => {
            if scalars.step == 0 {
                return Err(b.err("the optimizer step count is 1-based; got step 0"));
            }
            let (g, coef) = (b.f32_in(0)?, b.f32_in(1)?);
            b.expect(coef, "coef", 1)?;
            let param = b.f32_out(0)?;
            b.expect(param, "param", g.len)?;
            let buf = if outs.len() > 1 {
                let m = b.f32_out(1)?;
                b.expect(m, "momentum", g.len)?;
                m.ptr
            } else {
                0
            };
            let args = [
                p(g),
                p(coef),
                p(param),
                Arg::Ptr(buf),
                n(g.len),
                Arg::F32(*momentum as f32),
                Arg::F32(*weight_decay as f32),
                Arg::F32(scalars.lr as f32),
                Arg::I32(i32::from(scalars.step == 1)),
            ];
            be.launch_n("sgd", g.len, &args)
        }
    }
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
    be.launch_vec("convert", len, &args)
}

/// Launch a norm kernel over `rows` rows, one warp each.
fn launch_rows(be: &mut CudaBackend, name: &'static str, rows: usize, args: &[Arg]) -> Result<()> {
    let blocks = rows.div_ceil(NORM_ROWS_PER_BLOCK) as u32;
    be.launch(name, (blocks, 1, 1), (NORM_THREADS, 1, 1), 0, args)
}

/// Rows of a column-partial reduction: enough chunks to fill the GPU, each of ≥ 64 rows.
fn chunking(rows: usize) -> (usize, usize) {
    let chunk_rows = rows.div_ceil(REDUCTION_CHUNKS as usize).max(64);
    (chunk_rows, rows.div_ceil(chunk_rows))
}

/// Launch a column-partial pass over `cols` columns in `chunks` chunks: the vector kernel
/// (blocks of 32 × 8 threads, 256 columns of 8-element vectors each) where `cols` is a multiple
/// of 8 and every operand is 16-byte aligned, else the scalar one (a thread per column). Both
/// take `args` and write the same partials.
fn launch_column_partials(
    be: &mut CudaBackend,
    (cols, chunks): (usize, usize),
    operands: &[Buf],
    (scalar, vector): (&'static str, &'static str),
    args: &[Arg],
) -> Result<()> {
    let grid = (cols.div_ceil(256) as u32, chunks as u32, 1);
    if cols.is_multiple_of(8) && operands.iter().all(|b| b.ptr % 16 == 0) {
        be.launch(vector, grid, (32, 8, 1), 0, args)
    } else {
        be.launch(scalar, grid, (256, 1, 1), 0, args)
    }
}

/// dw (+=) Σ_rows dy·xhat, through per-chunk partials (deterministic, double accumulation).
#[allow(clippy::too_many_arguments)]
fn norm_dw(
    be: &mut CudaBackend,
    dy: Buf,
    x: Buf,
    mean: u64,
    rstd: Buf,
    (dw, accumulate): (Buf, bool),
    rows: usize,
    d: usize,
) -> Result<()> {
    let (chunk_rows, chunks) = chunking(rows);
    let part = be.scratch(chunks * d * 8)?;
    let args = [
        fv(dy),
        fv(x),
        Arg::Ptr(mean),
        p(rstd),
        Arg::Ptr(part),
        n(rows),
        n(d),
        n(chunk_rows),
    ];
    let names = ("norm_dw_partial", "norm_dw_partial8");
    launch_column_partials(be, (d, chunks), &[dy, x], names, &args)?;
    be.launch(
        "add_partials",
        (d.div_ceil(256) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(part),
            p(dw),
            n(d),
            n(chunks),
            Arg::I32(i32::from(accumulate)),
        ],
    )
}

/// out[cols] (+= when `accumulate`, else overwritten) column sums of x[rows, cols].
pub(super) fn col_sum_into(
    be: &mut CudaBackend,
    x: Buf,
    (out, accumulate): (Buf, bool),
    rows: usize,
    cols: usize,
) -> Result<()> {
    let (chunk_rows, chunks) = chunking(rows);
    let part = be.scratch(chunks * cols * 8)?;
    let args = [fv(x), Arg::Ptr(part), n(rows), n(cols), n(chunk_rows)];
    let names = ("col_sum_partial", "col_sum_partial8");
    launch_column_partials(be, (cols, chunks), &[x], names, &args)?;
    be.launch(
        "add_partials",
        (cols.div_ceil(256) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(part),
            p(out),
            n(cols),
            n(chunks),
            Arg::I32(i32::from(accumulate)),
        ],
    )
}
