//! The tests that need a GPU and NCCL (each prints `skipped: …` and passes without them): one
//! rank through NCCL, the ordering between the compute and communication streams, training
//! through NCCL on one and on several GPUs, a stalled rank, and the ignored bus-bandwidth
//! measurement.
use super::*;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::BufferId;
use parc_runtime::backend::{Backend, DeviceTransfer, StepScalars};
use parc_runtime::comm::{Comm, PeerOp};
use parc_runtime::cuda::{nccl_available, nccl_version, CudaBackend, NcclId};
use parc_runtime::error::RuntimeError as Error;
use parc_runtime::exec::{train, TrainResult};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Whether `gpus` GPUs and NCCL are here; prints why not.
fn have(gpus: usize) -> bool {
    for ordinal in 0..gpus {
        if let Err(e) = CudaBackend::new(ordinal) {
            println!("skipped: needs {gpus} CUDA device(s): device {ordinal}: {e}");
            return false;
        }
    }
    if let Err(e) = nccl_available() {
        println!("skipped: no NCCL ({e})");
        return false;
    }
    println!("NCCL {}", nccl_version().unwrap());
    true
}

/// Two GPU runs of one plan agree only up to the order of the float atomics of the
/// embedding gradients: 1e-4 relative at the first step, 1e-3 after (as tests/cuda_train.rs).
fn assert_close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        let tol = if step == 0 { 1e-4 } else { 1e-3 };
        assert!(
            ((x - y) / x).abs() <= tol,
            "{what}, step {step}: {x} vs {y} ({a:?} vs {b:?})"
        );
    }
}

fn one_rank_plan() -> Plan {
    plan_of(&spec(model(false), PlanChoice::default()))
}

fn scalars() -> StepScalars {
    StepScalars {
        lr: 0.0,
        step: 1,
        loss_scale: None,
    }
}

/// GPU 0 as the one rank of `plan`, communicating through NCCL.
fn one_rank_nccl(plan: &Plan) -> CudaBackend {
    let mut b = CudaBackend::new(0).unwrap();
    b.use_nccl(&NcclId::new().unwrap(), 0, plan, TIMEOUT)
        .unwrap();
    b
}

/// 32 Mi floats (a ramp of 1021 small integers, exact under the scalings the tests apply):
/// NCCL's copy and the kernels take long enough that a missing wait between the streams shows
/// up as stale or early data.
fn large_pattern() -> Vec<f32> {
    (0..1usize << 25)
        .map(|i| (i % 1021) as f32 - 510.0)
        .collect()
}

fn buffer(b: &mut CudaBackend, id: u32, data: &[f32]) -> BufferId {
    let id = BufferId(id);
    b.alloc(id, &[data.len() as u64], DType::F32).unwrap();
    b.write_f32(id, data).unwrap();
    id
}

#[test]
fn one_rank_collectives_and_self_transfers_through_nccl() {
    if !have(1) {
        return;
    }
    let plan = one_rank_plan();
    let mut b = one_rank_nccl(&plan);
    assert!(b.uses_nccl());
    let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let input = buffer(&mut b, 9_000, &data);
    let out = buffer(&mut b, 9_001, &vec![123.0; data.len()]);
    let me = [0u32];
    let kinds = [
        CollectiveKind::AllReduce { op: ReduceOp::Sum },
        CollectiveKind::AllReduce { op: ReduceOp::Max },
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::Broadcast { root: 0 },
    ];
    for kind in kinds {
        b.write_f32(out, &vec![123.0; data.len()]).unwrap();
        b.device_collective(kind, &me, input, out)
            .expect("the NCCL backend runs collectives itself")
            .unwrap();
        assert_eq!(b.read_f32(out).unwrap(), data, "{kind:?}");
    }
    // In place.
    b.device_collective(
        CollectiveKind::AllReduce { op: ReduceOp::Sum },
        &me,
        input,
        input,
    )
    .unwrap()
    .unwrap();
    assert_eq!(b.read_f32(input).unwrap(), data);
    // A compute op queued right after a collective reads its result (stream ordering):
    // out = all-reduce(input), then sum = Σ out².
    b.write_f32(out, &vec![0.0; data.len()]).unwrap();
    let sum = buffer(&mut b, 9_002, &[0.0]);
    b.device_collective(
        CollectiveKind::AllReduce { op: ReduceOp::Sum },
        &me,
        input,
        out,
    )
    .unwrap()
    .unwrap();
    b.compute(&Op::SumSquares, &[out], &[sum], &scalars())
        .unwrap();
    let expected: f64 = data.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    let got = f64::from(b.read_f32(sum).unwrap()[0]);
    assert!(
        (got - expected).abs() <= 1e-5 * expected,
        "{got} vs {expected}"
    );
    // Grouped send and receive to itself.
    let recv = buffer(&mut b, 9_003, &vec![0.0; data.len()]);
    b.device_p2p(&[
        DeviceTransfer::Send {
            peer: 0,
            tag: 7,
            buffer: input,
        },
        DeviceTransfer::Recv {
            peer: 0,
            tag: 7,
            buffer: recv,
        },
    ])
    .unwrap()
    .unwrap();
    // Freeing a buffer right after a transfer used it is ordered after the transfer.
    b.free(input).unwrap();
    assert_eq!(b.read_f32(recv).unwrap(), data);
    // A bad size is an error, not an out-of-bounds NCCL call.
    let short = buffer(&mut b, 9_004, &[1.0; 10]);
    let err = b
        .device_collective(CollectiveKind::AllGather, &me, recv, short)
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(err.contains("a lowering bug"), "{err}");
    let err = b
        .device_collective(
            CollectiveKind::AllReduce { op: ReduceOp::Sum },
            &[0, 1],
            out,
            out,
        )
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(err.contains("no communicator for group [0, 1]"), "{err}");
    // The host comm over the same communicators (a multi-process rank's `Comm`).
    let mut host = b.nccl_host_comm(None).unwrap();
    assert_eq!((host.rank(), host.world()), (0, 1));
    let mut v = vec![1.5f32, -2.0, 3.0];
    host.all_reduce(&me, ReduceOp::Sum, &mut v).unwrap();
    assert_eq!(v, [1.5, -2.0, 3.0]);
    let mut gathered = vec![0.0; 3];
    host.all_gather(&me, &v, &mut gathered).unwrap();
    assert_eq!(gathered, v);
    let mut scattered = vec![0.0; 3];
    host.reduce_scatter(&me, &v, &mut scattered).unwrap();
    assert_eq!(scattered, v);
    host.broadcast(&me, 0, &mut v).unwrap();
    assert_eq!(v, [1.5, -2.0, 3.0]);
    let mut received = vec![0.0; 3];
    host.group_p2p(&mut [
        PeerOp::Send {
            peer: 0,
            tag: 1,
            data: &v,
        },
        PeerOp::Recv {
            peer: 0,
            tag: 1,
            out: &mut received,
        },
    ])
    .unwrap();
    assert_eq!(received, v);
    host.barrier(&me).unwrap();
    // The device path still works after host calls on the same stream.
    b.device_collective(CollectiveKind::AllGather, &me, recv, out)
        .unwrap()
        .unwrap();
    assert_eq!(b.read_f32(out).unwrap(), data);
}

#[test]
fn compute_and_communication_wait_for_each_other_on_large_buffers() {
    if !have(1) {
        return;
    }
    let plan = one_rank_plan();
    let mut b = one_rank_nccl(&plan);
    let p = large_pattern();
    let n = p.len();
    let me = [0u32];
    let sum = CollectiveKind::AllReduce { op: ReduceOp::Sum };
    let times = |k: f32| p.iter().map(|x| x * k).collect::<Vec<_>>();
    for round in 0..3 {
        let a = buffer(&mut b, 100, &p);
        let out = buffer(&mut b, 101, &vec![0.0; n]);
        let y = buffer(&mut b, 102, &vec![0.0; n]);
        // Compute reads a collective's output (read after write across the streams).
        b.device_collective(sum, &me, a, out).unwrap().unwrap();
        b.compute(&Op::Scale { factor: 2.0 }, &[out], &[y], &scalars())
            .unwrap();
        // Compute overwrites a collective's input (write after read).
        b.device_collective(sum, &me, a, out).unwrap().unwrap();
        b.compute(&Op::Zero, &[], &[a], &scalars()).unwrap();
        // A collective reads what compute just wrote.
        b.compute(&Op::Scale { factor: 3.0 }, &[y], &[a], &scalars())
            .unwrap();
        let z = buffer(&mut b, 103, &vec![0.0; n]);
        b.device_collective(CollectiveKind::Broadcast { root: 0 }, &me, a, z)
            .unwrap()
            .unwrap();
        assert!(b.read_f32(y).unwrap() == times(2.0), "round {round}: y");
        assert!(b.read_f32(out).unwrap() == p, "round {round}: out");
        assert!(b.read_f32(z).unwrap() == times(6.0), "round {round}: z");
        for id in [a, out, y, z] {
            b.free(id).unwrap();
        }
    }
}

/// `one_rank_plan()` with an (unexecuted) all-reduce over the one-rank group on each of
/// `ids` appended to its program, so that NCCL set up from it knows them as communication
/// buffers.
fn plan_knowing(ids: &[u32]) -> Plan {
    let mut plan = one_rank_plan();
    let group = parc_compiler::ir::GroupId(plan.groups.len() as u32);
    plan.groups.push(parc_compiler::ir::Group {
        name: "self".into(),
        axes: vec![parc_compiler::spec::Axis::Dp],
        sets: vec![vec![0]],
    });
    for &id in ids {
        plan.programs[0].instrs.push(Instr::Collective {
            kind: CollectiveKind::AllReduce { op: ReduceOp::Sum },
            group,
            input: BufferId(id),
            output: BufferId(id),
            node: None,
        });
    }
    plan
}

#[test]
fn communication_waits_for_the_last_compute_on_its_buffers_not_for_later_compute() {
    if !have(1) {
        return;
    }
    let plan = plan_knowing(&[200, 201]);
    let mut b = one_rank_nccl(&plan);
    let p = large_pattern();
    let n = p.len();
    let me = [0u32];
    let sum = CollectiveKind::AllReduce { op: ReduceOp::Sum };
    let times = |k: f32| p.iter().map(|x| x * k).collect::<Vec<_>>();
    for round in 0..3 {
        // 200 and 201 are communication buffers of the plan; 210 and 211 are not.
        let src = buffer(&mut b, 210, &p);
        let a = buffer(&mut b, 200, &vec![0.0; n]);
        let out = buffer(&mut b, 201, &vec![0.0; n]);
        let busy = buffer(&mut b, 211, &vec![0.0; n]);
        // The last writer of the collective's input, then unrelated compute it need not
        // wait for: the collective must still see the writer's result.
        b.compute(&Op::Scale { factor: 2.0 }, &[src], &[a], &scalars())
            .unwrap();
        for _ in 0..4 {
            b.compute(&Op::Scale { factor: 3.0 }, &[src], &[busy], &scalars())
                .unwrap();
        }
        b.device_collective(sum, &me, a, out).unwrap().unwrap();
        // A reader of the collective's output, then unrelated compute, then a collective
        // that overwrites that output: the reader must see the first result.
        b.compute(&Op::Scale { factor: 1.0 }, &[out], &[busy], &scalars())
            .unwrap();
        b.compute(&Op::Scale { factor: 5.0 }, &[src], &[src], &scalars())
            .unwrap();
        b.compute(&Op::Zero, &[], &[a], &scalars()).unwrap();
        b.device_collective(sum, &me, a, out).unwrap().unwrap();
        assert!(
            b.read_f32(busy).unwrap() == times(2.0),
            "round {round}: busy"
        );
        assert!(
            b.read_f32(out).unwrap() == vec![0.0; n],
            "round {round}: out"
        );
        assert!(b.read_f32(src).unwrap() == times(5.0), "round {round}: src");
        for id in [src, a, out, busy] {
            b.free(id).unwrap();
        }
    }
}

/// Bus bandwidth of all-reduce, all-gather and reduce-scatter through parc's own device
/// path (`Backend::device_collective` on the NCCL backend) on every visible GPU, one rank
/// thread per GPU, from 1 MB to `PARC_BENCH_MAX_BYTES` (4 GiB by default), reported as
/// nccl-tests does: algbw = bytes / time, busbw = algbw × 2(n−1)/n for all-reduce and
/// × (n−1)/n for all-gather and reduce-scatter (bytes: the larger buffer). Ignored; run
/// `cuda_nccl nccl_bus_bandwidth --ignored --nocapture` (issue 8, item 2).
#[test]
#[ignore]
fn nccl_bus_bandwidth() {
    if !have(1) {
        return;
    }
    let gpus = (0..8).take_while(|&g| CudaBackend::new(g).is_ok()).count() as u32;
    let plan = plan_of(&spec(
        model(false),
        PlanChoice {
            dp: gpus,
            microbatches: 1,
            ..PlanChoice::default()
        },
    ));
    let max: u64 = std::env::var("PARC_BENCH_MAX_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4 << 30);
    let sizes: Vec<u64> = std::iter::successors(Some(1u64 << 20), |s| Some(s * 4))
        .take_while(|&s| s <= max)
        .collect();
    let kinds = [
        (
            "all-reduce",
            CollectiveKind::AllReduce { op: ReduceOp::Sum },
        ),
        ("all-gather", CollectiveKind::AllGather),
        ("reduce-scatter", CollectiveKind::ReduceScatter),
    ];
    let id = NcclId::new().unwrap();
    let group: Vec<u32> = (0..gpus).collect();
    let start = std::sync::Barrier::new(gpus as usize);
    println!("{gpus} GPU(s), NCCL {}", nccl_version().unwrap());
    println!(
        "{:<15} {:>10} {:>11} {:>12} {:>12}",
        "collective", "bytes", "time (us)", "algbw GB/s", "busbw GB/s"
    );
    std::thread::scope(|scope| {
        for rank in 0..gpus {
            let (plan, sizes, group, start, id) = (&plan, &sizes, &group, &start, &id);
            scope.spawn(move || {
                let mut b = CudaBackend::new(rank as usize).unwrap();
                b.use_nccl(id, rank, plan, Duration::from_secs(300))
                    .unwrap();
                let n = u64::from(gpus);
                for (name, kind) in kinds {
                    for &bytes in sizes {
                        let big = (bytes / 4 / n * n) as usize;
                        let (input, output) = match kind {
                            CollectiveKind::AllGather => (big / n as usize, big),
                            CollectiveKind::ReduceScatter => (big, big / n as usize),
                            _ => (big, big),
                        };
                        let (i, o) = (BufferId(1_000_000), BufferId(1_000_001));
                        b.alloc(i, &[input as u64], DType::F32).unwrap();
                        b.alloc(o, &[output as u64], DType::F32).unwrap();
                        let iters = (((1u64 << 30) / bytes).clamp(5, 50)) as u32;
                        let mut run = |times: u32| {
                            for _ in 0..times {
                                b.device_collective(kind, group, i, o).unwrap().unwrap();
                            }
                            // The trait's synchronize: it also waits for the communication
                            // stream (the inherent one waits for the compute stream only).
                            Backend::synchronize(&mut b).unwrap();
                        };
                        run(2);
                        start.wait();
                        let began = std::time::Instant::now();
                        run(iters);
                        let seconds = began.elapsed().as_secs_f64() / f64::from(iters);
                        start.wait();
                        b.free(i).unwrap();
                        b.free(o).unwrap();
                        if rank == 0 {
                            let moved = (big * 4) as f64;
                            let algbw = moved / seconds / 1e9;
                            let nf = n as f64;
                            let factor = match kind {
                                CollectiveKind::AllReduce { .. } => 2.0 * (nf - 1.0) / nf,
                                _ => (nf - 1.0) / nf,
                            };
                            println!(
                                "{name:<15} {:>10} {:>11.1} {algbw:>12.1} {:>12.1}",
                                big * 4,
                                seconds * 1e6,
                                algbw * factor
                            );
                        }
                    }
                }
            });
        }
    });
}

/// The `parc` binary: `PARC_BIN`, else the one cargo built beside this test (absent when
/// the test binary was copied to another machine).
fn parc_binary() -> Option<std::path::PathBuf> {
    std::env::var_os("PARC_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_parc").into())
        .canonicalize()
        .ok()
}

/// The repository root: here when it holds the examples, else where this was built.
fn repo_root() -> std::path::PathBuf {
    if std::path::Path::new("examples/tiny.par").is_file() {
        ".".into()
    } else {
        env!("CARGO_MANIFEST_DIR").into()
    }
}

/// `parc run examples/tiny.par --backend cuda` with `extra`: the losses' bits, or the error.
fn cli_losses(parc: &std::path::Path, extra: &[&str]) -> Vec<u32> {
    let output = std::process::Command::new(parc)
        .args(["run", "examples/tiny.par", "--backend", "cuda"])
        .args(["--log-format", "json", "--set", "train.steps=6"])
        .args(extra)
        .current_dir(repo_root())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "parc run {extra:?}: {stderr}");
    let losses: Vec<u32> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .map(|v| (v["loss"].as_f64().unwrap() as f32).to_bits())
        .collect();
    assert_eq!(losses.len(), 6, "parc run {extra:?}: {stderr}");
    losses
}

#[test]
fn parc_run_gives_the_same_losses_with_and_without_nccl_and_launched() {
    if !have(1) {
        return;
    }
    let Some(parc) = parc_binary() else {
        println!("skipped: no parc binary (set PARC_BIN to a parc built with --features cuda)");
        return;
    };
    let local = cli_losses(&parc, &["--comm", "local"]);
    let nccl = cli_losses(&parc, &["--comm", "nccl"]);
    // One rank process started by the launcher: NCCL id through the rendezvous, the NCCL
    // host comm as its comm.
    let launched = cli_losses(&parc, &["--nproc-per-node", "1"]);
    let floats = |v: &[u32]| v.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>();
    println!(
        "local    {:?}\nnccl     {:?}",
        floats(&local),
        floats(&nccl)
    );
    println!("launched {:?}", floats(&launched));
    assert_close("--comm nccl", &floats(&local), &floats(&nccl));
    assert_close("--nproc-per-node 1", &floats(&local), &floats(&launched));
}

fn run(s: &Spec, nccl: bool, cpu: bool) -> TrainResult {
    let plan = plan_of(s);
    let mut options = TrainOptions::new(".");
    options.threads_per_rank = Some(1);
    if cpu {
        return train_cpu(s, &plan, &options).unwrap();
    }
    let id = NcclId::new().unwrap();
    train(
        s,
        &plan,
        &options,
        |rank, _| {
            let mut b = CudaBackend::new(rank as usize)?;
            if nccl {
                b.use_nccl(&id, rank, &plan, TIMEOUT)?;
            }
            Ok(b)
        },
        &|_| {},
    )
    .unwrap()
}

#[test]
fn one_gpu_training_through_nccl_gives_the_same_losses() {
    if !have(1) {
        return;
    }
    let mut s = spec(model(false), PlanChoice::default());
    s.train.steps = 4;
    let plain = run(&s, false, false);
    let nccl = run(&s, true, false);
    let losses = |r: &TrainResult| r.records.iter().map(|r| r.loss).collect::<Vec<_>>();
    println!(
        "without NCCL {:?}\nwith NCCL    {:?}",
        losses(&plain),
        losses(&nccl)
    );
    assert_close("loss", &losses(&plain), &losses(&nccl));
    let norms = |r: &TrainResult| r.records.iter().map(|r| r.grad_norm).collect::<Vec<_>>();
    assert_close("gradient norm", &norms(&plain), &norms(&nccl));
}

#[test]
fn identity_collectives_after_every_op_train_to_the_same_losses_through_nccl() {
    if !have(1) {
        return;
    }
    let mut s = spec(model(false), PlanChoice::default());
    s.train.steps = 3;
    let plain = run(&s, false, false);
    let plan = with_identity_collectives(plan_of(&s));
    let collectives = plan.programs[0]
        .instrs
        .iter()
        .filter(|i| matches!(i, Instr::Collective { .. }))
        .count();
    assert!(collectives > 50, "{collectives} collectives");
    let mut options = TrainOptions::new(".");
    options.threads_per_rank = Some(1);
    let id = NcclId::new().unwrap();
    let nccl = train(
        &s,
        &plan,
        &options,
        |rank, _| {
            let mut b = CudaBackend::new(rank as usize)?;
            b.use_nccl(&id, rank, &plan, TIMEOUT)?;
            Ok(b)
        },
        &|_| {},
    )
    .unwrap();
    let losses = |r: &TrainResult| r.records.iter().map(|r| r.loss).collect::<Vec<_>>();
    println!(
        "{collectives} NCCL all-reduces a step; without {:?}, with {:?}",
        losses(&plain),
        losses(&nccl)
    );
    assert_close("loss", &losses(&plain), &losses(&nccl));
}

#[test]
fn multi_gpu_plans_through_nccl_match_the_single_rank_cpu_run() {
    if !have(2) {
        return;
    }
    let gpus = (0..8).take_while(|&g| CudaBackend::new(g).is_ok()).count() as u32;
    let choices = [
        (2, 1, 1, 1, ZeroStage::Zero1),
        (2, 1, 1, 1, ZeroStage::Zero3),
        (1, 1, 1, 2, ZeroStage::Zero0),
        (1, 2, 1, 1, ZeroStage::Zero0),
        (2, 1, 1, 2, ZeroStage::Zero3),
        (2, 2, 1, 1, ZeroStage::Zero2),
    ];
    for (dp, pp, cp, tp, zero) in choices {
        if dp * pp * cp * tp > gpus {
            println!("skipped dp{dp} pp{pp} tp{tp}: needs {} GPUs", dp * pp * tp);
            continue;
        }
        let choice = PlanChoice {
            microbatches: 2,
            ..PlanChoice::mesh(dp, pp, cp, tp, zero)
        };
        let mut s = spec(model(false), choice);
        s.train.steps = 4;
        // The single rank with the same global batch.
        let mut single = spec(
            model(false),
            PlanChoice {
                microbatches: 2 * dp,
                ..PlanChoice::default()
            },
        );
        single.train.steps = 4;
        let reference = run(&single, false, true);
        let got = run(&s, true, false);
        for (step, (a, b)) in reference.records.iter().zip(&got.records).enumerate() {
            let tol = if step == 0 { 1e-4 } else { 1e-3 };
            let rel = ((a.loss - b.loss) / a.loss).abs();
            assert!(
                rel <= tol,
                "dp{dp} pp{pp} tp{tp} step {step}: cpu {} nccl {}",
                a.loss,
                b.loss
            );
        }
        println!(
            "dp{dp} pp{pp} tp{tp} {zero:?}: {} steps match",
            got.records.len()
        );
    }
}

/// A CUDA backend whose host stalls for `stall` when its executor reaches instruction
/// `at` of step `step` (0-based), before running it: a rank stuck outside NCCL.
struct Stalling {
    inner: CudaBackend,
    at: usize,
    step: u32,
    stall: Duration,
    steps_begun: u32,
}

impl Backend for Stalling {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn prepare(
        &mut self,
        program: &parc_compiler::ir::Program,
        layout: &parc_compiler::memplan::MemoryLayout,
    ) -> parc_runtime::error::Result<()> {
        self.inner.prepare(program, layout)
    }
    fn reserved_bytes(&self) -> Option<u64> {
        Backend::reserved_bytes(&self.inner)
    }
    fn alloc(&mut self, id: BufferId, shape: &[u64], dtype: DType) -> Result<(), Error> {
        self.inner.alloc(id, shape, dtype)
    }
    fn free(&mut self, id: BufferId) -> Result<(), Error> {
        self.inner.free(id)
    }
    fn compute(
        &mut self,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
        scalars: &StepScalars,
    ) -> Result<(), Error> {
        self.inner.compute(op, inputs, outputs, scalars)
    }
    fn write_f32(&mut self, id: BufferId, data: &[f32]) -> Result<(), Error> {
        self.inner.write_f32(id, data)
    }
    fn write_i32(&mut self, id: BufferId, data: &[i32]) -> Result<(), Error> {
        self.inner.write_i32(id, data)
    }
    fn read_f32(&self, id: BufferId) -> Result<Vec<f32>, Error> {
        self.inner.read_f32(id)
    }
    fn synchronize(&mut self) -> Result<(), Error> {
        Backend::synchronize(&mut self.inner)
    }
    fn device_collective(
        &mut self,
        kind: CollectiveKind,
        group: &[u32],
        input: BufferId,
        output: BufferId,
    ) -> Option<Result<(), Error>> {
        self.inner.device_collective(kind, group, input, output)
    }
    fn device_p2p(&mut self, transfers: &[DeviceTransfer]) -> Option<Result<(), Error>> {
        self.inner.device_p2p(transfers)
    }
    fn abort(&mut self, reason: &str) {
        self.inner.abort(reason)
    }
    fn begin_instruction(&mut self, index: usize) {
        if index == 0 {
            self.steps_begun += 1;
        }
        if index == self.at && self.steps_begun == self.step + 1 {
            std::thread::sleep(self.stall);
        }
        self.inner.begin_instruction(index)
    }
    fn stuck_instruction(&self) -> Option<usize> {
        self.inner.stuck_instruction()
    }
}

#[test]
fn a_rank_stalled_before_an_all_gather_is_reported_at_that_instruction() {
    if !have(2) {
        return;
    }
    let choice = PlanChoice {
        dp: 2,
        zero: ZeroStage::Zero3,
        microbatches: 2,
        ..PlanChoice::default()
    };
    let mut s = spec(model(false), choice);
    s.train.steps = 3;
    let plan = plan_of(&s);
    let program = &plan.programs[0];
    // The third ZeRO-3 all-gather of the step: its peer has queued the ones before it and
    // will queue later ones behind it.
    let gather = program
        .instrs
        .iter()
        .enumerate()
        .filter(|(_, i)| {
            matches!(
                i,
                Instr::Collective {
                    kind: CollectiveKind::AllGather,
                    ..
                }
            )
        })
        .map(|(index, _)| index)
        .nth(2)
        .unwrap();
    let timeout = Duration::from_secs(3);
    let mut options = TrainOptions::new(".");
    options.threads_per_rank = Some(1);
    let id = NcclId::new().unwrap();
    let started = std::time::Instant::now();
    let err = train(
        &s,
        &plan,
        &options,
        |rank, _| {
            let mut inner = CudaBackend::new(rank as usize)?;
            inner.use_nccl(&id, rank, &plan, timeout)?;
            let stall = if rank == 1 {
                timeout * 3
            } else {
                Duration::ZERO
            };
            Ok(Stalling {
                inner,
                at: gather,
                step: 1,
                stall,
                steps_begun: 0,
            })
        },
        &|_| {},
    )
    .unwrap_err();
    println!("{err}");
    assert!(started.elapsed() < timeout * 8, "{:?}", started.elapsed());
    match &err {
        Error::AtInstruction {
            index, instr, node, ..
        } => {
            assert_eq!(*index, gather, "{err}");
            assert!(instr.contains("all_gather"), "{err}");
            assert!(node.is_some(), "{err}");
        }
        other => panic!("not located at an instruction: {other}"),
    }
    assert!(err.to_string().contains("all-gather"), "{err}");
}
