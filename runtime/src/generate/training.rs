//! `train.sample`: a sample from the parameters of a run in progress. The run opens the
//! tokenizer and checks the prompt before its first step ([`TrainingSampler::new`]); every
//! `every` steps it gathers the parameters to global tensors and hands the text (prompt and
//! continuation) to its [`SampleSink`]. The sample runs on the CPU backend, in f32, seeded by
//! `train.seed`.
use super::engine::Engine;
use super::generation::{generate, Limits};
use super::prompt::{data_tokenizer, encode_prompt};
use super::sampler::Sampler;
use crate::checkpoint::ShardTensor;
use crate::cpu::CpuBackend;
use crate::data::Tokenizer;
use crate::error::{Result, RuntimeError};
use parc_compiler::spec::Spec;
use std::path::Path;
use std::sync::Arc;

/// What a [`SampleSink`] calls: with the number of steps done and the text.
type Report = dyn Fn(u64, &str) + Send + Sync;

/// Where a run's samples go.
#[derive(Clone)]
pub struct SampleSink(Arc<Report>);

impl SampleSink {
    pub fn new(report: impl Fn(u64, &str) + Send + Sync + 'static) -> SampleSink {
        SampleSink(Arc::new(report))
    }

    pub fn report(&self, step: u64, text: &str) {
        (self.0)(step, text)
    }
}

impl std::fmt::Debug for SampleSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SampleSink")
    }
}

/// A run's `train.sample`, its tokenizer open and its prompt encoded.
#[derive(Debug)]
pub struct TrainingSampler {
    every: u64,
    tokenizer: Tokenizer,
    prompt: Vec<u32>,
    sampler: Sampler,
    limits: Limits,
}

impl TrainingSampler {
    /// The sampler of `spec`'s `train.sample` (None without one); paths are relative to
    /// `spec_dir`. A prompt that does not fit the model is an error now, before training.
    pub fn new(spec: &Spec, spec_dir: &Path) -> Result<Option<TrainingSampler>> {
        let Some(sample) = &spec.train.sample else {
            return Ok(None);
        };
        let kind = data_tokenizer(spec, spec_dir)?.ok_or_else(|| {
            RuntimeError::Unsupported(
                "train.sample needs the tokenizer of the training text, and this spec's data \
                 is token ids (or synthetic), which name none; sample from a run on text \
                 (`text(\"file.txt\", tokenizer: gpt2)`, `\"file.txt\" as bytes`) or on a \
                 folder `parc tokenize` wrote, or sample the saved model with `parc sample \
                 CKPT --tokenizer …`"
                    .to_string(),
            )
        })?;
        let tokenizer = Tokenizer::open(&kind, spec_dir)?;
        let prompt = encode_prompt(&tokenizer, &sample.prompt, &spec.model)
            .map_err(|e| RuntimeError::Unsupported(format!("train.sample: {e}")))?;
        let limits = Limits {
            tokens: sample.tokens,
            end_of_text: tokenizer.end_of_text(),
            allowed: tokenizer.vocab_size(),
        };
        let sampler = Sampler {
            temperature: sample.temperature,
            top_k: sample.top_k,
            seed: spec.train.seed,
        };
        sampler.check()?;
        Ok(Some(TrainingSampler {
            every: sample.every,
            tokenizer,
            prompt,
            sampler,
            limits,
        }))
    }

    /// Whether a sample is due after `done` steps.
    pub fn due(&self, done: u64) -> bool {
        self.every > 0 && done.is_multiple_of(self.every)
    }

    /// The prompt and the model's continuation of it, with the global parameters `params`.
    pub fn text(&self, spec: &Spec, params: &[ShardTensor]) -> Result<String> {
        let mut engine = Engine::new(spec, params, CpuBackend::new())?;
        let generated = generate(
            &mut engine,
            &self.prompt,
            &self.sampler,
            &self.limits,
            |_| Ok(()),
        )?;
        let mut ids = self.prompt.clone();
        ids.extend(generated.tokens);
        self.tokenizer.decode(&ids)
    }
}
