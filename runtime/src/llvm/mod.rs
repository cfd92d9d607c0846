//! The LLVM emitter of generated kernels (feature `llvm`): a `kir::Kernel` (expanded: primitive
//! ops only) and its operands' storage types become LLVM IR built with inkwell, compiled to PTX
//! by LLVM 19's NVPTX backend. It follows the generated-kernel ABI of runtime/src/cuda/fused.rs
//! exactly as the NVRTC emitter does, so the same launcher runs either and both compute the same
//! bits:
//! - entry `parc_fused` (the PTX kernel calling convention); parameters: one global pointer per
//!   input, one per output, in order, then `i64 rows`;
//! - an `Elem` operand is f32 or bf16 (fixed when the kernel is built); `Row`, `Col` and
//!   `PerPosition` operands are f32;
//! - a kernel without row sums is a grid-stride loop over the `rows × cols` points (any grid,
//!   any block); one with row sums takes one block of `REDUCE_LANES` threads per row, striding
//!   over rows by the grid, and sums in exactly the `REDUCE_LANES` order of `kir` (lane `l`
//!   sums columns `l, l + LANES, …` from 0.0, then the lanes combine in a halving tree through
//!   shared memory and `llvm.nvvm.barrier0`);
//! - arithmetic is `kir::prim` (`arith`): IEEE f32, no fast-math flags, so no contraction (the
//!   only `fma` is the IR's own `Node::Fma`, as `llvm.fma.f32`) and no approximate division or
//!   square root.
//!
//! Owns: `plan` (which row sums each pass over a row computes), `arith` (the primitive ops and
//! bf16 conversions as instructions), `emit` (the kernel function: parameters, index maps,
//! loops, the reduction) and `target` (the NVPTX target machine, optimization, PTX text).
mod arith;
mod emit;
#[cfg(test)]
mod gpu_tests;
mod plan;
mod target;
#[cfg(test)]
mod tests;

use crate::error::{Result, RuntimeError};
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::module::Module;
use parc_compiler::ir::DType;
use parc_compiler::kir::{Access, Kernel};
use std::fmt::Display;

/// The PTX of `kernel` for `arch` (e.g. "sm_90"), with `dtypes` the storage type of every
/// operand, inputs then outputs. `kernel` must be expanded (`kir::expand`). The CUDA backend's
/// `Emitter` for `PARC_CODEGEN=llvm` (runtime/src/cuda/fused.rs) calls this.
pub fn ptx(kernel: &Kernel, dtypes: &[DType], arch: &str) -> Result<String> {
    if !kernel.is_expanded() {
        return Err(RuntimeError::Unsupported(
            "the LLVM emitter needs an expanded kernel (kir::expand): it has composite ops".into(),
        ));
    }
    kernel
        .validate()
        .map_err(|e| llvm_error(format!("invalid kernel `{kernel}`: {e}")))?;
    let bf16 = storage(kernel, dtypes)?;
    let ctx = Context::create();
    let module = ctx.create_module("parc_fused");
    let builder = ctx.create_builder();
    let ir = Ir {
        ctx: &ctx,
        module: &module,
        b: &builder,
    };
    emit::kernel(&ir, kernel, &bf16)?;
    target::ptx(&module, arch)
}

/// Whether each operand (inputs then outputs) is stored as bf16; checks the types the ABI allows.
fn storage(kernel: &Kernel, dtypes: &[DType]) -> Result<Vec<bool>> {
    let accesses: Vec<&Access> = kernel.inputs.iter().chain(&kernel.outputs).collect();
    if accesses.len() != dtypes.len() {
        return Err(llvm_error(format!(
            "{} operand types for a kernel of {} inputs and {} outputs",
            dtypes.len(),
            kernel.inputs.len(),
            kernel.outputs.len()
        )));
    }
    accesses
        .iter()
        .zip(dtypes)
        .enumerate()
        .map(|(i, (access, dtype))| match (access, dtype) {
            (_, DType::F32) => Ok(false),
            (Access::Elem { .. }, DType::Bf16) => Ok(true),
            _ => Err(llvm_error(format!(
                "operand {i} ({access:?}) stored as {dtype:?}: only elementwise operands may be \
                 bf16, and none i32"
            ))),
        })
        .collect()
}

/// What the builders share: the context, the module and the instruction builder.
pub(crate) struct Ir<'a, 'ctx> {
    ctx: &'ctx Context,
    module: &'a Module<'ctx>,
    b: &'a Builder<'ctx>,
}

fn llvm_error(what: impl Display) -> RuntimeError {
    RuntimeError::Op {
        op: "fused".into(),
        what: format!("LLVM emitter: {what}"),
    }
}

/// LLVM's errors (builder misuse, verifier, target) as runtime errors naming the emitter.
trait Llvm<T> {
    fn llvm(self) -> Result<T>;
}

impl<T, E: Display> Llvm<T> for std::result::Result<T, E> {
    fn llvm(self) -> Result<T> {
        self.map_err(llvm_error)
    }
}
