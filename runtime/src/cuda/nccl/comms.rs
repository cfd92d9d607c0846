//! A rank's NCCL communicators (cudarc's bindings, loaded at run time), shared by its backend
//! (device buffers, `nccl`) and its host comm (`nccl::host`), which queue their
//! collectives on the same communication stream and their transfers on the same transfer
//! stream, so that every rank issues each communicator's NCCL calls in program order.
//!
//! - **Communicators.** A world communicator from a shared [`NcclId`] (made by one rank and
//!   handed to the others by the launcher's rendezvous, or made locally for a one-process
//!   run), then one communicator per distinct group partition of the plan, split from the world
//!   with `ncclCommSplit` in [`CommLayout`] order (every rank splits the same partitions in the
//!   same order; a rank outside a partition takes part with no colour). The split key is the
//!   global rank, so NCCL's rank in a split is the group-rank index: all-gather concatenates in
//!   group order and reduce-scatter gives member `i` chunk `i`, as `crate::comm` requires.
//! - **Point-to-point** goes over the transfer communicator (every rank, split from the world
//!   first, keyed by global rank, so peers are global ranks), used by transfers alone, all of
//!   an instruction's transfers inside one `ncclGroupStart`/`ncclGroupEnd`.
//! - **No hang**: a wait polls, checks NCCL's asynchronous errors and the failure probe, and
//!   after the timeout aborts the communicators and names the communication that is stuck: the
//!   first queued call not finished (`inflight`).
use super::inflight::{InFlight, Queued};
use crate::comm::layout::{CommKey, CommLayout};
use crate::cuda::device::driver_error;
use crate::cuda::stream::poll_until_idle;
use crate::error::{Result, RuntimeError};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::sys as nc;
use parc_compiler::ir::{CollectiveKind, DType, ReduceOp};
use std::ffi::{c_int, c_void, CStr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// `NCCL_SPLIT_NOCOLOR` of nccl.h: take part in a split without joining any communicator.
const SPLIT_NO_COLOR: c_int = -1;

const LIBRARY_HELP: &str = "install NCCL 2.18 or newer (e.g. the libnccl2 package, or the \
     nvidia-nccl wheel) and make `libnccl.so` loadable: where only `libnccl.so.2` exists, link it \
     (`mkdir -p ~/.local/lib/nccl && ln -s /usr/lib/x86_64-linux-gnu/libnccl.so.2 \
     ~/.local/lib/nccl/libnccl.so`) and add that folder to LD_LIBRARY_PATH; or use --comm local";

/// Check that the NCCL library can be loaded (cudarc would panic on first use otherwise).
pub fn nccl_available() -> Result<()> {
    // SAFETY: only tries to load the shared library; calls nothing in it.
    if unsafe { nc::is_culib_present() } {
        Ok(())
    } else {
        Err(RuntimeError::Unsupported(format!(
            "NCCL could not be loaded; {LIBRARY_HELP}"
        )))
    }
}

/// NCCL's version as `major.minor.patch`.
pub fn nccl_version() -> Result<String> {
    nccl_available()?;
    let mut code: c_int = 0;
    // SAFETY: writes one int.
    check(unsafe { nc::ncclGetVersion(&mut code) }, None, || {
        "reading the NCCL version".into()
    })?;
    Ok(format!(
        "{}.{}.{}",
        code / 10000,
        (code / 100) % 100,
        code % 100
    ))
}

/// The world communicator's unique id: made by one rank ([`NcclId::new`]) and given to every
/// rank of the run ([`NcclId::to_bytes`]/[`NcclId::from_bytes`] carry it through a
/// rendezvous).
#[derive(Clone, Copy)]
pub struct NcclId(nc::ncclUniqueId);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({} bytes)", NcclId::BYTES)
    }
}

impl NcclId {
    /// Length of [`NcclId::to_bytes`].
    pub const BYTES: usize = 128;

    /// A fresh id (`ncclGetUniqueId`: needs the library, not a GPU).
    pub fn new() -> Result<NcclId> {
        nccl_available()?;
        let mut id = nc::ncclUniqueId {
            internal: [0; NcclId::BYTES],
        };
        // SAFETY: writes the id struct.
        check(unsafe { nc::ncclGetUniqueId(&mut id) }, None, || {
            "making the NCCL unique id".into()
        })?;
        Ok(NcclId(id))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.internal.iter().map(|&c| c as u8).collect()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<NcclId> {
        if bytes.len() != NcclId::BYTES {
            return Err(RuntimeError::Comm(format!(
                "an NCCL id has {} bytes, got {} from the rendezvous (is every rank the same \
                 parc build?)",
                NcclId::BYTES,
                bytes.len()
            )));
        }
        let mut id = nc::ncclUniqueId {
            internal: [0; NcclId::BYTES],
        };
        for (dst, &src) in id.internal.iter_mut().zip(bytes) {
            *dst = src as _;
        }
        Ok(NcclId(id))
    }
}

/// `result` as a `Result`, with NCCL's own message and the communicator's last error.
fn check(
    result: nc::ncclResult_t,
    comm: Option<nc::ncclComm_t>,
    what: impl FnOnce() -> String,
) -> Result<()> {
    use nc::ncclResult_t::{ncclInProgress, ncclSuccess};
    if result == ncclSuccess || result == ncclInProgress {
        return Ok(());
    }
    // SAFETY: NCCL returns static strings (or null).
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let name = text(unsafe { nc::ncclGetErrorString(result) });
    let last = text(unsafe { nc::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut())) });
    let detail = if last.is_empty() {
        String::new()
    } else {
        format!(" ({last})")
    };
    Err(RuntimeError::Comm(format!(
        "NCCL: {}: {name}{detail}",
        what()
    )))
}

/// One NCCL communicator and what it is for (for messages).
struct Communicator {
    raw: nc::ncclComm_t,
    what: String,
}

/// Every communicator of a rank. Shared ([`Shared`]) by the rank's backend (device buffers)
/// and its host comm (`host::NcclHostComm`), which queue their work on the same
/// communication stream so that every rank issues NCCL calls in program order.
pub(crate) struct Communicators {
    rank: u32,
    world: Communicator,
    /// Every rank again (a split of the world with one color): pipeline transfers only, on
    /// their own stream, so that they never share a communicator with a collective queued on
    /// the communication stream (one communicator is used from one stream).
    p2p: Communicator,
    /// Split `i` of the layout: this rank's communicator in it, or None where it has no set.
    splits: Vec<Option<Communicator>>,
    layout: CommLayout,
    /// The calls queued and not yet seen finished, for a timeout's message.
    inflight: InFlight<CudaEvent>,
    /// The call found stuck when the communicators failed (the first unfinished one).
    stuck: Option<Queued>,
    /// Why the communicators were aborted, once they were (after a failure): never used again.
    aborted: Option<String>,
    /// Checked while waiting, e.g. the launcher's news of another rank's failure.
    probe: Option<FailureProbe>,
    /// Tells the other ranks when this one fails (see `CudaBackend::on_abort`).
    notice: Option<AbortNotice>,
}

/// A check that fails once the run has failed elsewhere (another rank died).
pub type FailureProbe = Box<dyn Fn() -> Result<()> + Send>;

/// What to do when this rank fails: tell the other ranks (the launcher's rendezvous, or the
/// rank threads of this process), with the reason.
pub type AbortNotice = Box<dyn Fn(&str) + Send>;

/// The communicators as the backend and the host comm hold them.
pub(crate) type Shared = Arc<Mutex<Communicators>>;

// SAFETY: NCCL communicators may be used from any thread, one call at a time; the mutex in
// `Shared` serialises every use.
unsafe impl Send for Communicators {}

pub(crate) fn lock(shared: &Shared) -> Result<MutexGuard<'_, Communicators>> {
    shared
        .lock()
        .map_err(|_| RuntimeError::Comm("NCCL: a thread panicked while using NCCL".into()))
}

/// Whether the stream has passed `event` (an error, e.g. after an abort, counts as not).
fn event_finished(event: &CudaEvent) -> bool {
    event.try_is_complete().unwrap_or(false)
}

/// One send or receive on raw device memory: (is a send, global peer rank, pointer, elements,
/// element type: f32 or bf16).
pub(crate) type RawTransfer = (bool, u32, CUdeviceptr, usize, DType);

/// NCCL's element type for `dtype`: f32, or bf16 (reduced in bf16 by NCCL, as PyTorch DDP
/// reduces bf16 gradients); anything else is an error naming `what`.
fn nccl_type(dtype: DType, what: &str) -> Result<nc::ncclDataType_t> {
    match dtype {
        DType::F32 => Ok(nc::ncclDataType_t::ncclFloat32),
        DType::Bf16 => Ok(nc::ncclDataType_t::ncclBfloat16),
        other => Err(RuntimeError::Comm(format!(
            "{what}: NCCL moves f32 and bf16 buffers, not {other:?}"
        ))),
    }
}

impl Communicators {
    /// Join the world communicator of `id` as `rank` of `layout.world()` and split the plan's
    /// communicators. Collective over every rank of the run. The CUDA context must be current.
    pub(super) fn join(id: &NcclId, rank: u32, layout: CommLayout) -> Result<Communicators> {
        nccl_available()?;
        let world_size = layout.world();
        let mut raw: nc::ncclComm_t = std::ptr::null_mut();
        // SAFETY: writes one communicator handle; the id is the run's shared one.
        check(
            unsafe { nc::ncclCommInitRank(&mut raw, world_size as c_int, id.0, rank as c_int) },
            None,
            || format!("rank {rank} joining the world communicator of {world_size} ranks"),
        )?;
        let mut p2p: nc::ncclComm_t = std::ptr::null_mut();
        // SAFETY: the world handle is live; a null config inherits the parent's.
        check(
            unsafe { nc::ncclCommSplit(raw, 0, rank as c_int, &mut p2p, std::ptr::null_mut()) },
            Some(raw),
            || format!("rank {rank} splitting the transfer communicator from the world's"),
        )?;
        let mut comms = Communicators {
            rank,
            world: Communicator {
                raw,
                what: format!("the world communicator ({world_size} ranks)"),
            },
            p2p: Communicator {
                raw: p2p,
                what: format!("the transfer communicator ({world_size} ranks)"),
            },
            splits: Vec::new(),
            layout,
            inflight: InFlight::default(),
            stuck: None,
            aborted: None,
            probe: None,
            notice: None,
        };
        for index in 0..comms.layout.splits().len() {
            let color = comms.layout.color(index, rank);
            let mut split: nc::ncclComm_t = std::ptr::null_mut();
            let set = color.and_then(|c| comms.layout.splits()[index].get(c as usize));
            let what = match set {
                Some(set) => format!("the communicator of ranks {set:?}"),
                None => format!("split {index} (rank {rank} is in none of its sets)"),
            };
            // SAFETY: the world handle is live; a null config inherits the parent's.
            check(
                unsafe {
                    nc::ncclCommSplit(
                        comms.world.raw,
                        color.map_or(SPLIT_NO_COLOR, |c| c as c_int),
                        rank as c_int,
                        &mut split,
                        std::ptr::null_mut(),
                    )
                },
                Some(comms.world.raw),
                || format!("rank {rank} splitting {what} from the world communicator"),
            )?;
            comms.splits.push(
                (!split.is_null() && color.is_some()).then_some(Communicator { raw: split, what }),
            );
        }
        Ok(comms)
    }

    pub(crate) fn rank(&self) -> u32 {
        self.rank
    }

    /// Every communicator of the rank.
    fn all(&self) -> impl Iterator<Item = &Communicator> {
        [&self.world, &self.p2p]
            .into_iter()
            .chain(self.splits.iter().flatten())
    }

    pub(crate) fn world_size(&self) -> u32 {
        self.layout.world()
    }

    pub(crate) fn set_probe(&mut self, probe: FailureProbe) {
        self.probe = Some(probe);
    }

    pub(super) fn set_notice(&mut self, notice: AbortNotice) {
        self.notice = Some(notice);
    }

    /// This rank failed with `reason`: tell the others, then abort.
    pub(super) fn fail(&mut self, reason: &str) {
        if let Some(notice) = &self.notice {
            notice(reason);
        }
        self.abort(reason);
    }

    pub(super) fn usable(&self) -> Result<()> {
        match &self.aborted {
            Some(reason) => Err(RuntimeError::Comm(format!(
                "NCCL: rank {}: the communicators were aborted: {reason}",
                self.rank
            ))),
            None => Ok(()),
        }
    }

    fn communicator(&self, set: &[u32]) -> Result<&Communicator> {
        self.usable()?;
        let key = self.layout.key_of(set).ok_or_else(|| {
            RuntimeError::Comm(format!(
                "NCCL: rank {}: no communicator for group {set:?} (not a set of the plan's \
                 group families)",
                self.rank
            ))
        })?;
        match key {
            CommKey::World => Ok(&self.world),
            CommKey::Split(i) => self.splits.get(i).and_then(Option::as_ref).ok_or_else(|| {
                RuntimeError::Comm(format!(
                    "NCCL: rank {}: is not a member of group {set:?}",
                    self.rank
                ))
            }),
        }
    }

    /// NCCL's asynchronous errors on every communicator, then the failure probe.
    pub(crate) fn health(&self) -> Result<()> {
        self.usable()?;
        for c in self.all() {
            let mut state = nc::ncclResult_t::ncclSuccess;
            // SAFETY: the handle is live; writes one result.
            check(
                unsafe { nc::ncclCommGetAsyncError(c.raw, &mut state) },
                Some(c.raw),
                || format!("querying {}", c.what),
            )?;
            check(state, Some(c.raw), || {
                format!("rank {}: {} failed", self.rank, c.what)
            })?;
        }
        match &self.probe {
            Some(probe) => probe(),
            None => Ok(()),
        }
    }

    /// Abort every communicator because of `reason` (a failure or timeout): their queued work
    /// ends and nothing waits on them any more.
    pub(crate) fn abort(&mut self, reason: &str) {
        if self.aborted.is_some() {
            return;
        }
        self.aborted = Some(reason.to_string());
        for c in self.all() {
            // SAFETY: the handle is live; `aborted` keeps it from being used or destroyed again.
            unsafe { nc::ncclCommAbort(c.raw) };
        }
    }

    /// Block until `stream` has run everything queued on it, checking [`Communicators::health`]
    /// while waiting; on failure abort and say which communication is stuck.
    pub(crate) fn wait(&mut self, stream: &CudaStream, timeout: Duration) -> Result<()> {
        let result = poll_until_idle(stream, timeout, &mut || self.health());
        if let Err(e) = result {
            let note = self.stuck_note();
            let message = format!("rank {}: {e}{note}", self.rank);
            self.abort(&message);
            return Err(RuntimeError::Comm(message));
        }
        Ok(())
    }

    /// Find the call the communication stream is stuck in (the first unfinished one; call it
    /// before aborting, which ends every call) and describe it: " (stuck in: …)", or
    /// " (the last queued: …)" where every queued call finished, or nothing before any.
    pub(crate) fn stuck_note(&mut self) -> String {
        if self.stuck.is_none() {
            self.stuck = self.inflight.first_unfinished(event_finished).cloned();
        }
        match (&self.stuck, self.inflight.last()) {
            (Some(stuck), _) => format!(" (stuck in: {})", stuck.describe()),
            (None, Some(last)) => format!(" (the last queued: {})", last.describe()),
            (None, None) => String::new(),
        }
    }

    /// The instruction whose call was found stuck when the communicators failed.
    pub(crate) fn stuck_instruction(&self) -> Option<usize> {
        self.stuck.as_ref().and_then(|q| q.instruction)
    }

    /// Record an event after the call just queued on `stream` as `what`, from `instruction`.
    fn queued(
        &mut self,
        stream: &CudaStream,
        instruction: Option<usize>,
        what: String,
    ) -> Result<()> {
        let event = match self.inflight.spare() {
            Some(event) => event,
            None => stream
                .context()
                .new_event(None)
                .map_err(|e| driver_error("creating an event for an NCCL call", e))?,
        };
        event
            .record(stream)
            .map_err(|e| driver_error("recording an event after an NCCL call", e))?;
        self.inflight
            .push(event, Queued { instruction, what }, event_finished);
        Ok(())
    }

    /// Queue collective `kind` over `group` on `stream`: `count` is NCCL's count (elements per
    /// rank for all-gather and reduce-scatter, else the whole buffer); `instruction` is the
    /// program instruction it comes from, if any.
    ///
    /// # Safety
    /// `send` and `recv` must be device allocations of this context large enough for `kind`
    /// and `count` elements of `dtype` over `group.len()` ranks, alive until the stream has
    /// run the operation.
    pub(crate) unsafe fn collective(
        &mut self,
        kind: CollectiveKind,
        group: &[u32],
        (send, recv, count, dtype): (CUdeviceptr, CUdeviceptr, usize, DType),
        stream: &CudaStream,
        (instruction, what): (Option<usize>, String),
    ) -> Result<()> {
        let comm = self.communicator(group)?;
        let raw = comm.raw;
        let what = format!("rank {}: {what} over {}", self.rank, comm.what);
        let cu_stream = stream.cu_stream() as nc::cudaStream_t;
        let (send, recv) = (send as *const c_void, recv as *mut c_void);
        let elem = nccl_type(dtype, &what)?;
        let result = match kind {
            CollectiveKind::AllReduce { op } => {
                let op = match op {
                    ReduceOp::Sum => nc::ncclRedOp_t::ncclSum,
                    ReduceOp::Max => nc::ncclRedOp_t::ncclMax,
                };
                nc::ncclAllReduce(send, recv, count, elem, op, raw, cu_stream)
            }
            CollectiveKind::AllGather => nc::ncclAllGather(send, recv, count, elem, raw, cu_stream),
            CollectiveKind::ReduceScatter => {
                let sum = nc::ncclRedOp_t::ncclSum;
                nc::ncclReduceScatter(send, recv, count, elem, sum, raw, cu_stream)
            }
            CollectiveKind::Broadcast { root } => {
                nc::ncclBroadcast(send, recv, count, elem, root as c_int, raw, cu_stream)
            }
        };
        check(result, Some(raw), || what.clone())?;
        self.queued(stream, instruction, what)
    }

    /// Queue `transfers` on `stream` as one NCCL group over the transfer communicator, from
    /// program instruction `instruction` if any.
    ///
    /// # Safety
    /// Every pointer must be a device allocation of this context holding its count of
    /// elements of its type, alive until the stream has run the group.
    pub(crate) unsafe fn transfers(
        &mut self,
        transfers: &[RawTransfer],
        stream: &CudaStream,
        (instruction, what): (Option<usize>, String),
    ) -> Result<()> {
        self.usable()?;
        let world = self.p2p.raw;
        let what = format!("rank {}: {what}", self.rank);
        let cu_stream = stream.cu_stream() as nc::cudaStream_t;
        let types = transfers
            .iter()
            .map(|t| nccl_type(t.4, &what))
            .collect::<Result<Vec<_>>>()?;
        check(nc::ncclGroupStart(), Some(world), || {
            format!("{what}: starting the group")
        })?;
        let mut queued = Ok(());
        for (&(send, peer, ptr, len, _), &elem) in transfers.iter().zip(&types) {
            let result = if send {
                nc::ncclSend(
                    ptr as *const c_void,
                    len,
                    elem,
                    peer as c_int,
                    world,
                    cu_stream,
                )
            } else {
                nc::ncclRecv(
                    ptr as *mut c_void,
                    len,
                    elem,
                    peer as c_int,
                    world,
                    cu_stream,
                )
            };
            if queued.is_ok() {
                queued = check(result, Some(world), || what.clone());
            }
        }
        // The group is always closed, even after a failed call inside it.
        let closed = check(nc::ncclGroupEnd(), Some(world), || what.clone());
        queued?;
        closed?;
        self.queued(stream, instruction, what)
    }
}

impl Drop for Communicators {
    fn drop(&mut self) {
        if self.aborted.is_some() {
            return;
        }
        for c in self.splits.iter().flatten().chain([&self.p2p, &self.world]) {
            // SAFETY: the handle is live and not used again; errors at teardown are moot.
            unsafe { nc::ncclCommDestroy(c.raw) };
        }
    }
}
pub(super) fn describe(kind: CollectiveKind) -> &'static str {
    match kind {
        CollectiveKind::AllReduce {
            op: ReduceOp::Sum, ..
        } => "all-reduce (sum)",
        CollectiveKind::AllReduce {
            op: ReduceOp::Max, ..
        } => "all-reduce (max)",
        CollectiveKind::AllGather => "all-gather",
        CollectiveKind::ReduceScatter => "reduce-scatter",
        CollectiveKind::Broadcast { .. } => "broadcast",
    }
}
/// NCCL's count for collective `kind` over `n` ranks with `input`/`output` elements, or what is
/// wrong with the sizes.
pub(crate) fn collective_count(
    kind: CollectiveKind,
    n: usize,
    input: usize,
    output: usize,
) -> std::result::Result<usize, String> {
    let n = n.max(1);
    let (fits, count) = match kind {
        CollectiveKind::AllReduce { .. } | CollectiveKind::Broadcast { .. } => {
            (input == output, output)
        }
        CollectiveKind::AllGather => (output == input * n, input),
        CollectiveKind::ReduceScatter => (input == output * n, output),
    };
    if let CollectiveKind::Broadcast { root } = kind {
        if root as usize >= n {
            return Err(format!(
                "root {root} is not a member index of a {n}-rank group"
            ));
        }
    }
    if fits {
        Ok(count)
    } else {
        Err(format!(
            "{input} and {output} elements do not fit a {n}-rank {}",
            describe(kind)
        ))
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_survives_its_trip_through_bytes_and_a_wrong_length_is_refused() {
        let bytes: Vec<u8> = (0..NcclId::BYTES).map(|i| (i * 7 % 256) as u8).collect();
        let id = NcclId::from_bytes(&bytes).unwrap();
        assert_eq!(id.to_bytes(), bytes);
        let err = NcclId::from_bytes(&bytes[..100]).unwrap_err().to_string();
        assert!(err.contains("has 128 bytes, got 100"), "{err}");
    }

    #[test]
    fn f32_and_bf16_buffers_have_nccl_types_and_nothing_else_does() {
        let f32t = nccl_type(DType::F32, "x").unwrap();
        assert!(matches!(f32t, nc::ncclDataType_t::ncclFloat32));
        let bf16 = nccl_type(DType::Bf16, "x").unwrap();
        assert!(matches!(bf16, nc::ncclDataType_t::ncclBfloat16));
        let err = nccl_type(DType::I32, "all-reduce of buffer 3")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("all-reduce of buffer 3") && err.contains("I32"),
            "{err}"
        );
    }

    #[test]
    fn collective_sizes_are_checked_per_kind() {
        let sum = CollectiveKind::AllReduce { op: ReduceOp::Sum };
        assert_eq!(collective_count(sum, 4, 10, 10), Ok(10));
        assert!(collective_count(sum, 4, 10, 11).is_err());
        assert_eq!(
            collective_count(CollectiveKind::AllGather, 4, 10, 40),
            Ok(10)
        );
        assert!(collective_count(CollectiveKind::AllGather, 4, 10, 30).is_err());
        assert_eq!(
            collective_count(CollectiveKind::ReduceScatter, 4, 40, 10),
            Ok(10)
        );
        assert!(collective_count(CollectiveKind::ReduceScatter, 4, 40, 40).is_err());
        let bcast = |root| CollectiveKind::Broadcast { root };
        assert_eq!(collective_count(bcast(3), 4, 5, 5), Ok(5));
        let err = collective_count(bcast(4), 4, 5, 5).unwrap_err();
        assert!(err.contains("root 4"), "{err}");
    }
}
