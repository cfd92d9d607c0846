use super::*;

fn swiglu_kernel() -> Kernel {
    let mut g = Graph::new();
    let gate = g.load(0, 0);
    let up = g.load(1, 0);
    let s = g.un(Un::Sigmoid, gate);
    let silu = g.bin(Bin::Mul, gate, s);
    let y = g.bin(Bin::Mul, silu, up);
    Kernel {
        cols: 8,
        inputs: vec![Access::Elem { width: 8 }, Access::Elem { width: 8 }],
        outputs: vec![Access::Elem { width: 8 }],
        graph: g,
        stores: vec![Store {
            output: 0,
            col_offset: 0,
            value: y,
        }],
    }
}

#[test]
fn equal_nodes_are_one_node() {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let a = g.un(Un::Exp, x);
    let b = g.un(Un::Exp, x);
    assert_eq!(a, b);
    assert_eq!(g.len(), 2);
}

#[test]
fn builder_folds_constants_and_identities() {
    let mut g = Graph::new();
    let x = g.param(0);
    let zero = g.constant(0.0);
    let one = g.constant(1.0);
    assert_eq!(g.bin(Bin::Add, x, zero), x);
    assert_eq!(g.bin(Bin::Mul, one, x), x);
    assert_eq!(g.bin(Bin::Mul, x, zero), zero);
    let n = g.un(Un::Neg, x);
    assert_eq!(g.un(Un::Neg, n), x);
    let two = g.constant(2.0);
    let three = g.constant(3.0);
    let six = g.bin(Bin::Mul, two, three);
    assert_eq!(g.node(six).constant(), Some(6.0));
}

#[test]
fn a_valid_kernel_validates_and_prints_as_an_expression() {
    let k = swiglu_kernel();
    assert_eq!(k.validate(), Ok(()));
    assert_eq!(k.to_string(), "y0 = (x0 * sigmoid(x0)) * x1");
    assert!(!k.is_expanded());
}

#[test]
fn invalid_kernels_are_refused_with_the_broken_rule() {
    let mut k = swiglu_kernel();
    k.outputs = vec![Access::Elem { width: 16 }];
    assert!(k
        .validate()
        .unwrap_err()
        .contains("not covered exactly once"));

    let mut k = swiglu_kernel();
    k.inputs.pop();
    assert!(k.validate().unwrap_err().contains("does not exist"));

    let mut k = swiglu_kernel();
    let c = k.graph.cmp(Cmp::Gt, NodeId(0), NodeId(1));
    k.stores[0].value = c;
    assert!(k.validate().unwrap_err().contains("comparison"));

    let mut k = swiglu_kernel();
    let c = k.graph.constant(1.0);
    let s = k.graph.row_sum(c);
    k.stores[0].value = s;
    assert!(k.validate().unwrap_err().contains("constant along the row"));
}

#[test]
fn importing_a_function_substitutes_its_parameters() {
    let mut f = Graph::new();
    let x = f.param(0);
    let y = f.param(1);
    let body = f.bin(Bin::Mul, x, y);
    let mut g = Graph::new();
    let a = g.load(0, 0);
    let two = g.constant(2.0);
    let call = g.import(&f, body, &[a, two]);
    assert_eq!(g.node(call), Node::Bin(Bin::Mul, a, two));
}

#[test]
fn primitives_round_trip_the_exponent_bits() {
    for x in [1.0f32, 3.5, 1e-20, 6.0e37, 0.75] {
        let e = prim::exponent(x);
        let m = prim::un(Un::Mantissa, x);
        assert!((1.0..2.0).contains(&m), "{x}");
        assert_eq!(m * prim::exp2i(e), x);
    }
    assert_eq!(prim::exp2i(-126.0), f32::MIN_POSITIVE);
}

#[test]
fn exp2bits_is_the_power_of_two_a_rounded_integer_holds_in_its_low_bits() {
    // `1.5 · 2^23 + b` holds b in its low bits: 2^(b - 127) for every normal exponent.
    let magic = 12_582_912.0f32;
    for b in 1..=254 {
        let t = magic + b as f32;
        assert_eq!(prim::un(Un::Exp2Bits, t), 2f32.powi(b - 127), "b = {b}");
        assert_eq!(prim::exp2bits(t), prim::exp2i(b as f32 - 127.0));
    }
    // Just its bits: the low 9 become sign and exponent, the fraction is cleared.
    assert_eq!(
        prim::exp2bits(f32::from_bits(0x1234_5680)).to_bits(),
        0x4000_0000
    );
    assert_eq!(
        prim::exp2bits(f32::from_bits(0x0000_01ff)).to_bits(),
        0xff80_0000
    );
    assert_eq!(prim::exp2bits(0.0).to_bits(), 0);
}

#[test]
fn a_rotation_whose_heads_do_not_tile_the_domain_is_refused() {
    let mut k = swiglu_kernel();
    let partner = k.graph.load_mapped(0, 0, ColMap::RotateHalf(6));
    k.stores[0].value = partner;
    assert!(k
        .validate()
        .unwrap_err()
        .contains("must be even, at most the head and divide"));
    let mut k = swiglu_kernel();
    let partner = k.graph.load_mapped(0, 0, ColMap::RotateHalf(4));
    k.stores[0].value = partner;
    assert_eq!(k.validate(), Ok(()));
    // A partial rotation: an odd or too wide turned part is refused, an even one is valid.
    for (rot, ok) in [(3, false), (6, false), (2, true)] {
        let mut k = swiglu_kernel();
        let map = ColMap::RotatePart { head: 4, rot };
        k.stores[0].value = k.graph.load_mapped(0, 0, map);
        assert_eq!(k.validate().is_ok(), ok, "rot {rot}");
    }
}

/// A partial rotation's partners: in heads of 8 whose first 4 turn, columns 0, 1 pair with 2,
/// 3 and the other four are their own; `rotation` of a whole head is `RotateHalf`.
#[test]
fn a_partial_rotation_pairs_the_turned_columns_and_keeps_the_rest() {
    let map = ColMap::rotation(8, 4);
    let partners: Vec<u64> = (0..16).map(|c| map.apply(c)).collect();
    assert_eq!(
        partners,
        [2, 3, 0, 1, 4, 5, 6, 7, 10, 11, 8, 9, 12, 13, 14, 15]
    );
    assert_eq!(ColMap::rotation(8, 8), ColMap::RotateHalf(8));
    assert_eq!(map.period(), Some(8));
}

#[test]
fn fma_rounds_once_folds_and_prints() {
    let mut g = Graph::new();
    let (x, y, z) = (g.load(0, 0), g.load(1, 0), g.load(2, 0));
    let one = g.constant(1.0);
    // `1 · y + z` and `x · 1 + z` are adds; exact constant products fold; three constants fold
    // with one rounding.
    assert_eq!(g.fma(one, y, z), g.bin(Bin::Add, y, z));
    assert_eq!(g.fma(x, one, z), g.bin(Bin::Add, x, z));
    let (two, three) = (g.constant(2.0), g.constant(3.0));
    let six = g.constant(6.0);
    assert_eq!(g.fma(two, three, z), g.bin(Bin::Add, six, z));
    let a = 1.0 + f32::EPSILON;
    let (ca, cb) = (g.constant(a), g.constant(-1.0 - 2.0 * f32::EPSILON));
    let folded = g.fma(ca, ca, cb);
    assert_eq!(g.node(folded).constant(), Some(f32::EPSILON * f32::EPSILON));
    // An inexact constant product stays a fused node, as does `fma(x, y, 0)` (`-0` differs).
    let third = g.constant(1.0 / 3.0);
    let f3 = g.fma(third, third, z);
    assert!(matches!(g.node(f3), Node::Fma(..)));
    let zero = g.constant(0.0);
    let f0 = g.fma(x, y, zero);
    assert!(matches!(g.node(f0), Node::Fma(..)));
    let f = g.fma(x, y, z);
    assert_eq!(g.fma(x, y, z), f, "hash-consed");
    assert_ne!(g.fma(y, x, z), f);
    let k = Kernel {
        cols: 4,
        inputs: vec![Access::Elem { width: 4 }; 3],
        outputs: vec![Access::Elem { width: 4 }],
        graph: g,
        stores: vec![Store {
            output: 0,
            col_offset: 0,
            value: f,
        }],
    };
    assert_eq!(k.validate(), Ok(()));
    assert!(k.is_expanded());
    assert_eq!(k.to_string(), "y0 = fma(x0, x1, x2)");
    // The evaluator rounds once: the product's rounding error survives.
    let xs = [a, 3.0, 0.1, -2.5];
    let ys = [a, 1.0 / 3.0, 0.7, 4.0];
    let zs: Vec<f32> = xs.iter().zip(&ys).map(|(x, y)| -(x * y)).collect();
    let mut out = [0.0f32; 4];
    eval::run(&k, 0, 1, &[&xs, &ys, &zs], &mut [&mut out]).unwrap();
    for i in 0..4 {
        assert_eq!(out[i], prim::fma(xs[i], ys[i], zs[i]));
    }
    assert_eq!(out[0], f32::EPSILON * f32::EPSILON);
    assert_ne!(out[1], 0.0);
}
