//! The byte ranges of the buffers placed so far, indexed by time, for the planner's best fit:
//! [`PlacedIndex::query`] lists the bytes taken, at some instruction of an interval, by the
//! placed intervals that overlap it.
//!
//! Instructions are grouped [`FANOUT`] at a time into blocks, blocks [`FANOUT`] at a time into
//! the nodes of the next level, and so on up to a level of one node (tests use other powers of
//! two). A placed interval with byte range `lo..hi` is recorded
//! - at its `Alloc` and at its `Free` instruction, in an array indexed by instruction (an
//!   instruction allocates or frees one buffer at most);
//! - in the *whole* list of each node of its decomposition: the fewest nodes that together
//!   hold exactly the blocks it covers whole (at most `2 × (FANOUT - 1)` per level);
//! - in the *starting* list of the node holding its `Alloc`, at every level.
//!
//! An interval overlaps `[s, e]` exactly when it contains `s` or starts in `(s, e]`. It contains
//! `s` when a node of its decomposition holds `s` (the whole lists of `s`'s node at every
//! level), or else when it starts or ends in `s`'s block (the array, read over that block). It
//! starts in `(s, e]` in a block that `(s, e]` holds in part (the array, read over that part)
//! or whole (the starting lists of the fewest nodes holding those blocks). Ranges may come back
//! twice; the planner only needs their union.
//!
//! Every list is itself a union: sorted byte ranges, overlapping or touching ones merged. The
//! buffers a query meets are mostly long-lived ones standing side by side (activations kept
//! for the backward pass), which the lists give back as a few ranges: a query reads one block
//! of the array and a few lists per level, however many buffers overlap it.
use std::ops::Range;

/// Instructions per block, and nodes of one level per node of the next.
const FANOUT: usize = 1 << 5;

/// A sorted union of byte ranges, overlapping or touching ones merged.
type Ranges = Vec<(u64, u64)>;

/// A placed interval seen from one end: its other end and its bytes; `hi == 0` for none (every
/// placed buffer has at least one byte).
#[derive(Clone, Copy)]
struct End {
    other: u32,
    lo: u64,
    hi: u64,
}

const NONE: End = End {
    other: 0,
    lo: 0,
    hi: 0,
};

/// One level's nodes: node `n` of level `j` holds the `FANOUT^(j+1)` instructions from
/// `n × FANOUT^(j+1)` on.
struct Level {
    /// The bytes of the intervals with this node in their decomposition.
    whole: Vec<Ranges>,
    /// The bytes of the intervals whose `Alloc` this node holds.
    starting: Vec<Ranges>,
}

/// Placed intervals and their byte ranges (see the module docs).
pub(crate) struct PlacedIndex {
    /// log2 of the fanout.
    bits: u32,
    /// Per instruction: the placed interval it allocates or frees.
    ends: Vec<End>,
    /// Blocks first; the last level has one node.
    levels: Vec<Level>,
    /// `(start, end)` of every interval inserted since the last [`PlacedIndex::clear`].
    inserted: Vec<(u32, u32)>,
}

impl PlacedIndex {
    /// An empty index over instructions `0..times`.
    pub fn new(times: u32) -> PlacedIndex {
        PlacedIndex::with_fanout(times, FANOUT)
    }

    /// [`PlacedIndex::new`] with `fanout` (a power of two, at least 2) for [`FANOUT`].
    pub fn with_fanout(times: u32, fanout: usize) -> PlacedIndex {
        let bits = fanout.max(2).ilog2();
        let times = (times.max(1) as usize).next_multiple_of(1 << bits);
        let mut levels = Vec::new();
        let mut nodes = times >> bits;
        loop {
            levels.push(Level {
                whole: vec![Vec::new(); nodes],
                starting: vec![Vec::new(); nodes],
            });
            if nodes == 1 {
                break;
            }
            nodes = nodes.div_ceil(1 << bits);
        }
        PlacedIndex {
            bits,
            ends: vec![NONE; times],
            levels,
            inserted: Vec::new(),
        }
    }

    /// Forget every placed interval (keeping the memory, for the next ordering).
    pub fn clear(&mut self) {
        for &(start, end) in &self.inserted {
            self.ends[start as usize] = NONE;
            self.ends[end as usize] = NONE;
        }
        self.inserted.clear();
        for level in &mut self.levels {
            level.whole.iter_mut().for_each(Vec::clear);
            level.starting.iter_mut().for_each(Vec::clear);
        }
    }

    /// Record a buffer alive over `[start, end]` (`start < end`) at bytes `lo..hi`
    /// (`lo < hi`). No other interval may start or end at `start` or `end`.
    pub fn insert(&mut self, start: u32, end: u32, lo: u64, hi: u64) {
        let (s, e) = (start as usize, end as usize);
        debug_assert!(s < e && lo < hi && self.ends[s].hi == 0 && self.ends[e].hi == 0);
        self.ends[s] = End { other: end, lo, hi };
        self.ends[e] = End {
            other: start,
            lo,
            hi,
        };
        self.inserted.push((start, end));
        let bits = self.bits;
        for (j, level) in (1..).zip(&mut self.levels) {
            unite(&mut level.starting[s >> (bits * j)], lo, hi);
        }
        let blocks = s.div_ceil(1 << bits)..(e + 1) >> bits;
        let levels = &mut self.levels;
        decompose(bits, levels.len(), blocks, |j, n| {
            unite(&mut levels[j].whole[n], lo, hi);
        });
    }

    /// Append to `out` byte ranges whose union is every byte taken, at some instruction of
    /// `[start, end]`, by a placed interval.
    pub fn query(&self, start: u32, end: u32, out: &mut Vec<(u64, u64)>) {
        let (s, e, bits) = (start as usize, end as usize, self.bits);
        for (j, level) in (1..).zip(&self.levels) {
            out.extend_from_slice(&level.whole[s >> (bits * j)]);
        }
        let block = (s >> bits << bits)..((s >> bits) + 1) << bits;
        self.read_ends(block.clone(), s, e, out);
        if e < block.end {
            return;
        }
        let blocks = block.end >> bits..(e + 1) >> bits;
        self.read_ends(blocks.end << bits..e + 1, s, e, out);
        decompose(bits, self.levels.len(), blocks, |j, n| {
            out.extend_from_slice(&self.levels[j].starting[n]);
        });
    }

    /// The intervals starting or ending at an instruction of `at` that overlap `[s, e]`.
    fn read_ends(&self, at: Range<usize>, s: usize, e: usize, out: &mut Ranges) {
        for (t, end) in at.clone().zip(&self.ends[at]) {
            let other = end.other as usize;
            if end.hi != 0 && other.min(t) <= e && other.max(t) >= s {
                out.push((end.lo, end.hi));
            }
        }
    }
}

/// Visit, as `(level, node)`, the fewest nodes that together hold exactly `blocks` (level 0
/// nodes) in a tree of `levels` levels and fanout `1 << bits`.
fn decompose(bits: u32, levels: usize, blocks: Range<usize>, mut visit: impl FnMut(usize, usize)) {
    let mask = (1 << bits) - 1;
    let (mut l, mut r) = (blocks.start, blocks.end);
    for level in 0..levels {
        if level + 1 == levels {
            (l..r).for_each(|n| visit(level, n));
            return;
        }
        while l < r && l & mask != 0 {
            visit(level, l);
            l += 1;
        }
        while l < r && r & mask != 0 {
            r -= 1;
            visit(level, r);
        }
        (l, r) = (l >> bits, r >> bits);
    }
}

/// Add `lo..hi` to the union `list`.
fn unite(list: &mut Ranges, lo: u64, hi: u64) {
    // The first range reaching `lo` and the first one past `hi`: those between merge.
    let first = list.partition_point(|&(_, end)| end < lo);
    let past = first + list[first..].partition_point(|&(start, _)| start <= hi);
    if first == past {
        list.insert(first, (lo, hi));
        return;
    }
    let merged = (list[first].0.min(lo), list[past - 1].1.max(hi));
    list[first] = merged;
    list.drain(first + 1..past);
}
