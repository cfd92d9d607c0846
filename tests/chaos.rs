//! Chaos tests (issue 23): a multi-process CPU run (`--nproc-per-node 4`, mpiexec + the MPI comm)
//! that loses a rank to `kill -9` in the middle of a step or of a save ends non-zero naming the
//! dead rank, leaves no half-written checkpoint that resume would choose, and resumes from its
//! last good one; a rank stopped by SIGSTOP is named by rank, instruction and spec line within
//! twice the comm timeout; a disk that fills during a save (a small tmpfs, or where mounting is
//! refused the checkpoint writer's fault hook) ends the run with an error naming the checkpoint
//! folder and "no space", nothing broken published; bit-flipped and truncated shards are refused
//! and the folder falls back to a checkpoint that verifies; a second run on the same checkpoint
//! folder is refused naming the holder, and a dead holder's lock is taken over; ranks that would
//! resume different checkpoints (or one of them none) are refused before the first step.
//! They need the `mpi` feature (without it they are ignored) and `mpiexec` on PATH (without it
//! they say they skip). The runs are serialised: 4 rank processes each on 2 cores.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[path = "launch_support/mod.rs"]
mod launch_support;
use launch_support::{
    assert_timeout_names_instruction_and_spec_line, mpi_missing, parc, stderr, tiny_run,
};

/// One multi-process run at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// The tiny example as a 4-rank plan (dp 2, tp 2) checkpointing every `every` steps into `dir`.
fn plan_args(steps: u64, every: u64, dir: &Path) -> Vec<String> {
    let sets = [
        "parallel.dp=2".to_string(),
        "parallel.tp=2".to_string(),
        format!("train.checkpoint.every={every}"),
        format!("train.checkpoint.dir=\"{}\"", dir.display()),
    ];
    let mut args = tiny_run(steps, &sets);
    args.extend(["--log-format".into(), "json".into()]);
    args
}

fn multi(mut args: Vec<String>) -> Vec<String> {
    args.extend(["--nproc-per-node".into(), "4".into()]);
    args
}

fn run(args: &[String], env: &[(&str, String)]) -> Output {
    parc(args, env).output().unwrap()
}

/// The step numbers of the JSON step lines.
fn steps(output: &Output) -> Vec<u64> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .map(|v| v["step"].as_u64().unwrap())
        .collect()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("parc-chaos-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The finished checkpoints (`step-N` with a manifest) in `dir`, oldest first.
fn finished(dir: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter(|e| e.path().join("manifest.json").is_file())
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    name.strip_prefix("step-")?.parse().ok()
                })
                .collect()
        })
        .unwrap_or_default();
    steps.sort_unstable();
    steps
}

fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:08}"))
}

fn shard(dir: &Path, step: u64, rank: u32) -> PathBuf {
    step_dir(dir, step).join(format!("rank-{rank:05}.safetensors"))
}

/// A killed job's other processes can outlive mpiexec for a moment, holding `dir`'s lock (a
/// resume then is refused, rightly): wait up to 10 s for the holder to exit.
fn wait_for_the_lock_holder(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let Ok(lock) = std::fs::read_to_string(dir.join("parc.lock")) else {
            return;
        };
        let holder: Value = serde_json::from_str(&lock).unwrap_or_default();
        let Some(pid) = holder["pid"].as_u64() else {
            return;
        };
        if !parc_runtime::checkpoint::lock::process_runs(pid as u32) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Resume from the folder `from` for two more checkpoint periods; the run must succeed and
/// start right after `from`'s newest finished checkpoint, `expect`.
fn resume_continues(dir: &Path, from: &Path, expect: u64, every: u64) {
    wait_for_the_lock_holder(dir);
    let mut args = multi(plan_args(expect + 2 * every, every, dir));
    args.extend(["--resume".into(), from.display().to_string()]);
    let resumed = run(&args, &[]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let ran = steps(&resumed);
    assert_eq!(ran.first(), Some(&(expect + 1)), "{}", stderr(&resumed));
    assert_eq!(ran.last(), Some(&(expect + 2 * every)));
}

#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a parc built with --features mpi"
)]
fn a_rank_killed_mid_step_or_mid_save_is_named_and_the_run_resumes_from_its_last_good_checkpoint() {
    if let Some(why) = mpi_missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("kill");
    // kill -9 of rank 2 while it trains (steps take ~25 ms, saves of 5 MB are rare); 3 s in, so
    // that a loaded machine has still written a checkpoint to resume from (at 1.5 s one with a
    // load of 13 on 2 cores had not).
    let args = multi(plan_args(100_000, 8, &dir));
    let killed = run(&args, &[("PARC_TEST_FAULT", "kill:2@3000".into())]);
    let err = stderr(&killed);
    assert!(!killed.status.success(), "{err}");
    assert!(err.contains("error: rank 2 failed"), "{err}");
    let good = finished(&dir);
    let last = *good
        .last()
        .unwrap_or_else(|| panic!("no checkpoint in {dir:?}: {err}"));
    assert!(good.iter().all(|&s| s % 8 == 0), "{good:?}");

    // kill -9 of rank 2 in the middle of writing its shard of the second save from here: the
    // first is whole, the second stays unpublished.
    let size = std::fs::metadata(shard(&dir, last, 2)).unwrap().len();
    let mut args = multi(plan_args(last + 16, 8, &dir));
    args.extend(["--resume".into(), dir.display().to_string()]);
    let fault = format!("{}:kill@2", size + size / 2);
    let killed = run(&args, &[("PARC_FAULT_WRITE_AFTER_BYTES", fault)]);
    let err = stderr(&killed);
    assert!(!killed.status.success(), "{err}");
    assert!(err.contains("error: rank 2 failed"), "{err}");
    // It died in that save: the unfinished checkpoint is there, unpublished.
    let unfinished = dir.join(format!(".step-{:08}.tmp", last + 16));
    assert!(unfinished.is_dir(), "{err}");
    assert!(!step_dir(&dir, last + 16).exists());
    assert_eq!(finished(&dir).last(), Some(&(last + 8)), "{err}");
    resume_continues(&dir, &dir, last + 8, 8);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a parc built with --features mpi"
)]
fn a_stopped_rank_is_named_with_instruction_and_spec_line_within_twice_the_comm_timeout() {
    if let Some(why) = mpi_missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("stop");
    let mut args = multi(plan_args(100_000, 100_000, &dir));
    args.extend(["--comm-timeout".into(), "3".into()]);
    let mut child = parc(&args, &[("PARC_TEST_FAULT", "stop:2@1500".into())])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Each stderr line with the time it arrived.
    let lines: Vec<(Instant, String)> = BufReader::new(child.stderr.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .map(|line| (Instant::now(), line))
        .collect();
    let status = child.wait().unwrap();
    let err: String = lines.iter().map(|(_, l)| format!("{l}\n")).collect();
    assert!(!status.success(), "{err}");
    let at = |pattern: &dyn Fn(&str) -> bool| {
        lines
            .iter()
            .find(|(_, l)| pattern(l))
            .unwrap_or_else(|| panic!("no such line in:\n{err}"))
            .clone()
    };
    let (stopped, _) = at(&|l| l.contains("PARC_TEST_FAULT: rank 2 stops now"));
    let (named, timed_out) =
        at(&|l| l.contains(" waited 3.0 s in ") && l.contains("ranks [2] never"));
    let took = named - stopped;
    assert!(
        took <= Duration::from_secs(6),
        "named after {took:?}:\n{err}"
    );
    assert_timeout_names_instruction_and_spec_line(&err, &timed_out);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tmpfs of `bytes` mounted on a fresh folder, unmounted when dropped; None where mounting is
/// refused (not root, or a container without the capability).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(name: &str, bytes: u64) -> Option<Tmpfs> {
        let dir = temp_dir(name);
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            let _ = std::fs::remove_dir(&dir);
        }
        mounted.then_some(Tmpfs(dir))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Space a file of `len` bytes takes on a tmpfs (whole pages).
fn pages(len: u64) -> u64 {
    len.div_ceil(4096) * 4096
}

#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a parc built with --features mpi"
)]
fn a_disk_that_fills_during_a_save_ends_the_run_naming_the_folder_and_no_space() {
    if let Some(why) = mpi_missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The size of one checkpoint of this plan, from a one-process run.
    let probe = temp_dir("probe");
    let output = run(&plan_args(2, 2, &probe), &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    let files: Vec<u64> = std::fs::read_dir(step_dir(&probe, 2))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .collect();
    let largest_shard = *files.iter().max().unwrap();
    let checkpoint: u64 = files.iter().map(|&len| pages(len)).sum();
    std::fs::remove_dir_all(&probe).unwrap();

    // Room for one checkpoint and the lock, not for two.
    let tmpfs = Tmpfs::mount("tmpfs", checkpoint + checkpoint / 2 + 4 * 4096);
    let (dir, env) = match &tmpfs {
        Some(fs) => (fs.0.join("ckpt"), vec![]),
        None => {
            eprintln!(
                "note: mounting a tmpfs was refused; the disk fills through \
                 PARC_FAULT_WRITE_AFTER_BYTES instead"
            );
            let after = largest_shard + largest_shard / 2;
            (
                temp_dir("full"),
                vec![("PARC_FAULT_WRITE_AFTER_BYTES", after.to_string())],
            )
        }
    };
    let output = run(&multi(plan_args(4, 2, &dir)), &env);
    let err = stderr(&output);
    assert!(!output.status.success(), "{err}");
    // parc's launcher reports last; mpiexec may print its own trailer after it.
    let last = err
        .lines()
        .rfind(|l| !l.starts_with("[mpiexec]"))
        .unwrap_or_default();
    assert!(
        last.starts_with("error: rank ")
            && last.contains(&format!("{}/.step-00000004.tmp/", dir.display()))
            && last.contains("no space left"),
        "{err}"
    );
    assert_eq!(finished(&dir), vec![2], "{err}");
    // The checkpoint that fit resumes, saving elsewhere.
    let elsewhere = temp_dir("elsewhere");
    resume_continues(&elsewhere, &step_dir(&dir, 2), 2, 2);
    drop(tmpfs);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::remove_dir_all(&elsewhere).unwrap();
}

#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a parc built with --features mpi"
)]
fn ranks_that_resume_different_checkpoints_are_refused_before_the_first_step() {
    if let Some(why) = mpi_missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("disagree");
    let output = run(&multi(plan_args(4, 2, &dir)), &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    // mpiexec's MPMD form: ranks 0-2 resume step 4, rank 3 step 2 (as a host whose folder
    // holds other checkpoints would); then ranks 0-2 resume and rank 3 starts fresh.
    let out = temp_dir("disagree-out");
    let rank_args = |resume: Option<&Path>| {
        let mut args = plan_args(6, 2, &out);
        if let Some(from) = resume {
            args.extend(["--resume".into(), from.display().to_string()]);
        }
        args
    };
    for (last, named) in [
        (
            Some(step_dir(&dir, 2)),
            "rank 3 resumes the checkpoint of step 2 but rank 0 resumes the checkpoint of step 4",
        ),
        (
            None,
            "rank 3 starts fresh (no --resume) but rank 0 resumes the checkpoint of step 4",
        ),
    ] {
        let mut mpiexec = Command::new("mpiexec");
        mpiexec
            .args(["--oversubscribe", "--bind-to", "none", "-n", "3"])
            .arg(env!("CARGO_BIN_EXE_parc"))
            .args(rank_args(Some(&step_dir(&dir, 4))))
            .args([":", "-n", "1"])
            .arg(env!("CARGO_BIN_EXE_parc"))
            .args(rank_args(last.as_deref()))
            .current_dir(launch_support::root())
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env_remove("PARC_TEST_FAULT")
            .env_remove("PARC_FAULT_WRITE_AFTER_BYTES");
        let refused = mpiexec.output().unwrap();
        let err = stderr(&refused);
        assert!(!refused.status.success(), "{err}");
        assert!(err.contains(named), "{err}");
        // Refused before any step: nothing trained, nothing saved.
        assert!(steps(&refused).is_empty(), "{err}");
        assert!(finished(&out).is_empty(), "{err}");
        wait_for_the_lock_holder(&out);
    }
    std::fs::remove_dir_all(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&out);
}

/// Flip one bit in the middle of the largest tensor of `shard`.
fn flip_bit(shard: &Path) {
    let mut bytes = std::fs::read(shard).unwrap();
    let (header_len, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let (_, info) = metadata
        .tensors()
        .into_iter()
        .max_by_key(|(_, info)| info.data_offsets.1 - info.data_offsets.0)
        .unwrap();
    let middle = 8 + header_len + (info.data_offsets.0 + info.data_offsets.1) / 2;
    bytes[middle] ^= 0x04;
    std::fs::write(shard, bytes).unwrap();
}

#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a parc built with --features mpi"
)]
fn corrupt_shards_are_refused_by_a_multi_process_resume_which_falls_back_to_one_that_verifies() {
    if let Some(why) = mpi_missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("corrupt");
    let output = run(&multi(plan_args(4, 2, &dir)), &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    flip_bit(&shard(&dir, 4, 3));
    let resume = |from: &Path| {
        let mut args = multi(plan_args(6, 2, &temp_dir("corrupt-out")));
        args.extend(["--resume".into(), from.display().to_string()]);
        run(&args, &[])
    };
    let refused = resume(&step_dir(&dir, 4));
    let err = stderr(&refused);
    assert!(!refused.status.success(), "{err}");
    assert!(
        err.contains("step-00000004/rank-00003.safetensors") && err.contains("fails its checksum"),
        "{err}"
    );
    let fell_back = resume(&dir);
    let err = stderr(&fell_back);
    assert!(fell_back.status.success(), "{err}");
    assert!(err.contains("warning: skipping checkpoint"), "{err}");
    assert_eq!(steps(&fell_back).first(), Some(&3), "{err}");
    // A shard cut short.
    let cut = shard(&dir, 2, 1);
    let bytes = std::fs::read(&cut).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let refused = resume(&step_dir(&dir, 2));
    let err = stderr(&refused);
    assert!(!refused.status.success(), "{err}");
    assert!(
        err.contains("step-00000002/rank-00001.safetensors") && err.contains("truncated"),
        "{err}"
    );
    let nothing = resume(&dir);
    assert!(!nothing.status.success());
    assert!(
        stderr(&nothing).contains("no checkpoint in this folder verifies"),
        "{}",
        stderr(&nothing)
    );
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(temp_dir("corrupt-out")).ok();
}

#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a parc built with --features mpi"
)]
fn a_second_multi_process_run_on_the_same_folder_is_refused_naming_the_holder() {
    if let Some(why) = mpi_missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("lock");
    let mut first = parc(&multi(plan_args(100_000, 50, &dir)), &[])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lock = dir.join("parc.lock");
    let started = Instant::now();
    while !lock.is_file()
        || std::fs::read_to_string(&lock)
            .unwrap_or_default()
            .is_empty()
    {
        assert!(started.elapsed() < Duration::from_secs(30), "no lock");
        std::thread::sleep(Duration::from_millis(20));
    }
    let holder: Value = serde_json::from_str(&std::fs::read_to_string(&lock).unwrap()).unwrap();
    let second = run(&multi(plan_args(4, 2, &dir)), &[]);
    let err = stderr(&second);
    assert!(!second.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "another run is using this checkpoint folder (host {}, pid {})",
            holder["host"].as_str().unwrap(),
            holder["pid"]
        )),
        "{err}"
    );
    // kill -9 of the holder (the rank process that took the lock): its lock stays behind,
    // recognised as dead, and the next run takes the folder over.
    let pid = holder["pid"].as_u64().unwrap();
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(!first.wait().unwrap().success());
    assert!(lock.is_file());
    let third = run(&multi(plan_args(4, 2, &dir)), &[]);
    assert!(third.status.success(), "{}", stderr(&third));
    assert!(!lock.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
