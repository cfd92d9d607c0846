//! parc's runtime: executes verified per-rank schedule programs on a backend with a comm.
pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod init;
pub mod tensor;
pub mod data;
pub mod comm;
pub mod checkpoint;
pub mod exec;
