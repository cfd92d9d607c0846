//! The GEMM ops' fused forms (`Matmul { act, residual, swiglu }`, `MatmulBwdData { act_grad,
//! swiglu }`) against
//! the separate ops they replace: bit for bit in f32, and in bf16 each output rounded once from
//! the f32 values (the activation reads the pre-activation before it is rounded).
use super::{eval, values, Input, SCALARS};
use crate::backend::Backend;
use crate::cpu::CpuBackend;
use parc_compiler::ir::op::ActAttrs;
use parc_compiler::ir::op::{Act, Op};
use parc_compiler::ir::{BufferId, DType};

const ROWS: usize = 6;
const IN: usize = 5;
const OUT: usize = 7;

fn matmul(bias: bool, act: Option<Act>, residual: bool) -> Op {
    Op::Matmul {
        in_dim: IN as u64,
        out_dim: OUT as u64,
        bias,
        act,
        residual,
        swiglu: false,
        fp8: None,
    }
}

fn bwd_data(act_grad: Option<Act>, accumulate: bool) -> Op {
    Op::MatmulBwdData {
        in_dim: IN as u64,
        out_dim: OUT as u64,
        accumulate,
        act_grad,
        swiglu: false,
        fp8: None,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn f(v: &[f32]) -> Input {
    Input::F(v.to_vec())
}

#[test]
fn fused_forms_equal_the_separate_ops_bit_for_bit() {
    let (x, w, b) = (
        values(ROWS * IN, 1, 2.0),
        values(OUT * IN, 2, 1.0),
        values(OUT, 3, 0.5),
    );
    let r = values(ROWS * OUT, 4, 3.0);
    for &act in Act::ALL {
        for residual in [false, true] {
            let mut ins = vec![f(&x), f(&w), f(&b)];
            if residual {
                ins.push(f(&r));
            }
            let fused = eval(&matmul(true, Some(act), residual), &ins, &[ROWS * OUT; 2]);
            let mut y = eval(&matmul(true, None, false), &ins[..3], &[ROWS * OUT]).remove(0);
            if residual {
                y = eval(&Op::Add, &[f(&r), f(&y)], &[ROWS * OUT]).remove(0);
            }
            let a = eval(&Op::Activation(ActAttrs { act }), &[f(&y)], &[ROWS * OUT]).remove(0);
            assert_eq!(bits(&fused[0]), bits(&y), "{act:?} residual={residual}: y");
            assert_eq!(bits(&fused[1]), bits(&a), "{act:?} residual={residual}: a");
        }
        // The backward-data product times act'(pre), as MatmulBwdData then ActivationBwd.
        let (dy, pre) = (values(ROWS * OUT, 5, 1.0), values(ROWS * IN, 6, 2.0));
        let fused = eval(
            &bwd_data(Some(act), false),
            &[f(&dy), f(&w), f(&pre)],
            &[ROWS * IN],
        );
        let da = eval(&bwd_data(None, false), &[f(&dy), f(&w)], &[ROWS * IN]).remove(0);
        let dh = eval(
            &Op::ActivationBwd(ActAttrs { act }),
            &[f(&da), f(&pre)],
            &[ROWS * IN],
        );
        assert_eq!(bits(&fused[0]), bits(&dh[0]), "{act:?}: d(pre)");
    }
    // A residual without an activation is a Matmul followed by an Add.
    let fused = eval(
        &matmul(false, None, true),
        &[f(&x), f(&w), f(&r)],
        &[ROWS * OUT],
    );
    let y = eval(&matmul(false, None, false), &[f(&x), f(&w)], &[ROWS * OUT]).remove(0);
    let sum = eval(&Op::Add, &[f(&r), f(&y)], &[ROWS * OUT]);
    assert_eq!(bits(&fused[0]), bits(&sum[0]));
}

/// A SwiGLU MLP's projections with the gated product in their GEMMs: the up projection's
/// `Matmul { swiglu }` is a `Matmul` then `SwiGlu(gate, u)`, the down projection's
/// `MatmulBwdData { swiglu }` a `MatmulBwdData` then `SwiGluBwd`, bit for bit in f32.
#[test]
fn swiglu_forms_equal_the_separate_ops_bit_for_bit() {
    let (x, w) = (values(ROWS * IN, 11, 2.0), values(OUT * IN, 12, 1.0));
    let gate = values(ROWS * OUT, 13, 3.0);
    let up = Op::Matmul {
        in_dim: IN as u64,
        out_dim: OUT as u64,
        bias: false,
        act: None,
        residual: false,
        swiglu: true,
        fp8: None,
    };
    let fused = eval(&up, &[f(&x), f(&w), f(&gate)], &[ROWS * OUT; 2]);
    let u = eval(&matmul(false, None, false), &[f(&x), f(&w)], &[ROWS * OUT]).remove(0);
    let a = eval(&Op::SwiGlu, &[f(&gate), f(&u)], &[ROWS * OUT]).remove(0);
    assert_eq!(bits(&fused[0]), bits(&u), "u");
    assert_eq!(bits(&fused[1]), bits(&a), "a");

    let (dy, g, u) = (
        values(ROWS * OUT, 14, 1.0),
        values(ROWS * IN, 15, 3.0),
        values(ROWS * IN, 16, 2.0),
    );
    let down = Op::MatmulBwdData {
        in_dim: IN as u64,
        out_dim: OUT as u64,
        accumulate: false,
        act_grad: None,
        swiglu: true,
        fp8: None,
    };
    let fused = eval(&down, &[f(&dy), f(&w), f(&g), f(&u)], &[ROWS * IN; 2]);
    let da = eval(&bwd_data(None, false), &[f(&dy), f(&w)], &[ROWS * IN]).remove(0);
    let grads = eval(&Op::SwiGluBwd, &[f(&da), f(&g), f(&u)], &[ROWS * IN; 2]);
    assert_eq!(bits(&fused[0]), bits(&grads[0]), "dgate");
    assert_eq!(bits(&fused[1]), bits(&grads[1]), "dup");
    assert_ne!(
        bits(&fused[0]),
        bits(&da),
        "the gradient is not the bare product"
    );
}

/// `v` as a bf16 buffer holds it (the backend rounds on write).
fn rounded(v: &[f32]) -> Vec<f32> {
    let mut b = CpuBackend::new();
    b.alloc(BufferId(0), &[v.len() as u64], DType::Bf16)
        .unwrap();
    b.write_f32(BufferId(0), v).unwrap();
    b.read_f32(BufferId(0)).unwrap()
}

#[test]
fn bf16_outputs_are_rounded_once_from_the_f32_values() {
    let (x, w, r) = (
        values(ROWS * IN, 7, 2.0),
        values(OUT * IN, 8, 1.0),
        values(ROWS * OUT, 9, 3.0),
    );
    let mut b = CpuBackend::new();
    let inputs = [(&x, DType::F32), (&w, DType::F32), (&r, DType::F32)];
    for (i, (v, dtype)) in inputs.iter().enumerate() {
        b.alloc(BufferId(i as u32), &[v.len() as u64], *dtype)
            .unwrap();
        b.write_f32(BufferId(i as u32), v).unwrap();
    }
    for id in [3, 4] {
        b.alloc(BufferId(id), &[(ROWS * OUT) as u64], DType::Bf16)
            .unwrap();
    }
    let ids = |v: &[u32]| v.iter().map(|&i| BufferId(i)).collect::<Vec<_>>();
    let op = matmul(false, Some(Act::GeluTanh), true);
    b.compute(&op, &ids(&[0, 1, 2]), &ids(&[3, 4]), &SCALARS)
        .unwrap();
    let (y, a) = (
        b.read_f32(BufferId(3)).unwrap(),
        b.read_f32(BufferId(4)).unwrap(),
    );
    // The f32 pre-activation (product + r), then each output rounded once from it.
    let mut pre = eval(&matmul(false, None, false), &[f(&x), f(&w)], &[ROWS * OUT]).remove(0);
    pre = eval(&Op::Add, &[f(&pre), f(&r)], &[ROWS * OUT]).remove(0);
    let act = eval(
        &Op::Activation(ActAttrs { act: Act::GeluTanh }),
        &[f(&pre)],
        &[ROWS * OUT],
    );
    assert_eq!(bits(&y), bits(&rounded(&pre)));
    assert_eq!(bits(&a), bits(&rounded(&act[0])));
    // Rounding y first would have given other activations somewhere (the test can fail).
    let late = eval(
        &Op::Activation(ActAttrs { act: Act::GeluTanh }),
        &[f(&rounded(&pre))],
        &[ROWS * OUT],
    );
    assert_ne!(bits(&a), bits(&rounded(&late[0])));
}

#[test]
fn an_accumulating_activation_gradient_is_an_error() {
    let mut b = CpuBackend::new();
    for (id, n) in [
        (0, ROWS * OUT),
        (1, OUT * IN),
        (2, ROWS * IN),
        (3, ROWS * IN),
    ] {
        b.alloc(BufferId(id), &[n as u64], DType::F32).unwrap();
    }
    let ins = [BufferId(0), BufferId(1), BufferId(2)];
    let err = b
        .compute(
            &bwd_data(Some(Act::GeluTanh), true),
            &ins,
            &[BufferId(3)],
            &SCALARS,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("act_grad") && err.contains("E0822"), "{err}");
}
