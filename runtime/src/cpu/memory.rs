//! The CPU backend's buffer storage: one vector of 4-byte words per rank holding every buffer
//! (f32 and i32 one element per word, bf16 two per word, element `2k` in the low half of word
//! `k`, FP8 four per word, element `4k` in the lowest byte, as the bytes lie on a
//! little-endian device). With a memory plan (`Backend::prepare`)
//! the vector is sized once — the persistent region, then the transient arena — and each
//! buffer lives at its planned offset; `alloc` only zero-fills its words, or, for a buffer the
//! plan says is fully written before it is read ([`MemoryLayout::needs_zero`]), fills them with
//! NaN ([`POISON`], [`POISON_BF16`]): a wrong mark then shows as a NaN loss instead of passing
//! on stale bytes that happen to be harmless. Buffers without a planned place (a backend used
//! without a plan, as op tests do) go above the planned regions, first fit, the vector growing
//! as needed.
//!
//! An op borrows its inputs and outputs at once: [`Memory::split`] cuts the vector into
//! disjoint slices (two live buffers never overlap, which the planner's checker proved and this
//! module checks again per op).
use super::fp8::{round_fp8, widen_fp8};
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::fp8::Fp8Format;
use parc_compiler::ir::{BufferId, DType, Program};
use parc_compiler::memplan::{MemoryLayout, Placement};

/// The word an allocation the plan exempts from zero-filling is filled with: a quiet NaN as
/// f32 (and an id far outside any vocabulary as i32), so reading it before writing it shows.
const POISON: u32 = 0x7fc0_0000;
/// The same for bf16 buffers: a quiet bf16 NaN in both halves of the word.
const POISON_BF16: u32 = 0x7fc0_7fc0;
/// The same for FP8 buffers: NaN (0x7f in both formats) in every byte.
const POISON_FP8: u32 = 0x7f7f_7f7f;

/// Where one allocated buffer lives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot {
    /// First word.
    pub offset: usize,
    /// Elements.
    pub len: usize,
    /// Words holding them (`len`, `ceil(len / 2)` for bf16, `ceil(len / 4)` for FP8).
    pub words: usize,
    pub dtype: DType,
}

/// Words holding `len` elements of `dtype`.
fn words_for(len: usize, dtype: DType) -> usize {
    match dtype {
        DType::F32 | DType::I32 => len,
        DType::Bf16 => len.div_ceil(2),
        DType::Fp8(_) => len.div_ceil(4),
    }
}

/// The f32 value of a stored bf16 element (exact).
pub(crate) fn widen_bf16(bits: u16) -> f32 {
    half::bf16::from_bits(bits).to_f32()
}

/// `x` rounded to the nearest bf16, ties to even (NaN stays NaN, overflow becomes infinity).
pub(crate) fn round_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// A read-only view of one buffer's elements.
#[derive(Clone, Copy, Debug)]
pub(crate) enum View<'a> {
    F32(&'a [f32]),
    I32(&'a [i32]),
    /// Stored bf16 bits (kernels see them widened: the backend stages bf16 through f32).
    Bf16(&'a [u16]),
    /// Stored FP8 bits of the format (staged through f32 as bf16 is).
    Fp8(&'a [u8], Fp8Format),
}

/// A writable view of one buffer's elements.
#[derive(Debug)]
pub(crate) enum ViewMut<'a> {
    F32(&'a mut [f32]),
    I32(&'a mut [i32]),
    Bf16(&'a mut [u16]),
    Fp8(&'a mut [u8], Fp8Format),
}

impl<'a> View<'a> {
    /// The first `len` elements of `dtype` in `words`.
    pub(crate) fn of(words: &'a [u32], len: usize, dtype: DType) -> View<'a> {
        match dtype {
            DType::F32 => View::F32(bytemuck::cast_slice(words)),
            DType::I32 => View::I32(bytemuck::cast_slice(words)),
            DType::Bf16 => {
                let halves: &[u16] = bytemuck::cast_slice(words);
                View::Bf16(&halves[..len.min(halves.len())])
            }
            DType::Fp8(format) => {
                let bytes: &[u8] = bytemuck::cast_slice(words);
                View::Fp8(&bytes[..len.min(bytes.len())], format)
            }
        }
    }
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        match *self {
            View::F32(v) => Some(v),
            View::I32(_) | View::Bf16(_) | View::Fp8(..) => None,
        }
    }
    pub fn as_i32(&self) -> Option<&'a [i32]> {
        match *self {
            View::I32(v) => Some(v),
            View::F32(_) | View::Bf16(_) | View::Fp8(..) => None,
        }
    }
    /// The name of the element type, for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            View::F32(_) => "f32",
            View::I32(_) => "i32",
            View::Bf16(_) => "bf16",
            View::Fp8(_, format) => format.name(),
        }
    }
}

impl<'a> ViewMut<'a> {
    fn of(words: &'a mut [u32], len: usize, dtype: DType) -> ViewMut<'a> {
        match dtype {
            DType::F32 => ViewMut::F32(bytemuck::cast_slice_mut(words)),
            DType::I32 => ViewMut::I32(bytemuck::cast_slice_mut(words)),
            DType::Bf16 => {
                let halves: &mut [u16] = bytemuck::cast_slice_mut(words);
                let len = len.min(halves.len());
                ViewMut::Bf16(&mut halves[..len])
            }
            DType::Fp8(format) => {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(words);
                let len = len.min(bytes.len());
                ViewMut::Fp8(&mut bytes[..len], format)
            }
        }
    }
}

pub(super) fn buffer_error(id: BufferId, what: impl Into<String>) -> RuntimeError {
    RuntimeError::Buffer {
        id: id.0,
        what: what.into(),
    }
}

/// Copy `data` into `dst`, the elements of buffer `id`, which must hold as many.
pub(super) fn copy_exact<T: Copy>(id: BufferId, dst: &mut [T], data: &[T]) -> Result<()> {
    if dst.len() != data.len() {
        return Err(length_error(id, dst.len(), data.len()));
    }
    dst.copy_from_slice(data);
    Ok(())
}

fn length_error(id: BufferId, holds: usize, writes: usize) -> RuntimeError {
    buffer_error(id, format!("holds {holds} elements, cannot write {writes}"))
}

/// Every buffer of one rank. See the module docs.
#[derive(Default)]
pub(crate) struct Memory {
    words: Vec<u32>,
    /// Allocated buffers by id.
    slots: Vec<Option<Slot>>,
    /// Planned first word per buffer id (from `prepare`).
    planned: Vec<Option<usize>>,
    /// Words of the planned regions; unplanned buffers go above.
    planned_words: usize,
    /// Per buffer id: the plan places it and says its allocation need not be zero-filled.
    skip_zero: Vec<bool>,
}

/// Number of elements of `shape`, or an error naming `id` when it does not fit in memory.
pub(crate) fn element_count(id: BufferId, shape: &[u64]) -> Result<usize> {
    let too_big = || {
        buffer_error(
            id,
            format!("shape {shape:?} has more elements than this machine can address"),
        )
    };
    let count = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(too_big)?;
    usize::try_from(count).map_err(|_| too_big())
}

/// Words for `bytes` bytes (planned offsets and sizes are multiples of 256 bytes).
fn words(bytes: u64) -> usize {
    (bytes / 4) as usize
}

impl Memory {
    /// Size the storage for `layout` (persistent region first, then the arena) and remember
    /// every buffer's place. Fails if buffers are allocated already or the host is out of memory.
    pub fn prepare(&mut self, program: &Program, layout: &MemoryLayout) -> Result<()> {
        if self.slots.iter().any(Option::is_some) {
            return Err(RuntimeError::Unsupported(
                "the CPU backend was given a memory plan after buffers were allocated".into(),
            ));
        }
        let arena_start = words(layout.persistent_bytes);
        self.planned = (0..program.buffers.len())
            .map(|b| match layout.placement(BufferId(b as u32)) {
                Placement::Persistent(at) => Some(words(at)),
                Placement::Arena(at) => Some(arena_start + words(at)),
                Placement::Unused => None,
            })
            .collect();
        self.planned_words = arena_start + words(layout.arena_bytes);
        self.skip_zero = (0..program.buffers.len())
            .map(|b| {
                let id = BufferId(b as u32);
                layout.placement(id) != Placement::Unused && !layout.needs_zero(id)
            })
            .collect();
        self.words = Vec::new();
        self.grow(self.planned_words)
    }

    /// Words held (planned regions plus any unplanned buffers placed above them).
    pub fn reserved_words(&self) -> usize {
        self.words.len()
    }

    fn grow(&mut self, len: usize) -> Result<()> {
        if len <= self.words.len() {
            return Ok(());
        }
        self.words
            .try_reserve_exact(len - self.words.len())
            .map_err(|_| {
                RuntimeError::Unsupported(format!(
                    "cannot allocate {} bytes of host memory for the CPU backend's buffers; \
                     reduce the micro-batch or shard more",
                    len.saturating_mul(4)
                ))
            })?;
        self.words.resize(len, 0);
        Ok(())
    }

    pub fn slot(&self, id: BufferId) -> Result<Slot> {
        self.slots
            .get(id.0 as usize)
            .copied()
            .flatten()
            .ok_or_else(|| buffer_error(id, "is not allocated"))
    }

    /// Allocated buffers, for the bytes they hold.
    pub fn live(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter().flatten()
    }

    /// Give `id` its `len` elements, zeroed (poisoned where the plan says no zeros are needed):
    /// at its planned offset, else first fit above the planned regions.
    pub fn alloc(&mut self, id: BufferId, len: usize, dtype: DType) -> Result<()> {
        let index = id.0 as usize;
        if self.slots.get(index).is_some_and(Option::is_some) {
            return Err(buffer_error(id, "is already allocated"));
        }
        let elements = len;
        let len = words_for(elements, dtype);
        let offset = match self.planned.get(index).copied().flatten() {
            Some(offset) => {
                if offset + len > self.planned_words {
                    return Err(buffer_error(
                        id,
                        format!("{elements} elements do not fit its planned place (a planner bug)"),
                    ));
                }
                offset
            }
            None => self.first_fit(len),
        };
        self.grow(offset + len)?;
        let fill = match (self.skip_zero.get(index).copied().unwrap_or(false), dtype) {
            (false, _) => 0,
            (true, DType::Bf16) => POISON_BF16,
            (true, DType::Fp8(_)) => POISON_FP8,
            (true, DType::F32 | DType::I32) => POISON,
        };
        self.words[offset..offset + len].fill(fill);
        if self.slots.len() <= index {
            self.slots.resize(index + 1, None);
        }
        self.slots[index] = Some(Slot {
            offset,
            len: elements,
            words: len,
            dtype,
        });
        Ok(())
    }

    /// The lowest word above the planned regions where `len` words are free.
    fn first_fit(&self, len: usize) -> usize {
        let mut taken: Vec<(usize, usize)> = self
            .live()
            .filter(|s| s.offset >= self.planned_words)
            .map(|s| (s.offset, s.offset + s.words))
            .collect();
        taken.sort_unstable();
        let mut at = self.planned_words;
        for (start, end) in taken {
            if start >= at + len.max(1) {
                break;
            }
            at = at.max(end);
        }
        at
    }

    pub fn free(&mut self, id: BufferId) -> Result<()> {
        match self.slots.get_mut(id.0 as usize) {
            Some(slot @ Some(_)) => {
                *slot = None;
                Ok(())
            }
            _ => Err(buffer_error(id, "is not allocated, cannot free it")),
        }
    }

    pub fn view(&self, id: BufferId) -> Result<View<'_>> {
        let s = self.slot(id)?;
        Ok(View::of(
            &self.words[s.offset..s.offset + s.words],
            s.len,
            s.dtype,
        ))
    }

    pub fn view_mut(&mut self, id: BufferId) -> Result<ViewMut<'_>> {
        let s = self.slot(id)?;
        Ok(ViewMut::of(
            &mut self.words[s.offset..s.offset + s.words],
            s.len,
            s.dtype,
        ))
    }

    /// A copy of `id`'s words (for an input that is also the op's output).
    pub fn copy_words(&self, id: BufferId) -> Result<Vec<u32>> {
        let s = self.slot(id)?;
        Ok(self.words[s.offset..s.offset + s.words].to_vec())
    }

    /// The elements of narrow (bf16 or FP8) buffer `id`, widened to f32 (exact).
    pub fn widened(&self, id: BufferId) -> Result<Vec<f32>> {
        match self.view(id)? {
            View::Bf16(bits) => Ok(bits.iter().map(|&b| widen_bf16(b)).collect()),
            View::Fp8(bits, format) => Ok(bits.iter().map(|&b| widen_fp8(b, format)).collect()),
            other => Err(buffer_error(
                id,
                format!("is {}, not bf16 or FP8 (a backend bug)", other.type_name()),
            )),
        }
    }

    /// Store `values` into narrow (bf16 or FP8) buffer `id`, each rounded to its type.
    pub fn store_rounded(&mut self, id: BufferId, values: &[f32]) -> Result<()> {
        match self.view_mut(id)? {
            ViewMut::Bf16(bits) if bits.len() == values.len() => {
                for (b, &v) in bits.iter_mut().zip(values) {
                    *b = round_bf16(v);
                }
                Ok(())
            }
            ViewMut::Fp8(bits, format) if bits.len() == values.len() => {
                for (b, &v) in bits.iter_mut().zip(values) {
                    *b = round_fp8(v, format);
                }
                Ok(())
            }
            ViewMut::Bf16(bits) => Err(length_error(id, bits.len(), values.len())),
            ViewMut::Fp8(bits, _) => Err(length_error(id, bits.len(), values.len())),
            _ => Err(buffer_error(id, "is not bf16 or FP8 (a backend bug)")),
        }
    }

    /// Read-only views of `shared` and writable views of `exclusive`, all at once. `shared` may
    /// repeat an id; `exclusive` ids must be distinct and not in `shared`. Fails if two of the
    /// buffers overlap in memory (a planner or lowering bug).
    pub fn split(
        &mut self,
        shared: &[BufferId],
        exclusive: &[BufferId],
    ) -> Result<(Vec<View<'_>>, Vec<ViewMut<'_>>)> {
        // Distinct buffers, each a word range; shared ones first.
        let mut ids: Vec<BufferId> = Vec::with_capacity(shared.len() + exclusive.len());
        for &id in shared.iter().chain(exclusive) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        let slots = ids
            .iter()
            .map(|&id| self.slot(id))
            .collect::<Result<Vec<_>>>()?;
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_unstable_by_key(|&k| slots[k].offset);
        let mut cut: Vec<Option<&mut [u32]>> = (0..ids.len()).map(|_| None).collect();
        let mut rest: &mut [u32] = &mut self.words;
        let mut base = 0usize;
        for k in order {
            let s = slots[k];
            if s.offset < base {
                return Err(buffer_error(
                    ids[k],
                    "overlaps another buffer of the same op in memory (a memory plan bug)",
                ));
            }
            let tail = std::mem::take(&mut rest);
            let (_, tail) = tail.split_at_mut(s.offset - base);
            let (mine, tail) = tail.split_at_mut(s.words);
            cut[k] = Some(mine);
            rest = tail;
            base = s.offset + s.words;
        }
        let mut views: Vec<(BufferId, Slot, Option<&mut [u32]>)> = ids
            .iter()
            .copied()
            .zip(slots)
            .zip(cut)
            .map(|((id, s), c)| (id, s, c))
            .collect();
        let mut outs = Vec::with_capacity(exclusive.len());
        for &id in exclusive {
            let entry = views.iter_mut().find(|(v, _, _)| *v == id);
            match entry {
                Some((_, s, words @ Some(_))) => {
                    if let Some(w) = words.take() {
                        outs.push(ViewMut::of(w, s.len, s.dtype));
                    }
                }
                _ => return Err(buffer_error(id, "is bound twice to one op")),
            }
        }
        let shared_views: Vec<(BufferId, View<'_>)> = views
            .into_iter()
            .filter_map(|(id, s, w)| {
                w.map(|w| {
                    let w: &[u32] = w;
                    (id, View::of(w, s.len, s.dtype))
                })
            })
            .collect();
        let ins = shared
            .iter()
            .map(|id| {
                shared_views
                    .iter()
                    .find(|(v, _)| v == id)
                    .map(|(_, view)| *view)
                    .ok_or_else(|| buffer_error(*id, "is both an input and an output"))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((ins, outs))
    }
}
