//! parc's runtime: executes verified per-rank schedule programs on a backend with a comm.
pub mod backend;
pub mod bind;
pub mod calibrate;
pub mod checkpoint;
pub mod comm;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod error;
pub mod exec;
pub mod generate;
pub mod hf;
pub mod init;
pub mod launch;
#[cfg(feature = "llvm")]
pub mod llvm;
