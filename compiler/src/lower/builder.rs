//! Emits one program's buffers and instructions, and tracks transient buffer lifetimes with
//! reference counts: a buffer is freed (an explicit `Free`) when its last holder releases it,
//! so every activation dies right after its last use in forward or backward.

use crate::ir::op::Op;
use crate::ir::{
    Buffer, BufferId, BufferKind, CollectiveKind, DType, GroupId, Inputs, Instr, Outputs, P2pOp,
    Phase,
};
use crate::spec::NodeId;
use std::mem::Discriminant;
use std::sync::Arc;

/// Equal ops emitted by one program share one allocation: a program repeats the same few
/// dozen ops (one per layer shape and phase) in every microbatch.
#[derive(Default)]
struct OpPool {
    /// Distinct ops seen so far, grouped by variant (a program uses a few dozen variants, so a
    /// scan beats hashing); at most [`OpPool::PER_VARIANT`] each, so the scan stays short (ops
    /// past that, e.g. many distinct `CopyRange`s, get their own allocation).
    by_variant: Vec<(Discriminant<Op>, Vec<Arc<Op>>)>,
}

impl OpPool {
    const PER_VARIANT: usize = 64;

    fn share(&mut self, op: Op) -> Arc<Op> {
        let variant = std::mem::discriminant(&op);
        let slot = match self.by_variant.iter().position(|(v, _)| *v == variant) {
            Some(i) => i,
            None => {
                self.by_variant.push((variant, Vec::new()));
                self.by_variant.len() - 1
            }
        };
        let seen = &mut self.by_variant[slot].1;
        if let Some(same) = seen.iter().find(|s| ***s == op) {
            return Arc::clone(same);
        }
        let op = Arc::new(op);
        if seen.len() < Self::PER_VARIANT {
            seen.push(Arc::clone(&op));
        }
        op
    }
}

pub struct ProgramBuilder {
    pub buffers: Vec<Buffer>,
    pub instrs: Vec<Instr>,
    refs: Vec<u32>,
    ops: OpPool,
    /// Compute ops given more buffers than [`Inputs`] or [`Outputs`] hold (not emitted; a
    /// lowering bug reported after the step).
    pub oversized: u32,
}

impl ProgramBuilder {
    pub fn with_capacity(instrs: usize, buffers: usize) -> ProgramBuilder {
        ProgramBuilder {
            buffers: Vec::with_capacity(buffers),
            instrs: Vec::with_capacity(instrs),
            refs: Vec::with_capacity(buffers),
            ops: OpPool::default(),
            oversized: 0,
        }
    }

    /// Declare a buffer without allocating it (persistent buffers, or ones allocated later).
    pub fn declare(
        &mut self,
        name: String,
        shape: Vec<u64>,
        dtype: DType,
        kind: BufferKind,
    ) -> BufferId {
        let id = BufferId(self.buffers.len() as u32);
        self.buffers.push(Buffer {
            name,
            shape,
            dtype,
            kind,
        });
        self.refs.push(0);
        id
    }

    /// Declare and allocate a transient f32 buffer with one holder.
    pub fn alloc(&mut self, name: String, shape: Vec<u64>, kind: BufferKind) -> BufferId {
        self.alloc_typed(name, shape, DType::F32, kind)
    }

    pub fn alloc_typed(
        &mut self,
        name: String,
        shape: Vec<u64>,
        dtype: DType,
        kind: BufferKind,
    ) -> BufferId {
        let id = self.declare(name, shape, dtype, kind);
        self.instrs.push(Instr::Alloc { buffer: id });
        if let Some(r) = self.refs.get_mut(id.0 as usize) {
            *r = 1;
        }
        id
    }

    pub fn shape(&self, id: BufferId) -> Vec<u64> {
        self.buffers
            .get(id.0 as usize)
            .map(|b| b.shape.clone())
            .unwrap_or_default()
    }

    fn persistent(&self, id: BufferId) -> bool {
        self.buffers
            .get(id.0 as usize)
            .is_some_and(|b| b.kind.is_persistent())
    }

    /// Add a holder to a transient buffer (no-op for persistent ones).
    pub fn retain(&mut self, id: BufferId) {
        if self.persistent(id) {
            return;
        }
        if let Some(r) = self.refs.get_mut(id.0 as usize) {
            *r += 1;
        }
    }

    /// Drop a holder; the last one frees the buffer.
    pub fn release(&mut self, id: BufferId) {
        if self.persistent(id) {
            return;
        }
        if let Some(r) = self.refs.get_mut(id.0 as usize) {
            if *r > 0 {
                *r -= 1;
                if *r == 0 {
                    self.instrs.push(Instr::Free { buffer: id });
                }
            }
        }
    }

    /// How many holders a transient buffer has (0 once freed; persistent buffers report 0,
    /// they are not counted).
    pub fn holders(&self, id: BufferId) -> u32 {
        self.refs.get(id.0 as usize).copied().unwrap_or(0)
    }

    /// Transient buffers still held (a lowering bug if non-empty at the end of a step).
    pub fn live_transients(&self) -> Vec<BufferId> {
        self.refs
            .iter()
            .enumerate()
            .filter(|(_, r)| **r > 0)
            .map(|(i, _)| BufferId(i as u32))
            .collect()
    }

    pub fn compute(
        &mut self,
        op: Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
        node: Option<NodeId>,
        phase: Phase,
    ) {
        let (Some(inputs), Some(outputs)) =
            (Inputs::from_slice(inputs), Outputs::from_slice(outputs))
        else {
            self.oversized += 1;
            return;
        };
        self.instrs.push(Instr::Compute {
            op: self.ops.share(op),
            inputs,
            outputs,
            node,
            phase,
        });
    }

    pub fn collective(
        &mut self,
        kind: CollectiveKind,
        group: GroupId,
        input: BufferId,
        output: BufferId,
        node: Option<NodeId>,
    ) {
        self.instrs.push(Instr::Collective {
            kind,
            group,
            input,
            output,
            node,
        });
    }

    pub fn p2p(&mut self, ops: Vec<P2pOp>) {
        if ops.is_empty() {
            return;
        }
        self.instrs.push(Instr::P2p { ops });
    }

    /// Turns the `Matmul` that last wrote `y` into one that also adds `r` (`residual`), so
    /// that `y` becomes `y + r`, when that is the same as adding afterwards: the op is
    /// `node`'s in `phase`, writes `y` alone and has no activation or residual yet; no later
    /// instruction reads `y` (it would see the sum); `r` exists and is not written after it.
    /// Whether it did.
    pub fn add_residual(&mut self, y: BufferId, r: BufferId, node: NodeId, phase: Phase) -> bool {
        let Some(i) = self
            .instrs
            .iter()
            .rposition(|ins| ins.writes().contains(&y))
        else {
            return false;
        };
        let later = self.instrs.get(i + 1..).unwrap_or_default();
        if later.iter().any(|ins| {
            ins.reads().contains(&y)
                || ins.writes().contains(&r)
                || matches!(ins, Instr::Alloc { buffer } if *buffer == r)
        }) {
            return false;
        }
        let Some(c) = self.instrs.get(i).and_then(Instr::as_compute) else {
            return false;
        };
        let Op::Matmul {
            in_dim,
            out_dim,
            bias,
            act: None,
            residual: false,
            swiglu: false,
            fp8,
        } = *c.op
        else {
            return false;
        };
        if c.node != Some(node) || c.phase != phase || c.outputs.to_vec() != [y] {
            return false;
        }
        let outputs = *c.outputs;
        // r follows x, W and the bias, before any FP8 amax inputs (the op table's order).
        let mut with_r = c.inputs.to_vec();
        with_r.insert((2 + usize::from(bias)).min(with_r.len()), r);
        let Some(inputs) = Inputs::from_slice(&with_r) else {
            return false;
        };
        let op = self.ops.share(Op::Matmul {
            in_dim,
            out_dim,
            bias,
            act: None,
            residual: true,
            swiglu: false,
            fp8,
        });
        if let Some(slot) = self.instrs.get_mut(i) {
            *slot = Instr::Compute {
                op,
                inputs,
                outputs,
                node: Some(node),
                phase,
            };
        }
        true
    }

    pub fn push(&mut self, instr: Instr) {
        self.instrs.push(instr);
    }
}
