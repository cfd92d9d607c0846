//! `parc run --save-init` and `--log-batches`, the two files the PyTorch peer
//! (`bench/torch_peer.py`) needs to train from parc's initial weights on parc's batches: the
//! init file is plan independent (a dp × tp run writes the same tensors as one rank), holds the
//! weights before any step (not the trained ones), and the batch log lists every step's global
//! batch as token offsets that are sample starts inside the data.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli_support;

use cli_support::{parc_ok, root, sets};
use safetensors::SafeTensors;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn temp_dir(name: &str) -> PathBuf {
    cli_support::temp_dir("parity", name)
}

/// Train the tiny example (2 layers, 3 steps) with `extra` settings, writing both files and
/// (through a checkpoint) the final model into `dir`.
fn run(dir: &Path, extra: &[&str]) {
    let ckpt = format!("train.checkpoint.dir=\"{}\"", dir.join("ckpt").display());
    let mut args = vec!["run", "examples/tiny.par", "--log-format", "json"];
    args.extend(sets(&[
        "model.layers=2",
        "train.steps=3",
        "train.checkpoint.every=3",
        &ckpt,
    ]));
    let init = dir.join("init.safetensors");
    let batches = dir.join("batches.jsonl");
    let (init, batches) = (init.to_str().unwrap(), batches.to_str().unwrap());
    args.extend(["--save-init", init, "--log-batches", batches]);
    args.extend(extra);
    parc_ok(&args);
}

fn tensors(path: &Path) -> (BTreeMap<String, Vec<u8>>, Option<String>) {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let step = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("step").cloned());
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let map = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.data().to_vec()))
        .collect();
    (map, step)
}

#[test]
fn init_weights_are_plan_independent_and_batches_are_logged_per_step() {
    let one = temp_dir("one");
    let split = temp_dir("split");
    run(&one, &[]);
    let plan = ["parallel.dp=2", "parallel.tp=2", "cluster.gpus_per_node=4"];
    run(&split, &sets(&plan));
    let (init, step) = tensors(&one.join("init.safetensors"));
    assert_eq!(step.as_deref(), Some("0"));
    assert_eq!(
        init.len(),
        28,
        "2 layers × 12 (q, k, v fused in one weight and bias) + embed, pos, ln_f weight and bias"
    );
    let (split_init, _) = tensors(&split.join("init.safetensors"));
    assert_eq!(init, split_init, "the init must not depend on the plan");
    let ones: Vec<u8> = std::iter::repeat_n(1.0f32.to_le_bytes(), 64)
        .flatten()
        .collect();
    assert_eq!(init["ln_f.weight"], ones);
    let (trained, trained_step) = tensors(&one.join("ckpt/model.safetensors"));
    assert_eq!(trained_step.as_deref(), Some("3"));
    assert_ne!(init["embed.weight"], trained["embed.weight"]);

    let log = std::fs::read_to_string(one.join("batches.jsonl")).unwrap();
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4, "a header and 3 steps");
    assert_eq!(lines[0]["event"], "batches");
    assert_eq!(lines[0]["seq"], 64);
    assert_eq!(lines[0]["global_batch"], 8);
    let data_len = std::fs::metadata(root().join("examples/data/tiny-shakespeare.txt"))
        .unwrap()
        .len();
    for (k, line) in lines[1..].iter().enumerate() {
        assert_eq!(line["step"], k as u64 + 1);
        let offsets = line["offsets"].as_array().unwrap();
        assert_eq!(offsets.len(), 8);
        for o in offsets {
            let o = o.as_u64().unwrap();
            assert!(o % 64 == 0 && o + 65 <= data_len, "offset {o}");
        }
    }
    let split_log = std::fs::read_to_string(split.join("batches.jsonl")).unwrap();
    assert_eq!(log, split_log, "any dp split reads the same global batches");
    for dir in [one, split] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}
