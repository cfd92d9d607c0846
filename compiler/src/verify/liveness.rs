//! Per-program buffer checks (existence, defined before use, alloc/free pairing, nothing left
//! alive at the end of the step) and liveness numbers: persistent bytes, the peak of live
//! transient bytes and where it occurs, and the peak number of microbatches in flight.
//!
//! Microbatches in flight (Megatron's sense): microbatch k is in flight on a rank from its
//! first forward compute op there to its last backward compute op there. Lowering names every
//! per-microbatch buffer `…@<microbatch>`; a compute op belongs to the microbatch its outputs
//! name.

use super::rendezvous::ProgramIndex;
use super::Violation;
use crate::ir::{BufferId, Instr, P2pOp, Phase, Program, ProgramId};
use serde::Serialize;

/// Liveness numbers of one program (every rank running it has them).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProgramMemory {
    pub program: ProgramId,
    pub role: String,
    pub instrs: usize,
    /// Parameters, optimizer state and metrics: alive for the whole run.
    pub persistent_bytes: u64,
    /// The most transient bytes alive at once.
    pub peak_transient_bytes: u64,
    /// persistent + peak transient.
    pub peak_bytes: u64,
    /// Index of the instruction after which the peak is first reached.
    pub peak_at: usize,
    /// Live transient bytes at the peak, by buffer kind name, largest first.
    pub peak_by_kind: Vec<(String, u64)>,
    /// The most microbatches whose activations are alive at once.
    pub peak_microbatches_in_flight: u32,
}

/// Cap on violations reported per program (one bug tends to repeat in every microbatch).
const MAX_PER_PROGRAM: usize = 8;

/// Call `f` with every buffer `instr` names (reads, writes, and the target of `Alloc`/`Free`),
/// without allocating.
pub(crate) fn buffers_of(instr: &Instr, mut f: impl FnMut(BufferId)) {
    match instr {
        Instr::Compute {
            inputs, outputs, ..
        } => inputs.iter().chain(outputs).for_each(|b| f(*b)),
        Instr::Collective { input, output, .. } => {
            f(*input);
            f(*output);
        }
        Instr::Send { buffer, .. }
        | Instr::Recv { buffer, .. }
        | Instr::Alloc { buffer }
        | Instr::Free { buffer } => f(*buffer),
        Instr::P2p { ops } => ops.iter().for_each(|op| match op {
            P2pOp::Send { buffer, .. } | P2pOp::Recv { buffer, .. } => f(*buffer),
        }),
        Instr::LoadBatch {
            tokens, targets, ..
        } => tokens.iter().chain(targets).for_each(|b| f(*b)),
    }
}

fn microbatch_of(name: &str) -> Option<u32> {
    // Bounded so a hand-made name cannot make the per-microbatch table huge.
    name.rsplit_once('@')
        .and_then(|(_, mb)| mb.parse().ok())
        .filter(|&mb: &u32| mb < 1 << 20)
}

/// Check one program's buffer discipline and measure its liveness. Also returns what the
/// all-rank simulation needs of the program (its rendezvous instructions and buffer sizes), so
/// it does not scan the millions of local instructions again.
pub fn analyse(
    program: &Program,
    id: ProgramId,
    rank: u32,
) -> (ProgramMemory, Vec<Violation>, ProgramIndex) {
    let n = program.buffers.len();
    let mut violations = Vec::new();
    let mut alive = vec![false; n];
    let mut freed_at: Vec<Option<usize>> = vec![None; n];
    let mut persistent_bytes = 0u64;
    // (bytes, persistent) of each buffer, contiguous: the instruction loop reads it per Alloc
    // and Free instead of chasing each buffer's heap-allocated shape.
    let mut sizes: Vec<(u64, bool)> = Vec::with_capacity(n);
    let mut index = ProgramIndex {
        points: Vec::new(),
        numel: Vec::with_capacity(n),
    };
    for (i, b) in program.buffers.iter().enumerate() {
        let persistent = b.kind.is_persistent();
        sizes.push((b.bytes(), persistent));
        index.numel.push(b.numel());
        if persistent {
            alive[i] = true;
            persistent_bytes += b.bytes();
        }
    }
    let mb_of: Vec<Option<u32>> = program
        .buffers
        .iter()
        .map(|b| microbatch_of(&b.name))
        .collect();
    // Per microbatch: (first forward op, last backward op).
    let mut spans: Vec<(usize, usize)> = Vec::new();
    let mut live = 0u64;
    let mut peak = 0u64;
    let mut peak_at = 0usize;

    let mut push = |code: &'static str, instr: usize, node, message: String| {
        if violations.len() < MAX_PER_PROGRAM {
            violations.push(Violation {
                code,
                rank,
                program: id,
                instr,
                node,
                message,
            });
        }
    };
    let name = |b: BufferId| {
        program
            .buffer(b)
            .map(|x| format!("b{} `{}`", b.0, x.name))
            .unwrap_or_else(|| format!("b{}", b.0))
    };

    let mut used: Vec<BufferId> = Vec::new();
    for (i, instr) in program.instrs.iter().enumerate() {
        let node = match instr {
            Instr::Compute { node, .. } | Instr::Collective { node, .. } => *node,
            _ => None,
        };
        used.clear();
        buffers_of(instr, |b| used.push(b));
        if let Some(bad) = used.iter().find(|b| b.0 as usize >= n) {
            push(
                "E0810",
                i,
                node,
                format!("names buffer b{} but the program has {n} buffers", bad.0),
            );
            continue;
        }
        match instr {
            Instr::Alloc { buffer } => {
                let b = buffer.0 as usize;
                let (bytes, persistent) = sizes[b];
                if persistent {
                    push(
                        "E0812",
                        i,
                        node,
                        format!("allocates the persistent buffer {}", name(*buffer)),
                    );
                } else if alive[b] {
                    push(
                        "E0812",
                        i,
                        node,
                        format!("allocates {} which is already alive", name(*buffer)),
                    );
                } else {
                    alive[b] = true;
                    live += bytes;
                    if live > peak {
                        peak = live;
                        peak_at = i;
                    }
                }
            }
            Instr::Free { buffer } => {
                let b = buffer.0 as usize;
                let (bytes, persistent) = sizes[b];
                if persistent {
                    push(
                        "E0812",
                        i,
                        node,
                        format!("frees the persistent buffer {}", name(*buffer)),
                    );
                } else if !alive[b] {
                    let why = match freed_at[b] {
                        Some(k) => format!(
                            "double free of {}: already freed at instruction {k}",
                            name(*buffer)
                        ),
                        None => format!("frees {} which was never allocated", name(*buffer)),
                    };
                    push("E0812", i, node, why);
                } else {
                    alive[b] = false;
                    freed_at[b] = Some(i);
                    live -= bytes;
                }
            }
            _ => {
                if matches!(
                    instr,
                    Instr::Collective { .. }
                        | Instr::Send { .. }
                        | Instr::Recv { .. }
                        | Instr::P2p { .. }
                ) {
                    index.points.push((i as u32, instr.clone()));
                }
                if let Instr::Compute { outputs, phase, .. } = instr {
                    let mb = outputs.iter().find_map(|b| mb_of[b.0 as usize]);
                    if let Some(mb) = mb {
                        let mb = mb as usize;
                        if spans.len() <= mb {
                            spans.resize(mb + 1, (usize::MAX, 0));
                        }
                        let span = &mut spans[mb];
                        match phase {
                            Phase::Forward => span.0 = span.0.min(i),
                            Phase::Backward => span.1 = span.1.max(i),
                            Phase::Recompute | Phase::Optimizer => {}
                        }
                    }
                }
                if let Some(b) = used.iter().find(|b| !alive[b.0 as usize]) {
                    {
                        let why = match freed_at[b.0 as usize] {
                            Some(k) => {
                                format!("uses {} after it was freed at instruction {k}", name(*b))
                            }
                            None => format!("uses {} before it is allocated", name(*b)),
                        };
                        push("E0811", i, node, why);
                    }
                }
            }
        }
    }
    let end = program.instrs.len();
    let mut edges: Vec<(usize, i32)> = Vec::new();
    for &(first, last) in &spans {
        if first <= last {
            edges.push((first, 1));
            edges.push((last, -1));
        }
    }
    // Starts before ends at the same index: an op cannot both start and end microbatches.
    edges.sort_unstable_by_key(|&(i, d)| (i, -d));
    let mut in_flight = 0i32;
    let mut in_flight_peak = 0u32;
    for (_, d) in edges {
        in_flight += d;
        in_flight_peak = in_flight_peak.max(in_flight.max(0) as u32);
    }
    let leaked: Vec<String> = (0..n)
        .filter(|&b| alive[b] && !program.buffers[b].kind.is_persistent())
        .map(|b| name(BufferId(b as u32)))
        .collect();
    if !leaked.is_empty() {
        let shown: Vec<String> = leaked.iter().take(5).cloned().collect();
        push(
            "E0813",
            end,
            None,
            format!(
                "{} transient buffers are still alive at the end of the step: {}{}",
                leaked.len(),
                shown.join(", "),
                if leaked.len() > 5 { ", …" } else { "" }
            ),
        );
    }
    // Replay the transients' lifetimes up to the peak to break it down by kind.
    let mut at_peak = vec![false; n];
    for instr in program.instrs.iter().take(peak_at + 1) {
        match instr {
            Instr::Alloc { buffer } => {
                if let Some(a) = at_peak.get_mut(buffer.0 as usize) {
                    *a = true;
                }
            }
            Instr::Free { buffer } => {
                if let Some(a) = at_peak.get_mut(buffer.0 as usize) {
                    *a = false;
                }
            }
            _ => {}
        }
    }
    let mut by_kind: std::collections::BTreeMap<&'static str, u64> = Default::default();
    for (b, buf) in program.buffers.iter().enumerate() {
        if at_peak.get(b) == Some(&true) && !buf.kind.is_persistent() {
            *by_kind.entry(buf.kind.name()).or_default() += buf.bytes();
        }
    }
    let mut peak_by_kind: Vec<(String, u64)> = by_kind
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    peak_by_kind.sort_by_key(|(_, v)| std::cmp::Reverse(*v));
    let memory = ProgramMemory {
        program: id,
        role: program.role.clone(),
        instrs: program.instrs.len(),
        persistent_bytes,
        peak_transient_bytes: peak,
        peak_bytes: persistent_bytes + peak,
        peak_at,
        peak_by_kind,
        peak_microbatches_in_flight: in_flight_peak,
    };
    (memory, violations, index)
}
