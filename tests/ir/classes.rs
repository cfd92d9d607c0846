//! Class plans (`LowerOptions::representatives`, what `parc check` analyses) give the full
//! plan's results: for every rank, the verifier's peak, the memory plan and the memory per GPU
//! are equal, and the timeline's step, bubble and exposed communication agree to rounding,
//! over meshes where tp or cp has three or more ranks (with dp, pp, ZeRO, SP, recompute and
//! every schedule), GPT-2 and Llama style, f32 and bf16.

use super::fixtures::{sized_spec, Dims, PlanChoice, TinyModel};
use parc_compiler::diag::Diagnostics;
use parc_compiler::driver::{analyze, Analysis, Stage};
use parc_compiler::ir::Plan;
use parc_compiler::lower::{lower_with, LowerOptions};
use parc_compiler::spec::{PipelineSchedule, Precision, Recompute, Spec, ZeroStage};

fn dims(llama: bool) -> Dims {
    Dims {
        vocab: 64,
        dim: 32,
        seq: 32,
        heads: 8,
        kv_heads: if llama { 4 } else { 8 },
        ffn: 64,
        micro_batch: 2,
    }
}

fn analysed(spec: &Spec, representatives: bool) -> (Plan, Analysis) {
    let options = LowerOptions {
        representatives,
        ..LowerOptions::default()
    };
    let plan = lower_with(spec, options).unwrap_or_else(|d| panic!("{:?}", d.items));
    let mut diags = Diagnostics::default();
    let analysis = analyze(spec, &plan, Stage::Timeline, &mut diags);
    assert!(!diags.has_errors(), "{:?}", diags.items);
    (plan, analysis)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12)
}

/// Every rank's verified peak, memory plan and memory per GPU, and the step's timeline, equal
/// between the full plan of `spec` and its class plan.
fn assert_classes_agree(spec: &Spec, what: &str) {
    let (full, a) = analysed(spec, false);
    let (class, b) = analysed(spec, true);
    assert!(class.representative && !full.representative);
    assert!(
        class.programs.len() < full.programs.len(),
        "{what}: {} class programs for {} roles",
        class.programs.len(),
        full.programs.len()
    );
    let (va, vb) = (a.verified.expect("verified"), b.verified.expect("verified"));
    let (ma, mb) = (a.memory.expect("memory"), b.memory.expect("memory"));
    for r in 0..full.world as usize {
        let (pa, pb) = (
            full.rank_program[r].0 as usize,
            class.rank_program[r].0 as usize,
        );
        let (x, y) = (&va.programs[pa], &vb.programs[pb]);
        assert_eq!(
            (x.instrs, x.persistent_bytes, x.peak_transient_bytes),
            (y.instrs, y.persistent_bytes, y.peak_transient_bytes),
            "{what}: rank {r} liveness"
        );
        let (x, y) = (&ma.programs[pa], &mb.programs[pb]);
        assert_eq!(
            (x.persistent_bytes, x.arena_bytes, x.allocs, x.zeroed_allocs),
            (y.persistent_bytes, y.arena_bytes, y.allocs, y.zeroed_allocs),
            "{what}: rank {r} memory plan"
        );
        let (x, y) = (&ma.device[pa], &mb.device[pb]);
        assert_eq!(
            (x.reserved_bytes, x.total_bytes),
            (y.reserved_bytes, y.total_bytes),
            "{what}: rank {r} memory per GPU"
        );
    }
    let (ta, tb) = (a.timeline.expect("timeline"), b.timeline.expect("timeline"));
    assert!(ta.complete && tb.complete, "{what}: timeline incomplete");
    for (name, x, y) in [
        ("step", ta.step_seconds, tb.step_seconds),
        ("bubble", ta.bubble_fraction, tb.bubble_fraction),
        (
            "exposed",
            ta.exposed_comm_fraction,
            tb.exposed_comm_fraction,
        ),
    ] {
        assert!(close(x, y), "{what}: {name} {x} (full) vs {y} (classes)");
    }
    for rank in &tb.ranks {
        if let Some(same) = ta.ranks.iter().find(|t| t.rank == rank.rank) {
            assert!(
                close(same.busy_seconds, rank.busy_seconds)
                    && close(same.end_seconds, rank.end_seconds),
                "{what}: rank {} busy/end",
                rank.rank
            );
        }
    }
}

fn choice(dp: u32, pp: u32, cp: u32, tp: u32, zero: ZeroStage) -> PlanChoice {
    PlanChoice::mesh(dp, pp, cp, tp, zero)
}

#[test]
fn class_plans_give_the_full_plans_results() {
    let interleaved = PipelineSchedule::Interleaved { virtual_stages: 2 };
    let cases: Vec<(&str, bool, PlanChoice)> = vec![
        ("tp 4", false, choice(1, 1, 1, 4, ZeroStage::Zero0)),
        ("tp 4 llama", true, choice(1, 1, 1, 4, ZeroStage::Zero0)),
        (
            "tp 4 sp selective",
            true,
            PlanChoice {
                sp: true,
                recompute: Recompute::Selective,
                ..choice(1, 1, 1, 4, ZeroStage::Zero0)
            },
        ),
        (
            "dp 2 tp 4 zero 1",
            false,
            choice(2, 1, 1, 4, ZeroStage::Zero1),
        ),
        (
            "dp 2 tp 4 zero 3",
            true,
            choice(2, 1, 1, 4, ZeroStage::Zero3),
        ),
        (
            "pp 2 tp 4 1f1b full",
            false,
            PlanChoice {
                microbatches: 4,
                recompute: Recompute::Full,
                ..choice(1, 2, 1, 4, ZeroStage::Zero0)
            },
        ),
        (
            "pp 2 tp 4 interleaved sp",
            true,
            PlanChoice {
                microbatches: 4,
                schedule: interleaved,
                sp: true,
                ..choice(1, 2, 1, 4, ZeroStage::Zero0)
            },
        ),
        (
            "pp 2 tp 4 gpipe dp 2 zero 2",
            false,
            PlanChoice {
                microbatches: 2,
                schedule: PipelineSchedule::Gpipe,
                ..choice(2, 2, 1, 4, ZeroStage::Zero2)
            },
        ),
        ("cp 4 llama", true, choice(1, 1, 4, 1, ZeroStage::Zero0)),
        (
            "cp 4 tp 2 zero 1",
            true,
            choice(2, 1, 4, 2, ZeroStage::Zero1),
        ),
        ("cp 4 tp 4", true, choice(1, 1, 4, 4, ZeroStage::Zero0)),
    ];
    for (what, llama, plan) in cases {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let model = TinyModel {
                layers: 4,
                llama,
                tied: !llama,
            };
            let mut spec = sized_spec(model, plan.clone(), dims(llama));
            spec.train.precision = precision;
            assert_classes_agree(&spec, &format!("{what} {precision:?}"));
        }
    }
}
