//! Elementwise ops: activations and their backwards, SwiGLU, add, scale, copies and zeroing,
//! including outputs that alias an input (in place), with f32 buffers and with bf16 storage
//! (every float operand bf16, and copies/adds mixing f32 and bf16).
use crate::harness::{check, check_on, Case, Data, Rng, BF16_STORED, ELEMENTWISE};
use parc_compiler::ir::op::ActAttrs;
use parc_compiler::ir::op::{Act, Op};
use parc_compiler::ir::DType;
use parc_compiler::spec::Precision;

#[test]
fn elementwise() {
    let mut r = Rng::new("elementwise");
    check("elementwise", &cases(&mut r, 3001));
}

/// Both backends store the float operands in bf16. Ops whose f32 result is computed the same
/// way on both (add, scale, relu, copies, zero) must match exactly; the others within one bf16
/// rounding step. Odd lengths exercise the kernels' scalar tails, lengths that are multiples
/// of 8 their 16-byte vectors.
#[test]
fn elementwise_bf16_storage() {
    let mut r = Rng::new("elementwise_bf16_storage");
    let exact = |name: &str| {
        ["add", "scale", "copy", "zero", "activation Relu"]
            .iter()
            .any(|p| name.starts_with(p))
    };
    let mut all = Vec::new();
    for n in [3001, 4096] {
        for case in cases(&mut r, n) {
            let tol = if exact(case.name()) { 0.0 } else { BF16_STORED };
            all.push(case.stored_bf16(tol));
        }
    }
    // Conversions and mixed operands: f32 -> bf16 rounds, bf16 -> f32 widens, both exactly
    // as the CPU does.
    let (f, h) = (DType::F32, DType::Bf16);
    for n in [3001, 4096] {
        let x = r.vec(n, 3.0);
        let copy = |x: &[f32], r: &mut Rng| {
            Case::new(
                "copy",
                Op::Copy,
                vec![Data::F32(x.to_vec())],
                vec![r.vec(n, 1.0)],
                0.0,
            )
        };
        all.push(copy(&x, &mut r).with_dtypes(&[f], &[h], 0.0));
        all.push(copy(&x, &mut r).with_dtypes(&[h], &[f], 0.0));
        let range = Op::CopyRange {
            src_offset: 9,
            dst_offset: 24,
            len: n as u64 - 100,
        };
        for (src, dst) in [(f, h), (h, f)] {
            let case = Case::new(
                "copy_range",
                range.clone(),
                vec![Data::F32(x.clone())],
                vec![r.vec(n, 1.0)],
                0.0,
            );
            all.push(case.with_dtypes(&[src], &[dst], 0.0));
        }
        let add = Case::new(
            "add",
            Op::Add,
            vec![Data::F32(r.vec(n, 1.0)), Data::F32(r.vec(n, 1.0))],
            vec![r.vec(n, 1.0)],
            0.0,
        );
        all.push(add.with_dtypes(&[f, h], &[h], 0.0));
    }
    check_on("elementwise_bf16_storage", &all, Precision::Bf16);
}

/// One case per elementwise op on `n` elements (f32 buffers, fp32 tolerances).
fn cases(r: &mut Rng, n: usize) -> Vec<Case> {
    let mut cases = Vec::new();
    for &act in Act::ALL {
        let x = r.vec(n, 4.0);
        cases.push(Case::new(
            format!("activation {act:?}"),
            Op::Activation(ActAttrs { act }),
            vec![Data::F32(x.clone())],
            vec![r.vec(n, 1.0)],
            ELEMENTWISE,
        ));
        cases.push(Case::new(
            format!("activation_bwd {act:?}"),
            Op::ActivationBwd(ActAttrs { act }),
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
    cases
}
