//! GEMMs through cuBLASLt with fp32 compute (`CUBLAS_COMPUTE_32F`: no TF32). The A/B operands
//! are fp32 (results within float rounding of the CPU backend), bf16 (`CUDA_R_16BF`, the
//! backend's bf16 precision) or fp16 (`CUDA_R_16F`, its fp16 precision); the caller hands 16-bit
//! operands as stored, as cached casts or as per-use copies (`gemm_operands`). C/D are fp32, or
//! bf16 with bf16 A/B (a bf16-stored output: the fp32 result `alpha·AB + beta·C` is rounded
//! once, so an accumulating GEMM reads, adds and rounds; C may be another matrix than D,
//! `c_in`: a residual). Callers describe the product column-major, as cuBLAS sees memory; `matmul` maps the row-major ops onto it (see [`Gemm`]).
//! The epilogue ([`Epilogue`]) can add a bias per row of D (`CUBLASLT_EPILOGUE_BIAS`, fp32
//! values, or bf16 where cuBLASLt takes no fp32 bias beside a bf16 D) or write the column sums
//! of op(B) over k as fp32 (`CUBLASLT_EPILOGUE_BGRADB`, a bias gradient), apply GELU (tanh
//! approximation) and write the pre-activation as an auxiliary output (`GELU_AUX[_BIAS]`), or
//! multiply by GELU's derivative at an auxiliary pre-activation input (`DGELU`); a combination
//! cuBLASLt does not offer is reported by [`Blas::supports`] and the caller does it another way.
//!
//! Plans: the descriptors of each distinct GEMM (shape, transposes, leading dimensions, operand
//! and output types, whether it accumulates, its epilogue) are made once and cached for the
//! backend's life, with the algorithm to run. fp32 GEMMs run cuBLASLt's first heuristic choice
//! (the exact path is unchanged); 16-bit GEMMs ask the heuristic for up to [`CANDIDATES`]
//! algorithms and, on first use, time each on the real operands (CUDA events, best of
//! [`TIMED_RUNS`] after one warm-up) and keep the fastest for the rest of the run. A candidate
//! writes D before the real run overwrites it, so a GEMM that accumulates (beta ≠ 0) is timed
//! into a scratch D the caller provides (`tune_out`), and without one runs the first choice.
//!
//! FP8 GEMMs (`Operands::Fp8`, [`Blas::run_fp8`], fed by `fp8`): E4M3/E5M2 A and B, A
//! transposed and B not (Hopper's one FP8 form), each with a scale mode
//! (`CUBLASLT_MATMUL_DESC_{A,B}_SCALE_MODE`) and its dequantization factors' pointer; they
//! run the heuristic's first choice, untimed.
use super::device::{cublas_error, driver_error};
use super::kernel::Kernel;
use crate::error::Result;
use cudarc::cublaslt::{result, sys};
use cudarc::driver::result::event;
use cudarc::driver::sys::{CUdeviceptr, CUevent, CUevent_flags, CUstream};
use parc_compiler::ir::fp8::Fp8Format;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::mem::size_of;

/// Heuristic candidates timed per 16-bit GEMM.
const CANDIDATES: usize = 8;
/// Timed runs per candidate (the fastest counts).
const TIMED_RUNS: usize = 2;

/// A column-major `C = alpha · op(A) · op(B) + beta · C (+ bias)`, `op(A)` m×k, `op(B)` k×n,
/// C m×n. A transposed operand is stored k×m (or n×k) with its leading dimension.
#[derive(Clone, Copy, Debug)]
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
    /// Where C is read when it is not D (`c` is then D alone): `D = alpha·AB + beta·C_in`,
    /// C_in shaped and typed like D (a residual added by the GEMM). None: C is D.
    pub c_in: Option<CUdeviceptr>,
    pub beta: f32,
    /// The element type of C and D (bf16 only with 16-bit A/B).
    pub out: Output,
    pub epilogue: Epilogue,
}

/// The element type of a GEMM's C and D.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Output {
    F32,
    /// Raw bf16 bit patterns (`CUDA_R_16BF`); each element rounded once from the fp32 result.
    Bf16,
}

impl Output {
    pub fn bytes(self) -> usize {
        match self {
            Output::F32 => 4,
            Output::Bf16 => 2,
        }
    }

    fn data_type(self) -> sys::cudaDataType_t {
        match self {
            Output::F32 => sys::cudaDataType_t::CUDA_R_32F,
            Output::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        }
    }
}

/// What cuBLASLt's epilogue does besides `alpha·AB + beta·C`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Epilogue {
    None,
    /// m values at `ptr` (fp32, or bf16 when `bf16`) added to every column of the product.
    Bias {
        ptr: CUdeviceptr,
        bf16: bool,
    },
    /// The n column sums of op(B) over k written (not added) as fp32 at `ptr`: for a
    /// backward-weight GEMM whose B is dy, the bias gradient.
    BiasGradB {
        ptr: CUdeviceptr,
    },
    /// GELU (tanh approximation) of the product, plus the bias when given (as `Bias`): D =
    /// gelu(p), and the pre-activation p (m × n, leading dimension ldc, D's type) written at
    /// `aux` (`CUBLASLT_EPILOGUE_GELU_AUX[_BIAS]`).
    GeluAux {
        bias: Option<(CUdeviceptr, bool)>,
        aux: CUdeviceptr,
    },
    /// D = product ⊙ gelu'(pre), the pre-activation read at `aux` (m × n, leading dimension
    /// ldc, D's type): the GELU gradient (`CUBLASLT_EPILOGUE_DGELU`).
    DGelu {
        aux: CUdeviceptr,
    },
}

/// An [`Epilogue`] without its pointer: what a plan depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum EpilogueKind {
    None,
    BiasF32,
    BiasBf16,
    BiasGradB,
    GeluAux,
    GeluAuxBiasF32,
    GeluAuxBiasBf16,
    DGelu,
}

impl Epilogue {
    fn kind(self) -> EpilogueKind {
        match self {
            Epilogue::None => EpilogueKind::None,
            Epilogue::Bias { bf16: false, .. } => EpilogueKind::BiasF32,
            Epilogue::Bias { bf16: true, .. } => EpilogueKind::BiasBf16,
            Epilogue::BiasGradB { .. } => EpilogueKind::BiasGradB,
            Epilogue::GeluAux { bias: None, .. } => EpilogueKind::GeluAux,
            Epilogue::GeluAux {
                bias: Some((_, false)),
                ..
            } => EpilogueKind::GeluAuxBiasF32,
            Epilogue::GeluAux {
                bias: Some((_, true)),
                ..
            } => EpilogueKind::GeluAuxBiasBf16,
            Epilogue::DGelu { .. } => EpilogueKind::DGelu,
        }
    }

    /// The vector pointer (`CUBLASLT_MATMUL_DESC_BIAS_POINTER`: a bias or a bias gradient).
    fn pointer(self) -> Option<CUdeviceptr> {
        match self {
            Epilogue::None | Epilogue::DGelu { .. } => None,
            Epilogue::Bias { ptr, .. } | Epilogue::BiasGradB { ptr } => Some(ptr),
            Epilogue::GeluAux { bias, .. } => bias.map(|(ptr, _)| ptr),
        }
    }

    /// The auxiliary matrix pointer (`CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER`).
    fn aux(self) -> Option<CUdeviceptr> {
        match self {
            Epilogue::GeluAux { aux, .. } | Epilogue::DGelu { aux } => Some(aux),
            Epilogue::None | Epilogue::Bias { .. } | Epilogue::BiasGradB { .. } => None,
        }
    }
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

    /// Elements of C as stored (`ldc` per column).
    pub fn c_len(&self) -> usize {
        (self.ldc as u64 * self.n) as usize
    }

    pub(crate) fn key(&self, operands: Operands) -> PlanKey {
        PlanKey {
            trans_a: self.trans_a,
            trans_b: self.trans_b,
            m: self.m,
            n: self.n,
            k: self.k,
            lda: self.lda,
            ldb: self.ldb,
            ldc: self.ldc,
            operands,
            out: self.out,
            accumulates: self.beta != 0.0,
            epilogue: self.epilogue.kind(),
        }
    }
}

/// The element type of a GEMM's A and B operands (C/D and the accumulation are always fp32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Operands {
    F32,
    /// Raw bf16 bit patterns (`CUDA_R_16BF`).
    Bf16,
    /// Raw IEEE binary16 bit patterns (`CUDA_R_16F`).
    F16,
    /// FP8 (`CUDA_R_8F_E4M3` / `CUDA_R_8F_E5M2`), each operand with its scale mode (`fp8`):
    /// A transposed and B not (both K-major, the only FP8 form Hopper runs), the dequantization
    /// factors read through `CUBLASLT_MATMUL_DESC_{A,B}_SCALE_POINTER`.
    Fp8(Fp8Operands),
}

/// The formats of a tensorwise FP8 GEMM's A and B (one dequantization factor each,
/// `SCALAR_32F`: the other recipes run on parc's kernel, `fp8_gemm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Fp8Operands {
    pub a: Fp8Format,
    pub b: Fp8Format,
    /// Accumulate in the tensor cores' own accumulator (`CUBLASLT_MATMUL_DESC_FAST_ACCUM`)
    /// rather than promoting partial sums into fp32 every few K steps.
    pub fast_accum: bool,
}

fn fp8_type(format: Fp8Format) -> sys::cudaDataType_t {
    match format {
        Fp8Format::E4m3 => sys::cudaDataType_t::CUDA_R_8F_E4M3,
        Fp8Format::E5m2 => sys::cudaDataType_t::CUDA_R_8F_E5M2,
    }
}

impl Operands {
    /// The kernel that rounds both fp32 operands of a GEMM into this type in one launch
    /// (`(const float* a, unsigned short* a16, long long na, const float* b, unsigned short*
    /// b16, long long nb)`); None for fp32, which cuBLASLt reads as stored.
    pub fn conversion_kernel(self) -> Option<Kernel> {
        match self {
            Operands::F32 | Operands::Fp8(_) => None,
            Operands::Bf16 => Some(Kernel::F32ToBf16Pair),
            Operands::F16 => Some(Kernel::F32ToF16Pair),
        }
    }

    fn name(self) -> String {
        match self {
            Operands::F32 => "fp32".into(),
            Operands::Bf16 => "bf16".into(),
            Operands::F16 => "fp16".into(),
            Operands::Fp8(f) => format!(
                "tensorwise FP8 ({} A, {} B, {} accumulation)",
                f.a.name(),
                f.b.name(),
                if f.fast_accum { "fast" } else { "split" }
            ),
        }
    }

    /// The cuBLASLt types of A and B.
    fn data_types(self) -> [sys::cudaDataType_t; 2] {
        let both = |t| [t, t];
        match self {
            Operands::F32 => both(sys::cudaDataType_t::CUDA_R_32F),
            Operands::Bf16 => both(sys::cudaDataType_t::CUDA_R_16BF),
            Operands::F16 => both(sys::cudaDataType_t::CUDA_R_16F),
            Operands::Fp8(f) => [fp8_type(f.a), fp8_type(f.b)],
        }
    }
}

/// What makes two GEMMs share a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    trans_a: bool,
    trans_b: bool,
    m: u64,
    n: u64,
    k: u64,
    lda: i64,
    ldb: i64,
    ldc: i64,
    operands: Operands,
    out: Output,
    accumulates: bool,
    epilogue: EpilogueKind,
}

impl PlanKey {
    pub(crate) fn describe(&self) -> String {
        format!(
            "a {}x{}x{} {} GEMM with {} output (trans_a={}, trans_b={}{}{})",
            self.m,
            self.n,
            self.k,
            self.operands.name(),
            match self.out {
                Output::F32 => "fp32",
                Output::Bf16 => "bf16",
            },
            self.trans_a,
            self.trans_b,
            if self.accumulates { ", beta 1" } else { "" },
            match self.epilogue {
                EpilogueKind::None => "",
                EpilogueKind::BiasF32 => ", fp32 bias epilogue",
                EpilogueKind::BiasBf16 => ", bf16 bias epilogue",
                EpilogueKind::BiasGradB => ", bias-gradient epilogue",
                EpilogueKind::GeluAux => ", GELU epilogue",
                EpilogueKind::GeluAuxBiasF32 => ", fp32 bias + GELU epilogue",
                EpilogueKind::GeluAuxBiasBf16 => ", bf16 bias + GELU epilogue",
                EpilogueKind::DGelu => ", GELU-gradient epilogue",
            }
        )
    }
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

/// One GEMM's descriptors and the algorithms cuBLASLt offers for it.
struct Plan {
    desc: Guard<sys::cublasLtMatmulDesc_t>,
    a: Guard<sys::cublasLtMatrixLayout_t>,
    b: Guard<sys::cublasLtMatrixLayout_t>,
    c: Guard<sys::cublasLtMatrixLayout_t>,
    /// The heuristic's algorithms, best guess first; after tuning, the fastest alone.
    algos: Vec<sys::cublasLtMatmulAlgo_t>,
    /// Whether `algos[0]` is final (fp32 plans, and 16-bit plans once timed).
    settled: bool,
    /// The chosen algorithm's time in milliseconds, once timed.
    timed_ms: Option<f32>,
}

/// The fastest of [`TIMED_RUNS`] runs of `run` (milliseconds, CUDA events on `stream`); a
/// warm-up run, where one is wanted, is the caller's.
pub(crate) fn best_of(stream: CUstream, mut run: impl FnMut() -> Result<()>) -> Result<f32> {
    let (start, end) = (Event::new()?, Event::new()?);
    let mut fastest = f32::INFINITY;
    for _ in 0..TIMED_RUNS {
        start.record(stream)?;
        run()?;
        end.record(stream)?;
        fastest = fastest.min(start.until(&end)?);
    }
    Ok(fastest)
}

/// A CUDA event, destroyed on drop.
struct Event(CUevent);

impl Event {
    fn new() -> Result<Event> {
        event::create(CUevent_flags::CU_EVENT_DEFAULT)
            .map(Event)
            .map_err(|e| driver_error("creating a CUDA event to time GEMM algorithms", e))
    }

    fn record(&self, stream: CUstream) -> Result<()> {
        // SAFETY: the event is live and the stream is the backend's.
        unsafe { event::record(self.0, stream) }
            .map_err(|e| driver_error("recording a CUDA event", e))
    }

    /// Milliseconds from `self` to `end`, waiting for `end`.
    fn until(&self, end: &Event) -> Result<f32> {
        // SAFETY: both events are live and were recorded on one stream.
        unsafe { event::synchronize(end.0) }
            .map_err(|e| driver_error("waiting for a timed GEMM", e))?;
        // SAFETY: as above; both have completed.
        unsafe { event::elapsed(self.0, end.0) }
            .map_err(|e| driver_error("reading a GEMM's time", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once here.
        let _ = unsafe { event::destroy(self.0) };
    }
}

/// The cuBLASLt handle, its workspace (owned by the backend, freed with it) and the plans.
pub(crate) struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CUdeviceptr,
    workspace_size: usize,
    plans: HashMap<PlanKey, Plan>,
    /// Algorithms an earlier run timed fastest (`choices`, adopted from a checkpoint), by plan
    /// description: a plan made for one of them runs it, untimed.
    preferred: BTreeMap<String, sys::cublasLtMatmulAlgo_t>,
    /// Set by [`Blas::time_matmuls`]: events around each matmul and the time summed so far.
    timer: Option<(Event, Event, f64)>,
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
            plans: HashMap::new(),
            preferred: BTreeMap::new(),
            timer: None,
        })
    }

    /// The algorithm each plan runs where it was chosen by timing (in this run, or adopted
    /// from an earlier one: [`Blas::prefer`]), by plan description (`choices`), with those
    /// adopted but not yet used.
    pub fn chosen_algorithms(&self) -> BTreeMap<String, [u64; 8]> {
        let mut out: BTreeMap<String, [u64; 8]> = (self.preferred.iter())
            .map(|(k, a)| (k.clone(), a.data))
            .collect();
        for (key, plan) in &self.plans {
            if let (Some(_), Some(algo)) = (plan.timed_ms, plan.algos.first()) {
                out.insert(format!("{key:?}"), algo.data);
            }
        }
        out
    }

    /// Run the algorithms `saved` (plan description → algorithm, from an earlier run on this
    /// device and cuBLASLt version) for their plans instead of timing them (plans made already
    /// and not yet timed included).
    pub fn prefer(&mut self, saved: BTreeMap<String, [u64; 8]>) {
        for (key, data) in saved {
            self.preferred
                .insert(key, sys::cublasLtMatmulAlgo_t { data });
        }
        for (key, plan) in &mut self.plans {
            let saved = self.preferred.get(&format!("{key:?}"));
            if let (false, false, Some(algo)) = (plan.settled, plan.algos.is_empty(), saved) {
                plan.algos = vec![*algo];
                plan.settled = true;
            }
        }
    }

    /// Starts (`true`: from zero) or stops timing the matmuls alone: each one of `run` is then
    /// bracketed by CUDA events and waited for, so the GPU time of the cuBLASLt kernels (not
    /// the operand conversions, nor algorithm tuning) adds up in [`Blas::matmul_ms`].
    pub fn time_matmuls(&mut self, on: bool) -> Result<()> {
        self.timer = if on {
            Some((Event::new()?, Event::new()?, 0.0))
        } else {
            None
        };
        Ok(())
    }

    /// Milliseconds of matmul GPU time since `time_matmuls(true)`; None when not timing.
    pub fn matmul_ms(&self) -> Option<f64> {
        self.timer.as_ref().map(|t| t.2)
    }

    /// One line per plan made so far: the GEMM, and whether cuBLASLt runs it (with how many
    /// candidate algorithms, or the one timed fastest and its configuration) or offers nothing
    /// for it.
    pub fn describe_plans(&self) -> Vec<String> {
        let mut lines: Vec<String> = self
            .plans
            .iter()
            .map(|(key, plan)| {
                let state = match (plan.algos.first(), plan.algos.len(), plan.timed_ms) {
                    (None, _, _) => "unsupported".to_string(),
                    (Some(algo), _, Some(ms)) => {
                        format!("timed, fastest {ms:.3} ms: {}", algo_summary(algo))
                    }
                    (Some(algo), 1, None) => {
                        format!("the heuristic's choice: {}", algo_summary(algo))
                    }
                    (_, n, None) => format!("{n} candidates, not yet timed"),
                };
                format!("{}: {state}", key.describe())
            })
            .collect();
        lines.sort();
        lines
    }

    /// Whether cuBLASLt has an algorithm for `g` with `operands` (false only where none
    /// exists, e.g. an epilogue it does not offer for these types); makes the plan.
    pub fn supports(&mut self, g: &Gemm, operands: Operands) -> Result<bool> {
        let key = g.key(operands);
        if !self.plans.contains_key(&key) {
            let plan = self.make_plan(&key)?;
            self.plans.insert(key, plan);
        }
        Ok(self.plans.get(&key).is_some_and(|p| !p.algos.is_empty()))
    }

    /// The chosen cuBLASLt algorithm's milliseconds for `g`, once its candidates were timed.
    pub fn timed_ms(&self, g: &Gemm, operands: Operands) -> Option<f32> {
        self.plans.get(&g.key(operands)).and_then(|p| p.timed_ms)
    }

    /// The workspace: device pointer and bytes (free between GEMMs on the stream, so parc's
    /// GEMM kernel keeps its split partials there).
    pub fn workspace(&self) -> (CUdeviceptr, usize) {
        (self.workspace, self.workspace_size)
    }

    /// Around a GEMM that is not cuBLASLt's (parc's kernel): while `time_matmuls` is on, its
    /// time is added like a cuBLASLt run's.
    pub fn timer_start(&self, stream: CUstream) -> Result<()> {
        match &self.timer {
            Some((start, _, _)) => start.record(stream),
            None => Ok(()),
        }
    }

    pub fn timer_stop(&mut self, stream: CUstream) -> Result<()> {
        if let Some((start, end, total)) = &mut self.timer {
            end.record(stream)?;
            *total += f64::from(start.until(end)?);
        }
        Ok(())
    }

    /// Whether the algorithm for `g` is chosen (false before its first run, and while a 16-bit
    /// GEMM that accumulates has not yet been given a `tune_out` to be timed into).
    pub fn settled(&self, g: &Gemm, operands: Operands) -> bool {
        self.plans.get(&g.key(operands)).is_some_and(|p| p.settled)
    }

    /// Runs `g`; its A and B pointers hold `operands`-typed elements. On the first run of a
    /// 16-bit GEMM the candidates are timed first (see the module docs): into C itself when
    /// beta is 0, else into `tune_out` (`g.c_len()` elements of `g.out`), and without it not
    /// at all. A bias-gradient epilogue writes its vector on every timed run too. A GEMM with
    /// an epilogue that fails to launch makes its plan unsupported (see `supports`).
    pub fn run(
        &mut self,
        g: &Gemm,
        operands: Operands,
        stream: CUstream,
        tune_out: Option<CUdeviceptr>,
    ) -> Result<()> {
        if !self.supports(g, operands)? {
            return Err(cublas_error(
                &format!(
                    "cuBLASLt algorithm search for {}",
                    g.key(operands).describe()
                ),
                "no algorithm supports it",
            ));
        }
        let key = g.key(operands);
        let result = self.run_planned(&key, g, stream, tune_out);
        if result.is_err() && key.epilogue != EpilogueKind::None {
            // cuBLASLt refused the epilogue at launch although its heuristic offered it: from
            // now on `supports` says no, so the caller can do the epilogue's work another way
            // (nothing was written: a refused launch queues no work).
            if let Some(plan) = self.plans.get_mut(&key) {
                plan.algos.clear();
                plan.settled = true;
            }
        }
        result
    }

    /// `run` for a GEMM whose plan exists and has an algorithm.
    fn run_planned(
        &mut self,
        key: &PlanKey,
        g: &Gemm,
        stream: CUstream,
        tune_out: Option<CUdeviceptr>,
    ) -> Result<()> {
        let key = *key;
        // A candidate overwrites D: timed into D itself unless D is also the C it reads.
        let timed_into = if key.accumulates && g.c_in.is_none() {
            tune_out
        } else {
            Some(g.c)
        };
        let unsettled = self.plans.get(&key).is_some_and(|p| !p.settled);
        if let (true, Some(d)) = (unsettled, timed_into) {
            let (ms, best) = self.fastest(&key, g, d, stream)?;
            if let Some(plan) = self.plans.get_mut(&key) {
                plan.algos = vec![best];
                plan.timed_ms = Some(ms);
                plan.settled = true;
            }
        }
        let (plan, algo) = self.planned(&key)?;
        self.timer_start(stream)?;
        self.launch(plan, g, &algo, g.c, stream, None)
            .map_err(|e| cublas_error(&format!("cuBLASLt matmul for {}", key.describe()), e))?;
        self.timer_stop(stream)
    }

    /// The cached plan of `key` and the algorithm it runs.
    fn planned(&self, key: &PlanKey) -> Result<(&Plan, sys::cublasLtMatmulAlgo_t)> {
        let what = || format!("cuBLASLt plan for {}", key.describe());
        let plan = (self.plans.get(key)).ok_or_else(|| cublas_error(&what(), "missing"))?;
        let algo = *plan
            .algos
            .first()
            .ok_or_else(|| cublas_error(&what(), "no algorithm"))?;
        Ok((plan, algo))
    }

    /// Runs FP8 GEMM `g` (`operands` an `Operands::Fp8`; A and B hold FP8 bytes) with the
    /// dequantization factors of A and B at `scales`, on cuBLASLt's first heuristic choice.
    /// Errors where cuBLASLt has no algorithm for it (the caller names what is supported).
    pub fn run_fp8(
        &mut self,
        g: &Gemm,
        operands: Operands,
        scales: [CUdeviceptr; 2],
        stream: CUstream,
    ) -> Result<()> {
        let key = g.key(operands);
        if !self.supports(g, operands)? {
            return Err(cublas_error(
                &format!("cuBLASLt algorithm search for {}", key.describe()),
                "no algorithm supports it",
            ));
        }
        let (plan, algo) = self.planned(&key)?;
        self.timer_start(stream)?;
        self.launch(plan, g, &algo, g.c, stream, Some(scales))
            .map_err(|e| cublas_error(&format!("cuBLASLt matmul for {}", key.describe()), e))?;
        self.timer_stop(stream)
    }

    /// Times every candidate of `key`'s plan on `g`'s operands writing D at `d`: the fastest
    /// and its milliseconds.
    fn fastest(
        &self,
        key: &PlanKey,
        g: &Gemm,
        d: CUdeviceptr,
        stream: CUstream,
    ) -> Result<(f32, sys::cublasLtMatmulAlgo_t)> {
        let plan = self.plans.get(key).ok_or_else(|| {
            cublas_error(&format!("cuBLASLt plan for {}", key.describe()), "missing")
        })?;
        let mut best: Option<(f32, sys::cublasLtMatmulAlgo_t)> = None;
        for algo in &plan.algos {
            // A candidate cuBLASLt refuses at launch is skipped (the heuristic offered it,
            // but the check runs only here).
            if self.launch(plan, g, algo, d, stream, None).is_err() {
                continue;
            }
            let fastest = best_of(stream, || {
                self.launch(plan, g, algo, d, stream, None)
                    .map_err(|e| cublas_error(&format!("timing cuBLASLt on {}", key.describe()), e))
            })?;
            if best.is_none_or(|(ms, _)| fastest < ms) {
                best = Some((fastest, *algo));
            }
        }
        best.ok_or_else(|| {
            cublas_error(
                &format!("cuBLASLt matmul for {}", key.describe()),
                "every algorithm the heuristic offered failed to launch",
            )
        })
    }

    /// Queues `g` with `algo`, reading C at `g.c_in` (else `g.c`) and writing D at `d`; an
    /// FP8 GEMM reads A's and B's dequantization factors at `scales`.
    fn launch(
        &self,
        plan: &Plan,
        g: &Gemm,
        algo: &sys::cublasLtMatmulAlgo_t,
        d: CUdeviceptr,
        stream: CUstream,
        scales: Option<[CUdeviceptr; 2]>,
    ) -> std::result::Result<(), result::CublasError> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        for (attr, ptr) in [
            (A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.epilogue.pointer()),
            (
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                g.epilogue.aux(),
            ),
            (
                A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                scales.map(|s| s[0]),
            ),
            (
                A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                scales.map(|s| s[1]),
            ),
        ] {
            let Some(ptr) = ptr else { continue };
            // SAFETY: desc is live; the attribute is a device pointer (8 bytes).
            unsafe {
                result::set_matmul_desc_attribute(
                    plan.desc.0,
                    attr,
                    (&ptr as *const CUdeviceptr).cast(),
                    size_of::<CUdeviceptr>(),
                )
            }?;
        }
        let alpha = 1.0f32;
        let beta = g.beta;
        // SAFETY: the pointers are device allocations the backend checked to hold the
        // described matrices (D like C); the workspace outlives the call (stream-ordered).
        unsafe {
            result::matmul(
                self.handle,
                plan.desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                g.a as *const c_void,
                plan.a.0,
                g.b as *const c_void,
                plan.b.0,
                g.c_in.unwrap_or(g.c) as *const c_void,
                plan.c.0,
                d as *mut c_void,
                plan.c.0,
                algo,
                self.workspace as *mut c_void,
                self.workspace_size,
                stream as sys::cudaStream_t,
            )
        }
    }

    /// The descriptors of `key` and the heuristic's algorithms for them (none: unsupported).
    fn make_plan(&self, key: &PlanKey) -> Result<Plan> {
        let what = |step: &str| format!("cuBLASLt {step} for {}", key.describe());
        let [a_type, b_type] = key.operands.data_types();
        let layout = |dtype: sys::cudaDataType_t, rows: u64, cols: u64, ld: i64| {
            result::create_matrix_layout(dtype, rows, cols, ld)
                .map(|l| Guard(l, result::destroy_matrix_layout))
                .map_err(|e| cublas_error(&what("matrix layout"), e))
        };
        let (a_rows, a_cols) = if key.trans_a {
            (key.k, key.m)
        } else {
            (key.m, key.k)
        };
        let (b_rows, b_cols) = if key.trans_b {
            (key.n, key.k)
        } else {
            (key.k, key.n)
        };
        let a = layout(a_type, a_rows, a_cols, key.lda)?;
        let b = layout(b_type, b_rows, b_cols, key.ldb)?;
        let c = layout(key.out.data_type(), key.m, key.n, key.ldc)?;
        let (desc, supported) = matmul_desc(key, &what)?;
        let algos = match (supported, self.preferred.get(&format!("{key:?}"))) {
            (true, Some(saved)) => vec![*saved],
            (true, None) => self.heuristic(key, &desc, [&a, &b, &c], &what)?,
            (false, _) => Vec::new(),
        };
        Ok(Plan {
            settled: algos.len() <= 1,
            timed_ms: None,
            desc,
            a,
            b,
            c,
            algos,
        })
    }

    /// The algorithms cuBLASLt's heuristic offers for `desc` over layouts `a`, `b`, `c` (C and
    /// D alike) within the workspace, best guess first: one for fp32 plans, up to
    /// [`CANDIDATES`] to time for 16-bit ones; none where it supports no algorithm.
    fn heuristic(
        &self,
        key: &PlanKey,
        desc: &Guard<sys::cublasLtMatmulDesc_t>,
        [a, b, c]: [&Guard<sys::cublasLtMatrixLayout_t>; 3],
        what: &dyn Fn(&str) -> String,
    ) -> Result<Vec<sys::cublasLtMatmulAlgo_t>> {
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
        // fp32 and FP8 plans run the heuristic's first choice (FP8: not yet timed, so an
        // accumulating FP8 GEMM needs no scratch D to time into).
        let wanted = match key.operands {
            Operands::F32 | Operands::Fp8(_) => 1,
            Operands::Bf16 | Operands::F16 => CANDIDATES,
        };
        // SAFETY: an all-zero heuristic result is a valid value of this plain C struct.
        let mut found: Vec<sys::cublasLtMatmulHeuristicResult_t> =
            vec![unsafe { std::mem::zeroed() }; wanted];
        let mut count: i32 = 0;
        // SAFETY: every descriptor is live for the call; `found` has room for `wanted` results.
        let status = unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc.0,
                a.0,
                b.0,
                c.0,
                c.0,
                pref.0,
                wanted as i32,
                found.as_mut_ptr(),
                &mut count,
            )
        };
        match status {
            sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(found
                .iter()
                .take(count.max(0) as usize)
                .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|r| r.algo)
                .collect()),
            // No algorithm, or (with an epilogue) a combination cuBLASLt rejects: the caller
            // does the epilogue's work another way.
            sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => Ok(Vec::new()),
            _ if key.epilogue != EpilogueKind::None => Ok(Vec::new()),
            other => Err(cublas_error(&what("algorithm search"), other)),
        }
    }
}

/// The matmul descriptor of `key` (fp32 compute and scale, transposes, epilogue), and whether
/// cuBLASLt can run it at all: an epilogue with an auxiliary matrix needs D's leading
/// dimension a multiple of 8 (false: the plan has no algorithm).
fn matmul_desc(
    key: &PlanKey,
    what: &dyn Fn(&str) -> String,
) -> Result<(Guard<sys::cublasLtMatmulDesc_t>, bool)> {
    let f32_type = sys::cudaDataType_t::CUDA_R_32F;
    let desc = result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32_type)
        .map(|d| Guard(d, result::destroy_matmul_desc))
        .map_err(|e| cublas_error(&what("matmul descriptor"), e))?;
    let set = |attr: sys::cublasLtMatmulDescAttributes_t, value: i32, name: &str| {
        // SAFETY: desc is live; each attribute set here is a 4-byte enum.
        unsafe {
            result::set_matmul_desc_attribute(
                desc.0,
                attr,
                (&value as *const i32).cast(),
                size_of::<i32>(),
            )
        }
        .map_err(|e| cublas_error(&what(name), e))
    };
    use sys::cublasLtMatmulDescAttributes_t as A;
    set(
        A::CUBLASLT_MATMUL_DESC_TRANSA,
        i32::from(key.trans_a),
        "transpose attribute",
    )?;
    set(
        A::CUBLASLT_MATMUL_DESC_TRANSB,
        i32::from(key.trans_b),
        "transpose attribute",
    )?;
    if let Operands::Fp8(f) = key.operands {
        let scalar = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
        set(
            A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
            scalar as i32,
            "A scale mode",
        )?;
        set(
            A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
            scalar as i32,
            "B scale mode",
        )?;
        // The one attribute of these that is an int8_t.
        let fast = i8::from(f.fast_accum);
        // SAFETY: desc is live; the attribute is one byte.
        unsafe {
            result::set_matmul_desc_attribute(
                desc.0,
                A::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                (&fast as *const i8).cast(),
                size_of::<i8>(),
            )
        }
        .map_err(|e| cublas_error(&what("fast accumulation"), e))?;
    }
    if let Some((epilogue, vector_type)) = epilogue_of(key.epilogue) {
        set(
            A::CUBLASLT_MATMUL_DESC_EPILOGUE,
            epilogue as i32,
            "epilogue",
        )?;
        if let Some(vector_type) = vector_type {
            set(
                A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                vector_type as i32,
                "epilogue vector type",
            )?;
        }
    }
    if matches!(
        key.epilogue,
        EpilogueKind::GeluAux
            | EpilogueKind::GeluAuxBiasF32
            | EpilogueKind::GeluAuxBiasBf16
            | EpilogueKind::DGelu
    ) {
        // The auxiliary matrix is shaped and typed like D (its type left at the default,
        // D's); cuBLASLt wants its leading dimension a multiple of 8.
        if key.ldc % 8 != 0 {
            return Ok((desc, false));
        }
        let ld = key.ldc;
        // SAFETY: desc is live; the attribute is an int64_t.
        unsafe {
            result::set_matmul_desc_attribute(
                desc.0,
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                (&ld as *const i64).cast(),
                size_of::<i64>(),
            )
        }
        .map_err(|e| cublas_error(&what("auxiliary leading dimension"), e))?;
    }
    Ok((desc, true))
}

/// cuBLASLt's epilogue for `kind` and the type of its vector (None: it has none), or None for
/// no epilogue.
fn epilogue_of(
    kind: EpilogueKind,
) -> Option<(sys::cublasLtEpilogue_t, Option<sys::cudaDataType_t>)> {
    use sys::cublasLtEpilogue_t as E;
    let (f32_type, bf16_type) = (
        sys::cudaDataType_t::CUDA_R_32F,
        sys::cudaDataType_t::CUDA_R_16BF,
    );
    match kind {
        EpilogueKind::None => None,
        EpilogueKind::BiasF32 => Some((E::CUBLASLT_EPILOGUE_BIAS, Some(f32_type))),
        EpilogueKind::BiasBf16 => Some((E::CUBLASLT_EPILOGUE_BIAS, Some(bf16_type))),
        EpilogueKind::BiasGradB => Some((E::CUBLASLT_EPILOGUE_BGRADB, Some(f32_type))),
        EpilogueKind::GeluAux => Some((E::CUBLASLT_EPILOGUE_GELU_AUX, None)),
        EpilogueKind::GeluAuxBiasF32 => Some((E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS, Some(f32_type))),
        EpilogueKind::GeluAuxBiasBf16 => {
            Some((E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS, Some(bf16_type)))
        }
        EpilogueKind::DGelu => Some((E::CUBLASLT_EPILOGUE_DGELU, None)),
    }
}

/// A 4-byte configuration value of `algo` (None where cuBLASLt does not answer).
fn config(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
) -> Option<u32> {
    let mut value: u32 = 0;
    let mut written: usize = 0;
    // SAFETY: `algo` is an initialised algorithm; `value` has room for the 4 bytes asked for
    // and `written` receives how many cuBLASLt wrote.
    let status = unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            attr,
            (&mut value as *mut u32).cast(),
            size_of::<u32>(),
            &mut written,
        )
    };
    (status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && written == size_of::<u32>())
        .then_some(value)
}

/// The names of cuBLASLt's first tile ids (`cublasLtMatmulTile_t`, m × n per CTA).
const TILES: [&str; 36] = [
    "undefined",
    "8x8",
    "8x16",
    "16x8",
    "8x32",
    "16x16",
    "32x8",
    "8x64",
    "16x32",
    "32x16",
    "64x8",
    "32x32",
    "32x64",
    "64x32",
    "32x128",
    "64x64",
    "128x32",
    "64x128",
    "128x64",
    "64x256",
    "128x128",
    "256x64",
    "64x512",
    "128x256",
    "256x128",
    "512x64",
    "64x96",
    "96x64",
    "96x128",
    "128x160",
    "160x128",
    "192x128",
    "128x192",
    "128x96",
    "32x256",
    "256x32",
];

/// `algo`'s configuration in a few words: id, tile, stages, split-K and its reduction
/// scheme, CTA swizzling, custom option (for plan listings, so a device run shows which kernel
/// won; `?` where cuBLASLt does not say).
fn algo_summary(algo: &sys::cublasLtMatmulAlgo_t) -> String {
    use sys::cublasLtMatmulAlgoConfigAttributes_t as Config;
    let get = |attr| config(algo, attr).map_or("?".to_string(), |v| v.to_string());
    let tile = config(algo, Config::CUBLASLT_ALGO_CONFIG_TILE_ID).map_or("?".to_string(), |t| {
        TILES
            .get(t as usize)
            .map_or(format!("#{t}"), |name| name.to_string())
    });
    format!(
        "algo {} tile {tile} stages {} split-K {} (reduction {}) swizzle {} custom {}",
        get(Config::CUBLASLT_ALGO_CONFIG_ID),
        get(Config::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        get(Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
        get(Config::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
        get(Config::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        get(Config::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
    )
}

impl Drop for Blas {
    fn drop(&mut self) {
        // The plans' descriptors go before the handle.
        self.plans.clear();
        // SAFETY: the handle was created in `new` and is destroyed once.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}
