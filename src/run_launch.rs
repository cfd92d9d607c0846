//! One rank of a multi-process `parc run` (launcher variables set: `--nproc-per-node`'s, torchrun,
//! Open MPI, Slurm, PMI): compile the spec, refuse a world size other than the mesh's (and, on
//! GPUs, tp groups that span hosts), join the rendezvous, build this process's comm and train
//! its rank; only the plan's report rank prints progress and the summary, after every rank
//! finished, and writes `--metrics`. [`mode`] decides whether this process is such a rank, the
//! launcher (`run_supervise`) or a single-process run.
//!
//! For testing the failure handling, `PARC_TEST_FAULT=abort:R@MS` makes rank R's process abort
//! MS milliseconds after the rendezvous (a crash), `kill:R@MS` kill itself (SIGKILL, as `kill -9`
//! does), `stop:R@MS` stop (SIGSTOP: a hang).
use crate::metrics::RunMetrics;
use crate::run_args::{spec_folder, train_options, Resolved, RunArgs};
use crate::run_prepare::{backend_and_plan, exit_code, Shown, WARNINGS_SHOWN_VAR};
use crate::run_progress::{finish_report, LogFormat, Progress, Summary};
use parc_compiler::ir::Plan;
use parc_compiler::spec::Spec;
use parc_runtime::exec::RecordStage;
use parc_runtime::launch::{self, LaunchEnv, Rendezvous, RendezvousConfig};
use std::io::IsTerminal;
use std::time::Duration;

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
    args.consent.needs_resume(args.resume.as_deref())?;
    let env = launch::detect_process().map_err(|e| e.to_string())?;
    match (env, args.nproc_per_node) {
        (Some(env), _) if env.world > 1 => Ok(Mode::Rank(env)),
        (_, Some(0)) => Err("--nproc-per-node must be at least 1".to_string()),
        (_, Some(n)) if n > 1 => Ok(Mode::Launcher(n)),
        // Not a rank, but a Slurm job's batch script: its tasks are srun's to start.
        (None, None) => match launch::env::slurm_batch_script_of_tasks_here() {
            Some(why) => Err(why),
            None => Ok(Mode::Single),
        },
        _ => Ok(Mode::Single),
    }
}

pub(crate) fn timeout(seconds: f64, flag: &str) -> Result<Duration, String> {
    if seconds.is_finite() && seconds > 0.0 {
        Ok(Duration::from_secs_f64(seconds))
    } else {
        Err(format!("{flag} must be a positive number of seconds"))
    }
}

/// Run this process's rank of a launched job; the exit code.
pub fn run_rank(args: &RunArgs, env: LaunchEnv) -> u8 {
    let quiet = args.log_format == LogFormat::Json || env.rank != 0;
    let (backend, spec, plan) = match backend_and_plan(args, quiet, diagnostics_shown(env.rank)) {
        Ok(prepared) => prepared,
        Err(code) => return code,
    };
    exit_code(rank_main(args, &env, backend, &spec, &plan))
}

/// The spec's warnings once per job: rank 0 shows them, unless `--nproc-per-node`'s launcher
/// showed them before it started the ranks; every rank shows its errors (a rank whose spec
/// does not compile fails on its own).
fn diagnostics_shown(rank: u32) -> Shown {
    let launcher_showed = std::env::var_os(WARNINGS_SHOWN_VAR).is_some();
    if rank == 0 && !launcher_showed {
        Shown::All
    } else {
        Shown::Errors
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
    config.me.settings = launch::spec_settings(spec);
    config.me.flags = args.agreed_flags(backend);
    let rendezvous = Rendezvous::join(&config).map_err(|e| e.to_string())?;
    inject_fault(env.rank);
    let result = train_rank(args, env, backend, spec, plan, &rendezvous);
    if let Err(message) = &result {
        rendezvous.abort(&format!("rank {}: {message}", env.rank));
    }
    result
}

/// `PARC_TEST_FAULT=abort:R@MS`, `kill:R@MS` or `stop:R@MS`: MS ms from now, rank R's process
/// aborts (a crash), is killed (SIGKILL) or stops (SIGSTOP, a hang that keeps its connections
/// open).
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
    let signal = match kind {
        "abort" => libc::SIGABRT,
        "kill" => libc::SIGKILL,
        "stop" => libc::SIGSTOP,
        _ => return,
    };
    let kind = kind.to_string();
    std::thread::spawn(move || {
        std::thread::sleep(after);
        eprintln!("PARC_TEST_FAULT: rank {rank} {kind}s now");
        if signal == libc::SIGABRT {
            std::process::abort();
        }
        // SAFETY: sending a signal to this process.
        unsafe {
            libc::kill(libc::getpid(), signal);
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
    let mut options = train_options(args, &spec_folder(&args.file));
    options.comm_timeout = timeout(args.comm_timeout, "--comm-timeout")?;
    let is_report = env.rank == plan.report_rank;
    // Only the report rank writes metrics.
    let metrics = RunMetrics::open(args.metrics.as_deref().filter(|_| is_report), spec)?;
    let progress = Progress::new(
        args.log_format,
        spec.train.steps,
        spec.train.log_every,
        std::io::stderr().is_terminal(),
    );
    if is_report {
        progress.show_first_step();
    }
    // The metrics row before the step's save and its line (`RecordStage`): a reader that
    // sees a step's line, or a checkpoint of it, finds its row in metrics.csv.
    let on_step = |record: &parc_runtime::exec::StepRecord| match record.stage {
        RecordStage::BeforeSave => {
            if let Some(metrics) = &metrics {
                metrics.step(record);
            }
        }
        RecordStage::Complete if is_report => progress.step(record),
        RecordStage::Complete => {}
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
        let summary = Summary {
            records: &result.records,
            epochs: &result.epochs,
            checkpoints: &result.checkpoints,
            model_export: result.model_export.as_ref(),
            backend: backend.name(),
            world: plan.world,
            reserved_bytes: result.reserved_bytes,
        };
        let profile = (result.profile.as_ref())
            .map(|p| crate::run_profile::profiled(p, spec, plan, &args.calibration));
        finish_report(&progress, &summary, profile.as_ref(), args.log_format);
    }
    metrics.map_or(Ok(()), RunMetrics::finish)
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
pub(crate) const NO_MPI: &str =
    "a multi-process CPU run needs the MPI comm, and this parc was built \
    without it; install Open MPI (`apt-get install libopenmpi-dev openmpi-bin`) and build with \
    `cargo build --release --features mpi`, or run every rank in one process (`parc run FILE` \
    without --nproc-per-node or a launcher)";
