//! Using parc as a new user would, end to end on the CPU: the tiny GPT-2 trains on text through
//! GPT-2's tokenizer with evaluation, samples and metrics; `parc sample` continues a prompt from
//! the final weights; `parc export` and `parc sample` agree on a Hugging Face folder; `parc plot`
//! draws the run from its CSV and from its TensorBoard events alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]
mod cli_support;

use cli_support::{json_lines, parc, parc_ok, stderr_of, steps};
use serde_json::Value;
use std::path::Path;

fn number(line: &Value, field: &str) -> Option<f64> {
    line.get(field).and_then(Value::as_f64)
}

/// The run's step lines, validation losses and samples, checked for what the example promises.
fn check_run_log(lines: &[Value]) {
    let steps = steps(lines);
    assert_eq!(steps.len(), 30, "every step logs a JSON line");
    let loss = |i: usize| number(steps[i], "loss").unwrap();
    assert!(loss(29) < loss(0) - 1.0, "{} → {}", loss(0), loss(29));
    let evaluated: Vec<u64> = steps
        .iter()
        .filter(|s| number(s, "val_loss").is_some())
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evaluated, [10, 20, 30], "train.eval every 10 steps");
    let samples: Vec<&Value> = lines.iter().filter(|l| l["event"] == "sample").collect();
    assert_eq!(samples.len(), 2, "train.sample every 15 steps");
    for sample in samples {
        let text = sample["text"].as_str().unwrap();
        assert!(text.starts_with("ROMEO:") && text.len() > 10, "{text:?}");
    }
}

/// metrics.csv: a header and one row per step, the validation loss where it was measured.
fn check_metrics_csv(dir: &Path) {
    let csv = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let mut rows = csv.lines();
    let header: Vec<&str> = rows.next().unwrap().split(',').collect();
    let val = header.iter().position(|c| *c == "val_loss").unwrap();
    let rows: Vec<Vec<&str>> = rows.map(|r| r.split(',').collect()).collect();
    assert_eq!(rows.len(), 30);
    let with_val: Vec<&str> = rows
        .iter()
        .filter(|r| !r[val].is_empty())
        .map(|r| r[0])
        .collect();
    assert_eq!(with_val, ["10", "20", "30"]);
}

fn assert_png(file: &Path) {
    let bytes = std::fs::read(file).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is a PNG",
        file.display()
    );
}

#[test]
fn a_text_model_trains_evaluates_samples_exports_and_plots() {
    let dir = cli_support::temp_dir("real_use", "text");
    let (metrics, ckpt) = (dir.join("metrics"), dir.join("ckpt"));
    let set_ckpt = format!("train.checkpoint.dir=\"{}\"", ckpt.display());
    let run = parc_ok(&[
        "run",
        "examples/tiny-gpt2-text.par",
        "--backend",
        "cpu",
        "--log-format",
        "json",
        "--metrics",
        metrics.to_str().unwrap(),
        "--set",
        &set_ckpt,
    ]);
    check_run_log(&json_lines(&run));
    check_metrics_csv(&metrics);

    let sample = parc_ok(&[
        "sample",
        ckpt.to_str().unwrap(),
        "--prompt",
        "ROMEO:",
        "--tokens",
        "16",
    ]);
    let text = String::from_utf8_lossy(&sample.stdout);
    assert!(text.starts_with("ROMEO:") && text.len() > 12, "{text:?}");
    assert!(
        stderr_of(&sample).contains("tokenizer gpt2"),
        "{}",
        stderr_of(&sample)
    );

    // The export keeps GPT-2's 50,257 tokens of the padded 50,304 (the spec's tokenizer says so).
    let hf = dir.join("hf");
    let export = parc_ok(&[
        "export",
        ckpt.to_str().unwrap(),
        "--format",
        "hf",
        hf.to_str().unwrap(),
    ]);
    assert!(
        stderr_of(&export).contains("vocabulary 50257"),
        "{}",
        stderr_of(&export)
    );
    let config: Value =
        serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["vocab_size"], 50257);

    let png = dir.join("run.png");
    parc_ok(&[
        "plot",
        metrics.to_str().unwrap(),
        "-o",
        png.to_str().unwrap(),
    ]);
    assert_png(&png);
    // The TensorBoard events alone draw the same run (their records read back, CRCs checked).
    std::fs::remove_file(metrics.join("metrics.csv")).unwrap();
    let from_events = dir.join("events.png");
    parc_ok(&[
        "plot",
        metrics.to_str().unwrap(),
        "-o",
        from_events.to_str().unwrap(),
    ]);
    assert_png(&from_events);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_real_use_input_is_a_clear_error() {
    let dir = cli_support::temp_dir("real_use", "bad");
    let set_ckpt = format!("train.checkpoint.dir=\"{}\"", dir.join("ckpt").display());
    // A tokenizer file that is not there, named with what to do.
    let out = parc(&[
        "run",
        "examples/tiny-gpt2-text.par",
        "--backend",
        "cpu",
        "--set",
        &set_ckpt,
        "--set",
        "train.data=text(\"data/tiny-shakespeare.txt\", tokenizer: \"nope/tokenizer.json\")",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("nope/tokenizer.json"),
        "{}",
        stderr_of(&out)
    );
    // An evaluation set shorter than one global batch.
    let short = dir.join("short.txt");
    std::fs::write(&short, "too short").unwrap();
    let set_eval = format!(
        "train.eval={{every: 5, data: \"{}\" as bytes}}",
        short.display()
    );
    let out = parc(&[
        "run",
        "examples/tiny.par",
        "--backend",
        "cpu",
        "--set",
        &set_eval,
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("short.txt"), "{}", stderr_of(&out));
    std::fs::remove_dir_all(&dir).unwrap();
}
