//! What a compute op is handed, checked: each op's name and the roles of its inputs and outputs
//! (from `op.rs`), typed access to the buffers bound to them, and the shape checks the kernels run
//! before indexing. Every mismatch is a `RuntimeError::Op` naming the op, the role and the buffer:
//! a lowering bug must surface as a clear error, never as a panic or silent garbage.
use super::memory::{View, ViewMut};
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::{Op, Segment};
use parc_compiler::ir::BufferId;

/// An op's name (as in the IR's text form) and the roles of its inputs and outputs, in order.
pub(crate) struct Signature {
    pub name: &'static str,
    pub inputs: Vec<&'static str>,
    pub outputs: Vec<&'static str>,
}

fn sig(name: &'static str, inputs: &[&'static str], outputs: &[&'static str]) -> Signature {
    Signature {
        name,
        inputs: inputs.to_vec(),
        outputs: outputs.to_vec(),
    }
}

/// `base` followed by `extra` when `flag` is set (optional bias / momentum buffers).
fn with(base: &[&'static str], flag: bool, extra: &'static str) -> Vec<&'static str> {
    let mut roles = base.to_vec();
    if flag {
        roles.push(extra);
    }
    roles
}

/// The roles of `SplitColumns`' outputs and `ConcatColumns`' inputs (the IR's operand limit).
const PARTS: [&str; 3] = ["part0", "part1", "part2"];

pub(crate) fn signature(op: &Op) -> Signature {
    match op {
        Op::Embedding { .. } => sig("embedding", &["ids", "table"], &["y"]),
        Op::EmbeddingBwd { .. } => sig("embedding_bwd", &["ids", "dy"], &["dtable"]),
        Op::PositionAdd { .. } => sig("position_add", &["x", "table"], &["y"]),
        Op::PositionAddBwd { .. } => sig("position_add_bwd", &["dy"], &["dtable"]),
        Op::LayerNorm { bias, .. } => Signature {
            name: "layer_norm",
            inputs: with(&["x", "w"], *bias, "b"),
            outputs: vec!["y", "mean", "rstd"],
        },
        Op::LayerNormBwd { bias, .. } => Signature {
            name: "layer_norm_bwd",
            inputs: vec!["dy", "x", "w", "mean", "rstd"],
            outputs: with(&["dx", "dw"], *bias, "db"),
        },
        Op::RmsNorm { .. } => sig("rms_norm", &["x", "w"], &["y", "rstd"]),
        Op::RmsNormBwd { .. } => sig("rms_norm_bwd", &["dy", "x", "w", "rstd"], &["dx", "dw"]),
        Op::Matmul {
            bias,
            act,
            residual,
            ..
        } => Signature {
            name: "matmul",
            inputs: with(&with(&["x", "w"], *bias, "b"), *residual, "r"),
            outputs: with(&["y"], act.is_some(), "a"),
        },
        Op::MatmulBwdData { act_grad, .. } => Signature {
            name: "matmul_bwd_data",
            inputs: with(&["dy", "w"], act_grad.is_some(), "pre"),
            outputs: vec!["dx"],
        },
        Op::MatmulBwdWeight { bias, .. } => Signature {
            name: "matmul_bwd_weight",
            inputs: vec!["dy", "x"],
            outputs: with(&["dw"], *bias, "db"),
        },
        Op::Rope { .. } => sig("rope", &["x"], &["y"]),
        Op::RopeBwd { .. } => sig("rope_bwd", &["dy"], &["dx"]),
        Op::Attention { packed: true, .. } => sig("attention", &["qkv"], &["o", "lse"]),
        Op::Attention { .. } => sig("attention", &["q", "k", "v"], &["o", "lse"]),
        Op::AttentionBwd { packed: true, .. } => {
            sig("attention_bwd", &["do", "qkv", "o", "lse"], &["dqkv"])
        }
        Op::AttentionBwd { .. } => sig(
            "attention_bwd",
            &["do", "q", "k", "v", "o", "lse"],
            &["dq", "dk", "dv"],
        ),
        Op::Activation { .. } => sig("activation", &["x"], &["y"]),
        Op::ActivationBwd { .. } => sig("activation_bwd", &["dy", "x"], &["dx"]),
        Op::SwiGlu => sig("swiglu", &["gate", "up"], &["y"]),
        Op::SwiGluBwd => sig("swiglu_bwd", &["dy", "gate", "up"], &["dgate", "dup"]),
        Op::Add => sig("add", &["a", "b"], &["y"]),
        Op::Scale { .. } => sig("scale", &["x"], &["y"]),
        Op::Copy => sig("copy", &["x"], &["y"]),
        Op::Zero => sig("zero", &[], &["buffer"]),
        Op::CopyRange { .. } => sig("copy_range", &["src"], &["dst"]),
        Op::SplitColumns { widths } => Signature {
            name: "split_columns",
            inputs: vec!["x"],
            outputs: PARTS.iter().copied().take(widths.len()).collect(),
        },
        Op::ConcatColumns { widths } => Signature {
            name: "concat_columns",
            inputs: PARTS.iter().copied().take(widths.len()).collect(),
            outputs: vec!["y"],
        },
        Op::CrossEntropy { .. } => sig(
            "cross_entropy",
            &["logits", "targets"],
            &["dlogits", "loss"],
        ),
        Op::CeMax { .. } => sig("ce_max", &["logits"], &["max"]),
        Op::CeSumExp { .. } => sig("ce_sum_exp", &["logits", "max"], &["sumexp"]),
        Op::CeTargetLogit { .. } => {
            sig("ce_target_logit", &["logits", "targets"], &["target_logit"])
        }
        Op::CeLoss { .. } => sig("ce_loss", &["max", "sumexp", "target_logit"], &["loss"]),
        Op::CeGrad { .. } => sig(
            "ce_grad",
            &["logits", "targets", "max", "sumexp"],
            &["dlogits"],
        ),
        Op::SumSquares => sig("sum_squares", &["g"], &["sumsq"]),
        Op::ClipCoef { .. } => sig("clip_coef", &["sumsq"], &["coef"]),
        Op::AdamW { .. } => sig("adamw", &["g", "coef"], &["param", "m", "v"]),
        Op::Sgd { momentum, .. } => Signature {
            name: "sgd",
            inputs: vec!["g", "coef"],
            outputs: with(&["param"], *momentum != 0.0, "momentum"),
        },
    }
}

/// An `Op` error for op `op`.
pub(crate) fn op_error(op: &str, what: impl Into<String>) -> RuntimeError {
    RuntimeError::Op {
        op: op.to_string(),
        what: what.into(),
    }
}

/// A dimension attribute as usize; zero is an error (no op has an empty dimension).
pub(crate) fn dim(op: &str, name: &str, value: u64) -> Result<usize> {
    match usize::try_from(value) {
        Ok(v) if v > 0 => Ok(v),
        _ => Err(op_error(op, format!("{name} = {value} must be positive"))),
    }
}

/// Fail unless buffer `what` has exactly `expected` elements.
pub(crate) fn expect_len(op: &str, what: &str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(op_error(
            op,
            format!("{what} has {got} elements, expected {expected}"),
        ))
    }
}

/// Fails unless buffer `what`, of `len` elements, holds a tensor of `shape` (whose element
/// count must not overflow).
pub(crate) fn expect_shape(op: &str, what: &str, len: usize, shape: &[usize]) -> Result<()> {
    expect_len(op, what, len, product(op, what, shape)?)
}

/// Rows of a `[rows, cols]` buffer `what` of `len` elements (`len` must be a multiple of `cols`).
pub(crate) fn rows_of(op: &str, what: &str, len: usize, cols: usize) -> Result<usize> {
    if len.checked_rem(cols) == Some(0) {
        Ok(len / cols)
    } else {
        Err(op_error(
            op,
            format!("{what} has {len} elements, not a whole number of rows of {cols}"),
        ))
    }
}

/// The product of `factors` (the element count of a shape named `what`), or an error when it
/// overflows.
pub(crate) fn product(op: &str, what: &str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| op_error(op, format!("{what} {factors:?} overflows")))
}

/// The global position of each of the `expected` local sequence indices described by
/// `segments`; fails (before allocating anything) unless the segments cover exactly `expected`
/// positions, `expected` being the sequence length of buffer `what`.
pub(crate) fn positions_for(
    op: &str,
    segments: &[Segment],
    what: &str,
    expected: usize,
) -> Result<Vec<u32>> {
    let total: u64 = segments.iter().map(|s| u64::from(s.len)).sum();
    if total != expected as u64 {
        return Err(op_error(
            op,
            format!("positions cover {total} sequence positions but {what} holds {expected}"),
        ));
    }
    let mut positions = Vec::with_capacity(expected);
    for s in segments {
        let end = s
            .start
            .checked_add(s.len)
            .ok_or_else(|| op_error(op, format!("segment {}+{} overflows u32", s.start, s.len)))?;
        positions.extend(s.start..end);
    }
    Ok(positions)
}

/// The input buffers of one op, bound to their roles.
pub(crate) struct Inputs<'a> {
    pub op: &'static str,
    pub roles: &'a [&'static str],
    pub ids: &'a [BufferId],
    pub tensors: Vec<View<'a>>,
}

impl<'a> Inputs<'a> {
    fn describe(&self, i: usize) -> String {
        let role = self.roles.get(i).copied().unwrap_or("?");
        let id = self.ids.get(i).map_or(u32::MAX, |b| b.0);
        format!("input {i} ({role}, buffer {id})")
    }

    pub fn tensor(&self, i: usize) -> Result<View<'a>> {
        self.tensors
            .get(i)
            .copied()
            .ok_or_else(|| op_error(self.op, format!("{} is missing", self.describe(i))))
    }

    pub fn f32(&self, i: usize) -> Result<&'a [f32]> {
        self.tensor(i)?.as_f32().ok_or_else(|| {
            op_error(
                self.op,
                format!("{} is i32, expected f32", self.describe(i)),
            )
        })
    }

    pub fn i32(&self, i: usize) -> Result<&'a [i32]> {
        self.tensor(i)?.as_i32().ok_or_else(|| {
            op_error(
                self.op,
                format!("{} is f32, expected i32", self.describe(i)),
            )
        })
    }
}

/// The output buffers of one op, bound to their roles.
pub(crate) struct Outputs<'a> {
    pub op: &'static str,
    pub roles: &'a [&'static str],
    pub ids: &'a [BufferId],
    pub tensors: Vec<ViewMut<'a>>,
}

impl<'a> Outputs<'a> {
    fn describe(&self, i: usize) -> String {
        let role = self.roles.get(i).copied().unwrap_or("?");
        let id = self.ids.get(i).map_or(u32::MAX, |b| b.0);
        format!("output {i} ({role}, buffer {id})")
    }

    pub fn tensor(&mut self, i: usize) -> Result<&mut ViewMut<'a>> {
        let missing = op_error(self.op, format!("{} is missing", self.describe(i)));
        self.tensors.get_mut(i).ok_or(missing)
    }

    /// All `N` outputs as f32 slices, in order.
    pub fn f32s<const N: usize>(&mut self) -> Result<[&mut [f32]; N]> {
        if self.tensors.len() != N {
            return Err(op_error(
                self.op,
                format!("expects {N} outputs, got {}", self.tensors.len()),
            ));
        }
        let op = self.op;
        self.f32_vec()?
            .try_into()
            .map_err(|_| op_error(op, format!("expects {N} outputs")))
    }

    /// Every output as an f32 slice, in order (an op whose output count varies).
    pub fn f32_vec(&mut self) -> Result<Vec<&mut [f32]>> {
        let descriptions: Vec<String> = (0..self.tensors.len()).map(|i| self.describe(i)).collect();
        let op = self.op;
        self.tensors
            .iter_mut()
            .zip(descriptions)
            .map(|(tensor, description)| {
                tensor
                    .as_f32_mut()
                    .ok_or_else(|| op_error(op, format!("{description} is i32, expected f32")))
            })
            .collect()
    }
}
