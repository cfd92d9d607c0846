//! Data sources written as calls — `text("corpus.txt", tokenizer: gpt2)`, read into a
//! [`DataSource::Text`] — and the check of a text source's tokenizer against the model's
//! vocabulary (a `tokenizer.json`'s size is known only once its file is read: `parc check`'s
//! `src/data_check.rs` and the run do).

use super::suggest;
use crate::diag::{Diagnostic, Diagnostics, Span};
use crate::spec::{DataSource, Tokenizer};
use crate::syntax::ast::{Arg, Expr, ExprKind};

/// The data source `e` (a `data` setting) names when it is a call; `None` when it is not one.
pub fn call_source(e: &Expr, diags: &mut Diagnostics) -> Option<DataSource> {
    let ExprKind::Call { callee, args } = &e.kind else {
        return None;
    };
    match callee.as_word() {
        Some(w) if w.name == "text" => Some(text(diags, args, e.span)),
        _ => {
            diags.push(
                Diagnostic::error("E0904", "this call is not a data source")
                    .label(callee.span, "not a data source")
                    .help("read text with `text(\"corpus.txt\", tokenizer: gpt2)`, or tokens with `\"tokens.bin\" as u16`"),
            );
            Some(DataSource::Synthetic)
        }
    }
}

/// `text(PATH, tokenizer: T)`: every argument checked, all problems reported.
fn text(diags: &mut Diagnostics, args: &[Arg], span: Span) -> DataSource {
    let mut path: Option<String> = None;
    let mut tokenizer: Option<Tokenizer> = None;
    let mut tokenizer_span = span;
    for arg in args {
        match arg {
            Arg::Positional(e) if path.is_none() => path = Some(text_path(diags, e)),
            Arg::Positional(e) => wrong_argument(
                diags,
                e.span,
                "`text` takes one path",
                "name several files with a folder of .txt files or a glob: `text(\"corpus/*.txt\", tokenizer: gpt2)`",
            ),
            Arg::Named(name, e) if name.name == "tokenizer" && tokenizer.is_none() => {
                tokenizer = Some(tokenizer_arg(diags, e));
                tokenizer_span = e.span;
            }
            Arg::Named(name, _) if name.name == "tokenizer" => {
                wrong_argument(diags, name.span, "`tokenizer` is given twice", "keep one")
            }
            Arg::Named(name, _) => {
                let message = format!("`text` has no argument `{}`", name.name);
                let help = suggest::help(&name.name, ["tokenizer"], TEXT_USAGE);
                wrong_argument(diags, name.span, &message, &help)
            }
        }
    }
    if path.is_none() {
        missing_argument(diags, span, "`text` needs the file to read");
    }
    if tokenizer.is_none() {
        missing_argument(diags, span, "`text` needs a tokenizer");
    }
    DataSource::Text {
        path: path.unwrap_or_default(),
        tokenizer: tokenizer.unwrap_or(Tokenizer::Bytes),
        span,
        tokenizer_span,
    }
}

fn text_path(diags: &mut Diagnostics, e: &Expr) -> String {
    match &e.kind {
        ExprKind::Str(s) => {
            if s.is_empty() {
                diags.push(
                    Diagnostic::error("E0903", "the text file name is empty")
                        .label(e.span, "empty")
                        .help("write `text(\"data/corpus.txt\", tokenizer: gpt2)`"),
                );
            }
            s.clone()
        }
        _ => {
            diags.push(
                Diagnostic::error("E0902", "expected the text file's name as a string")
                    .label(e.span, "this value")
                    .help("write `text(\"data/corpus.txt\", tokenizer: gpt2)` (a file, a folder of .txt files or a glob)"),
            );
            String::new()
        }
    }
}

/// `gpt2`, `bytes`, or a `tokenizer.json`'s path as a string.
fn tokenizer_arg(diags: &mut Diagnostics, e: &Expr) -> Tokenizer {
    let names = Tokenizer::NAMES;
    let fallback = Tokenizer::Bytes;
    match (&e.kind, e.as_word()) {
        (_, Some(w)) => Tokenizer::from_name(&w.name).unwrap_or_else(|| {
            let rest = format!(
                "a tokenizer is {}, or a Hugging Face tokenizer.json's path as a string (\"tokenizer.json\")",
                suggest::one_of(&names)
            );
            diags.push(
                Diagnostic::error("E0904", format!("`{}` is not a tokenizer", w.name))
                    .label(e.span, "unknown tokenizer")
                    .help(suggest::help(&w.name, names, &rest)),
            );
            fallback
        }),
        (ExprKind::Str(path), _) if path.is_empty() => {
            diags.push(
                Diagnostic::error("E0903", "the tokenizer file name is empty")
                    .label(e.span, "empty")
                    .help("write `tokenizer: \"tokenizer.json\"` (relative to the spec's folder), or `tokenizer: gpt2`"),
            );
            fallback
        }
        (ExprKind::Str(path), _) => Tokenizer::File { path: path.clone() },
        _ => {
            diags.push(
                Diagnostic::error("E0902", "expected a tokenizer")
                    .label(e.span, "this value")
                    .help("write `tokenizer: gpt2`, `tokenizer: bytes` or `tokenizer: \"tokenizer.json\"`"),
            );
            fallback
        }
    }
}

/// How `text` is called, for helps.
const TEXT_USAGE: &str = "write `text(\"corpus.txt\", tokenizer: gpt2)`";

fn wrong_argument(diags: &mut Diagnostics, span: Span, message: &str, help: &str) {
    diags.push(
        Diagnostic::error("E0207", message.to_string())
            .label(span, "not an argument of `text`")
            .help(help.to_string()),
    );
}

fn missing_argument(diags: &mut Diagnostics, span: Span, message: &str) {
    diags.push(
        Diagnostic::error("E0207", message.to_string())
            .label(span, "incomplete")
            .help(format!(
                "{TEXT_USAGE} (or `tokenizer: bytes`, or `tokenizer: \"tokenizer.json\"`)"
            )),
    );
}

/// A built-in tokenizer's ids must be below the model's `vocab` (E0310). The help pads the
/// tokenizer's size to a multiple of 64, as nanoGPT pads GPT-2's 50,257 to 50,304, which keeps
/// the embedding and head GEMMs on fast shapes; where the model names it `let vocab`
/// (`vocab_let`), the fix sets that.
pub fn check_vocab(source: &DataSource, vocab: u64, vocab_let: bool, diags: &mut Diagnostics) {
    let DataSource::Text {
        tokenizer, span, ..
    } = source
    else {
        return;
    };
    let Some(need) = tokenizer.known_vocab() else {
        return;
    };
    if vocab >= need {
        return;
    }
    let name = tokenizer.name();
    let padded = need.div_ceil(64) * 64;
    let d = Diagnostic::error(
        "E0310",
        format!("the {name} tokenizer has {need} tokens but vocab = {vocab}"),
    )
    .label(*span, format!("tokenized by {name}"))
    .help(format!(
        "set `let vocab = {padded}` in the model (at least {need}; a multiple of 64 keeps the embedding and head fast)"
    ));
    diags.push(if vocab_let {
        d.fix([("model.vocab", padded)])
    } else {
        d
    });
}
