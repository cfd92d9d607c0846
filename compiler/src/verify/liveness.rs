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
const ALL_KINDS: [BufferKind; 10] = BufferKind::ALL;
const KINDS: usize = ALL_KINDS.len();

/// `kind`'s index in [`ALL_KINDS`] (exhaustive, so a new kind cannot be left out unnoticed).
fn kind_slot(kind: BufferKind) -> usize {
    match kind {
        BufferKind::Param => 0,
        BufferKind::OptState => 1,
        BufferKind::Metric => 2,
        BufferKind::Fp8History => 3,
        BufferKind::GatheredParam => 4,
        BufferKind::Grad => 5,
        BufferKind::Activation => 6,
        BufferKind::ActivationGrad => 7,
        BufferKind::Input => 8,
        BufferKind::Comm => 9,
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
    let mut live = Liveness::new(program);
    let mut spans = MicrobatchSpans::new(program);
    let mut index = ProgramIndex {
        points: Vec::new(),
        numel: program.buffers.iter().map(|b| b.numel()).collect(),
        dtype: program.buffers.iter().map(|b| b.dtype).collect(),
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
            let message = format!("names buffer b{} but the program has {n} buffers", bad.0);
            push("E0810", i, node, message);
            continue;
        }
        let violation = match instr {
            Instr::Alloc { buffer } => live.alloc(program, *buffer, i).map(|m| ("E0812", m)),
            Instr::Free { buffer } => live.free(program, *buffer, i).map(|m| ("E0812", m)),
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
                spans.record(instr, i);
                live.use_error(program, &used).map(|m| ("E0811", m))
            }
        };
        if let Some((code, message)) = violation {
            push(code, i, node, message);
        }
    }
    if let Some(message) = live.leaks(program) {
        push("E0813", program.instrs.len(), None, message);
    }
    let memory = ProgramMemory {
        program: id,
        role: program.role.clone(),
        instrs: program.instrs.len(),
        persistent_bytes: live.persistent_bytes,
        peak_transient_bytes: live.peak,
        peak_bytes: live.persistent_bytes + live.peak,
        peak_at: live.peak_at,
        peak_by_kind: live.peak_by_kind(),
        peak_microbatches_in_flight: spans.peak_in_flight(),
    };
    (memory, violations, index)
}

/// `b` as messages name it: b3 `name`.
fn buffer_name(program: &Program, b: BufferId) -> String {
    program
        .buffer(b)
        .map(|x| format!("b{} `{}`", b.0, x.name))
        .unwrap_or_else(|| format!("b{}", b.0))
}

/// The walk's account of memory: which buffers are alive, where each was freed, and the live
/// transient bytes (in all and by kind) with their peak.
struct Liveness {
    /// (bytes, persistent) of each buffer, contiguous: the walk reads it per Alloc and Free
    /// instead of chasing each buffer's heap-allocated shape.
    sizes: Vec<(u64, bool)>,
    alive: Vec<bool>,
    freed_at: Vec<Option<usize>>,
    persistent_bytes: u64,
    live: u64,
    peak: u64,
    peak_at: usize,
    /// Live transient (bytes, buffers) by kind, and its copy at the peak.
    live_by_kind: [(u64, u32); KINDS],
    peak_by_kind_live: [(u64, u32); KINDS],
}

impl Liveness {
    /// Before the first instruction: the persistent buffers alive, nothing else.
    fn new(program: &Program) -> Liveness {
        let sizes: Vec<(u64, bool)> = program
            .buffers
            .iter()
            .map(|b| (b.bytes(), b.kind.is_persistent()))
            .collect();
        Liveness {
            alive: sizes.iter().map(|&(_, persistent)| persistent).collect(),
            freed_at: vec![None; sizes.len()],
            persistent_bytes: sizes.iter().filter(|s| s.1).map(|s| s.0).sum(),
            sizes,
            live: 0,
            peak: 0,
            peak_at: 0,
            live_by_kind: [(0, 0); KINDS],
            peak_by_kind_live: [(0, 0); KINDS],
        }
    }

    /// `Alloc` of `buffer` at instruction `i`: what is wrong with it (E0812), or None.
    fn alloc(&mut self, program: &Program, buffer: BufferId, i: usize) -> Option<String> {
        let b = buffer.0 as usize;
        let (bytes, persistent) = self.sizes[b];
        if persistent {
            return Some(format!(
                "allocates the persistent buffer {}",
                buffer_name(program, buffer)
            ));
        }
        if self.alive[b] {
            return Some(format!(
                "allocates {} which is already alive",
                buffer_name(program, buffer)
            ));
        }
        self.alive[b] = true;
        self.live += bytes;
        if let Some(k) = self
            .live_by_kind
            .get_mut(kind_slot(program.buffers[b].kind))
        {
            k.0 += bytes;
            k.1 += 1;
        }
        if self.live > self.peak {
            self.peak = self.live;
            self.peak_at = i;
            self.peak_by_kind_live = self.live_by_kind;
        }
        None
    }

    /// `Free` of `buffer` at instruction `i`: what is wrong with it (E0812), or None.
    fn free(&mut self, program: &Program, buffer: BufferId, i: usize) -> Option<String> {
        let b = buffer.0 as usize;
        let (bytes, persistent) = self.sizes[b];
        let name = || buffer_name(program, buffer);
        if persistent {
            return Some(format!("frees the persistent buffer {}", name()));
        }
        if !self.alive[b] {
            return Some(match self.freed_at[b] {
                Some(k) => format!(
                    "double free of {}: already freed at instruction {k}",
                    name()
                ),
                None => format!("frees {} which was never allocated", name()),
            });
        }
        self.alive[b] = false;
        self.freed_at[b] = Some(i);
        self.live -= bytes;
        if let Some(k) = self
            .live_by_kind
            .get_mut(kind_slot(program.buffers[b].kind))
        {
            k.0 -= bytes;
            k.1 -= 1;
        }
        None
    }

    /// The first of `used` that is not alive (E0811), or None.
    fn use_error(&self, program: &Program, used: &[BufferId]) -> Option<String> {
        let b = *used.iter().find(|b| !self.alive[b.0 as usize])?;
        Some(match self.freed_at[b.0 as usize] {
            Some(k) => format!(
                "uses {} after it was freed at instruction {k}",
                buffer_name(program, b)
            ),
            None => format!("uses {} before it is allocated", buffer_name(program, b)),
        })
    }

    /// The transient buffers still alive at the end of the step (E0813), or None.
    fn leaks(&self, program: &Program) -> Option<String> {
        let leaked: Vec<String> = (0..self.alive.len())
            .filter(|&b| self.alive[b] && !self.sizes[b].1)
            .map(|b| buffer_name(program, BufferId(b as u32)))
            .collect();
        if leaked.is_empty() {
            return None;
        }
        let shown: Vec<String> = leaked.iter().take(5).cloned().collect();
        Some(format!(
            "{} transient buffers are still alive at the end of the step: {}{}",
            leaked.len(),
            shown.join(", "),
            if leaked.len() > 5 { ", …" } else { "" }
        ))
    }

    /// Live transient bytes at the peak by kind name, largest first.
    fn peak_by_kind(&self) -> Vec<(String, u64)> {
        let mut by_kind: std::collections::BTreeMap<&'static str, u64> = Default::default();
        for kind in ALL_KINDS {
            if let Some(&(bytes, count)) = self.peak_by_kind_live.get(kind_slot(kind)) {
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
        peak_by_kind
    }
}

/// Per microbatch, its first forward and last backward compute op (see the module docs).
struct MicrobatchSpans {
    /// The microbatch each buffer belongs to, from its name.
    mb_of: Vec<Option<u32>>,
    /// Per microbatch: (first forward op, last backward op).
    spans: Vec<(usize, usize)>,
}

impl MicrobatchSpans {
    fn new(program: &Program) -> MicrobatchSpans {
        MicrobatchSpans {
            mb_of: program
                .buffers
                .iter()
                .map(|b| microbatch_of(&b.name))
                .collect(),
            spans: Vec::new(),
        }
    }

    /// Count instruction `i` in its microbatch's span, if it is a compute op that has one.
    fn record(&mut self, instr: &Instr, i: usize) {
        let Instr::Compute { outputs, phase, .. } = instr else {
            return;
        };
        let Some(mb) = outputs.iter().find_map(|b| self.mb_of[b.0 as usize]) else {
            return;
        };
        let mb = mb as usize;
        if self.spans.len() <= mb {
            self.spans.resize(mb + 1, (usize::MAX, 0));
        }
        let span = &mut self.spans[mb];
        match phase {
            Phase::Forward => span.0 = span.0.min(i),
            Phase::Backward => span.1 = span.1.max(i),
            Phase::Recompute | Phase::Optimizer => {}
        }
    }

    /// The most microbatches in flight at once.
    fn peak_in_flight(&self) -> u32 {
        peak_in_flight(&self.spans)
    }
}

/// The most of `spans` (per microbatch, its first forward and last backward position; a span
/// whose first is after its last has none) that overlap at one position: the verifier's count
/// on a program's instructions and the cost model's on the lowering's unit order
/// (`cost::schedule::microbatches_in_flight`).
pub fn peak_in_flight(spans: &[(usize, usize)]) -> u32 {
    let mut edges: Vec<(usize, i32)> = Vec::new();
    for &(first, last) in spans {
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
    in_flight_peak
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
