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
//!
//! Delayed scaling (`Fp8Gemm::history`): every tensor an FP8 GEMM of this program quantizes
//! (a weight's x, W or dy, shared by the weight's GEMMs reading it: W by the forward and the
//! data gradient, dy by the data and the weight gradient, x by the forward and the weight
//! gradient, so they use one scale and one quantization can serve several) has two persistent
//! buffers ([`declare_histories`], declared after the metrics in the training and the
//! evaluation program alike): its amax history `[1, H + 1]` and its scale amax `[1]`. Each
//! GEMM records the same values into it that it did into a history of its own (the tensor is
//! the same), so sharing changes no scale. The GEMM reads the scale amax (no amax pass, no reduction before it); in
//! training (not in a recomputed forward, whose operands are the forward's, nor in evaluation)
//! an `Fp8AmaxRecord` before it max-accumulates the operand's amax into the history's step
//! slot. At the step's end ([`Emitter::fp8_roll`]) each history's step slot is max all-reduced
//! over the ranks holding pieces of the operand (`Fp8Gemm::shared`'s axes, as current scaling
//! reduces them) and then over dp, and `Fp8HistoryRoll` rolls it and writes the scale amax.

use super::builder::ProgramBuilder;
use super::context::{Fp8History as History, Fp8Layers};
use super::emitter::Emitter;
use crate::diag::Diagnostic;
use crate::fp8::GemmLayout;
use crate::ir::fp8::{
    operands, Axes, Fp8AmaxAttrs, Fp8Gemm, Fp8HistoryAttrs, Fp8Operand, Fp8Split, OperandKind,
};
use crate::ir::op::Op;
use crate::ir::{BufferId, BufferKind, CollectiveKind, DType, GroupId, Phase, ReduceOp};
use crate::spec::{Axis, NodeId, Spec};

/// The operand names of a GEMM layout, in its input order (the op table's roles).
fn operand_names(gemm: GemmLayout) -> [&'static str; 2] {
    match gemm {
        GemmLayout::Fwd => ["x", "w"],
        GemmLayout::BwdData => ["dy", "w"],
        GemmLayout::BwdWeight => ["dy", "x"],
    }
}

/// Declares the delayed-scaling buffers of every tensor FP8 GEMMs of the nodes in
/// `my_chunks` quantize (`ranges`: each chunk's node range), in model order: none without
/// delayed scaling. Named `NODE.WEIGHT.ROLE.amax_history` and `….amax` (ROLE `x`, `w` or
/// `dy`), the same in every plan, so checkpoints carry them across plans.
pub(super) fn declare_histories(
    b: &mut ProgramBuilder,
    (spec, fp8): (&Spec, Option<&Fp8Layers>),
    ranges: &[(usize, usize)],
    my_chunks: &[u32],
) -> Vec<History> {
    let Some((fp8, h)) = fp8.and_then(|f| Some((f, f.attr.history?))) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for &c in my_chunks {
        let Some(&(start, end)) = ranges.get(c as usize) else {
            continue;
        };
        for i in start..end {
            let (node, name) = (NodeId(i as u32), &spec.model.nodes[i].name);
            let weights = fp8.weights.get(i).map_or(&[][..], |w| w.as_slice());
            for &weight in weights {
                let own = |role: &&str| fp8.history_owner(node, weight, role) == weight;
                for role in quantized_roles(fp8, node).into_iter().filter(own) {
                    let base = format!("{name}.{weight}.{role}");
                    let mut declare = |what: &str, len: u64| {
                        let shape = vec![1, len];
                        let kind = BufferKind::Fp8History;
                        b.declare(format!("{base}.{what}"), shape, DType::F32, kind)
                    };
                    out.push(History {
                        node,
                        weight,
                        role,
                        history: declare("amax_history", u64::from(h) + 1),
                        amax: declare("amax", 1),
                        shared: None,
                    });
                }
            }
        }
    }
    out
}

/// The tensors (`x`, `w`, `dy`) the FP8 GEMMs of `node` quantize, in layout order.
fn quantized_roles(fp8: &Fp8Layers, node: NodeId) -> Vec<&'static str> {
    let mut roles: Vec<&'static str> = Vec::new();
    let layouts = GemmLayout::ALL.into_iter().filter(|&g| fp8.runs(node, g));
    for role in layouts.flat_map(operand_names) {
        if !roles.contains(&role) {
            roles.push(role);
        }
    }
    roles
}

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
        if let Some(h) = attr.history {
            let [sa, sb] = attr.shared(of);
            let amax = self.delayed_amax((node, w), (gemm, h), [(a, sa), (b, sb)], phase);
            return Fp8Emitted {
                attr: Some(attr),
                amax,
            };
        }
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

    /// The scale amaxes a delayed-scaling GEMM `gemm` (history length `h`) of `node`'s weight
    /// `w` reads for its `operands`, each recorded into its history first in a training forward
    /// or backward (not in a recompute, nor in evaluation), and each history told the axes its
    /// operand's scale groups span (reduced over at the step's end, [`Emitter::fp8_roll`]); a
    /// lowering error where `node` has no declared history for one.
    fn delayed_amax(
        &mut self,
        (node, w): (NodeId, &str),
        (gemm, h): (GemmLayout, u32),
        operands: [(BufferId, Axes); 2],
        phase: Phase,
    ) -> Vec<BufferId> {
        let record = !self.evaluating && phase != Phase::Recompute;
        let mut amax = Vec::new();
        for (i, (buf, axes)) in operands.into_iter().enumerate() {
            let found = (self.fp8_histories.iter_mut()).find(|x| {
                let role = operand_names(gemm)[i];
                let owner = self.fp8.map_or(w, |f| f.history_owner(node, w, role));
                x.node == node && x.weight == owner && x.role == role
            });
            let Some((history, scale)) = found.map(|x| {
                x.shared = Some(axes);
                (x.history, x.amax)
            }) else {
                let msg = format!(
                    "internal lowering error: no FP8 amax history was declared for operand {i} of `{}`'s {} GEMM of `{w}`",
                    self.node_name(node),
                    gemm.name()
                );
                self.errors.push(Diagnostic::error("E0804", msg));
                continue;
            };
            if record {
                let shape = self.b.shape(buf);
                let (rows, cols) = match shape.as_slice() {
                    [r, c] => (*r, *c),
                    _ => (1, shape.iter().product()),
                };
                let weight = gemm != GemmLayout::BwdWeight && i == 1;
                let attrs = Fp8HistoryAttrs {
                    history: h,
                    rows: weight.then_some(rows),
                    cols,
                };
                let op = Op::Fp8AmaxRecord(attrs);
                (self.b).compute(op, &[buf, history], &[history], Some(node), phase);
            }
            amax.push(scale);
        }
        amax
    }

    /// The end of a delayed-scaling step: each history's step amax max all-reduced over the
    /// ranks holding pieces of its operand, then over dp, and rolled into its scale amax.
    pub(super) fn fp8_roll(&mut self) {
        let Some(h) = self.fp8.and_then(|f| f.attr.history) else {
            return;
        };
        let max = CollectiveKind::AllReduce { op: ReduceOp::Max };
        for i in 0..self.fp8_histories.len() {
            let x = &self.fp8_histories[i];
            let (node, history, amax) = (x.node, x.history, x.amax);
            let shared = x.shared.unwrap_or(Axes::NONE);
            let dp = Axes::NONE.with_if(self.groups.dp.is_some(), Axis::Dp);
            for axes in [shared, dp].into_iter().filter(|a| !a.is_empty()) {
                match self.group_over(axes) {
                    Some(g) => self.b.collective(max, g, history, history, Some(node)),
                    None => {
                        let msg = format!(
                            "internal lowering error: no process group spans exactly {axes} for the FP8 amax history of `{}`",
                            self.node_name(node)
                        );
                        self.errors.push(Diagnostic::error("E0804", msg));
                    }
                }
            }
            let attrs = Fp8HistoryAttrs {
                history: h,
                rows: None,
                cols: 0,
            };
            let op = Op::Fp8HistoryRoll(attrs);
            (self.b).compute(
                op,
                &[history],
                &[history, amax],
                Some(node),
                Phase::Optimizer,
            );
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
        if axes == Axes::of(&[Axis::Dp]) {
            self.groups.dp
        } else if axes == Axes::of(&[Axis::Tp]) {
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
