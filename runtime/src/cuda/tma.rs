//! Tensor maps for the TMA-fed kernels (`kernels/hopper_async.cuh`): the 128-byte descriptor
//! of a global matrix that `cp.async.bulk.tensor` copies boxes of into shared memory, encoded
//! on the host by the driver (`cuTensorMapEncodeTiled`) and passed to the kernel by value. Only
//! what parc's kernels use: two dimensions (contiguous columns, strided rows), bf16, f32 or FP8
//! bytes, the 128-byte swizzle (the kernels' shared-memory tile layout) or none, zeros out of
//! bounds (and out-of-bounds parts of a reduction dropped).
use super::device::driver_error;
use crate::error::{Result, RuntimeError};
use cudarc::driver::sys::{
    self, CUdeviceptr, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill,
    CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::DeviceRepr;

/// A CUtensorMap as the kernels' `struct TmaMap` receives it (128 opaque bytes, by value).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct TmaMap(pub [u64; 16]);

// SAFETY: TmaMap is #[repr(C)] plain data of the kernels' `struct TmaMap` (128 bytes).
unsafe impl DeviceRepr for TmaMap {}

/// Bytes the 128-byte swizzle allows in a box's inner dimension.
const SWIZZLE_BYTES: u32 = 128;

/// The element type of a tensor map's matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Elem {
    Bf16,
    F32,
    /// One byte: an FP8 value of either format.
    Fp8,
}

impl Elem {
    fn bytes(self) -> u32 {
        match self {
            Elem::Fp8 => 1,
            Elem::Bf16 => 2,
            Elem::F32 => 4,
        }
    }
}

/// The tensor map of a matrix of `elem` at `ptr`: `rows` rows of `cols` contiguous elements,
/// `row_bytes` apart, copied in boxes of `box_cols` × `box_rows`, in shared memory with the
/// 128-byte swizzle when `swizzled` (else row-major); rows and columns past the matrix read as
/// zeros. Errors name what TMA cannot describe (alignment, sizes), so the caller can run a
/// kernel without it.
pub(crate) fn matrix(
    elem: Elem,
    ptr: CUdeviceptr,
    (cols, rows, row_bytes): (u64, u64, u64),
    (box_cols, box_rows): (u32, u32),
    swizzled: bool,
) -> Result<TmaMap> {
    let unsupported = |why: String| RuntimeError::Unsupported(format!("a TMA tensor map {why}"));
    if !ptr.is_multiple_of(16) || !row_bytes.is_multiple_of(16) {
        return Err(unsupported(format!(
            "needs 16-byte aligned rows (address {ptr:#x}, row stride {row_bytes} bytes)"
        )));
    }
    if cols == 0 || rows == 0 || cols > 1 << 32 || rows > 1 << 32 || row_bytes >= 1 << 40 {
        return Err(unsupported(format!(
            "cannot describe a {rows} x {cols} matrix with rows {row_bytes} bytes apart"
        )));
    }
    let box_bytes = box_cols * elem.bytes();
    if (swizzled && box_bytes > SWIZZLE_BYTES)
        || !box_bytes.is_multiple_of(16)
        || box_cols > 256
        || box_rows == 0
        || box_rows > 256
    {
        return Err(unsupported(format!(
            "cannot copy boxes of {box_rows} x {box_cols} {elem:?} (swizzled: {swizzled})"
        )));
    }
    let mut map = std::mem::MaybeUninit::<CUtensorMap>::zeroed();
    let dims = [cols, rows];
    let strides = [row_bytes];
    let boxes = [box_cols, box_rows];
    let element_strides = [1u32, 1u32];
    // SAFETY: every pointer is to a live array of the length the rank (2) implies; the driver
    // writes only the 128-byte map.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            match elem {
                Elem::Bf16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                Elem::F32 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                Elem::Fp8 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            },
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            if swizzled {
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
            } else {
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
            },
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    status.result().map_err(|e| {
        driver_error(
            &format!(
                "encoding a TMA tensor map ({rows} x {cols} {elem:?}, boxes {box_rows} x {box_cols})"
            ),
            e,
        )
    })?;
    // SAFETY: the driver filled the map (status success).
    let map = unsafe { map.assume_init() };
    Ok(TmaMap(map.opaque))
}
