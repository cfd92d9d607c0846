//! The schedule IR: one program per rank of local compute, communication and recompute.
pub mod op;
