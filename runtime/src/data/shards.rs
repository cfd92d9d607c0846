//! Token shard folders, as `parc tokenize` writes them and `data = "DIR" as u16|u32` reads
//! them: `shard-00000.bin`, `shard-00001.bin`, … of little-endian token ids, each holding at
//! most `shard_tokens` of them, and `info.json` naming the tokenizer, the id width and each
//! shard's token count. The folder is one token stream: shards are its pieces in name order, and
//! a document may continue from one shard into the next.
use super::tokenizer::Tokenizer;
use crate::error::{Result, RuntimeError};
use parc_compiler::spec::DataFormat;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The name of the folder's description.
pub const INFO_FILE: &str = "info.json";

/// `info.json`: what a shard folder holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// `bytes`, `gpt2` or the tokenizer.json's path.
    pub tokenizer: String,
    /// Token ids are below this.
    pub vocab_size: u64,
    /// The id that follows each document, if the tokenizer has one.
    pub end_of_text: Option<u32>,
    /// `u16` or `u32`: how `train.data` reads the folder (`as u16`).
    pub dtype: DataFormat,
    /// Documents (input files) tokenized.
    pub documents: u64,
    /// Tokens in all shards.
    pub tokens: u64,
    /// The shards in stream order.
    pub shards: Vec<Shard>,
}

/// One shard file of a folder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Shard {
    /// Its file name inside the folder.
    pub file: String,
    pub tokens: u64,
}

fn shard_error(path: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Data(format!("{}: {what}", path.display()))
}

/// How `info.json` names a tokenizer: a built-in one by its name, a tokenizer.json by its
/// absolute path (the folder is read from other working folders later).
fn recorded_name(tokenizer: &Tokenizer) -> String {
    let name = tokenizer.name();
    if parc_compiler::spec::Tokenizer::from_name(name).is_some() {
        return name.to_string();
    }
    std::path::absolute(name).map_or_else(|_| name.to_string(), |p| p.display().to_string())
}

/// The id width for a vocabulary: u16 when every id fits, else u32.
pub fn format_for(vocab_size: u64) -> DataFormat {
    if vocab_size <= 1 << 16 {
        DataFormat::U16
    } else {
        DataFormat::U32
    }
}

/// Writes a token stream into a new shard folder.
pub struct ShardWriter {
    dir: PathBuf,
    dtype: DataFormat,
    shard_tokens: u64,
    /// The open shard's writer and path.
    current: Option<(std::io::BufWriter<std::fs::File>, PathBuf)>,
    shards: Vec<Shard>,
}

impl ShardWriter {
    /// Start a folder of `dtype` (u16 or u32) shards of at most `shard_tokens` tokens. The
    /// folder is created, or must be empty: stale shards in it would be read as data.
    pub fn create(dir: &Path, dtype: DataFormat, shard_tokens: u64) -> Result<ShardWriter> {
        if dtype == DataFormat::Bytes {
            return Err(shard_error(
                dir,
                "shards hold u16 or u32 token ids, not bytes",
            ));
        }
        if shard_tokens == 0 {
            return Err(shard_error(dir, "a shard must hold at least one token"));
        }
        let mut existing = std::fs::read_dir(dir).into_iter().flatten();
        if existing.next().is_some() {
            return Err(shard_error(
                dir,
                "the folder is not empty; remove it or write to a new folder (old shards in it \
                 would be read as data)",
            ));
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| shard_error(dir, format!("cannot create the folder: {e}")))?;
        Ok(ShardWriter {
            dir: dir.to_path_buf(),
            dtype,
            shard_tokens,
            current: None,
            shards: Vec::new(),
        })
    }

    /// Append tokens to the stream, starting new shards as they fill.
    pub fn push(&mut self, mut tokens: &[u32]) -> Result<()> {
        while !tokens.is_empty() {
            let room = self.room()?;
            let (now, rest) = tokens.split_at(room.min(tokens.len()));
            self.write(now)?;
            tokens = rest;
        }
        Ok(())
    }

    /// Tokens the open shard still takes, opening a new one when it is full or none is open.
    fn room(&mut self) -> Result<usize> {
        let full = self
            .shards
            .last()
            .is_none_or(|s| s.tokens >= self.shard_tokens);
        if self.current.is_none() || full {
            self.close()?;
            let name = format!("shard-{:05}.bin", self.shards.len());
            let path = self.dir.join(&name);
            let file = std::fs::File::create(&path)
                .map_err(|e| shard_error(&path, format!("cannot create it: {e}")))?;
            self.current = Some((std::io::BufWriter::new(file), path));
            self.shards.push(Shard {
                file: name,
                tokens: 0,
            });
        }
        let used = self.shards.last().map_or(0, |s| s.tokens);
        Ok(usize::try_from(self.shard_tokens - used).unwrap_or(usize::MAX))
    }

    fn write(&mut self, tokens: &[u32]) -> Result<()> {
        let Some((out, path)) = self.current.as_mut() else {
            return Ok(());
        };
        let mut bytes = Vec::with_capacity(tokens.len() * 4);
        for &t in tokens {
            match self.dtype {
                DataFormat::U16 => {
                    let t = u16::try_from(t).map_err(|_| {
                        shard_error(
                            path,
                            format!("token {t} does not fit u16; write u32 shards"),
                        )
                    })?;
                    bytes.extend_from_slice(&t.to_le_bytes());
                }
                _ => bytes.extend_from_slice(&t.to_le_bytes()),
            }
        }
        out.write_all(&bytes)
            .map_err(|e| shard_error(path, format!("cannot write: {e}")))?;
        if let Some(shard) = self.shards.last_mut() {
            shard.tokens += tokens.len() as u64;
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        if let Some((mut out, path)) = self.current.take() {
            out.flush()
                .map_err(|e| shard_error(&path, format!("cannot write: {e}")))?;
        }
        Ok(())
    }

    /// Remove the shards written so far (after a failure: a partial folder would read as a
    /// shorter stream); the folder goes too when nothing else is in it.
    pub fn discard(mut self) {
        self.current = None;
        for shard in &self.shards {
            let _ = std::fs::remove_file(self.dir.join(&shard.file));
        }
        let _ = std::fs::remove_dir(&self.dir);
    }

    /// Close the last shard and write `info.json`; its contents are returned. A stream of no
    /// tokens is an error (there would be nothing to read).
    pub fn finish(mut self, tokenizer: &Tokenizer, documents: u64) -> Result<ShardInfo> {
        self.close()?;
        if self.shards.is_empty() {
            return Err(shard_error(
                &self.dir,
                "no tokens to write: the input text is empty",
            ));
        }
        let info = ShardInfo {
            tokenizer: recorded_name(tokenizer),
            vocab_size: tokenizer.vocab_size(),
            end_of_text: tokenizer.end_of_text(),
            dtype: self.dtype,
            documents,
            tokens: self.shards.iter().map(|s| s.tokens).sum(),
            shards: self.shards,
        };
        let path = self.dir.join(INFO_FILE);
        let json = serde_json::to_string_pretty(&info)
            .map_err(|e| shard_error(&path, format!("cannot describe the shards: {e}")))?;
        std::fs::write(&path, json + "\n")
            .map_err(|e| shard_error(&path, format!("cannot write it: {e}")))?;
        Ok(info)
    }
}

/// The folder's `info.json`, when it has one.
pub fn read_info(dir: &Path) -> Result<Option<ShardInfo>> {
    let path = dir.join(INFO_FILE);
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path)
        .map_err(|e| shard_error(&path, format!("cannot read it: {e}")))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| shard_error(&path, format!("not a shard folder's info.json: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("parc-shards-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn tokens_fill_shards_in_order_and_info_counts_them() {
        let dir = fresh("fill");
        let mut w = ShardWriter::create(&dir, DataFormat::U16, 4).unwrap();
        w.push(&[1, 2, 3]).unwrap();
        w.push(&[4, 5, 6, 7, 8, 9]).unwrap();
        let info = w.finish(&Tokenizer::gpt2(), 2).unwrap();
        let counts: Vec<u64> = info.shards.iter().map(|s| s.tokens).collect();
        assert_eq!(counts, [4, 4, 1]);
        assert_eq!((info.tokens, info.documents), (9, 2));
        assert_eq!(read_info(&dir).unwrap(), Some(info));
        let second = std::fs::read(dir.join("shard-00001.bin")).unwrap();
        assert_eq!(second, [5, 0, 6, 0, 7, 0, 8, 0]);
    }

    #[test]
    fn a_folder_in_use_or_a_token_too_wide_is_refused() {
        let dir = fresh("refuse");
        let mut w = ShardWriter::create(&dir, DataFormat::U16, 10).unwrap();
        let err = w.push(&[70_000]).unwrap_err().to_string();
        assert!(err.contains("70000") && err.contains("u32"), "{err}");
        let err = ShardWriter::create(&dir, DataFormat::U16, 10)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("not empty"), "{err}");
        w.discard();
        assert!(!dir.exists());
        assert_eq!(format_for(50_257), DataFormat::U16);
        assert_eq!(format_for(128_256), DataFormat::U32);
    }
}
