//! `parc run`'s command line and what follows from it alone: the flags ([`RunArgs`]; the
//! consents to a resume's changes, [`ConsentArgs`], are `parc check`'s and `parc reshard`'s
//! too), the backend `--backend` resolves to ([`resolve_backend`]), the folder the spec's paths
//! are relative to and the training options. Shared by the single-process run (`cmd_run`), the
//! launcher (`run_supervise`) and each launched rank (`run_launch`).
use crate::run_comm::CommChoice;
use crate::run_progress::LogFormat;
use crate::SpecArgs;
use parc_runtime::checkpoint::{Consent, SpecSource};
use parc_runtime::exec::TrainOptions;
use std::collections::BTreeMap;
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
    /// The calibration profile the FP8 choice is priced by (as `parc check` prices it).
    #[command(flatten)]
    pub calibration: crate::calibration::CalibrationArgs,
    /// Where the ranks compute.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendChoice,
    /// How the ranks communicate: `nccl` on the GPUs' own buffers, `local` through host
    /// memory; `auto` is NCCL for a CUDA run of several ranks.
    #[arg(long, value_enum, default_value = "auto")]
    pub comm: CommChoice,
    /// `human`: a progress line on stderr; `json`: one JSON object per step on stdout.
    #[arg(long = "log-format", value_enum, default_value = "human")]
    pub log_format: LogFormat,
    /// Continue from a checkpoint: a `step-N` folder, or a checkpoint dir (its newest that
    /// verifies).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    #[command(flatten)]
    pub consent: ConsentArgs,
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
    /// Write every step's metrics to DIR/metrics.csv and a TensorBoard event file in DIR, as
    /// the run goes (a resumed run appends); `parc plot DIR` draws them.
    #[arg(long, value_name = "DIR")]
    pub metrics: Option<PathBuf>,
}

impl RunArgs {
    /// The flags every rank of a multi-process job must share, by name, as the rendezvous
    /// compares them (`Member::flags`): the backend this rank resolved (the ranks of one job
    /// run one comm), `--fusion` (other kernels; the plan hash differs too, this names why) and
    /// the resume consents (a rank without one refuses the checkpoint the others continue).
    /// Left out, as they may differ per rank without changing what the job computes: output
    /// (`--log-format`, `--metrics`), `--profile` and `--profile-step` (only the report rank
    /// times a step, and timing changes no value), the timeouts, `--calibration` (a path per
    /// host; what it decides is in the plan hash), `--resume`'s path (the ranks compare the
    /// checkpoint itself before the first step) and `--save-init`/`--log-batches` (refused in
    /// such a run).
    pub(crate) fn agreed_flags(&self, backend: Resolved) -> BTreeMap<String, String> {
        let given = |on: bool| if on { "given" } else { "not given" }.to_string();
        BTreeMap::from([
            ("--backend".to_string(), backend.name().to_string()),
            ("--fusion".to_string(), self.spec.fusion_name().to_string()),
            (
                "--resume-any-batch".to_string(),
                given(self.consent.resume_any_batch),
            ),
            (
                "--resume-any-data".to_string(),
                given(self.consent.resume_any_data),
            ),
        ])
    }
}

/// What a resume may change beyond the plan; `parc run`, `parc check --resume` and `parc
/// reshard` take the same flags.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct ConsentArgs {
    /// Let the checkpoint continue under another `train.global_batch`: the data order
    /// continues at the samples the checkpoint had seen (refused without this flag: E1104).
    #[arg(long = "resume-any-batch")]
    pub resume_any_batch: bool,
    /// Let the checkpoint continue on other training data (another file, size or token
    /// count): the sampler continues on this data at the samples the checkpoint had seen
    /// (refused without this flag: E1107).
    #[arg(long = "resume-any-data")]
    pub resume_any_data: bool,
}

impl ConsentArgs {
    pub fn consent(self) -> Consent {
        Consent {
            any_batch: self.resume_any_batch,
            any_data: self.resume_any_data,
        }
    }

    /// A consent without `--resume` has nothing to consent to: a usage error naming the flag.
    pub fn needs_resume(self, resume: Option<&Path>) -> Result<(), String> {
        let given = [
            ("--resume-any-batch", self.resume_any_batch),
            ("--resume-any-data", self.resume_any_data),
        ];
        match given.iter().find(|(_, on)| *on) {
            Some((flag, _)) if resume.is_none() => Err(format!(
                "{flag} consents to a change when resuming a checkpoint; give --resume DIR too"
            )),
            _ => Ok(()),
        }
    }
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

/// The training options every way of running takes from the command line.
pub(crate) fn train_options(args: &RunArgs, spec_dir: &Path) -> TrainOptions {
    let mut options = TrainOptions::new(spec_dir);
    options.resume = args.resume.clone();
    options.resume_any_batch = args.consent.resume_any_batch;
    options.resume_any_data = args.consent.resume_any_data;
    options.profile = args.profile || args.profile_step.is_some();
    options.profile_step = args.profile_step;
    options.save_init = args.save_init.clone();
    options.log_batches = args.log_batches.clone();
    options.source = spec_source(args, spec_dir);
    options.on_sample = Some(crate::run_progress::sample_sink(args.log_format));
    options
}

/// The spec as given, for the model files the run writes (`checkpoint::saved`); none when the
/// file cannot be read again (the run has read it once already and fails on its own terms).
fn spec_source(args: &RunArgs, spec_dir: &Path) -> Option<SpecSource> {
    let text = crate::input::read_spec(&args.file).ok()?;
    Some(SpecSource {
        file: args.file.display().to_string(),
        dir: std::path::absolute(spec_dir).unwrap_or_else(|_| spec_dir.to_path_buf()),
        text,
        overrides: args.spec.set.clone(),
    })
}

/// The folder data and checkpoint paths are relative to: the spec file's.
pub(crate) fn spec_folder(file: &Path) -> PathBuf {
    match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Say where the parameters start when it is not the seed: the spec's `train.init = hf(…)`,
/// or, with `--resume`, the checkpoint (which wins over `train.init`).
pub(crate) fn note_init(spec: &parc_compiler::spec::Spec, args: &RunArgs) {
    if let parc_compiler::spec::InitFrom::Hf { path, .. } = &spec.train.init {
        if args.resume.is_some() {
            eprintln!(
                "note: --resume continues its checkpoint; train.init = hf(\"{path}\") is not read"
            );
        } else {
            eprintln!("note: the parameters start from the Hugging Face weights in {path}");
        }
    }
}
