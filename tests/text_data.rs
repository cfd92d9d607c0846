//! Text through a tokenizer, end to end through the binary: the bundled GPT-2 text example
//! trains on the CPU and its loss falls; `parc tokenize`'s shards hold the stream `text(...)`
//! tokenizes and train to the same losses; bad input (a missing text file or tokenizer.json, an
//! unknown tokenizer, a model vocabulary smaller than the tokenizer's) is a clear error.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli_support;

use cli_support::{json_lines, parc, parc_ok, root, stderr_of, steps};
use parc_runtime::data::text::tokenize_files;
use parc_runtime::data::Tokenizer;
use std::path::PathBuf;
use std::process::Output;

const EXAMPLE: &str = "examples/tiny-gpt2-text.par";

fn temp_dir(name: &str) -> PathBuf {
    cli_support::temp_dir("text", name)
}

fn losses(out: &Output) -> Vec<f64> {
    steps(&json_lines(out))
        .iter()
        .map(|v| v["loss"].as_f64().unwrap())
        .collect()
}

/// `--set train.checkpoint.dir=…` to a folder of its own: the example checkpoints, and runs
/// in parallel tests must not share (and lock) one folder, nor write into `examples/`.
fn own_checkpoint_dir() -> String {
    static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = temp_dir(&format!("ckpt-{n}"));
    format!("train.checkpoint.dir=\"{}\"", dir.display())
}

fn run_example(extra: &[&str]) -> Output {
    let ckpt = own_checkpoint_dir();
    let mut args = vec!["run", EXAMPLE, "--log-format", "json", "--set", &ckpt];
    args.extend(extra);
    parc_ok(&args)
}

#[test]
fn the_gpt2_text_example_learns_and_its_shards_train_the_same() {
    let text = run_example(&["--set", "train.steps=10"]);
    let text_losses = losses(&text);
    assert_eq!(text_losses.len(), 10);
    // ln(50304) ≈ 10.83 at the start: every token equally likely.
    assert!(
        (text_losses[0] - 50304f64.ln()).abs() < 0.1,
        "{text_losses:?}"
    );
    assert!(
        text_losses[9] < text_losses[0] - 0.4,
        "loss did not fall: {text_losses:?}"
    );

    let shards = temp_dir("shards").join("shakespeare");
    let input = root().join("examples/data/tiny-shakespeare.txt");
    let out = parc_ok(&[
        "tokenize",
        input.to_str().unwrap(),
        "--tokenizer",
        "gpt2",
        "--out",
        shards.to_str().unwrap(),
        "--shard-tokens",
        "10000",
    ]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("in 5 u16 shards"), "{said}");

    // The shards, concatenated in name order, are exactly the stream `text(...)` reads.
    let mut stored = Vec::new();
    for i in 0..5 {
        let bytes = std::fs::read(shards.join(format!("shard-{i:05}.bin"))).unwrap();
        stored.extend(
            bytes
                .chunks(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
        );
    }
    let tokenized = tokenize_files(&Tokenizer::gpt2(), &[input]).unwrap();
    assert_eq!(stored, tokenized);
    assert_eq!(
        tokenized.last(),
        Some(&50256),
        "the document ends with <|endoftext|>"
    );

    let data = format!("train.data=\"{}\" as u16", shards.display());
    let from_shards = run_example(&["--set", "train.steps=2", "--set", &data]);
    assert_eq!(losses(&from_shards), text_losses[..2]);
}

/// `parc check` of the example with `overrides`: its exit code and stderr.
fn check(overrides: &[&str]) -> (Option<i32>, String) {
    let mut args = vec!["check", EXAMPLE];
    for o in overrides {
        args.extend(["--set", o]);
    }
    let out = parc(&args);
    (out.status.code(), stderr_of(&out))
}

#[test]
fn bad_text_input_is_a_clear_error() {
    let (code, err) = check(&["model.vocab=50000"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("E0310") && err.contains("let vocab = 50304"),
        "{err}"
    );
    let (code, err) = check(&["train.data=text(\"x.txt\", tokenizer: gpt3)"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("E0904") && err.contains("did you mean `gpt2`"),
        "{err}"
    );

    for (data, says) in [
        (
            "text(\"data/absent.txt\", tokenizer: gpt2)",
            ["absent.txt", "no such file"],
        ),
        (
            "text(\"data/tiny-shakespeare.txt\", tokenizer: \"absent/tokenizer.json\")",
            ["absent/tokenizer.json", "no such file"],
        ),
    ] {
        let set = format!("train.data={data}");
        let ckpt = own_checkpoint_dir();
        let out = parc(&[
            "run",
            EXAMPLE,
            "--set",
            &set,
            "--set",
            "train.steps=1",
            "--set",
            &ckpt,
        ]);
        assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
        let err = stderr_of(&out);
        assert!(says.iter().all(|s| err.contains(s)), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }

    let out = parc(&[
        "tokenize",
        "absent.txt",
        "--tokenizer",
        "gpt2",
        "--out",
        "x",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr_of(&out).contains("absent.txt"),
        "{}",
        stderr_of(&out)
    );
}

/// `parc tokenize --shard-tokens 0` names the flag (it used to name the output folder, as if
/// the folder were the problem).
#[test]
fn a_shard_of_no_tokens_names_the_flag() {
    let dir = temp_dir("shard-tokens-0");
    let text = dir.join("a.txt");
    std::fs::write(&text, "some text").unwrap();
    let out = dir.join("out");
    let args = [
        "tokenize",
        text.to_str().unwrap(),
        "--tokenizer",
        "bytes",
        "--out",
        out.to_str().unwrap(),
        "--shard-tokens",
        "0",
    ];
    let run = parc(&args);
    let err = stderr_of(&run);
    assert_eq!(run.status.code(), Some(2), "{err}");
    assert!(err.contains("--shard-tokens 0"), "{err}");
    assert!(!out.exists(), "nothing is written");
}

/// `parc check` of `spec.par` in `dir`, `tiny.par` reading `corpus.txt` through `tokenizer`,
/// run from the repository root: its exit code and its diagnostics (JSON).
fn check_tokenizer(
    dir: &std::path::Path,
    tokenizer: &str,
    sets: &[&str],
) -> (Option<i32>, Vec<serde_json::Value>) {
    let tiny = std::fs::read_to_string(root().join("examples/tiny.par")).unwrap();
    let data = format!("data = text(\"corpus.txt\", tokenizer: \"{tokenizer}\")");
    let spec = tiny.replace("data = \"data/tiny-shakespeare.txt\" as bytes", &data);
    assert_ne!(spec, tiny);
    let file = dir.join("spec.par");
    std::fs::write(&file, spec).unwrap();
    let file = file.to_str().unwrap();
    let mut args = vec!["check", file, "--lower", "never", "--format", "json"];
    for set in sets {
        args.extend(["--set", set]);
    }
    let out = parc(&args);
    let doc: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", stderr_of(&out)));
    let diags = doc["files"][0]["diagnostics"].as_array().unwrap().clone();
    (out.status.code(), diags)
}

/// `parc check` opens a text source's tokenizer.json as `parc run` does, relative to the spec's
/// folder (here not the current one): one that is not there is a warning (W1004, as data that
/// is not here), one the run cannot read an error (E1004), one larger than the model's `vocab`
/// E0310; each labels the path. The check used to pass them all and only the run failed.
#[test]
fn check_opens_the_tokenizer_file_beside_the_spec() {
    let dir = temp_dir("check-tokenizer");
    std::fs::write(dir.join("corpus.txt"), "To be, or not to be.\n".repeat(100)).unwrap();
    std::fs::create_dir_all(dir.join("tok")).unwrap();
    std::fs::copy(
        root().join("tests/data/tiny-tokenizer.json"),
        dir.join("tok/tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.join("broken.json"), "{ not a tokenizer").unwrap();
    let codes = |diags: &[serde_json::Value]| -> Vec<String> {
        diags
            .iter()
            .map(|d| d["code"].as_str().unwrap().to_string())
            .collect()
    };

    // Its 320 tokens fit a vocab of 320.
    let (code, diags) = check_tokenizer(&dir, "tok/tokenizer.json", &["model.vocab=320"]);
    assert_eq!((code, codes(&diags)), (Some(0), vec![]), "{diags:?}");

    let cases = [
        ("tok/tokenizer.json", "E0310", Some(1), "has 320 tokens"),
        ("absent/tokenizer.json", "W1004", Some(0), "no such file"),
        (
            "broken.json",
            "E1004",
            Some(1),
            "not a readable tokenizer.json",
        ),
        ("tok", "E1004", Some(1), "give its tokenizer.json"),
    ];
    for (tokenizer, want, exit, says) in cases {
        let (code, diags) = check_tokenizer(&dir, tokenizer, &[]);
        assert_eq!(
            (code, codes(&diags)),
            (exit, vec![want.to_string()]),
            "{tokenizer}: {diags:?}"
        );
        let d = &diags[0];
        let text = format!("{} {}", d["message"], d["help"]);
        assert!(text.contains(says), "{tokenizer}: {text}");
        // The path, as the run resolves it: beside the spec.
        let resolved = dir.join(tokenizer).display().to_string();
        assert!(text.contains(&resolved), "{tokenizer}: {text}");
        // The label is the path's string in the spec.
        let spec = std::fs::read_to_string(dir.join("spec.par")).unwrap();
        let label = &d["labels"][0];
        let line = spec
            .lines()
            .nth(label["line"].as_u64().unwrap() as usize - 1)
            .unwrap();
        let (start, end) = (
            label["column"].as_u64().unwrap() as usize,
            label["end_column"].as_u64().unwrap() as usize,
        );
        let labelled: String = line.chars().skip(start - 1).take(end - start).collect();
        assert_eq!(labelled, format!("\"{tokenizer}\""), "{tokenizer}");
    }
}
