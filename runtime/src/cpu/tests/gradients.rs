//! Every backward op against central differences of its forward op (tolerance in
//! `assert_gradient`). Overwritten gradient outputs start as NaN (a kernel that reads them
//! fails); accumulated ones start at 1 and the check subtracts it (a kernel that overwrites
//! fails).
use super::*;
use parc_compiler::ir::op::Act;
use parc_compiler::ir::op::{
    ActAttrs, AttentionAttrs, EmbeddingAttrs, PositionAttrs, RopeAttrs, RopeScaling,
};

fn minus_one(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| x - 1.0).collect()
}

#[test]
fn embedding_backward_matches_differences_and_skips_other_ranks_ids() {
    let (vocab_start, vocab_local, dim) = (2u64, 4u64, 3usize);
    let ids = Input::I(vec![2, 0, 5, 3, 7, 2, -1, 4]);
    let table = values(12, 1, 1.0);
    let fwd = Op::Embedding(EmbeddingAttrs {
        vocab_start,
        vocab_local,
        dim: dim as u64,
    });
    let inputs = [ids.clone(), Input::F(table)];
    let cot = vec![values(8 * dim, 2, 1.0)];
    let numeric = op_gradient(&fwd, &inputs, &[8 * dim], &cot, 1);
    let bwd = Op::EmbeddingBwd(EmbeddingAttrs {
        vocab_start,
        vocab_local,
        dim: dim as u64,
    });
    let out = eval_from(&bwd, &[ids, Input::F(cot[0].clone())], &[vec![1.0; 12]]);
    assert_gradient("dtable", &numeric, &minus_one(&out[0]));
}

#[test]
fn position_add_backward_matches_differences_with_split_segments() {
    let (batch, dim) = (2u64, 3usize);
    let positions = vec![seg(0, 2), seg(6, 2)];
    let rows = 4 * batch as usize;
    let fwd = Op::PositionAdd(PositionAttrs {
        batch,
        dim: dim as u64,
        positions: positions.clone(),
    });
    let inputs = [
        Input::F(values(rows * dim, 3, 1.0)),
        Input::F(values(8 * dim, 4, 1.0)),
    ];
    let cot = vec![values(rows * dim, 5, 1.0)];
    let numeric_x = op_gradient(&fwd, &inputs, &[rows * dim], &cot, 0);
    assert_gradient("dx (= dy)", &numeric_x, &cot[0]);
    let numeric_table = op_gradient(&fwd, &inputs, &[rows * dim], &cot, 1);
    let bwd = Op::PositionAddBwd {
        pos: PositionAttrs {
            batch,
            dim: dim as u64,
            positions,
        },
        accumulate_param_grad: true,
    };
    let out = eval_from(&bwd, &[Input::F(cot[0].clone())], &[vec![1.0; 8 * dim]]);
    assert_gradient("dtable", &numeric_table, &minus_one(&out[0]));
}

fn check_layer_norm(bias: bool) {
    let (rows, dim) = (3usize, 5usize);
    let fwd = Op::LayerNorm {
        dim: dim as u64,
        eps: 1e-5,
        bias,
    };
    let mut inputs = vec![
        Input::F(values(rows * dim, 6, 2.0)),
        Input::F(values(dim, 7, 1.5)),
    ];
    if bias {
        inputs.push(Input::F(values(dim, 8, 1.0)));
    }
    let out_lens = [rows * dim, rows, rows];
    let cot = vec![values(rows * dim, 9, 1.0), vec![], vec![]];
    let fwd_out = eval(&fwd, &inputs, &out_lens);
    let bwd = Op::LayerNormBwd {
        dim: dim as u64,
        bias,
        accumulate: false,
        accumulate_param_grad: true,
    };
    let bwd_inputs = [
        Input::F(cot[0].clone()),
        inputs[0].clone(),
        inputs[1].clone(),
        Input::F(fwd_out[1].clone()),
        Input::F(fwd_out[2].clone()),
    ];
    let mut initial = vec![vec![f32::NAN; rows * dim], vec![1.0; dim]];
    if bias {
        initial.push(vec![1.0; dim]);
    }
    let grads = eval_from(&bwd, &bwd_inputs, &initial);
    let params: Vec<Vec<f32>> = grads[1..].iter().map(|g| minus_one(g)).collect();
    let mut checks = vec![("dx", 0, &grads[0][..]), ("dw", 1, &params[0])];
    if bias {
        checks.push(("db", 2, &params[1]));
    }
    assert_input_gradients(&fwd, &inputs, &out_lens, &cot, &checks);
}

#[test]
fn layer_norm_backward_matches_differences() {
    check_layer_norm(true);
    check_layer_norm(false);
}

#[test]
fn rms_norm_backward_matches_differences() {
    let (rows, dim) = (3usize, 6usize);
    let fwd = Op::RmsNorm {
        dim: dim as u64,
        eps: 1e-6,
    };
    let inputs = vec![
        Input::F(values(rows * dim, 10, 2.0)),
        Input::F(values(dim, 11, 1.5)),
    ];
    let out_lens = [rows * dim, rows];
    let cot = vec![values(rows * dim, 12, 1.0), vec![]];
    let fwd_out = eval(&fwd, &inputs, &out_lens);
    let bwd = Op::RmsNormBwd {
        dim: dim as u64,
        accumulate: false,
        accumulate_param_grad: true,
    };
    let bwd_inputs = [
        Input::F(cot[0].clone()),
        inputs[0].clone(),
        inputs[1].clone(),
        Input::F(fwd_out[1].clone()),
    ];
    let grads = eval_from(
        &bwd,
        &bwd_inputs,
        &[vec![f32::NAN; rows * dim], vec![1.0; dim]],
    );
    let checks = [("dx", 0, &grads[0][..]), ("dw", 1, &minus_one(&grads[1]))];
    assert_input_gradients(&fwd, &inputs, &out_lens, &cot, &checks);
}

#[test]
fn matmul_backward_data_and_weight_match_differences() {
    let (rows, in_dim, out_dim) = (5usize, 4usize, 3usize);
    let fwd = Op::Matmul {
        in_dim: in_dim as u64,
        out_dim: out_dim as u64,
        bias: true,
        act: None,
        residual: false,
        swiglu: false,
        fp8: None,
    };
    let inputs = vec![
        Input::F(values(rows * in_dim, 13, 1.0)),
        Input::F(values(out_dim * in_dim, 14, 1.0)),
        Input::F(values(out_dim, 15, 1.0)),
    ];
    let out_lens = [rows * out_dim];
    let cot = vec![values(rows * out_dim, 16, 1.0)];
    let dy = Input::F(cot[0].clone());
    let dx = eval(
        &Op::MatmulBwdData {
            in_dim: in_dim as u64,
            out_dim: out_dim as u64,
            accumulate: false,
            act_grad: None,
            swiglu: false,
            fp8: None,
        },
        &[dy.clone(), inputs[1].clone()],
        &[rows * in_dim],
    );
    let weight = eval_from(
        &Op::MatmulBwdWeight {
            in_dim: in_dim as u64,
            out_dim: out_dim as u64,
            bias: true,
            accumulate_param_grad: true,
            fp8: None,
        },
        &[dy, inputs[0].clone()],
        &[vec![1.0; out_dim * in_dim], vec![1.0; out_dim]],
    );
    let checks = [
        ("dx", 0, &dx[0][..]),
        ("dw", 1, &minus_one(&weight[0])),
        ("db", 2, &minus_one(&weight[1])),
    ];
    assert_input_gradients(&fwd, &inputs, &out_lens, &cot, &checks);
}

/// Plain RoPE and both scalings; with head_dim 8 and theta 100 the pairs' wavelengths are
/// 6.3, 19.9, 62.8 and 198.7, so Llama 3's rule with `original_max_position` 128 keeps the
/// first two (under 128 / 4), blends the third and divides the fourth (over 128 / 1).
#[test]
fn rope_backward_matches_differences_at_context_parallel_positions() {
    let scalings = [
        RopeScaling::None,
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 128,
        },
    ];
    let (batch, heads, head_dim) = (2u64, 2u64, 8usize);
    let len = 3 * batch as usize * heads as usize * head_dim;
    for scaling in scalings {
        let attrs = RopeAttrs {
            batch,
            heads,
            head_dim: head_dim as u64,
            theta: 100.0,
            scaling,
            positions: vec![seg(1, 2), seg(9, 1)],
            rotary_dim: None,
        };
        let (fwd, bwd) = (Op::Rope(attrs.clone()), Op::RopeBwd(attrs));
        let inputs = [Input::F(values(len, 17, 1.0))];
        let cot = vec![values(len, 18, 1.0)];
        let dx = eval(&bwd, &[Input::F(cot[0].clone())], &[len]);
        let what = format!("dx ({})", scaling.name());
        assert_gradient(&what, &op_gradient(&fwd, &inputs, &[len], &cot, 0), &dx[0]);
    }
}

/// Qwen3's q/k path as the lowering emits it (`qk_norm` then rope): `RmsNorm` over rows of
/// head_dim on a `[rows, heads·head_dim]` buffer, one weight shared by the heads, then `Rope`.
/// The forward normalizes each head on its own (against a reference computed here), and its
/// backward as lowered (`RopeBwd`, then `RmsNormBwd` over the same rows) gives the input's
/// gradient and the shared weight's, summed over heads and rows, as central differences of
/// the composed forward do.
#[test]
fn per_head_qk_norm_then_rope_matches_a_reference_and_differences() {
    let (batch, heads, head_dim) = (2u64, 3usize, 8usize);
    let rope = RopeAttrs {
        batch,
        heads: heads as u64,
        head_dim: head_dim as u64,
        theta: 100.0,
        scaling: RopeScaling::None,
        positions: vec![seg(1, 2), seg(9, 1)],
        rotary_dim: None,
    };
    let rows = 3 * batch as usize;
    let len = rows * heads * head_dim;
    let eps = 1e-6;
    let norm = Op::RmsNorm {
        dim: head_dim as u64,
        eps,
    };
    let normalized = |x: &[f32], w: &[f32]| {
        let ins = [Input::F(x.to_vec()), Input::F(w.to_vec())];
        eval(&norm, &ins, &[len, rows * heads])
    };
    let forward = |x: &[f32], w: &[f32]| {
        let n = normalized(x, w);
        eval(&Op::Rope(rope.clone()), &[Input::F(n[0].clone())], &[len])
    };
    let (x, w) = (values(len, 40, 2.0), values(head_dim, 41, 1.5));
    let n = normalized(&x, &w);
    for (i, (head, y)) in x.chunks(head_dim).zip(n[0].chunks(head_dim)).enumerate() {
        let ms = head.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / head_dim as f64;
        let rstd = 1.0 / (ms + eps).sqrt();
        assert!(
            (f64::from(n[1][i]) - rstd).abs() <= 1e-5 * rstd,
            "rstd of head row {i}"
        );
        for ((&xv, &yv), &wv) in head.iter().zip(y).zip(&w) {
            let want = f64::from(xv) * rstd * f64::from(wv);
            assert!(
                (f64::from(yv) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "head row {i}"
            );
        }
    }
    let cot = vec![values(len, 42, 1.0)];
    let numeric_x = numeric_gradient(&x, 1e-2, |p| pair(&forward(p, &w), &cot));
    let numeric_w = numeric_gradient(&w, 1e-2, |p| pair(&forward(&x, p), &cot));
    let dn = eval(
        &Op::RopeBwd(rope.clone()),
        &[Input::F(cot[0].clone())],
        &[len],
    );
    let bwd = Op::RmsNormBwd {
        dim: head_dim as u64,
        accumulate: false,
        accumulate_param_grad: true,
    };
    let ins = [
        Input::F(dn[0].clone()),
        Input::F(x.clone()),
        Input::F(w.clone()),
        Input::F(n[1].clone()),
    ];
    let grads = eval_from(&bwd, &ins, &[vec![f32::NAN; len], vec![1.0; head_dim]]);
    assert_gradient("dx", &numeric_x, &grads[0]);
    assert_gradient(
        "dw (shared by the heads)",
        &numeric_w,
        &minus_one(&grads[1]),
    );
}

fn check_attention(causal: bool, heads: u64, kv_heads: u64) {
    let (batch, head_dim) = (2u64, 4u64);
    // A context-parallel style query chunk against keys stored in another order.
    let q_positions = vec![seg(0, 2), seg(6, 2)];
    let kv_positions = vec![seg(4, 4), seg(0, 4)];
    let q_len = (4 * batch * heads * head_dim) as usize;
    let kv_len = (8 * batch * kv_heads * head_dim) as usize;
    let lse_len = (batch * heads * 4) as usize;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let fwd = Op::Attention(AttentionAttrs {
        batch,
        heads,
        kv_heads,
        head_dim,
        causal,
        scale,
        q_positions: q_positions.clone(),
        kv_positions: kv_positions.clone(),
        packed: false,
    });
    let inputs = vec![
        Input::F(values(q_len, 19, 1.0)),
        Input::F(values(kv_len, 20, 1.0)),
        Input::F(values(kv_len, 21, 1.0)),
    ];
    let out_lens = [q_len, lse_len];
    let cot = vec![values(q_len, 22, 1.0), vec![]];
    let fwd_out = eval(&fwd, &inputs, &out_lens);
    let bwd = Op::AttentionBwd(AttentionAttrs {
        batch,
        heads,
        kv_heads,
        head_dim,
        causal,
        scale,
        q_positions,
        kv_positions,
        packed: false,
    });
    let bwd_inputs = [
        Input::F(cot[0].clone()),
        inputs[0].clone(),
        inputs[1].clone(),
        inputs[2].clone(),
        Input::F(fwd_out[0].clone()),
        Input::F(fwd_out[1].clone()),
    ];
    let grads = eval(&bwd, &bwd_inputs, &[q_len, kv_len, kv_len]);
    for (which, name) in [(0, "dq"), (1, "dk"), (2, "dv")] {
        let numeric = op_gradient(&fwd, &inputs, &out_lens, &cot, which);
        assert_gradient(name, &numeric, &grads[which]);
    }
}

#[test]
fn attention_backward_matches_differences_causal_mha() {
    check_attention(true, 2, 2);
}

#[test]
fn attention_backward_matches_differences_causal_gqa() {
    check_attention(true, 4, 2);
}

#[test]
fn attention_backward_matches_differences_bidirectional_mqa() {
    check_attention(false, 2, 1);
}

#[test]
fn activation_backward_matches_differences() {
    // Keep relu's inputs away from its kink at 0.
    let x: Vec<f32> = values(40, 23, 3.0)
        .into_iter()
        .map(|v| if v.abs() < 0.05 { v + 0.1 } else { v })
        .collect();
    let cot = vec![values(40, 24, 1.0)];
    for &act in Act::ALL {
        let inputs = [Input::F(x.clone())];
        let numeric = op_gradient(&Op::Activation(ActAttrs { act }), &inputs, &[40], &cot, 0);
        let dx = eval(
            &Op::ActivationBwd(ActAttrs { act }),
            &[Input::F(cot[0].clone()), Input::F(x.clone())],
            &[40],
        );
        assert_gradient(&format!("{act:?} dx"), &numeric, &dx[0]);
    }
}

#[test]
fn swiglu_backward_matches_differences() {
    let inputs = vec![Input::F(values(30, 25, 3.0)), Input::F(values(30, 26, 2.0))];
    let cot = vec![values(30, 27, 1.0)];
    let Input::F(gate) = inputs[0].clone() else {
        unreachable!()
    };
    let Input::F(up) = inputs[1].clone() else {
        unreachable!()
    };
    let grads = eval(
        &Op::SwiGluBwd,
        &[Input::F(cot[0].clone()), Input::F(gate), Input::F(up)],
        &[30, 30],
    );
    let checks = [("dgate", 0, &grads[0][..]), ("dup", 1, &grads[1])];
    assert_input_gradients(&Op::SwiGlu, &inputs, &[30], &cot, &checks);
}

/// The unsplit cross-entropy loss of `logits` through the four forward pieces.
fn ce_loss_of(logits: &[f32], targets: &[i32], vocab: u64, scale: f64) -> f64 {
    let [max, sumexp, target] = ce_pieces(logits, targets, 0, vocab, None);
    let pieces = [max, sumexp, target].map(Input::F);
    let loss = eval_from(&Op::CeLoss { scale }, &pieces, &[vec![0.0]]);
    f64::from(loss[0][0])
}

#[test]
fn cross_entropy_gradient_matches_differences_of_the_loss() {
    let (rows, vocab) = (4usize, 7u64);
    let logits = values(rows * vocab as usize, 28, 3.0);
    let targets = vec![0, 6, 3, 3];
    let scale = 1.0 / rows as f64;
    let numeric = numeric_gradient(&logits, 1e-2, |l| ce_loss_of(l, &targets, vocab, scale));
    let [max, sumexp, _] = ce_pieces(&logits, &targets, 0, vocab, None);
    let grad = eval(
        &Op::CeGrad {
            vocab_start: 0,
            vocab_local: vocab,
            scale,
        },
        &[
            Input::F(logits.clone()),
            Input::I(targets.clone()),
            Input::F(max),
            Input::F(sumexp),
        ],
        &[logits.len()],
    );
    assert_gradient("dlogits", &numeric, &grad[0]);
}

/// Directional derivative check for sizes where per-element differences are too many: along a
/// random direction `u`, `(L(x + hu) − L(x − hu)) / 2h` must equal `<grad, u>` (1e-3 relative).
#[test]
fn attention_backward_matches_a_directional_difference_across_query_tiles() {
    // 150 queries span three query tiles of the kernel; keys stored in two segments.
    let (batch, heads, kv_heads, head_dim, seq) = (1u64, 2u64, 1u64, 8u64, 150u32);
    let q_positions = vec![seg(0, seq)];
    let kv_positions = vec![seg(75, 75), seg(0, 75)];
    let q_len = (u64::from(seq) * batch * heads * head_dim) as usize;
    let kv_len = (u64::from(seq) * batch * kv_heads * head_dim) as usize;
    let lse_len = (batch * heads) as usize * seq as usize;
    let fwd = Op::Attention(AttentionAttrs {
        batch,
        heads,
        kv_heads,
        head_dim,
        causal: true,
        scale: 0.3,
        q_positions: q_positions.clone(),
        kv_positions: kv_positions.clone(),
        packed: false,
    });
    let inputs = vec![
        Input::F(values(q_len, 90, 1.0)),
        Input::F(values(kv_len, 91, 1.0)),
        Input::F(values(kv_len, 92, 1.0)),
    ];
    let cot = vec![values(q_len, 93, 1.0), vec![]];
    let out = eval(&fwd, &inputs, &[q_len, lse_len]);
    let bwd = Op::AttentionBwd(AttentionAttrs {
        batch,
        heads,
        kv_heads,
        head_dim,
        causal: true,
        scale: 0.3,
        q_positions,
        kv_positions,
        packed: false,
    });
    let mut bwd_inputs = vec![Input::F(cot[0].clone())];
    bwd_inputs.extend(inputs.iter().cloned());
    bwd_inputs.push(Input::F(out[0].clone()));
    bwd_inputs.push(Input::F(out[1].clone()));
    let grads = eval(&bwd, &bwd_inputs, &[q_len, kv_len, kv_len]);
    for which in 0..3 {
        let Input::F(x) = &inputs[which] else {
            unreachable!()
        };
        let direction = values(x.len(), 94 + which as u64, 1.0);
        let loss_at = |h: f32| {
            let mut moved = inputs.clone();
            moved[which] = Input::F(x.iter().zip(&direction).map(|(a, u)| a + h * u).collect());
            pair(&eval(&fwd, &moved, &[q_len, lse_len]), &cot)
        };
        let numeric = (loss_at(1e-2) - loss_at(-1e-2)) / 2e-2;
        let analytic: f64 = grads[which]
            .iter()
            .zip(&direction)
            .map(|(&g, &u)| f64::from(g) * f64::from(u))
            .sum();
        assert!(
            (numeric - analytic).abs() <= 1e-3 * analytic.abs().max(1.0),
            "input {which}: numeric {numeric} vs analytic {analytic}"
        );
    }
}

/// An op that overwrites its parameter gradients (`accumulate_param_grad` false) ignores what
/// they held and writes, bit for bit, what the adding form writes into zeros; its other
/// outputs (a norm's dx) are unchanged.
#[test]
fn overwriting_parameter_gradients_equals_adding_into_zeros() {
    let (rows, dim, out) = (6usize, 4usize, 3usize);
    let f = |n, seed| Input::F(values(n, seed, 1.0));
    let rstd = Input::F(values(rows, 5, 0.5).iter().map(|v| v + 1.0).collect());
    let cases = [
        (
            Op::MatmulBwdWeight {
                in_dim: dim as u64,
                out_dim: out as u64,
                bias: true,
                accumulate_param_grad: true,
                fp8: None,
            },
            vec![f(rows * out, 1), f(rows * dim, 2)],
            vec![out * dim, out],
        ),
        (
            Op::LayerNormBwd {
                dim: dim as u64,
                bias: true,
                accumulate: false,
                accumulate_param_grad: true,
            },
            vec![
                f(rows * dim, 3),
                f(rows * dim, 4),
                f(dim, 6),
                f(rows, 7),
                rstd.clone(),
            ],
            vec![rows * dim, dim, dim],
        ),
        (
            Op::RmsNormBwd {
                dim: dim as u64,
                accumulate: false,
                accumulate_param_grad: true,
            },
            vec![f(rows * dim, 8), f(rows * dim, 9), f(dim, 10), rstd],
            vec![rows * dim, dim],
        ),
        (
            Op::PositionAddBwd {
                pos: PositionAttrs {
                    batch: 2,
                    dim: dim as u64,
                    positions: vec![seg(1, 3)],
                },
                accumulate_param_grad: true,
            },
            vec![f(rows * dim, 11)],
            vec![5 * dim],
        ),
    ];
    for (op, inputs, lens) in cases {
        let zeros: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n]).collect();
        let stale: Vec<Vec<f32>> = lens.iter().map(|&n| vec![7.5; n]).collect();
        let overwriting = op.with_param_grad_accumulation(false);
        let added = eval_from(&op, &inputs, &zeros);
        let written = eval_from(&overwriting, &inputs, &stale);
        let bits = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
            v.iter()
                .map(|x| x.iter().map(|y| y.to_bits()).collect())
                .collect()
        };
        assert_eq!(bits(&added), bits(&written), "{overwriting:?}");
    }
}

/// Packed q/k/v (one `[rows, (heads + 2 kv_heads)·d]` buffer, `Op::Attention(AttentionAttrs { packed })`)
/// computes what the separate layout does on the split columns, and its backward writes their
/// gradients side by side; `SplitColumns` and `ConcatColumns` are each other's inverse.
#[test]
fn packed_attention_is_the_split_layouts_attention() {
    let (batch, heads, kv_heads, head_dim) = (2u64, 4u64, 2u64, 4u64);
    let positions = vec![seg(0, 5)];
    let rows = (5 * batch) as usize;
    let widths = vec![heads * head_dim, kv_heads * head_dim, kv_heads * head_dim];
    let total: usize = widths.iter().sum::<u64>() as usize;
    let op = |backward: bool, packed: bool| {
        let (q_positions, kv_positions) = (positions.clone(), positions.clone());
        let scale = 0.5;
        if backward {
            Op::AttentionBwd(AttentionAttrs {
                batch,
                heads,
                kv_heads,
                head_dim,
                causal: true,
                scale,
                q_positions,
                kv_positions,
                packed,
            })
        } else {
            Op::Attention(AttentionAttrs {
                batch,
                heads,
                kv_heads,
                head_dim,
                causal: true,
                scale,
                q_positions,
                kv_positions,
                packed,
            })
        }
    };
    let qkv = values(rows * total, 31, 1.0);
    let part_lens: Vec<usize> = widths.iter().map(|&w| rows * w as usize).collect();
    let split = Op::SplitColumns {
        widths: widths.clone(),
    };
    let parts = eval(&split, &[Input::F(qkv.clone())], &part_lens);
    let concat = Op::ConcatColumns {
        widths: widths.clone(),
    };
    let parts_in: Vec<Input> = parts.iter().cloned().map(Input::F).collect();
    assert_eq!(eval(&concat, &parts_in, &[qkv.len()])[0], qkv);
    // Column block 1 of row 3 is k's row 3.
    let (q_w, kv_w) = (widths[0] as usize, widths[1] as usize);
    assert_eq!(
        parts[1][3 * kv_w..4 * kv_w],
        qkv[3 * total + q_w..3 * total + q_w + kv_w]
    );

    let (o_len, lse_len) = (part_lens[0], (batch * heads * 5) as usize);
    let unpacked = eval(&op(false, false), &parts_in, &[o_len, lse_len]);
    let packed = eval(
        &op(false, true),
        &[Input::F(qkv.clone())],
        &[o_len, lse_len],
    );
    assert_eq!(packed, unpacked);
    let d_o = values(o_len, 32, 1.0);
    let stats = [Input::F(unpacked[0].clone()), Input::F(unpacked[1].clone())];
    let mut ins = vec![Input::F(d_o.clone())];
    ins.extend(parts_in.iter().cloned());
    ins.extend(stats.iter().cloned());
    let grads = eval(&op(true, false), &ins, &part_lens);
    let grads_in: Vec<Input> = grads.into_iter().map(Input::F).collect();
    let joined = eval(&concat, &grads_in, &[qkv.len()]);
    let packed_ins = [
        Input::F(d_o.clone()),
        Input::F(qkv.clone()),
        stats[0].clone(),
        stats[1].clone(),
    ];
    let dqkv = eval(&op(true, true), &packed_ins, &[qkv.len()]);
    assert_eq!(dqkv, joined);
    // And it is the gradient of the packed forward.
    let cot = vec![d_o, vec![]];
    let numeric = op_gradient(
        &op(false, true),
        &[Input::F(qkv)],
        &[o_len, lse_len],
        &cot,
        0,
    );
    assert_gradient("dqkv", &numeric, &dqkv[0]);
}
