//! [`IdMap`]: a hash map for the lowering's small integer keys (value, node and parameter ids,
//! tuples of them). Lowering does a few lookups per emitted instruction, millions per plan;
//! the standard SipHash (built to resist adversarial keys) was a visible share of its time, and
//! these keys come from the compiler itself, not from input.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` keyed by compiler-made ids, with [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Multiply-rotate hashing of integer words (the scheme rustc uses for its own id maps).
#[derive(Default, Clone, Copy)]
pub struct IdHasher {
    hash: u64,
}

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl IdHasher {
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.hash
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }
    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::IdMap;

    #[test]
    fn tuple_keys_that_differ_anywhere_stay_apart() {
        let mut map: IdMap<(u32, u32, bool), usize> = IdMap::default();
        let mut n = 0;
        for a in 0..20 {
            for b in 0..20 {
                for c in [false, true] {
                    map.insert((a, b, c), n);
                    n += 1;
                }
            }
        }
        assert_eq!(map.len(), 800);
        assert_eq!(map.get(&(3, 7, true)), Some(&(3 * 40 + 7 * 2 + 1)));
        assert_eq!(map.get(&(20, 0, false)), None);
    }
}
