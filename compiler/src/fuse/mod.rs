//! The fusion pass: on each lowered program, maximal groups of elementwise, data-movement and
//! RoPE ops between GEMMs and attention become one `Op::Fused` each, a generated kernel
//! (`kir::Kernel`) that reads each input once and writes only what is read after it.
//!
//! - `ops`: each fusible op as a kernel fragment, with the CPU kernels' exact arithmetic;
//! - `group`: the greedy grouping over the instruction order and its reordering checks;
//! - `kernel`: one group's kernel (domain columns, internal values, stores, validation);
//! - `rewrite`: the program with fused instructions, vanished buffers and rotation tables;
//! - `graph`: copying parts of kernel graphs.
//!
//! **What fuses.** `Activation`/`ActivationBwd`, `SwiGlu`/`SwiGluBwd`, `Add`, `Scale`, `Copy`,
//! `SplitColumns`, `ConcatColumns`, `Rope`/`RopeBwd` and `Op::Fused` itself (an activation
//! defined in `.par`), when they overwrite their outputs. An instruction joins the group that
//! wrote a buffer it reads (several such groups merge) when its rows are the group's, one
//! kernel holds them (at most 6 inputs (`kernel::MAX_KERNEL_INPUTS`) and 3 outputs; the domain's
//! columns are the gcd of the members' widths and a rope's head must divide it), and moving the
//! members to the last one's place reorders no dependence (`group`). A buffer only members use
//! disappears (no store, no `Alloc`/`Free`); one read outside stays an output. A rope reads a
//! per-position cos/sin table (`Op::RopeTable`, one per distinct rotation per program, made
//! before its first reader and freed after its last) and its partner column through the
//! rotate-half column map. On a Llama step this fuses `SplitColumns → Rope(q), Rope(k)` (one
//! kernel reading qkv and writing qr, kr and v) and `RopeBwd(dq), RopeBwd(dk) →
//! ConcatColumns` (one kernel writing dqkv).
//!
//! **What does not, and why.** GEMMs, attention, norms, losses, embeddings and optimizer ops
//! (their own kernels); ops that accumulate into (`Write::Accumulate`), update or write a
//! range of their output, or whose output is one of their inputs (a kernel's outputs must not
//! alias what it reads); a `Fused` kernel with row sums or row/column operands (its domain
//! cannot be re-blocked); and a group of one, which keeps its hand-written op (already one
//! kernel; whether a generated one is faster is decided per op by measurement).
//!
//! **After the storage pass.** Fusion runs on the finished program, after `lower::storage`
//! chose each buffer's type: every buffer that survives keeps the type the unfused program
//! gives it (a fused kernel's elementwise operands accept f32 or bf16, as the ops it replaces
//! do), so the only numeric change fusion makes in bf16 is that a vanished intermediate is no
//! longer rounded to bf16 between two ops; in f32 the fused program computes what the
//! unfused one does (up to the few-ulp difference of `kir`'s exp and erf from libm). It runs
//! before verification and memory planning (`lower::LowerOptions::fusion`, the driver's
//! `CompileOptions::fusion`, `parc --fusion on|off`), so the verifier, memory planner,
//! timeline and `parc plan` see the fused program.

mod graph;
mod group;
mod kernel;
mod ops;
mod rewrite;
#[cfg(test)]
mod tests;

use crate::ir::Program;

/// What the pass did to one program.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FuseSummary {
    /// Fused instructions made.
    pub fused: usize,
    /// Instructions they replace.
    pub replaced: usize,
}

/// Fuse `program`'s groups (see the module docs). An error is a bug of this pass: a kernel
/// that does not validate, or a group it cannot place.
pub fn fuse_program(program: &mut Program) -> Result<FuseSummary, String> {
    let groups = group::groups(program)?;
    let summary = FuseSummary {
        fused: groups.len(),
        replaced: groups.iter().map(|g| g.members.len()).sum(),
    };
    if !groups.is_empty() {
        rewrite::rewrite(program, &groups)?;
    }
    Ok(summary)
}
