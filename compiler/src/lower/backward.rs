//! Backward of every layer kind: the gradient of each input from the gradient of the output
//! and the saved tensors, and the (accumulated) gradients of the layer's parameters. See
//! `layers` for the parallel conjugates.

use super::emitter::Emitter;
use super::layers::AttnShape;
use crate::ir::op::{Act, Op};
use crate::ir::{BufferId, BufferKind, CollectiveKind, Phase};
use crate::spec::{Activation, LayerKind, NodeId};

/// Whether the backward of a `kind` node reads its parameter `local` (ZeRO-3 prefetches only
/// those ahead of a backward that does not recompute the node): embeddings read none (their
/// gradients are scattered from the tokens or positions), the other layers read their weight
/// matrices and norm weights, never a bias. Must match the `weight` calls below;
/// `tests/ir/lowering.rs` checks that every prefetched parameter is read and that backward
/// gathers nothing on demand outside recompute.
pub(super) fn backward_reads(kind: &LayerKind, local: &str) -> bool {
    match kind {
        LayerKind::Embedding { .. } | LayerKind::PositionEmbedding { .. } => false,
        LayerKind::LayerNorm { .. } | LayerKind::RmsNorm { .. } | LayerKind::Linear { .. } => {
            local == "weight"
        }
        LayerKind::Attention { .. } => matches!(local, "wq" | "wk" | "wv" | "wo"),
        LayerKind::Mlp { .. } => matches!(local, "fc" | "proj" | "gate" | "up" | "down"),
        LayerKind::Add | LayerKind::CrossEntropy => false,
    }
}

impl Emitter<'_> {
    /// Emit the backward of `node` for microbatch `mb`, consuming its saved tensors and the
    /// gradient of its output.
    pub fn backward_node(&mut self, mb: u32, node: NodeId, saved: Vec<BufferId>) {
        let Some(n) = self.spec.model.nodes.get(node.0 as usize) else {
            return;
        };
        let (kind, output, inputs) = (n.kind.clone(), n.output, n.inputs.clone());
        let dy = if matches!(kind, LayerKind::CrossEntropy) {
            None
        } else {
            match self.mbs[mb as usize].grads.remove(&output) {
                Some(d) => Some(d),
                None => {
                    // The output does not reach the loss: nothing flows back.
                    for s in saved {
                        self.b.release(s);
                    }
                    let locals: Vec<&'static str> =
                        self.params.slots(node).iter().map(|s| s.local).collect();
                    for l in locals {
                        self.grad_used(node, l);
                    }
                    return;
                }
            }
        };
        self.phase = Phase::Backward;
        let rows = self.rows_full();
        let tp = u64::from(self.tp);
        let sv = |i: usize| saved.get(i).copied();
        let dx: Option<BufferId> = match (&kind, dy) {
            // The fused loss left dlogits in the logits buffer: it becomes the gradient (held
            // once more, as the saved list's hold is released below).
            (LayerKind::CrossEntropy, _) if self.fuses_loss(node) => {
                let dlogits = sv(0);
                if let Some(d) = dlogits {
                    self.b.retain(d);
                }
                dlogits
            }
            (LayerKind::CrossEntropy, _) => {
                if let (Some(logits), Some(targets), Some(mx), Some(se)) =
                    (sv(0), sv(1), sv(2), sv(3))
                {
                    let shape = self.b.shape(logits);
                    let vl = shape.get(1).copied().unwrap_or(0);
                    let vstart = if self.groups.tp.is_some() {
                        u64::from(self.tp_index) * vl
                    } else {
                        0
                    };
                    let dl = self.b.alloc(
                        self.name(node, "dlogits", mb),
                        shape,
                        BufferKind::ActivationGrad,
                    );
                    let op = Op::CeGrad {
                        vocab_start: vstart,
                        vocab_local: vl,
                        scale: self.loss_scale(),
                    };
                    self.b.compute(
                        op,
                        &[logits, targets, mx, se],
                        &[dl],
                        Some(node),
                        Phase::Backward,
                    );
                    Some(dl)
                } else {
                    None
                }
            }
            (LayerKind::Embedding { vocab, dim }, Some(dy)) => {
                let dyf = self.sp_gather_grad(dy, *dim, self.name(node, "dyg", mb), node);
                self.b.release(dy);
                let split = self.groups.tp.is_some();
                let vl = if split { vocab / tp } else { *vocab };
                if let (Some(tokens), Some(g)) = (sv(0), self.grad(node, "weight")) {
                    let op = Op::EmbeddingBwd {
                        vocab_start: u64::from(self.tp_index) * vl * u64::from(split),
                        vocab_local: vl,
                        dim: *dim,
                    };
                    self.b
                        .compute(op, &[tokens, dyf], &[g], Some(node), Phase::Backward);
                }
                self.grad_used(node, "weight");
                self.b.release(dyf);
                None
            }
            (LayerKind::PositionEmbedding { dim, .. }, Some(dy)) => {
                if let Some(g) = self.grad(node, "weight") {
                    let op = Op::PositionAddBwd {
                        batch: self.micro_batch,
                        dim: *dim,
                        positions: self.sp_positions.clone(),
                    };
                    self.b.compute(op, &[dy], &[g], Some(node), Phase::Backward);
                }
                self.grad_used(node, "weight");
                Some(dy)
            }
            (LayerKind::LayerNorm { dim, bias, .. }, Some(dy)) => {
                let dx = self.b.alloc(
                    self.name(node, "dx", mb),
                    self.b.shape(dy),
                    BufferKind::ActivationGrad,
                );
                let w = self.weight(node, "weight");
                let mut outs = vec![dx];
                outs.extend(self.grad(node, "weight"));
                if *bias {
                    outs.extend(self.grad(node, "bias"));
                }
                if let (Some(x), Some(mean), Some(rstd), Some(w)) = (sv(0), sv(1), sv(2), w) {
                    let op = Op::LayerNormBwd {
                        dim: *dim,
                        bias: *bias,
                    };
                    self.b.compute(
                        op,
                        &[dy, x, w, mean, rstd],
                        &outs,
                        Some(node),
                        Phase::Backward,
                    );
                }
                self.grad_used(node, "weight");
                if *bias {
                    self.grad_used(node, "bias");
                }
                self.b.release(dy);
                Some(dx)
            }
            (LayerKind::RmsNorm { dim, .. }, Some(dy)) => {
                let dx = self.b.alloc(
                    self.name(node, "dx", mb),
                    self.b.shape(dy),
                    BufferKind::ActivationGrad,
                );
                let w = self.weight(node, "weight");
                let mut outs = vec![dx];
                outs.extend(self.grad(node, "weight"));
                if let (Some(x), Some(rstd), Some(w)) = (sv(0), sv(1), w) {
                    self.b.compute(
                        Op::RmsNormBwd { dim: *dim },
                        &[dy, x, w, rstd],
                        &outs,
                        Some(node),
                        Phase::Backward,
                    );
                }
                self.grad_used(node, "weight");
                self.b.release(dy);
                Some(dx)
            }
            (
                LayerKind::Linear {
                    in_dim,
                    out_dim,
                    bias,
                    ..
                },
                Some(dy),
            ) => {
                let split = self.groups.tp.is_some();
                let ol = if split { out_dim / tp } else { *out_dim };
                let dxp = self.matmul_backward(
                    mb,
                    node,
                    dy,
                    sv(0),
                    ("weight", if *bias { Some("bias") } else { None }),
                    (*in_dim, ol),
                    rows,
                );
                self.b.release(dy);
                let name = self.name(node, "dx", mb);
                dxp.map(|d| self.tp_reduce(d, *in_dim, name, BufferKind::ActivationGrad, node))
            }
            (LayerKind::Attention { .. }, Some(dy)) => {
                let shape = AttnShape::of(&kind, tp);
                shape.and_then(|s| self.attention_backward(mb, node, dy, &saved, s))
            }
            (
                LayerKind::Mlp {
                    dim,
                    hidden,
                    act,
                    bias,
                },
                Some(dy),
            ) => self.mlp_backward(mb, node, dy, &saved, (*dim, hidden / tp), *act, *bias),
            (LayerKind::Add, Some(dy)) => {
                if let Some(second) = inputs.get(1) {
                    let copy = self.b.alloc(
                        self.name(node, "dx2", mb),
                        self.b.shape(dy),
                        BufferKind::ActivationGrad,
                    );
                    self.b
                        .compute(Op::Copy, &[dy], &[copy], Some(node), Phase::Backward);
                    self.contribute(mb, *second, copy, node);
                }
                Some(dy)
            }
            (_, None) => None,
        };
        for s in saved {
            self.b.release(s);
        }
        self.end_node();
        if let Some(dx) = dx {
            match inputs.first() {
                Some(v) if *v != self.spec.model.tokens && *v != self.spec.model.targets => {
                    self.contribute(mb, *v, dx, node);
                }
                _ => self.b.release(dx),
            }
        }
    }

    /// dx = dy W (returned, full rows), dW (+db) accumulated. `x` is the saved input.
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        dy: BufferId,
        x: Option<BufferId>,
        (w, b): (&'static str, Option<&'static str>),
        (in_dim, out_dim): (u64, u64),
        rows: u64,
    ) -> Option<BufferId> {
        let wbuf = self.weight(node, w)?;
        let dx = self.b.alloc(
            self.name(node, &format!("d{w}_in"), mb),
            vec![rows, in_dim],
            BufferKind::ActivationGrad,
        );
        self.b.compute(
            Op::MatmulBwdData { in_dim, out_dim },
            &[dy, wbuf],
            &[dx],
            Some(node),
            Phase::Backward,
        );
        let bias = b.is_some_and(|b| self.adds_bias(node, b));
        let mut outs = Vec::new();
        outs.extend(self.grad(node, w));
        if let (true, Some(bn)) = (bias, b) {
            outs.extend(self.grad(node, bn));
        }
        if let Some(x) = x {
            self.b.compute(
                Op::MatmulBwdWeight {
                    in_dim,
                    out_dim,
                    bias,
                },
                &[dy, x],
                &outs,
                Some(node),
                Phase::Backward,
            );
        }
        self.grad_used(node, w);
        if let Some(bn) = b {
            self.grad_used(node, bn);
        }
        Some(dx)
    }

    fn attention_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        dy: BufferId,
        saved: &[BufferId],
        s: AttnShape,
    ) -> Option<BufferId> {
        let rows = self.rows_full();
        let (q_cols, kv_cols) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let (xf, q, k, v) = (saved.first()?, saved.get(1)?, saved.get(2)?, saved.get(3)?);
        let (xf, q, k, v) = (*xf, *q, *k, *v);
        let (o, lse, recomputed) = match (saved.get(4), saved.get(5)) {
            (Some(o), Some(lse)) => (*o, *lse, false),
            _ => {
                let (o, lse) = self.attention_core(mb, node, (q, k, v), &s, Phase::Recompute);
                (o, lse, true)
            }
        };
        let dyf = self.sp_gather_grad(dy, s.dim, self.name(node, "dyg", mb), node);
        self.b.release(dy);
        let bias = |n: &'static str| if s.bias { Some(n) } else { None };
        let d_o = self.matmul_backward(
            mb,
            node,
            dyf,
            Some(o),
            ("wo", bias("bo")),
            (q_cols, s.dim),
            rows,
        );
        self.b.release(dyf);
        let d_o = d_o?;
        let k_rows = self.b.shape(k).first().copied().unwrap_or(0);
        let dq = self.b.alloc(
            self.name(node, "dq", mb),
            vec![rows, q_cols],
            BufferKind::ActivationGrad,
        );
        let dk = self.b.alloc(
            self.name(node, "dk", mb),
            vec![k_rows, kv_cols],
            BufferKind::ActivationGrad,
        );
        let dv = self.b.alloc(
            self.name(node, "dv", mb),
            vec![k_rows, kv_cols],
            BufferKind::ActivationGrad,
        );
        let op = self.attention_op(&s, true);
        self.b.compute(
            op,
            &[d_o, q, k, v, o, lse],
            &[dq, dk, dv],
            Some(node),
            Phase::Backward,
        );
        self.b.release(d_o);
        if recomputed {
            self.b.release(o);
            self.b.release(lse);
        }
        let (dk, dv) = match self.groups.cp {
            None => (dk, dv),
            Some(g) => {
                let mut local = Vec::new();
                for (d, what) in [(dk, "dk_local"), (dv, "dv_local")] {
                    let l = self.b.alloc(
                        self.name(node, what, mb),
                        vec![rows, kv_cols],
                        BufferKind::ActivationGrad,
                    );
                    self.b
                        .collective(CollectiveKind::ReduceScatter, g, d, l, Some(node));
                    self.b.release(d);
                    local.push(l);
                }
                (local[0], local[1])
            }
        };
        let (dq, dk) = match s.theta {
            None => (dq, dk),
            Some(theta) => (
                self.rope(mb, node, dq, s.heads, s.head_dim, theta, "dq_pre", true),
                self.rope(mb, node, dk, s.kv_heads, s.head_dim, theta, "dk_pre", true),
            ),
        };
        let parts = [
            (dq, "wq", bias("bq"), q_cols),
            (dk, "wk", bias("bk"), kv_cols),
            (dv, "wv", bias("bv"), kv_cols),
        ];
        let mut dx: Option<BufferId> = None;
        for (d, w, b, cols) in parts {
            let part = self.matmul_backward(mb, node, d, Some(xf), (w, b), (s.dim, cols), rows);
            self.b.release(d);
            let Some(part) = part else { continue };
            dx = Some(match dx {
                None => part,
                Some(acc) => {
                    let sum = self.b.alloc(
                        self.name(node, &format!("dx_{w}"), mb),
                        vec![rows, s.dim],
                        BufferKind::ActivationGrad,
                    );
                    self.b
                        .compute(Op::Add, &[acc, part], &[sum], Some(node), Phase::Backward);
                    self.b.release(acc);
                    self.b.release(part);
                    sum
                }
            });
        }
        let name = self.name(node, "dx", mb);
        dx.map(|d| self.tp_reduce(d, s.dim, name, BufferKind::ActivationGrad, node))
    }

    #[allow(clippy::too_many_arguments)]
    fn mlp_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        dy: BufferId,
        saved: &[BufferId],
        (dim, hl): (u64, u64),
        a: Activation,
        bias: bool,
    ) -> Option<BufferId> {
        let rows = self.rows_full();
        let dyf = self.sp_gather_grad(dy, dim, self.name(node, "dyg", mb), node);
        self.b.release(dy);
        let xf = *saved.first()?;
        let act_out = *saved.last()?;
        let bias_of = |n: &'static str| if bias { Some(n) } else { None };
        let out_w = if a == Activation::Swiglu {
            "down"
        } else {
            "proj"
        };
        let out_b = if a == Activation::Swiglu {
            None
        } else {
            bias_of("proj_bias")
        };
        let da = self.matmul_backward(
            mb,
            node,
            dyf,
            Some(act_out),
            (out_w, out_b),
            (hl, dim),
            rows,
        );
        self.b.release(dyf);
        let da = da?;
        let dxp = if a == Activation::Swiglu {
            let (g, u) = (*saved.get(1)?, *saved.get(2)?);
            let dg = self.b.alloc(
                self.name(node, "dg", mb),
                vec![rows, hl],
                BufferKind::ActivationGrad,
            );
            let du = self.b.alloc(
                self.name(node, "du", mb),
                vec![rows, hl],
                BufferKind::ActivationGrad,
            );
            self.b.compute(
                Op::SwiGluBwd,
                &[da, g, u],
                &[dg, du],
                Some(node),
                Phase::Backward,
            );
            self.b.release(da);
            let xg = self.matmul_backward(mb, node, dg, Some(xf), ("gate", None), (dim, hl), rows);
            self.b.release(dg);
            let xu = self.matmul_backward(mb, node, du, Some(xf), ("up", None), (dim, hl), rows);
            self.b.release(du);
            let (xg, xu) = (xg?, xu?);
            let sum = self.b.alloc(
                self.name(node, "dx_sum", mb),
                vec![rows, dim],
                BufferKind::ActivationGrad,
            );
            self.b
                .compute(Op::Add, &[xg, xu], &[sum], Some(node), Phase::Backward);
            self.b.release(xg);
            self.b.release(xu);
            sum
        } else {
            let h = *saved.get(1)?;
            let dh = self.b.alloc(
                self.name(node, "dh", mb),
                vec![rows, hl],
                BufferKind::ActivationGrad,
            );
            let op_act = match a {
                Activation::Gelu => Act::Gelu,
                Activation::GeluTanh => Act::GeluTanh,
                Activation::Relu | Activation::Swiglu => Act::Relu,
            };
            self.b.compute(
                Op::ActivationBwd { act: op_act },
                &[da, h],
                &[dh],
                Some(node),
                Phase::Backward,
            );
            self.b.release(da);
            let dx = self.matmul_backward(
                mb,
                node,
                dh,
                Some(xf),
                ("fc", bias_of("fc_bias")),
                (dim, hl),
                rows,
            );
            self.b.release(dh);
            dx?
        };
        let name = self.name(node, "dx", mb);
        Some(self.tp_reduce(dxp, dim, name, BufferKind::ActivationGrad, node))
    }
}
