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
            return Err(tokenizer_error(
                &name,
                "no such file; give the path of a Hugging Face `tokenizer.json` (relative to the \
                 spec's folder), or use `tokenizer: gpt2` or `tokenizer: bytes`",
            ));
        }
        let hf = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| tokenizer_error(&name, format!("not a readable tokenizer.json: {e}")))?;
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
        match &self.kind {
            Kind::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Kind::Gpt2(bpe) => Ok(bpe.encode_ordinary(text)),
            Kind::Hf(t) => t
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| tokenizer_error(&self.name, format!("cannot encode: {e}"))),
        }
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
