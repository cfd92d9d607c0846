//! The discrete-event simulation behind [`super::simulate`]: ranks run until they block on a
//! rendezvous; a rendezvous completes (with its time) when its last member arrives, so the
//! order ranks are run in does not change any time. A run the backend fuses
//! ([`super::fused`]) runs whole at its first member.

use super::fused::{FusedRuns, Role};
use super::{Events, RankTimeline, Row, StepCosts, Timeline, TraceEvent};
use crate::ir::{BufferId, CollectiveKind, GroupId, Instr, P2pOp, Phase, Plan, Program};
use crate::spec::Spec;
use crate::verify::slice::Slice;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Status {
    Running,
    Blocked,
    Done,
}

#[derive(Clone, Copy)]
struct Posted {
    send: bool,
    peer: u32,
    tag: u32,
    bytes: f64,
}

struct RankState {
    pc: usize,
    /// Compute stream clock.
    t: f64,
    /// Comm stream clock (collectives).
    t_comm: f64,
    /// Pipeline transfer stream clock (point-to-point groups, on their own stream).
    t_p2p: f64,
    /// When each buffer's last write (or a collective reading it) completes.
    ready: Vec<f64>,
    /// When the last member of the collective that last set `ready` issued it (waiting before
    /// that is waiting for other members: idle; after it, for communication, the collectives
    /// queued before it on a comm stream included).
    comm_start: Vec<f64>,
    busy: f64,
    comm: f64,
    exposed: f64,
    status: Status,
    posted: Vec<Posted>,
    /// Post time of the current p2p group, the latest start and end of its transfers.
    p2p_posted_at: f64,
    p2p_latest_start: f64,
    p2p_end: f64,
    /// The compute event being extended: (node, phase) key and the event.
    open: Option<((Option<u32>, Phase), TraceEvent)>,
}

impl RankState {
    /// Runs `dur` seconds of compute on the compute stream, once every buffer of `touched` is
    /// ready (waiting for a collective that writes one: exposed communication), making
    /// `written` ready when it ends; returns when it starts.
    fn run_compute(
        &mut self,
        touched: impl IntoIterator<Item = BufferId>,
        written: &[BufferId],
        dur: f64,
    ) -> f64 {
        let (deps, since) = touched
            .into_iter()
            .fold((self.t, self.t), |(deps, since), b| {
                let i = b.0 as usize;
                match (self.ready.get(i), self.comm_start.get(i)) {
                    (Some(&r), Some(&c)) if r > deps => (r, c.max(self.t)),
                    _ => (deps, since),
                }
            });
        self.exposed += deps - since;
        self.busy += dur;
        self.t = deps + dur;
        for b in written {
            if let Some(r) = self.ready.get_mut(b.0 as usize) {
                *r = deps + dur;
            }
        }
        deps
    }
}

struct Engine<'a> {
    plan: &'a Plan,
    spec: &'a Spec,
    costs: &'a dyn StepCosts,
    slice: Slice,
    ranks: Vec<RankState>,
    /// Collective arrivals per (group, first simulated member): (member, issue time).
    arrivals: HashMap<(GroupId, usize), Vec<(usize, f64)>>,
    /// crosses[g][set]: the set spans more than one node.
    crosses: Vec<Vec<bool>>,
    /// Merge compute events per layer rather than per node (large plans).
    coarse: bool,
    /// Per program, the runs the backend fuses (empty for programs no simulated rank runs).
    fused: &'a [FusedRuns],
    /// Whether events are recorded (`Events::Record`).
    record: bool,
    /// Every simulated rank's finished events, in the order each rank finished them.
    events: Vec<TraceEvent>,
    /// The name of the compute events of each (spec node, phase): one allocation per name
    /// rather than per event (a 70B plan's step has ~300k events).
    compute_names: HashMap<(Option<u32>, Phase), Arc<str>>,
    /// The name of every point-to-point event.
    p2p_name: Arc<str>,
}

/// Above this many simulated instructions, compute events are merged per layer.
const COARSE_TRACE_INSTRUCTIONS: usize = 1_000_000;

fn node_of(spec: &Spec, rank: u32) -> u32 {
    rank / spec.cluster.gpus_per_node.max(1)
}

impl<'a> Engine<'a> {
    fn program(&self, y: usize) -> Option<&'a Program> {
        self.plan.programs.get(self.program_index(y)?)
    }

    fn program_index(&self, y: usize) -> Option<usize> {
        let id = self.plan.rank_program.get(self.slice.ranks[y] as usize)?;
        Some(id.0 as usize)
    }

    fn bytes(&self, program: &Program, b: BufferId) -> f64 {
        program
            .buffer(b)
            .map(|buf| self.costs.bytes(buf))
            .unwrap_or(0.0)
    }

    fn close_event(&mut self, y: usize) {
        if let Some((_, e)) = self.ranks[y].open.take() {
            self.events.push(e);
        }
    }

    /// The name of a compute event starting at spec node `node` (`spec_node`) in `phase`, of
    /// its layer's block when `layer` (merged per layer).
    fn compute_name(
        &mut self,
        node: Option<u32>,
        spec_node: Option<&crate::spec::Node>,
        layer: bool,
        phase: Phase,
    ) -> Arc<str> {
        let name = self.compute_names.entry((node, phase)).or_insert_with(|| {
            match (spec_node, layer) {
                (Some(n), true) => {
                    let block = n.name.rsplit_once('.').map_or(n.name.as_str(), |(b, _)| b);
                    format!("{block} {}", phase.name())
                }
                (Some(n), false) => format!("{} {}", n.name, phase.name()),
                (None, _) => phase.name().to_string(),
            }
            .into()
        });
        Arc::clone(name)
    }

    fn compute_event(
        &mut self,
        y: usize,
        pc: usize,
        node: Option<u32>,
        phase: Phase,
        start: f64,
        dur: f64,
    ) {
        if !self.record {
            return;
        }
        let spec_node = node.and_then(|n| self.spec.model.nodes.get(n as usize));
        // Large plans merge a layer's ops (and small ones a node's) into one event.
        let layer = spec_node.and_then(|n| n.layer).filter(|_| self.coarse);
        let key = match layer {
            Some(l) => (Some(l | 1 << 31), phase),
            None => (node, phase),
        };
        let rank = self.slice.ranks[y];
        let state = &mut self.ranks[y];
        if let Some((k, e)) = state.open.as_mut() {
            if *k == key && (e.start + e.duration - start).abs() <= 1e-12 * start.abs().max(1.0) {
                e.duration = start + dur - e.start;
                e.last_instr = pc;
                return;
            }
        }
        let name = self.compute_name(node, spec_node, layer.is_some(), phase);
        let event = TraceEvent {
            rank,
            row: Row::Compute,
            name,
            start,
            duration: dur,
            first_instr: pc,
            last_instr: pc,
        };
        if let Some((_, done)) = self.ranks[y].open.replace((key, event)) {
            self.events.push(done);
        }
    }

    fn run(&mut self, y: usize, woken: &mut Vec<usize>) {
        let Some(program) = self.program(y) else {
            self.ranks[y].status = Status::Done;
            return;
        };
        let fused = self.program_index(y).and_then(|p| self.fused.get(p));
        while self.ranks[y].status == Status::Running {
            let pc = self.ranks[y].pc;
            let Some(instr) = program.instrs.get(pc) else {
                self.close_event(y);
                self.ranks[y].status = Status::Done;
                return;
            };
            match instr {
                Instr::Compute {
                    op,
                    inputs,
                    outputs,
                    node,
                    phase,
                    ..
                } => {
                    let state = &mut self.ranks[y];
                    let (start, dur) = match fused.and_then(|f| f.role(pc, op)) {
                        None => {
                            let dur = self.costs.compute(program, instr);
                            (
                                state.run_compute(
                                    inputs.iter().chain(outputs).copied(),
                                    outputs,
                                    dur,
                                ),
                                dur,
                            )
                        }
                        // The backend launches the whole run here: after every member's
                        // (and refresh copy's) buffers are ready, writing all their outputs.
                        Some(Role::First(run)) => {
                            let members =
                                || (run.instructions()).filter_map(|i| program.instrs.get(i));
                            let touched =
                                members().flat_map(|m| m.reads().into_iter().chain(m.writes()));
                            let written: Vec<BufferId> =
                                members().flat_map(Instr::writes).collect();
                            (
                                state.run_compute(touched, &written, run.seconds),
                                run.seconds,
                            )
                        }
                        Some(Role::Later) => {
                            state.pc += 1;
                            continue;
                        }
                    };
                    state.pc += 1;
                    self.compute_event(y, pc, node.map(|n| n.0), *phase, start, dur);
                }
                Instr::Collective { group, .. } => {
                    let r = self.slice.ranks[y];
                    let set = self
                        .slice
                        .member
                        .get(group.0 as usize)
                        .and_then(|m| m.get(r as usize))
                        .copied()
                        .flatten();
                    let Some(set) = set else {
                        self.ranks[y].status = Status::Blocked;
                        return;
                    };
                    let members = self.slice.proj_sets[group.0 as usize][set as usize].clone();
                    let key = (*group, members.first().copied().unwrap_or(y));
                    self.ranks[y].status = Status::Blocked;
                    let issue = self.ranks[y].t;
                    let arrived = self.arrivals.entry(key).or_default();
                    arrived.push((y, issue));
                    if arrived.len() == members.len() {
                        let arrived = self.arrivals.remove(&key).unwrap_or_default();
                        self.complete_collective(*group, set, &arrived);
                        for (m, _) in arrived {
                            if m != y {
                                woken.push(m);
                            }
                        }
                    }
                }
                Instr::Send { .. } | Instr::Recv { .. } | Instr::P2p { .. } => {
                    self.post(y, program, instr, woken);
                }
                Instr::Free { buffer } => {
                    // The runtime hands a freed buffer's bytes on, so the compute stream first
                    // waits for a collective still using it.
                    let state = &mut self.ranks[y];
                    let i = buffer.0 as usize;
                    if let (Some(&r), Some(&c)) = (state.ready.get(i), state.comm_start.get(i)) {
                        if r > state.t {
                            state.exposed += r - c.max(state.t);
                            state.t = r;
                        }
                    }
                    state.pc += 1;
                }
                Instr::Alloc { .. } | Instr::LoadBatch { .. } => {
                    self.ranks[y].pc += 1;
                }
            }
        }
    }

    fn complete_collective(&mut self, group: GroupId, set: u32, arrived: &[(usize, f64)]) {
        let n = self
            .plan
            .group(group)
            .and_then(|g| g.sets.get(set as usize))
            .map(|s| s.len() as u32)
            .unwrap_or(1);
        let crosses = self.crosses[group.0 as usize][set as usize];
        // When the last member issued it (and a received input's sender posted it): waiting
        // for that is waiting for a peer (idle); waiting after it, while a member's comm stream
        // finishes the collectives queued before this one and then this one moves data, is
        // exposed communication.
        let mut arrival: f64 = 0.0;
        let mut start: f64 = 0.0;
        let mut dur: f64 = 0.0;
        let mut label = String::new();
        for &(m, issue) in arrived {
            let Some(program) = self.program(m) else {
                continue;
            };
            if let Some(Instr::Collective {
                kind,
                input,
                output,
                ..
            }) = program.instrs.get(self.ranks[m].pc)
            {
                let state = &self.ranks[m];
                let input_ready = state.ready.get(input.0 as usize).copied().unwrap_or(0.0);
                // An input still being received or reduced when the collective is issued
                // keeps its own boundary: waiting for a pipeline peer's send is idle.
                let input_idle = match state.comm_start.get(input.0 as usize) {
                    Some(&c) if input_ready > issue => c.min(input_ready),
                    _ => issue,
                };
                arrival = arrival.max(issue).max(input_idle);
                start = start.max(issue).max(state.t_comm).max(input_ready);
                let bytes = match kind {
                    CollectiveKind::AllGather => self.bytes(program, *output),
                    _ => self.bytes(program, *input),
                };
                dur = dur.max(self.costs.collective(*kind, n, bytes, crosses));
                if label.is_empty() && self.record {
                    let what = match kind {
                        CollectiveKind::AllReduce { .. } => "all_reduce",
                        CollectiveKind::AllGather => "all_gather",
                        CollectiveKind::ReduceScatter => "reduce_scatter",
                        CollectiveKind::Broadcast { .. } => "broadcast",
                    };
                    let name = self
                        .plan
                        .group(group)
                        .map(|g| g.name.as_str())
                        .unwrap_or("?");
                    label = format!("{what} {name}");
                }
            }
        }
        let end = start + dur;
        let label: Arc<str> = label.into();
        for &(m, _) in arrived {
            let Some(program) = self.program(m) else {
                continue;
            };
            let pc = self.ranks[m].pc;
            let rank = self.slice.ranks[m];
            let state = &mut self.ranks[m];
            if let Some(Instr::Collective { input, output, .. }) = program.instrs.get(pc) {
                for b in [input, output] {
                    let i = b.0 as usize;
                    if let (Some(r), Some(c)) =
                        (state.ready.get_mut(i), state.comm_start.get_mut(i))
                    {
                        if end >= *r {
                            *r = end;
                            *c = arrival;
                        }
                    }
                }
            }
            state.t_comm = end;
            state.comm += dur;
            state.pc += 1;
            state.status = Status::Running;
            if !self.record {
                continue;
            }
            self.events.push(TraceEvent {
                rank,
                row: Row::Comm,
                name: Arc::clone(&label),
                start,
                duration: dur,
                first_instr: pc,
                last_instr: pc,
            });
        }
    }

    fn post(&mut self, y: usize, program: &Program, instr: &Instr, woken: &mut Vec<usize>) {
        let r = self.slice.ranks[y];
        let op = |send: bool, peer, buffer: BufferId, tag: u32| {
            (
                Posted {
                    send,
                    peer: self.plan.peer_rank(r, peer),
                    tag,
                    bytes: self.bytes(program, buffer),
                },
                buffer,
            )
        };
        let ops: Vec<(Posted, BufferId)> = match instr {
            Instr::Send { peer, buffer, tag } => vec![op(true, *peer, *buffer, *tag)],
            Instr::Recv { peer, buffer, tag } => vec![op(false, *peer, *buffer, *tag)],
            Instr::P2p { ops } => ops
                .iter()
                .map(|o| match o {
                    P2pOp::Send { peer, buffer, tag } => op(true, *peer, *buffer, *tag),
                    P2pOp::Recv { peer, buffer, tag } => op(false, *peer, *buffer, *tag),
                })
                .collect(),
            _ => Vec::new(),
        };
        // The group goes on the transfer stream once the compute stream has reached it, its
        // sends' data is written, its receives' buffers are free and the transfer stream's
        // earlier groups are done; the compute stream goes on.
        let state = &mut self.ranks[y];
        let at = ops
            .iter()
            .filter_map(|(_, b)| state.ready.get(b.0 as usize).copied())
            .fold(state.t.max(state.t_p2p), f64::max);
        state.p2p_posted_at = at;
        state.p2p_latest_start = at;
        state.p2p_end = at;
        let mut mine = Vec::new();
        for (p, _) in &ops {
            let q = self.slice.sim_of.get(p.peer as usize).copied();
            let matched = q.and_then(|q| {
                self.ranks[q]
                    .posted
                    .iter()
                    .position(|o| o.send != p.send && o.peer == r && o.tag == p.tag)
                    .map(|i| (q, i))
            });
            let Some((q, i)) = matched else {
                mine.push(*p);
                continue;
            };
            self.ranks[q].posted.remove(i);
            let crosses = node_of(self.spec, r) != node_of(self.spec, p.peer);
            let start = at.max(self.ranks[q].p2p_posted_at);
            let end = start + self.costs.transfer(p.bytes, crosses);
            for s in [y, q] {
                let st = &mut self.ranks[s];
                st.p2p_latest_start = st.p2p_latest_start.max(start);
                st.p2p_end = st.p2p_end.max(end);
            }
            if self.ranks[q].posted.is_empty() && self.ranks[q].status == Status::Blocked {
                self.finish_p2p(q);
                woken.push(q);
            }
        }
        self.ranks[y].posted = mine;
        if self.ranks[y].posted.is_empty() {
            self.finish_p2p(y);
        } else {
            self.ranks[y].status = Status::Blocked;
        }
    }

    fn finish_p2p(&mut self, y: usize) {
        let Some(program) = self.program(y) else {
            return;
        };
        let rank = self.slice.ranks[y];
        let pc = self.ranks[y].pc;
        let st = &mut self.ranks[y];
        let transfer = st.p2p_end - st.p2p_latest_start;
        st.comm += transfer;
        st.t_p2p = st.p2p_end;
        // Compute that reads a received buffer, or frees or overwrites a sent one, waits for the
        // group: up to its latest transfer's start for the peers (idle), then for the transfer
        // (exposed communication).
        if let Some(instr) = program.instrs.get(pc) {
            for b in instr.reads().into_iter().chain(instr.writes()) {
                let i = b.0 as usize;
                if let (Some(r), Some(c)) = (st.ready.get_mut(i), st.comm_start.get_mut(i)) {
                    *r = st.p2p_end;
                    *c = st.p2p_latest_start;
                }
            }
        }
        if transfer > 0.0 && self.record {
            self.events.push(TraceEvent {
                rank,
                row: Row::Comm,
                name: Arc::clone(&self.p2p_name),
                start: st.p2p_latest_start,
                duration: transfer,
                first_instr: pc,
                last_instr: pc,
            });
        }
        st.pc += 1;
        st.status = Status::Running;
    }
}

/// Per program of `plan`, the runs `costs`' backend fuses: found and priced once for each
/// program a simulated rank runs, none for the others.
fn fused_runs(plan: &Plan, slice: &Slice, costs: &dyn StepCosts) -> Vec<FusedRuns> {
    let mut fused = vec![FusedRuns::default(); plan.programs.len()];
    let mut done = vec![false; plan.programs.len()];
    for &rank in &slice.ranks {
        let Some(&id) = plan.rank_program.get(rank as usize) else {
            continue;
        };
        let (i, program) = (id.0 as usize, plan.programs.get(id.0 as usize));
        if let (Some(program), Some(false)) = (program, done.get(i).copied()) {
            fused[i] = FusedRuns::of(program, costs);
            done[i] = true;
        }
    }
    fused
}

pub fn run(plan: &Plan, spec: &Spec, costs: &dyn StepCosts, events: Events) -> Timeline {
    let slice = Slice::new(plan);
    let crosses = plan
        .groups
        .iter()
        .map(|g| {
            g.sets
                .iter()
                .map(|set| {
                    let first = set.first().map(|&r| node_of(spec, r));
                    set.iter().any(|&r| Some(node_of(spec, r)) != first)
                })
                .collect()
        })
        .collect();
    let ranks = slice
        .ranks
        .iter()
        .map(|&r| {
            let buffers = plan.program_of(r).map(|p| p.buffers.len()).unwrap_or(0);
            RankState {
                pc: 0,
                t: 0.0,
                t_comm: 0.0,
                t_p2p: 0.0,
                ready: vec![0.0; buffers],
                comm_start: vec![0.0; buffers],
                busy: 0.0,
                comm: 0.0,
                exposed: 0.0,
                status: Status::Running,
                posted: Vec::new(),
                p2p_posted_at: 0.0,
                p2p_latest_start: 0.0,
                p2p_end: 0.0,
                open: None,
            }
        })
        .collect();
    let simulated: usize = slice
        .ranks
        .iter()
        .filter_map(|&r| plan.program_of(r))
        .map(|p| p.instrs.len())
        .sum();
    let fused = fused_runs(plan, &slice, costs);
    let mut engine = Engine {
        plan,
        spec,
        costs,
        slice,
        ranks,
        arrivals: HashMap::new(),
        crosses,
        coarse: simulated > COARSE_TRACE_INSTRUCTIONS,
        fused: &fused,
        record: events == Events::Record,
        events: Vec::new(),
        compute_names: HashMap::new(),
        p2p_name: "p2p".into(),
    };
    let n = engine.ranks.len();
    let mut ready: Vec<usize> = (0..n).rev().collect();
    let mut woken = Vec::new();
    while let Some(y) = ready.pop() {
        engine.run(y, &mut woken);
        ready.append(&mut woken);
    }
    let complete = engine.ranks.iter().all(|s| s.status == Status::Done);
    let ends: Vec<f64> = engine
        .ranks
        .iter()
        .map(|s| s.t.max(s.t_comm).max(s.t_p2p))
        .collect();
    let step = ends.iter().copied().fold(0.0, f64::max);
    let mut ranks = Vec::with_capacity(n);
    for y in 0..n {
        engine.close_event(y);
    }
    // By rank (the simulated ranks ascend), then start time; a stable sort, so events of one
    // rank that start together stay in the order the rank finished them.
    let mut events = std::mem::take(&mut engine.events);
    events.sort_by(|a, b| a.rank.cmp(&b.rank).then(a.start.total_cmp(&b.start)));
    for (y, state) in engine.ranks.iter_mut().enumerate() {
        let rank = engine.slice.ranks[y];
        let program = plan.rank_program.get(rank as usize).copied();
        let role = plan
            .program_of(rank)
            .map(|p| p.role.clone())
            .unwrap_or_default();
        ranks.push(RankTimeline {
            rank,
            program: program.unwrap_or(crate::ir::ProgramId(0)),
            role,
            busy_seconds: state.busy,
            comm_seconds: state.comm,
            exposed_comm_seconds: state.exposed,
            idle_seconds: (step - state.busy - state.exposed).max(0.0),
            end_seconds: ends[y],
        });
    }
    // Over global ranks: each simulated rank counts for the ranks it stands for.
    let weights = &engine.slice.weight;
    let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    let mean = |f: &dyn Fn(&RankTimeline) -> f64| {
        if total <= 0.0 || step <= 0.0 {
            0.0
        } else {
            let sum: f64 = ranks
                .iter()
                .zip(weights)
                .map(|(r, &w)| f(r) * f64::from(w))
                .sum();
            sum / total / step
        }
    };
    Timeline {
        step_seconds: step,
        bubble_fraction: mean(&|r| r.idle_seconds),
        exposed_comm_fraction: mean(&|r| r.exposed_comm_seconds),
        dp_symmetric: engine.slice.dp_symmetric,
        ranks,
        events,
        complete,
    }
}
