//! The kernel IR: the small language of the kernels the compiler generates.
//!
//! A [`Graph`] is a DAG of scalar [`Node`]s with typed ids ([`NodeId`]), hash-consed: building a
//! node equal to an existing one returns the existing id, so common subexpressions are shared by
//! construction, and the builder folds constants and drops identities (`x + 0`, `x * 1`).
//! Two things are built from graphs:
//! - an expression function ([`func::ExprFn`], the language's `fn name(args) = expr`): a graph
//!   whose leaves are its parameters ([`Node::Param`]);
//! - a [`Kernel`]: a graph whose leaves are loads of its inputs, with stores to its outputs. A
//!   kernel runs over a domain of `rows × cols` points; at each point a load reads its input at
//!   that row and column (an [`Access`] says how), and a [`Node::RowSum`] sums a value over the
//!   columns of its row. Every value is f32 (a comparison's is a boolean, usable only as a
//!   select's condition); a bf16 buffer is widened on load and rounded to nearest-even on
//!   store, as every op does (`ir::storage`).
//!
//! Ops are primitive or composite ([`Un::is_primitive`], [`Bin::is_primitive`]); the fused
//! multiply-add [`Node::Fma`] (`a · b + c` rounded once, IEEE `fma`) is primitive. Emitters and
//! the reference evaluator implement only the primitives, each with IEEE single-precision
//! semantics and no contraction (no multiply and add fused unless the graph says `Fma`): `expand` rewrites every composite (exp, log, tanh, erf,
//! sigmoid, rsqrt, pow, min, max) into primitives once, in the compiler, so a generated kernel
//! computes the same bits on every backend. A row sum is reduced in one fixed order
//! ([`REDUCE_LANES`]): lane `l` sums columns `l, l + LANES, …` in order, then lanes combine in a
//! halving tree (`p[i] += p[i + s]` for `s = LANES/2, …, 1`).
//!
//! Invariants a valid kernel holds ([`Kernel::validate`]):
//! 1. every node's operands come before it (ids are topologically ordered);
//! 2. a kernel has no `Param` nodes; a load names an input that exists, and the columns it
//!    reads (`offset + map(c)` for every domain column `c`, [`ColMap`]) lie inside the input's
//!    width (a `RotateHalf` head is even and divides the domain's columns, so every partner lies
//!    in the block); `Row` and `Col` inputs are read without offset or map;
//! 3. arithmetic takes numbers and a select's condition is a comparison (types);
//! 4. an `Elem` output's stores cover each of its columns exactly once (every element written:
//!    the op table's `Write::Overwrite`); a `Row` output has exactly one store, of a row value;
//! 5. a row sum sums a value that varies along the row.
use serde::{Serialize, Serializer};
use std::collections::HashMap;
use std::fmt;

pub mod derive;
pub mod eval;
pub mod expand;
pub mod func;

/// A row sum's lanes: the fixed reduction order every backend follows (see the module docs).
pub const REDUCE_LANES: usize = 256;

/// A node of a [`Graph`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct NodeId(pub u32);

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

macro_rules! ops {
    ($(#[$meta:meta])* $ty:ident { $($(#[$vmeta:meta])* $variant:ident $name:literal $prim:literal,)* }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $ty {
            $($(#[$vmeta])* $variant,)*
        }

        impl $ty {
            /// Every op, in declaration order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant,)*];

            /// Its name in the language and in the IR's text.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)*
                }
            }

            /// Whether emitters implement it directly (else `expand` rewrites it).
            pub fn is_primitive(self) -> bool {
                match self {
                    $($ty::$variant => $prim,)*
                }
            }

            /// The op named `name`.
            pub fn from_name(name: &str) -> Option<$ty> {
                $ty::ALL.iter().copied().find(|op| op.name() == name)
            }
        }
    };
}

ops! {
    /// A one-operand op.
    Un {
        Neg "neg" true,
        Abs "abs" true,
        Sqrt "sqrt" true,
        Floor "floor" true,
        /// `2^k` for an integral `k` in [-126, 127] (built from the exponent bits).
        Exp2i "exp2i" true,
        /// `x`'s low 9 bits moved into the sign and exponent field (`bits(x) << 23`): for
        /// `x = 1.5 · 2^23 + b` with an integral `b` in [1, 254] (a float holding the integer
        /// `b` in its low bits), the power of two `2^(b - 127)`.
        Exp2Bits "exp2bits" true,
        /// The unbiased binary exponent of a normal, finite, non-zero `x`, as a float.
        Exponent "exponent" true,
        /// `x / 2^exponent(x)`, in [1, 2) for a positive normal `x`.
        Mantissa "mantissa" true,
        Exp "exp" false,
        Log "log" false,
        Tanh "tanh" false,
        Erf "erf" false,
        Sigmoid "sigmoid" false,
        Rsqrt "rsqrt" false,
    }
}

ops! {
    /// A two-operand arithmetic op.
    Bin {
        Add "+" true,
        Sub "-" true,
        Mul "*" true,
        Div "/" true,
        Min "min" false,
        Max "max" false,
        Pow "pow" false,
    }
}

ops! {
    /// A comparison: its value is a boolean.
    Cmp {
        Lt "<" true,
        Le "<=" true,
        Gt ">" true,
        Ge ">=" true,
        Eq "==" true,
        Ne "!=" true,
    }
}

impl Cmp {
    /// Whether `a op b` holds: IEEE comparisons, false with a NaN operand except for `!=`.
    /// The f32 primitive (`prim::cmp`) and the f64 reference (`eval::eval_f64`) both are this.
    pub fn holds<T: PartialOrd>(self, a: T, b: T) -> bool {
        match self {
            Cmp::Lt => a < b,
            Cmp::Le => a <= b,
            Cmp::Gt => a > b,
            Cmp::Ge => a >= b,
            Cmp::Eq => a == b,
            Cmp::Ne => a != b,
        }
    }
}

/// One scalar computation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Node {
    /// An expression function's `i`-th parameter.
    Param(u32),
    /// Input `input` at this point: for an `Elem` or `PerPosition` input, its column
    /// `col_offset + map(col)`.
    Load {
        input: u32,
        col_offset: u64,
        map: ColMap,
    },
    /// An f32 constant, by its bits (so that graphs hash and compare exactly).
    Const(u32),
    Un(Un, NodeId),
    Bin(Bin, NodeId, NodeId),
    Cmp(Cmp, NodeId, NodeId),
    /// `cond ? a : b`.
    Select(NodeId, NodeId, NodeId),
    /// `a · b + c`, rounded once (IEEE `fusedMultiplyAdd`, [`prim::fma`]).
    Fma(NodeId, NodeId, NodeId),
    /// The sum of a value over the columns of this row (a row value).
    RowSum(NodeId),
}

impl Node {
    /// The nodes it reads, in order.
    pub fn operands(&self) -> impl Iterator<Item = NodeId> {
        let (a, b, c) = match *self {
            Node::Param(_) | Node::Load { .. } | Node::Const(_) => (None, None, None),
            Node::Un(_, a) | Node::RowSum(a) => (Some(a), None, None),
            Node::Bin(_, a, b) | Node::Cmp(_, a, b) => (Some(a), Some(b), None),
            Node::Select(c, a, b) | Node::Fma(c, a, b) => (Some(c), Some(a), Some(b)),
        };
        a.into_iter().chain(b).chain(c)
    }

    /// The node's constant value, if it is one.
    pub fn constant(&self) -> Option<f32> {
        match *self {
            Node::Const(bits) => Some(f32::from_bits(bits)),
            _ => None,
        }
    }
}

/// Which column of an input a load at domain column `c` reads (before its offset).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ColMap {
    /// `c`.
    Id,
    /// `c mod period`: a per-column table repeated along the row (one head's rotary table).
    Periodic(u64),
    /// The rotate-half partner of `c` in its head of `head_dim` columns: `c + head_dim/2` in a
    /// head's first half, `c - head_dim/2` in its second (RoPE).
    RotateHalf(u64),
    /// A partial RoPE's partner of `c` in its head of `head` columns whose first `rot` turn:
    /// `c + rot/2` in the first half of those, `c - rot/2` in their second, `c` itself past
    /// them. (`rot` = `head` is `RotateHalf`, which [`ColMap::rotation`] gives then.)
    RotatePart { head: u64, rot: u64 },
}

impl ColMap {
    /// The rotate-half partner map of heads of `head` columns whose first `rot` turn.
    pub fn rotation(head: u64, rot: u64) -> ColMap {
        if rot == head {
            ColMap::RotateHalf(head)
        } else {
            ColMap::RotatePart { head, rot }
        }
    }

    /// The column a load at domain column `c` reads.
    pub fn apply(self, c: u64) -> u64 {
        match self {
            ColMap::Id => c,
            ColMap::Periodic(p) => c % p.max(1),
            ColMap::RotateHalf(hd) => rotate_part(c, hd, hd),
            ColMap::RotatePart { head, rot } => rotate_part(c, head, rot),
        }
    }

    /// The widest column it reads for a domain of `cols` columns, plus one.
    pub fn span(self, cols: u64) -> u64 {
        match self {
            ColMap::Periodic(p) => p.min(cols),
            ColMap::Id | ColMap::RotateHalf(_) | ColMap::RotatePart { .. } => cols,
        }
    }

    /// The columns after which it repeats: a table's period, a rotation's head.
    pub fn period(self) -> Option<u64> {
        match self {
            ColMap::Id => None,
            ColMap::Periodic(p) | ColMap::RotateHalf(p) | ColMap::RotatePart { head: p, .. } => {
                Some(p)
            }
        }
    }

    /// The rotation's head and turned columns, for the rotations.
    pub fn rotated(self) -> Option<(u64, u64)> {
        match self {
            ColMap::RotateHalf(hd) => Some((hd, hd)),
            ColMap::RotatePart { head, rot } => Some((head, rot)),
            ColMap::Id | ColMap::Periodic(_) => None,
        }
    }
}

/// The partner of column `c` in heads of `head` columns whose first `rot` turn in pairs.
fn rotate_part(c: u64, head: u64, rot: u64) -> u64 {
    let half = rot / 2;
    let within = c % head.max(1);
    if within < half {
        c + half
    } else if within < rot {
        c - half
    } else {
        c
    }
}

/// The type of a value: a number, or the boolean a comparison gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ty {
    F32,
    Bool,
}

/// A hash-consed DAG of nodes (see the module docs).
#[derive(Clone, Default)]
pub struct Graph {
    nodes: Vec<Node>,
    index: HashMap<Node, NodeId>,
}

impl PartialEq for Graph {
    fn eq(&self, other: &Graph) -> bool {
        self.nodes == other.nodes
    }
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.nodes).finish()
    }
}

impl Serialize for Graph {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.nodes.serialize(s)
    }
}

impl Graph {
    pub fn new() -> Graph {
        Graph::default()
    }

    /// Every node, in id (topological) order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: NodeId) -> Node {
        self.nodes[id.index()]
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The node, added unless an equal one exists (no simplification: see the typed builders).
    pub fn intern(&mut self, node: Node) -> NodeId {
        if let Some(&id) = self.index.get(&node) {
            return id;
        }
        let id = NodeId(self.nodes.len() as u32);
        self.nodes.push(node);
        self.index.insert(node, id);
        id
    }

    pub fn param(&mut self, i: u32) -> NodeId {
        self.intern(Node::Param(i))
    }

    /// Input `input` at this point, columns `col_offset + c`.
    pub fn load(&mut self, input: u32, col_offset: u64) -> NodeId {
        self.load_mapped(input, col_offset, ColMap::Id)
    }

    /// Input `input` at this point, column `col_offset + map(c)`.
    pub fn load_mapped(&mut self, input: u32, col_offset: u64, map: ColMap) -> NodeId {
        self.intern(Node::Load {
            input,
            col_offset,
            map,
        })
    }

    pub fn constant(&mut self, value: f32) -> NodeId {
        self.intern(Node::Const(value.to_bits()))
    }

    fn const_of(&self, id: NodeId) -> Option<f32> {
        self.node(id).constant()
    }

    /// `op(a)`, folding a constant operand of a primitive op and `neg(neg(x))`.
    pub fn un(&mut self, op: Un, a: NodeId) -> NodeId {
        if op.is_primitive() {
            if let Some(v) = self.const_of(a) {
                return self.constant(prim::un(op, v));
            }
        }
        if let (Un::Neg, Node::Un(Un::Neg, x)) = (op, self.node(a)) {
            return x;
        }
        self.intern(Node::Un(op, a))
    }

    /// `a op b`, folding constants of primitive ops and the identities `x + 0`, `0 + x`,
    /// `x - 0`, `x * 1`, `1 * x`, `x / 1`, `x * 0`, `0 * x` and `0 - x` (as `neg(x)`).
    pub fn bin(&mut self, op: Bin, a: NodeId, b: NodeId) -> NodeId {
        let (ca, cb) = (self.const_of(a), self.const_of(b));
        if op.is_primitive() {
            if let (Some(x), Some(y)) = (ca, cb) {
                return self.constant(prim::bin(op, x, y));
            }
        }
        let is = |c: Option<f32>, v: f32| c.is_some_and(|c| c == v);
        match op {
            Bin::Add if is(cb, 0.0) => return a,
            Bin::Add if is(ca, 0.0) => return b,
            Bin::Sub if is(cb, 0.0) => return a,
            Bin::Sub if is(ca, 0.0) => return self.un(Un::Neg, b),
            Bin::Mul | Bin::Div if is(cb, 1.0) => return a,
            Bin::Mul if is(ca, 1.0) => return b,
            Bin::Mul if is(ca, 0.0) || is(cb, 0.0) => return self.constant(0.0),
            _ => {}
        }
        self.intern(Node::Bin(op, a, b))
    }

    pub fn cmp(&mut self, op: Cmp, a: NodeId, b: NodeId) -> NodeId {
        self.intern(Node::Cmp(op, a, b))
    }

    /// `cond ? a : b`; just `a` when both arms are the same node.
    pub fn select(&mut self, cond: NodeId, a: NodeId, b: NodeId) -> NodeId {
        if a == b {
            return a;
        }
        self.intern(Node::Select(cond, a, b))
    }

    /// `a · b + c` rounded once: three constants fold (via [`prim::fma`]); `fma(1, b, c)` and
    /// `fma(a, 1, c)` are adds, and so is a product of two constants when it is exact in f32
    /// (all round once, the same). `fma(a, b, 0)` stays: it differs from `a · b` for `-0`.
    pub fn fma(&mut self, a: NodeId, b: NodeId, c: NodeId) -> NodeId {
        let (ca, cb, cc) = (self.const_of(a), self.const_of(b), self.const_of(c));
        if let (Some(x), Some(y), Some(z)) = (ca, cb, cc) {
            return self.constant(prim::fma(x, y, z));
        }
        let is = |k: Option<f32>, v: f32| k.is_some_and(|k| k == v);
        // `1 · b + c` and `a · 1 + c` round once either way: an add.
        if is(ca, 1.0) {
            return self.bin(Bin::Add, b, c);
        }
        if is(cb, 1.0) {
            return self.bin(Bin::Add, a, c);
        }
        // A product of two constants that is exact (its f64 value fits f32) is that constant.
        if let (Some(x), Some(y)) = (ca, cb) {
            let p = x as f64 * y as f64;
            if (p as f32) as f64 == p {
                let k = self.constant(p as f32);
                return self.bin(Bin::Add, k, c);
            }
        }
        self.intern(Node::Fma(a, b, c))
    }

    pub fn row_sum(&mut self, a: NodeId) -> NodeId {
        self.intern(Node::RowSum(a))
    }

    /// The type of a node's value.
    pub fn ty(&self, id: NodeId) -> Ty {
        match self.node(id) {
            Node::Cmp(..) => Ty::Bool,
            _ => Ty::F32,
        }
    }

    /// Copies the nodes `root` depends on from `from` into this graph, with each
    /// `Param(i)` replaced by `args[i]` (the inlining of a function call); the copy of `root`.
    /// A `Param` without an argument stays a `Param`.
    pub fn import(&mut self, from: &Graph, root: NodeId, args: &[NodeId]) -> NodeId {
        let mut map: Vec<Option<NodeId>> = vec![None; root.index() + 1];
        for (i, node) in from.nodes.iter().enumerate().take(root.index() + 1) {
            let m = |id: NodeId| map[id.index()].unwrap_or(id);
            let new = match *node {
                Node::Param(p) => match args.get(p as usize) {
                    Some(&arg) => arg,
                    None => self.param(p),
                },
                Node::Load {
                    input,
                    col_offset,
                    map,
                } => self.load_mapped(input, col_offset, map),
                Node::Const(bits) => self.intern(Node::Const(bits)),
                Node::Un(op, a) => self.un(op, m(a)),
                Node::Bin(op, a, b) => self.bin(op, m(a), m(b)),
                Node::Cmp(op, a, b) => self.cmp(op, m(a), m(b)),
                Node::Select(c, a, b) => self.select(m(c), m(a), m(b)),
                Node::Fma(a, b, c) => self.fma(m(a), m(b), m(c)),
                Node::RowSum(a) => self.row_sum(m(a)),
            };
            map[i] = Some(new);
        }
        map[root.index()].unwrap_or(root)
    }

    /// Writes `id` as an expression, with `name(i)` for `Param(i)` and `Load` input `i`.
    pub fn write_expr(
        &self,
        out: &mut dyn fmt::Write,
        id: NodeId,
        name: &dyn Fn(&Node) -> String,
    ) -> fmt::Result {
        match self.node(id) {
            n @ (Node::Param(_) | Node::Load { .. }) => out.write_str(&name(&n)),
            Node::Const(bits) => write!(out, "{}", f32::from_bits(bits)),
            Node::Un(Un::Neg, a) => {
                out.write_str("-")?;
                self.write_operand(out, a, name)
            }
            Node::Un(op, a) => self.write_call(out, op.name(), a, name),
            Node::RowSum(a) => self.write_call(out, "row_sum", a, name),
            Node::Bin(op, a, b) if !op.name().chars().all(char::is_alphanumeric) => {
                self.write_operand(out, a, name)?;
                write!(out, " {} ", op.name())?;
                self.write_operand(out, b, name)
            }
            Node::Bin(op, a, b) => {
                write!(out, "{}(", op.name())?;
                self.write_expr(out, a, name)?;
                out.write_str(", ")?;
                self.write_expr(out, b, name)?;
                out.write_str(")")
            }
            Node::Cmp(op, a, b) => {
                self.write_operand(out, a, name)?;
                write!(out, " {} ", op.name())?;
                self.write_operand(out, b, name)
            }
            Node::Fma(a, b, c) => {
                out.write_str("fma(")?;
                self.write_expr(out, a, name)?;
                out.write_str(", ")?;
                self.write_expr(out, b, name)?;
                out.write_str(", ")?;
                self.write_expr(out, c, name)?;
                out.write_str(")")
            }
            Node::Select(c, a, b) => {
                out.write_str("select(")?;
                self.write_expr(out, c, name)?;
                out.write_str(", ")?;
                self.write_expr(out, a, name)?;
                out.write_str(", ")?;
                self.write_expr(out, b, name)?;
                out.write_str(")")
            }
        }
    }

    fn write_call(
        &self,
        out: &mut dyn fmt::Write,
        f: &str,
        a: NodeId,
        name: &dyn Fn(&Node) -> String,
    ) -> fmt::Result {
        write!(out, "{f}(")?;
        self.write_expr(out, a, name)?;
        out.write_str(")")
    }

    /// An operand of an infix op: parenthesised unless it is a leaf or a call.
    fn write_operand(
        &self,
        out: &mut dyn fmt::Write,
        id: NodeId,
        name: &dyn Fn(&Node) -> String,
    ) -> fmt::Result {
        let bare = match self.node(id) {
            Node::Bin(op, ..) => op.name().chars().all(char::is_alphanumeric),
            Node::Cmp(..) => false,
            Node::Const(bits) => f32::from_bits(bits) >= 0.0,
            Node::Un(Un::Neg, _) => false,
            _ => true,
        };
        if !bare {
            out.write_str("(")?;
        }
        self.write_expr(out, id, name)?;
        if !bare {
            out.write_str(")")?;
        }
        Ok(())
    }
}

/// The primitive ops' semantics: IEEE single precision, each op rounded once. Emitters must
/// produce the same bits; the reference evaluator is this.
pub mod prim {
    use super::{Bin, Cmp, Un};

    /// A primitive one-operand op (a composite one gives NaN: expand it first).
    pub fn un(op: Un, x: f32) -> f32 {
        match op {
            Un::Neg => -x,
            Un::Abs => x.abs(),
            Un::Sqrt => x.sqrt(),
            Un::Floor => x.floor(),
            Un::Exp2i => exp2i(x),
            Un::Exp2Bits => exp2bits(x),
            Un::Exponent => exponent(x),
            Un::Mantissa => f32::from_bits((x.to_bits() & 0x807f_ffff) | 0x3f80_0000),
            _ => f32::NAN,
        }
    }

    /// `2^k` for integral `k`, clamped to the normal range [-126, 127].
    pub fn exp2i(k: f32) -> f32 {
        let k = k.clamp(-126.0, 127.0) as i32;
        f32::from_bits(((k + 127) as u32) << 23)
    }

    /// The float whose sign and exponent field are `x`'s low 9 bits, its fraction 0.
    pub fn exp2bits(x: f32) -> f32 {
        f32::from_bits(x.to_bits() << 23)
    }

    /// The unbiased exponent field, as a float (-127 for zero and subnormals).
    pub fn exponent(x: f32) -> f32 {
        (((x.to_bits() >> 23) & 0xff) as i32 - 127) as f32
    }

    /// A primitive two-operand op (a composite one gives NaN: expand it first).
    pub fn bin(op: Bin, a: f32, b: f32) -> f32 {
        match op {
            Bin::Add => a + b,
            Bin::Sub => a - b,
            Bin::Mul => a * b,
            Bin::Div => a / b,
            _ => f32::NAN,
        }
    }

    /// `a · b + c` rounded once (IEEE `fusedMultiplyAdd`; `__fmaf_rn`, `llvm.fma.f32`).
    pub fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }

    pub fn cmp(op: Cmp, a: f32, b: f32) -> bool {
        op.holds(a, b)
    }
}

/// How a kernel reads an input or writes an output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    /// A `[rows, width]` buffer: at domain point `(r, c)`, a load or store at column offset
    /// `o` touches element `(r, o + c)`.
    Elem { width: u64 },
    /// A `[rows]` buffer: one value per row (statistics such as a norm's `rstd`).
    Row,
    /// A `[cols]` buffer read at column `c` by every row (a norm's weight, a bias). f32.
    Col,
    /// A `[rows / batch, width]` f32 table with one row per sequence position: domain row `r`
    /// reads table row `r / batch` (rows are sequence-major, `ir::op`); RoPE's cos/sin.
    PerPosition { batch: u64, width: u64 },
}

/// A store of `value` to output `output` at column offset `col_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Store {
    pub output: u32,
    pub col_offset: u64,
    pub value: NodeId,
}

/// Where a value varies: the lattice `Const < Row, Col < Elem`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Const,
    Row,
    Col,
    Elem,
}

impl Level {
    fn join(self, other: Level) -> Level {
        match (self, other) {
            (a, b) if a == b => a,
            (Level::Const, x) | (x, Level::Const) => x,
            _ => Level::Elem,
        }
    }
}

/// A generated kernel (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Kernel {
    /// Columns of the domain; rows are the op's rows.
    pub cols: u64,
    pub inputs: Vec<Access>,
    pub outputs: Vec<Access>,
    pub graph: Graph,
    pub stores: Vec<Store>,
}

impl Kernel {
    /// Where each node's value varies.
    pub fn levels(&self) -> Vec<Level> {
        let mut levels: Vec<Level> = Vec::with_capacity(self.graph.len());
        for node in self.graph.nodes() {
            let level = match *node {
                Node::Param(_) | Node::Const(_) => Level::Const,
                Node::Load { input, .. } => match self.inputs.get(input as usize) {
                    Some(Access::Row) => Level::Row,
                    Some(Access::Col) => Level::Col,
                    _ => Level::Elem,
                },
                Node::RowSum(_) => Level::Row,
                _ => node
                    .operands()
                    .map(|id| levels.get(id.index()).copied().unwrap_or(Level::Elem))
                    .fold(Level::Const, Level::join),
            };
            levels.push(level);
        }
        levels
    }

    /// Checks the invariants of the module docs; the first broken one, described.
    pub fn validate(&self) -> Result<(), String> {
        let levels = self.levels();
        for (i, node) in self.graph.nodes().iter().enumerate() {
            if let Some(bad) = node.operands().find(|id| id.index() >= i) {
                return Err(format!("node {i} reads node {} defined after it", bad.0));
            }
            self.validate_node(i, node, &levels)?;
        }
        self.validate_stores(&levels)
    }

    fn validate_node(&self, i: usize, node: &Node, levels: &[Level]) -> Result<(), String> {
        let g = &self.graph;
        match *node {
            Node::Param(p) => return Err(format!("node {i} is parameter {p}: a kernel has none")),
            Node::Load {
                input,
                col_offset,
                map,
            } => self.validate_load(i, input, col_offset, map)?,
            Node::Select(c, a, b) => {
                if g.ty(c) != Ty::Bool || g.ty(a) != Ty::F32 || g.ty(b) != Ty::F32 {
                    return Err(format!(
                        "node {i}: select needs a comparison and two numbers"
                    ));
                }
            }
            Node::RowSum(a) if levels[a.index()] < Level::Col => {
                return Err(format!(
                    "node {i} sums a value that is constant along the row"
                ));
            }
            _ => {
                if node.operands().any(|id| g.ty(id) != Ty::F32) {
                    return Err(format!("node {i} does arithmetic on a comparison"));
                }
            }
        }
        Ok(())
    }

    fn validate_load(&self, i: usize, input: u32, offset: u64, map: ColMap) -> Result<(), String> {
        match map {
            ColMap::Periodic(0) => return Err(format!("node {i} loads with a period of 0")),
            // A partner outside the domain's heads would be read past the loaded block.
            ColMap::RotateHalf(_) | ColMap::RotatePart { .. } => {
                let (hd, rot) = map.rotated().unwrap_or_default();
                if hd == 0
                    || rot == 0
                    || rot > hd
                    || !rot.is_multiple_of(2)
                    || !self.cols.is_multiple_of(hd)
                {
                    return Err(format!(
                        "node {i} rotates halves of the first {rot} columns of {hd}-column heads, \
                         which must be even, at most the head and divide the {} columns",
                        self.cols
                    ));
                }
            }
            _ => {}
        }
        let end = offset + map.span(self.cols);
        match self.inputs.get(input as usize) {
            None => Err(format!(
                "node {i} loads input {input}, which does not exist"
            )),
            Some(Access::Elem { width } | Access::PerPosition { width, .. }) if end > *width => {
                Err(format!(
                    "node {i} loads columns {offset}..{end} of input {input}, {width} wide"
                ))
            }
            Some(Access::Row | Access::Col) if offset != 0 || map != ColMap::Id => Err(format!(
                "node {i} loads a row or column input at an offset or through a column map"
            )),
            Some(Access::PerPosition { batch: 0, .. }) => {
                Err(format!("node {i} loads a per-position table of batch 0"))
            }
            _ => Ok(()),
        }
    }

    fn validate_stores(&self, levels: &[Level]) -> Result<(), String> {
        for (o, access) in self.outputs.iter().enumerate() {
            let stores: Vec<&Store> = self
                .stores
                .iter()
                .filter(|s| s.output as usize == o)
                .collect();
            if let Some(s) = stores.iter().find(|s| s.value.index() >= self.graph.len()) {
                return Err(format!(
                    "a store to output {o} names node {}, which does not exist",
                    s.value.0
                ));
            }
            match access {
                Access::Elem { width } => {
                    let mut blocks: Vec<u64> = stores.iter().map(|s| s.col_offset).collect();
                    blocks.sort_unstable();
                    let expected: Vec<u64> = (0..width / self.cols.max(1))
                        .map(|b| b * self.cols)
                        .collect();
                    if self.cols == 0 || width % self.cols != 0 || blocks != expected {
                        return Err(format!(
                            "output {o} ({width} wide) is not covered exactly once by stores of {} columns at {blocks:?}",
                            self.cols
                        ));
                    }
                }
                Access::Row => {
                    if stores.len() != 1 || stores[0].col_offset != 0 {
                        return Err(format!("row output {o} needs exactly one store"));
                    }
                    if levels[stores[0].value.index()] > Level::Row {
                        return Err(format!(
                            "row output {o} is stored a value that varies along the row"
                        ));
                    }
                }
                Access::Col | Access::PerPosition { .. } => {
                    return Err(format!(
                        "output {o} is a column vector or table: kernels write rows"
                    ))
                }
            }
        }
        if let Some(s) = self
            .stores
            .iter()
            .find(|s| s.output as usize >= self.outputs.len())
        {
            return Err(format!(
                "a store names output {}, which does not exist",
                s.output
            ));
        }
        if let Some(s) = self
            .stores
            .iter()
            .find(|s| self.graph.ty(s.value) != Ty::F32)
        {
            return Err(format!("output {} is stored a comparison", s.output));
        }
        Ok(())
    }

    /// Whether every node is primitive (what emitters and the evaluator accept).
    pub fn is_expanded(&self) -> bool {
        self.graph.nodes().iter().all(|n| match n {
            Node::Un(op, _) => op.is_primitive(),
            Node::Bin(op, ..) => op.is_primitive(),
            _ => true,
        })
    }
}

/// The IR text form: `y0[+0] = silu(x0) * x1; …`, inputs named `x<i>` (with `[+offset]` for a
/// column block) and outputs `y<i>`.
impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = |n: &Node| match *n {
            Node::Load {
                input,
                col_offset,
                map,
            } => {
                let offset = match col_offset {
                    0 => String::new(),
                    o => format!("+{o}"),
                };
                match map {
                    ColMap::Id if offset.is_empty() => format!("x{input}"),
                    ColMap::Id => format!("x{input}[{offset}]"),
                    ColMap::Periodic(p) => format!("x{input}[c%{p}{offset}]"),
                    ColMap::RotateHalf(hd) => format!("x{input}[rot{hd}{offset}]"),
                    ColMap::RotatePart { head, rot } => {
                        format!("x{input}[rot{rot}of{head}{offset}]")
                    }
                }
            }
            Node::Param(p) => format!("p{p}"),
            _ => String::new(),
        };
        for (i, s) in self.stores.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            match s.col_offset {
                0 => write!(f, "y{} = ", s.output)?,
                o => write!(f, "y{}[+{o}] = ", s.output)?,
            }
            self.graph.write_expr(f, s.value, &name)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
