//! FP8 GEMMs: the two formats, the three ways of scaling an operand, and what an FP8 GEMM op
//! (`Matmul`, `MatmulBwdData`, `MatmulBwdWeight` with `fp8` set) computes. The numbers are
//! defined here once; the CPU backend emulates them exactly (`runtime/src/cpu/fp8.rs`) and a
//! GPU backend must match it within FP8's tolerance (docs/fp8.md).
//!
//! An FP8 GEMM `C = A Bᵀ` (both operands read along the contraction dimension K) computes
//! `C = dq(A) dq(B)ᵀ` in f32, where `dq(q(v)) = fp8(v · s) / s` quantizes each element of an
//! operand with the scale `s` of its *scale group* and dequantizes it back:
//! - `fp8` rounds to nearest-even in the operand's format and saturates to its largest finite
//!   value (NVIDIA's `__NV_SATFINITE`); a non-finite element passes through unchanged, so a
//!   step's non-finite check still sees it.
//! - `s = 2^⌊log₂(max / amax)⌋`, `amax` the largest finite |element| of the group and `max` the
//!   format's largest finite value; `s = 1` for a group of zeros. A power of two, so scaling
//!   and unscaling are exact and every backend gets the same `dq(A)`.
//! - Scale groups, by [`Fp8Scaling`]: the whole operand (`Tensorwise`); one line along K per
//!   row of the operand (`Rowwise`); `Blockwise { block }`: activations and gradients (the
//!   operands with a row per token) in `1 × block` tiles along K, weights in `block × block`
//!   squares (the same squares in either orientation, so forward and data gradient share them).
//!
//! The operands, each with the axis K runs along in its stored `[rows, cols]` buffer:
//! - `Matmul` (y = x Wᵀ): x `[rows, in]` along its columns; W `[out, in]` along its columns.
//! - `MatmulBwdData` (dx = dy W): dy `[rows, out]` along its columns; W along its rows.
//! - `MatmulBwdWeight` (dW = dyᵀ x): dy along its rows (tokens); x along its rows.
//!
//! Weights and activations are E4M3; gradients take the recipe's gradient format.
//!
//! **Scale groups across ranks.** A parallel plan holds pieces of the single-rank run's
//! operands: each GEMM operand is cut out of it along its rows and its columns by the mesh
//! axes of [`Fp8Split`] (cp splits the tokens, tp a sharded weight and the activations on its
//! sharded side). Where one scale group has pieces on several ranks
//! ([`Fp8Operand::shared_over`]), every rank of the group must use the group's one scale, the
//! single-rank run's: the GEMM then reads the operand's group amaxes from an extra input
//! (`x_amax`, `w_amax`, `dy_amax` in the op table) instead of taking them from its own piece.
//! That input is the [`Fp8AmaxAttrs`] op's amaxes of the piece, max-reduced over exactly the
//! ranks of those axes (an `all_reduce max` over the group family spanning them, the
//! verifier's invariant 9). A maximum is exact in any order, so every rank gets the single-rank
//! run's amax bit for bit. Blockwise groups never span ranks: `crate::fp8` (E1204) requires
//! every sharded extent to be a whole number of blocks.
//!
//! **Delayed scaling** (`Fp8Gemm::history` set; tensorwise only, Transformer Engine's
//! `DelayedScaling` with `amax_compute_algo = "max"` and margin 0). Each quantized operand of
//! each FP8 GEMM (x and W of a forward, dy and W of a data gradient, dy and x of a weight
//! gradient, per weight) keeps a persistent amax history of H steps. Step t scales that
//! operand by `s = 2^⌊log₂(max / a)⌋`, the rule above, with `a` the largest value of its
//! history as recorded through step t − 1 (not the operand's own amax); a history of zeros (the
//! first step, or a history that never saw a nonzero value) gives `s = 1`, as the rule gives a
//! group of zeros and as Transformer Engine starts. During step t the operand's amax (largest
//! finite |element| of the whole operand) is recorded: the maximum over every microbatch of the
//! step, over the data-parallel ranks, and over the ranks holding pieces of the operand
//! (`Fp8Operand::shared_over`), which is the single-rank run's maximum over its microbatches.
//! At the step's end the history rolls: every value moves one step older, the oldest is
//! dropped, the step's amax becomes the newest, and the next step's `a` is the maximum of the
//! history. Every rank of a stage so holds the same history and scale, and every plan computes
//! the single-rank run's numbers. Ops: [`Fp8HistoryAttrs`] (`Fp8AmaxRecord`, `Fp8HistoryRoll`).

use crate::axis::Axis;
use serde::Serialize;
use std::fmt;

/// The smallest blockwise block (a power of two up to [`MAX_BLOCK`]).
pub const MIN_BLOCK: u64 = 16;
/// The largest blockwise block.
pub const MAX_BLOCK: u64 = 1024;
/// A delayed-scaling amax history's length by default (Transformer Engine's examples use 16;
/// its default is 1024, which reacts to a shrinking amax only after as many steps).
pub const DEFAULT_HISTORY: u32 = 16;
/// The longest amax history (a longer one keeps a spike's scale for thousands of steps).
pub const MAX_HISTORY: u32 = 1024;

/// An 8-bit float format (OCP FP8: E4M3 without infinities, E5M2 IEEE-like).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8Format {
    E4m3,
    E5m2,
}

impl Fp8Format {
    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4m3 => 448.0,
            Fp8Format::E5m2 => 57344.0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Fp8Format::E4m3 => "e4m3",
            Fp8Format::E5m2 => "e5m2",
        }
    }
}

/// How an operand's elements are grouped under one scale (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Fp8Scaling {
    Tensorwise,
    Rowwise,
    Blockwise { block: u64 },
}

impl Fp8Scaling {
    pub fn name(self) -> &'static str {
        match self {
            Fp8Scaling::Tensorwise => "tensorwise",
            Fp8Scaling::Rowwise => "rowwise",
            Fp8Scaling::Blockwise { .. } => "blockwise",
        }
    }
}

/// What an operand is, which decides its blockwise groups: a weight is scaled in squares, an
/// activation or gradient (a row per token) in tiles along K.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OperandKind {
    Weight,
    Tokens,
}

/// The axis of an operand's stored `[rows, cols]` buffer that the contraction runs along.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Along {
    /// K is the column index: one line per row.
    Cols,
    /// K is the row index: one line per column.
    Rows,
}

/// One quantized operand of an FP8 GEMM: its format, kind and contraction axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Fp8Operand {
    pub format: Fp8Format,
    pub kind: OperandKind,
    pub along: Along,
}

impl Fp8Operand {
    /// The extent of one scale group of this operand, stored `[rows, cols]`, under `scaling`:
    /// (rows, cols) of the group, clipped to the operand (the last group along an axis may be
    /// partial). Group `(r / row_block) · ⌈cols / col_block⌉ + c / col_block` holds element
    /// `(r, c)`.
    pub fn group_shape(self, scaling: Fp8Scaling, rows: u64, cols: u64) -> (u64, u64) {
        let (rows, cols) = (rows.max(1), cols.max(1));
        let (r, c) = match (scaling, self.kind, self.along) {
            (Fp8Scaling::Tensorwise, ..) => (rows, cols),
            (Fp8Scaling::Rowwise, _, Along::Cols) => (1, cols),
            (Fp8Scaling::Rowwise, _, Along::Rows) => (rows, 1),
            (Fp8Scaling::Blockwise { block }, OperandKind::Weight, _) => (block, block),
            (Fp8Scaling::Blockwise { block }, OperandKind::Tokens, Along::Cols) => (1, block),
            (Fp8Scaling::Blockwise { block }, OperandKind::Tokens, Along::Rows) => (block, 1),
        };
        (r.clamp(1, rows), c.clamp(1, cols))
    }

    /// How many scale groups a `[rows, cols]` operand has under `scaling`.
    pub fn groups(self, scaling: Fp8Scaling, rows: u64, cols: u64) -> u64 {
        let (rb, cb) = self.group_shape(scaling, rows, cols);
        rows.max(1).div_ceil(rb) * cols.max(1).div_ceil(cb)
    }

    /// The mesh axes whose ranks hold pieces of one scale group of this operand when it is
    /// split as `split`: its amaxes must be max-reduced over exactly their ranks (none: every
    /// group lies within the rank). Tensorwise: every axis splitting the operand. Rowwise:
    /// the axes splitting its lines, i.e. the contraction axis (a row-parallel input's rows
    /// across tp, a weight gradient's columns across cp); a split across lines leaves each
    /// line whole. Blockwise: none (E1204 keeps every block inside a shard).
    pub fn shared_over(self, scaling: Fp8Scaling, split: Fp8Split) -> Axes {
        match (scaling, self.along) {
            (Fp8Scaling::Tensorwise, _) => split.rows.union(split.cols),
            (Fp8Scaling::Rowwise, Along::Cols) => split.cols,
            (Fp8Scaling::Rowwise, Along::Rows) => split.rows,
            (Fp8Scaling::Blockwise { .. }, _) => Axes::NONE,
        }
    }
}

/// A set of mesh axes (the ranks that differ only on them form one group of a family).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Axes(u8);

impl Axes {
    pub const NONE: Axes = Axes(0);

    fn bit(axis: Axis) -> u8 {
        match axis {
            Axis::Dp => 1,
            Axis::Pp => 2,
            Axis::Cp => 4,
            Axis::Tp => 8,
        }
    }

    pub fn of(axes: &[Axis]) -> Axes {
        Axes(axes.iter().fold(0, |s, a| s | Axes::bit(*a)))
    }

    /// This set and `axis`, where `on` holds.
    pub fn with_if(self, on: bool, axis: Axis) -> Axes {
        if on {
            Axes(self.0 | Axes::bit(axis))
        } else {
            self
        }
    }

    pub fn union(self, other: Axes) -> Axes {
        Axes(self.0 | other.0)
    }

    pub fn contains(self, axis: Axis) -> bool {
        self.0 & Axes::bit(axis) != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The axes, in mesh order (`Axis::ALL`).
    pub fn iter(self) -> impl Iterator<Item = Axis> {
        Axis::ALL.into_iter().filter(move |a| self.contains(*a))
    }
}

impl Serialize for Axes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

/// `cp+tp`, or `1` for no axis.
impl fmt::Display for Axes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("1");
        }
        let names: Vec<&str> = self.iter().map(Axis::name).collect();
        f.write_str(&names.join("+"))
    }
}

/// How a GEMM operand's local buffer is cut out of the single-rank run's tensor: the mesh
/// axes whose ranks hold the other pieces along its rows and along its columns (none: whole).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
pub struct Fp8Split {
    pub rows: Axes,
    pub cols: Axes,
}

impl Fp8Split {
    pub fn is_whole(self) -> bool {
        self.rows.is_empty() && self.cols.is_empty()
    }
}

/// `rows × cols`: `cp × tp`, `1 × tp`.
impl fmt::Display for Fp8Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} × {}", self.rows, self.cols)
    }
}

/// The `Fp8Amax` op: the group amaxes of one FP8 GEMM operand's local piece, for a max
/// all-reduce over the ranks sharing its groups. Its input is `[rows, cols]` (`rows` fixed for
/// a weight, the op's row count for a token operand); its output holds one amax per group of
/// the piece, in [`Fp8Operand::group_shape`]'s group order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Fp8AmaxAttrs {
    pub operand: Fp8Operand,
    pub scaling: Fp8Scaling,
    /// The operand's rows where they are fixed (a weight); None for a token operand.
    pub rows: Option<u64>,
    pub cols: u64,
}

/// The two delayed-scaling ops of one operand's amax history (the module doc), whose history
/// buffer is `[1, history + 1]` f32: element 0 the step's amax recorded so far, then the
/// history, newest first.
///
/// - `Fp8AmaxRecord`: max-accumulates the largest finite |element| of x (`[rows, cols]`, rows
///   fixed for a weight, else the op's) into element 0, in place.
/// - `Fp8HistoryRoll`: at the step's end (after element 0 was max-reduced over the ranks that
///   record the operand), rolls the history (element 0 becomes the newest value, the oldest is
///   dropped, element 0 is zeroed) and writes the history's maximum to the operand's scale amax
///   (`[1]`), which the next step's GEMMs read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Fp8HistoryAttrs {
    /// The history's length H.
    pub history: u32,
    /// The recorded operand's rows where they are fixed (a weight); None for a token operand
    /// (`Fp8AmaxRecord` only; 0 columns for `Fp8HistoryRoll`).
    pub rows: Option<u64>,
    pub cols: u64,
}

/// The `Fp8Quantize` op: one tensor quantized once, tensorwise, for every FP8 GEMM that reads
/// it (`lower::fp8_quantize`). in: x `[rows, cols]` (rows fixed for a weight, else the op's);
/// amax `[1]`, the scale amax (`s = 2^⌊log₂(max / amax)⌋`, 1 for 0, as the module doc
/// defines). out, each where its flag is set: `q` `[rows, cols]` = fp8(x·s), x's layout (K
/// along x's columns); `qt` `[cols, rows]`, its transpose (K along x's rows). Each element
/// rounds as a GEMM's own quantization does; a non-finite one is stored as NaN (0x7f), which
/// the GEMM reads as NaN (its own quantization keeps an infinity: either way the product is
/// non-finite and the step's check sees it). An FP8 GEMM with `Fp8Gemm::quantized` reads its
/// operands from these, so its numbers are the unquantized op's bit for bit on finite inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Fp8QuantizeAttrs {
    pub format: Fp8Format,
    /// x's rows where they are fixed (a weight); None for a token operand.
    pub rows: Option<u64>,
    pub cols: u64,
    /// Writes `q` (x's layout).
    pub direct: bool,
    /// Writes `qt` (the transpose).
    pub transposed: bool,
}

/// The `fp8` attribute of a GEMM op: its scaling, the format of its gradient operand (dy,
/// in the two backward GEMMs; weights and activations are E4M3), how each operand (in the
/// op's input order) is split across ranks, which decides which operands read their amaxes
/// from an input ([`Fp8Gemm::shared`]), for delayed scaling the amax history's length (both
/// operands then read their scale amax from an input: [`Fp8Gemm::reads_amax`]), and whether
/// its operands come quantized ([`Fp8Gemm::quantized`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Fp8Gemm {
    pub scaling: Fp8Scaling,
    pub grad: Fp8Format,
    #[serde(skip_serializing_if = "unsplit")]
    pub split: [Fp8Split; 2],
    /// Delayed scaling with an amax history of this many steps (tensorwise only); None:
    /// current scaling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub history: Option<u32>,
    /// Tensorwise only: both operands are read already quantized, from two more inputs after
    /// the amaxes (`Fp8Quantize`'s outputs, K-major: `q` of an operand read along its
    /// columns, `qt` of one read along its rows), each with the scale its amax input (always
    /// present then) gives. The unquantized operands stay inputs: a delayed-scaling GEMM
    /// whose history is still empty runs on them unquantized, and a weight gradient's bias
    /// gradient sums the exact dy.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub quantized: bool,
}

fn unsplit(split: &[Fp8Split; 2]) -> bool {
    split.iter().all(|s| s.is_whole())
}

impl Fp8Gemm {
    /// A GEMM under current scaling on one rank's whole operands (no history, nothing split,
    /// each operand quantized by the GEMM itself): `scaling` with gradients in `grad`.
    pub fn current(scaling: Fp8Scaling, grad: Fp8Format) -> Fp8Gemm {
        Fp8Gemm {
            scaling,
            grad,
            split: Default::default(),
            history: None,
            quantized: false,
        }
    }

    /// For each of the two operands `operands` (the op's, `operands::forward` etc.), the axes
    /// its amaxes are max-reduced over (none: the GEMM takes them from its own piece).
    pub fn shared(self, operands: [Fp8Operand; 2]) -> [Axes; 2] {
        let [a, b] = operands;
        [
            a.shared_over(self.scaling, self.split[0]),
            b.shared_over(self.scaling, self.split[1]),
        ]
    }

    /// Whether each operand's amaxes come from an input of the GEMM rather than from its own
    /// piece: all of them under delayed scaling (the history's scale amax), else those whose
    /// groups span ranks ([`Fp8Gemm::shared`]).
    pub fn reads_amax(self, operands: [Fp8Operand; 2]) -> [bool; 2] {
        self.shared(operands)
            .map(|axes| self.quantized || self.history.is_some() || !axes.is_empty())
    }
}

impl fmt::Display for Fp8Gemm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.scaling {
            Fp8Scaling::Blockwise { block } => write!(f, "blockwise({block})")?,
            s => f.write_str(s.name())?,
        }
        if let Some(h) = self.history {
            write!(f, " delayed({h})")?;
        }
        if self.quantized {
            f.write_str(" quantized")?;
        }
        write!(f, " grad {}", self.grad.name())?;
        if !unsplit(&self.split) {
            write!(f, " split [{}, {}]", self.split[0], self.split[1])?;
        }
        Ok(())
    }
}

/// The operands of each FP8 GEMM, in the op's input order (see the module doc).
pub mod operands {
    use super::{Along, Fp8Format, Fp8Gemm, Fp8Operand, OperandKind};

    fn operand(format: Fp8Format, kind: OperandKind, along: Along) -> Fp8Operand {
        Fp8Operand {
            format,
            kind,
            along,
        }
    }

    /// `Matmul`: x, then W.
    pub fn forward(_: Fp8Gemm) -> [Fp8Operand; 2] {
        [
            operand(Fp8Format::E4m3, OperandKind::Tokens, Along::Cols),
            operand(Fp8Format::E4m3, OperandKind::Weight, Along::Cols),
        ]
    }

    /// `MatmulBwdData`: dy, then W.
    pub fn bwd_data(g: Fp8Gemm) -> [Fp8Operand; 2] {
        [
            operand(g.grad, OperandKind::Tokens, Along::Cols),
            operand(Fp8Format::E4m3, OperandKind::Weight, Along::Rows),
        ]
    }

    /// `MatmulBwdWeight`: dy, then x.
    pub fn bwd_weight(g: Fp8Gemm) -> [Fp8Operand; 2] {
        [
            operand(g.grad, OperandKind::Tokens, Along::Rows),
            operand(Fp8Format::E4m3, OperandKind::Tokens, Along::Rows),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_the_scaling_and_clip_at_the_edges() {
        let g = Fp8Gemm::current(Fp8Scaling::Rowwise, Fp8Format::E5m2);
        let [x, w] = operands::forward(g);
        let [dy, _] = operands::bwd_weight(g);
        let block = Fp8Scaling::Blockwise { block: 128 };
        assert_eq!(x.group_shape(Fp8Scaling::Tensorwise, 3, 5), (3, 5));
        assert_eq!(x.group_shape(Fp8Scaling::Rowwise, 3, 5), (1, 5));
        assert_eq!(dy.group_shape(Fp8Scaling::Rowwise, 3, 5), (3, 1));
        assert_eq!(x.group_shape(block, 300, 200), (1, 128));
        assert_eq!(w.group_shape(block, 300, 200), (128, 128));
        assert_eq!(dy.group_shape(block, 300, 200), (128, 1));
        // A block larger than the operand is the whole extent.
        assert_eq!(w.group_shape(block, 40, 200), (40, 128));
        assert_eq!(w.groups(block, 300, 200), 3 * 2);
        assert_eq!(dy.groups(block, 300, 200), 3 * 200);
        assert_eq!(x.groups(Fp8Scaling::Tensorwise, 300, 200), 1);
    }

    #[test]
    fn shared_groups_follow_the_split_and_the_lines() {
        let g = |scaling| Fp8Gemm::current(scaling, Fp8Format::E5m2);
        let (cp, tp) = (Axes::of(&[Axis::Cp]), Axes::of(&[Axis::Tp]));
        // A row-parallel input under cp: rows split by cp, columns (K) by tp.
        let split = Fp8Split { rows: cp, cols: tp };
        let [x, _] = operands::forward(g(Fp8Scaling::Rowwise));
        let [dy, _] = operands::bwd_weight(g(Fp8Scaling::Rowwise));
        assert_eq!(x.shared_over(Fp8Scaling::Tensorwise, split), cp.union(tp));
        assert_eq!(x.shared_over(Fp8Scaling::Rowwise, split), tp);
        // A weight gradient's operands run K along the tokens: cp splits their lines.
        assert_eq!(dy.shared_over(Fp8Scaling::Rowwise, split), cp);
        let block = Fp8Scaling::Blockwise { block: 128 };
        assert_eq!(x.shared_over(block, split), Axes::NONE);
        assert_eq!(format!("{}", cp.union(tp)), "cp+tp");
        assert_eq!(format!("{split}"), "cp × tp");
    }
}
