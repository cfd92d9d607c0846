//! Binding a compute op's buffers to its signature (`parc_compiler::ir::table`), once, for every
//! backend: the operand counts, each buffer's element type against its storage class, each
//! buffer's element count against its shape rule, and the op's row counts (`n`, `m`) derived
//! from them. A backend binds before it touches memory and then reads the checked buffers by
//! position, so its kernels check only what is theirs (launch limits, tile sizes). Every
//! mismatch is a `RuntimeError::Op` naming the op, the operand's role and the buffer: a
//! lowering bug surfaces as a clear error, never as a panic or an out-of-bounds kernel.
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::Op;
use parc_compiler::ir::table::{Operand, Rows, Shape, Signature};
use parc_compiler::ir::{BufferId, DType};

/// What binding needs to know of a backend's buffer.
pub trait OperandBuffer {
    fn id(&self) -> BufferId;
    fn dtype(&self) -> DType;
    /// Element count.
    fn numel(&self) -> usize;
}

/// An op's buffers, checked against its signature.
pub struct Bound<'a, B> {
    pub op: &'a Op,
    pub signature: Signature,
    pub inputs: &'a [B],
    pub outputs: &'a [B],
    /// The op's row count `n` (0 when no operand is row-shaped).
    pub rows: usize,
    /// The op's key/value row count `m` (0 when no operand is).
    pub kv_rows: usize,
}

/// An `Op` error for op `op`.
pub fn op_error(op: &str, what: impl Into<String>) -> RuntimeError {
    RuntimeError::Op {
        op: op.to_string(),
        what: what.into(),
    }
}

impl<'a, B: OperandBuffer + Copy> Bound<'a, B> {
    /// Check `inputs` and `outputs` against `op`'s signature.
    pub fn bind(op: &'a Op, inputs: &'a [B], outputs: &'a [B]) -> Result<Self> {
        let signature = op.signature();
        let name = signature.opcode.name();
        let count = |side: &str, operands: &[Operand], got: usize| {
            let roles: Vec<&str> = operands.iter().map(|o| o.role).collect();
            op_error(
                name,
                format!(
                    "takes {} {side} ({}), got {got}",
                    roles.len(),
                    roles.join(", ")
                ),
            )
        };
        if inputs.len() != signature.inputs.len() {
            return Err(count("inputs", &signature.inputs, inputs.len()));
        }
        if outputs.len() != signature.outputs.len() {
            return Err(count("outputs", &signature.outputs, outputs.len()));
        }
        let mut bound = Bound {
            op,
            signature,
            inputs,
            outputs,
            rows: 0,
            kv_rows: 0,
        };
        bound.check_types()?;
        bound.check_shapes()?;
        Ok(bound)
    }

    /// The op's name, for messages.
    pub fn name(&self) -> &'static str {
        self.signature.opcode.name()
    }

    /// An error about this op.
    pub fn err(&self, what: impl Into<String>) -> RuntimeError {
        op_error(self.name(), what)
    }

    /// Input `i` (checked by `bind`; an index past the signature is a backend bug, reported).
    pub fn input(&self, i: usize) -> Result<B> {
        self.inputs
            .get(i)
            .copied()
            .ok_or_else(|| self.err(format!("has no input {i}")))
    }

    /// The input in role `role` where the op's signature has one (an operand its attributes
    /// make optional, e.g. an FP8 GEMM's `x_amax`), else None.
    pub fn optional_input(&self, role: &str) -> Option<B> {
        let i = self.signature.inputs.iter().position(|o| o.role == role)?;
        self.inputs.get(i).copied()
    }

    /// Output `i` (see [`Bound::input`]).
    pub fn output(&self, i: usize) -> Result<B> {
        self.outputs
            .get(i)
            .copied()
            .ok_or_else(|| self.err(format!("has no output {i}")))
    }

    /// A dimension attribute as usize; zero is an error (no op has an empty dimension).
    pub fn dim(&self, name: &str, value: u64) -> Result<usize> {
        usize::try_from(value)
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| self.err(format!("{name} = {value} must be positive")))
    }

    fn operands(&self) -> impl Iterator<Item = (&'static str, usize, &Operand, B)> + '_ {
        let ins = self.signature.inputs.iter().zip(self.inputs);
        let outs = self.signature.outputs.iter().zip(self.outputs);
        let ins = ins.enumerate().map(|(i, (o, b))| ("input", i, o, *b));
        ins.chain(outs.enumerate().map(|(i, (o, b))| ("output", i, o, *b)))
    }

    /// Operand `i` of `side` (`input` or `output`) as messages name it.
    pub(crate) fn describe(side: &str, i: usize, operand: &Operand, b: &B) -> String {
        format!("{side} {i} ({}, buffer {})", operand.role, b.id().0)
    }

    fn check_types(&self) -> Result<()> {
        for (side, i, operand, b) in self.operands() {
            if !operand.class.accepts(b.dtype()) {
                return Err(self.err(format!(
                    "{} is {}, expected {}",
                    Self::describe(side, i, operand, &b),
                    b.dtype().name(),
                    operand.class.describe()
                )));
            }
        }
        Ok(())
    }

    /// Derive `n` and `m` (from the attributes, else from the first operand of each) and check
    /// every operand's element count against its shape.
    fn check_shapes(&mut self) -> Result<()> {
        let mut rows = self.signature.rows.map(|r| self.usize(r)).transpose()?;
        let mut kv_rows = self.signature.kv_rows.map(|r| self.usize(r)).transpose()?;
        for (side, i, operand, b) in self.operands() {
            let Some(shape) = operand.shape else {
                continue;
            };
            let what = || Self::describe(side, i, operand, &b);
            let cols = self.usize(shape.cols)?;
            if cols == 0 {
                return Err(self.err(format!(
                    "{} has rows of 0 elements: a dimension attribute is 0, and must be positive",
                    what()
                )));
            }
            let expected = match shape.rows {
                Rows::N => self.resolve(&mut rows, &b, cols, what)?,
                Rows::M => self.resolve(&mut kv_rows, &b, cols, what)?,
                Rows::Fixed(r) => Some(self.usize(r)?),
                Rows::Any => None,
            };
            self.check_len(&shape, expected, cols, b.numel(), what)?;
        }
        self.rows = rows.unwrap_or(0);
        self.kv_rows = kv_rows.unwrap_or(0);
        Ok(())
    }

    /// The row count an `[n, cols]` operand must have: the one already known, or this
    /// buffer's (which must then be whole rows).
    fn resolve(
        &self,
        known: &mut Option<usize>,
        b: &B,
        cols: usize,
        what: impl Fn() -> String,
    ) -> Result<Option<usize>> {
        if known.is_none() {
            if !b.numel().is_multiple_of(cols) {
                return Err(self.err(format!(
                    "{} holds {} elements, not a whole number of rows of {cols}",
                    what(),
                    b.numel()
                )));
            }
            *known = Some(b.numel() / cols);
        }
        Ok(*known)
    }

    fn check_len(
        &self,
        shape: &Shape,
        rows: Option<usize>,
        cols: usize,
        len: usize,
        what: impl Fn() -> String,
    ) -> Result<()> {
        let expected = match rows.map(|r| (r, r.checked_mul(cols))) {
            Some((_, Some(n))) if n == len => return Ok(()),
            None if len.is_multiple_of(cols) => return Ok(()),
            Some((r, Some(_))) => format!("[{r}, {cols}]"),
            Some((r, None)) => format!("[{r}, {cols}], whose element count overflows"),
            None => format!("whole rows of {cols}"),
        };
        Err(self.err(format!(
            "{} holds {len} elements, expected {expected} ({:?} rows)",
            what(),
            shape.rows
        )))
    }

    fn usize(&self, v: u64) -> Result<usize> {
        usize::try_from(v).map_err(|_| self.err(format!("size {v} does not fit this machine")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parc_compiler::ir::op::{EmbeddingAttrs, Op};

    #[derive(Clone, Copy)]
    struct Buf(u32, DType, usize);

    impl OperandBuffer for Buf {
        fn id(&self) -> BufferId {
            BufferId(self.0)
        }
        fn dtype(&self) -> DType {
            self.1
        }
        fn numel(&self) -> usize {
            self.2
        }
    }

    fn matmul() -> Op {
        Op::Matmul {
            in_dim: 3,
            out_dim: 5,
            bias: true,
            act: None,
            residual: false,
            swiglu: false,
            fp8: None,
        }
    }

    /// x `[rows, 3]` of `x_len` elements, w `[5, 3]` and b `[5]`, of the given types.
    fn matmul_inputs(x_len: usize, x: DType, w: DType) -> [Buf; 3] {
        [Buf(0, x, x_len), Buf(1, w, 15), Buf(2, DType::F32, 5)]
    }

    fn bind_error(op: &Op, ins: &[Buf], outs: &[Buf]) -> String {
        match Bound::bind(op, ins, outs) {
            Ok(_) => panic!("bound a malformed op"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn derives_rows_and_accepts_a_well_formed_op() {
        let op = matmul();
        let ins = matmul_inputs(21, DType::Bf16, DType::F32);
        let outs = [Buf(3, DType::F32, 35)];
        let bound = Bound::bind(&op, &ins, &outs).unwrap();
        assert_eq!(bound.rows, 7);
        assert_eq!(bound.output(0).unwrap().0, 3);
        assert!(bound.output(1).is_err());
    }

    #[test]
    fn names_the_role_and_buffer_of_each_mismatch() {
        let op = matmul();
        let ins = matmul_inputs(21, DType::F32, DType::F32);
        let short = [Buf(9, DType::F32, 34)];
        let e = bind_error(&op, &ins, &short);
        assert!(
            e.contains("matmul") && e.contains("output 0 (y, buffer 9)"),
            "{e}"
        );
        let bf16_bias = [ins[0], ins[1], Buf(2, DType::Bf16, 5)];
        let e = bind_error(&op, &bf16_bias, &short);
        assert!(
            e.contains("input 2 (b, buffer 2) is bf16, expected f32"),
            "{e}"
        );
        let e = bind_error(&op, &ins[..2], &short);
        assert!(e.contains("takes 3 inputs (x, w, b), got 2"), "{e}");
        let e = bind_error(&op, &matmul_inputs(20, DType::F32, DType::F32), &short);
        assert!(e.contains("not a whole number of rows of 3"), "{e}");
    }

    #[test]
    fn tokens_and_fixed_tables_are_checked() {
        let op = Op::Embedding(EmbeddingAttrs {
            vocab_start: 0,
            vocab_local: 10,
            dim: 4,
        });
        let outs = [Buf(2, DType::F32, 24)];
        let ins = [Buf(0, DType::I32, 6), Buf(1, DType::F32, 40)];
        assert_eq!(Bound::bind(&op, &ins, &outs).unwrap().rows, 6);
        let float_ids = [Buf(0, DType::F32, 6), Buf(1, DType::F32, 40)];
        assert!(Bound::bind(&op, &float_ids, &outs).is_err());
        let small_table = [Buf(0, DType::I32, 6), Buf(1, DType::F32, 36)];
        let e = bind_error(&op, &small_table, &outs);
        assert!(
            e.contains("input 1 (table, buffer 1) holds 36 elements, expected [10, 4]"),
            "{e}"
        );
    }
}
