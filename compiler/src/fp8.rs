//! The FP8 plan of a spec with `train.fp8`: which of each linear layer's three GEMMs (forward,
//! data gradient, weight gradient) run in FP8 and why, and the checks that make FP8 GEMMs
//! compute what the single-rank run computes (docs/fp8.md).
//!
//! A layer's choice, in order: a `bf16: [...]` pin keeps all three GEMMs in bf16; an
//! `fp8: [...]` pin puts all three in FP8; the LM head (a linear layer onto the vocabulary)
//! stays bf16; otherwise each GEMM layout (forward, data gradient, weight gradient, summed over
//! the layer's weights) runs in FP8 when the cost model says that layout, quantization
//! included, saves at least 10% of its bf16 time ([`MIN_GAIN`]; 3% where FP8 was measured,
//! [`MIN_GAIN_MEASURED`]): the weight gradient, whose operands are both quantized along the
//! tokens, may not pay where the forward does.
//!
//! The cost of one microbatch on one rank, at the layer's local shapes (tp shards, cp's share
//! of the sequence), is the calibration profile's where it has the GEMMs ([`GemmPrices`]), else
//! a roofline: each GEMM takes max(2mnk / peak, bytes / bandwidth) at the bf16 or FP8 tensor
//! peak, its bytes the two operands it reads and the one it writes; FP8 adds the quantization
//! of the GEMM's two operands (x and W forward, dy and W for the data gradient, dy and x for
//! the weight gradient) as the CUDA backend runs it (`runtime/src/cuda/fp8.rs`): per operand an
//! amax pass reading it, a pass reading it again and writing it in FP8 in the layout its GEMM
//! reads, at HBM bandwidth, and the scales' pass: three launches.
//!
//! Under delayed scaling the amax pass is not made (the scale comes from the history), and the
//! operand's `Fp8AmaxRecord` costs nothing of its own: the CUDA backend records the amax
//! inside the quantize pass of the GEMM that follows it ([`recording_gemm`]).
//!
//! Every rank holding a piece of a scale group must use the group's one scale. Tensorwise and
//! rowwise groups that span tp or cp ranks get it from an amax max-reduced over exactly those
//! ranks (`ir::fp8`, `lower/fp8.rs`). Blockwise scales are not reduced: each block must lie
//! inside one rank, so every sharded dimension of an FP8 GEMM must be a whole number of blocks
//! (E1204 otherwise).

use crate::check::past_the_last_layer;
use crate::diag::{Diagnostic, Diagnostics, Span};
use crate::ir::fp8::{Fp8Gemm, Fp8Scaling, MIN_BLOCK};
use crate::ir::op::Op;
use crate::ir::{Instr, Program};
use crate::spec::{Fp8, LayerKind, Node, NodeId, Pin, Precision, Spec};
use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};
use std::ops::{Index, IndexMut};

/// Which of a linear layer's three GEMMs: forward, data gradient, weight gradient (the
/// calibration profile's GEMM layouts; [`GemmLayout::ALL`] is their order).
pub use crate::timeline::profile::GemmLayout;

/// Launch overhead of one quantization kernel, seconds.
const QUANT_LAUNCH_S: f64 = 4e-6;

/// Kernels that quantize one operand: its group amaxes, the FP8 copy, the scales.
pub const QUANT_LAUNCHES: f64 = 3.0;

/// The CUDA backend's FP8 kernel's step along K (`kernels/fp8_gemm.cu`): its blockwise GEMMs
/// take blocks that are multiples of it ([`cuda_runs_block`]).
pub const CUDA_BLOCK: u64 = 128;

/// Whether the CUDA backend runs blockwise FP8 GEMMs with `block`-element blocks.
pub fn cuda_runs_block(block: u64) -> bool {
    block.is_multiple_of(CUDA_BLOCK)
}

/// The share of a GEMM layout's bf16 time FP8 must save by the roofline to be chosen: a
/// roofline counts FP8 GEMMs at the same fraction of their (doubled) peak as bf16 ones, which
/// small FP8 GEMMs do not reach (torchao measures ~0.8× bf16 at d ≈ 1–2k). Until `parc
/// calibrate` measures FP8 GEMMs, a GEMM must win clearly.
pub const MIN_GAIN: f64 = 0.10;

/// The share FP8 must save where a calibration profile measured both GEMMs (quantization
/// included): enough to stay clear of the measurement's noise.
pub const MIN_GAIN_MEASURED: f64 = 0.03;

/// One value for each of a linear layer's three GEMM layouts, indexed by [`GemmLayout`]; stored
/// in [`GemmLayout::ALL`]'s order: forward, data gradient, weight gradient. Serialized as an
/// object keyed by the profile's layout names (`fwd`, `bwd_data`, `bwd_weight`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PerLayout<T>(pub [T; 3]);

impl<T> PerLayout<T> {
    /// The value `f` gives each layout.
    pub fn from_fn(mut f: impl FnMut(GemmLayout) -> T) -> PerLayout<T> {
        PerLayout(GemmLayout::ALL.map(&mut f))
    }

    /// Each layout's value through `f`.
    pub fn map<U>(self, f: impl FnMut(T) -> U) -> PerLayout<U> {
        PerLayout(self.0.map(f))
    }

    /// Each layout with its value, in [`GemmLayout::ALL`]'s order.
    pub fn iter(&self) -> impl Iterator<Item = (GemmLayout, &T)> {
        GemmLayout::ALL.into_iter().zip(self.0.iter())
    }
}

impl<T: Copy> PerLayout<T> {
    /// The same value for every layout.
    pub fn splat(value: T) -> PerLayout<T> {
        PerLayout([value; 3])
    }
}

impl PerLayout<f64> {
    /// The sum of `self` and `other`, layout by layout.
    pub fn plus(self, other: PerLayout<f64>) -> PerLayout<f64> {
        PerLayout::from_fn(|l| self[l] + other[l])
    }
}

/// The slot of `layout` in a [`PerLayout`].
fn slot(layout: GemmLayout) -> usize {
    match layout {
        GemmLayout::Fwd => 0,
        GemmLayout::BwdData => 1,
        GemmLayout::BwdWeight => 2,
    }
}

impl<T> Index<GemmLayout> for PerLayout<T> {
    type Output = T;
    fn index(&self, layout: GemmLayout) -> &T {
        &self.0[slot(layout)]
    }
}

impl<T> IndexMut<GemmLayout> for PerLayout<T> {
    fn index_mut(&mut self, layout: GemmLayout) -> &mut T {
        &mut self.0[slot(layout)]
    }
}

impl<T: Serialize> Serialize for PerLayout<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut out = s.serialize_struct("PerLayout", 3)?;
        for (layout, value) in self.iter() {
            out.serialize_field(layout.name(), value)?;
        }
        out.end()
    }
}

impl Serialize for Choice {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut out = s.serialize_struct("Choice", 6)?;
        out.serialize_field("node", &self.node)?;
        out.serialize_field("name", &self.name)?;
        out.serialize_field("fp8", &self.fp8.0.iter().all(|&f| f))?;
        out.serialize_field("fp8_gemms", &self.fp8)?;
        out.serialize_field("reason", &self.reason)?;
        out.serialize_field("gemms", &self.gemms)?;
        out.end()
    }
}

impl Serialize for Reason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let kind = match self {
            Reason::PinnedBf16 => "pinned_bf16",
            Reason::PinnedFp8 => "pinned_fp8",
            Reason::LmHead => "lm_head",
            Reason::Cost(_) => "cost",
        };
        let Reason::Cost(Priced {
            bf16_s,
            fp8_s,
            priced_by,
        }) = self
        else {
            let mut out = s.serialize_struct("Reason", 1)?;
            out.serialize_field("kind", kind)?;
            return out.end();
        };
        let total = |t: &PerLayout<f64>| t.0.iter().sum::<f64>();
        let mut out = s.serialize_struct("Reason", 6)?;
        out.serialize_field("kind", kind)?;
        out.serialize_field("bf16_s", &total(bf16_s))?;
        out.serialize_field("fp8_s", &total(fp8_s))?;
        out.serialize_field("bf16_gemm_s", bf16_s)?;
        out.serialize_field("fp8_gemm_s", fp8_s)?;
        out.serialize_field("priced_by", priced_by)?;
        out.end()
    }
}

/// A layout's short name for people (`parc check`'s FP8 table): `fwd`, `data`, `weight`.
pub fn short_name(layout: GemmLayout) -> &'static str {
    match layout {
        GemmLayout::Fwd => "fwd",
        GemmLayout::BwdData => "data",
        GemmLayout::BwdWeight => "weight",
    }
}

/// One GEMM of a layer at its local shape on one rank: `[rows, in] × [out, in]ᵀ`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Gemm {
    pub weight: &'static str,
    /// The tensor its x is, within the layer: `input` (the layer's input), `hidden` (an MLP's
    /// activation) or `attn` (attention's output). Weights reading one tensor quantize it
    /// once (`lower::fp8_quantize`) under one delayed-scaling history (`lower/fp8.rs`).
    pub reads: &'static str,
    pub rows: u64,
    pub in_dim: u64,
    pub out_dim: u64,
}

/// Why a layer's GEMMs run in the precisions they do. In JSON (`parc check --format json`,
/// version 1): `kind`, and for `cost` the layer's totals `bf16_s` and `fp8_s` (their meaning
/// since version 1) beside each layout's, `bf16_gemm_s` and `fp8_gemm_s`, and `priced_by`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Reason {
    /// A `bf16: [...]` pin: all three layouts bf16.
    PinnedBf16,
    /// An `fp8: [...]` pin: all three layouts FP8.
    PinnedFp8,
    /// The LM head stays bf16 (all three layouts) unless pinned.
    LmHead,
    /// The cost model's prices of the layer's GEMMs for one microbatch, each layout summed
    /// over its weights: each layout runs in FP8 where it [`pays`].
    Cost(Priced),
}

/// What priced a layer's GEMMs for its choice, ordered from least to most measured (a layer
/// is as measured as its least measured GEMM: the minimum).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pricing {
    /// The roofline of the module doc (no calibration profile).
    Roofline,
    /// A calibration profile's bf16 GEMMs; FP8 at the GPU's FP8-to-bf16 peak ratio plus the
    /// roofline's quantization, as the profile has no FP8 GEMMs of the recipe's scaling.
    MeasuredBf16,
    /// A calibration profile's bf16 GEMMs and its FP8 GEMMs of the recipe's scaling
    /// (quantization included), both measured.
    Measured,
}

impl Pricing {
    /// The share of the bf16 time FP8 must save to be chosen: [`MIN_GAIN`] where FP8's time
    /// is a model, [`MIN_GAIN_MEASURED`] where it was measured.
    pub fn min_gain(self) -> f64 {
        match self {
            Pricing::Measured => MIN_GAIN_MEASURED,
            Pricing::Roofline | Pricing::MeasuredBf16 => MIN_GAIN,
        }
    }

    fn words(self) -> &'static str {
        match self {
            Pricing::Roofline => "roofline",
            Pricing::Measured => "measured",
            Pricing::MeasuredBf16 => "bf16 measured, FP8 at the peak ratio",
        }
    }
}

/// One layer GEMM's seconds in each layout, in bf16 and in FP8 (quantization included), and
/// what priced them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Priced {
    pub bf16_s: PerLayout<f64>,
    pub fp8_s: PerLayout<f64>,
    pub priced_by: Pricing,
}

impl Priced {
    /// Both GEMMs' seconds added layout by layout, as measured as the less measured of the two.
    pub fn plus(self, other: Priced) -> Priced {
        Priced {
            bf16_s: self.bf16_s.plus(other.bf16_s),
            fp8_s: self.fp8_s.plus(other.fp8_s),
            priced_by: self.priced_by.min(other.priced_by),
        }
    }
}

/// A layer's GEMM priced in bf16 and FP8 by a measured profile (`timeline::Calibration`
/// implements it): the seconds of its forward, data-gradient and weight-gradient GEMMs in
/// each, and how FP8's were priced; None where the profile cannot price them (the roofline
/// then does).
pub trait GemmPrices {
    /// `gemm`'s three layouts under `spec`'s GPU, FP8 in `scaling`.
    fn layer_gemm(&self, spec: &Spec, gemm: &Gemm, scaling: Fp8Scaling) -> Option<Priced>;
}

/// The choice for one linear layer: which of its GEMM layouts run in FP8 (each for all of the
/// layer's weights), and why. In JSON (version 1): `fp8` is true when all three run in FP8
/// (its meaning since version 1), `fp8_gemms` says which do.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub node: NodeId,
    pub name: String,
    /// Whether each layout (forward, data gradient, weight gradient) runs in FP8.
    pub fp8: PerLayout<bool>,
    pub reason: Reason,
    pub gemms: Vec<Gemm>,
}

impl Choice {
    /// Whether `layout` runs in FP8.
    pub fn runs(&self, layout: GemmLayout) -> bool {
        self.fp8[layout]
    }

    /// Whether any of the layer's GEMMs runs in FP8.
    pub fn any(&self) -> bool {
        self.fp8.0.iter().any(|&f| f)
    }

    /// The tensors its FP8 GEMMs quantize, each with one delayed-scaling history: per weight
    /// its W where the forward or the data gradient runs in FP8, its dy where a gradient does,
    /// and once per tensor read as x (`Gemm::reads`) where the forward or the weight gradient
    /// does (`lower/fp8.rs`).
    pub fn quantized_tensors(&self) -> usize {
        let [fwd, data, weight] = self.fp8.0;
        let per_weight = usize::from(fwd || data) + usize::from(data || weight);
        let mut xs: Vec<&str> = self.gemms.iter().map(|g| g.reads).collect();
        xs.sort_unstable();
        xs.dedup();
        let x = if fwd || weight { xs.len() } else { 0 };
        per_weight * self.gemms.len() + x
    }

    /// How many of the layer's GEMM ops of one microbatch run in FP8: its weights times its
    /// FP8 layouts.
    pub fn fp8_gemms(&self) -> usize {
        self.gemms.len() * self.fp8.0.iter().filter(|&&f| f).count()
    }

    /// Which GEMMs run FP8, for people: `fp8` (all three), `fp8 fwd+data` (some), `bf16`.
    pub fn label(&self) -> String {
        let on: Vec<&str> = (self.fp8.iter())
            .filter(|(_, &f)| f)
            .map(|(l, _)| short_name(l))
            .collect();
        match on.len() {
            0 => "bf16".to_string(),
            3 => "fp8".to_string(),
            _ => format!("fp8 {}", on.join("+")),
        }
    }

    /// The reason in words, for `parc check` and `parc plan`: a cost-decided layer's FP8 and
    /// bf16 microseconds per layout and whether FP8 pays in each.
    pub fn explain(&self) -> String {
        match self.reason {
            Reason::PinnedBf16 => "pinned bf16".to_string(),
            Reason::PinnedFp8 => "pinned fp8".to_string(),
            Reason::LmHead => "the LM head stays bf16 unless pinned".to_string(),
            Reason::Cost(Priced {
                bf16_s,
                fp8_s,
                priced_by,
            }) => {
                let layouts: Vec<String> = GemmLayout::ALL
                    .iter()
                    .map(|&l| {
                        let (b, f) = (bf16_s[l], fp8_s[l]);
                        let verdict = match (pays(b, f, priced_by), f < b) {
                            (true, _) => "pays".to_string(),
                            (false, true) => {
                                format!("saves under {:.0}%", priced_by.min_gain() * 100.0)
                            }
                            (false, false) => "slower".to_string(),
                        };
                        format!("{} {:.1}/{:.1} {verdict}", short_name(l), f * 1e6, b * 1e6)
                    })
                    .collect();
                format!(
                    "FP8/bf16 µs per microbatch ({}): {}",
                    priced_by.words(),
                    layouts.join(", ")
                )
            }
        }
    }
}

/// The IR attribute of an FP8 GEMM under `fp8`, its operands whole (the lowering sets each
/// GEMM's split).
pub fn gemm_attr(fp8: &Fp8) -> Fp8Gemm {
    Fp8Gemm {
        scaling: fp8.scaling,
        grad: fp8.grad,
        split: Default::default(),
        history: fp8.history,
        quantized: false,
    }
}

/// Every linear layer's choice, in model order (empty without `train.fp8`), its GEMMs priced
/// by `prices` (a calibration profile) where it can, else by the roofline.
pub fn choices(spec: &Spec, prices: Option<&dyn GemmPrices>) -> Vec<Choice> {
    let Some(fp8) = &spec.train.fp8 else {
        return Vec::new();
    };
    spec.model
        .nodes
        .iter()
        .enumerate()
        .filter_map(|(i, n)| {
            let gemms = gemms(spec, n);
            if gemms.is_empty() {
                return None;
            }
            let mut reason = reason(spec, fp8, n, &gemms, prices);
            let fp8 = match reason {
                Reason::PinnedBf16 | Reason::LmHead => PerLayout::splat(false),
                Reason::PinnedFp8 => PerLayout::splat(true),
                Reason::Cost(p) => {
                    let (chosen, priced) = decide(p, shared_savings(spec, fp8, &gemms));
                    reason = Reason::Cost(priced);
                    chosen
                }
            };
            Some(Choice {
                node: NodeId(i as u32),
                name: n.name.clone(),
                fp8,
                reason,
                gemms,
            })
        })
        .collect()
}

/// Why `node` (whose GEMMs are `gemms`) runs as it does: a pin, the LM head, or its GEMMs'
/// prices per layout, summed over its weights.
fn reason(
    spec: &Spec,
    fp8: &Fp8,
    node: &Node,
    gemms: &[Gemm],
    prices: Option<&dyn GemmPrices>,
) -> Reason {
    if fp8.keep_bf16.iter().any(|p| node.matches(p)) {
        Reason::PinnedBf16
    } else if fp8.force_fp8.iter().any(|p| node.matches(p)) {
        Reason::PinnedFp8
    } else if is_lm_head(spec, node) {
        Reason::LmHead
    } else {
        let priced = |g: &Gemm| {
            let measured = prices.and_then(|p| p.layer_gemm(spec, g, fp8.scaling));
            measured.unwrap_or_else(|| {
                let (bf16_s, fp8_s) = times(spec, g);
                Priced {
                    bf16_s,
                    fp8_s,
                    priced_by: Pricing::Roofline,
                }
            })
        };
        let none = Priced {
            bf16_s: PerLayout::splat(0.0),
            fp8_s: PerLayout::splat(0.0),
            priced_by: Pricing::Measured,
        };
        Reason::Cost(gemms.iter().map(priced).fold(none, Priced::plus))
    }
}

/// What quantizing each tensor once for the FP8 GEMMs near it (`quantize: shared`,
/// `lower::fp8_quantize`) saves a layer's FP8 GEMMs of one microbatch against quantizing
/// their operands each on its own, as the prices count it: a forward (and a weight gradient)
/// reads an x that k of the layer's weights read once instead of k times; a data and a weight
/// gradient both in FP8 read each weight's dy once (`pair`). A read is priced as an amax pass
/// (at the GPU's bandwidth, with its launch; under current scaling twice: the amax pass is
/// shared too).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SharedSavings {
    pub layout: PerLayout<f64>,
    pub pair: f64,
}

/// [`SharedSavings`] of `gemms` under `fp8` (none where it does not share quantization).
fn shared_savings(spec: &Spec, fp8: &Fp8, gemms: &[Gemm]) -> SharedSavings {
    if !(fp8.shared_quantization && fp8.scaling == Fp8Scaling::Tensorwise) {
        return SharedSavings::default();
    }
    let reads = if fp8.history.is_some() { 1.0 } else { 2.0 };
    let bandwidth = spec.cluster.gpu.memory_bandwidth.max(1.0);
    let pass = |elements: u64| reads * (elements as f64 * 2.0 / bandwidth + QUANT_LAUNCH_S);
    // x read by several weights: every reader after the first.
    let x: f64 = (gemms.iter().enumerate())
        .filter(|(i, g)| gemms[..*i].iter().any(|h| h.reads == g.reads))
        .map(|(_, g)| pass(g.rows * g.in_dim))
        .sum();
    let pair = gemms.iter().map(|g| pass(g.rows * g.out_dim)).sum();
    SharedSavings {
        layout: PerLayout([x, 0.0, x]),
        pair,
    }
}

/// Which layouts of a layer priced `p` run in FP8 with shared quantization's `savings`, and
/// the prices that decided it: each layout where it pays ([`pays`]) at its FP8 price less what
/// sharing saves it, a data and a weight gradient in FP8 together sharing dy's read (half to
/// each); one of them alone is priced without it.
fn decide(p: Priced, savings: SharedSavings) -> (PerLayout<bool>, Priced) {
    let (data, weight) = (GemmLayout::BwdData, GemmLayout::BwdWeight);
    let mut priced = p;
    for l in GemmLayout::ALL {
        priced.fp8_s[l] -= savings.layout[l];
    }
    let shared = |priced: Priced| {
        let mut p = priced;
        p.fp8_s[data] -= savings.pair / 2.0;
        p.fp8_s[weight] -= savings.pair / 2.0;
        p
    };
    let choose = |p: &Priced| PerLayout::from_fn(|l| pays(p.bf16_s[l], p.fp8_s[l], p.priced_by));
    let both = shared(priced);
    let chosen = choose(&both);
    if chosen[data] && chosen[weight] || savings.pair == 0.0 {
        return (chosen, both);
    }
    (choose(&priced), priced)
}

/// FP8 pays for a GEMM layout when the cost model says it saves at least its pricing's minimum
/// gain of that layout's bf16 time.
pub fn pays(bf16_s: f64, fp8_s: f64, priced_by: Pricing) -> bool {
    fp8_s <= bf16_s * (1.0 - priced_by.min_gain())
}

/// A linear layer onto the vocabulary.
fn is_lm_head(spec: &Spec, node: &Node) -> bool {
    matches!(node.kind, LayerKind::Linear { out_dim, .. } if out_dim == spec.model.vocab)
}

/// The GEMMs of a layer on one rank: local shapes under tp, rows of one microbatch under cp.
pub fn gemms(spec: &Spec, node: &Node) -> Vec<Gemm> {
    let (tp, cp) = tp_cp(spec);
    let rows = spec.train.micro_batch * spec.model.seq / cp.max(1);
    let gemm = |(weight, reads), in_dim, out_dim| Gemm {
        weight,
        reads,
        rows,
        in_dim,
        out_dim,
    };
    match &node.kind {
        LayerKind::Linear {
            in_dim, out_dim, ..
        } => vec![gemm(("weight", "input"), *in_dim, out_dim / tp)],
        LayerKind::Attention {
            dim,
            heads,
            kv_heads,
            head_dim,
            ..
        } => vec![
            gemm(
                ("wqkv", "input"),
                *dim,
                (heads + 2 * kv_heads) * head_dim / tp,
            ),
            gemm(("wo", "attn"), heads * head_dim / tp, *dim),
        ],
        LayerKind::Mlp {
            dim, hidden, act, ..
        } if act.is_gated() => vec![
            gemm(("gate", "input"), *dim, hidden / tp),
            gemm(("up", "input"), *dim, hidden / tp),
            gemm(("down", "hidden"), hidden / tp, *dim),
        ],
        LayerKind::Mlp { dim, hidden, .. } => {
            vec![
                gemm(("fc", "input"), *dim, hidden / tp),
                gemm(("proj", "hidden"), hidden / tp, *dim),
            ]
        }
        _ => Vec::new(),
    }
}

/// Seconds of one GEMM's forward, data gradient and weight gradient (a [`PerLayout`] each) in
/// bf16 and in FP8 (quantization included), by the roofline of the module doc: each layout
/// reads its two operands and writes its output (forward: x, W → y; data gradient: dy, W →
/// dx; weight gradient: dy, x → dW), two bytes an element in bf16, FP8's operands one.
/// Without FP8 tensor cores FP8 takes forever.
pub fn times(spec: &Spec, g: &Gemm) -> (PerLayout<f64>, PerLayout<f64>) {
    let gpu = &spec.cluster.gpu;
    let bw = gpu.memory_bandwidth.max(1.0);
    let (m, k, n) = (g.rows as f64, g.in_dim as f64, g.out_dim as f64);
    let flops = 2.0 * m * n * k;
    // Each layout's (operand elements, output elements).
    let elements = PerLayout([
        (m * k + n * k, m * n),
        (m * n + n * k, m * k),
        (m * n + m * k, n * k),
    ]);
    let gemm = |peak: f64, in_bytes: f64| {
        elements.map(|(operands, output)| {
            let bytes = in_bytes * operands + 2.0 * output;
            (flops / peak.max(1.0)).max(bytes / bw)
        })
    };
    let bf16 = gemm(gpu.peak_flops, 2.0);
    let Some(peak8) = gpu.peak_flops_fp8 else {
        return (bf16, PerLayout::splat(f64::INFINITY));
    };
    let quant = quantize_each(spec, g);
    (bf16, gemm(peak8, 1.0).plus(quant))
}

/// Seconds to quantize the operands of a layer's forward (x, W), data-gradient (dy, W) and
/// weight-gradient (dy, x) GEMMs, each pair from bf16 into the layout its GEMM reads; under
/// delayed scaling without the amax passes (the records ride on the quantize pass).
pub fn quantize_each(spec: &Spec, g: &Gemm) -> PerLayout<f64> {
    PerLayout::from_fn(|layout| {
        let elements = quantize_elements(layout, [g.rows, g.out_dim, g.in_dim]);
        quantize_seconds(elements, 2.0, &spec.cluster.gpu, delayed(spec))
    })
}

/// The quantize pass that delayed scaling's `Fp8AmaxRecord` at instruction `at` of `program`
/// rides on: the first instruction after it, past other records, allocations, frees and
/// `Fp8Quantize` ops of other buffers, if that is an `Fp8Quantize` of the recorded buffer, or
/// an FP8 GEMM under delayed scaling quantizing it itself (not `quantized`) as one of its two
/// operands. The CUDA backend max-adds the amax into the history inside that quantize pass
/// (one read of the operand instead of two); the verifier holds every record to have one
/// (invariant 9), so the time model prices records at nothing. None for any other
/// instruction.
pub fn recording_gemm(program: &Program, at: usize) -> Option<usize> {
    let recorded = match program.instrs.get(at)?.as_compute()? {
        c if matches!(c.op, Op::Fp8AmaxRecord(_)) => *c.inputs.first()?,
        _ => return None,
    };
    let passes = |x: &Instr| match x {
        Instr::Alloc { .. } | Instr::Free { .. } => true,
        Instr::Compute { op, inputs, .. } => match **op {
            Op::Fp8AmaxRecord(_) => true,
            Op::Fp8Quantize(_) => inputs.first() != Some(&recorded),
            _ => false,
        },
        _ => false,
    };
    let next = (at + 1..program.instrs.len()).find(|&j| !passes(&program.instrs[j]))?;
    let c = program.instrs[next].as_compute()?;
    if matches!(c.op, Op::Fp8Quantize(_)) {
        return Some(next);
    }
    let delayed =
        c.op.fp8()
            .is_some_and(|f| f.history.is_some() && !f.quantized);
    (delayed && c.inputs.get(..2)?.contains(&recorded)).then_some(next)
}

/// The elements an FP8 GEMM of `layout` at `[m, n, k]` = [rows, out, in] quantizes: x and W
/// (forward), dy and W (data gradient), dy and x (weight gradient).
pub fn quantize_elements(layout: GemmLayout, [m, n, k]: [u64; 3]) -> f64 {
    let (m, n, k) = (m as f64, n as f64, k as f64);
    match layout {
        GemmLayout::Fwd => m * k + n * k,
        GemmLayout::BwdData => m * n + n * k,
        GemmLayout::BwdWeight => m * n + m * k,
    }
}

/// Seconds to quantize the two operands of one FP8 GEMM, `elements` in all, stored with
/// `stored_bytes` per element, at the GPU's bandwidth ([`quantize_bytes`]), [`QUANT_LAUNCHES`]
/// launches per operand; under delayed scaling (`delayed`) without the amax passes
/// ([`amax_pass_seconds`]: the records ride on the quantize pass, [`recording_gemm`]).
pub fn quantize_seconds(
    elements: f64,
    stored_bytes: f64,
    gpu: &crate::spec::Gpu,
    delayed: bool,
) -> f64 {
    let bytes = quantize_bytes(elements, stored_bytes);
    let all = bytes / gpu.memory_bandwidth.max(1.0) + 2.0 * QUANT_LAUNCHES * QUANT_LAUNCH_S;
    match delayed {
        true => all - amax_pass_seconds(elements, stored_bytes, gpu),
        false => all,
    }
}

/// Whether `spec` trains in FP8 under delayed scaling (an amax history).
pub fn delayed(spec: &Spec) -> bool {
    spec.train.fp8.as_ref().is_some_and(|f| f.history.is_some())
}

/// Bytes quantizing `elements` stored with `stored_bytes` each moves: read for their amaxes
/// ([`amax_pass_bytes`]), read again and written as one byte each.
pub fn quantize_bytes(elements: f64, stored_bytes: f64) -> f64 {
    amax_pass_bytes(elements, stored_bytes) + elements * (stored_bytes + 1.0)
}

/// Bytes of quantization's amax pass over `elements` stored with `stored_bytes` each: the read
/// a GEMM under delayed scaling does not make (its scale amax comes from the history; the
/// operand's `Fp8AmaxRecord` is taken in the quantize pass: [`recording_gemm`]).
pub fn amax_pass_bytes(elements: f64, stored_bytes: f64) -> f64 {
    elements * stored_bytes
}

/// Seconds of the amax passes of an FP8 GEMM's two operands, `elements` in all, at the GPU's
/// bandwidth, with their launches: what a delayed-scaling GEMM saves against its price under
/// current scaling.
pub fn amax_pass_seconds(elements: f64, stored_bytes: f64, gpu: &crate::spec::Gpu) -> f64 {
    amax_pass_bytes(elements, stored_bytes) / gpu.memory_bandwidth.max(1.0) + 2.0 * QUANT_LAUNCH_S
}

/// How much faster the GPU's FP8 tensor cores are than its bf16 ones (1 without FP8).
pub fn speedup(gpu: &crate::spec::Gpu) -> f64 {
    gpu.peak_flops_fp8
        .map_or(1.0, |fp8| fp8 / gpu.peak_flops.max(1.0))
}

/// An FP8 GEMM's seconds where only its bf16 time was measured: that time at the FP8 peak's
/// speed-up, plus quantizing its operands (both timelines and the per-layer choice price it so).
pub fn from_bf16(bf16_seconds: f64, quantize_seconds: f64, gpu: &crate::spec::Gpu) -> f64 {
    bf16_seconds / speedup(gpu) + quantize_seconds
}

/// The FP8 recipe's checks against the model, the precision, the GPU and the plan: E1201 a
/// GPU without FP8 tensor cores, E1202 fp16 precision, E1203 a pin matching no
/// linear layer (or a layer pinned both ways), E1204 a blockwise block split across ranks.
pub fn validate(spec: &Spec) -> Diagnostics {
    let mut diags = Diagnostics::default();
    let Some(fp8) = &spec.train.fp8 else {
        return diags;
    };
    let gpu = &spec.cluster.gpu;
    if gpu.peak_flops_fp8.is_none() {
        diags.push(
            Diagnostic::error(
                "E1201",
                format!("`{}` has no FP8 tensor cores: `train.fp8` cannot run on it", gpu.name),
            )
            .label(fp8.span, "FP8 asked for here")
            .label(spec.cluster.span, "on this cluster")
            .help("FP8 GEMMs need Hopper (h100_80gb, h100_94gb, h200) or a custom GPU with `flops_fp8`; remove `train.fp8` to train in bf16"),
        );
    }
    if matches!(spec.train.precision, Precision::Fp16 { .. }) {
        diags.push(
            Diagnostic::error(
                "E1202",
                "`train.fp8` with `precision = fp16`: FP8 scaling under fp16's loss scaling is not supported",
            )
            .label(fp8.span, "FP8 asked for here")
            .help("set `precision = bf16` (FP8 GEMMs between bf16 activations, as the anchors train)"),
        );
    }
    pins(spec, fp8, &mut diags);
    scale_groups(spec, fp8, &mut diags);
    diags
}

fn pins(spec: &Spec, fp8: &Fp8, diags: &mut Diagnostics) {
    let linear: Vec<&Node> = (spec.model.nodes.iter())
        .filter(|n| !gemms(spec, n).is_empty())
        .collect();
    for (list, pattern) in [("bf16", &fp8.keep_bf16), ("fp8", &fp8.force_fp8)]
        .iter()
        .flat_map(|(l, ps)| ps.iter().map(move |p| (*l, p)))
    {
        if !linear.iter().any(|n| n.matches(pattern)) {
            let names: Vec<&str> = (linear.iter())
                .map(|n| n.name.as_str())
                .chain(["Attention", "MLP", "Linear"])
                .collect();
            let help = match (
                past_the_last_layer(pattern, &names),
                crate::check::closest_name(pattern, names.iter().copied()),
            ) {
                (Some(range), _) => format!("{range}; pins name layer kinds (`MLP`) or paths (`blocks.3.attn`, `head`) of layers with GEMMs"),
                (None, Some(c)) => format!("did you mean `{c}`? pins name layer kinds (`MLP`) or paths (`blocks.3.attn`, `head`) of layers with GEMMs"),
                (None, None) => "pins name layer kinds (`Attention`, `MLP`, `Linear`) or paths (`blocks.3.attn`, `head`) of layers with GEMMs".to_string(),
            };
            diags.push(
                Diagnostic::error(
                    "E1203",
                    format!("`train.fp8.{list}` names `{pattern}`, which matches no linear layer"),
                )
                .label(pin_span(pattern, fp8), "matches no linear layer")
                .help(help),
            );
        }
    }
    for n in linear {
        let keep = fp8.keep_bf16.iter().find(|p| n.matches(p));
        let force = fp8.force_fp8.iter().find(|p| n.matches(p));
        if let (Some(k), Some(f)) = (keep, force) {
            diags.push(
                Diagnostic::error(
                    "E1203",
                    format!(
                        "`{}` is pinned both ways: `bf16` names it as `{k}`, `fp8` as `{f}`",
                        n.name
                    ),
                )
                .label(pin_span(k, fp8), "kept in bf16 here")
                .label(pin_span(f, fp8), "pinned to FP8 here")
                .help("name each layer in one list"),
            );
        }
    }
}

/// Where `pin` is written; the recipe's span for a pin written nowhere (built by code, or
/// given through `--set` without a place of its own).
fn pin_span(pin: &Pin, fp8: &Fp8) -> Span {
    if pin.span == Span::default() {
        fp8.span
    } else {
        pin.span
    }
}

fn scale_groups(spec: &Spec, fp8: &Fp8, diags: &mut Diagnostics) {
    let (tp, cp) = tp_cp(spec);
    // Every layer the cost model may put in FP8, whatever prices it, so that the verdict does
    // not change with the calibration profile.
    let chosen: Vec<Choice> = (choices(spec, None).into_iter())
        .filter(|c| c.any() || matches!(c.reason, Reason::Cost(_)))
        .collect();
    if chosen.is_empty() {
        return;
    }
    let block = match fp8.scaling {
        Fp8Scaling::Blockwise { block } => {
            if !cuda_runs_block(block) && spec.cluster.gpu.name != "cpu" {
                diags.push(
                    Diagnostic::warning(
                        "W1201",
                        format!("blockwise FP8 with {block}-element blocks runs on the CPU backend only: the CUDA backend's FP8 kernel scales K in steps of {CUDA_BLOCK} elements, so its blocks are multiples of {CUDA_BLOCK}"),
                    )
                    .label(fp8.span, "this FP8 recipe")
                    .help(format!("use `blockwise {{ block_size: {CUDA_BLOCK} }}` (the default, DeepSeek-V3's) or a larger power of two to train on GPUs")),
                );
            }
            block
        }
        // Tensorwise and rowwise groups that span ranks have their amaxes max-reduced over
        // exactly those ranks (`ir::fp8`, `lower/fp8.rs`): nothing to refuse.
        _ => return,
    };
    let extents = sharded_extents(spec, &chosen, tp, cp);
    let bad: Vec<&String> = (extents.iter())
        .filter(|(_, n)| !n.is_multiple_of(block))
        .map(|(what, _)| what)
        .collect();
    if let Some(first) = bad.first() {
        let more = match bad.len() {
            1 => String::new(),
            n => format!(" (and {} more)", n - 1),
        };
        diags.push(
            Diagnostic::error(
                "E1204",
                format!("blockwise FP8 blocks of {block} would span ranks: {first} is not a whole number of blocks{more}, and parc reduces no blockwise scale across ranks"),
            )
            .label(fp8.span, "this FP8 recipe")
            .label(spec.parallel.span, "this plan")
            .help(match largest_block(block, extents.iter().map(|(_, n)| *n)) {
                b if b >= MIN_BLOCK => format!(
                    "choose a block dividing every sharded dimension (`blockwise {{ block_size: {b} }}`), use `rowwise` or `tensorwise` (their amaxes are reduced across ranks), or pin those layers bf16"
                ),
                _ => "no block of 16 or more divides them: use `rowwise` or `tensorwise` (their amaxes are reduced across ranks), pin those layers bf16 (`bf16: [...]`) or change tp / cp".to_string(),
            }),
        );
    }
}

/// The sharded extents of a layer's FP8 GEMM operands on one of `tp` ranks: each must be a
/// whole number of blocks for its blocks to be the single-rank run's.
fn sharded_dims(spec: &Spec, node: NodeId, tp: u64) -> Vec<(&'static str, u64)> {
    let Some(n) = spec.model.nodes.get(node.0 as usize) else {
        return Vec::new();
    };
    match &n.kind {
        LayerKind::Linear { out_dim, .. } => vec![("output columns", out_dim / tp)],
        LayerKind::Attention {
            heads,
            kv_heads,
            head_dim,
            ..
        } => vec![
            ("query columns", heads * head_dim / tp),
            ("key/value columns", kv_heads * head_dim / tp),
        ],
        LayerKind::Mlp { hidden, .. } => vec![("hidden columns", hidden / tp)],
        _ => Vec::new(),
    }
}

/// Every extent the FP8 GEMMs of the `chosen` layers split across ranks, described: each
/// cp rank's sequence chunk (load-balanced: two chunks per sequence) and each layer's tp
/// shards. Blocks that divide them all are the single-rank run's blocks.
fn sharded_extents(spec: &Spec, chosen: &[Choice], tp: u64, cp: u64) -> Vec<(String, u64)> {
    let mut extents = Vec::new();
    if cp > 1 {
        let rows = spec.model.seq / (2 * cp) * spec.train.micro_batch;
        let what =
            format!("each cp rank's sequence chunk of {rows} rows (seq / 2cp × micro_batch)");
        extents.push((what, rows));
    }
    if tp > 1 {
        for c in chosen {
            for (what, n) in sharded_dims(spec, c.node, tp) {
                extents.push((format!("`{}` {what} ({n} per rank)", c.name), n));
            }
        }
    }
    extents
}

/// The largest power of two up to `block` dividing every extent (at least 1).
fn largest_block(block: u64, extents: impl Iterator<Item = u64> + Clone) -> u64 {
    let mut b = block;
    while b > 1 && !extents.clone().all(|n| n.is_multiple_of(b)) {
        b /= 2;
    }
    b
}

/// The tp and cp sizes of the plan.
fn tp_cp(spec: &Spec) -> (u64, u64) {
    let (_, _, cp, tp) = spec.parallel.mesh.sizes();
    (u64::from(tp), u64::from(cp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::testspec::{build, Dims, Plan};
    use crate::diag::Span;
    use crate::ir::fp8::Fp8Format;

    #[test]
    fn a_pin_past_the_last_repeated_layer_names_the_range() {
        let names = [
            "blocks.0.attn",
            "blocks.0.mlp",
            "blocks.31.mlp",
            "head",
            "MLP",
        ];
        let said = past_the_last_layer("blocks.40.mlp", &names);
        assert_eq!(
            said.as_deref(),
            Some("the model repeats `blocks.0` to `blocks.31`")
        );
        assert_eq!(
            past_the_last_layer("blocks.40", &names).as_deref(),
            said.as_deref()
        );
        // Inside the range, another scope, or no index: the closest name helps instead.
        assert_eq!(past_the_last_layer("blocks.3.mlpp", &names), None);
        assert_eq!(past_the_last_layer("layers.40.mlp", &names), None);
        assert_eq!(past_the_last_layer("head", &names), None);
    }

    fn with_fp8(d: &Dims, plan: &Plan, scaling: Fp8Scaling, pins: (&[&str], &[&str])) -> Spec {
        let mut spec = build(d, plan);
        spec.train.precision = Precision::Bf16;
        spec.train.fp8 = Some(Fp8 {
            scaling,
            grad: Fp8Format::E4m3,
            history: None,
            keep_bf16: pins.0.iter().map(|&s| s.into()).collect(),
            force_fp8: pins.1.iter().map(|&s| s.into()).collect(),
            shared_quantization: true,
            span: Span::default(),
        });
        spec
    }

    fn blockwise() -> Fp8Scaling {
        Fp8Scaling::Blockwise { block: 128 }
    }

    #[test]
    fn large_layers_pay_small_ones_and_the_head_stay_bf16() {
        let big = with_fp8(
            &Dims::llama3_70b(),
            &Plan::default(),
            blockwise(),
            (&[], &[]),
        );
        let picked = choices(&big, None);
        assert!(picked.iter().any(|c| c.any()));
        for c in &picked {
            let head = c.name == "head";
            assert_eq!(
                c.fp8,
                PerLayout::splat(!head),
                "{}: {}",
                c.name,
                c.explain()
            );
            if head {
                assert_eq!(c.reason, Reason::LmHead);
            }
        }
        // GPT-2 124M's GEMMs (d = 768) do not gain 10% by the roofline.
        let small = with_fp8(
            &Dims::gpt2_124m(),
            &Plan::default(),
            blockwise(),
            (&[], &[]),
        );
        assert!(choices(&small, None).iter().all(|c| !c.any()));
    }

    /// Delayed scaling's FP8 GEMMs are priced without their amax passes (the records ride on
    /// the quantize pass): each layout exactly that much below current scaling's, the bf16
    /// prices unchanged, so at least as many layouts pay.
    #[test]
    fn delayed_scaling_prices_fp8_without_the_amax_passes() {
        let current = with_fp8(
            &Dims::llama3_70b(),
            &Plan::default(),
            Fp8Scaling::Tensorwise,
            (&[], &[]),
        );
        let mut delayed = current.clone();
        if let Some(f) = delayed.train.fp8.as_mut() {
            f.history = Some(16);
        }
        let node = (current.model.nodes.iter())
            .find(|n| !gemms(&current, n).is_empty() && !is_lm_head(&current, n))
            .expect("a linear layer");
        let g = gemms(&current, node)[0];
        let ((bf16_c, fp8_c), (bf16_d, fp8_d)) = (times(&current, &g), times(&delayed, &g));
        for layout in GemmLayout::ALL {
            let elements = quantize_elements(layout, [g.rows, g.out_dim, g.in_dim]);
            let saved = amax_pass_seconds(elements, 2.0, &current.cluster.gpu);
            assert_eq!(bf16_c[layout], bf16_d[layout]);
            assert!(
                ((fp8_c[layout] - fp8_d[layout]) / saved - 1.0).abs() < 1e-9,
                "{layout:?}"
            );
        }
        let count = |spec: &Spec| {
            (choices(spec, None).iter())
                .map(|c| GemmLayout::ALL.iter().filter(|&&l| c.runs(l)).count())
                .sum::<usize>()
        };
        assert!(count(&delayed) >= count(&current));
    }

    #[test]
    fn pins_decide_before_the_cost_model() {
        let d = Dims::gpt2_124m();
        let spec = with_fp8(
            &d,
            &Plan::default(),
            blockwise(),
            (&["blocks.0"], &["MLP", "head"]),
        );
        for c in choices(&spec, None) {
            let (fp8, reason) = match c.name.as_str() {
                n if n.starts_with("blocks.0.") => (false, Reason::PinnedBf16),
                n if n.ends_with(".mlp") || n == "head" => (true, Reason::PinnedFp8),
                _ => (false, c.reason),
            };
            let fp8 = PerLayout::splat(fp8);
            assert_eq!((c.fp8, c.reason), (fp8, reason), "{}", c.name);
        }
    }

    /// A price table: every GEMM of every layer takes one µs in bf16 and `fp8` µs per layout in
    /// FP8, measured.
    struct Table {
        fp8: PerLayout<f64>,
    }

    /// With shared quantization a data and a weight gradient that both run in FP8 read dy
    /// once: a pair that pays only together runs together, priced with half the saving each;
    /// one that pays alone is priced without it; a forward's x read by two weights is read once.
    #[test]
    fn shared_quantization_prices_dy_once_for_both_gradients() {
        let priced = |fp8: [f64; 3]| Priced {
            bf16_s: PerLayout::splat(1.0),
            fp8_s: PerLayout(fp8),
            priced_by: Pricing::Measured,
        };
        let savings = SharedSavings {
            layout: PerLayout([0.05, 0.0, 0.05]),
            pair: 0.1,
        };
        // Data 0.99 and weight 1.02 alone: neither saves 3%; together 0.94 and 0.92 (weight
        // less x's shared read).
        let (chosen, p) = decide(priced([1.0, 0.99, 1.02]), savings);
        assert_eq!(chosen, PerLayout([true, true, true]));
        assert!((p.fp8_s[GemmLayout::BwdData] - 0.94).abs() < 1e-12);
        assert!((p.fp8_s[GemmLayout::BwdWeight] - 0.92).abs() < 1e-12);
        // Weight far slower: the data gradient is priced alone and does not pay.
        let (chosen, p) = decide(priced([1.2, 0.99, 1.5]), savings);
        assert_eq!(chosen, PerLayout([false, false, false]));
        assert!((p.fp8_s[GemmLayout::BwdData] - 0.99).abs() < 1e-12);
        // No sharing: the prices as they are.
        let (chosen, _) = decide(priced([0.9, 0.99, 1.02]), SharedSavings::default());
        assert_eq!(chosen, PerLayout([true, false, false]));
    }

    impl GemmPrices for Table {
        fn layer_gemm(&self, _: &Spec, _: &Gemm, _: Fp8Scaling) -> Option<Priced> {
            Some(Priced {
                bf16_s: PerLayout::splat(1e-6),
                fp8_s: self.fp8.map(|us| us * 1e-6),
                priced_by: Pricing::Measured,
            })
        }
    }

    /// The H100 case (Llama 3.2 1B, tensorwise): FP8 pays for the forward and the data
    /// gradient, not the weight gradient, so a cost-decided layer runs exactly those two in
    /// FP8, and the lowered program carries `fp8` on exactly those ops of the layer; pins and
    /// the LM head still decide all three. (Each GEMM quantizing its own operands, so the
    /// table's prices decide alone: `shared_quantization_prices_dy_once_for_both_gradients`.)
    #[test]
    fn each_gemm_runs_fp8_only_where_it_pays() {
        let mut spec = with_fp8(
            &Dims::tiny(),
            &Plan::default(),
            Fp8Scaling::Tensorwise,
            (&["blocks.0"], &[]),
        );
        if let Some(f) = spec.train.fp8.as_mut() {
            f.shared_quantization = false;
        }
        // 0.79, 0.91 and 1.09 of bf16: H100's 780/988, 713/786 and 727/666 TFLOP/s.
        let table = Table {
            fp8: PerLayout([0.79, 0.91, 1.09]),
        };
        let picked = choices(&spec, Some(&table));
        let fwd_data = PerLayout([true, true, false]);
        // Each linear layer's expected choice, by node.
        let mut expected = vec![None; spec.model.nodes.len()];
        for c in &picked {
            let want = match c.reason {
                Reason::PinnedBf16 | Reason::LmHead => PerLayout::splat(false),
                Reason::PinnedFp8 => PerLayout::splat(true),
                Reason::Cost(_) => fwd_data,
            };
            assert_eq!(c.fp8, want, "{}: {}", c.name, c.explain());
            expected[c.node.0 as usize] = Some(want);
        }
        let cost = (picked.iter())
            .find(|c| matches!(c.reason, Reason::Cost(_)))
            .expect("a cost-decided layer");
        assert_eq!(cost.label(), "fp8 fwd+data");
        // Two weights a layer (tiny's attention and MLP): 2 µs in bf16 per layout.
        let why = "FP8/bf16 µs per microbatch (measured): fwd 1.6/2.0 pays, data 1.8/2.0 pays, \
                   weight 2.2/2.0 slower";
        assert_eq!(cost.explain(), why);
        assert!(picked.iter().any(|c| c.reason == Reason::PinnedBf16));
        assert!(picked.iter().any(|c| c.reason == Reason::LmHead));

        let plan = match crate::lower::lower_chosen(&spec, Default::default(), &picked) {
            Ok(plan) => plan,
            Err(d) => panic!("{:?}", d.items),
        };
        let mut fp8_ops = PerLayout::splat(0);
        for c in (plan.programs.iter())
            .flat_map(|p| &p.instrs)
            .filter_map(|i| i.as_compute())
        {
            let Some(layout) = GemmLayout::of(c.op) else {
                continue;
            };
            let node = c
                .node
                .and_then(|n| expected.get(n.0 as usize).copied().flatten());
            let Some(want) = node else {
                panic!("a GEMM of no linear layer: {:?}", c.node);
            };
            assert_eq!(
                c.op.fp8().is_some(),
                want[layout],
                "{:?} {layout:?}",
                c.node
            );
            fp8_ops[layout] += usize::from(c.op.fp8().is_some());
        }
        assert!(fp8_ops[GemmLayout::Fwd] > 0 && fp8_ops[GemmLayout::BwdData] > 0);
        assert_eq!(fp8_ops[GemmLayout::BwdWeight], 0);
    }

    #[test]
    fn without_fp8_tensor_cores_nothing_pays_and_the_check_names_the_gpu() {
        let mut spec = with_fp8(
            &Dims::llama3_70b(),
            &Plan::default(),
            blockwise(),
            (&[], &[]),
        );
        spec.cluster.gpu.name = "a100_80gb".into();
        spec.cluster.gpu.peak_flops_fp8 = None;
        assert!(choices(&spec, None).iter().all(|c| !c.any()));
        let diags = validate(&spec);
        let e = diags.items.iter().find(|d| d.code == "E1201");
        assert!(e.is_some_and(|d| d.message.contains("a100_80gb")));
    }

    #[test]
    fn blocks_must_stay_within_a_rank() {
        let d = Dims::llama3_70b();
        let tp8 = Plan {
            tp: 8,
            gpus_per_node: 8,
            ..Plan::default()
        };
        let codes = |scaling, block_pins: &[&str]| -> Vec<&'static str> {
            let spec = with_fp8(&d, &tp8, scaling, (&[], block_pins));
            validate(&spec).items.iter().map(|d| d.code).collect()
        };
        // 70B under tp 8: 1024 query and 128 key/value columns per rank.
        assert!(codes(blockwise(), &[]).is_empty());
        assert!(codes(Fp8Scaling::Blockwise { block: 256 }, &[]).contains(&"E1204"));
        // Tensorwise and rowwise groups spanning tp ranks have their amaxes reduced over them.
        assert!(codes(Fp8Scaling::Rowwise, &[]).is_empty());
        assert!(codes(Fp8Scaling::Tensorwise, &[]).is_empty());
        // Nothing in FP8, nothing to split: a bf16-pinned model passes whatever the recipe.
        let spec = with_fp8(&d, &tp8, Fp8Scaling::Tensorwise, (&["blocks", "head"], &[]));
        assert!(validate(&spec).items.is_empty());
    }

    #[test]
    fn largest_block_divides_every_dimension() {
        assert_eq!(largest_block(128, [96, 64].into_iter()), 32);
        assert_eq!(largest_block(128, [256].into_iter()), 128);
        assert_eq!(largest_block(64, [3].into_iter()), 1);
    }
}
