use super::*;
use crate::driver::{compile, CompileOptions, Stage};
use crate::ir::op::Op;
use crate::spec::{Activation, LayerKind};

/// A two-layer model whose MLPs use `act`, under `tp`, with `fns` defined in the file.
fn spec_text(fns: &str, act: &str, tp: u32) -> String {
    format!(
        "{fns}
model m {{
  let vocab = 64; let d = 32; let seq = 16
  input tokens  : [batch, seq] i32
  input targets : [batch, seq] i32
  x = Embedding(vocab, d)(tokens) + PositionEmbedding(seq, d)
  x = repeat 2 {{ x + MLP(d, 4 * d, act = {act})(LayerNorm(d)(x)) }}
  logits = Linear(d, vocab, bias = false, tied = Embedding)(LayerNorm(d)(x) as ln_f) as head
  loss = CrossEntropy(logits, targets)
  shard Embedding.vocab on tp
  shard Attention.heads on tp
  shard MLP.hidden on tp
}}
parallel {{ mesh = {{ dp: 1, pp: 1, cp: 1, tp: {tp} }} }}
train {{ global_batch = 4; micro_batch = 2; steps = 2 }}
cluster {{ nodes = 1; gpus_per_node = {tp}; gpu = cpu }}
"
    )
}

/// The fused ops (name, kernel) of every program of the verified plan of `text`.
fn fused_ops(text: String) -> Vec<(String, Arc<Kernel>)> {
    let c = compile("t.par", text, &[], &CompileOptions::through(Stage::Verify));
    assert!(!c.diagnostics.has_errors(), "{:?}", c.diagnostics.items);
    assert!(c.analysis.verified.is_some(), "the plan verifies");
    let plan = c.plan.expect("a plan");
    let mut out = Vec::new();
    for p in &plan.programs {
        for (_, comp) in p.computes() {
            if let Op::Fused(a) = comp.op {
                out.push((a.name.clone(), a.kernel.clone()));
            }
        }
    }
    out
}

/// The prelude's function `name` (also those whose names lower to hand-written ops).
fn prelude_fn(name: &str) -> Arc<ExprFn> {
    let (_, text) = crate::stdlib::PRELUDE;
    let file = crate::syntax::parse_file(crate::diag::FileId(0), text).unwrap();
    let defs: Vec<&crate::syntax::ast::FnDef> = file
        .items
        .iter()
        .filter_map(|i| match i {
            crate::syntax::ast::Item::Fn(f) => Some(f),
            _ => None,
        })
        .collect();
    let mut diags = crate::diag::Diagnostics::default();
    let (consts, prelude) = (Default::default(), Default::default());
    let checked = crate::check::functions::check_module(&defs, &consts, &prelude, &mut diags);
    checked.fns[name].clone()
}

/// The activation `act` of a model whose file defines `fns`, checked.
fn user_fn(fns: &str, act: &str) -> Arc<ExprFn> {
    let c = compile(
        "t.par",
        spec_text(fns, act, 1),
        &[],
        &CompileOptions::through(Stage::Check),
    );
    let spec = c.spec.expect("a spec");
    let act = spec.model.nodes.iter().find_map(|n| match &n.kind {
        LayerKind::Mlp {
            act: Activation::Fn(f),
            ..
        } => Some(f.clone()),
        _ => None,
    });
    act.expect("an MLP with a function activation")
}

#[test]
fn a_plain_activation_kernel_reads_x_and_writes_f_of_x() {
    let f = prelude_fn("squared_relu");
    let a = forward(&f, 128).unwrap();
    assert_eq!(a.name, "act squared_relu");
    assert_eq!(a.rows, None);
    let k = &a.kernel;
    assert_eq!(k.inputs, [Access::Elem { width: 128 }]);
    assert_eq!(k.outputs, [Access::Elem { width: 128 }]);
    assert_eq!(
        k.to_string(),
        "y0 = select(x0 > 0, x0, 0) * select(x0 > 0, x0, 0)"
    );
}

#[test]
fn a_gated_activation_kernel_reads_gate_and_up() {
    let f = user_fn("", "glu(gelu)");
    assert_eq!(f.params.len(), 2);
    let a = forward(&f, 64).unwrap();
    assert_eq!(a.name, "act glu(gelu)");
    assert_eq!(a.kernel.inputs.len(), 2);
    assert_eq!(a.kernel.outputs.len(), 1);
    assert!(a.kernel.to_string().ends_with(" * x1"), "{}", a.kernel);
}

#[test]
fn backward_kernels_take_dy_and_the_arguments_and_give_one_gradient_each() {
    for (name, params) in [("squared_relu", 1), ("geglu", 2)] {
        let f = prelude_fn(name);
        let a = backward(&f, 32).unwrap();
        assert_eq!(a.name, format!("act_bwd {name}"));
        assert_eq!(a.kernel.inputs.len(), params + 1);
        assert_eq!(a.kernel.outputs.len(), params);
        a.kernel.validate().unwrap();
    }
}

#[test]
fn a_squared_relu_mlp_lowers_to_fused_forward_and_backward() {
    let ops = fused_ops(spec_text("", "squared_relu", 1));
    let names: Vec<&str> = ops.iter().map(|(n, _)| n.as_str()).collect();
    // Two layers × two microbatches, a forward and a backward each.
    assert_eq!(
        names.iter().filter(|n| **n == "act squared_relu").count(),
        4
    );
    assert_eq!(
        names
            .iter()
            .filter(|n| **n == "act_bwd squared_relu")
            .count(),
        4
    );
    for (_, k) in &ops {
        assert_eq!(k.cols, 128);
    }
}

#[test]
fn a_geglu_mlp_under_tp_lowers_to_fused_ops_on_the_local_shard() {
    for act in ["geglu", "glu(gelu)", "mine"] {
        let fns = "fn mine(gate, up) = gelu(gate) * up";
        let ops = fused_ops(spec_text(fns, act, 2));
        assert!(!ops.is_empty());
        for (name, k) in &ops {
            assert!(name.ends_with(act), "{name}");
            assert_eq!(k.cols, 64, "the local half of ffn = 128");
            let (ins, outs) = if name.starts_with("act_bwd") {
                (3, 2)
            } else {
                (2, 1)
            };
            assert_eq!((k.inputs.len(), k.outputs.len()), (ins, outs), "{name}");
        }
    }
}

#[test]
fn hand_written_activations_keep_their_ops() {
    for act in ["gelu", "gelu_tanh", "relu", "silu", "swiglu", "glu(silu)"] {
        assert!(fused_ops(spec_text("", act, 1)).is_empty(), "{act}");
    }
}

/// `f`'s value at `args`, by the f32 reference evaluator on its expanded forward kernel.
fn run(k: &Kernel, inputs: &[Vec<f32>], outputs: usize) -> Vec<Vec<f32>> {
    let k = crate::kir::expand::expand(k);
    let n = inputs[0].len();
    let mut outs = vec![vec![0f32; n]; outputs];
    let ins: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
    let mut out_refs: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
    crate::kir::eval::run(&k, 0, 1, &ins, &mut out_refs).unwrap();
    outs
}

#[test]
fn derived_backward_kernels_match_finite_differences() {
    let user = "fn mine(x) = select(x > 0, x, 0.1 * x) * tanh(x) + pow(abs(x) + 1, 1.5)";
    let mut fns: Vec<Arc<ExprFn>> = ["gelu", "gelu_tanh", "relu", "silu", "squared_relu", "geglu"]
        .iter()
        .map(|n| prelude_fn(n))
        .collect();
    fns.push(user_fn(user, "mine"));
    fns.push(user_fn("", "glu(squared_relu)"));
    let cols = 64usize;
    // Points away from the kinks at 0.
    let xs: Vec<f32> = (0..cols).map(|i| (i as f32 - 31.7) / 9.0).collect();
    let ups: Vec<f32> = (0..cols).map(|i| 0.5 + (i % 5) as f32 / 3.0).collect();
    let dy: Vec<f32> = (0..cols).map(|i| 1.0 + (i % 3) as f32 / 2.0).collect();
    for f in &fns {
        let args: Vec<Vec<f32>> = [xs.clone(), ups.clone()][..f.params.len()].to_vec();
        let fwd = forward(f, cols as u64).unwrap();
        let bwd = backward(f, cols as u64).unwrap();
        assert_derived_matches_numeric(f, &fwd.kernel, &bwd.kernel, &args, &dy);
    }
}

/// A two-layer model whose blocks apply `gate` and `squared_relu` in the dataflow, under `tp`.
fn dataflow_text(tp: u32, sp: bool) -> String {
    format!(
        "fn gate(a, b) = a * sigmoid(b)
block B(d)(x) {{
  h = x + MLP(d, 4 * d)(LayerNorm(d)(x))
  m = MLP(d, 4 * d)(LayerNorm(d)(h))
  h + gate(m, squared_relu(h))
}}
model m {{
  let vocab = 64; let d = 32; let seq = 16
  input tokens  : [batch, seq] i32
  input targets : [batch, seq] i32
  x = Embedding(vocab, d)(tokens) + PositionEmbedding(seq, d)
  x = repeat 2 {{ B(d)(x) }}
  logits = Linear(d, vocab, bias = false, tied = Embedding)(LayerNorm(d)(x) as ln_f) as head
  loss = CrossEntropy(logits, targets)
  shard Embedding.vocab on tp
  shard Attention.heads on tp
  shard MLP.hidden on tp
}}
parallel {{ mesh = {{ dp: 1, pp: 1, cp: 1, tp: {tp} }}; sequence_parallel = {sp} }}
train {{ global_batch = 4; micro_batch = 2; steps = 2 }}
cluster {{ nodes = 1; gpus_per_node = {tp}; gpu = cpu }}
"
    )
}

/// The fused ops of the verified, unfused plan of `text`, per program.
fn unfused_ops(text: String) -> Vec<Vec<(String, Arc<Kernel>)>> {
    let mut options = CompileOptions::through(Stage::Verify);
    options.fusion = false;
    let c = compile("t.par", text, &[], &options);
    assert!(!c.diagnostics.has_errors(), "{:?}", c.diagnostics.items);
    assert!(c.analysis.verified.is_some(), "the plan verifies");
    let plan = c.plan.expect("a plan");
    plan.programs
        .iter()
        .map(|p| {
            p.computes()
                .filter_map(|(_, comp)| match &comp.op {
                    Op::Fused(a) => Some((a.name.clone(), a.kernel.clone())),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

#[test]
fn functions_in_the_dataflow_lower_to_fused_forward_and_backward() {
    for (tp, sp) in [(1, false), (2, false), (2, true)] {
        let programs = unfused_ops(dataflow_text(tp, sp));
        assert_eq!(programs.len(), tp as usize);
        for ops in &programs {
            let count = |name: &str| ops.iter().filter(|(n, _)| n == name).count();
            // Two layers × two microbatches of each.
            for name in [
                "fn gate",
                "fn_bwd gate",
                "fn squared_relu",
                "fn_bwd squared_relu",
            ] {
                assert_eq!(count(name), 4, "{name} under tp {tp} sp {sp}");
            }
            for (name, k) in ops {
                // Hidden states are replicated over tp: the whole width d = 32.
                assert_eq!(k.cols, 32, "{name}");
                let (ins, outs) = match name.as_str() {
                    "fn gate" => (2, 1),
                    "fn_bwd gate" => (3, 2),
                    "fn squared_relu" => (1, 1),
                    _ => (2, 1),
                };
                assert_eq!((k.inputs.len(), k.outputs.len()), (ins, outs), "{name}");
            }
        }
    }
}

#[test]
fn a_function_on_tensors_is_checked() {
    let check = |fns: &str, call: &str| {
        let text = dataflow_text(1, false)
            .replace("fn gate(a, b) = a * sigmoid(b)", fns)
            .replace("h + gate(m, squared_relu(h))", call);
        let c = compile("t.par", text, &[], &CompileOptions::through(Stage::Check));
        c.diagnostics
            .items
            .iter()
            .map(|d| d.code.to_string())
            .collect::<Vec<_>>()
    };
    let f = "fn f(a, b) = a * b\nfn fl(x) = floor(x)\nfn four(a, b, c, e) = a * b * c * e";
    assert_eq!(check(f, "h + f(m, h)"), Vec::<String>::new());
    assert_eq!(check(f, "h + f(m)"), ["E0221"]);
    assert_eq!(check(f, "h + fl(m)"), ["E0224"]);
    assert_eq!(check(f, "h + four(m, h, m, h)"), ["E0229"]);
    assert_eq!(check(f, "h + f(m, 2)"), ["E0307"]);
}

#[test]
fn derived_elementwise_backward_kernels_match_finite_differences() {
    let fns = [
        user_fn("", "squared_relu"),
        user_fn("fn gate(a, b) = a * sigmoid(b) + tanh(a * b)", "gate"),
    ];
    let cols = 48usize;
    let xs: Vec<f32> = (0..cols).map(|i| (i as f32 - 23.7) / 9.0).collect();
    let ys: Vec<f32> = (0..cols).map(|i| 0.5 - (i % 7) as f32 / 4.0).collect();
    let dy: Vec<f32> = (0..cols).map(|i| 1.0 + (i % 3) as f32 / 2.0).collect();
    for f in &fns {
        let args: Vec<Vec<f32>> = [xs.clone(), ys.clone()][..f.params.len()].to_vec();
        let fwd = elementwise(f, cols as u64).unwrap();
        let bwd = elementwise_backward(f, cols as u64).unwrap();
        assert_eq!(fwd.name, format!("fn {}", f.name));
        assert_derived_matches_numeric(f, &fwd.kernel, &bwd.kernel, &args, &dy);
    }
}

/// `bwd` (dy, args… → one gradient per arg) against central differences of `fwd` (args → y)
/// at every column, scaled by dy.
fn assert_derived_matches_numeric(
    f: &ExprFn,
    fwd: &Kernel,
    bwd: &Kernel,
    args: &[Vec<f32>],
    dy: &[f32],
) {
    let mut ins = vec![dy.to_vec()];
    ins.extend(args.iter().cloned());
    let grads = run(bwd, &ins, args.len());
    for (p, grad) in grads.iter().enumerate() {
        for c in 0..dy.len() {
            let h = 1e-2f32;
            let at = |d: f32| {
                let mut a = args.to_vec();
                a[p][c] += d;
                run(fwd, &a, 1)[0][c] as f64
            };
            let numeric = (at(h) - at(-h)) / (2.0 * h as f64) * dy[c] as f64;
            let err = (grad[c] as f64 - numeric).abs();
            assert!(
                err <= 2e-2 * numeric.abs().max(1.0),
                "{}: d/d{} at {c}: derived {}, numeric {numeric}",
                f.name,
                f.params[p],
                grad[c]
            );
        }
    }
}
