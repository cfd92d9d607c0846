//! The simulated timeline of one training step: every rank's program run against a cost model
//! ([`costs`]: the GPU's peak numbers, or a measured calibration [`profile`] through
//! [`calibrated`]) under the IR's semantics, giving per-rank busy, exposed-communication and idle
//! time, the pipeline bubble, and a Chrome trace-event file for Perfetto.
//!
//! Execution model (what a stream-ordered GPU runtime does):
//! - Each rank has a **compute stream** and a **comm stream**. Compute ops run in program order
//!   on the compute stream, each starting once the buffers it reads or writes are ready.
//! - A **collective** is issued at the compute stream's current time and runs on the comm
//!   stream once every member of its set has issued it and each member's comm stream is free;
//!   the compute stream does not wait for it, only for its output when an op uses it (this is
//!   how gradient buckets overlap backward). Waiting for such an output is *exposed
//!   communication*.
//! - A **point-to-point** group goes on a third stream, the **transfer stream** (the CUDA
//!   backend queues pipeline transfers on a stream and NCCL communicator of their own, as
//!   Megatron-LM does, so a receive waiting for a slower peer does not hold back the tp/dp
//!   collectives queued after it): it is posted once the compute stream has reached it, its
//!   sends' data is written and the transfer stream's earlier groups are done; each transfer
//!   starts when both sides have posted it and the group completes when all its transfers
//!   have. The compute stream
//!   goes on; it waits for the group only where an op reads a received buffer or a sent or
//!   received buffer is freed or overwritten. Such a wait is idle time (the pipeline bubble)
//!   until the group's last transfer starts, exposed communication after.
//! - A run of optimizer updates (or of gradient clipping's sums of squares) that the backend
//!   launches as one ([`fused`]: the CUDA backend's multi-tensor kernels) is one op at its first
//!   member's position, waiting for every member's buffers; its later members (and the refresh
//!   copies of bf16 working copies it absorbed) take no time.
//! - `Alloc`, `Free` and `LoadBatch` take no time, but a `Free` of a buffer a collective still
//!   uses waits for it, as the runtime does (the memory plan hands the bytes on).
//!
//! Checked against the formulas with uniform stage costs and free communication, for the mean
//! over stages and for the last stage: GPipe and 1F1B give (p−1)/(m+p−1), interleaved 1F1B
//! Narayanan et al.'s (p−1)/(v·m+p−1), for any forward/backward cost ratio (the lowering frees
//! a sent buffer only after the next unit, so no stage waits for its peer to take a send).
//!
//! Per rank, idle = step − busy − exposed communication, where the step ends when the last rank
//! finishes; the bubble fraction is the mean idle time over the step. Ranks are simulated with
//! the verifier's symmetry reductions (dp replicas behave identically; in a class plan tp/cp
//! index 1 stands for its class), so the trace has one track per simulated rank and the means
//! weight each by the ranks it stands for. Run the verifier first: a plan that deadlocks gives a timeline with
//! `complete = false`.

pub mod calibrated;
pub mod costs;
mod engine;
pub mod fused;
pub mod profile;
#[cfg(test)]
mod tests;

pub use calibrated::{Calibration, ProfileCosts};
pub use costs::{SpecCosts, StepCosts};
pub use fused::{compute_seconds, FusedRuns};

use crate::ir::{Plan, ProgramId};
use crate::spec::Spec;
use serde::Serialize;
use std::sync::Arc;

/// The simulated step.
#[derive(Clone, Debug, Serialize)]
pub struct Timeline {
    pub step_seconds: f64,
    /// Mean over ranks of idle time / step.
    pub bubble_fraction: f64,
    /// Mean over ranks of exposed communication / step.
    pub exposed_comm_fraction: f64,
    pub ranks: Vec<RankTimeline>,
    /// Trace events, by rank then start time; back-to-back compute ops of one node and phase
    /// are merged into one event (of one layer and phase for plans over a million simulated
    /// instructions). Empty unless the simulation recorded them ([`Events::Record`]).
    pub events: Vec<TraceEvent>,
    /// Whether only the dp-0 slice was simulated (its replicas are identical).
    pub dp_symmetric: bool,
    /// False when some rank could not finish its program (the plan does not verify).
    pub complete: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct RankTimeline {
    pub rank: u32,
    pub program: ProgramId,
    pub role: String,
    /// Time the compute stream runs ops.
    pub busy_seconds: f64,
    /// Time the comm stream runs collectives and transfers (overlapped or not).
    pub comm_seconds: f64,
    /// Time the compute stream waits on communication.
    pub exposed_comm_seconds: f64,
    /// step − busy − exposed.
    pub idle_seconds: f64,
    /// When this rank's last op ends.
    pub end_seconds: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Row {
    Compute,
    Comm,
}

#[derive(Clone, Debug, Serialize)]
pub struct TraceEvent {
    pub rank: u32,
    pub row: Row,
    /// What ran (`blocks.3.attn fwd`, `all_reduce tp`, `p2p`), shared by the events of one
    /// name.
    pub name: Arc<str>,
    pub start: f64,
    pub duration: f64,
    /// Instruction range `[first, last]` of the program this event covers.
    pub first_instr: usize,
    pub last_instr: usize,
}

/// Whether a simulation records its trace events ([`Timeline::events`]): only a trace shows
/// them, and a large plan's step has hundreds of thousands (~300k for the 70B example, which
/// `parc check` simulates only for its numbers). The numbers are the same either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Events {
    Record,
    Skip,
}

/// Simulate one step of `plan` with costs from `spec`'s GPU and links.
pub fn simulate(plan: &Plan, spec: &Spec) -> Timeline {
    simulate_with(plan, spec, &SpecCosts { spec })
}

/// Simulate with the costs of `calibration`'s profile ([`ProfileCosts`]), or of the spec's GPU
/// peak numbers ([`SpecCosts`]) without one; its trace events as `events` says.
pub fn simulate_calibrated(
    plan: &Plan,
    spec: &Spec,
    calibration: Option<&Calibration>,
    events: Events,
) -> Timeline {
    match calibration {
        Some(calibration) => engine::run(plan, spec, &ProfileCosts::new(calibration, spec), events),
        None => engine::run(plan, spec, &SpecCosts { spec }, events),
    }
}

/// Simulate with any cost model (`spec` names nodes and places ranks on nodes).
pub fn simulate_with(plan: &Plan, spec: &Spec, costs: &dyn StepCosts) -> Timeline {
    engine::run(plan, spec, costs, Events::Record)
}

impl Timeline {
    /// The Chrome trace-event JSON (open in Perfetto or chrome://tracing): one process per rank
    /// with a `compute` and a `comm` thread; times in microseconds.
    pub fn to_chrome_trace(&self) -> String {
        self.to_chrome_trace_of(|_| true)
    }

    /// As [`Timeline::to_chrome_trace`], keeping only the ranks `keep` accepts (big plans'
    /// traces are large: `parc plan --rank R` can keep one).
    pub fn to_chrome_trace_of(&self, keep: impl Fn(u32) -> bool) -> String {
        let mut events = Vec::with_capacity(self.events.len() + 3 * self.ranks.len());
        for r in self.ranks.iter().filter(|r| keep(r.rank)) {
            events.push(serde_json::json!({
                "name": "process_name", "ph": "M", "pid": r.rank,
                "args": {"name": format!("rank {} ({})", r.rank, r.role)}
            }));
            events.push(serde_json::json!({
                "name": "process_sort_index", "ph": "M", "pid": r.rank,
                "args": {"sort_index": r.rank}
            }));
            for (tid, name) in [(0, "compute"), (1, "comm")] {
                events.push(serde_json::json!({
                    "name": "thread_name", "ph": "M", "pid": r.rank, "tid": tid,
                    "args": {"name": name}
                }));
            }
        }
        for e in self.events.iter().filter(|e| keep(e.rank)) {
            events.push(serde_json::json!({
                "name": e.name,
                "cat": match e.row { Row::Compute => "compute", Row::Comm => "comm" },
                "ph": "X",
                "ts": e.start * 1e6,
                "dur": e.duration * 1e6,
                "pid": e.rank,
                "tid": match e.row { Row::Compute => 0, Row::Comm => 1 },
                "args": {"instrs": format!("{}..={}", e.first_instr, e.last_instr)}
            }));
        }
        serde_json::json!({
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "step_seconds": self.step_seconds,
                "bubble_fraction": self.bubble_fraction,
                "exposed_comm_fraction": self.exposed_comm_fraction,
                "dp_symmetric": self.dp_symmetric,
                "complete": self.complete,
            }
        })
        .to_string()
    }
}
