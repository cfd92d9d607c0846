//! Multi-process `parc run`: one rank per process.
//!
//! - Launcher (`--nproc-per-node N`, no launcher variables set): compiles the spec, refuses a
//!   mesh that is not N ranks, and starts the N rank processes of this binary on this host:
//!   CPU runs through `mpiexec -n N` (the MPI comm needs an MPI launcher), CUDA runs directly
//!   with torchrun-style variables. It prints each rank's stderr prefixed with `[rank R]`
//!   (stdout, where only the report rank writes JSON, passes unprefixed), ends the whole job
//!   when the first rank fails (the others are told through the rendezvous, then killed),
//!   reports that rank's error and exits with its status, and forwards Ctrl-C.
//! - Rank (launcher variables set: ours, torchrun, Open MPI, Slurm, PMI): compiles the spec,
//!   refuses a world size other than the mesh's, joins the rendezvous, builds this process's
//!   comm and trains its rank; only the plan's report rank prints progress and the summary.
//!
//! For testing the failure handling, `PARC_TEST_FAULT=abort:R@MS` makes rank R's process abort
//! MS milliseconds after the rendezvous (a crash), `stop:R@MS` stop (SIGSTOP: a hang).
use crate::cmd_run::{compile, resolve_backend, spec_folder, Resolved, RunArgs};
use crate::run_progress::{LogFormat, Progress, Summary};
use parc_compiler::ir::Plan;
use parc_compiler::spec::Spec;
use parc_runtime::launch::{self, LaunchEnv, Rendezvous, RendezvousConfig};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How this `parc run` process takes part in a run.
pub enum Mode {
    /// Every rank a thread of this process.
    Single,
    /// Start this many rank processes and supervise them.
    Launcher(u32),
    /// Run one rank of a launched job.
    Rank(LaunchEnv),
}

/// Decide the mode from the flags and the environment.
pub fn mode(args: &RunArgs) -> Result<Mode, String> {
    let env = launch::detect_process().map_err(|e| e.to_string())?;
    match (env, args.nproc_per_node) {
        (Some(env), _) if env.world > 1 => Ok(Mode::Rank(env)),
        (_, Some(0)) => Err("--nproc-per-node must be at least 1".to_string()),
        (_, Some(n)) if n > 1 => Ok(Mode::Launcher(n)),
        _ => Ok(Mode::Single),
    }
}

fn timeout(seconds: f64, flag: &str) -> Result<Duration, String> {
    if seconds.is_finite() && seconds > 0.0 {
        Ok(Duration::from_secs_f64(seconds))
    } else {
        Err(format!("{flag} must be a positive number of seconds"))
    }
}

// ------------------------------------------------------------------------------------------
// Rank
// ------------------------------------------------------------------------------------------

/// Run this process's rank of a launched job; the exit code.
pub fn run_rank(args: &RunArgs, env: LaunchEnv) -> u8 {
    let quiet = args.log_format == LogFormat::Json || env.rank != 0;
    let backend = match resolve_backend(args.backend, quiet) {
        Ok(b) => b,
        Err(message) => {
            eprintln!("error: {message}");
            return 2;
        }
    };
    let (spec, plan) = match compile(&args.file, &args.spec.set) {
        Ok(compiled) => compiled,
        Err(code) => return code,
    };
    match rank_main(args, &env, backend, &spec, &plan) {
        Ok(()) => 0,
        Err(message) => {
            eprintln!("error: {message}");
            1
        }
    }
}

fn rank_main(
    args: &RunArgs,
    env: &LaunchEnv,
    backend: Resolved,
    spec: &Spec,
    plan: &Plan,
) -> Result<(), String> {
    let how = format!("{}: {} processes", env.kind.name(), env.world);
    launch::check_world(&plan.mesh, env.world, &how).map_err(|e| e.to_string())?;
    if backend != Resolved::Cpu {
        // GPU ranks: tensor-parallel groups must not span hosts.
        let per_host = env.local_world.unwrap_or(spec.cluster.gpus_per_node);
        launch::check_tp_on_host(&plan.mesh, per_host).map_err(|e| e.to_string())?;
    }
    let hash = parc_runtime::checkpoint::plan_hash(plan);
    let mut config = RendezvousConfig::new(
        env.rank,
        env.world,
        env.local_rank,
        &hash,
        &env.master_addr,
        env.master_port,
    );
    config.timeout = timeout(args.rendezvous_timeout, "--rendezvous-timeout")?;
    let rendezvous = Rendezvous::join(&config).map_err(|e| e.to_string())?;
    inject_fault(env.rank);
    let result = train_rank(args, env, backend, spec, plan, &rendezvous);
    if let Err(message) = &result {
        rendezvous.abort(&format!("rank {}: {message}", env.rank));
    }
    result
}

/// `PARC_TEST_FAULT=abort:R@MS` or `stop:R@MS`: MS ms from now, rank R's process aborts (a
/// crash) or stops (SIGSTOP, a hang that keeps its connections open).
fn inject_fault(rank: u32) {
    let Ok(fault) = std::env::var("PARC_TEST_FAULT") else {
        return;
    };
    let Some((kind, at)) = fault.split_once(':') else {
        return;
    };
    let (who, after) = at.split_once('@').unwrap_or((at, "0"));
    if who.trim().parse::<u32>().ok() != Some(rank) {
        return;
    }
    let after = Duration::from_millis(after.trim().parse().unwrap_or(0));
    let stop = match kind {
        "abort" => false,
        "stop" => true,
        _ => return,
    };
    let kind = kind.to_string();
    std::thread::spawn(move || {
        std::thread::sleep(after);
        eprintln!("PARC_TEST_FAULT: rank {rank} {kind}s now");
        if stop {
            // SAFETY: raising a signal on this process.
            unsafe {
                libc::raise(libc::SIGSTOP);
            }
        } else {
            std::process::abort();
        }
    });
}

fn train_rank(
    args: &RunArgs,
    env: &LaunchEnv,
    backend: Resolved,
    spec: &Spec,
    plan: &Plan,
    rendezvous: &Rendezvous,
) -> Result<(), String> {
    let mut options = parc_runtime::exec::TrainOptions::new(spec_folder(&args.file));
    options.resume = args.resume.clone();
    options.profile = args.profile || args.profile_step.is_some();
    options.profile_step = args.profile_step;
    options.comm_timeout = timeout(args.comm_timeout, "--comm-timeout")?;
    options.save_init = args.save_init.clone();
    options.log_batches = args.log_batches.clone();
    let is_report = env.rank == plan.report_rank;
    let progress = Progress::new(
        args.log_format,
        spec.train.steps,
        spec.train.log_every,
        std::io::stderr().is_terminal(),
    );
    let first_step = std::sync::atomic::AtomicU64::new(u64::MAX);
    let on_step = |record: &parc_runtime::exec::StepRecord| {
        if !is_report {
            return;
        }
        let _ = first_step.compare_exchange(
            u64::MAX,
            record.step,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        progress.step(record, first_step.load(Ordering::Relaxed));
    };
    if is_report && args.log_format == LogFormat::Human {
        eprintln!(
            "training {} on {} ranks, one per process ({}; this is rank {} on {}) ({} steps)",
            spec.model.name,
            plan.world,
            env.kind.name(),
            env.rank,
            launch::rendezvous::host_name(),
            spec.train.steps
        );
    }
    let result = match backend {
        Resolved::Cpu => cpu_rank(spec, plan, &options, env, rendezvous, &on_step)
            .map_err(|e| crate::run_error::describe(&e, spec, &args.file, &args.spec.set))?,
        #[cfg(feature = "cuda")]
        Resolved::Cuda => crate::run_comm::cuda_process_rank(
            args.comm, spec, plan, &options, env, rendezvous, &on_step,
        )?,
    };
    // Every rank has finished (and rank 0 written the model export) before the summary.
    rendezvous.finish().map_err(|e| e.to_string())?;
    if is_report {
        progress.finish(&Summary {
            records: &result.records,
            epochs: &result.epochs,
            checkpoints: &result.checkpoints,
            model_export: result.model_export.as_ref(),
            backend: backend.name(),
            world: plan.world,
        });
        if let (Some(profile), LogFormat::Human) = (&result.profile, args.log_format) {
            eprint!("{}", crate::run_profile::human(profile, &spec.cluster.gpu));
        }
    }
    Ok(())
}

#[cfg(feature = "mpi")]
fn cpu_rank(
    spec: &Spec,
    plan: &Plan,
    options: &parc_runtime::exec::TrainOptions,
    env: &LaunchEnv,
    rendezvous: &Rendezvous,
    on_step: &(dyn Fn(&parc_runtime::exec::StepRecord) + Sync),
) -> parc_runtime::error::Result<parc_runtime::exec::ProcessRankResult> {
    use parc_runtime::comm::mpi::MpiComm;
    let comm = MpiComm::init(rendezvous.clone(), options.comm_timeout)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_host = env.local_world.unwrap_or(env.world).max(1) as usize;
    let backend = parc_runtime::cpu::CpuBackend::with_threads((cores / per_host).max(1))?;
    parc_runtime::exec::train_rank(spec, plan, options, backend, Box::new(comm), on_step)
}

#[cfg(not(feature = "mpi"))]
fn cpu_rank(
    _spec: &Spec,
    _plan: &Plan,
    _options: &parc_runtime::exec::TrainOptions,
    env: &LaunchEnv,
    _rendezvous: &Rendezvous,
    _on_step: &(dyn Fn(&parc_runtime::exec::StepRecord) + Sync),
) -> parc_runtime::error::Result<parc_runtime::exec::ProcessRankResult> {
    Err(parc_runtime::error::RuntimeError::Unsupported(format!(
        "rank {} of {}: {NO_MPI}",
        env.rank, env.world
    )))
}

/// Why a multi-process CPU run cannot start in a build without the `mpi` feature.
const NO_MPI: &str = "a multi-process CPU run needs the MPI comm, and this parc was built \
    without it; install Open MPI (`apt-get install libopenmpi-dev openmpi-bin`) and build with \
    `cargo build --release --features mpi`, or run every rank in one process (`parc run FILE` \
    without --nproc-per-node or a launcher)";

// ------------------------------------------------------------------------------------------
// Launcher
// ------------------------------------------------------------------------------------------

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
                eprintln!("error: {message}");
            }
            code
        }
    }
}

fn launch_inner(args: &RunArgs, n: u32) -> Result<u8, (u8, String)> {
    let quiet = args.log_format == LogFormat::Json;
    let backend = resolve_backend(args.backend, true).map_err(|m| (2, m))?;
    let (_, plan) = compile(&args.file, &args.spec.set).map_err(|code| (code, String::new()))?;
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
    let port = free_port().map_err(|e| (1, format!("no free port for the rendezvous: {e}")))?;
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
                .args(["-x", &format!("MASTER_PORT={port}")]);
            if std::env::var_os("PARC_TEST_FAULT").is_some() {
                command.args(["-x", "PARC_TEST_FAULT"]);
            }
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
                    .env("MASTER_PORT", port.to_string());
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

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()?
        .port())
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
/// `mpiexec --tag-output` (`[job,R]<stderr>:text`) name their rank; other mpiexec lines are
/// prefixed `[mpiexec]`. Each rank's last `error:` line is kept for the final report.
fn relay(
    stream: impl std::io::Read,
    rank: Option<u32>,
    is_stderr: bool,
    errors: &Mutex<HashMap<u32, String>>,
) {
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { return };
        let (rank, to_stderr, text) = match rank {
            Some(r) => (Some(r), is_stderr, line),
            None => match parse_tagged(&line) {
                Some((r, err, text)) => (Some(r), err, text),
                None => (None, true, line),
            },
        };
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
}

/// `[1,2]<stderr>:text` → (2, true, "text"). mpiexec tags every write, so a line printed in
/// pieces carries more tags inside; they are removed.
fn parse_tagged(line: &str) -> Option<(u32, bool, String)> {
    let (rank, is_stderr, len) = tag_at(line)?;
    Some((rank, is_stderr, strip_tags(line.get(len..).unwrap_or(""))))
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

fn strip_tags(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('[') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let skip = tag_at(rest).map_or(1, |(_, _, len)| len);
        if skip == 1 {
            out.push('[');
        }
        rest = rest.get(skip..).unwrap_or("");
    }
    out.push_str(rest);
    out
}

/// The rank a "stopped because rank R failed" message blames.
fn blamed_rank(message: &str) -> Option<u32> {
    let (_, rest) = message.split_once("because rank ")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
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
    // The root cause: the rank the others blame, else the first to fail, else any with an
    // error of its own.
    let blamed = errors.values().find_map(|m| blamed_rank(m));
    let own_error = |r: &u32| errors.get(r).is_some_and(|m| blamed_rank(m).is_none());
    let root = blamed
        .or(first.filter(own_error))
        .or_else(|| errors.keys().copied().filter(own_error).min())
        .or(first);
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
        let tagged = |line: &str, rank: u32, err: bool, text: &str| {
            assert_eq!(
                parse_tagged(line),
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
        assert_eq!(parse_tagged("mpiexec noticed that"), None);
        assert_eq!(parse_tagged("[0, 1] x"), None);
    }

    #[test]
    fn follower_errors_blame_the_failed_rank() {
        assert_eq!(
            blamed_rank("communication: rank 1 stopped in x because rank 2 failed: dead"),
            Some(2)
        );
        assert_eq!(blamed_rank("data: file missing"), None);
    }
}
