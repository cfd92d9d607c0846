//! What the CUDA backend reserves beside the memory plan for one program, read off its ops:
//! the one computation of these sizes. The backend's `prepare` allocates exactly them
//! (`runtime/src/cuda/storage.rs`) and `parc check` predicts from them ([`super::device`]).
//! Pure: a function of the program, the run's [`KernelTarget`] (16-bit operands, a Hopper GPU)
//! and the constants below, which the backend's kernels import rather than restate.
//!
//! - **Weight casts** (16-bit runs): one 16-bit copy of every f32 `Param` a GEMM reads as its
//!   weight (or a forward GEMM's bias), 2 bytes an element, each 256-byte aligned.
//! - **GEMM scratch** (16-bit runs): per GEMM, a copy of each other f32 operand (B's, then A's,
//!   each aligned) and, for one that accumulates (backward-weight, accumulating
//!   backward-data), room for the D its algorithms are timed into; the largest op's. Beside
//!   it the longest bias (gradient) vector.
//! - **Op scratch**: the largest op's reduction partials (`SumSquares`' per-block sums; norm
//!   and bias gradients' per-chunk column sums, f64), the fused cross-entropy's per-row losses
//!   (f64), or the attention scratch the kernels lay out ([`attention_scratch`]); at least
//!   [`MIN_REDUCTION_SCRATCH`].
//! - **Aliased copies**: the largest op's inputs that are also its outputs (read from before
//!   the op writes them), except those the op updates in place (`Op::in_place`).
//! - **FP8 GEMM scratch** (every run with FP8 GEMMs): per FP8 GEMM its two operands quantized
//!   to one byte an element, K-major with K padded, their scale groups' amaxes and the
//!   dequantization factors in cuBLASLt's layout ([`fp8_gemm_scratch`]); the largest op's.
use super::ALIGN;
use crate::ir::fp8::{operands, Along, Fp8Operand, Fp8Scaling, OperandKind};
use crate::ir::op::Op;
use crate::ir::{Buffer, BufferId, BufferKind, Compute, DType, Program};
use crate::spec::{Precision, Spec};

const MIB: u64 = 1 << 20;

/// cuBLASLt's workspace, one per backend.
pub const CUBLASLT_WORKSPACE_BYTES: u64 = 32 * MIB;
/// The op scratch's smallest size.
pub const MIN_REDUCTION_SCRATCH: u64 = MIB;
/// Most chunks a column reduction (norm and bias gradients) splits its rows into, one f64
/// partial per column each.
pub const REDUCTION_CHUNKS: u64 = 128;
/// `SumSquares`' most blocks, one f64 partial each.
pub const SUM_SQUARES_BLOCKS: u64 = 1024;
/// Head dims the tensor-core attention kernels take.
const TENSOR_CORE_HEAD_DIMS: [u64; 2] = [64, 128];

/// What the CUDA backend's kernel choices, and so its scratch, depend on beyond the program:
/// the run's operand format (GEMMs take 16-bit operands in bf16 and fp16 runs; the
/// tensor-core attention kernels only in bf16 runs, fp16 runs keep the exact ones), and
/// whether the GPU runs the Hopper (sm_90) kernels, whose attention backward at head dim
/// [`PER_QUERY_HEAD_DKV`] under GQA accumulates dK and dV apart. `parc check` reads both from
/// the spec ([`KernelTarget::of_spec`]), the backend from its run and the device it runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelTarget {
    pub operands: OperandFormat,
    pub hopper: bool,
}

/// The format GEMMs (and, in bf16, attention) read their operands in: the run's precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperandFormat {
    F32,
    Bf16,
    F16,
}

impl OperandFormat {
    /// The format of a run at `precision` (FP8 GEMMs are chosen per GEMM on top of it).
    pub fn of(precision: &Precision) -> OperandFormat {
        match precision {
            Precision::Fp32 => OperandFormat::F32,
            Precision::Bf16 => OperandFormat::Bf16,
            Precision::Fp16 { .. } => OperandFormat::F16,
        }
    }
}

impl KernelTarget {
    /// The target a spec names: its precision and its cluster's GPU.
    pub fn of_spec(spec: &Spec) -> KernelTarget {
        KernelTarget {
            operands: OperandFormat::of(&spec.train.precision),
            hopper: spec.cluster.gpu.hopper(),
        }
    }

    /// Whether GEMMs take 16-bit operands (cached weight casts, per-use copies).
    pub fn half(self) -> bool {
        self.operands != OperandFormat::F32
    }
}

/// The backend's scratch sizes for one program (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendScratch {
    /// The weights GEMMs read through a cached 16-bit cast, distinct, in first-use order.
    pub casts: Vec<BufferId>,
    /// Bytes of those casts (each aligned).
    pub weight_casts: u64,
    /// The largest GEMM's per-use copies plus timing D.
    pub gemm_operands: u64,
    /// The longest bias (gradient) vector of a GEMM, in elements (16-bit runs).
    pub gemm_vector_len: u64,
    /// The largest op's reduction partials or attention scratch.
    pub reduction: u64,
    /// The largest op's copies of inputs that are also its outputs.
    pub aliased: u64,
    /// The largest FP8 GEMM's quantized operands, amaxes and scales ([`fp8_gemm_scratch`]).
    pub fp8: u64,
}

/// One op's share of [`BackendScratch`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct OpScratch {
    gemm_operands: u64,
    reduction: u64,
    aliased: u64,
}

fn aligned(bytes: u64) -> u64 {
    bytes.next_multiple_of(ALIGN)
}

/// Bytes of a 16-bit copy of `buffer`, aligned.
fn half_copy(buffer: &Buffer) -> u64 {
    aligned(buffer.numel() * 2)
}

/// Whether a weight operand is read through a cached cast (only `Param`s: a ZeRO-3 gathered
/// weight lives one use and is copied per use instead).
fn cached_cast(buffer: &Buffer) -> bool {
    buffer.kind == BufferKind::Param && buffer.dtype == DType::F32
}

/// The scratch `program`'s ops ask the CUDA backend for on `target`.
pub fn backend_scratch(program: &Program, target: KernelTarget) -> BackendScratch {
    let mut s = BackendScratch::default();
    for (_, c) in program.computes() {
        let op = op_scratch(program, c, target);
        s.gemm_operands = s.gemm_operands.max(op.gemm_operands);
        s.reduction = s.reduction.max(op.reduction);
        s.aliased = s.aliased.max(op.aliased);
        s.fp8 = s.fp8.max(fp8_scratch_of(program, c));
        if target.half() {
            gemm_casts(program, c, &mut s);
        }
    }
    s.weight_casts = s
        .casts
        .iter()
        .filter_map(|&id| program.buffer(id))
        .map(half_copy)
        .sum();
    s
}

/// The scratch one compute instruction of `program` asks for on `target`.
fn op_scratch(program: &Program, c: Compute<'_>, target: KernelTarget) -> OpScratch {
    OpScratch {
        gemm_operands: if target.half() {
            gemm_operands(program, c)
        } else {
            0
        },
        reduction: reduction(program, c, target),
        aliased: aliased(program, c),
    }
}

/// A GEMM op's A and B inputs of the backend's cuBLASLt product (input index, read as a
/// weight?); empty for other ops. Forward and backward-data: A = w, B = x or dy;
/// backward-weight: A = x, B = dy.
fn gemm_roles(op: &Op) -> &'static [(usize, bool)] {
    match op {
        Op::Matmul { .. } | Op::MatmulBwdData { .. } => &[(1, true), (0, false)],
        Op::MatmulBwdWeight { .. } => &[(1, false), (0, false)],
        _ => &[],
    }
}

/// A 16-bit run's GEMM scratch for `c`: its per-use copies, then the timing D.
fn gemm_operands(program: &Program, c: Compute<'_>) -> u64 {
    let buffer = |id: Option<&BufferId>| id.and_then(|id| program.buffer(*id));
    let copies: u64 = gemm_roles(c.op)
        .iter()
        .filter_map(|&(i, weight)| Some((buffer(c.inputs.get(i))?, weight)))
        .filter(|&(b, weight)| b.dtype == DType::F32 && !(weight && cached_cast(b)))
        .map(|(b, _)| half_copy(b))
        .sum();
    let timing = match c.op {
        Op::MatmulBwdWeight { .. }
        | Op::MatmulBwdData {
            accumulate: true, ..
        } => buffer(c.outputs.first()).map_or(0, Buffer::bytes),
        _ => 0,
    };
    copies + timing
}

/// Adds `c`'s cached weight casts and bias vector to `s` (16-bit runs).
fn gemm_casts(program: &Program, c: Compute<'_>, s: &mut BackendScratch) {
    let numel = |id: Option<&BufferId>| {
        id.and_then(|id| program.buffer(*id))
            .map_or(0, Buffer::numel)
    };
    let weights: &[usize] = match c.op {
        Op::Matmul { bias: true, .. } => {
            s.gemm_vector_len = s.gemm_vector_len.max(numel(c.inputs.get(2)));
            &[1, 2]
        }
        Op::Matmul { .. } | Op::MatmulBwdData { .. } => &[1],
        Op::MatmulBwdWeight { bias: true, .. } => {
            s.gemm_vector_len = s.gemm_vector_len.max(numel(c.outputs.get(1)));
            &[]
        }
        _ => &[],
    };
    for &id in weights.iter().filter_map(|&i| c.inputs.get(i)) {
        if program.buffer(id).is_some_and(cached_cast) && !s.casts.contains(&id) {
            s.casts.push(id);
        }
    }
}

/// `c`'s reduction partials, per-row losses or attention scratch.
fn reduction(program: &Program, c: Compute<'_>, target: KernelTarget) -> u64 {
    let numel = |id: Option<&BufferId>| {
        id.and_then(|id| program.buffer(*id))
            .map_or(0, Buffer::numel)
    };
    let (inputs, outputs) = (c.inputs, c.outputs);
    match c.op {
        Op::SumSquares => SUM_SQUARES_BLOCKS * 8,
        // dw, and db when there is one, each reduced over row chunks.
        Op::LayerNormBwd { .. } | Op::RmsNormBwd { .. } => {
            REDUCTION_CHUNKS * 8 * numel(outputs.get(1)).max(numel(outputs.get(2)))
        }
        Op::MatmulBwdWeight { bias: true, .. } => REDUCTION_CHUNKS * 8 * numel(outputs.get(1)),
        Op::Attention { .. } | Op::AttentionBwd { .. } => {
            let shapes = |ids: &[BufferId]| -> Vec<(u64, DType)> {
                let shape = |b: &Buffer| (b.numel(), b.dtype);
                let shape = |id: &BufferId| program.buffer(*id).map_or((0, DType::F32), shape);
                ids.iter().map(shape).collect()
            };
            let layout = attention_scratch(c.op, target, &shapes(inputs), &shapes(outputs));
            layout.map_or(0, |l| l.bytes)
        }
        // Each row's loss (f64), summed in a fixed order after.
        Op::CrossEntropy { .. } => numel(inputs.get(1)) * 8,
        _ => 0,
    }
}

/// Bytes of `c`'s copies of inputs that are also its outputs.
fn aliased(program: &Program, c: Compute<'_>) -> u64 {
    let (inputs, outputs) = (c.inputs, c.outputs);
    inputs
        .iter()
        .enumerate()
        .filter(|&(i, id)| {
            // The op's signature is read only for the rare input that is also an output.
            let first = inputs.iter().position(|x| x == id) == Some(i);
            first && outputs.contains(id) && !c.op.in_place().any(|(input, _)| input == i)
        })
        .map(|(_, id)| aligned(program.buffer(*id).map_or(0, Buffer::bytes)))
        .sum()
}

/// How one FP8 operand's dequantization factors are laid out (one f32 each), as cuBLASLt
/// (tensorwise) and parc's FP8 kernel (rowwise, blockwise) read them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8ScaleLayout {
    /// One factor (tensorwise).
    Scalar,
    /// One per line (rowwise: one scale group per line along K).
    PerLine,
    /// `1 × block` tiles along K: factor `(line, kb)` at `line + kb · lines`.
    LineTiles { block: u64 },
    /// `block × block` squares: factor `(lb, kb)` at `kb + lb · round4(⌈K / block⌉)`.
    Squares { block: u64 },
}

/// One quantized operand of an FP8 GEMM in the scratch: `lines` lines (the dimension that is
/// not K) of `k` elements along K, stored one byte each with leading dimension `ld` (K padded
/// with zeros to a multiple of 16, or of the block), its groups' amaxes (`groups` u32 bit
/// patterns of non-negative floats) and `scales` factors laid out as `layout`; offsets in bytes
/// from the scratch's start, each aligned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8OperandScratch {
    pub operand: Fp8Operand,
    /// The operand as stored: `[rows, cols]`.
    pub rows: u64,
    pub cols: u64,
    pub lines: u64,
    pub k: u64,
    pub ld: u64,
    pub groups: u64,
    pub layout: Fp8ScaleLayout,
    pub scales: u64,
    pub q_at: u64,
    pub amax_at: u64,
    pub scales_at: u64,
}

/// An FP8 GEMM's scratch: its operands in the op's input order and the total bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Scratch {
    pub operands: [Fp8OperandScratch; 2],
    pub bytes: u64,
}

/// The scratch of FP8 GEMM `op` over `rows` rows (its x or dy's), None for any other op.
/// Operands in the op's input order (`ir::fp8::operands`): `Matmul` x `[rows, in]`, W
/// `[out, in]`; `MatmulBwdData` dy `[rows, out]`, W; `MatmulBwdWeight` dy, x `[rows, in]`.
/// A `quantized` GEMM reads its FP8 operands from its inputs: its scratch holds only the
/// scales (each operand's `q_at` and `amax_at` are then where its scales are, and unused).
pub fn fp8_gemm_scratch(op: &Op, rows: u64) -> Option<Fp8Scratch> {
    let g = op.fp8()?;
    let (shapes, ops) = match *op {
        Op::Matmul {
            in_dim, out_dim, ..
        } => ([(rows, in_dim), (out_dim, in_dim)], operands::forward(g)),
        Op::MatmulBwdData {
            in_dim, out_dim, ..
        } => ([(rows, out_dim), (out_dim, in_dim)], operands::bwd_data(g)),
        Op::MatmulBwdWeight {
            in_dim, out_dim, ..
        } => ([(rows, out_dim), (rows, in_dim)], operands::bwd_weight(g)),
        _ => return None,
    };
    let mut bytes = 0;
    let mut take = |n: u64| {
        let at = bytes;
        bytes = aligned(bytes + n);
        at
    };
    let mut one = |(rows, cols): (u64, u64), operand: Fp8Operand| {
        let (k, lines) = match operand.along {
            Along::Cols => (cols, rows),
            Along::Rows => (rows, cols),
        };
        let (layout, pad) = match (g.scaling, operand.kind) {
            (Fp8Scaling::Tensorwise, _) => (Fp8ScaleLayout::Scalar, 16),
            (Fp8Scaling::Rowwise, _) => (Fp8ScaleLayout::PerLine, 16),
            (Fp8Scaling::Blockwise { block }, OperandKind::Tokens) => {
                (Fp8ScaleLayout::LineTiles { block }, block.max(16))
            }
            (Fp8Scaling::Blockwise { block }, OperandKind::Weight) => {
                (Fp8ScaleLayout::Squares { block }, block.max(16))
            }
        };
        let scales = match layout {
            Fp8ScaleLayout::Scalar => 1,
            Fp8ScaleLayout::PerLine => lines,
            Fp8ScaleLayout::LineTiles { block } => lines * k.div_ceil(block),
            Fp8ScaleLayout::Squares { block } => {
                k.div_ceil(block).next_multiple_of(4) * lines.div_ceil(block)
            }
        };
        let ld = k.max(1).next_multiple_of(pad);
        let groups = operand.groups(g.scaling, rows, cols);
        Fp8OperandScratch {
            operand,
            rows,
            cols,
            lines,
            k,
            ld,
            groups,
            layout,
            scales,
            q_at: take(if g.quantized { 0 } else { lines * ld }),
            amax_at: take(if g.quantized { 0 } else { groups * 4 }),
            scales_at: take(scales * 4),
        }
    };
    let a = one(shapes[0], ops[0]);
    let b = one(shapes[1], ops[1]);
    Some(Fp8Scratch {
        operands: [a, b],
        bytes,
    })
}

/// The FP8 scratch of compute instruction `c` (0 unless it is an FP8 GEMM): its rows are its
/// first input's elements over that input's width (`in_dim` for x, `out_dim` for dy).
fn fp8_scratch_of(program: &Program, c: Compute<'_>) -> u64 {
    let width = match *c.op {
        Op::Matmul { in_dim, .. } => in_dim,
        Op::MatmulBwdData { out_dim, .. } | Op::MatmulBwdWeight { out_dim, .. } => out_dim,
        _ => return 0,
    };
    let numel = c
        .inputs
        .first()
        .and_then(|id| program.buffer(*id))
        .map_or(0, Buffer::numel);
    let rows = numel / width.max(1);
    fp8_gemm_scratch(c.op, rows).map_or(0, |s| s.bytes)
}

/// Whether an attention op of `head_dim` and `scale` runs on the tensor-core kernels in a run
/// of `operands`: they take bf16 operands and the head dims listed, and need a positive scale
/// (they take the row max of raw scores).
pub fn tensor_core_attention(operands: OperandFormat, head_dim: u64, scale: f64) -> bool {
    operands == OperandFormat::Bf16
        && (scale as f32) > 0.0
        && TENSOR_CORE_HEAD_DIMS.contains(&head_dim)
}

/// Where the pieces of an attention op's scratch lie, in bytes from its start, each aligned
/// ([`attention_scratch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttentionScratch {
    /// Per operand the tensor-core kernels read as bf16 (the backward's dO, then q, k, v or the
    /// packed qkv): its bf16 copy's offset, or None where it is read in place; empty for the
    /// exact kernels.
    pub copies: Vec<Option<u64>>,
    /// The offsets of `delta` and `lse2` (backward only).
    pub stats: Option<(u64, u64)>,
    /// The offset of dQ's f32 accumulator, where there is one.
    pub dq_acc: Option<u64>,
    /// The offset of dK's and dV's f32 accumulators (dV's right after dK's, compact rows of
    /// kv_heads · head_dim), where there are: [`PER_QUERY_HEAD_DKV`].
    pub dkv_acc: Option<u64>,
    pub bytes: u64,
}

/// The head dim whose tensor-core backward under GQA takes an item per query head on a Hopper
/// (the CUDA backend's attention_ws_bwd.cu), adding each head's dK and dV into f32
/// accumulators (reserved only for a Hopper: other GPUs run the older kernels).
pub const PER_QUERY_HEAD_DKV: u64 = 128;

/// The scratch an attention op lays out (None for any other op), from its buffers' (elements,
/// dtype), inputs then outputs, on `target`. With tensor cores, a bf16
/// copy of each operand read that is not stored bf16; then for the backward `delta` and `lse2`
/// (one f32 per (batch, head, query), query rows padded to 4: the kernels' `att_rows`) and,
/// where dQ is stored bf16 and always for a packed op (dqkv's q columns are not compact
/// rows), dQ's f32 accumulator of dO's shape; at head dim [`PER_QUERY_HEAD_DKV`] under GQA on
/// a Hopper, dK's and dV's f32 accumulators.
pub fn attention_scratch(
    op: &Op,
    target: KernelTarget,
    ins: &[(u64, DType)],
    outs: &[(u64, DType)],
) -> Option<AttentionScratch> {
    let (Op::Attention(a) | Op::AttentionBwd(a)) = op else {
        return None;
    };
    let (batch, heads, head_dim, scale, packed) =
        (&a.batch, &a.heads, &a.head_dim, &a.scale, &a.packed);
    let tc = tensor_core_attention(target.operands, *head_dim, *scale);
    let backward = matches!(op, Op::AttentionBwd { .. });
    let mut bytes = 0;
    let mut take = |n: u64| {
        let at = bytes;
        bytes = aligned(bytes + n);
        at
    };
    // Inputs: [dO,] q, k, v[, o, lse], or packed [dO,] qkv[, o, lse].
    let operands = usize::from(backward) + if *packed { 1 } else { 3 };
    let copies = ins
        .iter()
        .take(if tc { operands } else { 0 })
        .map(|&(n, dtype)| (dtype != DType::Bf16).then(|| take(n * 2)))
        .collect();
    let (mut stats, mut dq_acc, mut dkv_acc) = (None, None, None);
    if backward {
        let rows = ins.get(operands + 1).map_or(0, |lse| lse.0);
        let per_head = (batch * heads).max(1);
        let len = per_head * (rows / per_head).next_multiple_of(4) * 4;
        stats = Some((take(len), take(len)));
        let bf16_dq = outs.first().is_some_and(|dq| dq.1 == DType::Bf16);
        if tc && (*packed || bf16_dq) {
            dq_acc = Some(take(ins.first().map_or(0, |d_out| d_out.0) * 4));
        }
        if tc && target.hopper && *head_dim == PER_QUERY_HEAD_DKV && a.kv_heads < *heads {
            // k's elements: its own buffer, or (packed: q's positions are k's) dO's over the
            // group.
            let k = if *packed {
                ins.first().map_or(0, |d_out| d_out.0) / heads * a.kv_heads
            } else {
                ins.get(2).map_or(0, |k| k.0)
            };
            dkv_acc = Some(take(2 * k * 4));
        }
    }
    Some(AttentionScratch {
        copies,
        stats,
        dq_acc,
        dkv_acc,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::op::{AttentionAttrs, Segment};
    use crate::ir::Instr;
    use crate::memplan::tests::program_of;

    /// A 16-bit run and an f32 one, on a Hopper.
    const HALF: KernelTarget = KernelTarget {
        operands: OperandFormat::Bf16,
        hopper: true,
    };
    const FULL: KernelTarget = KernelTarget {
        operands: OperandFormat::F32,
        hopper: true,
    };

    fn matmul(bias: bool) -> Op {
        Op::Matmul {
            in_dim: 6,
            out_dim: 4,
            bias,
            act: None,
            residual: false,
            swiglu: false,
            fp8: None,
        }
    }

    fn bwd_weight(bias: bool) -> Op {
        Op::MatmulBwdWeight {
            in_dim: 6,
            out_dim: 4,
            bias,
            accumulate_param_grad: true,
            fp8: None,
        }
    }

    /// GEMMs over x (bf16 activation), w and b (f32 params), y (bf16), dw and db (f32 grads), a
    /// ZeRO-3 gathered weight and an f32 x.
    fn gemms() -> Program {
        let bwd_data = Op::MatmulBwdData {
            in_dim: 6,
            out_dim: 4,
            accumulate: false,
            act_grad: None,
            swiglu: false,
            fp8: None,
        };
        let mut program = program_of(
            &[6000, -24, -4, 4000, 24, 4, 24, 6000],
            vec![
                Instr::compute(matmul(true), &[0, 1, 2], &[3]),
                Instr::compute(bwd_data, &[3, 1], &[0]),
                Instr::compute(bwd_weight(true), &[3, 0], &[4, 5]),
                Instr::compute(matmul(false), &[7, 6], &[3]),
            ],
        );
        for b in [0, 3] {
            program.buffers[b].dtype = DType::Bf16;
        }
        program.buffers[4].kind = BufferKind::Grad;
        program.buffers[5].kind = BufferKind::Grad;
        program.buffers[6].kind = BufferKind::GatheredParam;
        program
    }

    fn op_at(program: &Program, i: usize, half: bool) -> OpScratch {
        let target = if half { HALF } else { FULL };
        op_scratch(program, program.instrs[i].as_compute().unwrap(), target)
    }

    #[test]
    fn bf16_operands_and_cached_weights_need_no_copies() {
        let p = gemms();
        let gemm = |i, half| op_at(&p, i, half).gemm_operands;
        // Forward and backward-data: bf16 activations, a cached param: nothing to copy.
        assert_eq!((gemm(0, true), gemm(1, true)), (0, 0));
        // Backward-weight: no copies, but room to time it into an f32 dw (24 floats).
        assert_eq!(gemm(2, true), 96);
        // An f32 activation and a gathered (uncached) weight are copied per use.
        assert_eq!(gemm(3, true), 12032 + 256);
        // fp32 runs read every operand as stored.
        assert!((0..4).all(|i| gemm(i, false) == 0));
    }

    /// FP8 GEMM scratch: each operand quantized K-major (one byte an element, K padded to 16
    /// or to the block), its amaxes and its factors in cuBLASLt's layout, each aligned; the
    /// program reserves its largest FP8 GEMM's, in fp32 runs too.
    #[test]
    fn fp8_gemms_reserve_their_quantized_operands_and_scales() {
        use crate::ir::fp8::{Fp8Format, Fp8Gemm};
        let fp8 = |scaling| Some(Fp8Gemm::current(scaling, Fp8Format::E4m3));
        // 37 rows, in 200, out 136.
        let forward = |scaling| Op::Matmul {
            in_dim: 200,
            out_dim: 136,
            bias: false,
            act: None,
            residual: false,
            swiglu: false,
            fp8: fp8(scaling),
        };
        let tensorwise = fp8_gemm_scratch(&forward(Fp8Scaling::Tensorwise), 37).unwrap();
        let [x, w] = tensorwise.operands;
        assert_eq!(
            (x.lines, x.k, x.ld, x.groups, x.scales),
            (37, 200, 208, 1, 1)
        );
        assert_eq!(
            (w.lines, w.k, w.ld, w.groups, w.scales),
            (136, 200, 208, 1, 1)
        );
        assert_eq!(x.q_at, 0);
        assert_eq!(x.amax_at, aligned(37 * 208));
        assert_eq!(x.scales_at, x.amax_at + 256);
        assert_eq!(w.q_at, x.scales_at + 256);
        assert_eq!(tensorwise.bytes, w.q_at + aligned(136 * 208) + 2 * 256);
        // Blockwise(128): K padded to 256; x in 1×128 tiles, W in 128×128 squares (the K
        // blocks padded to 4 per line block).
        let block = Fp8Scaling::Blockwise { block: 128 };
        let [x, w] = fp8_gemm_scratch(&forward(block), 37).unwrap().operands;
        assert_eq!((x.ld, x.groups, x.scales), (256, 37 * 2, 37 * 2));
        assert_eq!(x.layout, Fp8ScaleLayout::LineTiles { block: 128 });
        assert_eq!((w.ld, w.groups, w.scales), (256, 2 * 2, 4 * 2));
        // The data gradient reads W along its rows: 200 lines of K = 136.
        let bwd_data = Op::MatmulBwdData {
            in_dim: 200,
            out_dim: 136,
            accumulate: false,
            act_grad: None,
            swiglu: false,
            fp8: fp8(Fp8Scaling::Rowwise),
        };
        let [dy, w] = fp8_gemm_scratch(&bwd_data, 37).unwrap().operands;
        assert_eq!((dy.lines, dy.k, dy.ld, dy.scales), (37, 136, 144, 37));
        assert_eq!((w.lines, w.k, w.ld, w.scales), (200, 136, 144, 200));
        // The weight gradient contracts over the 37 rows: dy and x transposed.
        let bwd_weight = Op::MatmulBwdWeight {
            in_dim: 200,
            out_dim: 136,
            bias: true,
            accumulate_param_grad: true,
            fp8: fp8(block),
        };
        let [dy, x] = fp8_gemm_scratch(&bwd_weight, 37).unwrap().operands;
        assert_eq!((dy.lines, dy.k, dy.ld, dy.groups), (136, 37, 128, 136));
        assert_eq!((x.lines, x.k, x.ld, x.groups), (200, 37, 128, 200));
        assert_eq!(fp8_gemm_scratch(&matmul(false), 37), None);
        // A program reserves its largest FP8 GEMM's scratch whatever its precision.
        let program = program_of(
            &[37 * 200, 136 * 200, 37 * 136],
            vec![Instr::compute(forward(block), &[0, 1], &[2])],
        );
        let expected = fp8_gemm_scratch(&forward(block), 37).unwrap().bytes;
        assert_eq!(backend_scratch(&program, FULL).fp8, expected);
        assert_eq!(backend_scratch(&program, HALF).fp8, expected);
        assert_eq!(backend_scratch(&gemms(), HALF).fp8, 0);
    }

    #[test]
    fn params_read_by_gemms_are_cast_once_each() {
        let half = backend_scratch(&gemms(), HALF);
        // w, read by two GEMMs, and b; not the gathered weight.
        assert_eq!(half.casts, vec![BufferId(1), BufferId(2)]);
        assert_eq!(half.weight_casts, 2 * 256);
        assert_eq!(half.gemm_vector_len, 4);
        let full = backend_scratch(&gemms(), FULL);
        assert_eq!(
            (full.casts.len(), full.weight_casts, full.gemm_vector_len),
            (0, 0, 0)
        );
    }

    #[test]
    fn scratch_is_the_largest_op_of_each_kind() {
        // Buffer b has 1000·(b+1) f32 elements.
        let program = program_of(
            &[1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000],
            vec![
                Instr::compute(matmul(false), &[0, 1], &[2]),
                Instr::compute(bwd_weight(true), &[2, 0], &[1, 3]),
                Instr::compute(Op::SumSquares, &[7], &[0]),
                Instr::compute(Op::Scale { factor: 2.0 }, &[4], &[4]),
            ],
        );
        let full = backend_scratch(&program, FULL);
        // Bias gradient b3 (4000 floats): 128 chunks × 8 bytes per column.
        assert_eq!(full.reduction, 128 * 8 * 4000);
        // An fp32 run's GEMMs read their operands as stored.
        assert_eq!(full.gemm_operands, 0);
        // b4 is read and written by one op.
        assert_eq!(full.aliased, 20224);
        // A 16-bit run copies the bwd-weight GEMM's f32 operands b2 and b0 (3000 + 1000
        // halves, each aligned) and times it into a copy of dw (b1: 2000 floats).
        let half = backend_scratch(&program, HALF);
        assert_eq!(half.gemm_operands, 6144 + 2048 + 8000);
        assert_eq!(
            (half.reduction, half.aliased),
            (full.reduction, full.aliased)
        );
    }

    #[test]
    fn the_fused_loss_takes_no_copy_of_its_logits() {
        // Logits b0 (30 rows × 100) updated in place, targets b1, loss b2; b3 an ordinary op
        // whose output is its input, for contrast.
        let loss = Op::CrossEntropy {
            vocab: 100,
            scale: 0.5,
        };
        let program = program_of(
            &[3000, 30, 1, 3000],
            vec![
                Instr::compute(loss, &[0, 1], &[0, 2]),
                Instr::compute(Op::Scale { factor: 2.0 }, &[3], &[3]),
            ],
        );
        let s = backend_scratch(&program, FULL);
        // Only Scale's input is copied (12000 bytes, aligned); the loss keeps one f64 per row.
        assert_eq!((s.aliased, s.reduction), (12032, 30 * 8));
    }

    #[test]
    fn aliased_copies_take_the_stored_bytes() {
        // 1000 elements scaled in place: 4000 bytes in f32, 2000 in bf16 (256-byte aligned).
        let in_place = |dtype| {
            let mut program = program_of(
                &[1000],
                vec![Instr::compute(Op::Scale { factor: 2.0 }, &[0], &[0])],
            );
            program.buffers[0].dtype = dtype;
            backend_scratch(&program, HALF).aliased
        };
        assert_eq!((in_place(DType::F32), in_place(DType::Bf16)), (4096, 2048));
    }

    /// Attention over 10 positions × batch 2, 4 heads and 2 kv heads of `head_dim`.
    fn attention(forward: bool, head_dim: u64) -> Op {
        let positions = vec![Segment { start: 0, len: 10 }];
        let attrs = AttentionAttrs {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            head_dim,
            causal: true,
            scale: 0.125,
            q_positions: positions.clone(),
            kv_positions: positions,
            packed: false,
        };
        if forward {
            Op::Attention(attrs)
        } else {
            Op::AttentionBwd(attrs)
        }
    }

    /// `op` with q, k, v packed into one buffer.
    fn packed(mut op: Op) -> Op {
        if let Op::Attention(AttentionAttrs { packed, .. })
        | Op::AttentionBwd(AttentionAttrs { packed, .. }) = &mut op
        {
            *packed = true;
        }
        op
    }

    fn bytes(op: &Op, target: KernelTarget, ins: &[(u64, DType)], outs: &[(u64, DType)]) -> u64 {
        attention_scratch(op, target, ins, outs).map_or(0, |l| l.bytes)
    }

    /// bf16 operands are read in place (no copy), f32 ones copied; the backward's delta and
    /// lse2 pad each (batch, head)'s 10 query rows to 12; a bf16 dQ gets an f32 accumulator
    /// on the tensor-core path only; every piece starts on a 256-byte boundary.
    #[test]
    fn attention_scratch_holds_copies_of_f32_operands_only() {
        let (f, b) = (DType::F32, DType::Bf16);
        let (q, kv, lse) = (10 * 2 * 4 * 64, 10 * 2 * 2 * 64, 2 * 4 * 10);
        let fwd = attention(true, 64);
        assert_eq!(bytes(&fwd, HALF, &[(q, b), (kv, b), (kv, b)], &[]), 0);
        assert_eq!(
            bytes(&fwd, HALF, &[(q, f), (kv, b), (kv, f)], &[]),
            aligned(q * 2) + aligned(kv * 2)
        );
        // fp32 and fp16 runs and other head dims: the exact kernels, no copies.
        let f32_qkv = [(q, f), (kv, f), (kv, f)];
        assert_eq!(bytes(&fwd, FULL, &f32_qkv, &[]), 0);
        let fp16 = KernelTarget {
            operands: OperandFormat::F16,
            ..HALF
        };
        assert!(fp16.half(), "fp16 GEMMs take 16-bit operands");
        assert_eq!(bytes(&fwd, fp16, &f32_qkv, &[]), 0);
        assert_eq!(bytes(&attention(true, 32), HALF, &f32_qkv, &[]), 0);
        let bwd = attention(false, 64);
        let stats = aligned(2 * 4 * 12 * 4);
        let ins = |t: DType| [(q, t), (q, t), (kv, t), (kv, t), (q, t), (lse, f)];
        let outs = |t: DType| [(q, t), (kv, t), (kv, t)];
        assert_eq!(bytes(&bwd, HALF, &ins(b), &outs(f)), 2 * stats);
        assert_eq!(
            bytes(&bwd, HALF, &ins(b), &outs(b)),
            2 * stats + aligned(q * 4)
        );
        let copies = 2 * aligned(q * 2) + 2 * aligned(kv * 2);
        assert_eq!(bytes(&bwd, HALF, &ins(f), &outs(f)), copies + 2 * stats);
        assert_eq!(bytes(&bwd, FULL, &ins(b), &outs(b)), 2 * stats);
        assert_eq!(bytes(&bwd, fp16, &ins(f), &outs(f)), 2 * stats);
        let layout = attention_scratch(&bwd, HALF, &ins(f), &outs(b)).unwrap();
        assert_eq!(layout.copies.len(), 4);
        let offsets = layout.copies.iter().flatten().copied();
        let stats_at = layout.stats.unwrap();
        for at in offsets.chain([stats_at.0, stats_at.1, layout.dq_acc.unwrap()]) {
            assert_eq!(at % 256, 0);
        }
        assert_eq!(attention_scratch(&Op::Copy, HALF, &[], &[]), None);
    }

    /// At head dim 128 under GQA the tensor-core backward's scratch on a Hopper ends with dK's
    /// and dV's f32 accumulators (2 · k's elements · 4 bytes), packed or not; not on other
    /// GPUs, not at head dim 64, nor without GQA, nor for the exact kernels or the forward.
    #[test]
    fn gqa_backward_at_head_dim_128_accumulates_dk_dv_apart() {
        let (f, b) = (DType::F32, DType::Bf16);
        let (q, kv, lse) = (10 * 2 * 4 * 128, 10 * 2 * 2 * 128, 2 * 4 * 10);
        let ins = [(q, b), (q, b), (kv, b), (kv, b), (q, b), (lse, f)];
        let outs = [(q, b), (kv, b), (kv, b)];
        let bwd = attention(false, 128);
        let layout = attention_scratch(&bwd, HALF, &ins, &outs).unwrap();
        let at = layout.dkv_acc.unwrap();
        assert_eq!(at % 256, 0);
        assert_eq!(layout.bytes, aligned(at + 2 * kv * 4));
        let packed_ins = [(q, b), (q + 2 * kv, b), (q, b), (lse, f)];
        let packed_layout =
            attention_scratch(&packed(bwd.clone()), HALF, &packed_ins, &[(q + 2 * kv, b)]);
        assert_eq!(packed_layout.unwrap().bytes, layout.bytes);
        assert_eq!(
            attention_scratch(&bwd, FULL, &ins, &outs).unwrap().dkv_acc,
            None
        );
        // Other GPUs run the older kernels, which accumulate nothing apart.
        let other_gpu = KernelTarget {
            hopper: false,
            ..HALF
        };
        let other = attention_scratch(&bwd, other_gpu, &ins, &outs).unwrap();
        assert_eq!((other.dkv_acc, other.bytes), (None, at));
        let mut mha = bwd.clone();
        if let Op::AttentionBwd(a) = &mut mha {
            a.kv_heads = a.heads;
        }
        let mha_ins = [(q, b), (q, b), (q, b), (q, b), (q, b), (lse, f)];
        assert_eq!(
            attention_scratch(&mha, HALF, &mha_ins, &outs)
                .unwrap()
                .dkv_acc,
            None
        );
        let d64 = attention(false, 64);
        assert_eq!(
            attention_scratch(&d64, HALF, &ins, &outs).unwrap().dkv_acc,
            None
        );
        let fwd = attention(true, 128);
        assert_eq!(
            attention_scratch(&fwd, HALF, &ins[1..4], &[])
                .unwrap()
                .dkv_acc,
            None
        );
    }

    /// A packed op's scratch: a copy of the whole qkv where it is f32 (and of dO), never of
    /// its parts; the backward's dQ accumulator whatever dqkv's dtype (dq is a column range
    /// of it, so the kernels never accumulate in place), sized as dO.
    #[test]
    fn packed_attention_copies_qkv_whole_and_always_accumulates_dq_apart() {
        let (f, b) = (DType::F32, DType::Bf16);
        // 10 positions x batch 2; 4 heads, 2 kv heads of 64: rows of (4 + 2 * 2) * 64.
        let (q, qkv, lse) = (10 * 2 * 4 * 64, 10 * 2 * 8 * 64, 2 * 4 * 10);
        let fwd = packed(attention(true, 64));
        assert_eq!(bytes(&fwd, HALF, &[(qkv, b)], &[]), 0);
        assert_eq!(bytes(&fwd, HALF, &[(qkv, f)], &[]), aligned(qkv * 2));
        assert_eq!(bytes(&fwd, FULL, &[(qkv, f)], &[]), 0);
        let bwd = packed(attention(false, 64));
        let (stats, acc) = (aligned(2 * 4 * 12 * 4), aligned(q * 4));
        let ins = |t: DType| [(q, t), (qkv, t), (q, t), (lse, f)];
        for dqkv in [b, f] {
            let reserved = bytes(&bwd, HALF, &ins(b), &[(qkv, dqkv)]);
            assert_eq!(reserved, 2 * stats + acc);
        }
        let copies = aligned(q * 2) + aligned(qkv * 2);
        assert_eq!(
            bytes(&bwd, HALF, &ins(f), &[(qkv, f)]),
            copies + 2 * stats + acc
        );
        // The exact kernels: delta and lse2 only.
        assert_eq!(bytes(&bwd, FULL, &ins(f), &[(qkv, f)]), 2 * stats);
        let layout = attention_scratch(&bwd, HALF, &ins(f), &[(qkv, b)]).unwrap();
        assert_eq!(layout.copies.len(), 2);
    }

    #[test]
    fn programs_reserve_their_largest_attention_scratch() {
        // q, k, v, o and lse of `attention(_, 64)`; the backward's dO is o.
        let (q, kv, lse) = (10 * 2 * 4 * 64, 10 * 2 * 2 * 64, 2 * 4 * 10);
        let mut program = program_of(
            &[q, kv, kv, q, lse],
            vec![
                Instr::compute(attention(true, 64), &[0, 1, 2], &[3, 4]),
                Instr::compute(attention(false, 64), &[3, 0, 1, 2, 3, 4], &[0, 1, 2]),
            ],
        );
        let (q, kv, stats) = (q as u64, kv as u64, aligned(2 * 4 * 12 * 4));
        assert_eq!(backend_scratch(&program, FULL).reduction, 2 * stats);
        // The backward's copies of dO, q, k and v.
        let copies = 2 * aligned(q * 2) + 2 * aligned(kv * 2);
        assert_eq!(
            backend_scratch(&program, HALF).reduction,
            copies + 2 * stats
        );
        // A bf16 q is read in place, and dQ, stored bf16 too, accumulates in f32.
        program.buffers[0].dtype = DType::Bf16;
        assert_eq!(
            backend_scratch(&program, HALF).reduction,
            copies - aligned(q * 2) + 2 * stats + aligned(q * 4)
        );
    }
}
