//! Rotary position embedding ("rotate half", as Llama/HF): in every head, the pair
//! `(i, i + rotary/2)` of its first `rotary` features (all `head_dim` unless the op is a
//! partial RoPE's, `rotary_dim`) is rotated by `pos · inv_freq(i)`, `pos` the row's global
//! position from the op's segments and `inv_freq` the compiler's one definition
//! (`parc_compiler::ir::rope::inv_freq`: `theta^(−2i/rotary)`, scaled as the op's `scaling`
//! says); the features past `rotary` pass unchanged. The backward pass rotates by the negative
//! angle. Angles, cosines and sines are computed in f64 once per (local position, i)
//! ([`rotation`]), by `rope` and by `rope_table` alike (the cos/sin table a fused rope reads,
//! `Op::RopeTable`).
use super::args::{op_error, positions_for, product};
use super::par::rows_per_task;
use crate::error::Result;
use parc_compiler::ir::op::{RopeAttrs, RopeScaling, Segment};
use parc_compiler::ir::rope::{inv_freq, rotation_problem};
use rayon::prelude::*;

/// The frequencies of a rope op: its base, scaling and rotated features (`None`: all).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Freqs {
    pub theta: f64,
    pub scaling: RopeScaling,
    pub rotary_dim: Option<u64>,
}

impl Freqs {
    pub fn of(a: &RopeAttrs) -> Freqs {
        Freqs {
            theta: a.theta,
            scaling: a.scaling,
            rotary_dim: a.rotary_dim,
        }
    }

    /// How many of a head's `head_dim` features turn.
    fn rotary(&self, head_dim: usize) -> usize {
        self.rotary_dim.map_or(head_dim, |r| r as usize)
    }
}

/// The shape of a rope op.
pub(crate) struct RopeShape<'a> {
    pub batch: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub freqs: Freqs,
    pub positions: &'a [Segment],
}

/// The cosine and sine of `sign · pos · inv_freq(i)` (over `rotary` features), computed in f64
/// and rounded to f32.
fn rotation(f: Freqs, rotary: usize, pos: u32, i: usize, sign: f64) -> (f32, f32) {
    let inv_freq = inv_freq(f.theta, rotary as u64, i as u64, f.scaling);
    let angle = sign * f64::from(pos) * inv_freq;
    (angle.cos() as f32, angle.sin() as f32)
}

/// The features that turn, unless the rotation is undefined (`rope::rotation_problem`).
fn check_rotation(op: &str, head_dim: usize, f: Freqs) -> Result<usize> {
    let rotary = f.rotary(head_dim);
    match rotation_problem(f.theta, f.scaling, head_dim as u64, rotary as u64) {
        Some(problem) => Err(op_error(op, problem)),
        None => Ok(rotary),
    }
}

/// The rotation table of `Op::RopeTable`: per local position (row), `cos(angle_i)` in columns
/// `c < rotary` and `∓sin(angle_i)` in columns `head_dim + c` (− in the first half of the
/// turned features), `i = c mod rotary/2`, each value exactly as [`rope`] computes it; 1 and 0
/// in the columns of the features past `rotary`, which a fused rope so passes unchanged.
pub(crate) fn rope_table(
    op: &str,
    head_dim: usize,
    freqs: Freqs,
    positions: &[Segment],
    table: &mut [f32],
) -> Result<()> {
    let rotary = check_rotation(op, head_dim, freqs)?;
    let width = product(op, "2 × head_dim", &[2, head_dim])?;
    let global = positions_for(op, positions, "table", table.len() / width)?;
    let half = rotary / 2;
    for (row, &pos) in table.chunks_mut(width).zip(&global) {
        let (cos, sin) = row.split_at_mut(head_dim);
        for i in 0..half {
            let (c, s) = rotation(freqs, rotary, pos, i, 1.0);
            cos[i] = c;
            cos[i + half] = c;
            sin[i] = -s;
            sin[i + half] = s;
        }
        cos[rotary..].fill(1.0);
        sin[rotary..].fill(0.0);
    }
    Ok(())
}

/// Rotate `x` into `y`; `inverse` rotates by the negative angle (the backward pass).
pub(crate) fn rope(
    op: &str,
    shape: &RopeShape,
    inverse: bool,
    x: &[f32],
    y: &mut [f32],
) -> Result<()> {
    let RopeShape {
        batch,
        heads,
        head_dim,
        freqs,
        positions,
    } = *shape;
    let rotary = check_rotation(op, head_dim, freqs)?;
    let width = product(op, "heads × head_dim", &[heads, head_dim])?;
    let seq = x.len() / product(op, "row block", &[batch, width])?;
    let global = positions_for(op, positions, "x", seq)?;
    let half = rotary / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    // cos/sin per (local position, i), interleaved.
    let table: Vec<(f32, f32)> = global
        .iter()
        .flat_map(|&pos| (0..half).map(move |i| rotation(freqs, rotary, pos, i, sign)))
        .collect();
    y.par_chunks_mut(width)
        .zip(x.par_chunks(width))
        .enumerate()
        .with_min_len(rows_per_task(width))
        .for_each(|(row, (y, x))| {
            let rotations = &table[(row / batch) * half..(row / batch + 1) * half];
            for (y, x) in y.chunks_mut(head_dim).zip(x.chunks(head_dim)) {
                let (y_turned, y_kept) = y.split_at_mut(rotary);
                let (x_turned, x_kept) = x.split_at(rotary);
                y_kept.copy_from_slice(x_kept);
                let (y_lo, y_hi) = y_turned.split_at_mut(half);
                let (x_lo, x_hi) = x_turned.split_at(half);
                for i in 0..half {
                    let (cos, sin) = rotations[i];
                    y_lo[i] = x_lo[i] * cos - x_hi[i] * sin;
                    y_hi[i] = x_hi[i] * cos + x_lo[i] * sin;
                }
            }
        });
    Ok(())
}
