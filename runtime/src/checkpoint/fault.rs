//! Test-only fault injection into checkpoint writes, for the chaos tests (`tests/chaos.rs`):
//! `PARC_FAULT_WRITE_AFTER_BYTES=N` makes this process's checkpoint file writes fail as a full
//! disk does (ENOSPC) once N bytes have been written in all; `N:kill` kills the process there
//! instead (SIGKILL: a crash in the middle of a save, the file cut at N bytes). A suffix `@R`
//! arms it only in rank R's process (launcher variables `OMPI_COMM_WORLD_RANK` or `RANK`).
//! Unset, writes are plain `write_all`s.
use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The variable that arms the fault.
pub const WRITE_FAULT_VAR: &str = "PARC_FAULT_WRITE_AFTER_BYTES";

#[derive(Clone, Copy, Debug, PartialEq)]
struct WriteFault {
    after_bytes: u64,
    kill: bool,
}

/// Bytes this process wrote through [`write_all`] while a fault was armed.
static WRITTEN: AtomicU64 = AtomicU64::new(0);

fn launcher_rank() -> Option<u32> {
    ["OMPI_COMM_WORLD_RANK", "RANK"]
        .iter()
        .find_map(|key| std::env::var(key).ok()?.trim().parse().ok())
}

/// `N`, `N:kill`, optionally `@R`; None when it does not apply to this process.
fn parse(value: &str, rank: Option<u32>) -> Result<Option<WriteFault>, String> {
    let (fault, only) = match value.split_once('@') {
        Some((fault, r)) => (
            fault,
            Some(r.trim().parse::<u32>().map_err(|e| e.to_string())?),
        ),
        None => (value, None),
    };
    let (bytes, kind) = fault.split_once(':').unwrap_or((fault, "enospc"));
    let after_bytes = bytes
        .trim()
        .parse()
        .map_err(|e| format!("{bytes:?}: {e}"))?;
    let kill = match kind.trim() {
        "kill" => true,
        "enospc" => false,
        other => return Err(format!("unknown fault {other:?} (kill or enospc)")),
    };
    if only.is_some() && only != rank {
        return Ok(None);
    }
    Ok(Some(WriteFault { after_bytes, kill }))
}

fn armed() -> Option<WriteFault> {
    static FAULT: OnceLock<Option<WriteFault>> = OnceLock::new();
    *FAULT.get_or_init(|| {
        let value = std::env::var(WRITE_FAULT_VAR).ok()?;
        parse(&value, launcher_rank()).unwrap_or_else(|e| {
            eprintln!("warning: {WRITE_FAULT_VAR}={value} ignored: {e}");
            None
        })
    })
}

/// Whether a write fault is armed in this process (writers that stream through other APIs
/// then write through [`write_all`]).
pub(super) fn is_armed() -> bool {
    armed().is_some()
}

/// Write `bytes` to `file`, failing (or dying) where an armed fault says.
pub(super) fn write_all(file: &mut File, bytes: &[u8]) -> std::io::Result<()> {
    let Some(fault) = armed() else {
        return file.write_all(bytes);
    };
    let len = bytes.len() as u64;
    let before = WRITTEN.fetch_add(len, Ordering::SeqCst);
    let room = fault.after_bytes.saturating_sub(before);
    if room >= len {
        return file.write_all(bytes);
    }
    let cut = usize::try_from(room).unwrap_or(bytes.len());
    file.write_all(&bytes[..cut])?;
    if fault.kill {
        file.sync_all()?;
        eprintln!(
            "{WRITE_FAULT_VAR}: killed after {} bytes",
            fault.after_bytes
        );
        // SAFETY: sending a signal to this process.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
    Err(std::io::Error::from_raw_os_error(libc::ENOSPC))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_and_apply_to_their_rank() {
        let enospc = WriteFault {
            after_bytes: 100,
            kill: false,
        };
        assert_eq!(parse("100", None), Ok(Some(enospc)));
        assert_eq!(parse("100@2", Some(2)), Ok(Some(enospc)));
        assert_eq!(parse("100@2", Some(1)), Ok(None));
        let kill = parse("7:kill", Some(0)).unwrap().unwrap();
        assert!(kill.kill && kill.after_bytes == 7);
        assert!(parse("x", None).is_err() && parse("1:melt", None).is_err());
    }
}
