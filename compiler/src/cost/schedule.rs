//! Pipeline schedule arithmetic: how many microbatches' activations a stage holds at its peak
//! and the bubble fraction of the step.
//!
//! - GPipe runs all m forwards before any backward: every stage holds m microbatches.
//! - 1F1B (PipeDream-Flush) warms up with p − s forwards on stage s (0-based), then alternates:
//!   min(p − s, m) microbatches in flight.
//! - Interleaved 1F1B (Narayanan et al. 2021, Megatron's schedule) with v chunks per stage: stage
//!   s warms up with 2(p − s − 1) + (v − 1)·p chunk-forwards and runs one more before its first
//!   backward, so min(2(p − s − 1) + (v − 1)·p + 1, v·m) chunk-microbatches are in flight, each
//!   holding 1/v of the stage's layers (stage 0: 1 + (p − 1)/(p·v) times 1F1B's p microbatches).
//! - Bubble: (p − 1)/(m + p − 1) for GPipe and 1F1B; (p − 1)/(v·m + p − 1) interleaved.

use crate::lower::{stage_order, Dir};
use crate::spec::PipelineSchedule;
use serde::Serialize;

/// How much a stage holds at its peak.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct InFlight {
    /// In units of the stage's layers for one microbatch: in-flight chunk-microbatches / v.
    pub layer_microbatches: f64,
    /// Microbatches alive in the first model chunk (it holds the embedding output), for stage 0.
    pub first_chunk: u32,
    /// Microbatches alive in the last model chunk (it holds the logits), for the last stage.
    pub last_chunk: u32,
}

/// Chunk-microbatches alive at once on `stage` (for GPipe and 1F1B a chunk is the whole stage).
pub fn chunk_microbatches_in_flight(
    schedule: PipelineSchedule,
    p: u32,
    v: u32,
    m: u32,
    stage: u32,
) -> u32 {
    // u64 so that no plan's numbers can overflow.
    let (p, v, m) = (u64::from(p), u64::from(v.max(1)), u64::from(m));
    let behind = p.saturating_sub(u64::from(stage) + 1);
    let count = match schedule {
        PipelineSchedule::Gpipe => m * v,
        PipelineSchedule::Interleaved { .. } if v > 1 => (2 * behind + (v - 1) * p + 1).min(v * m),
        PipelineSchedule::OneFOneB | PipelineSchedule::Interleaved { .. } => (behind + 1).min(m),
    };
    u32::try_from(count).unwrap_or(u32::MAX)
}

/// Microbatches in flight on `stage` at its peak, in Megatron's sense (the verifier's
/// `peak_microbatches_in_flight`): microbatch k is in flight from its first forward unit on
/// the stage to its last backward unit there. Counted on the lowering's own unit order
/// (`lower::stage_order`), so under interleaving it counts microbatches, not
/// chunk-microbatches or their activations.
pub fn microbatches_in_flight(
    schedule: PipelineSchedule,
    p: u32,
    v: u32,
    m: u32,
    stage: u32,
) -> u32 {
    // GPipe and 1F1B in closed form (the search estimates thousands of plans, and the order
    // is m·v units a stage); interleaved on the order itself, of at most 2p microbatches: past
    // them the steady state repeats and the peak does not grow (a test holds it to the whole
    // order's).
    match schedule {
        PipelineSchedule::Gpipe => m,
        _ if v <= 1 => chunk_microbatches_in_flight(schedule, p, 1, m, stage),
        _ => in_flight_on_order(schedule, p, v, m.min(2 * p), stage),
    }
}

/// [`microbatches_in_flight`] counted on the lowering's unit order of `stage`: the peak number
/// of microbatches between their first forward unit and their last backward unit.
pub(super) fn in_flight_on_order(
    schedule: PipelineSchedule,
    p: u32,
    v: u32,
    m: u32,
    stage: u32,
) -> u32 {
    let order = stage_order(schedule, p.max(1), v.max(1), m.max(1), stage);
    // spans[k] = (first forward, last backward) positions of microbatch k.
    let mut spans = vec![(usize::MAX, 0usize); m.max(1) as usize];
    for (at, unit) in order.iter().enumerate() {
        let Some(span) = spans.get_mut(unit.microbatch as usize) else {
            continue;
        };
        match unit.dir {
            Dir::Forward => span.0 = span.0.min(at),
            Dir::Backward => span.1 = span.1.max(at),
        }
    }
    crate::verify::peak_in_flight(&spans)
}

pub fn in_flight_layers_factor(
    schedule: PipelineSchedule,
    p: u32,
    v: u32,
    m: u32,
    stage: u32,
) -> InFlight {
    let v = v.max(1);
    let chunks = chunk_microbatches_in_flight(schedule, p, v, m, stage);
    let (first_chunk, last_chunk) = match schedule {
        PipelineSchedule::Gpipe => (m, m),
        _ => (p.min(m), 1),
    };
    InFlight {
        layer_microbatches: f64::from(chunks) / f64::from(v),
        first_chunk,
        last_chunk,
    }
}

/// Idle fraction of the step from pipeline fill and drain.
pub fn bubble_fraction(schedule: PipelineSchedule, p: u32, v: u32, m: u32) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let idle = f64::from(p - 1);
    let work = match schedule {
        PipelineSchedule::Interleaved { .. } => f64::from(v.max(1)) * f64::from(m),
        _ => f64::from(m),
    };
    idle / (work + idle)
}

/// The smallest microbatch count whose bubble is below `limit` (for interleaving, a multiple of
/// p as the schedule requires).
pub fn microbatches_for_bubble(schedule: PipelineSchedule, p: u32, v: u32, limit: f64) -> u32 {
    let step = match schedule {
        PipelineSchedule::Interleaved { .. } if v > 1 => p.max(1),
        _ => 1,
    };
    let work = match schedule {
        PipelineSchedule::Interleaved { .. } => f64::from(v.max(1)),
        _ => 1.0,
    };
    if p <= 1 || limit <= 0.0 {
        return step;
    }
    // (p−1)/(w·m + p − 1) < limit  ⇔  m > (p−1)(1/limit − 1)/w.
    let bound = f64::from(p - 1) * (1.0 / limit - 1.0) / work;
    let first = (bound.floor() + 1.0).min(f64::from(u32::MAX / 2)) as u32;
    let mut m = first.div_ceil(step).max(1) * step;
    // Guard the float bound at its edge.
    while m > step && bubble_fraction(schedule, p, v, m - step) < limit {
        m -= step;
    }
    while bubble_fraction(schedule, p, v, m) >= limit && m < u32::MAX / 2 {
        m += step;
    }
    m
}
