use super::*;
use crate::ir::op::{Act, ActAttrs, EmbeddingAttrs, PositionAttrs, Segment};

fn attention(packed: bool) -> AttentionAttrs {
    AttentionAttrs {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        causal: true,
        scale: 0.5,
        q_positions: vec![Segment { start: 0, len: 6 }],
        kv_positions: vec![Segment { start: 0, len: 6 }, Segment { start: 6, len: 4 }],
        packed,
    }
}

#[test]
fn names_are_unique_and_match_the_serialized_tag() {
    let mut names: Vec<&str> = Opcode::ALL.iter().map(|o| o.name()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), Opcode::ALL.len());
    let op = Op::SwiGluBwd;
    let json = serde_json::to_value(&op).unwrap();
    assert_eq!(json["op"], op.opcode().name());
    let op = Op::Attention(attention(true));
    let json = serde_json::to_value(&op).unwrap();
    assert_eq!(json["op"], "attention");
    assert_eq!(
        json["heads"], 4,
        "the shared attributes serialize flattened: {json}"
    );
}

#[test]
fn text_form_flattens_shared_attributes() {
    let op = Op::PositionAddBwd {
        pos: PositionAttrs {
            batch: 2,
            dim: 16,
            positions: vec![Segment { start: 0, len: 8 }],
        },
        accumulate_param_grad: false,
    };
    assert_eq!(
        format!("{op:?}"),
        "PositionAddBwd { batch: 2, dim: 16, positions: [Segment { start: 0, len: 8 }], \
         accumulate_param_grad: false }"
    );
    let op = Op::ActivationBwd(ActAttrs { act: Act::Gelu });
    assert_eq!(format!("{op:?}"), "ActivationBwd { act: Gelu }");
    assert_eq!(format!("{:?}", Op::SumSquares), "SumSquares");
}

#[test]
fn optional_operands_follow_their_flags() {
    let norm = |bias| {
        Op::LayerNorm {
            dim: 4,
            eps: 1e-5,
            bias,
        }
        .signature()
    };
    assert_eq!((norm(true).inputs.len(), norm(false).inputs.len()), (3, 2));
    let sgd = |momentum| {
        Op::Sgd {
            momentum,
            weight_decay: 0.0,
        }
        .signature()
    };
    assert_eq!((sgd(0.0).outputs.len(), sgd(0.9).outputs.len()), (1, 2));
    let roles = |s: &Signature| s.inputs.iter().map(|o| o.role).collect::<Vec<_>>();
    assert_eq!(
        roles(&Op::AttentionBwd(attention(false)).signature()),
        ["do", "q", "k", "v", "o", "lse"]
    );
    assert_eq!(
        roles(&Op::AttentionBwd(attention(true)).signature()),
        ["do", "qkv", "o", "lse"]
    );
}

#[test]
fn writes_say_what_the_planner_may_skip() {
    let bwd = |accumulate, accumulate_param_grad| Op::LayerNormBwd {
        dim: 4,
        bias: true,
        accumulate,
        accumulate_param_grad,
    };
    let writes = |op: Op| {
        op.signature()
            .outputs
            .iter()
            .map(|o| o.write)
            .collect::<Vec<_>>()
    };
    use Write::{Accumulate, Overwrite};
    assert_eq!(writes(bwd(true, false)), [Accumulate, Overwrite, Overwrite]);
    assert_eq!(
        writes(bwd(false, true)),
        [Overwrite, Accumulate, Accumulate]
    );
    let ce = Op::CrossEntropy {
        vocab: 8,
        scale: 1.0,
    };
    assert_eq!(ce.in_place().collect::<Vec<_>>(), [(0, 0)]);
    assert!(ce.accumulates(1) && !ce.accumulates(0));
    let adam = Op::AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    assert!(adam
        .signature()
        .outputs
        .iter()
        .all(|o| o.write == Write::Update));
    assert!(!adam.accumulates(0));
}

#[test]
fn rows_come_from_attributes_or_the_first_row_shaped_input() {
    let s = Op::AttentionBwd(attention(false)).signature();
    assert_eq!((s.rows, s.kv_rows), (Some(12), Some(20)));
    let s = Op::Matmul {
        in_dim: 3,
        out_dim: 5,
        bias: true,
        act: None,
        residual: false,
        swiglu: false,
        fp8: None,
    }
    .signature();
    assert_eq!(s.rows_from_inputs(|i| [21, 15, 5][i]), Some(7));
    let op = Op::MatmulBwdWeight {
        in_dim: 3,
        out_dim: 5,
        bias: false,
        accumulate_param_grad: false,
        fp8: None,
    };
    assert_eq!(op.flops(7.0, FlopCount::Model), 2.0 * 7.0 * 15.0);
}

#[test]
fn causal_attention_executes_only_earlier_keys() {
    let seg = |start, len| vec![Segment { start, len }];
    let pairs = |causal, q, kv| {
        let a = AttentionAttrs {
            batch: 1,
            heads: 1,
            head_dim: 1,
            causal,
            q_positions: q,
            kv_positions: kv,
            ..attention(false)
        };
        Op::Attention(a).flops(0.0, FlopCount::Executed) / 4.0
    };
    assert_eq!(pairs(false, seg(0, 4), seg(0, 4)), 16.0);
    // 1 + 2 + 3 + 4 pairs.
    assert_eq!(pairs(true, seg(0, 4), seg(0, 4)), 10.0);
    // A context-parallel chunk: queries 4..8 see all of keys 0..4.
    assert_eq!(pairs(true, seg(4, 4), seg(0, 4)), 16.0);
    assert_eq!(pairs(true, seg(0, 4), seg(4, 4)), 0.0);
    // The model's count ignores the mask and doubles the backward.
    let a = attention(false);
    let model = Op::Attention(a.clone()).flops(0.0, FlopCount::Model);
    assert_eq!(model, 4.0 * (2 * 4 * 8) as f64 * 6.0 * 10.0);
    assert_eq!(
        Op::AttentionBwd(a).flops(0.0, FlopCount::Model),
        2.0 * model
    );
}

#[test]
fn every_family_has_an_op_and_bytes_count_accumulation_twice() {
    for family in [
        Family::Embedding,
        Family::Norm,
        Family::Matmul,
        Family::Attention,
        Family::Elementwise,
        Family::DataMovement,
        Family::Loss,
        Family::Optimizer,
    ] {
        assert!(
            Opcode::ALL.iter().any(|o| o.family() == family),
            "{family:?}"
        );
    }
    let s = Op::SumSquares.signature();
    assert_eq!(s.bytes_touched(25, |_| 100.0, |_| 4.0), 108.0);
    // AdamW reads g and coef, and reads and writes param, m and v.
    let adam = Op::AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let s = adam.signature();
    assert_eq!(s.bytes_touched(0, |i| [400.0, 4.0][i], |_| 400.0), 2804.0);
    // An embedding's table and its gradient are touched at the looked-up rows only: 8 of
    // 1000 (ids 4 bytes a row, 64 floats of 4 bytes a row).
    let lookup = EmbeddingAttrs {
        vocab_start: 0,
        vocab_local: 1000,
        dim: 64,
    };
    let table = 1000.0 * 256.0;
    let forward = Op::Embedding(lookup.clone()).signature();
    assert_eq!(
        forward.bytes_touched(8, |i| [32.0, table][i], |_| 8.0 * 256.0),
        32.0 + 2.0 * 8.0 * 256.0
    );
    let backward = Op::EmbeddingBwd(lookup).signature();
    assert_eq!(
        backward.bytes_touched(8, |i| [32.0, 8.0 * 256.0][i], |_| table),
        32.0 + 3.0 * 8.0 * 256.0
    );
}
