//! `parc calibrate`'s collective table on a machine of several GPUs: all-reduce, all-gather and
//! reduce-scatter through the CUDA backend's NCCL path (`Backend::device_collective`, what a
//! training step runs), one rank thread per GPU, for groups of 2, 4 and 8 GPUs (as many as are
//! visible), from 1 MiB to 1 GiB. Each point's bytes are the collective's defining buffer as the
//! timeline takes it (all-reduce and reduce-scatter: the input; all-gather: the output), its
//! time the mean of back-to-back runs between synchronizations, after two to warm up (the
//! collectives themselves keep the ranks in step). A rank that fails leaves the others' NCCL
//! calls to the backend's watchdog, which ends them with an error after [`TIMEOUT`].
use parc_compiler::driver::{self, CompileOptions, Stage};
use parc_compiler::ir::{BufferId, CollectiveKind, DType, Plan, ReduceOp};
use parc_compiler::timeline::calibrated::collective_name;
use parc_compiler::timeline::profile::CollectivePoint;
use parc_runtime::backend::Backend;
use parc_runtime::cuda::{CudaBackend, NcclId};
use std::time::{Duration, Instant};

/// How long a rank's NCCL call may wait for the others.
const TIMEOUT: Duration = Duration::from_secs(60);

/// The collectives measured.
const KINDS: [CollectiveKind; 3] = [
    CollectiveKind::AllReduce { op: ReduceOp::Sum },
    CollectiveKind::AllGather,
    CollectiveKind::ReduceScatter,
];

/// The points of every group size the visible GPUs allow (none with one GPU).
pub fn measure(progress: &mut dyn FnMut(&str)) -> Result<Vec<CollectivePoint>, String> {
    let gpus = (0..8).take_while(|&g| CudaBackend::new(g).is_ok()).count() as u32;
    let mut points = Vec::new();
    for ranks in [2, 4, 8].into_iter().filter(|&n| n <= gpus) {
        progress(&format!("measuring collectives over {ranks} GPUs"));
        points.extend(group(ranks, &plan_over(ranks)?)?);
    }
    Ok(points)
}

/// A plan whose communicators span `ranks` GPUs (the bundled tiny model, data parallel), for the
/// NCCL backend to join.
fn plan_over(ranks: u32) -> Result<Plan, String> {
    let text = include_str!("../examples/tiny.par").to_string();
    let sets = [
        format!("parallel.mesh.dp={ranks}"),
        format!("cluster.gpus_per_node={ranks}"),
        format!("train.global_batch={}", 2 * ranks),
        "train.micro_batch=2".to_string(),
    ];
    let overrides = sets
        .iter()
        .map(|s| parc_compiler::parse_override(s).map_err(|e| format!("{s}: {e:?}")))
        .collect::<Result<Vec<_>, _>>()?;
    let compiled = driver::compile(
        "tiny.par",
        text,
        &overrides,
        &CompileOptions::through(Stage::Lower),
    );
    compiled
        .plan
        .ok_or_else(|| format!("the {ranks}-GPU plan of the collective table did not lower"))
}

/// One group size's points, measured on GPUs 0..ranks (rank 0 reports them).
fn group(ranks: u32, plan: &Plan) -> Result<Vec<CollectivePoint>, String> {
    let id = NcclId::new().map_err(|e| format!("NCCL: {e}"))?;
    let members: Vec<u32> = (0..ranks).collect();
    let results: Vec<Result<Vec<CollectivePoint>, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..ranks)
            .map(|rank| {
                let (id, members) = (&id, &members);
                scope.spawn(move || rank_points(rank, plan, id, members))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a rank thread panicked".to_string()))
            })
            .collect()
    });
    let mut reported = Vec::new();
    for (rank, result) in results.into_iter().enumerate() {
        let points = result.map_err(|e| format!("rank {rank} of {ranks}: {e}"))?;
        if rank == 0 {
            reported = points;
        }
    }
    Ok(reported)
}

/// What rank `rank` measures: every kind at every size, in step with the other ranks.
fn rank_points(
    rank: u32,
    plan: &Plan,
    id: &NcclId,
    members: &[u32],
) -> Result<Vec<CollectivePoint>, String> {
    let mut b = CudaBackend::new(rank as usize).map_err(|e| e.to_string())?;
    b.use_nccl(id, rank, plan, TIMEOUT)
        .map_err(|e| e.to_string())?;
    let n = members.len() as u64;
    let sizes =
        std::iter::successors(Some(1u64 << 20), |s| Some(s * 4)).take_while(|&s| s <= 1 << 30);
    let mut points = Vec::new();
    for kind in KINDS {
        for bytes in sizes.clone() {
            let seconds = time_one(&mut b, kind, members, bytes / 4 / n * n)?;
            points.push(CollectivePoint {
                kind: collective_name(kind).to_string(),
                ranks: members.len() as u32,
                bytes: (bytes / 4 / n * n * 4) as f64,
                seconds,
            });
        }
    }
    Ok(points)
}

/// Seconds of one `kind` over `members` whose larger buffer holds `elements` f32 values.
fn time_one(
    b: &mut CudaBackend,
    kind: CollectiveKind,
    members: &[u32],
    elements: u64,
) -> Result<f64, String> {
    let n = members.len() as u64;
    let (input, output) = match kind {
        CollectiveKind::AllGather => (elements / n, elements),
        CollectiveKind::ReduceScatter => (elements, elements / n),
        _ => (elements, elements),
    };
    let (i, o) = (BufferId(1_000_000), BufferId(1_000_001));
    b.alloc(i, &[input], DType::F32)
        .map_err(|e| e.to_string())?;
    b.alloc(o, &[output], DType::F32)
        .map_err(|e| e.to_string())?;
    let iters = ((1u64 << 30) / (elements * 4).max(1)).clamp(5, 50) as u32;
    let run = |b: &mut CudaBackend, times: u32| -> Result<(), String> {
        for _ in 0..times {
            match b.device_collective(kind, members, i, o) {
                Some(result) => result.map_err(|e| e.to_string())?,
                None => return Err("the backend runs no device collectives".to_string()),
            }
        }
        Backend::synchronize(b).map_err(|e| e.to_string())
    };
    run(b, 2)?;
    let began = Instant::now();
    run(b, iters)?;
    let seconds = began.elapsed().as_secs_f64() / f64::from(iters);
    b.free(i).map_err(|e| e.to_string())?;
    b.free(o).map_err(|e| e.to_string())?;
    Ok(seconds)
}
