//! `parc reshard CKPT SPEC OUT [--set PATH=VALUE]...`: write checkpoint `CKPT` re-sharded for
//! the plan of `SPEC` as `OUT/step-N` (a checkpoint folder that `parc run SPEC --resume OUT`
//! loads without re-sharding, and verifies), offline: no backend, no comm. A change the
//! checkpoint cannot follow (another model, optimizer, precision, global batch, seed or
//! training data) is refused naming the field as `parc check --resume` refuses it
//! (`resume_check::judge`; E1101–E1107, docs/diagnostics.md), and the consents are the same:
//! `--resume-any-batch` (the new checkpoint's layout has the new global batch, its sampler
//! position the samples seen), `--resume-any-data` (the new checkpoint still records the data
//! its run trained on, so `parc run --resume` needs the flag too).
use crate::resume_check::{judge, render_moves};
use crate::run_args::ConsentArgs;
use crate::run_prepare::{compile, print_error};
use crate::SpecArgs;
use parc_compiler::ir::Plan;
use parc_compiler::spec::Spec;
use parc_runtime::checkpoint::{self, FolderLock, Layout, ResumeKind};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct ReshardArgs {
    /// The checkpoint: a `step-N` folder, or a checkpoint folder (its newest checkpoint that
    /// verifies).
    pub checkpoint: PathBuf,
    /// The .par file whose plan to re-shard it for.
    pub file: PathBuf,
    /// The checkpoint folder to write `step-N` into (give it to `parc run --resume`).
    pub out: PathBuf,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub consent: ConsentArgs,
}

pub fn main(args: ReshardArgs) -> u8 {
    // Parameter layouts do not depend on which GEMMs run in FP8: the default profile serves.
    let calibration = crate::calibration::CalibrationArgs::default();
    let (spec, plan) = match compile(&args.file, &args.spec, &calibration) {
        Ok(compiled) => compiled,
        Err(code) => return code,
    };
    match reshard(&args, &spec, &plan) {
        Ok(()) => 0,
        Err(message) => {
            print_error(&message);
            1
        }
    }
}

fn reshard(args: &ReshardArgs, spec: &Spec, plan: &Plan) -> Result<(), String> {
    let (source, manifest) =
        checkpoint::choose_resume(&args.checkpoint).map_err(|e| e.to_string())?;
    let layout = Layout::of(spec, plan).map_err(|e| e.to_string())?;
    let hash = checkpoint::plan_hash(plan);
    let spec_dir = crate::run_args::spec_folder(&args.file);
    let judged = judge(
        &manifest,
        spec,
        plan,
        &layout,
        &spec_dir,
        args.consent.consent(),
    )
    .map_err(|refusal| format!("{}: {refusal}", source.display()))?;
    let target = args.out.join(checkpoint::step_dir_name(manifest.step));
    if target.exists() {
        return Err(format!(
            "{} exists; give another OUT folder (parc reshard never replaces a checkpoint)",
            target.display()
        ));
    }
    let _lock = FolderLock::acquire(&args.out).map_err(|e| e.to_string())?;
    let (written, reads) =
        checkpoint::reshard::write_checkpoint(&source, &manifest, &layout, &hash, &args.out)
            .map_err(|e| e.to_string())?;
    if judged.kind == ResumeKind::SamePlan {
        eprintln!(
            "note: {} was already written by this plan; {} is a copy",
            source.display(),
            written.display()
        );
    }
    println!(
        "{} ({} ranks) → {} ({} ranks, plan {hash}), step {}:",
        source.display(),
        manifest.world,
        written.display(),
        plan.world,
        manifest.step
    );
    print!("{}", render_moves(&reads));
    if let Some(change) = &judged.data_change {
        eprintln!(
            "note: --resume-any-data: {change}; {} still records the data its run trained on, so \
             `parc run --resume` of it needs --resume-any-data as well",
            written.display()
        );
    } else if !judged.data_compared {
        eprintln!(
            "note: the spec's training data is not here, so it was not compared with the \
             checkpoint's; `parc run --resume` compares it"
        );
    }
    Ok(())
}
