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
