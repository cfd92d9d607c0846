//! [`Operands`]: the buffer list of one compute instruction (its inputs, or its outputs), stored
//! inline. Plans hold millions of compute instructions; a heap `Vec` per list made lowering
//! spend most of its time in the allocator. It reads like a slice (`Deref<Target =
//! [BufferId]>`), so consumers index, iterate and pass it as `&[BufferId]` unchanged.

use super::BufferId;
use serde::{Serialize, Serializer};
use std::ops::Deref;

/// Up to [`Operands::CAPACITY`] buffers, in the op's documented order.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Operands {
    len: u8,
    ids: [BufferId; Operands::CAPACITY],
}

impl Operands {
    /// The most buffers one side of an op takes (`AttentionBwd` reads six). An op with more
    /// needs this raised; lowering reports it instead of emitting a truncated list.
    pub const CAPACITY: usize = 6;

    /// The list `ids`, or `None` if it has more than [`Operands::CAPACITY`] entries.
    pub fn from_slice(ids: &[BufferId]) -> Option<Operands> {
        if ids.len() > Self::CAPACITY {
            return None;
        }
        let mut out = Operands {
            len: ids.len() as u8,
            ids: [BufferId(0); Self::CAPACITY],
        };
        out.ids[..ids.len()].copy_from_slice(ids);
        Some(out)
    }
}

impl Deref for Operands {
    type Target = [BufferId];
    fn deref(&self) -> &[BufferId] {
        &self.ids[..usize::from(self.len)]
    }
}

impl<'a> IntoIterator for &'a Operands {
    type Item = &'a BufferId;
    type IntoIter = std::slice::Iter<'a, BufferId>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl std::fmt::Debug for Operands {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Serialize for Operands {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_up_to_capacity_in_order() {
        let ids: Vec<BufferId> = (0..6).map(BufferId).collect();
        for n in 0..=Operands::CAPACITY {
            let ops = Operands::from_slice(&ids[..n]).unwrap();
            assert_eq!(&*ops, &ids[..n]);
            assert_eq!(format!("{ops:?}"), format!("{:?}", &ids[..n]));
        }
        let seven: Vec<BufferId> = (0..7).map(BufferId).collect();
        assert!(Operands::from_slice(&seven).is_none());
    }

    #[test]
    fn serializes_as_a_list() {
        let ops = Operands::from_slice(&[BufferId(3), BufferId(1)]).unwrap();
        assert_eq!(serde_json::to_string(&ops).unwrap(), "[3,1]");
    }
}
