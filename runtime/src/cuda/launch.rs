//! Launching a compiled kernel on the compute stream: the argument list pushed as the kernel's
//! C signature takes it, the common launch shapes (a grid-stride launch over `n` elements, one
//! moving 8 elements a thread), the opt-in to more than the default 48 KiB of dynamic shared
//! memory, and the persistent launch of the warp-specialized Hopper kernels (the attention
//! kernels' and parc's GEMM: one CTA an SM, 384 threads, tensor maps first).
use super::device::driver_error;
use super::kernel::Kernel;
use super::tma::TmaMap;
use super::{Arg, CudaBackend};
use crate::error::Result;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Shared memory a CTA may use without opting in to more.
const DEFAULT_SMEM: u32 = 48 << 10;
/// Threads of a warp-specialized CTA: a producer and two consumer warpgroups.
const WS_THREADS: u32 = 384;

impl CudaBackend {
    /// Launch `kernel`; arguments must match its C signature.
    pub(crate) fn launch(
        &mut self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        args: &[Arg],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let stream = self.stream.clone();
        let f = self.kernels.function(kernel)?;
        let mut b = stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(p) => b.arg(p),
                Arg::I64(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
                Arg::F64(v) => b.arg(v),
                Arg::Geom(g) => b.arg(g),
                Arg::Float(f) => b.arg(f),
                Arg::Tma(m) => b.arg(m),
                Arg::RopeScale(s) => b.arg(s),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: block,
            shared_mem_bytes: shared_bytes,
        };
        // SAFETY: `bind` checked every buffer's length against the op's signature, the family
        // code derived the sizes passed from them, and the argument list follows the kernel's
        // signature.
        unsafe { b.launch(cfg) }
            .map_err(|e| driver_error(&format!("launching kernel {kernel}"), e))?;
        Ok(())
    }

    /// Launch a grid-stride kernel over `n` elements (256 threads a block).
    pub(crate) fn launch_n(&mut self, kernel: Kernel, n: usize, args: &[Arg]) -> Result<()> {
        let blocks = n.div_ceil(256).clamp(1, 1 << 16) as u32;
        if n == 0 {
            return Ok(());
        }
        self.launch(kernel, (blocks, 1, 1), (256, 1, 1), 0, args)
    }

    /// Launch a kernel that moves 8 elements per thread (kernels/common.cuh's `map1`/`map2`)
    /// over `n` elements: ~n / 8 threads, 256 a block.
    pub(crate) fn launch_vec(&mut self, kernel: Kernel, n: usize, args: &[Arg]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(8 * 256).clamp(1, 1 << 16) as u32;
        self.launch(kernel, (blocks, 1, 1), (256, 1, 1), 0, args)
    }

    /// Let `kernel` use `bytes` of dynamic shared memory (the opt-in above 48 KiB).
    pub(crate) fn allow_shared_memory(&mut self, kernel: Kernel, bytes: u32) -> Result<()> {
        self.kernels
            .function(kernel)?
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| {
                driver_error(
                    &format!("allowing {kernel} {bytes} bytes of shared memory"),
                    e,
                )
            })
    }

    /// Launch `kernel` with `smem` bytes of dynamic shared memory, opting in first where
    /// that is more than the default.
    pub(crate) fn launch_with_smem(
        &mut self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        threads: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_block_with_smem(kernel, grid, (threads, 1, 1), smem, args)
    }

    /// [`CudaBackend::launch_with_smem`] with a block of any shape.
    pub(crate) fn launch_block_with_smem(
        &mut self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        if smem > DEFAULT_SMEM {
            self.allow_shared_memory(kernel, smem)?;
        }
        self.launch(kernel, grid, block, smem, args)
    }

    /// Launches a warp-specialized kernel: persistent, one CTA an SM (at most one per work
    /// item), WS_THREADS threads; its arguments are the tensor maps, then `rest`.
    pub(crate) fn launch_persistent(
        &mut self,
        kernel: Kernel,
        work: usize,
        smem: u32,
        maps: &[TmaMap],
        rest: &[Arg],
    ) -> Result<()> {
        let mut args: Vec<Arg> = maps.iter().copied().map(Arg::Tma).collect();
        args.extend_from_slice(rest);
        let ctas = work.min(self.limits.sms).max(1) as u32;
        self.launch_with_smem(kernel, (ctas, 1, 1), WS_THREADS, smem, &args)
    }
}
