//! End-to-end equivalence through the real executor (`parc_runtime::exec::train`: one thread
//! per rank, local comm, CPU backend, sampler): every parallel plan of a tiny model gives the
//! single-rank run's (same model, same global batch) per-step losses and gradient norms (1e-5
//! relative, 5 steps) and final parameters: within 1e-5 relative but at least 1e-5 absolute
//! under AdamW, whose normalised update turns float noise in near-zero gradients (the key bias's
//! is zero in exact arithmetic) into parameter differences of ~1e-6 between plans; within 1e-5
//! relative plus 1e-6 under SGD with momentum (`parameters_match_under_sgd`).
//!
//! CI runs the named cases and every 37th plan of the matrix (`matrix_sample`); the whole matrix
//! runs with `PARC_EQUIVALENCE=full` or `-- --ignored` (`bench/equivalence.sh`).
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;

use fixtures::{
    sized_spec_variant, spec_variant, tiny_dims, train_cpu, Dims, PlanChoice, Split, TinyModel,
    Variant,
};
use parc_compiler::diag::Sources;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{Instr, Phase, Plan};
use parc_compiler::lower::{lower, lower_with, LowerOptions};
use parc_compiler::spec::{Axis, LayerKind, PipelineSchedule, Recompute, SpSave, Spec, ZeroStage};
use parc_compiler::{check, parse_override};
use parc_runtime::exec::{TrainOptions, TrainResult};
use std::time::Duration;

const STEPS: usize = 5;

fn model(llama: bool) -> TinyModel {
    TinyModel {
        layers: 4,
        llama,
        tied: !llama,
    }
}

fn run(llama: bool, plan: PlanChoice, variant: Variant) -> TrainResult {
    run_plan_of(&spec_variant(model(llama), plan, variant))
}

fn run_plan(s: &Spec, p: &Plan) -> TrainResult {
    let mut options = TrainOptions::new(".");
    options.comm_timeout = Duration::from_secs(30);
    options.threads_per_rank = Some(1);
    train_cpu(s, p, &options).unwrap_or_else(|e| panic!("{e}"))
}

fn describe(llama: bool, p: &PlanChoice, variant: Variant) -> String {
    format!(
        "{} dp {} pp {} cp {} tp {} zero {:?} {:?} m {} {:?} sp {} ({:?}){}{}",
        if llama { "llama" } else { "gpt" },
        p.dp,
        p.pp,
        p.cp,
        p.tp,
        p.zero,
        p.schedule,
        p.microbatches,
        p.recompute,
        p.sp,
        variant.sp_save,
        if variant.order == Variant::default().order {
            String::new()
        } else {
            format!(" mesh {:?}", variant.order)
        },
        if variant.sgd { " sgd" } else { "" }
    )
}

/// The single-rank plan with `plan`'s global batch: all its microbatches on one rank.
fn single_rank_plan(plan: &PlanChoice) -> PlanChoice {
    PlanChoice {
        microbatches: plan.microbatches * plan.dp,
        ..PlanChoice::default()
    }
}

/// The single-rank run with the same global batch and optimizer as `plan` under `variant`.
fn single_rank_of(llama: bool, plan: &PlanChoice, variant: Variant) -> TrainResult {
    run(
        llama,
        single_rank_plan(plan),
        Variant {
            sgd: variant.sgd,
            ..Variant::default()
        },
    )
}

fn assert_equivalent(llama: bool, plan: PlanChoice) {
    assert_equivalent_variant(llama, plan, Variant::default());
}

fn assert_equivalent_variant(llama: bool, plan: PlanChoice, variant: Variant) {
    let single = single_rank_of(llama, &plan, variant);
    assert_matches(&single, llama, plan, variant);
}

fn assert_matches(single: &TrainResult, llama: bool, plan: PlanChoice, variant: Variant) {
    let desc = describe(llama, &plan, variant);
    let got = run(llama, plan, variant);
    assert_close(&desc, single, &got, variant.sgd);
}

/// `got` trained as `single` did (see the module header for the tolerances).
fn assert_close(desc: &str, single: &TrainResult, got: &TrainResult, sgd: bool) {
    assert_eq!(single.records.len(), STEPS, "{desc}");
    assert_eq!(got.records.len(), STEPS, "{desc}");
    assert_eq!(single.params.len(), got.params.len(), "{desc}");
    assert!(!single.params.is_empty());
    // Training moved the loss, so equal losses are not equal constants.
    assert_ne!(single.records[0].loss, single.records[STEPS - 1].loss);
    for (a, b) in single.records.iter().zip(&got.records) {
        for (what, x, y) in [
            ("loss", a.loss, b.loss),
            ("grad norm", a.grad_norm, b.grad_norm),
        ] {
            let rel = (x - y).abs() / x.abs().max(1e-12);
            assert!(
                rel < 1e-5,
                "{desc}: step {} {what} {y} vs single rank {x} (rel {rel:e})",
                a.step
            );
        }
    }
    for (a, b) in single.params.iter().zip(&got.params) {
        assert_eq!((&a.name, &a.shape), (&b.name, &b.shape), "{desc}");
        for (i, (x, y)) in a.data.iter().zip(&b.data).enumerate() {
            let tolerance = if sgd {
                1e-5 * x.abs() + 1e-6
            } else {
                1e-5 * x.abs().max(1.0)
            };
            assert!(
                (x - y).abs() <= tolerance,
                "{desc}: {}[{i}] = {y} vs single rank {x}",
                a.name
            );
        }
    }
}

#[test]
fn data_parallel_with_each_zero_stage() {
    for zero in [
        ZeroStage::Zero0,
        ZeroStage::Zero1,
        ZeroStage::Zero2,
        ZeroStage::Zero3,
    ] {
        assert_equivalent(
            false,
            PlanChoice {
                dp: 2,
                zero,
                ..PlanChoice::default()
            },
        );
    }
}

/// Qwen2's attention (biases on q, k and v, none on the output projection: `qkv_bias = true,
/// bias = false`) under tp 2 with SP and under dp 2 with ZeRO 3 trains as on one rank: the
/// q/k/v bias splits with its heads, and no output bias is added.
#[test]
fn qkv_biases_without_an_output_bias() {
    let qwen = |mut s: Spec| {
        for node in &mut s.model.nodes {
            if let LayerKind::Attention { qkv_bias, .. } = &mut node.kind {
                *qkv_bias = true;
            }
        }
        s
    };
    let plans = [
        PlanChoice {
            tp: 2,
            sp: true,
            ..PlanChoice::default()
        },
        PlanChoice {
            dp: 2,
            zero: ZeroStage::Zero3,
            ..PlanChoice::default()
        },
    ];
    for plan in plans {
        let desc = format!("qwen {}", describe(true, &plan, Variant::default()));
        let single_plan = single_rank_plan(&plan);
        let single = run_plan_of(&qwen(spec_variant(
            model(true),
            single_plan,
            Variant::default(),
        )));
        assert!(single.params.iter().any(|p| p.name.ends_with("attn.bqkv")));
        assert!(!single.params.iter().any(|p| p.name.ends_with("attn.bo")));
        let got = run_plan_of(&qwen(spec_variant(model(true), plan, Variant::default())));
        assert_close(&desc, &single, &got, false);
    }
}

/// `s` with Qwen3's attention: each head of q and k RMS-normalized before RoPE (`qk_norm`),
/// heads of 8 where d / heads is 4 (the q projection twice the model's width).
fn qwen3(mut s: Spec) -> Spec {
    for node in &mut s.model.nodes {
        if let LayerKind::Attention {
            qk_norm, head_dim, ..
        } = &mut node.kind
        {
            *qk_norm = Some(1e-6);
            *head_dim = 8;
        }
    }
    s
}

/// tp 2 with sequence parallelism, and cp 2 with `cp_recompute`: the plans an attention
/// feature is held to one rank's run under (heads split, positions split).
fn tp_with_sp_and_cp(cp_recompute: Recompute) -> [PlanChoice; 2] {
    let tp = PlanChoice {
        tp: 2,
        sp: true,
        ..PlanChoice::default()
    };
    let cp = PlanChoice {
        cp: 2,
        recompute: cp_recompute,
        ..PlanChoice::default()
    };
    [tp, cp]
}

/// `s` with every attention's q·k factor set to `scale` (`Attention(…, scale = …)`).
fn attention_scaled(mut s: Spec, scale: Option<f64>) -> Spec {
    for node in &mut s.model.nodes {
        if let LayerKind::Attention { scale: own, .. } = &mut node.kind {
            *own = scale;
        }
    }
    s
}

/// An attention's own `scale` (Gemma 2's `query_pre_attn_scalar^−½`): written as the usual
/// `1/√head_dim` it trains bit for bit as left out; another value changes the run (the factor
/// reaches the kernels), and trains under tp 2 with SP and under cp 2 as on one rank.
#[test]
fn an_attention_scale_reaches_the_kernels_under_tp_and_cp() {
    let with = |plan: PlanChoice, scale: Option<f64>| {
        let s = spec_variant(model(true), plan.clone(), Variant::default());
        run_plan_of(&attention_scaled(s, scale))
    };
    let head_dim = tiny_dims(true).dim / tiny_dims(true).heads;
    let usual = 1.0 / (head_dim as f64).sqrt();
    let left_out = with(PlanChoice::default(), None);
    let written = with(PlanChoice::default(), Some(usual));
    assert!(run_bits(&left_out) == run_bits(&written));
    let own = with(PlanChoice::default(), Some(0.9));
    assert!(
        left_out.records[0].loss != own.records[0].loss,
        "a scale of 0.9 trained as 1/√{head_dim}"
    );
    for plan in tp_with_sp_and_cp(Recompute::None) {
        let desc = format!("scale 0.9, {}", describe(true, &plan, Variant::default()));
        assert_close(&desc, &own, &with(plan, Some(0.9)), false);
    }
}

/// A partial RoPE (`RoPE(…, fraction = 0.5)`: the first half of each head's features turn,
/// as GPT-NeoX's rotary_pct) under tp 2 with SP and under cp 2 with selective recompute
/// trains as on one rank (cp's ranks turn their own positions' rows, tp's their own heads),
/// and differs from the full rotation's run.
#[test]
fn a_partial_rope_under_tp_and_cp() {
    let with = |plan: PlanChoice, fraction: f64| {
        let mut s = spec_variant(model(true), plan.clone(), Variant::default());
        for node in &mut s.model.nodes {
            if let LayerKind::Attention { rope: Some(r), .. } = &mut node.kind {
                r.fraction = fraction;
            }
        }
        run_plan_of(&s)
    };
    let single = with(PlanChoice::default(), 0.5);
    let full = with(PlanChoice::default(), 1.0);
    assert!(single.records[1].loss != full.records[1].loss);
    for plan in tp_with_sp_and_cp(Recompute::Selective) {
        let desc = format!(
            "fraction 0.5, {}",
            describe(true, &plan, Variant::default())
        );
        assert_close(&desc, &single, &with(plan, 0.5), false);
    }
}

/// Qwen3's per-head q/k norms under every axis train as on one rank: tp 2 with and without SP
/// (each rank normalizes its own heads with the replicated weights, whose partial gradients
/// are all-reduced over tp), dp 2 with ZeRO 3 (the weights sharded and gathered per use),
/// pp 2 × cp 2 with selective recompute (k normalized on the rank's own rows before the
/// gather), tp 2 × dp 2 with ZeRO 1, and an interleaved pipeline with full recompute. Every
/// plan runs under SGD with momentum, whose parameters compare at 1e-6; the first three under
/// AdamW too. (Under AdamW, cp 2's one wqkv element whose gradient is near zero moves by
/// 1.4e-5 between plans: Adam's normalized update of float noise, not a gradient difference.)
#[test]
fn per_head_qk_norm_under_every_axis() {
    let plans = [
        PlanChoice {
            tp: 2,
            ..PlanChoice::default()
        },
        PlanChoice {
            tp: 2,
            sp: true,
            ..PlanChoice::default()
        },
        PlanChoice {
            dp: 2,
            zero: ZeroStage::Zero3,
            ..PlanChoice::default()
        },
        PlanChoice {
            pp: 2,
            cp: 2,
            microbatches: 2,
            recompute: Recompute::Selective,
            ..PlanChoice::default()
        },
        PlanChoice {
            dp: 2,
            tp: 2,
            zero: ZeroStage::Zero1,
            ..PlanChoice::default()
        },
        PlanChoice {
            pp: 2,
            schedule: PipelineSchedule::Interleaved { virtual_stages: 2 },
            microbatches: 2,
            recompute: Recompute::Full,
            ..PlanChoice::default()
        },
    ];
    for (i, plan) in plans.into_iter().enumerate() {
        for sgd in [true, false].into_iter().filter(|&sgd| sgd || i < 3) {
            let variant = Variant {
                sgd,
                ..Variant::default()
            };
            let desc = format!("qwen3 {}", describe(true, &plan, variant));
            let single_plan = single_rank_plan(&plan);
            let single = run_plan_of(&qwen3(spec_variant(model(true), single_plan, variant)));
            let norm = single
                .params
                .iter()
                .find(|p| p.name == "blocks.0.attn.k_norm");
            let norm = norm.unwrap_or_else(|| panic!("{desc}: no k_norm"));
            assert!(
                norm.data.iter().any(|&w| w != 1.0),
                "{desc}: k_norm untrained"
            );
            let got = run_plan_of(&qwen3(spec_variant(model(true), plan.clone(), variant)));
            assert_close(&desc, &single, &got, sgd);
        }
    }
}

/// ZeRO-3 on a pipeline: the last stage runs each microbatch's backward right after its
/// forward, so the forward keeps the head's gathered weight for it (1F1B), and interleaving
/// puts other chunks between some forwards and their backwards (no weight kept there).
#[test]
fn zero3_through_pipeline_schedules() {
    for (schedule, microbatches) in [
        (PipelineSchedule::OneFOneB, 3),
        (PipelineSchedule::Interleaved { virtual_stages: 2 }, 4),
    ] {
        assert_equivalent(
            false,
            PlanChoice {
                dp: 2,
                pp: 2,
                zero: ZeroStage::Zero3,
                schedule,
                microbatches,
                ..PlanChoice::default()
            },
        );
    }
}

/// Plans that exercise every lowering path a `LowerOptions` switch touches: GPT and Llama,
/// tp with and without SP, pipelines, dp with cp, ZeRO and both recompute modes.
fn option_plans() -> Vec<(bool, PlanChoice)> {
    vec![
        (false, PlanChoice::default()),
        (true, PlanChoice::default()),
        (
            false,
            PlanChoice {
                tp: 2,
                sp: true,
                ..PlanChoice::default()
            },
        ),
        (
            true,
            PlanChoice {
                tp: 2,
                ..PlanChoice::default()
            },
        ),
        (
            false,
            PlanChoice {
                pp: 2,
                schedule: PipelineSchedule::Interleaved { virtual_stages: 2 },
                microbatches: 4,
                ..PlanChoice::default()
            },
        ),
        (
            true,
            PlanChoice {
                dp: 2,
                cp: 2,
                zero: ZeroStage::Zero3,
                recompute: Recompute::Full,
                ..PlanChoice::default()
            },
        ),
        (
            false,
            PlanChoice {
                pp: 2,
                dp: 2,
                zero: ZeroStage::Zero2,
                microbatches: 2,
                recompute: Recompute::Selective,
                ..PlanChoice::default()
            },
        ),
    ]
}

/// The bits of every step's loss and gradient norm, and of every trained parameter.
fn run_bits(r: &TrainResult) -> (Vec<(u32, u32)>, Vec<u32>) {
    let steps = r
        .records
        .iter()
        .map(|x| (x.loss.to_bits(), x.grad_norm.to_bits()));
    let params = r
        .params
        .iter()
        .flat_map(|p| p.data.iter().map(|v| v.to_bits()));
    (steps.collect(), params.collect())
}

/// Instructions of `plan` (all programs) that `f` accepts.
fn count(plan: &Plan, f: impl Fn(&Instr) -> bool) -> usize {
    plan.programs
        .iter()
        .map(|q| q.instrs.iter().filter(|i| f(i)).count())
        .sum()
}

/// Two lowerings of `s` train alike, bit for bit (`what` names the difference between them).
fn assert_same_run(s: &Spec, a: &Plan, b: &Plan, desc: &str, what: &str) {
    let (a, b) = (run_plan(s, a), run_plan(s, b));
    assert_eq!(a.records.len(), STEPS, "{desc}");
    assert!(
        run_bits(&a) == run_bits(&b),
        "{desc}: {what} changed the run"
    );
}

/// For each of `plans`, its lowerings with the default options and with `other` train alike,
/// bit for bit (`what` names the difference between them), after `check(desc, llama, tp,
/// default, other)` on the two plans.
fn assert_options_change_no_bit(
    plans: Vec<(bool, PlanChoice)>,
    other: LowerOptions,
    what: &str,
    check: impl Fn(&str, bool, u32, &Plan, &Plan),
) {
    for (llama, plan) in plans {
        let desc = describe(llama, &plan, Variant::default());
        let tp = plan.tp;
        let s = spec_variant(model(llama), plan, Variant::default());
        let default = lower(&s).unwrap_or_else(|d| panic!("{:?}", d.items));
        let changed = lower_with(&s, other).unwrap_or_else(|d| panic!("{:?}", d.items));
        check(&desc, llama, tp, &default, &changed);
        assert_same_run(&s, &default, &changed, &desc, what);
    }
}

/// Adding gradient contributions in place (`LowerOptions::accumulate_in_place`, the default:
/// a producer's `+=` into the gradient already there, one gradient handed to both inputs of a
/// residual `Add` without a copy) changes no bit of an f32 run: every plan trains exactly as
/// its plain form (each contribution summed by an `Add` into a fresh buffer, each residual
/// gradient copied): the same losses, gradient norms and parameters, bit for bit, across tp
/// with and without SP, pipelines, ZeRO, cp and recompute. A `+=` adds the finished value once
/// (`a + b`, as the `Add` did), and the summation order of every gradient is kept.
#[test]
fn accumulating_gradients_in_place_changes_no_bit() {
    let plans = option_plans();
    let instrs = |p: &Plan| count(p, |_| true);
    let is_add_or_copy = |i: &Instr| matches!(i.op(), Some(Op::Add | Op::Copy));
    let plain = LowerOptions {
        accumulate_in_place: false,
        ..LowerOptions::default()
    };
    let what = "in-place accumulation";
    assert_options_change_no_bit(plans, plain, what, |desc, _, _, in_place, plain| {
        // The two plans differ: the in-place one drops Adds and Copies.
        let adds = |p: &Plan| count(p, is_add_or_copy);
        assert!(
            instrs(in_place) < instrs(plain) && adds(in_place) < adds(plain),
            "{desc}: {} instructions ({} Add/Copy) in place vs {} ({}) plain",
            instrs(in_place),
            adds(in_place),
            instrs(plain),
            adds(plain)
        );
    });
}

/// The first contribution to each freshly allocated parameter gradient overwriting it
/// (`LowerOptions::overwrite_first_grads`, the default: `accumulate_param_grad` = false on
/// that `MatmulBwdWeight` / norm backward / `PositionAddBwd`) changes no bit of an f32 run and
/// drops those gradients' zero-fills: across tp with and without SP, pipelines with several
/// micro-batches (gradient accumulation), ZeRO-2/3 buckets, cp, recompute, and the tied
/// embedding (the head's product overwrites, the embedding's scatter adds).
#[test]
fn overwriting_first_gradient_contributions_changes_no_bit() {
    let adding = LowerOptions {
        overwrite_first_grads: false,
        ..LowerOptions::default()
    };
    let overwriting =
        |i: &Instr| matches!(i.op().and_then(Op::param_grad_outputs), Some((_, false)));
    let zero_filled = |p: &Plan| -> usize {
        p.programs
            .iter()
            .map(|q| {
                let needs = parc_compiler::memplan::zero_needs(q);
                q.buffers
                    .iter()
                    .zip(needs)
                    .filter(|(b, n)| *n && !b.kind.is_persistent())
                    .count()
            })
            .sum()
    };
    let mut plans = option_plans();
    plans.push((
        false,
        PlanChoice {
            dp: 2,
            microbatches: 2,
            ..PlanChoice::default()
        },
    ));
    let what = "overwriting first contributions";
    assert_options_change_no_bit(plans, adding, what, |desc, _, _, first, add| {
        assert!(
            count(first, overwriting) > 0 && count(add, overwriting) == 0,
            "{desc}: {} overwriting gradient ops (adding form: {})",
            count(first, overwriting),
            count(add, overwriting)
        );
        assert!(
            zero_filled(first) < zero_filled(add),
            "{desc}: {} zero-filled buffers overwriting vs {} adding",
            zero_filled(first),
            zero_filled(add)
        );
    });
}

/// Fusing GPT-2's gelu_tanh and the residual adds into the GEMMs (`LowerOptions::
/// fuse_epilogues`, the default: the first MLP projection's `Matmul` writes the activation
/// too, the second's backward-data product writes the pre-activation's gradient, and the
/// attention and MLP output projections add the residual) changes no bit of an f32 run: per
/// element the fused ops compute the expressions the separate `Activation` / `ActivationBwd`
/// / `Add` computed, on the same f32 values. Across tp with SP (no residual fusion there: the
/// adds follow the all-reduce), pipelines, dp with cp, ZeRO and both recompute modes. Llama's
/// SwiGLU MLP forms its gated product in the up projection's GEMM and its gradient in the down
/// projection's data-gradient GEMM (`swiglu`), with no `SwiGlu` / `SwiGluBwd` left; its
/// residual adds fuse.
#[test]
fn fusing_epilogues_changes_no_bit() {
    let unfused = LowerOptions {
        fuse_epilogues: false,
        ..LowerOptions::default()
    };
    let is_activation = |i: &Instr| {
        matches!(
            i.op(),
            Some(Op::Activation { .. } | Op::ActivationBwd { .. } | Op::SwiGlu | Op::SwiGluBwd)
        )
    };
    let is_forward_add = |i: &Instr| {
        (i.as_compute()).is_some_and(|c| matches!(c.op, Op::Add) && c.phase == Phase::Forward)
    };
    let mut plans: Vec<(bool, PlanChoice)> = option_plans()
        .into_iter()
        .map(|(_, plan)| (false, plan))
        .collect();
    plans.push((true, PlanChoice::default()));
    let what = "fusing into the GEMMs";
    assert_options_change_no_bit(plans, unfused, what, |desc, _llama, tp, fused, plain| {
        assert_eq!(count(fused, is_activation), 0, "{desc}: fused");
        assert!(count(plain, is_activation) > 0, "{desc}: plain");
        let adds = (count(fused, is_forward_add), count(plain, is_forward_add));
        if tp > 1 {
            assert_eq!(adds.0, adds.1, "{desc}: tp keeps the residual adds");
        } else {
            assert!(adds.0 < adds.1, "{desc}: forward adds {adds:?}");
        }
    });
}

/// Three dp ranks do not divide the tiny model's parameters, so ZeRO pads their flat copies: a
/// gradient copied into a padded copy leaves the padding to the allocation's zeros (the memory
/// plan must keep that zero-fill; the CPU backend poisons the ones it skips with NaN).
#[test]
fn zero_padding_with_three_data_parallel_ranks() {
    for zero in [ZeroStage::Zero1, ZeroStage::Zero3] {
        assert_equivalent(
            false,
            PlanChoice {
                dp: 3,
                zero,
                ..PlanChoice::default()
            },
        );
    }
}

#[test]
fn tensor_parallel_with_and_without_sequence_parallelism() {
    for llama in [false, true] {
        for sp in [false, true] {
            assert_equivalent(
                llama,
                PlanChoice {
                    tp: 2,
                    sp,
                    ..PlanChoice::default()
                },
            );
        }
    }
}

/// `parallel.sp_save = gathered`: the layers keep the all-gathered input instead of the shard
/// (the default, re-gathered in backward, is every other sequence-parallel case here).
#[test]
fn sequence_parallel_keeping_the_gathered_inputs() {
    for (llama, recompute) in [(false, Recompute::None), (true, Recompute::Selective)] {
        let plan = PlanChoice {
            tp: 2,
            sp: true,
            recompute,
            ..PlanChoice::default()
        };
        let variant = Variant {
            sp_save: SpSave::Gathered,
            ..Variant::default()
        };
        assert_equivalent_variant(llama, plan, variant);
    }
}

#[test]
fn pipeline_schedules() {
    for schedule in [
        PipelineSchedule::Gpipe,
        PipelineSchedule::OneFOneB,
        PipelineSchedule::Interleaved { virtual_stages: 2 },
    ] {
        assert_equivalent(
            false,
            PlanChoice {
                pp: 2,
                schedule,
                microbatches: 4,
                ..PlanChoice::default()
            },
        );
    }
}

/// The tiny GPT-style model with `layers` layers and a 256-token vocabulary, whose head costs
/// about two layers' FLOPs (so `balance: auto` splits unevenly), under `plan` and `split`.
fn big_vocab_spec(layers: u32, plan: PlanChoice, split: Split) -> Spec {
    let model = TinyModel {
        layers,
        llama: false,
        tied: true,
    };
    let dims = Dims {
        vocab: 256,
        ..tiny_dims(false)
    };
    let variant = Variant {
        split,
        ..Variant::default()
    };
    sized_spec_variant(model, plan, dims, variant)
}

/// Pipelines whose stages hold different numbers of layers (given, or `balance: auto`'s), with
/// the tied embedding and head on the first and last stage, train as the single rank does:
/// 1F1B with [3, 1], [1, 3] and auto's [3, 1]; interleaved with uneven chunks and auto's.
#[test]
fn uneven_pipeline_stages() {
    let interleaved = PipelineSchedule::Interleaved { virtual_stages: 2 };
    let cases: [(u32, PipelineSchedule, Split, &[u32]); 5] = [
        (
            4,
            PipelineSchedule::OneFOneB,
            Split::Given(&[3, 1]),
            &[3, 1],
        ),
        (
            4,
            PipelineSchedule::OneFOneB,
            Split::Given(&[1, 3]),
            &[1, 3],
        ),
        (4, PipelineSchedule::OneFOneB, Split::Auto, &[3, 1]),
        (6, interleaved, Split::Given(&[1, 2, 2, 1]), &[1, 2, 2, 1]),
        (6, interleaved, Split::Auto, &[2, 1, 2, 1]),
    ];
    for (layers, schedule, split, want) in cases {
        let single = PlanChoice {
            microbatches: 4,
            ..PlanChoice::default()
        };
        let single = run_plan_of(&big_vocab_spec(layers, single, Split::Even));
        let plan = PlanChoice {
            pp: 2,
            schedule,
            microbatches: 4,
            ..PlanChoice::default()
        };
        let spec = big_vocab_spec(layers, plan, split);
        let desc = format!("{layers} layers {schedule:?} {split:?}");
        assert_eq!(spec.parallel.chunk_layers, want, "{desc}");
        assert_close(&desc, &single, &run_plan_of(&spec), false);
    }
}

/// `s` lowered and trained.
fn run_plan_of(s: &Spec) -> TrainResult {
    let p = lower(s).unwrap_or_else(|d| panic!("{:?}", d.items));
    run_plan(s, &p)
}

#[test]
fn context_parallel_with_and_without_recompute() {
    for llama in [false, true] {
        for recompute in [Recompute::None, Recompute::Full] {
            assert_equivalent(
                llama,
                PlanChoice {
                    cp: 2,
                    recompute,
                    ..PlanChoice::default()
                },
            );
        }
    }
}

/// Every recompute mode on one rank, for both model styles. The named kinds include the
/// embedding (its tokens are kept for the recompute).
#[test]
fn recompute_modes() {
    for llama in [false, true] {
        let single = single_rank_of(llama, &PlanChoice::default(), Variant::default());
        for recompute in [
            Recompute::Selective,
            Recompute::Full,
            Recompute::Named(vec!["MLP".into()]),
            Recompute::Named(vec![
                "Embedding".into(),
                "LayerNorm".into(),
                "RMSNorm".into(),
                "Attention".into(),
            ]),
        ] {
            assert_matches(
                &single,
                llama,
                PlanChoice {
                    recompute,
                    ..PlanChoice::default()
                },
                Variant::default(),
            );
        }
    }
}

#[test]
fn all_axes_at_once() {
    for llama in [false, true] {
        assert_equivalent(
            llama,
            PlanChoice {
                dp: 2,
                pp: 2,
                cp: 2,
                tp: 2,
                zero: ZeroStage::Zero1,
                microbatches: 2,
                recompute: Recompute::Selective,
                sp: true,
                ..PlanChoice::default()
            },
        );
    }
}

/// Any mesh order: tp outermost and dp innermost changes every group and peer, not the math.
#[test]
fn mesh_order_does_not_matter() {
    assert_equivalent_variant(
        true,
        PlanChoice {
            dp: 2,
            pp: 2,
            cp: 2,
            tp: 2,
            zero: ZeroStage::Zero2,
            sp: true,
            ..PlanChoice::default()
        },
        Variant {
            order: [Axis::Tp, Axis::Cp, Axis::Pp, Axis::Dp],
            ..Variant::default()
        },
    );
}

/// Parameters agree at 1e-6 absolute under SGD with momentum across all axes and ZeRO-3.
#[test]
fn parameters_match_under_sgd() {
    for llama in [false, true] {
        assert_equivalent_variant(
            llama,
            PlanChoice {
                dp: 2,
                pp: 2,
                cp: 2,
                tp: 2,
                zero: ZeroStage::Zero3,
                sp: true,
                ..PlanChoice::default()
            },
            Variant {
                sgd: true,
                ..Variant::default()
            },
        );
    }
}

/// Every plan of the matrix: dp, pp, cp, tp ∈ {1, 2}, ZeRO 0–3 (where dp·cp > 1), GPipe / 1F1B
/// / interleaved (where pp > 1), recompute none / selective / full, sequence parallel on/off
/// (where tp > 1), for both tiny models (936 plans).
fn full_matrix() -> Vec<(bool, PlanChoice)> {
    let mut plans = Vec::new();
    let two = [1u32, 2];
    for llama in [false, true] {
        for dp in two {
            for pp in two {
                for cp in two {
                    for tp in two {
                        let zeros: &[ZeroStage] = if dp * cp > 1 {
                            &[
                                ZeroStage::Zero0,
                                ZeroStage::Zero1,
                                ZeroStage::Zero2,
                                ZeroStage::Zero3,
                            ]
                        } else {
                            &[ZeroStage::Zero0]
                        };
                        let schedules: &[PipelineSchedule] = if pp > 1 {
                            &[
                                PipelineSchedule::Gpipe,
                                PipelineSchedule::OneFOneB,
                                PipelineSchedule::Interleaved { virtual_stages: 2 },
                            ]
                        } else {
                            &[PipelineSchedule::OneFOneB]
                        };
                        let sps: &[bool] = if tp > 1 { &[false, true] } else { &[false] };
                        for &zero in zeros {
                            for &schedule in schedules {
                                for recompute in
                                    [Recompute::None, Recompute::Selective, Recompute::Full]
                                {
                                    for &sp in sps {
                                        plans.push((
                                            llama,
                                            PlanChoice {
                                                schedule,
                                                microbatches: 2 * pp,
                                                recompute: recompute.clone(),
                                                sp,
                                                ..PlanChoice::mesh(dp, pp, cp, tp, zero)
                                            },
                                        ));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    plans
}

/// Runs every `stride`-th plan of the matrix (all of them for 1) against single-rank runs
/// shared between plans of one global batch, printing one line per plan; fails listing every
/// plan that differed.
fn run_matrix(stride: usize) {
    let plans: Vec<_> = full_matrix().into_iter().step_by(stride).collect();
    let total = plans.len();
    let mut failures = Vec::new();
    let mut references = std::collections::HashMap::new();
    for (i, (llama, plan)) in plans.into_iter().enumerate() {
        let desc = describe(llama, &plan, Variant::default());
        let key = (llama, plan.microbatches * plan.dp);
        let single = references
            .entry(key)
            .or_insert_with(|| single_rank_of(llama, &plan, Variant::default()));
        let outcome =
            std::panic::catch_unwind(|| assert_matches(single, llama, plan, Variant::default()));
        match outcome {
            Ok(()) => println!("[{}/{total}] ok   {desc}", i + 1),
            Err(e) => {
                let why = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                println!("[{}/{total}] FAIL {desc}: {why}", i + 1);
                failures.push(desc);
            }
        }
    }
    println!(
        "{} passed, {} failed",
        total - failures.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "failed plans: {failures:#?}");
}

/// Every 37th plan of the matrix (26 plans of both model styles, a few seconds in release), or
/// the whole matrix with `PARC_EQUIVALENCE=full`.
#[test]
fn matrix_sample() {
    let full = std::env::var("PARC_EQUIVALENCE").as_deref() == Ok("full");
    run_matrix(if full { 1 } else { 37 });
}

/// The whole matrix (about 100 s in release): `cargo test --release --test equivalence --
/// --ignored`, or `bench/equivalence.sh`.
#[test]
#[ignore]
fn matrix_full() {
    run_matrix(1);
}

/// The bundled examples themselves (shrunk by `--set` to keep CI fast), on their real data.
fn example(file: &str, sets: &[&str]) -> Spec {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join(file)).unwrap();
    example_text(file, text, sets)
}

/// `text` (the example `file`, edited) shrunk as [`example`] shrinks it.
fn example_text(file: &str, text: String, sets: &[&str]) -> Spec {
    let mut sources = Sources::default();
    let main = sources.add(file, text);
    let shrink = [
        "model.seq=16",
        "model.d=32",
        "model.ffn=64",
        "train.steps=5",
    ];
    let overrides: Vec<_> = shrink
        .iter()
        .chain(sets)
        .map(|s| parse_override(s).unwrap())
        .collect();
    let (spec, diags) = check(&mut sources, main, &overrides);
    spec.unwrap_or_else(|| panic!("{file} {sets:?}: {:?}", diags.items))
}

fn run_example(spec: &Spec) -> TrainResult {
    let plan = lower(spec).unwrap_or_else(|d| panic!("{:?}", d.items));
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut options = TrainOptions::new(root.join("examples"));
    options.comm_timeout = Duration::from_secs(60);
    options.threads_per_rank = Some(1);
    train_cpu(spec, &plan, &options).unwrap_or_else(|e| panic!("{e}"))
}

fn assert_example_equivalent(file: &str, plan: &[&str]) {
    let single = run_example(&example(file, &[]));
    let got = run_example(&example(file, plan));
    assert_eq!(got.records.len(), 5);
    assert_ne!(single.records[0].loss, single.records[4].loss);
    for (a, b) in single.records.iter().zip(&got.records) {
        let rel = (a.loss - b.loss).abs() / a.loss.abs();
        assert!(
            rel < 1e-5,
            "{file} {plan:?} step {}: {} vs {}",
            a.step,
            b.loss,
            a.loss
        );
    }
    assert_eq!(single.params.len(), got.params.len());
    for (a, b) in single.params.iter().zip(&got.params) {
        for (x, y) in a.data.iter().zip(&b.data) {
            assert!(
                (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                "{file} {plan:?} {}: {y} vs {x}",
                a.name
            );
        }
    }
}

#[test]
fn tiny_example_with_dp_tp_zero_and_sequence_parallelism() {
    assert_example_equivalent(
        "examples/tiny.par",
        &[
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.zero=2",
            "parallel.sequence_parallel=true",
            "cluster.gpus_per_node=4",
        ],
    );
}

#[test]
fn tiny_llama_example_with_interleaved_pipeline_and_context_parallelism() {
    assert_example_equivalent(
        "examples/tiny-llama.par",
        &[
            "parallel.pp=2",
            "parallel.cp=2",
            "parallel.schedule=interleaved",
            "parallel.virtual=2",
            "parallel.recompute=full",
            "cluster.gpus_per_node=4",
        ],
    );
}

/// The tiny Llama with Llama 3's RoPE scaling at a scale its 16 positions reach: head_dim 4
/// has wavelengths 6.3 and 628, and an original length of 8 (band 2..8) blends the first and
/// divides the second by 4.
fn scaled_llama(sets: &[&str]) -> Spec {
    let file = "examples/tiny-llama.par";
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join(file)).unwrap().replace(
        "theta = 10000)",
        "theta = 10000, scaling = llama3 { factor: 4, low_freq_factor: 1, high_freq_factor: 4, \
         original_max_position: 8 })",
    );
    let spec = example_text(file, text, sets);
    let scaled = spec.model.nodes.iter().any(
        |n| matches!(n.kind, LayerKind::Attention { rope: Some(r), .. } if !r.scaling.is_none()),
    );
    assert!(scaled, "the edit did not reach the spec");
    spec
}

/// A scaled-RoPE model trains, and every plan that splits its positions (cp, whose ranks
/// rotate two segments each, and tp with sequence parallelism, fused rotation tables included)
/// equals its single-rank run; the scaling changes the losses from the plain model's.
#[test]
fn scaled_rope_plans_equal_the_single_rank_run() {
    let single = run_example(&scaled_llama(&[]));
    let plain = run_example(&example("examples/tiny-llama.par", &[]));
    assert_ne!(single.records[0].loss, plain.records[0].loss);
    assert_ne!(single.records[0].loss, single.records[4].loss);
    for plan in [
        &[
            "parallel.cp=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ][..],
        &["parallel.pp=2", "parallel.cp=2", "parallel.recompute=full"][..],
    ] {
        let mut sets = plan.to_vec();
        sets.push("cluster.gpus_per_node=4");
        let got = run_example(&scaled_llama(&sets));
        assert_eq!(got.records.len(), single.records.len());
        for (a, b) in single.records.iter().zip(&got.records) {
            let rel = (a.loss - b.loss).abs() / a.loss.abs();
            assert!(
                rel < 1e-5,
                "{plan:?} step {}: {} vs {}",
                a.step,
                b.loss,
                a.loss
            );
        }
    }
}

/// `file` scaled down, with the FP8 `recipe` (first: a later `train.fp8=…` replaces the whole
/// setting, fields included), every linear layer pinned FP8, and the `plan` settings.
fn fp8_spec(file: &str, recipe: &[&str], plan: &[&str]) -> Spec {
    let pinned = ["train.fp8.fp8=[Attention, MLP, head]"];
    let sets: Vec<&str> = (recipe.iter().chain(&SMALL).chain(&pinned).chain(plan))
        .copied()
        .collect();
    example(file, &sets)
}

/// The FP8 tests' model size.
const SMALL: [&str; 3] = ["model.seq=64", "model.d=64", "model.ffn=128"];

/// FP8 plans (`train.fp8`, every linear layer pinned FP8) against their single-rank run: the
/// CPU backend's exact emulation, in f32 storage. Tolerance 1e-4 where 1e-5 holds elsewhere:
/// a last-bit difference of an f32 partial sum between plans (tp's split sums, cp's split
/// attention) can move one value across an FP8 rounding boundary, a step of 2⁻⁴ of it.
fn assert_fp8_equivalent(file: &str, recipe: &[&str], plan: &[&str]) {
    let with = |extra: &[&str]| fp8_spec(file, recipe, extra);
    let single_spec = with(&[]);
    let single_plan = lower(&single_spec).unwrap_or_else(|d| panic!("{:?}", d.items));
    let fp8_gemms = single_plan.programs[0]
        .instrs
        .iter()
        .filter_map(Instr::as_compute)
        .filter(|c| c.op.fp8().is_some())
        .count();
    assert!(fp8_gemms > 0, "{recipe:?}: no FP8 GEMM in the plan");
    let single = run_example(&single_spec);
    let got = run_example(&with(plan));
    let desc = format!("{file} {recipe:?} {plan:?}");
    assert_ne!(single.records[0].loss, single.records[4].loss);
    // FP8 changes the numbers (a test that holds without quantizing proves nothing).
    let exact = run_example(&example(file, &SMALL));
    assert!(
        exact
            .records
            .iter()
            .zip(&single.records)
            .any(|(a, b)| a.loss != b.loss),
        "{desc}: FP8 GEMMs computed exactly what the plain ones do"
    );
    for (a, b) in single.records.iter().zip(&got.records) {
        let rel = (a.loss - b.loss).abs() / a.loss.abs();
        assert!(
            rel < 1e-4,
            "{desc} step {}: {} vs {}",
            a.step,
            b.loss,
            a.loss
        );
    }
    for (a, b) in single.params.iter().zip(&got.params) {
        let worst = a
            .data
            .iter()
            .zip(&b.data)
            .map(|(x, y)| (x - y).abs() / x.abs().max(1.0))
            .fold(0.0f32, f32::max);
        assert!(worst <= 1e-4, "{desc} {}: off by {worst:e}", a.name);
    }
}

#[test]
fn fp8_blockwise_plans_equal_the_single_rank_run() {
    let recipe = ["train.fp8=blockwise", "train.fp8.block_size=16"];
    assert_fp8_equivalent(
        "examples/tiny-llama.par",
        &recipe,
        &[
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.zero=1",
            "parallel.sequence_parallel=true",
            "cluster.gpus_per_node=4",
        ],
    );
    assert_fp8_equivalent(
        "examples/tiny-llama.par",
        &recipe,
        &[
            "parallel.pp=2",
            "parallel.cp=2",
            "parallel.recompute=full",
            "cluster.gpus_per_node=4",
        ],
    );
}

#[test]
fn fp8_tensorwise_and_rowwise_plans_equal_the_single_rank_run() {
    let plan = [
        "parallel.dp=2",
        "parallel.pp=2",
        "parallel.zero=3",
        "cluster.gpus_per_node=4",
    ];
    assert_fp8_equivalent("examples/tiny.par", &["train.fp8=tensorwise"], &plan);
    assert_fp8_equivalent("examples/tiny-llama.par", &["train.fp8=rowwise"], &plan);
}

/// Tensorwise and rowwise FP8 under tp (with and without sequence parallelism), cp, cp × tp and
/// tp × dp: their scale groups span ranks, and each group's amax is max-reduced over exactly
/// its ranks (`ir::fp8`), so every plan computes the single-rank run's scales. Beside the five
/// steps within 1e-4, the first steps' losses and gradient norms must agree within 1e-6,
/// before a last-bit difference of tp's split sums has crossed an FP8 rounding boundary: a
/// power-of-two scale changes few FP8 values of these small models, so a plan that skipped a
/// reduction stays within 1e-4 but moves them by 5e-6 to 3e-4 (measured by lowering the same
/// plans without the reductions).
fn assert_fp8_shared_scales_equivalent(recipe: &[&str]) {
    let tp = ["parallel.tp=2", "cluster.gpus_per_node=2"];
    let tp_sp = [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "cluster.gpus_per_node=2",
    ];
    let cp = ["parallel.cp=2", "cluster.gpus_per_node=2"];
    let cp_tp = ["parallel.cp=2", "parallel.tp=2", "cluster.gpus_per_node=4"];
    let tp_dp = [
        "parallel.tp=2",
        "parallel.dp=2",
        "parallel.zero=1",
        "cluster.gpus_per_node=4",
    ];
    for plan in [&tp[..], &tp_sp, &cp, &cp_tp, &tp_dp] {
        assert_fp8_equivalent("examples/tiny-llama.par", recipe, plan);
        assert_fp8_first_steps_equal("examples/tiny-llama.par", recipe, plan, 2);
    }
    // GPT-2: biases, a tied vocab-parallel head. Its tp runs cross rounding boundaries from
    // the second step on (tensorwise: grad norms 2e-5 apart at step 1, weights 1–2e-4 apart
    // after five), so only its first step is held tight.
    assert_fp8_first_steps_equal("examples/tiny.par", recipe, &tp, 1);
}

/// The first `steps` steps of an FP8 plan against the single-rank run's, within 1e-6.
fn assert_fp8_first_steps_equal(file: &str, recipe: &[&str], plan: &[&str], steps: usize) {
    let with = |extra: &[&str]| fp8_spec(file, recipe, extra);
    let (single, got) = (run_example(&with(&[])), run_example(&with(plan)));
    for (a, b) in single.records.iter().zip(&got.records).take(steps) {
        let rel = |x: f32, y: f32| (x - y).abs() / x.abs().max(1e-6);
        assert!(
            rel(a.loss, b.loss) < 1e-6 && rel(a.grad_norm, b.grad_norm) < 1e-6,
            "{file} {recipe:?} {plan:?} step {}: loss {} vs {}, grad norm {} vs {}",
            a.step,
            b.loss,
            a.loss,
            b.grad_norm,
            a.grad_norm
        );
    }
}

/// Tensorwise with E4M3 gradients: with its default E5M2 (two mantissa bits) a last-bit
/// difference of tp's split partial sums moves a gradient across a rounding boundary often
/// enough that five AdamW steps leave weights ~3e-4 apart, the scaling aside (rowwise with
/// E5M2 gradients does the same; tensorwise with E4M3 matches to 1e-8). The default E5M2 runs
/// under cp and pp, whose GEMMs sum as the single-rank run does.
#[test]
fn fp8_tensorwise_scales_shared_across_tp_sp_and_cp_equal_the_single_rank_run() {
    assert_fp8_shared_scales_equivalent(&["train.fp8=tensorwise", "train.fp8.grad=e4m3"]);
    let cp = ["parallel.cp=2", "parallel.pp=2", "cluster.gpus_per_node=4"];
    assert_fp8_equivalent("examples/tiny-llama.par", &["train.fp8=tensorwise"], &cp);
}

#[test]
fn fp8_rowwise_scales_shared_across_tp_sp_and_cp_equal_the_single_rank_run() {
    assert_fp8_shared_scales_equivalent(&["train.fp8=rowwise"]);
}

/// Delayed scaling (`tensorwise { scaling: delayed }`, `ir::fp8`): each operand is scaled by
/// its amax history, recorded over the step's microbatches (four in the single-rank run: grad
/// accumulation; split over dp here), over the ranks holding its pieces (tp, cp) and over dp,
/// then rolled alike on every rank, so every plan computes the single-rank run's scales. A
/// history of 2 drops values within the five steps. E4M3 gradients under tp, as for current
/// scaling (`fp8_tensorwise_scales_shared_across_tp_sp_and_cp_equal_the_single_rank_run`).
#[test]
fn fp8_delayed_scaling_plans_equal_the_single_rank_run() {
    let file = "examples/tiny-llama.par";
    let plans: [&[&str]; 3] = [
        &[
            "parallel.dp=2",
            "parallel.pp=2",
            "parallel.zero=3",
            "cluster.gpus_per_node=4",
        ],
        &[
            "parallel.tp=2",
            "parallel.dp=2",
            "parallel.zero=1",
            "parallel.sequence_parallel=true",
            "cluster.gpus_per_node=4",
        ],
        &[
            "parallel.dp=4",
            "parallel.zero=2",
            "cluster.gpus_per_node=4",
        ],
    ];
    for plan in plans {
        assert_fp8_equivalent(file, &DELAYED, plan);
        assert_fp8_first_steps_equal(file, &DELAYED, plan, 2);
    }
    // The history changes the numbers: the first step runs unquantized (an empty history),
    // later ones scale by earlier steps' amaxes, where current scaling takes each GEMM's own.
    let current = run_example(&fp8_spec(file, &DELAYED[..1], &[]));
    let delayed = run_example(&fp8_spec(file, &DELAYED, &[]));
    for (a, b) in current.records.iter().zip(&delayed.records) {
        assert_ne!(a.loss, b.loss, "step {}: delayed = current scaling", a.step);
    }
}

/// The delayed-scaling recipe of the equivalence tests.
const DELAYED: [&str; 4] = [
    "train.fp8=tensorwise",
    "train.fp8.scaling=delayed",
    "train.fp8.history=2",
    "train.fp8.grad=e4m3",
];

/// Delayed scaling under cp (with tp, and with pp and full recompute, whose recomputed
/// forward records nothing): the first two steps within 1e-6. Every amax the cp run records
/// equals the single-rank run's to the last bit or two of f32 in its first two steps (cp's
/// split attention and reductions sum in another order, as without FP8); from the third step
/// on, scales taken from those histories cross FP8 rounding boundaries as current scaling's
/// do under GPT-2's tp, leaving weights 1–2e-4 apart after five steps (measured: worst
/// parameter 1.1e-4 under cp × tp, 1.2e-4 under cp; current scaling 5e-6), so only the first
/// steps are held tight.
#[test]
fn fp8_delayed_scaling_under_cp_equals_the_single_rank_run_first() {
    let file = "examples/tiny-llama.par";
    let cp_tp = ["parallel.cp=2", "parallel.tp=2", "cluster.gpus_per_node=4"];
    let pp_cp = [
        "parallel.pp=2",
        "parallel.cp=2",
        "parallel.recompute=full",
        "cluster.gpus_per_node=4",
    ];
    for plan in [&cp_tp[..], &pp_cp] {
        assert_fp8_first_steps_equal(file, &DELAYED, plan, 2);
    }
}

/// Tensorwise FP8 with each tensor quantized once for the GEMMs near it that read it
/// (`quantize: shared`, the default: `lower::fp8_quantize`) computes what each GEMM quantizing
/// its own operands does (`quantize: per_gemm`), bit for bit, under current and delayed
/// scaling, on one rank and under tp × dp; and the plan shares: fewer quantizations than the
/// GEMMs' operands, some writing both layouts (a data and a weight gradient reading one dy).
#[test]
fn fp8_shared_quantization_computes_the_per_gemm_numbers() {
    let file = "examples/tiny-llama.par";
    let tp_dp = [
        "parallel.tp=2",
        "parallel.dp=2",
        "parallel.zero=1",
        "parallel.sequence_parallel=true",
        "cluster.gpus_per_node=4",
    ];
    let current = ["train.fp8=tensorwise", "train.fp8.grad=e4m3"];
    for recipe in [&current[..], &DELAYED[..]] {
        for plan in [&[][..], &tp_dp[..]] {
            let shared = fp8_spec(file, recipe, plan);
            let per_gemm = [plan, &["train.fp8.quantize=per_gemm"][..]].concat();
            let own = fp8_spec(file, recipe, &per_gemm);
            let lowered = lower(&shared).unwrap_or_else(|d| panic!("{:?}", d.items));
            let computes = || {
                lowered.programs[0]
                    .instrs
                    .iter()
                    .filter_map(Instr::as_compute)
            };
            let quantized = computes()
                .filter(|c| c.op.fp8().is_some_and(|f| f.quantized))
                .count();
            let quantizes: Vec<_> = computes()
                .filter_map(|c| match c.op {
                    parc_compiler::ir::op::Op::Fp8Quantize(a) => Some(*a),
                    _ => None,
                })
                .collect();
            let desc = format!("{recipe:?} {plan:?}");
            assert!(quantized > 0, "{desc}: no quantized GEMM");
            assert!(quantizes.len() < 2 * quantized, "{desc}: nothing shared");
            assert!(
                quantizes.iter().any(|a| a.direct && a.transposed),
                "{desc}: no quantization writes both layouts"
            );
            let (a, b) = (run_example(&shared), run_example(&own));
            for (x, y) in a.records.iter().zip(&b.records) {
                assert_eq!(
                    (x.loss.to_bits(), x.grad_norm.to_bits()),
                    (y.loss.to_bits(), y.grad_norm.to_bits()),
                    "{desc} step {}",
                    x.step
                );
            }
            for (x, y) in a.params.iter().zip(&b.params) {
                assert_eq!(x.data, y.data, "{desc} {}", x.name);
            }
        }
    }
}
