//! The storage pass: which buffers of an emitted program a bf16 run (`train.precision = bf16`)
//! stores in bf16 (docs/architecture.md, "bf16 activation storage"). A buffer becomes bf16 when
//! it is an activation or an activation gradient and every operand it is bound to accepts bf16
//! (`ir::storage`); a collective's input and output keep one type, so a pair with an fp32 side
//! stays fp32 on both. Everything else (parameters, gradients, optimizer state, statistics,
//! metrics, tokens, buckets) stays as emitted. Other precisions leave the program unchanged.
use crate::ir::storage::{operand_classes, StorageClass};
use crate::ir::{BufferId, BufferKind, DType, Instr, Program};
use crate::spec::Precision;

/// Give `program`'s buffers their storage types for a run in `precision`.
pub(super) fn assign(program: &mut Program, precision: Precision) {
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
    let mut collectives = Vec::new();
    for instr in &program.instrs {
        match instr {
            Instr::Compute {
                op,
                inputs,
                outputs,
                ..
            } => {
                let (ins, outs) = operand_classes(op);
                let bound = inputs.iter().zip(ins).chain(outputs.iter().zip(outs));
                for (id, class) in bound {
                    if class != StorageClass::Float {
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
