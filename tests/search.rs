//! `parc plan --search` from the command line: a space with no plan that fits says which
//! constraint rejected the most, by how many, and how far the closest plan is from fitting;
//! a small space prints its ranking and the winner as flags that check clean.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli_support;

use cli_support::{parc, parc_ok, stderr_of};

fn stdout_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Llama-3-70B on one 80 GB GPU: every plan is over the GPU's memory; exit 1, the rule that
/// rejected them all with its count, and the closest plan with its need and excess.
#[test]
fn a_space_with_no_plan_that_fits_says_why() {
    let out = parc(&[
        "plan",
        "--search",
        "examples/llama3-70b-64gpu.par",
        "--gpus",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    let text = stdout_of(&out);
    assert!(
        text.contains(
            "no plan fits: most were rejected by `memory per GPU over 1.5× the GPU's by the \
             cost formulas` (21)"
        ),
        "{text}"
    );
    let closest = text
        .lines()
        .find(|l| l.starts_with("closest to fitting: dp 1 pp 1 cp 1 tp 1"))
        .unwrap_or_else(|| panic!("no closest plan in:\n{text}"));
    assert!(
        closest.contains("TiB per GPU") && closest.contains("over the GPU's 79.6 GiB"),
        "{closest}"
    );
    assert!(closest.contains("use more GPUs (--gpus)"), "{closest}");
}

/// The tiny example on 2 GPUs: a ranking, and the winner's flags check clean.
#[test]
fn the_winner_checks_clean() {
    let out = parc_ok(&["plan", "--search", "examples/tiny.par", "--gpus", "2"]);
    let text = stdout_of(&out);
    assert!(text.contains(" 1  "), "{text}");
    let flags = text
        .lines()
        .skip_while(|l| !l.starts_with("the fastest as flags:"))
        .nth(1)
        .unwrap_or_else(|| panic!("no flags in:\n{text}"));
    let mut args = vec!["check", "examples/tiny.par"];
    args.extend(flags.split_whitespace());
    let mut args: Vec<String> = args.into_iter().map(String::from).collect();
    args.extend(["--set", "cluster.gpus_per_node=2"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let checked = parc(&args);
    assert!(
        checked.status.success(),
        "{}{}",
        stdout_of(&checked),
        stderr_of(&checked)
    );
}

/// The search replaces the spec's plan, so the plan's own errors do not stop it: GPT-2 XL's
/// `dp = 8` with `gpipe { microbatches: 8 }` (tied to its dp) searched on 16 GPUs over 2 nodes
/// (was E0401, the mesh of 8 ranks against the 16 GPUs), and TinyLlama's pp = 4 that does not
/// divide its 22 layers searched on its own cluster (was E0407).
#[test]
fn a_spec_whose_own_plan_fails_is_still_searched() {
    let cases: [&[&str]; 2] = [
        &[
            "tests/configs/gpt2-xl-deepspeed-zero2-fp16.par",
            "--gpus",
            "16",
            "--nodes",
            "2",
        ],
        &["tests/configs/tinyllama-1.1b-pp4.par"],
    ];
    for case in cases {
        let mut args = vec!["plan", "--search", "--top", "1"];
        args.extend(case);
        let out = parc(&args);
        let text = stdout_of(&out);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{case:?}: {text}{}",
            stderr_of(&out)
        );
        assert!(text.contains("as sections to paste:"), "{case:?}: {text}");
    }
}

/// A model error stays the verdict: Gemma 2's final softcap written as a function between the
/// head and the loss (E0803) is reported as such on another cluster, not hidden behind the
/// mesh that does not match it (E0401).
#[test]
fn a_model_error_is_reported_on_another_cluster() {
    let out = parc(&[
        "plan",
        "--search",
        "tests/configs/gemma2-2b-final-softcap-fn.par",
        "--gpus",
        "16",
        "--nodes",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr_of(&out);
    assert!(err.contains("E0803"), "{err}");
    assert!(!err.contains("E0401"), "{err}");
}
