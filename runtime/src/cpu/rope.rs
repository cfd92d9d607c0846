//! Rotary position embedding ("rotate half", as Llama/HF): in every head, the pair
//! `(i, i + head_dim/2)` is rotated by `pos · theta^(−2i/head_dim)`, `pos` the row's global
//! position from the op's segments. The backward pass rotates by the negative angle. Angles,
//! cosines and sines are computed in f64 once per (local position, i).
use super::args::{op_error, positions_for, product};
use super::par::rows_per_task;
use crate::error::Result;
use parc_compiler::ir::op::Segment;
use rayon::prelude::*;

/// The shape of a rope op.
pub(crate) struct RopeShape<'a> {
    pub batch: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub theta: f64,
    pub positions: &'a [Segment],
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
        theta,
        positions,
    } = *shape;
    if head_dim % 2 != 0 {
        return Err(op_error(
            op,
            format!("head_dim = {head_dim} must be even to rotate pairs (i, i + head_dim/2)"),
        ));
    }
    if theta.is_nan() || theta <= 0.0 {
        return Err(op_error(op, format!("theta = {theta} must be positive")));
    }
    let width = product(op, "heads × head_dim", &[heads, head_dim])?;
    let seq = x.len() / product(op, "row block", &[batch, width])?;
    let global = positions_for(op, positions, "x", seq)?;
    let half = head_dim / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    // cos/sin per (local position, i), interleaved.
    let table: Vec<(f32, f32)> = global
        .iter()
        .flat_map(|&pos| {
            (0..half).map(move |i| {
                let inv_freq = theta.powf(-2.0 * i as f64 / head_dim as f64);
                let angle = sign * f64::from(pos) * inv_freq;
                (angle.cos() as f32, angle.sin() as f32)
            })
        })
        .collect();
    y.par_chunks_mut(width)
        .zip(x.par_chunks(width))
        .enumerate()
        .with_min_len(rows_per_task(width))
        .for_each(|(row, (y, x))| {
            let rotations = &table[(row / batch) * half..(row / batch + 1) * half];
            for (y, x) in y.chunks_mut(head_dim).zip(x.chunks(head_dim)) {
                let (y_lo, y_hi) = y.split_at_mut(half);
                let (x_lo, x_hi) = x.split_at(half);
                for i in 0..half {
                    let (cos, sin) = rotations[i];
                    y_lo[i] = x_lo[i] * cos - x_hi[i] * sin;
                    y_hi[i] = x_hi[i] * cos + x_lo[i] * sin;
                }
            }
        });
    Ok(())
}
