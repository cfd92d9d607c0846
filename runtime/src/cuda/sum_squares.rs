//! Gradient clipping's sums of squares in one launch per run instead of two per gradient
//! tensor. The program keeps one `SumSquares` instruction per gradient (`out[0] += Σ g²`);
//! `parc_compiler::ir::optimizer_runs::find_sum_squares_runs` finds the runs of adjacent ones.
//! Because the memory plan gives every buffer one device address for the whole run, `prepare`
//! writes each run's table once into a device allocation of its own: per tensor its input and
//! output pointers, element count and its partials' place; per block the tensor it reduces; the
//! launch's groups of blocks; then room for the partials, the per-tensor sums and the
//! completion counters. When the executor reaches a run's first instruction the backend checks
//! the buffers are still where the table says, orders the launch after any communication on
//! them and launches `sum_squares_one_pass` (kernels/common.cuh): each tensor's partials exactly
//! as a per-tensor `sum_squares_partial` launch over it gives them, several of those blocks to
//! one real block, summed as `sum_partials_into` does and added into the outputs in program
//! order by the blocks that complete a tensor and the run (the counters say which), so the
//! outputs are bit for bit the per-instruction ones. (Measured on one H200, GPT-2 124M's 196
//! gradients: 0.22 ms, against 0.41 ms for the two launches it replaced.) The run's later
//! instructions must then arrive in order and become no-ops; any other compute before the run's
//! last instruction is an error. Without a memory plan, or with `with_fused_sum_squares(false)`,
//! every instruction takes the per-instruction path (kernels/common.cuh).
use super::device::driver_error;
use super::kernel::Kernel;
use super::{raw_ptr, Arg, Buf, CudaBackend};
use crate::error::{Result, RuntimeError};
use cudarc::driver::result as cu;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaSlice;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::optimizer_runs::{find_sum_squares_runs, SumSquaresRun};
use parc_compiler::ir::{BufferId, Program};
use std::collections::HashMap;

/// Threads per block (`sum_squares_one_pass` is written for 256).
const THREADS: u32 = 256;
/// Most blocks of one tensor's first pass.
pub(super) const MAX_BLOCKS: usize = parc_compiler::memplan::SUM_SQUARES_BLOCKS as usize;
/// Bytes of one `SsqTensor` (kernels/common.cuh): x, out, n, first, blocks.
const TENSOR_BYTES: usize = 40;
/// Most virtual blocks one block of `sum_squares_one_pass` takes (`SSQ_GROUP`).
const GROUP: u64 = 8;
/// Elements per thread a `sum_squares_one_pass` block is given where its tensor allows: small
/// tensors' virtual blocks (one element per thread) go 8 to a block, the 2.4M-element
/// matrices' (9 per thread) 7; a large tensor's virtual block (the vocabulary table's: 147)
/// stays alone, so its 1024 blocks still spread over the GPU.
const GROUP_ELEMENTS: u64 = 64;

/// Blocks of the first pass over a tensor of `n` elements (both paths).
fn blocks_for(n: usize) -> usize {
    n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS)
}

/// out[0] += Σ g² for one gradient on its own (the per-instruction path): per-block partial
/// sums into the reduction scratch, then one block adds them in order.
pub(super) fn per_instruction(be: &mut CudaBackend, g: Buf, out: Buf) -> Result<()> {
    let blocks = blocks_for(g.len);
    let part = be.scratch(blocks * 8)?;
    be.launch(
        Kernel::SumSquaresPartial,
        (blocks as u32, 1, 1),
        (THREADS, 1, 1),
        0,
        &[Arg::Ptr(g.ptr), Arg::Ptr(part), Arg::I64(g.len as i64)],
    )?;
    be.launch(
        Kernel::SumPartialsInto,
        (1, 1, 1),
        (THREADS, 1, 1),
        0,
        &[Arg::Ptr(part), Arg::Ptr(out.ptr), Arg::I64(blocks as i64)],
    )
}

/// A run's table as bytes and where its parts lie in the allocation (byte offsets).
#[derive(Debug, PartialEq)]
struct TableLayout {
    /// The tensors, then (at `block_tensor`) one i32 tensor index per block, then (at `groups`)
    /// the one-pass kernel's blocks: an i32 pair (first block, blocks) each.
    bytes: Vec<u8>,
    block_tensor: usize,
    groups: usize,
    /// One f64 partial per block.
    partials: usize,
    /// One f64 sum per tensor.
    sums: usize,
    /// The one-pass kernel's counters: one u32 per tensor and one for the run (zero).
    counters: usize,
    /// The whole allocation.
    total: usize,
    blocks: u32,
    /// Blocks of the one-pass launch.
    group_count: u32,
}

/// Lays out the `SsqTensor`s of tensors with these (input pointer, output pointer, numel) and
/// the block → tensor map, the partials of tensor k following those of tensor k − 1.
fn encode_table(tensors: &[(CUdeviceptr, CUdeviceptr, u64)]) -> Result<TableLayout> {
    let mut bytes = Vec::with_capacity(tensors.len() * TENSOR_BYTES);
    let mut block_tensor = Vec::new();
    let mut groups = Vec::new();
    let mut first = 0u64;
    for (index, &(x, out, n)) in tensors.iter().enumerate() {
        let blocks = blocks_for(usize::try_from(n).unwrap_or(usize::MAX)) as u64;
        for v in [x, out, n, first, blocks] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        let index = i32::try_from(index).map_err(|_| too_large(tensors.len() as u64))?;
        block_tensor.extend(std::iter::repeat_n(index, blocks as usize));
        let per_thread = n.div_ceil(blocks * THREADS as u64).max(1);
        let group = (GROUP_ELEMENTS / per_thread).clamp(1, GROUP);
        let mut local = 0;
        while local < blocks {
            groups.push((first + local, group.min(blocks - local)));
            local += group;
        }
        first += blocks;
    }
    let blocks = u32::try_from(first)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| too_large(first))?;
    let block_tensor_at = bytes.len();
    for index in block_tensor {
        bytes.extend_from_slice(&index.to_le_bytes());
    }
    // int2s: 8-byte aligned.
    let groups_at = bytes.len().next_multiple_of(8);
    bytes.resize(groups_at, 0);
    for &(group_first, count) in &groups {
        // Both fit: group_first < blocks <= i32::MAX, count <= GROUP.
        bytes.extend_from_slice(&(group_first as i32).to_le_bytes());
        bytes.extend_from_slice(&(count as i32).to_le_bytes());
    }
    let partials = bytes.len().next_multiple_of(8);
    let sums = partials + 8 * blocks as usize;
    let counters = sums + 8 * tensors.len();
    Ok(TableLayout {
        bytes,
        block_tensor: block_tensor_at,
        groups: groups_at,
        partials,
        sums,
        counters,
        total: counters + 4 * (tensors.len() + 1),
        blocks,
        // No more groups than blocks.
        group_count: groups.len() as u32,
    })
}

fn too_large(what: u64) -> RuntimeError {
    RuntimeError::Unsupported(format!(
        "a fused sum-of-squares run needs {what} blocks or tensors, more than one launch has \
         (2^31 - 1)"
    ))
}

/// One run on the device.
struct DeviceRun {
    run: SumSquaresRun,
    /// The table, partials and sums (kept alive; the pointers below point into it).
    table: CudaSlice<u8>,
    tensors: CUdeviceptr,
    block_tensor: CUdeviceptr,
    partials: CUdeviceptr,
    sums: CUdeviceptr,
    groups: CUdeviceptr,
    counters: CUdeviceptr,
    group_count: u32,
    /// Per member, the input and output pointers the table holds.
    pointers: Vec<(CUdeviceptr, CUdeviceptr)>,
}

/// Where the executor is inside a launched run: the member expected next.
#[derive(Clone, Copy)]
struct Cursor {
    run: usize,
    next: usize,
}

/// The fused runs of the prepared program and the executor's position in them.
pub(super) struct FusedSumSquares {
    enabled: bool,
    runs: Vec<DeviceRun>,
    /// A run's first member's input buffer → the run.
    by_first: HashMap<BufferId, usize>,
    cursor: Option<Cursor>,
}

impl Default for FusedSumSquares {
    fn default() -> FusedSumSquares {
        FusedSumSquares {
            enabled: true,
            runs: Vec::new(),
            by_first: HashMap::new(),
            cursor: None,
        }
    }
}

impl FusedSumSquares {
    /// Device bytes of the tables.
    pub fn bytes(&self) -> usize {
        self.runs.iter().map(|r| r.table.len()).sum()
    }
}

fn run_error(what: String) -> RuntimeError {
    RuntimeError::Op {
        op: "fused SumSquares".into(),
        what,
    }
}

impl CudaBackend {
    /// `false`: sum every gradient's squares with its own two launches (the per-instruction
    /// path), e.g. to compare against the fused one. Takes effect at `prepare`.
    pub fn with_fused_sum_squares(mut self, fused: bool) -> CudaBackend {
        self.sum_squares.enabled = fused;
        self
    }

    /// The fused `SumSquares` runs of the prepared program: how many instructions each covers
    /// (empty before `prepare`, without a memory plan, or with fusion off).
    pub fn fused_sum_squares_runs(&self) -> Vec<usize> {
        (self.sum_squares.runs.iter())
            .map(|r| r.run.members.len())
            .collect()
    }

    /// Builds and uploads the table of every run of `program` whose buffers the memory plan
    /// places (called from `prepare`, after the planned regions exist).
    pub(super) fn prepare_fused_sum_squares(&mut self, program: &Program) -> Result<()> {
        let enabled = self.sum_squares.enabled;
        self.sum_squares = FusedSumSquares {
            enabled,
            ..FusedSumSquares::default()
        };
        if !enabled {
            return Ok(());
        }
        for run in find_sum_squares_runs(program) {
            let pointer = |id: BufferId| self.planned.pointer(id.0 as usize).map(|(p, _)| p);
            let pointers: Option<Vec<(CUdeviceptr, CUdeviceptr)>> = (run.members.iter())
                .map(|m| Some((pointer(m.input)?, pointer(m.output)?)))
                .collect();
            // A buffer outside the plan has no fixed address: leave the run per-instruction.
            let Some(pointers) = pointers else { continue };
            let first = run.members[0].input;
            if self.sum_squares.by_first.contains_key(&first) {
                continue;
            }
            let tensors: Vec<(CUdeviceptr, CUdeviceptr, u64)> = (pointers.iter())
                .zip(&run.members)
                .map(|(&(x, out), m)| (x, out, m.numel))
                .collect();
            let layout = encode_table(&tensors)?;
            let table = self.alloc_bytes(layout.total, "a fused sum-of-squares table")?;
            let base = raw_ptr(&self.stream, &table);
            // SAFETY: the allocation holds layout.total >= layout.bytes.len() bytes;
            // synchronous copy.
            unsafe { cu::memcpy_htod_sync(base, &layout.bytes) }
                .map_err(|e| driver_error("uploading a fused sum-of-squares table", e))?;
            let at = |offset: usize| base + offset as CUdeviceptr;
            self.sum_squares
                .by_first
                .insert(first, self.sum_squares.runs.len());
            self.sum_squares.runs.push(DeviceRun {
                run,
                tensors: base,
                block_tensor: at(layout.block_tensor),
                partials: at(layout.partials),
                sums: at(layout.sums),
                groups: at(layout.groups),
                counters: at(layout.counters),
                table,
                group_count: layout.group_count,
                pointers,
            });
        }
        Ok(())
    }

    /// Handles `op` if it belongs to a fused run: the run's first instruction launches the whole
    /// run, its later ones are no-ops. Returns false for every other op (the per-instruction
    /// path); any op but the expected member while a launched run is pending is an error.
    pub(super) fn fused_sum_squares(
        &mut self,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
    ) -> Result<bool> {
        if let Some(cursor) = self.sum_squares.cursor {
            let members = &self.sum_squares.runs[cursor.run].run.members;
            let expected = &members[cursor.next];
            if !expected.is(op, inputs, outputs) {
                return Err(run_error(format!(
                    "{} came while instruction {}'s SumSquares was expected: the fused launch \
                     at instruction {} already added instructions {}..={} into their outputs; \
                     run the program's instructions in order",
                    op.opcode().name(),
                    expected.index,
                    members[0].index,
                    expected.index,
                    members[members.len() - 1].index
                )));
            }
            self.sum_squares.cursor = (cursor.next + 1 < members.len()).then_some(Cursor {
                next: cursor.next + 1,
                ..cursor
            });
            return Ok(true);
        }
        if !matches!(op, Op::SumSquares) {
            return Ok(false);
        }
        let Some(&run) = inputs
            .first()
            .and_then(|x| self.sum_squares.by_first.get(x))
        else {
            return Ok(false);
        };
        if !self.sum_squares.runs[run].run.members[0].is(op, inputs, outputs) {
            return Ok(false);
        }
        self.launch_fused_sum_squares(run)?;
        self.sum_squares.cursor = Some(Cursor { run, next: 1 });
        Ok(true)
    }

    /// Checks run `index`'s buffers are bound where its table points, then launches it.
    fn launch_fused_sum_squares(&mut self, index: usize) -> Result<()> {
        let mut ids = Vec::new();
        {
            let run = &self.sum_squares.runs[index];
            for (m, &(x, out)) in run.run.members.iter().zip(&run.pointers) {
                for (id, want, want_len) in [(m.input, x, m.numel as usize), (m.output, out, 1)] {
                    let b = self.buf(id)?;
                    if b.ptr != want
                        || b.len != want_len
                        || b.dtype != parc_compiler::ir::DType::F32
                    {
                        return Err(run_error(format!(
                            "buffer {} of instruction {} is bound at {:#x} with {} {:?} \
                             elements, but the table built at prepare has {want:#x} with \
                             {want_len} f32 (a backend bug: planned buffers never move)",
                            id.0, m.index, b.ptr, b.len, b.dtype
                        )));
                    }
                    ids.push(id);
                }
            }
        }
        self.order_after_comm(ids)?;
        let run = &self.sum_squares.runs[index];
        let count = run.run.members.len() as i64;
        let (tensors, partials, sums) = (run.tensors, run.partials, run.sums);
        let args = [
            Arg::Ptr(tensors),
            Arg::Ptr(run.block_tensor),
            Arg::Ptr(run.groups),
            Arg::Ptr(partials),
            Arg::Ptr(sums),
            Arg::Ptr(run.counters),
            Arg::I64(count),
        ];
        let grid = (run.group_count, 1, 1);
        self.launch(Kernel::SumSquaresOnePass, grid, (THREADS, 1, 1), 0, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_u64(bytes: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn table_layout_matches_the_kernels_struct_and_the_per_tensor_blocks() {
        // 1 block (an empty tensor still gets one, as the per-tensor launch does), 3 blocks
        // (513 elements), the 1024-block cap.
        let t = encode_table(&[(1, 2, 0), (3, 4, 513), (5, 2, 10_000_000)]).unwrap();
        assert_eq!(t.blocks, 1 + 3 + 1024);
        let tensor = |k: usize| -> Vec<u64> {
            (0..5)
                .map(|f| read_u64(&t.bytes, k * TENSOR_BYTES + 8 * f))
                .collect()
        };
        assert_eq!(tensor(0), vec![1, 2, 0, 0, 1]);
        assert_eq!(tensor(1), vec![3, 4, 513, 1, 3]);
        assert_eq!(tensor(2), vec![5, 2, 10_000_000, 4, 1024]);
        assert_eq!(t.block_tensor, 3 * TENSOR_BYTES);
        let map: Vec<i32> = (0..t.blocks as usize)
            .map(|b| {
                let at = t.block_tensor + 4 * b;
                i32::from_le_bytes(t.bytes[at..at + 4].try_into().unwrap())
            })
            .collect();
        assert_eq!(&map[..5], &[0, 1, 1, 1, 2]);
        assert!(map[4..].iter().all(|&k| k == 2));
        // 120 + 4 × 1028 = 4232 bytes, already a multiple of 8; then the one-pass groups:
        // the empty tensor's block, the 3 blocks of 513 elements (one element per thread) as
        // one group, the large tensor's 1024 blocks (39 elements per thread) one each.
        assert_eq!(t.groups, 4232);
        assert_eq!(t.group_count, 2 + 1024);
        let group = |g: usize| -> (i32, i32) {
            let at = t.groups + 8 * g;
            let int = |at: usize| i32::from_le_bytes(t.bytes[at..at + 4].try_into().unwrap());
            (int(at), int(at + 4))
        };
        assert_eq!(
            (0..4).map(group).collect::<Vec<_>>(),
            vec![(0, 1), (1, 3), (4, 1), (5, 1)]
        );
        assert_eq!(group(1025), (1027, 1));
        assert_eq!(t.bytes.len(), 4232 + 8 * 1026);
        assert_eq!(t.partials, t.bytes.len());
        assert_eq!(t.sums, t.partials + 8 * 1028);
        assert_eq!(t.counters, t.sums + 8 * 3);
        assert_eq!(t.total, t.counters + 4 * 4);
    }

    #[test]
    fn one_pass_groups_cover_every_block_once_within_a_tensor() {
        // 2.4M elements (9 per thread: 7 blocks a group), 590k (3: 8 a group), 38.6M (alone).
        let sizes = [2_359_296, 589_824, 38_597_376, 5];
        let tensors: Vec<_> = sizes.iter().map(|&n| (1, 2, n)).collect();
        let t = encode_table(&tensors).unwrap();
        let mut next = 0;
        let mut widths = Vec::new();
        for g in 0..t.group_count as usize {
            let at = t.groups + 8 * g;
            let int = |at: usize| i32::from_le_bytes(t.bytes[at..at + 4].try_into().unwrap());
            let (first, count) = (int(at), int(at + 4));
            assert_eq!(first, next, "group {g}");
            next += count;
            widths.push(count);
        }
        assert_eq!(next as u32, t.blocks);
        // 1024 = 146 × 7 + 2; 1024 = 128 × 8; 1024 × 1; 1.
        assert_eq!(t.group_count, 147 + 128 + 1024 + 1);
        assert_eq!((widths[0], widths[146], widths[147]), (7, 2, 8));
    }

    #[test]
    fn partials_start_eight_byte_aligned() {
        let t = encode_table(&[(1, 2, 256)]).unwrap();
        assert_eq!((t.blocks, t.groups), (1, 48));
        assert_eq!(t.bytes.len(), 56);
        assert_eq!(t.partials, 56);
    }

    #[test]
    fn blocks_follow_the_per_tensor_launch() {
        assert_eq!(blocks_for(0), 1);
        assert_eq!(blocks_for(256), 1);
        assert_eq!(blocks_for(257), 2);
        assert_eq!(blocks_for(1 << 30), MAX_BLOCKS);
    }
}
