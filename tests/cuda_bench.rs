//! GPT-2 124M on one GPU with the CUDA backend: tokens/s per step, for `bench/RESULTS.md`.
//! Ignored by default (it needs a GPU and minutes); run it on the device machine with
//! `cuda_bench --ignored --nocapture`. PARC_BENCH_STEPS (default 6) and PARC_BENCH_BATCH
//! (default 8) size it; PARC_BENCH_PRECISION is `fp32` (default), `bf16` or `fp16` (dynamic
//! loss scaling with the spec defaults). Without a GPU it prints `skipped: no CUDA device`.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;
#[cfg(feature = "cuda")]
#[path = "gpu_support/mod.rs"]
mod gpu_support;

#[cfg(feature = "cuda")]
use fixtures::gpt2_124m;

#[cfg(feature = "cuda")]
fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
#[ignore = "needs a GPU and minutes: run on the device machine with --ignored"]
fn gpt2_124m_tokens_per_second() {
    #[cfg(not(feature = "cuda"))]
    println!("skipped: no CUDA device (this build has no `cuda` feature)");
    #[cfg(feature = "cuda")]
    {
        use parc_compiler::lower::lower;
        use parc_runtime::cuda::CudaBackend;
        use parc_runtime::exec::{train, TrainOptions};
        if gpu_support::backend_or_skip(parc_compiler::spec::Precision::Fp32).is_none() {
            return;
        }
        let batch = env_u64("PARC_BENCH_BATCH", 8);
        let mut s = gpt2_124m(batch);
        s.train.steps = env_u64("PARC_BENCH_STEPS", 6);
        s.train.global_batch = batch;
        use parc_compiler::spec::{LossScale, Precision};
        let (label, precision) = match std::env::var("PARC_BENCH_PRECISION").as_deref() {
            Ok("bf16") => ("cuda-bf16", Precision::Bf16),
            Ok("fp16") => (
                "cuda-fp16",
                Precision::Fp16 {
                    loss_scale: LossScale::Dynamic {
                        init: 65536.0,
                        window: 2000,
                        hysteresis: 2,
                        min: 1.0,
                    },
                },
            ),
            Ok("fp32") | Err(_) => ("cuda-fp32", Precision::Fp32),
            Ok(other) => panic!("PARC_BENCH_PRECISION={other}: use fp32, bf16 or fp16"),
        };
        s.train.precision = precision;
        let plan = lower(&s).unwrap_or_else(|d| panic!("{:?}", d.items));
        let options = TrainOptions::new(".");
        let started = std::time::Instant::now();
        let result = train(
            &s,
            &plan,
            &options,
            |rank, _| CudaBackend::with_precision(rank as usize, precision),
            &|r| {
                println!(
                    "{{\"model\":\"124m\",\"backend\":\"{label}\",\"batch\":{batch},\"seq\":1024,\"step\":{},\"loss\":{:.4},\"grad_norm\":{:.4},\"tokens_per_s\":{:.0},\"elapsed_s\":{:.2},\"loss_scale\":{},\"skipped\":{}}}",
                    r.step, r.loss, r.grad_norm, r.tokens_per_s, r.elapsed_s,
                    r.loss_scale.map_or("null".to_string(), |l| l.scale.to_string()),
                    r.loss_scale.is_some_and(|l| l.skipped)
                )
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let steady: Vec<f64> = result
            .records
            .iter()
            .skip(1)
            .map(|r| r.tokens_per_s)
            .collect();
        let mean = steady.iter().sum::<f64>() / steady.len().max(1) as f64;
        println!(
            "gpt2-124m {label}: {} steps in {:.1}s, steady tokens/s {mean:.0} (steps after the first)",
            result.records.len(),
            started.elapsed().as_secs_f64()
        );
    }
}
