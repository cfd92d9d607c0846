//! The op table: one description of every compute op that every pass and backend reads.
//!
//! For each op kind ([`Opcode`]) the table gives its name, its [`Family`], and, for a concrete
//! [`Op`] (whose attributes decide optional operands), its [`Signature`]: every input and
//! output in the order the instruction lists them, each with its role, [`StorageClass`],
//! [`Shape`] rule and, for an output, how the op writes it ([`Write`]). The verifier (operand
//! counts and dtypes), the lowering's storage pass, the memory planner's zeroing, the timeline's
//! costs ([`Op::flops`], [`Signature::bytes_touched`]), the runtime's operand binding (which both
//! backends use) and the profiler read it; none restates it. The semantics of each op are
//! documented on its variant in `op`.
//!
//! Shapes are element counts in terms of the op's attributes and two row counts: `n`, the
//! op's rows (tokens × batch for activations; query rows for attention), and `m`, key/value
//! rows (attention with separate k and v). Where the attributes fix a row count
//! (`Signature::rows`, `Signature::kv_rows`), a bound buffer must agree with it; otherwise the
//! first operand of that row count decides it and every other must agree.
use super::fp8::{Along, Fp8HistoryAttrs, Fp8Operand, Fp8Scaling, OperandKind};
use super::op::{AttentionAttrs, Op};
use super::storage::StorageClass::{self, Float, Fp32, Fp8, Tokens};

mod signatures;
pub use signatures::Signatures;

/// What kind of work an op is: backends group their code by family, and the profiler its time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    Embedding,
    Norm,
    Matmul,
    Attention,
    Elementwise,
    DataMovement,
    Loss,
    Optimizer,
}

macro_rules! opcodes {
    ($($variant:ident $name:literal $family:ident,)*) => {
        super::named_enum! {
            /// The kind of an [`Op`], without its attributes: one per variant, named in messages
            /// and JSON as it is serialized (`snake_case`).
            #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
            pub enum Opcode {
                $($variant $name,)*
            }
        }

        impl Opcode {
            /// The op's name in the IR's text form (the `Op` variant's name).
            pub fn variant(self) -> &'static str {
                match self {
                    $(Opcode::$variant => stringify!($variant),)*
                }
            }

            /// The family the op belongs to.
            pub fn family(self) -> Family {
                match self {
                    $(Opcode::$variant => Family::$family,)*
                }
            }
        }

        impl Op {
            /// The op's kind.
            pub fn opcode(&self) -> Opcode {
                match self {
                    $(Op::$variant { .. } => Opcode::$variant,)*
                }
            }
        }
    };
}

opcodes! {
    Embedding "embedding" Embedding,
    EmbeddingBwd "embedding_bwd" Embedding,
    PositionAdd "position_add" Embedding,
    PositionAddBwd "position_add_bwd" Embedding,
    LayerNorm "layer_norm" Norm,
    LayerNormBwd "layer_norm_bwd" Norm,
    RmsNorm "rms_norm" Norm,
    RmsNormBwd "rms_norm_bwd" Norm,
    Matmul "matmul" Matmul,
    MatmulBwdData "matmul_bwd_data" Matmul,
    MatmulBwdWeight "matmul_bwd_weight" Matmul,
    Fp8Amax "fp8_amax" Matmul,
    Fp8AmaxRecord "fp8_amax_record" Matmul,
    Fp8HistoryRoll "fp8_history_roll" Matmul,
    Fp8Quantize "fp8_quantize" Matmul,
    Rope "rope" Elementwise,
    RopeBwd "rope_bwd" Elementwise,
    RopeTable "rope_table" Elementwise,
    Attention "attention" Attention,
    AttentionBwd "attention_bwd" Attention,
    Activation "activation" Elementwise,
    ActivationBwd "activation_bwd" Elementwise,
    Fused "fused" Elementwise,
    SwiGlu "swi_glu" Elementwise,
    SwiGluBwd "swi_glu_bwd" Elementwise,
    Add "add" Elementwise,
    Scale "scale" Elementwise,
    Copy "copy" DataMovement,
    SplitColumns "split_columns" DataMovement,
    ConcatColumns "concat_columns" DataMovement,
    Zero "zero" DataMovement,
    CopyRange "copy_range" DataMovement,
    CrossEntropy "cross_entropy" Loss,
    CeMax "ce_max" Loss,
    CeSumExp "ce_sum_exp" Loss,
    CeTargetLogit "ce_target_logit" Loss,
    CeLoss "ce_loss" Loss,
    CeGrad "ce_grad" Loss,
    SumSquares "sum_squares" Optimizer,
    ClipCoef "clip_coef" Optimizer,
    AdamW "adam_w" Optimizer,
    Sgd "sgd" Optimizer,
}

/// The rows of an operand's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// The op's row count `n`.
    N,
    /// The op's key/value row count `m`.
    M,
    /// Exactly this many rows (parameters, statistics of one value).
    Fixed(u64),
    /// Any whole number of rows (a table indexed by position).
    Any,
}

/// An operand's shape rule: `rows × cols` elements, row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub rows: Rows,
    pub cols: u64,
}

/// How an op writes one of its outputs (what the memory planner and the verifier rely on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// Every element written, none read: the output needs no zero-fill first.
    Overwrite,
    /// Added into ("(+=)"): read, added to and written back; it must hold zeros or an earlier
    /// value first and must not also be an input (E0821).
    Accumulate,
    /// The same buffer as this input, read element by element before being written (E0820).
    InPlace(usize),
    /// Updated where it lies (optimizer state and parameters): read, then written.
    Update,
    /// Only `[start, end)` written (flat element offsets); the rest untouched.
    Range(u64, u64),
}

impl Write {
    /// Whether the op reads the output's earlier value.
    pub fn reads(self) -> bool {
        !matches!(self, Write::Overwrite | Write::Range(..))
    }
}

/// One operand of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operand {
    /// Its name in the op's documentation and in error messages (`x`, `w`, `dy`, …).
    pub role: &'static str,
    pub class: StorageClass,
    /// `None`: any element count (a flat buffer such as a gradient or a copy's range).
    pub shape: Option<Shape>,
    /// How an output is written (inputs: `Overwrite`, unused).
    pub write: Write,
    /// Touched only at the rows the op's token ids select (an embedding table and its
    /// gradient): its traffic is the op's n rows of it, not the whole of it.
    pub gathered: bool,
}

/// Up to `N` operands, inline (the verifier reads a signature per instruction of plans holding
/// millions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OperandList<const N: usize> {
    len: u8,
    items: [Operand; N],
}

const UNUSED: Operand = Operand {
    role: "",
    class: Fp32,
    shape: None,
    write: Write::Overwrite,
    gathered: false,
};

impl<const N: usize> OperandList<N> {
    fn gather_last(&mut self) {
        if let Some(last) = usize::from(self.len).checked_sub(1) {
            self.items[last].gathered = true;
        }
    }

    fn new() -> Self {
        OperandList {
            len: 0,
            items: [UNUSED; N],
        }
    }

    fn push(&mut self, operand: Operand) {
        // The IR's operand lists hold at most N (`operands::MAX_INPUTS`/`MAX_OUTPUTS`); the
        // table's test checks that no signature needs more.
        if let Some(slot) = self.items.get_mut(usize::from(self.len)) {
            *slot = operand;
            self.len += 1;
        }
    }
}

impl<const N: usize> std::ops::Deref for OperandList<N> {
    type Target = [Operand];
    fn deref(&self) -> &[Operand] {
        &self.items[..usize::from(self.len)]
    }
}

/// The operands of one op (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signature {
    pub opcode: Opcode,
    pub inputs: OperandList<{ super::operands::MAX_INPUTS }>,
    pub outputs: OperandList<{ super::operands::MAX_OUTPUTS }>,
    /// The row count `n` the attributes fix, if they do.
    pub rows: Option<u64>,
    /// The key/value row count `m` the attributes fix, if they do.
    pub kv_rows: Option<u64>,
}

/// A shape of `rows × cols`.
fn shape(rows: Rows, cols: u64) -> Option<Shape> {
    Some(Shape { rows, cols })
}
/// `[n, cols]`.
fn n(cols: u64) -> Option<Shape> {
    shape(Rows::N, cols)
}
/// `[m, cols]`.
fn m(cols: u64) -> Option<Shape> {
    shape(Rows::M, cols)
}
/// A fixed `[rows, cols]`.
fn fixed(rows: u64, cols: u64) -> Option<Shape> {
    shape(Rows::Fixed(rows), cols)
}
/// One value (`[1]`).
const ONE: Option<Shape> = Some(Shape {
    rows: Rows::Fixed(1),
    cols: 1,
});
/// Any element count.
const FLAT: Option<Shape> = None;

impl Signature {
    /// The (input, output) pairs the op updates in place (`Op::in_place`).
    pub fn in_place(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (self.outputs.iter().enumerate()).filter_map(|(o, output)| match output.write {
            Write::InPlace(i) => Some((i, o)),
            _ => None,
        })
    }

    fn new(opcode: Opcode) -> Signature {
        Signature {
            opcode,
            inputs: OperandList::new(),
            outputs: OperandList::new(),
            rows: None,
            kv_rows: None,
        }
    }

    fn input(
        &mut self,
        role: &'static str,
        class: StorageClass,
        shape: Option<Shape>,
    ) -> &mut Self {
        self.inputs.push(Operand {
            role,
            class,
            shape,
            write: Write::Overwrite,
            gathered: false,
        });
        self
    }

    fn input_if(
        &mut self,
        flag: bool,
        role: &'static str,
        c: StorageClass,
        s: Option<Shape>,
    ) -> &mut Self {
        if flag {
            self.input(role, c, s);
        }
        self
    }

    fn output(
        &mut self,
        role: &'static str,
        class: StorageClass,
        shape: Option<Shape>,
    ) -> &mut Self {
        self.write(role, class, shape, Write::Overwrite)
    }

    fn output_if(
        &mut self,
        flag: bool,
        role: &'static str,
        c: StorageClass,
        s: Option<Shape>,
    ) -> &mut Self {
        if flag {
            self.output(role, c, s);
        }
        self
    }

    fn write(
        &mut self,
        role: &'static str,
        class: StorageClass,
        shape: Option<Shape>,
        write: Write,
    ) -> &mut Self {
        self.outputs.push(Operand {
            role,
            class,
            shape,
            write,
            gathered: false,
        });
        self
    }

    /// The last input or output pushed is `gathered` (see [`Operand::gathered`]).
    fn gathered(&mut self, output: bool) -> &mut Self {
        if output {
            self.outputs.gather_last();
        } else {
            self.inputs.gather_last();
        }
        self
    }

    /// An FP8 GEMM's amax inputs (`op`'s `Fp8Gemm::reads_amax`): for each of its two
    /// operands, given as (role, fixed rows or None for the op's rows, columns), the reduced
    /// amaxes of its groups where they span ranks, or its scale amax under delayed scaling.
    fn amax_inputs(
        &mut self,
        op: &Op,
        operands: [(&'static str, Option<u64>, u64); 2],
    ) -> &mut Self {
        let Some((g, quantized)) = op.fp8_operands() else {
            return self;
        };
        let reads = g.reads_amax(quantized);
        for (((role, rows, cols), operand), read) in operands.into_iter().zip(quantized).zip(reads)
        {
            let rows = rows.map_or(Rows::N, Rows::Fixed);
            let shape = amax_shape(operand, g.scaling, rows, cols);
            self.input_if(read, role, Fp32, Some(shape));
        }
        self
    }

    /// A quantized FP8 GEMM's operands as `Fp8Quantize` wrote them (`Fp8Gemm::quantized`):
    /// for each of its two operands, given as (role, rows, columns), in the format the GEMM
    /// reads it in. A transposed token operand (`[K, tokens]` of a weight gradient) has the
    /// op's rows as its columns, which a shape rule cannot say (columns 0: any count; the
    /// verifier checks its extent, `verify::fp8`).
    fn quantized_inputs(&mut self, op: &Op, operands: [(&'static str, Rows, u64); 2]) -> &mut Self {
        let Some((_, quantized)) = op.fp8_operands().filter(|(g, _)| g.quantized) else {
            return self;
        };
        for ((role, rows, cols), operand) in operands.into_iter().zip(quantized) {
            let shape = (cols > 0).then_some(Shape { rows, cols });
            self.input(role, Fp8(operand.format), shape);
        }
        self
    }

    /// Every later output written as `write` (the parameter gradients an
    /// `accumulate_param_grad` flag governs).
    fn writing_from(&mut self, first: usize, write: Write) -> &mut Self {
        let len = usize::from(self.outputs.len);
        for out in self.outputs.items.iter_mut().take(len).skip(first) {
            out.write = write;
        }
        self
    }

    fn rows(&mut self, rows: u64) -> &mut Self {
        self.rows = Some(rows);
        self
    }

    fn kv_rows(&mut self, rows: u64) -> &mut Self {
        self.kv_rows = Some(rows);
        self
    }

    /// Bytes an op of `rows` rows (its n) touches given each operand's bytes (`input(i)`,
    /// `output(i)`): every input read, every output written, and an accumulated or updated
    /// output read as well (AdamW's param, m and v: 28 bytes a parameter with its gradient); a
    /// gathered operand only at `rows` of its rows.
    pub fn bytes_touched(
        &self,
        rows: u64,
        input: impl Fn(usize) -> f64,
        output: impl Fn(usize) -> f64,
    ) -> f64 {
        let share = |o: &Operand| match o.shape {
            Some(Shape {
                rows: Rows::Fixed(all),
                ..
            }) if o.gathered && all > 0 => (rows as f64 / all as f64).min(1.0),
            _ => 1.0,
        };
        let read: f64 = (self.inputs.iter().enumerate())
            .map(|(i, o)| input(i) * share(o))
            .sum();
        let written: f64 = (self.outputs.iter().enumerate())
            .map(|(i, o)| {
                let accumulated = match o.write {
                    Write::Accumulate | Write::Update => 2.0,
                    _ => 1.0,
                };
                output(i) * share(o) * accumulated
            })
            .sum();
        read + written
    }

    /// The row count `n`, from the attributes or else from the element count of the first
    /// input shaped `[n, cols]` (`numel(i)` of input `i`); None if neither says.
    pub fn rows_from_inputs(&self, numel: impl Fn(usize) -> u64) -> Option<u64> {
        self.rows.or_else(|| {
            self.inputs
                .iter()
                .enumerate()
                .find_map(|(i, o)| match o.shape {
                    Some(Shape {
                        rows: Rows::N,
                        cols,
                    }) if cols > 0 => Some(numel(i) / cols),
                    _ => None,
                })
        })
    }
}

/// `Write::Accumulate` when `flag`, else `Write::Overwrite`.
fn accumulate_if(flag: bool) -> Write {
    if flag {
        Write::Accumulate
    } else {
        Write::Overwrite
    }
}

/// Rows of a `len(positions) × batch` activation.
fn rows_of(positions: &[super::op::Segment], batch: u64) -> u64 {
    u64::from(super::op::segments_len(positions)).saturating_mul(batch)
}

impl Op {
    /// The op's operands (see the module docs).
    pub fn signature(&self) -> Signature {
        let mut signature = Signature::new(self.opcode());
        self.describe(&mut signature);
        signature
    }

    /// Pushes the op's operands and row counts onto `s`, a new signature of its opcode: built
    /// in place, as a signature is several hundred bytes and is asked for per instruction.
    fn describe<'s>(&self, s: &'s mut Signature) -> &'s mut Signature {
        match self {
            Op::Embedding(a) => s
                .input("ids", Tokens, n(1))
                .input("table", Float, fixed(a.vocab_local, a.dim))
                .gathered(false)
                .output("y", Float, n(a.dim)),
            Op::EmbeddingBwd(a) => s
                .input("ids", Tokens, n(1))
                .input("dy", Float, n(a.dim))
                .write(
                    "dtable",
                    Fp32,
                    fixed(a.vocab_local, a.dim),
                    Write::Accumulate,
                )
                .gathered(true),
            Op::PositionAdd(a) => s
                .rows(rows_of(&a.positions, a.batch))
                .input("x", Float, n(a.dim))
                .input("table", Float, shape(Rows::Any, a.dim))
                .output("y", Float, n(a.dim)),
            Op::PositionAddBwd {
                pos,
                accumulate_param_grad,
            } => s
                .rows(rows_of(&pos.positions, pos.batch))
                .input("dy", Float, n(pos.dim))
                .write(
                    "dtable",
                    Fp32,
                    shape(Rows::Any, pos.dim),
                    accumulate_if(*accumulate_param_grad),
                ),
            Op::LayerNorm { dim, bias, .. } => norm_forward(s, *dim, Some(*bias)),
            Op::LayerNormBwd {
                dim,
                bias,
                accumulate,
                accumulate_param_grad,
            } => norm_backward(s, *dim, Some(*bias), *accumulate, *accumulate_param_grad),
            Op::RmsNorm { dim, .. } => norm_forward(s, *dim, None),
            Op::RmsNormBwd {
                dim,
                accumulate,
                accumulate_param_grad,
            } => norm_backward(s, *dim, None, *accumulate, *accumulate_param_grad),
            Op::Matmul { .. }
            | Op::MatmulBwdData { .. }
            | Op::MatmulBwdWeight { .. }
            | Op::Fp8Amax(_)
            | Op::Fp8AmaxRecord(_)
            | Op::Fp8HistoryRoll(_)
            | Op::Fp8Quantize(_) => gemm_family(self, s),
            Op::Rope(a) => {
                let width = a.heads.saturating_mul(a.head_dim);
                s.rows(rows_of(&a.positions, a.batch))
                    .input("x", Float, n(width))
                    .output("y", Float, n(width))
            }
            Op::RopeBwd(a) => {
                let width = a.heads.saturating_mul(a.head_dim);
                s.rows(rows_of(&a.positions, a.batch))
                    .input("dy", Float, n(width))
                    .output("dx", Float, n(width))
            }
            Op::RopeTable(a) => s.output(
                "table",
                Fp32,
                fixed(
                    u64::from(super::op::segments_len(&a.positions)),
                    a.head_dim.saturating_mul(2),
                ),
            ),
            Op::Attention(a) => attention_forward(s, a),
            Op::AttentionBwd(a) => attention_backward(s, a),
            Op::Activation(_) => s.input("x", Float, n(1)).output("y", Float, n(1)),
            Op::ActivationBwd(_) => {
                s.input("dy", Float, n(1))
                    .input("x", Float, n(1))
                    .output("dx", Float, n(1))
            }
            Op::Fused(a) => fused(s, a),
            Op::SwiGlu => s
                .input("gate", Float, n(1))
                .input("up", Float, n(1))
                .output("y", Float, n(1)),
            Op::SwiGluBwd => s
                .input("dy", Float, n(1))
                .input("gate", Float, n(1))
                .input("up", Float, n(1))
                .output("dgate", Float, n(1))
                .output("dup", Float, n(1)),
            Op::Add => s
                .input("a", Float, n(1))
                .input("b", Float, n(1))
                .output("y", Float, n(1)),
            Op::Scale { .. } | Op::Copy => s.input("x", Float, n(1)).output("y", Float, n(1)),
            Op::Zero => s.output("buffer", Float, FLAT),
            Op::CopyRange {
                dst_offset, len, ..
            } => s.input("src", Float, FLAT).write(
                "dst",
                Float,
                FLAT,
                Write::Range(*dst_offset, dst_offset.saturating_add(*len)),
            ),
            Op::SplitColumns { widths } => widths.iter().zip(PARTS).fold(
                s.input("x", Float, n(widths.iter().sum())),
                |s, (w, role)| s.output(role, Float, n(*w)),
            ),
            Op::ConcatColumns { widths } => widths
                .iter()
                .zip(PARTS)
                .fold(s, |s, (w, role)| s.input(role, Float, n(*w)))
                .output("y", Float, n(widths.iter().sum())),
            Op::CrossEntropy { vocab, .. } => s
                .input("logits", Float, n(*vocab))
                .input("targets", Tokens, n(1))
                .write("dlogits", Float, n(*vocab), Write::InPlace(0))
                .write("loss", Fp32, ONE, Write::Accumulate),
            Op::CeMax { vocab_local } => {
                s.input("logits", Float, n(*vocab_local))
                    .output("max", Fp32, n(1))
            }
            Op::CeSumExp { vocab_local } => s
                .input("logits", Float, n(*vocab_local))
                .input("max", Fp32, n(1))
                .output("sumexp", Fp32, n(1)),
            Op::CeTargetLogit { vocab_local, .. } => s
                .input("logits", Float, n(*vocab_local))
                .input("targets", Tokens, n(1))
                .output("target_logit", Fp32, n(1)),
            Op::CeLoss { .. } => s
                .input("max", Fp32, n(1))
                .input("sumexp", Fp32, n(1))
                .input("target_logit", Fp32, n(1))
                .write("loss", Fp32, ONE, Write::Accumulate),
            Op::CeGrad { vocab_local, .. } => s
                .input("logits", Float, n(*vocab_local))
                .input("targets", Tokens, n(1))
                .input("max", Fp32, n(1))
                .input("sumexp", Fp32, n(1))
                .output("dlogits", Float, n(*vocab_local)),
            Op::SumSquares => s
                .input("g", Fp32, FLAT)
                .write("sumsq", Fp32, ONE, Write::Accumulate),
            Op::ClipCoef { .. } => s.input("sumsq", Fp32, ONE).output("coef", Fp32, ONE),
            Op::AdamW { .. } => s
                .input("g", Fp32, n(1))
                .input("coef", Fp32, ONE)
                .write("param", Fp32, n(1), Write::Update)
                .write("m", Fp32, n(1), Write::Update)
                .write("v", Fp32, n(1), Write::Update),
            Op::Sgd { momentum, .. } => {
                let s = s.input("g", Fp32, n(1)).input("coef", Fp32, ONE).write(
                    "param",
                    Fp32,
                    n(1),
                    Write::Update,
                );
                if *momentum != 0.0 {
                    s.write("momentum", Fp32, n(1), Write::Update)
                } else {
                    s
                }
            }
        }
    }

    /// FLOPs of the op over `rows` rows (`n`, see the module docs), a multiply-add counting 2:
    /// 2·rows·in·out for each matmul; attention as `count` says ([`FlopCount`]); every other op
    /// is memory bound and counts none.
    pub fn flops(&self, rows: f64, count: FlopCount) -> f64 {
        if let Some((in_dim, out_dim)) = self.gemm_dims() {
            return 2.0 * rows * in_dim as f64 * out_dim as f64;
        }
        match self {
            Op::Attention(a) | Op::AttentionBwd(a) => {
                let backward = matches!(self, Op::AttentionBwd(_));
                let pairs = match count {
                    FlopCount::Model => attention_pairs(false, a),
                    FlopCount::Executed => attention_pairs(a.causal, a),
                };
                // QKᵀ and P·V: two multiply-adds per (pair, head_dim element).
                let forward = 4.0 * (a.batch * a.heads * a.head_dim) as f64 * pairs as f64;
                forward
                    * match (backward, count) {
                        (false, _) => 1.0,
                        (true, FlopCount::Model) => 2.0,
                        // dV, dP, dQ, dK and the recomputed scores: 2.5 × the forward's two.
                        (true, FlopCount::Executed) => 2.5,
                    }
            }
            _ => 0.0,
        }
    }

    /// For an op that writes parameter gradients with an `accumulate_param_grad` flag
    /// (`MatmulBwdWeight`, `LayerNormBwd`, `RmsNormBwd`, `PositionAddBwd`): the index of its
    /// first parameter-gradient output (the flag governs that output and every later one) and
    /// whether it accumulates. None for every other op.
    pub fn param_grad_outputs(&self) -> Option<(usize, bool)> {
        let first = match self.opcode() {
            Opcode::MatmulBwdWeight | Opcode::PositionAddBwd => 0,
            Opcode::LayerNormBwd | Opcode::RmsNormBwd => 1,
            _ => return None,
        };
        Some((first, self.accumulates(first)))
    }

    /// The amax input of each operand of an FP8 GEMM bound to `inputs` (None where it reads
    /// none) and, for a `quantized` one, its quantized operands: the amaxes come after the
    /// op's other inputs, in operand order, for the operands `Fp8Gemm::reads_amax` names, then
    /// the two quantized operands. None where the op is no FP8 GEMM or the inputs are too few.
    #[allow(clippy::type_complexity)]
    pub fn fp8_inputs(
        &self,
        inputs: &[super::BufferId],
    ) -> Option<([Option<super::BufferId>; 2], Option<[super::BufferId; 2]>)> {
        let (g, of) = self.fp8_operands()?;
        let reads = g.reads_amax(of);
        let quantized = if g.quantized { 2 } else { 0 };
        let count = reads.iter().filter(|r| **r).count();
        let mut at = inputs.len().checked_sub(quantized + count)?;
        let mut amax = [None, None];
        for k in 0..2 {
            if reads[k] {
                amax[k] = Some(*inputs.get(at)?);
                at += 1;
            }
        }
        let q = match g.quantized {
            true => Some([*inputs.get(at)?, *inputs.get(at + 1)?]),
            false => None,
        };
        Some((amax, q))
    }

    /// Whether the op adds into its output `output` (`Write::Accumulate`).
    pub fn accumulates(&self, output: usize) -> bool {
        self.signature()
            .outputs
            .get(output)
            .is_some_and(|o| o.write == Write::Accumulate)
    }

    /// The (input, output) pairs the op updates in place (`Write::InPlace`): the instruction
    /// binds both to one buffer (the verifier checks it, E0820) and the op reads every element
    /// before it writes it, so a backend runs it on the buffer as it is.
    pub fn in_place(&self) -> impl Iterator<Item = (usize, usize)> {
        let outputs = self.signature().outputs;
        (0..outputs.len()).filter_map(move |o| match outputs[o].write {
            Write::InPlace(i) => Some((i, o)),
            _ => None,
        })
    }
}

/// The signature of an op of the GEMM family: the three matmuls (with an FP8 GEMM's reduced
/// amaxes as extra inputs) and the amax op that feeds them. `Op::signature` routes only these
/// here; any other op gets `s` back unchanged.
fn gemm_family<'s>(op: &Op, s: &'s mut Signature) -> &'s mut Signature {
    match op {
        Op::Matmul {
            in_dim,
            out_dim,
            bias,
            act,
            residual,
            swiglu,
            ..
        } => s
            .input("x", Float, n(*in_dim))
            .input("w", Float, fixed(*out_dim, *in_dim))
            .input_if(*bias, "b", Fp32, fixed(*out_dim, 1))
            .input_if(*residual, "r", Float, n(*out_dim))
            .input_if(*swiglu, "gate", Float, n(*out_dim))
            .amax_inputs(
                op,
                [
                    ("x_amax", None, *in_dim),
                    ("w_amax", Some(*out_dim), *in_dim),
                ],
            )
            .quantized_inputs(
                op,
                [
                    ("xq", Rows::N, *in_dim),
                    ("wq", Rows::Fixed(*out_dim), *in_dim),
                ],
            )
            .output("y", Float, n(*out_dim))
            .output_if(act.is_some() || *swiglu, "a", Float, n(*out_dim)),
        Op::MatmulBwdData {
            in_dim,
            out_dim,
            accumulate,
            act_grad,
            swiglu,
            ..
        } => {
            let s = s
                .input("dy", Float, n(*out_dim))
                .input("w", Float, fixed(*out_dim, *in_dim))
                .input_if(act_grad.is_some(), "pre", Float, n(*in_dim))
                .input_if(*swiglu, "gate", Float, n(*in_dim))
                .input_if(*swiglu, "up", Float, n(*in_dim))
                .amax_inputs(
                    op,
                    [
                        ("dy_amax", None, *out_dim),
                        ("w_amax", Some(*out_dim), *in_dim),
                    ],
                )
                .quantized_inputs(
                    op,
                    [
                        ("dyq", Rows::N, *out_dim),
                        ("wq", Rows::Fixed(*in_dim), *out_dim),
                    ],
                );
            if *swiglu {
                s.output("dgate", Float, n(*in_dim))
                    .output("dup", Float, n(*in_dim))
            } else {
                s.write("dx", Float, n(*in_dim), accumulate_if(*accumulate))
            }
        }
        Op::MatmulBwdWeight {
            in_dim,
            out_dim,
            bias,
            accumulate_param_grad,
            ..
        } => s
            .input("dy", Float, n(*out_dim))
            .input("x", Float, n(*in_dim))
            .amax_inputs(op, [("dy_amax", None, *out_dim), ("x_amax", None, *in_dim)])
            .quantized_inputs(
                op,
                [
                    ("dyq", Rows::Fixed(*out_dim), 0),
                    ("xq", Rows::Fixed(*in_dim), 0),
                ],
            )
            .output("dw", Fp32, fixed(*out_dim, *in_dim))
            .output_if(*bias, "db", Fp32, fixed(*out_dim, 1))
            .writing_from(0, accumulate_if(*accumulate_param_grad)),
        Op::Fp8Amax(a) => {
            let rows = a.rows.map_or(Rows::N, Rows::Fixed);
            s.input("x", Float, shape(rows, a.cols)).output(
                "amax",
                Fp32,
                Some(amax_shape(a.operand, a.scaling, rows, a.cols)),
            )
        }
        Op::Fp8AmaxRecord(a) => {
            let rows = a.rows.map_or(Rows::N, Rows::Fixed);
            s.input("x", Float, shape(rows, a.cols))
                .input("history", Fp32, history_shape(a))
                .write("history", Fp32, history_shape(a), Write::InPlace(1))
        }
        Op::Fp8HistoryRoll(a) => s
            .rows(1)
            .input("history", Fp32, history_shape(a))
            .write("history", Fp32, history_shape(a), Write::InPlace(0))
            .output("amax", Fp32, fixed(1, 1)),
        Op::Fp8Quantize(a) => {
            let rows = a.rows.map_or(Rows::N, Rows::Fixed);
            let transposed = match a.rows {
                // A weight's transpose has fixed columns; a token operand's has the op's rows
                // as columns, which a shape rule cannot say: its extent is checked by the
                // verifier (`verify::fp8`).
                Some(r) => fixed(a.cols, r),
                None => FLAT,
            };
            s.input("x", Float, shape(rows, a.cols))
                .input("amax", Fp32, ONE)
                .output_if(a.direct, "q", Fp8(a.format), shape(rows, a.cols))
                .output_if(a.transposed, "qt", Fp8(a.format), transposed)
        }
        _ => s,
    }
}

/// A delayed-scaling amax history: the step's amax, then H steps (`ir::fp8::Fp8HistoryAttrs`).
fn history_shape(a: &Fp8HistoryAttrs) -> Option<Shape> {
    fixed(1, u64::from(a.history) + 1)
}

/// The shape of the group amaxes of an FP8 GEMM operand of `rows × cols` (`ir::fp8`'s
/// groups): one value for a tensor, one per line along K, one per block or tile.
fn amax_shape(operand: Fp8Operand, scaling: Fp8Scaling, rows: Rows, cols: u64) -> Shape {
    let tiles = |n: u64, block: u64| n.max(1).div_ceil(block.max(1));
    let (rows, cols) = match (scaling, operand.kind, operand.along) {
        (Fp8Scaling::Tensorwise, ..) => (Rows::Fixed(1), 1),
        (Fp8Scaling::Rowwise, _, Along::Cols) => (rows, 1),
        (Fp8Scaling::Rowwise, _, Along::Rows) => (Rows::Fixed(1), cols),
        (Fp8Scaling::Blockwise { block }, OperandKind::Tokens, Along::Cols) => {
            (rows, tiles(cols, block))
        }
        (Fp8Scaling::Blockwise { .. }, OperandKind::Tokens, Along::Rows) => (Rows::Any, cols),
        (Fp8Scaling::Blockwise { block }, OperandKind::Weight, _) => match rows {
            Rows::Fixed(r) => (Rows::Fixed(tiles(r, block)), tiles(cols, block)),
            _ => (Rows::Any, tiles(cols, block)),
        },
    };
    Shape { rows, cols }
}

/// A norm's forward: LayerNorm (`layer` = Some(bias)) or RMSNorm (None: no mean, no bias).
/// A generated kernel's operands, from its accesses (`Op::Fused`).
fn fused<'s>(s: &'s mut Signature, a: &super::op::FusedAttrs) -> &'s mut Signature {
    use crate::kir::Access;
    const INPUTS: [&str; 6] = ["x0", "x1", "x2", "x3", "x4", "x5"];
    const OUTPUTS: [&str; 3] = ["y0", "y1", "y2"];
    let operand = |access: &Access| match *access {
        Access::Elem { width } => (Float, n(width)),
        Access::Row => (Fp32, n(1)),
        Access::Col => (Fp32, fixed(a.kernel.cols, 1)),
        Access::PerPosition { width, .. } => (Fp32, shape(Rows::Any, width)),
    };
    if let Some(rows) = a.rows {
        s.rows(rows);
    }
    for (role, access) in INPUTS.iter().zip(&a.kernel.inputs) {
        let (class, shape) = operand(access);
        s.input(role, class, shape);
    }
    for (role, access) in OUTPUTS.iter().zip(&a.kernel.outputs) {
        let (class, shape) = operand(access);
        s.output(role, class, shape);
    }
    s
}

fn norm_forward(s: &mut Signature, dim: u64, layer: Option<bool>) -> &mut Signature {
    s.input("x", Float, n(dim))
        .input("w", Fp32, fixed(dim, 1))
        .input_if(layer == Some(true), "b", Fp32, fixed(dim, 1))
        .output("y", Float, n(dim))
        .output_if(layer.is_some(), "mean", Fp32, n(1))
        .output("rstd", Fp32, n(1))
}

/// A norm's backward (`layer` as [`norm_forward`]): dx, then the parameter gradients, which
/// `accumulate_param_grad` governs.
fn norm_backward(
    s: &mut Signature,
    dim: u64,
    layer: Option<bool>,
    accumulate: bool,
    accumulate_param_grad: bool,
) -> &mut Signature {
    s.input("dy", Float, n(dim))
        .input("x", Float, n(dim))
        .input("w", Fp32, fixed(dim, 1))
        .input_if(layer.is_some(), "mean", Fp32, n(1))
        .input("rstd", Fp32, n(1))
        .write("dx", Float, n(dim), accumulate_if(accumulate))
        .output("dw", Fp32, fixed(dim, 1))
        .output_if(layer == Some(true), "db", Fp32, fixed(dim, 1))
        .writing_from(1, accumulate_if(accumulate_param_grad))
}

/// The roles of `SplitColumns`' outputs and `ConcatColumns`' inputs (the IR's operand limit).
const PARTS: [&str; 3] = ["part0", "part1", "part2"];

fn attention_widths(a: &AttentionAttrs) -> (u64, u64) {
    let q = a.heads.saturating_mul(a.head_dim);
    (q, a.kv_heads.saturating_mul(a.head_dim))
}

fn attention_rows<'s>(s: &'s mut Signature, a: &AttentionAttrs) -> &'s mut Signature {
    s.rows(rows_of(&a.q_positions, a.batch))
        .kv_rows(rows_of(&a.kv_positions, a.batch))
}

fn attention_forward<'s>(s: &'s mut Signature, a: &AttentionAttrs) -> &'s mut Signature {
    let (q, kv) = attention_widths(a);
    let s = attention_rows(s, a);
    let s = if a.packed {
        s.input("qkv", Float, n(q + 2 * kv))
    } else {
        s.input("q", Float, n(q))
            .input("k", Float, m(kv))
            .input("v", Float, m(kv))
    };
    s.output("o", Float, n(q)).output("lse", Fp32, n(a.heads))
}

fn attention_backward<'s>(s: &'s mut Signature, a: &AttentionAttrs) -> &'s mut Signature {
    let (q, kv) = attention_widths(a);
    let s = attention_rows(s, a).input("do", Float, n(q));
    if a.packed {
        s.input("qkv", Float, n(q + 2 * kv))
            .input("o", Float, n(q))
            .input("lse", Fp32, n(a.heads))
            .output("dqkv", Float, n(q + 2 * kv))
    } else {
        s.input("q", Float, n(q))
            .input("k", Float, m(kv))
            .input("v", Float, m(kv))
            .input("o", Float, n(q))
            .input("lse", Fp32, n(a.heads))
            .output("dq", Float, n(q))
            .output("dk", Float, m(kv))
            .output("dv", Float, m(kv))
    }
}

/// How [`Op::flops`] counts attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlopCount {
    /// Every (query, key) pair, causal or not, and the backward twice the forward: the papers'
    /// count, which the cost model and the timeline use.
    Model,
    /// The pairs a causal mask keeps, and the backward 2.5 × the forward (it recomputes the
    /// scores): what the kernels execute, which the profiler's TFLOP/s divide.
    Executed,
}

/// (query, key) pairs one attention head scores per sequence: every pair, or with `causal`
/// only keys at global positions ≤ the query's.
fn attention_pairs(causal: bool, a: &AttentionAttrs) -> u64 {
    let (q, kv) = (&a.q_positions, &a.kv_positions);
    let kv_len = u64::from(super::op::segments_len(kv));
    if !causal {
        return u64::from(super::op::segments_len(q)) * kv_len;
    }
    let keys_upto = |p: u64| -> u64 {
        kv.iter()
            .map(|s| {
                let (start, len) = (u64::from(s.start), u64::from(s.len));
                if p < start {
                    0
                } else {
                    (p - start + 1).min(len)
                }
            })
            .sum()
    };
    q.iter()
        .flat_map(|s| u64::from(s.start)..u64::from(s.start) + u64::from(s.len))
        .map(keys_upto)
        .sum()
}

#[cfg(test)]
mod tests;
