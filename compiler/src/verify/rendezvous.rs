//! All ranks simulated together under rendezvous semantics: collectives complete when every
//! member of the caller's set has reached one on the same group, point-to-point operations
//! when both sides have posted them. Finds misordered collectives, size mismatches, unmatched
//! or misordered transfers and deadlocks (see the `verify` header for the dp symmetry rule).

use super::slice::Slice;
use super::Violation;
use crate::ir::{CollectiveKind, GroupId, Instr, P2pOp, Plan, ProgramId};
use crate::spec::NodeId;

/// What the simulation needs of one program, gathered by the parallel liveness pass: its
/// rendezvous instructions (collectives and transfers) with their indices, copied out so the
/// simulation reads them contiguously instead of jumping through millions of local
/// instructions, and each buffer's element count.
#[derive(Default)]
pub struct ProgramIndex {
    pub points: Vec<(u32, Instr)>,
    pub numel: Vec<u64>,
    /// Each buffer's element type (a transfer moves elements without converting them).
    pub dtype: Vec<crate::ir::DType>,
}

pub struct Simulation {
    pub violations: Vec<Violation>,
    pub ranks_simulated: u32,
    pub dp_symmetric: bool,
}

/// One posted send or receive.
#[derive(Clone, Copy, Debug)]
struct Posted {
    send: bool,
    /// Global rank of the other side.
    peer: u32,
    tag: u32,
    numel: u64,
    dtype: Option<crate::ir::DType>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Running,
    /// At a collective, waiting for the rest of its set.
    Collective,
    /// At a send/receive/p2p group with operations still unmatched.
    Transfer,
    Done,
}

struct World<'a> {
    plan: &'a Plan,
    /// Global rank of each simulated rank.
    ranks: Vec<u32>,
    /// Simulated index of each global rank's representative.
    sim_of: Vec<usize>,
    /// member[g][rank] = index of the rank's set in group g.
    member: Vec<Vec<Option<u32>>>,
    /// Simulated indices of each group set's representatives, ascending and deduplicated.
    proj_sets: Vec<Vec<Vec<usize>>>,
    /// Each program's rendezvous instructions (collectives and transfers), ascending; local
    /// instructions need no rendezvous and are never visited.
    index: &'a [ProgramIndex],
    /// Per simulated rank: its position in its program's `points`, and the instruction there
    /// (the program's length once it is past the last).
    next: Vec<usize>,
    pc: Vec<usize>,
    status: Vec<Status>,
    posted: Vec<Vec<Posted>>,
    /// arrivals[g][y]: how many members of the set of group `g` whose first simulated member
    /// is `y` wait at a collective on it.
    arrivals: Vec<Vec<u32>>,
    violations: Vec<Violation>,
}

const MAX_VIOLATIONS: usize = 16;

fn describe_kind(kind: &CollectiveKind) -> String {
    match kind {
        CollectiveKind::AllReduce { op } => format!("all_reduce {op:?}").to_lowercase(),
        CollectiveKind::AllGather => "all_gather".to_string(),
        CollectiveKind::ReduceScatter => "reduce_scatter".to_string(),
        CollectiveKind::Broadcast { root } => format!("broadcast from {root}"),
    }
}

impl<'a> World<'a> {
    fn program(&self, y: usize) -> Option<(ProgramId, &'a crate::ir::Program)> {
        let id = *self.plan.rank_program.get(self.ranks[y] as usize)?;
        Some((id, self.plan.programs.get(id.0 as usize)?))
    }

    fn instr(&self, y: usize, pc: usize) -> Option<&'a Instr> {
        self.program(y).and_then(|(_, p)| p.instrs.get(pc))
    }

    /// The rendezvous instruction simulated rank `y` is at (None past the last).
    fn current(&self, y: usize) -> Option<&'a Instr> {
        let (id, _) = self.program(y)?;
        let (_, instr) = self.index.get(id.0 as usize)?.points.get(self.next[y])?;
        Some(instr)
    }

    /// Move simulated rank `y` to its next rendezvous instruction.
    fn advance(&mut self, y: usize) {
        self.next[y] += 1;
        self.settle(y);
    }

    /// Point `pc[y]` at the rendezvous instruction `next[y]` names.
    fn settle(&mut self, y: usize) {
        let program = self.program(y);
        let end = program.map(|(_, p)| p.instrs.len()).unwrap_or(0);
        self.pc[y] = program
            .and_then(|(id, _)| self.index.get(id.0 as usize))
            .and_then(|index| index.points.get(self.next[y]))
            .map(|&(i, _)| i as usize)
            .unwrap_or(end);
    }

    fn numel(&self, y: usize, b: crate::ir::BufferId) -> u64 {
        self.program(y)
            .and_then(|(id, _)| self.index.get(id.0 as usize))
            .and_then(|index| index.numel.get(b.0 as usize))
            .copied()
            .unwrap_or(0)
    }

    fn dtype(&self, y: usize, b: crate::ir::BufferId) -> Option<crate::ir::DType> {
        self.program(y)
            .and_then(|(id, _)| self.index.get(id.0 as usize))
            .and_then(|index| index.dtype.get(b.0 as usize))
            .copied()
    }

    fn group_name(&self, g: GroupId) -> String {
        self.plan
            .group(g)
            .map(|x| x.name.clone())
            .unwrap_or_else(|| format!("g{}", g.0))
    }

    fn describe(&self, y: usize, pc: usize) -> String {
        let r = self.ranks[y];
        match self.instr(y, pc) {
            None => "the end of its program".to_string(),
            Some(Instr::Collective { kind, group, .. }) => {
                format!("{} on {}", describe_kind(kind), self.group_name(*group))
            }
            Some(Instr::Send { peer, tag, .. }) => {
                format!(
                    "send of tag {tag} to rank {}",
                    self.plan.peer_rank(r, *peer)
                )
            }
            Some(Instr::Recv { peer, tag, .. }) => {
                format!(
                    "receive of tag {tag} from rank {}",
                    self.plan.peer_rank(r, *peer)
                )
            }
            Some(Instr::P2p { ops }) => {
                let parts: Vec<String> = ops
                    .iter()
                    .map(|op| match op {
                        P2pOp::Send { peer, tag, .. } => {
                            format!("send tag {tag} to {}", self.plan.peer_rank(r, *peer))
                        }
                        P2pOp::Recv { peer, tag, .. } => {
                            format!("recv tag {tag} from {}", self.plan.peer_rank(r, *peer))
                        }
                    })
                    .collect();
                format!("p2p group ({})", parts.join(", "))
            }
            Some(_) => "a local instruction".to_string(),
        }
    }

    fn violation(
        &mut self,
        code: &'static str,
        y: usize,
        pc: usize,
        node: Option<NodeId>,
        message: String,
    ) {
        if self.violations.len() >= MAX_VIOLATIONS {
            return;
        }
        let program = self.program(y).map(|(id, _)| id).unwrap_or(ProgramId(0));
        self.violations.push(Violation {
            code,
            rank: self.ranks[y],
            program,
            instr: pc,
            node,
            message,
        });
    }

    /// Run simulated rank `y` until it blocks or ends; returns ranks it unblocked.
    fn run(&mut self, y: usize, woken: &mut Vec<usize>) {
        if self.program(y).is_none() {
            self.status[y] = Status::Done;
            return;
        }
        while self.status[y] == Status::Running {
            // `pc` is always at a rendezvous instruction (or the end): local ones are skipped.
            let pc = self.pc[y];
            let Some(instr) = self.current(y) else {
                self.status[y] = Status::Done;
                return;
            };
            match instr {
                Instr::Collective { group, node, .. } => {
                    let r = self.ranks[y];
                    let set = self
                        .member
                        .get(group.0 as usize)
                        .and_then(|m| m.get(r as usize))
                        .copied()
                        .flatten();
                    let Some(set) = set else {
                        let name = self.group_name(*group);
                        self.violation(
                            "E0815",
                            y,
                            pc,
                            *node,
                            format!("issues a collective on group {name}, which has no set containing rank {r}"),
                        );
                        self.status[y] = Status::Done;
                        return;
                    };
                    let (g, set_index) = (group.0 as usize, set as usize);
                    // Borrowed out of `proj_sets` (and put back) so no list is copied per
                    // collective.
                    let members = std::mem::take(&mut self.proj_sets[g][set_index]);
                    let first = members.first().copied().unwrap_or(y);
                    self.status[y] = Status::Collective;
                    let arrived = &mut self.arrivals[g][first];
                    *arrived += 1;
                    if *arrived as usize == members.len() {
                        *arrived = 0;
                        self.complete_collective(*group, set, &members);
                        for &m in &members {
                            self.advance(m);
                            self.status[m] = Status::Running;
                            if m != y {
                                woken.push(m);
                            }
                        }
                    }
                    self.proj_sets[g][set_index] = members;
                }
                Instr::Send { .. } | Instr::Recv { .. } | Instr::P2p { .. } => {
                    self.post(y, instr, woken);
                }
                _ => self.advance(y),
            }
        }
    }

    fn complete_collective(&mut self, group: GroupId, set: u32, members: &[usize]) {
        let n = self
            .plan
            .group(group)
            .and_then(|g| g.sets.get(set as usize))
            .map(|s| s.len() as u64)
            .unwrap_or(1);
        let issued: Vec<(usize, usize, CollectiveKind, u64, u64, Option<NodeId>)> = members
            .iter()
            .filter_map(|&m| match self.current(m) {
                Some(Instr::Collective {
                    kind,
                    input,
                    output,
                    node,
                    ..
                }) => Some((
                    m,
                    self.pc[m],
                    *kind,
                    self.numel(m, *input),
                    self.numel(m, *output),
                    *node,
                )),
                _ => None,
            })
            .collect();
        for &(m, pc, kind, input, output, node) in &issued {
            let fits = match kind {
                CollectiveKind::AllGather => output == n * input,
                CollectiveKind::ReduceScatter => input == n * output,
                CollectiveKind::AllReduce { .. } | CollectiveKind::Broadcast { .. } => {
                    input == output
                }
            };
            let root_ok = match kind {
                CollectiveKind::Broadcast { root } => u64::from(root) < n,
                _ => true,
            };
            if !fits || !root_ok {
                let name = self.group_name(group);
                self.violation(
                    "E0814",
                    m,
                    pc,
                    node,
                    format!(
                        "{} on {name} over {n} ranks has input {input} and output {output} elements, which that collective cannot produce",
                        describe_kind(&kind)
                    ),
                );
            }
        }
        // Members that disagree with the majority (all of them when there is none) issued
        // their collectives in a different order.
        let signature =
            |i: &(usize, usize, CollectiveKind, u64, u64, Option<NodeId>)| (i.2, i.3, i.5);
        let count = |sig| issued.iter().filter(|i| signature(i) == sig).count();
        let Some(majority) = issued.iter().map(signature).max_by_key(|&sig| count(sig)) else {
            return;
        };
        if count(majority) == issued.len() {
            return;
        }
        let strict = count(majority) * 2 > issued.len();
        let name = self.group_name(group);
        let node_name =
            |n: Option<NodeId>| n.map(|n| format!(" for node n{}", n.0)).unwrap_or_default();
        let others: Vec<String> = issued
            .iter()
            .map(|&(m, pc, kind, input, _, node)| {
                format!(
                    "rank {} instruction {pc}: {} of {input} elements{}",
                    self.ranks[m],
                    describe_kind(&kind),
                    node_name(node)
                )
            })
            .collect();
        for &(m, pc, kind, input, _, node) in &issued {
            if strict && (kind, input, node) == majority {
                continue;
            }
            let message = format!(
                "issues {} of {input} elements{} on {name}, but the set's members issue different collectives here ({}): the group's collectives are issued in different orders",
                describe_kind(&kind),
                node_name(node),
                others.join("; ")
            );
            self.violation("E0814", m, pc, node, message);
        }
    }

    fn post(&mut self, y: usize, instr: &Instr, woken: &mut Vec<usize>) {
        let r = self.ranks[y];
        let ops: Vec<Posted> = match instr {
            Instr::Send { peer, buffer, tag } => vec![Posted {
                send: true,
                peer: self.plan.peer_rank(r, *peer),
                tag: *tag,
                numel: self.numel(y, *buffer),
                dtype: self.dtype(y, *buffer),
            }],
            Instr::Recv { peer, buffer, tag } => vec![Posted {
                send: false,
                peer: self.plan.peer_rank(r, *peer),
                tag: *tag,
                numel: self.numel(y, *buffer),
                dtype: self.dtype(y, *buffer),
            }],
            Instr::P2p { ops } => ops
                .iter()
                .map(|op| match op {
                    P2pOp::Send { peer, buffer, tag } => Posted {
                        send: true,
                        peer: self.plan.peer_rank(r, *peer),
                        tag: *tag,
                        numel: self.numel(y, *buffer),
                        dtype: self.dtype(y, *buffer),
                    },
                    P2pOp::Recv { peer, buffer, tag } => Posted {
                        send: false,
                        peer: self.plan.peer_rank(r, *peer),
                        tag: *tag,
                        numel: self.numel(y, *buffer),
                        dtype: self.dtype(y, *buffer),
                    },
                })
                .collect(),
            _ => Vec::new(),
        };
        let mut mine = Vec::new();
        for op in ops {
            let q = self.sim_of.get(op.peer as usize).copied();
            let matched = q.and_then(|q| {
                self.posted[q]
                    .iter()
                    .position(|o| o.send != op.send && o.peer == r && o.tag == op.tag)
                    .map(|i| (q, i))
            });
            match matched {
                Some((q, i)) => {
                    let theirs = self.posted[q].remove(i);
                    if theirs.numel != op.numel || theirs.dtype != op.dtype {
                        let pc = self.pc[y];
                        self.violation(
                            "E0816",
                            y,
                            pc,
                            None,
                            format!(
                                "{} tag {} {} rank {} has {} {} elements but the other side's buffer has {} {}",
                                if op.send { "send of" } else { "receive of" },
                                op.tag,
                                if op.send { "to" } else { "from" },
                                op.peer,
                                op.numel,
                                op.dtype.map_or("?", |d| d.name()),
                                theirs.numel,
                                theirs.dtype.map_or("?", |d| d.name())
                            ),
                        );
                    }
                    if self.posted[q].is_empty() && self.status[q] == Status::Transfer {
                        self.advance(q);
                        self.status[q] = Status::Running;
                        woken.push(q);
                    }
                }
                None => mine.push(op),
            }
        }
        if mine.is_empty() {
            self.advance(y);
        } else {
            self.posted[y] = mine;
            self.status[y] = Status::Transfer;
        }
    }

    /// Where rank `q` (global) receives or sends tag `tag` with rank `r`, if anywhere.
    fn find_transfer(&self, q: u32, r: u32, tag: u32, send: bool) -> Option<usize> {
        let y = *self.sim_of.get(q as usize)?;
        let (_, program) = self.program(y)?;
        program.instrs.iter().position(|instr| {
            let hit = |peer, t, s: bool| {
                s == send && t == tag && self.plan.peer_rank(self.ranks[y], peer) == r
            };
            match instr {
                Instr::Send { peer, tag: t, .. } => hit(*peer, *t, true),
                Instr::Recv { peer, tag: t, .. } => hit(*peer, *t, false),
                Instr::P2p { ops } => ops.iter().any(|op| match op {
                    P2pOp::Send { peer, tag: t, .. } => hit(*peer, *t, true),
                    P2pOp::Recv { peer, tag: t, .. } => hit(*peer, *t, false),
                }),
                _ => false,
            }
        })
    }

    fn report_stuck(&mut self) {
        let stuck: Vec<usize> = (0..self.ranks.len())
            .filter(|&y| self.status[y] != Status::Done)
            .collect();
        for y in stuck {
            let pc = self.pc[y];
            let r = self.ranks[y];
            let node = match self.instr(y, pc) {
                Some(Instr::Collective { node, .. }) => *node,
                _ => None,
            };
            let message = match self.status[y] {
                Status::Collective => {
                    let (group, set) = match self.instr(y, pc) {
                        Some(Instr::Collective { group, .. }) => (
                            *group,
                            self.member[group.0 as usize][r as usize].unwrap_or(0),
                        ),
                        _ => continue,
                    };
                    let members = self.proj_sets[group.0 as usize][set as usize].clone();
                    // Members that reached a collective on this group wait for the missing.
                    let arrived = |m: usize| {
                        self.status[m] == Status::Collective
                            && matches!(
                                self.instr(m, self.pc[m]),
                                Some(Instr::Collective { group: h, .. }) if *h == group
                            )
                    };
                    let missing: Vec<String> = members
                        .iter()
                        .filter(|&&m| !arrived(m))
                        .map(|&m| {
                            format!(
                                "rank {} is at instruction {} ({})",
                                self.ranks[m],
                                self.pc[m],
                                self.describe(m, self.pc[m])
                            )
                        })
                        .collect();
                    format!(
                        "deadlock: {} never completes: {}",
                        self.describe(y, pc),
                        missing.join("; ")
                    )
                }
                Status::Transfer => {
                    let parts: Vec<String> = self.posted[y]
                        .clone()
                        .iter()
                        .map(|op| {
                            let (what, dir) = if op.send {
                                ("send", "to")
                            } else {
                                ("receive", "from")
                            };
                            let there = match self.sim_of.get(op.peer as usize) {
                                Some(&q) => format!(
                                    "rank {} is at instruction {} ({})",
                                    op.peer,
                                    self.pc[q],
                                    self.describe(q, self.pc[q])
                                ),
                                None => format!("rank {} does not exist", op.peer),
                            };
                            match self.find_transfer(op.peer, r, op.tag, !op.send) {
                                None => format!(
                                    "{what} of tag {} {dir} rank {} is unmatched: rank {}'s program has no matching {}; {there}",
                                    op.tag,
                                    op.peer,
                                    op.peer,
                                    if op.send { "receive" } else { "send" }
                                ),
                                Some(k) => format!(
                                    "{what} of tag {} {dir} rank {} is misordered: rank {} posts its side at instruction {k}, but {there}",
                                    op.tag, op.peer, op.peer
                                ),
                            }
                        })
                        .collect();
                    format!("deadlock: {}", parts.join("; "))
                }
                Status::Running | Status::Done => continue,
            };
            self.violation("E0817", y, pc, node, message);
        }
    }
}

/// Simulate every rank (or the dp-symmetric slice) of `plan`; `index[p]` is program `p`'s
/// [`ProgramIndex`] (from [`super::liveness::analyse`]).
pub fn simulate(plan: &Plan, index: &[ProgramIndex]) -> Simulation {
    let Slice {
        ranks,
        sim_of,
        member,
        proj_sets,
        dp_symmetric: symmetric,
        ..
    } = Slice::new(plan);
    let n = ranks.len();
    let mut w = World {
        plan,
        ranks,
        sim_of,
        member,
        proj_sets,
        index,
        next: vec![0; n],
        pc: vec![0; n],
        status: vec![Status::Running; n],
        posted: vec![Vec::new(); n],
        arrivals: vec![vec![0; n]; plan.groups.len()],
        violations: Vec::new(),
    };
    for y in 0..n {
        w.settle(y);
    }
    let mut ready: Vec<usize> = (0..n).rev().collect();
    let mut woken = Vec::new();
    while let Some(y) = ready.pop() {
        w.run(y, &mut woken);
        ready.append(&mut woken);
        if w.violations.len() >= MAX_VIOLATIONS {
            break;
        }
    }
    if w.violations.is_empty() {
        w.report_stuck();
    }
    Simulation {
        violations: w.violations,
        ranks_simulated: n as u32,
        dp_symmetric: symmetric,
    }
}
