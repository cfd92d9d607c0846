//! Live intervals of a program's transient buffers, from its `Alloc`/`Free` instructions.
use crate::ir::{Instr, Program};

/// Every transient buffer's live intervals: `(alloc, free)` instruction indices, inclusive.
pub(crate) struct LiveIntervals {
    /// Grouped by buffer, each buffer's intervals in program order.
    intervals: Vec<(u32, u32)>,
    /// Per buffer: its range in `intervals` (empty for buffers never allocated).
    ranges: Vec<(u32, u32)>,
    /// The instruction count (times run from 0 to `instrs - 1`).
    instrs: u32,
    /// `(buffer, is_alloc)` for every `Alloc` and `Free`, in program order (for the peak).
    events: Vec<(u32, bool)>,
}

/// Collect the live intervals of `program`'s transient buffers. Fails (naming the buffer and
/// the instruction) where the program breaks the verifier's buffer discipline.
pub(crate) fn live_intervals(program: &Program) -> Result<LiveIntervals, String> {
    let n = program.buffers.len();
    let instrs = u32::try_from(program.instrs.len())
        .map_err(|_| format!("{} instructions are too many", program.instrs.len()))?;
    let name = |b: usize| {
        program
            .buffers
            .get(b)
            .map_or_else(|| format!("b{b}"), |x| format!("b{b} `{}`", x.name))
    };
    // Per buffer: the instruction of its open Alloc, if alive.
    let mut open: Vec<Option<u32>> = vec![None; n];
    let mut pairs: Vec<(u32, u32, u32)> = Vec::new();
    let mut events = Vec::new();
    for (i, instr) in program.instrs.iter().enumerate() {
        let (buffer, is_alloc) = match instr {
            Instr::Alloc { buffer } => (buffer.0 as usize, true),
            Instr::Free { buffer } => (buffer.0 as usize, false),
            _ => continue,
        };
        let what = if is_alloc { "allocates" } else { "frees" };
        let Some(b) = program.buffers.get(buffer) else {
            return Err(format!(
                "instruction {i} {what} b{buffer}, but the program has {n} buffers"
            ));
        };
        if b.kind.is_persistent() {
            return Err(format!(
                "instruction {i} {what} the persistent buffer {}",
                name(buffer)
            ));
        }
        match (is_alloc, open[buffer]) {
            (true, None) => open[buffer] = Some(i as u32),
            (false, Some(start)) => {
                open[buffer] = None;
                pairs.push((buffer as u32, start, i as u32));
            }
            (true, Some(_)) => {
                return Err(format!(
                    "instruction {i} allocates {} which is already alive",
                    name(buffer)
                ))
            }
            (false, None) => {
                return Err(format!(
                    "instruction {i} frees {} which is not alive",
                    name(buffer)
                ))
            }
        }
        events.push((buffer as u32, is_alloc));
    }
    if let Some(b) = open.iter().position(Option::is_some) {
        return Err(format!("{} is still alive at the end of the step", name(b)));
    }
    // Group by buffer, keeping program order within a buffer.
    pairs.sort_by_key(|&(b, start, _)| (b, start));
    let mut ranges = vec![(0u32, 0u32); n];
    let mut intervals = Vec::with_capacity(pairs.len());
    for (k, &(b, start, end)) in pairs.iter().enumerate() {
        let range = &mut ranges[b as usize];
        if range.1 == range.0 {
            *range = (k as u32, k as u32);
        }
        range.1 = k as u32 + 1;
        intervals.push((start, end));
    }
    Ok(LiveIntervals {
        intervals,
        ranges,
        instrs,
        events,
    })
}

impl LiveIntervals {
    /// Buffers with at least one interval, ascending.
    pub fn buffers(&self) -> impl Iterator<Item = u32> + '_ {
        self.ranges
            .iter()
            .enumerate()
            .filter(|(_, r)| r.1 > r.0)
            .map(|(b, _)| b as u32)
    }

    /// The intervals of `buffer` as `(alloc, free)`, in program order.
    pub fn of(&self, buffer: u32) -> &[(u32, u32)] {
        let (lo, hi) = self.ranges.get(buffer as usize).copied().unwrap_or((0, 0));
        &self.intervals[lo as usize..hi as usize]
    }

    /// The instruction of the buffer's first `Alloc` (`u32::MAX` for none).
    pub fn first_start(&self, buffer: u32) -> u32 {
        self.of(buffer)
            .first()
            .map_or(u32::MAX, |&(start, _)| start)
    }

    /// The number of instructions (the time axis' length).
    pub fn times(&self) -> u32 {
        self.instrs
    }

    /// Whether `other` allocates and frees the same buffers in the same order.
    pub fn same_events(&self, other: &LiveIntervals) -> bool {
        self.events == other.events
    }

    /// The most bytes alive at once when buffer `b` takes `sizes[b]` bytes.
    pub fn aligned_peak(&self, sizes: &[u64]) -> u64 {
        let (mut live, mut peak) = (0u64, 0u64);
        for &(b, alloc) in &self.events {
            let size = sizes.get(b as usize).copied().unwrap_or(0);
            if alloc {
                live += size;
                peak = peak.max(live);
            } else {
                live -= size;
            }
        }
        peak
    }
}
