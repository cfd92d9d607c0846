//! Prompts: which tokenizer a spec's text uses, and a prompt's ids for a model (checked
//! against its vocabulary and `seq`).
use super::generation::prompt_too_long;
use crate::data::Tokenizer;
use crate::error::{Result, RuntimeError};
use parc_compiler::spec::{DataFormat, DataSource, Model, Spec, Tokenizer as TokenizerSpec};

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
