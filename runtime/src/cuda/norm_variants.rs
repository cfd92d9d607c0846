//! The norm ops' default kernels (`variants.rs`; `warp`, in dispatch.rs, is their fallback):
//! `norm_fwd` = `multirow` (PARC_NORM_FWD_KERNEL)
//! normalises two rows per warp, holding them as stored, so more bytes are in flight than with
//! one row per warp; `norm_bwd` = `fused` (PARC_NORM_BWD_KERNEL) computes dx and the dw (and
//! db) column partials in one pass over dy and x, where the `warp` path reads them twice more
//! for the partials over four more launches. Each takes rows of a multiple of 8 elements, at
//! most [`MAX_DIM`], with 16-byte aligned operands (and, for the fused backward, dy, x and dx
//! of one dtype); otherwise it says so (`Ok(false)`) and the caller runs the `warp` kernels.
//!
//! The fused backward's partials are f32, one row per block for dw and one for db: at most
//! 128 blocks × 2 × dim × 4 bytes, within the 128 chunks × dim × 8 bytes that
//! `storage::program_needs` reserves for a norm backward's partials.
use super::dispatch::{fv, n, p};
use super::{Arg, Buf, CudaBackend};
use crate::error::Result;
use parc_compiler::ir::DType;
use parc_compiler::memplan::REDUCTION_CHUNKS;

/// Widest row the variants take: each lane holds at most 4 vectors of 8 (4 × 256 columns).
const MAX_DIM: usize = 1024;
/// Most blocks (partial rows) of a fused backward (`memplan::REDUCTION_CHUNKS` is 128).
const MAX_BLOCKS: usize = 128;
// The partials (f32, dw and db) fit the 128 f64 chunks per column reserved for them.
const _: () = assert!(2 * MAX_BLOCKS * 4 <= REDUCTION_CHUNKS as usize * 8);
/// Threads of a multirow forward's block (8 warps of 2 rows: 16 rows per block).
const FWD_THREADS: u32 = 256;
const FWD_ROWS_PER_BLOCK: usize = 16;

/// The vectors per lane (1..=4) a row of `d` elements needs, when the variants take it.
fn vectors(d: usize, ptrs: &[u64]) -> Option<usize> {
    let ok = d > 0 && d.is_multiple_of(8) && d <= MAX_DIM && ptrs.iter().all(|p| p % 16 == 0);
    ok.then(|| d.div_ceil(256))
}

/// Index 0 for operands stored in f32, 1 for bf16 (the kernels' `_f32`/`_bf16` suffix).
fn stored(b: Buf) -> usize {
    usize::from(b.dtype == DType::Bf16)
}

const LN_FWD: [[&str; 4]; 2] = [
    [
        "layer_norm_fwd_multirow1_f32",
        "layer_norm_fwd_multirow2_f32",
        "layer_norm_fwd_multirow3_f32",
        "layer_norm_fwd_multirow4_f32",
    ],
    [
        "layer_norm_fwd_multirow1_bf16",
        "layer_norm_fwd_multirow2_bf16",
        "layer_norm_fwd_multirow3_bf16",
        "layer_norm_fwd_multirow4_bf16",
    ],
];
const RMS_FWD: [[&str; 4]; 2] = [
    [
        "rms_norm_fwd_multirow1_f32",
        "rms_norm_fwd_multirow2_f32",
        "rms_norm_fwd_multirow3_f32",
        "rms_norm_fwd_multirow4_f32",
    ],
    [
        "rms_norm_fwd_multirow1_bf16",
        "rms_norm_fwd_multirow2_bf16",
        "rms_norm_fwd_multirow3_bf16",
        "rms_norm_fwd_multirow4_bf16",
    ],
];
const LN_BWD: [[&str; 4]; 2] = [
    [
        "layer_norm_bwd_fused1_f32",
        "layer_norm_bwd_fused2_f32",
        "layer_norm_bwd_fused3_f32",
        "layer_norm_bwd_fused4_f32",
    ],
    [
        "layer_norm_bwd_fused1_bf16",
        "layer_norm_bwd_fused2_bf16",
        "layer_norm_bwd_fused3_bf16",
        "layer_norm_bwd_fused4_bf16",
    ],
];
const RMS_BWD: [[&str; 4]; 2] = [
    [
        "rms_norm_bwd_fused1_f32",
        "rms_norm_bwd_fused2_f32",
        "rms_norm_bwd_fused3_f32",
        "rms_norm_bwd_fused4_f32",
    ],
    [
        "rms_norm_bwd_fused1_bf16",
        "rms_norm_bwd_fused2_bf16",
        "rms_norm_bwd_fused3_bf16",
        "rms_norm_bwd_fused4_bf16",
    ],
];
/// Threads of each fused backward (by stored dtype, then vectors per lane): the
/// `__launch_bounds__` of norm_loss.cu's NORM_BWD_FUSED lines, as many warps as keep the row
/// and the column sums in registers without spills (ptxas: 128 registers at 512 threads).
const BWD_THREADS: [[u32; 4]; 2] = [[512, 512, 384, 256], [512, 512, 512, 384]];

/// One norm forward's operands: `mean` and `bias` are 0 for none (RMSNorm; no bias).
pub(super) struct NormFwd {
    pub x: Buf,
    pub w: Buf,
    pub bias: u64,
    pub y: Buf,
    pub mean: u64,
    pub rstd: Buf,
    pub rows: usize,
    pub d: usize,
    pub eps: f64,
}

/// Runs the multirow forward when it is chosen and takes the row (`Ok(true)`).
pub(super) fn forward(be: &mut CudaBackend, f: &NormFwd) -> Result<bool> {
    if !be.variants.is("norm_fwd", "multirow") {
        return Ok(false);
    }
    let mut ptrs = vec![f.x.ptr, f.y.ptr, f.w.ptr];
    if f.bias != 0 {
        ptrs.push(f.bias);
    }
    let Some(v) = vectors(f.d, &ptrs) else {
        return Ok(false);
    };
    let grid = (f.rows.div_ceil(FWD_ROWS_PER_BLOCK) as u32, 1, 1);
    let block = (FWD_THREADS, 1, 1);
    let tail = [n(f.rows), n(f.d), Arg::F64(f.eps)];
    if f.mean != 0 {
        let mut args = vec![
            fv(f.x),
            p(f.w),
            Arg::Ptr(f.bias),
            fv(f.y),
            Arg::Ptr(f.mean),
            p(f.rstd),
        ];
        args.extend(tail);
        be.launch(LN_FWD[stored(f.x)][v - 1], grid, block, 0, &args)?;
    } else {
        let mut args = vec![fv(f.x), p(f.w), fv(f.y), p(f.rstd)];
        args.extend(tail);
        be.launch(RMS_FWD[stored(f.x)][v - 1], grid, block, 0, &args)?;
    }
    Ok(true)
}

/// One norm backward's operands: `mean` is 0 for RMSNorm; `db` only for a LayerNorm with a
/// bias; `accumulate_dx` adds into dx, `accumulate_param` into dw and db.
pub(super) struct NormBwd {
    pub dy: Buf,
    pub x: Buf,
    pub w: Buf,
    pub mean: u64,
    pub rstd: Buf,
    pub dx: Buf,
    pub dw: Buf,
    pub db: Option<Buf>,
    pub rows: usize,
    pub d: usize,
    pub accumulate_dx: bool,
    pub accumulate_param: bool,
}

/// Runs the fused backward (dx, dw, db) when it is chosen and takes the rows (`Ok(true)`).
pub(super) fn backward(be: &mut CudaBackend, f: &NormBwd) -> Result<bool> {
    let one_dtype = f.dy.dtype == f.x.dtype && f.dx.dtype == f.x.dtype;
    if !be.variants.is("norm_bwd", "fused") || !one_dtype {
        return Ok(false);
    }
    let Some(v) = vectors(f.d, &[f.dy.ptr, f.x.ptr, f.dx.ptr, f.w.ptr]) else {
        return Ok(false);
    };
    let threads = BWD_THREADS[stored(f.x)][v - 1];
    // Blocks: at most 128, each with a row per warp at least; bands of equal rows (the last
    // shorter), none empty.
    let warps = threads as usize / 32;
    let blocks = f.rows.div_ceil(warps).min(MAX_BLOCKS);
    let band = if blocks == 0 {
        0
    } else {
        f.rows.div_ceil(blocks)
    };
    let blocks = if band == 0 { 0 } else { f.rows.div_ceil(band) };
    let sums = 1 + usize::from(f.db.is_some());
    let part = be.scratch(sums * blocks * f.d * 4)?;
    let grid = (blocks as u32, 1, 1);
    let block = (threads, 1, 1);
    let tail = [
        Arg::Ptr(part),
        n(f.rows),
        n(f.d),
        n(band),
        Arg::I32(i32::from(f.accumulate_dx)),
    ];
    if f.mean != 0 {
        let mut args = vec![
            fv(f.dy),
            fv(f.x),
            p(f.w),
            Arg::Ptr(f.mean),
            p(f.rstd),
            fv(f.dx),
        ];
        args.extend(tail);
        args.push(Arg::I32(i32::from(f.db.is_some())));
        be.launch(LN_BWD[stored(f.x)][v - 1], grid, block, 0, &args)?;
    } else {
        let mut args = vec![fv(f.dy), fv(f.x), p(f.w), p(f.rstd), fv(f.dx)];
        args.extend(tail);
        be.launch(RMS_BWD[stored(f.x)][v - 1], grid, block, 0, &args)?;
    }
    be.launch(
        "norm_bwd_fused_finish",
        (f.d.div_ceil(256) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(part),
            p(f.dw),
            Arg::Ptr(f.db.map_or(0, |b| b.ptr)),
            n(f.d),
            n(blocks),
            Arg::I32(i32::from(f.accumulate_param)),
        ],
    )?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_the_variants_take() {
        assert_eq!(vectors(768, &[0, 16, 4096]), Some(3));
        assert_eq!(vectors(1024, &[0]), Some(4));
        assert_eq!(vectors(64, &[0]), Some(1));
        assert_eq!(vectors(1000, &[0]), Some(4));
        assert_eq!(vectors(1040, &[0]), None, "too wide");
        assert_eq!(vectors(20, &[0]), None, "not a multiple of 8");
        assert_eq!(vectors(768, &[8]), None, "unaligned");
    }
}
