//! The analytical cost model behind `parc check`: per distinct rank role (each pipeline stage;
//! under interleaving a stage holds several model chunks) the memory by term, the FLOPs and
//! compute time of one step, the bytes each mesh axis communicates, and the pipeline bubble.
//! It reads only the checked [`Spec`]; the verifier (`parc plan`) later measures the lowered
//! programs exactly. Formulas (also in `docs/cost-model.md`):
//!
//! **Parameters per rank.** Ψ = the parameters of the nodes in the stage's chunks; attention,
//! MLP and vocab-sized embedding/head weights are divided by tp when the spec shards them
//! (norms, position embeddings and row-parallel biases are replicated). Chunk `c` of `p·v`
//! holds the next `chunk_layers[c]` repeated layers (`Spec.parallel.chunk_layers`: even,
//! given, or chosen by [`balance`]) and lives on stage `c mod p`; nodes before the repeat
//! belong to chunk 0, after it to the last chunk. A tied head on another stage than
//! its embedding holds a copy of the table (Megatron).
//!
//! **Model state** (ZeRO, Rajbhandari et al. 2020), with N_d = dp·cp (the ranks holding the same
//! parameters): mixed precision holds 2Ψ weights + 2Ψ gradients + KΨ optimizer state with
//! K = 4 (fp32 master) + 4 per fp32 optimizer word (AdamW: K = 12; SGD+momentum: 8); fp32 holds
//! 4Ψ + 4Ψ + 4·wordsΨ (AdamW 8Ψ). ZeRO-1 divides the optimizer term by N_d, ZeRO-2 also the
//! gradients, ZeRO-3 also the weights.
//!
//! **Activations** (Korthikanti et al. 2022, Table 2, per layer and microbatch in bytes with
//! 16-bit activations): sbh(34 + 5as/h) without parallelism; sbh(10 + 24/t + 5as/(ht)) with
//! TP; sbh(34/t + 5as/(ht)) with TP+SP; sbh·34/t with selective recompute (+SP); 2sbh with
//! full recompute. [`activation`] derives these from the tensors each layer keeps, which also
//! covers what the paper does not (SwiGLU, GQA, ffn ≠ 4h, fp32, no dropout, attention that keeps
//! only its log-sum-exp, inputs kept gathered under SP). Per stage: layers held × microbatches
//! in flight ([`schedule`]), plus the last stage's final norm input, head input and logits
//! (kept by the loss, s·b·v/t activation elements; the fused loss writes dlogits over them, so
//! there is no second such buffer) or, when larger, the working set of the largest
//! recomputed layer. Checked against the verifier's measured liveness (`verify` tests).
//!
//! **Buffers.** Gradient buckets: 2 × `bucket_bytes` (one filling, one reducing; at most the
//! gradients' size) when dp·cp > 1; ZeRO-3 also holds the gathered weights of the two largest
//! layers (current and prefetched), in compute precision.
//!
//! **FLOPs.** Per token 6 FLOPs per matmul weight (2 forward + 4 backward; embedding lookups are
//! free, a tied head is a matmul) plus attention 12·d_attn·s per layer (PaLM's 6N + 12·L·d·T
//! convention, not halved for causal masks), divided over tp and cp. Recompute adds one more
//! forward of what it recomputes (full: the layers; selective: the attention core 4·d_attn·s
//! per token per layer; named: those nodes). Time = FLOPs / the GPU's peak (bf16/fp16: tensor
//! peak; fp32: the fp32 peak).
//!
//! **Communication** (bytes each rank sends per step, ring algorithms; n = group size):
//! all-reduce 2(n−1)/n·B, all-gather and reduce-scatter (n−1)/n·B (B = the full buffer).
//! dp (over dp·cp): ZeRO-0/1/2 one all-reduce's worth of gradients (RS + AG for 1/2),
//! ZeRO-3 a reduce-scatter plus two all-gathers of the weights per microbatch (forward and
//! backward). tp: per layer and microbatch 2 all-reduces forward and 2 backward of the s·b·h
//! activations (SP: the same volume as all-gathers and reduce-scatters, plus under `sp_save =
//! sharded` one all-gather per layer and head in backward re-gathering the kept shard), plus 2
//! forward under full recompute, plus the vocab-parallel embedding's all-reduce. pp: each chunk boundary
//! sends s·b·h (÷t under SP) forward and its gradient back, per microbatch. cp: per layer
//! all-gather of K and V forward, reduce-scatter of their gradients backward. Seconds = bytes
//! over the intra-node link when the group fits in a node, else the inter-node link.
//!
//! **Bubble**: (p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(v·m+p−1) for interleaved 1F1B with v
//! chunks per rank (Narayanan et al. 2021), as a fraction of the step.

pub mod activation;
pub mod balance;
mod comm;
mod diagnose;
mod flops;
pub mod model_state;
pub mod schedule;
#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod testspec;

pub(crate) use diagnose::{alternatives, memory_error_head, memory_help, set_recompute, Measure};
pub use diagnose::{diagnose, gib, warnings, BUBBLE_LIMIT};

use crate::spec::{Axis, LayerKind, Precision, Spec};
use serde::Serialize;

/// Everything `parc check` reports about the cost of one training step.
#[derive(Clone, Debug, Serialize)]
pub struct CostReport {
    pub world: u32,
    /// Mesh sizes, outermost first.
    pub mesh: Vec<(Axis, u32)>,
    pub gpu: String,
    pub gpu_memory_bytes: u64,
    /// Parameters of the whole model (a tied weight counted once).
    pub params_total: u64,
    /// Tokens per optimizer step over all ranks.
    pub tokens_per_step: u64,
    pub microbatches: u32,
    /// Idle fraction of the step caused by pipeline fill and drain.
    pub bubble_fraction: f64,
    /// One entry per pipeline stage (its ranks are alike up to dp, cp and tp coordinates).
    pub roles: Vec<RoleCost>,
}

impl CostReport {
    /// The role with the largest peak memory.
    pub fn worst_role(&self) -> Option<&RoleCost> {
        self.roles.iter().max_by_key(|r| r.memory.total())
    }
}

/// The cost of one rank role: a pipeline stage.
#[derive(Clone, Debug, Serialize)]
pub struct RoleCost {
    /// Human name, e.g. `stage 0` or `stage 1 (chunks 1, 5)`.
    pub role: String,
    pub stage: u32,
    /// Global model chunks this stage holds (one without interleaving).
    pub chunks: Vec<u32>,
    /// Repeated layers this stage holds.
    pub layers: u32,
    /// Parameters held by one rank of this stage (after the tp split, before ZeRO).
    pub params: u64,
    /// Microbatches in flight at the stage's peak, from a microbatch's first forward on the
    /// stage to its last backward there (what the verifier counts on the lowered plan).
    pub microbatches_in_flight: u32,
    /// The activations the stage holds at its peak, in units of one microbatch through all of
    /// the stage's layers: chunk-microbatches in flight / v (fractional under interleaving,
    /// where each chunk holds 1/v of the layers; equal to `microbatches_in_flight` without).
    pub activation_microbatches: f64,
    pub memory: MemoryTerms,
    pub flops: FlopTerms,
    /// FLOPs / the GPU's peak, in seconds.
    pub compute_seconds: f64,
    /// Bytes sent per step on each mesh axis of size > 1.
    pub comm: Vec<AxisComm>,
}

/// Peak memory of one rank, by term, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct MemoryTerms {
    pub weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub buffers: u64,
}

impl MemoryTerms {
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.optimizer + self.activations + self.buffers
    }
    /// The terms with their names, largest first (ties in declaration order).
    pub fn by_size(&self) -> Vec<(&'static str, u64)> {
        let mut terms = vec![
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("buffers", self.buffers),
        ];
        terms.sort_by_key(|t| std::cmp::Reverse(t.1));
        terms
    }
}

/// FLOPs of one step on one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct FlopTerms {
    pub forward: f64,
    pub backward: f64,
    pub recompute: f64,
}

impl FlopTerms {
    pub fn total(&self) -> f64 {
        self.forward + self.backward + self.recompute
    }
}

/// Communication of one rank on one mesh axis per step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AxisComm {
    pub axis: Axis,
    /// Ranks in the group (for dp: dp·cp, the gradient-reduction group).
    pub group_size: u32,
    /// What travels, e.g. `gradient all-reduce`.
    pub what: String,
    pub bytes: f64,
    /// Whether the group spans more than one node (then the inter-node link is used).
    pub crosses_nodes: bool,
    /// bytes / link bandwidth + one latency per collective.
    pub seconds: f64,
}

/// Pipeline shape: stages p and model chunks per stage v (v = 1 unless interleaved with p > 1).
pub(crate) fn pipeline_shape(spec: &Spec) -> (u32, u32) {
    spec.parallel.pipeline_shape()
}

/// Chunk of each node (see the module header for the split rule).
pub(crate) fn node_chunks(spec: &Spec, chunks: u32) -> Vec<u32> {
    let mut seen_layer = false;
    spec.model
        .nodes
        .iter()
        .map(|n| match n.layer {
            Some(l) => {
                seen_layer = true;
                spec.parallel.chunk_of_layer(l).min(chunks.max(1) - 1)
            }
            None if seen_layer => chunks.max(1) - 1,
            None => 0,
        })
        .collect()
}

/// Bytes per activation element as the lowered plan stores them: 16-bit in bf16 runs only;
/// fp16 runs keep activations in f32 (16-bit storage would need the loss scale in every stored
/// gradient: docs/decisions.md), as fp32 runs do.
pub(crate) fn act_bytes(precision: Precision) -> u64 {
    match precision {
        Precision::Bf16 => 2,
        Precision::Fp32 | Precision::Fp16 { .. } => 4,
    }
}

/// Model FLOPs utilisation of a step of `step_seconds`: the model's forward and backward FLOPs
/// (no recompute) over the step and all GPUs at their peak in the run's precision.
pub fn mfu(spec: &Spec, step_seconds: f64) -> f64 {
    let (dp, _, cp, tp) = spec.parallel.mesh.sizes();
    let per_stage = f64::from(dp * cp * tp);
    let model: f64 = estimate(spec)
        .roles
        .iter()
        .map(|r| (r.flops.forward + r.flops.backward) * per_stage)
        .sum();
    let peak = spec.cluster.gpu.peak_for(spec.train.precision).max(1.0);
    let gpus = f64::from(spec.cluster.world());
    model / (step_seconds.max(f64::MIN_POSITIVE) * gpus * peak)
}

/// Estimate the cost of one training step of `spec`, per pipeline stage.
pub fn estimate(spec: &Spec) -> CostReport {
    let (p, v) = pipeline_shape(spec);
    let chunks = p * v;
    let node_chunk = node_chunks(spec, chunks);
    let m = spec.parallel.microbatches.max(1);
    let roles = (0..p)
        .map(|stage| {
            let held: Vec<u32> = (0..v).map(|j| j * p + stage).collect();
            let in_stage: Vec<bool> = node_chunk.iter().map(|c| held.contains(c)).collect();
            let params = model_state::stage_params(spec, &in_stage);
            let memory = model_state::memory_terms(spec, &in_stage, params);
            let in_flight =
                schedule::in_flight_layers_factor(spec.parallel.schedule, p, v, m, stage);
            let activations = activation::stage_activation_bytes(spec, &in_stage, in_flight);
            let memory = MemoryTerms {
                activations,
                ..memory
            };
            let flops = flops::stage_flops(spec, &in_stage);
            let peak = spec.cluster.gpu.peak_for(spec.train.precision);
            let compute_seconds = if peak > 0.0 {
                flops.total() / peak
            } else {
                0.0
            };
            let layers = spec
                .model
                .nodes
                .iter()
                .zip(&in_stage)
                .filter_map(|(n, &here)| if here { n.layer } else { None })
                .collect::<std::collections::BTreeSet<u32>>()
                .len() as u32;
            let role = if v > 1 {
                let list: Vec<String> = held.iter().map(u32::to_string).collect();
                format!("stage {stage} (chunks {})", list.join(", "))
            } else {
                format!("stage {stage}")
            };
            RoleCost {
                role,
                stage,
                chunks: held.clone(),
                layers,
                params,
                microbatches_in_flight: schedule::microbatches_in_flight(
                    spec.parallel.schedule,
                    p,
                    v,
                    m,
                    stage,
                ),
                activation_microbatches: in_flight.layer_microbatches,
                memory,
                flops,
                compute_seconds,
                comm: comm::stage_comm(spec, &in_stage, &held, chunks, params),
            }
        })
        .collect();
    let dp = u64::from(spec.parallel.mesh.size(Axis::Dp));
    CostReport {
        world: spec.parallel.mesh.world(),
        mesh: spec.parallel.mesh.axes.clone(),
        gpu: spec.cluster.gpu.name.clone(),
        gpu_memory_bytes: spec.cluster.gpu.memory_bytes,
        params_total: model_state::total_params(spec),
        tokens_per_step: spec.train.micro_batch * u64::from(m) * dp * spec.model.seq,
        microbatches: m,
        bubble_fraction: schedule::bubble_fraction(spec.parallel.schedule, p, v, m),
        roles,
    }
}

/// Whether `kind` is a layer whose parameters the tp split divides (given the spec's sharding).
pub(crate) fn tp_divides(spec: &Spec, kind: &LayerKind) -> bool {
    let sh = &spec.model.sharding;
    match kind {
        LayerKind::Attention { .. } => sh.attention_heads_on_tp,
        LayerKind::Mlp { .. } => sh.mlp_hidden_on_tp,
        LayerKind::Embedding { .. } => sh.vocab_on_tp,
        LayerKind::Linear { out_dim, .. } => sh.vocab_on_tp && *out_dim == spec.model.vocab,
        _ => false,
    }
}
