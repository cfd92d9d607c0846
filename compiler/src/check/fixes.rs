//! Which text edits a diagnostic's fixes may keep. A check that suggests an edit (E0301's
//! width, E0304's kv_heads, E0905's path) labels a value wherever it was written, which is not
//! always a place the user should edit for that one use:
//! - the spec file itself, except the value of a `let` or a block parameter's default, which
//!   other uses share (changing it would change them too);
//! - a `--set` flag's path (E0905), but not its value, which sets a constant as a `let` does;
//! - never a stdlib module or the prelude (the user does not edit parc's files).
//!
//! A fix with any edit outside these is dropped whole: applied in part it would not do what
//! its help says.
use crate::diag::{Diagnostic, FileId, Sources, Span};
use crate::syntax::ast::{File, Item, Stmt};
use std::collections::HashSet;
use std::ops::Range;

/// Where a fix's edits may go in one compilation.
pub struct Editable<'a> {
    pub sources: &'a Sources,
    /// The spec file.
    pub main: FileId,
    /// The spec file's parsed items (for its shared values).
    pub file: &'a File,
    /// The files that hold `--set` flags' texts.
    pub overrides: Range<u32>,
}

impl Editable<'_> {
    /// Drop from `diags` every fix with an edit outside the editable places (module header).
    pub fn retain(&self, diags: &mut [Diagnostic]) {
        let shared = shared_values(self.file);
        for d in diags {
            d.fixes
                .retain(|f| f.edits.iter().all(|e| self.allows(e.span, &shared)));
        }
    }

    fn allows(&self, span: Span, shared: &HashSet<(u32, u32)>) -> bool {
        if span.file == self.main {
            return !shared.contains(&(span.start, span.end));
        }
        if !self.overrides.contains(&span.file.0) {
            return false;
        }
        // A flag's text is `PATH=VALUE`: only its path.
        let text = self.sources.get(span.file).map_or("", |f| f.text.as_str());
        span.start == 0
            && text
                .get(span.end as usize..)
                .is_some_and(|t| t.starts_with('='))
    }
}

/// The spans of the spec's values that several uses share: `let` values (file, model and
/// block level) and block parameters' defaults.
fn shared_values(file: &File) -> HashSet<(u32, u32)> {
    let lets = |stmts: &[Stmt]| -> Vec<Span> {
        stmts
            .iter()
            .filter_map(|s| match s {
                Stmt::Let(l) => Some(l.value.span),
                _ => None,
            })
            .collect()
    };
    let mut spans = Vec::new();
    for item in &file.items {
        match item {
            Item::Let(l) => spans.push(l.value.span),
            Item::Model(m) => spans.extend(lets(&m.stmts)),
            Item::Block(b) => {
                spans.extend(lets(&b.body.stmts));
                spans.extend(
                    b.params
                        .iter()
                        .filter_map(|p| p.default.as_ref().map(|d| d.span)),
                );
            }
            Item::Use(_) | Item::Fn(_) | Item::Section(_) => {}
        }
    }
    spans.into_iter().map(|s| (s.start, s.end)).collect()
}
