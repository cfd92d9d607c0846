//! Checkpoint snapshots on the GPU: page-locked host staging that the checkpoint writer's
//! thread reads ([`PinnedStaging`]), and the device-to-host copy of a buffer into it. The copy
//! is synchronous, after the work queued on the compute stream: the step loop waits for it (and,
//! with an asynchronous save, only for it), then the writer thread writes the staged values
//! while the GPU trains on. A copy on a side stream overlapping the next step is not done: the
//! next step's optimizer update would have to wait for it anyway.
use super::device::driver_error;
use crate::backend::HostStaging;
use crate::error::Result;
use cudarc::driver::{CudaContext, PinnedHostSlice};
use std::sync::Arc;

/// `len` page-locked f32s (not write-combined: the writer thread reads them).
pub(super) struct PinnedStaging(PinnedHostSlice<f32>);

impl PinnedStaging {
    /// Allocate and zero `len` (> 0) page-locked f32s in `ctx`.
    pub(super) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<PinnedStaging> {
        // SAFETY: the memory is zero-filled below before anything reads it.
        let memory = unsafe { ctx.alloc_pinned_with_flags::<f32>(len, 0) }.map_err(|e| {
            driver_error(
                &format!(
                    "allocating {} bytes of pinned host memory for checkpoint snapshots",
                    len * 4
                ),
                e,
            )
        })?;
        let mut staging = PinnedStaging(memory);
        staging.values_mut()?.fill(0.0);
        Ok(staging)
    }
}

impl HostStaging for PinnedStaging {
    fn values(&self) -> Result<&[f32]> {
        self.0
            .as_slice()
            .map_err(|e| driver_error("reading the checkpoint snapshot's pinned memory", e))
    }

    fn values_mut(&mut self) -> Result<&mut [f32]> {
        self.0
            .as_mut_slice()
            .map_err(|e| driver_error("filling the checkpoint snapshot's pinned memory", e))
    }
}
