//! Checkpoints: what a run saves every `train.checkpoint.every` steps and `parc run --resume`
//! loads to continue bit-identically.
//!
//! Layout of a checkpoint directory `DIR` (the spec's `checkpoint.dir`):
//!
//! ```text
//! DIR/step-00000010/manifest.json          the Manifest (plan hash, step, sampler, optimizer)
//! DIR/step-00000010/rank-00000.safetensors  rank 0's persistent buffers, named as in its program,
//!                                           and its backend's choices (`CHOICES_KEY`: the CUDA
//!                                           backend's timed GEMM algorithms), which a resumed
//!                                           run takes so it continues bit for bit
//! DIR/step-00000010/rank-00001.safetensors  …
//! ```
//!
//! A checkpoint is written into `DIR/.step-00000010.tmp/` (each file: temp file, fsync,
//! rename), the manifest last, then the folder is fsynced and renamed to `step-00000010` and
//! `DIR` is fsynced: a crash leaves either the whole checkpoint or none of it. Only the newest
//! `keep` checkpoints stay (0 keeps all). At the end of a run, `DIR/model.safetensors` holds the
//! final parameters as global tensors (plan-independent, for export), its step in the metadata.
//!
//! Saves run in the background by default (`train.checkpoint.async`): each rank copies its
//! buffers to host memory and its writer thread writes the shard while training goes on; rank 0
//! commits once every shard is written (`writer`, and `exec`'s saves). A run that takes the
//! folder removes the staging folders of saves that never finished.
//!
//! Each shard records a CRC-32C per tensor, which the manifest collects; resuming verifies them
//! (`verify`). A run that writes checkpoints holds `DIR/parc.lock` for its lifetime (`lock`).
//!
//! A checkpoint belongs to one plan: its manifest carries a hash of the lowered plan (programs,
//! groups, parameter layout, world) and the layout of its shards (`layout`). Under the same plan
//! each rank loads its own shard; under another plan of the same model, optimizer, precision and
//! global batch, each rank reads its slices of the old shards (`reshard`); anything else is
//! refused naming the field that changed. The manifest also records the training data, which a
//! resume must train on unless the user consents to other data (`dataset`).
pub mod dataset;
pub mod fault;
pub mod layout;
pub mod lock;
pub mod reshard;
pub mod resume;
pub mod saved;
pub mod store;
pub mod verify;
pub mod writer;

pub use dataset::{data_change, DataSeen};
pub use layout::Layout;
pub use lock::FolderLock;
pub use resume::choose_resume;
pub use saved::SavedModel;
pub use store::{
    commit, find_latest, model_path, prepare, read_manifest, read_shard, staging_dir, write_model,
    write_params, write_shard, write_shard_slices, Shard, ShardTensor, TensorSlice, CHOICES_KEY,
};
pub use writer::{remove_unfinished, Snapshot, SnapshotTensor, Writer};

use parc_compiler::ir::Plan;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Version of the manifest format this build writes. 2 added per-tensor checksums; format 1
/// (without them) is still read, and loaded unverified with a note.
pub const FORMAT: u32 = 2;

/// Dynamic loss-scaling state (fp16 runs); absent for fp32 and bf16.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaleState {
    pub scale: f64,
    /// Consecutive steps without overflow.
    pub good_steps: u32,
    /// Consecutive overflowing steps (for hysteresis).
    pub bad_steps: u32,
}

/// The metadata key of the spec in a saved model.
pub const SPEC_KEY: &str = "parc.spec";

/// The spec a run was started with, as the user wrote it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpecSource {
    /// The `.par` file's name as given (for diagnostics).
    pub file: String,
    /// The `.par` file's folder: relative paths in the spec are relative to it.
    pub dir: PathBuf,
    /// The `.par` text.
    pub text: String,
    /// The `--set` overrides, each `path=value`.
    pub overrides: Vec<String>,
}

/// Everything besides tensors that a resumed run needs to continue exactly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    /// Hash of the plan that wrote this checkpoint (see [`plan_hash`]).
    pub plan_hash: String,
    pub world: u32,
    /// Training steps completed; a resumed run starts with this 0-based step.
    pub step: u64,
    /// Optimizer updates applied (Adam's bias-correction count).
    pub optimizer_step: u64,
    /// The run's seed (parameter init, sampler permutations, synthetic data).
    pub seed: u64,
    /// Samples in the dataset: the sampler's epoch length. The sampler's position is `step`
    /// global batches, or `samples_seen` where a run resumed under another global batch.
    pub samples: u64,
    /// The sampler's stream position after `step` steps (samples seen); absent in older
    /// checkpoints, where it is `step` times the global batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_seen: Option<u64>,
    pub loss_scale: Option<LossScaleState>,
    /// Shard file of each rank, in rank order.
    pub shards: Vec<String>,
    /// Shard file → tensor → CRC-32C of its bytes (`verify`); empty in format 1.
    #[serde(default)]
    pub checksums: std::collections::BTreeMap<String, verify::TensorChecksums>,
    /// What each shard's tensors hold of the model (`layout`), for resuming under another
    /// plan; absent in checkpoints of older builds, which resume only under their own plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<Layout>,
    /// The training data the run read (`dataset`); absent in checkpoints of older builds, whose
    /// data is compared by `samples` alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<crate::data::DataRecord>,
}

/// A stable hash of a lowered plan: FNV-1a 64 over its JSON form, as 16 hex digits.
pub fn plan_hash(plan: &Plan) -> String {
    let json = serde_json::to_vec(plan).unwrap_or_default();
    format!("{:016x}", crate::fnv::fnv1a(&json))
}

/// The folder name of the checkpoint after `step` steps.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The checkpoints of `paths` that still exist (a run's `keep` may have pruned some), for the
/// run's summary.
pub fn still_there(mut paths: Vec<PathBuf>) -> Vec<PathBuf> {
    paths.retain(|p| p.join("manifest.json").is_file());
    paths
}

/// The shard file name of `rank`.
pub fn shard_file_name(rank: u32) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// The sampler's stream position after the checkpoint's steps: what it recorded, else its
/// steps times its global batch (`global_batch` when it records no layout).
pub fn samples_seen(manifest: &Manifest, global_batch: u64) -> u64 {
    manifest.samples_seen.unwrap_or_else(|| {
        let batch = manifest
            .layout
            .as_ref()
            .map_or(global_batch, |l| l.global_batch);
        manifest.step * batch
    })
}

/// How a run continues from a compatible checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResumeKind {
    /// Written by this plan: each rank loads its own shard.
    SamePlan,
    /// Written by another plan of the same model, optimizer, precision and global batch: each
    /// rank reads its slices of the old shards (`reshard`).
    Reshard,
}

/// What a resume consents to change beyond the plan: another global batch
/// (`--resume-any-batch`), other training data (`--resume-any-data`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Consent {
    pub any_batch: bool,
    pub any_data: bool,
}

/// Whether a run of the plan with hash `plan_hash` and shard layout `layout` may continue from
/// the checkpoint of `manifest`, and how: refused for another seed or model, for another plan
/// unless the checkpoint records its layout and the change keeps model, optimizer, precision
/// and global batch ([`plan_change`]), and for other training data ([`data_change`]), unless
/// `consent` allows another global batch or other data.
pub fn check_compatible(
    manifest: &Manifest,
    plan_hash: &str,
    layout: &Layout,
    seed: u64,
    data: DataSeen<'_>,
    consent: Consent,
) -> crate::error::Result<ResumeKind> {
    let refused = |refusal: layout::Refusal| {
        crate::error::RuntimeError::Checkpoint(format!(
            "this checkpoint cannot continue under this run's spec: {refusal}"
        ))
    };
    let kind =
        plan_change(manifest, plan_hash, layout, seed, consent.any_batch).map_err(refused)?;
    match data_change(manifest, data) {
        Some(refusal) if !consent.any_data => Err(refused(refusal)),
        _ => Ok(kind),
    }
}

/// How the checkpoint of `manifest` continues under the plan of hash `plan_hash`, layout
/// `layout` and seed `seed` (the dataset aside), or the refusal naming what changed;
/// `any_batch` allows another global batch.
pub fn plan_change(
    manifest: &Manifest,
    plan_hash: &str,
    layout: &Layout,
    seed: u64,
    any_batch: bool,
) -> std::result::Result<ResumeKind, layout::Refusal> {
    if manifest.seed != seed {
        return Err(layout::Refusal {
            code: "E1105",
            field: "train.seed",
            message: format!(
                "this checkpoint was written with train.seed = {}, this run has {seed}",
                manifest.seed
            ),
            help: format!(
                "set train.seed = {} to continue the same run",
                manifest.seed
            ),
        });
    }
    if manifest.plan_hash == plan_hash && manifest.world == layout.world() {
        return Ok(ResumeKind::SamePlan);
    }
    let Some(old) = &manifest.layout else {
        return Err(layout::Refusal {
            code: "E1106",
            field: "parallel",
            message: format!(
                "this checkpoint was written by plan {} on {} ranks, but this run's plan is {} \
                 on {} ranks, and it does not record its shards' layout (an older parc wrote \
                 it), so it cannot be re-sharded",
                manifest.plan_hash,
                manifest.world,
                plan_hash,
                layout.world()
            ),
            help: "resume with the same .par file and --set overrides".to_string(),
        });
    };
    match old.refuse_change(layout, any_batch) {
        Some(refusal) => Err(refusal),
        None => Ok(ResumeKind::Reshard),
    }
}

#[cfg(test)]
mod tests {
    use super::layout::GlobalParam;
    use super::*;

    fn layout(world: usize, shape: Vec<u64>) -> Layout {
        Layout {
            params: vec![GlobalParam {
                name: "w".to_string(),
                shape,
            }],
            optimizer: "adamw".to_string(),
            precision: "fp32".to_string(),
            global_batch: 8,
            ranks: vec![Vec::new(); world],
        }
    }

    #[test]
    fn another_seed_data_or_model_is_refused_and_another_plan_is_resharded() {
        let mut manifest = Manifest {
            format: FORMAT,
            plan_hash: "aaaa".to_string(),
            world: 4,
            step: 10,
            optimizer_step: 10,
            seed: 1,
            samples: 50,
            loss_scale: None,
            shards: Vec::new(),
            checksums: Default::default(),
            layout: None,
            samples_seen: None,
            data: None,
        };
        let four = layout(4, vec![4, 2]);
        let seen = |samples| DataSeen {
            record: None,
            samples: Some(samples),
        };
        let check = |m: &Manifest, hash: &str, l: &Layout, seed, samples| {
            check_compatible(m, hash, l, seed, seen(samples), Consent::default())
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            check(&manifest, "aaaa", &four, 1, 50),
            Ok(ResumeKind::SamePlan)
        );
        let plan = check(&manifest, "bbbb", &four, 1, 50).unwrap_err();
        assert!(
            plan.contains("plan aaaa on 4 ranks") && plan.contains("bbbb"),
            "{plan}"
        );
        assert!(check(&manifest, "aaaa", &layout(2, vec![4, 2]), 1, 50).is_err());
        let seed = check(&manifest, "aaaa", &four, 2, 50).unwrap_err();
        assert!(seed.contains("train.seed = 1"), "{seed}");
        let data = check(&manifest, "aaaa", &four, 1, 51).unwrap_err();
        assert!(
            data.contains("E1107") && data.contains("gives 51"),
            "{data}"
        );
        let any_data = Consent {
            any_data: true,
            ..Consent::default()
        };
        let consented = check_compatible(&manifest, "aaaa", &four, 1, seen(51), any_data);
        assert_eq!(consented.ok(), Some(ResumeKind::SamePlan));
        manifest.layout = Some(four.clone());
        let two = layout(2, vec![4, 2]);
        assert_eq!(
            check(&manifest, "bbbb", &two, 1, 50),
            Ok(ResumeKind::Reshard)
        );
        let model = check(&manifest, "bbbb", &layout(2, vec![2, 4]), 1, 50).unwrap_err();
        assert!(
            model.contains("E1101") && model.contains("parameter w is [4, 2]"),
            "{model}"
        );
        let sgd = Layout {
            optimizer: "sgd".to_string(),
            ..two.clone()
        };
        let optimizer = check(&manifest, "bbbb", &sgd, 1, 50).unwrap_err();
        assert!(optimizer.contains("train.optimizer"), "{optimizer}");
        let batch = Layout {
            global_batch: 16,
            ..two
        };
        let refused = check(&manifest, "bbbb", &batch, 1, 50).unwrap_err();
        assert!(
            refused.contains("E1104") && refused.contains("train.global_batch = 8"),
            "{refused}"
        );
        let any_batch = Consent {
            any_batch: true,
            ..Consent::default()
        };
        let consented = check_compatible(&manifest, "bbbb", &batch, 1, seen(50), any_batch);
        assert_eq!(consented.ok(), Some(ResumeKind::Reshard));
        assert_eq!(samples_seen(&manifest, 16), 80);
    }
}
