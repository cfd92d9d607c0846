//! Every help leads somewhere (issue 23): each UI case (`tests/ui/*.par`, with its `// args:`)
//! is checked with `parc check --format json`, and every fix its diagnostics carry (the help's
//! concrete change as `--set PATH=VALUE` overrides) is applied and the spec checked again: the
//! diagnostic's code must be gone — the fix neither leaves that error nor leads into another of
//! the same check — and no error of another code may appear that the case did not have.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::path::Path;
use std::process::Command;

#[path = "ui_cases/mod.rs"]
mod ui_cases;
use ui_cases::{case_args, ui_files};

/// The diagnostics of `parc check FILE ARGS` (JSON).
fn diagnostics(file: &Path, args: &[String]) -> Vec<Value> {
    let rel = file.strip_prefix(env!("CARGO_MANIFEST_DIR")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_parc"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg("check")
        .arg(rel)
        .args(["--format", "json"])
        .args(args)
        .output()
        .unwrap();
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{}: no JSON ({e}): {}",
            rel.display(),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    doc["files"][0]["diagnostics"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[test]
fn every_fix_of_the_ui_cases_clears_its_diagnostic() {
    let mut applied = 0;
    let mut failures = Vec::new();
    for file in ui_files() {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let args = case_args(&file);
        let before = diagnostics(&file, &args);
        for d in &before {
            let code = d["code"].as_str().unwrap().to_string();
            for fix in d["fixes"].as_array().into_iter().flatten() {
                let sets: Vec<String> = fix
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s.as_str().unwrap().to_string())
                    .collect();
                let mut fixed = args.clone();
                for set in &sets {
                    fixed.extend(["--set".to_string(), set.clone()]);
                }
                applied += 1;
                let after = diagnostics(&file, &fixed);
                if let Some(left) = after.iter().find(|a| a["code"] == code.as_str()) {
                    failures.push(format!(
                        "{name}: {code}'s fix {sets:?} (help: {}) still gives {code}: {}",
                        d["help"], left["message"]
                    ));
                }
                let is_new = |a: &&Value| {
                    a["severity"] == "error" && !before.iter().any(|b| b["code"] == a["code"])
                };
                if let Some(new) = after.iter().find(is_new) {
                    failures.push(format!(
                        "{name}: {code}'s fix {sets:?} leads into {}: {}",
                        new["code"], new["message"]
                    ));
                }
            }
        }
    }
    assert!(applied >= 20, "only {applied} fixes in the UI cases");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
