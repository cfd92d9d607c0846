//! Derived gradients against central finite differences (f64), node sharing, errors, and
//! derivatives of kernel-style graphs run through `expand` and `eval::run`.
use super::*;
use crate::kir::eval::{eval_f64, run};
use crate::kir::expand::expand;
use crate::kir::{Access, Kernel, Store};

/// A function of parameters built into a graph.
type Build = fn(&mut Graph, &[NodeId]) -> NodeId;

/// Checks every partial of `f` at every point against central differences.
fn check(name: &str, arity: usize, f: Build, points: &[Vec<f64>]) {
    let mut g = Graph::new();
    let params: Vec<NodeId> = (0..arity as u32).map(|i| g.param(i)).collect();
    let root = f(&mut g, &params);
    let one = g.constant(1.0);
    let grads = gradients(&mut g, root, &params, one).unwrap();
    let mut worst = 0.0f64;
    for p in points {
        for (i, &d) in grads.iter().enumerate() {
            let h = 1e-6 * p[i].abs().max(1.0);
            let mut hi = p.clone();
            hi[i] += h;
            let mut lo = p.clone();
            lo[i] -= h;
            let fd = (eval_f64(&g, root, &hi) - eval_f64(&g, root, &lo)) / (2.0 * h);
            let got = eval_f64(&g, d, p);
            let err = (got - fd).abs() / fd.abs().max(1.0);
            worst = worst.max(err);
            assert!(
                err < 1e-6,
                "{name}: d/dp{i} at {p:?} = {got}, finite differences {fd}"
            );
        }
    }
    println!(
        "{name}: worst relative error {worst:.2e} over {} points",
        points.len()
    );
}

fn grid(lo: f64, hi: f64, n: usize) -> Vec<Vec<f64>> {
    (0..n)
        .map(|i| vec![lo + (hi - lo) * (i as f64 + 0.37) / n as f64])
        .collect()
}

fn grid2(lo: f64, hi: f64, n: usize) -> Vec<Vec<f64>> {
    let xs = grid(lo, hi, n);
    let mut out = Vec::new();
    for (i, a) in xs.iter().enumerate() {
        for b in xs.iter().skip(i % 3).step_by(3) {
            out.push(vec![a[0], b[0] * 0.9 + 0.05]);
        }
    }
    out
}

fn un(op: Un) -> impl Fn(&mut Graph, &[NodeId]) -> NodeId {
    move |g, p| g.un(op, p[0])
}

#[test]
fn every_unary_op_matches_finite_differences() {
    let cases: [(Un, f64, f64); 10] = [
        (Un::Neg, -3.0, 3.0),
        (Un::Abs, -3.0, 3.0),
        (Un::Sqrt, 0.1, 9.0),
        (Un::Exp, -8.0, 8.0),
        (Un::Log, 0.05, 20.0),
        (Un::Tanh, -5.0, 5.0),
        (Un::Erf, -4.0, 4.0),
        (Un::Sigmoid, -10.0, 10.0),
        (Un::Rsqrt, 0.1, 9.0),
        (Un::Exp, -1.0, 1.0),
    ];
    for (op, lo, hi) in cases {
        let mut g = Graph::new();
        let x = g.param(0);
        let root = un(op)(&mut g, &[x]);
        let one = g.constant(1.0);
        let d = gradients(&mut g, root, &[x], one).unwrap()[0];
        for p in grid(lo, hi, 97) {
            let h = 1e-6 * p[0].abs().max(1.0);
            let fd =
                (eval_f64(&g, root, &[p[0] + h]) - eval_f64(&g, root, &[p[0] - h])) / (2.0 * h);
            let got = eval_f64(&g, d, &p);
            assert!(
                (got - fd).abs() <= 1e-6 * fd.abs().max(1.0),
                "{}'({}) = {got}, finite differences {fd}",
                op.name(),
                p[0]
            );
        }
    }
}

#[test]
fn every_binary_op_matches_finite_differences() {
    let pts = grid2(0.1, 3.0, 40);
    check("add", 2, |g, p| g.bin(Bin::Add, p[0], p[1]), &pts);
    check("sub", 2, |g, p| g.bin(Bin::Sub, p[0], p[1]), &pts);
    check("mul", 2, |g, p| g.bin(Bin::Mul, p[0], p[1]), &pts);
    check("div", 2, |g, p| g.bin(Bin::Div, p[0], p[1]), &pts);
    check("min", 2, |g, p| g.bin(Bin::Min, p[0], p[1]), &pts);
    check("max", 2, |g, p| g.bin(Bin::Max, p[0], p[1]), &pts);
    check("pow", 2, |g, p| g.bin(Bin::Pow, p[0], p[1]), &pts);
    let pts3: Vec<Vec<f64>> = pts.iter().map(|p| vec![p[0], p[1], p[0] - p[1]]).collect();
    check("fma", 3, |g, p| g.fma(p[0], p[1], p[2]), &pts3);
    check("fma(x, x, y)", 2, |g, p| g.fma(p[0], p[0], p[1]), &pts);
    let xs = grid(0.2, 3.0, 50);
    for c in [-2.0f32, -0.5, 0.5, 1.0, 1.5, 2.0, 3.0, 2.7] {
        let mut g = Graph::new();
        let x = g.param(0);
        let k = g.constant(c);
        let root = g.bin(Bin::Pow, x, k);
        let one = g.constant(1.0);
        let d = gradients(&mut g, root, &[x], one).unwrap()[0];
        for p in &xs {
            let want = c as f64 * p[0].powf(c as f64 - 1.0);
            let got = eval_f64(&g, d, p);
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                "pow(x, {c})' at {p:?}"
            );
        }
    }
}

#[test]
fn selects_pass_the_adjoint_to_the_taken_arm() {
    let pts = grid2(-2.0, 2.0, 40);
    // select(x > y, x * y, exp(y)): both arms and the condition depend on the variables.
    check(
        "select",
        2,
        |g, p| {
            let c = g.cmp(Cmp::Gt, p[0], p[1]);
            let a = g.bin(Bin::Mul, p[0], p[1]);
            let b = g.un(Un::Exp, p[1]);
            g.select(c, a, b)
        },
        &pts,
    );
}

fn silu(g: &mut Graph, x: NodeId) -> NodeId {
    let s = g.un(Un::Sigmoid, x);
    g.bin(Bin::Mul, x, s)
}

fn softplus(g: &mut Graph, x: NodeId) -> NodeId {
    let e = g.un(Un::Exp, x);
    let one = g.constant(1.0);
    let e1 = g.bin(Bin::Add, one, e);
    g.un(Un::Log, e1)
}

#[test]
fn activations_match_finite_differences() {
    let pts = grid(-6.0, 6.0, 301);
    check(
        "gelu (erf)",
        1,
        |g, p| {
            let k = g.constant(std::f32::consts::FRAC_1_SQRT_2);
            let xs = g.bin(Bin::Mul, p[0], k);
            let e = g.un(Un::Erf, xs);
            let one = g.constant(1.0);
            let e1 = g.bin(Bin::Add, one, e);
            let half = g.constant(0.5);
            let hx = g.bin(Bin::Mul, half, p[0]);
            g.bin(Bin::Mul, hx, e1)
        },
        &pts,
    );
    check(
        "gelu (tanh)",
        1,
        |g, p| {
            let three = g.constant(3.0);
            let x3 = g.bin(Bin::Pow, p[0], three);
            let c = g.constant(0.044_715);
            let cx3 = g.bin(Bin::Mul, c, x3);
            let inner = g.bin(Bin::Add, p[0], cx3);
            let k = g.constant((2.0 / std::f32::consts::PI).sqrt());
            let arg = g.bin(Bin::Mul, k, inner);
            let t = g.un(Un::Tanh, arg);
            let one = g.constant(1.0);
            let t1 = g.bin(Bin::Add, one, t);
            let half = g.constant(0.5);
            let hx = g.bin(Bin::Mul, half, p[0]);
            g.bin(Bin::Mul, hx, t1)
        },
        &pts,
    );
    check("silu", 1, |g, p| silu(g, p[0]), &pts);
    check(
        "squared relu",
        1,
        |g, p| {
            let zero = g.constant(0.0);
            let r = g.bin(Bin::Max, p[0], zero);
            let two = g.constant(2.0);
            g.bin(Bin::Pow, r, two)
        },
        &pts,
    );
    check("softplus", 1, |g, p| softplus(g, p[0]), &pts);
    check(
        "mish",
        1,
        |g, p| {
            let sp = softplus(g, p[0]);
            let t = g.un(Un::Tanh, sp);
            g.bin(Bin::Mul, p[0], t)
        },
        &pts,
    );
    check(
        "swiglu (gated product)",
        2,
        |g, p| {
            let s = silu(g, p[0]);
            g.bin(Bin::Mul, s, p[1])
        },
        &grid2(-5.0, 5.0, 60),
    );
}

#[test]
fn the_derivative_of_silu_shares_the_sigmoid() {
    let mut g = Graph::new();
    let x = g.param(0);
    let root = silu(&mut g, x);
    let sigmoid = NodeId(1);
    let before = g.len();
    let one = g.constant(1.0);
    let d = gradients(&mut g, root, &[x], one).unwrap()[0];
    let added = g.len() - before;
    // s + x · (s · (1 - s)): the constant 1, 1 - s, s (1 - s), x s (1 - s), the sum.
    assert!(added <= 5, "silu' added {added} nodes: {:?}", g);
    let sigmoids = g
        .nodes()
        .iter()
        .filter(|n| matches!(n, Node::Un(Un::Sigmoid, _)))
        .count();
    assert_eq!(sigmoids, 1);
    assert!(g.nodes()[before..]
        .iter()
        .any(|n| n.operands().any(|o| o == sigmoid)));
    assert!((eval_f64(&g, d, &[0.0]) - 0.5).abs() < 1e-12);
}

#[test]
fn non_differentiable_ops_on_a_path_to_a_variable_are_errors() {
    for op in [
        Un::Floor,
        Un::Exp2i,
        Un::Exp2Bits,
        Un::Exponent,
        Un::Mantissa,
    ] {
        let mut g = Graph::new();
        let x = g.param(0);
        let f = g.un(op, x);
        let root = g.bin(Bin::Mul, f, x);
        let one = g.constant(1.0);
        let err = gradients(&mut g, root, &[x], one).unwrap_err();
        assert_eq!(err.op, op.name());
        assert_eq!(err.node, f);
        assert!(err.to_string().contains(op.name()), "{err}");
    }
    // Off the path to the variable, floor is fine: d/dx (x · floor(y)) = floor(y).
    let mut g = Graph::new();
    let x = g.param(0);
    let y = g.param(1);
    let f = g.un(Un::Floor, y);
    let root = g.bin(Bin::Mul, x, f);
    let one = g.constant(1.0);
    let d = gradients(&mut g, root, &[x], one).unwrap();
    assert_eq!(d, vec![f]);
    // A comparison has no gradient.
    let c = g.cmp(Cmp::Lt, x, y);
    let err = gradients(&mut g, c, &[x], one).unwrap_err();
    assert!(err.to_string().contains("comparison"), "{err}");
}

#[test]
fn a_variable_the_root_does_not_read_has_a_zero_gradient() {
    let mut g = Graph::new();
    let x = g.param(0);
    let y = g.param(1);
    let root = g.un(Un::Exp, x);
    let one = g.constant(1.0);
    let d = gradients(&mut g, root, &[x, y], one).unwrap();
    assert_eq!(d[0], root);
    assert_eq!(g.node(d[1]).constant(), Some(0.0));
}

/// `y = op(x)` backward as a kernel: wrt the load of x, seed a load of dy; returns dx computed
/// by `eval::run` and the f64 value of the derived graph.
fn backward_kernel(g: Graph, root: NodeId, x: NodeId, cols: u64) -> (Kernel, NodeId, Graph) {
    let mut g = g;
    let dy = g.load(1, 0);
    let dx = gradients(&mut g, root, &[x], dy).unwrap()[0];
    let k = Kernel {
        cols,
        inputs: vec![Access::Elem { width: cols }; 2],
        outputs: vec![Access::Elem { width: cols }],
        graph: g.clone(),
        stores: vec![Store {
            output: 0,
            col_offset: 0,
            value: dx,
        }],
    };
    (k, dx, g)
}

#[test]
fn a_kernel_graph_derived_wrt_its_loads_runs_as_a_kernel() {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let k = g.constant(std::f32::consts::FRAC_1_SQRT_2);
    let xs = g.bin(Bin::Mul, x, k);
    let e = g.un(Un::Erf, xs);
    let one = g.constant(1.0);
    let e1 = g.bin(Bin::Add, one, e);
    let hx = g.bin(Bin::Mul, x, e1);
    let half = g.constant(0.5);
    let root = g.bin(Bin::Mul, hx, half);
    let cols = 512u64;
    let (kernel, dx, g) = backward_kernel(g, root, x, cols);
    assert_eq!(kernel.validate(), Ok(()));
    let xs: Vec<f32> = (0..cols).map(|i| i as f32 / 40.0 - 6.0).collect();
    let dys: Vec<f32> = (0..cols).map(|i| 1.0 + (i % 5) as f32 * 0.25).collect();
    let mut out = vec![0.0f32; cols as usize];
    run(&expand(&kernel), 0, 1, &[&xs, &dys], &mut [&mut out]).unwrap();
    for i in 0..cols as usize {
        let want = eval_f64(&g, dx, &[xs[i] as f64, dys[i] as f64]);
        assert!(
            (out[i] as f64 - want).abs() <= 2e-6 * want.abs().max(1.0),
            "gelu' at {}: {} vs {want}",
            xs[i],
            out[i]
        );
    }
}

#[test]
fn a_row_value_collects_its_gradient_with_one_row_sum() {
    // RMSNorm: y = x · rsqrt(row_sum(x²) / n + eps).
    let cols = 300usize;
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let x2 = g.bin(Bin::Mul, x, x);
    let ss = g.row_sum(x2);
    let inv_n = g.constant(1.0 / cols as f32);
    let ms = g.bin(Bin::Mul, ss, inv_n);
    let eps = g.constant(1e-5);
    let mse = g.bin(Bin::Add, ms, eps);
    let r = g.un(Un::Rsqrt, mse);
    let root = g.bin(Bin::Mul, x, r);
    let before = g.len();
    let (kernel, _, g) = backward_kernel(g, root, x, cols as u64);
    let sums = g.nodes()[before..]
        .iter()
        .filter(|n| matches!(n, Node::RowSum(_)))
        .count();
    assert_eq!(sums, 1, "one row sum for the gradient of the row value");
    assert_eq!(kernel.validate(), Ok(()));

    let xs: Vec<f32> = (0..cols).map(|i| ((i as f32) * 0.37).sin() * 2.0).collect();
    let dys: Vec<f32> = (0..cols).map(|i| ((i as f32) * 0.11).cos()).collect();
    let mut out = vec![0.0f32; cols];
    run(&expand(&kernel), 0, 1, &[&xs, &dys], &mut [&mut out]).unwrap();
    // L = Σ dy_j y_j(x), by central differences in f64.
    let loss = |x: &[f64]| {
        let ms: f64 = x.iter().map(|v| v * v).sum::<f64>() / cols as f64;
        let r = 1.0 / (ms + 1e-5).sqrt();
        x.iter()
            .zip(&dys)
            .map(|(v, &d)| v * r * d as f64)
            .sum::<f64>()
    };
    let x64: Vec<f64> = xs.iter().map(|&v| v as f64).collect();
    for i in (0..cols).step_by(7) {
        let h = 1e-6;
        let mut hi = x64.clone();
        hi[i] += h;
        let mut lo = x64.clone();
        lo[i] -= h;
        let fd = (loss(&hi) - loss(&lo)) / (2.0 * h);
        assert!(
            (out[i] as f64 - fd).abs() <= 1e-4 * fd.abs().max(1.0),
            "dx[{i}] = {} vs {fd}",
            out[i]
        );
    }
}
