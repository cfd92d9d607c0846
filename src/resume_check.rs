//! `parc check SPEC --resume DIR`: whether the checkpoint in `DIR` can continue under the spec's
//! plan and what moves, before any GPU is held. The plan is lowered as `parc run` lowers it (one
//! program per rank), the checkpoint chosen and verified as `--resume` chooses it; a change it
//! cannot follow is an error naming the field (E1101 model, E1102 optimizer, E1103 precision,
//! E1104 global batch, E1105 seed, E1106 a checkpoint without a layout record or unreadable,
//! E1107 other training data: [`judge`], which `parc reshard` applies too); otherwise [`Moves`]
//! says, per rank of the new plan, the bytes it reads and from which shard files
//! ([`render_moves`]). The data is compared as far as it can be without opening it: its files'
//! sizes and fingerprints, and the samples where its tokens are known (token files by their
//! size; text only when its files are the checkpoint's); `parc run` compares the rest.
use parc_compiler::diag::{Diagnostic, Span};
use parc_compiler::driver::{self, CompileOptions, Compiled, Stage};
use parc_compiler::ir::Plan;
use parc_compiler::spec::{DataSource, Spec};
use parc_compiler::Override;
use parc_runtime::checkpoint::layout::Refusal;
use parc_runtime::checkpoint::{self, reshard::RankRead, Consent, Layout, Manifest, ResumeKind};
use parc_runtime::data::{training_samples, DataRecord};
use serde::Serialize;
use std::path::Path;

/// What resuming moves.
#[derive(Serialize)]
pub struct Moves {
    /// The checkpoint `--resume` would continue.
    pub checkpoint: String,
    pub step: u64,
    pub from_ranks: u32,
    pub to_ranks: u32,
    /// Written by this very plan: each rank loads its own shard.
    pub same_plan: bool,
    /// How this spec's training data differs from the checkpoint's, when `--resume-any-data`
    /// consented to it.
    pub data_change: Option<String>,
    /// Per rank of the new plan: bytes read and the old shard files read from.
    pub ranks: Vec<RankMoves>,
    #[serde(skip)]
    pub reads: Vec<RankRead>,
}

#[derive(Serialize)]
pub struct RankMoves {
    pub rank: u32,
    pub bytes: u64,
    pub shards: Vec<u32>,
}

fn refused(code: &'static str, message: String, help: &str) -> Diagnostic {
    Diagnostic::error(code, message).help(help.to_string())
}

/// How the checkpoint continues under a spec, when it can.
pub struct Judged {
    pub kind: ResumeKind,
    /// The consented change of training data (`--resume-any-data`).
    pub data_change: Option<String>,
    /// Whether the spec's training data was here to be compared.
    pub data_compared: bool,
}

/// Whether the checkpoint of `manifest` can continue under `spec` (lowered to `plan`, its
/// shards laid out as `layout`; data paths relative to `spec_dir`) with `consent`: how, or the
/// refusal naming the field.
pub fn judge(
    manifest: &Manifest,
    spec: &Spec,
    plan: &Plan,
    layout: &Layout,
    spec_dir: &Path,
    consent: Consent,
) -> Result<Judged, Refusal> {
    let hash = checkpoint::plan_hash(plan);
    let seed = spec.train.seed;
    let kind = checkpoint::plan_change(manifest, &hash, layout, seed, consent.any_batch)?;
    let record = DataRecord::scan(&spec.train.data, spec_dir).ok();
    let seen = checkpoint::DataSeen {
        record: record.as_ref(),
        samples: record.as_ref().and_then(|r| samples(spec, manifest, r)),
    };
    let data_change = match checkpoint::data_change(manifest, seen) {
        Some(refusal) if !consent.any_data => return Err(refusal),
        change => change.map(|r| r.message),
    };
    Ok(Judged {
        kind,
        data_change,
        data_compared: record.is_some(),
    })
}

/// The samples training would draw from the data of `record`, where its tokens are known.
fn samples(spec: &Spec, manifest: &Manifest, record: &DataRecord) -> Option<u64> {
    if matches!(spec.train.data, DataSource::Synthetic) {
        return Some(parc_runtime::exec::SYNTHETIC_SAMPLES);
    }
    let tokens = checkpoint::dataset::known_tokens(manifest, record)?;
    let samples = tokens.saturating_sub(1) / spec.model.seq.max(1);
    Some(training_samples(spec, samples))
}

/// Where the spec gives its training data.
fn data_span(spec: &Spec) -> Option<Span> {
    match &spec.train.data {
        DataSource::File { span, .. } | DataSource::Text { span, .. } => Some(*span),
        DataSource::Synthetic => None,
    }
}

/// The resume of `dir` under the plan of the spec (`file`, `text`, `overrides`, compiled as
/// `parc run` compiles it with `fusion`; data paths relative to `spec_dir`) with `consent`:
/// the moves, or the error that refuses it.
pub fn diagnose(
    file: &str,
    text: String,
    overrides: &[Override],
    fusion: bool,
    dir: &Path,
    spec_dir: &Path,
    consent: Consent,
) -> Result<Moves, Diagnostic> {
    let options = CompileOptions {
        fusion,
        ..CompileOptions::through(Stage::Lower)
    };
    let Compiled {
        spec: Some(spec),
        plan: Some(plan),
        ..
    } = driver::compile(file, text, overrides, &options)
    else {
        return Err(refused(
            "E1106",
            "the spec's plan cannot be lowered, so a resume cannot be checked".to_string(),
            "fix the errors `parc check` shows without --resume",
        ));
    };
    let unreadable = |e: parc_runtime::error::RuntimeError| {
        refused(
            "E1106",
            e.to_string(),
            "give --resume a checkpoint folder that `parc run --resume` accepts",
        )
    };
    let (chosen, manifest) = checkpoint::choose_resume(dir).map_err(unreadable)?;
    let layout = Layout::of(&spec, &plan).map_err(unreadable)?;
    let judged = judge(&manifest, &spec, &plan, &layout, spec_dir, consent).map_err(|refusal| {
        let d = refused(
            refusal.code,
            format!(
                "{} cannot continue under this spec ({} changed): {}",
                chosen.display(),
                refusal.field,
                refusal.message
            ),
            &refusal.help,
        );
        match data_span(&spec).filter(|_| refusal.field == "train.data") {
            Some(span) => d.label(span, "other data than the checkpoint's run trained on"),
            None => d,
        }
    })?;
    let reads = match (&manifest.layout, judged.kind) {
        // A checkpoint of this plan without a layout record: each rank loads its own shard.
        (None, ResumeKind::SamePlan) => Vec::new(),
        _ => checkpoint::reshard::plan_all(&manifest, &layout).map_err(unreadable)?,
    };
    Ok(Moves {
        checkpoint: chosen.display().to_string(),
        step: manifest.step,
        from_ranks: manifest.world,
        to_ranks: plan.world,
        same_plan: judged.kind == ResumeKind::SamePlan,
        data_change: judged.data_change,
        ranks: reads
            .iter()
            .map(|r| RankMoves {
                rank: r.rank,
                bytes: r.bytes(),
                shards: r.shards().into_iter().collect(),
            })
            .collect(),
        reads,
    })
}

/// The moves for people.
pub fn render(moves: &Moves) -> String {
    let how = if moves.same_plan {
        "written by this plan: each rank loads its own shard".to_string()
    } else {
        format!(
            "re-sharded on load from {} ranks to {}, each rank reading only its slices",
            moves.from_ranks, moves.to_ranks
        )
    };
    let data = match &moves.data_change {
        Some(change) => format!(
            "  other training data (--resume-any-data): {change}; the sampler continues on \
             this data at the samples the checkpoint had seen\n"
        ),
        None => String::new(),
    };
    format!(
        "\nresume from {} (step {}): {how}\n{data}{}",
        moves.checkpoint,
        moves.step,
        render_moves(&moves.reads)
    )
}

/// One line per new rank: the bytes it reads and from which old shard files.
pub fn render_moves(reads: &[RankRead]) -> String {
    let mut out = String::new();
    for read in reads {
        let shards = read.shards();
        let names: Vec<String> = shards.iter().map(|&r| format!("rank {r}")).collect();
        let from = match names.len() {
            0 => "nothing".to_string(),
            1..=4 => format!(
                "{} shard file{} ({})",
                names.len(),
                plural(names.len()),
                names.join(", ")
            ),
            n => format!("{n} shard files"),
        };
        out.push_str(&format!(
            "  rank {}: reads {} from {from}\n",
            read.rank,
            bytes(read.bytes())
        ));
    }
    out
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// `12.3 KiB`: a size for people.
fn bytes(n: u64) -> String {
    let n = n as f64;
    match n {
        n if n >= 1024.0 * 1024.0 * 1024.0 => format!("{:.2} GiB", n / (1024.0 * 1024.0 * 1024.0)),
        n if n >= 1024.0 * 1024.0 => format!("{:.2} MiB", n / (1024.0 * 1024.0)),
        n if n >= 1024.0 => format!("{:.1} KiB", n / 1024.0),
        n => format!("{n} B"),
    }
}
