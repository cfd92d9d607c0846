//! `parc check`'s look at the training data, which the pure compiler cannot read: files that
//! exist must hold at least one global batch (E1001); files that are not here are a warning
//! (W1002: a spec is often checked where its data is not, on a laptop or in CI, and `parc run`
//! fails on them where they are still missing); an epoch of only a few global batches is a
//! warning too, as the run repeats its data often (W1001).
//!
//! Only file sizes are read: token files hold `size / width` tokens; text through a tokenizer
//! is only checked to exist (counting its tokens means tokenizing it, which `parc run` does).
//! It runs on a spec without errors, as lowering does.
use parc_compiler::diag::{Diagnostic, Span};
use parc_compiler::spec::{DataFormat, DataSource, Spec};
use parc_runtime::data::files::data_files;
use std::path::Path;

/// Epochs shorter than this many global batches are warned about when the run repeats them.
const FEW_BATCHES: u64 = 10;

/// The data's diagnostics for `spec`, whose relative paths start at `spec_dir`.
pub fn diagnose(spec: &Spec, spec_dir: &Path) -> Vec<Diagnostic> {
    let (path, extension, width, span) = match &spec.train.data {
        DataSource::File { path, format, span } => {
            let (extension, width) = match format {
                DataFormat::Bytes => ("txt", 1),
                DataFormat::U16 => ("bin", 2),
                DataFormat::U32 => ("bin", 4),
            };
            (path, extension, Some(width), *span)
        }
        DataSource::Text { path, span, .. } => (path, "txt", None, *span),
        DataSource::Synthetic => return Vec::new(),
    };
    let files = match data_files(spec_dir, path, extension) {
        Ok(files) => files,
        Err(e) => return vec![missing(span, &e.to_string())],
    };
    let Some(width) = width else {
        return Vec::new();
    };
    let bytes: u64 = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    batches(spec, bytes / width, span)
}

fn missing(span: Span, error: &str) -> Diagnostic {
    Diagnostic::warning(
        "W1002",
        "the training data is not here; `parc run` fails unless it is where the run starts",
    )
    .label(span, "this data")
    .help(error.to_string())
}

/// E1001 for fewer samples than one global batch; W1001 for an epoch of few batches that the
/// run goes through more than once.
fn batches(spec: &Spec, tokens: u64, span: Span) -> Vec<Diagnostic> {
    let (seq, global) = (spec.model.seq, spec.train.global_batch);
    let samples = tokens.saturating_sub(1) / seq.max(1);
    let per_epoch = samples / global.max(1);
    if per_epoch == 0 {
        let d = Diagnostic::error(
            "E1001",
            format!(
                "the training data holds {tokens} tokens: {samples} samples of seq + 1 = {} \
                 tokens, fewer than one global batch of {global}",
                seq + 1
            ),
        )
        .label(span, "too little data")
        .help(format!(
            "give at least {} tokens, or lower global_batch to {}",
            global * seq + 1,
            samples.max(1)
        ));
        return vec![d];
    }
    if per_epoch < FEW_BATCHES && spec.train.steps > per_epoch {
        let d = Diagnostic::warning(
            "W1001",
            format!(
                "an epoch of the training data is only {per_epoch} global batches: {} steps go \
                 through it {} times",
                spec.train.steps,
                spec.train.steps.div_ceil(per_epoch)
            ),
        )
        .label(span, format!("{samples} samples"))
        .help("train on more data, or expect the loss to fall by memorising it");
        return vec![d];
    }
    Vec::new()
}
