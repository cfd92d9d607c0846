//! Forward and backward (autodiff at op level) of every layer kind, on local shards.
//!
//! Tensor parallelism is Megatron's: q/k/v and MLP fc/gate/up column-parallel, `wo` and
//! `proj`/`down` row-parallel followed by a tp all-reduce (a reduce-scatter to the sequence
//! shard under sequence parallelism, whose inputs are all-gathered first); in backward the
//! conjugates: the gradient at a column-parallel input is all-reduced (reduce-scattered under
//! SP) and the gradient entering a row-parallel output is all-gathered under SP. The embedding
//! and head are vocab-parallel, the loss uses the `Ce*` pieces with tp all-reduces. A
//! row-parallel bias is added by tp rank 0 only, before the reduction.
//!
//! Context parallelism: K and V (after RoPE) are all-gathered over cp before attention and
//! their gradients reduce-scattered back. We gather rather than pass around a ring (Llama 3's
//! choice): with GQA the K/V are a fraction of the activations, and one all-gather overlaps
//! better and needs no online-softmax merge in the IR.
//!
//! Each forward leaves the layer's output in the microbatch's value map and returns the
//! tensors its backward needs ("saved", one holder each); the caller owns input lifetimes.

use super::emitter::Emitter;
use crate::fp8::GemmLayout;
use crate::ir::op::{
    Act, ActAttrs, AttentionAttrs, EmbeddingAttrs, FusedAttrs, Op, PositionAttrs, RopeAttrs,
};
use crate::ir::{BufferId, BufferKind, CollectiveKind, ReduceOp};
use crate::kir::func::ExprFn;
use crate::spec::{Activation, LayerKind, NodeId, Rope};

/// The hand-written activation of a non-gated MLP (a SwiGLU MLP has none: its gate is
/// `SwiGlu`; an expression function has generated kernels instead).
pub(super) fn act(a: &Activation) -> Act {
    match a {
        Activation::Plain(act) => *act,
        Activation::Swiglu | Activation::Fn(_) => Act::Relu,
    }
}

impl Emitter<'_> {
    fn input(&self, mb: u32, node: NodeId, i: usize) -> Option<BufferId> {
        let n = self.spec.model.nodes.get(node.0 as usize)?;
        let v = n.inputs.get(i)?;
        if *v == self.spec.model.tokens {
            return self.mbs[mb as usize].tokens;
        }
        if *v == self.spec.model.targets {
            return self.mbs[mb as usize].targets;
        }
        self.mbs[mb as usize].values.get(v).copied()
    }

    fn set_output(&mut self, mb: u32, node: NodeId, buf: BufferId) {
        if let Some(n) = self.spec.model.nodes.get(node.0 as usize) {
            let value = n.output;
            self.mbs[mb as usize].values.insert(value, buf);
            self.note_residual(value, buf);
        }
    }

    /// Where `node` is written in the spec (for a diagnostic about it).
    fn node_span(&self, node: NodeId) -> crate::diag::Span {
        self.spec
            .model
            .nodes
            .get(node.0 as usize)
            .map(|n| n.span)
            .unwrap_or_default()
    }

    pub(super) fn missing(&mut self, node: NodeId, what: &str) {
        let span = self.node_span(node);
        self.errors.push(
            crate::diag::Diagnostic::error(
                "E0804",
                format!(
                    "lowering `{}` found no {what} (an internal lowering error)",
                    self.node_name(node)
                ),
            )
            .label(span, "while lowering this layer")
            .help("please report this with the spec file"),
        );
    }

    /// Emit the forward of `node` for microbatch `mb`; returns its saved tensors.
    pub fn forward_node(&mut self, mb: u32, node: NodeId) -> Vec<BufferId> {
        let Some(n) = self.spec.model.nodes.get(node.0 as usize) else {
            return Vec::new();
        };
        let kind = n.kind.clone();
        let Some(x) = self.input(mb, node, 0) else {
            self.missing(node, "input");
            return Vec::new();
        };
        let phase = self.phase;
        let rows_h = self.rows_hidden();
        let rows = self.rows_full();
        let tp = u64::from(self.tp);
        let saved = match kind {
            LayerKind::Embedding { vocab, dim } => {
                let Some(w) = self.weight(node, "weight") else {
                    self.missing(node, "weight");
                    return Vec::new();
                };
                let split = self.groups.tp.is_some();
                let vl = if split { vocab / tp } else { vocab };
                let y = self.activation(node, "y", mb, vec![rows, dim]);
                let op = Op::Embedding(EmbeddingAttrs {
                    vocab_start: u64::from(self.tp_index) * vl * u64::from(split),
                    vocab_local: vl,
                    dim,
                });
                self.b.compute(op, &[x, w], &[y], Some(node), phase);
                let out = self.tp_reduce(
                    y,
                    dim,
                    self.name(node, "out", mb),
                    BufferKind::Activation,
                    node,
                );
                self.set_output(mb, node, out);
                self.b.retain(x);
                vec![x]
            }
            LayerKind::PositionEmbedding { dim, .. } => {
                let Some(w) = self.weight(node, "weight") else {
                    self.missing(node, "weight");
                    return Vec::new();
                };
                let y = self.activation(node, "y", mb, vec![rows_h, dim]);
                let op = Op::PositionAdd(PositionAttrs {
                    batch: self.micro_batch,
                    dim,
                    positions: self.sp_positions.clone(),
                });
                self.b.compute(op, &[x, w], &[y], Some(node), phase);
                self.set_output(mb, node, y);
                Vec::new()
            }
            LayerKind::LayerNorm { dim, eps, bias } => {
                let mut ins = vec![x];
                ins.extend(self.weight(node, "weight"));
                if bias {
                    ins.extend(self.weight(node, "bias"));
                }
                let y = self.activation(node, "y", mb, vec![rows_h, dim]);
                let mean = self.activation(node, "mean", mb, vec![rows_h]);
                let rstd = self.activation(node, "rstd", mb, vec![rows_h]);
                let op = Op::LayerNorm { dim, eps, bias };
                self.b
                    .compute(op, &ins, &[y, mean, rstd], Some(node), phase);
                self.set_output(mb, node, y);
                self.b.retain(x);
                vec![x, mean, rstd]
            }
            LayerKind::RmsNorm { dim, eps } => {
                let mut ins = vec![x];
                ins.extend(self.weight(node, "weight"));
                let y = self.activation(node, "y", mb, vec![rows_h, dim]);
                let rstd = self.activation(node, "rstd", mb, vec![rows_h]);
                self.b.compute(
                    Op::RmsNorm { dim, eps },
                    &ins,
                    &[y, rstd],
                    Some(node),
                    phase,
                );
                self.set_output(mb, node, y);
                self.b.retain(x);
                vec![x, rstd]
            }
            LayerKind::Linear {
                in_dim,
                out_dim,
                bias,
                ..
            } => {
                let xf = self.sp_gather(x, in_dim, self.name(node, "xg", mb), node);
                let split = self.groups.tp.is_some();
                let ol = if split { out_dim / tp } else { out_dim };
                let mut ins = vec![xf];
                ins.extend(self.weight(node, "weight"));
                if bias {
                    ins.extend(self.weight(node, "bias"));
                }
                let y = self.activation(node, "y", mb, vec![rows, ol]);
                let f8 = self.fp8_gemm((mb, node, "weight"), GemmLayout::Fwd, &ins, phase);
                ins.extend(&f8.amax);
                let op = Op::Matmul {
                    in_dim,
                    out_dim: ol,
                    bias,
                    act: None,
                    residual: false,
                    swiglu: false,
                    fp8: f8.attr,
                };
                self.b.compute(op, &ins, &[y], Some(node), phase);
                self.fp8_done(f8);
                self.set_output(mb, node, y);
                vec![self.sp_saved_input(x, xf)]
            }
            LayerKind::Attention { .. } => match AttnShape::of(&kind, tp) {
                Some(s) => self.attention_forward(mb, node, x, s),
                None => Vec::new(),
            },
            LayerKind::Mlp {
                dim,
                hidden,
                act: a,
                bias,
            } => self
                .mlp_forward(mb, node, x, dim, hidden / tp, &a, bias)
                .unwrap_or_default(),
            LayerKind::Add => {
                let Some(x2) = self.input(mb, node, 1) else {
                    self.missing(node, "second input");
                    return Vec::new();
                };
                if let Some(y) = self.fused_residual(node, x, x2) {
                    // The GEMM that wrote one input added the other: its output is this
                    // node's (one more holder, as a fresh output would have).
                    self.b.retain(y);
                    self.set_output(mb, node, y);
                } else {
                    let shape = self.b.shape(x);
                    let y = self.activation(node, "y", mb, shape);
                    self.b.compute(Op::Add, &[x, x2], &[y], Some(node), phase);
                    self.set_output(mb, node, y);
                }
                Vec::new()
            }
            LayerKind::Elementwise { f, .. } => self.elementwise_forward(mb, node, &f),
            LayerKind::CrossEntropy => self.loss_forward(mb, node, x),
        };
        self.end_node();
        saved
    }

    /// `y = f(x, …)`: one generated kernel over the inputs' local shards, which must all have
    /// one shape (as an `Add`'s: hidden states, replicated over tp or the sequence shard under
    /// sequence parallelism). Saves its inputs.
    fn elementwise_forward(&mut self, mb: u32, node: NodeId, f: &ExprFn) -> Vec<BufferId> {
        let mut ins = Vec::new();
        for i in 0..f.params.len() {
            match self.input(mb, node, i) {
                Some(b) => ins.push(b),
                None => {
                    self.missing(node, "input");
                    return Vec::new();
                }
            }
        }
        let shape = ins.first().map(|&b| self.b.shape(b)).unwrap_or_default();
        if ins.iter().any(|&b| self.b.shape(b) != shape) {
            self.mixed_shards(node);
            return Vec::new();
        }
        let cols = shape.get(1).copied().unwrap_or(0);
        let Some(attrs) = self.act_kernel(node, super::act_kernels::elementwise(f, cols)) else {
            return Vec::new();
        };
        let y = self.activation(node, "y", mb, shape);
        self.b
            .compute(Op::Fused(attrs), &ins, &[y], Some(node), self.phase);
        self.set_output(mb, node, y);
        for &b in &ins {
            self.b.retain(b);
        }
        ins
    }

    /// An elementwise layer whose inputs reach it split differently over tp.
    fn mixed_shards(&mut self, node: NodeId) {
        let span = self.node_span(node);
        self.errors.push(
            crate::diag::Diagnostic::error(
                "E0229",
                format!(
                    "`{}` applies a function to tensors split differently over tp",
                    self.node_name(node)
                ),
            )
            .label(span, "applied here")
            .help("apply the function to tensors split alike: hidden states between layers"),
        );
    }

    fn loss_forward(&mut self, mb: u32, node: NodeId, logits: BufferId) -> Vec<BufferId> {
        let phase = self.phase;
        let Some(targets) = self.input(mb, node, 1) else {
            self.missing(node, "targets");
            return Vec::new();
        };
        let Some(loss) = self.loss else {
            self.missing(node, "loss buffer");
            return Vec::new();
        };
        let rows = self.rows_full();
        let shape = self.b.shape(logits);
        let vl = shape.get(1).copied().unwrap_or(0);
        if self.fuses_loss(node) {
            // One pass per row; the logits buffer then holds dlogits for the backward.
            self.b.compute(
                Op::CrossEntropy {
                    vocab: vl,
                    scale: self.loss_scale(),
                },
                &[logits, targets],
                &[logits, loss],
                Some(node),
                phase,
            );
            self.b.retain(logits);
            return vec![logits];
        }
        let vstart = if self.groups.tp.is_some() {
            u64::from(self.tp_index) * vl
        } else {
            0
        };
        let mx = self.activation(node, "max", mb, vec![rows]);
        self.b.compute(
            Op::CeMax { vocab_local: vl },
            &[logits],
            &[mx],
            Some(node),
            phase,
        );
        self.tp_all_reduce(mx, ReduceOp::Max, node);
        let se = self.activation(node, "sumexp", mb, vec![rows]);
        self.b.compute(
            Op::CeSumExp { vocab_local: vl },
            &[logits, mx],
            &[se],
            Some(node),
            phase,
        );
        self.tp_all_reduce(se, ReduceOp::Sum, node);
        let tl = self.activation(node, "target", mb, vec![rows]);
        self.b.compute(
            Op::CeTargetLogit {
                vocab_start: vstart,
                vocab_local: vl,
            },
            &[logits, targets],
            &[tl],
            Some(node),
            phase,
        );
        self.tp_all_reduce(tl, ReduceOp::Sum, node);
        self.b.compute(
            Op::CeLoss {
                scale: self.loss_scale(),
            },
            &[mx, se, tl],
            &[loss],
            Some(node),
            phase,
        );
        self.b.release(tl);
        self.b.retain(logits);
        self.b.retain(targets);
        vec![logits, targets, mx, se]
    }

    /// Whether the loss of `node` is the fused `CrossEntropy` (which overwrites its logits
    /// with their gradient): its vocabulary is not split over tp (a split one needs collectives
    /// between the pieces) and it is the only reader of the logits (another would see dlogits).
    pub fn fuses_loss(&self, node: NodeId) -> bool {
        let Some(logits) = self
            .spec
            .model
            .nodes
            .get(node.0 as usize)
            .and_then(|n| n.inputs.first())
        else {
            return false;
        };
        let readers = self
            .spec
            .model
            .nodes
            .iter()
            .filter(|n| n.inputs.contains(logits))
            .count();
        self.groups.tp.is_none() && readers == 1
    }

    /// 1 / (tokens in the global batch).
    pub fn loss_scale(&self) -> f64 {
        1.0 / (self.spec.train.global_batch as f64 * self.spec.model.seq as f64)
    }

    fn tp_all_reduce(&mut self, buf: BufferId, op: ReduceOp, node: NodeId) {
        if let Some(g) = self.groups.tp {
            self.b
                .collective(CollectiveKind::AllReduce { op }, g, buf, buf, Some(node));
        }
    }

    fn matmul(
        &mut self,
        mb: u32,
        node: NodeId,
        x: BufferId,
        (w, b): (&str, Option<&str>),
        (in_dim, out_dim): (u64, u64),
        what: &str,
    ) -> BufferId {
        let rows = self.b.shape(x).first().copied().unwrap_or(0);
        let mut ins = vec![x];
        ins.extend(self.weight(node, w));
        let bias = b.is_some_and(|b| self.adds_bias(node, b));
        if let (true, Some(bn)) = (bias, b) {
            ins.extend(self.weight(node, bn));
        }
        let y = self.activation(node, what, mb, vec![rows, out_dim]);
        let f8 = self.fp8_gemm((mb, node, w), GemmLayout::Fwd, &ins, self.phase);
        ins.extend(&f8.amax);
        let op = Op::Matmul {
            in_dim,
            out_dim,
            bias,
            act: None,
            residual: false,
            swiglu: false,
            fp8: f8.attr,
        };
        self.b.compute(op, &ins, &[y], Some(node), self.phase);
        self.fp8_done(f8);
        y
    }

    /// Fuses the residual `Add` `node` (inputs `x`, `x2`) into the GEMM that wrote one input,
    /// which then adds the other (`Matmul { residual }`); the buffer holding the sum, or None
    /// (the `Add` stays). Only where it is exact and safe (`LowerOptions::fuse_epilogues`):
    /// without tp (a row-parallel product is a partial sum, reduced after the GEMM), when the
    /// input's value is read by this node alone (nothing else may see the sum) and produced
    /// in the same recompute segment (a recomputed segment reads its inputs again), and when
    /// the GEMM is that producer's last write of it (`ProgramBuilder::add_residual`).
    fn fused_residual(&mut self, node: NodeId, x: BufferId, x2: BufferId) -> Option<BufferId> {
        if !self.fuse_epilogues || self.groups.tp.is_some() || x == x2 {
            return None;
        }
        let nodes = &self.spec.model.nodes;
        let values = nodes.get(node.0 as usize)?.inputs.clone();
        let segment = self.segments.get(node.0 as usize).copied().flatten();
        for (value, y, r) in [(values.get(1)?, x2, x), (values.first()?, x, x2)] {
            let Some(producer) = nodes.iter().position(|p| p.output == *value) else {
                continue;
            };
            let readers = nodes.iter().filter(|c| c.inputs.contains(value)).count();
            let same_segment = self.segments.get(producer).copied().flatten() == segment;
            if readers == 1
                && same_segment
                && self
                    .b
                    .add_residual(y, r, NodeId(producer as u32), self.phase)
            {
                return Some(y);
            }
        }
        None
    }

    /// Whether an MLP with activation `a` runs it inside its GEMMs (`LowerOptions::
    /// fuse_epilogues`): only `gelu_tanh`, which cuBLASLt's GELU epilogues compute by the same
    /// definition; `gelu` (erf) and `relu` keep their separate ops (cuBLASLt's relu epilogue
    /// saves a bit mask, not the pre-activation the IR's backward reads).
    pub fn fuses_activation(&self, a: &Activation) -> bool {
        self.fuse_epilogues && *a == Activation::Plain(Act::GeluTanh)
    }

    /// Whether a SwiGLU MLP's gated product runs inside its GEMMs (`LowerOptions::
    /// fuse_epilogues`): the up projection's `Matmul { swiglu }` writes silu(g) ⊙ u beside u,
    /// and the down projection's backward-data product writes dgate and dup, with no `SwiGlu` /
    /// `SwiGluBwd` between (an FP8 GEMM too: the backends run the gated product after it, as
    /// for any epilogue an FP8 GEMM has, so the FP8 choice does not change the program's ops).
    pub fn fuses_swiglu(&self) -> bool {
        self.fuse_epilogues
    }

    /// The up projection of a SwiGLU MLP with its gated product (`fuses_swiglu`): `x`'s product
    /// with `up`, u (saved), and silu(`g`) ⊙ u.
    fn matmul_swiglu(
        &mut self,
        mb: u32,
        node: NodeId,
        x: BufferId,
        g: BufferId,
        (in_dim, out_dim): (u64, u64),
    ) -> (BufferId, BufferId) {
        let rows = self.b.shape(x).first().copied().unwrap_or(0);
        let mut ins = vec![x];
        ins.extend(self.weight(node, "up"));
        let u = self.activation(node, "u", mb, vec![rows, out_dim]);
        let a = self.activation(node, "a", mb, vec![rows, out_dim]);
        let f8 = self.fp8_gemm((mb, node, "up"), GemmLayout::Fwd, &ins, self.phase);
        // The gate follows x and W, before any FP8 amax inputs (the op table's order).
        ins.push(g);
        ins.extend(&f8.amax);
        let op = Op::Matmul {
            in_dim,
            out_dim,
            bias: false,
            act: None,
            residual: false,
            swiglu: true,
            fp8: f8.attr,
        };
        self.b.compute(op, &ins, &[u, a], Some(node), self.phase);
        self.fp8_done(f8);
        (u, a)
    }

    /// [`Self::matmul`] with a fused activation: the pre-activation `h` and `act(h)`.
    fn matmul_act(
        &mut self,
        mb: u32,
        node: NodeId,
        x: BufferId,
        (w, b): (&str, Option<&str>),
        (in_dim, out_dim): (u64, u64),
        act: Act,
    ) -> (BufferId, BufferId) {
        let rows = self.b.shape(x).first().copied().unwrap_or(0);
        let mut ins = vec![x];
        ins.extend(self.weight(node, w));
        let bias = b.is_some_and(|b| self.adds_bias(node, b));
        if let (true, Some(bn)) = (bias, b) {
            ins.extend(self.weight(node, bn));
        }
        let mut out = |what: &str| {
            let name = self.name(node, what, mb);
            self.b
                .alloc(name, vec![rows, out_dim], BufferKind::Activation)
        };
        let (h, a) = (out("h"), out("a"));
        let f8 = self.fp8_gemm((mb, node, w), GemmLayout::Fwd, &ins, self.phase);
        ins.extend(&f8.amax);
        let op = Op::Matmul {
            in_dim,
            out_dim,
            bias,
            act: Some(act),
            residual: false,
            swiglu: false,
            fp8: f8.attr,
        };
        self.b.compute(op, &ins, &[h, a], Some(node), self.phase);
        self.fp8_done(f8);
        (h, a)
    }

    fn attention_forward(
        &mut self,
        mb: u32,
        node: NodeId,
        x: BufferId,
        s: AttnShape,
    ) -> Vec<BufferId> {
        let phase = self.phase;
        let q_cols = s.heads * s.head_dim;
        let kv_cols = s.kv_heads * s.head_dim;
        let xf = self.sp_gather(x, s.dim, self.name(node, "xg", mb), node);
        // One fused projection (rows q, k, v of `wqkv`) writes every row's q, k and v heads.
        let qkv_cols = q_cols + 2 * kv_cols;
        let qkv = self.matmul(
            mb,
            node,
            xf,
            ("wqkv", s.qkv_bias.then_some("bqkv")),
            (s.dim, qkv_cols),
            "qkv",
        );
        // Attention reads q, k and v where the projection wrote them, or as separate buffers
        // (followed, under qk_norm, by what the norms' backward reads).
        let inputs = if self.packs_qkv(&s) {
            vec![qkv]
        } else {
            self.split_qkv(mb, node, qkv, &s)
        };
        let attended = inputs.get(..inputs.len().min(3)).unwrap_or_default();
        let (o, lse) = self.attention_core(mb, node, attended, &s, phase);
        let yp = self.matmul(
            mb,
            node,
            o,
            ("wo", s.out_bias.then_some("bo")),
            (q_cols, s.dim),
            "y",
        );
        let y = self.tp_reduce(
            yp,
            s.dim,
            self.name(node, "out", mb),
            BufferKind::Activation,
            node,
        );
        self.set_output(mb, node, y);
        let mut saved = vec![self.sp_saved_input(x, xf)];
        saved.extend(inputs);
        if self.selective_here(node) {
            self.b.release(o);
            self.b.release(lse);
        } else {
            saved.extend([o, lse]);
        }
        saved
    }

    /// Whether attention reads q, k and v packed in the fused projection's output (one
    /// buffer, no split): always but where q and k are normalized or rotated first or context
    /// parallelism gathers k and v over the group (all want them as separate buffers).
    pub fn packs_qkv(&self, s: &AttnShape) -> bool {
        s.rope.is_none() && s.qk_norm.is_none() && self.groups.cp.is_none()
    }

    /// How many tensors an attention of shape `s` saves after its input for the backward
    /// before its output and log-sum-exp: the packed projection output, or q, k and v, then
    /// under qk_norm q and k as projected with their norms' rstd.
    pub fn saved_qkv_len(&self, s: &AttnShape) -> usize {
        match (self.packs_qkv(s), s.qk_norm) {
            (true, _) => 1,
            (false, None) => 3,
            (false, Some(_)) => 7,
        }
    }

    /// The fused projection's output (consumed) as the q, k and v attention reads: split into
    /// three buffers, q and k normalized per head under qk_norm and rotated under rope, k and v
    /// gathered over context parallelism. Under qk_norm four more follow for the backward:
    /// q as projected, its rstd, k as projected, its rstd.
    fn split_qkv(&mut self, mb: u32, node: NodeId, qkv: BufferId, s: &AttnShape) -> Vec<BufferId> {
        let (q_cols, kv_cols) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let rows = self.b.shape(qkv).first().copied().unwrap_or(0);
        let [q, k, v] = [("q", q_cols), ("k", kv_cols), ("v", kv_cols)]
            .map(|(what, w)| self.activation(node, what, mb, vec![rows, w]));
        self.b.compute(
            Op::SplitColumns {
                widths: vec![q_cols, kv_cols, kv_cols],
            },
            &[qkv],
            &[q, k, v],
            Some(node),
            self.phase,
        );
        self.b.release(qkv);
        let mut norm_saved = Vec::new();
        let (q, k) = match s.qk_norm {
            None => (q, k),
            Some(eps) => {
                let norm = (eps, s.head_dim);
                let (qn, q_rstd) = self.head_norm(mb, node, q, ("q_norm", "qn"), norm);
                let (kn, k_rstd) = self.head_norm(mb, node, k, ("k_norm", "kn"), norm);
                norm_saved = vec![q, q_rstd, k, k_rstd];
                (qn, kn)
            }
        };
        let (q, k) = match s.rope {
            None => (q, k),
            Some(rope) => {
                let qr = self.rope(mb, node, q, s.heads, s.head_dim, rope, "qr", false);
                let kr = self.rope(mb, node, k, s.kv_heads, s.head_dim, rope, "kr", false);
                (qr, kr)
            }
        };
        let (k, v) = match self.groups.cp {
            None => (k, v),
            Some(g) => {
                let rows_all = self.rows_full() * u64::from(self.cp);
                let kf = self.activation(node, "k_all", mb, vec![rows_all, kv_cols]);
                self.b
                    .collective(CollectiveKind::AllGather, g, k, kf, Some(node));
                self.b.release(k);
                let vf = self.activation(node, "v_all", mb, vec![rows_all, kv_cols]);
                self.b
                    .collective(CollectiveKind::AllGather, g, v, vf, Some(node));
                self.b.release(v);
                (kf, vf)
            }
        };
        let mut out = vec![q, k, v];
        out.extend(norm_saved);
        out
    }

    /// Each head of `x` (`[rows, heads·head_dim]`, read as `[rows·heads, head_dim]`: the op
    /// table's rows are whole rows of `dim`) RMS-normalized with the weight `local`, shared by
    /// every head: `(y, rstd)`, rstd `[rows·heads]`. `x` keeps its holder (the caller saves
    /// it for the backward).
    fn head_norm(
        &mut self,
        mb: u32,
        node: NodeId,
        x: BufferId,
        (local, what): (&str, &str),
        (eps, head_dim): (f64, u64),
    ) -> (BufferId, BufferId) {
        let shape = self.b.shape(x);
        let heads_rows = shape.iter().product::<u64>() / head_dim.max(1);
        let y = self.activation(node, what, mb, shape);
        let rstd = self.activation(node, &format!("{what}_rstd"), mb, vec![heads_rows]);
        match self.weight(node, local) {
            Some(w) => {
                let op = Op::RmsNorm { dim: head_dim, eps };
                self.b
                    .compute(op, &[x, w], &[y, rstd], Some(node), self.phase);
            }
            None => self.missing(node, local),
        }
        (y, rstd)
    }

    pub fn selective_here(&self, node: NodeId) -> bool {
        self.selective
            && self
                .spec
                .model
                .nodes
                .get(node.0 as usize)
                .is_some_and(|n| n.recompute)
    }

    pub fn attention_core(
        &mut self,
        mb: u32,
        node: NodeId,
        qkv: &[BufferId],
        s: &AttnShape,
        phase: crate::ir::Phase,
    ) -> (BufferId, BufferId) {
        let rows = self.rows_full();
        let seq_q = u64::from(crate::ir::op::segments_len(&self.positions));
        let o = self.activation(node, "o", mb, vec![rows, s.heads * s.head_dim]);
        let lse = self.activation(node, "lse", mb, vec![self.micro_batch, s.heads, seq_q]);
        let op = self.attention_op(s, false, qkv.len() == 1);
        self.b.compute(op, qkv, &[o, lse], Some(node), phase);
        (o, lse)
    }

    pub fn attention_op(&self, s: &AttnShape, backward: bool, packed: bool) -> Op {
        let attrs = AttentionAttrs {
            batch: self.micro_batch,
            heads: s.heads,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            causal: s.causal,
            scale: s.scale,
            q_positions: self.positions.clone(),
            kv_positions: self.kv_positions.clone(),
            packed,
        };
        if backward {
            Op::AttentionBwd(attrs)
        } else {
            Op::Attention(attrs)
        }
    }

    /// Rotate (or, in backward, un-rotate) a `[rows, heads·head_dim]` tensor; consumes `x`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &mut self,
        mb: u32,
        node: NodeId,
        x: BufferId,
        heads: u64,
        head_dim: u64,
        rope: Rope,
        what: &str,
        backward: bool,
    ) -> BufferId {
        let shape = self.b.shape(x);
        let kind = if backward {
            BufferKind::ActivationGrad
        } else {
            BufferKind::Activation
        };
        let y = self.b.alloc(self.name(node, what, mb), shape, kind);
        let attrs = RopeAttrs {
            batch: self.micro_batch,
            heads,
            head_dim,
            theta: rope.theta,
            scaling: rope.scaling,
            positions: self.positions.clone(),
            rotary_dim: rope.partial_dim(head_dim),
        };
        let op = if backward {
            Op::RopeBwd(attrs)
        } else {
            Op::Rope(attrs)
        };
        self.b.compute(op, &[x], &[y], Some(node), self.phase);
        self.b.release(x);
        y
    }

    #[allow(clippy::too_many_arguments)]
    fn mlp_forward(
        &mut self,
        mb: u32,
        node: NodeId,
        x: BufferId,
        dim: u64,
        hidden_local: u64,
        a: &Activation,
        bias: bool,
    ) -> Option<Vec<BufferId>> {
        let phase = self.phase;
        let xf = self.sp_gather(x, dim, self.name(node, "xg", mb), node);
        let bias_of = |n: &'static str| if bias { Some(n) } else { None };
        let (saved_mid, act_out, out_w, out_b) = if let Activation::Fn(f) = a {
            self.fn_act_forward(mb, node, xf, (dim, hidden_local), f, bias)?
        } else if *a == Activation::Swiglu {
            let g = self.matmul(mb, node, xf, ("gate", None), (dim, hidden_local), "g");
            let (u, h) = if self.fuses_swiglu() {
                self.matmul_swiglu(mb, node, xf, g, (dim, hidden_local))
            } else {
                let u = self.matmul(mb, node, xf, ("up", None), (dim, hidden_local), "u");
                let h = self.activation(node, "a", mb, vec![self.rows_full(), hidden_local]);
                self.b.compute(Op::SwiGlu, &[g, u], &[h], Some(node), phase);
                (u, h)
            };
            (vec![g, u], h, "down", None)
        } else if self.fuses_activation(a) {
            // One GEMM writes the pre-activation h (saved) and the activation.
            let (h, out) = self.matmul_act(
                mb,
                node,
                xf,
                ("fc", bias_of("fc_bias")),
                (dim, hidden_local),
                act(a),
            );
            (vec![h], out, "proj", bias_of("proj_bias"))
        } else {
            let h = self.matmul(
                mb,
                node,
                xf,
                ("fc", bias_of("fc_bias")),
                (dim, hidden_local),
                "h",
            );
            let out = self.activation(node, "a", mb, vec![self.rows_full(), hidden_local]);
            self.b.compute(
                Op::Activation(ActAttrs { act: act(a) }),
                &[h],
                &[out],
                Some(node),
                phase,
            );
            (vec![h], out, "proj", bias_of("proj_bias"))
        };
        let yp = self.matmul(mb, node, act_out, (out_w, out_b), (hidden_local, dim), "y");
        let y = self.tp_reduce(
            yp,
            dim,
            self.name(node, "out", mb),
            BufferKind::Activation,
            node,
        );
        self.set_output(mb, node, y);
        let mut saved = vec![self.sp_saved_input(x, xf)];
        saved.extend(saved_mid);
        saved.push(act_out);
        Some(saved)
    }

    /// The projections and generated activation kernel of an MLP whose activation is an
    /// expression function: `(saved, activation output, output weight, output bias)`.
    fn fn_act_forward(
        &mut self,
        mb: u32,
        node: NodeId,
        xf: BufferId,
        (dim, hl): (u64, u64),
        f: &ExprFn,
        bias: bool,
    ) -> Option<FnActParts> {
        let attrs = self.act_kernel(node, super::act_kernels::forward(f, hl))?;
        let ins = if f.params.len() == 2 {
            let g = self.matmul(mb, node, xf, ("gate", None), (dim, hl), "g");
            let u = self.matmul(mb, node, xf, ("up", None), (dim, hl), "u");
            vec![g, u]
        } else {
            let b = bias.then_some("fc_bias");
            vec![self.matmul(mb, node, xf, ("fc", b), (dim, hl), "h")]
        };
        let out = self.activation(node, "a", mb, vec![self.rows_full(), hl]);
        let phase = self.phase;
        self.b
            .compute(Op::Fused(attrs), &ins, &[out], Some(node), phase);
        Some(if ins.len() == 2 {
            (ins, out, "down", None)
        } else {
            (ins, out, "proj", bias.then_some("proj_bias"))
        })
    }

    /// A generated activation kernel, or an error reported at `node`.
    pub(super) fn act_kernel(
        &mut self,
        node: NodeId,
        kernel: Result<FusedAttrs, String>,
    ) -> Option<FusedAttrs> {
        match kernel {
            Ok(attrs) => Some(attrs),
            Err(e) => {
                let span = self.node_span(node);
                self.errors.push(
                    crate::diag::Diagnostic::error(
                        "E0807",
                        format!("lowering `{}`: {e}", self.node_name(node)),
                    )
                    .label(span, "while lowering this layer")
                    .help("the activation's generated kernel could not be built; please report this with the spec file"),
                );
                None
            }
        }
    }
}

/// What an MLP's activation step hands on: `(saved, activation output, output weight, output
/// bias)`.
type FnActParts = (Vec<BufferId>, BufferId, &'static str, Option<&'static str>);

/// Local attention sizes (heads already divided by tp).
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub dim: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub causal: bool,
    pub rope: Option<Rope>,
    /// `wqkv` has a bias `bqkv`.
    pub qkv_bias: bool,
    /// `wo` has a bias `bo`.
    pub out_bias: bool,
    /// Each head of q and k RMS-normalized with this epsilon (weights `q_norm`, `k_norm`).
    pub qk_norm: Option<f64>,
    /// The factor q·k is multiplied by (`spec::attention_scale`).
    pub scale: f64,
}

impl AttnShape {
    pub fn of(kind: &LayerKind, tp: u64) -> Option<AttnShape> {
        match kind {
            LayerKind::Attention {
                dim,
                heads,
                kv_heads,
                head_dim,
                causal,
                rope,
                qkv_bias,
                out_bias,
                qk_norm,
                scale,
            } => Some(AttnShape {
                dim: *dim,
                heads: heads / tp,
                kv_heads: kv_heads / tp,
                head_dim: *head_dim,
                causal: *causal,
                rope: *rope,
                qkv_bias: *qkv_bias,
                out_bias: *out_bias,
                qk_norm: *qk_norm,
                scale: crate::spec::attention_scale(*head_dim, *scale),
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::cost::testspec::{build, Dims, Plan as PlanChoice};
    use crate::ir::op::Op;
    use crate::ir::Plan;
    use crate::lower::lower;
    use crate::spec::{LayerKind, Node, Shape, Spec, Value, ValueId};

    /// The loss ops of every program of `spec`'s plan (which must verify).
    fn loss_ops(spec: &Spec) -> Vec<&'static str> {
        let plan: Plan = lower(spec).unwrap_or_else(|d| panic!("{:?}", d.items));
        crate::verify::verify(&plan).unwrap_or_else(|d| panic!("{:?}", d.items));
        let mut ops = Vec::new();
        for (_, c) in plan.programs.iter().flat_map(|p| p.computes()) {
            match c.op {
                Op::CrossEntropy { .. } => ops.push("fused"),
                Op::CeMax { .. } => ops.push("split"),
                _ => {}
            }
        }
        ops.dedup();
        ops
    }

    #[test]
    fn the_loss_is_fused_unless_the_vocab_is_split_or_the_logits_have_another_reader() {
        let dims = Dims::tiny();
        assert_eq!(loss_ops(&build(&dims, &PlanChoice::default())), ["fused"]);
        let tp = PlanChoice {
            tp: 2,
            ..PlanChoice::default()
        };
        assert_eq!(loss_ops(&build(&dims, &tp)), ["split"]);
        // A second reader of the logits, after the loss: it must see the logits, not dlogits.
        let mut spec = build(&dims, &PlanChoice::default());
        let loss = spec.model.nodes.len() - 1;
        let logits = spec.model.nodes[loss].inputs[0];
        let out = ValueId(spec.model.values.len() as u32);
        spec.model.values.push(Value {
            name: "logits2".into(),
            shape: Shape::Hidden(dims.vocab),
            span: Default::default(),
        });
        let reader = Node {
            name: "reread".into(),
            kind: LayerKind::Add,
            inputs: vec![logits, logits],
            output: out,
            layer: None,
            recompute: false,
            span: Default::default(),
        };
        spec.model.nodes.push(reader);
        assert_eq!(loss_ops(&spec), ["split"]);
    }
}
