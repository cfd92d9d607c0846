//! One rank per process: [`train_rank`] runs only this process's rank of a verified plan with
//! a comm the caller built (MPI on the CPU, NCCL on GPUs), where [`super::train`] runs every
//! rank as a thread of this process. The rank runs exactly the code a thread rank runs
//! (`RunContext::rank_main`): the same steps, checkpoints and abort on failure.
use super::{open_dataset, RunContext, StepProfile, StepRecord};
use crate::backend::Backend;
use crate::checkpoint;
use crate::comm::Comm;
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::Plan;
use parc_compiler::spec::Spec;
use std::path::PathBuf;
use std::sync::Arc;

/// What this process's rank of a multi-process run did.
#[derive(Clone, Debug)]
pub struct ProcessRankResult {
    pub rank: u32,
    /// One record per step when this is the plan's report rank, else empty.
    pub records: Vec<StepRecord>,
    /// Samples seen per epoch after the last step.
    pub epochs: Vec<crate::data::EpochProgress>,
    /// Checkpoints written (rank 0 publishes them; empty on other ranks).
    pub checkpoints: Vec<PathBuf>,
    pub start_step: u64,
    /// The profiled step, on the report rank with `TrainOptions::profile`.
    pub profile: Option<StepProfile>,
}

/// Train rank `comm.rank()` of `plan` in this process. `comm` connects it to the job's other
/// processes (its world must be the plan's); `on_step` sees the records when this rank is the
/// plan's report rank. The final parameters stay with their ranks (see [`ProcessRankResult`]).
pub fn train_rank<B: Backend>(
    spec: &Spec,
    plan: &Plan,
    options: &super::TrainOptions,
    backend: B,
    mut comm: Box<dyn Comm + '_>,
    on_step: &(dyn Fn(&StepRecord) + Sync),
) -> Result<ProcessRankResult> {
    let rank = comm.rank();
    if comm.world() != plan.world {
        let message = format!(
            "the spec's mesh has {} ranks but the comm connects {} processes",
            plan.world,
            comm.world()
        );
        comm.abort(&message);
        return Err(RuntimeError::Unsupported(message));
    }
    let prepared = (|| {
        super::verified(plan, spec)?;
        let dataset = Arc::new(open_dataset(spec, &options.spec_dir)?);
        let resume = options
            .resume
            .as_deref()
            .map(checkpoint::find_latest)
            .transpose()?;
        let manifest = resume
            .as_deref()
            .map(checkpoint::read_manifest)
            .transpose()?;
        let hash = checkpoint::plan_hash(plan);
        if let Some(m) = &manifest {
            checkpoint::check_compatible(
                m,
                &hash,
                plan.world,
                spec.train.seed,
                dataset.num_samples(),
            )?;
        }
        Ok((dataset, resume, manifest, hash))
    })();
    let (dataset, resume, manifest, hash) = match prepared {
        Ok(p) => p,
        Err(e) => {
            comm.abort(&format!("rank {rank}: {e}"));
            return Err(e);
        }
    };
    let run = RunContext {
        spec,
        plan,
        options,
        dataset: &dataset,
        resume: resume.as_deref().zip(manifest.as_ref()),
        plan_hash: &hash,
        on_step,
        init_export: None,
    };
    let outcome = run.rank_main(rank, backend, comm)?;
    Ok(ProcessRankResult {
        rank,
        records: outcome.records,
        epochs: outcome.epochs,
        checkpoints: outcome.checkpoints,
        start_step: outcome.start_step,
        profile: outcome.profile,
    })
}
