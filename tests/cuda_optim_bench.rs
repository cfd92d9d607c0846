//! The fused optimizer's two launches alone, at GPT-2 124M's and 350M's parameter shapes (the
//! lowered programs' own optimizer phases, micro-batch 1: the batch does not change them): the
//! fused `SumSquares` run (gradient clipping's sums of squares) and
//! the fused AdamW run, as milliseconds and
//! GB/s of the ideal traffic (sum of squares: 4 bytes per parameter read; AdamW: g, p, m, v
//! read and p, m, v written, 28 bytes per parameter). Each launch is timed on the host around
//! a synchronised `compute` of its run's first instruction (the one that launches the whole
//! run; the launch's few microseconds included), the median of several steps after a
//! warm-up step. Ignored by default (it needs a GPU); run it on the device machine with
//! `cuda_optim_bench --ignored --nocapture`. Without a GPU it prints `skipped`.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;

#[path = "gpu_support/mod.rs"]
mod gpu_support;

gpu_support::gpu_benchmark!(gpt2_optimizer_launches, bench::run);

#[cfg(feature = "cuda")]
mod bench {
    use super::fixtures::{decoder_spec, gpt2_124m, PlanChoice, Variant};
    use crate::gpu_support::{
        alloc_or_free, backend_or_skip, median, optimizer_phase_start, uniform,
    };
    use parc_compiler::ir::op::Op;
    use parc_compiler::ir::{BufferId, DType, Program};
    use parc_compiler::lower::lower;
    use parc_compiler::memplan::plan_program;
    use parc_compiler::spec::Precision;
    use parc_compiler::testing::Dims as Decoder;
    use parc_runtime::backend::{Backend, StepScalars};
    use parc_runtime::cuda::CudaBackend;
    use std::collections::HashSet;
    use std::time::Instant;

    /// Timed steps (the median counts), after one warm-up step.
    const REPS: usize = 7;

    pub fn run() {
        if backend_or_skip(Precision::Fp32).is_none() {
            return;
        }
        println!("model  parameters  launch        kernel                ms      GB/s");
        let gpt2_350m = decoder_spec(
            &Decoder::gpt2_350m(),
            PlanChoice::default(),
            1,
            Variant::default(),
        );
        for (name, spec) in [("124M", gpt2_124m(1)), ("350M", gpt2_350m)] {
            let plan = lower(&spec).unwrap_or_else(|d| panic!("{:?}", d.items));
            time_model(name, &plan.programs[0]);
        }
    }

    /// Drives `program`'s optimizer phase REPS + 1 times, timing the launches of
    /// its first `SumSquares` and its first AdamW (each launches its whole fused run).
    fn time_model(name: &str, program: &Program) {
        let (start, live) = optimizer_phase_start(program);
        let first_sumsq = (program.instrs.iter().enumerate().skip(start))
            .find(|(_, i)| matches!(i.op(), Some(Op::SumSquares)))
            .map(|(k, _)| k)
            .expect("a SumSquares");
        let first_adamw = (program.instrs.iter().enumerate().skip(start))
            .find(|(_, i)| matches!(i.op(), Some(Op::AdamW { .. })))
            .map(|(k, _)| k)
            .expect("an AdamW");
        let params: u64 = (program.computes())
            .filter(|(_, c)| matches!(c.op, Op::AdamW { .. }))
            .map(|(_, c)| program.buffer(c.inputs[0]).unwrap().numel())
            .sum();
        let mut backend = CudaBackend::new(0).unwrap();
        backend
            .prepare(program, &plan_program(program).unwrap())
            .unwrap();
        let mut allocated = HashSet::new();
        let fill = |backend: &mut CudaBackend, id: BufferId, seed: u64| {
            let b = program.buffer(id).unwrap();
            if b.dtype == DType::F32 {
                let data = uniform(b.numel() as usize, seed, 0.0, 1e-3);
                backend.write_f32(id, &data).unwrap();
            }
        };
        for id in (0..program.buffers.len() as u32).map(BufferId) {
            let b = program.buffer(id).unwrap();
            if b.kind.is_persistent() {
                backend.alloc(id, &b.shape, b.dtype).unwrap();
                fill(&mut backend, id, id.0 as u64);
            }
        }
        for &id in &live {
            let b = program.buffer(id).unwrap();
            backend.alloc(id, &b.shape, b.dtype).unwrap();
            allocated.insert(id);
            fill(&mut backend, id, 1000 + id.0 as u64);
        }
        {
            let (mut sumsq_s, mut adamw_s) = (Vec::new(), Vec::new());
            for step in 1..=REPS as u64 + 1 {
                let scalars = StepScalars {
                    lr: 1e-4,
                    step,
                    loss_scale: None,
                };
                for (k, instr) in program.instrs.iter().enumerate().skip(start) {
                    if alloc_or_free(&mut backend, program, instr, &mut allocated) {
                        continue;
                    }
                    let Some(c) = instr.as_compute() else {
                        panic!("unexpected instruction in the optimizer phase: {instr:?}");
                    };
                    let timed = k == first_sumsq || k == first_adamw;
                    if timed {
                        backend.synchronize().unwrap();
                    }
                    let t = Instant::now();
                    backend
                        .compute(c.op, c.inputs, c.outputs, &scalars)
                        .unwrap();
                    if timed {
                        backend.synchronize().unwrap();
                        let s = t.elapsed().as_secs_f64();
                        if step > 1 && k == first_sumsq {
                            sumsq_s.push(s);
                        } else if step > 1 {
                            adamw_s.push(s);
                        }
                    }
                }
                // The next step's gradients: the phase freed them; bind them again (their
                // contents are whatever the plan's region holds, which times the same).
                for &id in &live {
                    if allocated.insert(id) {
                        let b = program.buffer(id).unwrap();
                        backend.alloc(id, &b.shape, b.dtype).unwrap();
                    }
                }
            }
            for (launch, kernel, bytes, s) in [
                (
                    "SumSquares",
                    "sum_squares_one_pass",
                    4 * params,
                    median(sumsq_s),
                ),
                ("AdamW", "adamw_multi", 28 * params, median(adamw_s)),
            ] {
                println!(
                    "{name:<6} {params:>10}  {launch:<12}  {kernel:<20} {:>6.3}  {:>8.0}",
                    s * 1e3,
                    bytes as f64 / s / 1e9
                );
            }
        }
    }
}
