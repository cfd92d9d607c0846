//! The NCCL device comm (`runtime/src/cuda/nccl.rs`, `--comm nccl`).
//!
//! Everywhere (no GPU needed): the communicator layout of real lowered plans (every rank's
//! group sets resolve to a communicator, members of a set agree on it), and the check that
//! NCCL's order matching pairs the same messages as the IR's tags, on every pipeline plan of
//! the equivalence configurations and on a plan broken on purpose.
//!
//! On a GPU with NCCL (otherwise each prints `skipped: …` and passes):
//! - one rank, world = 1 through NCCL: all-reduce (sum, max, in place), all-gather,
//!   reduce-scatter and broadcast of a one-member group, grouped send/receive to itself, a
//!   compute op reading a collective's output right after it (ordering across the streams);
//! - large buffers passed between compute and collectives in every order (the streams' waits),
//!   on buffers outside the program (communication waits for all compute) and on the
//!   program's communication buffers (it waits only for their last compute, not for unrelated
//!   compute queued after it);
//! - training a one-GPU plan with NCCL gives the losses of the run without it (within the
//!   float-atomic noise of two GPU runs), also with an identity all-reduce after every op, and
//!   `parc run` with `--comm local`, `--comm nccl` and `--nproc-per-node 1`;
//! - with two or more GPUs (skipped on one): dp = 2 (ZeRO-1 and ZeRO-3 with prefetch), tp = 2
//!   and pp = 2 plans trained through NCCL match the single-rank CPU run (loss 1e-4 relative
//!   at step 1, 1e-3 after); a rank that stalls before a ZeRO-3 all-gather makes the run fail
//!   within the timeout, naming that all-gather's instruction and its layer (not the last
//!   communication its peer queued);
//! - ignored, for measurements: `nccl_bus_bandwidth`, all-reduce/all-gather/reduce-scatter bus
//!   bandwidth through parc's device path on every visible GPU, 1 MB to 4 GiB.
//!
//! The GPU tests live in `gpu.rs` (built with `--features cuda`); this file holds the plans they
//! share and the tests that need no GPU.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "../ir/fixtures.rs"]
mod fixtures;

use fixtures::{spec, train_cpu, PlanChoice, TinyModel};
use parc_compiler::ir::{CollectiveKind, DType, Instr, P2pOp, Plan, ReduceOp};
use parc_compiler::lower::lower;
use parc_compiler::spec::{PipelineSchedule, Spec, ZeroStage};
use parc_runtime::comm::layout::{check_p2p_order, CommKey, CommLayout};
use parc_runtime::exec::TrainOptions;

fn plan_of(s: &Spec) -> Plan {
    lower(s).unwrap_or_else(|d| panic!("{:?}", d.items))
}

fn model(llama: bool) -> TinyModel {
    TinyModel {
        layers: 8,
        llama,
        tied: !llama,
    }
}

/// Plans with every kind of group and pipeline transfer.
fn plans() -> Vec<(String, Plan)> {
    let mut out = Vec::new();
    let schedules = [
        PipelineSchedule::OneFOneB,
        PipelineSchedule::Gpipe,
        PipelineSchedule::Interleaved { virtual_stages: 2 },
    ];
    for llama in [false, true] {
        for schedule in schedules {
            for (dp, pp, cp, tp, zero) in [
                (1, 2, 1, 1, ZeroStage::Zero0),
                (2, 2, 1, 2, ZeroStage::Zero1),
                (1, 4, 1, 1, ZeroStage::Zero0),
                (2, 2, 2, 1, ZeroStage::Zero3),
            ] {
                let choice = PlanChoice {
                    schedule,
                    microbatches: 4,
                    ..PlanChoice::mesh(dp, pp, cp, tp, zero)
                };
                let name = format!(
                    "{} dp{dp} pp{pp} cp{cp} tp{tp} {zero:?} {schedule:?}",
                    if llama { "llama" } else { "gpt" }
                );
                out.push((name, plan_of(&spec(model(llama), choice))));
            }
        }
    }
    out
}

#[test]
fn nccl_order_matching_pairs_the_same_messages_as_the_plans_tags() {
    let mut transfers = 0;
    for (name, plan) in plans() {
        for rank in 0..plan.world {
            check_p2p_order(&plan, rank).unwrap_or_else(|e| panic!("{name}, rank {rank}: {e}"));
        }
        transfers += plan
            .programs
            .iter()
            .flat_map(|p| &p.instrs)
            .filter(|i| {
                matches!(
                    i,
                    Instr::P2p { .. } | Instr::Send { .. } | Instr::Recv { .. }
                )
            })
            .count();
    }
    assert!(transfers > 100, "the plans hold only {transfers} transfers");
}

#[test]
fn a_plan_whose_send_order_disagrees_with_its_tags_is_refused() {
    let choice = PlanChoice {
        pp: 2,
        microbatches: 4,
        ..PlanChoice::default()
    };
    let mut plan = plan_of(&spec(model(false), choice));
    // Swap the tags of the first two sends of stage 0: tag matching still pairs every message,
    // order matching would pair them crosswise.
    let program = plan.rank_program[0].0 as usize;
    let mut sends: Vec<(usize, usize)> = Vec::new();
    for (i, instr) in plan.programs[program].instrs.iter().enumerate() {
        if let Instr::P2p { ops } = instr {
            for (j, op) in ops.iter().enumerate() {
                if matches!(op, P2pOp::Send { .. }) {
                    sends.push((i, j));
                }
            }
        }
    }
    assert!(sends.len() >= 2, "stage 0 sends {} messages", sends.len());
    let tag_at = |plan: &Plan, (i, j): (usize, usize)| match &plan.programs[program].instrs[i] {
        Instr::P2p { ops } => match ops[j] {
            P2pOp::Send { tag, .. } => tag,
            P2pOp::Recv { .. } => unreachable!(),
        },
        _ => unreachable!(),
    };
    let (a, b) = (sends[0], sends[1]);
    let (tag_a, tag_b) = (tag_at(&plan, a), tag_at(&plan, b));
    assert_ne!(tag_a, tag_b);
    for ((i, j), tag) in [(a, tag_b), (b, tag_a)] {
        if let Instr::P2p { ops } = &mut plan.programs[program].instrs[i] {
            if let P2pOp::Send { tag: t, .. } = &mut ops[j] {
                *t = tag;
            }
        }
    }
    let err = check_p2p_order(&plan, 0).unwrap_err();
    assert!(err.contains("rank 0 sends tags"), "{err}");
    assert!(err.contains("rank 1 receives tags"), "{err}");
    assert!(err.contains("NCCL matches messages by order"), "{err}");
}

#[test]
fn every_group_set_of_a_plan_has_one_communicator_its_members_share() {
    for (name, plan) in plans() {
        let layout = CommLayout::of_plan(&plan);
        for group in &plan.groups {
            for set in &group.sets {
                let key = layout
                    .key_of(set)
                    .unwrap_or_else(|| panic!("{name}: no communicator for {set:?}"));
                if let CommKey::Split(index) = key {
                    let colors: Vec<_> = set.iter().map(|&r| layout.color(index, r)).collect();
                    assert!(
                        colors.iter().all(|c| c.is_some() && *c == colors[0]),
                        "{name}: members of {set:?} got colours {colors:?}"
                    );
                    let members = &layout.splits()[index][colors[0].unwrap() as usize];
                    assert_eq!(members, set, "{name}");
                } else {
                    assert_eq!(set.len() as u32, plan.world, "{name}");
                }
            }
        }
        // Distinct partitions only: never more splits than group families.
        assert!(layout.splits().len() <= plan.groups.len(), "{name}");
    }
}

/// `plan` (world 1) with an in-place all-reduce over the one-rank group after every
/// compute op's f32 outputs: identities that put every buffer through NCCL and the
/// communication stream, so the ordering between the streams is exercised by real training.
fn with_identity_collectives(mut plan: Plan) -> Plan {
    let group = parc_compiler::ir::GroupId(plan.groups.len() as u32);
    plan.groups.push(parc_compiler::ir::Group {
        name: "self".into(),
        axes: vec![parc_compiler::spec::Axis::Dp],
        sets: vec![vec![0]],
    });
    for program in &mut plan.programs {
        let mut instrs = Vec::with_capacity(program.instrs.len() * 2);
        for instr in program.instrs.drain(..) {
            let extra: Vec<Instr> = match &instr {
                Instr::Compute { outputs, node, .. } => outputs
                    .iter()
                    .filter(|&&id| program.buffers[id.0 as usize].dtype == DType::F32)
                    .map(|&id| Instr::Collective {
                        kind: CollectiveKind::AllReduce { op: ReduceOp::Sum },
                        group,
                        input: id,
                        output: id,
                        node: *node,
                    })
                    .collect(),
                _ => Vec::new(),
            };
            instrs.push(instr);
            instrs.extend(extra);
        }
        program.instrs = instrs;
    }
    plan
}

#[test]
fn identity_collectives_plan_is_verified_and_trains_like_the_original_on_the_cpu() {
    let mut s = spec(model(false), PlanChoice::default());
    s.train.steps = 2;
    let mut options = TrainOptions::new(".");
    options.threads_per_rank = Some(1);
    let cpu = |plan: &Plan| {
        train_cpu(&s, plan, &options)
            .unwrap()
            .records
            .iter()
            .map(|r| r.loss)
            .collect::<Vec<_>>()
    };
    let plan = plan_of(&s);
    assert_eq!(cpu(&plan), cpu(&with_identity_collectives(plan.clone())));
}

#[cfg(feature = "cuda")]
mod gpu;

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_tests_skip_without_the_cuda_feature() {
    println!("skipped: no CUDA device (this build has no `cuda` feature)");
}
