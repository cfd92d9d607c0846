//! The NVPTX target: LLVM's optimization pipeline on a built kernel module and its PTX text.
//! The target machine has default options (no unsafe FP math, FP-op fusion "standard": only
//! instructions flagged `contract` may become `fma`, and the emitter flags none), so the PTX
//! keeps `kir::prim`'s rounding: `div.rn.f32`, `sqrt.rn.f32`, no `fma` but the IR's own
//! (`Node::Fma` as `llvm.fma.f32`), no `.ftz`, no `.approx`.
use super::Llvm;
use crate::error::Result;
use inkwell::module::Module;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{
    CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetMachine, TargetTriple,
};
use inkwell::OptimizationLevel;

const TRIPLE: &str = "nvptx64-nvidia-cuda";
/// PTX ISA 8.0 (CUDA 12.0): loaded by the CUDA 13 driver of the GPU machine (docs/cuda.md).
const FEATURES: &str = "+ptx80";

/// The optimized module as PTX for `arch` (e.g. "sm_90").
pub fn ptx(module: &Module<'_>, arch: &str) -> Result<String> {
    let machine = machine(arch)?;
    module.set_triple(&machine.get_triple());
    module.set_data_layout(&machine.get_target_data().get_data_layout());
    module
        .verify()
        .llvm()
        .map_err(|e| super::llvm_error(format!("the built module is invalid: {e}")))?;
    module
        .run_passes("default<O3>", &machine, PassBuilderOptions::create())
        .llvm()?;
    let buffer = machine
        .write_to_memory_buffer(module, FileType::Assembly)
        .llvm()?;
    String::from_utf8(buffer.as_slice().to_vec()).llvm()
}

fn machine(arch: &str) -> Result<TargetMachine> {
    Target::initialize_nvptx(&InitializationConfig::default());
    let triple = TargetTriple::create(TRIPLE);
    let target = Target::from_triple(&triple).llvm()?;
    target
        .create_target_machine(
            &triple,
            arch,
            FEATURES,
            OptimizationLevel::Aggressive,
            RelocMode::Default,
            CodeModel::Default,
        )
        .ok_or_else(|| super::llvm_error(format!("no NVPTX target machine for `{arch}`")))
}
