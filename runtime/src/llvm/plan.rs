//! The shape of a generated kernel before any LLVM is built: which nodes the stores need and,
//! for a kernel with row sums, the passes over a row that compute them. A row sum whose
//! operand reads another row sum (a variance after a mean) waits for that sum's pass, so the
//! sums are grouped by their nesting depth: pass `k` computes every needed sum of depth `k + 1`.
use parc_compiler::kir::{Kernel, Node, NodeId};

/// What a kernel computes, in the order it must compute it.
#[derive(Debug, PartialEq)]
pub struct Plan {
    /// The row sums, one group per pass over the row, inner sums first (empty: no row sum).
    pub passes: Vec<Vec<NodeId>>,
}

impl Plan {
    pub fn of(kernel: &Kernel) -> Plan {
        let g = &kernel.graph;
        let roots: Vec<NodeId> = kernel.stores.iter().map(|s| s.value).collect();
        let needed = reachable(kernel, &roots, &[]);
        let mut depth = vec![0usize; g.len()];
        for (i, node) in g.nodes().iter().enumerate() {
            let inner = node.operands().map(|a| depth[a.index()]).max().unwrap_or(0);
            depth[i] = match node {
                Node::RowSum(_) => inner + 1,
                _ => inner,
            };
        }
        let levels = depth.iter().copied().max().unwrap_or(0);
        let passes = (1..=levels)
            .map(|d| {
                (0..g.len())
                    .filter(|&i| needed[i] && depth[i] == d)
                    .filter(|&i| matches!(g.nodes()[i], Node::RowSum(_)))
                    .map(|i| NodeId(i as u32))
                    .collect::<Vec<_>>()
            })
            .filter(|pass| !pass.is_empty())
            .collect();
        Plan { passes }
    }

    pub fn has_row_sums(&self) -> bool {
        !self.passes.is_empty()
    }
}

/// Which nodes `roots` depend on (indexed by node id), not looking through `known` nodes
/// (values computed before, such as a finished row sum).
pub fn reachable(kernel: &Kernel, roots: &[NodeId], known: &[NodeId]) -> Vec<bool> {
    let g = &kernel.graph;
    let mut seen = vec![false; g.len()];
    let mut stack: Vec<NodeId> = roots.to_vec();
    while let Some(id) = stack.pop() {
        if id.index() >= seen.len() || seen[id.index()] {
            continue;
        }
        seen[id.index()] = true;
        if !known.contains(&id) {
            stack.extend(g.node(id).operands());
        }
    }
    seen
}
