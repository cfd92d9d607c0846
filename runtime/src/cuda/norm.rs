//! The norm family on the GPU (kernels/norm_loss.cu): LayerNorm and RMSNorm, forward and
//! backward, one code path for both (an RMSNorm is a LayerNorm without mean and bias: the
//! kernels take the same operands less those).
//!
//! Each direction has two kernels (`variants.rs`). The forward's default, `multirow`
//! (PARC_NORM_FWD_KERNEL), normalises two rows per warp, holding them as stored, so more bytes
//! are in flight than with `warp`'s one row per warp. The backward's default, `fused`
//! (PARC_NORM_BWD_KERNEL), computes dx and the dw (and db) column partials in one pass over dy
//! and x, where `warp` computes dx and then reads dy and x twice more for the partials
//! (`columns`) over four more launches. The defaults take rows of a multiple of 8 elements, at
//! most [`MAX_DIM`], with 16-byte aligned operands (and, for the fused backward, dy, x and dx
//! of one dtype); elsewhere the `warp` kernels run.
//!
//! The fused backward's partials are f32, one row per block for dw and one for db: at most
//! 128 blocks × 2 × dim × 4 bytes, within the 128 chunks × dim × 8 bytes that
//! `storage::program_needs` reserves for a norm backward's partials.
use super::args::{fv, n, p, Bound, Limits};
use super::columns::{col_sum_into, column_sums};
use super::kernel::Kernel;
use super::variants::{NormBwdKernel, NormFwdKernel};
use super::{Arg, Buf, CudaBackend};
use crate::error::Result;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::DType;
use parc_compiler::memplan::REDUCTION_CHUNKS;

/// Threads of a `warp` kernel's block, one warp a row.
const WARP_THREADS: u32 = 256;
const WARP_ROWS_PER_BLOCK: usize = WARP_THREADS as usize / 32;
/// Widest row the default kernels take: each lane holds at most 4 vectors of 8 (4 × 256
/// columns).
const MAX_DIM: usize = 1024;
/// Most blocks (partial rows) of a fused backward (`memplan::REDUCTION_CHUNKS` is 128).
const MAX_BLOCKS: usize = 128;
// The partials (f32, dw and db) fit the 128 f64 chunks per column reserved for them.
const _: () = assert!(2 * MAX_BLOCKS * 4 <= REDUCTION_CHUNKS as usize * 8);
/// Threads of a multirow forward's block (8 warps of 2 rows: 16 rows per block).
const FWD_THREADS: u32 = 256;
const FWD_ROWS_PER_BLOCK: usize = 16;

const LN_FWD: [[Kernel; 4]; 2] = [
    [
        Kernel::LayerNormFwdMultirow1F32,
        Kernel::LayerNormFwdMultirow2F32,
        Kernel::LayerNormFwdMultirow3F32,
        Kernel::LayerNormFwdMultirow4F32,
    ],
    [
        Kernel::LayerNormFwdMultirow1Bf16,
        Kernel::LayerNormFwdMultirow2Bf16,
        Kernel::LayerNormFwdMultirow3Bf16,
        Kernel::LayerNormFwdMultirow4Bf16,
    ],
];
const RMS_FWD: [[Kernel; 4]; 2] = [
    [
        Kernel::RmsNormFwdMultirow1F32,
        Kernel::RmsNormFwdMultirow2F32,
        Kernel::RmsNormFwdMultirow3F32,
        Kernel::RmsNormFwdMultirow4F32,
    ],
    [
        Kernel::RmsNormFwdMultirow1Bf16,
        Kernel::RmsNormFwdMultirow2Bf16,
        Kernel::RmsNormFwdMultirow3Bf16,
        Kernel::RmsNormFwdMultirow4Bf16,
    ],
];
const LN_BWD: [[Kernel; 4]; 2] = [
    [
        Kernel::LayerNormBwdFused1F32,
        Kernel::LayerNormBwdFused2F32,
        Kernel::LayerNormBwdFused3F32,
        Kernel::LayerNormBwdFused4F32,
    ],
    [
        Kernel::LayerNormBwdFused1Bf16,
        Kernel::LayerNormBwdFused2Bf16,
        Kernel::LayerNormBwdFused3Bf16,
        Kernel::LayerNormBwdFused4Bf16,
    ],
];
const RMS_BWD: [[Kernel; 4]; 2] = [
    [
        Kernel::RmsNormBwdFused1F32,
        Kernel::RmsNormBwdFused2F32,
        Kernel::RmsNormBwdFused3F32,
        Kernel::RmsNormBwdFused4F32,
    ],
    [
        Kernel::RmsNormBwdFused1Bf16,
        Kernel::RmsNormBwdFused2Bf16,
        Kernel::RmsNormBwdFused3Bf16,
        Kernel::RmsNormBwdFused4Bf16,
    ],
];
/// Threads of each fused backward (by stored dtype, then vectors per lane): the
/// `__launch_bounds__` of norm_loss.cu's NORM_BWD_FUSED lines, as many warps as keep the row
/// and the column sums in registers without spills (ptxas: 128 registers at 512 threads).
const BWD_THREADS: [[u32; 4]; 2] = [[512, 512, 384, 256], [512, 512, 512, 384]];

/// Run an op of the norm family.
pub(super) fn run(be: &mut CudaBackend, b: &Bound) -> Result<()> {
    match b.op {
        Op::LayerNorm { dim, eps, bias } => forward(be, &NormFwd::bind(b, *dim, *eps, *bias)?),
        Op::RmsNorm { dim, eps } => forward(be, &NormFwd::bind(b, *dim, *eps, false)?),
        Op::LayerNormBwd {
            dim,
            bias,
            accumulate,
            accumulate_param_grad,
        } => backward(
            be,
            &NormBwd::bind(b, *dim, *bias, (*accumulate, *accumulate_param_grad))?,
        ),
        Op::RmsNormBwd {
            dim,
            accumulate,
            accumulate_param_grad,
        } => backward(
            be,
            &NormBwd::bind(b, *dim, false, (*accumulate, *accumulate_param_grad))?,
        ),
        _ => Err(b.err("is not a norm op")),
    }
}

/// Index 0 for operands stored in f32, 1 for bf16 (the kernels' `_f32`/`_bf16` suffix).
fn stored(b: Buf) -> usize {
    usize::from(b.dtype == DType::Bf16)
}

/// The vectors per lane (1..=4) a row of `d` elements needs, when the default kernels take it.
fn vectors(d: usize, ptrs: &[u64]) -> Option<usize> {
    let ok = d > 0 && d.is_multiple_of(8) && d <= MAX_DIM && ptrs.iter().all(|p| p % 16 == 0);
    ok.then(|| d.div_ceil(256))
}

/// One norm forward's operands: `mean` only for a LayerNorm (else an RMSNorm), `bias` only for
/// one with a bias.
struct NormFwd {
    x: Buf,
    w: Buf,
    bias: Option<Buf>,
    y: Buf,
    mean: Option<Buf>,
    rstd: Buf,
    rows: usize,
    d: usize,
    eps: f64,
}

impl NormFwd {
    /// The operands of a `LayerNorm` (x, w, [b]; y, mean, rstd) or `RmsNorm` (x, w; y, rstd).
    fn bind(b: &Bound, dim: u64, eps: f64, bias: bool) -> Result<NormFwd> {
        let d = b.launch_dim("dim", dim)?;
        if eps.is_nan() || eps < 0.0 {
            return Err(b.err(format!("eps = {eps} must be non-negative")));
        }
        let layer = matches!(b.op, Op::LayerNorm { .. });
        let x = b.input(0)?;
        Ok(NormFwd {
            x,
            w: b.input(1)?,
            bias: bias.then(|| b.input(2)).transpose()?,
            y: b.output(0)?,
            mean: layer.then(|| b.output(1)).transpose()?,
            rstd: b.output(1 + usize::from(layer))?,
            rows: b.launch_rows(x, "x", b.rows)?,
            d,
            eps,
        })
    }

    /// The kernels' arguments (both kernels of each norm take the same).
    fn args(&self) -> Vec<Arg> {
        let mut args = vec![fv(self.x), p(self.w)];
        if let Some(mean) = self.mean {
            args.push(Arg::Ptr(self.bias.map_or(0, |b| b.ptr)));
            args.extend([fv(self.y), p(mean)]);
        } else {
            args.push(fv(self.y));
        }
        args.extend([p(self.rstd), n(self.rows), n(self.d), Arg::F64(self.eps)]);
        args
    }
}

/// A norm forward: `multirow` where it is chosen and takes the rows, else `warp`.
fn forward(be: &mut CudaBackend, f: &NormFwd) -> Result<()> {
    let mut ptrs = vec![f.x.ptr, f.y.ptr, f.w.ptr];
    ptrs.extend(f.bias.map(|b| b.ptr));
    let multirow = be.variants.norm_fwd == NormFwdKernel::Multirow;
    if let Some(v) = vectors(f.d, &ptrs).filter(|_| multirow) {
        let names = if f.mean.is_some() { LN_FWD } else { RMS_FWD };
        let grid = (f.rows.div_ceil(FWD_ROWS_PER_BLOCK) as u32, 1, 1);
        let kernel = names[stored(f.x)][v - 1];
        return be.launch(kernel, grid, (FWD_THREADS, 1, 1), 0, &f.args());
    }
    let kernel = if f.mean.is_some() {
        Kernel::LayerNormFwd
    } else {
        Kernel::RmsNormFwd
    };
    launch_warp_rows(be, kernel, f.rows, &f.args())
}

/// Launch a `warp` kernel over `rows` rows, one warp each.
fn launch_warp_rows(be: &mut CudaBackend, kernel: Kernel, rows: usize, args: &[Arg]) -> Result<()> {
    let blocks = rows.div_ceil(WARP_ROWS_PER_BLOCK) as u32;
    be.launch(kernel, (blocks, 1, 1), (WARP_THREADS, 1, 1), 0, args)
}

/// One norm backward's operands: `mean` only for a LayerNorm, `db` only for one with a bias;
/// `accumulate_dx` adds into dx, `accumulate_param` into dw and db.
struct NormBwd {
    dy: Buf,
    x: Buf,
    w: Buf,
    mean: Option<Buf>,
    rstd: Buf,
    dx: Buf,
    dw: Buf,
    db: Option<Buf>,
    rows: usize,
    d: usize,
    accumulate_dx: bool,
    accumulate_param: bool,
}

impl NormBwd {
    /// The operands of a `LayerNormBwd` (dy, x, w, mean, rstd; dx, dw, [db]) or `RmsNormBwd`
    /// (dy, x, w, rstd; dx, dw).
    fn bind(b: &Bound, dim: u64, bias: bool, (dx, param): (bool, bool)) -> Result<NormBwd> {
        let d = b.launch_dim("dim", dim)?;
        let layer = matches!(b.op, Op::LayerNormBwd { .. });
        let x = b.input(1)?;
        Ok(NormBwd {
            dy: b.input(0)?,
            x,
            w: b.input(2)?,
            mean: layer.then(|| b.input(3)).transpose()?,
            rstd: b.input(3 + usize::from(layer))?,
            dx: b.output(0)?,
            dw: b.output(1)?,
            db: bias.then(|| b.output(2)).transpose()?,
            rows: b.launch_rows(x, "x", b.rows)?,
            d,
            accumulate_dx: dx,
            accumulate_param: param,
        })
    }

    /// The operands as both kernels of each norm take them: dy, x, w, [mean], rstd, dx.
    fn operands(&self) -> Vec<Arg> {
        let mut args = vec![fv(self.dy), fv(self.x), p(self.w)];
        args.extend(self.mean.map(p));
        args.extend([p(self.rstd), fv(self.dx)]);
        args
    }
}

/// A norm backward: `fused` where it is chosen and takes the rows, else `warp`'s dx, then dw
/// (and db) through column partials.
fn backward(be: &mut CudaBackend, f: &NormBwd) -> Result<()> {
    if fused_backward(be, f)? {
        return Ok(());
    }
    let kernel = if f.mean.is_some() {
        Kernel::LayerNormBwdDx
    } else {
        Kernel::RmsNormBwdDx
    };
    let mut args = f.operands();
    // The last argument: accumulate into dx (0: overwrite).
    args.extend([n(f.rows), n(f.d), Arg::I32(i32::from(f.accumulate_dx))]);
    launch_warp_rows(be, kernel, f.rows, &args)?;
    // dw (+=) Σ_rows dy·xhat, in double, deterministically.
    let mean = Arg::Ptr(f.mean.map_or(0, |m| m.ptr));
    let leading = [fv(f.dy), fv(f.x), mean, p(f.rstd)];
    let partial = (Kernel::NormDwPartial, Kernel::NormDwPartial8);
    let dw = (f.dw, f.accumulate_param);
    column_sums(be, partial, (&leading, &[f.dy, f.x]), dw, f.rows, f.d)?;
    if let Some(db) = f.db {
        col_sum_into(be, f.dy, (db, f.accumulate_param), f.rows, f.d)?;
    }
    Ok(())
}

/// Runs the fused backward (dx, dw, db) when it is chosen and takes the rows (`Ok(true)`).
fn fused_backward(be: &mut CudaBackend, f: &NormBwd) -> Result<bool> {
    let one_dtype = f.dy.dtype == f.x.dtype && f.dx.dtype == f.x.dtype;
    if be.variants.norm_bwd != NormBwdKernel::Fused || !one_dtype {
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
    let mut args = f.operands();
    args.extend([
        Arg::Ptr(part),
        n(f.rows),
        n(f.d),
        n(band),
        Arg::I32(i32::from(f.accumulate_dx)),
    ]);
    let names = match f.mean {
        Some(_) => {
            args.push(Arg::I32(i32::from(f.db.is_some())));
            LN_BWD
        }
        None => RMS_BWD,
    };
    let kernel = names[stored(f.x)][v - 1];
    be.launch(kernel, (blocks as u32, 1, 1), (threads, 1, 1), 0, &args)?;
    be.launch(
        Kernel::NormBwdFusedFinish,
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
    fn rows_the_default_kernels_take() {
        assert_eq!(vectors(768, &[0, 16, 4096]), Some(3));
        assert_eq!(vectors(1024, &[0]), Some(4));
        assert_eq!(vectors(64, &[0]), Some(1));
        assert_eq!(vectors(1000, &[0]), Some(4));
        assert_eq!(vectors(1040, &[0]), None, "too wide");
        assert_eq!(vectors(20, &[0]), None, "not a multiple of 8");
        assert_eq!(vectors(768, &[8]), None, "unaligned");
    }
}
