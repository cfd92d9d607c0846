//! The static memory planner: where every buffer of a [`Program`] lives, decided before the
//! first step, so a backend makes one allocation for the persistent buffers and one arena for
//! all transient ones and turns each `Alloc`/`Free` into binding/unbinding a planned offset.
//!
//! - **Persistent buffers** (parameters, optimizer state, metrics) are packed one after the
//!   other in their own region, in buffer order.
//! - **Transient buffers** get arena offsets from their live intervals (`Alloc` to `Free`,
//!   inclusive instruction indices; a buffer allocated again after its `Free` has several).
//!   Placement is greedy by size with best fit (the static planners of TFLite and XLA): largest
//!   buffer first; each goes into the smallest gap between the buffers already placed whose
//!   intervals overlap its own, or above the highest of them. Where that leaves the arena above
//!   the aligned liveness peak, the same best fit in allocation order, then by bytes × lifetime
//!   (largest first), is tried too and the smallest arena kept. A later order stops as soon as
//!   its arena reaches the smallest so far (an arena only grows as buffers are placed, so that
//!   order can no longer win): usually well before its last buffer.
//! - Best fit needs, per buffer, the byte ranges of the placed buffers alive with it. A
//!   placed-buffer index (`placed.rs`), shared by the orders, answers with unions of ranges
//!   kept per block of instructions and per level of blocks above them, so a buffer that
//!   overlaps hundreds of placed ones (activations kept for the backward pass, standing side by
//!   side) costs a few dozen ranges, whatever their number; the gap search then sorts those
//!   ranges, packed into one integer each, and walks them once.
//! - Every offset and every size is a multiple of [`ALIGN`] (256 bytes: cuBLASLt's preferred
//!   operand alignment, and whole cache lines on the host).
//! - [`check_layout`] proves a layout safe: no two buffers alive at the same instruction share a
//!   byte, every buffer lies inside its region. [`plan_program`] runs it on every layout it makes,
//!   so a layout that reaches a backend has been checked.
//!
//! - [`zero_needs`] marks the buffers whose `Alloc` must zero-fill them (read or accumulated
//!   into before being fully written); a backend skips the fill of the others.
//! - [`comm_overlap`] measures how far each collective can run ahead of the compute that waits
//!   for it under the executor's ordering rules (a `Free` of a buffer a queued collective uses
//!   waits for it, since the plan hands its bytes on).
//!
//! - [`backend_scratch`] is what the CUDA backend reserves beside the plan (weight casts, GEMM,
//!   op and aliased-copy scratch), read off the program; the backend allocates it and
//!   [`device_memory`] counts it.
//! - [`device_memory`] predicts what a GPU holds for a rank of a CUDA run beyond the planned
//!   regions (the backend's scratch and weight casts, the CUDA context, NCCL's buffers), line by
//!   line, so `parc check` can predict nvidia-smi's per-GPU figure.
//!
//! The arena can never be smaller than [`MemoryLayout::aligned_peak_bytes`], the most (aligned)
//! transient bytes alive at once; the difference is fragmentation.
mod check;
mod device;
mod intervals;
mod overlap;
mod placed;
mod scratch;
mod shared;
mod sizing;
#[cfg(test)]
pub(crate) mod tests;
mod zeroing;

pub use check::check_layout;
pub use device::{
    device_memory, predicted_reserved, program_device_memory, DeviceLine, DeviceMemory,
};
pub use overlap::{comm_overlap, CommOverlap};
pub use scratch::{
    attention_scratch, backend_scratch, fp8_gemm_scratch, tensor_core_attention, AttentionScratch,
    BackendScratch, Fp8OperandScratch, Fp8ScaleLayout, Fp8Scratch, KernelTarget, OperandFormat,
    CUBLASLT_WORKSPACE_BYTES, MIN_REDUCTION_SCRATCH, REDUCTION_CHUNKS, SUM_SQUARES_BLOCKS,
};
pub use sizing::{arena_bounds, exact_arenas, ArenaBound};
pub use zeroing::zero_needs;

use crate::ir::{BufferId, Instr, Plan, Program, ProgramId};
use crate::verify::{ProgramMemory, VerifyReport};
use placed::PlacedIndex;
use serde::Serialize;
use shared::Memo;
use std::cmp::Reverse;

/// Alignment, in bytes, of every offset and size the planner gives out.
pub const ALIGN: u64 = 256;

/// `bytes` rounded up to a multiple of [`ALIGN`] (at least one [`ALIGN`], so every buffer has
/// an address of its own).
pub fn aligned_size(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(ALIGN).saturating_mul(ALIGN)
}

/// Where one buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "region", content = "offset")]
pub enum Placement {
    /// A transient buffer the program never allocates: it needs no memory.
    Unused,
    /// At this byte offset in the persistent region.
    Persistent(u64),
    /// At this byte offset in the transient arena.
    Arena(u64),
}

/// Every buffer's place and the two regions' sizes, for one program.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryLayout {
    /// Indexed by `BufferId`.
    #[serde(skip)]
    pub placements: Vec<Placement>,
    /// Bytes of the persistent region.
    pub persistent_bytes: u64,
    /// Bytes of the transient arena.
    pub arena_bytes: u64,
    /// The most transient bytes alive at once, each buffer's size rounded up to [`ALIGN`]: the
    /// smallest arena any placement could use.
    pub aligned_peak_bytes: u64,
    /// Indexed by `BufferId`: whether allocating the buffer must zero-fill it ([`zero_needs`]).
    /// A backend may leave the others' bytes as they are.
    #[serde(skip)]
    pub needs_zero: Vec<bool>,
    /// `Alloc` instructions in one step.
    pub allocs: u64,
    /// Those of them whose buffer needs zero-filling.
    pub zeroed_allocs: u64,
    /// How far each collective runs ahead of the compute that waits for it.
    pub comm_overlap: CommOverlap,
}

impl MemoryLayout {
    /// The place of `id` ([`Placement::Unused`] for an id outside the program).
    pub fn placement(&self, id: BufferId) -> Placement {
        self.placements
            .get(id.0 as usize)
            .copied()
            .unwrap_or(Placement::Unused)
    }

    /// Whether allocating `id` must zero-fill it (true for an id outside the program).
    pub fn needs_zero(&self, id: BufferId) -> bool {
        self.needs_zero.get(id.0 as usize).copied().unwrap_or(true)
    }

    /// Persistent region plus arena: all the buffer memory a rank running the program needs.
    pub fn total_bytes(&self) -> u64 {
        self.persistent_bytes + self.arena_bytes
    }
}

/// One program's memory plan beside the verifier's liveness peak, for reports.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanSummary {
    pub program: ProgramId,
    pub persistent_bytes: u64,
    pub arena_bytes: u64,
    /// The verifier's peak of live transient bytes (sizes not rounded).
    pub liveness_peak_bytes: u64,
    /// `arena_bytes` over `liveness_peak_bytes`, minus one (0.05 = the arena is 5% larger).
    pub overhead: f64,
    /// `Alloc` instructions per step, and those that must zero-fill their buffer.
    pub allocs: u64,
    pub zeroed_allocs: u64,
    /// Collectives, those waited for by the very next instruction, and the median run-ahead.
    pub comm_overlap: CommOverlap,
}

/// Plan every program of `plan` and keep only its summary beside its verified liveness peak
/// (`report`), in program order, without holding every program's per-buffer placements at once
/// as [`plan_all`] does (a report needs none of them).
pub fn plan_summaries(
    plan: &Plan,
    report: &VerifyReport,
) -> Result<Vec<PlanSummary>, MemPlanError> {
    let programs: Vec<&Program> = plan.programs.iter().collect();
    let summaries = shared::by_class(&programs, |i, program, t, memo| {
        match report.programs.get(i) {
            Some(memory) => Ok(Some(summary(&plan_with(program, t, memo)?, memory))),
            None => Ok(None),
        }
    })?;
    Ok(summaries.into_iter().flatten().collect())
}

/// One program's layout beside its verified liveness peak.
fn summary(layout: &MemoryLayout, memory: &ProgramMemory) -> PlanSummary {
    PlanSummary {
        program: memory.program,
        persistent_bytes: layout.persistent_bytes,
        arena_bytes: layout.arena_bytes,
        liveness_peak_bytes: memory.peak_transient_bytes,
        overhead: layout.arena_bytes as f64 / memory.peak_transient_bytes.max(1) as f64 - 1.0,
        allocs: layout.allocs,
        zeroed_allocs: layout.zeroed_allocs,
        comm_overlap: layout.comm_overlap.clone(),
    }
}

/// A program whose buffers cannot be planned (it breaks the verifier's buffer invariants), or a
/// layout that fails [`check_layout`] (a planner bug).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("memory plan of program `{role}`: {message}")]
pub struct MemPlanError {
    /// The program's role (`pp 1 cp 0 tp 1`).
    pub role: String,
    pub message: String,
}

/// Plan the memory of one program (see the module docs). Fails, naming the buffer and the
/// instruction, on a program that allocates a live or persistent buffer, frees a dead one, or
/// leaves one alive at the end of the step.
pub fn plan_program(program: &Program) -> Result<MemoryLayout, MemPlanError> {
    plan_with(program, &Transients::of(program)?, &mut Memo::default())
}

/// [`plan_program`] of `program`, whose [`Transients`] are `t`, its placements through `memo`.
fn plan_with(
    program: &Program,
    t: &Transients,
    memo: &mut Memo,
) -> Result<MemoryLayout, MemPlanError> {
    let error = |message: String| MemPlanError {
        role: program.role.clone(),
        message,
    };
    let mut placements = vec![Placement::Unused; program.buffers.len()];
    let mut persistent_bytes = 0u64;
    for (i, buffer) in program.buffers.iter().enumerate() {
        if buffer.kind.is_persistent() {
            placements[i] = Placement::Persistent(persistent_bytes);
            persistent_bytes += aligned_size(buffer.bytes());
        }
    }
    let aligned_peak_bytes = t.aligned_peak;
    let (offsets, arena_bytes) = place_arena(t, memo);
    for b in t.live.buffers() {
        placements[b as usize] = Placement::Arena(offsets[b as usize]);
    }
    let needs_zero = zero_needs(program);
    let (mut allocs, mut zeroed_allocs) = (0u64, 0u64);
    for instr in &program.instrs {
        if let Instr::Alloc { buffer } = instr {
            allocs += 1;
            zeroed_allocs += u64::from(needs_zero.get(buffer.0 as usize).copied().unwrap_or(true));
        }
    }
    let layout = MemoryLayout {
        placements,
        persistent_bytes,
        arena_bytes,
        aligned_peak_bytes,
        needs_zero,
        allocs,
        zeroed_allocs,
        comm_overlap: comm_overlap(program),
    };
    check_layout(program, &layout).map_err(|e| error(format!("planner bug: {e}")))?;
    Ok(layout)
}

/// What placing a program's transient buffers reads: their live intervals, every buffer's
/// size rounded up to [`ALIGN`] (by id) and the aligned liveness peak.
pub(crate) struct Transients {
    live: intervals::LiveIntervals,
    sizes: Vec<u64>,
    aligned_peak: u64,
}

impl Transients {
    /// `program`'s; fails (naming the buffer and the instruction) where it breaks the
    /// verifier's buffer discipline.
    fn of(program: &Program) -> Result<Transients, MemPlanError> {
        let live = intervals::live_intervals(program).map_err(|message| MemPlanError {
            role: program.role.clone(),
            message,
        })?;
        let sizes: Vec<u64> = (program.buffers.iter())
            .map(|b| aligned_size(b.bytes()))
            .collect();
        let aligned_peak = live.aligned_peak(&sizes);
        Ok(Transients {
            live,
            sizes,
            aligned_peak,
        })
    }

    /// Whether every order places `other`'s buffers where it places these: the same buffers,
    /// of the same sizes, allocated and freed in the same order (their intervals then overlap
    /// alike, and best fit reads nothing else of them).
    fn alike(&self, other: &Transients) -> bool {
        self.sizes == other.sizes && self.live.same_events(&other.live)
    }
}

/// Plan every program of `plan`, in program order (programs are planned on all cores).
pub fn plan_all(plan: &Plan) -> Result<Vec<MemoryLayout>, MemPlanError> {
    on_threads(&plan.programs, |_, program| plan_program(program))
}

/// `each(index, item)` of every item of `items`, in order, spread over the machine's cores
/// (each core takes the next item when done with one: the items of a plan cost unlike
/// amounts, the first pipeline stages' most); the first error in order.
fn on_threads<I: Sync, T: Send>(
    items: &[I],
    each: impl Fn(usize, &I) -> Result<T, MemPlanError> + Sync,
) -> Result<Vec<T>, MemPlanError> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, items.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(item) = items.get(i) else {
                return done;
            };
            done.push((i, each(i, item)));
        }
    };
    let mut results: Vec<(usize, Result<T, MemPlanError>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads).map(|_| scope.spawn(work)).collect();
        let mut all = Vec::with_capacity(items.len());
        for h in handles {
            match h.join() {
                Ok(done) => all.extend(done),
                Err(_) => all.push((0, Err(panicked()))),
            }
        }
        all
    });
    results.sort_by_key(|(i, _)| *i);
    if results.len() < items.len() {
        return Err(panicked());
    }
    results.into_iter().map(|(_, r)| r).collect()
}

fn panicked() -> MemPlanError {
    MemPlanError {
        role: "?".into(),
        message: "a planner thread panicked (a planner bug)".into(),
    }
}

/// Every transient buffer's offset (by id) and the arena's size: best fit largest first and,
/// while the arena stays above `aligned_peak` (no order can go below it), in allocation order
/// and by bytes × lifetime too, keeping the smallest arena (the first of equal ones).
fn place_arena(t: &Transients, memo: &mut Memo) -> (Vec<u64>, u64) {
    let first = place_largest_first(t, memo);
    other_orders(t, memo, first)
}

/// Best fit largest buffer first (the first order [`place_arena`] tries).
fn place_largest_first(t: &Transients, memo: &mut Memo) -> (Vec<u64>, u64) {
    let (live, sizes) = (&t.live, &t.sizes);
    let largest = sorted_by(live, |b| (Reverse(sizes[b as usize]), live.first_start(b)));
    memo.place(t, largest, u64::MAX)
}

/// The smallest arena of `first` (offsets and arena) and, while the arena stays above the
/// aligned peak, the orders [`place_arena`] tries after it.
fn other_orders(t: &Transients, memo: &mut Memo, first: (Vec<u64>, u64)) -> (Vec<u64>, u64) {
    let (live, sizes) = (&t.live, &t.sizes);
    let mut best = first;
    if best.1 > t.aligned_peak {
        let in_order = sorted_by(live, |b| (live.first_start(b), Reverse(sizes[b as usize])));
        let placed = memo.place(t, in_order, best.1);
        if placed.1 < best.1 {
            best = placed;
        }
    }
    if best.1 > t.aligned_peak {
        // Largest bytes × lifetime first: long-lived buffers at the bottom, short ones filling
        // the gaps above them.
        let lifetime =
            |b: u32| -> u64 { live.of(b).iter().map(|&(s, e)| u64::from(e - s) + 1).sum() };
        let by_area = sorted_by(live, |b| Reverse(sizes[b as usize] * lifetime(b)));
        let placed = memo.place(t, by_area, best.1);
        if placed.1 < best.1 {
            best = placed;
        }
    }
    best
}

/// The buffers of `live` sorted by `key` (computed once per buffer), then by id.
fn sorted_by<K: Ord>(live: &intervals::LiveIntervals, key: impl Fn(u32) -> K) -> Vec<u32> {
    let mut keyed: Vec<(K, u32)> = live.buffers().map(|b| (key(b), b)).collect();
    keyed.sort_unstable();
    keyed.into_iter().map(|(_, b)| b).collect()
}

/// Best fit in the given order: each buffer of `order` goes into the smallest gap left by the
/// buffers already placed whose intervals overlap its own, else above them. Returns every
/// buffer's offset (by id) and the arena's size; stops early, with an arena of at least `limit`
/// and some buffers unplaced, once the arena reaches `limit` (the caller keeps only a smaller
/// arena). `index` is cleared first: the orderings share its memory.
fn place_transients(
    index: &mut PlacedIndex,
    live: &intervals::LiveIntervals,
    sizes: &[u64],
    order: &[u32],
    limit: u64,
) -> (Vec<u64>, u64) {
    index.clear();
    let mut offsets = vec![0u64; sizes.len()];
    let (mut taken, mut keys) = (Vec::new(), Vec::new());
    let mut arena = 0u64;
    for &b in order {
        taken.clear();
        for &(start, end) in live.of(b) {
            index.query(start, end, &mut taken);
        }
        let size = sizes[b as usize];
        let offset = best_fit(&mut taken, &mut keys, size, arena);
        offsets[b as usize] = offset;
        arena = arena.max(offset + size);
        if arena >= limit {
            break;
        }
        for &(start, end) in live.of(b) {
            index.insert(start, end, offset, offset + size);
        }
    }
    (offsets, arena)
}

/// Where a buffer of `size` bytes goes among `taken`, the byte ranges (in any order, possibly
/// overlapping or repeated) of the placed buffers that overlap it in time, none ending above
/// `arena`: see [`smallest_gap`].
fn best_fit(taken: &mut [(u64, u64)], keys: &mut Vec<u64>, size: u64, arena: u64) -> u64 {
    // Every offset and size is a multiple of ALIGN, so below 2^32 ALIGNs (1 TiB) a range packs
    // into one integer, start in the high half; std sorts short slices of integers without
    // branches (on the 70B example, about twice as fast as sorting the pairs).
    const UNIT: u32 = ALIGN.trailing_zeros();
    if arena >> UNIT <= u64::from(u32::MAX) {
        keys.clear();
        keys.extend(
            taken
                .iter()
                .map(|&(lo, hi)| (lo >> UNIT) << 32 | hi >> UNIT),
        );
        keys.sort_unstable();
        let unpack = |&key: &u64| ((key >> 32) << UNIT, (key & u64::from(u32::MAX)) << UNIT);
        return smallest_gap(keys.iter().map(unpack), size);
    }
    taken.sort_unstable_by_key(|&(lo, _)| lo);
    smallest_gap(taken.iter().copied(), size)
}

/// Over byte ranges sorted by start: the start of the smallest gap between them that holds
/// `size` bytes (the lowest of equal ones), else the end of the highest.
fn smallest_gap(sorted: impl Iterator<Item = (u64, u64)>, size: u64) -> u64 {
    let mut best: Option<(u64, u64)> = None;
    let mut top = 0u64;
    for (start, end) in sorted {
        if start >= top + size {
            let gap = start - top;
            if best.is_none_or(|(g, _)| gap < g) {
                best = Some((gap, top));
            }
        }
        top = top.max(end);
    }
    best.map_or(top, |(_, at)| at)
}
