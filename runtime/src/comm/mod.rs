//! Communication between ranks: the [`Comm`] trait the executor calls for every collective and
//! point-to-point instruction, and its implementations (`local`: ranks as threads of one
//! process; `mpi`, feature `mpi`: one rank per process over an MPI library).
//!
//! Semantics every implementation keeps (they are the IR's, see `parc_compiler::ir::program`):
//! - A collective runs over `group`, a list of global ranks in group-rank order (ascending) that
//!   contains the caller. Members must issue the same collectives on a group in the same order.
//! - Reductions combine members' inputs in group-rank order, so every member gets bit-identical
//!   results and a run is reproducible.
//! - All-gather concatenates the members' inputs in group-rank order; reduce-scatter gives member
//!   `i` the `i`-th of `n` equal contiguous chunks of the sum.
//! - Point-to-point messages are matched by (sender, receiver, tag), in order per triple.
//!   [`Comm::group_p2p`] issues several at once and returns when all are done, so two ranks that
//!   exchange in both directions cannot deadlock.
//! - No operation waits forever: a peer that never arrives is an error naming the waiting rank,
//!   the operation and the missing ranks; a rank that fails calls [`Comm::abort`] so its peers
//!   stop at once with its reason instead of timing out.
//!
//! Buffers are host `f32` slices: the CPU backend's storage. A device comm (NCCL) implements the
//! same operation set over device memory; the executor's collective dispatch is the only place
//! that moves data between a backend and a comm, so it is where a device comm plugs in.
pub mod layout;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;

pub use local::LocalComm;

use crate::error::Result;
use parc_compiler::ir::{CollectiveKind, ReduceOp};

/// `acc ← acc op x` elementwise: the step every comm applies to the members' contributions, one
/// member after another in group-rank order (the first is copied), so all agree bit for bit.
pub(crate) fn combine(acc: &mut [f32], x: &[f32], op: ReduceOp) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a = match op {
            ReduceOp::Sum => *a + v,
            ReduceOp::Max => a.max(v),
        };
    }
}

/// Checks an all_gather's or reduce_scatter's lengths: its gathered side (all_gather's output,
/// reduce_scatter's input) holds one of the other per member of `group`. Else the message.
pub(crate) fn check_lengths(
    kind: CollectiveKind,
    group: &[u32],
    input: &[f32],
    output: &[f32],
) -> std::result::Result<(), String> {
    let (input, output) = (input.len(), output.len());
    let (what, part, whole) = match kind {
        CollectiveKind::AllGather => ("all_gather", input, output),
        CollectiveKind::ReduceScatter => ("reduce_scatter", output, input),
        CollectiveKind::AllReduce { .. } | CollectiveKind::Broadcast { .. } => return Ok(()),
    };
    if whole == part * group.len() {
        return Ok(());
    }
    Err(format!(
        "{what} on group {group:?}: input of {input} and output of {output} elements do not fit \
         {} members",
        group.len()
    ))
}

/// One send or receive of a [`Comm::group_p2p`] batch.
#[derive(Debug)]
pub enum PeerOp<'a> {
    Send {
        peer: u32,
        tag: u32,
        data: &'a [f32],
    },
    Recv {
        peer: u32,
        tag: u32,
        out: &'a mut [f32],
    },
}

/// Collectives and point-to-point transfers between the ranks of one run.
pub trait Comm: Send {
    /// This rank's global index.
    fn rank(&self) -> u32;
    /// Number of ranks.
    fn world(&self) -> u32;
    /// Combine `data` over `group` with `op`, in place.
    fn all_reduce(&mut self, group: &[u32], op: ReduceOp, data: &mut [f32]) -> Result<()>;
    /// `output` (n × `input.len()` elements) = the members' inputs concatenated in group order.
    fn all_gather(&mut self, group: &[u32], input: &[f32], output: &mut [f32]) -> Result<()>;
    /// `output` = this member's chunk of the elementwise sum of the inputs (n × output elements).
    fn reduce_scatter(&mut self, group: &[u32], input: &[f32], output: &mut [f32]) -> Result<()>;
    /// Every member's `data` becomes the `root`-th member's (`root` is a group index).
    fn broadcast(&mut self, group: &[u32], root: usize, data: &mut [f32]) -> Result<()>;
    /// Send `data` to global rank `peer` under `tag` (by default a group of that one transfer).
    fn send(&mut self, peer: u32, tag: u32, data: &[f32]) -> Result<()> {
        self.group_p2p(&mut [PeerOp::Send { peer, tag, data }])
    }
    /// Receive exactly `out.len()` elements from global rank `peer` under `tag` (by default a
    /// group of that one transfer).
    fn recv(&mut self, peer: u32, tag: u32, out: &mut [f32]) -> Result<()> {
        self.group_p2p(&mut [PeerOp::Recv { peer, tag, out }])
    }
    /// Issue all `ops` together; returns when all have completed.
    fn group_p2p(&mut self, ops: &mut [PeerOp<'_>]) -> Result<()>;
    /// Tell every peer that this rank failed with `reason`; their pending and later operations
    /// fail with it.
    fn abort(&mut self, reason: &str);
    /// Wait until every member of `group` has reached this call.
    fn barrier(&mut self, group: &[u32]) -> Result<()> {
        let mut token = [0.0f32];
        self.all_reduce(group, ReduceOp::Sum, &mut token)
    }
}
