//! One rank per process: [`train_rank`] runs only this process's rank of a verified plan with
//! a comm the caller built (MPI on the CPU, NCCL on GPUs), where [`super::train`] runs every
//! rank as a thread of this process. The rank runs exactly the code a thread rank runs
//! (`RunContext::rank_main`): the same steps, checkpoints and abort on failure. A run that
//! checkpoints also exports its final parameters as global tensors, as a single-process run
//! does: every rank sends its pieces to rank 0 through the comm, which assembles and writes
//! them (`gather::collect_on_root`).
use super::{
    gather, global_tensors, open_run_data, ParamPiece, RunContext, StepProfile, StepRecord,
};
use crate::backend::Backend;
use crate::checkpoint;
use crate::comm::{Comm, PeerOp};
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::{Plan, ReduceOp};
use parc_compiler::spec::Spec;
use std::path::PathBuf;

/// What this process's rank of a multi-process run did.
#[derive(Clone, Debug)]
pub struct ProcessRankResult {
    pub rank: u32,
    /// One record per step when this is the plan's report rank, else empty.
    pub records: Vec<StepRecord>,
    /// Samples seen per epoch after the last step.
    pub epochs: Vec<crate::data::EpochProgress>,
    /// Checkpoints written, oldest first (rank 0 publishes them; every rank lists them).
    pub checkpoints: Vec<PathBuf>,
    pub start_step: u64,
    /// The profiled step, on the report rank with `TrainOptions::profile`.
    pub profile: Option<StepProfile>,
    /// `DIR/model.safetensors`, the final parameters as global tensors, when the spec
    /// checkpoints (rank 0 writes it; every rank returns its path once the run succeeded).
    pub model_export: Option<PathBuf>,
    /// The most memory any rank's backend held (`Backend::reserved_bytes`; the same on every
    /// rank), None when no rank's backend reports it.
    pub reserved_bytes: Option<u64>,
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
        // Both are the same for every plan of a spec: a single-process run writes them.
        for (flag, asked) in [
            ("--save-init", options.save_init.is_some()),
            ("--log-batches", options.log_batches.is_some()),
        ] {
            if asked {
                return Err(RuntimeError::Unsupported(format!(
                    "{flag} is not available in a run of one process per rank; the file does \
                     not depend on the plan, so write it with a single-process run of the same \
                     spec (`parc run FILE {flag} …` without a launcher)"
                )));
            }
        }
        super::verified(plan, spec)?;
        // Rank 0 writes the manifests, so its process holds the folder's lock.
        let lock = match rank {
            0 => super::lock_checkpoints(spec, options)?,
            _ => None,
        };
        let data = open_run_data(spec, &options.spec_dir)?;
        let (resume, manifest, hash) = super::resume_point(plan, spec, options, &data)?;
        let weights = super::initial_weights(spec, plan, options, resume.is_some())?;
        let sampler = super::training_sampler(spec, options)?;
        Ok((lock, data, resume, manifest, hash, weights, sampler))
    })();
    let (_lock, data, resume, manifest, hash, weights, sampler) = match prepared {
        Ok(p) => p,
        Err(e) => {
            comm.abort(&format!("rank {rank}: {e}"));
            return Err(e);
        }
    };
    let start = StartPoint::of(manifest.as_ref(), data.train.record());
    if let Err(e) = agree_on_start(comm.as_mut(), plan.world, &start) {
        comm.abort(&format!("rank {rank}: {e}"));
        return Err(e);
    }
    let run = RunContext {
        spec,
        plan,
        options,
        data: &data,
        resume: resume.as_deref().zip(manifest.as_ref()),
        plan_hash: &hash,
        on_step,
        weights: weights.as_ref(),
        init_export: None,
        sampler: sampler.as_ref(),
    };
    let outcome = run.rank_main(rank, backend, Box::new(Lent(comm.as_mut())))?;
    let end = options
        .stop_after
        .unwrap_or(spec.train.steps)
        .min(spec.train.steps)
        .max(outcome.start_step);
    let mut checkpoints = outcome.checkpoints;
    let model_export = match &spec.train.checkpoint {
        Some(ckpt) => {
            let dir = options.spec_dir.join(&ckpt.dir);
            if rank != 0 && ckpt.every > 0 {
                // Rank 0 published them; the others name them for their own summary.
                checkpoints = (outcome.start_step + 1..=end)
                    .filter(|done| done % ckpt.every == 0)
                    .map(|done| dir.join(checkpoint::step_dir_name(done)))
                    .collect();
            }
            let target = ModelTarget {
                dir: &dir,
                step: end,
                source: options.source.as_ref(),
            };
            match export_model(plan, comm.as_mut(), outcome.pieces, &target) {
                Ok(path) => Some(path),
                Err(e) => {
                    comm.abort(&format!("rank {rank}: {e}"));
                    return Err(e);
                }
            }
        }
        None => None,
    };
    let reserved_bytes = match most_reserved(comm.as_mut(), plan.world, outcome.reserved_bytes) {
        Ok(bytes) => bytes,
        Err(e) => {
            comm.abort(&format!("rank {rank}: {e}"));
            return Err(e);
        }
    };
    Ok(ProcessRankResult {
        rank,
        records: outcome.records,
        epochs: outcome.epochs,
        checkpoints: checkpoint::still_there(checkpoints),
        start_step: outcome.start_step,
        profile: outcome.profile,
        model_export,
        reserved_bytes,
    })
}

/// Where a rank starts: the checkpoint it resumes (its step and a fingerprint of its manifest)
/// and the training data it read (a fingerprint of its files' sizes and contents, not their
/// paths). Each rank chooses its checkpoint and reads its data itself, so ranks given another
/// `--resume`, or hosts whose folders hold other checkpoints or other data, would otherwise
/// train from different states with no error.
struct StartPoint {
    step: Option<u64>,
    checkpoint: u64,
    data: u64,
}

impl StartPoint {
    fn of(
        manifest: Option<&checkpoint::Manifest>,
        data: Option<&crate::data::record::DataRecord>,
    ) -> Self {
        let fingerprint = crate::fnv::fnv1a;
        let checkpoint = manifest
            .and_then(|m| serde_json::to_vec(m).ok())
            .map_or(0, |json| fingerprint(&json));
        let data = data.map_or(0, |record| {
            let mut text = record.reads.clone();
            for file in record.files.iter().chain(&record.tokenizer) {
                text.push_str(&format!(";{}:{:08x}", file.bytes, file.crc32c));
            }
            text.push_str(&format!(";{:?}", record.tokens));
            fingerprint(text.as_bytes())
        });
        StartPoint {
            step: manifest.map(|m| m.step),
            checkpoint,
            data,
        }
    }

    /// Exactly in f32 (the comm's type): 16 bits an element.
    fn encode(&self) -> [f32; 10] {
        let mut out = [0.0f32; 10];
        out[0] = if self.step.is_some() { 1.0 } else { 0.0 };
        for (i, word) in [self.step.unwrap_or(0), self.checkpoint, self.data]
            .into_iter()
            .enumerate()
        {
            for j in 0..3 {
                out[1 + 3 * i + j] = ((word >> (16 * j)) & 0xffff) as f32;
            }
        }
        out
    }

    fn decode(values: &[f32]) -> (Option<u64>, [u64; 2]) {
        let word = |i: usize| {
            (0..3).fold(0u64, |w, j| {
                let part = values.get(1 + 3 * i + j).copied().unwrap_or(0.0) as u64;
                w | (part << (16 * j))
            })
        };
        let step = (values.first().copied().unwrap_or(0.0) != 0.0).then(|| word(0));
        (step, [word(1), word(2)])
    }
}

/// Every rank must start from the same checkpoint and read the same data: compare each rank's
/// [`StartPoint`] with rank 0's; an error naming the first rank that differs and how.
fn agree_on_start(comm: &mut dyn Comm, world: u32, start: &StartPoint) -> Result<()> {
    let mine = start.encode();
    let group: Vec<u32> = (0..world).collect();
    let mut all = vec![0.0f32; mine.len() * world as usize];
    comm.all_gather(&group, &mine, &mut all)?;
    let ranks: Vec<(Option<u64>, [u64; 2])> = all
        .chunks_exact(mine.len())
        .map(StartPoint::decode)
        .collect();
    let Some(&(first_step, [first_checkpoint, first_data])) = ranks.first() else {
        return Ok(());
    };
    let from = |step: Option<u64>| match step {
        Some(step) => format!("resumes the checkpoint of step {step}"),
        None => "starts fresh (no --resume)".to_string(),
    };
    for (other, &(step, [checkpoint, data])) in ranks.iter().enumerate().skip(1) {
        if step != first_step || checkpoint != first_checkpoint {
            let how = if step == first_step {
                format!("{} of another run than rank 0's", from(step))
            } else {
                format!("{} but rank 0 {}", from(step), from(first_step))
            };
            return Err(RuntimeError::Checkpoint(format!(
                "rank {other} {how}: every rank must resume the same checkpoint; give every \
                 rank the same --resume, on a folder that all of them see (a shared file \
                 system)"
            )));
        }
        if data != first_data {
            return Err(RuntimeError::Unsupported(format!(
                "rank {other} read other training data than rank 0 (the files of train.data \
                 differ in size or content on its host): every rank must read the same data; \
                 give every host the same files"
            )));
        }
    }
    Ok(())
}

/// Largest byte count a backend reports exactly in two f32 halves of 24 bits each.
const RESERVED_LIMIT: u64 = 1 << 48;

/// The largest of every rank's `reserved` (None where a backend does not know), gathered over
/// the whole world: the comm moves f32, so each count travels as two exact 24-bit halves, and
/// an unknown one as -1.
fn most_reserved(comm: &mut dyn Comm, world: u32, reserved: Option<u64>) -> Result<Option<u64>> {
    const LOW_BITS: u32 = 24;
    let mine = match reserved {
        Some(bytes) if bytes < RESERVED_LIMIT => [
            (bytes >> LOW_BITS) as f32,
            (bytes & ((1 << LOW_BITS) - 1)) as f32,
        ],
        _ => [-1.0, -1.0],
    };
    let group: Vec<u32> = (0..world).collect();
    let mut all = vec![0.0f32; 2 * world as usize];
    comm.all_gather(&group, &mine, &mut all)?;
    Ok(all
        .chunks_exact(2)
        .filter(|halves| halves[0] >= 0.0)
        .map(|halves| ((halves[0] as u64) << LOW_BITS) | halves[1] as u64)
        .max())
}

/// Where [`export_model`] writes: `dir/model.safetensors`, after `step` steps, recording
/// `source`.
struct ModelTarget<'a> {
    dir: &'a std::path::Path,
    step: u64,
    source: Option<&'a checkpoint::SpecSource>,
}

/// Send every rank's parameter pieces to rank 0, which assembles the global tensors and writes
/// `target`'s model file ([`gather::collect_on_root`]). Returns the file's path on every rank
/// once rank 0 has written it.
fn export_model(
    plan: &Plan,
    comm: &mut dyn Comm,
    pieces: Vec<ParamPiece>,
    target: &ModelTarget<'_>,
) -> Result<PathBuf> {
    let ModelTarget { dir, step, source } = *target;
    let world: Vec<u32> = (0..plan.world).collect();
    if let Some(params) = gather::collect_on_root(plan, comm, pieces)? {
        let path = checkpoint::write_model(dir, step, &global_tensors(params), source)?;
        if path != checkpoint::model_path(dir) {
            return Err(RuntimeError::Checkpoint(format!(
                "the model export went to {}, not where the ranks expect it",
                path.display()
            )));
        }
    }
    // Every rank returns only once rank 0 has written the file.
    let mut written = [0.0f32];
    comm.all_reduce(&world, ReduceOp::Sum, &mut written)?;
    Ok(checkpoint::model_path(dir))
}

/// A comm lent to the executor (which takes its comm by box) and used again after it.
struct Lent<'c, 'a>(&'c mut (dyn Comm + 'a));

impl Comm for Lent<'_, '_> {
    fn rank(&self) -> u32 {
        self.0.rank()
    }
    fn world(&self) -> u32 {
        self.0.world()
    }
    fn all_reduce(&mut self, group: &[u32], op: ReduceOp, data: &mut [f32]) -> Result<()> {
        self.0.all_reduce(group, op, data)
    }
    fn all_gather(&mut self, group: &[u32], input: &[f32], output: &mut [f32]) -> Result<()> {
        self.0.all_gather(group, input, output)
    }
    fn reduce_scatter(&mut self, group: &[u32], input: &[f32], output: &mut [f32]) -> Result<()> {
        self.0.reduce_scatter(group, input, output)
    }
    fn broadcast(&mut self, group: &[u32], root: usize, data: &mut [f32]) -> Result<()> {
        self.0.broadcast(group, root, data)
    }
    fn send(&mut self, peer: u32, tag: u32, data: &[f32]) -> Result<()> {
        self.0.send(peer, tag, data)
    }
    fn recv(&mut self, peer: u32, tag: u32, out: &mut [f32]) -> Result<()> {
        self.0.recv(peer, tag, out)
    }
    fn group_p2p(&mut self, ops: &mut [PeerOp<'_>]) -> Result<()> {
        self.0.group_p2p(ops)
    }
    fn abort(&mut self, reason: &str) {
        self.0.abort(reason)
    }
    fn barrier(&mut self, group: &[u32]) -> Result<()> {
        self.0.barrier(group)
    }
}
