//! Which element types each operand of each op accepts: the dtype half of the op contract
//! (`op`). The verifier checks every compute instruction against it, and the lowering's storage
//! pass (`lower::storage`) uses it to decide which buffers a bf16 run stores in bf16.
//!
//! Every operand is in one [`StorageClass`]:
//! - `Tokens`: token ids and targets, i32.
//! - `Fp32`: parameters and their gradients, norm statistics (`mean`, `rstd`), the attention
//!   `lse`, the cross-entropy reductions and loss, and everything the clipping and optimizer ops
//!   touch. Always f32: these carry precision a bf16 copy would lose (PyTorch autocast and llm.c
//!   keep them fp32 too).
//! - `Float`: activation-like tensors, f32 or bf16. An op reads a bf16 operand widened exactly
//!   to f32, computes in f32 and rounds each bf16 output element to the nearest bf16 (ties to
//!   even) once, when it writes it; an accumulating output is read, added to and rounded.
//!
//! `Copy`, `CopyRange`, `SplitColumns`, `ConcatColumns` and `Zero` take any float type on either
//! side (a copy between f32 and bf16 converts); their operands are `Float`.
use super::op::Op;
use super::DType;

/// The element types an operand accepts (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageClass {
    Tokens,
    Fp32,
    Float,
}

impl StorageClass {
    /// Whether a buffer of `dtype` may be bound to an operand of this class.
    pub fn accepts(self, dtype: DType) -> bool {
        match self {
            StorageClass::Tokens => dtype == DType::I32,
            StorageClass::Fp32 => dtype == DType::F32,
            StorageClass::Float => matches!(dtype, DType::F32 | DType::Bf16),
        }
    }
    /// What the class accepts, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            StorageClass::Tokens => "i32",
            StorageClass::Fp32 => "f32",
            StorageClass::Float => "f32 or bf16",
        }
    }
}

use StorageClass::{Float, Fp32, Tokens};

/// `base` followed by `extra` when `flag` is set (optional bias / momentum operands).
fn with(base: &[StorageClass], flag: bool, extra: StorageClass) -> Vec<StorageClass> {
    let mut classes = base.to_vec();
    if flag {
        classes.push(extra);
    }
    classes
}

/// The classes of `op`'s inputs and of its outputs, in the order `op` documents them.
pub fn operand_classes(op: &Op) -> (Vec<StorageClass>, Vec<StorageClass>) {
    match op {
        Op::Embedding { .. } => (vec![Tokens, Fp32], vec![Float]),
        Op::EmbeddingBwd { .. } => (vec![Tokens, Float], vec![Fp32]),
        Op::PositionAdd { .. } => (vec![Float, Fp32], vec![Float]),
        Op::PositionAddBwd { .. } => (vec![Float], vec![Fp32]),
        Op::LayerNorm { bias, .. } => (with(&[Float, Fp32], *bias, Fp32), vec![Float, Fp32, Fp32]),
        Op::LayerNormBwd { bias, .. } => (
            vec![Float, Float, Fp32, Fp32, Fp32],
            with(&[Float, Fp32], *bias, Fp32),
        ),
        Op::RmsNorm { .. } => (vec![Float, Fp32], vec![Float, Fp32]),
        Op::RmsNormBwd { .. } => (vec![Float, Float, Fp32, Fp32], vec![Float, Fp32]),
        Op::Matmul {
            bias,
            act,
            residual,
            ..
        } => (
            with(&with(&[Float, Fp32], *bias, Fp32), *residual, Float),
            with(&[Float], act.is_some(), Float),
        ),
        Op::MatmulBwdData { act_grad, .. } => {
            (with(&[Float, Fp32], act_grad.is_some(), Float), vec![Float])
        }
        Op::MatmulBwdWeight { bias, .. } => (vec![Float, Float], with(&[Fp32], *bias, Fp32)),
        Op::Rope { .. } | Op::RopeBwd { .. } => (vec![Float], vec![Float]),
        Op::Attention { packed: false, .. } => (vec![Float; 3], vec![Float, Fp32]),
        Op::Attention { packed: true, .. } => (vec![Float], vec![Float, Fp32]),
        Op::AttentionBwd { packed: false, .. } => (
            vec![Float, Float, Float, Float, Float, Fp32],
            vec![Float; 3],
        ),
        Op::AttentionBwd { packed: true, .. } => (vec![Float, Float, Float, Fp32], vec![Float]),
        Op::Activation { .. } => (vec![Float], vec![Float]),
        Op::ActivationBwd { .. } => (vec![Float; 2], vec![Float]),
        Op::SwiGlu => (vec![Float; 2], vec![Float]),
        Op::SwiGluBwd => (vec![Float; 3], vec![Float; 2]),
        Op::Add => (vec![Float; 2], vec![Float]),
        Op::Scale { .. } | Op::Copy | Op::CopyRange { .. } => (vec![Float], vec![Float]),
        Op::Zero => (vec![], vec![Float]),
        Op::SplitColumns { widths } => (vec![Float], vec![Float; widths.len()]),
        Op::ConcatColumns { widths } => (vec![Float; widths.len()], vec![Float]),
        Op::CrossEntropy { .. } => (vec![Float, Tokens], vec![Float, Fp32]),
        Op::CeMax { .. } => (vec![Float], vec![Fp32]),
        Op::CeSumExp { .. } => (vec![Float, Fp32], vec![Fp32]),
        Op::CeTargetLogit { .. } => (vec![Float, Tokens], vec![Fp32]),
        Op::CeLoss { .. } => (vec![Fp32; 3], vec![Fp32]),
        Op::CeGrad { .. } => (vec![Float, Tokens, Fp32, Fp32], vec![Float]),
        Op::SumSquares => (vec![Fp32], vec![Fp32]),
        Op::ClipCoef { .. } => (vec![Fp32], vec![Fp32]),
        Op::AdamW { .. } => (vec![Fp32; 2], vec![Fp32; 3]),
        Op::Sgd { momentum, .. } => (vec![Fp32; 2], with(&[Fp32], *momentum != 0.0, Fp32)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_accept_exactly_their_types() {
        assert!(Tokens.accepts(DType::I32) && !Tokens.accepts(DType::F32));
        assert!(Fp32.accepts(DType::F32) && !Fp32.accepts(DType::Bf16));
        assert!(Float.accepts(DType::F32) && Float.accepts(DType::Bf16));
        assert!(!Float.accepts(DType::I32));
    }

    #[test]
    fn optional_operands_follow_their_flags() {
        let (ins, outs) = operand_classes(&Op::LayerNorm {
            dim: 4,
            eps: 1e-5,
            bias: true,
        });
        assert_eq!(ins, vec![Float, Fp32, Fp32]);
        assert_eq!(outs, vec![Float, Fp32, Fp32]);
        let (ins, outs) = operand_classes(&Op::Sgd {
            momentum: 0.0,
            weight_decay: 0.0,
        });
        assert_eq!((ins.len(), outs.len()), (2, 1));
    }
}
