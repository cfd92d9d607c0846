//! Scaled dot-product attention (MHA and GQA), optionally causal by *global* positions: query
//! and key positions come from separate segment lists, so a context-parallel rank attends its
//! query chunk against keys gathered from other ranks in any storage order.
//!
//! Formulation: one task per (sample, head) for the output and `dq`, one per (sample, kv head)
//! for `dk`/`dv`; each streams over keys (or queries) one at a time with a single row of scores
//! as scratch — no `[seq_q, seq_kv]` matrix is ever stored. The backward recomputes
//! probabilities from the saved log-sum-exp (`p = exp(s − lse)`), as FlashAttention does.
//! Tasks are independent and sequential inside, results are scattered in task order, so the
//! output is bit-identical for any thread count. A query with no visible key gets `o = 0`,
//! `lse = −inf` and contributes no gradient.
use super::args::{expect_len, op_error, positions_for, product, rows_of};
use crate::error::Result;
use parc_compiler::ir::op::Segment;
use rayon::prelude::*;

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
    /// The geometry of q (`q_len` elements) and k/v (`kv_len` elements each).
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
        let seq_q = rows_of(op, "q", q_len, q_row)?;
        let seq_kv = rows_of(op, "k", kv_len, kv_row)?;
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

    fn q_len(&self) -> usize {
        self.q_pos.len() * self.batch * self.heads * self.head_dim
    }

    fn kv_len(&self) -> usize {
        self.kv_pos.len() * self.batch * self.kv_heads * self.head_dim
    }

    fn lse_len(&self) -> usize {
        self.batch * self.heads * self.q_pos.len()
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
}

/// Dot product with eight fixed accumulators (vectorisable, fixed summation order).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (a_main, a_tail) = a.split_at(a.len() - a.len() % 8);
    let (b_main, b_tail) = b.split_at(a_main.len().min(b.len()));
    for (x, y) in a_main.chunks_exact(8).zip(b_main.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in a_tail.iter().zip(b_tail) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `acc += factor · x`.
fn axpy(acc: &mut [f32], factor: f32, x: &[f32]) {
    for (a, &x) in acc.iter_mut().zip(x) {
        *a += factor * x;
    }
}

/// Forward: o `[rows_q, heads·head_dim]`, lse `[batch, heads, seq_q]`.
pub(crate) fn attention(
    op: &str,
    shape: &AttentionShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let g = Geometry::new(op, shape, q.len(), k.len())?;
    expect_len(op, "v", v.len(), g.kv_len())?;
    expect_len(op, "o", o.len(), g.q_len())?;
    expect_len(op, "lse", lse.len(), g.lse_len())?;
    let (sq, skv, d) = (g.q_pos.len(), g.kv_pos.len(), g.head_dim);
    let results: Vec<(Vec<f32>, Vec<f32>)> = (0..g.batch * g.heads)
        .into_par_iter()
        .map(|task| {
            let (b, h) = (task / g.heads, task % g.heads);
            let q = g.gather(q, g.heads, b, h);
            let k = g.gather(k, g.kv_heads, b, h / g.group);
            let v = g.gather(v, g.kv_heads, b, h / g.group);
            let mut out = vec![0.0f32; sq * d];
            let mut lse = vec![f32::NEG_INFINITY; sq];
            let mut scores = vec![0.0f32; skv];
            for i in 0..sq {
                let qi = &q[i * d..(i + 1) * d];
                let mut max = f32::NEG_INFINITY;
                for j in 0..skv {
                    if g.visible(i, j) {
                        scores[j] = g.scale * dot(qi, &k[j * d..(j + 1) * d]);
                        max = max.max(scores[j]);
                    }
                }
                if max == f32::NEG_INFINITY {
                    continue;
                }
                let oi = &mut out[i * d..(i + 1) * d];
                let mut sum = 0.0f32;
                for j in 0..skv {
                    if g.visible(i, j) {
                        let p = (scores[j] - max).exp();
                        sum += p;
                        axpy(oi, p, &v[j * d..(j + 1) * d]);
                    }
                }
                for x in oi.iter_mut() {
                    *x /= sum;
                }
                lse[i] = max + sum.ln();
            }
            (out, lse)
        })
        .collect();
    for (task, (out, task_lse)) in results.into_iter().enumerate() {
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

/// Backward: dq, dk, dv (overwritten).
pub(crate) fn attention_bwd(
    op: &str,
    shape: &AttentionShape,
    t: &AttentionGrads,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) -> Result<()> {
    let g = Geometry::new(op, shape, t.q.len(), t.k.len())?;
    expect_len(op, "do", t.d_out.len(), g.q_len())?;
    expect_len(op, "v", t.v.len(), g.kv_len())?;
    expect_len(op, "o", t.o.len(), g.q_len())?;
    expect_len(op, "lse", t.lse.len(), g.lse_len())?;
    expect_len(op, "dq", dq.len(), g.q_len())?;
    expect_len(op, "dk", dk.len(), g.kv_len())?;
    expect_len(op, "dv", dv.len(), g.kv_len())?;
    let (sq, skv, d) = (g.q_pos.len(), g.kv_pos.len(), g.head_dim);

    // Per query head: the gathered q, do, lse and D_i = do_i · o_i.
    struct QueryHead {
        q: Vec<f32>,
        d_out: Vec<f32>,
        lse: Vec<f32>,
        delta: Vec<f32>,
    }
    let query_head = |b: usize, h: usize| {
        let q = g.gather(t.q, g.heads, b, h);
        let d_out = g.gather(t.d_out, g.heads, b, h);
        let o = g.gather(t.o, g.heads, b, h);
        let offset = g.lse_offset(b, h);
        let delta = (0..sq)
            .map(|i| dot(&d_out[i * d..(i + 1) * d], &o[i * d..(i + 1) * d]))
            .collect();
        QueryHead {
            q,
            d_out,
            lse: t.lse[offset..offset + sq].to_vec(),
            delta,
        }
    };
    // p_ij and ds_ij = p_ij (do_i · v_j − D_i) for a visible pair.
    let prob_and_dscore = |qh: &QueryHead, i: usize, kj: &[f32], vj: &[f32]| {
        let s = g.scale * dot(&qh.q[i * d..(i + 1) * d], kj);
        let p = (s - qh.lse[i]).exp();
        let dp = dot(&qh.d_out[i * d..(i + 1) * d], vj);
        (p, p * (dp - qh.delta[i]))
    };

    let dq_parts: Vec<Vec<f32>> = (0..g.batch * g.heads)
        .into_par_iter()
        .map(|task| {
            let (b, h) = (task / g.heads, task % g.heads);
            let qh = query_head(b, h);
            let k = g.gather(t.k, g.kv_heads, b, h / g.group);
            let v = g.gather(t.v, g.kv_heads, b, h / g.group);
            let mut dq = vec![0.0f32; sq * d];
            for i in 0..sq {
                if qh.lse[i] == f32::NEG_INFINITY {
                    continue;
                }
                let dqi = &mut dq[i * d..(i + 1) * d];
                for j in 0..skv {
                    if g.visible(i, j) {
                        let kj = &k[j * d..(j + 1) * d];
                        let (_, ds) = prob_and_dscore(&qh, i, kj, &v[j * d..(j + 1) * d]);
                        axpy(dqi, g.scale * ds, kj);
                    }
                }
            }
            dq
        })
        .collect();

    let dkv_parts: Vec<(Vec<f32>, Vec<f32>)> = (0..g.batch * g.kv_heads)
        .into_par_iter()
        .map(|task| {
            let (b, kvh) = (task / g.kv_heads, task % g.kv_heads);
            let k = g.gather(t.k, g.kv_heads, b, kvh);
            let v = g.gather(t.v, g.kv_heads, b, kvh);
            let heads: Vec<QueryHead> = (kvh * g.group..(kvh + 1) * g.group)
                .map(|h| query_head(b, h))
                .collect();
            let mut dk = vec![0.0f32; skv * d];
            let mut dv = vec![0.0f32; skv * d];
            for j in 0..skv {
                let (kj, vj) = (&k[j * d..(j + 1) * d], &v[j * d..(j + 1) * d]);
                let dkj = &mut dk[j * d..(j + 1) * d];
                let dvj = &mut dv[j * d..(j + 1) * d];
                for qh in &heads {
                    for i in 0..sq {
                        if g.visible(i, j) && qh.lse[i] != f32::NEG_INFINITY {
                            let (p, ds) = prob_and_dscore(qh, i, kj, vj);
                            axpy(dkj, g.scale * ds, &qh.q[i * d..(i + 1) * d]);
                            axpy(dvj, p, &qh.d_out[i * d..(i + 1) * d]);
                        }
                    }
                }
            }
            (dk, dv)
        })
        .collect();

    for (task, part) in dq_parts.into_iter().enumerate() {
        g.scatter(dq, g.heads, task / g.heads, task % g.heads, &part);
    }
    for (task, (dk_part, dv_part)) in dkv_parts.into_iter().enumerate() {
        let (b, kvh) = (task / g.kv_heads, task % g.kv_heads);
        g.scatter(dk, g.kv_heads, b, kvh, &dk_part);
        g.scatter(dv, g.kv_heads, b, kvh, &dv_part);
    }
    Ok(())
}
