//! Sampling from a trained model: an inference engine over the spec's node graph with a KV
//! cache per attention layer, token choice, and the generation loop, for `parc sample` and for
//! `train.sample` (samples printed while training).
//!
//! - `device`: the backend with the buffers the engine holds on it;
//! - `weights`: the global parameters of a saved model on a backend, by node and local name;
//! - `engine`: runs the model on new tokens at the next positions (a prefill of the prompt,
//!   then one token at a time), each layer by `layer` and attention by `attention` (its cache);
//! - `sampler`: picks a token from logits (greedy, temperature, top-k, seeded);
//! - `generation`: prompt → tokens until end-of-text, a token count, or the model's `seq`;
//! - `prompt`: which tokenizer a spec's text uses, and a prompt's ids for a model;
//! - `training`: one sample from the parameters of a run in progress (`train.sample`).
//!
//! The engine emits the ops the training forward lowers to (`parc_compiler::ir::op`) and runs
//! them through the [`Backend`](crate::backend::Backend) trait, so its numbers are the
//! backend's kernels' (the CPU backend's are parc's reference); it computes in f32.
pub mod engine;
pub mod generation;
pub mod prompt;
pub mod sampler;
pub mod training;
pub mod weights;

mod attention;
mod device;
mod layer;

pub use engine::{Engine, Rows};
pub use generation::{generate, Generated, Limits, Stop};
pub use prompt::{data_tokenizer, encode_prompt, spec_tokenizer};
pub use sampler::{compact, Sampler};
pub use training::{SampleSink, TrainingSampler};
