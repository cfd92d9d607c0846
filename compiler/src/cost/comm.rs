//! Bytes each rank sends per step on each mesh axis, with ring algorithms (n = group size, B =
//! the full buffer): all-reduce 2(n−1)/n·B, all-gather and reduce-scatter (n−1)/n·B each, a
//! point-to-point transfer B. What travels on each axis is listed in the `cost` module header.

use super::AxisComm;
use crate::spec::{Axis, LayerKind, Recompute, SpSave, Spec, ZeroStage};

/// Whether the group along `axes` containing rank 0 spans more than one node.
pub(crate) fn crosses_nodes(spec: &Spec, axes: &[Axis]) -> bool {
    let gpn = spec.cluster.gpus_per_node.max(1);
    let mesh = &spec.parallel.mesh;
    let mut members = vec![0u32];
    for &axis in axes {
        let (stride, size) = (mesh.stride(axis), mesh.size(axis));
        members = members
            .iter()
            .flat_map(|&r| (0..size).map(move |c| r + c * stride))
            .collect();
    }
    members.iter().any(|&r| r / gpn != 0)
}

fn entry(
    spec: &Spec,
    axis: Axis,
    axes: &[Axis],
    n: u32,
    what: String,
    bytes: f64,
    ops: f64,
) -> AxisComm {
    let crosses = crosses_nodes(spec, axes);
    let link = if crosses {
        &spec.cluster.inter
    } else {
        &spec.cluster.intra
    };
    let seconds = if link.bandwidth > 0.0 {
        bytes / link.bandwidth + ops * link.latency
    } else {
        0.0
    };
    AxisComm {
        axis,
        group_size: n,
        what,
        bytes,
        crosses_nodes: crosses,
        seconds,
    }
}

/// Per-axis communication of one rank of a stage holding `params` parameters and the global
/// chunks `held` of `chunks`.
pub fn stage_comm(
    spec: &Spec,
    in_stage: &[bool],
    held: &[u32],
    chunks: u32,
    params: u64,
) -> Vec<AxisComm> {
    let (dp, pp, cp, tp) = spec.parallel.mesh.sizes();
    let m = f64::from(spec.parallel.microbatches.max(1));
    let elem = super::act_bytes(spec.train.precision) as f64;
    let s_local = spec.model.seq as f64 / f64::from(cp.max(1));
    let b = spec.train.micro_batch as f64;
    let h = spec.model.dim as f64;
    let sp = spec.parallel.sequence_parallel && tp > 1;
    let full_recompute = !matches!(
        spec.parallel.recompute,
        Recompute::None | Recompute::Selective
    );
    let ring = |n: u32| f64::from(n.saturating_sub(1)) / f64::from(n.max(1));
    let mut out = Vec::new();

    let nd = dp * cp;
    if nd > 1 {
        let per_param = super::model_state::bytes_per_param(
            spec.train.precision,
            &spec.train.optimizer,
            spec.parallel.zero,
        );
        let (w, g) = (params as f64 * elem, params as f64 * per_param.1);
        let buckets = (g / spec.parallel.bucket_bytes.max(1) as f64)
            .ceil()
            .max(1.0);
        let (what, bytes, ops) = match spec.parallel.zero {
            ZeroStage::Zero0 => ("gradient all-reduce", 2.0 * ring(nd) * g, buckets),
            ZeroStage::Zero1 => (
                "gradient reduce-scatter + weight all-gather",
                ring(nd) * (g + w),
                2.0 * buckets,
            ),
            // ZeRO-2/3 reduce-scatter each microbatch's gradients into the shard.
            ZeroStage::Zero2 => (
                "gradient reduce-scatters (per microbatch) + weight all-gather",
                ring(nd) * (m * g + w),
                buckets * (m + 1.0),
            ),
            ZeroStage::Zero3 => (
                "gradient reduce-scatters + weight all-gathers (forward and backward), per microbatch",
                ring(nd) * m * (g + 2.0 * w),
                buckets * 3.0 * m,
            ),
        };
        let label = if cp > 1 {
            format!("{what} over dp×cp")
        } else {
            what.to_string()
        };
        out.push(entry(
            spec,
            Axis::Dp,
            &[Axis::Dp, Axis::Cp],
            nd,
            label,
            bytes,
            ops,
        ));
    }

    let act = s_local * b * h * elem;
    if tp > 1 {
        // All-reduces of the s·b·h activations per microbatch (SP: AG + RS, the same volume).
        let mut all_reduces = 0.0;
        for (node, &here) in spec.model.nodes.iter().zip(in_stage) {
            if !here || !super::tp_divides(spec, &node.kind) {
                continue;
            }
            let per = match node.kind {
                LayerKind::Attention { .. } | LayerKind::Mlp { .. } => 2.0,
                LayerKind::Embedding { .. } | LayerKind::Linear { .. } => 1.0,
                _ => 0.0,
            };
            let again = if node.recompute && full_recompute {
                per / 2.0
            } else {
                0.0
            };
            // A kept sequence shard is all-gathered again in backward (half an all-reduce).
            let regather = match node.kind {
                LayerKind::Attention { .. } | LayerKind::Mlp { .. } | LayerKind::Linear { .. }
                    if sp && spec.parallel.sp_save == SpSave::Sharded =>
                {
                    0.5
                }
                _ => 0.0,
            };
            all_reduces += per + again + regather;
        }
        let what = if sp {
            "activation all-gather + reduce-scatter (sequence parallel)"
        } else {
            "activation all-reduce"
        };
        let ops = all_reduces * m * if sp { 2.0 } else { 1.0 };
        out.push(entry(
            spec,
            Axis::Tp,
            &[Axis::Tp],
            tp,
            what.to_string(),
            all_reduces * m * 2.0 * ring(tp) * act,
            ops,
        ));
    }

    if pp > 1 {
        let boundary = if sp { act / f64::from(tp) } else { act };
        let sends: f64 = held
            .iter()
            .map(|&c| f64::from(u8::from(c + 1 < chunks)) + f64::from(u8::from(c > 0)))
            .sum();
        out.push(entry(
            spec,
            Axis::Pp,
            &[Axis::Pp],
            pp,
            "activations forward, their gradients back (point-to-point)".to_string(),
            sends * m * boundary,
            sends * m,
        ));
    }

    if cp > 1 {
        let mut bytes = 0.0;
        let mut ops = 0.0;
        for (node, &here) in spec.model.nodes.iter().zip(in_stage) {
            let LayerKind::Attention {
                kv_heads, head_dim, ..
            } = node.kind
            else {
                continue;
            };
            if !here {
                continue;
            }
            let split = if spec.model.sharding.attention_heads_on_tp {
                f64::from(tp)
            } else {
                1.0
            };
            let kv_full =
                spec.model.seq as f64 * b * 2.0 * (kv_heads * head_dim) as f64 / split * elem;
            let times = if node.recompute && full_recompute {
                3.0
            } else {
                2.0
            };
            bytes += times * ring(cp) * kv_full * m;
            ops += times * m;
        }
        out.push(entry(
            spec,
            Axis::Cp,
            &[Axis::Cp],
            cp,
            "K/V all-gather forward, their gradients reduce-scattered back".to_string(),
            bytes,
            ops,
        ));
    }
    out
}
