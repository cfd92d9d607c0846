//! Invariant 6 of the verifier: every buffer has an element type its uses accept (E0819).
//! A compute instruction's operands are checked against the op's storage classes
//! (`ir::table`), a collective's input and output must share one type (a collective moves
//! elements, it does not convert them), and `LoadBatch` fills i32 buffers. Buffers that do not
//! exist are invariant 1's (E0810) and skipped here.
use super::{Findings, Violation};
use crate::ir::{BufferId, Compute, Instr, Program, ProgramId};

/// Every dtype violation of `program` (run by `rank`, the lowest rank running it).
pub(super) fn check(program: &Program, id: ProgramId, rank: u32) -> Vec<Violation> {
    let mut found = Findings::new(id, rank);
    let describe = |b: BufferId| {
        program
            .buffer(b)
            .map(|x| format!("b{} `{}` ({})", b.0, x.name, x.dtype.name()))
            .unwrap_or_else(|| format!("b{}", b.0))
    };
    let mut signatures = crate::ir::table::Signatures::new();
    for (i, instr) in program.instrs.iter().enumerate() {
        let mut push = |node, message: String| found.push("E0819", i, node, || message);
        match instr {
            Instr::Compute { .. } => {
                let Some(Compute {
                    op,
                    inputs,
                    outputs,
                    node,
                    ..
                }) = instr.as_compute()
                else {
                    continue;
                };
                let signature = signatures.of(op);
                let bound = [
                    ("input", &inputs[..], &signature.inputs[..]),
                    ("output", &outputs[..], &signature.outputs[..]),
                ];
                for (side, ids, operands) in bound {
                    for (k, (b, operand)) in ids.iter().zip(operands).enumerate() {
                        let class = operand.class;
                        let Some(buffer) = program.buffer(*b) else {
                            continue;
                        };
                        if !class.accepts(buffer.dtype) {
                            push(
                                node,
                                format!(
                                    "{side} {k} of {op:?} is {} but takes {}",
                                    describe(*b),
                                    class.describe()
                                ),
                            );
                        }
                    }
                }
            }
            Instr::Collective {
                input,
                output,
                node,
                ..
            } => {
                let types = (program.buffer(*input), program.buffer(*output));
                if let (Some(a), Some(b)) = types {
                    if a.dtype != b.dtype {
                        push(
                            *node,
                            format!(
                                "a collective from {} into {} would convert; its input and \
                                 output must share one type",
                                describe(*input),
                                describe(*output)
                            ),
                        );
                    }
                }
            }
            Instr::LoadBatch {
                tokens, targets, ..
            } => {
                for b in tokens.iter().chain(targets) {
                    let buffer = program.buffer(*b);
                    if buffer.is_some_and(|x| x.dtype != crate::ir::DType::I32) {
                        push(
                            None,
                            format!("LoadBatch fills {} with i32 tokens", describe(*b)),
                        );
                    }
                }
            }
            _ => {}
        }
    }
    found.into_vec()
}
