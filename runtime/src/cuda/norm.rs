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
//! Rows of at most [`LANE_DIM`] run one warp a row (up to 4 vectors of 8 a lane) and give the
//! `warp` kernels' values exactly. Wider rows (every Llama-family width, 1,536 to 8,192) run
//! the `*_wide` kernels: a row split over a row group of 2 to 8 warps, each thread holding
//! [`WIDE_VECS`] vectors of 8 as stored, so the row is still read once; its double sums cross
//! the group's warps through shared memory, in another order than `warp`'s, so statistics and
//! dx may differ from `warp`'s in the last bits. A wide backward's thread keeps its columns'
//! dw/db sums over its group's rows in registers, as the one-warp backward does.
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
/// Widest row the one-warp-a-row defaults (`multirow`, `fused`) take: each lane holds at most 4
/// vectors of 8 (4 × 256 columns).
const LANE_DIM: usize = 1024;
/// Widest row the default kernels take (norm_loss.cu's NORM_WIDE_MAX_DIM): rows wider than
/// [`LANE_DIM`] are split over a row group of warps, each thread holding [`WIDE_VECS`] vectors
/// of 8 (NORM_WIDE_VECS).
const MAX_DIM: usize = 8192;
const WIDE_VECS: usize = 4;
/// Threads of a wide kernel's block at most (NORM_WIDE_THREADS, the wide kernels'
/// `__launch_bounds__`): ⌊8 / W⌋ row groups of W warps.
const WIDE_THREADS: usize = 256;
// The widest row's group (8 warps) fits a block.
const _: () = assert!(32 * MAX_DIM.div_ceil(256 * WIDE_VECS) <= WIDE_THREADS);
/// Most blocks (partial rows) of a fused backward (`memplan::REDUCTION_CHUNKS` is 128).
const MAX_BLOCKS: usize = 128;
// The partials (f32, dw and db) fit the 128 f64 chunks per column reserved for them.
const _: () = assert!(2 * MAX_BLOCKS * 4 <= REDUCTION_CHUNKS as usize * 8);
/// Threads of a multirow forward's block (8 warps of 2 rows: 16 rows per block).
const FWD_THREADS: u32 = 256;
const FWD_ROWS_PER_BLOCK: usize = 16;
/// Threads of each one-warp-a-row fused backward (by stored dtype, then vectors per lane): the
/// `__launch_bounds__` of norm_loss.cu's NORM_BWD_FUSED lines, as many warps as keep the row
/// and the column sums in registers without spills (ptxas: 128 registers at 512 threads).
const BWD_THREADS: [[u32; 4]; 2] = [[512, 512, 384, 256], [512, 512, 512, 384]];

/// The default kernels of one norm (LayerNorm or RMSNorm), each by stored dtype ([`stored`]),
/// the one-warp-a-row ones then by vectors per lane.
struct NormKernels {
    fwd: [[Kernel; 4]; 2],
    fwd_wide: [Kernel; 2],
    bwd: [[Kernel; 4]; 2],
    bwd_wide: [Kernel; 2],
}

const LAYER_NORM: NormKernels = NormKernels {
    fwd: [
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
    ],
    fwd_wide: [Kernel::LayerNormFwdWideF32, Kernel::LayerNormFwdWideBf16],
    bwd: [
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
    ],
    bwd_wide: [Kernel::LayerNormBwdWideF32, Kernel::LayerNormBwdWideBf16],
};

const RMS_NORM: NormKernels = NormKernels {
    fwd: [
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
    ],
    fwd_wide: [Kernel::RmsNormFwdWideF32, Kernel::RmsNormFwdWideBf16],
    bwd: [
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
    ],
    bwd_wide: [Kernel::RmsNormBwdWideF32, Kernel::RmsNormBwdWideBf16],
};

/// How a default kernel holds a row: one warp, each lane `v` (1..=4) vectors of 8 (`Lane(v)`),
/// or a row group of `w` (2..=8) warps, each thread [`WIDE_VECS`] vectors (`Group(w)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RowSplit {
    Lane(usize),
    Group(usize),
}

/// One default kernel's launch: `threads` a block, working on `rows_at_once` rows at a time
/// (one a warp or row group), and for a wide kernel the warps of a row group (its `row_warps`
/// argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    kernel: Kernel,
    threads: u32,
    rows_at_once: usize,
    row_warps: Option<usize>,
}

/// The launch of a wide kernel whose row groups have `w` warps: as many groups as fit
/// [`WIDE_THREADS`].
fn wide_plan(kernel: Kernel, w: usize) -> Plan {
    let groups = WIDE_THREADS / (32 * w);
    Plan {
        kernel,
        threads: (32 * w * groups) as u32,
        rows_at_once: groups,
        row_warps: Some(w),
    }
}

/// The forward's launch for rows held as `split`, operands stored as `s` ([`stored`]).
fn fwd_plan(table: &NormKernels, s: usize, split: RowSplit) -> Plan {
    match split {
        RowSplit::Lane(v) => Plan {
            kernel: table.fwd[s][v - 1],
            threads: FWD_THREADS,
            rows_at_once: FWD_ROWS_PER_BLOCK,
            row_warps: None,
        },
        RowSplit::Group(w) => wide_plan(table.fwd_wide[s], w),
    }
}

/// The fused backward's launch for rows held as `split`, operands stored as `s`.
fn bwd_plan(table: &NormKernels, s: usize, split: RowSplit) -> Plan {
    match split {
        RowSplit::Lane(v) => Plan {
            kernel: table.bwd[s][v - 1],
            threads: BWD_THREADS[s][v - 1],
            rows_at_once: BWD_THREADS[s][v - 1] as usize / 32,
            row_warps: None,
        },
        RowSplit::Group(w) => wide_plan(table.bwd_wide[s], w),
    }
}

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

/// How the default kernels hold a row of `d` elements, when they take it: a multiple of 8 up
/// to [`MAX_DIM`], every operand (`ptrs`) 16-byte aligned.
fn split(d: usize, ptrs: &[u64]) -> Option<RowSplit> {
    let ok = d > 0 && d.is_multiple_of(8) && d <= MAX_DIM && ptrs.iter().all(|p| p % 16 == 0);
    ok.then(|| {
        if d <= LANE_DIM {
            RowSplit::Lane(d.div_ceil(256))
        } else {
            RowSplit::Group(d.div_ceil(256 * WIDE_VECS))
        }
    })
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

/// A norm forward: `multirow` (one warp a row, or a row group for rows wider than
/// [`LANE_DIM`]) where it is chosen and takes the rows, else `warp`.
fn forward(be: &mut CudaBackend, f: &NormFwd) -> Result<()> {
    let mut ptrs = vec![f.x.ptr, f.y.ptr, f.w.ptr];
    ptrs.extend(f.bias.map(|b| b.ptr));
    let multirow = be.variants.norm_fwd == NormFwdKernel::Multirow;
    if let Some(split) = split(f.d, &ptrs).filter(|_| multirow) {
        let table = if f.mean.is_some() {
            &LAYER_NORM
        } else {
            &RMS_NORM
        };
        let plan = fwd_plan(table, stored(f.x), split);
        let mut args = f.args();
        args.extend(plan.row_warps.map(|w| Arg::I32(w as i32)));
        let grid = (f.rows.div_ceil(plan.rows_at_once) as u32, 1, 1);
        return be.launch(plan.kernel, grid, (plan.threads, 1, 1), 0, &args);
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

/// Runs the fused backward (dx, dw, db) when it is chosen and takes the rows (`Ok(true)`): the
/// row kernel (one warp or row group a row) over at most [`MAX_BLOCKS`] bands of rows, then
/// `norm_bwd_fused_finish` adding the bands' partial rows into dw (and db).
fn fused_backward(be: &mut CudaBackend, f: &NormBwd) -> Result<bool> {
    let one_dtype = f.dy.dtype == f.x.dtype && f.dx.dtype == f.x.dtype;
    if be.variants.norm_bwd != NormBwdKernel::Fused || !one_dtype {
        return Ok(false);
    }
    let Some(split) = split(f.d, &[f.dy.ptr, f.x.ptr, f.dx.ptr, f.w.ptr]) else {
        return Ok(false);
    };
    let table = if f.mean.is_some() {
        &LAYER_NORM
    } else {
        &RMS_NORM
    };
    let plan = bwd_plan(table, stored(f.x), split);
    let (blocks, band) = bands(f.rows, plan.rows_at_once);
    let sums = 1 + usize::from(f.db.is_some());
    let part = be.scratch(sums * blocks * f.d * 4)?;
    let mut args = f.operands();
    args.extend([Arg::Ptr(part), n(f.rows), n(f.d), n(band)]);
    args.extend(plan.row_warps.map(|w| Arg::I32(w as i32)));
    args.push(Arg::I32(i32::from(f.accumulate_dx)));
    if f.mean.is_some() {
        args.push(Arg::I32(i32::from(f.db.is_some())));
    }
    let grid = (blocks as u32, 1, 1);
    be.launch(plan.kernel, grid, (plan.threads, 1, 1), 0, &args)?;
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

/// A fused backward's blocks and rows a block (its band) for `rows` rows, a block working on
/// `at_once` rows at a time: at most [`MAX_BLOCKS`], each with a row per warp or row group at
/// least; bands of equal rows (the last shorter), none empty.
fn bands(rows: usize, at_once: usize) -> (usize, usize) {
    let blocks = rows.div_ceil(at_once).min(MAX_BLOCKS);
    if blocks == 0 {
        return (0, 0);
    }
    let band = rows.div_ceil(blocks);
    (rows.div_ceil(band), band)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_the_default_kernels_take() {
        use RowSplit::{Group, Lane};
        assert_eq!(split(768, &[0, 16, 4096]), Some(Lane(3)));
        assert_eq!(split(1024, &[0]), Some(Lane(4)));
        assert_eq!(split(64, &[0]), Some(Lane(1)));
        assert_eq!(split(1000, &[0]), Some(Lane(4)));
        assert_eq!(split(1032, &[0]), Some(Group(2)), "past one warp");
        assert_eq!(split(1536, &[0]), Some(Group(2)));
        assert_eq!(split(2048, &[0]), Some(Group(2)));
        assert_eq!(split(3000, &[0]), Some(Group(3)));
        assert_eq!(split(4096, &[0, 16]), Some(Group(4)));
        assert_eq!(split(8192, &[0]), Some(Group(8)));
        assert_eq!(split(8200, &[0]), None, "too wide");
        assert_eq!(split(20, &[0]), None, "not a multiple of 8");
        assert_eq!(split(2052, &[0]), None, "not a multiple of 8");
        assert_eq!(split(768, &[8]), None, "unaligned");
        assert_eq!(split(4096, &[0, 8]), None, "unaligned");
    }

    #[test]
    fn wide_launches_fit_their_kernels() {
        for d in (LANE_DIM + 8..=MAX_DIM).step_by(8) {
            let Some(RowSplit::Group(w)) = split(d, &[0]) else {
                panic!("{d} is not split over warps");
            };
            for s in 0..2 {
                for table in [&LAYER_NORM, &RMS_NORM] {
                    for plan in [
                        fwd_plan(table, s, RowSplit::Group(w)),
                        bwd_plan(table, s, RowSplit::Group(w)),
                    ] {
                        // The group's threads hold the row; groups fill the block, which its
                        // __launch_bounds__ allows, with a named barrier each (1..=15).
                        assert!(256 * WIDE_VECS * w >= d && 256 * WIDE_VECS * (w - 1) < d);
                        assert_eq!(plan.threads as usize, 32 * w * plan.rows_at_once);
                        assert!(plan.threads as usize <= WIDE_THREADS);
                        assert!((1..=15).contains(&plan.rows_at_once));
                        assert_eq!(plan.row_warps, Some(w));
                    }
                }
            }
        }
        let llama = fwd_plan(&RMS_NORM, 1, RowSplit::Group(2));
        assert_eq!(
            (llama.threads, llama.rows_at_once),
            (256, 4),
            "d 2048: 4 rows of 2 warps"
        );
        let wide = bwd_plan(&RMS_NORM, 1, RowSplit::Group(8));
        assert_eq!(
            (wide.threads, wide.rows_at_once),
            (256, 1),
            "d 8192: 1 row of 8 warps"
        );
        let odd = bwd_plan(&LAYER_NORM, 0, RowSplit::Group(3));
        assert_eq!(
            (odd.threads, odd.rows_at_once),
            (192, 2),
            "d 3000: 2 rows of 3 warps"
        );
    }

    #[test]
    fn bands_cover_the_rows() {
        assert_eq!(bands(0, 4), (0, 0));
        assert_eq!(bands(3, 4), (1, 3));
        assert_eq!(bands(37, 2), (19, 2), "one band a row pair, the last a row");
        assert_eq!(bands(4099, 16), (125, 33), "125 bands of 33, the last of 7");
        assert_eq!(bands(16_384, 4), (128, 128));
        for (rows, at_once) in [(1, 1), (37, 2), (1000, 3), (33_000, 16), (16_385, 1)] {
            let (blocks, band) = bands(rows, at_once);
            assert!(blocks <= MAX_BLOCKS && band * blocks >= rows && band * (blocks - 1) < rows);
        }
    }
}
