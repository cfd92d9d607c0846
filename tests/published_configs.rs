//! `parc check` on the published-config corpus (`tests/configs/*.par`): models with the
//! dimensions of their Hugging Face config.json and recipes from Megatron-LM, NeMo, torchtitan
//! and DeepSpeed, written as a user would, including published features parc has no spelling
//! for. Each file's first line states what `parc check` says of it:
//!
//! - `// expect: ok` — no diagnostics at all;
//! - `// expect: ok, W0601` — no errors, exactly these warnings;
//! - `// expect: E0403, E0601` — exactly these codes, errors and warnings (a code reported
//!   several times is listed once).
//!
//! An optional `// check: ARGS` line adds arguments (`--lower never` for the few plans whose
//! lowering takes seconds; their verdict is then the cost formulas'). Files run two at a time.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ui_cases/mod.rs"]
mod ui_cases;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

fn corpus() -> Vec<PathBuf> {
    ui_cases::par_files("tests/configs")
}

/// The codes the file's `// expect:` line names ("ok" names none) and its extra arguments.
fn expectation(file: &Path) -> (BTreeSet<String>, Vec<String>) {
    let text = std::fs::read_to_string(file).unwrap();
    let expect = text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("// expect:"))
        .unwrap_or_else(|| panic!("{}: the first line must be `// expect: …`", file.display()));
    let codes = expect
        .split(',')
        .map(str::trim)
        .filter(|c| *c != "ok")
        .map(String::from)
        .collect();
    let args = text
        .lines()
        .take_while(|l| l.starts_with("//"))
        .find_map(|l| l.strip_prefix("// check:"))
        .map(|a| a.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    (codes, args)
}

/// The diagnostic codes `parc check --format json` reports for `file`, and its exit code.
fn check(file: &Path, args: &[String]) -> (BTreeSet<String>, Option<i32>) {
    let out = Command::new(env!("CARGO_BIN_EXE_parc"))
        .arg("check")
        .arg(file)
        .args(["--format", "json"])
        .args(args)
        .output()
        .unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{}: no JSON document ({e}); stderr:\n{}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let codes = doc["files"][0]["diagnostics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["code"].as_str().unwrap().to_string())
        .collect();
    (codes, out.status.code())
}

/// What is wrong with `file`'s outcome, if anything.
fn mismatch(file: &Path) -> Option<String> {
    let (want, args) = expectation(file);
    let (got, status) = check(file, &args);
    let code = Some(i32::from(want.iter().any(|c| c.starts_with('E'))));
    (got != want || status != code).then(|| {
        format!(
            "{}: expected {want:?} (exit {code:?}), got {got:?} (exit {status:?})",
            file.display()
        )
    })
}

#[test]
fn every_published_config_gives_its_expected_outcome() {
    let files = corpus();
    assert!(files.len() >= 30, "the corpus has {} files", files.len());
    let next = AtomicUsize::new(0);
    let failures: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let mut found = Vec::new();
                    while let Some(f) = files.get(next.fetch_add(1, Ordering::Relaxed)) {
                        found.extend(mismatch(f));
                    }
                    found
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}
