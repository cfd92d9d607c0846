//! The backend the engine runs on, with the buffer ids it hands out: f32 tensors of
//! `[rows, cols]` allocated, run through ops and freed, ids reused once freed.
use crate::backend::{Backend, StepScalars};
use crate::error::Result;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{BufferId, DType};

/// Buffer ids: the lowest free one first, so the backend's table of buffers stays small.
#[derive(Debug, Default)]
pub(super) struct Ids {
    next: u32,
    free: Vec<u32>,
}

impl Ids {
    pub fn take(&mut self) -> BufferId {
        match self.free.pop() {
            Some(id) => BufferId(id),
            None => {
                self.next += 1;
                BufferId(self.next - 1)
            }
        }
    }

    pub fn give_back(&mut self, id: BufferId) {
        self.free.push(id.0);
    }
}

/// An f32 activation `[rows, cols]` in one buffer (rows: one per token, batch 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tensor {
    pub buf: BufferId,
    pub rows: u64,
    pub cols: u64,
}

/// A backend and the ids of the buffers the engine holds on it.
pub(super) struct Device<B: Backend> {
    pub backend: B,
    pub ids: Ids,
}

/// Ops of inference read no learning rate, step count or loss scale.
const NO_SCALARS: StepScalars = StepScalars {
    lr: 0.0,
    step: 0,
    loss_scale: None,
};

impl<B: Backend> Device<B> {
    /// A zeroed buffer of `shape` and `dtype`.
    pub fn alloc(&mut self, shape: &[u64], dtype: DType) -> Result<BufferId> {
        let id = self.ids.take();
        if let Err(e) = self.backend.alloc(id, shape, dtype) {
            self.ids.give_back(id);
            return Err(e);
        }
        Ok(id)
    }

    /// A zeroed `[rows, cols]` tensor.
    pub fn tensor(&mut self, rows: u64, cols: u64) -> Result<Tensor> {
        let buf = self.alloc(&[rows, cols], DType::F32)?;
        Ok(Tensor { buf, rows, cols })
    }

    pub fn free(&mut self, id: BufferId) -> Result<()> {
        self.backend.free(id)?;
        self.ids.give_back(id);
        Ok(())
    }

    pub fn run(&mut self, op: &Op, inputs: &[BufferId], outputs: &[BufferId]) -> Result<()> {
        self.backend.compute(op, inputs, outputs, &NO_SCALARS)
    }

    /// A new `[x.rows, cols]` tensor written by `op` from `inputs` (its only output).
    pub fn apply(&mut self, op: &Op, inputs: &[BufferId], x: Tensor, cols: u64) -> Result<Tensor> {
        let y = self.tensor(x.rows, cols)?;
        self.run(op, inputs, &[y.buf])?;
        Ok(y)
    }

    /// The last row of `x`, as a new `[1, cols]` tensor.
    pub fn last_row(&mut self, x: Tensor) -> Result<Tensor> {
        let y = self.tensor(1, x.cols)?;
        let op = Op::CopyRange {
            src_offset: (x.rows - 1) * x.cols,
            dst_offset: 0,
            len: x.cols,
        };
        self.run(&op, &[x.buf], &[y.buf])?;
        Ok(y)
    }
}
