//! Checkpoints you can trust (issue 23): a shard with one flipped bit or cut short is refused
//! naming the file and the tensor, and resuming from the checkpoint folder falls back to the
//! newest checkpoint that verifies, continuing exactly as the uninterrupted run; a second run on
//! a locked checkpoint folder is refused naming the holder, a dead holder's lock is taken over;
//! the summary lists only checkpoints that exist.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;

use fixtures::{spec, train_cpu, PlanChoice, TinyModel};
use parc_compiler::lower::lower;
use parc_compiler::spec::{Checkpointing, Spec};
use parc_runtime::exec::{TrainOptions, TrainResult};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("parc-trust-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny Llama on dp 2, `steps` steps, a checkpoint every 2 steps into `dir`.
fn checkpointing(dir: &Path, steps: u64, keep: u32) -> Spec {
    let model = TinyModel {
        layers: 2,
        llama: true,
        tied: false,
    };
    let plan = PlanChoice {
        dp: 2,
        ..PlanChoice::default()
    };
    let mut s = spec(model, plan);
    s.train.steps = steps;
    s.train.checkpoint = Some(Checkpointing {
        every: 2,
        dir: dir.display().to_string(),
        keep,
        asynchronous: true,
    });
    s
}

fn try_run(
    s: &Spec,
    stop_after: Option<u64>,
    resume: Option<&Path>,
) -> Result<TrainResult, String> {
    let plan = lower(s).unwrap_or_else(|d| panic!("{:?}", d.items));
    let mut options = TrainOptions::new(".");
    options.comm_timeout = Duration::from_secs(30);
    options.threads_per_rank = Some(1);
    options.stop_after = stop_after;
    options.resume = resume.map(Path::to_path_buf);
    train_cpu(s, &plan, &options).map_err(|e| e.to_string())
}

fn run(s: &Spec, stop_after: Option<u64>, resume: Option<&Path>) -> TrainResult {
    try_run(s, stop_after, resume).unwrap_or_else(|e| panic!("{e}"))
}

/// The name and absolute byte range of the largest tensor of a safetensors file.
fn largest_tensor(shard: &Path) -> (String, usize, usize) {
    let bytes = std::fs::read(shard).unwrap();
    let (header_len, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
    let (name, info) = metadata
        .tensors()
        .into_iter()
        .max_by_key(|(_, info)| info.data_offsets.1 - info.data_offsets.0)
        .unwrap();
    let start = 8 + header_len;
    (
        name,
        start + info.data_offsets.0,
        start + info.data_offsets.1,
    )
}

fn bits(values: impl IntoIterator<Item = f32>) -> Vec<u32> {
    values.into_iter().map(f32::to_bits).collect()
}

#[test]
fn a_corrupt_checkpoint_is_refused_and_the_folder_resumes_from_one_that_verifies() {
    let full = run(&checkpointing(&temp_dir("full"), 6, 0), None, None);
    let dir = temp_dir("flip");
    let s = checkpointing(&dir, 6, 0);
    let first = run(&s, Some(4), None);
    assert_eq!(first.checkpoints.len(), 2);
    let step4 = dir.join("step-00000004");
    let shard = step4.join("rank-00001.safetensors");
    let (tensor, start, end) = largest_tensor(&shard);
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[(start + end) / 2] ^= 0x04;
    std::fs::write(&shard, &bytes).unwrap();

    let refused = try_run(&s, None, Some(&step4)).unwrap_err();
    assert!(
        refused.contains("step-00000004/rank-00001.safetensors")
            && refused.contains(&format!("tensor {tensor} fails its checksum")),
        "{refused}"
    );
    // The folder resumes from step 2, the newest that verifies, and continues exactly.
    let resumed = run(&s, None, Some(&dir));
    assert_eq!(resumed.start_step, 2);
    assert_eq!(
        bits(resumed.records.iter().map(|r| r.loss)),
        bits(full.records[2..].iter().map(|r| r.loss))
    );

    // A shard cut short is refused naming the file and a tensor past its end.
    let step2_shard = dir.join("step-00000002").join("rank-00000.safetensors");
    let bytes = std::fs::read(&step2_shard).unwrap();
    std::fs::write(&step2_shard, &bytes[..bytes.len() / 2]).unwrap();
    let truncated = try_run(&s, None, Some(&dir.join("step-00000002"))).unwrap_err();
    assert!(
        truncated.contains("step-00000002/rank-00000.safetensors")
            && truncated.contains("tensor ")
            && truncated.contains("truncated"),
        "{truncated}"
    );
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_string()
}

fn write_lock(dir: &Path, pid: u32) {
    let json = serde_json::json!({ "host": host_name(), "pid": pid });
    std::fs::write(dir.join("parc.lock"), json.to_string()).unwrap();
}

#[test]
fn a_locked_checkpoint_folder_is_refused_and_a_dead_holders_lock_taken_over() {
    let dir = temp_dir("lock");
    let s = checkpointing(&dir, 2, 0);
    // A live holder: this test's own process, as another run of it would be.
    write_lock(&dir, std::process::id());
    let refused = try_run(&s, None, None).unwrap_err();
    assert!(
        refused.contains(&format!(
            "another run is using this checkpoint folder (host {}, pid {})",
            host_name(),
            std::process::id()
        )),
        "{refused}"
    );
    assert!(!dir.join("step-00000002").exists(), "the refused run wrote");
    // A holder that no longer runs: taken over, and the lock is gone when the run ends.
    write_lock(&dir, 999_999_999);
    let result = run(&s, None, None);
    assert_eq!(result.checkpoints, vec![dir.join("step-00000002")]);
    assert!(!dir.join("parc.lock").exists());
}

#[test]
fn the_summary_lists_only_checkpoints_that_exist() {
    let dir = temp_dir("pruned");
    // An earlier, longer run left step-6 and step-8 (keep 2).
    let earlier = run(&checkpointing(&dir, 8, 2), None, None);
    assert_eq!(earlier.checkpoints.len(), 2);
    assert!(earlier.checkpoints.iter().all(|p| p.is_dir()));
    // This run's step-2 and step-4 are pruned as older than those: it must not report them.
    let later = run(&checkpointing(&dir, 4, 2), None, None);
    assert_eq!(later.checkpoints, Vec::<PathBuf>::new());
    assert!(dir.join("step-00000008").is_dir());
}
