//! The background checkpoint writer of one rank: a thread that writes the rank's shard from a
//! [`Snapshot`] (host memory the step loop copied the rank's persistent buffers into) and, on
//! rank 0, commits checkpoints once every rank's shard is written (`store::commit`: manifest,
//! rename of the staging folder). Jobs run one after another in the order given; each reports
//! back ([`Report`]), and a shard job hands its snapshot memory back for the next save, so a
//! rank holds at most one snapshot. A save that never finishes (a full disk, a killed process)
//! leaves only its staging folder `.step-N.tmp`, which resuming never chooses and the next run
//! on the folder removes ([`remove_unfinished`]).
//!
//! Test hook: `PARC_TEST_CHECKPOINT_STALL=STEP:MS` makes each writer of the checkpoint after
//! STEP steps (`*`: every checkpoint) sleep MS milliseconds before writing its shard (its
//! staging folder exists by then) — time for a test to kill the run, or to put something in
//! the way of the shard, while a save is unfinished.
use super::store::{self, TensorSlice};
use super::Manifest;
use crate::backend::HostStaging;
use crate::error::{Result, RuntimeError};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The environment variable of the test hook (see the module docs).
pub const STALL_VAR: &str = "PARC_TEST_CHECKPOINT_STALL";

/// One tensor of a [`Snapshot`]: its name, shape and place in the snapshot's memory.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub range: Range<usize>,
}

/// A rank's persistent buffers copied to host memory at one step, with its backend's choices
/// (`Backend::choices`), which the shard carries.
pub struct Snapshot {
    pub tensors: Vec<SnapshotTensor>,
    pub host: Box<dyn HostStaging>,
    pub choices: Option<String>,
}

impl Snapshot {
    /// The tensors as slices of the snapshot's memory.
    fn slices(&self) -> Result<Vec<TensorSlice<'_>>> {
        let values = self.host.values()?;
        self.tensors
            .iter()
            .map(|t| {
                let data = values.get(t.range.clone()).ok_or_else(|| {
                    RuntimeError::Checkpoint(format!(
                        "tensor {} lies outside the snapshot's {} values (a checkpoint bug)",
                        t.name,
                        values.len()
                    ))
                })?;
                Ok(TensorSlice {
                    name: &t.name,
                    shape: &t.shape,
                    data,
                })
            })
            .collect()
    }
}

enum Job {
    Shard {
        staging: PathBuf,
        rank: u32,
        step: u64,
        snapshot: Snapshot,
    },
    Commit {
        dir: PathBuf,
        manifest: Box<Manifest>,
        keep: u32,
    },
}

/// What the writer did with a job, in the order the jobs were given.
#[derive(Debug)]
pub enum Report {
    /// The shard of the checkpoint after `step` steps is written (or why not).
    Shard { step: u64, result: Result<()> },
    /// The checkpoint after `step` steps is published at the path (or why not).
    Commit { step: u64, result: Result<PathBuf> },
}

/// A rank's writer thread and the snapshot memory it is not using.
pub struct Writer {
    rank: u32,
    jobs: Option<mpsc::Sender<Job>>,
    reports: mpsc::Receiver<(Report, Option<Snapshot>)>,
    thread: Option<JoinHandle<()>>,
    /// The snapshot memory, while no shard job holds it.
    idle: Option<Snapshot>,
}

impl Writer {
    /// Start rank `rank`'s writer thread.
    pub fn start(rank: u32) -> Result<Writer> {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (outbox, reports) = mpsc::channel();
        let stall = stall_hook();
        let thread = std::thread::Builder::new()
            .name(format!("parc-ckpt-{rank}"))
            .spawn(move || {
                for job in inbox {
                    if outbox.send(run(job, stall)).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| RuntimeError::Io {
                context: format!("starting rank {rank}'s checkpoint writer thread"),
                source: e,
            })?;
        Ok(Writer {
            rank,
            jobs: Some(jobs),
            reports,
            thread: Some(thread),
            idle: None,
        })
    }

    /// The snapshot memory of the last save, to fill again (None before the first, or while a
    /// shard job holds it).
    pub fn take_idle(&mut self) -> Option<Snapshot> {
        self.idle.take()
    }

    /// Keep `snapshot`'s memory for the next save.
    pub fn keep_idle(&mut self, snapshot: Snapshot) {
        self.idle = Some(snapshot);
    }

    /// Write `snapshot` as this rank's shard into the staging folder `staging` of the
    /// checkpoint after `step` steps.
    pub fn write_shard(&mut self, staging: &Path, step: u64, snapshot: Snapshot) -> Result<()> {
        self.send(Job::Shard {
            staging: staging.to_path_buf(),
            rank: self.rank,
            step,
            snapshot,
        })
    }

    /// Commit the checkpoint `manifest` describes into `dir` (after the jobs given before),
    /// keeping the newest `keep`.
    pub fn commit(&mut self, dir: &Path, manifest: Manifest, keep: u32) -> Result<()> {
        self.send(Job::Commit {
            dir: dir.to_path_buf(),
            manifest: Box::new(manifest),
            keep,
        })
    }

    fn send(&mut self, job: Job) -> Result<()> {
        match &self.jobs {
            Some(jobs) if jobs.send(job).is_ok() => Ok(()),
            _ => Err(self.gone()),
        }
    }

    fn gone(&self) -> RuntimeError {
        RuntimeError::Checkpoint(format!(
            "rank {}'s checkpoint writer thread stopped unexpectedly",
            self.rank
        ))
    }

    /// The next report: with `wait`, waiting for it; without, None when there is none yet.
    pub fn report(&mut self, wait: bool) -> Result<Option<Report>> {
        let received = if wait {
            self.reports.recv().map_err(|_| self.gone())?
        } else {
            match self.reports.try_recv() {
                Ok(received) => received,
                Err(mpsc::TryRecvError::Empty) => return Ok(None),
                Err(mpsc::TryRecvError::Disconnected) => return Err(self.gone()),
            }
        };
        let (report, snapshot) = received;
        if let Some(snapshot) = snapshot {
            self.idle = Some(snapshot);
        }
        Ok(Some(report))
    }
}

impl Drop for Writer {
    /// Let the jobs given finish (a run that failed leaves an unfinished save's staging
    /// folder, never a checkpoint), and drop the snapshot memory on this thread.
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        while let Ok((_, snapshot)) = self.reports.try_recv() {
            drop(snapshot);
        }
    }
}

/// Run one job on the writer thread.
fn run(job: Job, stall: Option<(Option<u64>, Duration)>) -> (Report, Option<Snapshot>) {
    match job {
        Job::Shard {
            staging,
            rank,
            step,
            snapshot,
        } => {
            if let Some((at, pause)) = stall {
                if at.is_none_or(|at| at == step) {
                    std::thread::sleep(pause);
                }
            }
            let choices = snapshot.choices.as_deref();
            let result = snapshot
                .slices()
                .and_then(|slices| store::write_shard_slices(&staging, rank, &slices, choices));
            (Report::Shard { step, result }, Some(snapshot))
        }
        Job::Commit {
            dir,
            manifest,
            keep,
        } => {
            let result = store::commit(&dir, &manifest, keep);
            let step = manifest.step;
            (Report::Commit { step, result }, None)
        }
    }
}

/// The test hook's step (None: every checkpoint) and pause, when it is set and well formed.
fn stall_hook() -> Option<(Option<u64>, Duration)> {
    let value = std::env::var(STALL_VAR).ok()?;
    let (step, ms) = value.split_once(':')?;
    let pause = Duration::from_millis(ms.parse().ok()?);
    match step {
        "*" => Some((None, pause)),
        step => Some((Some(step.parse().ok()?), pause)),
    }
}

/// Remove the staging folders (`.step-N.tmp`) of saves that never finished from the checkpoint
/// folder `dir`, saying so on stderr (the caller holds the folder's lock, so no run is writing
/// them).
pub fn remove_unfinished(dir: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let unfinished = name
            .strip_prefix(".step-")
            .and_then(|rest| rest.strip_suffix(".tmp"))
            .is_some_and(|step| step.parse::<u64>().is_ok());
        if !unfinished || !entry.path().is_dir() {
            continue;
        }
        std::fs::remove_dir_all(entry.path()).map_err(|source| RuntimeError::Io {
            context: format!(
                "removing {}, the staging folder of a save that did not finish",
                entry.path().display()
            ),
            source,
        })?;
        eprintln!(
            "note: removed {}: a checkpoint save that did not finish (the run that wrote it \
             ended during the save); resuming never uses it",
            entry.path().display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::store::tests::temp_dir;
    use super::*;

    fn snapshot() -> Snapshot {
        Snapshot {
            tensors: vec![SnapshotTensor {
                name: "w".to_string(),
                shape: vec![2],
                range: 1..3,
            }],
            host: Box::new(vec![0.0f32, 1.5, -2.0]),
            choices: Some("{\"gemms\": []}".to_string()),
        }
    }

    #[test]
    fn a_shard_is_written_from_its_snapshot_and_a_failure_names_the_file() {
        let dir = temp_dir("writer");
        let mut writer = Writer::start(0).unwrap();
        writer.write_shard(&dir, 3, snapshot()).unwrap();
        writer
            .write_shard(&dir.join("absent"), 4, snapshot())
            .unwrap();
        let Some(Report::Shard { step: 3, result }) = writer.report(true).unwrap() else {
            panic!("no report of the first shard");
        };
        result.unwrap();
        let back = store::read_shard(&dir, 0, &[("w".to_string(), vec![2])]).unwrap();
        assert_eq!(back.tensors, vec![vec![1.5, -2.0]]);
        // The backend's choices travel in the shard's header.
        assert_eq!(back.choices.as_deref(), Some("{\"gemms\": []}"));
        let Some(Report::Shard { step: 4, result }) = writer.report(true).unwrap() else {
            panic!("no report of the second shard");
        };
        let err = result.unwrap_err().to_string();
        assert!(err.contains("absent/rank-00000.safetensors.tmp"), "{err}");
        assert!(
            writer.take_idle().is_some(),
            "the snapshot memory came back"
        );
        assert!(writer.report(false).unwrap().is_none());
    }

    #[test]
    fn only_the_staging_folders_of_unfinished_saves_are_removed() {
        let dir = temp_dir("unfinished");
        for name in [".step-00000004.tmp", "step-00000002", ".step-x.tmp"] {
            std::fs::create_dir_all(dir.join(name)).unwrap();
        }
        std::fs::write(dir.join(".step-00000006.tmp"), b"a file").unwrap();
        remove_unfinished(&dir).unwrap();
        assert!(!dir.join(".step-00000004.tmp").exists());
        for kept in ["step-00000002", ".step-x.tmp", ".step-00000006.tmp"] {
            assert!(dir.join(kept).exists(), "{kept}");
        }
    }
}
