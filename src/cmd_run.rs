//! `parc run FILE [--set PATH=VALUE]… [--backend auto|cpu|cuda] [--log-format human|json]
//! [--resume DIR] [--profile] [--profile-step N] [--save-init FILE] [--log-batches FILE]`:
//! check the spec, lower it to per-rank programs, and train them on this machine, one thread
//! per rank with the local comm. Exit codes as `main`: 0 trained, 1 the spec or the run
//! failed, 2 usage or unreadable input.
use crate::diagnostics;
use crate::input::{parse_overrides, read_spec};
use crate::run_profile;
use crate::run_progress::{LogFormat, Progress, Summary};
use crate::SpecArgs;
use parc_compiler::diag::{Diagnostics, Sources};
use parc_compiler::ir::Plan;
use parc_compiler::lower::lower;
use parc_compiler::spec::{Gpu, Precision, Spec};
use parc_runtime::backend::Backend;
use parc_runtime::cpu::CpuBackend;
use parc_runtime::exec::profile::StepProfile;
use parc_runtime::exec::{train, TrainOptions};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    /// CUDA when this build has it and a GPU is present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The .par file.
    pub file: PathBuf,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Where the ranks compute.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendChoice,
    /// How the ranks communicate: `nccl` on the GPUs' own buffers, `local` through host
    /// memory; `auto` is NCCL for a CUDA run of several ranks.
    #[arg(long, value_enum, default_value = "auto")]
    pub comm: crate::run_comm::CommChoice,
    /// `human`: a progress line on stderr; `json`: one JSON object per step on stdout.
    #[arg(long = "log-format", value_enum, default_value = "human")]
    pub log_format: LogFormat,
    /// Continue from a checkpoint: a `step-N` folder, or a checkpoint dir (its newest).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Time every op of one step (the third, or the last if fewer) and report where the
    /// step's time went.
    #[arg(long)]
    pub profile: bool,
    /// The 0-based step to profile (implies --profile).
    #[arg(long = "profile-step", value_name = "N")]
    pub profile_step: Option<u64>,
    /// Start N rank processes of this run on this host, one rank per process (see
    /// docs/launch.md); the spec's mesh must have N ranks.
    #[arg(long = "nproc-per-node", value_name = "N")]
    pub nproc_per_node: Option<u32>,
    /// Seconds the ranks of a multi-process run wait for each other to join.
    #[arg(
        long = "rendezvous-timeout",
        value_name = "SECS",
        default_value_t = 60.0
    )]
    pub rendezvous_timeout: f64,
    /// Seconds a rank of a multi-process run waits for a peer in a collective or transfer.
    #[arg(long = "comm-timeout", value_name = "SECS", default_value_t = 120.0)]
    pub comm_timeout: f64,
    /// Write the parameters before the first step (the initialisation) as global tensors to
    /// this safetensors file, named as in the final `model.safetensors`.
    #[arg(long = "save-init", value_name = "FILE")]
    pub save_init: Option<PathBuf>,
    /// Write every step's global batch (token offsets of its samples in the data file) to
    /// this file as JSON lines before training.
    #[arg(long = "log-batches", value_name = "FILE")]
    pub log_batches: Option<PathBuf>,
}

/// The backend a run will use, after resolving `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Resolved {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda,
}

impl Resolved {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Resolved::Cpu => "cpu",
            #[cfg(feature = "cuda")]
            Resolved::Cuda => "cuda",
        }
    }
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn resolve_backend(choice: BackendChoice, quiet: bool) -> Result<Resolved, String> {
    match choice {
        BackendChoice::Cpu => Ok(Resolved::Cpu),
        BackendChoice::Cuda => Err("--backend cuda: this parc was built without CUDA; rebuild \
             with `cargo build --release --features cuda` on a machine with the CUDA driver, \
             or use --backend cpu"
            .to_string()),
        BackendChoice::Auto => {
            if !quiet {
                eprintln!("backend: cpu (auto: this parc was built without CUDA)");
            }
            Ok(Resolved::Cpu)
        }
    }
}

#[cfg(feature = "cuda")]
pub(crate) fn resolve_backend(choice: BackendChoice, quiet: bool) -> Result<Resolved, String> {
    match choice {
        BackendChoice::Cpu => Ok(Resolved::Cpu),
        BackendChoice::Cuda => Ok(Resolved::Cuda),
        BackendChoice::Auto => match parc_runtime::cuda::CudaBackend::new(0) {
            Ok(_) => {
                if !quiet {
                    eprintln!("backend: cuda (auto: a CUDA device is present)");
                }
                Ok(Resolved::Cuda)
            }
            Err(e) => {
                if !quiet {
                    eprintln!("backend: cpu (auto: no usable CUDA device: {e})");
                }
                Ok(Resolved::Cpu)
            }
        },
    }
}

pub fn main(args: RunArgs) -> u8 {
    match crate::run_launch::mode(&args) {
        Ok(crate::run_launch::Mode::Single) => {}
        Ok(crate::run_launch::Mode::Launcher(n)) => return crate::run_supervise::launch(&args, n),
        Ok(crate::run_launch::Mode::Rank(env)) => return crate::run_launch::run_rank(&args, env),
        Err(message) => {
            print_error(&message);
            return 2;
        }
    }
    let quiet = args.log_format == LogFormat::Json;
    let (backend, spec, plan) = match backend_and_plan(&args, quiet) {
        Ok(prepared) => prepared,
        Err(code) => return code,
    };
    let spec_dir = spec_folder(&args.file);
    exit_code(run(&spec, &plan, &spec_dir, backend, &args))
}

/// The backend `args` asks for and its spec compiled to a plan. `Err` is the exit code, the
/// error already on stderr: 2 for a backend that cannot run, else as `compile`.
pub(crate) fn backend_and_plan(args: &RunArgs, quiet: bool) -> Result<(Resolved, Spec, Plan), u8> {
    let backend = resolve_backend(args.backend, quiet).map_err(|message| {
        print_error(&message);
        2
    })?;
    let (spec, plan) = compile(&args.file, &args.spec.set)?;
    Ok((backend, spec, plan))
}

/// A run's exit code: 0, or 1 with its error on stderr.
pub(crate) fn exit_code(outcome: Result<(), String>) -> u8 {
    match outcome {
        Ok(()) => 0,
        Err(message) => {
            print_error(&message);
            1
        }
    }
}

/// `error: message` on stderr in one write, so that a launcher reading several ranks at once
/// gets it whole (`eprintln!` writes each piece of its format separately).
pub(crate) fn print_error(message: &str) {
    use std::io::Write;
    let text = format!("error: {message}\n");
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// Read, check and lower the spec, rendering every diagnostic on stderr. `Err` is the exit
/// code: 2 for unreadable input or a bad `--set`, 1 for a spec with errors.
pub(crate) fn compile(file: &Path, set: &[String]) -> Result<(Spec, Plan), u8> {
    let fail = |code: u8| {
        move |message: String| {
            print_error(&message);
            code
        }
    };
    let overrides = parse_overrides(set).map_err(fail(2))?;
    let text = read_spec(file).map_err(fail(2))?;
    let mut sources = Sources::default();
    let main = sources.add(file.display().to_string(), text);
    let (spec, diags) = parc_compiler::check(&mut sources, main, &overrides);
    let color = diagnostics::stderr_color();
    let show = |diags: &Diagnostics| {
        for d in &diags.items {
            eprint!("{}", diagnostics::render(&sources, d, color));
            eprintln!();
        }
    };
    show(&diags);
    let spec = match spec {
        Some(spec) if !diags.has_errors() => spec,
        _ => {
            eprintln!(
                "error: {} has errors; `parc check` shows them all",
                file.display()
            );
            return Err(1);
        }
    };
    match lower(&spec) {
        Ok(plan) => Ok((spec, plan)),
        Err(diags) => {
            show(&diags);
            eprintln!("error: the plan of {} cannot be lowered", file.display());
            Err(1)
        }
    }
}

/// The folder data and checkpoint paths are relative to.
/// The training options every way of running takes from the command line.
pub(crate) fn train_options(args: &RunArgs, spec_dir: &Path) -> TrainOptions {
    let mut options = TrainOptions::new(spec_dir);
    options.resume = args.resume.clone();
    options.profile = args.profile || args.profile_step.is_some();
    options.profile_step = args.profile_step;
    options.save_init = args.save_init.clone();
    options.log_batches = args.log_batches.clone();
    options
}

pub(crate) fn spec_folder(file: &Path) -> PathBuf {
    match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn run(
    spec: &Spec,
    plan: &Plan,
    spec_dir: &Path,
    backend: Resolved,
    args: &RunArgs,
) -> Result<(), String> {
    match backend {
        Resolved::Cpu => {
            crate::run_comm::check_cpu(args.comm)?;
            run_with(spec, plan, spec_dir, backend, args, |_, threads| {
                CpuBackend::with_threads(threads)
            })
        }
        // Rank r of a local run uses GPU r.
        #[cfg(feature = "cuda")]
        Resolved::Cuda => {
            let quiet = args.log_format == LogFormat::Json;
            let comm = crate::run_comm::resolve_cuda(args.comm, plan.world, quiet)?;
            let timeout = crate::run_comm::comm_timeout(args.comm_timeout)?;
            let gate = crate::run_comm::StartGate::new(plan.world, timeout);
            run_with(spec, plan, spec_dir, backend, args, |rank, _| {
                crate::run_comm::cuda_rank(rank, spec, plan, &comm, &gate)
            })
        }
    }
}

fn run_with<B: Backend>(
    spec: &Spec,
    plan: &Plan,
    spec_dir: &Path,
    backend: Resolved,
    args: &RunArgs,
    new_backend: impl Fn(u32, usize) -> parc_runtime::error::Result<B> + Sync,
) -> Result<(), String> {
    let quiet = args.log_format == LogFormat::Json;
    if !quiet {
        if backend == Resolved::Cpu && spec.train.precision != Precision::Fp32 {
            let asked = match spec.train.precision {
                Precision::Fp16 { .. } => "fp16; its loss scaling stays active",
                _ => "bf16",
            };
            eprintln!("note: the cpu backend computes in fp32 (the spec asks for {asked})");
        }
        eprintln!(
            "training {} on {} rank{} ({} steps, global batch {} × seq {})",
            spec.model.name,
            plan.world,
            if plan.world == 1 { "" } else { "s" },
            spec.train.steps,
            spec.train.global_batch,
            spec.model.seq
        );
    }
    let mut options = train_options(args, spec_dir);
    if backend == Resolved::Cpu {
        // Every rank lives in this process: all of them must fit in host memory.
        options.memory_limit = available_memory();
    }
    let progress = Progress::new(
        args.log_format,
        spec.train.steps,
        spec.train.log_every,
        std::io::stderr().is_terminal(),
    );
    let on_step = |record: &parc_runtime::exec::StepRecord| progress.step(record);
    let result = train(spec, plan, &options, new_backend, &on_step)
        .map_err(|e| crate::run_error::describe(&e, spec, &args.file, &args.spec.set))?;
    let summary = Summary {
        records: &result.records,
        epochs: &result.epochs,
        checkpoints: &result.checkpoints,
        model_export: result.model_export.as_ref(),
        backend: backend.name(),
        world: plan.world,
        reserved_bytes: result.reserved_bytes,
    };
    let (profile, gpu) = (result.profile.as_ref(), &spec.cluster.gpu);
    finish_report(&progress, &summary, profile, args.log_format, gpu);
    Ok(())
}

/// What the report rank prints when training has ended: the profiled step as JSON (before the
/// summary line), the summary, then in the human format the memory the backend held and the
/// profile's table.
pub(crate) fn finish_report(
    progress: &Progress,
    summary: &Summary,
    profile: Option<&StepProfile>,
    format: LogFormat,
    gpu: &Gpu,
) {
    if let (Some(profile), LogFormat::Json) = (profile, format) {
        println!("{}", run_profile::json(profile, gpu));
    }
    progress.finish(summary);
    if format == LogFormat::Human {
        if let Some(reserved) = summary.reserved_bytes {
            print_reserved(summary.backend, reserved);
        }
        if let Some(profile) = profile {
            eprint!("{}", run_profile::human(profile, gpu));
        }
    }
}

/// Bytes of host memory available now (Linux `MemAvailable`), if known.
fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
}

/// The human summary's line on the most memory one rank's backend held.
fn print_reserved(backend: &str, reserved: u64) {
    eprintln!(
        "memory held by the {backend} backend: {} per rank at most (buffers as planned, scratch, \
         workspace)",
        crate::report::bytes(reserved as f64)
    );
}
