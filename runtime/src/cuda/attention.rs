//! Attention (`Op::Attention`, `Op::AttentionBwd`) on the GPU: checks the op's geometry and
//! buffers, uploads the q/kv global positions, places the op's scratch memory where
//! `memplan::attention_scratch` says (what `memplan::backend_scratch` reserves), and launches
//! one of two kernel families:
//! - bf16 runs with head_dim 64 or 128 and a positive scale: flash attention on tensor cores,
//!   bf16 operands, fp32 accumulation and softmax. On a Hopper GPU for head_dim 64 and 128 the
//!   warp-specialized, TMA-fed kernels (`kernels/attention_ws_{fwd,bwd}.cu`: persistent CTAs,
//!   a producer warp filling mbarrier rings through tensor maps, `tma.rs`; head_dim 128 with
//!   fewer ring slots, and in the backward one K/V buffer and one dQ tile a consumer, to fit
//!   shared memory; its backward's dQ split over the consumers' columns as FlashAttention-3
//!   does), falling back where a tensor map cannot be encoded (unaligned rows) to the
//!   warpgroup-MMA forward (`kernels/attention_wgmma_fwd.cu`) and the `mma.sync` backward;
//!   `PARC_ATTENTION_FWD_KERNEL=wgmma` selects that warpgroup-MMA forward for both head dims.
//!   Elsewhere, and under `PARC_ATTENTION_{FWD,BWD}_KERNEL=fa2`, FA2's `mma.sync` kernels
//!   (`kernels/attention_tc.cu`). The head_dim 128 kernels that ran on a Hopper before the
//!   warp-specialized ones (`wgmma` forward, `fa2` backward) stay selectable through those
//!   variables until GPU measurements settle which to keep. All read bf16 q, k, v, dO buffers
//!   in place and bf16 copies of f32 ones, write O, dK, dV in their buffers' type, and
//!   accumulate dQ in f32 (in a scratch accumulator rounded once into a bf16 dQ), with the same
//!   semantics;
//! - everything else (fp32 and fp16 runs, other head dims): the exact fp32 kernels of
//!   `kernels/attention.cu`, which read and write f32 or bf16 buffers (bf16 widened on load,
//!   rounded once on store).
//!
//! A `packed` op's q, k, v (and its backward's dq, dk, dv) are column ranges of one qkv (dqkv)
//! buffer: both families read and write them in place through `AttGeom`'s row strides, and the
//! tensor-core backward's f32 dQ accumulator is then always scratch, converted into dqkv's q
//! columns (`attention_dq_out`).
use super::args::{p, Bound, Limits};
use super::device::driver_error;
use super::kernel::Kernel;
use super::tma::{self, Elem, TmaMap};
use super::variants::{AttentionBwdKernel, AttentionFwdKernel};
use super::{cu, raw_ptr, Arg, Buf, CudaBackend};
use crate::error::{Result, RuntimeError};
use cudarc::driver::sys::CUdeviceptr;
use parc_compiler::ir::op::AttentionAttrs;
use parc_compiler::ir::op::{Op, Segment};
use parc_compiler::ir::DType;
use parc_compiler::memplan::{attention_scratch, AttentionScratch, KernelTarget};

/// Geometry of one attention call, as the kernels' `struct AttGeom`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttGeom {
    pub batch: i64,
    pub heads: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
    pub seq_q: i64,
    pub seq_kv: i64,
    /// Row strides (elements between consecutive rows of the stored `[seq · batch, width]`
    /// layout) of q; k and v; o and dO; dq; dk and dv. Each tensor's own width, except that a
    /// packed op's q, k, v (dq, dk, dv) are column ranges of one qkv (dqkv) buffer,
    /// `(heads + 2 kv_heads) · head_dim` wide. 32-bit, with batch times each of them below
    /// 2^31 (`attention_geometry` checks).
    pub ld_q: i32,
    pub ld_kv: i32,
    pub ld_o: i32,
    pub ld_dq: i32,
    pub ld_dkv: i32,
    /// 1: the tensor-core kernels' grid is (tiles, heads), one head's tiles launched together
    /// so they share its K and V (backward: Q and dO) in L2; 0: (heads, tiles). See
    /// [`launch_tc`].
    pub tiles_first: i32,
    pub causal: i32,
    pub scale: f32,
    pub q_sorted: i32,
    pub kv_sorted: i32,
    /// Which of q, k, v, o, dO, dQ, dK, dV are bf16 (`BF16_*` bits; the rest are f32).
    pub bf16: i32,
    pub pad: i32,
}

/// Bits of `AttGeom::bf16`: must match ATT_BF16_* in kernels/attention.cu.
const BF16_Q: i32 = 1;
const BF16_K: i32 = 2;
const BF16_V: i32 = 4;
const BF16_O: i32 = 8;
const BF16_DO: i32 = 16;
const BF16_DQ: i32 = 32;
const BF16_DK: i32 = 64;
const BF16_DV: i32 = 128;

/// Must match ATT_WARPS / ATT_TILE in kernels/attention.cu.
const ATT_WARPS: u32 = 8;
const ATT_TILE: usize = 32;
/// Query rows per forward CTA, keys per backward CTA and the threads of each kernel's CTA:
/// must match TC_FWD_BR / TC_BC / TC_THREADS / TC_BWD_THREADS in kernels/attention_tc.cu.
const TC_FWD_BR: usize = 128;
const TC_BC: usize = 128;
const TC_FWD_THREADS: u32 = 128;
const TC_BWD_THREADS: u32 = 256;
/// The `wgmma` forward (attention_wgmma_fwd.cu's WG_FWD): 64 query rows per warpgroup, key
/// tiles of WGMMA_KEYS rows, 1024 bytes for aligning the tiles to the 128-byte swizzle's period.
const WGMMA_KEYS: usize = 64;
const WGMMA_ALIGN: usize = 1024;
/// The warp-specialized forward (attention_ws_fwd.cu): query rows per work item, and keys per
/// K/V tile (its threads: `CudaBackend::launch_persistent`'s).
const WS_BR: usize = 128;
const WS_FWD_KEYS: usize = 128;

/// The warp-specialized forward's shared memory for head_dim `d`, `tiles` WS_FWD_KEYS-row tiles
/// of K and V (bf16) in `slots` ring slots: alignment slack, two Q buffers, the tiles, the
/// mbarriers (a full and an empty one per slot and per Q buffer) and the two items' tile ranges
/// (8 ints each).
const fn ws_fwd_smem(d: usize, tiles: usize, slots: usize) -> u32 {
    (WGMMA_ALIGN + 2 * WS_BR * d * 2 + tiles * WS_FWD_KEYS * d * 2 + 8 * (2 * slots + 4) + 64)
        as u32
}
/// Head_dim 64: one ring of 4 slots, each a K and a V tile, 161 KiB. Head_dim 128: separate
/// rings of 3 K and 2 V slots, 225.2 KiB.
const WS_FWD_SMEM: u32 = ws_fwd_smem(64, 2 * 4, 4);
const WS_FWD_SMEM_D128: u32 = ws_fwd_smem(128, 3 + 2, 3 + 2);

/// The warp-specialized backward (attention_ws_bwd.cu): keys per work item, and a consumer's
/// dQ part (rows × columns, f32: head_dim 64 splits dQ's 128 rows of a tile over the consumers,
/// 128 its 128 columns).
const WSB_BC: usize = 128;
const WSB_DQ_PART: usize = 64 * 64;

/// Query rows of the warp-specialized backward's ring slots for head_dim `d` (attention_ws_bwd.cu's
/// `wsb_br`): 128 at 64, 64 at 128.
const fn wsb_br(d: usize) -> usize {
    if d == 64 {
        128
    } else {
        64
    }
}

/// The warp-specialized backward's shared memory for head_dim `d` (attention_ws_bwd.cu's
/// budgets: 2 ring slots; head_dim 64 double-buffers K/V and has one dSᵀ tile, 128 one K/V
/// buffer and two dSᵀ tiles): alignment slack, the K and V buffers, the slots (Q, dO, and 1 KiB
/// for their lse2 and delta rows), the dSᵀ tiles (keys × the slot's queries, bf16), the
/// consumers' dQ parts (f32), the mbarriers, the two items' query ranges (8 ints each) and the
/// parts' places (6 ints, 32 bytes).
const fn wsb_smem(d: usize) -> u32 {
    let (kv_bufs, ds_tiles) = if d == 64 { (2, 1) } else { (1, 2) };
    let (br, stages) = (wsb_br(d), 2);
    (WGMMA_ALIGN
        + kv_bufs * 2 * WSB_BC * d * 2
        + stages * (2 * br * d * 2 + 1024)
        + ds_tiles * WSB_BC * br * 2
        + 2 * WSB_DQ_PART * 4
        + 8 * (2 * stages + 4)
        + 64
        + 32) as u32
}
/// 195 KiB at both head dims.
const WSB_SMEM: u32 = wsb_smem(64);
const WSB_SMEM_D128: u32 = wsb_smem(128);

/// The TMA tensor map of one bf16 operand of the stored layout (q, k, v or dO; `ptr` at its
/// first column): a matrix of one sequence position per row (the batch's rows side by side),
/// from the view's first column to its last head's last one, row stride `ld` elements, copied
/// in boxes of 64 columns (the widest the 128-byte swizzle takes: one head of 64, half a head
/// of 128, which the kernels load as two boxes) by `box_rows` positions, swizzled.
fn operand_map(
    g: &AttGeom,
    ptr: CUdeviceptr,
    ld: i32,
    heads: i64,
    rows: i64,
    box_rows: usize,
) -> Result<TmaMap> {
    let (d, ld, batch) = (g.head_dim as u64, ld as u64, g.batch as u64);
    tma::matrix(
        Elem::Bf16,
        ptr,
        (
            (batch - 1) * ld + heads as u64 * d,
            rows as u64,
            batch * ld * 2,
        ),
        (WS_BOX_COLS, box_rows as u32),
        true,
    )
}

/// Columns of one bf16 TMA box: 128 bytes, the 128-byte swizzle's row.
const WS_BOX_COLS: u32 = 64;

/// The TMA tensor maps of q, k and v (bf16 pointers) for the warp-specialized forward.
fn ws_tensor_maps(g: &AttGeom, [qp, kp, vp]: [CUdeviceptr; 3]) -> Result<[TmaMap; 3]> {
    Ok([
        operand_map(g, qp, g.ld_q, g.heads, g.seq_q, WS_BR)?,
        operand_map(g, kp, g.ld_kv, g.kv_heads, g.seq_kv, WS_FWD_KEYS)?,
        operand_map(g, vp, g.ld_kv, g.kv_heads, g.seq_kv, WS_FWD_KEYS)?,
    ])
}

/// The warp-specialized backward's tensor maps: q, dO, k, v (bf16 pointers, boxes of 64
/// columns: `operand_map`; q and dO of one slot's `wsb_br` rows), lse2 and delta (f32, one row
/// of `att_rows` per (batch, head), boxes of one slot's queries) and the dQ accumulator (f32,
/// compact rows of batch · heads · head_dim; boxes of 32 columns × 64 query rows, swizzled,
/// that the kernel adds into: 2 a consumer's dQ part), then the dK and dV accumulators of items
/// per query head (`dkv_acc`: f32, compact rows of batch · kv_heads · head_dim a key, dV's
/// after dK's; boxes as dQ's, of 64 keys), or dQ's map again where there are none (unused).
fn wsb_tensor_maps(
    g: &AttGeom,
    [dop, qp, kp, vp]: [CUdeviceptr; 4],
    (lse2, delta, dq_acc): (CUdeviceptr, CUdeviceptr, CUdeviceptr),
    dkv_acc: Option<CUdeviceptr>,
) -> Result<[TmaMap; 9]> {
    let bh = (g.batch * g.heads) as u64;
    let br = wsb_br(g.head_dim as usize);
    let rows_ld = (g.seq_q as u64).next_multiple_of(4);
    let stats = |ptr| {
        tma::matrix(
            Elem::F32,
            ptr,
            (g.seq_q as u64, bh, rows_ld * 4),
            (br as u32, 1),
            false,
        )
    };
    // An f32 accumulator of `cols` columns and `rows` rows, in boxes of a 32-column block of
    // 64 rows (a part's, 128-byte swizzled).
    let acc = |ptr, cols: u64, rows: i64| {
        tma::matrix(
            Elem::F32,
            ptr,
            (cols, rows as u64, cols * 4),
            (32, 64),
            true,
        )
    };
    let dq = acc(dq_acc, bh * g.head_dim as u64, g.seq_q)?;
    let (dk, dv) = match dkv_acc {
        Some(ptr) => {
            let cols = (g.batch * g.kv_heads * g.head_dim) as u64;
            let dv_at = ptr + cols * g.seq_kv as u64 * 4;
            (acc(ptr, cols, g.seq_kv)?, acc(dv_at, cols, g.seq_kv)?)
        }
        None => (dq, dq),
    };
    Ok([
        operand_map(g, qp, g.ld_q, g.heads, g.seq_q, br)?,
        operand_map(g, dop, g.ld_o, g.heads, g.seq_q, br)?,
        operand_map(g, kp, g.ld_kv, g.kv_heads, g.seq_kv, WSB_BC)?,
        operand_map(g, vp, g.ld_kv, g.kv_heads, g.seq_kv, WSB_BC)?,
        stats(lse2)?,
        stats(delta)?,
        dq,
        dk,
        dv,
    ])
}

/// The most blocks a grid's y dimension takes.
const MAX_GRID_Y: usize = 65_535;

/// The tensor-core kernels' names and shared memory for one head dim, or None where the
/// exact kernels run.
struct TensorCore {
    fwd: Kernel,
    /// delta and lse2 for the backward, and the dQ accumulator zeroed (16-byte aligned
    /// buffers; else `attention_delta` and a memset).
    delta: Kernel,
    bwd: Kernel,
    /// The forward's key tile (rows) and the backward's query tile, per head dim (TC_FWD's BC
    /// and TC_BWD's BR in attention_tc.cu).
    fwd_keys: usize,
    bwd_rows: usize,
    head_dim: usize,
}

impl TensorCore {
    fn for_head_dim(d: usize) -> Option<TensorCore> {
        match d {
            64 => Some(TensorCore {
                fwd: Kernel::AttentionFwdTcD64,
                delta: Kernel::AttentionDeltaTcD64,
                bwd: Kernel::AttentionBwdTcD64,
                fwd_keys: 64,
                bwd_rows: 64,
                head_dim: 64,
            }),
            128 => Some(TensorCore {
                fwd: Kernel::AttentionFwdTcD128,
                delta: Kernel::AttentionDeltaTcD128,
                bwd: Kernel::AttentionBwdTcD128,
                fwd_keys: 32,
                bwd_rows: 64,
                head_dim: 128,
            }),
            _ => None,
        }
    }

    /// The tensor-core kernels for this op on `target`, or None where the exact kernels run
    /// (the compiler's `tensor_core_attention` says which, for the scratch layout too).
    fn for_op(target: KernelTarget, head_dim: u64, scale: f64) -> Option<TensorCore> {
        if !parc_compiler::memplan::tensor_core_attention(target.operands, head_dim, scale) {
            return None;
        }
        TensorCore::for_head_dim(usize::try_from(head_dim).ok()?)
    }

    /// Bytes of one bf16 tile row (padded by 8 elements against bank conflicts).
    fn row_bytes(&self) -> usize {
        (self.head_dim + 8) * 2
    }

    /// The Q tile; K, V tiles and key positions in two stages.
    fn fwd_smem(&self) -> u32 {
        let bc = self.fwd_keys;
        ((TC_FWD_BR + 4 * bc) * self.row_bytes() + 2 * bc * 4) as u32
    }

    /// The `wgmma` forward's kernel, warpgroups (of 128 threads, 64 query rows each) and
    /// shared memory: the alignment slack, Q (unpadded bf16 rows, swizzled), K and V tiles
    /// in two stages and the key positions of each stage.
    fn wgmma_fwd(&self) -> (Kernel, usize, u32) {
        let (name, warpgroups) = match self.head_dim {
            64 => (Kernel::AttentionFwdWgmmaD64, 2),
            _ => (Kernel::AttentionFwdWgmmaD128, 3),
        };
        let row = self.head_dim * 2;
        let smem = WGMMA_ALIGN + (64 * warpgroups + 4 * WGMMA_KEYS) * row + 2 * WGMMA_KEYS * 4;
        (name, warpgroups, smem as u32)
    }

    /// K, V tiles; Q, dO tiles and lse2 / delta / position per query row in two stages; dSᵀ.
    fn bwd_smem(&self) -> u32 {
        let br = self.bwd_rows;
        let stage = 2 * br * self.row_bytes() + 3 * br * 4;
        (2 * TC_BC * self.row_bytes() + 2 * stage + TC_BC * (br + 8) * 2) as u32
    }
}

/// Fails unless the GPU is a Hopper (compute capability 9.0), the only one whose program holds
/// the compute_90a kernels (`what` names the test kernel that needs them; the attention ops
/// themselves run the mma.sync kernels elsewhere).
fn require_hopper(be: &CudaBackend, what: &str) -> Result<()> {
    if !be.is_hopper() {
        return Err(crate::error::RuntimeError::Unsupported(format!(
            "{what} needs a Hopper GPU (compute capability 9.0; this one is {})",
            be.device_name()?
        )));
    }
    Ok(())
}

/// Launches a tensor-core kernel over `heads` × `tiles` CTAs, first letting it use `smem` bytes
/// of shared memory: the grid is (tiles, heads) where `tiles_first` (the kernel reads the same
/// order from `AttGeom::tiles_first`), else (heads, tiles).
fn launch_tc(
    be: &mut CudaBackend,
    kernel: Kernel,
    (heads, tiles, tiles_first): (u32, u32, bool),
    threads: u32,
    smem: u32,
    args: &[Arg],
) -> Result<()> {
    let grid = if tiles_first {
        (tiles, heads, 1)
    } else {
        (heads, tiles, 1)
    };
    be.launch_with_smem(kernel, grid, threads, smem, args)
}

/// Rounds each f32 operand that has a bf16 copy in `layout` into it; returns every operand's
/// bf16 pointer (the buffer itself where it is bf16).
fn bf16_operands(
    be: &mut CudaBackend,
    bufs: &[Buf],
    layout: &AttentionScratch,
    base: CUdeviceptr,
) -> Result<Vec<CUdeviceptr>> {
    let mut ptrs = Vec::with_capacity(bufs.len());
    for (b, copy) in bufs.iter().zip(&layout.copies) {
        match copy {
            None => ptrs.push(b.ptr),
            Some(at) => {
                let dst = base + *at as CUdeviceptr;
                let n4 = b.len / 4;
                be.launch_n(
                    Kernel::AttentionToBf16,
                    n4,
                    &[p(*b), Arg::Ptr(dst), Arg::I64(n4 as i64)],
                )?;
                ptrs.push(dst);
            }
        }
    }
    Ok(ptrs)
}

/// Whether the positions of `segments` strictly increase (each segment starts at or after the
/// previous one's end).
fn ascending(segments: &[Segment]) -> bool {
    segments
        .windows(2)
        .all(|w| u64::from(w[0].start) + u64::from(w[0].len) <= u64::from(w[1].start))
}

/// `bit` when `b` is bf16, else 0.
fn bf16_bit(b: Buf, bit: i32) -> i32 {
    if b.dtype == DType::Bf16 {
        bit
    } else {
        0
    }
}

/// An attention op's dimensions, each checked to be in 1..2^31: batch, heads, kv heads, head dim.
#[derive(Clone, Copy)]
struct Dims {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
}

impl Dims {
    fn new(b: &Bound, batch: u64, heads: u64, kv_heads: u64, head_dim: u64) -> Result<Dims> {
        Ok(Dims {
            batch: b.launch_dim("batch", batch)?,
            heads: b.launch_dim("heads", heads)?,
            kv_heads: b.launch_dim("kv_heads", kv_heads)?,
            d: b.launch_dim("head_dim", head_dim)?,
        })
    }

    /// Elements of one row of a packed qkv (dqkv): q's heads, then k's, then v's.
    fn packed_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.d
    }
}

/// q, k, v (or dq, dk, dv) as views of one packed buffer `qkv` (named `what`, of the op's
/// rows): each starts at its first column of row 0 and counts its own elements (rows × its
/// width); their row stride is the packed width (AttGeom's ld_q / ld_kv, ld_dq / ld_dkv).
fn split_packed(b: &Bound, qkv: Buf, what: &str, dims: Dims) -> Result<[Buf; 3]> {
    let rows = b.launch_rows(qkv, what, b.rows)?;
    let (qw, kw) = (dims.heads * dims.d, dims.kv_heads * dims.d);
    let view = |col: usize, width: usize| Buf {
        ptr: qkv.ptr + (col * qkv.elem_bytes()) as CUdeviceptr,
        len: rows * width,
        ..qkv
    };
    Ok([view(0, qw), view(qw, kw), view(qw + kw, kw)])
}

/// The bf16 pointers of q, k, v, from those of the operand buffers the kernels read (`ptrs`:
/// q, k, v; or, packed, qkv, whose bf16 form — the buffer or its copy — holds them at their
/// columns).
fn qkv_bf16(ptrs: &[CUdeviceptr], g: &AttGeom, packed: bool) -> [CUdeviceptr; 3] {
    if packed {
        let (qw, kw) = (
            (g.heads * g.head_dim * 2) as u64,
            (g.kv_heads * g.head_dim * 2) as u64,
        );
        [ptrs[0], ptrs[0] + qw, ptrs[0] + qw + kw]
    } else {
        [ptrs[0], ptrs[1], ptrs[2]]
    }
}

/// The geometry of a call over `dims` on views `q`, `k` of the op's rows (`b.rows` query rows,
/// `b.kv_rows` key rows: `bind` checked every buffer against them; `Call::bind` checked the
/// kernels' head and grid limits, `crate::cuda_limits`).
fn attention_geometry(
    b: &Bound,
    (q, k): (Buf, Buf),
    dims: Dims,
    (causal, scale): (bool, f64),
    packed: bool,
) -> Result<AttGeom> {
    let Dims {
        batch,
        heads,
        kv_heads,
        d,
    } = dims;
    if heads % kv_heads != 0 {
        return Err(b.err(format!(
            "heads = {heads} is not a multiple of kv_heads = {kv_heads}"
        )));
    }
    if !scale.is_finite() {
        return Err(b.err(format!("scale = {scale} is not finite")));
    }
    let seq_q = b.launch_rows(q, "q", b.rows / batch)?;
    let seq_kv = b.launch_rows(k, "k", b.kv_rows / batch)?;
    let (qw, kw) = (heads * d, kv_heads * d);
    let (ld_q, ld_kv) = if packed {
        (dims.packed_width(), dims.packed_width())
    } else {
        (qw, kw)
    };
    // The kernels step from one sequence position to the next by batch · stride, in 32 bits.
    let widest = ld_q.max(ld_kv);
    if batch * widest > i32::MAX as usize {
        return Err(b.err(format!(
            "batch x row width = {batch} x {widest} is above 2^31 - 1, the most the CUDA \
             attention kernels index per sequence position"
        )));
    }
    Ok(AttGeom {
        batch: batch as i64,
        heads: heads as i64,
        kv_heads: kv_heads as i64,
        head_dim: d as i64,
        seq_q: seq_q as i64,
        seq_kv: seq_kv as i64,
        // dq, dk, dv are laid out as q, k, v; o and dO are never packed.
        ld_q: ld_q as i32,
        ld_kv: ld_kv as i32,
        ld_o: qw as i32,
        ld_dq: ld_q as i32,
        ld_dkv: ld_kv as i32,
        tiles_first: 0,
        causal: i32::from(causal),
        scale: scale as f32,
        q_sorted: 0,
        kv_sorted: 0,
        bf16: bf16_bit(q, BF16_Q) | bf16_bit(k, BF16_K),
        pad: 0,
    })
}

/// The y extent of a tensor-core grid of `tiles` tiles, or an error naming the limit.
fn grid_y(b: &Bound, tiles: usize, what: &str) -> Result<u32> {
    if tiles > MAX_GRID_Y {
        return Err(b.err(format!(
            "{what} needs {tiles} tiles of the tensor-core kernel, above {MAX_GRID_Y}"
        )));
    }
    Ok(tiles as u32)
}

/// Runs an op of the attention family (`Attention`, `AttentionBwd`). A packed op's q, k, v
/// (dq, dk, dv) are views of its qkv (dqkv) buffer read (written) in place through the row
/// strides of AttGeom: no kernel copies them apart (a bf16 copy of an f32 qkv, on the
/// tensor-core path, copies the whole buffer and keeps its layout).
pub(super) fn run(be: &mut CudaBackend, b: &Bound) -> Result<()> {
    let (Op::Attention(a) | Op::AttentionBwd(a)) = b.op else {
        return Err(b.err("is not an attention op"));
    };
    let forward = matches!(b.op, Op::Attention(_));
    let call = Call::bind(be, b, a, forward)?;
    if forward {
        attention_forward(be, b, &call)
    } else {
        attention_backward(be, b, &call)
    }
}

/// What the forward and the backward share: the geometry, the buffers holding q, k, v (three,
/// or one packed qkv: input 0 forward, 1 backward), the views q, k, v, the uploaded global
/// positions and the kernels that run.
struct Call {
    g: AttGeom,
    dims: Dims,
    packed: bool,
    qkv: Vec<Buf>,
    q: Buf,
    k: Buf,
    v: Buf,
    qpos: CUdeviceptr,
    kvpos: CUdeviceptr,
    /// The tensor-core kernels, or None where the exact ones run.
    tensor_core: Option<TensorCore>,
}

impl Call {
    fn bind(be: &mut CudaBackend, b: &Bound, a: &AttentionAttrs, forward: bool) -> Result<Call> {
        if let Some(why) = crate::cuda_limits::attention_refusal(a) {
            return Err(b.err(why));
        }
        let dims = Dims::new(b, a.batch, a.heads, a.kv_heads, a.head_dim)?;
        let first = usize::from(!forward);
        let qkv: Vec<Buf> = if a.packed {
            if a.q_positions != a.kv_positions {
                return Err(b.err(
                    "is packed (q, k, v in one buffer, one row each) but its q_positions and \
                     kv_positions differ: a packed op needs them equal",
                ));
            }
            vec![b.input(first)?]
        } else {
            (first..first + 3)
                .map(|i| b.input(i))
                .collect::<Result<_>>()?
        };
        let [q, k, v] = if a.packed {
            split_packed(b, qkv[0], "qkv", dims)?
        } else {
            [qkv[0], qkv[1], qkv[2]]
        };
        let mut g = attention_geometry(b, (q, k), dims, (a.causal, a.scale), a.packed)?;
        g.q_sorted = i32::from(ascending(&a.q_positions));
        g.kv_sorted = i32::from(ascending(&a.kv_positions));
        g.bf16 |= bf16_bit(v, BF16_V);
        // One head's tiles launched together share its K and V (backward: Q and dO) in L2:
        // measured +3% on the wgmma backward at 32·12·1024·64 (163.7 → 168.4 TFLOP/s). The
        // other order only where the heads exceed a grid's y extent.
        let heads_fit = (g.batch * g.heads).max(g.batch * g.kv_heads) <= MAX_GRID_Y as i64;
        g.tiles_first = i32::from(heads_fit);
        let (qpos, _) = be.positions(&a.q_positions)?;
        let (kvpos, _) = be.positions(&a.kv_positions)?;
        Ok(Call {
            g,
            dims,
            packed: a.packed,
            qkv,
            q,
            k,
            v,
            qpos,
            kvpos,
            tensor_core: TensorCore::for_op(be.kernel_target(), a.head_dim, a.scale),
        })
    }

    /// The exact kernels' grid over query rows (a block of ATT_WARPS rows a head), block and
    /// shared memory (a K and a V tile of f32).
    fn exact_launch(&self) -> ((u32, u32, u32), (u32, u32, u32), u32) {
        let q_blocks = self.seq_q().div_ceil(ATT_WARPS as usize) as u32;
        let grid = (q_blocks, (self.dims.batch * self.dims.heads) as u32, 1);
        (
            grid,
            (32, ATT_WARPS, 1),
            (2 * ATT_TILE * self.dims.d * 4) as u32,
        )
    }

    fn seq_q(&self) -> usize {
        self.g.seq_q as usize
    }
}

/// The (elements, dtype) of `bufs`, as the scratch layout reads them.
fn shape(bufs: &[Buf]) -> Vec<(u64, DType)> {
    bufs.iter().map(|b| (b.len as u64, b.dtype)).collect()
}

/// O and lse of the forward: by the exact kernel, or by the tensor-core kernels.
fn attention_forward(be: &mut CudaBackend, b: &Bound, c: &Call) -> Result<()> {
    let (o, lse) = (b.output(0)?, b.output(1)?);
    let mut g = c.g;
    g.bf16 |= bf16_bit(o, BF16_O);
    if let Some(tc) = &c.tensor_core {
        return tensor_core_forward(be, b, c, tc, g, (o, lse));
    }
    let args = [
        p(c.q),
        p(c.k),
        p(c.v),
        p(o),
        p(lse),
        Arg::Ptr(c.qpos),
        Arg::Ptr(c.kvpos),
        Arg::Geom(g),
    ];
    let (grid, block, smem) = c.exact_launch();
    let kernel = ExactKernels::for_head_dim(c.dims.d).fwd;
    be.launch_block_with_smem(kernel, grid, block, smem, &args)
}

/// The exact (fp32) kernels for heads of `d` columns: up to 4 columns a lane (heads up to 128)
/// or up to 8 (the `_w8` instances: up to 256, `cuda_limits::ATTENTION_MAX_HEAD_DIM`).
#[derive(Clone, Copy)]
struct ExactKernels {
    fwd: Kernel,
    delta: Kernel,
    dq: Kernel,
    dkdv: Kernel,
}

impl ExactKernels {
    fn for_head_dim(d: usize) -> ExactKernels {
        if d <= 128 {
            ExactKernels {
                fwd: Kernel::AttentionFwd,
                delta: Kernel::AttentionDelta,
                dq: Kernel::AttentionBwdDq,
                dkdv: Kernel::AttentionBwdDkdv,
            }
        } else {
            ExactKernels {
                fwd: Kernel::AttentionFwdW8,
                delta: Kernel::AttentionDeltaW8,
                dq: Kernel::AttentionBwdDqW8,
                dkdv: Kernel::AttentionBwdDkdvW8,
            }
        }
    }
}

/// The forward on tensor cores: the warp-specialized, TMA-fed kernel where it applies (a
/// Hopper, head_dim 64 or 128, tensor maps the driver can encode), else the warpgroup-MMA one
/// (a Hopper), else mma.sync, each as its variant allows.
fn tensor_core_forward(
    be: &mut CudaBackend,
    b: &Bound,
    c: &Call,
    tc: &TensorCore,
    g: AttGeom,
    (o, lse): (Buf, Buf),
) -> Result<()> {
    let layout = attention_scratch(b.op, be.kernel_target(), &shape(&c.qkv), &shape(&[o, lse]))
        .ok_or_else(|| b.err("has no scratch layout"))?;
    let base = be.scratch(layout.bytes as usize)?;
    let ptrs = bf16_operands(be, &c.qkv, &layout, base)?;
    let [qp, kp, vp] = qkv_bf16(&ptrs, &g, c.packed);
    let args = [
        Arg::Ptr(qp),
        Arg::Ptr(kp),
        Arg::Ptr(vp),
        p(o),
        p(lse),
        Arg::Ptr(c.qpos),
        Arg::Ptr(c.kvpos),
        Arg::Geom(g),
    ];
    let (batch, heads, d) = (c.dims.batch, c.dims.heads, c.dims.d);
    let seq_q = c.seq_q();
    let ws = be.variants.attention_fwd == AttentionFwdKernel::Ws;
    let ws_kernel = match d {
        64 => Some((Kernel::AttentionFwdWsD64, WS_FWD_SMEM)),
        128 => Some((Kernel::AttentionFwdWsD128, WS_FWD_SMEM_D128)),
        _ => None,
    };
    if let (true, true, Some((name, smem))) = (ws, be.is_hopper(), ws_kernel) {
        if let Ok(maps) = ws_tensor_maps(&g, [qp, kp, vp]) {
            let work = seq_q.div_ceil(WS_BR) * batch * heads;
            // o, lse, the claim counter (shared with the backward: each launch leaves it
            // zeroed), the positions, the geometry.
            let counter = Arg::Ptr(be.attention_work_counter()?);
            let rest = [args[3], args[4], counter, args[5], args[6], args[7]];
            return be.launch_persistent(name, work, smem, &maps, &rest);
        }
    }
    if (ws || be.variants.attention_fwd == AttentionFwdKernel::Wgmma) && be.is_hopper() {
        let (name, warpgroups, smem) = tc.wgmma_fwd();
        let rows = 64 * warpgroups;
        let grid = (
            (batch * heads) as u32,
            grid_y(b, seq_q.div_ceil(rows), "seq_q")?,
            g.tiles_first != 0,
        );
        return launch_tc(be, name, grid, 128 * warpgroups as u32, smem, &args);
    }
    let grid = (
        (batch * heads) as u32,
        grid_y(b, seq_q.div_ceil(TC_FWD_BR), "seq_q")?,
        g.tiles_first != 0,
    );
    launch_tc(be, tc.fwd, grid, TC_FWD_THREADS, tc.fwd_smem(), &args)
}

/// The backward's operands and scratch: dO, O, lse; dq, dk, dv (views of one dqkv where
/// packed); the scratch layout, its base, and the delta and lse2 pieces of it.
struct Grads {
    dout: Buf,
    o: Buf,
    lse: Buf,
    dq: Buf,
    dk: Buf,
    dv: Buf,
    layout: AttentionScratch,
    base: CUdeviceptr,
    delta: CUdeviceptr,
    lse2: CUdeviceptr,
    /// Head dim 128 under GQA: the f32 dK and dV accumulators (dV's after dK's) in the op's
    /// scratch and their bytes (`AttentionScratch::dkv_acc`), where the warp-specialized
    /// backward takes an item per query head.
    dkv_acc: Option<(CUdeviceptr, usize)>,
}

impl Grads {
    /// `attention_delta`'s arguments, or `attention_delta_tc`'s with the dQ accumulator it
    /// zeroes.
    fn delta_args(&self, g: AttGeom, dq_acc: Option<CUdeviceptr>) -> Vec<Arg> {
        let mut args = vec![
            p(self.dout),
            p(self.o),
            p(self.lse),
            Arg::Ptr(self.delta),
            Arg::Ptr(self.lse2),
        ];
        args.extend(dq_acc.map(Arg::Ptr));
        args.push(Arg::Geom(g));
        args
    }

    /// delta and lse2 by the exact kernels' `attention_delta` (a block of rows a head).
    fn exact_delta(&self, be: &mut CudaBackend, c: &Call, g: AttGeom) -> Result<()> {
        let (grid, block, _) = c.exact_launch();
        let args = self.delta_args(g, None);
        let kernel = ExactKernels::for_head_dim(c.dims.d).delta;
        be.launch(kernel, grid, block, 0, &args)
    }
}

/// dq, dk, dv of the backward: by the exact kernels, or by the tensor-core kernels.
fn attention_backward(be: &mut CudaBackend, b: &Bound, c: &Call) -> Result<()> {
    let (o_at, lse_at) = if c.packed { (2, 3) } else { (4, 5) };
    let (dout, o, lse) = (b.input(0)?, b.input(o_at)?, b.input(lse_at)?);
    // The buffers dq, dk, dv are written into: three, or one dqkv laid out as qkv.
    let (dq, dk, dv, outs) = if c.packed {
        let dqkv = b.output(0)?;
        let [dq, dk, dv] = split_packed(b, dqkv, "dqkv", c.dims)?;
        (dq, dk, dv, vec![dqkv])
    } else {
        let (dq, dk, dv) = (b.output(0)?, b.output(1)?, b.output(2)?);
        (dq, dk, dv, vec![dq, dk, dv])
    };
    let mut g = c.g;
    g.bf16 |= bf16_bit(o, BF16_O)
        | bf16_bit(dout, BF16_DO)
        | bf16_bit(dq, BF16_DQ)
        | bf16_bit(dk, BF16_DK)
        | bf16_bit(dv, BF16_DV);
    let mut ins = vec![dout];
    ins.extend(&c.qkv);
    ins.extend([o, lse]);
    let layout = attention_scratch(b.op, be.kernel_target(), &shape(&ins), &shape(&outs))
        .ok_or_else(|| b.err("has no scratch layout"))?;
    let base = be.scratch(layout.bytes as usize)?;
    let dkv_bytes = 2 * c.g.seq_kv as usize * c.dims.batch * c.dims.kv_heads * c.dims.d * 4;
    let dkv_acc = match layout.dkv_acc {
        Some(at) if at as usize + dkv_bytes <= layout.bytes as usize => {
            Some((base + at as CUdeviceptr, dkv_bytes))
        }
        Some(_) => return Err(b.err("has dK/dV accumulators its scratch layout does not hold")),
        None => None,
    };
    let (delta, lse2) = layout
        .stats
        .map(|(d, l)| (base + d as CUdeviceptr, base + l as CUdeviceptr))
        .ok_or_else(|| b.err("has no delta in its scratch layout"))?;
    let grads = Grads {
        dout,
        o,
        lse,
        dq,
        dk,
        dv,
        layout,
        base,
        delta,
        lse2,
        dkv_acc,
    };
    match &c.tensor_core {
        Some(tc) => tensor_core_backward(be, b, c, tc, g, &grads),
        None => exact_backward(be, c, g, &grads),
    }
}

/// The exact kernels' backward: delta, then dq over query blocks, then dk and dv over key
/// blocks.
fn exact_backward(be: &mut CudaBackend, c: &Call, g: AttGeom, r: &Grads) -> Result<()> {
    r.exact_delta(be, c, g)?;
    let (grid_q, block, kv_smem) = c.exact_launch();
    let (q, k, v) = (p(c.q), p(c.k), p(c.v));
    let (lse, delta) = (p(r.lse), Arg::Ptr(r.delta));
    let positions = [Arg::Ptr(c.qpos), Arg::Ptr(c.kvpos), Arg::Geom(g)];
    let kernels = ExactKernels::for_head_dim(c.dims.d);
    let mut args = vec![p(r.dout), q, k, v, lse, delta, p(r.dq)];
    args.extend(positions);
    be.launch_block_with_smem(kernels.dq, grid_q, block, kv_smem, &args)?;
    let kv_blocks = (g.seq_kv as usize).div_ceil(ATT_WARPS as usize) as u32;
    let grid_kv = (kv_blocks, (c.dims.batch * c.dims.kv_heads) as u32, 1);
    let mut args = vec![p(r.dout), q, k, v, lse, delta, p(r.dk), p(r.dv)];
    args.extend(positions);
    let smem = kv_smem + (2 * ATT_TILE * 4) as u32;
    be.launch_block_with_smem(kernels.dkdv, grid_kv, block, smem, &args)
}

/// The backward on tensor cores: bf16 operands, delta and lse2 (with the dQ accumulator
/// zeroed), then the warp-specialized, TMA-fed kernel where it applies (a Hopper, head_dim 64
/// or 128, tensor maps the driver can encode: 16-byte aligned rows) and its variant allows,
/// else mma.sync; dQ is rounded out of its accumulator after.
fn tensor_core_backward(
    be: &mut CudaBackend,
    b: &Bound,
    c: &Call,
    tc: &TensorCore,
    g: AttGeom,
    r: &Grads,
) -> Result<()> {
    let mut bf16_in = vec![r.dout];
    bf16_in.extend(&c.qkv);
    let ptrs = bf16_operands(be, &bf16_in, &r.layout, r.base)?;
    let [qp, kp, vp] = qkv_bf16(&ptrs[1..], &g, c.packed);
    // dQ is added into with atomics: an f32 accumulator of compact rows (dq itself when
    // it is f32 and not packed), zeroed first (the op overwrites dq).
    let dq_acc = match r.layout.dq_acc {
        Some(at) => r.base + at as CUdeviceptr,
        None => r.dq.ptr,
    };
    let (batch, heads, d) = (c.dims.batch, c.dims.heads, c.dims.d);
    if [r.dout.ptr, r.o.ptr, dq_acc]
        .iter()
        .all(|ptr| ptr % 16 == 0)
    {
        let threads = batch * heads * c.seq_q() * (d / 8);
        be.launch_n(tc.delta, threads, &r.delta_args(g, Some(dq_acc)))?;
    } else {
        r.exact_delta(be, c, g)?;
        be.zero_bytes(dq_acc, r.dq.len * 4)?;
    }
    let seq_kv = g.seq_kv as usize;
    let grid = (
        (batch * c.dims.kv_heads) as u32,
        grid_y(b, seq_kv.div_ceil(TC_BC), "seq_kv")?,
        g.tiles_first != 0,
    );
    let positions = [Arg::Ptr(c.qpos), Arg::Ptr(c.kvpos), Arg::Geom(g)];
    // Items per query head (head dim 128 under GQA: r.dkv_acc) or per kv head.
    let per_head = r.dkv_acc.is_some();
    let ws_kernel = match (be.variants.attention_bwd, d, per_head) {
        (AttentionBwdKernel::Fa2, _, _) => None,
        (_, 64, _) => Some((Kernel::AttentionBwdWsD64, WSB_SMEM)),
        (_, 128, true) => Some((Kernel::AttentionBwdWsHeadsD128, WSB_SMEM_D128)),
        (_, 128, false) => Some((Kernel::AttentionBwdWsD128, WSB_SMEM_D128)),
        _ => None,
    };
    if let (true, Some((name, smem))) = (be.is_hopper(), ws_kernel) {
        let dkv_acc = r.dkv_acc.map(|(acc, _)| acc);
        let maps = wsb_tensor_maps(
            &g,
            [ptrs[0], qp, kp, vp],
            (r.lse2, r.delta, dq_acc),
            dkv_acc,
        );
        if let Ok(maps) = maps {
            let counter = be.attention_work_counter()?;
            if let Some((acc, bytes)) = r.dkv_acc {
                be.zero_bytes(acc, bytes)?;
            }
            let mut rest = vec![p(r.dk), p(r.dv), Arg::Ptr(counter)];
            rest.extend(positions);
            let pairs = batch * if per_head { heads } else { c.dims.kv_heads };
            be.launch_persistent(name, seq_kv.div_ceil(WSB_BC) * pairs, smem, &maps, &rest)?;
            if let Some((acc, bytes)) = r.dkv_acc {
                let args = [Arg::Ptr(acc), p(r.dk), p(r.dv), Arg::Geom(g)];
                be.launch_n(Kernel::AttentionDkvOut, bytes / 16, &args)?;
            }
            return dq_out(be, &r.layout, dq_acc, r.dq, g);
        }
    }
    let mut args: Vec<Arg> = [ptrs[0], qp, kp, vp, r.lse2, r.delta, dq_acc]
        .into_iter()
        .map(Arg::Ptr)
        .collect();
    args.extend([p(r.dk), p(r.dv)]);
    args.extend(positions);
    launch_tc(be, tc.bwd, grid, TC_BWD_THREADS, tc.bwd_smem(), &args)?;
    dq_out(be, &r.layout, dq_acc, r.dq, g)
}

/// After a tensor-core backward: dq from its f32 accumulator where that is scratch (each bf16
/// element rounded once from its f32 sum; an f32 one, of a packed dqkv, copied).
fn dq_out(
    be: &mut CudaBackend,
    layout: &AttentionScratch,
    dq_acc: CUdeviceptr,
    dq: Buf,
    g: AttGeom,
) -> Result<()> {
    if layout.dq_acc.is_some() {
        be.launch_n(
            Kernel::AttentionDqOut,
            dq.len / 4,
            &[Arg::Ptr(dq_acc), p(dq), Arg::Geom(g)],
        )?;
    }
    Ok(())
}

/// Deterministic small integers in [-3, 3] as bf16 bits (exact in bf16, and their products'
/// sums exact in f32), from `seed`.
fn small_ints(n: usize, seed: u32) -> Vec<u16> {
    let mut x = seed.wrapping_mul(0x9e37_79b9) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let v = (x % 7) as f32 - 3.0;
            (v.to_bits() >> 16) as u16
        })
        .collect()
}

fn bf16_value(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// `want` against `got` (rows × cols, row-major): a line naming `what`, how many entries
/// differ and the first few, or None when all agree.
fn compare_exact(what: &str, got: &[f32], want: &[f32], cols: usize) -> Option<String> {
    let bad: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
    if bad.is_empty() {
        return None;
    }
    let first: Vec<String> = bad
        .iter()
        .take(4)
        .map(|&i| {
            format!(
                "(row {}, col {}): got {} want {}",
                i / cols,
                i % cols,
                got[i],
                want[i]
            )
        })
        .collect();
    Some(format!(
        "{what}: {} of {} entries wrong; first {}",
        bad.len(),
        want.len(),
        first.join(", ")
    ))
}

impl CudaBackend {
    /// Checks, on their own, the shared-memory layouts, matrix descriptors and register
    /// fragments the `wgmma` attention forward relies on, for `head_dim` 64 or 128 (one
    /// warpgroup, `attention_wgmma_layout_check_d*`): S = A·Bᵀ with A and B (64 × head_dim)
    /// K-major in swizzled shared memory, and O = P·V with P (64 × 64) in registers and V
    /// (64 × head_dim) MN-major, on small integers, so every product is exact. Returns one
    /// line per product that came out wrong (empty: all exact). Hopper GPUs only.
    pub fn attention_wgmma_layout_check(&mut self, head_dim: usize) -> Result<Vec<String>> {
        require_hopper(self, "attention_wgmma_layout_check")?;
        let name = match head_dim {
            64 => Kernel::AttentionWgmmaLayoutCheckD64,
            128 => Kernel::AttentionWgmmaLayoutCheckD128,
            _ => {
                return Err(RuntimeError::Unsupported(format!(
                    "the wgmma layout check takes head_dim 64 or 128, not {head_dim}"
                )))
            }
        };
        let d = head_dim;
        let (a, bm, p, v) = (
            small_ints(64 * d, 1),
            small_ints(64 * d, 2),
            small_ints(64 * 64, 3),
            small_ints(64 * d, 4),
        );
        let mut inputs = Vec::new();
        for host in [&a, &bm, &p, &v] {
            let memory = self.alloc_bytes(host.len() * 2, "the wgmma layout check's inputs")?;
            let ptr = raw_ptr(&self.stream, &memory);
            // SAFETY: memory holds host.len() u16s; the copy completes before returning.
            unsafe { cu::memcpy_htod_sync(ptr, host.as_slice()) }
                .map_err(|e| driver_error("uploading the wgmma layout check's inputs", e))?;
            inputs.push((memory, ptr));
        }
        let s_out = self.alloc_bytes(64 * 64 * 4, "the wgmma layout check's S")?;
        let o_out = self.alloc_bytes(64 * d * 4, "the wgmma layout check's O")?;
        let (s_ptr, o_ptr) = (raw_ptr(&self.stream, &s_out), raw_ptr(&self.stream, &o_out));
        let mut args: Vec<Arg> = inputs.iter().map(|(_, ptr)| Arg::Ptr(*ptr)).collect();
        args.extend([Arg::Ptr(s_ptr), Arg::Ptr(o_ptr)]);
        let smem = (WGMMA_ALIGN + 3 * 64 * d * 2) as u32;
        launch_tc(self, name, (1, 1, false), 128, smem, &args)?;
        self.synchronize()?;
        let mut s_got = vec![0f32; 64 * 64];
        let mut o_got = vec![0f32; 64 * d];
        // SAFETY: each allocation holds exactly the f32s read; the stream is synchronized.
        unsafe {
            cu::memcpy_dtoh_sync(&mut s_got, s_ptr)
                .and_then(|()| cu::memcpy_dtoh_sync(&mut o_got, o_ptr))
        }
        .map_err(|e| driver_error("reading the wgmma layout check's results", e))?;
        let mut s_want = vec![0f32; 64 * 64];
        for i in 0..64 {
            for j in 0..64 {
                s_want[i * 64 + j] = (0..d)
                    .map(|k| bf16_value(a[i * d + k]) * bf16_value(bm[j * d + k]))
                    .sum();
            }
        }
        let mut o_want = vec![0f32; 64 * d];
        for i in 0..64 {
            for n in 0..d {
                o_want[i * d + n] = (0..64)
                    .map(|k| bf16_value(p[i * 64 + k]) * bf16_value(v[k * d + n]))
                    .sum();
            }
        }
        let s_what = format!(
            "d{d} S = A·Bᵀ (wg_mma_ss_n64: A and B K-major from 128-byte-swizzled shared \
             memory, descriptors wg_desc_k; accumulator layout)"
        );
        let o_what = format!(
            "d{d} O = P·V (wg_mma_rs_n{d}: P as A fragments in registers, V MN-major from \
             swizzled shared memory, wg_desc_mn with LBO = one 64-column block)"
        );
        Ok([
            compare_exact(&s_what, &s_got, &s_want, 64),
            compare_exact(&o_what, &o_got, &o_want, d),
        ]
        .into_iter()
        .flatten()
        .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opt-in shared memory per block: A100 (the smallest among GPUs with bf16 `mma.sync`) and
    /// H100 / H200.
    const A100_SMEM: u32 = 163 << 10;
    const H100_SMEM: u32 = 227 << 10;

    #[test]
    fn tensor_core_kernels_exist_for_head_dims_64_and_128_only() {
        for d in [8, 16, 32, 48, 80, 96, 256] {
            assert!(TensorCore::for_head_dim(d).is_none(), "head_dim {d}");
        }
        for d in [64, 128] {
            let tc = TensorCore::for_head_dim(d).expect("a tensor-core kernel");
            assert_eq!(tc.head_dim, d);
            let suffix = format!("_d{d}");
            assert!(tc.fwd.symbol().ends_with(&suffix) && tc.bwd.symbol().ends_with(&suffix));
        }
    }

    /// Every kernel fits an A100's shared memory, two forward CTAs (what their registers
    /// allow) an H100's, and the sizes follow the kernels' layouts (attention_tc.cu's comments).
    #[test]
    fn tensor_core_shared_memory_fits() {
        let d64 = TensorCore::for_head_dim(64).expect("d64");
        let bc = d64.fwd_keys;
        // Q 128 rows + K, V bc rows x 2 stages, 72 bf16 a row; key positions 2 x bc.
        assert_eq!(d64.fwd_smem() as usize, (128 + 4 * bc) * 144 + 2 * bc * 4);
        // K, V 128 rows; 2 stages of Q, dO 64 rows and 3 x 64 floats; dS^T 128 x 72 bf16.
        assert_eq!(
            d64.bwd_smem(),
            2 * 128 * 144 + 2 * (2 * 64 * 144 + 3 * 64 * 4) + 128 * 72 * 2
        );
        for d in [64, 128] {
            let tc = TensorCore::for_head_dim(d).expect("a tensor-core kernel");
            let (fwd, bwd) = (tc.fwd_smem(), tc.bwd_smem());
            assert!(fwd <= H100_SMEM / 2, "d{d} forward: {fwd}");
            assert!(bwd <= A100_SMEM, "d{d} backward: {bwd}");
        }
        // The warp-specialized kernels (Hopper only), one CTA an SM: forward 161 KiB (head_dim
        // 64) and 225.2 KiB (128), backward 195 KiB at both, all under the 227 KiB an H100
        // block may opt in to; the sizes follow the kernels' budget comments.
        const { assert!(WSB_SMEM <= H100_SMEM) };
        const { assert!(WSB_SMEM_D128 <= H100_SMEM) };
        const { assert!(WS_FWD_SMEM <= H100_SMEM) };
        const { assert!(WS_FWD_SMEM_D128 <= H100_SMEM) };
        assert_eq!(WS_FWD_SMEM, 165_024);
        assert_eq!(WS_FWD_SMEM_D128, 230_576);
        assert_eq!(WSB_SMEM, 199_840);
        assert_eq!(WSB_SMEM_D128, 199_840);
    }

    /// The wgmma forward's shared memory follows its kernel's layout (1024-byte alignment
    /// slack, Q 64 rows a warpgroup, K and V in two stages, key positions): two d64 CTAs (what
    /// their ≤ 128 registers allow) fit an H100, and one d128 CTA.
    #[test]
    fn wgmma_forward_shared_memory_fits() {
        let d64 = TensorCore::for_head_dim(64).expect("d64");
        let (name, warpgroups, smem) = d64.wgmma_fwd();
        assert_eq!((name, warpgroups), (Kernel::AttentionFwdWgmmaD64, 2));
        assert_eq!(smem as usize, 1024 + 128 * 128 + 4 * 64 * 128 + 2 * 64 * 4);
        assert!(smem <= H100_SMEM / 2, "d64: {smem}");
        let d128 = TensorCore::for_head_dim(128).expect("d128");
        let (name, warpgroups, smem) = d128.wgmma_fwd();
        assert_eq!((name, warpgroups), (Kernel::AttentionFwdWgmmaD128, 3));
        assert_eq!(smem as usize, 1024 + 192 * 256 + 4 * 64 * 256 + 2 * 64 * 4);
        assert!(smem <= H100_SMEM, "d128: {smem}");
    }
}
