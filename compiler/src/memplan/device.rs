//! What one GPU holds for a rank of a CUDA run beyond its planned regions (the persistent
//! region and the arena of [`super::plan_program`]), so `parc check` can predict the whole
//! per-GPU footprint that `nvidia-smi` shows. Pure: a function of the lowered plan, the run's
//! [`KernelTarget`] (operand precision, a Hopper GPU) and the documented constants below.
//! Each overhead is its own labelled line with where its number comes from (docs/memory.md
//! has the table):
//!
//! - **The CUDA backend's own memory**: the sizes it reserves, [`super::backend_scratch`]
//!   (16-bit weight casts, GEMM scratch and bias vector area, op scratch, aliased copies), and
//!   the cuBLASLt workspace.
//! - **The CUDA context** with the loaded kernels: a measured constant.
//! - **NCCL** (runs of several ranks): a per-process constant (its kernels and communicator
//!   state), the connection buffers of every communicator the rank runs collectives on
//!   (ring and tree, every channel), and the point-to-point buffers of every pipeline peer.
//!
//! Small pieces are left out: position lists, fused optimizer and sum-of-squares tables
//! (KiBs), Hopper GEMMs' split counters (16 KiB), the NCCL host comm's staging (metrics).
use super::scratch::{
    backend_scratch, KernelTarget, CUBLASLT_WORKSPACE_BYTES, MIN_REDUCTION_SCRATCH,
};
use super::PlanSummary;
use crate::ir::{Instr, P2pOp, Peer, Plan, Program, ProgramId};
use serde::Serialize;
use std::collections::HashSet;

const MIB: u64 = 1 << 20;

/// The CUDA context, its loaded kernels (parc's NVRTC modules, cuBLASLt's) and cuBLASLt's
/// handle: nvidia-smi above `memory_reserved_bytes` on one H200 (driver 580, CUDA 13), GPT-2
/// 124M (14.8 vs 14.3 GiB) and 350M (19.3 vs 18.8 GiB), bench/RESULTS.md session 3.
pub const CUDA_CONTEXT_BYTES: u64 = 512 * MIB;
/// NCCL channels per communicator on NVLink/NVSwitch H100/H200 hosts (NVIDIA/nccl#1685 counts
/// 32 channels per pair of GPUs on 8 H100s; `bench/multi_gpu.sh`'s ZeRO runs print NCCL's own
/// count from its INIT log).
pub const NCCL_CHANNELS: u64 = 32;
/// One connection's buffers for all three protocols: LL 512 KiB (8 lines × 512 threads × 8
/// steps × 16 B) + LL128 4.69 MiB (120 × 640 × 8 × 8 B) + Simple 4 MiB (`NCCL_BUFFSIZE`),
/// 9.19 MiB rounded up to cuMem's 2 MiB granularity (NVIDIA/nccl#1685 logs 10,485,760-byte
/// allocations).
pub const NCCL_CONNECTION_BYTES: u64 = 10 * MIB;
/// One pipeline peer's point-to-point buffers per channel, both directions: NVIDIA/nccl#1685's
/// 3.28 GB that an all-to-all added on 8 H100s over 7 peers × 32 channels.
pub const NCCL_P2P_PEER_CHANNEL_BYTES: u64 = 14 * MIB;
/// NCCL's per-process memory besides connection buffers (its kernels, communicator and proxy
/// state). Measured, not derived: GPT-2 350M dp4 on 4 H200s (NCCL 2.28.3) held 1.84 GiB more
/// per GPU than the same per-GPU run on one H200 (21.14 vs 19.30 GiB, bench/RESULTS.md session
/// 3); this is that less one communicator's ring and tree buffers (0.94 GiB).
pub const NCCL_PROCESS_BYTES: u64 = 920 * MIB;

/// One line of the per-GPU prediction.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceLine {
    /// What holds the memory (`weight casts`, `NCCL collectives`, …), short: a column name.
    pub what: &'static str,
    pub bytes: u64,
    /// How the number is made.
    pub basis: String,
}

/// One program's predicted memory per GPU on the CUDA backend.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceMemory {
    pub program: ProgramId,
    /// The memory plan's persistent region plus arena.
    pub planned_bytes: u64,
    /// What the CUDA backend allocates beside the plan (its `memory_reserved_bytes` is
    /// `planned_bytes` plus these).
    pub backend: Vec<DeviceLine>,
    /// What the CUDA context and NCCL hold (counted by nvidia-smi, not by the backend).
    pub runtime: Vec<DeviceLine>,
    /// `planned_bytes` plus the backend's lines: the predicted `memory_reserved_bytes`.
    pub reserved_bytes: u64,
    /// Everything: the predicted nvidia-smi `memory.used` of the GPU.
    pub total_bytes: u64,
}

fn aligned(bytes: u64) -> u64 {
    bytes.next_multiple_of(super::ALIGN)
}

/// The backend's lines for `program` (see the module docs).
fn backend_lines(program: &Program, target: KernelTarget) -> Vec<DeviceLine> {
    let s = backend_scratch(program, target);
    let mut lines = Vec::new();
    if s.weight_casts > 0 {
        lines.push(DeviceLine {
            what: "weight casts",
            bytes: s.weight_casts,
            basis: "16-bit copies (2 bytes per element) of every f32 parameter a GEMM reads as its weight".into(),
        });
    }
    let vectors = if target.half() && s.gemm_vector_len > 0 {
        aligned(super::ALIGN + s.gemm_vector_len * 4)
    } else {
        0
    };
    if s.gemm_operands + vectors > 0 {
        lines.push(DeviceLine {
            what: "GEMM scratch",
            bytes: s.gemm_operands + vectors,
            basis: "the largest GEMM's 16-bit copies of f32 operands plus the output its \
                    algorithms are timed into, and the bias vector area"
                .into(),
        });
    }
    if s.fp8 > 0 {
        lines.push(DeviceLine {
            what: "FP8 GEMM scratch",
            bytes: s.fp8,
            basis: "the largest FP8 GEMM's operands quantized to one byte an element, their \
                    scale groups' amaxes and dequantization factors"
                .into(),
        });
    }
    lines.push(DeviceLine {
        what: "op scratch",
        bytes: s.reduction.max(MIN_REDUCTION_SCRATCH),
        basis: "the largest op's partial sums, per-row losses or attention copies and \
                statistics (at least 1 MiB)"
            .into(),
    });
    if s.aliased > 0 {
        lines.push(DeviceLine {
            what: "aliased copies",
            bytes: s.aliased,
            basis: "the largest op's inputs that are also its outputs".into(),
        });
    }
    lines.push(DeviceLine {
        what: "cuBLASLt",
        bytes: CUBLASLT_WORKSPACE_BYTES,
        basis: "cuBLASLt's workspace, fixed".into(),
    });
    lines
}

/// The communicators (by partition) `program` runs collectives on, with their set size
/// (sets of one rank need no buffers), and its distinct point-to-point peers.
fn communication(plan: &Plan, program: &Program) -> (Vec<u64>, usize) {
    let mut partitions: Vec<(&[Vec<u32>], u64)> = Vec::new();
    let mut peers: HashSet<Peer> = HashSet::new();
    // A group's partition is looked at once, at its first collective (a program runs tens of
    // thousands of collectives on a few groups).
    let mut seen = vec![false; plan.groups.len()];
    for instr in &program.instrs {
        match instr {
            Instr::Collective { group, .. } => {
                let (Some(g), Some(seen)) = (
                    plan.groups.get(group.0 as usize),
                    seen.get_mut(group.0 as usize),
                ) else {
                    continue;
                };
                if std::mem::replace(seen, true) {
                    continue;
                }
                // One communicator per distinct partition (the whole world as one set is the
                // world communicator), as `runtime/src/comm/layout.rs` splits them.
                let size = g.sets.iter().map(Vec::len).max().unwrap_or(0) as u64;
                let sets = g.sets.as_slice();
                if size > 1 && !partitions.iter().any(|p| p.0 == sets) {
                    partitions.push((sets, size));
                }
            }
            Instr::Send { peer, .. } | Instr::Recv { peer, .. } => {
                peers.insert(*peer);
            }
            Instr::P2p { ops } => peers.extend(ops.iter().map(|o| match o {
                P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } => *peer,
            })),
            _ => {}
        }
    }
    (
        partitions.into_iter().map(|(_, n)| n).collect(),
        peers.len(),
    )
}

/// The CUDA context's and NCCL's lines for `program` in `plan` (NCCL only with several ranks).
fn runtime_lines(plan: &Plan, program: &Program) -> Vec<DeviceLine> {
    let mut lines = vec![DeviceLine {
        what: "CUDA context",
        bytes: CUDA_CONTEXT_BYTES,
        basis: "the context with its loaded kernels, measured on one H200 (nvidia-smi above the backend's reserved bytes)".into(),
    }];
    if plan.world < 2 {
        return lines;
    }
    lines.push(DeviceLine {
        what: "NCCL state",
        bytes: NCCL_PROCESS_BYTES,
        basis: "NCCL's kernels and communicator state per process, measured on 4 H200s (GPT-2 350M dp4 against one GPU)".into(),
    });
    let (communicators, peers) = communication(plan, program);
    if !communicators.is_empty() {
        // Ring: one receiving connection per channel; tree (a chain within a node): two, one
        // for a set of two ranks.
        let connections: u64 = communicators.iter().map(|&n| 1 + (n - 1).min(2)).sum();
        let sizes: Vec<String> = communicators.iter().map(|n| n.to_string()).collect();
        lines.push(DeviceLine {
            what: "NCCL collectives",
            bytes: connections * NCCL_CHANNELS * NCCL_CONNECTION_BYTES,
            basis: format!(
                "ring and tree buffers of {} communicator(s) of {} ranks: {connections} \
                 connections × {NCCL_CHANNELS} channels × 10 MiB",
                communicators.len(),
                sizes.join(", ")
            ),
        });
    }
    if peers > 0 {
        lines.push(DeviceLine {
            what: "NCCL p2p",
            bytes: peers as u64 * NCCL_CHANNELS * NCCL_P2P_PEER_CHANNEL_BYTES,
            basis: format!("pipeline send/receive buffers: {peers} peer(s) × {NCCL_CHANNELS} channels × 14 MiB"),
        });
    }
    lines
}

fn sum(lines: &[DeviceLine]) -> u64 {
    lines.iter().map(|l| l.bytes).sum()
}

/// What the CUDA backend should hold for `program` with a memory plan of `planned_bytes`
/// (persistent region plus arena) on `target`: its predicted `reserved_bytes`.
pub fn predicted_reserved(program: &Program, planned_bytes: u64, target: KernelTarget) -> u64 {
    planned_bytes + sum(&backend_lines(program, target))
}

/// Each program's predicted memory per GPU on the CUDA backend, beside its memory plan
/// (`summaries`, in program order), on `target` (16-bit operands where `train.precision` is
/// bf16 or fp16; a Hopper where the cluster's GPU is one).
pub fn device_memory(
    plan: &Plan,
    summaries: &[PlanSummary],
    target: KernelTarget,
) -> Vec<DeviceMemory> {
    plan.programs
        .iter()
        .zip(summaries)
        .map(|(program, summary)| {
            let planned_bytes = summary.persistent_bytes + summary.arena_bytes;
            program_device_memory(plan, (summary.program, program), planned_bytes, target)
        })
        .collect()
}

/// What a GPU holds for a rank running `program` (`id` in `plan`) with a memory plan of
/// `planned_bytes` (persistent region plus arena) on `target`.
pub fn program_device_memory(
    plan: &Plan,
    (id, program): (ProgramId, &Program),
    planned_bytes: u64,
    target: KernelTarget,
) -> DeviceMemory {
    DeviceMemory {
        program: id,
        planned_bytes: 0,
        backend: backend_lines(program, target),
        runtime: runtime_lines(plan, program),
        reserved_bytes: 0,
        total_bytes: 0,
    }
    .with_planned_bytes(planned_bytes)
}

impl DeviceMemory {
    /// The same lines beside a memory plan of `planned_bytes`: what the GPU holds when only
    /// the plan's size differs (the backend's and runtime's lines do not depend on it).
    pub fn with_planned_bytes(self, planned_bytes: u64) -> DeviceMemory {
        let reserved_bytes = planned_bytes + sum(&self.backend);
        let total_bytes = reserved_bytes + sum(&self.runtime);
        DeviceMemory {
            planned_bytes,
            reserved_bytes,
            total_bytes,
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::testspec::{build, Dims, Plan as PlanChoice};

    use crate::lower::lower;

    use crate::memplan::{plan_summaries, OperandFormat};
    use crate::spec::{Precision, ZeroStage};

    const GIB: f64 = (1u64 << 30) as f64;

    /// Every program's prediction for `dims` under `choice`.
    fn predict(dims: &Dims, choice: &PlanChoice) -> (Plan, Vec<DeviceMemory>) {
        let spec = build(dims, choice);
        let plan = lower(&spec).expect("lowers");
        let report = crate::verify::verify_spec(&plan, &spec).expect("verifies");
        let summaries = plan_summaries(&plan, &report).expect("plans");
        let target = KernelTarget {
            operands: OperandFormat::of(&choice.precision),
            hopper: true,
        };
        let device = device_memory(&plan, &summaries, target);
        (plan, device)
    }

    fn line(lines: &[DeviceLine], what: &str) -> Option<u64> {
        lines.iter().find(|l| l.what == what).map(|l| l.bytes)
    }

    /// Each program's runtime line `what`.
    fn each_program(device: &[DeviceMemory], what: &str) -> Vec<Option<u64>> {
        device.iter().map(|d| line(&d.runtime, what)).collect()
    }

    #[test]
    fn gpt2_350m_dp4_zero0_lands_within_ten_percent_of_the_four_h200_run() {
        // nvidia-smi's peak per GPU on 4 H200s (bench/RESULTS.md, session 3), ZeRO-0. That run
        // held f32 weights and cached 16-bit casts of them; the runtime now holds f32 masters
        // and bf16 working copies, the same bytes, so ZeRO-0 still compares. ZeRO-1..3 hold
        // less than they did then and wait for a multi-GPU run to be measured again
        // (docs/memory.md).
        let choice = PlanChoice {
            dp: 4,
            zero: ZeroStage::Zero0,
            microbatches: 1,
            micro_batch: 16,
            precision: Precision::Bf16,
            ..PlanChoice::default()
        };
        let (_, device) = predict(&Dims::gpt2_350m(), &choice);
        let d = &device[0];
        let (total, smi) = (d.total_bytes as f64 / GIB, 21.14);
        assert!(
            (total / smi - 1.0).abs() <= 0.10,
            "predicted {total:.2} GiB, measured {smi} GiB"
        );
        assert!(line(&d.runtime, "NCCL collectives").is_some());
        assert_eq!(line(&d.runtime, "NCCL p2p"), None);
    }

    #[test]
    fn bf16_runs_keep_their_weights_in_bf16_so_the_backend_casts_only_biases() {
        let zeros = [
            ZeroStage::Zero0,
            ZeroStage::Zero1,
            ZeroStage::Zero2,
            ZeroStage::Zero3,
        ];
        for zero in zeros {
            let choice = PlanChoice {
                dp: 4,
                zero,
                microbatches: 2,
                micro_batch: 4,
                precision: Precision::Bf16,
                ..PlanChoice::default()
            };
            let (plan, _) = predict(&crate::memplan::tests::small_model(), &choice);
            let program = &plan.programs[0];
            let target = KernelTarget {
                operands: OperandFormat::Bf16,
                hopper: true,
            };
            let scratch = crate::memplan::backend_scratch(program, target);
            let cast_shapes = scratch.casts.iter().filter_map(|&id| program.buffer(id));
            for b in cast_shapes {
                assert_eq!(b.shape.len(), 1, "{zero:?}: {} is cast", b.name);
            }
        }
    }

    #[test]
    fn one_rank_runs_have_no_nccl_and_fp32_runs_no_casts() {
        let dims = crate::memplan::tests::small_model();
        let (_, device) = predict(&dims, &PlanChoice::default());
        let d = &device[0];
        assert_eq!(line(&d.backend, "weight casts"), None);
        assert_eq!(line(&d.backend, "GEMM scratch"), None);
        assert_eq!(line(&d.runtime, "CUDA context"), Some(CUDA_CONTEXT_BYTES));
        assert!(d.runtime.iter().all(|l| !l.what.starts_with("NCCL")));
        let sum: u64 = d.backend.iter().chain(&d.runtime).map(|l| l.bytes).sum();
        assert_eq!(d.total_bytes, d.planned_bytes + sum);
    }

    #[test]
    fn each_distinct_communicator_a_stage_uses_has_its_buffers() {
        // pp 4, tied embedding: the first and last stages all-reduce the embedding's gradient
        // over their pair and the gradient norm over the world; the middle ones the norm only.
        let dims = crate::memplan::tests::small_model();
        let choice = PlanChoice {
            pp: 4,
            microbatches: 4,
            ..PlanChoice::default()
        };
        let (plan, device) = predict(&dims, &choice);
        let connection = NCCL_CHANNELS * NCCL_CONNECTION_BYTES;
        let collectives = each_program(&device, "NCCL collectives");
        let (pair, world) = (2 * connection, 3 * connection);
        assert_eq!(plan.programs.len(), 4);
        assert_eq!(
            collectives,
            [
                Some(pair + world),
                Some(world),
                Some(world),
                Some(pair + world)
            ]
        );
        // Stages 0 and 3 have one neighbour, the middle ones two.
        let peers = each_program(&device, "NCCL p2p");
        let peer = NCCL_CHANNELS * NCCL_P2P_PEER_CHANNEL_BYTES;
        assert_eq!(
            peers,
            [Some(peer), Some(2 * peer), Some(2 * peer), Some(peer)]
        );
    }

    #[test]
    fn pipeline_ranks_count_their_peers_and_their_data_parallel_communicator() {
        let dims = crate::memplan::tests::small_model();
        let choice = PlanChoice {
            dp: 2,
            pp: 2,
            microbatches: 4,
            precision: Precision::Bf16,
            ..PlanChoice::default()
        };
        let (plan, device) = predict(&dims, &choice);
        assert_eq!(plan.programs.len(), 2);
        for d in &device {
            // One neighbouring stage; the dp pair's ring plus a two-rank chain: 2 connections.
            assert_eq!(
                line(&d.runtime, "NCCL p2p"),
                Some(NCCL_CHANNELS * NCCL_P2P_PEER_CHANNEL_BYTES)
            );
            let collectives = line(&d.runtime, "NCCL collectives").expect("dp all-reduce");
            assert!(collectives >= 2 * NCCL_CHANNELS * NCCL_CONNECTION_BYTES);
            assert_eq!(line(&d.runtime, "NCCL state"), Some(NCCL_PROCESS_BYTES));
        }
    }
}
