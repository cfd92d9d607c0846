//! Training data: where tokens come from ([`source`]: byte-level text, little-endian u16/u32
//! token files or folders of shards ([`files`] says which files a path names, [`shards`] what
//! `parc tokenize` writes), text through a tokenizer ([`text`], [`tokenizer`]), seeded synthetic
//! tokens) and which samples each rank reads at each step ([`sampler`]: seeded per-epoch
//! permutations cut into global batches, each global batch split into fixed per-rank,
//! per-microbatch slices), and the evaluation set of `train.eval` ([`eval`]: its own data, or
//! the training data's held-out tail); [`tokenizer`] also turns ids back into text; [`record`]
//! describes a dataset for the checkpoints that compare it on resume.
//!
//! A *sample* is a window of `seq + 1` consecutive tokens; its first `seq` tokens are the inputs
//! and its last `seq` the targets (inputs shifted by one). Sample `i` starts at token `i · seq`,
//! so consecutive samples share one boundary token and every token of the file is used.
pub mod batch_log;
pub mod eval;
pub mod files;
pub mod record;
pub mod sampler;
pub mod shards;
pub mod source;
pub mod text;
pub mod tokenizer;

pub use batch_log::{write_batch_log, write_run_batch_log};
pub use eval::{training_samples, EvalSet, RunData};
pub use record::DataRecord;
pub use sampler::{BatchLayout, EpochProgress, Sampler};
pub use source::{fill_microbatch, Dataset};
pub use tokenizer::{StreamDecoder, Tokenizer};
