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
use super::device::{cublas_error, driver_error};
use crate::error::Result;
use cudarc::cublaslt::{result, sys};
use cudarc::driver::result::event;
use cudarc::driver::sys::{CUdeviceptr, CUevent, CUevent_flags, CUstream};
use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;

/// Heuristic candidates timed per 16-bit GEMM (`top8`).
const CANDIDATES: usize = 8;
/// Timed runs per candidate (the fastest counts; `top8`).
const TIMED_RUNS: usize = 2;
/// Heuristic results asked for by the `wide` search (cuBLASLt returns what it has).
const WIDE_HEURISTIC: usize = 64;
/// Heuristic algorithms (the first distinct ones) the `wide` search also runs split-K.
const SPLIT_BASES: usize = 4;
/// The split-K counts tried on a small-output, long-K GEMM (`wide`).
const SPLITS: [u32; 7] = [2, 3, 4, 6, 8, 12, 16];
/// Fewest k values a split-K slice keeps: below that a slice's prologue outweighs its work.
const MIN_SPLIT_K: u64 = 256;
/// Screening runs per `wide` candidate after its warm-up (the fastest counts).
const SCREEN_RUNS: usize = 2;
/// `wide` candidates re-timed after screening, and their timed runs (the median counts).
const FINALISTS: usize = 3;
const FINAL_RUNS: usize = 5;
/// Most algorithms `enumerate` builds from cuBLASLt's ids, tiles and stages.
const ENUMERATED: usize = 256;
/// The GPU time a `wide` search aims to spend per GEMM: the candidates screened are cut to
/// what fits, judged by the first one's time, but never below [`CANDIDATES`].
const SEARCH_BUDGET_MS: f32 = 100.0;

/// How a 16-bit GEMM's algorithm is chosen on first use (the `gemm_search` kernel variant).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Search {
    /// The heuristic's first [`CANDIDATES`], each timed best of [`TIMED_RUNS`] after a warm-up.
    Top8,
    /// Up to [`WIDE_HEURISTIC`] heuristic results plus split-K variants of its first
    /// [`SPLIT_BASES`] on GEMMs whose k is at least twice m and n (backward-weight: a small
    /// output with fewer tiles than SMs, a long k), each checked by `cublasLtMatmulAlgoCheck`;
    /// screened on [`SCREEN_RUNS`] back-to-back runs within [`SEARCH_BUDGET_MS`], the
    /// [`FINALISTS`] fastest re-timed over [`FINAL_RUNS`] runs, the lowest median kept.
    Wide,
    /// `Wide`'s candidates, then up to [`ENUMERATED`] more built explicitly: every algorithm
    /// id cuBLASLt has for the types (`cublasLtMatmulAlgoGetIds`, `cublasLtMatmulAlgoInit`)
    /// with each tile it supports (a share of the total per id), split-K 1, each checked by
    /// `cublasLtMatmulAlgoCheck`; timed as `Wide` (the budget cuts the list on large GEMMs).
    Enumerate,
}

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

    fn key(&self, operands: Operands) -> PlanKey {
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
}

impl Operands {
    /// The kernel that rounds both fp32 operands of a GEMM into this type in one launch
    /// (`(const float* a, unsigned short* a16, long long na, const float* b, unsigned short*
    /// b16, long long nb)`); None for fp32, which cuBLASLt reads as stored.
    pub fn conversion_kernel(self) -> Option<&'static str> {
        match self {
            Operands::F32 => None,
            Operands::Bf16 => Some("f32_to_bf16_pair"),
            Operands::F16 => Some("f32_to_f16_pair"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Operands::F32 => "fp32",
            Operands::Bf16 => "bf16",
            Operands::F16 => "fp16",
        }
    }

    fn data_type(self) -> sys::cudaDataType_t {
        match self {
            Operands::F32 => sys::cudaDataType_t::CUDA_R_32F,
            Operands::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
            Operands::F16 => sys::cudaDataType_t::CUDA_R_16F,
        }
    }
}

/// What makes two GEMMs share a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
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
    fn describe(&self) -> String {
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
    /// The chosen algorithm's time in milliseconds and how many candidates were timed.
    timed_ms: Option<(f32, usize)>,
    /// How many of the candidates were split-K variants the search built (`wide`).
    split_variants: usize,
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
    /// How 16-bit GEMMs choose their algorithm.
    search: Search,
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
            search: Search::Top8,
            timer: None,
        })
    }

    /// Chooses 16-bit GEMMs' algorithms by `search` from now on: a change drops the plans made
    /// so far (they are remade, and their algorithms timed again, on next use).
    pub fn set_search(&mut self, search: Search) {
        if search != self.search {
            self.search = search;
            self.plans.clear();
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
    /// candidate algorithms, or the one timed fastest) or offers nothing for it.
    pub fn describe_plans(&self) -> Vec<String> {
        let mut lines: Vec<String> = self
            .plans
            .iter()
            .map(|(key, plan)| {
                let state = match (plan.algos.first(), plan.algos.len(), plan.timed_ms) {
                    (None, _, _) => "unsupported".to_string(),
                    (Some(algo), _, Some((ms, of))) => format!(
                        "timed, fastest of {of} ({} split-K built) {ms:.3} ms: {}",
                        plan.split_variants,
                        algo_summary(algo)
                    ),
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
            let (ms, best, timed) = match self.search {
                Search::Top8 => self.fastest(&key, g, d, stream)?,
                Search::Wide | Search::Enumerate => self.fastest_wide(&key, g, d, stream)?,
            };
            if let Some(plan) = self.plans.get_mut(&key) {
                plan.algos = vec![best];
                plan.timed_ms = Some((ms, timed));
                plan.settled = true;
            }
        }
        let plan = self.plans.get(&key).ok_or_else(|| {
            cublas_error(&format!("cuBLASLt plan for {}", key.describe()), "missing")
        })?;
        let algo = *plan.algos.first().ok_or_else(|| {
            cublas_error(
                &format!("cuBLASLt plan for {}", key.describe()),
                "no algorithm",
            )
        })?;
        if let Some((start, _, _)) = &self.timer {
            start.record(stream)?;
        }
        self.launch(plan, g, &algo, g.c, stream)
            .map_err(|e| cublas_error(&format!("cuBLASLt matmul for {}", key.describe()), e))?;
        if let Some((start, end, total)) = &mut self.timer {
            end.record(stream)?;
            *total += f64::from(start.until(end)?);
        }
        Ok(())
    }

    /// Times every candidate of `key`'s plan on `g`'s operands writing D at `d` (`top8`): the
    /// fastest, its milliseconds and how many candidates ran.
    fn fastest(
        &self,
        key: &PlanKey,
        g: &Gemm,
        d: CUdeviceptr,
        stream: CUstream,
    ) -> Result<(f32, sys::cublasLtMatmulAlgo_t, usize)> {
        let plan = self.plans.get(key).ok_or_else(|| {
            cublas_error(&format!("cuBLASLt plan for {}", key.describe()), "missing")
        })?;
        let (start, end) = (Event::new()?, Event::new()?);
        let mut best: Option<(f32, sys::cublasLtMatmulAlgo_t)> = None;
        let mut timed = 0;
        for algo in &plan.algos {
            // A candidate cuBLASLt refuses at launch is skipped (the heuristic offered it,
            // but the check runs only here).
            if self.launch(plan, g, algo, d, stream).is_err() {
                continue;
            }
            let mut fastest = f32::INFINITY;
            for _ in 0..TIMED_RUNS {
                start.record(stream)?;
                self.launch(plan, g, algo, d, stream).map_err(|e| {
                    cublas_error(&format!("timing cuBLASLt on {}", key.describe()), e)
                })?;
                end.record(stream)?;
                fastest = fastest.min(start.until(&end)?);
            }
            timed += 1;
            if best.is_none_or(|(ms, _)| fastest < ms) {
                best = Some((fastest, *algo));
            }
        }
        best.map(|(ms, algo)| (ms, algo, timed)).ok_or_else(|| {
            cublas_error(
                &format!("cuBLASLt matmul for {}", key.describe()),
                "every algorithm the heuristic offered failed to launch",
            )
        })
    }

    /// The `wide` search (see [`Search::Wide`]) over `key`'s candidates on `g`'s operands,
    /// writing D at `d`: the fastest, its median milliseconds and how many were screened.
    fn fastest_wide(
        &self,
        key: &PlanKey,
        g: &Gemm,
        d: CUdeviceptr,
        stream: CUstream,
    ) -> Result<(f32, sys::cublasLtMatmulAlgo_t, usize)> {
        let plan = self.plans.get(key).ok_or_else(|| {
            cublas_error(&format!("cuBLASLt plan for {}", key.describe()), "missing")
        })?;
        let events = (0..=FINAL_RUNS)
            .map(|_| Event::new())
            .collect::<Result<Vec<Event>>>()?;
        let mut limit = plan.algos.len();
        // (fastest screening run, candidate)
        let mut screened: Vec<(f32, usize)> = Vec::new();
        for (i, algo) in plan.algos.iter().enumerate() {
            if i >= limit {
                break;
            }
            // The warm-up; a candidate cuBLASLt refuses at launch is skipped.
            if self.launch(plan, g, algo, d, stream).is_err() {
                continue;
            }
            let times = self.time_runs(key, plan, g, algo, d, stream, &events[..=SCREEN_RUNS])?;
            let ms = times.iter().copied().fold(f32::INFINITY, f32::min);
            if screened.is_empty() {
                // The budget: each screened candidate costs 1 + SCREEN_RUNS runs, the
                // finalists FINALISTS · FINAL_RUNS more, all about as long as this first one.
                let runs = SEARCH_BUDGET_MS / ms.max(1e-3) - (FINALISTS * FINAL_RUNS) as f32;
                let fits = (runs / (1 + SCREEN_RUNS) as f32).max(0.0) as usize;
                limit = limit.min(fits.max(CANDIDATES));
            }
            screened.push((ms, i));
        }
        let screened_count = screened.len();
        screened.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut best: Option<(f32, usize)> = None;
        for &(_, i) in screened.iter().take(FINALISTS) {
            let mut times = self.time_runs(key, plan, g, &plan.algos[i], d, stream, &events)?;
            times.sort_by(f32::total_cmp);
            let median = times[times.len() / 2];
            if best.is_none_or(|(ms, _)| median < ms) {
                best = Some((median, i));
            }
        }
        best.map(|(ms, i)| (ms, plan.algos[i], screened_count))
            .ok_or_else(|| {
                cublas_error(
                    &format!("cuBLASLt matmul for {}", key.describe()),
                    "every candidate algorithm failed to launch",
                )
            })
    }

    /// Runs `algo` once between each pair of neighbouring `events`, back to back on the stream
    /// as in a step, and returns each run's milliseconds.
    #[allow(clippy::too_many_arguments)]
    fn time_runs(
        &self,
        key: &PlanKey,
        plan: &Plan,
        g: &Gemm,
        algo: &sys::cublasLtMatmulAlgo_t,
        d: CUdeviceptr,
        stream: CUstream,
        events: &[Event],
    ) -> Result<Vec<f32>> {
        let Some((first, rest)) = events.split_first() else {
            return Ok(Vec::new());
        };
        first.record(stream)?;
        for end in rest {
            self.launch(plan, g, algo, d, stream).map_err(|e| {
                cublas_error(
                    &format!(
                        "timing cuBLASLt algorithm {} on {}",
                        algo_summary(algo),
                        key.describe()
                    ),
                    e,
                )
            })?;
            end.record(stream)?;
        }
        events
            .windows(2)
            .map(|pair| pair[0].until(&pair[1]))
            .collect()
    }

    /// Queues `g` with `algo`, reading C at `g.c_in` (else `g.c`) and writing D at `d`.
    fn launch(
        &self,
        plan: &Plan,
        g: &Gemm,
        algo: &sys::cublasLtMatmulAlgo_t,
        d: CUdeviceptr,
        stream: CUstream,
    ) -> std::result::Result<(), result::CublasError> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        for (attr, ptr) in [
            (A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.epilogue.pointer()),
            (
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                g.epilogue.aux(),
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
        let f32_type = sys::cudaDataType_t::CUDA_R_32F;
        let ab_type = key.operands.data_type();
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
        let a = layout(ab_type, a_rows, a_cols, key.lda)?;
        let b = layout(ab_type, b_rows, b_cols, key.ldb)?;
        let c = layout(key.out.data_type(), key.m, key.n, key.ldc)?;
        let desc =
            result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32_type)
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
        use sys::cublasLtEpilogue_t as E;
        let bf16_type = sys::cudaDataType_t::CUDA_R_16BF;
        // The epilogue and the type of its vector (None: it has none).
        let epilogue = match key.epilogue {
            EpilogueKind::None => None,
            EpilogueKind::BiasF32 => Some((E::CUBLASLT_EPILOGUE_BIAS, Some(f32_type))),
            EpilogueKind::BiasBf16 => Some((E::CUBLASLT_EPILOGUE_BIAS, Some(bf16_type))),
            EpilogueKind::BiasGradB => Some((E::CUBLASLT_EPILOGUE_BGRADB, Some(f32_type))),
            EpilogueKind::GeluAux => Some((E::CUBLASLT_EPILOGUE_GELU_AUX, None)),
            EpilogueKind::GeluAuxBiasF32 => {
                Some((E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS, Some(f32_type)))
            }
            EpilogueKind::GeluAuxBiasBf16 => {
                Some((E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS, Some(bf16_type)))
            }
            EpilogueKind::DGelu => Some((E::CUBLASLT_EPILOGUE_DGELU, None)),
        };
        if let Some((epilogue, vector_type)) = epilogue {
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
                return Ok(Plan {
                    split_variants: 0,
                    settled: true,
                    timed_ms: None,
                    desc,
                    a,
                    b,
                    c,
                    algos: Vec::new(),
                });
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
        let wanted = match (key.operands, self.search) {
            (Operands::F32, _) => 1,
            (_, Search::Top8) => CANDIDATES,
            (_, Search::Wide | Search::Enumerate) => WIDE_HEURISTIC,
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
        let mut algos: Vec<sys::cublasLtMatmulAlgo_t> = match status {
            sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => found
                .iter()
                .take(count.max(0) as usize)
                .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|r| r.algo)
                .collect(),
            // No algorithm, or (with an epilogue) a combination cuBLASLt rejects: the caller
            // does the epilogue's work another way.
            sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => Vec::new(),
            _ if key.epilogue != EpilogueKind::None => Vec::new(),
            other => return Err(cublas_error(&what("algorithm search"), other)),
        };
        let mut split_variants = 0;
        if self.search != Search::Top8 && key.operands != Operands::F32 && !algos.is_empty() {
            // The split-K variants go after the heuristic's first CANDIDATES, so a budget
            // that cuts the list (a large GEMM) keeps what `top8` would time.
            let split = self.split_k_variants(key, (&desc, &a, &b, &c), &algos);
            split_variants = split.len();
            let tail = algos.split_off(algos.len().min(CANDIDATES));
            algos.extend(split);
            algos.extend(tail);
            if self.search == Search::Enumerate {
                let more = self.enumerated(key, (&desc, &a, &b, &c), &algos);
                algos.extend(more);
            }
        }
        Ok(Plan {
            split_variants,
            settled: algos.len() <= 1,
            timed_ms: None,
            desc,
            a,
            b,
            c,
            algos,
        })
    }
}

impl Blas {
    /// Split-K variants of the first [`SPLIT_BASES`] of `found` that support it, for a GEMM
    /// whose k is at least twice m and n (none otherwise): each count of [`SPLITS`] leaving at
    /// least [`MIN_SPLIT_K`] per slice, with the first reduction scheme the algorithm offers of
    /// fp32 workspace (`COMPUTE_TYPE`), in place and output type, that `cublasLtMatmulAlgoCheck`
    /// accepts within the workspace. A query cuBLASLt refuses drops that variant only: the
    /// search is an optimisation, and the heuristic's own candidates remain.
    fn split_k_variants(
        &self,
        key: &PlanKey,
        descs: Descriptors<'_>,
        found: &[sys::cublasLtMatmulAlgo_t],
    ) -> Vec<sys::cublasLtMatmulAlgo_t> {
        use sys::cublasLtMatmulAlgoCapAttributes_t as Cap;
        use sys::cublasLtMatmulAlgoConfigAttributes_t as Config;
        use sys::cublasLtReductionScheme_t as R;
        let mut variants = Vec::new();
        if key.k < 2 * key.m.max(key.n) {
            return variants;
        }
        let mut bases: Vec<sys::cublasLtMatmulAlgo_t> = Vec::new();
        for algo in found {
            if bases.len() == SPLIT_BASES {
                break;
            }
            // The same kernel with another split count is the same base.
            let mut base = *algo;
            if set_config(&mut base, Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 1).is_some()
                && !bases.contains(&base)
            {
                bases.push(base);
            }
        }
        for base in bases {
            if cap(&base, Cap::CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) != Some(1) {
                continue;
            }
            let mask = cap(&base, Cap::CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK).unwrap_or(0);
            let Some(scheme) = [
                R::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                R::CUBLASLT_REDUCTION_SCHEME_INPLACE,
                R::CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE,
            ]
            .into_iter()
            .find(|&s| mask & s as u32 != 0) else {
                continue;
            };
            for splits in SPLITS {
                if key.k / u64::from(splits) < MIN_SPLIT_K {
                    continue;
                }
                let mut algo = base;
                if set_config(&mut algo, Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, splits).is_none()
                    || set_config(
                        &mut algo,
                        Config::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                        scheme as u32,
                    )
                    .is_none()
                    || found.contains(&algo)
                    || variants.contains(&algo)
                {
                    continue;
                }
                if self.check(&algo, descs) {
                    variants.push(algo);
                }
            }
        }
        variants
    }
}

impl Blas {
    /// Whether `cublasLtMatmulAlgoCheck` accepts `algo` for the descriptors within the
    /// workspace.
    fn check(&self, algo: &sys::cublasLtMatmulAlgo_t, (desc, a, b, c): Descriptors<'_>) -> bool {
        // SAFETY: an all-zero heuristic result is a valid value of this C struct.
        let mut checked: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: every descriptor is live for the call; `algo` and `checked` are valid for
        // reads and writes of their types.
        let status = unsafe {
            sys::cublasLtMatmulAlgoCheck(
                self.handle,
                desc.0,
                a.0,
                b.0,
                c.0,
                c.0,
                algo,
                &mut checked,
            )
        };
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && checked.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && checked.workspaceSize <= self.workspace_size
    }

    /// Up to [`ENUMERATED`] algorithms for `key` built from cuBLASLt's ids for its types: per
    /// id its supported tiles, largest first, each with the stage count left to cuBLASLt or
    /// else the first one `check` accepts (split-K 1), that `found` lacks (see
    /// [`Search::Enumerate`]). None where cuBLASLt lists nothing.
    fn enumerated(
        &self,
        key: &PlanKey,
        descs: Descriptors<'_>,
        found: &[sys::cublasLtMatmulAlgo_t],
    ) -> Vec<sys::cublasLtMatmulAlgo_t> {
        use sys::cublasLtMatmulAlgoCapAttributes_t as Cap;
        use sys::cublasLtMatmulAlgoConfigAttributes_t as Config;
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let scale = sys::cudaDataType_t::CUDA_R_32F;
        let (ab, cd) = (key.operands.data_type(), key.out.data_type());
        let mut ids = vec![0i32; 256];
        let mut count: i32 = 0;
        // SAFETY: the handle is live; `ids` has room for the count asked for.
        let status = unsafe {
            sys::cublasLtMatmulAlgoGetIds(
                self.handle,
                compute,
                scale,
                ab,
                ab,
                cd,
                cd,
                ids.len() as i32,
                ids.as_mut_ptr(),
                &mut count,
            )
        };
        let mut out = Vec::new();
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return out;
        }
        ids.truncate(count.clamp(0, 256) as usize);
        // Spread over the ids: each keeps at most its share of ENUMERATED and makes at most
        // four checks per algorithm it may keep (a check costs microseconds of host time, and
        // most tile × stage pairs of an id do not fit the shape or epilogue).
        let share = (ENUMERATED / ids.len().max(1)).max(1);
        for id in ids {
            // SAFETY: an all-zero algorithm is a valid value of this plain C struct, which
            // AlgoInit overwrites.
            let mut base: sys::cublasLtMatmulAlgo_t = unsafe { std::mem::zeroed() };
            // SAFETY: the handle is live; `base` is writable.
            let status = unsafe {
                sys::cublasLtMatmulAlgoInit(
                    self.handle,
                    compute,
                    scale,
                    ab,
                    ab,
                    cd,
                    cd,
                    id,
                    &mut base,
                )
            };
            if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                continue;
            }
            let mut tiles = cap_list(&base, Cap::CUBLASLT_ALGO_CAP_TILE_IDS);
            // Largest tiles first (the ones a big GEMM wants; the share may cut the rest); an
            // id without a list takes the undefined (0) tile: its kernel decides.
            tiles.sort_by_key(|&t| std::cmp::Reverse(tile_area(t)));
            if tiles.is_empty() {
                tiles.push(0);
            }
            // Per tile the stage count is left to cuBLASLt (0) where it accepts that, else
            // the first supported count it accepts.
            let mut stages = cap_list(&base, Cap::CUBLASLT_ALGO_CAP_STAGES_IDS);
            stages.retain(|&s| s != 0);
            stages.insert(0, 0);
            let (mut kept, mut checks) = (0, 0);
            'tiles: for &tile in &tiles {
                for &stage in &stages {
                    if out.len() == ENUMERATED {
                        return out;
                    }
                    if kept == share || checks == 4 * share {
                        break 'tiles;
                    }
                    let mut algo = base;
                    if set_config(&mut algo, Config::CUBLASLT_ALGO_CONFIG_TILE_ID, tile).is_none()
                        || set_config(&mut algo, Config::CUBLASLT_ALGO_CONFIG_STAGES_ID, stage)
                            .is_none()
                    {
                        continue;
                    }
                    if found.contains(&algo) || out.contains(&algo) {
                        continue 'tiles;
                    }
                    checks += 1;
                    if self.check(&algo, descs) {
                        out.push(algo);
                        kept += 1;
                        continue 'tiles;
                    }
                }
            }
        }
        out
    }
}

/// A plan's matmul descriptor and its A, B and C/D layouts.
type Descriptors<'a> = (
    &'a Guard<sys::cublasLtMatmulDesc_t>,
    &'a Guard<sys::cublasLtMatrixLayout_t>,
    &'a Guard<sys::cublasLtMatrixLayout_t>,
    &'a Guard<sys::cublasLtMatrixLayout_t>,
);

/// A list-valued capability of `algo` (tile or stage ids, `uint32_t` each; empty where
/// cuBLASLt does not answer).
fn cap_list(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoCapAttributes_t,
) -> Vec<u32> {
    let mut bytes: usize = 0;
    // SAFETY: a null buffer of size 0 asks only for the size, written to `bytes`.
    let status = unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(algo, attr, std::ptr::null_mut(), 0, &mut bytes)
    };
    if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || bytes == 0 {
        return Vec::new();
    }
    let mut values = vec![0u32; bytes.div_ceil(size_of::<u32>())];
    let mut written: usize = 0;
    // SAFETY: `values` has room for `bytes` bytes.
    let status = unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(
            algo,
            attr,
            values.as_mut_ptr().cast(),
            values.len() * size_of::<u32>(),
            &mut written,
        )
    };
    if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Vec::new();
    }
    values.truncate(written / size_of::<u32>());
    values
}

/// A 4-byte capability of `algo` (None where cuBLASLt does not answer).
fn cap(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoCapAttributes_t,
) -> Option<u32> {
    let mut value: u32 = 0;
    let mut written: usize = 0;
    // SAFETY: `algo` is an initialised algorithm; `value` has room for the 4 bytes asked for.
    let status = unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(
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

/// A 4-byte configuration value of `algo` (None where cuBLASLt does not answer).
fn config(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
) -> Option<u32> {
    let mut value: u32 = 0;
    let mut written: usize = 0;
    // SAFETY: as in `cap`.
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

/// Sets a 4-byte configuration value of `algo` (the split count and reduction scheme are
/// `int32_t` / `uint32_t`); None where cuBLASLt refuses it.
fn set_config(
    algo: &mut sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
    value: u32,
) -> Option<()> {
    // SAFETY: `algo` is an initialised algorithm; `value` is 4 readable bytes.
    let status = unsafe {
        sys::cublasLtMatmulAlgoConfigSetAttribute(
            algo,
            attr,
            (&value as *const u32).cast(),
            size_of::<u32>(),
        )
    };
    (status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(())
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

/// A tile's m × n elements from its [`TILES`] name (0 for the undefined and unnamed ones).
fn tile_area(tile: u32) -> u32 {
    TILES
        .get(tile as usize)
        .and_then(|name| name.split_once('x'))
        .and_then(|(m, n)| Some(m.parse::<u32>().ok()? * n.parse::<u32>().ok()?))
        .unwrap_or(0)
}

/// `algo`'s configuration in a few words: id, tile, stages, split-K and its reduction
/// scheme, CTA swizzling, custom option (for plan listings; `?` where cuBLASLt does not say).
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
