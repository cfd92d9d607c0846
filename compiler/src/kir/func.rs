//! Expression functions: the language's `fn name(args) = expr`, checked and held as a graph of
//! kernel IR over its parameters. A call inlines the body ([`ExprFn::apply`]); the lowering
//! applies an activation function to a kernel's loads and its derivative to the backward's.
use super::{Graph, NodeId};
use serde::Serialize;

/// A checked expression function: `name(params) = body`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExprFn {
    pub name: String,
    pub params: Vec<String>,
    /// The body's nodes; `Param(i)` is `params[i]`.
    pub graph: Graph,
    pub body: NodeId,
}

impl ExprFn {
    /// The body inlined into `g` with `args` for the parameters; the result's node.
    pub fn apply(&self, g: &mut Graph, args: &[NodeId]) -> NodeId {
        g.import(&self.graph, self.body, args)
    }

    /// The definition as text: `silu(x) = x * sigmoid(x)`.
    pub fn to_text(&self) -> String {
        let mut body = String::new();
        let name = |n: &super::Node| match *n {
            super::Node::Param(p) => self.params.get(p as usize).cloned().unwrap_or_default(),
            _ => String::new(),
        };
        // Writing to a String cannot fail.
        let _ = self.graph.write_expr(&mut body, self.body, &name);
        format!("{}({}) = {body}", self.name, self.params.join(", "))
    }
}
