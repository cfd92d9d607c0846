//! How a GEMM's A and B reach cuBLASLt in the run's operand type (`gemm::Operands`), and the
//! memory that takes. In an fp32 run cuBLASLt reads the f32 buffers as they are. In a bf16 or
//! fp16 run each operand is one of:
//! - **stored**: a bf16 buffer (bf16 activation storage) is read as it is;
//! - **a cached cast**: a weight (an f32 `Fp32`-class operand: a `Matmul`/`MatmulBwdData` `w`,
//!   or a bias the epilogue needs in bf16) is read through a 16-bit copy kept per buffer and
//!   made on first use after the buffer last changed. Any write invalidates it: an op output
//!   (the optimizer ops invalidate every cast, since a fused optimizer launch updates a whole
//!   run of parameters at its first instruction), `write_f32`, a collective or transfer into
//!   it; freeing the buffer drops it. With a memory plan only `Param` buffers are cached, in one
//!   allocation `prepare` sizes (a ZeRO-3 gathered weight lives one use and is copied per use
//!   instead, so no cast outlives its buffer); without a plan every weight operand is;
//! - **a per-use copy**: any other f32 operand (a buffer the plan keeps f32, every activation
//!   of an fp16 run) is rounded into the GEMM scratch, both operands in one launch, B first;
//!   the copy of the last GEMM's B is reused while that buffer is unchanged (a layer's
//!   backward-data and backward-weight GEMMs share dy).
//!
//! The scratch is, in order: B's copy, A's copy (each 256-byte aligned), then room for the D an
//! accumulating GEMM's algorithms are timed into (`gemm`); `memplan::backend_scratch` sizes it,
//! and the casts, for `prepare`. A separate vector area holds an fp32 1.0 and room for the longest
//! bias (gradient) vector: a bias-gradient epilogue's output before it is added into db, or a
//! per-use bf16 copy of a bias.
use super::gemm::{Gemm, Operands, Output, PlanKey};
use super::gemm_ws::Chosen;
use super::{raw_ptr, Arg, Buf, CudaBackend};
use crate::error::{Result, RuntimeError};
use cudarc::driver::result as cu;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaSlice;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{BufferId, DType, Program};
use parc_compiler::memplan::BackendScratch;
use std::collections::HashMap;

/// Alignment of every piece of GEMM memory (cuBLASLt's preferred operand alignment).
const ALIGN: usize = parc_compiler::memplan::ALIGN as usize;

fn aligned(bytes: usize) -> usize {
    bytes.next_multiple_of(ALIGN)
}

/// One GEMM operand: its bound buffer, and whether it is a weight (read through a cast).
#[derive(Clone, Copy, Debug)]
pub(super) struct Operand {
    pub buf: Buf,
    pub weight: bool,
}

/// A weight's cached 16-bit copy.
struct Cast {
    ptr: CUdeviceptr,
    len: usize,
    /// Whether it matches the buffer now.
    current: bool,
    /// Its own allocation (without a memory plan); None inside the planned cast region.
    own: Option<CudaSlice<u8>>,
}

/// The backend's GEMM operand memory and what it holds (see the module docs).
#[derive(Default)]
pub(super) struct GemmOperands {
    /// Per-use copies, then the timing D; sized by `prepare` (grows only without a plan).
    scratch: Option<CudaSlice<u8>>,
    /// The f32 pointer and length of the operand whose copy starts `scratch` (the last GEMM's
    /// B), while that buffer is known to be unchanged.
    copied_b: Option<(CUdeviceptr, usize)>,
    casts: HashMap<BufferId, Cast>,
    /// With a memory plan: the one allocation of every cast (the entries point into it).
    cast_region: Option<CudaSlice<u8>>,
    /// Whether `prepare` planned the casts (then only the planned weights are cached).
    planned: bool,
    /// An fp32 1.0, then (at `ALIGN`) room for `vector_len` fp32 values.
    vectors: Option<CudaSlice<u8>>,
    vector_len: usize,
    /// Per GEMM plan parc's kernel was measured on: the times and which runs it (`gemm_ws`).
    pub(super) ws_chosen: HashMap<PlanKey, Chosen>,
    /// What an earlier run measured for plans parc's kernel takes (`choices`, adopted from a
    /// checkpoint), by plan description: taken instead of measuring again.
    pub(super) ws_preferred: std::collections::BTreeMap<String, super::choices::ParcKernel>,
    /// `gemm_ws`'s split counters and the attention backward's work counters (zeroed): made
    /// by `prepare_gemm` on a Hopper, else with the first kernel that needs them.
    pub(super) ws_counters: Option<CudaSlice<u8>>,
    /// The FP8 GEMMs' quantized operands, amaxes and scales (`fp8`): sized by `prepare` for
    /// every run with FP8 GEMMs, else grown by the first FP8 GEMM that needs more.
    pub(super) fp8: Option<CudaSlice<u8>>,
}

impl GemmOperands {
    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        let own: usize = self
            .casts
            .values()
            .filter_map(|c| c.own.as_ref().map(CudaSlice::len))
            .sum();
        [&self.scratch, &self.cast_region, &self.vectors, &self.fp8]
            .into_iter()
            .flatten()
            .map(CudaSlice::len)
            .sum::<usize>()
            + own
    }

    /// Forgets the copy of B and the cast of `id` (the buffer is about to change).
    fn written(&mut self, id: BufferId, overlaps_b: bool) {
        if overlaps_b {
            self.copied_b = None;
        }
        if let Some(cast) = self.casts.get_mut(&id) {
            cast.current = false;
        }
    }
}

/// Where one operand of the current GEMM is read from.
enum Source {
    /// A 16-bit pointer (a stored bf16 buffer, or a current cast).
    Ready(CUdeviceptr),
    /// An f32 buffer to round into the scratch.
    Copy,
}

impl CudaBackend {
    /// Reserves the GEMM memory of `program` (from `prepare`), as `scratch` sizes it: the
    /// operand scratch, and in a 16-bit run the weight casts and the vector area.
    pub(super) fn prepare_gemm(
        &mut self,
        program: &Program,
        scratch: &BackendScratch,
    ) -> Result<()> {
        self.gemm_operands = GemmOperands::default();
        if scratch.fp8 > 0 {
            let bytes = scratch.fp8 as usize;
            self.gemm_operands.fp8 = Some(self.alloc_bytes(bytes, "FP8 GEMM operands and scales")?);
        }
        if self.operands == Operands::F32 {
            return Ok(());
        }
        if scratch.gemm_operands > 0 {
            let bytes = scratch.gemm_operands as usize;
            self.gemm_operands.scratch =
                Some(self.alloc_bytes(bytes, "16-bit GEMM operand copies")?);
        }
        if scratch.weight_casts > 0 {
            let bytes = scratch.weight_casts as usize;
            let region = self.alloc_bytes(bytes, "16-bit casts of the GEMM weights")?;
            let base = raw_ptr(&self.stream, &region);
            let mut offset = 0usize;
            for &id in &scratch.casts {
                let len = program.buffer(id).map_or(0, |b| b.numel() as usize);
                let cast = Cast {
                    ptr: base + offset as CUdeviceptr,
                    len,
                    current: false,
                    own: None,
                };
                self.gemm_operands.casts.insert(id, cast);
                offset += aligned(len * 2);
            }
            self.gemm_operands.cast_region = Some(region);
        }
        self.gemm_operands.planned = true;
        if self.hopper {
            // Here, so a planned step allocates nothing.
            self.ws_counters()?;
        }
        if scratch.gemm_vector_len > 0 {
            self.gemm_vectors(scratch.gemm_vector_len as usize)?;
        }
        Ok(())
    }

    /// Device pointers to an fp32 1.0 and to room for `len` fp32 values (valid until the next
    /// GEMM; stream-ordered). Made (or grown) here only without a plan's reservation.
    pub(super) fn gemm_vectors(&mut self, len: usize) -> Result<(CUdeviceptr, CUdeviceptr)> {
        if self.gemm_operands.vectors.is_none() || self.gemm_operands.vector_len < len {
            self.gemm_operands.vectors = None;
            let memory = self.alloc_bytes(ALIGN + len * 4, "GEMM bias vectors")?;
            let ptr = raw_ptr(&self.stream, &memory);
            // SAFETY: the allocation holds at least 4 bytes; the copy completes before return.
            unsafe { cu::memcpy_htod_sync(ptr, &[1.0f32]) }
                .map_err(|e| super::device::driver_error("writing the GEMM constant 1.0", e))?;
            self.gemm_operands.vectors = Some(memory);
            self.gemm_operands.vector_len = len;
        }
        match &self.gemm_operands.vectors {
            Some(v) => {
                let base = raw_ptr(&self.stream, v);
                Ok((base, base + ALIGN as CUdeviceptr))
            }
            None => Err(RuntimeError::Unsupported("GEMM vectors missing".into())),
        }
    }

    /// The current 16-bit cast of weight `buf` (f32), made now if stale; None where the run
    /// does not cache it (fp32 runs; with a memory plan, a weight that is not a `Param`).
    pub(super) fn weight_cast(&mut self, buf: Buf) -> Result<Option<CUdeviceptr>> {
        if self.operands == Operands::F32 || buf.dtype != DType::F32 {
            return Ok(None);
        }
        if !self.gemm_operands.casts.contains_key(&buf.id) {
            if self.gemm_operands.planned {
                return Ok(None);
            }
            let own = self.alloc_bytes(buf.len * 2, "a 16-bit cast of a GEMM weight")?;
            let cast = Cast {
                ptr: raw_ptr(&self.stream, &own),
                len: buf.len,
                current: false,
                own: Some(own),
            };
            self.gemm_operands.casts.insert(buf.id, cast);
        }
        let (ptr, len, current) = match self.gemm_operands.casts.get(&buf.id) {
            Some(c) => (c.ptr, c.len, c.current),
            None => return Err(RuntimeError::Unsupported("GEMM weight cast missing".into())),
        };
        if len != buf.len {
            return Err(RuntimeError::Buffer {
                id: buf.id.0,
                what: format!(
                    "holds {} elements but its GEMM cast was planned for {len}",
                    buf.len
                ),
            });
        }
        if !current {
            self.round_copy(buf.ptr, ptr, len)?;
            if let Some(c) = self.gemm_operands.casts.get_mut(&buf.id) {
                c.current = true;
            }
        }
        Ok(Some(ptr))
    }

    /// Rounds `len` f32 values at `src` into the run's 16-bit operand type at `dst`.
    pub(super) fn round_copy(
        &mut self,
        src: CUdeviceptr,
        dst: CUdeviceptr,
        len: usize,
    ) -> Result<()> {
        let convert = self.operands.conversion_kernel().ok_or_else(|| {
            RuntimeError::Unsupported("a 16-bit GEMM operand copy in an fp32 run".into())
        })?;
        let n = |v: usize| Arg::I64(v as i64);
        let args = [
            Arg::Ptr(src),
            Arg::Ptr(dst),
            n(len),
            Arg::Ptr(src),
            Arg::Ptr(dst),
            n(0),
        ];
        self.launch_n(convert, len.div_ceil(4), &args)
    }

    /// Where `operand` is read from in a 16-bit run.
    fn source(&mut self, operand: Operand, role: &str) -> Result<Source> {
        let buf = operand.buf;
        match buf.dtype {
            DType::Bf16 if self.operands == Operands::Bf16 => Ok(Source::Ready(buf.ptr)),
            DType::F32 if operand.weight => Ok(match self.weight_cast(buf)? {
                Some(ptr) => Source::Ready(ptr),
                None => Source::Copy,
            }),
            DType::F32 => Ok(Source::Copy),
            other => Err(RuntimeError::Buffer {
                id: buf.id.0,
                what: format!(
                    "is {other:?}, which a GEMM of this {:?} run cannot read as its {role}",
                    self.operands
                ),
            }),
        }
    }

    /// Runs `g`, whose A and B are the buffers of `a` and `b` (`g.a`, `g.b` their pointers),
    /// reading each as the module docs say. fp32 runs read f32 buffers only and write f32.
    /// The first run of each distinct 16-bit GEMM picks its algorithm by timing (`gemm`); one
    /// that accumulates is timed into the scratch after the copies where there is room.
    pub(super) fn gemm(&mut self, g: &Gemm, a: Operand, b: Operand) -> Result<()> {
        let stream = self.stream.cu_stream();
        let Some(convert) = self.operands.conversion_kernel() else {
            for (operand, role) in [(a, "A"), (b, "B")] {
                if operand.buf.dtype != DType::F32 {
                    self.source(operand, role)?;
                }
            }
            if g.out != Output::F32 {
                return Err(RuntimeError::Unsupported(
                    "a bf16 GEMM output in an fp32 run (only bf16 runs store bf16)".into(),
                ));
            }
            return self.blas.run(g, Operands::F32, stream, None);
        };
        if g.out == Output::Bf16 && self.operands != Operands::Bf16 {
            return Err(RuntimeError::Unsupported(format!(
                "a bf16 GEMM output in a {:?} run (only bf16 runs store bf16)",
                self.operands
            )));
        }
        let a_source = self.source(a, "A")?;
        let b_source = self.source(b, "B")?;
        let (a_len, b_len) = (g.a_len(), g.b_len());
        // The copies: B first (at 0), then A, each aligned.
        let b_bytes = match b_source {
            Source::Copy => aligned(b_len * 2),
            Source::Ready(_) => 0,
        };
        let a_bytes = match a_source {
            Source::Copy => aligned(a_len * 2),
            Source::Ready(_) => 0,
        };
        let copies = b_bytes + a_bytes;
        let tuning = if g.beta != 0.0 && g.c_in.is_none() && !self.blas.settled(g, self.operands) {
            g.c_len() * g.out.bytes()
        } else {
            0
        };
        let room = self
            .gemm_operands
            .scratch
            .as_ref()
            .map_or(0, CudaSlice::len);
        // With a plan the scratch is sized for every op; without one it grows here.
        let wanted = if self.gemm_operands.planned {
            copies
        } else {
            copies + tuning
        };
        if room < wanted {
            // Free the old scratch first so peak memory holds only one.
            self.gemm_operands.scratch = None;
            self.gemm_operands.copied_b = None;
            self.gemm_operands.scratch =
                Some(self.alloc_bytes(wanted, "16-bit GEMM operand copies")?);
        }
        let (base, room) = match &self.gemm_operands.scratch {
            Some(s) => (raw_ptr(&self.stream, s), s.len()),
            None => (0, 0),
        };
        let b_ptr = match b_source {
            Source::Ready(ptr) => ptr,
            Source::Copy => base,
        };
        let a_ptr = match a_source {
            Source::Ready(ptr) => ptr,
            Source::Copy => base + b_bytes as CUdeviceptr,
        };
        let b_todo = match b_source {
            // The copy of B is still there when the last GEMM had the same, unchanged B.
            Source::Copy if self.gemm_operands.copied_b != Some((g.b, b_len)) => b_len,
            _ => 0,
        };
        let a_todo = match a_source {
            Source::Copy => a_len,
            Source::Ready(_) => 0,
        };
        self.gemm_operands.copied_b = None;
        if a_todo + b_todo > 0 {
            let n = |v: usize| Arg::I64(v as i64);
            self.launch_n(
                convert,
                (a_todo + b_todo).div_ceil(4),
                &[
                    Arg::Ptr(g.a),
                    Arg::Ptr(a_ptr),
                    n(a_todo),
                    Arg::Ptr(g.b),
                    Arg::Ptr(b_ptr),
                    n(b_todo),
                ],
            )?;
        }
        let rounded = Gemm {
            a: a_ptr,
            b: b_ptr,
            ..*g
        };
        let tune_out =
            (tuning > 0 && copies + tuning <= room).then_some(base + copies as CUdeviceptr);
        self.run_16bit_gemm(&rounded, tune_out)?;
        if let Source::Copy = b_source {
            self.gemm_operands.copied_b = Some((g.b, b_len));
        }
        Ok(())
    }

    /// Before `compute` runs `op`: what its writes make stale. An op writes only its outputs
    /// (and the backend's scratch), so the copy of B stays unless an output overlaps that B or
    /// an input is also an output (then the op reads a scratch copy of it that later ops
    /// reuse); each output's cast goes stale, and every cast after an optimizer op (a fused
    /// launch updates its whole run of parameters at once). `alloc` zero-fills only memory no
    /// live buffer holds, so it keeps both.
    pub(super) fn gemm_before_compute(
        &mut self,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
    ) {
        if inputs.iter().any(|id| outputs.contains(id)) {
            self.gemm_operands.copied_b = None;
        }
        if matches!(op, Op::AdamW { .. } | Op::Sgd { .. }) {
            for cast in self.gemm_operands.casts.values_mut() {
                cast.current = false;
            }
        }
        for &id in outputs {
            self.gemm_buffer_written(id);
        }
    }

    /// Buffer `id` is about to be written (by an op, from the host or by communication).
    pub(super) fn gemm_buffer_written(&mut self, id: BufferId) {
        let overlaps = self.overlaps_copied_b(id);
        self.gemm_operands.written(id, overlaps);
    }

    /// Buffer `id` is about to be freed: its cast goes (a planned one stays reserved, stale).
    pub(super) fn gemm_buffer_freed(&mut self, id: BufferId) {
        self.gemm_buffer_written(id);
        if !self.gemm_operands.planned {
            self.gemm_operands.casts.remove(&id);
        }
    }

    /// Communication is about to write `buffers`: their casts go stale, and the copy of B
    /// is dropped (the comm stream may touch any buffer it names).
    pub(super) fn gemm_comm_writes(&mut self, buffers: &[BufferId]) {
        self.gemm_operands.copied_b = None;
        for &id in buffers {
            self.gemm_operands.written(id, true);
        }
    }

    /// Whether buffer `id` overlaps the f32 operand whose copy starts the scratch.
    fn overlaps_copied_b(&self, id: BufferId) -> bool {
        let Some((b, b_len)) = self.gemm_operands.copied_b else {
            return false;
        };
        let b_end = b + (b_len * 4) as CUdeviceptr;
        // An unknown buffer is an error its caller reports; forgetting the copy is safe.
        self.slot(id).map_or(true, |o| {
            let o_end = o.ptr + (o.len * o.dtype.bytes() as usize) as CUdeviceptr;
            o.ptr < b_end && b < o_end
        })
    }

    /// Device bytes of the GEMM operand memory (for `reserved_bytes`).
    pub(super) fn gemm_operand_bytes(&self) -> usize {
        self.gemm_operands.bytes()
    }
}
