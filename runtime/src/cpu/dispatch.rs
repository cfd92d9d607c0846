//! Routing of one `Op` to its family (`Opcode::family`, the op table's grouping). Each family's
//! module owns its ops whole: the entry point that turns the op's attributes into sizes and its
//! bound buffers into typed slices, and the kernels it calls.
use super::args::{Inputs, Outputs};
use super::dense::Threads;
use super::{attention, cross_entropy, elementwise, embed, linear, movement, norm, optim};
use crate::backend::StepScalars;
use crate::error::Result;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::table::Family;

/// A family's entry point: runs `op` on its bound buffers; `threads` says whether dense
/// products and attention may use the pool.
type Entry = fn(&Op, &Inputs, &mut Outputs, &StepScalars, Threads) -> Result<()>;

/// Run `op` on bound buffers (checked against its signature) through its family's module.
pub(crate) fn run(
    op: &Op,
    ins: &Inputs,
    outs: &mut Outputs,
    scalars: &StepScalars,
    threads: Threads,
) -> Result<()> {
    let entry: Entry = match op.opcode().family() {
        Family::Embedding => embed::run,
        Family::Norm => norm::run,
        Family::Matmul => linear::run,
        Family::Attention => attention::run,
        Family::Elementwise => elementwise::run,
        Family::DataMovement => movement::run,
        Family::Loss => cross_entropy::run,
        Family::Optimizer => optim::run,
    };
    entry(op, ins, outs, scalars, threads)
}
