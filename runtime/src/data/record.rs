//! What a training dataset is, as a checkpoint records it (the manifest's `data`) and a resume
//! compares it (E1107, `checkpoint::dataset`): how its files are read (`u16 token ids`, `text
//! through gpt2`, …), each file's size and a fingerprint of its bytes, the tokenizer file when
//! there is one, and the stream's token count.
//!
//! The fingerprint is a CRC-32C of the whole file up to [`WHOLE`] bytes, else of [`WINDOWS`]
//! windows of [`WINDOW`] bytes spread evenly from its first byte to its last: 16 small reads
//! per file, whatever its size, so `parc check` can fingerprint a corpus of many gigabytes.
//! It tells another file of the same size apart unless all 16 windows hold the same bytes;
//! a file moved or renamed with its bytes kept is the same data. Sizes and fingerprints are
//! read from the files without decoding them, so `parc check` computes the same record as a
//! run, except the token count of text, which only tokenizing gives.
use super::files::data_files;
use crate::error::{Result, RuntimeError};
use parc_compiler::spec::{DataFormat, DataSource, Tokenizer};
use serde::{Deserialize, Serialize};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// Files up to this size are fingerprinted whole.
pub const WHOLE: u64 = 64 << 10;
/// Larger files: this many windows…
pub const WINDOWS: u64 = 16;
/// …of this many bytes.
pub const WINDOW: u64 = 4 << 10;

/// A training dataset as a checkpoint records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataRecord {
    /// How the files become tokens: `u16 token ids`, `u32 token ids`, `bytes`, `text through
    /// gpt2`, `text through tokenizer.json`, `synthetic tokens`.
    pub reads: String,
    /// The files read, in stream order (none for synthetic tokens).
    pub files: Vec<FileRecord>,
    /// A `tokenizer.json` the text went through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<FileRecord>,
    /// Tokens in the stream; None where they were not counted (text that was not tokenized,
    /// synthetic tokens, whose count follows from the spec).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
}

/// One file of a dataset.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Its path as the run named it (for messages; not compared).
    pub path: String,
    pub bytes: u64,
    /// CRC-32C of its bytes, or of its sampled windows (module header).
    pub crc32c: u32,
}

impl DataRecord {
    /// The record of `source` (paths relative to `spec_dir`): its files' sizes and fingerprints,
    /// and the tokens of token files (their size over the id width). Text's tokens are left
    /// uncounted ([`DataRecord::counted`] sets them once a run has tokenized it).
    pub fn scan(source: &DataSource, spec_dir: &Path) -> Result<DataRecord> {
        match source {
            DataSource::Synthetic => Ok(DataRecord {
                reads: "synthetic tokens".to_string(),
                files: Vec::new(),
                tokenizer: None,
                tokens: None,
            }),
            DataSource::File { path, format, .. } => {
                let reads = match format {
                    DataFormat::Bytes => "bytes".to_string(),
                    DataFormat::U16 | DataFormat::U32 => format!("{} token ids", format.name()),
                };
                let files = scan_files(spec_dir, path, format.extension())?;
                let bytes: u64 = files.iter().map(|f| f.bytes).sum();
                Ok(DataRecord {
                    reads,
                    files,
                    tokenizer: None,
                    tokens: Some(bytes / format.width()),
                })
            }
            DataSource::Text {
                path, tokenizer, ..
            } => {
                let file = match tokenizer {
                    Tokenizer::File { path } => Some(FileRecord::scan(&spec_dir.join(path))?),
                    _ => None,
                };
                Ok(DataRecord {
                    reads: format!("text through {}", tokenizer_name(tokenizer)),
                    files: scan_files(spec_dir, path, "txt")?,
                    tokenizer: file,
                    tokens: None,
                })
            }
        }
    }

    /// This record with its stream's token count, as a run counted it.
    pub fn counted(self, tokens: u64) -> DataRecord {
        DataRecord {
            tokens: Some(tokens),
            ..self
        }
    }

    /// What it names in a message: its files' count or first path, and how they are read.
    pub fn describe(&self) -> String {
        match self.files.as_slice() {
            [] => self.reads.clone(),
            [file] => format!("{} as {}", file.path, self.reads),
            [first, ..] => format!(
                "{} files from {} on, as {}",
                self.files.len(),
                first.path,
                self.reads
            ),
        }
    }
}

/// A tokenizer's name in a record: a file by its name alone (its bytes are compared).
fn tokenizer_name(tokenizer: &Tokenizer) -> String {
    match tokenizer {
        Tokenizer::File { path } => Path::new(path)
            .file_name()
            .map_or_else(|| path.clone(), |n| n.to_string_lossy().into_owned()),
        other => other.name().to_string(),
    }
}

fn scan_files(spec_dir: &Path, path: &str, extension: &str) -> Result<Vec<FileRecord>> {
    data_files(spec_dir, path, extension)?
        .iter()
        .map(|f| FileRecord::scan(f))
        .collect()
}

impl FileRecord {
    /// The size and fingerprint of `path`.
    pub fn scan(path: &Path) -> Result<FileRecord> {
        let fail = |e: std::io::Error| {
            RuntimeError::Data(format!(
                "{}: cannot read it to fingerprint the training data: {e}",
                path.display()
            ))
        };
        let mut file = std::fs::File::open(path).map_err(fail)?;
        let bytes = file.metadata().map_err(fail)?.len();
        let mut crc = 0;
        let mut buffer = Vec::new();
        for (offset, len) in windows(bytes) {
            buffer.resize(len as usize, 0);
            file.seek(SeekFrom::Start(offset)).map_err(fail)?;
            file.read_exact(&mut buffer).map_err(fail)?;
            crc = crc32c::crc32c_append(crc, &buffer);
        }
        Ok(FileRecord {
            path: path.display().to_string(),
            bytes,
            crc32c: crc,
        })
    }
}

/// The (offset, length) ranges a file of `bytes` bytes is fingerprinted by.
fn windows(bytes: u64) -> Vec<(u64, u64)> {
    if bytes <= WHOLE {
        return vec![(0, bytes)];
    }
    let last = bytes - WINDOW;
    (0..WINDOWS)
        .map(|i| (last * i / (WINDOWS - 1), WINDOW))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("parc-record-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn windows_cover_small_files_whole_and_large_ones_from_first_to_last_byte() {
        assert_eq!(windows(10), vec![(0, 10)]);
        let large = windows(1 << 20);
        assert_eq!(large.len() as u64, WINDOWS);
        assert_eq!(large[0], (0, WINDOW));
        assert_eq!(large[15], ((1 << 20) - WINDOW, WINDOW));
    }

    #[test]
    fn another_file_of_the_same_size_has_another_fingerprint_and_a_copy_the_same() {
        let dir = temp_dir("fingerprint");
        let mut bytes: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(dir.join("a.bin"), &bytes).unwrap();
        std::fs::write(dir.join("copy.bin"), &bytes).unwrap();
        bytes[199_999] ^= 1;
        std::fs::write(dir.join("b.bin"), &bytes).unwrap();
        let scan = |name: &str| FileRecord::scan(&dir.join(name)).unwrap();
        let (a, copy, b) = (scan("a.bin"), scan("copy.bin"), scan("b.bin"));
        assert_eq!((a.bytes, a.crc32c), (copy.bytes, copy.crc32c));
        assert_eq!(a.bytes, b.bytes);
        assert_ne!(a.crc32c, b.crc32c);
    }

    #[test]
    fn token_files_are_counted_by_size_and_text_is_not() {
        let dir = temp_dir("scan");
        std::fs::write(dir.join("t.bin"), [0u8; 40]).unwrap();
        let source = |path: &str, format| DataSource::File {
            path: path.to_string(),
            format,
            span: Default::default(),
        };
        let u16s = DataRecord::scan(&source("t.bin", DataFormat::U16), &dir).unwrap();
        assert_eq!(
            (u16s.tokens, u16s.reads.as_str()),
            (Some(20), "u16 token ids")
        );
        let text = DataSource::Text {
            path: "t.bin".to_string(),
            tokenizer: Tokenizer::Gpt2,
            span: Default::default(),
            tokenizer_span: Default::default(),
        };
        let record = DataRecord::scan(&text, &dir).unwrap();
        assert_eq!(
            (record.tokens, record.reads.as_str()),
            (None, "text through gpt2")
        );
        assert_eq!(record.files[0].bytes, 40);
        assert!(DataRecord::scan(&source("absent.bin", DataFormat::U16), &dir).is_err());
    }
}
