//! What each instruction costs in the simulated step.
//!
//! [`SpecCosts`] prices instructions from the spec's cluster (the default): a compute op takes
//! max(FLOPs / peak, bytes touched / HBM bandwidth) (a roofline); matmuls count 2·rows·in·out
//! FLOPs for each of forward, data-gradient and weight-gradient, attention 4·b·heads·s_q·s_kv·d
//! forward and twice that backward (not halved for causal masks, as the cost model), everything
//! else is memory bound (an output the op accumulates into is touched twice: read and
//! written). Elements take the spec's compute precision (2 bytes for bf16/fp16, 4
//! for fp32) except i32 token ids. A collective over n ranks of a B-byte buffer (all-reduce and
//! reduce-scatter: the input; all-gather: the output; broadcast: the buffer) takes, with the
//! link of the group (intra-node when its set fits in one node, else inter-node), ring times:
//! all-reduce 2(n−1)/n·B/bw + 2(n−1)·latency, all-gather and reduce-scatter (n−1)/n·B/bw +
//! (n−1)·latency, broadcast B/bw + latency. A point-to-point transfer takes B/bw + latency.

use crate::ir::op::Op;
use crate::ir::table::FlopCount;
use crate::ir::{Buffer, CollectiveKind, DType, Instr, Program};
use crate::spec::Spec;

/// Prices instructions for the timeline. Implement it to simulate other machines or, in tests,
/// idealised costs.
pub trait StepCosts {
    /// Seconds of a compute instruction (`Instr::Compute`) of `program`.
    fn compute(&self, program: &Program, instr: &Instr) -> f64;
    /// Whether the backend these costs describe runs each run of fusable optimizer
    /// instructions (`crate::ir::optimizer_runs`) as one launch, as the CUDA backend does
    /// (`super::fused`). The default, and the peak numbers (which charge no launch, so a run
    /// costs its members' sum either way): each instruction runs alone.
    fn fuses_optimizer_runs(&self) -> bool {
        false
    }
    /// Seconds of the one launch that runs `members` (a run's compute instructions of
    /// `program`) and makes the refresh copies it absorbed (`refreshes`: `Copy`s into bf16
    /// working copies, whose outputs the launch writes) where
    /// [`StepCosts::fuses_optimizer_runs`]. The default: their own prices, summed.
    fn fused_run(&self, program: &Program, members: &[&Instr], refreshes: &[&Instr]) -> f64 {
        (members.iter().chain(refreshes))
            .map(|i| self.compute(program, i))
            .sum()
    }
    /// Seconds of a collective over `n` ranks whose defining buffer holds `bytes`.
    fn collective(&self, kind: CollectiveKind, n: u32, bytes: f64, crosses_nodes: bool) -> f64;
    /// Seconds of one point-to-point transfer of `bytes`.
    fn transfer(&self, bytes: f64, crosses_nodes: bool) -> f64;
    /// Bytes of a buffer as moved on the wire and through memory.
    fn bytes(&self, buffer: &Buffer) -> f64;
}

/// Costs from a spec's GPU and links.
pub struct SpecCosts<'a> {
    pub spec: &'a Spec,
}

impl SpecCosts<'_> {
    /// Seconds to quantize an FP8 GEMM's two operands as stored (`crate::fp8`'s model; the
    /// calibrated costs price it the same way); under delayed scaling (`delayed`) less their
    /// amax passes (the operands' `Fp8AmaxRecord`s ride on the quantize pass:
    /// [`rides_on_its_gemm`]).
    pub(super) fn fp8_quantize_seconds(
        &self,
        operands: [Option<&Buffer>; 2],
        delayed: bool,
    ) -> f64 {
        let (elements, stored) = (operands.iter().flatten()).fold((0.0, 0.0), |(e, b), x| {
            (e + x.numel() as f64, b + self.bytes(x))
        });
        let stored = stored / elements.max(1.0);
        crate::fp8::quantize_seconds(elements, stored, &self.spec.cluster.gpu, delayed)
    }

    /// Bytes of the outputs of `instrs` (compute instructions of `program`), as
    /// [`StepCosts::bytes`] counts them: what a fused run writes for the refresh copies it
    /// absorbed.
    pub(super) fn written_bytes(&self, program: &Program, instrs: &[&Instr]) -> f64 {
        (instrs.iter())
            .filter_map(|i| i.as_compute())
            .flat_map(|c| c.outputs.iter())
            .filter_map(|&b| program.buffer(b))
            .map(|b| self.bytes(b))
            .sum()
    }

    /// Seconds to move `bytes` at the GPU's memory bandwidth (0 where it has none).
    pub(super) fn memory_seconds(&self, bytes: f64) -> f64 {
        let bw = self.spec.cluster.gpu.memory_bandwidth;
        if bw > 0.0 {
            bytes / bw
        } else {
            0.0
        }
    }

    fn peak(&self) -> f64 {
        self.spec.cluster.gpu.peak_for(self.spec.train.precision)
    }

    fn link(&self, crosses_nodes: bool) -> (f64, f64) {
        let link = if crosses_nodes {
            &self.spec.cluster.inter
        } else {
            &self.spec.cluster.intra
        };
        (link.bandwidth, link.latency)
    }
}

/// Whether `op` costs nothing of its own: delayed scaling's `Fp8AmaxRecord`, which the CUDA
/// backend makes inside the quantize pass of the GEMM after it (`crate::fp8::recording_gemm`;
/// the verifier holds every record to have that GEMM).
pub(super) fn rides_on_its_gemm(op: &Op) -> bool {
    matches!(op, Op::Fp8AmaxRecord(_))
}

impl StepCosts for SpecCosts<'_> {
    fn compute(&self, program: &Program, instr: &Instr) -> f64 {
        let Some(c) = instr.as_compute().filter(|c| !rides_on_its_gemm(c.op)) else {
            return 0.0;
        };
        let buffer =
            |ids: &[crate::ir::BufferId], i: usize| ids.get(i).and_then(|b| program.buffer(*b));
        // FLOPs over the op's rows as its signature reads them from the inputs; bytes as the
        // signature counts them.
        let signature = c.op.signature();
        let rows = signature.rows_from_inputs(|i| buffer(c.inputs, i).map_or(0, Buffer::numel));
        let flops = c.op.flops(rows.unwrap_or(0) as f64, FlopCount::Model);
        let bytes =
            |ids: &[crate::ir::BufferId], i: usize| buffer(ids, i).map_or(0.0, |b| self.bytes(b));
        let touched = signature.bytes_touched(
            rows.unwrap_or(0),
            |i| bytes(c.inputs, i),
            |i| bytes(c.outputs, i),
        );
        let gpu = &self.spec.cluster.gpu;
        let fp8 = c.op.fp8();
        let peak = match gpu.peak_flops_fp8 {
            Some(p) if fp8.is_some() => p,
            _ => self.peak(),
        };
        let math = if peak > 0.0 { flops / peak } else { 0.0 };
        let memory = self.memory_seconds(touched);
        // A `quantized` GEMM reads its operands quantized by their own `Fp8Quantize` ops,
        // priced as the memory-bound ops they are.
        let quantize = match fp8.filter(|f| !f.quantized) {
            Some(f) => self.fp8_quantize_seconds(
                [buffer(c.inputs, 0), buffer(c.inputs, 1)],
                f.history.is_some(),
            ),
            None => 0.0,
        };
        math.max(memory) + quantize
    }

    fn collective(&self, kind: CollectiveKind, n: u32, bytes: f64, crosses_nodes: bool) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let (bw, latency) = self.link(crosses_nodes);
        let steps = f64::from(n - 1);
        let share = steps / f64::from(n);
        let time = |volume: f64, hops: f64| {
            if bw > 0.0 {
                volume / bw + hops * latency
            } else {
                hops * latency
            }
        };
        match kind {
            CollectiveKind::AllReduce { .. } => time(2.0 * share * bytes, 2.0 * steps),
            CollectiveKind::AllGather | CollectiveKind::ReduceScatter => time(share * bytes, steps),
            CollectiveKind::Broadcast { .. } => time(bytes, 1.0),
        }
    }

    fn transfer(&self, bytes: f64, crosses_nodes: bool) -> f64 {
        let (bw, latency) = self.link(crosses_nodes);
        if bw > 0.0 {
            bytes / bw + latency
        } else {
            latency
        }
    }

    fn bytes(&self, buffer: &Buffer) -> f64 {
        let elem = match buffer.dtype {
            DType::I32 => 4,
            DType::F32 => self.spec.train.precision.compute_bytes(),
            DType::Bf16 => 2,
            DType::Fp8(_) => 1,
        };
        (buffer.numel() * elem) as f64
    }
}
