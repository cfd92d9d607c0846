//! The TCP rendezvous of a multi-process job: the small control plane every rank joins before
//! any collective. Rank 0 listens on the master address; every other rank connects and says
//! who it is ([`Member`]: rank, world size, host, pid, local rank, plan hash). Rank 0 waits until
//! every rank came or the timeout passed (then it names the ranks that never came), checks that
//! all agree on the world size, the plan, the spec's settings and the `parc run` flags that
//! change training, and answers every rank with the member list or the reason it refuses.
//!
//! After that the connections stay open as the job's failure channel and a byte broadcast:
//! - [`Rendezvous::broadcast_bytes`] sends a payload from rank 0 to all (the NCCL unique id).
//! - [`Rendezvous::abort`] tells every rank that this one failed and why (rank 0 relays);
//!   a connection that closes before its rank said it finished is reported as that rank's
//!   death. [`Rendezvous::failure`] is what comms poll while they wait, so a peer's failure
//!   ends their waits at once instead of at a timeout.
//! - [`Rendezvous::report_waiting`] tells every rank which ranks this one has been waiting for
//!   (rank 0 relays), and [`Rendezvous::waiting_for`] reads the board: a comm whose wait times
//!   out on a rank that is itself waiting for others waits on, so the error names the rank that
//!   hangs rather than one stuck behind it.
//! - [`Rendezvous::finish`] ends the job together: every rank reports done, rank 0 answers
//!   when all have, so no rank mistakes another's normal exit for a death.
//! - Rank 0's port stays open while the job runs (`Gate`): a process that comes later (a
//!   second process with a rank the job has, another job on the same port) is turned away at
//!   once, told which process holds its rank, rather than retrying until its own timeout.
//!
//! Frames: a little-endian u32 length (of kind + payload), a kind byte, the payload.
use crate::error::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a rendezvous waits for every rank by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// What a rank says about itself when it joins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub rank: u32,
    pub world: u32,
    pub local_rank: u32,
    pub host: String,
    pub pid: u32,
    /// The plan's hash (`checkpoint::plan_hash`): every rank must run the same programs.
    pub plan_hash: String,
    /// The spec's settings that the plan does not cover (`super::spec_settings`: the seed, the
    /// learning rate, the data, the steps, …), each by its path: every rank must train with
    /// the same ones, or the replicas of one model drift apart with no error.
    #[serde(default)]
    pub settings: BTreeMap<String, String>,
    /// The `parc run` flags that change how the job trains, each by its name (`--fusion` →
    /// `off`): every rank must be started with the same ones.
    #[serde(default)]
    pub flags: BTreeMap<String, String>,
}

impl Member {
    fn describe(&self) -> String {
        format!("rank {} (host {}, pid {})", self.rank, self.host, self.pid)
    }
}

/// How to join.
#[derive(Clone, Debug)]
pub struct RendezvousConfig {
    pub me: Member,
    pub master_addr: String,
    pub master_port: u16,
    pub timeout: Duration,
}

impl RendezvousConfig {
    /// This process as `rank` of `world`, on this host.
    pub fn new(
        rank: u32,
        world: u32,
        local_rank: u32,
        plan_hash: &str,
        master_addr: &str,
        master_port: u16,
    ) -> RendezvousConfig {
        RendezvousConfig {
            me: Member {
                rank,
                world,
                local_rank,
                host: host_name(),
                pid: std::process::id(),
                plan_hash: plan_hash.to_string(),
                settings: Default::default(),
                flags: Default::default(),
            },
            master_addr: master_addr.to_string(),
            master_port,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// This machine's host name (for messages).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".to_string())
}

/// A free port for the rendezvous, below the kernel's ephemeral range so no outgoing
/// connection (the ranks' own, or another job's) takes it between now and rank 0's listen.
pub fn free_port() -> std::io::Result<u16> {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (20000u16, ephemeral_low.max(20001));
    // Start at a point that differs per launch so concurrent launchers do not race for one.
    let seed = std::process::id() as u64
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as u64);
    let span = u64::from(high - low);
    for i in 0..span {
        let port = low + ((seed + i) % span) as u16;
        if TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return Ok(port);
        }
    }
    // Everything below the ephemeral range is taken: let the kernel pick.
    Ok(TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}

const HELLO: u8 = 1;
const READY: u8 = 2;
const REFUSED: u8 = 3;
const BROADCAST: u8 = 4;
const ABORT: u8 = 5;
const DONE: u8 = 6;
const BYE: u8 = 7;
const WAITING: u8 = 8;
/// Rank 0's answer to a process that came once the rendezvous was over (the job goes on).
const TURNED_AWAY: u8 = 9;

/// Largest frame accepted (a broadcast payload is small: an id, a config).
const MAX_FRAME: u32 = 64 << 20;

fn rdv_error(message: String) -> RuntimeError {
    RuntimeError::Comm(format!("rendezvous: {message}"))
}

fn write_frame(stream: &mut TcpStream, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(payload.len() + 1)
        .map_err(|_| std::io::Error::new(ErrorKind::InvalidInput, "frame too large"))?;
    let mut frame = Vec::with_capacity(payload.len() + 5);
    frame.extend_from_slice(&len.to_le_bytes());
    frame.push(kind);
    frame.extend_from_slice(payload);
    stream.write_all(&frame)?;
    stream.flush()
}

fn read_frame(stream: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len);
    if len == 0 || len > MAX_FRAME {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a frame of {len} bytes is not a parc rendezvous frame"),
        ));
    }
    let mut body = vec![0u8; len as usize];
    stream.read_exact(&mut body)?;
    let kind = body.remove(0);
    Ok((kind, body))
}

fn abort_payload(rank: u32, reason: &str) -> Vec<u8> {
    let mut payload = rank.to_le_bytes().to_vec();
    payload.extend_from_slice(reason.as_bytes());
    payload
}

fn parse_abort(payload: &[u8]) -> (u32, String) {
    let rank = payload
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map_or(u32::MAX, u32::from_le_bytes);
    let reason = String::from_utf8_lossy(payload.get(4..).unwrap_or(&[])).into_owned();
    (rank, reason)
}

/// The first failure the job heard of: (rank, reason).
#[derive(Clone, Default)]
pub struct FailureWatch {
    first: Arc<Mutex<Option<(u32, String)>>>,
}

impl FailureWatch {
    /// The first rank that failed and why, if any has.
    pub fn failed(&self) -> Option<(u32, String)> {
        self.first.lock().ok().and_then(|f| f.clone())
    }

    /// Record a failure; false when one was already recorded.
    fn set(&self, rank: u32, reason: String) -> bool {
        match self.first.lock() {
            Ok(mut first) if first.is_none() => {
                *first = Some((rank, reason));
                true
            }
            _ => false,
        }
    }
}

/// Which ranks each rank has been waiting for in a comm (empty: none), as last reported.
#[derive(Clone)]
struct WaitBoard {
    waits: Arc<Mutex<Vec<Vec<u32>>>>,
}

impl WaitBoard {
    fn new(world: u32) -> WaitBoard {
        WaitBoard {
            waits: Arc::new(Mutex::new(vec![Vec::new(); world as usize])),
        }
    }

    fn set(&self, rank: u32, waiting_for: Vec<u32>) {
        if let Ok(mut waits) = self.waits.lock() {
            if let Some(slot) = waits.get_mut(rank as usize) {
                *slot = waiting_for;
            }
        }
    }

    fn get(&self, rank: u32) -> Vec<u32> {
        self.waits
            .lock()
            .ok()
            .and_then(|w| w.get(rank as usize).cloned())
            .unwrap_or_default()
    }
}

fn waiting_payload(rank: u32, waiting_for: &[u32]) -> Vec<u8> {
    let mut payload = rank.to_le_bytes().to_vec();
    for r in waiting_for {
        payload.extend_from_slice(&r.to_le_bytes());
    }
    payload
}

fn parse_waiting(payload: &[u8]) -> Option<(u32, Vec<u32>)> {
    let mut words = payload
        .chunks_exact(4)
        .filter_map(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_le_bytes);
    let rank = words.next()?;
    Some((rank, words.collect()))
}

/// One open connection: rank 0 holds one per peer, the others one to rank 0.
struct Link {
    peer: u32,
    writer: Mutex<TcpStream>,
}

impl Link {
    fn send(&self, kind: u8, payload: &[u8]) -> std::io::Result<()> {
        let mut stream = self
            .writer
            .lock()
            .map_err(|_| std::io::Error::other("a rendezvous writer panicked"))?;
        write_frame(&mut stream, kind, payload)
    }
}

struct Inner {
    me: Member,
    members: Vec<Member>,
    timeout: Duration,
    links: Vec<Arc<Link>>,
    failure: FailureWatch,
    waits: WaitBoard,
    /// Rank 0: peers that reported done; others: whether rank 0 said bye.
    finished: Arc<Mutex<Vec<bool>>>,
    /// Broadcast payloads from rank 0 (ranks other than 0).
    broadcasts: Mutex<Receiver<Vec<u8>>>,
    /// Rank 0: its port, kept open while the job runs to turn latecomers away.
    _gate: Option<Gate>,
}

/// A completed rendezvous: the job's members and its control connections.
#[derive(Clone)]
pub struct Rendezvous {
    inner: Arc<Inner>,
}

impl Rendezvous {
    /// Join the job's rendezvous: rank 0 listens, the others connect. Returns when every rank
    /// has joined and they agree, or fails naming who did not come or who disagrees.
    pub fn join(config: &RendezvousConfig) -> Result<Rendezvous> {
        let me = &config.me;
        if me.rank >= me.world {
            return Err(rdv_error(format!(
                "rank {} is outside a world of {} processes",
                me.rank, me.world
            )));
        }
        if me.rank == 0 {
            host(config)
        } else {
            connect(config)
        }
    }

    pub fn rank(&self) -> u32 {
        self.inner.me.rank
    }

    pub fn world(&self) -> u32 {
        self.inner.me.world
    }

    /// Every member, in rank order.
    pub fn members(&self) -> &[Member] {
        &self.inner.members
    }

    /// The failure channel's state, for comms to poll while they wait.
    pub fn failure(&self) -> FailureWatch {
        self.inner.failure.clone()
    }

    /// Rank 0 passes `Some(payload)` and every other rank `None`; all get rank 0's payload.
    /// Calls pair up in order. A rank that fails meanwhile ends the wait with its reason.
    pub fn broadcast_bytes(&self, payload: Option<&[u8]>) -> Result<Vec<u8>> {
        let inner = &self.inner;
        if inner.me.rank == 0 {
            let payload = payload.ok_or_else(|| {
                rdv_error("rank 0 must give the payload of a broadcast".to_string())
            })?;
            for link in &inner.links {
                link.send(BROADCAST, payload).map_err(|e| {
                    rdv_error(format!(
                        "rank 0 could not send a broadcast to rank {}: {e}",
                        link.peer
                    ))
                })?;
            }
            return Ok(payload.to_vec());
        }
        let receiver = inner
            .broadcasts
            .lock()
            .map_err(|_| rdv_error("a broadcast reader panicked".to_string()))?;
        let deadline = Instant::now() + inner.timeout;
        loop {
            self.check_failed("waiting for a broadcast from rank 0")?;
            match receiver.recv_timeout(Duration::from_millis(50)) {
                Ok(payload) => return Ok(payload),
                Err(RecvTimeoutError::Timeout) if Instant::now() < deadline => continue,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(rdv_error(format!(
                        "rank {} waited {:.1} s for a broadcast from rank 0, which never sent it",
                        inner.me.rank,
                        inner.timeout.as_secs_f64()
                    )))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.check_failed("waiting for a broadcast from rank 0")?;
                    return Err(rdv_error(format!(
                        "rank {}'s connection to rank 0 closed before a broadcast came",
                        inner.me.rank
                    )));
                }
            }
        }
    }

    /// Tell every rank that this one has been waiting for `ranks` in a comm (empty: it no
    /// longer waits). Best effort: a rank that cannot be told only misses a hint.
    pub fn report_waiting(&self, ranks: &[u32]) {
        let inner = &self.inner;
        inner.waits.set(inner.me.rank, ranks.to_vec());
        let payload = waiting_payload(inner.me.rank, ranks);
        for link in &inner.links {
            let _ = link.send(WAITING, &payload);
        }
    }

    /// Whom `rank` last reported waiting for (empty: it reported no wait, or it ended).
    pub fn waiting_for(&self, rank: u32) -> Vec<u32> {
        self.inner.waits.get(rank)
    }

    /// An error when another rank has failed (`while_doing` says what this rank was doing).
    pub fn check_failed(&self, while_doing: &str) -> Result<()> {
        match self.inner.failure.failed() {
            Some((rank, reason)) if rank != self.inner.me.rank => Err(RuntimeError::Comm(format!(
                "rank {} stopped {while_doing} because rank {rank} failed: {reason}",
                self.inner.me.rank
            ))),
            _ => Ok(()),
        }
    }

    /// Tell every rank that this one failed with `reason` (rank 0 relays it to all).
    pub fn abort(&self, reason: &str) {
        let inner = &self.inner;
        inner.failure.set(inner.me.rank, reason.to_string());
        let payload = abort_payload(inner.me.rank, reason);
        for link in &inner.links {
            // A peer already gone cannot be told; the others still are.
            let _ = link.send(ABORT, &payload);
        }
    }

    /// End the job together: report done and wait (up to the timeout) until every rank has,
    /// so closing connections is not taken for a death. Fails when a rank failed meanwhile.
    pub fn finish(&self) -> Result<()> {
        let inner = &self.inner;
        let deadline = Instant::now() + inner.timeout;
        if inner.me.rank != 0 {
            if let Some(link) = inner.links.first() {
                link.send(DONE, &[]).map_err(|e| {
                    rdv_error(format!(
                        "rank {} could not tell rank 0 it finished: {e}",
                        inner.me.rank
                    ))
                })?;
            }
        }
        loop {
            self.check_failed("at the end of the run")?;
            let all = inner
                .finished
                .lock()
                .map(|f| f.iter().all(|&d| d))
                .unwrap_or(true);
            if all {
                break;
            }
            if Instant::now() >= deadline {
                let waiting: Vec<u32> = inner
                    .finished
                    .lock()
                    .map(|f| {
                        f.iter()
                            .enumerate()
                            .filter(|(_, d)| !**d)
                            .map(|(r, _)| r as u32)
                            .collect()
                    })
                    .unwrap_or_default();
                return Err(rdv_error(format!(
                    "rank {} finished but ranks {waiting:?} did not within {:.1} s",
                    inner.me.rank,
                    inner.timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if inner.me.rank == 0 {
            for link in &inner.links {
                let _ = link.send(BYE, &[]);
            }
        }
        Ok(())
    }
}

/// Rank 0: listen, collect every member, check them, answer.
fn host(config: &RendezvousConfig) -> Result<Rendezvous> {
    let me = &config.me;
    let port = config.master_port;
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
        rdv_error(format!(
            "rank 0 cannot listen on port {port}: {e} (another job may hold it, or another \
             process of this job also says it is rank 0: check that the launcher gives every \
             process its own rank; else set MASTER_PORT to a free port)"
        ))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| rdv_error(format!("rank 0 cannot poll its listener: {e}")))?;
    let started = Instant::now();
    let deadline = started + config.timeout;
    let world = me.world as usize;
    let mut joined: Vec<Option<(Member, TcpStream)>> = (0..world).map(|_| None).collect();
    let mut problems: Vec<String> = Vec::new();
    while joined.iter().skip(1).any(Option::is_none) && Instant::now() < deadline {
        match listener.accept() {
            Ok((stream, from)) => {
                // A connection that is not a parc rank (a port scan, a stale client) is
                // ignored.
                if let Ok((member, mut stream)) = read_hello(stream, deadline) {
                    let rank = member.rank as usize;
                    let problem = match joined.get(rank) {
                        None => format!(
                            "{} from {from} is outside a world of {} processes (it says {})",
                            member.describe(),
                            me.world,
                            member.world
                        ),
                        Some(Some((first, _))) => format!(
                            "two processes say they are rank {rank}: {} and {}",
                            first.describe(),
                            member.describe()
                        ),
                        Some(None) if rank == 0 => format!(
                            "{} says it is rank 0, but this process (pid {}) is rank 0",
                            member.describe(),
                            me.pid
                        ),
                        Some(None) => {
                            joined[rank] = Some((member, stream));
                            continue;
                        }
                    };
                    // The process refused is told why (else it sees only a closed connection).
                    let _ = write_frame(&mut stream, REFUSED, problem.as_bytes());
                    problems.push(problem);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => return Err(rdv_error(format!("rank 0 could not accept a rank: {e}"))),
        }
    }
    let mut members = vec![me.clone()];
    let mut streams = Vec::new();
    let mut missing = Vec::new();
    for (rank, slot) in joined.into_iter().enumerate().skip(1) {
        match slot {
            Some((member, stream)) => {
                members.push(member);
                streams.push(stream);
            }
            None => missing.push(rank as u32),
        }
    }
    if !missing.is_empty() {
        let came: Vec<String> = members.iter().map(Member::describe).collect();
        problems.insert(
            0,
            format!(
                "ranks {missing:?} never came within {:.1} s (rank 0 listened on port {port}; \
                 came: {}); start every rank, check MASTER_ADDR/MASTER_PORT, or raise the \
                 timeout with --rendezvous-timeout",
                config.timeout.as_secs_f64(),
                came.join(", ")
            ),
        );
    }
    for member in &members {
        if member.world != me.world {
            problems.push(format!(
                "{} says the job has {} processes, rank 0 says {}",
                member.describe(),
                member.world,
                me.world
            ));
        }
        if member.plan_hash != me.plan_hash {
            problems.push(format!(
                "{} lowered a different plan (hash {} vs rank 0's {}): every rank must run the \
                 same spec with the same --set",
                member.describe(),
                member.plan_hash,
                me.plan_hash
            ));
        } else if let Some(differ) = values_differ(&member.settings, &me.settings) {
            problems.push(format!(
                "{} runs the spec with other settings than rank 0 ({differ}): every rank must \
                 run the same spec with the same --set",
                member.describe()
            ));
        }
        if let Some(differ) = values_differ(&member.flags, &me.flags) {
            problems.push(format!(
                "{} was started with other flags than rank 0 ({differ}): every rank must be \
                 given the same flags (only output paths, --log-format, --profile and the \
                 timeouts may differ)",
                member.describe()
            ));
        }
    }
    if !problems.is_empty() {
        turn_away_waiting(&listener, &members, me.world);
        let message = problems.join("; ");
        for stream in &mut streams {
            let _ = write_frame(stream, REFUSED, message.as_bytes());
        }
        return Err(rdv_error(message));
    }
    let gate = Gate::open(listener, members.clone(), me.world)?;
    let listing = serde_json::to_vec(&members)
        .map_err(|e| rdv_error(format!("cannot encode the member list: {e}")))?;
    let failure = FailureWatch::default();
    let waits = WaitBoard::new(me.world);
    let finished = Arc::new(Mutex::new(vec![false; world]));
    if let Ok(mut f) = finished.lock() {
        f[0] = true;
    }
    let mut links = Vec::new();
    let mut readers = Vec::new();
    for (stream, member) in streams.iter_mut().zip(members.iter().skip(1)) {
        write_frame(stream, READY, &listing).map_err(|e| {
            rdv_error(format!(
                "rank 0 could not answer {}: {e}",
                member.describe()
            ))
        })?;
        let reader = stream
            .try_clone()
            .map_err(|e| rdv_error(format!("cannot share a connection: {e}")))?;
        let writer = stream
            .try_clone()
            .map_err(|e| rdv_error(format!("cannot share a connection: {e}")))?;
        links.push(Arc::new(Link {
            peer: member.rank,
            writer: Mutex::new(writer),
        }));
        readers.push((member.rank, reader));
    }
    for (peer, reader) in readers {
        let (links, failure, finished) = (links.clone(), failure.clone(), Arc::clone(&finished));
        let waits = waits.clone();
        std::thread::Builder::new()
            .name(format!("parc-rdv-{peer}"))
            .spawn(move || host_reader(peer, reader, &links, &failure, &waits, &finished))
            .map_err(|e| rdv_error(format!("cannot start a rendezvous reader: {e}")))?;
    }
    let (_, broadcasts) = channel();
    Ok(Rendezvous {
        inner: Arc::new(Inner {
            me: me.clone(),
            members,
            timeout: config.timeout,
            links,
            failure,
            waits,
            finished,
            broadcasts: Mutex::new(broadcasts),
            _gate: Some(gate),
        }),
    })
}

/// Rank 0's port once the rendezvous is over, kept open while the job runs: a process that
/// comes then (a second process with a rank the job has, a rank restarted, another job on the
/// same port) is told at once why it is not let in, instead of finding nothing listening and
/// retrying until its own timeout. Dropping the gate closes the port.
struct Gate {
    closed: Arc<AtomicBool>,
}

impl Gate {
    fn open(listener: TcpListener, members: Vec<Member>, world: u32) -> Result<Gate> {
        let closed = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&closed);
        std::thread::Builder::new()
            .name("parc-rdv-gate".to_string())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    if !turn_away_waiting(&listener, &members, world) {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            })
            .map_err(|e| rdv_error(format!("cannot start the rendezvous gate: {e}")))?;
        Ok(Gate { closed })
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

/// Answer every process waiting on the (non-blocking) `listener` with why it is not let in;
/// whether any came. `members` are the ranks that joined.
fn turn_away_waiting(listener: &TcpListener, members: &[Member], world: u32) -> bool {
    let mut any = false;
    while let Ok((stream, from)) = listener.accept() {
        any = true;
        let deadline = Instant::now() + Duration::from_millis(500);
        // A connection that is not a parc rank (a port scan) gets no answer.
        let Ok((late, mut stream)) = read_hello(stream, deadline) else {
            continue;
        };
        let problem = latecomer_problem(&late, from, members, world);
        let _ = write_frame(&mut stream, TURNED_AWAY, problem.as_bytes());
    }
    any
}

/// Why `late`, which connected from `from` once the rendezvous was over, is not let in.
fn latecomer_problem(late: &Member, from: SocketAddr, members: &[Member], world: u32) -> String {
    let who = format!("{} from {from}", late.describe());
    match members.iter().find(|m| m.rank == late.rank) {
        Some(holder) => format!(
            "{who} came after the job had started, and another process already holds rank {} \
             ({}); give every process its own rank (the launcher's rank variable: RANK, \
             OMPI_COMM_WORLD_RANK, SLURM_PROCID or PMI_RANK), or, if this process belongs to \
             another job, give that job another MASTER_PORT",
            late.rank,
            holder.describe()
        ),
        None if late.rank >= world => format!(
            "{who} says the job has {} processes, but the job on this port started with {world}; \
             if it belongs to another job, give that job another MASTER_PORT",
            late.world
        ),
        None => format!(
            "{who} came after rank 0 had stopped waiting for rank {} (the rendezvous timeout \
             passed); start every rank within --rendezvous-timeout, or raise it",
            late.rank
        ),
    }
}

/// Where a rank's values (`theirs`: its spec settings or flags, by name) differ from rank 0's
/// (`ours`), as `name = theirs (rank 0: ours)`, at most three of them; None when they agree.
fn values_differ(
    theirs: &BTreeMap<String, String>,
    ours: &BTreeMap<String, String>,
) -> Option<String> {
    let paths: std::collections::BTreeSet<&String> = theirs.keys().chain(ours.keys()).collect();
    let shown = |v: Option<&String>| v.map_or("unset".to_string(), Clone::clone);
    let differ: Vec<String> = paths
        .into_iter()
        .filter(|path| theirs.get(*path) != ours.get(*path))
        .map(|path| {
            format!(
                "{path} = {} (rank 0: {})",
                shown(theirs.get(path)),
                shown(ours.get(path))
            )
        })
        .collect();
    match differ.len() {
        0 => None,
        1..=3 => Some(differ.join(", ")),
        n => Some(format!("{} and {} more", differ[..3].join(", "), n - 3)),
    }
}

fn read_hello(mut stream: TcpStream, deadline: Instant) -> std::io::Result<(Member, TcpStream)> {
    stream.set_nonblocking(false)?;
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    stream.set_read_timeout(Some(wait.min(Duration::from_secs(10))))?;
    let (kind, payload) = read_frame(&mut stream)?;
    if kind != HELLO {
        return Err(std::io::Error::new(ErrorKind::InvalidData, "not a hello"));
    }
    let member: Member = serde_json::from_slice(&payload)
        .map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))?;
    stream.set_read_timeout(None)?;
    stream.set_nodelay(true)?;
    Ok((member, stream))
}

/// How a connection ended, for a message: nothing for a plain close, else the error.
fn closed_how(e: &std::io::Error) -> String {
    if e.kind() == ErrorKind::UnexpectedEof {
        String::new()
    } else {
        format!(" ({e})")
    }
}

/// Rank 0's reader of one peer: relays aborts and waits, records done, reports a dropped
/// connection.
fn host_reader(
    peer: u32,
    mut stream: TcpStream,
    links: &[Arc<Link>],
    failure: &FailureWatch,
    waits: &WaitBoard,
    finished: &Mutex<Vec<bool>>,
) {
    let relay = |rank: u32, reason: &str| {
        let payload = abort_payload(rank, reason);
        for link in links.iter().filter(|l| l.peer != rank) {
            let _ = link.send(ABORT, &payload);
        }
    };
    loop {
        match read_frame(&mut stream) {
            Ok((ABORT, payload)) => {
                let (rank, reason) = parse_abort(&payload);
                if failure.set(rank, reason.clone()) {
                    relay(rank, &reason);
                }
            }
            Ok((WAITING, payload)) => {
                if let Some((rank, ranks)) = parse_waiting(&payload) {
                    waits.set(rank, ranks);
                    for link in links.iter().filter(|l| l.peer != rank) {
                        let _ = link.send(WAITING, &payload);
                    }
                }
            }
            Ok((DONE, _)) => {
                if let Ok(mut f) = finished.lock() {
                    if let Some(done) = f.get_mut(peer as usize) {
                        *done = true;
                    }
                }
            }
            Ok(_) => {}
            Err(e) => {
                let done = finished
                    .lock()
                    .map(|f| f.get(peer as usize).copied().unwrap_or(true))
                    .unwrap_or(true);
                if !done {
                    let reason = format!(
                        "its process died: its connection to the rendezvous closed{} before \
                         it finished or reported an error (killed, or crashed)",
                        closed_how(&e)
                    );
                    if failure.set(peer, reason.clone()) {
                        relay(peer, &reason);
                    }
                }
                return;
            }
        }
    }
}

/// Ranks other than 0: connect (retrying until the deadline), say hello, wait for the answer.
fn connect(config: &RendezvousConfig) -> Result<Rendezvous> {
    let me = &config.me;
    let target = format!("{}:{}", config.master_addr, config.master_port);
    let deadline = Instant::now() + config.timeout;
    let mut last_error = String::from("no attempt");
    let mut stream = loop {
        let addrs: Vec<SocketAddr> = match target.to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(e) => {
                last_error = format!("cannot resolve {target}: {e}");
                Vec::new()
            }
        };
        let attempt = addrs.iter().find_map(|addr| {
            match TcpStream::connect_timeout(addr, Duration::from_millis(500)) {
                // Connecting to a local port in the ephemeral range where nothing listens yet
                // can connect the socket to itself (TCP simultaneous open); that is not rank
                // 0, and it would hold rank 0's port.
                Ok(s) if is_self_connected(&s) => {
                    last_error = "nothing listens there yet".to_string();
                    None
                }
                Ok(s) => Some(s),
                Err(e) => {
                    last_error = e.to_string();
                    None
                }
            }
        });
        if let Some(s) = attempt {
            break s;
        }
        if Instant::now() >= deadline {
            return Err(rdv_error(format!(
                "rank {} could not reach rank 0 at {target} within {:.1} s ({last_error}); is \
                 rank 0 started, and are MASTER_ADDR/MASTER_PORT right?",
                me.rank,
                config.timeout.as_secs_f64()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let hello = serde_json::to_vec(me).map_err(|e| rdv_error(format!("cannot encode: {e}")))?;
    let io = |e: std::io::Error| {
        rdv_error(format!(
            "rank {} lost its connection to rank 0 at {target} while joining: {e}",
            me.rank
        ))
    };
    stream.set_nodelay(true).map_err(io)?;
    write_frame(&mut stream, HELLO, &hello).map_err(io)?;
    // Rank 0 answers by its own deadline, which is at most one timeout after we connected.
    stream
        .set_read_timeout(Some(config.timeout + Duration::from_secs(5)))
        .map_err(io)?;
    let (kind, payload) = read_frame(&mut stream).map_err(|e| {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            rdv_error(format!(
                "rank {} joined at {target} but rank 0 never completed the rendezvous",
                me.rank
            ))
        } else {
            io(e)
        }
    })?;
    let members: Vec<Member> = match kind {
        READY => serde_json::from_slice(&payload)
            .map_err(|e| rdv_error(format!("rank 0 sent an unreadable member list: {e}")))?,
        REFUSED => {
            return Err(rdv_error(format!(
                "rank 0 refused the job: {}",
                String::from_utf8_lossy(&payload)
            )))
        }
        TURNED_AWAY => {
            return Err(rdv_error(format!(
                "rank 0 turned this process away: {}",
                String::from_utf8_lossy(&payload)
            )))
        }
        other => {
            return Err(rdv_error(format!(
                "rank 0 answered with frame kind {other}, not a parc rendezvous answer"
            )))
        }
    };
    stream.set_read_timeout(None).map_err(io)?;
    let failure = FailureWatch::default();
    let waits = WaitBoard::new(me.world);
    let finished = Arc::new(Mutex::new(vec![false]));
    let reader = stream
        .try_clone()
        .map_err(|e| rdv_error(format!("cannot share a connection: {e}")))?;
    let (sender, broadcasts) = channel();
    {
        let (failure, finished, waits) = (failure.clone(), Arc::clone(&finished), waits.clone());
        std::thread::Builder::new()
            .name("parc-rdv-0".to_string())
            .spawn(move || peer_reader(reader, &failure, &waits, &finished, &sender))
            .map_err(|e| rdv_error(format!("cannot start a rendezvous reader: {e}")))?;
    }
    Ok(Rendezvous {
        inner: Arc::new(Inner {
            me: me.clone(),
            members,
            timeout: config.timeout,
            links: vec![Arc::new(Link {
                peer: 0,
                writer: Mutex::new(stream),
            })],
            failure,
            waits,
            finished,
            broadcasts: Mutex::new(broadcasts),
            _gate: None,
        }),
    })
}

fn is_self_connected(stream: &TcpStream) -> bool {
    matches!((stream.local_addr(), stream.peer_addr()), (Ok(a), Ok(b)) if a == b)
}

/// A non-zero rank's reader of rank 0: broadcasts, relayed aborts and waits, the final bye.
fn peer_reader(
    mut stream: TcpStream,
    failure: &FailureWatch,
    waits: &WaitBoard,
    finished: &Mutex<Vec<bool>>,
    broadcasts: &Sender<Vec<u8>>,
) {
    loop {
        match read_frame(&mut stream) {
            Ok((BROADCAST, payload)) => {
                let _ = broadcasts.send(payload);
            }
            Ok((ABORT, payload)) => {
                let (rank, reason) = parse_abort(&payload);
                failure.set(rank, reason);
            }
            Ok((WAITING, payload)) => {
                if let Some((rank, ranks)) = parse_waiting(&payload) {
                    waits.set(rank, ranks);
                }
            }
            Ok((BYE, _)) => {
                if let Ok(mut f) = finished.lock() {
                    f.fill(true);
                }
                return;
            }
            Ok(_) => {}
            Err(e) => {
                let bye = finished
                    .lock()
                    .map(|f| f.iter().all(|&d| d))
                    .unwrap_or(true);
                if !bye {
                    failure.set(
                        0,
                        format!(
                            "its process died: its rendezvous connection closed{} before the \
                             job finished (killed, or crashed)",
                            closed_how(&e)
                        ),
                    );
                }
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rank: u32, world: u32, port: u16, hash: &str, timeout_ms: u64) -> RendezvousConfig {
        let mut c = RendezvousConfig::new(rank, world, rank, hash, "127.0.0.1", port);
        c.timeout = Duration::from_millis(timeout_ms);
        c
    }

    /// Join ranks `ranks` of `world` on threads; results in the order given.
    fn join_all(
        ranks: &[u32],
        world: u32,
        hash: impl Fn(u32) -> String + Sync,
        timeout_ms: u64,
    ) -> Vec<Result<Rendezvous>> {
        let port = free_port().unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|&r| {
                    let hash = &hash;
                    s.spawn(move || Rendezvous::join(&config(r, world, port, &hash(r), timeout_ms)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_rank_joins_broadcasts_and_finishes() {
        let joined = join_all(&[0, 1, 2, 3], 4, |_| "h".into(), 10_000);
        let rdvs: Vec<Rendezvous> = joined.into_iter().map(Result::unwrap).collect();
        for rdv in &rdvs {
            let ranks: Vec<u32> = rdv.members().iter().map(|m| m.rank).collect();
            assert_eq!(ranks, [0, 1, 2, 3]);
        }
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let handles: Vec<_> = rdvs
                .iter()
                .map(|rdv| {
                    s.spawn(move || {
                        let payload = (rdv.rank() == 0).then_some(&b"nccl-id"[..]);
                        let got = rdv.broadcast_bytes(payload).unwrap();
                        rdv.finish().unwrap();
                        got
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(got.iter().all(|g| g == b"nccl-id"));
    }

    #[test]
    fn a_rank_that_never_comes_is_named() {
        let started = Instant::now();
        let joined = join_all(&[0, 1, 2], 4, |_| "h".into(), 1_000);
        assert!(started.elapsed() < Duration::from_secs(8));
        for result in joined {
            let err = result.err().unwrap().to_string();
            assert!(err.contains("ranks [3] never came"), "{err}");
        }
    }

    #[test]
    fn ranks_with_another_plan_or_world_are_refused() {
        let joined = join_all(&[0, 1], 2, |r| format!("plan{r}"), 10_000);
        for result in joined {
            let err = result.err().unwrap().to_string();
            assert!(err.contains("lowered a different plan"), "{err}");
        }
    }

    #[test]
    fn two_processes_with_one_rank_are_refused_and_both_told_why() {
        let port = free_port().unwrap();
        let join = |rank: u32| Rendezvous::join(&config(rank, 3, port, "h", 10_000));
        let results: Vec<Result<Rendezvous>> = std::thread::scope(|s| {
            let handles: Vec<_> = [0, 1, 1]
                .into_iter()
                .map(|rank| s.spawn(move || join(rank)))
                .collect();
            // Rank 2 comes once the two rank-1 processes have.
            std::thread::sleep(Duration::from_millis(500));
            let last = s.spawn(move || join(2));
            handles
                .into_iter()
                .chain([last])
                .map(|h| h.join().unwrap())
                .collect()
        });
        for result in results {
            let err = result.err().unwrap().to_string();
            assert!(
                err.contains("two processes say they are rank 1"),
                "every process, the one refused too: {err}"
            );
        }
    }

    #[test]
    fn a_process_with_a_rank_the_running_job_has_is_turned_away_at_once() {
        let port = free_port().unwrap();
        let join =
            |rank: u32, timeout_ms: u64| Rendezvous::join(&config(rank, 2, port, "h", timeout_ms));
        let rdvs: Vec<Rendezvous> = std::thread::scope(|s| {
            let handles: Vec<_> = [0, 1]
                .into_iter()
                .map(|rank| s.spawn(move || join(rank, 10_000)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect()
        });
        // The job runs; a second process says it is rank 1, with a long timeout of its own.
        let started = Instant::now();
        let err = join(1, 20_000).err().unwrap().to_string();
        assert!(started.elapsed() < Duration::from_secs(5), "{err}");
        assert!(
            err.contains("turned this process away")
                && err.contains("came after the job had started")
                && err.contains("another process already holds rank 1 (rank 1 (host "),
            "{err}"
        );
        // Once the job's rendezvous is gone, so is its port.
        drop(rdvs);
        std::thread::sleep(Duration::from_millis(300));
        let err = join(1, 300).err().unwrap().to_string();
        assert!(err.contains("could not reach rank 0"), "{err}");
    }

    #[test]
    fn every_rank_sees_whom_the_others_wait_for() {
        let joined = join_all(&[0, 1, 2], 3, |_| "h".into(), 10_000);
        let rdvs: Vec<Rendezvous> = joined.into_iter().map(Result::unwrap).collect();
        // Rank 1 (through rank 0's relay) and rank 0 (directly) report waits.
        rdvs[1].report_waiting(&[0]);
        rdvs[0].report_waiting(&[2]);
        let sees = |rdv: &Rendezvous, rank: u32, expect: &[u32]| {
            let deadline = Instant::now() + Duration::from_secs(5);
            while rdv.waiting_for(rank) != expect && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(
                rdv.waiting_for(rank),
                expect,
                "rank {} on rank {rank}",
                rdv.rank()
            );
        };
        for rdv in &rdvs {
            sees(rdv, 1, &[0]);
            sees(rdv, 0, &[2]);
            sees(rdv, 2, &[]);
        }
        rdvs[1].report_waiting(&[]);
        for rdv in &rdvs {
            sees(rdv, 1, &[]);
        }
        assert_eq!(
            parse_waiting(&waiting_payload(7, &[1, 2])),
            Some((7, vec![1, 2]))
        );
        assert_eq!(parse_waiting(&[1, 2]), None);
    }

    #[test]
    fn a_failure_reaches_every_rank_and_a_dropped_rank_is_reported_dead() {
        let joined = join_all(&[0, 1, 2], 3, |_| "h".into(), 10_000);
        let mut rdvs: Vec<Rendezvous> = joined.into_iter().map(Result::unwrap).collect();
        rdvs[2].abort("out of memory at step 3");
        let wait = |rdv: &Rendezvous| {
            let deadline = Instant::now() + Duration::from_secs(5);
            while rdv.failure().failed().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            rdv.check_failed("in a test").unwrap_err().to_string()
        };
        for rdv in &rdvs[..2] {
            let err = wait(rdv);
            assert!(
                err.contains("because rank 2 failed: out of memory at step 3"),
                "{err}"
            );
        }
        // A new job where rank 1 drops its connection without finishing.
        let joined = join_all(&[0, 1, 2], 3, |_| "h".into(), 10_000);
        rdvs = joined.into_iter().map(Result::unwrap).collect();
        let dropped = rdvs.remove(1);
        for link in &dropped.inner.links {
            let _ = link
                .writer
                .lock()
                .unwrap()
                .shutdown(std::net::Shutdown::Both);
        }
        for rdv in &rdvs {
            let err = wait(rdv);
            assert!(
                err.contains("because rank 1 failed: its process died"),
                "{err}"
            );
        }
    }
}
