//! Runs of a GEMM with a SwiGLU epilogue and the FP8 quantizations of what the epilogue wrote,
//! which a backend may make in one pass (the CUDA backend's `swiglu_fp8` kernels): the epilogue
//! computes each element, stores it and quantizes it while it has it, instead of a quantize op
//! reading the stored tensor again. `lower::fp8_quantize` places such quantizations right after
//! their GEMM (delayed scaling, whose scale amaxes are known before the step).
//!
//! A run is a compute instruction whose op is a GEMM with a SwiGLU epilogue (the *producer*:
//! `Matmul { swiglu }` writing the gated product `a` as its second output, or
//! `MatmulBwdData { swiglu }` writing dgate and dup), followed at once by its *members*: at
//! least one `Fp8Quantize` of a tensor the epilogue wrote, and the `Fp8AmaxRecord`s of such
//! tensors that ride on them (`crate::fp8::recording_gemm`), with nothing else between. Each
//! member is well formed (one quantization a tensor; its scale amax and its outputs none of the
//! producer's inputs or outputs nor a history the run records into; a record's history none of
//! the producer's buffers), so making every member's outputs when the producer runs gives each
//! the value it gets when the members run in turn: the members read only what the producer
//! wrote and buffers nothing in the run writes, and no instruction lies between.
//!
//! The timeline prices a run as its producer and each quantization's writes (its read of the
//! tensor absorbed: `crate::timeline::fused`); the CPU backend runs every instruction alone.
use crate::fp8::recording_gemm;
use crate::ir::op::Op;
use crate::ir::{BufferId, Instr, Program};

/// One run: the producer's instruction index and its members'.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwigluRun {
    pub producer: usize,
    /// Its `Fp8Quantize` members, in program order.
    pub quantizes: Vec<usize>,
    /// Its `Fp8AmaxRecord` members, in program order.
    pub records: Vec<usize>,
}

impl SwigluRun {
    /// Every instruction of the run: the producer, then its members in program order.
    pub fn instructions(&self) -> Vec<usize> {
        let mut members: Vec<usize> = self
            .quantizes
            .iter()
            .chain(&self.records)
            .copied()
            .collect();
        members.sort_unstable();
        std::iter::once(self.producer).chain(members).collect()
    }
}

/// The tensors the SwiGLU epilogue of the compute instruction `instr` writes: the gated product
/// of a forward, dgate and dup of a data gradient. Empty for any other instruction.
pub fn epilogue_outputs(instr: &Instr) -> Vec<BufferId> {
    let Some(c) = instr.as_compute() else {
        return Vec::new();
    };
    match *c.op {
        Op::Matmul { swiglu: true, .. } => c.outputs.get(1).copied().into_iter().collect(),
        Op::MatmulBwdData { swiglu: true, .. } => c
            .outputs
            .get(..2)
            .map(<[BufferId]>::to_vec)
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// Every run of `program` (the module doc), in program order.
pub fn find_swiglu_runs(program: &Program) -> Vec<SwigluRun> {
    (program.computes())
        .filter_map(|(at, _)| run_at(program, at))
        .collect()
}

/// The run whose producer is instruction `at`, if it heads one.
fn run_at(program: &Program, at: usize) -> Option<SwigluRun> {
    let producer = &program.instrs[at];
    let written = epilogue_outputs(producer);
    if written.is_empty() {
        return None;
    }
    let c = producer.as_compute()?;
    let touched: Vec<BufferId> = c.inputs.iter().chain(c.outputs.iter()).copied().collect();
    let mut run = SwigluRun {
        producer: at,
        quantizes: Vec::new(),
        records: Vec::new(),
    };
    let mut quantized: Vec<BufferId> = Vec::new();
    let mut histories: Vec<BufferId> = Vec::new();
    let mut claimed: Vec<BufferId> = Vec::new();
    for j in at + 1..program.instrs.len() {
        let Some(m) = program.instrs[j].as_compute() else {
            break;
        };
        let x = m.inputs.first().copied();
        match *m.op {
            Op::Fp8AmaxRecord(_) => {
                let history = m.outputs.first().copied()?;
                let rides = recording_gemm(program, j).and_then(|q| program.instrs[q].as_compute());
                let on_member = rides.is_some_and(|q| {
                    matches!(*q.op, Op::Fp8Quantize(_)) && q.inputs.first().copied() == x
                });
                if !x.is_some_and(|x| written.contains(&x))
                    || !on_member
                    || touched.contains(&history)
                    || claimed.contains(&history)
                {
                    break;
                }
                histories.push(history);
                run.records.push(j);
            }
            Op::Fp8Quantize(_) => {
                let (Some(x), Some(&amax)) = (x, m.inputs.get(1)) else {
                    break;
                };
                let foreign = |b: &BufferId| {
                    touched.contains(b) || histories.contains(b) || claimed.contains(b)
                };
                if !written.contains(&x)
                    || quantized.contains(&x)
                    || foreign(&amax)
                    || m.outputs.iter().any(foreign)
                {
                    break;
                }
                quantized.push(x);
                claimed.extend(m.outputs.iter().copied());
                claimed.push(amax);
                run.quantizes.push(j);
            }
            _ => break,
        }
    }
    // A trailing record whose quantization is not in the run leaves it.
    let last_quantize = run.quantizes.last().copied()?;
    run.records.retain(|&r| r < last_quantize);
    Some(run)
}

/// Who reads the tensors `run`'s epilogue writes, besides the run itself: per tensor (in
/// [`epilogue_outputs`] order), the quantized FP8 GEMMs that read it, where nothing else does
/// and each reads it only as an operand it quantizes (inputs 0 and 1, and not the dy a bias
/// gradient sums exactly); None where anything else reads it (another op, a communication) or
/// it outlives the step. Such a GEMM reads the tensor itself only on a step it runs
/// unquantized (delayed scaling's cold first step, an empty history): on every other step a
/// backend may leave the tensor unstored and write only its quantizations.
pub fn quantized_readers(program: &Program, run: &SwigluRun) -> Vec<Option<Vec<usize>>> {
    let Some(producer) = program.instrs.get(run.producer) else {
        return Vec::new();
    };
    let own = run.instructions();
    let readers_of = |y: BufferId| -> Option<Vec<usize>> {
        if program.buffer(y)?.kind.is_persistent() {
            return None;
        }
        let mut gemms = Vec::new();
        for (at, instr) in program.instrs.iter().enumerate() {
            if own.contains(&at) || !instr.reads().contains(&y) {
                continue;
            }
            let c = instr.as_compute()?;
            let quantized = c.op.fp8().is_some_and(|g| g.quantized);
            let positions: Vec<usize> = (c.inputs.iter().enumerate())
                .filter(|&(_, &b)| b == y)
                .map(|(i, _)| i)
                .collect();
            let exact_dy =
                matches!(*c.op, Op::MatmulBwdWeight { bias: true, .. }) && positions.contains(&0);
            if !quantized || exact_dy || positions.iter().any(|&i| i > 1) {
                return None;
            }
            gemms.push(at);
        }
        Some(gemms)
    };
    epilogue_outputs(producer)
        .into_iter()
        .map(readers_of)
        .collect()
}

#[cfg(test)]
mod tests;
