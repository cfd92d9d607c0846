//! FLOPs of one step on one rank: 2 per matmul weight per token forward and 4 backward, plus
//! attention's 4·s·d_attn per token forward and 8 backward (PaLM's 6N + 12·L·d·T convention,
//! not halved for causal masks), divided over tp (split layers) and cp (tokens). Recompute adds
//! one more forward of what it rebuilds. Norms, activations and the loss are ignored (memory
//! bound, a few percent).

use super::FlopTerms;
use crate::spec::{Axis, LayerKind, Node, Recompute, Spec};

/// (matmul weights, attention width d_attn = heads·head_dim) of one node as one rank holds them.
fn node_work(spec: &Spec, kind: &LayerKind) -> (f64, f64) {
    let t = f64::from(spec.parallel.mesh.size(Axis::Tp).max(1));
    let split = if super::tp_divides(spec, kind) {
        t
    } else {
        1.0
    };
    let (weights, attn) = match kind {
        LayerKind::Attention {
            dim,
            heads,
            kv_heads,
            head_dim,
            ..
        } => {
            let q = (heads * head_dim) as f64;
            let kv = (kv_heads * head_dim) as f64;
            ((2.0 * q + 2.0 * kv) * *dim as f64, q)
        }
        LayerKind::Mlp {
            dim, hidden, act, ..
        } => {
            let mats = if act.is_gated() { 3.0 } else { 2.0 };
            (mats * (*hidden as f64) * (*dim as f64), 0.0)
        }
        LayerKind::Linear {
            in_dim, out_dim, ..
        } => ((*in_dim as f64) * (*out_dim as f64), 0.0),
        _ => (0.0, 0.0),
    };
    (weights / split, attn / split)
}

/// FLOPs of one step on one rank of the stage whose nodes are marked in `in_stage`.
pub fn stage_flops(spec: &Spec, in_stage: &[bool]) -> FlopTerms {
    let mut out = FlopTerms::default();
    for (node, &here) in spec.model.nodes.iter().zip(in_stage) {
        if here {
            let f = node_flops(spec, node);
            out.forward += f.forward;
            out.backward += f.backward;
            out.recompute += f.recompute;
        }
    }
    out
}

/// FLOPs of one step of `node` on one rank that holds it.
pub fn node_flops(spec: &Spec, node: &Node) -> FlopTerms {
    let cp = f64::from(spec.parallel.mesh.size(Axis::Cp).max(1));
    let seq = spec.model.seq as f64;
    let tokens =
        f64::from(spec.parallel.microbatches.max(1)) * spec.train.micro_batch as f64 * seq / cp;
    let selective = spec.parallel.recompute == Recompute::Selective;
    let (weights, attn) = node_work(spec, &node.kind);
    let core = 4.0 * seq * attn * tokens;
    let forward = 2.0 * weights * tokens + core;
    let recompute = match (node.recompute, selective) {
        (false, _) => 0.0,
        (true, true) => core,
        (true, false) => forward,
    };
    FlopTerms {
        forward,
        backward: 2.0 * forward,
        recompute,
    }
}
