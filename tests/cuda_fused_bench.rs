//! Bandwidth of generated kernels (`Op::Fused`) against a device-to-device copy of the same
//! bytes in the same process: a copy kernel (y = x), SwiGLU forward (y = x0·σ(x0)·x1) and
//! backward, squared ReLU, and RMSNorm (a row sum; NVRTC: a row per warp), with bf16 and with f32
//! `[rows, cols]` operands of 64 MiB each; beside them the hand-written `SwiGlu` and
//! `SwiGluBwd` kernels on the same buffers, through the backend's `compute`.
//!
//! GB/s is by the ideal traffic (every input read once, every output written once); `copy%`
//! is a kernel's GB/s over the copy's (`Op::Copy` of one buffer onto another of the same type:
//! `cuMemcpyDtoDAsync`, reading and writing 64 MiB). The target is copy% ≥ 80 for
//! every generated kernel. The emitter is `PARC_CODEGEN`'s (nvrtc by default).
//!
//! Ignored by default (it needs a GPU): on the device machine,
//! `cuda_fused_bench --ignored --nocapture`. Prints one JSON line per kernel; without a GPU
//! it prints `skipped: no CUDA device`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "gpu_support/mod.rs"]
mod gpu_support;

#[path = "cuda_ops/fused_kernels.rs"]
mod fused_kernels;

gpu_support::gpu_benchmark!(fused_bandwidth, bench::run);

#[cfg(feature = "cuda")]
mod bench {
    use crate::fused_kernels as k;
    use crate::gpu_support::{backend_or_skip, median, uniform};
    use parc_compiler::ir::op::{FusedAttrs, Op};
    use parc_compiler::ir::{BufferId, DType};
    use parc_compiler::kir::Kernel;
    use parc_compiler::spec::Precision;
    use parc_runtime::backend::{Backend, StepScalars};
    use parc_runtime::cuda::CudaBackend;
    use std::sync::Arc;
    use std::time::Instant;

    /// Ops per timed sample (back to back, one synchronisation), and samples (median).
    const OPS: usize = 20;
    const SAMPLES: usize = 7;
    /// Bytes of every `[rows, cols]` operand.
    const BYTES: usize = 64 << 20;
    /// Columns of the operands (a Llama-style MLP's width; RMSNorm's row).
    const COLS: usize = 8192;
    const NORM_COLS: usize = 2048;
    const SCALARS: StepScalars = StepScalars {
        lr: 0.0,
        step: 1,
        loss_scale: None,
    };

    pub fn run() {
        let Some(mut be) = backend_or_skip(Precision::Bf16) else {
            return;
        };
        println!(
            "emitter: {}",
            std::env::var("PARC_CODEGEN").unwrap_or("nvrtc".into())
        );
        for dtype in [DType::Bf16, DType::F32] {
            let n = BYTES / dtype.bytes() as usize;
            // Buffers 0..4: [rows, COLS] of `dtype`; 5: [rows] f32; 6: [NORM_COLS] f32.
            for i in 0..5 {
                let id = BufferId(i);
                be.alloc(id, &[n as u64], dtype).unwrap();
                be.write_f32(id, &uniform(n, u64::from(i) + 1, -2.0, 2.0))
                    .unwrap();
            }
            be.alloc(BufferId(5), &[(n / NORM_COLS) as u64], DType::F32)
                .unwrap();
            be.alloc(BufferId(6), &[NORM_COLS as u64], DType::F32)
                .unwrap();
            be.write_f32(BufferId(6), &uniform(NORM_COLS, 9, 0.5, 1.5))
                .unwrap();
            let copy = time(&mut be, &Op::Copy, &[0], &[1]);
            let copy_gbps = 2.0 * BYTES as f64 / copy / 1e9;
            report("memcpy_dtod", dtype, copy, 2, copy_gbps);
            let cols = COLS as u64;
            let fused = |kernel: Kernel, name: &str| {
                Op::Fused(FusedAttrs {
                    name: name.into(),
                    rows: None,
                    kernel: Arc::new(kernel),
                })
            };
            let cases: [(&str, Op, &[u32], &[u32]); 7] = [
                ("fused copy", fused(k::copy(cols), "copy"), &[0], &[1]),
                (
                    "fused swiglu",
                    fused(k::swiglu(cols), "swiglu"),
                    &[0, 1],
                    &[2],
                ),
                ("hand swiglu", Op::SwiGlu, &[0, 1], &[2]),
                (
                    "fused swiglu_bwd",
                    fused(k::swiglu_bwd(cols), "swiglu_bwd"),
                    &[0, 1, 2],
                    &[3, 4],
                ),
                ("hand swiglu_bwd", Op::SwiGluBwd, &[0, 1, 2], &[3, 4]),
                (
                    "fused squared_relu",
                    fused(k::squared_relu(cols), "squared_relu"),
                    &[0],
                    &[1],
                ),
                (
                    "fused rms_norm",
                    fused(k::rms(NORM_COLS as u64), "rms"),
                    &[0, 6],
                    &[1, 5],
                ),
            ];
            for (name, op, ins, outs) in cases {
                let t = time(&mut be, &op, ins, outs);
                // Row and column vectors (rms_norm's) are under 0.1% of the traffic.
                let big = ins.iter().chain(outs).filter(|&&b| b < 5).count();
                report(name, dtype, t, big, copy_gbps);
            }
            for i in 0..7 {
                be.free(BufferId(i)).unwrap();
            }
        }
    }

    /// Seconds per op: the median over SAMPLES of OPS back-to-back calls between two
    /// synchronisations, after one warm-up call (which compiles and loads a generated kernel).
    fn time(be: &mut CudaBackend, op: &Op, ins: &[u32], outs: &[u32]) -> f64 {
        let ids = |v: &[u32]| v.iter().map(|&i| BufferId(i)).collect::<Vec<_>>();
        let (ins, outs) = (ids(ins), ids(outs));
        be.compute(op, &ins, &outs, &SCALARS).unwrap();
        let mut samples = Vec::new();
        for _ in 0..SAMPLES {
            be.synchronize().unwrap();
            let start = Instant::now();
            for _ in 0..OPS {
                be.compute(op, &ins, &outs, &SCALARS).unwrap();
            }
            be.synchronize().unwrap();
            samples.push(start.elapsed().as_secs_f64() / OPS as f64);
        }
        median(samples)
    }

    /// One JSON line: `buffers` operands of 64 MiB moved in `secs`.
    fn report(name: &str, dtype: DType, secs: f64, buffers: usize, copy_gbps: f64) {
        let gbps = (buffers * BYTES) as f64 / secs / 1e9;
        println!(
            "{{\"kernel\": \"{name}\", \"dtype\": \"{}\", \"buffers\": {buffers}, \"us\": {:.1}, \"gbps\": {gbps:.0}, \"copy_pct\": {:.1}}}",
            dtype.name(),
            secs * 1e6,
            100.0 * gbps / copy_gbps
        );
    }
}
