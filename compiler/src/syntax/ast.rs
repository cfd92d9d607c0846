//! The syntax tree of a `.par` file, as written: no names resolved, no values computed. Every
//! node carries the [`Span`] of its text so the checker can point at it.

use crate::diag::Span;

#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

#[derive(Clone, Debug, Default)]
pub struct File {
    pub items: Vec<Item>,
}

#[derive(Clone, Debug)]
pub enum Item {
    Use(UseDecl),
    Let(LetDecl),
    Fn(FnDef),
    Block(BlockDef),
    Model(ModelDef),
    Section(Section),
}

/// `use std::gpt2 { Block, Mlp }`
#[derive(Clone, Debug)]
pub struct UseDecl {
    pub module: Vec<Ident>,
    pub module_span: Span,
    pub names: Vec<Ident>,
    pub span: Span,
}

/// `let name = expr`
#[derive(Clone, Debug)]
pub struct LetDecl {
    pub name: Ident,
    pub value: Expr,
    pub span: Span,
}

/// `fn name(params) = body`: an expression function over scalars.
#[derive(Clone, Debug)]
pub struct FnDef {
    pub name: Ident,
    pub params: Vec<Ident>,
    pub body: Expr,
    pub span: Span,
}

/// `block Name(params)(inputs) { stmts; result }`
#[derive(Clone, Debug)]
pub struct BlockDef {
    pub name: Ident,
    pub params: Vec<Param>,
    pub inputs: Vec<Ident>,
    pub body: Body,
    pub span: Span,
}

#[derive(Clone, Debug)]
pub struct Param {
    pub name: Ident,
    pub default: Option<Expr>,
}

/// Statements followed by the expression whose value the body produces.
#[derive(Clone, Debug)]
pub struct Body {
    pub stmts: Vec<Stmt>,
    pub result: Box<Expr>,
}

#[derive(Clone, Debug)]
pub enum Stmt {
    Let(LetDecl),
    /// `name = expr`: binds a tensor (or rebinds it).
    Assign {
        name: Ident,
        value: Expr,
        span: Span,
    },
    Input(InputDecl),
    Shard(Vec<ShardItem>),
}

/// `input tokens : [batch, seq] i32`
#[derive(Clone, Debug)]
pub struct InputDecl {
    pub name: Ident,
    pub batch: Expr,
    pub seq: Expr,
    pub dtype: Ident,
    pub span: Span,
}

/// `Attention.heads on tp` (the layer kind may be left out to reuse the previous item's).
#[derive(Clone, Debug)]
pub struct ShardItem {
    pub kind: Option<Ident>,
    pub dim: Ident,
    pub axis: Ident,
    pub span: Span,
}

#[derive(Clone, Debug)]
pub struct ModelDef {
    pub name: Ident,
    pub stmts: Vec<Stmt>,
    pub span: Span,
}

/// `parallel { … }`, `train { … }`, `cluster { … }`
#[derive(Clone, Debug)]
pub struct Section {
    pub name: Ident,
    pub settings: Vec<Setting>,
    pub span: Span,
}

/// `path = expr` inside a section.
#[derive(Clone, Debug)]
pub struct Setting {
    pub path: Vec<Ident>,
    pub value: Expr,
    pub span: Span,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
}

impl BinOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

#[derive(Clone, Debug)]
pub struct Field {
    pub name: Ident,
    pub value: Expr,
}

#[derive(Clone, Debug)]
pub enum Arg {
    Positional(Expr),
    Named(Ident, Expr),
}

#[derive(Clone, Debug)]
pub enum ExprKind {
    /// A number literal with an optional unit (`80 GB`). `text` is the literal as written.
    Number {
        text: String,
        unit: Option<String>,
    },
    Str(String),
    Bool(bool),
    /// A name or dotted path (`d`, `Embedding`, `blocks.3.mlp`).
    Path(Vec<Ident>),
    Neg(Box<Expr>),
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// `a < b` (and `<=`, `>`, `>=`, `==`, `!=`): a boolean, allowed only in a fn body.
    Compare(crate::kir::Cmp, Box<Expr>, Box<Expr>),
    /// `callee(args)`; `Attention(d, heads)(x)` is a call of a call.
    Call {
        callee: Box<Expr>,
        args: Vec<Arg>,
    },
    /// `expr as name`: names a layer instance, or gives a data file its format.
    Rename(Box<Expr>, Ident),
    /// `word { field: value, … }`, e.g. `adamw { lr: 3e-4 }`.
    Tagged {
        tag: Ident,
        fields: Vec<Field>,
    },
    /// `{ field: value, … }`
    Record(Vec<Field>),
    List(Vec<Expr>),
    /// `(a, b)`; a single parenthesised expression is not a tuple.
    Tuple(Vec<Expr>),
    /// `repeat count [as name] { stmts; result }`
    Repeat {
        count: Box<Expr>,
        name: Option<Ident>,
        body: Body,
    },
}

impl Expr {
    /// The single name this expression is, if it is one (`gelu`, `tp`).
    pub fn as_word(&self) -> Option<&Ident> {
        match &self.kind {
            ExprKind::Path(p) if p.len() == 1 => p.first(),
            _ => None,
        }
    }
}
