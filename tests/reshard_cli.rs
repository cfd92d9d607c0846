//! Re-sharding through the binary on the tiny example: `parc check --resume` shows what each
//! rank of the new plan reads (and refuses another global batch or model with E1104 / E1101
//! before anything runs); `parc reshard` writes a checkpoint that `parc run --resume` of the new
//! plan loads as its own (no re-sharding), continuing to the losses of the run resumed with
//! re-sharding on load; with the `mpi` feature, a 4-rank checkpoint resumes in 2 processes
//! (`--nproc-per-node 2`) to the losses of the uninterrupted 4-rank run.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("parc-reshard-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `--set` flags for the tiny example on `ranks` ranks with `parallel` settings, checkpointing
/// every 2 steps into `dir`, `steps` steps.
fn sets(parallel: &[&str], ranks: u32, steps: u32, dir: &Path) -> Vec<String> {
    let mut args = Vec::new();
    for set in parallel.iter().map(|s| s.to_string()).chain([
        format!("cluster.gpus_per_node={ranks}"),
        format!("train.steps={steps}"),
        "train.checkpoint.every=2".to_string(),
        format!("train.checkpoint.dir=\"{}\"", dir.display()),
    ]) {
        args.push("--set".to_string());
        args.push(set);
    }
    args
}

fn parc(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_parc"))
        .args(args)
        .current_dir(root())
        .env_remove("OMPI_ALLOW_RUN_AS_ROOT")
        .env_remove("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
        .output()
        .unwrap()
}

fn run(extra: &[String]) -> Output {
    let mut args: Vec<String> = ["run", "examples/tiny.par", "--backend", "cpu"]
        .map(String::from)
        .to_vec();
    args.extend(["--log-format".into(), "json".into()]);
    args.extend(extra.iter().cloned());
    let out = parc(&args);
    assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    out
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn losses(output: &Output) -> Vec<f32> {
    text(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .map(|v| v["loss"].as_f64().unwrap() as f32)
        .collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (x, y) in got.iter().zip(want) {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "{what}: {got:?} vs {want:?}"
        );
    }
}

const FOUR: [&str; 2] = ["parallel.dp=2", "parallel.tp=2"];
const PP2: [&str; 1] = ["parallel.pp=2"];

#[test]
fn check_shows_the_moves_reshard_writes_a_checkpoint_of_the_new_plan_and_refusals_name_the_field() {
    let (a, full) = (temp_dir("a"), temp_dir("full"));
    run(&sets(&FOUR, 4, 2, &a));
    let uninterrupted = losses(&run(&sets(&FOUR, 4, 4, &full)));
    let check = |extra: &[&str], dir: &Path, format: &str| {
        let mut args: Vec<String> = ["check", "examples/tiny.par", "--format", format, "--resume"]
            .map(String::from)
            .to_vec();
        args.push(dir.display().to_string());
        args.extend(sets(extra, 2, 4, &temp_dir("unused")));
        parc(&args)
    };
    let shown = check(&PP2, &a, "human");
    let stdout = text(&shown.stdout);
    assert!(shown.status.success(), "{}", text(&shown.stderr));
    assert!(
        stdout.contains("re-sharded on load from 4 ranks to 2")
            && stdout.contains("rank 0: reads ")
            && stdout.contains("from 2 shard files (rank 0, rank 1)"),
        "{stdout}"
    );
    for (set, code, field) in [
        (
            "train.global_batch=4",
            "E1104",
            "train.global_batch changed",
        ),
        (
            "model.ffn=128",
            "E1101",
            "parameter blocks.0.mlp.fc is [256, 64]",
        ),
    ] {
        let refused = check(&[PP2[0], set], &a, "json");
        assert_eq!(refused.status.code(), Some(1), "{set}");
        // JSON keeps the message whole (the human report wraps it at the terminal's width).
        let doc: Value = serde_json::from_slice(&refused.stdout).unwrap();
        let file = &doc["files"][0];
        let diagnostic = file["diagnostics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["code"] == code)
            .unwrap_or_else(|| panic!("{set}: no {code} in {file}"));
        let message = diagnostic["message"].as_str().unwrap();
        assert!(message.contains(field), "{message}");
        assert!(file["resume"].is_null());
    }
    // Offline: the re-sharded checkpoint is the new plan's own.
    let out = temp_dir("out");
    let mut args: Vec<String> = vec!["reshard".into(), a.display().to_string()];
    args.extend(["examples/tiny.par".into(), out.display().to_string()]);
    args.extend(sets(&PP2, 2, 4, &temp_dir("unused")));
    let written = parc(&args);
    assert!(written.status.success(), "{}", text(&written.stderr));
    let again = parc(&args);
    assert!(
        text(&again.stderr).contains("exists"),
        "{}",
        text(&again.stderr)
    );
    let own = check(&PP2, &out, "human");
    assert!(
        text(&own.stdout).contains("written by this plan"),
        "{}",
        text(&own.stdout)
    );
    let resume = |from: &Path, dir: &str| {
        let mut args = sets(&PP2, 2, 4, &temp_dir(dir));
        args.extend(["--resume".into(), from.display().to_string()]);
        losses(&run(&args))
    };
    let offline = resume(&out, "b-offline");
    let online = resume(&a, "b-online");
    assert_eq!(offline, online, "offline vs on-load re-sharding");
    assert_close("resumed under pp 2", &online, &uninterrupted[2..]);
}

#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a parc built with --features mpi"
)]
fn four_ranks_resume_in_two_processes() {
    let on_path = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join("mpiexec").is_file()));
    if !on_path {
        eprintln!("skipped: mpiexec is not on PATH (install openmpi-bin)");
        return;
    }
    let (a, full) = (temp_dir("mpi-a"), temp_dir("mpi-full"));
    let mut first = sets(&FOUR, 4, 2, &a);
    first.extend(["--nproc-per-node".into(), "4".into()]);
    run(&first);
    let uninterrupted = losses(&run(&sets(&FOUR, 4, 4, &full)));
    for (parallel, to) in [(&PP2[..], "pp2"), (&["parallel.dp=2"][..], "dp2")] {
        let mut args = sets(parallel, 2, 4, &temp_dir(&format!("mpi-{to}")));
        args.extend(["--resume".into(), a.display().to_string()]);
        args.extend(["--nproc-per-node".into(), "2".into()]);
        assert_close(to, &losses(&run(&args)), &uninterrupted[2..]);
    }
}
