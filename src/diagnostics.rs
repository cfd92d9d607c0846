//! Rendering compiler diagnostics for people (miette's graphical report, fixed width, colour only
//! on a terminal) and for programs (the JSON objects of `docs/check-json.md`). Labels in other
//! files than the primary one (a stdlib module, a `--set` flag) are shown as related reports
//! with their own source, so every label points into the right text. The text shown is the
//! file's with control characters escaped and long lines cut around the labels
//! ([`crate::diag_text`]); JSON keeps the file's own positions.

use crate::diag_text::{escape_controls, ShownSource};
use miette::{GraphicalReportHandler, GraphicalTheme, LabeledSpan, Severity as MSeverity};
use parc_compiler::diag::{Diagnostic, FileId, Fix, Severity, Sources, Span};
use serde_json::{json, Value};
use std::fmt;
use std::io::IsTerminal;

/// Report width: fixed, so output does not depend on the terminal (goldens are stable).
const WIDTH: usize = 100;

/// One diagnostic's view for miette: the labels that fall in one file.
#[derive(Debug)]
struct Report {
    code: String,
    severity: MSeverity,
    message: String,
    help: Option<String>,
    source: ShownSource,
    labels: Vec<LabeledSpan>,
    related: Vec<Report>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Report {}

impl miette::Diagnostic for Report {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        (!self.code.is_empty()).then(|| Box::new(&self.code) as Box<dyn fmt::Display>)
    }
    fn severity(&self) -> Option<MSeverity> {
        Some(self.severity)
    }
    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.help
            .as_ref()
            .map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }
    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        Some(&self.source)
    }
    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        Some(Box::new(self.labels.iter().cloned()))
    }
    fn related<'a>(&'a self) -> Option<Box<dyn Iterator<Item = &'a dyn miette::Diagnostic> + 'a>> {
        if self.related.is_empty() {
            return None;
        }
        Some(Box::new(
            self.related.iter().map(|r| r as &dyn miette::Diagnostic),
        ))
    }
}

/// `file` as `d` shows it (see [`crate::diag_text`]): its name and shown text, and `d`'s labels
/// that point into it, each clamped to the file's text and mapped into the shown text.
fn file_view(sources: &Sources, d: &Diagnostic, file: FileId) -> (ShownSource, Vec<LabeledSpan>) {
    let Some(source) = sources.get(file) else {
        return (ShownSource::new("<unknown>".into(), "", &[]), Vec::new());
    };
    let len = source.text.len();
    let spans: Vec<(usize, usize)> = (d.labels.iter())
        .filter(|l| l.span.file == file)
        .map(|l| {
            let start = (l.span.start as usize).min(len);
            (start, (l.span.end as usize).clamp(start, len))
        })
        .collect();
    let shown = ShownSource::new(escape_controls(&source.name), &source.text, &spans);
    let labels = (d.labels.iter().filter(|l| l.span.file == file))
        .zip(&spans)
        .map(|(l, &(start, end))| {
            let (start, end) = (shown.offset(start), shown.offset(end));
            LabeledSpan::new(Some(escape_controls(&l.message)), start, end - start)
        })
        .collect();
    (shown, labels)
}

fn report(sources: &Sources, d: &Diagnostic) -> Report {
    let severity = match d.severity {
        Severity::Error => MSeverity::Error,
        Severity::Warning => MSeverity::Warning,
    };
    let primary = d.primary_span().map(|s| s.file).unwrap_or_default();
    let mut files: Vec<FileId> = Vec::new();
    for l in &d.labels {
        if l.span.file != primary && !files.contains(&l.span.file) {
            files.push(l.span.file);
        }
    }
    let mut help = d.help.as_deref().map(escape_controls);
    for n in &d.notes {
        help = Some(match help {
            Some(h) => format!("{h}\nnote: {}", escape_controls(n)),
            None => format!("note: {}", escape_controls(n)),
        });
    }
    let related = files
        .into_iter()
        .map(|f| {
            let (source, labels) = file_view(sources, d, f);
            Report {
                code: String::new(),
                severity: MSeverity::Advice,
                message: format!("related: {}", source.name),
                help: None,
                source,
                labels,
                related: Vec::new(),
            }
        })
        .collect();
    let (source, labels) = file_view(sources, d, primary);
    Report {
        code: d.code.to_string(),
        severity,
        message: escape_controls(&d.message),
        help,
        source,
        labels,
        related,
    }
}

/// Render one diagnostic as text. `color` only when writing to a terminal.
pub fn render(sources: &Sources, d: &Diagnostic, color: bool) -> String {
    let theme = if color {
        GraphicalTheme::unicode()
    } else {
        GraphicalTheme::unicode_nocolor()
    };
    let handler = GraphicalReportHandler::new_themed(theme).with_width(WIDTH);
    let mut out = String::new();
    let r = report(sources, d);
    if handler.render_report(&mut out, &r).is_err() {
        out = format!("{d}\n");
    }
    out
}

/// Whether stderr gets colours (a terminal, and `NO_COLOR` unset).
pub fn stderr_color() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none()
}

fn position(sources: &Sources, span: Span) -> Value {
    let (line, column) = sources.line_col(span);
    let end = Span {
        start: span.end,
        ..span
    };
    let (end_line, end_column) = sources.line_col(end);
    json!({
        "file": sources.get(span.file).map(|f| f.name.as_str()).unwrap_or(""),
        "line": line,
        "column": column,
        "end_line": end_line,
        "end_column": end_column,
    })
}

/// One diagnostic as a JSON object (schema in docs/check-json.md).
pub fn to_json(sources: &Sources, d: &Diagnostic) -> Value {
    let primary = d
        .primary_span()
        .map(|s| position(sources, s))
        .unwrap_or_else(
            || json!({"file": "", "line": 0, "column": 0, "end_line": 0, "end_column": 0}),
        );
    let labels: Vec<Value> = d
        .labels
        .iter()
        .map(|l| {
            let mut p = position(sources, l.span);
            p["message"] = json!(l.message);
            p
        })
        .collect();
    json!({
        "code": d.code,
        "severity": match d.severity { Severity::Error => "error", Severity::Warning => "warning" },
        "message": d.message,
        "file": primary["file"],
        "line": primary["line"],
        "column": primary["column"],
        "labels": labels,
        "help": d.help,
        "notes": d.notes,
        "fixes": d.fixes.iter().map(|f| fix_json(sources, f)).collect::<Vec<_>>(),
    })
}

/// One alternative of a help: its `--set` overrides as `PATH=VALUE` strings, then its text
/// edits as objects (where, and the `replacement` text).
fn fix_json(sources: &Sources, fix: &Fix) -> Value {
    let sets = fix.sets.iter().map(|s| json!(s));
    let edits = fix.edits.iter().map(|e| {
        let mut p = position(sources, e.span);
        p["replacement"] = json!(e.replacement);
        p
    });
    Value::Array(sets.chain(edits).collect())
}
