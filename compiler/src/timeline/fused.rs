//! The runs of optimizer instructions a backend launches as one (`crate::ir::optimizer_runs`:
//! the CUDA backend's multi-tensor AdamW/SGD, its one-pass sums of squares and delayed FP8
//! scaling's history rolls; and a GEMM's SwiGLU epilogue with the FP8 quantizations of what it
//! wrote, `crate::ir::swiglu_runs`), as the timeline prices and places them.
//!
//! Where the cost model's backend fuses them ([`StepCosts::fuses_optimizer_runs`]) a run is one
//! op, priced by [`StepCosts::fused_run`] (one launch of its members' summed bytes) and run
//! where the backend runs it: at its first member's position, once every member's buffers are
//! ready (the backend orders the launch after all the communication on them), making every
//! member's outputs ready when it ends; its later members take no time. A run of updates that
//! absorbed its members' refresh copies (`optimizer_runs::Refresh`: the launch also writes the
//! bf16 working copies) is priced with their outputs written (2 bytes an element more), waits
//! for and readies their buffers too, and the copies take no time. Elsewhere (the CPU backend)
//! every instruction is priced and run alone. Finding the runs is linear in the program, done
//! once per program a simulation runs.
use super::costs::StepCosts;
use crate::ir::op::Op;
use crate::ir::optimizer_runs::{find_roll_runs, find_runs, find_sum_squares_runs};
use crate::ir::swiglu_runs::{find_swiglu_runs, SwigluRun};
use crate::ir::{Instr, Program};

/// One run the backend launches as one op.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedRun {
    /// Its members' instruction indices, in program order (at least two).
    pub members: Vec<usize>,
    /// The instruction indices of the refresh copies its launch makes, in program order.
    pub refreshes: Vec<usize>,
    /// The seconds of its one launch.
    pub seconds: f64,
}

impl FusedRun {
    /// The instruction indices of everything its launch does: members, then refresh copies.
    pub fn instructions(&self) -> impl Iterator<Item = usize> + '_ {
        self.members.iter().chain(&self.refreshes).copied()
    }

    /// A run of `members` and `refreshes` of `program`, priced by `costs`.
    fn priced(
        program: &Program,
        costs: &dyn StepCosts,
        members: Vec<usize>,
        refreshes: Vec<usize>,
    ) -> FusedRun {
        let instrs = |indices: &[usize]| -> Vec<&Instr> {
            (indices.iter())
                .filter_map(|&i| program.instrs.get(i))
                .collect()
        };
        let seconds = costs.fused_run(program, &instrs(&members), &instrs(&refreshes));
        FusedRun {
            members,
            refreshes,
            seconds,
        }
    }
}

/// What an instruction is to the fused runs of its program.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Role<'a> {
    /// The run's first member: the whole run runs here.
    First(&'a FusedRun),
    /// A later member: the run already ran it.
    Later,
}

/// The fused runs of one program (none where the backend does not fuse).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FusedRuns {
    /// Every member's instruction index with its run's index, by instruction.
    members: Vec<(usize, usize)>,
    runs: Vec<FusedRun>,
}

impl FusedRuns {
    /// The runs of `program` the backend `costs` prices fuses, each priced by it; none where it
    /// does not fuse.
    pub fn of(program: &Program, costs: &dyn StepCosts) -> FusedRuns {
        if !costs.fuses_optimizer_runs() {
            return FusedRuns::default();
        }
        let updates = find_runs(program).into_iter().map(|run| {
            let members = run.members.iter().map(|m| m.index).collect();
            let mut refreshes: Vec<usize> = (run.members.iter())
                .filter_map(|m| m.refresh.map(|r| r.index))
                .collect();
            refreshes.sort_unstable();
            FusedRun::priced(program, costs, members, refreshes)
        });
        let sums = find_sum_squares_runs(program).into_iter().map(|run| {
            let members = run.members.iter().map(|m| m.index).collect();
            FusedRun::priced(program, costs, members, Vec::new())
        });
        let mut runs: Vec<FusedRun> = updates.chain(sums).collect();
        // A run of history rolls is one launch of a thread a history: its first member's price.
        runs.extend(find_roll_runs(program).into_iter().map(|run| {
            let members: Vec<usize> = run.members.iter().map(|m| m.index).collect();
            let first = members.first().and_then(|&i| program.instrs.get(i));
            let seconds = first.map_or(0.0, |f| costs.compute(program, f));
            FusedRun {
                members,
                refreshes: Vec::new(),
                seconds,
            }
        }));
        runs.extend(find_swiglu_runs(program).into_iter().map(|run| {
            let seconds = swiglu_run_seconds(program, costs, &run);
            FusedRun {
                members: run.instructions(),
                refreshes: Vec::new(),
                seconds,
            }
        }));
        runs.sort_by_key(|r| r.members.first().copied());
        let mut members: Vec<(usize, usize)> = (runs.iter().enumerate())
            .flat_map(|(r, run)| run.instructions().map(move |i| (i, r)))
            .collect();
        members.sort_unstable();
        FusedRuns { members, runs }
    }

    /// What instruction `index` (whose op is `op`) is to the runs (an absorbed refresh copy is a
    /// later member); None for one outside them.
    pub fn role(&self, index: usize, op: &Op) -> Option<Role<'_>> {
        if self.members.is_empty() || !fusable(op) {
            return None;
        }
        let at = (self.members)
            .binary_search_by_key(&index, |&(i, _)| i)
            .ok()?;
        let run = self.runs.get(self.members[at].1)?;
        match run.members.first() {
            Some(&first) if first == index => Some(Role::First(run)),
            _ => Some(Role::Later),
        }
    }
}

/// Whether `op` can be a run's member or refresh copy (the ops `crate::ir::optimizer_runs`
/// and `crate::ir::swiglu_runs` fuse).
fn fusable(op: &Op) -> bool {
    matches!(
        op,
        Op::AdamW { .. }
            | Op::Sgd { .. }
            | Op::SumSquares
            | Op::Fp8HistoryRoll(_)
            | Op::Copy
            | Op::Matmul { swiglu: true, .. }
            | Op::MatmulBwdData { swiglu: true, .. }
            | Op::Fp8AmaxRecord(_)
            | Op::Fp8Quantize(_)
    )
}

/// A SwiGLU run's seconds: its GEMM's, and each quantization's share of its own price that its
/// writes take (the bytes of its layouts over those it reads and writes alone: its read of the
/// tensor is the epilogue's); the records ride on the quantizations at no cost, as alone.
fn swiglu_run_seconds(program: &Program, costs: &dyn StepCosts, run: &SwigluRun) -> f64 {
    let price = |at: usize| {
        program
            .instrs
            .get(at)
            .map(|i| (i, costs.compute(program, i)))
    };
    let bytes = |ids: &[crate::ir::BufferId]| -> f64 {
        (ids.iter())
            .filter_map(|&b| program.buffer(b))
            .map(|b| costs.bytes(b))
            .sum()
    };
    let quantizations: f64 = (run.quantizes.iter())
        .filter_map(|&q| price(q))
        .filter_map(|(instr, seconds)| {
            let c = instr.as_compute()?;
            let read = bytes(c.inputs.get(..1)?);
            let written = bytes(c.outputs);
            (read + written > 0.0).then(|| seconds * written / (read + written))
        })
        .sum();
    price(run.producer).map_or(0.0, |(_, s)| s) + quantizations
}

/// Each instruction's compute seconds as the timeline charges them (0 for other instructions):
/// a fused run's on its first member and 0 on its later ones.
pub fn compute_seconds(program: &Program, costs: &dyn StepCosts) -> Vec<f64> {
    let fused = FusedRuns::of(program, costs);
    (program.instrs.iter().enumerate())
        .map(
            |(index, instr)| match instr.op().and_then(|op| fused.role(index, op)) {
                Some(Role::First(run)) => run.seconds,
                Some(Role::Later) => 0.0,
                None => costs.compute(program, instr),
            },
        )
        .collect()
}
