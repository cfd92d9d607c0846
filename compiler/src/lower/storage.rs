//! The storage pass: which buffers of an emitted program a bf16 run (`train.precision = bf16`)
//! stores in bf16 (docs/decisions.md, "bf16 activation storage"). A buffer becomes bf16 when
//! it is an activation or an activation gradient and every operand it is bound to accepts bf16
//! (`ir::table`); a collective's input and output keep one type, so a pair with an fp32 side
//! stays fp32 on both. Everything else (parameters, gradients, optimizer state, statistics,
//! metrics, tokens, buckets) stays as emitted. Other precisions leave the program unchanged.
//!
//! With `precision = bf16 { residual: fp32 }` the residual stream stays f32 as well
//! ([`ResidualStream`]: the emitter names the buffers that hold it or its gradient), as
//! Megatron's `fp32_residual_connection` and PyTorch autocast keep it.
use crate::ir::storage::StorageClass;
use crate::ir::{BufferId, BufferKind, DType, Instr, Program};
use crate::spec::{LayerKind, Model, Precision, Train, ValueId};

/// The residual stream of a model: every `Add`'s output, and every `Add` input that another
/// node reads too (the skip connection: the embedding's output or the previous block's sum,
/// read by the next norm; a branch's output, read by its `Add` alone, is not part of it).
/// The emitter reports each buffer it puts such a value or its gradient in
/// ([`ResidualStream::hold`]); [`assign`] keeps those f32.
#[derive(Debug)]
pub(crate) struct ResidualStream {
    /// Indexed by `ValueId`: whether the value is part of the stream.
    values: Vec<bool>,
    /// The buffers that have held a value of the stream or its gradient.
    buffers: Vec<BufferId>,
}

impl ResidualStream {
    /// The stream of `model`'s values, where `train` keeps it f32; else None.
    pub fn of(model: &Model, train: &Train) -> Option<ResidualStream> {
        if !(train.fp32_residual && train.precision == Precision::Bf16) {
            return None;
        }
        let mut values = vec![false; model.values.len()];
        let readers = |v: ValueId| model.nodes.iter().filter(|n| n.inputs.contains(&v)).count();
        for node in model.nodes.iter().filter(|n| n.kind == LayerKind::Add) {
            let skips = node.inputs.iter().filter(|&&v| readers(v) > 1);
            for v in skips.chain(std::iter::once(&node.output)) {
                if let Some(slot) = values.get_mut(v.0 as usize) {
                    *slot = true;
                }
            }
        }
        Some(ResidualStream {
            values,
            buffers: Vec::new(),
        })
    }

    /// `buffer` holds `value` (or its gradient): kept f32 when the value is in the stream.
    pub fn hold(&mut self, value: ValueId, buffer: BufferId) {
        if self.values.get(value.0 as usize).copied().unwrap_or(false) {
            self.buffers.push(buffer);
        }
    }

    /// The buffers that held the stream or its gradient.
    pub fn buffers(&self) -> &[BufferId] {
        &self.buffers
    }
}

/// Give `program`'s buffers their storage types for a run in `precision`; `keep_f32` (the
/// residual stream's buffers, where it is kept f32) stay f32 whatever their operands take.
pub(super) fn assign(program: &mut Program, precision: Precision, keep_f32: &[BufferId]) {
    if precision != Precision::Bf16 {
        return;
    }
    let mut eligible: Vec<bool> = program
        .buffers
        .iter()
        .map(|b| {
            b.dtype == DType::F32
                && matches!(b.kind, BufferKind::Activation | BufferKind::ActivationGrad)
        })
        .collect();
    let exclude = |id: BufferId, eligible: &mut Vec<bool>| {
        if let Some(e) = eligible.get_mut(id.0 as usize) {
            *e = false;
        }
    };
    for &id in keep_f32 {
        exclude(id, &mut eligible);
    }
    let mut collectives = Vec::new();
    let mut signatures = crate::ir::table::Signatures::new();
    for instr in &program.instrs {
        match instr {
            Instr::Compute { .. } => {
                let Some(c) = instr.as_compute() else {
                    continue;
                };
                let signature = signatures.of(c.op);
                let bound = c.inputs.iter().zip(signature.inputs.iter());
                let bound = bound.chain(c.outputs.iter().zip(signature.outputs.iter()));
                for (id, operand) in bound {
                    if operand.class != StorageClass::Float {
                        exclude(*id, &mut eligible);
                    }
                }
            }
            Instr::Collective { input, output, .. } => collectives.push((*input, *output)),
            _ => {}
        }
    }
    // Excluding one side of a collective can exclude another collective's side: repeat until
    // no pair disagrees (each round excludes at least one buffer, so this ends).
    loop {
        let mut changed = false;
        for &(input, output) in &collectives {
            let at = |id: BufferId| eligible.get(id.0 as usize).copied();
            if at(input) != at(output) {
                exclude(input, &mut eligible);
                exclude(output, &mut eligible);
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    for (buffer, bf16) in program.buffers.iter_mut().zip(eligible) {
        if bf16 {
            buffer.dtype = DType::Bf16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::op::Op;
    use crate::ir::{Buffer, CollectiveKind, GroupId, ReduceOp};

    /// b0 → all-reduce → b1 → all-reduce → b2, b2 the `max` (f32) of `CeMax` on logits b3,
    /// b4 a parameter.
    fn chained() -> Program {
        let buffer = |name: &str, kind| Buffer {
            name: name.into(),
            shape: vec![4],
            dtype: DType::F32,
            kind,
        };
        let reduce = |input: u32, output: u32| Instr::Collective {
            kind: CollectiveKind::AllReduce { op: ReduceOp::Max },
            group: GroupId(0),
            input: BufferId(input),
            output: BufferId(output),
            node: None,
        };
        Program::new(
            "test",
            vec![
                buffer("a", BufferKind::Activation),
                buffer("b", BufferKind::Activation),
                buffer("c", BufferKind::Activation),
                buffer("logits", BufferKind::Activation),
                buffer("w", BufferKind::Param),
            ],
            vec![
                reduce(0, 1),
                reduce(1, 2),
                Instr::compute(Op::CeMax { vocab_local: 4 }, &[3], &[2]),
            ],
        )
    }

    fn dtypes(p: &Program) -> Vec<DType> {
        p.buffers.iter().map(|b| b.dtype).collect()
    }

    #[test]
    fn an_fp32_use_excludes_every_buffer_a_collective_chain_ties_to_it() {
        let mut p = chained();
        assign(&mut p, Precision::Bf16, &[]);
        use DType::{Bf16, F32};
        assert_eq!(dtypes(&p), vec![F32, F32, F32, Bf16, F32]);
    }

    #[test]
    fn a_buffer_kept_f32_stays_f32() {
        let mut p = chained();
        assign(&mut p, Precision::Bf16, &[BufferId(3)]);
        assert_eq!(dtypes(&p), vec![DType::F32; 5]);
    }

    #[test]
    fn fp32_leaves_the_program_alone() {
        let mut p = chained();
        assign(&mut p, Precision::Fp32, &[]);
        assert_eq!(dtypes(&p), vec![DType::F32; 5]);
    }
}
