//! FP8 GEMMs (`Matmul`, `MatmulBwdData`, `MatmulBwdWeight` with `fp8` set) on the CUDA
//! backend against the CPU backend's exact emulation (`runtime/src/cpu/fp8.rs`): tensorwise
//! (E5M2 gradients; current and delayed scaling), f32 and bf16 storage, at shapes whose
//! rows, inputs and outputs all end in partial tiles and blocks (150 = 128 + 22 rows, 200 and
//! 136 columns). Both backends quantize to the same FP8 values with the same power-of-two
//! scales and sum their exact products in f32, so they differ by the order of f32 additions:
//! 1e-3 (f32 outputs); bf16 outputs add bf16 rounding (a bias is rounded to bf16 before the
//! product is added onto it on the GPU): `BF16_STORED`. The worst error must also stay far
//! below FP8's own error, which the FP8 numbers' distance from the exact product shows: a GPU
//! that skipped the quantization would fail.
//!
//! Rowwise and blockwise run on parc's own Hopper kernel (`fp8_gemm.cu`: cuBLASLt's algorithm
//! search refuses their scales on Hopper), tensorwise on cuBLASLt; the cases are the same.
//!
//! Also: a NaN in an operand makes the GEMM's output NaN on both backends (the non-finite
//! check still fires); an infinity makes it non-finite on the GPU; blockwise with a block that
//! is not a multiple of 128 is an error that names what is supported.
use crate::harness::{check_with, gpu, gpu_variant, Case, Data, Rng};
use crate::harness::{BF16_STORED, REDUCTION, SCALARS};
use parc_compiler::ir::fp8::{Fp8Format, Fp8Gemm, Fp8Scaling};
use parc_compiler::ir::op::{Act, Op};
use parc_compiler::ir::{BufferId, DType};
use parc_compiler::spec::Precision;
use parc_runtime::backend::Backend;

/// FP8 GEMMs on f32 outputs: f32 sums of identical products in another order.
const FP8_GEMM: f32 = 1e-3;

/// The recipes the CUDA backend runs: each scaling with its default gradient format, and
/// rowwise with E5M2 gradients (parc's kernel for each pair of formats), blockwise(256).
fn recipes() -> Vec<Fp8Gemm> {
    let recipe = |scaling, grad| Fp8Gemm::current(scaling, grad);
    vec![
        recipe(Fp8Scaling::Tensorwise, Fp8Format::E5m2),
        recipe(Fp8Scaling::Rowwise, Fp8Format::E4m3),
        recipe(Fp8Scaling::Rowwise, Fp8Format::E5m2),
        recipe(Fp8Scaling::Blockwise { block: 128 }, Fp8Format::E4m3),
        // Two of the kernel's steps along K a factor.
        recipe(Fp8Scaling::Blockwise { block: 256 }, Fp8Format::E4m3),
    ]
}

/// A forward GEMM of `in_dim` into `out_dim` columns without bias, residual or activation.
fn plain_matmul(in_dim: u64, out_dim: u64, fp8: Option<Fp8Gemm>) -> Op {
    Op::Matmul {
        in_dim,
        out_dim,
        bias: false,
        act: None,
        residual: false,
        swiglu: false,
        fp8,
    }
}

/// A forward GEMM with every epilogue: y = x Wᵀ + b + r, then gelu_tanh.
fn epilogue_matmul(in_dim: u64, out_dim: u64, fp8: Option<Fp8Gemm>) -> Op {
    Op::Matmul {
        in_dim,
        out_dim,
        bias: true,
        act: Some(Act::GeluTanh),
        residual: true,
        swiglu: false,
        fp8,
    }
}

/// Every FP8 GEMM op form under `g` at (rows, in, out), f32 storage.
fn cases(r: &mut Rng, g: Fp8Gemm, (rows, k, m): (usize, usize, usize)) -> Vec<Case> {
    let fp8 = Some(g);
    let (i, o) = (k as u64, m as u64);
    let x = r.vec(rows * k, 1.0);
    let w = r.vec(m * k, 0.1);
    // Gradients are small: the scales must bring them into range.
    let dy = r.vec(rows * m, 1e-3);
    let shape = format!("{g} {rows}x{k}x{m}");
    let mut cases = vec![
        Case::new(
            format!("fp8 matmul {shape}"),
            plain_matmul(i, o, fp8),
            vec![Data::F32(x.clone()), Data::F32(w.clone())],
            vec![r.vec(rows * m, 1.0)],
            FP8_GEMM,
        ),
        Case::new(
            format!("fp8 matmul+bias+residual+gelu_tanh {shape}"),
            epilogue_matmul(i, o, fp8),
            vec![
                Data::F32(x.clone()),
                Data::F32(w.clone()),
                Data::F32(r.vec(m, 1.0)),
                Data::F32(r.vec(rows * m, 1.0)),
            ],
            vec![r.vec(rows * m, 1.0), r.vec(rows * m, 1.0)],
            FP8_GEMM,
        )
        .errors_scaled_by_output(0),
        // A residual alone: the GEMM's C on the GPU (beta 1), added after on the CPU.
        Case::new(
            format!("fp8 matmul+residual {shape}"),
            Op::Matmul {
                in_dim: i,
                out_dim: o,
                bias: false,
                act: None,
                residual: true,
                swiglu: false,
                fp8,
            },
            vec![
                Data::F32(x.clone()),
                Data::F32(w.clone()),
                Data::F32(r.vec(rows * m, 1.0)),
            ],
            vec![r.vec(rows * m, 1.0)],
            FP8_GEMM,
        ),
    ];
    for accumulate in [false, true] {
        cases.push(Case::new(
            format!("fp8 matmul_bwd_data {shape} accumulate={accumulate}"),
            Op::MatmulBwdData {
                in_dim: i,
                out_dim: o,
                accumulate,
                act_grad: None,
                swiglu: false,
                fp8,
            },
            vec![Data::F32(dy.clone()), Data::F32(w.clone())],
            vec![r.vec(rows * k, 1e-3)],
            FP8_GEMM,
        ));
        cases.push(Case::new(
            format!("fp8 matmul_bwd_weight+bias {shape} accumulate={accumulate}"),
            Op::MatmulBwdWeight {
                in_dim: i,
                out_dim: o,
                bias: true,
                accumulate_param_grad: accumulate,
                fp8,
            },
            vec![Data::F32(dy.clone()), Data::F32(x.clone())],
            vec![r.vec(m * k, 1e-2), r.vec(m, 1e-2)],
            FP8_GEMM,
        ));
    }
    cases.push(Case::new(
        format!("fp8 matmul_bwd_data+relu' {shape}"),
        Op::MatmulBwdData {
            in_dim: i,
            out_dim: o,
            accumulate: false,
            act_grad: Some(Act::Relu),
            swiglu: false,
            fp8,
        },
        vec![
            Data::F32(dy.clone()),
            Data::F32(w.clone()),
            Data::F32(r.vec(rows * k, 1.0)),
        ],
        vec![r.vec(rows * k, 1e-3)],
        FP8_GEMM,
    ));
    cases
}

/// Partial tiles and blocks on every axis; a small shape; K below one block.
const SHAPES: [(usize, usize, usize); 3] = [(150, 200, 136), (37, 64, 40), (5, 24, 16)];

/// Every recipe's cases on shape `SHAPES`, on a GPU running kernel variant `variant` (op and
/// name as `PARC_<OP>_KERNEL` takes them).
fn run(test: &str, bf16: bool, variant: (&str, &str)) {
    let Some(mut gpu) = gpu_variant(Precision::Fp32, variant) else {
        return;
    };
    let mut r = Rng::new(test);
    let mut all = Vec::new();
    for g in recipes() {
        for shape in SHAPES {
            let cases = cases(&mut r, g, shape);
            all.extend(
                cases
                    .into_iter()
                    .map(|c| if bf16 { c.stored_bf16(BF16_STORED) } else { c }),
            );
        }
    }
    check_with(test, &all, gpu.as_mut());
}

#[test]
fn fp8_gemms_match_the_cpu_emulation() {
    run("fp8_gemms_match_the_cpu_emulation", false, DEFAULTS);
}

#[test]
fn fp8_gemms_match_the_cpu_emulation_bf16_storage() {
    run(
        "fp8_gemms_match_the_cpu_emulation_bf16_storage",
        true,
        DEFAULTS,
    );
}

/// The default kernels (a variant named as the default changes nothing).
const DEFAULTS: (&str, &str) = ("fp8_amax", "groups");

/// As above with each variant waiting for its measurement: the group amaxes by 8-vectors
/// (`fp8_amax_rows8`, `fp8_amax_cols8`), blockwise folds reading a weight's factor once a tile,
/// and rowwise in 128 × 256 tiles.
#[test]
fn fp8_gemms_with_kernel_variants_match_the_cpu_emulation() {
    let test = "fp8_gemms_with_kernel_variants_match_the_cpu_emulation";
    let variants = [
        ("fp8_amax", "vectors"),
        ("fp8_gemm", "tiles"),
        ("fp8_gemm", "wide"),
    ];
    for variant in variants {
        run(test, false, variant);
        run(test, true, variant);
    }
}

/// A NaN in x makes its row of y NaN on both backends (it is not quantized: FP8 NaN); an
/// infinity makes the row non-finite on the GPU (the emulation keeps inf, the GPU writes NaN).
#[test]
fn non_finite_operands_give_non_finite_products() {
    let Some(mut gpu) = gpu() else { return };
    let (rows, k, m) = (4usize, 32usize, 16usize);
    let mut r = Rng::new("non_finite_operands_give_non_finite_products");
    for g in recipes() {
        let mut x = r.vec(rows * k, 1.0);
        x[k + 3] = f32::NAN;
        let case = Case::new(
            format!("fp8 matmul with a NaN {g}"),
            plain_matmul(k as u64, m as u64, Some(g)),
            vec![Data::F32(x.clone()), Data::F32(r.vec(m * k, 1.0))],
            vec![r.vec(rows * m, 1.0)],
            FP8_GEMM,
        );
        check_with("fp8 NaN", &[case], gpu.as_mut());
        x[k + 3] = f32::INFINITY;
        let op = plain_matmul(k as u64, m as u64, Some(g));
        let ids = [BufferId(0), BufferId(1), BufferId(2)];
        gpu.alloc(ids[0], &[(rows * k) as u64], DType::F32).unwrap();
        gpu.alloc(ids[1], &[(m * k) as u64], DType::F32).unwrap();
        gpu.alloc(ids[2], &[(rows * m) as u64], DType::F32).unwrap();
        gpu.write_f32(ids[0], &x).unwrap();
        gpu.write_f32(ids[1], &r.vec(m * k, 1.0)).unwrap();
        gpu.compute(&op, &ids[..2], &ids[2..], &SCALARS).unwrap();
        let y = gpu.read_f32(ids[2]).unwrap();
        assert!(
            y[m..2 * m].iter().all(|v| !v.is_finite()),
            "{g}: an infinite x left a finite y: {:?}",
            &y[m..2 * m]
        );
        assert!(y[..m].iter().chain(&y[2 * m..]).all(|v| v.is_finite()));
        for id in ids {
            gpu.free(id).unwrap();
        }
    }
}

/// An n × n × n FP8 forward GEMM under `fp8` on `gpu`, its buffers freed after: the error
/// where the backend refuses it.
fn matmul_square(gpu: &mut dyn Backend, fp8: Fp8Gemm, n: u64) -> Result<(), String> {
    let op = plain_matmul(n, n, Some(fp8));
    let ids = [BufferId(0), BufferId(1), BufferId(2)];
    for id in ids {
        gpu.alloc(id, &[n * n], DType::F32).unwrap();
    }
    let result = gpu.compute(&op, &ids[..2], &ids[2..], &SCALARS);
    for id in ids {
        gpu.free(id).unwrap();
    }
    result.map_err(|e| e.to_string())
}

/// The CUDA backend's FP8 kernel scales K in steps of 128: another block is an error naming it.
#[test]
fn blockwise_with_another_block_is_unsupported() {
    let Some(mut gpu) = gpu() else { return };
    let blockwise64 = Fp8Gemm::current(Fp8Scaling::Blockwise { block: 64 }, Fp8Format::E4m3);
    let err = matmul_square(gpu.as_mut(), blockwise64, 64).unwrap_err();
    assert!(
        err.contains("blockwise(64)") && err.contains("128"),
        "unexpected error: {err}"
    );
}

/// Delayed scaling (`ir::fp8`): recording an operand's amax into its history's step slot (below and above
/// the slot's value, and past a NaN and an infinity, which never raise it), rolling a history,
/// and the three GEMMs reading their operands' scale amaxes from their histories (larger
/// than the operands' own amaxes, as after a step whose values were larger, or 0: an empty
/// history), against the CPU backend, exactly (the records and rolls) and within `FP8_GEMM`
/// (the GEMMs; the plain f32 GEMM's `REDUCTION` where a history is empty).
#[test]
fn delayed_scaling_ops_match_the_cpu_emulation() {
    use parc_compiler::ir::fp8::Fp8HistoryAttrs;
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng::new("delayed_scaling_ops_match_the_cpu_emulation");
    let attrs = |rows| Fp8HistoryAttrs {
        history: 4,
        rows,
        cols: 64,
    };
    let mut cases = Vec::new();
    let mut x = r.vec(150 * 64, 1.0);
    for (name, step) in [("below", 0.25), ("above", 1e3)] {
        let mut case = Case::new(
            format!("fp8_amax_record step amax {name} the operand's"),
            Op::Fp8AmaxRecord(attrs(None)),
            vec![
                Data::F32(x.clone()),
                Data::F32(vec![step, 4.0, 3.0, 2.0, 1.0]),
            ],
            vec![vec![0.0; 5]],
            0.0,
        );
        case.aliases = vec![Some(1)];
        cases.push(case);
    }
    x[7] = f32::NAN;
    x[99] = f32::INFINITY;
    let mut case = Case::new(
        "fp8_amax_record past non-finite values",
        Op::Fp8AmaxRecord(attrs(Some(150))),
        vec![Data::F32(x), Data::F32(vec![0.0; 5])],
        vec![vec![0.0; 5]],
        0.0,
    );
    case.aliases = vec![Some(1)];
    cases.push(case);
    let mut case = Case::new(
        "fp8_history_roll",
        Op::Fp8HistoryRoll(Fp8HistoryAttrs {
            history: 4,
            rows: None,
            cols: 0,
        }),
        vec![Data::F32(vec![2.5, 4.0, 3.0, 2.0, 1.0])],
        vec![vec![0.0; 5], vec![0.0]],
        0.0,
    );
    case.aliases = vec![Some(0), None];
    cases.push(case);
    let g = Fp8Gemm {
        scaling: Fp8Scaling::Tensorwise,
        grad: Fp8Format::E5m2,
        split: Default::default(),
        history: Some(4),
        quantized: false,
    };
    // Each GEMM's two scale amaxes follow its operands: 4 (x), 0.5 (W), 5e-3 (dy).
    let (rows, k, m) = (150, 200, 136);
    let (i, o, fp8) = (k as u64, m as u64, Some(g));
    let x = Data::F32(r.vec(rows * k, 1.0));
    let w = Data::F32(r.vec(m * k, 0.1));
    let dy = Data::F32(r.vec(rows * m, 1e-3));
    let amax = |v: f32| Data::F32(vec![v]);
    cases.push(Case::new(
        "delayed fp8 matmul",
        plain_matmul(i, o, fp8),
        vec![x.clone(), w.clone(), amax(4.0), amax(0.5)],
        vec![r.vec(rows * m, 1.0)],
        FP8_GEMM,
    ));
    cases.push(Case::new(
        "delayed fp8 matmul_bwd_data",
        Op::MatmulBwdData {
            in_dim: i,
            out_dim: o,
            accumulate: false,
            act_grad: None,
            swiglu: false,
            fp8,
        },
        vec![dy.clone(), w, amax(5e-3), amax(0.5)],
        vec![r.vec(rows * k, 1e-3)],
        FP8_GEMM,
    ));
    cases.push(Case::new(
        "delayed fp8 matmul_bwd_weight",
        Op::MatmulBwdWeight {
            in_dim: i,
            out_dim: o,
            bias: false,
            accumulate_param_grad: false,
            fp8,
        },
        vec![dy, x.clone(), amax(5e-3), amax(4.0)],
        vec![r.vec(m * k, 1e-2)],
        FP8_GEMM,
    ));
    // An empty history (its scale amax 0, the first step) leaves the whole GEMM unquantized on
    // both backends: the plain f32 product, within the f32 GEMMs' tolerance, which a GEMM that
    // quantized either operand misses by an order of magnitude.
    cases.push(Case::new(
        "delayed fp8 matmul, W's history empty",
        plain_matmul(i, o, fp8),
        vec![x, Data::F32(r.vec(m * k, 0.1)), amax(4.0), amax(0.0)],
        vec![r.vec(rows * m, 1.0)],
        REDUCTION,
    ));
    check_with(
        "delayed_scaling_ops_match_the_cpu_emulation",
        &cases,
        gpu.as_mut(),
    );
}

/// Delayed scaling's records ride on their GEMM's quantize pass (`runtime/src/cuda/
/// fp8_record.rs`): a program of records of x and W, the delayed FP8 forward GEMM, records
/// of dy and x, and the weight-gradient GEMM (whose operands are read along their rows, the
/// transposing quantize kernel), prepared and run in order, leaves each history's step amax
/// at the maximum of what it held and its operand's largest finite |element| (exactly), past a
/// NaN and an infinity in x, the other history values untouched, and all four records taken by
/// the GEMMs. With W's history empty (the forward runs unquantized) its two records are made
/// apart, with the same values.
/// An fp32 CUDA backend prepared for `program` with its memory plan, every buffer allocated
/// (None without a GPU).
#[cfg(feature = "cuda")]
fn planned_gpu(program: &parc_compiler::ir::Program) -> Option<parc_runtime::cuda::CudaBackend> {
    let mut gpu = crate::harness::cuda_backend(parc_compiler::spec::Precision::Fp32)?;
    let plan = parc_compiler::memplan::plan_program(program).unwrap();
    gpu.prepare(program, &plan).unwrap();
    for (i, b) in program.buffers.iter().enumerate() {
        gpu.alloc(BufferId(i as u32), &b.shape, b.dtype).unwrap();
    }
    Some(gpu)
}

/// Every instruction of `program` (all compute) on `gpu`, in order, as the executor runs them.
#[cfg(feature = "cuda")]
fn run_in_order(gpu: &mut parc_runtime::cuda::CudaBackend, program: &parc_compiler::ir::Program) {
    for (i, instr) in program.instrs.iter().enumerate() {
        let c = instr.as_compute().unwrap();
        gpu.begin_instruction(i);
        gpu.compute(c.op, c.inputs, c.outputs, &SCALARS).unwrap();
    }
}

#[cfg(feature = "cuda")]
#[test]
fn records_ride_on_their_gemms_quantize_pass() {
    use parc_compiler::ir::fp8::Fp8HistoryAttrs;
    use parc_compiler::ir::{Buffer, BufferKind, Instr, Program};
    let mut r = Rng::new("records_ride_on_their_gemms_quantize_pass");
    let (rows, k, m) = (150u64, 200u64, 136u64);
    let g = Fp8Gemm {
        scaling: Fp8Scaling::Tensorwise,
        grad: Fp8Format::E5m2,
        split: Default::default(),
        history: Some(4),
        quantized: false,
    };
    let buffer = |name: &str, shape: Vec<u64>, kind| Buffer {
        name: name.into(),
        shape,
        dtype: DType::F32,
        kind,
    };
    let (param, history) = (BufferKind::Param, BufferKind::Fp8History);
    let buffers = vec![
        buffer("x", vec![rows, k], param),
        buffer("w", vec![m, k], param),
        buffer("dy", vec![rows, m], param),
        buffer("y", vec![rows, m], param),
        buffer("dw", vec![m, k], param),
        buffer("x.amax", vec![1], history),
        buffer("w.amax", vec![1], history),
        buffer("dy.amax", vec![1], history),
        buffer("x.fwd.history", vec![1, 5], history),
        buffer("w.history", vec![1, 5], history),
        buffer("dy.history", vec![1, 5], history),
        buffer("x.bwd_weight.history", vec![1, 5], history),
    ];
    let record = |rows: Option<u64>, cols: u64| {
        Op::Fp8AmaxRecord(Fp8HistoryAttrs {
            history: 4,
            rows,
            cols,
        })
    };
    let program = Program::new(
        "records",
        buffers.clone(),
        vec![
            Instr::compute(record(None, k), &[0, 8], &[8]),
            Instr::compute(record(Some(m), k), &[1, 9], &[9]),
            Instr::compute(plain_matmul(k, m, Some(g)), &[0, 1, 5, 6], &[3]),
            Instr::compute(record(None, m), &[2, 10], &[10]),
            Instr::compute(record(None, k), &[0, 11], &[11]),
            Instr::compute(
                Op::MatmulBwdWeight {
                    in_dim: k,
                    out_dim: m,
                    bias: false,
                    accumulate_param_grad: false,
                    fp8: Some(g),
                },
                &[2, 0, 7, 5],
                &[4],
            ),
        ],
    );
    let mut x = r.vec((rows * k) as usize, 1.0);
    x[7] = f32::NAN;
    x[99] = f32::INFINITY;
    let (w, dy) = (
        r.vec((m * k) as usize, 0.1),
        r.vec((rows * m) as usize, 1e-3),
    );
    let largest =
        |v: &[f32]| (v.iter().filter(|v| v.is_finite())).fold(0.0f32, |a, v| a.max(v.abs()));
    // Each history's step amax before: below its operand's (x, dy, x) or above it (W).
    let steps = [0.25f32, 1e3, 0.0, 0.0];
    let expected = [largest(&x), 1e3, largest(&dy), largest(&x)];
    for w_amax in [0.5f32, 0.0] {
        let Some(mut gpu) = planned_gpu(&program) else {
            return;
        };
        let data: [&[f32]; 3] = [&x, &w, &dy];
        for (i, d) in data.into_iter().enumerate() {
            gpu.write_f32(BufferId(i as u32), d).unwrap();
        }
        for (i, a) in [4.0f32, w_amax, 5e-3].into_iter().enumerate() {
            gpu.write_f32(BufferId(5 + i as u32), &[a]).unwrap();
        }
        for (i, s) in steps.into_iter().enumerate() {
            gpu.write_f32(BufferId(8 + i as u32), &[s, 4.0, 3.0, 2.0, 1.0])
                .unwrap();
        }
        run_in_order(&mut gpu, &program);
        for (i, want) in expected.into_iter().enumerate() {
            let got = gpu.read_f32(BufferId(8 + i as u32)).unwrap();
            assert_eq!(
                got,
                [want, 4.0, 3.0, 2.0, 1.0],
                "history {i}, W's scale amax {w_amax}"
            );
        }
        let taken = gpu.fp8_records_in_quantize();
        assert_eq!(
            taken,
            if w_amax > 0.0 { 4 } else { 2 },
            "W's scale amax {w_amax}"
        );
    }
}

/// A run of consecutive history rolls is made in one launch (`cuda/fp8_roll.rs`) with the results
/// of rolling one by one, and a roll outside any run still rolls alone; over two steps, so the
/// second finds its run's host slots in place.
#[cfg(feature = "cuda")]
#[test]
fn a_run_of_rolls_is_one_launch_with_the_same_results() {
    use parc_compiler::ir::fp8::Fp8HistoryAttrs;
    use parc_compiler::ir::{Buffer, BufferKind, Instr, Program};
    // Histories 0..4 (lengths 5, 9, 5, 5), scale amaxes 4..8, a scratch buffer 8.
    let lens = [5u64, 9, 5, 5];
    let mut buffers: Vec<Buffer> = (lens.iter().enumerate())
        .map(|(i, &len)| Buffer {
            name: format!("h{i}"),
            shape: vec![1, len],
            dtype: DType::F32,
            kind: BufferKind::Fp8History,
        })
        .collect();
    buffers.extend((0..4).map(|i| Buffer {
        name: format!("a{i}"),
        shape: vec![1],
        dtype: DType::F32,
        kind: BufferKind::Fp8History,
    }));
    buffers.push(Buffer {
        name: "scratch".into(),
        shape: vec![1, 5],
        dtype: DType::F32,
        kind: BufferKind::Param,
    });
    let roll = |h: u32, len: u64| {
        let attrs = Fp8HistoryAttrs {
            history: (len - 1) as u32,
            rows: None,
            cols: 0,
        };
        Instr::compute(Op::Fp8HistoryRoll(attrs), &[h], &[h, h + 4])
    };
    let instrs = vec![
        roll(0, 5),
        roll(1, 9),
        roll(2, 5),
        Instr::compute(Op::Copy, &[2], &[8]),
        roll(3, 5),
    ];
    let program = Program::new("rolls", buffers, instrs);
    let Some(mut gpu) = planned_gpu(&program) else {
        return;
    };
    // What rolling one by one gives: history[k + 1] = history[k], history[0] = 0, the scale
    // amax the rolled history's largest value.
    let mut histories: Vec<Vec<f32>> = (lens.iter().enumerate())
        .map(|(i, &len)| {
            (0..len)
                .map(|k| (i as f32 + 1.0) * (k as f32 * 0.37).sin().abs())
                .collect()
        })
        .collect();
    for (i, h) in histories.iter().enumerate() {
        gpu.write_f32(BufferId(i as u32), h).unwrap();
    }
    for step in 0..2 {
        run_in_order(&mut gpu, &program);
        for (i, h) in histories.iter_mut().enumerate() {
            h.rotate_right(1);
            h[0] = 0.0;
            let amax = h.iter().fold(0.0f32, |a, &v| a.max(v));
            assert_eq!(
                gpu.read_f32(BufferId(i as u32)).unwrap(),
                *h,
                "step {step}, history {i}"
            );
            assert_eq!(
                gpu.read_f32(BufferId(4 + i as u32)).unwrap(),
                [amax],
                "step {step}, amax {i}"
            );
        }
        // The run of three rolls in one launch each step; the fourth alone.
        assert_eq!(gpu.fp8_rolls_in_runs(), 3 * (step + 1), "step {step}");
        // The run's launch wrote its members' tensorwise factors 1/s beside them; a roll made
        // alone wrote none.
        for (i, h) in histories.iter().enumerate() {
            let amax = h.iter().fold(0.0f32, |a, &v| a.max(v));
            let factors = gpu.fp8_rolled_factors(BufferId(4 + i as u32)).unwrap();
            let want = [Fp8Format::E4m3, Fp8Format::E5m2].map(|f| 1.0 / tensorwise_scale(amax, f));
            assert_eq!(factors, (i < 3).then_some(want), "step {step}, amax {i}");
        }
    }
    // A scale amax written since its roll (here from the host) has no rolled factors.
    gpu.write_f32(BufferId(4), &[1.0]).unwrap();
    assert_eq!(gpu.fp8_rolled_factors(BufferId(4)).unwrap(), None);
    assert!(gpu.fp8_rolled_factors(BufferId(5)).unwrap().is_some());
}

/// The scale of `amax` as `runtime/src/cpu/fp8.rs` computes it (docs/fp8.md): the power of two
/// 2^⌊log₂(max / amax)⌋ read from the quotient's exponent bits, 1 for amax 0. The CPU's own
/// scale is checked through `dual::cpu_dequantized`.
#[cfg(feature = "cuda")]
fn tensorwise_scale(amax: f32, format: Fp8Format) -> f32 {
    if amax.is_nan() || amax <= 0.0 {
        return 1.0;
    }
    let ratio = format.max() / amax;
    if ratio == 0.0 {
        return f32::from_bits(1 << 23);
    }
    f32::from_bits(((ratio.to_bits() >> 23) & 0xff).clamp(1, 254) << 23)
}

/// Operands quantized once (`runtime/src/cuda/fp8_quantize.rs`): `fp8_quantize_dual`, the pass
/// of `Op::Fp8Quantize`, a tensor quantized with one tensorwise scale into `q` (`[rows, cols]`)
/// and `qt` (`[cols, rows]`) in one read; the op; the `quantized` GEMMs reading its outputs; and
/// a program whose GEMMs share their operands' quantizations (`lower::fp8_quantize`).
#[cfg(feature = "cuda")]
mod dual {
    use super::{epilogue_matmul, tensorwise_scale as scale, FP8_GEMM};
    use crate::harness::{check_with, cuda_backend, Case, Data, Rng, REDUCTION};
    use float8::{F8E4M3, F8E5M2};
    use parc_compiler::ir::fp8::{Fp8Format, Fp8Gemm, Fp8Scaling};
    use parc_compiler::ir::op::Op;
    use parc_compiler::ir::{BufferId, DType};
    use parc_compiler::spec::Precision;
    use parc_runtime::backend::{Backend, StepScalars};
    use parc_runtime::cpu::CpuBackend;
    use parc_runtime::cuda::CudaBackend;

    const X: BufferId = BufferId(0);
    const AMAX: BufferId = BufferId(1);
    const Q: BufferId = BufferId(2);
    const QT: BufferId = BufferId(3);
    const RECORD: BufferId = BufferId(4);
    /// What an output holds before the pass: a layout not asked for must still hold it.
    const UNTOUCHED: u8 = 0xa5;
    const SCALARS: StepScalars = StepScalars {
        lr: 0.0,
        step: 1,
        loss_scale: None,
    };

    /// The FP8 byte of `v` scaled by `s`: the float8 crate's conversion (the CPU emulation's:
    /// nearest-even, saturating) of a finite value; NaN (0x7f) for a non-finite one, as
    /// `Op::Fp8Quantize` stores it.
    fn fp8_byte(v: f32, s: f32, format: Fp8Format) -> u8 {
        if !v.is_finite() {
            return 0x7f;
        }
        match format {
            Fp8Format::E4m3 => F8E4M3::from_f32(v * s).to_bits(),
            Fp8Format::E5m2 => F8E5M2::from_f32(v * s).to_bits(),
        }
    }

    /// The f32 value of FP8 byte `b`.
    fn fp8_value(b: u8, format: Fp8Format) -> f32 {
        match format {
            Fp8Format::E4m3 => F8E4M3::from_bits(b).to_f32(),
            Fp8Format::E5m2 => F8E5M2::from_bits(b).to_f32(),
        }
    }

    /// `x` (`[rows, cols]`, finite) quantized and dequantized by the CPU backend's FP8
    /// emulation with scale amax `amax` (> 0): the data gradient dx = dy · W of a delayed
    /// tensorwise GEMM whose dy (format `format`) is x and whose W is the identity (its FP8
    /// value exactly 1), so dx is the emulation's dq(x) = fp8(x·s)/s, exactly (one nonzero
    /// product per sum).
    fn cpu_dequantized(x: &[f32], cols: usize, amax: f32, format: Fp8Format) -> Vec<f32> {
        let rows = x.len() / cols;
        let fp8 = Fp8Gemm {
            scaling: Fp8Scaling::Tensorwise,
            grad: format,
            split: Default::default(),
            history: Some(1),
            quantized: false,
        };
        let op = Op::MatmulBwdData {
            in_dim: cols as u64,
            out_dim: cols as u64,
            accumulate: false,
            act_grad: None,
            swiglu: false,
            fp8: Some(fp8),
        };
        let identity: Vec<f32> = (0..cols * cols)
            .map(|i| if i % (cols + 1) == 0 { 1.0 } else { 0.0 })
            .collect();
        let mut cpu = CpuBackend::new();
        let shapes = [rows * cols, cols * cols, 1, 1, rows * cols];
        for (i, len) in shapes.into_iter().enumerate() {
            cpu.alloc(BufferId(i as u32), &[len as u64], DType::F32)
                .unwrap();
        }
        let data: [&[f32]; 4] = [x, &identity, &[amax], &[1.0]];
        for (i, d) in data.into_iter().enumerate() {
            cpu.write_f32(BufferId(i as u32), d).unwrap();
        }
        let ids = [BufferId(0), BufferId(1), BufferId(2), BufferId(3)];
        cpu.compute(&op, &ids, &[BufferId(4)], &SCALARS).unwrap();
        cpu.read_f32(BufferId(4)).unwrap()
    }

    /// `n` values over many binades (2^-24 to 16, so some round to FP8 subnormals or zero),
    /// with exact FP8 ties, signed zeros, the largest finite magnitude at a random place, and,
    /// with `non_finite`, a NaN and both infinities.
    fn values(r: &mut Rng, n: usize, non_finite: bool) -> Vec<f32> {
        let exponents = r.positive(n, -24.0, 4.0);
        let mut v: Vec<f32> = (r.vec(n, 1.0).iter().zip(exponents))
            .map(|(u, e)| u * e.exp2())
            .collect();
        let mut specials = vec![1.0625f32, -1.1875, 0.0, -0.0, 3.0 * 2f32.powi(-10), 20.0];
        if non_finite {
            specials.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
        }
        let step = (n / specials.len()).max(1);
        for (i, s) in specials.into_iter().enumerate() {
            if let Some(slot) = v.get_mut((i * step + 3 * i) % n) {
                *slot = s;
            }
        }
        v
    }

    /// The largest finite magnitude of `v`.
    fn largest(v: &[f32]) -> f32 {
        (v.iter().filter(|v| v.is_finite())).fold(0.0f32, |a, v| a.max(v.abs()))
    }

    /// One pass on `gpu`: x (stored as `dtype`) quantized with scale amax `amax` into the
    /// layouts `[q, qt]` asks for, recording into a record that held `record_before`. Returns
    /// x as stored, q's and qt's bytes and the record after.
    fn run_pass(
        gpu: &mut CudaBackend,
        (x, rows, cols, dtype): (&[f32], usize, usize, DType),
        (amax, format): (f32, Fp8Format),
        layouts: [bool; 2],
        record_before: f32,
    ) -> (Vec<f32>, Vec<u8>, Vec<u8>, f32) {
        let n = rows * cols;
        gpu.alloc(X, &[n as u64], dtype).unwrap();
        gpu.alloc(AMAX, &[1], DType::F32).unwrap();
        gpu.alloc(RECORD, &[1], DType::F32).unwrap();
        gpu.write_f32(X, x).unwrap();
        gpu.write_f32(AMAX, &[amax]).unwrap();
        gpu.write_f32(RECORD, &[record_before]).unwrap();
        // UNTOUCHED's FP8 value (finite in both formats), which writing rounds to it.
        let untouched = fp8_value(UNTOUCHED, format);
        for id in [Q, QT] {
            gpu.alloc(id, &[n as u64], DType::Fp8(format)).unwrap();
            gpu.write_f32(id, &vec![untouched; n]).unwrap();
        }
        let [q, qt] = layouts;
        let outputs = [q.then_some(Q), qt.then_some(QT)];
        gpu.fp8_quantize_dual((X, cols as u64), (AMAX, format), outputs, Some(RECORD))
            .unwrap();
        let stored = gpu.read_f32(X).unwrap();
        let (q_bytes, qt_bytes) = (gpu.read_bytes(Q).unwrap(), gpu.read_bytes(QT).unwrap());
        let record = gpu.read_f32(RECORD).unwrap()[0];
        for id in [X, AMAX, Q, QT, RECORD] {
            gpu.free(id).unwrap();
        }
        (stored, q_bytes, qt_bytes, record)
    }

    /// Checks one pass's outputs against the CPU emulation; `what` names the case.
    fn check_pass(
        what: &str,
        (x, rows, cols): (&[f32], usize, usize),
        (amax, format): (f32, Fp8Format),
        (q, qt): (Option<&[u8]>, Option<&[u8]>),
    ) {
        let s = scale(amax, format);
        let want: Vec<u8> = x.iter().map(|&v| fp8_byte(v, s, format)).collect();
        if let Some(q) = q {
            for (i, (&got, &w)) in q.iter().zip(&want).enumerate() {
                assert_eq!(
                    got,
                    w,
                    "{what}: q[{}, {}] of x = {:e} (scale {s:e}): {got:#04x}, want {w:#04x}",
                    i / cols,
                    i % cols,
                    x[i]
                );
            }
        }
        if let Some(qt) = qt {
            for (j, &got) in qt.iter().enumerate() {
                let (c, r) = (j / rows, j % rows);
                let w = want[r * cols + c];
                assert_eq!(
                    got,
                    w,
                    "{what}: qt[{c}, {r}] of x = {:e} (scale {s:e}): {got:#04x}, want {w:#04x}",
                    x[r * cols + c]
                );
            }
        }
        // The CPU emulation's own dq(x) (its scale and rounding), at x's finite elements, from
        // q (or qt where q was not written).
        let Some((bytes, row_major)) = q.map(|b| (b, true)).or(qt.map(|b| (b, false))) else {
            return;
        };
        if amax > 0.0 {
            let finite: Vec<f32> = (x.iter())
                .map(|&v| if v.is_finite() { v } else { 0.0 })
                .collect();
            let cpu = cpu_dequantized(&finite, cols, amax, format);
            for (i, &v) in x.iter().enumerate().filter(|(_, v)| v.is_finite()) {
                let at = if row_major {
                    i
                } else {
                    (i % cols) * rows + i / cols
                };
                let got = fp8_value(bytes[at], format) / s;
                assert!(
                    got == cpu[i],
                    "{what}: x[{i}] = {v:e} dequantizes to {got:e}, the CPU's to {:e}",
                    cpu[i]
                );
            }
        }
    }

    /// Both formats, f32 and bf16 storage, each layout alone and both, at shapes with partial
    /// tiles and rows or columns not a multiple of 8 (the one-byte paths) beside whole ones
    /// (the vector paths), scale amaxes at the operand's largest value, below it (saturation, as
    /// a delayed scale after smaller steps) and 0 (scale 1): every byte equals the CPU
    /// emulation's conversion, a non-finite element is written as NaN (0x7f),
    /// the layouts not asked for are untouched, and the record becomes the maximum of what it
    /// held and x's largest finite magnitude, exactly.
    #[test]
    fn quantize_dual_matches_the_cpu_emulation_bit_for_bit() {
        let Some(mut gpu) = cuda_backend(Precision::Fp32) else {
            return;
        };
        let mut r = Rng::new("quantize_dual_matches_the_cpu_emulation_bit_for_bit");
        let shapes = [
            (1, 1),
            (5, 24),
            (37, 200),
            (64, 128),
            (65, 129),
            (150, 136),
            (16, 1040),
            (200, 8),
            (272, 24),
        ];
        for (rows, cols) in shapes {
            for dtype in [DType::F32, DType::Bf16] {
                for format in [Fp8Format::E4m3, Fp8Format::E5m2] {
                    for layouts in [[true, true], [true, false], [false, true]] {
                        let x = values(&mut r, rows * cols, true);
                        let top = largest(&x);
                        for (amax, record_before) in [(top, 0.25), (top / 37.0, 1e3), (0.0, 0.0)] {
                            let (stored, q, qt, record) = run_pass(
                                &mut gpu,
                                (&x, rows, cols, dtype),
                                (amax, format),
                                layouts,
                                record_before,
                            );
                            let what = format!(
                                "[{rows}, {cols}] {dtype:?} {format:?} layouts {layouts:?} amax {amax:e}"
                            );
                            let [want_q, want_qt] = layouts;
                            check_pass(
                                &what,
                                (&stored, rows, cols),
                                (amax, format),
                                (want_q.then_some(&q[..]), want_qt.then_some(&qt[..])),
                            );
                            for (asked, bytes, name) in [(want_q, &q, "q"), (want_qt, &qt, "qt")] {
                                assert!(
                                    asked || bytes.iter().all(|&b| b == UNTOUCHED),
                                    "{what}: {name} was written"
                                );
                            }
                            let want = record_before.max(largest(&stored));
                            assert_eq!(record, want, "{what}: the record");
                        }
                    }
                }
            }
        }
    }

    /// `v` (`[rows, cols]`) transposed.
    fn transpose(v: &[f32], cols: usize) -> Vec<f32> {
        let rows = v.len() / cols;
        (0..v.len())
            .map(|j| v[(j % rows) * cols + j / rows])
            .collect()
    }

    /// `v` scaled by the scale of `amax` in `format`: written to an FP8 buffer, each backend
    /// rounds it to fp8(v·s), what `Op::Fp8Quantize` stores.
    fn scaled(v: &[f32], amax: f32, format: Fp8Format) -> Vec<f32> {
        let s = scale(amax, format);
        v.iter().map(|v| v * s).collect()
    }

    /// `Op::Fp8Quantize` against the CPU backend, exactly (FP8 outputs read widened to their
    /// f32 values; NaN where x is not finite): a weight (fixed rows) and token operands, each
    /// layout alone and both, f32 and bf16 x, both formats, at shapes the lowering emits
    /// (multiples of 16) and odd ones, and scale amaxes at x's largest value, below it and 0.
    #[test]
    fn the_quantize_op_matches_the_cpu() {
        use parc_compiler::ir::fp8::Fp8QuantizeAttrs;
        let Some(mut gpu) = cuda_backend(Precision::Fp32) else {
            return;
        };
        let mut r = Rng::new("the_quantize_op_matches_the_cpu");
        let mut cases = Vec::new();
        for (rows, cols, weight) in [(160, 208, true), (48, 16, false), (37, 200, false)] {
            for format in [Fp8Format::E4m3, Fp8Format::E5m2] {
                for (direct, transposed) in [(true, true), (true, false), (false, true)] {
                    let x = values(&mut r, rows * cols, true);
                    let top = largest(&x);
                    for amax in [top, top / 37.0, 0.0] {
                        let attrs = Fp8QuantizeAttrs {
                            format,
                            rows: weight.then_some(rows as u64),
                            cols: cols as u64,
                            direct,
                            transposed,
                        };
                        let outputs: Vec<Vec<f32>> = [direct, transposed]
                            .iter()
                            .filter(|on| **on)
                            .map(|_| vec![0.0; rows * cols])
                            .collect();
                        let fp8 = vec![DType::Fp8(format); outputs.len()];
                        for x_dtype in [DType::F32, DType::Bf16] {
                            let case = Case::new(
                                format!("fp8_quantize [{rows}, {cols}] {attrs:?} amax {amax:e}"),
                                Op::Fp8Quantize(attrs),
                                vec![Data::F32(x.clone()), Data::F32(vec![amax])],
                                outputs.clone(),
                                0.0,
                            );
                            cases.push(case.with_dtypes(&[x_dtype, DType::F32], &fp8, 0.0));
                        }
                    }
                }
            }
        }
        check_with("the_quantize_op_matches_the_cpu", &cases, &mut gpu);
    }

    /// The three FP8 GEMMs `quantized` (`Fp8Gemm::quantized`: their operands read from FP8
    /// inputs, K-major with no padding, as `Op::Fp8Quantize` writes them: here written from the
    /// host as v·s, which both backends round to the same bytes) against the CPU backend,
    /// within `FP8_GEMM`: current scaling (the amaxes the operands' own) and delayed (scale
    /// amaxes above them), with a bias, residual and activation on the forward and a bias
    /// gradient on the weight gradient; and a delayed GEMM whose W history is empty (scale
    /// amax 0), which runs as the plain f32 GEMM on its unquantized inputs (`REDUCTION`).
    #[test]
    fn quantized_gemms_match_the_cpu_emulation() {
        let Some(mut gpu) = cuda_backend(Precision::Fp32) else {
            return;
        };
        let mut r = Rng::new("quantized_gemms_match_the_cpu_emulation");
        let (rows, k, m) = (160usize, 208usize, 144usize);
        let (i, o) = (k as u64, m as u64);
        let x = r.vec(rows * k, 1.0);
        let w = r.vec(m * k, 0.1);
        let dy = r.vec(rows * m, 1e-3);
        let (e4m3, grad) = (Fp8Format::E4m3, Fp8Format::E5m2);
        let f32s = |n: usize| vec![DType::F32; n];
        let mut cases = Vec::new();
        for history in [None, Some(4)] {
            let fp8 = Some(Fp8Gemm {
                scaling: Fp8Scaling::Tensorwise,
                grad,
                split: Default::default(),
                history,
                quantized: true,
            });
            let [xa, wa, dya] = match history {
                None => [largest(&x), largest(&w), largest(&dy)],
                Some(_) => [4.0, 0.5, 5e-3],
            };
            let (xq, wq) = (scaled(&x, xa, e4m3), scaled(&w, wa, e4m3));
            let dyq = scaled(&dy, dya, grad);
            let d = |v: &[f32]| Data::F32(v.to_vec());
            let a = |v: f32| Data::F32(vec![v]);
            let forward = epilogue_matmul(i, o, fp8);
            let fwd_in = vec![
                d(&x),
                d(&w),
                Data::F32(r.vec(m, 1.0)),
                Data::F32(r.vec(rows * m, 1.0)),
                a(xa),
                a(wa),
                d(&xq),
                d(&wq),
            ];
            let fwd_types = [f32s(6), vec![DType::Fp8(e4m3); 2]].concat();
            let name = format!("quantized fp8 matmul+bias+residual+gelu_tanh {history:?}");
            let outputs = vec![r.vec(rows * m, 1.0), r.vec(rows * m, 1.0)];
            cases.push(
                Case::new(name, forward, fwd_in, outputs, FP8_GEMM)
                    .errors_scaled_by_output(0)
                    .with_dtypes(&fwd_types, &f32s(2), FP8_GEMM),
            );
            let data_grad = Op::MatmulBwdData {
                in_dim: i,
                out_dim: o,
                accumulate: false,
                act_grad: None,
                swiglu: false,
                fp8,
            };
            let wqt = transpose(&wq, k);
            let bwd_in = vec![d(&dy), d(&w), a(dya), a(wa), d(&dyq), d(&wqt)];
            let bwd_types = [f32s(4), vec![DType::Fp8(grad), DType::Fp8(e4m3)]].concat();
            let name = format!("quantized fp8 matmul_bwd_data {history:?}");
            cases.push(
                Case::new(
                    name,
                    data_grad,
                    bwd_in,
                    vec![r.vec(rows * k, 1e-3)],
                    FP8_GEMM,
                )
                .with_dtypes(&bwd_types, &f32s(1), FP8_GEMM),
            );
            let weight_grad = Op::MatmulBwdWeight {
                in_dim: i,
                out_dim: o,
                bias: true,
                accumulate_param_grad: true,
                fp8,
            };
            let (dyqt, xqt) = (transpose(&dyq, m), transpose(&xq, k));
            let wgt_in = vec![d(&dy), d(&x), a(dya), a(xa), d(&dyqt), d(&xqt)];
            let name = format!("quantized fp8 matmul_bwd_weight+bias {history:?}");
            let outputs = vec![r.vec(m * k, 1e-2), r.vec(m, 1e-2)];
            cases.push(
                Case::new(name, weight_grad, wgt_in, outputs, FP8_GEMM).with_dtypes(
                    &bwd_types,
                    &f32s(2),
                    FP8_GEMM,
                ),
            );
        }
        // Delayed, W's history empty: the plain GEMM on x and W.
        let cold = Op::Matmul {
            in_dim: i,
            out_dim: o,
            bias: false,
            act: None,
            residual: false,
            swiglu: false,
            fp8: Some(Fp8Gemm {
                scaling: Fp8Scaling::Tensorwise,
                grad,
                split: Default::default(),
                history: Some(4),
                quantized: true,
            }),
        };
        let inputs = vec![
            Data::F32(x.clone()),
            Data::F32(w.clone()),
            Data::F32(vec![4.0]),
            Data::F32(vec![0.0]),
            Data::F32(scaled(&x, 4.0, e4m3)),
            Data::F32(w.clone()),
        ];
        let types = [f32s(4), vec![DType::Fp8(e4m3); 2]].concat();
        cases.push(
            Case::new(
                "quantized fp8 matmul, W's history empty",
                cold,
                inputs,
                vec![r.vec(rows * m, 1.0)],
                REDUCTION,
            )
            .with_dtypes(&types, &f32s(1), REDUCTION),
        );
        check_with("quantized_gemms_match_the_cpu_emulation", &cases, &mut gpu);
    }

    /// Buffers 0 x `[rows, k]`, 1 W `[m, k]`, 2 dy `[rows, m]`, 3 y, 4 dx, 5 dW; under
    /// delayed scaling (`history`) 6–8 the scale amaxes of x, W and dy and 9–11 their
    /// histories (`[1, 5]`). A forward, data gradient and weight gradient, FP8 tensorwise (E5M2
    /// dy), with delayed scaling's records of x, W and dy before the GEMMs that first read them;
    /// then `lower::fp8_quantize`'s pass, which quantizes x, W and dy once each into both
    /// layouts (x: q for the forward, qt for the weight gradient; W: q, and qt for the data
    /// gradient; dy: q for the data gradient, qt for the weight gradient), the records riding
    /// on the quantize ops.
    fn shared_program(
        history: Option<u32>,
        (rows, k, m): (u64, u64, u64),
    ) -> parc_compiler::ir::Program {
        use parc_compiler::ir::fp8::Fp8HistoryAttrs;
        use parc_compiler::ir::{Buffer, BufferKind, Instr, Program};
        use parc_compiler::lower::fp8_quantize::quantize_operands;
        let buffer = |name: &str, shape: Vec<u64>, kind| Buffer {
            name: name.into(),
            shape,
            dtype: DType::F32,
            kind,
        };
        let (param, hist) = (BufferKind::Param, BufferKind::Fp8History);
        let mut buffers = vec![
            buffer("x", vec![rows, k], param),
            buffer("w", vec![m, k], param),
            buffer("dy", vec![rows, m], param),
            buffer("y", vec![rows, m], param),
            buffer("dx", vec![rows, k], param),
            buffer("dw", vec![m, k], param),
        ];
        let fp8 = Some(Fp8Gemm {
            scaling: Fp8Scaling::Tensorwise,
            grad: Fp8Format::E5m2,
            split: Default::default(),
            history,
            quantized: false,
        });
        let gemms = [
            Op::Matmul {
                in_dim: k,
                out_dim: m,
                bias: false,
                act: None,
                residual: false,
                swiglu: false,
                fp8,
            },
            Op::MatmulBwdData {
                in_dim: k,
                out_dim: m,
                accumulate: false,
                act_grad: None,
                swiglu: false,
                fp8,
            },
            Op::MatmulBwdWeight {
                in_dim: k,
                out_dim: m,
                bias: false,
                accumulate_param_grad: false,
                fp8,
            },
        ];
        let [fwd, data, weight] = gemms;
        let instrs = match history {
            None => vec![
                Instr::compute(fwd, &[0, 1], &[3]),
                Instr::compute(data, &[2, 1], &[4]),
                Instr::compute(weight, &[2, 0], &[5]),
            ],
            Some(h) => {
                for name in ["x", "w", "dy"] {
                    buffers.push(buffer(&format!("{name}.amax"), vec![1], hist));
                }
                for name in ["x", "w", "dy"] {
                    let shape = vec![1, u64::from(h) + 1];
                    buffers.push(buffer(&format!("{name}.history"), shape, hist));
                }
                let record = |rows: Option<u64>, cols: u64| {
                    Op::Fp8AmaxRecord(Fp8HistoryAttrs {
                        history: h,
                        rows,
                        cols,
                    })
                };
                vec![
                    Instr::compute(record(None, k), &[0, 9], &[9]),
                    Instr::compute(record(Some(m), k), &[1, 10], &[10]),
                    Instr::compute(fwd, &[0, 1, 6, 7], &[3]),
                    Instr::compute(record(None, m), &[2, 11], &[11]),
                    Instr::compute(data, &[2, 1, 8, 7], &[4]),
                    Instr::compute(weight, &[2, 0, 8, 6], &[5]),
                ]
            }
        };
        let mut program = Program::new("shared", buffers, instrs);
        let summary = quantize_operands(&mut program);
        assert_eq!((summary.gemms, summary.quantizes), (3, 3), "{history:?}");
        program
    }

    /// Allocates `program`'s buffers that no `Alloc` of it allocates (its parameters, outputs
    /// and histories) on `be`.
    fn allocate_persistent(be: &mut dyn Backend, program: &parc_compiler::ir::Program) {
        use parc_compiler::ir::Instr;
        let transient: Vec<BufferId> = (program.instrs.iter())
            .filter_map(|i| match i {
                Instr::Alloc { buffer } => Some(*buffer),
                _ => None,
            })
            .collect();
        for (i, b) in program.buffers.iter().enumerate() {
            let id = BufferId(i as u32);
            if !transient.contains(&id) {
                be.alloc(id, &b.shape, b.dtype).unwrap();
            }
        }
    }

    /// Every instruction of `program` on `be`, in order, as the executor runs them.
    fn run_program(be: &mut dyn Backend, program: &parc_compiler::ir::Program) {
        use parc_compiler::ir::Instr;
        for (i, instr) in program.instrs.iter().enumerate() {
            match instr {
                Instr::Alloc { buffer } => {
                    let b = &program.buffers[buffer.0 as usize];
                    be.alloc(*buffer, &b.shape, b.dtype).unwrap();
                }
                Instr::Free { buffer } => be.free(*buffer).unwrap(),
                _ => {
                    let c = instr.as_compute().unwrap();
                    be.begin_instruction(i);
                    be.compute(c.op, c.inputs, c.outputs, &super::SCALARS)
                        .unwrap();
                }
            }
        }
    }

    /// `got` within `tol` of `want` as the op tests judge it: `|got − want| ≤ tol · (|want| +
    /// rms(want))`.
    fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "{what}");
        let rms = (want.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>()
            / want.len().max(1) as f64)
            .sqrt() as f32;
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let err = (g - w).abs() / (w.abs() + rms);
            assert!(
                err <= tol,
                "{what}[{i}]: cuda {g:e}, cpu {w:e} (error {err:.2e} > {tol:e})"
            );
        }
    }

    /// A program whose three FP8 GEMMs share their operands' quantizations (`shared_program`:
    /// three `Fp8Quantize` ops, each writing both layouts) gives on the GPU, prepared with its
    /// memory plan, what the CPU backend gives for the same program: y, dx and dW within
    /// `FP8_GEMM`, under current scaling (the pass's own `Fp8Amax` for each tensor) and delayed
    /// scaling, whose histories' step amaxes must equal the CPU's exactly, with all three
    /// records taken in the quantize passes. With W's history empty (delayed, its scale amax 0)
    /// the forward and the data gradient run as plain f32 GEMMs on both backends
    /// (`REDUCTION`), the weight gradient still quantized, and the quantize passes still take
    /// the records.
    #[test]
    fn a_program_sharing_quantizations_matches_the_cpu() {
        let (rows, k, m) = (160u64, 208u64, 144u64);
        let mut r = Rng::new("a_program_sharing_quantizations_matches_the_cpu");
        let x = r.vec((rows * k) as usize, 1.0);
        let w = r.vec((m * k) as usize, 0.1);
        let dy = r.vec((rows * m) as usize, 1e-3);
        for (history, w_amax) in [(None, 0.0), (Some(4), 0.5), (Some(4), 0.0)] {
            let program = shared_program(history, (rows, k, m));
            let both = (program.instrs.iter().filter_map(|i| i.op()))
                .filter(|op| matches!(op, Op::Fp8Quantize(a) if a.direct && a.transposed))
                .count();
            assert_eq!(
                both, 3,
                "{history:?}: every quantization writes both layouts"
            );
            let Some(mut gpu) = planned_gpu_for_program(&program) else {
                return;
            };
            let mut cpu = CpuBackend::new();
            allocate_persistent(&mut cpu, &program);
            let steps = [0.25f32, 1e3, 0.0];
            for be in [&mut gpu as &mut dyn Backend, &mut cpu] {
                let data: [&[f32]; 3] = [&x, &w, &dy];
                for (i, d) in data.into_iter().enumerate() {
                    be.write_f32(BufferId(i as u32), d).unwrap();
                }
                if history.is_some() {
                    for (i, a) in [4.0f32, w_amax, 5e-3].into_iter().enumerate() {
                        be.write_f32(BufferId(6 + i as u32), &[a]).unwrap();
                    }
                    for (i, s) in steps.into_iter().enumerate() {
                        let h = [s, 4.0, 3.0, 2.0, 1.0];
                        be.write_f32(BufferId(9 + i as u32), &h).unwrap();
                    }
                }
                run_program(be, &program);
            }
            let what = format!("{history:?}, W's scale amax {w_amax}");
            let cold = history.is_some() && w_amax == 0.0;
            let tols = [
                ("y", if cold { REDUCTION } else { FP8_GEMM }),
                ("dx", if cold { REDUCTION } else { FP8_GEMM }),
                ("dW", FP8_GEMM),
            ];
            for (i, (name, tol)) in tols.into_iter().enumerate() {
                let id = BufferId(3 + i as u32);
                let (got, want) = (gpu.read_f32(id).unwrap(), cpu.read_f32(id).unwrap());
                assert_close(&format!("{what}: {name}"), &got, &want, tol);
            }
            if history.is_some() {
                for i in 0..3 {
                    let id = BufferId(9 + i);
                    let (got, want) = (gpu.read_f32(id).unwrap(), cpu.read_f32(id).unwrap());
                    assert_eq!(got, want, "{what}: history {i}");
                }
                assert_eq!(gpu.fp8_records_in_quantize(), 3, "{what}");
            }
        }
    }

    /// An fp32 CUDA backend prepared for `program` with its memory plan, its persistent
    /// buffers allocated (None without a GPU).
    fn planned_gpu_for_program(program: &parc_compiler::ir::Program) -> Option<CudaBackend> {
        let mut gpu = cuda_backend(Precision::Fp32)?;
        let plan = parc_compiler::memplan::plan_program(program).unwrap();
        gpu.prepare(program, &plan).unwrap();
        allocate_persistent(&mut gpu, program);
        Some(gpu)
    }

    /// Bandwidth of the dual quantization of a 16384 × 8192 tensor (bf16 and f32) into both
    /// layouts, each alone, and both with a record, against a device copy of the same tensor
    /// (`Op::Copy`: what a pass reading x once and writing 2 bytes an element is held to).
    /// Prints one JSON line per point: median milliseconds over REPS runs (CUDA events) and
    /// GB/s of the ideal traffic (x read once, each byte written once).
    #[test]
    #[ignore = "needs a GPU: run on the device machine with --ignored --nocapture"]
    fn quantize_dual_bandwidth() {
        use crate::gpu_support::{median, uniform};
        const REPS: usize = 20;
        let (rows, cols) = (16384usize, 8192usize);
        let n = rows * cols;
        for dtype in [DType::Bf16, DType::F32] {
            let Some(mut gpu) = cuda_backend(Precision::Fp32) else {
                return;
            };
            let copy = BufferId(5);
            gpu.alloc(X, &[n as u64], dtype).unwrap();
            gpu.write_f32(X, &uniform(n, 7, -1.0, 1.0)).unwrap();
            gpu.alloc(copy, &[n as u64], dtype).unwrap();
            for id in [AMAX, RECORD] {
                gpu.alloc(id, &[1], DType::F32).unwrap();
                gpu.write_f32(id, &[1.0]).unwrap();
            }
            for id in [Q, QT] {
                gpu.alloc(id, &[n as u64], DType::Fp8(Fp8Format::E4m3))
                    .unwrap();
            }
            let elem = dtype.bytes() as f64;
            // Each point: its name, the layouts written (q, qt) and whether a record rides.
            let points = [
                ("copy", [false, false], false),
                ("q+qt", [true, true], false),
                ("q", [true, false], false),
                ("qt", [false, true], false),
                ("q+qt+record", [true, true], true),
            ];
            for (name, [q, qt], with_record) in points {
                let outputs = [q.then_some(Q), qt.then_some(QT)];
                let record = with_record.then_some(RECORD);
                let run = |gpu: &mut CudaBackend| {
                    if name == "copy" {
                        gpu.compute(&Op::Copy, &[X], &[copy], &SCALARS).unwrap();
                    } else {
                        let x = (X, cols as u64);
                        let amax = (AMAX, Fp8Format::E4m3);
                        gpu.fp8_quantize_dual(x, amax, outputs, record).unwrap();
                    }
                };
                run(&mut gpu);
                let mut times = Vec::new();
                for _ in 0..REPS {
                    gpu.mark_time().unwrap();
                    run(&mut gpu);
                    gpu.mark_time().unwrap();
                    times.extend(gpu.marked_intervals().unwrap());
                }
                let t = median(times);
                let written = if name == "copy" {
                    elem
                } else {
                    outputs.iter().flatten().count() as f64
                };
                let bytes = n as f64 * (elem + written);
                println!(
                    "{{\"bench\":\"fp8_quantize_dual\",\"dtype\":\"{}\",\"rows\":{rows},\"cols\":{cols},\"point\":\"{name}\",\"ms\":{:.3},\"gbps\":{:.0}}}",
                    dtype.name(),
                    t * 1e3,
                    bytes / t / 1e9
                );
            }
        }
    }
}
