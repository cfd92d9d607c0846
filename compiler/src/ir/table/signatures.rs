//! [`Signatures`]: each op's signature built once per pass over a program. A program of
//! hundreds of thousands of instructions holds a few hundred distinct ops (equal ops share one
//! `Arc`: the lowering's op pool), the same in every microbatch, and a signature is several
//! hundred bytes to build; the passes that read one per instruction (the storage pass, the
//! verifier's types and in-place checks, the memory planner's zeroing) read it from here.
use super::{Op, Signature};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::marker::PhantomData;

/// The signatures of the ops a pass has met, by the op's address: every op it is asked about
/// outlives the cache (`'p`), so an address names one op throughout.
#[derive(Default)]
pub struct Signatures<'p> {
    built: HashMap<usize, Signature, BuildHasherDefault<AddressHasher>>,
    ops: PhantomData<&'p Op>,
}

impl<'p> Signatures<'p> {
    pub fn new() -> Signatures<'p> {
        Signatures::default()
    }

    /// `op.signature()`, built on first use.
    pub fn of(&mut self, op: &'p Op) -> &Signature {
        let address = std::ptr::from_ref(op) as usize;
        self.built.entry(address).or_insert_with(|| op.signature())
    }
}

/// Hashing of an address: its bits above the alignment, mixed by one multiplication.
#[derive(Default, Clone, Copy)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = ((n as u64) >> 3).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

#[cfg(test)]
mod tests {
    use super::Signatures;
    use crate::ir::op::Op;
    use std::sync::Arc;

    #[test]
    fn each_op_gets_its_own_signature() {
        let (add, copy) = (Arc::new(Op::Add), Arc::new(Op::Copy));
        let mut signatures = Signatures::new();
        for _ in 0..2 {
            assert_eq!(*signatures.of(&add), add.signature());
            assert_eq!(*signatures.of(&copy), copy.signature());
        }
    }
}
