//! Which buffers need their `Alloc` zero-fill. The IR says an `Alloc` creates a zero-filled
//! buffer, but most transient buffers are fully overwritten by their first writer before
//! anything reads them, and with a memory plan the fill is a memset of the buffer's planned
//! bytes per allocation (on the GPU one kernel per `Alloc`). [`zero_needs`] marks the buffers
//! whose zeros can be observed; a backend may skip the fill of every other one.
//!
//! After each `Alloc` of a buffer the analysis looks at the first instruction that touches it:
//! - it reads the buffer (an op input, a collective's input, a send): zeros needed;
//! - it writes every element without reading any (an op output documented as overwritten, a
//!   `CopyRange` covering the whole destination, a collective's output, a receive, a loaded
//!   batch): no zeros needed;
//! - it writes part of it or accumulates into it (outputs documented "(+=)", in-place optimizer
//!   state, a `CopyRange` into a slice): zeros needed;
//! - the buffer is freed untouched: no zeros needed (nothing can see them).
//!
//! A buffer allocated several times needs zeros if any of its allocations does (backends see
//! buffer ids, not instructions). Persistent buffers always do (optimizer state and metrics
//! start at zero). Anything the analysis cannot place is marked as needing zeros.
use crate::ir::op::Op;
use crate::ir::{BufferId, Instr, P2pOp, Program};

/// Per `BufferId` of `program`: whether an allocation of it must be zero-filled (see the
/// module docs).
pub fn zero_needs(program: &Program) -> Vec<bool> {
    let count = program.buffers.len();
    let mut needs: Vec<bool> = program
        .buffers
        .iter()
        .map(|b| b.kind.is_persistent())
        .collect();
    // Allocated and not yet touched since.
    let mut fresh = vec![false; count];
    for instr in &program.instrs {
        match instr {
            Instr::Alloc { buffer } => {
                if let Some(f) = fresh.get_mut(buffer.0 as usize) {
                    *f = true;
                }
            }
            Instr::Free { buffer } => {
                if let Some(f) = fresh.get_mut(buffer.0 as usize) {
                    *f = false;
                }
            }
            Instr::Compute {
                op,
                inputs,
                outputs,
                ..
            } => {
                // Reads come first: an output that is also an input is read before it is
                // written.
                for &id in inputs.iter() {
                    touch(&mut fresh, &mut needs, id, false);
                }
                for (index, &id) in outputs.iter().enumerate() {
                    let numel = program.buffer(id).map(|b| b.numel());
                    touch(&mut fresh, &mut needs, id, overwrites(op, index, numel));
                }
            }
            Instr::Collective { input, output, .. } => {
                touch(&mut fresh, &mut needs, *input, false);
                touch(&mut fresh, &mut needs, *output, true);
            }
            Instr::Send { buffer, .. } => touch(&mut fresh, &mut needs, *buffer, false),
            Instr::Recv { buffer, .. } => touch(&mut fresh, &mut needs, *buffer, true),
            Instr::P2p { ops } => {
                for op in ops {
                    match *op {
                        P2pOp::Send { buffer, .. } => touch(&mut fresh, &mut needs, buffer, false),
                        P2pOp::Recv { buffer, .. } => touch(&mut fresh, &mut needs, buffer, true),
                    }
                }
            }
            Instr::LoadBatch {
                tokens, targets, ..
            } => {
                for &id in tokens.iter().chain(targets.iter()) {
                    touch(&mut fresh, &mut needs, id, true);
                }
            }
        }
    }
    needs
}

/// The first use of `id` since its `Alloc` (if it is fresh) decides whether it needs zeros.
fn touch(fresh: &mut [bool], needs: &mut [bool], id: BufferId, overwrites: bool) {
    let i = id.0 as usize;
    if fresh.get(i).copied().unwrap_or(false) {
        fresh[i] = false;
        if !overwrites {
            needs[i] = true;
        }
    }
}

/// Whether `op` writes every element of its output `index` (of `numel` elements, None when
/// unknown) without reading its old value, per the semantics in `crate::ir::op`.
fn overwrites(op: &Op, index: usize, numel: Option<u64>) -> bool {
    match op {
        // Outputs documented "(+=)": dtable; dw and db.
        Op::EmbeddingBwd { .. }
        | Op::PositionAddBwd { .. }
        | Op::MatmulBwdWeight { .. }
        | Op::CeLoss { .. }
        | Op::SumSquares => false,
        Op::LayerNormBwd { .. } | Op::RmsNormBwd { .. } => index == 0,
        // Updated in place.
        Op::AdamW { .. } | Op::Sgd { .. } => false,
        // Only the destination range is written.
        Op::CopyRange {
            dst_offset, len, ..
        } => *dst_offset == 0 && numel == Some(*len),
        Op::Embedding { .. }
        | Op::PositionAdd { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::Matmul { .. }
        | Op::MatmulBwdData { .. }
        | Op::Rope { .. }
        | Op::RopeBwd { .. }
        | Op::Attention { .. }
        | Op::AttentionBwd { .. }
        | Op::Activation { .. }
        | Op::ActivationBwd { .. }
        | Op::SwiGlu
        | Op::SwiGluBwd
        | Op::Add
        | Op::Scale { .. }
        | Op::Copy
        | Op::Zero
        | Op::CeMax { .. }
        | Op::CeSumExp { .. }
        | Op::CeTargetLogit { .. }
        | Op::CeGrad { .. }
        | Op::ClipCoef { .. } => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::testspec::{build, Dims, Plan as PlanChoice};
    use crate::ir::{Buffer, BufferKind, CollectiveKind, DType, GroupId, Inputs, Outputs, Phase};
    use crate::lower::lower;
    use crate::spec::ZeroStage;
    use std::sync::Arc;

    /// Buffers of `sizes` f32 elements (kind `act`, or `param` where the size is negative).
    fn program(sizes: &[i64], instrs: Vec<Instr>) -> Program {
        let buffers = sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| Buffer {
                name: format!("b{i}"),
                shape: vec![s.unsigned_abs()],
                dtype: DType::F32,
                kind: if s < 0 {
                    BufferKind::Param
                } else {
                    BufferKind::Activation
                },
            })
            .collect();
        Program {
            role: "test".into(),
            coords: Vec::new(),
            buffers,
            params: Vec::new(),
            instrs,
            loss: None,
            grad_sumsq: None,
        }
    }

    fn alloc(b: u32) -> Instr {
        Instr::Alloc {
            buffer: BufferId(b),
        }
    }

    fn free(b: u32) -> Instr {
        Instr::Free {
            buffer: BufferId(b),
        }
    }

    fn compute(op: Op, inputs: &[u32], outputs: &[u32]) -> Instr {
        let ids = |v: &[u32]| v.iter().map(|&b| BufferId(b)).collect::<Vec<_>>();
        Instr::Compute {
            op: Arc::new(op),
            inputs: Inputs::from_slice(&ids(inputs)).unwrap(),
            outputs: Outputs::from_slice(&ids(outputs)).unwrap(),
            node: None,
            phase: Phase::Forward,
        }
    }

    fn copy_range(dst_offset: u64, len: u64) -> Op {
        Op::CopyRange {
            src_offset: 0,
            dst_offset,
            len,
        }
    }

    fn weight_grad(bias: bool) -> Op {
        Op::MatmulBwdWeight {
            in_dim: 2,
            out_dim: 2,
            bias,
        }
    }

    #[test]
    fn overwritten_outputs_need_no_zeros_accumulated_ones_do() {
        // b0 = param; b1 = 2·b0 (overwritten); b2, b3 accumulated (dw, db); b4 never used.
        let p = program(
            &[-4, 4, 4, 2, 4],
            vec![
                alloc(1),
                compute(Op::Scale { factor: 2.0 }, &[0], &[1]),
                alloc(2),
                alloc(3),
                compute(weight_grad(true), &[1, 1], &[2, 3]),
                alloc(4),
                free(4),
                free(1),
                free(2),
                free(3),
            ],
        );
        assert_eq!(zero_needs(&p), vec![true, false, true, true, false]);
    }

    #[test]
    fn an_output_that_is_also_an_input_is_read_first() {
        let p = program(
            &[4],
            vec![
                alloc(0),
                compute(Op::Scale { factor: 2.0 }, &[0], &[0]),
                free(0),
            ],
        );
        assert_eq!(zero_needs(&p), vec![true]);
    }

    #[test]
    fn only_the_first_use_after_each_alloc_counts() {
        // b0 overwritten, then accumulated into (its zeros are gone by then: no need); b1
        // overwritten in its first life, accumulated in its second: needed.
        let p = program(
            &[4, 4, 4],
            vec![
                alloc(2),
                compute(Op::Zero, &[], &[2]),
                alloc(0),
                compute(Op::Copy, &[2], &[0]),
                compute(weight_grad(false), &[2, 2], &[0]),
                alloc(1),
                compute(Op::Copy, &[2], &[1]),
                free(1),
                alloc(1),
                compute(weight_grad(false), &[2, 2], &[1]),
                free(1),
                free(0),
                free(2),
            ],
        );
        assert_eq!(zero_needs(&p), vec![false, true, false]);
    }

    #[test]
    fn copy_range_overwrites_only_when_it_covers_the_destination() {
        // b1: [0, 4) of 4 elements; b2: [0, 3) of 4 (ZeRO padding left); b3: [1, 5) of 5.
        let p = program(
            &[-4, 4, 4, 5],
            vec![
                alloc(1),
                compute(copy_range(0, 4), &[0], &[1]),
                alloc(2),
                compute(copy_range(0, 3), &[0], &[2]),
                alloc(3),
                compute(copy_range(1, 4), &[0], &[3]),
                free(1),
                free(2),
                free(3),
            ],
        );
        assert_eq!(zero_needs(&p), vec![true, false, true, true]);
    }

    #[test]
    fn communication_writes_whole_outputs_and_reads_inputs() {
        use crate::ir::{P2pOp, Peer};
        use crate::spec::Axis;
        let peer = Peer {
            axis: Axis::Pp,
            coord: 1,
        };
        let collective = |input: u32, output: u32| Instr::Collective {
            kind: CollectiveKind::AllGather,
            group: GroupId(0),
            input: BufferId(input),
            output: BufferId(output),
            node: None,
        };
        // b0 gathered into b1; b2 sent fresh (reads zeros); b3 received; b4 received in a
        // batch; b5 loaded; b6 all-gathered fresh (its zeros are read).
        let p = program(
            &[4, 8, 4, 4, 4, 4, 4],
            vec![
                alloc(0),
                compute(Op::Zero, &[], &[0]),
                alloc(1),
                collective(0, 1),
                alloc(2),
                Instr::Send {
                    peer,
                    buffer: BufferId(2),
                    tag: 0,
                },
                alloc(3),
                Instr::Recv {
                    peer,
                    buffer: BufferId(3),
                    tag: 1,
                },
                alloc(4),
                Instr::P2p {
                    ops: vec![
                        P2pOp::Recv {
                            peer,
                            buffer: BufferId(4),
                            tag: 2,
                        },
                        P2pOp::Send {
                            peer,
                            buffer: BufferId(3),
                            tag: 3,
                        },
                    ],
                },
                alloc(5),
                Instr::LoadBatch {
                    microbatch: 0,
                    positions: Vec::new(),
                    tokens: Some(BufferId(5)),
                    targets: None,
                },
                alloc(6),
                collective(6, 1),
            ],
        );
        assert_eq!(
            zero_needs(&p),
            vec![false, false, true, false, false, false, true]
        );
    }

    #[test]
    fn lowered_plans_zero_only_what_accumulates_and_persists() {
        let dims = Dims {
            layers: 2,
            ..Dims::tiny()
        };
        for zero in [ZeroStage::Zero0, ZeroStage::Zero3] {
            let choice = PlanChoice {
                dp: 2,
                tp: 2,
                zero,
                ..PlanChoice::default()
            };
            let plan = lower(&build(&dims, &choice)).unwrap_or_else(|d| panic!("{:?}", d.items));
            for program in &plan.programs {
                let needs = zero_needs(program);
                let layout = super::super::plan_program(program).unwrap();
                assert_eq!(layout.needs_zero, needs);
                assert!(layout.zeroed_allocs < layout.allocs / 4, "{layout:?}");
                for (buffer, need) in program.buffers.iter().zip(&needs) {
                    if *need {
                        assert!(
                            matches!(
                                buffer.kind,
                                BufferKind::Param
                                    | BufferKind::OptState
                                    | BufferKind::Metric
                                    | BufferKind::Grad
                                    | BufferKind::Comm
                            ),
                            "{} ({:?}) is zeroed",
                            buffer.name,
                            buffer.kind
                        );
                    }
                }
            }
        }
    }
}
