//! The runtime's error type: every failure names the thing that failed and what to do.
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RuntimeError {
    /// A buffer id the program did not allocate, or of the wrong type/size for an op.
    #[error("buffer {id}: {what}")]
    Buffer { id: u32, what: String },
    /// An op got inputs it cannot run on (shape or count mismatch): a lowering bug.
    #[error("op {op}: {what}")]
    Op { op: String, what: String },
    /// A communication failure: a peer that died or a collective that timed out.
    #[error("communication: {0}")]
    Comm(String),
    /// A communication failure at one instruction of a rank's program: where the rank was
    /// (`node`: the spec node the instruction implements, or the nearest before it, which a
    /// caller holding the spec's sources renders as file:line).
    #[error("{source} [rank {rank} at instruction {index} of program `{role}`: {instr}]")]
    AtInstruction {
        rank: u32,
        role: String,
        index: usize,
        /// What the instruction does, e.g. `all_reduce on group dp`.
        instr: String,
        node: Option<parc_compiler::spec::NodeId>,
        source: Box<RuntimeError>,
    },
    /// A step's loss or global gradient norm was not finite (`train.on_nonfinite`); `origin`:
    /// the message names the instruction that computed the first such value.
    #[error("non-finite values: {message}")]
    NonFinite { message: String, origin: bool },
    /// Data files: missing, malformed, too short.
    #[error("data: {0}")]
    Data(String),
    /// Checkpoints: missing, corrupt, or from another plan.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// Hugging Face weights: a config.json that disagrees with the spec, a missing or
    /// misshapen tensor, a model that does not map to transformers'.
    #[error("Hugging Face weights: {0}")]
    Hf(String),
    /// A capability this build or machine does not have.
    #[error("{0}")]
    Unsupported(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
