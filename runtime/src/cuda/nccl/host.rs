//! The `nccl` [`Comm`]: the host-slice collectives and transfers of `crate::comm` through the
//! NCCL communicators of a rank's CUDA backend, staged through a device buffer. It is the comm
//! of a multi-process CUDA run: the program's own collectives go to the backend's device path
//! ([`crate::backend::Backend::device_collective`]), and this carries what the executor does
//! on the host (the checkpoint barrier) and the abort of a failed rank.
//!
//! Its collectives are queued on the backend's communication stream and its transfers on the
//! backend's transfer stream, after the device work already queued there, so every rank issues
//! each communicator's NCCL calls in one order. Each call waits for its
//! result (polling, with the run's timeout and the failure probe). Tags are not sent: NCCL
//! matches messages by order per pair of ranks (see `crate::comm::layout`).
use super::comms::{collective_count, lock, RawTransfer, Shared};
use crate::comm::{Comm, PeerOp};
use crate::cuda::device::driver_error;
use crate::cuda::CudaBackend;
use crate::error::{Result, RuntimeError};
use cudarc::driver::result as cu;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use parc_compiler::ir::{CollectiveKind, DType, ReduceOp};
use std::sync::Arc;
use std::time::Duration;

use super::comms::AbortNotice;

/// See the module docs. Made by [`CudaBackend::nccl_host_comm`].
pub struct NcclHostComm {
    ctx: Arc<CudaContext>,
    comms: Shared,
    /// The backend's communication stream.
    stream: Arc<CudaStream>,
    /// The backend's transfer stream (point-to-point).
    p2p_stream: Arc<CudaStream>,
    timeout: Duration,
    rank: u32,
    world: u32,
    /// Device copy of the data of the current call; grows, never shrinks.
    staging: Option<CudaSlice<u8>>,
    on_abort: Option<AbortNotice>,
}

impl std::fmt::Debug for NcclHostComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclHostComm(rank {} of {})", self.rank, self.world)
    }
}

impl CudaBackend {
    /// The host [`Comm`] over this backend's NCCL communicators (after
    /// [`CudaBackend::use_nccl`]). `on_abort` tells the other processes when this rank fails.
    pub fn nccl_host_comm(&self, on_abort: Option<AbortNotice>) -> Result<NcclHostComm> {
        let nccl = self.nccl.as_ref().ok_or_else(|| {
            RuntimeError::Unsupported(
                "the NCCL host comm needs NCCL set up on the backend (use_nccl)".into(),
            )
        })?;
        let (rank, world) = {
            let comms = lock(&nccl.comms)?;
            (comms.rank(), comms.world_size())
        };
        Ok(NcclHostComm {
            ctx: Arc::clone(&self.ctx),
            comms: Arc::clone(&nccl.comms),
            stream: Arc::clone(nccl.stream.stream()),
            p2p_stream: Arc::clone(nccl.p2p.stream()),
            timeout: nccl.stream.timeout(),
            rank,
            world,
            staging: None,
            on_abort,
        })
    }
}

impl NcclHostComm {
    /// Device memory for `words` f32s, valid until the next call.
    fn staging(&mut self, words: usize) -> Result<CUdeviceptr> {
        let bytes = (words * 4).max(4);
        if self.staging.as_ref().is_none_or(|s| s.len() < bytes) {
            self.staging = None;
            let memory = self
                .stream
                .alloc_zeros::<u8>(bytes.max(1 << 12))
                .map_err(|e| driver_error("allocating the NCCL host comm's staging buffer", e))?;
            self.stream
                .synchronize()
                .map_err(|e| driver_error("allocating the NCCL host comm's staging buffer", e))?;
            self.staging = Some(memory);
        }
        match &self.staging {
            Some(memory) => {
                let (ptr, _sync) = memory.device_ptr(&self.stream);
                Ok(ptr)
            }
            None => Err(RuntimeError::Unsupported("staging memory missing".into())),
        }
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("making the context current for NCCL", e))
    }

    fn upload(&self, ptr: CUdeviceptr, data: &[f32]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: the staging buffer holds at least the caller's words past `ptr`; the stream
        // has finished every earlier use of it (each call waits).
        unsafe { cu::memcpy_htod_sync(ptr, data) }
            .map_err(|e| driver_error("copying data to the NCCL staging buffer", e))
    }

    fn download(&self, out: &mut [f32], ptr: CUdeviceptr) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: as `upload`; the stream is idle after `wait`.
        unsafe { cu::memcpy_dtoh_sync(out, ptr) }
            .map_err(|e| driver_error("copying data from the NCCL staging buffer", e))
    }

    fn wait(&self) -> Result<()> {
        lock(&self.comms)?.wait(&self.stream, self.timeout)
    }

    /// Run collective `kind` on host data: `input` in, `output` out (may be the same length).
    fn collective(
        &mut self,
        kind: CollectiveKind,
        group: &[u32],
        input: &[f32],
        output_len: usize,
        name: &str,
    ) -> Result<Vec<f32>> {
        self.bind()?;
        let count = collective_count(kind, group.len(), input.len(), output_len)
            .map_err(|what| RuntimeError::Comm(format!("NCCL host {name}: {what}")))?;
        let base = self.staging(input.len() + output_len + 64)?;
        // The output starts on a 256-byte boundary after the input.
        let out_offset = (input.len() * 4).next_multiple_of(256);
        let (send, recv) = (base, base + out_offset as CUdeviceptr);
        self.upload(send, input)?;
        // SAFETY: both regions lie in the staging buffer, sized for `count` over the group.
        unsafe {
            lock(&self.comms)?.collective(
                kind,
                group,
                (send, recv, count, DType::F32),
                &self.stream,
                (None, format!("host {name} of {} elements", input.len())),
            )?;
        }
        self.wait()?;
        let mut out = vec![0.0f32; output_len];
        self.download(&mut out, recv)?;
        Ok(out)
    }
}

impl Comm for NcclHostComm {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.world
    }

    fn all_reduce(&mut self, group: &[u32], op: ReduceOp, data: &mut [f32]) -> Result<()> {
        let kind = CollectiveKind::AllReduce { op };
        let out = self.collective(kind, group, data, data.len(), "all-reduce")?;
        data.copy_from_slice(&out);
        Ok(())
    }

    fn all_gather(&mut self, group: &[u32], input: &[f32], output: &mut [f32]) -> Result<()> {
        let kind = CollectiveKind::AllGather;
        let out = self.collective(kind, group, input, output.len(), "all-gather")?;
        output.copy_from_slice(&out);
        Ok(())
    }

    fn reduce_scatter(&mut self, group: &[u32], input: &[f32], output: &mut [f32]) -> Result<()> {
        let kind = CollectiveKind::ReduceScatter;
        let out = self.collective(kind, group, input, output.len(), "reduce-scatter")?;
        output.copy_from_slice(&out);
        Ok(())
    }

    fn broadcast(&mut self, group: &[u32], root: usize, data: &mut [f32]) -> Result<()> {
        let kind = CollectiveKind::Broadcast { root: root as u32 };
        let out = self.collective(kind, group, data, data.len(), "broadcast")?;
        data.copy_from_slice(&out);
        Ok(())
    }

    fn group_p2p(&mut self, ops: &mut [PeerOp<'_>]) -> Result<()> {
        self.bind()?;
        // Each transfer gets its own 256-byte aligned region of the staging buffer.
        let mut offsets = Vec::with_capacity(ops.len());
        let mut words = 0usize;
        for op in ops.iter() {
            let len = match op {
                PeerOp::Send { data, .. } => data.len(),
                PeerOp::Recv { out, .. } => out.len(),
            };
            offsets.push(words);
            words = (words + len).next_multiple_of(64);
        }
        let base = self.staging(words)?;
        let mut raw: Vec<RawTransfer> = Vec::with_capacity(ops.len());
        let mut what = Vec::with_capacity(ops.len());
        for (op, &offset) in ops.iter().zip(&offsets) {
            let ptr = base + (offset * 4) as CUdeviceptr;
            match op {
                PeerOp::Send { peer, tag, data } => {
                    self.upload(ptr, data)?;
                    raw.push((true, *peer, ptr, data.len(), DType::F32));
                    what.push(format!("host send of tag {tag} to rank {peer}"));
                }
                PeerOp::Recv { peer, tag, out } => {
                    raw.push((false, *peer, ptr, out.len(), DType::F32));
                    what.push(format!("host receive of tag {tag} from rank {peer}"));
                }
            }
        }
        // SAFETY: every region lies in the staging buffer with its length in f32s.
        unsafe {
            lock(&self.comms)?.transfers(&raw, &self.p2p_stream, (None, what.join(", ")))?;
        }
        lock(&self.comms)?.wait(&self.p2p_stream, self.timeout)?;
        for (op, &offset) in ops.iter_mut().zip(&offsets) {
            if let PeerOp::Recv { out, .. } = op {
                self.download(out, base + (offset * 4) as CUdeviceptr)?;
            }
        }
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        if let Some(notice) = &self.on_abort {
            notice(reason);
        }
        if let Ok(mut comms) = lock(&self.comms) {
            comms.abort(&format!("rank {} failed: {reason}", self.rank));
        }
    }
}
