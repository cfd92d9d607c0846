//! [`Operands`]: the buffer list of one compute instruction (its inputs, or its outputs), stored
//! inline, with room for [`MAX_INPUTS`] inputs and [`MAX_OUTPUTS`] outputs (the most any op in
//! `op` takes; an instruction is 72 bytes). Plans hold millions of compute instructions; a heap
//! `Vec` per list made lowering spend most of its time in the allocator. It reads like a slice (`Deref<Target =
//! [BufferId]>`), so consumers index, iterate and pass it as `&[BufferId]` unchanged.

use super::BufferId;
use serde::{Serialize, Serializer};
use std::ops::Deref;

/// The most inputs an op reads (a quantized FP8 data gradient through SwiGLU's backward: dy,
/// w, gate, up, two amaxes and two quantized operands). An op with more needs this raised;
/// lowering reports it instead of emitting a truncated list.
pub const MAX_INPUTS: usize = 8;
/// The most outputs an op writes (`LayerNormBwd` with bias, `AttentionBwd`: three).
pub const MAX_OUTPUTS: usize = 3;

/// A compute instruction's inputs.
pub type Inputs = Operands<MAX_INPUTS>;
/// A compute instruction's outputs.
pub type Outputs = Operands<MAX_OUTPUTS>;

/// Up to `N` buffers, in the op's documented order.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Operands<const N: usize> {
    len: u8,
    ids: [BufferId; N],
}

impl<const N: usize> Operands<N> {
    /// How many buffers the list can hold.
    pub const CAPACITY: usize = N;

    /// The list `ids`, or `None` if it has more than `N` entries.
    pub fn from_slice(ids: &[BufferId]) -> Option<Operands<N>> {
        if ids.len() > N {
            return None;
        }
        let mut out = Operands {
            len: ids.len() as u8,
            ids: [BufferId(0); N],
        };
        out.ids[..ids.len()].copy_from_slice(ids);
        Some(out)
    }

    /// The buffers numbered `ids` (`BufferId(n)` for each `n`); a list longer than `N` does
    /// not compile.
    pub fn numbered<const K: usize>(ids: &[u32; K]) -> Operands<N> {
        const { assert!(K <= N, "more buffers than the operand list holds") };
        let mut out = Operands {
            len: K as u8,
            ids: [BufferId(0); N],
        };
        for (slot, &id) in out.ids.iter_mut().zip(ids) {
            *slot = BufferId(id);
        }
        out
    }

    /// The same list with every buffer `id` replaced by `to(id)`.
    pub fn map(&self, to: impl Fn(BufferId) -> BufferId) -> Operands<N> {
        let mut out = *self;
        for id in &mut out.ids[..usize::from(self.len)] {
            *id = to(*id);
        }
        out
    }
}

impl<const N: usize> Deref for Operands<N> {
    type Target = [BufferId];
    fn deref(&self) -> &[BufferId] {
        &self.ids[..usize::from(self.len)]
    }
}

impl<'a, const N: usize> IntoIterator for &'a Operands<N> {
    type Item = &'a BufferId;
    type IntoIter = std::slice::Iter<'a, BufferId>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<const N: usize> std::fmt::Debug for Operands<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<const N: usize> Serialize for Operands<N> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_up_to_capacity_in_order() {
        let ids: Vec<BufferId> = (0..MAX_INPUTS as u32).map(BufferId).collect();
        for n in 0..=MAX_INPUTS {
            let ops = Inputs::from_slice(&ids[..n]).unwrap();
            assert_eq!(&*ops, &ids[..n]);
            assert_eq!(format!("{ops:?}"), format!("{:?}", &ids[..n]));
        }
        let too_many: Vec<BufferId> = (0..=MAX_INPUTS as u32).map(BufferId).collect();
        assert!(Inputs::from_slice(&too_many).is_none());
        assert!(Outputs::from_slice(&ids[..4]).is_none());
    }

    #[test]
    fn instructions_stay_small() {
        // Plans hold millions of instructions, two thirds of them `Alloc`/`Free`.
        assert!(std::mem::size_of::<crate::ir::Instr>() <= 72);
    }

    #[test]
    fn serializes_as_a_list() {
        let ops = Outputs::from_slice(&[BufferId(3), BufferId(1)]).unwrap();
        assert_eq!(serde_json::to_string(&ops).unwrap(), "[3,1]");
    }
}
