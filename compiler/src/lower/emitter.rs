//! The per-program emission state shared by the layer, pipeline and optimizer lowering: the
//! rank role, the local parameters and their gradients, and each microbatch's live values.

use super::builder::ProgramBuilder;
use super::context::{Chunks, Groups};
use super::idmap::IdMap;
use super::params::{Params, TpRule};
use crate::diag::Diagnostic;
use crate::ir::op::{Op, Segment};
use crate::ir::{
    BufferId, BufferKind, CollectiveKind, DType, Param, ParamId, Phase, ReduceOp, TpSplit,
    ZeroSplit,
};
use crate::spec::{NodeId, SpSave, Spec, ValueId, ZeroStage};

/// A parameter held by this program while it is being emitted.
pub struct LocalState {
    pub param: ParamId,
    pub rule: TpRule,
    /// tp-local shape.
    pub shape: Vec<u64>,
    pub numel: u64,
    pub master: BufferId,
    pub working: Option<BufferId>,
    /// Compute reads this parameter in bf16 (its working copy, or under ZeRO-3 the gathered
    /// tensor; `lower::computes_in_bf16`).
    pub bf16: bool,
    pub state: Vec<BufferId>,
    pub tp: Option<TpSplit>,
    pub zero: Option<ZeroSplit>,
    /// Full tp-local gradient accumulator (transient, allocated zeroed at the first backward
    /// write, so forward never holds gradient memory).
    pub grad: Option<BufferId>,
    /// The gradient the optimizer reads once reductions are done (the shard under ZeRO).
    pub final_grad: Option<BufferId>,
    /// Backward uses left before the current reduction group is complete.
    pub uses_left: u32,
    /// Backward uses of one reduction group: one microbatch's under ZeRO-2/3 (each
    /// microbatch's gradient is reduce-scattered into the shard, so no full-size gradient
    /// lives across microbatches), the whole step's otherwise.
    pub group_uses: u32,
    /// Reduction groups left in the step (microbatches under ZeRO-2/3, else 1).
    pub groups_left: u32,
    /// Reduction groups completed so far (names a later group's buffers: `NAME.grad.g1`; not `@1`, which names a microbatch).
    pub groups_done: u32,
    /// Every reduction group of the step has been completed.
    pub complete: bool,
    /// Counted in the gradient norm by this program (exactly one holder of each element).
    pub in_norm: bool,
    /// Also held by another pipeline stage (tied embedding copy): all-reduced over `embed`.
    pub shared: bool,
}

/// A ZeRO-3 all-gather of a parameter's shards, until the node that uses it unpads it.
pub struct ShardGather {
    /// The gathered shards, padding included.
    flat: BufferId,
    /// The bf16 rounding of this rank's shard the gather sends, if it sends one.
    rounded: Option<BufferId>,
}

impl ShardGather {
    /// Free the gather's buffers.
    fn release(self, b: &mut ProgramBuilder) {
        b.release(self.flat);
        if let Some(r) = self.rounded {
            b.release(r);
        }
    }
}

/// One microbatch's live tensors on this program.
#[derive(Default)]
pub struct MbState {
    pub values: IdMap<ValueId, BufferId>,
    pub grads: IdMap<ValueId, BufferId>,
    pub saved: IdMap<NodeId, Vec<BufferId>>,
    /// Values kept for recomputing a segment: (segment, value) → buffer.
    pub seg_keep: Vec<(u32, ValueId, BufferId)>,
    /// Buffers received for a later unit: (chunk, value) → buffer (activations or grads).
    pub inbox: IdMap<(u32, ValueId, bool), BufferId>,
    /// Buffers waiting to be sent after a unit: (chunk, value, is_grad) → buffer.
    pub outbox: IdMap<(u32, ValueId, bool), BufferId>,
    pub tokens: Option<BufferId>,
    pub targets: Option<BufferId>,
}

pub struct Emitter<'a> {
    pub spec: &'a Spec,
    pub params: &'a Params,
    pub chunks: &'a Chunks,
    pub groups: &'a Groups,
    pub b: ProgramBuilder,
    pub tp: u32,
    pub tp_index: u32,
    pub cp: u32,
    pub stage: u32,
    pub sp: bool,
    pub zero: ZeroStage,
    pub micro_batch: u64,
    /// Positions this rank holds (cp-local), and those of every cp rank in cp order.
    pub positions: Vec<Segment>,
    pub kv_positions: Vec<Segment>,
    /// Positions of this rank's sequence-parallel shard (= `positions` without SP).
    pub sp_positions: Vec<Segment>,
    pub locals: Vec<LocalState>,
    pub local_of: IdMap<ParamId, usize>,
    pub mbs: Vec<MbState>,
    pub segments: Vec<Option<u32>>,
    pub selective: bool,
    pub loss: Option<BufferId>,
    pub grad_sumsq: BufferId,
    /// Completed gradients waiting for their bucket to fill: (local index, gradient buffer,
    /// reduction group).
    pub bucket: Vec<(usize, BufferId, u32)>,
    pub bucket_bytes: u64,
    /// Flat buckets whose all-reduce is queued, with their gradients (local indices, in packing
    /// order): unpacked only after the whole backward, so nothing waits for the all-reduce
    /// while backward still has compute to overlap it with.
    pub reduced: Vec<(BufferId, Vec<usize>)>,
    /// ZeRO-2/3 padded gradient copies whose reduce-scatter is queued: freed once the next
    /// bucket's reductions are queued (a `Free` waits for the collective using the buffer).
    pub scattered: Vec<BufferId>,
    /// ZeRO-2/3 reduce-scatters of a later microbatch's gradient into a part shard: (local
    /// index, part, reduction group), added into the accumulated shard once the next bucket's reductions are
    /// queued, so compute does not wait for the reduce-scatter at once.
    pub scattered_parts: Vec<(usize, BufferId, u32)>,
    /// ZeRO-3 parameters gathered for the node being emitted (their full tensors).
    pub gathered: Vec<(ParamId, BufferId)>,
    /// ZeRO-3 parameters gathered ahead of the node that uses them (their gathers).
    pub prefetched: Vec<(ParamId, ShardGather)>,
    /// ZeRO-3 parameters of the node being emitted whose full tensors [`Emitter::end_node`]
    /// moves to `kept` instead of freeing.
    pub keep: Vec<ParamId>,
    /// ZeRO-3 full tensors a forward unit keeps for the backward unit that follows it at once
    /// (its last node's weights, read again first thing in backward), so that backward neither
    /// gathers them again nor waits for a gather with no compute before it.
    pub kept: Vec<(ParamId, BufferId)>,
    pub errors: Vec<Diagnostic>,
    /// Phase of the compute being emitted (forward, recompute or backward).
    pub phase: Phase,
    /// `LowerOptions::accumulate_in_place`.
    pub accumulate_in_place: bool,
    /// `LowerOptions::fuse_epilogues`.
    pub fuse_epilogues: bool,
    /// Emitting an evaluation step (`eval`): forward units only, nothing saved for a backward,
    /// and the step ends with the loss (no gradients, no optimizer).
    pub evaluating: bool,
    /// The residual stream, where `bf16 { residual: fp32 }` keeps it f32: every buffer given a
    /// value of it or its gradient is reported to it ([`Emitter::note_residual`]).
    pub residual: Option<super::storage::ResidualStream>,
    /// The layers whose GEMMs run in FP8 (`train.fp8`; `lower/fp8.rs`).
    pub fp8: Option<&'a super::context::Fp8Layers>,
    /// Delayed FP8 scaling's per-operand histories (`lower/fp8.rs`), declared up front.
    pub fp8_histories: Vec<super::context::Fp8History>,
}

impl Emitter<'_> {
    /// Rows of the full cp-local sequence × microbatch.
    pub fn rows_full(&self) -> u64 {
        u64::from(super::super::ir::op::segments_len(&self.positions)) * self.micro_batch
    }
    /// Rows of a hidden value between nodes (the SP shard under sequence parallelism).
    pub fn rows_hidden(&self) -> u64 {
        if self.sp {
            self.rows_full() / u64::from(self.tp)
        } else {
            self.rows_full()
        }
    }

    pub fn node_name(&self, node: NodeId) -> &str {
        self.spec
            .model
            .nodes
            .get(node.0 as usize)
            .map(|n| n.name.as_str())
            .unwrap_or("?")
    }

    pub fn name(&self, node: NodeId, what: &str, mb: u32) -> String {
        buffer_name(self.node_name(node), what, mb)
    }

    /// Allocate `node`'s activation `what` of microbatch `mb` (named by [`Emitter::name`]).
    pub fn activation(&mut self, node: NodeId, what: &str, mb: u32, shape: Vec<u64>) -> BufferId {
        let name = self.name(node, what, mb);
        self.b.alloc(name, shape, BufferKind::Activation)
    }

    /// Allocate `node`'s activation gradient `what` of microbatch `mb`.
    pub fn activation_grad(
        &mut self,
        node: NodeId,
        what: &str,
        mb: u32,
        shape: Vec<u64>,
    ) -> BufferId {
        let name = self.name(node, what, mb);
        self.b.alloc(name, shape, BufferKind::ActivationGrad)
    }

    /// The buffer compute ops read for a parameter of `node` (ZeRO-3: kept from the forward,
    /// or gathered by a prefetch or now; freed by [`Emitter::end_node`]).
    pub fn weight(&mut self, node: NodeId, local: &str) -> Option<BufferId> {
        let slot = self.params.get(node, local)?;
        let idx = *self.local_of.get(&slot.param)?;
        let l = &self.locals[idx];
        if self.zero != ZeroStage::Zero3 || l.zero.is_none() {
            return Some(l.working.unwrap_or(l.master));
        }
        let full = match self.kept.iter().position(|(p, _)| *p == slot.param) {
            Some(i) => self.kept.remove(i).1,
            None => {
                let flat = match self.prefetched.iter().position(|(p, _)| *p == slot.param) {
                    Some(i) => self.prefetched.remove(i).1,
                    None => self.gather(idx, node)?,
                };
                self.unpad_gathered(idx, flat, node)
            }
        };
        self.gathered.push((slot.param, full));
        Some(full)
    }

    /// The global parameter of local parameter `idx`.
    pub fn param(&self, idx: usize) -> Option<&Param> {
        let id = self.locals.get(idx)?.param;
        self.params.table.params.get(id.0 as usize)
    }

    /// The name of local parameter `idx` (`blocks.3.attn.wqkv`), for its buffers' names.
    pub fn param_name(&self, idx: usize) -> String {
        self.param(idx).map(|p| p.name.clone()).unwrap_or_default()
    }

    /// The buffer a gather of local parameter `idx`'s shards sends: its f32 master shard, or
    /// where compute reads it in bf16, a transient bf16 rounding of it made now (returned
    /// first, for the caller to free once the gather is done with it).
    pub fn shard_source(
        &mut self,
        idx: usize,
        node: Option<NodeId>,
        phase: Phase,
    ) -> (Option<BufferId>, BufferId) {
        let l = &self.locals[idx];
        let master = l.master;
        let (Some(z), true) = (l.zero, l.bf16) else {
            return (None, master);
        };
        let rounded = self.b.alloc_typed(
            format!("{}.shard_bf16", self.param_name(idx)),
            vec![z.shard_len],
            DType::Bf16,
            BufferKind::Comm,
        );
        self.b.compute(Op::Copy, &[master], &[rounded], node, phase);
        (Some(rounded), rounded)
    }

    /// All-gather local parameter `idx`'s ZeRO-3 shards into a transient flat buffer (the
    /// shards concatenated, padding included; bf16 where compute reads the parameter in bf16);
    /// [`Emitter::unpad_gathered`] makes the tensor.
    fn gather(&mut self, idx: usize, node: NodeId) -> Option<ShardGather> {
        let (z, bf16) = (self.locals[idx].zero?, self.locals[idx].bf16);
        let (rounded, source) = self.shard_source(idx, Some(node), self.phase);
        let flat = self.b.alloc_typed(
            format!("{}.gather", self.param_name(idx)),
            vec![u64::from(z.parts) * z.shard_len],
            if bf16 { DType::Bf16 } else { DType::F32 },
            BufferKind::Comm,
        );
        self.b
            .collective(CollectiveKind::AllGather, z.group, source, flat, Some(node));
        Some(ShardGather { flat, rounded })
    }

    /// Copy parameter `idx`'s gathered `flat` buffer (from [`Emitter::gather`]) into a full
    /// tensor of its shape for `node`, and free the gather's buffers. Emitted where `node` uses
    /// the parameter, not where the gather was issued, so a prefetched gather runs while the
    /// nodes in between compute (this copy is the first compute that waits for it).
    fn unpad_gathered(&mut self, idx: usize, gathered: ShardGather, node: NodeId) -> BufferId {
        let l = &self.locals[idx];
        let (shape, numel, bf16) = (l.shape.clone(), l.numel, l.bf16);
        let full = self.b.alloc_typed(
            format!("{}.full", self.param_name(idx)),
            shape,
            if bf16 { DType::Bf16 } else { DType::F32 },
            BufferKind::GatheredParam,
        );
        self.b.compute(
            Op::CopyRange {
                src_offset: 0,
                dst_offset: 0,
                len: numel,
            },
            &[gathered.flat],
            &[full],
            Some(node),
            self.phase,
        );
        gathered.release(&mut self.b);
        full
    }

    /// ZeRO-3 prefetch: issue the all-gathers of `node`'s parameters whose local name
    /// `wanted` accepts now, before the node emitted next, so they overlap with its compute
    /// (one node ahead); the node that uses them unpads them ([`Emitter::weight`]).
    pub fn prefetch(&mut self, node: NodeId, wanted: impl Fn(&str) -> bool) {
        if self.zero != ZeroStage::Zero3 {
            return;
        }
        let params: Vec<_> = self
            .params
            .slots(node)
            .iter()
            .filter(|s| wanted(s.local))
            .map(|s| s.param)
            .collect();
        for p in params {
            let Some(&idx) = self.local_of.get(&p) else {
                continue;
            };
            let prefetched = self.prefetched.iter().any(|(q, _)| *q == p);
            let kept = self.kept.iter().any(|(q, _)| *q == p);
            if self.locals[idx].zero.is_none() || prefetched || kept {
                continue;
            }
            if let Some(g) = self.gather(idx, node) {
                self.prefetched.push((p, g));
            }
        }
    }

    /// Free the gather buffers of prefetched parameters nobody used (end of a unit).
    pub fn drop_prefetched(&mut self) {
        for (_, g) in std::mem::take(&mut self.prefetched) {
            g.release(&mut self.b);
        }
    }

    /// Free the full tensors kept from a forward that its backward did not read (end of a
    /// backward unit).
    pub fn drop_kept(&mut self) {
        for (_, b) in std::mem::take(&mut self.kept) {
            self.b.release(b);
        }
    }

    /// Release the parameters gathered for the node just emitted, except those named in
    /// `keep`, which move to `kept`.
    pub fn end_node(&mut self) {
        let keep = std::mem::take(&mut self.keep);
        for (p, g) in std::mem::take(&mut self.gathered) {
            if keep.contains(&p) && !self.kept.iter().any(|(q, _)| *q == p) {
                self.kept.push((p, g));
            } else {
                self.b.release(g);
            }
        }
    }

    /// The gradient accumulator of a parameter of `node` (allocated on first use).
    pub fn grad(&mut self, node: NodeId, local: &str) -> Option<BufferId> {
        let slot = self.params.get(node, local)?;
        let idx = *self.local_of.get(&slot.param)?;
        Some(self.grad_buffer(idx))
    }

    /// Local parameter `idx`'s gradient accumulator, allocated (zeroed) the first time.
    pub fn grad_buffer(&mut self, idx: usize) -> BufferId {
        if let Some(g) = self.locals[idx].grad {
            return g;
        }
        let name = match self.locals[idx].groups_done {
            0 => format!("{}.grad", self.param_name(idx)),
            k => format!("{}.grad.g{k}", self.param_name(idx)),
        };
        let shape = self.locals[idx].shape.clone();
        let g = self.b.alloc(name, shape, BufferKind::Grad);
        self.locals[idx].grad = Some(g);
        g
    }

    /// Whether this rank adds a row-parallel bias (tp rank 0 only).
    pub fn adds_bias(&self, node: NodeId, local: &str) -> bool {
        match self.params.get(node, local) {
            None => false,
            Some(s) if s.rule == TpRule::RowParallelBias => self.tp_index == 0,
            Some(_) => true,
        }
    }

    /// One backward use of a parameter of `node` has been emitted.
    pub fn grad_used(&mut self, node: NodeId, local: &str) {
        let Some(slot) = self.params.get(node, local) else {
            return;
        };
        let Some(&idx) = self.local_of.get(&slot.param) else {
            return;
        };
        let l = &mut self.locals[idx];
        l.uses_left = l.uses_left.saturating_sub(1);
        if l.uses_left == 0 && !l.complete {
            self.complete_grad(idx);
        }
    }

    /// Sequence-parallel all-gather of a hidden value to full rows; returns a buffer with one
    /// new holder for the caller.
    pub fn sp_gather(&mut self, x: BufferId, cols: u64, name: String, node: NodeId) -> BufferId {
        match (self.sp, self.groups.tp) {
            (true, Some(g)) => {
                let full = self
                    .b
                    .alloc(name, vec![self.rows_full(), cols], BufferKind::Activation);
                self.b
                    .collective(CollectiveKind::AllGather, g, x, full, Some(node));
                full
            }
            _ => {
                self.b.retain(x);
                x
            }
        }
    }

    /// Whether sequence-parallel layers keep their input's sequence shard for backward rather
    /// than the all-gathered rows (`parallel.sp_save = sharded`).
    fn keeps_sp_shard(&self) -> bool {
        self.sp && self.groups.tp.is_some() && self.spec.parallel.sp_save == SpSave::Sharded
    }

    /// What a layer that all-gathered its input `x` into `xf` ([`Emitter::sp_gather`], whose
    /// holder this takes) saves for backward: `xf`, or `x` (one more holder) where it keeps
    /// the shard; [`Emitter::sp_regather`] undoes the difference.
    pub fn sp_saved_input(&mut self, x: BufferId, xf: BufferId) -> BufferId {
        if self.keeps_sp_shard() && x != xf {
            self.b.release(xf);
            self.b.retain(x);
            x
        } else {
            xf
        }
    }

    /// The full-row input a layer's backward reads, from the saved input of
    /// [`Emitter::sp_saved_input`], with one new holder for the caller: the shard all-gathered
    /// again (issued after the gather of dy, so it overlaps the GEMMs before the one that reads
    /// it), or the saved buffer itself.
    pub fn sp_regather(&mut self, saved: BufferId, name: String, node: NodeId) -> BufferId {
        let Some(g) = self.groups.tp.filter(|_| self.keeps_sp_shard()) else {
            self.b.retain(saved);
            return saved;
        };
        let cols = self.b.shape(saved).get(1).copied().unwrap_or(0);
        let full = self
            .b
            .alloc(name, vec![self.rows_full(), cols], BufferKind::Activation);
        self.b
            .collective(CollectiveKind::AllGather, g, saved, full, Some(node));
        full
    }

    /// Same as [`Emitter::sp_gather`] for a gradient in backward.
    pub fn sp_gather_grad(
        &mut self,
        dy: BufferId,
        cols: u64,
        name: String,
        node: NodeId,
    ) -> BufferId {
        match (self.sp, self.groups.tp) {
            (true, Some(g)) => {
                let full = self.b.alloc(
                    name,
                    vec![self.rows_full(), cols],
                    BufferKind::ActivationGrad,
                );
                self.b
                    .collective(CollectiveKind::AllGather, g, dy, full, Some(node));
                full
            }
            _ => {
                self.b.retain(dy);
                dy
            }
        }
    }

    /// Reduce tp partial sums of a full-row tensor: all-reduce in place, or reduce-scatter to
    /// the SP shard under sequence parallelism. Consumes `partial`'s holder.
    pub fn tp_reduce(
        &mut self,
        partial: BufferId,
        cols: u64,
        name: String,
        kind: BufferKind,
        node: NodeId,
    ) -> BufferId {
        let Some(g) = self.groups.tp else {
            return partial;
        };
        if self.sp {
            let out = self.b.alloc(name, vec![self.rows_hidden(), cols], kind);
            self.b
                .collective(CollectiveKind::ReduceScatter, g, partial, out, Some(node));
            self.b.release(partial);
            out
        } else {
            self.b.collective(
                CollectiveKind::AllReduce { op: ReduceOp::Sum },
                g,
                partial,
                partial,
                Some(node),
            );
            partial
        }
    }

    /// The gradient of `value` that an op about to be emitted may add its contribution into
    /// with its `+=` form (`MatmulBwdData`, `LayerNormBwd`, `RmsNormBwd` with `accumulate`),
    /// instead of writing a fresh buffer that [`Emitter::contribute`] then sums with an `Add`;
    /// None when the contribution must take that path.
    ///
    /// Safe exactly when the gradient's only holder is the gradient map: the lowering reads a
    /// buffer only through a holder (a node's `dy`, saved tensors, the gradient map, pipeline
    /// in/outboxes, recompute keeps) and drops it after its last read, so one holder means every
    /// other read of the current value — e.g. the other branch of an `Add` whose backward handed
    /// both inputs this same buffer — is already emitted, before the `+=` in program order (a
    /// rank runs its program in order; a backend orders a write after communication still
    /// reading the buffer). The one reader left is the consumer of `value`'s gradient, which
    /// wants the sum. The op's own inputs are holders too, so the target is never one of them
    /// (the verifier checks that, E0821). The caller must not all-reduce or reduce-scatter what
    /// it accumulates: a tp partial sum goes to [`Emitter::contribute`] after its reduction.
    /// `shape`: the contribution's (a gradient of another shape is not a target).
    pub fn accumulation_target(&self, mb: u32, value: ValueId, shape: &[u64]) -> Option<BufferId> {
        if !self.accumulate_in_place {
            return None;
        }
        let grad = *self.mbs.get(mb as usize)?.grads.get(&value)?;
        let alone = self.b.holders(grad) == 1;
        (alone && self.b.buffers.get(grad.0 as usize)?.shape == shape).then_some(grad)
    }

    /// Add a gradient contribution to `value` (takes ownership of `dx`'s holder).
    pub fn contribute(&mut self, mb: u32, value: ValueId, dx: BufferId, node: NodeId) {
        let existing = self.mbs[mb as usize].grads.get(&value).copied();
        match existing {
            None => {
                self.note_residual(value, dx);
                self.mbs[mb as usize].grads.insert(value, dx);
            }
            Some(prev) => {
                let shape = self.b.shape(prev);
                let name = buffer_name(&self.value_name(value), "dsum", mb);
                let sum = self.b.alloc(name, shape, BufferKind::ActivationGrad);
                self.b
                    .compute(Op::Add, &[prev, dx], &[sum], Some(node), Phase::Backward);
                self.b.release(prev);
                self.b.release(dx);
                self.note_residual(value, sum);
                self.mbs[mb as usize].grads.insert(value, sum);
            }
        }
    }

    /// `buffer` holds `value` or its gradient (for the residual stream's storage type).
    pub fn note_residual(&mut self, value: ValueId, buffer: BufferId) {
        if let Some(stream) = &mut self.residual {
            stream.hold(value, buffer);
        }
    }

    pub fn value_name(&self, v: ValueId) -> String {
        self.spec
            .model
            .values
            .get(v.0 as usize)
            .map(|x| x.name.clone())
            .unwrap_or_else(|| format!("v{}", v.0))
    }
}

/// `{base}.{what}@{mb}`, the name of a per-microbatch buffer, built in one allocation (lowering
/// names millions of buffers; `format!` grew each string several times).
pub fn buffer_name(base: &str, what: &str, mb: u32) -> String {
    let mut digits = [0u8; 10];
    let mut start = digits.len();
    let mut n = mb;
    loop {
        start -= 1;
        digits[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut name = String::with_capacity(base.len() + what.len() + 2 + digits.len() - start);
    name.push_str(base);
    name.push('.');
    name.push_str(what);
    name.push('@');
    for &d in &digits[start..] {
        name.push(char::from(d));
    }
    name
}

#[cfg(test)]
mod tests {
    use super::buffer_name;

    #[test]
    fn buffer_names_match_the_text_form() {
        for mb in [0, 7, 10, 63, 4_294_967_295] {
            assert_eq!(
                buffer_name("blocks.3.attn", "q", mb),
                format!("blocks.3.attn.q@{mb}")
            );
        }
    }
}
