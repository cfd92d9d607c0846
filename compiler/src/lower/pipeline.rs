//! One program's step: its pipeline units in schedule order with the grouped point-to-point
//! transfers between them (see `schedule`), each unit running its chunk's layers forward or
//! backward for one microbatch, recompute segments re-run before their backward, then the
//! gradient reductions and the optimizer (`optim`). An evaluation step (`eval`) runs the same
//! forward units alone, releasing what each node saves at once, and ends with the loss.
//!
//! Activation lifetimes: a value is held once per later consumer in its chunk (plus once when
//! it is sent on) and once by every saved-tensor list; the last release frees it. Recomputed
//! segments keep only their inputs through forward. A sent buffer is released after the unit
//! that follows its transfer group: a runtime may queue the group and go on (CUDA: NCCL's
//! stream) but orders a free after the transfer, which ends only once the peer has posted its
//! side, so a free right after the group would stall the sender until the peer reached it.

use super::backward::backward_reads;
use super::emitter::Emitter;
use super::schedule::{Dir, Timetable, Unit};
use crate::ir::op::segments_len;
use crate::ir::{BufferId, BufferKind, DType, Instr, P2pOp, Peer, Phase};
use crate::spec::{Axis, NodeId, ValueId, ZeroStage};
use std::collections::BTreeMap;

/// A transfer between chunk `from` and chunk `to` of one value for one microbatch.
struct Transfer {
    tick: u64,
    mb: u32,
    /// Chunk that produced it (sender side).
    from: u32,
    to: u32,
    value: ValueId,
    grad: bool,
    tag: u32,
}

impl Emitter<'_> {
    fn chunk_stage(&self, chunk: u32) -> u32 {
        let p = self.spec.parallel.mesh.size(Axis::Pp).max(1);
        chunk % p
    }

    fn transfers(&self, table: &Timetable) -> Vec<Transfer> {
        let chunks = self.chunks.count;
        let width = self
            .chunks
            .inputs
            .iter()
            .map(Vec::len)
            .max()
            .unwrap_or(1)
            .max(1) as u32;
        let mut out = Vec::new();
        for order in &table.orders {
            for (u, start) in order {
                let (from, to, grad, values) = match u.dir {
                    Dir::Forward if u.chunk + 1 < chunks => {
                        (u.chunk, u.chunk + 1, false, self.chunks.outputs(u.chunk))
                    }
                    Dir::Backward if u.chunk > 0 => (
                        u.chunk,
                        u.chunk - 1,
                        true,
                        self.chunks
                            .inputs
                            .get(u.chunk as usize)
                            .map(Vec::as_slice)
                            .unwrap_or(&[]),
                    ),
                    _ => continue,
                };
                let boundary = from.min(to);
                for (k, v) in values.iter().enumerate() {
                    let tag = ((u.microbatch * chunks + boundary) * width + k as u32) * 2
                        + u32::from(grad);
                    out.push(Transfer {
                        tick: start + 1,
                        mb: u.microbatch,
                        from,
                        to,
                        value: *v,
                        grad,
                        tag,
                    });
                }
            }
        }
        out
    }

    /// Emit this stage's whole step.
    pub fn emit_step(&mut self, table: &Timetable) {
        if let Some(loss) = self.loss {
            self.b
                .compute(crate::ir::op::Op::Zero, &[], &[loss], None, Phase::Forward);
        }
        let transfers = self.transfers(table);
        let mut groups: BTreeMap<u64, Vec<&Transfer>> = BTreeMap::new();
        for t in &transfers {
            if self.chunk_stage(t.from) == self.stage || self.chunk_stage(t.to) == self.stage {
                groups.entry(t.tick).or_default().push(t);
            }
        }
        let order = table
            .orders
            .get(self.stage as usize)
            .cloned()
            .unwrap_or_default();
        let mut units: BTreeMap<u64, Unit> = BTreeMap::new();
        for (u, start) in order {
            units.insert(start, u);
        }
        let last_tick = groups
            .keys()
            .chain(units.keys())
            .copied()
            .max()
            .unwrap_or(0);
        // Sent buffers wait here until the next unit has been emitted (see the module docs).
        let mut in_flight: Vec<BufferId> = Vec::new();
        for tick in 0..=last_tick {
            if let Some(ts) = groups.get(&tick) {
                let mut ts = ts.clone();
                ts.sort_by_key(|t| t.tag);
                let sent = self.emit_p2p(&ts);
                in_flight.extend(sent);
            }
            if let Some(u) = units.get(&tick).copied() {
                let sent_before = std::mem::take(&mut in_flight);
                match u.dir {
                    Dir::Forward => {
                        let next = units.range(tick + 1..).next().map(|(_, n)| *n);
                        let backward_next = next
                            == Some(Unit {
                                dir: Dir::Backward,
                                ..u
                            });
                        self.forward_unit(u.microbatch, u.chunk, backward_next);
                    }
                    Dir::Backward => self.backward_unit(u.microbatch, u.chunk),
                }
                for buf in sent_before {
                    self.b.release(buf);
                }
            }
        }
        for buf in in_flight {
            self.b.release(buf);
        }
        if self.evaluating {
            self.reduce_loss();
        } else {
            self.finish_step();
        }
    }

    /// Emit one grouped transfer; returns the buffers it sends, for the caller to release.
    fn emit_p2p(&mut self, ts: &[&Transfer]) -> Vec<BufferId> {
        let mut ops = Vec::new();
        let mut sent = Vec::new();
        for t in ts {
            let mb = t.mb as usize;
            if self.chunk_stage(t.from) == self.stage {
                let key = (t.from, t.value, t.grad);
                let Some(buf) = self.mbs[mb].outbox.remove(&key) else {
                    continue;
                };
                ops.push(P2pOp::Send {
                    peer: Peer {
                        axis: Axis::Pp,
                        coord: self.chunk_stage(t.to),
                    },
                    buffer: buf,
                    tag: t.tag,
                });
                sent.push(buf);
            } else {
                let cols = match self
                    .spec
                    .model
                    .values
                    .get(t.value.0 as usize)
                    .map(|v| &v.shape)
                {
                    Some(crate::spec::Shape::Hidden(n)) => *n,
                    _ => 1,
                };
                let kind = if t.grad {
                    BufferKind::ActivationGrad
                } else {
                    BufferKind::Activation
                };
                let what = if t.grad { "recv_grad" } else { "recv" };
                let name = super::emitter::buffer_name(&self.value_name(t.value), what, t.mb);
                let buf = self.b.alloc(name, vec![self.rows_hidden(), cols], kind);
                // Typed as the sender's buffer: both sides know the value.
                self.note_residual(t.value, buf);
                self.mbs[mb].inbox.insert((t.to, t.value, t.grad), buf);
                ops.push(P2pOp::Recv {
                    peer: Peer {
                        axis: Axis::Pp,
                        coord: self.chunk_stage(t.from),
                    },
                    buffer: buf,
                    tag: t.tag,
                });
            }
        }
        self.b.p2p(ops);
        sent
    }

    fn node_range(&self, chunk: u32) -> (usize, usize) {
        self.chunks
            .ranges
            .get(chunk as usize)
            .copied()
            .unwrap_or((0, 0))
    }

    /// Consumers of `v` among nodes `[from, to)`.
    fn consumers(&self, v: ValueId, from: usize, to: usize) -> u32 {
        self.spec.model.nodes[from..to]
            .iter()
            .filter(|n| n.inputs.contains(&v))
            .count() as u32
    }

    fn hold(&mut self, buf: BufferId, count: u32) {
        if count == 0 {
            self.b.release(buf);
        }
        for _ in 1..count {
            self.b.retain(buf);
        }
    }

    /// `backward_next`: this stage runs the same microbatch's backward through `chunk` right
    /// after, so the ZeRO-3 weights of the last node with parameters stay gathered for it
    /// ([`Emitter::kept`]; as FSDP keeps the root unsharded after forward and DeepSpeed keeps a
    /// parameter reused within its reuse distance): the backward starts with no gather to wait
    /// for (the fused loss, the only node after the head, has no backward compute to hide one
    /// behind) and one all-gather per microbatch fewer. It holds no more memory than the
    /// backward of that node does.
    fn forward_unit(&mut self, mb: u32, chunk: u32, backward_next: bool) {
        let (start, end) = self.node_range(chunk);
        let keep_at = if backward_next {
            self.keep_for_backward(start..end)
        } else {
            None
        };
        let m = mb as usize;
        let model = &self.spec.model;
        let (tokens_v, targets_v) = (model.tokens, model.targets);
        let need_tokens = self.consumers(tokens_v, start, end) > 0;
        let need_targets = self.consumers(targets_v, start, end) > 0;
        if need_tokens || need_targets {
            let local_seq = u64::from(segments_len(&self.positions));
            let shape = vec![local_seq, self.micro_batch];
            let tokens = need_tokens.then(|| {
                self.b.alloc_typed(
                    format!("tokens@{mb}"),
                    shape.clone(),
                    DType::I32,
                    BufferKind::Input,
                )
            });
            let targets = need_targets.then(|| {
                self.b.alloc_typed(
                    format!("targets@{mb}"),
                    shape.clone(),
                    DType::I32,
                    BufferKind::Input,
                )
            });
            self.b.push(Instr::LoadBatch {
                microbatch: mb,
                positions: self.positions.clone(),
                tokens,
                targets,
            });
            self.mbs[m].tokens = tokens;
            self.mbs[m].targets = targets;
        }
        let received: Vec<ValueId> = self
            .chunks
            .inputs
            .get(chunk as usize)
            .cloned()
            .unwrap_or_default();
        let outputs: Vec<ValueId> = self.chunks.outputs(chunk).to_vec();
        for v in &received {
            if let Some(buf) = self.mbs[m].inbox.remove(&(chunk, *v, false)) {
                self.mbs[m].values.insert(*v, buf);
                let count = self.consumers(*v, start, end) + u32::from(outputs.contains(v));
                self.hold(buf, count);
            }
        }
        self.phase = Phase::Forward;
        for i in start..end {
            let node = NodeId(i as u32);
            let (inputs, output) = {
                let n = &self.spec.model.nodes[i];
                (n.inputs.clone(), n.output)
            };
            if let Some(seg) = self.segments[i] {
                for v in &inputs {
                    let produced_inside = self.spec.model.nodes[start..i]
                        .iter()
                        .enumerate()
                        .any(|(j, n)| n.output == *v && self.segments[start + j] == Some(seg));
                    let kept = self.mbs[m]
                        .seg_keep
                        .iter()
                        .any(|(s, kv, _)| *s == seg && kv == v);
                    if produced_inside || kept {
                        continue;
                    }
                    let buf = if *v == tokens_v {
                        self.mbs[m].tokens
                    } else if *v == targets_v {
                        self.mbs[m].targets
                    } else {
                        self.mbs[m].values.get(v).copied()
                    };
                    if let Some(buf) = buf {
                        self.b.retain(buf);
                        self.mbs[m].seg_keep.push((seg, *v, buf));
                    }
                }
            }
            if i == start {
                self.prefetch_next(start..end);
            }
            self.prefetch_next(i + 1..end);
            if let Some((at, params)) = &keep_at {
                if *at == i {
                    self.keep = params.clone();
                }
            }
            let saved = self.forward_node(mb, node);
            // No backward will read what the node saved in an evaluation step.
            if self.segments[i].is_some() || self.evaluating {
                for s in saved {
                    self.b.release(s);
                }
            } else {
                self.mbs[m].saved.insert(node, saved);
            }
            if let Some(buf) = self.mbs[m].values.get(&output).copied() {
                let count =
                    self.consumers(output, i + 1, end) + u32::from(outputs.contains(&output));
                self.hold(buf, count);
            }
            let mut distinct = inputs.clone();
            distinct.sort();
            distinct.dedup();
            for v in distinct {
                if v == tokens_v || v == targets_v {
                    continue;
                }
                if let Some(buf) = self.mbs[m].values.get(&v).copied() {
                    self.b.release(buf);
                }
            }
        }
        self.drop_prefetched();
        // The last backward's reduce-scatters ran while this forward computed: their inputs go
        // now, before the next backward allocates its first gradient.
        self.settle_scattered();
        for v in &outputs {
            if let Some(buf) = self.mbs[m].values.get(v).copied() {
                self.mbs[m].outbox.insert((chunk, *v, false), buf);
            }
        }
        self.mbs[m].values.clear();
        if let Some(t) = self.mbs[m].tokens.take() {
            self.b.release(t);
        }
        if let Some(t) = self.mbs[m].targets.take() {
            self.b.release(t);
        }
    }

    fn backward_unit(&mut self, mb: u32, chunk: u32) {
        let (start, end) = self.node_range(chunk);
        let m = mb as usize;
        let outputs: Vec<ValueId> = self.chunks.outputs(chunk).to_vec();
        for v in &outputs {
            if let Some(buf) = self.mbs[m].inbox.remove(&(chunk, *v, true)) {
                self.contribute(mb, *v, buf, NodeId(start as u32));
            }
        }
        let mut recomputed: Vec<u32> = Vec::new();
        self.phase = Phase::Backward;
        for i in (start..end).rev() {
            let node = NodeId(i as u32);
            if i + 1 == end {
                self.prefetch_prev(start..end, &recomputed);
            }
            self.prefetch_prev(start..i, &recomputed);
            if let Some(seg) = self.segments[i] {
                if !recomputed.contains(&seg) {
                    recomputed.push(seg);
                    self.recompute_segment(mb, seg, start, end);
                }
            }
            let saved = self.mbs[m].saved.remove(&node).unwrap_or_default();
            self.backward_node(mb, node, saved);
            if let Some(seg) = self.segments[i] {
                let first = i == start || self.segments[i - 1] != Some(seg);
                if first {
                    let keep = std::mem::take(&mut self.mbs[m].seg_keep);
                    let (done, rest): (Vec<_>, Vec<_>) =
                        keep.into_iter().partition(|(s, _, _)| *s == seg);
                    self.mbs[m].seg_keep = rest;
                    for (_, _, buf) in done {
                        self.b.release(buf);
                    }
                }
            }
        }
        self.drop_prefetched();
        self.drop_kept();
        let inputs: Vec<ValueId> = self
            .chunks
            .inputs
            .get(chunk as usize)
            .cloned()
            .unwrap_or_default();
        for v in &inputs {
            let buf = match self.mbs[m].grads.remove(v) {
                Some(b) => b,
                None => {
                    let cols = match self.spec.model.values.get(v.0 as usize).map(|x| &x.shape) {
                        Some(crate::spec::Shape::Hidden(n)) => *n,
                        _ => 1,
                    };
                    let name = format!("{}.zero_grad@{mb}", self.value_name(*v));
                    let zero = self.b.alloc(
                        name,
                        vec![self.rows_hidden(), cols],
                        BufferKind::ActivationGrad,
                    );
                    self.note_residual(*v, zero);
                    zero
                }
            };
            self.mbs[m].outbox.insert((chunk, *v, true), buf);
        }
        let leftover: Vec<BufferId> = self.mbs[m].grads.drain().map(|(_, b)| b).collect();
        for b in leftover {
            self.b.release(b);
        }
        if matches!(self.zero, ZeroStage::Zero2 | ZeroStage::Zero3) {
            // The unit's last gradients are reduce-scattered now, overlapping the next unit,
            // rather than waiting in a bucket alongside the next microbatch's.
            self.flush_bucket();
        }
    }

    /// The last node in `range` with parameters and the ZeRO-3 parameters of it that its
    /// backward reads, if that node is not recomputed (a recompute would take them first).
    fn keep_for_backward(
        &self,
        range: std::ops::Range<usize>,
    ) -> Option<(usize, Vec<crate::ir::ParamId>)> {
        if self.zero != ZeroStage::Zero3 {
            return None;
        }
        let j = range
            .rev()
            .find(|&j| !self.params.slots(NodeId(j as u32)).is_empty())?;
        if self.segments[j].is_some() {
            return None;
        }
        let params: Vec<_> = self
            .params
            .slots(NodeId(j as u32))
            .iter()
            .filter(|s| self.read_in_backward(j, s.local, &[]))
            .map(|s| s.param)
            .collect();
        (!params.is_empty()).then_some((j, params))
    }

    /// Prefetch the parameters of the first node in `range` that has any.
    fn prefetch_next(&mut self, range: std::ops::Range<usize>) {
        let next = range
            .into_iter()
            .find(|&j| !self.params.slots(NodeId(j as u32)).is_empty());
        if let Some(j) = next {
            self.prefetch(NodeId(j as u32), |_| true);
        }
    }

    /// Whether node `j`'s backward reads its parameter `local`: all of them where its recompute
    /// segment is still to re-run its forward (not in `recomputed`), else those
    /// [`backward_reads`] names.
    fn read_in_backward(&self, j: usize, local: &str, recomputed: &[u32]) -> bool {
        self.segments[j].is_some_and(|s| !recomputed.contains(&s))
            || self
                .spec
                .model
                .nodes
                .get(j)
                .is_some_and(|n| backward_reads(&n.kind, local))
    }

    /// Prefetch, for backward, the parameters of the last node in `range` that reads any
    /// (`recomputed`: the segments whose forward already re-ran).
    fn prefetch_prev(&mut self, range: std::ops::Range<usize>, recomputed: &[u32]) {
        let prev = range.into_iter().rev().find(|&j| {
            self.params
                .slots(NodeId(j as u32))
                .iter()
                .any(|s| self.read_in_backward(j, s.local, recomputed))
        });
        if let Some(j) = prev {
            let wanted: Vec<&'static str> = self
                .params
                .slots(NodeId(j as u32))
                .iter()
                .map(|s| s.local)
                .filter(|l| self.read_in_backward(j, l, recomputed))
                .collect();
            self.prefetch(NodeId(j as u32), |l| wanted.contains(&l));
        }
    }

    /// Re-run a recompute segment's forward from its kept inputs, refilling its saved tensors.
    fn recompute_segment(&mut self, mb: u32, seg: u32, start: usize, end: usize) {
        let m = mb as usize;
        let outer = std::mem::take(&mut self.mbs[m].values);
        let (outer_tokens, outer_targets) = (self.mbs[m].tokens, self.mbs[m].targets);
        let keep: Vec<(ValueId, BufferId)> = self.mbs[m]
            .seg_keep
            .iter()
            .filter(|(s, _, _)| *s == seg)
            .map(|(_, v, b)| (*v, *b))
            .collect();
        for (v, b) in keep {
            if v == self.spec.model.tokens {
                self.mbs[m].tokens = Some(b);
            } else if v == self.spec.model.targets {
                self.mbs[m].targets = Some(b);
            } else {
                self.mbs[m].values.insert(v, b);
            }
        }
        self.phase = Phase::Recompute;
        let mut produced = Vec::new();
        for i in start..end {
            if self.segments[i] != Some(seg) {
                continue;
            }
            let node = NodeId(i as u32);
            let saved = self.forward_node(mb, node);
            self.mbs[m].saved.insert(node, saved);
            let out = self.spec.model.nodes[i].output;
            if let Some(buf) = self.mbs[m].values.get(&out) {
                produced.push(*buf);
            }
        }
        for b in produced {
            self.b.release(b);
        }
        self.mbs[m].values = outer;
        self.mbs[m].tokens = outer_tokens;
        self.mbs[m].targets = outer_targets;
        self.phase = Phase::Backward;
    }
}
