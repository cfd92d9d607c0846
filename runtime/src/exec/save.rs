//! One rank's checkpoint saves during training. A save copies the rank's persistent buffers
//! into host memory (the device-to-host copy: all the step loop waits for) and hands them to the
//! rank's writer thread (`checkpoint::writer`), which writes the shard while training goes on.
//! After each step while a save is in flight, the ranks tell each other in one small all-reduce
//! whether their shard is written; once all are, rank 0's writer commits the checkpoint
//! (manifest, rename), so a checkpoint is published only when every shard of its step is
//! complete. A shard or commit that fails ends the run with the checkpoint's folder and the
//! cause, on the next step or at the end. At most one save is in flight: a save that finds the
//! previous one unfinished waits for it (the step's record says how long). With
//! `train.checkpoint.async = false` each save is committed before the next step starts.
use super::rank::RankExecutor;
use crate::backend::Backend;
use crate::checkpoint::{self, writer::Report, Manifest, Writer};
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::ReduceOp;
use parc_compiler::spec::Checkpointing;
use std::path::PathBuf;
use std::time::Instant;

/// What starting a save cost the step loop, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SaveStall {
    /// Waiting for the previous save to finish.
    pub waited_s: f64,
    /// The whole save start: the wait, the snapshot copy and, for a synchronous save, the
    /// write and commit.
    pub total_s: f64,
}

/// A shard's state as the ranks exchange it.
const WRITING: f32 = 0.0;
const WRITTEN: f32 = 1.0;
const FAILED: f32 = -1.0;

/// The save whose shards are being written.
struct Writing {
    step: u64,
    /// Rank 0: what it commits once all shards are written.
    manifest: Option<Manifest>,
    /// This rank's shard, once its writer reported.
    shard: Option<Result<()>>,
}

/// One rank's saves: its writer and the save in flight.
pub(super) struct Saves {
    dir: PathBuf,
    every: u64,
    keep: u32,
    asynchronous: bool,
    rank: u32,
    world: Vec<u32>,
    writer: Writer,
    writing: Option<Writing>,
    /// Rank 0: the step whose commit the writer has.
    committing: Option<u64>,
    /// Rank 0: the checkpoints published, oldest first.
    committed: Vec<PathBuf>,
}

impl Saves {
    /// The saves of rank `rank` of `world` ranks into `dir`, as `ckpt` asks.
    pub(super) fn new(ckpt: &Checkpointing, dir: PathBuf, rank: u32, world: u32) -> Result<Saves> {
        Ok(Saves {
            dir,
            every: ckpt.every,
            keep: ckpt.keep,
            asynchronous: ckpt.asynchronous,
            rank,
            world: (0..world).collect(),
            writer: Writer::start(rank)?,
            writing: None,
            committing: None,
            committed: Vec::new(),
        })
    }

    /// Whether a checkpoint is due after `done` steps.
    pub(super) fn due(&self, done: u64) -> bool {
        self.every > 0 && done.is_multiple_of(self.every)
    }

    /// Whether a save is being written or committed.
    pub(super) fn in_flight(&self) -> bool {
        self.writing.is_some() || self.committing.is_some()
    }

    /// Allocate the snapshot memory before the first step, so no save pays for it.
    pub(super) fn reserve<B: Backend>(&mut self, exec: &mut RankExecutor<'_, B>) -> Result<()> {
        let host = exec.snapshot_memory()?;
        self.writer.keep_idle(checkpoint::Snapshot {
            tensors: Vec::new(),
            host,
            choices: None,
        });
        Ok(())
    }

    /// Start the save after `step` steps (`manifest` on rank 0): wait for the save in flight,
    /// copy the buffers to host memory and give them to the writer; a synchronous save also
    /// waits until it is committed.
    pub(super) fn start<B: Backend>(
        &mut self,
        exec: &mut RankExecutor<'_, B>,
        step: u64,
        manifest: Option<Manifest>,
    ) -> Result<SaveStall> {
        let started = Instant::now();
        self.settle(exec, true)?;
        let waited_s = started.elapsed().as_secs_f64();
        if self.rank == 0 {
            checkpoint::prepare(&self.dir, step)?;
        }
        exec.comm().barrier(&self.world)?;
        let host = match self.writer.take_idle() {
            Some(snapshot) => snapshot.host,
            None => exec.snapshot_memory()?,
        };
        let snapshot = exec.snapshot(host)?;
        self.writer
            .write_shard(&checkpoint::staging_dir(&self.dir, step), step, snapshot)?;
        self.writing = Some(Writing {
            step,
            manifest,
            shard: None,
        });
        if !self.asynchronous {
            self.settle(exec, true)?;
        }
        Ok(SaveStall {
            waited_s,
            total_s: started.elapsed().as_secs_f64(),
        })
    }

    /// After a step: take the writer's reports and, while shards are being written, agree with
    /// the other ranks whether all are (every rank calls this at the same steps). With `wait`,
    /// until nothing is in flight.
    pub(super) fn settle<B: Backend>(
        &mut self,
        exec: &mut RankExecutor<'_, B>,
        wait: bool,
    ) -> Result<()> {
        self.receive(wait)?;
        if self.writing.is_some() {
            self.agree(exec)?;
        }
        if wait {
            self.receive(true)?;
        }
        Ok(())
    }

    /// The checkpoints published, once every save has finished (rank 0's list; empty on the
    /// others).
    pub(super) fn finish<B: Backend>(
        mut self,
        exec: &mut RankExecutor<'_, B>,
    ) -> Result<Vec<PathBuf>> {
        self.settle(exec, true)?;
        Ok(std::mem::take(&mut self.committed))
    }

    /// Take the writer's reports: with `wait`, until this rank's shard is reported and its
    /// commit is done; without, those there are.
    fn receive(&mut self, wait: bool) -> Result<()> {
        loop {
            let shard_pending = self.writing.as_ref().is_some_and(|w| w.shard.is_none());
            if !shard_pending && self.committing.is_none() {
                return Ok(());
            }
            let Some(report) = self.writer.report(wait)? else {
                return Ok(());
            };
            match report {
                Report::Shard { step, result } => match self.writing.as_mut() {
                    Some(writing) if writing.step == step => writing.shard = Some(result),
                    _ => return Err(self.unexpected(step)),
                },
                Report::Commit { step, result } => {
                    self.committing = None;
                    let path = result.map_err(|e| self.not_saved(step, e))?;
                    self.committed.push(path);
                }
            }
        }
    }

    /// All ranks: exchange the shard states of the save being written; commit (rank 0) once
    /// all are written, fail when one failed.
    fn agree<B: Backend>(&mut self, exec: &mut RankExecutor<'_, B>) -> Result<()> {
        let Some(writing) = &self.writing else {
            return Ok(());
        };
        let mine = match &writing.shard {
            None => WRITING,
            Some(Ok(())) => WRITTEN,
            Some(Err(_)) => FAILED,
        };
        let mut states = vec![0.0f32; self.world.len()];
        states[self.rank as usize] = mine;
        exec.comm()
            .all_reduce(&self.world, ReduceOp::Sum, &mut states)?;
        let step = writing.step;
        if let Some(failed) = states.iter().position(|&s| s == FAILED) {
            let writing = self.writing.take();
            return Err(match writing.and_then(|w| w.shard) {
                Some(Err(e)) => self.not_saved(step, e),
                _ => RuntimeError::Checkpoint(format!(
                    "{} was not saved: stopped because rank {failed} could not write its shard",
                    self.step_path(step).display()
                )),
            });
        }
        if states.iter().all(|&s| s == WRITTEN) {
            if let Some(manifest) = self.writing.take().and_then(|w| w.manifest) {
                self.writer.commit(&self.dir, manifest, self.keep)?;
                self.committing = Some(step);
            }
        }
        Ok(())
    }

    fn step_path(&self, step: u64) -> PathBuf {
        self.dir.join(checkpoint::step_dir_name(step))
    }

    fn not_saved(&self, step: u64, cause: RuntimeError) -> RuntimeError {
        let cause = match cause {
            RuntimeError::Checkpoint(what) => what,
            other => other.to_string(),
        };
        RuntimeError::Checkpoint(format!(
            "{} was not saved (rank {}): {cause}; check that {} is writable and its disk has \
             room",
            self.step_path(step).display(),
            self.rank,
            self.dir.display()
        ))
    }

    fn unexpected(&self, step: u64) -> RuntimeError {
        RuntimeError::Checkpoint(format!(
            "rank {}'s checkpoint writer reported a shard of step {step}, which no save is \
             writing (a checkpoint bug)",
            self.rank
        ))
    }
}
