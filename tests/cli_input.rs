//! How the `parc` binary takes its input and gives its output outside the spec's meaning: a spec
//! saved with a UTF-8 byte-order mark (Windows editors write one) reads as the same spec, and a
//! command whose stdout closes early (`parc check --format json | head`) ends without a panic,
//! and a file that cannot be read does not hide the verdicts of the others checked with it. A
//! `parc run` whose files are not what the spec says names the setting they came from: a missing
//! evaluation file is `train.eval.data`'s, and a `checkpoint.dir` that is a file is called one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn parc() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_parc"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1");
    c
}

#[test]
fn a_byte_order_mark_is_not_part_of_the_spec() {
    let spec = std::fs::read_to_string("examples/tiny-llama.par").unwrap();
    let dir = std::env::temp_dir().join(format!("parc-bom-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bom.par");
    std::fs::write(&file, format!("\u{feff}{spec}")).unwrap();
    let out = parc()
        .args(["check", "--lower", "never"])
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    assert!(!stderr.contains("E0101"), "stderr:\n{stderr}");
}

#[test]
fn a_closed_stdout_ends_check_without_a_panic() {
    // The reader goes away right after the start, long before the check prints its JSON: the
    // print fails with a broken pipe, which panicked (exit 101, a backtrace on stderr).
    let mut child = parc()
        .args(["check", "--format", "json", "examples/tiny-llama.par"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!stderr.contains("panicked"), "stderr:\n{stderr}");
    assert_ne!(status.code(), Some(101), "stderr:\n{stderr}");
}

#[test]
fn an_unreadable_file_does_not_hide_the_others() {
    let out = parc()
        .args(["check", "--format", "json", "--lower", "never"])
        .args(["examples/tiny-llama.par", "examples/no-such-spec.par"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(stderr.contains("no-such-spec.par"), "stderr:\n{stderr}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let files: Vec<&str> = doc["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["file"].as_str().unwrap())
        .collect();
    assert_eq!(files, ["examples/tiny-llama.par"]);
}

/// A fresh folder holding `examples/tiny.par` on synthetic data, its `train` section given
/// `extra` settings; returns the folder and the spec's path.
fn tiny_spec_with(name: &str, extra: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("parc-input-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let spec = std::fs::read_to_string("examples/tiny.par").unwrap();
    let data = "data = \"data/tiny-shakespeare.txt\" as bytes";
    assert!(spec.contains(data));
    let file = dir.join("tiny.par");
    let spec = spec.replace(data, &format!("data = synthetic\n  {extra}"));
    std::fs::write(&file, spec).unwrap();
    (dir, file)
}

/// `parc run FILE --set train.steps=10`: its exit code and stderr.
fn run_briefly(file: &PathBuf) -> (Option<i32>, String) {
    let out = parc()
        .arg("run")
        .arg(file)
        .args(["--set", "train.steps=10"])
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_missing_evaluation_file_is_named_as_train_eval_data() {
    let eval = "eval = { every: 5, data: \"absent-eval.txt\" as bytes }";
    let (dir, file) = tiny_spec_with("eval-data", eval);
    let (code, stderr) = run_briefly(&file);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(code, Some(1), "stderr:\n{stderr}");
    assert!(stderr.contains("`train.eval.data`"), "stderr:\n{stderr}");
    assert!(stderr.contains("absent-eval.txt"), "stderr:\n{stderr}");
    assert!(!stderr.contains("`train.data`"), "stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "stderr:\n{stderr}");
}

#[test]
fn a_checkpoint_dir_that_is_a_file_is_called_a_file() {
    let ckpt = "checkpoint = { every: 5, dir: \"ckpt\" }";
    let (dir, file) = tiny_spec_with("ckpt-file", ckpt);
    std::fs::write(dir.join("ckpt"), b"a file, not a folder").unwrap();
    let (code, stderr) = run_briefly(&file);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(code, Some(1), "stderr:\n{stderr}");
    assert!(
        stderr.contains("is a file, not a folder"),
        "stderr:\n{stderr}"
    );
    assert!(stderr.contains("checkpoint.dir"), "stderr:\n{stderr}");
    assert!(!stderr.contains("File exists"), "stderr:\n{stderr}");
}
