//! A program's arena size without its layout, bounded before it is computed in full. The
//! planner keeps the smallest arena of its orders and tries the others only while the first
//! (largest buffer first) stays above the aligned liveness peak, so the first order's arena
//! bounds the planned arena from above, and equals it when it reaches that peak. The memory
//! verdict's help needs only a plan's largest need (`crate::fit::largest_need`): it bounds every
//! program this way and runs the other orders ([`exact_arenas`]) only for the programs whose
//! bound could still be the largest. Alike programs share their placements (`shared`).
use super::shared::{by_class, Memo};
use super::{aligned_size, other_orders, place_largest_first, MemPlanError, Transients};
use crate::ir::Program;

/// A program's arena as the planner's first order places it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaBound {
    /// The persistent region's bytes, as [`super::plan_program`] packs it.
    pub persistent_bytes: u64,
    /// The first order's arena: at least [`super::plan_program`]'s.
    pub upper_bytes: u64,
    /// Whether `upper_bytes` is the planned arena (it is the aligned liveness peak, below which
    /// no order goes, so the planner tries no other).
    pub exact: bool,
}

/// Each program's [`ArenaBound`], in order (programs are bounded on all cores).
pub fn arena_bounds(programs: &[Program]) -> Result<Vec<ArenaBound>, MemPlanError> {
    let programs: Vec<&Program> = programs.iter().collect();
    by_class(&programs, |_, program, t, memo| {
        Ok(arena_bound(program, t, memo))
    })
}

/// The arena [`super::plan_program`] gives each program of `programs`, beside its
/// [`ArenaBound`], in order (on all cores); no layout is kept or checked.
pub fn exact_arenas(programs: &[(&Program, ArenaBound)]) -> Result<Vec<u64>, MemPlanError> {
    let only: Vec<&Program> = programs.iter().map(|(p, _)| *p).collect();
    by_class(&only, |i, _, t, memo| {
        let bound = programs.get(i).map(|(_, b)| *b);
        Ok(bound.map_or(0, |bound| exact_arena(t, memo, bound)))
    })
}

fn arena_bound(program: &Program, t: &Transients, memo: &mut Memo) -> ArenaBound {
    let (_, upper_bytes) = place_largest_first(t, memo);
    let persistent_bytes = (program.buffers.iter())
        .filter(|b| b.kind.is_persistent())
        .map(|b| aligned_size(b.bytes()))
        .sum();
    ArenaBound {
        persistent_bytes,
        upper_bytes,
        exact: upper_bytes <= t.aligned_peak,
    }
}

fn exact_arena(t: &Transients, memo: &mut Memo, bound: ArenaBound) -> u64 {
    if bound.exact {
        return bound.upper_bytes;
    }
    let (_, arena) = other_orders(t, memo, (Vec::new(), bound.upper_bytes));
    arena
}
