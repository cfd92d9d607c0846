//! The compute operations of the schedule IR: the contract between lowering (which emits them
//! with concrete local shapes) and every backend (which implements them exactly).
//!
//! Layout conventions (see also `spec`):
//! - Activations are row-major 2-D `[rows, cols]` with `rows = local_seq × batch`, sequence-major:
//!   row `s * batch + b` holds sequence position index `s` (local) of sample `b`.
//! - A local sequence chunk is described by `positions`: segments of the global sequence, in the
//!   order their rows are stored (context parallelism gives each rank two segments).
//! - Heads are column blocks: head `h` of a `[rows, heads * head_dim]` tensor is columns
//!   `h*head_dim .. (h+1)*head_dim`. With GQA, query head `h` uses kv head `h / (heads / kv_heads)`.
//! - Linear weights are `[out, in]`; `Matmul` computes `y = x Wᵀ (+ b)`.
//! - RoPE rotates pairs `(i, i + head_dim/2)` of each head ("rotate half", as Llama/HF), angle
//!   `pos * inv_freq(i)` for `i < head_dim/2`: `theta^(-2i/head_dim)`, scaled as `scaling` says
//!   (`rope::inv_freq`, the one definition).
//! - Every op lists its inputs and outputs in order; the IR instruction's buffer lists follow that
//!   order exactly. "(+=)" marks an output the op accumulates into (its first accumulation
//!   starts from the zeros of its `Alloc` or of a `Zero`); "(in place)" marks an output that
//!   is one of the op's inputs, updated where it lies (`Op::in_place`); all other outputs are
//!   overwritten: every element written, none read (the memory planner relies on this to skip
//!   zero-fills, `memplan::zero_needs`).
//! - Token ids are i32 buffers; everything else is f32, except that a `precision = bf16` plan
//!   stores activations and their gradients in bf16. Which operand accepts which type, and
//!   what an op on bf16 operands computes (read widened, compute in f32, round each written
//!   element to nearest-even), is `storage`; master weights, gradients, optimizer state and
//!   statistics are always f32.
//! - `lr` and the 1-based optimizer step count used by `AdamW`/`Sgd` are supplied by the executor
//!   from the spec's schedule; they are not part of the op. So is the loss scale `s` of an fp16
//!   run (`precision = fp16`; absent otherwise, which acts as `s = 1` with no skipping): `CeGrad`
//!   and `CrossEntropy` multiply the loss gradient by it, `ClipCoef` divides it back out and
//!   marks an overflowed step, and a marked step leaves `AdamW`/`Sgd` parameters and state
//!   untouched.

use super::fp8::{operands, Fp8AmaxAttrs, Fp8Gemm, Fp8HistoryAttrs, Fp8Operand, Fp8QuantizeAttrs};
pub use super::rope::RopeScaling;
use crate::kir::Kernel;
use serde::Serialize;
use std::fmt;
use std::sync::Arc;

/// A run of consecutive global sequence positions `[start, start + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Segment {
    pub start: u32,
    pub len: u32,
}

/// Total length of a list of segments.
pub fn segments_len(segments: &[Segment]) -> u32 {
    segments.iter().map(|s| s.len).sum()
}

/// Global position of the `i`-th local position.
pub fn position_at(segments: &[Segment], mut i: u32) -> Option<u32> {
    for s in segments {
        if i < s.len {
            return Some(s.start + i);
        }
        i -= s.len;
    }
    None
}

super::named_enum! {
    /// An elementwise activation (`Activation`, `ActivationBwd`, a matmul's fused epilogue), and
    /// an MLP's `act` in the language: the one list of them. A backend's activation code is the
    /// position here (`Act::code`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
    #[serde(rename_all = "snake_case")]
    pub enum Act {
        Gelu "gelu",
        GeluTanh "gelu_tanh",
        Relu "relu",
        Silu "silu",
    }
}

impl Act {
    /// The activation named `name` in the language.
    pub fn from_name(name: &str) -> Option<Act> {
        Act::ALL.iter().copied().find(|a| a.name() == name)
    }

    /// Its position in [`Act::ALL`]: the code a kernel's `switch` takes.
    pub fn code(self) -> i32 {
        Act::ALL
            .iter()
            .position(|a| *a == self)
            .map_or(-1, |i| i as i32)
    }
}

/// The attributes `Embedding` and `EmbeddingBwd` share: which rows of the vocabulary this rank's
/// table holds, and the embedding width.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EmbeddingAttrs {
    pub vocab_start: u64,
    pub vocab_local: u64,
    pub dim: u64,
}

/// The attributes `PositionAdd` and `PositionAddBwd` share.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PositionAttrs {
    pub batch: u64,
    pub dim: u64,
    pub positions: Vec<Segment>,
}

/// The attributes `Rope`, `RopeBwd` and `RopeTable` share.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RopeAttrs {
    pub batch: u64,
    pub heads: u64,
    pub head_dim: u64,
    pub theta: f64,
    /// How the frequencies are scaled; plain RoPE's `None` is left out of the plan's JSON (and
    /// text), so an unscaled plan serializes, hashes and prints as before scaling existed.
    #[serde(skip_serializing_if = "RopeScaling::is_none")]
    pub scaling: RopeScaling,
    pub positions: Vec<Segment>,
    /// A partial RoPE's rotated features: a head's first `rotary_dim` turn, in pairs `(i, i +
    /// rotary_dim/2)` at `rope::inv_freq` of `rotary_dim`, and the rest pass unchanged. `None`
    /// (every feature turns) is left out of the plan's JSON and text, as scaling's `None` is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rotary_dim: Option<u64>,
}

impl RopeAttrs {
    /// How many of a head's features turn (`rotary_dim`, else all `head_dim`).
    pub fn rotary(&self) -> u64 {
        self.rotary_dim.unwrap_or(self.head_dim)
    }

    /// Why this rotation is undefined, if it is (`rope::rotation_problem`).
    pub fn problem(&self) -> Option<String> {
        super::rope::rotation_problem(self.theta, self.scaling, self.head_dim, self.rotary())
    }

    /// The inverse frequency of pair `i` of a head (`rope::inv_freq` over its rotated
    /// features).
    pub fn inv_freq(&self, i: u64) -> f64 {
        super::rope::inv_freq(self.theta, self.rotary(), i, self.scaling)
    }
}

/// The attributes `Attention` and `AttentionBwd` share (see `Op::Attention`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AttentionAttrs {
    pub batch: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub causal: bool,
    pub scale: f64,
    pub q_positions: Vec<Segment>,
    pub kv_positions: Vec<Segment>,
    pub packed: bool,
}

/// The attribute `Activation` and `ActivationBwd` share.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ActAttrs {
    pub act: Act,
}

/// A generated kernel in the program (`Op::Fused`): the kernel and what it was made from. Its
/// JSON (`parc plan --emit json`) gives the kernel's text form as `expression` beside the graph.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedAttrs {
    /// What the kernel computes, for people: the ops or the function it replaces
    /// (`swi_glu`, `rope+split_columns`, `act squared_relu`).
    pub name: String,
    /// Its rows, where the attributes fix them (the fusion of ops that fix theirs).
    pub rows: Option<u64>,
    pub kernel: Arc<Kernel>,
}

impl Serialize for FusedAttrs {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("FusedAttrs", 4)?;
        st.serialize_field("name", &self.name)?;
        st.serialize_field("rows", &self.rows)?;
        st.serialize_field("expression", &self.kernel.to_string())?;
        st.serialize_field("kernel", &*self.kernel)?;
        st.end()
    }
}

#[derive(Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum Op {
    // ------------------------------------------------------------------ embeddings
    /// in: ids `[rows]` i32, table `[vocab_local, dim]`. out: y `[rows, dim]`.
    /// Rows whose id is outside `[vocab_start, vocab_start + vocab_local)` are zero
    /// (vocab-parallel embedding: the lowering all-reduces over tp after).
    Embedding(EmbeddingAttrs),
    /// in: ids `[rows]`, dy `[rows, dim]`. out: dtable `[vocab_local, dim]` (+=).
    EmbeddingBwd(EmbeddingAttrs),
    /// in: x `[rows, dim]`, table `[seq, dim]`. out: y = x + table[position(row)].
    PositionAdd(PositionAttrs),
    /// in: dy `[rows, dim]`. out: dtable `[seq, dim]` (+= when `accumulate_param_grad`, else
    /// overwritten: the step's first contribution to a fresh gradient). (dx = dy: the lowering
    /// reuses dy.)
    PositionAddBwd {
        #[serde(flatten)]
        pos: PositionAttrs,
        accumulate_param_grad: bool,
    },

    // ------------------------------------------------------------------ norms
    /// in: x `[rows, dim]`, w `[dim]`, b `[dim]` (only when `bias`).
    /// out: y `[rows, dim]`, mean `[rows]`, rstd `[rows]`.
    LayerNorm { dim: u64, eps: f64, bias: bool },
    /// in: dy, x, w, mean, rstd. out: dx `[rows, dim]` (+= when `accumulate`, else
    /// overwritten), dw `[dim]` and db `[dim]` (only when `bias`): += when
    /// `accumulate_param_grad`, else overwritten (the first contribution to fresh gradients).
    LayerNormBwd {
        dim: u64,
        bias: bool,
        accumulate: bool,
        accumulate_param_grad: bool,
    },
    /// in: x `[rows, dim]`, w `[dim]`. out: y `[rows, dim]`, rstd `[rows]`.
    RmsNorm { dim: u64, eps: f64 },
    /// in: dy, x, w, rstd. out: dx `[rows, dim]` (+= when `accumulate`, else overwritten),
    /// dw `[dim]` (+= when `accumulate_param_grad`, else overwritten).
    RmsNormBwd {
        dim: u64,
        accumulate: bool,
        accumulate_param_grad: bool,
    },

    // ------------------------------------------------------------------ linear
    /// in: x `[rows, in]`, w `[out, in]`, b `[out]` (only when `bias`), r `[rows, out]` (only
    /// when `residual`). out: y `[rows, out]` = x Wᵀ + b (+ r: a residual add fused into the
    /// GEMM, added to the finished `x Wᵀ + b`, so in f32 exactly a `Matmul` followed by an
    /// `Add`; in bf16 r is read as stored and y rounded once), then, only when `act` is set,
    /// a `[rows, out]` = act(y) (a fused activation, as a GEMM epilogue computes it: y is the
    /// pre-activation the backward reads). `a` is computed from y's f32 value before y is
    /// rounded to a bf16 output, so in f32 the op is exactly a `Matmul` followed by an
    /// `Activation`, and in bf16 each output is rounded once. With `swiglu` (the up projection
    /// of a SwiGLU MLP), one more input, gate `[rows, out]`, after r, and the output a
    /// `[rows, out]` = silu(gate) ⊙ y, from y's f32 value: in f32 exactly a `Matmul` followed
    /// by a `SwiGlu(gate, y)`. `swiglu` excludes `bias`, `act` and `residual` (E0822).
    Matmul {
        in_dim: u64,
        out_dim: u64,
        bias: bool,
        act: Option<Act>,
        residual: bool,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        swiglu: bool,
        /// Set: x and W are quantized to FP8 as `ir::fp8` defines (None: bf16/f32 as stored).
        #[serde(skip_serializing_if = "Option::is_none")]
        fp8: Option<Fp8Gemm>,
    },
    /// in: dy `[rows, out]`, w `[out, in]`, then, only when `act_grad` is set, pre `[rows, in]`
    /// (the saved pre-activation of the layer whose activation feeds this product). out: dx
    /// `[rows, in]` = dy W (+= when `accumulate`, else overwritten), or with `act_grad` dx =
    /// (dy W) ⊙ act'(pre), formed from the product's f32 value and rounded once: in f32
    /// exactly a `MatmulBwdData` followed by an `ActivationBwd` (a GEMM's activation-gradient
    /// epilogue). `act_grad` requires `accumulate` = false (the verifier checks it, E0822).
    /// An accumulating dx adds the finished product once per element (`dx + (dy W)`, in bf16
    /// read, added in f32 and rounded once), exactly what an `Add` of the old dx and a
    /// separate product computes in f32.
    /// With `swiglu` (the down projection of a SwiGLU MLP, whose input was silu(gate) ⊙ up):
    /// in dy, w, gate `[rows, in]`, up `[rows, in]`; out, instead of dx, dgate and dup
    /// `[rows, in]` (overwritten), the product's f32 value p = dy W through `SwiGluBwd`:
    /// dgate = p · up · σ(g)(1 + g(1 − σ(g))), dup = p · silu(g), each rounded once; in f32
    /// exactly a `MatmulBwdData` followed by a `SwiGluBwd`. `swiglu` excludes `accumulate` and
    /// `act_grad` (E0822).
    MatmulBwdData {
        in_dim: u64,
        out_dim: u64,
        accumulate: bool,
        act_grad: Option<Act>,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        swiglu: bool,
        /// Set: dy and W are quantized to FP8 (`ir::fp8`).
        #[serde(skip_serializing_if = "Option::is_none")]
        fp8: Option<Fp8Gemm>,
    },
    /// in: dy `[rows, out]`, x `[rows, in]`. out: dw `[out, in]` = dyᵀ x and db `[out]` = the
    /// column sums of dy (only when `bias`): both += when `accumulate_param_grad`, else
    /// overwritten (the first contribution to fresh gradients: no zero-fill needed). An
    /// accumulating output adds the finished value once per element (`dw + (dyᵀ x)`), so in
    /// f32 an overwrite is bit-identical to adding into zeros.
    MatmulBwdWeight {
        in_dim: u64,
        out_dim: u64,
        bias: bool,
        accumulate_param_grad: bool,
        /// Set: dy and x are quantized to FP8 along the rows (`ir::fp8`); db stays exact.
        #[serde(skip_serializing_if = "Option::is_none")]
        fp8: Option<Fp8Gemm>,
    },
    /// in: x, one operand of an FP8 GEMM as that GEMM reads it (`[rows, cols]`, `rows` fixed
    /// for a weight). out: amax, f32, one value per scale group of x as `ir::fp8` groups the
    /// operand under the scaling (`Fp8Operand::group_shape` on x's local shape, in its group
    /// order): the largest finite |element| of the group, 0 where it has none. The lowering
    /// max-reduces it over the ranks sharing those groups and hands it to the GEMM
    /// (`Fp8Gemm::shared`), so every one of them uses the single-rank run's scale.
    Fp8Amax(Fp8AmaxAttrs),
    /// Delayed FP8 scaling (`ir::fp8`'s module doc). in: x, one operand of an FP8 GEMM as that
    /// GEMM reads it (`[rows, cols]`, rows fixed for a weight); history, the operand's amax
    /// history `[1, H + 1]`. out: history, in place: element 0 becomes the larger of itself and
    /// x's largest finite |element| (the step's amax so far).
    Fp8AmaxRecord(Fp8HistoryAttrs),
    /// Delayed FP8 scaling, at the step's end. in: history `[1, H + 1]`, its element 0 the
    /// step's amax (max-reduced over the ranks recording it). out: history, in place: rolled
    /// one step (element k + 1 takes element k for k < H, the oldest is dropped, element 0 is
    /// zeroed); amax `[1]`, the rolled history's largest value: the scale amax the operand's
    /// GEMMs read next step.
    Fp8HistoryRoll(Fp8HistoryAttrs),
    /// in: x `[rows, cols]` (rows fixed for a weight), amax `[1]` f32. out: `q` `[rows, cols]`
    /// and/or `qt` `[cols, rows]` in the FP8 format: x quantized once, tensorwise, with the
    /// scale amax's scale, for the FP8 GEMMs with `Fp8Gemm::quantized` that read it
    /// (`ir::fp8::Fp8QuantizeAttrs`).
    Fp8Quantize(Fp8QuantizeAttrs),

    // ------------------------------------------------------------------ attention
    /// in: x `[rows, heads*head_dim]`. out: y, each head rotated by its row's position.
    Rope(RopeAttrs),
    /// in: dy. out: dx (rotation by the negative angle).
    RopeBwd(RopeAttrs),
    /// in: nothing. out: table `[len(positions), 2·head_dim]` f32, the rotation of each local
    /// position: row `s` (the `s`-th position of `positions`, global position `p`) holds
    /// `cos(angle_i)` in column `c < head_dim` and `sign_c · sin(angle_i)` in column
    /// `head_dim + c`, with `i = c mod head_dim/2`, `sign_c` = −1 for `c < head_dim/2` and +1
    /// after, and `angle_i = p · inv_freq(i)` (`RopeAttrs::inv_freq`) computed in f64 and rounded to f32
    /// exactly as `Rope` computes it. The table is the same for every head and sample: `heads`
    /// and `batch` do not change it. With it a rope is `y(c) = x(c)·cos(c) + x(rot(c))·ssin(c)`
    /// and its backward `dx(c) = dy(c)·cos(c) − dy(rot(c))·ssin(c)` (`rot` the rotate-half
    /// partner, `ssin` the signed sine), bit for bit what `Rope`/`RopeBwd` compute: the fusion
    /// pass (`fuse`) makes one per step for the fused kernels that rotate.
    RopeTable(RopeAttrs),
    /// Scaled dot-product attention, softmax scale `scale` (1/sqrt(head_dim) by default).
    /// in: q `[rows_q, heads*head_dim]`, k `[rows_kv, kv_heads*head_dim]`, v (as k); or, when
    /// `packed`, one qkv `[rows, (heads + 2*kv_heads)*head_dim]` whose every row holds that
    /// row's q heads, then its k heads, then its v heads (what one fused projection GEMM
    /// writes; needs `q_positions == kv_positions`).
    /// out: o `[rows_q, heads*head_dim]`, lse `[batch, heads, seq_q]` (log-sum-exp of the scaled
    /// scores per query). `rows_q = len(q_positions) * batch`, `rows_kv = len(kv_positions) * batch`.
    /// When `causal`, query at global position p attends keys at positions ≤ p.
    Attention(AttentionAttrs),
    /// in: do, q, k, v, o, lse. out: dq, dk, dv (overwritten). When `packed`: in do, qkv, o,
    /// lse; out dqkv, laid out as qkv (every element written).
    AttentionBwd(AttentionAttrs),

    // ------------------------------------------------------------------ elementwise
    /// in: x. out: act(x). gelu is the erf form; gelu_tanh the tanh approximation.
    Activation(ActAttrs),
    /// in: dy, x. out: dx.
    ActivationBwd(ActAttrs),
    /// A generated kernel (`kir::Kernel`): in, one buffer per kernel input, shaped by its
    /// `Access` (`[n, width]`, `[n]`, or `[cols]` f32); out, one per kernel output. Every output
    /// element is written (kernel invariant 4). Made by the fusion pass and by the lowering of
    /// an activation defined as a `.par` function.
    Fused(FusedAttrs),
    /// in: gate, up (same shape). out: silu(gate) * up.
    SwiGlu,
    /// in: dy, gate, up. out: dgate, dup.
    SwiGluBwd,
    /// in: a, b (same shape). out: a + b.
    Add,
    /// in: x. out: factor * x.
    Scale { factor: f64 },
    /// in: x. out: a copy of x.
    Copy,
    /// in: x `[rows, Σ widths]`. out: one `[rows, widths[i]]` per width: x's column blocks in
    /// order (a fused q/k/v projection's output split for rope or context parallelism).
    SplitColumns { widths: Vec<u64> },
    /// in: one `[rows, widths[i]]` per width. out: x `[rows, Σ widths]`, their columns side by
    /// side (the inverse of `SplitColumns`).
    ConcatColumns { widths: Vec<u64> },
    /// in: nothing. out: the buffer, set to zero.
    Zero,
    /// in: src. out: dst, with `dst[dst_offset + i] = src[src_offset + i]` for `i < len` (flat
    /// element offsets, any shapes); the rest of dst is untouched. Moves gradients into and out
    /// of flat buckets and ZeRO's zero-padded flat copies.
    CopyRange {
        src_offset: u64,
        dst_offset: u64,
        len: u64,
    },

    // ------------------------------------------------------------------ cross-entropy
    /// The whole loss of an unsplit vocabulary in one pass per row (llm.c's fused classifier),
    /// writing the loss gradient over the logits.
    /// in: logits `[rows, vocab]`, targets `[rows]` i32. out: dlogits — the logits buffer
    /// itself (in place: output 0 is input 0) — and loss `[1]` (+=).
    /// Per row, with `max` = the row's largest logit, `sumexp = Σ_j exp(logit_j − max)` and
    /// `target_logit` = the logit of the row's target (0 when the target is outside
    /// `[0, vocab)`): `loss += scale * Σ_rows (ln sumexp + max − target_logit)` and
    /// `dlogits = s * scale * (softmax − onehot(target))`, `s` the step's loss scale (1
    /// without): exactly what `CeMax`, `CeSumExp`, `CeTargetLogit`, `CeLoss` and `CeGrad`
    /// compute together with `vocab_start = 0`, minus the dlogits buffer. `scale` = 1 / (tokens
    /// in the global batch).
    CrossEntropy { vocab: u64, scale: f64 },
    // Vocab-parallel decomposition (Megatron): with the vocab split over tp, the lowering
    // all-reduces `max` (Max), `sumexp` (Sum) and `target_logit` (Sum) over tp between the steps.
    /// in: logits `[rows, vocab_local]`. out: max `[rows]`.
    CeMax { vocab_local: u64 },
    /// in: logits, max `[rows]`. out: sumexp `[rows]` = Σ exp(logit − max).
    CeSumExp { vocab_local: u64 },
    /// in: logits, targets `[rows]` i32. out: target_logit `[rows]` (0 where the target is
    /// outside `[vocab_start, vocab_start + vocab_local)`).
    CeTargetLogit { vocab_start: u64, vocab_local: u64 },
    /// in: max, sumexp, target_logit. out: loss `[1]` (+=) `scale * Σ_rows (ln sumexp + max −
    /// target_logit)`. `scale` = 1 / (tokens in the global batch).
    CeLoss { scale: f64 },
    /// in: logits, targets, max, sumexp. out: dlogits `[rows, vocab_local]` =
    /// `s * scale * (softmax − onehot(target))`, `s` the step's loss scale (1 without).
    CeGrad {
        vocab_start: u64,
        vocab_local: u64,
        scale: f64,
    },

    // ------------------------------------------------------------------ optimizer
    /// in: g (any shape). out: sumsq `[1]` (+=) Σ g².
    SumSquares,
    /// in: sumsq `[1]` (the global squared gradient norm). out: coef `[1]` =
    /// `min(1, max_norm / (sqrt(sumsq) + 1e-6))`, or 1 when `max_norm` is None.
    /// With a loss scale `s` (the gradients are `s` times too large): `coef =
    /// min(1, max_norm / (sqrt(sumsq) / s + 1e-6)) / s` (or `1 / s`), and NaN when sumsq is
    /// not finite (an overflow: the optimizer ops then skip the step). Without one the
    /// coefficient is always finite.
    ClipCoef { max_norm: Option<f64> },
    /// in: g, coef `[1]`. out (in place, listed as outputs): param, m, v.
    /// g' = coef·g; m = β1 m + (1−β1) g'; v = β2 v + (1−β2) g'²; m̂ = m/(1−β1^t); v̂ = v/(1−β2^t);
    /// param -= lr·(m̂/(√v̂ + eps) + wd·param) where wd = `weight_decay` (0 for non-decayed).
    /// A non-finite coef (an overflowed fp16 step) leaves param, m and v untouched.
    AdamW {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    /// in: g, coef. out (in place): param, momentum (omit when `momentum` is 0).
    /// g' = coef·g + wd·param; buf = momentum·buf + g' (buf = g' at t = 1); param -= lr·buf.
    /// A non-finite coef (an overflowed fp16 step) leaves param and momentum untouched.
    Sgd { momentum: f64, weight_decay: f64 },
}

impl Op {
    /// A GEMM: `Matmul`, `MatmulBwdData` or `MatmulBwdWeight`.
    pub fn is_gemm(&self) -> bool {
        matches!(
            self,
            Op::Matmul { .. } | Op::MatmulBwdData { .. } | Op::MatmulBwdWeight { .. }
        )
    }

    /// A GEMM's `(in_dim, out_dim)` (None for every other op).
    pub fn gemm_dims(&self) -> Option<(u64, u64)> {
        match *self {
            Op::Matmul {
                in_dim, out_dim, ..
            }
            | Op::MatmulBwdData {
                in_dim, out_dim, ..
            }
            | Op::MatmulBwdWeight {
                in_dim, out_dim, ..
            } => Some((in_dim, out_dim)),
            _ => None,
        }
    }

    /// The GEMM's `fp8` attribute (None for every other op).
    pub fn fp8(&self) -> Option<Fp8Gemm> {
        match self {
            Op::Matmul { fp8, .. }
            | Op::MatmulBwdData { fp8, .. }
            | Op::MatmulBwdWeight { fp8, .. } => *fp8,
            _ => None,
        }
    }

    /// An FP8 GEMM's attribute and its two quantized operands, in input order (None for
    /// every other op).
    pub fn fp8_operands(&self) -> Option<(Fp8Gemm, [Fp8Operand; 2])> {
        let g = self.fp8()?;
        let of = match self {
            Op::Matmul { .. } => operands::forward(g),
            Op::MatmulBwdData { .. } => operands::bwd_data(g),
            _ => operands::bwd_weight(g),
        };
        Some((g, of))
    }

    /// The GEMM with its `fp8` attribute set to `to` (unchanged for every other op).
    pub fn with_fp8(&self, to: Option<Fp8Gemm>) -> Op {
        let mut op = self.clone();
        if let Op::Matmul { fp8, .. }
        | Op::MatmulBwdData { fp8, .. }
        | Op::MatmulBwdWeight { fp8, .. } = &mut op
        {
            *fp8 = to;
        }
        op
    }

    /// The op with its `accumulate_param_grad` set to `accumulate` (unchanged for an op
    /// without one, see `Op::param_grad_outputs` in `table`).
    pub fn with_param_grad_accumulation(&self, accumulate: bool) -> Op {
        let mut op = self.clone();
        match &mut op {
            Op::MatmulBwdWeight {
                accumulate_param_grad,
                ..
            }
            | Op::PositionAddBwd {
                accumulate_param_grad,
                ..
            }
            | Op::LayerNormBwd {
                accumulate_param_grad,
                ..
            }
            | Op::RmsNormBwd {
                accumulate_param_grad,
                ..
            } => *accumulate_param_grad = accumulate,
            _ => {}
        }
        op
    }
}

/// The IR's text form of an op: its variant name and attributes, as a derived `Debug` would
/// print a struct variant (the shared attribute structs of the twins are flattened into it).
impl fmt::Debug for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.opcode().variant();
        if matches!(
            self,
            Op::SwiGlu | Op::SwiGluBwd | Op::Add | Op::Copy | Op::Zero | Op::SumSquares
        ) {
            return f.write_str(name);
        }
        if let Op::Fused(a) = self {
            return write!(f, "Fused {:?} {{ {} }}", a.name, a.kernel);
        }
        let mut d = f.debug_struct(name);
        match self {
            Op::Embedding(a) | Op::EmbeddingBwd(a) => d
                .field("vocab_start", &a.vocab_start)
                .field("vocab_local", &a.vocab_local)
                .field("dim", &a.dim),
            Op::PositionAdd(a) => position_fields(&mut d, a),
            Op::PositionAddBwd {
                pos,
                accumulate_param_grad,
            } => position_fields(&mut d, pos).field("accumulate_param_grad", accumulate_param_grad),
            Op::LayerNorm { dim, eps, bias } => {
                d.field("dim", dim).field("eps", eps).field("bias", bias)
            }
            Op::LayerNormBwd {
                dim,
                bias,
                accumulate,
                accumulate_param_grad,
            } => d
                .field("dim", dim)
                .field("bias", bias)
                .field("accumulate", accumulate)
                .field("accumulate_param_grad", accumulate_param_grad),
            Op::RmsNorm { dim, eps } => d.field("dim", dim).field("eps", eps),
            Op::RmsNormBwd {
                dim,
                accumulate,
                accumulate_param_grad,
            } => d
                .field("dim", dim)
                .field("accumulate", accumulate)
                .field("accumulate_param_grad", accumulate_param_grad),
            Op::Matmul {
                in_dim,
                out_dim,
                bias,
                act,
                residual,
                swiglu,
                fp8,
            } => fp8_field(
                swiglu_field(
                    d.field("in_dim", in_dim)
                        .field("out_dim", out_dim)
                        .field("bias", bias)
                        .field("act", act)
                        .field("residual", residual),
                    *swiglu,
                ),
                fp8,
            ),
            Op::MatmulBwdData {
                in_dim,
                out_dim,
                accumulate,
                act_grad,
                swiglu,
                fp8,
            } => fp8_field(
                swiglu_field(
                    d.field("in_dim", in_dim)
                        .field("out_dim", out_dim)
                        .field("accumulate", accumulate)
                        .field("act_grad", act_grad),
                    *swiglu,
                ),
                fp8,
            ),
            Op::MatmulBwdWeight {
                in_dim,
                out_dim,
                bias,
                accumulate_param_grad,
                fp8,
            } => fp8_field(
                d.field("in_dim", in_dim)
                    .field("out_dim", out_dim)
                    .field("bias", bias)
                    .field("accumulate_param_grad", accumulate_param_grad),
                fp8,
            ),
            Op::Fp8Amax(a) => d
                .field("operand", &format_args!("{}", a.operand.format.name()))
                .field("kind", &a.operand.kind)
                .field("along", &a.operand.along)
                .field("scaling", &format_args!("{}", a.scaling.name()))
                .field("rows", &a.rows)
                .field("cols", &a.cols),
            Op::Fp8AmaxRecord(a) => d
                .field("history", &a.history)
                .field("rows", &a.rows)
                .field("cols", &a.cols),
            Op::Fp8HistoryRoll(a) => d.field("history", &a.history),
            Op::Fp8Quantize(a) => d
                .field("format", &format_args!("{}", a.format.name()))
                .field("rows", &a.rows)
                .field("cols", &a.cols)
                .field("direct", &a.direct)
                .field("transposed", &a.transposed),
            Op::Rope(a) | Op::RopeBwd(a) | Op::RopeTable(a) => {
                d.field("batch", &a.batch)
                    .field("heads", &a.heads)
                    .field("head_dim", &a.head_dim)
                    .field("theta", &a.theta);
                if !a.scaling.is_none() {
                    d.field("scaling", &a.scaling);
                }
                d.field("positions", &a.positions)
            }
            Op::Attention(a) | Op::AttentionBwd(a) => d
                .field("batch", &a.batch)
                .field("heads", &a.heads)
                .field("kv_heads", &a.kv_heads)
                .field("head_dim", &a.head_dim)
                .field("causal", &a.causal)
                .field("scale", &a.scale)
                .field("q_positions", &a.q_positions)
                .field("kv_positions", &a.kv_positions)
                .field("packed", &a.packed),
            Op::Activation(a) | Op::ActivationBwd(a) => d.field("act", &a.act),
            Op::Fused(_)
            | Op::SwiGlu
            | Op::SwiGluBwd
            | Op::Add
            | Op::Copy
            | Op::Zero
            | Op::SumSquares => &mut d,
            Op::Scale { factor } => d.field("factor", factor),
            Op::SplitColumns { widths } | Op::ConcatColumns { widths } => d.field("widths", widths),
            Op::CopyRange {
                src_offset,
                dst_offset,
                len,
            } => d
                .field("src_offset", src_offset)
                .field("dst_offset", dst_offset)
                .field("len", len),
            Op::CrossEntropy { vocab, scale } => d.field("vocab", vocab).field("scale", scale),
            Op::CeMax { vocab_local } | Op::CeSumExp { vocab_local } => {
                d.field("vocab_local", vocab_local)
            }
            Op::CeTargetLogit {
                vocab_start,
                vocab_local,
            } => vocab_fields(&mut d, vocab_start, vocab_local),
            Op::CeLoss { scale } => d.field("scale", scale),
            Op::CeGrad {
                vocab_start,
                vocab_local,
                scale,
            } => vocab_fields(&mut d, vocab_start, vocab_local).field("scale", scale),
            Op::ClipCoef { max_norm } => d.field("max_norm", max_norm),
            Op::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => d
                .field("beta1", beta1)
                .field("beta2", beta2)
                .field("eps", eps)
                .field("weight_decay", weight_decay),
            Op::Sgd {
                momentum,
                weight_decay,
            } => d
                .field("momentum", momentum)
                .field("weight_decay", weight_decay),
        };
        d.finish()
    }
}

fn vocab_fields<'a, 'b, 'c>(
    d: &'a mut fmt::DebugStruct<'b, 'c>,
    vocab_start: &u64,
    vocab_local: &u64,
) -> &'a mut fmt::DebugStruct<'b, 'c> {
    d.field("vocab_start", vocab_start)
        .field("vocab_local", vocab_local)
}

/// A GEMM's `fp8` attribute, printed only where set (bf16 GEMMs read as before).
fn fp8_field<'a, 'b, 'c>(
    d: &'a mut fmt::DebugStruct<'b, 'c>,
    fp8: &Option<Fp8Gemm>,
) -> &'a mut fmt::DebugStruct<'b, 'c> {
    match fp8 {
        Some(g) => d.field("fp8", &format_args!("{g}")),
        None => d,
    }
}

/// A GEMM's `swiglu` flag, printed only when set (the text form of every other GEMM is as it was).
fn swiglu_field<'a, 'b, 'c>(
    d: &'a mut fmt::DebugStruct<'b, 'c>,
    swiglu: bool,
) -> &'a mut fmt::DebugStruct<'b, 'c> {
    if swiglu {
        d.field("swiglu", &true)
    } else {
        d
    }
}

fn position_fields<'a, 'b, 'c>(
    d: &'a mut fmt::DebugStruct<'b, 'c>,
    a: &PositionAttrs,
) -> &'a mut fmt::DebugStruct<'b, 'c> {
    d.field("batch", &a.batch)
        .field("dim", &a.dim)
        .field("positions", &a.positions)
}
