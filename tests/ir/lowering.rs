//! Lowering tests over the plan matrix: every plan lowers, every rank's program runs to the
//! end under rendezvous semantics with consistent buffer lifetimes and collective shapes.

use super::fixtures::{simulate, spec, spec_variant, PlanChoice, Split, TinyModel, Variant};
use parc_compiler::lower::lower;
use parc_compiler::spec::{PipelineSchedule, Recompute, ZeroStage};

fn check(model: TinyModel, plan: PlanChoice) {
    check_split(model, plan, Split::Even);
}

/// Lowers `plan` with the layers split as `split` says, runs every rank's program
/// symbolically and verifies it.
fn check_split(model: TinyModel, plan: PlanChoice, split: Split) {
    let desc = format!(
        "dp {} pp {} cp {} tp {} zero {:?} {:?} m {} {:?} sp {} {split:?}",
        plan.dp,
        plan.pp,
        plan.cp,
        plan.tp,
        plan.zero,
        plan.schedule,
        plan.microbatches,
        plan.recompute,
        plan.sp
    );
    let variant = Variant {
        split,
        ..Variant::default()
    };
    let s = spec_variant(model, plan, variant);
    let plan = match lower(&s) {
        Ok(p) => p,
        Err(d) => panic!("{desc}: {:?}", d.items),
    };
    if let Err(e) = simulate(&plan) {
        panic!("{desc}: {e}");
    }
    if let Err(d) = parc_compiler::verify::verify_spec(&plan, &s) {
        let msgs: Vec<String> = d.items.iter().map(|x| x.message.clone()).collect();
        panic!("{desc}: verifier: {}", msgs.join("\n"));
    }
}

fn gpt(layers: u32) -> TinyModel {
    TinyModel {
        layers,
        llama: false,
        tied: true,
    }
}

fn llama(layers: u32) -> TinyModel {
    TinyModel {
        layers,
        llama: true,
        tied: false,
    }
}

#[test]
fn single_rank_lowers_and_runs() {
    check(gpt(2), PlanChoice::default());
    check(llama(2), PlanChoice::default());
}

#[test]
fn each_axis_alone() {
    for (dp, pp, cp, tp) in [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)] {
        for model in [gpt(4), llama(4)] {
            check(
                model,
                PlanChoice {
                    dp,
                    pp,
                    cp,
                    tp,
                    ..PlanChoice::default()
                },
            );
        }
    }
}

#[test]
fn zero_stages_and_schedules_over_all_axes() {
    let schedules = [
        PipelineSchedule::Gpipe,
        PipelineSchedule::OneFOneB,
        PipelineSchedule::Interleaved { virtual_stages: 2 },
    ];
    for zero in [
        ZeroStage::Zero0,
        ZeroStage::Zero1,
        ZeroStage::Zero2,
        ZeroStage::Zero3,
    ] {
        for schedule in schedules {
            check(
                gpt(4),
                PlanChoice {
                    dp: 2,
                    pp: 2,
                    cp: 2,
                    tp: 2,
                    zero,
                    schedule,
                    microbatches: 4,
                    ..PlanChoice::default()
                },
            );
        }
    }
}

#[test]
fn recompute_and_sequence_parallel() {
    let modes = [
        Recompute::Selective,
        Recompute::Full,
        Recompute::Named(vec!["MLP".to_string()]),
    ];
    for recompute in modes {
        for sp in [false, true] {
            for model in [gpt(4), llama(4)] {
                check(
                    model,
                    PlanChoice {
                        dp: 1,
                        pp: 2,
                        cp: 2,
                        tp: 2,
                        recompute: recompute.clone(),
                        sp,
                        zero: ZeroStage::Zero3,
                        ..PlanChoice::default()
                    },
                );
            }
        }
    }
}

#[test]
fn deep_pipelines() {
    for (pp, schedule, m) in [
        (4, PipelineSchedule::OneFOneB, 6),
        (4, PipelineSchedule::Gpipe, 3),
        (4, PipelineSchedule::Interleaved { virtual_stages: 2 }, 8),
    ] {
        check(
            gpt(8),
            PlanChoice {
                pp,
                schedule,
                microbatches: m,
                ..PlanChoice::default()
            },
        );
    }
}

/// Stages of different sizes, given and the cost model's, under every schedule, with ZeRO and
/// tp beside them: every rank's program runs to the end and verifies.
#[test]
fn uneven_stages_lower_and_run() {
    let interleaved = PipelineSchedule::Interleaved { virtual_stages: 2 };
    let cases: [(u32, PipelineSchedule, Split); 7] = [
        (2, PipelineSchedule::Gpipe, Split::Given(&[5, 1])),
        (2, PipelineSchedule::OneFOneB, Split::Given(&[1, 5])),
        (4, PipelineSchedule::OneFOneB, Split::Given(&[3, 1, 1, 1])),
        (4, PipelineSchedule::OneFOneB, Split::Auto),
        (2, interleaved, Split::Given(&[3, 1, 1, 1])),
        (2, interleaved, Split::Given(&[1, 2, 1, 2])),
        (2, interleaved, Split::Auto),
    ];
    for (pp, schedule, split) in cases {
        for (model, tp, zero) in [
            (gpt(6), 1, ZeroStage::Zero0),
            (llama(6), 2, ZeroStage::Zero1),
        ] {
            let plan = PlanChoice {
                dp: 2,
                pp,
                tp,
                zero,
                schedule,
                microbatches: 4,
                ..PlanChoice::default()
            };
            check_split(model, plan, split);
        }
    }
}

#[test]
fn programs_are_shared_over_dp() {
    let s = spec(
        gpt(2),
        PlanChoice {
            dp: 4,
            tp: 2,
            ..PlanChoice::default()
        },
    );
    let plan = lower(&s).unwrap();
    assert_eq!(plan.programs.len(), 2);
    assert_eq!(plan.rank_program.len(), 8);
}

#[test]
fn text_form_is_stable() {
    let s = spec(
        gpt(2),
        PlanChoice {
            tp: 2,
            dp: 2,
            ..PlanChoice::default()
        },
    );
    let a = lower(&s).unwrap().to_string();
    let b = lower(&s).unwrap().to_string();
    assert_eq!(a, b);
    assert!(a.starts_with("plan world 4"));
}

#[test]
#[ignore]
fn print_plan() {
    let s = spec(
        gpt(1),
        PlanChoice {
            tp: 2,
            microbatches: 1,
            ..PlanChoice::default()
        },
    );
    let names: Vec<String> = s.model.nodes.iter().map(|n| n.name.clone()).collect();
    let p = lower(&s).unwrap();
    println!(
        "{}",
        parc_compiler::ir::text::PlanText::new(&p)
            .with_names(&names)
            .only(parc_compiler::ir::ProgramId(1))
    );
}

fn codes(s: &parc_compiler::spec::Spec) -> Vec<&'static str> {
    match lower(s) {
        Ok(_) => Vec::new(),
        Err(d) => d.items.iter().map(|x| x.code).collect(),
    }
}

#[test]
fn what_lowering_rejects_is_a_diagnostic() {
    // tp > 1 with attention, MLP and vocab left replicated.
    let mut s = spec(
        gpt(2),
        PlanChoice {
            tp: 2,
            ..PlanChoice::default()
        },
    );
    s.model.sharding.attention_heads_on_tp = false;
    s.model.sharding.mlp_hidden_on_tp = false;
    assert!(codes(&s).iter().all(|c| *c == "E0803") && codes(&s).len() == 4);
    // More pipeline chunks than layers.
    let s = spec(
        gpt(2),
        PlanChoice {
            pp: 2,
            schedule: PipelineSchedule::Interleaved { virtual_stages: 2 },
            ..PlanChoice::default()
        },
    );
    assert_eq!(codes(&s), vec!["E0801"]);
    // Interleaving with microbatches not a multiple of pp.
    let s = spec(
        gpt(4),
        PlanChoice {
            pp: 2,
            microbatches: 3,
            schedule: PipelineSchedule::Interleaved { virtual_stages: 2 },
            ..PlanChoice::default()
        },
    );
    assert_eq!(codes(&s), vec!["E0802"]);
}

/// ZeRO-3 prefetch: every all-gather is read, first by the copy of the node that uses it (no
/// gather of a parameter its node does not read, such as a bias in backward), and without
/// recompute every gather but a forward unit's first has compute of another node between it
/// and that copy, which it overlaps. A backward unit that follows its forward at once starts
/// with the head's weight its forward kept gathered (the fused loss before it has no backward
/// compute to hide a gather behind), so the head is gathered once per microbatch, not twice.
/// (Recompute re-runs a segment's forward on demand, so its gathers are not all prefetched.)
/// Qwen3's per-head q/k norm weights are read by the attention's backward, so they are
/// prefetched with its matrices.
#[test]
fn zero3_gathers_run_while_the_node_before_computes() {
    use parc_compiler::ir::{CollectiveKind, Instr};
    use parc_compiler::spec::LayerKind;
    for (model, recompute, qk_norm) in [
        (gpt(3), Recompute::None, None),
        (llama(3), Recompute::None, None),
        (llama(3), Recompute::None, Some(1e-6)),
        (gpt(3), Recompute::Full, None),
    ] {
        let (microbatches, llama) = (2, model.llama);
        let mut s = spec(
            model,
            PlanChoice {
                dp: 2,
                zero: ZeroStage::Zero3,
                microbatches,
                recompute: recompute.clone(),
                ..PlanChoice::default()
            },
        );
        for n in &mut s.model.nodes {
            if let LayerKind::Attention { qk_norm: q, .. } = &mut n.kind {
                *q = qk_norm;
            }
        }
        let plan = lower(&s).unwrap();
        let instrs = &plan.programs[0].instrs;
        let (mut gathers, mut overlapped) = (0, 0);
        for (g, instr) in instrs.iter().enumerate() {
            let Instr::Collective {
                kind: CollectiveKind::AllGather,
                output,
                node,
                ..
            } = instr
            else {
                continue;
            };
            gathers += 1;
            let (r, reader) = instrs[g + 1..]
                .iter()
                .enumerate()
                .find_map(|(r, i)| Some((r, i.as_compute().filter(|c| c.inputs.contains(output))?)))
                .unwrap_or_else(|| panic!("{recompute:?}: gather {g} {instr:?} is never read"));
            assert_eq!(reader.node, *node, "instruction {g}: read by another node");
            let between = &instrs[g + 1..g + 1 + r];
            if between
                .iter()
                .any(|i| matches!(i, Instr::Compute { node: n, .. } if n.is_some() && n != node))
            {
                overlapped += 1;
            }
        }
        println!("llama {llama} {recompute:?}: {overlapped} of {gathers} gathers overlap compute");
        assert!(gathers > 0);
        if recompute == Recompute::None {
            assert_eq!(gathers - overlapped, microbatches, "llama {llama}");
        }
        let head = s.model.nodes.iter().position(|n| n.name == "head").unwrap();
        let head_gathers = instrs
            .iter()
            .filter(|i| {
                matches!(i, Instr::Collective { kind: CollectiveKind::AllGather, node: Some(n), .. }
                    if n.0 as usize == head)
            })
            .count();
        if recompute == Recompute::None {
            assert_eq!(head_gathers, microbatches as usize, "llama {llama}");
        }
    }
}

/// ZeRO-3 on a 1F1B pipeline: the last stage runs each microbatch's backward right after its
/// forward, so it gathers the head's weight once per microbatch (the forward keeps it).
#[test]
fn zero3_last_pipeline_stage_gathers_the_head_once_per_microbatch() {
    use parc_compiler::ir::{CollectiveKind, Instr};
    let microbatches = 3;
    let s = spec(
        gpt(4),
        PlanChoice {
            dp: 2,
            pp: 2,
            zero: ZeroStage::Zero3,
            microbatches,
            ..PlanChoice::default()
        },
    );
    let plan = lower(&s).unwrap();
    let head = s.model.nodes.iter().position(|n| n.name == "head").unwrap();
    let per_program: Vec<usize> = plan
        .programs
        .iter()
        .map(|p| {
            p.instrs
                .iter()
                .filter(|i| {
                    matches!(i, Instr::Collective { kind: CollectiveKind::AllGather, node: Some(n), .. }
                        if n.0 as usize == head)
                })
                .count()
        })
        .collect();
    assert!(
        per_program.contains(&(microbatches as usize)),
        "{per_program:?}"
    );
    assert!(
        per_program
            .iter()
            .all(|&n| n == 0 || n == microbatches as usize),
        "{per_program:?}"
    );
}

/// The backward of a pre-norm block sums every gradient in place (docs/decisions.md,
/// "Gradient accumulation in place"): no `Copy` and no `Add` in backward, with or without tp and
/// SP; per layer and microbatch both norms' dx add into the residual gradient (Llama: also
/// SwiGLU's up product into gate's; q, k and v are one fused product), before any tp
/// all-reduce.
#[test]
fn backward_sums_residual_gradients_in_place() {
    use parc_compiler::ir::op::Op;
    use parc_compiler::ir::Phase;
    let (layers, microbatches) = (3u32, 2u32);
    for (model, tp) in [
        (gpt(layers), 1),
        (llama(layers), 1),
        (gpt(layers), 2),
        (llama(layers), 2),
    ] {
        let llama = model.llama;
        let s = spec(
            model,
            PlanChoice {
                tp,
                sp: tp > 1 && llama,
                microbatches,
                ..PlanChoice::default()
            },
        );
        let plan = lower(&s).unwrap();
        for program in &plan.programs {
            let (mut adds, mut accumulating) = (0, 0);
            for (_, c) in program.computes() {
                if c.phase != Phase::Backward {
                    continue;
                }
                match c.op {
                    Op::Add | Op::Copy => adds += 1,
                    Op::MatmulBwdData {
                        accumulate: true, ..
                    }
                    | Op::LayerNormBwd {
                        accumulate: true, ..
                    }
                    | Op::RmsNormBwd {
                        accumulate: true, ..
                    } => accumulating += 1,
                    _ => {}
                }
            }
            let per_layer = if llama { 3 } else { 2 };
            let desc = format!("llama {llama} tp {tp} {}", program.role);
            assert_eq!(adds, 0, "{desc}: Add or Copy in backward");
            assert_eq!(accumulating, per_layer * layers * microbatches, "{desc}");
        }
    }
}

/// ZeRO-2/3 reduce-scatter each microbatch's gradients into the shard: every gradient is
/// reduce-scattered once per microbatch, and no full-size gradient buffer is alive when a
/// backward unit starts (none lives across microbatches: the last ones, which the
/// reduce-scatters read, go by the end of the forward in between). ZeRO-1 keeps them to the end
/// of the step.
#[test]
fn zero2_reduces_each_microbatch_into_the_shard() {
    use parc_compiler::ir::{BufferKind, CollectiveKind, Instr, Phase};
    for (model, zero) in [
        (gpt(2), ZeroStage::Zero1),
        (gpt(2), ZeroStage::Zero2),
        (llama(2), ZeroStage::Zero2),
        (llama(2), ZeroStage::Zero3),
    ] {
        let microbatches = 3;
        let s = spec(
            model,
            PlanChoice {
                dp: 2,
                zero,
                microbatches,
                ..PlanChoice::default()
            },
        );
        let plan = lower(&s).unwrap();
        let program = &plan.programs[0];
        let full_grad = |b: &parc_compiler::ir::BufferId| {
            let buf = &program.buffers[b.0 as usize];
            buf.kind == BufferKind::Grad
                && (buf.name.ends_with(".grad") || buf.name.contains(".grad.g"))
        };
        let (mut scatters, mut shards, mut live, mut held_into_backward) = (0, 0, 0i64, false);
        let mut in_forward = false;
        for instr in &program.instrs {
            match instr {
                Instr::Collective {
                    kind: CollectiveKind::ReduceScatter,
                    output,
                    ..
                } => {
                    scatters += 1;
                    shards += usize::from(
                        program.buffers[output.0 as usize]
                            .name
                            .ends_with(".grad_shard"),
                    );
                }
                Instr::Alloc { buffer } if full_grad(buffer) => live += 1,
                Instr::Free { buffer } if full_grad(buffer) => live -= 1,
                Instr::Compute { phase, .. } => {
                    let starts_backward = in_forward && *phase == Phase::Backward;
                    held_into_backward |= starts_backward && live > 0;
                    in_forward = *phase == Phase::Forward;
                }
                _ => {}
            }
        }
        let per_microbatch = zero != ZeroStage::Zero1;
        let expected = if per_microbatch {
            shards * microbatches as usize
        } else {
            shards
        };
        assert!(shards > 0, "{zero:?}: no gradient shards");
        assert_eq!(scatters, expected, "{zero:?}: reduce-scatters");
        assert_eq!(
            held_into_backward, !per_microbatch,
            "{zero:?}: full gradients alive when a backward starts"
        );
    }
}
