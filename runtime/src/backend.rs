//! The `Backend` trait: where a rank's buffers live and how compute ops run on them. The
//! executor drives it; `cpu` (the exact reference) and later `cuda` implement it.
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::Op;
use parc_compiler::ir::Program;
use parc_compiler::ir::{BufferId, CollectiveKind, DType};
use parc_compiler::memplan::MemoryLayout;

/// Per-step values an op may need that are not part of the program: the learning rate from the
/// schedule, the 1-based optimizer step count (for Adam's bias correction) and, in fp16 runs,
/// the loss scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    pub lr: f64,
    pub step: u64,
    /// The loss scale of this step when the run scales its loss (fp16); None otherwise. With
    /// it, `CeGrad` and `CrossEntropy` multiply the loss gradient by it, `ClipCoef` divides it
    /// back out (and marks an overflowed step with a NaN coefficient), and `AdamW`/`Sgd` leave
    /// a step with a non-finite coefficient untouched (see `parc_compiler::ir::op`).
    pub loss_scale: Option<f64>,
}

/// One send or receive of a [`Backend::device_p2p`] batch: `peer` is a global rank, `tag` the
/// IR's tag, `buffer` this rank's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceTransfer {
    Send {
        peer: u32,
        tag: u32,
        buffer: BufferId,
    },
    Recv {
        peer: u32,
        tag: u32,
        buffer: BufferId,
    },
}

/// Host memory a checkpoint snapshot is copied into ([`Backend::host_staging`]): plain memory
/// on the CPU, page-locked on CUDA (the device-to-host copy then runs at the bus's speed). It
/// travels to the checkpoint writer's thread and back (`checkpoint::writer`).
pub trait HostStaging: Send {
    /// The values, to read.
    fn values(&self) -> Result<&[f32]>;
    /// The values, to fill.
    fn values_mut(&mut self) -> Result<&mut [f32]>;
}

impl HostStaging for Vec<f32> {
    fn values(&self) -> Result<&[f32]> {
        Ok(self)
    }
    fn values_mut(&mut self) -> Result<&mut [f32]> {
        Ok(self)
    }
}

/// `out` must take exactly the `len` elements of buffer `id`.
pub fn check_read_len(id: BufferId, len: usize, out: &[f32]) -> Result<()> {
    if len == out.len() {
        return Ok(());
    }
    Err(RuntimeError::Buffer {
        id: id.0,
        what: format!(
            "holds {len} elements, but {} were reserved to read it into",
            out.len()
        ),
    })
}

pub trait Backend {
    /// Short name for logs (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// Called once, before any `alloc`, with the program this backend will run and its memory
    /// plan (`parc_compiler::memplan`, already checked). A backend that preallocates makes its
    /// persistent region and transient arena here, and `alloc`/`free` of planned buffers then
    /// bind and unbind their planned offsets. The plan also says which buffers need their
    /// zero-fill ([`MemoryLayout::needs_zero`]): the others are fully written by their first use
    /// before anything reads them, so `alloc` may leave their bytes as they are. The default
    /// ignores the plan: every `alloc` allocates on its own.
    fn prepare(&mut self, program: &Program, layout: &MemoryLayout) -> Result<()> {
        let _ = (program, layout);
        Ok(())
    }
    /// Bytes of memory this backend holds for buffers, scratch and workspaces, where it
    /// knows them (None: not reported). With a memory plan this is fixed after `prepare`.
    fn reserved_bytes(&self) -> Option<u64> {
        None
    }
    /// Allocate `id` with `shape`, zero-filled unless the plan given to `prepare` says the
    /// buffer needs no zeros (then its contents are unspecified until written). Allocating an id
    /// twice is an error.
    fn alloc(&mut self, id: BufferId, shape: &[u64], dtype: DType) -> Result<()>;
    /// Release `id`. Freeing an unallocated id is an error.
    fn free(&mut self, id: BufferId) -> Result<()>;
    /// Run one compute op; `inputs`/`outputs` follow the order documented on the `Op` variant.
    fn compute(
        &mut self,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
        scalars: &StepScalars,
    ) -> Result<()>;
    /// Whether this backend stores `DType::Bf16` buffers (rounding on write, as the CPU
    /// backend defines). One that does not is given programs with their bf16 buffers stored
    /// f32 instead (`Program::with_f32_storage`, done by the executor before `prepare`).
    fn stores_bf16(&self) -> bool {
        false
    }
    /// Copy host data into an f32 buffer (length must match); into a bf16 buffer (on a backend
    /// that stores bf16) each element is rounded to the nearest bf16.
    fn write_f32(&mut self, id: BufferId, data: &[f32]) -> Result<()>;
    /// Copy host data into an i32 buffer (length must match).
    fn write_i32(&mut self, id: BufferId, data: &[i32]) -> Result<()>;
    /// Copy an f32 buffer to the host (a bf16 buffer widened exactly to f32).
    fn read_f32(&self, id: BufferId) -> Result<Vec<f32>>;
    /// Host memory for `len` f32s that [`Backend::read_f32_into`] copies into fastest (for
    /// checkpoint snapshots, reused from save to save). The default is plain memory.
    fn host_staging(&mut self, len: usize) -> Result<Box<dyn HostStaging>> {
        Ok(Box::new(vec![0.0f32; len]))
    }
    /// [`Backend::read_f32`] into `out`, which must hold exactly the buffer's elements. The
    /// default reads through `read_f32`.
    fn read_f32_into(&mut self, id: BufferId, out: &mut [f32]) -> Result<()> {
        let values = self.read_f32(id)?;
        check_read_len(id, values.len(), out)?;
        out.copy_from_slice(&values);
        Ok(())
    }
    /// The choices this backend made while running that change its results' rounding (CUDA:
    /// the algorithm each GEMM timed fastest on its first run), as text a checkpoint shard
    /// carries so a resumed run makes the same ones; None where it makes none (the default: its
    /// results do not depend on timing).
    fn choices(&self) -> Result<Option<String>> {
        Ok(None)
    }
    /// Make the choices `saved` records (its [`Backend::choices`] in the run a checkpoint
    /// continues) instead of timing again, so the resumed run continues bit for bit. `Ok(Some)`
    /// says why they were not taken (another GPU or library version, or unreadable: the run
    /// times its own, and its results may differ from the original run's by rounding). The
    /// default takes none and says nothing (a backend without choices).
    fn adopt_choices(&mut self, saved: &str) -> Result<Option<String>> {
        let _ = saved;
        Ok(None)
    }
    /// Wait until all queued work has finished (for timing ops); backends that run ops
    /// synchronously need not override it.
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
    /// For `--profile`: record a time mark on the device's queue of work, after everything
    /// queued so far, without waiting for it. `Ok(false)`: this backend keeps no device clock
    /// (its ops finish before they return), and the executor times each instruction on the
    /// host between [`Backend::synchronize`] calls instead. The default keeps none.
    fn mark_time(&mut self) -> Result<bool> {
        Ok(false)
    }
    /// Seconds between consecutive marks of [`Backend::mark_time`] since the last call (one
    /// value fewer than marks), after waiting for the device; the marks are then forgotten.
    fn marked_intervals(&mut self) -> Result<Vec<f64>> {
        Ok(Vec::new())
    }
    /// For `--profile`: make the device's queue of work wait now for the queued communication
    /// that uses `buffers` (the wait the next instruction on them would start with), so a
    /// [`Backend::mark_time`] after it times the wait apart from the instruction's work. The
    /// default does nothing: communication is done when its call returns.
    fn wait_for_communication(&mut self, _buffers: &[BufferId]) -> Result<()> {
        Ok(())
    }
    /// Run a collective on this backend's own buffers through a device communicator it owns
    /// (NCCL), with the semantics of [`crate::comm::Comm`]: `group` holds global ranks in
    /// group-rank order and contains this rank; all-gather concatenates in group order;
    /// reduce-scatter gives member `i` chunk `i`; `input == output` is allowed for all-reduce
    /// and broadcast. The work may complete later: the backend orders every later use of
    /// `input` and `output` (ops, reads, writes, free) after it. `None` means this backend has
    /// no device communicator and the executor moves the data through the host `Comm`.
    fn device_collective(
        &mut self,
        _kind: CollectiveKind,
        _group: &[u32],
        _input: BufferId,
        _output: BufferId,
    ) -> Option<Result<()>> {
        None
    }
    /// Issue `transfers` together (group semantics: two ranks exchanging in both directions
    /// cannot deadlock) through the backend's device communicator, ordered like
    /// [`Backend::device_collective`]. A device communicator may match messages by their order
    /// per (sender, receiver) pair instead of by tag; the backend checks at set-up that the
    /// plan's order and tags agree. `None`: use the host `Comm`.
    fn device_p2p(&mut self, _transfers: &[DeviceTransfer]) -> Option<Result<()>> {
        None
    }
    /// This rank failed with `reason`: a backend with a device communicator aborts it and tells
    /// the other ranks' backends (where it can), so nothing waits on this rank until a timeout.
    /// The executor calls it after the comm's abort; the default does nothing.
    fn abort(&mut self, _reason: &str) {}
    /// The executor is about to run instruction `index` of the program. A backend that queues
    /// communication to complete later keeps it to say which instruction queued the work that
    /// got stuck ([`Backend::stuck_instruction`]); the default ignores it.
    fn begin_instruction(&mut self, _index: usize) {}
    /// After a communication error: the instruction whose queued communication never
    /// finished, where the backend knows it. The executor then reports the rank stuck there
    /// (and that instruction's spec line) rather than where it noticed. Default: None.
    fn stuck_instruction(&self) -> Option<usize> {
        None
    }
    /// `true`: until called with `false`, every instruction's outputs hold their values when it
    /// returns, for a check that reads each back (`RankExecutor::first_nonfinite`). Otherwise a
    /// backend may leave unstored an output that no reader loads this step (the CUDA backend's
    /// fused SwiGLU-and-FP8 pass). The default stores everything always.
    fn check_outputs(&mut self, _on: bool) {}
}
