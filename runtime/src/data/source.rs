//! Token sources: a [`Dataset`] is the token stream of a spec's `train.data`, validated against
//! the model's vocabulary and sequence length when it is opened, and cut into samples of
//! `seq + 1` tokens (see the module header of `data`).
//!
//! A source's path may name several files (a folder of shards, a glob: [`files`](super::files));
//! their tokens are concatenated in sorted name order into one stream. Text through a tokenizer
//! is tokenized here, when the run starts (`parc tokenize` does it once, ahead of runs). Files
//! are read whole into memory (the bundled examples are small; a memory-mapped reader can
//! replace `Tokens::Owned` without changing the API). Synthetic data is a pure function of the
//! seed and the token index, so it costs no memory and is identical on every rank.
use super::files::data_files;
use super::record::DataRecord;
use super::shards::read_info;
use super::text::tokenize_files;
use super::tokenizer::Tokenizer;
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::{position_at, segments_len, Segment};
use parc_compiler::spec::{DataFormat, DataSource, Tokenizer as TokenizerSpec};
use std::path::{Path, PathBuf};

/// Where a dataset's tokens live.
#[derive(Clone, Debug)]
enum Tokens {
    Owned(Vec<u32>),
    /// Uniform tokens in `[0, vocab)`, `len` of them, from `seed`.
    Synthetic {
        seed: u64,
        vocab: u64,
        len: u64,
    },
}

/// A validated token stream and its samples.
#[derive(Clone, Debug)]
pub struct Dataset {
    tokens: Tokens,
    seq: u64,
    /// What errors call it: the file, or `synthetic data`.
    name: String,
    /// What checkpoints record of it (None for tokens given in memory).
    record: Option<DataRecord>,
}

/// splitmix64 output mixer (also used by the sampler's generator).
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn data_error(file: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Data(format!("{}: {what}", file.display()))
}

impl Dataset {
    /// Open the spec's data source. File paths are relative to `spec_dir` (the folder of the
    /// `.par` file). `synthetic_samples` is how many samples a synthetic source provides.
    pub fn open(
        source: &DataSource,
        spec_dir: &Path,
        vocab: u64,
        seq: u64,
        seed: u64,
        synthetic_samples: u64,
    ) -> Result<Dataset> {
        if seq == 0 {
            return Err(RuntimeError::Data(
                "the model's sequence length is 0; set `seq` to at least 1".to_string(),
            ));
        }
        match source {
            DataSource::Synthetic => Ok(Dataset {
                tokens: Tokens::Synthetic {
                    seed,
                    vocab,
                    len: synthetic_samples.max(1) * seq + 1,
                },
                seq,
                name: "synthetic data".to_string(),
                record: Some(DataRecord::scan(source, spec_dir)?),
            }),
            DataSource::File { path, format, .. } => {
                let tokens = read_token_files(spec_dir, path, *format, vocab)?;
                Dataset::from_tokens(&stream_name(spec_dir, path), tokens, vocab, seq)?
                    .recorded(source, spec_dir)
            }
            DataSource::Text {
                path, tokenizer, ..
            } => {
                let tokens = read_text_files(spec_dir, path, tokenizer, vocab)?;
                Dataset::from_tokens(&stream_name(spec_dir, path), tokens, vocab, seq)?
                    .recorded(source, spec_dir)
            }
        }
    }

    /// This dataset with the record of `source`, whose tokens it holds.
    fn recorded(self, source: &DataSource, spec_dir: &Path) -> Result<Dataset> {
        let record = DataRecord::scan(source, spec_dir)?.counted(self.token_count());
        Ok(Dataset {
            record: Some(record),
            ..self
        })
    }

    /// A dataset over tokens already in memory (tests, and the file reader above). `name` is
    /// what errors call it.
    pub fn from_tokens(name: &str, tokens: Vec<u32>, vocab: u64, seq: u64) -> Result<Dataset> {
        let file = PathBuf::from(name);
        if tokens.is_empty() {
            return Err(data_error(&file, "the file is empty; it must hold tokens"));
        }
        check_ids(&file, &tokens, vocab)?;
        let len = tokens.len() as u64;
        if seq == 0 || len < seq + 1 {
            return Err(data_error(
                &file,
                format!(
                    "{len} tokens are too few for one sample of seq + 1 = {} tokens; use more \
                     data or a shorter `seq`",
                    seq + 1
                ),
            ));
        }
        Ok(Dataset {
            tokens: Tokens::Owned(tokens),
            seq,
            name: name.to_string(),
            record: None,
        })
    }

    /// What errors call it: its file, or `synthetic data`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What checkpoints record of it: its files' sizes and fingerprints and its token count
    /// (`record`); None for tokens given in memory.
    pub fn record(&self) -> Option<&DataRecord> {
        self.record.as_ref()
    }

    /// Seeded random tokens rather than a file's.
    pub fn is_synthetic(&self) -> bool {
        matches!(self.tokens, Tokens::Synthetic { .. })
    }

    /// Tokens per sample, less the target's one more.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Tokens in the stream.
    pub fn token_count(&self) -> u64 {
        match &self.tokens {
            Tokens::Owned(t) => t.len() as u64,
            Tokens::Synthetic { len, .. } => *len,
        }
    }

    /// Number of samples: windows of `seq + 1` tokens starting every `seq` tokens.
    pub fn num_samples(&self) -> u64 {
        (self.token_count() - 1) / self.seq
    }

    /// Token `index` of the stream (callers stay below `token_count`).
    fn token(&self, index: u64) -> u32 {
        match &self.tokens {
            Tokens::Owned(t) => usize::try_from(index)
                .ok()
                .and_then(|i| t.get(i).copied())
                .unwrap_or(0),
            Tokens::Synthetic { seed, vocab, .. } => {
                let bits = mix64(mix64(seed ^ 0x5eed_da7a_0000_0000) ^ index);
                (bits % (*vocab).max(1)) as u32
            }
        }
    }

    /// Token `offset` (0 ..= seq) of sample `sample`.
    pub fn sample_token(&self, sample: u64, offset: u64) -> u32 {
        self.token(sample * self.seq + offset)
    }
}

/// What errors call a source's stream: its path under the spec's folder.
fn stream_name(spec_dir: &Path, path: &str) -> String {
    spec_dir.join(path).display().to_string()
}

/// Every id of `file`'s tokens is below `vocab`, or an error naming the first that is not.
fn check_ids(file: &Path, tokens: &[u32], vocab: u64) -> Result<()> {
    match tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| u64::from(t) >= vocab)
    {
        Some((at, &token)) => Err(data_error(
            file,
            format!(
                "token {token} at position {at} is not below the model's vocab = {vocab}; \
                 raise `vocab` to at least {} or re-tokenize the data",
                u64::from(token) + 1
            ),
        )),
        None => Ok(()),
    }
}

/// The tokens of the files `path` names (`.bin` shards of a folder, or `.txt` files read `as
/// bytes`), concatenated in name order; each file's ids are checked against `vocab` so an error
/// names the file. A folder's `info.json` (from `parc tokenize`) must agree with `format`.
fn read_token_files(
    spec_dir: &Path,
    path: &str,
    format: DataFormat,
    vocab: u64,
) -> Result<Vec<u32>> {
    let files = data_files(spec_dir, path, format.extension())?;
    check_shard_format(&spec_dir.join(path), format)?;
    let mut tokens = Vec::new();
    for file in &files {
        let bytes =
            std::fs::read(file).map_err(|e| data_error(file, format!("cannot read it: {e}")))?;
        let ids = decode(file, &bytes, format)?;
        check_ids(file, &ids, vocab)?;
        tokens.extend(ids);
    }
    Ok(tokens)
}

/// A shard folder written for another id width is refused: read as the wrong width, its bytes
/// would be other tokens.
pub fn check_shard_format(dir: &Path, format: DataFormat) -> Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    match read_info(dir)? {
        Some(info) if info.dtype != format => {
            let (wrote, asked) = (info.dtype.name(), format.name());
            Err(data_error(
                dir,
                format!(
                    "its info.json says the shards hold {wrote} token ids, but `train.data` \
                     reads them `as {asked}`; write `as {wrote}`"
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// The tokens of the text files `path` names, one document per file, through the tokenizer;
/// the tokenizer's ids must fit the model's `vocab`.
fn read_text_files(
    spec_dir: &Path,
    path: &str,
    tokenizer: &TokenizerSpec,
    vocab: u64,
) -> Result<Vec<u32>> {
    let files = data_files(spec_dir, path, "txt")?;
    let tokenizer = Tokenizer::open(tokenizer, spec_dir)?;
    let size = tokenizer.vocab_size();
    if size > vocab {
        return Err(RuntimeError::Data(format!(
            "tokenizer {} has {size} tokens, more than the model's vocab = {vocab}; set `let \
             vocab = {}` in the model (its size rounded up to a multiple of 64)",
            tokenizer.name(),
            size.div_ceil(64) * 64
        )));
    }
    tokenize_files(&tokenizer, &files)
}

/// A token file of `len` bytes read in `format` is refused where it is empty or not a whole
/// number of ids: the one rule `parc run` reads by and `parc check` checks sizes by.
pub fn check_token_file_size(file: &Path, len: u64, format: DataFormat) -> Result<()> {
    if len == 0 {
        return Err(data_error(file, "the file is empty; it must hold tokens"));
    }
    let width = format.width();
    if !len.is_multiple_of(width) {
        return Err(data_error(
            file,
            format!(
                "{len} bytes is not a whole number of {width}-byte tokens; the file is \
                 truncated or not `as {}`",
                format.name()
            ),
        ));
    }
    Ok(())
}

/// Decode a file's bytes in `format`, or say why they are malformed.
fn decode(file: &Path, bytes: &[u8], format: DataFormat) -> Result<Vec<u32>> {
    check_token_file_size(file, bytes.len() as u64, format)?;
    if format == DataFormat::Bytes {
        return Ok(bytes.iter().map(|&b| u32::from(b)).collect());
    }
    let width = format.width() as usize;
    Ok(bytes
        .chunks_exact(width)
        .map(|c| match *c {
            [a, b] => u32::from(u16::from_le_bytes([a, b])),
            [a, b, c, d] => u32::from_le_bytes([a, b, c, d]),
            _ => 0,
        })
        .collect())
}

/// Fill a microbatch's token and target buffers (`[segments_len(positions), samples.len()]`,
/// sequence-major: element `s * batch + b` is local position `s` of sample `b`) with the global
/// sequence `positions` of `samples`.
pub fn fill_microbatch(
    dataset: &Dataset,
    samples: &[u64],
    positions: &[Segment],
    tokens: &mut [i32],
    targets: &mut [i32],
) -> Result<()> {
    let batch = samples.len();
    let local = segments_len(positions) as usize;
    let want = local * batch;
    if tokens.len() != want || targets.len() != want {
        return Err(RuntimeError::Data(format!(
            "microbatch of {batch} samples × {local} positions needs buffers of {want} tokens, \
             got {} and {} (a lowering bug)",
            tokens.len(),
            targets.len()
        )));
    }
    for s in 0..local {
        let pos = position_at(positions, s as u32)
            .map(u64::from)
            .filter(|&p| p < dataset.seq)
            .ok_or_else(|| {
                RuntimeError::Data(format!(
                    "local position {s} of segments {positions:?} is outside the sequence of \
                     {} tokens (a lowering bug)",
                    dataset.seq
                ))
            })?;
        for (b, &sample) in samples.iter().enumerate() {
            tokens[s * batch + b] = dataset.sample_token(sample, pos) as i32;
            targets[s * batch + b] = dataset.sample_token(sample, pos + 1) as i32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::shards::ShardWriter;
    use super::*;
    use parc_compiler::diag::Span;

    fn temp_file(name: &str, bytes: &[u8]) -> (PathBuf, PathBuf) {
        let dir = std::env::temp_dir().join(format!("parc-data-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
        (dir.clone(), dir.join(name))
    }

    fn file_source(path: &str, format: DataFormat) -> DataSource {
        DataSource::File {
            path: path.to_string(),
            format,
            span: Span::default(),
        }
    }

    fn open_err(bytes: &[u8], name: &str, format: DataFormat, vocab: u64, seq: u64) -> String {
        let (dir, _) = temp_file(name, bytes);
        Dataset::open(&file_source(name, format), &dir, vocab, seq, 0, 0)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn byte_files_are_one_token_per_byte_relative_to_the_spec_folder() {
        let (dir, _) = temp_file("text.txt", b"hello world");
        let d = Dataset::open(
            &file_source("text.txt", DataFormat::Bytes),
            &dir,
            256,
            4,
            0,
            0,
        )
        .unwrap();
        // 11 tokens, windows of 5 every 4: starts 0, 4 (8 would need token 12).
        assert_eq!(d.num_samples(), 2);
        assert_eq!(d.sample_token(1, 0), u32::from(b'o'));
        assert_eq!(d.sample_token(1, 4), u32::from(b'r'));
    }

    #[test]
    fn u16_and_u32_files_are_little_endian() {
        let (dir, _) = temp_file("t16.bin", &[1, 0, 0, 1, 255, 255]);
        let d = Dataset::open(
            &file_source("t16.bin", DataFormat::U16),
            &dir,
            65536,
            2,
            0,
            0,
        )
        .unwrap();
        assert_eq!(
            (0..3).map(|i| d.sample_token(0, i)).collect::<Vec<_>>(),
            [1, 256, 65535]
        );
        let (dir, _) = temp_file("t32.bin", &[1, 0, 1, 0, 2, 0, 0, 0]);
        let d = Dataset::open(
            &file_source("t32.bin", DataFormat::U32),
            &dir,
            70000,
            1,
            0,
            0,
        )
        .unwrap();
        assert_eq!(d.sample_token(0, 0), 65537);
        assert_eq!(d.sample_token(0, 1), 2);
    }

    #[test]
    fn malformed_files_get_errors_that_name_the_file_and_the_fix() {
        let missing = Dataset::open(
            &file_source("nope.txt", DataFormat::Bytes),
            Path::new("/nonexistent-parc"),
            256,
            4,
            0,
            0,
        )
        .unwrap_err()
        .to_string();
        assert!(
            missing.contains("nope.txt") && missing.contains("no such file"),
            "{missing}"
        );
        // (contents, name, format, sequence length, what the error says)
        type Case = (
            &'static [u8],
            &'static str,
            DataFormat,
            u64,
            [&'static str; 2],
        );
        let (bytes, u16) = (DataFormat::Bytes, DataFormat::U16);
        let cases: [Case; 4] = [
            (b"", "empty.txt", bytes, 4, ["empty.txt", "empty"]),
            (&[1, 2, 3], "odd.bin", u16, 1, ["odd.bin", "3 bytes"]),
            (
                &[1, 0, 44, 1],
                "big.bin",
                u16,
                1,
                ["token 300 at position 1", "at least 301"],
            ),
            (b"abc", "short.txt", bytes, 8, ["short.txt", "too few"]),
        ];
        for (contents, name, format, seq, says) in cases {
            let err = open_err(contents, name, format, 256, seq);
            assert!(says.iter().all(|s| err.contains(s)), "{err}");
        }
    }

    fn text_source(path: &str, tokenizer: TokenizerSpec) -> DataSource {
        DataSource::Text {
            path: path.to_string(),
            tokenizer,
            span: Span::default(),
            tokenizer_span: Span::default(),
        }
    }

    fn stream(d: &Dataset) -> Vec<u32> {
        (0..d.token_count()).map(|i| d.token(i)).collect()
    }

    #[test]
    fn text_is_tokenized_one_document_per_file_in_name_order() {
        let (dir, _) = temp_file("b.txt", b"Hello");
        std::fs::write(dir.join("a.txt"), b"Hello world").unwrap();
        let gpt2 = |path| {
            Dataset::open(
                &text_source(path, TokenizerSpec::Gpt2),
                &dir,
                50304,
                2,
                0,
                0,
            )
        };
        assert_eq!(stream(&gpt2("a.txt").unwrap()), [15496, 995, 50256]);
        let both = [15496, 995, 50256, 15496, 50256];
        assert_eq!(stream(&gpt2(".").unwrap()), both);
        assert_eq!(stream(&gpt2("*.txt").unwrap()), both);
        let small = Dataset::open(
            &text_source("a.txt", TokenizerSpec::Gpt2),
            &dir,
            50000,
            2,
            0,
            0,
        );
        let err = small.unwrap_err().to_string();
        assert!(
            err.contains("50257") && err.contains("let vocab = 50304"),
            "{err}"
        );
        let json = TokenizerSpec::File {
            path: "missing/tokenizer.json".into(),
        };
        let err = Dataset::open(&text_source("a.txt", json), &dir, 50304, 2, 0, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing/tokenizer.json"), "{err}");
    }

    #[test]
    fn a_shard_folder_is_one_stream_and_its_info_must_match_the_width() {
        let dir = std::env::temp_dir().join(format!("parc-data-{}-shards", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut w = ShardWriter::create(&dir.join("tok"), DataFormat::U16, 3).unwrap();
        w.push(&[1, 2, 3, 4, 5, 6, 7]).unwrap();
        w.finish(&Tokenizer::gpt2(), 1).unwrap();
        let open = |format| Dataset::open(&file_source("tok", format), &dir, 50304, 2, 0, 0);
        assert_eq!(
            stream(&open(DataFormat::U16).unwrap()),
            [1, 2, 3, 4, 5, 6, 7]
        );
        let err = open(DataFormat::U32).unwrap_err().to_string();
        assert!(err.contains("info.json") && err.contains("as u16"), "{err}");
    }

    #[test]
    fn synthetic_tokens_are_seeded_and_below_vocab() {
        let open = |seed| Dataset::open(&DataSource::Synthetic, Path::new("."), 50, 8, seed, 10);
        let (a, b, c) = (open(1).unwrap(), open(1).unwrap(), open(2).unwrap());
        assert_eq!(a.num_samples(), 10);
        let tokens = |d: &Dataset| (0..=8).map(|i| d.sample_token(3, i)).collect::<Vec<_>>();
        assert_eq!(tokens(&a), tokens(&b));
        assert_ne!(tokens(&a), tokens(&c));
        assert!((0..10).all(|s| (0..=8).all(|i| a.sample_token(s, i) < 50)));
    }

    #[test]
    fn microbatches_are_sequence_major_and_targets_are_shifted_inputs() {
        let d = Dataset::from_tokens("mem", (0..100).collect(), 100, 8).unwrap();
        let positions = [Segment { start: 0, len: 2 }, Segment { start: 6, len: 2 }];
        let (mut tokens, mut targets) = (vec![0; 8], vec![0; 8]);
        fill_microbatch(&d, &[0, 3], &positions, &mut tokens, &mut targets).unwrap();
        // Sample 3 starts at token 24; local positions are global 0, 1, 6, 7.
        assert_eq!(tokens, [0, 24, 1, 25, 6, 30, 7, 31]);
        assert_eq!(targets, [1, 25, 2, 26, 7, 31, 8, 32]);
        let beyond = [Segment { start: 7, len: 2 }];
        let err = fill_microbatch(&d, &[0, 3], &beyond, &mut tokens, &mut targets);
        assert!(err.is_err());
    }
}
