//! GEMMs through cuBLASLt with fp32 compute (`CUBLAS_COMPUTE_32F`: no TF32) and fp32 C/D.
//! The A/B operands are fp32 (results within float rounding of the CPU backend), bf16
//! (`CUDA_R_16BF`, the backend's bf16 precision) or fp16 (`CUDA_R_16F`, its fp16 precision);
//! for the 16-bit kinds the caller converts them first (see [`Operands`]). Callers describe the product column-major, as cuBLAS sees memory;
//! `dispatch` maps the row-major ops onto it (see [`Gemm`]).
use super::device::cublas_error;
use crate::error::Result;
use cudarc::cublaslt::{result, sys};
use cudarc::driver::sys::CUdeviceptr;
use std::ffi::c_void;
use std::mem::size_of;

/// A column-major `C = alpha · op(A) · op(B) + beta · C`, `op(A)` m×k, `op(B)` k×n, C m×n.
/// A transposed operand is stored k×m (or n×k) with its leading dimension.
pub(crate) struct Gemm {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub a: CUdeviceptr,
    pub lda: i64,
    pub b: CUdeviceptr,
    pub ldb: i64,
    pub c: CUdeviceptr,
    pub ldc: i64,
    pub beta: f32,
}

impl Gemm {
    /// Elements of A as stored (`lda` per stored column).
    pub fn a_len(&self) -> usize {
        let cols = if self.trans_a { self.m } else { self.k };
        (self.lda as u64 * cols) as usize
    }

    /// Elements of B as stored (`ldb` per stored column).
    pub fn b_len(&self) -> usize {
        let cols = if self.trans_b { self.k } else { self.n };
        (self.ldb as u64 * cols) as usize
    }
}

/// The element type of a GEMM's A and B operands (C/D and the accumulation are always fp32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operands {
    F32,
    /// Raw bf16 bit patterns (`CUDA_R_16BF`).
    Bf16,
    /// Raw IEEE binary16 bit patterns (`CUDA_R_16F`).
    F16,
}

impl Operands {
    /// The kernel that rounds fp32 operands into this type (`(const float*, unsigned short*,
    /// long long n)`); None for fp32, which cuBLASLt reads as stored.
    pub fn conversion_kernel(self) -> Option<&'static str> {
        match self {
            Operands::F32 => None,
            Operands::Bf16 => Some("f32_to_bf16"),
            Operands::F16 => Some("f32_to_f16"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Operands::F32 => "fp32",
            Operands::Bf16 => "bf16",
            Operands::F16 => "fp16",
        }
    }
}

/// The cuBLASLt handle and its workspace (owned by the backend, freed with it).
pub(crate) struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CUdeviceptr,
    workspace_size: usize,
}

/// Destroys a cuBLASLt object on every exit path.
struct Guard<T: Copy>(
    T,
    unsafe fn(T) -> std::result::Result<(), result::CublasError>,
);

impl<T: Copy> Drop for Guard<T> {
    fn drop(&mut self) {
        // SAFETY: the object was created by cuBLASLt and is destroyed exactly once, here.
        // A failure to destroy leaks a descriptor; there is nothing better to do in drop.
        let _ = unsafe { (self.1)(self.0) };
    }
}

impl Blas {
    /// `workspace` is device memory of `workspace_size` bytes the backend keeps alive.
    pub fn new(workspace: CUdeviceptr, workspace_size: usize) -> Result<Blas> {
        let handle =
            result::create_handle().map_err(|e| cublas_error("creating a cuBLASLt handle", e))?;
        Ok(Blas {
            handle,
            workspace,
            workspace_size,
        })
    }

    /// Runs `g`; its A and B pointers hold `operands`-typed elements.
    pub fn run(&self, g: &Gemm, operands: Operands, stream: sys::cudaStream_t) -> Result<()> {
        let kind = operands.name();
        let what = |step: &str| {
            format!(
                "cuBLASLt {step} for a {}x{}x{} {kind} GEMM (trans_a={}, trans_b={})",
                g.m, g.n, g.k, g.trans_a, g.trans_b
            )
        };
        let f32_type = sys::cudaDataType_t::CUDA_R_32F;
        let ab_type = match operands {
            Operands::F32 => f32_type,
            Operands::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
            Operands::F16 => sys::cudaDataType_t::CUDA_R_16F,
        };
        let layout = |dtype: sys::cudaDataType_t, rows: u64, cols: u64, ld: i64| {
            result::create_matrix_layout(dtype, rows, cols, ld)
                .map(|l| Guard(l, result::destroy_matrix_layout))
                .map_err(|e| cublas_error(&what("matrix layout"), e))
        };
        let (a_rows, a_cols) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
        let (b_rows, b_cols) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
        let a_layout = layout(ab_type, a_rows, a_cols, g.lda)?;
        let b_layout = layout(ab_type, b_rows, b_cols, g.ldb)?;
        let c_layout = layout(f32_type, g.m, g.n, g.ldc)?;
        let desc =
            result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32_type)
                .map(|d| Guard(d, result::destroy_matmul_desc))
                .map_err(|e| cublas_error(&what("matmul descriptor"), e))?;
        for (attr, transpose) in [
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                g.trans_a,
            ),
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                g.trans_b,
            ),
        ] {
            let op = i32::from(transpose);
            // SAFETY: desc is live; the attribute is a 4-byte cublasOperation_t.
            unsafe {
                result::set_matmul_desc_attribute(
                    desc.0,
                    attr,
                    (&op as *const i32).cast(),
                    size_of::<i32>(),
                )
            }
            .map_err(|e| cublas_error(&what("transpose attribute"), e))?;
        }
        let pref = result::create_matmul_pref()
            .map(|p| Guard(p, result::destroy_matmul_pref))
            .map_err(|e| cublas_error(&what("preference"), e))?;
        let size = self.workspace_size;
        // SAFETY: pref is live; the attribute is a usize (size_t).
        unsafe {
            result::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&size as *const usize).cast(),
                size_of::<usize>(),
            )
        }
        .map_err(|e| cublas_error(&what("workspace preference"), e))?;
        // SAFETY: every descriptor is live for the call.
        let heuristic = unsafe {
            result::get_matmul_algo_heuristic(
                self.handle,
                desc.0,
                a_layout.0,
                b_layout.0,
                c_layout.0,
                c_layout.0,
                pref.0,
            )
        }
        .map_err(|e| cublas_error(&what("algorithm search"), e))?;
        let alpha = 1.0f32;
        let beta = g.beta;
        // SAFETY: the pointers are device allocations the backend checked to hold the
        // described matrices; the workspace outlives the call (stream-ordered).
        unsafe {
            result::matmul(
                self.handle,
                desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                g.a as *const c_void,
                a_layout.0,
                g.b as *const c_void,
                b_layout.0,
                g.c as *const c_void,
                c_layout.0,
                g.c as *mut c_void,
                c_layout.0,
                &heuristic.algo,
                self.workspace as *mut c_void,
                self.workspace_size,
                stream,
            )
        }
        .map_err(|e| cublas_error(&what("matmul"), e))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}
