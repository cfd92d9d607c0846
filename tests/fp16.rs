//! fp16 loss scaling on the CPU backend (which computes in f32 with the scaling logic active):
//! a step whose scaled gradients overflow is skipped on every rank (parameters and optimizer
//! state bit-identical to before, Adam's step count not advanced) and the dynamic scale halves
//! per the hysteresis rule, down to `min`; clean steps double it after `window`; a power-of-two
//! scale that does not overflow trains exactly as fp32 does (the test holds it to 1e-5
//! relative; in practice it is bit-identical, since scaling by 2^k commutes with rounding); the
//! skip is reported in `parc run`'s JSON lines and summary.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli_support;
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;

use cli_support::{json_lines, parc_ok, sets, steps};
use fixtures::{spec, train_cpu, PlanChoice, TinyModel};
use parc_compiler::lower::lower;
use parc_compiler::spec::{Checkpointing, LossScale, OnNonFinite, Precision, Spec, ZeroStage};
use parc_runtime::checkpoint::{read_manifest, LossScaleState};
use parc_runtime::exec::{TrainOptions, TrainResult};
use std::path::PathBuf;
use std::time::Duration;

fn tiny(plan: PlanChoice, precision: Precision) -> Spec {
    let mut s = spec(
        TinyModel {
            layers: 2,
            llama: true,
            tied: false,
        },
        plan,
    );
    s.train.precision = precision;
    s
}

fn dynamic(init: f64, window: u32, hysteresis: u32, min: f64) -> Precision {
    Precision::Fp16 {
        loss_scale: LossScale::Dynamic {
            init,
            window,
            hysteresis,
            min,
        },
    }
}

fn run(s: &Spec, stop_after: Option<u64>) -> TrainResult {
    let plan = lower(s).unwrap_or_else(|d| panic!("{:?}", d.items));
    let mut options = TrainOptions::new(".");
    options.comm_timeout = Duration::from_secs(30);
    options.threads_per_rank = Some(1);
    options.stop_after = stop_after;
    train_cpu(s, &plan, &options).unwrap_or_else(|e| panic!("{e}"))
}

fn temp_dir(name: &str) -> PathBuf {
    cli_support::temp_dir("fp16", name)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// A scale of 2^120 makes the squared gradient norm overflow f32: every step is skipped on
/// every rank of a sharded plan (ZeRO-2 shards over dp, two pipeline stages), so the
/// parameters stay the initial ones bit for bit; with hysteresis 2 the scale holds for the
/// first overflow, then halves, and stops at `min`. An overflow at `min` is left to
/// `train.on_nonfinite` (the scale cannot help any more): `skip { max: 1 }` lets the third
/// step be skipped too.
#[test]
fn overflowing_steps_are_skipped_and_the_scale_backs_off() {
    let (init, min) = (2f64.powi(120), 2f64.powi(119));
    let plan = || PlanChoice {
        dp: 2,
        pp: 2,
        zero: ZeroStage::Zero2,
        microbatches: 2,
        ..PlanChoice::default()
    };
    let dir = temp_dir("overflow");
    let mut s = tiny(plan(), dynamic(init, 1000, 2, min));
    s.train.steps = 3;
    s.train.on_nonfinite = OnNonFinite::Skip { max: 1 };
    s.train.checkpoint = Some(Checkpointing {
        every: 3,
        dir: dir.display().to_string(),
        keep: 1,
        asynchronous: true,
    });
    let result = run(&s, None);
    let initial = run(&tiny(plan(), Precision::Fp32), Some(0));
    let scales: Vec<(f64, f64, bool)> = result
        .records
        .iter()
        .map(|r| {
            let l = r.loss_scale.unwrap();
            (l.scale, l.next_scale, l.skipped)
        })
        .collect();
    assert_eq!(
        scales,
        [(init, init, true), (init, min, true), (min, min, true)]
    );
    for r in &result.records {
        assert!(r.loss.is_finite(), "a skipped step still reports its loss");
        assert!(!r.grad_norm.is_finite());
    }
    assert_eq!(initial.params.len(), result.params.len());
    for (a, b) in initial.params.iter().zip(&result.params) {
        assert_eq!(bits(&a.data), bits(&b.data), "{} changed", a.name);
    }
    // Adam counted no update; the checkpoint keeps the scaler.
    let manifest = read_manifest(&result.checkpoints[0]).unwrap();
    assert_eq!(manifest.optimizer_step, 0);
    assert_eq!(
        manifest.loss_scale,
        Some(LossScaleState {
            scale: min,
            good_steps: 0,
            bad_steps: 3,
        })
    );
}

fn max_relative(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let (x, y) = (f64::from(*x), f64::from(*y));
            (x - y).abs() / y.abs().max(1e-12)
        })
        .fold(0.0, f64::max)
}

/// Static 1024 and dynamic (1024, doubling every 2 clean steps) train as fp32 does: losses,
/// gradient norms (reported unscaled) and final parameters within 1e-5 relative, with
/// clipping active (max norm 0.5).
#[test]
fn power_of_two_scaling_trains_as_fp32_does() {
    let plan = || PlanChoice {
        tp: 2,
        ..PlanChoice::default()
    };
    let make = |precision| {
        let mut s = tiny(plan(), precision);
        s.train.grad_clip = Some(0.5);
        s
    };
    let fp32 = run(&make(Precision::Fp32), None);
    let fixed = run(
        &make(Precision::Fp16 {
            loss_scale: LossScale::Static { scale: 1024.0 },
        }),
        None,
    );
    let grown = run(&make(dynamic(1024.0, 2, 2, 1.0)), None);
    let used: Vec<f64> = grown
        .records
        .iter()
        .map(|r| r.loss_scale.unwrap().scale)
        .collect();
    assert_eq!(used, [1024.0, 1024.0, 2048.0, 2048.0, 4096.0]);
    assert!(fixed
        .records
        .iter()
        .all(|r| r.loss_scale.unwrap().scale == 1024.0 && !r.loss_scale.unwrap().skipped));
    let column = |r: &TrainResult, f: fn(&parc_runtime::exec::StepRecord) -> f32| -> Vec<f32> {
        r.records.iter().map(f).collect()
    };
    for (name, run) in [("static", &fixed), ("dynamic", &grown)] {
        let losses = max_relative(&column(run, |r| r.loss), &column(&fp32, |r| r.loss));
        let norms = max_relative(
            &column(run, |r| r.grad_norm),
            &column(&fp32, |r| r.grad_norm),
        );
        let params = run
            .params
            .iter()
            .zip(&fp32.params)
            .map(|(a, b)| max_relative(&a.data, &b.data))
            .fold(0.0, f64::max);
        println!("{name}: loss {losses:.2e}, grad norm {norms:.2e}, params {params:.2e}");
        assert!(losses <= 1e-5 && norms <= 1e-5 && params <= 1e-5, "{name}");
    }
    // Clipping was active, and training moved the loss.
    assert!(fp32.records.iter().any(|r| r.grad_norm > 0.5));
    assert_ne!(fp32.records[0].loss, fp32.records[4].loss);
}

/// Through the binary: skipped steps carry `"skipped": true` and their scale in the JSON lines,
/// and the summary counts them.
#[test]
fn parc_run_logs_skipped_steps_in_json() {
    let mut args = vec![
        "run",
        "examples/tiny.par",
        "--log-format",
        "json",
        "--backend",
        "cpu",
    ];
    args.extend(sets(&[
        "train.steps=2",
        "train.micro_batch=2",
        "train.global_batch=2",
        "train.precision=fp16",
        "train.precision.loss_scale.init=1.329227995784916e36",
        "train.precision.loss_scale.hysteresis=1",
    ]));
    let lines = json_lines(&parc_ok(&args));
    let steps = steps(&lines);
    assert_eq!(steps.len(), 2);
    let init = 2f64.powi(120);
    for (step, scale) in steps.iter().zip([init, init / 2.0]) {
        assert_eq!(step["skipped"], true, "{step}");
        assert_eq!(step["loss_scale"].as_f64(), Some(scale), "{step}");
        assert!(
            step["loss"].is_number() && step["grad_norm"].is_null(),
            "{step}"
        );
    }
    let summary = lines.last().unwrap();
    assert_eq!(summary["event"], "summary");
    assert_eq!(summary["skipped_steps"], 2);
    assert_eq!(summary["loss_scale"].as_f64(), Some(init / 4.0));
}
