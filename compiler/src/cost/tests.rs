//! The cost model against the papers' worked numbers and its own invariants.

use super::activation::{korthikanti_table2, Keeps, LayerDims, LayerRecompute, Table2};
use super::model_state::{model_state_bytes, node_params};
use super::schedule::{bubble_fraction, chunk_microbatches_in_flight, microbatches_for_bubble};
use super::testspec::{build, Dims, Plan};
use super::*;
use crate::spec::{LossScale, PipelineSchedule, Precision, Recompute, ZeroStage};

fn gb(x: f64) -> f64 {
    (x / 1e9 * 10.0).round() / 10.0
}

#[test]
fn zero_paper_7_5b_on_64_gpus() {
    // Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, K = 12, N_d = 64.
    let psi = 7.5e9;
    let mixed = (2.0, 2.0, 12.0);
    let at = |z| gb(model_state_bytes(psi, mixed, z, 64).total());
    assert_eq!(at(ZeroStage::Zero0), 120.0);
    assert_eq!(at(ZeroStage::Zero1), 31.4);
    assert_eq!(at(ZeroStage::Zero2), 16.6);
    assert_eq!(at(ZeroStage::Zero3), 1.9);
}

#[test]
fn bytes_per_param_by_precision_and_optimizer() {
    let adam = crate::spec::Optimizer::AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let sgd = crate::spec::Optimizer::Sgd {
        lr: 1e-3,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    use super::model_state::bytes_per_param;
    let z0 = ZeroStage::Zero0;
    // bf16: bf16 weights, fp32 gradients, fp32 master beside Adam's m and v.
    assert_eq!(
        bytes_per_param(Precision::Bf16, &adam, z0),
        (2.0, 4.0, 12.0)
    );
    // fp32 without ZeRO: the parameter is its own master.
    assert_eq!(bytes_per_param(Precision::Fp32, &adam, z0), (4.0, 4.0, 8.0));
    assert_eq!(
        bytes_per_param(Precision::Fp32, &adam, ZeroStage::Zero1),
        (4.0, 4.0, 12.0)
    );
    assert_eq!(bytes_per_param(Precision::Bf16, &sgd, z0), (2.0, 4.0, 8.0));
    // ZeRO-3 gathers the weights per use.
    let z3 = ZeroStage::Zero3;
    assert_eq!(
        bytes_per_param(Precision::Bf16, &adam, z3),
        (0.0, 4.0, 12.0)
    );
}

/// GPT-3 175B as in Korthikanti et al. 2022: s = 2048, h = 12288, a = 96, t = 8, b = 1.
fn gpt3(t: f64, sp: bool) -> LayerDims {
    LayerDims {
        s: 2048.0,
        b: 1.0,
        h: 12288.0,
        heads: 96.0,
        kv_heads: 96.0,
        head_dim: 128.0,
        ffn: 4.0 * 12288.0,
        gated: false,
        qk_norm: false,
        t,
        sp,
        cp: 1.0,
        elem: 2.0,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

#[test]
fn korthikanti_table2_from_kept_tensors() {
    let (s, b, h, a) = (2048.0, 1.0, 12288.0, 96.0);
    let paper = Keeps::PAPER;
    let none = LayerRecompute::None;
    let sel = LayerRecompute::Selective;
    let rows = [
        (gpt3(1.0, false), none, Table2::NoParallelism, 1.0),
        (gpt3(8.0, false), none, Table2::Tensor, 8.0),
        (gpt3(8.0, true), none, Table2::TensorSequence, 8.0),
        (gpt3(8.0, false), sel, Table2::TensorSelective, 8.0),
        (gpt3(8.0, true), sel, Table2::TensorSequenceSelective, 8.0),
        (
            gpt3(8.0, false),
            LayerRecompute::Full,
            Table2::FullRecompute,
            8.0,
        ),
    ];
    for (dims, recompute, row, t) in rows {
        let ours = dims.layer(paper, recompute);
        let theirs = korthikanti_table2(s, b, h, a, t, row);
        assert!(close(ours, theirs), "{row:?}: {ours} vs {theirs}");
    }
}

#[test]
fn korthikanti_gpt3_stated_numbers() {
    let (s, b, h, a) = (2048.0, 1.0, 12288.0, 96.0);
    // "For GPT-3, 5as/h = 80", against 34 for the rest of the layer.
    assert_eq!(5.0 * a * s / h, 80.0);
    let sbh = s * b * h;
    let none = korthikanti_table2(s, b, h, a, 8.0, Table2::Tensor);
    assert!(close(none / sbh, 10.0 + 3.0 + 10.0));
    // Selective recompute keeps 34 of the 114 units: a 70% saving for GPT-3.
    let full = korthikanti_table2(s, b, h, a, 1.0, Table2::NoParallelism);
    let sel = korthikanti_table2(s, b, h, a, 1.0, Table2::TensorSequenceSelective);
    assert_eq!(((1.0 - sel / full) * 100.0).round(), 70.0);
    // TP+SP+selective for t = 8: 34/8 sbh = 107 MB per layer.
    let tsp = korthikanti_table2(s, b, h, a, 8.0, Table2::TensorSequenceSelective);
    assert_eq!((tsp / 1e6).round(), 107.0);
}

#[test]
fn parc_attention_keeps_lse_not_scores() {
    // No dropout masks and no scores but the fp32 log-sum-exp (4 bytes per head and token); the
    // q/k/v and MLP inputs kept gathered under SP (2 + 2 units of sbh instead of (2 + 2)/t):
    // 28/t + 4 units of sbh.
    let d = gpt3(8.0, true);
    let sbh = d.s * d.b * d.h;
    let lse = 4.0 * d.s * d.b * 96.0 / 8.0;
    let parc = d.layer(Keeps::PARC, LayerRecompute::None);
    assert!(close(parc, (28.0 / 8.0 + 4.0) * sbh + lse));
    // Selective recompute rebuilds the attention output and lse: 2/t units fewer and no lse.
    let sel = d.layer(Keeps::PARC, LayerRecompute::Selective);
    assert!(close(sel, (26.0 / 8.0 + 4.0) * sbh));
}

#[test]
fn qk_norm_keeps_the_unnormalized_q_and_k_and_their_rstd() {
    // Qwen3-8B's attention (32 heads, 8 kv heads, head dim 128) on tp 8 without SP: q and k
    // before their norms (a + k)·d/t elements a token, and one f32 rstd per local head.
    let plain = LayerDims {
        h: 4096.0,
        heads: 32.0,
        kv_heads: 8.0,
        ..gpt3(8.0, false)
    };
    let normed = LayerDims {
        qk_norm: true,
        ..plain
    };
    let sb = plain.s * plain.b;
    let extra = sb * (32.0 + 8.0) * 128.0 / 8.0 * 2.0 + sb * (32.0 + 8.0) / 8.0 * 4.0;
    for recompute in [LayerRecompute::None, LayerRecompute::Selective] {
        let more =
            normed.attention(Keeps::PARC, recompute) - plain.attention(Keeps::PARC, recompute);
        assert!(close(more, extra), "{recompute:?}: {more} vs {extra}");
    }
    // Full recompute keeps the layer's input alone, normalized or not.
    let full = LayerRecompute::Full;
    assert!(close(
        normed.layer(Keeps::PARC, full),
        plain.layer(Keeps::PARC, full)
    ));
}

#[test]
fn microbatches_in_flight_per_schedule() {
    let (p, m) = (4, 8);
    for s in 0..p {
        assert_eq!(
            chunk_microbatches_in_flight(PipelineSchedule::Gpipe, p, 1, m, s),
            m
        );
        assert_eq!(
            chunk_microbatches_in_flight(PipelineSchedule::OneFOneB, p, 1, m, s),
            p - s
        );
    }
    // Fewer microbatches than stages: all of them.
    assert_eq!(
        chunk_microbatches_in_flight(PipelineSchedule::OneFOneB, 8, 1, 3, 0),
        3
    );
    // Interleaved stage 0 holds 1 + (p−1)/(p·v) times 1F1B's p microbatches of its layers.
    let v = 2;
    let sched = PipelineSchedule::Interleaved { virtual_stages: v };
    let chunks = chunk_microbatches_in_flight(sched, p, v, m, 0);
    let stage_units = f64::from(chunks) / f64::from(v);
    let expected = f64::from(p) * (1.0 + f64::from(p - 1) / f64::from(p * v));
    assert!(close(stage_units, expected), "{stage_units} vs {expected}");
    // The last stage runs one chunk-microbatch more than its (v − 1)·p warm-up.
    assert_eq!(chunk_microbatches_in_flight(sched, p, v, m, p - 1), p + 1);
}

/// The closed forms the report uses for GPipe and 1F1B, and interleaving's count on its first
/// 2p microbatches, count what the lowering's whole unit order holds in flight, on every stage.
#[test]
fn microbatches_in_flight_match_the_whole_unit_order() {
    use super::schedule::{in_flight_on_order, microbatches_in_flight};
    for v in 2..=4 {
        let schedule = PipelineSchedule::Interleaved { virtual_stages: v };
        for p in 2..=6 {
            for m in (1..=8).map(|k| k * p) {
                for s in 0..p {
                    assert_eq!(
                        microbatches_in_flight(schedule, p, v, m, s),
                        in_flight_on_order(schedule, p, v, m, s),
                        "interleaved v {v} p {p} m {m} stage {s}"
                    );
                }
            }
        }
    }
    for schedule in [PipelineSchedule::Gpipe, PipelineSchedule::OneFOneB] {
        for p in 1..=6 {
            for m in 1..=12 {
                for s in 0..p {
                    assert_eq!(
                        microbatches_in_flight(schedule, p, 1, m, s),
                        in_flight_on_order(schedule, p, 1, m, s),
                        "{schedule:?} p {p} m {m} stage {s}"
                    );
                }
            }
        }
    }
}

#[test]
fn bubble_fractions() {
    assert_eq!(bubble_fraction(PipelineSchedule::OneFOneB, 1, 1, 8), 0.0);
    assert!(close(
        bubble_fraction(PipelineSchedule::Gpipe, 4, 1, 8),
        3.0 / 11.0
    ));
    assert!(close(
        bubble_fraction(PipelineSchedule::Interleaved { virtual_stages: 2 }, 4, 2, 8),
        3.0 / 19.0
    ));
    assert_eq!(
        microbatches_for_bubble(PipelineSchedule::OneFOneB, 4, 1, 0.25),
        10
    );
    // Interleaving needs a multiple of p: 3/(2m+3) < 0.25 from m = 5, so 8.
    assert_eq!(
        microbatches_for_bubble(
            PipelineSchedule::Interleaved { virtual_stages: 2 },
            4,
            2,
            0.25
        ),
        8
    );
}

fn llama70b_64() -> Spec {
    build(
        &Dims::llama3_70b(),
        &Plan {
            dp: 1,
            pp: 8,
            tp: 8,
            zero: ZeroStage::Zero1,
            schedule: PipelineSchedule::Interleaved { virtual_stages: 5 },
            microbatches: 16,
            micro_batch: 1,
            recompute: Recompute::Selective,
            sp: true,
            precision: Precision::Bf16,
            ..Plan::default()
        },
    )
}

#[test]
fn llama3_70b_parameters_and_split() {
    let spec = llama70b_64();
    let report = estimate(&spec);
    // Llama-3-70B has 70.55B parameters.
    assert_eq!((report.params_total as f64 / 1e8).round(), 706.0);
    assert_eq!(report.roles.len(), 8);
    // Every stage holds 10 of the 80 layers, in 5 chunks of 2.
    for role in &report.roles {
        assert_eq!(role.layers, 10);
        assert_eq!(role.chunks.len(), 5);
    }
    // tp 8 splits everything but the norms: the stages together hold ~1/8 of the model.
    let held: u64 = report.roles.iter().map(|r| r.params).sum();
    let ratio = held as f64 * 8.0 / report.params_total as f64;
    assert!((1.0..1.001).contains(&ratio), "{ratio}");
    // bf16 + AdamW without dp sharding: 18 bytes per parameter (bf16 weights, fp32 gradients,
    // fp32 master, m and v).
    let r0 = &report.roles[0];
    assert_eq!(
        r0.memory.weights + r0.memory.gradients + r0.memory.optimizer,
        18 * r0.params
    );
    assert!(r0.memory.total() < 80 << 30, "{}", gib(r0.memory.total()));
    assert!(close(report.bubble_fraction, 7.0 / (5.0 * 16.0 + 7.0)));
}

#[test]
fn params_per_node_match_the_layer_shapes() {
    let d = Dims::tiny();
    let spec = build(&d, &Plan::default());
    let by_kind = |name: &str| {
        spec.model
            .nodes
            .iter()
            .find(|n| n.name == name)
            .map(|n| node_params(&spec, &n.kind))
    };
    // wqkv wo 4·16·16 + biases 3·16 + 16.
    assert_eq!(by_kind("blocks.0.attn"), Some(4 * 256 + 64));
    // fc, proj 2·64·16 + biases 64 + 16.
    assert_eq!(by_kind("blocks.0.mlp"), Some(2 * 1024 + 80));
    assert_eq!(by_kind("head"), Some(0));
    // Per-head q/k norms add one head_dim weight each (head_dim 16 / 4 heads = 4).
    let mut normed = spec.clone();
    for n in &mut normed.model.nodes {
        if let LayerKind::Attention { qk_norm, .. } = &mut n.kind {
            *qk_norm = Some(1e-6);
        }
    }
    let attn = normed
        .model
        .nodes
        .iter()
        .find(|n| n.name == "blocks.0.attn");
    let count = attn.map(|n| node_params(&normed, &n.kind));
    assert_eq!(count, Some(4 * 256 + 64 + 2 * 4));
}

#[test]
fn tied_head_on_another_stage_holds_a_copy() {
    let d = Dims::tiny();
    let spec = build(
        &d,
        &Plan {
            pp: 2,
            ..Plan::default()
        },
    );
    let report = estimate(&spec);
    let table = d.vocab * d.dim;
    let total_held: u64 = report.roles.iter().map(|r| r.params).sum();
    assert_eq!(total_held, report.params_total + table);
}

#[test]
fn zero_shards_over_dp_and_cp() {
    let d = Dims::tiny();
    let plan = |zero| Plan {
        dp: 2,
        cp: 2,
        zero,
        ..Plan::default()
    };
    let role = |zero| estimate(&build(&d, &plan(zero))).roles[0].clone();
    let (z0, z3) = (role(ZeroStage::Zero0), role(ZeroStage::Zero3));
    let (p, z0, z3) = (z0.params, z0.memory, z3.memory);
    // fp32: the parameter is its own master without ZeRO; ZeRO-3 shards the master, the
    // optimizer state and the gradients over dp × cp = 4 and gathers the weights per use.
    assert_eq!(
        (z0.weights, z0.gradients, z0.optimizer),
        (4 * p, 4 * p, 8 * p)
    );
    assert_eq!(z3.optimizer, (12 * p).div_ceil(4));
    assert_eq!(z3.gradients, z0.gradients.div_ceil(4));
    assert_eq!(z3.weights, 0);
}

#[test]
fn fp16_activations_are_counted_in_f32_as_the_lowered_plan_stores_them() {
    // Only bf16 runs store activations in 16 bits; a formula that counted fp16's in 16 bits said
    // GPT-NeoX-20B's published fp16 plan fits an A100 40GB at 32 GiB where its lowered plan
    // needs 43 GiB.
    let activations = |precision: Precision| {
        let plan = Plan {
            tp: 2,
            pp: 2,
            precision,
            ..Plan::default()
        };
        estimate(&build(&Dims::llama3_70b(), &plan)).roles[0]
            .memory
            .activations
    };
    let loss_scale = LossScale::Static { scale: 1024.0 };
    let fp16 = activations(Precision::Fp16 { loss_scale }) as f64;
    let (fp32, bf16) = (
        activations(Precision::Fp32) as f64,
        activations(Precision::Bf16) as f64,
    );
    assert!((fp16 / fp32 - 1.0).abs() < 1e-3, "{fp16} {fp32}");
    assert!(fp16 > 1.9 * bf16, "{fp16} {bf16}");
}

#[test]
fn recompute_lowers_activations_and_adds_flops() {
    let d = Dims::llama3_70b();
    let base = Plan {
        tp: 8,
        pp: 8,
        precision: Precision::Bf16,
        ..Plan::default()
    };
    let est = |recompute: Recompute| {
        let r = estimate(&build(
            &d,
            &Plan {
                recompute,
                ..base.clone()
            },
        ));
        (r.roles[1].memory.activations, r.roles[1].flops)
    };
    let (none, f_none) = est(Recompute::None);
    let (sel, f_sel) = est(Recompute::Selective);
    let (full, f_full) = est(Recompute::Full);
    assert!(full < sel && sel < none, "{full} {sel} {none}");
    assert_eq!(f_none.recompute, 0.0);
    assert!(f_sel.recompute > 0.0 && f_sel.recompute < f_full.recompute);
    // Full recompute re-runs the whole forward of a middle stage.
    assert!(close(f_full.recompute, f_full.forward));
    assert!(close(f_none.backward, 2.0 * f_none.forward));
}

#[test]
fn flops_follow_6n_plus_attention() {
    // One stage, no parallelism: total = 3 × forward, forward = 2N·T + 4·L·d·s·T.
    let d = Dims::tiny();
    let spec = build(&d, &Plan::default());
    let report = estimate(&spec);
    let tokens = 4.0 * 2.0 * 8.0;
    let matmul: f64 = spec
        .model
        .nodes
        .iter()
        .map(|n| match n.kind {
            LayerKind::Attention { .. } | LayerKind::Mlp { .. } => {
                // Weights only, no biases.
                (node_params(&spec, &n.kind)
                    - if matches!(n.kind, LayerKind::Attention { .. }) {
                        64
                    } else {
                        80
                    }) as f64
            }
            LayerKind::Linear { .. } => (d.vocab * d.dim) as f64,
            _ => 0.0,
        })
        .sum();
    let forward = 2.0 * matmul * tokens + 4.0 * f64::from(d.layers) * 16.0 * 8.0 * tokens;
    assert!(close(report.roles[0].flops.forward, forward));
    assert!(close(report.roles[0].flops.total(), 3.0 * forward));
}

#[test]
fn comm_volumes_per_axis() {
    let d = Dims::tiny();
    let spec = build(
        &d,
        &Plan {
            dp: 4,
            tp: 2,
            pp: 2,
            cp: 2,
            gpus_per_node: 8,
            ..Plan::default()
        },
    );
    let report = estimate(&spec);
    let r0 = &report.roles[0];
    let axis = |a| r0.comm.iter().find(|c| c.axis == a).cloned();
    let dp = axis(crate::spec::Axis::Dp).unwrap();
    // Ring all-reduce over dp·cp = 8 of the fp32 gradients.
    assert!(close(dp.bytes, 2.0 * 7.0 / 8.0 * r0.params as f64 * 4.0));
    assert!(dp.crosses_nodes);
    let tp = axis(crate::spec::Axis::Tp).unwrap();
    assert!(!tp.crosses_nodes);
    // Stage 0 (2 layers + embedding): 4 + 4 + 1 all-reduces of s/cp·b·h fp32 per microbatch.
    let act = 4.0 * 2.0 * 16.0 * 4.0;
    assert!(close(tp.bytes, 9.0 * 4.0 * 2.0 * 0.5 * act));
    // One boundary: forward sends only, 4 microbatches.
    let pp = axis(crate::spec::Axis::Pp).unwrap();
    assert!(close(pp.bytes, 4.0 * act));
    assert!(axis(crate::spec::Axis::Cp).is_some());
}

#[test]
fn diagnose_memory_over_capacity_names_savings() {
    let d = Dims::llama3_70b();
    let spec = build(
        &d,
        &Plan {
            dp: 8,
            tp: 8,
            pp: 1,
            microbatches: 2,
            micro_batch: 1,
            precision: Precision::Bf16,
            ..Plan::default()
        },
    );
    let report = estimate(&spec);
    let diags = diagnose(&spec, &report);
    let e = diags.items.iter().find(|d| d.code == "E0701").unwrap();
    assert!(e.message.contains("stage 0 needs"), "{}", e.message);
    assert_eq!(e.primary_span(), Some(spec.parallel.span));
    assert!(e.labels.iter().any(|l| l.span == spec.cluster.span));
    let notes = e.notes.join("\n");
    assert!(notes.contains("biggest terms: optimizer"), "{notes}");
    assert!(notes.contains("zero = 3 saves"), "{notes}");
    assert!(notes.contains("recompute = full saves"), "{notes}");
    assert!(e.help.as_deref().unwrap_or("").contains("saves"));
    // The savings quoted are the model's own: zero = 3 gathers the 2Ψ of bf16 weights per use
    // and shards the other 16Ψ over 8.
    let r0 = &report.roles[0];
    let state = r0.memory.weights + r0.memory.gradients + r0.memory.optimizer;
    let z3 = state - (r0.memory.gradients + r0.memory.optimizer) / 8;
    assert!(
        notes.contains(&format!(
            "zero = 3 saves {}",
            gib(z3 + r0.memory.buffers
                - estimate(&{
                    let mut s = spec.clone();
                    s.parallel.zero = ZeroStage::Zero3;
                    s
                })
                .roles[0]
                    .memory
                    .buffers)
        )),
        "{notes}"
    );
}

#[test]
fn diagnose_warnings() {
    let d = Dims::tiny();
    let spec = build(
        &d,
        &Plan {
            pp: 4,
            microbatches: 4,
            zero: ZeroStage::Zero3,
            ..Plan::default()
        },
    );
    let diags = diagnose(&spec, &estimate(&spec));
    let codes: Vec<&str> = diags.items.iter().map(|d| d.code).collect();
    assert_eq!(codes, vec!["W0701", "W0702"]);
    let help = diags.items[0].help.clone().unwrap_or_default();
    assert!(
        help.starts_with("raise microbatches to 10 for under 25%"),
        "{help}"
    );
    assert!(!diags.has_errors());

    let spec = build(
        &d,
        &Plan {
            zero: ZeroStage::Zero1,
            ..Plan::default()
        },
    );
    let codes: Vec<&str> = diagnose(&spec, &estimate(&spec))
        .items
        .iter()
        .map(|d| d.code)
        .collect();
    assert_eq!(codes, vec!["W0703"]);
    let clean = build(&d, &Plan::default());
    assert!(diagnose(&clean, &estimate(&clean)).is_empty());
}

#[test]
fn report_serializes_to_json() {
    let spec = build(&Dims::tiny(), &Plan::default());
    let json = serde_json::to_value(estimate(&spec)).unwrap();
    assert!(json["roles"][0]["memory"]["activations"].as_u64().unwrap() > 0);
    assert_eq!(json["roles"][0]["role"], "stage 0");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
    /// Any plan, valid or not, gets a finite report and diagnostics without panicking.
    #[test]
    fn any_plan_is_estimated_without_panic(
        dp in 1u32..=8, pp in 1u32..=8, cp in 1u32..=4, tp in 1u32..=8,
        zero in 0u32..=3, schedule in 0u32..=2, v in 1u32..=4,
        microbatches in 0u32..=40, micro_batch in 0u64..=4, layers in 0u32..=12,
        recompute in 0u32..=2, sp in proptest::bool::ANY, fp32 in proptest::bool::ANY,
    ) {
        let dims = Dims { layers, ..Dims::tiny() };
        let plan = Plan {
            dp, pp, cp, tp,
            zero: [ZeroStage::Zero0, ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3][zero as usize],
            schedule: match schedule {
                0 => PipelineSchedule::Gpipe,
                1 => PipelineSchedule::OneFOneB,
                _ => PipelineSchedule::Interleaved { virtual_stages: v },
            },
            microbatches,
            micro_batch,
            recompute: [Recompute::None, Recompute::Selective, Recompute::Full][recompute as usize].clone(),
            sp,
            precision: if fp32 { Precision::Fp32 } else { Precision::Bf16 },
            ..Plan::default()
        };
        let spec = build(&dims, &plan);
        let report = estimate(&spec);
        proptest::prop_assert_eq!(report.roles.len() as u32, pp);
        for role in &report.roles {
            proptest::prop_assert!(role.flops.total().is_finite());
            proptest::prop_assert!(role.compute_seconds.is_finite());
            proptest::prop_assert!(role.comm.iter().all(|c| c.bytes.is_finite() && c.seconds.is_finite()));
        }
        proptest::prop_assert!((0.0..1.0).contains(&report.bubble_fraction));
        let _ = diagnose(&spec, &report);
    }
}

#[test]
fn diagnose_combines_changes_when_none_fits_alone() {
    let spec = build(
        &Dims::llama3_70b(),
        &Plan {
            dp: 8,
            pp: 8,
            tp: 1,
            microbatches: 16,
            micro_batch: 1,
            precision: Precision::Bf16,
            ..Plan::default()
        },
    );
    let diags = diagnose(&spec, &estimate(&spec));
    let e = diags.items.iter().find(|d| d.code == "E0701").unwrap();
    let help = e.help.clone().unwrap_or_default();
    assert!(
        help.starts_with("no single change fits; together ") && help.contains(" fit: peak "),
        "{help}"
    );
    // Activations dominate, so the greedy combination starts with full recompute.
    assert!(help.contains("recompute = full"), "{help}");
}

/// Stages hold the layers `chunk_layers` gives them, and `balance = auto` relieves the head's
/// stage: GPT-2 124M on pp 4 (interleaved, 2 chunks per stage too) has a lighter most loaded
/// stage than the even split, and every chunk keeps a layer.
#[test]
fn stages_hold_the_listed_layers_and_auto_lightens_the_most_loaded() {
    use crate::spec::Balance;
    let given = build(
        &Dims::tiny(),
        &Plan {
            pp: 2,
            balance: Balance::Given,
            layers: vec![3, 1],
            ..Plan::default()
        },
    );
    let layers: Vec<u32> = estimate(&given).roles.iter().map(|r| r.layers).collect();
    assert_eq!(layers, vec![3, 1]);
    for schedule in [
        PipelineSchedule::OneFOneB,
        PipelineSchedule::Interleaved { virtual_stages: 2 },
    ] {
        let plan = |balance| Plan {
            pp: 4,
            microbatches: 8,
            schedule,
            balance,
            ..Plan::default()
        };
        let most = |spec: &Spec| {
            let report = estimate(spec);
            report
                .roles
                .iter()
                .map(|r| r.flops.total())
                .fold(0.0, f64::max)
        };
        let even = build(&Dims::gpt2_124m(), &plan(Balance::Even));
        let auto = build(&Dims::gpt2_124m(), &plan(Balance::Auto));
        assert!(auto.parallel.chunk_layers.iter().all(|n| *n >= 1));
        assert_eq!(auto.parallel.chunk_layers.iter().sum::<u32>(), 12);
        assert!(
            most(&auto) < 0.8 * most(&even),
            "{schedule:?}: {:?}",
            auto.parallel.chunk_layers
        );
    }
}

#[test]
fn small_amounts_of_memory_print_in_a_unit_that_shows_them() {
    use super::diagnose::gib;
    assert_eq!(gib(80 << 30), "80.0 GiB");
    assert_eq!(gib(0), "0.0 GiB");
    // A GPU of 2 MB (E0701's "has" side) read as 0.0 GiB.
    assert_eq!(gib(2_000_000), "1.9 MiB");
    assert_eq!(gib(2048), "2.0 KiB");
}
