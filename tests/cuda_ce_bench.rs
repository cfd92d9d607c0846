//! The fused cross-entropy (`Op::CrossEntropy`) alone, for each of its kernel variants (`staged`,
//! `rows`: cuda/cross_entropy.rs, `PARC_CROSS_ENTROPY_KERNEL`), at GPT-2's shapes: 124M's
//! 32 × 1024 rows and 350M's 16 × 1024 of the 50,257-column vocabulary, bf16 logits as a bf16
//! run stores them, and 350M's rows in f32. Each point prints the median milliseconds of the
//! op (CUDA events around it: the row kernel and the one-block loss sum) over REPS runs on fresh
//! logits, and GB/s of its ideal traffic, each logit read once and its dlogit written once (2 ·
//! rows · vocab · element bytes), for `bench/RESULTS.md`; the loss of the first call too, which the
//! variants should agree on to about 1e-6 (they sum in different orders).
//!
//! Ignored by default (it needs a GPU): on the device machine,
//! `cuda_ce_bench --ignored --nocapture`. Prints one JSON line per point and variant; without a
//! GPU it prints `skipped: no CUDA device`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "gpu_support/mod.rs"]
mod gpu_support;

gpu_support::gpu_benchmark!(cross_entropy_gbps, bench::run);

#[cfg(feature = "cuda")]
mod bench {
    use crate::gpu_support::{backend_or_skip, median, uniform};
    use parc_compiler::ir::op::Op;
    use parc_compiler::ir::{BufferId, DType};
    use parc_compiler::spec::Precision;
    use parc_runtime::backend::{Backend, StepScalars};
    use parc_runtime::cuda::{CrossEntropyKernel, CudaBackend, Variant};

    const VOCAB: usize = 50_257;
    /// Timed runs per point (the median counts).
    const REPS: usize = 10;
    /// Rows of random logits written from the host once, then copied on the device over the
    /// whole logits buffer before every run (a host write of 3.3 GB would take seconds).
    const SEED_ROWS: usize = 1024;
    /// 1 / tokens, as a training step's loss scale.
    const SCALE: f64 = 1.0 / 32_768.0;

    const SEED: BufferId = BufferId(0);
    const LOGITS: BufferId = BufferId(1);
    const TARGETS: BufferId = BufferId(2);
    const LOSS: BufferId = BufferId(3);

    struct Point {
        model: &'static str,
        rows: usize,
        dtype: DType,
    }

    pub fn run() {
        let points = [
            Point {
                model: "gpt2-124m",
                rows: 32 * 1024,
                dtype: DType::Bf16,
            },
            Point {
                model: "gpt2-350m",
                rows: 16 * 1024,
                dtype: DType::Bf16,
            },
            Point {
                model: "gpt2-350m",
                rows: 16 * 1024,
                dtype: DType::F32,
            },
        ];
        for pt in &points {
            for &variant in CrossEntropyKernel::ALL {
                let precision = if pt.dtype == DType::Bf16 {
                    Precision::Bf16
                } else {
                    Precision::Fp32
                };
                let Some(mut be) = backend_or_skip(precision) else {
                    return;
                };
                be.set_kernel_variant(variant);
                measure(&mut be, pt, variant.name());
            }
        }
    }

    fn measure(be: &mut CudaBackend, pt: &Point, variant: &str) {
        assert!(pt.rows.is_multiple_of(SEED_ROWS));
        let scalars = StepScalars {
            lr: 0.0,
            step: 1,
            loss_scale: None,
        };
        let seed_len = SEED_ROWS * VOCAB;
        be.alloc(SEED, &[seed_len as u64], pt.dtype).unwrap();
        be.write_f32(SEED, &uniform(seed_len, 1, -8.0, 8.0))
            .unwrap();
        be.alloc(LOGITS, &[(pt.rows * VOCAB) as u64], pt.dtype)
            .unwrap();
        be.alloc(TARGETS, &[pt.rows as u64], DType::I32).unwrap();
        let targets: Vec<i32> = uniform(pt.rows, 2, -1.0, 1.0)
            .iter()
            .map(|u| ((u + 1.0) * 0.5 * (VOCAB - 1) as f32) as i32)
            .collect();
        be.write_i32(TARGETS, &targets).unwrap();
        be.alloc(LOSS, &[1], DType::F32).unwrap();
        be.write_f32(LOSS, &[0.0]).unwrap();
        let refill = |be: &mut CudaBackend| {
            for block in 0..pt.rows / SEED_ROWS {
                let copy = Op::CopyRange {
                    src_offset: 0,
                    dst_offset: (block * seed_len) as u64,
                    len: seed_len as u64,
                };
                be.compute(&copy, &[SEED], &[LOGITS], &scalars).unwrap();
            }
        };
        let op = Op::CrossEntropy {
            vocab: VOCAB as u64,
            scale: SCALE,
        };
        // Warm-up: module load, the scratch, first-use attributes; its loss is the one printed.
        refill(be);
        be.compute(&op, &[LOGITS, TARGETS], &[LOGITS, LOSS], &scalars)
            .unwrap();
        be.synchronize().unwrap();
        let loss = be.read_f32(LOSS).unwrap()[0];
        let mut times = Vec::new();
        for _ in 0..REPS {
            refill(be);
            be.mark_time().unwrap();
            be.compute(&op, &[LOGITS, TARGETS], &[LOGITS, LOSS], &scalars)
                .unwrap();
            be.mark_time().unwrap();
            times.extend(be.marked_intervals().unwrap());
        }
        let t = median(times);
        let elem = if pt.dtype == DType::Bf16 { 2 } else { 4 };
        let bytes = 2.0 * (pt.rows * VOCAB * elem) as f64;
        let dtype = if pt.dtype == DType::Bf16 {
            "bf16"
        } else {
            "f32"
        };
        println!(
            "{{\"bench\":\"cross_entropy\",\"model\":\"{}\",\"variant\":\"{variant}\",\"dtype\":\"{dtype}\",\"rows\":{},\"vocab\":{VOCAB},\"ms\":{:.3},\"gbps\":{:.0},\"loss\":{loss:.7}}}",
            pt.model,
            pt.rows,
            t * 1e3,
            bytes / t / 1e9,
        );
        for id in [SEED, LOGITS, TARGETS, LOSS] {
            be.free(id).unwrap();
        }
    }
}
