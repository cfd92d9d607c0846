//! GEMM epilogues run apart from their GEMM by the backend's elementwise kernels, where a
//! GEMM cannot fuse them (cuBLASLt's missing forms, every FP8 GEMM): a forward's residual add
//! and activation, a data gradient's activation derivative, SwiGLU's gated product and its
//! gradient. Shared by `matmul` and `fp8`; `elementwise` runs the SwiGLU ops with them.
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

/// SwiGLU's gated product apart from the up projection's GEMM: a = silu(gate) ⊙ up (with the
/// FP8 quantizations of a where the instruction heads a run that takes them: `swiglu_fp8`).
pub(super) fn swiglu_apart(be: &mut CudaBackend, gate: Buf, up: Buf, a: Buf) -> Result<()> {
    if be.swiglu_fp8_forward(gate, up, a)? {
        return Ok(());
    }
    let args = [fv(gate), fv(up), fv(a), n(a.len)];
    be.launch_vec(Kernel::SwigluFwd, a.len, &args)
}

/// SwiGLU's gradient: dgate and dup from the product `dy` (the down projection's data
/// gradient), gate and up, per element (`swiglu_bwd`). `dy` may be `dgate` itself (the GEMM's
/// product written there): the kernel reads each element's product before it writes that
/// element's dgate. With the FP8 quantizations of dgate and dup where the instruction heads a run
/// that takes them (`swiglu_fp8`).
pub(super) fn swiglu_grad(
    be: &mut CudaBackend,
    dy: Buf,
    (gate, up): (Buf, Buf),
    (dgate, dup): (Buf, Buf),
) -> Result<()> {
    if be.swiglu_fp8_backward(dy, (gate, up), (dgate, dup))? {
        return Ok(());
    }
    let args = [fv(dy), fv(gate), fv(up), fv(dgate), fv(dup), n(dgate.len)];
    be.launch_vec(Kernel::SwigluBwd, dgate.len, &args)
}
