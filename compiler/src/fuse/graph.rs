//! Copying parts of kernel graphs: the nodes a set of roots depends on ([`reachable`]), and
//! their copy into another graph with every load replaced ([`rebuild`]). The fusion pass uses
//! it to inline a fused member's kernel, to read a group's own value at its rotate-half partner
//! column, and to drop the nodes no store uses.
use crate::kir::{Graph, Node, NodeId};
use std::collections::HashMap;

/// The nodes `roots` depend on, themselves included, in id (topological) order.
pub(super) fn reachable(g: &Graph, roots: &[NodeId]) -> Vec<(NodeId, Node)> {
    let mut seen = vec![false; g.len()];
    let mut stack: Vec<NodeId> = roots.to_vec();
    while let Some(id) = stack.pop() {
        match seen.get_mut(id.index()) {
            Some(s) if !*s => *s = true,
            _ => continue,
        }
        stack.extend(g.node(id).operands());
    }
    seen.iter()
        .enumerate()
        .filter(|(_, s)| **s)
        .map(|(i, _)| (NodeId(i as u32), g.node(NodeId(i as u32))))
        .collect()
}

/// Copies `nodes` (a [`reachable`] list) into `dst` through its builders, each `Load` and
/// `Param` replaced by what `leaf` makes of it; the copy of each node, by its old id.
pub(super) fn rebuild(
    nodes: &[(NodeId, Node)],
    dst: &mut Graph,
    leaf: &mut dyn FnMut(&mut Graph, Node) -> Result<NodeId, String>,
) -> Result<HashMap<NodeId, NodeId>, String> {
    let mut map: HashMap<NodeId, NodeId> = HashMap::with_capacity(nodes.len());
    for &(id, node) in nodes {
        let m = |a: NodeId| {
            map.get(&a)
                .copied()
                .ok_or_else(|| format!("node {} is read before it is copied", a.0))
        };
        let new = match node {
            Node::Param(_) | Node::Load { .. } => leaf(dst, node)?,
            Node::Const(bits) => dst.intern(Node::Const(bits)),
            Node::Un(op, a) => dst.un(op, m(a)?),
            Node::Bin(op, a, b) => dst.bin(op, m(a)?, m(b)?),
            Node::Cmp(op, a, b) => dst.cmp(op, m(a)?, m(b)?),
            Node::Select(c, a, b) => dst.select(m(c)?, m(a)?, m(b)?),
            Node::Fma(a, b, c) => dst.fma(m(a)?, m(b)?, m(c)?),
            Node::RowSum(_) => return Err("a row sum cannot be fused".to_string()),
        };
        map.insert(id, new);
    }
    Ok(map)
}

/// The copy of `root` after [`rebuild`] of its [`reachable`] nodes.
pub(super) fn rebuild_one(
    src: &Graph,
    root: NodeId,
    dst: &mut Graph,
    leaf: &mut dyn FnMut(&mut Graph, Node) -> Result<NodeId, String>,
) -> Result<NodeId, String> {
    let nodes = reachable(src, &[root]);
    let map = rebuild(&nodes, dst, leaf)?;
    map.get(&root)
        .copied()
        .ok_or_else(|| format!("node {} was not copied", root.0))
}
