//! [`ProfileCosts`]: instruction costs from a calibration profile ([`super::profile`]).
//!
//! A GEMM (`Matmul`, `MatmulBwdData`, `MatmulBwdWeight`) takes 2·m·n·k FLOPs at the rate the
//! profile's GEMM points of its layout and dtype give at (m, n, k); attention its model FLOPs
//! at the rate of its pass's points at (batch·heads, group, seq, head dim); every other op its
//! bytes touched (as [`SpecCosts`] counts them) at the bandwidth its kind's memory points give
//! at that size; no op less than the profile's launch overhead. A run of optimizer updates (or
//! of sums of squares) that the profile's backend launches as one ([`super::fused`]: CUDA's
//! multi-tensor kernels) is one such op of its members' summed bytes, at the rate of the
//! profile's points of that multi-tensor launch (`adam_w_multi`, `sum_squares_multi`:
//! [`multi_op_name`]) where it has them, else of its op's own points at that size; on a backend
//! that does not fuse (the CPU) each member is priced alone. Rates come from
//! [`super::profile::rate_at`] (log-size interpolation, clamped to the grid), scaled by the
//! spec's GPU peak over the profile's when the calibration asks to scale. An op whose table the
//! profile lacks is priced by the roofline ([`SpecCosts`]), and so are collectives without
//! measured points and all transfers; [`ProfileCosts::roofline_kinds`] names them.
use super::costs::{rides_on_its_gemm, SpecCosts, StepCosts};
use super::profile::{
    multi_op_name, rate_at, GemmDtype, GemmEpilogue, GemmLayout, GemmPoint, MemoryKind,
    MemoryPoint, Pass, Profile,
};
use crate::fp8::{Gemm, GemmPrices, PerLayout, Priced, Pricing};
use crate::ir::fp8::Fp8Scaling;
use crate::ir::op::{AttentionAttrs, Op};
use crate::ir::table::{Family, FlopCount, Opcode, Rows, Shape, Signature};
use crate::ir::{Buffer, BufferId, CollectiveKind, DType, Instr, Plan, Program};
use crate::spec::Spec;
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

/// A profile chosen to price a compile's timeline (`driver::CompileOptions::calibration`).
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    pub profile: Profile,
    /// Scale the profile's rates by the spec's GPU peak numbers over the profile's (a profile
    /// of another GPU kind, when asked for).
    pub scale: bool,
}

/// The table an instruction is priced from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Table {
    Gemm(GemmLayout),
    Attention(Pass),
    Memory(MemoryKind),
}

/// A priced op's table and sizes (up to five numbers).
type PriceKey = (Table, [u64; 5]);

/// Costs from a calibration profile, the roofline where it has no points. See the module docs.
pub struct ProfileCosts<'a> {
    profile: &'a Profile,
    roofline: SpecCosts<'a>,
    flops_scale: f64,
    bytes_scale: f64,
    /// Seconds by table and sizes: plans repeat few shapes many times.
    cache: RefCell<HashMap<PriceKey, Option<f64>>>,
    /// Per FP8 GEMM dtype priced so far, whether its points decompose
    /// ([`ProfileCosts::fp8_decomposes`]): found once, on its first GEMM.
    fp8_decomposes: RefCell<HashMap<String, bool>>,
}

impl<'a> ProfileCosts<'a> {
    pub fn new(calibration: &'a Calibration, spec: &'a Spec) -> ProfileCosts<'a> {
        let profile = &calibration.profile;
        let gpu = &spec.cluster.gpu;
        let peak = gpu.peak_for(spec.train.precision);
        let ratio = |target: f64, measured: f64| {
            if calibration.scale && target > 0.0 && measured > 0.0 {
                target / measured
            } else {
                1.0
            }
        };
        ProfileCosts {
            profile,
            roofline: SpecCosts { spec },
            flops_scale: ratio(peak, profile.peak_flops),
            bytes_scale: ratio(gpu.memory_bandwidth, profile.memory_bandwidth),
            cache: RefCell::new(HashMap::new()),
            fp8_decomposes: RefCell::new(HashMap::new()),
        }
    }

    /// The kinds of work in `plan` this model prices by the roofline because the profile has
    /// no points for them (`attention_fwd`, `collective all_reduce`, …), sorted.
    pub fn roofline_kinds(&self, plan: &Plan) -> Vec<String> {
        let mut kinds = BTreeSet::new();
        for program in &plan.programs {
            for instr in &program.instrs {
                match instr {
                    Instr::Compute { op, .. } => {
                        let table = table_of(op);
                        if !self.has_points(table) {
                            kinds.insert(table_name(table));
                        }
                        // Without points of its scaling an FP8 GEMM is its bf16 time at the
                        // GPU's FP8 peak ratio.
                        if let Some(f) = op
                            .fp8()
                            .filter(|f| !self.has_gemm(GemmDtype::Fp8(f.scaling)))
                        {
                            kinds.insert(format!("FP8 GEMMs ({})", f.scaling.name()));
                        }
                    }
                    Instr::Collective { kind, .. } => {
                        let name = collective_name(*kind);
                        if !self.profile.collectives.iter().any(|p| p.kind == name) {
                            kinds.insert(format!("collective {name}"));
                        }
                    }
                    _ => {}
                }
            }
        }
        kinds.into_iter().collect()
    }

    /// What `plan` runs that this profile prices more coarsely than `parc calibrate` measures
    /// today (a profile from an older calibrate): GEMM epilogues priced as plainer GEMMs where
    /// it measured none, memory-bound ops priced by their kind's rate where it measured no op
    /// on its own. Empty for a current profile.
    pub fn coarse_tables(&self, plan: &Plan) -> Vec<String> {
        let p = self.profile;
        let epilogues = p.gemm.iter().any(|g| g.epilogue() != GemmEpilogue::PLAIN);
        let per_op = p.memory.iter().any(|m| m.op.is_some());
        let ops = (plan.programs.iter().flat_map(|p| &p.instrs)).filter_map(Instr::op);
        let mut coarse = BTreeSet::new();
        for op in ops {
            match table_of(op) {
                Table::Gemm(_) if !epilogues && epilogue_of(op) != GemmEpilogue::PLAIN => {
                    coarse.insert("GEMM epilogues (as plain GEMMs)");
                }
                Table::Memory(_) if !per_op => {
                    coarse.insert("memory-bound ops (by their kind's rate, not their own)");
                }
                _ => {}
            }
        }
        coarse.into_iter().map(String::from).collect()
    }

    fn has_points(&self, table: Table) -> bool {
        let p = self.profile;
        match table {
            Table::Gemm(layout) => p.gemm.iter().any(|g| g.layout == layout),
            Table::Attention(pass) => p.attention.iter().any(|a| a.pass == pass),
            Table::Memory(kind) => p.memory.iter().any(|m| m.kind == kind),
        }
    }

    /// Seconds of `op` on buffers `inputs`/`outputs` of `program`; None when the profile has
    /// no points for it.
    fn price(
        &self,
        program: &Program,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
    ) -> Option<f64> {
        let buffer = |ids: &[BufferId], i: usize| ids.get(i).and_then(|b| program.buffer(*b));
        let signature = op.signature();
        // The rows of a GEMM or attention (memory-bound ops need only their bytes).
        let rows = || signature.rows_from_inputs(|i| buffer(inputs, i).map_or(0, Buffer::numel));
        let table = table_of(op);
        let seconds = match (table, op) {
            (Table::Gemm(layout), _) => {
                let (in_dim, out_dim) = op.gemm_dims()?;
                let bf16 = buffer(inputs, 0).is_some_and(|b| b.dtype == DType::Bf16);
                let dtype = GemmDtype::storage(bf16);
                let mnk = [rows()?, out_dim, in_dim];
                let epilogue = epilogue_of(op);
                let elem = buffer(outputs, 0).map_or(4, |b| b.dtype.bytes());
                let product = match op.fp8() {
                    // Operands quantized by their own ops: the GEMM alone.
                    Some(f) if f.quantized => self.fp8_gemm_alone(
                        (layout, mnk),
                        (f.scaling, epilogue),
                        dtype,
                        [buffer(inputs, 0), buffer(inputs, 1)],
                    )?,
                    Some(f) if self.has_gemm(GemmDtype::Fp8(f.scaling)) => {
                        let delayed = f.history.is_some();
                        self.measured_fp8(layout, mnk, (f.scaling, epilogue), delayed)?
                    }
                    // No FP8 points of its scaling: the measured bf16 time at the FP8 peak's
                    // speed-up, plus quantizing both operands.
                    Some(f) => self.fp8_gemm(
                        self.gemm(layout, mnk, dtype, epilogue)?,
                        [buffer(inputs, 0), buffer(inputs, 1)],
                        f.history.is_some(),
                    ),
                    None => self.gemm(layout, mnk, dtype, epilogue)?,
                };
                product + self.swiglu_apart(op, mnk, elem)?
            }
            (Table::Attention(pass), Op::Attention(a) | Op::AttentionBwd(a)) => {
                self.attention(pass, a, op.flops(rows()? as f64, FlopCount::Model))?
            }
            (Table::Memory(kind), _) => {
                let touched = self.bytes_touched(program, &signature, inputs, outputs);
                self.memory(kind, op.opcode(), row_width(&signature), touched)?
            }
            _ => return None,
        };
        Some(seconds.max(self.profile.launch_overhead_s))
    }

    /// Seconds of a GEMM's SwiGLU epilogue (`swiglu`; 0 for any other op) as the CUDA
    /// backend runs it: the `SwiGlu` (`SwiGluBwd`) kernel after the GEMM, reading and writing
    /// three (five) `rows × width` tensors of `elem` bytes an element, at that op's measured
    /// rate.
    fn swiglu_apart(&self, op: &Op, [rows, out_dim, in_dim]: [u64; 3], elem: u64) -> Option<f64> {
        let (opcode, width, tensors) = match op {
            Op::Matmul { swiglu: true, .. } => (Opcode::SwiGlu, out_dim, 3.0),
            Op::MatmulBwdData { swiglu: true, .. } => (Opcode::SwiGluBwd, in_dim, 5.0),
            _ => return Some(0.0),
        };
        let bytes = tensors * (rows * width * elem) as f64;
        let kind = MemoryKind::Elementwise;
        Some(
            self.memory(kind, opcode, Some(width), bytes)?
                .max(self.profile.launch_overhead_s),
        )
    }

    /// Bytes an op of `signature` on buffers `inputs`/`outputs` of `program` touches, as the
    /// signature counts them (elements at the roofline's sizes).
    fn bytes_touched(
        &self,
        program: &Program,
        signature: &Signature,
        inputs: &[BufferId],
        outputs: &[BufferId],
    ) -> f64 {
        let buffer = |ids: &[BufferId], i: usize| ids.get(i).and_then(|b| program.buffer(*b));
        let bytes =
            |ids: &[BufferId], i: usize| buffer(ids, i).map_or(0.0, |b| self.roofline.bytes(b));
        let rows = signature.rows_from_inputs(|i| buffer(inputs, i).map_or(0, Buffer::numel));
        signature.bytes_touched(
            rows.unwrap_or(0),
            |i| bytes(inputs, i),
            |i| bytes(outputs, i),
        )
    }

    /// Seconds of one launch running `members` (a fused run of one memory-bound op) and
    /// writing the outputs of the `refreshes` it absorbed: their bytes summed, at the rate of
    /// the op's multi-tensor points ([`multi_op_name`]) where the profile has them, else of its
    /// own points; None without either.
    fn price_run(
        &self,
        program: &Program,
        members: &[&Instr],
        refreshes: &[&Instr],
    ) -> Option<f64> {
        let op = members.first()?.as_compute()?.op;
        let Table::Memory(kind) = table_of(op) else {
            return None;
        };
        let bytes: f64 = (members.iter())
            .map(|m| {
                let c = m.as_compute()?;
                Some(self.bytes_touched(program, &c.op.signature(), c.inputs, c.outputs))
            })
            .sum::<Option<f64>>()?
            + self.roofline.written_bytes(program, refreshes);
        let opcode = op.opcode();
        let multi_name = multi_op_name(opcode);
        let multi: Vec<&MemoryPoint> = (self.profile.memory.iter())
            .filter(|p| p.kind == kind && p.op.as_deref() == Some(multi_name.as_str()))
            .collect();
        let seconds = match memory_rate(&multi, None, bytes) {
            Some(rate) => bytes / (rate * self.bytes_scale),
            None => self.memory(kind, opcode, None, bytes)?,
        };
        Some(seconds.max(self.profile.launch_overhead_s))
    }

    fn cached(&self, key: PriceKey, f: impl FnOnce() -> Option<f64>) -> Option<f64> {
        if let Some(hit) = self.cache.borrow().get(&key) {
            return *hit;
        }
        let value = f();
        self.cache.borrow_mut().insert(key, value);
        value
    }

    /// An FP8 GEMM measured as `bf16_seconds` in bf16, by the roofline's FP8 assumptions
    /// (`delayed`: without the operands' amax passes).
    fn fp8_gemm(&self, bf16_seconds: f64, operands: [Option<&Buffer>; 2], delayed: bool) -> f64 {
        let quantize = self.roofline.fp8_quantize_seconds(operands, delayed);
        crate::fp8::from_bf16(bf16_seconds, quantize, &self.roofline.spec.cluster.gpu)
    }

    /// Whether the profile has GEMM points of `dtype`.
    fn has_gemm(&self, dtype: GemmDtype) -> bool {
        let name = dtype.name();
        self.profile.gemm.iter().any(|g| g.dtype == name)
    }

    /// Seconds of a GEMM of `layout` at `[m, n, k]` on `dtype` with `epilogue`: from the
    /// points of the same layout, dtype and epilogue, else the nearest epilogue measured
    /// ([`GemmEpilogue::relaxed`]: older profiles have plain GEMMs only), else the plain points
    /// of any layout of the dtype.
    fn gemm(
        &self,
        layout: GemmLayout,
        [m, n, k]: [u64; 3],
        dtype: GemmDtype,
        epilogue: GemmEpilogue,
    ) -> Option<f64> {
        let key = (
            Table::Gemm(layout),
            [m, n, k, dtype_code(dtype), epilogue.code()],
        );
        self.cached(key, || {
            let fp8 = matches!(dtype, GemmDtype::Fp8(_));
            let dtype = dtype.name();
            let flops = 2.0 * m as f64 * n as f64 * k as f64;
            let whole = flops / self.gemm_rate(layout, [m, n, k], &dtype, epilogue, false)?;
            // An FP8 point's time is its GEMM and its operands' quantization, whose share of
            // it changes with the shape faster than a rate interpolates: priced again as the
            // GEMM part's rate, interpolated, plus the quantization modelled at the target,
            // and the lower of the two taken (each overstates in its own regime: the whole
            // points where the target's quantization share is below its neighbours', the
            // model where it overstates small operands' launches).
            if !fp8 || !self.fp8_decomposes(&dtype) {
                return Some(whole);
            }
            let split = flops / self.gemm_rate(layout, [m, n, k], &dtype, epilogue, true)?
                + self.fp8_quantize(layout, [m, n, k])?;
            Some(whole.min(split))
        })
    }

    /// The rate (FLOP/s) of a GEMM of `layout` at `[m, n, k]` on `dtype` with `epilogue`,
    /// interpolated between the points of the same layout, dtype and epilogue, else the
    /// nearest epilogue measured ([`GemmEpilogue::relaxed`]), else the plain points of any
    /// layout; with `gemm_part`, of FP8 points' GEMM part ([`Self::fp8_core_seconds`]).
    fn gemm_rate(
        &self,
        layout: GemmLayout,
        [m, n, k]: [u64; 3],
        dtype: &str,
        epilogue: GemmEpilogue,
        gemm_part: bool,
    ) -> Option<f64> {
        let curve = |keep: &dyn Fn(&GemmPoint) -> bool| -> Vec<_> {
            (self.profile.gemm.iter())
                .filter(|g| g.dtype == dtype && keep(g))
                .filter_map(|g| {
                    let seconds = match gemm_part {
                        true => self.fp8_core_seconds(g)?,
                        false => g.seconds,
                    };
                    Some((log2s(&[g.m, g.n, g.k]), g.flops() / seconds))
                })
                .collect()
        };
        let mut points = Vec::new();
        for nearest in epilogue.relaxed() {
            if points.is_empty() {
                points = curve(&|g| g.layout == layout && g.epilogue() == nearest);
            }
        }
        if points.is_empty() {
            // Another layout of the same dtype says more than the roofline.
            points = curve(&|g| g.epilogue() == GemmEpilogue::PLAIN);
        }
        Some(rate_at(&points, &log2s(&[m, n, k]))? * self.flops_scale)
    }

    /// Seconds to quantize the two bf16 operands of an FP8 GEMM of `layout` at `[m, n, k]`
    /// (`crate::fp8::quantize_elements`): an amax pass reading each, a pass reading it again and
    /// writing one byte an element, priced as elementwise traffic at the profile's measured
    /// rate for that many bytes, plus their launches.
    fn fp8_quantize(&self, layout: GemmLayout, mnk: [u64; 3]) -> Option<f64> {
        let launches = crate::fp8::QUANT_LAUNCHES;
        self.operand_passes(layout, mnk, crate::fp8::quantize_bytes, launches)
    }

    /// Seconds of an FP8 GEMM of `layout` at `mnk` in `scaling` with `epilogue` from the
    /// profile's FP8 points, which were measured under current scaling: under delayed scaling
    /// (`delayed`) less its amax passes (its records ride on its quantize pass), at least a
    /// launch.
    fn measured_fp8(
        &self,
        layout: GemmLayout,
        mnk: [u64; 3],
        (scaling, epilogue): (Fp8Scaling, GemmEpilogue),
        delayed: bool,
    ) -> Option<f64> {
        let measured = self.gemm(layout, mnk, GemmDtype::Fp8(scaling), epilogue)?;
        let saved = match delayed {
            true => self.amax_passes(layout, mnk)?,
            false => 0.0,
        };
        Some((measured - saved).max(self.profile.launch_overhead_s))
    }

    /// Seconds of an FP8 GEMM of `layout` at `mnk` whose operands come quantized (`dtype` the
    /// storage of its unquantized ones, `operands` those): the GEMM part of the profile's FP8
    /// points where they decompose ([`Self::fp8_core_seconds`]), else their time less the
    /// modelled quantization, at least the time at the GPU's FP8 peak; without FP8 points, the
    /// bf16 time at the FP8 peak's speed-up.
    fn fp8_gemm_alone(
        &self,
        (layout, mnk): (GemmLayout, [u64; 3]),
        (scaling, epilogue): (Fp8Scaling, GemmEpilogue),
        dtype: GemmDtype,
        operands: [Option<&Buffer>; 2],
    ) -> Option<f64> {
        let fp8 = GemmDtype::Fp8(scaling);
        if !self.has_gemm(fp8) {
            let quantize = self.roofline.fp8_quantize_seconds(operands, false);
            let priced = self.fp8_gemm(self.gemm(layout, mnk, dtype, epilogue)?, operands, false);
            return Some(priced - quantize);
        }
        let [m, n, k] = mnk;
        let flops = 2.0 * m as f64 * n as f64 * k as f64;
        if self.fp8_decomposes(&fp8.name()) {
            return Some(flops / self.gemm_rate(layout, mnk, &fp8.name(), epilogue, true)?);
        }
        let gpu = &self.roofline.spec.cluster.gpu;
        let peak = gpu.peak_flops_fp8.unwrap_or(gpu.peak_flops).max(1.0) * self.flops_scale;
        let measured = self.gemm(layout, mnk, fp8, epilogue)?;
        Some((measured - self.fp8_quantize(layout, mnk)?).max(flops / peak))
    }

    /// Seconds of the amax passes over the two bf16 operands of an FP8 GEMM of `layout` at
    /// `[m, n, k]`, as [`Self::fp8_quantize`] prices them: what delayed scaling's GEMM saves.
    fn amax_passes(&self, layout: GemmLayout, mnk: [u64; 3]) -> Option<f64> {
        self.operand_passes(layout, mnk, crate::fp8::amax_pass_bytes, 1.0)
    }

    /// Passes over an FP8 GEMM's two bf16 operands moving `bytes(elements, 2)` bytes, priced as
    /// elementwise traffic at the profile's measured rate, with `launches` per operand.
    fn operand_passes(
        &self,
        layout: GemmLayout,
        mnk: [u64; 3],
        bytes: fn(f64, f64) -> f64,
        launches: f64,
    ) -> Option<f64> {
        let bytes = bytes(crate::fp8::quantize_elements(layout, mnk), 2.0);
        let launches = launches * 2.0 * self.profile.launch_overhead_s;
        Some(self.memory(MemoryKind::Elementwise, Opcode::Add, None, bytes)? + launches)
    }

    /// An FP8 point's GEMM seconds: its measured time less its modelled quantization, where
    /// that leaves at least what the GEMM takes at the GPU's FP8 peak; None where it does not
    /// (the smallest GEMMs, whose launches the model overstates: such a point cannot say how
    /// fast the GEMM itself ran).
    fn fp8_core_seconds(&self, g: &GemmPoint) -> Option<f64> {
        let gpu = &self.roofline.spec.cluster.gpu;
        let peak = gpu.peak_flops_fp8.unwrap_or(gpu.peak_flops).max(1.0) * self.flops_scale;
        let core = g.seconds - self.fp8_quantize(g.layout, [g.m, g.n, g.k])?;
        (core >= g.flops() / peak).then_some(core)
    }

    /// Whether FP8 points of `dtype` are priced as GEMM plus quantization: where at least a
    /// quarter of them leave a GEMM time (a profile whose memory rates cannot account for its
    /// FP8 times, as a synthetic one, is interpolated whole). Found once per dtype.
    fn fp8_decomposes(&self, dtype: &str) -> bool {
        if let Some(&known) = self.fp8_decomposes.borrow().get(dtype) {
            return known;
        }
        let decomposes = self.fp8_points_decompose(dtype);
        (self.fp8_decomposes.borrow_mut()).insert(dtype.to_string(), decomposes);
        decomposes
    }

    /// [`ProfileCosts::fp8_decomposes`], from the points.
    fn fp8_points_decompose(&self, dtype: &str) -> bool {
        let points: Vec<&GemmPoint> = (self.profile.gemm.iter())
            .filter(|g| g.dtype == dtype)
            .collect();
        let valid = points
            .iter()
            .filter(|g| self.fp8_core_seconds(g).is_some())
            .count();
        !points.is_empty() && 4 * valid >= points.len()
    }

    fn attention(&self, pass: Pass, a: &AttentionAttrs, flops: f64) -> Option<f64> {
        let seq = u64::from(crate::ir::op::segments_len(&a.q_positions));
        let group = a.heads / a.kv_heads.max(1);
        let sizes = [a.batch * a.heads, group.max(1), seq, a.head_dim];
        let key = (
            Table::Attention(pass),
            [
                sizes[0],
                sizes[1],
                seq,
                a.head_dim,
                u64::from(a.causal) * 2 + u64::from(a.packed),
            ],
        );
        self.cached(key, || {
            let of_pass = self.profile.attention.iter().filter(|p| p.pass == pass);
            let matching = |causal: bool, packed: bool| -> Vec<_> {
                of_pass
                    .clone()
                    .filter(|p| p.causal == causal && p.packed == packed)
                    .map(|p| {
                        let x = log2s(&[p.batch_heads, p.group, p.seq, p.head_dim]);
                        (x, p.flops() / p.seconds)
                    })
                    .collect()
            };
            // The same masking and layout if measured, else the same masking, else any.
            let mut points = matching(a.causal, a.packed);
            for (causal, packed) in [
                (a.causal, !a.packed),
                (!a.causal, a.packed),
                (!a.causal, !a.packed),
            ] {
                if points.is_empty() {
                    points = matching(causal, packed);
                }
            }
            let rate = rate_at(&points, &log2s(&sizes))? * self.flops_scale;
            Some(flops / rate)
        })
    }

    /// Seconds of a memory-bound op `opcode` of `kind` touching `bytes`, its rows `width`
    /// wide ([`ProfileCosts::memory_points`]), interpolated in bytes at the measured widths
    /// around `width` and between them in log-width.
    fn memory(
        &self,
        kind: MemoryKind,
        opcode: Opcode,
        width: Option<u64>,
        bytes: f64,
    ) -> Option<f64> {
        let key = (
            Table::Memory(kind),
            [bytes as u64, opcode as u64, width.unwrap_or(0), 0, 0],
        );
        self.cached(key, || {
            let points = self.memory_points(kind, opcode);
            let rate = memory_rate(&points, width, bytes)? * self.bytes_scale;
            Some(bytes / rate)
        })
    }

    /// The points that price `opcode`: its own where the profile has them, else its kind's of
    /// no particular op (older profiles), else of the kind's first op measured (calibrate
    /// measures each kind's plainest op first: add, layer_norm, adam_w, embedding); an
    /// embedding without points of its kind, elementwise ones.
    fn memory_points(&self, kind: MemoryKind, opcode: Opcode) -> Vec<&MemoryPoint> {
        let of_kind =
            |kind: MemoryKind| (self.profile.memory.iter()).filter(move |p| p.kind == kind);
        let of_op = |kind: MemoryKind, name: Option<&str>| -> Vec<&MemoryPoint> {
            of_kind(kind).filter(|p| p.op.as_deref() == name).collect()
        };
        let first_op = |kind: MemoryKind| of_kind(kind).next().and_then(|p| p.op.as_deref());
        let fallbacks: &[MemoryKind] = match kind {
            MemoryKind::Embedding => &[kind, MemoryKind::Elementwise],
            _ => &[kind],
        };
        let mut points = of_op(kind, Some(opcode.name()));
        for &fallback in fallbacks {
            if points.is_empty() {
                points = of_op(fallback, None);
            }
            if points.is_empty() {
                points = of_op(fallback, first_op(fallback));
            }
        }
        points
    }

    /// Seconds of a measured collective, interpolated in bytes among points of its kind and
    /// rank count (the nearest count measured when not this one); None without points.
    fn measured_collective(&self, kind: CollectiveKind, n: u32, bytes: f64) -> Option<f64> {
        let name = collective_name(kind);
        let of_kind: Vec<_> = (self.profile.collectives.iter())
            .filter(|p| p.kind == name)
            .collect();
        let ranks = of_kind
            .iter()
            .map(|p| p.ranks)
            .min_by_key(|r| r.abs_diff(n))?;
        let points: Vec<_> = (of_kind.iter())
            .filter(|p| p.ranks == ranks)
            .map(|p| (vec![p.bytes.log2()], p.bytes / p.seconds))
            .collect();
        let rate = rate_at(&points, &[bytes.max(1.0).log2()])? * self.bytes_scale;
        Some(bytes / rate)
    }
}

impl StepCosts for ProfileCosts<'_> {
    fn compute(&self, program: &Program, instr: &Instr) -> f64 {
        let Some(c) = instr.as_compute().filter(|c| !rides_on_its_gemm(c.op)) else {
            return 0.0;
        };
        self.price(program, c.op, c.inputs, c.outputs)
            .unwrap_or_else(|| self.roofline.compute(program, instr))
    }

    fn fuses_optimizer_runs(&self) -> bool {
        self.profile.fuses_optimizer_runs()
    }

    fn fused_run(&self, program: &Program, members: &[&Instr], refreshes: &[&Instr]) -> f64 {
        self.price_run(program, members, refreshes)
            .unwrap_or_else(|| {
                let written = self.roofline.written_bytes(program, refreshes);
                (members.iter())
                    .map(|m| self.roofline.compute(program, m))
                    .sum::<f64>()
                    + self.roofline.memory_seconds(written)
            })
    }

    fn collective(&self, kind: CollectiveKind, n: u32, bytes: f64, crosses_nodes: bool) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        // Collectives are measured within one host: between nodes the link model prices them.
        let measured = (!crosses_nodes)
            .then(|| self.measured_collective(kind, n, bytes))
            .flatten();
        measured.unwrap_or_else(|| self.roofline.collective(kind, n, bytes, crosses_nodes))
    }

    fn transfer(&self, bytes: f64, crosses_nodes: bool) -> f64 {
        self.roofline.transfer(bytes, crosses_nodes)
    }

    fn bytes(&self, buffer: &Buffer) -> f64 {
        self.roofline.bytes(buffer)
    }
}

/// `dtype` as one number of a price's cache key.
fn dtype_code(dtype: GemmDtype) -> u64 {
    match dtype {
        GemmDtype::F32 => 0,
        GemmDtype::Bf16 => 1,
        GemmDtype::Fp8(Fp8Scaling::Tensorwise) => 2,
        GemmDtype::Fp8(Fp8Scaling::Rowwise) => 3,
        GemmDtype::Fp8(Fp8Scaling::Blockwise { block }) => 4 + block,
    }
}

/// The FP8 choice's prices (`crate::fp8::choices`): a layer's GEMM in each of its three
/// layouts from the profile's bf16 points, and from its FP8 points of the recipe's scaling
/// where it has them, else at the FP8 peak's speed-up plus the roofline's quantization.
impl GemmPrices for Calibration {
    fn layer_gemm(&self, spec: &Spec, g: &Gemm, scaling: Fp8Scaling) -> Option<Priced> {
        let costs = ProfileCosts::new(self, spec);
        let mnk = [g.rows, g.out_dim, g.in_dim];
        let measured = costs.has_gemm(GemmDtype::Fp8(scaling));
        let delayed = crate::fp8::delayed(spec);
        let quantize = crate::fp8::quantize_each(spec, g);
        let mut priced = Priced {
            bf16_s: PerLayout::splat(0.0),
            fp8_s: PerLayout::splat(0.0),
            priced_by: match measured {
                true => Pricing::Measured,
                false => Pricing::MeasuredBf16,
            },
        };
        for layout in GemmLayout::ALL {
            let bf16 = costs.gemm(layout, mnk, GemmDtype::Bf16, GemmEpilogue::PLAIN)?;
            priced.bf16_s[layout] = bf16;
            priced.fp8_s[layout] = match measured {
                true => {
                    let plain = (scaling, GemmEpilogue::PLAIN);
                    costs.measured_fp8(layout, mnk, plain, delayed)?
                }
                false => crate::fp8::from_bf16(bf16, quantize[layout], &spec.cluster.gpu),
            };
        }
        Some(priced)
    }
}

/// The table that prices `op`.
fn table_of(op: &Op) -> Table {
    if let Some(layout) = GemmLayout::of(op) {
        return Table::Gemm(layout);
    }
    match op {
        Op::Attention(_) => Table::Attention(Pass::Fwd),
        Op::AttentionBwd(_) => Table::Attention(Pass::Bwd),
        _ => Table::Memory(match op.opcode().family() {
            Family::Norm => MemoryKind::Norm,
            Family::Loss => MemoryKind::CrossEntropy,
            Family::Optimizer => MemoryKind::Optimizer,
            Family::Embedding => MemoryKind::Embedding,
            _ => MemoryKind::Elementwise,
        }),
    }
}

fn table_name(table: Table) -> String {
    match table {
        Table::Gemm(GemmLayout::Fwd) => "matmul_fwd".into(),
        Table::Gemm(GemmLayout::BwdData) => "matmul_bwd_data".into(),
        Table::Gemm(GemmLayout::BwdWeight) => "matmul_bwd_weight".into(),
        Table::Attention(Pass::Fwd) => "attention_fwd".into(),
        Table::Attention(Pass::Bwd) => "attention_bwd".into(),
        Table::Memory(kind) => kind.name().into(),
    }
}

/// A GEMM's epilogue: whether it reads an output-sized operand (a forward's residual, a
/// gradient added into), adds a bias or writes its gradient, applies an activation or its
/// derivative. (A SwiGLU epilogue is priced apart: [`ProfileCosts::swiglu_apart`].)
fn epilogue_of(op: &Op) -> GemmEpilogue {
    let (accumulate, bias, act) = match op {
        Op::Matmul {
            residual,
            bias,
            act,
            ..
        } => (*residual, *bias, act.is_some()),
        Op::MatmulBwdData {
            accumulate,
            act_grad,
            ..
        } => (*accumulate, false, act_grad.is_some()),
        Op::MatmulBwdWeight {
            accumulate_param_grad,
            bias,
            ..
        } => (*accumulate_param_grad, *bias, false),
        _ => (false, false, false),
    };
    GemmEpilogue {
        accumulate,
        bias,
        act,
    }
}

/// The width of an op's rows: the widest `[n, cols]` operand's cols (a norm's dim, the
/// cross-entropy's vocabulary, an embedding's dim); None for flat operands only.
fn row_width(signature: &Signature) -> Option<u64> {
    (signature.inputs.iter().chain(signature.outputs.iter()))
        .filter_map(|o| match o.shape {
            Some(Shape {
                rows: Rows::N,
                cols,
            }) => Some(cols),
            _ => None,
        })
        .max()
}

/// The bytes/s of `points` at `bytes` and row `width`: without widths (the points' or the
/// op's), interpolated in log-bytes over all of them; else at each of the two measured widths
/// around `width` (clamped to those measured) and between them in log-width.
fn memory_rate(points: &[&MemoryPoint], width: Option<u64>, bytes: f64) -> Option<f64> {
    let at = [bytes.max(1.0).log2()];
    let rate_of = |points: Vec<&&MemoryPoint>| -> Option<f64> {
        let curve: Vec<_> = (points.iter())
            .map(|p| (vec![p.bytes.log2()], p.bytes / p.seconds))
            .collect();
        rate_at(&curve, &at)
    };
    let widths: BTreeSet<u64> = points.iter().filter_map(|p| p.cols).collect();
    let Some(width) = width.filter(|_| !widths.is_empty()) else {
        return rate_of(points.iter().collect());
    };
    let below = widths.range(..=width).next_back().or(widths.first());
    let above = widths.range(width..).next().or(widths.last());
    let (Some(&lo), Some(&hi)) = (below, above) else {
        return rate_of(points.iter().collect());
    };
    let at_width = |w: u64| rate_of(points.iter().filter(|p| p.cols == Some(w)).collect());
    let (rate_lo, rate_hi) = (at_width(lo)?, at_width(hi)?);
    if hi == lo {
        return Some(rate_lo);
    }
    let t =
        ((width as f64).log2() - (lo as f64).log2()) / ((hi as f64).log2() - (lo as f64).log2());
    Some(rate_lo + t.clamp(0.0, 1.0) * (rate_hi - rate_lo))
}

/// A collective's name in profiles.
pub fn collective_name(kind: CollectiveKind) -> &'static str {
    match kind {
        CollectiveKind::AllReduce { .. } => "all_reduce",
        CollectiveKind::AllGather => "all_gather",
        CollectiveKind::ReduceScatter => "reduce_scatter",
        CollectiveKind::Broadcast { .. } => "broadcast",
    }
}

fn log2s(sizes: &[u64]) -> Vec<f64> {
    sizes.iter().map(|&s| (s.max(1) as f64).log2()).collect()
}

#[cfg(test)]
pub(crate) mod tests;
