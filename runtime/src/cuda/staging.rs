//! Host writes without stalling the host: `CudaBackend::write` of up to [`MAX_STAGED_BYTES`]
//! (each micro-batch's tokens and targets) copies the data into a page-locked staging slot and
//! queues an asynchronous copy from it on the compute stream, so the copy comes in stream order
//! after every op queued before the write (earlier readers of the buffer) and before every op
//! queued after it, as the synchronous write did, and the host goes on queuing work at once.
//! [`SLOTS`] slots are used in turn (two micro-batches' tokens and targets); each records an
//! event after its copy, and a slot is refilled only once its previous copy has completed
//! (the host waits for that event then). Slots grow to the largest write they have taken (a
//! power of two, at least [`MIN_SLOT_BYTES`]). Larger writes (parameters, checkpoints) keep the
//! synchronous path: they are rare and would pin much host memory.
use super::device::driver_error;
use crate::error::{Result, RuntimeError};
use cudarc::driver::result as cu;
use cudarc::driver::sys::{CUdeviceptr, CUevent_flags};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice};
use std::sync::Arc;

/// Staging slots used in turn.
pub(super) const SLOTS: usize = 4;
/// The largest write that is staged.
pub(super) const MAX_STAGED_BYTES: usize = 16 << 20;
/// The smallest slot allocated.
const MIN_SLOT_BYTES: usize = 64 << 10;

/// Whether a write of `bytes` goes through a staging slot.
pub(super) fn staged(bytes: usize) -> bool {
    bytes > 0 && bytes <= MAX_STAGED_BYTES
}

/// Which slot the next staged write takes and how large each slot is (no device state).
#[derive(Debug, Default, PartialEq)]
struct Ring {
    next: usize,
    capacity: [usize; SLOTS],
}

impl Ring {
    /// The slot a write of `bytes` takes (each in turn) and, when that slot is smaller, the
    /// capacity to allocate for it (recorded by [`Ring::grown`] once allocated).
    fn take(&mut self, bytes: usize) -> (usize, Option<usize>) {
        let slot = self.next;
        self.next = (slot + 1) % SLOTS;
        let grow =
            (self.capacity[slot] < bytes).then(|| bytes.next_power_of_two().max(MIN_SLOT_BYTES));
        (slot, grow)
    }

    fn grown(&mut self, slot: usize, capacity: usize) {
        self.capacity[slot] = capacity;
    }
}

/// One slot: its page-locked bytes and the event recorded after the last copy from them.
struct Slot {
    memory: PinnedHostSlice<u8>,
    copied: CudaEvent,
}

impl Drop for Slot {
    /// The memory is freed only after its last copy has read it.
    fn drop(&mut self) {
        // Nothing to report to in a drop; a failed wait means the context is already gone.
        let _ = self.copied.synchronize();
    }
}

/// The staging slots of one backend (allocated on first use).
#[derive(Default)]
pub(super) struct Staging {
    ring: Ring,
    slots: [Option<Slot>; SLOTS],
}

impl Staging {
    /// Queues a copy of `src` to `dst` (which holds at least `src.len()` bytes) on `stream`
    /// through the next slot, first waiting until that slot's previous copy has completed.
    pub fn upload(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        dst: CUdeviceptr,
        src: &[u8],
    ) -> Result<()> {
        ctx.bind_to_thread()
            .map_err(|e| driver_error("binding the CUDA context for a staged write", e))?;
        let (index, grow) = self.ring.take(src.len());
        if let Some(slot) = &self.slots[index] {
            slot.copied
                .synchronize()
                .map_err(|e| driver_error("waiting for a staging slot's previous copy", e))?;
        }
        let slot = match grow {
            Some(capacity) => {
                // Dropping the old slot waits for its copy (done above) before freeing it.
                self.slots[index] = None;
                // SAFETY: the bytes are written below before any copy reads them.
                let memory = unsafe { ctx.alloc_pinned::<u8>(capacity) }.map_err(|e| {
                    driver_error(
                        &format!("allocating {capacity} bytes of pinned host memory"),
                        e,
                    )
                })?;
                let copied = ctx
                    .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(|e| driver_error("creating a staging slot's event", e))?;
                self.ring.grown(index, capacity);
                self.slots[index].insert(Slot { memory, copied })
            }
            None => match self.slots[index].as_mut() {
                Some(slot) => slot,
                None => {
                    return Err(RuntimeError::Op {
                        op: "staged write".into(),
                        what: format!(
                            "no staging slot holds {} bytes (only non-empty writes are staged)",
                            src.len()
                        ),
                    })
                }
            },
        };
        let host = slot
            .memory
            .as_mut_slice()
            .map_err(|e| driver_error("mapping a staging slot", e))?;
        let host = &mut host[..src.len()];
        host.copy_from_slice(src);
        // SAFETY: dst holds at least src.len() bytes (the caller checked the buffer's length);
        // the pinned bytes stay alive and unchanged until the event recorded next has fired.
        unsafe { cu::memcpy_htod_async(dst, host, stream.cu_stream()) }
            .map_err(|e| driver_error("queuing a staged host-to-device copy", e))?;
        slot.copied
            .record(stream)
            .map_err(|e| driver_error("recording a staging slot's event", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_taken_in_turn_and_grow_to_the_largest_write() {
        let mut ring = Ring::default();
        // First use of every slot allocates at least the minimum.
        for k in 0..SLOTS {
            let (slot, grow) = ring.take(100);
            assert_eq!((slot, grow), (k, Some(MIN_SLOT_BYTES)));
            ring.grown(slot, MIN_SLOT_BYTES);
        }
        // Back to slot 0, big enough now.
        assert_eq!(ring.take(MIN_SLOT_BYTES), (0, None));
        // Slot 1 must grow to the next power of two.
        let (slot, grow) = ring.take(MIN_SLOT_BYTES + 1);
        assert_eq!((slot, grow), (1, Some(2 * MIN_SLOT_BYTES)));
        // A failed allocation (no `grown`) leaves it to grow again next time round.
        for _ in 0..SLOTS - 1 {
            ring.take(1);
        }
        assert_eq!(ring.take(MIN_SLOT_BYTES + 1), (1, Some(2 * MIN_SLOT_BYTES)));
        ring.grown(1, 2 * MIN_SLOT_BYTES);
        assert_eq!(ring.capacity[1], 2 * MIN_SLOT_BYTES);
    }

    #[test]
    fn only_small_nonempty_writes_are_staged() {
        assert!(!staged(0));
        assert!(staged(4));
        assert!(staged(MAX_STAGED_BYTES));
        assert!(!staged(MAX_STAGED_BYTES + 1));
    }
}
