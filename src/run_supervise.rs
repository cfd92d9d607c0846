//! `parc run FILE --nproc-per-node N`: start the N rank processes of this binary on this host
//! and supervise them. The spec is compiled first (its warnings shown here, once: the ranks show
//! only errors) and a mesh that is not N ranks is refused before anything starts. CPU runs
//! start through `mpiexec -n N` (the MPI comm needs an MPI launcher), CUDA runs directly with
//! torchrun-style variables. Each rank's stderr is printed with a `[rank R]` prefix (stdout,
//! where only the report rank writes JSON, passes unprefixed); the first rank that fails ends
//! the whole job (the others are told through the rendezvous, then killed), its error and exit
//! status are the launcher's, and Ctrl-C is forwarded to the ranks.
use crate::run_args::{resolve_backend, Resolved, RunArgs};
use crate::run_launch::{timeout, NO_MPI};
use crate::run_prepare::{compile, print_error, WARNINGS_SHOWN_VAR};
use crate::run_progress::LogFormat;
use parc_runtime::{checkpoint, launch};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Start `n` rank processes on this host and supervise them; the exit code.
pub fn launch(args: &RunArgs, n: u32) -> u8 {
    match launch_inner(args, n) {
        Ok(code) => code,
        Err((code, message)) => {
            // An empty message: the error was already shown (the spec's diagnostics).
            if !message.is_empty() {
                print_error(&message);
            }
            code
        }
    }
}

fn launch_inner(args: &RunArgs, n: u32) -> Result<u8, (u8, String)> {
    let quiet = args.log_format == LogFormat::Json;
    let backend = resolve_backend(args.backend, true).map_err(|m| (2, m))?;
    let (_, plan) =
        compile(&args.file, &args.spec, &args.calibration).map_err(|code| (code, String::new()))?;
    launch::check_world(&plan.mesh, n, &format!("--nproc-per-node {n}"))
        .map_err(|e| (1, e.to_string()))?;
    timeout(args.rendezvous_timeout, "--rendezvous-timeout").map_err(|m| (2, m))?;
    timeout(args.comm_timeout, "--comm-timeout").map_err(|m| (2, m))?;
    let exe = std::env::current_exe().map_err(|e| {
        (
            1,
            format!("cannot find this parc binary to start the ranks: {e}"),
        )
    })?;
    let child_args = rank_args();
    let port =
        launch::free_port().map_err(|e| (1, format!("no free port for the rendezvous: {e}")))?;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_interrupt as *const () as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGTERM,
            on_interrupt as *const () as libc::sighandler_t,
        );
    }
    let errors: Arc<Mutex<HashMap<u32, String>>> = Arc::default();
    let outcome = match backend {
        Resolved::Cpu => {
            if !cfg!(feature = "mpi") {
                return Err((1, NO_MPI.to_string()));
            }
            let mpiexec = find_on_path(&["mpiexec", "mpirun"]).ok_or_else(|| {
                (
                    1,
                    "a multi-process CPU run is started by mpiexec, which is not on PATH; \
                     install Open MPI (`apt-get install openmpi-bin libopenmpi-dev`) and use a \
                     parc built with `--features mpi`, or run without --nproc-per-node"
                        .to_string(),
                )
            })?;
            if !quiet {
                eprintln!(
                    "launch: {n} CPU rank processes through {} (MPI comm), rendezvous on \
                     127.0.0.1:{port}",
                    mpiexec.display()
                );
            }
            let mut command = Command::new(&mpiexec);
            command
                .args(["-n", &n.to_string(), "--oversubscribe", "--bind-to", "none"])
                .arg("--tag-output")
                .args(["-x", "MASTER_ADDR=127.0.0.1"])
                .args(["-x", &format!("MASTER_PORT={port}")])
                .args(["-x", &format!("{WARNINGS_SHOWN_VAR}=1")]);
            let faults = ["PARC_TEST_FAULT", checkpoint::fault::WRITE_FAULT_VAR];
            for key in faults.into_iter().filter(|k| std::env::var_os(k).is_some()) {
                command.args(["-x", key]);
            }
            allow_root(&mut command);
            command.arg(&exe).args(&child_args);
            let child = spawn(command)
                .map_err(|e| (1, format!("cannot start {}: {e}", mpiexec.display())))?;
            supervise(vec![(None, child)], &errors)
        }
        #[cfg(feature = "cuda")]
        Resolved::Cuda => {
            if !quiet {
                eprintln!("launch: {n} CUDA rank processes (GPU = local rank), rendezvous on 127.0.0.1:{port}");
            }
            let mut children = Vec::new();
            for rank in 0..n {
                let mut command = Command::new(&exe);
                command
                    .args(&child_args)
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", n.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("LOCAL_WORLD_SIZE", n.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env(WARNINGS_SHOWN_VAR, "1");
                match spawn(command) {
                    Ok(child) => children.push((Some(rank), child)),
                    Err(e) => {
                        for (_, mut c) in children {
                            let _ = c.kill();
                        }
                        return Err((1, format!("cannot start rank {rank}: {e}")));
                    }
                }
            }
            supervise(children, &errors)
        }
    };
    Ok(report(outcome, &errors))
}

/// Open MPI's mpiexec refuses to start under root (as containers usually run) unless told
/// twice that it is meant; MPICH's and other launchers ignore these `OMPI_` variables. A value
/// the user set stays.
fn allow_root(command: &mut Command) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    for key in ["OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] {
        if std::env::var_os(key).is_none() {
            command.env(key, "1");
        }
    }
}

/// This command line without `--nproc-per-node` (the ranks run the same command).
fn rank_args() -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    let mut skip = false;
    for arg in std::env::args_os().skip(1) {
        if skip {
            skip = false;
            continue;
        }
        let text = arg.to_string_lossy();
        if text == "--nproc-per-node" {
            skip = true;
            continue;
        }
        if text.starts_with("--nproc-per-node=") {
            continue;
        }
        out.push(arg);
    }
    out
}

fn find_on_path(names: &[&str]) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    names.iter().find_map(|name| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

fn spawn(mut command: Command) -> std::io::Result<Child> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
}

/// How the job ended: the first child that failed (its rank when known) and its status.
struct Outcome {
    failed: Option<(Option<u32>, ExitStatus)>,
    interrupted: bool,
}

/// Relay the children's output and wait for them; on the first failure give the others a
/// moment to stop on their own (the rendezvous tells them), then kill them.
fn supervise(
    children: Vec<(Option<u32>, Child)>,
    errors: &Arc<Mutex<HashMap<u32, String>>>,
) -> Outcome {
    let mut readers = Vec::new();
    let mut running: Vec<(Option<u32>, Child)> = Vec::new();
    for (rank, mut child) in children {
        if let Some(out) = child.stdout.take() {
            let errors = Arc::clone(errors);
            readers.push(std::thread::spawn(move || relay(out, rank, false, &errors)));
        }
        if let Some(err) = child.stderr.take() {
            let errors = Arc::clone(errors);
            readers.push(std::thread::spawn(move || relay(err, rank, true, &errors)));
        }
        running.push((rank, child));
    }
    let mut outcome = Outcome {
        failed: None,
        interrupted: false,
    };
    let mut stop_by: Option<Instant> = None;
    while !running.is_empty() {
        if INTERRUPTED.load(Ordering::SeqCst) && !outcome.interrupted {
            outcome.interrupted = true;
            for (_, child) in &running {
                // SAFETY: signalling our own child by its pid.
                unsafe {
                    libc::kill(child.id() as libc::pid_t, libc::SIGINT);
                }
            }
            stop_by = Some(Instant::now() + Duration::from_secs(5));
        }
        let mut still = Vec::new();
        for (rank, mut child) in running {
            match child.try_wait() {
                Ok(Some(status)) => {
                    if !status.success() && outcome.failed.is_none() {
                        outcome.failed = Some((rank, status));
                        stop_by.get_or_insert(Instant::now() + Duration::from_secs(3));
                    }
                }
                Ok(None) => still.push((rank, child)),
                Err(_) => {
                    let _ = child.kill();
                }
            }
        }
        running = still;
        if stop_by.is_some_and(|t| Instant::now() >= t) {
            for (_, child) in &mut running {
                let _ = child.kill();
            }
            for (_, child) in &mut running {
                let _ = child.wait();
            }
            running.clear();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for reader in readers {
        let _ = reader.join();
    }
    outcome
}

/// Copy one child stream line by line: stdout unprefixed, stderr as `[rank R] line`. Lines of
/// `mpiexec --tag-output` (`[job,R]<stderr>:text`) name their rank and are put back together
/// per rank (see [`Untangle`]); other mpiexec lines are prefixed `[mpiexec]`. Each rank's last
/// `error:` line is kept for the final report.
fn relay(
    stream: impl std::io::Read,
    rank: Option<u32>,
    is_stderr: bool,
    errors: &Mutex<HashMap<u32, String>>,
) {
    let mut untangle = Untangle::default();
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { break };
        let (rank, to_stderr, text) = match rank {
            Some(r) => (Some(r), is_stderr, line),
            None if tag_at(&line).is_some() => match untangle.line(&line) {
                Some((r, err, text)) => (Some(r), err, text),
                None => continue,
            },
            None => (None, true, line),
        };
        emit(rank, to_stderr, &text, errors);
    }
    for (r, err, text) in untangle.rest() {
        emit(Some(r), err, &text, errors);
    }
}

fn emit(rank: Option<u32>, to_stderr: bool, text: &str, errors: &Mutex<HashMap<u32, String>>) {
    if let (Some(r), Some(message)) = (rank, text.strip_prefix("error: ")) {
        if let Ok(mut errors) = errors.lock() {
            errors.insert(r, message.to_string());
        }
    }
    if to_stderr {
        let mut err = std::io::stderr().lock();
        let _ = match rank {
            Some(r) => writeln!(err, "[rank {r}] {text}"),
            None => writeln!(err, "[mpiexec] {text}"),
        };
    } else {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{text}");
        let _ = out.flush();
    }
}

/// Puts ranks' lines back together from `mpiexec --tag-output`. mpiexec tags every write it
/// reads, and a write that does not end a line leaves the line open, so two ranks printing at
/// once give `[1,1]<stderr>:error: [1,0]<stderr>:error: whole line of rank 0` and later
/// `[1,1]<stderr>:rest of rank 1's line`. Every piece but a line's last is the start of its
/// rank's next line and waits here; the last piece ends its rank's line.
#[derive(Default)]
struct Untangle {
    open: HashMap<(u32, bool), String>,
}

impl Untangle {
    /// The line that `line` ends, as (rank, is_stderr, text); `None` for a line that is not
    /// tagged.
    fn line(&mut self, line: &str) -> Option<(u32, bool, String)> {
        let mut pieces = tagged_pieces(line)?;
        let (rank, is_stderr, last) = pieces.pop()?;
        for (r, err, text) in pieces {
            self.open.entry((r, err)).or_default().push_str(&text);
        }
        let mut whole = self.open.remove(&(rank, is_stderr)).unwrap_or_default();
        whole.push_str(&last);
        Some((rank, is_stderr, whole))
    }

    /// Lines still open when the stream ended, by rank.
    fn rest(self) -> Vec<(u32, bool, String)> {
        let mut rest: Vec<_> = self
            .open
            .into_iter()
            .filter(|(_, text)| !text.is_empty())
            .map(|((r, err), text)| (r, err, text))
            .collect();
        rest.sort();
        rest
    }
}

/// `[1,2]<stderr>:a [1,0]<stdout>:b` → [(2, true, "a "), (0, false, "b")]; `None` unless the
/// line starts with a tag.
fn tagged_pieces(line: &str) -> Option<Vec<(u32, bool, String)>> {
    let (mut rank, mut is_stderr, len) = tag_at(line)?;
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut rest = line.get(len..).unwrap_or("");
    while let Some(at) = rest.find('[') {
        text.push_str(&rest[..at]);
        rest = &rest[at..];
        match tag_at(rest) {
            Some((r, err, len)) => {
                pieces.push((rank, is_stderr, std::mem::take(&mut text)));
                (rank, is_stderr) = (r, err);
                rest = rest.get(len..).unwrap_or("");
            }
            None => {
                text.push('[');
                rest = rest.get(1..).unwrap_or("");
            }
        }
    }
    text.push_str(rest);
    pieces.push((rank, is_stderr, text));
    Some(pieces)
}

/// The `[job,rank]<stdout>:` or `<stderr>:` tag at the start of `text`: (rank, is_stderr, its
/// length in bytes).
fn tag_at(text: &str) -> Option<(u32, bool, usize)> {
    let rest = text.strip_prefix('[')?;
    let (ids, after) = rest.split_once(']')?;
    let (job, rank) = ids.split_once(',')?;
    if job.is_empty() || !job.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let rank = rank.parse().ok()?;
    let (is_stderr, tag) = if after.starts_with("<stderr>:") {
        (true, "<stderr>:")
    } else if after.starts_with("<stdout>:") {
        (false, "<stdout>:")
    } else {
        return None;
    };
    Some((rank, is_stderr, 1 + ids.len() + 1 + tag.len()))
}

/// The rank a "stopped because rank R failed" message blames.
fn blamed_rank(message: &str) -> Option<u32> {
    let (_, rest) = message.split_once("because rank ")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The rank whose failure stopped the job, from each rank's last error and the first rank to
/// fail; in rank order, so the answer does not depend on which line came first: a rank the
/// others blame that has an error of its own; else the first to fail, if it has one; else any
/// rank with an error of its own (followers may blame each other in a circle when a failing rank
/// aborted the comm before printing its own cause); else a blamed rank; else the first to fail.
fn root_cause(errors: &HashMap<u32, String>, first: Option<u32>) -> Option<u32> {
    let mut ranks: Vec<u32> = errors.keys().copied().collect();
    ranks.sort_unstable();
    let blamed = || (ranks.iter()).filter_map(|r| errors.get(r).and_then(|m| blamed_rank(m)));
    let own_error = |r: &u32| errors.get(r).is_some_and(|m| blamed_rank(m).is_none());
    blamed()
        .find(own_error)
        .or(first.filter(own_error))
        .or_else(|| ranks.iter().copied().find(own_error))
        .or_else(|| blamed().next())
        .or(first)
}

/// Print how the job ended; the exit code.
fn report(outcome: Outcome, errors: &Mutex<HashMap<u32, String>>) -> u8 {
    let errors = errors.lock().map(|e| e.clone()).unwrap_or_default();
    if outcome.interrupted {
        eprintln!("error: interrupted; the ranks were stopped");
        return 130;
    }
    let Some((first, status)) = outcome.failed else {
        return 0;
    };
    let root = root_cause(&errors, first);
    let code = status
        .code()
        .map(|c| c.clamp(1, 255) as u8)
        .unwrap_or_else(|| {
            use std::os::unix::process::ExitStatusExt;
            128u8.saturating_add(status.signal().unwrap_or(0) as u8)
        });
    let how = match (status.code(), root == first) {
        (Some(c), true) => format!("exit status {c}"),
        (None, true) => {
            use std::os::unix::process::ExitStatusExt;
            format!("killed by signal {}", status.signal().unwrap_or(0))
        }
        _ => format!("the job's exit status {code}"),
    };
    match root {
        Some(r) => {
            let why = errors
                .get(&r)
                .filter(|m| blamed_rank(m).is_none())
                .cloned()
                .or_else(|| {
                    errors
                        .values()
                        .find(|m| blamed_rank(m) == Some(r))
                        .and_then(|m| m.split_once(&format!("because rank {r} failed: ")))
                        .map(|(_, why)| why.to_string())
                })
                .unwrap_or_else(|| "it printed no error".to_string());
            eprintln!("error: rank {r} failed ({how}), so the job was stopped: {why}");
        }
        None => eprintln!("error: the job failed ({how}); the ranks' errors are above"),
    }
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tagged_mpiexec_lines_name_their_rank() {
        let mut untangle = Untangle::default();
        let mut tagged = |line: &str, rank: u32, err: bool, text: &str| {
            assert_eq!(
                untangle.line(line),
                Some((rank, err, text.to_string())),
                "{line}"
            );
        };
        tagged("[1,2]<stderr>:error: boom", 2, true, "error: boom");
        tagged("[9,0]<stdout>:{\"event\":1}", 0, false, "{\"event\":1}");
        // A line printed in pieces is tagged once per piece.
        tagged(
            "[1,0]<stderr>:on [1,0]<stderr>:4 ranks [0, 1] [x",
            0,
            true,
            "on 4 ranks [0, 1] [x",
        );
        assert_eq!(untangle.line("mpiexec noticed that"), None);
        assert_eq!(untangle.line("[0, 1] x"), None);
        assert!(untangle.rest().is_empty());
    }

    #[test]
    fn two_ranks_printing_at_once_keep_their_own_lines() {
        // Rank 1 wrote "error: ", then rank 0 a whole line, then rank 1 the rest of its line.
        let mut untangle = Untangle::default();
        assert_eq!(
            untangle.line("[1,1]<stderr>:error: [1,0]<stderr>:error: a [0] b"),
            Some((0, true, "error: a [0] b".to_string()))
        );
        assert_eq!(
            untangle.line("[1,0]<stderr>:  at x.par:1:2"),
            Some((0, true, "  at x.par:1:2".to_string()))
        );
        assert_eq!(
            untangle.line("[1,1]<stderr>:communication: c"),
            Some((1, true, "error: communication: c".to_string()))
        );
        // A rank's stdout and stderr are separate lines.
        assert_eq!(
            untangle.line("[1,2]<stdout>:{\"a\":[1,2]}[1,2]<stderr>:warn"),
            Some((2, true, "warn".to_string()))
        );
        assert_eq!(
            untangle.rest(),
            vec![(2, false, "{\"a\":[1,2]}".to_string())]
        );
    }

    #[test]
    fn follower_errors_blame_the_failed_rank() {
        assert_eq!(
            blamed_rank("communication: rank 1 stopped in x because rank 2 failed: dead"),
            Some(2)
        );
        assert_eq!(blamed_rank("data: file missing"), None);
    }

    #[test]
    fn the_root_cause_is_an_error_of_its_own_even_when_followers_blame_in_a_circle() {
        let errors = |list: &[(u32, &str)]| -> HashMap<u32, String> {
            list.iter().map(|&(r, m)| (r, m.to_string())).collect()
        };
        // A full disk: rank 3 says so; rank 1 aborted the comm first and blames rank 0, which
        // (like rank 2) blames rank 1.
        let full = errors(&[
            (
                0,
                "checkpoint: not saved: stopped because rank 1 could not write its shard",
            ),
            (
                1,
                "communication: rank 1 stopped in all_reduce because rank 0 failed: …",
            ),
            (
                2,
                "checkpoint: not saved: stopped because rank 1 could not write its shard",
            ),
            (
                3,
                "checkpoint: writing rank-00003: no space left on the disk",
            ),
        ]);
        assert_eq!(root_cause(&full, Some(0)), Some(3));
        // A blamed rank with its own error wins over the first to exit.
        let own = errors(&[
            (0, "x because rank 2 failed: dead"),
            (2, "data: file missing"),
        ]);
        assert_eq!(root_cause(&own, Some(0)), Some(2));
        // A killed rank prints nothing: the one the others blame.
        let killed = errors(&[
            (0, "x because rank 2 failed: dead"),
            (1, "y because rank 2 failed"),
        ]);
        assert_eq!(root_cause(&killed, Some(0)), Some(2));
        assert_eq!(root_cause(&HashMap::new(), Some(1)), Some(1));
    }
}
