//! `parc plan --search` from the command line: a space with no plan that fits says which
//! constraint rejected the most, by how many, how far the closest plan is from fitting and what
//! to change; a small space prints its ranking and the winner as flags that check clean; a
//! spec whose own plan fails is searched on its own cluster; the rejections name rules, not
//! checker messages with their numbers blanked out.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli_support;

use cli_support::{parc, parc_ok, shell_words, stderr_of};

fn stdout_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The lines of the report's `rejected:` table, without their counts.
fn rejection_rules(text: &str) -> Vec<String> {
    text.lines()
        .skip_while(|l| *l != "rejected:")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .map(|l| {
            let l = l.trim_start();
            l.split_once("  ").map_or(l, |(_, rule)| rule).to_string()
        })
        .collect()
}

/// The `no plan fits` paragraph: from its first line to the end.
fn no_fit(text: &str) -> String {
    let at = text
        .find("\nno plan fits on ")
        .unwrap_or_else(|| panic!("no `no plan fits` in:\n{text}"));
    text[at + 1..].to_string()
}

/// Llama-3-70B on one 80 GB GPU: every plan is over the GPU's memory; exit 1, the rule that
/// rejected them all with its count, the least a plan needs against the GPU's memory, that the
/// closest already takes every saving the search has, and a GPU count where one fits.
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
    let text = no_fit(&stdout_of(&out));
    assert!(
        text.starts_with(
            "no plan fits on 1 GPU: of the 21 plans the arithmetic rules allow, `memory per GPU \
             over 1.5× the GPU's by the cost formulas` rejected the most, 21\n"
        ),
        "{text}"
    );
    let memory = text
        .lines()
        .find(|l| l.starts_with("memory: a plan needs "))
        .unwrap_or_else(|| panic!("no memory line in:\n{text}"));
    assert!(
        memory.contains("TiB per GPU at best (by the cost formulas, which err low), the GPU has 79.2 GiB: dp 1 pp 1 cp 1 tp 1"),
        "{memory}"
    );
    assert!(
        text.contains("it already recomputes every layer, runs micro batches of 1 and has no dp or cp ranks for ZeRO to shard over"),
        "{text}"
    );
    let fix = text
        .lines()
        .find(|l| l.starts_with("to fit: "))
        .unwrap_or_else(|| panic!("no `to fit` in:\n{text}"));
    assert!(
        fix.contains("by the cost formulas a plan fits on 16 GPUs (--gpus 16 --nodes 2)"),
        "{fix}"
    );
    // Nothing was simulated: no line about how step times were priced.
    assert!(!stdout_of(&out).contains("step times priced"), "{text}");
}

/// Llama-3-70B on 8 GPUs: the plans of pipelines too deep for the batch are the arithmetic's,
/// not the verdict; memory rejected every plan the arithmetic allows, a plan needs more than
/// the 80 GB GPU at best, and the help names the GPU count and the larger GPU that would fit.
#[test]
fn memory_names_the_smallest_overshoot_and_what_to_change() {
    let out = parc(&[
        "plan",
        "--search",
        "examples/llama3-70b-64gpu.par",
        "--gpus",
        "8",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    let text = no_fit(&stdout_of(&out));
    let first = text.lines().next().unwrap_or_default();
    let (allowed, most) = first
        .strip_prefix("no plan fits on 8 GPUs: of the ")
        .and_then(|l| l.split_once(" plans the arithmetic rules allow, `memory per GPU over 1.5× the GPU's by the cost formulas` rejected the most, "))
        .unwrap_or_else(|| panic!("{first}"));
    assert_eq!(allowed, most, "memory rejected every allowed plan: {first}");
    let memory = text
        .lines()
        .find(|l| l.starts_with("memory: a plan needs "))
        .unwrap_or_else(|| panic!("{text}"));
    let need: f64 = memory["memory: a plan needs ".len()..]
        .split_once(" GiB per GPU at best")
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("{memory}"));
    assert!(need > 79.2, "{memory}");
    assert!(memory.contains("the GPU has 79.2 GiB: dp "), "{memory}");
    assert!(text.contains("shards its weights, gradients and optimizer states with ZeRO-3"));
    assert!(
        text.contains("to fit: by the cost formulas a plan fits on 16 GPUs (--gpus 16 --nodes 2); search there to be sure; or a GPU with more memory: h200"),
        "{text}"
    );
}

/// Llama-3-70B at a global batch of 1 on 8 GPUs: dp × pp is at most the global batch (each dp
/// rank runs at least pp microbatches) and tp × cp stay inside a node, so no cluster of any size
/// fits a plan; the help says the global batch is what caps it, where it used to name only a
/// smaller model or a shorter sequence.
#[test]
fn a_global_batch_that_caps_the_cluster_is_named() {
    let out = parc(&[
        "plan",
        "--search",
        "examples/llama3-70b-64gpu.par",
        "--gpus",
        "8",
        "--set",
        "train.global_batch=1",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    let text = no_fit(&stdout_of(&out));
    let fix = text
        .lines()
        .find(|l| l.starts_with("to fit: "))
        .unwrap_or_else(|| panic!("no `to fit` in:\n{text}"));
    assert!(
        fix.contains(
            "no cluster of this GPU up to 65,536 GPUs has a plan the cost formulas fit at \
             global_batch = 1, which caps dp × pp at 1"
        ),
        "{fix}"
    );
    assert!(fix.contains("a larger global_batch"), "{fix}");
}

/// Tiny on 5 GPUs: no way of splitting 5 GPUs suits the model (dp 5 does not divide the batch of
/// 8, pp 5 is more stages than the 4 layers, tp 5 does not divide the vocabulary, 2·cp = 10 the
/// 64 tokens). The report says so
/// instead of "searched 0 plans", names the rule with the most, and the nearest GPU counts that
/// have a plan; searching one of them finds it.
#[test]
fn a_gpu_count_no_plan_can_split_names_the_nearest_that_can() {
    // (3 GPUs have a plan: pp 3 splits the layers by `balance: auto`.)
    let out = parc(&["plan", "--search", "examples/tiny.par", "--gpus", "5"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    let report = stdout_of(&out);
    assert!(
        report.contains(": 0 past the arithmetic rules,"),
        "{report}"
    );
    let text = no_fit(&report);
    assert!(
        text.starts_with("no plan fits on 5 GPUs: the arithmetic rules allow none of its "),
        "{text}"
    );
    assert!(text.contains("rejected the most, 48"), "{text}");
    assert!(
        !text.contains("memory:"),
        "no plan was judged on memory: {text}"
    );
    assert!(
        text.contains(
            "to fit: by the cost formulas a plan fits on 4 GPUs (--gpus 4) or 6 (--gpus 6)"
        ),
        "{text}"
    );
    parc_ok(&[
        "plan",
        "--search",
        "examples/tiny.par",
        "--gpus",
        "4",
        "--top",
        "1",
    ]);
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
    let mut args: Vec<String> = ["check", "examples/tiny.par"].map(String::from).to_vec();
    args.extend(shell_words(flags));
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

/// A spec whose own plan fails in a way the old neutral plan could not get past: an
/// interleaved schedule whose 7 microbatches are not a multiple of pp 2 (E0503) on its own
/// cluster of 16 GPUs, more than its global batch of 7 (so "all of it dp" was no plan either).
/// Without --gpus it is searched on those 16 GPUs, says why its own plan was not the start, and
/// finds a 1F1B plan of pp 2 (7 microbatches suit 1F1B).
#[test]
fn a_spec_whose_own_plan_fails_is_searched_on_its_own_cluster() {
    let own = [
        "model.layers=6",
        "train.global_batch=7",
        "train.micro_batch=1",
        "parallel.mesh={dp: 1, pp: 2, cp: 2, tp: 4}",
        "parallel.schedule=interleaved",
        "parallel.virtual=3",
        "cluster.nodes=2",
        "cluster.gpus_per_node=8",
    ];
    let mut check = vec!["check", "examples/tiny.par"];
    check.extend(cli_support::sets(&own));
    let checked = parc(&check);
    assert_eq!(checked.status.code(), Some(1));
    assert!(
        stderr_of(&checked).contains("E0503"),
        "{}",
        stderr_of(&checked)
    );
    let mut args = vec!["plan", "--search", "examples/tiny.par", "--top", "1"];
    args.extend(cli_support::sets(&own));
    let out = parc(&args);
    let text = stdout_of(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr_of(&out));
    assert!(
        text.starts_with(
            "the spec's own plan does not check (E0503 the interleaved schedule needs \
             microbatches (7) to be a multiple of pp = 2); searching its model and recipe on \
             its cluster instead\n"
        ),
        "{text}"
    );
    assert!(text.contains(" plans on 16 GPUs (2 nodes × 8, "), "{text}");
    let best = text
        .lines()
        .find(|l| l.starts_with(" 1  "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        best.contains("dp 1 pp 2 ") && best.contains(", 1f1b (even), 1 × 7,"),
        "{best}"
    );
}

/// The rejections are rules, each once: the checker's placement (E0601), sequence (E0406) and
/// schedule (E0503) errors no longer reach the table with their numbers blanked out
/// (`tp = N groups span N consecutive ranks …`), because the space lays the mesh out tp
/// innermost whatever the spec's order ({dp, tp} in torchtitan's 405B) and rules out what the
/// arithmetic can.
#[test]
fn rejections_are_rules_not_blanked_out_messages() {
    let cases: [&[&str]; 3] = [
        &["tests/configs/llama3.1-405b-torchtitan-512gpu.par"],
        &["examples/tiny.par", "--gpus", "3"],
        &["tests/configs/megatron-gbs-not-multiple.par", "--gpus", "8"],
    ];
    for case in cases {
        let mut args = vec!["plan", "--search", "--top", "1"];
        args.extend(case);
        let out = parc(&args);
        let text = stdout_of(&out);
        let rules = rejection_rules(&text);
        assert!(!rules.is_empty(), "{case:?}: {text}");
        for rule in &rules {
            let blanked = rule.split(|c: char| !c.is_alphanumeric()).any(|w| w == "N");
            assert!(
                !blanked && !rule.starts_with('E'),
                "{case:?}: {rule}\n{text}"
            );
        }
        let mut unique = rules.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), rules.len(), "{case:?}: {rules:?}");
    }
}

/// On a GPU cluster the search recommends only plans `parc run --backend cuda` runs: Llama-3-8B
/// with tensorwise FP8 on 8 H100s, whose fastest plans by the timeline shard attention on cp
/// or tp (FP8 amaxes reduced across ranks, which the CUDA backend runs since its plans of
/// several ranks were run on a GPU): none is rejected by the backend's rule, and the plan
/// shown first checks without W1202 (the warning `check` gives a plan the CUDA backend
/// refuses).
#[test]
fn a_gpu_search_recommends_only_plans_the_cuda_backend_runs() {
    let fp8 = ["--set", "train.fp8=tensorwise"];
    let mut args = vec![
        "plan",
        "--search",
        "examples/llama3-8b-8gpu.par",
        "--top",
        "3",
    ];
    args.extend(fp8);
    let text = stdout_of(&parc_ok(&args));
    let refused = rejection_rules(&text)
        .into_iter()
        .find(|r| r.starts_with("the backend does not run it"));
    assert!(refused.is_none(), "{text}");
    let plans: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_once("  dp ").map(|(_, plan)| plan))
        .collect();
    assert_eq!(plans.len(), 3, "{text}");
    let flags = text
        .lines()
        .skip_while(|l| !l.starts_with("the fastest as flags:"))
        .nth(1)
        .unwrap_or_else(|| panic!("no flags in:\n{text}"));
    let mut check: Vec<String> = ["check", "examples/llama3-8b-8gpu.par"]
        .map(String::from)
        .to_vec();
    check.extend(fp8.map(String::from));
    check.extend(shell_words(flags));
    let check: Vec<&str> = check.iter().map(String::as_str).collect();
    let checked = parc(&check);
    let said = format!("{}{}", stdout_of(&checked), stderr_of(&checked));
    assert!(checked.status.success(), "{said}");
    assert!(!said.contains("W1202"), "{said}");
}

/// A recipe the CUDA backend runs in no plan (blockwise FP8 with 64-element blocks, which its
/// FP8 kernel does not take): the search lowers past its usual limit for plans it might run,
/// then says that nothing fits and that the backend refused the plans it lowered, with the
/// reason.
#[test]
fn a_recipe_the_backend_runs_in_no_plan_says_so() {
    let out = parc(&[
        "plan",
        "--search",
        "examples/llama3-8b-8gpu.par",
        "--top",
        "1",
        "--set",
        "train.fp8=blockwise",
        "--set",
        "train.fp8.block_size=64",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    let text = no_fit(&stdout_of(&out));
    let line = text
        .lines()
        .find(|l| l.starts_with("`parc run --backend cuda` does not run "))
        .unwrap_or_else(|| panic!("no refusal line in:\n{text}"));
    let (refused, lowered) = line
        .trim_start_matches("`parc run --backend cuda` does not run ")
        .split_once(" plans lowered:")
        .and_then(|(counts, _)| counts.split_once(" of the "))
        .unwrap_or_else(|| panic!("{line}"));
    assert_eq!(refused, lowered, "{line}");
    // More than the 12 a search of --top 1 lowers when the backend refuses none.
    assert!(refused.parse::<u32>().unwrap() > 12, "{line}");
    assert!(line.contains("FP8"), "{line}");
}
