//! parc's FP8 GEMM kernel (`kernels/fp8_gemm.cu`) for the recipes whose scales cuBLASLt runs
//! no algorithm for on Hopper: rowwise (a dequantization factor per line of each operand:
//! cuBLASLt's outer-vector scales) and blockwise (a factor per `1 × block` tile of tokens and
//! per `block × block` square of a weight, along K in groups of `block`). Tensorwise runs on
//! cuBLASLt (`fp8::run`).
//!
//! The operands are what `fp8::run` quantized into the FP8 scratch (K-major `[lines, ld]`, K
//! padded with zeros) with their factors in the scratch's layouts (`Fp8ScaleLayout`, written by
//! `fp8_scales`), read as they lie. The kernel sums each K group of 128 elements (or all of K,
//! where the factors do not change along it) in f32 and multiplies by the row's and column's
//! factors: blockwise needs `block` a multiple of 128, the kernel's step along K.
use super::gemm::{Gemm, Output};
use super::kernel::Kernel;
use super::tma::{self, Elem};
use super::variants::Fp8GemmKernel;
use super::{Arg, CudaBackend};
use crate::error::{Result, RuntimeError};
use cudarc::driver::sys::CUdeviceptr;
use parc_compiler::fp8::cuda_runs_block;
use parc_compiler::ir::fp8::{Fp8Format, Fp8Scaling};
use parc_compiler::memplan::{Fp8OperandScratch, Fp8ScaleLayout};

/// The kernel's tile of C (rows, and columns but for the wide kernels') and its step along K
/// (FP8 elements: 128 bytes).
const TILE: u64 = 128;
const STEP_K: u64 = parc_compiler::fp8::CUDA_BLOCK;

/// Which of fp8_gemm.cu's kernels runs a GEMM: factors constant along K in 128 × 128 tiles
/// (`lines`) or 128 × 256 tiles (`wide`, `Fp8GemmKernel::Wide`), or folded K group by K group
/// (`blocks`, 128 × 128).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    Lines,
    Wide,
    Blocks,
}

impl Form {
    /// The columns of C a tile spans.
    fn tile_cols(self) -> u64 {
        match self {
            Form::Wide => 2 * TILE,
            Form::Lines | Form::Blocks => TILE,
        }
    }

    /// Dynamic shared memory (fp8_gemm.cu's FG_STAGES and FG_STAGE_BYTES): alignment, the
    /// ring's stages of P's and Q's tiles, the pipeline's barriers.
    fn smem(self) -> u32 {
        let stages = if self == Form::Wide { 4 } else { 5 };
        let stage = (TILE + self.tile_cols()) * STEP_K;
        (1024 + stages * stage + 16 * stages + 32) as u32
    }
}

/// Whether parc's kernel runs the FP8 GEMMs of `scaling` (cuBLASLt runs tensorwise).
pub(super) fn runs(scaling: Fp8Scaling) -> bool {
    scaling != Fp8Scaling::Tensorwise
}

/// `fp8_scales`' layout code of `block × block` squares, and the kernel's code for squares
/// read once per 128-line tile (`Fp8GemmKernel::Tiles`; each block spans whole tiles, as
/// tiles start at multiples of 128 and blocks are multiples of 128).
const SQUARES: i32 = 3;
const SQUARES_PER_TILE: i32 = 4;

/// An operand's `fp8_scales` layout code and its block (1 where it has none), as both GEMM
/// paths read its factors.
pub(super) fn scale_layout(s: &Fp8OperandScratch) -> (i32, u64) {
    match s.layout {
        Fp8ScaleLayout::Scalar => (0, 1),
        Fp8ScaleLayout::PerLine => (1, 1),
        Fp8ScaleLayout::LineTiles { block } => (2, block),
        Fp8ScaleLayout::Squares { block } => (SQUARES, block),
    }
}

/// One quantized operand as the kernel reads it: its scratch layout, its FP8 values and its
/// dequantization factors.
#[derive(Clone, Copy)]
pub(super) struct Quantized<'a> {
    pub s: &'a Fp8OperandScratch,
    pub q: CUdeviceptr,
    pub factors: CUdeviceptr,
}

impl Quantized<'_> {
    /// The factors' arguments: their pointer, then [`layout_args`]; with `per_tile`, squares
    /// as layout 4 (one factor over a 128-line tile: `fg_fold` loads it once).
    fn args(&self, per_tile: bool) -> [Arg; 5] {
        let (code, block, kg4) = layout_args(self.s);
        let code = if per_tile && code == SQUARES {
            SQUARES_PER_TILE
        } else {
            code
        };
        [
            Arg::Ptr(self.factors),
            Arg::I32(code),
            Arg::I64(self.s.lines as i64),
            Arg::I64(block as i64),
            Arg::I64(kg4 as i64),
        ]
    }
}

/// How the kernel finds an operand's factors (`FgScales`): the layout's code and block
/// (`scale_layout`), and the stride of a square's row of K groups (`round4(⌈K / block⌉)`).
fn layout_args(s: &Fp8OperandScratch) -> (i32, u64, u64) {
    let (code, block) = scale_layout(s);
    let kg4 = match s.layout {
        Fp8ScaleLayout::Squares { block } => s.k.div_ceil(block).next_multiple_of(4),
        _ => 0,
    };
    (code, block, kg4)
}

/// The kernel for operand formats `(p, q)` in `form`.
fn kernel(p: Fp8Format, q: Fp8Format, form: Form) -> Kernel {
    use Form::{Blocks, Lines, Wide};
    use Fp8Format::{E4m3, E5m2};
    match (p, q, form) {
        (E4m3, E4m3, Lines) => Kernel::Fp8GemmE4e4Lines,
        (E4m3, E5m2, Lines) => Kernel::Fp8GemmE4e5Lines,
        (E5m2, E4m3, Lines) => Kernel::Fp8GemmE5e4Lines,
        (E5m2, E5m2, Lines) => Kernel::Fp8GemmE5e5Lines,
        (E4m3, E4m3, Wide) => Kernel::Fp8GemmE4e4Wide,
        (E4m3, E5m2, Wide) => Kernel::Fp8GemmE4e5Wide,
        (E5m2, E4m3, Wide) => Kernel::Fp8GemmE5e4Wide,
        (E5m2, E5m2, Wide) => Kernel::Fp8GemmE5e5Wide,
        (E4m3, E4m3, Blocks) => Kernel::Fp8GemmE4e4Blocks,
        (E4m3, E5m2, Blocks) => Kernel::Fp8GemmE4e5Blocks,
        (E5m2, E4m3, Blocks) => Kernel::Fp8GemmE5e4Blocks,
        (E5m2, E5m2, Blocks) => Kernel::Fp8GemmE5e5Blocks,
    }
}

/// The kernel's steps along K a group of `scaling`'s factors spans (None: they do not change
/// along K), or why the kernel cannot run it.
fn fold_steps(scaling: Fp8Scaling) -> std::result::Result<Option<u64>, String> {
    match scaling {
        Fp8Scaling::Blockwise { block } if cuda_runs_block(block) => Ok(Some(block / STEP_K)),
        Fp8Scaling::Blockwise { block } => Err(format!(
            "blockwise({block}) FP8 GEMMs do not run on the CUDA backend: its FP8 kernel scales \
             K in steps of {STEP_K}, so the block must be a multiple of {STEP_K}. Use `fp8 = \
             blockwise` (block_size 128), rowwise or tensorwise, or the CPU backend"
        )),
        Fp8Scaling::Rowwise | Fp8Scaling::Tensorwise => Ok(None),
    }
}

impl CudaBackend {
    /// Runs FP8 GEMM `g` (`fp8::run`'s, of op `name` under `scaling`) on parc's kernel: C (g's
    /// D, row-major `[p lines, q lines]`) from operand `p` (g's B) and `q` (g's A), both padded
    /// to the same K (`fp8::run` checks).
    pub(super) fn fp8_scaled_gemm(
        &mut self,
        name: &str,
        g: &Gemm,
        scaling: Fp8Scaling,
        (p, q): (Quantized, Quantized),
    ) -> Result<()> {
        let unsupported = |what: String| RuntimeError::Unsupported(format!("{name}: {what}"));
        if !self.hopper {
            return Err(unsupported(format!(
                "{} FP8 GEMMs run on Hopper GPUs (compute capability 9.0) only: parc's FP8 \
                 kernel uses Hopper's warpgroup MMA. Use `fp8 = tensorwise`, or the CPU backend",
                scaling.name()
            )));
        }
        let fold = fold_steps(scaling).map_err(unsupported)?;
        let (mr, nr) = (p.s.lines, q.s.lines);
        if mr > i32::MAX as u64 || nr > i32::MAX as u64 || p.s.ld > i32::MAX as u64 {
            return Err(unsupported(format!(
                "an FP8 GEMM of {mr} x {nr} over {} is larger than parc's FP8 kernel takes",
                p.s.ld
            )));
        }
        let variant = self.variants.fp8_gemm;
        let form = match fold {
            Some(_) => Form::Blocks,
            None if variant == Fp8GemmKernel::Wide => Form::Wide,
            None => Form::Lines,
        };
        let map = |o: &Quantized, tile_lines: u64| {
            let (ld, lines) = (o.s.ld, o.s.lines);
            let boxes = (STEP_K as u32, tile_lines as u32);
            tma::matrix(Elem::Fp8, o.q, (ld, lines, ld), boxes, true)
        };
        let maps = [map(&p, TILE)?, map(&q, form.tile_cols())?];
        let mut args = vec![
            Arg::I32(mr as i32),
            Arg::I32(nr as i32),
            Arg::I32(p.s.ld.div_ceil(STEP_K) as i32),
            Arg::I32(fold.unwrap_or(1) as i32),
            Arg::I64(g.ldc),
            Arg::F32(g.beta),
            Arg::Ptr(g.c),
            Arg::Ptr(g.c_in.unwrap_or(0)),
            Arg::I32(i32::from(g.out == Output::F32)),
        ];
        // Only the columns' factors are read per tile: the rows' are two loads a fold.
        args.extend(p.args(false));
        args.extend(q.args(variant != Fp8GemmKernel::Columns));
        let kernel = kernel(p.s.operand.format, q.s.operand.format, form);
        let tiles = (mr.div_ceil(TILE) * nr.div_ceil(form.tile_cols())) as usize;
        let stream = self.stream.cu_stream();
        self.blas.timer_start(stream)?;
        self.launch_persistent(kernel, tiles, form.smem(), &maps, &args)?;
        self.blas.timer_stop(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_fold_in_whole_steps_along_k() {
        assert_eq!(fold_steps(Fp8Scaling::Rowwise), Ok(None));
        assert_eq!(
            fold_steps(Fp8Scaling::Blockwise { block: 128 }),
            Ok(Some(1))
        );
        assert_eq!(
            fold_steps(Fp8Scaling::Blockwise { block: 256 }),
            Ok(Some(2))
        );
        let err = fold_steps(Fp8Scaling::Blockwise { block: 64 }).unwrap_err();
        assert!(
            err.contains("blockwise(64)") && err.contains("multiple of 128"),
            "{err}"
        );
    }

    /// A blockwise forward of 150 rows, 200 inputs into 136 outputs: x in 1 × 128 tiles, W in
    /// 128 × 128 squares whose rows of K groups are padded to 4 (as `fp8_scales` lays them).
    #[test]
    fn factors_are_found_in_the_scratch_layouts() {
        use parc_compiler::ir::op::Op;
        let fp8 = parc_compiler::ir::fp8::Fp8Gemm::current(
            Fp8Scaling::Blockwise { block: 128 },
            Fp8Format::E4m3,
        );
        let op = Op::Matmul {
            in_dim: 200,
            out_dim: 136,
            bias: false,
            act: None,
            residual: false,
            swiglu: false,
            fp8: Some(fp8),
        };
        let scratch = parc_compiler::memplan::fp8_gemm_scratch(&op, 150).unwrap();
        let [x, w] = scratch.operands;
        assert_eq!((x.lines, x.ld, w.lines, w.ld), (150, 256, 136, 256));
        assert_eq!(layout_args(&x), (2, 128, 0));
        assert_eq!(layout_args(&w), (3, 128, 4));
        assert_eq!(
            w.scales,
            4 * 2,
            "two line blocks of a padded row of groups each"
        );
    }

    /// The shared memory of fp8_gemm.cu's rings: 5 stages of two 16 KB tiles, or 4 of a 16 KB
    /// and a 32 KB tile, within the 227 KB a Hopper block may opt into.
    #[test]
    fn each_form_has_its_ring() {
        assert_eq!(Form::Lines.smem(), 1024 + 5 * 32768 + 80 + 32);
        assert_eq!(Form::Blocks.smem(), Form::Lines.smem());
        assert_eq!(Form::Wide.smem(), 1024 + 4 * 49152 + 64 + 32);
        assert!(Form::Wide.smem() <= 227 * 1024);
    }

    #[test]
    fn each_pair_of_formats_has_its_kernels() {
        use Fp8Format::{E4m3, E5m2};
        let mut all = Vec::new();
        for p in [E4m3, E5m2] {
            for q in [E4m3, E5m2] {
                for form in [Form::Lines, Form::Wide, Form::Blocks] {
                    all.push(kernel(p, q, form));
                }
            }
        }
        all.sort_by_key(|k| k.symbol());
        all.dedup();
        assert_eq!(all.len(), 12);
    }
}
