//! The schedule IR: one program per rank of local compute, communication and recompute.
//! `op` holds the compute operations (the backend contract; RoPE's frequencies in `rope`) and
//! `table` the one description of each (operands, roles, storage classes, shapes, family,
//! costs); the program structure (buffers, groups, instructions) lives in `program` (a compute
//! instruction's buffer lists in `operands`), its stable text form in `text`.

/// An enum of unit variants, each with its name: the enum, `ALL` (every variant in declaration
/// order) and `name()`. The op kinds (`table::Opcode`) and the activations (`op::Act`) are such
/// lists, each written once as `Variant "name",` lines.
macro_rules! named_enum {
    ($(#[$meta:meta])* $vis:vis enum $ty:ident { $($variant:ident $name:literal,)* }) => {
        $(#[$meta])*
        $vis enum $ty {
            $($variant,)*
        }

        impl $ty {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant,)*];

            /// Its name in the language, in messages and in JSON.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)*
                }
            }
        }
    };
}
pub(crate) use named_enum;

pub mod fp8;
pub mod op;
pub mod operands;
pub mod optimizer_runs;
pub mod program;
pub mod rope;
pub mod storage;
pub mod swiglu_runs;
pub mod table;
pub mod text;

pub use operands::{Inputs, Operands, Outputs};
pub use program::*;

use serde::Serialize;

/// Index of a buffer in a program's buffer arena. Backends key their allocations by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct BufferId(pub u32);

/// Element type of a buffer. `Bf16` stores an f32 value rounded to bfloat16 (8 exponent bits, 7
/// mantissa bits); which buffers use it is decided by the lowering (see `storage`). `Fp8` holds
/// an FP8 GEMM operand quantized once for the GEMMs that read it (`Op::Fp8Quantize`): the
/// scaled values `fp8(v·s)` in the format's bits, one byte each (`ir::fp8`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    I32,
    Bf16,
    #[serde(untagged)]
    Fp8(fp8::Fp8Format),
}

impl DType {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::Bf16 => 2,
            DType::Fp8(_) => 1,
        }
    }
    /// The name in the text form (`f32`, `i32`, `bf16`, `e4m3`, `e5m2`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::Bf16 => "bf16",
            DType::Fp8(format) => format.name(),
        }
    }
    /// Whether elements are stored narrower than the f32 values kernels compute with (bf16,
    /// FP8): a backend that computes in f32 widens them on reading and rounds on writing.
    pub fn is_narrow(self) -> bool {
        matches!(self, DType::Bf16 | DType::Fp8(_))
    }
}
