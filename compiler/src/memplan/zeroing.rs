//! Which buffers need their `Alloc` zero-fill. The IR says an `Alloc` creates a zero-filled
//! buffer, but most transient buffers are fully overwritten by their first writer before
//! anything reads them, and with a memory plan the fill is a memset of the buffer's planned
//! bytes per allocation (on the GPU one kernel per `Alloc`). [`zero_needs`] marks the buffers
//! whose zeros can be observed; a backend may skip the fill of every other one.
//!
//! After each `Alloc` of a buffer the analysis follows the instructions that touch it until its
//! zeros can no longer matter:
//! - one reads the buffer (an op input, a collective's input, a send): zeros needed;
//! - one writes every element without reading any (an op output documented as overwritten, a
//!   collective's output, a receive, a loaded batch): no zeros needed;
//! - one accumulates into it (outputs documented "(+=)", in-place optimizer state): zeros
//!   needed;
//! - `CopyRange`s write element ranges: once the ranges written since the `Alloc` cover the
//!   whole buffer (one copy of all of it, or the copies that fill a gradient bucket) no zeros
//!   are needed; any other use before that counts as above, as if nothing had been written
//!   (a read may read an unwritten element, so zeros are needed; a ZeRO-padded copy, whose
//!   padding no copy writes, needs them);
//! - the buffer is freed untouched: no zeros needed (nothing can see them).
//!
//! A buffer allocated several times needs zeros if any of its allocations does (backends see
//! buffer ids, not instructions). Persistent buffers always do (optimizer state and metrics
//! start at zero).
use crate::ir::table::Write;
use crate::ir::{BufferId, Instr, P2pOp, Program};

/// How an instruction uses a buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Use {
    /// Reads some elements, or adds into them.
    Reads,
    /// Writes every element, reading none.
    Overwrites,
    /// Writes the elements `[start, end)` only, reading none.
    WritesRange(u64, u64),
}

/// Per `BufferId` of `program`: whether an allocation of it must be zero-filled (see the
/// module docs).
pub fn zero_needs(program: &Program) -> Vec<bool> {
    let mut tracker = Tracker {
        needs: program
            .buffers
            .iter()
            .map(|b| b.kind.is_persistent())
            .collect(),
        fresh: vec![None; program.buffers.len()],
        numel: program.buffers.iter().map(|b| b.numel()).collect(),
    };
    let mut signatures = crate::ir::table::Signatures::new();
    for instr in &program.instrs {
        match instr {
            Instr::Alloc { buffer } => {
                if let Some(f) = tracker.fresh.get_mut(buffer.0 as usize) {
                    *f = Some(Vec::new());
                }
            }
            Instr::Free { buffer } => {
                if let Some(f) = tracker.fresh.get_mut(buffer.0 as usize) {
                    *f = None;
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
                    tracker.touch(id, Use::Reads);
                }
                let writes = signatures.of(op).outputs;
                for (index, &id) in outputs.iter().enumerate() {
                    tracker.touch(id, output_use(writes.get(index).map(|o| o.write)));
                }
            }
            Instr::Collective { input, output, .. } => {
                tracker.touch(*input, Use::Reads);
                tracker.touch(*output, Use::Overwrites);
            }
            Instr::Send { buffer, .. } => tracker.touch(*buffer, Use::Reads),
            Instr::Recv { buffer, .. } => tracker.touch(*buffer, Use::Overwrites),
            Instr::P2p { ops } => {
                for op in ops {
                    match *op {
                        P2pOp::Send { buffer, .. } => tracker.touch(buffer, Use::Reads),
                        P2pOp::Recv { buffer, .. } => tracker.touch(buffer, Use::Overwrites),
                    }
                }
            }
            Instr::LoadBatch {
                tokens, targets, ..
            } => {
                for &id in tokens.iter().chain(targets.iter()) {
                    tracker.touch(id, Use::Overwrites);
                }
            }
        }
    }
    tracker.needs
}

/// The analysis' state while it walks the instructions.
struct Tracker {
    needs: Vec<bool>,
    /// Per buffer: allocated, and its zeros may still matter (with the element ranges written
    /// since, all by `CopyRange`s); None otherwise.
    fresh: Vec<Option<Vec<(u64, u64)>>>,
    numel: Vec<u64>,
}

impl Tracker {
    /// `id` is used as `how`: decide whether its zeros are needed, if that is still open.
    fn touch(&mut self, id: BufferId, how: Use) {
        let i = id.0 as usize;
        let Some(Some(written)) = self.fresh.get_mut(i) else {
            return;
        };
        match how {
            Use::Overwrites => self.fresh[i] = None,
            Use::Reads => {
                self.needs[i] = true;
                self.fresh[i] = None;
            }
            Use::WritesRange(start, end) => {
                written.push((start, end));
                if covers(written, self.numel[i]) {
                    self.fresh[i] = None;
                }
            }
        }
    }
}

/// Whether the ranges cover `[0, numel)` (sorts them).
fn covers(ranges: &mut [(u64, u64)], numel: u64) -> bool {
    ranges.sort_unstable();
    let mut reached = 0u64;
    for &(start, end) in ranges.iter() {
        if start > reached {
            return false;
        }
        reached = reached.max(end);
    }
    reached >= numel
}

/// How an op uses an output it writes as `write` says (the op table's `Write`): an output it
/// adds into, updates, or that is also its input is read; a range write covers only its range;
/// every other output (or one the signature does not list) is overwritten.
fn output_use(write: Option<Write>) -> Use {
    match write {
        Some(Write::Range(start, end)) => Use::WritesRange(start, end),
        Some(w) if w.reads() => Use::Reads,
        _ => Use::Overwrites,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::testspec::{build, Dims, Plan as PlanChoice};
    use crate::ir::op::Op;
    use crate::ir::{BufferKind, CollectiveKind, GroupId};
    use crate::lower::lower;
    use crate::spec::ZeroStage;

    use crate::memplan::tests::program_of as program;

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
            accumulate_param_grad: true,
            fp8: None,
        }
    }

    #[test]
    fn overwritten_outputs_need_no_zeros_accumulated_ones_do() {
        // b0 = param; b1 = 2·b0 (overwritten); b2, b3 accumulated (dw, db); b4 never used.
        let p = program(
            &[-4, 4, 4, 2, 4],
            vec![
                alloc(1),
                Instr::compute(Op::Scale { factor: 2.0 }, &[0], &[1]),
                alloc(2),
                alloc(3),
                Instr::compute(weight_grad(true), &[1, 1], &[2, 3]),
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
    fn a_first_gradient_write_needs_no_zeros_an_adding_one_does() {
        // b0 = x; b1, b2 dw and db of a MatmulBwdWeight that overwrites or adds.
        for accumulate in [false, true] {
            let op = weight_grad(true).with_param_grad_accumulation(accumulate);
            let p = program(
                &[-4, 4, 2],
                vec![
                    alloc(1),
                    alloc(2),
                    Instr::compute(op, &[0, 0], &[1, 2]),
                    free(1),
                    free(2),
                ],
            );
            assert_eq!(zero_needs(&p), vec![true, accumulate, accumulate]);
        }
    }

    #[test]
    fn a_dx_that_accumulates_needs_zeros_one_that_is_overwritten_does_not() {
        // b0 = w; b1 = dy; b2, b3 dx of MatmulBwdData and LayerNormBwd without and with
        // accumulate (b4..b7: the norm's statistics and dw).
        for accumulate in [false, true] {
            let data = Op::MatmulBwdData {
                in_dim: 2,
                out_dim: 2,
                accumulate,
                act_grad: None,
                swiglu: false,
                fp8: None,
            };
            let norm = Op::LayerNormBwd {
                dim: 2,
                bias: false,
                accumulate,
                accumulate_param_grad: true,
            };
            let p = program(
                &[-4, 4, 4, 4, 2, 2, -2, 2],
                vec![
                    alloc(1),
                    Instr::compute(Op::Zero, &[], &[1]),
                    alloc(2),
                    Instr::compute(data, &[1, 0], &[2]),
                    alloc(3),
                    alloc(7),
                    Instr::compute(norm, &[1, 1, 6, 4, 5], &[3, 7]),
                    free(1),
                    free(2),
                    free(3),
                    free(7),
                ],
            );
            let needs = zero_needs(&p);
            assert_eq!(
                (needs[2], needs[3], needs[7]),
                (accumulate, accumulate, true)
            );
        }
    }

    #[test]
    fn an_output_that_is_also_an_input_is_read_first() {
        let p = program(
            &[4],
            vec![
                alloc(0),
                Instr::compute(Op::Scale { factor: 2.0 }, &[0], &[0]),
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
                Instr::compute(Op::Zero, &[], &[2]),
                alloc(0),
                Instr::compute(Op::Copy, &[2], &[0]),
                Instr::compute(weight_grad(false), &[2, 2], &[0]),
                alloc(1),
                Instr::compute(Op::Copy, &[2], &[1]),
                free(1),
                alloc(1),
                Instr::compute(weight_grad(false), &[2, 2], &[1]),
                free(1),
                free(0),
                free(2),
            ],
        );
        assert_eq!(zero_needs(&p), vec![false, true, false]);
    }

    #[test]
    fn copy_ranges_overwrite_once_they_cover_the_destination() {
        // b1: [0, 4) of 4; b2: [0, 3) of 4 (ZeRO padding left), then read; b3: [1, 5) of 5,
        // then read; b4: a bucket of 6 filled by three copies out of order, then read; b5:
        // half written, then freed (nothing reads its zeros).
        let read = |b: u32| Instr::compute(Op::Copy, &[b], &[6]);
        let p = program(
            &[-4, 4, 4, 5, 6, 4, 8],
            vec![
                alloc(6),
                alloc(1),
                Instr::compute(copy_range(0, 4), &[0], &[1]),
                read(1),
                alloc(2),
                Instr::compute(copy_range(0, 3), &[0], &[2]),
                read(2),
                alloc(3),
                Instr::compute(copy_range(1, 4), &[0], &[3]),
                read(3),
                alloc(4),
                Instr::compute(copy_range(0, 2), &[0], &[4]),
                Instr::compute(copy_range(4, 2), &[0], &[4]),
                Instr::compute(copy_range(2, 2), &[0], &[4]),
                read(4),
                alloc(5),
                Instr::compute(copy_range(0, 2), &[0], &[5]),
                free(5),
                free(1),
                free(2),
                free(3),
                free(4),
                free(6),
            ],
        );
        assert_eq!(
            zero_needs(&p),
            vec![true, false, true, true, false, false, false]
        );
        assert!(covers(&mut [(3, 4), (0, 2), (1, 3)], 4));
        assert!(!covers(&mut [(0, 2), (3, 4)], 4));
        assert!(!covers(&mut [], 1));
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
                Instr::compute(Op::Zero, &[], &[0]),
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
                let buckets = program.buffers.iter().zip(&needs);
                let buckets: Vec<bool> = buckets
                    .filter(|(b, _)| b.name.starts_with("bucket."))
                    .map(|(_, need)| *need)
                    .collect();
                // Gradient buckets are filled by copies that cover them.
                assert_eq!(buckets.is_empty(), zero != ZeroStage::Zero0);
                assert!(buckets.iter().all(|need| !need), "{buckets:?}");
                for (buffer, need) in program.buffers.iter().zip(&needs) {
                    if *need {
                        assert!(
                            matches!(
                                buffer.kind,
                                BufferKind::Param
                                    | BufferKind::OptState
                                    | BufferKind::Metric
                                    | BufferKind::Fp8History
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
