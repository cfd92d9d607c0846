//! The ranks a whole-plan simulation must run, shared by the verifier's rendezvous check and the
//! timeline. A rank can stand for others when they run its program and talk to its peers'
//! stand-ins (see the `verify` header for the argument):
//! - **dp**: every rank stands for its dp replicas (dp index → 0) when ranks differing only in
//!   dp run one program and no transfer crosses dp;
//! - **classes**: in a class plan (`Plan::representative`) the ranks of tp index ≥ 1 run one
//!   program per stage, as do those of cp index ≥ 1; index 1 stands for the others of its
//!   class (tp or cp index → min(index, 1)) when no transfer crosses that axis.
//!
//! The projections apply together when every group's projected sets agree, else dp alone, else
//! none (every rank simulated).

use crate::ir::{Instr, P2pOp, Plan};
use crate::spec::{Axis, Mesh};

/// The simulated ranks and how every global rank and group set maps onto them.
pub struct Slice {
    /// Global rank of each simulated rank, ascending.
    pub ranks: Vec<u32>,
    /// How many global ranks each simulated rank stands for (itself included).
    pub weight: Vec<u32>,
    /// Simulated index of each global rank's representative.
    pub sim_of: Vec<usize>,
    /// member[g][rank] = index of the rank's set in group g.
    pub member: Vec<Vec<Option<u32>>>,
    /// Simulated indices of each group set's representatives, ascending and deduplicated.
    pub proj_sets: Vec<Vec<Vec<usize>>>,
    pub dp_symmetric: bool,
}

/// Per axis, the largest coordinate a representative keeps (`None`: the axis is not projected).
#[derive(Clone, Copy, Default)]
struct Projection {
    dp: Option<u32>,
    tp: Option<u32>,
    cp: Option<u32>,
}

impl Projection {
    fn rank(&self, mesh: &Mesh, r: u32) -> u32 {
        let mut rank = r;
        for (axis, cap) in [
            (Axis::Dp, self.dp),
            (Axis::Tp, self.tp),
            (Axis::Cp, self.cp),
        ] {
            if let Some(cap) = cap {
                let c = mesh.coord(r, axis);
                rank -= (c - c.min(cap)) * mesh.stride(axis);
            }
        }
        rank
    }
}

/// Whether ranks run their projection's program along `axis` capped at `cap`, with no
/// transfer along it (`transfers`: the axes some transfer crosses).
fn symmetric_along(plan: &Plan, transfers: &[Axis], axis: Axis, cap: u32) -> bool {
    let mesh = &plan.mesh;
    if mesh.size(axis) <= cap + 1 {
        return false;
    }
    let only = Projection {
        dp: (axis == Axis::Dp).then_some(cap),
        tp: (axis == Axis::Tp).then_some(cap),
        cp: (axis == Axis::Cp).then_some(cap),
    };
    let same_program = (0..plan.world).all(|r| {
        plan.rank_program.get(r as usize) == plan.rank_program.get(only.rank(mesh, r) as usize)
    });
    same_program && !transfers.contains(&axis)
}

/// The axes some point-to-point transfer of the plan crosses (one pass over every program).
fn transfer_axes(plan: &Plan) -> Vec<Axis> {
    let mut axes = Vec::new();
    let mut note = |axis: Axis| {
        if !axes.contains(&axis) {
            axes.push(axis);
        }
    };
    for instr in plan.programs.iter().flat_map(|p| &p.instrs) {
        match instr {
            Instr::Send { peer, .. } | Instr::Recv { peer, .. } => note(peer.axis),
            Instr::P2p { ops } => {
                for op in ops {
                    let (P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. }) = op;
                    note(peer.axis);
                }
            }
            _ => {}
        }
    }
    axes
}

/// Each group's sets projected onto representatives, ascending and deduplicated.
fn projected_sets(plan: &Plan, projection: &Projection) -> Vec<Vec<Vec<u32>>> {
    plan.groups
        .iter()
        .map(|g| {
            g.sets
                .iter()
                .map(|set| {
                    let mut p: Vec<u32> = set
                        .iter()
                        .map(|&r| projection.rank(&plan.mesh, r))
                        .collect();
                    p.sort_unstable();
                    p.dedup();
                    p
                })
                .collect()
        })
        .collect()
}

/// Whether every representative's own set, projected, is the projected set it appears in.
fn consistent(proj: &[Vec<Vec<u32>>], member: &[Vec<Option<u32>>]) -> bool {
    proj.iter().enumerate().all(|(g, sets)| {
        sets.iter().all(|p| {
            p.iter().all(|&z| {
                member[g]
                    .get(z as usize)
                    .copied()
                    .flatten()
                    .and_then(|s| sets.get(s as usize))
                    == Some(p)
            })
        })
    })
}

/// The first of the candidate projections (all that apply, dp alone, none) whose projected
/// sets are consistent, with those sets.
fn choose(plan: &Plan, member: &[Vec<Option<u32>>]) -> (Projection, Vec<Vec<Vec<u32>>>) {
    let transfers = transfer_axes(plan);
    let along = |axis: Axis, cap: u32| symmetric_along(plan, &transfers, axis, cap);
    let dp = along(Axis::Dp, 0).then_some(0);
    let classes = plan.representative;
    let all = Projection {
        dp,
        tp: (classes && along(Axis::Tp, 1)).then_some(1),
        cp: (classes && along(Axis::Cp, 1)).then_some(1),
    };
    let dp_only = Projection {
        dp,
        ..Projection::default()
    };
    for projection in [all, dp_only] {
        let proj = projected_sets(plan, &projection);
        if consistent(&proj, member) {
            return (projection, proj);
        }
    }
    let none = Projection::default();
    (none, projected_sets(plan, &none))
}

impl Slice {
    pub fn new(plan: &Plan) -> Slice {
        let world = plan.world;
        let mesh = &plan.mesh;
        let mut member = vec![vec![None; world as usize]; plan.groups.len()];
        for (g, group) in plan.groups.iter().enumerate() {
            for (s, set) in group.sets.iter().enumerate() {
                for &r in set {
                    if let Some(slot) = member[g].get_mut(r as usize) {
                        *slot = Some(s as u32);
                    }
                }
            }
        }
        let (projection, proj) = choose(plan, &member);
        let ranks: Vec<u32> = (0..world)
            .filter(|&r| projection.rank(mesh, r) == r)
            .collect();
        let mut sim_index = vec![usize::MAX; world as usize];
        for (y, &r) in ranks.iter().enumerate() {
            sim_index[r as usize] = y;
        }
        let sim_of: Vec<usize> = (0..world)
            .map(|r| sim_index[projection.rank(mesh, r) as usize])
            .collect();
        let mut weight = vec![0u32; ranks.len()];
        for &y in &sim_of {
            if let Some(w) = weight.get_mut(y) {
                *w += 1;
            }
        }
        let proj_sets: Vec<Vec<Vec<usize>>> = proj
            .iter()
            .map(|sets| {
                sets.iter()
                    .map(|p| p.iter().map(|&r| sim_of[r as usize]).collect())
                    .collect()
            })
            .collect();
        Slice {
            ranks,
            weight,
            sim_of,
            member,
            proj_sets,
            dp_symmetric: projection.dp.is_some(),
        }
    }
}
