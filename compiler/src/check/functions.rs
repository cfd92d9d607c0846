//! Expression functions: the language's `fn name(a, b) = expr`, resolved and typed into
//! [`ExprFn`]s. A body is arithmetic (`+ - * /`, unary minus) on its parameters, numbers and
//! file-level constants, calls of the builtins ([`BUILTINS`]) and of other functions (inlined, so
//! each function is one graph), and comparisons, which only a `select`'s condition may hold.
//!
//! What this module reports: unknown names and functions (E0220, with the nearest name), wrong
//! arity (E0221), recursion (E0222, naming the cycle), a comparison used as a number or returned
//! (E0223), definitions that clash with another, a prelude function or a builtin (E0225), what a
//! body may not hold (E0227), and unused parameters (W0220). It also says whether a function can
//! be an MLP activation ([`activation`]: one or two parameters, differentiable; E0224, E0228),
//! and holds the diagnostic for a comparison outside a function body (E0226).
//!
//! Every module (the main file, each stdlib module) checks its own definitions, with the prelude
//! (`stdlib/act.par`) in scope.

use super::number::Number;
use super::suggest;
use crate::diag::{Diagnostic, Diagnostics, Span};
use crate::kir::func::ExprFn;
use crate::kir::{Bin, Graph, NodeId, Ty, Un};
use crate::syntax::ast::{Arg, BinOp, Expr, ExprKind, FnDef, Ident};
use std::collections::HashMap;
use std::sync::Arc;

/// Checked functions by name.
pub type FnTable = HashMap<String, Arc<ExprFn>>;

/// The builtin functions a body may call, with their arity.
pub const BUILTINS: [(&str, usize); 13] = [
    ("exp", 1),
    ("log", 1),
    ("tanh", 1),
    ("erf", 1),
    ("sigmoid", 1),
    ("sqrt", 1),
    ("rsqrt", 1),
    ("abs", 1),
    ("floor", 1),
    ("pow", 2),
    ("min", 2),
    ("max", 2),
    ("select", 3),
];

/// `act = glu(f)`: the gated form of a one-parameter function (a reserved name).
pub const GLU: &str = "glu";

/// Inlined calls nest at most this deep.
const MAX_DEPTH: usize = 64;
/// A function's graph, with every call inlined, has at most this many nodes.
const MAX_NODES: usize = 100_000;

/// A module's functions: those in scope (the prelude's and its own), and the names of its own
/// that have errors (already reported; a use of one stays quiet).
#[derive(Default)]
pub struct Checked {
    pub fns: FnTable,
    pub broken: Vec<String>,
}

/// Check the functions `defs` of one module, with `prelude` in scope.
pub fn check_module<'a>(
    defs: &[&'a FnDef],
    consts: &'a HashMap<String, Number>,
    prelude: &'a FnTable,
    diags: &'a mut Diagnostics,
) -> Checked {
    let mut c = Checker {
        defs: HashMap::new(),
        consts,
        prelude,
        done: HashMap::new(),
        stack: Vec::new(),
        diags,
    };
    let mut order = Vec::new();
    for def in defs {
        if c.admit(def) {
            order.push(def.name.name.as_str());
        }
    }
    for name in order {
        c.build(name);
    }
    let mut out = Checked {
        fns: prelude.clone(),
        broken: Vec::new(),
    };
    for (name, f) in std::mem::take(&mut c.done) {
        match f {
            Some(f) => {
                out.fns.insert(name, f);
            }
            None => out.broken.push(name),
        }
    }
    out
}

/// Whether `f` can be an MLP activation: one parameter (plain) or two (gated: gate, up), and a
/// derivative the compiler can derive. `span` is where the activation is named.
pub fn activation(f: &ExprFn, span: Span) -> Result<(), Diagnostic> {
    if !matches!(f.params.len(), 1 | 2) {
        return Err(Diagnostic::error(
            "E0228",
            format!(
                "`{}` takes {} parameters: an activation takes one (or two, gate and up)",
                f.name,
                f.params.len()
            ),
        )
        .label(span, "used as an activation here")
        .help("use a function `fn f(x) = …`, or a gated one `fn f(gate, up) = …`"));
    }
    match underivable(f) {
        None => Ok(()),
        Some(op) => Err(Diagnostic::error(
            "E0224",
            format!(
                "`{}` cannot be an activation: its `{op}` has no derivative",
                f.name
            ),
        )
        .label(span, "used as an activation here")
        .help("training needs the activation's gradient; write it without floor (a comparison may choose between branches with select)")),
    }
}

/// The most tensors a function applied in the dataflow takes: its backward writes one
/// gradient per input, and a generated kernel has at most this many outputs.
pub const MAX_TENSOR_ARGS: usize = crate::ir::operands::MAX_OUTPUTS;

/// Whether `f` can be applied to tensors in the model's dataflow (`y = f(x)`): at most
/// [`MAX_TENSOR_ARGS`] parameters (E0229) and a derivative the compiler can derive (E0224).
/// `span` is the application.
pub fn on_tensors(f: &ExprFn, span: Span) -> Result<(), Diagnostic> {
    if f.params.len() > MAX_TENSOR_ARGS {
        return Err(Diagnostic::error(
            "E0229",
            format!(
                "`{}` takes {} parameters: a function applied to tensors takes at most {MAX_TENSOR_ARGS}",
                f.name,
                f.params.len()
            ),
        )
        .label(span, "applied here")
        .help("its backward writes one gradient per tensor, and a generated kernel has at most 3 outputs: split the function"));
    }
    match underivable(f) {
        None => Ok(()),
        Some(op) => Err(Diagnostic::error(
            "E0224",
            format!(
                "`{}` cannot be applied to tensors: its `{op}` has no derivative",
                f.name
            ),
        )
        .label(span, "applied here")
        .help("training needs the function's gradient; write it without floor (a comparison may choose between branches with select)")),
    }
}

/// The operation of `f` that has no derivative, if any.
fn underivable(f: &ExprFn) -> Option<String> {
    let mut g = f.graph.clone();
    let params: Vec<NodeId> = (0..f.params.len() as u32).map(|i| g.param(i)).collect();
    let seed = g.param(f.params.len() as u32);
    crate::kir::derive::gradients(&mut g, f.body, &params, seed)
        .err()
        .map(|e| e.op.to_string())
}

/// The gated activation `glu(f)`: `(gate, up) -> f(gate) * up`.
pub fn glu(f: &ExprFn) -> ExprFn {
    let mut graph = Graph::new();
    let (gate, up) = (graph.param(0), graph.param(1));
    let fg = f.apply(&mut graph, &[gate]);
    let body = graph.bin(Bin::Mul, fg, up);
    ExprFn {
        name: format!("{GLU}({})", f.name),
        params: vec!["gate".into(), "up".into()],
        graph,
        body,
    }
}

/// A comparison where only a function body may hold one.
pub fn comparison_outside(span: Span) -> Diagnostic {
    Diagnostic::error("E0226", "a comparison outside a function body")
        .label(span, "comparison")
        .help("comparisons are for `select` conditions inside `fn name(x) = …`; settings and layer arguments are numbers")
}

struct Checker<'a> {
    defs: HashMap<&'a str, &'a FnDef>,
    consts: &'a HashMap<String, Number>,
    prelude: &'a FnTable,
    /// Built functions (`None`: had an error, already reported).
    done: HashMap<String, Option<Arc<ExprFn>>>,
    /// The functions being built, outermost first (a call of one of them is recursion).
    stack: Vec<&'a str>,
    diags: &'a mut Diagnostics,
}

/// A body being built: its definition and graph.
struct Body<'a> {
    def: &'a FnDef,
    graph: Graph,
}

impl<'a> Checker<'a> {
    /// Accept `def` as a definition of this module, unless its name is taken.
    fn admit(&mut self, def: &'a FnDef) -> bool {
        let name = def.name.name.as_str();
        let clash = if let Some(first) = self.defs.get(name) {
            Some(
                Diagnostic::error("E0225", format!("function `{name}` is defined twice"))
                    .label(def.name.span, "defined again here")
                    .label(first.name.span, "first definition")
                    .help("rename one of them"),
            )
        } else if self.prelude.contains_key(name) {
            Some(
                Diagnostic::error(
                    "E0225",
                    format!("`{name}` is a prelude function (stdlib/act.par)"),
                )
                .label(def.name.span, "defined here")
                .help(format!(
                    "the prelude's `{name}` is in scope everywhere; give yours another name"
                )),
            )
        } else if BUILTINS.iter().any(|(b, _)| *b == name) || name == GLU {
            Some(
                Diagnostic::error("E0225", format!("`{name}` is a builtin function"))
                    .label(def.name.span, "defined here")
                    .help("give the function another name"),
            )
        } else {
            None
        };
        if let Some(d) = clash {
            self.diags.push(d);
            return false;
        }
        self.defs.insert(name, def);
        true
    }

    /// The function `name` of this module, built once.
    fn build(&mut self, name: &'a str) -> Option<Arc<ExprFn>> {
        if let Some(done) = self.done.get(name) {
            return done.clone();
        }
        let def = *self.defs.get(name)?;
        self.stack.push(name);
        let mut body = Body {
            def,
            graph: Graph::new(),
        };
        let root = self.expr(&mut body, &def.body);
        self.stack.pop();
        self.unused_params(def);
        let f = root.and_then(|root| self.result(def, body.graph, root));
        self.done.insert(name.to_string(), f.clone());
        f
    }

    fn result(&mut self, def: &FnDef, graph: Graph, root: NodeId) -> Option<Arc<ExprFn>> {
        if graph.ty(root) == Ty::Bool {
            self.diags.push(
                Diagnostic::error(
                    "E0223",
                    format!("function `{}` returns a comparison", def.name.name),
                )
                .label(def.body.span, "a comparison, not a number")
                .help("return a number: choose between values with `select(cond, a, b)`"),
            );
            return None;
        }
        Some(Arc::new(ExprFn {
            name: def.name.name.clone(),
            params: def.params.iter().map(|p| p.name.clone()).collect(),
            graph,
            body: root,
        }))
    }

    fn unused_params(&mut self, def: &FnDef) {
        let mut seen: Vec<&str> = Vec::new();
        for p in &def.params {
            if seen.contains(&p.name.as_str()) {
                self.diags.push(
                    Diagnostic::error("E0225", format!("parameter `{}` is declared twice", p.name))
                        .label(p.span, "again here")
                        .help("give each parameter its own name"),
                );
            } else if !mentions(&def.body, &p.name) {
                self.diags.push(
                    Diagnostic::warning(
                        "W0220",
                        format!(
                            "parameter `{}` of function `{}` is never used",
                            p.name, def.name.name
                        ),
                    )
                    .label(p.span, "declared here")
                    .help("remove it, or use it in the body"),
                );
            }
            seen.push(&p.name);
        }
    }

    fn err(&mut self, d: Diagnostic) -> Option<NodeId> {
        self.diags.push(d);
        None
    }

    /// A value of any type (a number or a comparison).
    fn expr(&mut self, b: &mut Body<'a>, e: &'a Expr) -> Option<NodeId> {
        match &e.kind {
            ExprKind::Number { text, unit } => self.number_literal(b, text, unit.as_deref(), e),
            ExprKind::Path(p) if p.len() == 1 => self.name(b, &p[0]),
            ExprKind::Neg(x) => {
                let x = self.number(b, x)?;
                Some(b.graph.un(Un::Neg, x))
            }
            ExprKind::Binary(op, x, y) => {
                let (x, y) = (self.number(b, x), self.number(b, y));
                let op = match op {
                    BinOp::Add => Bin::Add,
                    BinOp::Sub => Bin::Sub,
                    BinOp::Mul => Bin::Mul,
                    BinOp::Div => Bin::Div,
                };
                Some(b.graph.bin(op, x?, y?))
            }
            ExprKind::Compare(op, x, y) => {
                let (x, y) = (self.number(b, x), self.number(b, y));
                Some(b.graph.cmp(*op, x?, y?))
            }
            ExprKind::Call { callee, args } => self.call(b, callee, args, e.span),
            _ => self.err(not_allowed(e.span, &b.def.name.name)),
        }
    }

    /// A number: a comparison here is an error.
    fn number(&mut self, b: &mut Body<'a>, e: &'a Expr) -> Option<NodeId> {
        let id = self.expr(b, e)?;
        if b.graph.ty(id) == Ty::Bool {
            return self.err(
                Diagnostic::error("E0223", "a comparison used as a number")
                    .label(e.span, "a comparison, not a number")
                    .help("a comparison can only be select's condition: `select(x > 0, x, 0)`"),
            );
        }
        Some(id)
    }

    fn number_literal(
        &mut self,
        b: &mut Body,
        text: &str,
        unit: Option<&str>,
        e: &Expr,
    ) -> Option<NodeId> {
        if let Some(unit) = unit {
            return self.err(
                Diagnostic::error("E0227", format!("a unit (`{unit}`) in a function body"))
                    .label(e.span, "this number")
                    .help("function bodies compute with plain numbers; remove the unit"),
            );
        }
        let n = match Number::literal(text, None, e.span) {
            Ok(n) => n,
            Err(d) => return self.err(d),
        };
        self.constant(b, n.value, e.span)
    }

    fn constant(&mut self, b: &mut Body, value: f64, span: Span) -> Option<NodeId> {
        let v = value as f32;
        if !v.is_finite() {
            return self.err(
                Diagnostic::error("E0903", format!("{value} is outside f32's range"))
                    .label(span, "this number")
                    .help(format!("use a number of magnitude at most {:e}", f32::MAX)),
            );
        }
        Some(b.graph.constant(v))
    }

    /// A bare name: a parameter or a file-level constant.
    fn name(&mut self, b: &mut Body, id: &Ident) -> Option<NodeId> {
        if let Some(i) = b.def.params.iter().position(|p| p.name == id.name) {
            return Some(b.graph.param(i as u32));
        }
        if let Some(n) = self.consts.get(&id.name) {
            return self.constant(b, n.value, id.span);
        }
        if self.is_function(&id.name) {
            return self.err(
                Diagnostic::error("E0220", format!("`{}` is a function, not a value", id.name))
                    .label(id.span, "not called")
                    .help(format!("call it: `{}(…)`", id.name)),
            );
        }
        let mut names: Vec<&str> = b.def.params.iter().map(|p| p.name.as_str()).collect();
        names.extend(self.consts.keys().map(String::as_str));
        let rest = format!(
            "a body uses its parameters ({}), numbers and file-level `let` constants",
            suggest::one_of(
                &b.def
                    .params
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
            )
        );
        self.err(
            Diagnostic::error(
                "E0220",
                format!(
                    "unknown name `{}` in function `{}`",
                    id.name, b.def.name.name
                ),
            )
            .label(id.span, "not defined")
            .help(suggest::help(&id.name, names, &rest)),
        )
    }

    fn is_function(&self, name: &str) -> bool {
        self.defs.contains_key(name)
            || self.prelude.contains_key(name)
            || BUILTINS.iter().any(|(b, _)| *b == name)
    }

    fn call(
        &mut self,
        b: &mut Body<'a>,
        callee: &'a Expr,
        args: &'a [Arg],
        span: Span,
    ) -> Option<NodeId> {
        let Some(name) = callee.as_word() else {
            return self.err(not_allowed(callee.span, &b.def.name.name));
        };
        let mut positional = Vec::new();
        for a in args {
            match a {
                Arg::Positional(x) => positional.push(x),
                Arg::Named(n, _) => {
                    return self.err(
                        Diagnostic::error("E0227", "named arguments in a function body")
                            .label(n.span, "named argument")
                            .help("pass a function's arguments by position: `f(x, y)`"),
                    )
                }
            }
        }
        if let Some(&(_, arity)) = BUILTINS.iter().find(|(b, _)| *b == name.name) {
            self.arity(name, arity, positional.len(), span)?;
            return self.builtin(b, &name.name, &positional);
        }
        let params = match (
            self.defs.get(name.name.as_str()),
            self.prelude.get(&name.name),
        ) {
            (Some(def), _) => def.params.len(),
            (None, Some(f)) => f.params.len(),
            (None, None) => return self.err(self.unknown_function(name)),
        };
        self.arity(name, params, positional.len(), span)?;
        let mut ids = Vec::new();
        for x in &positional {
            ids.push(self.number(b, x));
        }
        let ids: Vec<NodeId> = ids.into_iter().collect::<Option<_>>()?;
        let f = self.callee(&name.name, name.span)?;
        let id = f.apply(&mut b.graph, &ids);
        if b.graph.len() > MAX_NODES {
            return self.err(
                Diagnostic::error(
                    "E0227",
                    format!(
                        "function `{}` grows past {MAX_NODES} operations when its calls are inlined",
                        b.def.name.name
                    ),
                )
                .label(span, "this call")
                .help("simplify the function: every call is inlined into one kernel"),
            );
        }
        Some(id)
    }

    /// The function a call names, built (or the prelude's); recursion is an error here.
    fn callee(&mut self, name: &str, span: Span) -> Option<Arc<ExprFn>> {
        let Some((&key, _)) = self.defs.get_key_value(name) else {
            return self.prelude.get(name).cloned();
        };
        if let Some(pos) = self.stack.iter().position(|s| *s == key) {
            let mut cycle: Vec<&str> = self.stack[pos..].to_vec();
            cycle.push(key);
            self.diags.push(
                Diagnostic::error(
                    "E0222",
                    format!("recursive function definition: {}", cycle.join(" → ")),
                )
                .label(span, "calls back into the cycle here")
                .help("functions are inlined into one kernel, so they cannot call themselves, directly or through others"),
            );
            return None;
        }
        if self.stack.len() >= MAX_DEPTH {
            self.diags.push(
                Diagnostic::error(
                    "E0222",
                    format!("functions call functions more than {MAX_DEPTH} deep"),
                )
                .label(span, "called here")
                .help("flatten the chain of calls"),
            );
            return None;
        }
        self.build(key)
    }

    fn arity(&mut self, name: &Ident, want: usize, found: usize, span: Span) -> Option<()> {
        if want == found {
            return Some(());
        }
        let s = |n: usize| if n == 1 { "" } else { "s" };
        self.diags.push(
            Diagnostic::error(
                "E0221",
                format!(
                    "`{}` takes {want} argument{}, found {found}",
                    name.name,
                    s(want)
                ),
            )
            .label(span, format!("{found} argument{}", s(found)))
            .help(format!("pass exactly {want} argument{}", s(want))),
        );
        None
    }

    fn builtin(&mut self, b: &mut Body<'a>, name: &str, args: &[&'a Expr]) -> Option<NodeId> {
        if name == "select" {
            return self.select(b, args);
        }
        let mut ids = Vec::new();
        for x in args {
            ids.push(self.number(b, x));
        }
        let ids: Vec<NodeId> = ids.into_iter().collect::<Option<_>>()?;
        match (Un::from_name(name), Bin::from_name(name), ids.as_slice()) {
            (Some(op), _, [x]) => Some(b.graph.un(op, *x)),
            (_, Some(op), [x, y]) => Some(b.graph.bin(op, *x, *y)),
            _ => None,
        }
    }

    fn select(&mut self, b: &mut Body<'a>, args: &[&'a Expr]) -> Option<NodeId> {
        let [cond, x, y] = args else { return None };
        let c = self.expr(b, cond);
        let (x, y) = (self.number(b, x), self.number(b, y));
        let c = c?;
        if b.graph.ty(c) != Ty::Bool {
            return self.err(
                Diagnostic::error("E0223", "select's condition must be a comparison")
                    .label(cond.span, "a number, not a comparison")
                    .help("write a comparison: `select(x > 0, x, 0)`"),
            );
        }
        Some(b.graph.select(c, x?, y?))
    }

    fn unknown_function(&self, name: &Ident) -> Diagnostic {
        let mut names: Vec<&str> = self.defs.keys().copied().collect();
        names.extend(self.prelude.keys().map(String::as_str));
        names.extend(BUILTINS.iter().map(|(b, _)| *b));
        names.sort_unstable();
        let builtins: Vec<&str> = BUILTINS.iter().map(|(b, _)| *b).collect();
        let rest = format!(
            "the builtins are {}; define others with `fn {}(x) = …`",
            suggest::one_of(&builtins),
            name.name
        );
        Diagnostic::error("E0220", format!("unknown function `{}`", name.name))
            .label(name.span, "not defined")
            .help(suggest::did_you_mean(&name.name, names, &rest))
    }
}

/// Whether `e` names `name` anywhere (as a value or an argument).
fn mentions(e: &Expr, name: &str) -> bool {
    match &e.kind {
        ExprKind::Path(p) => p.first().is_some_and(|i| i.name == name),
        ExprKind::Neg(x) | ExprKind::Rename(x, _) => mentions(x, name),
        ExprKind::Binary(_, x, y) | ExprKind::Compare(_, x, y) => {
            mentions(x, name) || mentions(y, name)
        }
        ExprKind::Call { callee, args } => {
            mentions(callee, name)
                || args.iter().any(|a| match a {
                    Arg::Positional(x) | Arg::Named(_, x) => mentions(x, name),
                })
        }
        ExprKind::List(xs) | ExprKind::Tuple(xs) => xs.iter().any(|x| mentions(x, name)),
        _ => false,
    }
}

fn not_allowed(span: Span, f: &str) -> Diagnostic {
    Diagnostic::error("E0227", format!("this is not allowed in the body of function `{f}`"))
        .label(span, "here")
        .help("a body is arithmetic on its parameters and numbers, calls of functions, and comparisons in select")
}

#[cfg(test)]
mod tests;
