//! Invariant 7 of the verifier: an op that updates an operand in place (`Op::in_place`, e.g.
//! `CrossEntropy` writing dlogits over its logits) binds that input and that output to one
//! buffer (E0820). Backends rely on it: they run such an op on the buffer without copying the
//! input first, so an instruction naming two buffers there would read one and leave the other
//! unwritten.
use super::{Findings, Violation};
use crate::ir::{Program, ProgramId};

/// Every in-place binding violation of `program` (run by `rank`, the lowest rank running it).
pub(super) fn check(program: &Program, id: ProgramId, rank: u32) -> Vec<Violation> {
    let mut found = Findings::new(id, rank);
    let mut signatures = crate::ir::table::Signatures::new();
    for (i, c) in program.computes() {
        let op = c.op;
        for (input, output) in signatures.of(op).in_place() {
            let (a, b) = (c.inputs.get(input), c.outputs.get(output));
            if a.is_none() || a != b {
                let name = |b: Option<&crate::ir::BufferId>| {
                    b.map_or_else(|| "nothing".to_string(), |b| format!("b{}", b.0))
                };
                found.push("E0820", i, c.node, || {
                    format!(
                        "{op:?} updates input {input} in place as output {output}, but input \
                         {input} is {} and output {output} is {}",
                        name(a),
                        name(b)
                    )
                });
            }
        }
    }
    found.into_vec()
}
