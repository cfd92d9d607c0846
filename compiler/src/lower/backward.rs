//! Backward of every layer kind: the gradient of each input from the gradient of the output
//! and the saved tensors, and the (accumulated) gradients of the layer's parameters. See
//! `layers` for the parallel conjugates.

use super::act_kernels;
use super::emitter::Emitter;
use super::layers::AttnShape;
use crate::fp8::GemmLayout;
use crate::ir::op::{Act, ActAttrs, EmbeddingAttrs, Op, PositionAttrs};
use crate::ir::{BufferId, BufferKind, CollectiveKind, Phase};
use crate::kir::func::ExprFn;
use crate::spec::{Activation, LayerKind, NodeId, ValueId};

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
        LayerKind::Attention { .. } => matches!(local, "wqkv" | "wo" | "q_norm" | "k_norm"),
        LayerKind::Mlp { .. } => matches!(local, "fc" | "proj" | "gate" | "up" | "down"),
        LayerKind::Add | LayerKind::Elementwise { .. } | LayerKind::CrossEntropy => false,
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
                    self.skip_unreached(node, saved);
                    return;
                }
            }
        };
        self.phase = Phase::Backward;
        let dx = self.backward_of_kind(mb, node, (&kind, &inputs), dy, &saved);
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

    /// Emits nothing for a node whose output does not reach the loss: releases its saved
    /// tensors and marks its parameters' gradients used.
    fn skip_unreached(&mut self, node: NodeId, saved: Vec<BufferId>) {
        for s in saved {
            self.b.release(s);
        }
        let locals: Vec<&'static str> = self.params.slots(node).iter().map(|s| s.local).collect();
        for l in locals {
            self.grad_used(node, l);
        }
    }

    /// Emits the backward ops of a `kind` node with inputs `inputs` from its output's gradient
    /// `dy`; returns its first input's gradient still to be contributed.
    fn backward_of_kind(
        &mut self,
        mb: u32,
        node: NodeId,
        (kind, inputs): (&LayerKind, &[ValueId]),
        dy: Option<BufferId>,
        saved: &[BufferId],
    ) -> Option<BufferId> {
        let tp = u64::from(self.tp);
        match (kind, dy) {
            (LayerKind::CrossEntropy, _) => self.cross_entropy_backward(mb, node, saved),
            (LayerKind::Embedding { vocab, dim }, Some(dy)) => {
                self.embedding_backward(mb, node, dy, (*vocab, *dim), saved.first().copied());
                None
            }
            (LayerKind::PositionEmbedding { dim, .. }, Some(dy)) => {
                self.position_embedding_backward(node, dy, *dim);
                Some(dy)
            }
            (LayerKind::LayerNorm { dim, bias, .. }, Some(dy)) => {
                self.norm_backward(mb, node, (dy, inputs.first()), saved, (*dim, Some(*bias)))
            }
            (LayerKind::RmsNorm { dim, .. }, Some(dy)) => {
                self.norm_backward(mb, node, (dy, inputs.first()), saved, (*dim, None))
            }
            (
                LayerKind::Linear {
                    in_dim,
                    out_dim,
                    bias,
                    ..
                },
                Some(dy),
            ) => self.linear_backward(
                mb,
                node,
                (dy, inputs.first()),
                saved.first().copied(),
                (*in_dim, *out_dim, *bias),
            ),
            (LayerKind::Attention { .. }, Some(dy)) => {
                let shape = AttnShape::of(kind, tp);
                shape.and_then(|s| self.attention_backward(mb, node, dy, saved, s))
            }
            (
                LayerKind::Mlp {
                    dim,
                    hidden,
                    act,
                    bias,
                },
                Some(dy),
            ) => {
                let shape = (*dim, hidden / tp);
                let input = inputs.first();
                self.mlp_backward(mb, node, (dy, input), saved, shape, act, *bias)
            }
            (LayerKind::Add, Some(dy)) => {
                if let Some(second) = inputs.get(1) {
                    self.add_backward_second(mb, node, dy, *second);
                }
                Some(dy)
            }
            (LayerKind::Elementwise { f, .. }, Some(dy)) => {
                self.elementwise_backward(mb, node, (dy, inputs), saved, f)
            }
            (_, None) => None,
        }
    }

    /// The backward of `y = f(x1, …)`: one generated kernel `dy, x1, … → dx1, …` (derived
    /// symbolically). A generated kernel overwrites its outputs, so each gradient is a fresh
    /// buffer; every input but the first is contributed here (summed with an `Add` into a
    /// gradient already there), the first is returned for the caller to contribute.
    fn elementwise_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        (dy, inputs): (BufferId, &[ValueId]),
        saved: &[BufferId],
        f: &ExprFn,
    ) -> Option<BufferId> {
        let shape = self.b.shape(dy);
        let cols = shape.get(1).copied().unwrap_or(0);
        let kernel = act_kernels::elementwise_backward(f, cols);
        let attrs = match (saved.len() == f.params.len(), self.act_kernel(node, kernel)) {
            (true, Some(a)) => a,
            _ => {
                self.b.release(dy);
                return None;
            }
        };
        let mut ins = vec![dy];
        ins.extend_from_slice(saved);
        let dxs: Vec<BufferId> = (0..saved.len())
            .map(|i| {
                let what = if i == 0 {
                    "dx".to_string()
                } else {
                    format!("dx{}", i + 1)
                };
                self.activation_grad(node, &what, mb, shape.clone())
            })
            .collect();
        self.b
            .compute(Op::Fused(attrs), &ins, &dxs, Some(node), Phase::Backward);
        self.b.release(dy);
        for (&v, &dx) in inputs.iter().zip(&dxs).skip(1) {
            self.contribute(mb, v, dx, node);
        }
        dxs.first().copied()
    }

    /// The loss's backward: dlogits (`CeGrad` from the saved logits, targets, max and sum of
    /// exponentials, or the fused loss's dlogits already in the logits buffer).
    fn cross_entropy_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        saved: &[BufferId],
    ) -> Option<BufferId> {
        let sv = |i: usize| saved.get(i).copied();
        // The fused loss left dlogits in the logits buffer: it becomes the gradient (held once
        // more, as the saved list's hold is released by the caller).
        if self.fuses_loss(node) {
            let dlogits = sv(0);
            if let Some(d) = dlogits {
                self.b.retain(d);
            }
            return dlogits;
        }
        let (Some(logits), Some(targets), Some(mx), Some(se)) = (sv(0), sv(1), sv(2), sv(3)) else {
            return None;
        };
        let shape = self.b.shape(logits);
        let vl = shape.get(1).copied().unwrap_or(0);
        let vstart = if self.groups.tp.is_some() {
            u64::from(self.tp_index) * vl
        } else {
            0
        };
        let dl = self.activation_grad(node, "dlogits", mb, shape);
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
    }

    /// The token embedding's backward: `EmbeddingBwd` scatters the (sp-gathered) dy into the
    /// weight's gradient rows of `tokens`; it consumes dy.
    fn embedding_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        dy: BufferId,
        (vocab, dim): (u64, u64),
        tokens: Option<BufferId>,
    ) {
        let tp = u64::from(self.tp);
        let dyf = self.sp_gather_grad(dy, dim, self.name(node, "dyg", mb), node);
        self.b.release(dy);
        let split = self.groups.tp.is_some();
        let vl = if split { vocab / tp } else { vocab };
        if let (Some(tokens), Some(g)) = (tokens, self.grad(node, "weight")) {
            let op = Op::EmbeddingBwd(EmbeddingAttrs {
                vocab_start: u64::from(self.tp_index) * vl * u64::from(split),
                vocab_local: vl,
                dim,
            });
            self.b
                .compute(op, &[tokens, dyf], &[g], Some(node), Phase::Backward);
        }
        self.grad_used(node, "weight");
        self.b.release(dyf);
    }

    /// The position embedding's backward: `PositionAddBwd` adds dy into the weight's gradient
    /// at this rank's positions (dy itself passes on to the input).
    fn position_embedding_backward(&mut self, node: NodeId, dy: BufferId, dim: u64) {
        if let Some(g) = self.grad(node, "weight") {
            let op = Op::PositionAddBwd {
                pos: PositionAttrs {
                    batch: self.micro_batch,
                    dim,
                    positions: self.sp_positions.clone(),
                },
                accumulate_param_grad: true,
            };
            self.b.compute(op, &[dy], &[g], Some(node), Phase::Backward);
        }
        self.grad_used(node, "weight");
    }

    /// A norm's backward: one `LayerNormBwd` (`layer` = Some(its bias flag); saved x, mean,
    /// rstd) or `RmsNormBwd` (None; saved x, rstd) writing dx (see [`Emitter::norm_dx`]) and
    /// the weight's (and bias's) gradients; it consumes dy.
    fn norm_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        (dy, input): (BufferId, Option<&ValueId>),
        saved: &[BufferId],
        (dim, layer): (u64, Option<bool>),
    ) -> Option<BufferId> {
        let bias = layer == Some(true);
        let (dx, accumulate) = self.norm_dx(mb, node, input, dy);
        let w = self.weight(node, "weight");
        let mut outs = vec![dx];
        outs.extend(self.grad(node, "weight"));
        if bias {
            outs.extend(self.grad(node, "bias"));
        }
        // x, then the statistics: mean and rstd (LayerNorm) or rstd alone.
        let stats = if layer.is_some() { 2 } else { 1 };
        if let (Some(&x), Some(stats), Some(w)) = (saved.first(), saved.get(1..1 + stats), w) {
            let mut ins = vec![dy, x, w];
            ins.extend_from_slice(stats);
            let op = match layer {
                Some(bias) => Op::LayerNormBwd {
                    dim,
                    bias,
                    accumulate,
                    accumulate_param_grad: true,
                },
                None => Op::RmsNormBwd {
                    dim,
                    accumulate,
                    accumulate_param_grad: true,
                },
            };
            self.b.compute(op, &ins, &outs, Some(node), Phase::Backward);
        }
        self.grad_used(node, "weight");
        if bias {
            self.grad_used(node, "bias");
        }
        self.b.release(dy);
        (!accumulate).then_some(dx)
    }

    /// A linear layer's backward: [`Emitter::matmul_backward`] from the saved input `x`, then
    /// the tp reduction of a partial dx; it consumes dy.
    fn linear_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        (dy, input): (BufferId, Option<&ValueId>),
        x: Option<BufferId>,
        (in_dim, out_dim, bias): (u64, u64, bool),
    ) -> Option<BufferId> {
        let rows = self.rows_full();
        let tp = u64::from(self.tp);
        let split = self.groups.tp.is_some();
        let ol = if split { out_dim / tp } else { out_dim };
        // Without tp, dx is complete as computed and may add into the input's gradient; a tp
        // partial sum is reduced first and then contributed.
        let into = self.unreduced_target(mb, input, &[rows, in_dim]);
        let xf = x.map(|x| self.sp_regather(x, self.name(node, "xrg", mb), node));
        let dxp = self.matmul_backward(
            mb,
            node,
            dy,
            xf,
            ("weight", if bias { Some("bias") } else { None }),
            (in_dim, ol),
            rows,
            (into, None),
        );
        self.b.release(dy);
        if let Some(xf) = xf {
            self.b.release(xf);
        }
        let name = self.name(node, "dx", mb);
        match into {
            Some(_) => None,
            None => dxp.map(|d| self.tp_reduce(d, in_dim, name, BufferKind::ActivationGrad, node)),
        }
    }

    /// An `Add`'s gradient for its second input: dy itself, held once more, or (without
    /// in-place accumulation) a `Copy` of it; contributed at once.
    fn add_backward_second(&mut self, mb: u32, node: NodeId, dy: BufferId, second: ValueId) {
        // Both inputs get dy itself, held twice: while either branch still reads it, nothing
        // adds into it (`accumulation_target` needs a single holder).
        let dx2 = if self.accumulate_in_place {
            self.b.retain(dy);
            dy
        } else {
            let copy = self.activation_grad(node, "dx2", mb, self.b.shape(dy));
            self.b
                .compute(Op::Copy, &[dy], &[copy], Some(node), Phase::Backward);
            copy
        };
        self.contribute(mb, second, dx2, node);
    }

    /// dx = dy W, dW (+db) accumulated. `x` is the saved input. dx goes into a fresh buffer
    /// (returned with one holder, full rows), or, given `into`, is added into that buffer
    /// (returned; the caller keeps its holder).
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
        (into, act_grad): (Option<BufferId>, Option<(Act, BufferId)>),
    ) -> Option<BufferId> {
        let wbuf = self.weight(node, w)?;
        let mut ins = vec![dy, wbuf];
        ins.extend(act_grad.map(|(_, pre)| pre));
        let dx = match into {
            Some(acc) => acc,
            None => self.activation_grad(node, &format!("d{w}_in"), mb, vec![rows, in_dim]),
        };
        let f8 = self.fp8_gemm((mb, node, w), GemmLayout::BwdData, &ins, Phase::Backward);
        ins.extend(&f8.amax);
        self.b.compute(
            Op::MatmulBwdData {
                in_dim,
                out_dim,
                accumulate: into.is_some(),
                act_grad: act_grad.map(|(act, _)| act),
                swiglu: false,
                fp8: f8.attr,
            },
            &ins,
            &[dx],
            Some(node),
            Phase::Backward,
        );
        self.fp8_done(f8);
        self.weight_backward(mb, node, dy, x, (w, b), (in_dim, out_dim));
        Some(dx)
    }

    /// The down projection's backward of a SwiGLU MLP with the gated product's gradient in its
    /// backward-data GEMM (`fuses_swiglu`): dgate and dup (fresh, one holder each) from dy, the
    /// saved gate `g` and up `u`, then dW from the saved input `x` (silu(g) ⊙ u).
    #[allow(clippy::too_many_arguments)]
    fn swiglu_down_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        dy: BufferId,
        x: BufferId,
        (g, u): (BufferId, BufferId),
        (in_dim, out_dim): (u64, u64),
        rows: u64,
    ) -> Option<(BufferId, BufferId)> {
        let w = self.weight(node, "down")?;
        let dg = self.activation_grad(node, "dg", mb, vec![rows, in_dim]);
        let du = self.activation_grad(node, "du", mb, vec![rows, in_dim]);
        let mut ins = vec![dy, w];
        let f8 = self.fp8_gemm(
            (mb, node, "down"),
            GemmLayout::BwdData,
            &ins,
            Phase::Backward,
        );
        // gate and up follow dy and W, before any FP8 amax inputs (the op table's order).
        ins.extend([g, u]);
        ins.extend(&f8.amax);
        let op = Op::MatmulBwdData {
            in_dim,
            out_dim,
            accumulate: false,
            act_grad: None,
            swiglu: true,
            fp8: f8.attr,
        };
        self.b
            .compute(op, &ins, &[dg, du], Some(node), Phase::Backward);
        self.fp8_done(f8);
        self.weight_backward(mb, node, dy, Some(x), ("down", None), (in_dim, out_dim));
        Some((dg, du))
    }

    /// dW (+db) of a linear layer accumulated from dy and its saved input `x` (none: only the
    /// gradients are marked used, as for a layer whose input needs no weight gradient here).
    fn weight_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        dy: BufferId,
        x: Option<BufferId>,
        (w, b): (&'static str, Option<&'static str>),
        (in_dim, out_dim): (u64, u64),
    ) {
        let bias = b.is_some_and(|b| self.adds_bias(node, b));
        let mut outs = Vec::new();
        outs.extend(self.grad(node, w));
        if let (true, Some(bn)) = (bias, b) {
            outs.extend(self.grad(node, bn));
        }
        if let Some(x) = x {
            let mut ins = vec![dy, x];
            let f8 = self.fp8_gemm((mb, node, w), GemmLayout::BwdWeight, &ins, Phase::Backward);
            ins.extend(&f8.amax);
            self.b.compute(
                Op::MatmulBwdWeight {
                    in_dim,
                    out_dim,
                    bias,
                    accumulate_param_grad: true,
                    fp8: f8.attr,
                },
                &ins,
                &outs,
                Some(node),
                Phase::Backward,
            );
            self.fp8_done(f8);
        }
        self.grad_used(node, w);
        if let Some(bn) = b {
            self.grad_used(node, bn);
        }
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
        // Saved: xf, then qkv (packed) or q, k, v (and under qk_norm q and k as projected
        // with their rstd), then o and lse unless selective.
        let packed = self.packs_qkv(&s);
        let xf = *saved.first()?;
        let n_in = self.saved_qkv_len(&s);
        let split: Vec<BufferId> = saved.get(1..1 + n_in)?.to_vec();
        let qkv = split.get(..n_in.min(3))?;
        let (o, lse, recomputed) = match (saved.get(1 + n_in), saved.get(2 + n_in)) {
            (Some(o), Some(lse)) => (*o, *lse, false),
            _ => {
                let (o, lse) = self.attention_core(mb, node, qkv, &s, Phase::Recompute);
                (o, lse, true)
            }
        };
        let dyf = self.sp_gather_grad(dy, s.dim, self.name(node, "dyg", mb), node);
        self.b.release(dy);
        let xf = self.sp_regather(xf, self.name(node, "xrg", mb), node);
        let d_o = self.matmul_backward(
            mb,
            node,
            dyf,
            Some(o),
            ("wo", s.out_bias.then_some("bo")),
            (q_cols, s.dim),
            rows,
            (None, None),
        );
        self.b.release(dyf);
        let d_o = d_o?;
        let qkv_cols = q_cols + 2 * kv_cols;
        let op = self.attention_op(&s, true, packed);
        let dqkv = if packed {
            let dqkv = self.activation_grad(node, "dqkv", mb, vec![rows, qkv_cols]);
            let ins = [d_o, *qkv.first()?, o, lse];
            self.b
                .compute(op, &ins, &[dqkv], Some(node), Phase::Backward);
            self.b.release(d_o);
            dqkv
        } else {
            let (q, k, v) = (*qkv.first()?, *qkv.get(1)?, *qkv.get(2)?);
            let norm = split
                .get(3..7)
                .and_then(|n| <[BufferId; 4]>::try_from(n).ok());
            self.attention_grads_split(mb, node, op, ([d_o, q, k, v, o, lse], norm), &s)
        };
        if recomputed {
            self.b.release(o);
            self.b.release(lse);
        }
        let dx = self.matmul_backward(
            mb,
            node,
            dqkv,
            Some(xf),
            ("wqkv", s.qkv_bias.then_some("bqkv")),
            (s.dim, qkv_cols),
            rows,
            (None, None),
        );
        self.b.release(dqkv);
        self.b.release(xf);
        let name = self.name(node, "dx", mb);
        dx.map(|d| self.tp_reduce(d, s.dim, name, BufferKind::ActivationGrad, node))
    }

    /// Attention's backward on separate q, k, v (consumes `d_o`, the first of `ins`): dk and dv
    /// reduce-scattered back over context parallelism, dq and dk un-rotated under rope and
    /// taken back through their per-head norms under qk_norm (`norm`: q and k as projected,
    /// each with its rstd), then joined into one `[rows, q + 2 kv]` gradient of the fused
    /// projection's output.
    fn attention_grads_split(
        &mut self,
        mb: u32,
        node: NodeId,
        op: Op,
        (ins, norm): ([BufferId; 6], Option<[BufferId; 4]>),
        s: &AttnShape,
    ) -> BufferId {
        let rows = self.rows_full();
        let (q_cols, kv_cols) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let [d_o, _, k, ..] = ins;
        let k_rows = self.b.shape(k).first().copied().unwrap_or(0);
        let dq = self.activation_grad(node, "dq", mb, vec![rows, q_cols]);
        let dk = self.activation_grad(node, "dk", mb, vec![k_rows, kv_cols]);
        let dv = self.activation_grad(node, "dv", mb, vec![k_rows, kv_cols]);
        self.b
            .compute(op, &ins, &[dq, dk, dv], Some(node), Phase::Backward);
        self.b.release(d_o);
        let (dk, dv) = match self.groups.cp {
            None => (dk, dv),
            Some(g) => {
                let mut local = Vec::new();
                for (d, what) in [(dk, "dk_local"), (dv, "dv_local")] {
                    let l = self.activation_grad(node, what, mb, vec![rows, kv_cols]);
                    self.b
                        .collective(CollectiveKind::ReduceScatter, g, d, l, Some(node));
                    self.b.release(d);
                    local.push(l);
                }
                (local[0], local[1])
            }
        };
        let (dq, dk) = match s.rope {
            None => (dq, dk),
            Some(rope) => (
                self.rope(mb, node, dq, s.heads, s.head_dim, rope, "dq_pre", true),
                self.rope(mb, node, dk, s.kv_heads, s.head_dim, rope, "dk_pre", true),
            ),
        };
        let (dq, dk) = match norm {
            Some([q, q_rstd, k, k_rstd]) => (
                self.head_norm_backward(mb, node, dq, (q, q_rstd), ("q_norm", "dq_proj"), s),
                self.head_norm_backward(mb, node, dk, (k, k_rstd), ("k_norm", "dk_proj"), s),
            ),
            None => (dq, dk),
        };
        let dqkv = self.activation_grad(node, "dqkv", mb, vec![rows, q_cols + 2 * kv_cols]);
        let widths = vec![q_cols, kv_cols, kv_cols];
        self.b.compute(
            Op::ConcatColumns { widths },
            &[dq, dk, dv],
            &[dqkv],
            Some(node),
            Phase::Backward,
        );
        for d in [dq, dk, dv] {
            self.b.release(d);
        }
        dqkv
    }

    /// The backward of [`Emitter::head_norm`] (consumes `dy`): the gradient of the projected
    /// `x` from its saved value and rstd, the shared weight `local`'s gradient added over
    /// every head and row. Under tp each rank adds its own heads' part: the gradient is
    /// all-reduced over tp when complete (`TpRule::PerHead`).
    fn head_norm_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        dy: BufferId,
        (x, rstd): (BufferId, BufferId),
        (local, what): (&str, &str),
        s: &AttnShape,
    ) -> BufferId {
        let dx = self.activation_grad(node, what, mb, self.b.shape(dy));
        let w = self.weight(node, local);
        match (w, self.grad(node, local)) {
            (Some(w), Some(dw)) => {
                let op = Op::RmsNormBwd {
                    dim: s.head_dim,
                    accumulate: false,
                    accumulate_param_grad: true,
                };
                self.b.compute(
                    op,
                    &[dy, x, w, rstd],
                    &[dx, dw],
                    Some(node),
                    Phase::Backward,
                );
            }
            _ => self.missing(node, local),
        }
        self.grad_used(node, local);
        self.b.release(dy);
        dx
    }

    #[allow(clippy::too_many_arguments)]
    fn mlp_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        (dy, input): (BufferId, Option<&ValueId>),
        saved: &[BufferId],
        (dim, hl): (u64, u64),
        a: &Activation,
        bias: bool,
    ) -> Option<BufferId> {
        let rows = self.rows_full();
        // Built first: a kernel that cannot be built stops here, before any buffer exists.
        let Some(act_op) = self.act_backward_op(node, a, hl) else {
            self.b.release(dy);
            return None;
        };
        let dyf = self.sp_gather_grad(dy, dim, self.name(node, "dyg", mb), node);
        self.b.release(dy);
        let xf = self.sp_regather(*saved.first()?, self.name(node, "xrg", mb), node);
        let act_out = *saved.last()?;
        let bias_of = |n: &'static str| if bias { Some(n) } else { None };
        let out_w = if a.is_gated() { "down" } else { "proj" };
        let out_b = if a.is_gated() {
            None
        } else {
            bias_of("proj_bias")
        };
        let op_act = super::layers::act(a);
        // Fused (`fuses_activation`): the product is multiplied by act'(h) as it is written,
        // so it is h's gradient directly.
        let fused = self.fuses_activation(a);
        if *a == Activation::Swiglu && self.fuses_swiglu() {
            let (g, u) = (*saved.get(1)?, *saved.get(2)?);
            let dims = (hl, dim);
            let grads = self.swiglu_down_backward(mb, node, dyf, act_out, (g, u), dims, rows);
            self.b.release(dyf);
            let dxp = self.gated_input_backward(mb, node, xf, grads?, (dim, hl), rows)?;
            let name = self.name(node, "dx", mb);
            return Some(self.tp_reduce(dxp, dim, name, BufferKind::ActivationGrad, node));
        }
        let act_grad = match (fused, saved.get(1)) {
            (true, Some(&h)) => Some((op_act, h)),
            _ => None,
        };
        let da = self.matmul_backward(
            mb,
            node,
            dyf,
            Some(act_out),
            (out_w, out_b),
            (hl, dim),
            rows,
            (None, act_grad),
        );
        self.b.release(dyf);
        let da = da?;
        let dxp = if a.is_gated() {
            let (g, u) = (*saved.get(1)?, *saved.get(2)?);
            let dg = self.activation_grad(node, "dg", mb, vec![rows, hl]);
            let du = self.activation_grad(node, "du", mb, vec![rows, hl]);
            self.b
                .compute(act_op, &[da, g, u], &[dg, du], Some(node), Phase::Backward);
            self.b.release(da);
            self.gated_input_backward(mb, node, xf, (dg, du), (dim, hl), rows)?
        } else {
            let dh = if fused {
                da
            } else {
                let h = *saved.get(1)?;
                let dh = self.activation_grad(node, "dh", mb, vec![rows, hl]);
                self.b
                    .compute(act_op, &[da, h], &[dh], Some(node), Phase::Backward);
                self.b.release(da);
                dh
            };
            // One product makes dx: without tp it may add into the input's gradient.
            let into = self.unreduced_target(mb, input, &[rows, dim]);
            let dx = self.matmul_backward(
                mb,
                node,
                dh,
                Some(xf),
                ("fc", bias_of("fc_bias")),
                (dim, hl),
                rows,
                (into, None),
            );
            self.b.release(dh);
            self.b.release(xf);
            if into.is_some() {
                return None;
            }
            dx?
        };
        let name = self.name(node, "dx", mb);
        Some(self.tp_reduce(dxp, dim, name, BufferKind::ActivationGrad, node))
    }

    /// A gated MLP's input gradient dx = dg Wgate + du Wup (the second product adding into the
    /// first), with both weight gradients; releases dg, du and the gathered input `xf`.
    fn gated_input_backward(
        &mut self,
        mb: u32,
        node: NodeId,
        xf: BufferId,
        (dg, du): (BufferId, BufferId),
        (dim, hl): (u64, u64),
        rows: u64,
    ) -> Option<BufferId> {
        let gate = ("gate", None);
        let xg = self.matmul_backward(mb, node, dg, Some(xf), gate, (dim, hl), rows, (None, None));
        self.b.release(dg);
        let into = xg.filter(|_| self.accumulate_in_place);
        let up = ("up", None);
        let xu = self.matmul_backward(mb, node, du, Some(xf), up, (dim, hl), rows, (into, None));
        self.b.release(du);
        self.b.release(xf);
        let (xg, xu) = (xg?, xu?);
        Some(self.add_part(mb, node, Some(xg), xu, "dx_sum"))
    }

    /// The op of an MLP activation's backward: the hand-written `SwiGluBwd` or `ActivationBwd`,
    /// or the generated kernel of an expression function's derivative (`local_cols` = the local
    /// ffn shard).
    fn act_backward_op(&mut self, node: NodeId, a: &Activation, local_cols: u64) -> Option<Op> {
        Some(match a {
            Activation::Fn(f) => {
                Op::Fused(self.act_kernel(node, act_kernels::backward(f, local_cols))?)
            }
            Activation::Swiglu => Op::SwiGluBwd,
            Activation::Plain(act) => Op::ActivationBwd(ActAttrs { act: *act }),
        })
    }

    /// The buffer a layer's backward writes its input's gradient into with an `LayerNormBwd`
    /// or `RmsNormBwd` shaped like `dy`: `input`'s gradient, added into (true), where
    /// [`Emitter::accumulation_target`] allows it, else a fresh one (false) to contribute.
    fn norm_dx(
        &mut self,
        mb: u32,
        node: NodeId,
        input: Option<&ValueId>,
        dy: BufferId,
    ) -> (BufferId, bool) {
        let shape = self.b.shape(dy);
        match input.and_then(|v| self.accumulation_target(mb, *v, &shape)) {
            Some(grad) => (grad, true),
            None => {
                let name = self.name(node, "dx", mb);
                let dx = self.b.alloc(name, shape, BufferKind::ActivationGrad);
                (dx, false)
            }
        }
    }

    /// [`Emitter::accumulation_target`] for a dx that needs no tp reduction: only without tp
    /// (a partial sum added into the gradient would be all-reduced with it). `shape`: dx's.
    fn unreduced_target(
        &self,
        mb: u32,
        input: Option<&ValueId>,
        shape: &[u64],
    ) -> Option<BufferId> {
        if self.groups.tp.is_some() {
            return None;
        }
        input.and_then(|v| self.accumulation_target(mb, *v, shape))
    }

    /// `acc + part` for a layer summing its input's gradient from several products: `part`
    /// itself when it is the first (`acc` None) or was added into `acc` already, else an `Add`
    /// into a fresh buffer named `what` (consuming both holders).
    fn add_part(
        &mut self,
        mb: u32,
        node: NodeId,
        acc: Option<BufferId>,
        part: BufferId,
        what: &str,
    ) -> BufferId {
        let Some(acc) = acc.filter(|a| *a != part) else {
            return part;
        };
        let sum = self.activation_grad(node, what, mb, self.b.shape(part));
        self.b
            .compute(Op::Add, &[acc, part], &[sum], Some(node), Phase::Backward);
        self.b.release(acc);
        self.b.release(part);
        sum
    }
}
