//! Per-step differential test: the same lowered single-GPU program trained for a few steps on
//! the CUDA and CPU backends (GPT-style: LayerNorm, learned positions, GELU; Llama-style:
//! RMSNorm, RoPE, SwiGLU, GQA) gives the same loss and gradient norm every step, within
//! 1e-4 relative at step 1 and 1e-3 after (fp32 rounding differences grow through AdamW).
//! The same models with `precision = bf16` on CUDA (GEMM operands in bf16) against the fp32 CPU
//! run: loss within 1e-2 relative and gradient norm within 2e-2 at every step, and at least one
//! step must differ by more than 1e-5 (proof that bf16 rounding happened at all). The CUDA
//! backend stores a bf16 plan's activations in bf16 (`Backend::stores_bf16`), as the CPU does,
//! and the two bf16 runs agree within the same tolerances (the GPU also rounds GEMM weights,
//! the CPU does not).
//! `precision = fp16` with dynamic loss scaling (init 1024, doubling every 2 clean steps) on
//! CUDA (GEMM operands in fp16) against the fp32 CPU run: the same tolerances (fp16 rounds
//! more finely than bf16; the 1e-2 loss tolerance is the brief's), the same loss scales, no
//! skipped step, and rounding visible; and a scale of 2^120 overflows fp16 on the GPU as it
//! overflows f32 on the CPU: every step skipped, the parameters the initial ones bit for bit.
//! The CUDA runs fill the buffers the memory plan exempts from zero-filling with NaN until
//! written (`CudaBackend::poison_unzeroed`), so a kernel that reads one first fails the loss.
//! Qwen3's per-head q/k norms (head_dim 64 and 128) train on CUDA as on the CPU, in fp32 and
//! in bf16 storage, their trained weights equal within 1e-3.
//! Checkpoints cross backends: a CUDA run's checkpoint resumes on the CPU and the reverse, and
//! the resumed losses match an uninterrupted run. The fused optimizer (one launch per run of
//! updates) gives the per-tensor launches' parameters and state bit for bit on the same inputs
//! (AdamW, also with widths that are not multiples of 4; SGD, an fp16 overflow step, a ZeRO-1
//! rank), and in bf16 also the working copies its launch refreshes in place of each weight
//! matrix's `Copy`, and a bf16 run's losses with and without it. Without a GPU every GPU test prints
//! `skipped: no CUDA device (…)`; the run detection on the lowered programs needs none.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;
#[cfg(feature = "cuda")]
#[path = "gpu_support/mod.rs"]
mod gpu_support;

use fixtures::{gpt2_124m, sized_spec, train_cpu, Dims, PlanChoice, TinyModel};
use parc_compiler::ir::fp8::{Fp8Format, Fp8Scaling};
use parc_compiler::lower::lower;
use parc_compiler::spec::{Checkpointing, Fp8, LayerKind, LossScale, Precision, Spec, ZeroStage};
use parc_runtime::exec::{StepRecord, TrainOptions, TrainResult};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, PartialEq)]
enum Which {
    Cpu,
    Cuda,
}

#[cfg(feature = "cuda")]
fn gpu_present() -> bool {
    gpu_support::backend_or_skip(parc_compiler::spec::Precision::Fp32).is_some()
}

#[cfg(not(feature = "cuda"))]
fn gpu_present() -> bool {
    println!("skipped: no CUDA device (this build has no `cuda` feature)");
    false
}

fn model_spec(llama: bool, steps: u64) -> Spec {
    planned_model_spec(llama, steps, PlanChoice::default())
}

fn planned_model_spec(llama: bool, steps: u64, choice: PlanChoice) -> Spec {
    let dims = Dims {
        vocab: 96,
        dim: 64,
        seq: 32,
        heads: 4,
        kv_heads: if llama { 2 } else { 4 },
        ffn: 128,
        micro_batch: 4,
    };
    let mut s = sized_spec(
        TinyModel {
            layers: 2,
            llama,
            tied: !llama,
        },
        choice,
        dims,
    );
    s.train.steps = steps;
    s
}

fn run(s: &Spec, which: Which, stop_after: Option<u64>, resume: Option<&Path>) -> TrainResult {
    let plan = lower(s).unwrap_or_else(|d| panic!("{:?}", d.items));
    let options = train_options(stop_after, resume);
    let result = match which {
        Which::Cpu => train_cpu(s, &plan, &options),
        #[cfg(feature = "cuda")]
        Which::Cuda => train_cuda(s, &plan, &options, true),
        #[cfg(not(feature = "cuda"))]
        Which::Cuda => unreachable!("gpu_present() is false without the cuda feature"),
    };
    result.unwrap_or_else(|e| panic!("{e}"))
}

fn train_options(stop_after: Option<u64>, resume: Option<&Path>) -> TrainOptions {
    let mut options = TrainOptions::new(".");
    options.threads_per_rank = Some(1);
    options.stop_after = stop_after;
    options.resume = resume.map(Path::to_path_buf);
    options
}

/// `plan` of `s` trained on CUDA, the fused optimizer on or off (`fused`).
#[cfg(feature = "cuda")]
fn train_cuda(
    s: &Spec,
    plan: &parc_compiler::ir::Plan,
    options: &TrainOptions,
    fused: bool,
) -> parc_runtime::error::Result<TrainResult> {
    train_cuda_with(s, plan, options, &|backend| {
        backend.with_fused_optimizer(fused)
    })
}

/// `plan` of `s` trained on CUDA, each rank's backend set up by `setup` first.
#[cfg(feature = "cuda")]
fn train_cuda_with(
    s: &Spec,
    plan: &parc_compiler::ir::Plan,
    options: &TrainOptions,
    setup: &(dyn Fn(parc_runtime::cuda::CudaBackend) -> parc_runtime::cuda::CudaBackend + Sync),
) -> parc_runtime::error::Result<TrainResult> {
    parc_runtime::exec::train(
        s,
        plan,
        options,
        |rank, _| {
            // Buffers exempt from zero-filling hold NaN until written, as on the CPU.
            parc_runtime::cuda::CudaBackend::with_precision(rank as usize, s.train.precision).map(
                |backend| {
                    let mut backend = setup(backend);
                    backend.poison_unzeroed();
                    backend
                },
            )
        },
        &|_| {},
    )
}

fn compare(name: &str, cuda: &[StepRecord], cpu: &[StepRecord]) {
    compare_within(name, cuda, cpu, |step| {
        let tol = if step == 0 { 1e-4 } else { 1e-3 };
        (tol, tol)
    });
}

/// Compares per step; `tols(step)` gives the (loss, grad norm) relative tolerances. Returns the
/// largest relative difference seen.
fn compare_within(
    name: &str,
    cuda: &[StepRecord],
    cpu: &[StepRecord],
    tols: impl Fn(u64) -> (f32, f32),
) -> f32 {
    assert_eq!(cuda.len(), cpu.len(), "{name}: step counts");
    let mut largest = 0.0f32;
    for (g, c) in cuda.iter().zip(cpu) {
        let (loss_tol, norm_tol) = tols(g.step);
        let loss_err = (g.loss - c.loss).abs() / c.loss.abs();
        let norm_err = (g.grad_norm - c.grad_norm).abs() / c.grad_norm.abs();
        println!(
            "{name} step {}: loss cuda {:.6} cpu {:.6} (rel {loss_err:.2e}, tol {loss_tol:.0e}); grad norm cuda {:.6} cpu {:.6} (rel {norm_err:.2e}, tol {norm_tol:.0e})",
            g.step, g.loss, c.loss, g.grad_norm, c.grad_norm
        );
        assert!(
            loss_err <= loss_tol && norm_err <= norm_tol,
            "{name} step {}: CUDA and CPU differ",
            g.step
        );
        largest = largest.max(loss_err).max(norm_err);
    }
    largest
}

/// `precision = bf16` on CUDA against the fp32 CPU run of the same model.
fn bf16_matches_cpu(name: &str, llama: bool) {
    if !gpu_present() {
        return;
    }
    let mut s = model_spec(llama, 6);
    s.train.precision = Precision::Bf16;
    let cuda = run(&s, Which::Cuda, None, None);
    s.train.precision = Precision::Fp32;
    let cpu = run(&s, Which::Cpu, None, None);
    let largest = compare_within(name, &cuda.records, &cpu.records, |_| (1e-2, 2e-2));
    assert!(
        largest > 1e-5,
        "{name}: bf16 agrees with fp32 to {largest:.1e}: no bf16 rounding took place"
    );
}

#[cfg(feature = "cuda")]
fn cuda_stores_bf16() -> bool {
    use parc_runtime::backend::Backend;
    parc_runtime::cuda::CudaBackend::with_precision(0, Precision::Bf16)
        .is_ok_and(|b| b.stores_bf16())
}

#[cfg(not(feature = "cuda"))]
fn cuda_stores_bf16() -> bool {
    false
}

/// `precision = bf16` on both backends, each storing the activations in bf16.
fn bf16_storage_matches_cpu_bf16(name: &str, llama: bool) {
    if !gpu_present() {
        return;
    }
    assert!(
        cuda_stores_bf16(),
        "{name}: the CUDA backend does not store bf16"
    );
    let mut s = model_spec(llama, 6);
    s.train.precision = Precision::Bf16;
    let cuda = run(&s, Which::Cuda, None, None);
    let cpu = run(&s, Which::Cpu, None, None);
    compare_within(name, &cuda.records, &cpu.records, |_| (1e-2, 2e-2));
}

/// `s` with every attention and MLP projection pinned to tensorwise FP8 (E5M2 gradients),
/// delayed scaling with `history`.
fn tensorwise_fp8(s: &Spec, history: Option<u32>) -> Spec {
    pinned_fp8(s, (Fp8Scaling::Tensorwise, Fp8Format::E5m2), history)
}

/// `s` with every attention and MLP projection pinned to FP8 of `scaling` with `grad`
/// gradients, delayed scaling with `history`.
fn pinned_fp8(s: &Spec, (scaling, grad): (Fp8Scaling, Fp8Format), history: Option<u32>) -> Spec {
    let mut fp8 = s.clone();
    fp8.train.fp8 = Some(Fp8 {
        scaling,
        grad,
        history,
        keep_bf16: Vec::new(),
        force_fp8: vec!["Attention".into(), "MLP".into()],
        shared_quantization: true,
        span: Default::default(),
    });
    fp8
}

/// FP8 (every attention and MLP projection pinned FP8 under `recipe`: scaling and gradient
/// format) on CUDA against the CPU's exact emulation, both bf16 runs: within the bf16 storage
/// runs' tolerances (the GPU also rounds GEMM weights to bf16 before taking their amax, the CPU
/// does not, so an element can land on the other side of an FP8 rounding boundary), and visibly
/// apart from the same run without FP8 (FP8 rounding took place). With `history` (delayed
/// scaling), the first step's histories are empty, so it runs unquantized: its loss is the bf16
/// run's.
fn fp8_matches_cpu_emulation(
    name: &str,
    llama: bool,
    recipe: (Fp8Scaling, Fp8Format),
    history: Option<u32>,
) {
    let mut s = model_spec(llama, 6);
    s.train.precision = Precision::Bf16;
    let fp8 = pinned_fp8(&s, recipe, history);
    let plan = lower(&fp8).unwrap_or_else(|d| panic!("{:?}", d.items));
    let fp8_gemms = (plan.programs[0].instrs.iter())
        .filter_map(|i| i.as_compute())
        .filter(|c| c.op.fp8().is_some())
        .count();
    assert!(fp8_gemms >= 8, "{name}: {fp8_gemms} FP8 GEMMs in the plan");
    if !gpu_present() {
        return;
    }
    let bf16 = run(&s, Which::Cuda, None, None);
    let cuda = run(&fp8, Which::Cuda, None, None);
    let cpu = run(&fp8, Which::Cpu, None, None);
    compare_within(name, &cuda.records, &cpu.records, |_| (1e-2, 2e-2));
    let apart = (cuda.records.iter().zip(&bf16.records))
        .map(|(f, b)| (f.loss - b.loss).abs() / b.loss.abs())
        .fold(0.0f32, f32::max);
    assert!(apart > 1e-5, "{name}: FP8 equals bf16 to {apart:.1e}");
    if history.is_some() {
        let (first, plain) = (&cuda.records[0], &bf16.records[0]);
        assert!(
            (first.loss - plain.loss).abs() <= 1e-6 * plain.loss.abs(),
            "{name}: the first (unquantized) step's loss {} is not the bf16 run's {}",
            first.loss,
            plain.loss
        );
    }
}

const TENSORWISE: (Fp8Scaling, Fp8Format) = (Fp8Scaling::Tensorwise, Fp8Format::E5m2);

#[test]
fn gpt_style_tensorwise_fp8_matches_cpu_emulation() {
    fp8_matches_cpu_emulation("gpt_fp8_tensorwise", false, TENSORWISE, None);
}

#[test]
fn llama_style_tensorwise_fp8_matches_cpu_emulation() {
    fp8_matches_cpu_emulation("llama_fp8_tensorwise", true, TENSORWISE, None);
}

/// Delayed scaling (history 4) on the GPU: the first step unquantized, then each operand
/// scaled by its history, as the CPU emulates it.
#[test]
fn llama_style_delayed_fp8_matches_cpu_emulation() {
    fp8_matches_cpu_emulation("llama_fp8_delayed", true, TENSORWISE, Some(4));
}

/// Rowwise and blockwise(128) FP8 (E4M3 gradients, as DeepSeek-V3 trains) on parc's own FP8
/// kernel, as the CPU emulates them.
#[test]
fn llama_style_rowwise_and_blockwise_fp8_match_cpu_emulation() {
    let blockwise = Fp8Scaling::Blockwise { block: 128 };
    for (name, scaling) in [
        ("llama_fp8_rowwise", Fp8Scaling::Rowwise),
        ("llama_fp8_blockwise", blockwise),
    ] {
        fp8_matches_cpu_emulation(name, true, (scaling, Fp8Format::E4m3), None);
    }
}

/// Delayed FP8 on a Llama-style model in bf16: each SwiGLU GEMM makes the FP8 quantizations of
/// what its epilogue writes in one pass (`ir::swiglu_runs`, `cuda/swiglu_fp8.rs`), and the
/// forward and backward give bit for bit what the same program gives with every quantization
/// and record its own launch: every buffer left at the optimizer phase, the quantized copies,
/// amax histories and gradients included, from the same parameters, warm histories and tokens.
/// The fused passes run once a run.
#[test]
fn fused_swiglu_quantization_equals_its_ops_run_apart() {
    let mut s = model_spec(true, 2);
    s.train.precision = Precision::Bf16;
    let plan = lower(&tensorwise_fp8(&s, Some(4))).unwrap_or_else(|d| panic!("{:?}", d.items));
    let program = &plan.programs[0];
    let runs = parc_compiler::ir::swiglu_runs::find_swiglu_runs(program).len();
    let gemms = (program.instrs.iter())
        .filter(|i| !parc_compiler::ir::swiglu_runs::epilogue_outputs(i).is_empty())
        .count();
    assert!(
        runs > 0 && runs == gemms,
        "{runs} runs of {gemms} SwiGLU GEMMs"
    );
    #[cfg(not(feature = "cuda"))]
    gpu_present();
    #[cfg(feature = "cuda")]
    if gpu_present() {
        use parc_runtime::cuda::SwigluFp8StoreKernel::Always;
        let fused = forward_backward_on_gpu(program, true, Always);
        let apart = forward_backward_on_gpu(program, false, Always);
        assert_eq!((fused.1, apart.1), (runs as u64, 0), "fused passes");
        assert_eq!((fused.2, apart.2), (0, 0), "unstored outputs");
        assert_eq!(fused.0.len(), apart.0.len());
        for ((name, a), (_, b)) in fused.0.iter().zip(&apart.0) {
            assert!(
                a == b,
                "{name}: the fused pass differs from the ops run apart"
            );
        }
    }
}

/// The fused SwiGLU-and-FP8 passes leaving unstored each epilogue output that only quantized
/// GEMMs read (`PARC_SWIGLU_FP8_STORE_KERNEL=needed`; warm histories, so no reader runs cold):
/// every buffer left at the optimizer phase, gradients included, bit for bit as when they store
/// everything. On tiny-llama that is dgate and dup of every layer, and the last layer's gated
/// product (elsewhere the backward quantizes it again, transposed).
#[test]
fn swiglu_outputs_only_quantized_gemms_read_need_no_store() {
    let mut s = model_spec(true, 2);
    s.train.precision = Precision::Bf16;
    let plan = lower(&tensorwise_fp8(&s, Some(4))).unwrap_or_else(|d| panic!("{:?}", d.items));
    let program = &plan.programs[0];
    let runs = parc_compiler::ir::swiglu_runs::find_swiglu_runs(program);
    let readable: usize = (runs.iter())
        .flat_map(|r| parc_compiler::ir::swiglu_runs::quantized_readers(program, r))
        .filter(Option::is_some)
        .count();
    assert!(
        readable > 0,
        "no epilogue output read only by quantized GEMMs"
    );
    #[cfg(not(feature = "cuda"))]
    gpu_present();
    #[cfg(feature = "cuda")]
    if gpu_present() {
        use parc_runtime::cuda::SwigluFp8StoreKernel::{Always, Needed};
        let needed = forward_backward_on_gpu(program, true, Needed);
        let always = forward_backward_on_gpu(program, true, Always);
        assert_eq!(
            (needed.2, always.2),
            (readable as u64, 0),
            "unstored outputs"
        );
        assert_eq!(needed.0.len(), always.0.len());
        for ((name, a), (_, b)) in needed.0.iter().zip(&always.0) {
            assert!(
                a == b,
                "{name}: differs where the epilogue left outputs unstored"
            );
        }
    }
}

/// `program` up to its optimizer phase on a bf16 CUDA backend (the SwiGLU FP8 passes fused or
/// not, storing their outputs as `store` says), from parameters and amax histories of a fixed
/// seed and tokens 0, 7, 14, …: the bits of every float buffer allocated at the end, by name,
/// the fused passes run and the epilogue outputs they left unstored.
#[cfg(feature = "cuda")]
fn forward_backward_on_gpu(
    program: &parc_compiler::ir::Program,
    fused: bool,
    store: parc_runtime::cuda::SwigluFp8StoreKernel,
) -> (Vec<(String, Vec<u32>)>, u64, u64) {
    use parc_compiler::ir::{BufferId, BufferKind, DType, Instr};
    use parc_runtime::backend::Backend;
    let mut gpu = parc_runtime::cuda::CudaBackend::with_precision(0, Precision::Bf16)
        .unwrap()
        .with_fused_swiglu_fp8(fused);
    gpu.set_kernel_variant(store);
    gpu.prepare(
        program,
        &parc_compiler::memplan::plan_program(program).unwrap(),
    )
    .unwrap();
    let (start, _) = gpu_support::optimizer_phase_start(program);
    let mut allocated = std::collections::HashSet::new();
    for (i, b) in program.buffers.iter().enumerate() {
        if !b.kind.is_persistent() {
            continue;
        }
        let id = BufferId(i as u32);
        gpu.alloc(id, &b.shape, b.dtype).unwrap();
        allocated.insert(id);
        let n = b.numel() as usize;
        let data = match b.kind {
            BufferKind::Fp8History => gpu_support::uniform(n, i as u64, 0.5, 4.0),
            _ => gpu_support::uniform(n, i as u64, -0.05, 0.05),
        };
        if matches!(b.dtype, DType::F32 | DType::Bf16) {
            gpu.write_f32(id, &data).unwrap();
        }
    }
    let scalars = parc_runtime::backend::StepScalars {
        lr: 0.0,
        step: 1,
        loss_scale: None,
    };
    for (i, instr) in program.instrs[..start].iter().enumerate() {
        if gpu_support::alloc_or_free(&mut gpu, program, instr, &mut allocated) {
            continue;
        }
        match instr {
            Instr::Compute {
                op,
                inputs,
                outputs,
                ..
            } => {
                gpu.begin_instruction(i);
                gpu.compute(op, inputs, outputs, &scalars).unwrap();
            }
            Instr::LoadBatch {
                tokens, targets, ..
            } => {
                for id in tokens.iter().chain(targets) {
                    let n = program.buffer(*id).unwrap().numel() as i32;
                    let ids: Vec<i32> = (0..n).map(|t| (7 * t) % 96).collect();
                    gpu.write_i32(*id, &ids).unwrap();
                }
            }
            other => panic!("unexpected instruction before the optimizer phase: {other:?}"),
        }
    }
    let mut bits: Vec<(String, Vec<u32>)> = (allocated.iter())
        .filter(|id| program.buffer(**id).unwrap().dtype != DType::I32)
        .map(|&id| {
            let values = gpu.read_f32(id).unwrap();
            let name = program.buffer(id).unwrap().name.clone();
            (name, values.iter().map(|v| v.to_bits()).collect())
        })
        .collect();
    bits.sort();
    let unstored = gpu.unstored_swiglu_outputs();
    (bits, gpu.fused_swiglu_fp8_passes(), unstored)
}

/// Every rank of `s`'s plan on GPU 0, as threads of this process that communicate through host
/// memory (`--comm local`): several ranks' CUDA programs, their collectives included, checked on
/// one GPU (NCCL refuses two ranks on one GPU; its max all-reduce is the one tensor parallelism's
/// cross-entropy already uses).
#[cfg(feature = "cuda")]
fn run_ranks_on_one_gpu(s: &Spec) -> TrainResult {
    let plan = lower(s).unwrap_or_else(|d| panic!("{:?}", d.items));
    let mut options = TrainOptions::new(".");
    options.threads_per_rank = Some(1);
    let result = parc_runtime::exec::train(
        s,
        &plan,
        &options,
        |_, _| {
            parc_runtime::cuda::CudaBackend::with_precision(0, s.train.precision).map(
                |mut backend| {
                    backend.poison_unzeroed();
                    backend
                },
            )
        },
        &|_| {},
    );
    result.unwrap_or_else(|e| panic!("{e}"))
}

/// How many FP8 amaxes and amax histories `s`'s plan all-reduces across ranks (what the CUDA
/// backend refused to run before these plans were run on a GPU).
fn fp8_reductions(s: &Spec) -> usize {
    use parc_compiler::ir::{BufferKind, Instr};
    let plan = lower(s).unwrap_or_else(|d| panic!("{:?}", d.items));
    let amaxes = |p: &parc_compiler::ir::Program| -> std::collections::HashSet<_> {
        (p.computes())
            .filter(|(_, c)| matches!(c.op, parc_compiler::ir::op::Op::Fp8Amax(_)))
            .filter_map(|(_, c)| c.outputs.first().copied())
            .collect()
    };
    (plan.programs.iter())
        .map(|p| {
            let reduced = amaxes(p);
            (p.instrs.iter())
                .filter(|i| match i {
                    Instr::Collective { input, .. } => {
                        reduced.contains(input)
                            || p.buffer(*input)
                                .is_some_and(|b| b.kind == BufferKind::Fp8History)
                    }
                    _ => false,
                })
                .count()
        })
        .sum()
}

/// Tensorwise FP8 plans whose amaxes or histories are reduced across ranks (tp and cp share a
/// scale over their group; delayed scaling's histories agree over dp, tp and cp), every rank
/// on one GPU, against the CPU's exact emulation of the same plan: within the bf16 tolerances
/// of the one-rank FP8 test above. Each plan must reduce some amax or history across ranks.
#[test]
fn fp8_plans_reducing_amaxes_across_ranks_match_cpu_emulation() {
    let cases = [
        (
            "dp2 delayed",
            PlanChoice::mesh(2, 1, 1, 1, ZeroStage::Zero1),
            Some(4),
        ),
        (
            "tp2 current",
            PlanChoice::mesh(1, 1, 1, 2, ZeroStage::Zero0),
            None,
        ),
        (
            "tp2 delayed",
            PlanChoice::mesh(1, 1, 1, 2, ZeroStage::Zero0),
            Some(4),
        ),
        (
            "cp2 current",
            PlanChoice::mesh(1, 1, 2, 1, ZeroStage::Zero0),
            None,
        ),
        (
            "dp2 tp2 sp delayed",
            PlanChoice {
                sp: true,
                ..PlanChoice::mesh(2, 1, 1, 2, ZeroStage::Zero1)
            },
            Some(4),
        ),
    ];
    let mut specs = Vec::new();
    for (name, choice, history) in cases {
        let mut s = planned_model_spec(true, 5, choice);
        s.train.precision = Precision::Bf16;
        let fp8 = tensorwise_fp8(&s, history);
        let reductions = fp8_reductions(&fp8);
        assert!(
            reductions > 0,
            "{name}: the plan reduces no FP8 amax across ranks"
        );
        specs.push((name, fp8, reductions));
    }
    if !gpu_present() {
        return;
    }
    #[cfg(feature = "cuda")]
    for (name, fp8, reductions) in specs {
        println!("{name}: {reductions} FP8 amax/history all-reduces a step");
        let cuda = run_ranks_on_one_gpu(&fp8);
        let cpu = run(&fp8, Which::Cpu, None, None);
        compare_within(name, &cuda.records, &cpu.records, |_| (1e-2, 2e-2));
    }
    #[cfg(not(feature = "cuda"))]
    drop(specs);
}

fn fp16_dynamic(init: f64, window: u32, min: f64) -> Precision {
    Precision::Fp16 {
        loss_scale: LossScale::Dynamic {
            init,
            window,
            hysteresis: 2,
            min,
        },
    }
}

/// `precision = fp16` (dynamic scaling from 1024) on CUDA against the fp32 CPU run.
fn fp16_matches_cpu(name: &str, llama: bool) {
    if !gpu_present() {
        return;
    }
    let mut s = model_spec(llama, 6);
    s.train.precision = fp16_dynamic(1024.0, 2, 1.0);
    let cuda = run(&s, Which::Cuda, None, None);
    let scaled_cpu = run(&s, Which::Cpu, None, None);
    s.train.precision = Precision::Fp32;
    let cpu = run(&s, Which::Cpu, None, None);
    let scales = |r: &TrainResult| -> Vec<_> { r.records.iter().map(|r| r.loss_scale).collect() };
    assert_eq!(scales(&cuda), scales(&scaled_cpu), "{name}: loss scales");
    assert!(
        cuda.records.iter().all(|r| !r.loss_scale.unwrap().skipped),
        "{name}: a step overflowed at scale ≤ 4096"
    );
    let largest = compare_within(name, &cuda.records, &cpu.records, |_| (1e-2, 2e-2));
    assert!(
        largest > 1e-5,
        "{name}: fp16 agrees with fp32 to {largest:.1e}: no fp16 rounding took place"
    );
}

#[test]
fn gpt_style_fp16_steps_match_cpu() {
    fp16_matches_cpu("gpt-fp16", false);
}

#[test]
fn llama_style_fp16_steps_match_cpu() {
    fp16_matches_cpu("llama-fp16", true);
}

/// Scale 2^120: the scaled loss gradient overflows fp16 in the first backward GEMM, the norm
/// is not finite, and the step is skipped on the GPU as on the CPU (where f32 overflows):
/// same skip flags and scales, parameters still the initial ones bit for bit.
#[test]
fn fp16_overflow_skips_steps_on_cuda() {
    if !gpu_present() {
        return;
    }
    let (init, min) = (2f64.powi(120), 2f64.powi(119));
    let mut s = model_spec(true, 3);
    s.train.precision = fp16_dynamic(init, 1000, min);
    let cuda = run(&s, Which::Cuda, None, None);
    let cpu = run(&s, Which::Cpu, None, None);
    let initial = run(&s, Which::Cpu, Some(0), None);
    let steps = |r: &TrainResult| -> Vec<_> { r.records.iter().map(|r| r.loss_scale).collect() };
    assert_eq!(steps(&cuda), steps(&cpu));
    let used: Vec<(f64, bool)> = cuda
        .records
        .iter()
        .map(|r| (r.loss_scale.unwrap().scale, r.loss_scale.unwrap().skipped))
        .collect();
    assert_eq!(used, [(init, true), (init, true), (min, true)]);
    for (a, b) in initial.params.iter().zip(&cuda.params) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.data), bits(&b.data), "{} changed", a.name);
    }
}

#[test]
fn gpt_style_bf16_steps_match_cpu() {
    bf16_matches_cpu("gpt-bf16", false);
}

#[test]
fn llama_style_bf16_steps_match_cpu() {
    bf16_matches_cpu("llama-bf16", true);
}

#[test]
fn gpt_style_bf16_storage_matches_cpu_bf16() {
    bf16_storage_matches_cpu_bf16("gpt-bf16-storage", false);
}

#[test]
fn llama_style_bf16_storage_matches_cpu_bf16() {
    bf16_storage_matches_cpu_bf16("llama-bf16-storage", true);
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("parc-cuda-train-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn gpt_style_steps_match_cpu() {
    if !gpu_present() {
        return;
    }
    let s = model_spec(false, 6);
    compare(
        "gpt",
        &run(&s, Which::Cuda, None, None).records,
        &run(&s, Which::Cpu, None, None).records,
    );
}

#[test]
fn llama_style_steps_match_cpu() {
    if !gpu_present() {
        return;
    }
    let s = model_spec(true, 6);
    compare(
        "llama",
        &run(&s, Which::Cuda, None, None).records,
        &run(&s, Which::Cpu, None, None).records,
    );
}

/// Heads of 256 (Gemma's size: the fp32 attention kernels with 8 columns a lane), a
/// Llama-style model of one head a layer and GQA off, in f32 and in bf16: the GPU's steps
/// follow the CPU's as the other Llama-style runs do.
#[test]
fn heads_of_256_steps_match_cpu() {
    let dims = Dims {
        vocab: 96,
        dim: 256,
        seq: 32,
        heads: 1,
        kv_heads: 1,
        ffn: 256,
        micro_batch: 2,
    };
    let tiny = TinyModel {
        layers: 2,
        llama: true,
        tied: false,
    };
    let mut s = sized_spec(tiny, PlanChoice::default(), dims);
    s.train.steps = 4;
    let plan = lower(&s).unwrap_or_else(|d| panic!("{:?}", d.items));
    let head_dim = (plan.programs[0].instrs.iter())
        .filter_map(|i| match i.op() {
            Some(parc_compiler::ir::op::Op::Attention(a)) => Some(a.head_dim),
            _ => None,
        })
        .max();
    assert_eq!(head_dim, Some(256));
    if !gpu_present() {
        return;
    }
    compare(
        "heads_256",
        &run(&s, Which::Cuda, None, None).records,
        &run(&s, Which::Cpu, None, None).records,
    );
    s.train.precision = Precision::Bf16;
    compare_within(
        "heads_256_bf16",
        &run(&s, Which::Cuda, None, None).records,
        &run(&s, Which::Cpu, None, None).records,
        |_| (1e-2, 2e-2),
    );
}

/// The Llama-style model with every attention's q·k factor its own (`scale = 0.3`, not
/// 1/√head_dim) on CUDA against the CPU: the tensor-core and exact attention kernels take the
/// factor from the op, so the per-step losses and gradient norms match as the Llama run's do.
#[test]
fn an_attention_scale_steps_match_cpu() {
    if !gpu_present() {
        return;
    }
    let mut s = model_spec(true, 6);
    for n in &mut s.model.nodes {
        if let LayerKind::Attention { scale, .. } = &mut n.kind {
            *scale = Some(0.3);
        }
    }
    let cuda = run(&s, Which::Cuda, None, None);
    let cpu = run(&s, Which::Cpu, None, None);
    compare("attention scale 0.3", &cuda.records, &cpu.records);
}

/// The Llama-style model with a partial RoPE (a quarter of each head's features turn, as
/// Pythia's rotary_pct) on CUDA against the CPU: the hand-written rope kernels and the fused
/// split-and-rope kernels (RotatePart loads, tables of 1 and 0 past the turned columns) train
/// as the CPU's.
#[test]
fn a_partial_rope_steps_match_cpu() {
    if !gpu_present() {
        return;
    }
    let mut s = model_spec(true, 6);
    for n in &mut s.model.nodes {
        if let LayerKind::Attention { rope: Some(r), .. } = &mut n.kind {
            r.fraction = 0.25;
        }
    }
    let cuda = run(&s, Which::Cuda, None, None);
    let cpu = run(&s, Which::Cpu, None, None);
    compare("partial rope 0.25", &cuda.records, &cpu.records);
}

/// The Llama-style model with Qwen3's attention: heads of `head_dim` (64: the q projection 4×
/// d; 128) and each head of q and k RMS-normalized before RoPE (`qk_norm`).
fn qwen3_spec(head_dim: u64, steps: u64) -> Spec {
    let mut s = model_spec(true, steps);
    for n in &mut s.model.nodes {
        if let LayerKind::Attention {
            qk_norm,
            head_dim: width,
            ..
        } = &mut n.kind
        {
            *qk_norm = Some(1e-6);
            *width = head_dim;
        }
    }
    s
}

/// Qwen3's per-head q/k norms (`RmsNorm` over rows of head_dim 64 and 128 of the q and k
/// buffers, `RmsNormBwd` summing the shared weights' gradients over heads and tokens) on CUDA
/// against the CPU: per-step losses and gradient norms within the Llama run's tolerances, and
/// the trained `q_norm`/`k_norm` weights within 1e-3 (a norm kernel that took a head's row
/// wrongly or summed a weight's gradient over the wrong rows fails either); with bf16
/// storage, both backends storing bf16, within the bf16 tolerances.
#[test]
fn qwen3_style_qk_norm_steps_match_cpu() {
    if !gpu_present() {
        return;
    }
    for head_dim in [64, 128] {
        let name = format!("qwen3 head_dim {head_dim}");
        let s = qwen3_spec(head_dim, 6);
        let cuda = run(&s, Which::Cuda, None, None);
        let cpu = run(&s, Which::Cpu, None, None);
        compare(&name, &cuda.records, &cpu.records);
        let norms =
            (cuda.params.iter().zip(&cpu.params)).filter(|(g, _)| g.name.ends_with("_norm"));
        let mut seen = 0;
        for (g, c) in norms {
            seen += 1;
            assert_eq!(g.name, c.name);
            assert!(
                c.data.iter().any(|&w| w != 1.0),
                "{name}: {} untrained",
                c.name
            );
            let worst = (g.data.iter().zip(&c.data))
                .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
                .fold(0.0f32, f32::max);
            assert!(worst <= 1e-3, "{name}: {} off by {worst:.1e}", c.name);
        }
        assert_eq!(seen, 4, "{name}: q_norm and k_norm of two layers");
        let mut bf16 = s.clone();
        bf16.train.precision = Precision::Bf16;
        let (cuda, cpu) = (
            run(&bf16, Which::Cuda, None, None),
            run(&bf16, Which::Cpu, None, None),
        );
        compare_within(&format!("{name} bf16"), &cuda.records, &cpu.records, |_| {
            (1e-2, 2e-2)
        });
    }
}

#[test]
fn checkpoints_cross_backends() {
    if !gpu_present() {
        return;
    }
    let full = run(&model_spec(true, 6), Which::Cpu, None, None);
    for (first, second, name) in [
        (Which::Cuda, Which::Cpu, "cuda-to-cpu"),
        (Which::Cpu, Which::Cuda, "cpu-to-cuda"),
    ] {
        let dir = temp_dir(name);
        let mut s = model_spec(true, 6);
        s.train.checkpoint = Some(Checkpointing {
            every: 2,
            dir: dir.display().to_string(),
            keep: 1,
            asynchronous: true,
        });
        let head = run(&s, first, Some(4), None);
        assert!(
            !head.checkpoints.is_empty(),
            "{name}: no checkpoint written"
        );
        let tail = run(&s, second, None, Some(&dir));
        assert_eq!(tail.start_step, 4, "{name}");
        compare(name, &tail.records, &full.records[4..]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A CUDA run resumed on CUDA from a background (asynchronous) save continues bit for bit: the
/// losses, gradient norms and final parameters of an uninterrupted CUDA run, in bf16 storage
/// (the bf16 working copies are rebuilt from the masters on load).
#[test]
fn cuda_resume_from_an_async_save_is_bit_exact() {
    let mut s = model_spec(true, 6);
    s.train.precision = Precision::Bf16;
    resume_is_bit_exact(s, "cuda-resume-bits");
}

/// The same under delayed FP8 scaling: the checkpoint carries the amax histories, and the
/// resumed run's GEMMs read the loaded scale amaxes (written from the host, so the backend's
/// copies of them are stale and it reads them again), not the empty histories of a cold start.
#[test]
fn cuda_resume_of_a_delayed_fp8_run_is_bit_exact() {
    let mut s = model_spec(true, 6);
    s.train.precision = Precision::Bf16;
    resume_is_bit_exact(tensorwise_fp8(&s, Some(4)), "cuda-resume-delayed");
}

/// Delayed FP8's kernel variants train bit for bit as the defaults: quantized GEMMs taking the
/// dequantization factors their scale amaxes' roll wrote (`PARC_FP8_FACTORS_KERNEL=rolled`,
/// `cuda/fp8_roll.rs`) instead of an `fp8_scales` launch each, and fused SwiGLU passes leaving
/// unstored what only quantized GEMMs read (`PARC_SWIGLU_FP8_STORE_KERNEL=needed`): each step's
/// loss and gradient norm and the final parameters. All resume from one checkpoint after step
/// 2, so they run the same GEMM algorithms, and their first step reads scale amaxes the
/// checkpoint wrote from the host, whose rolled factors are stale.
#[test]
fn delayed_fp8_variants_train_as_the_defaults() {
    #[cfg(not(feature = "cuda"))]
    gpu_present();
    #[cfg(feature = "cuda")]
    if gpu_present() {
        delayed_fp8_variants_agree();
    }
}

/// The test above's body (a CUDA build on a GPU).
#[cfg(feature = "cuda")]
fn delayed_fp8_variants_agree() {
    use parc_runtime::cuda::{CudaBackend, Fp8FactorsKernel, KernelVariant, SwigluFp8StoreKernel};
    let s = tensorwise_fp8(&in_bf16(model_spec(true, 7)), Some(4));
    let with = |v: KernelVariant| {
        move |mut backend: CudaBackend| {
            backend.set_kernel_variant(v);
            backend
        }
    };
    let (rolled, needed) = (
        with(Fp8FactorsKernel::Rolled.into()),
        with(SwigluFp8StoreKernel::Needed.into()),
    );
    resumed_runs_agree(
        "delayed-fp8-variants",
        s,
        &[
            ("defaults", &|backend| backend),
            ("fp8_factors=rolled", &rolled),
            ("swiglu_fp8_store=needed", &needed),
        ],
    );
}

/// How a backend is set up for one of [`resumed_runs_agree`]'s runs.
#[cfg(feature = "cuda")]
type Setup<'a> =
    &'a (dyn Fn(parc_runtime::cuda::CudaBackend) -> parc_runtime::cuda::CudaBackend + Sync);

/// `s` trained on CUDA for 2 steps with a checkpoint (in a temporary folder named after
/// `name`), then resumed from it once per `setups` (named backend set-ups): every resumed run
/// gives the first's losses, gradient norms and final parameters, bit for bit. Resuming from
/// one checkpoint, all take the GEMM algorithms it carries: two runs that time them apart may
/// pick differently and differ by rounding (see `resume_is_bit_exact`).
#[cfg(feature = "cuda")]
fn resumed_runs_agree(name: &str, mut s: Spec, setups: &[(&str, Setup)]) {
    let dir = temp_dir(name);
    let checkpoints = |sub: &str| Checkpointing {
        every: 2,
        dir: dir.join(sub).display().to_string(),
        keep: 0,
        asynchronous: false,
    };
    let plan = lower(&s).unwrap_or_else(|d| panic!("{:?}", d.items));
    s.train.checkpoint = Some(checkpoints("first"));
    let first = train_cuda(&s, &plan, &train_options(Some(2), None), true);
    let first = first.unwrap_or_else(|e| panic!("{e}"));
    assert!(!first.checkpoints.is_empty(), "{name}: no checkpoint");
    let step2 = dir.join("first").join("step-00000002");
    let runs: Vec<(&str, TrainResult)> = (setups.iter())
        .map(|&(label, setup)| {
            let mut s = s.clone();
            s.train.checkpoint = Some(checkpoints(label));
            let options = train_options(None, Some(&step2));
            let result = train_cuda_with(&s, &plan, &options, setup);
            (
                label,
                result.unwrap_or_else(|e| panic!("{name} {label}: {e}")),
            )
        })
        .collect();
    let (base, want) = &runs[0];
    assert_eq!(
        want.records.len() as u64,
        s.train.steps - 2,
        "{name}: steps 3 on"
    );
    for (label, got) in &runs[1..] {
        assert_eq!(got.records.len(), want.records.len(), "{name} {label}");
        for (a, b) in got.records.iter().zip(&want.records) {
            assert_eq!(
                (a.loss.to_bits(), a.grad_norm.to_bits()),
                (b.loss.to_bits(), b.grad_norm.to_bits()),
                "{name} step {}: {label} {} / {} vs {base} {} / {}",
                a.step,
                a.loss,
                a.grad_norm,
                b.loss,
                b.grad_norm
            );
        }
        assert_eq!(got.params.len(), want.params.len());
        for (a, b) in got.params.iter().zip(&want.params) {
            let same = (a.data.iter().zip(&b.data)).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{name} {}: {label} and {base} parameters differ",
                a.name
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `s` run on CUDA with asynchronous checkpoints every 2 steps (in a temporary folder named
/// after `name`), then resumed from its checkpoint after step 4: the same losses, gradient
/// norms and final parameters from there, bit for bit. The resumed run takes the GEMM
/// algorithms the original timed (the shard carries them, `cuda/choices.rs`): two runs that time
/// them apart may pick differently and differ by rounding, as the H200 showed on 2026-12-06
/// (one in two runs, whether parc's kernel or cuBLASLt won a GEMM).
fn resume_is_bit_exact(mut s: Spec, name: &str) {
    if !gpu_present() {
        return;
    }
    let dir = temp_dir(name);
    let checkpoints = |dir: &Path| Checkpointing {
        every: 2,
        dir: dir.display().to_string(),
        keep: 0,
        asynchronous: true,
    };
    s.train.checkpoint = Some(checkpoints(&dir.join("first")));
    let full = run(&s, Which::Cuda, None, None);
    assert!(!full.checkpoints.is_empty(), "no checkpoint written");
    s.train.checkpoint = Some(checkpoints(&dir.join("resumed")));
    let step4 = dir.join("first").join("step-00000004");
    let tail = run(&s, Which::Cuda, None, Some(&step4));
    assert_eq!(tail.start_step, 4);
    for (a, b) in full.records[4..].iter().zip(&tail.records) {
        assert_eq!(
            (a.loss.to_bits(), a.grad_norm.to_bits()),
            (b.loss.to_bits(), b.grad_norm.to_bits()),
            "{name} step {}: resumed {} / {} vs uninterrupted {} / {}",
            a.step,
            b.loss,
            b.grad_norm,
            a.loss,
            a.grad_norm
        );
    }
    for (a, b) in full.params.iter().zip(&tail.params) {
        let same = a
            .data
            .iter()
            .zip(&b.data)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{name} {}: resumed parameters differ", a.name);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A dp = 2 ZeRO plan of the GPT-style model.
fn zero_spec(zero: ZeroStage, steps: u64) -> Spec {
    let choice = PlanChoice {
        dp: 2,
        zero,
        ..PlanChoice::default()
    };
    planned_model_spec(false, steps, choice)
}

/// The model's optimizer updates as runs the CUDA backend fuses
/// (`parc_compiler::ir::optimizer_runs`): every parameter's update of a rank's program is in one run, without ZeRO (the gradient
/// `Free`s between updates do not split it) and with ZeRO 1, 2 and 3 (nor do the all-gathers of
/// the updated shards); in bf16 without ZeRO the run absorbs every refresh copy. Needs no GPU.
#[test]
fn every_update_of_a_program_is_one_fused_run() {
    use parc_compiler::ir::optimizer_runs::{find_runs, find_sum_squares_runs};
    use parc_compiler::ir::{op::Op, Program};
    // Every SumSquares of a program (one per gradient tensor) in one run, in program order.
    let one_sum_squares_run = |program: &Program, name: &str| -> usize {
        let all: Vec<usize> = (program.computes())
            .filter(|(_, c)| matches!(c.op, Op::SumSquares))
            .map(|(index, _)| index)
            .collect();
        let runs = find_sum_squares_runs(program);
        assert_eq!(runs.len(), 1, "{name}: SumSquares runs {runs:?}");
        let fused: Vec<usize> = runs[0].members.iter().map(|m| m.index).collect();
        assert_eq!(fused, all, "{name}");
        all.len()
    };
    let cases = [
        (false, false, None),
        (true, false, None),
        (false, true, None),
        (false, false, Some(ZeroStage::Zero1)),
        (false, false, Some(ZeroStage::Zero2)),
        (false, false, Some(ZeroStage::Zero3)),
    ];
    for (llama, sgd, zero) in cases {
        let mut s = match zero {
            None => model_spec(llama, 1),
            Some(zero) => zero_spec(zero, 1),
        };
        if sgd {
            s.train.optimizer = parc_compiler::spec::Optimizer::Sgd {
                lr: 1e-1,
                momentum: 0.9,
                weight_decay: 0.1,
            };
        }
        let plan = lower(&s).unwrap_or_else(|d| panic!("{:?}", d.items));
        let program = &plan.programs[0];
        let (llama, sgd) = (format!("{llama} {zero:?}"), sgd);
        let updates: Vec<usize> = (program.computes())
            .filter(|(_, c)| matches!(c.op, Op::AdamW { .. } | Op::Sgd { .. }))
            .map(|(index, _)| index)
            .collect();
        let runs = find_runs(program);
        assert_eq!(runs.len(), 1, "llama {llama} sgd {sgd}: {runs:?}");
        let fused: Vec<usize> = runs[0].members.iter().map(|m| m.index).collect();
        assert_eq!(fused, updates, "llama {llama} sgd {sgd}");
        assert!(updates.len() > 10, "llama {llama} sgd {sgd}");
        // Decayed matrices and undecayed norms and biases share the run.
        let decays: std::collections::BTreeSet<u64> = runs[0]
            .members
            .iter()
            .map(|m| m.weight_decay.to_bits())
            .collect();
        assert_eq!(decays.len(), 2, "llama {llama} sgd {sgd}");
        let name = format!("llama {llama} sgd {sgd}");
        assert!(one_sum_squares_run(program, &name) > 10, "{name}");
    }
    // bf16 without ZeRO: the run also absorbs every weight matrix's refresh copy (its bf16
    // working copy rounded from the updated master); SGD's alike.
    for (llama, sgd) in [(false, false), (true, false), (false, true)] {
        let mut s = in_bf16(model_spec(llama, 1));
        if sgd {
            s.train.optimizer = parc_compiler::spec::Optimizer::Sgd {
                lr: 1e-1,
                momentum: 0.9,
                weight_decay: 0.1,
            };
        }
        let plan = lower(&s).unwrap_or_else(|d| panic!("{:?}", d.items));
        let program = &plan.programs[0];
        let runs = find_runs(program);
        assert_eq!(runs.len(), 1, "bf16 llama {llama} sgd {sgd}: {runs:?}");
        let absorbed = (runs[0].members.iter())
            .filter(|m| m.refresh.is_some())
            .count();
        let copies = refresh_copies(program);
        assert!(copies >= 2, "bf16 llama {llama} sgd {sgd}: {copies} copies");
        assert_eq!(absorbed, copies, "bf16 llama {llama} sgd {sgd}");
    }
    // GPT-2 124M at micro-batch 32 (issue 6's benchmark): its updates are one launch.
    let plan = lower(&gpt2_124m(32)).unwrap_or_else(|d| panic!("{:?}", d.items));
    let program = &plan.programs[0];
    let updates = (program.instrs.iter())
        .filter(|i| matches!(i.op(), Some(Op::AdamW { .. })))
        .count();
    let runs = find_runs(program);
    assert_eq!(runs.len(), 1, "gpt2-124m: {} runs", runs.len());
    assert_eq!(runs[0].members.len(), updates);
    assert!(updates > 12 * 10, "gpt2-124m: {updates} updates");
    // Its 196 gradients' sums of squares: two launches, not 392.
    assert_eq!(one_sum_squares_run(program, "gpt2-124m"), updates);
}

/// Llama 3.2 1B in bf16 (`examples/llama3.2-1b.par`): its one update run absorbs all 81
/// refresh copies (16 layers' five weight matrices and the token table; the norms have no
/// working copy), so a step launches 81 kernels fewer. Needs no GPU.
#[test]
fn llama_3_2_1b_absorbs_every_refresh_copy() {
    use parc_compiler::driver::{compile, CompileOptions, Stage};
    use parc_compiler::ir::optimizer_runs::find_runs;
    let text = include_str!("../examples/llama3.2-1b.par").to_string();
    let compiled = compile(
        "llama3.2-1b.par",
        text,
        &[],
        &CompileOptions::through(Stage::Lower),
    );
    let plan = (compiled.plan.as_ref()).unwrap_or_else(|| panic!("{:?}", compiled.diagnostics));
    let program = &plan.programs[0];
    let runs = find_runs(program);
    assert_eq!(runs.len(), 1, "{} runs", runs.len());
    let absorbed = (runs[0].members.iter())
        .filter(|m| m.refresh.is_some())
        .count();
    assert_eq!((absorbed, refresh_copies(program)), (81, 81));
}

/// A small deterministic generator (xorshift64*) for the optimizer test's inputs.
#[cfg(feature = "cuda")]
struct Xorshift(u64);

#[cfg(feature = "cuda")]
impl Xorshift {
    /// Uniform in (-1, 1).
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        (bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Every persistent f32 and bf16 buffer's name and bits (a bf16 buffer's values widened to f32).
#[cfg(feature = "cuda")]
type BufferBits = Vec<(String, Vec<u32>)>;

/// What [`optimizer_phase`] gives: the fused runs the backend found (the optimizer's, each as
/// its updates' count, with the refresh copies each makes; then the sums of squares') and
/// every persistent buffer's bits at the end.
#[cfg(feature = "cuda")]
struct PhaseResult {
    runs: Vec<usize>,
    refreshes: Vec<usize>,
    sumsq_runs: Vec<usize>,
    state: BufferBits,
}

/// Drives `program`'s optimizer phase (from its first optimizer-phase instruction to the end)
/// directly through a CUDA backend, `steps` times, with the same inputs whatever `fused` is:
/// the persistent buffers start random (second moments non-negative), and every step the
/// transient buffers live at the phase's start get fresh random values (in `overflow_step`,
/// one gradient element is infinite: an fp16 run skips that step). Collectives are emulated
/// (the output is the input repeated), so a ZeRO rank's phase runs alone. `fused` turns both
/// the fused optimizer and the fused `SumSquares` on or off. Returns the fused runs the
/// backend found and every persistent buffer's bits at the end (the squared gradient norm
/// `grad_sumsq` and a bf16 run's working copies among them).
#[cfg(feature = "cuda")]
fn optimizer_phase(
    program: &parc_compiler::ir::Program,
    precision: Precision,
    fused: bool,
    steps: u64,
    overflow_step: Option<u64>,
) -> PhaseResult {
    use parc_compiler::ir::{op::Op, BufferId, DType, Instr};
    use parc_compiler::memplan::plan_program;
    use parc_runtime::backend::{Backend, StepScalars};
    use parc_runtime::cuda::CudaBackend;
    use std::collections::HashSet;
    let (start, live) = gpu_support::optimizer_phase_start(program);
    // Second moments: the last output of each AdamW.
    let second_moments: HashSet<BufferId> = (program.computes())
        .filter(|(_, c)| matches!(c.op, Op::AdamW { .. }))
        .filter_map(|(_, c)| c.outputs.last().copied())
        .collect();
    let mut rng = Xorshift(0x9e37_79b9_7f4a_7c15);
    let mut backend = CudaBackend::with_precision(0, precision)
        .unwrap()
        .with_fused_optimizer(fused)
        .with_fused_sum_squares(fused);
    backend
        .prepare(program, &plan_program(program).unwrap())
        .unwrap();
    let mut allocated = HashSet::new();
    let float = |dtype: DType| matches!(dtype, DType::F32 | DType::Bf16);
    let fill = |backend: &mut CudaBackend, id: BufferId, rng: &mut Xorshift| {
        let b = program.buffer(id).unwrap();
        if float(b.dtype) {
            let abs = second_moments.contains(&id);
            let data: Vec<f32> = (0..b.numel())
                .map(|_| if abs { rng.next().abs() } else { rng.next() })
                .collect();
            backend.write_f32(id, &data).unwrap();
        }
    };
    let persistent: Vec<BufferId> = (0..program.buffers.len() as u32)
        .map(BufferId)
        .filter(|&id| program.buffer(id).unwrap().kind.is_persistent())
        .collect();
    for &id in &persistent {
        let b = program.buffer(id).unwrap();
        backend.alloc(id, &b.shape, b.dtype).unwrap();
        fill(&mut backend, id, &mut rng);
    }
    let loss_scale = matches!(precision, Precision::Fp16 { .. }).then_some(1024.0);
    for step in 1..=steps {
        for &id in &live {
            if allocated.insert(id) {
                let b = program.buffer(id).unwrap();
                backend.alloc(id, &b.shape, b.dtype).unwrap();
            }
            fill(&mut backend, id, &mut rng);
        }
        if overflow_step == Some(step) {
            let grad = (program.computes())
                .find(|&(i, c)| i >= start && matches!(c.op, Op::SumSquares))
                .map(|(_, c)| c.inputs[0])
                .unwrap();
            let mut data = backend.read_f32(grad).unwrap();
            data[0] = f32::INFINITY;
            backend.write_f32(grad, &data).unwrap();
        }
        let scalars = StepScalars {
            lr: 1e-2,
            step,
            loss_scale,
        };
        for instr in &program.instrs[start..] {
            if gpu_support::alloc_or_free(&mut backend, program, instr, &mut allocated) {
                continue;
            }
            if let Some(c) = instr.as_compute() {
                backend
                    .compute(c.op, c.inputs, c.outputs, &scalars)
                    .unwrap();
                continue;
            }
            match instr {
                Instr::Collective { input, output, .. } => {
                    let data = backend.read_f32(*input).unwrap();
                    let len = program.buffer(*output).unwrap().numel() as usize;
                    let out: Vec<f32> = data.iter().copied().cycle().take(len).collect();
                    backend.write_f32(*output, &out).unwrap();
                }
                other => panic!("unexpected instruction in the optimizer phase: {other:?}"),
            }
        }
    }
    let state = (persistent.iter())
        .filter(|&&id| float(program.buffer(id).unwrap().dtype))
        .map(|&id| {
            let bits = backend
                .read_f32(id)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            (program.buffer(id).unwrap().name.clone(), bits)
        })
        .collect();
    PhaseResult {
        runs: backend.fused_optimizer_runs(),
        refreshes: backend.fused_optimizer_refreshes(),
        sumsq_runs: backend.fused_sum_squares_runs(),
        state,
    }
}

/// The refresh copies of `program`: its optimizer phase's `Copy`s of an f32 buffer into a bf16
/// one (a bf16 run's working copies refreshed from the updated masters, without ZeRO).
fn refresh_copies(program: &parc_compiler::ir::Program) -> usize {
    use parc_compiler::ir::{op::Op, DType, Phase};
    let dtype = |id: &parc_compiler::ir::BufferId| program.buffer(*id).map(|b| b.dtype);
    (program.computes())
        .filter(|(_, c)| matches!(c.op, Op::Copy) && c.phase == Phase::Optimizer)
        .filter(|(_, c)| c.inputs.iter().all(|i| dtype(i) == Some(DType::F32)))
        .filter(|(_, c)| c.outputs.iter().all(|o| dtype(o) == Some(DType::Bf16)))
        .count()
}

/// The optimizer phase of `spec`'s rank-0 program, fused and per tensor, on the same inputs:
/// every parameter and optimizer state bit for bit after `steps` steps, and the squared gradient
/// norm of the last step; the fused backend fused all updates into one run and all gradients'
/// sums of squares into another (and changed something), the other none.
#[cfg(feature = "cuda")]
fn fused_equals_per_tensor(name: &str, spec: &Spec, steps: u64, overflow_step: Option<u64>) {
    let plan = lower(spec).unwrap_or_else(|d| panic!("{:?}", d.items));
    let program = &plan.programs[0];
    let precision = spec.train.precision;
    let per_tensor = optimizer_phase(program, precision, false, steps, overflow_step);
    let before = optimizer_phase(program, precision, false, 0, None).state;
    assert!(per_tensor.runs.is_empty(), "{name}: {:?}", per_tensor.runs);
    assert!(per_tensor.refreshes.is_empty(), "{name}");
    assert!(per_tensor.sumsq_runs.is_empty(), "{name}");
    let fused = optimizer_phase(program, precision, true, steps, overflow_step);
    // A bf16 run's launch makes every refresh copy (an fp32 or fp16 run has none).
    let refreshes = refresh_copies(program);
    assert_eq!(fused.refreshes, vec![refreshes], "{name}: refresh copies");
    if precision == Precision::Bf16 {
        assert!(refreshes >= 2, "{name}: {refreshes} refresh copies");
    }
    fused_matches(name, program, steps, fused, &per_tensor.state, &before);
}

/// One fused run of [`fused_equals_per_tensor`] against the per-tensor one.
#[cfg(feature = "cuda")]
fn fused_matches(
    name: &str,
    program: &parc_compiler::ir::Program,
    steps: u64,
    phase: PhaseResult,
    per_tensor: &BufferBits,
    before: &BufferBits,
) {
    use parc_compiler::ir::op::Op;
    let PhaseResult {
        runs: fused_runs,
        sumsq_runs,
        state: fused,
        ..
    } = phase;
    println!("{name}: fused runs {fused_runs:?}, SumSquares runs {sumsq_runs:?}");
    assert_eq!(fused_runs.len(), 1, "{name}: fused runs {fused_runs:?}");
    // Every gradient's SumSquares in one run (each parameter tensor has one).
    let sum_squares = (program.instrs.iter())
        .filter(|i| matches!(i.op(), Some(Op::SumSquares)))
        .count();
    assert_eq!(sumsq_runs, vec![sum_squares], "{name}");
    assert!(sum_squares >= 2, "{name}: {sum_squares} SumSquares");
    // The squared gradient norm, bit for bit, and not trivially zero.
    let norm = |state: &[(String, Vec<u32>)]| {
        (state.iter())
            .find(|(n, _)| n == "grad_sumsq")
            .map(|(_, bits)| bits.clone())
            .expect("a grad_sumsq buffer")
    };
    assert_eq!(norm(&fused), norm(per_tensor), "{name}: grad_sumsq differs");
    assert!(
        f32::from_bits(norm(&fused)[0]) > 0.0,
        "{name}: grad_sumsq is 0"
    );
    assert_eq!(fused.len(), per_tensor.len());
    for (f, t) in fused.iter().zip(per_tensor) {
        assert_eq!(f.0, t.0);
        assert!(f.1 == t.1, "{name}: {} differs after {steps} steps", f.0);
    }
    let changed = fused.iter().zip(before).filter(|(f, b)| f.1 != b.1).count();
    assert!(
        changed > fused_runs[0],
        "{name}: only {changed} buffers changed"
    );
}

/// Widths that are not multiples of 4 (the float4 path's element tails) and a table of
/// 301 × 66 = 19,866 elements (two chunks, the second ending in a tail).
#[cfg(feature = "cuda")]
fn odd_widths_spec() -> Spec {
    let odd = Dims {
        vocab: 301,
        dim: 66,
        seq: 16,
        heads: 2,
        kv_heads: 2,
        ffn: 130,
        micro_batch: 2,
    };
    let odd_model = TinyModel {
        layers: 1,
        llama: false,
        tied: true,
    };
    sized_spec(odd_model, PlanChoice::default(), odd)
}

/// `s` in bf16 (a bf16 working copy beside each weight matrix's f32 master).
fn in_bf16(mut s: Spec) -> Spec {
    s.train.precision = Precision::Bf16;
    s
}

#[test]
fn fused_optimizer_equals_per_tensor_updates() {
    #[cfg(not(feature = "cuda"))]
    gpu_present();
    #[cfg(feature = "cuda")]
    if gpu_present() {
        use parc_compiler::spec::Optimizer;
        fused_equals_per_tensor("gpt-adamw", &model_spec(false, 1), 3, None);
        fused_equals_per_tensor("llama-adamw", &model_spec(true, 1), 3, None);
        fused_equals_per_tensor("gpt-adamw-odd-widths", &odd_widths_spec(), 3, None);
        let mut sgd = model_spec(false, 1);
        sgd.train.optimizer = Optimizer::Sgd {
            lr: 1e-1,
            momentum: 0.9,
            weight_decay: 0.1,
        };
        fused_equals_per_tensor("gpt-sgd-momentum", &sgd, 3, None);
        sgd.train.optimizer = Optimizer::Sgd {
            lr: 1e-1,
            momentum: 0.0,
            weight_decay: 0.1,
        };
        fused_equals_per_tensor("gpt-sgd", &sgd, 2, None);
        // fp16 (loss scale 1024): step 2's gradient overflows and every tensor skips it.
        let mut fp16 = model_spec(true, 1);
        fp16.train.precision = fp16_dynamic(1024.0, 2, 1.0);
        fused_equals_per_tensor("llama-fp16", &fp16, 3, Some(2));
        // ZeRO 1: the all-gathers of the updated shards lie between the fused updates.
        fused_equals_per_tensor("gpt-zero1", &zero_spec(ZeroStage::Zero1, 1), 3, None);
    }
}

/// bf16 runs without ZeRO: the fused launch also makes every weight matrix's refresh copy
/// (its bf16 working copy rounded from the updated f32 master, `optimizer_runs::Refresh`), and
/// the masters, the optimizer state and the working copies are bit for bit those of the
/// per-tensor updates each followed by its `Copy`: AdamW (GPT and Llama; odd widths, whose
/// tails take the one-element path), SGD with momentum, and a step whose gradient is not
/// finite (every update skipped, every working copy still refreshed from its master).
#[test]
fn fused_optimizer_equals_per_tensor_updates_in_bf16() {
    #[cfg(not(feature = "cuda"))]
    gpu_present();
    #[cfg(feature = "cuda")]
    if gpu_present() {
        use parc_compiler::spec::Optimizer;
        fused_equals_per_tensor("gpt-bf16", &in_bf16(model_spec(false, 1)), 3, None);
        fused_equals_per_tensor("llama-bf16", &in_bf16(model_spec(true, 1)), 3, None);
        let odd = in_bf16(odd_widths_spec());
        fused_equals_per_tensor("gpt-bf16-odd-widths", &odd, 3, None);
        let mut sgd = in_bf16(model_spec(false, 1));
        sgd.train.optimizer = Optimizer::Sgd {
            lr: 1e-1,
            momentum: 0.9,
            weight_decay: 0.1,
        };
        fused_equals_per_tensor("gpt-bf16-sgd-momentum", &sgd, 3, None);
        let llama = in_bf16(model_spec(true, 1));
        fused_equals_per_tensor("llama-bf16-skipped-step", &llama, 3, Some(2));
    }
}

/// A bf16 Llama-style run trained on CUDA with the fused optimizer (its launch making the
/// refresh copies) and without it (every update and every `Copy` launched alone): the same
/// losses, gradient norms and final parameters, bit for bit. Both continue from one checkpoint
/// (after step 2 of a first run), so both take the GEMM algorithms it carries: two runs that
/// time them apart may pick differently and differ by rounding (see `resume_is_bit_exact`).
#[test]
fn fused_optimizer_equals_per_tensor_updates_in_bf16_training() {
    #[cfg(not(feature = "cuda"))]
    gpu_present();
    #[cfg(feature = "cuda")]
    if gpu_present() {
        fused_and_per_tensor_bf16_runs_agree();
    }
}

/// The test above's body (a CUDA build on a GPU).
#[cfg(feature = "cuda")]
fn fused_and_per_tensor_bf16_runs_agree() {
    let s = in_bf16(model_spec(true, 6));
    let plan = lower(&s).unwrap_or_else(|d| panic!("{:?}", d.items));
    assert!(
        refresh_copies(&plan.programs[0]) >= 2,
        "fused-bf16-training"
    );
    resumed_runs_agree(
        "fused-bf16-training",
        s,
        &[
            ("fused", &|backend| backend.with_fused_optimizer(true)),
            ("per-tensor", &|backend| backend.with_fused_optimizer(false)),
        ],
    );
}

/// GPT-2 124M's own optimizer phase (196 tensors up to the 38.6M-element token table), fused
/// and per tensor: bit for bit after 2 steps, in fp32 and in bf16 (the launch making the
/// working copies of its weight matrices too). Only the real sizes reach the one-pass sum of
/// squares' paths for large tensors (a virtual block with 8 or more elements per thread,
/// groups of 2 to 7 virtual blocks); the second step checks its counters were reset.
#[test]
fn fused_optimizer_equals_per_tensor_updates_at_gpt2_124m() {
    #[cfg(not(feature = "cuda"))]
    gpu_present();
    #[cfg(feature = "cuda")]
    if gpu_present() {
        fused_equals_per_tensor("gpt2-124m", &gpt2_124m(1), 2, None);
        fused_equals_per_tensor("gpt2-124m-bf16", &in_bf16(gpt2_124m(1)), 2, None);
    }
}

/// Host writes queue on the compute stream through page-locked slots (`cuda::staging`) without
/// waiting for the GPU: each write must still land after the ops queued before it (which read
/// the old contents) and before those queued after it. Twelve rounds of writing two inputs (a
/// small one and one of 1.2 MB, so slots grow and every slot is reused) each copied by a
/// queued `Copy` into a buffer of its own, read back only at the end.
#[test]
fn staged_writes_keep_stream_order() {
    #[cfg(not(feature = "cuda"))]
    gpu_present();
    #[cfg(feature = "cuda")]
    if gpu_present() {
        use parc_compiler::ir::{op::Op, BufferId, DType};
        use parc_runtime::backend::{Backend, StepScalars};
        use parc_runtime::cuda::CudaBackend;
        let mut gpu = CudaBackend::new(0).unwrap();
        let scalars = StepScalars {
            lr: 0.0,
            step: 1,
            loss_scale: None,
        };
        let (rounds, sizes) = (12u32, [1000usize, 300_000]);
        for (k, &n) in sizes.iter().enumerate() {
            gpu.alloc(BufferId(k as u32), &[n as u64], DType::F32)
                .unwrap();
        }
        let data = |round: u32, k: usize| -> Vec<f32> {
            (0..sizes[k])
                .map(|i| (round as f32) * 1000.0 + (k as f32) * 0.5 + (i % 977) as f32)
                .collect()
        };
        let out = |round: u32, k: usize| BufferId(2 + 2 * round + k as u32);
        for round in 0..rounds {
            for (k, &n) in sizes.iter().enumerate() {
                gpu.alloc(out(round, k), &[n as u64], DType::F32).unwrap();
                gpu.write_f32(BufferId(k as u32), &data(round, k)).unwrap();
                gpu.compute(&Op::Copy, &[BufferId(k as u32)], &[out(round, k)], &scalars)
                    .unwrap();
            }
        }
        for round in 0..rounds {
            for k in 0..sizes.len() {
                assert!(
                    gpu.read_f32(out(round, k)).unwrap() == data(round, k),
                    "round {round}, input {k}: the copy saw another write's data"
                );
            }
        }
    }
}

/// The tiny GPT-2 of `examples/tiny.par` with its MLP activation defined in the file as a `.par`
/// function (`plain`: `act = leaky`; gated: `act = glu(leaky)`): a generated kernel forward, a
/// derived one backward.
fn par_function_spec(gated: bool) -> Spec {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let data = root.join("examples/data/tiny-shakespeare.txt");
    let act = if gated { "glu(leaky)" } else { "leaky" };
    let text = std::fs::read_to_string(root.join("examples/tiny.par"))
        .unwrap()
        .replace(
            "use std::gpt2 { Block }",
            "use std::gpt2 { Block }\nfn leaky(x) = select(x > 0, x, 0.1 * x) + 0.05 * squared_relu(x)",
        )
        .replace("act = gelu_tanh", &format!("act = {act}"))
        .replace(
            "\"data/tiny-shakespeare.txt\"",
            &format!("{:?}", data.display().to_string()),
        );
    assert!(
        text.contains(&format!("act = {act}")),
        "examples/tiny.par changed"
    );
    let options =
        parc_compiler::driver::CompileOptions::through(parc_compiler::driver::Stage::Check);
    let compiled = parc_compiler::driver::compile("tiny-fn.par", text, &[], &options);
    let mut s = compiled
        .spec
        .unwrap_or_else(|| panic!("{:?}", compiled.diagnostics.items));
    s.train.steps = 8;
    s
}

/// A model whose activation exists only as a `.par` function trains on CUDA as on the CPU: the
/// same losses and gradient norms every step (fp32 tolerances), and the loss falls.
#[test]
fn a_par_function_activation_trains_as_on_the_cpu() {
    if !gpu_present() {
        return;
    }
    for gated in [false, true] {
        let s = par_function_spec(gated);
        let cuda = run(&s, Which::Cuda, None, None);
        let cpu = run(&s, Which::Cpu, None, None);
        let name = if gated { "glu(leaky)" } else { "leaky" };
        compare(name, &cuda.records, &cpu.records);
        let (first, last) = (cuda.records[0].loss, cuda.records[7].loss);
        assert!(
            last < first - 0.3,
            "{name}: loss did not fall: {first} → {last}"
        );
    }
}
