//! Invariant 8 of the verifier: an output an op adds into (`Op::accumulates`, the "(+=)"
//! outputs) is not also one of that op's inputs (E0821). The lowering adds gradient
//! contributions into the gradient already there (`lower::Emitter::accumulation_target`); a
//! `+=` target that the op also reads as an input would be read while the op writes it (a GEMM
//! or norm kernel reads its inputs across rows as it writes dx), so a backend could not run it
//! in place. The cross-instruction half of the argument — no later instruction wants the value
//! from before the `+=` — is the lowering's, from its holder counts; it is not visible in the
//! IR. Also E0822: a `MatmulBwdData` with an activation gradient (`act_grad`) does not
//! accumulate (its dx is the product times act'(pre), overwritten), and a GEMM with a SwiGLU
//! epilogue (`swiglu`) has no other epilogue (no bias, residual, activation or accumulation).
//! And E0823: an op that
//! overwrites its parameter gradients (`accumulate_param_grad` = false) is their first writer
//! since their allocation (`lower::first_write::may_overwrite`): an overwrite of a gradient
//! that holds an earlier contribution, a reduced value or a persistent accumulator would drop
//! it.
use super::{Findings, Violation};
use crate::ir::op::Op;
use crate::ir::{Program, ProgramId};

/// Every accumulating output of `program` that is also an input of its instruction (run by
/// `rank`, the lowest rank running it).
pub(super) fn check(program: &Program, id: ProgramId, rank: u32) -> Vec<Violation> {
    let mut found = Findings::new(id, rank);
    let may_overwrite = crate::lower::first_write::may_overwrite(program);
    for (i, c) in program.computes() {
        let op = c.op;
        if let Some(why) = epilogue_conflict(op) {
            found.push("E0822", i, c.node, || format!("{op:?} {why}"));
        }
        if let Some((first, false)) = op.param_grad_outputs() {
            if !may_overwrite.get(i).copied().unwrap_or(false) {
                found.push("E0823", i, c.node, || {
                    format!(
                        "{op:?} overwrites its parameter gradient(s) from output {first} on, \
                         but one of them is not freshly allocated and untouched (or is also an \
                         input): only a gradient's first writer since its allocation may \
                         overwrite it"
                    )
                });
            }
        }
        for (k, out) in c.outputs.iter().enumerate() {
            let Some(input) = c.inputs.iter().position(|b| b == out) else {
                continue;
            };
            if !op.accumulates(k) {
                continue;
            }
            let name = program.buffer(*out).map_or("?", |b| b.name.as_str());
            found.push("E0821", i, c.node, || {
                format!(
                    "{op:?} adds into output {k}, b{} `{name}`, which is also its input \
                     {input}: an accumulating output must be a buffer the op does not read",
                    out.0
                )
            });
        }
    }
    found.into_vec()
}

/// Why a GEMM's epilogue attributes cannot go together (E0822), or None.
fn epilogue_conflict(op: &Op) -> Option<String> {
    match *op {
        Op::MatmulBwdData {
            accumulate: true,
            act_grad: Some(act),
            ..
        } => Some(format!(
            "both accumulates dx and multiplies it by {act:?}'s derivative: an \
             activation-gradient product must overwrite dx"
        )),
        Op::Matmul {
            swiglu: true,
            act,
            residual,
            bias,
            ..
        } if act.is_some() || residual || bias => Some(
            "has a SwiGLU epilogue and also an activation, a residual or a bias: a SwiGLU \
             product takes none of them"
                .to_string(),
        ),
        Op::MatmulBwdData {
            swiglu: true,
            accumulate,
            act_grad,
            ..
        } if accumulate || act_grad.is_some() => Some(
            "has a SwiGLU-gradient epilogue and also accumulates or an activation gradient: a \
             SwiGLU-gradient product overwrites dgate and dup"
                .to_string(),
        ),
        _ => None,
    }
}
