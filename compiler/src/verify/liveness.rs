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
use crate::ir::{BufferId, BufferKind, Instr, P2pOp, Phase, Program, ProgramId};
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

/// Every buffer kind, and how many there are (the live-bytes-by-kind table's size).
const ALL_KINDS: [BufferKind; 9] = [
    BufferKind::Param,
    BufferKind::OptState,
    BufferKind::Metric,
    BufferKind::GatheredParam,
    BufferKind::Grad,
    BufferKind::Activation,
    BufferKind::ActivationGrad,
    BufferKind::Input,
    BufferKind::Comm,
];
const KINDS: usize = ALL_KINDS.len();

/// `kind`'s index in [`ALL_KINDS`] (exhaustive, so a new kind cannot be left out unnoticed).
fn kind_slot(kind: BufferKind) -> usize {
    match kind {
        BufferKind::Param => 0,
        BufferKind::OptState => 1,
        BufferKind::Metric => 2,
        BufferKind::GatheredParam => 3,
        BufferKind::Grad => 4,
        BufferKind::Activation => 5,
        BufferKind::ActivationGrad => 6,
        BufferKind::Input => 7,
        BufferKind::Comm => 8,
    }
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
    // The decimal digits after the last `@` (read from the end: this runs once per buffer, on
    // millions of names). Bounded so a hand-made name cannot make the per-microbatch table huge.
    let bytes = name.as_bytes();
    let digits = bytes
        .iter()
        .rev()
        .take_while(|b| b.is_ascii_digit())
        .count();
    let at = bytes.len().checked_sub(digits + 1)?;
    if digits == 0 || digits > 7 || bytes.get(at) != Some(&b'@') {
        return None;
    }
    let mb = bytes[at + 1..]
        .iter()
        .fold(0u32, |n, &d| n * 10 + u32::from(d - b'0'));
    (mb < 1 << 20).then_some(mb)
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
    // Live transient (bytes, buffers) by kind, and its copy at the peak.
    let mut live_by_kind = [(0u64, 0u32); KINDS];
    let mut peak_by_kind_live = live_by_kind;
    let mut index = ProgramIndex {
        points: Vec::new(),
        numel: Vec::with_capacity(n),
        dtype: Vec::with_capacity(n),
    };
    for (i, b) in program.buffers.iter().enumerate() {
        let persistent = b.kind.is_persistent();
        sizes.push((b.bytes(), persistent));
        index.numel.push(b.numel());
        index.dtype.push(b.dtype);
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
                    if let Some(k) = live_by_kind.get_mut(kind_slot(program.buffers[b].kind)) {
                        k.0 += bytes;
                        k.1 += 1;
                    }
                    if live > peak {
                        peak = live;
                        peak_at = i;
                        peak_by_kind_live = live_by_kind;
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
                    if let Some(k) = live_by_kind.get_mut(kind_slot(program.buffers[b].kind)) {
                        k.0 -= bytes;
                        k.1 -= 1;
                    }
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
    let mut by_kind: std::collections::BTreeMap<&'static str, u64> = Default::default();
    for kind in ALL_KINDS {
        if let Some(&(bytes, count)) = peak_by_kind_live.get(kind_slot(kind)) {
            if count > 0 {
                by_kind.insert(kind.name(), bytes);
            }
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

#[cfg(test)]
mod unit_tests {
    use super::{kind_slot, microbatch_of, ALL_KINDS};

    #[test]
    fn every_kind_has_its_own_slot() {
        for (i, &kind) in ALL_KINDS.iter().enumerate() {
            assert_eq!(kind_slot(kind), i);
        }
    }

    #[test]
    fn microbatch_is_the_number_after_the_last_at() {
        assert_eq!(microbatch_of("blocks.3.attn.q@12"), Some(12));
        assert_eq!(microbatch_of("a@b@0"), Some(0));
        assert_eq!(microbatch_of("tokens@7"), Some(7));
        assert_eq!(microbatch_of("loss"), None);
        assert_eq!(microbatch_of("x@"), None);
        assert_eq!(microbatch_of("x@1a"), None);
        assert_eq!(microbatch_of("x12"), None);
        assert_eq!(microbatch_of("@3"), Some(3));
        assert_eq!(microbatch_of("x@99999999"), None);
        assert_eq!(microbatch_of("x@1048576"), None);
        assert_eq!(microbatch_of("x@1048575"), Some(1_048_575));
    }
}
