//! Loss parity with PyTorch on the CPU (`bench/loss_parity.sh --cpu`, shortened to 12 steps),
//! for GPT-2 (`bench/torch_peer.py`) and the Llama family (`MODEL=llama`,
//! `bench/torch_llama_peer.py`: RMSNorm, RoPE, GQA, SwiGLU): from parc's initial weights and
//! batches, the PyTorch peer's fp32 losses equal parc's within 1e-4 relative at every step,
//! which proves the mapping of layouts, tying, the lr schedule, decay groups, clipping and data
//! order. Without python3 + torch it prints
//! `skipped: ...` and passes (CI machines need not have PyTorch). The comparison's gate itself
//! (`bench/parity/compare.py`) is checked on made-up curves.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::path::PathBuf;
use std::process::Command;

#[test]
fn pytorch_peer_matches_parc_per_step_on_the_cpu() {
    peer_matches_parc("gpt2");
}

#[test]
fn pytorch_llama_peer_matches_parc_per_step_on_the_cpu() {
    peer_matches_parc("llama");
}

fn peer_matches_parc(model: &str) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let torch = Command::new("python3")
        .args(["-c", "import torch"])
        .output();
    if !torch.map(|o| o.status.success()).unwrap_or(false) {
        println!(
            "skipped: python3 cannot import torch (pip install torch to run the parity check)"
        );
        return;
    }
    let out = std::env::temp_dir().join(format!("parc-loss-parity-{model}-{}", std::process::id()));
    let run = Command::new("bash")
        .arg(root.join("bench/loss_parity.sh"))
        .arg("--cpu")
        .env("MODEL", model)
        .env("PARC", env!("CARGO_BIN_EXE_parc"))
        .env("STEPS", "12")
        .env("OUT", &out)
        .current_dir(&root)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("PASS: per-step losses within 0.0001"),
        "{stdout}"
    );
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join(format!("loss-parity-{model}-cpu/comparison.json")))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(summary["steps"], 12);
    let (first, last) = (
        summary["parc_first_last"][0].as_f64().unwrap(),
        summary["parc_first_last"][1].as_f64().unwrap(),
    );
    assert!(last < first - 0.5, "the loss must fall: {first} -> {last}");
    std::fs::remove_dir_all(&out).unwrap();
}

/// `bench/parity/compare.py` passes equal curves and fails (exit 1) curves whose moving
/// averages drift apart by more than the tolerance, or whose learning rates differ.
#[test]
fn compare_gates_on_the_moving_average_and_the_learning_rate() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if Command::new("python3").arg("--version").output().is_err() {
        println!("skipped: no python3");
        return;
    }
    let dir = std::env::temp_dir().join(format!("parc-compare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, drift: f64, lr_scale: f64| {
        let lines: Vec<String> = (1..=20)
            .map(|k| {
                let loss = 5.0 - 0.1 * k as f64 + if k > 10 { drift } else { 0.0 };
                format!(
                    r#"{{"event":"step","step":{k},"loss":{loss},"lr":{},"grad_norm":1.0}}"#,
                    1e-3 * lr_scale
                )
            })
            .collect();
        let path = dir.join(name);
        std::fs::write(&path, lines.join("\n")).unwrap();
        path
    };
    let base = write("base.jsonl", 0.0, 1.0);
    let compare = |other: &PathBuf| {
        Command::new("python3")
            .arg(root.join("bench/parity/compare.py"))
            .args([&base, other])
            .args(["--tolerance", "0.01"])
            .output()
            .unwrap()
            .status
            .code()
    };
    assert_eq!(compare(&write("same.jsonl", 0.0, 1.0)), Some(0));
    assert_eq!(compare(&write("close.jsonl", 0.01, 1.0)), Some(0));
    assert_eq!(compare(&write("drift.jsonl", 0.2, 1.0)), Some(1));
    assert_eq!(compare(&write("lr.jsonl", 0.0, 1.001)), Some(1));
    std::fs::remove_dir_all(&dir).unwrap();
}
