//! Differential test of the CUDA backend against the CPU backend (the exact reference): every
//! op of `parc_compiler::ir::op`, forward and backward, on fresh random inputs each run (the
//! seed is printed; set PARC_TEST_SEED to replay one). Outputs start from random values too, so
//! (+=) accumulation and "rest untouched" are checked, not only the written values.
//!
//! Tolerance, per op, on `|gpu − cpu| ≤ tol · (|cpu| + rms(cpu))` (rms: the output's typical
//! size, so values near zero after cancellation are judged on the output's scale):
//! fp32 elementwise 1e-5; reductions, GEMMs, norms, cross-entropy, attention 1e-4.
//! bf16 (`precision = bf16`: GEMM operands rounded to bf16, fp32 accumulation): GEMMs 2e-2
//! against the fp32 CPU (each operand carries up to 2^-9 relative rounding; the sum's error is
//! a random walk on the output's scale, a few 1e-3 in practice), and the worst error must also
//! be above 1e-4, so a bf16 run that silently stayed fp32 fails; attention with head_dim 64 or
//! 128 runs on tensor cores in a bf16 run (bf16 operands; the cases give it bf16-valued inputs,
//! so P and dS carry the rounding): forward 2e-2, backward 5e-2, and it too must be above 1e-4;
//! every other op is fp32 in a bf16 run and keeps the fp32 tolerances.
//! fp16 (`precision = fp16`: GEMM operands rounded to IEEE half, fp32 accumulation): GEMMs 5e-3
//! (2^-11 relative rounding per operand, 4× finer than bf16), and the worst error must be above
//! 2e-5; the conversion is checked bit-exactly (ties to even, subnormals, overflow to infinity
//! past 65504). Under fp16 loss scaling (`StepScalars::loss_scale`) `CeGrad`, `ClipCoef` and
//! the updates hold the fp32 tolerances, and an overflowed step's NaN coefficient leaves the
//! parameters and optimizer state untouched on both backends.
//!
//! Without a GPU (or built without `--features cuda`) every test prints
//! `skipped: no CUDA device (…)` and passes.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use parc_compiler::ir::op::{Act, Op, Segment};
use parc_compiler::ir::{BufferId, DType};
use parc_compiler::spec::Precision;
use parc_runtime::backend::{Backend, StepScalars};
use parc_runtime::cpu::CpuBackend;
use std::time::{SystemTime, UNIX_EPOCH};

const ELEMENTWISE: f32 = 1e-5;
const REDUCTION: f32 = 1e-4;
const BF16_GEMM: f32 = 2e-2;
/// bf16 tensor-core attention against the fp32 CPU on the same bf16-valued q, k, v, dO: P and
/// dS are rounded to bf16 (2^-9 relative) for their products, softmax and sums stay fp32.
/// Seen on an H200: forward ≤ 7e-3; backward ≤ 2.1e-2 (dS = P∘(dP − δ) cancels, and dK, dQ
/// sum its rounding over every query or key).
const BF16_ATTENTION: (f32, f32) = (2e-2, 5e-2);
/// A bf16 GEMM's worst error must exceed this (fp32 GEMMs stay below 2e-6).
const BF16_ROUNDED: f32 = 1e-4;
const FP16_GEMM: f32 = 5e-3;
/// An fp16 GEMM's worst error must exceed this.
const FP16_ROUNDED: f32 = 2e-5;

fn fp16(scale: f64) -> Precision {
    Precision::Fp16 {
        loss_scale: parc_compiler::spec::LossScale::Static { scale },
    }
}

#[cfg(feature = "cuda")]
fn gpu_with(precision: Precision) -> Option<Box<dyn Backend>> {
    match parc_runtime::cuda::CudaBackend::with_precision(0, precision) {
        Ok(b) => Some(Box::new(b)),
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_with(_precision: Precision) -> Option<Box<dyn Backend>> {
    println!("skipped: no CUDA device (this build has no `cuda` feature)");
    None
}

fn gpu() -> Option<Box<dyn Backend>> {
    gpu_with(Precision::Fp32)
}

/// splitmix64: small, seedable, good enough for test data.
struct Rng(u64);

impl Rng {
    fn new(test: &str) -> Rng {
        let seed = std::env::var("PARC_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
        println!("{test}: seed {seed} (PARC_TEST_SEED={seed} replays it)");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }

    fn positive(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n)
            .map(|_| lo + (self.unit() + 1.0) * 0.5 * (hi - lo))
            .collect()
    }

    fn ids(&mut self, n: usize, below: u64) -> Vec<i32> {
        (0..n).map(|_| (self.next() % below) as i32).collect()
    }
}

#[derive(Clone)]
enum Data {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

impl Data {
    fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::I32(v) => v.len(),
        }
    }
}

/// One op call: its inputs' data and its outputs' initial data (f32), as buffers 0.., then
/// n_inputs... Optionally an output may be one of the inputs (in place).
struct Case {
    name: String,
    op: Op,
    inputs: Vec<Data>,
    outputs: Vec<Vec<f32>>,
    /// For each output: Some(i) when it is input i's buffer (in place).
    aliases: Vec<Option<usize>>,
    tol: f32,
    scalars: StepScalars,
}

const SCALARS: StepScalars = StepScalars {
    lr: 0.01,
    step: 3,
    loss_scale: None,
};

impl Case {
    fn new(
        name: impl Into<String>,
        op: Op,
        inputs: Vec<Data>,
        outputs: Vec<Vec<f32>>,
        tol: f32,
    ) -> Case {
        let aliases = vec![None; outputs.len()];
        Case {
            name: name.into(),
            op,
            inputs,
            outputs,
            aliases,
            tol,
            scalars: SCALARS,
        }
    }

    /// Runs the case on `b`; returns the outputs after the op.
    fn run(&self, b: &mut dyn Backend) -> Vec<Vec<f32>> {
        let mut ids_in = Vec::new();
        for (i, d) in self.inputs.iter().enumerate() {
            let id = BufferId(i as u32);
            let shape = [d.len() as u64];
            match d {
                Data::F32(v) => {
                    b.alloc(id, &shape, DType::F32).unwrap();
                    b.write_f32(id, v).unwrap();
                }
                Data::I32(v) => {
                    b.alloc(id, &shape, DType::I32).unwrap();
                    b.write_i32(id, v).unwrap();
                }
            }
            ids_in.push(id);
        }
        let mut ids_out = Vec::new();
        for (o, init) in self.outputs.iter().enumerate() {
            let id = match self.aliases[o] {
                Some(i) => BufferId(i as u32),
                None => {
                    let id = BufferId((self.inputs.len() + o) as u32);
                    b.alloc(id, &[init.len() as u64], DType::F32).unwrap();
                    b.write_f32(id, init).unwrap();
                    id
                }
            };
            ids_out.push(id);
        }
        b.compute(&self.op, &ids_in, &ids_out, &self.scalars)
            .unwrap_or_else(|e| panic!("{} on {}: {e}", self.name, b.name()));
        ids_out.iter().map(|&id| b.read_f32(id).unwrap()).collect()
    }
}

/// Runs every case on both backends and compares; prints the worst error per case.
fn check(test: &str, cases: &[Case]) {
    check_on(test, cases, Precision::Fp32);
}

/// As `check`, with the GPU backend in `precision`; returns the worst error of every output
/// (empty when skipped).
fn check_on(test: &str, cases: &[Case], precision: Precision) -> Vec<f32> {
    let Some(mut gpu) = gpu_with(precision) else {
        return Vec::new();
    };
    let mut worst_errors = Vec::new();
    let mut failures = Vec::new();
    for case in cases {
        let mut cpu = CpuBackend::new();
        let want = case.run(&mut cpu);
        let got = case.run(gpu.as_mut());
        // Free the case's buffers on the GPU so the next case can reuse the ids.
        let n = case.inputs.len() + case.outputs.len();
        for i in 0..n {
            let _ = gpu.free(BufferId(i as u32));
        }
        for (o, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.len(), g.len());
            let rms = (w.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / w.len().max(1) as f64)
                .sqrt() as f32;
            let mut worst = (0.0f32, 0usize);
            for (i, (a, b)) in g.iter().zip(w).enumerate() {
                let err = if a.is_finite() && b.is_finite() {
                    (a - b).abs() / (b.abs() + rms).max(f32::MIN_POSITIVE)
                } else if a == b || (a.is_nan() && b.is_nan()) {
                    0.0
                } else {
                    f32::INFINITY
                };
                if err > worst.0 || err.is_nan() {
                    worst = (err, i);
                }
            }
            let (err, i) = worst;
            worst_errors.push(err);
            println!(
                "{test}/{} output {o}: {} values, worst relative error {err:.3e} at {i} (cuda {} cpu {}), tol {:.0e}",
                case.name, w.len(), g.get(i).copied().unwrap_or(0.0), w.get(i).copied().unwrap_or(0.0), case.tol
            );
            if err.is_nan() || err > case.tol {
                failures.push(format!(
                    "{} output {o}: error {err:.3e} > {:.0e} at {i}",
                    case.name, case.tol
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{test}: CUDA differs from CPU:\n{}",
        failures.join("\n")
    );
    worst_errors
}

fn seg(start: u32, len: u32) -> Segment {
    Segment { start, len }
}

#[test]
fn embeddings_and_positions() {
    let mut r = Rng::new("embeddings_and_positions");
    let (rows, dim, vocab_start, vocab_local) = (37, 24, 5u64, 20u64);
    let ids = r.ids(rows, 30);
    let table = r.vec(vocab_local as usize * dim, 1.0);
    let emb = Op::Embedding {
        vocab_start,
        vocab_local,
        dim: dim as u64,
    };
    let emb_bwd = Op::EmbeddingBwd {
        vocab_start,
        vocab_local,
        dim: dim as u64,
    };
    // Context-parallel-like chunk: two segments of the global sequence, batch 3.
    let positions = vec![seg(0, 4), seg(12, 4)];
    let (batch, seq_table) = (3usize, 16usize);
    let prow = 8 * batch;
    let pos_add = Op::PositionAdd {
        batch: batch as u64,
        dim: dim as u64,
        positions: positions.clone(),
    };
    let pos_bwd = Op::PositionAddBwd {
        batch: batch as u64,
        dim: dim as u64,
        positions,
    };
    check(
        "embeddings_and_positions",
        &[
            Case::new(
                "embedding",
                emb,
                vec![Data::I32(ids.clone()), Data::F32(table.clone())],
                vec![r.vec(rows * dim, 1.0)],
                ELEMENTWISE,
            ),
            Case::new(
                "embedding_bwd",
                emb_bwd,
                vec![Data::I32(ids), Data::F32(r.vec(rows * dim, 1.0))],
                vec![r.vec(table.len(), 1.0)],
                REDUCTION,
            ),
            Case::new(
                "position_add",
                pos_add,
                vec![
                    Data::F32(r.vec(prow * dim, 1.0)),
                    Data::F32(r.vec(seq_table * dim, 1.0)),
                ],
                vec![r.vec(prow * dim, 1.0)],
                ELEMENTWISE,
            ),
            Case::new(
                "position_add_bwd",
                pos_bwd,
                vec![Data::F32(r.vec(prow * dim, 1.0))],
                vec![r.vec(seq_table * dim, 1.0)],
                REDUCTION,
            ),
        ],
    );
}

#[test]
fn norms() {
    let mut r = Rng::new("norms");
    let mut cases = Vec::new();
    for (rows, dim) in [(13usize, 96usize), (5, 1000)] {
        let x = r.vec(rows * dim, 2.0);
        let w = r.vec(dim, 1.0);
        let bias = r.vec(dim, 1.0);
        let dy = r.vec(rows * dim, 1.0);
        for with_bias in [false, true] {
            let mut ins = vec![Data::F32(x.clone()), Data::F32(w.clone())];
            if with_bias {
                ins.push(Data::F32(bias.clone()));
            }
            let ln = Op::LayerNorm {
                dim: dim as u64,
                eps: 1e-5,
                bias: with_bias,
            };
            let outs = vec![r.vec(rows * dim, 1.0), r.vec(rows, 1.0), r.vec(rows, 1.0)];
            let fwd = Case::new(
                format!("layer_norm {rows}x{dim} bias={with_bias}"),
                ln.clone(),
                ins.clone(),
                outs,
                REDUCTION,
            );
            // The backward takes mean/rstd from the CPU forward.
            let stats = fwd.run(&mut CpuBackend::new());
            let bwd_ins = vec![
                Data::F32(dy.clone()),
                Data::F32(x.clone()),
                Data::F32(w.clone()),
                Data::F32(stats[1].clone()),
                Data::F32(stats[2].clone()),
            ];
            let mut bwd_outs = vec![r.vec(rows * dim, 1.0), r.vec(dim, 1.0)];
            if with_bias {
                bwd_outs.push(r.vec(dim, 1.0));
            }
            cases.push(fwd);
            cases.push(Case::new(
                format!("layer_norm_bwd {rows}x{dim} bias={with_bias}"),
                Op::LayerNormBwd {
                    dim: dim as u64,
                    bias: with_bias,
                },
                bwd_ins,
                bwd_outs,
                REDUCTION,
            ));
        }
        let rms = Case::new(
            format!("rms_norm {rows}x{dim}"),
            Op::RmsNorm {
                dim: dim as u64,
                eps: 1e-6,
            },
            vec![Data::F32(x.clone()), Data::F32(w.clone())],
            vec![r.vec(rows * dim, 1.0), r.vec(rows, 1.0)],
            REDUCTION,
        );
        let rstd = rms.run(&mut CpuBackend::new())[1].clone();
        cases.push(rms);
        cases.push(Case::new(
            format!("rms_norm_bwd {rows}x{dim}"),
            Op::RmsNormBwd { dim: dim as u64 },
            vec![Data::F32(dy), Data::F32(x), Data::F32(w), Data::F32(rstd)],
            vec![r.vec(rows * dim, 1.0), r.vec(dim, 1.0)],
            REDUCTION,
        ));
    }
    check("norms", &cases);
}

#[test]
fn matmuls() {
    check("matmuls", &matmul_cases("matmuls", REDUCTION));
}

#[test]
fn matmuls_bf16() {
    let cases = matmul_cases("matmuls_bf16", BF16_GEMM);
    let worst = check_on("matmuls_bf16", &cases, Precision::Bf16);
    // Most outputs must show bf16 rounding (the 1x3x5 cases and the bias sums may not).
    let rounded = worst.iter().filter(|&&e| e > BF16_ROUNDED).count();
    assert!(
        worst.is_empty() || rounded * 2 > worst.len(),
        "bf16 GEMMs agree with fp32 to {BF16_ROUNDED:.0e} in {} of {} outputs: the operands \
         were not rounded to bf16",
        worst.len() - rounded,
        worst.len()
    );
}

#[test]
fn matmuls_fp16() {
    let cases = matmul_cases("matmuls_fp16", FP16_GEMM);
    let worst = check_on("matmuls_fp16", &cases, fp16(1024.0));
    let rounded = worst.iter().filter(|&&e| e > FP16_ROUNDED).count();
    assert!(
        worst.is_empty() || rounded * 2 > worst.len(),
        "fp16 GEMMs agree with fp32 to {FP16_ROUNDED:.0e} in {} of {} outputs: the operands \
         were not rounded to fp16",
        worst.len() - rounded,
        worst.len()
    );
}

/// A GEMM with k = 1 and a weight of 1 returns its input rounded to the run's operand type,
/// exactly: `cases` pairs inputs with their hand-computed roundings.
fn assert_gemm_operands_round(precision: Precision, label: &str, cases: &[(f32, f32)]) {
    let Some(mut gpu) = gpu_with(precision) else {
        return;
    };
    let x: Vec<f32> = cases.iter().map(|c| c.0).collect();
    let n = x.len() as u64;
    gpu.alloc(BufferId(0), &[n], DType::F32).unwrap();
    gpu.write_f32(BufferId(0), &x).unwrap();
    gpu.alloc(BufferId(1), &[1], DType::F32).unwrap();
    gpu.write_f32(BufferId(1), &[1.0]).unwrap();
    gpu.alloc(BufferId(2), &[n], DType::F32).unwrap();
    let op = Op::Matmul {
        in_dim: 1,
        out_dim: 1,
        bias: false,
    };
    gpu.compute(&op, &[BufferId(0), BufferId(1)], &[BufferId(2)], &SCALARS)
        .unwrap();
    let y = gpu.read_f32(BufferId(2)).unwrap();
    for ((input, want), got) in cases.iter().zip(&y) {
        let same = if want.is_nan() {
            got.is_nan()
        } else {
            got.to_bits() == want.to_bits()
        };
        println!("{label}({input:e}) = {got:e}, want {want:e}");
        assert!(same, "{label}({input:e}) gave {got:e}, want {want:e}");
    }
}

/// fp16 operands round as IEEE binary16: nearest, ties to even, carries into the exponent,
/// the largest finite 65504 (and below-halfway values above it), infinity from 65520 up (a
/// scaled gradient that overflows fp16 must become infinite so the step is skipped),
/// subnormals down to 2^-24 with ties to even at the bottom, NaN kept.
#[test]
fn fp16_operands_round_to_nearest_even() {
    let ulp = 2f32.powi(-10); // fp16's spacing in [1, 2)
    let tiny = 2f32.powi(-24); // its smallest subnormal
    let cases: [(f32, f32); 15] = [
        (1.0, 1.0),
        (1.0 + ulp / 2.0, 1.0),                        // tie, 1.0 is even
        (1.0 + 1.5 * ulp, 1.0 + 2.0 * ulp),            // tie, rounds up to even
        (1.0 + ulp / 2.0 + 2f32.powi(-20), 1.0 + ulp), // above the tie
        (-(1.0 + 0.25 * ulp), -1.0),                   // below half an ulp, negative
        (2.0 - ulp / 4.0, 2.0),                        // carries into the exponent
        (65504.0, 65504.0),                            // the largest finite
        (65519.0, 65504.0),                            // below the halfway point to 2^16
        (65520.0, f32::INFINITY),                      // the halfway point rounds up: overflow
        (-1e6, f32::NEG_INFINITY),
        (tiny, tiny),
        (1.5 * tiny, 2.0 * tiny), // tie between subnormals, to even
        (tiny / 2.0, 0.0),        // tie with zero, to even
        (0.75 * tiny, tiny),
        (f32::NAN, f32::NAN),
    ];
    assert_gemm_operands_round(fp16(1.0), "fp16", &cases);
}

/// A bf16 GEMM with k = 1 and a weight of 1 returns its input rounded to bf16, exactly: checks
/// the conversion's rounding (nearest, ties to even, carries into the exponent, overflow to
/// infinity, NaN kept) against hand-computed values.
#[test]
fn bf16_operands_round_to_nearest_even() {
    let ulp = 2f32.powi(-7); // bf16's spacing in [1, 2)
    let big = 2f32.powi(127);
    let cases: [(f32, f32); 10] = [
        (1.0, 1.0),
        (1.0 + ulp / 2.0, 1.0),                        // tie, 1.0 is even
        (1.0 + 1.5 * ulp, 1.0 + 2.0 * ulp),            // tie, rounds up to even
        (1.0 + ulp / 2.0 + 2f32.powi(-20), 1.0 + ulp), // above the tie
        (-(1.0 + 0.25 * ulp), -1.0),                   // below half an ulp, negative
        (2.0 - ulp / 4.0, 2.0),                        // carries into the exponent
        (big * (1.0 + 0.75 * ulp), big * (1.0 + ulp)), // large, still finite
        (f32::MAX, f32::INFINITY),                     // past bf16's largest
        (f32::NEG_INFINITY, f32::NEG_INFINITY),
        (f32::NAN, f32::NAN),
    ];
    assert_gemm_operands_round(Precision::Bf16, "bf16", &cases);
}

/// In a bf16 run, attention with head_dim 64 or 128 runs on tensor cores (bf16 operands, fp32
/// accumulation and softmax): within BF16_ATTENTION of the fp32 CPU, and its worst error must
/// exceed BF16_ROUNDED (the operands were rounded, so the tensor-core kernels ran). Other head
/// dims keep the exact fp32 kernels and the fp32 tolerance in a bf16 run.
#[test]
fn attention_bf16() {
    let mut r = Rng::new("attention_bf16");
    let tc = [
        // GQA, causal, a partial tile.
        AttConfig {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            causal: true,
            q_positions: vec![seg(0, 40)],
            kv_positions: vec![seg(0, 40)],
        },
        // Several tiles: skipped, masked and whole ones.
        AttConfig {
            batch: 2,
            heads: 2,
            kv_heads: 2,
            head_dim: 64,
            causal: true,
            q_positions: vec![seg(0, 300)],
            kv_positions: vec![seg(0, 300)],
        },
        // Context parallel: two q segments, kv the whole sequence.
        AttConfig {
            batch: 1,
            heads: 2,
            kv_heads: 2,
            head_dim: 128,
            causal: true,
            q_positions: vec![seg(16, 48), seg(160, 48)],
            kv_positions: vec![seg(0, 208)],
        },
        // kv ahead of q: the first queries see no key (o = 0, lse = −inf).
        AttConfig {
            batch: 1,
            heads: 2,
            kv_heads: 1,
            head_dim: 64,
            causal: true,
            q_positions: vec![seg(0, 70)],
            kv_positions: vec![seg(5, 70)],
        },
        // Positions not ascending: every tile masked, none skipped.
        AttConfig {
            batch: 1,
            heads: 2,
            kv_heads: 2,
            head_dim: 64,
            causal: true,
            q_positions: vec![seg(64, 64), seg(0, 64)],
            kv_positions: vec![seg(64, 64), seg(0, 64)],
        },
        AttConfig {
            batch: 2,
            heads: 3,
            kv_heads: 3,
            head_dim: 64,
            causal: false,
            q_positions: vec![seg(0, 70)],
            kv_positions: vec![seg(0, 70)],
        },
        AttConfig {
            batch: 1,
            heads: 4,
            kv_heads: 1,
            head_dim: 128,
            causal: true,
            q_positions: vec![seg(0, 200)],
            kv_positions: vec![seg(0, 200)],
        },
    ];
    let cases: Vec<Case> = tc
        .iter()
        .flat_map(|c| attention_cases(&mut r, c, BF16_ATTENTION, true))
        .collect();
    let worst = check_on("attention_bf16", &cases, Precision::Bf16);
    // Every output but lse (which can round to its fp32 value) must show bf16 rounding.
    let rounded = worst.iter().filter(|&&e| e > BF16_ROUNDED).count();
    assert!(
        worst.is_empty() || rounded >= worst.len() - tc.len(),
        "bf16 attention agrees with fp32 to {BF16_ROUNDED:.0e} in {} of {} outputs: the \
         tensor-core kernels did not run",
        worst.len() - rounded,
        worst.len()
    );
    let exact = AttConfig {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        causal: true,
        q_positions: vec![seg(0, 40)],
        kv_positions: vec![seg(0, 40)],
    };
    check_on(
        "attention_bf16_other_head_dims_stay_fp32",
        &attention_cases(&mut r, &exact, (REDUCTION, REDUCTION), false),
        Precision::Bf16,
    );
}

fn matmul_cases(test: &str, tol: f32) -> Vec<Case> {
    let mut r = Rng::new(test);
    let mut cases = Vec::new();
    for (rows, k, m) in [(37usize, 50usize, 70usize), (256, 128, 384), (1, 3, 5)] {
        let x = r.vec(rows * k, 1.0);
        let w = r.vec(m * k, 1.0);
        let dy = r.vec(rows * m, 1.0);
        let (i, o) = (k as u64, m as u64);
        cases.push(Case::new(
            format!("matmul {rows}x{k}x{m}"),
            Op::Matmul {
                in_dim: i,
                out_dim: o,
                bias: false,
            },
            vec![Data::F32(x.clone()), Data::F32(w.clone())],
            vec![r.vec(rows * m, 1.0)],
            tol,
        ));
        cases.push(Case::new(
            format!("matmul+bias {rows}x{k}x{m}"),
            Op::Matmul {
                in_dim: i,
                out_dim: o,
                bias: true,
            },
            vec![
                Data::F32(x.clone()),
                Data::F32(w.clone()),
                Data::F32(r.vec(m, 1.0)),
            ],
            vec![r.vec(rows * m, 1.0)],
            tol,
        ));
        cases.push(Case::new(
            format!("matmul_bwd_data {rows}x{k}x{m}"),
            Op::MatmulBwdData {
                in_dim: i,
                out_dim: o,
            },
            vec![Data::F32(dy.clone()), Data::F32(w)],
            vec![r.vec(rows * k, 1.0)],
            tol,
        ));
        for bias in [false, true] {
            let mut outs = vec![r.vec(m * k, 1.0)];
            if bias {
                outs.push(r.vec(m, 1.0));
            }
            cases.push(Case::new(
                format!("matmul_bwd_weight {rows}x{k}x{m} bias={bias}"),
                Op::MatmulBwdWeight {
                    in_dim: i,
                    out_dim: o,
                    bias,
                },
                vec![Data::F32(dy.clone()), Data::F32(x.clone())],
                outs,
                tol,
            ));
        }
    }
    cases
}

#[test]
fn rope() {
    let mut r = Rng::new("rope");
    let positions = vec![seg(0, 5), seg(1000, 5)];
    let (batch, heads, head_dim) = (2u64, 3u64, 16u64);
    let n = (10 * batch * heads * head_dim) as usize;
    let fwd = Op::Rope {
        batch,
        heads,
        head_dim,
        theta: 10000.0,
        positions: positions.clone(),
    };
    let bwd = Op::RopeBwd {
        batch,
        heads,
        head_dim,
        theta: 500000.0,
        positions,
    };
    check(
        "rope",
        &[
            Case::new(
                "rope",
                fwd,
                vec![Data::F32(r.vec(n, 1.0))],
                vec![r.vec(n, 1.0)],
                ELEMENTWISE,
            ),
            Case::new(
                "rope_bwd",
                bwd,
                vec![Data::F32(r.vec(n, 1.0))],
                vec![r.vec(n, 1.0)],
                ELEMENTWISE,
            ),
        ],
    );
}

struct AttConfig {
    batch: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    causal: bool,
    q_positions: Vec<Segment>,
    kv_positions: Vec<Segment>,
}

/// `x` rounded to the nearest bf16 (ties to even; finite inputs).
fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1));
    f32::from_bits(rounded & 0xffff_0000)
}

/// Forward and backward cases of `c`, held to `tol` (forward, backward). With `bf16_inputs`, q, k, v and dO are
/// bf16 values (as a bf16 run's tensor cores read them), so the comparison measures the
/// kernels' own rounding (P and dS in bf16) rather than the inputs'.
fn attention_cases(r: &mut Rng, c: &AttConfig, tol: (f32, f32), bf16_inputs: bool) -> Vec<Case> {
    let seq_q: u32 = c.q_positions.iter().map(|s| s.len).sum();
    let seq_kv: u32 = c.kv_positions.iter().map(|s| s.len).sum();
    let q_len = (u64::from(seq_q) * c.batch * c.heads * c.head_dim) as usize;
    let kv_len = (u64::from(seq_kv) * c.batch * c.kv_heads * c.head_dim) as usize;
    let lse_len = (c.batch * c.heads * u64::from(seq_q)) as usize;
    let scale = 1.0 / (c.head_dim as f64).sqrt();
    let fwd = Op::Attention {
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        causal: c.causal,
        scale,
        q_positions: c.q_positions.clone(),
        kv_positions: c.kv_positions.clone(),
    };
    let bwd = Op::AttentionBwd {
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        causal: c.causal,
        scale,
        q_positions: c.q_positions.clone(),
        kv_positions: c.kv_positions.clone(),
    };
    let name = format!(
        "b{} h{} kv{} d{} causal={} q{:?} kv{:?}",
        c.batch, c.heads, c.kv_heads, c.head_dim, c.causal, c.q_positions, c.kv_positions
    );
    let (mut q, mut k, mut v) = (r.vec(q_len, 2.0), r.vec(kv_len, 2.0), r.vec(kv_len, 1.0));
    let mut dout = r.vec(q_len, 1.0);
    if bf16_inputs {
        for x in [&mut q, &mut k, &mut v, &mut dout] {
            x.iter_mut().for_each(|e| *e = round_bf16(*e));
        }
    }
    let fwd_case = Case::new(
        format!("attention {name}"),
        fwd,
        vec![
            Data::F32(q.clone()),
            Data::F32(k.clone()),
            Data::F32(v.clone()),
        ],
        vec![r.vec(q_len, 1.0), r.vec(lse_len, 1.0)],
        tol.0,
    );
    let out = fwd_case.run(&mut CpuBackend::new());
    let bwd_case = Case::new(
        format!("attention_bwd {name}"),
        bwd,
        vec![
            Data::F32(dout),
            Data::F32(q),
            Data::F32(k),
            Data::F32(v),
            Data::F32(out[0].clone()),
            Data::F32(out[1].clone()),
        ],
        vec![r.vec(q_len, 1.0), r.vec(kv_len, 1.0), r.vec(kv_len, 1.0)],
        tol.1,
    );
    vec![fwd_case, bwd_case]
}

#[test]
fn attention() {
    let mut r = Rng::new("attention");
    let configs = [
        // Small head dim, GQA, causal, one segment.
        AttConfig {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            causal: true,
            q_positions: vec![seg(0, 40)],
            kv_positions: vec![seg(0, 40)],
        },
        // Context parallel: the rank's q chunk is two segments, kv the whole sequence.
        AttConfig {
            batch: 1,
            heads: 2,
            kv_heads: 2,
            head_dim: 32,
            causal: true,
            q_positions: vec![seg(8, 8), seg(40, 8)],
            kv_positions: vec![seg(0, 48)],
        },
        // kv ahead of q: the first queries see no key (o = 0, lse = −inf).
        AttConfig {
            batch: 1,
            heads: 2,
            kv_heads: 1,
            head_dim: 8,
            causal: true,
            q_positions: vec![seg(0, 6)],
            kv_positions: vec![seg(3, 6)],
        },
        AttConfig {
            batch: 2,
            heads: 3,
            kv_heads: 3,
            head_dim: 64,
            causal: false,
            q_positions: vec![seg(0, 70)],
            kv_positions: vec![seg(0, 70)],
        },
        AttConfig {
            batch: 1,
            heads: 4,
            kv_heads: 1,
            head_dim: 128,
            causal: true,
            q_positions: vec![seg(0, 65)],
            kv_positions: vec![seg(0, 65)],
        },
        AttConfig {
            batch: 2,
            heads: 2,
            kv_heads: 2,
            head_dim: 64,
            causal: true,
            q_positions: vec![seg(0, 300)],
            kv_positions: vec![seg(0, 300)],
        },
    ];
    let cases: Vec<Case> = configs
        .iter()
        .flat_map(|c| attention_cases(&mut r, c, (REDUCTION, REDUCTION), false))
        .collect();
    check("attention", &cases);
}

#[test]
fn elementwise() {
    let mut r = Rng::new("elementwise");
    let n = 3001;
    let mut cases = Vec::new();
    for act in [Act::Gelu, Act::GeluTanh, Act::Relu] {
        let x = r.vec(n, 4.0);
        cases.push(Case::new(
            format!("activation {act:?}"),
            Op::Activation { act },
            vec![Data::F32(x.clone())],
            vec![r.vec(n, 1.0)],
            ELEMENTWISE,
        ));
        cases.push(Case::new(
            format!("activation_bwd {act:?}"),
            Op::ActivationBwd { act },
            vec![Data::F32(r.vec(n, 1.0)), Data::F32(x)],
            vec![r.vec(n, 1.0)],
            ELEMENTWISE,
        ));
    }
    let (gate, up) = (r.vec(n, 4.0), r.vec(n, 2.0));
    cases.push(Case::new(
        "swiglu",
        Op::SwiGlu,
        vec![Data::F32(gate.clone()), Data::F32(up.clone())],
        vec![r.vec(n, 1.0)],
        ELEMENTWISE,
    ));
    cases.push(Case::new(
        "swiglu_bwd",
        Op::SwiGluBwd,
        vec![Data::F32(r.vec(n, 1.0)), Data::F32(gate), Data::F32(up)],
        vec![r.vec(n, 1.0), r.vec(n, 1.0)],
        ELEMENTWISE,
    ));
    cases.push(Case::new(
        "add",
        Op::Add,
        vec![Data::F32(r.vec(n, 1.0)), Data::F32(r.vec(n, 1.0))],
        vec![r.vec(n, 1.0)],
        ELEMENTWISE,
    ));
    cases.push(Case::new(
        "scale",
        Op::Scale { factor: 0.37 },
        vec![Data::F32(r.vec(n, 1.0))],
        vec![r.vec(n, 1.0)],
        ELEMENTWISE,
    ));
    cases.push(Case::new(
        "copy",
        Op::Copy,
        vec![Data::F32(r.vec(n, 1.0))],
        vec![r.vec(n, 1.0)],
        ELEMENTWISE,
    ));
    cases.push(Case::new(
        "zero",
        Op::Zero,
        vec![],
        vec![r.vec(n, 1.0)],
        ELEMENTWISE,
    ));
    cases.push(Case::new(
        "copy_range",
        Op::CopyRange {
            src_offset: 17,
            dst_offset: 400,
            len: 1000,
        },
        vec![Data::F32(r.vec(n, 1.0))],
        vec![r.vec(2000, 1.0)],
        ELEMENTWISE,
    ));
    // In place: the output is input 0's buffer (the op must see the value from before).
    let mut in_place = Case::new(
        "add in place",
        Op::Add,
        vec![Data::F32(r.vec(n, 1.0)), Data::F32(r.vec(n, 1.0))],
        vec![vec![0.0; n]],
        ELEMENTWISE,
    );
    in_place.aliases = vec![Some(0)];
    cases.push(in_place);
    let mut scale_in_place = Case::new(
        "scale in place",
        Op::Scale { factor: -2.5 },
        vec![Data::F32(r.vec(n, 1.0))],
        vec![vec![0.0; n]],
        ELEMENTWISE,
    );
    scale_in_place.aliases = vec![Some(0)];
    cases.push(scale_in_place);
    check("elementwise", &cases);
}

#[test]
fn cross_entropy() {
    let mut r = Rng::new("cross_entropy");
    let (rows, vocab_start, vocab_local) = (29usize, 100u64, 1000usize);
    let logits = r.vec(rows * vocab_local, 8.0);
    // Targets inside and outside this rank's vocab range.
    let targets = r.ids(rows, 1300);
    let max: Vec<f32> = logits
        .chunks(vocab_local)
        .map(|c| c.iter().copied().fold(f32::NEG_INFINITY, f32::max))
        .collect();
    let sumexp: Vec<f32> = logits
        .chunks(vocab_local)
        .zip(&max)
        .map(|(c, m)| c.iter().map(|l| f64::from((l - m).exp())).sum::<f64>() as f32)
        .collect();
    let v = vocab_local as u64;
    let scale = 1.0 / 64.0;
    check(
        "cross_entropy",
        &[
            Case::new(
                "ce_max",
                Op::CeMax { vocab_local: v },
                vec![Data::F32(logits.clone())],
                vec![r.vec(rows, 1.0)],
                ELEMENTWISE,
            ),
            Case::new(
                "ce_sum_exp",
                Op::CeSumExp { vocab_local: v },
                vec![Data::F32(logits.clone()), Data::F32(max.clone())],
                vec![r.vec(rows, 1.0)],
                REDUCTION,
            ),
            Case::new(
                "ce_target_logit",
                Op::CeTargetLogit {
                    vocab_start,
                    vocab_local: v,
                },
                vec![Data::F32(logits.clone()), Data::I32(targets.clone())],
                vec![r.vec(rows, 1.0)],
                ELEMENTWISE,
            ),
            Case::new(
                "ce_loss",
                Op::CeLoss { scale },
                vec![
                    Data::F32(max.clone()),
                    Data::F32(sumexp.clone()),
                    Data::F32(r.vec(rows, 3.0)),
                ],
                vec![r.vec(1, 1.0)],
                REDUCTION,
            ),
            Case::new(
                "ce_grad",
                Op::CeGrad {
                    vocab_start,
                    vocab_local: v,
                    scale,
                },
                vec![
                    Data::F32(logits),
                    Data::I32(targets),
                    Data::F32(max),
                    Data::F32(sumexp),
                ],
                vec![r.vec(rows * vocab_local, 1.0)],
                REDUCTION,
            ),
        ],
    );
}

#[test]
fn optimizer() {
    let mut r = Rng::new("optimizer");
    let n = 70_001;
    let g = r.vec(n, 0.1);
    let mut cases = vec![
        Case::new(
            "sum_squares",
            Op::SumSquares,
            vec![Data::F32(g.clone())],
            vec![r.positive(1, 0.0, 5.0)],
            REDUCTION,
        ),
        Case::new(
            "clip_coef none",
            Op::ClipCoef { max_norm: None },
            vec![Data::F32(r.positive(1, 0.0, 9.0))],
            vec![r.vec(1, 1.0)],
            ELEMENTWISE,
        ),
        Case::new(
            "clip_coef clipping",
            Op::ClipCoef {
                max_norm: Some(1.0),
            },
            vec![Data::F32(vec![7.3])],
            vec![r.vec(1, 1.0)],
            ELEMENTWISE,
        ),
        Case::new(
            "clip_coef not clipping",
            Op::ClipCoef {
                max_norm: Some(10.0),
            },
            vec![Data::F32(vec![7.3])],
            vec![r.vec(1, 1.0)],
            ELEMENTWISE,
        ),
    ];
    for step in [1u64, 7] {
        let mut adam = Case::new(
            format!("adamw step {step}"),
            Op::AdamW {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            vec![Data::F32(g.clone()), Data::F32(vec![0.8])],
            vec![r.vec(n, 1.0), r.vec(n, 0.01), r.positive(n, 0.0, 1e-4)],
            ELEMENTWISE,
        );
        adam.scalars = StepScalars {
            lr: 3e-4,
            step,
            loss_scale: None,
        };
        cases.push(adam);
        let mut sgd = Case::new(
            format!("sgd momentum step {step}"),
            Op::Sgd {
                momentum: 0.9,
                weight_decay: 0.01,
            },
            vec![Data::F32(g.clone()), Data::F32(vec![0.5])],
            vec![r.vec(n, 1.0), r.vec(n, 0.1)],
            ELEMENTWISE,
        );
        sgd.scalars = StepScalars {
            lr: 0.1,
            step,
            loss_scale: None,
        };
        cases.push(sgd);
    }
    cases.push(Case::new(
        "sgd plain",
        Op::Sgd {
            momentum: 0.0,
            weight_decay: 0.0,
        },
        vec![Data::F32(g), Data::F32(vec![1.0])],
        vec![r.vec(n, 1.0)],
        ELEMENTWISE,
    ));
    check("optimizer", &cases);
}

/// Under fp16 loss scaling (scale 1024 in `StepScalars`): the loss gradient carries the scale,
/// the clip coefficient divides it back out (clipping or not, with or without a max norm) and
/// is NaN for a non-finite squared norm, and the updates skip a non-finite coefficient.
#[test]
fn loss_scaled_ops() {
    let mut r = Rng::new("loss_scaled_ops");
    let scaled = StepScalars {
        loss_scale: Some(1024.0),
        ..SCALARS
    };
    let (rows, vocab) = (13usize, 300usize);
    let logits = r.vec(rows * vocab, 6.0);
    let max: Vec<f32> = logits
        .chunks(vocab)
        .map(|c| c.iter().copied().fold(f32::NEG_INFINITY, f32::max))
        .collect();
    let sumexp: Vec<f32> = logits
        .chunks(vocab)
        .zip(&max)
        .map(|(c, m)| c.iter().map(|l| f64::from((l - m).exp())).sum::<f64>() as f32)
        .collect();
    let mut cases = vec![Case::new(
        "ce_grad scaled",
        Op::CeGrad {
            vocab_start: 0,
            vocab_local: vocab as u64,
            scale: 1.0 / 26.0,
        },
        vec![
            Data::F32(logits),
            Data::I32(r.ids(rows, vocab as u64)),
            Data::F32(max),
            Data::F32(sumexp),
        ],
        vec![r.vec(rows * vocab, 1.0)],
        REDUCTION,
    )];
    let big = 7.3 * 1024.0 * 1024.0;
    for (name, max_norm, sumsq) in [
        ("no max norm", None, big),
        ("clipping", Some(1.0), big),
        ("not clipping", Some(10.0), big),
        ("overflow", Some(1.0), f32::INFINITY),
        ("nan", None, f32::NAN),
    ] {
        cases.push(Case::new(
            format!("clip_coef scaled {name}"),
            Op::ClipCoef { max_norm },
            vec![Data::F32(vec![sumsq])],
            vec![r.vec(1, 1.0)],
            ELEMENTWISE,
        ));
    }
    let n = 5_003;
    let g = r.vec(n, 100.0);
    for coef in [f32::NAN, f32::INFINITY, 0.8 / 1024.0] {
        cases.push(Case::new(
            format!("adamw coef {coef:e}"),
            Op::AdamW {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            vec![Data::F32(g.clone()), Data::F32(vec![coef])],
            vec![r.vec(n, 1.0), r.vec(n, 0.01), r.positive(n, 0.0, 1e-4)],
            ELEMENTWISE,
        ));
        cases.push(Case::new(
            format!("sgd momentum coef {coef:e}"),
            Op::Sgd {
                momentum: 0.9,
                weight_decay: 0.01,
            },
            vec![Data::F32(g.clone()), Data::F32(vec![coef])],
            vec![r.vec(n, 1.0), r.vec(n, 0.1)],
            ELEMENTWISE,
        ));
    }
    for case in &mut cases {
        case.scalars = scaled;
    }
    check("loss_scaled_ops", &cases);
}

/// A lowering bug (wrong lengths, counts, dtypes) is an error on the GPU too, never a crash.
#[test]
fn bad_programs_are_errors() {
    let Some(mut b) = gpu() else { return };
    b.alloc(BufferId(0), &[6], DType::F32).unwrap();
    b.alloc(BufferId(1), &[7], DType::F32).unwrap();
    b.alloc(BufferId(2), &[4], DType::F32).unwrap();
    b.alloc(BufferId(3), &[4], DType::I32).unwrap();
    let matmul = Op::Matmul {
        in_dim: 2,
        out_dim: 2,
        bias: false,
    };
    let err = b
        .compute(
            &matmul,
            &[BufferId(0), BufferId(1)],
            &[BufferId(2)],
            &SCALARS,
        )
        .unwrap_err();
    assert!(err.to_string().contains("Matmul"), "{err}");
    let err = b
        .compute(&Op::Add, &[BufferId(0)], &[BufferId(2)], &SCALARS)
        .unwrap_err();
    assert!(err.to_string().contains("inputs"), "{err}");
    let err = b
        .compute(&Op::Copy, &[BufferId(3)], &[BufferId(2)], &SCALARS)
        .unwrap_err();
    assert!(err.to_string().contains("dtype"), "{err}");
    let range = Op::CopyRange {
        src_offset: 5,
        dst_offset: 0,
        len: 3,
    };
    let err = b
        .compute(&range, &[BufferId(0)], &[BufferId(2)], &SCALARS)
        .unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    assert!(b.alloc(BufferId(0), &[1], DType::F32).is_err());
    assert!(b.read_f32(BufferId(3)).is_err());
    assert!(b.write_f32(BufferId(2), &[1.0; 3]).is_err());
    b.free(BufferId(0)).unwrap();
    assert!(b.free(BufferId(0)).is_err());
    println!("bad_programs_are_errors: every mistake was an error");
}
