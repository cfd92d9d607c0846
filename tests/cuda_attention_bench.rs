//! Causal attention forward + backward TFLOP/s on one GPU, for `bench/RESULTS.md` beside
//! PyTorch SDPA (`bench/attention.py`, same shapes; `bench/attention.sh` runs both in one
//! device call). bf16 runs take the tensor-core kernels (head_dim 64 and 128) on bf16 buffers
//! (q, k, v, o, dO, dQ, dK, dV stored bf16, as a bf16 run's plan stores them; label
//! `parc-bf16-tc`); one point repeats GPT-2 124M's shape on f32 buffers (`parc-bf16-f32buf`:
//! the operands copied to bf16 first), and one fp32 point times the exact kernels. GPT-2 124M's
//! training shape runs once more with q, k, v packed in one qkv buffer (and dq, dk, dv in one
//! dqkv; `…-packed`), the layout one fused projection GEMM writes: the kernels read and write it
//! through row strides, so it should time as the unpacked point does. FLOPs follow PyTorch's attention benchmark: causal
//! forward 4·B·H·T²·d / 2, backward 2.5× the forward.
//!
//! Each bf16 point runs with the `fa2` kernels both ways (labelled as before) and, on a Hopper
//! GPU, with the warp-specialized `ws` kernels (the defaults there, head_dim 64 and 128;
//! labelled `…-ws-wsbwd`) and the `wgmma` forward beside the `ws` backward (`…-wgmma-wsbwd`):
//! each run times both directions. The bench sets the variants on the backend, whatever
//! PARC_ATTENTION_*_KERNEL say.
//!
//! Ignored by default (it needs a GPU): on the device machine,
//! `cuda_attention_bench --ignored --nocapture`. Prints one JSON line per point (`KVH`: kv
//! heads, GQA when below `H`). Without a GPU it prints `skipped: no CUDA device`.
//! `PARC_ATT_POINT=B,H,T,D[,KVH]` runs only that bf16 point, once after the warm-up (for a
//! profiler: its 3rd and 4th attention kernels are the timed ones). `PARC_ATT_GRID=1` runs
//! issue 19's grid instead of the default points: head_dim {64, 128} × T {1k, 2k, 4k, 8k} × GQA
//! ratio {1, 4, 6}, 12 heads (12, 3 or 2 kv heads), B · T = 16k tokens (`PARC_ATT_GRID=64` or
//! `=128`: that head dim's half of it). `PARC_ATT_PAIRS=ws` times only the warp-specialized
//! pair on a Hopper (kernel work: a third of the time).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "gpu_support/mod.rs"]
mod gpu_support;

gpu_support::gpu_benchmark!(attention_tflops, bench::run);

#[cfg(feature = "cuda")]
mod bench {
    use crate::gpu_support::{backend_or_skip, median, uniform};
    use parc_compiler::ir::op::AttentionAttrs;
    use parc_compiler::ir::op::{Op, Segment};
    use parc_compiler::ir::{BufferId, DType};
    use parc_compiler::spec::Precision;
    use parc_runtime::backend::{Backend, StepScalars};
    use parc_runtime::cuda::{AttentionBwdKernel, AttentionFwdKernel, CudaBackend, Variant};
    use std::time::Instant;

    struct Point {
        precision: Precision,
        /// How q, k, v, o, dO, dQ, dK, dV are stored (lse is always f32).
        stored: DType,
        batch: u64,
        heads: u64,
        seq: u64,
        head_dim: u64,
        /// Kv heads (GQA when below `heads`).
        kv_heads: u64,
        iters: usize,
        /// q, k, v in one packed qkv buffer (dq, dk, dv in one dqkv).
        packed: bool,
    }

    fn point(precision: Precision, batch: u64, heads: u64, seq: u64, head_dim: u64) -> Point {
        // About the same work per point: fewer repeats for long sequences.
        let iters = if seq >= 4096 { 5 } else { 20 };
        let stored = match precision {
            Precision::Bf16 => DType::Bf16,
            _ => DType::F32,
        };
        Point {
            precision,
            stored,
            batch,
            heads,
            seq,
            head_dim,
            kv_heads: heads,
            iters,
            packed: false,
        }
    }

    /// `PARC_ATT_GRID=1`: head_dim {64, 128} × T {1k, 2k, 4k, 8k} × GQA ratio {1, 4, 6} on
    /// 12 query heads and 16k tokens (B = 16384 / T), bf16.
    fn grid_points() -> Vec<Point> {
        let mut points = Vec::new();
        for d in [64, 128] {
            for t in [1024, 2048, 4096, 8192] {
                for ratio in [1, 4, 6] {
                    points.push(Point {
                        kv_heads: 12 / ratio,
                        ..point(Precision::Bf16, 16384 / t, 12, t, d)
                    });
                }
            }
        }
        points
    }

    /// `PARC_ATT_POINT=B,H,T,D[,KVH]`, if set.
    fn chosen_point() -> Option<Point> {
        let text = std::env::var("PARC_ATT_POINT").ok()?;
        let v: Vec<u64> = text
            .split(',')
            .map(|x| x.trim().parse().expect("PARC_ATT_POINT is B,H,T,D[,KVH]"))
            .collect();
        assert!(
            v.len() == 4 || v.len() == 5,
            "PARC_ATT_POINT is B,H,T,D[,KVH]"
        );
        Some(Point {
            iters: 1,
            kv_heads: v.get(4).copied().unwrap_or(v[1]),
            ..point(Precision::Bf16, v[0], v[1], v[2], v[3])
        })
    }

    pub fn run() {
        if let Some(pt) = chosen_point() {
            if let Some(mut be) = backend_or_skip(pt.precision) {
                for (fwd, bwd) in variant_pairs(&be, &pt) {
                    measure(&mut be, &pt, fwd, bwd);
                }
            }
            return;
        }
        let grid = std::env::var("PARC_ATT_GRID").unwrap_or_default();
        let points = match grid.as_str() {
            "1" => grid_points(),
            "64" | "128" => grid_points()
                .into_iter()
                .filter(|p| p.head_dim.to_string() == grid)
                .collect(),
            _ => default_points(),
        };
        for pt in &points {
            let Some(mut be) = backend_or_skip(pt.precision) else {
                return;
            };
            for (fwd, bwd) in variant_pairs(&be, pt) {
                measure(&mut be, pt, fwd, bwd);
            }
        }
    }

    /// The points timed by default.
    fn default_points() -> Vec<Point> {
        vec![
            point(Precision::Bf16, 8, 16, 1024, 64),
            point(Precision::Bf16, 8, 16, 4096, 64),
            point(Precision::Bf16, 8, 8, 1024, 128),
            point(Precision::Bf16, 8, 8, 4096, 128),
            // GPT-2 124M's attention at 8 x 1024, on bf16 and on f32 buffers.
            point(Precision::Bf16, 8, 12, 1024, 64),
            // The training steps' shapes: GPT-2 124M at 32 x 1024, 350M at 16 x 1024.
            point(Precision::Bf16, 32, 12, 1024, 64),
            point(Precision::Bf16, 16, 16, 1024, 64),
            Point {
                packed: true,
                ..point(Precision::Bf16, 32, 12, 1024, 64)
            },
            Point {
                stored: DType::F32,
                ..point(Precision::Bf16, 8, 12, 1024, 64)
            },
            Point {
                iters: 2,
                ..point(Precision::Fp32, 8, 16, 1024, 64)
            },
        ]
    }

    /// The (forward, backward) attention variants a point is timed with: `fa2`, and on a
    /// Hopper GPU in a bf16 run the warp-specialized kernels and the wgmma forward beside the
    /// warp-specialized backward (each pair times both directions).
    fn variant_pairs(
        be: &CudaBackend,
        pt: &Point,
    ) -> Vec<(AttentionFwdKernel, AttentionBwdKernel)> {
        let hopper_bf16 = matches!(pt.precision, Precision::Bf16) && be.is_hopper();
        let chosen = std::env::var("PARC_ATT_PAIRS").unwrap_or_default();
        if hopper_bf16 && chosen == "ws" {
            return vec![(AttentionFwdKernel::Ws, AttentionBwdKernel::Ws)];
        }
        let mut pairs = vec![(AttentionFwdKernel::Fa2, AttentionBwdKernel::Fa2)];
        if hopper_bf16 {
            // The warp-specialized kernels (the defaults, head_dim 64 and 128), and the wgmma
            // forward beside them.
            pairs.push((AttentionFwdKernel::Ws, AttentionBwdKernel::Ws));
            pairs.push((AttentionFwdKernel::Wgmma, AttentionBwdKernel::Ws));
        }
        pairs
    }

    /// Times `pt` with attention variants `fwd` and `bwd` (PARC_ATTENTION_FWD_KERNEL's and
    /// PARC_ATTENTION_BWD_KERNEL's names, set here whatever the environment says); the label
    /// names the variants that are not the default.
    fn measure(
        be: &mut CudaBackend,
        pt: &Point,
        fwd_kernel: AttentionFwdKernel,
        bwd_kernel: AttentionBwdKernel,
    ) {
        be.set_kernel_variant(fwd_kernel);
        be.set_kernel_variant(bwd_kernel);
        let (b, h, t, d) = (pt.batch, pt.heads, pt.seq, pt.head_dim);
        let kvh = pt.kv_heads;
        let n = (t * b * h * d) as usize;
        // k, v (dk, dv): kv_heads of head_dim a row.
        let nkv = (t * b * kvh * d) as usize;
        let lse_n = (b * h * t) as usize;
        let positions = vec![Segment {
            start: 0,
            len: t as u32,
        }];
        let scale = 1.0 / (d as f64).sqrt();
        let fwd = Op::Attention(AttentionAttrs {
            batch: b,
            heads: h,
            kv_heads: kvh,
            head_dim: d,
            causal: true,
            scale,
            q_positions: positions.clone(),
            kv_positions: positions.clone(),
            packed: pt.packed,
        });
        let bwd = Op::AttentionBwd(AttentionAttrs {
            batch: b,
            heads: h,
            kv_heads: kvh,
            head_dim: d,
            causal: true,
            scale,
            q_positions: positions.clone(),
            kv_positions: positions,
            packed: pt.packed,
        });
        // q k v o lse do dq dk dv; packed: qkv (as q, k and v) and dqkv (as dq, dk and dv),
        // buffers 1, 2, 7 and 8 left empty.
        let sizes = if pt.packed {
            [n + 2 * nkv, 0, 0, n, lse_n, n, n + 2 * nkv, 0, 0]
        } else {
            [n, nkv, nkv, n, lse_n, n, n, nkv, nkv]
        };
        for (i, &len) in sizes.iter().enumerate().filter(|(_, &len)| len > 0) {
            let id = BufferId(i as u32);
            let dtype = if i == 4 { DType::F32 } else { pt.stored };
            be.alloc(id, &[len as u64], dtype).unwrap();
            be.write_f32(id, &uniform(len, i as u64 + 1, -1.0, 1.0))
                .unwrap();
        }
        let id = |i: u32| BufferId(i);
        let scalars = StepScalars {
            lr: 0.0,
            step: 1,
            loss_scale: None,
        };
        let (fwd_in, fwd_out, bwd_in, bwd_out) = if pt.packed {
            (
                vec![id(0)],
                vec![id(3), id(4)],
                vec![id(5), id(0), id(3), id(4)],
                vec![id(6)],
            )
        } else {
            (
                vec![id(0), id(1), id(2)],
                vec![id(3), id(4)],
                vec![id(5), id(0), id(1), id(2), id(3), id(4)],
                vec![id(6), id(7), id(8)],
            )
        };
        let mut run = |op: &Op, ins: &[BufferId], outs: &[BufferId]| -> f64 {
            be.synchronize().unwrap();
            let start = Instant::now();
            be.compute(op, ins, outs, &scalars).unwrap();
            be.synchronize().unwrap();
            start.elapsed().as_secs_f64()
        };
        // Warm-up: module load, first-use attributes, allocations.
        run(&fwd, &fwd_in, &fwd_out);
        run(&bwd, &bwd_in, &bwd_out);
        let mut fwd_s = Vec::new();
        let mut bwd_s = Vec::new();
        for _ in 0..pt.iters {
            fwd_s.push(run(&fwd, &fwd_in, &fwd_out));
            bwd_s.push(run(&bwd, &bwd_in, &bwd_out));
        }
        let (fwd_t, bwd_t) = (median(fwd_s), median(bwd_s));
        let fwd_flop = 4.0 * (b * h) as f64 * (t * t) as f64 * d as f64 / 2.0;
        let bwd_flop = 2.5 * fwd_flop;
        let label = match (pt.precision, pt.stored) {
            (Precision::Bf16, DType::Bf16) => "parc-bf16-tc",
            (Precision::Bf16, _) => "parc-bf16-f32buf",
            _ => "parc-fp32-exact",
        };
        let mut label = label.to_string();
        if fwd_kernel != AttentionFwdKernel::Fa2 {
            label = format!("{label}-{}", fwd_kernel.name());
        }
        if bwd_kernel != AttentionBwdKernel::Fa2 {
            label = format!("{label}-{}bwd", bwd_kernel.name());
        }
        if pt.packed {
            label = format!("{label}-packed");
        }
        println!(
            "{{\"impl\": \"{label}\", \"B\": {b}, \"H\": {h}, \"KVH\": {kvh}, \"T\": {t}, \"D\": {d}, \"fwd_ms\": {:.3}, \"bwd_ms\": {:.3}, \"fwd_tflops\": {:.1}, \"bwd_tflops\": {:.1}, \"fwdbwd_tflops\": {:.1}}}",
            fwd_t * 1e3,
            bwd_t * 1e3,
            fwd_flop / fwd_t / 1e12,
            bwd_flop / bwd_t / 1e12,
            (fwd_flop + bwd_flop) / (fwd_t + bwd_t) / 1e12
        );
        for (i, _) in sizes.iter().enumerate().filter(|(_, &len)| len > 0) {
            be.free(BufferId(i as u32)).unwrap();
        }
    }
}
