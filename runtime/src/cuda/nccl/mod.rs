//! NCCL in the CUDA backend, in one place:
//! - `comms`: a rank's communicators (the library checks, `NcclId`, joining and splitting,
//!   health, abort, the stuck call), shared by the two sides below;
//! - this module: the backend's device comm, collectives and grouped point-to-point transfers
//!   on the backend's own buffers, on two streams of `cuda::stream` so that they overlap
//!   compute: collectives on the communication stream, transfers on the transfer stream (a
//!   receive waiting for a slower pipeline stage does not hold back the tp/dp collectives
//!   queued after it, as Megatron-LM runs pipeline transfers; the timeline models the same);
//! - `host`: the host-slice [`crate::comm::Comm`] of a multi-process run over the same
//!   communicators;
//! - `inflight`: which queued calls have not finished (what a timeout names);
//! - `watchdog`: the thread that aborts the communicators when the stream stops progressing.
//!
//! The device comm:
//! - **Point-to-point** goes over the transfer communicator (every rank, used by transfers
//!   alone) with global ranks as peers, all of an instruction's transfers inside one NCCL
//!   group. Where a buffer is used by both streams since the last drain, the stream about to
//!   use it first waits for everything queued on the other. NCCL matches messages by order per
//!   (sender, receiver), not by tag: [`CudaBackend::use_nccl`] refuses a plan whose order and
//!   tags disagree ([`crate::comm::layout::check_p2p_order`]).
//! - **Reductions** are NCCL's: every member gets the same result, but the summation order is
//!   NCCL's, not group-rank order, so a multi-rank result may differ from the CPU backend's in
//!   the last bits (one rank: identical).
//! - **No hang**: the host waits for queued communication by polling, checks NCCL's
//!   asynchronous errors, and after the timeout aborts the communicators and fails naming the
//!   communication that is stuck, with the program instruction that issued it, which the
//!   executor turns into the rank, instruction and spec line of the error
//!   ([`CudaBackend::stuck_instruction`]). The watchdog does the same for the waits it cannot
//!   poll (a host copy behind compute that waits for communication).
mod comms;
mod host;
mod inflight;
mod watchdog;

pub use comms::{nccl_available, nccl_version, AbortNotice, FailureProbe, NcclId};
pub use host::NcclHostComm;

use super::device::driver_error;
use super::stream::{comm_buffers, CommStream};
use super::{Buf, CudaBackend};
use crate::backend::DeviceTransfer;
use crate::comm::layout::{check_p2p_order, CommLayout};
use crate::error::{Result, RuntimeError};
use comms::{collective_count, describe, lock, Communicators, RawTransfer, Shared};
use parc_compiler::ir::{BufferId, CollectiveKind, DType, Plan};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use watchdog::Watchdog;

/// The backend's side: the shared communicators, its communication and transfer streams and
/// the watchdogs that abort NCCL when one stops making progress.
pub(crate) struct NcclComm {
    pub(crate) comms: Shared,
    /// Collectives.
    pub(crate) stream: CommStream,
    /// Point-to-point transfers.
    pub(crate) p2p: CommStream,
    /// Buffers collectives and transfers used since the host last drained both streams.
    collective_buffers: HashSet<BufferId>,
    transfer_buffers: HashSet<BufferId>,
    /// The program instruction the executor runs now ([`CudaBackend::begin_instruction`]).
    instruction: Option<usize>,
    _watchdogs: [Watchdog; 2],
}

impl NcclComm {
    /// Block until all queued communication has finished (or fail: timeout, NCCL error, the
    /// failure probe); on failure the communicators are aborted.
    pub(crate) fn wait(&self) -> Result<()> {
        for stream in [&self.stream, &self.p2p] {
            if stream.has_queued() {
                lock(&self.comms)?.wait(stream.stream(), stream.timeout())?;
            }
        }
        Ok(())
    }

    /// [`NcclComm::wait`], then forget every pending mark.
    pub(crate) fn drain(&mut self) -> Result<()> {
        self.wait()?;
        self.stream.forget_all();
        self.p2p.forget_all();
        self.collective_buffers.clear();
        self.transfer_buffers.clear();
        Ok(())
    }

    /// Whether queued communication of either stream may still use `id`.
    fn uses(&self, id: BufferId) -> bool {
        self.stream.uses(id) || self.p2p.uses(id)
    }
}

impl Drop for NcclComm {
    /// Queued communication finishes (or, failing or timing out, the communicators are
    /// aborted) before the backend frees the buffers it uses (the backend drops this first).
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

fn not_set_up() -> RuntimeError {
    RuntimeError::Unsupported("NCCL is not set up on this backend (call use_nccl first)".into())
}

fn float_buffer(op: &str, b: &Buf) -> Result<()> {
    if matches!(b.dtype, DType::F32 | DType::Bf16) {
        Ok(())
    } else {
        Err(RuntimeError::Op {
            op: op.into(),
            what: format!(
                "buffer {} is {:?}; NCCL comm moves f32 and bf16 buffers",
                b.id.0, b.dtype
            ),
        })
    }
}

fn sizes_error(op: &str, what: String) -> RuntimeError {
    RuntimeError::Op {
        op: op.into(),
        what: format!("{what} (a lowering bug)"),
    }
}
impl CudaBackend {
    /// Use NCCL for this backend's collectives and transfers: join the run's world
    /// communicator of `id` as `rank` and split the communicators `plan` needs. Collective over
    /// every rank of the run (each calls it with the same id and plan). `timeout` bounds every
    /// host wait for communication.
    pub fn use_nccl(
        &mut self,
        id: &NcclId,
        rank: u32,
        plan: &Plan,
        timeout: Duration,
    ) -> Result<()> {
        check_p2p_order(plan, rank).map_err(RuntimeError::Comm)?;
        let program = plan.program_of(rank).ok_or_else(|| {
            RuntimeError::Comm(format!(
                "NCCL: rank {rank} has no program in a plan of {} ranks",
                plan.world
            ))
        })?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("making the context current for NCCL", e))?;
        let stream = CommStream::new(&self.ctx, comm_buffers(program), timeout)?;
        let p2p = CommStream::new(&self.ctx, comm_buffers(program), timeout)?;
        let comms = Communicators::join(id, rank, CommLayout::of_plan(plan))?;
        let comms = Arc::new(Mutex::new(comms));
        let watchdogs = [
            Watchdog::start(&self.ctx, stream.stream(), &comms, timeout)?,
            Watchdog::start(&self.ctx, p2p.stream(), &comms, timeout)?,
        ];
        self.nccl = Some(NcclComm {
            comms,
            stream,
            p2p,
            collective_buffers: HashSet::new(),
            transfer_buffers: HashSet::new(),
            instruction: None,
            _watchdogs: watchdogs,
        });
        Ok(())
    }

    /// Whether collectives run through NCCL.
    pub fn uses_nccl(&self) -> bool {
        self.nccl.is_some()
    }

    /// Stop waiting for communication (with an error) once `probe` fails: e.g. the launcher's
    /// rendezvous reporting that another rank died, which NCCL itself would wait out.
    pub fn watch_failures(&mut self, probe: FailureProbe) -> Result<()> {
        let nccl = self.nccl_set_up()?;
        lock(&nccl.comms)?.set_probe(probe);
        Ok(())
    }

    /// Call `notice` with the reason when this rank fails (the executor's
    /// [`crate::backend::Backend::abort`]), e.g. to stop the other rank threads' NCCL waits.
    pub fn on_abort(&mut self, notice: AbortNotice) -> Result<()> {
        let nccl = self.nccl_set_up()?;
        lock(&nccl.comms)?.set_notice(notice);
        Ok(())
    }

    /// [`crate::backend::Backend::abort`]: tell the others and abort the communicators.
    pub(crate) fn abort_nccl(&mut self, reason: &str) {
        if let Some(nccl) = &self.nccl {
            if let Ok(mut comms) = lock(&nccl.comms) {
                comms.fail(reason);
            }
        }
    }

    fn nccl_set_up(&self) -> Result<&NcclComm> {
        self.nccl.as_ref().ok_or_else(not_set_up)
    }

    fn nccl_set_up_mut(&mut self) -> Result<&mut NcclComm> {
        self.nccl.as_mut().ok_or_else(not_set_up)
    }

    /// [`crate::backend::Backend::begin_instruction`]: later NCCL calls come from `index`.
    pub(crate) fn nccl_instruction(&mut self, index: usize) {
        if let Some(nccl) = &mut self.nccl {
            nccl.instruction = Some(index);
        }
    }

    /// [`crate::backend::Backend::stuck_instruction`]: the instruction whose NCCL call was found
    /// stuck when the communicators failed.
    pub(crate) fn nccl_stuck_instruction(&self) -> Option<usize> {
        let nccl = self.nccl.as_ref()?;
        lock(&nccl.comms).ok()?.stuck_instruction()
    }

    /// Before compute-stream work on `ids` (an op, an `Alloc`, a `Free`): make the compute
    /// stream wait for queued communication on them, and let later communication on them wait
    /// for this work (see [`super::stream`]).
    pub(crate) fn order_after_comm(
        &mut self,
        ids: impl IntoIterator<Item = BufferId>,
    ) -> Result<()> {
        match &mut self.nccl {
            Some(nccl) => {
                let ids: Vec<BufferId> = ids.into_iter().collect();
                nccl.stream
                    .order_compute(&self.stream, ids.iter().copied())?;
                nccl.p2p.order_compute(&self.stream, ids)
            }
            None => Ok(()),
        }
    }

    /// Whether the host must drain communication before touching `id`.
    pub(crate) fn comm_uses(&self, id: BufferId) -> bool {
        self.nccl.as_ref().is_some_and(|n| n.uses(id))
    }

    /// Block until all queued communication has finished (with the timeout).
    pub(crate) fn drain_comm(&mut self) -> Result<()> {
        match &mut self.nccl {
            Some(nccl) => nccl.drain(),
            None => Ok(()),
        }
    }

    /// After the host waited for compute: fail if the communicators were aborted meanwhile
    /// (the watchdog found communication stuck; compute that waited for it ran on data it never
    /// got), with the reason, which names the stuck call.
    pub(crate) fn check_comm_intact(&self) -> Result<()> {
        match &self.nccl {
            Some(nccl) => lock(&nccl.comms)?.usable(),
            None => Ok(()),
        }
    }

    /// Before the host reads `id`: wait for queued communication that may still write it.
    pub(crate) fn wait_comm_for(&self, id: BufferId) -> Result<()> {
        match &self.nccl {
            Some(nccl) if nccl.uses(id) => nccl.wait(),
            _ => Ok(()),
        }
    }

    /// [`crate::backend::Backend::device_collective`] through NCCL.
    pub(crate) fn nccl_collective(
        &mut self,
        kind: CollectiveKind,
        group: &[u32],
        input: BufferId,
        output: BufferId,
    ) -> Result<()> {
        let name = describe(kind);
        let (inp, out) = (self.buf(input)?, self.buf(output)?);
        float_buffer(name, &inp)?;
        float_buffer(name, &out)?;
        if inp.dtype != out.dtype {
            return Err(sizes_error(
                name,
                format!(
                    "input buffer {} is {:?} but output buffer {} is {:?}; a collective keeps \
                     one element type",
                    input.0, inp.dtype, output.0, out.dtype
                ),
            ));
        }
        let count = collective_count(kind, group.len(), inp.len, out.len).map_err(|what| {
            sizes_error(
                name,
                format!(
                    "input buffer {}, output buffer {}: {what}",
                    input.0, output.0
                ),
            )
        })?;
        let compute = Arc::clone(&self.stream);
        let nccl = self.nccl_set_up_mut()?;
        if [input, output]
            .iter()
            .any(|id| nccl.transfer_buffers.contains(id))
        {
            nccl.stream.follow_stream(&nccl.p2p)?;
        }
        nccl.collective_buffers.extend([input, output]);
        nccl.stream.follow_uses(&compute, &[input, output])?;
        let what = format!("{name} of buffer {} into buffer {}", input.0, output.0);
        // SAFETY: both buffers are live device allocations whose lengths were checked against
        // `count` for this kind; the buffers stay allocated until the recorded event (a free
        // waits for it).
        unsafe {
            lock(&nccl.comms)?.collective(
                kind,
                group,
                (inp.ptr, out.ptr, count, inp.dtype),
                nccl.stream.stream(),
                (nccl.instruction, what),
            )?;
        }
        match &mut self.nccl {
            Some(nccl) => nccl.stream.record(&[input, output]),
            None => Ok(()),
        }
    }

    /// [`crate::backend::Backend::device_p2p`] through NCCL: one NCCL group.
    pub(crate) fn nccl_p2p(&mut self, transfers: &[DeviceTransfer]) -> Result<()> {
        let mut raw: Vec<RawTransfer> = Vec::with_capacity(transfers.len());
        let mut ids = Vec::with_capacity(transfers.len());
        let mut words = Vec::with_capacity(transfers.len());
        for t in transfers {
            let (send, peer, buffer) = match *t {
                DeviceTransfer::Send { peer, buffer, .. } => (true, peer, buffer),
                DeviceTransfer::Recv { peer, buffer, .. } => (false, peer, buffer),
            };
            let b = self.buf(buffer)?;
            float_buffer(if send { "send" } else { "receive" }, &b)?;
            raw.push((send, peer, b.ptr, b.len, b.dtype));
            ids.push(buffer);
            words.push(if send {
                format!("send buffer {} to rank {peer}", buffer.0)
            } else {
                format!("receive buffer {} from rank {peer}", buffer.0)
            });
        }
        let compute = Arc::clone(&self.stream);
        let nccl = self.nccl_set_up_mut()?;
        if ids.iter().any(|id| nccl.collective_buffers.contains(id)) {
            nccl.p2p.follow_stream(&nccl.stream)?;
        }
        nccl.transfer_buffers.extend(ids.iter().copied());
        nccl.p2p.follow_uses(&compute, &ids)?;
        // SAFETY: every buffer is a live device allocation of its length and type, kept until
        // the recorded event; peers are global ranks of the transfer communicator.
        unsafe {
            lock(&nccl.comms)?.transfers(
                &raw,
                nccl.p2p.stream(),
                (nccl.instruction, words.join(", ")),
            )?;
        }
        match &mut self.nccl {
            Some(nccl) => nccl.p2p.record(&ids),
            None => Ok(()),
        }
    }
}
