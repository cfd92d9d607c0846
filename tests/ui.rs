//! UI tests: every `tests/ui/CODE-name.par` is checked by the real `parc check` binary and its
//! stderr compared with the `.stderr` golden beside it. The file name's prefix is the code the
//! run must report; a `// args: …` line passes extra arguments (`--set …`). `PARC_BLESS=1 cargo
//! test --test ui` rewrites the goldens. Rendering has a fixed width and no colour, so the goldens
//! do not depend on the terminal.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

#[path = "ui_cases/mod.rs"]
mod ui_cases;
use ui_cases::{case_args, ui_files};

fn run(file: &Path) -> (String, Option<i32>) {
    let args = case_args(file);
    let rel = file
        .strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .unwrap()
        .to_path_buf();
    let out = Command::new(env!("CARGO_BIN_EXE_parc"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg("check")
        .arg(&rel)
        .args(&args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.code(),
    )
}

#[test]
fn ui_goldens() {
    let bless = std::env::var_os("PARC_BLESS").is_some();
    let mut failures = Vec::new();
    let files = ui_files();
    assert!(files.len() >= 40, "expected the UI test files in tests/ui");
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let code = name.split('-').next().unwrap().to_string();
        let (stderr, status) = run(file);
        if !stderr.lines().any(|l| l.trim() == code) {
            failures.push(format!("{name}: does not report {code}:\n{stderr}"));
            continue;
        }
        let want_status = if code.starts_with('E') { 1 } else { 0 };
        if status != Some(want_status) {
            failures.push(format!("{name}: exit {status:?}, expected {want_status}"));
        }
        let golden = file.with_extension("stderr");
        if bless {
            std::fs::write(&golden, &stderr).unwrap();
            continue;
        }
        let expected = std::fs::read_to_string(&golden).unwrap_or_default();
        if expected != stderr {
            failures.push(format!(
                "{name}: output differs from {} (PARC_BLESS=1 to accept)\n--- expected\n{expected}\n--- got\n{stderr}",
                golden.display()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
