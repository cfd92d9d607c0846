//! bf16 activation storage in the lowering: which buffers a `precision = bf16` plan stores in
//! bf16, that every such plan verifies (operand types, collective and transfer types) over the
//! plan matrix, and that fp32 plans keep every float buffer f32; with `bf16 { residual: fp32 }`,
//! that the residual stream and its gradient alone stay f32, over the plan matrix too.

use super::fixtures::{spec, PlanChoice, TinyModel};
use parc_compiler::ir::{BufferKind, DType, Plan};
use parc_compiler::lower::lower;
use parc_compiler::spec::{PipelineSchedule, Precision, Recompute, ZeroStage};

fn bf16_plan(model: TinyModel, choice: PlanChoice) -> Plan {
    bf16_plan_with(model, choice, false)
}

/// A bf16 plan, its residual stream kept f32 where `fp32_residual` (`bf16 { residual: fp32 }`).
fn bf16_plan_with(model: TinyModel, choice: PlanChoice, fp32_residual: bool) -> Plan {
    let mut s = spec(model, choice);
    s.train.precision = Precision::Bf16;
    s.train.fp32_residual = fp32_residual;
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

/// Every plan of a small matrix (dp, pp, cp, tp, ZeRO, schedule, recompute, SP), GPT-2 and
/// Llama, lowered in bf16 (its residual stream f32 where `fp32_residual`) and verified: operand,
/// collective and transfer types agree everywhere, and every program stores bf16.
fn assert_bf16_plans_verify(fp32_residual: bool) {
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
            let m = TinyModel {
                layers: 4,
                llama,
                tied: !llama,
            };
            let plan = bf16_plan_with(m, choice, fp32_residual);
            assert!(plan.programs.iter().all(|p| p.uses_bf16()));
        }
    }
}

#[test]
fn bf16_plans_verify_over_the_plan_matrix() {
    assert_bf16_plans_verify(false);
}

#[test]
fn an_fp32_residual_keeps_the_stream_and_its_gradient_f32_and_nothing_else() {
    for llama in [false, true] {
        let plain = bf16_plan(model(llama), PlanChoice::default());
        let residual = bf16_plan_with(model(llama), PlanChoice::default(), true);
        let (plain, residual) = (&plain.programs[0], &residual.programs[0]);
        assert_eq!(plain.buffers.len(), residual.buffers.len());
        let mut widened = Vec::new();
        for (a, b) in plain.buffers.iter().zip(&residual.buffers) {
            assert_eq!((&a.name, &a.shape), (&b.name, &b.shape));
            if a.dtype != b.dtype {
                assert_eq!((a.dtype, b.dtype), (DType::Bf16, DType::F32), "{}", a.name);
                widened.push(b.name.as_str());
            }
        }
        // The stream: the embedding's output (GPT-2's after its positions are added), each
        // block's two sums (GEMMs adding the residual), and the one buffer its gradient
        // accumulates in, per microbatch.
        let stream = |n: &str| {
            let base = n.split('@').next().unwrap_or(n);
            ["embed.y", "pos.y", "ln_f.dx"].contains(&base)
                || base.ends_with(".attn.y")
                || base.ends_with(".mlp.y")
        };
        assert!(
            widened.iter().all(|n| stream(n)),
            "llama {llama}: {widened:?}"
        );
        let first: Vec<_> = widened.iter().filter(|n| n.ends_with("@0")).collect();
        let sums = 2 * model(llama).layers as usize;
        assert_eq!(first.len(), 1 + sums + 1, "llama {llama}: {widened:?}");
        assert!(residual.uses_bf16(), "the branches stay bf16");
    }
}

#[test]
fn fp32_residual_plans_verify_over_the_plan_matrix() {
    // The verifier checks transfer types: a stage's stream goes to the next stage f32 and its
    // gradient comes back f32, and collectives keep one type on both sides.
    assert_bf16_plans_verify(true);
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
