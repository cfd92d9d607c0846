//! GEMMs (`Matmul`, its data and weight backwards, with and without bias, with a fused
//! activation or activation gradient: gelu_tanh by cuBLASLt's epilogues, relu by the separate
//! kernels; SwiGLU's gated product and its gradient, apart and in parc's GEMM epilogue; with a
//! fused residual add) in fp32, bf16 and fp16 runs; with bf16 storage (bf16 activation operands and
//! outputs, f32 weights, biases and their gradients; and runs mixing f32 and bf16
//! activations); that a bf16 run's cached weight casts follow every write to the weight; and
//! the bit-exact rounding of bf16 and fp16 GEMM operands.
use crate::harness::{
    check, check_on, fp16, gpu_with, Case, Data, Rng, BF16_GEMM, BF16_ROUNDED, FP16_GEMM,
    FP16_ROUNDED, REDUCTION, SCALARS,
};
use parc_compiler::ir::op::{Act, Op};
use parc_compiler::ir::{BufferId, DType};
use parc_compiler::spec::Precision;
use parc_runtime::backend::Backend;
use parc_runtime::cpu::CpuBackend;

fn matmul_cases(test: &str, tol: f32) -> Vec<Case> {
    matmul_cases_of(test, tol, &[(37, 50, 70), (256, 128, 384), (1, 3, 5)])
}

/// Every GEMM op form at each (rows, in, out) of `shapes`.
fn matmul_cases_of(test: &str, tol: f32, shapes: &[(usize, usize, usize)]) -> Vec<Case> {
    let mut r = Rng::new(test);
    let mut cases = Vec::new();
    for &(rows, k, m) in shapes {
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
                act: None,
                residual: false,
                swiglu: false,
                fp8: None,
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
                act: None,
                residual: false,
                swiglu: false,
                fp8: None,
            },
            vec![
                Data::F32(x.clone()),
                Data::F32(w.clone()),
                Data::F32(r.vec(m, 1.0)),
            ],
            vec![r.vec(rows * m, 1.0)],
            tol,
        ));
        // dx starts random: accumulate adds into it, otherwise it is overwritten.
        for accumulate in [false, true] {
            cases.push(Case::new(
                format!("matmul_bwd_data {rows}x{k}x{m} accumulate={accumulate}"),
                Op::MatmulBwdData {
                    in_dim: i,
                    out_dim: o,
                    accumulate,
                    act_grad: None,
                    swiglu: false,
                    fp8: None,
                },
                vec![Data::F32(dy.clone()), Data::F32(w.clone())],
                vec![r.vec(rows * k, 1.0)],
                tol,
            ));
        }
        // Fused activations: gelu_tanh through cuBLASLt's GELU epilogues, relu through the
        // separate kernels (no epilogue takes it); y and a (forward), dx (backward) start
        // random and are overwritten.
        for act in [Act::GeluTanh, Act::Relu] {
            for bias in [false, true] {
                let mut ins = vec![Data::F32(x.clone()), Data::F32(w.clone())];
                if bias {
                    ins.push(Data::F32(r.vec(m, 1.0)));
                }
                // The activation is judged on the product's scale: relu zeroes about half of
                // it, and a 16-bit run's weight rounding errs on the product's scale.
                cases.push(
                    Case::new(
                        format!("matmul_act {act:?} bias={bias} {rows}x{k}x{m}"),
                        Op::Matmul {
                            in_dim: i,
                            out_dim: o,
                            bias,
                            act: Some(act),
                            residual: false,
                            swiglu: false,
                            fp8: None,
                        },
                        ins,
                        vec![r.vec(rows * m, 1.0), r.vec(rows * m, 1.0)],
                        tol,
                    )
                    .errors_scaled_by_output(0),
                );
            }
            cases.push(Case::new(
                format!("matmul_bwd_data_act {act:?} {rows}x{k}x{m}"),
                Op::MatmulBwdData {
                    in_dim: i,
                    out_dim: o,
                    accumulate: false,
                    act_grad: Some(act),
                    swiglu: false,
                    fp8: None,
                },
                vec![
                    Data::F32(dy.clone()),
                    Data::F32(w.clone()),
                    Data::F32(r.vec(rows * k, 2.0)),
                ],
                vec![r.vec(rows * k, 1.0)],
                tol,
            ));
        }
        cases.extend(swiglu_cases(&mut r, (rows, k, m), (&x, &w, &dy), tol));
        // A fused residual (r added by the GEMM: C = r, beta = 1), alone and under a fused
        // GELU (the residual is part of the pre-activation).
        for act in [None, Some(Act::GeluTanh)] {
            for bias in [false, true] {
                let mut ins = vec![Data::F32(x.clone()), Data::F32(w.clone())];
                if bias {
                    ins.push(Data::F32(r.vec(m, 1.0)));
                }
                ins.push(Data::F32(r.vec(rows * m, 1.0)));
                let mut outs = vec![r.vec(rows * m, 1.0)];
                if act.is_some() {
                    outs.push(r.vec(rows * m, 1.0));
                }
                cases.push(Case::new(
                    format!("matmul_residual act={act:?} bias={bias} {rows}x{k}x{m}"),
                    Op::Matmul {
                        in_dim: i,
                        out_dim: o,
                        bias,
                        act,
                        residual: true,
                        swiglu: false,
                        fp8: None,
                    },
                    ins,
                    outs,
                    tol,
                ));
            }
        }
        // dw (and db) added into their random initial values, or overwritten (a first
        // contribution: beta 0, the bias-gradient epilogue or column sum written into db).
        for (bias, accumulate) in [(false, true), (true, true), (false, false), (true, false)] {
            let mut outs = vec![r.vec(m * k, 1.0)];
            if bias {
                outs.push(r.vec(m, 1.0));
            }
            cases.push(Case::new(
                format!("matmul_bwd_weight {rows}x{k}x{m} bias={bias} accumulate={accumulate}"),
                Op::MatmulBwdWeight {
                    in_dim: i,
                    out_dim: o,
                    bias,
                    accumulate_param_grad: accumulate,
                    fp8: None,
                },
                vec![Data::F32(dy.clone()), Data::F32(x.clone())],
                outs,
                tol,
            ));
        }
    }
    cases
}

/// SwiGLU's gated product in the up projection's GEMM (gate read; u and a = silu(gate) ⊙ u
/// written) and its gradient in the down projection's data gradient (gate and up read; dgate
/// and dup written), outputs starting random. The gated output is judged on the product's
/// scale, as a fused activation is.
fn swiglu_cases(
    r: &mut Rng,
    (rows, k, m): (usize, usize, usize),
    (x, w, dy): (&[f32], &[f32], &[f32]),
    tol: f32,
) -> Vec<Case> {
    let (i, o) = (k as u64, m as u64);
    let up = Op::Matmul {
        in_dim: i,
        out_dim: o,
        bias: false,
        act: None,
        residual: false,
        swiglu: true,
        fp8: None,
    };
    let ins = vec![
        Data::F32(x.to_vec()),
        Data::F32(w.to_vec()),
        Data::F32(r.vec(rows * m, 2.0)),
    ];
    let outs = vec![r.vec(rows * m, 1.0), r.vec(rows * m, 1.0)];
    let forward = Case::new(format!("matmul_swiglu {rows}x{k}x{m}"), up, ins, outs, tol)
        .errors_scaled_by_output(0);
    let down = Op::MatmulBwdData {
        in_dim: i,
        out_dim: o,
        accumulate: false,
        act_grad: None,
        swiglu: true,
        fp8: None,
    };
    let ins = vec![
        Data::F32(dy.to_vec()),
        Data::F32(w.to_vec()),
        Data::F32(r.vec(rows * k, 2.0)),
        Data::F32(r.vec(rows * k, 1.0)),
    ];
    let outs = vec![r.vec(rows * k, 1.0), r.vec(rows * k, 1.0)];
    let name = format!("matmul_bwd_data_swiglu {rows}x{k}x{m}");
    vec![forward, Case::new(name, down, ins, outs, tol)]
}

#[test]
fn matmuls() {
    check("matmuls", &matmul_cases("matmuls", REDUCTION));
}

#[test]
fn matmuls_bf16() {
    let cases = matmul_cases("matmuls_bf16", BF16_GEMM);
    let worst = check_on("matmuls_bf16", &cases, Precision::Bf16);
    assert_mostly_rounded(&worst, BF16_ROUNDED, "bf16");
}

/// Both backends store the activations bf16 (x, y, dy, dx) and keep w, b, dw, db f32: the GPU
/// reads them straight from the bf16 buffers and writes bf16 y/dx, the CPU rounds its f32
/// result once on write (the harness checks a bf16 output holds bf16 values). The GPU also
/// rounds w to bf16 (the CPU does not), hence the bf16 GEMM tolerance; dw and db, products of
/// bf16 values summed in fp32 on both, accumulate onto their random starting values. (No
/// "was it rounded" check: dw and db agree to fp32 rounding here, and y's error is mostly
/// where the two round a nearly equal f32 to neighbouring bf16 values.)
#[test]
fn matmuls_bf16_storage() {
    let cases: Vec<Case> = matmul_cases("matmuls_bf16_storage", BF16_GEMM)
        .into_iter()
        .map(|c| c.stored_bf16(BF16_GEMM))
        .collect();
    check_on("matmuls_bf16_storage", &cases, Precision::Bf16);
}

/// parc's Hopper GEMM kernel (`gemm_ws.cu`, variant gemm=ws: wherever it takes the GEMM, not
/// only where it was timed faster) on every op form with bf16 storage: shapes with partial
/// tiles in both dimensions, and a weight gradient long enough (8192 rows) that its reduction
/// is split 16 ways (partials added by the tile's last split, bias gradient too).
#[test]
fn matmuls_bf16_storage_ws() {
    #[cfg(feature = "cuda")]
    {
        let test = "matmuls_bf16_storage_ws";
        let shapes = [(256, 128, 384), (300, 136, 264), (8192, 64, 128)];
        let cases: Vec<Case> = matmul_cases_of(test, BF16_GEMM, &shapes)
            .into_iter()
            .map(|c| c.stored_bf16(BF16_GEMM))
            .collect();
        let Some(mut gpu) =
            crate::harness::hopper_variant(Precision::Bf16, parc_runtime::cuda::GemmKernel::Ws)
        else {
            return;
        };
        crate::harness::check_with(test, &cases, &mut gpu);
        let ran: Vec<String> = gpu
            .gemm_plans()
            .into_iter()
            .filter(|l| l.ends_with("-> parc's kernel"))
            .collect();
        for l in &ran {
            println!("{l}");
        }
        // Forward (plain, bias, GELU, residual), backward-data (plain, GELU gradient) and
        // backward-weight (with and without bias gradient) plans at each of three shapes.
        assert!(
            ran.len() >= 18,
            "parc's GEMM kernel ran {} plans",
            ran.len()
        );
        assert!(
            ran.iter().any(|l| l.contains("(16 splits)")),
            "no split reduction ran"
        );
    }
    #[cfg(not(feature = "cuda"))]
    println!("skipped: no CUDA device (this build has no `cuda` feature)");
}

/// A bf16 run where some activation operands stay f32 (a buffer the plan keeps f32): those go
/// through per-use bf16 copies, the rest are read as stored; outputs of either type.
#[test]
fn matmuls_bf16_mixed_storage() {
    let (f, h) = (DType::F32, DType::Bf16);
    let mut cases = Vec::new();
    for case in matmul_cases("matmuls_bf16_mixed_storage", BF16_GEMM) {
        let (ins, outs): (&[DType], &[DType]) = match case.name() {
            // An f32 residual beside a bf16 y: added by the kernel after the GEMM.
            n if n.starts_with("matmul_residual") => {
                let bias = n.contains("bias=true");
                let act = n.contains("act=Some");
                match (bias, act) {
                    (true, true) => (&[h, f, f, f], &[h, h]),
                    (true, false) => (&[h, f, f, f], &[h]),
                    (false, true) => (&[h, f, f], &[h, h]),
                    (false, false) => (&[h, f, f], &[h]),
                }
            }
            // bf16 y and a; then an f32 y beside a bf16 a (no fused epilogue: the kernel).
            n if n.starts_with("matmul_act") && n.contains("bias=true") => (&[f, f, f], &[h, h]),
            n if n.starts_with("matmul_act") => (&[h, f], &[f, h]),
            n if n.starts_with("matmul_bwd_data_act") => (&[f, f, h], &[h]),
            // An f32 gate, an f32 up: the SwiGLU kernel after the GEMM, not the epilogue.
            n if n.starts_with("matmul_swiglu") => (&[h, f, f], &[h, h]),
            n if n.starts_with("matmul_bwd_data_swiglu") => (&[h, f, h, f], &[h, h]),
            n if n.starts_with("matmul+bias") => (&[f, f, f], &[h]),
            n if n.starts_with("matmul ") => (&[h, f], &[f]),
            n if n.starts_with("matmul_bwd_data") => (&[f, f], &[h]),
            n if n.contains("bias=true") => (&[h, f], &[f, f]),
            _ => (&[f, h], &[f]),
        };
        // A 1x3x5 product is a sum of 3 or 5 terms: bf16 operands (2^-9 relative each) can
        // leave a result that cancels to a few percent of its terms' size off by more than
        // the larger shapes' bound, and an activation gradient then zeroes or shrinks some of
        // its 3 values (a device run saw 6.3% under ReLU'). These cases check the tails' indexing,
        // which a wrong element would miss by far more.
        let tol = if case.name().contains(" 1x3x5") {
            0.15
        } else {
            BF16_GEMM
        };
        cases.push(case.with_dtypes(ins, outs, tol));
    }
    check_on("matmuls_bf16_mixed_storage", &cases, Precision::Bf16);
}

/// One step of a weight-cast check: a host write, an op, or a read to compare.
enum Step {
    Write(u32, Vec<f32>),
    Compute(Op, Vec<u32>, Vec<u32>),
    Read(u32),
}

/// Allocates `buffers` (element count, dtype) as ids 0.., runs `steps`; the values read.
fn run_steps(b: &mut dyn Backend, buffers: &[(usize, DType)], steps: &[Step]) -> Vec<Vec<f32>> {
    for (i, &(len, dtype)) in buffers.iter().enumerate() {
        b.alloc(BufferId(i as u32), &[len as u64], dtype).unwrap();
    }
    let ids = |v: &[u32]| v.iter().map(|&i| BufferId(i)).collect::<Vec<_>>();
    let mut reads = Vec::new();
    for step in steps {
        match step {
            Step::Write(id, data) => b.write_f32(BufferId(*id), data).unwrap(),
            Step::Compute(op, ins, outs) => b
                .compute(op, &ids(ins), &ids(outs), &SCALARS)
                .unwrap_or_else(|e| panic!("{op:?} on {}: {e}", b.name())),
            Step::Read(id) => reads.push(b.read_f32(BufferId(*id)).unwrap()),
        }
    }
    reads
}

/// A bf16 run reads each f32 weight through a cached bf16 cast: after the weight changes —
/// written from the host, updated by an optimizer op, overwritten by another op — the next
/// forward and backward-data GEMMs must use the new weight. Each read must match the CPU
/// (which reads the weight as it is now) and differ from the read before it.
#[test]
fn bf16_weight_casts_follow_the_weight() {
    let Some(mut gpu) = gpu_with(Precision::Bf16) else {
        return;
    };
    let mut r = Rng::new("bf16_weight_casts_follow_the_weight");
    let (rows, k, m) = (64usize, 96usize, 80usize);
    // 0 x, 1 w, 2 b, 3 y, 4 dy, 5 dx (activations bf16), 6 g, 7 coef, 8 w2 (f32).
    let (h, f) = (DType::Bf16, DType::F32);
    let buffers = [
        (rows * k, h),
        (m * k, f),
        (m, f),
        (rows * m, h),
        (rows * m, h),
        (rows * k, h),
        (m * k, f),
        (1, f),
        (m * k, f),
    ];
    let forward = Op::Matmul {
        in_dim: k as u64,
        out_dim: m as u64,
        bias: true,
        act: None,
        residual: false,
        swiglu: false,
        fp8: None,
    };
    let backward = Op::MatmulBwdData {
        in_dim: k as u64,
        out_dim: m as u64,
        accumulate: false,
        act_grad: None,
        swiglu: false,
        fp8: None,
    };
    let sgd = Op::Sgd {
        momentum: 0.0,
        weight_decay: 0.0,
    };
    let use_w = || {
        vec![
            Step::Compute(forward.clone(), vec![0, 1, 2], vec![3]),
            Step::Read(3),
            Step::Compute(backward.clone(), vec![4, 1], vec![5]),
            Step::Read(5),
        ]
    };
    let mut steps = vec![
        Step::Write(0, r.vec(rows * k, 1.0)),
        Step::Write(1, r.vec(m * k, 1.0)),
        Step::Write(2, r.vec(m, 1.0)),
        Step::Write(4, r.vec(rows * m, 1.0)),
        // lr 0.01 · g of 50: each weight moves by about 0.5.
        Step::Write(6, r.vec(m * k, 50.0)),
        Step::Write(7, vec![1.0]),
        Step::Write(8, r.vec(m * k, 1.0)),
    ];
    steps.extend(use_w());
    steps.push(Step::Write(1, r.vec(m * k, 1.0)));
    steps.extend(use_w());
    steps.push(Step::Compute(sgd, vec![6, 7], vec![1]));
    steps.extend(use_w());
    steps.push(Step::Compute(Op::Copy, vec![8], vec![1]));
    steps.extend(use_w());
    let want = run_steps(&mut CpuBackend::new(), &buffers, &steps);
    let got = run_steps(gpu.as_mut(), &buffers, &steps);
    let worst = |a: &[f32], b: &[f32]| {
        let rms = (b.iter().map(|v| v * v).sum::<f32>() / b.len() as f32).sqrt();
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / (y.abs() + rms))
            .fold(0.0f32, f32::max)
    };
    let labels = ["first", "after write_f32", "after Sgd", "after Copy"];
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        let (label, what) = (labels[i / 2], ["y", "dx"][i % 2]);
        let err = worst(g, w);
        println!("{what} {label}: worst relative error {err:.3e} against the CPU");
        assert!(
            err <= BF16_GEMM,
            "{what} {label}: error {err:.3e} > {BF16_GEMM:.0e}"
        );
        if i >= 2 {
            let moved = worst(&got[i - 2], w);
            println!("{what} {label}: differs from the previous {what} by {moved:.3e}");
            assert!(
                moved > 10.0 * BF16_GEMM,
                "{what} {label} hardly changed ({moved:.3e}): the GEMM read a stale weight cast"
            );
        }
    }
}

#[test]
fn matmuls_fp16() {
    let cases = matmul_cases("matmuls_fp16", FP16_GEMM);
    let worst = check_on("matmuls_fp16", &cases, fp16(1024.0));
    assert_mostly_rounded(&worst, FP16_ROUNDED, "fp16");
}

/// Most GEMM outputs' worst errors (`worst`, empty when skipped) must exceed `rounded`, the
/// sign that the operands were rounded to `label` (the 1x3x5 cases and the bias sums may not
/// show it).
fn assert_mostly_rounded(worst: &[f32], rounded: f32, label: &str) {
    let n = worst.iter().filter(|&&e| e > rounded).count();
    assert!(
        worst.is_empty() || n * 2 > worst.len(),
        "{label} GEMMs agree with fp32 to {rounded:.0e} in {} of {} outputs: the operands \
         were not rounded to {label}",
        worst.len() - n,
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
        act: None,
        residual: false,
        swiglu: false,
        fp8: None,
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

/// (input, rounded) near 1 for a 16-bit format of spacing `ulp` in [1, 2): ties to even both
/// ways, just above a tie, a negative value below half an ulp, a carry into the exponent.
fn near_one(ulp: f32) -> [(f32, f32); 6] {
    [
        (1.0, 1.0),
        (1.0 + ulp / 2.0, 1.0),                        // tie, 1.0 is even
        (1.0 + 1.5 * ulp, 1.0 + 2.0 * ulp),            // tie, rounds up to even
        (1.0 + ulp / 2.0 + 2f32.powi(-20), 1.0 + ulp), // above the tie
        (-(1.0 + 0.25 * ulp), -1.0),                   // below half an ulp, negative
        (2.0 - ulp / 4.0, 2.0),                        // carries into the exponent
    ]
}

/// fp16 operands round as IEEE binary16: nearest, ties to even, carries into the exponent,
/// the largest finite 65504 (and below-halfway values above it), infinity from 65520 up (a
/// scaled gradient that overflows fp16 must become infinite so the step is skipped),
/// subnormals down to 2^-24 with ties to even at the bottom, NaN kept.
#[test]
fn fp16_operands_round_to_nearest_even() {
    let ulp = 2f32.powi(-10); // fp16's spacing in [1, 2)
    let tiny = 2f32.powi(-24); // its smallest subnormal
    let mut cases = near_one(ulp).to_vec();
    cases.extend([
        (65504.0, 65504.0),       // the largest finite
        (65519.0, 65504.0),       // below the halfway point to 2^16
        (65520.0, f32::INFINITY), // the halfway point rounds up: overflow
        (-1e6, f32::NEG_INFINITY),
        (tiny, tiny),
        (1.5 * tiny, 2.0 * tiny), // tie between subnormals, to even
        (tiny / 2.0, 0.0),        // tie with zero, to even
        (0.75 * tiny, tiny),
        (f32::NAN, f32::NAN),
    ]);
    assert_gemm_operands_round(fp16(1.0), "fp16", &cases);
}

/// A bf16 GEMM with k = 1 and a weight of 1 returns its input rounded to bf16, exactly: checks
/// the conversion's rounding (nearest, ties to even, carries into the exponent, overflow to
/// infinity, NaN kept) against hand-computed values.
#[test]
fn bf16_operands_round_to_nearest_even() {
    let ulp = 2f32.powi(-7); // bf16's spacing in [1, 2)
    let big = 2f32.powi(127);
    let mut cases = near_one(ulp).to_vec();
    cases.extend([
        (big * (1.0 + 0.75 * ulp), big * (1.0 + ulp)), // large, still finite
        (f32::MAX, f32::INFINITY),                     // past bf16's largest
        (f32::NEG_INFINITY, f32::NEG_INFINITY),
        (f32::NAN, f32::NAN),
    ]);
    assert_gemm_operands_round(Precision::Bf16, "bf16", &cases);
}
