//! The verifier on lowered plans (which must pass) and on mutated ones (which must fail at the
//! exact rank and instruction).

use super::*;
use crate::cost::testspec::{build, Dims, Plan as PlanChoice};
use crate::ir::{BufferId, Instr, P2pOp, Plan};
use crate::lower::lower;
use crate::spec::{PipelineSchedule, Recompute, ZeroStage};

fn lowered(plan: PlanChoice) -> Plan {
    let spec = build(&Dims::tiny(), &plan);
    match lower(&spec) {
        Ok(p) => p,
        Err(d) => panic!("{:?}", d.items),
    }
}

fn codes(outcome: &Outcome) -> Vec<&'static str> {
    outcome.violations.iter().map(|v| v.code).collect()
}

#[test]
fn lowered_plans_verify() {
    let plans = [
        PlanChoice::default(),
        PlanChoice {
            dp: 2,
            tp: 2,
            zero: ZeroStage::Zero3,
            ..PlanChoice::default()
        },
        PlanChoice {
            pp: 2,
            cp: 2,
            sp: true,
            tp: 2,
            recompute: Recompute::Full,
            ..PlanChoice::default()
        },
        PlanChoice {
            dp: 2,
            pp: 2,
            schedule: PipelineSchedule::Interleaved { virtual_stages: 2 },
            zero: ZeroStage::Zero1,
            recompute: Recompute::Selective,
            ..PlanChoice::default()
        },
        PlanChoice {
            pp: 4,
            schedule: PipelineSchedule::Gpipe,
            ..PlanChoice::default()
        },
    ];
    for choice in plans {
        let desc = format!("{choice:?}");
        let plan = lowered(choice);
        let outcome = check(&plan);
        assert!(
            outcome.violations.is_empty(),
            "{desc}: {:#?}",
            outcome.violations
        );
        let report = verify(&plan).unwrap();
        assert_eq!(report.programs.len(), plan.programs.len());
        for p in &report.programs {
            assert!(p.peak_bytes > p.persistent_bytes, "{desc}");
            // The breakdown by kind accounts for exactly the transients alive at the peak.
            let by_kind: u64 = p.peak_by_kind.iter().map(|(_, b)| b).sum();
            assert_eq!(
                by_kind, p.peak_transient_bytes,
                "{desc}: {:?}",
                p.peak_by_kind
            );
        }
    }
}

#[test]
fn dp_symmetry_simulates_one_slice() {
    let plan = lowered(PlanChoice {
        dp: 4,
        tp: 2,
        zero: ZeroStage::Zero2,
        ..PlanChoice::default()
    });
    let report = verify(&plan).unwrap();
    assert!(report.dp_symmetric);
    assert_eq!(report.ranks_simulated, 2);
    let plan = lowered(PlanChoice {
        tp: 2,
        ..PlanChoice::default()
    });
    let report = verify(&plan).unwrap();
    assert!(!report.dp_symmetric);
    assert_eq!(report.ranks_simulated, 2);
}

#[test]
fn one_f_one_b_holds_p_minus_s_microbatches() {
    let (p, m) = (4u32, 8u32);
    let plan = lowered(PlanChoice {
        pp: p,
        microbatches: m,
        ..PlanChoice::default()
    });
    let report = verify(&plan).unwrap();
    for s in 0..p {
        let rank = plan.mesh.rank_of(&[(crate::spec::Axis::Pp, s)]);
        let id = plan.rank_program[rank as usize];
        let mem = report.program(id).unwrap();
        assert_eq!(mem.peak_microbatches_in_flight, p - s, "stage {s}");
    }
    let gpipe = lowered(PlanChoice {
        pp: p,
        microbatches: m,
        schedule: PipelineSchedule::Gpipe,
        ..PlanChoice::default()
    });
    let report = verify(&gpipe).unwrap();
    for mem in &report.programs {
        assert_eq!(mem.peak_microbatches_in_flight, m);
    }
}

/// The cost report's "in flight" counts what the verifier counts on the lowered plan:
/// microbatches, for every schedule. Interleaved, it counted chunk-microbatches over v (an
/// amount of activations, 2.5 "mb" on stage 0 here where 4 microbatches are in flight).
#[test]
fn the_cost_report_counts_the_microbatches_the_verifier_counts() {
    let interleaved = PipelineSchedule::Interleaved { virtual_stages: 2 };
    let cases = [
        (PipelineSchedule::OneFOneB, 4, 8, 4),
        (PipelineSchedule::OneFOneB, 2, 1, 4),
        (PipelineSchedule::Gpipe, 2, 4, 4),
        (interleaved, 2, 4, 4),
        (interleaved, 2, 8, 8),
    ];
    for (schedule, pp, microbatches, layers) in cases {
        let choice = PlanChoice {
            pp,
            microbatches,
            schedule,
            ..PlanChoice::default()
        };
        let dims = Dims {
            layers,
            ..Dims::tiny()
        };
        let spec = build(&dims, &choice);
        let plan = lower(&spec).unwrap_or_else(|d| panic!("{:?}", d.items));
        let report = verify(&plan).unwrap();
        let cost = crate::cost::estimate(&spec);
        for role in &cost.roles {
            let rank = plan.mesh.rank_of(&[(crate::spec::Axis::Pp, role.stage)]);
            let id = plan.rank_program[rank as usize];
            let verified = report.program(id).unwrap().peak_microbatches_in_flight;
            assert_eq!(
                role.microbatches_in_flight, verified,
                "{schedule:?} p {pp} m {microbatches}, {}",
                role.role
            );
        }
    }
}

/// (program, instruction, op) of the first receive in a p2p group.
fn first_recv(plan: &Plan) -> (usize, usize, usize) {
    for (p, program) in plan.programs.iter().enumerate() {
        for (i, instr) in program.instrs.iter().enumerate() {
            if let Instr::P2p { ops } = instr {
                if let Some(k) = ops.iter().position(|op| matches!(op, P2pOp::Recv { .. })) {
                    return (p, i, k);
                }
            }
        }
    }
    panic!("no receive in the plan")
}

#[test]
fn deleting_a_recv_reports_the_unmatched_send() {
    let mut plan = lowered(PlanChoice {
        pp: 2,
        ..PlanChoice::default()
    });
    let (p, i, k) = first_recv(&plan);
    let receiver = plan.ranks_of(ProgramId(p as u32))[0];
    let Instr::P2p { ops } = &mut plan.programs[p].instrs[i] else {
        unreachable!()
    };
    let P2pOp::Recv { peer, tag, .. } = ops.remove(k) else {
        unreachable!()
    };
    let sender = plan.peer_rank(receiver, peer);
    // The send of that tag in the sender's program.
    let sp = plan.rank_program[sender as usize].0 as usize;
    let send_at = plan.programs[sp]
        .instrs
        .iter()
        .position(|instr| match instr {
            Instr::P2p { ops } => ops
                .iter()
                .any(|op| matches!(op, P2pOp::Send { tag: t, .. } if *t == tag)),
            Instr::Send { tag: t, .. } => *t == tag,
            _ => false,
        })
        .unwrap();
    let outcome = check(&plan);
    let hit = outcome
        .violations
        .iter()
        .find(|v| v.rank == sender && v.instr == send_at)
        .unwrap_or_else(|| panic!("{:#?}", outcome.violations));
    assert_eq!(hit.code, "E0817");
    assert!(
        hit.message.contains(&format!(
            "send of tag {tag} to rank {receiver} is unmatched"
        )),
        "{}",
        hit.message
    );
    assert!(verify(&plan).is_err());
}

#[test]
fn swapping_two_collectives_reports_the_rank_and_instruction() {
    // cp ranks run different programs and reduce-scatter every gradient over cp after the
    // backward (ZeRO-1): adjacent collectives whose buffers are alive at both places.
    let mut plan = lowered(PlanChoice {
        cp: 2,
        zero: ZeroStage::Zero1,
        ..PlanChoice::default()
    });
    // Rank 1's program: swap its first two tp collectives that differ in node or size.
    let p = plan.rank_program[1].0 as usize;
    let program = &plan.programs[p];
    let colls: Vec<usize> = program
        .instrs
        .iter()
        .enumerate()
        .filter(|(_, i)| matches!(i, Instr::Collective { .. }))
        .map(|(k, _)| k)
        .collect();
    let sig = |k: usize| match &program.instrs[k] {
        Instr::Collective {
            input, node, group, ..
        } => (program.buffer(*input).map(|b| b.numel()), *node, *group),
        _ => unreachable!(),
    };
    // Swap two adjacent collectives on one group that differ in node or size, each with the
    // instructions that prepare it and the free that follows it, so every buffer stays alive
    // where it is used and only the order of the group's collectives is wrong: the segments
    // `start..=mid` and `mid+1..=end` trade places.
    let is_free = |k: usize| matches!(program.instrs.get(k), Some(Instr::Free { .. }));
    let mut found = None;
    for (x, w) in colls.windows(2).enumerate() {
        let (a, b) = (w[0], w[1]);
        if sig(b).2 != sig(a).2 || sig(b) == sig(a) {
            continue;
        }
        let start = if x == 0 { 0 } else { colls[x - 1] + 1 };
        let mid = if is_free(a + 1) && a + 1 < b {
            a + 1
        } else {
            a
        };
        let end = if is_free(b + 1) { b + 1 } else { b };
        let mut mutated = program.clone();
        mutated.instrs[start..=end].rotate_left(mid + 1 - start);
        if super::liveness::analyse(&mutated, ProgramId(p as u32), 1)
            .1
            .is_empty()
        {
            // The later collective now comes first, at its offset in its segment.
            found = Some((mutated, start + (b - mid - 1)));
            break;
        }
    }
    let (mutated, moved_to) = found.unwrap();
    plan.programs[p] = mutated;
    assert!(matches!(
        plan.programs[p].instrs[moved_to],
        Instr::Collective { .. }
    ));
    let outcome = check(&plan);
    assert!(
        outcome
            .violations
            .iter()
            .any(|v| v.code == "E0814" && v.rank == 1 && v.instr == moved_to),
        "{:#?}",
        outcome.violations
    );
    assert!(outcome.violations[0].message.contains("different orders"));
}

#[test]
fn double_free_and_use_before_alloc() {
    let base = lowered(PlanChoice::default());
    let program = &base.programs[0];
    let (at, buffer) = program
        .instrs
        .iter()
        .enumerate()
        .find_map(|(k, i)| match i {
            Instr::Free { buffer } => Some((k, *buffer)),
            _ => None,
        })
        .unwrap();
    let mut plan = base.clone();
    plan.programs[0]
        .instrs
        .insert(at + 1, Instr::Free { buffer });
    let outcome = check(&plan);
    assert_eq!(codes(&outcome), vec!["E0812"]);
    let v = &outcome.violations[0];
    assert_eq!((v.rank, v.instr), (0, at + 1));
    assert!(v.message.contains(&format!("double free of b{}", buffer.0)));
    assert!(v
        .message
        .contains(&format!("already freed at instruction {at}")));

    // Dropping an Alloc makes the first use come before any definition.
    let mut plan = base.clone();
    let (alloc_at, alloc_buf) = plan.programs[0]
        .instrs
        .iter()
        .enumerate()
        .find_map(|(k, i)| match i {
            Instr::Alloc { buffer } => Some((k, *buffer)),
            _ => None,
        })
        .unwrap();
    plan.programs[0].instrs.remove(alloc_at);
    let outcome = check(&plan);
    let first_use = plan.programs[0]
        .instrs
        .iter()
        .position(|i| i.reads().contains(&alloc_buf) || i.writes().contains(&alloc_buf))
        .unwrap();
    let v = &outcome.violations[0];
    assert_eq!((v.code, v.rank, v.instr), ("E0811", 0, first_use));

    // A buffer that does not exist.
    let mut plan = base;
    let n = plan.programs[0].buffers.len() as u32;
    plan.programs[0].instrs.push(Instr::Free {
        buffer: BufferId(n),
    });
    assert_eq!(codes(&check(&plan)), vec!["E0810"]);
}

#[test]
fn diagnostics_name_the_node() {
    let spec = build(
        &Dims::tiny(),
        &PlanChoice {
            tp: 2,
            ..PlanChoice::default()
        },
    );
    let mut plan = lower(&spec).unwrap();
    // Make one all-reduce's output the wrong size: an all-gather shape check on a resize.
    let p = plan.rank_program[0].0 as usize;
    let k = plan.programs[p]
        .instrs
        .iter()
        .position(|i| matches!(i, Instr::Collective { node: Some(_), .. }))
        .unwrap();
    if let Instr::Collective { kind, .. } = &mut plan.programs[p].instrs[k] {
        *kind = crate::ir::CollectiveKind::AllGather;
    }
    let diags = verify_spec(&plan, &spec).unwrap_err();
    let d = &diags.items[0];
    assert_eq!(d.code, "E0814");
    assert!(
        d.message
            .starts_with(&format!("rank 0, instruction {k} (node `")),
        "{}",
        d.message
    );
    assert!(!d.labels.is_empty());
}
/// The most bytes of `Activation` buffers alive at once in `program` (what the cost model's
/// activation term estimates: everything forward keeps for backward). The step's overall peak
/// can fall later, in a backward whose gradients outweigh the activations it has freed (with
/// the fused loss, whose dlogits reuse the logits, it does for small models), so the
/// activations live at that peak are not this number.
fn activation_peak(program: &crate::ir::Program) -> u64 {
    let (mut live, mut peak) = (0u64, 0u64);
    let activation = |b: &BufferId| {
        program
            .buffer(*b)
            .filter(|x| x.kind == crate::ir::BufferKind::Activation)
            .map_or(0, |x| x.bytes())
    };
    for instr in &program.instrs {
        match instr {
            Instr::Alloc { buffer } => {
                live += activation(buffer);
                peak = peak.max(live);
            }
            Instr::Free { buffer } => live -= activation(buffer),
            _ => {}
        }
    }
    peak
}

/// The cost model's estimate against what the verifier measures on the lowered programs
/// (fp32, so both count 4-byte elements): the activation term within 10% of the activations'
/// own peak and the total within 20% of the step's peak (the cost model also counts a gradient
/// bucket, which the peak does not coincide with). ZeRO-2/3 reduce-scatter each microbatch's
/// gradients into the shard, so the cost model's sharded gradients hold for them too.
#[test]
fn cost_model_agrees_with_measured_liveness() {
    let dims = Dims {
        vocab: 256,
        dim: 64,
        seq: 64,
        heads: 4,
        kv_heads: 4,
        ffn: 256,
        layers: 4,
        llama: false,
        tied: false,
    };
    let plans = [
        ("single", PlanChoice::default()),
        (
            "pp 2",
            PlanChoice {
                pp: 2,
                ..PlanChoice::default()
            },
        ),
        (
            "pp 2 gpipe",
            PlanChoice {
                pp: 2,
                schedule: PipelineSchedule::Gpipe,
                ..PlanChoice::default()
            },
        ),
        (
            "tp 2 sp",
            PlanChoice {
                tp: 2,
                sp: true,
                ..PlanChoice::default()
            },
        ),
        (
            "tp 2 sp, gathered inputs kept",
            PlanChoice {
                tp: 2,
                sp: true,
                sp_save: crate::spec::SpSave::Gathered,
                ..PlanChoice::default()
            },
        ),
        (
            "full recompute",
            PlanChoice {
                recompute: Recompute::Full,
                ..PlanChoice::default()
            },
        ),
        (
            "selective recompute",
            PlanChoice {
                recompute: Recompute::Selective,
                ..PlanChoice::default()
            },
        ),
        (
            "dp 2 zero 2",
            PlanChoice {
                dp: 2,
                zero: ZeroStage::Zero2,
                ..PlanChoice::default()
            },
        ),
        (
            "dp 2 zero 3",
            PlanChoice {
                dp: 2,
                zero: ZeroStage::Zero3,
                ..PlanChoice::default()
            },
        ),
        (
            "cp 2",
            PlanChoice {
                cp: 2,
                ..PlanChoice::default()
            },
        ),
    ];
    for (name, choice) in plans {
        let zero = choice.zero;
        let spec = build(&dims, &choice);
        let plan = lower(&spec).unwrap();
        let report = verify(&plan).unwrap();
        let cost = crate::cost::estimate(&spec);
        for (i, measured) in report.programs.iter().enumerate() {
            let stage = plan.programs[i]
                .coords
                .iter()
                .find(|(a, _)| *a == crate::spec::Axis::Pp)
                .map_or(0, |x| x.1);
            let estimated = &cost.roles[stage as usize].memory;
            let act = activation_peak(&plan.programs[i]) as f64;
            let est_act = estimated.activations as f64;
            assert!(
                (est_act - act).abs() <= 0.1 * act,
                "{name} program {i}: activations estimated {est_act}, measured {act}"
            );
            let (est, got) = (estimated.total() as f64, measured.peak_bytes as f64);
            assert!(
                (est - got).abs() <= 0.2 * got,
                "{name} program {i} ({zero:?}): total estimated {est}, measured {got}"
            );
        }
    }
}

/// Per-head q/k norms keep q and k as projected and each head's rstd for the backward: the
/// cost model's activation estimate of a Llama-style model with them (heads twice the width
/// d / heads gives) stays within 10% of the lowered programs' activation peak, and grows by
/// what the peak grows by over the same model without them (within 10% of the growth).
#[test]
fn cost_model_counts_what_qk_norm_keeps() {
    let dims = Dims {
        vocab: 256,
        dim: 64,
        seq: 64,
        heads: 4,
        kv_heads: 2,
        ffn: 256,
        layers: 4,
        llama: true,
        tied: false,
    };
    let with = |spec: &mut crate::spec::Spec, qk: Option<f64>| {
        for n in &mut spec.model.nodes {
            if let crate::spec::LayerKind::Attention {
                qk_norm, head_dim, ..
            } = &mut n.kind
            {
                *qk_norm = qk;
                *head_dim = 32;
            }
        }
    };
    let plans = [
        ("single", PlanChoice::default()),
        (
            "tp 2 sp",
            PlanChoice {
                tp: 2,
                sp: true,
                ..PlanChoice::default()
            },
        ),
        (
            "cp 2",
            PlanChoice {
                cp: 2,
                ..PlanChoice::default()
            },
        ),
    ];
    for (name, choice) in plans {
        let measure = |qk: Option<f64>| {
            let mut spec = build(&dims, &choice);
            with(&mut spec, qk);
            let plan = lower(&spec).unwrap();
            let act = activation_peak(&plan.programs[0]) as f64;
            let est = crate::cost::estimate(&spec).roles[0].memory.activations as f64;
            (act, est)
        };
        let (plain, normed) = (measure(None), measure(Some(1e-6)));
        let (act, est) = normed;
        assert!(
            (est - act).abs() <= 0.1 * act,
            "{name}: activations estimated {est}, measured {act}"
        );
        let (grown, est_grown) = (normed.0 - plain.0, normed.1 - plain.1);
        assert!(grown > 0.0, "{name}: the norms keep nothing");
        assert!(
            (est_grown - grown).abs() <= 0.1 * grown,
            "{name}: qk_norm adds {est_grown} estimated, {grown} measured"
        );
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]
    /// Random damage to a lowered plan (dropped, duplicated or swapped instructions, buffers out
    /// of range) is verified without panicking, and removing or duplicating a `Free` is caught.
    #[test]
    fn damaged_plans_never_panic(
        program in 0usize..8, at in 0usize..100_000, other in 0usize..100_000,
        kind in 0u32..4, buffer in 0u32..100_000,
    ) {
        let mut plan = lowered(PlanChoice {
            pp: 2,
            tp: 2,
            ..PlanChoice::default()
        });
        let p = program % plan.programs.len();
        let instrs = &mut plan.programs[p].instrs;
        let (i, j) = (at % instrs.len(), other % instrs.len());
        let was_free = matches!(instrs[i], Instr::Free { .. });
        match kind {
            0 => {
                instrs.remove(i);
            }
            1 => {
                let copy = instrs[i].clone();
                instrs.insert(i, copy);
            }
            2 => instrs.swap(i, j),
            _ => instrs.insert(i, Instr::Free { buffer: BufferId(buffer) }),
        }
        let outcome = check(&plan);
        let _ = verify_spec(&plan, &build(&Dims::tiny(), &PlanChoice { pp: 2, tp: 2, ..PlanChoice::default() }));
        if was_free && kind <= 1 {
            proptest::prop_assert!(!outcome.violations.is_empty());
        }
    }
}

/// The buffer with `name` in `program` of `plan`.
fn buffer_named(plan: &Plan, program: usize, name: &str) -> BufferId {
    let at = plan.programs[program]
        .buffers
        .iter()
        .position(|b| b.name == name)
        .unwrap_or_else(|| panic!("no buffer {name}"));
    BufferId(at as u32)
}

#[test]
fn a_statistic_stored_in_bf16_is_a_type_error_at_its_first_use() {
    use crate::ir::DType;
    let mut plan = lowered(PlanChoice {
        precision: crate::spec::Precision::Bf16,
        ..PlanChoice::default()
    });
    assert!(check(&plan).violations.is_empty());
    let rstd = plan.programs[0]
        .buffers
        .iter()
        .position(|b| b.name.contains(".rstd@"))
        .unwrap();
    let name = plan.programs[0].buffers[rstd].name.clone();
    plan.programs[0].buffers[rstd].dtype = DType::Bf16;
    let outcome = check(&plan);
    assert_eq!(codes(&outcome)[0], "E0819", "{:#?}", outcome.violations);
    let first_use = plan.programs[0]
        .instrs
        .iter()
        .position(|i| {
            matches!(i, Instr::Compute { .. }) && i.writes().contains(&BufferId(rstd as u32))
        })
        .unwrap();
    let v = &outcome.violations[0];
    assert_eq!(v.instr, first_use);
    assert!(
        v.message.contains(&name) && v.message.contains("takes f32"),
        "{}",
        v.message
    );
    // Token ids in a float buffer are refused too.
    let mut plan = lowered(PlanChoice::default());
    let tokens = buffer_named(&plan, 0, "tokens@0");
    plan.programs[0].buffers[tokens.0 as usize].dtype = DType::F32;
    assert!(codes(&check(&plan)).contains(&"E0819"));
}

#[test]
fn a_transfer_between_types_is_a_mismatch() {
    use crate::ir::DType;
    let mut plan = lowered(PlanChoice {
        pp: 2,
        precision: crate::spec::Precision::Bf16,
        ..PlanChoice::default()
    });
    assert!(check(&plan).violations.is_empty());
    let (p, i, k) = first_recv(&plan);
    let Instr::P2p { ops } = &plan.programs[p].instrs[i] else {
        unreachable!()
    };
    let P2pOp::Recv { buffer, .. } = ops[k] else {
        unreachable!()
    };
    assert_eq!(
        plan.programs[p].buffers[buffer.0 as usize].dtype,
        DType::Bf16
    );
    // The receiving side alone stored in f32 (its uses accept it): the transfer is caught.
    plan.programs[p].buffers[buffer.0 as usize].dtype = DType::F32;
    let outcome = check(&plan);
    let hit = outcome
        .violations
        .iter()
        .find(|v| v.code == "E0816")
        .unwrap_or_else(|| panic!("{:#?}", outcome.violations));
    assert!(
        hit.message.contains("bf16") && hit.message.contains("f32"),
        "{}",
        hit.message
    );
}

#[test]
fn an_accumulating_output_that_is_also_an_input_is_reported() {
    use crate::ir::op::Op;
    use crate::ir::Outputs;
    let mut plan = lowered(PlanChoice::default());
    assert!(check(&plan).violations.is_empty());
    // A backward-data product made to accumulate, bound to its own dy.
    let instrs = &mut plan.programs[0].instrs;
    let at = instrs
        .iter()
        .position(|i| matches!(i.op(), Some(Op::MatmulBwdData { act_grad: None, .. })))
        .expect("a MatmulBwdData");
    if let Instr::Compute {
        op,
        inputs,
        outputs,
        ..
    } = &mut instrs[at]
    {
        if let Op::MatmulBwdData {
            in_dim, out_dim, ..
        } = **op
        {
            *op = std::sync::Arc::new(Op::MatmulBwdData {
                in_dim,
                out_dim,
                accumulate: true,
                act_grad: None,
                swiglu: false,
                fp8: None,
            });
        }
        *outputs = Outputs::from_slice(&[inputs[0]]).unwrap();
    }
    let outcome = check(&plan);
    assert_eq!(codes(&outcome), ["E0821"], "{:#?}", outcome.violations);
    assert_eq!(outcome.violations[0].instr, at);
    assert!(outcome.violations[0].message.contains("also its input 0"));
}

#[test]
fn an_accumulating_activation_gradient_is_reported() {
    use crate::ir::op::{Act, Op};
    use std::sync::Arc;
    let mut plan = lowered(PlanChoice::default());
    assert!(check(&plan).violations.is_empty());
    // The fused GELU gradient of the MLP's second projection, made to accumulate.
    let instrs = &mut plan.programs[0].instrs;
    let at = instrs
        .iter()
        .position(|i| {
            matches!(
                i.op(),
                Some(Op::MatmulBwdData {
                    act_grad: Some(_),
                    ..
                })
            )
        })
        .expect("a MatmulBwdData with act_grad");
    if let Instr::Compute { op, .. } = &mut instrs[at] {
        if let Op::MatmulBwdData {
            in_dim, out_dim, ..
        } = **op
        {
            *op = Arc::new(Op::MatmulBwdData {
                in_dim,
                out_dim,
                accumulate: true,
                act_grad: Some(Act::GeluTanh),
                swiglu: false,
                fp8: None,
            });
        }
    }
    let outcome = check(&plan);
    assert_eq!(codes(&outcome), ["E0822"], "{:#?}", outcome.violations);
    assert_eq!(outcome.violations[0].instr, at);
}

#[test]
fn an_overwrite_of_a_gradient_written_before_is_reported() {
    use crate::ir::op::Op;
    use std::sync::Arc;
    let mut plan = lowered(PlanChoice::default());
    assert!(check(&plan).violations.is_empty());
    // The last parameter-gradient op that adds (a later micro-batch's contribution, or the
    // tied embedding's second product), made to overwrite what the first one wrote.
    let instrs = &mut plan.programs[0].instrs;
    let at = instrs
        .iter()
        .rposition(|i| matches!(i.op().and_then(Op::param_grad_outputs), Some((_, true))))
        .expect("an adding parameter-gradient op");
    if let Instr::Compute { op, .. } = &mut instrs[at] {
        *op = Arc::new(op.with_param_grad_accumulation(false));
    }
    let outcome = check(&plan);
    assert_eq!(codes(&outcome), ["E0823"], "{:#?}", outcome.violations);
    assert_eq!(outcome.violations[0].instr, at);
}

#[test]
fn a_check_keeps_its_first_sixteen_violations_per_program() {
    let mut found = Findings::new(ProgramId(2), 5);
    let mut built = 0;
    for i in 0..40 {
        found.push("E0820", i, None, || {
            built += 1;
            format!("violation {i}")
        });
    }
    let found = found.into_vec();
    assert_eq!(found.len(), 16);
    assert_eq!(built, 16, "messages past the limit are not built");
    assert_eq!((found[3].instr, found[3].rank), (3, 5));
    assert_eq!(found[3].program, ProgramId(2));
    assert_eq!(found[15].message, "violation 15");
}

/// A model applying `.par` functions in its dataflow (elementwise layers, which keep their
/// inputs): the cost model's activation term stays within 10% of the activations' measured
/// peak, as for the layers above, with and without tp and sequence parallelism.
#[test]
fn cost_model_counts_elementwise_layers() {
    use crate::driver::{compile, CompileOptions, Stage};
    for (tp, sp) in [(1, false), (2, false), (2, true)] {
        let text = format!(
            "fn gate(a, b) = a * sigmoid(b)
block B(d, heads, ffn)(x) {{
  h = x + Attention(d, heads, causal = true)(LayerNorm(d)(x))
  m = MLP(d, ffn, act = gelu)(LayerNorm(d)(h))
  h + gate(m, squared_relu(h))
}}
model m {{
  let vocab = 256; let d = 64; let seq = 64
  input tokens  : [batch, seq] i32
  input targets : [batch, seq] i32
  x = Embedding(vocab, d)(tokens) + PositionEmbedding(seq, d)
  x = repeat 4 {{ B(d, 4, 256)(x) }}
  logits = Linear(d, vocab, bias = false, tied = Embedding)(LayerNorm(d)(x) as ln_f) as head
  loss = CrossEntropy(logits, targets)
  shard Embedding.vocab on tp
  shard Attention.heads on tp
  shard MLP.hidden on tp
}}
parallel {{ mesh = {{ dp: 1, pp: 1, cp: 1, tp: {tp} }}; sequence_parallel = {sp} }}
train {{ global_batch = 8; micro_batch = 2; steps = 2 }}
cluster {{ nodes = 1; gpus_per_node = {tp}; gpu = cpu }}
"
        );
        let mut options = CompileOptions::through(Stage::Verify);
        options.fusion = false;
        options.cost_model = true;
        let c = compile("t.par", text, &[], &options);
        assert!(!c.diagnostics.has_errors(), "{:?}", c.diagnostics.items);
        let (plan, cost) = (c.plan.expect("a plan"), c.cost.expect("a cost report"));
        let est = cost.roles[0].memory.activations as f64;
        for program in &plan.programs {
            let act = activation_peak(program) as f64;
            assert!(
                (est - act).abs() <= 0.1 * act,
                "tp {tp} sp {sp}: activations estimated {est}, measured {act}"
            );
        }
    }
}

/// A tensorwise FP8 plan (every layer pinned FP8) of `choice`.
fn lowered_fp8(choice: PlanChoice, scaling: crate::ir::fp8::Fp8Scaling) -> Plan {
    lowered_fp8_history(choice, scaling, None)
}

/// [`lowered_fp8`] with delayed scaling's amax `history` (None: current scaling).
fn lowered_fp8_history(
    choice: PlanChoice,
    scaling: crate::ir::fp8::Fp8Scaling,
    history: Option<u32>,
) -> Plan {
    let mut spec = build(&Dims::tiny(), &choice);
    spec.train.precision = crate::spec::Precision::Bf16;
    spec.train.fp8 = Some(crate::spec::Fp8 {
        scaling,
        grad: crate::ir::fp8::Fp8Format::E4m3,
        history,
        keep_bf16: Vec::new(),
        force_fp8: vec!["Attention".into(), "MLP".into(), "Linear".into()],
        shared_quantization: true,
        span: Default::default(),
    });
    match lower(&spec) {
        Ok(p) => p,
        Err(d) => panic!("{:?}", d.items),
    }
}

/// The first `all_reduce max` of an FP8 amax in program 0 whose group spans exactly `axes`:
/// its instruction index.
fn amax_reduction(plan: &Plan, axes: &[crate::spec::Axis]) -> usize {
    let program = &plan.programs[0];
    let amax = |b: &BufferId| program.buffers[b.0 as usize].name.contains("amax");
    (program.instrs.iter())
        .position(|i| match i {
            Instr::Collective { group, input, .. } => {
                amax(input) && plan.groups[group.0 as usize].axes == axes
            }
            _ => false,
        })
        .expect("an amax reduction over those axes")
}

/// Swap the group of the collective at `at` in program 0 for the family spanning `axes`.
fn regroup(plan: &mut Plan, at: usize, axes: &[crate::spec::Axis]) {
    let family = (plan.groups.iter()).position(|g| g.axes == axes);
    let family = crate::ir::GroupId(family.expect("a family over those axes") as u32);
    if let Instr::Collective { group, .. } = &mut plan.programs[0].instrs[at] {
        *group = family;
    }
}

#[test]
fn fp8_amaxes_reduced_over_the_wrong_group_are_reported() {
    use crate::ir::fp8::Fp8Scaling;
    use crate::spec::Axis;
    let cp_tp = PlanChoice {
        cp: 2,
        tp: 2,
        ..PlanChoice::default()
    };
    let plan = lowered_fp8(cp_tp, Fp8Scaling::Tensorwise);
    assert!(
        check(&plan).violations.is_empty(),
        "{:#?}",
        check(&plan).violations
    );
    // A row-parallel input under cp × tp: its tensor's pieces are on every cp and tp rank.
    let at = amax_reduction(&plan, &[Axis::Cp, Axis::Tp]);
    // Reduced over tp alone (a subset, Megatron-LM PR#442's bug): each cp rank gets its
    // own scale for one group.
    let mut subset = plan.clone();
    regroup(&mut subset, at, &[Axis::Tp]);
    let found = check(&subset);
    assert!(codes(&found).contains(&"E0824"), "{:#?}", found.violations);
    let v = found
        .violations
        .iter()
        .find(|v| v.code == "E0824")
        .expect("E0824");
    assert!(
        v.message.contains("reduced over tp") && v.message.contains("exactly cp+tp"),
        "{}",
        v.message
    );
    // A weight split over tp only, reduced over cp and tp (a superset).
    let at = amax_reduction(&plan, &[Axis::Tp]);
    let mut superset = plan.clone();
    regroup(&mut superset, at, &[Axis::Cp, Axis::Tp]);
    assert!(codes(&check(&superset)).contains(&"E0824"));
    // No reduction at all: the GEMM reads amaxes its Fp8Amax computed on the piece alone.
    let mut none = plan.clone();
    none.programs[0].instrs.remove(at);
    assert!(codes(&check(&none)).contains(&"E0824"));
}

/// Delayed scaling: each history must be reduced over exactly its operand's shared axes and
/// dp before its roll, and each training GEMM must record its operand first.
#[test]
fn fp8_histories_reduced_over_the_wrong_group_or_unrecorded_are_reported() {
    use crate::ir::fp8::Fp8Scaling;
    use crate::ir::op::Op;
    use crate::spec::Axis;
    let dp_tp = PlanChoice {
        dp: 2,
        tp: 2,
        ..PlanChoice::default()
    };
    let plan = lowered_fp8_history(dp_tp, Fp8Scaling::Tensorwise, Some(4));
    let found = check(&plan);
    assert!(found.violations.is_empty(), "{:#?}", found.violations);
    let program = &plan.programs[0];
    let history = |b: &BufferId| program.buffers[b.0 as usize].name.ends_with("amax_history");
    let reduction = |axes: &[Axis]| {
        (program.instrs.iter())
            .position(|i| match i {
                Instr::Collective { group, input, .. } => {
                    history(input) && plan.groups[group.0 as usize].axes == axes
                }
                _ => false,
            })
            .expect("a history reduction over those axes")
    };
    // Without its dp reduction, each replica would roll its own microbatches' amax.
    let mut no_dp = plan.clone();
    no_dp.programs[0].instrs.remove(reduction(&[Axis::Dp]));
    let found = check(&no_dp);
    let v = (found.violations.iter()).find(|v| v.code == "E0824");
    assert!(
        v.is_some_and(
            |v| v.message.contains("max-reduced over 1") && v.message.contains("the ranks of dp")
        ),
        "{:#?}",
        found.violations
    );
    // A tp piece's history reduced over dp twice, not over tp.
    let mut wrong = plan.clone();
    regroup(&mut wrong, reduction(&[Axis::Tp]), &[Axis::Dp]);
    assert!(codes(&check(&wrong)).contains(&"E0824"));
    // A GEMM whose operand was never recorded.
    let mut unrecorded = plan.clone();
    let record = (program.instrs.iter())
        .position(|i| i.op().is_some_and(|op| matches!(op, Op::Fp8AmaxRecord(_))))
        .expect("a record");
    unrecorded.programs[0].instrs.remove(record);
    assert!(codes(&check(&unrecorded)).contains(&"E0824"));
    // A record that no GEMM follows (a copy at the program's start): nothing would record it
    // on the CUDA backend, which takes records in the following GEMM's quantize pass.
    let mut stray = plan.clone();
    let copy = program.instrs[record].clone();
    stray.programs[0].instrs.insert(0, copy);
    let found = check(&stray);
    let v = (found.violations.iter())
        .find(|v| v.code == "E0824" && v.message.contains("must record it"));
    assert!(v.is_some_and(|v| v.instr == 0), "{:#?}", found.violations);
}

#[test]
fn fp8_splits_must_agree_with_the_plan() {
    use crate::ir::fp8::{Axes, Fp8Scaling};
    use crate::spec::Axis;
    let tp = PlanChoice {
        tp: 2,
        ..PlanChoice::default()
    };
    let mut plan = lowered_fp8(tp, Fp8Scaling::Rowwise);
    assert!(
        check(&plan).violations.is_empty(),
        "{:#?}",
        check(&plan).violations
    );
    // Claim a token operand's rows are split by dp: dp splits no scale group.
    let program = &mut plan.programs[0];
    let at = (program.instrs.iter())
        .position(|i| i.op().is_some_and(|op| op.fp8().is_some()))
        .expect("an FP8 GEMM");
    if let Instr::Compute { op, .. } = &mut program.instrs[at] {
        let mut g = op.fp8().expect("fp8");
        g.split[0].rows = Axes::of(&[Axis::Dp]);
        *op = std::sync::Arc::new(op.with_fp8(Some(g)));
    }
    assert!(codes(&check(&plan)).contains(&"E0824"));
}

/// A quantized FP8 GEMM must read its operands as an `Fp8Quantize` of each wrote them, in the
/// operand's layout, with its scale amax, and the operand unchanged since.
#[test]
fn fp8_quantized_operands_must_be_their_operands_quantization() {
    use crate::ir::fp8::Fp8Scaling;
    use crate::ir::op::Op;
    let plan = lowered_fp8(PlanChoice::default(), Fp8Scaling::Tensorwise);
    assert!(
        check(&plan).violations.is_empty(),
        "{:#?}",
        check(&plan).violations
    );
    let program = &plan.programs[0];
    let quantized = |op: &Op| op.fp8().is_some_and(|f| f.quantized);
    let computes: Vec<(usize, Op, Vec<BufferId>)> = (program.computes())
        .map(|(i, c)| (i, c.op.clone(), c.inputs.to_vec()))
        .collect();
    let (at, _, inputs) = (computes.iter().find(|(_, op, _)| quantized(op)))
        .expect("a quantized GEMM")
        .clone();
    let n = inputs.len();
    let rebind = |inputs: Vec<BufferId>| {
        let mut p = plan.clone();
        if let Instr::Compute { inputs: ins, .. } = &mut p.programs[0].instrs[at] {
            *ins = crate::ir::Inputs::from_slice(&inputs).expect("fits");
        }
        p
    };
    // Its two quantized operands swapped: each the other operand's quantization.
    let mut swapped = inputs.clone();
    swapped.swap(n - 2, n - 1);
    let found = check(&rebind(swapped));
    let v = (found.violations.iter()).find(|v| v.code == "E0824");
    assert!(
        v.is_some_and(|v| v.message.contains("quantized operand")),
        "{:#?}",
        found.violations
    );
    // The operand rewritten between its quantization and the GEMM.
    let quantize = (computes.iter().rev())
        .find(|(i, op, ins)| *i < at && matches!(op, Op::Fp8Quantize(_)) && ins[0] == inputs[0])
        .expect("the operand's Fp8Quantize")
        .0;
    let mut rewritten = plan.clone();
    let zero = Instr::Compute {
        op: std::sync::Arc::new(Op::Zero),
        inputs: crate::ir::Inputs::from_slice(&[]).expect("empty"),
        outputs: crate::ir::Outputs::from_slice(&[inputs[0]]).expect("one"),
        node: None,
        phase: crate::ir::Phase::Forward,
    };
    rewritten.programs[0].instrs.insert(quantize + 1, zero);
    let found = check(&rewritten);
    assert!(
        (found.violations.iter())
            .any(|v| v.code == "E0824" && v.message.contains("writes the operand")),
        "{:#?}",
        found.violations
    );
}
