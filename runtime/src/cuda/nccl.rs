//! The NCCL device comm of the CUDA backend: collectives and grouped point-to-point transfers
//! on the backend's own buffers, through NCCL (cudarc's bindings, loaded at run time), on the
//! communication stream of [`super::stream`] so that they overlap compute.
//!
//! - **Communicators.** A world communicator from a shared [`NcclId`] (made by one rank and
//!   handed to the others by the launcher's rendezvous, or made locally for a one-process
//!   run), then one communicator per distinct group partition of the plan, split from the world
//!   with `ncclCommSplit` in [`CommLayout`] order (every rank splits the same partitions in the
//!   same order; a rank outside a partition takes part with no colour). The split key is the
//!   global rank, so NCCL's rank in a split is the group-rank index: all-gather concatenates in
//!   group order and reduce-scatter gives member `i` chunk `i`, as `crate::comm` requires.
//! - **Point-to-point** goes over the world communicator with global ranks as peers, all of an
//!   instruction's transfers inside one `ncclGroupStart`/`ncclGroupEnd`. NCCL matches messages
//!   by order per (sender, receiver), not by tag: [`NcclComm::new`] refuses a plan whose order
//!   and tags disagree ([`crate::comm::layout::check_p2p_order`]).
//! - **Reductions** are NCCL's: every member gets the same result, but the summation order is
//!   NCCL's, not group-rank order, so a multi-rank result may differ from the CPU backend's in
//!   the last bits (one rank: identical).
//! - **No hang**: the host waits for queued communication by polling, checks NCCL's
//!   asynchronous errors, and after the timeout aborts the communicators and fails naming the
//!   last communication it queued.
use super::stream::CommStream;
use super::{Buf, CudaBackend};
use crate::backend::DeviceTransfer;
use crate::comm::layout::{check_p2p_order, CommKey, CommLayout};
use crate::error::{Result, RuntimeError};
use cudarc::nccl::sys as nc;
use parc_compiler::ir::{BufferId, CollectiveKind, DType, Plan, ReduceOp};
use std::cell::Cell;
use std::ffi::{c_int, c_void, CStr};
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

/// Every communicator of a rank, and the communication stream its work runs on.
pub(crate) struct NcclComm {
    rank: u32,
    world: Communicator,
    /// Split `i` of the layout: this rank's communicator in it, or None where it has no set.
    splits: Vec<Option<Communicator>>,
    layout: CommLayout,
    pub(crate) stream: CommStream,
    /// The last communication queued, for a timeout's message.
    last_queued: String,
    /// Set once the communicators were aborted (after a failure): never used again.
    aborted: Cell<bool>,
}

// SAFETY: NCCL communicators may be used from any thread, one call at a time; the backend that
// owns this is used by one thread at a time (`&mut` for every NCCL call).
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Join the world communicator of `id` as `rank` of `layout.world()` and split the plan's
    /// communicators. Collective over every rank of the run. The CUDA context must be current.
    pub(crate) fn new(
        id: &NcclId,
        rank: u32,
        layout: CommLayout,
        stream: CommStream,
    ) -> Result<NcclComm> {
        nccl_available()?;
        let world_size = layout.world();
        let mut raw: nc::ncclComm_t = std::ptr::null_mut();
        // SAFETY: writes one communicator handle; the id is the run's shared one.
        check(
            unsafe { nc::ncclCommInitRank(&mut raw, world_size as c_int, id.0, rank as c_int) },
            None,
            || format!("rank {rank} joining the world communicator of {world_size} ranks"),
        )?;
        let mut comm = NcclComm {
            rank,
            world: Communicator {
                raw,
                what: format!("the world communicator ({world_size} ranks)"),
            },
            splits: Vec::new(),
            layout,
            stream,
            last_queued: String::new(),
            aborted: Cell::new(false),
        };
        for index in 0..comm.layout.splits().len() {
            let color = comm.layout.color(index, rank);
            let mut split: nc::ncclComm_t = std::ptr::null_mut();
            let set = color.and_then(|c| comm.layout.splits()[index].get(c as usize));
            let what = match set {
                Some(set) => format!("the communicator of ranks {set:?}"),
                None => format!("split {index} (rank {rank} is in none of its sets)"),
            };
            // SAFETY: the world handle is live; a null config inherits the parent's.
            check(
                unsafe {
                    nc::ncclCommSplit(
                        comm.world.raw,
                        color.map_or(SPLIT_NO_COLOR, |c| c as c_int),
                        rank as c_int,
                        &mut split,
                        std::ptr::null_mut(),
                    )
                },
                Some(comm.world.raw),
                || format!("rank {rank} splitting {what} from the world communicator"),
            )?;
            comm.splits.push(
                (!split.is_null() && color.is_some()).then_some(Communicator { raw: split, what }),
            );
        }
        Ok(comm)
    }

    fn communicator(&self, set: &[u32]) -> Result<&Communicator> {
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

    /// Block until all queued communication has finished (or fail: timeout, NCCL error). On
    /// failure the communicators are aborted, so nothing waits on them afterwards.
    pub(crate) fn wait(&self) -> Result<()> {
        let (rank, world, splits) = (self.rank, &self.world, &self.splits);
        let result = self.stream.wait(&mut || async_errors(rank, world, splits));
        if let Err(e) = result {
            self.abort();
            let last = if self.last_queued.is_empty() {
                String::new()
            } else {
                format!(" (the last queued: {})", self.last_queued)
            };
            return Err(RuntimeError::Comm(format!("rank {}: {e}{last}", self.rank)));
        }
        Ok(())
    }

    /// [`NcclComm::wait`], then forget every pending mark.
    pub(crate) fn drain(&mut self) -> Result<()> {
        self.wait()?;
        self.stream.forget_all();
        Ok(())
    }

    fn abort(&self) {
        if self.aborted.replace(true) {
            return;
        }
        for c in std::iter::once(&self.world).chain(self.splits.iter().flatten()) {
            // SAFETY: the handle is live; `aborted` keeps it from being used or destroyed again.
            unsafe { nc::ncclCommAbort(c.raw) };
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.aborted.get() {
            return;
        }
        for c in self
            .splits
            .iter()
            .flatten()
            .chain(std::iter::once(&self.world))
        {
            // SAFETY: the handle is live and not used again; errors at teardown are moot.
            unsafe { nc::ncclCommDestroy(c.raw) };
        }
    }
}

/// Poll NCCL's asynchronous errors on every communicator.
fn async_errors(rank: u32, world: &Communicator, splits: &[Option<Communicator>]) -> Result<()> {
    for c in std::iter::once(world).chain(splits.iter().flatten()) {
        let mut state = nc::ncclResult_t::ncclSuccess;
        // SAFETY: the handle is live; writes one result.
        check(
            unsafe { nc::ncclCommGetAsyncError(c.raw, &mut state) },
            Some(c.raw),
            || format!("querying {}", c.what),
        )?;
        check(state, Some(c.raw), || {
            format!("rank {rank}: {} failed", c.what)
        })?;
    }
    Ok(())
}

fn f32_buffer(op: &str, b: &Buf) -> Result<()> {
    if b.dtype == DType::F32 {
        Ok(())
    } else {
        Err(RuntimeError::Op {
            op: op.into(),
            what: format!(
                "buffer {} is {:?}; NCCL comm moves f32 buffers",
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

fn describe(kind: CollectiveKind) -> &'static str {
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
        self.ctx
            .bind_to_thread()
            .map_err(|e| super::device::driver_error("making the context current for NCCL", e))?;
        let stream = CommStream::new(&self.ctx, timeout)?;
        self.nccl = Some(NcclComm::new(id, rank, CommLayout::of_plan(plan), stream)?);
        Ok(())
    }

    /// Whether collectives run through NCCL.
    pub fn uses_nccl(&self) -> bool {
        self.nccl.is_some()
    }

    /// Make the compute stream wait for queued communication on `ids` (before an op, a free).
    pub(crate) fn order_after_comm(
        &mut self,
        ids: impl IntoIterator<Item = BufferId>,
    ) -> Result<()> {
        match &mut self.nccl {
            Some(nccl) => nccl.stream.order_compute(&self.stream, ids),
            None => Ok(()),
        }
    }

    /// Whether the host must drain communication before touching `id`.
    pub(crate) fn comm_uses(&self, id: BufferId) -> bool {
        self.nccl.as_ref().is_some_and(|n| n.stream.uses(id))
    }

    /// Block until all queued communication has finished (with the timeout).
    pub(crate) fn drain_comm(&mut self) -> Result<()> {
        match &mut self.nccl {
            Some(nccl) => nccl.drain(),
            None => Ok(()),
        }
    }

    /// Before the host reads `id`: wait for queued communication that may still write it.
    pub(crate) fn wait_comm_for(&self, id: BufferId) -> Result<()> {
        match &self.nccl {
            Some(nccl) if nccl.stream.uses(id) => nccl.wait(),
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
        f32_buffer(name, &inp)?;
        f32_buffer(name, &out)?;
        let n = group.len();
        let (want_in, count) = match kind {
            CollectiveKind::AllReduce { .. } | CollectiveKind::Broadcast { .. } => {
                (out.len, out.len)
            }
            CollectiveKind::AllGather => (out.len / n.max(1), out.len / n.max(1)),
            CollectiveKind::ReduceScatter => (out.len * n, out.len),
        };
        let fits = inp.len == want_in
            && match kind {
                CollectiveKind::AllGather => out.len == inp.len * n,
                _ => true,
            };
        if !fits {
            return Err(sizes_error(
                name,
                format!(
                    "over {n} ranks: input buffer {} has {} elements and output buffer {} has {}",
                    input.0, inp.len, output.0, out.len
                ),
            ));
        }
        if let CollectiveKind::Broadcast { root } = kind {
            if root as usize >= n {
                return Err(sizes_error(
                    name,
                    format!("root {root} is not a member index of a {n}-rank group"),
                ));
            }
        }
        let rank = self.ctx_rank();
        let Some(nccl) = self.nccl.as_mut() else {
            return Err(RuntimeError::Unsupported("NCCL is not set up".into()));
        };
        nccl.stream.follow(&self.stream)?;
        let comm = nccl.communicator(group)?;
        let comm_what = comm.what.clone();
        let stream = nccl.stream.stream().cu_stream() as nc::cudaStream_t;
        let (send, recv) = (inp.ptr as *const c_void, out.ptr as *mut c_void);
        let f32t = nc::ncclDataType_t::ncclFloat32;
        // SAFETY: both buffers are live device allocations whose lengths were checked against
        // `count` for this kind; the stream belongs to this context.
        let result = unsafe {
            match kind {
                CollectiveKind::AllReduce { op } => {
                    let op = match op {
                        ReduceOp::Sum => nc::ncclRedOp_t::ncclSum,
                        ReduceOp::Max => nc::ncclRedOp_t::ncclMax,
                    };
                    nc::ncclAllReduce(send, recv, count, f32t, op, comm.raw, stream)
                }
                CollectiveKind::AllGather => {
                    nc::ncclAllGather(send, recv, count, f32t, comm.raw, stream)
                }
                CollectiveKind::ReduceScatter => nc::ncclReduceScatter(
                    send,
                    recv,
                    count,
                    f32t,
                    nc::ncclRedOp_t::ncclSum,
                    comm.raw,
                    stream,
                ),
                CollectiveKind::Broadcast { root } => {
                    nc::ncclBroadcast(send, recv, count, f32t, root as c_int, comm.raw, stream)
                }
            }
        };
        let what = format!(
            "rank {rank}: {name} of buffer {} into buffer {} over {comm_what}",
            input.0, output.0
        );
        check(result, Some(comm.raw), || what.clone())?;
        nccl.last_queued = what;
        nccl.stream.record(&[input, output])
    }

    /// [`crate::backend::Backend::device_p2p`] through NCCL: one NCCL group.
    pub(crate) fn nccl_p2p(&mut self, transfers: &[DeviceTransfer]) -> Result<()> {
        let mut bound = Vec::with_capacity(transfers.len());
        for t in transfers {
            let (send, peer, buffer) = match *t {
                DeviceTransfer::Send { peer, buffer, .. } => (true, peer, buffer),
                DeviceTransfer::Recv { peer, buffer, .. } => (false, peer, buffer),
            };
            let b = self.buf(buffer)?;
            f32_buffer(if send { "send" } else { "receive" }, &b)?;
            bound.push((send, peer, b));
        }
        let rank = self.ctx_rank();
        let Some(nccl) = self.nccl.as_mut() else {
            return Err(RuntimeError::Unsupported("NCCL is not set up".into()));
        };
        nccl.stream.follow(&self.stream)?;
        let world = nccl.world.raw;
        let stream = nccl.stream.stream().cu_stream() as nc::cudaStream_t;
        let describe = || {
            bound
                .iter()
                .map(|(send, peer, b)| {
                    if *send {
                        format!("send buffer {} to rank {peer}", b.id.0)
                    } else {
                        format!("receive buffer {} from rank {peer}", b.id.0)
                    }
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        // SAFETY: no arguments.
        check(unsafe { nc::ncclGroupStart() }, Some(world), || {
            format!("rank {rank}: starting a transfer group")
        })?;
        let mut first_error = Ok(());
        for (send, peer, b) in &bound {
            // SAFETY: each buffer is a live device allocation of `b.len` f32s; the peer is a
            // global rank of the world communicator (the plan was checked).
            let result = unsafe {
                if *send {
                    nc::ncclSend(
                        b.ptr as *const c_void,
                        b.len,
                        nc::ncclDataType_t::ncclFloat32,
                        *peer as c_int,
                        world,
                        stream,
                    )
                } else {
                    nc::ncclRecv(
                        b.ptr as *mut c_void,
                        b.len,
                        nc::ncclDataType_t::ncclFloat32,
                        *peer as c_int,
                        world,
                        stream,
                    )
                }
            };
            if first_error.is_ok() {
                first_error = check(result, Some(world), || {
                    format!("rank {rank}: queueing {}", describe())
                });
            }
        }
        // The group is always closed, even after a failed call inside it.
        // SAFETY: no arguments.
        let closed = check(unsafe { nc::ncclGroupEnd() }, Some(world), || {
            format!("rank {rank}: {}", describe())
        });
        first_error?;
        closed?;
        nccl.last_queued = format!("rank {rank}: {}", describe());
        let ids: Vec<BufferId> = bound.iter().map(|(_, _, b)| b.id).collect();
        nccl.stream.record(&ids)
    }

    fn ctx_rank(&self) -> u32 {
        self.nccl.as_ref().map_or(0, |n| n.rank)
    }
}
