//! The CUDA backend (feature `cuda`): every `Op` of `parc_compiler::ir::op` forward and
//! backward on one NVIDIA GPU with the CPU backend's semantics (token ids i32, activations of
//! a bf16 run stored bf16, everything else fp32). The backend is told the run's precision when
//! it is made (`with_precision`): fp32 computes everything in fp32; a bf16 run stores the
//! plan's bf16 activations as bf16 (`stores_bf16`: kernels read them widened and round what
//! they write, per operand, `FloatArg`) and runs GEMMs and tensor-core attention on bf16
//! operands with fp32 accumulation; fp16 runs every GEMM on fp16 copies of its operands.
//! Master weights, gradients, optimizer state, norm statistics and losses stay fp32; fp16's
//! loss scaling comes from the executor (`StepScalars::loss_scale`) into the cross-entropy
//! gradient, clip and optimizer kernels. See
//! docs/cuda.md (the differential tests `tests/cuda_ops/` and `tests/cuda_train.rs` hold it
//! to them, per precision). GEMMs go through cuBLASLt (`gemm`), everything else through CUDA C
//! kernels compiled by NVRTC once per run (`compile`). All work is ordered on one stream;
//! reads to the host synchronise it, small host writes queue on it through page-locked slots
//! (`staging`), larger ones synchronise it.
//!
//! An op runs as one unit: `dispatch` binds its buffers to its signature (`crate::bind`: counts,
//! dtypes, element counts, rows) and routes it by `Family` to the module that holds that
//! family's host code beside its kernels' launch shapes, which checks only what its kernels add
//! (the 32-bit launch limits of `args::Limits`, tiles, alignment, positions against a table):
//! - `embedding`: `Embedding`, `PositionAdd` and their gradients;
//! - `norm`: `LayerNorm`, `RmsNorm` and their gradients (one path for both), their kernel
//!   variants, and `columns`' deterministic column sums for dw and db;
//! - `matmul`: the GEMM ops on cuBLASLt (`gemm`) or parc's Hopper kernel (`gemm_ws`), with the
//!   16-bit operand copies and casts of `gemm_operands`;
//! - `attention`: `Attention` and its gradient (exact, mma.sync, wgmma and warp-specialized
//!   kernels; TMA tensor maps from `tma`);
//! - `elementwise`: `Rope`, activations, SwiGLU, `Add`, `Scale` and their gradients;
//! - `fused`: the generated kernels (`Op::Fused`, an elementwise op): CUDA C from `codegen`
//!   through NVRTC, or LLVM's PTX (`PARC_CODEGEN`), loaded once per kernel and launched;
//! - `data_movement`: `Copy`, `CopyRange`, `Zero`, `SplitColumns`, `ConcatColumns`;
//! - `cross_entropy`: the loss family (the fused cross-entropy and the vocabulary-split pieces);
//! - `optimizer`: clipping and the AdamW / SGD updates, per tensor or fused (`optimizer`'s
//!   tables; `sum_squares` for the gradient norm).
//!
//! The leaves every family uses: `args` (operands as kernel arguments, launch limits),
//! `launch` (the launch of a compiled kernel, shared-memory opt-in, the persistent launch),
//! `kernel` (the kernel sources and every entry point of them as a typed `Kernel`,
//! whose C symbol is written once), `compile` (NVRTC and the PTX cache) and `variants` (which
//! kernel each op with variants runs: a typed choice per op, e.g. [`GemmKernel`], read from
//! `PARC_<OP>_KERNEL`). Beside the ops: `device` (opening the GPU, errors), `storage` (the
//! memory plan's regions and scratch sizes), `stream` (overlap of communication with compute),
//! `staging` (host writes), `scale_amax` (delayed FP8 scaling's scale amaxes copied to the
//! host after each roll), `choices` (the GEMM algorithms timed on first use, as a checkpoint
//! carries them) and `nccl` (NCCL: the communicators, the device comm, the host
//! comm, the watchdog).
//!
//! Buffers are keyed by `BufferId`. Given the program's memory plan (`Backend::prepare`, which
//! the executor always calls), the backend makes one allocation for the persistent buffers and
//! one arena for the transient ones, and sizes every per-op scratch once (`storage`): `Alloc` is
//! then a stream-ordered memset of the buffer's planned bytes (none where the plan says its first
//! use overwrites it: `MemoryLayout::needs_zero`) and `Free` releases nothing, so a step makes no
//! driver allocation. Without a plan each buffer is its own allocation. An op whose
//! output is also one of its inputs sees the input's value from before the op (the input is
//! copied first), as on the CPU, unless the op updates it in place (`Op::in_place`: the fused
//! cross-entropy overwrites its logits with dlogits without a copy).
mod args;
mod attention;
mod choices;
pub(crate) mod codegen;
mod columns;
mod compile;
mod cross_entropy;
mod data_movement;
mod device;
mod dispatch;
mod elementwise;
mod embedding;
mod epilogue;
mod fp8;
mod fp8_gemm;
mod fp8_quantize;
mod fp8_record;
mod fp8_roll;
mod fused;
mod gemm;
mod gemm_operands;
mod gemm_ws;
mod kernel;
mod launch;
mod matmul;
mod nccl;
mod norm;
mod optimizer;
mod scale_amax;
mod snapshot;
mod staging;
mod storage;
mod stream;
mod sum_squares;
mod swiglu_fp8;
mod tma;
mod variants;

use crate::backend::{Backend, DeviceTransfer, HostStaging, StepScalars};
use crate::error::{Result, RuntimeError};
use compile::Kernels;
use cudarc::driver::result as cu;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr};
use device::driver_error;
use gemm::{Blas, Operands};
use parc_compiler::ir::op::{Op, Segment};
use parc_compiler::ir::Program;
use parc_compiler::ir::{BufferId, CollectiveKind, DType};
use parc_compiler::memplan::{KernelTarget, MemoryLayout, OperandFormat};
use parc_compiler::spec::Precision;
use std::collections::HashMap;
use std::sync::Arc;

pub use device::gpu_absent;
pub use fused::{emitter_named, Emitter, NvrtcEmitter};
pub use nccl::{nccl_available, nccl_version, AbortNotice, FailureProbe, NcclHostComm, NcclId};
pub use variants::{AttentionBwdKernel, AttentionFwdKernel, CrossEntropyKernel, Fp8AmaxKernel};
pub use variants::{Fp8FactorsKernel, Fp8GemmKernel, SwigluFp8StoreKernel};
pub use variants::{GemmKernel, KernelVariant, NormBwdKernel, NormFwdKernel, Variant};

/// One allocated buffer.
struct Slot {
    /// The buffer's own allocation; None for a planned buffer (it points into a region).
    memory: Option<CudaSlice<u8>>,
    ptr: CUdeviceptr,
    len: usize,
    dtype: DType,
}

/// A bound buffer as `dispatch` sees it: device pointer, element count, dtype.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Buf {
    pub id: BufferId,
    pub ptr: CUdeviceptr,
    pub len: usize,
    pub dtype: DType,
}

impl crate::bind::OperandBuffer for Buf {
    fn id(&self) -> BufferId {
        self.id
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn numel(&self) -> usize {
        self.len
    }
}

impl Buf {
    /// Bytes per element (4 for f32 and i32, 2 for bf16).
    pub fn elem_bytes(&self) -> usize {
        self.dtype.bytes() as usize
    }

    /// Bytes of the whole buffer.
    pub fn bytes(&self) -> usize {
        self.len * self.elem_bytes()
    }

    /// Whether the buffer stores bf16.
    pub fn is_bf16(&self) -> bool {
        self.dtype == DType::Bf16
    }
}

/// A Float operand as a kernel receives it (`struct Fv` in kernels/common.cuh): the pointer
/// and whether it points at bf16 (else f32), padded to 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct FloatArg {
    ptr: CUdeviceptr,
    bf16: i32,
    pad: i32,
}

impl FloatArg {
    /// `b` from element `offset` on.
    pub fn at(b: Buf, offset: usize) -> FloatArg {
        FloatArg {
            ptr: b.ptr + (offset * b.elem_bytes()) as CUdeviceptr,
            bf16: i32::from(b.is_bf16()),
            pad: 0,
        }
    }

    /// `b`'s storage type with a null pointer: an output a kernel computes but does not store.
    pub fn unstored(b: Buf) -> FloatArg {
        FloatArg {
            ptr: 0,
            ..FloatArg::at(b, 0)
        }
    }
}

/// A kernel argument.
#[derive(Clone, Copy)]
pub(crate) enum Arg {
    Ptr(CUdeviceptr),
    I64(i64),
    I32(i32),
    F32(f32),
    F64(f64),
    Geom(attention::AttGeom),
    Float(FloatArg),
    Tma(tma::TmaMap),
    RopeScale(elementwise::RopeScale),
}

// SAFETY: AttGeom is #[repr(C)] plain data matching the kernels' `struct AttGeom`.
unsafe impl DeviceRepr for attention::AttGeom {}
// SAFETY: FloatArg is #[repr(C)] plain data matching the kernels' `struct Fv`.
unsafe impl DeviceRepr for FloatArg {}
// SAFETY: RopeScale is #[repr(C)] plain data matching the kernels' `struct RopeScale`.
unsafe impl DeviceRepr for elementwise::RopeScale {}

/// The CUDA backend. See the module docs.
pub struct CudaBackend {
    /// NCCL communicators and the communication stream, once `use_nccl` set them up. First:
    /// fields drop in order, so queued communication ends before the buffers it uses are freed.
    nccl: Option<nccl::NcclComm>,
    /// Page-locked slots of small host writes (`staging`); before the buffers, so a pending
    /// copy completes before its destination is freed.
    staging: staging::Staging,
    /// Delayed FP8 scaling's scale amaxes as the host sees them (`scale_amax`); before the
    /// buffers, so pending copies complete before their sources are freed.
    scale_amaxes: scale_amax::ScaleAmaxes,
    /// Delayed FP8 scaling's records held for the GEMMs that take them (`fp8_record`).
    records: fp8_record::Records,
    swiglu_runs: swiglu_fp8::SwigluRuns,
    /// Delayed FP8 scaling's runs of history rolls, each made in one launch (`fp8_roll`).
    rolls: fp8_roll::Rolls,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    blas: Blas,
    slots: Vec<Option<Slot>>,
    /// The memory plan's regions and pointers (empty until `prepare`).
    planned: storage::PlannedRegions,
    /// Copies of inputs that are also their op's output, sized by `prepare`.
    aliased: Option<CudaSlice<u8>>,
    /// Device allocations made so far (see `driver_allocations`).
    allocations: std::cell::Cell<u64>,
    /// Fill buffers the memory plan exempts from zeroing with NaN ([`CudaBackend::poison_unzeroed`]).
    poison_unzeroed: bool,
    /// Global positions per `Segment` list, uploaded once.
    positions: HashMap<Vec<Segment>, (CudaSlice<u8>, usize)>,
    /// Scratch for reductions' partials; grows, never shrinks.
    scratch: Option<CudaSlice<u8>>,
    /// The GEMM operand type: fp32, bf16 for `precision = bf16`, fp16 for `precision = fp16`.
    operands: Operands,
    /// The GEMMs' 16-bit operand memory: per-use copies, cached weight casts, bias vectors
    /// (`gemm_operands`).
    gemm_operands: gemm_operands::GemmOperands,
    /// The fused optimizer's runs and tables (built by `prepare`).
    fused: optimizer::FusedOptimizer,
    /// The fused `SumSquares` runs and tables (built by `prepare`).
    sum_squares: sum_squares::FusedSumSquares,
    /// The generated kernels (`Op::Fused`) loaded so far, and their emitter.
    generated: fused::Generated,
    /// `--profile`'s time marks on the compute stream since the last `marked_intervals`.
    time_marks: Vec<cudarc::driver::CudaEvent>,
    /// Which implementation runs each op that has kernel variants (`variants`).
    variants: variants::KernelVariants,
    /// Whether the GPU is a Hopper (compute capability 9.0), which alone runs the kernels
    /// compiled for compute_90a's features (`wgmma`).
    hopper: bool,
    /// The device's SM count and shared memory (launch shapes of persistent kernels).
    limits: device::DeviceLimits,
    /// Kept alive for cuBLASLt.
    _workspace: CudaSlice<u8>,
}

const WORKSPACE_BYTES: usize = parc_compiler::memplan::CUBLASLT_WORKSPACE_BYTES as usize;

fn buffer_error(id: BufferId, what: impl Into<String>) -> RuntimeError {
    RuntimeError::Buffer {
        id: id.0,
        what: what.into(),
    }
}

fn raw_ptr(stream: &CudaStream, memory: &CudaSlice<u8>) -> CUdeviceptr {
    use cudarc::driver::DevicePtr;
    let (ptr, _sync) = memory.device_ptr(stream);
    ptr
}

impl CudaBackend {
    /// Open GPU `ordinal` and compile (or load from the cache) the kernels. Fails with a clear
    /// message ("no CUDA driver found: …", "no CUDA device found: …") where there is none.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        CudaBackend::with_precision(ordinal, Precision::Fp32)
    }

    /// A backend for a run in `precision` (the spec's `train.precision`): fp32, bf16 or fp16
    /// GEMMs (see the module docs; fp16's loss scale arrives with each op's `StepScalars`).
    pub fn with_precision(ordinal: usize, precision: Precision) -> Result<CudaBackend> {
        let operands = match precision {
            Precision::Fp32 => Operands::F32,
            Precision::Bf16 => Operands::Bf16,
            Precision::Fp16 { .. } => Operands::F16,
        };
        let variants = variants::KernelVariants::from_env()?;
        let (ctx, stream) = device::open(ordinal)?;
        let limits = device::limits(&ctx)?;
        let kernels = Kernels::load(&ctx)?;
        let hopper = ctx
            .compute_capability()
            .map_err(|e| driver_error("reading the compute capability", e))?
            == (9, 0);
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| driver_error("allocating the cuBLASLt workspace", e))?;
        let blas = Blas::new(raw_ptr(&stream, &workspace), WORKSPACE_BYTES)?;
        Ok(CudaBackend {
            ctx,
            stream,
            kernels,
            blas,
            slots: Vec::new(),
            planned: storage::PlannedRegions::default(),
            aliased: None,
            allocations: std::cell::Cell::new(0),
            poison_unzeroed: false,
            positions: HashMap::new(),
            scratch: None,
            operands,
            gemm_operands: gemm_operands::GemmOperands::default(),
            fused: optimizer::FusedOptimizer::default(),
            sum_squares: sum_squares::FusedSumSquares::default(),
            generated: fused::Generated::default(),
            time_marks: Vec::new(),
            variants,
            hopper,
            limits,
            _workspace: workspace,
            nccl: None,
            staging: staging::Staging::default(),
            scale_amaxes: scale_amax::ScaleAmaxes::default(),
            records: fp8_record::Records::default(),
            swiglu_runs: swiglu_fp8::SwigluRuns::new(true),
            rolls: fp8_roll::Rolls::default(),
        })
    }

    /// Run `variant` of its op's kernel from now on (tests; runs choose with
    /// `PARC_<OP>_KERNEL`, read when the backend is made), e.g. `AttentionFwdKernel::Fa2`.
    pub fn set_kernel_variant(&mut self, variant: impl Into<KernelVariant>) {
        self.variants.set(variant.into());
    }

    /// Whether the GPU is a Hopper (compute capability 9.0: the program holds its compute_90a
    /// kernels, e.g. the `wgmma` attention), read once when the backend was made.
    pub fn is_hopper(&self) -> bool {
        self.hopper
    }

    /// What this run's kernel choices, and so its scratch, depend on: the operand format and
    /// the GPU (the compiler's memory plan reads the same from the spec).
    pub(crate) fn kernel_target(&self) -> KernelTarget {
        let operands = match self.operands {
            Operands::Bf16 => OperandFormat::Bf16,
            Operands::F16 => OperandFormat::F16,
            // A run's operands are never FP8 (FP8 is chosen per GEMM on a bf16 run).
            Operands::F32 | Operands::Fp8(_) => OperandFormat::F32,
        };
        KernelTarget {
            operands,
            hopper: self.hopper,
        }
    }

    /// The device's name, e.g. for the `--backend auto` message.
    pub fn device_name(&self) -> Result<String> {
        self.ctx
            .name()
            .map_err(|e| driver_error("reading the device name", e))
    }

    /// Wait for the work queued on the compute stream; surfaces asynchronous kernel errors.
    /// Communication queued on the NCCL stream is not waited for: `Backend::synchronize` waits
    /// for both.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver_error("waiting for queued GPU work", e))
    }

    /// The bytes of buffer `id` as the device holds them, whatever its dtype (FP8 bytes, bf16
    /// bit patterns, little-endian f32 and i32), after the work queued before.
    pub fn read_bytes(&self, id: BufferId) -> Result<Vec<u8>> {
        self.wait_comm_for(id)?;
        let s = self.slot(id)?;
        self.synchronize()?;
        self.check_comm_intact()?;
        let mut host = vec![0u8; s.len * s.dtype.bytes() as usize];
        // SAFETY: the allocation holds s.len elements of s.dtype, host.len() bytes; the stream
        // is idle.
        unsafe { cu::memcpy_dtoh_sync(&mut host, s.ptr) }
            .map_err(|e| driver_error(&format!("reading buffer {}", id.0), e))?;
        Ok(host)
    }

    fn slot(&self, id: BufferId) -> Result<&Slot> {
        self.slots
            .get(id.0 as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| buffer_error(id, "is not allocated"))
    }

    fn buf(&self, id: BufferId) -> Result<Buf> {
        let s = self.slot(id)?;
        Ok(Buf {
            id,
            ptr: s.ptr,
            len: s.len,
            dtype: s.dtype,
        })
    }

    /// Device allocations this backend has made (regions, scratch, buffers outside the memory
    /// plan, aliased-input copies), not counting the cuBLASLt workspace. With a memory plan it
    /// stops growing after `prepare`: a training step allocates nothing.
    pub fn driver_allocations(&self) -> u64 {
        self.allocations.get()
    }

    /// From now on fill every buffer the memory plan exempts from zero-filling
    /// (`MemoryLayout::needs_zero`) with NaN instead of leaving its stale bytes, as the CPU
    /// backend always does: a kernel that reads such a buffer before writing all of it then
    /// poisons the loss instead of computing on harmless leftovers. For tests; it costs the
    /// memsets the exemption saves.
    pub fn poison_unzeroed(&mut self) {
        self.poison_unzeroed = true;
    }

    fn alloc_bytes(&self, bytes: usize, what: &str) -> Result<CudaSlice<u8>> {
        self.allocations.set(self.allocations.get() + 1);
        self.stream
            .alloc_zeros::<u8>(bytes.max(4))
            .map_err(|e| driver_error(&format!("allocating {bytes} bytes for {what}"), e))
    }

    /// Device memory held now: the memory plan's regions, buffers allocated outside it, the
    /// scratch (reduction partials, 16-bit GEMM operands, aliased inputs), uploaded positions
    /// and the cuBLASLt workspace. With a memory plan this is fixed after `prepare` (scratch
    /// sized from the program), so it is the run's peak buffer memory; the CUDA context and
    /// the kernels' code are not counted.
    pub fn reserved_bytes(&self) -> u64 {
        let own: usize = self
            .slots
            .iter()
            .flatten()
            .filter_map(|s| s.memory.as_ref().map(CudaSlice::len))
            .sum();
        let scratch: usize = [&self.scratch, &self.aliased]
            .into_iter()
            .flatten()
            .map(CudaSlice::len)
            .sum::<usize>()
            + self.gemm_operand_bytes();
        let positions: usize = self.positions.values().map(|(m, _)| m.len()).sum();
        let tables = self.fused.bytes() + self.sum_squares.bytes() + self.rolls.bytes();
        self.planned.bytes + (own + scratch + positions + tables + WORKSPACE_BYTES) as u64
    }

    /// Room for a copy of an aliased input of `bytes`: the next piece of the planned scratch,
    /// or (without room there) an allocation of its own, kept in `own` until the op is queued.
    fn aliased_copy(
        &self,
        own: &mut Vec<CudaSlice<u8>>,
        used: &mut usize,
        bytes: usize,
    ) -> Result<CUdeviceptr> {
        if let Some(scratch) = &self.aliased {
            let start = *used;
            if start + bytes <= scratch.len() {
                *used = (start + bytes).next_multiple_of(256);
                return Ok(raw_ptr(&self.stream, scratch) + start as CUdeviceptr);
            }
        }
        let copy = self.alloc_bytes(bytes, "an aliased input")?;
        let ptr = raw_ptr(&self.stream, &copy);
        own.push(copy);
        Ok(ptr)
    }

    /// Device pointer to `bytes` of scratch (valid until the next call; stream-ordered).
    pub(crate) fn scratch(&mut self, bytes: usize) -> Result<CUdeviceptr> {
        let big_enough = self.scratch.as_ref().is_some_and(|s| s.len() >= bytes);
        if !big_enough {
            let least = parc_compiler::memplan::MIN_REDUCTION_SCRATCH as usize;
            self.scratch = Some(self.alloc_bytes(bytes.max(least), "reduction scratch")?);
        }
        match &self.scratch {
            Some(s) => Ok(raw_ptr(&self.stream, s)),
            None => Err(RuntimeError::Unsupported("scratch memory missing".into())),
        }
    }

    /// Device array of the global position of each local sequence index of `segments`.
    pub(crate) fn positions(&mut self, segments: &[Segment]) -> Result<(CUdeviceptr, usize)> {
        if !self.positions.contains_key(segments) {
            let mut host: Vec<i32> = Vec::new();
            for s in segments {
                let end = s.start.checked_add(s.len).filter(|&e| e <= i32::MAX as u32);
                let end = end.ok_or_else(|| RuntimeError::Op {
                    op: "positions".into(),
                    what: format!("segment {}+{} is past the i32 range", s.start, s.len),
                })?;
                host.extend((s.start..end).map(|p| p as i32));
            }
            let memory = self.alloc_bytes(host.len() * 4, "positions")?;
            let ptr = raw_ptr(&self.stream, &memory);
            // SAFETY: memory holds at least host.len() i32s; the host copy completes before
            // returning (synchronous copy).
            unsafe { cu::memcpy_htod_sync(ptr, &host) }
                .map_err(|e| driver_error("uploading positions", e))?;
            self.positions
                .insert(segments.to_vec(), (memory, host.len()));
        }
        match self.positions.get(segments) {
            Some((memory, len)) => Ok((raw_ptr(&self.stream, memory), *len)),
            None => Err(RuntimeError::Unsupported("positions missing".into())),
        }
    }

    pub(crate) fn copy_bytes(
        &self,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: callers checked both ranges lie inside their allocations.
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying device memory", e))
    }

    pub(crate) fn zero_bytes(&self, dst: CUdeviceptr, bytes: usize) -> Result<()> {
        // SAFETY: callers pass a whole allocation's pointer and size.
        unsafe { cu::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver_error("zeroing device memory", e))
    }

    /// Fill `bytes` at `ptr` with quiet NaNs of `dtype`: one per 4-byte word (f32 and i32
    /// buffers alike), one per 2-byte element for bf16, one per byte for FP8 (0x7f).
    fn poison(&self, ptr: CUdeviceptr, bytes: usize, dtype: DType) -> Result<()> {
        let stream = self.stream.cu_stream();
        // SAFETY: the planned range holds `bytes` bytes, a multiple of the element size.
        let done = unsafe {
            match dtype {
                DType::Bf16 => {
                    cudarc::driver::sys::cuMemsetD16Async(ptr, 0x7fc0, bytes / 2, stream)
                }
                DType::Fp8(_) => cudarc::driver::sys::cuMemsetD8Async(ptr, 0x7f, bytes, stream),
                DType::F32 | DType::I32 => {
                    cudarc::driver::sys::cuMemsetD32Async(ptr, 0x7fc0_0000, bytes / 4, stream)
                }
            }
        };
        done.result()
            .map_err(|e| driver_error("poisoning an unzeroed buffer", e))
    }

    fn write<T>(&mut self, id: BufferId, dtype: DType, data: &[T]) -> Result<()> {
        self.gemm_buffer_written(id);
        self.scale_amax_written(id);
        if self.comm_uses(id) {
            self.drain_comm()?;
        }
        let s = self.slot(id)?;
        if s.dtype != dtype {
            return Err(buffer_error(
                id,
                format!("is {:?}, cannot write {dtype:?} data", s.dtype),
            ));
        }
        if s.len != data.len() {
            return Err(buffer_error(
                id,
                format!("holds {} elements, got {} to write", s.len, data.len()),
            ));
        }
        let bytes = std::mem::size_of_val(data);
        if staging::staged(bytes) {
            // SAFETY: T is one of the plain numeric types the buffers hold (f32, i32, u16 bf16
            // bits): its bytes are initialised, with no padding.
            let src = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), bytes) };
            // Queued on the compute stream: after the ops queued before (earlier readers of
            // the buffer), before those queued after; the host does not wait.
            return self.staging.upload(&self.ctx, &self.stream, s.ptr, src);
        }
        CudaBackend::synchronize(self)?;
        // SAFETY: the allocation holds exactly data.len() elements of this type.
        unsafe { cu::memcpy_htod_sync(s.ptr, data) }
            .map_err(|e| driver_error(&format!("writing buffer {}", id.0), e))
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    /// A bf16 run stores its activations in bf16 (docs/cuda.md, "bf16 activation storage");
    /// fp32 and fp16 runs store f32.
    fn stores_bf16(&self) -> bool {
        self.operands == Operands::Bf16
    }

    fn reserved_bytes(&self) -> Option<u64> {
        Some(CudaBackend::reserved_bytes(self))
    }

    fn synchronize(&mut self) -> Result<()> {
        self.flush_records(true)?;
        self.drain_comm()?;
        CudaBackend::synchronize(self)
    }

    /// A timing event recorded on the compute stream (work on the communication stream is
    /// seen where the compute stream waits for it).
    fn mark_time(&mut self) -> Result<bool> {
        let event = self
            .stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| driver_error("recording a profiling event", e))?;
        self.time_marks.push(event);
        Ok(true)
    }

    fn wait_for_communication(&mut self, buffers: &[BufferId]) -> Result<()> {
        self.order_after_comm(buffers.iter().copied())
    }

    fn marked_intervals(&mut self) -> Result<Vec<f64>> {
        let marks = std::mem::take(&mut self.time_marks);
        CudaBackend::synchronize(self)?;
        marks
            .windows(2)
            .map(|pair| {
                pair[0]
                    .elapsed_ms(&pair[1])
                    .map(|ms| f64::from(ms) / 1e3)
                    .map_err(|e| driver_error("reading a profiling event's time", e))
            })
            .collect()
    }

    fn prepare(&mut self, program: &Program, layout: &MemoryLayout) -> Result<()> {
        if self.slots.iter().any(Option::is_some) {
            return Err(RuntimeError::Unsupported(
                "the CUDA backend was given a memory plan after buffers were allocated".into(),
            ));
        }
        let region = |bytes: u64, what: &str| -> Result<(CudaSlice<u8>, CUdeviceptr)> {
            let memory = self.alloc_bytes(bytes as usize, what)?;
            let ptr = raw_ptr(&self.stream, &memory);
            Ok((memory, ptr))
        };
        let persistent = region(layout.persistent_bytes, "the persistent buffers")?;
        let arena = region(layout.arena_bytes, "the transient buffer arena")?;
        self.planned = storage::PlannedRegions::new(program, layout, persistent, arena);
        let needs = storage::program_needs(program, self.kernel_target());
        self.scratch(needs.scratch.reduction as usize)?;
        self.prepare_gemm(program, &needs.scratch)?;
        self.aliased = None;
        if needs.scratch.aliased > 0 {
            let bytes = needs.scratch.aliased as usize;
            self.aliased = Some(self.alloc_bytes(bytes, "aliased input copies")?);
        }
        for segments in &needs.segments {
            self.positions(segments)?;
        }
        self.prepare_fused_optimizer(program)?;
        self.records.prepare(program);
        self.swiglu_runs.prepare(program);
        self.prepare_rolls(program)?;
        self.prepare_fused_sum_squares(program)
    }

    fn alloc(&mut self, id: BufferId, shape: &[u64], dtype: DType) -> Result<()> {
        let len = shape
            .iter()
            .try_fold(1usize, |acc, &d| {
                usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
            })
            .ok_or_else(|| buffer_error(id, format!("shape {shape:?} is too large")))?;
        self.fused.check_alloc(id)?;
        self.scale_amax_written(id);
        let index = id.0 as usize;
        if self.slots.get(index).is_some_and(Option::is_some) {
            return Err(buffer_error(id, "is already allocated"));
        }
        let bytes = len * dtype.bytes() as usize;
        // Communication on the buffer waits for the compute queued up to here (earlier users of
        // its bytes, and its zero-fill where it gets one): the alloc counts as work on it.
        self.order_after_comm([id])?;
        let (memory, ptr) = match self.planned.pointer(index) {
            // Its planned bytes, zeroed in stream order (after every earlier user of them)
            // unless the plan says its first use writes all of them.
            Some((ptr, capacity)) => {
                if bytes as u64 > capacity {
                    return Err(buffer_error(
                        id,
                        format!("needs {bytes} bytes but was planned {capacity} (a planner bug)"),
                    ));
                }
                if bytes > 0 && self.planned.needs_zero(index) {
                    self.zero_bytes(ptr, bytes)?;
                } else if bytes > 0 && self.poison_unzeroed {
                    self.poison(ptr, bytes, dtype)?;
                }
                (None, ptr)
            }
            None => {
                let memory = self.alloc_bytes(bytes, &format!("buffer {}", id.0))?;
                let ptr = raw_ptr(&self.stream, &memory);
                (Some(memory), ptr)
            }
        };
        if self.slots.len() <= index {
            self.slots.resize_with(index + 1, || None);
        }
        self.slots[index] = Some(Slot {
            memory,
            ptr,
            len,
            dtype,
        });
        Ok(())
    }

    fn free(&mut self, id: BufferId) -> Result<()> {
        self.gemm_buffer_freed(id);
        self.scale_amax_written(id);
        // Communication still using the buffer must finish before its bytes are reused.
        self.order_after_comm([id])?;
        match self.slots.get_mut(id.0 as usize).and_then(Option::take) {
            Some(slot) => {
                drop(slot.memory);
                Ok(())
            }
            None => Err(buffer_error(id, "is not allocated")),
        }
    }

    fn compute(
        &mut self,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
        scalars: &StepScalars,
    ) -> Result<()> {
        self.flush_records(false)?;
        self.gemm_before_compute(op, inputs, outputs);
        for &id in outputs {
            self.scale_amax_written(id);
        }
        if self.fused_sum_squares(op, inputs, outputs)? {
            return Ok(());
        }
        if self.fused_optimizer(op, inputs, outputs, scalars)? {
            return Ok(());
        }
        if self.swiglu_runs.absorbed(self.records.current()) {
            return Ok(());
        }
        self.order_after_comm(inputs.iter().chain(outputs).copied())?;
        let outs = outputs
            .iter()
            .map(|&id| self.buf(id))
            .collect::<Result<Vec<_>>>()?;
        // Inputs that are also outputs are read from a copy taken before the op, except where
        // the op updates them in place (`Op::in_place`: it reads each element before writing it).
        let mut copies = Vec::new();
        let mut aliased_used = 0usize;
        let mut ins = Vec::with_capacity(inputs.len());
        for (i, &id) in inputs.iter().enumerate() {
            let mut b = self.buf(id)?;
            // The op's signature is read only for an input that is also an output.
            if outputs.contains(&id) && !op.in_place().any(|(input, _)| input == i) {
                let bytes = b.len * b.dtype.bytes() as usize;
                let ptr = self.aliased_copy(&mut copies, &mut aliased_used, bytes)?;
                self.copy_bytes(ptr, b.ptr, bytes)?;
                b.ptr = ptr;
            }
            ins.push(b);
        }
        dispatch::run(self, op, &ins, &outs, scalars)
    }

    /// Into a bf16 buffer each element is rounded to the nearest bf16 (ties to even) on the
    /// host; into an FP8 buffer to its format (`crate::cpu::fp8::round_fp8`), as the CPU backend
    /// stores them.
    fn write_f32(&mut self, id: BufferId, data: &[f32]) -> Result<()> {
        match self.slot(id)?.dtype {
            DType::Bf16 => {
                let bits: Vec<u16> = data
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                self.write(id, DType::Bf16, &bits)
            }
            DType::Fp8(format) => {
                let bits: Vec<u8> = (data.iter())
                    .map(|&v| crate::cpu::fp8::round_fp8(v, format))
                    .collect();
                self.write(id, DType::Fp8(format), &bits)
            }
            _ => self.write(id, DType::F32, data),
        }
    }

    fn write_i32(&mut self, id: BufferId, data: &[i32]) -> Result<()> {
        self.write(id, DType::I32, data)
    }

    /// A bf16 or FP8 buffer is read widened exactly to f32 (FP8: the stored values, scaled).
    fn read_f32(&self, id: BufferId) -> Result<Vec<f32>> {
        self.wait_comm_for(id)?;
        let s = self.slot(id)?;
        if let DType::Fp8(format) = s.dtype {
            let bytes = self.read_bytes(id)?;
            return Ok((bytes.into_iter())
                .map(|b| crate::cpu::fp8::widen_fp8(b, format))
                .collect());
        }
        if !matches!(s.dtype, DType::F32 | DType::Bf16) {
            return Err(buffer_error(
                id,
                format!("is {:?}, expected f32, bf16 or FP8", s.dtype),
            ));
        }
        self.synchronize()?;
        self.check_comm_intact()?;
        let what = || format!("reading buffer {}", id.0);
        if s.dtype == DType::Bf16 {
            let mut bits = vec![0u16; s.len];
            // SAFETY: the allocation holds exactly s.len bf16s; the stream is idle.
            unsafe { cu::memcpy_dtoh_sync(&mut bits, s.ptr) }
                .map_err(|e| driver_error(&what(), e))?;
            return Ok(bits
                .into_iter()
                .map(|b| half::bf16::from_bits(b).to_f32())
                .collect());
        }
        let mut host = vec![0.0f32; s.len];
        // SAFETY: the allocation holds exactly s.len f32s; the stream is idle.
        unsafe { cu::memcpy_dtoh_sync(&mut host, s.ptr) }.map_err(|e| driver_error(&what(), e))?;
        Ok(host)
    }

    /// The GEMM algorithms timed fastest and parc's kernel against cuBLASLt, per plan
    /// (`choices`); None before any GEMM was timed.
    fn choices(&self) -> Result<Option<String>> {
        let (algorithms, kernels) = (self.blas.chosen_algorithms(), self.chosen_kernels());
        if algorithms.is_empty() && kernels.is_empty() {
            return Ok(None);
        }
        let choices = choices::Choices::from_maps(
            self.device_name()?,
            choices::cublaslt_version(),
            algorithms,
            kernels,
        );
        choices.to_text().map(Some)
    }

    /// Takes `saved`'s choices where they were made on this device model and cuBLASLt version
    /// and can be read.
    fn adopt_choices(&mut self, saved: &str) -> Result<Option<String>> {
        let choices = match choices::Choices::parse(saved) {
            Ok(choices) => choices,
            Err(e) => return Ok(Some(e.to_string())),
        };
        let here = self.device_name()?;
        if let Some(why) = choices.foreign(&here, choices::cublaslt_version()) {
            return Ok(Some(why));
        }
        let (algorithms, kernels) = choices.into_maps();
        self.blas.prefer(algorithms);
        self.gemm_operands.ws_preferred.extend(kernels);
        Ok(None)
    }

    /// Page-locked memory, so the snapshot's copy runs at the bus's speed.
    fn host_staging(&mut self, len: usize) -> Result<Box<dyn HostStaging>> {
        if len == 0 {
            return Ok(Box::new(Vec::new()));
        }
        Ok(Box::new(snapshot::PinnedStaging::new(&self.ctx, len)?))
    }

    /// An f32 buffer is copied straight into `out` (pinned memory from `host_staging` makes
    /// this a direct DMA); a bf16 one is widened through `read_f32`.
    fn read_f32_into(&mut self, id: BufferId, out: &mut [f32]) -> Result<()> {
        let (dtype, len, ptr) = {
            let s = self.slot(id)?;
            (s.dtype, s.len, s.ptr)
        };
        if dtype != DType::F32 {
            let values = self.read_f32(id)?;
            crate::backend::check_read_len(id, values.len(), out)?;
            out.copy_from_slice(&values);
            return Ok(());
        }
        crate::backend::check_read_len(id, len, out)?;
        self.wait_comm_for(id)?;
        CudaBackend::synchronize(self)?;
        self.check_comm_intact()?;
        // SAFETY: the allocation holds exactly len f32s, as does out; the stream is idle.
        unsafe { cu::memcpy_dtoh_sync(out, ptr) }
            .map_err(|e| driver_error(&format!("reading buffer {}", id.0), e))
    }

    fn device_collective(
        &mut self,
        kind: CollectiveKind,
        group: &[u32],
        input: BufferId,
        output: BufferId,
    ) -> Option<Result<()>> {
        self.gemm_comm_writes(&[input, output]);
        self.scale_amax_written(output);
        self.nccl.as_ref()?;
        Some(self.nccl_collective(kind, group, input, output))
    }

    fn device_p2p(&mut self, transfers: &[DeviceTransfer]) -> Option<Result<()>> {
        let buffers: Vec<BufferId> = transfers
            .iter()
            .map(|t| match t {
                DeviceTransfer::Send { buffer, .. } | DeviceTransfer::Recv { buffer, .. } => {
                    *buffer
                }
            })
            .collect();
        self.gemm_comm_writes(&buffers);
        for &id in &buffers {
            self.scale_amax_written(id);
        }
        self.nccl.as_ref()?;
        Some(self.nccl_p2p(transfers))
    }

    fn abort(&mut self, reason: &str) {
        self.abort_nccl(reason);
    }

    fn begin_instruction(&mut self, index: usize) {
        self.records.begin(index);
        self.nccl_instruction(index);
    }

    fn check_outputs(&mut self, on: bool) {
        self.check_swiglu_outputs(on);
    }

    fn stuck_instruction(&self) -> Option<usize> {
        self.nccl_stuck_instruction()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `FloatArg` must match kernels/common.cuh's `struct Fv { void* p; int bf16; int pad_; }`.
    #[test]
    fn a_float_argument_is_laid_out_as_the_kernels_read_it() {
        assert_eq!(std::mem::size_of::<FloatArg>(), 16);
        assert_eq!(std::mem::align_of::<FloatArg>(), 8);
        assert_eq!(std::mem::offset_of!(FloatArg, bf16), 8);
        let buf = |dtype| Buf {
            id: BufferId(0),
            ptr: 0x1000,
            len: 64,
            dtype,
        };
        let f = FloatArg::at(buf(DType::F32), 5);
        assert_eq!((f.ptr, f.bf16), (0x1000 + 20, 0));
        let h = FloatArg::at(buf(DType::Bf16), 5);
        assert_eq!((h.ptr, h.bf16), (0x1000 + 10, 1));
    }
}
