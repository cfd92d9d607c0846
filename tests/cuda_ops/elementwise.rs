//! Elementwise ops: activations and their backwards, SwiGLU, add, scale, copies and zeroing,
//! including outputs that alias an input (in place).
use crate::harness::{check, Case, Data, Rng, ELEMENTWISE};
use parc_compiler::ir::op::{Act, Op};

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
