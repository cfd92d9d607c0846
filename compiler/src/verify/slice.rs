//! The ranks a whole-plan simulation must run: with dp symmetry (every rank runs its dp-0
//! counterpart's program and no transfer crosses dp; see the `verify` header) only the dp-0
//! slice, else the world. Shared by the verifier's rendezvous check and the timeline.

use crate::ir::{Instr, P2pOp, Plan};
use crate::spec::Axis;

/// The simulated ranks and how every global rank and group set maps onto them.
pub struct Slice {
    /// Global rank of each simulated rank, ascending.
    pub ranks: Vec<u32>,
    /// Simulated index of each global rank's representative.
    pub sim_of: Vec<usize>,
    /// member[g][rank] = index of the rank's set in group g.
    pub member: Vec<Vec<Option<u32>>>,
    /// Simulated indices of each group set's representatives, ascending and deduplicated.
    pub proj_sets: Vec<Vec<Vec<usize>>>,
    pub dp_symmetric: bool,
}

/// Whether ranks differing only in dp run the same program and talk only within their slice.
fn dp_symmetric(plan: &Plan) -> bool {
    let mesh = &plan.mesh;
    if mesh.size(Axis::Dp) <= 1 {
        return false;
    }
    let stride = mesh.stride(Axis::Dp);
    let base = |r: u32| r - mesh.coord(r, Axis::Dp) * stride;
    let same_program = (0..plan.world)
        .all(|r| plan.rank_program.get(r as usize) == plan.rank_program.get(base(r) as usize));
    let no_dp_transfers = plan.programs.iter().all(|p| {
        p.instrs.iter().all(|i| match i {
            Instr::Send { peer, .. } | Instr::Recv { peer, .. } => peer.axis != Axis::Dp,
            Instr::P2p { ops } => ops.iter().all(|op| match op {
                P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } => peer.axis != Axis::Dp,
            }),
            _ => true,
        })
    });
    same_program && no_dp_transfers
}

impl Slice {
    pub fn new(plan: &Plan) -> Slice {
        let world = plan.world;
        let mut symmetric = dp_symmetric(plan);
        let mesh = &plan.mesh;
        let project = |r: u32, sym: bool| {
            if sym {
                r - mesh.coord(r, Axis::Dp) * mesh.stride(Axis::Dp)
            } else {
                r
            }
        };
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
        // Projected sets must agree for every representative (else simulate everything).
        let projected = |sym: bool| -> Vec<Vec<Vec<u32>>> {
            plan.groups
                .iter()
                .map(|g| {
                    g.sets
                        .iter()
                        .map(|set| {
                            let mut p: Vec<u32> = set.iter().map(|&r| project(r, sym)).collect();
                            p.sort_unstable();
                            p.dedup();
                            p
                        })
                        .collect()
                })
                .collect()
        };
        let mut proj = projected(symmetric);
        if symmetric {
            let consistent = proj.iter().enumerate().all(|(g, sets)| {
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
            });
            if !consistent {
                symmetric = false;
                proj = projected(false);
            }
        }
        let ranks: Vec<u32> = (0..world)
            .filter(|&r| !symmetric || mesh.coord(r, Axis::Dp) == 0)
            .collect();
        let mut sim_index = vec![usize::MAX; world as usize];
        for (y, &r) in ranks.iter().enumerate() {
            sim_index[r as usize] = y;
        }
        let sim_of: Vec<usize> = (0..world)
            .map(|r| sim_index[project(r, symmetric) as usize])
            .collect();
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
            sim_of,
            member,
            proj_sets,
            dp_symmetric: symmetric,
        }
    }
}
