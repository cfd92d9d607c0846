//! Overlap of communication with compute: the communication stream and which buffers it still
//! uses. Compute ops run on the backend's compute stream; collectives and transfers on a
//! separate (non-blocking, highest-priority) communication stream, so they run while later
//! compute runs.
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
//!
//! Events are recycled ([`EventRing`]): once the other stream's wait for an event is queued (a
//! wait uses the event as recorded when the wait is queued; recording it again later does not
//! change that wait), or it finished with no wait needed, or the host waited for everything, the
//! event goes back to a spare list and is recorded again for later work, so a step creates a
//! handful of events instead of one per compute op on a communication buffer.
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

/// Keep at most this many events the other stream has not waited for; beyond it, finished ones
/// are recycled (a mark whose event is gone needs no wait).
const KEPT_EVENTS: usize = 64;

/// The events recorded on one stream that the other stream may still wait for, by sequence
/// number (oldest first), and the spare events free to be recorded again. An event leaves the
/// live list only when nothing can wait for it any more: the other stream's wait for it (or a
/// later one, which covers it) is queued, it finished, or the host waited for everything; it
/// then becomes spare. Generic over the event so the recycling is tested without a GPU.
#[derive(Debug)]
pub(crate) struct EventRing<E> {
    live: VecDeque<(u64, E)>,
    spare: Vec<E>,
}

impl<E> Default for EventRing<E> {
    fn default() -> EventRing<E> {
        EventRing {
            live: VecDeque::new(),
            spare: Vec::new(),
        }
    }
}

impl<E> EventRing<E> {
    /// An event to record next: a spare one, or `create`'s.
    pub(crate) fn take_or(&mut self, create: impl FnOnce() -> Result<E>) -> Result<E> {
        match self.spare.pop() {
            Some(e) => Ok(e),
            None => create(),
        }
    }

    /// `event` was just recorded as sequence number `seq` (increasing); beyond
    /// [`KEPT_EVENTS`] live ones, the finished ones at the front are recycled.
    pub(crate) fn push(&mut self, seq: u64, event: E, finished: impl Fn(&E) -> bool) {
        self.live.push_back((seq, event));
        if self.live.len() > KEPT_EVENTS {
            while self.live.front().is_some_and(|(_, e)| finished(e)) {
                self.recycle_front();
            }
        }
    }

    /// The live event of sequence number `seq` (None: it finished and was recycled, or the
    /// other stream already waits for it).
    pub(crate) fn get(&self, seq: u64) -> Option<&E> {
        self.live.iter().find(|(s, _)| *s == seq).map(|(_, e)| e)
    }

    /// The other stream's wait for every event up to `seq` is queued: recycle them.
    pub(crate) fn passed_through(&mut self, seq: u64) {
        while self.live.front().is_some_and(|(s, _)| *s <= seq) {
            self.recycle_front();
        }
    }

    /// An event used once and waited for at once (not numbered) goes back to the spares.
    pub(crate) fn give_back(&mut self, event: E) {
        self.spare.push(event);
    }

    /// The host waited for all the work: every live event is spare.
    pub(crate) fn recycle_all(&mut self) {
        while !self.live.is_empty() {
            self.recycle_front();
        }
    }

    fn recycle_front(&mut self) {
        if let Some((_, e)) = self.live.pop_front() {
            self.spare.push(e);
        }
    }
}

/// The communication stream, its recorded events, the [`Pending`] marks of communication and
/// the [`ComputeUses`] of communication buffers on the compute stream.
pub(crate) struct CommStream {
    stream: Arc<CudaStream>,
    pending: Pending,
    /// Communication events; recycled once the compute stream waits for them.
    events: EventRing<CudaEvent>,
    /// Compute-stream work on communication buffers, and its events.
    uses: ComputeUses,
    compute_events: EventRing<CudaEvent>,
    /// How long the host waits for queued communication before failing.
    timeout: Duration,
}

/// Record `stream`'s work so far into a spare event of `ring`, or a new one.
fn record_into(
    ring: &mut EventRing<CudaEvent>,
    stream: &CudaStream,
    what: &str,
) -> Result<CudaEvent> {
    let event = ring.take_or(|| {
        stream
            .context()
            .new_event(None)
            .map_err(|e| driver_error(&format!("creating {what}"), e))
    })?;
    event
        .record(stream)
        .map_err(|e| driver_error(&format!("recording {what}"), e))?;
    Ok(event)
}

fn finished(event: &CudaEvent) -> bool {
    event.try_is_complete().unwrap_or(false)
}

impl CommStream {
    /// A communication stream for a rank whose communication uses `comm_buffers`.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        comm_buffers: HashSet<BufferId>,
        timeout: Duration,
    ) -> Result<CommStream> {
        // The highest priority the device allows: a collective's kernels get SMs as soon as
        // blocks of the compute kernels running then retire, instead of after every block of
        // those kernels has been scheduled (what PyTorch's TORCH_NCCL_HIGH_PRIORITY option does).
        ctx.bind_to_thread()
            .map_err(|e| driver_error("making the context current", e))?;
        let (_, highest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(|e| driver_error("reading the stream priority range", e))?;
        let stream = ctx
            .new_stream_with_priority(highest)
            .map_err(|e| driver_error("creating the communication stream", e))?;
        Ok(CommStream {
            stream,
            pending: Pending::default(),
            events: EventRing::default(),
            uses: ComputeUses::new(comm_buffers),
            compute_events: EventRing::default(),
            timeout,
        })
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// An event recorded on `compute` after the work queued so far.
    fn compute_event(&mut self, compute: &CudaStream) -> Result<CudaEvent> {
        record_into(
            &mut self.compute_events,
            compute,
            "a compute event for communication",
        )
    }

    /// Record an event on `compute` after the work queued so far, for `buffers`.
    fn record_compute(&mut self, compute: &CudaStream, buffers: &[BufferId]) -> Result<()> {
        if buffers.is_empty() {
            return Ok(());
        }
        let event = self.compute_event(compute)?;
        let seq = self.uses.recorded(buffers);
        self.compute_events.push(seq, event, finished);
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
                if let Some(event) = self.compute_events.get(seq) {
                    self.stream.wait(event).map_err(ordering)?;
                }
            }
            CommWait::Everything => {
                let event = self.compute_event(compute)?;
                self.stream.wait(&event).map_err(ordering)?;
                self.compute_events.give_back(event);
            }
        }
        self.compute_events
            .passed_through(self.uses.waited_through());
        Ok(())
    }

    /// Make this stream wait for everything queued on `other` so far: communication of the
    /// other stream (collectives and transfers run on two) may use the buffers this stream's
    /// next work uses.
    pub(crate) fn follow_stream(&self, other: &CommStream) -> Result<()> {
        let event = other
            .stream
            .record_event(None)
            .map_err(|e| driver_error("recording an event on a communication stream", e))?;
        self.stream
            .wait(&event)
            .map_err(|e| driver_error("ordering one communication stream after the other", e))
    }

    /// Record that the communication just queued uses `buffers`.
    pub(crate) fn record(&mut self, buffers: &[BufferId]) -> Result<()> {
        let event = record_into(&mut self.events, &self.stream, "a communication event")?;
        let seq = self.pending.record(buffers);
        // Events the compute stream never waits for (results only the host reads) would pile
        // up: the ring recycles finished ones.
        self.events.push(seq, event, finished);
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
        if let Some(event) = self.events.get(seq) {
            compute
                .wait(event)
                .map_err(|e| driver_error("ordering compute after communication", e))?;
        }
        self.events.passed_through(seq);
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
        self.events.recycle_all();
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
    use super::{comm_buffers, CommWait, ComputeUses, EventRing, Pending, KEPT_EVENTS};
    use crate::error::Result;
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

    /// A stand-in for a CUDA event: which one it is (by creation order) and whether the work
    /// recorded into it finished.
    #[derive(Debug)]
    struct Fake {
        id: usize,
        done: bool,
    }

    /// An [`EventRing`] of fakes that counts the events it had to create.
    struct Recorder {
        ring: EventRing<Fake>,
        created: usize,
    }

    impl Recorder {
        fn new() -> Recorder {
            Recorder {
                ring: EventRing::default(),
                created: 0,
            }
        }

        /// Record event `seq` (`done`: its work already finished); returns the event's id.
        fn record(&mut self, seq: u64, done: bool) -> usize {
            let created = &mut self.created;
            let mut e = self
                .ring
                .take_or(|| -> Result<Fake> {
                    *created += 1;
                    Ok(Fake { id: *created, done })
                })
                .unwrap();
            e.done = done;
            let id = e.id;
            self.ring.push(seq, e, |e| e.done);
            id
        }
    }

    #[test]
    fn an_event_is_recorded_again_only_after_the_other_side_passed_it() {
        let mut r = Recorder::new();
        let (e1, e2, e3) = (r.record(1, false), r.record(2, false), r.record(3, false));
        assert_eq!((e1, e2, e3), (1, 2, 3));
        // The other stream's wait for event 2 is queued: 1 and 2 are free, 3 is not.
        r.ring.passed_through(2);
        assert!(r.ring.get(1).is_none() && r.ring.get(2).is_none());
        assert_eq!(r.ring.get(3).map(|e| e.id), Some(3));
        let (e4, e5) = (r.record(4, false), r.record(5, false));
        assert!([1, 2].contains(&e4) && [1, 2].contains(&e5) && e4 != e5);
        // Only now a new event: 3, 4 and 5 are still live.
        assert_eq!(r.record(6, false), 4);
        assert_eq!(r.created, 4);
        assert_eq!(r.ring.get(3).map(|e| e.id), Some(3));
        assert_eq!(r.ring.get(4).map(|e| e.id), Some(e4));
    }

    #[test]
    fn a_step_of_compute_on_communication_buffers_creates_a_handful_of_events() {
        // Thousands of compute ops on communication buffers, each followed by an event, with the
        // communication stream waiting for the latest one every eight ops (the events between
        // have not finished): the events are reused instead of created per op.
        let mut uses = ComputeUses::new([BufferId(1), BufferId(2)].into_iter().collect());
        let mut r = Recorder::new();
        for op in 0..5000u32 {
            let buffer = BufferId(1 + op % 2);
            let before = uses.begin([buffer]);
            if !before.is_empty() {
                let seq = uses.recorded(&before);
                r.record(seq, false);
            }
            if op % 8 == 7 {
                let latest = uses.flush();
                if !latest.is_empty() {
                    let seq = uses.recorded(&latest);
                    r.record(seq, false);
                }
                let CommWait::Event(seq) = uses.wait_for(&[buffer]) else {
                    panic!("op {op}: the collective must wait for the compute before it");
                };
                assert!(
                    r.ring.get(seq).is_some(),
                    "op {op}: event {seq} was recycled"
                );
                r.ring.passed_through(uses.waited_through());
            }
        }
        assert!(r.created <= 9, "{} events for 5000 ops", r.created);
    }

    #[test]
    fn finished_events_nobody_waits_for_are_recycled_unfinished_ones_kept() {
        let mut r = Recorder::new();
        for seq in 1..=1000 {
            r.record(seq, true);
        }
        assert!(r.created <= KEPT_EVENTS + 1, "{} events", r.created);
        let mut r = Recorder::new();
        for seq in 1..=200 {
            r.record(seq, false);
        }
        assert_eq!(r.created, 200);
        assert!(r.ring.get(1).is_some(), "an unfinished event was recycled");
        // After a host wait every event is spare again.
        r.ring.recycle_all();
        assert!(r.ring.get(200).is_none());
        r.record(201, false);
        assert_eq!(r.created, 200);
    }

    #[test]
    fn communication_buffers_are_the_collectives_and_transfers_ones() {
        let b = BufferId;
        let peer = Peer {
            axis: Axis::Pp,
            coord: 1,
        };
        let program = Program::new(
            "test",
            Vec::new(),
            vec![
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
        );
        let mut ids: Vec<u32> = comm_buffers(&program).into_iter().map(|b| b.0).collect();
        ids.sort();
        assert_eq!(ids, [1, 2, 3, 4, 5, 6]);
    }
}
