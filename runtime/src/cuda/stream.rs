//! Overlap of communication with compute: the communication stream and which buffers it still
//! uses. Compute ops run on the backend's compute stream; collectives and transfers on a
//! separate (non-blocking) communication stream, so they run while later compute runs.
//!
//! The ordering rules, in stream terms:
//! - Before a communication op is queued, the communication stream waits for everything queued
//!   on the compute stream so far (its inputs are written, and earlier readers of its output,
//!   or of the bytes its output reuses, are done).
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
use parc_compiler::ir::BufferId;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which buffers are still in use by queued communication, by event sequence number. Pure
/// bookkeeping (no CUDA): the events themselves live in [`CommStream`].
#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// Buffer → sequence number of the last communication event that uses it.
    marks: HashMap<BufferId, u64>,
    /// The compute stream already waits for every event up to this one (0: none).
    waited_through: u64,
    /// Sequence number of the last event recorded (events are numbered from 1).
    last: u64,
}

impl Pending {
    /// A new event was recorded after communication on `buffers`; returns its sequence number.
    pub(crate) fn record(&mut self, buffers: &[BufferId]) -> u64 {
        self.last += 1;
        for &id in buffers {
            self.marks.insert(id, self.last);
        }
        self.last
    }

    /// The event the compute stream must wait for before it touches `ids`, if any (the
    /// latest of theirs not already waited for). Marks it waited for, with all before it.
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

    /// Whether queued communication still uses `id` (as far as the compute stream knows).
    pub(crate) fn is_marked(&self, id: BufferId) -> bool {
        self.marks
            .get(&id)
            .is_some_and(|&seq| seq > self.waited_through)
    }

    /// The host waited for all communication: nothing is pending.
    pub(crate) fn clear(&mut self) {
        self.marks.clear();
        self.waited_through = self.last;
    }

    /// Sequence number of the last event recorded (0: none yet).
    pub(crate) fn last(&self) -> u64 {
        self.last
    }
}

/// The communication stream, its recorded events and the [`Pending`] marks.
pub(crate) struct CommStream {
    stream: Arc<CudaStream>,
    pending: Pending,
    /// Events by sequence number, oldest first; dropped once the compute stream waited.
    events: VecDeque<(u64, CudaEvent)>,
    /// How long the host waits for queued communication before failing.
    timeout: Duration,
}

impl CommStream {
    pub(crate) fn new(ctx: &Arc<CudaContext>, timeout: Duration) -> Result<CommStream> {
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("creating the communication stream", e))?;
        Ok(CommStream {
            stream,
            pending: Pending::default(),
            events: VecDeque::new(),
            timeout,
        })
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Order the communication stream after everything queued on `compute` so far.
    pub(crate) fn follow(&self, compute: &CudaStream) -> Result<()> {
        self.stream
            .join(compute)
            .map_err(|e| driver_error("ordering communication after compute", e))
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
        // up: drop the finished ones; a mark whose event is gone needs no wait.
        if self.events.len() > 64 {
            while self
                .events
                .front()
                .is_some_and(|(_, e)| e.try_is_complete().unwrap_or(false))
            {
                self.events.pop_front();
            }
        }
        Ok(())
    }

    /// Make `compute` wait for queued communication that uses any of `ids`.
    pub(crate) fn order_compute(
        &mut self,
        compute: &CudaStream,
        ids: impl IntoIterator<Item = BufferId>,
    ) -> Result<()> {
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
    use super::Pending;
    use parc_compiler::ir::BufferId;

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
}
