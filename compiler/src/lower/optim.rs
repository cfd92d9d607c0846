//! Gradient synchronisation and the optimizer step.
//!
//! - A gradient is *complete* once the last backward use of its reduction group is emitted:
//!   the step's under ZeRO-0/1, each microbatch's under ZeRO-2/3, whose full-size gradient
//!   buffer so lives only from its first write in a microbatch's backward to that microbatch's
//!   reduce-scatter (the next microbatch's first write allocates a new one). Then, if tp
//!   ranks hold different partial gradients of a replicated parameter (row-parallel biases,
//!   which only tp rank 0 adds, the per-head q/k norm weights, which each rank applies to its
//!   own heads, and, under sequence parallelism, every replicated parameter applied to
//!   sequence shards: norms, position embedding), it is all-reduced over tp.
//! - Data parallel (dp × cp, since cp ranks see different tokens of the same samples): without
//!   ZeRO, a large complete gradient is all-reduced alone in place at once; small ones are
//!   packed into flat buckets of `bucket_bytes` and each bucket is all-reduced (sum) as soon as
//!   it fills, so the runtime can overlap it with the rest of backward; the gradients are freed
//!   once packed and copied back out of the buckets only after the last bucket's all-reduce is
//!   queued, so no compute waits for an all-reduce while backward still runs (a read of the
//!   bucket, or its `Free`, would). ZeRO-2/3 reduce-scatter
//!   each bucket's gradients as they complete (padded flat copies, see `ir::program`), free the
//!   full gradients, and free the padded copies once the next bucket's reduce-scatters are
//!   queued; each backward unit ends by flushing its bucket. The first microbatch's
//!   reduce-scatter writes the fp32 shard; a later one writes a part that is added into the
//!   shard once the next bucket is queued (so compute does not wait on it). ZeRO-1 keeps full
//!   accumulators over the microbatches and reduce-scatters each bucket as its gradients
//!   complete in the last one. A reduce-scatter reads the gradient itself where it needs no
//!   padding; the inputs of a backward unit's last reduce-scatters are freed by the next
//!   forward unit ([`Emitter::settle_scattered`]), before the next backward allocates any.
//! - A parameter held by two pipeline stages (tied embedding and head) has its gradient
//!   all-reduced over the `embed` group (first and last stage) at the end of the step.
//! - Gradient norm: each program sums the squares of the gradient elements it owns — tp-split
//!   parameters on every tp rank, replicated ones on tp rank 0, the tied copy only on the
//!   owner's stage, ZeRO shards on every dp × cp rank, full gradients on cp rank 0 (dp ranks
//!   share programs, so without ZeRO the sum runs over pp × cp × tp and dp is left out) — then
//!   all-reduces the sum. `ClipCoef` and `AdamW`/`Sgd` run on each local master; then each
//!   working copy is refreshed from it: ZeRO-1/2 all-gather the updated shards (rounded to
//!   bf16 first where the working copy is bf16) and copy them into the working copy a bucket's
//!   worth of gathers later; a bf16 working copy without shards takes a rounding `Copy`.

use super::emitter::Emitter;
use super::params::TpRule;
use crate::ir::op::Op;
use crate::ir::{BufferId, BufferKind, CollectiveKind, DType, Phase, ReduceOp};
use crate::spec::{Optimizer, ZeroStage};
use std::collections::VecDeque;

/// Without ZeRO, a gradient of at least `bucket_bytes / IN_PLACE_FRACTION` bytes is all-reduced
/// on its own, in place (NCCL runs near its full bandwidth from a few MB: 25 MiB buckets put
/// GPT-2's 4 MB weight matrices in place), so only small gradients are copied into buckets.
const IN_PLACE_FRACTION: u64 = 8;

impl Emitter<'_> {
    fn needs_tp_sync(&self, rule: TpRule) -> bool {
        self.groups.tp.is_some()
            && (matches!(rule, TpRule::RowParallelBias | TpRule::PerHead)
                || (rule == TpRule::Replicated && self.sp))
    }

    /// The gradient of local parameter `idx` has received the last contribution of its
    /// reduction group (one microbatch's under ZeRO-2/3, else the step's).
    pub fn complete_grad(&mut self, idx: usize) {
        let grad = self.grad_buffer(idx);
        let l = &mut self.locals[idx];
        let group = l.groups_done;
        l.groups_done += 1;
        l.groups_left = l.groups_left.saturating_sub(1);
        l.complete = l.groups_left == 0;
        l.uses_left = l.group_uses;
        let rule = l.rule;
        if self.needs_tp_sync(rule) {
            if let Some(g) = self.groups.tp {
                self.b.collective(
                    CollectiveKind::AllReduce { op: ReduceOp::Sum },
                    g,
                    grad,
                    grad,
                    None,
                );
            }
        }
        if self.groups.dpcp.is_none() {
            self.locals[idx].final_grad = Some(grad);
            return;
        }
        if self.zero == ZeroStage::Zero0
            && self.locals[idx].numel * 4 * IN_PLACE_FRACTION >= self.bucket_bytes
        {
            // A large gradient is all-reduced alone, in place, as soon as it completes: no
            // copies into and out of a bucket (weight matrices, GPT-2's embedding); the small
            // ones (biases, norms) keep filling the bucket.
            let waiting = std::mem::replace(&mut self.bucket, vec![(idx, grad, group)]);
            self.flush_bucket();
            self.bucket = waiting;
            return;
        }
        self.bucket.push((idx, grad, group));
        // The bucket holds this group's gradient: a later group's first write allocates anew.
        self.locals[idx].grad = None;
        let bytes: u64 = self
            .bucket
            .iter()
            .map(|&(i, _, _)| self.locals[i].numel * 4)
            .sum();
        if bytes >= self.bucket_bytes {
            self.flush_bucket();
        }
    }

    /// Reduce the gradients waiting in the bucket over dp × cp.
    pub fn flush_bucket(&mut self) {
        let items = std::mem::take(&mut self.bucket);
        let Some(group) = self.groups.dpcp else {
            return;
        };
        if items.is_empty() {
            return;
        }
        if self.zero == ZeroStage::Zero0 {
            if let [(only, g, _)] = items.as_slice() {
                self.b.collective(
                    CollectiveKind::AllReduce { op: ReduceOp::Sum },
                    group,
                    *g,
                    *g,
                    None,
                );
                self.locals[*only].grad = Some(*g);
                self.locals[*only].final_grad = Some(*g);
                return;
            }
            let total: u64 = items.iter().map(|&(i, _, _)| self.locals[i].numel).sum();
            let first = items
                .first()
                .map(|&(i, _, _)| self.locals[i].param.0)
                .unwrap_or(0);
            let flat = self
                .b
                .alloc(format!("bucket.p{first}"), vec![total], BufferKind::Comm);
            let mut offset = 0;
            for &(i, g, _) in &items {
                let n = self.locals[i].numel;
                let op = Op::CopyRange {
                    src_offset: 0,
                    dst_offset: offset,
                    len: n,
                };
                self.b.compute(op, &[g], &[flat], None, Phase::Backward);
                offset += n;
                // The bucket holds the gradient now; `unpack_reduced` copies it back out.
                self.b.release(g);
            }
            self.b.collective(
                CollectiveKind::AllReduce { op: ReduceOp::Sum },
                group,
                flat,
                flat,
                None,
            );
            let items = items.into_iter().map(|(i, _, _)| i).collect();
            self.reduced.push((flat, items));
            return;
        }
        // The previous bucket's padded copies and parts: its reduce-scatters ran while this
        // bucket's backward computed.
        let scattered = std::mem::take(&mut self.scattered);
        let parts = std::mem::take(&mut self.scattered_parts);
        for (i, g, k) in items {
            let (n, zero) = (self.locals[i].numel, self.locals[i].zero);
            let Some(z) = zero else {
                self.locals[i].final_grad = Some(g);
                continue;
            };
            let name = self.param_name(i);
            let at = match k {
                0 => String::new(),
                k => format!(".g{k}"),
            };
            // The reduce-scatter reads the gradient itself where its shards need no padding,
            // else a zero-padded flat copy of it.
            let padded = if u64::from(z.parts) * z.shard_len == n {
                g
            } else {
                let padded = self.b.alloc(
                    format!("{name}.grad_flat{at}"),
                    vec![u64::from(z.parts) * z.shard_len],
                    BufferKind::Comm,
                );
                let op = Op::CopyRange {
                    src_offset: 0,
                    dst_offset: 0,
                    len: n,
                };
                self.b.compute(op, &[g], &[padded], None, Phase::Backward);
                self.b.release(g);
                padded
            };
            // The first microbatch's reduce-scatter writes the shard; later ones write a part
            // that `add_parts` adds into it.
            let suffix = match self.locals[i].final_grad {
                None => "grad_shard",
                Some(_) => "grad_part",
            };
            let shard = self.b.alloc(
                format!("{name}.{suffix}{at}"),
                vec![z.shard_len],
                BufferKind::Grad,
            );
            self.b
                .collective(CollectiveKind::ReduceScatter, group, padded, shard, None);
            self.scattered.push(padded);
            match self.locals[i].final_grad {
                None => self.locals[i].final_grad = Some(shard),
                Some(_) => self.scattered_parts.push((i, shard, k)),
            }
        }
        for padded in scattered {
            self.b.release(padded);
        }
        self.add_parts(parts);
    }

    /// Free the inputs of the reduce-scatters issued so far and add their parts into the
    /// shards (ZeRO-2/3): where the caller knows they have had time to finish.
    pub fn settle_scattered(&mut self) {
        for padded in std::mem::take(&mut self.scattered) {
            self.b.release(padded);
        }
        let parts = std::mem::take(&mut self.scattered_parts);
        self.add_parts(parts);
    }

    /// Add reduce-scattered parts of later microbatches' gradients into their accumulated
    /// shards (into a new buffer: an op whose output is its input costs the backend a copy).
    fn add_parts(&mut self, parts: Vec<(usize, BufferId, u32)>) {
        for (i, part, group) in parts {
            let Some(shard) = self.locals[i].final_grad else {
                continue;
            };
            let name = format!("{}.grad_shard.g{group}", self.param_name(i));
            let len = self.b.shape(shard);
            let sum = self.b.alloc(name, len, BufferKind::Grad);
            self.b
                .compute(Op::Add, &[shard, part], &[sum], None, Phase::Backward);
            self.b.release(shard);
            self.b.release(part);
            self.locals[i].final_grad = Some(sum);
        }
    }

    /// After the last bucket's all-reduce is queued: copy every reduced bucket's gradients
    /// into gradient buffers of their own, oldest bucket first (its all-reduce finishes first),
    /// and free the padded copies of the last reduce-scatters.
    fn unpack_reduced(&mut self) {
        for (flat, items) in std::mem::take(&mut self.reduced) {
            let mut offset = 0;
            for i in items {
                let (shape, n) = (self.locals[i].shape.clone(), self.locals[i].numel);
                let name = format!("{}.grad_reduced", self.param_name(i));
                let g = self.b.alloc(name, shape, BufferKind::Grad);
                self.locals[i].grad = Some(g);
                let op = Op::CopyRange {
                    src_offset: offset,
                    dst_offset: 0,
                    len: n,
                };
                self.b.compute(op, &[flat], &[g], None, Phase::Backward);
                offset += n;
                self.locals[i].final_grad = Some(g);
            }
            self.b.release(flat);
        }
        self.settle_scattered();
    }

    /// Sum the step's loss over dp × cp (each member holds its share of the global mean), on
    /// the programs that hold it.
    pub fn reduce_loss(&mut self) {
        if let (Some(loss), Some(g)) = (self.loss, self.groups.dpcp) {
            self.b.collective(
                CollectiveKind::AllReduce { op: ReduceOp::Sum },
                g,
                loss,
                loss,
                None,
            );
        }
    }

    /// Everything after the last backward unit: remaining reductions, loss, norm, optimizer.
    pub fn finish_step(&mut self) {
        for i in 0..self.locals.len() {
            if !self.locals[i].complete {
                self.complete_grad(i);
            }
        }
        self.flush_bucket();
        self.unpack_reduced();
        self.fp8_roll();
        if let Some(g) = self.groups.embed {
            for i in 0..self.locals.len() {
                if let (true, Some(fg)) = (self.locals[i].shared, self.locals[i].final_grad) {
                    self.b.collective(
                        CollectiveKind::AllReduce { op: ReduceOp::Sum },
                        g,
                        fg,
                        fg,
                        None,
                    );
                }
            }
        }
        self.reduce_loss();
        let sumsq = self.grad_sumsq;
        self.b
            .compute(Op::Zero, &[], &[sumsq], None, Phase::Optimizer);
        for i in 0..self.locals.len() {
            if let (true, Some(fg)) = (self.locals[i].in_norm, self.locals[i].final_grad) {
                self.b
                    .compute(Op::SumSquares, &[fg], &[sumsq], None, Phase::Optimizer);
            }
        }
        if let Some(g) = self.groups.norm {
            self.b.collective(
                CollectiveKind::AllReduce { op: ReduceOp::Sum },
                g,
                sumsq,
                sumsq,
                None,
            );
        }
        let coef = self
            .b
            .alloc("clip_coef".to_string(), vec![1], BufferKind::Comm);
        self.b.compute(
            Op::ClipCoef {
                max_norm: self.spec.train.grad_clip,
            },
            &[sumsq],
            &[coef],
            None,
            Phase::Optimizer,
        );
        // ZeRO-1/2 gathers of updated shards whose copy into the working copy is still to come.
        let mut gathering: VecDeque<Gathering> = VecDeque::new();
        let mut gathering_bytes = 0u64;
        for i in 0..self.locals.len() {
            let Some(fg) = self.locals[i].final_grad else {
                continue;
            };
            let l = &self.locals[i];
            let decay = self.param(i).is_some_and(|p| p.decay);
            let mut outs = vec![l.master];
            outs.extend(l.state.iter().copied());
            let op = self.update_op(decay);
            self.b
                .compute(op, &[fg, coef], &outs, None, Phase::Optimizer);
            self.b.release(fg);
            let Some(g) = self.refresh_working(i) else {
                continue;
            };
            gathering_bytes += g.bytes;
            gathering.push_back(g);
            // A gathered parameter is copied into its working copy once a bucket's worth of
            // later gathers is queued behind its own, so the compute stream does not wait
            // for each gather as soon as it is issued.
            while let Some(front) = gathering.front() {
                if gathering.len() < 2 || gathering_bytes - front.bytes < self.bucket_bytes {
                    break;
                }
                gathering_bytes -= front.bytes;
                if let Some(g) = gathering.pop_front() {
                    self.copy_gathered(g);
                }
            }
        }
        for g in gathering {
            self.copy_gathered(g);
        }
        self.b.release(coef);
    }

    /// The update of one parameter by the spec's optimizer (`decay`: weight decay applies).
    fn update_op(&self, decay: bool) -> Op {
        match self.spec.train.optimizer {
            Optimizer::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => Op::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay: if decay { weight_decay } else { 0.0 },
            },
            Optimizer::Sgd {
                momentum,
                weight_decay,
                ..
            } => Op::Sgd {
                momentum,
                weight_decay: if decay { weight_decay } else { 0.0 },
            },
        }
    }

    /// Bring local parameter `idx`'s working copy up to its just-updated master: a rounding
    /// copy where the master is the whole tp-local tensor (bf16 runs), or, under ZeRO-1/2, the
    /// all-gather of the updated shards (rounded to bf16 first where the working copy is bf16,
    /// which halves the gather) whose copy into the working copy the caller places.
    fn refresh_working(&mut self, idx: usize) -> Option<Gathering> {
        let l = &self.locals[idx];
        let (master, w, zero, numel, bf16) = (l.master, l.working?, l.zero, l.numel, l.bf16);
        let Some(z) = zero else {
            self.b
                .compute(Op::Copy, &[master], &[w], None, Phase::Optimizer);
            return None;
        };
        let (rounded, source) = self.shard_source(idx, None, Phase::Optimizer);
        let name = self.param_name(idx);
        let flat = self.b.alloc_typed(
            format!("{name}.param_flat"),
            vec![u64::from(z.parts) * z.shard_len],
            if bf16 { DType::Bf16 } else { DType::F32 },
            BufferKind::Comm,
        );
        self.b
            .collective(CollectiveKind::AllGather, z.group, source, flat, None);
        let bytes = numel * if bf16 { 2 } else { 4 };
        Some(Gathering {
            flat,
            rounded,
            working: w,
            numel,
            bytes,
        })
    }

    /// Copy an all-gathered parameter (`flat`, padding included) into its working copy, and
    /// free the gather's buffers.
    fn copy_gathered(&mut self, g: Gathering) {
        let op = Op::CopyRange {
            src_offset: 0,
            dst_offset: 0,
            len: g.numel,
        };
        self.b
            .compute(op, &[g.flat], &[g.working], None, Phase::Optimizer);
        self.b.release(g.flat);
        if let Some(r) = g.rounded {
            self.b.release(r);
        }
    }
}

/// A ZeRO-1/2 all-gather of an updated parameter, queued until its copy into the working copy.
struct Gathering {
    flat: BufferId,
    /// The bf16 rounding of the shard the gather sends, freed with `flat`.
    rounded: Option<BufferId>,
    working: BufferId,
    numel: u64,
    /// Bytes the gather moves into this rank.
    bytes: u64,
}
