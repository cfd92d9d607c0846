//! The loss family on the GPU: the pieces of a vocabulary-split cross-entropy
//! (kernels/norm_loss.cu: `CeMax`, `CeSumExp`, `CeTargetLogit`, `CeLoss`, `CeGrad`), and the
//! fused cross-entropy of an unsplit vocabulary (`Op::CrossEntropy`,
//! kernels/cross_entropy.cu): the logits are read for each row's max, sum of exponentials and
//! target logit, the row's loss goes to the reduction scratch (f64, sized by
//! `storage::program_needs`) and the row is overwritten with dlogits in place; a second
//! one-block kernel adds the scaled row losses into the loss in a fixed order, so the loss is
//! the same every run. Logits are f32 or bf16; the loss is f32.
//!
//! Two kernels (variant `cross_entropy`, `PARC_CROSS_ENTROPY_KERNEL`): `staged`, the default,
//! persistent CTAs (one per SM) that copy each row into shared memory with cp.async, the next
//! row's copy in flight while they work on this one, so each logit crosses HBM once each way,
//! in few instructions an element (each exponential one MUFU ex2, a shuffle-only block merge,
//! no edge tests in the loops: kernels/cross_entropy.cu) so that the SM's arithmetic hides
//! under the row's HBM traffic (measured on one H200 at 1.77 ms for GPT-2 124M's 32,768 ×
//! 50,257 bf16 logits, 3.71 TB/s); and `rows`, a block per row that reads the row from global
//! memory twice (the second time hoping for L2; 3.73 ms there). `staged` needs the logits on a
//! 16-byte boundary and a row (plus 16 bytes) within a block's shared memory — GPT-2's 50,257
//! columns take two buffers in bf16 (2 × 98 KB) and one in f32 — and runs `rows` otherwise.
use super::args::{fv, n, p, Bound, Limits};
use super::device::DeviceLimits;
use super::kernel::Kernel;
use super::variants::CrossEntropyKernel;
use super::{Arg, CudaBackend};
use crate::backend::StepScalars;
use crate::error::Result;
use parc_compiler::ir::op::Op;

/// Threads of the loss-sum block.
const SUM_THREADS: u32 = 1024;

/// Threads of a row's block: about four 16-byte vectors a thread (`per_vector` elements each),
/// a whole number of warps, from 64 to 1024.
fn row_threads(vocab: usize, per_vector: usize) -> u32 {
    let wanted = vocab.div_ceil(4 * per_vector).next_multiple_of(32);
    wanted.clamp(64, 1024) as u32
}

/// Threads of a block per row (`ce_max`, `ce_sum_exp`) and of `ce_loss`'s one block.
const BLOCK_THREADS: u32 = 256;

/// Run an op of the loss family: the fused cross-entropy, or a piece of the vocabulary-split
/// one (kernels/norm_loss.cu): the row max, the sum of exponentials, the target logit, the
/// loss and the gradient, each over this rank's vocabulary shard.
pub(super) fn run(be: &mut CudaBackend, b: &Bound, scalars: &StepScalars) -> Result<()> {
    match b.op {
        Op::CrossEntropy { vocab, scale } => fused(be, b, *vocab, *scale, scalars),
        Op::CeMax { vocab_local } | Op::CeSumExp { vocab_local } => {
            let v = b.launch_dim("vocab_local", *vocab_local)?;
            let logits = b.input(0)?;
            let rows = b.launch_rows(logits, "logits", b.rows)?;
            let out = b.output(0)?;
            let grid = (rows as u32, 1, 1);
            let (kernel, args) = if matches!(b.op, Op::CeMax { .. }) {
                (Kernel::CeMax, vec![fv(logits), p(out), n(v)])
            } else {
                let max = b.input(1)?;
                (Kernel::CeSumExp, vec![fv(logits), p(max), p(out), n(v)])
            };
            be.launch(kernel, grid, (BLOCK_THREADS, 1, 1), 0, &args)
        }
        Op::CeTargetLogit {
            vocab_start,
            vocab_local,
        } => {
            let v = b.launch_dim("vocab_local", *vocab_local)?;
            let (logits, targets) = (b.input(0)?, b.input(1)?);
            let rows = b.launch_rows(logits, "logits", b.rows)?;
            let start = i64::try_from(*vocab_start).map_err(|_| b.err("vocab_start too large"))?;
            let args = [
                fv(logits),
                p(targets),
                p(b.output(0)?),
                n(rows),
                Arg::I64(start),
                n(v),
            ];
            let grid = (rows.div_ceil(256) as u32, 1, 1);
            be.launch(Kernel::CeTargetLogit, grid, (256, 1, 1), 0, &args)
        }
        Op::CeLoss { scale } => {
            let max = b.input(0)?;
            let (sumexp, target) = (b.input(1)?, b.input(2)?);
            let args = [
                p(max),
                p(sumexp),
                p(target),
                p(b.output(0)?),
                n(max.len),
                Arg::F64(*scale),
            ];
            be.launch(Kernel::CeLoss, (1, 1, 1), (BLOCK_THREADS, 1, 1), 0, &args)
        }
        Op::CeGrad {
            vocab_start,
            vocab_local,
            scale,
        } => {
            let v = b.launch_dim("vocab_local", *vocab_local)?;
            let logits = b.input(0)?;
            let rows = b.launch_rows(logits, "logits", b.rows)?;
            let start = i64::try_from(*vocab_start).map_err(|_| b.err("vocab_start too large"))?;
            let args = [
                fv(logits),
                p(b.input(1)?),
                p(b.input(2)?),
                p(b.input(3)?),
                fv(b.output(0)?),
                n(rows),
                Arg::I64(start),
                n(v),
                // fp16: the loss gradient carries the step's loss scale.
                Arg::F32((*scale * scalars.loss_scale.unwrap_or(1.0)) as f32),
            ];
            be.launch_vec(Kernel::CeGrad, logits.len, &args)
        }
        _ => Err(b.err("is not a loss op")),
    }
}

/// The fused cross-entropy over its bound buffers: logits (also the dlogits output), targets,
/// and the loss it accumulates into.
fn fused(
    be: &mut CudaBackend,
    b: &Bound,
    vocab: u64,
    scale: f64,
    scalars: &StepScalars,
) -> Result<()> {
    let v = b.launch_dim("vocab", vocab)?;
    let logits = b.input(0)?;
    let targets = b.input(1)?;
    let rows = b.launch_rows(logits, "logits", b.rows)?;
    let (dlogits, loss) = (b.output(0)?, b.output(1)?);
    if dlogits.ptr != logits.ptr || dlogits.len != logits.len {
        return Err(b.err(format!(
            "dlogits (buffer {}) must be the logits buffer (buffer {}): the op writes the \
             gradient over the logits",
            dlogits.id.0, logits.id.0
        )));
    }
    let row_loss = be.scratch(rows * 8)?;
    // fp16: the loss gradient carries the step's loss scale; the loss does not.
    let grad_scale = (scale * scalars.loss_scale.unwrap_or(1.0)) as f32;
    let staged = be.variants.cross_entropy == CrossEntropyKernel::Staged && logits.ptr % 16 == 0;
    match staged
        .then(|| Staged::plan(rows, v, logits.elem_bytes(), &be.limits))
        .flatten()
    {
        Some(plan) => {
            let kernel = if logits.is_bf16() {
                Kernel::CrossEntropyStagedBf16
            } else {
                Kernel::CrossEntropyStagedF32
            };
            be.allow_shared_memory(kernel, plan.smem)?;
            be.launch(
                kernel,
                (plan.grid, 1, 1),
                (plan.threads, 1, 1),
                plan.smem,
                &[
                    p(logits),
                    p(targets),
                    Arg::Ptr(row_loss),
                    n(rows),
                    n(v),
                    Arg::F32(grad_scale),
                    Arg::I32(plan.stages),
                    Arg::I32(plan.stage_chunks),
                ],
            )?;
        }
        None => {
            let (kernel, per_vector) = if logits.is_bf16() {
                (Kernel::CrossEntropyRowsBf16, 8)
            } else {
                (Kernel::CrossEntropyRowsF32, 4)
            };
            be.launch(
                kernel,
                (rows as u32, 1, 1),
                (row_threads(v, per_vector), 1, 1),
                0,
                &[
                    p(logits),
                    p(targets),
                    Arg::Ptr(row_loss),
                    n(v),
                    Arg::F32(grad_scale),
                ],
            )?;
        }
    }
    be.launch(
        Kernel::CrossEntropyLossSum,
        (1, 1, 1),
        (SUM_THREADS, 1, 1),
        0,
        &[Arg::Ptr(row_loss), p(loss), n(rows), Arg::F64(scale)],
    )
}

/// Static shared memory of a staged CTA: the (max, sum) merge's two sets of 2 × 32 floats.
const STAGED_STATIC_SMEM: usize = 512;

/// Shared memory the driver keeps for each resident block (CUDA's reserved 1 KB).
const BLOCK_RESERVED_SMEM: usize = 1024;

/// The launch of `cross_entropy_staged_*` (kernels/cross_entropy.cu, "staged").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Staged {
    /// Row buffers in shared memory: 2 (the next row loads while this one is worked on) or 1.
    stages: i32,
    /// 16-byte chunks a buffer holds: enough for any row, whatever its alignment.
    stage_chunks: i32,
    /// Dynamic shared memory (bytes): the buffers.
    smem: u32,
    threads: u32,
    /// Persistent CTAs: as many as are resident at once, at most one per row.
    grid: u32,
}

impl Staged {
    /// The launch for `rows` rows of `vocab` elements of `elem_bytes` each, or None where a
    /// row does not fit a block's shared memory (then `rows` runs).
    fn plan(rows: usize, vocab: usize, elem_bytes: usize, limits: &DeviceLimits) -> Option<Staged> {
        // A row starting anywhere on the 2- or 4-byte grid touches at most one chunk more
        // than its length needs.
        let stage_chunks = (vocab * elem_bytes).div_ceil(16) + 1;
        let stage_bytes = stage_chunks * 16;
        let room = limits.smem_per_block.checked_sub(STAGED_STATIC_SMEM)?;
        let stages = if 2 * stage_bytes <= room {
            2
        } else if stage_bytes <= room {
            1
        } else {
            return None;
        };
        let smem = stages * stage_bytes;
        // A thread per chunk up to 1024 (the kernel's launch bound), whole warps.
        let threads = stage_chunks.next_multiple_of(32).clamp(64, 1024);
        // Resident CTAs an SM: by threads (2048), registers (the launch bound lets a thread
        // take 64 of the 65,536) and shared memory.
        let by_smem = limits.smem_per_sm / (smem + STAGED_STATIC_SMEM + BLOCK_RESERVED_SMEM);
        let per_sm = (2048 / threads)
            .min(65_536 / (64 * threads))
            .min(by_smem)
            .max(1);
        let grid = rows.min(limits.sms.max(1) * per_sm);
        Some(Staged {
            stages: stages as i32,
            stage_chunks: i32::try_from(stage_chunks).ok()?,
            smem: u32::try_from(smem).ok()?,
            threads: threads as u32,
            grid: u32::try_from(grid).ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_are_whole_warps_within_the_launch_limit() {
        assert_eq!(row_threads(1, 4), 64);
        assert_eq!(row_threads(1000, 4), 64);
        assert_eq!(row_threads(4000, 8), 128);
        // GPT-2's 50304 columns: the most threads a block may have.
        assert_eq!(row_threads(50_304, 8), 1024);
        assert_eq!(row_threads(50_304, 4), 1024);
        for vocab in [7, 129, 5_003, 32_000, 128_256] {
            let t = row_threads(vocab, 8);
            assert!(t.is_multiple_of(32) && (64..=1024).contains(&t));
        }
    }

    const H200: DeviceLimits = DeviceLimits {
        sms: 132,
        smem_per_block: 227 << 10,
        smem_per_sm: 228 << 10,
    };
    const A100: DeviceLimits = DeviceLimits {
        sms: 108,
        smem_per_block: 163 << 10,
        smem_per_sm: 164 << 10,
    };

    #[test]
    fn staged_rows_fit_shared_memory_two_deep_where_they_can() {
        // GPT-2's bf16 logits: two 6,284-chunk buffers (98 KB each), a persistent CTA per SM.
        let gpt2 = Staged::plan(32_768, 50_257, 2, &H200).unwrap();
        assert_eq!(
            gpt2,
            Staged {
                stages: 2,
                stage_chunks: 6_284,
                smem: 201_088,
                threads: 1024,
                grid: 132,
            }
        );
        // The extra chunk is needed where a row's bytes are a multiple of 16 and it starts off
        // a boundary (50,304 bf16 columns starting 2 bytes past one: 6,289 chunks).
        let padded = Staged::plan(1, 50_304, 2, &H200).unwrap();
        assert_eq!(
            padded.stage_chunks as usize,
            (2 + 50_304 * 2usize).div_ceil(16)
        );
        // f32: one buffer of 196 KB; an A100 holds one bf16 row and no f32 row.
        let f32 = Staged::plan(16_384, 50_257, 4, &H200).unwrap();
        assert_eq!((f32.stages, f32.smem, f32.grid), (1, 201_056, 132));
        assert_eq!(Staged::plan(32_768, 50_257, 2, &A100).unwrap().stages, 1);
        assert_eq!(Staged::plan(32_768, 50_257, 4, &A100), None);
        // Llama-3's 128,256 columns do not fit in bf16 either: `rows` runs.
        assert_eq!(Staged::plan(1, 128_256, 2, &H200), None);
    }

    #[test]
    fn staged_launches_stay_within_one_wave_and_the_row_count() {
        for (rows, vocab, elem) in [(7, 1, 4), (19, 37, 2), (3, 50_257, 2), (9, 5_003, 4)] {
            let plan = Staged::plan(rows, vocab, elem, &H200).unwrap();
            assert!(plan.grid as usize <= rows, "{rows}x{vocab}: {plan:?}");
            assert!(plan.threads.is_multiple_of(32) && (64..=1024).contains(&plan.threads));
            assert!(plan.stage_chunks as usize * 16 >= vocab * elem + 16);
            assert_eq!(
                plan.smem as usize,
                plan.stages as usize * plan.stage_chunks as usize * 16
            );
        }
        // Small rows: several CTAs an SM, as many as threads and shared memory allow.
        let small = Staged::plan(1 << 20, 1_000, 2, &H200).unwrap();
        assert_eq!((small.threads, small.grid), (128, 132 * 8));
    }
}
