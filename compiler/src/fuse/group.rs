//! Grouping: one greedy pass over a program's instructions. A fusible instruction (`ops`)
//! joins the groups that wrote a buffer it reads, when one kernel can compute them all
//! (`kernel::build`) and moving every member to the new member's place reorders nothing that
//! matters: no instruction between reads or writes what a moved member writes, or writes what
//! it reads (a `Free` of a buffer a member reads is moved after the group instead, or dropped
//! with the buffer when only members use it). Otherwise it starts a group of its own. Groups
//! of one keep their hand-written op.
//!
//! A group runs where its last member was (its place); a merge only looks `WINDOW`
//! instructions back, which keeps the pass linear and the moved work close to where it was.
//! The same layer repeats in every microbatch, so kernels are built once per shape of group
//! (its ops, how their buffers connect, the buffers' shapes) and reused ([`KernelCache`]);
//! an instruction's fragment is made only when it takes part in a merge.
use super::kernel::{self, Built, Refusal, Source};
use super::ops::{self, Fragment};
use crate::ir::{BufferId, Instr, P2pOp, Phase, Program};
use std::collections::HashMap;

/// How far back (in instructions) a member may move to join a later one.
const WINDOW: usize = 64;

/// No group, no fragment, no writer.
const NONE: u32 = u32::MAX;

/// A fragment not made yet.
const LATER: u32 = u32::MAX - 1;

/// A group of two or more members, with its kernel.
pub(super) struct Group {
    /// Member instruction indices, ascending.
    pub members: Vec<usize>,
    /// Where the fused instruction goes: the last member's index.
    pub place: usize,
    pub built: Built,
}

/// How an instruction uses a buffer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Use {
    /// Read (an output an op adds into or updates is also written, which is what matters).
    Read,
    Write,
    Alloc,
    Free,
}

/// Calls `f` for every buffer `instr` uses, and how.
fn visit(instr: &Instr, mut f: impl FnMut(BufferId, Use)) {
    match instr {
        Instr::Compute {
            inputs, outputs, ..
        } => {
            inputs.iter().for_each(|b| f(*b, Use::Read));
            outputs.iter().for_each(|b| f(*b, Use::Write));
        }
        Instr::Collective { input, output, .. } => {
            f(*input, Use::Read);
            f(*output, Use::Write);
        }
        Instr::Send { buffer, .. } => f(*buffer, Use::Read),
        Instr::Recv { buffer, .. } => f(*buffer, Use::Write),
        Instr::P2p { ops } => {
            for op in ops {
                match op {
                    P2pOp::Send { buffer, .. } => f(*buffer, Use::Read),
                    P2pOp::Recv { buffer, .. } => f(*buffer, Use::Write),
                }
            }
        }
        Instr::LoadBatch {
            tokens, targets, ..
        } => tokens
            .iter()
            .chain(targets.iter())
            .for_each(|b| f(*b, Use::Write)),
        Instr::Alloc { buffer } => f(*buffer, Use::Alloc),
        Instr::Free { buffer } => f(*buffer, Use::Free),
    }
}

/// A compute instruction's input and output buffers (none for other instructions).
fn operands(instr: &Instr) -> (&[BufferId], &[BufferId]) {
    match instr {
        Instr::Compute {
            inputs, outputs, ..
        } => (inputs, outputs),
        _ => (&[], &[]),
    }
}

/// How each buffer is used over the program: by how many instructions (reads and writes),
/// how often it is allocated and freed.
struct Uses {
    users: Vec<u32>,
    allocs: Vec<u32>,
    frees: Vec<u32>,
    transient: Vec<bool>,
}

impl Uses {
    fn new(program: &Program) -> Uses {
        let n = program.buffers.len();
        let mut uses = Uses {
            users: vec![0; n],
            allocs: vec![0; n],
            frees: vec![0; n],
            transient: program
                .buffers
                .iter()
                .map(|b| !b.kind.is_persistent())
                .collect(),
        };
        let mut last = vec![NONE; n];
        for (i, instr) in program.instrs.iter().enumerate() {
            visit(instr, |b, u| {
                let b = b.0 as usize;
                let Some(last) = last.get_mut(b) else {
                    return;
                };
                match u {
                    Use::Alloc => uses.allocs[b] += 1,
                    Use::Free => uses.frees[b] += 1,
                    Use::Read | Use::Write if *last != i as u32 => {
                        *last = i as u32;
                        uses.users[b] += 1;
                    }
                    _ => {}
                }
            });
        }
        uses
    }

    fn users(&self, b: BufferId) -> u32 {
        self.users.get(b.0 as usize).copied().unwrap_or(0)
    }

    /// Whether `b`, used by `member_users` of a group's members, lives inside their kernel
    /// only: a transient allocated once, written and read, by members only.
    fn internal(&self, b: BufferId, member_users: u32) -> bool {
        let i = b.0 as usize;
        self.transient.get(i) == Some(&true)
            && self.allocs.get(i) == Some(&1)
            && self.frees.get(i).is_some_and(|f| *f <= 1)
            && member_users >= 2
            && self.users(b) == member_users
    }
}

/// A group while the pass runs.
struct Open {
    members: Vec<usize>,
    place: usize,
    phase: Phase,
    built: Option<Built>,
}

/// Kernels built so far, by the shape of their group (see the module docs), in canonical
/// buffer numbering; `None` where one kernel cannot compute the group.
#[derive(Default)]
struct KernelCache {
    built: HashMap<Vec<u64>, Option<Built>>,
    /// Scratch: the key and buffers of the group being looked up.
    key: Vec<u64>,
    buffers: Vec<BufferId>,
}

/// A group's shape, written into `key`: its ops (by identity: equal layers share one), how
/// its members' operands name its buffers (numbered in order of first appearance, into
/// `buffers`), each buffer's shape and whether it is internal.
fn shape_key(
    fragments: &[&Fragment],
    internal: &dyn Fn(BufferId) -> bool,
    program: &Program,
    (key, buffers): (&mut Vec<u64>, &mut Vec<BufferId>),
) {
    key.clear();
    buffers.clear();
    for f in fragments {
        key.push(std::ptr::from_ref(f.op) as usize as u64);
        for b in f.reads.iter().chain(&f.writes) {
            let index = buffers.iter().position(|x| x == b).unwrap_or_else(|| {
                buffers.push(*b);
                buffers.len() - 1
            });
            key.push(index as u64);
        }
        key.push(u64::MAX);
    }
    for b in buffers.iter() {
        key.push(u64::from(internal(*b)));
        let shape = program.buffer(*b).map_or(&[][..], |x| &x.shape[..]);
        key.push(shape.len() as u64);
        key.extend(shape);
    }
}

/// `built` with its buffers renamed by `rename`.
fn renamed(built: &Built, rename: impl Fn(BufferId) -> BufferId) -> Built {
    Built {
        kernel: built.kernel.clone(),
        name: built.name.clone(),
        inputs: built
            .inputs
            .iter()
            .map(|s| match s {
                Source::Buffer(b) => Source::Buffer(rename(*b)),
                table => table.clone(),
            })
            .collect(),
        outputs: built.outputs.iter().map(|b| rename(*b)).collect(),
        internal: built.internal.iter().map(|b| rename(*b)).collect(),
        rows: built.rows,
        fixes_rows: built.fixes_rows,
    }
}

/// The groups of two or more fusible instructions of `program` (see the module docs), each
/// with its kernel; an error only for a kernel this pass got wrong.
pub(super) fn groups(program: &Program) -> Result<Vec<Group>, String> {
    let n = program.instrs.len();
    // Room for every fragment and group the pass can make (a group per fusible instruction,
    // and one per merge), so the large lists never move while they grow.
    let fusible = (program.instrs.iter())
        .filter(|i| matches!(i, Instr::Compute { op, .. } if ops::fusible(op)))
        .count();
    let mut pass = Pass {
        program,
        uses: Uses::new(program),
        fragments: Vec::with_capacity(fusible),
        fragment_of: vec![NONE; n],
        open: Vec::with_capacity(2 * fusible),
        group_of: vec![NONE; n],
        writer: vec![NONE; program.buffers.len()],
        cache: KernelCache::default(),
    };
    for (i, instr) in program.instrs.iter().enumerate() {
        match instr {
            Instr::Compute { op, phase, .. } if ops::fusible(op) => {
                pass.fragment_of[i] = LATER;
                pass.add(i, *phase)?;
            }
            _ => {}
        }
    }
    Ok(pass
        .open
        .into_iter()
        .flatten()
        .filter_map(|g| {
            let built = g.built?;
            (g.members.len() >= 2).then_some(Group {
                members: g.members,
                place: g.place,
                built,
            })
        })
        .collect())
}

struct Pass<'p> {
    program: &'p Program,
    uses: Uses,
    fragments: Vec<Option<Fragment<'p>>>,
    /// Per instruction: its fragment's index, `LATER` (not made yet) or `NONE` (not fusible).
    fragment_of: Vec<u32>,
    /// Groups by id; `None` once merged into another.
    open: Vec<Option<Open>>,
    /// Per instruction: its group, or `NONE`.
    group_of: Vec<u32>,
    /// Per buffer: the fusible instruction that wrote it, or `NONE`.
    writer: Vec<u32>,
    cache: KernelCache,
}

impl<'p> Pass<'p> {
    fn group(&self, g: usize) -> Option<&Open> {
        self.open.get(g).and_then(Option::as_ref)
    }

    /// Instruction `i`'s fragment, if it is fusible (made by [`Pass::make_fragment`]).
    fn fragment(&self, i: usize) -> Option<&Fragment<'p>> {
        let f = *self.fragment_of.get(i)?;
        self.fragments.get(f as usize)?.as_ref()
    }

    /// Makes instruction `i`'s fragment if it is due.
    fn make_fragment(&mut self, i: usize) {
        if self.fragment_of.get(i) != Some(&LATER) {
            return;
        }
        let program = self.program;
        let fragment = program
            .instrs
            .get(i)
            .and_then(Instr::as_compute)
            .and_then(|c| ops::fragment(program, &c));
        self.fragment_of[i] = self.fragments.len() as u32;
        self.fragments.push(fragment);
    }

    /// Put fusible instruction `i` into a group: the merge of every group it reads from,
    /// else of one of them (the latest first), else none (it stays alone, with no group made
    /// for it until a later instruction tries to join it).
    fn add(&mut self, i: usize, phase: Phase) -> Result<(), String> {
        let program = self.program;
        let (inputs, outputs) = program.instrs.get(i).map_or((&[][..], &[][..]), operands);
        for b in outputs {
            if let Some(slot) = self.writer.get_mut(b.0 as usize) {
                *slot = i as u32;
            }
        }
        let writers = inputs
            .iter()
            .filter_map(|b| self.writer.get(b.0 as usize))
            .filter(|w| **w != NONE && **w as usize != i);
        let writers: Vec<usize> = writers.map(|w| *w as usize).collect();
        if writers.is_empty() {
            return Ok(());
        }
        let mut candidates: Vec<usize> = writers
            .into_iter()
            .map(|w| self.group_of_or_own(w))
            .collect();
        candidates.sort_unstable();
        candidates.dedup();
        candidates.sort_by_key(|g| std::cmp::Reverse(self.group(*g).map_or(0, |o| o.place)));
        let members: Vec<usize> = candidates
            .iter()
            .filter_map(|g| self.group(*g))
            .flat_map(|g| g.members.clone())
            .collect();
        for m in members.into_iter().chain([i]) {
            self.make_fragment(m);
        }
        let mut cache = std::mem::take(&mut self.cache);
        let merged = self.merge(&candidates, i, phase, &mut cache);
        self.cache = cache;
        if let Some((set, group)) = merged? {
            self.install(&set, group);
        }
        Ok(())
    }

    /// The group of instruction `w`, made (a group of one) if it has none.
    fn group_of_or_own(&mut self, w: usize) -> usize {
        match self.group_of.get(w) {
            Some(&g) if g != NONE => g as usize,
            _ => {
                let phase = match self.program.instrs.get(w) {
                    Some(Instr::Compute { phase, .. }) => *phase,
                    _ => Phase::Forward,
                };
                let own = Open {
                    members: vec![w],
                    place: w,
                    phase,
                    built: None,
                };
                self.install(&[], own)
            }
        }
    }

    /// The first merge of `i` with its `candidates` (latest first) that works: all of them,
    /// else each alone; with the groups it replaces.
    fn merge(
        &self,
        candidates: &[usize],
        i: usize,
        phase: Phase,
        cache: &mut KernelCache,
    ) -> Result<Option<(Vec<usize>, Open)>, String> {
        let mut attempts: Vec<Vec<usize>> = Vec::new();
        if candidates.len() > 1 {
            attempts.push(candidates.to_vec());
        }
        attempts.extend(candidates.iter().map(|g| vec![*g]));
        for set in attempts {
            if let Some(merged) = self.try_merge(&set, i, phase, cache)? {
                return Ok(Some((set, merged)));
            }
        }
        Ok(None)
    }

    /// The group of `set`'s groups and instruction `i`, if they may merge.
    fn try_merge(
        &self,
        set: &[usize],
        i: usize,
        phase: Phase,
        cache: &mut KernelCache,
    ) -> Result<Option<Open>, String> {
        let groups: Vec<&Open> = set.iter().filter_map(|g| self.group(*g)).collect();
        if groups.len() != set.len()
            || groups
                .iter()
                .any(|g| g.phase != phase || i - g.place > WINDOW)
        {
            return Ok(None);
        }
        let mut members: Vec<usize> = groups.iter().flat_map(|g| g.members.clone()).collect();
        members.push(i);
        members.sort_unstable();
        let fragments: Vec<&Fragment> = members.iter().filter_map(|m| self.fragment(*m)).collect();
        if fragments.len() != members.len() {
            return Ok(None);
        }
        let uses = &self.uses;
        let internal = |b: BufferId| {
            let member_users = fragments
                .iter()
                .filter(|f| f.reads.contains(&b) || f.writes.contains(&b))
                .count();
            uses.internal(b, member_users as u32)
        };
        // A free of a buffer the group writes may move after it when the buffer vanishes or
        // nothing else uses it.
        let freeable = |b: BufferId| internal(b) || uses.users(b) == 1;
        if groups.iter().any(|g| self.blocked(g, set, i, &freeable)) {
            return Ok(None);
        }
        let Some(built) = self.built(&fragments, &internal, cache)? else {
            return Ok(None);
        };
        Ok(Some(Open {
            members,
            place: i,
            phase,
            built: Some(built),
        }))
    }

    /// The kernel of `fragments`, from the cache or built (and cached); `None` where one
    /// kernel cannot compute them.
    fn built(
        &self,
        fragments: &[&Fragment],
        internal: &dyn Fn(BufferId) -> bool,
        cache: &mut KernelCache,
    ) -> Result<Option<Built>, String> {
        let mut key = std::mem::take(&mut cache.key);
        let mut buffers = std::mem::take(&mut cache.buffers);
        shape_key(fragments, internal, self.program, (&mut key, &mut buffers));
        if let Some(cached) = cache.built.get(key.as_slice()) {
            let actual = |x: BufferId| buffers.get(x.0 as usize).copied().unwrap_or(x);
            let built = cached.as_ref().map(|b| renamed(b, actual));
            cache.key = key;
            cache.buffers = buffers;
            return Ok(built);
        }
        let built = match kernel::build(fragments, internal) {
            Ok(built) => Some(built),
            Err(Refusal::Cannot(_)) => None,
            Err(Refusal::Bug(e)) => return Err(e),
        };
        let canonical = |x: BufferId| {
            let at = buffers.iter().position(|y| *y == x).unwrap_or(usize::MAX);
            BufferId(at as u32)
        };
        cache
            .built
            .insert(key, built.as_ref().map(|b| renamed(b, canonical)));
        cache.buffers = buffers;
        Ok(built)
    }

    /// Whether moving group `g` from its place to `i` crosses an instruction or another group
    /// it conflicts with (groups of `set` move with it); `freeable(b)` says whether a free of
    /// a buffer `g` writes may move after it.
    fn blocked(
        &self,
        g: &Open,
        set: &[usize],
        i: usize,
        freeable: &dyn Fn(BufferId) -> bool,
    ) -> bool {
        let instrs = &self.program.instrs;
        let member_ops = || {
            g.members
                .iter()
                .filter_map(|m| instrs.get(*m))
                .map(operands)
        };
        let writes = |b: &BufferId| member_ops().any(|(_, w)| w.contains(b));
        let touches = |b: &BufferId| member_ops().any(|(r, w)| r.contains(b) || w.contains(b));
        let conflicts = |b: BufferId, u: Use| match u {
            Use::Read => writes(&b),
            Use::Write | Use::Alloc => touches(&b),
            // A buffer the group only reads: its free moves after the group.
            Use::Free => writes(&b) && !freeable(b),
        };
        let mut seen: Vec<u32> = Vec::new();
        for j in g.place + 1..i {
            let h = self.group_of.get(j).copied().unwrap_or(NONE);
            if h != NONE && set.contains(&(h as usize)) {
                continue;
            }
            if h == NONE {
                let mut conflict = false;
                if let Some(instr) = instrs.get(j) {
                    visit(instr, |b, u| conflict |= conflicts(b, u));
                }
                if conflict {
                    return true;
                }
                continue;
            }
            if seen.contains(&h) {
                continue;
            }
            seen.push(h);
            // Another group runs at its own place, inside this stretch: all of its members.
            let Some(other) = self.group(h as usize) else {
                continue;
            };
            for (r, w) in other
                .members
                .iter()
                .filter_map(|m| instrs.get(*m))
                .map(operands)
            {
                let uses = r.iter().map(|b| (*b, Use::Read));
                if uses
                    .chain(w.iter().map(|b| (*b, Use::Write)))
                    .any(|(b, u)| conflicts(b, u))
                {
                    return true;
                }
            }
        }
        false
    }

    /// Record `group`, replacing the groups of `set`; its id.
    fn install(&mut self, set: &[usize], group: Open) -> usize {
        for g in set {
            if let Some(slot) = self.open.get_mut(*g) {
                *slot = None;
            }
        }
        let id = self.open.len();
        for m in &group.members {
            if let Some(slot) = self.group_of.get_mut(*m) {
                *slot = id as u32;
            }
        }
        self.open.push(Some(group));
        id
    }
}
