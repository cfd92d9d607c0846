//! A GEMM's SwiGLU epilogue with the FP8 quantizations of what it writes, in one pass
//! (`parc_compiler::ir::swiglu_runs`; `swiglu_fwd_fp8` and `swiglu_bwd_fp8` in
//! `kernels/fp8.cu`). At `prepare` the runs of the program are found; when the GEMM that heads
//! one runs its epilogue (`epilogue::swiglu_apart` or `swiglu_grad`), the kernel computes the
//! gated product (or dgate and dup), stores it, quantizes the stored values into each member's
//! layouts with its scale amax and max-adds the records that ride on them, and the members'
//! instructions then do nothing. The bytes are those the members make alone (the CPU backend
//! runs them so; the GPU tests compare). Where a run cannot take the fused pass (storage types
//! that differ, columns not a multiple of 8, unaligned or missing buffers), the epilogue runs
//! alone and the members run as instructions of their own.
//!
//! Measured (H100, Llama 3.2 1B at 8 × 2048, delayed FP8; bench/RESULTS.md, session 48): the
//! quantize ops' time fell from 18.8 to 10.0 ms a step, but the epilogues' grew by 9.6 ms with
//! every load of a 64-row tile issued first (108-128 registers, 2 blocks an SM: the arithmetic
//! of the sigmoid, the bf16 rounding and four FP8 packings an element was not hidden); loading
//! each pass in turn (63-71 registers, 3 blocks) ran 0.5% faster end to end than the ops apart,
//! in two pairs of runs.
use super::args::fv;
use super::fp8::{amax_roles, any_history_empty};
use super::kernel::Kernel;
use super::variants::SwigluFp8StoreKernel;
use super::{Arg, Buf, CudaBackend, FloatArg};
use crate::error::Result;
use cudarc::driver::sys::CUdeviceptr;
use parc_compiler::ir::fp8::Fp8Format;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::swiglu_runs::{find_swiglu_runs, quantized_readers};
use parc_compiler::ir::{BufferId, DType, Program};
use std::collections::HashMap;

/// Threads of a block and the rows and columns of a tile (`kernels/fp8.cu`).
const THREADS: u32 = 256;
const TILE_ROWS: u64 = 64;
const TILE_COLS: u64 = 128;

/// The runs of the prepared program, by their GEMM's instruction.
#[derive(Default)]
pub(super) struct SwigluRuns {
    enabled: bool,
    by_producer: HashMap<usize, PreparedRun>,
    /// The members of the run whose fused pass ran last: they do nothing.
    absorbed: Vec<usize>,
    /// Fused passes launched so far (for tests).
    launched: u64,
    /// Epilogue outputs the fused passes left unstored so far (for tests).
    unstored: u64,
    /// Set while every output must hold its value once its instruction returns (a check
    /// reads each back: `Backend::check_outputs`).
    checking: bool,
}

/// One member quantization: the epilogue output it reads, its scale amax, format, layouts,
/// the history a record riding on it adds into, and x's columns.
#[derive(Clone, Copy, Debug)]
struct Member {
    x: BufferId,
    amax: BufferId,
    format: Fp8Format,
    q: Option<BufferId>,
    qt: Option<BufferId>,
    history: Option<BufferId>,
    cols: u64,
}

#[derive(Clone, Debug)]
struct PreparedRun {
    members: Vec<Member>,
    /// The instructions the fused pass makes (records and quantizations).
    instructions: Vec<usize>,
    /// Per epilogue output (in order): the scale amaxes of the delayed-scaling GEMMs that read
    /// it besides the run, where only quantized GEMMs do (`quantized_readers`), else None. The
    /// output need not be stored on a step where every one of those amaxes is non-zero: each
    /// GEMM then reads only its quantization.
    readers_amaxes: Vec<Option<Vec<BufferId>>>,
}

/// One member's quantization as the kernel takes it (all null: not quantized).
#[derive(Clone, Copy, Default)]
struct Dest {
    amax: CUdeviceptr,
    maxv: f32,
    e5m2: bool,
    q: CUdeviceptr,
    qt: CUdeviceptr,
    record: CUdeviceptr,
}

impl SwigluRuns {
    /// On by default; `false` runs every member alone (to compare).
    pub(super) fn new(enabled: bool) -> SwigluRuns {
        SwigluRuns {
            enabled,
            ..SwigluRuns::default()
        }
    }

    /// Finds the runs of `program`.
    pub(super) fn prepare(&mut self, program: &Program) {
        self.by_producer.clear();
        self.absorbed.clear();
        if !self.enabled {
            return;
        }
        for run in find_swiglu_runs(program) {
            let member = |at: usize| -> Option<Member> {
                let c = program.instrs.get(at)?.as_compute()?;
                let Op::Fp8Quantize(a) = *c.op else {
                    return None;
                };
                let mut outputs = c.outputs.iter().copied();
                let q = a.direct.then(|| outputs.next()).flatten();
                let qt = a.transposed.then(|| outputs.next()).flatten();
                let x = *c.inputs.first()?;
                let history = (run.records.iter())
                    .filter_map(|&r| program.instrs.get(r)?.as_compute())
                    .find(|r| r.inputs.first() == Some(&x))
                    .and_then(|r| r.outputs.first().copied());
                Some(Member {
                    x,
                    amax: *c.inputs.get(1)?,
                    format: a.format,
                    q,
                    qt,
                    history,
                    cols: a.cols,
                })
            };
            let Some(members) = run.quantizes.iter().map(|&q| member(q)).collect() else {
                continue;
            };
            let instructions = run.instructions()[1..].to_vec();
            let readers_amaxes = (quantized_readers(program, &run).into_iter())
                .map(|gemms| gemms.and_then(|g| delayed_amaxes(program, &g)))
                .collect();
            self.by_producer.insert(
                run.producer,
                PreparedRun {
                    members,
                    instructions,
                    readers_amaxes,
                },
            );
        }
    }

    /// Whether instruction `index` was made by the last fused pass.
    pub(super) fn absorbed(&self, index: usize) -> bool {
        self.absorbed.contains(&index)
    }
}

impl CudaBackend {
    /// `false`: run SwiGLU epilogues and the quantizations of what they write apart (to
    /// compare). Takes effect at `prepare`.
    pub fn with_fused_swiglu_fp8(mut self, fused: bool) -> CudaBackend {
        self.swiglu_runs = SwigluRuns::new(fused);
        self
    }

    /// How many fused SwiGLU-and-quantize passes have run (for tests).
    pub fn fused_swiglu_fp8_passes(&self) -> u64 {
        self.swiglu_runs.launched
    }

    /// How many epilogue outputs fused passes have left unstored (for tests).
    pub fn unstored_swiglu_outputs(&self) -> u64 {
        self.swiglu_runs.unstored
    }

    /// While `on`, every epilogue output is stored (`Backend::check_outputs`).
    pub(super) fn check_swiglu_outputs(&mut self, on: bool) {
        self.swiglu_runs.checking = on;
    }

    /// The forward epilogue a = silu(gate) ⊙ up with its run's quantizations, if the
    /// instruction running now heads a run that can take the fused pass. False: the caller
    /// runs the epilogue alone (and the members run themselves).
    pub(super) fn swiglu_fp8_forward(&mut self, gate: Buf, up: Buf, a: Buf) -> Result<bool> {
        let Some((run, dests, stored)) = self.fused_dests(&[a], &[gate, up])? else {
            return Ok(false);
        };
        let [d, _] = dests;
        let mut args = vec![fv(gate), fv(up), output_arg(a, stored[0])];
        args.extend(run.args());
        args.extend(d.args());
        self.launch_swiglu_fp8(Kernel::SwigluFwdFp8, run, &args)?;
        Ok(true)
    }

    /// The backward epilogue (dgate and dup from the product `dy`, which may be dgate) with its
    /// run's quantizations, as [`CudaBackend::swiglu_fp8_forward`].
    pub(super) fn swiglu_fp8_backward(
        &mut self,
        dy: Buf,
        (gate, up): (Buf, Buf),
        (dgate, dup): (Buf, Buf),
    ) -> Result<bool> {
        let Some((run, [g, u], stored)) = self.fused_dests(&[dgate, dup], &[dy, gate, up])? else {
            return Ok(false);
        };
        let (dg, du) = (output_arg(dgate, stored[0]), output_arg(dup, stored[1]));
        let mut args = vec![fv(dy), fv(gate), fv(up), dg, du];
        args.extend(run.args());
        args.extend(g.args());
        args.extend(u.args());
        self.launch_swiglu_fp8(Kernel::SwigluBwdFp8, run, &args)?;
        Ok(true)
    }

    fn launch_swiglu_fp8(&mut self, kernel: Kernel, run: Shape, args: &[Arg]) -> Result<()> {
        let tiles = run.rows.div_ceil(TILE_ROWS) * run.cols.div_ceil(TILE_COLS);
        let blocks = tiles.min(i32::MAX as u64) as u32;
        self.launch(kernel, (blocks, 1, 1), (THREADS, 1, 1), 0, args)?;
        self.swiglu_runs.launched += 1;
        Ok(())
    }

    /// For the run the instruction running now heads, where `outputs` are its epilogue's
    /// outputs in order and `inputs` what the epilogue reads: the shape, each output's
    /// quantization and whether to store it ([`Self::stored`]), once every member's buffers
    /// check; the members are then absorbed. None where the instruction heads no run or the run
    /// cannot take the fused pass.
    fn fused_dests(&mut self, outputs: &[Buf], inputs: &[Buf]) -> Result<Option<FusedPass>> {
        self.swiglu_runs.absorbed.clear();
        let current = self.records.current();
        let Some(run) = self.swiglu_runs.by_producer.get(&current).cloned() else {
            return Ok(None);
        };
        let Some(shape) = fusable_shape(outputs, inputs, &run.members) else {
            return Ok(None);
        };
        let mut dests = [Dest::default(); 2];
        for m in &run.members {
            let Some(slot) = outputs.iter().position(|o| o.id == m.x) else {
                return Ok(None);
            };
            let Some(d) = self.dest(m, outputs[slot].len) else {
                return Ok(None);
            };
            dests[slot] = d;
        }
        let touched: Vec<BufferId> = (run.members.iter())
            .flat_map(|m| [Some(m.amax), m.q, m.qt, m.history])
            .flatten()
            .collect();
        self.order_after_comm(touched.iter().copied())?;
        let mut stored = [true; 2];
        for (k, amaxes) in run.readers_amaxes.iter().enumerate().take(2) {
            stored[k] = self.stored(amaxes.as_deref())?;
        }
        self.swiglu_runs.unstored += stored.iter().filter(|&&s| !s).count() as u64;
        self.records
            .count_taken(run.members.iter().filter(|m| m.history.is_some()).count());
        self.swiglu_runs.absorbed = run.instructions;
        Ok(Some((shape, dests, stored)))
    }

    /// Whether a fused pass stores an epilogue output whose readers besides its run are the
    /// delayed-scaling GEMMs of scale amaxes `amaxes` (None: anything else reads it). Unstored
    /// only under the `needed` variant, outside a check of every output, where every amax is
    /// non-zero: no reader runs cold (`fp8::delayed_cold`'s test), so each reads only the
    /// quantization.
    fn stored(&mut self, amaxes: Option<&[BufferId]>) -> Result<bool> {
        let Some(amaxes) = amaxes else {
            return Ok(true);
        };
        if self.swiglu_runs.checking
            || self.variants.swiglu_fp8_store == SwigluFp8StoreKernel::Always
        {
            return Ok(true);
        }
        let amaxes = (amaxes.iter())
            .map(|&id| self.buf(id))
            .collect::<Result<Vec<Buf>>>()?;
        any_history_empty(self, amaxes)
    }

    /// Member `m`'s device pointers, each buffer allocated and of its kind (an FP8 layout of
    /// `len` elements, aligned for the kernel's 8-byte stores; a one-element f32 amax; an f32
    /// history). None otherwise.
    fn dest(&self, m: &Member, len: usize) -> Option<Dest> {
        let layout = |id: Option<BufferId>| -> Option<CUdeviceptr> {
            let Some(id) = id else { return Some(0) };
            let b = self.buf(id).ok()?;
            (b.dtype == DType::Fp8(m.format) && b.len == len && b.ptr % 8 == 0).then_some(b.ptr)
        };
        let amax = self
            .buf(m.amax)
            .ok()
            .filter(|b| b.dtype == DType::F32 && b.len >= 1)?;
        let record = match m.history {
            Some(h) => {
                let b = self
                    .buf(h)
                    .ok()
                    .filter(|b| b.dtype == DType::F32 && b.len >= 1)?;
                b.ptr
            }
            None => 0,
        };
        Some(Dest {
            amax: amax.ptr,
            maxv: m.format.max(),
            e5m2: m.format == Fp8Format::E5m2,
            q: layout(m.q)?,
            qt: layout(m.qt)?,
            record,
        })
    }
}

/// The scale amaxes of the delayed-scaling FP8 GEMMs at instructions `gemms` (each one's
/// operands' amax inputs, as `fp8::delayed_cold` reads them). None where one is not such a GEMM.
fn delayed_amaxes(program: &Program, gemms: &[usize]) -> Option<Vec<BufferId>> {
    let mut amaxes = Vec::new();
    for &g in gemms {
        let c = program.instrs.get(g)?.as_compute()?;
        c.op.fp8()?.history?;
        let roles = c.op.signature().inputs;
        for role in amax_roles(c.op) {
            let at = roles.iter().position(|o| o.role == role)?;
            amaxes.push(*c.inputs.get(at)?);
        }
    }
    Some(amaxes)
}

/// Epilogue output `b` as the kernels' argument: a null pointer where it is not stored.
fn output_arg(b: Buf, stored: bool) -> Arg {
    if stored {
        fv(b)
    } else {
        Arg::Float(FloatArg::unstored(b))
    }
}

/// A fused pass as [`CudaBackend::fused_dests`] sets it up: its shape, each output's
/// quantization and whether to store it.
type FusedPass = (Shape, [Dest; 2], [bool; 2]);

/// The rows and columns an epilogue's outputs are quantized as.
#[derive(Clone, Copy, Debug)]
struct Shape {
    rows: u64,
    cols: u64,
}

impl Shape {
    /// The kernels' `rows, cols` arguments.
    fn args(self) -> [Arg; 2] {
        [Arg::I64(self.rows as i64), Arg::I64(self.cols as i64)]
    }
}

impl Dest {
    /// The kernels' arguments of one output's quantization: `amax, maxv, e5m2, q, qt, record`.
    fn args(self) -> [Arg; 6] {
        [
            Arg::Ptr(self.amax),
            Arg::F32(self.maxv),
            Arg::I32(i32::from(self.e5m2)),
            Arg::Ptr(self.q),
            Arg::Ptr(self.qt),
            Arg::Ptr(self.record),
        ]
    }
}

/// The shape of a run whose epilogue reads `inputs` and writes `outputs` (all of one length
/// and one storage type, f32 or bf16, 16-byte aligned), quantized by `members` at one number of
/// columns, a multiple of 8. None where the fused pass cannot take them.
fn fusable_shape(outputs: &[Buf], inputs: &[Buf], members: &[Member]) -> Option<Shape> {
    let first = outputs.first()?;
    let cols = members.first()?.cols;
    let all = outputs.iter().chain(inputs);
    let alike = all
        .clone()
        .all(|b| b.len == first.len && b.dtype == first.dtype && b.ptr % 16 == 0);
    let storage = matches!(first.dtype, DType::F32 | DType::Bf16);
    let columns = cols > 0 && cols.is_multiple_of(8) && members.iter().all(|m| m.cols == cols);
    let whole = columns && (first.len as u64).is_multiple_of(cols);
    (alike && storage && whole).then(|| Shape {
        rows: first.len as u64 / cols,
        cols,
    })
}
