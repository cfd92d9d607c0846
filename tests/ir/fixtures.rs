//! Hand-built specs for the IR tests (GPT-2 style and Llama style tiny models, the decoder of
//! `parc_compiler::testing` on a CPU cluster), so lowering is tested without the parser, plus
//! a plan simulator that executes every rank's program symbolically: buffer lifetimes, shapes
//! of collectives and transfers, and rendezvous progress (an unmatched or misordered transfer
//! or collective shows up as no progress); [`train_cpu`] trains a spec's plan on the CPU.

use parc_compiler::diag::Span;
use parc_compiler::ir::{CollectiveKind, Instr, P2pOp, Plan};
use parc_compiler::spec::*;
use parc_compiler::testing::{adamw, decoder_model, train, Dims as Decoder};
use std::collections::HashSet;

pub struct TinyModel {
    pub layers: u32,
    pub llama: bool,
    pub tied: bool,
}

#[derive(Clone)]
pub struct PlanChoice {
    pub dp: u32,
    pub pp: u32,
    pub cp: u32,
    pub tp: u32,
    pub zero: ZeroStage,
    pub schedule: PipelineSchedule,
    pub microbatches: u32,
    pub recompute: Recompute,
    pub sp: bool,
}

/// Less common choices, kept out of `PlanChoice` so its literal stays stable for its users.
#[derive(Clone, Copy)]
pub struct Variant {
    /// Mesh axes outermost first.
    pub order: [Axis; 4],
    /// SGD with momentum instead of AdamW (Adam turns float noise in near-zero gradients into
    /// visible parameter differences; SGD keeps parameters comparable at 1e-6).
    pub sgd: bool,
    /// How the repeated layers split over the pipeline's chunks.
    pub split: Split,
    /// What sequence-parallel layers keep of their gathered input (`parallel.sp_save`).
    pub sp_save: SpSave,
}

/// `parallel.balance` / `parallel.layers` of a hand-built spec.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Split {
    Even,
    /// Layers per chunk, in chunk order.
    Given(&'static [u32]),
    Auto,
}

impl Default for Variant {
    fn default() -> Self {
        Variant {
            order: [Axis::Dp, Axis::Pp, Axis::Cp, Axis::Tp],
            sgd: false,
            split: Split::Even,
            sp_save: SpSave::Sharded,
        }
    }
}

impl Default for PlanChoice {
    fn default() -> Self {
        PlanChoice {
            dp: 1,
            pp: 1,
            cp: 1,
            tp: 1,
            zero: ZeroStage::Zero0,
            schedule: PipelineSchedule::OneFOneB,
            microbatches: 2,
            recompute: Recompute::None,
            sp: false,
        }
    }
}

impl PlanChoice {
    /// The default choice on the mesh `dp` × `pp` × `cp` × `tp`, with ZeRO stage `zero`.
    pub fn mesh(dp: u32, pp: u32, cp: u32, tp: u32, zero: ZeroStage) -> PlanChoice {
        PlanChoice {
            dp,
            pp,
            cp,
            tp,
            zero,
            ..PlanChoice::default()
        }
    }
}

/// Model sizes.
pub struct Dims {
    pub vocab: u64,
    pub dim: u64,
    pub seq: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub ffn: u64,
    pub micro_batch: u64,
}

/// The tiny sizes every equivalence test uses (GQA 4/2 for the Llama style).
pub fn tiny_dims(llama: bool) -> Dims {
    Dims {
        vocab: 32,
        dim: 16,
        seq: 8,
        heads: 4,
        kv_heads: if llama { 2 } else { 4 },
        ffn: 32,
        micro_batch: 2,
    }
}

pub fn spec(model: TinyModel, plan: PlanChoice) -> Spec {
    spec_variant(model, plan, Variant::default())
}

pub fn spec_variant(model: TinyModel, plan: PlanChoice, variant: Variant) -> Spec {
    let dims = tiny_dims(model.llama);
    sized_spec_variant(model, plan, dims, variant)
}

/// `parc_runtime::exec::train` on the CPU backend, each rank with the threads `train` gives it.
#[allow(dead_code)] // for the tests that train; the IR tests include this file too
pub fn train_cpu(
    s: &Spec,
    plan: &Plan,
    options: &parc_runtime::exec::TrainOptions,
) -> parc_runtime::error::Result<parc_runtime::exec::TrainResult> {
    let backend = |_, threads| parc_runtime::cpu::CpuBackend::with_threads(threads);
    parc_runtime::exec::train(s, plan, options, backend, &|_| {})
}

/// GPT-2 124M (12 layers, d 768, 12 heads, ffn 3072, the vocab padded to 50304, seq 1024, a
/// tied head) at `micro_batch`, on one rank.
#[allow(dead_code)] // for the GPU tests; the IR tests include this file too
pub fn gpt2_124m(micro_batch: u64) -> Spec {
    let plan = PlanChoice::default();
    decoder_spec(&Decoder::gpt2_124m(), plan, micro_batch, Variant::default())
}

#[allow(dead_code)] // for the GPU and memory tests; the IR tests include this file too
pub fn sized_spec(model: TinyModel, plan: PlanChoice, dims: Dims) -> Spec {
    sized_spec_variant(model, plan, dims, Variant::default())
}

pub fn sized_spec_variant(
    model: TinyModel,
    plan: PlanChoice,
    dims: Dims,
    variant: Variant,
) -> Spec {
    let decoder = Decoder {
        vocab: dims.vocab,
        dim: dims.dim,
        seq: dims.seq,
        heads: dims.heads,
        kv_heads: dims.kv_heads,
        ffn: dims.ffn,
        layers: model.layers,
        llama: model.llama,
        tied: model.tied,
    };
    decoder_spec(&decoder, plan, dims.micro_batch, variant)
}

/// The decoder `decoder` trained with `plan` at `micro_batch` sequences per microbatch, on a
/// CPU cluster of one node.
pub fn decoder_spec(
    decoder: &Decoder,
    plan: PlanChoice,
    micro_batch: u64,
    variant: Variant,
) -> Spec {
    let optimizer = if variant.sgd {
        Optimizer::Sgd {
            lr: 1e-1,
            momentum: 0.9,
            weight_decay: 0.1,
        }
    } else {
        adamw()
    };
    let (balance, chunk_layers) = match variant.split {
        Split::Even => (Balance::Even, Vec::new()),
        Split::Given(counts) => (Balance::Given, counts.to_vec()),
        Split::Auto => (Balance::Auto, Vec::new()),
    };
    let mut spec = Spec {
        model: decoder_model(decoder, "tiny", &plan.recompute, plan.tp, plan.cp),
        parallel: Parallel {
            mesh: Mesh {
                axes: variant
                    .order
                    .iter()
                    .map(|a| {
                        let n = match a {
                            Axis::Dp => plan.dp,
                            Axis::Pp => plan.pp,
                            Axis::Cp => plan.cp,
                            Axis::Tp => plan.tp,
                        };
                        (*a, n)
                    })
                    .collect(),
            },
            zero: plan.zero,
            schedule: plan.schedule,
            microbatches: plan.microbatches,
            recompute: plan.recompute,
            sequence_parallel: plan.sp,
            sp_save: variant.sp_save,
            bucket_bytes: 4096,
            balance,
            chunk_layers,
            cross_node: Vec::new(),
            span: Span::default(),
        },
        train: train(
            micro_batch,
            micro_batch * u64::from(plan.microbatches) * u64::from(plan.dp),
            Precision::Fp32,
            optimizer,
        ),
        cluster: Cluster {
            nodes: 1,
            gpus_per_node: plan.dp * plan.pp * plan.cp * plan.tp,
            gpu: Gpu {
                name: "cpu".into(),
                memory_bytes: 1 << 30,
                peak_flops: 1e12,
                peak_flops_fp32: 1e12,
                peak_flops_fp8: Some(1e12),
                memory_bandwidth: 1e11,
            },
            intra: Link {
                kind: "shm".into(),
                bandwidth: 1e10,
                latency: 1e-6,
            },
            inter: Link {
                kind: "eth".into(),
                bandwidth: 1e9,
                latency: 1e-5,
            },
            span: Span::default(),
        },
    };
    parc_compiler::cost::balance::rebalance(&mut spec);
    spec
}

/// A pending point-to-point op: (is_send, peer rank, tag, elements).
type PendingOp = (bool, u32, u32, u64);

/// Execute every rank's program symbolically. Returns the first problem found.
pub fn simulate(plan: &Plan) -> Result<(), String> {
    let world = plan.world as usize;
    let mut pc = vec![0usize; world];
    let mut alive: Vec<HashSet<u32>> = vec![HashSet::new(); world];
    // Pending p2p ops of the current P2p/Send/Recv instruction: (is_send, peer rank, tag, len).
    let mut pending: Vec<Option<Vec<PendingOp>>> = vec![None; world];
    let progs: Vec<_> = (0..plan.world)
        .map(|r| plan.program_of(r).ok_or(format!("rank {r} has no program")))
        .collect::<Result<_, _>>()?;
    for (r, prog) in progs.iter().enumerate() {
        for (i, b) in prog.buffers.iter().enumerate() {
            if b.kind.is_persistent() {
                alive[r].insert(i as u32);
            }
        }
    }
    let numel = |r: usize, b: parc_compiler::ir::BufferId| -> u64 {
        progs[r]
            .buffers
            .get(b.0 as usize)
            .map(|x| x.numel())
            .unwrap_or(0)
    };
    loop {
        let mut progressed = false;
        // Local instructions.
        for r in 0..world {
            while let Some(instr) = progs[r].instrs.get(pc[r]) {
                let at = format!("rank {r} instr {}", pc[r]);
                match instr {
                    Instr::Alloc { buffer } => {
                        if !alive[r].insert(buffer.0) {
                            return Err(format!("{at}: alloc of live b{}", buffer.0));
                        }
                    }
                    Instr::Free { buffer } => {
                        if !alive[r].remove(&buffer.0) {
                            return Err(format!("{at}: free of dead b{}", buffer.0));
                        }
                    }
                    Instr::Compute { .. } | Instr::LoadBatch { .. } => {}
                    _ => break,
                }
                for b in instr.reads().iter().chain(instr.writes().iter()) {
                    if !alive[r].contains(&b.0) {
                        return Err(format!("{at}: uses dead b{} in {instr:?}", b.0));
                    }
                }
                pc[r] += 1;
                progressed = true;
            }
        }
        // Collectives: a set completes when all members are at a matching collective.
        for r in 0..world {
            let Some(Instr::Collective {
                kind,
                group,
                input,
                output,
                ..
            }) = progs[r].instrs.get(pc[r])
            else {
                continue;
            };
            let g = plan.group(*group).ok_or("bad group")?;
            let (set, idx) = g
                .set_of(r as u32)
                .ok_or(format!("rank {r} not in group {}", g.name))?;
            let n = set.len() as u64;
            let (i_len, o_len) = (numel(r, *input), numel(r, *output));
            let ok = match kind {
                CollectiveKind::AllGather => o_len == n * i_len,
                CollectiveKind::ReduceScatter => i_len == n * o_len,
                _ => i_len == o_len,
            };
            if !ok {
                return Err(format!(
                    "rank {r} instr {}: {kind:?} sizes {i_len} -> {o_len} over {n}",
                    pc[r]
                ));
            }
            let _ = idx;
            let all_there = set.iter().all(|&m| {
                matches!(progs[m as usize].instrs.get(pc[m as usize]),
                    Some(Instr::Collective { kind: k2, group: g2, input: i2, .. })
                    if k2 == kind && g2 == group && numel(m as usize, *i2) == i_len)
            });
            if all_there {
                for &m in set {
                    let m = m as usize;
                    for b in progs[m].instrs[pc[m]].reads() {
                        if !alive[m].contains(&b.0) {
                            return Err(format!("rank {m} instr {}: dead b{}", pc[m], b.0));
                        }
                    }
                    pc[m] += 1;
                }
                progressed = true;
            }
        }
        // Point-to-point.
        for r in 0..world {
            if pending[r].is_none() {
                let ops: Vec<PendingOp> = match progs[r].instrs.get(pc[r]) {
                    Some(Instr::Send { peer, buffer, tag }) => {
                        vec![(
                            true,
                            plan.peer_rank(r as u32, *peer),
                            *tag,
                            numel(r, *buffer),
                        )]
                    }
                    Some(Instr::Recv { peer, buffer, tag }) => {
                        vec![(
                            false,
                            plan.peer_rank(r as u32, *peer),
                            *tag,
                            numel(r, *buffer),
                        )]
                    }
                    Some(Instr::P2p { ops }) => ops
                        .iter()
                        .map(|op| match op {
                            P2pOp::Send { peer, buffer, tag } => (
                                true,
                                plan.peer_rank(r as u32, *peer),
                                *tag,
                                numel(r, *buffer),
                            ),
                            P2pOp::Recv { peer, buffer, tag } => (
                                false,
                                plan.peer_rank(r as u32, *peer),
                                *tag,
                                numel(r, *buffer),
                            ),
                        })
                        .collect(),
                    _ => continue,
                };
                pending[r] = Some(ops);
            }
        }
        for r in 0..world {
            let Some(ops) = pending[r].clone() else {
                continue;
            };
            for (is_send, peer, tag, len) in ops {
                if !is_send {
                    continue;
                }
                let p = peer as usize;
                let Some(theirs) = pending[p].as_mut() else {
                    continue;
                };
                if let Some(pos) = theirs
                    .iter()
                    .position(|o| !o.0 && o.1 == r as u32 && o.2 == tag)
                {
                    if theirs[pos].3 != len {
                        return Err(format!(
                            "rank {r} -> {p} tag {tag}: {len} vs {}",
                            theirs[pos].3
                        ));
                    }
                    theirs.remove(pos);
                    if let Some(mine) = pending[r].as_mut() {
                        mine.retain(|o| !(o.0 && o.1 == peer && o.2 == tag));
                    }
                    progressed = true;
                }
            }
        }
        for r in 0..world {
            if pending[r].as_ref().is_some_and(Vec::is_empty) {
                pending[r] = None;
                pc[r] += 1;
                progressed = true;
            }
        }
        if (0..world).all(|r| pc[r] >= progs[r].instrs.len()) {
            break;
        }
        if !progressed {
            let stuck: Vec<String> = (0..world)
                .filter(|&r| pc[r] < progs[r].instrs.len())
                .map(|r| format!("rank {r} at {}: {:?}", pc[r], progs[r].instrs[pc[r]]))
                .collect();
            return Err(format!("deadlock:\n{}", stuck.join("\n")));
        }
    }
    for (r, prog) in progs.iter().enumerate() {
        let persistent = prog
            .buffers
            .iter()
            .filter(|b| b.kind.is_persistent())
            .count();
        if alive[r].len() != persistent {
            return Err(format!("rank {r}: transient buffers outlive the step"));
        }
    }
    Ok(())
}
