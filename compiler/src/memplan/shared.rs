//! Placements shared by alike programs. A class plan's programs of tp index 0 and 1 of a stage
//! allocate and free the same buffers in the same order (only the gradient norm's instructions
//! differ), so every order of the planner whose buffer order is the same places their buffers
//! alike: such programs are planned one after the other on one thread, and an order already
//! placed for one is not placed again for the next ([`Memo`]).
use super::placed::PlacedIndex;
use super::{on_threads, place_transients, MemPlanError, Transients};
use crate::ir::{Instr, Program};
use std::collections::HashMap;

/// An order's placement: `(offsets by buffer, arena)`.
type Placed = (Vec<u64>, u64);

/// The placements made for alike programs: each order with the limit it ran under.
#[derive(Default)]
pub(super) struct Memo {
    /// Whether to keep placements (not for a program planned alone).
    keep: bool,
    placed: Vec<(Vec<u32>, u64, Placed)>,
    /// The index of the last placement made, over its program's instruction count: the
    /// orders of one program share its memory.
    index: Option<(u32, PlacedIndex)>,
}

impl Memo {
    /// Best fit of `t`'s buffers in `order`, stopping at `limit` (`super::place_transients`),
    /// or the placement kept for the same order and limit of an alike program.
    pub fn place(&mut self, t: &Transients, order: Vec<u32>, limit: u64) -> Placed {
        let kept = (self.placed.iter()).find(|(o, l, _)| *l == limit && *o == order);
        if let Some((_, _, placed)) = kept {
            return placed.clone();
        }
        let times = t.live.times();
        let index = match &mut self.index {
            Some((n, index)) if *n == times => index,
            slot => &mut slot.insert((times, PlacedIndex::new(times))).1,
        };
        let placed = place_transients(index, &t.live, &t.sizes, &order, limit);
        if self.keep {
            self.placed.push((order, limit, placed.clone()));
        }
        placed
    }
}

/// `each(index, program, its transients, memo)` for every program of `programs`, in order, on
/// all cores; programs with the same events (by [`fingerprint`]) in turn on one thread, sharing
/// a memo where their transients are alike. The first error in program order.
pub(super) fn by_class<T: Send>(
    programs: &[&Program],
    each: impl Fn(usize, &Program, &Transients, &mut Memo) -> Result<T, MemPlanError> + Sync,
) -> Result<Vec<T>, MemPlanError> {
    let prints = on_threads(programs, |_, program| Ok(fingerprint(program)))?;
    let mut classes: Vec<Vec<usize>> = Vec::new();
    let mut class_of: HashMap<u64, usize> = HashMap::new();
    for (i, print) in prints.into_iter().enumerate() {
        let class = *class_of.entry(print).or_insert_with(|| {
            classes.push(Vec::new());
            classes.len() - 1
        });
        classes[class].push(i);
    }
    let each = &each;
    let done = on_threads(&classes, |_, class| Ok(plan_class(programs, class, each)))?;
    let mut out: Vec<Option<Result<T, MemPlanError>>> = programs.iter().map(|_| None).collect();
    for (class, results) in classes.iter().zip(done) {
        for (&i, result) in class.iter().zip(results) {
            out[i] = Some(result);
        }
    }
    out.into_iter().flatten().collect()
}

/// `each` of the programs of `class` (indices into `programs`), in turn, alike ones sharing a
/// memo with the first.
fn plan_class<T>(
    programs: &[&Program],
    class: &[usize],
    each: &(impl Fn(usize, &Program, &Transients, &mut Memo) -> Result<T, MemPlanError> + Sync),
) -> Vec<Result<T, MemPlanError>> {
    let mut memo = Memo {
        keep: class.len() > 1,
        ..Memo::default()
    };
    let mut first: Option<Transients> = None;
    let mut out = Vec::with_capacity(class.len());
    for &i in class {
        let Some(program) = programs.get(i) else {
            continue;
        };
        let t = match Transients::of(program) {
            Ok(t) => t,
            Err(e) => {
                out.push(Err(e));
                continue;
            }
        };
        let result = match &first {
            Some(f) if !f.alike(&t) => each(i, program, &t, &mut Memo::default()),
            _ => each(i, program, &t, &mut memo),
        };
        out.push(result);
        first.get_or_insert(t);
    }
    out
}

/// A hash of the program's `Alloc` and `Free` instructions in order, each with its buffer and
/// the buffer's bytes: equal for alike programs (a class is confirmed by [`Transients::alike`]).
/// Multiply-rotate mixing: the words are the compiler's own, and a collision only costs a
/// class its sharing.
fn fingerprint(program: &Program) -> u64 {
    const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;
    let mix = |hash: u64, word: u64| (hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    let mut hash = 0u64;
    for instr in &program.instrs {
        let (buffer, alloc) = match instr {
            Instr::Alloc { buffer } => (buffer, 1),
            Instr::Free { buffer } => (buffer, 0),
            _ => continue,
        };
        let bytes = program.buffer(*buffer).map_or(u64::MAX, |b| b.bytes());
        hash = mix(mix(hash, u64::from(buffer.0) << 1 | alloc), bytes);
    }
    hash
}
