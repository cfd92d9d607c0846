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

fn prelude_fn(name: &str) -> Arc<ExprFn> {
    let c = compile(
        "t.par",
        spec_text("", name, 1),
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
    let f = prelude_fn("glu(gelu)");
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
