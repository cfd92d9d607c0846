//! A program's arena size without its layout, bounded before it is computed in full. The
//! planner keeps the smallest arena of its orders and tries the others only while the first
//! (largest buffer first) stays above the aligned liveness peak, so the first order's arena
//! bounds the planned arena from above, and equals it when it reaches that peak. The memory
//! verdict's help needs only a plan's largest need (`crate::fit::largest_need`): it bounds every
//! program this way and runs the other orders ([`exact_arenas`]) only for the programs whose
//! bound could still be the largest.
use super::placed::PlacedIndex;
use super::{
    aligned_size, aligned_sizes, intervals, on_threads, other_orders, place_largest_first,
    MemPlanError,
};
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
    on_threads(programs, |_, program| arena_bound(program))
}

/// The arena [`super::plan_program`] gives each program of `programs`, beside its
/// [`ArenaBound`], in order (on all cores); no layout is kept or checked.
pub fn exact_arenas(programs: &[(&Program, ArenaBound)]) -> Result<Vec<u64>, MemPlanError> {
    on_threads(programs, |_, (program, bound)| exact_arena(program, *bound))
}

fn arena_bound(program: &Program) -> Result<ArenaBound, MemPlanError> {
    let (live, sizes, aligned_peak) = transients(program)?;
    let mut index = PlacedIndex::new(live.times());
    let (_, upper_bytes) = place_largest_first(&mut index, &live, &sizes);
    let persistent_bytes = (program.buffers.iter())
        .filter(|b| b.kind.is_persistent())
        .map(|b| aligned_size(b.bytes()))
        .sum();
    Ok(ArenaBound {
        persistent_bytes,
        upper_bytes,
        exact: upper_bytes <= aligned_peak,
    })
}

fn exact_arena(program: &Program, bound: ArenaBound) -> Result<u64, MemPlanError> {
    if bound.exact {
        return Ok(bound.upper_bytes);
    }
    let (live, sizes, aligned_peak) = transients(program)?;
    let mut index = PlacedIndex::new(live.times());
    let first = (Vec::new(), bound.upper_bytes);
    let (_, arena) = other_orders(&mut index, (&live, &sizes), aligned_peak, first);
    Ok(arena)
}

/// The program's live intervals, aligned buffer sizes and aligned liveness peak.
fn transients(
    program: &Program,
) -> Result<(intervals::LiveIntervals, Vec<u64>, u64), MemPlanError> {
    let live = intervals::live_intervals(program).map_err(|message| MemPlanError {
        role: program.role.clone(),
        message,
    })?;
    let sizes = aligned_sizes(program);
    let aligned_peak = live.aligned_peak(&sizes);
    Ok((live, sizes, aligned_peak))
}
