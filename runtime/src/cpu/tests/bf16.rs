//! bf16 storage on the CPU backend: packed storage at planned sizes, rounding to nearest-even on
//! every write, exact widening on read, and ops on bf16 operands equal to the same op in f32
//! with its inputs widened and its outputs rounded (accumulating outputs included).
use super::*;
use crate::cpu::memory::{round_bf16, widen_bf16};
use parc_compiler::ir::op::Act;
use parc_compiler::ir::op::ActAttrs;

fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| widen_bf16(round_bf16(x))).collect()
}

#[test]
fn rounding_is_to_nearest_even() {
    // 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one.
    assert_eq!(widen_bf16(round_bf16(1.0 + 1.0 / 256.0)), 1.0);
    assert_eq!(widen_bf16(round_bf16(1.0 + 3.0 / 256.0)), 1.0 + 4.0 / 256.0);
    assert_eq!(widen_bf16(round_bf16(1.0 + 1.5 / 256.0)), 1.0 + 2.0 / 256.0);
    assert!(widen_bf16(round_bf16(f32::NAN)).is_nan());
    assert_eq!(widen_bf16(round_bf16(f32::MAX)), f32::INFINITY);
    assert_eq!(widen_bf16(round_bf16(-0.0)).to_bits(), (-0.0f32).to_bits());
}

#[test]
fn bf16_buffers_round_on_write_and_take_two_bytes() {
    let mut b = CpuBackend::new();
    let values = [1.0, 1.0 + 1.0 / 256.0, 2.71, -2.5e-3, 65504.0];
    b.alloc(BufferId(0), &[5], DType::Bf16).unwrap();
    assert_eq!(b.allocated_bytes(), 10);
    assert_eq!(b.read_f32(BufferId(0)).unwrap(), vec![0.0; 5]);
    b.write_f32(BufferId(0), &values).unwrap();
    assert_eq!(b.read_f32(BufferId(0)).unwrap(), rounded(&values));
    assert!(b.write_f32(BufferId(0), &[1.0; 4]).is_err());
    // Borrowing a bf16 buffer as f32 slices is refused with a message, never a panic.
    assert!(b.f32(BufferId(0)).is_err());
    assert!(b.i32(BufferId(0)).is_err());
    // A neighbour allocated right after does not overlap the packed words.
    b.alloc(BufferId(1), &[3], DType::Bf16).unwrap();
    b.write_f32(BufferId(1), &[7.0, 8.0, 9.0]).unwrap();
    assert_eq!(b.read_f32(BufferId(0)).unwrap(), rounded(&values));
}

/// Run `op` with every float operand stored as `dtype`; outputs start at `initial`.
fn run_as(
    op: &Op,
    inputs: &[Vec<f32>],
    initial: &[Vec<f32>],
    input_types: &[DType],
    output_types: &[DType],
) -> Vec<Vec<f32>> {
    let mut b = CpuBackend::new();
    let mut next = 0u32;
    let mut make = |b: &mut CpuBackend, v: &[f32], dtype: DType| {
        let id = BufferId(next);
        next += 1;
        b.alloc(id, &[v.len() as u64], dtype).unwrap();
        b.write_f32(id, v).unwrap();
        id
    };
    let ins: Vec<BufferId> = inputs
        .iter()
        .zip(input_types)
        .map(|(v, &t)| make(&mut b, v, t))
        .collect();
    let outs: Vec<BufferId> = initial
        .iter()
        .zip(output_types)
        .map(|(v, &t)| make(&mut b, v, t))
        .collect();
    b.compute(op, &ins, &outs, &SCALARS).unwrap();
    outs.iter().map(|&id| b.read_f32(id).unwrap()).collect()
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 + 0.37) * (seed as f32 + 1.3)).sin() * 1.7)
        .collect()
}

#[test]
fn ops_on_bf16_equal_f32_ops_on_widened_inputs_rounded_once() {
    use DType::{Bf16, F32};
    let (rows, dim) = (4usize, 8usize);
    let x = values(rows * dim, 1);
    let w = values(dim, 2);
    let bias = values(dim, 3);
    // (op, inputs, input types, output lengths, output types)
    type Case = (Op, Vec<Vec<f32>>, Vec<DType>, Vec<usize>, Vec<DType>);
    let cases: Vec<Case> = vec![
        (
            Op::Activation(ActAttrs { act: Act::Gelu }),
            vec![x.clone()],
            vec![Bf16],
            vec![rows * dim],
            vec![Bf16],
        ),
        (
            Op::Add,
            vec![x.clone(), values(rows * dim, 4)],
            vec![Bf16, F32],
            vec![rows * dim],
            vec![Bf16],
        ),
        (
            Op::LayerNorm {
                dim: dim as u64,
                eps: 1e-5,
                bias: true,
            },
            vec![x.clone(), w.clone(), bias.clone()],
            vec![Bf16, F32, F32],
            vec![rows * dim, rows, rows],
            vec![Bf16, F32, F32],
        ),
        (
            Op::Matmul {
                in_dim: dim as u64,
                out_dim: 2,
                bias: false,
                act: None,
                residual: false,
                swiglu: false,
                fp8: None,
            },
            vec![x.clone(), values(2 * dim, 5)],
            vec![Bf16, F32],
            vec![rows * 2],
            vec![Bf16],
        ),
    ];
    for (op, inputs, input_types, out_lens, output_types) in cases {
        let initial: Vec<Vec<f32>> = out_lens.iter().map(|&n| vec![0.0; n]).collect();
        let got = run_as(&op, &inputs, &initial, &input_types, &output_types);
        // The same op in f32 on the inputs as bf16 holds them, outputs rounded where bf16.
        let widened: Vec<Vec<f32>> = inputs
            .iter()
            .zip(&input_types)
            .map(|(v, &t)| if t == Bf16 { rounded(v) } else { v.clone() })
            .collect();
        let f32_types = vec![F32; inputs.len()];
        let reference = run_as(
            &op,
            &widened,
            &initial,
            &f32_types,
            &vec![F32; out_lens.len()],
        );
        for ((g, r), &t) in got.iter().zip(&reference).zip(&output_types) {
            let expected = if t == Bf16 { rounded(r) } else { r.clone() };
            assert_eq!(g, &expected, "{op:?}");
        }
        // And it is not the f32 result: the rounding happened.
        let exact = run_as(
            &op,
            &inputs,
            &initial,
            &f32_types,
            &vec![F32; out_lens.len()],
        );
        assert_ne!(got[0], exact[0], "{op:?}");
    }
}

#[test]
fn accumulating_into_bf16_reads_adds_and_rounds() {
    // Copy into a bf16 buffer converts; an in-place Add whose
    // output is one of its inputs reads the value from before the op.
    let start = vec![0.5f32; 6];
    let add = vec![1.0 / 512.0; 6];
    let got = run_as(
        &Op::Add,
        &[start.clone(), add.clone()],
        &[vec![0.0; 6]],
        &[DType::Bf16, DType::F32],
        &[DType::Bf16],
    );
    assert_eq!(got[0], rounded(&[0.5 + 1.0 / 512.0; 6]));
    let mut b = CpuBackend::new();
    b.alloc(BufferId(0), &[6], DType::Bf16).unwrap();
    b.alloc(BufferId(1), &[6], DType::F32).unwrap();
    b.write_f32(BufferId(0), &start).unwrap();
    b.write_f32(BufferId(1), &values(6, 9)).unwrap();
    let ids = [BufferId(0), BufferId(1)];
    b.compute(&Op::Add, &ids, &[BufferId(0)], &SCALARS).unwrap();
    let expected: Vec<f32> = values(6, 9).iter().map(|v| v + 0.5).collect();
    assert_eq!(b.read_f32(BufferId(0)).unwrap(), rounded(&expected));
    b.compute(&Op::Copy, &[BufferId(1)], &[BufferId(0)], &SCALARS)
        .unwrap();
    assert_eq!(b.read_f32(BufferId(0)).unwrap(), rounded(&values(6, 9)));
}

/// The ops whose dx may accumulate (`MatmulBwdData`, `LayerNormBwd`, `RmsNormBwd` with
/// `accumulate`) add the finished dx once: in f32 bit-identical to an `Add` of the old dx and
/// the overwritten form's dx (what the lowering's plain form computes), and into a bf16 dx the
/// old value read, the f32 dx added and the sum rounded once.
#[test]
fn accumulating_dx_adds_the_finished_value_once() {
    use DType::{Bf16, F32};
    let (rows, dim, out) = (4usize, 8usize, 3usize);
    let x = values(rows * dim, 11);
    let w = values(dim, 12);
    let dy = values(rows * dim, 13);
    let ln = run_as(
        &Op::LayerNorm {
            dim: dim as u64,
            eps: 1e-5,
            bias: false,
        },
        &[x.clone(), w.clone()],
        &[vec![0.0; rows * dim], vec![0.0; rows], vec![0.0; rows]],
        &[F32, F32],
        &[F32, F32, F32],
    );
    let rms = run_as(
        &Op::RmsNorm {
            dim: dim as u64,
            eps: 1e-6,
        },
        &[x.clone(), w.clone()],
        &[vec![0.0; rows * dim], vec![0.0; rows]],
        &[F32, F32],
        &[F32, F32],
    );
    let norm_ins = vec![
        dy.clone(),
        x.clone(),
        w.clone(),
        ln[1].clone(),
        ln[2].clone(),
    ];
    let rms_ins = vec![dy.clone(), x.clone(), w.clone(), rms[1].clone()];
    let dy_out = values(rows * out, 14);
    let mm_ins = vec![dy_out, values(out * dim, 15)];
    // (op with accumulate off, on; inputs; input types; dx length; the other outputs' lengths)
    type Case = (Op, Op, Vec<Vec<f32>>, Vec<DType>, usize, Vec<usize>);
    let ln_op = |accumulate| Op::LayerNormBwd {
        dim: dim as u64,
        bias: false,
        accumulate,
        accumulate_param_grad: true,
    };
    let rms_op = |accumulate| Op::RmsNormBwd {
        dim: dim as u64,
        accumulate,
        accumulate_param_grad: true,
    };
    let mm_op = |accumulate| Op::MatmulBwdData {
        in_dim: dim as u64,
        out_dim: out as u64,
        accumulate,
        act_grad: None,
        swiglu: false,
        fp8: None,
    };
    let cases: Vec<Case> = vec![
        (
            ln_op(false),
            ln_op(true),
            norm_ins,
            vec![F32; 5],
            rows * dim,
            vec![dim],
        ),
        (
            rms_op(false),
            rms_op(true),
            rms_ins,
            vec![F32; 4],
            rows * dim,
            vec![dim],
        ),
        (
            mm_op(false),
            mm_op(true),
            mm_ins,
            vec![F32; 2],
            rows * dim,
            vec![],
        ),
    ];
    let old_dx = values(rows * dim, 16);
    for (plain, accumulating, inputs, types, dx_len, others) in cases {
        let start = |dx: Vec<f32>| {
            let mut v = vec![dx];
            v.extend(others.iter().map(|&n| vec![0.0; n]));
            v
        };
        let out_types = |dx: DType| {
            let mut t = vec![dx];
            t.extend(others.iter().map(|_| F32));
            t
        };
        let fresh = run_as(
            &plain,
            &inputs,
            &start(vec![0.0; dx_len]),
            &types,
            &out_types(F32),
        );
        let added = run_as(
            &Op::Add,
            &[old_dx.clone(), fresh[0].clone()],
            &[vec![0.0; dx_len]],
            &[F32, F32],
            &[F32],
        );
        let got = run_as(
            &accumulating,
            &inputs,
            &start(old_dx.clone()),
            &types,
            &out_types(F32),
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got[0]), bits(&added[0]), "{accumulating:?}");
        assert_ne!(got[0], fresh[0], "{accumulating:?}: the old dx was added");
        // The other outputs do not depend on the flag.
        assert_eq!(got[1..], fresh[1..], "{accumulating:?}");
        // bf16 dx: read, add the f32 dx, round once.
        let got = run_as(
            &accumulating,
            &inputs,
            &start(old_dx.clone()),
            &types,
            &out_types(Bf16),
        );
        let old = rounded(&old_dx);
        let once: Vec<f32> = old.iter().zip(&fresh[0]).map(|(a, b)| a + b).collect();
        assert_eq!(got[0], rounded(&once), "{accumulating:?} into bf16");
    }
}
