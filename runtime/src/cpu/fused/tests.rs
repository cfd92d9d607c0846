#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The CPU's fused op against the reference evaluator run on the whole op at once: the same
//! bits for every fixture kernel on 1 and 4 threads (rows chunked, per-position tables read at
//! absolute rows), bf16 operands staged as every op stages them, and a short table refused.
use super::super::CpuBackend;
use crate::backend::{Backend, StepScalars};
use parc_compiler::ir::op::{FusedAttrs, Op};
use parc_compiler::ir::{BufferId, DType};
use parc_compiler::kir::{self, Access, Kernel};
use std::sync::Arc;

#[path = "../../../../tests/cuda_ops/fused_kernels.rs"]
pub(crate) mod fixtures;

const SCALARS: StepScalars = StepScalars {
    lr: 0.0,
    step: 1,
    loss_scale: None,
};

/// Values in [-2, 2) from a fixed stream.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
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

fn inputs(k: &Kernel, rows: usize) -> Vec<Vec<f32>> {
    (k.inputs.iter().enumerate())
        .map(|(i, a)| values(len(k, a, rows), i as u64 + 7))
        .collect()
}

/// `k` run as an op on `backend` with `dtypes` (inputs then outputs).
fn on_backend(
    backend: &mut CpuBackend,
    k: &Kernel,
    ins: &[Vec<f32>],
    rows: usize,
    dtypes: &[DType],
) -> crate::error::Result<Vec<Vec<f32>>> {
    let mut ids_in = Vec::new();
    for (i, x) in ins.iter().enumerate() {
        let id = BufferId(i as u32);
        backend.alloc(id, &[x.len() as u64], dtypes[i]).unwrap();
        backend.write_f32(id, x).unwrap();
        ids_in.push(id);
    }
    let mut ids_out = Vec::new();
    for (o, a) in k.outputs.iter().enumerate() {
        let id = BufferId((ins.len() + o) as u32);
        let n = len(k, a, rows);
        backend
            .alloc(id, &[n as u64], dtypes[ins.len() + o])
            .unwrap();
        backend.write_f32(id, &values(n, 99)).unwrap();
        ids_out.push(id);
    }
    let op = Op::Fused(FusedAttrs {
        name: "test".into(),
        rows: None,
        kernel: Arc::new(k.clone()),
    });
    backend.compute(&op, &ids_in, &ids_out, &SCALARS)?;
    Ok(ids_out
        .iter()
        .map(|&id| backend.read_f32(id).unwrap())
        .collect())
}

/// The evaluator on all rows at once.
fn reference(k: &Kernel, ins: &[Vec<f32>], rows: usize) -> Vec<Vec<f32>> {
    let k = kir::expand::expand(k);
    let mut outs: Vec<Vec<f32>> = k
        .outputs
        .iter()
        .map(|a| vec![0.0; len(&k, a, rows)])
        .collect();
    let ins: Vec<&[f32]> = ins.iter().map(Vec::as_slice).collect();
    let mut views: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
    kir::eval::run(&k, 0, rows, &ins, &mut views).unwrap();
    outs
}

fn all_kernels() -> Vec<(&'static str, Kernel)> {
    let mut all = fixtures::primitive(64, 16);
    all.extend(fixtures::composite(64));
    all.push(("rms wide", fixtures::rms(1000)));
    all
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn fused_ops_compute_the_evaluators_bits_on_any_thread_count() {
    // 300 rows: several chunks for every kernel, a per-position table read across them.
    let rows = 300;
    for (name, k) in all_kernels() {
        let ins = inputs(&k, rows);
        let want = reference(&k, &ins, rows);
        let dtypes = vec![DType::F32; k.inputs.len() + k.outputs.len()];
        for threads in [1, 4] {
            let mut backend = CpuBackend::with_threads(threads).unwrap();
            let got = on_backend(&mut backend, &k, &ins, rows, &dtypes).unwrap();
            for (o, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(same_bits(g, w), "{name} output {o} on {threads} threads");
            }
        }
    }
}

#[test]
fn bf16_operands_are_widened_and_rounded_as_every_op_does() {
    let rows = 70;
    for (name, k) in all_kernels() {
        let bf16 = |a: &Access| match a {
            Access::Elem { .. } => DType::Bf16,
            _ => DType::F32,
        };
        let dtypes: Vec<DType> = k.inputs.iter().chain(&k.outputs).map(bf16).collect();
        let round = |v: f32| half::bf16::from_f32(v).to_f32();
        let ins = inputs(&k, rows);
        let widened: Vec<Vec<f32>> = (ins.iter().zip(&dtypes))
            .map(|(x, d)| match d {
                DType::Bf16 => x.iter().map(|&v| round(v)).collect(),
                _ => x.clone(),
            })
            .collect();
        let mut want = reference(&k, &widened, rows);
        for (w, d) in want.iter_mut().zip(&dtypes[k.inputs.len()..]) {
            if *d == DType::Bf16 {
                w.iter_mut().for_each(|v| *v = round(*v));
            }
        }
        let got = on_backend(&mut CpuBackend::new(), &k, &ins, rows, &dtypes).unwrap();
        for (o, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(same_bits(g, w), "{name} output {o}");
        }
    }
}

#[test]
fn a_table_short_of_positions_is_refused() {
    let k = fixtures::rope(64, 16);
    let rows = 30;
    let mut ins = inputs(&k, rows);
    let short = ins[1].len() - 32;
    ins[1].truncate(short);
    let dtypes = vec![DType::F32; 3];
    let e = on_backend(&mut CpuBackend::new(), &k, &ins, rows, &dtypes)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("table of 9 positions") && e.contains("read 10"),
        "{e}"
    );
}
