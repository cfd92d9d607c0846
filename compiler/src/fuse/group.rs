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
use super::kernel::{self, Built, Refusal};
use super::ops::{self, Fragment};
use crate::ir::{BufferId, Instr, Phase, Program};
use std::collections::{HashMap, HashSet};

/// How far back (in instructions) a member may move to join a later one.
const WINDOW: usize = 64;

/// A group of two or more members, with its kernel.
pub(super) struct Group {
    /// Member instruction indices, ascending.
    pub members: Vec<usize>,
    /// Where the fused instruction goes: the last member's index.
    pub place: usize,
    pub built: Built,
}

/// What an instruction does to buffers.
#[derive(Default)]
struct Effects {
    /// Read, including outputs an op adds into or updates.
    reads: Vec<BufferId>,
    writes: Vec<BufferId>,
    alloc: Option<BufferId>,
    free: Option<BufferId>,
}

fn effects(instr: &Instr) -> Effects {
    match instr {
        Instr::Alloc { buffer } => Effects {
            alloc: Some(*buffer),
            ..Effects::default()
        },
        Instr::Free { buffer } => Effects {
            free: Some(*buffer),
            ..Effects::default()
        },
        Instr::Compute {
            op,
            inputs,
            outputs,
            ..
        } => {
            let signature = op.signature();
            let mut reads = inputs.to_vec();
            let read_back = outputs.iter().zip(signature.outputs.iter());
            reads.extend(read_back.filter(|(_, o)| o.write.reads()).map(|(b, _)| *b));
            Effects {
                reads,
                writes: outputs.to_vec(),
                ..Effects::default()
            }
        }
        other => Effects {
            reads: other.reads(),
            writes: other.writes(),
            ..Effects::default()
        },
    }
}

/// Who uses each buffer: the instructions that read or write it, and how often it is
/// allocated and freed.
struct Uses {
    users: Vec<Vec<u32>>,
    allocs: Vec<u32>,
    frees: Vec<u32>,
    transient: Vec<bool>,
}

impl Uses {
    fn new(program: &Program) -> Uses {
        let n = program.buffers.len();
        let mut uses = Uses {
            users: vec![Vec::new(); n],
            allocs: vec![0; n],
            frees: vec![0; n],
            transient: program
                .buffers
                .iter()
                .map(|b| !b.kind.is_persistent())
                .collect(),
        };
        for (i, instr) in program.instrs.iter().enumerate() {
            let e = effects(instr);
            let count = |v: &mut Vec<u32>, b: Option<BufferId>| {
                if let Some(slot) = b.and_then(|b| v.get_mut(b.0 as usize)) {
                    *slot += 1;
                }
            };
            count(&mut uses.allocs, e.alloc);
            count(&mut uses.frees, e.free);
            let mut touched: Vec<BufferId> = e.reads.into_iter().chain(e.writes).collect();
            touched.sort_unstable();
            touched.dedup();
            for b in touched {
                if let Some(users) = uses.users.get_mut(b.0 as usize) {
                    users.push(i as u32);
                }
            }
        }
        uses
    }

    /// Whether only `members` (ascending) use `b`, a transient allocated once, written and
    /// read: it then lives inside their kernel only.
    fn internal(&self, b: BufferId, members: &[usize]) -> bool {
        let i = b.0 as usize;
        let (Some(users), Some(&allocs), Some(&frees), Some(&transient)) = (
            self.users.get(i),
            self.allocs.get(i),
            self.frees.get(i),
            self.transient.get(i),
        ) else {
            return false;
        };
        transient
            && allocs == 1
            && frees <= 1
            && users.len() >= 2
            && users
                .iter()
                .all(|u| members.binary_search(&(*u as usize)).is_ok())
    }
}

/// A group while the pass runs.
struct Open {
    members: Vec<usize>,
    place: usize,
    phase: Phase,
    reads: HashSet<BufferId>,
    writes: HashSet<BufferId>,
    built: Option<Built>,
}

impl Open {
    /// Whether moving this group past an instruction (or group) doing `e` changes what
    /// either computes (see the module docs), for the group's members after a merge
    /// `members`.
    fn conflicts(&self, e: &Effects, uses: &Uses, members: &[usize]) -> bool {
        let touches = |b: &BufferId| self.reads.contains(b) || self.writes.contains(b);
        e.reads.iter().any(|b| self.writes.contains(b))
            || e.writes.iter().any(touches)
            || e.alloc.as_ref().is_some_and(touches)
            || e.free.is_some_and(|b| {
                // A buffer the group reads and something else wrote: its free moves after the
                // group. One the group writes: fine when only members use it (it disappears)
                // or nothing reads it (the free moves).
                self.writes.contains(&b) && {
                    let users = uses.users.get(b.0 as usize);
                    !(uses.internal(b, members) || users.is_some_and(|u| u.len() == 1))
                }
            })
    }

    fn effects(&self) -> Effects {
        Effects {
            reads: self.reads.iter().copied().collect(),
            writes: self.writes.iter().copied().collect(),
            ..Effects::default()
        }
    }
}

/// The groups of two or more fusible instructions of `program` (see the module docs), each
/// with its kernel; an error only for a kernel this pass got wrong.
pub(super) fn groups(program: &Program) -> Result<Vec<Group>, String> {
    let mut pass = Pass {
        program,
        uses: Uses::new(program),
        fragments: HashMap::new(),
        open: Vec::new(),
        group_of: HashMap::new(),
        writer: HashMap::new(),
    };
    for (i, instr) in program.instrs.iter().enumerate() {
        let Some(c) = instr.as_compute() else {
            continue;
        };
        let Some(fragment) = ops::fragment(program, &c) else {
            continue;
        };
        pass.fragments.insert(i, fragment);
        pass.add(i, c.phase)?;
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
    fragments: HashMap<usize, Fragment<'p>>,
    /// Groups by id; `None` once merged into another.
    open: Vec<Option<Open>>,
    group_of: HashMap<usize, usize>,
    /// The group that wrote each buffer.
    writer: HashMap<BufferId, usize>,
}

impl Pass<'_> {
    /// Put fusible instruction `i` into a group: the merge of every group it reads from,
    /// else of one of them (the latest first), else a new one.
    fn add(&mut self, i: usize, phase: Phase) -> Result<(), String> {
        let Some(fragment) = self.fragments.get(&i) else {
            return Ok(());
        };
        let mut candidates: Vec<usize> = fragment
            .reads
            .iter()
            .filter_map(|b| self.writer.get(b).copied())
            .filter(|g| self.open.get(*g).is_some_and(Option::is_some))
            .collect();
        candidates.sort_unstable();
        candidates.dedup();
        candidates.sort_by_key(|g| std::cmp::Reverse(self.place(*g)));
        let mut attempts: Vec<Vec<usize>> = Vec::new();
        if candidates.len() > 1 {
            attempts.push(candidates.clone());
        }
        attempts.extend(candidates.iter().map(|g| vec![*g]));
        for set in attempts {
            if let Some(merged) = self.try_merge(&set, i, phase)? {
                self.install(&set, merged);
                return Ok(());
            }
        }
        let single = Open {
            members: vec![i],
            place: i,
            phase,
            reads: fragment.reads.iter().copied().collect(),
            writes: fragment.writes.iter().copied().collect(),
            built: None,
        };
        self.install(&[], single);
        Ok(())
    }

    fn place(&self, g: usize) -> usize {
        self.open
            .get(g)
            .and_then(Option::as_ref)
            .map_or(0, |o| o.place)
    }

    /// The group of `set`'s groups and instruction `i`, if they may merge.
    fn try_merge(&self, set: &[usize], i: usize, phase: Phase) -> Result<Option<Open>, String> {
        let groups: Vec<&Open> = set
            .iter()
            .filter_map(|g| self.open.get(*g).and_then(Option::as_ref))
            .collect();
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
        if groups.iter().any(|g| self.blocked(g, set, i, &members)) {
            return Ok(None);
        }
        let fragments: Vec<&Fragment> = members
            .iter()
            .filter_map(|m| self.fragments.get(m))
            .collect();
        let uses = &self.uses;
        let internal = |b: BufferId| uses.internal(b, &members);
        let built = match kernel::build(&fragments, &internal) {
            Ok(built) => built,
            Err(Refusal::Cannot(_)) => return Ok(None),
            Err(Refusal::Bug(e)) => return Err(e),
        };
        let mut reads = HashSet::new();
        let mut writes = HashSet::new();
        for f in &fragments {
            reads.extend(f.reads.iter().copied());
            writes.extend(f.writes.iter().copied());
        }
        Ok(Some(Open {
            members,
            place: i,
            phase,
            reads,
            writes,
            built: Some(built),
        }))
    }

    /// Whether moving group `g` from its place to `i` crosses an instruction or another group
    /// it conflicts with (groups of `set` move with it).
    fn blocked(&self, g: &Open, set: &[usize], i: usize, members: &[usize]) -> bool {
        let mut seen: HashSet<usize> = HashSet::new();
        for j in g.place + 1..i {
            match self.group_of.get(&j) {
                Some(h) if set.contains(h) => {}
                Some(h) => {
                    let other = self.open.get(*h).and_then(Option::as_ref);
                    if seen.insert(*h)
                        && other.is_some_and(|o| g.conflicts(&o.effects(), &self.uses, members))
                    {
                        return true;
                    }
                }
                None => {
                    let Some(instr) = self.program.instrs.get(j) else {
                        return true;
                    };
                    if g.conflicts(&effects(instr), &self.uses, members) {
                        return true;
                    }
                }
            }
        }
        false
    }

    /// Record `group`, replacing the groups of `set`.
    fn install(&mut self, set: &[usize], group: Open) {
        for g in set {
            if let Some(slot) = self.open.get_mut(*g) {
                *slot = None;
            }
        }
        let id = self.open.len();
        for m in &group.members {
            self.group_of.insert(*m, id);
        }
        for b in &group.writes {
            self.writer.insert(*b, id);
        }
        self.open.push(Some(group));
    }
}
