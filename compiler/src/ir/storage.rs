//! The element types an operand accepts: its [`StorageClass`], which the op table (`table`)
//! gives for every operand of every op. The verifier checks every compute instruction against
//! it, and the lowering's storage pass (`lower::storage`) uses it to decide which buffers a bf16
//! run stores in bf16.
//!
//! Every operand is in one [`StorageClass`]:
//! - `Tokens`: token ids and targets, i32.
//! - `Fp32`: vector parameters (norm weights, biases), every parameter gradient, norm
//!   statistics (`mean`, `rstd`), the attention `lse`, the cross-entropy reductions and loss, and
//!   everything the clipping and optimizer ops touch (master weights, moments). Always f32: these
//!   carry precision a bf16 copy would lose (PyTorch autocast, llm.c and Megatron keep them fp32).
//! - `Float`: activation-like tensors and the weight matrices a GEMM or an embedding lookup reads
//!   (a bf16 run keeps those in bf16 beside the f32 master, `lower::declare_param_buffers`), f32
//!   or bf16. An op reads a bf16 operand widened exactly
//!   to f32, computes in f32 and rounds each bf16 output element to the nearest bf16 (ties to
//!   even) once, when it writes it; an accumulating output is read, added to and rounded.
//!
//! `Copy`, `CopyRange`, `SplitColumns`, `ConcatColumns` and `Zero` take any float type on either
//! side (a copy between f32 and bf16 converts); their operands are `Float`.
use super::fp8::Fp8Format;
use super::DType;

/// The element types an operand accepts (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageClass {
    Tokens,
    Fp32,
    Float,
    /// FP8 bits of this format (`Op::Fp8Quantize`'s outputs and the quantized GEMM inputs).
    Fp8(Fp8Format),
}

impl StorageClass {
    /// Whether a buffer of `dtype` may be bound to an operand of this class.
    pub fn accepts(self, dtype: DType) -> bool {
        match self {
            StorageClass::Tokens => dtype == DType::I32,
            StorageClass::Fp32 => dtype == DType::F32,
            StorageClass::Float => matches!(dtype, DType::F32 | DType::Bf16),
            StorageClass::Fp8(format) => dtype == DType::Fp8(format),
        }
    }
    /// What the class accepts, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            StorageClass::Tokens => "i32",
            StorageClass::Fp32 => "f32",
            StorageClass::Float => "f32 or bf16",
            StorageClass::Fp8(format) => format.name(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use StorageClass::{Float, Fp32, Tokens};

    #[test]
    fn classes_accept_exactly_their_types() {
        assert!(Tokens.accepts(DType::I32) && !Tokens.accepts(DType::F32));
        assert!(Fp32.accepts(DType::F32) && !Fp32.accepts(DType::Bf16));
        assert!(Float.accepts(DType::F32) && Float.accepts(DType::Bf16));
        assert!(!Float.accepts(DType::I32));
    }
}
