//! Where the CUDA backend's memory comes from when it is given a memory plan
//! (`Backend::prepare`): the planned regions (one device allocation for the persistent
//! buffers, one for the transient arena; each planned buffer is a fixed pointer into them, so
//! `Alloc` is a stream-ordered memset — none for a buffer the plan says is fully written before
//! it is read (`MemoryLayout::needs_zero`) — and `Free` releases nothing), and what else the
//! program needs, read off it once so no step allocates: the scratch sizes the compiler
//! computes ([`parc_compiler::memplan::backend_scratch`], the same numbers `parc check`
//! predicts: weight casts, GEMM scratch and vectors, the reduction and attention scratch,
//! aliased-input copies), and every distinct `Segment` list, whose positions are uploaded once.
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaSlice;
use parc_compiler::ir::op::{Op, Segment};
use parc_compiler::ir::{Instr, Program};
use parc_compiler::memplan::{backend_scratch, BackendScratch, MemoryLayout, Placement};

/// The scratch sizes and position lists one program needs (see the module docs).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ProgramNeeds {
    pub scratch: BackendScratch,
    /// Every distinct position list, in first-use order.
    pub segments: Vec<Vec<Segment>>,
}

/// What `program` needs; `half_operands`: the run rounds GEMM (and tensor-core attention)
/// operands to 16 bits.
pub(crate) fn program_needs(program: &Program, half_operands: bool) -> ProgramNeeds {
    ProgramNeeds {
        scratch: backend_scratch(program, half_operands),
        segments: position_lists(program),
    }
}

/// Every distinct position list of `program`'s ops, in first-use order.
fn position_lists(program: &Program) -> Vec<Vec<Segment>> {
    let mut segments: Vec<Vec<Segment>> = Vec::new();
    for instr in &program.instrs {
        let Instr::Compute { op, .. } = instr else {
            continue;
        };
        let lists: Vec<&Vec<Segment>> = match &**op {
            Op::PositionAdd { positions, .. }
            | Op::PositionAddBwd { positions, .. }
            | Op::Rope { positions, .. }
            | Op::RopeBwd { positions, .. } => vec![positions],
            Op::Attention {
                q_positions,
                kv_positions,
                ..
            }
            | Op::AttentionBwd {
                q_positions,
                kv_positions,
                ..
            } => vec![q_positions, kv_positions],
            _ => Vec::new(),
        };
        for list in lists {
            if !segments.contains(list) {
                segments.push(list.clone());
            }
        }
    }
    segments
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
    use parc_compiler::ir::{Buffer, BufferId, BufferKind, DType};
    use parc_compiler::memplan::op_scratch;

    #[test]
    fn position_lists_are_uploaded_once_each() {
        let seg = |start, len| vec![Segment { start, len }];
        let rope = |positions: Vec<Segment>| Op::Rope {
            batch: 1,
            heads: 1,
            head_dim: 2,
            theta: 1e4,
            positions,
        };
        let program = Program {
            role: "test".into(),
            coords: Vec::new(),
            buffers: (0..2)
                .map(|b| Buffer {
                    name: format!("b{b}"),
                    shape: vec![8],
                    dtype: DType::F32,
                    kind: BufferKind::Activation,
                })
                .collect(),
            params: Vec::new(),
            instrs: [seg(0, 4), seg(4, 4), seg(0, 4)]
                .into_iter()
                .map(|s| Instr::compute(rope(s), &[0], &[1]))
                .collect(),
            loss: None,
            grad_sumsq: None,
        };
        assert_eq!(position_lists(&program), vec![seg(0, 4), seg(4, 4)]);
    }

    /// `examples/tiny.par` lowered with `sets` (besides a synthetic data set on 2 GPUs a node).
    fn tiny(sets: &[&str]) -> parc_compiler::ir::Plan {
        let text = include_str!("../../../examples/tiny.par").to_string();
        let overrides: Vec<_> = ["cluster.gpus_per_node=2", "train.data=synthetic"]
            .iter()
            .chain(sets)
            .map(|s| parc_compiler::parse_override(s).unwrap())
            .collect();
        let mut sources = parc_compiler::diag::Sources::default();
        let main = sources.add("tiny.par", text);
        let (spec, diags) = parc_compiler::check(&mut sources, main, &overrides);
        let spec = spec.unwrap_or_else(|| panic!("{sets:?}: {:?}", diags.items));
        parc_compiler::lower::lower(&spec).unwrap_or_else(|d| panic!("{sets:?}: {:?}", d.items))
    }

    #[test]
    fn attention_layouts_are_the_scratch_parc_check_predicts() {
        // The attention kernels lay their scratch out themselves (`attention::scratch_bytes`);
        // `prepare` reserves the compiler's size of it. At head dims 16, 64 and 128 (tensor
        // cores at 64 and 128 in bf16 runs), q/k/v packed (dp 2) and split (cp 2), f32 and
        // bf16 activations, under ZeRO-3 and tp with sp, the two agree op by op.
        let plans: [&[&str]; 5] = [
            &["model.d=64", "parallel.dp=2"],
            &["model.d=256", "parallel.dp=2", "parallel.zero=3"],
            &["model.d=256", "parallel.cp=2"],
            &[
                "model.d=256",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ],
            &[
                "model.d=512",
                "parallel.pp=2",
                "parallel.schedule=interleaved",
            ],
        ];
        let (mut checked, mut copies) = (0, 0);
        for sets in plans {
            for precision in ["train.precision=fp32", "train.precision=bf16"] {
                let plan = tiny(&[sets, &[precision]].concat());
                for program in &plan.programs {
                    let shapes = |ids: &[BufferId]| -> Vec<(usize, DType)> {
                        let shape = |b: &Buffer| (b.numel() as usize, b.dtype);
                        let shape =
                            |id: &BufferId| program.buffer(*id).map_or((0, DType::F32), shape);
                        ids.iter().map(shape).collect()
                    };
                    let attention = |(_, c): &(usize, parc_compiler::ir::Compute<'_>)| {
                        matches!(c.op, Op::Attention { .. } | Op::AttentionBwd { .. })
                    };
                    for (_, c) in program.computes().filter(attention) {
                        for bf16 in [false, true] {
                            let (ins, outs) = (shapes(c.inputs), shapes(c.outputs));
                            let laid_out =
                                super::super::attention::scratch_bytes(c.op, bf16, &ins, &outs);
                            let reserved = op_scratch(program, c, bf16).reduction;
                            assert_eq!(
                                laid_out as u64, reserved,
                                "{sets:?} {precision} {:?}",
                                c.op
                            );
                            checked += 1;
                            let plain = op_scratch(program, c, false).reduction;
                            copies += usize::from(reserved > plain);
                        }
                    }
                }
            }
        }
        assert!(
            checked > 100 && copies > 20,
            "{checked} ops, {copies} with copies"
        );
    }
}
