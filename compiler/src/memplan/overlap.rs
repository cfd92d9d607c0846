//! How far each collective of a program can run ahead of the compute that waits for it, under
//! the executor's ordering rules for a stream-ordered backend (the CUDA backend's
//! `runtime/src/cuda/stream.rs`): collectives run in program order on a communication stream;
//! a compute op that reads or writes a buffer some queued collective uses, or an `Alloc`/`Free`
//! of one (the memory plan gives a freed buffer's bytes to later buffers, so the runtime orders
//! every reuse of those bytes after the collective at the `Free`), makes the compute stream wait
//! for that collective, which also covers every collective queued before it; the host reads the
//! loss and gradient norm after the last instruction, waiting for everything left.
//!
//! A collective's *run-ahead* is the number of instructions the executor queues between the
//! collective and the first one that waits for it: 0 means the very next instruction waits, so
//! the collective cannot overlap any compute. The report counts the instructions that wait and
//! the collectives waited for at once.
use crate::ir::{BufferId, Instr, Program};
use serde::Serialize;
use std::collections::HashMap;

/// The overlap the ordering rules leave each collective of one program.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CommOverlap {
    /// Collective instructions in one step.
    pub collectives: u64,
    /// Instructions that make the compute stream wait for a queued collective.
    pub waiting_instructions: u64,
    /// Collectives whose very next instruction waits for them (run-ahead 0).
    pub waited_at_once: u64,
    /// Collectives nothing waits for before the end of the step.
    pub waited_at_end: u64,
    /// Per collective, in program order: (instruction index, run-ahead in instructions).
    #[serde(skip)]
    pub run_ahead: Vec<(usize, usize)>,
}

impl CommOverlap {
    /// The median run-ahead over the collectives (0 for none).
    pub fn median_run_ahead(&self) -> usize {
        let mut ahead: Vec<usize> = self.run_ahead.iter().map(|&(_, a)| a).collect();
        ahead.sort_unstable();
        ahead.get(ahead.len() / 2).copied().unwrap_or(0)
    }
}

/// The run-ahead of every collective of `program` (see the module docs). Point-to-point
/// transfers are not counted: the executor's transfers complete before the next instruction
/// where a peer waits for them.
pub fn comm_overlap(program: &Program) -> CommOverlap {
    let mut report = CommOverlap::default();
    // Buffer → index of the latest queued collective using it.
    let mut marks: HashMap<BufferId, usize> = HashMap::new();
    // Collectives queued and not yet waited for, in program order.
    let mut in_flight: Vec<usize> = Vec::new();
    for (index, instr) in program.instrs.iter().enumerate() {
        let touched: Vec<BufferId> = match instr {
            Instr::Collective { input, output, .. } => {
                report.collectives += 1;
                marks.insert(*input, index);
                marks.insert(*output, index);
                in_flight.push(index);
                continue;
            }
            Instr::Compute { .. } => instr.reads().into_iter().chain(instr.writes()).collect(),
            Instr::Alloc { buffer } | Instr::Free { buffer } => vec![*buffer],
            Instr::Send { .. }
            | Instr::Recv { .. }
            | Instr::P2p { .. }
            | Instr::LoadBatch { .. } => continue,
        };
        let needed = touched.iter().filter_map(|id| marks.get(id).copied()).max();
        let Some(upto) = needed.filter(|&c| in_flight.first().is_some_and(|&f| f <= c)) else {
            continue;
        };
        report.waiting_instructions += 1;
        settle(upto, index, &mut in_flight, &mut report);
        marks.retain(|_, c| *c > upto);
    }
    let end = program.instrs.len();
    report.waited_at_end = in_flight.len() as u64;
    settle(usize::MAX, end, &mut in_flight, &mut report);
    report.run_ahead.sort_unstable();
    report.waited_at_once = report.run_ahead.iter().filter(|&&(_, a)| a == 0).count() as u64;
    report
}

/// The collectives of `in_flight` up to index `upto` are waited for at instruction `at`.
fn settle(upto: usize, at: usize, in_flight: &mut Vec<usize>, report: &mut CommOverlap) {
    let done = in_flight.partition_point(|&c| c <= upto);
    for c in in_flight.drain(..done) {
        report.run_ahead.push((c, at - c - 1));
    }
}

#[cfg(test)]
mod tests {
    use super::comm_overlap;
    use crate::cost::testspec::{build, Plan as PlanChoice};
    use crate::ir::op::Op;
    use crate::ir::{BufferId, CollectiveKind, GroupId, Instr, ReduceOp};
    use crate::memplan::tests::{program_of, small_model};
    use crate::spec::ZeroStage;

    fn all_reduce(b: u32) -> Instr {
        Instr::Collective {
            kind: CollectiveKind::AllReduce { op: ReduceOp::Sum },
            group: GroupId(0),
            input: BufferId(b),
            output: BufferId(b),
            node: None,
        }
    }

    fn copy(from: u32, to: u32) -> Instr {
        let op = Op::CopyRange {
            src_offset: 0,
            dst_offset: 0,
            len: 4,
        };
        Instr::compute(op, &[from], &[to])
    }

    #[test]
    fn a_reader_right_after_a_collective_leaves_it_no_run_ahead() {
        let p = program_of(
            &[4, 4, 4],
            vec![
                Instr::Alloc {
                    buffer: BufferId(0),
                },
                Instr::Alloc {
                    buffer: BufferId(1),
                },
                all_reduce(0),
                copy(0, 1),
                Instr::Free {
                    buffer: BufferId(0),
                },
                Instr::Free {
                    buffer: BufferId(1),
                },
            ],
        );
        let o = comm_overlap(&p);
        assert_eq!(
            (o.collectives, o.waited_at_once, o.waiting_instructions),
            (1, 1, 1)
        );
        assert_eq!(o.run_ahead, [(2, 0)]);
    }

    #[test]
    fn unrelated_compute_runs_under_a_collective_until_a_free_or_a_later_wait() {
        let p = program_of(
            &[4, 4, 4, 4],
            vec![
                Instr::Alloc {
                    buffer: BufferId(0),
                },
                Instr::Alloc {
                    buffer: BufferId(1),
                },
                Instr::Alloc {
                    buffer: BufferId(2),
                },
                all_reduce(0),
                copy(2, 2),
                copy(2, 2),
                all_reduce(1),
                copy(2, 2),
                // Waiting for the second covers the first.
                Instr::Free {
                    buffer: BufferId(1),
                },
                Instr::Free {
                    buffer: BufferId(0),
                },
                Instr::Alloc {
                    buffer: BufferId(3),
                },
                all_reduce(3),
                Instr::Free {
                    buffer: BufferId(2),
                },
            ],
        );
        let o = comm_overlap(&p);
        assert_eq!(o.collectives, 3);
        assert_eq!(o.waiting_instructions, 1);
        assert_eq!(o.waited_at_end, 1);
        assert_eq!(o.run_ahead, [(3, 4), (6, 1), (11, 1)]);
        assert_eq!(o.waited_at_once, 0);
        assert_eq!(o.median_run_ahead(), 1);
    }

    /// A dp-2 GPT-2-style plan with buckets small enough that backward fills several.
    fn dp2(zero: ZeroStage, microbatches: u32) -> crate::ir::Plan {
        let dims = small_model();
        let choice = PlanChoice {
            dp: 2,
            zero,
            microbatches,
            ..PlanChoice::default()
        };
        let mut spec = build(&dims, &choice);
        spec.parallel.bucket_bytes = 1 << 18;
        crate::lower::lower(&spec).unwrap_or_else(|d| panic!("{:?}", d.items))
    }

    fn collectives_of(
        program: &crate::ir::Program,
        keep: impl Fn(&CollectiveKind) -> bool,
    ) -> Vec<usize> {
        program
            .instrs
            .iter()
            .enumerate()
            .filter(|(_, i)| matches!(i, Instr::Collective { kind, .. } if keep(kind)))
            .map(|(k, _)| k)
            .collect()
    }

    #[test]
    fn no_gradient_all_reduce_is_waited_for_while_backward_has_compute_left() {
        for microbatches in [1, 3] {
            let plan = dp2(ZeroStage::Zero0, microbatches);
            let program = &plan.programs[0];
            let buckets =
                collectives_of(program, |k| matches!(k, CollectiveKind::AllReduce { .. }));
            assert!(buckets.len() >= 4, "{} all-reduces", buckets.len());
            let o = comm_overlap(program);
            assert_eq!(o.waited_at_once, 0, "m {microbatches}: {:?}", o.run_ahead);
            // Every bucket but the last is waited for only after the last bucket's all-reduce
            // is queued: after the whole backward.
            let last_bucket = buckets[buckets.len() - 2];
            for &(at, ahead) in &o.run_ahead {
                assert!(
                    at + ahead >= last_bucket,
                    "m {microbatches}: the all-reduce at {at} is waited for {ahead} instructions \
                     later, before the last bucket's at {last_bucket}"
                );
            }
        }
    }

    #[test]
    fn zero2_reduce_scatters_run_under_the_next_buckets_backward() {
        let plan = dp2(ZeroStage::Zero2, 1);
        let program = &plan.programs[0];
        let scatters = collectives_of(program, |k| matches!(k, CollectiveKind::ReduceScatter));
        let o = comm_overlap(program);
        let ahead: Vec<usize> = o
            .run_ahead
            .iter()
            .filter(|(at, _)| scatters.contains(at))
            .map(|&(_, a)| a)
            .collect();
        assert_eq!(ahead.len(), scatters.len());
        // All but the last bucket's reduce-scatters overlap a bucket's worth of backward.
        let overlapped = ahead.iter().filter(|&&a| a > 10).count();
        assert!(overlapped * 2 > scatters.len(), "run-ahead {ahead:?}");
    }

    #[test]
    fn zero1_and_zero2_gathers_of_updated_shards_run_under_later_updates() {
        for zero in [ZeroStage::Zero1, ZeroStage::Zero2] {
            let plan = dp2(zero, 1);
            let program = &plan.programs[0];
            let gathers = collectives_of(program, |k| matches!(k, CollectiveKind::AllGather));
            assert!(gathers.len() >= 4, "{zero:?}: {} gathers", gathers.len());
            let o = comm_overlap(program);
            assert_eq!(o.waited_at_once, 0, "{zero:?}: {:?}", o.run_ahead);
        }
    }
}
