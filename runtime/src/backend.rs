//! The `Backend` trait: where a rank's buffers live and how compute ops run on them. The
//! executor drives it; `cpu` (the exact reference) and later `cuda` implement it.
use crate::error::Result;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{BufferId, DType};

/// Per-step values an op may need that are not part of the program: the learning rate from the
/// schedule, the 1-based optimizer step count (for Adam's bias correction) and, in fp16 runs,
/// the loss scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    pub lr: f64,
    pub step: u64,
    /// The loss scale of this step when the run scales its loss (fp16); None otherwise. With
    /// it, `CeGrad` multiplies the loss gradient by it, `ClipCoef` divides it back out (and
    /// marks an overflowed step with a NaN coefficient), and `AdamW`/`Sgd` leave a step with a
    /// non-finite coefficient untouched (see `parc_compiler::ir::op`).
    pub loss_scale: Option<f64>,
}

pub trait Backend {
    /// Short name for logs (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// Allocate `id` with `shape` (zero-filled). Allocating an id twice is an error.
    fn alloc(&mut self, id: BufferId, shape: &[u64], dtype: DType) -> Result<()>;
    /// Release `id`. Freeing an unallocated id is an error.
    fn free(&mut self, id: BufferId) -> Result<()>;
    /// Run one compute op; `inputs`/`outputs` follow the order documented on the `Op` variant.
    fn compute(
        &mut self,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
        scalars: &StepScalars,
    ) -> Result<()>;
    /// Copy host data into an f32 buffer (length must match).
    fn write_f32(&mut self, id: BufferId, data: &[f32]) -> Result<()>;
    /// Copy host data into an i32 buffer (length must match).
    fn write_i32(&mut self, id: BufferId, data: &[i32]) -> Result<()>;
    /// Copy an f32 buffer to the host.
    fn read_f32(&self, id: BufferId) -> Result<Vec<f32>>;
    /// Wait until all queued work has finished (for timing ops); backends that run ops
    /// synchronously need not override it.
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}
