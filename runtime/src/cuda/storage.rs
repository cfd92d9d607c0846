//! Where the CUDA backend's memory comes from when it is given a memory plan
//! (`Backend::prepare`): the planned regions (one device allocation for the persistent
//! buffers, one for the transient arena; each planned buffer is a fixed pointer into them, so
//! `Alloc` is a stream-ordered memset — none for a buffer the plan says is fully written before
//! it is read (`MemoryLayout::needs_zero`) — and `Free` releases nothing), and the sizes of the
//! per-op scratch memory read off the program once, so no step allocates:
//! - reduction partials (`dispatch`: `SumSquares`' per-block sums, the per-chunk column partials
//!   of norm and bias gradients — at most 128 chunks of 8-byte sums per column — and attention
//!   backward's `delta`, one f32 per `lse` element, the fused cross-entropy's per-row losses),
//!   which share one scratch buffer with the tensor-core attention's bf16 copies of q, k, v
//!   (and dO; or the whole packed qkv) in 16-bit runs (`attention`);
//! - the GEMMs' per-use 16-bit copies of f32 operands (bf16 and fp16 runs; bf16-stored operands
//!   and cached weight casts need none), then for a bwd-weight GEMM a dw-sized D its algorithms
//!   are timed into (`gemm_operands::scratch_bytes`);
//! - copies of inputs that are also the op's output (read from before the op), except those the
//!   op updates in place (`Op::in_place`);
//! - every distinct `Segment` list, whose positions are uploaded once.
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaSlice;
use parc_compiler::ir::op::{AttentionAttrs, PositionAttrs, RopeAttrs};
use parc_compiler::ir::op::{Op, Segment};
use parc_compiler::ir::{Buffer, Instr, Program};
use parc_compiler::memplan::{MemoryLayout, Placement, ALIGN};

/// Most chunks a column reduction splits its rows into (`dispatch::chunking`).
const MAX_CHUNKS: usize = 128;

/// The scratch sizes and position lists one program needs (see the module docs).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ProgramNeeds {
    /// Bytes of reduction partials (the largest single op's).
    pub reduction_bytes: usize,
    /// Bytes of the largest GEMM's scratch (`gemm_operands::scratch_bytes`).
    pub gemm_operand_bytes: usize,
    /// Bytes of the largest op's inputs that are also its outputs (each 256-byte aligned).
    pub aliased_bytes: usize,
    /// Every distinct position list, in first-use order.
    pub segments: Vec<Vec<Segment>>,
}

fn aligned(bytes: usize) -> usize {
    bytes.next_multiple_of(ALIGN as usize)
}

/// Read every compute op of `program` for the scratch it will ask for; `half_operands`: the run
/// rounds GEMM (and tensor-core attention) operands to 16 bits.
pub(crate) fn program_needs(program: &Program, half_operands: bool) -> ProgramNeeds {
    let mut needs = ProgramNeeds::default();
    let buffer = |id: Option<&parc_compiler::ir::BufferId>| -> Option<&Buffer> {
        id.and_then(|id| program.buffer(*id))
    };
    let numel = |b: Option<&Buffer>| b.map_or(0, |b| b.numel() as usize);
    for instr in &program.instrs {
        let Instr::Compute {
            op,
            inputs,
            outputs,
            ..
        } = instr
        else {
            continue;
        };
        let input = |i: usize| buffer(inputs.get(i));
        let output = |i: usize| buffer(outputs.get(i));
        let reduction = match &**op {
            Op::SumSquares => super::sum_squares::MAX_BLOCKS * 8,
            // dw, and db when there is one, each reduced over row chunks.
            Op::LayerNormBwd { .. } | Op::RmsNormBwd { .. } => {
                MAX_CHUNKS * 8 * numel(output(1)).max(numel(output(2)))
            }
            Op::MatmulBwdWeight { bias: true, .. } => MAX_CHUNKS * 8 * numel(output(1)),
            // bf16 copies of f32 operands (tensor cores), delta, lse2, a bf16 dQ's accumulator.
            Op::Attention { .. } | Op::AttentionBwd { .. } => {
                use parc_compiler::ir::{BufferId, DType};
                let shapes = |ids: &[BufferId]| -> Vec<(usize, DType)> {
                    let shape = |b: &Buffer| (b.numel() as usize, b.dtype);
                    ids.iter()
                        .map(|id| buffer(Some(id)).map_or((0, DType::F32), shape))
                        .collect()
                };
                let (ins, outs) = (shapes(inputs), shapes(outputs));
                super::attention::scratch_bytes(op, half_operands, &ins, &outs)
            }
            // Each row's loss (f64), summed in a fixed order after (`cross_entropy`).
            Op::CrossEntropy { .. } => numel(input(1)) * 8,
            _ => 0,
        };
        needs.reduction_bytes = needs.reduction_bytes.max(reduction);
        let gemm = super::gemm_operands::scratch_bytes(
            op,
            &inputs.iter().map(|id| buffer(Some(id))).collect::<Vec<_>>(),
            &outputs
                .iter()
                .map(|id| buffer(Some(id)))
                .collect::<Vec<_>>(),
            half_operands,
        );
        needs.gemm_operand_bytes = needs.gemm_operand_bytes.max(gemm);
        let mut aliased = 0usize;
        for (i, id) in inputs.iter().enumerate() {
            let first = inputs.iter().position(|x| x == id) == Some(i);
            let in_place = op.in_place().iter().any(|&(input, _)| input == i);
            if first && !in_place && outputs.iter().any(|o| o == id) {
                aliased += aligned(buffer(Some(id)).map_or(0, |b| b.bytes() as usize));
            }
        }
        needs.aliased_bytes = needs.aliased_bytes.max(aliased);
        let lists: Vec<&Vec<Segment>> = match &**op {
            Op::PositionAdd(PositionAttrs { positions, .. })
            | Op::PositionAddBwd {
                pos: PositionAttrs { positions, .. },
                ..
            }
            | Op::Rope(RopeAttrs { positions, .. })
            | Op::RopeBwd(RopeAttrs { positions, .. }) => vec![positions],
            Op::Attention(AttentionAttrs {
                q_positions,
                kv_positions,
                ..
            })
            | Op::AttentionBwd(AttentionAttrs {
                q_positions,
                kv_positions,
                ..
            }) => vec![q_positions, kv_positions],
            _ => Vec::new(),
        };
        for list in lists {
            if !needs.segments.contains(list) {
                needs.segments.push(list.clone());
            }
        }
    }
    needs
}

/// The planned regions and each planned buffer's device pointer and size.
#[derive(Default)]
pub(crate) struct PlannedRegions {
    /// Persistent region, then arena (kept alive; the pointers below point into them).
    _regions: Vec<CudaSlice<u8>>,
    /// Per buffer id: its planned pointer and bytes, if the plan places it.
    pointers: Vec<Option<(CUdeviceptr, u64)>>,
    /// Per buffer id: whether its allocation must be zero-filled.
    needs_zero: Vec<bool>,
    /// Bytes of the two regions.
    pub bytes: u64,
}

impl PlannedRegions {
    /// Pointers for every buffer `layout` places, given the regions and their base pointers.
    pub fn new(
        program: &Program,
        layout: &MemoryLayout,
        persistent: (CudaSlice<u8>, CUdeviceptr),
        arena: (CudaSlice<u8>, CUdeviceptr),
    ) -> PlannedRegions {
        let pointers = program
            .buffers
            .iter()
            .zip(&layout.placements)
            .map(|(buffer, placement)| match *placement {
                Placement::Persistent(at) => Some((persistent.1 + at, buffer.bytes())),
                Placement::Arena(at) => Some((arena.1 + at, buffer.bytes())),
                Placement::Unused => None,
            })
            .collect();
        PlannedRegions {
            _regions: vec![persistent.0, arena.0],
            pointers,
            needs_zero: layout.needs_zero.clone(),
            bytes: layout.total_bytes(),
        }
    }

    /// The planned pointer and size of buffer `index`.
    pub fn pointer(&self, index: usize) -> Option<(CUdeviceptr, u64)> {
        self.pointers.get(index).copied().flatten()
    }

    /// Whether allocating buffer `index` must zero-fill it (true where the plan does not say).
    pub fn needs_zero(&self, index: usize) -> bool {
        self.needs_zero.get(index).copied().unwrap_or(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parc_compiler::ir::{BufferId, BufferKind, DType, Inputs, Outputs, Phase};
    use std::sync::Arc;

    fn buffer(n: u64) -> Buffer {
        Buffer {
            name: format!("b{n}"),
            shape: vec![n],
            dtype: DType::F32,
            kind: BufferKind::Activation,
        }
    }

    fn compute(op: Op, inputs: &[u32], outputs: &[u32]) -> Instr {
        let ids = |v: &[u32]| v.iter().map(|&b| BufferId(b)).collect::<Vec<_>>();
        Instr::Compute {
            op: Arc::new(op),
            inputs: Inputs::from_slice(&ids(inputs)).unwrap(),
            outputs: Outputs::from_slice(&ids(outputs)).unwrap(),
            node: None,
            phase: Phase::Forward,
        }
    }

    #[test]
    fn needs_are_the_largest_op_of_each_kind() {
        let seg = |start, len| vec![Segment { start, len }];
        // Buffer b has 1000·(b+1) elements.
        let program = Program {
            role: "test".into(),
            coords: Vec::new(),
            buffers: (0..8).map(|b| buffer(1000 * (b + 1))).collect(),
            params: Vec::new(),
            instrs: vec![
                compute(
                    Op::Matmul {
                        in_dim: 1,
                        out_dim: 1,
                        bias: false,
                        act: None,
                        residual: false,
                    },
                    &[0, 1],
                    &[2],
                ),
                compute(
                    Op::MatmulBwdWeight {
                        in_dim: 1,
                        out_dim: 1,
                        bias: true,
                        accumulate_param_grad: true,
                    },
                    &[2, 0],
                    &[1, 3],
                ),
                compute(Op::SumSquares, &[7], &[0]),
                compute(Op::Scale { factor: 2.0 }, &[4], &[4]),
                compute(
                    Op::Rope(RopeAttrs {
                        batch: 1,
                        heads: 1,
                        head_dim: 2,
                        theta: 1e4,
                        positions: seg(0, 4),
                    }),
                    &[5],
                    &[6],
                ),
                compute(
                    Op::RopeBwd(RopeAttrs {
                        batch: 1,
                        heads: 1,
                        head_dim: 2,
                        theta: 1e4,
                        positions: seg(0, 4),
                    }),
                    &[5],
                    &[6],
                ),
            ],
            loss: None,
            grad_sumsq: None,
        };
        assert_prediction_agrees(&program, false);
        assert_prediction_agrees(&program, true);
        let needs = program_needs(&program, false);
        // Bias gradient b3 (4000 floats): 128 chunks × 8 bytes per column.
        assert_eq!(needs.reduction_bytes, 128 * 8 * 4000);
        // An fp32 run's GEMMs read their operands as stored.
        assert_eq!(needs.gemm_operand_bytes, 0);
        // b4 is read and written by one op.
        assert_eq!(needs.aliased_bytes, 20224);
        assert_eq!(needs.segments, vec![seg(0, 4)]);
        // A 16-bit run copies the bwd-weight GEMM's f32 operands b2 and b0 (3000 + 1000
        // halves, each aligned) and times it into a copy of dw (b1: 2000 floats).
        let half = program_needs(&program, true);
        assert_eq!(half.gemm_operand_bytes, 6144 + 2048 + 8000);
        let no_attention = ProgramNeeds {
            gemm_operand_bytes: needs.gemm_operand_bytes,
            ..half
        };
        assert_eq!(no_attention, needs, "no attention here");
    }

    #[test]
    fn the_fused_loss_takes_no_copy_of_its_logits() {
        // Logits b0 (30 rows × 100) updated in place, targets b1, loss b2; b3 an ordinary op
        // whose output is its input, for contrast.
        let program = Program {
            role: "test".into(),
            coords: Vec::new(),
            buffers: vec![buffer(3000), buffer(30), buffer(1), buffer(3000)],
            params: Vec::new(),
            instrs: vec![
                compute(
                    Op::CrossEntropy {
                        vocab: 100,
                        scale: 0.5,
                    },
                    &[0, 1],
                    &[0, 2],
                ),
                compute(Op::Scale { factor: 2.0 }, &[3], &[3]),
            ],
            loss: None,
            grad_sumsq: None,
        };
        let needs = program_needs(&program, false);
        // Only Scale's input is copied (12000 bytes, aligned); the loss keeps one f64 per row.
        assert_eq!(needs.aliased_bytes, 12032);
        assert_eq!(needs.reduction_bytes, 30 * 8);
    }

    #[test]
    fn half_runs_reserve_the_attention_copies() {
        let att = |backward: bool| {
            let (batch, heads, kv_heads, head_dim, causal, scale) = (1, 2, 2, 64, true, 0.125);
            let positions = vec![Segment { start: 0, len: 8 }];
            if backward {
                Op::AttentionBwd(AttentionAttrs {
                    batch,
                    heads,
                    kv_heads,
                    head_dim,
                    causal,
                    scale,
                    q_positions: positions.clone(),
                    kv_positions: positions,
                    packed: false,
                })
            } else {
                Op::Attention(AttentionAttrs {
                    batch,
                    heads,
                    kv_heads,
                    head_dim,
                    causal,
                    scale,
                    q_positions: positions.clone(),
                    kv_positions: positions,
                    packed: false,
                })
            }
        };
        // q, k, v, o: 8 rows × 128; lse: 2 heads × 8.
        let mut buffers: Vec<Buffer> = (0..4).map(|_| buffer(1024)).collect();
        buffers.push(buffer(16));
        let program = Program {
            role: "test".into(),
            coords: Vec::new(),
            buffers,
            params: Vec::new(),
            instrs: vec![
                compute(att(false), &[0, 1, 2], &[3, 4]),
                compute(att(true), &[3, 0, 1, 2, 3, 4], &[0, 1, 2]),
            ],
            loss: None,
            grad_sumsq: None,
        };
        assert_prediction_agrees(&program, false);
        assert_prediction_agrees(&program, true);
        // delta and lse2 (16 floats each, on 256-byte boundaries); then, before them, the bf16
        // copies of the four f32 operands dO, q, k, v.
        assert_eq!(program_needs(&program, false).reduction_bytes, 2 * 256);
        assert_eq!(
            program_needs(&program, true).reduction_bytes,
            4 * 2048 + 2 * 256
        );
    }

    /// The compiler's prediction of this scratch (`memplan::backend_scratch`, which `parc
    /// check` adds to the plan) agrees with the sizes `prepare` reserves.
    fn assert_prediction_agrees(program: &Program, half: bool) {
        let needs = program_needs(program, half);
        let predicted = parc_compiler::memplan::backend_scratch(program, half);
        let what = format!("program {} (half {half})", program.role);
        assert_eq!(predicted.reduction, needs.reduction_bytes as u64, "{what}");
        assert_eq!(
            predicted.gemm_operands, needs.gemm_operand_bytes as u64,
            "{what}"
        );
        assert_eq!(predicted.aliased, needs.aliased_bytes as u64, "{what}");
    }

    #[test]
    fn parc_checks_prediction_matches_the_reserved_scratch() {
        // examples/tiny.par at head dim 64 (tensor-core attention in 16-bit runs), bf16, under
        // plans that change which operands are f32 and cast: plain, ZeRO-3, tp 2 with sp, pp 2.
        let text = include_str!("../../../examples/tiny.par").to_string();
        let plans: [&[&str]; 4] = [
            &["parallel.dp=2"],
            &["parallel.dp=2", "parallel.zero=3"],
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
            &["parallel.pp=2", "parallel.schedule=interleaved"],
        ];
        for sets in plans {
            let mut all = vec![
                "model.d=256",
                "train.precision=bf16",
                "cluster.gpus_per_node=2",
                "train.data=synthetic",
            ];
            all.extend(sets);
            let overrides: Vec<_> = all
                .iter()
                .map(|s| parc_compiler::parse_override(s).unwrap())
                .collect();
            let mut sources = parc_compiler::diag::Sources::default();
            let main = sources.add("tiny.par", text.clone());
            let (spec, diags) = parc_compiler::check(&mut sources, main, &overrides);
            let spec = spec.unwrap_or_else(|| panic!("{sets:?}: {:?}", diags.items));
            let plan = parc_compiler::lower::lower(&spec)
                .unwrap_or_else(|d| panic!("{sets:?}: {:?}", d.items));
            for program in &plan.programs {
                assert_prediction_agrees(program, true);
                assert_prediction_agrees(program, false);
            }
        }
    }

    #[test]
    fn aliased_copies_take_the_stored_bytes() {
        // 1000 elements scaled in place: 4000 bytes in f32, 2000 in bf16 (256-byte aligned).
        let in_place = |dtype| {
            let program = Program {
                role: "test".into(),
                coords: Vec::new(),
                buffers: vec![Buffer {
                    dtype,
                    ..buffer(1000)
                }],
                params: Vec::new(),
                instrs: vec![compute(Op::Scale { factor: 2.0 }, &[0], &[0])],
                loss: None,
                grad_sumsq: None,
            };
            program_needs(&program, true).aliased_bytes
        };
        assert_eq!(in_place(DType::F32), 4096);
        assert_eq!(in_place(DType::Bf16), 2048);
    }
}
