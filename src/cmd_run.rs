//! `parc run FILE [--set PATH=VALUE]… [--backend auto|cpu|cuda] [--log-format human|json]
//! [--resume DIR] [--profile] [--profile-step N] [--save-init FILE] [--log-batches FILE]
//! [--metrics DIR]`:
//! check the spec, lower it to per-rank programs, and train them on this machine, one thread
//! per rank with the local comm; with `--nproc-per-node` or under a launcher, hand over to
//! `run_supervise` or `run_launch`. Exit codes as `main`: 0 trained, 1 the spec or the run
//! failed, 2 usage or unreadable input.
use crate::metrics::RunMetrics;
use crate::run_args::{spec_folder, train_options, Resolved, RunArgs};
use crate::run_launch::{self, Mode};
use crate::run_prepare::{backend_and_plan, exit_code, print_error, Shown};
use crate::run_progress::{finish_report, LogFormat, Progress, Summary};
use parc_compiler::ir::Plan;
use parc_compiler::spec::{DataSource, Precision, Spec};
use parc_runtime::backend::Backend;
use parc_runtime::cpu::CpuBackend;
use parc_runtime::exec::{train, RecordStage};
use std::io::IsTerminal;
use std::path::Path;

pub fn main(args: RunArgs) -> u8 {
    match run_launch::mode(&args) {
        Ok(Mode::Single) => {}
        Ok(Mode::Launcher(n)) => return crate::run_supervise::launch(&args, n),
        Ok(Mode::Rank(env)) => return run_launch::run_rank(&args, env),
        Err(message) => {
            print_error(&message);
            return 2;
        }
    }
    let quiet = args.log_format == LogFormat::Json;
    let (backend, spec, plan) = match backend_and_plan(&args, quiet, Shown::All) {
        Ok(prepared) => prepared,
        Err(code) => return code,
    };
    let spec_dir = spec_folder(&args.file);
    exit_code(run(&spec, &plan, &spec_dir, backend, &args))
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
    let metrics = RunMetrics::open(args.metrics.as_deref(), spec)?;
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
        if let DataSource::Text {
            path, tokenizer, ..
        } = &spec.train.data
        {
            eprintln!(
                "data: {path} through the {} tokenizer, tokenized now (`parc tokenize` does it \
                 once, ahead of runs)",
                tokenizer.name()
            );
        }
    }
    if !quiet {
        crate::run_args::note_init(spec, args);
        if backend == Resolved::Cpu {
            note_cpu_threads(plan.world);
        }
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
    progress.show_first_step();
    // The metrics row before the step's save and its line (`RecordStage`): a reader that
    // sees a step's line, or a checkpoint of it, finds its row in metrics.csv.
    let on_step = |record: &parc_runtime::exec::StepRecord| match record.stage {
        RecordStage::BeforeSave => {
            if let Some(metrics) = &metrics {
                metrics.step(record);
            }
        }
        RecordStage::Complete => progress.step(record),
    };
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
    let profile = (result.profile.as_ref())
        .map(|p| crate::run_profile::profiled(p, spec, plan, &args.calibration));
    finish_report(&progress, &summary, profile.as_ref(), args.log_format);
    metrics.map_or(Ok(()), RunMetrics::finish)
}

/// The CPU backend runs every rank as a thread of this process: a world far larger than the
/// machine's cores trains, but slowly, and says so before it starts.
fn note_cpu_threads(world: u32) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if world as usize > 4 * cores {
        eprintln!(
            "note: the cpu backend runs each of the {world} ranks as a thread on this machine's \
             {cores} cores: expect steps to be slow (`parc check` and `parc plan` price this plan \
             without running it)"
        );
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
