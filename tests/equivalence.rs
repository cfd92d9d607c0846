//! End-to-end equivalence through the real executor (`parc_runtime::exec::train`: one thread
//! per rank, local comm, CPU backend, sampler): every parallel plan of a tiny model gives the
//! single-rank run's per-step losses (1e-5 relative, 5 steps) and final parameters (1e-5).
//! CI runs the sample below; `bench/equivalence.sh` runs the whole matrix
//! (`PARC_EQUIVALENCE=full`).
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;

use fixtures::{spec, PlanChoice, TinyModel};
use parc_compiler::diag::Sources;
use parc_compiler::lower::lower;
use parc_compiler::spec::{PipelineSchedule, Recompute, Spec, ZeroStage};
use parc_compiler::{check, parse_override};
use parc_runtime::cpu::CpuBackend;
use parc_runtime::exec::{train, TrainOptions, TrainResult};
use std::time::Duration;

fn model(llama: bool) -> TinyModel {
    TinyModel {
        layers: 4,
        llama,
        tied: !llama,
    }
}

fn run(llama: bool, plan: PlanChoice) -> TrainResult {
    let s = spec(model(llama), plan);
    let p = lower(&s).unwrap_or_else(|d| panic!("{:?}", d.items));
    let mut options = TrainOptions::new(".");
    options.comm_timeout = Duration::from_secs(30);
    options.threads_per_rank = Some(1);
    train(
        &s,
        &p,
        &options,
        |_, threads| CpuBackend::with_threads(threads),
        &|_| {},
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn describe(llama: bool, p: &PlanChoice) -> String {
    format!(
        "{} dp {} pp {} cp {} tp {} zero {:?} {:?} m {} {:?} sp {}",
        if llama { "llama" } else { "gpt" },
        p.dp,
        p.pp,
        p.cp,
        p.tp,
        p.zero,
        p.schedule,
        p.microbatches,
        p.recompute,
        p.sp
    )
}

/// The single-rank run with the same global batch as `plan`.
fn single_rank_of(llama: bool, plan: &PlanChoice) -> TrainResult {
    run(
        llama,
        PlanChoice {
            microbatches: plan.microbatches * plan.dp,
            ..PlanChoice::default()
        },
    )
}

fn assert_equivalent(llama: bool, plan: PlanChoice) {
    let single = single_rank_of(llama, &plan);
    assert_matches(&single, llama, plan);
}

fn assert_matches(single: &TrainResult, llama: bool, plan: PlanChoice) {
    let desc = describe(llama, &plan);
    let got = run(llama, plan);
    assert_eq!(got.records.len(), 5, "{desc}");
    assert_eq!(single.params.len(), got.params.len(), "{desc}");
    assert!(!single.params.is_empty());
    // Training moved the loss, so equal losses are not equal constants.
    assert_ne!(single.records[0].loss, single.records[4].loss);
    for (a, b) in single.records.iter().zip(&got.records) {
        let rel = (a.loss - b.loss).abs() / a.loss.abs().max(1e-12);
        assert!(
            rel < 1e-5,
            "{desc}: step {} loss {} vs single rank {} (rel {rel:e})",
            a.step,
            b.loss,
            a.loss
        );
    }
    for (a, b) in single.params.iter().zip(&got.params) {
        assert_eq!((&a.name, &a.shape), (&b.name, &b.shape), "{desc}");
        for (i, (x, y)) in a.data.iter().zip(&b.data).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                "{desc}: {}[{i}] = {y} vs single rank {x}",
                a.name
            );
        }
    }
}

#[test]
fn data_parallel_with_each_zero_stage() {
    for zero in [
        ZeroStage::Zero0,
        ZeroStage::Zero1,
        ZeroStage::Zero2,
        ZeroStage::Zero3,
    ] {
        assert_equivalent(
            false,
            PlanChoice {
                dp: 2,
                zero,
                ..PlanChoice::default()
            },
        );
    }
}

#[test]
fn tensor_parallel_with_and_without_sequence_parallelism() {
    for sp in [false, true] {
        assert_equivalent(
            true,
            PlanChoice {
                tp: 2,
                sp,
                ..PlanChoice::default()
            },
        );
    }
}

#[test]
fn pipeline_schedules() {
    for schedule in [
        PipelineSchedule::Gpipe,
        PipelineSchedule::OneFOneB,
        PipelineSchedule::Interleaved { virtual_stages: 2 },
    ] {
        assert_equivalent(
            false,
            PlanChoice {
                pp: 2,
                schedule,
                microbatches: 4,
                ..PlanChoice::default()
            },
        );
    }
}

#[test]
fn context_parallel_and_recompute() {
    assert_equivalent(
        true,
        PlanChoice {
            cp: 2,
            recompute: Recompute::Full,
            ..PlanChoice::default()
        },
    );
}

#[test]
fn all_axes_at_once() {
    assert_equivalent(
        true,
        PlanChoice {
            dp: 2,
            pp: 2,
            cp: 2,
            tp: 2,
            zero: ZeroStage::Zero1,
            microbatches: 2,
            recompute: Recompute::Selective,
            sp: true,
            ..PlanChoice::default()
        },
    );
}

/// Every plan of the matrix: dp, pp, cp, tp ∈ {1, 2}, ZeRO 0–3 (where dp·cp > 1), GPipe / 1F1B
/// / interleaved (where pp > 1), recompute none / selective / full, sequence parallel on/off
/// (where tp > 1), for both tiny models. Minutes of CPU: run by `bench/equivalence.sh`.
fn full_matrix() -> Vec<(bool, PlanChoice)> {
    let mut plans = Vec::new();
    let two = [1u32, 2];
    for llama in [false, true] {
        for dp in two {
            for pp in two {
                for cp in two {
                    for tp in two {
                        let zeros: &[ZeroStage] = if dp * cp > 1 {
                            &[
                                ZeroStage::Zero0,
                                ZeroStage::Zero1,
                                ZeroStage::Zero2,
                                ZeroStage::Zero3,
                            ]
                        } else {
                            &[ZeroStage::Zero0]
                        };
                        let schedules: &[PipelineSchedule] = if pp > 1 {
                            &[
                                PipelineSchedule::Gpipe,
                                PipelineSchedule::OneFOneB,
                                PipelineSchedule::Interleaved { virtual_stages: 2 },
                            ]
                        } else {
                            &[PipelineSchedule::OneFOneB]
                        };
                        let sps: &[bool] = if tp > 1 { &[false, true] } else { &[false] };
                        for &zero in zeros {
                            for &schedule in schedules {
                                for recompute in
                                    [Recompute::None, Recompute::Selective, Recompute::Full]
                                {
                                    for &sp in sps {
                                        plans.push((
                                            llama,
                                            PlanChoice {
                                                dp,
                                                pp,
                                                cp,
                                                tp,
                                                zero,
                                                schedule,
                                                microbatches: 2 * pp,
                                                recompute: recompute.clone(),
                                                sp,
                                            },
                                        ));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    plans
}

#[test]
fn full_matrix_when_asked() {
    if std::env::var("PARC_EQUIVALENCE").as_deref() != Ok("full") {
        println!("skipped: set PARC_EQUIVALENCE=full (bench/equivalence.sh) for the whole matrix");
        return;
    }
    let plans = full_matrix();
    let total = plans.len();
    let mut failures = Vec::new();
    let mut references = std::collections::HashMap::new();
    for (i, (llama, plan)) in plans.into_iter().enumerate() {
        let desc = describe(llama, &plan);
        let key = (llama, plan.microbatches * plan.dp);
        let single = references
            .entry(key)
            .or_insert_with(|| single_rank_of(llama, &plan));
        let outcome = std::panic::catch_unwind(|| assert_matches(single, llama, plan));
        match outcome {
            Ok(()) => println!("[{}/{total}] ok   {desc}", i + 1),
            Err(e) => {
                let why = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                println!("[{}/{total}] FAIL {desc}: {why}", i + 1);
                failures.push(desc);
            }
        }
    }
    println!(
        "{} passed, {} failed",
        total - failures.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "failed plans: {failures:#?}");
}

/// The bundled examples themselves (shrunk by `--set` to keep CI fast), on their real data.
fn example(file: &str, sets: &[&str]) -> Spec {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join(file)).unwrap();
    let mut sources = Sources::default();
    let main = sources.add(file, text);
    let shrink = [
        "model.seq=16",
        "model.d=32",
        "model.ffn=64",
        "train.steps=5",
    ];
    let overrides: Vec<_> = shrink
        .iter()
        .chain(sets)
        .map(|s| parse_override(s).unwrap())
        .collect();
    let (spec, diags) = check(&mut sources, main, &overrides);
    spec.unwrap_or_else(|| panic!("{file} {sets:?}: {:?}", diags.items))
}

fn run_example(spec: &Spec) -> TrainResult {
    let plan = lower(spec).unwrap_or_else(|d| panic!("{:?}", d.items));
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut options = TrainOptions::new(root.join("examples"));
    options.comm_timeout = Duration::from_secs(60);
    options.threads_per_rank = Some(1);
    train(
        spec,
        &plan,
        &options,
        |_, t| CpuBackend::with_threads(t),
        &|_| {},
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn assert_example_equivalent(file: &str, plan: &[&str]) {
    let single = run_example(&example(file, &[]));
    let got = run_example(&example(file, plan));
    assert_eq!(got.records.len(), 5);
    assert_ne!(single.records[0].loss, single.records[4].loss);
    for (a, b) in single.records.iter().zip(&got.records) {
        let rel = (a.loss - b.loss).abs() / a.loss.abs();
        assert!(
            rel < 1e-5,
            "{file} {plan:?} step {}: {} vs {}",
            a.step,
            b.loss,
            a.loss
        );
    }
    assert_eq!(single.params.len(), got.params.len());
    for (a, b) in single.params.iter().zip(&got.params) {
        for (x, y) in a.data.iter().zip(&b.data) {
            assert!(
                (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                "{file} {plan:?} {}: {y} vs {x}",
                a.name
            );
        }
    }
}

#[test]
fn tiny_example_with_dp_tp_zero_and_sequence_parallelism() {
    assert_example_equivalent(
        "examples/tiny.par",
        &[
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.zero=2",
            "parallel.sequence_parallel=true",
            "cluster.gpus_per_node=4",
        ],
    );
}

#[test]
fn tiny_llama_example_with_interleaved_pipeline_and_context_parallelism() {
    assert_example_equivalent(
        "examples/tiny-llama.par",
        &[
            "parallel.pp=2",
            "parallel.cp=2",
            "parallel.schedule=interleaved",
            "parallel.virtual=2",
            "parallel.recompute=full",
            "cluster.gpus_per_node=4",
        ],
    );
}
