//! The GEMMs of one GPT-2 124M step (B×T = 32×1024 rows) alone, for `bench/RESULTS.md`: every
//! linear layer's forward (with its bias; fc with its fused gelu_tanh, the output projections
//! with their fused residual add), backward-data (fc2's with the fused GELU gradient) and
//! backward-weight (with its bias gradient) op on the CUDA backend in a bf16 run, as TFLOP/s of the whole op (operand
//! conversions, weight casts, bias, algorithm already chosen) and of its cuBLASLt kernels
//! alone; once with bf16 activation storage (x, y, dx bf16; w, b, dw, db f32: operands read as
//! stored, weights through their cached cast, bias gradient in the epilogue) and once with
//! every buffer f32 (activations rounded per use). Ignored by default (it needs a GPU); run it
//! on the device machine with `cuda_gemm_bench --ignored --nocapture`. PARC_BENCH_ROWS
//! (default 32768) sets the token rows. Without a GPU it prints `skipped`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[test]
#[ignore = "needs a GPU: run on the device machine with --ignored"]
fn gpt2_124m_step_gemms() {
    #[cfg(not(feature = "cuda"))]
    println!("skipped: no CUDA device (this build has no `cuda` feature)");
    #[cfg(feature = "cuda")]
    bench::run();
}

#[cfg(feature = "cuda")]
mod bench {
    use parc_compiler::ir::op::{Act, Op};
    use parc_compiler::ir::{BufferId, DType};
    use parc_compiler::spec::Precision;
    use parc_runtime::backend::{Backend, StepScalars};
    use parc_runtime::cuda::CudaBackend;
    use std::time::Instant;

    /// Timed repetitions per op (the median counts).
    const REPS: usize = 5;

    /// Uniform values in [-scale, scale) from a fixed LCG (never zeros: see METHOD.md).
    fn random(len: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

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
    ) -> Vec<(f64, f64)> {
        let scalars = StepScalars {
            lr: 0.0,
            step: 1,
            loss_scale: None,
        };
        let mut whole = vec![Vec::new(); ops.len()];
        let mut kernels = vec![Vec::new(); ops.len()];
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
                }
            }
        }
        be.time_gemm_kernels(false).unwrap();
        whole
            .into_iter()
            .map(median)
            .zip(kernels.into_iter().map(median))
            .collect()
    }

    pub fn run() {
        let rows: u64 = std::env::var("PARC_BENCH_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(32768);
        for storage in [DType::Bf16, DType::F32] {
            // A fresh backend each time: algorithms and casts chosen anew.
            let mut be = match CudaBackend::with_precision(0, Precision::Bf16) {
                Ok(be) => be,
                Err(e) => {
                    assert!(
                        parc_runtime::cuda::gpu_absent(&e),
                        "a GPU is there, but the CUDA backend failed: {e}"
                    );
                    println!("skipped: no CUDA device ({e})");
                    return;
                }
            };
            run_storage(&mut be, rows, storage);
            for line in be.gemm_plans() {
                println!("plan: {line}");
            }
        }
    }

    /// Every layer's three GEMM ops with activations stored as `storage`.
    fn run_storage(be: &mut CudaBackend, rows: u64, storage: DType) {
        let label = match storage {
            DType::Bf16 => "bf16",
            _ => "f32",
        };
        // (name, in, out, bias, times per step)
        let layers = [
            ("qkv", 768u64, 2304u64, true, 12u32),
            ("proj", 768, 768, true, 12),
            ("fc", 768, 3072, true, 12),
            ("fc2", 3072, 768, true, 12),
            ("head", 768, 50304, false, 1),
        ];
        let mut lines = Vec::new();
        let mut step_ms = [0.0f64; 2];
        let mut next = 0u32;
        let mut id = || {
            next += 1;
            BufferId(next)
        };
        for (name, din, dout, bias, per_step) in layers {
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
            be.write_f32(x, &random(n(&[rows, din]), 1, 1.0)).unwrap();
            let w_data = random(n(&[dout, din]), 2, 0.05);
            be.write_f32(w, &w_data).unwrap();
            be.write_f32(b, &random(dout as usize, 3, 0.1)).unwrap();
            be.write_f32(r, &random(n(&[rows, dout]), 4, 1.0)).unwrap();
            let flops = 2.0 * rows as f64 * din as f64 * dout as f64;
            let fwd = Op::Matmul {
                in_dim: din,
                out_dim: dout,
                bias,
                act,
                residual,
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
            };
            let dw_out: Vec<BufferId> = if bias { vec![dw, db] } else { vec![dw] };
            let ops = [
                (&fwd, fwd_in, fwd_out),
                (&bwd_data, bwd_in, vec![dx]),
                (&bwd_weight, vec![y, x], dw_out),
            ];
            let kinds = ["fwd", "bwd-data", "bwd-weight"];
            for (kind, (whole, kernels)) in
                kinds.into_iter().zip(time_layer(be, &ops, (w, &w_data)))
            {
                step_ms[0] += whole * f64::from(per_step);
                step_ms[1] += kernels * f64::from(per_step);
                let line = format!(
                    "{{\"storage\":\"{label}\",\"gemm\":\"{name}\",\"kind\":\"{kind}\",\"rows\":{rows},\"in\":{din},\"out\":{dout},\"bias\":{bias},\"op_ms\":{whole:.4},\"kernel_ms\":{kernels:.4},\"op_tflops\":{:.1},\"kernel_tflops\":{:.1}}}",
                    flops / whole / 1e9,
                    flops / kernels / 1e9
                );
                println!("{line}");
                lines.push(line);
            }
            for buf in [x, w, b, y, a, r, dx, dw, db] {
                be.free(buf).unwrap();
            }
        }
        println!(
            "one 124M step's GEMMs ({label} activations; 12 layers + head, {rows} rows): {:.2} ms as ops, {:.2} ms in cuBLASLt kernels",
            step_ms[0], step_ms[1]
        );
        assert_eq!(lines.len(), 15);
    }
}
