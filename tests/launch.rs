//! Multi-process `parc run` through the binary: a 4-process CPU run started by
//! `--nproc-per-node 4` (mpiexec + the MPI comm) gives exactly the single-process losses,
//! validation losses, checkpoints and exported parameters, and resumes bit-identically; a rank
//! that crashes ends the job with its error, quickly; a rank that hangs makes its peers'
//! collective time out naming the waiting rank, the missing peer, the instruction and the spec
//! line; a rendezvous missing a rank names it; a world size other than the mesh's is refused
//! before any communication, with both numbers; ranks whose settings differ (another seed or
//! learning rate: not in the plan) are refused at the rendezvous naming the setting, and so
//! are ranks started with other training flags (`--resume-any-batch`, `--fusion`), naming the
//! flag; the spec's warnings are shown by rank 0 alone; a leftover `RANK` beside mpirun's
//! variables, and a Slurm batch script of several tasks (not started by srun), are refused at
//! once; the MPI comm itself checks collective order, names missing peers and hears aborts.
//! The MPI tests need the `mpi` feature (without it they are ignored) and `mpiexec` on PATH
//! (without it they say they skip). The 4-process run's `--metrics` are written by its report
//! rank alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use serde_json::Value;
use std::path::PathBuf;
use std::process::Output;
use std::time::{Duration, Instant};

#[path = "launch_support/mod.rs"]
mod launch_support;
use launch_support::{
    assert_timeout_names_instruction_and_spec_line, mpi_missing, parc, stderr, tiny_run,
};

/// The tiny example as a 4-rank plan (dp = 2, tp = 2), small and short.
fn plan_args(steps: u32) -> Vec<String> {
    plan_args_with(steps, &["parallel.dp=2", "parallel.tp=2"])
}

/// The tiny example as a small, short plan with `parallel` settings.
fn plan_args_with(steps: u32, parallel: &[&str]) -> Vec<String> {
    let parallel: Vec<String> = parallel.iter().map(|s| s.to_string()).collect();
    tiny_run(steps.into(), &parallel)
}

/// Rank `rank` of `world` started with torchrun-style variables, rendezvous on 127.0.0.1:`port`,
/// its stderr piped.
fn torchrun_rank(args: &[String], rank: u32, world: u32, port: &str) -> std::process::Child {
    parc(
        args,
        &[
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.to_string()),
        ],
    )
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap()
}

fn losses(output: &Output) -> Vec<u32> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .map(|v| (v["loss"].as_f64().unwrap() as f32).to_bits())
        .collect()
}

/// The validation losses of the JSON step lines (f32 bits; None where the step did not
/// evaluate).
fn val_losses(output: &Output) -> Vec<Option<u32>> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .map(|v| v["val_loss"].as_f64().map(|x| (x as f32).to_bits()))
        .collect()
}

/// A fresh folder under the system's temp dir.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("parc-launch-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn free_port() -> u16 {
    parc_runtime::launch::free_port().unwrap()
}

#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a parc built with --features mpi"
)]
fn four_processes_give_exactly_the_single_process_losses() {
    if let Some(why) = mpi_missing() {
        eprintln!("skipped: {why}");
        return;
    }
    // Tensor and data parallelism (all-reduce); pipeline stages with ZeRO-3 (grouped
    // send/receive, reduce-scatter, all-gather), whose report rank is not rank 0.
    for parallel in [
        &["parallel.dp=2", "parallel.tp=2"][..],
        &["parallel.dp=2", "parallel.pp=2", "parallel.zero=3"][..],
    ] {
        let mut args = plan_args_with(3, parallel);
        args.extend(["--log-format".into(), "json".into(), "--profile".into()]);
        args.extend(["--set".into(), "train.checkpoint.every=2".into()]);
        // Evaluated after steps 2 and 3 on the held-out tail, by every rank.
        args.extend(["--set".into(), "train.eval={every: 2, batches: 2}".into()]);
        let ckpt = |dir: &PathBuf| {
            vec![
                "--set".into(),
                format!("train.checkpoint.dir=\"{}\"", dir.display()),
            ]
        };
        let (one_dir, four_dir) = (temp_dir("one"), temp_dir("four"));
        let single = parc(&[args.clone(), ckpt(&one_dir)].concat(), &[])
            .output()
            .unwrap();
        assert!(single.status.success(), "{}", stderr(&single));
        args.extend(["--nproc-per-node".into(), "4".into()]);
        let metrics = four_dir.join("metrics");
        let metrics_arg = vec!["--metrics".into(), metrics.display().to_string()];
        let multi = parc(&[args.clone(), ckpt(&four_dir), metrics_arg].concat(), &[])
            .output()
            .unwrap();
        assert!(multi.status.success(), "{parallel:?}: {}", stderr(&multi));
        // Three steps end inside the example's warmup: the launcher shows W0901, no rank again.
        let warned = stderr(&multi).matches("W0901").count();
        assert_eq!(warned, 1, "{parallel:?}: {}", stderr(&multi));
        // Only the report rank writes metrics: one event file, one row per step.
        let names: Vec<String> = std::fs::read_dir(&metrics)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let events = names
            .iter()
            .filter(|n| n.starts_with("events.out.tfevents."));
        assert_eq!(events.count(), 1, "{parallel:?}: {names:?}");
        let csv = std::fs::read_to_string(metrics.join("metrics.csv")).unwrap();
        let csv_losses: Vec<u32> = csv
            .lines()
            .skip(1)
            .map(|l| {
                l.split(',')
                    .nth(1)
                    .unwrap()
                    .parse::<f32>()
                    .unwrap()
                    .to_bits()
            })
            .collect();
        assert_eq!(csv_losses, losses(&multi), "{parallel:?}: metrics.csv");
        // Resuming the 4-process run from its step-2 checkpoint continues bit-identically.
        let resume = vec![
            "--resume".into(),
            four_dir.join("step-00000002").display().to_string(),
        ];
        let resumed = parc(&[args, ckpt(&four_dir), resume].concat(), &[])
            .output()
            .unwrap();
        assert!(
            resumed.status.success(),
            "{parallel:?}: {}",
            stderr(&resumed)
        );
        assert_eq!(
            losses(&resumed),
            losses(&multi)[2..],
            "{parallel:?}: resumed"
        );
        assert_eq!(
            val_losses(&resumed),
            val_losses(&multi)[2..],
            "{parallel:?}: resumed validation"
        );
        // The same checkpoint shards and final parameters, bit for bit (the tensors: the model
        // file's metadata records each run's own `--set`s).
        for file in ["model.safetensors", "step-00000002/rank-00003.safetensors"] {
            assert!(
                tensors(&one_dir.join(file)) == tensors(&four_dir.join(file)),
                "{parallel:?}: {file} differs"
            );
        }
        for dir in [one_dir, four_dir] {
            std::fs::remove_dir_all(dir).unwrap();
        }
        let (one, four) = (losses(&single), losses(&multi));
        assert_eq!(one.len(), 3);
        assert_eq!(
            one, four,
            "{parallel:?}: losses (f32 bits) of 1 process vs 4 processes"
        );
        let evaluated = val_losses(&single);
        assert!(
            evaluated[0].is_none() && evaluated[1].is_some() && evaluated[2].is_some(),
            "{parallel:?}: {evaluated:?}"
        );
        assert_eq!(
            evaluated,
            val_losses(&multi),
            "{parallel:?}: validation losses of 1 process vs 4 processes"
        );
        // Only the report rank prints its profiled step and the summary, once each.
        for event in ["\"profile\"", "\"summary\""] {
            let lines = String::from_utf8_lossy(&multi.stdout)
                .lines()
                .filter(|l| l.contains(event))
                .count();
            assert_eq!(lines, 1, "{parallel:?}: {event} lines");
        }
        // The most memory one rank held: the same whether the ranks are threads or processes.
        let reserved = |output: &std::process::Output| {
            let text = String::from_utf8_lossy(&output.stdout).into_owned();
            let line = text.lines().find(|l| l.contains("\"summary\"")).unwrap();
            let summary: serde_json::Value = serde_json::from_str(line).unwrap();
            summary["memory_reserved_bytes"].as_u64()
        };
        let held = reserved(&multi);
        assert!(held.is_some_and(|b| b > 0), "{parallel:?}: {held:?}");
        assert_eq!(held, reserved(&single), "{parallel:?}: memory held");
    }
}

#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a parc built with --features mpi"
)]
fn a_crashed_rank_ends_the_job_with_its_error() {
    if let Some(why) = mpi_missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let mut args = plan_args(1000);
    args.extend(["--nproc-per-node".into(), "4".into()]);
    let started = Instant::now();
    let output = parc(&args, &[("PARC_TEST_FAULT", "abort:2@1500".into())])
        .output()
        .unwrap();
    let err = stderr(&output);
    assert!(!output.status.success(), "{err}");
    assert!(
        err.contains("error: rank 2 failed") && err.contains("its process died"),
        "{err}"
    );
    // The others stop at once (the rendezvous tells them), long before the comm timeout.
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a parc built with --features mpi"
)]
fn a_hung_rank_times_out_its_peers_naming_the_instruction_and_spec_line() {
    if let Some(why) = mpi_missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let mut args = plan_args(1000);
    args.extend([
        "--nproc-per-node".into(),
        "4".into(),
        "--comm-timeout".into(),
        "6".into(),
    ]);
    // The timeout leaves a wide margin over a step's slowest wait on a loaded 2-core machine,
    // so only the stopped rank can exceed it.
    let started = Instant::now();
    let output = parc(&args, &[("PARC_TEST_FAULT", "stop:2@1500".into())])
        .output()
        .unwrap();
    let err = stderr(&output);
    assert!(!output.status.success(), "{err}");
    // Where rank 2 stopped decides which peer times out first, in which collective and layer.
    let timed_out = err
        .lines()
        .find(|l| l.contains(" waited 6.0 s in ") && l.contains("ranks [2] never"))
        .unwrap_or_else(|| panic!("no timeout naming rank 2 in:\n{err}"));
    assert_timeout_names_instruction_and_spec_line(&err, timed_out);
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn a_rendezvous_missing_a_rank_names_it() {
    // Ranks 0-2 of 4 start with torchrun-style variables; rank 3 never does.
    let port = free_port().to_string();
    let mut args = plan_args(2);
    args.extend(["--rendezvous-timeout".into(), "3".into()]);
    let started = Instant::now();
    let children: Vec<_> = (0..3)
        .map(|rank| torchrun_rank(&args, rank, 4, &port))
        .collect();
    for child in children {
        let output = child.wait_with_output().unwrap();
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{err}");
        assert!(err.contains("ranks [3] never came within 3.0 s"), "{err}");
    }
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn ranks_with_another_seed_or_learning_rate_are_refused_naming_the_setting() {
    // The plan is the same (the seed and the learning rate are not in it), so only the
    // settings tell: rank 2 would start from other weights, and its replicas drift apart.
    for (set, named) in [
        ("train.seed=7", "train.seed = 7 (rank 0: 0)"),
        (
            "train.optimizer.lr=0.5",
            "train.optimizer.lr = 0.5 (rank 0: 0.001)",
        ),
    ] {
        let port = free_port().to_string();
        let children: Vec<_> = (0..4)
            .map(|rank| {
                let mut args = plan_args(2);
                if rank == 2 {
                    args.extend(["--set".into(), set.into()]);
                }
                args.extend(["--rendezvous-timeout".into(), "20".into()]);
                torchrun_rank(&args, rank, 4, &port)
            })
            .collect();
        for child in children {
            let output = child.wait_with_output().unwrap();
            let err = stderr(&output);
            assert_eq!(output.status.code(), Some(1), "{err}");
            assert!(
                err.contains("rank 2 (host ") && err.contains(named),
                "{set}: {err}"
            );
        }
    }
}

#[test]
fn ranks_started_with_other_training_flags_are_refused_naming_the_flag() {
    // Outside the spec and, for the consent, outside the plan: a rank without it would refuse
    // the checkpoint the others continue; another --fusion runs other kernels.
    for (flag, named) in [
        (
            &["--resume-any-batch"][..],
            "--resume-any-batch = given (rank 0: not given)",
        ),
        (&["--fusion", "off"][..], "--fusion = off (rank 0: on)"),
    ] {
        let port = free_port().to_string();
        let children: Vec<_> = (0..4)
            .map(|rank| {
                let mut args = plan_args(2);
                // A consent needs --resume; the checkpoint is read only after the rendezvous.
                args.extend(["--resume".into(), "no-such-checkpoint".into()]);
                args.extend(["--rendezvous-timeout".into(), "20".into()]);
                if rank == 2 {
                    args.extend(flag.iter().map(|s| s.to_string()));
                }
                torchrun_rank(&args, rank, 4, &port)
            })
            .collect();
        for child in children {
            let output = child.wait_with_output().unwrap();
            let err = stderr(&output);
            assert_eq!(output.status.code(), Some(1), "{err}");
            assert!(
                err.contains("rank 2 (host ")
                    && err.contains("was started with other flags than rank 0")
                    && err.contains(named),
                "{flag:?}: {err}"
            );
        }
    }
}

#[test]
fn a_multi_process_job_shows_the_spec_warnings_once() {
    // Two steps end inside the example's warmup: warning W0901 in every compile of the spec.
    // Rank 3's other seed ends the job at the rendezvous, after every rank compiled.
    let port = free_port().to_string();
    let children: Vec<_> = (0..4)
        .map(|rank| {
            let mut args = plan_args(2);
            if rank == 3 {
                args.extend(["--set".into(), "train.seed=7".into()]);
            }
            args.extend(["--rendezvous-timeout".into(), "20".into()]);
            torchrun_rank(&args, rank, 4, &port)
        })
        .collect();
    let shown: Vec<usize> = children
        .into_iter()
        .map(|child| {
            let output = child.wait_with_output().unwrap();
            let err = stderr(&output);
            assert_eq!(output.status.code(), Some(1), "{err}");
            err.matches("W0901").count()
        })
        .collect();
    assert_eq!(shown, [1, 0, 0, 0], "W0901 shown by ranks 0-3");
}

#[test]
fn a_rank_variable_left_beside_mpiruns_is_refused_naming_both() {
    // mpirun's rank 1 of 4 with a RANK=0 left in its environment: it took itself for rank 0
    // and failed on rank 0's port, held by the job's real rank 0 (here, this listener).
    let held = std::net::TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    let output = parc(
        &plan_args(2),
        &[
            ("OMPI_COMM_WORLD_RANK", "1".into()),
            ("OMPI_COMM_WORLD_SIZE", "4".into()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1".into()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4".into()),
            ("RANK", "0".into()),
            ("WORLD_SIZE", "4".into()),
            ("LOCAL_RANK", "0".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port),
        ],
    )
    .output()
    .unwrap();
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(
        err.contains("RANK=0 WORLD_SIZE=4 (torchrun-style)")
            && err.contains("OMPI_COMM_WORLD_RANK=1")
            && err.contains("If mpirun started this job, unset RANK"),
        "{err}"
    );
}

#[test]
fn a_slurm_batch_script_of_several_tasks_says_at_once_to_launch_with_srun() {
    // A Slurm job's batch script (no step id) is no rank: it waited for 3 ranks that srun
    // never started, until the rendezvous timeout.
    let started = Instant::now();
    let mut args = plan_args(2);
    args.extend(["--rendezvous-timeout".into(), "20".into()]);
    let output = parc(
        &args,
        &[
            ("SLURM_JOB_ID", "77".into()),
            ("SLURM_NTASKS", "4".into()),
            ("SLURM_PROCID", "0".into()),
            ("SLURM_LOCALID", "0".into()),
            ("SLURM_JOB_NODELIST", "localhost".into()),
            ("MASTER_PORT", free_port().to_string()),
        ],
    )
    .output()
    .unwrap();
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(
        err.contains("batch script of Slurm job 77") && err.contains("`srun parc run …`"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(15), "{err}");
}

#[test]
fn a_world_size_other_than_the_mesh_is_refused_with_both_numbers() {
    let mut args = plan_args(2);
    args.extend(["--nproc-per-node".into(), "3".into()]);
    let output = parc(&args, &[]).output().unwrap();
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(
        err.contains("mesh has 4 ranks") && err.contains("but 3 processes were launched"),
        "{err}"
    );
    // Under a launcher's variables, before the rendezvous.
    let output = parc(
        &plan_args(2),
        &[
            ("RANK", "1".into()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_RANK", "1".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", free_port().to_string()),
        ],
    )
    .output()
    .unwrap();
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(
        err.contains("mesh has 4 ranks") && err.contains("but 2 processes were launched"),
        "{err}"
    );
}

#[cfg(not(feature = "mpi"))]
#[test]
fn without_the_mpi_feature_a_cpu_launch_says_how_to_build_it() {
    let mut args = plan_args(2);
    args.extend(["--nproc-per-node".into(), "4".into()]);
    let output = parc(&args, &[]).output().unwrap();
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(
        err.contains("built without it") && err.contains("--features mpi"),
        "{err}"
    );
}

/// The MPI comm itself, two ranks under mpiexec (each runs [`mpi_comm_rank`]): collectives
/// equal the local comm's arithmetic bit for bit; members issuing different collectives are
/// told so; a peer that never comes is named at the timeout; a peer's abort reaches a waiting
/// rank at once.
#[cfg(feature = "mpi")]
#[test]
fn mpi_comm_checks_order_names_missing_peers_and_hears_aborts() {
    if let Some(why) = mpi_missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let output = std::process::Command::new("mpiexec")
        .args(["-n", "2", "--oversubscribe", "--bind-to", "none"])
        .args(["-x", "MASTER_ADDR=127.0.0.1"])
        .args(["-x", &format!("MASTER_PORT={}", free_port())])
        .arg(std::env::current_exe().unwrap())
        .args(["mpi_comm_rank", "--exact", "--ignored", "--nocapture"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&output.stdout);
    let all = format!("{out}\n{}", stderr(&output));
    for line in [
        "rank 0: collectives exact",
        "rank 1: collectives exact",
        "rank 0: mismatch: communication: collective mismatch on group [0, 1], call #4: rank 0 \
         issued all_reduce(sum) of 2 elements but rank 1 issued all_gather of 1 elements",
        "rank 1: mismatch: communication: collective mismatch on group [0, 1], call #4: rank 1 \
         issued all_gather of 1 elements but rank 0 issued all_reduce(sum) of 2 elements",
        "rank 0: timeout: communication: rank 0 waited 1.5 s in all_reduce(sum) of 1 elements \
         on group [0, 1] (call #5): ranks [1] never sent their part",
        "rank 0: abort: communication: rank 0 stopped in all_reduce(sum) of 1 elements on group \
         [0, 1] (call #6) because rank 1 failed: rank 1 gave up",
    ] {
        assert!(all.contains(line), "missing {line:?} in:\n{all}");
    }
}

/// One rank of [`mpi_comm_checks_order_names_missing_peers_and_hears_aborts`].
#[cfg(feature = "mpi")]
#[test]
#[ignore = "a rank of mpi_comm_checks_order_names_missing_peers_and_hears_aborts (mpiexec)"]
fn mpi_comm_rank() {
    use parc_compiler::ir::ReduceOp;
    use parc_runtime::comm::mpi::MpiComm;
    use parc_runtime::comm::{Comm, PeerOp};
    use parc_runtime::launch::{detect_process, Rendezvous, RendezvousConfig};
    let env = detect_process().unwrap().unwrap();
    let config = RendezvousConfig::new(
        env.rank,
        env.world,
        env.local_rank,
        "test",
        &env.master_addr,
        env.master_port,
    );
    let rendezvous = Rendezvous::join(&config).unwrap();
    let mut comm = MpiComm::init(rendezvous, Duration::from_millis(1500)).unwrap();
    let me = comm.rank();
    let group = [0, 1];
    // Values whose float sum depends on the order of addition.
    let input = |r: u32| [1e8 * (r as f32 - 0.5), 0.1 * r as f32 + 1e-3, -(r as f32)];
    let mut sum = input(me);
    comm.all_reduce(&group, ReduceOp::Sum, &mut sum).unwrap();
    let mut want = input(0);
    for (w, x) in want.iter_mut().zip(input(1)) {
        *w += x;
    }
    let mut gathered = [0.0; 6];
    comm.all_gather(&group, &input(me), &mut gathered).unwrap();
    let mut scattered = [0.0; 3];
    let contribution: Vec<f32> = (0..6).map(|i| i as f32 * (me as f32 + 1.0)).collect();
    comm.reduce_scatter(&group, &contribution, &mut scattered)
        .unwrap();
    let mut shared = [me as f32; 2];
    comm.broadcast(&group, 1, &mut shared).unwrap();
    let mine = [me as f32; 4];
    let mut theirs = [9.0; 4];
    comm.group_p2p(&mut [
        PeerOp::Recv {
            peer: 1 - me,
            tag: 3,
            out: &mut theirs,
        },
        PeerOp::Send {
            peer: 1 - me,
            tag: 3,
            data: &mine,
        },
    ])
    .unwrap();
    let base = 3.0 * me as f32;
    let exact = sum.map(f32::to_bits) == want.map(f32::to_bits)
        && gathered[..3] == input(0)
        && gathered[3..] == input(1)
        && scattered == [3.0 * base, 3.0 * (base + 1.0), 3.0 * (base + 2.0)]
        && shared == [1.0; 2]
        && theirs == [(1 - me) as f32; 4];
    if exact {
        println!("rank {me}: collectives exact");
    }
    // Call #4 on the group: different collectives.
    let mismatch = if me == 0 {
        comm.all_reduce(&group, ReduceOp::Sum, &mut [1.0, 2.0])
    } else {
        comm.all_gather(&group, &[1.0], &mut [0.0; 2])
    };
    println!("rank {me}: mismatch: {}", mismatch.unwrap_err());
    // Call #5: rank 1 never comes; call #6: rank 1 aborts while rank 0 waits.
    if me == 0 {
        let timeout = comm.all_reduce(&group, ReduceOp::Sum, &mut [1.0]);
        println!("rank 0: timeout: {}", timeout.unwrap_err());
        let abort = comm.all_reduce(&group, ReduceOp::Sum, &mut [1.0]);
        println!("rank 0: abort: {}", abort.unwrap_err());
    } else {
        std::thread::sleep(Duration::from_millis(2500));
        comm.abort("rank 1 gave up");
        std::thread::sleep(Duration::from_millis(1500));
    }
}

/// A safetensors file's tensors (name, shape, bytes), sorted by name.
fn tensors(path: &std::path::Path) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut all: Vec<_> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.shape().to_vec(), view.data().to_vec()))
        .collect();
    all.sort();
    all
}
