//! The UI cases (`tests/ui/*.par`) and their `// args:` lines, shared by `tests/ui.rs` (the
//! goldens) and `tests/ui_fixes.rs` (every fix applied), and the `.par` lister that
//! `tests/check_examples.rs` and `tests/published_configs.rs` also use. Each binary includes it
//! with `#[path]`.
use std::path::{Path, PathBuf};

/// Every `*.par` of `dir` (relative to the repository), sorted: the UI cases, the examples, the
/// published-config corpus.
pub fn par_files(dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "par"))
        .collect();
    files.sort();
    files
}

/// Every `tests/ui/*.par`, sorted.
pub fn ui_files() -> Vec<PathBuf> {
    par_files("tests/ui")
}

/// The `// args:` of a UI case.
pub fn case_args(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("// args:"))
        .map(|a| a.split_whitespace().map(String::from).collect())
        .unwrap_or_default()
}
