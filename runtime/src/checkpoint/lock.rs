//! The checkpoint folder's lock: a run that writes checkpoints holds `DIR/parc.lock` (its host
//! and pid, as JSON) from before its first step until it ends, so two runs never write one
//! folder. The file appears atomically with its content (written under a temporary name, then
//! hard-linked to `parc.lock`, which fails when the lock exists). A second run is refused naming
//! the holder; a lock left by a process of this host that no longer runs is taken over with a
//! note on stderr. One process holds it per run: the process of a local run (whose ranks are
//! threads), rank 0's in a run of one process per rank.
use crate::error::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The lock file's name inside the checkpoint folder.
pub const LOCK_FILE: &str = "parc.lock";

/// Who holds a lock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub host: String,
    pub pid: u32,
}

impl Holder {
    fn this_process() -> Self {
        Holder {
            host: host_name(),
            pid: std::process::id(),
        }
    }

    /// Whether the holder is known to have exited: a process of this host whose pid is gone,
    /// or has exited and waits to be reaped (a zombie: containers whose first process reaps
    /// nothing keep those). A holder on another host is assumed alive.
    fn is_dead(&self) -> bool {
        self.host == host_name() && cfg!(target_os = "linux") && !process_runs(self.pid)
    }
}

/// Whether process `pid` of this host runs: `/proc/PID/stat` exists and its state (the field
/// after the parenthesised command name) is not zombie (`Z`) or dead (`X`).
pub fn process_runs(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rfind(')')
        .and_then(|end| stat[end + 1..].split_whitespace().next());
    !matches!(state, Some("Z" | "X"))
}

/// This machine's host name (Linux: the kernel's; else `$HOSTNAME`).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_string())
}

/// A held lock on a checkpoint folder; dropping it releases the folder.
#[derive(Debug)]
pub struct FolderLock {
    path: PathBuf,
    holder: Holder,
}

fn lock_error(path: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Checkpoint(format!("{}: {what}", path.display()))
}

/// Create the checkpoint folder `dir` and its parents. A path that is (or lies under) an
/// existing file is said to be one, with what to do: `create_dir_all`'s own "File exists" /
/// "Not a directory" reads as if the folder could not be made for some other reason.
fn create_folder(dir: &Path) -> Result<()> {
    if let Some(file) = dir.ancestors().find(|a| a.is_file()) {
        let what = if file == dir {
            "is a file, not a folder".to_string()
        } else {
            format!("{} is a file, not a folder", file.display())
        };
        return Err(lock_error(
            dir,
            format!(
                "{what}: `checkpoint.dir` names the folder the run writes its checkpoints into; \
                 give it a path that is a folder or does not exist yet, or move the file away"
            ),
        ));
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| lock_error(dir, format!("cannot create the checkpoint folder ({e})")))
}

impl FolderLock {
    /// Lock the checkpoint folder `dir` (creating it) for this process.
    pub fn acquire(dir: &Path) -> Result<FolderLock> {
        create_folder(dir)?;
        let lock = FolderLock {
            path: dir.join(LOCK_FILE),
            holder: Holder::this_process(),
        };
        if lock.try_create()? {
            return Ok(lock);
        }
        let holder = lock.read_holder()?;
        if !holder.is_dead() {
            return Err(lock_error(
                dir,
                format!(
                    "another run is using this checkpoint folder (host {}, pid {}); wait for \
                     it to end or give this run another checkpoint.dir (if no such run \
                     exists, remove {})",
                    holder.host,
                    holder.pid,
                    lock.path.display()
                ),
            ));
        }
        lock.take_over(&holder)?;
        eprintln!(
            "note: {}: took over the lock of pid {} on {}, which no longer runs",
            dir.display(),
            holder.pid,
            holder.host
        );
        Ok(lock)
    }

    /// Create the lock file with this process's holder; false when it already exists.
    fn try_create(&self) -> Result<bool> {
        static ATTEMPT: AtomicU64 = AtomicU64::new(0);
        let attempt = ATTEMPT.fetch_add(1, Ordering::Relaxed);
        let temp = self
            .path
            .with_file_name(format!(".{LOCK_FILE}.{}.{attempt}", self.holder.pid));
        let json = serde_json::to_vec(&self.holder).map_err(|e| lock_error(&self.path, e))?;
        std::fs::write(&temp, json)
            .map_err(|e| lock_error(&temp, format!("cannot write the lock ({e})")))?;
        let linked = std::fs::hard_link(&temp, &self.path);
        let _ = std::fs::remove_file(&temp);
        match linked {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(lock_error(
                &self.path,
                format!("cannot create the lock ({e})"),
            )),
        }
    }

    fn read_holder(&self) -> Result<Holder> {
        let bytes = std::fs::read(&self.path)
            .map_err(|e| lock_error(&self.path, format!("cannot read the lock ({e})")))?;
        serde_json::from_slice(&bytes).map_err(|e| {
            lock_error(
                &self.path,
                format!("unreadable lock ({e}); if no run uses this checkpoint folder, remove it"),
            )
        })
    }

    /// Replace the lock of `dead` with this process's. The stale file is first renamed away and
    /// checked to be the one judged dead, so two runs taking it over at once cannot both win.
    fn take_over(&self, dead: &Holder) -> Result<()> {
        static ATTEMPT: AtomicU64 = AtomicU64::new(0);
        let attempt = ATTEMPT.fetch_add(1, Ordering::Relaxed);
        let aside = self
            .path
            .with_file_name(format!(".{LOCK_FILE}.stale.{}.{attempt}", self.holder.pid));
        std::fs::rename(&self.path, &aside).map_err(|e| {
            lock_error(&self.path, format!("cannot take over the stale lock ({e})"))
        })?;
        let moved: Option<Holder> = std::fs::read(&aside)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        if moved.as_ref() != Some(dead) {
            // Another run took it over first: put its lock back and refuse.
            let _ = std::fs::hard_link(&aside, &self.path);
            let _ = std::fs::remove_file(&aside);
            return Err(lock_error(
                &self.path,
                "another run took over this stale lock at the same time; try again",
            ));
        }
        let _ = std::fs::remove_file(&aside);
        if self.try_create()? {
            Ok(())
        } else {
            Err(lock_error(
                &self.path,
                "another run locked this checkpoint folder while the stale lock was removed",
            ))
        }
    }
}

impl Drop for FolderLock {
    fn drop(&mut self) {
        if self.read_holder().ok().as_ref() == Some(&self.holder) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("parc-lock-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn write_lock(dir: &Path, holder: &Holder) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(LOCK_FILE), serde_json::to_vec(holder).unwrap()).unwrap();
    }

    #[test]
    fn a_file_where_the_folder_belongs_is_named_a_file() {
        let dir = temp_dir("file");
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ckpt");
        std::fs::write(&file, b"not a folder").unwrap();
        for path in [file.clone(), file.join("inner")] {
            let err = FolderLock::acquire(&path).unwrap_err().to_string();
            assert!(err.contains("is a file, not a folder"), "{err}");
            assert!(err.contains("checkpoint.dir"), "{err}");
            assert!(!err.contains("File exists"), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_held_folder_is_refused_naming_host_and_pid_and_released_on_drop() {
        let dir = temp_dir("held");
        let lock = FolderLock::acquire(&dir).unwrap();
        let err = FolderLock::acquire(&dir).unwrap_err().to_string();
        let me = Holder::this_process();
        assert!(
            err.contains(&format!("host {}, pid {}", me.host, me.pid)),
            "{err}"
        );
        drop(lock);
        assert!(!dir.join(LOCK_FILE).exists());
        FolderLock::acquire(&dir).unwrap();
    }

    #[test]
    fn a_lock_of_a_dead_pid_on_this_host_is_taken_over_one_elsewhere_is_not() {
        let dir = temp_dir("stale");
        let dead = Holder {
            host: host_name(),
            pid: 999_999_999,
        };
        write_lock(&dir, &dead);
        let lock = FolderLock::acquire(&dir).unwrap();
        assert_eq!(lock.read_holder().unwrap(), Holder::this_process());
        drop(lock);
        let remote = Holder {
            host: "another-host".to_string(),
            pid: 999_999_999,
        };
        write_lock(&dir, &remote);
        let err = FolderLock::acquire(&dir).unwrap_err().to_string();
        assert!(err.contains("host another-host, pid 999999999"), "{err}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn an_exited_unreaped_process_does_not_run() {
        assert!(process_runs(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // Not waited for: once it exits it is a zombie until `wait` below.
        while process_runs(child.id()) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!process_runs(child.id()));
        child.wait().unwrap();
    }
}
