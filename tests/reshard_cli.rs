//! Re-sharding through the binary on the tiny example: `parc check --resume` shows what each
//! rank of the new plan reads (and refuses another global batch or model with E1104 / E1101
//! before anything runs); `parc reshard` writes a checkpoint that `parc run --resume` of the new
//! plan loads as its own (no re-sharding), continuing to the losses of the run resumed with
//! re-sharding on load; with the `mpi` feature, a 4-rank checkpoint resumes in 2 processes
//! (`--nproc-per-node 2`) to the losses of the uninterrupted 4-rank run. Other training data
//! (another size, other bytes, fewer samples) is refused by check, run and reshard alike with
//! E1107 unless `--resume-any-data` consents; reshard takes `--resume-any-batch` as run does.
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

/// The first `bytes` bytes of the tiny example's text, with `edit` applied, as `dir/name`.
fn text_file(dir: &Path, name: &str, bytes: usize, edit: fn(&mut [u8])) -> PathBuf {
    let all = std::fs::read(root().join("examples/data/tiny-shakespeare.txt")).unwrap();
    let mut text = all[..bytes].to_vec();
    edit(&mut text);
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn on(data: &Path) -> String {
    format!("train.data=\"{}\" as bytes", data.display())
}

/// `parc check --resume` (JSON) of the tiny example with `extra` flags: the document's file.
fn check_resume(from: &Path, sets: &[String], extra: &[&str]) -> (Option<i32>, Value) {
    let mut args: Vec<String> = ["check", "examples/tiny.par", "--format", "json", "--resume"]
        .map(String::from)
        .to_vec();
    args.push(from.display().to_string());
    args.extend(sets.iter().cloned());
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = parc(&args);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    (out.status.code(), doc["files"][0].clone())
}

/// The message of `file`'s diagnostic `code`, if it has one.
fn diagnostic(file: &Value, code: &str) -> Option<String> {
    file["diagnostics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["code"] == code)
        .map(|d| format!("{} / {}", d["message"], d["help"]))
}

#[test]
fn other_data_is_refused_by_check_run_and_reshard_unless_consented() {
    let dir = temp_dir("data");
    let a = text_file(&dir, "a.txt", 20_000, |_| {});
    let moved = text_file(&dir.join("elsewhere"), "renamed.txt", 20_000, |_| {});
    let longer = text_file(&dir, "longer.txt", 30_000, |_| {});
    let edited = text_file(&dir, "edited.txt", 20_000, |t| t.make_ascii_uppercase());
    let ckpt = dir.join("ckpt");
    let with = |data: &Path, extra: &[&str]| {
        let mut args = sets(&[&on(data)], 1, 4, &ckpt);
        for set in extra {
            args.extend(["--set".to_string(), set.to_string()]);
        }
        args
    };
    let mut first = with(&a, &[]);
    first.extend(["--set".into(), "train.steps=2".into()]);
    run(&first);
    let step2 = ckpt.join("step-00000002");

    let (code, file) = check_resume(&step2, &with(&moved, &[]), &[]);
    assert_eq!(
        code,
        Some(0),
        "the same bytes elsewhere are the same data: {file}"
    );
    for (data, extra, what) in [
        (&longer, &[][..], "has 30000 bytes"),
        (&edited, &[][..], "holds other bytes"),
        // The held-out evaluation tail leaves fewer samples to train on.
        (&a, &["train.eval.every=2"][..], "drew from 312 samples"),
    ] {
        let (code, file) = check_resume(&step2, &with(data, extra), &[]);
        let message = diagnostic(&file, "E1107").unwrap_or_else(|| panic!("{what}: {file}"));
        assert_eq!(code, Some(1));
        assert!(
            message.contains(what) && message.contains("--resume-any-data"),
            "{message}"
        );
        let (code, file) = check_resume(&step2, &with(data, extra), &["--resume-any-data"]);
        assert_eq!(code, Some(0), "{file}");
        assert!(file["resume"]["data_change"]
            .as_str()
            .unwrap()
            .contains(what));
    }

    // `parc run --resume` applies the same rule.
    let mut resumed = with(&longer, &[]);
    resumed.extend(["--resume".into(), step2.display().to_string()]);
    let mut args: Vec<String> = ["run", "examples/tiny.par", "--backend", "cpu"]
        .map(String::from)
        .to_vec();
    args.extend(resumed.iter().cloned());
    let refused = parc(&args);
    let stderr = text(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("E1107") && stderr.contains("has 30000 bytes"),
        "{stderr}"
    );
    resumed.push("--resume-any-data".into());
    let consented = run(&resumed);
    assert_eq!(losses(&consented).len(), 2);
    let stderr = text(&consented.stderr);
    assert!(stderr.contains("note: --resume-any-data"), "{stderr}");
    // Its own checkpoint records the new data: resuming it needs no consent.
    let (code, file) = check_resume(&ckpt.join("step-00000004"), &with(&longer, &[]), &[]);
    assert_eq!(code, Some(0), "{file}");

    // `parc reshard` too, with both consents.
    let reshard = |out: &str, extra: &[&str]| {
        let mut args: Vec<String> = vec!["reshard".into(), step2.display().to_string()];
        args.extend([
            "examples/tiny.par".into(),
            dir.join(out).display().to_string(),
        ]);
        args.extend(with(&longer, &["train.global_batch=4"]));
        args.extend(extra.iter().map(|s| s.to_string()));
        parc(&args)
    };
    let batch = reshard("r1", &["--resume-any-data"]);
    let stderr = text(&batch.stderr);
    assert!(
        stderr.contains("E1104") && stderr.contains("--resume-any-batch"),
        "{stderr}"
    );
    let data = reshard("r2", &["--resume-any-batch"]);
    let stderr = text(&data.stderr);
    assert!(stderr.contains("E1107"), "{stderr}");
    let both = reshard("r3", &["--resume-any-batch", "--resume-any-data"]);
    let stderr = text(&both.stderr);
    assert!(both.status.success(), "{stderr}");
    assert!(stderr.contains("--resume-any-data as well"), "{stderr}");
    let mut resumed = with(&longer, &["train.global_batch=4"]);
    resumed.extend(["--resume".into(), dir.join("r3").display().to_string()]);
    resumed.push("--resume-any-data".into());
    assert_eq!(losses(&run(&resumed)).len(), 2);
}
