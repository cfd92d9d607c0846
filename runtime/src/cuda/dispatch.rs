//! Dispatch of one `Op` onto its family's module: the op's buffers are bound to its signature
//! first (`crate::bind`: operand counts, dtypes, element counts, row counts), so a bad program
//! is an error before any memory is touched, and each family then reads checked buffers by
//! position and checks only what its kernels add (launch limits, alignment, positions against
//! a table's rows).
use super::{attention, cross_entropy, data_movement, elementwise, embedding, fused, matmul, norm};
use super::{optimizer, Buf, CudaBackend};
use crate::backend::StepScalars;
use crate::bind::Bound;
use crate::error::Result;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::table::Family;

/// Run `op` (buffers already looked up; aliased inputs already copied).
pub(crate) fn run(
    be: &mut CudaBackend,
    op: &Op,
    ins: &[Buf],
    outs: &[Buf],
    scalars: &StepScalars,
) -> Result<()> {
    let b = Bound::bind(op, ins, outs)?;
    if let Op::Fused(attrs) = op {
        return fused::run(be, &b, attrs);
    }
    match op.opcode().family() {
        Family::Embedding => embedding::run(be, &b),
        Family::Norm => norm::run(be, &b),
        Family::Matmul => matmul::run(be, &b),
        Family::Attention => attention::run(be, &b),
        Family::Elementwise => elementwise::run(be, &b),
        Family::DataMovement => data_movement::run(be, &b),
        Family::Loss => cross_entropy::run(be, &b, scalars),
        Family::Optimizer => optimizer::run(be, &b, scalars),
    }
}
