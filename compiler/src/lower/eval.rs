//! The evaluation step (`train.eval`): each role's training forward through the loss and
//! nothing after it (no backward, gradient reduction or optimizer), as a program the runtime
//! runs between training steps on the same parameters ([`Plan::eval`](crate::ir::Plan)).
//!
//! - Its pipeline runs the training schedule's forward units alone, in the same order on each
//!   stage, timed by the same simulation (`timetable` with `forward_only`), so its transfers
//!   are placed by the same rule and cannot deadlock.
//! - The training step's emitter emits it in its evaluating mode (`pipeline`): every node's
//!   forward exactly as in training (ZeRO-3 gathers, tp and sequence-parallel collectives, cp's
//!   positions, the same loss ops, scaled by the same global batch), what a node saves for its
//!   backward released at once, no recompute segments (nothing is recomputed without a
//!   backward), then the loss summed over dp × cp as in training.
//! - It is declared as its training program is (parameters, optimizer state and metrics first,
//!   in the same order), typed for storage and fused as any program, then appended to its
//!   training program's table ([`append`]): its persistent buffers become the training
//!   program's (checked equal), its transients follow the training program's buffers, named
//!   `eval.NAME`. An instruction writing a persistent buffer other than the loss is an internal
//!   lowering error: evaluation never touches parameters, gradients or optimizer state.
use super::schedule::Timetable;
use super::{
    check_step, declare_locals, declare_metrics, finish_program, internal_error, new_emitter, one,
    sized_builder, storage, Role, Shared,
};
use crate::diag::Diagnostics;
use crate::ir::{Buffer, BufferId, Program};

/// The evaluation program of the role `key`, over `training`'s buffers and then its own.
pub(super) fn program(
    sh: &Shared,
    table: &Timetable,
    key: (u32, u32, u32),
    training: &Program,
) -> Result<Program, Diagnostics> {
    let role = Role::new(sh, key);
    let my_chunks = role.chunks(sh);
    let mut b = sized_builder(sh, &my_chunks);
    let locals = declare_locals(&mut b, sh, role, &my_chunks);
    let metrics = declare_metrics(&mut b, sh, &my_chunks);
    let histories =
        super::fp8::declare_histories(&mut b, (sh.spec, sh.fp8), &sh.chunks.ranges, &my_chunks);
    let mut em = new_emitter(sh, role, b, locals, metrics);
    em.fp8_histories = histories;
    em.evaluating = true;
    em.segments.iter_mut().for_each(|s| *s = None);
    em.selective = false;
    em.emit_step(table);
    check_step(&mut em, sh, role)?;
    let residual = em.residual.take();
    let mut program = finish_program(em, role);
    program.grad_sumsq = None;
    let keep_f32 = residual.as_ref().map_or(&[][..], |r| r.buffers());
    storage::assign(&mut program, sh.spec.train.precision, keep_f32);
    if super::fp8_quantize::wanted(sh.spec) {
        super::fp8_quantize::quantize_operands(&mut program);
    }
    let internal = |what: String| {
        one(internal_error(
            sh,
            format!(
                "internal lowering error in the evaluation step of {}: {what}",
                role.name()
            ),
        ))
    };
    if sh.options.fusion {
        crate::fuse::fuse_program(&mut program).map_err(|e| internal(format!("fusion: {e}")))?;
    }
    append(training, program).map_err(internal)
}

/// `eval` (a program declared as `training` is, see the module docs) over `training`'s whole
/// buffer table followed by its own transients, renumbered; an error when its persistent
/// buffers or parameters are not `training`'s or it writes a persistent buffer but the loss.
pub(super) fn append(training: &Program, eval: Program) -> Result<Program, String> {
    if eval.params != training.params {
        return Err("its parameters are not the training step's".to_string());
    }
    let mut buffers = training.buffers.clone();
    let mut to = Vec::with_capacity(eval.buffers.len());
    for (i, buffer) in eval.buffers.iter().enumerate() {
        if buffer.kind.is_persistent() {
            if training.buffers.get(i) != Some(buffer) {
                return Err(format!(
                    "its persistent buffer `{}` is not the training step's buffer {i}",
                    buffer.name
                ));
            }
            to.push(BufferId(i as u32));
        } else {
            to.push(BufferId(buffers.len() as u32));
            buffers.push(Buffer {
                name: format!("eval.{}", buffer.name),
                ..buffer.clone()
            });
        }
    }
    // An id outside the table stays outside it, for the verifier to report (E0810).
    let map = |id: BufferId| to.get(id.0 as usize).copied().unwrap_or(BufferId(u32::MAX));
    let instrs: Vec<_> = eval.instrs.iter().map(|i| i.with_buffers(map)).collect();
    let loss = eval.loss.map(map);
    for (index, instr) in instrs.iter().enumerate() {
        let persistent = |id: &BufferId| {
            buffers
                .get(id.0 as usize)
                .is_some_and(|b| b.kind.is_persistent())
        };
        if let Some(id) = instr
            .writes()
            .into_iter()
            .find(|id| persistent(id) && Some(*id) != loss)
        {
            let name = buffers.get(id.0 as usize).map_or("?", |b| b.name.as_str());
            return Err(format!("instruction {index} writes `{name}`"));
        }
    }
    Ok(Program {
        role: format!("{} (eval)", eval.role),
        coords: eval.coords,
        buffers,
        params: eval.params,
        instrs,
        loss,
        grad_sumsq: None,
    })
}

#[cfg(test)]
mod tests;
