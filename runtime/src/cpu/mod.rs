//! The CPU backend: the exact reference every other backend and every parallel plan is measured
//! against. f32 activations and parameters, i32 token ids; every op forward and backward as
//! documented in `parc_compiler::ir::op`; deterministic (bit-identical results for any thread
//! count: see `par`). Matmuls go through the `gemm` crate, other kernels split rows over rayon.
//!
//! Buffers live in a slot table indexed by `BufferId`. Besides the `Backend` trait, the executor
//! and the local comm get direct access: borrow a buffer as a slice, or [`CpuBackend::take`] a
//! tensor out (for a collective running on another thread) and [`CpuBackend::put_back`] it.
//! An op whose output is also one of its inputs sees the input's value from before the op.
//! Ops on at most `par::TASK_ELEMENTS` elements in all run on the calling thread (no kernel loop
//! splits at that size); larger ones run on the backend's pool.
mod args;
mod attention;
mod cross_entropy;
mod dense;
mod dispatch;
mod elementwise;
mod embed;
mod linear;
mod norm;
mod optim;
mod par;
mod rope;

use crate::backend::{Backend, StepScalars};
use crate::error::{Result, RuntimeError};
use crate::tensor::Tensor;
use args::{signature, Inputs, Outputs};
use dense::Threads;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{BufferId, DType};
use std::sync::Arc;

/// One allocated buffer: its tensor, or only its shape and dtype while the tensor is taken out.
struct Slot {
    shape: Vec<u64>,
    dtype: DType,
    tensor: Option<Tensor>,
}

/// The CPU backend. See the module docs.
pub struct CpuBackend {
    slots: Vec<Option<Slot>>,
    /// A dedicated thread pool, or None to run on rayon's global pool.
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

fn buffer_error(id: BufferId, what: impl Into<String>) -> RuntimeError {
    RuntimeError::Buffer {
        id: id.0,
        what: what.into(),
    }
}

impl CpuBackend {
    /// A backend running its kernels on rayon's global thread pool.
    pub fn new() -> CpuBackend {
        CpuBackend {
            slots: Vec::new(),
            pool: None,
        }
    }

    /// A backend running its kernels on its own pool of `threads` threads (results are the same
    /// for every count; this only bounds how many cores one rank uses).
    pub fn with_threads(threads: usize) -> Result<CpuBackend> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("parc-cpu-{i}"))
            .build()
            .map_err(|e| {
                RuntimeError::Unsupported(format!("cannot start {threads} CPU threads: {e}"))
            })?;
        Ok(CpuBackend {
            slots: Vec::new(),
            pool: Some(Arc::new(pool)),
        })
    }

    fn slot(&self, id: BufferId) -> Result<&Slot> {
        self.slots
            .get(id.0 as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| buffer_error(id, "is not allocated"))
    }

    fn slot_mut(&mut self, id: BufferId) -> Result<&mut Slot> {
        self.slots
            .get_mut(id.0 as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| buffer_error(id, "is not allocated"))
    }

    /// The tensor of `id` (an error while it is taken out).
    pub fn tensor(&self, id: BufferId) -> Result<&Tensor> {
        self.slot(id)?
            .tensor
            .as_ref()
            .ok_or_else(|| buffer_error(id, "is taken out (a collective has not put it back)"))
    }

    pub fn tensor_mut(&mut self, id: BufferId) -> Result<&mut Tensor> {
        self.slot_mut(id)?
            .tensor
            .as_mut()
            .ok_or_else(|| buffer_error(id, "is taken out (a collective has not put it back)"))
    }

    /// Borrow an f32 buffer.
    pub fn f32(&self, id: BufferId) -> Result<&[f32]> {
        self.tensor(id)?
            .as_f32()
            .ok_or_else(|| buffer_error(id, "is i32, expected f32"))
    }

    pub fn f32_mut(&mut self, id: BufferId) -> Result<&mut [f32]> {
        self.tensor_mut(id)?
            .as_f32_mut()
            .ok_or_else(|| buffer_error(id, "is i32, expected f32"))
    }

    /// Borrow an i32 buffer.
    pub fn i32(&self, id: BufferId) -> Result<&[i32]> {
        self.tensor(id)?
            .as_i32()
            .ok_or_else(|| buffer_error(id, "is f32, expected i32"))
    }

    pub fn i32_mut(&mut self, id: BufferId) -> Result<&mut [i32]> {
        self.tensor_mut(id)?
            .as_i32_mut()
            .ok_or_else(|| buffer_error(id, "is f32, expected i32"))
    }

    /// Move the tensor of `id` out (the buffer stays allocated, unusable until
    /// [`CpuBackend::put_back`]).
    pub fn take(&mut self, id: BufferId) -> Result<Tensor> {
        self.slot_mut(id)?
            .tensor
            .take()
            .ok_or_else(|| buffer_error(id, "is already taken out"))
    }

    /// Return a tensor taken with [`CpuBackend::take`]; its shape and dtype must be unchanged.
    pub fn put_back(&mut self, id: BufferId, tensor: Tensor) -> Result<()> {
        let slot = self.slot_mut(id)?;
        if slot.tensor.is_some() {
            return Err(buffer_error(
                id,
                "was not taken out, cannot put a tensor back",
            ));
        }
        if tensor.shape() != slot.shape.as_slice() || tensor.dtype() != slot.dtype {
            return Err(buffer_error(
                id,
                format!(
                    "put back as {:?} {:?}, but it was allocated as {:?} {:?}",
                    tensor.dtype(),
                    tensor.shape(),
                    slot.dtype,
                    slot.shape
                ),
            ));
        }
        slot.tensor = Some(tensor);
        Ok(())
    }

    /// Whether `id` is allocated (taken out or not).
    pub fn is_allocated(&self, id: BufferId) -> bool {
        self.slot(id).is_ok()
    }

    /// Bytes held by allocated buffers (taken-out ones included).
    pub fn allocated_bytes(&self) -> u64 {
        self.slots
            .iter()
            .flatten()
            .map(|s| s.shape.iter().product::<u64>() * s.dtype.bytes())
            .sum()
    }

    /// Run `f` on this backend's pool.
    fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(pool) => pool.install(f),
            None => f(),
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc(&mut self, id: BufferId, shape: &[u64], dtype: DType) -> Result<()> {
        let index = id.0 as usize;
        if self.slots.get(index).is_some_and(Option::is_some) {
            return Err(buffer_error(id, "is already allocated"));
        }
        let tensor = Tensor::zeros(id, shape, dtype)?;
        if self.slots.len() <= index {
            self.slots.resize_with(index + 1, || None);
        }
        self.slots[index] = Some(Slot {
            shape: shape.to_vec(),
            dtype,
            tensor: Some(tensor),
        });
        Ok(())
    }

    fn free(&mut self, id: BufferId) -> Result<()> {
        match self.slots.get_mut(id.0 as usize) {
            Some(slot @ Some(_)) => {
                *slot = None;
                Ok(())
            }
            _ => Err(buffer_error(id, "is not allocated, cannot free it")),
        }
    }

    fn compute(
        &mut self,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
        scalars: &StepScalars,
    ) -> Result<()> {
        let sig = signature(op);
        let count_error = |kind: &str, expected: &[&str], got: usize| {
            args::op_error(
                sig.name,
                format!(
                    "takes {} {kind} ({}), got {got}",
                    expected.len(),
                    expected.join(", ")
                ),
            )
        };
        if inputs.len() != sig.inputs.len() {
            return Err(count_error("inputs", &sig.inputs, inputs.len()));
        }
        if outputs.len() != sig.outputs.len() {
            return Err(count_error("outputs", &sig.outputs, outputs.len()));
        }
        for (i, id) in outputs.iter().enumerate() {
            if outputs[..i].contains(id) {
                return Err(args::op_error(
                    sig.name,
                    format!("buffer {} is bound to two outputs", id.0),
                ));
            }
        }
        // Move the outputs out of their slots so they can be borrowed mutably next to the inputs.
        let mut taken: Vec<Tensor> = Vec::with_capacity(outputs.len());
        for &id in outputs {
            match self.take(id) {
                Ok(tensor) => taken.push(tensor),
                Err(e) => {
                    self.restore(outputs, taken);
                    return Err(e);
                }
            }
        }
        let result = self.compute_on(op, &sig, inputs, outputs, &mut taken, scalars);
        self.restore(outputs, taken);
        result
    }

    fn write_f32(&mut self, id: BufferId, data: &[f32]) -> Result<()> {
        let dst = self.f32_mut(id)?;
        if dst.len() != data.len() {
            return Err(buffer_error(
                id,
                format!("holds {} elements, cannot write {}", dst.len(), data.len()),
            ));
        }
        dst.copy_from_slice(data);
        Ok(())
    }

    fn write_i32(&mut self, id: BufferId, data: &[i32]) -> Result<()> {
        let dst = self.i32_mut(id)?;
        if dst.len() != data.len() {
            return Err(buffer_error(
                id,
                format!("holds {} elements, cannot write {}", dst.len(), data.len()),
            ));
        }
        dst.copy_from_slice(data);
        Ok(())
    }

    fn read_f32(&self, id: BufferId) -> Result<Vec<f32>> {
        Ok(self.f32(id)?.to_vec())
    }
}

impl CpuBackend {
    /// Put the tensors taken for an op's outputs back into their slots.
    fn restore(&mut self, outputs: &[BufferId], taken: Vec<Tensor>) {
        for (&id, tensor) in outputs.iter().zip(taken) {
            if let Ok(slot) = self.slot_mut(id) {
                slot.tensor = Some(tensor);
            }
        }
    }

    /// Bind inputs (copying any that is also an output, so it reads the value from before the
    /// op) and outputs, then run the kernel on this backend's pool.
    fn compute_on(
        &self,
        op: &Op,
        sig: &args::Signature,
        inputs: &[BufferId],
        outputs: &[BufferId],
        taken: &mut [Tensor],
        scalars: &StepScalars,
    ) -> Result<()> {
        let aliased: Vec<Option<Tensor>> = inputs
            .iter()
            .map(|id| {
                outputs
                    .iter()
                    .position(|o| o == id)
                    .map(|k| taken[k].clone())
            })
            .collect();
        let mut tensors = Vec::with_capacity(inputs.len());
        for (&id, copy) in inputs.iter().zip(&aliased) {
            tensors.push(match copy {
                Some(tensor) => tensor,
                None => self.tensor(id)?,
            });
        }
        let ins = Inputs {
            op: sig.name,
            roles: &sig.inputs,
            ids: inputs,
            tensors,
        };
        let mut outs = Outputs {
            op: sig.name,
            roles: &sig.outputs,
            ids: outputs,
            tensors: taken.iter_mut().collect(),
        };
        // An op small enough that no kernel loop would split runs right here: handing it to the
        // pool would cost two thread switches for no parallelism (see `par`).
        let elements: usize = ins.tensors.iter().map(|t| t.len()).sum::<usize>()
            + outs.tensors.iter().map(|t| t.len()).sum::<usize>();
        if elements <= par::TASK_ELEMENTS {
            dispatch::run(op, &ins, &mut outs, scalars, Threads::Caller)
        } else {
            self.install(|| dispatch::run(op, &ins, &mut outs, scalars, Threads::Pool))
        }
    }
}

#[cfg(test)]
mod tests;
