//! Tokenizers: text to token ids and back, for text data, prompts and samples.
//!
//! Three kinds, as the spec names them ([`parc_compiler::spec::Tokenizer`]):
//! - `bytes`: one token per byte (vocabulary 256, no end-of-text token);
//! - `gpt2`: GPT-2's byte-level BPE from `tiktoken-rs`, which bundles its ranks (no download);
//! - a Hugging Face `tokenizer.json`, read by the `tokenizers` crate.
//!
//! Encoding never adds special tokens (a document separator is the caller's choice, through
//! [`Tokenizer::end_of_text`]). Decoding is lossy where ids end inside a UTF-8 character;
//! [`StreamDecoder`] holds such a tail back until the character completes, so tokens can be
//! printed as they come.
use crate::error::{Result, RuntimeError};
use parc_compiler::spec::Tokenizer as TokenizerSpec;
use rayon::prelude::*;
use std::path::Path;

/// GPT-2's `<|endoftext|>` id.
const GPT2_END_OF_TEXT: u32 = 50256;

/// Special tokens that end a document in Hugging Face tokenizers, most common first.
const HF_END_OF_TEXT: [&str; 5] = [
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<|im_end|>",
    "<eos>",
];

enum Kind {
    Bytes,
    Gpt2(&'static tiktoken_rs::CoreBPE),
    Hf(Box<tokenizers::Tokenizer>),
}

/// An opened tokenizer.
pub struct Tokenizer {
    kind: Kind,
    name: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({})", self.name)
    }
}

/// The files of a Hugging Face tokenizer saved without its single-file form: GPT-2/BPE's
/// vocabulary and merges, SentencePiece's model, WordPiece's vocabulary, the settings.
const TOKENIZER_PARTS: [&str; 6] = [
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// How to get a `tokenizer.json` from a model's other tokenizer files.
const CONVERT: &str = "transformers writes one: `AutoTokenizer.from_pretrained(DIR)\
                       .save_pretrained(DIR)` in Python";

/// Why `path`, which is not a file, is no tokenizer: a folder (a model folder, whose
/// `tokenizer.json` is meant, or that holds only a tokenizer's other files) or nothing.
fn not_a_file(path: &Path) -> String {
    let alternatives = "or use `tokenizer: gpt2` or `tokenizer: bytes`";
    let folder = if path.is_dir() {
        path
    } else {
        match path.parent() {
            Some(parent)
                if parent.is_dir() && path.file_name() == Some("tokenizer.json".as_ref()) =>
            {
                parent
            }
            _ => {
                return format!(
                    "no such file; give the path of a Hugging Face `tokenizer.json`, {alternatives}"
                )
            }
        }
    };
    let inside = folder.join("tokenizer.json");
    let parts: Vec<&str> = TOKENIZER_PARTS
        .into_iter()
        .filter(|p| folder.join(p).is_file())
        .collect();
    let holds = if parts.is_empty() {
        String::new()
    } else {
        format!(
            " {} holds {}, a tokenizer's files without its tokenizer.json, which parc reads; {CONVERT}.",
            folder.display(),
            parts.join(", ")
        )
    };
    if path.is_dir() && inside.is_file() {
        format!(
            "is a folder; give its tokenizer.json: `{}`",
            inside.display()
        )
    } else if path.is_dir() {
        format!("is a folder without a tokenizer.json.{holds} Give the path of a Hugging Face `tokenizer.json`, {alternatives}")
    } else {
        format!(
            "no such file.{holds} Give the path of a Hugging Face `tokenizer.json`, {alternatives}"
        )
    }
}

fn tokenizer_error(name: &str, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Data(format!("tokenizer {name}: {what}"))
}

impl Tokenizer {
    /// Open the tokenizer a spec names; a file path is relative to `base_dir` (the spec's
    /// folder).
    pub fn open(spec: &TokenizerSpec, base_dir: &Path) -> Result<Tokenizer> {
        match spec {
            TokenizerSpec::Bytes => Ok(Tokenizer::bytes()),
            TokenizerSpec::Gpt2 => Ok(Tokenizer::gpt2()),
            TokenizerSpec::File { path } => Tokenizer::from_file(&base_dir.join(path)),
        }
    }

    /// One token per byte.
    pub fn bytes() -> Tokenizer {
        Tokenizer {
            kind: Kind::Bytes,
            name: "bytes".to_string(),
        }
    }

    /// GPT-2's BPE.
    pub fn gpt2() -> Tokenizer {
        Tokenizer {
            kind: Kind::Gpt2(tiktoken_rs::r50k_base_singleton()),
            name: "gpt2".to_string(),
        }
    }

    /// A Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let name = path.display().to_string();
        if !path.is_file() {
            return Err(tokenizer_error(&name, not_a_file(path)));
        }
        let mut hf = tokenizers::Tokenizer::from_file(path).map_err(|e| {
            let hint = path
                .file_name()
                .and_then(|n| n.to_str())
                .filter(|n| TOKENIZER_PARTS.contains(n))
                .map_or_else(String::new, |n| {
                    format!(
                        " ({n} is one of a tokenizer's files, not its tokenizer.json; {CONVERT})"
                    )
                });
            tokenizer_error(&name, format!("not a readable tokenizer.json: {e}{hint}"))
        })?;
        // Special tokens written in the text are text, as for GPT-2 (`encode`).
        hf.set_encode_special_tokens(true);
        Ok(Tokenizer {
            kind: Kind::Hf(Box::new(hf)),
            name,
        })
    }

    /// What the tokenizer is: `bytes`, `gpt2` or the file's path.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Token ids are below this.
    pub fn vocab_size(&self) -> u64 {
        match &self.kind {
            Kind::Bytes => 256,
            Kind::Gpt2(_) => u64::from(GPT2_END_OF_TEXT) + 1,
            Kind::Hf(t) => t.get_vocab_size(true) as u64,
        }
    }

    /// The id that separates documents, when the tokenizer has one.
    pub fn end_of_text(&self) -> Option<u32> {
        match &self.kind {
            Kind::Bytes => None,
            Kind::Gpt2(_) => Some(GPT2_END_OF_TEXT),
            Kind::Hf(t) => HF_END_OF_TEXT.iter().find_map(|s| t.token_to_id(s)),
        }
    }

    /// The ids of `text`, without special tokens (`<|endoftext|>` in the text is ordinary text).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with_progress(text, &|_| {})
    }

    /// The ids of `text` as [`Tokenizer::encode`] gives them, calling `progress` with the bytes
    /// of text done as parts of it finish. GPT-2's BPE encodes a long text in pieces, in
    /// parallel, cut where its pre-tokenizer always cuts ([`gpt2_pieces`]): the same ids.
    pub fn encode_with_progress(
        &self,
        text: &str,
        progress: &(dyn Fn(usize) + Sync),
    ) -> Result<Vec<u32>> {
        let ids = match &self.kind {
            Kind::Bytes => text.bytes().map(u32::from).collect(),
            Kind::Gpt2(bpe) => {
                let parts: Vec<Vec<u32>> = gpt2_pieces(text, GPT2_PIECE_BYTES)
                    .par_iter()
                    .map(|piece| {
                        let ids = bpe.encode_ordinary(piece);
                        progress(piece.len());
                        ids
                    })
                    .collect();
                return Ok(parts.concat());
            }
            Kind::Hf(t) => t
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| tokenizer_error(&self.name, format!("cannot encode: {e}")))?,
        };
        progress(text.len());
        Ok(ids)
    }

    /// The text of `ids`; an incomplete UTF-8 sequence becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.check_ids(ids)?;
        match &self.kind {
            Kind::Bytes => Ok(String::from_utf8_lossy(&byte_values(ids)).into_owned()),
            Kind::Gpt2(bpe) => bpe
                .decode_bytes(ids)
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .map_err(|e| tokenizer_error(&self.name, format!("cannot decode: {e}"))),
            Kind::Hf(t) => t
                .decode(ids, false)
                .map_err(|e| tokenizer_error(&self.name, format!("cannot decode: {e}"))),
        }
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.vocab_size();
        match ids.iter().find(|&&id| u64::from(id) >= vocab) {
            Some(id) => Err(tokenizer_error(
                &self.name,
                format!(
                    "token id {id} is outside its vocabulary of {vocab}; the model's vocabulary is \
                     larger than the tokenizer's (padding), and the model produced a padding id"
                ),
            )),
            None => Ok(()),
        }
    }
}

/// Bytes of text GPT-2's BPE encodes as one piece of a long text.
const GPT2_PIECE_BYTES: usize = 1 << 20;

/// `text` cut into pieces of at least `size` bytes (the last may be shorter), each cut just
/// after a newline with a non-whitespace character on both sides (`a\nb`). GPT-2's
/// pre-tokenizer (`'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s`)
/// always cuts on both sides of such a newline, which is a piece of its own whether text follows
/// it or not, and its patterns look at nothing before where they start: so the pieces' ids,
/// concatenated, are the ids of the whole text.
fn gpt2_pieces(text: &str, size: usize) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while rest.len() > size {
        let cut = rest.as_bytes()[size..]
            .iter()
            .enumerate()
            .filter(|(_, &b)| b == b'\n')
            .map(|(i, _)| size + i)
            .find(|&i| newline_between_words(rest, i));
        let Some(at) = cut else { break };
        let (piece, tail) = rest.split_at(at + 1);
        pieces.push(piece);
        rest = tail;
    }
    pieces.push(rest);
    pieces
}

/// Whether the newline at byte `i` of `text` has a non-whitespace character on both sides.
fn newline_between_words(text: &str, i: usize) -> bool {
    let (before, after) = (&text[..i], &text[i + 1..]);
    before
        .chars()
        .next_back()
        .is_some_and(|c| !c.is_whitespace())
        && after.chars().next().is_some_and(|c| !c.is_whitespace())
}

/// Byte tokens as bytes (ids are below 256 once checked).
fn byte_values(ids: &[u32]) -> Vec<u8> {
    ids.iter().map(|&id| id as u8).collect()
}

/// Decodes a growing list of ids piece by piece: [`StreamDecoder::push`] returns the text the
/// new id completes, holding back a trailing incomplete character.
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    /// Characters of the decoded text already returned.
    emitted: usize,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> StreamDecoder<'a> {
        StreamDecoder {
            tokenizer,
            ids: Vec::new(),
            emitted: 0,
        }
    }

    /// Add one id; the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids)?;
        let complete = text.trim_end_matches(char::REPLACEMENT_CHARACTER);
        let fresh: String = complete.chars().skip(self.emitted).collect();
        self.emitted += fresh.chars().count();
        Ok(fresh)
    }

    /// Whatever is held back, replacement characters included (at the end of a sample).
    pub fn finish(self) -> Result<String> {
        let text = self.tokenizer.decode(&self.ids)?;
        Ok(text.chars().skip(self.emitted).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip() {
        let t = Tokenizer::bytes();
        let ids = t.encode("héllo").unwrap();
        assert_eq!(ids.len(), 6);
        assert_eq!(t.decode(&ids).unwrap(), "héllo");
        assert_eq!(t.end_of_text(), None);
    }

    #[test]
    fn gpt2_matches_the_published_ids() {
        let t = Tokenizer::gpt2();
        // GPT-2's ids for "Hello world" (as transformers' GPT2TokenizerFast gives them).
        assert_eq!(t.encode("Hello world").unwrap(), vec![15496, 995]);
        assert_eq!(t.end_of_text(), Some(50256));
        assert_eq!(t.vocab_size(), 50257);
        let ids = t.encode("<|endoftext|>").unwrap();
        assert!(
            !ids.contains(&50256),
            "special tokens are not parsed from text"
        );
    }

    /// Keep in step with `GPT2_SAMPLE` in tests/data/make_tokenizer_data.py.
    const GPT2_SAMPLE: &str =
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\n\n  \
        It's 2024; they'll say   \"naïve café\" costs $3.50 — 東京 🚀!\t<|endoftext|> end \n";

    #[test]
    fn gpt2_matches_transformers_gpt2_tokenizer_fast() {
        // transformers' GPT2TokenizerFast on GPT2_SAMPLE (tests/data/make_tokenizer_data.py;
        // its literal `<|endoftext|>` encoded as text).
        let expected = [
            5962, 22307, 25, 198, 8421, 356, 5120, 597, 2252, 11, 3285, 502, 2740, 13, 628, 198,
            220, 632, 338, 48609, 26, 484, 1183, 910, 220, 220, 366, 2616, 38776, 40304, 1, 3484,
            720, 18, 13, 1120, 851, 10545, 251, 109, 12859, 105, 12520, 248, 222, 0, 197, 27, 91,
            437, 1659, 5239, 91, 29, 886, 220, 198,
        ];
        let t = Tokenizer::gpt2();
        let ids = t.encode(GPT2_SAMPLE).unwrap();
        assert_eq!(ids, expected);
        assert_eq!(t.decode(&ids).unwrap(), GPT2_SAMPLE);
    }

    /// A model folder given where its tokenizer.json is meant, or a folder holding only a
    /// tokenizer's other files (vocab.json and merges.txt, no tokenizer.json), is named with
    /// what it holds and what to do, not as "no such file".
    #[test]
    fn a_folder_or_a_tokenizer_s_other_files_say_what_to_do() {
        let pid = std::process::id();
        let dir = std::env::temp_dir().join(format!("parc-tokenizer-parts-{pid}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("vocab.json"), "{}").unwrap();
        std::fs::write(dir.join("merges.txt"), "#version: 0.2\n").unwrap();
        let err = |p: &Path| Tokenizer::from_file(p).unwrap_err().to_string();
        for given in [dir.clone(), dir.join("tokenizer.json")] {
            let e = err(&given);
            assert!(
                e.contains(
                    "holds vocab.json, merges.txt, a tokenizer's files without its \
                            tokenizer.json"
                ) && e.contains("save_pretrained(DIR)"),
                "{e}"
            );
        }
        let e = err(&dir.join("vocab.json"));
        assert!(
            e.contains("(vocab.json is one of a tokenizer's files, not its tokenizer.json"),
            "{e}"
        );
        let e = err(&dir.join("nowhere").join("tokenizer.json"));
        assert!(
            e.contains("no such file; give the path of a Hugging Face `tokenizer.json`"),
            "{e}"
        );
        let tiny = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/data/tiny-tokenizer.json"
        );
        std::fs::copy(tiny, dir.join("tokenizer.json")).unwrap();
        let e = err(&dir);
        assert!(e.contains("is a folder; give its tokenizer.json: `"), "{e}");
        assert!(Tokenizer::from_file(&dir.join("tokenizer.json")).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_tokenizer_json_encodes_decodes_and_ends_documents() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/data/tiny-tokenizer.json"
        );
        let t = Tokenizer::from_file(Path::new(path)).unwrap();
        assert_eq!((t.vocab_size(), t.end_of_text()), (320, Some(0)));
        // The ids the Python `tokenizers` library gives (tests/data/make_tokenizer_data.py).
        let sample = "First Citizen:\nYou are all resolved rather to die than to famish?";
        let expected = [
            38, 299, 302, 221, 35, 271, 73, 90, 276, 26, 199, 57, 259, 260, 264, 260, 274, 221,
            264, 83, 79, 76, 297, 68, 221, 82, 296, 258, 82, 288, 291, 73, 69, 257, 266, 78, 288,
            275, 65, 77, 279, 72, 31,
        ];
        let ids = t.encode(sample).unwrap();
        assert_eq!(ids, expected);
        assert_eq!(t.decode(&ids).unwrap(), sample);
        let special = t.encode("a<|endoftext|>b").unwrap();
        assert!(
            !special.contains(&0),
            "special tokens in text are text: {special:?}"
        );
        let err = t.decode(&[320]).unwrap_err().to_string();
        assert!(err.contains("320"), "{err}");
    }

    #[test]
    fn gpt2_encodes_a_long_text_in_pieces_to_the_same_ids() {
        let text = include_str!("../../../examples/data/tiny-shakespeare.txt");
        let text = format!("{text} \u{3000}\nX\r\nY  \n\nZ\u{a0}\na\nb");
        let bpe = tiktoken_rs::r50k_base_singleton();
        let whole = bpe.encode_ordinary(&text);
        for size in [1, 7, 1000, 40_000] {
            let pieces = gpt2_pieces(&text, size);
            assert_eq!(pieces.concat(), text);
            assert!(pieces.len() > 1);
            let ids: Vec<u32> = pieces.iter().flat_map(|p| bpe.encode_ordinary(p)).collect();
            assert_eq!(ids, whole, "pieces of {size} bytes");
        }
        let done = std::sync::atomic::AtomicUsize::new(0);
        let add = |n| {
            done.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        };
        let t = Tokenizer::gpt2();
        assert_eq!(t.encode_with_progress(&text, &add).unwrap(), whole);
        assert_eq!(done.into_inner(), text.len());
    }

    #[test]
    fn ids_past_the_vocabulary_are_an_error() {
        let err = Tokenizer::gpt2().decode(&[50300]).unwrap_err().to_string();
        assert!(err.contains("50300"), "{err}");
    }

    #[test]
    fn a_missing_file_is_named() {
        let err = Tokenizer::open(
            &TokenizerSpec::File {
                path: "nope/tokenizer.json".into(),
            },
            Path::new("/tmp"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("nope/tokenizer.json"), "{err}");
    }

    #[test]
    fn streaming_holds_back_split_characters() {
        let t = Tokenizer::bytes();
        let mut s = StreamDecoder::new(&t);
        let ids = t.encode("aé").unwrap();
        assert_eq!(s.push(ids[0]).unwrap(), "a");
        assert_eq!(s.push(ids[1]).unwrap(), "");
        assert_eq!(s.push(ids[2]).unwrap(), "é");
        assert_eq!(s.finish().unwrap(), "");
    }
}
