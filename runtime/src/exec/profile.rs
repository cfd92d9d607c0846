//! Per-kernel timing of one training step (`parc run --profile`): which kind of work each
//! instruction is, how much arithmetic (FLOPs, for matmuls and attention) or memory traffic
//! (bytes read + written, for memory-bound ops) it does, and the per-kind totals of one step.
//!
//! The executor fills a [`StepProfile`] only for the profiled step, so a run without
//! `--profile` pays nothing. A backend with a device clock (CUDA: events on its stream) times
//! the instructions where they run, without per-instruction synchronization; others are timed
//! on the host around synchronizations ([`StepProfile::device_timed`] says which). FLOPs come
//! from an op's dimensions; bytes from the sizes of the buffers it reads and writes, an output
//! it adds into counted twice (a lower bound on its traffic).
use parc_compiler::ir::op::Op;
use parc_compiler::ir::table::{Family, FlopCount, Opcode};
use parc_compiler::ir::{BufferId, Instr, Program};
use parc_compiler::timeline::{compute_seconds, StepCosts};
use serde::Serialize;
use std::collections::HashMap;

/// The kinds of work a step's time is split into, in report order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    MatmulFwd,
    MatmulBwdData,
    MatmulBwdWeight,
    AttentionFwd,
    AttentionBwd,
    Norm,
    Embedding,
    Elementwise,
    CrossEntropy,
    Optimizer,
    Collective,
    P2p,
    AllocFree,
    DataLoad,
    /// Step time outside the instructions (the loop, reading the step's metrics).
    Other,
}

impl OpKind {
    pub const ALL: [OpKind; 15] = [
        OpKind::MatmulFwd,
        OpKind::MatmulBwdData,
        OpKind::MatmulBwdWeight,
        OpKind::AttentionFwd,
        OpKind::AttentionBwd,
        OpKind::Norm,
        OpKind::Embedding,
        OpKind::Elementwise,
        OpKind::CrossEntropy,
        OpKind::Optimizer,
        OpKind::Collective,
        OpKind::P2p,
        OpKind::AllocFree,
        OpKind::DataLoad,
        OpKind::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpKind::MatmulFwd => "matmul_fwd",
            OpKind::MatmulBwdData => "matmul_bwd_data",
            OpKind::MatmulBwdWeight => "matmul_bwd_weight",
            OpKind::AttentionFwd => "attention_fwd",
            OpKind::AttentionBwd => "attention_bwd",
            OpKind::Norm => "norm",
            OpKind::Embedding => "embedding",
            OpKind::Elementwise => "elementwise",
            OpKind::CrossEntropy => "cross_entropy",
            OpKind::Optimizer => "optimizer",
            OpKind::Collective => "collective",
            OpKind::P2p => "p2p",
            OpKind::AllocFree => "alloc_free",
            OpKind::DataLoad => "data_load",
            OpKind::Other => "other",
        }
    }

    /// Whether the kind is judged by arithmetic (TFLOP/s) rather than memory traffic (GB/s).
    pub fn compute_bound(self) -> bool {
        matches!(
            self,
            OpKind::MatmulFwd
                | OpKind::MatmulBwdData
                | OpKind::MatmulBwdWeight
                | OpKind::AttentionFwd
                | OpKind::AttentionBwd
        )
    }

    /// Whether the kind moves data on the device, so GB/s against HBM bandwidth means
    /// something (not for comm, allocation, data loading or the residual).
    pub fn memory_bound(self) -> bool {
        matches!(
            self,
            OpKind::Norm
                | OpKind::Embedding
                | OpKind::Elementwise
                | OpKind::CrossEntropy
                | OpKind::Optimizer
        )
    }
}

/// The kind of work `instr` is.
pub fn classify(instr: &Instr) -> OpKind {
    match instr {
        Instr::Compute { op, .. } => op_kind(op),
        Instr::Collective { .. } => OpKind::Collective,
        Instr::Send { .. } | Instr::Recv { .. } | Instr::P2p { .. } => OpKind::P2p,
        Instr::LoadBatch { .. } => OpKind::DataLoad,
        Instr::Alloc { .. } | Instr::Free { .. } => OpKind::AllocFree,
    }
}

/// The buffers communication of `program` uses, each with its kind: `P2p` for what a pipeline
/// transfer (`Send`, `Recv`, `P2p`) sends or receives, `Collective` for a collective's input and
/// output (a buffer both use counts as `P2p`).
pub fn communicated_buffers(program: &Program) -> HashMap<BufferId, OpKind> {
    let mut kinds = HashMap::new();
    for instr in &program.instrs {
        let kind = match instr {
            Instr::Send { .. } | Instr::Recv { .. } | Instr::P2p { .. } => OpKind::P2p,
            Instr::Collective { .. } => OpKind::Collective,
            _ => continue,
        };
        for b in instr.reads().into_iter().chain(instr.writes()) {
            let entry = kinds.entry(b).or_insert(kind);
            if kind == OpKind::P2p {
                *entry = OpKind::P2p;
            }
        }
    }
    kinds
}

/// The buffers of `communicated` that a local instruction (compute, `Alloc`, `Free`) uses, and
/// the kind its wait counts as (`P2p` if any is a transfer's): a device that queues
/// communication makes such an instruction first wait for it, which a device-timed profile
/// times apart from the instruction's work. None when it uses none.
pub fn communication_wait(
    instr: &Instr,
    communicated: &HashMap<BufferId, OpKind>,
) -> Option<(OpKind, Vec<BufferId>)> {
    let used = match instr {
        Instr::Compute { .. } => instr.reads().into_iter().chain(instr.writes()).collect(),
        Instr::Alloc { buffer } | Instr::Free { buffer } => vec![*buffer],
        _ => Vec::new(),
    };
    let mut kind = None;
    let mut waits: Vec<BufferId> = Vec::new();
    for b in used {
        if let Some(&k) = communicated.get(&b) {
            if kind != Some(OpKind::P2p) {
                kind = Some(k);
            }
            if !waits.contains(&b) {
                waits.push(b);
            }
        }
    }
    kind.map(|k| (k, waits))
}

/// The profile's kind of an op: its family (`ir::table`), with matmuls split by direction
/// and attention by pass, and rope, activations and data movement counted as elementwise.
fn op_kind(op: &Op) -> OpKind {
    match (op.opcode().family(), op.opcode()) {
        (Family::Matmul, Opcode::MatmulBwdData) => OpKind::MatmulBwdData,
        (Family::Matmul, Opcode::MatmulBwdWeight) => OpKind::MatmulBwdWeight,
        // An FP8 operand's amax pass reads it once, as its delayed-scaling record does, its
        // quantization reads it and writes a byte an element, and a history's roll touches a
        // few values: memory bound, as elementwise work.
        (
            Family::Matmul,
            Opcode::Fp8Amax | Opcode::Fp8AmaxRecord | Opcode::Fp8HistoryRoll | Opcode::Fp8Quantize,
        ) => OpKind::Elementwise,
        (Family::Matmul, _) => OpKind::MatmulFwd,
        (Family::Attention, Opcode::AttentionBwd) => OpKind::AttentionBwd,
        (Family::Attention, _) => OpKind::AttentionFwd,
        (Family::Norm, _) => OpKind::Norm,
        (Family::Embedding, _) => OpKind::Embedding,
        (Family::Elementwise | Family::DataMovement, _) => OpKind::Elementwise,
        (Family::Loss, _) => OpKind::CrossEntropy,
        (Family::Optimizer, _) => OpKind::Optimizer,
    }
}

/// Floating-point operations a compute-bound op executes (`Op::flops`, `FlopCount::Executed`),
/// or None for ops judged by bytes. `first_input_numel` is the element count of the op's first
/// input (x for a matmul, dy for its backward), which gives the row count.
pub fn flops(op: &Op, first_input_numel: u64) -> Option<f64> {
    if !(op.is_gemm() || op.opcode().family() == Family::Attention) {
        return None;
    }
    let rows = op
        .signature()
        .rows_from_inputs(|i| if i == 0 { first_input_numel } else { 0 })
        .unwrap_or(0);
    Some(op.flops(rows as f64, FlopCount::Executed))
}

/// The name a compute instruction's work is listed under in the per-op table: its opcode's,
/// with a GEMM's epilogue after it and its layer's dimensions (`matmul+bias+gelu_tanh
/// 768->3072`, `matmul_bwd_weight+acc 3072->768`, `matmul+swiglu` with SwiGLU's pass,
/// `+fp8_tensorwise`), a generated kernel's with what it replaces (`fused swi_glu`); None for
/// other instructions.
pub fn op_label(instr: &Instr) -> Option<String> {
    let op = instr.as_compute()?.op;
    let mut label = match op {
        Op::Fused(f) => format!("fused {}", f.name),
        _ => op.opcode().name().to_string(),
    };
    let mut part = |on: bool, name: &str| {
        if on {
            label.push('+');
            label.push_str(name);
        }
    };
    match op {
        Op::Matmul {
            bias,
            act,
            residual,
            swiglu,
            ..
        } => {
            part(*bias, "bias");
            part(act.is_some(), act.map_or("", |a| a.name()));
            part(*residual, "residual");
            part(*swiglu, "swiglu");
        }
        Op::MatmulBwdData {
            accumulate,
            act_grad,
            swiglu,
            ..
        } => {
            part(act_grad.is_some(), act_grad.map_or("", |a| a.name()));
            part(*accumulate, "acc");
            part(*swiglu, "swiglu");
        }
        Op::MatmulBwdWeight {
            bias,
            accumulate_param_grad,
            ..
        } => {
            part(*bias, "bias");
            part(*accumulate_param_grad, "acc");
        }
        _ => {}
    }
    if let Some(f) = op.fp8() {
        label.push_str(&format!("+fp8_{}", f.scaling.name()));
    }
    if let Some((in_dim, out_dim)) = op.gemm_dims() {
        label.push_str(&format!(" {in_dim}->{out_dim}"));
    }
    Some(label)
}

/// The seconds `costs` (the timeline's pricing: the GPU's peak numbers or a calibration
/// profile) gives `program`'s compute instructions under each [`op_label`], with the op's kind,
/// in the order the labels first appear: what `parc check` predicts, beside what the profiled
/// step measured (a kind's prediction is the sum of its ops'). A run the backend fuses is priced
/// as the timeline prices it: one launch, under its first member's label.
pub fn predicted_ops(program: &Program, costs: &dyn StepCosts) -> Vec<(String, OpKind, f64)> {
    let mut seconds: Vec<(String, OpKind, f64)> = Vec::new();
    let priced = compute_seconds(program, costs);
    for (instr, &s) in program.instrs.iter().zip(&priced) {
        let Some(label) = op_label(instr) else {
            continue;
        };
        match seconds.iter_mut().find(|(l, _, _)| *l == label) {
            Some((_, _, total)) => *total += s,
            None => seconds.push((label, classify(instr), s)),
        }
    }
    seconds
}

/// Totals of one op (an [`op_label`]) over the profiled step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OpTotals {
    pub label: String,
    pub kind: OpKind,
    pub count: u64,
    pub seconds: f64,
    pub flops: f64,
    pub bytes: f64,
}

/// Totals of one kind of work over the profiled step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct KindTotals {
    pub kind: OpKind,
    /// Instructions of this kind run.
    pub count: u64,
    pub seconds: f64,
    /// FLOPs done (compute-bound kinds).
    pub flops: f64,
    /// Bytes of the buffers read and written.
    pub bytes: f64,
}

/// Where one step's time went, on one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct StepProfile {
    /// 0-based step index profiled.
    pub step: u64,
    pub rank: u32,
    /// Wall time of the whole step.
    pub step_seconds: f64,
    /// Whether the instructions were timed on the device's queue (between time marks the
    /// backend recorded after each one, with no waiting between them: the step ran as it does
    /// unprofiled, and an instruction's time includes any idle gap before it) rather than on
    /// the host between synchronizations (each instruction alone, launch and wait included).
    pub device_timed: bool,
    /// One entry per [`OpKind`], in [`OpKind::ALL`] order; `Other` holds the step time
    /// outside the instructions, so the seconds sum to `step_seconds`.
    pub kinds: Vec<KindTotals>,
    /// The compute instructions' time per [`op_label`], in the order the labels first ran
    /// (each also counted in its kind).
    pub ops: Vec<OpTotals>,
}

impl StepProfile {
    pub fn new(step: u64, rank: u32) -> StepProfile {
        StepProfile {
            step,
            rank,
            step_seconds: 0.0,
            device_timed: false,
            kinds: OpKind::ALL
                .iter()
                .map(|&kind| KindTotals {
                    kind,
                    count: 0,
                    seconds: 0.0,
                    flops: 0.0,
                    bytes: 0.0,
                })
                .collect(),
            ops: Vec::new(),
        }
    }

    /// Add one timed instruction.
    /// As [`StepProfile::add`], for a compute instruction listed under `label` too.
    pub fn add_op(&mut self, label: String, kind: OpKind, seconds: f64, flops: f64, bytes: f64) {
        self.add(kind, seconds, flops, bytes);
        match self.ops.iter_mut().find(|o| o.label == label) {
            Some(o) => {
                o.count += 1;
                o.seconds += seconds;
                o.flops += flops;
                o.bytes += bytes;
            }
            None => self.ops.push(OpTotals {
                label,
                kind,
                count: 1,
                seconds,
                flops,
                bytes,
            }),
        }
    }

    pub fn add(&mut self, kind: OpKind, seconds: f64, flops: f64, bytes: f64) {
        if let Some(totals) = self.kinds.iter_mut().find(|t| t.kind == kind) {
            totals.count += 1;
            totals.seconds += seconds;
            totals.flops += flops;
            totals.bytes += bytes;
        }
    }

    /// Close the step: its wall time, and the part no instruction accounts for as `Other`.
    pub fn finish(&mut self, step_seconds: f64) {
        let timed: f64 = self
            .kinds
            .iter()
            .filter(|t| t.kind != OpKind::Other)
            .map(|t| t.seconds)
            .sum();
        self.step_seconds = step_seconds.max(timed);
        if let Some(other) = self.kinds.iter_mut().find(|t| t.kind == OpKind::Other) {
            other.seconds = self.step_seconds - timed;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parc_compiler::ir::op::{AttentionAttrs, Segment};

    fn seg(start: u32, len: u32) -> Vec<Segment> {
        vec![Segment { start, len }]
    }

    #[test]
    fn waits_are_the_local_uses_of_communicated_buffers() {
        use parc_compiler::ir::{CollectiveKind, GroupId, P2pOp, Peer, ReduceOp};
        use parc_compiler::spec::Axis;
        let b = BufferId;
        let peer = Peer {
            axis: Axis::Pp,
            coord: 1,
        };
        let program = Program::new(
            "test",
            Vec::new(),
            vec![
                Instr::Alloc { buffer: b(2) },
                Instr::P2p {
                    ops: vec![
                        P2pOp::Send {
                            peer,
                            buffer: b(1),
                            tag: 0,
                        },
                        P2pOp::Recv {
                            peer,
                            buffer: b(2),
                            tag: 1,
                        },
                    ],
                },
                Instr::Collective {
                    kind: CollectiveKind::AllReduce { op: ReduceOp::Sum },
                    group: GroupId(0),
                    input: b(3),
                    output: b(3),
                    node: None,
                },
                Instr::compute(Op::Add, &[2, 2], &[4]),
                Instr::compute(Op::Add, &[3, 4], &[5]),
                Instr::Free { buffer: b(1) },
            ],
        );
        let communicated = communicated_buffers(&program);
        let mut kinds: Vec<(u32, OpKind)> = communicated.iter().map(|(b, k)| (b.0, *k)).collect();
        kinds.sort_by_key(|(b, _)| *b);
        assert_eq!(
            kinds,
            [(1, OpKind::P2p), (2, OpKind::P2p), (3, OpKind::Collective)]
        );
        let waits: Vec<Option<(OpKind, Vec<u32>)>> = program
            .instrs
            .iter()
            .map(|i| {
                communication_wait(i, &communicated)
                    .map(|(k, bufs)| (k, bufs.iter().map(|b| b.0).collect()))
            })
            .collect();
        // The communication itself waits for nothing here; the received buffer's reader (once,
        // though it reads it twice), the collective's reader and the sent buffer's free do.
        assert_eq!(
            waits,
            [
                Some((OpKind::P2p, vec![2])),
                None,
                None,
                Some((OpKind::P2p, vec![2])),
                Some((OpKind::Collective, vec![3])),
                Some((OpKind::P2p, vec![1])),
            ]
        );
    }

    #[test]
    fn matmul_flops_are_two_per_multiply_add() {
        let fwd = Op::Matmul {
            in_dim: 64,
            out_dim: 256,
            bias: true,
            act: None,
            residual: false,
            swiglu: false,
            fp8: None,
        };
        // x is [8, 64]: 8 rows.
        assert_eq!(flops(&fwd, 8 * 64), Some(2.0 * 8.0 * 64.0 * 256.0));
        let bwd = Op::MatmulBwdData {
            in_dim: 64,
            out_dim: 256,
            accumulate: false,
            act_grad: None,
            swiglu: false,
            fp8: None,
        };
        // dy is [8, 256].
        assert_eq!(flops(&bwd, 8 * 256), Some(2.0 * 8.0 * 64.0 * 256.0));
        assert_eq!(flops(&Op::Add, 100), None);
    }

    #[test]
    fn causal_attention_scores_only_earlier_keys() {
        // 1 + 2 + 3 + 4 pairs (the table's tests cover the pair count).
        let op = Op::Attention(AttentionAttrs {
            batch: 2,
            heads: 3,
            kv_heads: 3,
            head_dim: 8,
            causal: true,
            scale: 0.35,
            q_positions: seg(0, 4),
            kv_positions: seg(0, 4),
            packed: false,
        });
        assert_eq!(flops(&op, 0), Some(4.0 * 2.0 * 3.0 * 8.0 * 10.0));
    }

    #[test]
    fn finish_puts_untimed_step_time_in_other() {
        let mut p = StepProfile::new(2, 0);
        p.add(OpKind::MatmulFwd, 0.3, 1e9, 0.0);
        p.add(OpKind::Elementwise, 0.2, 0.0, 1e6);
        p.finish(1.0);
        let total: f64 = p.kinds.iter().map(|t| t.seconds).sum();
        assert!((total - 1.0).abs() < 1e-12);
        let other = p.kinds.iter().find(|t| t.kind == OpKind::Other).unwrap();
        assert!((other.seconds - 0.5).abs() < 1e-12);
        assert_eq!(
            classify(&Instr::Free {
                buffer: parc_compiler::ir::BufferId(0)
            }),
            OpKind::AllocFree
        );
    }
}
