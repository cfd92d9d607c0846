//! `parc calibrate` and the timeline it prices: a quick CPU profile prices tiny.par's step (the
//! test prints it beside what `parc run` measures; timings are compared by benchmarks, never by
//! a test: bench/predict_call.sh on the GPU); bad profiles are clear errors naming the file; the
//! CUDA calibration runs on a GPU machine and skips visibly elsewhere.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli_support;
#[path = "gpu_support/mod.rs"]
mod gpu_support;

use cli_support::{json_lines, parc, parc_ok, stderr_of, steps};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// One test at a time: timings measured while another test's `parc` runs would be skewed.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn alone() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn temp_dir(name: &str) -> PathBuf {
    cli_support::temp_dir("calibrate", name)
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 temporary path")
}

/// `parc check examples/tiny.par --format json` with `extra`: its `lowered` object.
fn check_json(extra: &[&str]) -> Value {
    let mut args = vec!["check", "examples/tiny.par", "--format", "json"];
    args.extend_from_slice(extra);
    let out = parc_ok(&args);
    let doc: Value = serde_json::from_slice(&out.stdout).expect("check's JSON");
    doc["files"][0]["lowered"].clone()
}

/// A quick CPU profile, written to `dir/name`.
fn quick_profile(dir: &Path, name: &str) -> PathBuf {
    let file = dir.join(name);
    parc_ok(&[
        "calibrate",
        "--backend",
        "cpu",
        "--quick",
        "-o",
        path_str(&file),
    ]);
    file
}

#[test]
fn a_quick_cpu_profile_prices_the_step() {
    let _alone = alone();
    let dir = temp_dir("e2e");
    let profile = quick_profile(&dir, "cpu.json");
    let lowered = check_json(&["--calibration", path_str(&profile)]);
    let predicted = lowered["step_seconds"].as_f64().expect("a predicted step");
    assert_eq!(lowered["priced_by"]["model"], "calibration", "{lowered}");
    assert!(lowered["tokens_per_second"]
        .as_f64()
        .is_some_and(|t| t > 0.0));
    assert!(lowered["mfu"].as_f64().is_some_and(|m| m > 0.0));
    let out = parc_ok(&[
        "run",
        "examples/tiny.par",
        "--backend",
        "cpu",
        "--log-format",
        "json",
        "--set",
        "train.steps=12",
    ]);
    let lines = json_lines(&out);
    // Each step's wall time, the first two (warm-up) left out; the median.
    let mut times: Vec<f64> = steps(&lines)
        .iter()
        .skip(2)
        .map(|s| s["tokens"].as_f64().unwrap() / s["tokens_per_s"].as_f64().unwrap())
        .collect();
    times.sort_by(f64::total_cmp);
    let measured = times[times.len() / 2];
    let ratio = measured / predicted;
    // Printed, not asserted: on shared cores the measured step swings with the load.
    println!(
        "tiny.par on the cpu: predicted {:.2} ms (quick profile), measured {:.2} ms (median of \
         {} steps): measured/predicted {ratio:.2}",
        predicted * 1e3,
        measured * 1e3,
        times.len()
    );
    assert!(predicted.is_finite() && predicted > 0.0, "{predicted}");
}

#[test]
fn without_a_profile_the_report_says_the_peak_numbers_priced_it() {
    let _alone = alone();
    let lowered = check_json(&[]);
    assert_eq!(lowered["priced_by"]["model"], "peak");
    let note = lowered["priced_by"]["note"].as_str().unwrap_or("");
    assert!(
        note.contains("no calibration profile for cpu") && note.contains("parc calibrate"),
        "{note}"
    );
}

/// `parc check tiny.par --calibration FILE` with `extra`, which must fail with exit 2 and an
/// error naming `file` and containing each of `says`.
fn refused(file: &Path, extra: &[&str], says: &[&str]) {
    let mut args = vec![
        "check",
        "examples/tiny.par",
        "--calibration",
        path_str(file),
    ];
    args.extend_from_slice(extra);
    let out = parc(&args);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(path_str(file)), "names the file: {err}");
    for s in says {
        assert!(err.contains(s), "says {s:?}: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_profiles_are_clear_errors_naming_the_file() {
    let _alone = alone();
    let dir = temp_dir("bad");
    let good = quick_profile(&dir, "cpu.json");
    let text = std::fs::read_to_string(&good).unwrap();
    let write = |name: &str, body: &str| {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p
    };
    refused(
        &dir.join("absent.json"),
        &[],
        &["cannot read", "parc calibrate"],
    );
    refused(
        &write("corrupt.json", "this is not json"),
        &[],
        &["not a calibration profile"],
    );
    let truncated = write("truncated.json", &text[..text.len() / 2]);
    refused(&truncated, &[], &["truncated"]);
    let mut profile: Value = serde_json::from_str(&text).unwrap();
    profile["version"] = 99.into();
    let version = write("version.json", &profile.to_string());
    refused(&version, &[], &["version 99", "version 2"]);
    let mut profile: Value = serde_json::from_str(&text).unwrap();
    profile["gemm"][0]["seconds"] = (-1.0).into();
    refused(
        &write("negative.json", &profile.to_string()),
        &[],
        &["gemm point 0", "positive"],
    );
    profile["gemm"][0]["seconds"] = Value::Null; // how NaN is written
    refused(
        &write("nan.json", &profile.to_string()),
        &[],
        &["not a number"],
    );
    let mut profile: Value = serde_json::from_str(&text).unwrap();
    profile["gpu"] = "h200".into();
    let other = write("h200.json", &profile.to_string());
    refused(
        &other,
        &[],
        &["measured on gpu `h200`", "`cpu`", "--scale-calibration"],
    );
    // Scaling asked for: accepted, and the report says it was scaled.
    let lowered = check_json(&["--calibration", path_str(&other), "--scale-calibration"]);
    let note = lowered["priced_by"]["note"].as_str().unwrap_or("");
    assert!(note.contains("scaled from h200 to cpu"), "{note}");
    profile["gpu"] = "cpu".into();
    profile["precision"] = "bf16".into();
    let bf16 = write("bf16.json", &profile.to_string());
    refused(&bf16, &[], &["measured in bf16", "trains in fp32"]);
}

/// The shipped profile of a gpu kind (calibration/h100_80gb.json, bf16) is not a spec's of
/// another precision: its steps are priced by the peak numbers, and the report says why, where a
/// profile named with --calibration would be an error.
#[test]
fn a_default_profile_of_another_precision_is_passed_over_with_a_note() {
    let _alone = alone();
    let on_h100 = ["--set", "cluster.gpu=h100_80gb"];
    let bf16 = check_json(&[&on_h100[..], &["--set", "train.precision=bf16"]].concat());
    assert_eq!(bf16["priced_by"]["model"], "calibration", "{bf16}");
    let fp32 = check_json(&[&on_h100[..], &["--set", "train.precision=fp32"]].concat());
    assert_eq!(fp32["priced_by"]["model"], "peak", "{fp32}");
    let note = fp32["priced_by"]["note"].as_str().unwrap_or("");
    assert!(
        note.contains("h100_80gb.json") && note.contains("measured in bf16"),
        "{note}"
    );
}

#[test]
fn parc_plan_takes_a_profile_too() {
    let _alone = alone();
    let dir = temp_dir("plan");
    let profile = quick_profile(&dir, "cpu.json");
    let out = parc_ok(&[
        "plan",
        "examples/tiny.par",
        "--calibration",
        path_str(&profile),
    ]);
    assert!(
        stderr_of(&out).contains("timeline priced by"),
        "{}",
        stderr_of(&out)
    );
}

#[test]
fn cuda_calibration_writes_a_profile_on_a_gpu() {
    let _alone = alone();
    #[cfg(not(feature = "cuda"))]
    println!("skipped: no CUDA device (this build has no `cuda` feature)");
    #[cfg(feature = "cuda")]
    {
        use parc_compiler::spec::Precision;
        if gpu_support::backend_or_skip(Precision::Bf16).is_none() {
            return;
        }
        let dir = temp_dir("cuda");
        let file = dir.join("gpu.json");
        parc_ok(&[
            "calibrate",
            "--backend",
            "cuda",
            "--quick",
            "--gpu",
            "h200",
            "-o",
            path_str(&file),
        ]);
        let text = std::fs::read_to_string(&file).unwrap();
        let profile = parc_compiler::timeline::profile::Profile::parse(&text).unwrap();
        assert_eq!(
            (profile.backend.as_str(), profile.precision.as_str()),
            ("cuda", "bf16")
        );
        assert!(!profile.gemm.is_empty() && !profile.attention.is_empty());
        // The optimizer as a step runs it: fused runs (one launch each) of the grid's sizes.
        for op in ["adam_w_multi", "sum_squares_multi"] {
            let runs = (profile.memory.iter()).filter(|m| m.op.as_deref() == Some(op));
            assert_eq!(runs.count(), 3, "{op}");
        }
    }
}

/// A quick bf16 CPU profile with blockwise FP8 GEMMs, those then made `speedup` times faster
/// than its bf16 GEMMs of the same layout (`fwd`, `bwd_data`, `bwd_weight`, in that order; the
/// CPU's emulation is slower than bf16: a profile says what a GPU would).
fn fp8_profile(dir: &Path, speedup: [f64; 3]) -> PathBuf {
    let [fwd, data, weight] = speedup;
    let file = dir.join(format!("fp8-{fwd}-{data}-{weight}.json"));
    parc_ok(&[
        "calibrate",
        "--backend",
        "cpu",
        "--quick",
        "--precision",
        "bf16",
        "--fp8",
        "blockwise",
        "-o",
        path_str(&file),
    ]);
    let mut doc: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let gemm = doc["gemm"].as_array_mut().expect("gemm points");
    let bf16: Vec<Value> = gemm
        .iter()
        .filter(|g| g["dtype"] == "bf16")
        .cloned()
        .collect();
    assert!(!bf16.is_empty() && gemm.iter().any(|g| g["dtype"] == "fp8_blockwise"));
    gemm.retain(|g| g["dtype"] == "bf16");
    for mut g in bf16 {
        let speedup = match g["layout"].as_str() {
            Some("fwd") => fwd,
            Some("bwd_data") => data,
            Some("bwd_weight") => weight,
            other => panic!("a GEMM point of layout {other:?}"),
        };
        g["dtype"] = "fp8_blockwise".into();
        g["seconds"] = (g["seconds"].as_f64().unwrap() / speedup).into();
        gemm.push(g);
    }
    std::fs::write(&file, serde_json::to_vec(&doc).unwrap()).unwrap();
    file
}

const TINY_LLAMA_FP8: [&str; 4] = [
    "--set",
    "train.precision=bf16",
    "--set",
    "train.fp8=blockwise { block_size: 16 }",
];

/// `parc run` of tiny-llama with FP8 on the CPU, two steps, with `extra`: the losses.
fn fp8_losses(extra: &[&str]) -> Vec<f64> {
    let mut args = vec!["run", "examples/tiny-llama.par", "--backend", "cpu"];
    args.extend_from_slice(&["--log-format", "json", "--set", "train.steps=2"]);
    args.extend_from_slice(&TINY_LLAMA_FP8);
    args.extend_from_slice(extra);
    let lines = json_lines(&parc_ok(&args));
    steps(&lines)
        .iter()
        .map(|s| s["loss"].as_f64().unwrap())
        .collect()
}

#[test]
fn check_and_run_choose_the_same_fp8_layers_from_a_profile() {
    let _alone = alone();
    let dir = temp_dir("fp8-choice");
    let fast = fp8_profile(&dir, [8.0; 3]);
    let mut args = vec!["check", "examples/tiny-llama.par"];
    args.extend_from_slice(&TINY_LLAMA_FP8);
    args.extend_from_slice(&["--calibration", path_str(&fast)]);
    let report = String::from_utf8(parc_ok(&args).stdout).unwrap();
    // Every GEMM of the 8 layers but the head (4 blocks: 2 attention and 3 MLP weights) pays.
    let count = "FP8 GEMMs: 60 of the 63 forward, data-gradient and weight-gradient GEMMs of 9 \
                 linear layers (8 run some in FP8)";
    assert!(report.contains(count), "{report}");
    assert!(
        report.contains("(measured): fwd ") && report.contains(" pays, weight "),
        "{report}"
    );
    // Without the profile the roofline keeps every layer in bf16 (the cpu's FP8 peak is its
    // bf16 one); with it, run trains in FP8 as check said: the losses differ from bf16's.
    let roofline = fp8_losses(&[]);
    let plain = fp8_losses(&["--set", "train.fp8=none"]);
    let measured = fp8_losses(&["--calibration", path_str(&fast)]);
    assert_eq!(roofline, plain, "the roofline chooses no FP8 layer");
    assert_ne!(measured, plain, "the profile's FP8 layers run in FP8");
}

/// A profile whose FP8 forward and data-gradient GEMMs are faster than bf16 and whose weight
/// gradients are slower (as measured on an H100): `check` says each layer runs those two in
/// FP8, and `run` trains that mix (each GEMM op carries its own precision), which is neither
/// the bf16 run nor the all-FP8 one.
#[test]
fn check_and_run_choose_fp8_per_gemm_from_a_profile() {
    let _alone = alone();
    let dir = temp_dir("fp8-per-gemm");
    let mixed = fp8_profile(&dir, [8.0, 8.0, 0.5]);
    let mut args = vec!["check", "examples/tiny-llama.par"];
    args.extend_from_slice(&TINY_LLAMA_FP8);
    args.extend_from_slice(&["--calibration", path_str(&mixed)]);
    let report = String::from_utf8(parc_ok(&args).stdout).unwrap();
    let count = "FP8 GEMMs: 40 of the 63 forward, data-gradient and weight-gradient GEMMs of 9 \
                 linear layers (8 run some in FP8)";
    assert!(report.contains(count), "{report}");
    assert!(report.contains(" fp8 fwd+data "), "{report}");
    assert!(report.contains(" slower"), "{report}");
    // JSON keeps version 1's fields: `fp8` (all three GEMMs in FP8) and the layer's totals,
    // with each GEMM's choice and seconds beside them.
    args.extend_from_slice(&["--format", "json"]);
    let doc: Value = serde_json::from_slice(&parc_ok(&args).stdout).unwrap();
    let layers = doc["files"][0]["fp8"].as_array().unwrap();
    let mixed_layer = layers
        .iter()
        .find(|l| l["fp8_gemms"]["fwd"] == true && l["fp8_gemms"]["bwd_weight"] == false)
        .expect("a layer with its forward in FP8 and its weight gradient in bf16");
    assert_eq!(mixed_layer["fp8"], false, "{mixed_layer}");
    let reason = &mixed_layer["reason"];
    let layouts = ["fwd", "bwd_data", "bwd_weight"];
    let sum: f64 = layouts
        .iter()
        .map(|l| reason["bf16_gemm_s"][l].as_f64().unwrap())
        .sum();
    let total = reason["bf16_s"].as_f64().unwrap();
    assert!((sum - total).abs() <= 1e-12 * total.max(1.0), "{reason}");
    let plain = fp8_losses(&["--set", "train.fp8=none"]);
    let all = fp8_losses(&["--calibration", path_str(&fp8_profile(&dir, [8.0; 3]))]);
    let some = fp8_losses(&["--calibration", path_str(&mixed)]);
    assert_ne!(some, plain, "the forward and data gradients run in FP8");
    assert_ne!(some, all, "the weight gradients stay bf16");
}

/// `--add-to` measures only the FP8 tables into a profile measured before: the bf16 points
/// stay, FP8 points of the scaling appear (the CPU backend emulates FP8), measured twice they
/// are replaced, not doubled; a profile of another precision, a run without FP8 scalings and a
/// missing file are usage errors naming the file.
#[test]
fn add_to_puts_fp8_tables_into_an_existing_profile() {
    let _alone = alone();
    let dir = temp_dir("add_to");
    let base = dir.join("base.json");
    let quick = ["calibrate", "--backend", "cpu", "--quick"];
    let bf16 = [&quick[..], &["--precision", "bf16", "--fp8", "none"]].concat();
    parc_ok(&[&bf16[..], &["-o", path_str(&base)]].concat());
    let read =
        |p: &Path| -> Value { serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap() };
    let dtypes = |v: &Value, d: &str| {
        v["gemm"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|g| g["dtype"] == d)
            .count()
    };
    let before = read(&base);
    let add = [&quick[..], &["--precision", "bf16", "--fp8", "tensorwise"]].concat();
    let added = dir.join("added.json");
    parc_ok(
        &[
            &add[..],
            &["--add-to", path_str(&base), "-o", path_str(&added)],
        ]
        .concat(),
    );
    let once = read(&added);
    assert_eq!(dtypes(&once, "bf16"), dtypes(&before, "bf16"));
    let fp8 = dtypes(&once, "fp8_tensorwise");
    assert!(fp8 > 0, "no FP8 points added");
    // Again onto the result, written back to it (no -o): replaced, not doubled.
    parc_ok(&[&add[..], &["--add-to", path_str(&added)]].concat());
    assert_eq!(dtypes(&read(&added), "fp8_tensorwise"), fp8);
    let fp32 = [
        &quick[..],
        &["--fp8", "tensorwise", "--add-to", path_str(&base)],
    ]
    .concat();
    let out = parc(&fp32);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("base.json") && stderr_of(&out).contains("fp32"));
    let none = [&bf16[..], &["--add-to", path_str(&base)]].concat();
    let out = parc(&none);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("FP8 GEMM tables only"));
    let missing = dir.join("missing.json");
    let out = parc(&[&add[..], &["--add-to", path_str(&missing)]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("missing.json"));
}
