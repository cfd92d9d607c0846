//! The checked specification: what `check` produces from a `.par` file and every later stage
//! (cost model, lowering, runtime) consumes. All numbers are resolved (constants evaluated,
//! defaults filled in, `--set` overrides applied), `repeat` is expanded, and every layer has its
//! concrete dimensions. Spans point back at the text so later stages can report errors there.
//!
//! Conventions that every consumer relies on:
//! - Activations are sequence-major: a microbatch's hidden state is `[seq, micro_batch, dim]`
//!   (Megatron's layout), so sequence-parallel and context-parallel shards are contiguous.
//! - Linear weights are `[out, in]` (PyTorch layout); a tied head uses the embedding table
//!   `[vocab, dim]` as its `[out = vocab, in = dim]` weight.
//! - The training loss is the mean token cross-entropy over the whole global batch.
//! - global_batch = micro_batch × microbatches × dp (the accumulation rule, stated once here).

use crate::diag::Span;
use crate::ir::fp8::{Fp8Format, Fp8Scaling};
use crate::ir::op::Act;
pub use crate::ir::rope::RopeScaling;
use crate::kir::func::ExprFn;
use serde::Serialize;
use std::sync::Arc;

/// Index of a layer node in [`Model::nodes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct NodeId(pub u32);

/// Index of a value (a tensor flowing between nodes) in [`Model::values`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct ValueId(pub u32);

#[derive(Clone, Debug, Serialize)]
pub struct Spec {
    pub model: Model,
    pub parallel: Parallel,
    pub train: Train,
    pub cluster: Cluster,
}

// ----------------------------------------------------------------------------------------------
// Model
// ----------------------------------------------------------------------------------------------

#[derive(Clone, Debug, Serialize)]
pub struct Model {
    pub name: String,
    pub span: Span,
    /// Training sequence length (tokens per sample).
    pub seq: u64,
    pub vocab: u64,
    /// Width of the residual stream.
    pub dim: u64,
    /// Number of iterations of the model's (single) top-level `repeat`; 0 if it has none.
    pub layers: u32,
    /// Tensors, in definition order. Inputs first.
    pub values: Vec<Value>,
    /// Layer nodes in a topological order (the order they appear in the source, `repeat` expanded).
    pub nodes: Vec<Node>,
    /// The `tokens` and `targets` inputs.
    pub tokens: ValueId,
    pub targets: ValueId,
    /// The scalar loss value (output of the `CrossEntropy` node).
    pub loss: ValueId,
    /// What `shard` annotations asked for, resolved to the mesh axes.
    pub sharding: Sharding,
}

/// The shape of a value, symbolic in the microbatch and sequence sizes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Shape {
    /// `[seq, batch]` integer token ids.
    Tokens,
    /// `[seq, batch, n]` activations (n = model dim, ffn hidden, vocab, …).
    Hidden(u64),
    /// A scalar (the loss).
    Scalar,
}

#[derive(Clone, Debug, Serialize)]
pub struct Value {
    pub name: String,
    pub shape: Shape,
    pub span: Span,
}

#[derive(Clone, Debug, Serialize)]
pub struct Node {
    /// Dotted path naming this layer instance, e.g. `embed`, `blocks.3.attn`, `blocks.3.ln1`,
    /// `head`. Parameter names derive from it (`blocks.3.attn.wqkv`). Stable across runs.
    pub name: String,
    pub kind: LayerKind,
    pub inputs: Vec<ValueId>,
    pub output: ValueId,
    /// Iteration of the top-level `repeat` this node belongs to; `None` before/after it.
    /// Pipeline stages split the model at these boundaries.
    pub layer: Option<u32>,
    /// Recompute this node's activations in backward (set from `parallel.recompute`).
    pub recompute: bool,
    pub span: Span,
}

/// An MLP's activation: one elementwise function between its two projections, or a gated pair
/// (SwiGLU's `silu(x W_gate) * (x W_up)`, any `glu(f)`).
#[derive(Clone, Debug, PartialEq)]
pub enum Activation {
    /// `act(x W_fc + b) W_proj + b`, by a hand-written op.
    Plain(Act),
    /// SwiGLU: `silu(x W_gate) * (x W_up)`, then `W_down`, by a hand-written op.
    Swiglu,
    /// An expression function (`fn`, the prelude's `squared_relu`, `glu(gelu)`): with one
    /// parameter `f(x W_fc + b) W_proj + b`; with two (gate, up) gated like SwiGLU,
    /// `f(x W_gate, x W_up) W_down`. Lowered to generated kernels.
    Fn(Arc<ExprFn>),
}

impl Activation {
    /// The names of the hand-written activations in the language.
    pub fn names() -> impl Iterator<Item = &'static str> {
        Act::ALL.iter().map(|a| a.name()).chain(["swiglu"])
    }

    /// The hand-written activation named `name` in the language.
    pub fn from_name(name: &str) -> Option<Activation> {
        match name {
            "swiglu" => Some(Activation::Swiglu),
            _ => Act::from_name(name).map(Activation::Plain),
        }
    }

    /// Its name in the language and in JSON.
    pub fn name(&self) -> &str {
        match self {
            Activation::Plain(a) => a.name(),
            Activation::Swiglu => "swiglu",
            Activation::Fn(f) => &f.name,
        }
    }

    /// Whether the MLP is gated: `gate`, `up` and `down` projections without biases.
    pub fn is_gated(&self) -> bool {
        match self {
            Activation::Plain(_) => false,
            Activation::Swiglu => true,
            Activation::Fn(f) => f.params.len() == 2,
        }
    }

    /// The expression function, when it is one.
    pub fn function(&self) -> Option<&ExprFn> {
        match self {
            Activation::Fn(f) => Some(f),
            _ => None,
        }
    }
}

impl Serialize for Activation {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// Rotary positions: the base `theta`, how the frequencies are scaled (`ir::rope`; `none` for
/// plain RoPE, left out of the spec's JSON then) and the share of each head's features that
/// turn (`fraction`: GPT-NeoX's `rotary_pct`, Phi's `partial_rotary_factor`; 1, every feature,
/// is left out of the JSON). The checker makes `head_dim · fraction` an even whole number.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Rope {
    pub theta: f64,
    #[serde(skip_serializing_if = "RopeScaling::is_none")]
    pub scaling: RopeScaling,
    #[serde(skip_serializing_if = "rotates_every_feature")]
    pub fraction: f64,
}

impl Rope {
    /// How many of a head's `head_dim` features turn: its first `head_dim · fraction`, in
    /// pairs `(i, i + rotary/2)`; the others pass unchanged.
    pub fn rotary_dim(&self, head_dim: u64) -> u64 {
        (head_dim as f64 * self.fraction).round() as u64
    }

    /// [`Rope::rotary_dim`] where fewer than the head's features turn (a partial RoPE), as an
    /// op's `RopeAttrs::rotary_dim` takes it; None where all do.
    pub fn partial_dim(&self, head_dim: u64) -> Option<u64> {
        Some(self.rotary_dim(head_dim)).filter(|&r| r != head_dim)
    }
}

fn rotates_every_feature(fraction: &f64) -> bool {
    *fraction == 1.0
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum LayerKind {
    /// Token embedding: `tokens -> [seq, b, dim]`. Parameter `weight [vocab, dim]`.
    Embedding { vocab: u64, dim: u64 },
    /// Learned absolute positions added to its input: `x -> x + P[pos]`. Parameter
    /// `weight [seq, dim]`. Inputs: the hidden state.
    PositionEmbedding { seq: u64, dim: u64 },
    /// Parameters `weight [dim]`, and `bias [dim]` when `bias`.
    LayerNorm { dim: u64, eps: f64, bias: bool },
    /// Parameter `weight [dim]`.
    RmsNorm { dim: u64, eps: f64 },
    /// `y = x W^T (+ b)`. Parameters `weight [out, in]` unless tied, `bias [out]` when `bias`.
    /// `tied`: the node whose weight this one uses (an Embedding with `[vocab, dim]` = `[out, in]`).
    Linear {
        in_dim: u64,
        out_dim: u64,
        bias: bool,
        tied: Option<NodeId>,
    },
    /// Self-attention block without its norm or residual: one fused q/k/v projection (`wqkv
    /// [(heads + 2*kv_heads)*head_dim, dim]`, rows q then k then v; bias `bqkv` when
    /// `qkv_bias`), optional RoPE on q and k, scaled-dot-product attention (causal when
    /// `causal`), output projection `wo [dim, heads*head_dim]` (+ `bo` when `out_bias`).
    /// The language's `bias` sets both biases, `qkv_bias` the first alone (Qwen2's q/k/v
    /// biases without an output bias: `bias = false, qkv_bias = true`). `qk_norm` (the
    /// epsilon, when set): each head of q and of k is RMS-normalized over its `head_dim`
    /// features between the projection and RoPE, with weights `q_norm [head_dim]` (shared by
    /// every q head) and `k_norm [head_dim]` (every kv head), as Qwen3 and Gemma 3 do.
    /// `scale` multiplies q·k before the softmax where a model sets its own (Gemma 2's
    /// `query_pre_attn_scalar^−½`, Granite's `attention_multiplier`); `None` is the usual
    /// `1/√head_dim` ([`attention_scale`]), left out of the spec's JSON.
    Attention {
        dim: u64,
        heads: u64,
        kv_heads: u64,
        head_dim: u64,
        causal: bool,
        rope: Option<Rope>,
        qkv_bias: bool,
        out_bias: bool,
        qk_norm: Option<f64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        scale: Option<f64>,
    },
    /// Feed-forward: `fc [hidden, dim]` (+`fc_bias`), activation, `proj [dim, hidden]` (+`proj_bias`).
    /// For SwiGLU: `gate [hidden, dim]`, `up [hidden, dim]`, `down [dim, hidden]`, no biases.
    Mlp {
        dim: u64,
        hidden: u64,
        act: Activation,
        bias: bool,
    },
    /// Elementwise sum of its two inputs (the residual add).
    Add,
    /// An expression function applied to its inputs elementwise (`y = f(x)`, `y = g(a, b)` in
    /// the dataflow): one input per parameter (1 to 3), all `[batch, seq, dim]`, and an output
    /// of that shape. Lowered to a generated kernel and its derived backward.
    Elementwise {
        #[serde(serialize_with = "fn_name")]
        f: Arc<ExprFn>,
        dim: u64,
    },
    /// Mean token cross-entropy of `logits [seq, b, vocab]` against `targets` (the second input).
    CrossEntropy,
}

impl Node {
    /// Whether a layer list's entry names this node: its kind (`Attention`), its path
    /// (`blocks.3.mlp`) or a path above it (`blocks.3`). Used by `recompute` and FP8 pins.
    pub fn matches(&self, entry: &str) -> bool {
        self.kind.kind_name() == entry
            || self.name == entry
            || self.name.starts_with(entry) && self.name.as_bytes().get(entry.len()) == Some(&b'.')
    }
}

impl LayerKind {
    /// The name users write for this kind (`shard Attention.heads …`).
    pub fn kind_name(&self) -> &'static str {
        match self {
            LayerKind::Embedding { .. } => "Embedding",
            LayerKind::PositionEmbedding { .. } => "PositionEmbedding",
            LayerKind::LayerNorm { .. } => "LayerNorm",
            LayerKind::RmsNorm { .. } => "RMSNorm",
            LayerKind::Linear { .. } => "Linear",
            LayerKind::Attention { .. } => "Attention",
            LayerKind::Mlp { .. } => "MLP",
            LayerKind::Add => "Add",
            LayerKind::Elementwise { .. } => "Elementwise",
            LayerKind::CrossEntropy => "CrossEntropy",
        }
    }
}

/// The factor an attention of `head_dim` features per head multiplies q·k by: its own `scale`
/// where the model sets one, else `1/√head_dim`.
pub fn attention_scale(head_dim: u64, scale: Option<f64>) -> f64 {
    scale.unwrap_or_else(|| 1.0 / (head_dim as f64).sqrt())
}

/// An elementwise layer's function, in JSON: its name.
fn fn_name<S: serde::Serializer>(f: &Arc<ExprFn>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&f.name)
}

/// Which dimensions the `shard` annotations split, resolved against the mesh.
/// A flag is only true when its axis has size > 1 in the mesh or was named explicitly.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sharding {
    /// Attention heads (and kv heads) split over tp (Megatron column/row parallel attention).
    pub attention_heads_on_tp: bool,
    /// MLP hidden split over tp (column-parallel fc, row-parallel proj).
    pub mlp_hidden_on_tp: bool,
    /// Embedding/head vocab split over tp (vocab-parallel embedding and cross-entropy).
    pub vocab_on_tp: bool,
    /// Sequence split over cp for attention (context parallelism).
    pub seq_on_cp: bool,
    /// Where each annotation was written, for diagnostics.
    pub spans: Vec<Span>,
}

// ----------------------------------------------------------------------------------------------
// Parallel plan
// ----------------------------------------------------------------------------------------------

pub use crate::axis::Axis;

/// The device mesh. `axes` is outermost first, innermost last: the innermost axis's ranks are
/// neighbours (consecutive global ranks). Every axis appears exactly once (size 1 if unused).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Mesh {
    pub axes: Vec<(Axis, u32)>,
}

impl Mesh {
    pub fn size(&self, axis: Axis) -> u32 {
        self.axes
            .iter()
            .find(|(a, _)| *a == axis)
            .map(|(_, n)| *n)
            .unwrap_or(1)
    }
    /// Ranks in the mesh (saturating: a checked spec has at most `check::sections::MAX_WORLD`).
    pub fn world(&self) -> u32 {
        let world: u64 = self.axes.iter().map(|(_, n)| u64::from(*n)).product();
        u32::try_from(world).unwrap_or(u32::MAX)
    }
    /// The sizes of the dp, pp, cp and tp axes, in that order.
    pub fn sizes(&self) -> (u32, u32, u32, u32) {
        let [dp, pp, cp, tp] = [Axis::Dp, Axis::Pp, Axis::Cp, Axis::Tp].map(|a| self.size(a));
        (dp, pp, cp, tp)
    }
    /// Number of consecutive global ranks between neighbours on `axis`.
    pub fn stride(&self, axis: Axis) -> u32 {
        let mut stride = 1;
        for (a, n) in self.axes.iter().rev() {
            if *a == axis {
                return stride;
            }
            stride *= n;
        }
        stride
    }
    /// This rank's index along `axis`.
    pub fn coord(&self, rank: u32, axis: Axis) -> u32 {
        (rank / self.stride(axis)) % self.size(axis)
    }
    /// The global rank with the given coordinates on every axis.
    pub fn rank_of(&self, coords: &[(Axis, u32)]) -> u32 {
        coords.iter().map(|(a, c)| c * self.stride(*a)).sum()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum ZeroStage {
    /// Replicated optimizer state, all-reduced gradients.
    Zero0,
    /// Optimizer state sharded over dp.
    Zero1,
    /// Optimizer state and gradients sharded over dp.
    Zero2,
    /// Optimizer state, gradients and parameters sharded over dp.
    Zero3,
}

impl ZeroStage {
    pub fn level(self) -> u32 {
        self as u32
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum PipelineSchedule {
    Gpipe,
    OneFOneB,
    /// Interleaved 1F1B with `virtual_stages` model chunks per pipeline rank.
    Interleaved {
        virtual_stages: u32,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "layers")]
pub enum Recompute {
    None,
    /// Recompute only the attention core (Korthikanti et al.'s selective recomputation).
    Selective,
    /// Recompute every layer from its input (store only the layer boundary).
    Full,
    /// Recompute the named layer kinds or node paths (e.g. `Attention`, `blocks.3.mlp`).
    Named(Vec<String>),
}

#[derive(Clone, Debug, Serialize)]
pub struct Parallel {
    pub mesh: Mesh,
    pub zero: ZeroStage,
    pub schedule: PipelineSchedule,
    /// Microbatches per step per data-parallel rank (gradient accumulation steps).
    pub microbatches: u32,
    pub recompute: Recompute,
    pub sequence_parallel: bool,
    /// What a sequence-parallel layer keeps of its all-gathered input for backward
    /// (`parallel.sp_save`).
    pub sp_save: SpSave,
    /// Gradient all-reduce / reduce-scatter bucket size in bytes (default 25 MiB, as PyTorch DDP).
    pub bucket_bytes: u64,
    /// How `chunk_layers` was chosen (`parallel.balance`, `parallel.layers`).
    pub balance: Balance,
    /// Repeated layers per pipeline chunk, in chunk order (chunk `c` runs on stage `c mod pp`):
    /// pp × virtual entries (one when pp = 1), each ≥ 1, summing to the model's layers. Always
    /// filled (even, given or chosen by the cost model); lowering, the cost model and every
    /// later stage read the split from here only ([`Parallel::chunk_of_layer`]).
    pub chunk_layers: Vec<u32>,
    /// Axes the spec lets span nodes (`cross_node = [tp]`): their groups may leave a node (a
    /// warning, W0601, not E0601). The plan search keeps them allowed.
    #[serde(skip)]
    pub cross_node: Vec<Axis>,
    pub span: Span,
}

/// What the q/k/v, MLP and linear layers keep of their input under sequence parallelism,
/// where forward all-gathers it from the sequence shard before the projection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpSave {
    /// The sequence shard (1/tp of the rows), all-gathered again at the start of the layer's
    /// backward (Megatron's choice): less memory, one more all-gather per layer.
    #[default]
    Sharded,
    /// The gathered, full-sequence input: no second all-gather, tp× the memory.
    Gathered,
}

/// Where the split of the repeated layers over the pipeline's chunks comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    /// `balance: even` (the default): [`even_layers`].
    Even,
    /// `layers: [4, 3, 3, 2]`: the user's list.
    Given,
    /// `balance: auto`: the cost model's split that minimises the most loaded stage
    /// (`cost::balance`).
    Auto,
}

impl Parallel {
    /// Pipeline stages p and model chunks per stage v (v = 1 unless interleaved with p > 1:
    /// with one stage, virtual chunks collapse to one).
    pub fn pipeline_shape(&self) -> (u32, u32) {
        let p = self.mesh.size(Axis::Pp).max(1);
        let v = match self.schedule {
            PipelineSchedule::Interleaved { virtual_stages } if p > 1 => virtual_stages.max(1),
            _ => 1,
        };
        (p, v)
    }

    /// The pipeline chunk holding repeated layer `layer` under [`Parallel::chunk_layers`]
    /// (layers past the list's sum go to its last chunk).
    pub fn chunk_of_layer(&self, layer: u32) -> u32 {
        let mut end = 0u64;
        for (c, n) in self.chunk_layers.iter().enumerate() {
            end += u64::from(*n);
            if u64::from(layer) < end {
                return c as u32;
            }
        }
        self.chunk_layers.len().saturating_sub(1) as u32
    }
}

/// The even split of `layers` over `chunks` chunks: chunk `c` holds layers
/// `[c·L/chunks, (c+1)·L/chunks)` (equal when `chunks` divides `layers`).
pub fn even_layers(layers: u32, chunks: u32) -> Vec<u32> {
    let chunks = u64::from(chunks.max(1));
    let first = |c: u64| c * u64::from(layers) / chunks;
    (0..chunks)
        .map(|c| (first(c + 1) - first(c)) as u32)
        .collect()
}

// ----------------------------------------------------------------------------------------------
// Training recipe
// ----------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LossScale {
    Static {
        scale: f64,
    },
    /// Dynamic loss scaling: start at `init`, halve on overflow (after `hysteresis` consecutive
    /// overflows), double after `window` clean steps, never below `min`.
    Dynamic {
        init: f64,
        window: u32,
        hysteresis: u32,
        min: f64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Precision {
    Fp32,
    Bf16,
    Fp16 { loss_scale: LossScale },
}

impl Precision {
    /// Bytes per element of weights/activations in compute precision.
    pub fn compute_bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 | Precision::Fp16 { .. } => 2,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Optimizer {
    /// AdamW (decoupled weight decay, applied to 2-D weights only, as nanoGPT).
    AdamW {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    /// SGD with optional momentum (weight decay added to the gradient, PyTorch semantics).
    Sgd {
        lr: f64,
        momentum: f64,
        weight_decay: f64,
    },
}

impl Optimizer {
    pub fn lr(&self) -> f64 {
        match self {
            Optimizer::AdamW { lr, .. } | Optimizer::Sgd { lr, .. } => *lr,
        }
    }
    /// fp32 optimizer-state words per parameter (AdamW: m and v; SGD: momentum or nothing).
    pub fn state_words(&self) -> u64 {
        match self {
            Optimizer::AdamW { .. } => 2,
            Optimizer::Sgd { momentum, .. } => u64::from(*momentum != 0.0),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LrSchedule {
    Constant {
        warmup: u64,
    },
    /// Linear warmup to `lr` over `warmup` steps, cosine decay to `min_lr` at `decay_steps`
    /// (default: `train.steps`), `min_lr` after.
    Cosine {
        warmup: u64,
        min_lr: f64,
        decay_steps: u64,
    },
    /// Linear warmup, then linear decay to `min_lr` at `decay_steps`.
    Linear {
        warmup: u64,
        min_lr: f64,
        decay_steps: u64,
    },
}

impl LrSchedule {
    /// Learning rate for 0-based `step`, given the peak `lr`.
    pub fn lr_at(&self, lr: f64, step: u64) -> f64 {
        let (LrSchedule::Constant { warmup }
        | LrSchedule::Cosine { warmup, .. }
        | LrSchedule::Linear { warmup, .. }) = *self;
        if warmup > 0 && step < warmup {
            return lr * (step + 1) as f64 / warmup as f64;
        }
        let (min_lr, decay_steps) = match *self {
            LrSchedule::Constant { .. } => return lr,
            LrSchedule::Cosine {
                min_lr,
                decay_steps,
                ..
            }
            | LrSchedule::Linear {
                min_lr,
                decay_steps,
                ..
            } => (min_lr, decay_steps),
        };
        if step >= decay_steps || decay_steps <= warmup {
            return min_lr;
        }
        let t = (step - warmup) as f64 / (decay_steps - warmup) as f64;
        if matches!(self, LrSchedule::Cosine { .. }) {
            min_lr + 0.5 * (1.0 + (std::f64::consts::PI * t).cos()) * (lr - min_lr)
        } else {
            lr + t * (min_lr - lr)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataFormat {
    /// Raw bytes of a text file, one token per byte (vocab ≥ 256).
    Bytes,
    /// Little-endian u16 token ids (`.bin`, as nanoGPT/llm.c).
    U16,
    /// Little-endian u32 token ids.
    U32,
}

impl DataFormat {
    /// Its name after `as` (`bytes`, `u16`, `u32`).
    pub fn name(self) -> &'static str {
        match self {
            DataFormat::Bytes => "bytes",
            DataFormat::U16 => "u16",
            DataFormat::U32 => "u32",
        }
    }

    /// Bytes per token id in its files.
    pub fn width(self) -> u64 {
        match self {
            DataFormat::Bytes => 1,
            DataFormat::U16 => 2,
            DataFormat::U32 => 4,
        }
    }

    /// The extension of its files: text read a byte a token, or binary token shards.
    pub fn extension(self) -> &'static str {
        match self {
            DataFormat::Bytes => "txt",
            DataFormat::U16 | DataFormat::U32 => "bin",
        }
    }
}

/// How text becomes token ids (and ids text again, for samples).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Tokenizer {
    /// One token per byte (vocabulary 256; no end-of-text token).
    Bytes,
    /// GPT-2's byte-level BPE (`r50k_base`: 50,257 tokens, `<|endoftext|>` = 50256).
    Gpt2,
    /// A Hugging Face `tokenizer.json`, its path relative to the spec file's folder.
    File { path: String },
}

impl Tokenizer {
    /// The built-in tokenizers' names in the language (a file is written as its path string).
    pub const NAMES: [&'static str; 2] = ["bytes", "gpt2"];

    /// The built-in tokenizer named `name`.
    pub fn from_name(name: &str) -> Option<Tokenizer> {
        match name {
            "bytes" => Some(Tokenizer::Bytes),
            "gpt2" => Some(Tokenizer::Gpt2),
            _ => None,
        }
    }

    /// Its name in the language, or the file's path.
    pub fn name(&self) -> &str {
        match self {
            Tokenizer::Bytes => "bytes",
            Tokenizer::Gpt2 => "gpt2",
            Tokenizer::File { path } => path,
        }
    }

    /// Token ids are below this, when it is known without reading a file (the built-ins).
    pub fn known_vocab(&self) -> Option<u64> {
        match self {
            Tokenizer::Bytes => Some(256),
            Tokenizer::Gpt2 => Some(50_257),
            Tokenizer::File { .. } => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum DataSource {
    /// A file, a folder of shards (its `.bin` files; `.txt` files `as bytes`) or a glob,
    /// relative to the spec file's folder; several files are one token stream, concatenated in
    /// sorted name order.
    File {
        path: String,
        format: DataFormat,
        span: Span,
    },
    /// Text files through a tokenizer, tokenized when the run starts: `path` is a file, a
    /// folder (its `.txt` files) or a glob, relative to the spec file's folder; each file is one
    /// document, followed by the tokenizer's end-of-text token when it has one.
    Text {
        path: String,
        tokenizer: Tokenizer,
        span: Span,
        /// Where the tokenizer is written (a `tokenizer.json`'s path string), for the
        /// diagnostics of its file.
        tokenizer_span: Span,
    },
    /// Uniform random tokens from the seed (benchmarks and tests).
    Synthetic,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Checkpointing {
    pub every: u64,
    pub dir: String,
    /// Keep only the newest `keep` checkpoints (0 = keep all).
    pub keep: u32,
    /// `async`: a background writer saves while training continues (the default); `false`
    /// makes each save finish before the next step.
    pub asynchronous: bool,
}

/// `train.eval`: the validation loss, measured on data training never reads.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Eval {
    /// Evaluate after every `every`-th step (and after the last).
    pub every: u64,
    /// Global batches of evaluation data per evaluation (default [`Eval::DEFAULT_BATCHES`]).
    pub batches: u64,
    /// Where the evaluation data comes from; `None`: the training data's held-out tail (its
    /// last `batches × global_batch` samples, which training then never reads), or for
    /// synthetic training data a synthetic stream of its own.
    pub data: Option<DataSource>,
    pub span: Span,
}

impl Eval {
    /// Global batches per evaluation when `batches` is not written.
    pub const DEFAULT_BATCHES: u64 = 8;
}

/// Where a run's parameters start (`train.init`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum InitFrom {
    /// Counter-based random values from `train.seed` (the default).
    Seeded,
    /// A Hugging Face checkpoint folder (`config.json` and `model.safetensors` or a sharded
    /// `model.safetensors.index.json`), relative to the spec file's folder (`hf("DIR")`).
    Hf { path: String, span: Span },
}

#[derive(Clone, Debug, Serialize)]
pub struct Train {
    /// Sequences per optimizer step over all data-parallel ranks.
    pub global_batch: u64,
    /// Sequences per microbatch per data-parallel rank.
    pub micro_batch: u64,
    pub precision: Precision,
    /// `precision = bf16 { residual: fp32 }`: the residual stream and its gradient stay f32 in
    /// a bf16 run (Megatron's `fp32_residual_connection`; `lower::storage`). False: bf16, as
    /// every other activation; always false outside bf16.
    pub fp32_residual: bool,
    pub optimizer: Optimizer,
    pub schedule: LrSchedule,
    /// Clip the global gradient norm to this value.
    pub grad_clip: Option<f64>,
    pub data: DataSource,
    pub steps: u64,
    pub seed: u64,
    /// Where the parameters start; the optimizer always starts fresh at step 0.
    pub init: InitFrom,
    pub checkpoint: Option<Checkpointing>,
    /// Log every `log_every` steps (default 1).
    pub log_every: u64,
    /// Validation loss every so many steps (`train.eval`), when asked for.
    pub eval: Option<Eval>,
    /// Print a sample from the model while it trains (`train.sample`).
    pub sample: Option<Sampling>,
    /// What a step whose loss or global gradient norm is not finite does
    /// (`train.on_nonfinite`; fp16's overflow skipping is the loss scaler's, not this).
    pub on_nonfinite: OnNonFinite,
    /// FP8 GEMMs (`train.fp8`), when asked for.
    pub fp8: Option<Fp8>,
    pub span: Span,
}

/// `train.fp8 = tensorwise | rowwise | blockwise { … }`: which linear layers compute their
/// GEMMs in FP8 and how operands are scaled (`ir::fp8`, docs/fp8.md). The lowering decides
/// per layer from the cost model, except where a pin says otherwise.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fp8 {
    pub scaling: Fp8Scaling,
    /// The format of gradient operands (weights and activations are E4M3).
    pub grad: Fp8Format,
    /// Delayed scaling (`tensorwise { scaling: delayed, history: H }`): each operand scaled by
    /// the largest amax of its last H steps (`ir::fp8`); None: current scaling.
    pub history: Option<u32>,
    /// Layers kept in bf16 (`bf16: [head, blocks.0]`): layer kinds or node paths.
    pub keep_bf16: Vec<Pin>,
    /// Layers in FP8 whatever the cost model says (`fp8: [MLP]`).
    pub force_fp8: Vec<Pin>,
    /// Tensorwise: each tensor quantized once for the FP8 GEMMs near it that read it
    /// (`quantize: shared`, the default; `lower::fp8_quantize`), or inside each GEMM
    /// (`quantize: per_gemm`, to compare). The same numbers either way on finite values.
    pub shared_quantization: bool,
    pub span: Span,
}

/// One layer an FP8 pin list names (`fp8: [MLP, blocks.3.attn]`): a layer kind or node path,
/// and where it is written (for a diagnostic of that pin alone). Reads as its name (`Deref`,
/// `Display`, serialized as the string).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pin {
    pub name: String,
    pub span: Span,
}

impl From<&str> for Pin {
    /// A pin written nowhere (built by code, not read from a spec).
    fn from(name: &str) -> Pin {
        Pin {
            name: name.to_string(),
            span: Span::default(),
        }
    }
}

impl std::ops::Deref for Pin {
    type Target = str;
    fn deref(&self) -> &str {
        &self.name
    }
}

impl std::fmt::Display for Pin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

impl Serialize for Pin {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name)
    }
}

/// `train.on_nonfinite = stop | skip { max: N }`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum OnNonFinite {
    /// End the run with an error naming the step, the rank and the first op whose output was
    /// not finite (the default).
    #[default]
    Stop,
    /// Leave parameters and optimizer state as they were, at most `max` times in the run;
    /// the next such step stops it.
    Skip { max: u64 },
}

/// `train.sample = { every: N, prompt: "…", tokens: 64 }`: every `every` steps, the model
/// continues `prompt` by up to `tokens` tokens and the run prints the text.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sampling {
    pub every: u64,
    pub prompt: String,
    pub tokens: u64,
    /// Softmax temperature; 0 picks the most likely token (default 1).
    pub temperature: f64,
    /// Draw from the `top_k` most likely tokens only (None: from all).
    pub top_k: Option<u64>,
    /// Where the prompt is written.
    pub span: Span,
}

// ----------------------------------------------------------------------------------------------
// Cluster
// ----------------------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Gpu {
    /// Catalogue name (`h100_80gb`, `h200`, `a100_80gb`, `cpu`, …) or `custom`.
    pub name: String,
    pub memory_bytes: u64,
    /// Dense bf16/fp16 tensor-core peak, FLOP/s.
    pub peak_flops: f64,
    /// Dense fp32 (non-tensor-core) peak, FLOP/s.
    pub peak_flops_fp32: f64,
    /// Dense FP8 tensor-core peak, FLOP/s; None where the GPU has no FP8 tensor cores.
    pub peak_flops_fp8: Option<f64>,
    /// HBM bandwidth, bytes/s.
    pub memory_bandwidth: f64,
}

impl Gpu {
    /// Whether the CUDA backend runs its Hopper (sm_90) kernels here: on a GPU with FP8 tensor
    /// cores, the rule `train.fp8`'s check applies (the catalogue's H100s and H200; a custom
    /// GPU with them counts as one, so its memory is not under-predicted:
    /// [`crate::memplan::KernelTarget`]); not on the CPU, which emulates FP8.
    pub fn hopper(&self) -> bool {
        self.name != "cpu" && self.peak_flops_fp8.is_some()
    }

    /// The peak FLOP/s a run in `precision` computes at: the fp32 peak for fp32, the tensor
    /// peak for bf16/fp16.
    pub fn peak_for(&self, precision: Precision) -> f64 {
        match precision {
            Precision::Fp32 => self.peak_flops_fp32,
            _ => self.peak_flops,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Link {
    /// e.g. `nvlink`, `infiniband`, `ethernet`, `pcie`.
    pub kind: String,
    /// Per-GPU unidirectional bandwidth, bytes/s.
    pub bandwidth: f64,
    /// Per-message latency, seconds.
    pub latency: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Cluster {
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub gpu: Gpu,
    /// Between GPUs of one node.
    pub intra: Link,
    /// Between nodes.
    pub inter: Link,
    pub span: Span,
}

impl Cluster {
    /// GPUs in the cluster (saturating, as [`Mesh::world`]).
    pub fn world(&self) -> u32 {
        self.nodes.saturating_mul(self.gpus_per_node)
    }
}
