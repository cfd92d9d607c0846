//! Overlap of communication with compute: the communication stream and which buffers it still
//! uses. Compute ops run on the backend's compute stream; collectives and transfers on a
//! separate (non-blocking) communication stream, so they run while later compute runs.
//!
//! The ordering rules, in stream terms:
//! - The buffers some collective or transfer of the rank's program uses ([`comm_buffers`],
//!   known from the program when NCCL is set up) are watched on the compute stream: after
//!   compute-stream work that touches one (an op reading or writing it, an `Alloc`'s zero-fill,
//!   which also comes after every earlier user of the bytes it reuses), an event is recorded
//!   and the buffer is marked with it ([`ComputeUses`]). The event is recorded when the next
//!   compute-stream work begins (or a collective is queued), so it covers exactly the work
//!   queued up to then, including a fused launch that updates several buffers at once.
//! - Before a communication op is queued, the communication stream waits only for the latest
//!   such event of its input and output buffers (their last writer, and the last reader of
//!   the bytes it overwrites), not for all compute queued so far: a ZeRO-3 gather issued a node
//!   ahead runs while that node computes.
//! - After it, an event is recorded on the communication stream and every buffer the op reads
//!   or writes is marked with that event's sequence number ([`Pending`]).
//! - A compute op that reads or writes a marked buffer, or a `Free` of one (a memory planner
//!   may give its bytes to a later buffer), first makes the compute stream wait for that event.
//!   The communication stream runs in order, so waiting for event `n` also covers every event
//!   before it: [`Pending`] remembers how far the compute stream has waited and skips covered
//!   marks.
//! - Host reads and writes of a marked buffer wait for the communication stream to drain (with
//!   a timeout: a peer that never arrives is an error, not a hang).
use crate::cuda::device::driver_error;
use crate::error::{Result, RuntimeError};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use parc_compiler::ir::{BufferId, Instr, Program};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which buffers are still in use by work queued on one stream, by the sequence number of the
/// event recorded after it, as the other stream sees them: communication the compute stream
/// must wait for, or compute the communication stream must wait for. Pure bookkeeping (no
/// CUDA): the events themselves live in [`CommStream`].
#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// Buffer → sequence number of the last event after work that uses it.
    marks: HashMap<BufferId, u64>,
    /// The other stream already waits for every event up to this one (0: none).
    waited_through: u64,
    /// Sequence number of the last event recorded (events are numbered from 1).
    last: u64,
}

impl Pending {
    /// A new event was recorded after work on `buffers`; returns its sequence number.
    pub(crate) fn record(&mut self, buffers: &[BufferId]) -> u64 {
        self.last += 1;
        for &id in buffers {
            self.marks.insert(id, self.last);
        }
        self.last
    }

    /// The event the other stream must wait for before it touches `ids`, if any (the latest of
    /// theirs not already waited for). Marks it waited for, with all before it.
    pub(crate) fn wait_for(&mut self, ids: impl IntoIterator<Item = BufferId>) -> Option<u64> {
        let mut needed = None;
        for id in ids {
            if let Some(seq) = self.marks.remove(&id) {
                if seq > self.waited_through {
                    needed = needed.max(Some(seq));
                }
            }
        }
        if let Some(seq) = needed {
            self.waited_through = seq;
            self.marks.retain(|_, s| *s > seq);
        }
        needed
    }

    /// Whether queued work still uses `id` (as far as the other stream knows).
    pub(crate) fn is_marked(&self, id: BufferId) -> bool {
        self.marks
            .get(&id)
            .is_some_and(|&seq| seq > self.waited_through)
    }

    /// The host waited for all the work: nothing is pending.
    pub(crate) fn clear(&mut self) {
        self.marks.clear();
        self.waited_through = self.last;
    }

    /// Sequence number of the last event recorded (0: none yet).
    pub(crate) fn last(&self) -> u64 {
        self.last
    }
}

/// The buffers collectives and transfers of `program` read or write.
pub(crate) fn comm_buffers(program: &Program) -> HashSet<BufferId> {
    program
        .instrs
        .iter()
        .filter(|i| {
            matches!(
                i,
                Instr::Collective { .. }
                    | Instr::Send { .. }
                    | Instr::Recv { .. }
                    | Instr::P2p { .. }
            )
        })
        .flat_map(|i| i.reads().into_iter().chain(i.writes()))
        .collect()
}

/// What communication must wait for on the compute stream ([`ComputeUses::wait_for`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CommWait {
    Nothing,
    /// The compute event of this sequence number.
    Event(u64),
    /// Everything queued on the compute stream so far.
    Everything,
}

/// Compute-stream work on communication buffers that later communication must wait for (see
/// the module docs). Pure bookkeeping: [`CommStream`] records the events.
#[derive(Debug, Default)]
pub(crate) struct ComputeUses {
    /// The buffers some communication uses; compute on others is not tracked.
    comm_buffers: HashSet<BufferId>,
    /// Communication buffers touched by the latest compute-stream work, whose event is not
    /// recorded yet (it is, when the next work begins or communication is queued).
    unrecorded: Vec<BufferId>,
    marks: Pending,
}

impl ComputeUses {
    pub(crate) fn new(comm_buffers: HashSet<BufferId>) -> ComputeUses {
        ComputeUses {
            comm_buffers,
            ..ComputeUses::default()
        }
    }

    /// Compute-stream work on `ids` is about to be queued. Returns the buffers of the work
    /// before it, whose event the caller records now (then calls [`ComputeUses::recorded`]).
    pub(crate) fn begin(&mut self, ids: impl IntoIterator<Item = BufferId>) -> Vec<BufferId> {
        let done = std::mem::take(&mut self.unrecorded);
        for id in ids {
            if self.comm_buffers.contains(&id) && !self.unrecorded.contains(&id) {
                self.unrecorded.push(id);
            }
        }
        done
    }

    /// Communication is about to be queued: the buffers of the latest compute-stream work,
    /// whose event the caller records now (then calls [`ComputeUses::recorded`]).
    pub(crate) fn flush(&mut self) -> Vec<BufferId> {
        std::mem::take(&mut self.unrecorded)
    }

    /// An event was recorded on the compute stream after the work on `buffers`; returns its
    /// sequence number.
    pub(crate) fn recorded(&mut self, buffers: &[BufferId]) -> u64 {
        self.marks.record(buffers)
    }

    /// What communication on `ids` must wait for on the compute stream (call
    /// [`ComputeUses::flush`] first): the latest event of theirs not already waited for (see
    /// [`Pending`]), or everything queued so far where one of them is not a communication
    /// buffer of the program (a caller outside the program: its compute is not tracked).
    pub(crate) fn wait_for(&mut self, ids: &[BufferId]) -> CommWait {
        if ids.iter().any(|id| !self.comm_buffers.contains(id)) {
            self.marks.clear();
            return CommWait::Everything;
        }
        match self.marks.wait_for(ids.iter().copied()) {
            Some(seq) => CommWait::Event(seq),
            None => CommWait::Nothing,
        }
    }

    /// Events up to this one were waited for (they need not be kept).
    fn waited_through(&self) -> u64 {
        self.marks.waited_through
    }
}

/// The communication stream, its recorded events, the [`Pending`] marks of communication and
/// the [`ComputeUses`] of communication buffers on the compute stream.
pub(crate) struct CommStream {
    stream: Arc<CudaStream>,
    pending: Pending,
    /// Events by sequence number, oldest first; dropped once the compute stream waited.
    events: VecDeque<(u64, CudaEvent)>,
    /// Compute-stream work on communication buffers, and its events by sequence number.
    uses: ComputeUses,
    compute_events: VecDeque<(u64, CudaEvent)>,
    /// How long the host waits for queued communication before failing.
    timeout: Duration,
}

/// Keep at most this many events the other stream has not waited for; beyond it, finished ones
/// are dropped (a mark whose event is gone needs no wait).
const KEPT_EVENTS: usize = 64;

/// Drop the finished events at the front of `events` once there are more than [`KEPT_EVENTS`].
fn drop_finished(events: &mut VecDeque<(u64, CudaEvent)>) {
    if events.len() > KEPT_EVENTS {
        while events
            .front()
            .is_some_and(|(_, e)| e.try_is_complete().unwrap_or(false))
        {
            events.pop_front();
        }
    }
}

impl CommStream {
    /// A communication stream for a rank whose communication uses `comm_buffers`.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        comm_buffers: HashSet<BufferId>,
        timeout: Duration,
    ) -> Result<CommStream> {
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("creating the communication stream", e))?;
        Ok(CommStream {
            stream,
            pending: Pending::default(),
            events: VecDeque::new(),
            uses: ComputeUses::new(comm_buffers),
            compute_events: VecDeque::new(),
            timeout,
        })
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Record an event on `compute` after the work queued so far, for `buffers`.
    fn record_compute(&mut self, compute: &CudaStream, buffers: &[BufferId]) -> Result<()> {
        if buffers.is_empty() {
            return Ok(());
        }
        let event = compute
            .record_event(None)
            .map_err(|e| driver_error("recording a compute event for communication", e))?;
        let seq = self.uses.recorded(buffers);
        self.compute_events.push_back((seq, event));
        drop_finished(&mut self.compute_events);
        Ok(())
    }

    /// Before communication on `ids` is queued: order the communication stream after the
    /// compute-stream work that last touched them (and nothing else).
    pub(crate) fn follow_uses(&mut self, compute: &CudaStream, ids: &[BufferId]) -> Result<()> {
        let latest = self.uses.flush();
        self.record_compute(compute, &latest)?;
        let ordering = |e| driver_error("ordering communication after compute", e);
        match self.uses.wait_for(ids) {
            CommWait::Nothing => {}
            // No event with this number: it finished and was dropped.
            CommWait::Event(seq) => {
                if let Some((_, event)) = self.compute_events.iter().find(|(s, _)| *s == seq) {
                    self.stream.wait(event).map_err(ordering)?;
                }
            }
            CommWait::Everything => self.stream.join(compute).map_err(ordering)?,
        }
        let waited = self.uses.waited_through();
        while self
            .compute_events
            .front()
            .is_some_and(|(s, _)| *s <= waited)
        {
            self.compute_events.pop_front();
        }
        Ok(())
    }

    /// Record that the communication just queued uses `buffers`.
    pub(crate) fn record(&mut self, buffers: &[BufferId]) -> Result<()> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| driver_error("recording a communication event", e))?;
        let seq = self.pending.record(buffers);
        self.events.push_back((seq, event));
        // Events the compute stream never waited for (results only the host reads) would pile
        // up: drop the finished ones.
        drop_finished(&mut self.events);
        Ok(())
    }

    /// Before compute-stream work on `ids` (an op, an `Alloc`'s zero-fill, a `Free`) is
    /// queued: record the event of the work before it for later communication, note `ids`
    /// for the next one, and make `compute` wait for queued communication that uses `ids`.
    pub(crate) fn order_compute(
        &mut self,
        compute: &CudaStream,
        ids: impl IntoIterator<Item = BufferId>,
    ) -> Result<()> {
        let ids: Vec<BufferId> = ids.into_iter().collect();
        let before = self.uses.begin(ids.iter().copied());
        self.record_compute(compute, &before)?;
        let Some(seq) = self.pending.wait_for(ids) else {
            return Ok(());
        };
        // No event with this number: it finished and was dropped, so there is nothing to wait for.
        if let Some((_, event)) = self.events.iter().find(|(s, _)| *s == seq) {
            compute
                .wait(event)
                .map_err(|e| driver_error("ordering compute after communication", e))?;
        }
        while self.events.front().is_some_and(|(s, _)| *s <= seq) {
            self.events.pop_front();
        }
        Ok(())
    }

    /// Whether queued communication may still use `id`.
    pub(crate) fn uses(&self, id: BufferId) -> bool {
        self.pending.is_marked(id)
    }

    /// Whether anything was ever queued (nothing to wait for otherwise).
    pub(crate) fn has_queued(&self) -> bool {
        self.pending.last() > 0
    }

    /// How long a host wait for this stream may take.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// After the host waited for the stream: nothing queued is pending any more.
    pub(crate) fn forget_all(&mut self) {
        self.pending.clear();
        self.events.clear();
    }
}

/// Block the host until `stream` has run everything queued on it so far, polling so that it
/// fails after `timeout` instead of hanging; `check` runs between polls (NCCL's asynchronous
/// errors, news of a failed peer) and its error ends the wait.
pub(crate) fn poll_until_idle(
    stream: &CudaStream,
    timeout: Duration,
    check: &mut dyn FnMut() -> Result<()>,
) -> Result<()> {
    let event = stream
        .record_event(None)
        .map_err(|e| driver_error("recording a communication event", e))?;
    let started = Instant::now();
    let mut spins = 0u32;
    loop {
        match event.try_is_complete() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => return Err(driver_error("waiting for communication", e)),
        }
        check()?;
        if started.elapsed() > timeout {
            return Err(RuntimeError::Comm(format!(
                "communication queued on the GPU did not complete within {:.1} s: a peer rank \
                 is stuck or died",
                timeout.as_secs_f64()
            )));
        }
        spins += 1;
        if spins < 1000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{comm_buffers, CommWait, ComputeUses, Pending};
    use parc_compiler::ir::{
        BufferId, CollectiveKind, GroupId, Instr, P2pOp, Peer, Program, ReduceOp,
    };
    use parc_compiler::spec::Axis;

    const A: BufferId = BufferId(1);
    const B: BufferId = BufferId(2);
    const C: BufferId = BufferId(3);

    #[test]
    fn untouched_buffers_need_no_wait() {
        let mut p = Pending::default();
        assert_eq!(p.wait_for([A]), None);
        p.record(&[A, B]);
        assert_eq!(p.wait_for([C]), None);
        assert!(p.is_marked(A) && p.is_marked(B) && !p.is_marked(C));
    }

    #[test]
    fn waiting_for_a_later_event_covers_earlier_ones() {
        let mut p = Pending::default();
        assert_eq!(p.record(&[A]), 1);
        assert_eq!(p.record(&[B]), 2);
        assert_eq!(p.record(&[C]), 3);
        // Touching B waits for event 2, which covers A's event 1 but not C's 3.
        assert_eq!(p.wait_for([B]), Some(2));
        assert!(!p.is_marked(A));
        assert_eq!(p.wait_for([A]), None);
        assert!(p.is_marked(C));
        assert_eq!(p.wait_for([A, C]), Some(3));
        assert_eq!(p.wait_for([C]), None);
    }

    #[test]
    fn the_latest_mark_of_a_buffer_wins() {
        let mut p = Pending::default();
        p.record(&[A]);
        p.record(&[B]);
        p.record(&[A]);
        assert_eq!(p.wait_for([A]), Some(3));
        assert!(!p.is_marked(B));
    }

    #[test]
    fn several_buffers_wait_for_their_latest_event() {
        let mut p = Pending::default();
        p.record(&[A]);
        p.record(&[B]);
        assert_eq!(p.wait_for([A, B]), Some(2));
    }

    #[test]
    fn clearing_after_a_host_wait_forgets_every_mark() {
        let mut p = Pending::default();
        p.record(&[A, B]);
        p.clear();
        assert!(!p.is_marked(A));
        assert_eq!(p.wait_for([A, B]), None);
        assert_eq!(p.record(&[C]), 2);
        assert_eq!(p.wait_for([C]), Some(2));
    }

    /// Replays compute work and communication through [`ComputeUses`] the way [`super::CommStream`]
    /// drives it; returns the compute event each communication waits for.
    struct Replay {
        uses: ComputeUses,
        /// Sequence number → index of the compute work after which its event was recorded.
        recorded_after: Vec<usize>,
        work: usize,
    }

    impl Replay {
        fn new(comm: &[BufferId]) -> Replay {
            Replay {
                uses: ComputeUses::new(comm.iter().copied().collect()),
                recorded_after: Vec::new(),
                work: 0,
            }
        }

        fn record(&mut self, buffers: &[BufferId]) {
            if !buffers.is_empty() {
                let seq = self.uses.recorded(buffers);
                assert_eq!(seq as usize, self.recorded_after.len() + 1);
                // The event covers the compute work queued so far.
                self.recorded_after.push(self.work);
            }
        }

        /// Compute work (an op, an alloc's zero-fill) on `ids`; returns its number.
        fn compute(&mut self, ids: &[BufferId]) -> usize {
            let before = self.uses.begin(ids.iter().copied());
            self.record(&before);
            self.work += 1;
            self.work
        }

        /// Communication on `ids`: after which compute work it waits (None: none).
        fn communicate(&mut self, ids: &[BufferId]) -> Option<usize> {
            let latest = self.uses.flush();
            self.record(&latest);
            match self.uses.wait_for(ids) {
                CommWait::Nothing => None,
                CommWait::Event(seq) => Some(self.recorded_after[seq as usize - 1]),
                CommWait::Everything => Some(self.work),
            }
        }
    }

    #[test]
    fn communication_waits_for_the_last_compute_on_its_buffers_only() {
        const SHARD: BufferId = BufferId(10);
        const FLAT: BufferId = BufferId(11);
        const X: BufferId = BufferId(20);
        let mut r = Replay::new(&[SHARD, FLAT]);
        // The optimizer wrote the shard; then unrelated compute.
        let optimizer = r.compute(&[SHARD]);
        r.compute(&[X]);
        // A prefetched gather: alloc's zero-fill of its output, then the all-gather, which
        // waits for that zero-fill (it covers the optimizer too), not for compute after it.
        let alloc = r.compute(&[FLAT]);
        assert!(alloc > optimizer);
        assert_eq!(r.communicate(&[SHARD, FLAT]), Some(alloc));
        // Compute of the current node runs meanwhile; nothing more to wait for on these buffers.
        r.compute(&[X]);
        r.compute(&[X]);
        assert_eq!(r.communicate(&[SHARD, FLAT]), None);
    }

    #[test]
    fn communication_on_a_buffer_outside_the_program_waits_for_all_compute() {
        const GRAD: BufferId = BufferId(1);
        const ELSEWHERE: BufferId = BufferId(50);
        let mut r = Replay::new(&[GRAD]);
        r.compute(&[GRAD]);
        r.compute(&[ELSEWHERE]);
        let last = r.compute(&[BufferId(9)]);
        assert_eq!(r.communicate(&[GRAD, ELSEWHERE]), Some(last));
        // That covered every compute event recorded before.
        assert_eq!(r.communicate(&[GRAD]), None);
    }

    #[test]
    fn compute_on_other_buffers_never_delays_communication() {
        const GRAD: BufferId = BufferId(1);
        let mut r = Replay::new(&[GRAD]);
        for _ in 0..5 {
            r.compute(&[BufferId(7), BufferId(8)]);
        }
        assert_eq!(r.communicate(&[GRAD]), None);
    }

    #[test]
    fn the_event_of_the_last_writer_is_recorded_right_after_it() {
        const GRAD: BufferId = BufferId(1);
        const OTHER: BufferId = BufferId(2);
        let mut r = Replay::new(&[GRAD, OTHER]);
        r.compute(&[GRAD]);
        let last_writer = r.compute(&[GRAD, BufferId(9)]);
        r.compute(&[BufferId(9)]);
        r.compute(&[BufferId(9)]);
        assert_eq!(r.communicate(&[GRAD]), Some(last_writer));
        // A writer just before the collective: its event is recorded when the collective is
        // queued (nothing after it yet).
        let writer = r.compute(&[OTHER]);
        assert_eq!(r.communicate(&[OTHER]), Some(writer));
    }

    #[test]
    fn a_reader_of_a_later_collectives_output_is_waited_for() {
        // The optimizer reads a reduce-scatter's output shard; the next step's reduce-scatter
        // into it must wait for that read (the write would race it otherwise).
        const GRAD: BufferId = BufferId(1);
        const SHARD_GRAD: BufferId = BufferId(2);
        let mut r = Replay::new(&[GRAD, SHARD_GRAD]);
        let backward = r.compute(&[GRAD]);
        assert_eq!(r.communicate(&[GRAD, SHARD_GRAD]), Some(backward));
        let optimizer = r.compute(&[SHARD_GRAD, BufferId(5)]);
        r.compute(&[BufferId(5)]);
        let next_backward = r.compute(&[GRAD]);
        assert!(next_backward > optimizer);
        assert_eq!(r.communicate(&[GRAD, SHARD_GRAD]), Some(next_backward));
        // Waiting for a later event covers the earlier ones.
        assert_eq!(r.communicate(&[SHARD_GRAD]), None);
    }

    #[test]
    fn communication_buffers_are_the_collectives_and_transfers_ones() {
        let b = BufferId;
        let peer = Peer {
            axis: Axis::Pp,
            coord: 1,
        };
        let program = Program {
            role: "test".into(),
            coords: Vec::new(),
            buffers: Vec::new(),
            params: Vec::new(),
            instrs: vec![
                Instr::Alloc { buffer: b(1) },
                Instr::Collective {
                    kind: CollectiveKind::AllReduce { op: ReduceOp::Sum },
                    group: GroupId(0),
                    input: b(1),
                    output: b(2),
                    node: None,
                },
                Instr::Send {
                    peer,
                    buffer: b(3),
                    tag: 0,
                },
                Instr::Recv {
                    peer,
                    buffer: b(4),
                    tag: 1,
                },
                Instr::P2p {
                    ops: vec![
                        P2pOp::Send {
                            peer,
                            buffer: b(5),
                            tag: 2,
                        },
                        P2pOp::Recv {
                            peer,
                            buffer: b(6),
                            tag: 3,
                        },
                    ],
                },
                Instr::Free { buffer: b(7) },
            ],
            loss: None,
            grad_sumsq: None,
        };
        let mut ids: Vec<u32> = comm_buffers(&program).into_iter().map(|b| b.0).collect();
        ids.sort();
        assert_eq!(ids, [1, 2, 3, 4, 5, 6]);
    }
}
