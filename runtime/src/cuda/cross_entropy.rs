//! The fused cross-entropy of an unsplit vocabulary (`Op::CrossEntropy`) on the GPU
//! (kernels/cross_entropy.cu): one block per row reads the logits once for the row's max, sum of
//! exponentials and target logit, writes the row's loss to the reduction scratch (f64, sized by
//! `storage::program_needs`) and overwrites the row with dlogits in place; a second one-block
//! kernel adds the scaled row losses into the loss in a fixed order, so the loss is the same
//! every run. Logits are f32 or bf16; the loss is f32.
use super::dispatch::{n, p, Bound};
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

/// Run `op` (a `CrossEntropy`) on its bound buffers: logits (also the dlogits output), targets,
/// and the loss it accumulates into.
pub(super) fn run(be: &mut CudaBackend, b: &Bound, op: &Op, scalars: &StepScalars) -> Result<()> {
    let Op::CrossEntropy { vocab, scale } = op else {
        return Err(b.err("the fused cross-entropy kernel runs only Op::CrossEntropy"));
    };
    let v = b.dim("vocab", *vocab)?;
    let logits = b.float_in(0)?;
    let targets = b.i32_in(1)?;
    let rows = b.rows(logits, "logits", v)?;
    b.expect(targets, "targets", rows)?;
    let (dlogits, loss) = (b.float_out(0)?, b.f32_out(1)?);
    if dlogits.ptr != logits.ptr || dlogits.len != logits.len {
        return Err(b.err(format!(
            "dlogits (buffer {}) must be the logits buffer (buffer {}): the op writes the \
             gradient over the logits",
            dlogits.id.0, logits.id.0
        )));
    }
    b.expect(loss, "loss", 1)?;
    let row_loss = be.scratch(rows * 8)?;
    let (kernel, per_vector) = if logits.is_bf16() {
        ("cross_entropy_rows_bf16", 8)
    } else {
        ("cross_entropy_rows_f32", 4)
    };
    // fp16: the loss gradient carries the step's loss scale; the loss does not.
    let grad_scale = (*scale * scalars.loss_scale.unwrap_or(1.0)) as f32;
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
    be.launch(
        "cross_entropy_loss_sum",
        (1, 1, 1),
        (SUM_THREADS, 1, 1),
        0,
        &[Arg::Ptr(row_loss), p(loss), n(rows), Arg::F64(*scale)],
    )
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
}
