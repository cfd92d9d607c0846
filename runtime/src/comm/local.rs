//! The local comm: every rank is a thread of this process and they meet in a shared
//! [`Fabric`]. Collectives deposit each member's input in a slot keyed by (group, call number);
//! once all members have deposited, each member computes the result itself from the inputs in
//! group-rank order (so results are bit-identical everywhere). Point-to-point messages go through
//! per-(sender, receiver, tag) queues; sends are buffered, so they never block.
//!
//! Every wait is bounded by the fabric's timeout and re-checks whether a peer aborted; members
//! that issue different collectives for the same call number are reported with both ops.
use super::{check_lengths, combine, Comm, PeerOp};
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::{CollectiveKind, ReduceOp};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a member asked a collective to do (compared across members).
#[derive(Clone, Debug, PartialEq)]
enum CollectiveCall {
    AllReduce { op: ReduceOp, len: usize },
    AllGather { len: usize },
    ReduceScatter { len: usize },
    Broadcast { root: usize, len: usize },
}

impl std::fmt::Display for CollectiveCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CollectiveCall::AllReduce { op, len } => {
                let op = match op {
                    ReduceOp::Sum => "sum",
                    ReduceOp::Max => "max",
                };
                write!(f, "all_reduce({op}) of {len} elements")
            }
            CollectiveCall::AllGather { len } => write!(f, "all_gather of {len} elements"),
            CollectiveCall::ReduceScatter { len } => {
                write!(f, "reduce_scatter of {len} elements")
            }
            CollectiveCall::Broadcast { root, len } => {
                write!(f, "broadcast from member {root} of {len} elements")
            }
        }
    }
}

/// One collective call in progress on one group.
struct Slot {
    call: CollectiveCall,
    /// The first member to deposit (named when another member disagrees).
    first: u32,
    inputs: Vec<Option<Arc<Vec<f32>>>>,
    /// Members that have not yet taken the inputs; the last one removes the slot.
    readers_left: usize,
}

#[derive(Default)]
struct FabricState {
    slots: HashMap<(Vec<u32>, u64), Slot>,
    /// (sender, receiver, tag) → queued messages.
    mail: HashMap<(u32, u32, u32), VecDeque<Vec<f32>>>,
    /// The first rank that aborted and why.
    failed: Option<(u32, String)>,
}

/// The meeting point of all local ranks.
pub struct Fabric {
    world: u32,
    timeout: Duration,
    state: Mutex<FabricState>,
    changed: Condvar,
}

impl Fabric {
    fn lock(&self) -> Result<MutexGuard<'_, FabricState>> {
        self.state.lock().map_err(|_| {
            RuntimeError::Comm("a rank thread panicked while holding the local comm".to_string())
        })
    }

    /// Wait on the condition variable until `deadline`; false when the deadline has passed.
    fn wait<'a>(
        &self,
        guard: MutexGuard<'a, FabricState>,
        deadline: Instant,
    ) -> Result<(MutexGuard<'a, FabricState>, bool)> {
        let now = Instant::now();
        if now >= deadline {
            return Ok((guard, false));
        }
        let (guard, _) = self
            .changed
            .wait_timeout(guard, deadline - now)
            .map_err(|_| {
                RuntimeError::Comm(
                    "a rank thread panicked while holding the local comm".to_string(),
                )
            })?;
        Ok((guard, true))
    }
}

fn aborted(rank: u32, failed: &(u32, String)) -> RuntimeError {
    RuntimeError::Comm(format!(
        "rank {rank} stopped because rank {} failed: {}",
        failed.0, failed.1
    ))
}

/// One rank's handle on a [`Fabric`].
pub struct LocalComm {
    rank: u32,
    fabric: Arc<Fabric>,
    /// Collective calls issued so far per group (the next call's number).
    calls: HashMap<Vec<u32>, u64>,
}

impl LocalComm {
    /// Handles for ranks `0..world` of one new fabric; any wait longer than `timeout` fails.
    pub fn world(world: u32, timeout: Duration) -> Vec<LocalComm> {
        let fabric = Arc::new(Fabric {
            world,
            timeout,
            state: Mutex::new(FabricState::default()),
            changed: Condvar::new(),
        });
        (0..world)
            .map(|rank| LocalComm {
                rank,
                fabric: Arc::clone(&fabric),
                calls: HashMap::new(),
            })
            .collect()
    }

    fn check_group(&self, group: &[u32]) -> Result<usize> {
        if let Some(&bad) = group.iter().find(|&&r| r >= self.fabric.world) {
            return Err(RuntimeError::Comm(format!(
                "group {group:?} names rank {bad}, but the world has {} ranks",
                self.fabric.world
            )));
        }
        group.iter().position(|&r| r == self.rank).ok_or_else(|| {
            RuntimeError::Comm(format!(
                "rank {} issued a collective on group {group:?}, which does not contain it",
                self.rank
            ))
        })
    }

    /// Deposit this member's input for the group's next collective and return every member's
    /// input, in group order, once all have arrived.
    fn exchange(
        &mut self,
        group: &[u32],
        call: CollectiveCall,
        input: Vec<f32>,
    ) -> Result<Vec<Arc<Vec<f32>>>> {
        let me = self.check_group(group)?;
        let counter = self.calls.entry(group.to_vec()).or_insert(0);
        let number = *counter;
        *counter += 1;
        let key = (group.to_vec(), number);
        let fabric = Arc::clone(&self.fabric);
        let mut state = fabric.lock()?;
        if let Some(failed) = &state.failed {
            return Err(aborted(self.rank, failed));
        }
        let slot = state.slots.entry(key.clone()).or_insert_with(|| Slot {
            call: call.clone(),
            first: self.rank,
            inputs: vec![None; group.len()],
            readers_left: group.len(),
        });
        if slot.call != call {
            return Err(RuntimeError::Comm(format!(
                "collective mismatch on group {group:?}, call #{number}: rank {} issued {} but \
                 rank {} issued {}; members must issue the same collectives in the same order",
                slot.first, slot.call, self.rank, call
            )));
        }
        if let Some(entry) = slot.inputs.get_mut(me) {
            *entry = Some(Arc::new(input));
        }
        fabric.changed.notify_all();
        let deadline = Instant::now() + fabric.timeout;
        loop {
            if let Some(failed) = &state.failed {
                return Err(aborted(self.rank, failed));
            }
            let ready = state
                .slots
                .get(&key)
                .map(|slot| slot.inputs.iter().all(Option::is_some))
                .unwrap_or(false);
            if ready {
                break;
            }
            let (next, in_time) = fabric.wait(state, deadline)?;
            state = next;
            if !in_time {
                let missing: Vec<u32> = state
                    .slots
                    .get(&key)
                    .map(|slot| {
                        group
                            .iter()
                            .zip(&slot.inputs)
                            .filter(|(_, input)| input.is_none())
                            .map(|(&r, _)| r)
                            .collect()
                    })
                    .unwrap_or_default();
                return Err(RuntimeError::Comm(format!(
                    "rank {} waited {:.1} s for {call} on group {group:?} (call #{number}); \
                     ranks {missing:?} never joined: they failed, hang, or issued collectives \
                     in a different order",
                    self.rank,
                    fabric.timeout.as_secs_f64()
                )));
            }
        }
        let mut inputs = Vec::with_capacity(group.len());
        let mut remove = false;
        if let Some(slot) = state.slots.get_mut(&key) {
            inputs.extend(slot.inputs.iter().flatten().cloned());
            slot.readers_left -= 1;
            remove = slot.readers_left == 0;
        }
        if remove {
            state.slots.remove(&key);
        }
        Ok(inputs)
    }

    fn post(&mut self, peer: u32, tag: u32, data: &[f32]) -> Result<()> {
        if peer >= self.fabric.world {
            return Err(RuntimeError::Comm(format!(
                "rank {} sent to rank {peer}, but the world has {} ranks",
                self.rank, self.fabric.world
            )));
        }
        let fabric = Arc::clone(&self.fabric);
        let mut state = fabric.lock()?;
        if let Some(failed) = &state.failed {
            return Err(aborted(self.rank, failed));
        }
        state
            .mail
            .entry((self.rank, peer, tag))
            .or_default()
            .push_back(data.to_vec());
        fabric.changed.notify_all();
        Ok(())
    }

    fn take(&mut self, peer: u32, tag: u32, out: &mut [f32]) -> Result<()> {
        let fabric = Arc::clone(&self.fabric);
        let mut state = fabric.lock()?;
        let deadline = Instant::now() + fabric.timeout;
        let key = (peer, self.rank, tag);
        loop {
            if let Some(message) = state.mail.get_mut(&key).and_then(VecDeque::pop_front) {
                if message.len() != out.len() {
                    return Err(RuntimeError::Comm(format!(
                        "rank {} expected {} elements from rank {peer} (tag {tag}) but got {}",
                        self.rank,
                        out.len(),
                        message.len()
                    )));
                }
                out.copy_from_slice(&message);
                return Ok(());
            }
            if let Some(failed) = &state.failed {
                return Err(aborted(self.rank, failed));
            }
            let (next, in_time) = fabric.wait(state, deadline)?;
            state = next;
            if !in_time {
                return Err(RuntimeError::Comm(format!(
                    "rank {} waited {:.1} s to receive {} elements from rank {peer} (tag {tag}); \
                     rank {peer} never sent them: it failed, hangs, or sends in another order",
                    self.rank,
                    out.len(),
                    fabric.timeout.as_secs_f64()
                )));
            }
        }
    }
}

impl Comm for LocalComm {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.fabric.world
    }

    fn all_reduce(&mut self, group: &[u32], op: ReduceOp, data: &mut [f32]) -> Result<()> {
        let call = CollectiveCall::AllReduce {
            op,
            len: data.len(),
        };
        let inputs = self.exchange(group, call, data.to_vec())?;
        let mut members = inputs.iter();
        if let Some(first) = members.next() {
            data.copy_from_slice(first);
        }
        for input in members {
            combine(data, input, op);
        }
        Ok(())
    }

    fn all_gather(&mut self, group: &[u32], input: &[f32], output: &mut [f32]) -> Result<()> {
        check_lengths(CollectiveKind::AllGather, group, input, output)
            .map_err(RuntimeError::Comm)?;
        let call = CollectiveCall::AllGather { len: input.len() };
        let inputs = self.exchange(group, call, input.to_vec())?;
        for (chunk, member) in output.chunks_mut(input.len().max(1)).zip(&inputs) {
            chunk.copy_from_slice(member);
        }
        Ok(())
    }

    fn reduce_scatter(&mut self, group: &[u32], input: &[f32], output: &mut [f32]) -> Result<()> {
        check_lengths(CollectiveKind::ReduceScatter, group, input, output)
            .map_err(RuntimeError::Comm)?;
        let me = self.check_group(group)?;
        let call = CollectiveCall::ReduceScatter { len: input.len() };
        let inputs = self.exchange(group, call, input.to_vec())?;
        let range = me * output.len()..(me + 1) * output.len();
        output.fill(0.0);
        for (i, member) in inputs.iter().enumerate() {
            let chunk = member.get(range.clone()).unwrap_or(&[]);
            if i == 0 {
                output.copy_from_slice(chunk);
            } else {
                combine(output, chunk, ReduceOp::Sum);
            }
        }
        Ok(())
    }

    fn broadcast(&mut self, group: &[u32], root: usize, data: &mut [f32]) -> Result<()> {
        if root >= group.len() {
            return Err(RuntimeError::Comm(format!(
                "broadcast on group {group:?} from member {root}, which does not exist"
            )));
        }
        let me = self.check_group(group)?;
        let call = CollectiveCall::Broadcast {
            root,
            len: data.len(),
        };
        let input = if me == root {
            data.to_vec()
        } else {
            Vec::new()
        };
        let inputs = self.exchange(group, call, input)?;
        if me != root {
            if let Some(source) = inputs.get(root) {
                data.copy_from_slice(source);
            }
        }
        Ok(())
    }

    fn send(&mut self, peer: u32, tag: u32, data: &[f32]) -> Result<()> {
        self.post(peer, tag, data)
    }

    fn recv(&mut self, peer: u32, tag: u32, out: &mut [f32]) -> Result<()> {
        self.take(peer, tag, out)
    }

    fn group_p2p(&mut self, ops: &mut [PeerOp<'_>]) -> Result<()> {
        for op in ops.iter() {
            if let PeerOp::Send { peer, tag, data } = op {
                self.post(*peer, *tag, data)?;
            }
        }
        for op in ops.iter_mut() {
            if let PeerOp::Recv { peer, tag, out } = op {
                self.take(*peer, *tag, out)?;
            }
        }
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        if let Ok(mut state) = self.fabric.lock() {
            if state.failed.is_none() {
                state.failed = Some((self.rank, reason.to_string()));
            }
            self.fabric.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `body` on every rank of a fresh fabric, one thread each; results in rank order.
    fn on_ranks<T: Send>(
        world: u32,
        timeout_ms: u64,
        body: impl Fn(&mut LocalComm) -> T + Sync,
    ) -> Vec<T> {
        let comms = LocalComm::world(world, Duration::from_millis(timeout_ms));
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut comm| {
                    let body = &body;
                    s.spawn(move || body(&mut comm))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Values whose float sum depends on the order of addition.
    fn input(rank: u32) -> Vec<f32> {
        vec![
            1e8 * (rank as f32 - 1.5),
            0.1 * (rank as f32) + 1e-3,
            -(rank as f32),
        ]
    }

    #[test]
    fn all_reduce_adds_in_group_order_bit_identically_on_every_rank() {
        let out = on_ranks(4, 5_000, |comm| {
            let mut data = input(comm.rank());
            comm.all_reduce(&[0, 1, 2, 3], ReduceOp::Sum, &mut data)
                .unwrap();
            data
        });
        let mut expected = input(0);
        for r in 1..4 {
            for (e, x) in expected.iter_mut().zip(input(r)) {
                *e += x;
            }
        }
        for data in &out {
            let bits: Vec<u32> = data.iter().map(|x| x.to_bits()).collect();
            let want: Vec<u32> = expected.iter().map(|x| x.to_bits()).collect();
            assert_eq!(bits, want);
        }
    }

    #[test]
    fn subgroups_run_independently_and_max_reduces() {
        let out = on_ranks(4, 5_000, |comm| {
            let group: &[u32] = if comm.rank() % 2 == 0 {
                &[0, 2]
            } else {
                &[1, 3]
            };
            let mut data = vec![comm.rank() as f32, -(comm.rank() as f32)];
            comm.all_reduce(group, ReduceOp::Max, &mut data).unwrap();
            data
        });
        assert_eq!(out, [[2.0, -0.0], [3.0, -1.0], [2.0, -0.0], [3.0, -1.0]]);
    }

    #[test]
    fn gather_scatter_and_broadcast_follow_group_order() {
        let out = on_ranks(3, 5_000, |comm| {
            let r = comm.rank() as f32;
            let group = [0, 1, 2];
            let mut gathered = vec![0.0; 6];
            comm.all_gather(&group, &[r, r + 0.5], &mut gathered)
                .unwrap();
            let contribution: Vec<f32> = (0..6).map(|i| i as f32 * (r + 1.0)).collect();
            let mut scattered = vec![0.0; 2];
            comm.reduce_scatter(&group, &contribution, &mut scattered)
                .unwrap();
            let mut shared = vec![r; 2];
            comm.broadcast(&group, 1, &mut shared).unwrap();
            (gathered, scattered, shared)
        });
        for (rank, (gathered, scattered, shared)) in out.iter().enumerate() {
            assert_eq!(gathered, &[0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
            // Σ_r i·(r+1) = 6i for i in this rank's chunk.
            let i = 2.0 * rank as f32;
            assert_eq!(scattered, &[6.0 * i, 6.0 * (i + 1.0)]);
            assert_eq!(shared, &[1.0, 1.0]);
        }
    }

    #[test]
    fn point_to_point_matches_by_tag_and_grouped_exchanges_do_not_deadlock() {
        let out = on_ranks(2, 5_000, |comm| {
            let me = comm.rank();
            let other = 1 - me;
            if me == 0 {
                comm.send(1, 7, &[7.0]).unwrap();
                comm.send(1, 3, &[3.0, 3.0]).unwrap();
            } else {
                let mut three = [0.0; 2];
                let mut seven = [0.0; 1];
                comm.recv(0, 3, &mut three).unwrap();
                comm.recv(0, 7, &mut seven).unwrap();
                assert_eq!((three, seven), ([3.0, 3.0], [7.0]));
            }
            // Both ranks send and receive at once.
            let mine = [me as f32; 4];
            let mut theirs = [0.0; 4];
            let mut ops = [
                PeerOp::Recv {
                    peer: other,
                    tag: 1,
                    out: &mut theirs,
                },
                PeerOp::Send {
                    peer: other,
                    tag: 1,
                    data: &mine,
                },
            ];
            comm.group_p2p(&mut ops).unwrap();
            theirs
        });
        assert_eq!(out, [[1.0; 4], [0.0; 4]]);
    }

    #[test]
    fn a_missing_peer_is_an_error_naming_the_rank_and_operation() {
        let out = on_ranks(3, 200, |comm| {
            if comm.rank() == 2 {
                return String::new();
            }
            let mut data = [1.0];
            comm.all_reduce(&[0, 1, 2], ReduceOp::Sum, &mut data)
                .unwrap_err()
                .to_string()
        });
        assert!(out[0].contains("rank 0 waited"), "{}", out[0]);
        assert!(
            out[0].contains("all_reduce(sum) of 1 elements"),
            "{}",
            out[0]
        );
        assert!(out[1].contains("ranks [2] never joined"), "{}", out[1]);
        let out = on_ranks(2, 200, |comm| {
            let mut data = [0.0];
            (comm.rank() == 1).then(|| comm.recv(0, 5, &mut data).unwrap_err().to_string())
        });
        let err = out[1].clone().unwrap();
        assert!(err.contains("from rank 0 (tag 5)"), "{err}");
    }

    #[test]
    fn mismatched_collectives_and_aborts_are_reported_at_once() {
        let out = on_ranks(2, 10_000, |comm| {
            let group = [0, 1];
            let started = Instant::now();
            let err = if comm.rank() == 0 {
                let mut data = [0.0; 2];
                comm.all_reduce(&group, ReduceOp::Sum, &mut data)
            } else {
                std::thread::sleep(Duration::from_millis(50));
                let mut out = [0.0; 4];
                comm.all_gather(&group, &[1.0, 2.0], &mut out)
            }
            .unwrap_err()
            .to_string();
            if comm.rank() == 1 {
                comm.abort(&err);
            }
            (err, started.elapsed())
        });
        assert!(out[1].0.contains("collective mismatch"), "{}", out[1].0);
        assert!(
            out[1].0.contains("all_gather of 2 elements"),
            "{}",
            out[1].0
        );
        assert!(out[0].0.contains("because rank 1 failed"), "{}", out[0].0);
        assert!(
            out[0].1 < Duration::from_secs(5),
            "abort did not wake the waiter"
        );
    }
}
