//! bf16 activation storage in the lowering: which buffers a `precision = bf16` plan stores in
//! bf16, that every such plan verifies (operand types, collective and transfer types) over the
//! plan matrix, and that fp32 plans keep every float buffer f32.

use super::fixtures::{spec, PlanChoice, TinyModel};
use parc_compiler::ir::{BufferKind, DType, Plan};
use parc_compiler::lower::lower;
use parc_compiler::spec::{PipelineSchedule, Precision, Recompute, ZeroStage};

fn bf16_plan(model: TinyModel, choice: PlanChoice) -> Plan {
    let mut s = spec(model, choice);
    s.train.precision = Precision::Bf16;
    let plan = lower(&s).unwrap();
    if let Err(d) = parc_compiler::verify::verify_spec(&plan, &s) {
        let msgs: Vec<String> = d.items.iter().map(|x| x.message.clone()).collect();
        panic!("verifier: {}", msgs.join("\n"));
    }
    plan
}

fn model(llama: bool) -> TinyModel {
    TinyModel {
        layers: 2,
        llama,
        tied: !llama,
    }
}

#[test]
fn activations_are_bf16_and_everything_else_f32() {
    for llama in [false, true] {
        let plan = bf16_plan(model(llama), PlanChoice::default());
        let program = &plan.programs[0];
        let dtype = |name: &str| {
            program
                .buffers
                .iter()
                .find(|b| b.name == name)
                .unwrap_or_else(|| panic!("no buffer {name}"))
                .dtype
        };
        let mut bf16 = 0;
        for b in &program.buffers {
            let stat = ["mean", "rstd", "lse", "max", "sumexp", "target"]
                .iter()
                .any(|s| b.name.contains(&format!(".{s}@")));
            match b.kind {
                BufferKind::Activation | BufferKind::ActivationGrad if stat => {
                    assert_eq!(b.dtype, DType::F32, "{}", b.name)
                }
                BufferKind::Input => assert_eq!(b.dtype, DType::I32, "{}", b.name),
                BufferKind::Activation | BufferKind::ActivationGrad => {
                    if b.dtype == DType::Bf16 {
                        bf16 += 1;
                    }
                }
                // Weight matrices compute reads are bf16 working copies (issue 21); their
                // masters, vectors, gradients and optimizer state f32.
                BufferKind::Param if b.shape.len() == 2 && !b.name.ends_with(".master") => {
                    assert_eq!(b.dtype, DType::Bf16, "{}", b.name)
                }
                _ => assert_eq!(b.dtype, DType::F32, "{}: {:?}", b.name, b.kind),
            }
        }
        assert!(bf16 > 20, "only {bf16} bf16 buffers");
        // A GEMM output and its gradient are bf16.
        let q = program
            .buffers
            .iter()
            .find(|b| b.name.contains("attn") && b.dtype == DType::Bf16);
        assert!(q.is_some());
        assert_eq!(dtype("loss"), DType::F32);
    }
}

#[test]
fn bf16_plans_verify_over_the_plan_matrix() {
    for (dp, pp, cp, tp, zero, schedule, recompute, sp) in [
        (
            2,
            2,
            2,
            2,
            ZeroStage::Zero3,
            PipelineSchedule::OneFOneB,
            Recompute::None,
            false,
        ),
        (
            2,
            2,
            1,
            2,
            ZeroStage::Zero1,
            PipelineSchedule::Gpipe,
            Recompute::Selective,
            true,
        ),
        (
            1,
            2,
            2,
            2,
            ZeroStage::Zero2,
            PipelineSchedule::Interleaved { virtual_stages: 2 },
            Recompute::Full,
            true,
        ),
    ] {
        for llama in [false, true] {
            let choice = PlanChoice {
                schedule,
                microbatches: 4,
                recompute: recompute.clone(),
                sp,
                ..PlanChoice::mesh(dp, pp, cp, tp, zero)
            };
            let plan = bf16_plan(
                TinyModel {
                    layers: 4,
                    llama,
                    tied: !llama,
                },
                choice,
            );
            assert!(plan.programs.iter().all(|p| p.uses_bf16()));
        }
    }
}

#[test]
fn bf16_halves_the_activation_bytes() {
    let fp32 = lower(&spec(model(false), PlanChoice::default())).unwrap();
    let bf16 = bf16_plan(model(false), PlanChoice::default());
    let fp32_program = &fp32.programs[0];
    assert!(!fp32_program.uses_bf16());
    let bytes = |p: &parc_compiler::ir::Program| p.buffers.iter().map(|b| b.bytes()).sum::<u64>();
    let (full, half) = (bytes(fp32_program), bytes(&bf16.programs[0]));
    assert!(half < full, "{half} !< {full}");
    // Widening for a backend without bf16 storage gives back the fp32 program's buffers, plus
    // the f32 masters beside the weight matrices' working copies (issue 21).
    let widened: Vec<_> = bf16.programs[0]
        .with_f32_storage()
        .buffers
        .into_iter()
        .filter(|b| !b.name.ends_with(".master"))
        .collect();
    assert_eq!(widened, fp32_program.buffers);
}
