//! Attention (`Op::Attention`, `Op::AttentionBwd`) on the GPU: checks the op's geometry and
//! buffers, uploads the q/kv global positions, and launches one of two kernel families:
//! - bf16 runs with head_dim 64 or 128 and a positive scale: flash-attention-2 on tensor cores
//!   (`kernels/attention_tc.cu`: bf16 `mma.sync` operands, fp32 accumulation and softmax);
//! - everything else (fp32 and fp16 runs, other head dims): the exact fp32 kernels of
//!   `kernels/attention.cu`.
use super::device::driver_error;
use super::dispatch::{p, segments_len, Bound};
use super::gemm::Operands;
use super::{Arg, Buf, CudaBackend};
use crate::error::Result;
use cudarc::driver::sys::{CUdeviceptr, CUfunction_attribute};
use parc_compiler::ir::op::{Op, Segment};

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
    pub causal: i32,
    pub scale: f32,
    pub q_sorted: i32,
    pub kv_sorted: i32,
}

/// Must match ATT_WARPS / ATT_TILE in kernels/attention.cu.
const ATT_WARPS: u32 = 8;
const ATT_TILE: usize = 32;
/// Each lane holds at most 4 columns of a head (kernels' ATT_MAX_PER_LANE).
const ATT_MAX_HEAD_DIM: usize = 128;
/// Query rows per forward CTA, keys per backward CTA and the threads of each kernel's CTA:
/// must match TC_FWD_BR / TC_BC / TC_THREADS / TC_BWD_THREADS in kernels/attention_tc.cu.
const TC_FWD_BR: usize = 128;
const TC_BC: usize = 128;
const TC_FWD_THREADS: u32 = 128;
const TC_BWD_THREADS: u32 = 256;
/// Shared memory a CTA may use without opting in to more.
const DEFAULT_SMEM: u32 = 48 << 10;

/// The tensor-core kernels' names and shared memory for one head dim, or None where the
/// exact kernels run.
struct TensorCore {
    fwd: &'static str,
    bwd: &'static str,
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
                fwd: "attention_fwd_tc_d64",
                bwd: "attention_bwd_tc_d64",
                fwd_keys: 64,
                bwd_rows: 64,
                head_dim: 64,
            }),
            128 => Some(TensorCore {
                fwd: "attention_fwd_tc_d128",
                bwd: "attention_bwd_tc_d128",
                fwd_keys: 32,
                bwd_rows: 32,
                head_dim: 128,
            }),
            _ => None,
        }
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

    /// K, V tiles; Q, dO tiles and lse / delta / position per query row in two stages; dSᵀ.
    fn bwd_smem(&self) -> u32 {
        let br = self.bwd_rows;
        let stage = 2 * br * self.row_bytes() + 3 * br * 4;
        (2 * TC_BC * self.row_bytes() + 2 * stage + TC_BC * (br + 8) * 2) as u32
    }
}

/// bf16 copies of fp32 buffers for the tensor-core kernels (which read bf16), in the backend's
/// scratch memory (grows to the largest attention's copies, then is reused), each on a 256-byte
/// boundary, with `extra_bytes` after them for the caller.
struct Bf16Copies {
    ptrs: Vec<CUdeviceptr>,
    extra: CUdeviceptr,
}

impl Bf16Copies {
    /// Rounds each of `bufs` (fp32, lengths multiples of 4) to bf16.
    fn of(be: &mut CudaBackend, bufs: &[Buf], extra_bytes: usize) -> Result<Bf16Copies> {
        let mut offsets = Vec::with_capacity(bufs.len());
        let mut bytes = 0usize;
        for b in bufs {
            offsets.push(bytes);
            bytes = (bytes + b.len * 2).next_multiple_of(256);
        }
        let base = be.scratch(bytes + extra_bytes)?;
        let ptrs: Vec<CUdeviceptr> = offsets.iter().map(|&o| base + o as CUdeviceptr).collect();
        for (b, &dst) in bufs.iter().zip(&ptrs) {
            let n4 = b.len / 4;
            be.launch_n(
                "attention_to_bf16",
                n4,
                &[p(*b), Arg::Ptr(dst), Arg::I64(n4 as i64)],
            )?;
        }
        Ok(Bf16Copies {
            ptrs,
            extra: base + bytes as CUdeviceptr,
        })
    }

    /// The copy of the `i`th buffer given to `of`.
    fn arg(&self, i: usize) -> Arg {
        Arg::Ptr(self.ptrs[i])
    }
}

/// Launches a tensor-core kernel, first letting it use `smem` bytes of shared memory.
fn launch_tc(
    be: &mut CudaBackend,
    name: &'static str,
    grid: (u32, u32, u32),
    threads: u32,
    smem: u32,
    args: &[Arg],
) -> Result<()> {
    if smem > DEFAULT_SMEM {
        be.kernels
            .function(name)?
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| {
                driver_error(&format!("allowing {name} {smem} bytes of shared memory"), e)
            })?;
    }
    be.launch(name, grid, (threads, 1, 1), smem, args)
}

/// Whether the positions of `segments` strictly increase (each segment starts at or after the
/// previous one's end).
fn ascending(segments: &[Segment]) -> bool {
    segments
        .windows(2)
        .all(|w| u64::from(w[0].start) + u64::from(w[0].len) <= u64::from(w[1].start))
}

#[allow(clippy::too_many_arguments)]
fn attention_geometry(
    b: &Bound,
    q: Buf,
    k: Buf,
    batch: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    causal: bool,
    scale: f64,
) -> Result<AttGeom> {
    let (batch, heads, kv_heads, d) = (
        b.dim("batch", batch)?,
        b.dim("heads", heads)?,
        b.dim("kv_heads", kv_heads)?,
        b.dim("head_dim", head_dim)?,
    );
    if heads % kv_heads != 0 {
        return Err(b.err(format!(
            "heads = {heads} is not a multiple of kv_heads = {kv_heads}"
        )));
    }
    if d > ATT_MAX_HEAD_DIM {
        return Err(b.err(format!(
            "head_dim = {d} is above {ATT_MAX_HEAD_DIM}, the largest the CUDA attention kernel takes"
        )));
    }
    if !scale.is_finite() {
        return Err(b.err(format!("scale = {scale} is not finite")));
    }
    if batch * heads > 65_535 {
        return Err(b.err(format!("batch x heads = {} is above 65535", batch * heads)));
    }
    let seq_q = b.rows(q, "q", batch * heads * d)?;
    let seq_kv = b.rows(k, "k", batch * kv_heads * d)?;
    Ok(AttGeom {
        batch: batch as i64,
        heads: heads as i64,
        kv_heads: kv_heads as i64,
        head_dim: d as i64,
        seq_q: seq_q as i64,
        seq_kv: seq_kv as i64,
        causal: i32::from(causal),
        scale: scale as f32,
        q_sorted: 0,
        kv_sorted: 0,
    })
}

/// Runs `op`, an `Attention` or `AttentionBwd` (any other op is an error).
pub(super) fn run(be: &mut CudaBackend, b: &Bound, op: &Op) -> Result<()> {
    let (Op::Attention {
        batch,
        heads,
        kv_heads,
        head_dim,
        causal,
        scale,
        q_positions,
        kv_positions,
    }
    | Op::AttentionBwd {
        batch,
        heads,
        kv_heads,
        head_dim,
        causal,
        scale,
        q_positions,
        kv_positions,
    }) = op
    else {
        return Err(b.err("is not an attention op"));
    };
    let forward = matches!(op, Op::Attention { .. });
    let (qi, ki, vi) = if forward { (0, 1, 2) } else { (1, 2, 3) };
    let (q, k, v) = (b.f32_in(qi)?, b.f32_in(ki)?, b.f32_in(vi)?);
    let mut g = attention_geometry(
        b, q, k, *batch, *heads, *kv_heads, *head_dim, *causal, *scale,
    )?;
    g.q_sorted = i32::from(ascending(q_positions));
    g.kv_sorted = i32::from(ascending(kv_positions));
    let (batch, heads, d) = (g.batch as usize, g.heads as usize, g.head_dim as usize);
    let (seq_q, seq_kv) = (g.seq_q as usize, g.seq_kv as usize);
    b.expect(v, "v", k.len)?;
    if segments_len(q_positions) != seq_q as u64 || segments_len(kv_positions) != seq_kv as u64 {
        return Err(b.err(format!(
            "q/kv positions cover {}/{} positions, the buffers hold {seq_q}/{seq_kv}",
            segments_len(q_positions),
            segments_len(kv_positions)
        )));
    }
    let (qpos, _) = be.positions(q_positions)?;
    let (kvpos, _) = be.positions(kv_positions)?;
    let lse_len = batch * heads * seq_q;
    // The tensor-core kernels take the row max of raw scores, so they need scale > 0.
    let tensor_core = if be.operands == Operands::Bf16 && g.scale > 0.0 {
        TensorCore::for_head_dim(d)
    } else {
        None
    };
    let q_blocks = seq_q.div_ceil(ATT_WARPS as usize) as u32;
    let block = (32, ATT_WARPS, 1);
    let kv_smem = (2 * ATT_TILE * d * 4) as u32;
    if forward {
        let (o, lse) = (b.f32_out(0)?, b.f32_out(1)?);
        b.expect(o, "o", q.len)?;
        b.expect(lse, "lse", lse_len)?;
        let args = [
            p(q),
            p(k),
            p(v),
            p(o),
            p(lse),
            Arg::Ptr(qpos),
            Arg::Ptr(kvpos),
            Arg::Geom(g),
        ];
        if let Some(tc) = &tensor_core {
            let copies = Bf16Copies::of(be, &[q, k, v], 0)?;
            let args = [
                copies.arg(0),
                copies.arg(1),
                copies.arg(2),
                p(o),
                p(lse),
                Arg::Ptr(qpos),
                Arg::Ptr(kvpos),
                Arg::Geom(g),
            ];
            let grid = (seq_q.div_ceil(TC_FWD_BR) as u32, (batch * heads) as u32, 1);
            return launch_tc(be, tc.fwd, grid, TC_FWD_THREADS, tc.fwd_smem(), &args);
        }
        be.launch(
            "attention_fwd",
            (q_blocks, (batch * heads) as u32, 1),
            block,
            kv_smem,
            &args,
        )
    } else {
        let (dout, o, lse) = (b.f32_in(0)?, b.f32_in(4)?, b.f32_in(5)?);
        b.same(&[(dout, "do"), (o, "o")], q.len)?;
        b.expect(lse, "lse", lse_len)?;
        let (dq, dk, dv) = (b.f32_out(0)?, b.f32_out(1)?, b.f32_out(2)?);
        b.expect(dq, "dq", q.len)?;
        b.same(&[(dk, "dk"), (dv, "dv")], k.len)?;
        // The tensor-core path's bf16 copies and delta share the scratch memory.
        let copies = match tensor_core {
            Some(_) => Some(Bf16Copies::of(be, &[dout, q, k, v], lse_len * 4)?),
            None => None,
        };
        let delta = match &copies {
            Some(c) => c.extra,
            None => be.scratch(lse_len * 4)?,
        };
        let grid_q = (q_blocks, (batch * heads) as u32, 1);
        be.launch(
            "attention_delta",
            grid_q,
            block,
            0,
            &[p(dout), p(o), Arg::Ptr(delta), Arg::Geom(g)],
        )?;
        if let (Some(tc), Some(copies)) = (&tensor_core, &copies) {
            // dQ is added into with atomics: start it at zero (the op overwrites it).
            be.zero_bytes(dq.ptr, dq.len * 4)?;
            let grid = (
                seq_kv.div_ceil(TC_BC) as u32,
                (batch * g.kv_heads as usize) as u32,
                1,
            );
            let args = [
                copies.arg(0),
                copies.arg(1),
                copies.arg(2),
                copies.arg(3),
                p(lse),
                Arg::Ptr(delta),
                p(dq),
                p(dk),
                p(dv),
                Arg::Ptr(qpos),
                Arg::Ptr(kvpos),
                Arg::Geom(g),
            ];
            return launch_tc(be, tc.bwd, grid, TC_BWD_THREADS, tc.bwd_smem(), &args);
        }
        let args = [
            p(dout),
            p(q),
            p(k),
            p(v),
            p(lse),
            Arg::Ptr(delta),
            p(dq),
            Arg::Ptr(qpos),
            Arg::Ptr(kvpos),
            Arg::Geom(g),
        ];
        be.launch("attention_bwd_dq", grid_q, block, kv_smem, &args)?;
        let kv_blocks = seq_kv.div_ceil(ATT_WARPS as usize) as u32;
        let grid_kv = (kv_blocks, (batch * g.kv_heads as usize) as u32, 1);
        let args = [
            p(dout),
            p(q),
            p(k),
            p(v),
            p(lse),
            Arg::Ptr(delta),
            p(dk),
            p(dv),
            Arg::Ptr(qpos),
            Arg::Ptr(kvpos),
            Arg::Geom(g),
        ];
        let smem = kv_smem + (2 * ATT_TILE * 4) as u32;
        be.launch("attention_bwd_dkdv", grid_kv, block, smem, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smallest opt-in shared memory per block among GPUs with bf16 `mma.sync` (A100:
    /// 163 KB; H100 / H200: 227 KB).
    const MAX_SMEM: u32 = 163 << 10;

    #[test]
    fn tensor_core_kernels_exist_for_head_dims_64_and_128_only() {
        for d in [8, 16, 32, 48, 80, 96, 256] {
            assert!(TensorCore::for_head_dim(d).is_none(), "head_dim {d}");
        }
        for d in [64, 128] {
            let tc = TensorCore::for_head_dim(d).expect("a tensor-core kernel");
            assert_eq!(tc.head_dim, d);
            assert!(tc.fwd.ends_with(&format!("_d{d}")) && tc.bwd.ends_with(&format!("_d{d}")));
        }
    }

    /// Two CTAs of each kernel fit an SM's shared memory with room to spare, and the sizes
    /// follow the kernels' layouts (attention_tc.cu's comments).
    #[test]
    fn tensor_core_shared_memory_fits() {
        let d64 = TensorCore::for_head_dim(64).expect("d64");
        // Q 128 rows + K, V 64 rows x 2 stages, 72 bf16 a row; key positions 2 x 64.
        assert_eq!(d64.fwd_smem(), (128 + 4 * 64) * 144 + 2 * 64 * 4);
        // K, V 128 rows; 2 stages of Q, dO 64 rows and 3 x 64 floats; dS^T 128 x 72 bf16.
        assert_eq!(
            d64.bwd_smem(),
            2 * 128 * 144 + 2 * (2 * 64 * 144 + 3 * 64 * 4) + 128 * 72 * 2
        );
        for d in [64, 128] {
            let tc = TensorCore::for_head_dim(d).expect("a tensor-core kernel");
            assert!(
                tc.fwd_smem() <= MAX_SMEM / 2,
                "d{d} forward: {}",
                tc.fwd_smem()
            );
            assert!(
                tc.bwd_smem() <= MAX_SMEM,
                "d{d} backward: {}",
                tc.bwd_smem()
            );
        }
    }
}
