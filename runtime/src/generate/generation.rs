//! The generation loop: a prompt's ids through the engine in one prefill, then the chosen
//! token fed back one at a time, each handed to the caller as it comes, until the end-of-text
//! token (not handed on), the asked number of tokens, or the model's `seq` positions (a sample
//! holds at most `seq` tokens, its prompt included: learned positions have no row past it).
use super::engine::{Engine, Rows};
use super::sampler::Sampler;
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use std::time::Instant;

/// When a sample ends, besides the model's `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// New tokens at most.
    pub tokens: u64,
    /// The tokenizer's end-of-text id, when it has one.
    pub end_of_text: Option<u32>,
    /// Ids below this may be chosen (the tokenizer's vocabulary: a model's may be padded).
    pub allowed: u64,
}

/// Why a sample ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The model chose the end-of-text token.
    EndOfText,
    /// It has the asked number of tokens.
    Tokens,
    /// It fills the model's `seq` positions.
    Seq,
}

impl Stop {
    /// For people, after "stopped by".
    pub fn describe(self, seq: u64) -> String {
        match self {
            Stop::EndOfText => "the model ended the text".to_string(),
            Stop::Tokens => "the asked number of tokens".to_string(),
            Stop::Seq => format!("the model's seq = {seq} positions, prompt included"),
        }
    }
}

/// A finished sample.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// The new tokens (not the prompt, not an end-of-text).
    pub tokens: Vec<u32>,
    pub stop: Stop,
    /// Seconds of the prompt's prefill (and its first choice) and of the tokens after.
    pub prefill_s: f64,
    pub decode_s: f64,
}

/// Continue `prompt` with `engine` (reset first), choosing by `sampler` within `limits`;
/// `on_token` sees each new token as it is chosen.
pub fn generate<B: Backend>(
    engine: &mut Engine<B>,
    prompt: &[u32],
    sampler: &Sampler,
    limits: &Limits,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generated> {
    sampler.check()?;
    let seq = engine.seq();
    if prompt.is_empty() {
        return Err(RuntimeError::Unsupported(
            "the prompt is empty: give at least one token of text to continue".to_string(),
        ));
    }
    if prompt.len() as u64 >= seq {
        return Err(prompt_too_long(prompt.len() as u64, seq));
    }
    let allowed = limits.allowed.min(engine.vocab()) as usize;
    engine.reset()?;
    let started = Instant::now();
    let mut logits = engine.feed(prompt, Rows::Last)?;
    let mut tokens = Vec::new();
    let mut prefill_s = None;
    let stop = loop {
        if tokens.len() as u64 >= limits.tokens {
            break Stop::Tokens;
        }
        let id = sampler.choose(&logits, allowed, tokens.len() as u64)?;
        prefill_s.get_or_insert_with(|| started.elapsed().as_secs_f64());
        if Some(id) == limits.end_of_text {
            break Stop::EndOfText;
        }
        tokens.push(id);
        on_token(id)?;
        if engine.len() + 1 >= seq {
            break Stop::Seq;
        }
        logits = engine.feed(&[id], Rows::Last)?;
    };
    let total = started.elapsed().as_secs_f64();
    let prefill_s = prefill_s.unwrap_or(total);
    Ok(Generated {
        tokens,
        stop,
        prefill_s,
        decode_s: total - prefill_s,
    })
}

/// A prompt that leaves the model no position to continue it.
pub fn prompt_too_long(tokens: u64, seq: u64) -> RuntimeError {
    RuntimeError::Unsupported(format!(
        "the prompt is {tokens} tokens but the model's seq is {seq}: a sample, prompt and \
         continuation, fits in {seq} positions; shorten the prompt to at most {} tokens",
        seq.saturating_sub(1)
    ))
}
