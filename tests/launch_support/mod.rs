//! What the multi-process tests (`tests/launch.rs`, `tests/chaos.rs`) share: `parc` run from the
//! repository root with no fault or run-as-root variable inherited, the tiny example as a
//! 4-process plan, why MPI cannot run here, and the check that a communication timeout names
//! the waiting rank's instruction, group and spec line. Each binary includes it with `#[path]`.
#![allow(dead_code)] // each binary uses a part

use std::path::PathBuf;
use std::process::{Command, Output};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `parc` with `args` and the variables `env`, from the repository root. The test-fault
/// variables are cleared, and so are Open MPI's run-as-root ones: parc itself lets mpiexec
/// start under root.
pub fn parc(args: &[String], env: &[(&str, String)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_parc"));
    command.args(args).current_dir(root());
    for key in [
        "OMPI_ALLOW_RUN_AS_ROOT",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
        "PARC_TEST_FAULT",
        "PARC_FAULT_WRITE_AFTER_BYTES",
        "PARC_SPEC_WARNINGS_SHOWN",
    ] {
        command.env_remove(key);
    }
    for (key, value) in env {
        command.env(key, value);
    }
    command
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `parc run` of the tiny example, small and short, on the CPU, for 4 ranks on one node: the
/// `sets` (the plan's `parallel` settings first) and then 4 GPUs per node, global batch 4,
/// micro batch 1 and `steps` steps.
pub fn tiny_run(steps: u64, sets: &[String]) -> Vec<String> {
    let mut args: Vec<String> = vec!["run".into(), "examples/tiny.par".into()];
    let fixed = [
        "cluster.gpus_per_node=4".to_string(),
        "train.global_batch=4".to_string(),
        "train.micro_batch=1".to_string(),
        format!("train.steps={steps}"),
    ];
    for set in sets.iter().cloned().chain(fixed) {
        args.push("--set".into());
        args.push(set);
    }
    args.extend(["--backend".into(), "cpu".into()]);
    args
}

/// Why the MPI tests cannot run here, if they cannot.
pub fn mpi_missing() -> Option<&'static str> {
    if !cfg!(feature = "mpi") {
        return Some("parc was built without --features mpi");
    }
    let on_path = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join("mpiexec").is_file()));
    (!on_path).then_some("mpiexec is not on PATH (install openmpi-bin)")
}

/// `timed_out`, a line of `err`, is `[rank R at instruction I (op) … group]`, and `err` has the
/// spec line it came from after it (the example's, or the standard library's where the waiting
/// layer is a library block's).
pub fn assert_timeout_names_instruction_and_spec_line(err: &str, timed_out: &str) {
    let prefix = &timed_out[..timed_out.find(']').unwrap() + 1];
    let rank = prefix.trim_start_matches("[rank ").trim_end_matches(']');
    assert!(
        timed_out.contains(&format!("[rank {rank} at instruction "))
            && timed_out.contains(" group]"),
        "{err}"
    );
    assert!(
        err.lines()
            .any(|l| l.starts_with(&format!("{prefix}   at "))
                && l.contains(".par:")
                && l.contains("layer `")),
        "{err}"
    );
}
