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
use parc_compiler::ir::op::{AttentionAttrs, PositionAttrs, RopeAttrs};
use parc_compiler::ir::op::{Op, Segment};
use parc_compiler::ir::{Instr, Program};
use parc_compiler::memplan::{
    backend_scratch, BackendScratch, KernelTarget, MemoryLayout, Placement,
};

/// The scratch sizes and position lists one program needs (see the module docs).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ProgramNeeds {
    pub scratch: BackendScratch,
    /// Every distinct position list, in first-use order.
    pub segments: Vec<Vec<Segment>>,
}

/// What `program` needs on `target` (the run's operand precision, this GPU).
pub(crate) fn program_needs(program: &Program, target: KernelTarget) -> ProgramNeeds {
    ProgramNeeds {
        scratch: backend_scratch(program, target),
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
            Op::PositionAdd(PositionAttrs { positions, .. })
            | Op::PositionAddBwd {
                pos: PositionAttrs { positions, .. },
                ..
            }
            | Op::Rope(RopeAttrs { positions, .. })
            | Op::RopeBwd(RopeAttrs { positions, .. })
            | Op::RopeTable(RopeAttrs { positions, .. }) => vec![positions],
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
    use parc_compiler::ir::op::RopeScaling;
    use parc_compiler::ir::{Buffer, BufferKind, DType};

    #[test]
    fn position_lists_are_uploaded_once_each() {
        let seg = |start, len| vec![Segment { start, len }];
        let rope = |positions: Vec<Segment>| {
            Op::Rope(RopeAttrs {
                batch: 1,
                heads: 1,
                head_dim: 2,
                theta: 1e4,
                scaling: RopeScaling::None,
                positions,
                rotary_dim: None,
            })
        };
        let program = Program::new(
            "test",
            (0..2)
                .map(|b| Buffer {
                    name: format!("b{b}"),
                    shape: vec![8],
                    dtype: DType::F32,
                    kind: BufferKind::Activation,
                })
                .collect(),
            [seg(0, 4), seg(4, 4), seg(0, 4)]
                .into_iter()
                .map(|s| Instr::compute(rope(s), &[0], &[1]))
                .collect(),
        );
        assert_eq!(position_lists(&program), vec![seg(0, 4), seg(4, 4)]);
    }
}
