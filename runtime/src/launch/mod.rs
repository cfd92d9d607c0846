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
use parc_compiler::spec::{Axis, Mesh, Spec};
use serde_json::Value;
use std::collections::BTreeMap;

/// The spec's settings as the rendezvous compares them across ranks (`Member::settings`):
/// every value of its `train`, `parallel` and `cluster` sections by its path
/// (`train.seed` → `0`, `train.optimizer.lr` → `0.001`), and the model as one hash of its
/// definition. Source positions are left out: ranks may write one setting in another place
/// (an argument order, a copy of the spec elsewhere) and still agree.
pub fn spec_settings(spec: &Spec) -> BTreeMap<String, String> {
    serde_json::to_value(spec).map_or_else(|_| BTreeMap::new(), settings_of)
}

/// [`spec_settings`] of the spec's JSON.
fn settings_of(mut json: Value) -> BTreeMap<String, String> {
    let mut settings = BTreeMap::new();
    strip_spans(&mut json);
    let Value::Object(sections) = json else {
        return settings;
    };
    for (section, value) in sections {
        if section == "model" {
            let bytes = serde_json::to_vec(&value).unwrap_or_default();
            let hash = crate::fnv::fnv1a(&bytes);
            settings.insert("model".to_string(), format!("definition {hash:016x}"));
        } else {
            flatten(&section, &value, &mut settings);
        }
    }
    settings
}

/// Remove source positions (`span`, `spans`, `…_span` fields) everywhere in `value`.
fn strip_spans(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|key, _| !(key == "spans" || key == "span" || key.ends_with("_span")));
            map.values_mut().for_each(strip_spans);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_spans),
        _ => {}
    }
}

fn flatten(path: &str, value: &Value, out: &mut BTreeMap<String, String>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (key, inner) in map {
                flatten(&format!("{path}.{key}"), inner, out);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            for (i, inner) in items.iter().enumerate() {
                flatten(&format!("{path}[{i}]"), inner, out);
            }
        }
        Value::String(text) => {
            out.insert(path.to_string(), format!("{text:?}"));
        }
        other => {
            out.insert(path.to_string(), other.to_string());
        }
    }
}

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

    #[test]
    fn settings_name_each_value_by_its_path_without_source_positions() {
        let at = |start: u32| serde_json::json!({"file": 0, "start": start, "end": start + 1});
        let spec = |seed: u64, start: u32| {
            serde_json::json!({
                "model": {"name": "tiny", "span": at(start)},
                "train": {
                    "seed": seed,
                    "optimizer": {"AdamW": {"lr": 0.001}},
                    "data": {"File": {"path": "a.txt", "span": at(start), "tokenizer_span": at(1)}},
                    "span": at(start),
                },
                "parallel": {"mesh": {"axes": [["Dp", 2], ["Tp", 1]]}, "spans": [at(start)]},
            })
        };
        let settings = settings_of(spec(0, 5));
        assert_eq!(settings["train.seed"], "0");
        assert_eq!(settings["train.optimizer.AdamW.lr"], "0.001");
        assert_eq!(settings["train.data.File.path"], "\"a.txt\"");
        assert_eq!(settings["parallel.mesh.axes[0][1]"], "2");
        assert!(settings["model"].starts_with("definition "));
        assert!(!settings.keys().any(|k| k.contains("span")), "{settings:?}");
        // Written elsewhere, the same settings; another seed differs in that path alone.
        assert_eq!(settings_of(spec(0, 9)), settings);
        let other = settings_of(spec(7, 5));
        let differ: Vec<&String> = settings
            .keys()
            .filter(|k| other.get(*k) != settings.get(*k))
            .collect();
        assert_eq!(differ, ["train.seed"]);
    }
}
