//! Scaled dot-product attention (MHA and GQA), optionally causal by *global* positions: query
//! and key positions come from separate segment lists, so a context-parallel rank attends its
//! query chunk against keys gathered from other ranks in any storage order.
//!
//! Formulation: the forward runs one task per (sample, head), the backward one per (sample, kv
//! head) covering the query heads that share it (so `dk`/`dv` need no cross-task reduction).
//! Inside a task, queries are processed in tiles of [`QUERY_TILE`] rows: scores for a tile
//! against all keys (`[tile, seq_kv]`, the only scratch — never a `[seq_q, seq_kv]` matrix) come
//! from a dense product, masked and exponentiated in place, then multiplied into the outputs.
//! The backward recomputes probabilities from the saved log-sum-exp (`p = exp(s − lse)`), as
//! FlashAttention does. Tasks are independent and sequential inside, results are scattered in
//! task order, so the output is bit-identical for any thread count. A query with no visible key
//! gets `o = 0`, `lse = −inf` and contributes no gradient.
use super::args::{op_error, positions_for, product, Inputs, Outputs};
use super::dense::{gemm_checked, Strided, Threads};
use super::movement::{concat_columns, split_columns};
use crate::error::Result;
use parc_compiler::ir::op::{AttentionAttrs, Op, Segment};
use rayon::prelude::*;

/// The attention family's entry point (see `dispatch`).
pub(crate) fn run(op: &Op, ins: &Inputs, outs: &mut Outputs, threads: Threads) -> Result<()> {
    match op {
        Op::Attention(a) => forward(ins, outs, a, threads),
        Op::AttentionBwd(a) => backward(ins, outs, a, threads),
        _ => Err(ins.unrouted("attention")),
    }
}

/// The shape of an attention op, and with packed q/k/v (`AttentionAttrs::packed`) the widths
/// of q, k and v in a `qkv` row: packed operands are split into the separate layout and the
/// gradient concatenated back, which the exact reference computes the same either way.
fn shape<'a>(
    ins: &Inputs,
    a: &'a AttentionAttrs,
) -> Result<(AttentionShape<'a>, Option<[u64; 3]>)> {
    let shape = AttentionShape {
        batch: ins.dim("batch", a.batch)?,
        heads: ins.dim("heads", a.heads)?,
        kv_heads: ins.dim("kv_heads", a.kv_heads)?,
        head_dim: ins.dim("head_dim", a.head_dim)?,
        causal: a.causal,
        scale: a.scale,
        q_positions: &a.q_positions,
        kv_positions: &a.kv_positions,
    };
    if a.packed && a.q_positions != a.kv_positions {
        return Err(
            ins.err("packed q/k/v needs the same query and key positions (one row holds both)")
        );
    }
    Ok((shape, a.packed.then(|| packed_widths(a))))
}

/// `Op::Attention` on its bound buffers.
fn forward(ins: &Inputs, outs: &mut Outputs, a: &AttentionAttrs, threads: Threads) -> Result<()> {
    let (shape, packed) = shape(ins, a)?;
    let name = ins.name();
    let (o, lse) = (outs.f32("o")?, outs.f32("lse")?);
    match packed {
        None => {
            let (q, k, v) = (ins.f32("q")?, ins.f32("k")?, ins.f32("v")?);
            attention(name, &shape, threads, q, k, v, o, lse)
        }
        Some(widths) => {
            let [q, k, v] = unpack(name, &widths, ins.f32("qkv")?)?;
            attention(name, &shape, threads, &q, &k, &v, o, lse)
        }
    }
}

/// `Op::AttentionBwd` on its bound buffers.
fn backward(ins: &Inputs, outs: &mut Outputs, a: &AttentionAttrs, threads: Threads) -> Result<()> {
    let (shape, packed) = shape(ins, a)?;
    let name = ins.name();
    let (d_out, o, lse) = (ins.f32("do")?, ins.f32("o")?, ins.f32("lse")?);
    let Some(widths) = packed else {
        let (q, k, v) = (ins.f32("q")?, ins.f32("k")?, ins.f32("v")?);
        let tensors = AttentionGrads {
            d_out,
            q,
            k,
            v,
            o,
            lse,
        };
        let (dq, dk, dv) = (outs.f32("dq")?, outs.f32("dk")?, outs.f32("dv")?);
        return attention_bwd(name, &shape, threads, &tensors, dq, dk, dv);
    };
    let [q, k, v] = unpack(name, &widths, ins.f32("qkv")?)?;
    let tensors = AttentionGrads {
        d_out,
        q: &q,
        k: &k,
        v: &v,
        o,
        lse,
    };
    let mut grads = [&q, &k, &v].map(|t| vec![0.0f32; t.len()]);
    let [dq, dk, dv] = &mut grads;
    attention_bwd(name, &shape, threads, &tensors, dq, dk, dv)?;
    concat_columns(name, &widths, &[dq, dk, dv], outs.f32("dqkv")?)
}

/// The column widths of q, k and v in a packed `qkv` row.
fn packed_widths(a: &AttentionAttrs) -> [u64; 3] {
    let kv = a.kv_heads.saturating_mul(a.head_dim);
    [a.heads.saturating_mul(a.head_dim), kv, kv]
}

/// Packed `qkv` split into separate q, k and v.
fn unpack(op: &str, widths: &[u64; 3], qkv: &[f32]) -> Result<[Vec<f32>; 3]> {
    let rows = qkv.len() / (widths.iter().sum::<u64>().max(1) as usize);
    let mut parts = widths.map(|w| vec![0.0f32; rows * w as usize]);
    let [q, k, v] = &mut parts;
    split_columns(op, widths, qkv, &mut [q, k, v])?;
    Ok(parts)
}

/// Query rows per score tile.
const QUERY_TILE: usize = 64;

/// The shape attributes of an attention op.
pub(crate) struct AttentionShape<'a> {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub scale: f64,
    pub q_positions: &'a [Segment],
    pub kv_positions: &'a [Segment],
}

/// Validated geometry shared by forward and backward.
struct Geometry {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Query heads per kv head.
    group: usize,
    causal: bool,
    scale: f32,
    q_pos: Vec<u32>,
    kv_pos: Vec<u32>,
}

impl Geometry {
    /// The geometry of q (`q_len` elements) and k/v (`kv_len` elements each), whose element
    /// counts binding checked against the attributes.
    fn new(op: &str, shape: &AttentionShape, q_len: usize, kv_len: usize) -> Result<Geometry> {
        if shape.heads.checked_rem(shape.kv_heads) != Some(0) {
            return Err(op_error(
                op,
                format!(
                    "heads = {} is not a multiple of kv_heads = {}",
                    shape.heads, shape.kv_heads
                ),
            ));
        }
        if !shape.scale.is_finite() {
            return Err(op_error(
                op,
                format!("scale = {} is not finite", shape.scale),
            ));
        }
        let q_row = product(
            op,
            "q row block",
            &[shape.batch, shape.heads, shape.head_dim],
        )?;
        let kv_row = product(
            op,
            "k row block",
            &[shape.batch, shape.kv_heads, shape.head_dim],
        )?;
        let (seq_q, seq_kv) = (q_len / q_row, kv_len / kv_row);
        Ok(Geometry {
            batch: shape.batch,
            heads: shape.heads,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            group: shape.heads / shape.kv_heads,
            causal: shape.causal,
            scale: shape.scale as f32,
            q_pos: positions_for(op, shape.q_positions, "q", seq_q)?,
            kv_pos: positions_for(op, shape.kv_positions, "k", seq_kv)?,
        })
    }

    fn visible(&self, i: usize, j: usize) -> bool {
        !self.causal || self.kv_pos[j] <= self.q_pos[i]
    }

    /// Head `head` of sample `b` from a `[seq × batch, heads × head_dim]` tensor, as a
    /// contiguous `[seq, head_dim]` matrix.
    fn gather(&self, src: &[f32], heads: usize, b: usize, head: usize) -> Vec<f32> {
        let d = self.head_dim;
        let width = heads * d;
        let seq = src.len() / (self.batch * width);
        let mut out = Vec::with_capacity(seq * d);
        for s in 0..seq {
            let row = (s * self.batch + b) * width + head * d;
            out.extend_from_slice(&src[row..row + d]);
        }
        out
    }

    /// Write a contiguous `[seq, head_dim]` matrix back as head `head` of sample `b`.
    fn scatter(&self, dst: &mut [f32], heads: usize, b: usize, head: usize, src: &[f32]) {
        let d = self.head_dim;
        let width = heads * d;
        for (s, values) in src.chunks(d).enumerate() {
            let row = (s * self.batch + b) * width + head * d;
            dst[row..row + d].copy_from_slice(values);
        }
    }

    fn lse_offset(&self, b: usize, h: usize) -> usize {
        (b * self.heads + h) * self.q_pos.len()
    }

    /// `scores[r, j] = scale · q_tile[r] · k[j]` for a tile of queries against all keys
    /// (`q_tile` `[rows, head_dim]`, `k` `[seq_kv, head_dim]`, both contiguous).
    fn scores(
        &self,
        op: &str,
        q_tile: &[f32],
        k: &[f32],
        scores: &mut [f32],
        threads: Threads,
    ) -> Result<()> {
        let (d, skv) = (self.head_dim, self.kv_pos.len());
        let rows = q_tile.len() / d;
        gemm_checked(
            op,
            (&mut scores[..rows * skv], Strided::row_major(rows, skv)),
            false,
            (q_tile, Strided::row_major(rows, d)),
            (k, Strided::transposed(d, skv)),
            threads,
        )?;
        for s in scores[..rows * skv].iter_mut() {
            *s *= self.scale;
        }
        Ok(())
    }
}

/// Dot product with eight fixed accumulators (vectorisable, fixed summation order).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let main = a.len().min(b.len()) / 8 * 8;
    for (x, y) in a[..main].chunks_exact(8).zip(b[..main].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail: f32 = a[main..].iter().zip(&b[main..]).map(|(x, y)| x * y).sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Which parallelism the products inside tasks use: the pool when the op may use it and there
/// are fewer tasks than threads (one long sequence), the calling thread otherwise.
fn inner_threads(threads: Threads, tasks: usize) -> Threads {
    if threads == Threads::Pool && tasks < rayon::current_num_threads() {
        Threads::Pool
    } else {
        Threads::Caller
    }
}

/// Tasks per rayon split: all of them (no split) when the op runs on the calling thread.
fn tasks_per_split(threads: Threads, tasks: usize) -> usize {
    match threads {
        Threads::Pool => 1,
        Threads::Caller => tasks.max(1),
    }
}

/// Forward: o `[rows_q, heads·head_dim]`, lse `[batch, heads, seq_q]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    op: &str,
    shape: &AttentionShape,
    op_threads: Threads,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let g = Geometry::new(op, shape, q.len(), k.len())?;
    let (sq, skv, d) = (g.q_pos.len(), g.kv_pos.len(), g.head_dim);
    let tasks = g.batch * g.heads;
    let threads = inner_threads(op_threads, tasks);
    let results: Vec<Result<(Vec<f32>, Vec<f32>)>> = (0..tasks)
        .into_par_iter()
        .with_min_len(tasks_per_split(op_threads, tasks))
        .map(|task| {
            let (b, h) = (task / g.heads, task % g.heads);
            let q = g.gather(q, g.heads, b, h);
            let k = g.gather(k, g.kv_heads, b, h / g.group);
            let v = g.gather(v, g.kv_heads, b, h / g.group);
            let mut out = vec![0.0f32; sq * d];
            let mut lse = vec![f32::NEG_INFINITY; sq];
            let mut probs = vec![0.0f32; QUERY_TILE.min(sq) * skv];
            for i0 in (0..sq).step_by(QUERY_TILE) {
                let rows = QUERY_TILE.min(sq - i0);
                g.scores(op, &q[i0 * d..(i0 + rows) * d], &k, &mut probs, threads)?;
                for (r, row) in probs.chunks_mut(skv).take(rows).enumerate() {
                    let i = i0 + r;
                    // A score that is NaN makes the row's max NaN (`f32::max` would pass it
                    // over), so the row's outputs and log-sum-exp are NaN, as in PyTorch,
                    // rather than a row of zeros that hides the NaN from every later check.
                    let mut max = f32::NEG_INFINITY;
                    for (j, &s) in row.iter().enumerate() {
                        if g.visible(i, j) && (s.is_nan() || s > max) {
                            max = s;
                        }
                    }
                    if max == f32::NEG_INFINITY {
                        row.fill(0.0);
                        continue;
                    }
                    let mut sum = 0.0f32;
                    for (j, p) in row.iter_mut().enumerate() {
                        *p = if g.visible(i, j) {
                            (*p - max).exp()
                        } else {
                            0.0
                        };
                        sum += *p;
                    }
                    let inv = 1.0 / sum;
                    for p in row.iter_mut() {
                        *p *= inv;
                    }
                    lse[i] = max + sum.ln();
                }
                gemm_checked(
                    op,
                    (
                        &mut out[i0 * d..(i0 + rows) * d],
                        Strided::row_major(rows, d),
                    ),
                    false,
                    (&probs[..rows * skv], Strided::row_major(rows, skv)),
                    (&v, Strided::row_major(skv, d)),
                    threads,
                )?;
            }
            Ok((out, lse))
        })
        .collect();
    for (task, result) in results.into_iter().enumerate() {
        let (out, task_lse) = result?;
        let (b, h) = (task / g.heads, task % g.heads);
        g.scatter(o, g.heads, b, h, &out);
        let offset = g.lse_offset(b, h);
        lse[offset..offset + sq].copy_from_slice(&task_lse);
    }
    Ok(())
}

/// The tensors of the backward pass.
pub(crate) struct AttentionGrads<'a> {
    pub d_out: &'a [f32],
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub o: &'a [f32],
    pub lse: &'a [f32],
}

/// What one backward task returns: dq of each query head of the group, and dk, dv.
struct KvHeadGrads {
    dq: Vec<Vec<f32>>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// Backward: dq, dk, dv (overwritten).
pub(crate) fn attention_bwd(
    op: &str,
    shape: &AttentionShape,
    op_threads: Threads,
    t: &AttentionGrads,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) -> Result<()> {
    let g = Geometry::new(op, shape, t.q.len(), t.k.len())?;
    let (sq, skv, d) = (g.q_pos.len(), g.kv_pos.len(), g.head_dim);
    let tasks = g.batch * g.kv_heads;
    let threads = inner_threads(op_threads, tasks);
    let results: Vec<Result<KvHeadGrads>> = (0..tasks)
        .into_par_iter()
        .with_min_len(tasks_per_split(op_threads, tasks))
        .map(|task| {
            let (b, kvh) = (task / g.kv_heads, task % g.kv_heads);
            let k = g.gather(t.k, g.kv_heads, b, kvh);
            let v = g.gather(t.v, g.kv_heads, b, kvh);
            let mut grads = KvHeadGrads {
                dq: Vec::with_capacity(g.group),
                dk: vec![0.0f32; skv * d],
                dv: vec![0.0f32; skv * d],
            };
            let tile = QUERY_TILE.min(sq);
            let mut probs = vec![0.0f32; tile * skv];
            let mut dscores = vec![0.0f32; tile * skv];
            for h in kvh * g.group..(kvh + 1) * g.group {
                let q = g.gather(t.q, g.heads, b, h);
                let d_out = g.gather(t.d_out, g.heads, b, h);
                let o = g.gather(t.o, g.heads, b, h);
                let lse = &t.lse[g.lse_offset(b, h)..g.lse_offset(b, h) + sq];
                let mut dq = vec![0.0f32; sq * d];
                for i0 in (0..sq).step_by(QUERY_TILE) {
                    let rows = QUERY_TILE.min(sq - i0);
                    let q_tile = &q[i0 * d..(i0 + rows) * d];
                    let do_tile = &d_out[i0 * d..(i0 + rows) * d];
                    g.scores(op, q_tile, &k, &mut probs, threads)?;
                    // dP = dO Vᵀ.
                    gemm_checked(
                        op,
                        (&mut dscores[..rows * skv], Strided::row_major(rows, skv)),
                        false,
                        (do_tile, Strided::row_major(rows, d)),
                        (&v, Strided::transposed(d, skv)),
                        threads,
                    )?;
                    // P = exp(S − lse) and dS = scale · P ∘ (dP − do·o), masked to zero.
                    for r in 0..rows {
                        let i = i0 + r;
                        let delta = dot(&do_tile[r * d..(r + 1) * d], &o[i * d..(i + 1) * d]);
                        let p_row = &mut probs[r * skv..(r + 1) * skv];
                        let ds_row = &mut dscores[r * skv..(r + 1) * skv];
                        for j in 0..skv {
                            if g.visible(i, j) && lse[i] != f32::NEG_INFINITY {
                                let p = (p_row[j] - lse[i]).exp();
                                p_row[j] = p;
                                ds_row[j] = g.scale * p * (ds_row[j] - delta);
                            } else {
                                p_row[j] = 0.0;
                                ds_row[j] = 0.0;
                            }
                        }
                    }
                    let ds = (&dscores[..rows * skv], Strided::row_major(rows, skv));
                    // dQ = dS K, dK += dSᵀ Q, dV += Pᵀ dO.
                    gemm_checked(
                        op,
                        (
                            &mut dq[i0 * d..(i0 + rows) * d],
                            Strided::row_major(rows, d),
                        ),
                        false,
                        ds,
                        (&k, Strided::row_major(skv, d)),
                        threads,
                    )?;
                    gemm_checked(
                        op,
                        (&mut grads.dk, Strided::row_major(skv, d)),
                        true,
                        (ds.0, Strided::transposed(skv, rows)),
                        (q_tile, Strided::row_major(rows, d)),
                        threads,
                    )?;
                    gemm_checked(
                        op,
                        (&mut grads.dv, Strided::row_major(skv, d)),
                        true,
                        (&probs[..rows * skv], Strided::transposed(skv, rows)),
                        (do_tile, Strided::row_major(rows, d)),
                        threads,
                    )?;
                }
                grads.dq.push(dq);
            }
            Ok(grads)
        })
        .collect();
    for (task, result) in results.into_iter().enumerate() {
        let grads = result?;
        let (b, kvh) = (task / g.kv_heads, task % g.kv_heads);
        for (r, part) in grads.dq.iter().enumerate() {
            g.scatter(dq, g.heads, b, kvh * g.group + r, part);
        }
        g.scatter(dk, g.kv_heads, b, kvh, &grads.dk);
        g.scatter(dv, g.kv_heads, b, kvh, &grads.dv);
    }
    Ok(())
}
