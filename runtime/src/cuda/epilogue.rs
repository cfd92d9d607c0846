//! GEMM epilogues run apart from their GEMM by the backend's elementwise kernels, where a
//! GEMM cannot fuse them (cuBLASLt's missing forms, every FP8 GEMM): a forward's residual add
//! and activation, a data gradient's activation derivative. Shared by `matmul` and `fp8`.
use super::args::{fv, n};
use super::kernel::Kernel;
use super::{Arg, Buf, CudaBackend};
use crate::error::Result;
use parc_compiler::ir::op::Act;

/// A forward's epilogue apart from its GEMM: y += r (an `Add`), then a = act(y) from y as
/// stored (a bf16 y is rounded before each step reads it).
pub(super) fn residual_then_activation(
    be: &mut CudaBackend,
    y: Buf,
    r: Option<Buf>,
    act: Option<(Act, Buf)>,
) -> Result<()> {
    if let Some(r) = r {
        be.launch_vec(Kernel::AddFwd, y.len, &[fv(y), fv(r), fv(y), n(y.len)])?;
    }
    match act {
        Some((act, a)) => {
            let args = [Arg::I32(act.code()), fv(y), fv(a), n(y.len)];
            be.launch_vec(Kernel::ActivationFwd, y.len, &args)
        }
        None => Ok(()),
    }
}

/// A data gradient's epilogue apart from its GEMM: dx = dx ⊙ act'(pre) in place.
pub(super) fn activation_grad_in_place(
    be: &mut CudaBackend,
    dx: Buf,
    act: Act,
    pre: Buf,
) -> Result<()> {
    let args = [Arg::I32(act.code()), fv(dx), fv(pre), fv(dx), n(dx.len)];
    be.launch_vec(Kernel::ActivationBwd, dx.len, &args)
}
