//! Asynchronous checkpoint saves (issue 23): a run whose saves are written in the background
//! while it trains resumes bit-exactly and trains as a synchronous one does; a run killed while
//! a save is unfinished leaves no checkpoint that `--resume` picks (the next run removes the
//! unfinished one, saying so); a save that cannot be written ends the run with a non-zero exit,
//! naming the checkpoint and the cause, and publishes nothing. The writer's test hook
//! (`PARC_TEST_CHECKPOINT_STALL`) holds a save open long enough to act while it is in flight.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli_support;

use cli_support::{json_lines, stderr_of, steps};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const STALL: &str = "PARC_TEST_CHECKPOINT_STALL";

fn temp_dir(name: &str) -> PathBuf {
    cli_support::temp_dir("async-save", name)
}

/// `parc run` of a shrunk tiny example on dp 2: 8 steps, a checkpoint every 2 into `ckpt`,
/// JSON lines, and `extra` arguments.
fn run_args(ckpt: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["run", "examples/tiny.par", "--log-format", "json"]
        .map(String::from)
        .to_vec();
    for set in [
        "model.seq=16".to_string(),
        "model.d=32".to_string(),
        "model.ffn=64".to_string(),
        "parallel.dp=2".to_string(),
        "cluster.gpus_per_node=2".to_string(),
        "train.micro_batch=1".to_string(),
        "train.global_batch=4".to_string(),
        "train.steps=8".to_string(),
        "train.checkpoint.every=2".to_string(),
        format!("train.checkpoint.dir=\"{}\"", ckpt.display()),
    ] {
        args.extend(["--set".to_string(), set]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn command(args: &[String], stall: Option<&str>) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_parc"));
    command.args(args).current_dir(cli_support::root());
    match stall {
        Some(stall) => command.env(STALL, stall),
        None => command.env_remove(STALL),
    };
    command
}

fn run_ok(args: &[String], stall: Option<&str>) -> Output {
    let out = command(args, stall).output().unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    out
}

/// The loss bits of each step line, by step.
fn losses(out: &Output) -> Vec<(u64, u32)> {
    steps(&json_lines(out))
        .iter()
        .map(|v| {
            let loss = v["loss"].as_f64().unwrap() as f32;
            (v["step"].as_u64().unwrap(), loss.to_bits())
        })
        .collect()
}

/// Every tensor of `ckpt`'s model.safetensors, by name, as bytes.
fn model_tensors(ckpt: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(ckpt.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.data().to_vec()))
        .collect();
    tensors.sort();
    tensors
}

/// Spawn a run and wait until every path of `ready` exists (at most a minute).
fn spawn_until(args: &[String], stall: &str, ready: &[PathBuf]) -> Child {
    let mut child = command(args, Some(stall))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !ready.iter().all(|p| p.exists()) {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before {ready:?} appeared");
        }
        assert!(started.elapsed() < Duration::from_secs(60), "{ready:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn an_async_save_resumes_bit_exactly_and_a_killed_save_is_never_chosen() {
    let full_dir = temp_dir("full");
    // Each save is held open a while, so steps run while it is written.
    let full = run_ok(&run_args(&full_dir, &[]), Some("*:150"));
    let lines = json_lines(&full);
    assert!(
        steps(&lines).iter().any(|v| v["saving"] == true),
        "no step overlapped a save"
    );
    assert!(steps(&lines)
        .iter()
        .all(|v| (v["step"].as_u64().unwrap() % 2 == 0) == v["save_s"].is_number()));
    let summary = lines.iter().find(|v| v["event"] == "summary").unwrap();
    let listed: Vec<&str> = summary["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(listed.len(), 4, "{listed:?}");
    assert!(listed
        .iter()
        .all(|p| Path::new(p).join("manifest.json").is_file()));

    // Synchronous saves train exactly as asynchronous ones do.
    let sync_dir = temp_dir("sync");
    let sync = run_ok(
        &run_args(&sync_dir, &["--set", "train.checkpoint.async=false"]),
        None,
    );
    assert_eq!(losses(&sync), losses(&full));
    assert_eq!(model_tensors(&sync_dir), model_tensors(&full_dir));

    // Killed while the save of step 4 is unfinished (step 2's is committed).
    let dir = temp_dir("killed");
    let args = run_args(&dir, &[]);
    let unfinished = dir.join(".step-00000004.tmp");
    let ready = [
        dir.join("step-00000002").join("manifest.json"),
        unfinished.clone(),
    ];
    let mut child = spawn_until(&args, "4:60000", &ready);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!dir.join("step-00000004").exists());

    let mut resume = args.clone();
    resume.extend(["--resume".to_string(), dir.display().to_string()]);
    let resumed = run_ok(&resume, None);
    let stderr = stderr_of(&resumed);
    assert!(
        stderr.contains(&format!("removed {}", unfinished.display())),
        "{stderr}"
    );
    assert!(!unfinished.exists());
    let full_losses = losses(&full);
    assert_eq!(losses(&resumed), full_losses[2..]);
    assert_eq!(model_tensors(&dir), model_tensors(&full_dir));
}

#[test]
fn a_save_that_cannot_be_written_ends_the_run_naming_the_checkpoint_and_the_cause() {
    let dir = temp_dir("blocked");
    let staging = dir.join(".step-00000004.tmp");
    let args = run_args(&dir, &[]);
    let child = spawn_until(&args, "4:2000", std::slice::from_ref(&staging));
    // A file in the way of the shards, while the writers wait to write them.
    std::fs::remove_dir_all(&staging).unwrap();
    std::fs::write(&staging, b"in the way").unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = stderr_of(&out);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{} was not saved",
            dir.join("step-00000004").display()
        )) && stderr.contains("Not a directory"),
        "{stderr}"
    );
    assert!(!dir.join("step-00000004").exists());
    assert!(dir.join("step-00000002").join("manifest.json").is_file());
}
