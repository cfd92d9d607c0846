//! The planner on hand-made programs (exact offsets, errors), the checker on broken layouts,
//! and both on lowered plans of many parallel configurations.
use super::*;
use crate::cost::testspec::{build, Dims, Plan as PlanChoice};
use crate::ir::{Buffer, BufferKind, DType, Instr};
use crate::lower::lower;
use crate::spec::{PipelineSchedule, Recompute, ZeroStage};
use std::cmp::Reverse;

/// A program over buffers of `sizes` f32 elements (kind `act`, or `param` where the size is
/// negative) running `instrs`. The zero-fill analysis's tests build theirs with it too.
pub(super) fn program_of(sizes: &[i64], instrs: Vec<Instr>) -> Program {
    let buffers = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| Buffer {
            name: format!("b{i}"),
            shape: vec![s.unsigned_abs()],
            dtype: DType::F32,
            kind: if s < 0 {
                BufferKind::Param
            } else {
                BufferKind::Activation
            },
        })
        .collect();
    Program::new("test", buffers, instrs)
}

/// [`program_of`] with only allocations and frees: `+b` allocates buffer b, `-b` frees it.
fn program(sizes: &[i64], ops: &[i32]) -> Program {
    let instrs = ops
        .iter()
        .map(|&o| {
            let buffer = BufferId(o.unsigned_abs() - 1);
            if o > 0 {
                Instr::Alloc { buffer }
            } else {
                Instr::Free { buffer }
            }
        })
        .collect();
    program_of(sizes, instrs)
}

fn arena_offset(layout: &MemoryLayout, b: u32) -> u64 {
    match layout.placement(BufferId(b)) {
        Placement::Arena(o) => o,
        other => panic!("b{b} is {other:?}"),
    }
}

// Buffer ids in `program`'s ops are 1-based (so `-1` frees buffer 0); offsets below are 0-based.

#[test]
fn buffers_alive_at_different_times_share_bytes() {
    let p = program(&[1024, 1024], &[1, -1, 2, -2]);
    let layout = plan_program(&p).unwrap();
    assert_eq!(arena_offset(&layout, 0), 0);
    assert_eq!(arena_offset(&layout, 1), 0);
    assert_eq!(layout.arena_bytes, 4096);
    assert_eq!(layout.aligned_peak_bytes, 4096);
}

#[test]
fn buffers_alive_together_get_disjoint_aligned_ranges() {
    // 3 floats round up to 256 bytes.
    let p = program(&[3, 1000, 3], &[1, 2, 3, -2, -1, -3]);
    let layout = plan_program(&p).unwrap();
    // Largest first at 0, then the others above it.
    assert_eq!(arena_offset(&layout, 1), 0);
    assert_eq!(arena_offset(&layout, 0), 4096);
    assert_eq!(arena_offset(&layout, 2), 4352);
    assert_eq!(layout.arena_bytes, 4608);
    assert_eq!(layout.arena_bytes, layout.aligned_peak_bytes);
}

#[test]
fn best_fit_takes_the_smallest_gap_that_fits() {
    // b0 (1 KiB) and b1 (4 KiB) die, leaving gaps under the long-lived b2 (4 KiB) and b3 (2 KiB):
    // layout by size: b1 0..4K, b2 4K..8K, b3 8K..10K (b1 overlaps b3? no: see ops), …
    // Lifetimes: b2 and b3 live throughout; b1 lives first, b4 (4 KiB) after b1 dies; b0 (1 KiB)
    // lives with b1. b4 must reuse b1's bytes, b0 must go in a gap, not on top.
    let p = program(
        &[256, 1024, 1024, 512, 1024],
        &[3, 4, 2, 1, -2, -1, 5, -5, -3, -4],
    );
    let layout = plan_program(&p).unwrap();
    assert_eq!(arena_offset(&layout, 4), arena_offset(&layout, 1));
    assert_eq!(layout.arena_bytes, layout.aligned_peak_bytes);
    check_layout(&p, &layout).unwrap();
}

#[test]
fn persistent_buffers_get_their_own_region() {
    let p = program(&[-100, 64, -3], &[2, -2]);
    let layout = plan_program(&p).unwrap();
    assert_eq!(layout.placement(BufferId(0)), Placement::Persistent(0));
    assert_eq!(layout.placement(BufferId(2)), Placement::Persistent(512));
    assert_eq!(layout.persistent_bytes, 768);
    assert_eq!(layout.arena_bytes, 256);
    assert_eq!(layout.total_bytes(), 1024);
}

#[test]
fn a_buffer_allocated_twice_keeps_one_offset_clear_of_both_lifetimes() {
    // b0 lives twice; b1 (bigger, placed first) lives between its lifetimes; b2 overlaps the
    // second one only.
    let p = program(&[64, 128, 64], &[1, -1, 2, -2, 1, 3, -3, -1]);
    let layout = plan_program(&p).unwrap();
    assert_ne!(arena_offset(&layout, 0), arena_offset(&layout, 2));
    check_layout(&p, &layout).unwrap();
}

#[test]
fn unused_transients_take_no_memory() {
    let p = program(&[64, 1 << 20], &[1, -1]);
    let layout = plan_program(&p).unwrap();
    assert_eq!(layout.placement(BufferId(1)), Placement::Unused);
    assert_eq!(layout.arena_bytes, 256);
}

#[test]
fn broken_buffer_discipline_is_an_error_naming_the_buffer() {
    for (ops, says) in [
        (&[1, 1][..], "already alive"),
        (&[-1][..], "not alive"),
        (&[1][..], "still alive at the end"),
        (&[2, -2][..], "persistent"),
        (&[9][..], "the program has 2 buffers"),
    ] {
        let p = program(&[4, -4], ops);
        let err = plan_program(&p).unwrap_err();
        assert!(err.to_string().contains(says), "{ops:?}: {err}");
        assert!(err.to_string().contains("`test`"), "{err}");
    }
}

#[test]
fn the_checker_finds_shared_bytes_misalignment_and_overflow() {
    let p = program(&[64, 64, -64, -64], &[1, 2, -1, -2]);
    let good = plan_program(&p).unwrap();
    check_layout(&p, &good).unwrap();

    let mut shared = good.clone();
    shared.placements[1] = Placement::Arena(arena_offset(&good, 0));
    let err = check_layout(&p, &shared).unwrap_err();
    assert!(err.contains("overlap b0 `b0`"), "{err}");

    let mut odd = good.clone();
    odd.placements[1] = Placement::Arena(128);
    assert!(check_layout(&p, &odd)
        .unwrap_err()
        .contains("multiple of 256"));

    let mut past = good.clone();
    past.placements[1] = Placement::Arena(good.arena_bytes);
    assert!(check_layout(&p, &past)
        .unwrap_err()
        .contains("reaches past the arena"));

    let mut persistent = good.clone();
    persistent.placements[3] = Placement::Persistent(0);
    assert!(check_layout(&p, &persistent)
        .unwrap_err()
        .contains("share bytes"));

    let mut missing = good;
    missing.placements[0] = Placement::Unused;
    assert!(check_layout(&p, &missing)
        .unwrap_err()
        .contains("no arena offset"));
}

fn lowered(dims: &Dims, choice: &PlanChoice) -> crate::ir::Plan {
    match lower(&build(dims, choice)) {
        Ok(p) => p,
        Err(d) => panic!("{choice:?}: {:?}", d.items),
    }
}

/// Plan every program of `choice`, check it, and return the worst arena / aligned peak ratio.
fn plan_and_check(dims: &Dims, choice: &PlanChoice) -> f64 {
    let plan = lowered(dims, choice);
    let report = crate::verify::verify(&plan).unwrap_or_else(|d| panic!("{choice:?}: {d:?}"));
    let layouts = plan_all(&plan).unwrap_or_else(|e| panic!("{choice:?}: {e}"));
    assert_eq!(layouts.len(), plan.programs.len());
    let mut worst = 1.0f64;
    for ((program, layout), memory) in plan.programs.iter().zip(&layouts).zip(&report.programs) {
        check_layout(program, layout).unwrap_or_else(|e| panic!("{choice:?}: {e}"));
        assert!(layout.aligned_peak_bytes >= memory.peak_transient_bytes);
        assert!(layout.arena_bytes >= layout.aligned_peak_bytes);
        assert_eq!(
            layout.persistent_bytes,
            program
                .buffers
                .iter()
                .filter(|b| b.kind.is_persistent())
                .map(|b| aligned_size(b.bytes()))
                .sum::<u64>()
        );
        let ratio = layout.arena_bytes as f64 / layout.aligned_peak_bytes.max(1) as f64;
        worst = worst.max(ratio);
    }
    worst
}

/// Dimensions large enough that the 256-byte rounding of tiny buffers does not dominate.
pub(crate) fn small_model() -> Dims {
    Dims {
        vocab: 512,
        dim: 128,
        seq: 64,
        heads: 4,
        kv_heads: 4,
        ffn: 512,
        layers: 4,
        llama: false,
        tied: true,
    }
}

#[test]
fn lowered_plans_pack_within_a_few_percent_of_their_peak() {
    let choices = [
        PlanChoice::default(),
        PlanChoice {
            dp: 2,
            zero: ZeroStage::Zero3,
            ..PlanChoice::default()
        },
        PlanChoice {
            pp: 2,
            microbatches: 8,
            ..PlanChoice::default()
        },
        PlanChoice {
            pp: 2,
            schedule: PipelineSchedule::Interleaved { virtual_stages: 2 },
            microbatches: 4,
            ..PlanChoice::default()
        },
        PlanChoice {
            tp: 2,
            sp: true,
            recompute: Recompute::Selective,
            ..PlanChoice::default()
        },
        PlanChoice {
            cp: 2,
            recompute: Recompute::Full,
            ..PlanChoice::default()
        },
    ];
    for llama in [false, true] {
        let dims = Dims {
            llama,
            tied: !llama,
            ..small_model()
        };
        for choice in &choices {
            let worst = plan_and_check(&dims, choice);
            // ZeRO-2/3's per-microbatch gradient buffers (allocated and freed once per
            // microbatch) leave the packing 2.2–2.6% above the peak on the ZeRO-3 plan here.
            let bound = if choice.zero >= ZeroStage::Zero2 {
                1.03
            } else {
                1.02
            };
            assert!(
                worst <= bound,
                "{choice:?} llama {llama}: arena {worst:.3}× peak"
            );
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
    /// Every lowered plan gets layouts that pass the checker, with the arena at least the
    /// aligned liveness peak and at most a quarter above it.
    #[test]
    fn every_parallel_config_plans_safely(
        dp in 1u32..3, pp in 1u32..3, cp in 1u32..3, tp in 1u32..3,
        zero in 0usize..4, schedule in 0usize..3, recompute in 0usize..3,
        microbatches in 1u32..5, sp: bool, llama: bool,
    ) {
        let pp_schedule = [
            PipelineSchedule::OneFOneB,
            PipelineSchedule::Gpipe,
            PipelineSchedule::Interleaved { virtual_stages: 2 },
        ][schedule];
        let choice = PlanChoice {
            dp,
            pp,
            cp,
            tp,
            zero: [ZeroStage::Zero0, ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3][zero],
            schedule: pp_schedule,
            microbatches: if matches!(pp_schedule, PipelineSchedule::Interleaved { .. }) {
                pp * microbatches.max(1)
            } else {
                microbatches
            },
            recompute: [Recompute::None, Recompute::Selective, Recompute::Full][recompute].clone(),
            sp: sp && tp > 1,
            ..PlanChoice::default()
        };
        let dims = Dims { llama, tied: !llama, kv_heads: if llama { 2 } else { 4 }, ..Dims::tiny() };
        let worst = plan_and_check(&dims, &choice);
        proptest::prop_assert!(worst <= 1.25, "{:?}: arena {:.3}× peak", choice, worst);
    }
}

/// xorshift64: the random programs' generator.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// A random program of `buffers` transient buffers over about `instrs` allocations and frees:
/// most buffers of up to 10 KiB, one in five up to 1.25 MiB; each allocated zero or more times,
/// living from one instruction to most of the program.
fn random_program(seed: u64, buffers: usize, instrs: usize) -> Program {
    let mut state = seed | 1;
    let mut roll = |below: u64| next_random(&mut state) % below;
    let sizes: Vec<i64> = (0..buffers)
        .map(|_| {
            let most = if roll(5) == 0 { 320_000 } else { 2_560 };
            1 + roll(most) as i64
        })
        .collect();
    let mut alive = vec![false; buffers];
    let mut ops: Vec<i32> = Vec::new();
    while ops.len() < instrs {
        let b = roll(buffers as u64) as usize;
        let id = b as i32 + 1;
        if alive[b] && roll(4) == 0 {
            ops.push(-id);
            alive[b] = false;
        } else if !alive[b] && roll(3) == 0 {
            ops.push(id);
            alive[b] = true;
        }
    }
    for (b, _) in alive.iter().enumerate().filter(|(_, &a)| a) {
        ops.push(-(b as i32 + 1));
    }
    program(&sizes, &ops)
}

/// Best fit without the index, the planner's specification: each buffer of `order` goes to
/// the smallest gap that holds it (the lowest of equal ones) between the placed buffers alive
/// with it at some instruction, else above the highest of them.
fn naive_best_fit(live: &intervals::LiveIntervals, sizes: &[u64], order: &[u32]) -> Vec<u64> {
    let mut offsets = vec![0u64; sizes.len()];
    for (k, &b) in order.iter().enumerate() {
        let meets = |c: u32| {
            let theirs = live.of(c);
            let meet = |&(s, e): &(u32, u32)| theirs.iter().any(|&(t, f)| t <= e && s <= f);
            live.of(b).iter().any(meet)
        };
        let taken: Vec<(u64, u64)> = order[..k]
            .iter()
            .filter(|&&c| meets(c))
            .map(|&c| (offsets[c as usize], offsets[c as usize] + sizes[c as usize]))
            .collect();
        let size = sizes[b as usize];
        let top = taken.iter().map(|&(_, end)| end).max().unwrap_or(0);
        let free = |at: u64| taken.iter().all(|&(s, e)| at < s || at >= e);
        let next_start = |at: u64| taken.iter().map(|&(s, _)| s).filter(|&s| s >= at).min();
        let gaps = std::iter::once(0).chain(taken.iter().map(|&(_, e)| e));
        let best = gaps
            .filter(|&at| at < top && free(at))
            .filter_map(|at| next_start(at).map(|s| (s - at, at)))
            .filter(|&(gap, _)| gap >= size)
            .min();
        offsets[b as usize] = best.map_or(top, |(_, at)| at);
    }
    offsets
}

/// The gap search answers the same on ranges packed into integers (arenas under 1 TiB) and on
/// plain pairs (above), in any order: the smallest gap that fits, else the top.
#[test]
fn best_fit_takes_the_smallest_gap_packed_or_not() {
    let taken = [
        (4096, 8192),
        (0, 1024),
        (1536, 2048),
        (1024, 1280),
        (9216, 9472),
    ];
    for (size, at) in [
        (256, 1280),
        (512, 8192),
        (1024, 8192),
        (2048, 2048),
        (4096, 9472),
    ] {
        let packed = best_fit(&mut taken.clone(), &mut Vec::new(), size, 9472);
        let plain = best_fit(&mut taken.clone(), &mut Vec::new(), size, 1 << 41);
        assert_eq!((packed, plain), (at, at), "{size} bytes");
    }
    let far = [
        (3 << 40, (3 << 40) + 512),
        (0, 256),
        (1 << 41, (1 << 41) + 256),
    ];
    let at = best_fit(&mut far.clone(), &mut Vec::new(), 512, (3 << 40) + 512);
    assert_eq!(at, (1 << 41) + 256);
}

/// An interval over a whole tree of the index sits at its top node and is found from every
/// instruction (its ends also from their blocks); random programs rarely make one.
#[test]
fn the_index_finds_an_interval_over_every_instruction() {
    for fanout in [2, 4, 32] {
        let times = (fanout * fanout) as u32;
        let mut index = PlacedIndex::with_fanout(times, fanout);
        index.insert(0, times - 1, 512, 768);
        for t in 0..times {
            let mut found = Vec::new();
            index.query(t, t, &mut found);
            found.dedup();
            assert_eq!(found, [(512, 768)], "fanout {fanout}, instruction {t}");
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// The placed-buffer index hides nothing from best fit: on random programs (lifetimes up to
    /// thousands of instructions, buffers allocated several times), in the planner's first two
    /// orders and a random one, with each index reused across them (fanouts 2 and 4 for trees
    /// of many levels, and the planner's), every buffer lands where the naive best fit puts it;
    /// a run stopped at a limit reports an arena at least that big.
    #[test]
    fn the_index_places_every_buffer_where_naive_best_fit_does(
        seed: u64, buffers in 1usize..160, instrs in 1usize..3000,
    ) {
        let p = random_program(seed, buffers, instrs);
        let live = intervals::live_intervals(&p).unwrap();
        let sizes: Vec<u64> = p.buffers.iter().map(|b| aligned_size(b.bytes())).collect();
        let mut indexes = [2, 4, 32].map(|fanout| PlacedIndex::with_fanout(live.times(), fanout));
        let mut order: Vec<u32> = live.buffers().collect();
        let mut state = seed | 1;
        for round in 0..3 {
            match round {
                0 => order.sort_by_key(|&b| (Reverse(sizes[b as usize]), live.first_start(b), b)),
                1 => order.sort_by_key(|&b| (live.first_start(b), b)),
                _ => order.sort_by_cached_key(|_| next_random(&mut state)),
            }
            let naive = naive_best_fit(&live, &sizes, &order);
            for index in &mut indexes {
                let (offsets, arena) = place_transients(index, &live, &sizes, &order, u64::MAX);
                for &b in &order {
                    proptest::prop_assert_eq!(offsets[b as usize], naive[b as usize], "b{}", b);
                }
                let limit = arena / 2 + 1;
                let (_, stopped) = place_transients(index, &live, &sizes, &order, limit);
                proptest::prop_assert!(stopped >= limit.min(arena));
            }
        }
    }
}

/// One program of the 70B example's plan (46k transient buffers): prints the planning time
/// (`cargo test --release -p parc-compiler --lib speed -- --ignored --nocapture`).
#[test]
#[ignore]
fn speed_on_llama3_70b() {
    let choice = PlanChoice {
        tp: 8,
        pp: 8,
        schedule: PipelineSchedule::Interleaved { virtual_stages: 5 },
        microbatches: 64,
        micro_batch: 1,
        recompute: Recompute::Full,
        sp: true,
        ..PlanChoice::default()
    };
    let plan = lowered(&Dims::llama3_70b(), &choice);
    let p = &plan.programs[0];
    let allocs = p
        .instrs
        .iter()
        .filter(|i| matches!(i, Instr::Alloc { .. }))
        .count();
    eprintln!(
        "instrs {} buffers {} allocs {allocs}",
        p.instrs.len(),
        p.buffers.len()
    );
    let t = std::time::Instant::now();
    let layout = plan_program(p).unwrap();
    eprintln!(
        "plan_program {:?} arena {} peak {}",
        t.elapsed(),
        layout.arena_bytes,
        layout.aligned_peak_bytes
    );
    let t = std::time::Instant::now();
    check_layout(p, &layout).unwrap();
    eprintln!("check {:?}", t.elapsed());
    assert!(layout.arena_bytes as f64 <= 1.01 * layout.aligned_peak_bytes as f64);
}

/// A class plan's programs of tp index 0 and 1 of a stage of a Llama (no replicated biases)
/// allocate alike (only the gradient norm's instructions differ) and share their placements:
/// each is planned as it is alone.
#[test]
fn alike_programs_share_placements_and_plan_as_they_do_alone() {
    let choice = PlanChoice {
        tp: 2,
        pp: 2,
        dp: 2,
        zero: ZeroStage::Zero1,
        recompute: Recompute::Selective,
        microbatches: 8,
        ..PlanChoice::default()
    };
    let llama = Dims {
        llama: true,
        tied: false,
        ..small_model()
    };
    let spec = build(&llama, &choice);
    let options = crate::lower::LowerOptions {
        representatives: true,
        ..crate::lower::LowerOptions::default()
    };
    let plan = crate::lower::lower_with(&spec, options).unwrap();
    let alone: Vec<Transients> = plan
        .programs
        .iter()
        .map(|p| Transients::of(p).unwrap())
        .collect();
    let roles: Vec<&str> = plan.programs.iter().map(|p| p.role.as_str()).collect();
    assert!(alone[0].alike(&alone[1]), "{roles:?}");
    assert!(!alone[0].alike(&alone[2]), "{roles:?}");
    let report = crate::verify::verify_spec(&plan, &spec).unwrap();
    let shared = plan_summaries(&plan, &report).unwrap();
    for (program, summary) in plan.programs.iter().zip(&shared) {
        let layout = plan_program(program).unwrap();
        assert_eq!(summary.arena_bytes, layout.arena_bytes, "{}", program.role);
    }
    let programs: Vec<&Program> = plan.programs.iter().collect();
    let bounds = arena_bounds(&plan.programs).unwrap();
    let exact = exact_arenas(&programs.iter().copied().zip(bounds).collect::<Vec<_>>()).unwrap();
    let planned: Vec<u64> = shared.iter().map(|s| s.arena_bytes).collect();
    assert_eq!(exact, planned);
}
