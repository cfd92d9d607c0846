//! The verifier: proves a lowered [`Plan`] can run before any backend sees it, and measures each
//! program's peak memory from buffer liveness (what the runtime's memory planner consumes).
//!
//! Invariants checked (each violation names the rank, the instruction index and, where the
//! instruction has one, the spec node):
//! 1. **Buffers exist**: every buffer an instruction names is in its program's arena (E0810).
//! 2. **Defined before use**: an instruction reads or writes only live buffers: persistent ones,
//!    or transients between their `Alloc` and `Free` (E0811).
//! 3. **Freed once**: `Free` only of a live transient (a second `Free` is a double free), `Alloc`
//!    only of a dead transient, never `Alloc`/`Free` of a persistent buffer (E0812); no transient
//!    outlives the step (E0813).
//! 4. **Collectives agree**: the members of a group's set issue their collectives in the same
//!    order: at each rendezvous all members issue the same kind (and root) for the same spec
//!    node, with sizes that fit the kind (all-gather output = n × input, reduce-scatter input =
//!    n × output, otherwise equal) and equal inputs across members (E0814). Every rank that
//!    names a group belongs to one of its sets (E0815).
//! 5. **Point-to-point matches**: with rendezvous semantics (a `Send` completes only with the
//!    peer's matching `Recv`: same pair of ranks, same tag; a `P2p` group completes when all of
//!    its operations have) every transfer is matched with equal element counts and types (E0816), and
//!    every rank runs to the end of its program: no deadlock, no unmatched or misordered
//!    transfer, no collective some member never reaches (E0817, with where each stuck rank
//!    waits).
//!
//! 6. **Types fit**: every operand's dtype is one its op accepts (`ir::storage`), a
//!    collective's input and output share one type, `LoadBatch` fills i32 buffers (E0819).
//! 7. **In place is one buffer**: an op that updates an input in place (`Op::in_place`) names
//!    the same buffer as that input and as the output it becomes (E0820).
//! 8. **Accumulation reads no input**: an output an op adds into (`Op::accumulates`) is not
//!    also one of its inputs (E0821); a `MatmulBwdData` with `act_grad` does not accumulate,
//!    and a GEMM with a `swiglu` epilogue has no other (E0822); an op overwriting its parameter gradients is their first writer since their
//!    allocation (E0823).
//! 9. **FP8 scales are shared by exactly their group**: every FP8 GEMM operand's split across
//!    ranks agrees with the plan (tp as its weight's `TpSplit`, cp on the tokens, never dp or
//!    pp), and each operand whose scale groups span ranks (`ir::fp8`) reads amaxes of that
//!    operand computed by `Fp8Amax` and max all-reduced over a group family spanning exactly
//!    those axes: not a subset, not a superset; under delayed scaling each operand's history is
//!    reduced so before its roll, and every `Fp8AmaxRecord` is followed by the delayed FP8 GEMM
//!    that quantizes its operand, which records it (`crate::fp8::recording_gemm`) (E0824;
//!    `fp8`).
//!
//! Invariants 1–3, 6–9 and the liveness numbers are per program (ranks sharing a program are
//! alike); 4–5 come from simulating all ranks together ([`rendezvous`]). Ranks whose programs
//! differ only in the dp coordinate are simulated once: when every rank runs the program of its
//! dp-0 counterpart and no transfer crosses dp, the dp-0 slice's run is the whole run (each rank
//! is in its counterpart's state at every step, by induction), so a 1,024-GPU plan with dp = 16
//! simulates 64 ranks. The same argument lets tp (cp) index 1 stand for indices ≥ 2 in a class
//! plan (`Plan::representative`, where they run one program): the 70B plan on 64 GPUs then
//! simulates 16 ranks (`slice`). Otherwise every rank is simulated.

mod accumulation;
mod dtypes;
mod fp8;
mod in_place;
mod liveness;
mod rendezvous;
pub(crate) mod slice;
#[cfg(test)]
mod tests;

pub use liveness::{peak_in_flight, ProgramMemory};

use crate::diag::{Diagnostic, Diagnostics};
use crate::ir::{Plan, ProgramId};
use crate::spec::{NodeId, Spec};
use serde::Serialize;

/// What the verifier measured on a plan that passed.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    /// One entry per program, in program order.
    pub programs: Vec<ProgramMemory>,
    /// Ranks simulated (the dp-0 slice when the plan is dp-symmetric, else the world).
    pub ranks_simulated: u32,
    /// Whether the dp symmetry reduction applied.
    pub dp_symmetric: bool,
}

impl VerifyReport {
    pub fn program(&self, id: ProgramId) -> Option<&ProgramMemory> {
        self.programs.get(id.0 as usize)
    }
    /// The largest peak over all programs, in bytes.
    pub fn peak_bytes(&self) -> u64 {
        self.programs
            .iter()
            .map(|p| p.peak_bytes)
            .max()
            .unwrap_or(0)
    }
}

/// One broken invariant, located exactly.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Violation {
    pub code: &'static str,
    /// The rank whose instruction breaks it (the lowest rank running the program for
    /// per-program invariants).
    pub rank: u32,
    pub program: ProgramId,
    /// Index into the program's `instrs` (its length for "at the end of the step").
    pub instr: usize,
    /// The spec node the instruction implements, if any.
    pub node: Option<NodeId>,
    pub message: String,
}

impl Violation {
    fn to_diagnostic(&self, spec: Option<&Spec>) -> Diagnostic {
        let node = self.node.and_then(|n| spec?.model.nodes.get(n.0 as usize));
        let at = match (node, self.node) {
            (Some(n), _) => format!(" (node `{}`)", n.name),
            (None, Some(id)) => format!(" (node n{})", id.0),
            (None, None) => String::new(),
        };
        let mut d = Diagnostic::error(
            self.code,
            format!(
                "rank {}, instruction {}{at}: {}",
                self.rank, self.instr, self.message
            ),
        );
        if let Some(n) = node {
            d = d.label(n.span, "lowered from this layer");
        } else if let Some(spec) = spec {
            d = d.label(spec.parallel.span, "lowered from this plan");
        }
        d.help("this is a bug in parc's lowering: please report it with the spec and `parc plan --emit text`")
    }
}

/// The violations one per-program check (invariants 6–9) finds in a program run by `rank` (the
/// lowest rank running it): at most [`Findings::MAX`], the first ones, which say what is wrong.
pub(super) struct Findings {
    program: ProgramId,
    rank: u32,
    found: Vec<Violation>,
}

impl Findings {
    /// Violations kept per program and check.
    const MAX: usize = 16;

    pub(super) fn new(program: ProgramId, rank: u32) -> Findings {
        Findings {
            program,
            rank,
            found: Vec::new(),
        }
    }

    /// Violation `code` at instruction `instr` (of spec node `node`); `message` is built only
    /// while fewer than [`Findings::MAX`] are kept.
    pub(super) fn push(
        &mut self,
        code: &'static str,
        instr: usize,
        node: Option<NodeId>,
        message: impl FnOnce() -> String,
    ) {
        if self.found.len() < Findings::MAX {
            self.found.push(Violation {
                code,
                rank: self.rank,
                program: self.program,
                instr,
                node,
                message: message(),
            });
        }
    }

    pub(super) fn into_vec(self) -> Vec<Violation> {
        self.found
    }
}

/// Everything the verifier found: the report and every violation (empty when the plan passed).
#[derive(Clone, Debug)]
pub struct Outcome {
    pub report: VerifyReport,
    pub violations: Vec<Violation>,
}

/// Check every invariant of the module header; return the measured report and all violations.
pub fn check(plan: &Plan) -> Outcome {
    let mut first_rank = vec![0u32; plan.programs.len()];
    for (r, p) in plan.rank_program.iter().enumerate().rev() {
        if let Some(slot) = first_rank.get_mut(p.0 as usize) {
            *slot = r as u32;
        }
    }
    // Programs are independent here: analyse them on all cores, keep program order.
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, plan.programs.len().max(1));
    let per_thread = plan.programs.len().div_ceil(threads).max(1);
    let analysed: Vec<(ProgramMemory, Vec<Violation>, rendezvous::ProgramIndex)> =
        std::thread::scope(|scope| {
            let handles: Vec<_> = plan
                .programs
                .chunks(per_thread)
                .enumerate()
                .map(|(c, chunk)| {
                    let first_rank = &first_rank;
                    scope.spawn(move || {
                        chunk
                            .iter()
                            .enumerate()
                            .map(|(k, program)| {
                                let i = c * per_thread + k;
                                analyse(plan, program, ProgramId(i as u32), first_rank[i])
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
    // A worker that died (it cannot: the analysis has no panicking path) is redone here.
    let analysed = if analysed.len() == plan.programs.len() {
        analysed
    } else {
        plan.programs
            .iter()
            .enumerate()
            .map(|(i, p)| analyse(plan, p, ProgramId(i as u32), first_rank[i]))
            .collect()
    };
    let mut violations = Vec::new();
    let mut programs = Vec::with_capacity(plan.programs.len());
    let mut indices = Vec::with_capacity(plan.programs.len());
    for (memory, found, index) in analysed {
        programs.push(memory);
        violations.extend(found);
        indices.push(index);
    }
    // Rendezvous on programs with broken buffers would report the same fault twice.
    let (ranks_simulated, dp_symmetric) = if violations.is_empty() {
        let sim = rendezvous::simulate(plan, &indices);
        violations.extend(sim.violations);
        (sim.ranks_simulated, sim.dp_symmetric)
    } else {
        (0, false)
    };
    Outcome {
        report: VerifyReport {
            programs,
            ranks_simulated,
            dp_symmetric,
        },
        violations,
    }
}

/// One program's liveness and the invariants checked per program (liveness's violations, then
/// types, in-place updates, accumulation and FP8 scales'), with its rendezvous index.
fn analyse(
    plan: &Plan,
    program: &crate::ir::Program,
    id: ProgramId,
    rank: u32,
) -> (ProgramMemory, Vec<Violation>, rendezvous::ProgramIndex) {
    let (memory, mut found, index) = liveness::analyse(program, id, rank);
    found.extend(dtypes::check(program, id, rank));
    found.extend(in_place::check(program, id, rank));
    found.extend(accumulation::check(program, id, rank));
    found.extend(fp8::check(plan, program, id, rank));
    (memory, found, index)
}

fn finish(outcome: Outcome, spec: Option<&Spec>) -> Result<VerifyReport, Diagnostics> {
    if outcome.violations.is_empty() {
        return Ok(outcome.report);
    }
    let mut diags = Diagnostics::default();
    for v in &outcome.violations {
        diags.push(v.to_diagnostic(spec));
    }
    Err(diags)
}

/// Verify a plan: its report, or one diagnostic per violation (nodes named by id).
pub fn verify(plan: &Plan) -> Result<VerifyReport, Diagnostics> {
    finish(check(plan), None)
}

/// Verify a plan lowered from `spec`: as [`verify`], with node names and spans in the
/// diagnostics.
pub fn verify_spec(plan: &Plan, spec: &Spec) -> Result<VerifyReport, Diagnostics> {
    finish(check(plan), Some(spec))
}
