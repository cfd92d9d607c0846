//! Prompts: which tokenizer a spec's text uses, and a prompt's ids for a model (checked
//! against its vocabulary and `seq`).
use super::generation::prompt_too_long;
use crate::data::shards::read_info;
use crate::data::Tokenizer;
use crate::error::{Result, RuntimeError};
use parc_compiler::spec::{DataFormat, DataSource, Model, Spec, Tokenizer as TokenizerSpec};
use std::path::Path;

/// The tokenizer of the spec's training text, when the spec says: `text(…, tokenizer: T)` is
/// `T`, byte-level text (`"file" as bytes`) is `bytes`; token-id files and synthetic data name
/// none.
pub fn spec_tokenizer(spec: &Spec) -> Option<TokenizerSpec> {
    match &spec.train.data {
        DataSource::File {
            format: DataFormat::Bytes,
            ..
        } => Some(TokenizerSpec::Bytes),
        DataSource::Text { tokenizer, .. } => Some(tokenizer.clone()),
        _ => None,
    }
}

/// The tokenizer of the spec's training data, as [`spec_tokenizer`], or for token ids read from
/// a folder of shards that `parc tokenize` wrote (`data = "DIR" as u16`), the tokenizer its
/// `info.json` names (a tokenizer.json path as `parc tokenize` was given it).
pub fn data_tokenizer(spec: &Spec, spec_dir: &Path) -> Result<Option<TokenizerSpec>> {
    if let Some(kind) = spec_tokenizer(spec) {
        return Ok(Some(kind));
    }
    let DataSource::File { path, .. } = &spec.train.data else {
        return Ok(None);
    };
    let dir = spec_dir.join(path);
    if !dir.is_dir() {
        return Ok(None);
    }
    Ok(read_info(&dir)?.map(|info| {
        TokenizerSpec::from_name(&info.tokenizer).unwrap_or(TokenizerSpec::File {
            path: info.tokenizer,
        })
    }))
}

/// `prompt`'s ids: some, each in the model's vocabulary, and fewer than its `seq` (a sample
/// holds at most `seq` tokens and must add one).
pub fn encode_prompt(tokenizer: &Tokenizer, prompt: &str, model: &Model) -> Result<Vec<u32>> {
    let ids = tokenizer.encode(prompt)?;
    if ids.is_empty() {
        return Err(RuntimeError::Unsupported(
            "the prompt is empty: give at least one token of text to continue".to_string(),
        ));
    }
    if ids.len() as u64 >= model.seq {
        return Err(prompt_too_long(ids.len() as u64, model.seq));
    }
    if let Some(id) = ids.iter().find(|&&id| u64::from(id) >= model.vocab) {
        return Err(RuntimeError::Unsupported(format!(
            "the prompt has token id {id} (tokenizer {}), outside model {}'s vocabulary of {}; \
             is this the tokenizer the model was trained with?",
            tokenizer.name(),
            model.name,
            model.vocab
        )));
    }
    Ok(ids)
}
