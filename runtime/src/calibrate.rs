//! `parc calibrate`'s measurements: each table of a calibration profile
//! (`parc_compiler::timeline::profile`) timed through the [`Backend`] trait on the ops the
//! lowering emits (`Matmul`, `MatmulBwdData`, `MatmulBwdWeight`, `Attention`, `AttentionBwd`,
//! `Add`, `LayerNorm`(`Bwd`), `CrossEntropy`, `AdamW`, `Embedding`(`Bwd`) with the attributes a
//! model gives them), so what is measured is what a step runs.
//!
//! Each point allocates its op's buffers from the op's signature (the op table), fills the
//! inputs with standard normal values, signs and exponents spread as a step's activations and
//! gradients are (the same GEMM on values of one sign and exponent, in [0.5, 1), ran 9% faster
//! on an H100: fewer bits toggle, so it draws less power and keeps higher clocks; priced by it
//! the steps measured 4–11% slower than predicted, by normal values 0–7%, 2026-12-05);
//! attention's backward gets the forward's output and log-sum-exp. It runs the op once to warm
//! up, then takes the median of
//! `reps` samples, each the mean of enough back-to-back runs to last about a millisecond
//! between [`Backend::synchronize`] calls, and frees the buffers. The GEMM table fills one
//! shape's inputs once for all its epilogue variants (filling, not timing, is most of its time).
//! The optimizer is also timed as a step runs it ([`runs`]): runs of AdamW updates and of sums
//! of squares over a model's parameter list, which the CUDA backend launches as one.
use crate::backend::{Backend, StepScalars};
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::fp8::{Fp8Format, Fp8Gemm, Fp8Scaling};
use parc_compiler::ir::op::{Act, AttentionAttrs, EmbeddingAttrs, Op, Segment};
use parc_compiler::ir::storage::StorageClass;
use parc_compiler::ir::table::{Operand, Rows, Write};
use parc_compiler::ir::{BufferId, DType};
use parc_compiler::spec::{Gpu, Precision};
use parc_compiler::timeline::profile::{
    precision_name, AttentionPoint, GemmDtype, GemmEpilogue, GemmLayout, GemmPoint, MemoryKind,
    MemoryPoint, Pass, Profile, VERSION,
};
use std::collections::HashMap;
use std::time::Instant;

mod runs;

/// What to measure on.
pub struct Settings {
    /// The small grid (seconds on a CPU) instead of the full one.
    pub quick: bool,
    pub precision: Precision,
    /// The spec's `cluster.gpu` this device is (the catalogue's entry).
    pub gpu: Gpu,
    /// The device as people know it (`NVIDIA H200`, `cpu (16 threads)`).
    pub device: String,
    /// Today's date, `YYYY-MM-DD`.
    pub date: String,
    /// The FP8 scalings whose GEMMs are measured too (bf16 runs only), each over the GEMM grid
    /// with its quantization.
    pub fp8: Vec<Fp8Scaling>,
}

/// The sizes measured.
struct Grid {
    gemm_m: &'static [u64],
    gemm_nk: &'static [u64],
    /// Largest n·k (the weight's elements) measured.
    gemm_max_weight: u64,
    /// Largest m·n and m·k (an activation's elements) measured: the largest GEMMs a step runs
    /// take a few milliseconds, so larger ones teach nothing and take seconds to fill.
    gemm_max_activation: u64,
    /// (batch, heads, kv heads, seq, head dim).
    attention: Vec<[u64; 5]>,
    /// Elements of the memory-bound ops' main operand.
    memory_elements: Vec<u64>,
    /// Row widths, each measured (an op's speed changes with it: a row that fits in shared
    /// memory or not): norms' dims, cross-entropy's vocabularies; the embedding's dim and
    /// vocabulary.
    norm_dims: &'static [u64],
    vocabs: &'static [u64],
    embed: (u64, u64),
    reps: usize,
}

fn grid(quick: bool) -> Grid {
    if quick {
        return Grid {
            gemm_m: &[64, 512],
            gemm_nk: &[64, 256, 1024],
            gemm_max_weight: 1 << 20,
            gemm_max_activation: 1 << 20,
            attention: [32, 128].map(|seq| [2, 4, 4, seq, 16]).to_vec(),
            memory_elements: vec![1 << 10, 1 << 14, 1 << 18],
            norm_dims: &[256],
            vocabs: &[256],
            embed: (256, 64),
            reps: 3,
        };
    }
    let mut attention = Vec::new();
    // 4096 and 16384 tokens a call at each length: a step's batch·heads ranges widely (Llama
    // 3.2 1B: 64 at micro batch 2, 256 at 8), and a GPU half-filled runs slower per FLOP.
    for seq in [512, 1024, 2048, 4096, 8192] {
        for head_dim in [64, 128] {
            for (heads, kv_heads) in [(16, 16), (32, 8)] {
                for tokens in [4096, 16384] {
                    attention.push([(tokens / seq).max(1), heads, kv_heads, seq, head_dim]);
                }
            }
        }
    }
    Grid {
        // Rows: every power of four, and 4096 and 16384, the rows of most steps' micro batches
        // (2 × 2048, 8 × 2048, 16 × 1024), where GEMM speed is not monotonic in the rows: on an
        // H100 a GELU-gradient GEMM at 16384 rows ran 22% under its price interpolated between
        // 8192 and 32768 while its 8192 point ran 15% over (2026-12-05).
        gemm_m: &[512, 2048, 4096, 8192, 16384, 32768],
        gemm_nk: &[256, 1024, 4096, 16384, 65536],
        gemm_max_weight: 1 << 28,
        gemm_max_activation: 1 << 28,
        attention,
        memory_elements: (12..=28).step_by(2).map(|b| 1u64 << b).collect(),
        norm_dims: &[1024, 4096],
        vocabs: &[32768, 131072],
        embed: (32768, 1024),
        reps: 10,
    }
}

/// Measure every table on `backend`; `progress` hears what is being measured.
pub fn calibrate(
    backend: &mut dyn Backend,
    settings: &Settings,
    progress: &mut dyn FnMut(&str),
) -> Result<Profile> {
    let grid = grid(settings.quick);
    let mut bench = Bench::new(backend, settings, &grid);
    progress("measuring launch overhead");
    let overhead = bench.time(&Op::Scale { factor: 0.5 }, 1, 1)?.0;
    let started = Instant::now();
    progress("measuring gemm");
    let (gemm, gemm_note) = bench.gemms(&grid)?;
    progress(&table_done("gemm", gemm.len(), &started));
    progress("measuring attention");
    let attention = bench.attention(&grid)?;
    progress(&table_done("attention", attention.len(), &started));
    progress("measuring memory-bound ops");
    let memory = bench.memory(&grid)?;
    progress(&table_done("memory-bound ops", memory.len(), &started));
    // FP8 after the bf16 tables: a scaling the backend fails on is left out with a note, and
    // cannot cost the tables measured before it.
    let mut notes =
        vec!["collectives not measured: the timeline prices them with the spec's links".into()];
    notes.extend(gemm_note);
    let mut gemm = gemm;
    let (fp8, fp8_notes) = bench.fp8_tables(&grid, settings, &started, progress);
    gemm.extend(fp8);
    notes.extend(fp8_notes);
    // The optimizer runs after every other table: they give the backend a memory plan, and a
    // planned backend runs its GEMMs otherwise (CUDA: the plan's casts and scratch). After the
    // single-op points: an op without points of its own is priced by its kind's first op.
    let mut memory = memory;
    // A failure leaves them out with a note, as FP8's do.
    progress("measuring optimizer runs (multi-tensor AdamW, sums of squares)");
    match bench.optimizer_runs(&grid) {
        Ok(runs) => {
            progress(&table_done("optimizer runs", runs.len(), &started));
            memory.extend(runs);
        }
        Err(e) => notes.push(format!(
            "optimizer runs (adam_w_multi, sum_squares_multi) not measured, the backend failed \
             on them: {e}; the timeline prices a run by its op's points at its summed bytes"
        )),
    }
    let peak_flops = settings.gpu.peak_for(settings.precision);
    Ok(Profile {
        version: VERSION,
        gpu: settings.gpu.name.clone(),
        device: settings.device.clone(),
        backend: bench.backend.name().to_string(),
        precision: precision_name(settings.precision).to_string(),
        date: settings.date.clone(),
        parc_version: env!("CARGO_PKG_VERSION").to_string(),
        peak_flops,
        memory_bandwidth: settings.gpu.memory_bandwidth,
        launch_overhead_s: overhead,
        gemm,
        attention,
        memory,
        collectives: Vec::new(),
        notes,
    })
}

/// Only the FP8 GEMM tables of `settings.fp8` (bf16 runs; none otherwise) and their notes, for
/// adding to a profile measured before (`parc calibrate --add-to`).
pub fn calibrate_fp8(
    backend: &mut dyn Backend,
    settings: &Settings,
    progress: &mut dyn FnMut(&str),
) -> (Vec<GemmPoint>, Vec<String>) {
    let grid = grid(settings.quick);
    let mut bench = Bench::new(backend, settings, &grid);
    bench.fp8_tables(&grid, settings, &Instant::now(), progress)
}

/// A progress line: a table's points measured, and the seconds since the first table began.
fn table_done(table: &str, points: usize, started: &Instant) -> String {
    let seconds = started.elapsed().as_secs_f64();
    format!("{table}: {points} points measured ({seconds:.1} s so far)")
}

/// Times ops on one backend.
struct Bench<'a> {
    backend: &'a mut dyn Backend,
    /// Activations stored in bf16 (a bf16 or fp16 run).
    half: bool,
    reps: usize,
    /// The next buffer id.
    next: u32,
    /// The values inputs are filled with, grown to the largest input so far (generating
    /// gigabytes of them per point would take longer than timing the op).
    pattern: Vec<f32>,
    /// Inputs kept filled across the ops timed on them, by role, shape and dtype (one GEMM shape's
    /// epilogue variants read the same x, W and dy: filling them once saves most of the GEMM
    /// table's time); `None` outside such a run.
    shared: Option<HashMap<SharedKey, (BufferId, f64)>>,
}

/// A shared input: its operand's role, its shape and dtype.
type SharedKey = (&'static str, Vec<u64>, DType);

const SCALARS: StepScalars = StepScalars {
    lr: 1e-4,
    step: 1,
    loss_scale: None,
};

/// About this long between synchronizations per sample.
const SAMPLE_SECONDS: f64 = 1e-3;

impl<'a> Bench<'a> {
    /// A bench on `backend` for `settings`' precision, with `grid`'s samples per point.
    fn new(backend: &'a mut dyn Backend, settings: &Settings, grid: &Grid) -> Bench<'a> {
        Bench {
            backend,
            half: settings.precision != Precision::Fp32,
            reps: grid.reps,
            next: 0,
            pattern: Vec::new(),
            shared: None,
        }
    }

    /// The GEMM grid's points, each shape with every epilogue, and a note naming the epilogue
    /// points the backend failed on (left out: the nearest measured epilogue prices them); a
    /// plain GEMM that fails fails the profile.
    fn gemms(&mut self, grid: &Grid) -> Result<(Vec<GemmPoint>, Option<String>)> {
        let dtype = GemmDtype::storage(self.half);
        let mut points = Vec::new();
        let mut failed = Vec::new();
        for [m, n, k] in gemm_shapes(grid) {
            self.shared = Some(HashMap::new());
            for (layout, epilogue, op) in gemm_ops(n, k, true) {
                let seconds = match self.time(&op, m, m) {
                    Ok((seconds, _)) => seconds,
                    Err(e) if epilogue != GemmEpilogue::PLAIN => {
                        failed.push(format!("{layout:?} {epilogue:?} {m}×{n}×{k} ({e})"));
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                points.push(GemmPoint {
                    layout,
                    m,
                    n,
                    k,
                    dtype: dtype.name(),
                    accumulate: epilogue.accumulate,
                    bias: epilogue.bias,
                    act: epilogue.act,
                    seconds,
                });
            }
            self.free_shared()?;
        }
        let note = failed.first().map(|first| {
            format!(
                "{} GEMM points with an epilogue not measured, the backend failed on them (the \
                 nearest measured epilogue prices them); the first: {first}",
                failed.len()
            )
        });
        Ok((points, note))
    }

    /// The FP8 GEMM points of every scaling of `settings.fp8` (bf16 runs only) and the notes
    /// of those it could not measure.
    fn fp8_tables(
        &mut self,
        grid: &Grid,
        settings: &Settings,
        started: &Instant,
        progress: &mut dyn FnMut(&str),
    ) -> (Vec<GemmPoint>, Vec<String>) {
        let (mut gemm, mut notes) = (Vec::new(), Vec::new());
        let fp8: &[Fp8Scaling] = if self.half { &settings.fp8 } else { &[] };
        for &scaling in fp8 {
            progress(&format!("measuring fp8 {} gemm", scaling.name()));
            let (points, skipped) = self.fp8_gemms(grid, scaling);
            notes.extend(skipped);
            progress(&table_done(
                &GemmDtype::Fp8(scaling).name(),
                points.len(),
                started,
            ));
            gemm.extend(points);
        }
        (gemm, notes)
    }

    /// The GEMM grid's points in FP8 under `scaling` (bf16 activations quantized by the op),
    /// and a note naming the points the backend refused (`Unsupported`: a shape its FP8 GEMMs
    /// do not take), which are left out; any other error ends the scaling's points there, with
    /// a note saying why, rather than failing the profile.
    fn fp8_gemms(&mut self, grid: &Grid, scaling: Fp8Scaling) -> (Vec<GemmPoint>, Option<String>) {
        let attr = Fp8Gemm::current(scaling, Fp8Format::E4m3);
        let dtype = GemmDtype::Fp8(scaling).name();
        let (mut points, mut refused) = (Vec::new(), Vec::new());
        for [m, n, k] in gemm_shapes(grid) {
            for (layout, _, op) in gemm_ops(n, k, false) {
                match self.time(&op.with_fp8(Some(attr)), m, m) {
                    Ok((seconds, _)) => points.push(GemmPoint {
                        layout,
                        m,
                        n,
                        k,
                        dtype: dtype.clone(),
                        accumulate: false,
                        bias: false,
                        act: false,
                        seconds,
                    }),
                    Err(RuntimeError::Unsupported(why)) => {
                        refused.push(format!("{layout:?} {m}×{n}×{k} ({why})"))
                    }
                    Err(e) => {
                        let note = format!(
                            "{dtype}: measuring stopped at {layout:?} {m}×{n}×{k}, {} points in: {e}",
                            points.len()
                        );
                        return (points, Some(note));
                    }
                }
            }
        }
        let note = (!refused.is_empty()).then(|| {
            format!(
                "{dtype}: {} of the grid's GEMMs not measured, the backend refused them: {}",
                refused.len(),
                refused.join("; ")
            )
        });
        (points, note)
    }

    fn attention(&mut self, grid: &Grid) -> Result<Vec<AttentionPoint>> {
        let mut points = Vec::new();
        for &[batch, heads, kv_heads, seq, head_dim] in &grid.attention {
            // The lowering packs q, k and v into one input without rope and context
            // parallelism (GPT-2), and passes them apart otherwise (Llama).
            for packed in [true, false] {
                let attrs = attention_attrs([batch, heads, kv_heads, seq, head_dim], packed);
                let rows = seq * batch;
                for pass in [Pass::Fwd, Pass::Bwd] {
                    let op = match pass {
                        Pass::Fwd => Op::Attention(attrs.clone()),
                        Pass::Bwd => Op::AttentionBwd(attrs.clone()),
                    };
                    let seconds = self.time(&op, rows, rows)?.0;
                    points.push(AttentionPoint {
                        pass,
                        batch_heads: batch * heads,
                        group: heads / kv_heads,
                        seq,
                        head_dim,
                        causal: true,
                        packed,
                        seconds,
                    });
                }
            }
        }
        Ok(points)
    }

    fn memory(&mut self, grid: &Grid) -> Result<Vec<MemoryPoint>> {
        let mut points = Vec::new();
        for &elements in &grid.memory_elements {
            for (kind, op, width) in memory_ops(grid) {
                let rows = (elements / width).max(1);
                let (seconds, bytes) = self.time(&op, rows, rows)?;
                points.push(MemoryPoint {
                    kind,
                    bytes,
                    op: Some(op.opcode().name().to_string()),
                    cols: (width > 1).then_some(width),
                    seconds,
                });
            }
        }
        Ok(points)
    }

    /// The median seconds of `op` over `rows` (and `kv_rows` key/value rows), and the bytes
    /// it touches as the timeline counts them.
    fn time(&mut self, op: &Op, rows: u64, kv_rows: u64) -> Result<(f64, f64)> {
        let signature = op.signature();
        let n = signature.rows.unwrap_or(rows);
        let m = signature.kv_rows.unwrap_or(kv_rows);
        let mut allocated = Vec::new();
        let result = self.time_allocated(op, n, m, &mut allocated);
        for id in allocated {
            self.backend.free(id)?;
        }
        result
    }

    fn time_allocated(
        &mut self,
        op: &Op,
        n: u64,
        m: u64,
        allocated: &mut Vec<BufferId>,
    ) -> Result<(f64, f64)> {
        let signature = op.signature();
        let mut inputs = Vec::new();
        let mut input_bytes = Vec::new();
        for operand in signature.inputs.iter() {
            let (id, bytes) = self.input(operand, n, m, allocated)?;
            inputs.push(id);
            input_bytes.push(bytes);
        }
        let mut outputs = Vec::new();
        let mut output_bytes = Vec::new();
        for operand in signature.outputs.iter() {
            if let Write::InPlace(i) = operand.write {
                outputs.push(inputs[i]);
                output_bytes.push(input_bytes[i]);
                continue;
            }
            let (id, bytes) = self.alloc(operand, n, m)?;
            allocated.push(id);
            outputs.push(id);
            output_bytes.push(bytes);
        }
        if let Op::AttentionBwd(a) = op {
            self.run_forward(a, &inputs)?;
        }
        let touched = signature.bytes_touched(n, |i| input_bytes[i], |i| output_bytes[i]);
        Ok((self.median(&[(op, &inputs, &outputs)])?, touched))
    }

    /// Attention's backward reads the forward's o and lse: compute them from its q, k, v.
    fn run_forward(&mut self, a: &AttentionAttrs, bwd_inputs: &[BufferId]) -> Result<()> {
        let qkv = if a.packed { 1 } else { 3 };
        let (ins, outs) = (&bwd_inputs[1..1 + qkv], &bwd_inputs[1 + qkv..3 + qkv]);
        let forward = Op::Attention(a.clone());
        self.backend.compute(&forward, ins, outs, &SCALARS)?;
        self.backend.synchronize()
    }

    /// The median seconds of `calls` (op, inputs, outputs) run in turn.
    fn median(&mut self, calls: &[(&Op, &[BufferId], &[BufferId])]) -> Result<f64> {
        let run = |b: &mut dyn Backend, times: usize| -> Result<f64> {
            let start = Instant::now();
            for _ in 0..times {
                for &(op, inputs, outputs) in calls {
                    b.compute(op, inputs, outputs, &SCALARS)?;
                }
            }
            b.synchronize()?;
            Ok(start.elapsed().as_secs_f64() / times as f64)
        };
        run(self.backend, 1)?;
        let once = run(self.backend, 1)?;
        let times = ((SAMPLE_SECONDS / once.max(1e-9)) as usize).clamp(1, 100);
        let mut samples = (0..self.reps)
            .map(|_| run(self.backend, times))
            .collect::<Result<Vec<f64>>>()?;
        samples.sort_by(f64::total_cmp);
        Ok(samples.get(samples.len() / 2).copied().unwrap_or(once))
    }

    /// An input buffer for `operand`, filled: a shared one of its role, shape and dtype when
    /// inputs are shared (an input is only read; no two operands of an op share one), else a
    /// new one listed in `allocated`.
    fn input(
        &mut self,
        operand: &Operand,
        n: u64,
        m: u64,
        allocated: &mut Vec<BufferId>,
    ) -> Result<(BufferId, f64)> {
        let key = (
            operand.role,
            operand_shape(operand, n, m),
            self.storage(operand).0,
        );
        if let Some(&found) = self.shared.as_ref().and_then(|s| s.get(&key)) {
            return Ok(found);
        }
        let (id, bytes) = self.alloc(operand, n, m)?;
        self.fill(id, operand, n, m)?;
        match self.shared.as_mut() {
            Some(shared) => {
                shared.insert(key, (id, bytes));
            }
            None => allocated.push(id),
        }
        Ok((id, bytes))
    }

    /// Free the shared inputs and stop sharing.
    fn free_shared(&mut self) -> Result<()> {
        for (id, _) in self.shared.take().into_iter().flat_map(|s| s.into_values()) {
            self.backend.free(id)?;
        }
        Ok(())
    }

    /// The dtype `operand` is stored in and the bytes an element counts as in the timeline
    /// ([`Bench::timeline_bytes`]).
    fn storage(&self, operand: &Operand) -> (DType, u64) {
        let dtype = match operand.class {
            StorageClass::Tokens => DType::I32,
            StorageClass::Float if self.half && self.backend.stores_bf16() => DType::Bf16,
            StorageClass::Fp32 | StorageClass::Float => DType::F32,
            StorageClass::Fp8(format) => DType::Fp8(format),
        };
        (dtype, self.timeline_bytes(dtype))
    }

    /// The bytes an element of `dtype` counts as in the timeline: f32 at the run's precision,
    /// bf16 2, i32 4.
    fn timeline_bytes(&self, dtype: DType) -> u64 {
        match dtype {
            DType::F32 if self.half => 2,
            DType::F32 | DType::I32 => 4,
            DType::Bf16 => 2,
            DType::Fp8(_) => 1,
        }
    }

    /// A buffer for `operand` at `n` rows (`m` key/value rows), and its bytes as the timeline
    /// counts them ([`Bench::storage`]).
    fn alloc(&mut self, operand: &Operand, n: u64, m: u64) -> Result<(BufferId, f64)> {
        let shape = operand_shape(operand, n, m);
        let (dtype, bytes) = self.storage(operand);
        let id = BufferId(self.next);
        self.next += 1;
        self.backend.alloc(id, &shape, dtype)?;
        Ok((id, (shape.iter().product::<u64>() * bytes) as f64))
    }

    /// Token ids 0 (valid for any vocabulary), floats standard normal.
    fn fill(&mut self, id: BufferId, operand: &Operand, n: u64, m: u64) -> Result<()> {
        let len = operand_shape(operand, n, m).iter().product::<u64>() as usize;
        match operand.class {
            StorageClass::Tokens => self.backend.write_i32(id, &vec![0; len]),
            _ => self.fill_f32(id, len),
        }
    }

    /// `len` standard normal values into float buffer `id`.
    fn fill_f32(&mut self, id: BufferId, len: usize) -> Result<()> {
        let have = self.pattern.len();
        if have < len {
            self.pattern
                .extend((have..len).map(|i| normal_value(i as u64)));
        }
        self.backend.write_f32(id, &self.pattern[..len])
    }
}

/// A standard normal value for index `i` (Box–Muller over two splitmix64 draws): signs and
/// exponents spread as a training step's activations and gradients are.
fn normal_value(i: u64) -> f32 {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let unit = |z: u64| ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let (u1, u2) = (unit(mix(2 * i)), unit(mix(2 * i + 1)));
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// The shape of `operand` at `n` rows (`m` key/value rows): `[rows, cols]`, or `[n]` for an
/// operand without a fixed shape.
fn operand_shape(operand: &Operand, n: u64, m: u64) -> Vec<u64> {
    match operand.shape {
        Some(s) => {
            let rows = match s.rows {
                Rows::N | Rows::Any => n,
                Rows::M => m,
                Rows::Fixed(r) => r,
            };
            vec![rows, s.cols]
        }
        None => vec![n],
    }
}

/// The grid's GEMM shapes `[m, n, k]` (rows, outputs, inputs), within its size limits.
fn gemm_shapes(grid: &Grid) -> Vec<[u64; 3]> {
    let mut shapes = Vec::new();
    for &m in grid.gemm_m {
        for &n in grid.gemm_nk {
            for &k in grid.gemm_nk {
                if n * k <= grid.gemm_max_weight && m * n.max(k) <= grid.gemm_max_activation {
                    shapes.push([m, n, k]);
                }
            }
        }
    }
    shapes
}

/// The GEMMs of a layer with `k` inputs and `n` outputs, each layout with every epilogue the
/// lowering emits (plain; adding into the output: a residual, accumulated gradients; a bias or
/// its gradient; an activation or its derivative), as (layout, epilogue, op); only the plain
/// three unless `epilogues`.
fn gemm_ops(n: u64, k: u64, epilogues: bool) -> Vec<(GemmLayout, GemmEpilogue, Op)> {
    let act = Some(Act::GeluTanh);
    let epi = |accumulate, bias, act| GemmEpilogue {
        accumulate,
        bias,
        act,
    };
    let forward = |accumulate, bias, act: Option<Act>| Op::Matmul {
        in_dim: k,
        out_dim: n,
        bias,
        act,
        residual: accumulate,
        swiglu: false,
        fp8: None,
    };
    let data = |accumulate, act_grad: Option<Act>| Op::MatmulBwdData {
        in_dim: k,
        out_dim: n,
        accumulate,
        act_grad,
        swiglu: false,
        fp8: None,
    };
    let weight = |accumulate, bias| Op::MatmulBwdWeight {
        in_dim: k,
        out_dim: n,
        bias,
        accumulate_param_grad: accumulate,
        fp8: None,
    };
    let (fwd, bwd_data, bwd_weight) = (GemmLayout::Fwd, GemmLayout::BwdData, GemmLayout::BwdWeight);
    let mut ops = vec![
        (fwd, GemmEpilogue::PLAIN, forward(false, false, None)),
        (bwd_data, GemmEpilogue::PLAIN, data(false, None)),
        (bwd_weight, GemmEpilogue::PLAIN, weight(false, false)),
    ];
    if epilogues {
        ops.extend([
            (fwd, epi(true, false, false), forward(true, false, None)),
            (fwd, epi(false, true, false), forward(false, true, None)),
            (fwd, epi(true, true, false), forward(true, true, None)),
            (fwd, epi(false, true, true), forward(false, true, act)),
            (bwd_data, epi(true, false, false), data(true, None)),
            (bwd_data, epi(false, false, true), data(false, act)),
            (bwd_weight, epi(true, false, false), weight(true, false)),
            (bwd_weight, epi(false, true, false), weight(false, true)),
            (bwd_weight, epi(true, true, false), weight(true, true)),
        ]);
    }
    ops
}

/// Causal self-attention over one sequence of `seq` positions per sample.
fn attention_attrs(
    [batch, heads, kv_heads, seq, head_dim]: [u64; 5],
    packed: bool,
) -> AttentionAttrs {
    let positions = vec![Segment {
        start: 0,
        len: seq as u32,
    }];
    AttentionAttrs {
        batch,
        heads,
        kv_heads,
        head_dim,
        causal: true,
        scale: 1.0 / (head_dim as f64).sqrt(),
        q_positions: positions.clone(),
        kv_positions: positions,
        packed: packed && heads == kv_heads,
    }
}

/// The memory-bound ops measured, each with its table and the width of its rows: the
/// elementwise add and SwiGLU (forward and backward), each norm (forward and backward) at each
/// of the grid's dims, the cross-entropy at each vocabulary, AdamW and the gradients' sum of
/// squares, the embedding (forward and backward).
fn memory_ops(grid: &Grid) -> Vec<(MemoryKind, Op, u64)> {
    let (vocab, embed_dim) = grid.embed;
    let embedding = EmbeddingAttrs {
        vocab_start: 0,
        vocab_local: vocab,
        dim: embed_dim,
    };
    let adamw = Op::AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut ops = vec![
        (MemoryKind::Elementwise, Op::Add, 1),
        (MemoryKind::Elementwise, Op::SwiGlu, 1),
        (MemoryKind::Elementwise, Op::SwiGluBwd, 1),
    ];
    for &dim in grid.norm_dims {
        let norms = [
            Op::LayerNorm {
                dim,
                eps: 1e-5,
                bias: true,
            },
            Op::LayerNormBwd {
                dim,
                bias: true,
                accumulate: false,
                accumulate_param_grad: true,
            },
            Op::RmsNorm { dim, eps: 1e-5 },
            Op::RmsNormBwd {
                dim,
                accumulate: false,
                accumulate_param_grad: true,
            },
        ];
        ops.extend(norms.map(|op| (MemoryKind::Norm, op, dim)));
    }
    for &vocab in grid.vocabs {
        let loss = Op::CrossEntropy { vocab, scale: 1e-3 };
        ops.push((MemoryKind::CrossEntropy, loss, vocab));
    }
    ops.extend([
        (MemoryKind::Optimizer, adamw, 1),
        (MemoryKind::Optimizer, Op::SumSquares, 1),
        (
            MemoryKind::Embedding,
            Op::Embedding(embedding.clone()),
            embed_dim,
        ),
        (
            MemoryKind::Embedding,
            Op::EmbeddingBwd(embedding),
            embed_dim,
        ),
    ]);
    ops
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuBackend;

    #[test]
    fn a_quick_cpu_calibration_measures_every_table() {
        let mut backend = CpuBackend::with_threads(1).unwrap();
        let settings = Settings {
            quick: true,
            precision: Precision::Fp32,
            gpu: Gpu {
                name: "cpu".into(),
                memory_bytes: 1 << 34,
                peak_flops: 1e11,
                peak_flops_fp32: 1e11,
                peak_flops_fp8: Some(1e11),
                memory_bandwidth: 2e10,
            },
            device: "cpu (1 thread)".into(),
            date: "2026-01-01".into(),
            fp8: Vec::new(),
        };
        let profile = calibrate(&mut backend, &settings, &mut |_| {}).unwrap();
        assert!(profile.validate().is_ok());
        // 2 m × 9 (n, k) shapes × (3 layouts plain + 9 epilogues).
        assert_eq!(profile.gemm.len(), 2 * 9 * 12);
        assert!(profile.gemm.iter().any(|g| g.accumulate && g.bias));
        assert!(profile
            .gemm
            .iter()
            .any(|g| g.act && g.layout == GemmLayout::BwdData));
        assert_eq!(profile.attention.len(), 2 * 2 * 2);
        // Sizes × (add, SwiGLU and its backward; four norm ops at one dim; one vocabulary;
        // AdamW, sum of squares; the embedding and its backward; runs of AdamW and of sums of
        // squares).
        assert_eq!(profile.memory.len(), 3 * (3 + 4 + 1 + 2 + 2 + 2));
        let norm = |op: &str| profile.memory.iter().any(|m| m.op.as_deref() == Some(op));
        assert!(norm("rms_norm_bwd") && norm("layer_norm") && norm("sum_squares"));
        assert!(norm("adam_w_multi") && norm("sum_squares_multi"));
        // The runs follow the single ops (an op without points is priced by its kind's first).
        let first_optimizer = (profile.memory.iter()).find(|m| m.kind == MemoryKind::Optimizer);
        assert_eq!(first_optimizer.unwrap().op.as_deref(), Some("adam_w"));
        assert!(profile.launch_overhead_s > 0.0);
    }
}
