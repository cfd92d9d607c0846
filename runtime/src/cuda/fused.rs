//! Generated kernels on the GPU (`Op::Fused`): the emitters that turn a kernel into PTX, their
//! selection, and the compile, load and launch of what they give.
//!
//! An [`Emitter`] follows the generated-kernel ABI (docs/cuda.md, "Generated kernels"; the
//! emitters' modules restate it): entry `parc_fused`, one device pointer per input then per
//! output, then `long long rows`; `Elem` operands f32 or bf16 as `dtypes` says, the others
//! f32; any grid; a kernel with row sums blocks of `REDUCE_LANES` threads, each taking
//! [`Emitter::reduce_rows_per_block`] rows at once (NVRTC's: a row per warp; LLVM's: one). Two
//! emitters exist: [`NvrtcEmitter`] (CUDA C from `codegen`, compiled by NVRTC; the default) and
//! LLVM's (runtime/src/llvm, feature `llvm`), chosen by `PARC_CODEGEN=nvrtc|llvm`.
//!
//! Caches: NVRTC's PTX by content hash of the source in memory and on disk (`compile`); per
//! backend, the loaded function of each distinct kernel and operand types (keyed by the
//! kernel's JSON, so equal kernels of different ops share one module), and a fast path from
//! the op's `Arc<Kernel>` to it (the entry keeps a `Weak` of the kernel, so the address it is
//! keyed by cannot be reused by another kernel while the entry lives).
use super::args::Bound;
use super::codegen::{self, Shape};
use super::compile::cached_ptx;
use super::device::driver_error;
use super::CudaBackend;
use crate::error::{Result, RuntimeError};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use parc_compiler::ir::op::FusedAttrs;
use parc_compiler::ir::DType;
use parc_compiler::kir::{Access, Kernel, REDUCE_LANES};
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// Makes PTX of a generated kernel (see the module docs for the ABI it must follow).
pub trait Emitter: Send + Sync {
    /// Its name (`PARC_CODEGEN`'s value).
    fn name(&self) -> &'static str;
    /// The PTX of `kernel` (expanded: primitive ops only) for `arch` (e.g. "sm_90"), `dtypes`
    /// the storage type of every operand, inputs then outputs.
    fn ptx(&self, kernel: &Kernel, dtypes: &[DType], arch: &str) -> Result<String>;
    /// Rows a block of `REDUCE_LANES` threads of its row-sum kernels takes at once (the
    /// launch starts that many fewer blocks; the kernels stride over the rest).
    fn reduce_rows_per_block(&self) -> usize;
}

/// NVRTC options of generated kernels (part of the PTX cache key): float arithmetic as
/// written (no contraction into fma), IEEE division and square root, subnormals kept.
const NVRTC_OPTIONS: [&str; 4] = [
    "--fmad=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--ftz=false",
];

/// CUDA C from `codegen`, compiled by NVRTC (the default emitter).
pub struct NvrtcEmitter;

impl NvrtcEmitter {
    /// The CUDA C source it compiles for `kernel` and `dtypes`.
    pub fn source(kernel: &Kernel, dtypes: &[DType]) -> Result<String> {
        codegen::source(kernel, dtypes).map_err(|e| {
            RuntimeError::Unsupported(format!("generating CUDA C for kernel `{kernel}`: {e}"))
        })
    }
}

impl Emitter for NvrtcEmitter {
    fn name(&self) -> &'static str {
        "nvrtc"
    }

    fn ptx(&self, kernel: &Kernel, dtypes: &[DType], arch: &str) -> Result<String> {
        let src = NvrtcEmitter::source(kernel, dtypes)?;
        let what = format!("the generated kernel `{kernel}`");
        cached_ptx("fused", &what, &src, arch, &NVRTC_OPTIONS)
    }

    /// A row per warp (codegen's row-sum kernels).
    fn reduce_rows_per_block(&self) -> usize {
        REDUCE_LANES / 32
    }
}

/// The emitter `PARC_CODEGEN` names (`nvrtc` when unset).
pub fn emitter_from_env() -> Result<Box<dyn Emitter>> {
    let name = std::env::var("PARC_CODEGEN").unwrap_or_default();
    emitter_named(&name)
}

/// The emitter called `name` (`nvrtc` when empty).
pub fn emitter_named(name: &str) -> Result<Box<dyn Emitter>> {
    match name {
        "" | "nvrtc" => Ok(Box::new(NvrtcEmitter)),
        "llvm" => llvm_emitter(),
        other => Err(RuntimeError::Unsupported(format!(
            "PARC_CODEGEN={other}: no such kernel emitter (nvrtc or llvm)"
        ))),
    }
}

/// LLVM's emitter (runtime/src/llvm: inkwell, NVPTX), where this build has it. (The lint
/// allowance lets this compile before the `llvm` feature is declared.)
#[allow(unexpected_cfgs)]
mod llvm_hook {
    use super::{Emitter, Result};

    #[cfg(feature = "llvm")]
    struct LlvmEmitter;

    #[cfg(feature = "llvm")]
    impl Emitter for LlvmEmitter {
        fn name(&self) -> &'static str {
            "llvm"
        }

        fn ptx(
            &self,
            kernel: &super::Kernel,
            dtypes: &[super::DType],
            arch: &str,
        ) -> Result<String> {
            crate::llvm::ptx(kernel, dtypes, arch)
        }

        /// A row per block (runtime/src/llvm's row-sum kernels).
        fn reduce_rows_per_block(&self) -> usize {
            1
        }
    }

    #[cfg(feature = "llvm")]
    pub fn llvm_emitter() -> Result<Box<dyn Emitter>> {
        Ok(Box::new(LlvmEmitter))
    }

    #[cfg(not(feature = "llvm"))]
    pub fn llvm_emitter() -> Result<Box<dyn Emitter>> {
        Err(crate::error::RuntimeError::Unsupported(
            "PARC_CODEGEN=llvm: this parc was built without the `llvm` feature (build with \
             --features cuda,llvm, which needs LLVM 19's development package)"
                .into(),
        ))
    }
}
use llvm_hook::llvm_emitter;

/// The loaded kernel of one distinct (kernel, operand types).
#[derive(Clone)]
struct Loaded {
    function: CudaFunction,
    shape: Shape,
    /// Its emitter's [`Emitter::reduce_rows_per_block`].
    reduce_rows: usize,
}

/// A backend's generated kernels (see the module docs).
#[derive(Default)]
pub(crate) struct Generated {
    /// Chosen at the first fused op (`PARC_CODEGEN`).
    emitter: Option<Box<dyn Emitter>>,
    /// By the kernel's JSON and the operand types.
    by_content: HashMap<String, Loaded>,
    /// By the op's kernel's address and the operand types' bf16 mask.
    by_arc: HashMap<(usize, u64), (Weak<Kernel>, Loaded)>,
}

impl Generated {
    /// Use `emitter` from now on (forgetting the kernels loaded so far).
    pub fn set_emitter(&mut self, emitter: Box<dyn Emitter>) {
        *self = Generated {
            emitter: Some(emitter),
            ..Generated::default()
        };
    }

    fn emitter(&mut self) -> Result<&dyn Emitter> {
        if self.emitter.is_none() {
            self.emitter = Some(emitter_from_env()?);
        }
        match &self.emitter {
            Some(e) => Ok(e.as_ref()),
            None => Err(RuntimeError::Unsupported("no kernel emitter".into())),
        }
    }
}

/// Bit `i` set: operand `i` is bf16.
fn bf16_mask(dtypes: &[DType]) -> u64 {
    (dtypes.iter().enumerate())
        .filter(|(_, d)| **d == DType::Bf16)
        .fold(0, |m, (i, _)| m | (1 << i))
}

/// The NVRTC and LLVM name of the device's architecture ("sm_90").
fn arch(be: &CudaBackend) -> Result<String> {
    let (major, minor) = be
        .ctx
        .compute_capability()
        .map_err(|e| driver_error("reading the compute capability", e))?;
    Ok(format!("sm_{major}{minor}"))
}

impl CudaBackend {
    /// Run generated kernels with `emitter` instead of `PARC_CODEGEN`'s (tests comparing the
    /// emitters).
    pub fn set_emitter(&mut self, emitter: Box<dyn Emitter>) {
        self.generated.set_emitter(emitter);
    }

    /// The loaded function of `kernel` for `dtypes`: from the op's kernel's address, from its
    /// content, or expanded, emitted, compiled and loaded.
    fn generated_kernel(&mut self, kernel: &Arc<Kernel>, dtypes: &[DType]) -> Result<Loaded> {
        let key = (Arc::as_ptr(kernel) as usize, bf16_mask(dtypes));
        if let Some((weak, loaded)) = self.generated.by_arc.get(&key) {
            if weak.upgrade().is_some_and(|k| Arc::ptr_eq(&k, kernel)) {
                return Ok(loaded.clone());
            }
        }
        let content = serde_json::to_string(&**kernel)
            .map_err(|e| RuntimeError::Unsupported(format!("serializing a kernel: {e}")))?;
        let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
        let content = format!("{} {content}", names.join(","));
        let loaded = match self.generated.by_content.get(&content) {
            Some(loaded) => loaded.clone(),
            None => {
                let loaded = self.load_generated(kernel, dtypes)?;
                self.generated.by_content.insert(content, loaded.clone());
                loaded
            }
        };
        self.generated
            .by_arc
            .retain(|_, (weak, _)| weak.strong_count() > 0);
        let entry = (Arc::downgrade(kernel), loaded.clone());
        self.generated.by_arc.insert(key, entry);
        Ok(loaded)
    }

    fn load_generated(&mut self, kernel: &Kernel, dtypes: &[DType]) -> Result<Loaded> {
        let expanded = parc_compiler::kir::expand::expand(kernel);
        let arch = arch(self)?;
        let emitter = self.generated.emitter()?;
        let ptx = emitter.ptx(&expanded, dtypes, &arch)?;
        let reduce_rows = emitter.reduce_rows_per_block();
        let what = || format!("the generated kernel `{kernel}`");
        let module = self
            .ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(|e| driver_error(&format!("loading {}", what()), e))?;
        let function = module
            .load_function(codegen::ENTRY)
            .map_err(|e| driver_error(&format!("finding {} in its module", what()), e))?;
        Ok(Loaded {
            function,
            shape: codegen::shape(&expanded),
            reduce_rows,
        })
    }
}

/// Runs an `Op::Fused` on its bound buffers.
pub(super) fn run(be: &mut CudaBackend, b: &Bound, attrs: &FusedAttrs) -> Result<()> {
    let kernel = &attrs.kernel;
    let rows = b.rows;
    check_tables(b, kernel, rows)?;
    if rows == 0 || kernel.cols == 0 {
        return Ok(());
    }
    let buffers: Vec<_> = b.inputs.iter().chain(b.outputs).copied().collect();
    let dtypes: Vec<DType> = buffers.iter().map(|x| x.dtype).collect();
    let loaded = be.generated_kernel(kernel, &dtypes)?;
    let cfg = launch_config(loaded.shape, rows, kernel.cols, loaded.reduce_rows);
    let ptrs: Vec<u64> = buffers.iter().map(|x| x.ptr).collect();
    let rows = rows as i64;
    let mut launch = be.stream.launch_builder(&loaded.function);
    for p in &ptrs {
        launch.arg(p);
    }
    launch.arg(&rows);
    // SAFETY: `bind` checked every buffer's length against the kernel's accesses for `rows`
    // rows and `check_tables` the per-position tables; the arguments follow the ABI
    // (a pointer per operand, then the rows).
    unsafe { launch.launch(cfg) }.map_err(|e| {
        driver_error(
            &format!("launching the generated kernel `{}`", attrs.name),
            e,
        )
    })?;
    Ok(())
}

/// A per-position table must have a row for every position the rows reach (`bind` checked
/// only that it is whole rows).
fn check_tables(b: &Bound, kernel: &Kernel, rows: usize) -> Result<()> {
    for (i, access) in kernel.inputs.iter().enumerate() {
        if let Access::PerPosition { batch, width } = *access {
            let have = b.input(i)?.len as u64 / width.max(1);
            let need = (rows as u64).div_ceil(batch.max(1));
            if have < need {
                return Err(b.err(format!(
                    "input {i} is a table of {have} positions, but {rows} rows of batch {batch} read {need}"
                )));
            }
        }
    }
    Ok(())
}

/// Threads a block of an elementwise kernel.
const BLOCK: u32 = 256;
/// The most blocks a launch starts (the rest is grid-strided), as `launch_vec`'s.
const MAX_BLOCKS: usize = 1 << 16;

/// The launch of a kernel of `shape` over `rows × cols`: a thread per vector (per element in
/// a scalar kernel) up to [`MAX_BLOCKS`] blocks of 256, as the hand-written elementwise
/// kernels launch (on an H200 it moves f32 a third faster than a grid of one wave striding
/// over the rest); for row sums, blocks of `REDUCE_LANES` threads taking `reduce_rows` rows
/// each.
fn launch_config(shape: Shape, rows: usize, cols: u64, reduce_rows: usize) -> LaunchConfig {
    let (blocks, threads) = match shape {
        Shape::Reduce => (
            rows.div_ceil(reduce_rows.max(1)).min(MAX_BLOCKS),
            REDUCE_LANES as u32,
        ),
        Shape::Flat | Shape::Rows(_) => {
            let per_thread = match shape {
                Shape::Flat => 8,
                Shape::Rows(v) => v,
                Shape::Reduce => 1,
            };
            let items = (rows as u64 * cols).div_ceil(per_thread) as usize;
            (items.div_ceil(BLOCK as usize).min(MAX_BLOCKS), BLOCK)
        }
    };
    LaunchConfig {
        grid_dim: (blocks.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests;
