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
    /// Data files: missing, malformed, too short.
    #[error("data: {0}")]
    Data(String),
    /// Checkpoints: missing, corrupt, or from another plan.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
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
