//! The optimizer family on the GPU: gradient clipping's sums of squares (`SumSquares`, per
//! instruction or fused: `sum_squares`) and coefficient (`ClipCoef`), and the AdamW and SGD
//! updates, per tensor (`adamw`, `sgd` in kernels/optimizer.cu) or fused.
//!
//! The fused optimizer: one multi-tensor AdamW (or SGD) launch per run of optimizer
//! instructions instead of one launch per parameter tensor. The program keeps one instruction
//! per tensor; `parc_compiler::ir::optimizer_runs` finds the runs that may be fused. Because
//! the memory plan gives every buffer one device address for the whole run, `prepare` writes
//! each run's table once (per tensor: pointers to g, coef, param and state, the element count
//! and the weight decay; per block: which tensor and which chunk of `CHUNK_LEN` elements) into
//! a device allocation of its own. When the executor reaches a run's first instruction the backend
//! checks the buffers are still where the table says, orders the launch after any
//! communication on them, and launches `adamw_multi` / `sgd_multi` (kernels/optimizer.cu) over
//! the whole run; the run's later updates must then arrive in order, with the same step
//! scalars, and become no-ops (an update out of order, or an `Alloc` of a buffer a pending
//! update uses, is an error: that update already ran); the instructions between them run as
//! usual. The
//! kernels share their per-element code with the per-tensor ones, so the results are
//! bit-identical, including the skipped update of an fp16 step whose coefficient is not
//! finite.
//!
//! A run also makes the refresh copies it absorbed (`optimizer_runs::Refresh`: in a bf16 run
//! without ZeRO, each weight matrix's `Copy` of its updated f32 master into its bf16 working
//! copy): the table holds each such tensor's working copy, and the kernels write the updated
//! param rounded to bf16 into it as the `Copy`'s `convert` kernel rounds (`round_bf16`; on a
//! skipped step the param as it is), so the working copies are bit-identical too and the copy
//! costs 2 bytes an element written instead of a launch reading 4 and writing 2. Each absorbed
//! `Copy` then arrives in its place among the run's later instructions and is a checked no-op:
//! out of order, with its buffers bound elsewhere than the table says, or with no launch of its
//! run in flight, it is an error, not skipped. Without a memory plan, or with
//! `with_fused_optimizer(false)`, every instruction takes the per-tensor path (the copies
//! included).
use super::args::{n, p, Bound};
use super::device::driver_error;
use super::kernel::Kernel;
use super::{raw_ptr, sum_squares, Arg, CudaBackend};
use crate::backend::StepScalars;
use crate::error::{Result, RuntimeError};
use cudarc::driver::result as cu;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaSlice;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::optimizer_runs::{find_runs, OptimizerRun, RunKind, RunMember};
use parc_compiler::ir::{BufferId, DType, Program};
use std::collections::HashMap;

/// Elements one block of a multi-tensor launch updates.
const CHUNK_LEN: u64 = 16384;
/// Threads per block of a multi-tensor launch.
const THREADS: u32 = 256;
/// Bytes of one `OptTensor` (kernels/optimizer.cu): six pointers, n, wd, padding.
const TENSOR_BYTES: usize = 64;
/// Pointers of one `OptTensor`: g, coef, param, state0, state1, working.
const POINTERS: usize = 6;
/// The `OptTensor` pointer of the param.
const PARAM_SLOT: usize = 2;
/// The `OptTensor` pointer of the bf16 working copy a refresh copy writes (0: none).
const WORKING_SLOT: usize = 5;
/// Bytes of one `OptChunk`: tensor index and first element, both i64.
const CHUNK_BYTES: usize = 16;

/// The error of an update at step 0 (the step count is 1-based).
const STEP_ZERO: &str = "the optimizer step count is 1-based; got step 0";

/// Run an op of the optimizer family on its own (the instructions a fused run does not take).
pub(super) fn run(be: &mut CudaBackend, b: &Bound, scalars: &StepScalars) -> Result<()> {
    match b.op {
        Op::SumSquares => sum_squares::per_instruction(be, b.input(0)?, b.output(0)?),
        Op::ClipCoef { max_norm } => clip_coef(be, b, *max_norm, scalars.loss_scale),
        Op::AdamW { .. } | Op::Sgd { .. } => update(be, b, scalars),
        _ => Err(b.err("is not an optimizer op")),
    }
}

/// One tensor's AdamW or SGD update (g, coef; param and its state).
fn update(be: &mut CudaBackend, b: &Bound, scalars: &StepScalars) -> Result<()> {
    if scalars.step == 0 {
        return Err(b.err(STEP_ZERO));
    }
    let g = b.input(0)?;
    let mut args = vec![p(g), p(b.input(1)?), p(b.output(0)?)];
    let lr = Arg::F32(scalars.lr as f32);
    let kernel = match *b.op {
        Op::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay: decay,
        } => {
            let (bias1, bias2) = adam_bias_corrections(beta1, beta2, scalars.step);
            let (m, v) = (b.output(1)?, b.output(2)?);
            args.extend([p(m), p(v), n(g.len)]);
            let hyper = [beta1, beta2, eps, decay].map(|h| Arg::F32(h as f32));
            args.extend(hyper);
            args.extend([lr, Arg::F32(bias1), Arg::F32(bias2)]);
            Kernel::Adamw
        }
        Op::Sgd {
            momentum,
            weight_decay,
        } => {
            // The momentum buffer where the op has one (momentum ≠ 0), else none.
            let buf = b.outputs.get(1).map_or(0, |m| m.ptr);
            args.extend([Arg::Ptr(buf), n(g.len)]);
            args.extend([Arg::F32(momentum as f32), Arg::F32(weight_decay as f32), lr]);
            args.push(Arg::I32(i32::from(scalars.step == 1)));
            Kernel::Sgd
        }
        _ => return Err(b.err("is not an optimizer update")),
    };
    be.launch_n(kernel, g.len, &args)
}

/// coef = the clipping coefficient of the gradient norm √sumsq (a negative max norm: no
/// clipping), unscaled by a loss scale; a NaN marks a step whose norm is not finite (an fp16
/// overflow, or `train.on_nonfinite`'s), which the updates skip. Always a kernel: the mark
/// depends on sumsq, which is on the device.
fn clip_coef(
    be: &mut CudaBackend,
    b: &Bound,
    max_norm: Option<f64>,
    loss_scale: Option<f64>,
) -> Result<()> {
    let (sumsq, coef) = (b.input(0)?, b.output(0)?);
    let args = [
        p(sumsq),
        p(coef),
        Arg::F64(max_norm.unwrap_or(-1.0)),
        Arg::F64(loss_scale.unwrap_or(1.0)),
        Arg::I32(1),
    ];
    be.launch(Kernel::ClipCoef, (1, 1, 1), (32, 1, 1), 0, &args)
}

/// Adam's bias corrections `1 - β₁ᵗ`, `1 - β₂ᵗ` for the 1-based step `t`, as the kernels take
/// them (one definition for the per-tensor and the fused launch).
pub(super) fn adam_bias_corrections(beta1: f64, beta2: f64, step: u64) -> (f32, f32) {
    let t = i32::try_from(step).unwrap_or(i32::MAX);
    ((1.0 - beta1.powi(t)) as f32, (1.0 - beta2.powi(t)) as f32)
}

/// One tensor of a table: device pointers to g, coef, param, state0, state1 and the working
/// copy of its refresh copy (0 for none).
#[derive(Clone, Copy, Debug, PartialEq)]
struct TableTensor {
    pointers: [CUdeviceptr; POINTERS],
    numel: u64,
    weight_decay: f32,
}

/// `m`'s buffers by their table slot (g, coef, param, state0, state1, working), each with the
/// element count it must have.
fn table_slots(m: &RunMember) -> Vec<(usize, BufferId, usize)> {
    let n = m.numel as usize;
    let mut slots = vec![(0, m.inputs[0], n), (1, m.inputs[1], 1)];
    let outputs = m.outputs.iter().enumerate();
    slots.extend(outputs.map(|(k, &id)| (PARAM_SLOT + k, id, n)));
    slots.extend(m.refresh.map(|r| (WORKING_SLOT, r.working, n)));
    slots
}

/// A run's table as bytes: the tensors, then (at `chunks_offset`) one chunk per block.
#[derive(Debug, PartialEq)]
struct TableBytes {
    bytes: Vec<u8>,
    chunks_offset: usize,
    blocks: u32,
}

/// Lays out `tensors` as `OptTensor`s followed by the `OptChunk`s that cover every element of
/// every tensor once (empty tensors get none).
fn encode_table(tensors: &[TableTensor]) -> Result<TableBytes> {
    let mut bytes = Vec::with_capacity(tensors.len() * TENSOR_BYTES);
    for t in tensors {
        for p in t.pointers {
            bytes.extend_from_slice(&p.to_le_bytes());
        }
        bytes.extend_from_slice(&t.numel.to_le_bytes());
        bytes.extend_from_slice(&t.weight_decay.to_le_bytes());
        bytes.extend_from_slice(&0i32.to_le_bytes());
    }
    let chunks_offset = bytes.len().next_multiple_of(CHUNK_BYTES);
    bytes.resize(chunks_offset, 0);
    let mut blocks = 0u64;
    for (index, t) in tensors.iter().enumerate() {
        let mut start = 0u64;
        while start < t.numel {
            bytes.extend_from_slice(&(index as u64).to_le_bytes());
            bytes.extend_from_slice(&start.to_le_bytes());
            start += CHUNK_LEN;
            blocks += 1;
        }
    }
    let blocks = u32::try_from(blocks)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| {
            RuntimeError::Unsupported(format!(
                "a fused optimizer run needs {blocks} blocks, more than one launch has (2^31 - 1)"
            ))
        })?;
    Ok(TableBytes {
        bytes,
        chunks_offset,
        blocks,
    })
}

/// An instruction of a run after its first member, which the run's launch already did.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Later {
    /// Member `k`'s update.
    Update(usize),
    /// Member `k`'s refresh copy.
    Refresh(usize),
}

/// One run on the device.
struct DeviceRun {
    run: OptimizerRun,
    /// The table (kept alive; `tensors` and `chunks` point into it).
    table: CudaSlice<u8>,
    tensors: CUdeviceptr,
    chunks: CUdeviceptr,
    blocks: u32,
    /// Per member, what the table holds for it.
    entries: Vec<TableTensor>,
    /// Its instructions after the first member, in program order.
    later: Vec<Later>,
}

impl DeviceRun {
    /// The member `later` belongs to.
    fn member(&self, later: Later) -> &RunMember {
        let (Later::Update(k) | Later::Refresh(k)) = later;
        &self.run.members[k]
    }

    /// `later`'s position in the program.
    fn index(&self, later: Later) -> usize {
        let m = self.member(later);
        match later {
            Later::Update(_) => m.index,
            Later::Refresh(_) => m.refresh.map_or(m.index, |r| r.index),
        }
    }

    /// Whether a compute call with these operands is `later`.
    fn is(&self, later: Later, op: &Op, inputs: &[BufferId], outputs: &[BufferId]) -> bool {
        let m = self.member(later);
        match later {
            Later::Update(_) => m.is(op, inputs, outputs),
            Later::Refresh(_) => m.is_refresh(op, inputs, outputs),
        }
    }

    /// Whether `later` uses buffer `id` (an update: its member's buffers, the working copy
    /// among them; a refresh copy: the param and the working copy).
    fn uses(&self, later: Later, id: BufferId) -> bool {
        let m = self.member(later);
        match later {
            Later::Update(_) => m.buffers().any(|b| b == id),
            Later::Refresh(_) => m.outputs[0] == id || m.refresh.is_some_and(|r| r.working == id),
        }
    }
}

/// `run`'s instructions after its first member (later updates and every refresh copy), in
/// program order.
fn later_instructions(run: &OptimizerRun) -> Vec<Later> {
    let members = run.members.iter().enumerate();
    let mut later: Vec<(usize, Later)> = (members.clone().skip(1))
        .map(|(k, m)| (m.index, Later::Update(k)))
        .chain(members.filter_map(|(k, m)| Some((m.refresh?.index, Later::Refresh(k)))))
        .collect();
    later.sort_by_key(|&(index, _)| index);
    later.into_iter().map(|(_, l)| l).collect()
}

/// Where the executor is inside a launched run.
#[derive(Clone, Copy)]
struct Cursor {
    run: usize,
    /// The run's later instruction expected next (an index into `DeviceRun::later`).
    next: usize,
    scalars: StepScalars,
}

/// The fused runs of the prepared program and the executor's position in them.
pub(super) struct FusedOptimizer {
    enabled: bool,
    runs: Vec<DeviceRun>,
    /// A run's first member's param buffer → the run.
    by_first: HashMap<BufferId, usize>,
    /// An absorbed refresh copy's working buffer → its run and member.
    by_working: HashMap<BufferId, (usize, usize)>,
    cursor: Option<Cursor>,
}

impl Default for FusedOptimizer {
    fn default() -> FusedOptimizer {
        FusedOptimizer {
            enabled: true,
            runs: Vec::new(),
            by_first: HashMap::new(),
            by_working: HashMap::new(),
            cursor: None,
        }
    }
}

impl FusedOptimizer {
    /// Device bytes of the tables.
    pub fn bytes(&self) -> usize {
        self.runs.iter().map(|r| r.table.len()).sum()
    }

    /// An error if a launched run's later update or refresh copy uses buffer `id`: allocating
    /// (zeroing) it now would come after the launch did that instruction (the run detection
    /// keeps such an `Alloc` out of a run, so this only trips when the instructions arrive out
    /// of the program's order).
    pub fn check_alloc(&self, id: BufferId) -> Result<()> {
        let Some(c) = &self.cursor else {
            return Ok(());
        };
        let run = &self.runs[c.run];
        match run.later[c.next..].iter().find(|&&l| run.uses(l, id)) {
            None => Ok(()),
            Some(&l) => Err(table_error(format!(
                "Alloc of buffer {} came after the fused launch at instruction {} already ran \
                 instruction {}, which uses it; run the program's instructions in order",
                id.0,
                run.run.members[0].index,
                run.index(l)
            ))),
        }
    }
}

fn table_error(what: String) -> RuntimeError {
    RuntimeError::Op {
        op: "fused optimizer".into(),
        what,
    }
}

impl CudaBackend {
    /// `false`: update every tensor with its own launch (the per-tensor path), e.g. to compare
    /// against the fused one. Takes effect at `prepare`.
    pub fn with_fused_optimizer(mut self, fused: bool) -> CudaBackend {
        self.fused.enabled = fused;
        self
    }

    /// The fused runs of the prepared program: how many updates each covers (empty before
    /// `prepare`, without a memory plan, or with the fused optimizer off).
    pub fn fused_optimizer_runs(&self) -> Vec<usize> {
        self.fused
            .runs
            .iter()
            .map(|r| r.run.members.len())
            .collect()
    }

    /// Per fused run of the prepared program (as [`CudaBackend::fused_optimizer_runs`]), how
    /// many refresh copies its launch makes.
    pub fn fused_optimizer_refreshes(&self) -> Vec<usize> {
        (self.fused.runs.iter())
            .map(|r| r.run.members.iter().filter(|m| m.refresh.is_some()).count())
            .collect()
    }

    /// Builds and uploads the table of every fusable run of `program` whose buffers the memory
    /// plan places (called from `prepare`, after the planned regions exist).
    pub(super) fn prepare_fused_optimizer(&mut self, program: &Program) -> Result<()> {
        let enabled = self.fused.enabled;
        self.fused = FusedOptimizer {
            enabled,
            ..FusedOptimizer::default()
        };
        if !enabled {
            return Ok(());
        }
        for run in find_runs(program) {
            let pointer = |id: BufferId| self.planned.pointer(id.0 as usize).map(|(p, _)| p);
            let entries: Option<Vec<TableTensor>> = run
                .members
                .iter()
                .map(|m| {
                    let mut pointers = [0; POINTERS];
                    for (slot, id, _) in table_slots(m) {
                        pointers[slot] = pointer(id)?;
                    }
                    Some(TableTensor {
                        pointers,
                        numel: m.numel,
                        weight_decay: m.weight_decay as f32,
                    })
                })
                .collect();
            // A buffer outside the plan has no fixed address: leave the run per-tensor.
            let Some(entries) = entries else { continue };
            let param = run.members[0].outputs[0];
            if self.fused.by_first.contains_key(&param) {
                continue;
            }
            let encoded = encode_table(&entries)?;
            let table = self.alloc_bytes(encoded.bytes.len(), "a fused optimizer table")?;
            let base = raw_ptr(&self.stream, &table);
            // SAFETY: the allocation holds at least encoded.bytes.len() bytes; synchronous copy.
            unsafe { cu::memcpy_htod_sync(base, &encoded.bytes) }
                .map_err(|e| driver_error("uploading a fused optimizer table", e))?;
            let index = self.fused.runs.len();
            self.fused.by_first.insert(param, index);
            for (k, m) in run.members.iter().enumerate() {
                if let Some(r) = m.refresh {
                    self.fused.by_working.insert(r.working, (index, k));
                }
            }
            self.fused.runs.push(DeviceRun {
                later: later_instructions(&run),
                run,
                table,
                tensors: base,
                chunks: base + encoded.chunks_offset as CUdeviceptr,
                blocks: encoded.blocks,
                entries,
            });
        }
        Ok(())
    }

    /// Handles `op` if it belongs to a fused run: the run's first instruction launches the whole
    /// run, its later updates and refresh copies are no-ops. Returns false for every other op
    /// (the per-tensor path).
    pub(super) fn fused_optimizer(
        &mut self,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
        scalars: &StepScalars,
    ) -> Result<bool> {
        if !matches!(op, Op::AdamW { .. } | Op::Sgd { .. } | Op::Copy) {
            return Ok(false);
        }
        if let Some(cursor) = self.fused.cursor {
            return self.fused_later(cursor, op, inputs, outputs, scalars);
        }
        if matches!(op, Op::Copy) {
            return self
                .refresh_outside_its_run(op, inputs, outputs)
                .map(|()| false);
        }
        let Some(&run) = outputs.first().and_then(|p| self.fused.by_first.get(p)) else {
            return Ok(false);
        };
        if !self.fused.runs[run].run.members[0].is(op, inputs, outputs) {
            return Ok(false);
        }
        self.launch_fused(run, scalars)?;
        self.fused.cursor = (!self.fused.runs[run].later.is_empty()).then_some(Cursor {
            run,
            next: 0,
            scalars: *scalars,
        });
        Ok(true)
    }

    /// The launched run's instruction expected next, `op` with these operands: a no-op when it
    /// is that instruction (an update with the launch's step scalars, a refresh copy whose
    /// buffers are where the launch wrote), an error when it is a later one (the launch already
    /// did it), else false (an instruction between the run's, the per-tensor path).
    fn fused_later(
        &mut self,
        cursor: Cursor,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
        scalars: &StepScalars,
    ) -> Result<bool> {
        let run = &self.fused.runs[cursor.run];
        let first = run.run.members[0].index;
        let expected = run.later[cursor.next];
        if !run.is(expected, op, inputs, outputs) {
            let later = run.later[cursor.next..].iter();
            if let Some(&l) = later.clone().find(|&&l| run.is(l, op, inputs, outputs)) {
                return Err(table_error(format!(
                    "instruction {} came before instruction {}, both already run by the fused \
                     launch at instruction {first}; run the program's instructions in order",
                    run.index(l),
                    run.index(expected)
                )));
            }
            // A copy between the run's instructions, unless it is another absorbed one.
            self.refresh_outside_its_run(op, inputs, outputs)?;
            return Ok(false);
        }
        match expected {
            Later::Update(_) if cursor.scalars != *scalars => {
                return Err(table_error(format!(
                    "instruction {} came with step scalars {scalars:?}, but its update already \
                     ran with {:?} (instruction {first})",
                    run.index(expected),
                    cursor.scalars
                )));
            }
            Later::Update(_) => {}
            Later::Refresh(k) => self.check_refresh_bound(cursor.run, k)?,
        }
        let more = cursor.next + 1 < self.fused.runs[cursor.run].later.len();
        self.fused.cursor = more.then_some(Cursor {
            next: cursor.next + 1,
            ..cursor
        });
        Ok(true)
    }

    /// An error if member `k` of run `run`'s param or working copy is bound elsewhere than
    /// the table its launch wrote through.
    fn check_refresh_bound(&self, run: usize, k: usize) -> Result<()> {
        let device_run = &self.fused.runs[run];
        let (m, entry) = (&device_run.run.members[k], &device_run.entries[k]);
        for (slot, id, want_len) in table_slots(m) {
            if slot != PARAM_SLOT && slot != WORKING_SLOT {
                continue;
            }
            let (b, want) = (self.buf(id)?, entry.pointers[slot]);
            if b.ptr != want || b.len != want_len {
                return Err(table_error(format!(
                    "buffer {} of instruction {}'s refresh copy is bound at {:#x} with {} \
                     elements, but the fused launch at instruction {} wrote it at {want:#x} with \
                     {want_len}; it moved in between (a backend bug: planned buffers never move)",
                    id.0,
                    m.refresh.map_or(m.index, |r| r.index),
                    b.ptr,
                    b.len,
                    device_run.run.members[0].index
                )));
            }
        }
        Ok(())
    }

    /// An error if `op` is a refresh copy a fused run absorbed that the launch in flight (if
    /// any) does not expect: it came before its run's first instruction or after the run was
    /// done with it (the launch makes it; made here it could see another param).
    fn refresh_outside_its_run(
        &self,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
    ) -> Result<()> {
        let Some(&(run, k)) = outputs.first().and_then(|w| self.fused.by_working.get(w)) else {
            return Ok(());
        };
        let device_run = &self.fused.runs[run];
        let m = &device_run.run.members[k];
        if !m.is_refresh(op, inputs, outputs) {
            return Ok(());
        }
        Err(table_error(format!(
            "instruction {}'s refresh copy came outside its fused run (the launch at \
             instruction {} makes it); run the program's instructions in order",
            m.refresh.map_or(m.index, |r| r.index),
            device_run.run.members[0].index
        )))
    }

    /// Checks run `index`'s buffers are bound where its table points, then launches it.
    fn launch_fused(&mut self, index: usize, scalars: &StepScalars) -> Result<()> {
        if scalars.step == 0 {
            return Err(table_error(STEP_ZERO.into()));
        }
        let mut ids = Vec::new();
        {
            let run = &self.fused.runs[index];
            for (m, entry) in run.run.members.iter().zip(&run.entries) {
                for (slot, id, want_len) in table_slots(m) {
                    let (b, want) = (self.buf(id)?, entry.pointers[slot]);
                    if b.ptr != want || b.len != want_len {
                        return Err(table_error(format!(
                            "buffer {} of instruction {} is bound at {:#x} with {} elements, but \
                             the table built at prepare has {want:#x} with {want_len} (a backend \
                             bug: planned buffers never move)",
                            id.0, m.index, b.ptr, b.len
                        )));
                    }
                    if slot == WORKING_SLOT && b.dtype != DType::Bf16 {
                        return Err(table_error(format!(
                            "buffer {} (the working copy instruction {}'s launch refreshes) is \
                             stored {:?}, but the kernel writes bf16",
                            id.0, m.index, b.dtype
                        )));
                    }
                    ids.push(id);
                }
            }
        }
        self.order_after_comm(ids)?;
        let run = &self.fused.runs[index];
        let (tensors, chunks, blocks) = (run.tensors, run.chunks, run.blocks);
        let lr = scalars.lr as f32;
        let chunk_len = Arg::I64(CHUNK_LEN as i64);
        match run.run.kind {
            RunKind::AdamW { beta1, beta2, eps } => {
                let (bias1, bias2) = adam_bias_corrections(beta1, beta2, scalars.step);
                let args = [
                    Arg::Ptr(tensors),
                    Arg::Ptr(chunks),
                    chunk_len,
                    Arg::F32(beta1 as f32),
                    Arg::F32(beta2 as f32),
                    Arg::F32(eps as f32),
                    Arg::F32(lr),
                    Arg::F32(bias1),
                    Arg::F32(bias2),
                ];
                self.launch(
                    Kernel::AdamwMulti,
                    (blocks, 1, 1),
                    (THREADS, 1, 1),
                    0,
                    &args,
                )
            }
            RunKind::Sgd { momentum } => {
                let args = [
                    Arg::Ptr(tensors),
                    Arg::Ptr(chunks),
                    chunk_len,
                    Arg::F32(momentum as f32),
                    Arg::F32(lr),
                    Arg::I32(i32::from(scalars.step == 1)),
                ];
                self.launch(Kernel::SgdMulti, (blocks, 1, 1), (THREADS, 1, 1), 0, &args)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_u64(bytes: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn table_layout_matches_the_kernels_structs() {
        let tensors = [
            TableTensor {
                pointers: [1, 2, 3, 4, 5, 14],
                numel: 2 * CHUNK_LEN + 1,
                weight_decay: 0.1,
            },
            TableTensor {
                pointers: [6, 7, 8, 0, 0, 0],
                numel: 0,
                weight_decay: 0.0,
            },
            TableTensor {
                pointers: [9, 10, 11, 12, 13, 0],
                numel: CHUNK_LEN,
                weight_decay: 0.0,
            },
        ];
        let t = encode_table(&tensors).unwrap();
        // 3 × 64 bytes of tensors, already a multiple of the chunks' 16.
        assert_eq!(t.chunks_offset, 192);
        // Tensor 2 (index 2) starts 128 bytes in: g, coef, param, state0, state1, working, n,
        // wd, padding.
        let second = 2 * TENSOR_BYTES;
        let pointers: Vec<u64> = (0..6).map(|k| read_u64(&t.bytes, second + 8 * k)).collect();
        assert_eq!(pointers, vec![9, 10, 11, 12, 13, 0]);
        assert_eq!(read_u64(&t.bytes, second + 48), CHUNK_LEN);
        assert_eq!(read_u64(&t.bytes, 8 * WORKING_SLOT), 14);
        let wd = f32::from_le_bytes(t.bytes[56..60].try_into().unwrap());
        assert_eq!(wd, 0.1f32);
        // Chunks: three of tensor 0 (the last holds one element), none of the empty tensor 1,
        // one of tensor 2.
        assert_eq!(t.blocks, 4);
        let chunks: Vec<(u64, u64)> = (0..4)
            .map(|c| {
                let at = t.chunks_offset + c * CHUNK_BYTES;
                (read_u64(&t.bytes, at), read_u64(&t.bytes, at + 8))
            })
            .collect();
        assert_eq!(
            chunks,
            vec![(0, 0), (0, CHUNK_LEN), (0, 2 * CHUNK_LEN), (2, 0)]
        );
        assert_eq!(t.bytes.len(), t.chunks_offset + 4 * CHUNK_BYTES);
    }

    #[test]
    fn bias_corrections_are_one_minus_the_betas_powers() {
        assert_eq!(adam_bias_corrections(0.5, 0.25, 1), (0.5, 0.75));
        assert_eq!(adam_bias_corrections(0.5, 0.25, 2), (0.75, 0.9375));
    }

    /// A run of three updates: buffers 1 + 4t .. 4 + 4t (g, param, m, v) of tensor t, the
    /// coefficient 0; tensors 0 and 2 refreshed into working copies 20 and 22 by copies at
    /// instructions 2 and 7 (after the run's last update, at 5).
    fn refreshing_run() -> OptimizerRun {
        use parc_compiler::ir::optimizer_runs::Refresh;
        use parc_compiler::ir::{Inputs, Outputs};
        let adam = Op::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let member = |t: u32, index: usize, refresh: Option<(usize, u32)>| RunMember {
            index,
            op: adam.clone(),
            inputs: Inputs::numbered(&[1 + 4 * t, 0]),
            outputs: Outputs::numbered(&[2 + 4 * t, 3 + 4 * t, 4 + 4 * t]),
            weight_decay: 0.1,
            numel: 100,
            refresh: refresh.map(|(index, w)| Refresh {
                index,
                working: BufferId(w),
            }),
        };
        OptimizerRun {
            kind: RunKind::AdamW {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
            },
            members: vec![
                member(0, 0, Some((2, 20))),
                member(1, 3, None),
                member(2, 5, Some((7, 22))),
            ],
        }
    }

    #[test]
    fn a_refreshed_tensor_has_its_working_copy_in_the_last_slot() {
        let run = refreshing_run();
        let slots = |k: usize| -> Vec<(usize, u32, usize)> {
            (table_slots(&run.members[k]).into_iter())
                .map(|(slot, id, n)| (slot, id.0, n))
                .collect()
        };
        let plain = vec![
            (0, 5, 100),
            (1, 0, 1),
            (2, 6, 100),
            (3, 7, 100),
            (4, 8, 100),
        ];
        assert_eq!(slots(1), plain);
        assert_eq!(slots(0).last(), Some(&(WORKING_SLOT, 20, 100)));
        assert_eq!(slots(0).len(), POINTERS);
    }

    #[test]
    fn a_runs_later_instructions_are_its_updates_and_refresh_copies_in_program_order() {
        use Later::{Refresh, Update};
        let run = refreshing_run();
        let later = later_instructions(&run);
        assert_eq!(later, vec![Refresh(0), Update(1), Update(2), Refresh(2)]);
        let copy = |from: u32, to: u32| (Op::Copy, [BufferId(from)], [BufferId(to)]);
        let (op, inputs, outputs) = copy(2, 20);
        assert!(run.members[0].is_refresh(&op, &inputs, &outputs));
        let (op, inputs, outputs) = copy(10, 20);
        assert!(!run.members[0].is_refresh(&op, &inputs, &outputs));
    }
}
