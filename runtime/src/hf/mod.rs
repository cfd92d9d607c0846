//! Hugging Face weights in and out, for the GPT-2 and Llama families (Qwen2's q/k/v biases
//! and Qwen3's per-head q/k norms included): `parc export --format hf` writes a transformers model folder ([`export`]), and
//! `train.init = hf("DIR")` starts a run from one ([`HfInit`]), each rank reading only its
//! own elements.
//!
//! One file per concern: recognising the family from the spec's graph (`family`), the names
//! and layouts of the tensors (`names`), config.json (`config`; RoPE's scaling in it, `rope`),
//! reading safetensors (`read`), loading into a rank (`load`) and writing an export (`write`).
mod config;
mod family;
mod load;
mod names;
mod read;
mod rope;
mod write;

pub use config::check_config;
pub use family::{recognise, Arch, Family};
pub use load::HfInit;
pub use write::{default_vocab, export, ExportOptions, Exported, HfDtype};
