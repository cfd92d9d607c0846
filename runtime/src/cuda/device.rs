//! Opening the GPU: checks that the driver, NVRTC and cuBLASLt libraries can be loaded (cudarc
//! loads them at run time, and would panic on first use otherwise), creates the context and
//! stream, reads the limits launch shapes depend on, and turns every cudarc error into a
//! `RuntimeError` that says what was being done.
use crate::error::{Result, RuntimeError};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaStream};
use std::fmt::Debug;
use std::sync::Arc;

pub(crate) fn driver_error(context: &str, e: impl Debug) -> RuntimeError {
    RuntimeError::Unsupported(format!("CUDA driver: {context}: {e:?}"))
}

pub(crate) fn cublas_error(context: &str, e: impl Debug) -> RuntimeError {
    RuntimeError::Unsupported(format!("{context}: {e:?}"))
}

/// How the errors of a machine without a usable GPU begin (`open`'s three kinds: no driver, a
/// missing CUDA library, no device), which [`gpu_absent`] recognises.
const NO_DRIVER: &str = "no CUDA driver found";
const NO_LIBRARY: &str = "the CUDA driver is there but";
const NO_DEVICE: &str = "no CUDA device found";

/// Whether `error` (from making a `CudaBackend`) says the machine has no usable GPU — no
/// driver, a CUDA library missing, or no device — rather than that a GPU is there and
/// something on it failed (a kernel that does not compile, a driver call that fails). GPU
/// tests skip on the first and must fail on the second.
pub fn gpu_absent(error: &RuntimeError) -> bool {
    matches!(error, RuntimeError::Unsupported(m)
        if [NO_DRIVER, NO_LIBRARY, NO_DEVICE].iter().any(|p| m.starts_with(p)))
}

const LIBRARY_HELP: &str = "install the NVIDIA driver and CUDA 13 (libcuda, libnvrtc, \
     libcublasLt) and put their directory (e.g. /usr/local/cuda/lib64) on LD_LIBRARY_PATH, \
     or use --backend cpu";

/// The context and stream of device `ordinal`, after checking the libraries are loadable.
pub(crate) fn open(ordinal: usize) -> Result<(Arc<CudaContext>, Arc<CudaStream>)> {
    // SAFETY: these only try to load the shared libraries; they call nothing in them.
    let (driver, nvrtc, blas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublaslt::sys::is_culib_present(),
        )
    };
    if !driver {
        return Err(RuntimeError::Unsupported(format!(
            "{NO_DRIVER}: libcuda could not be loaded; {LIBRARY_HELP}"
        )));
    }
    for (present, name) in [
        (nvrtc, "NVRTC (libnvrtc)"),
        (blas, "cuBLASLt (libcublasLt)"),
    ] {
        if !present {
            return Err(RuntimeError::Unsupported(format!(
                "{NO_LIBRARY} {name} could not be loaded; {LIBRARY_HELP}"
            )));
        }
    }
    let count = CudaContext::device_count().map_err(|e| {
        RuntimeError::Unsupported(format!(
            "{NO_DEVICE}: the driver could not count devices ({e:?}); {LIBRARY_HELP}"
        ))
    })?;
    if usize::try_from(count).map_or(true, |c| c <= ordinal) {
        return Err(RuntimeError::Unsupported(format!(
            "{NO_DEVICE}: device {ordinal} requested, the driver sees {count}"
        )));
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| driver_error(&format!("creating a context on device {ordinal}"), e))?;
    // One stream orders everything, so cudarc's per-buffer event tracking is not needed.
    // SAFETY: called before any buffer exists on this context.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.default_stream();
    Ok((ctx, stream))
}

/// What some kernels size their launch by: persistent kernels start one CTA per SM, and kernels
/// that keep a whole row in shared memory need to know how much a block may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceLimits {
    /// Streaming multiprocessors.
    pub sms: usize,
    /// Shared memory one block may use once it opts in (bytes; static plus dynamic).
    pub smem_per_block: usize,
    /// Shared memory of one SM, shared by its resident blocks (bytes).
    pub smem_per_sm: usize,
}

/// The [`DeviceLimits`] of the context's device.
pub(crate) fn limits(ctx: &CudaContext) -> Result<DeviceLimits> {
    let read = |attribute: CUdevice_attribute, what: &str| -> Result<usize> {
        let v = ctx
            .attribute(attribute)
            .map_err(|e| driver_error(&format!("reading the device's {what}"), e))?;
        usize::try_from(v).map_err(|_| driver_error(&format!("the device's {what}"), v))
    };
    Ok(DeviceLimits {
        sms: read(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "multiprocessor count",
        )?,
        smem_per_block: read(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "shared memory per block",
        )?,
        smem_per_sm: read(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            "shared memory per multiprocessor",
        )?,
    })
}

#[cfg(test)]
mod gpu_absent_tests {
    use super::*;

    #[test]
    fn only_a_missing_gpu_reads_as_absent() {
        let absent = [
            format!("{NO_DRIVER}: libcuda could not be loaded"),
            format!("{NO_LIBRARY} NVRTC (libnvrtc) could not be loaded"),
            format!("{NO_DEVICE}: device 0 requested, the driver sees 0"),
        ];
        for m in absent {
            assert!(gpu_absent(&RuntimeError::Unsupported(m.clone())), "{m}");
        }
        let present = RuntimeError::Unsupported(
            "NVRTC could not compile parc's CUDA kernels for compute_90a: ...".into(),
        );
        assert!(!gpu_absent(&present));
        assert!(!gpu_absent(&RuntimeError::Comm(NO_DEVICE.to_string())));
    }
}
