//! Accuracy of the expansions against f64 references, on dense sweeps (every `STRIDE`-th f32
//! bit pattern of a range) and special values. The maxima found are in each test's comment.
use super::super::eval;
use super::*;
use crate::kir::Access;

/// `y = op(x)` over one row of `xs.len()` columns, expanded and evaluated.
fn apply(op: Un, xs: &[f32]) -> Vec<f32> {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let y = g.un(op, x);
    run_one(g, y, &[xs])
}

fn apply2(op: Bin, xs: &[f32], ys: &[f32]) -> Vec<f32> {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let y = g.load(1, 0);
    let z = g.bin(op, x, y);
    run_one(g, z, &[xs, ys])
}

fn run_one(graph: Graph, value: NodeId, inputs: &[&[f32]]) -> Vec<f32> {
    let n = inputs[0].len() as u64;
    let k = Kernel {
        cols: n,
        inputs: vec![Access::Elem { width: n }; inputs.len()],
        outputs: vec![Access::Elem { width: n }],
        graph,
        stores: vec![Store {
            output: 0,
            col_offset: 0,
            value,
        }],
    };
    let e = expand(&k);
    assert!(e.is_expanded());
    assert_eq!(e.validate(), Ok(()));
    let mut out = vec![0.0f32; n as usize];
    eval::run(&e, 0, 1, inputs, &mut [&mut out]).unwrap();
    out
}

/// Every `stride`-th f32 from `lo` to `hi` (same sign, by bit pattern), plus both signs when
/// `both_signs`.
fn sweep(lo: f32, hi: f32, stride: u32, both_signs: bool) -> Vec<f32> {
    let (a, b) = (lo.to_bits(), hi.to_bits());
    let mut v: Vec<f32> = (a..=b)
        .step_by(stride as usize)
        .map(f32::from_bits)
        .collect();
    v.push(hi);
    if both_signs {
        let neg: Vec<f32> = v.iter().map(|x| -x).collect();
        v.extend(neg);
    }
    v
}

/// The distance from `got` to `exact` in units of the f32 spacing at `exact`.
fn ulps(got: f32, exact: f64) -> f64 {
    if got == exact as f32 || (got.is_nan() && exact.is_nan()) {
        return 0.0;
    }
    if got.is_infinite() || exact.is_infinite() || got.is_nan() || exact.is_nan() {
        return f64::INFINITY;
    }
    let a = exact.abs().max(f32::MIN_POSITIVE as f64);
    let ulp = 2f64.powi(a.log2().floor() as i32 - 23);
    (got as f64 - exact).abs() / ulp
}

/// The largest ulp error of `op` over `xs`, and where.
fn max_ulps(op: Un, xs: &[f32], reference: impl Fn(f64) -> f64) -> (f64, f32) {
    let ys = apply(op, xs);
    xs.iter()
        .zip(&ys)
        .map(|(&x, &y)| (ulps(y, reference(x as f64)), x))
        .fold((0.0, 0.0), |m, e| if e.0 > m.0 { e } else { m })
}

fn same(got: f32, want: f32) -> bool {
    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan())
}

fn check_specials(op: Un, cases: &[(f32, f32)]) {
    let xs: Vec<f32> = cases.iter().map(|c| c.0).collect();
    let ys = apply(op, &xs);
    for (&(x, want), &got) in cases.iter().zip(&ys) {
        assert!(same(got, want), "{}({x}) = {got}, want {want}", op.name());
    }
}

// Measured: 1.01 ulp (1.09 in dense_sweeps).
#[test]
fn exp_is_within_2_ulp() {
    let mut xs = sweep(1e-30, 89.0, 601, true);
    xs.retain(|&x| x > -104.0);
    let (err, at) = max_ulps(Un::Exp, &xs, f64::exp);
    println!("exp: max {err:.3} ulp at {at}");
    assert!(err <= 2.0, "exp: {err} ulp at {at}");
    check_specials(
        Un::Exp,
        &[
            (0.0, 1.0),
            (-0.0, 1.0),
            (f32::INFINITY, f32::INFINITY),
            (f32::NEG_INFINITY, 0.0),
            (f32::NAN, f32::NAN),
            (88.8, f32::INFINITY),
            (1000.0, f32::INFINITY),
            (-1000.0, 0.0),
        ],
    );
    assert!(apply(Un::Exp, &[88.7])[0].is_finite());
}

// Measured: 0.80 ulp, subnormal inputs included (0.83 in dense_sweeps).
#[test]
fn log_is_within_2_ulp() {
    let mut xs = sweep(f32::from_bits(1), f32::MAX, 997, false);
    xs.extend(sweep(0.5, 2.0, 53, false));
    let (err, at) = max_ulps(Un::Log, &xs, f64::ln);
    println!("log: max {err:.3} ulp at {at}");
    assert!(err <= 2.0, "log: {err} ulp at {at}");
    check_specials(
        Un::Log,
        &[
            (1.0, 0.0),
            (0.0, f32::NEG_INFINITY),
            (-0.0, f32::NEG_INFINITY),
            (-1.0, f32::NAN),
            (f32::NEG_INFINITY, f32::NAN),
            (f32::INFINITY, f32::INFINITY),
            (f32::NAN, f32::NAN),
        ],
    );
}

// Measured: 1.58 ulp (1.58 in dense_sweeps).
#[test]
fn tanh_is_within_2_ulp_and_saturates_to_exactly_one() {
    let mut xs = sweep(1e-30, 12.0, 211, true);
    xs.extend(sweep(0.4, 0.7, 7, true));
    let (err, at) = max_ulps(Un::Tanh, &xs, f64::tanh);
    println!("tanh: max {err:.3} ulp at {at}");
    assert!(err <= 2.0, "tanh: {err} ulp at {at}");
    check_specials(
        Un::Tanh,
        &[
            (0.0, 0.0),
            (-0.0, -0.0),
            (9.1, 1.0),
            (-9.1, -1.0),
            (50.0, 1.0),
            (f32::INFINITY, 1.0),
            (f32::NEG_INFINITY, -1.0),
            (f32::NAN, f32::NAN),
        ],
    );
}

// Measured: 1.79e-7 absolute (1.85e-7 in dense_sweeps); erf(x)/x 1.6e-7 relative below 1e-3.
#[test]
fn erf_is_within_3e_7_absolute_and_accurate_near_zero() {
    let xs: Vec<f32> = (-600_000..=600_000).map(|i| i as f32 * 1e-5).collect();
    let ys = apply(Un::Erf, &xs);
    let (err, at) = xs
        .iter()
        .zip(&ys)
        .map(|(&x, &y)| ((y as f64 - libm::erf(x as f64)).abs(), x))
        .fold((0.0, 0.0), |m, e| if e.0 > m.0 { e } else { m });
    println!("erf: max {err:.3e} absolute at {at}");
    assert!(err <= 3e-7, "erf: {err} at {at}");

    let tiny = sweep(1e-30, 1e-3, 1009, true);
    let ys = apply(Un::Erf, &tiny);
    let rel = tiny
        .iter()
        .zip(&ys)
        .map(|(&x, &y)| ((y as f64 / x as f64) / (libm::erf(x as f64) / x as f64) - 1.0).abs())
        .fold(0.0, f64::max);
    println!("erf near 0: erf(x)/x relative {rel:.3e}");
    assert!(rel <= 1e-6, "erf(x)/x: {rel}");
    check_specials(
        Un::Erf,
        &[
            (0.0, 0.0),
            (-0.0, -0.0),
            (4.0, 1.0),
            (-7.0, -1.0),
            (f32::INFINITY, 1.0),
            (f32::NEG_INFINITY, -1.0),
            (f32::NAN, f32::NAN),
        ],
    );
}

// Measured: 1.53 ulp, subnormal results included (1.59 in dense_sweeps).
#[test]
fn sigmoid_is_within_2_ulp() {
    let xs = sweep(1e-30, 103.0, 307, true);
    let (err, at) = max_ulps(Un::Sigmoid, &xs, |x| 1.0 / (1.0 + (-x).exp()));
    println!("sigmoid: max {err:.3} ulp at {at}");
    assert!(err <= 2.0, "sigmoid: {err} ulp at {at}");
    check_specials(
        Un::Sigmoid,
        &[
            (0.0, 0.5),
            (-0.0, 0.5),
            (1e-30, 0.5),
            (-1e-30, 0.5),
            (f32::INFINITY, 1.0),
            (f32::NEG_INFINITY, 0.0),
            (f32::NAN, f32::NAN),
        ],
    );
}

// Measured: 1.48 ulp (1.49 in dense_sweeps).
#[test]
fn rsqrt_is_within_2_ulp() {
    let xs = sweep(f32::from_bits(1), f32::MAX, 1013, false);
    let (err, at) = max_ulps(Un::Rsqrt, &xs, |x| 1.0 / x.sqrt());
    println!("rsqrt: max {err:.3} ulp at {at}");
    assert!(err <= 2.0, "rsqrt: {err} ulp at {at}");
    check_specials(
        Un::Rsqrt,
        &[(0.0, f32::INFINITY), (f32::INFINITY, 0.0), (-1.0, f32::NAN)],
    );
}

#[test]
fn min_and_max_are_exact_and_propagate_nan() {
    let nan = f32::NAN;
    let xs = [1.0, 3.0, -2.0, nan, 1.0, nan, -0.0, 0.0];
    let ys = [2.0, -1.0, -2.0, 1.0, nan, nan, 0.0, -0.0];
    let min = apply2(Bin::Min, &xs, &ys);
    let max = apply2(Bin::Max, &xs, &ys);
    let want_min = [1.0, -1.0, -2.0, nan, nan, nan, -0.0, 0.0];
    let want_max = [2.0, 3.0, -2.0, nan, nan, nan, -0.0, 0.0];
    for i in 0..xs.len() {
        assert!(
            same(min[i], want_min[i]),
            "min({}, {}) = {}",
            xs[i],
            ys[i],
            min[i]
        );
        assert!(
            same(max[i], want_max[i]),
            "max({}, {}) = {}",
            xs[i],
            ys[i],
            max[i]
        );
    }
}

/// `pow(x, c)` for a constant `c`, expanded.
fn pow_const(xs: &[f32], c: f32) -> (Vec<f32>, Graph) {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let e = g.constant(c);
    let y = g.bin(Bin::Pow, x, e);
    let (eg, _) = expand_graph(&g, &[y]);
    (run_one(g, y, &[xs]), eg)
}

#[test]
fn pow_with_small_integral_exponents_multiplies() {
    let xs = [0.5f32, -1.5, 3.0, 0.0, -2.0, 7.25];
    for c in -4..=4 {
        let (ys, g) = pow_const(&xs, c as f32);
        let uses_exp = g
            .nodes()
            .iter()
            .any(|n| matches!(n, Node::Un(Un::Exp2i, _)));
        assert!(!uses_exp, "pow(x, {c}) went through exp");
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = (x as f64).powi(c) as f32;
            assert!(
                ulps(y, want as f64) <= 2.0,
                "pow({x}, {c}) = {y}, want {want}"
            );
        }
    }
    let (ys, _) = pow_const(&[4.0, 2.0], 0.5);
    assert_eq!(ys, vec![2.0, std::f32::consts::SQRT_2]);
    let (ys, _) = pow_const(&[4.0], -0.5);
    assert_eq!(ys, vec![0.5]);
}

// Measured: about 2 ulp for |y log x| < 20.
#[test]
fn general_pow_goes_through_exp_and_log() {
    let xs: Vec<f32> = (1..2000).map(|i| i as f32 * 0.01).collect();
    for c in [1.7f32, -2.5, 0.3, 4.5] {
        let (ys, _) = pow_const(&xs, c);
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = (x as f64).powf(c as f64);
            let bound = 2.0 + 2.0 * ((c as f64) * (x as f64).ln()).abs();
            assert!(ulps(y, want) <= bound, "pow({x}, {c}) = {y}, want {want}");
        }
    }
    let xs = [-2.0f32, 0.0, 0.0];
    let ys = [2.0f32, 1.5, -1.5];
    let got = apply2(Bin::Pow, &xs, &ys);
    assert!(got[0].is_nan());
    assert_eq!(got[1], 0.0);
    assert_eq!(got[2], f32::INFINITY);
}

#[test]
fn expansion_drops_dead_nodes_and_keeps_primitives() {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let _dead = g.un(Un::Tanh, x);
    let s = g.un(Un::Sqrt, x);
    let two = g.constant(2.0);
    let y = g.bin(Bin::Mul, s, two);
    let (e, roots) = expand_graph(&g, &[y]);
    assert_eq!(e.len(), 4);
    assert_eq!(e.node(roots[0]), Node::Bin(Bin::Mul, NodeId(1), NodeId(2)));
    let (again, roots2) = expand_graph(&e, &roots);
    assert_eq!(again, e);
    assert_eq!(roots2, roots);
}

#[test]
fn every_composite_op_expands_to_primitives_only() {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let y = g.load(1, 0);
    let mut roots: Vec<NodeId> = Un::ALL.iter().map(|&op| g.un(op, x)).collect();
    roots.extend(Bin::ALL.iter().map(|&op| g.bin(op, x, y)));
    let (e, _) = expand_graph(&g, &roots);
    for n in e.nodes() {
        match n {
            Node::Un(op, _) => assert!(op.is_primitive(), "{}", op.name()),
            Node::Bin(op, ..) => assert!(op.is_primitive(), "{}", op.name()),
            _ => {}
        }
    }
}

#[test]
fn tanh_coefficients_match_the_known_series() {
    let c = tanh_coefficients(4);
    let want = [1.0, -1.0 / 3.0, 2.0 / 15.0, -17.0 / 315.0];
    for (a, b) in c.iter().zip(want) {
        assert!((a - b).abs() < 1e-15, "{a} vs {b}");
    }
}

/// The ulp bounds on a much denser sweep (every 5th f32 of each range), in chunks:
/// `cargo test --release -p parc-compiler --lib dense_sweeps -- --ignored --nocapture`.
#[test]
#[ignore = "minutes in debug; run in release"]
fn dense_sweeps() {
    let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
    let rsqrt = |x: f64| 1.0 / x.sqrt();
    type Reference<'a> = &'a dyn Fn(f64) -> f64;
    let cases: [(Un, f32, f32, Reference); 6] = [
        (Un::Exp, -103.0, 89.0, &f64::exp),
        (Un::Log, 0.0, f32::MAX, &f64::ln),
        (Un::Tanh, -12.0, 12.0, &f64::tanh),
        (Un::Sigmoid, -103.0, 103.0, &sigmoid),
        (Un::Rsqrt, 0.0, f32::MAX, &rsqrt),
        (Un::Erf, -5.0, 5.0, &libm::erf),
    ];
    for (op, lo, hi, reference) in cases {
        let mut worst = (0.0f64, 0.0f32);
        let mut ranges = vec![(0u32, hi.to_bits())];
        if lo < 0.0 {
            ranges.push(((-0.0f32).to_bits(), lo.to_bits()));
        }
        for (a, b) in ranges {
            let xs: Vec<f32> = (a..=b).step_by(5).map(f32::from_bits).collect();
            for chunk in xs.chunks(1 << 20) {
                let ys = apply(op, chunk);
                for (&x, &y) in chunk.iter().zip(&ys) {
                    let exact = reference(x as f64);
                    let err = match op {
                        Un::Erf => (y as f64 - exact).abs() / 1.5e-7,
                        _ => ulps(y, exact),
                    };
                    if err > worst.0 {
                        worst = (err, x);
                    }
                }
            }
        }
        let unit = if op == Un::Erf {
            "x 1.5e-7 absolute"
        } else {
            "ulp"
        };
        println!("{}: max {:.3} {unit} at {}", op.name(), worst.0, worst.1);
        assert!(worst.0 <= 2.0, "{}: {} at {}", op.name(), worst.0, worst.1);
    }
}

/// The cost of each expansion, in primitive nodes and divisions (a correctly rounded f32
/// division is several instructions on a GPU), bounded so a costlier rewrite is a decision.
#[test]
fn expansions_stay_small() {
    let bounds: [(Un, usize, usize); 6] = [
        (Un::Exp, 21, 0),
        (Un::Log, 37, 1),
        (Un::Tanh, 38, 1),
        (Un::Erf, 45, 1),
        (Un::Sigmoid, 32, 0),
        (Un::Rsqrt, 2, 1),
    ];
    for (op, max_nodes, max_divs) in bounds {
        let mut g = Graph::new();
        let x = g.load(0, 0);
        let y = g.un(op, x);
        let (e, _) = expand_graph(&g, &[y]);
        let ops = e
            .nodes()
            .iter()
            .filter(|n| !matches!(n, Node::Load { .. } | Node::Const(_)))
            .count();
        let divs = e
            .nodes()
            .iter()
            .filter(|n| matches!(n, Node::Bin(Bin::Div, ..)))
            .count();
        println!("{}: {ops} ops, {divs} divisions", op.name());
        assert!(
            ops <= max_nodes && divs <= max_divs,
            "{}: {ops} ops, {divs} divisions",
            op.name()
        );
    }
}

/// The instruction-count proxy of the activations generated kernels compute (primitive nodes
/// of the expanded graph besides loads and constants; divisions and fmas among them), printed:
/// `cargo test -p parc-compiler --lib expansion_costs -- --nocapture`.
#[test]
fn expansion_costs() {
    type Build = fn(&mut Graph, NodeId, NodeId, NodeId) -> Vec<NodeId>;
    let cases: [(&str, Build); 6] = [
        ("exp", |g, x, _, _| vec![g.un(Un::Exp, x)]),
        ("sigmoid", |g, x, _, _| vec![g.un(Un::Sigmoid, x)]),
        ("silu", |g, x, _, _| {
            let s = g.un(Un::Sigmoid, x);
            vec![g.bin(Bin::Mul, x, s)]
        }),
        ("swiglu", |g, x, u, _| {
            let s = g.un(Un::Sigmoid, x);
            let silu = g.bin(Bin::Mul, x, s);
            vec![g.bin(Bin::Mul, silu, u)]
        }),
        ("swiglu_bwd", |g, x, u, dy| {
            let s = g.un(Un::Sigmoid, x);
            let one = g.constant(1.0);
            let oms = g.bin(Bin::Sub, one, s);
            let goms = g.bin(Bin::Mul, x, oms);
            let inner = g.bin(Bin::Add, one, goms);
            let ds = g.bin(Bin::Mul, s, inner);
            let dyu = g.bin(Bin::Mul, dy, u);
            let dgate = g.bin(Bin::Mul, dyu, ds);
            let gs = g.bin(Bin::Mul, x, s);
            vec![dgate, g.bin(Bin::Mul, dy, gs)]
        }),
        ("gelu", |g, x, _, _| {
            let c = g.constant(std::f32::consts::FRAC_1_SQRT_2);
            let xs = g.bin(Bin::Mul, x, c);
            let erf = g.un(Un::Erf, xs);
            let one = g.constant(1.0);
            let e1 = g.bin(Bin::Add, one, erf);
            let half = g.constant(0.5);
            let hx = g.bin(Bin::Mul, half, x);
            vec![g.bin(Bin::Mul, hx, e1)]
        }),
    ];
    for (name, build) in cases {
        let mut g = Graph::new();
        let (x, u, dy) = (g.load(0, 0), g.load(1, 0), g.load(2, 0));
        let roots = build(&mut g, x, u, dy);
        let (e, _) = expand_graph(&g, &roots);
        let count = |f: &dyn Fn(&Node) -> bool| e.nodes().iter().filter(|n| f(n)).count();
        let ops = count(&|n| !matches!(n, Node::Load { .. } | Node::Const(_)));
        let divs = count(&|n| matches!(n, Node::Bin(Bin::Div, ..)));
        let fmas = count(&|n| matches!(n, Node::Fma(..)));
        println!("{name}: {ops} ops ({divs} divisions, {fmas} fma)");
    }
}

/// exp's one-sided scaling (`B::scale`: `er · 2^(k ± 64)` from the rounding constant's bits,
/// then `· 2^∓64`) gives the bits of the two-step one (`er · 2^⌊k/2⌋ · 2^(k - ⌊k/2⌋)`) for
/// every `k` its ranges allow and a sweep of `er` over `e^r`'s range (|r| ≤ ln 2 / 2, with
/// margin); a NaN `k` (from a NaN argument, so `er` is NaN too) gives NaN.
#[test]
fn one_sided_exp_scaling_matches_the_two_step_bits() {
    use crate::kir::prim;
    let mul = |a: f32, b: f32| prim::bin(Bin::Mul, a, b);
    let exp2i = |k: f32| prim::un(Un::Exp2i, k);
    let two_step = |er: f32, k: f32| {
        let k1 = prim::un(Un::Floor, mul(k, 0.5));
        let k2 = prim::bin(Bin::Sub, k, k1);
        mul(mul(er, exp2i(k1)), exp2i(k2))
    };
    let one_sided = |er: f32, k: f32, offset: f32| {
        let t = ROUND_MAGIC + EXP_BIAS + offset + k;
        let s = prim::un(Un::Exp2Bits, t);
        mul(mul(er, s), (-offset).exp2())
    };
    let ers: Vec<f32> = (0.69f32.to_bits()..=1.43f32.to_bits())
        .step_by(997)
        .map(f32::from_bits)
        .collect();
    for (range, lo, hi) in [(Range::NonPositive, -151, 0), (Range::NonNegative, 0, 128)] {
        let offset = scale_offset(range).unwrap();
        assert!(one_sided(f32::NAN, f32::NAN, offset).is_nan());
        for k in (lo..=hi).map(|k| k as f32) {
            for &er in &ers {
                let (want, got) = (two_step(er, k), one_sided(er, k, offset));
                assert!(same(got, want), "er {er:e}, k {k}: {got:e}, want {want:e}");
            }
        }
    }
}

/// exp's `k`: `x · log2 e` plus the rounding constant (and a bias), rounded once, less the
/// constant again, is `x · log2 e` rounded to the nearest integer (ties to even), over the
/// clamped argument range.
#[test]
fn the_rounding_constant_rounds_to_the_nearest_integer() {
    use crate::kir::prim;
    let log2e = std::f32::consts::LOG2_E;
    let xs = sweep(1e-30, 105.0, 4099, true);
    for bias in [0.0, EXP_BIAS + SCALE_OFFSET, EXP_BIAS - SCALE_OFFSET] {
        let magic = ROUND_MAGIC + bias;
        for &x in xs
            .iter()
            .filter(|x| (EXP_MIN_ARG..=EXP_MAX_ARG).contains(*x))
        {
            let t = prim::fma(x, log2e, magic);
            let k = prim::bin(Bin::Sub, t, magic);
            let want = (x as f64 * log2e as f64).round_ties_even();
            assert_eq!(k as f64, want, "x {x}, bias {bias}");
        }
    }
}

/// exp's polynomial (Chebyshev interpolation, in f64) is within its bound of `e^r` on
/// [-ln2/2, ln2/2], and starts `1 + r`.
#[test]
fn exp_polynomial_is_within_its_bound() {
    let h = std::f64::consts::LN_2 / 2.0;
    let c = exp_coefficients(EXP_DEGREE, h);
    assert_eq!(c.len(), EXP_DEGREE + 1);
    assert!(
        (c[0] - 1.0).abs() < 1e-8 && (c[1] - 1.0).abs() < 1e-7,
        "{c:?}"
    );
    let bound = 2.0 * (h / 2.0).powi(7) / 5040.0 * h.exp();
    let worst = (0..=10_000)
        .map(|i| -h + 2.0 * h * i as f64 / 10_000.0)
        .map(|r| {
            let p = c.iter().rev().fold(0.0, |acc, &ci| acc * r + ci);
            ((p - r.exp()) / r.exp()).abs()
        })
        .fold(0.0, f64::max);
    println!("exp polynomial: relative error {worst:.3e}, bound {bound:.3e}");
    assert!(worst <= bound && worst < 3e-9, "{worst}");
}

/// The reciprocal's first guesses are the known best ones (the line `24/17 - 8/17 d`) and
/// their relative error is `1/|T(-3)|`: 1/17 for the line, 1/99 for the parabola.
#[test]
fn reciprocal_guesses_have_the_least_relative_error() {
    let line = reciprocal_guess_coefficients(1);
    assert!((line[0] - 24.0 / 17.0).abs() < 1e-15 && (line[1] + 8.0 / 17.0).abs() < 1e-15);
    for (degree, error) in [(1, 1.0 / 17.0), (2, 1.0 / 99.0)] {
        let c = reciprocal_guess_coefficients(degree);
        let worst = (0..=10_000)
            .map(|i| 1.0 + i as f64 / 10_000.0)
            .map(|d| (1.0 - d * c.iter().rev().fold(0.0, |acc, &ci| acc * d + ci)).abs())
            .fold(0.0, f64::max);
        assert!((worst - error).abs() < 1e-12, "degree {degree}: {worst}");
    }
}

/// sigmoid's reciprocal, in f32 as expanded: within 1.1e-4 of `1 / d` on [1, 2] and never below
/// 1/2 (so `n - q` is exact), exactly 1/2 at 2; NaN stays NaN.
#[test]
fn sigmoids_reciprocal_is_close_and_at_least_one_half() {
    let mut g = Graph::new();
    let d = g.load(0, 0);
    let inv = B { g: &mut g }.reciprocal_1_2(d);
    let mut ds: Vec<f32> = (1.0f32.to_bits()..=2.0f32.to_bits())
        .step_by(7)
        .map(f32::from_bits)
        .collect();
    ds.extend([2.0, f32::NAN]);
    let ys = run_one(g, inv, &[&ds]);
    let mut worst = 0.0f64;
    for (&d, &y) in ds.iter().zip(&ys).filter(|(d, _)| !d.is_nan()) {
        assert!((0.5..=1.0).contains(&y), "1/{d}: {y}");
        worst = worst.max((y as f64 * d as f64 - 1.0).abs());
    }
    println!("sigmoid's reciprocal: relative error {worst:.3e}");
    assert!(worst <= 1.1e-4, "{worst}");
    assert_eq!(ys[ys.len() - 2], 0.5);
    assert!(ys[ys.len() - 1].is_nan());
}
