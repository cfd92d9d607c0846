//! Every help leads somewhere (issue 23): each UI case (`tests/ui/*.par`, with its `// args:`)
//! is checked with `parc check --format json`, and every fix its diagnostics carry (the help's
//! concrete change: `--set PATH=VALUE` overrides and text edits of the spec or of a `--set`
//! flag) is applied and the spec checked again: the diagnostic's code must be gone — the fix
//! neither leaves that error nor leads into another of the same check — and no error of another
//! code may appear that the case did not have. An edit never changes a value other uses share
//! (a `let`, a `--set model.NAME` constant).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "ui_cases/mod.rs"]
mod ui_cases;
use ui_cases::{case_args, ui_files};

/// The diagnostics of `parc check FILE ARGS` (JSON), `file` relative to the workspace or
/// absolute.
fn diagnostics(file: &Path, args: &[String]) -> Vec<Value> {
    let rel = file
        .strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .unwrap_or(file);
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

/// The byte offset of 1-based `line` and `column` (in characters) in `text`.
fn offset(text: &str, line: u64, column: u64) -> usize {
    let start: usize = text
        .split_inclusive('\n')
        .take(line as usize - 1)
        .map(str::len)
        .sum();
    let rest = &text[start..];
    rest.char_indices()
        .nth(column as usize - 1)
        .map_or(text.len(), |(i, _)| start + i)
}

/// `text` with `edit` (an edit object of a fix) applied.
fn apply_edit(text: &str, edit: &Value) -> String {
    let at = |l: &str, c: &str| offset(text, edit[l].as_u64().unwrap(), edit[c].as_u64().unwrap());
    let (start, end) = (at("line", "column"), at("end_line", "end_column"));
    format!(
        "{}{}{}",
        &text[..start],
        edit["replacement"].as_str().unwrap(),
        &text[end..]
    )
}

/// The spec (as a file to check) and arguments of the case `file` with `fix` applied: its
/// `--set` strings added to `args`, its edits made to the spec's text or to the `--set` flag
/// they name. An edited spec is a temporary copy (its relative data paths then point nowhere,
/// so cases about data files must not get spec edits); otherwise the case itself is checked.
/// Err: an edit of a file the user does not own.
fn apply(file: &Path, args: &[String], fix: &[Value]) -> Result<(PathBuf, Vec<String>), String> {
    let rel = file.strip_prefix(env!("CARGO_MANIFEST_DIR")).unwrap();
    let original = std::fs::read_to_string(file).unwrap();
    let mut text = original.clone();
    let mut args = args.to_vec();
    // Later edits first, so earlier offsets stay valid.
    let mut edits: Vec<&Value> = fix.iter().filter(|c| c.is_object()).collect();
    edits.sort_by_key(|e| std::cmp::Reverse((e["line"].as_u64(), e["column"].as_u64())));
    for edit in edits {
        let target = edit["file"].as_str().unwrap();
        if Path::new(target) == rel {
            text = apply_edit(&text, edit);
        } else if let Some(flag) = target.strip_prefix("--set ") {
            let i = args.iter().position(|a| a == flag).ok_or(format!(
                "an edit of `{target}`, which the case does not pass"
            ))?;
            args[i] = apply_edit(&args[i], edit);
        } else {
            return Err(format!("an edit of {target}, which is not the user's"));
        }
    }
    for set in fix.iter().filter_map(Value::as_str) {
        args.extend(["--set".to_string(), set.to_string()]);
    }
    if text == original {
        return Ok((file.to_path_buf(), args));
    }
    let copy = std::env::temp_dir()
        .join(format!("parc-ui-fixes-{}", std::process::id()))
        .join(rel.file_name().unwrap());
    std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
    std::fs::write(&copy, text).unwrap();
    Ok((copy, args))
}

#[test]
fn every_fix_of_the_ui_cases_clears_its_diagnostic() {
    let (mut applied, mut edits) = (0, 0);
    let mut failures = Vec::new();
    for file in ui_files() {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let args = case_args(&file);
        let before = diagnostics(&file, &args);
        for d in &before {
            let code = d["code"].as_str().unwrap().to_string();
            for fix in d["fixes"].as_array().into_iter().flatten() {
                let fix = fix.as_array().unwrap();
                let (fixed_file, fixed) = match apply(&file, &args, fix) {
                    Ok(applied) => applied,
                    Err(e) => {
                        failures.push(format!("{name}: {code}'s fix {fix:?}: {e}"));
                        continue;
                    }
                };
                applied += 1;
                edits += fix.iter().filter(|c| c.is_object()).count();
                let after = diagnostics(&fixed_file, &fixed);
                if let Some(left) = after.iter().find(|a| a["code"] == code.as_str()) {
                    failures.push(format!(
                        "{name}: {code}'s fix {fix:?} (help: {}) still gives {code}: {}",
                        d["help"], left["message"]
                    ));
                }
                let is_new = |a: &&Value| {
                    a["severity"] == "error" && !before.iter().any(|b| b["code"] == a["code"])
                };
                if let Some(new) = after.iter().find(is_new) {
                    failures.push(format!(
                        "{name}: {code}'s fix {fix:?} leads into {}: {}",
                        new["code"], new["message"]
                    ));
                }
            }
        }
    }
    assert!(applied >= 20, "only {applied} fixes in the UI cases");
    assert!(edits >= 3, "only {edits} text edits in the UI cases");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn an_edit_never_changes_a_value_other_uses_share() {
    let case = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ui/E0301-shape.par");
    let text = std::fs::read_to_string(case).unwrap();
    let shared = text
        .replace("let seq = 64", "let seq = 64; let wide = 128")
        .replace("Linear(2 * d,", "Linear(wide,");
    let copy = std::env::temp_dir().join(format!("parc-ui-shared-{}.par", std::process::id()));
    std::fs::write(&copy, shared).unwrap();
    for args in [
        vec![],
        vec!["--set".to_string(), "model.wide=128".to_string()],
    ] {
        let found = diagnostics(&copy, &args);
        let d = found.iter().find(|d| d["code"] == "E0301").unwrap();
        assert_eq!(d["fixes"], serde_json::json!([]), "{args:?}: {d}");
        assert!(d["help"].as_str().unwrap().contains("to 64"), "{d}");
    }
}
