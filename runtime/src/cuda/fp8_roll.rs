//! Delayed FP8 scaling's step end in one launch. A lowered program rolls each amax history
//! with its own `Op::Fp8HistoryRoll`, one after another where no all-reduce sits between them
//! (one GPU, no dp): on Llama 3.2 1B that is 352 one-thread kernels, each followed by its scale
//! amax's copy to the host (`scale_amax`), some 3 ms of launches a step and as much again of
//! host time the GPU waits through.
//!
//! `prepare` takes each run of consecutive rolls (`parc_compiler::ir::optimizer_runs::
//! find_roll_runs`) whose histories and scale amaxes the memory plan places (fixed addresses)
//! and uploads a table of them. The run's first instruction then rolls every member
//! (`fp8_history_rolls`: a thread a history, the same arithmetic as `fp8_history_roll`), writes
//! their new scale amaxes into a staging array in the run's order, and queues one copy of that
//! array to the host; the other members find their roll done. Nothing reads a history or scale
//! amax between two members (they are consecutive instructions), so the step's results are
//! those of the rolls made one by one, bit for bit.
//!
//! The launch also writes each new scale amax's tensorwise dequantization factors `1/s`, one
//! per FP8 format, into the table. Until something else writes that scale amax
//! ([`CudaBackend::scale_amax_written`]), a quantized GEMM reading it may point cuBLASLt at its
//! factor ([`CudaBackend::rolled_factor`]) instead of computing it with an `fp8_scales` launch
//! (the `fp8_factors` kernel variant, `rolled`): some 480 one-thread launches a step on Llama
//! 3.2 1B.
use super::args::Bound;
use super::device::driver_error;
use super::kernel::Kernel;
use super::{raw_ptr, Arg, CudaBackend};
use crate::error::{Result, RuntimeError};
use cudarc::driver::result as cu;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaSlice;
use parc_compiler::ir::fp8::Fp8Format;
use parc_compiler::ir::optimizer_runs::{find_roll_runs, RollMember, RollRun};
use parc_compiler::ir::{BufferId, Program};
use std::collections::{HashMap, HashSet};

/// Threads of an `fp8_history_rolls` block (a history each).
const ROLL_THREADS: u32 = 128;

/// Bytes from one dequantization factor to the next in a run's table: cuBLASLt takes a scale
/// pointer only at a 16-byte boundary (at 4 it answers `CUBLAS_STATUS_NOT_SUPPORTED`, measured
/// on an H100), so each factor has its own 16 bytes (`fp8_history_rolls` writes them so).
const FACTOR_STRIDE: usize = 16;

/// A run of consecutive rolls and its device table.
struct Run {
    members: Vec<RollMember>,
    /// Per member `{history, amax, len}` (three 8-byte words), then the staging array of one
    /// f32 per member, then from a multiple of 16 bytes the factors: per member `1/s` for
    /// E4M3, then for E5M2, each at its own [`FACTOR_STRIDE`] bytes.
    table: CudaSlice<u8>,
    staging_at: usize,
    factors_at: usize,
}

/// The prepared program's roll runs.
#[derive(Default)]
pub(super) struct Rolls {
    runs: Vec<Run>,
    /// The run whose first instruction is at this index.
    by_first: HashMap<usize, usize>,
    /// The instructions a run launched this pass has rolled already, with their buffers.
    done: HashMap<usize, RollMember>,
    /// Rolls made by run launches so far ([`CudaBackend::fp8_rolls_in_runs`]).
    rolled: u64,
    /// Each scale amax a run rolls: its run and its place there.
    member_of: HashMap<BufferId, (usize, usize)>,
    /// The scale amaxes whose factors in their run's table are those of their present value
    /// (rolled, and not written since).
    fresh: HashSet<BufferId>,
}

impl Rolls {
    /// Device bytes the tables hold (`CudaBackend::reserved_bytes`).
    pub(super) fn bytes(&self) -> usize {
        self.runs.iter().map(|r| r.table.len()).sum()
    }
}

impl CudaBackend {
    /// Builds and uploads the table of every run of rolls of `program` whose buffers the memory
    /// plan places (called from `prepare`, after the planned regions exist).
    pub(super) fn prepare_rolls(&mut self, program: &Program) -> Result<()> {
        self.rolls = Rolls::default();
        for RollRun { members } in find_roll_runs(program) {
            let pointer = |id: BufferId| self.planned.pointer(id.0 as usize);
            let entries: Option<Vec<[u64; 3]>> = (members.iter())
                .map(|m| {
                    let (history, bytes) = pointer(m.history)?;
                    let (amax, _) = pointer(m.amax)?;
                    Some([history, amax, bytes / 4])
                })
                .collect();
            // A buffer outside the plan has no fixed address: leave the run one by one.
            let Some(entries) = entries else { continue };
            let bytes: Vec<u8> = (entries.iter().flatten())
                .flat_map(|w| w.to_le_bytes())
                .collect();
            let staging_at = bytes.len();
            let factors_at = (staging_at + 4 * members.len()).next_multiple_of(FACTOR_STRIDE);
            let factors_bytes = 2 * FACTOR_STRIDE * members.len();
            let table =
                self.alloc_bytes(factors_at + factors_bytes, "an FP8 history roll table")?;
            // SAFETY: the allocation holds at least bytes.len() bytes; synchronous copy.
            unsafe { cu::memcpy_htod_sync(raw_ptr(&self.stream, &table), &bytes) }
                .map_err(|e| driver_error("uploading an FP8 history roll table", e))?;
            let (first, run) = (members[0].index, self.rolls.runs.len());
            self.rolls.by_first.insert(first, run);
            for (k, m) in members.iter().enumerate() {
                self.rolls.member_of.insert(m.amax, (run, k));
            }
            self.rolls.runs.push(Run {
                members,
                table,
                staging_at,
                factors_at,
            });
        }
        Ok(())
    }

    /// `Op::Fp8HistoryRoll` at instruction `index` as part of a run: the whole run rolled at
    /// its first instruction, nothing at the others. False where `index` is in no run (the
    /// caller rolls it alone).
    pub(super) fn roll_in_run(&mut self, index: usize, b: &Bound) -> Result<bool> {
        let (history, amax) = (b.output(0)?.id, b.output(1)?.id);
        let rolls_its = |m: &RollMember| {
            if (m.history, m.amax) == (history, amax) {
                return Ok(());
            }
            Err(RuntimeError::Op {
                op: format!("fp8_history_roll (instruction {index})"),
                what: "rolls other buffers than its run's table holds".into(),
            })
        };
        if let Some(done) = self.rolls.done.remove(&index) {
            rolls_its(&done)?;
            // The op's own write (`compute`) marked them stale; the run's launch wrote them.
            self.scale_amaxes.copied_in_run(amax);
            self.rolls.fresh.insert(amax);
            return Ok(true);
        }
        let Some(&run) = self.rolls.by_first.get(&index) else {
            return Ok(false);
        };
        rolls_its(&self.rolls.runs[run].members[0])?;
        // Members a pass did not reach (it stopped inside the run) were rolled by its launch
        // all the same: nothing of theirs is left to do.
        self.launch_run(run)?;
        let members = &self.rolls.runs[run].members;
        self.rolls.rolled += members.len() as u64;
        self.rolls.done = members[1..].iter().map(|m| (m.index, *m)).collect();
        self.rolls.fresh.extend(members.iter().map(|m| m.amax));
        Ok(true)
    }

    /// Buffer `id` is about to be written (by an op, from the host or by communication),
    /// allocated or freed: neither the host's copy of its value, if it is a scale amax
    /// (`scale_amax`), nor its factors in a roll table describe it any more.
    pub(super) fn scale_amax_written(&mut self, id: BufferId) {
        self.scale_amaxes.written(id);
        if !self.rolls.fresh.is_empty() {
            self.rolls.fresh.remove(&id);
        }
    }

    /// The device address of scale amax `amax`'s tensorwise dequantization factor for `format`,
    /// where a run's launch wrote it and nothing has written `amax` since; None otherwise.
    pub(super) fn rolled_factor(&self, amax: BufferId, format: Fp8Format) -> Option<CUdeviceptr> {
        if !self.rolls.fresh.contains(&amax) {
            return None;
        }
        let &(run, k) = self.rolls.member_of.get(&amax)?;
        let r = &self.rolls.runs[run];
        let slot = 2 * k + usize::from(format == Fp8Format::E5m2);
        let at = r.factors_at + FACTOR_STRIDE * slot;
        Some(raw_ptr(&self.stream, &r.table) + at as CUdeviceptr)
    }

    /// Scale amax `amax`'s tensorwise dequantization factors (E4M3, E5M2) as its run's last
    /// launch wrote them, where they still describe it (see [`Self::rolled_factor`]): for tests
    /// and diagnosis. Waits for the device.
    pub fn fp8_rolled_factors(&self, amax: BufferId) -> Result<Option<[f32; 2]>> {
        let Some(at) = self.rolled_factor(amax, Fp8Format::E4m3) else {
            return Ok(None);
        };
        self.stream
            .synchronize()
            .map_err(|e| driver_error("waiting for an FP8 history roll", e))?;
        let mut bytes = [0u8; 2 * FACTOR_STRIDE];
        // SAFETY: `at` starts a member's two factor slots inside a live roll table; the stream
        // is idle.
        unsafe { cu::memcpy_dtoh_sync(&mut bytes, at) }
            .map_err(|e| driver_error("reading a roll's FP8 factors", e))?;
        let f = |k: usize| f32::from_le_bytes([bytes[k], bytes[k + 1], bytes[k + 2], bytes[k + 3]]);
        Ok(Some([f(0), f(FACTOR_STRIDE)]))
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
        let factors = base + r.factors_at as CUdeviceptr;
        let amaxes: Vec<BufferId> = r.members.iter().map(|m| m.amax).collect();
        let blocks = (count as u32).div_ceil(ROLL_THREADS);
        let args = [
            Arg::Ptr(base),
            Arg::I64(count as i64),
            Arg::Ptr(staging),
            Arg::Ptr(factors),
            Arg::F32(Fp8Format::E4m3.max()),
            Arg::F32(Fp8Format::E5m2.max()),
        ];
        self.launch(
            Kernel::Fp8HistoryRolls,
            (blocks, 1, 1),
            (ROLL_THREADS, 1, 1),
            0,
            &args,
        )?;
        (self.scale_amaxes).copy_run_after_roll(&self.ctx, &self.stream, &amaxes, staging)
    }
}
