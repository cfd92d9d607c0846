//! The GEMM ops (`Matmul`, `MatmulBwdData`, `MatmulBwdWeight`) on cuBLASLt: how each maps onto
//! a column-major GEMM (a row-major `[r, c]` matrix is a column-major `c × r` one with leading
//! dimension `c`), and how the backend feeds the operands to `gemm::Blas` — in 16-bit runs,
//! rounded copies of fp32 operands, reusing the last GEMM's B copy while it is unchanged.
use super::dispatch::{col_sum_into, n, p, Bound};
use super::gemm::{self, Gemm, Operands};
use super::{raw_ptr, Arg, CudaBackend};
use crate::error::{Result, RuntimeError};
use cudarc::driver::sys::CUdeviceptr;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::BufferId;

/// Run one GEMM op (buffer count already checked by `dispatch`).
pub(super) fn run(be: &mut CudaBackend, b: &Bound<'_>, op: &Op) -> Result<()> {
    match op {
        Op::Matmul {
            in_dim,
            out_dim,
            bias,
        } => {
            let (k, m) = (b.dim("in_dim", *in_dim)?, b.dim("out_dim", *out_dim)?);
            let (x, w) = (b.f32_in(0)?, b.f32_in(1)?);
            let rows = b.rows(x, "x", k)?;
            b.expect(w, "w", m * k)?;
            let y = b.f32_out(0)?;
            b.expect(y, "y", rows * m)?;
            // yᵀ (m × rows) = W (m × k, stored k × m) · xᵀ (k × rows) (+ b per row of yᵀ).
            let mut g = Gemm {
                trans_a: true,
                trans_b: false,
                m: m as u64,
                n: rows as u64,
                k: k as u64,
                a: w.ptr,
                lda: k as i64,
                b: x.ptr,
                ldb: k as i64,
                c: y.ptr,
                ldc: m as i64,
                beta: 0.0,
                bias: None,
            };
            if *bias {
                let bb = b.f32_in(2)?;
                b.expect(bb, "b", m)?;
                g.bias = Some(bb.ptr);
                // The bias in cuBLASLt's epilogue where it offers one, else y = b first and
                // the product accumulated onto it.
                if !be.gemm_supported(&g)? {
                    be.launch_n("broadcast_rows", rows * m, &[p(bb), p(y), n(rows), n(m)])?;
                    g.bias = None;
                    g.beta = 1.0;
                }
            }
            be.gemm(&g)
        }
        Op::MatmulBwdData { in_dim, out_dim } => {
            let (k_in, m_out) = (b.dim("in_dim", *in_dim)?, b.dim("out_dim", *out_dim)?);
            let (dy, w) = (b.f32_in(0)?, b.f32_in(1)?);
            let rows = b.rows(dy, "dy", m_out)?;
            b.expect(w, "w", m_out * k_in)?;
            let dx = b.f32_out(0)?;
            b.expect(dx, "dx", rows * k_in)?;
            // dxᵀ (in × rows) = Wᵀ (in × out, as stored) · dyᵀ (out × rows).
            be.gemm(&Gemm {
                trans_a: false,
                trans_b: false,
                m: k_in as u64,
                n: rows as u64,
                k: m_out as u64,
                a: w.ptr,
                lda: k_in as i64,
                b: dy.ptr,
                ldb: m_out as i64,
                c: dx.ptr,
                ldc: k_in as i64,
                beta: 0.0,
                bias: None,
            })
        }
        Op::MatmulBwdWeight {
            in_dim,
            out_dim,
            bias,
        } => {
            let (k_in, m_out) = (b.dim("in_dim", *in_dim)?, b.dim("out_dim", *out_dim)?);
            let (dy, x) = (b.f32_in(0)?, b.f32_in(1)?);
            let rows = b.rows(dy, "dy", m_out)?;
            b.expect(x, "x", rows * k_in)?;
            let dw = b.f32_out(0)?;
            b.expect(dw, "dw", m_out * k_in)?;
            // dWᵀ (in × out) += xᵀ (in × rows, as stored) · dy (rows × out, stored out × rows).
            be.gemm(&Gemm {
                trans_a: false,
                trans_b: true,
                m: k_in as u64,
                n: m_out as u64,
                k: rows as u64,
                a: x.ptr,
                lda: k_in as i64,
                b: dy.ptr,
                ldb: m_out as i64,
                c: dw.ptr,
                ldc: k_in as i64,
                beta: 1.0,
                bias: None,
            })?;
            if *bias {
                let db = b.f32_out(1)?;
                b.expect(db, "db", m_out)?;
                col_sum_into(be, dy, db, rows, m_out)?;
            }
            Ok(())
        }
        _ => Err(b.err("is not a GEMM op")),
    }
}

impl CudaBackend {
    /// Runs `g` (fp32 operands). In a bf16 or fp16 run the operands are first rounded into
    /// 16-bit copies (one launch for both) and cuBLASLt reads those; C stays fp32. The first
    /// run of each distinct 16-bit GEMM picks its algorithm by timing (`gemm`); one that
    /// accumulates is timed into the scratch after the copies (`storage` sizes it).
    pub(crate) fn gemm(&mut self, g: &gemm::Gemm) -> Result<()> {
        let stream = self.stream.cu_stream();
        let Some(convert) = self.operands.conversion_kernel() else {
            return self.blas.run(g, Operands::F32, stream, None);
        };
        // B first, then A on a 256-byte boundary (cuBLASLt's preferred operand alignment).
        let (a_len, b_len) = (g.a_len(), g.b_len());
        let a_offset = (b_len * 2).next_multiple_of(256);
        let bytes = a_offset + a_len * 2;
        let big_enough = self
            .half_operands
            .as_ref()
            .is_some_and(|s| s.len() >= bytes);
        if !big_enough {
            // Free the old copies first so peak memory holds only one of them.
            self.half_operands = None;
            self.half_b = None;
            self.half_operands = Some(self.alloc_bytes(bytes, "16-bit GEMM operands")?);
        }
        let (base, room) = match &self.half_operands {
            Some(s) => (raw_ptr(&self.stream, s), s.len()),
            None => return Err(RuntimeError::Unsupported("16-bit operands missing".into())),
        };
        let (b16, a16) = (base, base + a_offset as CUdeviceptr);
        // B's copy is still there when the last GEMM had the same, unchanged B.
        let b_todo = if self.half_b == Some((g.b, b_len)) {
            0
        } else {
            b_len
        };
        self.half_b = None;
        let n = |v: usize| Arg::I64(v as i64);
        self.launch_n(
            convert,
            (a_len + b_todo).div_ceil(4),
            &[
                Arg::Ptr(g.a),
                Arg::Ptr(a16),
                n(a_len),
                Arg::Ptr(g.b),
                Arg::Ptr(b16),
                n(b_todo),
            ],
        )?;
        let rounded = gemm::Gemm {
            a: a16,
            b: b16,
            ..*g
        };
        let tune_offset = bytes.next_multiple_of(256);
        let tune_out = (tune_offset + g.c_len() * 4 <= room
            && !self.blas.settled(g, self.operands))
        .then_some(base + tune_offset as CUdeviceptr);
        self.blas.run(&rounded, self.operands, stream, tune_out)?;
        self.half_b = Some((g.b, b_len));
        Ok(())
    }

    /// Before `compute` runs an op: whether the 16-bit copy of the last GEMM's B may still be
    /// read. An op writes only its outputs (and the backend's scratch), so the copy stays
    /// unless an output overlaps that B, or an input is also an output (then the op reads a
    /// scratch copy of it that later ops reuse). `alloc` zero-fills only memory no live buffer
    /// holds, so it keeps the copy; a write from the host or a `free` of a buffer overlapping
    /// B, and any communication, clear it.
    pub(super) fn reuse_half_b(&mut self, inputs: &[BufferId], outputs: &[BufferId]) {
        if inputs.iter().any(|id| outputs.contains(id)) {
            self.half_b = None;
        }
        for &id in outputs {
            self.keep_half_b_unless_written(id);
        }
    }

    /// Clears `half_b` where buffer `id` (about to be written or freed) overlaps that B.
    pub(super) fn keep_half_b_unless_written(&mut self, id: BufferId) {
        let Some((b, b_len)) = self.half_b else {
            return;
        };
        let b_end = b + (b_len * 4) as CUdeviceptr;
        // An unknown buffer is an error its caller reports; forgetting the copy is safe.
        let overlaps = self.slot(id).map_or(true, |o| {
            let o_end = o.ptr + (o.len * o.dtype.bytes() as usize) as CUdeviceptr;
            o.ptr < b_end && b < o_end
        });
        if overlaps {
            self.half_b = None;
        }
    }

    /// Starts (from zero) or stops timing the GEMMs' cuBLASLt kernels alone, without their
    /// operand conversions (for GEMM benchmarks): while on, every GEMM waits for its kernels.
    pub fn time_gemm_kernels(&mut self, on: bool) -> Result<()> {
        self.blas.time_matmuls(on)
    }

    /// Milliseconds of GEMM kernel time since `time_gemm_kernels(true)`; None when off.
    pub fn gemm_kernel_ms(&self) -> Option<f64> {
        self.blas.matmul_ms()
    }

    /// Whether cuBLASLt offers `g` (with its bias epilogue) for this run's operand type.
    pub(crate) fn gemm_supported(&mut self, g: &gemm::Gemm) -> Result<bool> {
        self.blas.supports(g, self.operands)
    }
}
