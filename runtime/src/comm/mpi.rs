//! The MPI comm: the collectives of a multi-process CPU run, one rank per process, over an MPI
//! library (Open MPI, MPICH) started by `mpiexec`/`mpirun`/`srun`. Feature `mpi`.
//!
//! MPI moves the bytes; the reductions are parc's own, so results equal the local comm's bit
//! for bit: every collective is an exchange of point-to-point messages among the group's
//! members, and each member combines what it received in group-rank order (an all-reduce
//! gathers every member's input and adds them in order; a reduce-scatter sends member `j` the
//! `j`-th chunk of every input). Group traffic is small on the CPU, where this comm serves
//! tests and laptops; the GPU path uses NCCL.
//!
//! All traffic runs on `MPI_COMM_WORLD`, with no sub-communicators: creating one is a blocking
//! collective that would hang if a member died first. Collective messages carry a header
//! (group, call number, operation, length) that the receiver checks, so members that issue
//! different collectives are reported as a mismatch instead of exchanging wrong data; ranks
//! issue their common collectives in one order (the verifier proves the schedule free of
//! deadlock, which needs that), so MPI's in-order matching per sender pairs the calls.
//!
//! Nothing waits forever: sends are `MPI_Isend` tested in a loop, receives are matched with
//! `MPI_Improbe` then taken with `MPI_Mrecv` (a message is received only once it has arrived,
//! at its real size), and every loop ends at the deadline with an error naming this rank, the
//! operation and the peers it still waits for, or at once when the rendezvous reports that a
//! rank failed. After a failure the process must exit: buffers of unfinished sends are leaked
//! on purpose (MPI may still read them), and MPI is not finalized.
use super::{check_lengths, combine, Comm, PeerOp};
use crate::error::{Result, RuntimeError};
use crate::launch::Rendezvous;
use mpi::ffi;
use parc_compiler::ir::{CollectiveKind, ReduceOp};
use std::collections::HashMap;
use std::os::raw::c_int;
use std::time::{Duration, Instant};

/// Tag of every collective message; point-to-point tags are the IR's tag + 1.
const COLLECTIVE_TAG: c_int = 0;
/// The largest tag every MPI library accepts (the standard's minimum `MPI_TAG_UB`).
const MAX_TAG: u32 = 32767;
/// Header of a collective message: group key, call number, operation code, element count.
const HEADER: usize = 24;

fn mpi_error(what: String) -> RuntimeError {
    RuntimeError::Comm(format!("MPI: {what}"))
}

fn check(code: c_int, call: &str) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(mpi_error(format!(
            "{call} failed with MPI error code {code}"
        )))
    }
}

/// A collective as the members must agree on it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Call {
    AllReduce(ReduceOp),
    AllGather,
    ReduceScatter,
    Broadcast(usize),
}

impl Call {
    fn code(self) -> u32 {
        match self {
            Call::AllReduce(ReduceOp::Sum) => 1,
            Call::AllReduce(ReduceOp::Max) => 2,
            Call::AllGather => 3,
            Call::ReduceScatter => 4,
            Call::Broadcast(root) => 16 + root as u32,
        }
    }

    fn describe(code: u32, len: u32) -> String {
        match code {
            1 => format!("all_reduce(sum) of {len} elements"),
            2 => format!("all_reduce(max) of {len} elements"),
            3 => format!("all_gather of {len} elements"),
            4 => format!("reduce_scatter of {len} elements"),
            c if c >= 16 => format!("broadcast from member {} of {len} elements", c - 16),
            c => format!("unknown collective {c}"),
        }
    }
}

/// A stable key of a group's member list (the same on every rank).
fn group_key(group: &[u32]) -> u64 {
    group.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &r| {
        (h ^ u64::from(r)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn f32_bytes(data: &[f32]) -> impl Iterator<Item = u8> + '_ {
    data.iter().flat_map(|x| x.to_le_bytes())
}

fn read_f32s(bytes: &[u8], out: &mut [f32]) {
    for (x, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// One rank's MPI comm. Create it once per process ([`MpiComm::init`]); dropping it after a
/// successful run finalizes MPI.
pub struct MpiComm {
    rank: u32,
    world: u32,
    timeout: Duration,
    rendezvous: Rendezvous,
    /// Collective calls issued so far per group (the next call's number).
    calls: HashMap<Vec<u32>, u64>,
    /// A failure happened: MPI is left as is for the process to exit.
    failed: bool,
}

// SAFETY: MPI is initialized with MPI_THREAD_SERIALIZED and the comm is used by one thread at
// a time (it is moved, never shared: `&mut self` on every call).
unsafe impl Send for MpiComm {}

impl MpiComm {
    /// Initialize MPI for this process and check it agrees with the rendezvous (same rank and
    /// world size). Any wait longer than `timeout` fails.
    pub fn init(rendezvous: Rendezvous, timeout: Duration) -> Result<MpiComm> {
        let (rank, world) = unsafe {
            let mut initialized: c_int = 0;
            check(ffi::MPI_Initialized(&mut initialized), "MPI_Initialized")?;
            if initialized != 0 {
                return Err(mpi_error(
                    "MPI is already initialized in this process; create one MpiComm per \
                     process"
                        .to_string(),
                ));
            }
            let mut provided: c_int = 0;
            check(
                ffi::MPI_Init_thread(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    ffi::RSMPI_THREAD_SERIALIZED,
                    &mut provided,
                ),
                "MPI_Init_thread",
            )?;
            let (mut rank, mut size): (c_int, c_int) = (0, 0);
            check(
                ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank),
                "MPI_Comm_rank",
            )?;
            check(
                ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size),
                "MPI_Comm_size",
            )?;
            (rank as u32, size as u32)
        };
        let mut comm = MpiComm {
            rank,
            world,
            timeout,
            rendezvous,
            calls: HashMap::new(),
            failed: false,
        };
        if (rank, world) != (comm.rendezvous.rank(), comm.rendezvous.world()) {
            // Not finalized on drop: the other processes may never get there.
            comm.failed = true;
            return Err(mpi_error(format!(
                "MPI says this is rank {rank} of {world}, but the launcher's variables say rank \
                 {} of {}; start the ranks with one launcher (mpiexec, or srun --mpi=pmix)",
                comm.rendezvous.rank(),
                comm.rendezvous.world()
            )));
        }
        Ok(comm)
    }

    fn fail(&mut self, error: RuntimeError) -> RuntimeError {
        self.failed = true;
        error
    }

    /// Whether every rank in `peers` is itself waiting (as the rendezvous board says) and,
    /// following whom they wait for, some rank other than this one waits for nobody: then
    /// that rank hangs, and a rank waiting for it directly will time out and name it. False
    /// when a peer is not waiting (it hangs, or is slow), or when the waits only lead back
    /// here (ranks waiting for each other: issued in different orders).
    fn stuck_behind(&self, peers: &[u32]) -> bool {
        let mut seen = vec![false; self.world as usize];
        let mut queue: Vec<u32> = peers.to_vec();
        let mut leads_to_a_hang = false;
        while let Some(rank) = queue.pop() {
            if rank == self.rank || std::mem::replace(&mut seen[rank as usize], true) {
                continue;
            }
            let waits = self.rendezvous.waiting_for(rank);
            if waits.is_empty() {
                if peers.contains(&rank) {
                    return false;
                }
                leads_to_a_hang = true;
            }
            queue.extend(waits.into_iter().filter(|&r| r < self.world));
        }
        leads_to_a_hang
    }

    fn peer_failed(&mut self, doing: &str) -> Result<()> {
        let result = self.rendezvous.check_failed(doing);
        result.map_err(|e| self.fail(e))
    }

    /// Send `messages` (peer, tag, bytes) and receive one message from each of `from`
    /// (peer, tag), all at once; returns the received messages in the order of `from`.
    /// `doing` names the operation in errors.
    fn exchange(
        &mut self,
        messages: Vec<(u32, c_int, Vec<u8>)>,
        from: &[(u32, c_int)],
        doing: &dyn Fn() -> String,
    ) -> Result<Vec<Vec<u8>>> {
        let peers = messages
            .iter()
            .map(|(p, ..)| *p)
            .chain(from.iter().map(|(p, _)| *p));
        for peer in peers.collect::<Vec<u32>>() {
            if peer >= self.world {
                return Err(mpi_error(format!(
                    "rank {} addressed rank {peer}, but the world has {} ranks",
                    self.rank, self.world
                )));
            }
        }
        let mut sends: Vec<(u32, ffi::MPI_Request, Vec<u8>)> = Vec::with_capacity(messages.len());
        for (peer, tag, bytes) in messages {
            let mut request: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
            let count = c_int::try_from(bytes.len()).map_err(|_| {
                mpi_error(format!(
                    "a message of {} bytes is too large for one MPI send",
                    bytes.len()
                ))
            })?;
            // SAFETY: `bytes` lives in `sends` until the request completes (or is leaked).
            let code = unsafe {
                ffi::MPI_Isend(
                    bytes.as_ptr().cast(),
                    count,
                    ffi::RSMPI_UINT8_T,
                    peer as c_int,
                    tag,
                    ffi::RSMPI_COMM_WORLD,
                    &mut request,
                )
            };
            sends.push((peer, request, bytes));
            if let Err(e) = check(code, "MPI_Isend") {
                std::mem::forget(sends);
                return Err(self.fail(e));
            }
        }
        let mut received: Vec<Option<Vec<u8>>> = vec![None; from.len()];
        let mut sent = vec![false; sends.len()];
        let started = Instant::now();
        let mut deadline = started + self.timeout;
        // A wait this long is told to the other ranks (see `stuck_behind`).
        let report_after = (self.timeout / 8).min(Duration::from_millis(250));
        let mut reported = false;
        let mut extensions = 0u32;
        let mut idle = 0u32;
        loop {
            let mut progress = false;
            for (i, (_, request, _)) in sends.iter_mut().enumerate() {
                if sent[i] {
                    continue;
                }
                let mut flag: c_int = 0;
                // SAFETY: a live request from MPI_Isend.
                let code = unsafe { ffi::MPI_Test(request, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
                if code != 0 {
                    std::mem::forget(sends);
                    return Err(self.fail(mpi_error(format!("MPI_Test failed with code {code}"))));
                }
                if flag != 0 {
                    sent[i] = true;
                    progress = true;
                }
            }
            for (slot, &(peer, tag)) in received.iter_mut().zip(from) {
                if slot.is_some() {
                    continue;
                }
                match probe_receive(peer, tag) {
                    Ok(Some(bytes)) => {
                        *slot = Some(bytes);
                        progress = true;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        std::mem::forget(sends);
                        return Err(self.fail(e));
                    }
                }
            }
            if sent.iter().all(|&s| s) && received.iter().all(Option::is_some) {
                if reported {
                    self.rendezvous.report_waiting(&[]);
                }
                return Ok(received.into_iter().flatten().collect());
            }
            if let Err(e) = self.peer_failed(&format!("in {}", doing())) {
                std::mem::forget(sends);
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline || (!reported && now >= started + report_after) {
                let unsent: Vec<u32> = sends
                    .iter()
                    .zip(&sent)
                    .filter(|(_, s)| !**s)
                    .map(|((p, ..), _)| *p)
                    .collect();
                let missing: Vec<u32> = from
                    .iter()
                    .zip(&received)
                    .filter(|(_, r)| r.is_none())
                    .map(|((p, _), _)| *p)
                    .collect();
                let mut peers: Vec<u32> = missing.iter().chain(&unsent).copied().collect();
                peers.sort_unstable();
                peers.dedup();
                if !reported {
                    self.rendezvous.report_waiting(&peers);
                    reported = true;
                }
                if now < deadline {
                    continue;
                }
                // Behind a rank that waits for a hung one: give it the time to name it.
                if extensions < self.world && self.stuck_behind(&peers) {
                    extensions += 1;
                    deadline = now + self.timeout;
                    continue;
                }
                std::mem::forget(sends);
                let mut waits = Vec::new();
                if !missing.is_empty() {
                    waits.push(format!("ranks {missing:?} never sent their part"));
                }
                if !unsent.is_empty() {
                    waits.push(format!("ranks {unsent:?} never took this rank's part"));
                }
                return Err(self.fail(RuntimeError::Comm(format!(
                    "rank {} waited {:.1} s in {}: {}; they failed, hang, or issued \
                     operations in a different order",
                    self.rank,
                    self.timeout.as_secs_f64(),
                    doing(),
                    waits.join(" and ")
                ))));
            }
            if progress {
                idle = 0;
            } else {
                idle = idle.saturating_add(1);
                // Spin briefly, then back off to at most 1 ms so a waiting rank leaves the
                // cores to the ranks that compute.
                if idle > 64 {
                    let micros = u64::from(idle.min(1000));
                    std::thread::sleep(Duration::from_micros(micros));
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Exchange one collective's messages over `group`: this member sends `parts[j]` to member
    /// `j` (none to itself, and none where `parts[j]` is None) and receives from `from`
    /// (member indices), each message checked against the call every member must issue.
    fn collective(
        &mut self,
        group: &[u32],
        call: Call,
        len: usize,
        parts: Vec<Option<Vec<u8>>>,
        from: &[usize],
        part_len: usize,
    ) -> Result<Vec<Vec<u8>>> {
        let me = self.member(group)?;
        let counter = self.calls.entry(group.to_vec()).or_insert(0);
        let number = *counter;
        *counter += 1;
        let key = group_key(group);
        let len32 = u32::try_from(len)
            .map_err(|_| mpi_error(format!("a collective of {len} elements is too large")))?;
        let mut header = Vec::with_capacity(HEADER);
        header.extend_from_slice(&key.to_le_bytes());
        header.extend_from_slice(&number.to_le_bytes());
        header.extend_from_slice(&call.code().to_le_bytes());
        header.extend_from_slice(&len32.to_le_bytes());
        let mut messages = Vec::new();
        for (j, part) in parts.into_iter().enumerate() {
            if let (Some(bytes), Some(&peer)) = (part, group.get(j)) {
                if j != me {
                    let mut message = header.clone();
                    message.extend_from_slice(&bytes);
                    messages.push((peer, COLLECTIVE_TAG, message));
                }
            }
        }
        let sources: Vec<(u32, c_int)> = from
            .iter()
            .filter_map(|&j| group.get(j).map(|&p| (p, COLLECTIVE_TAG)))
            .collect();
        let rank = self.rank;
        let doing = || {
            format!(
                "{} on group {group:?} (call #{number})",
                Call::describe(call.code(), len32)
            )
        };
        let received = self.exchange(messages, &sources, &doing)?;
        let mut payloads = Vec::with_capacity(received.len());
        for (message, &(peer, _)) in received.into_iter().zip(&sources) {
            let field = |at: usize, n: usize| message.get(at..at + n).unwrap_or(&[]);
            let u64_at =
                |at: usize| <[u8; 8]>::try_from(field(at, 8)).map_or(u64::MAX, u64::from_le_bytes);
            let u32_at =
                |at: usize| <[u8; 4]>::try_from(field(at, 4)).map_or(u32::MAX, u32::from_le_bytes);
            let (their_key, their_number, their_code, their_len) =
                (u64_at(0), u64_at(8), u32_at(16), u32_at(20));
            if (their_key, their_number, their_code, their_len) != (key, number, call.code(), len32)
                || message.len() != HEADER + part_len * 4
            {
                let theirs = if their_key == key {
                    format!(
                        "{} (call #{their_number})",
                        Call::describe(their_code, their_len)
                    )
                } else {
                    "a collective on another group".to_string()
                };
                return Err(self.fail(RuntimeError::Comm(format!(
                    "collective mismatch on group {group:?}, call #{number}: rank {rank} issued \
                     {} but rank {peer} issued {theirs}; members must issue the same \
                     collectives in the same order",
                    Call::describe(call.code(), len32)
                ))));
            }
            payloads.push(message[HEADER..].to_vec());
        }
        Ok(payloads)
    }

    /// Sends `input` to every other member of `group` and receives each one's, as `call`
    /// (all-reduce and all-gather exchange so): this member's index in the group, and the
    /// others' bytes in group order.
    fn exchange_all(
        &mut self,
        group: &[u32],
        call: Call,
        input: &[f32],
    ) -> Result<(usize, Vec<Vec<u8>>)> {
        let me = self.member(group)?;
        let mine: Vec<u8> = f32_bytes(input).collect();
        let parts = vec![Some(mine); group.len()];
        let others: Vec<usize> = (0..group.len()).filter(|&j| j != me).collect();
        let len = input.len();
        let received = self.collective(group, call, len, parts, &others, len)?;
        Ok((me, received))
    }

    fn member(&self, group: &[u32]) -> Result<usize> {
        if let Some(&bad) = group.iter().find(|&&r| r >= self.world) {
            return Err(mpi_error(format!(
                "group {group:?} names rank {bad}, but the world has {} ranks",
                self.world
            )));
        }
        group.iter().position(|&r| r == self.rank).ok_or_else(|| {
            mpi_error(format!(
                "rank {} issued a collective on group {group:?}, which does not contain it",
                self.rank
            ))
        })
    }

    fn p2p_tag(&self, tag: u32) -> Result<c_int> {
        if tag >= MAX_TAG {
            return Err(mpi_error(format!(
                "point-to-point tag {tag} is above what every MPI accepts ({})",
                MAX_TAG - 1
            )));
        }
        Ok(tag as c_int + 1)
    }
}

/// Receive the next message from `peer` under `tag` if it has arrived.
fn probe_receive(peer: u32, tag: c_int) -> Result<Option<Vec<u8>>> {
    // SAFETY: plain MPI calls on COMM_WORLD; the message handle from MPI_Improbe is received
    // at once with MPI_Mrecv into a buffer of exactly its size.
    unsafe {
        let mut flag: c_int = 0;
        let mut message: ffi::MPI_Message = ffi::RSMPI_MESSAGE_NULL;
        let mut status = std::mem::zeroed::<ffi::MPI_Status>();
        check(
            ffi::MPI_Improbe(
                peer as c_int,
                tag,
                ffi::RSMPI_COMM_WORLD,
                &mut flag,
                &mut message,
                &mut status,
            ),
            "MPI_Improbe",
        )?;
        if flag == 0 {
            return Ok(None);
        }
        let mut count: c_int = 0;
        check(
            ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count),
            "MPI_Get_count",
        )?;
        let mut bytes = vec![0u8; count.max(0) as usize];
        check(
            ffi::MPI_Mrecv(
                bytes.as_mut_ptr().cast(),
                count,
                ffi::RSMPI_UINT8_T,
                &mut message,
                ffi::RSMPI_STATUS_IGNORE,
            ),
            "MPI_Mrecv",
        )?;
        Ok(Some(bytes))
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if self.failed {
            // Peers may be gone: finalizing could wait for them. The process exits failed.
            return;
        }
        // SAFETY: every request completed (operations return only then, or mark `failed`).
        unsafe {
            let mut finalized: c_int = 0;
            if ffi::MPI_Finalized(&mut finalized) == 0 && finalized == 0 {
                ffi::MPI_Finalize();
            }
        }
    }
}

/// Reduce into `out` the contributions of a group of `members` in group-rank order: this
/// member's `own` at index `me`, the others' from `received` (their bytes in group order, `me`
/// left out).
fn reduce_members(
    out: &mut [f32],
    own: &[f32],
    received: &[Vec<u8>],
    (me, members): (usize, usize),
    op: ReduceOp,
) {
    let mut theirs = received.iter();
    let mut other = vec![0.0f32; out.len()];
    for j in 0..members {
        let member: &[f32] = if j == me {
            own
        } else {
            match theirs.next() {
                Some(bytes) => {
                    read_f32s(bytes, &mut other);
                    &other
                }
                None => continue,
            }
        };
        if j == 0 {
            out.copy_from_slice(member);
        } else {
            combine(out, member, op);
        }
    }
}

impl Comm for MpiComm {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.world
    }

    fn all_reduce(&mut self, group: &[u32], op: ReduceOp, data: &mut [f32]) -> Result<()> {
        let (me, received) = self.exchange_all(group, Call::AllReduce(op), data)?;
        // Combine in group-rank order, this member's own input in its place.
        let own = data.to_vec();
        reduce_members(data, &own, &received, (me, group.len()), op);
        Ok(())
    }

    fn all_gather(&mut self, group: &[u32], input: &[f32], output: &mut [f32]) -> Result<()> {
        check_lengths(CollectiveKind::AllGather, group, input, output).map_err(mpi_error)?;
        let (me, received) = self.exchange_all(group, Call::AllGather, input)?;
        let mut theirs = received.iter();
        for (j, chunk) in output.chunks_mut(input.len().max(1)).enumerate() {
            if j == me {
                chunk.copy_from_slice(input);
            } else if let Some(bytes) = theirs.next() {
                read_f32s(bytes, chunk);
            }
        }
        Ok(())
    }

    fn reduce_scatter(&mut self, group: &[u32], input: &[f32], output: &mut [f32]) -> Result<()> {
        check_lengths(CollectiveKind::ReduceScatter, group, input, output).map_err(mpi_error)?;
        let me = self.member(group)?;
        let n = output.len();
        let parts: Vec<Option<Vec<u8>>> = (0..group.len())
            .map(|j| {
                input
                    .get(j * n..(j + 1) * n)
                    .map(|c| f32_bytes(c).collect())
            })
            .collect();
        let others: Vec<usize> = (0..group.len()).filter(|&j| j != me).collect();
        let received =
            self.collective(group, Call::ReduceScatter, input.len(), parts, &others, n)?;
        let own = input.get(me * n..(me + 1) * n).unwrap_or(&[]);
        reduce_members(output, own, &received, (me, group.len()), ReduceOp::Sum);
        Ok(())
    }

    fn broadcast(&mut self, group: &[u32], root: usize, data: &mut [f32]) -> Result<()> {
        if root >= group.len() {
            return Err(mpi_error(format!(
                "broadcast on group {group:?} from member {root}, which does not exist"
            )));
        }
        let me = self.member(group)?;
        let (parts, from) = if me == root {
            let mine: Vec<u8> = f32_bytes(data).collect();
            (vec![Some(mine); group.len()], Vec::new())
        } else {
            (vec![None; group.len()], vec![root])
        };
        let received = self.collective(
            group,
            Call::Broadcast(root),
            data.len(),
            parts,
            &from,
            data.len(),
        )?;
        if let Some(bytes) = received.first() {
            read_f32s(bytes, data);
        }
        Ok(())
    }

    fn group_p2p(&mut self, ops: &mut [PeerOp<'_>]) -> Result<()> {
        let mut messages = Vec::new();
        let mut from = Vec::new();
        for op in ops.iter() {
            match op {
                PeerOp::Send { peer, tag, data } => {
                    messages.push((*peer, self.p2p_tag(*tag)?, f32_bytes(data).collect()))
                }
                PeerOp::Recv { peer, tag, .. } => from.push((*peer, self.p2p_tag(*tag)?)),
            }
        }
        let rank = self.rank;
        let describe: Vec<String> = ops
            .iter()
            .map(|op| match op {
                PeerOp::Send { peer, tag, data } => {
                    format!("send of {} elements to rank {peer} (tag {tag})", data.len())
                }
                PeerOp::Recv { peer, tag, out } => {
                    format!(
                        "receive of {} elements from rank {peer} (tag {tag})",
                        out.len()
                    )
                }
            })
            .collect();
        let doing = || describe.join(", ");
        let received = self.exchange(messages, &from, &doing)?;
        let mut messages = received.into_iter();
        for op in ops.iter_mut() {
            if let PeerOp::Recv { peer, tag, out } = op {
                let bytes = messages.next().unwrap_or_default();
                if bytes.len() != out.len() * 4 {
                    return Err(self.fail(RuntimeError::Comm(format!(
                        "rank {rank} expected {} elements from rank {peer} (tag {tag}) but got {}",
                        out.len(),
                        bytes.len() / 4
                    ))));
                }
                read_f32s(&bytes, out);
            }
        }
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        self.failed = true;
        self.rendezvous.abort(reason);
    }
}
