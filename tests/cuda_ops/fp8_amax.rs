//! The group amaxes of FP8 GEMM operands (`Op::Fp8Amax`) on the CUDA backend against the CPU,
//! bit for bit (a maximum does not depend on the order it is taken in), for both kernel
//! variants (`PARC_FP8_AMAX_KERNEL`: `groups`, and `vectors`, which reads 8-vectors where a
//! group holds whole ones of a row or is one column). Every operand of the three GEMMs
//! (tokens and weights, K along columns and along rows) under rowwise and blockwise scaling,
//! on shapes whose groups end clipped (rows 150 and 300 against blocks of 128 and runs of 64
//! rows), whose columns are not a multiple of 8 (the scalar kernel's shapes), and small ones.
//! Each group's maximum sits at a random element, some elements are NaN or infinite (never an
//! amax), and f32 and bf16 storage both run.
use crate::harness::{check_with, gpu_variant, Case, Data, Rng};
use parc_compiler::ir::fp8::{operands, Fp8AmaxAttrs, Fp8Format, Fp8Gemm, Fp8Scaling};
use parc_compiler::ir::fp8::{Fp8Operand, OperandKind};
use parc_compiler::ir::op::Op;
use parc_compiler::spec::Precision;

/// `[rows, cols]` operands: clipped groups and runs, odd columns, tiny.
const SHAPES: [(usize, usize); 6] = [
    (150, 200),
    (300, 136),
    (37, 64),
    (129, 264),
    (40, 30),
    (5, 24),
];

/// Every distinct operand of the three FP8 GEMMs.
fn all_operands() -> Vec<Fp8Operand> {
    let g = Fp8Gemm::current(Fp8Scaling::Rowwise, Fp8Format::E5m2);
    let mut all: Vec<Fp8Operand> = [operands::forward(g), operands::bwd_data(g)]
        .into_iter()
        .chain([operands::bwd_weight(g)])
        .flatten()
        .collect();
    all.dedup();
    all
}

/// Values of a few sizes, one element in 97 NaN or ±infinity.
fn values(r: &mut Rng, n: usize) -> Vec<f32> {
    let unit = r.vec(n, 1.0);
    (unit.iter().enumerate())
        .map(|(i, u)| match (i * 7919 + 13) % 97 {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => f32::NEG_INFINITY,
            _ => u * [1.0, 1e-3, 50.0][i % 3],
        })
        .collect()
}

fn cases(r: &mut Rng) -> Vec<Case> {
    let scalings = [
        Fp8Scaling::Rowwise,
        Fp8Scaling::Blockwise { block: 128 },
        Fp8Scaling::Blockwise { block: 256 },
    ];
    let mut cases = Vec::new();
    for operand in all_operands() {
        for scaling in scalings {
            for (rows, cols) in SHAPES {
                let (rows64, cols64) = (rows as u64, cols as u64);
                let weight = operand.kind == OperandKind::Weight;
                let attrs = Fp8AmaxAttrs {
                    operand,
                    scaling,
                    rows: weight.then_some(rows64),
                    cols: cols64,
                };
                let groups = operand.groups(scaling, rows64, cols64) as usize;
                cases.push(Case::new(
                    format!("fp8 amax {operand:?} {scaling:?} {rows}x{cols}"),
                    Op::Fp8Amax(attrs),
                    vec![Data::F32(values(r, rows * cols))],
                    vec![r.vec(groups, 1.0)],
                    0.0,
                ));
            }
        }
    }
    cases
}

fn run(test: &str, amax: &str) {
    let Some(mut gpu) = gpu_variant(Precision::Fp32, ("fp8_amax", amax)) else {
        return;
    };
    let mut r = Rng::new(test);
    let f32_cases = cases(&mut r);
    let bf16_cases: Vec<Case> = (cases(&mut r).into_iter())
        .map(|c| c.stored_bf16(0.0))
        .collect();
    check_with(test, &f32_cases, gpu.as_mut());
    check_with(test, &bf16_cases, gpu.as_mut());
}

#[test]
fn group_amaxes_match_the_cpu() {
    run("group_amaxes_match_the_cpu", "groups");
}

#[test]
fn vector_group_amaxes_match_the_cpu() {
    run("vector_group_amaxes_match_the_cpu", "vectors");
}
