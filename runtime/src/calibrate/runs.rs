//! The optimizer as a step runs it: runs of `AdamW` updates and of gradient clipping's
//! `SumSquares` over a model's parameter list (many tensors of mixed sizes), timed whole through
//! the `Backend` trait, as memory points of their own op ([`multi_op_name`]: `adam_w_multi`,
//! `sum_squares_multi`) by the members' summed bytes.
//!
//! Each run is a program of its own (`Alloc`s, the run, `Free`s), memory-planned and given to
//! `Backend::prepare` as the executor gives a step's, so a backend that fuses such runs (the
//! CUDA backend: one multi-tensor launch per run, `parc_compiler::ir::optimizer_runs`) fuses
//! this one; the CPU backend runs its members one by one. A sample runs every member in program
//! order. Afterwards the backend is given an empty program, which hands the plan's memory back;
//! it stays a planned backend (CUDA then runs GEMMs on the plan's casts and scratch only), so
//! calibrate measures the runs last.
use super::{Bench, Grid};
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{Buffer, BufferId, BufferKind, DType, Instr, Program};
use parc_compiler::memplan::plan_program;
use parc_compiler::timeline::profile::{multi_op_name, MemoryKind, MemoryPoint};

/// Layers of the model a run's tensors are drawn from, about, at the width that gives its size
/// (the grid's sizes get 14 to 21: 168 to 252 tensors; GPT-2 124M and 350M and Llama 3.2 1B
/// update 114 to 292).
const LAYERS: f64 = 16.0;

/// The tensors of a GPT-style model of about `elements` parameters: per layer two norms' weight
/// and bias (d each), the attention's qkv and output projections (3d², d²) and the MLP's two
/// (4d² each), each with its bias (3d, d, 4d, d): 12d² + 13d elements. d is the power of two
/// that gives about [`LAYERS`] layers, their number the one nearest `elements`.
pub(super) fn model_tensors(elements: u64) -> Vec<u64> {
    let per_layer = |d: u64| 12 * d * d + 13 * d;
    let width = (elements as f64 / (12.0 * LAYERS)).sqrt().max(1.0);
    let d = 1u64 << width.log2().round() as u32;
    let layers = ((elements as f64 / per_layer(d) as f64).round() as u64).max(1);
    let layer = [
        d,
        d,
        3 * d * d,
        3 * d,
        d * d,
        d,
        d,
        d,
        4 * d * d,
        4 * d,
        4 * d * d,
        d,
    ];
    (0..layers).flat_map(|_| layer).collect()
}

/// A program of one run over tensors of `sizes` elements: AdamW updates (gradient, clip
/// coefficient; parameter, m, v) or sums of squares of the gradients into one scalar.
pub(super) fn run_program(op: &Op, sizes: &[u64]) -> Program {
    let buffer = |name: String, n: u64, kind: BufferKind| Buffer {
        name,
        shape: vec![n],
        dtype: DType::F32,
        kind,
    };
    let sums = matches!(op, Op::SumSquares);
    // Buffer 0: the clip coefficient (transient), or the sum of squares (a metric).
    let mut buffers = vec![match sums {
        true => buffer("grad_sumsq".into(), 1, BufferKind::Metric),
        false => buffer("clip_coef".into(), 1, BufferKind::Comm),
    }];
    let mut allocs = Vec::new();
    let mut computes = Vec::new();
    for (t, &n) in sizes.iter().enumerate() {
        let g = BufferId(buffers.len() as u32);
        buffers.push(buffer(format!("grad{t}"), n, BufferKind::Grad));
        allocs.push(g);
        if sums {
            computes.push(Instr::compute(op.clone(), &[g.0], &[0]));
            continue;
        }
        let param = buffers.len() as u32;
        buffers.push(buffer(format!("param{t}"), n, BufferKind::Param));
        buffers.push(buffer(format!("m{t}"), n, BufferKind::OptState));
        buffers.push(buffer(format!("v{t}"), n, BufferKind::OptState));
        let outputs = [param, param + 1, param + 2];
        computes.push(Instr::compute(op.clone(), &[g.0, 0], &outputs));
    }
    if !sums {
        allocs.insert(0, BufferId(0));
    }
    let mut instrs: Vec<Instr> = (allocs.iter())
        .map(|&buffer| Instr::Alloc { buffer })
        .collect();
    instrs.extend(computes);
    instrs.extend(allocs.iter().map(|&buffer| Instr::Free { buffer }));
    Program::new("calibrate", buffers, instrs)
}

impl Bench<'_> {
    /// The runs' points: AdamW and sums of squares over a model's tensors at each of the grid's
    /// memory sizes (its elements: the model's parameters).
    pub(super) fn optimizer_runs(&mut self, grid: &Grid) -> Result<Vec<MemoryPoint>> {
        let adamw = Op::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut points = Vec::new();
        for &elements in &grid.memory_elements {
            let sizes = model_tensors(elements);
            for op in [&adamw, &Op::SumSquares] {
                let program = run_program(op, &sizes);
                let (seconds, bytes) = self.time_run(&program)?;
                points.push(MemoryPoint {
                    kind: MemoryKind::Optimizer,
                    bytes,
                    op: Some(multi_op_name(op.opcode())),
                    cols: None,
                    seconds,
                });
            }
        }
        Ok(points)
    }

    /// The median seconds of `program`'s compute instructions run in order, under its memory
    /// plan, and the bytes they touch as the timeline counts them.
    fn time_run(&mut self, program: &Program) -> Result<(f64, f64)> {
        let layout = plan_program(program).map_err(|e| RuntimeError::Op {
            op: "calibrate".into(),
            what: format!("{e} (a bug in calibrate's run program)"),
        })?;
        self.backend.prepare(program, &layout)?;
        let mut allocated = Vec::new();
        let timed = self.time_planned(program, &mut allocated);
        let freed: Result<()> = (allocated.into_iter()).try_for_each(|id| self.backend.free(id));
        let released = self.release_plan();
        let timed = timed?;
        freed?;
        released?;
        Ok(timed)
    }

    fn time_planned(
        &mut self,
        program: &Program,
        allocated: &mut Vec<BufferId>,
    ) -> Result<(f64, f64)> {
        let read: Vec<BufferId> = (program.computes())
            .flat_map(|(_, c)| c.inputs.to_vec())
            .collect();
        for (i, buffer) in program.buffers.iter().enumerate() {
            let id = BufferId(i as u32);
            self.backend.alloc(id, &buffer.shape, buffer.dtype)?;
            allocated.push(id);
            if read.contains(&id) {
                self.fill_f32(id, buffer.numel() as usize)?;
            }
        }
        let calls: Vec<_> = (program.computes())
            .map(|(_, c)| (c.op, &c.inputs[..], &c.outputs[..]))
            .collect();
        let bytes = (program.computes())
            .map(|(_, c)| self.touched(program, c.op, c.inputs, c.outputs))
            .sum();
        Ok((self.median(&calls)?, bytes))
    }

    /// Bytes `op` touches on these buffers of `program`, as the timeline counts them.
    fn touched(
        &self,
        program: &Program,
        op: &Op,
        inputs: &[BufferId],
        outputs: &[BufferId],
    ) -> f64 {
        let bytes = |ids: &[BufferId], i: usize| {
            (ids.get(i).and_then(|&id| program.buffer(id)))
                .map_or(0.0, |b| (b.numel() * self.timeline_bytes(b.dtype)) as f64)
        };
        op.signature()
            .bytes_touched(0, |i| bytes(inputs, i), |i| bytes(outputs, i))
    }

    /// Hands the memory plan back: the backend is given an empty program's.
    fn release_plan(&mut self) -> Result<()> {
        let empty = Program::new("calibrate", Vec::new(), Vec::new());
        let layout = plan_program(&empty).map_err(|e| RuntimeError::Op {
            op: "calibrate".into(),
            what: e.to_string(),
        })?;
        self.backend.prepare(&empty, &layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parc_compiler::ir::optimizer_runs::{find_runs, find_sum_squares_runs};

    #[test]
    fn model_tensors_have_about_the_elements_asked_for() {
        for elements in [1u64 << 10, 1 << 14, 1 << 20, 1 << 28] {
            let sizes = model_tensors(elements);
            let total: u64 = sizes.iter().sum();
            let ratio = total as f64 / elements as f64;
            assert!((0.6..1.6).contains(&ratio), "{elements}: {total}");
            assert!(sizes.len() >= 12 * 8, "{elements}: {} tensors", sizes.len());
            assert!(sizes.iter().min() < sizes.iter().max());
        }
    }

    #[test]
    fn each_run_program_is_one_fused_run_of_every_member() {
        let sizes = model_tensors(1 << 14);
        let adamw = Op::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let updates = run_program(&adamw, &sizes);
        let runs = find_runs(&updates);
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].members.len(), sizes.len());
        let sums = run_program(&Op::SumSquares, &sizes);
        let runs = find_sum_squares_runs(&sums);
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].members.len(), sizes.len());
        for program in [&updates, &sums] {
            plan_program(program).unwrap();
        }
    }
}
