//! Fused and unfused programs compute the same thing.
//!
//! - Op chains (hand-written programs): each is run unfused and fused on the CPU backend, the
//!   fused kernels through the reference evaluator (`kir::expand` + `kir::eval::run`, the
//!   semantics every backend's generated kernels have), and every buffer the fused program
//!   still uses must hold the same values: bit for bit where the chain has no `exp`/`erf`
//!   (data movement, RoPE, ReLU, add, scale), within a few ulp otherwise (`kir`'s expansions
//!   against libm). Chains that must not fuse (a reader between, an aliased output, too many
//!   operands) are checked to stay as they are.
//! - Plans: every Llama plan of the equivalence matrix lowers with fusion, verifies, and fuses
//!   its rope chains; fusion off leaves no fused op.
//! - Training: tiny Llama on the CPU, fused and unfused, gives the same losses (1e-6 relative),
//!   with and without Qwen3's per-head q/k norms.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;

use fixtures::{spec, train_cpu, PlanChoice, TinyModel};
use parc_compiler::fuse::fuse_program;
use parc_compiler::ir::op::{Act, ActAttrs, FusedAttrs, Op, RopeAttrs, RopeScaling, Segment};
use parc_compiler::ir::{Buffer, BufferId, BufferKind, DType, Instr, Plan, Program};
use parc_compiler::kir::{self, Access};
use parc_compiler::lower::{lower_with, LowerOptions};
use parc_compiler::spec::{LayerKind, PipelineSchedule, Recompute, Spec, ZeroStage};
use parc_runtime::backend::{Backend, StepScalars};
use parc_runtime::cpu::CpuBackend;
use parc_runtime::exec::TrainOptions;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

const SCALARS: StepScalars = StepScalars {
    lr: 0.1,
    step: 1,
    loss_scale: None,
};

/// A program written by hand: buffers, and instructions with their `Alloc`s and `Free`s.
#[derive(Default)]
struct Chain {
    buffers: Vec<Buffer>,
    instrs: Vec<Instr>,
}

impl Chain {
    /// A `[rows, cols]` f32 activation.
    fn buffer(&mut self, name: &str, rows: u64, cols: u64) -> u32 {
        self.buffers.push(Buffer {
            name: name.to_string(),
            shape: vec![rows, cols],
            dtype: DType::F32,
            kind: BufferKind::Activation,
        });
        self.buffers.len() as u32 - 1
    }

    /// `op` from `inputs` into freshly allocated `outputs`.
    fn op(&mut self, op: Op, inputs: &[u32], outputs: &[u32]) {
        for &o in outputs {
            self.instrs.push(Instr::Alloc {
                buffer: BufferId(o),
            });
        }
        let ids = |v: &[u32]| v.iter().map(|&b| BufferId(b)).collect::<Vec<_>>();
        self.instrs.push(Instr::Compute {
            op: Arc::new(op),
            inputs: parc_compiler::ir::operands::Inputs::from_slice(&ids(inputs)).unwrap(),
            outputs: parc_compiler::ir::operands::Outputs::from_slice(&ids(outputs)).unwrap(),
            node: None,
            phase: parc_compiler::ir::Phase::Forward,
        });
    }

    fn free(&mut self, buffers: &[u32]) {
        for &b in buffers {
            self.instrs.push(Instr::Free {
                buffer: BufferId(b),
            });
        }
    }

    fn program(self) -> Program {
        Program::new("chain", self.buffers, self.instrs)
    }
}

/// Deterministic values in `[-scale, scale)`.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Every buffer of `program` after running it once on the CPU, the inputs (buffers no
/// instruction writes) set from `seed`: hand-written ops on the backend, fused ones through
/// the reference evaluator.
fn run(program: &Program, seed: u64) -> Vec<Vec<f32>> {
    let mut be = CpuBackend::new();
    let written: HashSet<BufferId> = program.instrs.iter().flat_map(Instr::writes).collect();
    for (i, b) in program.buffers.iter().enumerate() {
        let id = BufferId(i as u32);
        be.alloc(id, &b.shape, b.dtype).unwrap();
        if !written.contains(&id) {
            be.write_f32(id, &values(b.numel() as usize, seed + i as u64, 3.0))
                .unwrap();
        }
    }
    for instr in &program.instrs {
        let Some(c) = instr.as_compute() else {
            continue;
        };
        match c.op {
            Op::Fused(a) => evaluate(&mut be, a, c.inputs, c.outputs),
            op => be.compute(op, c.inputs, c.outputs, &SCALARS).unwrap(),
        }
    }
    (0..program.buffers.len())
        .map(|i| be.read_f32(BufferId(i as u32)).unwrap())
        .collect()
}

/// A fused op through `kir`'s reference evaluator.
fn evaluate(be: &mut CpuBackend, a: &FusedAttrs, inputs: &[BufferId], outputs: &[BufferId]) {
    let kernel = kir::expand::expand(&a.kernel);
    let ins: Vec<Vec<f32>> = inputs.iter().map(|b| be.read_f32(*b).unwrap()).collect();
    let rows = a.rows.map(|r| r as usize).unwrap_or_else(|| {
        let (i, width) = kernel
            .inputs
            .iter()
            .enumerate()
            .find_map(|(i, x)| match x {
                Access::Elem { width } => Some((i, *width)),
                _ => None,
            })
            .unwrap();
        ins[i].len() / width as usize
    });
    let mut outs: Vec<Vec<f32>> = outputs
        .iter()
        .map(|b| vec![f32::NAN; be.read_f32(*b).unwrap().len()])
        .collect();
    let in_slices: Vec<&[f32]> = ins.iter().map(Vec::as_slice).collect();
    let mut out_slices: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
    kir::eval::run(&kernel, 0, rows, &in_slices, &mut out_slices).unwrap();
    for (b, v) in outputs.iter().zip(&outs) {
        be.write_f32(*b, v).unwrap();
    }
}

/// The buffers `program` still reads or writes.
fn used(program: &Program) -> Vec<usize> {
    let mut used: Vec<usize> = program
        .instrs
        .iter()
        .flat_map(|i| i.reads().into_iter().chain(i.writes()))
        .map(|b| b.0 as usize)
        .collect();
    used.sort_unstable();
    used.dedup();
    used
}

/// Fuses `chain`, checks it made `fused` ops, and compares the two programs' buffers: equal
/// bits when `ulps` is 0, else within `ulps` units in the last place (relative to 1 near 0).
fn assert_fuses_to_same(what: &str, chain: Chain, fused: usize, ulps: f32) -> Program {
    let unfused = chain.program();
    let mut program = unfused.clone();
    let summary = fuse_program(&mut program).unwrap();
    assert_eq!(summary.fused, fused, "{what}: {:#?}", program.instrs);
    let (a, b) = (run(&unfused, 7), run(&program, 7));
    for i in used(&program)
        .into_iter()
        .filter(|i| *i < unfused.buffers.len())
    {
        let name = &unfused.buffers[i].name;
        for (k, (x, y)) in a[i].iter().zip(&b[i]).enumerate() {
            let close = if ulps == 0.0 {
                x.to_bits() == y.to_bits()
            } else {
                (x - y).abs() <= ulps * f32::EPSILON * x.abs().max(1.0)
            };
            assert!(close, "{what}: {name}[{k}] fused {y} vs unfused {x}");
        }
    }
    program
}

fn rope_attrs(heads: u64) -> RopeAttrs {
    scaled_rope_attrs(heads, RopeScaling::None)
}

fn scaled_rope_attrs(heads: u64, scaling: RopeScaling) -> RopeAttrs {
    RopeAttrs {
        batch: 2,
        heads,
        head_dim: 4,
        theta: 10000.0,
        scaling,
        positions: vec![Segment { start: 0, len: 2 }, Segment { start: 6, len: 2 }],
        rotary_dim: None,
    }
}

fn fused_ops(program: &Program) -> Vec<&FusedAttrs> {
    program
        .instrs
        .iter()
        .filter_map(|i| match i.op() {
            Some(Op::Fused(a)) => Some(a),
            _ => None,
        })
        .collect()
}

/// A q/k/v projection's output `[8, 32]` and its split into q `[8, 16]`, k and v `[8, 8]`.
fn split_qkv(c: &mut Chain) -> [u32; 4] {
    let qkv = c.buffer("qkv", 8, 32);
    let (q, k, v) = (
        c.buffer("q", 8, 16),
        c.buffer("k", 8, 8),
        c.buffer("v", 8, 8),
    );
    c.op(
        Op::SplitColumns {
            widths: vec![16, 8, 8],
        },
        &[qkv],
        &[q, k, v],
    );
    [qkv, q, k, v]
}

#[test]
fn split_and_rope_fuse_bit_for_bit() {
    let mut c = Chain::default();
    let [qkv, q, k, _] = split_qkv(&mut c);
    let (qr, kr) = (c.buffer("qr", 8, 16), c.buffer("kr", 8, 8));
    c.free(&[qkv]);
    c.op(Op::Rope(rope_attrs(4)), &[q], &[qr]);
    c.free(&[q]);
    c.op(Op::Rope(rope_attrs(2)), &[k], &[kr]);
    c.free(&[k]);
    let program = assert_fuses_to_same("split + rope", c, 1, 0.0);
    let fused = fused_ops(&program);
    assert_eq!(fused[0].name, "split_columns+rope");
    // q and k vanished with their Alloc and Free; qkv is freed after the fused op reads it.
    let named: Vec<String> = program.instrs.iter().map(|i| format!("{i:?}")).collect();
    for gone in [q, k] {
        assert!(!named
            .iter()
            .any(|s| s.contains(&format!("BufferId({gone})"))));
    }
    let at = |pred: &dyn Fn(&Instr) -> bool| program.instrs.iter().position(pred).unwrap();
    let fused_at = at(&|i| matches!(i.op(), Some(Op::Fused(_))));
    let table_at = at(&|i| matches!(i.op(), Some(Op::RopeTable(_))));
    let qkv_freed = at(&|i| matches!(i, Instr::Free { buffer } if buffer.0 == qkv));
    assert!(table_at < fused_at && fused_at < qkv_freed);
}

/// Scaled ropes read tables made with their scaling: q under Llama 3's rule (its second pair's
/// wavelength, 628, lies in the blended band 256..1024), k plain. Two tables, one per rotation,
/// and the fused kernel's bits are the hand-written ropes'.
#[test]
fn scaled_ropes_fuse_bit_for_bit_each_with_its_table() {
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 1024,
    };
    let mut c = Chain::default();
    let [qkv, q, k, _] = split_qkv(&mut c);
    let (qr, kr) = (c.buffer("qr", 8, 16), c.buffer("kr", 8, 8));
    c.free(&[qkv]);
    c.op(Op::Rope(scaled_rope_attrs(4, llama3)), &[q], &[qr]);
    c.free(&[q]);
    c.op(Op::Rope(rope_attrs(2)), &[k], &[kr]);
    c.free(&[k]);
    let program = assert_fuses_to_same("split + scaled rope", c, 1, 0.0);
    let tables: Vec<RopeScaling> = program
        .instrs
        .iter()
        .filter_map(|i| match i.op() {
            Some(Op::RopeTable(a)) => Some(a.scaling),
            _ => None,
        })
        .collect();
    assert_eq!(tables, [llama3, RopeScaling::None]);
}

/// A partial RoPE (the first 2 of each head's 4 features turn, GPT-NeoX style) fuses bit for
/// bit, forward after the split and backward before the concat: its loads read the partners
/// of the turned columns and the kept columns themselves, times the table's 1 and 0.
#[test]
fn partial_ropes_fuse_bit_for_bit() {
    let partial = |heads| RopeAttrs {
        rotary_dim: Some(2),
        ..rope_attrs(heads)
    };
    let mut c = Chain::default();
    let [qkv, q, k, _] = split_qkv(&mut c);
    let (qr, kr) = (c.buffer("qr", 8, 16), c.buffer("kr", 8, 8));
    c.free(&[qkv]);
    c.op(Op::Rope(partial(4)), &[q], &[qr]);
    c.free(&[q]);
    c.op(Op::Rope(partial(2)), &[k], &[kr]);
    c.free(&[k]);
    let program = assert_fuses_to_same("split + partial rope", c, 1, 0.0);
    let text = format!("{}", fused_ops(&program)[0].kernel);
    assert!(text.contains("rot2of4"), "{text}");
    let c = rope_bwd_and_concat(partial);
    assert_fuses_to_same("partial rope_bwd + concat", c, 1, 0.0);
}

/// dq and dk rotated back (`RopeBwd` of `attrs(heads)`: 4 q heads, 2 k heads) and
/// concatenated with dv into dqkv, as the attention's backward does.
fn rope_bwd_and_concat(attrs: impl Fn(u64) -> RopeAttrs) -> Chain {
    let mut c = Chain::default();
    let (dq, dk, dv) = (
        c.buffer("dq", 8, 16),
        c.buffer("dk", 8, 8),
        c.buffer("dv", 8, 8),
    );
    let (dqp, dkp) = (c.buffer("dq_pre", 8, 16), c.buffer("dk_pre", 8, 8));
    let dqkv = c.buffer("dqkv", 8, 32);
    c.op(Op::RopeBwd(attrs(4)), &[dq], &[dqp]);
    c.free(&[dq]);
    c.op(Op::RopeBwd(attrs(2)), &[dk], &[dkp]);
    c.free(&[dk]);
    c.op(
        Op::ConcatColumns {
            widths: vec![16, 8, 8],
        },
        &[dqp, dkp, dv],
        &[dqkv],
    );
    c.free(&[dqp, dkp, dv]);
    c
}

#[test]
fn rope_backward_and_concat_fuse_bit_for_bit() {
    let c = rope_bwd_and_concat(rope_attrs);
    let program = assert_fuses_to_same("rope_bwd + concat", c, 1, 0.0);
    assert_eq!(fused_ops(&program)[0].name, "rope_bwd+concat_columns");
}

/// x → act → scale → add r, and dy, x → act' → copy.
fn activation_chain(act: Act) -> Chain {
    let mut c = Chain::default();
    let (x, r, dy) = (
        c.buffer("x", 6, 8),
        c.buffer("r", 6, 8),
        c.buffer("dy", 6, 8),
    );
    let (y, z, w) = (
        c.buffer("y", 6, 8),
        c.buffer("z", 6, 8),
        c.buffer("w", 6, 8),
    );
    let (dx, dxc) = (c.buffer("dx", 6, 8), c.buffer("dx_copy", 6, 8));
    c.op(Op::Activation(ActAttrs { act }), &[x], &[y]);
    c.op(Op::Scale { factor: 0.5 }, &[y], &[z]);
    c.free(&[y]);
    c.op(Op::Add, &[z, r], &[w]);
    c.free(&[z]);
    c.op(Op::ActivationBwd(ActAttrs { act }), &[dy, x], &[dx]);
    c.op(Op::Copy, &[dx], &[dxc]);
    c.free(&[dx]);
    c
}

#[test]
fn activations_fuse_with_the_cpu_formulas() {
    for &act in Act::ALL {
        let ulps = if act == Act::Relu { 0.0 } else { 8.0 };
        let program = assert_fuses_to_same(act.name(), activation_chain(act), 2, ulps);
        let names: Vec<&str> = fused_ops(&program)
            .iter()
            .map(|a| a.name.as_str())
            .collect();
        assert_eq!(names, ["activation+scale+add", "activation_bwd+copy"]);
    }
}

#[test]
fn swiglu_and_its_gradient_fuse() {
    let mut c = Chain::default();
    let (g, u, r, dy) = (
        c.buffer("g", 4, 12),
        c.buffer("u", 4, 12),
        c.buffer("r", 4, 12),
        c.buffer("dy", 4, 12),
    );
    let (a, s) = (c.buffer("a", 4, 12), c.buffer("s", 4, 12));
    let (dg, du, t) = (
        c.buffer("dg", 4, 12),
        c.buffer("du", 4, 12),
        c.buffer("t", 4, 12),
    );
    c.op(Op::SwiGlu, &[g, u], &[a]);
    c.op(Op::Add, &[a, r], &[s]);
    c.free(&[a]);
    c.op(Op::SwiGluBwd, &[dy, g, u], &[dg, du]);
    c.op(Op::Add, &[dg, du], &[t]);
    c.free(&[dg, du]);
    assert_fuses_to_same("swiglu", c, 2, 8.0);
}

#[test]
fn a_reader_between_keeps_the_ops_apart() {
    let mut c = Chain::default();
    let [_, q, _, _] = split_qkv(&mut c);
    let (peek, qr) = (c.buffer("peek", 8, 16), c.buffer("qr", 8, 16));
    // A range copy (never fused) reads q between the split and the rope.
    c.op(
        Op::CopyRange {
            src_offset: 0,
            dst_offset: 0,
            len: 128,
        },
        &[q],
        &[peek],
    );
    c.op(Op::Rope(rope_attrs(4)), &[q], &[qr]);
    assert_fuses_to_same("reader between", c, 0, 0.0);
}

#[test]
fn an_output_that_aliases_an_input_is_not_fused() {
    let mut c = Chain::default();
    let (x, r, y) = (
        c.buffer("x", 4, 8),
        c.buffer("r", 4, 8),
        c.buffer("y", 4, 8),
    );
    c.op(Op::Scale { factor: 2.0 }, &[x], &[y]);
    c.op(Op::Add, &[y, r], &[y]);
    assert_fuses_to_same("aliased", c, 0, 0.0);
}

#[test]
fn a_group_stops_at_the_operand_limit() {
    let mut c = Chain::default();
    let ins: Vec<u32> = (0..7).map(|i| c.buffer(&format!("x{i}"), 4, 4)).collect();
    let sums: Vec<u32> = (0..3).map(|i| c.buffer(&format!("s{i}"), 4, 4)).collect();
    let (cat, out) = (c.buffer("cat", 4, 12), c.buffer("out", 4, 12));
    let seven = c.buffer("x7", 4, 12);
    for (i, s) in sums.iter().enumerate() {
        c.op(Op::Add, &[ins[2 * i], ins[2 * i + 1]], &[*s]);
    }
    c.op(
        Op::ConcatColumns {
            widths: vec![4, 4, 4],
        },
        &sums,
        &[cat],
    );
    c.free(&sums);
    // A seventh input would exceed a generated kernel's six: this add stays hand-written.
    c.op(Op::Add, &[cat, seven], &[out]);
    let program = assert_fuses_to_same("limit", c, 1, 0.0);
    let fused = fused_ops(&program);
    assert_eq!(fused[0].kernel.inputs.len(), 6);
    assert!(program
        .instrs
        .iter()
        .any(|i| matches!(i.op(), Some(Op::Add))));
}

fn lowered(llama: bool, plan: PlanChoice, fusion: bool) -> (parc_compiler::spec::Spec, Plan) {
    let s = spec(
        TinyModel {
            layers: 4,
            llama,
            tied: !llama,
        },
        plan,
    );
    let options = LowerOptions {
        fusion,
        ..LowerOptions::default()
    };
    let plan = lower_with(&s, options).unwrap_or_else(|d| panic!("{:?}", d.items));
    (s, plan)
}

fn count_fused(plan: &Plan) -> usize {
    plan.programs.iter().map(|p| fused_ops(p).len()).sum()
}

/// Every Llama plan of the equivalence matrix (dp, pp, cp, tp, ZeRO, schedules, recompute,
/// sequence parallelism) lowers with fusion and verifies.
#[test]
fn every_llama_plan_of_the_matrix_verifies_fused() {
    let mut checked = 0;
    for dp in [1, 2] {
        for pp in [1, 2] {
            for cp in [1, 2] {
                for tp in [1, 2] {
                    let zero = if dp * cp > 1 {
                        ZeroStage::Zero3
                    } else {
                        ZeroStage::Zero0
                    };
                    let schedules: &[PipelineSchedule] = if pp > 1 {
                        &[
                            PipelineSchedule::Gpipe,
                            PipelineSchedule::Interleaved { virtual_stages: 2 },
                        ]
                    } else {
                        &[PipelineSchedule::OneFOneB]
                    };
                    for &schedule in schedules {
                        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                            let plan = PlanChoice {
                                schedule,
                                microbatches: 2 * pp,
                                recompute,
                                sp: tp > 1,
                                ..PlanChoice::mesh(dp, pp, cp, tp, zero)
                            };
                            let desc = format!("dp {dp} pp {pp} cp {cp} tp {tp} {schedule:?}");
                            let (s, fused) = lowered(true, plan, true);
                            assert!(count_fused(&fused) > 0, "{desc}: nothing fused");
                            if let Err(d) = parc_compiler::verify::verify_spec(&fused, &s) {
                                panic!("{desc}: {:?}", d.items);
                            }
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(checked >= 48);
}

#[test]
fn fusion_off_leaves_the_hand_written_ops() {
    let (_, plan) = lowered(true, PlanChoice::default(), false);
    assert_eq!(count_fused(&plan), 0);
    let (_, gpt) = lowered(false, PlanChoice::default(), true);
    assert_eq!(count_fused(&gpt), 0, "GPT-2 has no chain to fuse");
}

/// Tiny Llama trained on the CPU with and without fusion: the same losses and gradient norms.
#[test]
fn tiny_llama_trains_the_same_fused_and_unfused() {
    assert_trains_the_same_fused_and_unfused(|s| s, true);
}

/// Tiny Llama with Qwen3's per-head q/k norms between the split and RoPE (`qk_norm`): the
/// norms keep their hand-written op, which splits the split-and-rope chain (nothing of the
/// attention fuses today), and the fused program trains as the unfused one.
#[test]
fn tiny_qwen3_trains_the_same_fused_and_unfused() {
    let qwen3 = |mut s: Spec| {
        for node in &mut s.model.nodes {
            if let LayerKind::Attention { qk_norm, .. } = &mut node.kind {
                *qk_norm = Some(1e-6);
            }
        }
        s
    };
    assert_trains_the_same_fused_and_unfused(qwen3, false);
}

/// Tiny Llama with a partial RoPE (half of each head's features turn): the split-and-rope and
/// rope-and-concat chains fuse with partial rotations, and train as the hand-written ropes.
#[test]
fn tiny_llama_with_a_partial_rope_trains_the_same_fused_and_unfused() {
    let partial = |mut s: Spec| {
        for node in &mut s.model.nodes {
            if let LayerKind::Attention { rope: Some(r), .. } = &mut node.kind {
                r.fraction = 0.5;
            }
        }
        s
    };
    assert_trains_the_same_fused_and_unfused(partial, true);
}

/// The tiny Llama made by `model` trained under dp 2 × tp 2 with SP, fused and unfused: the
/// same losses and gradient norms (1e-6 relative); `fuses` says whether anything fuses.
fn assert_trains_the_same_fused_and_unfused(model: impl Fn(Spec) -> Spec, fuses: bool) {
    let train = |fusion: bool| {
        let tiny = TinyModel {
            layers: 4,
            llama: true,
            tied: false,
        };
        let plan = PlanChoice {
            dp: 2,
            tp: 2,
            sp: true,
            ..PlanChoice::default()
        };
        let s = model(spec(tiny, plan));
        let options = LowerOptions {
            fusion,
            ..LowerOptions::default()
        };
        let plan = lower_with(&s, options).unwrap_or_else(|d| panic!("{:?}", d.items));
        assert_eq!(count_fused(&plan) > 0, fusion && fuses);
        let mut options = TrainOptions::new(".");
        options.comm_timeout = Duration::from_secs(30);
        options.threads_per_rank = Some(1);
        train_cpu(&s, &plan, &options).unwrap_or_else(|e| panic!("{e}"))
    };
    let (fused, unfused) = (train(true), train(false));
    assert_eq!(fused.records.len(), unfused.records.len());
    assert_ne!(
        unfused.records[0].loss,
        unfused.records.last().unwrap().loss
    );
    for (a, b) in unfused.records.iter().zip(&fused.records) {
        for (what, x, y) in [
            ("loss", a.loss, b.loss),
            ("grad norm", a.grad_norm, b.grad_norm),
        ] {
            let rel = (x - y).abs() / x.abs().max(1e-12);
            assert!(
                rel <= 1e-6,
                "step {}: {what} fused {y} vs {x} ({rel:e})",
                a.step
            );
        }
    }
}
