//! Activation memory: the tensors each layer keeps for its backward, after Korthikanti et al.
//! 2022 ("Reducing Activation Recomputation in Large Transformer Models", Table 2).
//!
//! A transformer layer keeps, per microbatch (s = local sequence, b = microbatch, h = model
//! width, t = tp, a = heads, d = head dim, k = kv heads, f = MLP hidden):
//! - replicated over tp (divided by t only under sequence parallelism): the two norm inputs
//!   2h, the q/k/v projection input h and the MLP input h (elements per token);
//! - split over tp: q a·d, k and v 2·k·d (gathered to the full sequence under cp), the output
//!   projection input a·d, the activation input f (SwiGLU: gate and up, 2f) and the down
//!   projection input f; with per-head q/k norms (`qk_norm`) also q and k before their norms,
//!   (a + k)·d, and one f32 rstd per head of each, (a + k)·4 bytes;
//! - attention scores, when the attention materialises them: softmax output a·s elements, plus
//!   with dropout a 1-byte mask and the dropout output (the paper's 5as²b bytes); an attention
//!   that keeps only its log-sum-exp (parc's, like FlashAttention) keeps a·4 bytes per token;
//! - with dropout, one 1-byte mask of h after attention and after the MLP;
//! - under sequence parallelism parc keeps the q/k/v, MLP and linear inputs as the sequence
//!   shard and gathers them again in backward, as Megatron does (`parallel.sp_save = sharded`),
//!   or all-gathered (h per token of the whole sequence, `sp_save = gathered`).
//!
//! With 16-bit activations, dropout, materialised scores, f = 4h and k = a this is exactly the
//! paper's sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)) with TP and sbh(34/t + 5as/(ht)) with
//! TP+SP (see the tests). Selective recompute drops the attention core's outputs (the paper: the
//! scores; parc: also the output projection input and the log-sum-exp, which it recomputes).
//! Full or named recompute keeps only each recomputed run's input (the paper's 2sbh per layer),
//! plus what the largest recomputed layer rebuilds for its backward, which is alive once the
//! last chunk's logits are gone (the larger of the two counts).

use super::schedule::InFlight;
use crate::spec::{Axis, LayerKind, Precision, Recompute, SpSave, Spec};

/// What the attention and the layers keep, beyond the tensors every implementation keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Keeps {
    /// Dropout after attention and MLP (and on the scores).
    pub dropout: bool,
    /// The softmax output is materialised and kept (otherwise only the log-sum-exp).
    pub scores: bool,
    /// Under sequence parallelism the q/k/v and MLP inputs are kept all-gathered (whole
    /// sequence) rather than as the sequence shard that backward gathers again.
    pub gathered_inputs: bool,
}

impl Keeps {
    /// Korthikanti et al.'s GPT: dropout everywhere, materialised scores.
    pub const PAPER: Keeps = Keeps {
        dropout: true,
        scores: true,
        gathered_inputs: false,
    };
    /// parc's layers: no dropout, attention keeps its log-sum-exp, matmul inputs kept gathered
    /// under `parallel.sp_save = gathered`.
    pub const PARC: Keeps = Keeps {
        dropout: false,
        scores: false,
        gathered_inputs: true,
    };

    /// parc's layers under `spec`'s `parallel.sp_save`.
    pub fn parc(spec: &Spec) -> Keeps {
        Keeps {
            gathered_inputs: spec.parallel.sp_save == SpSave::Gathered,
            ..Keeps::PARC
        }
    }
}

/// Korthikanti et al.'s recompute choices for one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerRecompute {
    None,
    Selective,
    Full,
}

/// The dimensions of one transformer layer as one rank sees them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerDims {
    /// Local sequence length (seq / cp).
    pub s: f64,
    pub b: f64,
    pub h: f64,
    pub heads: f64,
    pub kv_heads: f64,
    pub head_dim: f64,
    pub ffn: f64,
    pub gated: bool,
    /// q and k are RMS-normalized per head (their inputs and rstd kept for the backward).
    pub qk_norm: bool,
    pub t: f64,
    pub sp: bool,
    /// Context-parallel degree (k and v are gathered to s·cp positions).
    pub cp: f64,
    /// Bytes per activation element (2 for bf16/fp16, 4 for fp32).
    pub elem: f64,
}

impl LayerDims {
    /// Tokens-per-rank factor for tensors replicated over tp (÷t under sequence parallelism).
    fn replicated(&self) -> f64 {
        if self.sp {
            self.s * self.b / self.t
        } else {
            self.s * self.b
        }
    }
    fn sb(&self) -> f64 {
        self.s * self.b
    }
    /// Tokens-per-rank factor for a block's kept input.
    fn block_input(&self, keeps: Keeps) -> f64 {
        if keeps.gathered_inputs {
            self.sb()
        } else {
            self.replicated()
        }
    }

    /// Bytes the two norms keep (their inputs).
    pub fn norms(&self) -> f64 {
        2.0 * self.replicated() * self.h * self.elem
    }

    /// Bytes the attention block keeps (without its norm).
    pub fn attention(&self, keeps: Keeps, recompute: LayerRecompute) -> f64 {
        let (sb, t, e) = (self.sb(), self.t, self.elem);
        let qd = self.heads * self.head_dim;
        let kvd = self.kv_heads * self.head_dim;
        let mut bytes = self.block_input(keeps) * self.h * e; // projection input
        bytes += sb * (qd + 2.0 * kvd * self.cp) / t * e; // q, k, v
        if self.qk_norm {
            // q and k before their norms, and each head's rstd.
            bytes += sb * (qd + kvd) / t * e + sb * (self.heads + self.kv_heads) / t * 4.0;
        }
        if keeps.dropout {
            bytes += self.replicated() * self.h; // mask after the output projection
        }
        let core_kept = recompute != LayerRecompute::Selective;
        if keeps.scores {
            bytes += sb * qd / t * e; // output projection input
            if core_kept {
                let scores = sb * self.heads / t * self.s * self.cp;
                bytes += scores * e;
                if keeps.dropout {
                    bytes += scores * (1.0 + e);
                }
            }
        } else if core_kept {
            bytes += sb * qd / t * e + sb * self.heads / t * 4.0; // o and lse
        }
        bytes
    }

    /// Bytes the MLP block keeps (without its norm).
    pub fn mlp(&self, keeps: Keeps) -> f64 {
        let (sb, t, e) = (self.sb(), self.t, self.elem);
        let act_in = if self.gated { 2.0 } else { 1.0 } * self.ffn;
        let mut bytes = self.block_input(keeps) * self.h * e; // fc input
        bytes += sb * (act_in + self.ffn) / t * e; // activation input, down projection input
        if keeps.dropout {
            bytes += self.replicated() * self.h;
        }
        bytes
    }

    /// Bytes one whole layer keeps for one microbatch.
    pub fn layer(&self, keeps: Keeps, recompute: LayerRecompute) -> f64 {
        match recompute {
            LayerRecompute::Full => self.replicated() * self.h * self.elem,
            _ => self.norms() + self.attention(keeps, recompute) + self.mlp(keeps),
        }
    }
}

/// Korthikanti et al. 2022, Table 2: activation bytes per layer, as printed.
pub fn korthikanti_table2(s: f64, b: f64, h: f64, a: f64, t: f64, variant: Table2) -> f64 {
    let sbh = s * b * h;
    match variant {
        Table2::NoParallelism => sbh * (34.0 + 5.0 * a * s / h),
        Table2::Tensor => sbh * (10.0 + 24.0 / t + 5.0 * a * s / (h * t)),
        Table2::TensorSequence => sbh * (34.0 / t + 5.0 * a * s / (h * t)),
        Table2::TensorSelective => sbh * (10.0 + 24.0 / t),
        Table2::TensorSequenceSelective => sbh * 34.0 / t,
        Table2::FullRecompute => sbh * 2.0,
    }
}

/// The rows of Korthikanti et al.'s Table 2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Table2 {
    NoParallelism,
    Tensor,
    TensorSequence,
    TensorSelective,
    TensorSequenceSelective,
    FullRecompute,
}

fn elem(precision: Precision) -> f64 {
    super::act_bytes(precision) as f64
}

/// Dims of a layer with `kind`'s attention or MLP sizes, as one rank of `spec` sees them.
fn dims(spec: &Spec, attention: Option<&LayerKind>, mlp: Option<&LayerKind>) -> LayerDims {
    let mesh = &spec.parallel.mesh;
    let t = f64::from(mesh.size(Axis::Tp).max(1));
    let cp = f64::from(mesh.size(Axis::Cp).max(1));
    let h = spec.model.dim as f64;
    let (heads, kv_heads, head_dim, heads_split, qk_norm) = match attention {
        Some(LayerKind::Attention {
            heads,
            kv_heads,
            head_dim,
            qk_norm,
            ..
        }) => (
            *heads as f64,
            *kv_heads as f64,
            *head_dim as f64,
            spec.model.sharding.attention_heads_on_tp,
            qk_norm.is_some(),
        ),
        _ => (0.0, 0.0, 0.0, true, false),
    };
    let (ffn, gated, ffn_split) = match mlp {
        Some(LayerKind::Mlp { hidden, act, .. }) => (
            *hidden as f64,
            act.is_gated(),
            spec.model.sharding.mlp_hidden_on_tp,
        ),
        _ => (0.0, false, true),
    };
    // A block the spec does not split keeps its tensors whole: fold that into the head/ffn
    // counts so one `t` serves both.
    let unsplit = |x: f64, split: bool| if split { x } else { x * t };
    LayerDims {
        s: spec.model.seq as f64 / cp,
        b: spec.train.micro_batch as f64,
        h,
        heads: unsplit(heads, heads_split),
        kv_heads: unsplit(kv_heads, heads_split),
        head_dim,
        ffn: unsplit(ffn, ffn_split),
        gated,
        qk_norm,
        t,
        sp: spec.parallel.sequence_parallel && t > 1.0,
        cp,
        elem: elem(spec.train.precision),
    }
}

/// Bytes one node keeps for one microbatch when it is not recomputed (selective: its core).
fn node_bytes(spec: &Spec, kind: &LayerKind, selective: bool) -> f64 {
    let keeps = Keeps::parc(spec);
    let d = dims(spec, Some(kind), Some(kind));
    let recompute = if selective {
        LayerRecompute::Selective
    } else {
        LayerRecompute::None
    };
    match kind {
        LayerKind::LayerNorm { .. } | LayerKind::RmsNorm { .. } => d.norms() / 2.0,
        LayerKind::Attention { .. } => d.attention(keeps, recompute),
        LayerKind::Mlp { .. } => d.mlp(keeps),
        LayerKind::Linear {
            in_dim, out_dim, ..
        } => {
            let vocab_split = super::tp_divides(spec, kind);
            let input = d.block_input(keeps) * *in_dim as f64 * d.elem;
            let out = *out_dim as f64 / if vocab_split { d.t } else { 1.0 };
            // The loss keeps the logits when they are the vocab, stored like activations (the
            // fused loss writes dlogits over them: no second buffer).
            let logits = if *out_dim == spec.model.vocab {
                d.s * d.b * out * d.elem
            } else {
                0.0
            };
            input + logits
        }
        // An elementwise layer keeps its inputs (replicated over tp like the hidden states
        // between layers, split by sequence parallelism).
        LayerKind::Elementwise { f, dim } => {
            f.params.len() as f64 * d.replicated() * *dim as f64 * d.elem
        }
        LayerKind::Embedding { .. }
        | LayerKind::PositionEmbedding { .. }
        | LayerKind::Add
        | LayerKind::CrossEntropy => 0.0,
    }
}

/// Activation bytes one rank of a stage holds at its peak.
pub fn stage_activation_bytes(spec: &Spec, in_stage: &[bool], in_flight: InFlight) -> u64 {
    let selective = spec.parallel.recompute == Recompute::Selective;
    let nodes = &spec.model.nodes;
    let d = dims(spec, None, None);
    let boundary = d.replicated() * d.h * d.elem;
    let mut layer_bytes = 0.0;
    let mut first_bytes = 0.0;
    let mut last_bytes = 0.0;
    let mut in_run = false;
    let mut seen_layer = false;
    // What one recomputed layer rebuilds during its backward (the largest such layer).
    let mut rebuilt: std::collections::BTreeMap<Option<u32>, f64> = Default::default();
    for (i, (node, &here)) in nodes.iter().zip(in_stage).enumerate() {
        if node.layer.is_some() {
            seen_layer = true;
        }
        if !here {
            in_run = false;
            continue;
        }
        let bytes = if node.recompute && !selective {
            *rebuilt.entry(node.layer).or_default() += node_bytes(spec, &node.kind, false);
            // A run of recomputed nodes keeps only its input.
            let starts_run =
                !in_run || i == 0 || nodes.get(i - 1).map(|n| n.layer) != Some(node.layer);
            in_run = true;
            if starts_run {
                boundary
            } else {
                0.0
            }
        } else {
            in_run = false;
            node_bytes(spec, &node.kind, selective && node.recompute)
        };
        match node.layer {
            Some(_) => layer_bytes += bytes,
            None if seen_layer => last_bytes += bytes,
            None => first_bytes += bytes,
        }
    }
    // A layer is rebuilt in backward, after the head's backward has freed its microbatch's
    // logits: the two peaks do not add up.
    let working_set = rebuilt.values().copied().fold(0.0, f64::max);
    let total = layer_bytes * in_flight.layer_microbatches
        + first_bytes * f64::from(in_flight.first_chunk)
        + (last_bytes * f64::from(in_flight.last_chunk)).max(working_set);
    total.ceil() as u64
}
