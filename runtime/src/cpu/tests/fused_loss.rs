//! The fused cross-entropy (`Op::CrossEntropy`) on the CPU backend: bound in place (dlogits over
//! the logits buffer) it equals the split pieces (`CeMax` … `CeGrad`) bit for bit, with an odd
//! vocabulary, a target at the row's max and one outside the vocabulary; bf16 logits are read
//! widened and dlogits rounded once; the step's loss scale multiplies dlogits, not the loss.
use super::*;
use crate::cpu::memory::{round_bf16, widen_bf16};

const SCALE: f64 = 1.0 / 24.0;

/// Logits (`rows × vocab`, large enough that exp overflows without the max subtracted) and
/// targets: row 0's target holds its max, row 1's is past the vocabulary (no target logit, no
/// one-hot), the rest are inside.
fn case(rows: usize, vocab: usize) -> (Vec<f32>, Vec<i32>) {
    let mut logits = values(rows * vocab, 7, 120.0);
    let targets: Vec<i32> = (0..rows).map(|r| ((r * 37 + 5) % vocab) as i32).collect();
    let mut targets = targets;
    let top = logits[..vocab].iter().copied().fold(f32::MIN, f32::max);
    logits[targets[0] as usize] = top + 1.0;
    targets[1] = vocab as i32;
    (logits, targets)
}

/// (dlogits, loss) of the split pieces run one after another on unsplit logits.
fn pieces(
    logits: &[f32],
    targets: &[i32],
    vocab: usize,
    grad_scale: f64,
    loss0: f32,
) -> Vec<Vec<f32>> {
    let v = vocab as u64;
    let [max, sumexp, target] = ce_pieces(logits, targets, 0, v, None);
    let l = Input::F(logits.to_vec());
    let loss = eval_from(
        &Op::CeLoss { scale: SCALE },
        &[
            Input::F(max.clone()),
            Input::F(sumexp.clone()),
            Input::F(target),
        ],
        &[vec![loss0]],
    )
    .remove(0);
    let dlogits = eval(
        &Op::CeGrad {
            vocab_start: 0,
            vocab_local: v,
            scale: grad_scale,
        },
        &[
            l,
            Input::I(targets.to_vec()),
            Input::F(max),
            Input::F(sumexp),
        ],
        &[logits.len()],
    )
    .remove(0);
    vec![dlogits, loss]
}

/// (dlogits, loss) of the fused op with dlogits bound to the logits buffer (stored as `dtype`).
fn fused(
    logits: &[f32],
    targets: &[i32],
    vocab: usize,
    dtype: DType,
    scalars: &StepScalars,
    loss0: f32,
) -> Vec<Vec<f32>> {
    let mut b = CpuBackend::new();
    let (l, t, loss) = (BufferId(0), BufferId(1), BufferId(2));
    b.alloc(l, &[logits.len() as u64], dtype).unwrap();
    b.write_f32(l, logits).unwrap();
    b.alloc(t, &[targets.len() as u64], DType::I32).unwrap();
    b.write_i32(t, targets).unwrap();
    b.alloc(loss, &[1], DType::F32).unwrap();
    b.write_f32(loss, &[loss0]).unwrap();
    let op = Op::CrossEntropy {
        vocab: vocab as u64,
        scale: SCALE,
    };
    b.compute(&op, &[l, t], &[l, loss], scalars).unwrap();
    vec![b.read_f32(l).unwrap(), b.read_f32(loss).unwrap()]
}

#[test]
fn fused_in_place_equals_the_split_pieces_exactly() {
    for (rows, vocab) in [(6, 37), (4, 1000), (3, 1)] {
        let (logits, targets) = case(rows, vocab);
        let want = pieces(&logits, &targets, vocab, SCALE, 0.75);
        let got = fused(&logits, &targets, vocab, DType::F32, &SCALARS, 0.75);
        assert_eq!(got, want, "rows {rows} vocab {vocab}");
        assert!(got[1][0].is_finite() && got[1][0] > 0.75);
        // Row 1's target is outside the vocabulary: its gradient is the softmax alone.
        assert!(got[0][vocab..2 * vocab].iter().all(|&d| d >= 0.0));
    }
}

#[test]
fn bf16_logits_are_widened_and_dlogits_rounded_once() {
    let (rows, vocab) = (5, 129);
    let (logits, targets) = case(rows, vocab);
    let widened: Vec<f32> = logits.iter().map(|&x| widen_bf16(round_bf16(x))).collect();
    let mut want = pieces(&widened, &targets, vocab, SCALE, 0.0);
    want[0] = want[0].iter().map(|&d| widen_bf16(round_bf16(d))).collect();
    let got = fused(&logits, &targets, vocab, DType::Bf16, &SCALARS, 0.0);
    assert_eq!(got, want);
}

#[test]
fn the_loss_scale_multiplies_dlogits_only() {
    let (rows, vocab) = (4, 50);
    let (logits, targets) = case(rows, vocab);
    let scaled = StepScalars {
        loss_scale: Some(1024.0),
        ..SCALARS
    };
    let want = pieces(&logits, &targets, vocab, SCALE * 1024.0, 0.0);
    let got = fused(&logits, &targets, vocab, DType::F32, &scaled, 0.0);
    assert_eq!(got, want);
    let unscaled = fused(&logits, &targets, vocab, DType::F32, &SCALARS, 0.0);
    assert_eq!(got[1], unscaled[1]);
}

#[test]
fn mismatched_sizes_are_errors_not_panics() {
    let mut b = CpuBackend::new();
    b.alloc(BufferId(0), &[10], DType::F32).unwrap();
    b.alloc(BufferId(1), &[3], DType::I32).unwrap();
    b.alloc(BufferId(2), &[1], DType::F32).unwrap();
    let op = Op::CrossEntropy {
        vocab: 4,
        scale: SCALE,
    };
    let ids = [BufferId(0), BufferId(1)];
    let err = b.compute(&op, &ids, &[BufferId(0), BufferId(2)], &SCALARS);
    assert!(err.unwrap_err().to_string().contains("logits"));
}
