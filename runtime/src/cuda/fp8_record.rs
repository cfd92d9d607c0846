//! Delayed FP8 scaling's amax records (`Op::Fp8AmaxRecord`), taken in the quantize pass of the
//! GEMM that follows each (`parc_compiler::fp8::recording_gemm`, which the verifier holds every
//! record of a program to have). When the executor runs a record that its prepared program
//! places before such a GEMM, the record is held here; that GEMM's `fp8_quantize_lines` or
//! `fp8_quantize_cols` of the recorded operand then max-adds the operand's largest finite
//! magnitude into the history's step amax while it reads the operand to quantize it: one read
//! of the operand instead of two. A held record that its GEMM does not take is launched on its
//! own (`fp8_amax_one`, as a record without a GEMM is): where the GEMM runs unquantized (its
//! first step, `fp8::delayed_cold`), and, defensively, once the executor is past the GEMM or
//! waits for the device. Either way the history holds every record before any instruction
//! after its GEMM runs, and its value is the same (a maximum is exact in any order), so the
//! CPU backend, which records apart, agrees bit for bit.
use super::args::Bound;
use super::{Buf, CudaBackend};
use crate::error::Result;
use cudarc::driver::sys::CUdeviceptr;
use parc_compiler::fp8::recording_gemm;
use parc_compiler::ir::fp8::Fp8HistoryAttrs;
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{BufferId, Program};
use std::collections::HashMap;

/// The records of the prepared program, and those held for their GEMMs.
#[derive(Default)]
pub(super) struct Records {
    /// For each record instruction of the prepared program, the GEMM instruction it rides on.
    rides: HashMap<usize, usize>,
    /// The instruction the executor runs now (`Backend::begin_instruction`).
    current: usize,
    held: Vec<Held>,
    /// Records taken in quantize passes so far ([`CudaBackend::fp8_records_in_quantize`]).
    taken: u64,
}

/// A record held for its GEMM: the operand, where its history's step amax is, and the GEMM.
#[derive(Clone, Copy)]
struct Held {
    operand: Buf,
    step_amax: CUdeviceptr,
    gemm: usize,
}

impl Records {
    /// Which records of `program` ride on which GEMMs.
    pub(super) fn prepare(&mut self, program: &Program) {
        self.rides = (program.computes())
            .filter(|(_, c)| matches!(c.op, Op::Fp8AmaxRecord(_)))
            .filter_map(|(i, _)| Some((i, recording_gemm(program, i)?)))
            .collect();
        self.held.clear();
    }

    /// The executor runs instruction `index` next.
    pub(super) fn begin(&mut self, index: usize) {
        self.current = index;
    }

    /// The instruction the executor runs now.
    pub(super) fn current(&self) -> usize {
        self.current
    }

    /// `n` records were taken in a fused pass (`swiglu_fp8`), not held.
    pub(super) fn count_taken(&mut self, n: usize) {
        self.taken += n as u64;
    }
}

impl CudaBackend {
    /// `Op::Fp8AmaxRecord`: the operand's largest finite |element| max-added into its history's
    /// step amax (element 0), not zeroed first: held for the GEMM it rides on, else now.
    pub(super) fn record_amax(&mut self, b: &Bound, a: &Fp8HistoryAttrs) -> Result<()> {
        let (operand, history) = (b.input(0)?, b.output(0)?);
        if history.len as u64 != u64::from(a.history) + 1 {
            return Err(b.err(format!(
                "records into a history of {} values, not {} (the step's amax and {} steps)",
                history.len,
                u64::from(a.history) + 1,
                a.history
            )));
        }
        if operand.len == 0 {
            return Ok(());
        }
        let records = &mut self.records;
        match records.rides.get(&records.current) {
            Some(&gemm) => {
                records.held.push(Held {
                    operand,
                    step_amax: history.ptr,
                    gemm,
                });
                Ok(())
            }
            None => super::fp8::max_into_one(self, operand, operand.len as u64, history.ptr),
        }
    }

    /// For the GEMM running now, the step amax its quantize pass of `operand` records into,
    /// if a held record of that operand rides on it (taken: the caller must record it).
    pub(super) fn take_record(&mut self, operand: BufferId) -> Option<CUdeviceptr> {
        let records = &mut self.records;
        let current = records.current;
        let at =
            (records.held.iter()).position(|h| h.gemm == current && h.operand.id == operand)?;
        records.taken += 1;
        Some(records.held.swap_remove(at).step_amax)
    }

    /// How many delayed-scaling records GEMMs have taken in their quantize passes so far (the
    /// others were made apart): for tests and diagnosis.
    pub fn fp8_records_in_quantize(&self) -> u64 {
        self.records.taken
    }

    /// Launches the held records on their own: all of them (`all`), or those whose GEMM the
    /// executor is past.
    pub(super) fn flush_records(&mut self, all: bool) -> Result<()> {
        let current = self.records.current;
        let (due, keep) =
            (self.records.held.iter()).partition::<Vec<Held>, _>(|h| all || h.gemm < current);
        self.records.held = keep;
        for h in due {
            let len = h.operand.len as u64;
            super::fp8::max_into_one(self, h.operand, len, h.step_amax)?;
        }
        Ok(())
    }
}
