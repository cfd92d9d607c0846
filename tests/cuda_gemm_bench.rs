//! The GEMMs of one GPT-2 124M step (B×T = 32×1024 rows, d 768) and one 350M step (16×1024
//! rows, d 1024) alone, for `bench/RESULTS.md`: every linear layer's forward (with its bias; fc
//! with its fused gelu_tanh, the output projections with their fused residual add),
//! backward-data (fc2's with the fused GELU gradient) and backward-weight (with its bias
//! gradient) op on the CUDA backend in a bf16 run, as TFLOP/s of the whole op (operand
//! conversions, weight casts, bias, algorithm already chosen) and of its cuBLASLt kernels
//! alone, with bf16 activation storage as training runs them (x, y, dx bf16; w, b, dw, db f32:
//! operands read as stored, weights through their cached cast, bias gradient in the epilogue).
//! Each model gets a table of every op's kernel TFLOP/s, its plans printed with the algorithm
//! that won (id, tile, stages, split-K) and how long the ops' first round (with the algorithm
//! searches) took. PARC_BENCH_F32=1 also runs every buffer f32 (activations rounded per use). Ignored by
//! default (it needs a GPU); run it on the device machine with `cuda_gemm_bench --ignored
//! --nocapture`. PARC_BENCH_ROWS sets the token rows of every model (default 32768 and
//! 16384). PARC_BENCH_MODELS picks the models (`124m,350m` by default; `d2048`: d 2048, 16384
//! rows, 16 layers, Llama 3.2 1B's width, where FP8 is meant to pay). PARC_BENCH_FP8 lists FP8
//! recipes (`tensorwise`, `rowwise`, `blockwise`: 1 × 128 / 128 × 128) to run every op in
//! besides bf16 (`bf16` names the plain run): an FP8 op's time is its operands' amaxes and
//! quantization plus its GEMM, its kernel time the GEMM alone (cuBLASLt's for tensorwise,
//! parc's `fp8_gemm` for the others). The FP8 kernel variables (PARC_FP8_AMAX_KERNEL,
//! PARC_FP8_GEMM_KERNEL) pick the kernels, as in training. Without a GPU it prints `skipped`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "gpu_support/mod.rs"]
mod gpu_support;

gpu_support::gpu_benchmark!(gpt2_step_gemms, bench::run);

#[cfg(feature = "cuda")]
mod bench {
    use crate::gpu_support::{backend_or_skip, median, uniform};
    use parc_compiler::ir::fp8::{Fp8Format, Fp8Gemm, Fp8Scaling};
    use parc_compiler::ir::op::{Act, Op};
    use parc_compiler::ir::{BufferId, DType};
    use parc_compiler::spec::Precision;
    use parc_runtime::backend::{Backend, StepScalars};
    use parc_runtime::cuda::CudaBackend;
    use std::time::Instant;

    /// Timed repetitions per op (the median counts).
    const REPS: usize = 5;

    /// One layer's ops in step order (forward, backward-data, backward-weight), REPS times
    /// after one untimed round that picks the algorithms: per op, the median milliseconds of
    /// the whole op and of its cuBLASLt kernels alone. As in training, each round starts with
    /// a changed weight (`weight` written again, untimed), so its forward GEMM makes the bf16
    /// cast its backward-data GEMM reuses; with f32 activations the backward-weight GEMM reads
    /// the bf16 copy of dy the backward-data GEMM made.
    fn time_layer(
        be: &mut CudaBackend,
        ops: &[(&Op, Vec<BufferId>, Vec<BufferId>)],
        weight: (BufferId, &[f32]),
    ) -> (Vec<(f64, f64)>, f64) {
        let scalars = StepScalars {
            lr: 0.0,
            step: 1,
            loss_scale: None,
        };
        let mut whole = vec![Vec::new(); ops.len()];
        let mut kernels = vec![Vec::new(); ops.len()];
        let mut first_round_ms = 0.0;
        for round in 0..=2 * REPS {
            let timed_kernels = round > REPS;
            be.write_f32(weight.0, weight.1).unwrap();
            for (i, (op, inputs, outputs)) in ops.iter().enumerate() {
                be.time_gemm_kernels(timed_kernels).unwrap();
                Backend::synchronize(be).unwrap();
                let t = Instant::now();
                be.compute(op, inputs, outputs, &scalars).unwrap();
                Backend::synchronize(be).unwrap();
                let ms = t.elapsed().as_secs_f64() * 1e3;
                if timed_kernels {
                    kernels[i].push(be.gemm_kernel_ms().unwrap());
                } else if round > 0 {
                    whole[i].push(ms);
                } else {
                    first_round_ms += ms;
                }
            }
        }
        be.time_gemm_kernels(false).unwrap();
        let medians = whole
            .into_iter()
            .map(median)
            .zip(kernels.into_iter().map(median))
            .collect();
        (medians, first_round_ms)
    }

    /// The benchmarkable models: name, d, token rows by default, layers per step.
    const MODELS: [(&str, u64, u64, u32); 3] = [
        ("124m", 768, 32768, 12),
        ("350m", 1024, 16384, 24),
        ("d2048", 2048, 16384, 16),
    ];

    /// The recipe named `name` (`bf16`: none), each scaling with its default gradient format.
    fn recipe(name: &str) -> Option<Fp8Gemm> {
        let (scaling, grad) = match name {
            "bf16" => return None,
            "tensorwise" => (Fp8Scaling::Tensorwise, Fp8Format::E5m2),
            "rowwise" => (Fp8Scaling::Rowwise, Fp8Format::E4m3),
            "blockwise" => (Fp8Scaling::Blockwise { block: 128 }, Fp8Format::E4m3),
            other => {
                panic!("PARC_BENCH_FP8: `{other}` is not bf16, tensorwise, rowwise or blockwise")
            }
        };
        Some(Fp8Gemm::current(scaling, grad))
    }

    /// The comma-separated values of environment variable `var`, or `default`.
    fn list(var: &str, default: &str) -> Vec<String> {
        let value = std::env::var(var).unwrap_or_else(|_| default.to_string());
        value.split(',').map(|v| v.trim().to_string()).collect()
    }

    /// One timed GEMM op: (model, storage, gemm, kind, m·n·k as "rows x in x out", kernel
    /// TFLOP/s).
    type Row = (String, String, &'static str, &'static str, String, f64);

    pub fn run() {
        let rows_override: Option<u64> = std::env::var("PARC_BENCH_ROWS")
            .ok()
            .and_then(|v| v.parse().ok());
        let mut storages = vec![DType::Bf16];
        if std::env::var("PARC_BENCH_F32").is_ok_and(|v| v == "1") {
            storages.push(DType::F32);
        }
        // The JSON lines, printed last so that the tables come first in a device call's summary
        // (bench/variants_call.sh shows the first 40 table or rate lines).
        let mut json = Vec::new();
        let models = list("PARC_BENCH_MODELS", "124m,350m");
        let recipes = list("PARC_BENCH_FP8", "bf16");
        for (model, d, default_rows, layers) in MODELS {
            if !models.iter().any(|m| m == model) {
                continue;
            }
            let rows = rows_override.unwrap_or(default_rows);
            let mut results: Vec<Row> = Vec::new();
            for name in &recipes {
                for &storage in &storages {
                    // A fresh backend each time: algorithms and casts chosen anew.
                    let Some(mut be) = backend_or_skip(Precision::Bf16) else {
                        return;
                    };
                    let shape = (d, rows, layers);
                    let (mut rows_out, mut lines) =
                        run_storage(&mut be, model, shape, (storage, recipe(name)));
                    for line in be.gemm_plans() {
                        println!("plan {model}: {line}");
                    }
                    results.append(&mut rows_out);
                    json.append(&mut lines);
                }
            }
            print_table(&results);
        }
        for line in json {
            println!("{line}");
        }
    }

    /// A table of every op's kernel TFLOP/s.
    fn print_table(results: &[Row]) {
        println!();
        println!("| model | storage | gemm | kind | rows x in x out | kernel TFLOP/s |");
        println!("|---|---|---|---|---|---:|");
        for (model, storage, gemm, kind, shape, tflops) in results {
            println!("| {model} | {storage} | {gemm} | {kind} | {shape} | {tflops:.1} |");
        }
    }

    /// Every layer's three GEMM ops of `model` (d, token rows, layers per step) with
    /// activations stored as `storage`, in FP8 recipe `fp8` where one is given: one row and
    /// one JSON line per op.
    fn run_storage(
        be: &mut CudaBackend,
        model: &str,
        (d, rows, layers): (u64, u64, u32),
        (storage, fp8): (DType, Option<Fp8Gemm>),
    ) -> (Vec<Row>, Vec<String>) {
        let stored = match storage {
            DType::Bf16 => "bf16",
            _ => "f32",
        };
        let label = match fp8 {
            Some(g) => format!("{stored} fp8-{}", g.scaling.name()),
            None => stored.to_string(),
        };
        // (name, in, out, bias, times per step)
        let gemms = [
            ("qkv", d, 3 * d, true, layers),
            ("proj", d, d, true, layers),
            ("fc", d, 4 * d, true, layers),
            ("fc2", 4 * d, d, true, layers),
            ("head", d, 50304, false, 1),
        ];
        let mut out = Vec::new();
        let mut lines = Vec::new();
        let mut step_ms = [0.0f64; 2];
        let mut first_round_ms = 0.0;
        let mut next = 0u32;
        let mut id = || {
            next += 1;
            BufferId(next)
        };
        for (name, din, dout, bias, per_step) in gemms {
            let (x, w, b, y, dx, dw, db) = (id(), id(), id(), id(), id(), id(), id());
            // As the lowering fuses them: fc's gelu_tanh (a: the activation), the output
            // projections' residual add (r), fc2's backward-data GELU gradient (x as pre).
            let (a, r) = (id(), id());
            let act = (name == "fc").then_some(Act::GeluTanh);
            let residual = name == "proj" || name == "fc2";
            let act_grad = (name == "fc2").then_some(Act::GeluTanh);
            for (buf, shape, dtype) in [
                (x, vec![rows, din], storage),
                (w, vec![dout, din], DType::F32),
                (b, vec![dout], DType::F32),
                (y, vec![rows, dout], storage),
                (a, vec![rows, dout], storage),
                (r, vec![rows, dout], storage),
                (dx, vec![rows, din], storage),
                (dw, vec![dout, din], DType::F32),
                (db, vec![dout], DType::F32),
            ] {
                be.alloc(buf, &shape, dtype).unwrap();
            }
            let n = |s: &[u64]| s.iter().product::<u64>() as usize;
            be.write_f32(x, &uniform(n(&[rows, din]), 1, -1.0, 1.0))
                .unwrap();
            let w_data = uniform(n(&[dout, din]), 2, -0.05, 0.05);
            be.write_f32(w, &w_data).unwrap();
            be.write_f32(b, &uniform(dout as usize, 3, -0.1, 0.1))
                .unwrap();
            if residual {
                be.write_f32(r, &uniform(n(&[rows, dout]), 4, -1.0, 1.0))
                    .unwrap();
            }
            let flops = 2.0 * rows as f64 * din as f64 * dout as f64;
            let fwd = Op::Matmul {
                in_dim: din,
                out_dim: dout,
                bias,
                act,
                residual,
                swiglu: false,
                fp8,
            };
            let mut fwd_in: Vec<BufferId> = if bias { vec![x, w, b] } else { vec![x, w] };
            if residual {
                fwd_in.push(r);
            }
            let fwd_out = if act.is_some() { vec![y, a] } else { vec![y] };
            // The forward output doubles as the backward's dy (random, never zero).
            let bwd_data = Op::MatmulBwdData {
                in_dim: din,
                out_dim: dout,
                accumulate: false,
                act_grad,
                swiglu: false,
                fp8,
            };
            let bwd_in = if act_grad.is_some() {
                vec![y, w, x]
            } else {
                vec![y, w]
            };
            let bwd_weight = Op::MatmulBwdWeight {
                in_dim: din,
                out_dim: dout,
                bias,
                accumulate_param_grad: true,
                fp8,
            };
            let dw_out: Vec<BufferId> = if bias { vec![dw, db] } else { vec![dw] };
            let ops = [
                (&fwd, fwd_in, fwd_out),
                (&bwd_data, bwd_in, vec![dx]),
                (&bwd_weight, vec![y, x], dw_out),
            ];
            let kinds = ["fwd", "bwd-data", "bwd-weight"];
            let (medians, first_ms) = time_layer(be, &ops, (w, &w_data));
            first_round_ms += first_ms;
            for (kind, (whole, kernels)) in kinds.into_iter().zip(medians) {
                step_ms[0] += whole * f64::from(per_step);
                step_ms[1] += kernels * f64::from(per_step);
                let line = format!(
                    "{{\"model\":\"{model}\",\"storage\":\"{label}\",\"gemm\":\"{name}\",\"kind\":\"{kind}\",\"rows\":{rows},\"in\":{din},\"out\":{dout},\"bias\":{bias},\"op_ms\":{whole:.4},\"kernel_ms\":{kernels:.4},\"op_tflops\":{:.1},\"kernel_tflops\":{:.1}}}",
                    flops / whole / 1e9,
                    flops / kernels / 1e9
                );
                lines.push(line);
                out.push((
                    model.to_string(),
                    label.clone(),
                    name,
                    kind,
                    format!("{rows}x{din}x{dout}"),
                    flops / kernels / 1e9,
                ));
            }
            for buf in [x, w, b, y, a, r, dx, dw, db] {
                be.free(buf).unwrap();
            }
        }
        println!(
            "one {model} step's GEMMs ({label} activations; {layers} layers + head, {rows} rows): {:.2} ms as ops, {:.2} ms in cuBLASLt kernels; the first round of the 15 ops, with their algorithm searches, {first_round_ms:.0} ms",
            step_ms[0], step_ms[1]
        );
        assert_eq!(out.len(), 15);
        (out, lines)
    }
}
