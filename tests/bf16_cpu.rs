//! bf16 activation storage on the CPU backend, end to end through the executor: a
//! `precision = bf16` run rounds (its losses differ from fp32's) yet tracks fp32's per-step
//! losses within 0.1% (the fixture's data are random, so the loss need not fall), holds less
//! memory, is deterministic for any thread count, and every parallel plan
//! agrees with the single-rank bf16 run within bf16 tolerance (plans round at different points:
//! a tp all-reduce sums rounded partial outputs, so bit equality is not expected). With
//! `bf16 { residual: fp32 }` the run holds more than bf16 and less than fp32, rounds yet tracks
//! fp32 as closely, and pipeline and tensor-parallel plans agree with it.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;

use fixtures::{spec, PlanChoice, TinyModel};
use parc_compiler::lower::lower;
use parc_compiler::spec::{PipelineSchedule, Precision, Recompute, ZeroStage};
use parc_runtime::cpu::CpuBackend;
use parc_runtime::exec::{train, TrainOptions, TrainResult};
use std::time::Duration;

fn model(llama: bool) -> TinyModel {
    TinyModel {
        layers: 2,
        llama,
        tied: !llama,
    }
}

fn run(llama: bool, plan: PlanChoice, precision: Precision, threads: usize) -> TrainResult {
    run_with(llama, plan, precision, false, threads)
}

/// `run`, the residual stream kept f32 where `fp32_residual` (`bf16 { residual: fp32 }`).
fn run_with(
    llama: bool,
    plan: PlanChoice,
    precision: Precision,
    fp32_residual: bool,
    threads: usize,
) -> TrainResult {
    let mut s = spec(model(llama), plan);
    s.train.precision = precision;
    s.train.fp32_residual = fp32_residual;
    let p = lower(&s).unwrap_or_else(|d| panic!("{:?}", d.items));
    let mut options = TrainOptions::new(".");
    options.comm_timeout = Duration::from_secs(30);
    options.threads_per_rank = Some(threads);
    train(
        &s,
        &p,
        &options,
        |_, threads| CpuBackend::with_threads(threads),
        &|_| {},
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn losses(r: &TrainResult) -> Vec<f32> {
    r.records.iter().map(|x| x.loss).collect()
}

/// Asserts every step's loss of `got` within `tol` (relative) of `want`'s, naming `what`;
/// the largest relative difference.
fn assert_losses_within(want: &TrainResult, got: &TrainResult, tol: f32, what: &str) -> f32 {
    let mut largest = 0f32;
    for (a, b) in want.records.iter().zip(&got.records) {
        let rel = (a.loss - b.loss).abs() / a.loss.abs();
        largest = largest.max(rel);
        assert!(
            rel < tol,
            "{what} step {}: {} vs {}",
            a.step,
            b.loss,
            a.loss
        );
    }
    largest
}

#[test]
fn bf16_rounds_tracks_fp32_and_holds_less() {
    for llama in [false, true] {
        let fp32 = run(llama, PlanChoice::default(), Precision::Fp32, 1);
        let bf16 = run(llama, PlanChoice::default(), Precision::Bf16, 1);
        assert_ne!(losses(&fp32), losses(&bf16), "no rounding took place");
        let largest = assert_losses_within(&fp32, &bf16, 1e-3, &format!("llama {llama}"));
        println!("llama {llama}: bf16 vs fp32 loss {largest:.1e} relative at most");
        let (held32, held16) = (fp32.reserved_bytes.unwrap(), bf16.reserved_bytes.unwrap());
        assert!(held16 < held32, "llama {llama}: {held16} bytes !< {held32}");
    }
}

#[test]
fn bf16_is_deterministic_across_thread_counts() {
    let one = run(false, PlanChoice::default(), Precision::Bf16, 1);
    let two = run(false, PlanChoice::default(), Precision::Bf16, 2);
    assert_eq!(losses(&one), losses(&two));
    for (a, b) in one.params.iter().zip(&two.params) {
        assert_eq!(a.data, b.data, "{}", a.name);
    }
}

#[test]
fn parallel_bf16_plans_agree_with_the_single_rank() {
    let plans = || {
        [
            PlanChoice {
                dp: 2,
                zero: ZeroStage::Zero1,
                ..PlanChoice::default()
            },
            PlanChoice {
                tp: 2,
                sp: true,
                ..PlanChoice::default()
            },
            PlanChoice {
                pp: 2,
                schedule: PipelineSchedule::OneFOneB,
                microbatches: 2,
                ..PlanChoice::default()
            },
            PlanChoice {
                cp: 2,
                ..PlanChoice::default()
            },
            PlanChoice {
                dp: 2,
                tp: 2,
                zero: ZeroStage::Zero3,
                recompute: Recompute::Full,
                ..PlanChoice::default()
            },
            PlanChoice {
                pp: 2,
                schedule: PipelineSchedule::Gpipe,
                microbatches: 2,
                recompute: Recompute::Selective,
                ..PlanChoice::default()
            },
        ]
    };
    let names = [
        "dp 2 zero 1",
        "tp 2 sp",
        "pp 2 1f1b",
        "cp 2",
        "dp 2 tp 2 zero 3 full recompute",
        "pp 2 gpipe selective recompute",
    ];
    for llama in [false, true] {
        for (plan, name) in plans().into_iter().zip(names) {
            let (microbatches, dp) = (plan.microbatches, plan.dp);
            let single = run(
                llama,
                PlanChoice {
                    microbatches: microbatches * dp,
                    ..PlanChoice::default()
                },
                Precision::Bf16,
                1,
            );
            let got = run(llama, plan, Precision::Bf16, 1);
            let what = format!("llama {llama} {name} (against the single rank)");
            let largest = assert_losses_within(&single, &got, 1e-3, &what);
            println!("llama {llama} {name}: largest relative loss difference {largest:.1e}");
        }
    }
}

#[test]
fn an_fp32_residual_stream_rounds_elsewhere_tracks_fp32_and_holds_between() {
    for llama in [false, true] {
        let fp32 = run(llama, PlanChoice::default(), Precision::Fp32, 1);
        let bf16 = run(llama, PlanChoice::default(), Precision::Bf16, 1);
        let residual = run_with(llama, PlanChoice::default(), Precision::Bf16, true, 1);
        assert_ne!(
            losses(&residual),
            losses(&bf16),
            "the option changed nothing"
        );
        assert_ne!(losses(&residual), losses(&fp32), "no rounding took place");
        // Not asserted: that it tracks fp32 closer than bf16 does. Over these 5 steps it does
        // for the GPT-2 fixture (summed relative distance 2.8e-5 against 1.2e-4) and not for
        // the Llama one (8.6e-5 against 5.5e-5): per step, the stream's rounding is one of
        // many (issue 19 measured the same on longer runs).
        assert_losses_within(&fp32, &residual, 1e-3, &format!("llama {llama}"));
        let held = |r: &TrainResult| r.reserved_bytes.unwrap();
        assert!(held(&bf16) < held(&residual), "llama {llama}: bytes");
        assert!(held(&residual) < held(&fp32), "llama {llama}: bytes");
    }
}

#[test]
fn fp32_residual_plans_agree_with_the_single_rank() {
    // pp moves the stream between stages (both sides f32), tp with sp reduces and gathers it.
    let plans = [
        (
            "pp 2 1f1b",
            PlanChoice {
                pp: 2,
                schedule: PipelineSchedule::OneFOneB,
                microbatches: 2,
                ..PlanChoice::default()
            },
        ),
        (
            "tp 2 sp",
            PlanChoice {
                tp: 2,
                sp: true,
                ..PlanChoice::default()
            },
        ),
    ];
    for (name, plan) in plans {
        let microbatches = plan.microbatches;
        let single = PlanChoice {
            microbatches,
            ..PlanChoice::default()
        };
        let single = run_with(true, single, Precision::Bf16, true, 1);
        let got = run_with(true, plan, Precision::Bf16, true, 1);
        assert_losses_within(&single, &got, 1e-3, name);
    }
}
