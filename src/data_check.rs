//! `parc check`'s look at the training and evaluation data, which the pure compiler cannot
//! read, so that it refuses what `parc run` would refuse when it opens them:
//!
//! - files that exist must hold at least one global batch (E1001), and with `train.eval` on
//!   the training data's held-out tail, one global batch beside the `batches` held out;
//!   evaluation data of its own must hold its `batches` global batches (E1001 too);
//! - a file `parc run` cannot read as written is an error (E1004): an empty file, a size that
//!   is not a whole number of `as u16`/`as u32` tokens, a folder with no data files, a shard
//!   folder whose `info.json` names another width;
//! - files that are not here are a warning (W1002: a spec is often checked where its data is
//!   not, on a laptop or in CI, and `parc run` fails on them where they are still missing);
//! - an epoch of only a few global batches is a warning too, as the run repeats its data often
//!   (W1001);
//! - a text source's `tokenizer.json` is opened as the run opens it, relative to the spec's
//!   folder: not here is a warning (W1004, as data that is not here), one the run cannot read
//!   an error (E1004), one with more tokens than the model's `vocab` an error (E0310, as for
//!   the built-in tokenizers).
//!
//! Only file sizes are read, and the tokenizer: token files hold `size / width` tokens; text
//! through a tokenizer is only checked to exist and not to be empty (counting its tokens means
//! tokenizing it, which `parc run` does). It runs on a spec without errors, as lowering does.
use parc_compiler::diag::{Diagnostic, Span};
use parc_compiler::spec::{DataSource, Spec, Tokenizer as TokenizerSpec};
use parc_runtime::data::files::data_files;
use parc_runtime::data::source::{check_shard_format, check_token_file_size};
use parc_runtime::data::training_samples;
use parc_runtime::data::Tokenizer;
use parc_runtime::error::RuntimeError;
use std::path::Path;

/// Epochs shorter than this many global batches are warned about when the run repeats them.
const FEW_BATCHES: u64 = 10;

/// The data's diagnostics for `spec`, whose relative paths start at `spec_dir`.
pub fn diagnose(spec: &Spec, spec_dir: &Path) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    match measure(&spec.train.data, "train.data", spec_dir) {
        Measured::Tokens(tokens, span) => out.extend(batches(spec, tokens, span)),
        Measured::Refused(d) => out.push(d),
        Measured::Uncounted => {}
    }
    let vocab = spec.model.vocab;
    out.extend(tokenizer_file(
        &spec.train.data,
        "train.data",
        vocab,
        spec_dir,
    ));
    if let Some(source) = spec.train.eval.as_ref().and_then(|e| e.data.as_ref()) {
        match measure(source, "train.eval.data", spec_dir) {
            Measured::Tokens(tokens, span) => out.extend(eval_batches(spec, tokens, span)),
            Measured::Refused(d) => out.push(d),
            Measured::Uncounted => {}
        }
        // The training data's tokenizer once: its file says the same twice.
        if tokenizer_path(source) != tokenizer_path(&spec.train.data) {
            out.extend(tokenizer_file(source, "train.eval.data", vocab, spec_dir));
        }
    }
    out
}

/// The `tokenizer.json` a text source names, if it names one.
fn tokenizer_path(source: &DataSource) -> Option<&str> {
    match source {
        DataSource::Text {
            tokenizer: TokenizerSpec::File { path },
            ..
        } => Some(path),
        _ => None,
    }
}

/// A text source's `tokenizer.json`, opened as `parc run` opens it (relative to the spec's
/// folder): W1004 when it is not here, E1004 when the run could not read it, E0310 when it
/// has more tokens than the model's `vocab`. Labelled at the path.
fn tokenizer_file(
    source: &DataSource,
    setting: &str,
    vocab: u64,
    spec_dir: &Path,
) -> Option<Diagnostic> {
    let DataSource::Text {
        tokenizer: kind @ TokenizerSpec::File { path },
        tokenizer_span: span,
        ..
    } = source
    else {
        return None;
    };
    let file = spec_dir.join(path);
    let opened = match Tokenizer::open(kind, spec_dir) {
        Ok(opened) => opened,
        Err(e) if !file.exists() => {
            let d = Diagnostic::warning(
                "W1004",
                format!(
                    "the tokenizer of `{setting}` is not here; `parc run` fails unless it is \
                     where the run starts"
                ),
            )
            .label(*span, "this tokenizer")
            .help(format!(
                "{} (a path in `text(…)` is relative to the spec's folder)",
                message(e)
            ));
            return Some(d);
        }
        Err(e) => {
            let d = Diagnostic::error(
                "E1004",
                format!("`{setting}` cannot be read as written: {}", message(e)),
            )
            .label(*span, "this tokenizer")
            .help(
                "give the path of a Hugging Face tokenizer.json (relative to the spec's \
                 folder), or use `tokenizer: gpt2` or `tokenizer: bytes`",
            );
            return Some(d);
        }
    };
    let size = opened.vocab_size();
    if size <= vocab {
        return None;
    }
    let padded = size.div_ceil(64) * 64;
    let d = Diagnostic::error(
        "E0310",
        format!(
            "the tokenizer {} has {size} tokens but vocab = {vocab}",
            file.display()
        ),
    )
    .label(*span, format!("{size} tokens"))
    .help(format!(
        "set `let vocab = {padded}` in the model (at least {size}; a multiple of 64 keeps the \
         embedding and head fast), or use a tokenizer of at most {vocab} tokens"
    ));
    Some(d)
}

/// What the sizes of a data source's files say.
enum Measured {
    /// Token files holding this many tokens.
    Tokens(u64, Span),
    /// Missing (W1002) or unreadable as written (E1004).
    Refused(Diagnostic),
    /// Synthetic tokens, or text whose tokens only the tokenizer counts.
    Uncounted,
}

fn measure(source: &DataSource, setting: &str, spec_dir: &Path) -> Measured {
    let (path, extension, format, span) = match source {
        DataSource::File { path, format, span } => (path, format.extension(), Some(*format), *span),
        DataSource::Text { path, span, .. } => (path, "txt", None, *span),
        DataSource::Synthetic => return Measured::Uncounted,
    };
    let files = match data_files(spec_dir, path, extension) {
        Ok(files) => files,
        // A folder that is here but holds no data files is not a missing folder.
        Err(e) if spec_dir.join(path).is_dir() => {
            let help = "point it at the folder of the data files, or at the files themselves";
            return Measured::Refused(unreadable(setting, span, &message(e), help));
        }
        Err(e) => return Measured::Refused(missing(setting, span, &message(e))),
    };
    if let Some(format) = format {
        if let Err(e) = check_shard_format(&spec_dir.join(path), format) {
            return Measured::Refused(unreadable(setting, span, &message(e), WIDTHS));
        }
    }
    let mut total = 0u64;
    for file in &files {
        let Ok(size) = std::fs::metadata(file).map(|m| m.len()) else {
            continue;
        };
        total = total.saturating_add(size);
        let Some(format) = format else {
            continue;
        };
        // The run reads token files one by one and refuses an empty or truncated one.
        if let Err(e) = check_token_file_size(file, size, format) {
            let help = if size == 0 {
                "remove the empty file, or point the data at files that hold tokens"
            } else {
                WIDTHS
            };
            return Measured::Refused(unreadable(setting, span, &message(e), help));
        }
    }
    match format {
        Some(format) => Measured::Tokens(total / format.width(), span),
        None if total == 0 => {
            let what = format!("{path}: the text is empty");
            let help = "point the data at text that holds training tokens";
            Measured::Refused(unreadable(setting, span, &what, help))
        }
        None => Measured::Uncounted,
    }
}

fn missing(setting: &str, span: Span, error: &str) -> Diagnostic {
    let whose = if setting == "train.data" {
        "training"
    } else {
        "evaluation"
    };
    Diagnostic::warning(
        "W1002",
        format!("the {whose} data is not here; `parc run` fails unless it is where the run starts"),
    )
    .label(span, "this data")
    .help(error.to_string())
}

/// The help of a token file whose size or folder disagrees with its `as`.
const WIDTHS: &str = "token files hold little-endian ids of the width `as` names (`as bytes`: \
                      one a byte, `as u16`: two, `as u32`: four); re-tokenize the data (`parc \
                      tokenize`) or fix the path or the `as`";

/// A data error's own words, without the `data: ` its display starts with.
fn message(e: RuntimeError) -> String {
    match e {
        RuntimeError::Data(what) => what,
        other => other.to_string(),
    }
}

/// E1004: the data is here but `parc run` would refuse to read it as written.
fn unreadable(setting: &str, span: Span, error: &str, help: &str) -> Diagnostic {
    Diagnostic::error(
        "E1004",
        format!("`{setting}` cannot be read as written: {error}"),
    )
    .label(span, "this data")
    .help(help.to_string())
}

/// E1001 for fewer samples than one global batch (beside the evaluation's held-out tail);
/// W1001 for an epoch of few batches that the run goes through more than once.
fn batches(spec: &Spec, tokens: u64, span: Span) -> Vec<Diagnostic> {
    let (seq, global) = (spec.model.seq, spec.train.global_batch);
    let samples = tokens.saturating_sub(1) / seq.max(1);
    let trained = training_samples(spec, samples);
    let held = samples - trained;
    let needed_tokens = global
        .saturating_add(held)
        .saturating_mul(seq)
        .saturating_add(1);
    if trained < global {
        let d = if held > 0 || samples >= global {
            let batches = spec.train.eval.as_ref().map_or(0, |e| e.batches);
            let fits = samples / global.max(1);
            let lower = if fits >= 2 {
                format!("lower `batches` in train.eval to {}, ", fits - 1)
            } else {
                String::new()
            };
            Diagnostic::error(
                "E1001",
                format!(
                    "the training data holds {samples} samples of seq + 1 = {} tokens: holding \
                     out train.eval.batches × global_batch = {batches} × {global} = {} for \
                     evaluation leaves {trained}, fewer than one global batch of {global}",
                    seq + 1,
                    batches.saturating_mul(global)
                ),
            )
            .label(span, "too little data")
            .help(format!(
                "{lower}give evaluation data of its own (`eval = {{ every: …, data: \"val.bin\" \
                 as u16 }}`), or give at least {needed_tokens} tokens"
            ))
        } else {
            Diagnostic::error(
                "E1001",
                format!(
                    "the training data holds {tokens} tokens: {samples} samples of seq + 1 = {} \
                     tokens, fewer than one global batch of {global}",
                    seq + 1
                ),
            )
            .label(span, "too little data")
            .help(format!(
                "give at least {needed_tokens} tokens, or lower global_batch to {}",
                samples.max(1)
            ))
        };
        return vec![d];
    }
    let per_epoch = trained / global.max(1);
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
        .label(span, format!("{trained} samples"))
        .help("train on more data, or expect the loss to fall by memorising it");
        return vec![d];
    }
    Vec::new()
}

/// E1001 for evaluation data of its own holding fewer than `train.eval.batches` global batches.
fn eval_batches(spec: &Spec, tokens: u64, span: Span) -> Vec<Diagnostic> {
    let (seq, global) = (spec.model.seq, spec.train.global_batch);
    let batches = spec.train.eval.as_ref().map_or(0, |e| e.batches);
    let samples = tokens.saturating_sub(1) / seq.max(1);
    let fits = samples / global.max(1);
    if fits >= batches {
        return Vec::new();
    }
    let lower = if fits >= 1 {
        format!("set `batches` in train.eval to at most {fits}, or ")
    } else {
        String::new()
    };
    let needed = batches
        .saturating_mul(global)
        .saturating_mul(seq)
        .saturating_add(1);
    vec![Diagnostic::error(
        "E1001",
        format!(
            "the evaluation data holds {samples} samples of seq + 1 = {} tokens, fewer than \
             train.eval.batches × global_batch = {batches} × {global} = {}",
            seq + 1,
            batches.saturating_mul(global)
        ),
    )
    .label(span, "too little data")
    .help(format!("{lower}give at least {needed} tokens"))]
}
