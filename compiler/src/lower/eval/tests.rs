use super::append;
use crate::cost::testspec::{build, Plan as Choice};
use crate::ir::op::Op;
use crate::ir::{Instr, Phase, Plan};
use crate::lower::{lower, lower_with, LowerOptions};
use crate::spec::{Eval, PipelineSchedule, Precision, Recompute, Spec, ZeroStage};
use crate::testing::Dims;

fn with_eval(choice: &Choice) -> Spec {
    let mut spec = build(&Dims::tiny(), choice);
    spec.train.eval = Some(Eval {
        every: 2,
        batches: 3,
        data: None,
        span: Default::default(),
    });
    spec
}

/// One plan of each kind the evaluation step must handle.
fn choices() -> Vec<Choice> {
    let base = Choice::default;
    vec![
        base(),
        Choice { dp: 2, ..base() },
        Choice {
            dp: 2,
            zero: ZeroStage::Zero1,
            ..base()
        },
        Choice {
            dp: 2,
            zero: ZeroStage::Zero3,
            ..base()
        },
        Choice {
            tp: 2,
            sp: true,
            precision: Precision::Bf16,
            ..base()
        },
        Choice { pp: 2, ..base() },
        Choice {
            pp: 2,
            schedule: PipelineSchedule::Gpipe,
            ..base()
        },
        Choice {
            pp: 2,
            schedule: PipelineSchedule::Interleaved { virtual_stages: 2 },
            ..base()
        },
        Choice { cp: 2, ..base() },
        Choice {
            recompute: Recompute::Full,
            ..base()
        },
        Choice {
            recompute: Recompute::Selective,
            ..base()
        },
    ]
}

#[test]
fn every_plan_evaluates_forward_only_over_its_training_tables() {
    for choice in choices() {
        let spec = with_eval(&choice);
        let plan = lower(&spec).unwrap_or_else(|d| panic!("{d:?}"));
        let what = format!(
            "dp {} pp {} cp {} tp {} {:?} {:?} {:?}",
            choice.dp,
            choice.pp,
            choice.cp,
            choice.tp,
            choice.zero,
            choice.schedule,
            choice.recompute
        );
        assert_eq!(plan.eval.len(), plan.programs.len(), "{what}");
        for (training, eval) in plan.programs.iter().zip(&plan.eval) {
            assert_eq!(
                &eval.buffers[..training.buffers.len()],
                training.buffers.as_slice(),
                "{what}"
            );
            assert_eq!(eval.loss, training.loss, "{what}");
            for (_, c) in eval.computes() {
                assert_eq!(c.phase, Phase::Forward, "{what}: {:?}", c.op);
            }
            let loads = eval
                .instrs
                .iter()
                .filter(|i| matches!(i, Instr::LoadBatch { .. }))
                .count();
            let loads_in_training = training
                .instrs
                .iter()
                .filter(|i| matches!(i, Instr::LoadBatch { .. }))
                .count();
            assert_eq!(loads, loads_in_training, "{what}");
            let joint = training.followed_by(eval).unwrap();
            crate::memplan::plan_program(&joint).unwrap_or_else(|e| panic!("{what}: {e}"));
        }
        let eval_plan = plan.eval_plan().unwrap();
        crate::verify::verify_spec(&eval_plan, &spec).unwrap_or_else(|d| panic!("{what}: {d:?}"));
        // The training step is the one lowered without evaluation.
        let mut without = spec.clone();
        without.train.eval = None;
        let plain = lower(&without).unwrap();
        assert!(plain.eval.is_empty());
        let json = |p: &Plan| serde_json::to_string(p).unwrap();
        assert_eq!(json(&plan), json(&plain), "{what}");
    }
}

#[test]
fn an_analysis_plan_has_no_evaluation_step() {
    let spec = with_eval(&Choice {
        tp: 4,
        ..Choice::default()
    });
    let options = LowerOptions {
        representatives: true,
        ..LowerOptions::default()
    };
    assert!(lower_with(&spec, options).unwrap().eval.is_empty());
}

#[test]
fn an_evaluation_step_that_writes_a_parameter_is_refused() {
    let plan = lower(&with_eval(&Choice::default())).unwrap();
    let training = &plan.programs[0];
    let master = training.params[0].master;
    let mut eval = training.clone();
    eval.instrs = vec![Instr::compute(Op::Zero, &[], &[master.0])];
    let err = append(training, eval).unwrap_err();
    let name = &training.buffers[master.0 as usize].name;
    assert!(err.contains(&format!("writes `{name}`")), "{err}");
    let mut other = training.clone();
    other.buffers[master.0 as usize].shape = vec![1];
    let err = append(training, other).unwrap_err();
    assert!(
        err.contains("parameters are not") || err.contains("persistent buffer"),
        "{err}"
    );
}
