//! `parc check SPEC --resume DIR`: whether the checkpoint in `DIR` can continue under the spec's
//! plan and what moves, before any GPU is held. The plan is lowered as `parc run` lowers it (one
//! program per rank), the checkpoint chosen and verified as `--resume` chooses it; a change it
//! cannot follow is an error naming the field (E1101 model, E1102 optimizer, E1103 precision,
//! E1104 global batch, E1105 seed, E1106 a checkpoint without a layout record or unreadable);
//! otherwise [`Moves`] says, per rank of the new plan, the bytes it reads and from which shard
//! files. The dataset's size, which the manifest also records, is compared by `parc run`.
use parc_compiler::diag::Diagnostic;
use parc_compiler::driver::{self, CompileOptions, Compiled, Stage};
use parc_compiler::Override;
use parc_runtime::checkpoint::{self, reshard::RankRead, Layout, ResumeKind};
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

/// The resume of `dir` under the plan of the spec (`file`, `text`, `overrides`, compiled as
/// `parc run` compiles it with `fusion`): the moves, or the error that refuses it.
pub fn diagnose(
    file: &str,
    text: String,
    overrides: &[Override],
    fusion: bool,
    dir: &Path,
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
    let hash = checkpoint::plan_hash(&plan);
    let kind = checkpoint::plan_change(&manifest, &hash, &layout, spec.train.seed, false).map_err(
        |refusal| {
            refused(
                refusal.code,
                format!(
                    "{} cannot continue under this spec ({} changed): {}",
                    chosen.display(),
                    refusal.field,
                    refusal.message
                ),
                &refusal.help,
            )
        },
    )?;
    let reads = match (&manifest.layout, kind) {
        // A checkpoint of this plan without a layout record: each rank loads its own shard.
        (None, ResumeKind::SamePlan) => Vec::new(),
        _ => checkpoint::reshard::plan_all(&manifest, &layout).map_err(unreadable)?,
    };
    Ok(Moves {
        checkpoint: chosen.display().to_string(),
        step: manifest.step,
        from_ranks: manifest.world,
        to_ranks: plan.world,
        same_plan: kind == ResumeKind::SamePlan,
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
    format!(
        "\nresume from {} (step {}): {how}\n{}",
        moves.checkpoint,
        moves.step,
        crate::cmd_reshard::render_moves(&moves.reads)
    )
}
