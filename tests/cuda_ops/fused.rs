//! Generated kernels (`Op::Fused`): the CUDA backend's kernels (CUDA C from the NVRTC emitter,
//! or LLVM's under `PARC_CODEGEN=llvm`) against the CPU's reference evaluator, bit for bit
//! (tolerance 0): both compute `kir::prim`'s IEEE arithmetic in the same order, row sums in
//! the `REDUCE_LANES` order, and round bf16 stores the same way. The kernels
//! (`fused_kernels`) use every primitive op, column map and access, row outputs and row sums
//! one and two deep; composite ops (sigmoid, erf, exp, log, tanh, rsqrt, pow, min, max) are
//! expanded by the compiler first. Sizes cover the vectorised paths (64 columns), the scalar
//! ones (42 columns: rope's half-heads of 7 columns break vectors), flat kernels whose
//! `rows · cols` leaves a tail after the 8-element vectors (37 columns), rows wider than the
//! reduction's lanes (1000 columns: a partial last chunk of 256, the row kept in registers
//! between passes; 9000, too wide to keep, so read again) and a grid-strided row count;
//! operands all f32, all bf16,
//! and mixed; and an output that is also an input.
//!
//! A failure names the kernel (`rms/1000 bf16`), the output, and the worst element's CUDA
//! and CPU values; replay with the printed `PARC_TEST_SEED`.
use crate::fused_kernels::{composite, layer, primitive, rms};
use crate::harness::{check, Case, Data, Rng};
use parc_compiler::ir::op::{FusedAttrs, Op};
use parc_compiler::ir::DType;
use parc_compiler::kir::{Access, Kernel};
use std::sync::Arc;

/// Rows of every case: odd, more than one block of rows for the row sums of small kernels.
const ROWS: usize = 333;

#[test]
fn fused_f32() {
    let mut r = Rng::new("fused_f32");
    check("fused_f32", &cases(&mut r, Types::F32));
}

#[test]
fn fused_bf16() {
    let mut r = Rng::new("fused_bf16");
    check("fused_bf16", &cases(&mut r, Types::Bf16));
}

#[test]
fn fused_mixed_f32_and_bf16() {
    let mut r = Rng::new("fused_mixed");
    check("fused_mixed", &cases(&mut r, Types::Mixed));
}

/// The storage of the `Elem` operands (every other operand is f32).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Types {
    F32,
    Bf16,
    /// Even-numbered operands (inputs then outputs) bf16.
    Mixed,
}

fn kernels() -> Vec<(String, Kernel)> {
    let mut all = Vec::new();
    for (cols, hd) in [(64, 16), (42, 14)] {
        for (name, k) in primitive(cols, hd) {
            all.push((format!("{name}/{cols}"), k));
        }
    }
    for cols in [64, 37] {
        for (name, k) in composite(cols) {
            all.push((format!("{name}/{cols}"), k));
        }
    }
    all.push(("rms/1000".into(), rms(1000)));
    all.push(("layer/1000".into(), layer(1000)));
    // Rows too wide to keep in registers between the passes (read again).
    all.push(("rms/9000".into(), rms(9000)));
    all
}

/// Elements of an operand of `access` for `rows` rows.
fn len(k: &Kernel, access: &Access, rows: usize) -> usize {
    match *access {
        Access::Elem { width } => rows * width as usize,
        Access::Row => rows,
        Access::Col => k.cols as usize,
        Access::PerPosition { batch, width } => rows.div_ceil(batch as usize) * width as usize,
    }
}

fn cases(r: &mut Rng, types: Types) -> Vec<Case> {
    let mut cases = Vec::new();
    for (name, k) in kernels() {
        let inputs = (k.inputs.iter())
            .map(|a| Data::F32(r.vec(len(&k, a, ROWS), 2.0)))
            .collect();
        let outputs = (k.outputs.iter())
            .map(|a| r.vec(len(&k, a, ROWS), 1.0))
            .collect();
        let accesses: Vec<Access> = k.inputs.iter().chain(&k.outputs).copied().collect();
        let op = Op::Fused(FusedAttrs {
            name: name.clone(),
            rows: None,
            kernel: Arc::new(k.clone()),
        });
        let dtypes: Vec<DType> = (accesses.iter().enumerate())
            .map(|(i, a)| match (a, types) {
                (Access::Elem { .. }, Types::Bf16) => DType::Bf16,
                (Access::Elem { .. }, Types::Mixed) if i % 2 == 0 => DType::Bf16,
                _ => DType::F32,
            })
            .collect();
        let n_in = k.inputs.len();
        let label = format!("{name} {types:?}");
        let case = Case::new(label, op, inputs, outputs, 0.0);
        cases.push(case.with_dtypes(&dtypes[..n_in], &dtypes[n_in..], 0.0));
    }
    // In place: arith's first output is its first input's buffer (read before it is written).
    let k = crate::fused_kernels::arith(64);
    let n = 64 * ROWS;
    let op = Op::Fused(FusedAttrs {
        name: "arith in place".into(),
        rows: None,
        kernel: Arc::new(k),
    });
    let ins = vec![Data::F32(r.vec(n, 2.0)), Data::F32(r.vec(n, 2.0))];
    let mut case = Case::new(
        "arith in place",
        op,
        ins,
        vec![r.vec(n, 1.0), r.vec(n, 1.0)],
        0.0,
    );
    if types == Types::Bf16 {
        case = case.stored_bf16(0.0);
    }
    case.aliases[0] = Some(0);
    cases.push(case);
    cases
}

/// f32 bit patterns whose bf16 rounding is a special case: zeros, subnormals (ties to even
/// among them, the largest rounding up to the smallest normal), ties at normal values, values
/// that round up to infinity or stay at bf16's largest finite value, infinities.
const NUMBERS: [u32; 20] = [
    0x0000_0000,
    0x8000_0000,
    0x0000_0001,
    0x0000_8000,
    0x0001_8000,
    0x0000_8001,
    0x007f_ffff,
    0x8040_0000,
    0x3f80_8000,
    0x3f81_8000,
    0x3f80_ffff,
    0x3f7f_ffff,
    0xbfc0_0000,
    0x7f7f_ffff,
    0x7f7f_7fff,
    0x7f7f_8000,
    0xff7f_ffff,
    0x7f80_0000,
    0xff80_0000,
    0x4049_0fdb,
];

/// NaNs: quiet and signalling (the rounding sets the quiet bit), with payloads, negative, one
/// whose top 16 bits alone would read as infinity.
const NANS: [u32; 7] = [
    0x7fc0_0000,
    0x7fc1_2345,
    0xffc0_0001,
    0x7f80_0001,
    0x7fa0_0000,
    0xff81_2345,
    0x7fff_ffff,
];

/// `n` values cycling through `NUMBERS`, with every third group of 8 (a bf16 vector) taking
/// `NANS` in turn for some of its elements, so that vectors with and without a NaN both occur;
/// `shift` rotates the cycle (a second input differs from the first).
fn special_values(n: usize, shift: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let j = i + shift;
            let bits = match (j / 8) % 3 == 2 && j.is_multiple_of(3) {
                true => NANS[(j / 3) % NANS.len()],
                false => NUMBERS[j % NUMBERS.len()],
            };
            f32::from_bits(bits)
        })
        .collect()
}

/// `y[+0] = x[+half]; y[+half] = x[+0]` over rows of `2 · half` columns: a row-and-column kernel
/// whose vectors are `half` wide (4: `uint2` stores of bf16; 2: one word).
fn swap_halves(half: u64) -> Kernel {
    let mut g = parc_compiler::kir::Graph::new();
    let (lo, hi) = (g.load(0, 0), g.load(0, half));
    let store = |col_offset, value| parc_compiler::kir::Store {
        output: 0,
        col_offset,
        value,
    };
    Kernel {
        cols: half,
        inputs: vec![Access::Elem { width: 2 * half }],
        outputs: vec![Access::Elem { width: 2 * half }],
        graph: g,
        stores: vec![store(0, hi), store(half, lo)],
    }
}

/// bf16 stores of special f32 values give the CPU's bits through every store a generated kernel
/// has (vectors of 8, 4 and 2, a flat kernel's scalar tail): copies keep every bit, NaN
/// payloads included (the vector stores' fast rounding must leave NaNs to the exact one);
/// SwiGLU's outputs are the same bits where they are numbers and NaN together.
#[test]
fn fused_bf16_stores_of_special_values_are_bit_exact() {
    let Some(mut gpu) = crate::harness::gpu() else {
        return;
    };
    let kernels = [
        ("copy/64", crate::fused_kernels::copy(64), true),
        ("copy/37", crate::fused_kernels::copy(37), true),
        ("swap/4", swap_halves(4), true),
        ("swap/2", swap_halves(2), true),
        ("swiglu/64", crate::fused_kernels::swiglu(64), false),
    ];
    for (name, k, exact_nans) in kernels {
        let inputs: Vec<Data> = (k.inputs.iter().enumerate())
            .map(|(i, a)| Data::F32(special_values(len(&k, a, ROWS), 5 * i)))
            .collect();
        let outputs: Vec<Vec<f32>> = (k.outputs.iter())
            .map(|a| vec![0.0; len(&k, a, ROWS)])
            .collect();
        let op = Op::Fused(FusedAttrs {
            name: name.into(),
            rows: None,
            kernel: Arc::new(k.clone()),
        });
        let ins = vec![DType::F32; k.inputs.len()];
        let outs = vec![DType::Bf16; k.outputs.len()];
        let case = Case::new(name, op, inputs, outputs, 0.0).with_dtypes(&ins, &outs, 0.0);
        let want = case.run(&mut parc_runtime::cpu::CpuBackend::new());
        let got = case.run(gpu.as_mut());
        for i in 0..k.inputs.len() + k.outputs.len() {
            gpu.free(parc_compiler::ir::BufferId(i as u32)).unwrap();
        }
        for (o, (w, g)) in want.iter().zip(&got).enumerate() {
            let differs = |(a, b): (&f32, &f32)| {
                a.to_bits() != b.to_bits() && (exact_nans || !(a.is_nan() && b.is_nan()))
            };
            if let Some((i, (a, b))) = g.iter().zip(w).enumerate().find(|(_, p)| differs(*p)) {
                panic!(
                    "{name}: output {o}[{i}]: cuda {:#010x}, cpu {:#010x}",
                    a.to_bits(),
                    b.to_bits()
                );
            }
        }
        println!("{name}: {} bf16 values bit-exact", want.concat().len());
    }
}
