//! The pest parser for `grammar/par.pest` and the builders that turn its parse tree into the
//! [`ast`](super::ast). One builder per rule; pest's `Rule` names never reach the user: syntax
//! errors name what was expected in words (`expected an expression`).

use super::ast::*;
use crate::diag::{Diagnostic, FileId, Span};
use pest::iterators::Pair;
use pest::Parser;

#[derive(pest_derive::Parser)]
#[grammar = "../../grammar/par.pest"]
struct ParGrammar;

type Pairs<'a> = pest::iterators::Pairs<'a, Rule>;

/// Parse a whole `.par` file.
pub fn parse_file(file: FileId, text: &str) -> Result<File, Diagnostic> {
    if text.trim().is_empty() {
        return Err(Diagnostic::error("E0102", "the file is empty")
            .label(Span::new(file, 0, text.len()), "nothing here")
            .help("a spec needs at least a `model { … }` and a `train { … }` section; see examples/tiny.par"));
    }
    check_nesting(file, text, 0)?;
    let pairs = ParGrammar::parse(Rule::file, text).map_err(|e| syntax_error(file, text, e))?;
    let b = Builder::new(file);
    let mut items = Vec::new();
    for pair in pairs.flatten().take(1) {
        for item in pair.into_inner() {
            match item.as_rule() {
                Rule::use_decl => items.push(Item::Use(b.use_decl(item))),
                Rule::let_decl => items.push(Item::Let(b.let_decl(item))),
                Rule::fn_def => items.push(Item::Fn(b.fn_def(item))),
                Rule::block_def => items.push(Item::Block(b.block_def(item))),
                Rule::model_def => items.push(Item::Model(b.model_def(item))),
                Rule::section => items.push(Item::Section(b.section(item))),
                _ => {}
            }
        }
    }
    if let Some(d) = b.too_deep.into_inner() {
        return Err(d);
    }
    Ok(File { items })
}

/// Refuse bracket nesting deeper than [`MAX_NESTING`] before pest recurses into it.
fn check_nesting(file: FileId, text: &str, offset: usize) -> Result<(), Diagnostic> {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        match c {
            '(' | '[' | '{' => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Err(Diagnostic::error(
                        "E0101",
                        format!("brackets nest deeper than {MAX_NESTING} levels"),
                    )
                    .label(Span::new(file, offset + i, offset + i + 1), "too deep here")
                    .help("flatten the expression with `let` constants"));
                }
            }
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

/// Parse the value of a `--set PATH=VALUE` override; `offset` is where it starts in `text`.
pub fn parse_value(file: FileId, text: &str, offset: usize) -> Result<Expr, Diagnostic> {
    let value = text.get(offset..).unwrap_or("");
    check_nesting(file, value, offset)?;
    let pairs = ParGrammar::parse(Rule::override_value, value).map_err(|e| {
        let mut d = syntax_error(file, value, e);
        for l in &mut d.labels {
            l.span.start += offset as u32;
            l.span.end += offset as u32;
        }
        d
    })?;
    let b = Builder::new(file);
    let expr = pairs
        .flatten()
        .find(|p| p.as_rule() == Rule::expr)
        .map(|p| b.expr(p))
        .ok_or_else(|| {
            Diagnostic::error("E0101", "expected a value after `=`")
                .label(Span::new(file, offset, text.len()), "here")
        })?;
    if let Some(d) = b.too_deep.into_inner() {
        return Err(d);
    }
    Ok(shift(expr, offset as u32))
}

fn shift(mut e: Expr, by: u32) -> Expr {
    fn span(s: &mut Span, by: u32) {
        s.start += by;
        s.end += by;
    }
    fn ident(i: &mut Ident, by: u32) {
        span(&mut i.span, by);
    }
    fn walk(e: &mut Expr, by: u32) {
        span(&mut e.span, by);
        match &mut e.kind {
            ExprKind::Number { .. } | ExprKind::Str(_) | ExprKind::Bool(_) => {}
            ExprKind::Path(p) => p.iter_mut().for_each(|i| ident(i, by)),
            ExprKind::Neg(a) => walk(a, by),
            ExprKind::Binary(_, a, b) | ExprKind::Compare(_, a, b) => {
                walk(a, by);
                walk(b, by);
            }
            ExprKind::Call { callee, args } => {
                walk(callee, by);
                for a in args {
                    match a {
                        Arg::Positional(x) => walk(x, by),
                        Arg::Named(n, x) => {
                            ident(n, by);
                            walk(x, by);
                        }
                    }
                }
            }
            ExprKind::Rename(x, n) => {
                walk(x, by);
                ident(n, by);
            }
            ExprKind::Tagged { tag, fields } => {
                ident(tag, by);
                for f in fields {
                    ident(&mut f.name, by);
                    walk(&mut f.value, by);
                }
            }
            ExprKind::Record(fields) => {
                for f in fields {
                    ident(&mut f.name, by);
                    walk(&mut f.value, by);
                }
            }
            ExprKind::List(xs) | ExprKind::Tuple(xs) => xs.iter_mut().for_each(|x| walk(x, by)),
            // Overrides are single values; a `repeat` there is refused by the checker, which
            // only needs the outer span.
            ExprKind::Repeat { count, .. } => walk(count, by),
        }
    }
    walk(&mut e, by);
    e
}

/// What a grammar rule is called in an error message.
fn rule_words(rule: Rule) -> &'static str {
    match rule {
        Rule::EOI => "end of file",
        Rule::ident | Rule::keyword => "a name",
        Rule::path | Rule::segment => "a name",
        Rule::module_path => "a module path like `std::gpt2`",
        Rule::use_decl => "`use`",
        Rule::let_decl => "`let`",
        Rule::block_def => "`block`",
        Rule::fn_def | Rule::fn_kw => "`fn`",
        Rule::model_def => "`model`",
        Rule::section => "a section like `train { … }`",
        Rule::item => "`use`, `let`, `block`, `model` or a section",
        Rule::param | Rule::params => "a parameter",
        Rule::inputs => "an input name",
        Rule::body => "`{`",
        Rule::assign => "an assignment `name = …`",
        Rule::stmt => "a statement",
        Rule::input_decl => "`input`",
        Rule::shard_decl => "`shard`",
        Rule::shard_item => "`Kind.dim on axis`",
        Rule::setting => "a setting `name = value`",
        Rule::expr
        | Rule::sum
        | Rule::product
        | Rule::unary
        | Rule::postfix
        | Rule::primary
        | Rule::repeat_count
        | Rule::arg
        | Rule::override_value => "an expression",
        Rule::add_op => "`+` or `-`",
        Rule::cmp_op => "a comparison",
        Rule::mul_op => "`*` or `/`",
        Rule::neg => "`-`",
        Rule::rename => "`as`",
        Rule::call_args => "`(`",
        Rule::named_arg => "a named argument",
        Rule::repeat_expr => "`repeat`",
        Rule::tagged | Rule::record => "a record `{ name: value }`",
        Rule::field => "a field `name: value`",
        Rule::list => "a list `[…]`",
        Rule::paren => "`(`",
        Rule::schedule_word => "a schedule",
        Rule::boolean => "`true` or `false`",
        Rule::string | Rule::string_body => "a string",
        Rule::quantity | Rule::number => "a number",
        Rule::unit => "a unit",
        Rule::file | Rule::WHITESPACE | Rule::COMMENT | Rule::ident_char => "text",
    }
}

fn syntax_error(file: FileId, text: &str, e: pest::error::Error<Rule>) -> Diagnostic {
    use pest::error::{ErrorVariant, InputLocation};
    let (start, end) = match e.location {
        InputLocation::Pos(p) => (p, p),
        InputLocation::Span((s, e)) => (s, e),
    };
    let message = match &e.variant {
        ErrorVariant::ParsingError { positives, .. } => {
            // A comparison belongs only in a fn body: not worth suggesting elsewhere.
            let mut words: Vec<&str> = positives
                .iter()
                .filter(|r| **r != Rule::cmp_op || positives.len() == 1)
                .map(|r| rule_words(*r))
                .collect();
            words.sort_unstable();
            words.dedup();
            match words.len() {
                0 => "unexpected text".to_string(),
                1 => format!("expected {}", words[0]),
                n => format!("expected {} or {}", words[..n - 1].join(", "), words[n - 1]),
            }
        }
        ErrorVariant::CustomError { message } => message.clone(),
    };
    let found: String = text
        .get(start..)
        .unwrap_or("")
        .chars()
        .take_while(|c| !c.is_whitespace())
        .take(20)
        .collect();
    let end = if end > start {
        end
    } else {
        (start + found.len()).min(text.len())
    };
    let label = if found.is_empty() {
        "here".to_string()
    } else {
        format!("found `{found}`")
    };
    let help = unit_help(text, start)
        .or_else(|| non_ascii_name_help(text, start))
        .unwrap_or_else(|| "see docs/language.md for the syntax".into());
    Diagnostic::error("E0101", format!("syntax error: {message}"))
        .label(Span::new(file, start, end), label)
        .help(help)
}

/// A name with a letter outside ASCII where the error is (`model 模型`, `as tête`): names are
/// ASCII letters, digits and `_`, which "expected a name" alone does not say.
fn non_ascii_name_help(text: &str, start: usize) -> Option<String> {
    let word_char = |c: char| c.is_alphanumeric() || c == '_';
    let (before, after) = (text.get(..start)?, text.get(start..)?);
    let first = after.chars().next()?;
    if first.is_ascii() || !first.is_alphabetic() {
        return None;
    }
    let head: String = before.chars().rev().take_while(|c| word_char(*c)).collect();
    let tail: String = after
        .chars()
        .take_while(|c| word_char(*c))
        .take(40)
        .collect();
    let word: String = head.chars().rev().chain(tail.chars()).collect();
    Some(format!(
        "names are ASCII letters, digits and `_` (not starting with a digit): rename `{word}`"
    ))
}

/// The units a quantity takes (`grammar/par.pest`'s `unit`).
const UNITS: [&str; 21] = [
    "PFLOP/s", "TFLOP/s", "GFLOP/s", "FLOP/s", "TB/s", "GB/s", "MB/s", "Tb/s", "Gb/s", "TiB",
    "GiB", "MiB", "KiB", "TB", "GB", "MB", "KB", "B", "us", "ns", "ms",
];

/// Other tools' spellings of a unit, as configs and datasheets write them.
const UNIT_SPELLINGS: [(&str, &str); 15] = [
    ("FLOPS", "FLOP/s"),
    ("GFLOPS", "GFLOP/s"),
    ("TFLOPS", "TFLOP/s"),
    ("PFLOPS", "PFLOP/s"),
    ("GBps", "GB/s"),
    ("TBps", "TB/s"),
    ("MBps", "MB/s"),
    ("Gbps", "Gb/s"),
    ("Tbps", "Tb/s"),
    ("Gbit/s", "Gb/s"),
    ("Tbit/s", "Tb/s"),
    ("usec", "us"),
    ("µs", "us"),
    ("msec", "ms"),
    ("nsec", "ns"),
];

/// A word right after a number that is a unit misspelt (`165 TFLOPS`, `900 GBps`, `24 gb`) or
/// one written without the space the grammar needs (`24GB`): the quantity to write instead of
/// E0101's list of expected tokens. None for other words (`8 steps`, a missing `;`).
fn unit_help(text: &str, start: usize) -> Option<String> {
    let before = text.get(..start)?;
    let number = before.trim_end_matches(' ');
    if !number.ends_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    let word: String = text
        .get(start..)?
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '/')
        .collect();
    let value: String = number
        .chars()
        .rev()
        .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_'))
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    if UNITS.contains(&word.as_str()) && number.len() == before.len() {
        return Some(format!(
            "a unit follows its number after a space: `{value} {word}`"
        ));
    }
    if let Some(help) = bytes_or_bits(&word, &value) {
        return Some(help);
    }
    let unit = UNIT_SPELLINGS
        .iter()
        .find(|(other, _)| *other == word)
        .map(|(_, unit)| *unit)
        .or_else(|| {
            UNITS
                .iter()
                .copied()
                .find(|u| u.eq_ignore_ascii_case(&word) && !u.contains("b/"))
        })?;
    Some(format!(
        "`{word}` is not one of parc's units: write `{value} {unit}` (the units: \
         docs/language.md, \"Lexical structure\")"
    ))
}

/// A bandwidth whose case does not say bytes or bits (`gbps`, `tb/s`: `GBps` is bytes, `Gbps`
/// bits): the help names both readings with the unit each is written in, not a guess.
fn bytes_or_bits(word: &str, value: &str) -> Option<String> {
    if UNITS.contains(&word) || UNIT_SPELLINGS.iter().any(|(other, _)| *other == word) {
        return None;
    }
    let spelt = UNIT_SPELLINGS.iter().map(|(other, unit)| (*other, *unit));
    let units = UNITS.iter().map(|u| (*u, *u));
    let mut readings: Vec<&str> = spelt
        .chain(units)
        .filter(|(other, _)| other.eq_ignore_ascii_case(word))
        .map(|(_, unit)| unit)
        .collect();
    readings.sort_unstable();
    readings.dedup();
    let (bytes, bits) = match readings.as_slice() {
        [a, b] if a.contains("B/") && b.contains("b/") => (*a, *b),
        [a, b] if b.contains("B/") && a.contains("b/") => (*b, *a),
        _ => return None,
    };
    let prefix = match bytes.chars().next() {
        Some('T') => "tera",
        _ => "giga",
    };
    Some(format!(
        "`{word}` could mean {prefix}bytes or {prefix}bits per second: write `{value} {bytes}` \
         for {prefix}bytes or `{value} {bits}` for {prefix}bits (converted to bytes; the units: \
         docs/language.md, \"Lexical structure\")"
    ))
}

/// Brackets may nest this deep (pest and the checker recurse on nesting).
const MAX_NESTING: usize = 128;
/// Longest chain of operators or calls in one expression (the tree is as deep as the chain).
const MAX_CHAIN: usize = 256;

struct Builder {
    file: FileId,
    /// The first "too deep" problem met while building; reported instead of the tree.
    too_deep: std::cell::RefCell<Option<Diagnostic>>,
}

impl Builder {
    fn new(file: FileId) -> Builder {
        Builder {
            file,
            too_deep: std::cell::RefCell::new(None),
        }
    }

    /// Note that an expression chain at `span` is longer than [`MAX_CHAIN`].
    fn chain_too_long(&self, span: Span) {
        let mut slot = self.too_deep.borrow_mut();
        if slot.is_none() {
            *slot = Some(
                Diagnostic::error(
                    "E0101",
                    format!("this expression chains more than {MAX_CHAIN} operators or calls"),
                )
                .label(span, "too long")
                .help("split it with `let` constants"),
            );
        }
    }

    /// The pair's span without the whitespace pest's implicit rules leave at its end.
    fn span(&self, p: &Pair<Rule>) -> Span {
        let s = p.as_span();
        let trimmed = p.as_str().trim_end().len();
        Span::new(self.file, s.start(), s.start() + trimmed)
    }

    fn ident(&self, p: Pair<Rule>) -> Ident {
        Ident {
            name: p.as_str().to_string(),
            span: self.span(&p),
        }
    }

    fn idents(&self, pairs: Pairs) -> Vec<Ident> {
        pairs
            .filter(|p| matches!(p.as_rule(), Rule::ident | Rule::segment))
            .map(|p| self.ident(p))
            .collect()
    }

    fn use_decl(&self, p: Pair<Rule>) -> UseDecl {
        let span = self.span(&p);
        let mut module = Vec::new();
        let mut module_span = span;
        let mut names = Vec::new();
        for c in p.into_inner() {
            match c.as_rule() {
                Rule::module_path => {
                    module_span = self.span(&c);
                    module = self.idents(c.into_inner());
                }
                Rule::ident => names.push(self.ident(c)),
                _ => {}
            }
        }
        UseDecl {
            module,
            module_span,
            names,
            span,
        }
    }

    fn let_decl(&self, p: Pair<Rule>) -> LetDecl {
        let span = self.span(&p);
        let mut inner = p.into_inner();
        let name = self.next_ident(&mut inner, span);
        let value = self.next_expr(&mut inner, span);
        LetDecl { name, value, span }
    }

    fn next_ident(&self, inner: &mut Pairs, at: Span) -> Ident {
        match inner.next() {
            Some(p) => self.ident(p),
            None => Ident {
                name: String::new(),
                span: at,
            },
        }
    }

    fn next_expr(&self, inner: &mut Pairs, at: Span) -> Expr {
        match inner.next() {
            Some(p) => self.expr(p),
            None => Expr {
                kind: ExprKind::Tuple(Vec::new()),
                span: at,
            },
        }
    }

    fn fn_def(&self, p: Pair<Rule>) -> FnDef {
        let span = self.span(&p);
        let mut name = Ident {
            name: String::new(),
            span,
        };
        let mut params = Vec::new();
        let mut body = None;
        for c in p.into_inner() {
            match c.as_rule() {
                Rule::ident => name = self.ident(c),
                Rule::inputs => params = self.idents(c.into_inner()),
                Rule::expr => body = Some(self.expr(c)),
                _ => {}
            }
        }
        FnDef {
            name,
            params,
            body: body.unwrap_or_else(|| *self.empty_body(span).result),
            span,
        }
    }

    fn block_def(&self, p: Pair<Rule>) -> BlockDef {
        let span = self.span(&p);
        let mut name = Ident {
            name: String::new(),
            span,
        };
        let mut params = Vec::new();
        let mut inputs = Vec::new();
        let mut body = None;
        for c in p.into_inner() {
            match c.as_rule() {
                Rule::ident => name = self.ident(c),
                Rule::params => {
                    for param in c.into_inner() {
                        let mut pi = param.into_inner();
                        let pname = self.next_ident(&mut pi, span);
                        let default = pi.next().map(|e| self.expr(e));
                        params.push(Param {
                            name: pname,
                            default,
                        });
                    }
                }
                Rule::inputs => inputs = self.idents(c.into_inner()),
                Rule::body => body = Some(self.body(c)),
                _ => {}
            }
        }
        BlockDef {
            name,
            params,
            inputs,
            body: body.unwrap_or_else(|| self.empty_body(span)),
            span,
        }
    }

    fn empty_body(&self, span: Span) -> Body {
        Body {
            stmts: Vec::new(),
            result: Box::new(Expr {
                kind: ExprKind::Tuple(Vec::new()),
                span,
            }),
        }
    }

    /// Statements then a final expression (used by `block` bodies and `repeat`).
    fn body_parts(&self, pairs: Pairs, span: Span) -> Body {
        let mut stmts = Vec::new();
        let mut result = None;
        for c in pairs {
            match c.as_rule() {
                Rule::let_decl => stmts.push(Stmt::Let(self.let_decl(c))),
                Rule::assign => stmts.push(self.assign(c)),
                Rule::expr => result = Some(self.expr(c)),
                _ => {}
            }
        }
        match result {
            Some(r) => Body {
                stmts,
                result: Box::new(r),
            },
            None => Body {
                stmts,
                ..self.empty_body(span)
            },
        }
    }

    fn body(&self, p: Pair<Rule>) -> Body {
        let span = self.span(&p);
        self.body_parts(p.into_inner(), span)
    }

    fn assign(&self, p: Pair<Rule>) -> Stmt {
        let span = self.span(&p);
        let mut inner = p.into_inner();
        let name = self.next_ident(&mut inner, span);
        let value = self.next_expr(&mut inner, span);
        Stmt::Assign { name, value, span }
    }

    fn model_def(&self, p: Pair<Rule>) -> ModelDef {
        let span = self.span(&p);
        let mut inner = p.into_inner();
        let name = self.next_ident(&mut inner, span);
        let mut stmts = Vec::new();
        for c in inner {
            match c.as_rule() {
                Rule::let_decl => stmts.push(Stmt::Let(self.let_decl(c))),
                Rule::assign => stmts.push(self.assign(c)),
                Rule::input_decl => stmts.push(Stmt::Input(self.input_decl(c))),
                Rule::shard_decl => stmts.push(Stmt::Shard(
                    c.into_inner().map(|i| self.shard_item(i)).collect(),
                )),
                _ => {}
            }
        }
        ModelDef { name, stmts, span }
    }

    fn input_decl(&self, p: Pair<Rule>) -> InputDecl {
        let span = self.span(&p);
        let mut inner = p.into_inner();
        let name = self.next_ident(&mut inner, span);
        let batch = self.next_expr(&mut inner, span);
        let seq = self.next_expr(&mut inner, span);
        let dtype = self.next_ident(&mut inner, span);
        InputDecl {
            name,
            batch,
            seq,
            dtype,
            span,
        }
    }

    fn shard_item(&self, p: Pair<Rule>) -> ShardItem {
        let span = self.span(&p);
        let mut ids = self.idents(p.into_inner());
        let axis = ids.pop();
        let dim = ids.pop();
        let kind = ids.pop();
        let blank = || Ident {
            name: String::new(),
            span,
        };
        ShardItem {
            kind,
            dim: dim.unwrap_or_else(blank),
            axis: axis.unwrap_or_else(blank),
            span,
        }
    }

    fn section(&self, p: Pair<Rule>) -> Section {
        let span = self.span(&p);
        let mut inner = p.into_inner();
        let name = self.next_ident(&mut inner, span);
        let settings = inner
            .filter(|c| c.as_rule() == Rule::setting)
            .map(|c| {
                let sspan = self.span(&c);
                let mut si = c.into_inner();
                let path = si
                    .next()
                    .map(|p| self.idents(p.into_inner()))
                    .unwrap_or_default();
                let value = self.next_expr(&mut si, sspan);
                Setting {
                    path,
                    value,
                    span: sspan,
                }
            })
            .collect();
        Section {
            name,
            settings,
            span,
        }
    }

    fn expr(&self, p: Pair<Rule>) -> Expr {
        let span = self.span(&p);
        match p.as_rule() {
            Rule::expr => self.compare(p.into_inner(), span),
            Rule::sum | Rule::product => self.binary(p.into_inner(), span),
            Rule::unary => self.unary(p),
            Rule::postfix => self.postfix(p),
            Rule::repeat_count | Rule::override_value => {
                let mut inner = p.into_inner();
                self.next_expr(&mut inner, span)
            }
            _ => self.primary(p),
        }
    }

    /// `a` or `a cmp b` (comparisons do not chain).
    fn compare(&self, mut pairs: Pairs, span: Span) -> Expr {
        let lhs = self.next_expr(&mut pairs, span);
        let (Some(op), Some(rhs)) = (pairs.next(), pairs.next()) else {
            return lhs;
        };
        let Some(op) = crate::kir::Cmp::from_name(op.as_str()) else {
            return lhs;
        };
        let rhs = self.expr(rhs);
        Expr {
            span: lhs.span.to(rhs.span),
            kind: ExprKind::Compare(op, Box::new(lhs), Box::new(rhs)),
        }
    }

    /// `a op b op c`, left-associative.
    fn binary(&self, mut pairs: Pairs, span: Span) -> Expr {
        let mut acc = self.next_expr(&mut pairs, span);
        let mut chain = 0;
        while let (Some(op), Some(rhs)) = (pairs.next(), pairs.next()) {
            chain += 1;
            if chain > MAX_CHAIN {
                self.chain_too_long(span);
                break;
            }
            let op = match op.as_str() {
                "+" => BinOp::Add,
                "-" => BinOp::Sub,
                "*" => BinOp::Mul,
                _ => BinOp::Div,
            };
            let rhs = self.expr(rhs);
            let span = acc.span.to(rhs.span);
            acc = Expr {
                kind: ExprKind::Binary(op, Box::new(acc), Box::new(rhs)),
                span,
            };
        }
        acc
    }

    fn unary(&self, p: Pair<Rule>) -> Expr {
        let span = self.span(&p);
        let mut negs = 0;
        let mut operand = None;
        for c in p.into_inner() {
            match c.as_rule() {
                Rule::neg if negs >= MAX_CHAIN => self.chain_too_long(span),
                Rule::neg => negs += 1,
                _ => operand = Some(self.expr(c)),
            }
        }
        let mut e = operand.unwrap_or_else(|| *self.empty_body(span).result);
        for _ in 0..negs {
            e = Expr {
                kind: ExprKind::Neg(Box::new(e)),
                span,
            };
        }
        e
    }

    fn postfix(&self, p: Pair<Rule>) -> Expr {
        let span = self.span(&p);
        let mut inner = p.into_inner();
        let mut e = self.next_expr(&mut inner, span);
        for (i, c) in inner.enumerate() {
            if i >= MAX_CHAIN {
                self.chain_too_long(span);
                break;
            }
            let cspan = self.span(&c);
            match c.as_rule() {
                Rule::call_args => {
                    let args = c.into_inner().map(|a| self.arg(a)).collect();
                    e = Expr {
                        span: e.span.to(cspan),
                        kind: ExprKind::Call {
                            callee: Box::new(e),
                            args,
                        },
                    };
                }
                Rule::rename => {
                    let mut ri = c.into_inner();
                    let name = self.next_ident(&mut ri, cspan);
                    e = Expr {
                        span: e.span.to(cspan),
                        kind: ExprKind::Rename(Box::new(e), name),
                    };
                }
                _ => {}
            }
        }
        e
    }

    fn arg(&self, p: Pair<Rule>) -> Arg {
        let span = self.span(&p);
        let mut inner = p.into_inner();
        match inner.next() {
            Some(c) if c.as_rule() == Rule::named_arg => {
                let mut ni = c.into_inner();
                let name = self.next_ident(&mut ni, span);
                Arg::Named(name, self.next_expr(&mut ni, span))
            }
            Some(c) => Arg::Positional(self.expr(c)),
            None => Arg::Positional(self.next_expr(&mut inner, span)),
        }
    }

    fn fields(&self, pairs: Pairs) -> Vec<Field> {
        pairs
            .filter(|f| f.as_rule() == Rule::field)
            .map(|f| {
                let fspan = self.span(&f);
                let mut fi = f.into_inner();
                Field {
                    name: self.next_ident(&mut fi, fspan),
                    value: self.next_expr(&mut fi, fspan),
                }
            })
            .collect()
    }

    fn primary(&self, p: Pair<Rule>) -> Expr {
        let span = self.span(&p);
        let kind = match p.as_rule() {
            Rule::quantity => {
                let mut text = String::new();
                let mut unit = None;
                for c in p.into_inner() {
                    match c.as_rule() {
                        Rule::number => text = c.as_str().to_string(),
                        Rule::unit => unit = Some(c.as_str().to_string()),
                        _ => {}
                    }
                }
                ExprKind::Number { text, unit }
            }
            Rule::string => ExprKind::Str(
                p.into_inner()
                    .next()
                    .map(|s| unescape(s.as_str()))
                    .unwrap_or_default(),
            ),
            Rule::boolean => ExprKind::Bool(p.as_str() == "true"),
            Rule::schedule_word => ExprKind::Path(vec![Ident {
                name: p.as_str().to_string(),
                span,
            }]),
            Rule::path => ExprKind::Path(self.idents(p.into_inner())),
            Rule::tagged => {
                let mut inner = p.into_inner();
                let tag = match inner.next() {
                    Some(t) => Ident {
                        name: t.as_str().to_string(),
                        span: self.span(&t),
                    },
                    None => Ident {
                        name: String::new(),
                        span,
                    },
                };
                ExprKind::Tagged {
                    tag,
                    fields: self.fields(inner),
                }
            }
            Rule::record => ExprKind::Record(self.fields(p.into_inner())),
            Rule::list => ExprKind::List(p.into_inner().map(|e| self.expr(e)).collect()),
            Rule::paren => {
                let mut xs: Vec<Expr> = p.into_inner().map(|e| self.expr(e)).collect();
                if xs.len() == 1 {
                    if let Some(x) = xs.pop() {
                        return x;
                    }
                }
                ExprKind::Tuple(xs)
            }
            Rule::repeat_expr => {
                let mut inner = p.into_inner().peekable();
                let count = match inner.next() {
                    Some(c) => self.expr(c),
                    None => *self.empty_body(span).result,
                };
                let name = match inner.peek() {
                    Some(r) if r.as_rule() == Rule::rename => inner
                        .next()
                        .and_then(|r| r.into_inner().next())
                        .map(|i| self.ident(i)),
                    _ => None,
                };
                let mut stmts = Vec::new();
                let mut result = None;
                for c in inner {
                    match c.as_rule() {
                        Rule::let_decl => stmts.push(Stmt::Let(self.let_decl(c))),
                        Rule::assign => stmts.push(self.assign(c)),
                        Rule::expr => result = Some(self.expr(c)),
                        _ => {}
                    }
                }
                let result = Box::new(result.unwrap_or_else(|| *self.empty_body(span).result));
                ExprKind::Repeat {
                    count: Box::new(count),
                    name,
                    body: Body { stmts, result },
                }
            }
            _ => return self.expr_fallback(p, span),
        };
        Expr { kind, span }
    }

    fn expr_fallback(&self, p: Pair<Rule>, span: Span) -> Expr {
        let mut inner = p.into_inner();
        self.next_expr(&mut inner, span)
    }
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some(other) => out.push(other),
                None => {}
            }
        } else {
            out.push(c);
        }
    }
    out
}
