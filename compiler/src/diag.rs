//! Diagnostics: what every stage of the compiler reports to the user.
//!
//! A `Diagnostic` has a stable code (`E0xxx` errors, `W0xxx` warnings; the catalogue lives in
//! `docs/diagnostics.md`), a message, labelled spans into the sources and a help line that says
//! what to change, with the number to use. Stages collect many per run into a `Diagnostics` list
//! and keep going; the CLI renders them with miette or as JSON.
//!
//! Code ranges: E01xx syntax, E02xx names and imports, E03xx shapes, E04xx mesh and divisibility,
//! E05xx batch arithmetic and schedules, E06xx placement, E07xx memory, E08xx lowering and
//! verification, E09xx values and overrides; W0xxx warnings in the same ranges.

use serde::Serialize;
use std::fmt;

/// Index of a source file in a [`Sources`] map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Default)]
pub struct FileId(pub u32);

/// A byte range in one source file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Default)]
pub struct Span {
    pub file: FileId,
    pub start: u32,
    pub end: u32,
}

impl Span {
    pub fn new(file: FileId, start: usize, end: usize) -> Span {
        Span {
            file,
            start: start as u32,
            end: end as u32,
        }
    }
    /// The smallest span covering both (same file assumed; `self`'s file wins).
    pub fn to(self, other: Span) -> Span {
        Span {
            file: self.file,
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }
}

/// One source text: a user file, a stdlib module, or a `--set` override.
#[derive(Clone, Debug, Serialize)]
pub struct SourceFile {
    pub name: String,
    pub text: String,
}

/// All sources of one compilation. The compiler never reads files: the CLI adds them here.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sources {
    pub files: Vec<SourceFile>,
}

impl Sources {
    pub fn add(&mut self, name: impl Into<String>, text: impl Into<String>) -> FileId {
        self.files.push(SourceFile {
            name: name.into(),
            text: text.into(),
        });
        FileId(self.files.len() as u32 - 1)
    }
    pub fn get(&self, id: FileId) -> Option<&SourceFile> {
        self.files.get(id.0 as usize)
    }
    /// 1-based line and column (in characters) of a byte offset.
    pub fn line_col(&self, span: Span) -> (u32, u32) {
        let Some(file) = self.get(span.file) else {
            return (0, 0);
        };
        let upto = (span.start as usize).min(file.text.len());
        let upto = (0..=upto)
            .rev()
            .find(|&i| file.text.is_char_boundary(i))
            .unwrap_or(0);
        let before = &file.text[..upto];
        let line = before.matches('\n').count() as u32 + 1;
        let col = before
            .rsplit('\n')
            .next()
            .map(|l| l.chars().count())
            .unwrap_or(0) as u32
            + 1;
        (line, col)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Warning,
    Error,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Label {
    pub span: Span,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Diagnostic {
    /// Stable code, e.g. `E0401`.
    pub code: &'static str,
    pub severity: Severity,
    pub message: String,
    /// The first label is the primary one.
    pub labels: Vec<Label>,
    /// What to change, with the number to use.
    pub help: Option<String>,
    pub notes: Vec<String>,
    /// The help's concrete changes in a form a tool can apply, one [`Fix`] per alternative.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fixes: Vec<Fix>,
}

/// One alternative a help line suggests, as changes applied together: `--set PATH=VALUE`
/// overrides (`parallel.tp=2`, `model.vocab=50304`) and text edits of the sources (`2 * d`
/// becomes `64`): a spec with them passes the check that reported it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Fix {
    /// Each `PATH=VALUE`, as `--set` takes it.
    pub sets: Vec<String>,
    /// Each text edit: the spec file's text or a `--set` flag's (`check::fixes` keeps only
    /// edits the user can make there).
    pub edits: Vec<Edit>,
}

/// A text edit: `span`'s text becomes `replacement`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Edit {
    pub span: Span,
    pub replacement: String,
}

impl Diagnostic {
    pub fn error(code: &'static str, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            code,
            severity: Severity::Error,
            message: message.into(),
            labels: Vec::new(),
            help: None,
            notes: Vec::new(),
            fixes: Vec::new(),
        }
    }
    pub fn warning(code: &'static str, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            severity: Severity::Warning,
            ..Diagnostic::error(code, message)
        }
    }
    pub fn label(mut self, span: Span, message: impl Into<String>) -> Diagnostic {
        self.labels.push(Label {
            span,
            message: message.into(),
        });
        self
    }
    pub fn help(mut self, help: impl Into<String>) -> Diagnostic {
        self.help = Some(help.into());
        self
    }
    /// An alternative of the help as `--set` overrides (`path`, value) applied together.
    pub fn fix<P: fmt::Display, V: fmt::Display>(
        mut self,
        sets: impl IntoIterator<Item = (P, V)>,
    ) -> Diagnostic {
        let sets = sets
            .into_iter()
            .map(|(path, v)| format!("{path}={v}"))
            .collect();
        self.fixes.push(Fix {
            sets,
            edits: Vec::new(),
        });
        self
    }
    /// An alternative of the help as a text edit: `span`'s text becomes `replacement`.
    pub fn edit(mut self, span: Span, replacement: impl Into<String>) -> Diagnostic {
        self.fixes.push(Fix {
            sets: Vec::new(),
            edits: vec![Edit {
                span,
                replacement: replacement.into(),
            }],
        });
        self
    }
    pub fn note(mut self, note: impl Into<String>) -> Diagnostic {
        self.notes.push(note.into());
        self
    }
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
    pub fn primary_span(&self) -> Option<Span> {
        self.labels.first().map(|l| l.span)
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}[{}]: {}",
            self.severity_word(),
            self.code,
            self.message
        )
    }
}

impl Diagnostic {
    fn severity_word(&self) -> &'static str {
        match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        }
    }
}

/// The diagnostics of one run, in the order they were found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Diagnostics {
    pub items: Vec<Diagnostic>,
}

impl Diagnostics {
    pub fn push(&mut self, d: Diagnostic) {
        self.items.push(d);
    }
    pub fn extend(&mut self, other: Diagnostics) {
        self.items.extend(other.items);
    }
    pub fn has_errors(&self) -> bool {
        self.items.iter().any(Diagnostic::is_error)
    }
    pub fn error_count(&self) -> usize {
        self.items.iter().filter(|d| d.is_error()).count()
    }
    pub fn warning_count(&self) -> usize {
        self.items.len() - self.error_count()
    }
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}
