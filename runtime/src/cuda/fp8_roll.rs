//! Delayed FP8 scaling's step end in one launch. A lowered program rolls each amax history
//! with its own `Op::Fp8HistoryRoll`, one after another where no all-reduce sits between them
//! (one GPU, no dp): on Llama 3.2 1B that is 352 one-thread kernels, each followed by its scale
//! amax's copy to the host (`scale_amax`), some 3 ms of launches a step and as much again of
//! host time the GPU waits through.
//!
//! `prepare` finds each run of consecutive roll instructions whose histories and scale amaxes
//! the memory plan places (fixed addresses) and uploads a table of them. The run's first
//! instruction then rolls every member (`fp8_history_rolls`: a thread a history, the same
//! arithmetic as `fp8_history_roll`), writes their new scale amaxes into a staging array in the
//! run's order, and queues one copy of that array to the host; the other members find their
//! roll done. Nothing reads a history or scale amax between two members (they are consecutive
//! instructions), so the step's results are those of the rolls made one by one, bit for bit.
use super::args::Bound;
use super::device::driver_error;
use super::kernel::Kernel;
use super::{raw_ptr, Arg, CudaBackend};
use crate::error::{Result, RuntimeError};
use cudarc::driver::result as cu;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaSlice;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{BufferId, Program};
use std::collections::HashMap;

/// Threads of an `fp8_history_rolls` block (a history each).
const ROLL_THREADS: u32 = 128;

/// One roll of a run: its instruction, history and scale amax.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Member {
    index: usize,
    history: BufferId,
    amax: BufferId,
}

/// A run of consecutive rolls and its device table.
struct Run {
    members: Vec<Member>,
    /// Per member `{history, amax, len}` (three 8-byte words), then the staging array of one
    /// f32 per member.
    table: CudaSlice<u8>,
    staging_at: usize,
}

/// The prepared program's roll runs.
#[derive(Default)]
pub(super) struct Rolls {
    runs: Vec<Run>,
    /// The run whose first instruction is at this index.
    by_first: HashMap<usize, usize>,
    /// The instructions a run launched this pass has rolled already, with their buffers.
    done: HashMap<usize, Member>,
    /// Rolls made by run launches so far ([`CudaBackend::fp8_rolls_in_runs`]).
    rolled: u64,
}

impl Rolls {
    /// Device bytes the tables hold (`CudaBackend::reserved_bytes`).
    pub(super) fn bytes(&self) -> usize {
        self.runs.iter().map(|r| r.table.len()).sum()
    }
}

/// The runs of at least two consecutive `Fp8HistoryRoll` instructions of `program`.
fn find_runs(program: &Program) -> Vec<Vec<Member>> {
    let mut runs: Vec<Vec<Member>> = Vec::new();
    let mut current: Vec<Member> = Vec::new();
    for (index, instr) in program.instrs.iter().enumerate() {
        let member = instr.as_compute().and_then(|c| match c.op {
            Op::Fp8HistoryRoll(_) => Some(Member {
                index,
                history: *c.outputs.first()?,
                amax: *c.outputs.get(1)?,
            }),
            _ => None,
        });
        match member {
            Some(m) => current.push(m),
            None => runs.push(std::mem::take(&mut current)),
        }
    }
    runs.push(current);
    runs.retain(|r| r.len() > 1);
    runs
}

impl CudaBackend {
    /// Builds and uploads the table of every run of rolls of `program` whose buffers the memory
    /// plan places (called from `prepare`, after the planned regions exist).
    pub(super) fn prepare_rolls(&mut self, program: &Program) -> Result<()> {
        self.rolls = Rolls::default();
        for members in find_runs(program) {
            let pointer = |id: BufferId| self.planned.pointer(id.0 as usize);
            let mut words: Vec<u64> = Vec::with_capacity(3 * members.len());
            for m in &members {
                let (Some((history, bytes)), Some((amax, _))) =
                    (pointer(m.history), pointer(m.amax))
                else {
                    words.clear();
                    break;
                };
                words.extend([history, amax, bytes / 4]);
            }
            // A buffer outside the plan has no fixed address: leave the run one by one.
            if words.is_empty() {
                continue;
            }
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            let staging_at = bytes.len();
            let table =
                self.alloc_bytes(staging_at + 4 * members.len(), "an FP8 history roll table")?;
            // SAFETY: the allocation holds at least bytes.len() bytes; synchronous copy.
            unsafe { cu::memcpy_htod_sync(raw_ptr(&self.stream, &table), &bytes) }
                .map_err(|e| driver_error("uploading an FP8 history roll table", e))?;
            let first = members[0].index;
            self.rolls.by_first.insert(first, self.rolls.runs.len());
            self.rolls.runs.push(Run {
                members,
                table,
                staging_at,
            });
        }
        Ok(())
    }

    /// `Op::Fp8HistoryRoll` at instruction `index` as part of a run: the whole run rolled at
    /// its first instruction, nothing at the others. False where `index` is in no run (the
    /// caller rolls it alone).
    pub(super) fn roll_in_run(&mut self, index: usize, b: &Bound) -> Result<bool> {
        let (history, amax) = (b.output(0)?.id, b.output(1)?.id);
        if let Some(done) = self.rolls.done.remove(&index) {
            if (done.history, done.amax) != (history, amax) {
                return Err(roll_error(
                    index,
                    "rolls other buffers than its run's table holds",
                ));
            }
            self.scale_amaxes.copied_in_run(amax);
            return Ok(true);
        }
        let Some(&run) = self.rolls.by_first.get(&index) else {
            return Ok(false);
        };
        let members = &self.rolls.runs[run].members;
        if (members[0].history, members[0].amax) != (history, amax) {
            return Err(roll_error(
                index,
                "rolls other buffers than its run's table holds",
            ));
        }
        if let Some(pending) = self.rolls.done.keys().min() {
            return Err(roll_error(
                *pending,
                "was not reached before the next run of rolls began; run the program's \
                 instructions in order",
            ));
        }
        self.launch_run(run)?;
        let members = &self.rolls.runs[run].members;
        self.rolls.rolled += members.len() as u64;
        self.rolls.done = members[1..].iter().map(|m| (m.index, *m)).collect();
        Ok(true)
    }

    /// How many history rolls runs have made in their one launch so far (the others were made
    /// one by one): for tests and diagnosis.
    pub fn fp8_rolls_in_runs(&self) -> u64 {
        self.rolls.rolled
    }

    /// Rolls every member of run `run` and queues its scale amaxes' copy to the host.
    fn launch_run(&mut self, run: usize) -> Result<()> {
        let r = &self.rolls.runs[run];
        let count = r.members.len();
        let base = raw_ptr(&self.stream, &r.table);
        let staging = base + r.staging_at as CUdeviceptr;
        let amaxes: Vec<BufferId> = r.members.iter().map(|m| m.amax).collect();
        let blocks = (count as u32).div_ceil(ROLL_THREADS);
        let args = [Arg::Ptr(base), Arg::I64(count as i64), Arg::Ptr(staging)];
        self.launch(
            Kernel::Fp8HistoryRolls,
            (blocks, 1, 1),
            (ROLL_THREADS, 1, 1),
            0,
            &args,
        )?;
        for &id in &amaxes {
            self.scale_amaxes.written(id);
        }
        (self.scale_amaxes).copy_run_after_roll(&self.ctx, &self.stream, &amaxes, staging)
    }
}

fn roll_error(index: usize, what: &str) -> RuntimeError {
    RuntimeError::Op {
        op: format!("fp8_history_roll (instruction {index})"),
        what: what.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parc_compiler::ir::fp8::Fp8HistoryAttrs;
    use parc_compiler::ir::{Buffer, BufferKind, DType, Instr};

    #[test]
    fn runs_are_consecutive_rolls_of_two_or_more() {
        // Buffers 0..4 histories, 4..8 their scale amaxes.
        let buffers = (0..8)
            .map(|b| Buffer {
                name: format!("b{b}"),
                shape: vec![if b < 4 { 5 } else { 1 }],
                dtype: DType::F32,
                kind: BufferKind::Fp8History,
            })
            .collect();
        let roll = |h: u32| {
            let attrs = Fp8HistoryAttrs {
                history: 4,
                rows: None,
                cols: 0,
            };
            Instr::compute(Op::Fp8HistoryRoll(attrs), &[h], &[h, h + 4])
        };
        let copy = |from: u32, to: u32| Instr::compute(Op::Copy, &[from], &[to]);
        let instrs = vec![roll(0), roll(1), copy(1, 2), roll(2), copy(2, 3), roll(3)];
        let program = Program::new("test", buffers, instrs);
        let runs = find_runs(&program);
        assert_eq!(runs.len(), 1, "{runs:?}");
        let ids: Vec<_> = (runs[0].iter())
            .map(|m| (m.index, m.history.0, m.amax.0))
            .collect();
        assert_eq!(ids, vec![(0, 0, 4), (1, 1, 5)]);
    }
}
