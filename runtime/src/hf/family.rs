//! Recognising a spec's model as a transformers architecture, from its layer graph alone:
//! GPT-2 (`GPT2LMHeadModel`: Embedding + PositionEmbedding, pre-LayerNorm blocks of biased
//! multi-head attention without RoPE and a plain-activation MLP, a tied head) or the Llama
//! family (`LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`: Embedding, pre-RMSNorm
//! blocks of RoPE attention and a SwiGLU MLP, a tied or untied head; Qwen3 when the attention
//! normalizes q and k per head). Anything else (an extra elementwise layer, a `.par` function
//! activation, post-norm blocks, a scaled embedding, …) is an error naming the layer and,
//! for the last two, what to write instead.
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::Act;
use parc_compiler::spec::{Activation, LayerKind, Node, NodeId, Rope, RopeScaling, Spec, ValueId};

/// A transformers model class parc's graphs map to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `GPT2LMHeadModel`.
    Gpt2,
    /// `LlamaForCausalLM` (with `attention_bias` when the attention has both biases).
    Llama,
    /// `Qwen2ForCausalLM`: Llama with biases on q, k and v and none on the output.
    Qwen2,
    /// `Qwen3ForCausalLM`: Llama with each head of q and k RMS-normalized before RoPE
    /// (`self_attn.q_norm`, `self_attn.k_norm`; `attention_bias` as Llama's).
    Qwen3,
}

impl Family {
    /// The transformers class (`architectures` in config.json).
    pub fn class(self) -> &'static str {
        match self {
            Family::Gpt2 => "GPT2LMHeadModel",
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// config.json's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }
}

/// The node names of one transformer block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockNodes {
    pub ln1: String,
    pub attn: String,
    pub ln2: String,
    pub mlp: String,
}

/// A spec's model as a transformers architecture: the sizes config.json records and the
/// nodes whose parameters become its tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct Arch {
    pub family: Family,
    /// The spec's (possibly padded) vocabulary.
    pub vocab: u64,
    pub dim: u64,
    pub seq: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    /// The MLP's hidden width.
    pub ffn: u64,
    /// Every norm's epsilon.
    pub eps: f64,
    /// GPT-2's `activation_function`: `gelu_new` (parc's gelu_tanh) or `gelu`.
    pub activation: &'static str,
    /// RoPE's base (Llama family).
    pub theta: f64,
    /// RoPE's frequency scaling (config.json's `rope_scaling`; Llama family).
    pub rope_scaling: RopeScaling,
    /// Biases on the q/k/v projection and on the output projection.
    pub qkv_bias: bool,
    pub out_bias: bool,
    /// The head reuses the embedding table.
    pub tied: bool,
    pub embed: String,
    /// GPT-2's position table.
    pub pos: Option<String>,
    pub blocks: Vec<BlockNodes>,
    pub ln_f: String,
    pub head: String,
}

fn unmapped(node: &Node, what: impl std::fmt::Display) -> RuntimeError {
    let what = match &node.kind {
        LayerKind::Elementwise { f, .. } => format!(
            "transformers' models have no elementwise layer like the .par function `{}`; {what}",
            f.to_text()
        ),
        _ => what.to_string(),
    };
    RuntimeError::Hf(format!(
        "layer `{}` ({}) has no counterpart in transformers' GPT-2 or Llama models: {what}",
        node.name,
        node.kind.kind_name()
    ))
}

/// One block's attention and MLP settings; every block of a transformers model shares them.
#[derive(Clone, Debug, PartialEq)]
struct BlockShape {
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    rope: Option<Rope>,
    qkv_bias: bool,
    out_bias: bool,
    /// The per-head q/k norms' epsilon.
    qk_norm: Option<f64>,
    ffn: u64,
    act: Activation,
    mlp_bias: bool,
    eps: f64,
}

impl BlockShape {
    /// The settings in which `self` differs from `other`, as `name a vs b`.
    fn differences(&self, other: &BlockShape) -> Vec<String> {
        let fields = |b: &BlockShape| {
            [
                ("heads", b.heads.to_string()),
                ("kv_heads", b.kv_heads.to_string()),
                ("head_dim", b.head_dim.to_string()),
                ("rope theta", format!("{:?}", b.rope.map(|r| r.theta))),
                ("rope scaling", format!("{:?}", b.rope.map(|r| r.scaling))),
                ("rope fraction", format!("{:?}", b.rope.map(|r| r.fraction))),
                ("qkv_bias", b.qkv_bias.to_string()),
                ("out bias", b.out_bias.to_string()),
                ("qk_norm", format!("{:?}", b.qk_norm)),
                ("MLP hidden", b.ffn.to_string()),
                ("activation", b.act.name().to_string()),
                ("MLP bias", b.mlp_bias.to_string()),
                ("norm eps", b.eps.to_string()),
            ]
        };
        fields(self)
            .into_iter()
            .zip(fields(other))
            .filter(|(a, b)| a.1 != b.1)
            .map(|((name, a), (_, b))| format!("{name} {a} vs {b}"))
            .collect()
    }
}

/// Walks the nodes in order, checking each one's kind and inputs.
struct Walk<'a> {
    spec: &'a Spec,
    at: usize,
}

impl<'a> Walk<'a> {
    /// The next node, which must read exactly `inputs` (in any order).
    fn next(&mut self, inputs: &[ValueId], expected: &str) -> Result<&'a Node> {
        let nodes = &self.spec.model.nodes;
        let Some(node) = nodes.get(self.at) else {
            let last = nodes
                .last()
                .map_or("the model".to_string(), |n| n.name.clone());
            return Err(RuntimeError::Hf(format!(
                "the model ends after `{last}` where transformers' GPT-2 and Llama models have \
                 {expected}"
            )));
        };
        self.at += 1;
        let mut got = node.inputs.clone();
        let mut want = inputs.to_vec();
        got.sort();
        want.sort();
        if got != want {
            return Err(unmapped(
                node,
                format!("transformers' models have {expected} here, reading the layer before"),
            ));
        }
        if matches!(node.kind, LayerKind::Elementwise { .. }) {
            // Its place, not a reason that fits the layer expected here ("the norms are
            // RMSNorms" named a softcap after a block).
            return Err(unmapped(node, format!("they have {expected} here")));
        }
        Ok(node)
    }
}

/// Recognise `spec`'s model (see the module docs).
pub fn recognise(spec: &Spec) -> Result<Arch> {
    let model = &spec.model;
    let mut walk = Walk { spec, at: 0 };
    let embed = walk.next(&[model.tokens], "the token embedding")?;
    let LayerKind::Embedding { vocab, dim } = embed.kind else {
        return Err(unmapped(embed, "the model must start with an Embedding"));
    };
    let mut x = embed.output;
    let mut pos = None;
    if let Some(node) = model.nodes.get(walk.at) {
        if let LayerKind::PositionEmbedding { seq, .. } = node.kind {
            let node = walk.next(&[x], "a position table")?;
            if seq != model.seq {
                return Err(unmapped(
                    node,
                    format!("its {seq} positions are not seq {}", model.seq),
                ));
            }
            pos = Some(node.name.clone());
            x = node.output;
        }
    }
    if let Some(node) = model.nodes.get(walk.at) {
        refuse_scaled_embedding(node, x)?;
    }
    let gpt2 = matches!(
        model.nodes.get(walk.at).map(|n| &n.kind),
        Some(LayerKind::LayerNorm { .. })
    );
    let (blocks, block, first_block, x) = blocks(&mut walk, x, gpt2)?;
    let ln_f = walk.next(&[x], "the final norm")?;
    if !is_norm(ln_f) {
        return Err(unmapped(
            ln_f,
            "transformers' models have a final norm between the last block and the head; add \
             one (`RMSNorm(d)(x) as ln_f`, GPT-2's `LayerNorm(d)`) to export the model or start \
             it from transformers' weights",
        ));
    }
    let head = walk.next(&[ln_f.output], "the head")?;
    let loss = walk.next(&[head.output, model.targets], "the loss")?;
    if !matches!(loss.kind, LayerKind::CrossEntropy) {
        return Err(unmapped(
            loss,
            "the model must end with CrossEntropy(logits, targets)",
        ));
    }
    let eps = norm_eps(ln_f, gpt2)?;
    if eps != block.eps {
        return Err(unmapped(
            ln_f,
            format!(
                "its eps {eps} is not the blocks' {}; config.json has one",
                block.eps
            ),
        ));
    }
    let tied = head_is_tied(head, dim, vocab)?;
    let family = family_of(gpt2, pos.is_some(), &block, tied, first_block, head)?;
    Ok(Arch {
        family,
        vocab,
        dim,
        seq: model.seq,
        heads: block.heads,
        kv_heads: block.kv_heads,
        head_dim: block.head_dim,
        ffn: block.ffn,
        eps,
        activation: match block.act {
            Activation::Plain(Act::Gelu) => "gelu",
            _ => "gelu_new",
        },
        theta: block.rope.map_or(0.0, |r| r.theta),
        rope_scaling: block.rope.map_or(RopeScaling::None, |r| r.scaling),
        qkv_bias: block.qkv_bias,
        out_bias: block.out_bias,
        tied,
        embed: embed.name.clone(),
        pos,
        blocks,
        ln_f: ln_f.name.clone(),
        head: head.name.clone(),
    })
}

/// The blocks from `x` up to the final norm (the model's last three nodes: norm, head, loss):
/// their node names, their shared settings, the first one's attention node, and their output.
fn blocks<'a>(
    walk: &mut Walk<'a>,
    mut x: ValueId,
    gpt2: bool,
) -> Result<(Vec<BlockNodes>, BlockShape, &'a Node, ValueId)> {
    let end = walk.spec.model.nodes.len().saturating_sub(3);
    let mut names = Vec::new();
    let mut first: Option<(BlockShape, &Node)> = None;
    while walk.at < end {
        let (block, shape, attn, out) = block(walk, x, gpt2)?;
        if let Some((first_shape, first_attn)) = &first {
            let differences = shape.differences(first_shape);
            if !differences.is_empty() {
                return Err(unmapped(
                    attn,
                    format!(
                        "its block differs from `{}`'s ({}); a transformers config has one of \
                         each for every layer",
                        first_attn.name,
                        differences.join(", ")
                    ),
                ));
            }
        } else {
            first = Some((shape, attn));
        }
        names.push(block);
        x = out;
    }
    match first {
        Some((shape, attn)) => Ok((names, shape, attn, x)),
        None => {
            let node = walk.spec.model.nodes.get(walk.at);
            Err(node.map_or_else(
                || RuntimeError::Hf("the model has no transformer blocks".into()),
                |n| unmapped(n, "the model has no transformer blocks before it"),
            ))
        }
    }
}

/// An elementwise layer reading the embedding's output `x` (a scaled embedding: Gemma
/// multiplies it by sqrt(d)) is refused as what it is, not as a norm of the wrong kind.
fn refuse_scaled_embedding(node: &Node, x: ValueId) -> Result<()> {
    let LayerKind::Elementwise { f, .. } = &node.kind else {
        return Ok(());
    };
    if node.inputs != [x] {
        return Ok(());
    }
    Err(RuntimeError::Hf(format!(
        "layer `{}` (Elementwise, `{}`) changes the embedding's output before the first block \
         (a scaled embedding, as Gemma's sqrt(d) normalizer): transformers' GPT-2, Llama and \
         Qwen models feed the embedding into the first block unchanged, and parc exports no \
         family that scales it; remove the layer from the spec (train without the scale) to \
         export the model or start it from transformers' weights",
        node.name,
        f.to_text()
    )))
}

/// A block whose attention or MLP reads the residual stream itself, not a norm of it, is
/// refused as such (post-norm when a norm follows its residual add), not as a norm of the
/// wrong kind. `layer` is the node where the block's first norm should be.
fn refuse_unnormed_input(spec: &Spec, layer: &Node) -> Result<()> {
    if !matches!(
        layer.kind,
        LayerKind::Attention { .. } | LayerKind::Mlp { .. }
    ) {
        return Ok(());
    }
    let reader = |v: ValueId| spec.model.nodes.iter().find(|n| n.inputs.contains(&v));
    let post_norm = reader(layer.output)
        .filter(|add| add.kind == LayerKind::Add)
        .and_then(|add| reader(add.output))
        .is_some_and(is_norm);
    let what = if post_norm {
        "it reads the residual stream with no norm before it: a post-norm block (the norm \
         after the residual add)"
    } else {
        "it reads the residual stream with no norm before it"
    };
    Err(unmapped(
        layer,
        format!(
            "{what}, where transformers' GPT-2, Llama and Qwen blocks are pre-norm (a norm \
             before attention and before the MLP, each added back to its unnormed input); write \
             the block pre-norm, as std::llama's and std::gpt2's Block do (`h = x + \
             Attention(…)(RMSNorm(d)(x))`, then `h + MLP(…)(RMSNorm(d)(h))`), to export the model or start it from \
             transformers' weights"
        ),
    ))
}

/// Whether the head (which must be `Linear(dim, vocab, bias = false)`) is tied.
fn head_is_tied(head: &Node, dim: u64, vocab: u64) -> Result<bool> {
    match head.kind {
        LayerKind::Linear {
            in_dim,
            out_dim,
            bias: false,
            tied,
        } if in_dim == dim && out_dim == vocab => Ok(tied == Some(NodeId(0))),
        _ => Err(unmapped(
            head,
            format!("the head must be Linear({dim}, {vocab}, bias = false)"),
        )),
    }
}

/// The family a block shape belongs to, or why none does.
fn family_of(
    gpt2: bool,
    has_pos: bool,
    b: &BlockShape,
    tied: bool,
    block: &Node,
    head: &Node,
) -> Result<Family> {
    if gpt2 {
        let why = if !has_pos {
            Some(
                "a model of LayerNorms is GPT-2, which has learned positions \
                 (PositionEmbedding after the Embedding); the Llama family's norms are RMSNorms",
            )
        } else if b.rope.is_some() {
            Some("GPT-2's attention has no RoPE")
        } else if !(b.qkv_bias && b.out_bias && b.mlp_bias) {
            Some("GPT-2's attention and MLP have biases")
        } else if b.kv_heads != b.heads {
            Some("GPT-2 has no grouped-query attention (kv_heads = heads)")
        } else if b.qk_norm.is_some() {
            Some("GPT-2's attention does not normalize q and k")
        } else if !matches!(b.act, Activation::Plain(Act::GeluTanh | Act::Gelu)) {
            return Err(unmapped(
                block,
                format!(
                    "its MLP's activation `{}` is none of GPT-2's (gelu_tanh as gelu_new, gelu)",
                    b.act.name()
                ),
            ));
        } else {
            None
        };
        if let Some(why) = why {
            return Err(unmapped(block, why));
        }
        if !tied {
            return Err(unmapped(
                head,
                "GPT-2's head is tied to the embedding (`tied = Embedding`)",
            ));
        }
        return Ok(Family::Gpt2);
    }
    let why = if has_pos {
        "the Llama family has no position table"
    } else if b.rope.is_none() {
        "the Llama family's attention has RoPE"
    } else if b.rope.is_some_and(|r| r.fraction != 1.0) {
        "the Llama family's RoPE turns every feature of a head (`fraction = 1`), not a part \
         of them as GPT-NeoX's and Phi's partial rotary does"
    } else if b.act != Activation::Swiglu {
        "the Llama family's MLP is SwiGLU (`act = swiglu`)"
    } else if b.qk_norm.is_some() {
        match (b.qkv_bias, b.out_bias) {
            (false, false) | (true, true) => return Ok(Family::Qwen3),
            _ => "Qwen3's attention_bias puts biases on q, k, v and the output alike",
        }
    } else {
        match (b.qkv_bias, b.out_bias) {
            (false, false) | (true, true) => return Ok(Family::Llama),
            (true, false) => return Ok(Family::Qwen2),
            (false, true) => {
                "an output bias without q/k/v biases is neither Llama's attention_bias nor Qwen2's"
            }
        }
    };
    Err(unmapped(block, why))
}

/// Whether `node` is a norm of either family's kind (LayerNorm or RMSNorm).
fn is_norm(node: &Node) -> bool {
    matches!(
        node.kind,
        LayerKind::RmsNorm { .. } | LayerKind::LayerNorm { .. }
    )
}

fn norm_eps(node: &Node, gpt2: bool) -> Result<f64> {
    match (&node.kind, gpt2) {
        (
            LayerKind::LayerNorm {
                eps, bias: true, ..
            },
            true,
        ) => Ok(*eps),
        (LayerKind::LayerNorm { .. }, true) => Err(unmapped(
            node,
            "a LayerNorm without a bias is neither GPT-2's (LayerNorms with biases) nor the \
             Llama family's (RMSNorms)",
        )),
        (LayerKind::RmsNorm { eps, .. }, false) => Ok(*eps),
        (_, true) => Err(unmapped(node, "GPT-2's norms are LayerNorms")),
        (_, false) => Err(unmapped(node, "the Llama family's norms are RMSNorms")),
    }
}

/// One pre-norm block read from `x` (LayerNorms when `gpt2`, else RMSNorms): norm,
/// attention, residual add, norm, MLP, residual add. Returns its nodes' names, its settings,
/// its attention node and its output.
fn block<'a>(
    walk: &mut Walk<'a>,
    x: ValueId,
    gpt2: bool,
) -> Result<(BlockNodes, BlockShape, &'a Node, ValueId)> {
    let ln1 = walk.next(&[x], "a block's first norm")?;
    refuse_unnormed_input(walk.spec, ln1)?;
    let eps = norm_eps(ln1, gpt2)?;
    let attn = walk.next(&[ln1.output], "a block's attention")?;
    let add1 = walk.next(&[x, attn.output], "the residual add after attention")?;
    let ln2 = walk.next(&[add1.output], "a block's second norm")?;
    if norm_eps(ln2, gpt2)? != eps {
        return Err(unmapped(
            ln2,
            format!("its eps differs from `{}`'s", ln1.name),
        ));
    }
    let mlp = walk.next(&[ln2.output], "a block's MLP")?;
    let add2 = walk.next(&[add1.output, mlp.output], "the residual add after the MLP")?;
    for add in [add1, add2] {
        if add.kind != LayerKind::Add {
            return Err(unmapped(add, "transformers' blocks add the residual here"));
        }
    }
    let LayerKind::Attention {
        dim,
        heads,
        kv_heads,
        head_dim,
        causal,
        rope,
        qkv_bias,
        out_bias,
        qk_norm,
        scale,
    } = attn.kind
    else {
        return Err(unmapped(attn, "transformers' blocks have attention here"));
    };
    let usual = parc_compiler::spec::attention_scale(head_dim, None);
    if let Some(scale) = scale.filter(|&s| s != usual) {
        return Err(unmapped(
            attn,
            format!(
                "its scale = {scale} is not 1/√head_dim = {usual}, the factor transformers' \
                 GPT-2 and Llama-family attention multiplies q·k by"
            ),
        ));
    }
    if qk_norm.is_some_and(|qk| qk != eps) {
        return Err(unmapped(
            attn,
            format!(
                "its qk_norm_eps differs from `{}`'s eps; config.json has one",
                ln1.name
            ),
        ));
    }
    if !causal {
        return Err(unmapped(attn, "transformers' decoders attend causally"));
    }
    if gpt2 && heads * head_dim != dim {
        return Err(unmapped(
            attn,
            "GPT-2's heads × head_dim is the model width",
        ));
    }
    let LayerKind::Mlp {
        hidden, act, bias, ..
    } = &mlp.kind
    else {
        return Err(unmapped(mlp, "transformers' blocks have an MLP here"));
    };
    if let Activation::Fn(f) = act {
        return Err(unmapped(
            mlp,
            format!(
                "its activation is the .par function `{}`, which transformers does not have \
                 (GPT-2: gelu_tanh, gelu; Llama: swiglu)",
                f.name
            ),
        ));
    }
    let names = BlockNodes {
        ln1: ln1.name.clone(),
        attn: attn.name.clone(),
        ln2: ln2.name.clone(),
        mlp: mlp.name.clone(),
    };
    let shape = BlockShape {
        heads,
        kv_heads,
        head_dim,
        rope,
        qkv_bias,
        out_bias,
        qk_norm,
        ffn: *hidden,
        act: act.clone(),
        mlp_bias: *bias,
        eps,
    };
    Ok((names, shape, attn, add2.output))
}
