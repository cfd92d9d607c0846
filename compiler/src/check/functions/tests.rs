use super::*;
use crate::diag::FileId;
use crate::kir::Node;
use crate::syntax::ast::Item;
use crate::syntax::parse_file;

/// The prelude's functions, checked (with no diagnostics).
fn prelude() -> FnTable {
    let (_, text) = crate::stdlib::PRELUDE;
    let (checked, diags) = check_text(text, &FnTable::new());
    assert!(diags.is_empty(), "{:?}", diags.items);
    assert!(checked.broken.is_empty());
    checked.fns
}

fn check_text(text: &str, prelude: &FnTable) -> (Checked, Diagnostics) {
    let file = parse_file(FileId(0), text).unwrap();
    let defs: Vec<&FnDef> = file
        .items
        .iter()
        .filter_map(|i| match i {
            Item::Fn(f) => Some(f),
            _ => None,
        })
        .collect();
    let mut diags = Diagnostics::default();
    let consts = HashMap::from([(
        "alpha".to_string(),
        Number::float(1.5, super::super::number::Unit::None, Span::default()),
    )]);
    let checked = check_module(&defs, &consts, prelude, &mut diags);
    (checked, diags)
}

/// The codes reported for `text` (with the prelude in scope), in order.
fn codes(text: &str) -> Vec<&'static str> {
    let (_, diags) = check_text(text, &prelude());
    diags.items.iter().map(|d| d.code).collect()
}

#[test]
fn a_body_becomes_one_graph_with_calls_inlined() {
    let (checked, diags) = check_text(
        "fn sq(x) = x * x\nfn f(x, y) = sq(x + y) - alpha * select(x > 0, x, -x)",
        &prelude(),
    );
    assert!(diags.is_empty(), "{:?}", diags.items);
    let f = &checked.fns["f"];
    assert_eq!(f.params, ["x", "y"]);
    assert_eq!(
        f.to_text(),
        "f(x, y) = ((x + y) * (x + y)) - (1.5 * select(x > 0, x, -x))"
    );
    // `x + y` is built once and shared (hash-consing through the inlined call).
    let adds = f.graph.nodes().iter();
    let adds = adds.filter(|n| matches!(n, Node::Bin(Bin::Add, ..)));
    assert_eq!(adds.count(), 1);
}

#[test]
fn builtins_map_to_kernel_ops_by_name() {
    let (checked, diags) = check_text(
        "fn f(x) = exp(x) + log(x) + tanh(x) + erf(x) + sigmoid(x) + sqrt(x) + rsqrt(x) + abs(x) + floor(x) + pow(x, 2) + min(x, 1) + max(x, 0)",
        &FnTable::new(),
    );
    assert!(diags.is_empty(), "{:?}", diags.items);
    let g = &checked.fns["f"].graph;
    let uns: Vec<Un> = g
        .nodes()
        .iter()
        .filter_map(|n| match n {
            Node::Un(op, _) => Some(*op),
            _ => None,
        })
        .collect();
    for name in [
        "exp", "log", "tanh", "erf", "sigmoid", "sqrt", "rsqrt", "abs", "floor",
    ] {
        assert!(uns.iter().any(|u| u.name() == name), "{name}");
    }
    for op in [Bin::Pow, Bin::Min, Bin::Max] {
        assert!(g
            .nodes()
            .iter()
            .any(|n| matches!(n, Node::Bin(o, ..) if *o == op)));
    }
}

#[test]
fn each_mistake_is_a_diagnostic() {
    assert_eq!(codes("fn f(x) = relux(x)"), ["E0220"]);
    assert_eq!(codes("fn f(x) = x * beta"), ["E0220"]);
    assert_eq!(codes("fn f(x) = exp"), ["E0220", "W0220"]);
    assert_eq!(codes("fn f(x) = exp(x, x)"), ["E0221"]);
    assert_eq!(codes("fn g(a, b) = a * b\nfn f(x) = g(x)"), ["E0221"]);
    assert_eq!(codes("fn f(x) = f(x) + 1"), ["E0222"]);
    assert_eq!(codes("fn f(x) = (x > 0) + 1"), ["E0223"]);
    assert_eq!(codes("fn f(x) = x > 0"), ["E0223"]);
    assert_eq!(codes("fn f(x) = select(x, 1, 0)"), ["E0223"]);
    assert_eq!(codes("fn f(x) = relu(x > 0)"), ["E0223"]);
    assert_eq!(codes("fn f(x) = x\nfn f(y) = y"), ["E0225"]);
    assert_eq!(codes("fn silu(x) = x"), ["E0225"]);
    assert_eq!(codes("fn select(x) = x"), ["E0225"]);
    assert_eq!(codes("fn glu(x) = x"), ["E0225"]);
    assert_eq!(codes("fn f(x, x) = x"), ["E0225"]);
    assert_eq!(codes("fn f(x) = x * \"a\""), ["E0227"]);
    assert_eq!(codes("fn f(x) = max(x, b = 1)"), ["E0227"]);
    assert_eq!(codes("fn f(x) = 2 GB"), ["E0227", "W0220"]);
    assert_eq!(codes("fn f(x) = x * 1e39"), ["E0903"]);
    assert_eq!(codes("fn f(x, y) = x"), ["W0220"]);
}

#[test]
fn a_cycle_is_named_and_reported_once() {
    let (checked, diags) = check_text(
        "fn a(x) = b(x)\nfn b(x) = c(x) * 2\nfn c(x) = a(x) + 1\nfn d(x) = a(x)",
        &prelude(),
    );
    let messages: Vec<&str> = diags.items.iter().map(|d| d.message.as_str()).collect();
    assert_eq!(messages, ["recursive function definition: a → b → c → a"]);
    let mut broken = checked.broken.clone();
    broken.sort();
    assert_eq!(broken, ["a", "b", "c", "d"]);
}

#[test]
fn exponential_inlining_is_refused_not_run() {
    let mut text = String::from("fn f0(x) = x * 2\n");
    for i in 1..40 {
        text.push_str(&format!(
            "fn f{i}(x) = f{p}(x * 2) + f{p}(x * 3)\n",
            p = i - 1
        ));
    }
    let (_, diags) = check_text(&text, &FnTable::new());
    assert!(
        diags.items.iter().any(|d| d.code == "E0227"),
        "{:?}",
        diags.items
    );
}

#[test]
fn deep_call_chains_stop_with_a_diagnostic() {
    // Defined callers first, so that building the first one walks the whole chain.
    let mut text = String::new();
    for i in (1..200).rev() {
        text.push_str(&format!("fn f{i}(x) = f{}(x) + 1\n", i - 1));
    }
    text.push_str("fn f0(x) = x\n");
    let (_, diags) = check_text(&text, &FnTable::new());
    assert!(
        diags.items.iter().any(|d| d.code == "E0222"),
        "{:?}",
        diags.items
    );
}

#[test]
fn glu_gates_a_function() {
    let p = prelude();
    let g = glu(&p["gelu"]);
    assert_eq!(g.name, "glu(gelu)");
    assert_eq!(g.params, ["gate", "up"]);
    assert_eq!(
        g.to_text(),
        p["geglu"].to_text().replace("geglu", "glu(gelu)")
    );
}

#[test]
fn activations_take_one_or_two_parameters_and_need_a_derivative() {
    let p = prelude();
    for name in [
        "gelu",
        "gelu_tanh",
        "relu",
        "silu",
        "squared_relu",
        "geglu",
        "swiglu",
    ] {
        assert!(activation(&p[name], Span::default()).is_ok(), "{name}");
    }
    let (checked, _) = check_text("fn three(a, b, c) = a * b * c\nfn stairs(x) = floor(x)", &p);
    let err = |name: &str| {
        activation(&checked.fns[name], Span::default())
            .unwrap_err()
            .code
    };
    assert_eq!(err("three"), "E0228");
    assert_eq!(err("stairs"), "E0224");
}

/// The hand-written twins' formulas (runtime/src/cpu/elementwise.rs), in f64 with their f32
/// constants.
fn twin(name: &str, x: f64, up: f64) -> f64 {
    let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
    let inv_sqrt_2 = std::f32::consts::FRAC_1_SQRT_2 as f64;
    let (k, cubic) = (0.797_884_6f32 as f64, 0.044_715f32 as f64);
    match name {
        "gelu" => 0.5 * x * (1.0 + libm::erf(x * inv_sqrt_2)),
        "gelu_tanh" => x * sigmoid(2.0 * k * (x + cubic * x * x * x)),
        "relu" => x.max(0.0),
        "silu" => x * sigmoid(x),
        "swiglu" => x * sigmoid(x) * up,
        _ => panic!("{name} has no hand-written twin"),
    }
}

#[test]
fn prelude_functions_compute_their_hand_written_twins() {
    let p = prelude();
    for name in ["gelu", "gelu_tanh", "relu", "silu", "swiglu"] {
        let f = &p[name];
        for i in -800..=800 {
            let x = i as f64 / 100.0 + 0.003;
            let up = 1.0 + (i % 7) as f64 / 4.0;
            let args: Vec<f64> = [x, up][..f.params.len()].to_vec();
            let got = crate::kir::eval::eval_f64(&f.graph, f.body, &args);
            let want = twin(name, x, up);
            let tol = 1e-6 * want.abs().max(1e-9);
            assert!(
                (got - want).abs() <= tol,
                "{name}({x}) = {got}, twin {want}"
            );
        }
    }
}
