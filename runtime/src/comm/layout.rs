//! Which device communicators (NCCL) a plan needs, and the proof that a device communicator's
//! message matching agrees with the IR's. Pure: no CUDA, so it is tested everywhere.
//!
//! - **Communicators.** Every group family of a plan partitions (part of) the world into sets.
//!   A device comm makes one communicator per *distinct partition*, split from the world
//!   communicator: a split is collective over the whole world, so every rank must make the same
//!   splits in the same order. [`CommLayout::of_plan`] lists them in plan order (the same on
//!   every rank); a partition that is the whole world as one set uses the world communicator
//!   itself, and families with the same partition (e.g. `dp` and `dp+cp` when cp = 1) share one.
//! - **Message order.** NCCL matches point-to-point messages by their order per (sender,
//!   receiver) pair and ignores tags; the IR matches them by (sender, receiver, tag) and the
//!   verifier proves the plan completes under that rule, not that the orders agree.
//!   [`check_p2p_order`] proves, for one rank, that for every peer the tags it sends are the
//!   tags the peer receives, in the same order (and the reverse), so order matching pairs
//!   exactly the messages tag matching would.
use parc_compiler::ir::{Instr, P2pOp, Peer, Plan};
use std::collections::HashMap;

/// The communicator that serves a group set: the world's, or split `i` of
/// [`CommLayout::splits`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommKey {
    World,
    Split(usize),
}

/// The communicators of a plan; see the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct CommLayout {
    world: u32,
    /// Distinct partitions other than the whole world, in first-use (plan group) order.
    splits: Vec<Vec<Vec<u32>>>,
    /// Every set of every family → the communicator that serves it.
    keys: HashMap<Vec<u32>, CommKey>,
}

impl CommLayout {
    /// The communicators for every group family of `plan`.
    pub fn of_plan(plan: &Plan) -> CommLayout {
        CommLayout::of_partitions(plan.world, plan.groups.iter().map(|g| g.sets.as_slice()))
    }

    /// The communicators for `partitions` (each a list of disjoint sets of global ranks,
    /// ascending in each set) of a world of `world` ranks.
    pub fn of_partitions<'a>(
        world: u32,
        partitions: impl IntoIterator<Item = &'a [Vec<u32>]>,
    ) -> CommLayout {
        let whole: Vec<u32> = (0..world).collect();
        let mut splits: Vec<Vec<Vec<u32>>> = Vec::new();
        let mut keys = HashMap::new();
        for partition in partitions {
            let key = if partition.len() == 1 && partition[0] == whole {
                CommKey::World
            } else {
                match splits.iter().position(|s| s.as_slice() == partition) {
                    Some(i) => CommKey::Split(i),
                    None => {
                        splits.push(partition.to_vec());
                        CommKey::Split(splits.len() - 1)
                    }
                }
            };
            for set in partition {
                keys.entry(set.clone()).or_insert(key);
            }
        }
        CommLayout {
            world,
            splits,
            keys,
        }
    }

    pub fn world(&self) -> u32 {
        self.world
    }

    /// The partitions to split from the world communicator, in the order every rank splits.
    pub fn splits(&self) -> &[Vec<Vec<u32>>] {
        &self.splits
    }

    /// `rank`'s colour in split `index`: the index of its set, or None where it is in none
    /// (it still takes part in the split, asking for no communicator).
    pub fn color(&self, index: usize, rank: u32) -> Option<u32> {
        self.splits
            .get(index)?
            .iter()
            .position(|set| set.contains(&rank))
            .map(|i| i as u32)
    }

    /// The communicator that serves `set` (global ranks in group-rank order), if it is a set of
    /// one of the plan's families or the whole world.
    pub fn key_of(&self, set: &[u32]) -> Option<CommKey> {
        let whole = set.len() as u32 == self.world && set.iter().copied().eq(0..self.world);
        if whole {
            return Some(CommKey::World);
        }
        self.keys.get(set).copied()
    }
}

/// The tags of the messages `from` sends to `to`, in the order `from`'s program issues them.
fn tags_sent(plan: &Plan, from: u32, to: u32) -> Result<Vec<u32>, String> {
    transfer_tags(plan, from, to, true)
}

/// The tags of the messages `at` receives from `from`, in the order `at`'s program posts them.
fn tags_received(plan: &Plan, at: u32, from: u32) -> Result<Vec<u32>, String> {
    transfer_tags(plan, at, from, false)
}

fn transfer_tags(plan: &Plan, rank: u32, other: u32, sends: bool) -> Result<Vec<u32>, String> {
    let program = plan
        .program_of(rank)
        .ok_or_else(|| format!("rank {rank} has no program"))?;
    let mut tags = Vec::new();
    let mut visit = |send: bool, peer: Peer, tag: u32| {
        if send == sends && plan.peer_rank(rank, peer) == other {
            tags.push(tag);
        }
    };
    for instr in &program.instrs {
        match instr {
            Instr::Send { peer, tag, .. } => visit(true, *peer, *tag),
            Instr::Recv { peer, tag, .. } => visit(false, *peer, *tag),
            Instr::P2p { ops } => {
                for op in ops {
                    match op {
                        P2pOp::Send { peer, tag, .. } => visit(true, *peer, *tag),
                        P2pOp::Recv { peer, tag, .. } => visit(false, *peer, *tag),
                    }
                }
            }
            _ => {}
        }
    }
    Ok(tags)
}

/// The peers `rank`'s program sends to or receives from, ascending.
fn peers_of(plan: &Plan, rank: u32) -> Vec<u32> {
    let mut peers: Vec<u32> = plan
        .program_of(rank)
        .map(|program| {
            program
                .instrs
                .iter()
                .flat_map(|instr| match instr {
                    Instr::Send { peer, .. } | Instr::Recv { peer, .. } => vec![*peer],
                    Instr::P2p { ops } => ops
                        .iter()
                        .map(|op| match op {
                            P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } => *peer,
                        })
                        .collect(),
                    _ => Vec::new(),
                })
                .map(|peer| plan.peer_rank(rank, peer))
                .collect()
        })
        .unwrap_or_default();
    peers.sort_unstable();
    peers.dedup();
    peers
}

/// Check that order matching per (sender, receiver) pair pairs the same messages as the IR's
/// tag matching, for every transfer `rank` takes part in (see the module docs). The error
/// names both ranks and both tag sequences.
pub fn check_p2p_order(plan: &Plan, rank: u32) -> Result<(), String> {
    for peer in peers_of(plan, rank) {
        for (from, to) in [(rank, peer), (peer, rank)] {
            let sent = tags_sent(plan, from, to)?;
            let received = tags_received(plan, to, from)?;
            if sent != received {
                return Err(format!(
                    "rank {from} sends tags {sent:?} to rank {to} in this order, but rank {to} \
                     receives tags {received:?} from rank {from}: NCCL matches messages by \
                     order, so this plan cannot run on a device comm (a lowering bug; use \
                     --comm local)"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sets(v: &[&[u32]]) -> Vec<Vec<u32>> {
        v.iter().map(|s| s.to_vec()).collect()
    }

    #[test]
    fn equal_partitions_share_a_split_and_the_whole_world_uses_the_world_comm() {
        let dp = sets(&[&[0, 2], &[1, 3]]);
        let tp = sets(&[&[0, 1], &[2, 3]]);
        let all = sets(&[&[0, 1, 2, 3]]);
        let dp_again = dp.clone();
        let layout = CommLayout::of_partitions(
            4,
            [
                dp.as_slice(),
                tp.as_slice(),
                all.as_slice(),
                dp_again.as_slice(),
            ],
        );
        assert_eq!(layout.splits(), &[dp.clone(), tp.clone()]);
        assert_eq!(layout.key_of(&[1, 3]), Some(CommKey::Split(0)));
        assert_eq!(layout.key_of(&[2, 3]), Some(CommKey::Split(1)));
        assert_eq!(layout.key_of(&[0, 1, 2, 3]), Some(CommKey::World));
        assert_eq!(layout.key_of(&[0, 3]), None);
        assert_eq!(layout.color(0, 3), Some(1));
        assert_eq!(layout.color(1, 3), Some(1));
        assert_eq!(layout.color(1, 0), Some(0));
    }

    #[test]
    fn ranks_outside_a_partial_family_get_no_colour() {
        // An `embed`-like family: only the first and last pipeline stage.
        let embed = sets(&[&[0, 3]]);
        let layout = CommLayout::of_partitions(4, [embed.as_slice()]);
        assert_eq!(layout.splits().len(), 1);
        assert_eq!(layout.color(0, 0), Some(0));
        assert_eq!(layout.color(0, 1), None);
        assert_eq!(layout.color(5, 0), None);
    }

    #[test]
    fn a_one_rank_world_needs_no_split() {
        let one = sets(&[&[0]]);
        let layout = CommLayout::of_partitions(1, [one.as_slice(), one.as_slice()]);
        assert!(layout.splits().is_empty());
        assert_eq!(layout.key_of(&[0]), Some(CommKey::World));
    }

    #[test]
    fn the_whole_world_is_served_even_without_a_family_for_it() {
        let layout = CommLayout::of_partitions(3, std::iter::empty());
        assert_eq!(layout.key_of(&[0, 1, 2]), Some(CommKey::World));
        assert_eq!(layout.key_of(&[0, 1]), None);
        assert_eq!(layout.key_of(&[2, 1, 0]), None);
    }
}
