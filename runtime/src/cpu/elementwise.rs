//! Elementwise ops: activations (gelu erf form, gelu tanh approximation, relu) and their
//! gradients, SwiGLU, add, scale, and rotary embedding and its cos/sin table (their kernels in
//! `rope`). Computed in f32
//! (`libm::erff` for gelu; gelu_tanh through the identity `0.5·(1 + tanh u) = σ(2u)`, one
//! exponential per element).
use super::args::{Inputs, Outputs};
use super::par::TASK_ELEMENTS;
use super::rope::{rope, rope_table, Freqs, RopeShape};
use crate::error::Result;
use parc_compiler::ir::op::{Act, ActAttrs, Op};
use rayon::prelude::*;

/// The elementwise family's entry point (see `dispatch`).
pub(crate) fn run(op: &Op, ins: &Inputs, outs: &mut Outputs) -> Result<()> {
    match op {
        Op::Rope(a) | Op::RopeBwd(a) => {
            let shape = RopeShape {
                batch: ins.dim("batch", a.batch)?,
                heads: ins.dim("heads", a.heads)?,
                head_dim: ins.dim("head_dim", a.head_dim)?,
                freqs: Freqs::of(a),
                positions: &a.positions,
            };
            // The backward rotates the gradient back by the negative angle.
            let (x, y, inverse) = match op {
                Op::Rope(_) => (ins.f32("x")?, outs.f32("y")?, false),
                _ => (ins.f32("dy")?, outs.f32("dx")?, true),
            };
            rope(ins.name(), &shape, inverse, x, y)?;
        }
        Op::RopeTable(a) => {
            let head_dim = ins.dim("head_dim", a.head_dim)?;
            rope_table(
                ins.name(),
                head_dim,
                Freqs::of(a),
                &a.positions,
                outs.f32("table")?,
            )?;
        }
        Op::Activation(ActAttrs { act }) => activation(*act, ins.f32("x")?, outs.f32("y")?),
        Op::ActivationBwd(ActAttrs { act }) => {
            let (dy, x) = (ins.f32("dy")?, ins.f32("x")?);
            activation_bwd(*act, dy, x, outs.f32("dx")?);
        }
        Op::SwiGlu => swiglu(ins.f32("gate")?, ins.f32("up")?, outs.f32("y")?),
        Op::SwiGluBwd => {
            let (dy, gate, up) = (ins.f32("dy")?, ins.f32("gate")?, ins.f32("up")?);
            swiglu_bwd(dy, gate, up, outs.f32("dgate")?, outs.f32("dup")?);
        }
        Op::Add => add(ins.f32("a")?, ins.f32("b")?, outs.f32("y")?),
        Op::Scale { factor } => scale(*factor, ins.f32("x")?, outs.f32("y")?),
        _ => return Err(ins.unrouted("elementwise")),
    }
    Ok(())
}

/// Elements per rayon task for elementwise loops.
const CHUNK: usize = TASK_ELEMENTS;

/// `out[i] = f(a[i])` in parallel chunks.
fn map1(out: &mut [f32], a: &[f32], f: impl Fn(f32) -> f32 + Sync) {
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK))
        .for_each(|(out, a)| {
            for (o, &a) in out.iter_mut().zip(a) {
                *o = f(a);
            }
        });
}

/// `out[i] = f(a[i], b[i])` in parallel chunks.
fn map2(out: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(out, (a, b))| {
            for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
                *o = f(a, b);
            }
        });
}

/// `out[i] = f(out[i], a[i])` in parallel chunks.
fn update(out: &mut [f32], a: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK))
        .for_each(|(out, a)| {
            for (o, &a) in out.iter_mut().zip(a) {
                *o = f(*o, a);
            }
        });
}

/// `out[i] = f(out[i], a[i], b[i])` in parallel chunks.
fn update2(out: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32, f32) -> f32 + Sync) {
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(out, (a, b))| {
            for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
                *o = f(*o, a, b);
            }
        });
}

/// `out[i] = f(a[i], b[i], c[i])` in parallel chunks.
fn map3(out: &mut [f32], a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32 + Sync) {
    out.par_chunks_mut(CHUNK)
        .zip(
            a.par_chunks(CHUNK)
                .zip(b.par_chunks(CHUNK).zip(c.par_chunks(CHUNK))),
        )
        .for_each(|(out, (a, (b, c)))| {
            for (((o, &a), &b), &c) in out.iter_mut().zip(a).zip(b).zip(c) {
                *o = f(a, b, c);
            }
        });
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_TANH_CUBIC: f32 = 0.044_715;
const INV_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π), the standard normal density at 0.
const INV_SQRT_2PI: f32 = 0.398_942_3;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `0.5·(1 + tanh(u)) = σ(2u)` with `u = √(2/π)(x + 0.044715x³)`, and `du/dx`.
fn gelu_tanh_gate(x: f32) -> (f32, f32) {
    let u = SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x);
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_CUBIC * x * x);
    (sigmoid(2.0 * u), du)
}

fn activation_value(act: Act, x: f32) -> f32 {
    match act {
        Act::Gelu => 0.5 * x * (1.0 + libm::erff(x * INV_SQRT_2)),
        Act::GeluTanh => x * gelu_tanh_gate(x).0,
        Act::Relu => x.max(0.0),
        Act::Silu => x * sigmoid(x),
    }
}

fn activation_derivative(act: Act, x: f32) -> f32 {
    match act {
        Act::Gelu => {
            let cdf = 0.5 * (1.0 + libm::erff(x * INV_SQRT_2));
            cdf + x * INV_SQRT_2PI * (-0.5 * x * x).exp()
        }
        Act::GeluTanh => {
            // d/dx x·σ(2u) = σ(2u) + x·σ(2u)(1 − σ(2u))·2u'.
            let (s, du) = gelu_tanh_gate(x);
            s + x * s * (1.0 - s) * 2.0 * du
        }
        Act::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        Act::Silu => {
            // d/dx x·σ(x) = σ(x)·(1 + x·(1 − σ(x))).
            let s = sigmoid(x);
            s * (1.0 + x * (1.0 - s))
        }
    }
}

pub(crate) fn activation(act: Act, x: &[f32], y: &mut [f32]) {
    map1(y, x, |x| activation_value(act, x));
}

pub(crate) fn activation_bwd(act: Act, dy: &[f32], x: &[f32], dx: &mut [f32]) {
    map2(dx, dy, x, |dy, x| dy * activation_derivative(act, x));
}

/// `dx = dx · act'(x)`: an activation gradient applied to a product already in `dx` (a
/// `MatmulBwdData` with `act_grad`); per element exactly `activation_bwd`'s expression.
pub(crate) fn activation_bwd_in_place(act: Act, x: &[f32], dx: &mut [f32]) {
    update(dx, x, |d, x| d * activation_derivative(act, x));
}

/// `y = y + r` (per element `y + r`, the sum `add` forms: f32 addition commutes exactly).
pub(crate) fn add_in_place(r: &[f32], y: &mut [f32]) {
    update(y, r, |y, r| y + r);
}

/// `y = silu(gate) · up`.
pub(crate) fn swiglu(gate: &[f32], up: &[f32], y: &mut [f32]) {
    map2(y, gate, up, |g, u| g * sigmoid(g) * u);
}

/// SwiGLU's gate gradient of one element: `dy · up · σ(g)(1 + g(1 − σ(g)))`.
fn swiglu_dgate(dy: f32, g: f32, u: f32) -> f32 {
    let s = sigmoid(g);
    dy * u * s * (1.0 + g * (1.0 - s))
}

/// SwiGLU's up gradient of one element: `dy · silu(g)`.
fn swiglu_dup(dy: f32, g: f32) -> f32 {
    dy * g * sigmoid(g)
}

/// `dgate` and `dup` of each element ([`swiglu_dgate`], [`swiglu_dup`]).
pub(crate) fn swiglu_bwd(dy: &[f32], gate: &[f32], up: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    map3(dgate, dy, gate, up, swiglu_dgate);
    map2(dup, dy, gate, swiglu_dup);
}

/// [`swiglu_bwd`] with dy held in `dgate`, which it becomes: the same expressions, per element,
/// on the same values.
pub(crate) fn swiglu_bwd_in_place(dgate: &mut [f32], gate: &[f32], up: &[f32], dup: &mut [f32]) {
    map2(dup, dgate, gate, swiglu_dup);
    update2(dgate, gate, up, swiglu_dgate);
}

pub(crate) fn add(a: &[f32], b: &[f32], y: &mut [f32]) {
    map2(y, a, b, |a, b| a + b);
}

pub(crate) fn scale(factor: f64, x: &[f32], y: &mut [f32]) {
    let factor = factor as f32;
    map1(y, x, |x| factor * x);
}
