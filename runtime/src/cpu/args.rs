//! What a CPU kernel is handed: typed access to the buffers `bind` checked against the op's
//! signature (named by their roles there), and the shape checks the kernels run before
//! indexing. Every mismatch is a `RuntimeError::Op` naming the op, the role and the buffer:
//! a lowering bug must surface as a clear error, never as a panic or silent garbage.
use super::memory::{View, ViewMut};
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::Segment;
use parc_compiler::ir::BufferId;

pub(crate) use crate::bind::op_error;

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
    /// The error of a family's entry point handed an op of another family (a backend bug).
    pub fn unrouted(&self, family: &str) -> RuntimeError {
        op_error(
            self.op,
            format!("is not an op of the {family} family (a CPU dispatch bug)"),
        )
    }

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

/// An op that overwrites its parameter gradients (`accumulate_param_grad` false) writes what
/// adding into zeros writes: the gradients are cleared, then the accumulating kernel runs.
pub(crate) fn first_write<const N: usize>(accumulate: bool, grads: [&mut [f32]; N]) {
    if !accumulate {
        for g in grads {
            g.fill(0.0);
        }
    }
}
