//! The executor: trains a lowered [`Plan`] on this machine with one thread per rank, each
//! running its own program on its own backend, connected by the local comm.
//!
//! [`train`] opens the data once, spawns the ranks, and reports one [`StepRecord`] per step
//! (from the plan's report rank, as the step finishes) and the final parameters gathered to
//! global tensors. Checkpoints are written every `train.checkpoint.every` steps (each rank's
//! writer thread writes its shard in the background, rank 0 publishes the manifest once all
//! are written: `save`); `resume` continues from one. A run that checkpoints also exports its final parameters as global tensors
//! (`DIR/model.safetensors`); `save_init` writes the parameters before the first step the
//! same way, and `log_batches` the token offsets of every step's batch. A fresh run with
//! `train.init = hf(…)` starts from those weights (checked before any rank starts); a resumed
//! one continues its checkpoint. With `train.eval`,
//! every rank runs its evaluation program after every `every`-th step and the last
//! ([`RankExecutor::evaluate`]), and the step's record carries the validation loss. Plans are
//! verified (`parc_compiler::driver::analyze`, the evaluation programs too) before any rank
//! starts: the runtime runs only verified programs. `train.sample` prints a sample every
//! `every` steps (`generate::training`).
//! All parallelism lives in the programs: this module only dispatches.
pub mod gather;
pub mod loss_scale;
pub mod nonfinite;
pub mod process;
pub mod profile;
pub mod rank;
mod save;

pub use gather::GlobalParam;
pub use loss_scale::{LossScaleStep, LossScaler};
pub use process::{train_rank, ProcessRankResult};
pub use profile::StepProfile;
pub use rank::{ParamPiece, ParamStart, RankExecutor};

use crate::backend::Backend;
use crate::checkpoint::{self, Manifest, ShardTensor, SpecSource};
use crate::comm::{Comm, LocalComm};
use crate::data::{write_run_batch_log, BatchLayout, Dataset, EpochProgress, RunData};
use crate::error::{Result, RuntimeError};
use crate::exec::nonfinite::{NonFiniteGuard, Verdict};
pub use crate::exec::save::SaveStall;
use crate::generate::{SampleSink, TrainingSampler};
use crate::hf::HfInit;
use parc_compiler::diag::Diagnostics;
use parc_compiler::driver::{self, Stage};
use parc_compiler::ir::Plan;
use parc_compiler::spec::{Axis, DataSource, InitFrom, Spec};
use parc_compiler::verify::VerifyReport;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How to run: where the spec lives, resuming, and limits.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// The `.par` file's folder: data and checkpoint paths are relative to it.
    pub spec_dir: PathBuf,
    /// A checkpoint folder (or a `checkpoint.dir` holding several) to continue from.
    pub resume: Option<PathBuf>,
    /// Stop after this many steps in total (the spec's `train.steps` when None); a run stopped
    /// early continues with `resume` exactly as if it had not stopped.
    pub stop_after: Option<u64>,
    /// How long a rank waits for a peer before failing.
    pub comm_timeout: Duration,
    /// Kernel threads per rank (default: the machine's cores shared among the ranks).
    pub threads_per_rank: Option<usize>,
    /// Refuse to start when all ranks' verified peak memory together exceeds this many bytes
    /// (the CLI sets it to the host's available memory for the CPU backend, whose ranks all
    /// live in this process).
    pub memory_limit: Option<u64>,
    /// Time every instruction of one step on the report rank ([`TrainResult::profile`]).
    pub profile: bool,
    /// The 0-based step to profile (default: the run's third step, or its last if fewer);
    /// clamped into the steps this run takes.
    pub profile_step: Option<u64>,
    /// Write the parameters as global tensors to this safetensors file before the first step
    /// this run takes (the initialisation, or the resumed checkpoint's), named as in
    /// `DIR/model.safetensors`.
    pub save_init: Option<PathBuf>,
    /// Write the token offsets of every step's global batch to this file before training
    /// (format: [`crate::data::batch_log`]).
    pub log_batches: Option<PathBuf>,
    /// The spec as the user wrote it, recorded in the model files this run writes
    /// (`checkpoint::saved`), so they can be sampled and exported alone.
    pub source: Option<SpecSource>,
    /// Where the samples of `train.sample` go (rank 0 makes them); without it none are made.
    pub on_sample: Option<SampleSink>,
    /// Resume a checkpoint of another global batch (`--resume-any-batch`): the sampler
    /// continues at the samples it had seen.
    pub resume_any_batch: bool,
    /// Resume a checkpoint trained on other data (`--resume-any-data`): the sampler continues
    /// on this run's data at the samples the checkpoint had seen.
    pub resume_any_data: bool,
}

impl TrainOptions {
    pub fn new(spec_dir: impl Into<PathBuf>) -> TrainOptions {
        TrainOptions {
            spec_dir: spec_dir.into(),
            resume: None,
            stop_after: None,
            comm_timeout: Duration::from_secs(120),
            threads_per_rank: None,
            memory_limit: None,
            profile: false,
            profile_step: None,
            save_init: None,
            log_batches: None,
            source: None,
            on_sample: None,
            resume_any_batch: false,
            resume_any_data: false,
        }
    }
}

/// Which of a step's two reports a [`StepRecord`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordStage {
    /// Before the step's checkpoint save starts (`save` not known yet): what a metrics file
    /// records, so that no checkpoint a resume can start after lacks its step's row.
    BeforeSave,
    /// The step's whole record, its save included: what progress lines and the run's records
    /// hold.
    Complete,
}

/// What one training step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepRecord {
    /// Which of the step's two reports this is (`on_step` sees both, in this order).
    pub stage: RecordStage,
    /// 0-based step index.
    pub step: u64,
    /// Mean token cross-entropy over the global batch.
    pub loss: f32,
    pub lr: f64,
    /// Global gradient norm before clipping (of the unscaled gradients in an fp16 run; not
    /// finite when the step overflowed).
    pub grad_norm: f32,
    /// Tokens in the global batch.
    pub tokens: u64,
    pub tokens_per_s: f64,
    /// Seconds since the run (or the resumed run) started, at the end of this step.
    pub elapsed_s: f64,
    /// fp16 runs: the loss scale used, the next one, and whether the step was skipped.
    pub loss_scale: Option<LossScaleStep>,
    /// The step's gradients were not finite and `train.on_nonfinite = skip { … }` skipped
    /// its update.
    pub skipped_nonfinite: bool,
    /// Bytes the report rank's backend holds at the end of this step
    /// (`Backend::reserved_bytes`), where the backend reports them.
    pub memory_bytes: Option<u64>,
    /// Validation loss, on steps where `train.eval` ran.
    pub val_loss: Option<f32>,
    /// A checkpoint was being written in the background while this step ran.
    pub saving: bool,
    /// A checkpoint save started after this step: what it cost the step loop (waiting for the
    /// previous save, the snapshot copy; a synchronous save's whole write).
    pub save: Option<save::SaveStall>,
}

/// The outcome of [`train`].
#[derive(Clone, Debug)]
pub struct TrainResult {
    /// One record per step run (resumed runs start at the checkpoint's step).
    pub records: Vec<StepRecord>,
    pub params: Vec<GlobalParam>,
    /// Samples seen per epoch after the last step.
    pub epochs: Vec<EpochProgress>,
    /// Checkpoints written, oldest first.
    pub checkpoints: Vec<PathBuf>,
    /// `DIR/model.safetensors`: the final parameters as global tensors, when the spec
    /// checkpoints.
    pub model_export: Option<PathBuf>,
    /// The step this run started at (non-zero when resumed).
    pub start_step: u64,
    /// Where the profiled step's time went on the report rank, with `TrainOptions::profile`.
    pub profile: Option<StepProfile>,
    /// The most memory one rank's backend held at the end (`Backend::reserved_bytes`), when
    /// the backend reports it.
    pub reserved_bytes: Option<u64>,
}

/// Samples in a synthetic dataset: fixed (not derived from `train.steps`), so a run extended
/// with a larger `train.steps` can resume from its checkpoints.
pub const SYNTHETIC_SAMPLES: u64 = 1 << 16;

/// Open the spec's data source relative to `spec_dir`.
pub fn open_dataset(spec: &Spec, spec_dir: &Path) -> Result<Dataset> {
    let source = &spec.train.data;
    open_source(spec, source, "train.data", spec_dir, spec.train.seed)
}

/// Open `source`, the value of setting `setting` (`train.data`, `train.eval.data`), for `spec`'s
/// model relative to `spec_dir`; synthetic tokens come from `seed`. A data error starts with
/// the setting, so a missing evaluation file is not taken for the training data.
fn open_source(
    spec: &Spec,
    source: &DataSource,
    setting: &str,
    spec_dir: &Path,
    seed: u64,
) -> Result<Dataset> {
    let (vocab, seq) = (spec.model.vocab, spec.model.seq);
    Dataset::open(source, spec_dir, vocab, seq, seed, SYNTHETIC_SAMPLES).map_err(|e| match e {
        RuntimeError::Data(what) => RuntimeError::Data(format!("`{setting}`: {what}")),
        other => other,
    })
}

/// Mixed into the seed of synthetic evaluation data, so that its tokens are not training's.
const EVAL_STREAM: u64 = 0xe7a1_0000_0000_0000;

/// The run's data: the training dataset, the samples training draws from, and with
/// `train.eval` the evaluation set: `train.eval.data` (any source `train.data` accepts), else
/// synthetic tokens of a seed of their own when training is synthetic, else the training data's
/// held-out tail (`data::eval`).
pub fn open_run_data(spec: &Spec, spec_dir: &Path) -> Result<RunData> {
    let train = Arc::new(open_dataset(spec, spec_dir)?);
    let layout = BatchLayout {
        dp: spec.parallel.mesh.size(Axis::Dp),
        microbatches: spec.parallel.microbatches,
        micro_batch: spec.train.micro_batch,
    };
    let Some(eval) = &spec.train.eval else {
        return RunData::whole(train, layout);
    };
    let source = match (&eval.data, &spec.train.data) {
        (Some(source), _) => source,
        (None, DataSource::Synthetic) => &DataSource::Synthetic,
        (None, _) => return RunData::held_out(train, eval.batches, layout),
    };
    let seed = spec.train.seed ^ EVAL_STREAM;
    let eval_data = Arc::new(open_source(
        spec,
        source,
        "train.eval.data",
        spec_dir,
        seed,
    )?);
    RunData::separate(train, eval_data, eval.batches, layout)
}

/// Whether a run of `spec` evaluates once `done` steps are done: after every
/// `train.eval.every`-th step and after the last (`train.steps`).
fn evaluates_after(spec: &Spec, done: u64) -> bool {
    spec.train
        .eval
        .as_ref()
        .is_some_and(|e| done.is_multiple_of(e.every) || done == spec.train.steps)
}

/// Where a run continues from: the newest checkpoint under `options.resume` that verifies
/// (`checkpoint::verify`) and its manifest (both `None` for a fresh run), refused unless written
/// with this seed and training data (or the user consents to other data), by this plan or one
/// it can be re-sharded from (`checkpoint::check_compatible`); and `plan`'s hash, which the
/// run's own checkpoints record.
fn resume_point(
    plan: &Plan,
    spec: &Spec,
    options: &TrainOptions,
    data: &RunData,
) -> Result<(Option<PathBuf>, Option<Manifest>, String)> {
    let (resume, manifest) = match options.resume.as_deref() {
        Some(path) => checkpoint::choose_resume(path).map(|(p, m)| (Some(p), Some(m)))?,
        None => (None, None),
    };
    let hash = checkpoint::plan_hash(plan);
    if let Some(m) = &manifest {
        let layout = checkpoint::Layout::of(spec, plan)?;
        let seen = checkpoint::DataSeen {
            record: data.train.record(),
            samples: Some(data.train_samples),
        };
        let consent = checkpoint::Consent {
            any_batch: options.resume_any_batch,
            any_data: options.resume_any_data,
        };
        checkpoint::check_compatible(m, &hash, &layout, spec.train.seed, seen, consent)?;
        if let Some(change) = checkpoint::data_change(m, seen) {
            eprintln!(
                "note: --resume-any-data: {}; step {} continues at sample {} of this data's \
                 order ({} samples an epoch)",
                change.message,
                m.step,
                checkpoint::samples_seen(m, layout.global_batch),
                data.train_samples
            );
        }
        let old_batch = m
            .layout
            .as_ref()
            .map_or(layout.global_batch, |l| l.global_batch);
        if old_batch != layout.global_batch {
            eprintln!(
                "note: the checkpoint's global batch is {old_batch} sequences, this run's {}; \
                 the sampler position is translated by samples seen: step {} continues at \
                 sample {} of the data order",
                layout.global_batch,
                m.step,
                checkpoint::samples_seen(m, layout.global_batch)
            );
        }
    }
    Ok((resume, manifest, hash))
}

/// The lock on the spec's checkpoint folder, for a run that writes checkpoints (held until
/// the run ends; see `checkpoint::lock`). Holding it, the run removes the staging folders of
/// saves that never finished (`checkpoint::remove_unfinished`).
fn lock_checkpoints(spec: &Spec, options: &TrainOptions) -> Result<Option<checkpoint::FolderLock>> {
    spec.train
        .checkpoint
        .as_ref()
        .map(|ckpt| {
            let dir = options.spec_dir.join(&ckpt.dir);
            let lock = checkpoint::FolderLock::acquire(&dir)?;
            checkpoint::remove_unfinished(&dir)?;
            Ok(lock)
        })
        .transpose()
}

/// The Hugging Face checkpoint a fresh run starts from (`train.init = hf(…)`, relative to the
/// spec's folder), checked against the spec before any rank starts; None for a seeded run and
/// for a resumed one, which continues its checkpoint instead.
fn initial_weights(
    spec: &Spec,
    plan: &Plan,
    options: &TrainOptions,
    resuming: bool,
) -> Result<Option<HfInit>> {
    match &spec.train.init {
        InitFrom::Hf { path, .. } if !resuming => {
            HfInit::open(&options.spec_dir.join(path), spec, &plan.params).map(Some)
        }
        _ => Ok(None),
    }
}

/// Refuse a plan whose ranks together need more than `limit` bytes at their verified peaks.
fn check_memory(plan: &Plan, report: &VerifyReport, limit: u64) -> Result<()> {
    let peaks: Vec<u64> = plan
        .rank_program
        .iter()
        .map(|id| report.program(*id).map_or(0, |p| p.peak_bytes))
        .collect();
    let total: u64 = peaks.iter().sum();
    if total <= limit {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    Err(RuntimeError::Unsupported(format!(
        "this plan needs {:.1} GiB of memory for its {} ranks at their peaks (up to {:.1} GiB per \
         rank), but only {:.1} GiB is available here; shrink the model or batch with --set, or \
         run it on GPUs",
        gib(total),
        plan.world,
        gib(peaks.iter().copied().max().unwrap_or(0)),
        gib(limit)
    )))
}

/// Verify `plan` through the compile driver's stages after lowering (the runtime runs only
/// verified plans).
fn verified(plan: &Plan, spec: &Spec) -> Result<VerifyReport> {
    if plan.representative {
        return Err(RuntimeError::Unsupported(
            "this plan has one program per class of tp/cp ranks (lowered for analysis, as \
             `parc check` does): its ranks would hold the wrong shards; lower it with \
             `LowerOptions::representatives` off to run it"
                .to_string(),
        ));
    }
    let mut diags = Diagnostics::default();
    let analysis = driver::analyze(spec, plan, Stage::Verify, &mut diags);
    analysis.verified.ok_or_else(|| {
        let problems: Vec<String> = diags
            .items
            .iter()
            .map(|d| format!("{} {}", d.code, d.message))
            .collect();
        RuntimeError::Op {
            op: "plan verification".to_string(),
            what: format!(
                "the lowered plan is unsafe to run (a lowering bug): {}",
                problems.join("; ")
            ),
        }
    })
}

/// What a rank thread hands back.
struct RankOutcome {
    records: Vec<StepRecord>,
    pieces: Vec<ParamPiece>,
    epochs: Vec<EpochProgress>,
    checkpoints: Vec<PathBuf>,
    start_step: u64,
    profile: Option<StepProfile>,
    reserved_bytes: Option<u64>,
}

/// Train `plan` (lowered from `spec`) with one thread per rank. `new_backend` makes each
/// rank's backend (called on that rank's thread with the rank and its kernel thread count);
/// `on_step` sees each step's record as soon as the step ends, twice: before the step's
/// checkpoint save (`RecordStage::BeforeSave`) and after it (`Complete`).
pub fn train<B, F>(
    spec: &Spec,
    plan: &Plan,
    options: &TrainOptions,
    new_backend: F,
    on_step: &(dyn Fn(&StepRecord) + Sync),
) -> Result<TrainResult>
where
    B: Backend,
    F: Fn(u32, usize) -> Result<B> + Sync,
{
    let report = verified(plan, spec)?;
    if let Some(limit) = options.memory_limit {
        check_memory(plan, &report, limit)?;
    }
    let _lock = lock_checkpoints(spec, options)?;
    let data = open_run_data(spec, &options.spec_dir)?;
    let (resume, manifest, hash) = resume_point(plan, spec, options, &data)?;
    let weights = initial_weights(spec, plan, options, resume.is_some())?;
    if let Some(path) = &options.log_batches {
        let (start, position) = manifest.as_ref().map_or((0, 0), |m| {
            (m.step, checkpoint::samples_seen(m, spec.train.global_batch))
        });
        let end = options
            .stop_after
            .unwrap_or(spec.train.steps)
            .min(spec.train.steps);
        write_run_batch_log(path, spec, plan, data.train_samples, start..end, position)?;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = options
        .threads_per_rank
        .unwrap_or_else(|| (cores / plan.world.max(1) as usize).max(1));
    let comms = LocalComm::world(plan.world, options.comm_timeout);
    let sampler = training_sampler(spec, options)?;
    let run = RunContext {
        spec,
        plan,
        options,
        data: &data,
        resume: resume.as_deref().zip(manifest.as_ref()),
        plan_hash: &hash,
        on_step,
        weights: weights.as_ref(),
        init_export: options.save_init.clone().map(|path| InitExport {
            path,
            source: options.source.clone(),
            pending: Mutex::new((Vec::new(), 0)),
        }),
        sampler: sampler.as_ref(),
    };
    let outcomes: Vec<Result<RankOutcome>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (run, new_backend) = (&run, &new_backend);
                std::thread::Builder::new()
                    .name(format!("parc-rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let rank = rank as u32;
                        let mut comm: Box<dyn Comm> = Box::new(comm);
                        match new_backend(rank, threads) {
                            Ok(backend) => run.rank_main(rank, backend, comm),
                            Err(e) => {
                                comm.abort(&e.to_string());
                                Err(e)
                            }
                        }
                    })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| match handle {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(RuntimeError::Comm("a rank thread panicked".to_string()))
                }),
                Err(e) => Err(RuntimeError::Io {
                    context: "starting a rank thread".to_string(),
                    source: e,
                }),
            })
            .collect()
    });
    let mut results = Vec::with_capacity(outcomes.len());
    let mut errors = Vec::new();
    for outcome in outcomes {
        match outcome {
            Ok(o) => results.push(o),
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        // The root cause is the error that is not another rank's abort notice.
        let root = nonfinite::origin(&errors)
            .or_else(|| {
                errors
                    .iter()
                    .position(|e| !e.to_string().contains("stopped because rank"))
            })
            .unwrap_or(0);
        return Err(errors.swap_remove(root));
    }
    let report = results
        .get(plan.report_rank as usize)
        .ok_or_else(|| RuntimeError::Unsupported("the plan's report rank does not exist".into()))?;
    let (records, epochs, start_step, profile) = (
        report.records.clone(),
        report.epochs.clone(),
        report.start_step,
        report.profile.clone(),
    );
    let checkpoints = checkpoint::still_there(
        results
            .first()
            .map(|r| r.checkpoints.clone())
            .unwrap_or_default(),
    );
    let reserved_bytes = results.iter().filter_map(|r| r.reserved_bytes).max();
    let pieces: Vec<ParamPiece> = results.into_iter().flat_map(|r| r.pieces).collect();
    let params = gather::assemble(&plan.params, &pieces)?;
    let mut model_export = None;
    if let Some(ckpt) = &spec.train.checkpoint {
        let end = records.last().map_or(start_step, |r| r.step + 1);
        let tensors = global_tensors(params.clone());
        let dir = options.spec_dir.join(&ckpt.dir);
        model_export = Some(checkpoint::write_model(
            &dir,
            end,
            &tensors,
            options.source.as_ref(),
        )?);
    }
    Ok(TrainResult {
        records,
        params,
        epochs,
        checkpoints,
        model_export,
        start_step,
        profile,
        reserved_bytes,
    })
}

/// The run's `train.sample`, when it has one and a sink for its samples.
fn training_sampler(spec: &Spec, options: &TrainOptions) -> Result<Option<TrainingSampler>> {
    match options.on_sample {
        Some(_) => TrainingSampler::new(spec, &options.spec_dir),
        None => Ok(None),
    }
}

/// Global parameters as named tensors for a safetensors file.
pub fn global_tensors(params: Vec<GlobalParam>) -> Vec<ShardTensor> {
    params
        .into_iter()
        .map(|p| ShardTensor {
            name: p.name,
            shape: p.shape,
            data: p.data,
        })
        .collect()
}

/// Everything the rank threads share.
struct RunContext<'a> {
    spec: &'a Spec,
    plan: &'a Plan,
    options: &'a TrainOptions,
    data: &'a RunData,
    resume: Option<(&'a Path, &'a Manifest)>,
    plan_hash: &'a str,
    on_step: &'a (dyn Fn(&StepRecord) + Sync),
    /// The Hugging Face weights the parameters start from (else the seed's).
    weights: Option<&'a HfInit>,
    init_export: Option<InitExport>,
    /// `train.sample`, made on rank 0 with the parameters of all ranks.
    sampler: Option<&'a TrainingSampler>,
}

/// `TrainOptions::save_init`: collects every rank's parameter pieces before its first step;
/// the last rank to hand in its pieces writes the file while the others train on.
struct InitExport {
    path: PathBuf,
    source: Option<SpecSource>,
    /// Pieces handed in so far and how many ranks handed them in.
    pending: Mutex<(Vec<ParamPiece>, u32)>,
}

impl InitExport {
    fn hand_in(&self, plan: &Plan, pieces: Vec<ParamPiece>, step: u64) -> Result<()> {
        let complete = {
            let mut pending = self.pending.lock().map_err(|_| {
                RuntimeError::Comm("a rank failed while handing in its initial parameters".into())
            })?;
            pending.0.extend(pieces);
            pending.1 += 1;
            if pending.1 < plan.world {
                return Ok(());
            }
            std::mem::take(&mut pending.0)
        };
        let tensors = global_tensors(gather::assemble(&plan.params, &complete)?);
        checkpoint::write_params(&self.path, step, &tensors, self.source.as_ref())
    }
}

impl RunContext<'_> {
    fn rank_main<B: Backend>(
        &self,
        rank: u32,
        backend: B,
        comm: Box<dyn Comm + '_>,
    ) -> Result<RankOutcome> {
        let seed = self.spec.train.seed;
        let mut exec = RankExecutor::new(self.plan, rank, backend, comm, self.data.clone(), seed)?;
        let result = self.rank_loop(&mut exec);
        if let Err(e) = &result {
            exec.abort(&format!("rank {rank}: {e}"));
        }
        result
    }

    fn rank_loop<B: Backend>(&self, exec: &mut RankExecutor<'_, B>) -> Result<RankOutcome> {
        let train = &self.spec.train;
        exec.init_from(match self.weights {
            Some(weights) => ParamStart::Hf(weights),
            None => ParamStart::Seeded(train.seed),
        })?;
        exec.loss_scaler = LossScaler::for_precision(train.precision);
        let mut start_step = 0;
        if let Some((dir, manifest)) = self.resume {
            if manifest.plan_hash == self.plan_hash {
                exec.load_shard(dir)?;
            } else {
                let layout = checkpoint::Layout::of(self.spec, self.plan)?;
                let rank = exec.rank();
                exec.load_tensors(checkpoint::reshard::load_rank(
                    dir, manifest, &layout, rank,
                )?)?;
            }
            let position = checkpoint::samples_seen(manifest, train.global_batch);
            exec.resume_sampler_at(manifest.step, position);
            exec.optimizer_step = manifest.optimizer_step;
            start_step = manifest.step;
            if let (Some(scaler), Some(state)) = (exec.loss_scaler.as_mut(), manifest.loss_scale) {
                scaler.restore(state)?;
            }
        }
        if let Some(export) = &self.init_export {
            export.hand_in(self.plan, exec.param_pieces()?, start_step)?;
        }
        let end = self
            .options
            .stop_after
            .unwrap_or(train.steps)
            .min(train.steps);
        let is_report = exec.rank() == self.plan.report_rank;
        let tokens = train.global_batch * self.spec.model.seq;
        let started = Instant::now();
        let mut records = Vec::new();
        let profile_at = self.options.profile.then(|| {
            let wanted = self
                .options
                .profile_step
                .unwrap_or(start_step.saturating_add(2));
            wanted.clamp(start_step, end.saturating_sub(1).max(start_step))
        });
        let mut profile = None;
        let mut guard = NonFiniteGuard::new(train.on_nonfinite);
        let mut saves = self.saves(exec, start_step..end)?;
        for step in start_step..end {
            let saving = saves.as_ref().is_some_and(save::Saves::in_flight);
            let step_started = Instant::now();
            let lr = train.schedule.lr_at(train.optimizer.lr(), step);
            let metrics = if is_report && profile_at == Some(step) {
                let mut timed = StepProfile::new(step, exec.rank());
                let metrics = exec.step(step, lr, Some(&mut timed))?;
                timed.finish(step_started.elapsed().as_secs_f64());
                profile = Some(timed);
                metrics
            } else {
                exec.step(step, lr, None)?
            };
            let seconds = step_started.elapsed().as_secs_f64();
            let verdict = guard.judge(&metrics);
            if let Verdict::Stop { rerun } = verdict {
                let found = if rerun {
                    let found = exec.first_nonfinite(step, lr)?;
                    // No rank stops (and aborts the others) before all have re-run the step:
                    // each error names what its own rank found. A failed barrier changes
                    // nothing in what this rank reports.
                    let world: Vec<u32> = (0..self.plan.world).collect();
                    let _ = exec.comm().barrier(&world);
                    found
                } else {
                    None
                };
                return Err(guard.error(step, exec.rank(), &metrics, found));
            }
            let val_loss = if evaluates_after(self.spec, step + 1) {
                exec.evaluate()?
            } else {
                None
            };
            let mut record = StepRecord {
                stage: RecordStage::BeforeSave,
                step,
                loss: metrics.loss.unwrap_or(f32::NAN),
                lr,
                grad_norm: metrics.grad_sumsq.map_or(f32::NAN, f32::sqrt),
                tokens,
                tokens_per_s: tokens as f64 / seconds.max(1e-9),
                elapsed_s: started.elapsed().as_secs_f64(),
                loss_scale: metrics.loss_scale,
                skipped_nonfinite: verdict == Verdict::Skipped && metrics.loss_scale.is_none(),
                memory_bytes: exec.reserved_bytes(),
                val_loss,
                saving,
                save: None,
            };
            // The metrics row before the save: a kill between a synchronous save's commit and
            // the row would leave a checkpoint whose step has no row, and a resume after it.
            if is_report {
                (self.on_step)(&record);
            }
            record.save = match saves.as_mut() {
                Some(saves) => self.save(exec, saves, step + 1)?,
                None => None,
            };
            if is_report {
                record.stage = RecordStage::Complete;
                (self.on_step)(&record);
                records.push(record);
            }
            if let Some(sampler) = self.sampler.filter(|s| s.due(step + 1)) {
                self.sample(exec, sampler, step + 1)?;
            }
        }
        let checkpoints = match saves {
            Some(saves) => saves.finish(exec)?,
            None => Vec::new(),
        };
        Ok(RankOutcome {
            records,
            pieces: exec.param_pieces()?,
            epochs: exec.sampler().progress(end),
            checkpoints,
            start_step,
            profile,
            reserved_bytes: exec.reserved_bytes(),
        })
    }

    /// Gather the parameters to rank 0, which samples from them and reports the text.
    fn sample<B: Backend>(
        &self,
        exec: &mut RankExecutor<'_, B>,
        sampler: &TrainingSampler,
        done: u64,
    ) -> Result<()> {
        let pieces = exec.param_pieces()?;
        let Some(params) = gather::collect_on_root(self.plan, exec.comm(), pieces)? else {
            return Ok(());
        };
        let text = sampler.text(self.spec, &global_tensors(params))?;
        if let Some(sink) = &self.options.on_sample {
            sink.report(done, &text);
        }
        Ok(())
    }

    /// This rank's checkpoint saves, when the spec checkpoints (their snapshot memory taken
    /// before the first step when a save falls into `steps`).
    fn saves<B: Backend>(
        &self,
        exec: &mut RankExecutor<'_, B>,
        mut steps: std::ops::Range<u64>,
    ) -> Result<Option<save::Saves>> {
        let Some(ckpt) = &self.spec.train.checkpoint else {
            return Ok(None);
        };
        let dir = self.options.spec_dir.join(&ckpt.dir);
        let mut saves = save::Saves::new(ckpt, dir, exec.rank(), self.plan.world)?;
        if steps.any(|step| saves.due(step + 1)) {
            saves.reserve(exec)?;
        }
        Ok(Some(saves))
    }

    /// After `step` steps: learn how the save in flight is doing and, when a checkpoint is
    /// due, start it (rank 0 gives the manifest it commits). Returns what a started save cost.
    fn save<B: Backend>(
        &self,
        exec: &mut RankExecutor<'_, B>,
        saves: &mut save::Saves,
        step: u64,
    ) -> Result<Option<SaveStall>> {
        saves.settle(exec, false)?;
        if !saves.due(step) {
            return Ok(None);
        }
        let layout = match exec.rank() {
            0 => Some(checkpoint::Layout::of(self.spec, self.plan)?),
            _ => None,
        };
        let manifest = layout.map(|layout| Manifest {
            format: checkpoint::FORMAT,
            plan_hash: self.plan_hash.to_string(),
            world: self.plan.world,
            step,
            optimizer_step: exec.optimizer_step,
            seed: self.spec.train.seed,
            samples: exec.sampler().samples(),
            loss_scale: exec.loss_scaler.as_ref().map(LossScaler::state),
            shards: (0..self.plan.world)
                .map(checkpoint::shard_file_name)
                .collect(),
            checksums: Default::default(),
            layout: Some(layout),
            samples_seen: Some(exec.sampler().position(step)),
            data: self.data.train.record().cloned(),
        });
        saves.start(exec, step, manifest).map(Some)
    }
}
