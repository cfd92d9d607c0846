//! Parameters per rank and the model-state memory (weights, gradients, optimizer state) by
//! precision and ZeRO stage, sharded as Rajbhandari et al. 2020 ("ZeRO") do: ZeRO-1 shards the
//! optimizer term (fp32 master, Adam's m and v: K = 12) over N_d data-parallel ranks, ZeRO-2
//! also the gradients, ZeRO-3 also the weights. The bytes per parameter are the ones parc's
//! lowering holds (bf16 weights, fp32 gradients: 2 + 4 + 12/N_d under ZeRO-1, as Megatron's
//! distributed optimizer), not the paper's fp16 gradients.

use super::MemoryTerms;
use crate::spec::{Axis, LayerKind, Optimizer, Precision, Spec, ZeroStage};

/// Model-state bytes of one rank holding Ψ parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelStateBytes {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer: f64,
}

impl ModelStateBytes {
    pub fn total(&self) -> f64 {
        self.weights + self.gradients + self.optimizer
    }
}

/// Bytes per parameter of (weights, gradients, optimizer state) before sharding, as the
/// lowering holds them (docs/memory.md): weights are the copy compute reads (bf16 2, fp32 4,
/// fp16 an f32 tensor and its cached 16-bit cast 6; none under ZeRO-3, which gathers them per
/// use: a buffer term); gradients are f32 in every precision; the optimizer term counts the f32
/// master where it is a tensor of its own (bf16 runs, and every ZeRO shard) beside the
/// optimizer's words (AdamW: K = 4 + 8 = 12).
pub fn bytes_per_param(
    precision: Precision,
    optimizer: &Optimizer,
    zero: ZeroStage,
) -> (f64, f64, f64) {
    let words = optimizer.state_words() as f64;
    let weights = match (zero, precision) {
        (ZeroStage::Zero3, _) => 0.0,
        (_, Precision::Fp32) => 4.0,
        (_, Precision::Bf16) => 2.0,
        (_, Precision::Fp16 { .. }) => 6.0,
    };
    let master = if zero >= ZeroStage::Zero1 || precision == Precision::Bf16 {
        4.0
    } else {
        0.0
    };
    (weights, 4.0, master + 4.0 * words)
}

/// ZeRO's model-state memory for `psi` parameters sharded over `nd` ranks.
pub fn model_state_bytes(
    psi: f64,
    per_param: (f64, f64, f64),
    zero: ZeroStage,
    nd: u32,
) -> ModelStateBytes {
    let nd = f64::from(nd.max(1));
    let (w, g, k) = per_param;
    let shard = |on: bool| if on { nd } else { 1.0 };
    ModelStateBytes {
        weights: w * psi / shard(zero >= ZeroStage::Zero3),
        gradients: g * psi / shard(zero >= ZeroStage::Zero2),
        optimizer: k * psi / shard(zero >= ZeroStage::Zero1),
    }
}

/// Global parameter count of one node (a tied head owns none): the parameters the lowering
/// declares for it.
pub fn node_params(spec: &Spec, kind: &LayerKind) -> u64 {
    crate::lower::params::declared(spec, kind)
        .iter()
        .map(|p| p.numel())
        .sum()
}

/// Parameters of one node held by one tp rank: divided by tp where the spec shards the layer
/// (the row-parallel output bias stays whole, a rounding detail we ignore).
fn node_params_local(spec: &Spec, kind: &LayerKind) -> u64 {
    let n = node_params(spec, kind);
    let t = u64::from(spec.parallel.mesh.size(Axis::Tp).max(1));
    if super::tp_divides(spec, kind) {
        n.div_ceil(t)
    } else {
        n
    }
}

/// Whole-model parameter count (tied weights once).
pub fn total_params(spec: &Spec) -> u64 {
    (spec.model.nodes.iter())
        .map(|n| node_params(spec, &n.kind))
        .sum()
}

/// Parameters one rank of a stage holds: its nodes' tp-local parameters, plus a copy of a tied
/// embedding table when the tied head is here and the embedding is not.
pub fn stage_params(spec: &Spec, in_stage: &[bool]) -> u64 {
    let nodes = &spec.model.nodes;
    let mut total = 0;
    for (node, &here) in nodes.iter().zip(in_stage) {
        if !here {
            continue;
        }
        total += node_params_local(spec, &node.kind);
        if let LayerKind::Linear {
            tied: Some(owner), ..
        } = &node.kind
        {
            let owner_here = in_stage.get(owner.0 as usize).copied().unwrap_or(false);
            if !owner_here {
                if let Some(owner_node) = nodes.get(owner.0 as usize) {
                    total += node_params_local(spec, &owner_node.kind);
                }
            }
        }
    }
    total
}

/// Ranks that hold the same parameters and so share ZeRO shards: dp × cp.
pub fn zero_group(spec: &Spec) -> u32 {
    spec.parallel.mesh.size(Axis::Dp) * spec.parallel.mesh.size(Axis::Cp)
}

/// Weights, gradients and optimizer terms for a stage with `params` parameters per rank (the
/// activation term is filled in by the caller; buffers here).
pub fn memory_terms(spec: &Spec, in_stage: &[bool], params: u64) -> MemoryTerms {
    let per_param = bytes_per_param(
        spec.train.precision,
        &spec.train.optimizer,
        spec.parallel.zero,
    );
    let nd = zero_group(spec);
    let state = model_state_bytes(params as f64, per_param, spec.parallel.zero, nd);
    MemoryTerms {
        weights: state.weights.ceil() as u64,
        gradients: state.gradients.ceil() as u64,
        optimizer: state.optimizer.ceil() as u64,
        activations: 0,
        buffers: buffer_bytes(spec, in_stage, params, per_param.1),
    }
}

/// Communication staging: two gradient buckets when gradients are reduced over dp·cp, and under
/// ZeRO-3 the gathered weights of the two largest layers (in use and prefetched).
fn buffer_bytes(spec: &Spec, in_stage: &[bool], params: u64, grad_bytes: f64) -> u64 {
    let nd = zero_group(spec);
    if nd <= 1 {
        return 0;
    }
    let grads = (params as f64 * grad_bytes) as u64;
    let buckets = (2 * spec.parallel.bucket_bytes).min(grads);
    if spec.parallel.zero < ZeroStage::Zero3 {
        return buckets;
    }
    let bytes = spec.train.precision.compute_bytes();
    let mut per_layer: std::collections::BTreeMap<Option<u32>, u64> = Default::default();
    for (node, &here) in spec.model.nodes.iter().zip(in_stage) {
        if here {
            *per_layer.entry(node.layer).or_default() += node_params_local(spec, &node.kind);
        }
    }
    let mut sizes: Vec<u64> = per_layer.into_values().collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let gathered: u64 = sizes.iter().take(2).sum::<u64>() * bytes;
    buckets + gathered
}
