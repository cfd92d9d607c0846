//! The schedule IR: one program per rank of local compute, communication and recompute.
//! `op` holds the compute operations (the backend contract); the program structure (buffers,
//! groups, instructions) lives in `program` (a compute instruction's buffer lists in
//! `operands`), its stable text form in `text`.
pub mod op;
pub mod operands;
pub mod program;
pub mod text;

pub use operands::{Inputs, Operands, Outputs};
pub use program::*;

use serde::Serialize;

/// Index of a buffer in a program's buffer arena. Backends key their allocations by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct BufferId(pub u32);

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    I32,
}

impl DType {
    pub fn bytes(self) -> u64 {
        4
    }
}
