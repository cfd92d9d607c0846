//! The elementwise family on the GPU (kernels/elementwise.cu): rotary position embedding and
//! its inverse rotation (`Rope`, `RopeBwd`, at the op's global positions), the cos/sin table
//! of a fused rope (`RopeTable`), activations and
//! their gradients, SwiGLU and its gradient, `Add` and `Scale`. Each reads f32 or bf16
//! operands widened and rounds what it writes to its output's type; every operand of one op
//! has the same element count (`bind` checked it).
use super::args::{fv, n, p, Bound, Limits};
use super::epilogue::{swiglu_apart, swiglu_grad};
use super::kernel::Kernel;
use super::{Arg, CudaBackend};
use crate::error::Result;
use parc_compiler::ir::op::{ActAttrs, Op, RopeAttrs, RopeScaling};

/// Run an op of the elementwise family.
pub(super) fn run(be: &mut CudaBackend, b: &Bound) -> Result<()> {
    if let Op::RopeTable(attrs) = b.op {
        return rope_table(be, b, attrs);
    }
    let x = b.input(0)?;
    let len = x.len;
    match b.op {
        Op::Rope(attrs) => rope(be, b, attrs, 1.0),
        Op::RopeBwd(attrs) => rope(be, b, attrs, -1.0),
        Op::Activation(ActAttrs { act }) => {
            let args = [Arg::I32(act.code()), fv(x), fv(b.output(0)?), n(len)];
            be.launch_vec(Kernel::ActivationFwd, len, &args)
        }
        Op::ActivationBwd(ActAttrs { act }) => {
            let (x, dx) = (b.input(1)?, b.output(0)?);
            let args = [Arg::I32(act.code()), fv(b.input(0)?), fv(x), fv(dx), n(len)];
            be.launch_vec(Kernel::ActivationBwd, len, &args)
        }
        Op::SwiGlu => swiglu_apart(be, x, b.input(1)?, b.output(0)?),
        Op::SwiGluBwd => {
            let (gate, up) = (b.input(1)?, b.input(2)?);
            swiglu_grad(be, x, (gate, up), (b.output(0)?, b.output(1)?))
        }
        Op::Add => {
            let args = [fv(x), fv(b.input(1)?), fv(b.output(0)?), n(len)];
            be.launch_vec(Kernel::AddFwd, len, &args)
        }
        Op::Scale { factor } => {
            let args = [fv(x), fv(b.output(0)?), Arg::F32(*factor as f32), n(len)];
            be.launch_vec(Kernel::ScaleFwd, len, &args)
        }
        _ => Err(b.err("is not an elementwise op")),
    }
}

/// A rope's frequency scaling as the kernels' `struct RopeScale` (kernels/elementwise.cu), whose
/// `rope_inv_freq` computes `parc_compiler::ir::rope::inv_freq` with it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RopeScale {
    /// 0 none, 1 linear, 2 llama3.
    pub kind: i32,
    pub factor: f64,
    pub low: f64,
    pub high: f64,
    pub original: f64,
}

impl RopeScale {
    pub fn of(s: RopeScaling) -> RopeScale {
        let plain = RopeScale {
            kind: 0,
            factor: 1.0,
            low: 1.0,
            high: 1.0,
            original: 0.0,
        };
        match s {
            RopeScaling::None => plain,
            RopeScaling::Linear { factor } => RopeScale {
                kind: 1,
                factor,
                ..plain
            },
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => RopeScale {
                kind: 2,
                factor,
                low: low_freq_factor,
                high: high_freq_factor,
                original: original_max_position as f64,
            },
        }
    }
}

/// A rotation's turned features (`RopeAttrs::rotary`), unless the op's rotation is undefined
/// (`RopeAttrs::problem`).
fn check_rotation(b: &Bound, a: &RopeAttrs) -> Result<usize> {
    match a.problem() {
        Some(problem) => Err(b.err(problem)),
        None => Ok(a.rotary() as usize),
    }
}

/// Writes the cos/sin table of the op's positions (`Op::RopeTable`).
fn rope_table(be: &mut CudaBackend, b: &Bound, a: &RopeAttrs) -> Result<()> {
    let hd = b.launch_dim("head_dim", a.head_dim)?;
    let rot = check_rotation(b, a)?;
    let table = b.output(0)?;
    let positions = b.launch_rows(table, "table", table.len / (2 * hd))?;
    let (pos, _) = be.positions(&a.positions)?;
    let args = [
        p(table),
        Arg::Ptr(pos),
        n(positions),
        n(hd),
        n(rot),
        Arg::F64(a.theta),
        Arg::RopeScale(RopeScale::of(a.scaling)),
    ];
    be.launch_n(Kernel::RopeTable, positions * hd / 2, &args)
}

/// Rotates each pair of a head's columns by its position's angle: forward (`sign` 1) or back
/// (`sign` -1, the gradient).
fn rope(be: &mut CudaBackend, b: &Bound, a: &RopeAttrs, sign: f64) -> Result<()> {
    let (batch, heads, hd) = (
        b.launch_dim("batch", a.batch)?,
        b.launch_dim("heads", a.heads)?,
        b.launch_dim("head_dim", a.head_dim)?,
    );
    let rot = check_rotation(b, a)?;
    let (x, y) = (b.input(0)?, b.output(0)?);
    let rows = b.launch_rows(x, "x", b.rows)?;
    let (pos, _) = be.positions(&a.positions)?;
    let args = [
        fv(x),
        fv(y),
        Arg::Ptr(pos),
        n(rows),
        n(batch),
        n(heads),
        n(hd),
        n(rot),
        Arg::F64(a.theta),
        Arg::RopeScale(RopeScale::of(a.scaling)),
        Arg::F64(sign),
    ];
    be.launch_n(Kernel::RopeFwd, rows * heads * hd / 2, &args)
}
