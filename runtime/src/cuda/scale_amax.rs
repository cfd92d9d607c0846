//! Delayed FP8 scaling's scale amaxes as the host sees them. A delayed GEMM either of whose
//! operands' histories is empty (its scale amax 0: the first step, or a history started cold)
//! quantizes neither operand and runs at their stored precision, as the CPU backend does
//! (`cpu/linear.rs`); which of the two GEMMs to queue is the host's choice, so the host must know
//! the scale amax first.
//!
//! `Fp8HistoryRoll`, the op that writes a scale amax during training (at a step's end), is
//! followed by an asynchronous copy of the new value into a page-locked slot of its own and an
//! event. A GEMM that reads a copied value waits for that event once (by the next step's first
//! FP8 GEMM the previous step's end has run or nearly), then reads every slot copied so far. A
//! scale amax that no roll has copied since it was last written otherwise (allocated, written
//! from the host as a checkpoint loads, written by another op or by communication) is read
//! synchronously and kept in its slot: once per history on a run's first step, after a load.
//!
//! [`Slots`] is the bookkeeping without the device (which slot a buffer has, what its value's
//! state is), tested below; [`ScaleAmaxes`] adds the page-locked memory and the event.
use super::device::driver_error;
use super::Buf;
use crate::error::{Result, RuntimeError};
use cudarc::driver::result as cu;
use cudarc::driver::sys::{CUdeviceptr, CUevent_flags};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice};
use parc_compiler::ir::{BufferId, DType};
use std::collections::HashMap;
use std::sync::Arc;

/// The fewest slots allocated; the memory doubles when a roll needs one more.
const MIN_SLOTS: usize = 256;

/// Where a scale amax's value is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    /// In its slot, copied and waited for.
    Ready,
    /// Being copied into its slot (the event has not been waited for since).
    Copying,
}

/// How the host gets a scale amax's value.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Need {
    /// Read slot `.0`.
    Read(usize),
    /// Wait for the copies in flight, then read slot `.0`.
    Wait(usize),
    /// No copy holds its current value: read the device buffer.
    Device,
}

/// Which slot each rolled scale amax has and the state of its value (no device state).
#[derive(Debug, Default)]
struct Slots {
    index: HashMap<BufferId, usize>,
    /// Per buffer with a slot: its state, None once written since its last copy.
    state: HashMap<BufferId, State>,
    /// Slots handed out so far (a run given new slots leaves its members' old ones unused).
    used: usize,
    capacity: usize,
}

impl Slots {
    /// A roll's copy into `id`'s slot is about to be queued: the slot, and the capacity to grow
    /// the memory to first where it has no room for a new one.
    fn copying(&mut self, id: BufferId) -> (usize, Option<usize>) {
        self.assign(id, State::Copying)
    }

    /// `id`'s value, read from the device, is about to be kept in its slot (as [`Self::copying`]).
    fn keeping(&mut self, id: BufferId) -> (usize, Option<usize>) {
        self.assign(id, State::Ready)
    }

    fn assign(&mut self, id: BufferId, state: State) -> (usize, Option<usize>) {
        let slot = match self.index.get(&id) {
            Some(&slot) => slot,
            None => {
                self.index.insert(id, self.used);
                self.used += 1;
                self.used - 1
            }
        };
        self.state.insert(id, state);
        (slot, self.room_for(slot + 1))
    }

    /// A run of rolls' one copy into consecutive slots is about to be queued: the first of
    /// them (`ids`' own where they already lie in this order, else new ones), and the capacity
    /// to grow the memory to first where it has no room.
    fn copying_run(&mut self, ids: &[BufferId]) -> (usize, Option<usize>) {
        let first = ids.first().and_then(|id| self.index.get(id)).copied();
        let in_order = first.is_some_and(|first| {
            (ids.iter().enumerate()).all(|(k, id)| self.index.get(id) == Some(&(first + k)))
        });
        let first = match (in_order, first) {
            (true, Some(first)) => first,
            _ => {
                let first = self.used;
                self.used += ids.len();
                for (k, &id) in ids.iter().enumerate() {
                    self.index.insert(id, first + k);
                }
                first
            }
        };
        for &id in ids {
            self.state.insert(id, State::Copying);
        }
        (first, self.room_for(first + ids.len()))
    }

    /// `id`'s value is in the copy of its run (queued before, see [`ScaleAmaxes::copied_in_run`]).
    fn copied_in_run(&mut self, id: BufferId) {
        if self.index.contains_key(&id) {
            self.state.insert(id, State::Copying);
        }
    }

    /// The capacity to grow to for `slots` slots, if the present one is short.
    fn room_for(&mut self, slots: usize) -> Option<usize> {
        if slots <= self.capacity {
            return None;
        }
        let mut capacity = self.capacity.max(MIN_SLOTS);
        while capacity < slots {
            capacity *= 2;
        }
        self.capacity = capacity;
        Some(capacity)
    }

    /// Buffer `id` is written by something other than a roll's copy. (Called for every output
    /// of every op: nothing to hash in a run without delayed scaling.)
    fn written(&mut self, id: BufferId) {
        if !self.state.is_empty() {
            self.state.remove(&id);
        }
    }

    fn need(&self, id: BufferId) -> Need {
        match (self.state.get(&id), self.index.get(&id)) {
            (Some(State::Ready), Some(&slot)) => Need::Read(slot),
            (Some(State::Copying), Some(&slot)) => Need::Wait(slot),
            _ => Need::Device,
        }
    }

    /// The copies in flight have completed.
    fn waited(&mut self) {
        for state in self.state.values_mut() {
            *state = State::Ready;
        }
    }

    /// Whether a copy may be in flight.
    fn copying_any(&self) -> bool {
        self.state.values().any(|&s| s == State::Copying)
    }
}

/// The host's view of the scale amaxes (see the module docs).
#[derive(Default)]
pub(super) struct ScaleAmaxes {
    slots: Slots,
    memory: Option<PinnedHostSlice<f32>>,
    /// Recorded after the latest copy queued.
    copied: Option<CudaEvent>,
}

impl Drop for ScaleAmaxes {
    /// The memory is freed only after the copies into it have completed.
    fn drop(&mut self) {
        if let Some(event) = &self.copied {
            // Nothing to report to in a drop; a failed wait means the context is already gone.
            let _ = event.synchronize();
        }
    }
}

impl ScaleAmaxes {
    /// Buffer `id` is about to be written (by an op, from the host or by communication),
    /// allocated or freed: its copied value, if any, is no longer its value.
    pub fn written(&mut self, id: BufferId) {
        self.slots.written(id);
    }

    /// Queues a copy of scale amax `amax` (one f32, just written by a roll on `stream`) into its
    /// slot.
    pub fn copy_after_roll(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        amax: Buf,
    ) -> Result<()> {
        one_f32(amax)?;
        let (slot, grow) = self.slots.copying(amax.id);
        if let Some(capacity) = grow {
            self.grow(ctx, capacity)?;
            // Growing waited for the copies in flight and marked every value ready, this one's
            // too, whose copy is queued only below.
            self.slots.copying(amax.id);
        }
        let host = self.host_mut()?;
        // SAFETY: slot < capacity (grown above); amax holds one f32 (checked above); the
        // page-locked memory lives until the event recorded next has fired (Drop, grow).
        unsafe { cu::memcpy_dtoh_async(&mut host[slot..=slot], amax.ptr, stream.cu_stream()) }
            .map_err(|e| driver_error("queuing a scale amax's copy to the host", e))?;
        self.record_copied(ctx, stream)
    }

    /// Records the copy event after the copies queued on `stream` so far.
    fn record_copied(&mut self, ctx: &Arc<CudaContext>, stream: &CudaStream) -> Result<()> {
        let event = match self.copied.take() {
            Some(event) => event,
            None => ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(|e| driver_error("creating the scale amaxes' copy event", e))?,
        };
        (self.copied.insert(event).record(stream))
            .map_err(|e| driver_error("recording the scale amaxes' copy event", e))
    }

    /// Queues one copy of a run of rolls' scale amaxes `ids` (just written by the run's roll on
    /// `stream`, and into the f32 array at `staging` in this order) into consecutive slots.
    pub fn copy_run_after_roll(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        ids: &[BufferId],
        staging: CUdeviceptr,
    ) -> Result<()> {
        let (first, grow) = self.slots.copying_run(ids);
        if let Some(capacity) = grow {
            self.grow(ctx, capacity)?;
            // As in `copy_after_roll`: the run's copy is still to be queued.
            self.slots.copying_run(ids);
        }
        let host = self.host_mut()?;
        let held = host.len();
        let slots = (host.get_mut(first..first + ids.len())).ok_or_else(|| RuntimeError::Op {
            op: "delayed FP8 scaling".into(),
            what: format!(
                "no room for {} scale amax slots at slot {first} of {held}",
                ids.len()
            ),
        })?;
        // SAFETY: `staging` holds one f32 per id (the run's table); the page-locked memory
        // lives until the event recorded next has fired (Drop, grow).
        unsafe { cu::memcpy_dtoh_async(slots, staging, stream.cu_stream()) }
            .map_err(|e| driver_error("queuing a run of scale amaxes' copy to the host", e))?;
        self.record_copied(ctx, stream)
    }

    /// Scale amax `id`, just marked written by its roll's instruction, is in the copy its run's
    /// first instruction queued ([`Self::copy_run_after_roll`]).
    pub fn copied_in_run(&mut self, id: BufferId) {
        self.slots.copied_in_run(id);
    }

    /// The value of scale amax `amax`: from its slot (waiting for the copies in flight first
    /// where they hold it), else read from the device after the work queued on `stream` and
    /// kept in its slot until the buffer is written again.
    pub fn value(&mut self, ctx: &Arc<CudaContext>, stream: &CudaStream, amax: Buf) -> Result<f32> {
        let slot = match self.slots.need(amax.id) {
            Need::Read(slot) => slot,
            Need::Wait(slot) => {
                self.wait()?;
                slot
            }
            Need::Device => {
                // The read waits for the stream, so no copy into the slot is in flight.
                let value = read_one(stream, amax)?;
                let (slot, grow) = self.slots.keeping(amax.id);
                if let Some(capacity) = grow {
                    self.grow(ctx, capacity)?;
                }
                self.host_mut()?[slot] = value;
                return Ok(value);
            }
        };
        let host = self.host_mut()?;
        host.get(slot).copied().ok_or_else(|| RuntimeError::Buffer {
            id: amax.id.0,
            what: format!("has scale amax slot {slot} of {}", host.len()),
        })
    }

    /// The page-locked slots (allocated by the first roll's copy).
    fn host_mut(&mut self) -> Result<&mut [f32]> {
        let memory = self.memory.as_mut().ok_or_else(|| RuntimeError::Op {
            op: "delayed FP8 scaling".into(),
            what: "no page-locked memory for the scale amaxes".into(),
        })?;
        memory
            .as_mut_slice()
            .map_err(|e| driver_error("mapping the scale amaxes' slots", e))
    }

    fn wait(&mut self) -> Result<()> {
        if let Some(event) = &self.copied {
            event
                .synchronize()
                .map_err(|e| driver_error("waiting for the scale amaxes' copies", e))?;
        }
        self.slots.waited();
        Ok(())
    }

    /// New page-locked memory of `capacity` slots holding the old slots' values (after their
    /// copies have completed).
    fn grow(&mut self, ctx: &Arc<CudaContext>, capacity: usize) -> Result<()> {
        if self.slots.copying_any() {
            self.wait()?;
        }
        // Not write-combined: the host reads it. SAFETY: every slot is written below (zeros,
        // then the old values) before it is read.
        let mut memory =
            unsafe { ctx.alloc_pinned_with_flags::<f32>(capacity, 0) }.map_err(|e| {
                driver_error(
                    &format!("allocating {} bytes of pinned host memory", capacity * 4),
                    e,
                )
            })?;
        let new = memory
            .as_mut_slice()
            .map_err(|e| driver_error("mapping the scale amaxes' slots", e))?;
        new.fill(0.0);
        if let Some(old) = &self.memory {
            let old = old
                .as_slice()
                .map_err(|e| driver_error("mapping the scale amaxes' slots", e))?;
            new[..old.len()].copy_from_slice(old);
        }
        self.memory = Some(memory);
        Ok(())
    }
}

/// An error unless `amax` is one f32, as a scale amax is.
fn one_f32(amax: Buf) -> Result<()> {
    if amax.len == 1 && amax.dtype == DType::F32 {
        return Ok(());
    }
    Err(RuntimeError::Buffer {
        id: amax.id.0,
        what: format!(
            "is a scale amax of {} {:?} values; one f32 expected",
            amax.len, amax.dtype
        ),
    })
}

/// Scale amax `amax` read from the device once the work queued on `stream` has run.
fn read_one(stream: &CudaStream, amax: Buf) -> Result<f32> {
    one_f32(amax)?;
    stream
        .synchronize()
        .map_err(|e| driver_error("waiting to read a scale amax", e))?;
    let mut value = [0.0f32];
    // SAFETY: the buffer holds one f32 (checked above); the stream is idle.
    unsafe { cu::memcpy_dtoh_sync(&mut value, amax.ptr) }
        .map_err(|e| driver_error(&format!("reading scale amax buffer {}", amax.id.0), e))?;
    Ok(value[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rolled_value_is_waited_for_once_then_read_until_written() {
        let (a, b) = (BufferId(7), BufferId(9));
        let mut slots = Slots::default();
        assert_eq!(slots.need(a), Need::Device);
        assert_eq!(slots.copying(a), (0, Some(MIN_SLOTS)));
        assert_eq!(slots.copying(b), (1, None));
        assert_eq!(slots.need(a), Need::Wait(0));
        assert!(slots.copying_any());
        slots.waited();
        assert_eq!(
            (slots.need(a), slots.need(b)),
            (Need::Read(0), Need::Read(1))
        );
        // A host write (a checkpoint's load) makes the device the only source again, until
        // the value read from it is kept.
        slots.written(b);
        assert_eq!(slots.need(b), Need::Device);
        assert_eq!(slots.keeping(b), (1, None));
        assert_eq!(slots.need(b), Need::Read(1));
        // The next roll keeps the slot.
        assert_eq!(slots.copying(b), (1, None));
        assert_eq!(slots.need(b), Need::Wait(1));
    }

    #[test]
    fn a_run_keeps_consecutive_slots_in_its_order() {
        let ids = [BufferId(3), BufferId(1), BufferId(2)];
        let mut slots = Slots::default();
        // A value read before any roll (a cold GEMM's check) took a slot out of run order.
        assert_eq!(slots.keeping(BufferId(1)), (0, Some(MIN_SLOTS)));
        assert_eq!(slots.copying_run(&ids), (1, None));
        assert_eq!(slots.need(BufferId(1)), Need::Wait(2));
        slots.waited();
        // The next step's run finds its slots in order and keeps them.
        assert_eq!(slots.copying_run(&ids), (1, None));
        assert_eq!(
            ids.map(|id| slots.need(id)),
            [Need::Wait(1), Need::Wait(2), Need::Wait(3)]
        );
        // A single roll after the run keeps its member's slot; a new buffer takes the next.
        assert_eq!(slots.copying(BufferId(2)), (3, None));
        assert_eq!(slots.copying(BufferId(9)), (4, None));
        // A run longer than the memory doubles it as often as it needs.
        let long: Vec<BufferId> = (100..100 + 3 * MIN_SLOTS as u32).map(BufferId).collect();
        assert_eq!(slots.copying_run(&long), (5, Some(4 * MIN_SLOTS)));
    }

    /// A copy that grows the memory waits for those in flight first, which marks every value
    /// ready; marking its own again keeps its slot and has it waited for.
    #[test]
    fn a_copy_that_grows_the_memory_is_still_waited_for() {
        let mut slots = Slots::default();
        let run = [BufferId(4), BufferId(5)];
        assert_eq!(slots.copying_run(&run), (0, Some(MIN_SLOTS)));
        slots.waited();
        assert_eq!(slots.copying_run(&run), (0, None));
        assert_eq!(run.map(|id| slots.need(id)), [Need::Wait(0), Need::Wait(1)]);
        assert_eq!(slots.copying(BufferId(7)), (2, None));
        slots.waited();
        assert_eq!(slots.copying(BufferId(7)), (2, None));
        assert_eq!(slots.need(BufferId(7)), Need::Wait(2));
    }

    #[test]
    fn the_memory_doubles_when_a_roll_needs_one_more_slot() {
        let mut slots = Slots::default();
        for k in 0..MIN_SLOTS {
            let grow = slots.copying(BufferId(k as u32)).1;
            assert_eq!(grow, (k == 0).then_some(MIN_SLOTS));
        }
        assert_eq!(
            slots.copying(BufferId(MIN_SLOTS as u32)),
            (MIN_SLOTS, Some(2 * MIN_SLOTS))
        );
    }
}
