//! Tensorwise FP8 quantization of one tensor into both K-major layouts in one pass
//! (`fp8_quantize_dual`, `kernels/fp8.cu`): x `[rows, cols]` (f32 or bf16) read once, scaled by
//! the power of two of a device amax (`2^⌊log₂(max/amax)⌋`, 1 for amax 0, as
//! `runtime/src/cpu/fp8.rs`'s `scale`), rounded as the FP8 GEMMs' own quantize kernels round
//! (nearest-even, saturating; a non-finite element stored as NaN, 0x7f),
//! and written as `q` `[rows, cols]` (K along x's columns), `qt` `[cols, rows]` (its transpose,
//! K along x's rows), or both, with no padding (ld = the row length). A delayed-scaling record
//! can ride on the pass: x's largest finite magnitude max-added into a history's step amax.
//!
//! The kernel reads x in tiles of 128 columns by 64 rows (f32) or 128 rows (bf16), 16-byte
//! vectors, every load of a thread issued before any is used (128 bytes a thread in flight
//! either way: the kernel is bound by loads in flight); it converts each element once, writes
//! q straight from registers and qt through a byte tile in shared memory, transposed 4 × 8
//! (f32) or 4 × 16 (bf16) bytes a thread with byte permutes; its aim is copy bandwidth (2 + 2
//! bytes an element for a bf16 x into both layouts). `Op::Fp8Quantize` runs it (`quantize_op`,
//! taking the record that rides on the op); `CudaBackend::fp8_quantize_dual` runs it on
//! allocated buffers (tests and the bandwidth benchmark in `tests/cuda_ops/fp8.rs`). FP8
//! buffers written and read from the host round and widen as the CPU backend's
//! (`cpu::fp8::round_fp8`, `widen_fp8`).
use super::args::{fv, Bound};
use super::kernel::Kernel;
use super::{buffer_error, Arg, Buf, CudaBackend};
use crate::error::Result;
use cudarc::driver::sys::CUdeviceptr;
use parc_compiler::ir::fp8::{Fp8Format, Fp8QuantizeAttrs};
use parc_compiler::ir::{BufferId, DType};

/// Threads of a `fp8_quantize_dual` block and the columns of its tiles (`kernels/fp8.cu`).
const DUAL_THREADS: u32 = 256;
const DUAL_TILE_COLS: u64 = 128;
/// The most blocks one launch takes (they loop over the remaining tiles).
const DUAL_MAX_BLOCKS: u64 = i32::MAX as u64;

/// One quantization pass: x as `[rows, cols]`, its scale amax (one f32 on the device), the
/// format, where each layout goes (null: not written) and the record's step amax, if any.
#[derive(Clone, Copy, Debug)]
pub(super) struct DualQuantize {
    pub x: Buf,
    pub cols: u64,
    pub amax: CUdeviceptr,
    pub format: Fp8Format,
    pub q: Option<CUdeviceptr>,
    pub qt: Option<CUdeviceptr>,
    pub record: Option<CUdeviceptr>,
}

/// `Op::Fp8Quantize`: x quantized with the scale of its amax input into the layouts the op
/// writes (`q`, `qt`), taking the delayed-scaling record that rides on it (`fp8_record`; a
/// second record of x, none in a verified program, is made apart once the executor is past).
pub(super) fn quantize_op(be: &mut CudaBackend, b: &Bound, a: &Fp8QuantizeAttrs) -> Result<()> {
    let (x, amax) = (b.input(0)?, b.input(1)?);
    let cols = b.dim("cols", a.cols)? as u64;
    let output = |role: &str| -> Result<Option<Buf>> {
        (b.signature.outputs.iter())
            .position(|o| o.role == role)
            .map(|i| b.output(i))
            .transpose()
    };
    let (q, qt) = (output("q")?, output("qt")?);
    for out in [q, qt].into_iter().flatten() {
        if out.len != x.len {
            return Err(b.err(format!(
                "writes {} FP8 elements (buffer {}) for an x of {} (buffer {}): each layout \
                 holds all of x",
                out.len, out.id.0, x.len, x.id.0
            )));
        }
    }
    let record = be.take_record(x.id);
    let d = DualQuantize {
        x,
        cols,
        amax: amax.ptr,
        format: a.format,
        q: q.map(|q| q.ptr),
        qt: qt.map(|qt| qt.ptr),
        record,
    };
    quantize_dual(be, &d)
}

/// Launches `fp8_quantize_dual` for `d` (nothing for an empty x). x must hold a whole number
/// of rows of `cols` and be f32 or bf16; the callers check what the outputs hold.
pub(super) fn quantize_dual(be: &mut CudaBackend, d: &DualQuantize) -> Result<()> {
    let rows = rows_of(d.x, d.cols)?;
    if rows == 0 || d.cols == 0 {
        return Ok(());
    }
    let tiles = rows.div_ceil(dual_tile_rows(d.x.dtype)) * d.cols.div_ceil(DUAL_TILE_COLS);
    let blocks = tiles.min(DUAL_MAX_BLOCKS) as u32;
    let count = |v: u64| Arg::I64(v as i64);
    let args = [
        fv(d.x),
        count(rows),
        count(d.cols),
        Arg::Ptr(d.amax),
        Arg::F32(d.format.max()),
        Arg::I32(i32::from(d.format == Fp8Format::E5m2)),
        Arg::Ptr(d.q.unwrap_or(0)),
        Arg::Ptr(d.qt.unwrap_or(0)),
        Arg::Ptr(d.record.unwrap_or(0)),
    ];
    let threads = (DUAL_THREADS, 1, 1);
    be.launch(Kernel::Fp8QuantizeDual, (blocks, 1, 1), threads, 0, &args)
}

/// The rows of a `fp8_quantize_dual` tile for an x of `dtype` (`FP8_DUAL_PASSES` in
/// `kernels/fp8.cu`): 128 for bf16, 64 for f32, so that each thread loads 128 bytes of x a tile.
fn dual_tile_rows(dtype: DType) -> u64 {
    if dtype == DType::Bf16 {
        128
    } else {
        64
    }
}

/// The rows of x read as `[rows, cols]`: an f32 or bf16 buffer holding whole rows.
fn rows_of(x: Buf, cols: u64) -> Result<u64> {
    if !matches!(x.dtype, DType::F32 | DType::Bf16) {
        return Err(buffer_error(
            x.id,
            format!(
                "is {}, but FP8 quantization reads f32 or bf16",
                x.dtype.name()
            ),
        ));
    }
    let len = x.len as u64;
    match len.checked_rem(cols) {
        Some(0) => Ok(len / cols),
        None if len == 0 => Ok(0),
        _ => Err(buffer_error(
            x.id,
            format!("holds {len} elements, not whole rows of {cols} to quantize"),
        )),
    }
}

impl CudaBackend {
    /// `x` (an allocated f32 or bf16 buffer, `[rows, cols]`) quantized to `format` with the
    /// scale of the f32 in `amax` into `q` (`[rows, cols]`) and `qt` (`[cols, rows]`), each
    /// where given (FP8 buffers of `format`, `rows · cols` elements), and x's largest finite
    /// magnitude max-added into the first f32 of `record` where given: the pass
    /// `Op::Fp8Quantize` makes (see the module docs), with a record passed directly instead of
    /// one riding on the op. For tests and benchmarks; stream-ordered like an op.
    pub fn fp8_quantize_dual(
        &mut self,
        (x, cols): (BufferId, u64),
        (amax, format): (BufferId, Fp8Format),
        [q, qt]: [Option<BufferId>; 2],
        record: Option<BufferId>,
    ) -> Result<()> {
        let x = self.buf(x)?;
        let rows = rows_of(x, cols)?;
        let one_f32 = |be: &CudaBackend, id: BufferId, what: &str| -> Result<CUdeviceptr> {
            let b = be.buf(id)?;
            if b.dtype != DType::F32 || b.len == 0 {
                return Err(buffer_error(
                    id,
                    format!("is the {what} of an FP8 quantization, so it must be a non-empty f32 buffer"),
                ));
            }
            Ok(b.ptr)
        };
        let fp8 = |be: &CudaBackend, id: BufferId| -> Result<CUdeviceptr> {
            let b = be.buf(id)?;
            if b.dtype != DType::Fp8(format) || b.len as u64 != rows * cols {
                return Err(buffer_error(
                    id,
                    format!(
                        "is {} [{}], but the {} quantization of a [{rows}, {cols}] tensor \
                         writes {} {} elements",
                        b.dtype.name(),
                        b.len,
                        format.name(),
                        rows * cols,
                        format.name()
                    ),
                ));
            }
            Ok(b.ptr)
        };
        for id in [q, qt, record].into_iter().flatten() {
            self.gemm_buffer_written(id);
            self.scale_amax_written(id);
        }
        let d = DualQuantize {
            x,
            cols,
            amax: one_f32(self, amax, "scale amax")?,
            format,
            q: q.map(|id| fp8(self, id)).transpose()?,
            qt: qt.map(|id| fp8(self, id)).transpose()?,
            record: record.map(|id| one_f32(self, id, "record")).transpose()?,
        };
        quantize_dual(self, &d)
    }
}
