//! The built-in layer kinds as the language sees them: their parameters (positional order,
//! defaults), how their arguments become a [`LayerKind`], and the shape each one needs and gives.

use super::number::Number;
use super::suggest;
use crate::diag::{Diagnostic, Span};
use crate::ir::op::Act;
use crate::kir::func::ExprFn;
use crate::spec::{Activation, LayerKind, Rope, Shape};
use crate::syntax::ast::Ident;
use std::collections::HashMap;
use std::sync::Arc;

/// The largest layer dimension parc accepts (2^20): far above real models, low enough that
/// parameter and activation sizes stay inside 64 bits.
pub const MAX_DIM: u64 = 1 << 20;

/// The layer constructors users can call, and `RoPE`.
pub const BUILTINS: [&str; 10] = [
    "Embedding",
    "PositionEmbedding",
    "LayerNorm",
    "RMSNorm",
    "Linear",
    "Attention",
    "MLP",
    "CrossEntropy",
    "RoPE",
    "Add",
];

/// Parameter names in positional order.
pub fn params(kind: &str) -> &'static [&'static str] {
    match kind {
        "Embedding" => &["vocab", "dim"],
        "PositionEmbedding" => &["seq", "dim"],
        "LayerNorm" => &["dim", "eps", "bias"],
        "RMSNorm" => &["dim", "eps"],
        "Linear" => &["in", "out", "bias", "tied"],
        "Attention" => &[
            "dim",
            "heads",
            "kv_heads",
            "head_dim",
            "causal",
            "rope",
            "bias",
            "qkv_bias",
            "qk_norm",
            "qk_norm_eps",
            "scale",
        ],
        "MLP" => &["dim", "hidden", "act", "bias"],
        "RoPE" => &["theta", "scaling", "fraction"],
        _ => &[],
    }
}

/// What a parameter that `kind` does not have means when a published config names it: a
/// feature parc's layer lacks, said so (E0207's note), so that a user porting a config learns
/// it is missing, not merely misspelled.
pub fn missing_feature(kind: &str, param: &str) -> Option<&'static str> {
    let said = match (kind, param) {
        ("Attention", "sliding_window" | "window" | "window_size" | "local_window") => {
            "parc's Attention has no sliding window (Mistral 7B v0.1, Gemma 2's local layers). \
             Where seq is at most the window, every token sees all earlier ones anyway and full \
             causal attention (the parameter left out) computes the same; with a longer seq, \
             parc cannot train this attention"
        }
        ("Attention", "alibi" | "alibi_bias" | "position_bias") => {
            "parc's Attention has no ALiBi biases (BLOOM, MPT): positions are RoPE (`rope = \
             RoPE(theta = …)`) or a learned PositionEmbedding"
        }
        ("Attention", "query_pre_attn_scalar" | "attention_multiplier" | "softmax_scale") => {
            "parc's Attention takes `scale`, the factor q·k is multiplied by (default \
             1/√head_dim): Gemma 2's query_pre_attn_scalar = s is `scale = 1 / √s` (s = 144: \
             `scale = 1 / 12`), Granite's attention_multiplier is `scale` itself"
        }
        ("Attention", "softcap" | "logit_softcapping" | "attn_logit_softcapping") => {
            "parc's Attention has no logit soft-capping (Gemma 2)"
        }
        ("Attention", "qk_layernorm" | "q_norm" | "k_norm" | "use_qk_norm") => {
            "parc's Attention normalizes q and k per head: `qk_norm = true` is an RMSNorm over \
             each head's head_dim features, one weight shared by the heads (Qwen3, Gemma 3). \
             It has no norm over all heads' features together (OLMo 2's full-width q/k norm) \
             and no LayerNorm form (Persimmon's qk_layernorm)"
        }
        ("RoPE", "rope_scaling" | "rope_parameters" | "factor" | "rope_type" | "yarn") => {
            "RoPE's frequency scaling is its `scaling`: `llama3 { factor, low_freq_factor, \
             high_freq_factor, original_max_position }` (Llama 3.1–3.3) or `linear { factor }`; \
             parc has no YaRN, dynamic NTK or LongRoPE scaling"
        }
        ("RoPE", "rotary_pct" | "partial_rotary_factor" | "rotary_percent" | "rotary_dim") => {
            "parc's RoPE takes the share of each head's features that turn as `fraction`: \
             GPT-NeoX's rotary_pct = 0.25 is `RoPE(theta = 10000, fraction = 0.25)`, and a \
             rotary_dim of r is `fraction = r / head_dim`"
        }
        _ => return None,
    };
    Some(said)
}

/// The name a node of this kind gets when the source does not name it with `as`
/// (numbered `ln1`, `ln2`, … when one scope has several).
pub fn default_name(kind: &LayerKind) -> &'static str {
    match kind {
        LayerKind::Embedding { .. } => "embed",
        LayerKind::PositionEmbedding { .. } => "pos",
        LayerKind::LayerNorm { .. } | LayerKind::RmsNorm { .. } => "ln",
        LayerKind::Linear { .. } => "linear",
        LayerKind::Attention { .. } => "attn",
        LayerKind::Mlp { .. } => "mlp",
        LayerKind::Add => "add",
        LayerKind::Elementwise { .. } => "fn",
        LayerKind::CrossEntropy => "loss",
    }
}

/// One evaluated argument.
#[derive(Clone, Debug)]
pub enum ArgValue {
    Num(Number),
    Bool(bool, Span),
    Word(String, Span),
    Rope(Rope, Span),
    /// An expression function (an activation).
    Fn(Arc<ExprFn>, Span),
    /// `tag { field: value, … }`: RoPE's `scaling = llama3 { factor: 8, … }`.
    Tagged(Arc<Tagged>),
}

/// A tagged record as a layer argument, its fields evaluated.
#[derive(Clone, Debug)]
pub struct Tagged {
    pub tag: Ident,
    pub fields: Vec<(Ident, ArgValue)>,
    pub span: Span,
}

impl ArgValue {
    pub fn span(&self) -> Span {
        match self {
            ArgValue::Num(n) => n.span,
            ArgValue::Bool(_, s)
            | ArgValue::Word(_, s)
            | ArgValue::Rope(_, s)
            | ArgValue::Fn(_, s) => *s,
            ArgValue::Tagged(t) => t.span,
        }
    }
}

/// A constructed layer waiting for its input: `Attention(d, heads)` before `(x)`.
#[derive(Clone, Debug)]
pub struct Ctor {
    pub kind: LayerKind,
    /// `tied = Embedding` / `tied = embed`: resolved once every node has its name.
    pub tied: Option<(String, Span)>,
    /// The spans of the arguments, by parameter name (for diagnostics on shapes and grids).
    pub arg_spans: HashMap<&'static str, Span>,
}

/// Arguments bound to parameter names.
pub struct Bound {
    pub kind: &'static str,
    pub values: HashMap<&'static str, ArgValue>,
    pub span: Span,
}

impl Bound {
    fn count(&self, name: &'static str, default: Option<u64>) -> Result<(u64, Span), Diagnostic> {
        match self.values.get(name) {
            Some(ArgValue::Num(n)) => {
                let v = n.as_count_in(&format!("{}'s {name}", self.kind), 1, Some(MAX_DIM))?;
                if v > MAX_DIM {
                    return Err(Diagnostic::error(
                        "E0903",
                        format!(
                            "{}'s {name} = {v} is more than parc supports ({MAX_DIM})",
                            self.kind
                        ),
                    )
                    .label(n.span, "too large")
                    .help(format!("use a {name} of at most {MAX_DIM}")));
                }
                if v == 0 {
                    return Err(Diagnostic::error(
                        "E0903",
                        format!("{}'s {name} must be at least 1, found 0", self.kind),
                    )
                    .label(n.span, "zero")
                    .help(format!("give {name} a positive size")));
                }
                Ok((v, n.span))
            }
            Some(other) => Err(self.wrong(name, "a number", other.span())),
            None => match default {
                Some(d) => Ok((d, self.span)),
                None => Err(self.missing(name)),
            },
        }
    }

    fn float(&self, name: &'static str, default: f64) -> Result<f64, Diagnostic> {
        match self.values.get(name) {
            Some(ArgValue::Num(n)) if n.value > 0.0 => Ok(n.value),
            Some(ArgValue::Num(n)) => Err(Diagnostic::error(
                "E0903",
                format!("{}'s {name} must be positive, found {}", self.kind, n.value),
            )
            .label(n.span, "not positive")
            .help(format!("use a positive {name}, e.g. {default}"))),
            Some(other) => Err(self.wrong(name, "a number", other.span())),
            None => Ok(default),
        }
    }

    /// The span of argument `name` when it is given as something other than `none` (which
    /// stands for its default, so a block can pass an optional setting through).
    fn given(&self, name: &'static str) -> Option<Span> {
        match self.values.get(name) {
            None => None,
            Some(ArgValue::Word(w, _)) if w == "none" => None,
            Some(v) => Some(v.span()),
        }
    }

    fn flag(&self, name: &'static str, default: bool) -> Result<bool, Diagnostic> {
        match self.values.get(name) {
            Some(ArgValue::Bool(b, _)) => Ok(*b),
            Some(other) => Err(self.wrong(name, "`true` or `false`", other.span())),
            None => Ok(default),
        }
    }

    fn wrong(&self, name: &str, expected: &str, span: Span) -> Diagnostic {
        Diagnostic::error(
            "E0902",
            format!("{}'s `{name}` must be {expected}", self.kind),
        )
        .label(span, "this value")
        .help(format!("pass {expected} for `{name}`"))
    }

    fn missing(&self, name: &str) -> Diagnostic {
        Diagnostic::error(
            "E0207",
            format!("{} is missing its `{name}` argument", self.kind),
        )
        .label(self.span, "called here")
        .help(format!(
            "{} takes ({})",
            self.kind,
            params(self.kind).join(", ")
        ))
    }

    fn spans(&self) -> HashMap<&'static str, Span> {
        self.values.iter().map(|(k, v)| (*k, v.span())).collect()
    }
}

/// Build the layer for `kind` from its bound arguments.
pub fn construct(b: &Bound) -> Result<Ctor, Diagnostic> {
    let mut tied = None;
    let kind = match b.kind {
        "Embedding" => LayerKind::Embedding {
            vocab: b.count("vocab", None)?.0,
            dim: b.count("dim", None)?.0,
        },
        "PositionEmbedding" => LayerKind::PositionEmbedding {
            seq: b.count("seq", None)?.0,
            dim: b.count("dim", None)?.0,
        },
        "LayerNorm" => LayerKind::LayerNorm {
            dim: b.count("dim", None)?.0,
            eps: b.float("eps", 1e-5)?,
            bias: b.flag("bias", true)?,
        },
        "RMSNorm" => LayerKind::RmsNorm {
            dim: b.count("dim", None)?.0,
            eps: b.float("eps", 1e-5)?,
        },
        "Linear" => {
            match b.values.get("tied") {
                None => {}
                Some(ArgValue::Word(w, s)) if w == "none" => {
                    let _ = s;
                }
                Some(ArgValue::Word(w, s)) => tied = Some((w.clone(), *s)),
                Some(other) => {
                    return Err(b.wrong("tied", "a layer name like `Embedding`", other.span()))
                }
            }
            LayerKind::Linear {
                in_dim: b.count("in", None)?.0,
                out_dim: b.count("out", None)?.0,
                bias: b.flag("bias", true)?,
                tied: None,
            }
        }
        "Attention" => attention(b)?,
        "MLP" => mlp(b)?,
        _ => {
            return Err(
                Diagnostic::error("E0202", format!("`{}` is not a layer", b.kind))
                    .label(b.span, "here")
                    .help(format!("layers are {}", suggest::one_of(&BUILTINS[..8]))),
            )
        }
    };
    Ok(Ctor {
        kind,
        tied,
        arg_spans: b.spans(),
    })
}

fn mlp(b: &Bound) -> Result<LayerKind, Diagnostic> {
    let act = match b.values.get("act") {
        None => Some(Activation::Plain(Act::Gelu)),
        Some(ArgValue::Word(name, _)) => Activation::from_name(name),
        Some(ArgValue::Fn(f, span)) => {
            super::functions::activation(f, *span)?;
            Some(Activation::Fn(f.clone()))
        }
        Some(_) => None,
    };
    let Some(act) = act else {
        let span = b.values.get("act").map(ArgValue::span).unwrap_or(b.span);
        let names: Vec<&str> = Activation::names().collect();
        return Err(Diagnostic::error("E0904", "unknown MLP activation")
            .label(span, "this activation")
            .help(format!(
                "use {}, a function (`fn f(x) = …`, the prelude's `squared_relu`) or `glu(f)`",
                suggest::one_of(&names)
            )));
    };
    let bias = b.flag("bias", !act.is_gated())?;
    if bias && act.is_gated() {
        let span = b.values.get("bias").map(ArgValue::span).unwrap_or(b.span);
        return Err(Diagnostic::error(
            "E0903",
            format!("a gated MLP (`{}`) has no biases", act.name()),
        )
        .label(span, "bias = true")
        .help("remove `bias = true` (a gated MLP's gate/up/down projections are bias-free)"));
    }
    Ok(LayerKind::Mlp {
        dim: b.count("dim", None)?.0,
        hidden: b.count("hidden", None)?.0,
        act,
        bias,
    })
}

fn attention(b: &Bound) -> Result<LayerKind, Diagnostic> {
    let (dim, dim_span) = b.count("dim", None)?;
    let (heads, heads_span) = b.count("heads", None)?;
    let (kv_heads, kv_span) = b.count("kv_heads", Some(heads))?;
    let head_dim_given = b.given("head_dim");
    let head_dim = if head_dim_given.is_some() {
        b.count("head_dim", None)?.0
    } else if dim % heads != 0 {
        return Err(Diagnostic::error(
            "E0303",
            format!("the model width d = {dim} is not divisible by heads = {heads}"),
        )
        .label(heads_span, format!("heads = {heads}"))
        .label(dim_span, format!("d = {dim}"))
        .help(format!(
            "use a number of heads that divides {dim} ({}), or pass head_dim explicitly",
            suggest::divisors(dim, 128)
        )));
    } else {
        dim / heads
    };
    if heads % kv_heads != 0 || kv_heads > heads {
        let d = Diagnostic::error(
            "E0304",
            format!("kv_heads = {kv_heads} does not divide heads = {heads} (grouped-query attention shares each kv head among heads / kv_heads query heads)"),
        )
        .label(kv_span, format!("kv_heads = {kv_heads}"))
        .label(heads_span, format!("heads = {heads}"))
        .help(format!("set kv_heads to a divisor of {heads}: {}", suggest::divisors(heads, heads)));
        let nearest = suggest::divisors_nearest(heads, kv_heads);
        return Err(nearest
            .into_iter()
            .fold(d, |d, k| d.edit(kv_span, k.to_string())));
    }
    let rope = match b.values.get("rope") {
        None => None,
        Some(ArgValue::Rope(r, _)) => Some(*r),
        Some(ArgValue::Word(w, _)) if w == "none" => None,
        Some(ArgValue::Bool(false, _)) => None,
        Some(other) => return Err(b.wrong("rope", "`RoPE(theta = …)` or `none`", other.span())),
    };
    if let (Some(rope), Some(span)) = (rope, b.values.get("rope").map(ArgValue::span)) {
        if head_dim % 2 != 0 {
            return Err(odd_rotary(
                dim,
                heads,
                head_dim,
                span,
                head_dim_given.ok_or(heads_span),
            ));
        }
        check_rotary_fraction(rope, head_dim, span)?;
    }
    let bias = b.flag("bias", true)?;
    Ok(LayerKind::Attention {
        dim,
        heads,
        kv_heads,
        head_dim,
        causal: b.flag("causal", true)?,
        rope,
        qkv_bias: b.flag("qkv_bias", bias)?,
        out_bias: bias,
        qk_norm: qk_norm(b)?,
        scale: attention_scale(b, head_dim)?,
    })
}

/// Attention's own factor for q·k (`scale = …`; `none` or left out: `1/√head_dim`): a positive
/// finite number, E0903 otherwise, its help naming the usual value.
fn attention_scale(b: &Bound, head_dim: u64) -> Result<Option<f64>, Diagnostic> {
    if b.given("scale").is_none() {
        return Ok(None);
    }
    let usual = crate::spec::attention_scale(head_dim, None);
    let scale = b.float("scale", usual)?;
    if !scale.is_finite() {
        let span = b.given("scale").unwrap_or(b.span);
        return Err(Diagnostic::error(
            "E0903",
            format!("{}'s scale must be a finite number, found {scale}", b.kind),
        )
        .label(span, "not finite")
        .help(format!(
            "write the factor q·k is multiplied by, e.g. 1 / 12 for query_pre_attn_scalar = 144; \
             left out, it is 1/√head_dim = {usual}"
        )));
    }
    Ok(Some(scale))
}

/// Attention's per-head q/k normalization: `qk_norm = true` gives its RMSNorms' epsilon
/// (`qk_norm_eps`, checked either way: a block may pass it through whether or not it
/// normalizes); anything but `true` or `false` is E0902, naming the form parc has.
fn qk_norm(b: &Bound) -> Result<Option<f64>, Diagnostic> {
    let eps = b.float("qk_norm_eps", 1e-6)?;
    match b.values.get("qk_norm") {
        None | Some(ArgValue::Bool(false, _)) => Ok(None),
        Some(ArgValue::Bool(true, _)) => Ok(Some(eps)),
        Some(other) => Err(b
            .wrong("qk_norm", "`true` or `false`", other.span())
            .edit(other.span(), "true")
            .help(
                "`qk_norm = true` normalizes each head of q and k with an RMSNorm over its \
                 head_dim features before RoPE (Qwen3, Gemma 3); `qk_norm_eps` sets its \
                 epsilon (default 1e-6)",
            )
            .note(
                "a norm over all heads' features together (OLMo 2's full-width q/k norm) is \
                 not supported",
            )),
    }
}

/// E0311: a partial RoPE (`fraction` below 1) turns `head_dim · fraction` features in pairs, so
/// that must be an even whole number; the help lists the fractions that make one.
fn check_rotary_fraction(rope: Rope, head_dim: u64, span: Span) -> Result<(), Diagnostic> {
    let features = head_dim as f64 * rope.fraction;
    let rotary = rope.rotary_dim(head_dim);
    if (features - rotary as f64).abs() <= 1e-9 * features
        && rotary >= 2
        && rotary.is_multiple_of(2)
    {
        return Ok(());
    }
    let nearest: Vec<String> = (1..=head_dim / 2)
        .map(|pairs| 2 * pairs)
        .filter(|&r| r.abs_diff(rotary) <= 4)
        .map(|r| format!("{} ({r} features)", r as f64 / head_dim as f64))
        .collect();
    Err(Diagnostic::error(
        "E0311",
        format!(
            "RoPE's fraction = {} of head_dim = {head_dim} is {} features; rotary positions \
             turn an even whole number of them, in pairs",
            rope.fraction,
            (features * 1e6).round() / 1e6
        ),
    )
    .label(span, "rotary positions")
    .help(format!("use a fraction of {}", nearest.join(", "))))
}

/// E0311: rotary positions rotate pairs of a head's features (`i` with `i + head_dim / 2`), so
/// they need an even head_dim. `head_dim` is `Ok(span)` where the attention gives it, else
/// `Err(span of heads)`: `dim / heads`, and the help offers head counts that make it even.
fn odd_rotary(
    dim: u64,
    heads: u64,
    head_dim: u64,
    rope: Span,
    head_dim_span: Result<Span, Span>,
) -> Diagnostic {
    let message = format!(
        "RoPE needs an even head_dim, found {head_dim}: rotary positions rotate each head's \
         features in pairs"
    );
    let d = Diagnostic::error("E0311", message).label(rope, "rotary positions");
    match head_dim_span {
        Ok(span) => d
            .label(span, format!("head_dim = {head_dim}"))
            .help("pass an even head_dim, or leave rope out"),
        Err(heads_span) => {
            // The head counts nearest to `heads` that give an even head_dim.
            let mut even: Vec<u64> = (1..=dim.min(1024))
                .filter(|h| dim.is_multiple_of(*h) && (dim / h).is_multiple_of(2))
                .collect();
            even.sort_by_key(|h| h.abs_diff(heads));
            even.truncate(4);
            even.sort_unstable();
            let even: Vec<String> = even.iter().map(u64::to_string).collect();
            let change = if even.is_empty() {
                String::new()
            } else {
                format!("use heads = {} (an even d / heads), ", even.join(", "))
            };
            d.label(
                heads_span,
                format!("head_dim = d / heads = {dim} / {heads}"),
            )
            .help(format!("{change}pass an even head_dim, or leave rope out"))
        }
    }
}

/// The input shape this layer needs (`None`: any hidden width, checked by the caller).
pub fn input_shape(kind: &LayerKind) -> Shape {
    match kind {
        LayerKind::Embedding { .. } => Shape::Tokens,
        LayerKind::PositionEmbedding { dim, .. }
        | LayerKind::LayerNorm { dim, .. }
        | LayerKind::RmsNorm { dim, .. }
        | LayerKind::Attention { dim, .. }
        | LayerKind::Mlp { dim, .. } => Shape::Hidden(*dim),
        LayerKind::Linear { in_dim, .. } => Shape::Hidden(*in_dim),
        LayerKind::Elementwise { dim, .. } => Shape::Hidden(*dim),
        LayerKind::Add | LayerKind::CrossEntropy => Shape::Scalar,
    }
}

/// The output shape of this layer.
pub fn output_shape(kind: &LayerKind) -> Shape {
    match kind {
        LayerKind::Embedding { dim, .. } => Shape::Hidden(*dim),
        LayerKind::Linear { out_dim, .. } => Shape::Hidden(*out_dim),
        LayerKind::CrossEntropy => Shape::Scalar,
        other => input_shape(other),
    }
}

pub fn describe(shape: &Shape) -> String {
    match shape {
        Shape::Tokens => "token ids [batch, seq]".to_string(),
        Shape::Hidden(n) => format!("[batch, seq, {n}]"),
        Shape::Scalar => "a scalar".to_string(),
    }
}
