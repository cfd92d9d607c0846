//! The inference engine: the spec's node graph run on new tokens at the next positions, with a
//! KV cache per attention layer, so a sample is one prefill of its prompt and then one token
//! at a time. Any model the language writes runs: the graph is walked in its order, each node
//! by its kind (`layer`), up to the loss, whose input is the logits.
//!
//! A sample holds at most the model's `seq` tokens (learned positions have `seq` rows, and the
//! cache as many): [`Engine::feed`] refuses positions past it. Values are freed after their
//! last reader. With [`Rows::Last`] only the last new position's logits are wanted: after the
//! last attention layer (the last node that reads other positions) every live value is cut to
//! its last row, so the layers after it, the head included, run on one row.
use super::device::{Device, Ids, Tensor};
use super::layer::Layer;
use super::weights::Weights;
use crate::backend::Backend;
use crate::checkpoint::ShardTensor;
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::Segment;
use parc_compiler::ir::DType;
use parc_compiler::spec::{LayerKind, Model, NodeId, Shape, Spec, ValueId};
use std::collections::HashMap;

/// Which new positions [`Engine::feed`] returns logits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// Every new position's: `[n, vocab]`.
    All,
    /// The last new position's: `[vocab]`.
    Last,
}

/// A model on a backend, with its caches. See the module docs.
pub struct Engine<B: Backend> {
    device: Device<B>,
    model: Model,
    weights: Weights,
    /// One per node before the loss (the nodes run).
    layers: Vec<Layer>,
    /// The value the loss reads: the logits.
    logits: ValueId,
    /// The last node reading each value.
    last_use: HashMap<ValueId, usize>,
    /// The last attention node: the last node that reads other positions than its row's.
    last_attention: Option<usize>,
    /// Positions fed since the last [`Engine::reset`].
    len: u64,
}

fn engine_error(what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Unsupported(what.to_string())
}

impl<B: Backend> Engine<B> {
    /// `spec`'s model on `backend` with the global parameters `params` (named as in
    /// `model.safetensors`).
    pub fn new(spec: &Spec, params: &[ShardTensor], backend: B) -> Result<Engine<B>> {
        let model = spec.model.clone();
        let end = model
            .nodes
            .iter()
            .position(|n| n.kind == LayerKind::CrossEntropy)
            .ok_or_else(|| engine_error(format!("model {} has no loss", model.name)))?;
        let logits = model.nodes[end].inputs.first().copied().ok_or_else(|| {
            engine_error(format!("the loss of model {} reads nothing", model.name))
        })?;
        let width = model.values.get(logits.0 as usize).map(|v| &v.shape);
        if width != Some(&Shape::Hidden(model.vocab)) {
            return Err(engine_error(format!(
                "the loss of model {} does not read vocab-wide logits",
                model.name
            )));
        }
        let mut last_use = HashMap::new();
        for (i, node) in model.nodes[..end].iter().enumerate() {
            if node.inputs.contains(&model.targets) {
                return Err(engine_error(format!(
                    "`{}` reads the targets, which a sample does not have",
                    node.name
                )));
            }
            for v in &node.inputs {
                last_use.insert(*v, i);
            }
        }
        let mut device = Device {
            backend,
            ids: Ids::default(),
        };
        let weights = Weights::load(spec, params, &mut device)?;
        let mut layers = Vec::with_capacity(end);
        for (i, node) in model.nodes[..end].iter().enumerate() {
            layers.push(Layer::new(&mut device, NodeId(i as u32), node, model.seq)?);
        }
        let last_attention = layers
            .iter()
            .rposition(|l| matches!(l, Layer::Attention(_)));
        Ok(Engine {
            device,
            model,
            weights,
            layers,
            logits,
            last_use,
            last_attention,
            len: 0,
        })
    }

    /// Positions a sample may hold, its prompt included.
    pub fn seq(&self) -> u64 {
        self.model.seq
    }

    /// Logits per position.
    pub fn vocab(&self) -> u64 {
        self.model.vocab
    }

    /// Positions fed since the last [`Engine::reset`].
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing was fed since the last [`Engine::reset`].
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forget every position: the next [`Engine::feed`] starts a new sample at position 0.
    pub fn reset(&mut self) -> Result<()> {
        for layer in &self.layers {
            if let Layer::Attention(cache) = layer {
                cache.clear(&mut self.device)?;
            }
        }
        self.len = 0;
        Ok(())
    }

    /// Run `tokens` at the next positions and return their logits (`rows` says whose).
    pub fn feed(&mut self, tokens: &[u32], rows: Rows) -> Result<Vec<f32>> {
        self.check_tokens(tokens)?;
        let n = tokens.len() as u64;
        let mut at = Segment {
            start: self.len as u32,
            len: n as u32,
        };
        // Without attention every node works row by row: only the last row need run.
        let mut ids = tokens;
        if rows == Rows::Last && self.last_attention.is_none() {
            ids = &tokens[tokens.len() - 1..];
            at = last_position(at);
        }
        let mut live = HashMap::new();
        let result = self.token_tensor(ids).and_then(|t| {
            live.insert(self.model.tokens, t);
            self.walk(&mut live, ids, at, rows)
        });
        for t in live.into_values() {
            self.device.free(t.buf)?;
        }
        let logits = result?;
        self.len += n;
        Ok(logits)
    }

    /// Fails unless `tokens` are some, fit the model's positions after those fed, and are in
    /// its vocabulary.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let (seq, vocab) = (self.model.seq, self.model.vocab);
        let end = self.len + tokens.len() as u64;
        if tokens.is_empty() {
            return Err(engine_error("no tokens to run the model on"));
        }
        if end > seq {
            return Err(engine_error(format!(
                "positions {}..{end} pass the model's seq = {seq}: a sample holds at most {seq} \
                 tokens, its prompt included",
                self.len
            )));
        }
        match tokens.iter().find(|&&id| u64::from(id) >= vocab) {
            Some(id) => Err(engine_error(format!(
                "token id {id} is outside the model's vocabulary of {vocab}; is the tokenizer \
                 the one the model was trained with?"
            ))),
            None => Ok(()),
        }
    }

    /// `ids` in a new `[n, 1]` i32 tensor.
    fn token_tensor(&mut self, ids: &[u32]) -> Result<Tensor> {
        let rows = ids.len() as u64;
        let buf = self.device.alloc(&[rows], DType::I32)?;
        let as_i32: Vec<i32> = ids.iter().map(|&id| id as i32).collect();
        self.device.backend.write_i32(buf, &as_i32)?;
        Ok(Tensor { buf, rows, cols: 1 })
    }

    /// Every node up to the loss, on `ids` (at `at`) in `live`; the logits read back.
    fn walk(
        &mut self,
        live: &mut HashMap<ValueId, Tensor>,
        ids: &[u32],
        mut at: Segment,
        rows: Rows,
    ) -> Result<Vec<f32>> {
        for i in 0..self.layers.len() {
            let node = &self.model.nodes[i];
            let inputs = node
                .inputs
                .iter()
                .map(|v| {
                    live.get(v).copied().ok_or_else(|| {
                        engine_error(format!("`{}` reads a value not computed yet", node.name))
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let id = NodeId(i as u32);
            let y =
                self.layers[i].forward(&mut self.device, &self.weights, (id, node), &inputs, at)?;
            live.insert(node.output, y);
            for v in &node.inputs {
                if self.last_use.get(v) == Some(&i) {
                    if let Some(t) = live.remove(v) {
                        self.device.free(t.buf)?;
                    }
                }
            }
            if rows == Rows::Last && self.last_attention == Some(i) && at.len > 1 {
                self.keep_last_row(live, ids)?;
                at = last_position(at);
            }
        }
        let logits = live
            .get(&self.logits)
            .ok_or_else(|| engine_error("the logits were not computed (an engine bug)"))?;
        self.device.backend.read_f32(logits.buf)
    }
}

impl<B: Backend> Engine<B> {
    /// Cut every value in `live` to its last row (the tokens to the last of `ids`).
    fn keep_last_row(&mut self, live: &mut HashMap<ValueId, Tensor>, ids: &[u32]) -> Result<()> {
        for (v, t) in live.iter_mut() {
            let last = if *v == self.model.tokens {
                self.token_tensor(&ids[ids.len() - 1..])?
            } else {
                self.device.last_row(*t)?
            };
            self.device.free(t.buf)?;
            *t = last;
        }
        Ok(())
    }
}

/// The last position of `at`, alone.
fn last_position(at: Segment) -> Segment {
    Segment {
        start: at.start + at.len - 1,
        len: 1,
    }
}
