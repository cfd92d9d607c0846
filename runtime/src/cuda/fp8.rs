//! FP8 GEMMs on the CUDA backend: `Matmul`, `MatmulBwdData` and `MatmulBwdWeight` with `fp8`
//! set, computing what `parc_compiler::ir::fp8` defines and the CPU backend emulates
//! (`runtime/src/cpu/fp8.rs`): each operand quantized with its scale groups' power-of-two
//! scales, the product of the dequantized operands accumulated in f32.
//!
//! Per GEMM, for each operand (`kernels/fp8.cu`): the amax of every scale group
//! (`fp8_amax`; `fp8_amax_one` for one group, tensorwise, in 16-byte vectors), the operand
//! quantized into the FP8 scratch K-major, K padded with zeros to a multiple of 16 (of the
//! block, blockwise): along its lines where K runs along its columns (`fp8_quantize_lines`),
//! transposed through shared memory in 64 × 64 tiles where K runs along its rows
//! (`fp8_quantize_cols`), and its dequantization factors `1/s` in its scale layout
//! (`fp8_scales`). `memplan::fp8_gemm_scratch` lays the scratch out; `prepare` reserves
//! the program's largest. An operand whose scale groups span ranks takes its amaxes from the
//! op's amax input instead (`Op::Fp8Amax` on each rank's piece, `fp8_amax` too, then the
//! plan's NCCL all-reduce max over exactly the ranks sharing them), so its scales are the
//! single-rank run's. Under delayed scaling both operands take the scale amax of their
//! history the same way (no amax pass before quantizing); `Op::Fp8AmaxRecord` max-adds the
//! operand's amax into the history's step slot (not zeroed first) inside the quantize pass
//! of the GEMM after it (`fp8_record`), and `Op::Fp8HistoryRoll` rolls it at the step's end
//! (`fp8_history_roll`; a run of consecutive rolls in one launch, `fp8_roll`) and queues a
//! copy of the new scale amax to the host (`scale_amax`): a delayed GEMM either of whose scale
//! amaxes is 0 (an empty history: the first step) runs as the plain GEMM instead (`delayed_cold`), as on the CPU, its records made apart
//! (`fp8_amax_one`).
//!
//! A `quantized` GEMM (`Fp8Gemm::quantized`, tensorwise) quantizes nothing itself: its two
//! operands come from inputs that `Op::Fp8Quantize` wrote (`fp8_quantize`: one pass over a
//! tensor for every GEMM reading it, both layouts at once, the records riding on it), K-major
//! with no padding, and only their factors `1/s` are computed here, from the amax inputs
//! (`quantized_operands`); the cuBLASLt call is the same. Its cold path (delayed, an empty
//! history) runs on the unquantized inputs as above.
//!
//! The product of a tensorwise GEMM is cuBLASLt's FP8 GEMM (`gemm::Blas::run_fp8`) in the one
//! form Hopper runs, A transposed and B not, both read K-major: A is the op's second operand (W,
//! W read along its rows, or x), B its first (x or dy), D the op's output (`y`ᵀ, `dx`ᵀ, `dW`ᵀ
//! column-major), beta 1 where the op accumulates, one dequantization factor each
//! (`SCALAR_32F`); forward GEMMs accumulate in the tensor cores' own accumulator, gradients
//! promote into fp32 every few K steps (`PARC_FP8_ACCUM_KERNEL`, `variants.rs`). Rowwise and
//! blockwise GEMMs, whose scales cuBLASLt's algorithm search refuses on Hopper, run on parc's
//! own kernel (`fp8_gemm`) from the same quantized operands, factors and D.
//!
//! Epilogues run apart, with the backend's kernels, so every scale mode gets the op's full
//! semantics: a bias is broadcast into y first and the product accumulated onto it (a bf16 y
//! thereby rounds b to bf16 first); a residual without a bias is the GEMM's C (beta 1, one pass,
//! as in bf16), with a bias it is added (`add_fwd`) after; an activation is applied
//! (`activation_fwd`) after; an activation gradient multiplies dx in place
//! (`activation_bwd`); a bias gradient sums the exact dy's columns (`columns::col_sum_into`).
use super::args::{fv, n, p, Bound};
use super::columns::col_sum_into;
use super::epilogue::{
    activation_grad_in_place, residual_then_activation, swiglu_apart, swiglu_grad,
};
use super::fp8_gemm::{self, scale_layout, Quantized};
use super::gemm::{Epilogue, Fp8Operands, Gemm, Operands, Output};
use super::kernel::Kernel;
use super::variants::{Fp8AccumKernel, Fp8AmaxKernel, Fp8FactorsKernel};
use super::{raw_ptr, Arg, Buf, CudaBackend};
use crate::error::{Result, RuntimeError};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaSlice;
use parc_compiler::ir::fp8::{Along, Fp8AmaxAttrs, Fp8Format, Fp8Gemm, Fp8Scaling};
use parc_compiler::ir::op::Op;
use parc_compiler::ir::DType;
use parc_compiler::memplan::{fp8_gemm_scratch, Fp8OperandScratch, Fp8ScaleLayout, Fp8Scratch};

/// Threads of an `fp8_amax` block and the elements one block reduces (`kernels/fp8.cu`).
const AMAX_THREADS: u64 = 256;
const AMAX_PIECE: u64 = AMAX_THREADS * 16;
/// The most blocks an `fp8_amax` launch takes (it loops over the rest).
const AMAX_BLOCKS: u64 = 1 << 16;
/// The most blocks an `fp8_amax_one` launch takes: a few waves of the largest GPUs, so each
/// thread reduces many vectors before its block's one atomic.
const AMAX_ONE_BLOCKS: u64 = 1024;
/// Threads of an `fp8_quantize_lines` block (8 bytes of a line each) and of an
/// `fp8_quantize_cols` block (a 64 × 64 tile), and the tile's side.
const QUANT_LINE_VECS: u64 = 256;
const QUANT_TILE: u64 = 64;
/// The most lines (tiles along K) one quantize launch spans in its grid's y (it loops over
/// the rest).
const QUANT_GRID_Y: u64 = 65535;

/// Whether FP8 GEMM `op` accumulates in the tensor cores' own accumulator under `accum`.
fn fast_accum(accum: Fp8AccumKernel, op: &Op) -> bool {
    match accum {
        Fp8AccumKernel::Forward => matches!(op, Op::Matmul { .. }),
        Fp8AccumKernel::Split => false,
    }
}

/// The GEMM output type of buffer `b`.
fn output(b: Buf) -> Output {
    match b.dtype {
        DType::Bf16 => Output::Bf16,
        _ => Output::F32,
    }
}

impl CudaBackend {
    /// The FP8 scratch with room for `bytes`: `prepare`'s reservation, or (without one, or
    /// where it is short) a new allocation replacing it.
    fn fp8_scratch(&mut self, bytes: usize) -> Result<CUdeviceptr> {
        let room = self.gemm_operands.fp8.as_ref().map_or(0, CudaSlice::len);
        if room < bytes {
            // Free the old scratch first so peak memory holds only one.
            self.gemm_operands.fp8 = None;
            self.gemm_operands.fp8 = Some(self.alloc_bytes(bytes, "FP8 GEMM operands and scales")?);
        }
        match &self.gemm_operands.fp8 {
            Some(s) => Ok(raw_ptr(&self.stream, s)),
            None => Err(RuntimeError::Unsupported("FP8 GEMM scratch missing".into())),
        }
    }
}

/// The largest finite |element| of each `rb × cb` group of `buf` (`[rows, cols]`) into the
/// `groups` f32 values at `out`, zeroed first (`kernels/fp8.cu`'s `fp8_amax` kernels, as the
/// `fp8_amax` kernel variant chooses).
fn group_amax(
    be: &mut CudaBackend,
    buf: Buf,
    (rows, cols): (u64, u64),
    (rb, cb): (u64, u64),
    (groups, out): (u64, CUdeviceptr),
) -> Result<()> {
    be.zero_bytes(out, (groups * 4) as usize)?;
    if rows * cols == 0 {
        return Ok(());
    }
    if groups == 1 {
        // One group (tensorwise): the whole operand, read as 16-byte vectors.
        return max_into_one(be, buf, rows * cols, out);
    }
    let gpr = cols.max(1).div_ceil(cb);
    if be.variants.fp8_amax == Fp8AmaxKernel::Vectors {
        if let Some(launch) = VectorAmax::fits(buf, (rows, cols), (rb, cb), gpr) {
            return launch.run(be, buf, out);
        }
    }
    let u = |v: u64| n(v as usize);
    let pieces = (rb * cb).div_ceil(AMAX_PIECE);
    let items = groups * pieces;
    let blocks = items.clamp(1, AMAX_BLOCKS) as u32;
    let args = [
        fv(buf),
        u(rows),
        u(cols),
        u(rb),
        u(cb),
        u(gpr),
        u(pieces),
        u(items),
        Arg::Ptr(out),
    ];
    let threads = (AMAX_THREADS as u32, 1, 1);
    be.launch(Kernel::Fp8Amax, (blocks, 1, 1), threads, 0, &args)
}

/// A group amax by `fp8_amax_rows8` or `fp8_amax_cols8` (kernels/fp8.cu): threads in x take
/// a row's 8-vector column slots, y the runs of at most [`AMAX_SPAN`] rows inside each row
/// group.
struct VectorAmax {
    kernel: Kernel,
    rows: u64,
    cols: u64,
    rb: u64,
    /// The kernels' 32-bit arguments, in their order: each below 2^31.
    counts: RunCounts,
}

/// A vector amax launch's counts: the group width `cb` and groups a row of groups `gpr`, the
/// rows a run reads `span`, the runs of a row group `runs` and of the operand `total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RunCounts {
    cb: u64,
    gpr: u64,
    span: u64,
    runs: u64,
    total: u64,
}

impl RunCounts {
    fn all(self) -> [u64; 5] {
        [self.cb, self.gpr, self.span, self.runs, self.total]
    }
}

/// The most rows one thread of `fp8_amax_rows8`/`fp8_amax_cols8` reads before its group's
/// atomic.
const AMAX_SPAN: u64 = 64;
/// The most blocks a vector amax launch takes along y (its runs; it loops over the rest).
const AMAX_GRID_Y: u64 = 65535;
/// Blocks a vector amax launch aims at in all: a few waves of the largest GPUs.
const AMAX_VECTOR_BLOCKS: u64 = 4096;

impl VectorAmax {
    /// The launch for `buf`'s groups where the vector kernels read them: rows of whole
    /// 16-byte-aligned 8-vectors, groups of whole 8-vectors of a row (`rows8`) or of one
    /// column (`cols8`), counts that fit their 32-bit arguments. None otherwise.
    fn fits(buf: Buf, (rows, cols): (u64, u64), (rb, cb): (u64, u64), gpr: u64) -> Option<Self> {
        let kernel = match cb {
            1 => Kernel::Fp8AmaxCols8,
            _ if cb.is_multiple_of(8) => Kernel::Fp8AmaxRows8,
            _ => return None,
        };
        if !cols.is_multiple_of(8) || !buf.ptr.is_multiple_of(16) || rb == 0 {
            return None;
        }
        let span = rb.min(AMAX_SPAN);
        let runs = rb.div_ceil(span);
        let counts = RunCounts {
            cb,
            gpr,
            span,
            runs,
            total: rows.div_ceil(rb) * runs,
        };
        let fits_i32 = |v: u64| v <= i32::MAX as u64;
        (counts.all().iter().all(|&v| fits_i32(v))
            && fits_i32(cols)
            && fits_i32(rows.div_ceil(rb) * gpr))
        .then_some(VectorAmax {
            kernel,
            rows,
            cols,
            rb,
            counts,
        })
    }

    fn run(&self, be: &mut CudaBackend, buf: Buf, out: CUdeviceptr) -> Result<()> {
        let bx = (self.cols / 8).div_ceil(AMAX_THREADS);
        let by = (self.counts.total)
            .min(AMAX_GRID_Y)
            .min((AMAX_VECTOR_BLOCKS / bx).max(1));
        let u = |v: u64| n(v as usize);
        let mut args = vec![fv(buf), u(self.rows), u(self.cols), u(self.rb)];
        args.extend(self.counts.all().map(|v| Arg::I32(v as i32)));
        args.push(Arg::Ptr(out));
        let grid = (bx as u32, by as u32, 1);
        be.launch(self.kernel, grid, (AMAX_THREADS as u32, 1, 1), 0, &args)
    }
}

/// `Op::Fp8Amax`: the group amaxes of one FP8 GEMM operand into its output, in the group
/// order the GEMM's scales read (`ir::fp8`), for the max all-reduce that follows it.
pub(super) fn amax(be: &mut CudaBackend, b: &Bound, a: &Fp8AmaxAttrs) -> Result<()> {
    let (x, out) = (b.input(0)?, b.output(0)?);
    let cols = a.cols.max(1);
    let rows = x.len as u64 / cols;
    let (rb, cb) = a.operand.group_shape(a.scaling, rows, cols);
    let groups = a.operand.groups(a.scaling, rows, cols);
    if out.len as u64 != groups {
        return Err(b.err(format!(
            "writes {} amaxes, but its [{rows}, {cols}] operand has {groups} scale groups",
            out.len
        )));
    }
    group_amax(be, x, (rows, cols), (rb, cb), (groups, out.ptr))
}

/// The largest finite |element| of the first `len` (not 0) elements of `buf` max-added into
/// the one f32 at `out` (`fp8_amax_one`, 16-byte vectors; `out` is not zeroed here).
pub(super) fn max_into_one(
    be: &mut CudaBackend,
    buf: Buf,
    len: u64,
    out: CUdeviceptr,
) -> Result<()> {
    let blocks = len.div_ceil(AMAX_PIECE).clamp(1, AMAX_ONE_BLOCKS) as u32;
    let args = [fv(buf), n(len as usize), Arg::Ptr(out)];
    let threads = (AMAX_THREADS as u32, 1, 1);
    be.launch(Kernel::Fp8AmaxOne, (blocks, 1, 1), threads, 0, &args)
}

/// `Op::Fp8HistoryRoll` (delayed scaling, at the step's end): the history rolled one step and
/// its largest value written to the scale amax (`fp8_history_roll`).
pub(super) fn roll(be: &mut CudaBackend, b: &Bound) -> Result<()> {
    if be.roll_in_run(be.records.current(), b)? {
        return Ok(());
    }
    let (history, amax) = (b.output(0)?, b.output(1)?);
    if history.len < 2 || amax.len != 1 {
        return Err(b.err(format!(
            "rolls a history of {} values into {} scale amaxes; it needs at least 2 and 1",
            history.len, amax.len
        )));
    }
    let args = [p(history), n(history.len), p(amax)];
    be.launch(Kernel::Fp8HistoryRoll, (1, 1, 1), (1, 1, 1), 0, &args)?;
    be.scale_amaxes.copy_after_roll(&be.ctx, &be.stream, amax)
}

/// Whether delayed-scaling GEMM `b` runs unquantized this step: either operand's history is
/// empty (its scale amax 0), as on the CPU (`cpu/linear.rs`). False under current scaling.
pub(super) fn delayed_cold(be: &mut CudaBackend, b: &Bound, fp8: Fp8Gemm) -> Result<bool> {
    if fp8.history.is_none() {
        return Ok(false);
    }
    let amaxes = amax_roles(b.op)
        .into_iter()
        .filter_map(|role| b.optional_input(role));
    any_history_empty(be, amaxes)
}

/// Whether any of the scale amaxes `amaxes` is 0 (an empty history: a delayed GEMM reading it
/// runs unquantized this step), as the host knows them (`scale_amax`).
pub(super) fn any_history_empty(
    be: &mut CudaBackend,
    amaxes: impl IntoIterator<Item = Buf>,
) -> Result<bool> {
    for amax in amaxes {
        if be.scale_amaxes.value(&be.ctx, &be.stream, amax)? == 0.0 {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Quantizes `buf` as `s` lays it out (in the scratch at `base`): its groups' amaxes (or the
/// `reduced` ones the op reads), the FP8 operand and its dequantization factors in `layout`'s
/// order (`fp8_scales`' code, block); with `record`, the quantize pass also max-adds the
/// operand's largest finite |element| there (a delayed-scaling record, `fp8_record`).
fn quantize(
    be: &mut CudaBackend,
    (buf, reduced, record): (Buf, Option<Buf>, Option<CUdeviceptr>),
    s: &Fp8OperandScratch,
    scaling: Fp8Scaling,
    base: CUdeviceptr,
    (layout, block): (i32, u64),
) -> Result<()> {
    if buf.len as u64 != s.rows * s.cols {
        return Err(RuntimeError::Buffer {
            id: buf.id.0,
            what: format!(
                "holds {} elements, but the FP8 GEMM reads it as [{}, {}]",
                buf.len, s.rows, s.cols
            ),
        });
    }
    let (rb, cb) = s.operand.group_shape(scaling, s.rows, s.cols);
    let gpr = s.cols.max(1).div_ceil(cb);
    let (q, scales) = (
        base + s.q_at as CUdeviceptr,
        base + s.scales_at as CUdeviceptr,
    );
    let u = |v: u64| n(v as usize);
    let max = Arg::F32(s.operand.format.max());
    // The groups' amaxes: reduced across the ranks sharing them (the op's amax input, in the
    // same group order), or this operand's own, into the scratch.
    let amax = match reduced {
        Some(r) if r.len as u64 == s.groups => r.ptr,
        Some(r) => {
            return Err(RuntimeError::Buffer {
                id: r.id.0,
                what: format!(
                    "holds {} amaxes, but the FP8 operand [{}, {}] has {} scale groups",
                    r.len, s.rows, s.cols, s.groups
                ),
            })
        }
        None => {
            let amax = base + s.amax_at as CUdeviceptr;
            group_amax(be, buf, (s.rows, s.cols), (rb, cb), (s.groups, amax))?;
            amax
        }
    };
    let e5m2 = Arg::I32(i32::from(s.operand.format == Fp8Format::E5m2));
    let args = [
        fv(buf),
        u(s.lines),
        u(s.k),
        u(s.ld),
        u(rb),
        u(cb),
        u(gpr),
        Arg::I32(i32::from(s.groups == 1)),
        Arg::Ptr(amax),
        max,
        e5m2,
        Arg::Ptr(q),
        Arg::Ptr(record.unwrap_or(0)),
    ];
    if s.lines > 0 && s.ld > 0 {
        let (kernel, grid) = match s.operand.along {
            // K along the columns: a block per 256 vectors of 8 of a line, lines along y.
            Along::Cols => (
                Kernel::Fp8QuantizeLines,
                (
                    s.ld.div_ceil(8 * QUANT_LINE_VECS),
                    s.lines.min(QUANT_GRID_Y),
                ),
            ),
            // K along the rows: 64 × 64 tiles, transposed through shared memory.
            Along::Rows => (
                Kernel::Fp8QuantizeCols,
                (
                    s.lines.div_ceil(QUANT_TILE),
                    s.ld.div_ceil(QUANT_TILE).min(QUANT_GRID_Y),
                ),
            ),
        };
        let grid = (grid.0 as u32, grid.1 as u32, 1);
        be.launch(kernel, grid, (QUANT_LINE_VECS as u32, 1, 1), 0, &args)?;
    }
    write_scales(be, (amax, scaling), s, (layout, block), scales)
}

/// The dequantization factors `1/s` of operand `s` from its groups' amaxes (`amax`, f32 bits
/// on the device, under `scaling`) into `out`, in `layout`'s order (`fp8_scales`' code, block).
fn write_scales(
    be: &mut CudaBackend,
    (amax, scaling): (CUdeviceptr, Fp8Scaling),
    s: &Fp8OperandScratch,
    (layout, block): (i32, u64),
    out: CUdeviceptr,
) -> Result<()> {
    let (rb, cb) = s.operand.group_shape(scaling, s.rows, s.cols);
    let gpr = s.cols.max(1).div_ceil(cb);
    let u = |v: u64| n(v as usize);
    let args = [
        Arg::Ptr(amax),
        Arg::F32(s.operand.format.max()),
        Arg::I32(i32::from(s.operand.along == Along::Rows)),
        u(rb),
        u(cb),
        u(gpr),
        Arg::I32(layout),
        u(block),
        u(s.lines),
        u(s.k),
        Arg::Ptr(out),
        u(s.scales),
    ];
    be.launch_n(Kernel::Fp8Scales, s.scales as usize, &args)
}

/// The op-table roles of the reduced amaxes of an FP8 GEMM's two operands (present where its
/// `Fp8Gemm::shared` says the operand's groups span ranks).
pub(super) fn amax_roles(op: &Op) -> [&'static str; 2] {
    match op {
        Op::Matmul { .. } => ["x_amax", "w_amax"],
        Op::MatmulBwdData { .. } => ["dy_amax", "w_amax"],
        _ => ["dy_amax", "x_amax"],
    }
}

/// The op-table roles of a `quantized` FP8 GEMM's two FP8 operands (`Fp8Gemm::quantized`).
fn quantized_roles(op: &Op) -> [&'static str; 2] {
    match op {
        Op::Matmul { .. } => ["xq", "wq"],
        Op::MatmulBwdData { .. } => ["dyq", "wq"],
        _ => ["dyq", "xq"],
    }
}

/// A `quantized` GEMM's two operands as its inputs hold them (`Op::Fp8Quantize`'s, K-major with
/// no padding: `[lines, K]` of `scratch`'s layout), and each one's dequantization factor `1/s`:
/// a roll's where the `fp8_factors` variant takes them and one describes the amax input
/// (`CudaBackend::rolled_factor`), else computed from it into the scratch at `base`. Returns
/// the operands' and the factors' device pointers.
fn quantized_operands(
    be: &mut CudaBackend,
    b: &Bound,
    scratch: &Fp8Scratch,
    base: CUdeviceptr,
) -> Result<([CUdeviceptr; 2], [CUdeviceptr; 2])> {
    let (amaxes, quantized) = (amax_roles(b.op), quantized_roles(b.op));
    let (mut operands, mut factors) = ([0; 2], [0; 2]);
    for (k, s) in scratch.operands.iter().enumerate() {
        let input = |role: &str| {
            b.optional_input(role).ok_or_else(|| {
                b.err(format!(
                    "reads quantized operands but has no `{role}` input"
                ))
            })
        };
        let (q, amax) = (input(quantized[k])?, input(amaxes[k])?);
        if s.layout != Fp8ScaleLayout::Scalar || s.ld != s.k {
            return Err(b.err(format!(
                "reads `{}` quantized: only a tensorwise operand whose K ({}) is a multiple \
                 of 16 is (the lowering quantizes no other)",
                quantized[k], s.k
            )));
        }
        if q.len as u64 != s.lines * s.k || amax.len != 1 {
            return Err(b.err(format!(
                "reads `{}` (buffer {}) as [{}, {}] FP8 values with one scale amax, but it \
                 holds {} elements and its amax {}",
                quantized[k], q.id.0, s.lines, s.k, q.len, amax.len
            )));
        }
        let rolled = match be.variants.fp8_factors {
            Fp8FactorsKernel::Rolled => be.rolled_factor(amax.id, s.operand.format),
            Fp8FactorsKernel::PerGemm => None,
        };
        factors[k] = match rolled {
            Some(factor) => factor,
            None => {
                let scales = base + s.scales_at as CUdeviceptr;
                write_scales(be, (amax.ptr, Fp8Scaling::Tensorwise), s, (0, 1), scales)?;
                scales
            }
        };
        operands[k] = q.ptr;
    }
    Ok((operands, factors))
}

/// A tensorwise FP8 GEMM `g` of op `b` on cuBLASLt: A the quantized `s1` (op's second
/// operand), B `s0`, their dequantization factors `scales` in that order.
fn tensorwise_product(
    be: &mut CudaBackend,
    b: &Bound,
    fp8: Fp8Gemm,
    g: &Gemm,
    (s0, s1): (&Fp8OperandScratch, &Fp8OperandScratch),
    scales: [CUdeviceptr; 2],
) -> Result<()> {
    let operands = Operands::Fp8(Fp8Operands {
        a: s1.operand.format,
        b: s0.operand.format,
        fast_accum: fast_accum(be.variants.fp8_accum, b.op),
    });
    let stream = be.stream.cu_stream();
    be.blas.run_fp8(g, operands, scales, stream).map_err(|e| {
        RuntimeError::Unsupported(format!(
            "{}: cuBLASLt runs no FP8 GEMM ({fp8}) of {} x {} x {} with {} output ({e}). The \
             CUDA backend runs tensorwise FP8 GEMMs on Hopper and later through cuBLASLt 12.9+ \
             (rowwise and blockwise on its own Hopper kernel)",
            b.name(),
            g.m,
            g.n,
            s0.k,
            match g.out {
                Output::F32 => "f32",
                Output::Bf16 => "bf16",
            }
        ))
    })
}

/// Runs FP8 GEMM op `b` (`fp8` its attribute) over `rows` rows of `k_in` into `m_out`
/// columns (see the module docs).
pub(super) fn run(
    be: &mut CudaBackend,
    b: &Bound,
    fp8: Fp8Gemm,
    (rows, _, m_out): (usize, usize, usize),
) -> Result<()> {
    let name = b.name();
    // A quantized GEMM's scratch holds only its two factors (`quantized_operands`).
    let scratch = fp8_gemm_scratch(b.op, rows as u64)
        .ok_or_else(|| b.err("is not an FP8 GEMM op (no FP8 scratch layout)"))?;
    let [s0, s1] = scratch.operands;
    let (code0, block0) = scale_layout(&s0);
    let (code1, block1) = scale_layout(&s1);
    if s0.ld != s1.ld {
        return Err(b.err(format!(
            "FP8 operands padded to different K ({} and {})",
            s0.ld, s1.ld
        )));
    }
    // The op's two GEMM inputs, its output D and whether D accumulates.
    let (in0, in1) = (b.input(0)?, b.input(1)?);
    let (d, accumulate) = match *b.op {
        Op::Matmul { .. } => (b.output(0)?, false),
        Op::MatmulBwdData { accumulate, .. } => (b.output(0)?, accumulate),
        Op::MatmulBwdWeight {
            accumulate_param_grad,
            ..
        } => (b.output(0)?, accumulate_param_grad),
        _ => return Err(b.err("is not a GEMM op")),
    };
    if matches!(b.op, Op::MatmulBwdWeight { .. }) && d.dtype != DType::F32 {
        return Err(b.err("an FP8 weight gradient must be f32"));
    }
    // A forward's residual without a bias: the GEMM's C (beta 1) where it has y's dtype, so
    // y = product + r in one pass.
    let residual_c = match *b.op {
        Op::Matmul {
            bias: false,
            residual: true,
            ..
        } => Some(b.input(2)?).filter(|r| r.dtype == d.dtype),
        _ => None,
    };
    // A forward's bias: y = b first, the product accumulated onto it.
    let mut beta_one = accumulate || residual_c.is_some();
    if let Op::Matmul { bias: true, .. } = *b.op {
        let bb = b.input(2)?;
        be.launch_n(
            Kernel::BroadcastRows,
            rows * bb.len,
            &[p(bb), fv(d), n(rows), n(bb.len)],
        )?;
        beta_one = true;
    }
    let base = be.fp8_scratch(scratch.bytes as usize)?;
    let ([q0, q1], [f0, f1]) = if fp8.quantized {
        quantized_operands(be, b, &scratch, base)?
    } else {
        let [r0, r1] = amax_roles(b.op).map(|role| b.optional_input(role));
        let (rec0, rec1) = (be.take_record(in0.id), be.take_record(in1.id));
        quantize(be, (in0, r0, rec0), &s0, fp8.scaling, base, (code0, block0))?;
        quantize(be, (in1, r1, rec1), &s1, fp8.scaling, base, (code1, block1))?;
        let at = |at: u64| base + at as CUdeviceptr;
        (
            [at(s0.q_at), at(s1.q_at)],
            [at(s0.scales_at), at(s1.scales_at)],
        )
    };
    // A held record of neither operand (none in a verified program) is not lost.
    be.flush_records(true)?;
    let g = Gemm {
        trans_a: true,
        trans_b: false,
        m: s1.lines,
        n: s0.lines,
        k: s0.ld,
        a: q1,
        lda: s1.ld as i64,
        b: q0,
        ldb: s0.ld as i64,
        c: d.ptr,
        ldc: s1.lines as i64,
        c_in: residual_c.map(|r| r.ptr),
        beta: if beta_one { 1.0 } else { 0.0 },
        out: output(d),
        epilogue: Epilogue::None,
    };
    if g.m > 0 && g.n > 0 {
        if fp8_gemm::runs(fp8.scaling) {
            let p = Quantized {
                s: &s0,
                q: q0,
                factors: f0,
            };
            let q = Quantized {
                s: &s1,
                q: q1,
                factors: f1,
            };
            be.fp8_scaled_gemm(name, &g, fp8.scaling, (p, q))?;
        } else {
            tensorwise_product(be, b, fp8, &g, (&s0, &s1), [f1, f0])?;
        }
    }
    let role = |name: &str| {
        b.optional_input(name)
            .ok_or_else(|| b.err(format!("has no `{name}` input")))
    };
    match *b.op {
        Op::Matmul { swiglu: true, .. } => swiglu_apart(be, role("gate")?, d, b.output(1)?),
        Op::MatmulBwdData { swiglu: true, .. } => {
            swiglu_grad(be, d, (role("gate")?, role("up")?), (d, b.output(1)?))
        }
        Op::Matmul {
            bias,
            act,
            residual,
            ..
        } => {
            let r = (residual && residual_c.is_none())
                .then(|| b.input(2 + usize::from(bias)))
                .transpose()?;
            let a = act.map(|act| Ok((act, b.output(1)?))).transpose()?;
            residual_then_activation(be, d, r, a)
        }
        Op::MatmulBwdData {
            act_grad: Some(act),
            ..
        } => activation_grad_in_place(be, d, act, b.input(2)?),
        Op::MatmulBwdWeight {
            bias: true,
            accumulate_param_grad,
            ..
        } => {
            // The bias gradient sums the exact dy.
            let db = b.output(1)?;
            col_sum_into(be, in0, (db, accumulate_param_grad), rows, m_out)
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parc_compiler::ir::BufferId;

    fn buf(ptr: CUdeviceptr) -> Buf {
        Buf {
            id: BufferId(0),
            ptr,
            len: 0,
            dtype: DType::Bf16,
        }
    }

    /// (kernel, [cb, gpr, span, runs, total]) of a vector amax, None where it keeps `fp8_amax`.
    fn launch(
        ptr: CUdeviceptr,
        shape: (u64, u64),
        group: (u64, u64),
    ) -> Option<(Kernel, [u64; 5])> {
        let gpr = shape.1.div_ceil(group.1);
        VectorAmax::fits(buf(ptr), shape, group, gpr).map(|v| (v.kernel, v.counts.all()))
    }

    #[test]
    fn vector_amaxes_take_whole_vectors_in_runs_inside_row_groups() {
        let aligned = 0x1000;
        // 1 × 128 tiles: one row a run.
        assert_eq!(
            launch(aligned, (150, 200), (1, 128)),
            Some((Kernel::Fp8AmaxRows8, [128, 2, 1, 1, 150]))
        );
        // 128 × 128 squares over 300 rows: runs of 64, the last row group clipped to 44 rows
        // (its second run empty).
        assert_eq!(
            launch(aligned, (300, 136), (128, 128)),
            Some((Kernel::Fp8AmaxRows8, [128, 2, 64, 2, 6]))
        );
        // Columns (rowwise with K along the rows): runs of 64 down the whole operand.
        assert_eq!(
            launch(aligned, (300, 136), (300, 1)),
            Some((Kernel::Fp8AmaxCols8, [1, 136, 64, 5, 5]))
        );
        // What the vectors cannot read keeps the scalar kernel: columns not a multiple of 8,
        // a group width that splits vectors, an unaligned operand.
        assert_eq!(launch(aligned, (40, 30), (1, 30)), None);
        assert_eq!(launch(aligned, (40, 24), (1, 12)), None);
        assert_eq!(launch(aligned + 8, (40, 24), (1, 24)), None);
    }
}
