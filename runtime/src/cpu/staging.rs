//! One op's operands as its kernels see them: narrow (bf16 and FP8) buffers staged through f32
//! (inputs widened exactly; outputs widened before the op, since an accumulating op reads them,
//! and rounded to their type after it), an input that is also an output read from a copy taken before
//! the op, and every other buffer borrowed where it lies (`Memory::split`).
use super::memory::{buffer_error, Memory, View, ViewMut};
use crate::error::Result;
use parc_compiler::ir::{BufferId, DType};

/// The staged copies of one op's operands.
pub(super) struct Staging {
    /// Narrow inputs, widened (each buffer once).
    inputs: Vec<(BufferId, Vec<f32>)>,
    /// f32 and i32 inputs that are also outputs: their words, element count and type as they
    /// were before the op.
    copies: Vec<(BufferId, Vec<u32>, usize, DType)>,
    /// Narrow outputs, widened; [`Staging::store`] rounds them back.
    outputs: Vec<(BufferId, Vec<f32>)>,
}

impl Staging {
    /// Stage the operands of an op reading `inputs` and writing `outputs` (distinct).
    pub fn new(memory: &Memory, inputs: &[BufferId], outputs: &[BufferId]) -> Result<Staging> {
        let is_narrow = |id: BufferId| -> Result<bool> { Ok(memory.slot(id)?.dtype.is_narrow()) };
        let mut staging = Staging {
            inputs: Vec::new(),
            copies: Vec::new(),
            outputs: Vec::new(),
        };
        for &id in inputs {
            if is_narrow(id)? {
                if !staging.inputs.iter().any(|(c, _)| *c == id) {
                    staging.inputs.push((id, memory.widened(id)?));
                }
            } else if outputs.contains(&id) && !staging.copies.iter().any(|(c, ..)| *c == id) {
                let slot = memory.slot(id)?;
                let words = memory.copy_words(id)?;
                staging.copies.push((id, words, slot.len, slot.dtype));
            }
        }
        for &id in outputs {
            if is_narrow(id)? {
                staging.outputs.push((id, memory.widened(id)?));
            }
        }
        Ok(staging)
    }

    /// A view of every input and output, in order: the staged values where there are some,
    /// else the buffer in `memory`.
    pub fn views<'a>(
        &'a mut self,
        memory: &'a mut Memory,
        inputs: &[BufferId],
        outputs: &[BufferId],
    ) -> Result<(Vec<View<'a>>, Vec<ViewMut<'a>>)> {
        let Staging {
            inputs: staged_in,
            copies,
            outputs: staged_out,
        } = self;
        let (staged_in, copies): (&'a Vec<_>, &'a Vec<_>) = (staged_in, copies);
        let direct_inputs: Vec<BufferId> = inputs
            .iter()
            .copied()
            .filter(|id| !outputs.contains(id) && !staged_in.iter().any(|(c, _)| c == id))
            .collect();
        let direct_outputs: Vec<BufferId> = outputs
            .iter()
            .copied()
            .filter(|id| !staged_out.iter().any(|(c, _)| c == id))
            .collect();
        let (direct_in, direct_out) = memory.split(&direct_inputs, &direct_outputs)?;
        let mut direct_in = direct_in.into_iter();
        let mut views = Vec::with_capacity(inputs.len());
        for id in inputs {
            let staged = staged_in.iter().find(|(c, _)| c == id);
            let copy = copies.iter().find(|(c, ..)| c == id);
            let view = match (staged, copy) {
                (Some((_, values)), _) => Some(View::F32(values)),
                (None, Some((_, words, len, dtype))) => Some(View::of(words, *len, *dtype)),
                (None, None) => direct_in.next(),
            };
            views.push(view.ok_or_else(|| lost(*id))?);
        }
        let mut direct_out = direct_out.into_iter();
        let mut staged_out = staged_out.iter_mut();
        let mut out_views = Vec::with_capacity(outputs.len());
        for id in outputs {
            let view = if direct_outputs.contains(id) {
                direct_out.next()
            } else {
                staged_out
                    .next()
                    .map(|(_, values)| ViewMut::F32(values.as_mut_slice()))
            };
            out_views.push(view.ok_or_else(|| lost(*id))?);
        }
        Ok((views, out_views))
    }

    /// Round the staged outputs into their narrow buffers (after the op ran).
    pub fn store(&self, memory: &mut Memory) -> Result<()> {
        for (id, values) in &self.outputs {
            memory.store_rounded(*id, values)?;
        }
        Ok(())
    }
}

fn lost(id: BufferId) -> crate::error::RuntimeError {
    buffer_error(id, "lost its binding (a backend bug)")
}
