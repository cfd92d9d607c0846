//! What the tests that run the `parc` binary share: running it from the repository root (and
//! asserting that it succeeded, where a test needs it to), `--set` arguments, its JSON-lines
//! output, and a fresh temporary folder. Each test binary includes this file as a module
//! (`#[path]`).
#![allow(dead_code)] // each binary uses a part

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

/// The repository root, where the tests run `parc`.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `parc` with `args`, run from the repository root.
pub fn parc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_parc"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run parc")
}

/// [`parc`], which must succeed (the failure shows its stderr).
pub fn parc_ok(args: &[&str]) -> Output {
    let out = parc(args);
    assert!(out.status.success(), "{}", stderr_of(&out));
    out
}

pub fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A line of shell words as a shell splits it: on whitespace, except inside single quotes
/// (how `parc plan --search` prints a flag whose value has spaces, `'parallel.mesh={…}'`).
pub fn shell_words(line: &str) -> Vec<String> {
    let mut words = vec![String::new()];
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '\'' => quoted = !quoted,
            c if c.is_whitespace() && !quoted => words.push(String::new()),
            c => words.last_mut().expect("one word at least").push(c),
        }
    }
    words.retain(|w| !w.is_empty());
    words
}

/// `--set` before each of `overrides`: `parc`'s arguments for them.
pub fn sets<'a>(overrides: &[&'a str]) -> Vec<&'a str> {
    overrides.iter().flat_map(|o| ["--set", o]).collect()
}

/// Each line of `output`'s stdout, parsed as JSON.
pub fn json_lines(output: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The step lines among `lines`.
pub fn steps(lines: &[Value]) -> Vec<&Value> {
    lines.iter().filter(|v| v["event"] == "step").collect()
}

/// A fresh, empty folder `parc-{test}-{pid}-{name}` in the system's temporary folder.
pub fn temp_dir(test: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("parc-{test}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a temporary folder");
    dir
}
