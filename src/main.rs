//! `parc`: the command line. Reads files, calls the compiler and runtime, renders reports.
//! Exit codes: 0 success (warnings allowed), 1 the spec or the run failed, 2 usage or unreadable
//! input.

#[cfg(feature = "cuda")]
mod calibrate_nccl;
mod calibration;
mod cmd_calibrate;
mod cmd_check;
mod cmd_export;
mod cmd_plan;
mod cmd_plot;
mod cmd_reshard;
mod cmd_run;
mod cmd_sample;
mod cmd_search;
mod cmd_tokenize;
mod cuda_support;
mod data_check;
mod diag_text;
mod diagnostics;
mod init_check;
mod input;
mod metrics;
mod plan_summary;
mod report;
mod resume_check;
mod run_args;
mod run_comm;
mod run_error;
mod run_launch;
mod run_prepare;
mod run_profile;
mod run_progress;
mod run_supervise;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "parc",
    version,
    about = "Compile and run distributed training from one .par file"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Debug, Clone)]
pub struct SpecArgs {
    /// Override a value of the spec by its dotted path, e.g. `--set parallel.tp=4`.
    /// May be given many times; when a path is set twice, the last wins.
    #[arg(long = "set", value_name = "PATH=VALUE")]
    pub set: Vec<String>,
    /// Fuse groups of elementwise, data-movement and RoPE ops into generated kernels (`on`),
    /// or keep every hand-written op (`off`, to compare).
    #[arg(long, value_enum, default_value = "on")]
    pub fusion: Switch,
}

/// A compile option's `on` or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
}

impl SpecArgs {
    /// Whether `--fusion` is on.
    pub fn fusion(&self) -> bool {
        self.fusion == Switch::On
    }

    /// `--fusion`'s value as written.
    pub fn fusion_name(&self) -> &'static str {
        match self.fusion {
            Switch::On => "on",
            Switch::Off => "off",
        }
    }
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Parse and check specs: shapes, device grid, batch arithmetic, memory per rank.
    Check(cmd_check::CheckArgs),
    /// Lower a spec to per-rank schedule programs, verify them, show the timeline.
    Plan(cmd_plan::PlanArgs),
    /// Train: run the verified programs on this machine's backend.
    Run(run_args::RunArgs),
    /// Measure this machine's op times into a calibration profile for `check` and `plan`.
    Calibrate(cmd_calibrate::CalibrateArgs),
    /// Draw the metrics of `parc run --metrics` runs (loss, lr, throughput, …) as SVG or PNG.
    Plot(cmd_plot::PlotArgs),
    /// Write a trained model in another format: `--format hf`, a Hugging Face folder.
    Export(cmd_export::ExportArgs),
    /// Continue a prompt with a saved model, streaming the text as it comes.
    Sample(cmd_sample::SampleArgs),
    /// Tokenize text files into a folder of u16/u32 token shards for `data = "DIR" as u16`.
    Tokenize(cmd_tokenize::TokenizeArgs),
    /// Write a checkpoint re-sharded for another plan of the same model: `parc reshard CKPT
    /// SPEC OUT`, then `parc run SPEC --resume OUT`.
    Reshard(cmd_reshard::ReshardArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Check(_) | Command::Plan(_) | Command::Sample(_)
    ) {
        end_quietly_when_stdout_closes();
    }
    let code = match cli.command {
        Command::Check(args) => cmd_check::main(args),
        Command::Plan(args) => cmd_plan::main(args),
        Command::Run(args) => cmd_run::main(args),
        Command::Calibrate(args) => cmd_calibrate::main(args),
        Command::Plot(args) => cmd_plot::main(args),
        Command::Export(args) => cmd_export::main(args),
        Command::Sample(args) => cmd_sample::main(args),
        Command::Tokenize(args) => cmd_tokenize::main(args),
        Command::Reshard(args) => cmd_reshard::main(args),
    };
    ExitCode::from(code)
}

/// A command whose output is read through a pipe that closes early (`parc check --format json |
/// head`, `parc plan … | less` quit) ends as other Unix tools do, by SIGPIPE, where Rust's
/// default (the signal ignored) makes the next print panic with a backtrace. Only for commands
/// that print and open no sockets: the ranks of `parc run` must see a peer's closed connection
/// as an error they report, not a signal that kills them.
fn end_quietly_when_stdout_closes() {
    // SAFETY: sets one signal's disposition to the default, before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
