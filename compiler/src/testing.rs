//! Specs' parts built in code for tests, without the parser (feature `testing`; always in
//! this crate's own tests): a GPT-2-style or Llama-style decoder of any size
//! ([`decoder_model`]) and the training settings the tests share ([`train`]). The compiler's
//! tests (`cost::testspec`) and the workspace's integration tests (`tests/ir/fixtures.rs`) put
//! them in specs with their own plans and clusters.

use crate::diag::Span;
use crate::ir::op::Act;
use crate::spec::{
    Activation, DataSource, InitFrom, LayerKind, LrSchedule, Model, Node, NodeId, OnNonFinite,
    Optimizer, Precision, Recompute, Rope, RopeScaling, Shape, Sharding, Train, Value, ValueId,
};

/// Llama 3.2's published RoPE scaling (`rope_scaling` of its config.json): the tests of the
/// scaled frequencies and of the HF config's check share it.
pub const LLAMA3_2_SCALING: RopeScaling = RopeScaling::Llama3 {
    factor: 32.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position: 8192,
};

/// A decoder's sizes and style.
#[derive(Clone, Debug)]
pub struct Dims {
    pub vocab: u64,
    pub dim: u64,
    pub seq: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub ffn: u64,
    pub layers: u32,
    /// Llama style (RMSNorm, RoPE, SwiGLU, no biases, no position table) instead of GPT-2's.
    pub llama: bool,
    /// The head reuses the embedding table.
    pub tied: bool,
}

impl Dims {
    pub fn tiny() -> Dims {
        Dims {
            vocab: 32,
            dim: 16,
            seq: 8,
            heads: 4,
            kv_heads: 4,
            ffn: 64,
            layers: 4,
            llama: false,
            tied: true,
        }
    }
    /// GPT-2 124M: 12 layers, d 768, 12 heads, ffn 3072, the vocab padded to 50304, seq 1024,
    /// a tied head.
    pub fn gpt2_124m() -> Dims {
        Dims {
            dim: 768,
            heads: 12,
            kv_heads: 12,
            ffn: 3072,
            layers: 12,
            ..Dims::gpt2_350m()
        }
    }
    /// GPT-2 350M: 24 layers, d 1024, 16 heads, ffn 4096, the vocab padded to 50304, seq 1024,
    /// a tied head.
    pub fn gpt2_350m() -> Dims {
        Dims {
            vocab: 50304,
            dim: 1024,
            seq: 1024,
            heads: 16,
            kv_heads: 16,
            ffn: 4096,
            layers: 24,
            llama: false,
            tied: true,
        }
    }
    /// Llama-3-70B: 80 layers, d 8192, 64 heads, 8 kv heads, ffn 28672, vocab 128256.
    pub fn llama3_70b() -> Dims {
        Dims {
            vocab: 128256,
            dim: 8192,
            seq: 8192,
            heads: 64,
            kv_heads: 8,
            ffn: 28672,
            layers: 80,
            llama: true,
            tied: false,
        }
    }
}

/// The decoder `d` as the model `name`: tokens → embedding (→ position table) → `d.layers`
/// blocks (norm, attention, residual add, norm, MLP, residual add) → final norm → head →
/// cross-entropy. Node `i`'s output is value `2 + i`, named like the node (`blocks.3.attn`).
/// `recompute` marks nodes as the spec's `recompute` would; with `tp` > 1 the attention heads,
/// MLP hidden and vocab are sharded over tp, with `cp` > 1 the sequence over cp.
pub fn decoder_model(d: &Dims, name: &str, recompute: &Recompute, tp: u32, cp: u32) -> Model {
    let mut values: Vec<Value> = Vec::new();
    let mut nodes: Vec<Node> = Vec::new();
    let mut value = |name: String, shape: Shape| {
        values.push(Value {
            name,
            shape,
            span: Span::default(),
        });
        ValueId(values.len() as u32 - 1)
    };
    let tokens = value("tokens".into(), Shape::Tokens);
    let targets = value("targets".into(), Shape::Tokens);
    let dim = d.dim;
    let mut add = |name: String, kind: LayerKind, inputs: Vec<ValueId>, layer: Option<u32>| {
        let shape = match kind {
            LayerKind::CrossEntropy => Shape::Scalar,
            LayerKind::Linear { out_dim, .. } => Shape::Hidden(out_dim),
            _ => Shape::Hidden(dim),
        };
        let output = value(name.clone(), shape);
        let recomputed = match (recompute, &kind, layer) {
            (Recompute::Selective, LayerKind::Attention { .. }, _) => true,
            (Recompute::Full, _, Some(_)) => true,
            (Recompute::Named(names), k, _) => names.iter().any(|n| n == k.kind_name()),
            _ => false,
        };
        nodes.push(Node {
            name,
            kind,
            inputs,
            output,
            layer,
            recompute: recomputed,
            span: Span::default(),
        });
        output
    };
    let norm = || {
        if d.llama {
            LayerKind::RmsNorm { dim, eps: 1e-5 }
        } else {
            LayerKind::LayerNorm {
                dim,
                eps: 1e-5,
                bias: true,
            }
        }
    };
    let embedding = LayerKind::Embedding {
        vocab: d.vocab,
        dim,
    };
    let mut x = add("embed".into(), embedding, vec![tokens], None);
    if !d.llama {
        let table = LayerKind::PositionEmbedding { seq: d.seq, dim };
        x = add("pos".into(), table, vec![x], None);
    }
    for l in 0..d.layers {
        let p = format!("blocks.{l}");
        let a = add(format!("{p}.ln1"), norm(), vec![x], Some(l));
        let attention = LayerKind::Attention {
            dim,
            heads: d.heads,
            kv_heads: d.kv_heads,
            head_dim: dim / d.heads,
            causal: true,
            rope: d.llama.then_some(Rope {
                theta: 10000.0,
                scaling: RopeScaling::None,
                fraction: 1.0,
            }),
            qkv_bias: !d.llama,
            out_bias: !d.llama,
            qk_norm: None,
            scale: None,
        };
        let a = add(format!("{p}.attn"), attention, vec![a], Some(l));
        x = add(format!("{p}.add1"), LayerKind::Add, vec![x, a], Some(l));
        let m = add(format!("{p}.ln2"), norm(), vec![x], Some(l));
        let mlp = LayerKind::Mlp {
            dim,
            hidden: d.ffn,
            act: if d.llama {
                Activation::Swiglu
            } else {
                Activation::Plain(Act::GeluTanh)
            },
            bias: !d.llama,
        };
        let m = add(format!("{p}.mlp"), mlp, vec![m], Some(l));
        x = add(format!("{p}.add2"), LayerKind::Add, vec![x, m], Some(l));
    }
    let xf = add("ln_f".into(), norm(), vec![x], None);
    let head = LayerKind::Linear {
        in_dim: dim,
        out_dim: d.vocab,
        bias: false,
        tied: d.tied.then_some(NodeId(0)),
    };
    let logits = add("head".into(), head, vec![xf], None);
    let loss = add(
        "loss".into(),
        LayerKind::CrossEntropy,
        vec![logits, targets],
        None,
    );
    Model {
        name: name.into(),
        span: Span::default(),
        seq: d.seq,
        vocab: d.vocab,
        dim,
        layers: d.layers,
        values,
        nodes,
        tokens,
        targets,
        loss,
        sharding: Sharding {
            attention_heads_on_tp: tp > 1,
            mlp_hidden_on_tp: tp > 1,
            vocab_on_tp: tp > 1,
            seq_on_cp: cp > 1,
            spans: Vec::new(),
        },
    }
}

/// AdamW at lr 1e-3, betas 0.9 and 0.95, eps 1e-8, weight decay 0.1.
pub fn adamw() -> Optimizer {
    Optimizer::AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// Training with `optimizer` in `precision`, `micro_batch` sequences per microbatch and
/// `global_batch` per step: a constant learning rate, gradients clipped at norm 1, synthetic
/// data, 5 steps from seed 0, no checkpoints, every step logged, no evaluation.
pub fn train(
    micro_batch: u64,
    global_batch: u64,
    precision: Precision,
    optimizer: Optimizer,
) -> Train {
    Train {
        global_batch,
        micro_batch,
        precision,
        fp32_residual: false,
        optimizer,
        schedule: LrSchedule::Constant { warmup: 0 },
        grad_clip: Some(1.0),
        data: DataSource::Synthetic,
        steps: 5,
        seed: 0,
        init: InitFrom::Seeded,
        checkpoint: None,
        log_every: 1,
        eval: None,
        sample: None,
        on_nonfinite: OnNonFinite::Stop,
        fp8: None,
        span: Span::default(),
    }
}
