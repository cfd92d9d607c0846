//! Running one rank per process: which launcher started this process ([`env`]), the TCP
//! rendezvous that checks the job and carries its failures ([`rendezvous`]), and the checks
//! that tie a launched job to its plan: the world size must be the mesh's, and the mesh order
//! must keep tensor-parallel neighbours on one host.
//!
//! Global ranks are laid out host-major (ranks `h·n … h·n + n − 1` on host `h`, `n` processes
//! per host), and a rank's local rank picks its GPU. The mesh's innermost axis is `tp` in every
//! plan parc lowers, so tp groups are consecutive ranks and share a host whenever the tp size
//! divides the processes per host; [`check_tp_on_host`] verifies it for the job at hand.
pub mod env;
pub mod rendezvous;

pub use env::{detect, detect_process, LaunchEnv, LauncherKind};
pub use rendezvous::{free_port, FailureWatch, Member, Rendezvous, RendezvousConfig};

use crate::error::{Result, RuntimeError};
use parc_compiler::spec::{Axis, Mesh};

/// Refuse a job whose process count is not the plan's world size, before any communication.
pub fn check_world(mesh: &Mesh, launched: u32, how: &str) -> Result<()> {
    let world = mesh.world();
    if world == launched {
        return Ok(());
    }
    let axes: Vec<String> = mesh
        .axes
        .iter()
        .map(|(axis, n)| format!("{}={n}", axis.name()))
        .collect();
    Err(RuntimeError::Unsupported(format!(
        "the spec's mesh has {world} ranks ({}) but {launched} processes were launched ({how}); \
         launch {world} processes, or change the plan with --set parallel.…",
        axes.join(" × ")
    )))
}

/// Check that every tensor-parallel group lies on one host when `per_host` consecutive ranks
/// share a host. Tensor parallelism exchanges activations in every layer; across hosts it
/// would run at the inter-node link's speed.
pub fn check_tp_on_host(mesh: &Mesh, per_host: u32) -> Result<()> {
    let tp = mesh.size(Axis::Tp);
    if tp <= 1 || per_host == 0 {
        return Ok(());
    }
    let stride = mesh.stride(Axis::Tp);
    for rank in 0..mesh.world() {
        let first = rank - mesh.coord(rank, Axis::Tp) * stride;
        let last = first + (tp - 1) * stride;
        if first / per_host != last / per_host {
            return Err(RuntimeError::Unsupported(format!(
                "tensor-parallel group of rank {rank} (ranks {first}..={last}, tp = {tp}) spans \
                 hosts with {per_host} processes per host; use a tp that divides the processes \
                 per host (cluster.gpus_per_node) and keep tp the innermost mesh axis"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh(axes: &[(Axis, u32)]) -> Mesh {
        Mesh {
            axes: axes.to_vec(),
        }
    }

    #[test]
    fn world_mismatch_names_both_numbers() {
        let m = mesh(&[(Axis::Dp, 2), (Axis::Pp, 1), (Axis::Cp, 1), (Axis::Tp, 2)]);
        assert!(check_world(&m, 4, "--nproc-per-node 4").is_ok());
        let err = check_world(&m, 3, "WORLD_SIZE=3").unwrap_err().to_string();
        assert!(
            err.contains("mesh has 4 ranks (dp=2 × pp=1 × cp=1 × tp=2)"),
            "{err}"
        );
        assert!(
            err.contains("but 3 processes were launched (WORLD_SIZE=3)"),
            "{err}"
        );
    }

    #[test]
    fn tp_groups_must_share_a_host() {
        let m = mesh(&[(Axis::Dp, 4), (Axis::Pp, 1), (Axis::Cp, 1), (Axis::Tp, 4)]);
        assert!(check_tp_on_host(&m, 8).is_ok());
        assert!(check_tp_on_host(&m, 4).is_ok());
        let err = check_tp_on_host(&m, 2).unwrap_err().to_string();
        assert!(
            err.contains("spans hosts with 2 processes per host"),
            "{err}"
        );
        // tp not innermost: its members are 2 apart.
        let m = mesh(&[(Axis::Tp, 2), (Axis::Dp, 2)]);
        assert!(check_tp_on_host(&m, 2).is_err());
        assert!(check_tp_on_host(&m, 4).is_ok());
    }
}
