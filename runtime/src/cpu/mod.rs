//! The CPU backend: the exact reference every other backend and every parallel plan is measured
//! against. f32 (or bf16-stored) activations, f32 parameters, i32 token ids; every op forward
//! and backward as
//! documented in `parc_compiler::ir::op`; deterministic (bit-identical results for any thread
//! count: see `par`). Matmuls go through the `gemm` crate, other kernels split rows over rayon.
//!
//! Buffers live in one vector of words per rank (`memory`): at the offsets of the program's memory
//! plan when the executor gave one (`Backend::prepare`), so `Alloc` and `Free` only zero-fill and
//! release a planned range; a buffer the plan exempts from zeroing is filled with NaN instead,
//! so a wrong exemption poisons the loss (`memory`). Besides the `Backend` trait, callers can borrow a buffer as a slice.
//!
//! An op runs in four steps (`CpuBackend::compute`): its buffers are bound to its signature
//! (`crate::bind`; the kernels read them by role through `args`), staged (`staging`), run by its
//! family's module (`dispatch`), and the staged outputs stored. An op whose output is also one of
//! its inputs sees the input's value from before the op. bf16 buffers (a `precision = bf16`
//! plan's activations) are staged through f32 around each op: inputs widened exactly, outputs
//! widened before the op (an accumulating op reads them) and rounded to the nearest bf16 after
//! it, so every kernel computes in f32 and the CPU defines what bf16 storage means
//! (`parc_compiler::ir::storage`).
//! Ops on at most `par::TASK_ELEMENTS` elements in all run on the calling thread (no kernel loop
//! splits at that size); larger ones run on the backend's pool.
mod args;
mod attention;
mod cross_entropy;
mod dense;
mod dispatch;
mod elementwise;
mod embed;
pub(crate) mod fp8;
pub(crate) mod fused;
mod linear;
mod memory;
mod movement;
mod norm;
mod optim;
mod par;
mod rope;
mod staging;

use crate::backend::{Backend, StepScalars};
use crate::bind::Bound;
use crate::error::{Result, RuntimeError};
use args::{Inputs, Outputs, SlotRef};
use dense::Threads;
use memory::{buffer_error, copy_exact, element_count, Memory, ViewMut};
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{BufferId, DType, Program};
use parc_compiler::memplan::MemoryLayout;
use staging::Staging;
use std::sync::Arc;

/// The CPU backend. See the module docs.
pub struct CpuBackend {
    memory: Memory,
    /// A dedicated thread pool, or None to run on rayon's global pool.
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// A backend running its kernels on rayon's global thread pool.
    pub fn new() -> CpuBackend {
        CpuBackend {
            memory: Memory::default(),
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
            memory: Memory::default(),
            pool: Some(Arc::new(pool)),
        })
    }

    /// The buffers `ids` as operand binding sees them.
    fn slot_refs(&self, ids: &[BufferId]) -> Result<Vec<SlotRef>> {
        ids.iter()
            .map(|&id| {
                let slot = self.memory.slot(id)?;
                Ok(SlotRef(id, slot.dtype, slot.len))
            })
            .collect()
    }

    /// Borrow an f32 buffer.
    pub fn f32(&self, id: BufferId) -> Result<&[f32]> {
        let view = self.memory.view(id)?;
        view.as_f32().ok_or_else(|| {
            buffer_error(
                id,
                format!(
                    "is {}, expected f32 (read bf16 with read_f32)",
                    view.type_name()
                ),
            )
        })
    }

    pub fn f32_mut(&mut self, id: BufferId) -> Result<&mut [f32]> {
        match self.memory.view_mut(id)? {
            ViewMut::F32(v) => Ok(v),
            ViewMut::I32(_) => Err(buffer_error(id, "is i32, expected f32")),
            ViewMut::Bf16(_) | ViewMut::Fp8(..) => Err(buffer_error(
                id,
                "is narrow (bf16 or FP8), expected f32 (write it with write_f32)",
            )),
        }
    }

    /// Borrow an i32 buffer.
    pub fn i32(&self, id: BufferId) -> Result<&[i32]> {
        let view = self.memory.view(id)?;
        view.as_i32()
            .ok_or_else(|| buffer_error(id, format!("is {}, expected i32", view.type_name())))
    }

    pub fn i32_mut(&mut self, id: BufferId) -> Result<&mut [i32]> {
        match self.memory.view_mut(id)? {
            ViewMut::I32(v) => Ok(v),
            ViewMut::F32(_) => Err(buffer_error(id, "is f32, expected i32")),
            ViewMut::Bf16(_) | ViewMut::Fp8(..) => {
                Err(buffer_error(id, "is bf16 or FP8, expected i32"))
            }
        }
    }

    /// Whether `id` is allocated.
    pub fn is_allocated(&self, id: BufferId) -> bool {
        self.memory.slot(id).is_ok()
    }

    /// Bytes held by allocated buffers.
    pub fn allocated_bytes(&self) -> u64 {
        self.memory
            .live()
            .map(|s| s.len as u64 * s.dtype.bytes())
            .sum()
    }

    /// Bytes of buffer memory this backend holds: the planned persistent region and arena, and
    /// any buffers allocated outside the plan.
    pub fn reserved_bytes(&self) -> u64 {
        self.memory.reserved_words() as u64 * 4
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn reserved_bytes(&self) -> Option<u64> {
        Some(CpuBackend::reserved_bytes(self))
    }

    fn prepare(&mut self, program: &Program, layout: &MemoryLayout) -> Result<()> {
        self.memory.prepare(program, layout)
    }

    fn alloc(&mut self, id: BufferId, shape: &[u64], dtype: DType) -> Result<()> {
        let len = element_count(id, shape)?;
        self.memory.alloc(id, len, dtype)
    }

    fn free(&mut self, id: BufferId) -> Result<()> {
        self.memory.free(id)
    }

    /// Bind the operands to the op's signature, stage them (bf16 through f32, an input that is
    /// also an output through a copy), run the op's family, store the staged outputs.
    fn compute(
        &mut self,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
        scalars: &StepScalars,
    ) -> Result<()> {
        let (input_slots, output_slots) = (self.slot_refs(inputs)?, self.slot_refs(outputs)?);
        let bound = Bound::bind(op, &input_slots, &output_slots)?;
        for (i, id) in outputs.iter().enumerate() {
            if outputs[..i].contains(id) {
                return Err(bound.err(format!("buffer {} is bound to two outputs", id.0)));
            }
        }
        let elements = input_slots.iter().chain(&output_slots).map(|s| s.2).sum();
        let mut staging = Staging::new(&self.memory, inputs, outputs)?;
        let (in_views, out_views) = staging.views(&mut self.memory, inputs, outputs)?;
        let ins = Inputs::new(&bound, in_views);
        let mut outs = Outputs::new(&bound, out_views);
        let pool = self.pool.as_deref();
        run(pool, elements, op, &ins, &mut outs, scalars)?;
        staging.store(&mut self.memory)
    }

    /// Into a narrow (bf16 or FP8) buffer, each element is rounded to its type.
    fn write_f32(&mut self, id: BufferId, data: &[f32]) -> Result<()> {
        if self.memory.slot(id)?.dtype.is_narrow() {
            return self.memory.store_rounded(id, data);
        }
        copy_exact(id, self.f32_mut(id)?, data)
    }

    fn write_i32(&mut self, id: BufferId, data: &[i32]) -> Result<()> {
        copy_exact(id, self.i32_mut(id)?, data)
    }

    /// A narrow (bf16 or FP8) buffer reads widened to f32 (exact).
    fn read_f32(&self, id: BufferId) -> Result<Vec<f32>> {
        if self.memory.slot(id)?.dtype.is_narrow() {
            return self.memory.widened(id);
        }
        Ok(self.f32(id)?.to_vec())
    }

    /// An f32 buffer is copied without an intermediate vector.
    fn read_f32_into(&mut self, id: BufferId, out: &mut [f32]) -> Result<()> {
        let widened;
        let values = if self.memory.slot(id)?.dtype.is_narrow() {
            widened = self.memory.widened(id)?;
            &widened[..]
        } else {
            self.f32(id)?
        };
        crate::backend::check_read_len(id, values.len(), out)?;
        out.copy_from_slice(values);
        Ok(())
    }

    fn stores_bf16(&self) -> bool {
        true
    }
}

/// Run `op` on its staged operands, `elements` in all: right here when it is small enough that
/// no kernel loop would split (handing it to the pool would cost two thread switches for no
/// parallelism, see `par`), else on `pool` (rayon's global pool when None).
fn run(
    pool: Option<&rayon::ThreadPool>,
    elements: usize,
    op: &Op,
    ins: &Inputs,
    outs: &mut Outputs,
    scalars: &StepScalars,
) -> Result<()> {
    if elements <= par::TASK_ELEMENTS {
        return dispatch::run(op, ins, outs, scalars, Threads::Caller);
    }
    match pool {
        Some(pool) => pool.install(|| dispatch::run(op, ins, outs, scalars, Threads::Pool)),
        None => dispatch::run(op, ins, outs, scalars, Threads::Pool),
    }
}

#[cfg(test)]
mod tests;
