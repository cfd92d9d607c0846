//! Rendering compiler diagnostics for people (miette's graphical report, fixed width, colour only
//! on a terminal) and for programs (the JSON objects of `docs/check-json.md`). Labels in other
//! files than the primary one (a stdlib module, a `--set` flag) are shown as related reports
//! with their own source, so every label points into the right text.

use miette::{
    GraphicalReportHandler, GraphicalTheme, LabeledSpan, NamedSource, Severity as MSeverity,
};
use parc_compiler::diag::{Diagnostic, FileId, Severity, Sources, Span};
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
    source: NamedSource<String>,
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

fn source_of(sources: &Sources, file: FileId) -> NamedSource<String> {
    match sources.get(file) {
        Some(f) => NamedSource::new(f.name.clone(), f.text.clone()),
        None => NamedSource::new("<unknown>", String::new()),
    }
}

/// `d`'s labels that point into `file`, each clamped to the file's text.
fn labels_in(sources: &Sources, d: &Diagnostic, file: FileId) -> Vec<LabeledSpan> {
    let len = sources.get(file).map(|f| f.text.len()).unwrap_or(0);
    (d.labels.iter())
        .filter(|l| l.span.file == file)
        .map(|l| {
            let start = (l.span.start as usize).min(len);
            let end = (l.span.end as usize).clamp(start, len);
            LabeledSpan::new(Some(l.message.clone()), start, end - start)
        })
        .collect()
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
    let mut help = d.help.clone();
    for n in &d.notes {
        help = Some(match help {
            Some(h) => format!("{h}\nnote: {n}"),
            None => format!("note: {n}"),
        });
    }
    let related = files
        .into_iter()
        .map(|f| Report {
            code: String::new(),
            severity: MSeverity::Advice,
            message: format!(
                "related: {}",
                sources.get(f).map(|s| s.name.as_str()).unwrap_or("")
            ),
            help: None,
            source: source_of(sources, f),
            labels: labels_in(sources, d, f),
            related: Vec::new(),
        })
        .collect();
    Report {
        code: d.code.to_string(),
        severity,
        message: d.message.clone(),
        help,
        source: source_of(sources, primary),
        labels: labels_in(sources, d, primary),
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
    })
}
