//! Which NCCL work a rank has queued and not yet seen finish: each call's description and the
//! program instruction that issued it, with an event recorded after it on the communication
//! stream. The stream runs in order, so when a wait times out the first unfinished entry is
//! the operation that is stuck (the last queued one may merely be waiting behind it): its
//! instruction is what the failure names ([`super::CudaBackend::stuck_instruction`]).
//! Finished entries' events are kept as spares and recorded again for later calls
//! ([`InFlight::spare`]), so a step does not create one event per NCCL call.
//! Generic over the event so that the bookkeeping is tested without a GPU.
use std::collections::VecDeque;

/// One queued NCCL call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Queued {
    /// Index of the program instruction that queued it (None: the host comm's own calls).
    pub instruction: Option<usize>,
    /// What it is, e.g. `rank 1: all-gather of buffer 64 into buffer 65 over …`.
    pub what: String,
}

impl Queued {
    /// `what`, with the instruction when known.
    pub fn describe(&self) -> String {
        match self.instruction {
            Some(index) => format!("{} (instruction {index})", self.what),
            None => self.what.clone(),
        }
    }
}

/// The queued calls not yet seen finished, oldest first.
#[derive(Debug)]
pub(crate) struct InFlight<E> {
    entries: VecDeque<(E, Queued)>,
    /// Events of dropped (finished) entries, free to be recorded again.
    spares: Vec<E>,
    /// The last call queued (kept after it finished, for messages).
    last: Option<Queued>,
}

impl<E> Default for InFlight<E> {
    fn default() -> Self {
        InFlight {
            entries: VecDeque::new(),
            spares: Vec::new(),
            last: None,
        }
    }
}

impl<E> InFlight<E> {
    /// `queued` was queued and `event` recorded after it. Entries whose event `finished`
    /// reports done are dropped from the front first (the stream finishes them in order);
    /// their events become spares.
    pub fn push(&mut self, event: E, queued: Queued, finished: impl Fn(&E) -> bool) {
        while self.entries.front().is_some_and(|(e, _)| finished(e)) {
            if let Some((e, _)) = self.entries.pop_front() {
                self.spares.push(e);
            }
        }
        self.last = Some(queued.clone());
        self.entries.push_back((event, queued));
    }

    /// A finished entry's event to record the next call into (None: create one). Nothing
    /// waits for these events (only the host queries them), so a finished one is free.
    pub fn spare(&mut self) -> Option<E> {
        self.spares.pop()
    }

    /// The oldest call whose event is not finished: the one the stream is stuck in.
    pub fn first_unfinished(&self, finished: impl Fn(&E) -> bool) -> Option<&Queued> {
        self.entries
            .iter()
            .find(|(e, _)| !finished(e))
            .map(|(_, q)| q)
    }

    /// The last call queued, finished or not.
    pub fn last(&self) -> Option<&Queued> {
        self.last.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::{InFlight, Queued};
    use std::cell::Cell;

    fn queued(instruction: usize) -> Queued {
        Queued {
            instruction: Some(instruction),
            what: format!("all-gather {instruction}"),
        }
    }

    #[test]
    fn the_stuck_call_is_the_first_unfinished_not_the_last_queued() {
        // Events are the instruction numbers; `done` is how far the stream got.
        let done = Cell::new(0usize);
        let finished = |e: &usize| *e <= done.get();
        let mut f = InFlight::default();
        for i in [5, 9, 14, 20] {
            f.push(i, queued(i), finished);
        }
        done.set(9);
        assert_eq!(f.first_unfinished(finished), Some(&queued(14)));
        assert_eq!(f.last(), Some(&queued(20)));
        assert_eq!(
            f.first_unfinished(finished)
                .map(Queued::describe)
                .as_deref(),
            Some("all-gather 14 (instruction 14)")
        );
        done.set(20);
        assert_eq!(f.first_unfinished(finished), None);
    }

    #[test]
    fn finished_calls_are_dropped_as_new_ones_are_queued() {
        let done = Cell::new(0usize);
        let finished = |e: &usize| *e <= done.get();
        let mut f = InFlight::default();
        for i in 1..=100 {
            f.push(i, queued(i), finished);
            done.set(i - 1);
        }
        // Only the calls the stream had not finished when the last was queued remain.
        assert_eq!(f.entries.len(), 2);
        assert_eq!(f.first_unfinished(finished), Some(&queued(100)));
    }

    #[test]
    fn finished_calls_events_are_recorded_again_unfinished_ones_never() {
        // Events are (id, finished-after-call): a call's event finishes when the stream passes
        // that call number. Each call takes a spare event if there is one.
        let done = Cell::new(0usize);
        let finished = |e: &(usize, usize)| e.1 <= done.get();
        let mut f = InFlight::default();
        let mut created = 0;
        for call in 1..=1000 {
            let id = match f.spare() {
                Some((id, _)) => id,
                None => {
                    created += 1;
                    created
                }
            };
            assert!(
                f.entries.iter().all(|((live, _), _)| *live != id),
                "call {call}: event {id} is still in flight"
            );
            f.push((id, call), queued(call), finished);
            // The stream runs two calls behind the host.
            done.set(call.saturating_sub(2));
        }
        assert!(created <= 4, "{created} events for 1000 calls");
        assert_eq!(f.first_unfinished(finished), Some(&queued(999)));
    }

    #[test]
    fn a_host_call_has_no_instruction() {
        let host = Queued {
            instruction: None,
            what: "host all-reduce of 1 elements".into(),
        };
        assert_eq!(host.describe(), "host all-reduce of 1 elements");
    }
}
