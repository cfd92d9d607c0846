//! parc's compiler core. Pure: no file IO, no CUDA. The CLI reads files into [`diag::Sources`]
//! and renders what comes back; [`driver::compile`] chains the stages.
pub mod axis;
pub mod check;
pub mod cost;
pub mod diag;
pub mod driver;
pub mod fit;
pub mod fp8;
pub mod fuse;
pub mod ir;
pub mod kir;
pub mod lower;
pub mod memplan;
pub mod overrides;
pub mod search;
pub mod spec;
pub mod stdlib;
pub mod syntax;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod timeline;
pub mod verify;

pub use check::check;
pub use overrides::{parse_override, Override};
