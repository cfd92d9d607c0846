//! Symbolic derivatives of kernel IR: reverse mode over a graph's DAG.
//!
//! [`gradients`] adds to a graph the nodes of `seed · ∂root/∂w` for every `w` in `wrt`, built
//! with the graph's builders, so they share subexpressions with the forward graph and with each
//! other (the derivative of `x · sigmoid(x)` reuses the sigmoid node: exp' is exp itself, tanh'
//! is `1 - t²`, sigmoid' is `s (1 - s)`, rsqrt' is `-0.5 r / x`, sqrt' is `0.5 / sqrt`). The
//! adjoints are propagated in reverse id order (operands come before their users), each node's
//! contributions summed once before it passes them on.
//!
//! Semantics of the rules at their edges: `abs'(0) = 0`; `min`/`max` pass the adjoint to the
//! operand their value is (the first of two equal ones); a select passes it to the arm it takes
//! and nothing to its condition; `fma(a, b, c)` passes `b · adj`, `a · adj` and `adj`; `pow(x, c)` for a constant `c` is `c · pow(x, c - 1)`, and for a
//! variable exponent `∂/∂x = y · pow(x, y - 1)`, `∂/∂y = pow(x, y) · log(x)`. `floor`, `exp2i`,
//! `exponent` and `mantissa` have no derivative: one on a path from the root to a `wrt` node is
//! a [`DeriveError`], as is a root that is a comparison. Off such paths they are fine.
//!
//! Rows: a graph's loads and parameters are per-element values; a row sum is a row value. A
//! row sum's adjoint is broadcast to its operand, and the per-element contributions to a row
//! value (e.g. to a norm's `rsqrt(row_sum(x²)/n + eps)`) are summed over the row with one row
//! sum, so the derivative of a kernel-style graph is itself a kernel graph. The gradient of a
//! load is its per-element contribution (a caller wanting a `Row` input's gradient sums it).
use super::{Bin, Cmp, Graph, Level, Node, NodeId, Un};
use std::fmt;

/// A gradient that does not exist: `op` (node `node`) has no derivative and lies on a path
/// from the root to a variable, or is the root's comparison.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeriveError {
    pub op: &'static str,
    pub node: NodeId,
}

impl fmt::Display for DeriveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if Cmp::from_name(self.op).is_some() {
            write!(
                f,
                "a comparison (`{}`, node {}) has no gradient: only numbers are differentiable",
                self.op, self.node.0
            )
        } else {
            write!(
                f,
                "`{}` (node {}) is not differentiable, and a gradient would flow through it",
                self.op, self.node.0
            )
        }
    }
}

impl std::error::Error for DeriveError {}

/// `seed · ∂root/∂w` for each `w` of `wrt`, built into `g` (see the module docs): the constant
/// 0 for a `w` the root does not depend on (or a root that is not a node of `g`).
pub fn gradients(
    g: &mut Graph,
    root: NodeId,
    wrt: &[NodeId],
    seed: NodeId,
) -> Result<Vec<NodeId>, DeriveError> {
    let n = root.index() + 1;
    if n > g.len() {
        let zero = g.constant(0.0);
        return Ok(vec![zero; wrt.len()]);
    }
    let depends = dependence(g, n, wrt);
    if let (true, Node::Cmp(op, ..)) = (depends[root.index()], g.node(root)) {
        return Err(DeriveError {
            op: op.name(),
            node: root,
        });
    }
    let mut d = Reverse {
        g,
        depends,
        levels: Vec::new(),
        same: vec![None; n],
        from_elems: vec![None; n],
        done: vec![None; n],
    };
    if d.depends[root.index()] {
        d.contribute(root, seed);
    }
    for i in (0..n).rev() {
        d.visit(NodeId(i as u32))?;
    }
    let mut out = Vec::with_capacity(wrt.len());
    for w in wrt {
        let adj = match d.done.get(w.index()).copied().flatten() {
            Some(adj) => adj,
            None => d.g.constant(0.0),
        };
        out.push(adj);
    }
    Ok(out)
}

/// Which of the first `n` nodes depend on a `wrt` node (the `wrt` nodes included).
fn dependence(g: &Graph, n: usize, wrt: &[NodeId]) -> Vec<bool> {
    let mut depends = vec![false; n];
    for w in wrt {
        if let Some(d) = depends.get_mut(w.index()) {
            *d = true;
        }
    }
    for i in 0..n {
        if !depends[i] {
            depends[i] = g.nodes()[i].operands().any(|a| depends[a.index()]);
        }
    }
    depends
}

/// The reverse sweep's state.
struct Reverse<'g> {
    g: &'g mut Graph,
    depends: Vec<bool>,
    /// Where each node of `g` varies (loads and parameters per element), extended as nodes
    /// are added.
    levels: Vec<Level>,
    /// Each node's adjoint contributions that vary no more than it does, summed.
    same: Vec<Option<NodeId>>,
    /// Per-element contributions to a row value or constant, summed (a row sum at the end).
    from_elems: Vec<Option<NodeId>>,
    /// Each visited node's adjoint.
    done: Vec<Option<NodeId>>,
}

impl Reverse<'_> {
    fn level(&mut self, id: NodeId) -> Level {
        while self.levels.len() <= id.index() {
            let node = self.g.nodes()[self.levels.len()];
            let level = match node {
                Node::Param(_) | Node::Load { .. } => Level::Elem,
                Node::Const(_) => Level::Const,
                Node::RowSum(_) => Level::Row,
                _ => node
                    .operands()
                    .map(|a| self.levels[a.index()])
                    .fold(Level::Const, Level::join),
            };
            self.levels.push(level);
        }
        self.levels[id.index()]
    }

    /// Adds `c` to the adjoint of `to`, if `to` depends on a variable.
    fn contribute(&mut self, to: NodeId, c: NodeId) {
        if !self.depends[to.index()] {
            return;
        }
        let to_row = self.level(to) <= Level::Row && self.level(c) > Level::Row;
        let prev = if to_row {
            self.from_elems[to.index()]
        } else {
            self.same[to.index()]
        };
        let sum = match prev {
            Some(prev) => self.g.bin(Bin::Add, prev, c),
            None => c,
        };
        let slot = if to_row {
            &mut self.from_elems
        } else {
            &mut self.same
        };
        slot[to.index()] = Some(sum);
    }

    /// The node's adjoint: its contributions, the per-element ones summed over the row.
    fn adjoint(&mut self, i: usize) -> Option<NodeId> {
        let elems = self.from_elems[i].map(|e| self.g.row_sum(e));
        let adj = match (self.same[i], elems) {
            (Some(a), Some(b)) => Some(self.g.bin(Bin::Add, a, b)),
            (a, b) => a.or(b),
        };
        self.done[i] = adj;
        adj
    }

    fn visit(&mut self, id: NodeId) -> Result<(), DeriveError> {
        if !self.depends[id.index()] {
            return Ok(());
        }
        let Some(a) = self.adjoint(id.index()) else {
            return Ok(());
        };
        match self.g.node(id) {
            Node::Param(_) | Node::Load { .. } | Node::Const(_) | Node::Cmp(..) => {}
            Node::Un(op, x) => self.un(id, op, x, a)?,
            Node::Bin(op, x, y) => self.bin(id, op, x, y, a),
            Node::Select(c, p, q) => {
                let zero = self.g.constant(0.0);
                let to_p = self.g.select(c, a, zero);
                let to_q = self.g.select(c, zero, a);
                self.contribute(p, to_p);
                self.contribute(q, to_q);
            }
            Node::Fma(x, y, z) => {
                self.chain(x, a, y);
                self.chain(y, a, x);
                self.contribute(z, a);
            }
            Node::RowSum(x) => self.contribute(x, a),
        }
        Ok(())
    }

    /// `a · f` into `x`'s adjoint.
    fn chain(&mut self, x: NodeId, a: NodeId, f: NodeId) {
        let c = self.g.bin(Bin::Mul, a, f);
        self.contribute(x, c);
    }

    fn c(&mut self, v: f32) -> NodeId {
        self.g.constant(v)
    }

    /// The adjoint `a` of `n = op(x)` into `x`.
    fn un(&mut self, n: NodeId, op: Un, x: NodeId, a: NodeId) -> Result<(), DeriveError> {
        if !self.depends[x.index()] {
            return Ok(());
        }
        let g = &mut *self.g;
        let f = match op {
            Un::Neg => {
                let na = g.un(Un::Neg, a);
                self.contribute(x, na);
                return Ok(());
            }
            Un::Abs => {
                let zero = g.constant(0.0);
                let neg = g.cmp(Cmp::Lt, x, zero);
                let pos = g.cmp(Cmp::Gt, x, zero);
                let na = g.un(Un::Neg, a);
                let inner = g.select(pos, a, zero);
                let c = g.select(neg, na, inner);
                self.contribute(x, c);
                return Ok(());
            }
            Un::Floor | Un::Exp2i | Un::Exp2Bits | Un::Exponent | Un::Mantissa => {
                return Err(DeriveError {
                    op: op.name(),
                    node: n,
                })
            }
            Un::Exp => n,
            Un::Log => {
                let c = g.bin(Bin::Div, a, x);
                self.contribute(x, c);
                return Ok(());
            }
            Un::Sqrt => {
                let half = g.constant(0.5);
                g.bin(Bin::Div, half, n)
            }
            Un::Rsqrt => {
                let r_x = g.bin(Bin::Div, n, x);
                let k = g.constant(-0.5);
                g.bin(Bin::Mul, k, r_x)
            }
            Un::Tanh => {
                let t2 = g.bin(Bin::Mul, n, n);
                let one = g.constant(1.0);
                g.bin(Bin::Sub, one, t2)
            }
            Un::Sigmoid => {
                let one = g.constant(1.0);
                let one_minus = g.bin(Bin::Sub, one, n);
                g.bin(Bin::Mul, n, one_minus)
            }
            Un::Erf => {
                let x2 = g.bin(Bin::Mul, x, x);
                let nx2 = g.un(Un::Neg, x2);
                let e = g.un(Un::Exp, nx2);
                let k = g.constant(std::f32::consts::FRAC_2_SQRT_PI);
                g.bin(Bin::Mul, k, e)
            }
        };
        self.chain(x, a, f);
        Ok(())
    }

    /// The adjoint `a` of `n = x op y` into `x` and `y`.
    fn bin(&mut self, n: NodeId, op: Bin, x: NodeId, y: NodeId, a: NodeId) {
        match op {
            Bin::Add => {
                self.contribute(x, a);
                self.contribute(y, a);
            }
            Bin::Sub => {
                self.contribute(x, a);
                let na = self.g.un(Un::Neg, a);
                self.contribute(y, na);
            }
            Bin::Mul => {
                self.chain(x, a, y);
                self.chain(y, a, x);
            }
            Bin::Div => {
                let dx = self.g.bin(Bin::Div, a, y);
                self.contribute(x, dx);
                let an = self.g.bin(Bin::Mul, a, n);
                let an_y = self.g.bin(Bin::Div, an, y);
                let dy = self.g.un(Un::Neg, an_y);
                self.contribute(y, dy);
            }
            // min = y if y < x else x; max = y if x < y else x.
            Bin::Min | Bin::Max => {
                let y_taken = match op {
                    Bin::Min => self.g.cmp(Cmp::Lt, y, x),
                    _ => self.g.cmp(Cmp::Lt, x, y),
                };
                let zero = self.c(0.0);
                let to_x = self.g.select(y_taken, zero, a);
                let to_y = self.g.select(y_taken, a, zero);
                self.contribute(x, to_x);
                self.contribute(y, to_y);
            }
            Bin::Pow => self.pow(n, x, y, a),
        }
    }

    fn pow(&mut self, n: NodeId, x: NodeId, y: NodeId, a: NodeId) {
        if let Some(c) = self.g.node(y).constant() {
            let p = self.pow_const(x, c - 1.0);
            let k = self.c(c);
            let f = self.g.bin(Bin::Mul, k, p);
            self.chain(x, a, f);
            return;
        }
        if self.depends[x.index()] {
            let one = self.c(1.0);
            let y1 = self.g.bin(Bin::Sub, y, one);
            let p = self.g.bin(Bin::Pow, x, y1);
            let f = self.g.bin(Bin::Mul, y, p);
            self.chain(x, a, f);
        }
        if self.depends[y.index()] {
            let l = self.g.un(Un::Log, x);
            let f = self.g.bin(Bin::Mul, n, l);
            self.chain(y, a, f);
        }
    }

    /// `x^e` for a constant `e`, without a `pow` node for 0 and 1.
    fn pow_const(&mut self, x: NodeId, e: f32) -> NodeId {
        if e == 0.0 {
            self.c(1.0)
        } else if e == 1.0 {
            x
        } else {
            let k = self.c(e);
            self.g.bin(Bin::Pow, x, k)
        }
    }
}

#[cfg(test)]
mod tests;
