//! The calibration profile (`parc calibrate` writes it, `parc check --calibration` reads it):
//! what one device measured for the ops a step runs, as versioned JSON, and the interpolation
//! that turns its measured points into a rate for any size.
//!
//! Tables (times in seconds, sizes as the ops' attributes give them):
//! - `gemm`: (layout, m, n, k, dtype, epilogue) → seconds. m is the op's rows, n its
//!   `out_dim`, k its `in_dim`, for each of `Matmul` (`fwd`), `MatmulBwdData` (`bwd_data`) and
//!   `MatmulBwdWeight` (`bwd_weight`): 2·m·n·k FLOPs each. dtype `f32`, `bf16`, or an FP8
//!   GEMM's scaling (`fp8_blockwise`, …) timed with its quantization; the epilogue
//!   ([`GemmEpilogue`]): `accumulate` (reads an output-sized operand: a residual, a gradient
//!   added into), `bias`, `act` (an activation or its derivative).
//! - `attention`: (pass, batch·heads, q heads per kv head, seq, head dim, causal, packed) →
//!   seconds, FLOPs as [`crate::ir::table::FlopCount::Model`] counts them.
//! - `memory`: (kind, op, row width, bytes touched) → seconds for memory-bound ops, and
//!   `launch_overhead_s`, the time of the smallest op (no op is priced below it). An op named
//!   [`multi_op_name`] (`adam_w_multi`, `sum_squares_multi`) is a run of that op over many
//!   tensors of mixed sizes, as a step runs it, by its members' summed bytes.
//! - `collectives`: (kind, ranks, bytes) → seconds, where measured.
//!
//! Rates are interpolated in log-size ([`rate_at`]): the achieved FLOP/s or bytes/s of the
//! nearest measured points, with sizes outside the grid clamped to its edge, so no rate exceeds
//! the best one measured.
use crate::ir::fp8::Fp8Scaling;
use crate::spec::{Precision, Spec};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The format's version; a profile of another version is refused, but for version 1, read as
/// [`Profile::upgrade_v1`] says.
pub const VERSION: u32 = 2;

/// Version 1 counted an optimizer update's param and state (AdamW's param, m and v) as written
/// only; version 2 counts them read and written (`Signature::bytes_touched`). An `adam_w` or
/// `adam_w_multi` point's bytes, 16 a parameter in version 1 (gradient, param, m, v), are 28 in
/// version 2; the one-element coefficient's bytes, off by 1.75× this way, are negligible.
const V1_ADAM_W_BYTES: f64 = 28.0 / 16.0;

/// One device's measurements. See the module docs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub version: u32,
    /// The spec's `cluster.gpu` name of the device measured (`h200`, `cpu`).
    pub gpu: String,
    /// The device as its backend names it (`NVIDIA H200`, `cpu (16 threads)`).
    pub device: String,
    /// The backend that ran the ops (`cpu`, `cuda`).
    pub backend: String,
    /// `fp32`, `bf16` or `fp16`: the precision whose storage the ops ran on.
    pub precision: String,
    /// When it was measured (UTC, `YYYY-MM-DD`).
    pub date: String,
    pub parc_version: String,
    /// The catalogue's peak FLOP/s of `gpu` in `precision` and its memory bandwidth (bytes/s),
    /// for scaling the profile to another GPU's peak numbers.
    pub peak_flops: f64,
    pub memory_bandwidth: f64,
    pub launch_overhead_s: f64,
    pub gemm: Vec<GemmPoint>,
    pub attention: Vec<AttentionPoint>,
    pub memory: Vec<MemoryPoint>,
    #[serde(default)]
    pub collectives: Vec<CollectivePoint>,
    /// What the measurement left out or approximated, for people.
    #[serde(default)]
    pub notes: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GemmLayout {
    Fwd,
    BwdData,
    BwdWeight,
}

impl GemmLayout {
    /// A linear layer's three GEMMs: forward, data gradient, weight gradient.
    pub const ALL: [GemmLayout; 3] = [GemmLayout::Fwd, GemmLayout::BwdData, GemmLayout::BwdWeight];

    /// The layout's name, as profiles and `check`'s JSON spell it (`fwd`, `bwd_data`,
    /// `bwd_weight`).
    pub fn name(self) -> &'static str {
        match self {
            GemmLayout::Fwd => "fwd",
            GemmLayout::BwdData => "bwd_data",
            GemmLayout::BwdWeight => "bwd_weight",
        }
    }

    /// The layout of GEMM op `op`; None for any other op.
    pub fn of(op: &crate::ir::op::Op) -> Option<GemmLayout> {
        use crate::ir::op::Op;
        match op {
            Op::Matmul { .. } => Some(GemmLayout::Fwd),
            Op::MatmulBwdData { .. } => Some(GemmLayout::BwdData),
            Op::MatmulBwdWeight { .. } => Some(GemmLayout::BwdWeight),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmPoint {
    pub layout: GemmLayout,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// The GEMM's operands ([`GemmDtype::name`]): `f32` or `bf16` activations, or an FP8
    /// GEMM of bf16 activations (`fp8_tensorwise`, `fp8_rowwise`, `fp8_blockwise`), its
    /// operands' quantization included.
    pub dtype: String,
    /// The GEMM also reads an output-sized operand: a forward's residual, a gradient added
    /// into (`accumulate`, `accumulate_param_grad`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub accumulate: bool,
    /// The GEMM adds a bias (forward) or writes the bias gradient, dy's column sums (weight
    /// gradient).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bias: bool,
    /// The GEMM applies an activation (forward, keeping the pre-activation) or its derivative
    /// (data gradient).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub act: bool,
    pub seconds: f64,
}

impl GemmPoint {
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }

    pub fn epilogue(&self) -> GemmEpilogue {
        GemmEpilogue {
            accumulate: self.accumulate,
            bias: self.bias,
            act: self.act,
        }
    }
}

/// What a GEMM does besides its product (a point's `accumulate`, `bias`, `act`). cuBLASLt runs
/// each with other kernels (an epilogue reading C or reducing dy's columns, an f32 gradient
/// accumulated without split-K), so each is measured apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GemmEpilogue {
    pub accumulate: bool,
    pub bias: bool,
    pub act: bool,
}

impl GemmEpilogue {
    pub const PLAIN: GemmEpilogue = GemmEpilogue {
        accumulate: false,
        bias: false,
        act: false,
    };

    /// This epilogue, then with its parts dropped one by one (the activation, the bias, the
    /// accumulation): the points to price a GEMM by where a profile lacks its own.
    pub fn relaxed(self) -> [GemmEpilogue; 4] {
        let no_act = GemmEpilogue { act: false, ..self };
        let no_bias = GemmEpilogue {
            bias: false,
            ..no_act
        };
        [self, no_act, no_bias, GemmEpilogue::PLAIN]
    }

    /// A small number naming it (cache keys).
    pub fn code(self) -> u64 {
        u64::from(self.accumulate) | u64::from(self.bias) << 1 | u64::from(self.act) << 2
    }
}

/// What a GEMM point multiplies: its `dtype` in the profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmDtype {
    F32,
    Bf16,
    /// FP8 operands quantized from bf16 with this scaling (the CUDA backend's blocks are
    /// `crate::fp8::CUDA_BLOCK`, so blockwise points do not record the block).
    Fp8(Fp8Scaling),
}

impl GemmDtype {
    /// The activations' storage of a run: bf16 when `half` (bf16 and fp16 runs), else f32.
    pub fn storage(half: bool) -> GemmDtype {
        if half {
            GemmDtype::Bf16
        } else {
            GemmDtype::F32
        }
    }

    pub fn name(self) -> String {
        match self {
            GemmDtype::F32 => "f32".into(),
            GemmDtype::Bf16 => "bf16".into(),
            GemmDtype::Fp8(s) => format!("fp8_{}", s.name()),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    Fwd,
    Bwd,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionPoint {
    pub pass: Pass,
    pub batch_heads: u64,
    /// Query heads per kv head (1 without GQA).
    pub group: u64,
    pub seq: u64,
    pub head_dim: u64,
    pub causal: bool,
    /// One qkv input (what the lowering emits without rope or context parallelism).
    pub packed: bool,
    pub seconds: f64,
}

impl AttentionPoint {
    /// The model FLOPs (every pair, backward twice the forward), as the timeline counts them.
    pub fn flops(&self) -> f64 {
        let forward = 4.0 * (self.batch_heads * self.head_dim) as f64 * (self.seq as f64).powi(2);
        match self.pass {
            Pass::Fwd => forward,
            Pass::Bwd => 2.0 * forward,
        }
    }
}

/// The kinds of memory-bound work, each with its own table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryKind {
    Elementwise,
    Norm,
    CrossEntropy,
    Optimizer,
    Embedding,
}

impl MemoryKind {
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Elementwise => "elementwise",
            MemoryKind::Norm => "norm",
            MemoryKind::CrossEntropy => "cross_entropy",
            MemoryKind::Optimizer => "optimizer",
            MemoryKind::Embedding => "embedding",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryPoint {
    pub kind: MemoryKind,
    /// Bytes the op reads and writes (`Signature::bytes_touched`, elements at the profile's
    /// precision as the timeline counts them).
    pub bytes: f64,
    /// The op measured (its opcode's name: `rms_norm_bwd`, `cross_entropy`, …): an op with
    /// points of its own is priced by them, others by their kind's. Absent: any op of the kind.
    /// [`multi_op_name`]: a run of that op over many tensors (`bytes` summed over them), as the
    /// backend runs a fused run of it; such points follow the kind's single-op ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<String>,
    /// The width of the op's rows where its speed depends on it (a norm's dim, the
    /// cross-entropy's vocabulary): an op is priced between the two widths around its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cols: Option<u64>,
    pub seconds: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CollectivePoint {
    /// `all_reduce`, `all_gather`, `reduce_scatter` or `broadcast`.
    pub kind: String,
    pub ranks: u32,
    /// The defining buffer's bytes, as [`crate::timeline::StepCosts::collective`] takes them.
    pub bytes: f64,
    pub seconds: f64,
}

/// The `op` of memory points measuring a run of `opcode` over many tensors of mixed sizes (a
/// model's parameters or gradients): `adam_w_multi`, `sum_squares_multi`. A backend that fuses
/// such runs ([`Profile::fuses_optimizer_runs`]) runs each as one launch.
pub fn multi_op_name(opcode: crate::ir::table::Opcode) -> String {
    format!("{}_multi", opcode.name())
}

/// The backends (a profile's `backend`) that run each run of fusable optimizer instructions
/// (`crate::ir::optimizer_runs`) as one launch: the CUDA backend's multi-tensor AdamW/SGD and
/// one-pass sums of squares. The CPU backend runs every instruction alone.
const FUSING_BACKENDS: &[&str] = &["cuda"];

/// Why a profile cannot be used.
#[derive(Clone, Debug, PartialEq)]
pub enum ProfileError {
    /// Not JSON, or not a profile's JSON (`truncated`: it ends early).
    Json {
        message: String,
        truncated: bool,
    },
    Version {
        found: Option<u64>,
    },
    /// A measured value that cannot be a measurement (a time ≤ 0 or NaN, a size of 0).
    Invalid(String),
    /// Measured on another kind of GPU than the spec's, and scaling was not asked for.
    OtherGpu {
        profile: String,
        spec: String,
    },
    OtherPrecision {
        profile: String,
        spec: String,
    },
}

impl fmt::Display for ProfileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProfileError::Json {
                message,
                truncated: true,
            } => write!(
                f,
                "the JSON ends early (truncated: {message}); measure it again with `parc calibrate`"
            ),
            ProfileError::Json { message, .. } => write!(
                f,
                "not a calibration profile ({message}); measure one with `parc calibrate`"
            ),
            ProfileError::Version { found } => write!(
                f,
                "is format version {}, this parc reads version {VERSION} (and version 1 without \
                 SGD points); measure it again with this parc's `parc calibrate`",
                found.map_or("(none)".to_string(), |v| v.to_string())
            ),
            ProfileError::Invalid(what) => write!(
                f,
                "{what}: a measured time must be a positive number and every size positive; \
                 measure it again with `parc calibrate`"
            ),
            ProfileError::OtherGpu { profile, spec } => write!(
                f,
                "was measured on gpu `{profile}`, the spec runs on `{spec}`; measure a profile \
                 on a {spec} (`parc calibrate --gpu {spec}`), or pass `--scale-calibration` to \
                 scale this one by the two GPUs' peak numbers"
            ),
            ProfileError::OtherPrecision { profile, spec } => write!(
                f,
                "was measured in {profile}, the spec trains in {spec}; measure one with \
                 `parc calibrate --precision {spec}`"
            ),
        }
    }
}

impl std::error::Error for ProfileError {}

/// The name of `precision` in profiles and on the command line.
pub fn precision_name(precision: Precision) -> &'static str {
    match precision {
        Precision::Fp32 => "fp32",
        Precision::Bf16 => "bf16",
        Precision::Fp16 { .. } => "fp16",
    }
}

impl Profile {
    /// Whether the backend measured runs each run of fusable optimizer instructions as one
    /// launch (so the timeline prices and places it as one: `crate::timeline::fused`).
    pub fn fuses_optimizer_runs(&self) -> bool {
        FUSING_BACKENDS.contains(&self.backend.as_str())
    }

    /// Read a profile from its JSON, checking its version and every measured value.
    pub fn parse(text: &str) -> Result<Profile, ProfileError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(json_error)?;
        let found = value.get("version").and_then(serde_json::Value::as_u64);
        if found != Some(u64::from(VERSION)) && found != Some(1) {
            return Err(ProfileError::Version { found });
        }
        let mut profile: Profile = serde_json::from_value(value).map_err(json_error)?;
        if profile.version == 1 {
            profile.upgrade_v1()?;
        }
        profile.validate()?;
        Ok(profile)
    }

    /// A version-1 profile's memory points in version 2's byte counts (see [`VERSION`]): AdamW's
    /// scaled; an SGD point (which no version-1 `parc calibrate` measured) refused, its
    /// momentum unknown.
    fn upgrade_v1(&mut self) -> Result<(), ProfileError> {
        let adam_w = crate::ir::table::Opcode::AdamW;
        let sgd = crate::ir::table::Opcode::Sgd;
        for p in &mut self.memory {
            let op = p.op.as_deref().unwrap_or("");
            if op == adam_w.name() || op == multi_op_name(adam_w) {
                p.bytes *= V1_ADAM_W_BYTES;
            } else if op == sgd.name() || op == multi_op_name(sgd) {
                return Err(ProfileError::Version { found: Some(1) });
            }
        }
        self.version = VERSION;
        Ok(())
    }

    /// Every time positive and finite, every size positive.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let bad = |what: String| Err(ProfileError::Invalid(what));
        let time_ok = |s: f64| s.is_finite() && s > 0.0;
        if !(self.launch_overhead_s.is_finite() && self.launch_overhead_s >= 0.0) {
            return bad(format!("launch_overhead_s is {}", self.launch_overhead_s));
        }
        for (i, p) in self.gemm.iter().enumerate() {
            if !time_ok(p.seconds) || [p.m, p.n, p.k].contains(&0) {
                return bad(format!(
                    "gemm point {i} ({:?} m={} n={} k={}) has {} s",
                    p.layout, p.m, p.n, p.k, p.seconds
                ));
            }
        }
        for (i, p) in self.attention.iter().enumerate() {
            if !time_ok(p.seconds) || [p.batch_heads, p.group, p.seq, p.head_dim].contains(&0) {
                return bad(format!(
                    "attention point {i} ({:?} seq={}) has {} s",
                    p.pass, p.seq, p.seconds
                ));
            }
        }
        for (i, p) in self.memory.iter().enumerate() {
            if !time_ok(p.seconds) || !time_ok(p.bytes) {
                return bad(format!(
                    "memory point {i} ({} of {} bytes) has {} s",
                    p.kind.name(),
                    p.bytes,
                    p.seconds
                ));
            }
        }
        for (i, p) in self.collectives.iter().enumerate() {
            if !time_ok(p.seconds) || !time_ok(p.bytes) || p.ranks == 0 {
                return bad(format!(
                    "collective point {i} ({} of {} bytes) has {} s",
                    p.kind, p.bytes, p.seconds
                ));
            }
        }
        Ok(())
    }

    /// Whether this profile may price `spec`'s steps: the same precision, and the same GPU
    /// kind unless `scale` (then its rates are scaled by the two GPUs' peak numbers).
    pub fn check_for(&self, spec: &Spec, scale: bool) -> Result<(), ProfileError> {
        let precision = precision_name(spec.train.precision);
        if self.precision != precision {
            return Err(ProfileError::OtherPrecision {
                profile: self.precision.clone(),
                spec: precision.to_string(),
            });
        }
        if self.gpu != spec.cluster.gpu.name && !scale {
            return Err(ProfileError::OtherGpu {
                profile: self.gpu.clone(),
                spec: spec.cluster.gpu.name.clone(),
            });
        }
        Ok(())
    }
}

fn json_error(e: serde_json::Error) -> ProfileError {
    let message = e.to_string();
    let message = if message.contains("invalid type: null") {
        format!("a time that is not a number (NaN is written as null): {message}")
    } else {
        message
    };
    ProfileError::Json {
        truncated: e.classify() == serde_json::error::Category::Eof,
        message,
    }
}

/// The rate at `at` (log2 sizes, one per dimension) from measured `points` (their log2 sizes and
/// achieved rates): `at` is first clamped, dimension by dimension, to the points' range. With
/// one dimension the rate is interpolated linearly in log-size between the two points around
/// it; with more, a point at distance 0 gives its rate and otherwise the nearest four are
/// averaged (geometric mean, weighted by 1/distance²). Either way the rate lies between the
/// rates measured. None without points.
pub fn rate_at(points: &[(Vec<f64>, f64)], at: &[f64]) -> Option<f64> {
    let first = points.first()?;
    let dims = first.0.len();
    let clamped: Vec<f64> = (0..dims)
        .map(|d| {
            let (lo, hi) = points.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
                let x = p.0.get(d).copied().unwrap_or(0.0);
                (lo.min(x), hi.max(x))
            });
            at.get(d).copied().unwrap_or(lo).clamp(lo, hi)
        })
        .collect();
    if dims == 1 {
        return Some(linear_1d(points, clamped[0]));
    }
    Some(nearest_mean(points, &clamped))
}

/// Linear interpolation of the rate at `x` between the points around it (x within their range).
fn linear_1d(points: &[(Vec<f64>, f64)], x: f64) -> f64 {
    let coord = |p: &(Vec<f64>, f64)| p.0.first().copied().unwrap_or(0.0);
    let below = points
        .iter()
        .filter(|p| coord(p) <= x)
        .max_by(|a, b| coord(a).total_cmp(&coord(b)));
    let above = points
        .iter()
        .filter(|p| coord(p) >= x)
        .min_by(|a, b| coord(a).total_cmp(&coord(b)));
    match (below, above) {
        (Some(b), Some(a)) if coord(a) > coord(b) => {
            let t = (x - coord(b)) / (coord(a) - coord(b));
            b.1 + t * (a.1 - b.1)
        }
        (Some(p), _) | (None, Some(p)) => p.1,
        (None, None) => 0.0,
    }
}

/// The 1/d²-weighted geometric mean of the nearest four points' rates (a point at `at` itself:
/// its rate).
fn nearest_mean(points: &[(Vec<f64>, f64)], at: &[f64]) -> f64 {
    const NEAREST: usize = 4;
    let mut by_distance: Vec<(f64, f64)> = points
        .iter()
        .map(|(x, rate)| {
            let d2: f64 = x.iter().zip(at).map(|(a, b)| (a - b).powi(2)).sum();
            (d2, *rate)
        })
        .collect();
    by_distance.sort_by(|a, b| a.0.total_cmp(&b.0));
    if let Some(&(d2, rate)) = by_distance.first() {
        if d2 < 1e-12 {
            return rate;
        }
    }
    let nearest = &by_distance[..by_distance.len().min(NEAREST)];
    let (sum_w, sum_log) = nearest.iter().fold((0.0, 0.0), |(w, l), &(d2, rate)| {
        (w + 1.0 / d2, l + rate.ln() / d2)
    });
    (sum_log / sum_w).exp()
}

#[cfg(test)]
pub(crate) mod tests;
