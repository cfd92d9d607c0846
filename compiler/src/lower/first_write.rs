//! The first contribution to a parameter gradient writes instead of adding. A gradient
//! accumulator is allocated (zero-filled) by the step that fills it, and the ops that fill it
//! add into it (`MatmulBwdWeight`'s dw and db, the norms' dw and db, `PositionAddBwd`'s
//! dtable). The first of those ops to touch a freshly allocated gradient can overwrite it
//! instead (`accumulate_param_grad` = false), as PyTorch's autograd creates a `.grad` on the
//! first backward; `memplan::zero_needs` then drops the zero-fill (124M: every one of the
//! step's zero-filled buffers was such a gradient).
//!
//! The rule is decided on the finished program, in the order a rank runs it, so pipeline
//! schedules, recompute, tied weights (GPT-2's wte: the head's product comes first, the
//! embedding's scatter adds after it) and ZeRO buckets need no special case: an op's
//! parameter-gradient outputs may be overwritten when every one of them was allocated and
//! untouched since (no instruction read or wrote it: no collective, copy, `Zero` or earlier
//! contribution) and none is also an input of the op. Persistent buffers are never allocated
//! in the step, so they keep accumulating. In f32 an overwrite equals adding into zeros bit
//! for bit (`0 + v = v`), so the plan trains exactly as before; the verifier re-checks the rule
//! on every overwriting op (E0823).
use crate::ir::{Instr, Program};
use std::sync::Arc;

/// Per instruction of `program`: whether it is an op with parameter-gradient outputs
/// (`Op::param_grad_outputs`) that may overwrite them (see the module docs), whatever its
/// flag says now.
pub(crate) fn may_overwrite(program: &Program) -> Vec<bool> {
    let mut fresh = vec![false; program.buffers.len()];
    let mut result = vec![false; program.instrs.len()];
    for (i, instr) in program.instrs.iter().enumerate() {
        match instr {
            Instr::Alloc { buffer } => {
                if let Some(f) = fresh.get_mut(buffer.0 as usize) {
                    *f = true;
                }
                continue;
            }
            Instr::Compute {
                op,
                inputs,
                outputs,
                ..
            } => {
                if let Some((first, _)) = op.param_grad_outputs() {
                    let grads = outputs.get(first..).unwrap_or_default();
                    result[i] = !grads.is_empty()
                        && grads.iter().all(|g| {
                            fresh.get(g.0 as usize).copied().unwrap_or(false) && !inputs.contains(g)
                        });
                }
            }
            _ => {}
        }
        for b in instr.reads().into_iter().chain(instr.writes()) {
            if let Some(f) = fresh.get_mut(b.0 as usize) {
                *f = false;
            }
        }
        if let Instr::Free { buffer } = instr {
            if let Some(f) = fresh.get_mut(buffer.0 as usize) {
                *f = false;
            }
        }
    }
    result
}

/// Make every parameter-gradient op that [`may_overwrite`] allows overwrite its gradients.
pub(crate) fn overwrite_first_contributions(program: &mut Program) {
    let allowed = may_overwrite(program);
    for (instr, allowed) in program.instrs.iter_mut().zip(allowed) {
        if let (true, Instr::Compute { op, .. }) = (allowed, instr) {
            if op.param_grad_outputs().is_some_and(|(_, acc)| acc) {
                *op = Arc::new(op.with_param_grad_accumulation(false));
            }
        }
    }
}
