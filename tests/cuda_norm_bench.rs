//! LayerNorm and RMSNorm forward and backward speed of each norm kernel variant
//! (PARC_NORM_FWD_KERNEL: warp|multirow, PARC_NORM_BWD_KERNEL: warp|fused) at GPT-2's shapes:
//! 124M [32768, 768] and 350M [16384, 1024] (one warp a row), and Llama's: Llama 3.2 1B
//! [16384, 2048] and Llama 3 8B [8192, 4096] (a row split over a group of 2 or 4 warps, the
//! `*_wide` kernels), bf16 activations (x, y, dy, dx) with f32 weights, statistics and weight
//! gradients, as a bf16 run stores them.
//!
//! GB/s is by the ideal traffic: a forward reads x and writes y (2·rows·dim·2 bytes), a
//! backward reads dy and x (and dx when it accumulates) and writes dx; weights, statistics
//! and the dw/db partials are left out (under 1%).
//!
//! Ignored by default (it needs a GPU): on the device machine,
//! `cuda_norm_bench --ignored --nocapture`. Prints one JSON line per point; without a GPU it
//! prints `skipped: no CUDA device`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "gpu_support/mod.rs"]
mod gpu_support;

gpu_support::gpu_benchmark!(norm_bandwidth, bench::run);

#[cfg(feature = "cuda")]
mod bench {
    use crate::gpu_support::{backend_or_skip, median, uniform};
    use parc_compiler::ir::op::Op;
    use parc_compiler::ir::{BufferId, DType};
    use parc_compiler::spec::Precision;
    use parc_runtime::backend::{Backend, StepScalars};
    use parc_runtime::cuda::{CudaBackend, NormBwdKernel, NormFwdKernel, Variant};
    use std::time::Instant;

    /// Ops per timed sample (back to back, one synchronisation), and samples (median).
    const OPS: usize = 20;
    const SAMPLES: usize = 7;

    // Buffers: x, w, b, y, mean, rstd, dy, dx, dw, db.
    const X: u32 = 0;
    const W: u32 = 1;
    const B: u32 = 2;
    const Y: u32 = 3;
    const MEAN: u32 = 4;
    const RSTD: u32 = 5;
    const DY: u32 = 6;
    const DX: u32 = 7;
    const DW: u32 = 8;
    const DB: u32 = 9;

    pub fn run() {
        let Some(mut be) = backend_or_skip(Precision::Bf16) else {
            return;
        };
        let shapes = [
            (32_768usize, 768usize),
            (16_384, 1024),
            (16_384, 2048),
            (8_192, 4096),
        ];
        for (rows, dim) in shapes {
            let act = rows * dim;
            let sizes = [
                (act, DType::Bf16),
                (dim, DType::F32),
                (dim, DType::F32),
                (act, DType::Bf16),
                (rows, DType::F32),
                (rows, DType::F32),
                (act, DType::Bf16),
                (act, DType::Bf16),
                (dim, DType::F32),
                (dim, DType::F32),
            ];
            for (i, &(len, dtype)) in sizes.iter().enumerate() {
                let id = BufferId(i as u32);
                be.alloc(id, &[len as u64], dtype).unwrap();
                be.write_f32(id, &uniform(len, i as u64 + 1, -1.0, 1.0))
                    .unwrap();
            }
            let d = dim as u64;
            let ln = Op::LayerNorm {
                dim: d,
                eps: 1e-5,
                bias: true,
            };
            let rms = Op::RmsNorm { dim: d, eps: 1e-6 };
            // Real statistics for the backwards.
            be.set_kernel_variant(NormFwdKernel::Warp);
            let ids = |v: &[u32]| v.iter().map(|&i| BufferId(i)).collect::<Vec<_>>();
            let scalars = StepScalars {
                lr: 0.0,
                step: 1,
                loss_scale: None,
            };
            be.compute(&ln, &ids(&[X, W, B]), &ids(&[Y, MEAN, RSTD]), &scalars)
                .unwrap();
            let fwd_bytes = 2.0 * act as f64 * 2.0;
            for variant in [NormFwdKernel::Warp, NormFwdKernel::Multirow] {
                be.set_kernel_variant(variant);
                let name = variant.name();
                let t = time(&mut be, &ln, &ids(&[X, W, B]), &ids(&[Y, MEAN, RSTD]));
                report("layer_norm_fwd", name, rows, dim, t, fwd_bytes);
                let t = time(&mut be, &rms, &ids(&[X, W]), &ids(&[Y, RSTD]));
                report("rms_norm_fwd", name, rows, dim, t, fwd_bytes);
            }
            // rstd now holds the RMS statistics; the LayerNorm backward's speed does not
            // depend on the values, only on their being finite.
            for variant in [NormBwdKernel::Warp, NormBwdKernel::Fused] {
                be.set_kernel_variant(variant);
                let name = variant.name();
                for accumulate in [false, true] {
                    let bytes = (3.0 + f64::from(u8::from(accumulate))) * act as f64 * 2.0;
                    let ln_bwd = Op::LayerNormBwd {
                        dim: d,
                        bias: true,
                        accumulate,
                        accumulate_param_grad: true,
                    };
                    let ins = ids(&[DY, X, W, MEAN, RSTD]);
                    let t = time(&mut be, &ln_bwd, &ins, &ids(&[DX, DW, DB]));
                    let label = format!("layer_norm_bwd accumulate={accumulate}");
                    report(&label, name, rows, dim, t, bytes);
                    let rms_bwd = Op::RmsNormBwd {
                        dim: d,
                        accumulate,
                        accumulate_param_grad: true,
                    };
                    let ins = ids(&[DY, X, W, RSTD]);
                    let t = time(&mut be, &rms_bwd, &ins, &ids(&[DX, DW]));
                    let label = format!("rms_norm_bwd accumulate={accumulate}");
                    report(&label, name, rows, dim, t, bytes);
                }
            }
            for i in 0..sizes.len() {
                be.free(BufferId(i as u32)).unwrap();
            }
        }
    }

    /// Seconds per op: the median over SAMPLES of OPS back-to-back calls between two
    /// synchronisations (launch gaps included, as in a step), after one warm-up call.
    fn time(be: &mut CudaBackend, op: &Op, ins: &[BufferId], outs: &[BufferId]) -> f64 {
        let scalars = StepScalars {
            lr: 0.0,
            step: 1,
            loss_scale: None,
        };
        be.compute(op, ins, outs, &scalars).unwrap();
        let mut samples = Vec::new();
        for _ in 0..SAMPLES {
            be.synchronize().unwrap();
            let start = Instant::now();
            for _ in 0..OPS {
                be.compute(op, ins, outs, &scalars).unwrap();
            }
            be.synchronize().unwrap();
            samples.push(start.elapsed().as_secs_f64() / OPS as f64);
        }
        median(samples)
    }

    fn report(op: &str, variant: &str, rows: usize, dim: usize, secs: f64, bytes: f64) {
        println!(
            "{{\"op\": \"{op}\", \"variant\": \"{variant}\", \"rows\": {rows}, \"dim\": {dim}, \"ms\": {:.4}, \"gbps\": {:.0}}}",
            secs * 1e3,
            bytes / secs / 1e9
        );
    }
}
