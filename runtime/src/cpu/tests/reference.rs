//! Known values and decompositions: naive f64 references (attention, matmul, norms,
//! cross-entropy, optimizer steps), the context-parallel and vocab-parallel splits the lowering
//! relies on, and GQA against MHA with repeated kv heads. Tolerances are stated per test.
use super::*;
use parc_compiler::ir::op::Act;
use parc_compiler::ir::op::{
    ActAttrs, AttentionAttrs, EmbeddingAttrs, PositionAttrs, RopeAttrs, RopeScaling,
};

// ---------------------------------------------------------------- attention

struct AttnCase {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    causal: bool,
    q_pos: Vec<u32>,
    kv_pos: Vec<u32>,
}

impl AttnCase {
    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    fn op(&self, q_positions: Vec<Segment>, kv_positions: Vec<Segment>, bwd: bool) -> Op {
        let (batch, heads, kv_heads, head_dim) = (
            self.batch as u64,
            self.heads as u64,
            self.kv_heads as u64,
            self.head_dim as u64,
        );
        let attrs = AttentionAttrs {
            batch,
            heads,
            kv_heads,
            head_dim,
            causal: self.causal,
            scale: self.scale(),
            q_positions,
            kv_positions,
            packed: false,
        };
        attention_op(bwd, attrs)
    }

    /// softmax(scale·QKᵀ + mask)V and the log-sum-exp, in f64 straight from the definition.
    fn naive(&self, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let (b_n, h_n, d) = (self.batch, self.heads, self.head_dim);
        let (sq, skv) = (self.q_pos.len(), self.kv_pos.len());
        let group = self.heads / self.kv_heads;
        let mut o = vec![0.0; q.len()];
        let mut lse = vec![0.0; b_n * h_n * sq];
        for b in 0..b_n {
            for h in 0..h_n {
                let g = h / group;
                for i in 0..sq {
                    let qi = &q[(i * b_n + b) * h_n * d + h * d..][..d];
                    let scores: Vec<Option<f64>> = (0..skv)
                        .map(|j| {
                            if self.causal && self.kv_pos[j] > self.q_pos[i] {
                                return None;
                            }
                            let kj = &k[(j * b_n + b) * self.kv_heads * d + g * d..][..d];
                            let dot: f64 = qi
                                .iter()
                                .zip(kj)
                                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                                .sum();
                            Some(dot * self.scale())
                        })
                        .collect();
                    let total: f64 = scores.iter().flatten().map(|s| s.exp()).sum();
                    lse[(b * h_n + h) * sq + i] = total.ln();
                    for (j, s) in scores.iter().enumerate() {
                        if let Some(s) = s {
                            let p = s.exp() / total;
                            let vj = &v[(j * b_n + b) * self.kv_heads * d + g * d..][..d];
                            for c in 0..d {
                                o[(i * b_n + b) * h_n * d + h * d + c] += p * f64::from(vj[c]);
                            }
                        }
                    }
                }
            }
        }
        (o, lse)
    }

    /// The forward op on random q, k, v (seeds `seed`, `seed + 1`, `seed + 2`, magnitude
    /// `scale`) against [`AttnCase::naive`]: o and the log-sum-exp within 1e-5 relative (f32
    /// kernels against an f64 definition).
    fn forward_matches_naive(&self, seed: u64, scale: f32) {
        let (sq, skv) = (self.q_pos.len(), self.kv_pos.len());
        let q = values(sq * self.batch * self.heads * self.head_dim, seed, scale);
        let kv_len = skv * self.batch * self.kv_heads * self.head_dim;
        let (k, v) = (
            values(kv_len, seed + 1, scale),
            values(kv_len, seed + 2, scale),
        );
        let op = self.op(segments_of(&self.q_pos), segments_of(&self.kv_pos), false);
        let inputs = [
            Input::F(q.clone()),
            Input::F(k.clone()),
            Input::F(v.clone()),
        ];
        let out = eval(&op, &inputs, &[q.len(), self.batch * self.heads * sq]);
        let (o, lse) = self.naive(&q, &k, &v);
        assert_close("o", &out[0], &o, 1e-5);
        assert_close("lse", &out[1], &lse, 1e-5);
    }
}

fn segments_of(positions: &[u32]) -> Vec<Segment> {
    let mut segments: Vec<Segment> = Vec::new();
    for &p in positions {
        match segments.last_mut() {
            Some(s) if s.start + s.len == p => s.len += 1,
            _ => segments.push(seg(p, 1)),
        }
    }
    segments
}

/// Rows of a `[seq × batch, width]` tensor for the given local sequence indices.
fn take_rows(x: &[f32], batch: usize, width: usize, seq_indices: &[usize]) -> Vec<f32> {
    seq_indices
        .iter()
        .flat_map(|&s| {
            x[s * batch * width..(s + 1) * batch * width]
                .iter()
                .copied()
        })
        .collect()
}

#[test]
fn attention_matches_naive_softmax_causal_gqa_with_permuted_keys() {
    let case = AttnCase {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        causal: true,
        q_pos: (0..6).collect(),
        kv_pos: vec![3, 4, 5, 0, 1, 2],
    };
    case.forward_matches_naive(40, 1.5);
}

#[test]
fn attention_without_mask_matches_naive_softmax() {
    let case = AttnCase {
        batch: 1,
        heads: 2,
        kv_heads: 2,
        head_dim: 5,
        causal: false,
        q_pos: (0..3).collect(),
        kv_pos: (0..7).collect(),
    };
    case.forward_matches_naive(43, 1.0);
}

/// A query holding a NaN makes that query's outputs and log-sum-exp NaN, as in PyTorch: the
/// row's max once passed the NaN score over (`f32::max`), took the row for fully masked and
/// wrote zeros, so a NaN weight gave finite outputs and a finite loss.
#[test]
fn a_nan_query_gives_nan_outputs_not_zeros() {
    let case = AttnCase {
        batch: 1,
        heads: 2,
        kv_heads: 2,
        head_dim: 4,
        causal: true,
        q_pos: (0..3).collect(),
        kv_pos: (0..3).collect(),
    };
    let mut q = values(3 * 2 * 4, 7, 1.0);
    let (k, v) = (values(3 * 2 * 4, 8, 1.0), values(3 * 2 * 4, 9, 1.0));
    // Position 1, head 0, first dimension.
    q[2 * 4] = f32::NAN;
    let op = case.op(segments_of(&case.q_pos), segments_of(&case.kv_pos), false);
    let inputs = [Input::F(q.clone()), Input::F(k), Input::F(v)];
    let out = eval(&op, &inputs, &[q.len(), 2 * 3]);
    let (o, lse) = (&out[0], &out[1]);
    assert!(o[2 * 4..3 * 4].iter().all(|x| x.is_nan()), "{o:?}");
    assert!(lse[1].is_nan(), "{lse:?}");
    // Other rows and the other head stay finite.
    assert!(o[..2 * 4].iter().all(|x| x.is_finite()), "{o:?}");
    assert!(o[3 * 4..].iter().all(|x| x.is_finite()), "{o:?}");
}

#[test]
fn context_parallel_chunks_against_gathered_keys_equal_rows_of_full_attention() {
    // 16 positions over cp = 2 with the load-balanced split: rank 0 holds chunks 0 and 3,
    // rank 1 chunks 1 and 2; K/V are all-gathered in rank order.
    let (batch, heads, kv_heads, d, seq) = (2usize, 2usize, 1usize, 4usize, 16usize);
    let case = AttnCase {
        batch,
        heads,
        kv_heads,
        head_dim: d,
        causal: true,
        q_pos: (0..16).collect(),
        kv_pos: (0..16).collect(),
    };
    let q = values(seq * batch * heads * d, 46, 1.5);
    let k = values(seq * batch * kv_heads * d, 47, 1.5);
    let v = values(seq * batch * kv_heads * d, 48, 1.5);
    let full = eval(
        &case.op(vec![seg(0, 16)], vec![seg(0, 16)], false),
        &[
            Input::F(q.clone()),
            Input::F(k.clone()),
            Input::F(v.clone()),
        ],
        &[q.len(), batch * heads * seq],
    );
    let rank_chunks: [Vec<usize>; 2] = [
        (0..4).chain(12..16).collect(),
        (4..8).chain(8..12).collect(),
    ];
    let gathered: Vec<usize> = rank_chunks.concat();
    let kv_segments = vec![seg(0, 4), seg(12, 4), seg(4, 4), seg(8, 4)];
    let k_gathered = take_rows(&k, batch, kv_heads * d, &gathered);
    let v_gathered = take_rows(&v, batch, kv_heads * d, &gathered);
    for (rank, chunk) in rank_chunks.iter().enumerate() {
        let q_segments = if rank == 0 {
            vec![seg(0, 4), seg(12, 4)]
        } else {
            vec![seg(4, 8)]
        };
        let q_local = take_rows(&q, batch, heads * d, chunk);
        let out = eval(
            &case.op(q_segments, kv_segments.clone(), false),
            &[
                Input::F(q_local),
                Input::F(k_gathered.clone()),
                Input::F(v_gathered.clone()),
            ],
            &[chunk.len() * batch * heads * d, batch * heads * chunk.len()],
        );
        let expected_o: Vec<f64> = take_rows(&full[0], batch, heads * d, chunk)
            .into_iter()
            .map(f64::from)
            .collect();
        // Only the summation order over keys differs: 1e-6 relative.
        assert_close(&format!("rank {rank} o"), &out[0], &expected_o, 1e-6);
        let expected_lse: Vec<f64> = (0..batch * heads)
            .flat_map(|bh| chunk.iter().map(move |&s| (bh, s)))
            .map(|(bh, s)| f64::from(full[1][bh * seq + s]))
            .collect();
        assert_close(&format!("rank {rank} lse"), &out[1], &expected_lse, 1e-6);
    }
}

/// Repeat each kv head `group` times along the columns: `[rows, kv·d]` → `[rows, kv·group·d]`.
fn repeat_heads(x: &[f32], kv_heads: usize, group: usize, d: usize) -> Vec<f32> {
    x.chunks(kv_heads * d)
        .flat_map(|row| {
            row.chunks(d)
                .flat_map(move |head| std::iter::repeat_n(head, group).flatten().copied())
        })
        .collect()
}

#[test]
fn gqa_equals_mha_with_repeated_kv_heads_forward_and_backward() {
    let (batch, heads, kv_heads, d, seq) = (2usize, 4usize, 2usize, 4usize, 5usize);
    let gqa = AttnCase {
        batch,
        heads,
        kv_heads,
        head_dim: d,
        causal: true,
        q_pos: (0..5).collect(),
        kv_pos: (0..5).collect(),
    };
    let mha = AttnCase {
        kv_heads: heads,
        q_pos: gqa.q_pos.clone(),
        kv_pos: gqa.kv_pos.clone(),
        ..gqa
    };
    let q = values(seq * batch * heads * d, 49, 1.5);
    let k = values(seq * batch * kv_heads * d, 50, 1.5);
    let v = values(seq * batch * kv_heads * d, 51, 1.5);
    let d_out = values(q.len(), 52, 1.0);
    let k_rep = repeat_heads(&k, kv_heads, heads / kv_heads, d);
    let v_rep = repeat_heads(&v, kv_heads, heads / kv_heads, d);
    let run = |case: &AttnCase, k: &[f32], v: &[f32]| {
        let fwd = eval(
            &case.op(vec![seg(0, 5)], vec![seg(0, 5)], false),
            &[
                Input::F(q.clone()),
                Input::F(k.to_vec()),
                Input::F(v.to_vec()),
            ],
            &[q.len(), batch * heads * seq],
        );
        let bwd = eval(
            &case.op(vec![seg(0, 5)], vec![seg(0, 5)], true),
            &[
                Input::F(d_out.clone()),
                Input::F(q.clone()),
                Input::F(k.to_vec()),
                Input::F(v.to_vec()),
                Input::F(fwd[0].clone()),
                Input::F(fwd[1].clone()),
            ],
            &[q.len(), k.len(), k.len()],
        );
        (fwd, bwd)
    };
    let (gqa_fwd, gqa_bwd) = run(&gqa, &k, &v);
    let (mha_fwd, mha_bwd) = run(&mha, &k_rep, &v_rep);
    // Same arithmetic per query head: bit-identical outputs and dq.
    assert_eq!(gqa_fwd, mha_fwd);
    assert_eq!(gqa_bwd[0], mha_bwd[0]);
    // dk/dv of a shared kv head = the sum over the query heads that read it.
    for which in [1, 2] {
        let summed: Vec<f64> = mha_bwd[which]
            .chunks(heads * d)
            .flat_map(|row| {
                (0..kv_heads).flat_map(move |g| {
                    (0..d).map(move |c| {
                        (0..heads / kv_heads)
                            .map(|r| f64::from(row[(g * (heads / kv_heads) + r) * d + c]))
                            .sum::<f64>()
                    })
                })
            })
            .collect();
        assert_close(&format!("grad {which}"), &gqa_bwd[which], &summed, 1e-6);
    }
}

#[test]
fn a_query_that_sees_no_key_gets_zero_output_and_no_gradient() {
    let case = AttnCase {
        batch: 1,
        heads: 1,
        kv_heads: 1,
        head_dim: 2,
        causal: true,
        q_pos: vec![0, 5],
        kv_pos: vec![3, 4],
    };
    let (q, k, v) = (values(4, 53, 1.0), values(4, 54, 1.0), values(4, 55, 1.0));
    let segs = (vec![seg(0, 1), seg(5, 1)], vec![seg(3, 2)]);
    let fwd = eval(
        &case.op(segs.0.clone(), segs.1.clone(), false),
        &[
            Input::F(q.clone()),
            Input::F(k.clone()),
            Input::F(v.clone()),
        ],
        &[4, 2],
    );
    assert_eq!(&fwd[0][..2], &[0.0, 0.0]);
    assert_eq!(fwd[1][0], f32::NEG_INFINITY);
    let bwd = eval(
        &case.op(segs.0, segs.1, true),
        &[
            Input::F(vec![1.0; 4]),
            Input::F(q),
            Input::F(k),
            Input::F(v),
            Input::F(fwd[0].clone()),
            Input::F(fwd[1].clone()),
        ],
        &[4, 4, 4],
    );
    assert_eq!(&bwd[0][..2], &[0.0, 0.0]);
    assert!(bwd.iter().flatten().all(|x| x.is_finite()));
}

// ---------------------------------------------------------------- linear, norms, rope

#[test]
fn matmul_matches_a_naive_product_on_blocked_sizes() {
    let (rows, in_dim, out_dim) = (67usize, 130usize, 45usize);
    let x = values(rows * in_dim, 56, 1.0);
    let w = values(out_dim * in_dim, 57, 1.0);
    let b = values(out_dim, 58, 1.0);
    let out = eval(
        &Op::Matmul {
            in_dim: in_dim as u64,
            out_dim: out_dim as u64,
            bias: true,
            act: None,
            residual: false,
            swiglu: false,
            fp8: None,
        },
        &[
            Input::F(x.clone()),
            Input::F(w.clone()),
            Input::F(b.clone()),
        ],
        &[rows * out_dim],
    );
    let expected: Vec<f64> = (0..rows)
        .flat_map(|r| {
            let (x, w, b) = (&x, &w, &b);
            (0..out_dim).map(move |o| {
                f64::from(b[o])
                    + (0..in_dim)
                        .map(|i| f64::from(x[r * in_dim + i]) * f64::from(w[o * in_dim + i]))
                        .sum::<f64>()
            })
        })
        .collect();
    // Sums of 130 O(1) products in f32: 1e-5 relative to (1 + |value|).
    assert_close("y", &out[0], &expected, 1e-5);
}

#[test]
fn layer_norm_and_rms_norm_normalise_rows() {
    let (rows, dim) = (4usize, 16usize);
    let x: Vec<f32> = values(rows * dim, 59, 3.0)
        .iter()
        .map(|v| v + 2.0)
        .collect();
    let ln = eval(
        &Op::LayerNorm {
            dim: dim as u64,
            eps: 0.0,
            bias: true,
        },
        &[
            Input::F(x.clone()),
            Input::F(vec![1.0; dim]),
            Input::F(vec![0.0; dim]),
        ],
        &[rows * dim, rows, rows],
    );
    for row in ln[0].chunks(dim) {
        let mean: f64 = row.iter().map(|&v| f64::from(v)).sum::<f64>() / dim as f64;
        let var: f64 = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / dim as f64;
        assert!(
            mean.abs() < 1e-6 && (var - 1.0).abs() < 1e-5,
            "{mean} {var}"
        );
    }
    let rms = eval(
        &Op::RmsNorm {
            dim: dim as u64,
            eps: 0.0,
        },
        &[Input::F(x), Input::F(vec![2.0; dim])],
        &[rows * dim, rows],
    );
    for row in rms[0].chunks(dim) {
        let ms: f64 = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / dim as f64;
        assert!((ms - 4.0).abs() < 1e-5, "{ms}");
    }
}

#[test]
fn rope_rotates_pairs_by_position_times_frequency() {
    // One head of dim 4: pairs (0, 2) at frequency 1 and (1, 3) at theta^(-1/2) = 0.1.
    let x = vec![1.0f32, 2.0, 0.0, 0.0];
    let attrs = |pos: u32| RopeAttrs {
        batch: 1,
        heads: 1,
        head_dim: 4,
        theta: 100.0,
        scaling: RopeScaling::None,
        positions: vec![seg(pos, 1)],
        rotary_dim: None,
    };
    assert_eq!(
        eval(&Op::Rope(attrs(0)), &[Input::F(x.clone())], &[4])[0],
        x
    );
    let y = eval(&Op::Rope(attrs(3)), &[Input::F(x.clone())], &[4]);
    let expected = [
        3f64.cos(),
        2.0 * 0.3f64.cos(),
        3f64.sin(),
        2.0 * 0.3f64.sin(),
    ];
    assert_close("rotated", &y[0], &expected, 1e-6);
    let back = eval(&Op::RopeBwd(attrs(3)), &[Input::F(y[0].clone())], &[4]);
    assert_close("inverse", &back[0], &[1.0, 2.0, 0.0, 0.0], 1e-6);
}

/// A partial RoPE, worked by hand: two heads of 8 whose first 4 features turn (GPT-NeoX's
/// rotary_pct 0.5), at theta 100 over those 4: pairs (0, 2) at frequency 1 and (1, 3) at
/// 100^(−1/2) = 0.1, as the 4-wide head above; features 4..8 pass unchanged, forward and back;
/// the rotation table holds the turned columns' cos/∓sin and 1/0 in the kept ones.
#[test]
fn a_partial_rope_turns_the_first_features_and_keeps_the_rest() {
    let head: Vec<f32> = vec![1.0, 2.0, 0.0, 0.0, 5.0, -6.0, 7.0, 8.0];
    let x: Vec<f32> = head.iter().chain(&head).copied().collect();
    let attrs = |heads| RopeAttrs {
        batch: 1,
        heads,
        head_dim: 8,
        theta: 100.0,
        scaling: RopeScaling::None,
        positions: vec![seg(3, 1)],
        rotary_dim: Some(4),
    };
    let y = eval(&Op::Rope(attrs(2)), &[Input::F(x.clone())], &[16]).remove(0);
    let turned = [
        3f64.cos(),
        2.0 * 0.3f64.cos(),
        3f64.sin(),
        2.0 * 0.3f64.sin(),
    ];
    let kept = [5.0, -6.0, 7.0, 8.0];
    let one: Vec<f64> = turned.iter().chain(&kept).copied().collect();
    let both: Vec<f64> = one.iter().chain(&one).copied().collect();
    assert_close("partial", &y, &both, 1e-6);
    let back = eval(&Op::RopeBwd(attrs(2)), &[Input::F(y)], &[16]).remove(0);
    let x64: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    assert_close("inverse", &back, &x64, 1e-6);
    let table = eval(&Op::RopeTable(attrs(1)), &[], &[16]).remove(0);
    let expected = [
        3f64.cos(),
        0.3f64.cos(),
        3f64.cos(),
        0.3f64.cos(),
        1.0,
        1.0,
        1.0,
        1.0,
        -(3f64.sin()),
        -(0.3f64.sin()),
        3f64.sin(),
        0.3f64.sin(),
        0.0,
        0.0,
        0.0,
        0.0,
    ];
    assert_close("table", &table, &expected, 1e-6);
}

/// Scaled frequencies, worked by hand: one head of dim 8 at theta 100 (plain frequencies 1,
/// 0.316228, 0.1, 0.0316228; wavelengths 6.3, 19.9, 62.8, 198.7) under Llama 3's rule with
/// factor 8, low 1, high 4 and an original length of 128: the first two kept (under 32), the
/// third blended (smooth = (128 / 62.83 − 1) / 3 = 0.345728, 0.1 · (0.654272 / 8 + 0.345728) =
/// 0.0427512), the fourth divided by 8 (0.00395285). At position 5, x = 1 in every pair's first
/// half rotates to (cos, sin) of 5 × each. Linear scaling by 4 divides all four.
#[test]
fn scaled_rope_rotates_by_the_scaled_frequencies() {
    let x = vec![1.0f32, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
    let rotate = |scaling, op: fn(RopeAttrs) -> Op| {
        let attrs = RopeAttrs {
            batch: 1,
            heads: 1,
            head_dim: 8,
            theta: 100.0,
            scaling,
            positions: vec![seg(5, 1)],
            rotary_dim: None,
        };
        eval(&op(attrs), &[Input::F(x.clone())], &[8]).remove(0)
    };
    let expected = |freqs: [f64; 4]| -> Vec<f64> {
        let angles = freqs.map(|f| 5.0 * f);
        angles
            .map(f64::cos)
            .into_iter()
            .chain(angles.map(f64::sin))
            .collect()
    };
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 128,
    };
    let by_hand = [1.0, 0.31622777, 0.04275118, 0.00395285];
    assert_close(
        "llama3",
        &rotate(llama3, Op::Rope),
        &expected(by_hand),
        1e-6,
    );
    let linear = RopeScaling::Linear { factor: 4.0 };
    let quarter = [0.25, 0.31622777 / 4.0, 0.025, 0.031622777 / 4.0];
    assert_close(
        "linear",
        &rotate(linear, Op::Rope),
        &expected(quarter),
        1e-6,
    );
    // The backward rotates by the negative angles: the sines change sign.
    let back: Vec<f64> = expected(by_hand)
        .iter()
        .enumerate()
        .map(|(i, v)| if i < 4 { *v } else { -v })
        .collect();
    assert_close("llama3 backward", &rotate(llama3, Op::RopeBwd), &back, 1e-6);
}

// ---------------------------------------------------------------- elementwise

#[test]
fn activations_have_their_known_values() {
    let x = vec![-1.0f32, 0.0, 1.0, 2.0];
    let run = |act| {
        eval(
            &Op::Activation(ActAttrs { act }),
            &[Input::F(x.clone())],
            &[4],
        )
    };
    // Φ(1) = 0.841344746068543, Φ(2) = 0.977249868051821, Φ(−1) = 0.158655253931457.
    assert_close(
        "gelu",
        &run(Act::Gelu)[0],
        &[
            -0.158655253931457,
            0.0,
            0.841344746068543,
            1.954499736103642,
        ],
        1e-6,
    );
    assert_close(
        "gelu_tanh",
        &run(Act::GeluTanh)[0],
        &[-0.158808, 0.0, 0.841192, 1.954598],
        1e-5,
    );
    assert_eq!(run(Act::Relu)[0], vec![0.0, 0.0, 1.0, 2.0]);
    let swiglu = eval(
        &Op::SwiGlu,
        &[Input::F(vec![1.0, -2.0]), Input::F(vec![3.0, 0.5])],
        &[2],
    );
    let silu = |g: f64| g / (1.0 + (-g).exp());
    assert_close(
        "swiglu",
        &swiglu[0],
        &[3.0 * silu(1.0), 0.5 * silu(-2.0)],
        1e-6,
    );
}

#[test]
fn add_scale_copy_zero_and_copy_range_move_the_right_elements() {
    let a = Input::F(vec![1.0, 2.0, 3.0]);
    let b = Input::F(vec![0.5, 0.25, -1.0]);
    assert_eq!(
        eval(&Op::Add, &[a.clone(), b], &[3])[0],
        vec![1.5, 2.25, 2.0]
    );
    assert_eq!(
        eval(&Op::Scale { factor: -2.0 }, std::slice::from_ref(&a), &[3])[0],
        vec![-2.0, -4.0, -6.0]
    );
    assert_eq!(
        eval(&Op::Copy, std::slice::from_ref(&a), &[3])[0],
        vec![1.0, 2.0, 3.0]
    );
    assert_eq!(eval(&Op::Zero, &[], &[3])[0], vec![0.0; 3]);
    let moved = eval_from(
        &Op::CopyRange {
            src_offset: 1,
            dst_offset: 3,
            len: 2,
        },
        &[a],
        &[vec![9.0; 6]],
    );
    assert_eq!(moved[0], vec![9.0, 9.0, 9.0, 2.0, 3.0, 9.0]);

    // Copies move floats (the op table's `Float` class): token ids are refused by name.
    let mut h = Harness::new();
    let src = h.input(&Input::I(vec![4, 5, 6]));
    let dst = h.input(&Input::I(vec![0; 3]));
    let range = Op::CopyRange {
        src_offset: 0,
        dst_offset: 1,
        len: 2,
    };
    for op in [range, Op::Copy] {
        let e = h
            .backend
            .compute(&op, &[src], &[dst], &SCALARS)
            .unwrap_err();
        assert!(
            e.to_string().contains("is i32, expected f32 or bf16"),
            "{e}"
        );
    }
    assert_eq!(h.backend.i32(dst).unwrap(), &[0, 0, 0]);
}

// ---------------------------------------------------------------- embeddings

#[test]
fn vocab_parallel_embedding_shards_sum_to_the_full_embedding() {
    let (vocab, dim) = (6u64, 3usize);
    let table = values(vocab as usize * dim, 60, 1.0);
    let ids = Input::I(vec![5, 0, 2, 3, 3, 1]);
    let op = |vocab_start, vocab_local| {
        Op::Embedding(EmbeddingAttrs {
            vocab_start,
            vocab_local,
            dim: dim as u64,
        })
    };
    let full = eval(
        &op(0, vocab),
        &[ids.clone(), Input::F(table.clone())],
        &[18],
    );
    let lo = eval(
        &op(0, 3),
        &[ids.clone(), Input::F(table[..9].to_vec())],
        &[18],
    );
    let hi = eval(&op(3, 3), &[ids, Input::F(table[9..].to_vec())], &[18]);
    let summed: Vec<f32> = lo[0].iter().zip(&hi[0]).map(|(a, b)| a + b).collect();
    assert_eq!(summed, full[0]);
    assert_eq!(&full[0][..3], &table[15..18]);
}

#[test]
fn position_add_uses_global_positions_of_each_row() {
    let table: Vec<f32> = (0..8).map(|p| p as f32 * 10.0).collect();
    let out = eval(
        &Op::PositionAdd(PositionAttrs {
            batch: 2,
            dim: 1,
            positions: vec![seg(1, 1), seg(6, 1)],
        }),
        &[Input::F(vec![1.0, 2.0, 3.0, 4.0]), Input::F(table)],
        &[4],
    );
    assert_eq!(out[0], vec![11.0, 12.0, 63.0, 64.0]);
}

// ---------------------------------------------------------------- cross-entropy

fn columns(logits: &[f32], vocab: usize, range: std::ops::Range<usize>) -> Vec<f32> {
    logits
        .chunks(vocab)
        .flat_map(|row| row[range.clone()].iter().copied())
        .collect()
}

#[test]
fn vocab_parallel_cross_entropy_over_two_ranks_equals_unsplit() {
    let (rows, vocab) = (5usize, 8usize);
    let logits = values(rows * vocab, 61, 4.0);
    let targets = vec![0, 7, 3, 4, 4];
    let scale = 1.0 / rows as f64;
    let [max, sumexp, target] = ce_pieces(&logits, &targets, 0, vocab as u64, None);
    let loss = eval_from(
        &Op::CeLoss { scale },
        &[
            Input::F(max.clone()),
            Input::F(sumexp.clone()),
            Input::F(target),
        ],
        &[vec![0.0]],
    )[0][0];
    // Against -mean log softmax in f64.
    let expected: f64 = logits
        .chunks(vocab)
        .zip(&targets)
        .map(|(row, &t)| {
            let m = row.iter().fold(f64::MIN, |a, &b| a.max(f64::from(b)));
            let lse = m + row
                .iter()
                .map(|&x| (f64::from(x) - m).exp())
                .sum::<f64>()
                .ln();
            lse - f64::from(row[t as usize])
        })
        .sum::<f64>()
        * scale;
    assert_close("loss", &[loss], &[expected], 1e-6);

    // Two ranks of 4 columns: all-reduce max (max), then sumexp and target_logit (sum).
    let shards = [columns(&logits, vocab, 0..4), columns(&logits, vocab, 4..8)];
    let local_max: Vec<[Vec<f32>; 3]> = shards
        .iter()
        .enumerate()
        .map(|(r, s)| ce_pieces(s, &targets, 4 * r as u64, 4, None))
        .collect();
    let global_max: Vec<f32> = (0..rows)
        .map(|i| local_max[0][0][i].max(local_max[1][0][i]))
        .collect();
    assert_eq!(global_max, max);
    let pieces: Vec<[Vec<f32>; 3]> = shards
        .iter()
        .enumerate()
        .map(|(r, s)| ce_pieces(s, &targets, 4 * r as u64, 4, Some(&global_max)))
        .collect();
    let sum = |k: usize| -> Vec<f32> {
        (0..rows)
            .map(|i| pieces[0][k][i] + pieces[1][k][i])
            .collect()
    };
    let split_loss = eval_from(
        &Op::CeLoss { scale },
        &[
            Input::F(global_max.clone()),
            Input::F(sum(1)),
            Input::F(sum(2)),
        ],
        &[vec![0.0]],
    )[0][0];
    assert_close("split loss", &[split_loss], &[f64::from(loss)], 1e-6);

    // Each rank's CeGrad is its columns of the unsplit gradient.
    let grad = |logits: &[f32], start: u64, local: u64, sumexp: &[f32]| {
        eval(
            &Op::CeGrad {
                vocab_start: start,
                vocab_local: local,
                scale,
            },
            &[
                Input::F(logits.to_vec()),
                Input::I(targets.clone()),
                Input::F(global_max.clone()),
                Input::F(sumexp.to_vec()),
            ],
            &[logits.len()],
        )
        .remove(0)
    };
    let full = grad(&logits, 0, vocab as u64, &sumexp);
    for (r, shard) in shards.iter().enumerate() {
        let part = grad(shard, 4 * r as u64, 4, &sum(1));
        let expected: Vec<f64> = columns(&full, vocab, 4 * r..4 * r + 4)
            .into_iter()
            .map(f64::from)
            .collect();
        assert_close(&format!("rank {r} dlogits"), &part, &expected, 1e-6);
    }
}

// ---------------------------------------------------------------- optimizer

#[test]
fn sum_squares_accumulates_the_squared_norm() {
    let g = values(20_000, 62, 1.0);
    let expected: f64 = g.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() + 2.5;
    let out = eval_from(&Op::SumSquares, &[Input::F(g)], &[vec![2.5]]);
    assert_close("sumsq", &out[0], &[expected], 1e-6);
}

#[test]
fn clip_coefficient_scales_only_above_the_max_norm() {
    let coef = |max_norm| eval(&Op::ClipCoef { max_norm }, &[Input::F(vec![16.0])], &[1])[0][0];
    assert_close("clipped", &[coef(Some(1.0))], &[1.0 / (4.0 + 1e-6)], 1e-7);
    assert_eq!(coef(Some(10.0)), 1.0);
    assert_eq!(coef(None), 1.0);
}

#[test]
fn adamw_matches_a_hand_computed_two_step_update() {
    let (beta1, beta2, eps, wd, lr) = (0.9f64, 0.95f64, 1e-8f64, 0.1f64, 0.01f64);
    let op = Op::AdamW {
        beta1,
        beta2,
        eps,
        weight_decay: wd,
    };
    let grads = [[0.5f32, -2.0, 0.0], [1.0, 1.0, -0.25]];
    let coef = 0.5f32;
    let mut h = Harness::new();
    let param = h.f32(&[1.0, -1.0, 0.5]);
    let m = h.f32(&[0.0; 3]);
    let v = h.f32(&[0.0; 3]);
    let c = h.f32(&[coef]);
    let (mut p_ref, mut m_ref, mut v_ref) = ([1.0f64, -1.0, 0.5], [0.0f64; 3], [0.0f64; 3]);
    for (t, g) in grads.iter().enumerate() {
        let step = t as u64 + 1;
        let g_id = h.f32(g);
        h.backend
            .compute(
                &op,
                &[g_id, c],
                &[param, m, v],
                &StepScalars {
                    lr,
                    step,
                    loss_scale: None,
                },
            )
            .unwrap();
        for i in 0..3 {
            let g = f64::from(coef) * f64::from(g[i]);
            m_ref[i] = beta1 * m_ref[i] + (1.0 - beta1) * g;
            v_ref[i] = beta2 * v_ref[i] + (1.0 - beta2) * g * g;
            let m_hat = m_ref[i] / (1.0 - beta1.powi(step as i32));
            let v_hat = v_ref[i] / (1.0 - beta2.powi(step as i32));
            p_ref[i] -= lr * (m_hat / (v_hat.sqrt() + eps) + wd * p_ref[i]);
        }
    }
    assert_close("param", h.backend.f32(param).unwrap(), &p_ref, 1e-6);
    assert_close("m", h.backend.f32(m).unwrap(), &m_ref, 1e-6);
    assert_close("v", h.backend.f32(v).unwrap(), &v_ref, 1e-6);
}

#[test]
fn sgd_with_and_without_momentum_matches_hand_computed_steps() {
    let (lr, momentum, wd) = (0.1f64, 0.9f64, 0.01f64);
    let grads = [[1.0f32, -1.0], [0.5, 2.0]];
    let mut h = Harness::new();
    let c = h.f32(&[1.0]);
    let with = h.f32(&[1.0, 2.0]);
    let buf = h.f32(&[7.0, 7.0]); // stale values: step 1 must overwrite them
    let plain = h.f32(&[1.0, 2.0]);
    let (mut p_ref, mut b_ref, mut q_ref) = ([1.0f64, 2.0], [0.0f64; 2], [1.0f64, 2.0]);
    for (t, g) in grads.iter().enumerate() {
        let scalars = StepScalars {
            lr,
            step: t as u64 + 1,
            loss_scale: None,
        };
        let g_id = h.f32(g);
        let op = Op::Sgd {
            momentum,
            weight_decay: wd,
        };
        h.backend
            .compute(&op, &[g_id, c], &[with, buf], &scalars)
            .unwrap();
        let op = Op::Sgd {
            momentum: 0.0,
            weight_decay: wd,
        };
        h.backend
            .compute(&op, &[g_id, c], &[plain], &scalars)
            .unwrap();
        for i in 0..2 {
            let g_with = f64::from(g[i]) + wd * p_ref[i];
            b_ref[i] = if t == 0 {
                g_with
            } else {
                momentum * b_ref[i] + g_with
            };
            p_ref[i] -= lr * b_ref[i];
            q_ref[i] -= lr * (f64::from(g[i]) + wd * q_ref[i]);
        }
    }
    assert_close("param", h.backend.f32(with).unwrap(), &p_ref, 1e-6);
    assert_close("momentum", h.backend.f32(buf).unwrap(), &b_ref, 1e-6);
    assert_close("plain", h.backend.f32(plain).unwrap(), &q_ref, 1e-6);
}

#[test]
fn attention_over_several_query_tiles_matches_naive_softmax() {
    let case = AttnCase {
        batch: 2,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        causal: true,
        q_pos: (0..130).collect(),
        kv_pos: (0..130).collect(),
    };
    case.forward_matches_naive(63, 1.5);
}
