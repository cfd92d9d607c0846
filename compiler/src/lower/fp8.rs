//! FP8 GEMMs in a lowered program: the GEMM ops (forward, data and weight gradient, and their
//! recomputed and evaluation copies) that `crate::fp8` chose, per layer and layout, get the
//! recipe's `fp8` attribute as they are emitted, with each operand's split across ranks, and, for every
//! operand whose scale groups span ranks, the amaxes the GEMM reads: an `Fp8Amax` of the
//! operand's piece, max all-reduced over exactly the ranks holding the group's other pieces
//! (`ir::fp8`, docs/fp8.md). Which GEMMs and why is decided once per plan, not here.
//!
//! The split is what this program holds of the single-rank run's operand: a weight is cut by
//! tp along the dimension of its `TpSplit` (rows: column-parallel, columns: row-parallel); a
//! token operand's rows by cp (each cp rank holds its chunks of the sequence) and by tp where
//! the buffer holds a sequence-parallel shard, its columns as the weight's dimension they meet
//! (x's columns are W's columns, dy's are W's rows). Data parallelism splits nothing: each dp
//! rank's microbatch is its own tensor, as each microbatch is in the single-rank run.

use super::emitter::Emitter;
use crate::diag::Diagnostic;
use crate::fp8::GemmLayout;
use crate::ir::fp8::{operands, Axes, Fp8AmaxAttrs, Fp8Gemm, Fp8Operand, Fp8Split, OperandKind};
use crate::ir::op::Op;
use crate::ir::{BufferId, BufferKind, CollectiveKind, GroupId, Phase, ReduceOp};
use crate::spec::{Axis, NodeId};

/// An FP8 GEMM about to be emitted: its attribute and the amax buffers it reads (released by
/// [`Emitter::fp8_done`] once the GEMM is emitted).
pub(super) struct Fp8Emitted {
    pub attr: Option<Fp8Gemm>,
    pub amax: Vec<BufferId>,
}

impl Emitter<'_> {
    /// The `fp8` attribute of `node`'s GEMM `gemm` (of microbatch `mb`) whose weight is `w`,
    /// whose first two `inputs` are its quantized operands, in `phase`; for each operand whose
    /// scale groups span ranks, its amaxes emitted here and reduced over those ranks, which the
    /// GEMM takes as its last inputs. Nothing for a GEMM that stays bf16 (`crate::fp8` chose
    /// bf16 for this node's layout of `gemm`).
    pub(super) fn fp8_gemm(
        &mut self,
        (mb, node, w): (u32, NodeId, &str),
        gemm: GemmLayout,
        inputs: &[BufferId],
        phase: Phase,
    ) -> Fp8Emitted {
        let layers = self.fp8.filter(|l| l.runs(node, gemm));
        let (Some(layers), Some(&[a, b])) = (layers, inputs.get(..2)) else {
            return Fp8Emitted {
                attr: None,
                amax: Vec::new(),
            };
        };
        let operands = [a, b];
        let attr = Fp8Gemm {
            split: self.fp8_splits(node, w, gemm, operands),
            ..layers.attr
        };
        let of = quantized(gemm, attr);
        let mut amax = Vec::new();
        for (i, (buf, axes)) in operands.into_iter().zip(attr.shared(of)).enumerate() {
            if axes.is_empty() {
                continue;
            }
            let what = format!("{w}.{}.amax{i}", gemm.name());
            let name = self.name(node, &what, mb);
            amax.extend(self.reduced_amax((node, name), buf, (of[i], attr), axes, phase));
        }
        Fp8Emitted {
            attr: Some(attr),
            amax,
        }
    }

    /// Release the amax buffers of a GEMM just emitted.
    pub(super) fn fp8_done(&mut self, emitted: Fp8Emitted) {
        for a in emitted.amax {
            self.b.release(a);
        }
    }

    /// How this program's `operands` of `node`'s GEMM `gemm` are cut out of the single-rank
    /// run's (the module doc).
    fn fp8_splits(
        &self,
        node: NodeId,
        w: &str,
        gemm: GemmLayout,
        operands: [BufferId; 2],
    ) -> [Fp8Split; 2] {
        let split_tp = |dim: u32| {
            (self.params.get(node, w))
                .and_then(|slot| self.local_of.get(&slot.param))
                .and_then(|&i| self.locals.get(i)?.tp)
                .is_some_and(|t| t.parts > 1 && t.dim == dim)
        };
        let (w_rows, w_cols) = (
            Axes::NONE.with_if(split_tp(0), Axis::Tp),
            Axes::NONE.with_if(split_tp(1), Axis::Tp),
        );
        let tokens = |buf: BufferId, cols: Axes| {
            let rows = self.b.shape(buf).first().copied().unwrap_or(0);
            let sp_shard = self.tp > 1 && rows < self.rows_full();
            Fp8Split {
                rows: Axes::NONE
                    .with_if(self.cp > 1, Axis::Cp)
                    .with_if(sp_shard, Axis::Tp),
                cols,
            }
        };
        let weight = Fp8Split {
            rows: w_rows,
            cols: w_cols,
        };
        let [a, b] = operands;
        match gemm {
            GemmLayout::Fwd => [tokens(a, w_cols), weight],
            GemmLayout::BwdData => [tokens(a, w_rows), weight],
            GemmLayout::BwdWeight => [tokens(a, w_rows), tokens(b, w_cols)],
        }
    }

    /// The amaxes of operand `buf` (`operand` of GEMM `g`), computed on this piece and max
    /// all-reduced over the ranks of `axes`: a transient the GEMM reads (None, and a lowering
    /// error, where the plan has no group family spanning exactly `axes`).
    fn reduced_amax(
        &mut self,
        (node, name): (NodeId, String),
        buf: BufferId,
        (operand, g): (Fp8Operand, Fp8Gemm),
        axes: Axes,
        phase: Phase,
    ) -> Option<BufferId> {
        let Some(group) = self.group_over(axes) else {
            let msg = format!(
                "internal lowering error: no process group spans exactly {axes} for the FP8 amax of `{}`",
                self.node_name(node)
            );
            self.errors.push(Diagnostic::error("E0804", msg));
            return None;
        };
        let shape = self.b.shape(buf);
        let (rows, cols) = match shape.as_slice() {
            [r, c] => (*r, *c),
            [n] => (1, *n),
            _ => (1, shape.iter().product()),
        };
        let attrs = Fp8AmaxAttrs {
            operand,
            scaling: g.scaling,
            rows: (operand.kind == OperandKind::Weight).then_some(rows),
            cols,
        };
        let groups = operand.groups(g.scaling, rows, cols);
        let amax = self.b.alloc(name, vec![groups], BufferKind::Comm);
        self.b
            .compute(Op::Fp8Amax(attrs), &[buf], &[amax], Some(node), phase);
        let max = CollectiveKind::AllReduce { op: ReduceOp::Max };
        self.b.collective(max, group, amax, amax, Some(node));
        Some(amax)
    }

    /// The plan's group family spanning exactly `axes`.
    fn group_over(&self, axes: Axes) -> Option<GroupId> {
        if axes == Axes::of(&[Axis::Tp]) {
            self.groups.tp
        } else if axes == Axes::of(&[Axis::Cp]) {
            self.groups.cp
        } else if axes == Axes::of(&[Axis::Cp, Axis::Tp]) {
            self.groups.cptp
        } else {
            None
        }
    }
}

/// The two quantized operands of GEMM `gemm` under `g`, in its input order.
fn quantized(gemm: GemmLayout, g: Fp8Gemm) -> [Fp8Operand; 2] {
    match gemm {
        GemmLayout::Fwd => operands::forward(g),
        GemmLayout::BwdData => operands::bwd_data(g),
        GemmLayout::BwdWeight => operands::bwd_weight(g),
    }
}
