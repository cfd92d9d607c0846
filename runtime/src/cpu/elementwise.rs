//! Elementwise ops: activations (gelu erf form, gelu tanh approximation, relu) and their
//! gradients, SwiGLU, add, scale, and the data movers copy / zero / copy-range (any dtype).
//! Computed in f32 (`libm::erff` for gelu; gelu_tanh through the identity
//! `0.5·(1 + tanh u) = σ(2u)`, one exponential per element).
use super::args::{expect_len, op_error};
use super::memory::{View, ViewMut};
use super::par::TASK_ELEMENTS;
use crate::error::Result;
use parc_compiler::ir::op::Act;
use rayon::prelude::*;
use std::ops::Range;

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
    }
}

pub(crate) fn activation(op: &str, act: Act, x: &[f32], y: &mut [f32]) -> Result<()> {
    expect_len(op, "y", y.len(), x.len())?;
    map1(y, x, |x| activation_value(act, x));
    Ok(())
}

pub(crate) fn activation_bwd(
    op: &str,
    act: Act,
    dy: &[f32],
    x: &[f32],
    dx: &mut [f32],
) -> Result<()> {
    expect_len(op, "x", x.len(), dy.len())?;
    expect_len(op, "dx", dx.len(), dy.len())?;
    map2(dx, dy, x, |dy, x| dy * activation_derivative(act, x));
    Ok(())
}

/// `dx = dx · act'(x)`: an activation gradient applied to a product already in `dx` (a
/// `MatmulBwdData` with `act_grad`); per element exactly `activation_bwd`'s expression.
pub(crate) fn activation_bwd_in_place(op: &str, act: Act, x: &[f32], dx: &mut [f32]) -> Result<()> {
    expect_len(op, "pre", x.len(), dx.len())?;
    update(dx, x, |d, x| d * activation_derivative(act, x));
    Ok(())
}

/// `y = y + r` (per element `y + r`, the sum `add` forms: f32 addition commutes exactly).
pub(crate) fn add_in_place(op: &str, r: &[f32], y: &mut [f32]) -> Result<()> {
    expect_len(op, "r", r.len(), y.len())?;
    update(y, r, |y, r| y + r);
    Ok(())
}

/// `y = silu(gate) · up`.
pub(crate) fn swiglu(op: &str, gate: &[f32], up: &[f32], y: &mut [f32]) -> Result<()> {
    expect_len(op, "up", up.len(), gate.len())?;
    expect_len(op, "y", y.len(), gate.len())?;
    map2(y, gate, up, |g, u| g * sigmoid(g) * u);
    Ok(())
}

/// `dgate = dy · up · σ(g)(1 + g(1 − σ(g)))`, `dup = dy · silu(g)`.
pub(crate) fn swiglu_bwd(
    op: &str,
    dy: &[f32],
    gate: &[f32],
    up: &[f32],
    dgate: &mut [f32],
    dup: &mut [f32],
) -> Result<()> {
    for (what, len) in [
        ("gate", gate.len()),
        ("up", up.len()),
        ("dgate", dgate.len()),
        ("dup", dup.len()),
    ] {
        expect_len(op, what, len, dy.len())?;
    }
    map3(dgate, dy, gate, up, |dy, g, u| {
        let s = sigmoid(g);
        dy * u * s * (1.0 + g * (1.0 - s))
    });
    map2(dup, dy, gate, |dy, g| dy * g * sigmoid(g));
    Ok(())
}

pub(crate) fn add(op: &str, a: &[f32], b: &[f32], y: &mut [f32]) -> Result<()> {
    expect_len(op, "b", b.len(), a.len())?;
    expect_len(op, "y", y.len(), a.len())?;
    map2(y, a, b, |a, b| a + b);
    Ok(())
}

pub(crate) fn scale(op: &str, factor: f64, x: &[f32], y: &mut [f32]) -> Result<()> {
    expect_len(op, "y", y.len(), x.len())?;
    let factor = factor as f32;
    map1(y, x, |x| factor * x);
    Ok(())
}

/// `y = x` for tensors of one dtype and length.
pub(crate) fn copy(op: &str, x: View<'_>, y: &mut ViewMut<'_>) -> Result<()> {
    expect_len(op, "y", y.len(), x.len())?;
    match (x, y) {
        (View::F32(x), ViewMut::F32(y)) => y.copy_from_slice(x),
        (View::I32(x), ViewMut::I32(y)) => y.copy_from_slice(x),
        _ => return Err(op_error(op, "x and y have different dtypes")),
    }
    Ok(())
}

/// Checks a `[rows, Σ widths]` matrix of `whole_len` elements against its column blocks
/// (`part_lens[i]` = rows × `widths[i]`), then calls `copy(i, whole range, part range)` for
/// every row of every block: `SplitColumns` and `ConcatColumns` differ only in the direction.
fn column_blocks(
    op: &str,
    widths: &[u64],
    whole_len: usize,
    part_lens: &[usize],
    mut copy: impl FnMut(usize, Range<usize>, Range<usize>),
) -> Result<()> {
    let total = widths.iter().sum::<u64>() as usize;
    if total == 0 || !whole_len.is_multiple_of(total) {
        return Err(op_error(
            op,
            format!("{whole_len} elements are not rows of {total} columns (widths {widths:?})"),
        ));
    }
    if part_lens.len() != widths.len() {
        return Err(op_error(
            op,
            format!("{} parts for {} widths", part_lens.len(), widths.len()),
        ));
    }
    let rows = whole_len / total;
    for (&len, &w) in part_lens.iter().zip(widths) {
        expect_len(op, "part", len, rows * w as usize)?;
    }
    let mut col = 0usize;
    for (i, &w) in widths.iter().enumerate() {
        let w = w as usize;
        for r in 0..rows {
            copy(i, r * total + col..r * total + col + w, r * w..(r + 1) * w);
        }
        col += w;
    }
    Ok(())
}

/// `parts[i] = x[:, columns of block i]` for a `[rows, Σ widths]` x (`Op::SplitColumns`).
pub(crate) fn split_columns(
    op: &str,
    widths: &[u64],
    x: &[f32],
    parts: &mut [&mut [f32]],
) -> Result<()> {
    let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    column_blocks(op, widths, x.len(), &lens, |i, whole, part| {
        parts[i][part].copy_from_slice(&x[whole]);
    })
}

/// `y[:, columns of block i] = parts[i]` for a `[rows, Σ widths]` y (`Op::ConcatColumns`).
pub(crate) fn concat_columns(
    op: &str,
    widths: &[u64],
    parts: &[&[f32]],
    y: &mut [f32],
) -> Result<()> {
    let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    column_blocks(op, widths, y.len(), &lens, |i, whole, part| {
        y[whole].copy_from_slice(&parts[i][part]);
    })
}

/// `dst[dst_offset + i] = src[src_offset + i]` for `i < len`.
pub(crate) fn copy_range(
    op: &str,
    src_offset: u64,
    dst_offset: u64,
    len: u64,
    src: View<'_>,
    dst: &mut ViewMut<'_>,
) -> Result<()> {
    let range = |offset: u64, buffer_len: usize, what: &str| {
        let end = offset.checked_add(len);
        match end {
            Some(end) if end <= buffer_len as u64 => Ok(offset as usize..end as usize),
            _ => Err(op_error(
                op,
                format!(
                    "{what} range {offset}..{offset}+{len} is outside its {buffer_len} elements"
                ),
            )),
        }
    };
    let src_range = range(src_offset, src.len(), "src")?;
    let dst_range = range(dst_offset, dst.len(), "dst")?;
    match (src, dst) {
        (View::F32(s), ViewMut::F32(d)) => d[dst_range].copy_from_slice(&s[src_range]),
        (View::I32(s), ViewMut::I32(d)) => d[dst_range].copy_from_slice(&s[src_range]),
        _ => return Err(op_error(op, "src and dst have different dtypes")),
    }
    Ok(())
}
