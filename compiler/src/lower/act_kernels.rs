//! The generated kernels of an MLP whose activation is an expression function
//! ([`Activation::Fn`](crate::spec::Activation)): its forward `y = f(x)` (gated:
//! `y = f(gate, up)`) and its backward, derived symbolically with `seed = dy` (plain:
//! `dy, x → dx`; gated: `dy, gate, up → dgate, dup`). Each kernel works per column over
//! `cols` columns (the local ffn shard under tensor parallelism) and is validated here. The
//! same kernels, named `fn NAME` and `fn_bwd NAME`, are an elementwise layer's
//! ([`LayerKind::Elementwise`](crate::spec::LayerKind): `y = f(x)` in the dataflow).

use crate::ir::op::FusedAttrs;
use crate::kir::func::ExprFn;
use crate::kir::{derive, Access, Graph, Kernel, NodeId, Store};
use std::sync::Arc;

/// The forward kernel: inputs are the function's arguments (`[rows, cols]` each), output `y`.
pub fn forward(f: &ExprFn, cols: u64) -> Result<FusedAttrs, String> {
    forward_named(format!("act {}", f.name), f, cols)
}

/// The backward kernel: inputs `dy` then the function's arguments, outputs one gradient per
/// argument, `d f / d arg · dy`.
pub fn backward(f: &ExprFn, cols: u64) -> Result<FusedAttrs, String> {
    backward_named(format!("act_bwd {}", f.name), f, cols)
}

/// The forward kernel of an elementwise layer (`y = f(x)` in the dataflow), named `fn NAME`.
pub fn elementwise(f: &ExprFn, cols: u64) -> Result<FusedAttrs, String> {
    forward_named(format!("fn {}", f.name), f, cols)
}

/// The backward kernel of an elementwise layer, named `fn_bwd NAME`.
pub fn elementwise_backward(f: &ExprFn, cols: u64) -> Result<FusedAttrs, String> {
    backward_named(format!("fn_bwd {}", f.name), f, cols)
}

fn forward_named(name: String, f: &ExprFn, cols: u64) -> Result<FusedAttrs, String> {
    let mut g = Graph::new();
    let args: Vec<NodeId> = (0..f.params.len() as u32).map(|i| g.load(i, 0)).collect();
    let y = f.apply(&mut g, &args);
    let inputs = vec![Access::Elem { width: cols }; args.len()];
    fused(name, cols, inputs, &g, &[y])
}

fn backward_named(name: String, f: &ExprFn, cols: u64) -> Result<FusedAttrs, String> {
    let mut g = Graph::new();
    let dy = g.load(0, 0);
    let args: Vec<NodeId> = (1..=f.params.len() as u32).map(|i| g.load(i, 0)).collect();
    let y = f.apply(&mut g, &args);
    let grads = derive::gradients(&mut g, y, &args, dy)
        .map_err(|e| format!("the derivative of `{}`: {e}", f.name))?;
    let inputs = vec![Access::Elem { width: cols }; args.len() + 1];
    fused(name, cols, inputs, &g, &grads)
}

/// A kernel storing `values` (nodes of `g`) to one `[rows, cols]` output each, with only the
/// nodes they depend on, validated.
fn fused(
    name: String,
    cols: u64,
    inputs: Vec<Access>,
    g: &Graph,
    values: &[NodeId],
) -> Result<FusedAttrs, String> {
    let mut graph = Graph::new();
    let stores = values
        .iter()
        .enumerate()
        .map(|(o, &v)| Store {
            output: o as u32,
            col_offset: 0,
            value: graph.import(g, v, &[]),
        })
        .collect();
    let kernel = Kernel {
        cols,
        inputs,
        outputs: vec![Access::Elem { width: cols }; values.len()],
        graph,
        stores,
    };
    kernel
        .validate()
        .map_err(|e| format!("the kernel of `{name}`: {e}"))?;
    Ok(FusedAttrs {
        name,
        rows: None,
        kernel: Arc::new(kernel),
    })
}

#[cfg(test)]
mod tests;
