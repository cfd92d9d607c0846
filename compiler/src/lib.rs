//! parc's compiler core. Pure: no file IO, no CUDA. The CLI reads files into [`diag::Sources`]
//! and renders what comes back.
pub mod cost;
pub mod diag;
pub mod ir;
pub mod lower;
pub mod spec;
pub mod verify;
