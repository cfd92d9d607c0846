//! Elaboration of the `model` item: constants evaluated, blocks called, `repeat` expanded, layers
//! built and applied, every value's shape inferred and checked, node names assigned, tied
//! weights and `shard` lines resolved. Produces the model part of the [`Spec`](crate::spec::Spec).
//!
//! Node names (they become parameter names, so they are stable): a layer named with `as` keeps
//! that name; otherwise it gets its kind's default (`embed`, `pos`, `ln`, `linear`, `attn`, `mlp`,
//! `add`, `loss`), numbered from 1 (`ln1`, `ln2`) when one scope holds several of a kind. The
//! top-level `repeat` makes scopes `blocks.0`, `blocks.1`, … (or `NAME.i` with `repeat n as NAME`);
//! block calls do not add a scope.

mod finish;

use super::functions;
use super::layers::{self, ArgValue, Bound, Ctor};
use super::number::{arith, Number};
use super::rope;
use super::suggest;
use super::{Namespace, Overrides};
use crate::diag::{Diagnostic, Diagnostics, Span};
use crate::kir::func::ExprFn;
use crate::spec::Activation;
use crate::spec::{LayerKind, Model, Node, NodeId, Shape, Sharding, Value, ValueId};
use crate::syntax::ast::*;
use std::collections::HashMap;
use std::sync::Arc;

/// Block calls nest at most this deep (a block calling itself is an error, not a hang).
const MAX_DEPTH: u32 = 32;
/// Upper bounds that keep `check` fast on any input.
const MAX_LAYERS: u64 = 4096;
const MAX_NODES: usize = 100_000;

/// A value during elaboration.
#[derive(Clone, Debug)]
pub enum Val {
    Num(Number),
    Bool(bool, Span),
    /// A bare word: an activation (`gelu`), `none`, or a layer name used by `tied`.
    Word(String, Span),
    Tensor(ValueId, Span),
    Layer(Box<Ctor>),
    Rope(crate::spec::Rope, Span),
    /// `tag { field: value, … }`: RoPE's `scaling = llama3 { … }`, its fields evaluated.
    Tagged(Arc<layers::Tagged>),
    /// An expression function (`fn`, the prelude's), named as an activation.
    Fn(Arc<ExprFn>, Span),
    /// A block or built-in layer kind, not yet called.
    Callable(Callee, Span),
    /// Something already reported; stays quiet from here on.
    Poison,
}

#[derive(Clone, Debug)]
pub enum Callee {
    Builtin(&'static str),
    /// `glu(f)`: the gated form of a one-parameter function.
    Glu,
    Block {
        module: usize,
        name: String,
    },
    /// A block called with its parameters, waiting for its inputs.
    BlockArgs {
        module: usize,
        name: String,
        params: HashMap<String, Val>,
    },
}

/// The elaborated model before the plan is known.
pub struct Elaborated {
    pub model: Model,
    /// The top-level `repeat`'s count expression span (for `layers % pp` diagnostics).
    pub layers_span: Span,
    /// Model-level constants (visible to the other sections).
    pub consts: HashMap<String, Number>,
    /// Node argument spans by parameter name (`heads`, `kv_heads`, `hidden`, `vocab`).
    pub arg_spans: Vec<HashMap<&'static str, Span>>,
    /// Where the sequence length of the `tokens` input was written.
    pub seq_span: Span,
    /// The model's name where it is declared (`model NAME`).
    pub name_span: Span,
    /// Shard lines, resolved.
    pub shard_items: Vec<(ShardTarget, Span, Span)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardTarget {
    AttentionHeadsTp,
    AttentionSeqCp,
    MlpHiddenTp,
    VocabTp,
}

struct Pending {
    kind: LayerKind,
    inputs: Vec<ValueId>,
    output: ValueId,
    layer: Option<u32>,
    span: Span,
    scope: String,
    explicit: Option<Ident>,
    tied: Option<(String, Span)>,
    arg_spans: HashMap<&'static str, Span>,
}

pub struct Elab<'a> {
    ns: &'a [Namespace],
    overrides: &'a mut Overrides,
    diags: &'a mut Diagnostics,
    nodes: Vec<Pending>,
    values: Vec<Value>,
    scope: String,
    layer: Option<u32>,
    depth: u32,
    repeat: Option<(u32, Span)>,
    too_big: bool,
    /// A function with errors (reported before elaboration) was used: the graph is incomplete.
    used_broken: bool,
}

type Frame = HashMap<String, Val>;

impl<'a> Elab<'a> {
    pub fn new(
        ns: &'a [Namespace],
        overrides: &'a mut Overrides,
        diags: &'a mut Diagnostics,
    ) -> Elab<'a> {
        Elab {
            ns,
            overrides,
            diags,
            nodes: Vec::new(),
            values: Vec::new(),
            scope: String::new(),
            layer: None,
            depth: 0,
            repeat: None,
            too_big: false,
            used_broken: false,
        }
    }

    fn err(&mut self, d: Diagnostic) -> Val {
        self.diags.push(d);
        Val::Poison
    }

    /// Elaborate `model` (from module 0, the main file).
    pub fn model(mut self, def: &ModelDef) -> Option<Elaborated> {
        let errors_before = self.diags.error_count();
        let mut frame: Frame = HashMap::new();
        let mut inputs: Vec<(Ident, ValueId, Span)> = Vec::new();
        let mut seq: Option<(u64, Span)> = None;
        let mut consts = HashMap::new();
        let mut shard_lines = Vec::new();
        for stmt in &def.stmts {
            match stmt {
                Stmt::Let(l) => {
                    let path = format!("model.{}", l.name.name);
                    let v = match self.overrides.take(&path) {
                        Some(expr) => self.eval(&expr, &frame, 0),
                        None => self.eval(&l.value, &frame, 0),
                    };
                    if let Val::Num(n) = &v {
                        consts.insert(l.name.name.clone(), *n);
                    }
                    self.bind(&mut frame, &l.name, v, true);
                }
                Stmt::Input(inp) => {
                    if inp.batch.as_word().map(|w| w.name.as_str()) != Some("batch") {
                        self.err(
                            Diagnostic::error("E0307", "an input's first dimension must be `batch`")
                                .label(inp.batch.span, "here")
                                .help("write `input tokens : [batch, seq] i32`: the batch size comes from `train`"),
                        );
                    }
                    if let Val::Num(n) = self.eval(&inp.seq, &frame, 0) {
                        match n.as_count_in("the sequence length", 1, Some(layers::MAX_DIM)) {
                            Ok(s) if s > layers::MAX_DIM => {
                                self.err(
                                    Diagnostic::error(
                                        "E0903",
                                        format!(
                                            "seq = {s} is more than parc supports ({})",
                                            layers::MAX_DIM
                                        ),
                                    )
                                    .label(n.span, "too large")
                                    .help(format!(
                                        "use a sequence length of at most {}",
                                        layers::MAX_DIM
                                    )),
                                );
                            }
                            Ok(s) if s > 0 => seq = Some((s, n.span)),
                            Ok(_) => {
                                self.err(
                                    Diagnostic::error(
                                        "E0903",
                                        "the sequence length must be at least 1",
                                    )
                                    .label(n.span, "zero")
                                    .help("use a positive sequence length"),
                                );
                            }
                            Err(d) => {
                                self.err(d);
                            }
                        }
                    }
                    if !matches!(inp.dtype.name.as_str(), "i32" | "i64" | "u16" | "u32") {
                        self.err(
                            Diagnostic::error(
                                "E0902",
                                format!(
                                    "inputs are token ids; `{}` is not an integer type",
                                    inp.dtype.name
                                ),
                            )
                            .label(inp.dtype.span, "this type")
                            .help("use `i32`"),
                        );
                    }
                    let id = self.new_value(&inp.name.name, Shape::Tokens, inp.name.span);
                    inputs.push((inp.name.clone(), id, inp.span));
                    self.bind(&mut frame, &inp.name, Val::Tensor(id, inp.name.span), true);
                }
                Stmt::Assign { name, value, .. } => {
                    let v = match &value.kind {
                        ExprKind::Repeat {
                            count,
                            name: rname,
                            body,
                        } => self.repeat(name, count, rname.as_ref(), body, value.span, &mut frame),
                        _ => self.eval(value, &frame, 0),
                    };
                    self.bind(&mut frame, name, v, false);
                }
                Stmt::Shard(items) => shard_lines.extend(items.iter().cloned()),
            }
        }
        // After an error the graph is incomplete: "no loss" or "unused input" would only echo it.
        let quiet = self.diags.error_count() > errors_before || self.used_broken;
        self.finish(def, inputs, seq, consts, &shard_lines, quiet)
    }

    fn bind(&mut self, frame: &mut Frame, name: &Ident, v: Val, fresh: bool) {
        if fresh && frame.contains_key(&name.name) {
            self.err(
                Diagnostic::error("E0204", format!("`{}` is defined twice", name.name))
                    .label(name.span, "defined again here")
                    .help(format!("rename one of the `{}`s", name.name)),
            );
        }
        frame.insert(name.name.clone(), v);
    }

    fn new_value(&mut self, name: &str, shape: Shape, span: Span) -> ValueId {
        self.values.push(Value {
            name: name.to_string(),
            shape,
            span,
        });
        ValueId(self.values.len() as u32 - 1)
    }

    fn repeat(
        &mut self,
        target: &Ident,
        count: &Expr,
        name: Option<&Ident>,
        body: &Body,
        span: Span,
        frame: &mut Frame,
    ) -> Val {
        if let Some((_, first)) = self.repeat {
            return self.err(
                Diagnostic::error("E0210", "a model has at most one `repeat`")
                    .label(span, "second `repeat`")
                    .label(first, "first `repeat`")
                    .help("put everything that repeats into one block and repeat that"),
            );
        }
        let n = match self.eval(count, frame, 0) {
            Val::Num(n) => match n.as_count_in("the repeat count", 0, Some(MAX_LAYERS)) {
                Ok(v) if v > MAX_LAYERS => {
                    return self.err(
                        Diagnostic::error(
                            "E0903",
                            format!("repeat {v} times is more than parc supports ({MAX_LAYERS})"),
                        )
                        .label(n.span, "too many")
                        .help(format!("use at most {MAX_LAYERS} layers")),
                    )
                }
                Ok(v) => v as u32,
                Err(d) => return self.err(d),
            },
            Val::Poison => return Val::Poison,
            _ => {
                return self.err(
                    Diagnostic::error("E0902", "the repeat count must be a number")
                        .label(count.span, "not a number")
                        .help("write `repeat layers { … }` with `let layers = 12`"),
                )
            }
        };
        self.repeat = Some((n, count.span));
        let prefix = name
            .map(|i| i.name.clone())
            .unwrap_or_else(|| "blocks".into());
        let mut cur = frame.get(&target.name).cloned().unwrap_or(Val::Poison);
        for i in 0..n {
            if self.too_big {
                break;
            }
            self.scope = format!("{prefix}.{i}");
            self.layer = Some(i);
            let mut inner = frame.clone();
            inner.insert(target.name.clone(), cur);
            cur = self.body(body, &mut inner, 0);
        }
        self.scope.clear();
        self.layer = None;
        cur
    }

    fn body(&mut self, body: &Body, frame: &mut Frame, module: usize) -> Val {
        for stmt in &body.stmts {
            match stmt {
                Stmt::Let(l) => {
                    let v = self.eval(&l.value, frame, module);
                    self.bind(frame, &l.name, v, true);
                }
                Stmt::Assign { name, value, .. } => {
                    let v = self.eval(value, frame, module);
                    self.bind(frame, name, v, false);
                }
                Stmt::Input(i) => {
                    self.err(
                        Diagnostic::error(
                            "E0307",
                            "inputs are declared in the model, not in a block",
                        )
                        .label(i.span, "here")
                        .help("pass tensors to a block as its inputs: `Block(…)(x)`"),
                    );
                }
                Stmt::Shard(_) => {}
            }
        }
        self.eval(&body.result, frame, module)
    }

    fn lookup(&mut self, id: &Ident, frame: &Frame, module: usize) -> Val {
        if let Some(v) = frame.get(&id.name) {
            return v.clone();
        }
        let ns = &self.ns[module];
        if let Some(n) = ns.consts.get(&id.name) {
            return Val::Num(*n);
        }
        if let Some((m, name)) = ns.blocks.get(&id.name) {
            return Val::Callable(
                Callee::Block {
                    module: *m,
                    name: name.clone(),
                },
                id.span,
            );
        }
        if let Some(b) = layers::BUILTINS.iter().find(|b| **b == id.name) {
            return Val::Callable(Callee::Builtin(b), id.span);
        }
        if id.name == "none" || Activation::from_name(&id.name).is_some() {
            return Val::Word(id.name.clone(), id.span);
        }
        if let Some(f) = ns.fns.get(&id.name) {
            return Val::Fn(f.clone(), id.span);
        }
        if ns.broken_fns.contains(&id.name) {
            self.used_broken = true;
            return Val::Poison;
        }
        if id.name == functions::GLU {
            return Val::Callable(Callee::Glu, id.span);
        }
        let mut names: Vec<&str> = frame.keys().map(String::as_str).collect();
        names.extend(ns.consts.keys().map(String::as_str));
        names.extend(ns.blocks.keys().map(String::as_str));
        names.extend(ns.fns.keys().map(String::as_str));
        names.extend(layers::BUILTINS);
        for name in Activation::names() {
            names.push(name);
        }
        let builtin = functions::BUILTINS.iter().find(|(b, _)| *b == id.name);
        let help = match (builtin, suggest::closest(&id.name, names.iter().copied())) {
            (Some((b, arity)), _) => {
                let params = ["x", "y", "z"][..(*arity).min(3)].join(", ");
                format!(
                    "`{b}` is a builtin, called only inside a function's body; wrap it in a \
                     function to use it as an activation or on tensors: \
                     `fn my_{b}({params}) = {b}({params})`"
                )
            }
            (None, Some(s)) => format!("did you mean `{s}`?"),
            (None, None) if id.name.chars().next().is_some_and(char::is_uppercase) => {
                "define it with `block` or import it with `use std::gpt2 { Block }`".into()
            }
            (None, None) => "define it first with `let` or an assignment".into(),
        };
        self.err(
            Diagnostic::error("E0201", format!("unknown name `{}`", id.name))
                .label(id.span, "not defined here")
                .help(help),
        )
    }

    /// Evaluate an expression in `frame`, with globals from `module`.
    fn eval(&mut self, e: &Expr, frame: &Frame, module: usize) -> Val {
        if self.too_big {
            return Val::Poison;
        }
        match &e.kind {
            ExprKind::Number { text, unit } => match Number::literal(text, unit.as_deref(), e.span)
            {
                Ok(n) => Val::Num(n),
                Err(d) => self.err(d),
            },
            ExprKind::Str(_) => self.err(
                Diagnostic::error("E0902", "strings are not values in a model")
                    .label(e.span, "here")
                    .help("models use numbers, names and layer calls"),
            ),
            ExprKind::Bool(b) => Val::Bool(*b, e.span),
            ExprKind::Path(p) if p.len() == 1 => self.lookup(&p[0], frame, module),
            ExprKind::Path(p) => {
                let text: Vec<&str> = p.iter().map(|i| i.name.as_str()).collect();
                Val::Word(text.join("."), e.span)
            }
            ExprKind::Neg(x) => match self.eval(x, frame, module) {
                Val::Num(n) => Val::Num(n.neg(e.span)),
                Val::Poison => Val::Poison,
                _ => self.err(
                    Diagnostic::error("E0902", "only numbers can be negated")
                        .label(e.span, "here")
                        .help("remove the `-`"),
                ),
            },
            ExprKind::Binary(op, a, b) => {
                let (va, vb) = (self.eval(a, frame, module), self.eval(b, frame, module));
                self.binary(*op, va, vb, e.span)
            }
            ExprKind::Compare(..) => self.err(functions::comparison_outside(e.span)),
            ExprKind::Call { callee, args } => {
                let f = self.eval(callee, frame, module);
                if let Some(d) = compound_for_unknown_param(&f, args) {
                    return self.err(d);
                }
                if let Some(d) = self.shadowed_callee(callee, &f, frame, module) {
                    return self.err(d);
                }
                let mut vals = Vec::new();
                for a in args {
                    match a {
                        Arg::Positional(x) => {
                            vals.push((None, self.eval(x, frame, module), x.span))
                        }
                        // `tied = embed` names a layer, resolved once layers have names.
                        Arg::Named(n, x)
                            if n.name == "tied" && matches!(x.kind, ExprKind::Path(_)) =>
                        {
                            let v = match &x.kind {
                                ExprKind::Path(p) => Val::Word(
                                    p.iter()
                                        .map(|i| i.name.as_str())
                                        .collect::<Vec<_>>()
                                        .join("."),
                                    x.span,
                                ),
                                _ => Val::Poison,
                            };
                            vals.push((Some(n.clone()), v, x.span))
                        }
                        Arg::Named(n, x) => {
                            vals.push((Some(n.clone()), self.eval(x, frame, module), x.span))
                        }
                    }
                }
                self.call(f, vals, e.span, module)
            }
            ExprKind::Rename(x, name) => {
                let v = self.eval(x, frame, module);
                self.rename(v, name)
            }
            ExprKind::Repeat { .. } => self.err(
                Diagnostic::error(
                    "E0210",
                    "`repeat` must be the whole right side of a top-level model assignment",
                )
                .label(e.span, "here")
                .help("write `x = repeat layers { Block(…)(x) }` at the top level of the model"),
            ),
            ExprKind::Tagged { tag, fields } => self.tagged(tag, fields, e.span, frame, module),
            ExprKind::Record(_) | ExprKind::List(_) | ExprKind::Tuple(_) => self.err(
                Diagnostic::error(
                    "E0902",
                    "records, lists and tuples are not values in a model",
                )
                .label(e.span, "here")
                .help("models use numbers, names and layer calls"),
            ),
        }
    }

    /// `tag { field: value, … }` with its fields evaluated: a layer argument's value (RoPE's
    /// `scaling`), which the layer reads; a field that is a tensor or a layer is E0902.
    fn tagged(
        &mut self,
        tag: &Ident,
        fields: &[Field],
        span: Span,
        frame: &Frame,
        module: usize,
    ) -> Val {
        let mut out = Vec::new();
        for f in fields {
            let value = match self.eval(&f.value, frame, module) {
                Val::Poison => return Val::Poison,
                Val::Num(n) => ArgValue::Num(n),
                Val::Bool(b, s) => ArgValue::Bool(b, s),
                Val::Word(w, s) => ArgValue::Word(w, s),
                Val::Tagged(t) => ArgValue::Tagged(t),
                _ => {
                    return self.err(
                        Diagnostic::error(
                            "E0902",
                            format!(
                                "`{}`'s `{}` cannot be a tensor or layer",
                                tag.name, f.name.name
                            ),
                        )
                        .label(f.value.span, "this value")
                        .help("fields are numbers, `true`/`false` or names"),
                    )
                }
            };
            out.push((f.name.clone(), value));
        }
        Val::Tagged(Arc::new(layers::Tagged {
            tag: tag.clone(),
            fields: out,
            span,
        }))
    }

    fn binary(&mut self, op: BinOp, a: Val, b: Val, span: Span) -> Val {
        match (a, b) {
            (Val::Poison, _) | (_, Val::Poison) => Val::Poison,
            (Val::Num(x), Val::Num(y)) => match arith(op, x, y, span) {
                Ok(n) => Val::Num(n),
                Err(d) => self.err(d),
            },
            (Val::Tensor(x, xs), Val::Tensor(y, ys)) if op == BinOp::Add => {
                self.add(x, y, xs, ys, span)
            }
            // `Embedding(…)(tokens) + PositionEmbedding(seq, d)`: the positions apply to the left.
            (Val::Tensor(x, xs), Val::Layer(c)) | (Val::Layer(c), Val::Tensor(x, xs))
                if op == BinOp::Add && matches!(c.kind, LayerKind::PositionEmbedding { .. }) =>
            {
                self.apply(*c, vec![(x, xs)], span)
            }
            (a, b) => {
                let what = |v: &Val| match v {
                    Val::Num(_) => "a number",
                    Val::Tensor(..) => "a tensor",
                    Val::Layer(_) | Val::Callable(..) => "a layer",
                    Val::Tagged(_) => "a record",
                    _ => "a value",
                };
                let (wa, wb) = (what(&a), what(&b));
                self.err(
                    Diagnostic::error("E0902", format!("cannot apply `{}` to {wa} and {wb}", op.symbol()))
                        .label(span, "here")
                        .help("tensors are only added (`x + y`), numbers use + - * /; apply a layer to a tensor with `Layer(…)(x)`"),
                )
            }
        }
    }

    fn add(&mut self, x: ValueId, y: ValueId, xs: Span, ys: Span, span: Span) -> Val {
        let (sx, sy) = (
            self.values[x.0 as usize].shape.clone(),
            self.values[y.0 as usize].shape.clone(),
        );
        if sx != sy || !matches!(sx, Shape::Hidden(_)) {
            return self.err(
                Diagnostic::error(
                    "E0302",
                    format!(
                        "residual add of {} and {}",
                        layers::describe(&sx),
                        layers::describe(&sy)
                    ),
                )
                .label(xs, layers::describe(&sx))
                .label(ys, layers::describe(&sy))
                .help("both sides of `+` must be hidden states of one width"),
            );
        }
        self.node(LayerKind::Add, vec![x, y], sx, span, HashMap::new(), None)
    }

    fn node(
        &mut self,
        kind: LayerKind,
        inputs: Vec<ValueId>,
        shape: Shape,
        span: Span,
        arg_spans: HashMap<&'static str, Span>,
        tied: Option<(String, Span)>,
    ) -> Val {
        if self.nodes.len() >= MAX_NODES {
            if !self.too_big {
                self.too_big = true;
                return self.err(
                    Diagnostic::error(
                        "E0903",
                        format!("the model has more than {MAX_NODES} layers"),
                    )
                    .label(span, "here")
                    .help("use fewer layers"),
                );
            }
            return Val::Poison;
        }
        let output = self.new_value("", shape, span);
        self.nodes.push(Pending {
            kind,
            inputs,
            output,
            layer: self.layer,
            span,
            scope: self.scope.clone(),
            explicit: None,
            tied,
            arg_spans,
        });
        Val::Tensor(output, span)
    }

    fn rename(&mut self, v: Val, name: &Ident) -> Val {
        match v {
            Val::Tensor(id, s) => {
                if let Some(n) = self.nodes.iter_mut().rev().find(|n| n.output == id) {
                    n.explicit = Some(name.clone());
                    Val::Tensor(id, s)
                } else {
                    self.err(
                        Diagnostic::error("E0902", "only a layer's output can be named with `as`")
                            .label(name.span, "this name")
                            .help("put `as name` right after a layer application: `LayerNorm(d)(x) as ln_f`"),
                    )
                }
            }
            Val::Poison => Val::Poison,
            _ => self.err(
                Diagnostic::error("E0902", "`as` names a layer application here")
                    .label(name.span, "this name")
                    .help("write `LayerNorm(d)(x) as ln_f`"),
            ),
        }
    }

    fn call(
        &mut self,
        f: Val,
        args: Vec<(Option<Ident>, Val, Span)>,
        span: Span,
        module: usize,
    ) -> Val {
        if args.iter().any(|(_, v, _)| matches!(v, Val::Poison)) {
            return Val::Poison;
        }
        match f {
            Val::Poison => Val::Poison,
            Val::Callable(Callee::Builtin("CrossEntropy"), _) => self.cross_entropy(args, span),
            Val::Callable(Callee::Builtin("Add"), _) => {
                let ts = self.tensors(&args, 2, "Add");
                match ts {
                    Some(ts) => self.add(ts[0].0, ts[1].0, ts[0].1, ts[1].1, span),
                    None => Val::Poison,
                }
            }
            Val::Callable(Callee::Builtin(kind), _) => self.construct(kind, args, span),
            Val::Callable(Callee::Glu, _) => self.glu(args, span, module),
            Val::Fn(f, _) => self.elementwise(f, args, span),
            Val::Callable(Callee::Block { module, name }, _) => {
                self.block_params(module, name, args, span)
            }
            Val::Callable(
                Callee::BlockArgs {
                    module,
                    name,
                    params,
                },
                _,
            ) => self.block_apply(module, &name, params, args, span),
            Val::Layer(c) => match self.tensors(&args, 1, layers::default_name(&c.kind)) {
                Some(ts) => self.apply(*c, ts, span),
                None => Val::Poison,
            },
            _ => self.err(
                Diagnostic::error(
                    "E0202",
                    "this is not a layer or block, so it cannot be called",
                )
                .label(span, "called here")
                .help("call layers (`LayerNorm(d)(x)`) and blocks (`Block(d, heads)(x)`)"),
            ),
        }
    }

    /// A call of a name that this scope binds to a tensor or number while a function or block
    /// of that name exists: the binding (`gate = …`) hides the callable (E0202, naming both).
    fn shadowed_callee(
        &self,
        callee: &Expr,
        f: &Val,
        frame: &Frame,
        module: usize,
    ) -> Option<Diagnostic> {
        let ExprKind::Path(p) = &callee.kind else {
            return None;
        };
        let [id] = p.as_slice() else {
            return None;
        };
        let what = match f {
            Val::Tensor(..) => "a tensor",
            Val::Num(_) => "a number",
            _ => return None,
        };
        if !frame.contains_key(&id.name) {
            return None;
        }
        let ns = &self.ns[module];
        let hidden = if ns.fns.contains_key(&id.name) {
            "function"
        } else if ns.blocks.contains_key(&id.name) {
            "block"
        } else {
            return None;
        };
        Some(
            Diagnostic::error(
                "E0202",
                format!(
                    "`{}` is {what} here, which hides the {hidden} `{}`",
                    id.name, id.name
                ),
            )
            .label(id.span, format!("{what}, not the {hidden}"))
            .help(format!(
                "a name bound in the model or block (`{} = …`) hides the {hidden} of that name; rename the binding",
                id.name
            )),
        )
    }

    /// `glu(f)`: SwiGLU for `glu(silu)` (its hand-written op), else the gated function.
    fn glu(&mut self, args: Vec<(Option<Ident>, Val, Span)>, span: Span, module: usize) -> Val {
        let f = match args.as_slice() {
            [(None, Val::Word(w, s), _)] if w == "silu" => return Val::Word("swiglu".into(), *s),
            [(None, Val::Word(w, s), _)] => self.ns[module].fns.get(w).map(|f| (f.clone(), *s)),
            [(None, Val::Fn(f, s), _)] => Some((f.clone(), *s)),
            _ => None,
        };
        match f {
            Some((f, _)) if f.params.len() == 1 => Val::Fn(Arc::new(functions::glu(&f)), span),
            Some((f, s)) => self.err(
                Diagnostic::error(
                    "E0228",
                    format!(
                        "glu(f) gates a function of one parameter; `{}` takes {}",
                        f.name,
                        f.params.len()
                    ),
                )
                .label(s, "this function")
                .help("pass a one-parameter function, e.g. `glu(gelu)`"),
            ),
            None => self.err(
                Diagnostic::error("E0207", "glu takes one function: `glu(f)`")
                    .label(span, "here")
                    .help(
                        "write e.g. `act = glu(gelu)` or `act = glu(myfn)` with `fn myfn(x) = …`",
                    ),
            ),
        }
    }

    /// `f(x, …)` on tensors: an elementwise layer (`LayerKind::Elementwise`) whose inputs are
    /// the arguments, all hidden states of one width, one per parameter of `f`.
    fn elementwise(
        &mut self,
        f: Arc<ExprFn>,
        args: Vec<(Option<Ident>, Val, Span)>,
        span: Span,
    ) -> Val {
        let want = f.params.len();
        if args.len() != want {
            let s = |n: usize| if n == 1 { "" } else { "s" };
            return self.err(
                Diagnostic::error(
                    "E0221",
                    format!(
                        "`{}` takes {want} argument{}, found {}",
                        f.name,
                        s(want),
                        args.len()
                    ),
                )
                .label(span, format!("{} argument{}", args.len(), s(args.len())))
                .help(format!("pass exactly {want} tensor{}", s(want))),
            );
        }
        if let Err(d) = functions::on_tensors(&f, span) {
            return self.err(d);
        }
        let Some(ts) = self.tensors(&args, want, &f.name) else {
            return Val::Poison;
        };
        let shapes: Vec<Shape> = ts
            .iter()
            .map(|(id, _)| self.values[id.0 as usize].shape.clone())
            .collect();
        let dim = match shapes.first() {
            Some(first @ Shape::Hidden(n)) if shapes.iter().all(|s| s == first) => *n,
            _ => {
                let mut d = Diagnostic::error(
                    "E0229",
                    format!(
                        "`{}` is applied to tensors of different shapes, or not to hidden states",
                        f.name
                    ),
                );
                for ((_, s), shape) in ts.iter().zip(&shapes) {
                    d = d.label(*s, layers::describe(shape));
                }
                return self.err(d.help(
                    "a function applies elementwise to hidden states [batch, seq, d] of one width",
                ));
            }
        };
        let inputs = ts.iter().map(|(id, _)| *id).collect();
        self.node(
            LayerKind::Elementwise { f, dim },
            inputs,
            Shape::Hidden(dim),
            span,
            HashMap::new(),
            None,
        )
    }

    fn tensors(
        &mut self,
        args: &[(Option<Ident>, Val, Span)],
        want: usize,
        what: &str,
    ) -> Option<Vec<(ValueId, Span)>> {
        let mut out = Vec::new();
        for (name, v, s) in args {
            match (name, v) {
                (None, Val::Tensor(id, _)) => out.push((*id, *s)),
                _ => {
                    self.err(
                        Diagnostic::error(
                            "E0307",
                            format!("`{what}` is applied to tensors, and this is not one"),
                        )
                        .label(*s, "not a tensor")
                        .help(
                            "pass a tensor, e.g. `(x)`; layer settings go in the first parentheses",
                        ),
                    );
                    return None;
                }
            }
        }
        if out.len() != want {
            let span = args.first().map(|a| a.2).unwrap_or_default();
            self.err(
                Diagnostic::error(
                    "E0207",
                    format!("`{what}` takes {want} input tensor(s), found {}", out.len()),
                )
                .label(span, "here")
                .help(format!("pass exactly {want} tensor(s)")),
            );
            return None;
        }
        Some(out)
    }

    fn cross_entropy(&mut self, args: Vec<(Option<Ident>, Val, Span)>, span: Span) -> Val {
        let Some(ts) = self.tensors(&args, 2, "CrossEntropy") else {
            return Val::Poison;
        };
        let (logits, targets) = (ts[0], ts[1]);
        let ls = self.values[logits.0 .0 as usize].shape.clone();
        let tshape = self.values[targets.0 .0 as usize].shape.clone();
        if !matches!(ls, Shape::Hidden(_)) || tshape != Shape::Tokens {
            return self.err(
                Diagnostic::error("E0306", "CrossEntropy takes (logits, targets): logits [batch, seq, vocab] and token ids")
                    .label(logits.1, layers::describe(&ls))
                    .label(targets.1, layers::describe(&tshape))
                    .help("write `CrossEntropy(logits, targets)` with `input targets : [batch, seq] i32`"),
            );
        }
        self.node(
            LayerKind::CrossEntropy,
            vec![logits.0, targets.0],
            Shape::Scalar,
            span,
            HashMap::new(),
            None,
        )
    }

    fn construct(
        &mut self,
        kind: &'static str,
        args: Vec<(Option<Ident>, Val, Span)>,
        span: Span,
    ) -> Val {
        let params = layers::params(kind);
        let mut values = HashMap::new();
        let mut positional = 0;
        for (name, v, s) in args {
            let key = match &name {
                Some(n) => match params.iter().find(|p| **p == n.name) {
                    Some(p) => *p,
                    None => return self.err(no_such_param(kind, n)),
                },
                None => match params.get(positional) {
                    Some(p) => {
                        positional += 1;
                        *p
                    }
                    None => {
                        return self.err(
                            Diagnostic::error("E0207", format!("too many arguments for {kind}"))
                                .label(s, "extra argument")
                                .help(format!("{kind} takes ({})", params.join(", "))),
                        )
                    }
                },
            };
            let av = match v {
                Val::Num(n) => ArgValue::Num(n),
                Val::Bool(b, s) => ArgValue::Bool(b, s),
                Val::Word(w, s) => ArgValue::Word(w, s),
                Val::Rope(r, s) => ArgValue::Rope(r, s),
                Val::Fn(f, s) => ArgValue::Fn(f, s),
                Val::Tagged(t) => ArgValue::Tagged(t),
                Val::Callable(Callee::Builtin(k), s) if key == "tied" => ArgValue::Word(k.to_string(), s),
                _ => {
                    return self.err(
                        Diagnostic::error("E0902", format!("{kind}'s `{key}` cannot be a tensor or layer"))
                            .label(s, "this argument")
                            .help("layer settings are numbers, `true`/`false` or names; the input goes in the second parentheses"),
                    )
                }
            };
            if values.insert(key, av).is_some() {
                return self.err(
                    Diagnostic::error("E0207", format!("{kind}'s `{key}` is given twice"))
                        .label(s, "again here")
                        .help(format!("give `{key}` once")),
                );
            }
        }
        if kind == "RoPE" {
            return match rope::rope(&values) {
                Ok(r) => Val::Rope(r, span),
                Err(d) => self.err(d),
            };
        }
        let bound = Bound { kind, values, span };
        match layers::construct(&bound) {
            Ok(c) => Val::Layer(Box::new(c)),
            Err(d) => self.err(d),
        }
    }

    fn apply(&mut self, c: Ctor, ts: Vec<(ValueId, Span)>, span: Span) -> Val {
        let Some(&(input, input_span)) = ts.first() else {
            return Val::Poison;
        };
        let have = self.values[input.0 as usize].shape.clone();
        let want = layers::input_shape(&c.kind);
        if have != want {
            let name = c.kind.kind_name();
            let code =
                if matches!(want, Shape::Tokens) || matches!(have, Shape::Tokens | Shape::Scalar) {
                    "E0307"
                } else {
                    "E0301"
                };
            let (param_name, param_span) = match &c.kind {
                LayerKind::Linear { .. } => ("in", c.arg_spans.get("in").copied()),
                _ => ("dim", c.arg_spans.get("dim").copied()),
            };
            let mut d = Diagnostic::error(
                code,
                format!(
                    "{name} expects {} but its input is {}",
                    layers::describe(&want),
                    layers::describe(&have)
                ),
            )
            .label(input_span, format!("this is {}", layers::describe(&have)));
            if let Some(ps) = param_span {
                d = d.label(
                    ps,
                    format!("{name} is built for {}", layers::describe(&want)),
                );
            }
            let help = match (&have, &want) {
                (Shape::Hidden(n), Shape::Hidden(_)) => {
                    if let Some(ps) = param_span {
                        d = d.edit(ps, n.to_string());
                    }
                    format!("set {name}'s {param_name} to {n}")
                }
                (_, Shape::Tokens) => "apply Embedding to the token ids input".to_string(),
                _ => format!("apply {name} to a hidden state"),
            };
            self.diags.push(d.help(help));
        }
        let out = layers::output_shape(&c.kind);
        self.node(c.kind, vec![input], out, span, c.arg_spans, c.tied)
    }

    fn block_params(
        &mut self,
        module: usize,
        name: String,
        args: Vec<(Option<Ident>, Val, Span)>,
        span: Span,
    ) -> Val {
        let Some(def) = self.ns[module].defs.get(&name).cloned() else {
            return Val::Poison;
        };
        let mut params: HashMap<String, Val> = HashMap::new();
        let mut positional = 0;
        for (n, v, s) in args {
            let key = match n {
                Some(n) => {
                    if !def.params.iter().any(|p| p.name.name == n.name) {
                        let names: Vec<&str> =
                            def.params.iter().map(|p| p.name.name.as_str()).collect();
                        return self.err(
                            Diagnostic::error(
                                "E0207",
                                format!("block `{name}` has no parameter `{}`", n.name),
                            )
                            .label(n.span, "unknown parameter")
                            .label(def.name.span, "block defined here")
                            .help(format!("{name} takes ({})", names.join(", "))),
                        );
                    }
                    n.name
                }
                None => match def.params.get(positional) {
                    Some(p) => {
                        positional += 1;
                        p.name.name.clone()
                    }
                    None => {
                        return self.err(
                            Diagnostic::error(
                                "E0207",
                                format!("too many arguments for block `{name}`"),
                            )
                            .label(s, "extra argument")
                            .label(def.name.span, "block defined here")
                            .help(format!("{name} takes {} parameters", def.params.len())),
                        )
                    }
                },
            };
            if params.insert(key.clone(), v).is_some() {
                return self.err(
                    Diagnostic::error("E0207", format!("`{key}` is given twice"))
                        .label(s, "again here")
                        .help(format!("give `{key}` once")),
                );
            }
        }
        // Defaults are evaluated in the block's module, seeing the earlier parameters.
        let mut frame: Frame = HashMap::new();
        for p in &def.params {
            let v = match (params.remove(&p.name.name), &p.default) {
                (Some(v), _) => v,
                (None, Some(d)) => self.eval(d, &frame, module),
                (None, None) => {
                    return self.err(
                        Diagnostic::error(
                            "E0207",
                            format!("block `{name}` is missing its `{}` argument", p.name.name),
                        )
                        .label(span, "called here")
                        .label(p.name.span, "parameter without a default")
                        .help(format!("pass `{} = …`", p.name.name)),
                    )
                }
            };
            frame.insert(p.name.name.clone(), v);
        }
        Val::Callable(
            Callee::BlockArgs {
                module,
                name,
                params: frame,
            },
            span,
        )
    }

    fn block_apply(
        &mut self,
        module: usize,
        name: &str,
        mut frame: Frame,
        args: Vec<(Option<Ident>, Val, Span)>,
        span: Span,
    ) -> Val {
        let Some(def) = self.ns[module].defs.get(name).cloned() else {
            return Val::Poison;
        };
        if self.depth >= MAX_DEPTH {
            return self.err(
                Diagnostic::error("E0212", format!("block `{name}` calls blocks more than {MAX_DEPTH} deep (does it call itself?)"))
                    .label(span, "called here")
                    .help("blocks cannot be recursive; use `repeat` to stack layers"),
            );
        }
        let Some(ts) = self.tensors(&args, def.inputs.len(), name) else {
            return Val::Poison;
        };
        for (input, (id, s)) in def.inputs.iter().zip(ts) {
            frame.insert(input.name.clone(), Val::Tensor(id, s));
        }
        self.depth += 1;
        let out = self.body(&def.body, &mut frame, module);
        self.depth -= 1;
        out
    }
}

/// `kind` (a built-in layer) has no parameter `n`: E0207, with the nearest name or the list.
fn no_such_param(kind: &str, n: &Ident) -> Diagnostic {
    let params = layers::params(kind);
    let takes = format!("{kind} takes ({})", params.join(", "));
    let help = suggest::help(&n.name, params.iter().copied(), &takes);
    let d = Diagnostic::error("E0207", format!("{kind} has no parameter `{}`", n.name))
        .label(n.span, "unknown parameter")
        .help(help);
    match layers::missing_feature(kind, &n.name) {
        Some(note) => d.note(note),
        None => d,
    }
}

/// A record, list or tuple given to a built-in layer for a parameter it does not have, as a
/// published config spells a feature (`RoPE(scaling = llama3 { factor: 8 })`): the unknown
/// parameter is what to report, not that such values are not values in a model (E0902).
fn compound_for_unknown_param(f: &Val, args: &[Arg]) -> Option<Diagnostic> {
    let Val::Callable(Callee::Builtin(kind), _) = f else {
        return None;
    };
    args.iter().find_map(|a| match a {
        Arg::Named(n, x)
            if matches!(
                x.kind,
                ExprKind::Tagged { .. }
                    | ExprKind::Record(_)
                    | ExprKind::List(_)
                    | ExprKind::Tuple(_)
            ) && !layers::params(kind).contains(&n.name.as_str()) =>
        {
            Some(no_such_param(kind, n))
        }
        _ => None,
    })
}
