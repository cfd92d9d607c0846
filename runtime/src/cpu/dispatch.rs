//! Routing of one `Op` to its family (`Opcode::family`, the op table's grouping). Each family's
//! module owns its ops whole: an entry point `run(op, ins, outs, …)` that turns the op's
//! attributes into sizes and reads its bound buffers by role, and the kernels it calls. An
//! entry point takes the step's scalars (loss, optimizer) or the thread choice (matmul,
//! attention) where its kernels use them.
use super::args::{Inputs, Outputs};
use super::dense::Threads;
use super::{attention, cross_entropy, elementwise, embed, fused, linear, movement, norm, optim};
use crate::backend::StepScalars;
use crate::error::Result;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::table::Family;

/// Run `op` on its bound buffers through its family's module; `threads` says whether dense
/// products and attention may use the pool.
pub(crate) fn run(
    op: &Op,
    ins: &Inputs,
    outs: &mut Outputs,
    scalars: &StepScalars,
    threads: Threads,
) -> Result<()> {
    if let Op::Fused(attrs) = op {
        return fused::run(attrs, ins, outs);
    }
    match op.opcode().family() {
        Family::Embedding => embed::run(op, ins, outs),
        Family::Norm => norm::run(op, ins, outs),
        Family::Matmul => linear::run(op, ins, outs, threads),
        Family::Attention => attention::run(op, ins, outs, threads),
        Family::Elementwise => elementwise::run(op, ins, outs),
        Family::DataMovement => movement::run(op, ins, outs),
        Family::Loss => cross_entropy::run(op, ins, outs, scalars),
        Family::Optimizer => optim::run(op, ins, outs, scalars),
    }
}
