//! What a CPU kernel is handed: the op's buffers as `crate::bind` bound them to its signature
//! (`Bound`: counts, element types, element counts, rows), read as typed slices by their role
//! there. Binding guarantees every operand's element count against its shape rule, so the
//! kernels index without checking lengths again; what they still check is what a signature
//! cannot say (attributes no shape contains, segment positions, copy ranges). Every error is a
//! `RuntimeError::Op` naming the op, and for an operand its role and buffer: a lowering bug
//! must surface as a clear error, never as a panic or silent garbage.
use super::memory::{View, ViewMut};
use crate::bind::{Bound, OperandBuffer};
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::Segment;
use parc_compiler::ir::table::{Operand, Write};
use parc_compiler::ir::{BufferId, DType};

pub(crate) use crate::bind::op_error;

/// A buffer of this backend as operand binding sees it: id, element type, element count.
#[derive(Clone, Copy)]
pub(crate) struct SlotRef(pub BufferId, pub DType, pub usize);

impl OperandBuffer for SlotRef {
    fn id(&self) -> BufferId {
        self.0
    }
    fn dtype(&self) -> DType {
        self.1
    }
    fn numel(&self) -> usize {
        self.2
    }
}

/// An op bound to this backend's buffers.
pub(crate) type BoundOp<'a> = Bound<'a, SlotRef>;

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
/// positions, `expected` being the sequence length of buffer `what` (binding derived it from
/// the segments' total, which a sum past `u32` would have wrapped).
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

/// The index of the operand `role` among `operands`, if the signature has it.
fn position(operands: &[Operand], role: &str) -> Option<usize> {
    operands.iter().position(|o| o.role == role)
}

/// Operand `i` of one side as messages name it: `input 2 (b, buffer 7)`.
fn describe(side: &str, operands: &[Operand], buffers: &[SlotRef], i: usize) -> String {
    match (operands.get(i), buffers.get(i)) {
        (Some(operand), Some(b)) => BoundOp::describe(side, i, operand, b),
        _ => format!("{side} {i}"),
    }
}

/// A role the op's signature does not have, asked for by a kernel (a backend bug).
fn no_operand(bound: &BoundOp, side: &str, role: &str) -> RuntimeError {
    bound.err(format!("has no {side} {role} (a CPU backend bug)"))
}

/// The input buffers of one bound op, read by role.
pub(crate) struct Inputs<'a> {
    bound: &'a BoundOp<'a>,
    views: Vec<View<'a>>,
}

impl<'a> Inputs<'a> {
    /// `views[i]` holds input `i` of `bound`.
    pub fn new(bound: &'a BoundOp<'a>, views: Vec<View<'a>>) -> Inputs<'a> {
        Inputs { bound, views }
    }

    /// The op's name, for messages.
    pub fn name(&self) -> &'static str {
        self.bound.name()
    }

    /// A dimension attribute as usize; zero is an error (no op has an empty dimension).
    pub fn dim(&self, name: &str, value: u64) -> Result<usize> {
        self.bound.dim(name, value)
    }

    /// An error about this op.
    pub fn err(&self, what: impl Into<String>) -> RuntimeError {
        self.bound.err(what)
    }

    /// The error of a family's entry point handed an op of another family (a backend bug).
    pub fn unrouted(&self, family: &str) -> RuntimeError {
        self.err(format!(
            "is not an op of the {family} family (a CPU dispatch bug)"
        ))
    }

    /// Input `role` as f32 (a float operand's bf16 staged through f32).
    pub fn f32(&self, role: &str) -> Result<&'a [f32]> {
        self.typed(role, View::as_f32, "f32")
    }

    /// Input `role` as i32 (token ids).
    pub fn i32(&self, role: &str) -> Result<&'a [i32]> {
        self.typed(role, View::as_i32, "i32")
    }

    /// Input `role` as f32 if the op's signature has it (an operand its attributes make
    /// optional), else None.
    pub fn optional_f32(&self, role: &str) -> Result<Option<&'a [f32]>> {
        let present = position(&self.bound.signature.inputs, role).is_some();
        present.then(|| self.f32(role)).transpose()
    }

    /// Every input as f32, in order (an op whose input count varies).
    pub fn all_f32(&self) -> Result<Vec<&'a [f32]>> {
        let roles = self.bound.signature.inputs.iter().map(|o| o.role);
        roles.map(|role| self.f32(role)).collect()
    }

    fn typed<T: ?Sized>(
        &self,
        role: &str,
        cast: fn(&View<'a>) -> Option<&'a T>,
        expected: &str,
    ) -> Result<&'a T> {
        let bound = self.bound;
        let i = position(&bound.signature.inputs, role)
            .ok_or_else(|| no_operand(bound, "input", role))?;
        let what = || describe("input", &bound.signature.inputs, bound.inputs, i);
        let view = self
            .views
            .get(i)
            .ok_or_else(|| self.err(format!("{} lost its binding (a CPU backend bug)", what())))?;
        cast(view).ok_or_else(|| {
            self.err(format!(
                "{} is {}, expected {expected}",
                what(),
                view.type_name()
            ))
        })
    }
}

/// The output buffers of one bound op, each taken once by role (so that several can be
/// written at once).
pub(crate) struct Outputs<'a> {
    bound: &'a BoundOp<'a>,
    views: Vec<Option<ViewMut<'a>>>,
}

impl<'a> Outputs<'a> {
    /// `views[i]` holds output `i` of `bound`.
    pub fn new(bound: &'a BoundOp<'a>, views: Vec<ViewMut<'a>>) -> Outputs<'a> {
        let views = views.into_iter().map(Some).collect();
        Outputs { bound, views }
    }

    /// Output `role` as f32 (a float operand's bf16 staged through f32).
    pub fn f32(&mut self, role: &str) -> Result<&'a mut [f32]> {
        let bound = self.bound;
        self.optional_f32(role)?
            .ok_or_else(|| no_operand(bound, "output", role))
    }

    /// Output `role` if the op's signature has it (see [`Inputs::optional_f32`]).
    pub fn optional_f32(&mut self, role: &str) -> Result<Option<&'a mut [f32]>> {
        let i = position(&self.bound.signature.outputs, role);
        i.map(|i| self.take(i)).transpose()
    }

    /// Output `role` for a kernel that adds into it: cleared first where the op overwrites
    /// it (`Write::Overwrite` in its signature, e.g. a parameter gradient without
    /// `accumulate_param_grad`), so the op writes what adding into zeros writes.
    pub fn accumulator(&mut self, role: &str) -> Result<&'a mut [f32]> {
        let bound = self.bound;
        self.optional_accumulator(role)?
            .ok_or_else(|| no_operand(bound, "output", role))
    }

    /// [`Outputs::accumulator`] for an output the op's attributes make optional.
    pub fn optional_accumulator(&mut self, role: &str) -> Result<Option<&'a mut [f32]>> {
        let operands = &self.bound.signature.outputs;
        let Some(i) = position(operands, role) else {
            return Ok(None);
        };
        let out = self.take(i)?;
        if operands.get(i).is_some_and(|o| o.write == Write::Overwrite) {
            out.fill(0.0);
        }
        Ok(Some(out))
    }

    /// Every output as f32, in order (an op whose output count varies).
    pub fn all_f32(&mut self) -> Result<Vec<&'a mut [f32]>> {
        (0..self.views.len()).map(|i| self.take(i)).collect()
    }

    fn take(&mut self, i: usize) -> Result<&'a mut [f32]> {
        let bound = self.bound;
        let what = || describe("output", &bound.signature.outputs, bound.outputs, i);
        match self.views.get_mut(i).and_then(Option::take) {
            Some(ViewMut::F32(values)) => Ok(values),
            Some(_) => Err(bound.err(format!("{} is not f32", what()))),
            None => Err(bound.err(format!(
                "{} is taken twice or lost its binding (a CPU backend bug)",
                what()
            ))),
        }
    }
}
