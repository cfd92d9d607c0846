//! Which files a data path names: the file itself; a folder's files with the source's extension
//! (`.bin` token shards, `.txt` text); or a glob's matching files (`shards/train-*.bin`). A path
//! that exists is never read as a glob. Several files are read as one stream in sorted path
//! order, so a folder of shards `shard-00000.bin`, `shard-00001.bin`, … is read in the order it
//! was written.
use crate::error::{Result, RuntimeError};
use std::path::{Path, PathBuf};

/// The files `path` (relative to `spec_dir`) names, sorted; a folder contributes its files
/// ending in `.{extension}`. Never empty.
pub fn data_files(spec_dir: &Path, path: &str, extension: &str) -> Result<Vec<PathBuf>> {
    let full = spec_dir.join(path);
    if full.is_dir() {
        return folder_files(&full, extension);
    }
    if full.exists() {
        return Ok(vec![full]);
    }
    if is_glob(path) {
        return glob_files(&full);
    }
    Err(files_error(
        &full,
        format!(
            "no such file (data paths are relative to the spec's folder {}); create it or fix \
             the path",
            spec_dir.display()
        ),
    ))
}

fn files_error(path: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Data(format!("{}: {what}", path.display()))
}

fn is_glob(path: &str) -> bool {
    path.contains(['*', '?', '['])
}

/// The files of `dir` ending in `.{extension}`, sorted; never empty.
pub fn folder_files(dir: &Path, extension: &str) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| files_error(dir, format!("cannot list the folder: {e}")))?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|e| files_error(dir, format!("cannot list the folder: {e}")))?
            .path();
        if path.is_file() && path.extension().is_some_and(|e| e == extension) {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(files_error(
            dir,
            format!(
                "the folder holds no .{extension} files; `parc tokenize` writes token shards \
                 (`shard-00000.bin`, …), and text folders hold .txt files"
            ),
        ));
    }
    files.sort();
    Ok(files)
}

fn glob_files(pattern: &Path) -> Result<Vec<PathBuf>> {
    let text = pattern.to_string_lossy();
    let matches = glob::glob(&text)
        .map_err(|e| files_error(pattern, format!("not a valid glob pattern: {e}")))?;
    let mut files = Vec::new();
    for m in matches {
        let path = m.map_err(|e| files_error(pattern, format!("cannot read a match: {e}")))?;
        if path.is_file() {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(files_error(
            pattern,
            "the glob matches no files (it is relative to the spec's folder); fix the pattern",
        ));
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str, files: &[&str]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("parc-files-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("shards")).unwrap();
        for f in files {
            std::fs::write(dir.join("shards").join(f), b"xx").unwrap();
        }
        dir
    }

    fn names(files: &[PathBuf]) -> Vec<String> {
        files
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn a_folder_gives_its_files_of_the_extension_sorted() {
        let dir = folder("sorted", &["b.bin", "a.bin", "info.json", "c.txt"]);
        let files = data_files(&dir, "shards", "bin").unwrap();
        assert_eq!(names(&files), ["a.bin", "b.bin"]);
        assert_eq!(
            names(&data_files(&dir, "shards/", "txt").unwrap()),
            ["c.txt"]
        );
        let err = data_files(&dir, "shards", "u16").unwrap_err().to_string();
        assert!(err.contains("no .u16 files"), "{err}");
    }

    #[test]
    fn a_glob_gives_its_matches_sorted_and_a_file_itself() {
        let dir = folder("glob", &["train-1.bin", "train-0.bin", "val-0.bin"]);
        let files = data_files(&dir, "shards/train-*.bin", "bin").unwrap();
        assert_eq!(names(&files), ["train-0.bin", "train-1.bin"]);
        let one = data_files(&dir, "shards/val-0.bin", "bin").unwrap();
        assert_eq!(names(&one), ["val-0.bin"]);
        let err = data_files(&dir, "shards/test-*.bin", "bin")
            .unwrap_err()
            .to_string();
        assert!(err.contains("matches no files"), "{err}");
        let err = data_files(&dir, "nope.bin", "bin").unwrap_err().to_string();
        assert!(
            err.contains("nope.bin") && err.contains("no such file"),
            "{err}"
        );
    }
}
