//! `parc plan` end to end: exit codes, the three emit forms, `--rank`, `--set`.

use std::process::Command;

fn plan(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_parc"))
        .arg("plan")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run parc");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const TP2: [&str; 4] = ["--set", "parallel.tp=2", "--set", "cluster.gpus_per_node=2"];

#[test]
fn text_lists_every_program_or_one_rank() {
    let (code, out, err) = plan(&["examples/tiny.par", TP2[0], TP2[1], TP2[2], TP2[3]]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("verified"), "{out}");
    assert!(
        out.contains("program 0 (pp 0 cp 0 tp 0)") && out.contains("program 1 (pp 0 cp 0 tp 1)")
    );
    let (code, out, _) = plan(&[
        "examples/tiny.par",
        TP2[0],
        TP2[1],
        TP2[2],
        TP2[3],
        "--rank",
        "1",
    ]);
    assert_eq!(code, 0);
    let header = |p: &str| out.lines().any(|l| l.starts_with(p));
    assert!(!header("program 0 (") && header("program 1 ("), "{out}");
}

/// A plan that does not fit its GPU (E0701) is an error to `parc plan` as to `parc check`:
/// exit 1, the plan still written for a look (it used to exit 0 beside the error).
#[test]
fn a_plan_that_does_not_fit_exits_1_as_check_does() {
    let gpu = "cluster.gpu=custom { memory: 2 MB, flops: 100 TFLOP/s }";
    let (code, out, err) = plan(&["examples/tiny.par", "--set", gpu]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("E0701") && err.contains("has errors"), "{err}");
    assert!(out.contains("program 0 (pp 0 cp 0 tp 0)"), "{out}");
}

#[test]
fn json_and_trace_parse() {
    let (code, out, err) = plan(&["examples/tiny.par", "--emit", "json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("plan JSON");
    assert_eq!(v["world"], 1);
    assert!(v["programs"][0]["instrs"]
        .as_array()
        .is_some_and(|a| !a.is_empty()));
    let (code, out, err) = plan(&[
        "examples/tiny.par",
        "--set",
        "parallel.pp=2",
        "--set",
        "cluster.gpus_per_node=2",
        "--emit",
        "trace",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("trace JSON");
    assert!(v["traceEvents"].as_array().is_some_and(|a| a.len() > 4));
}

#[test]
fn exit_codes() {
    let (code, _, err) = plan(&["examples/does-not-exist.par"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = plan(&["examples/tiny.par", "--set", "parallel.tp=3"]);
    assert_eq!(code, 1);
    assert!(err.contains("E0401"), "{err}");
    let (code, _, err) = plan(&["examples/tiny.par", "--rank", "7"]);
    assert_eq!(code, 2);
    assert!(err.contains("--rank 7"), "{err}");
}

/// The program text of `program N (` … up to the next program or the end.
fn program_text(out: &str, id: u32) -> String {
    let head = format!("program {id} (");
    let mut lines = out.lines().skip_while(|l| !l.starts_with(&head));
    let first = lines.next().unwrap_or_default().to_string();
    let rest: Vec<&str> = lines.take_while(|l| !l.starts_with("program ")).collect();
    format!("{first}\n{}", rest.join("\n"))
}

#[test]
fn one_rank_is_lowered_alone_and_equals_its_program_in_the_full_plan() {
    // tp 4 × dp 2: ranks of tp index 2 and 3 share their class's analysis but print their own
    // shards (`part 2/4`), numbered as in the full plan.
    let spec = [
        "examples/tiny-llama.par",
        "--set",
        "parallel.tp=4",
        "--set",
        "parallel.dp=2",
        "--set",
        "cluster.gpus_per_node=8",
    ];
    let (code, full, err) = plan(&spec);
    assert_eq!(code, 0, "{err}");
    for rank in ["2", "7"] {
        let mut args = spec.to_vec();
        args.extend(["--rank", rank]);
        let (code, one, err) = plan(&args);
        assert_eq!(code, 0, "{err}");
        let id = one
            .lines()
            .find_map(|l| l.strip_prefix("program "))
            .and_then(|l| l.split(' ').next())
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or_else(|| panic!("{one}"));
        let shown = program_text(&one, id);
        assert_eq!(shown, program_text(&full, id), "rank {rank}");
        assert!(shown.contains("part"), "{shown}");
    }
}

#[test]
fn search_ranks_plans_whose_flags_check_clean() {
    let (code, out, err) = plan(&["--search", "examples/tiny.par", "--gpus", "4", "--top", "3"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(" 1  ") && out.contains("rejected:"), "{out}");
    let flags = out
        .lines()
        .skip_while(|l| !l.starts_with("the fastest as flags"))
        .nth(1)
        .unwrap_or_else(|| panic!("{out}"));
    let flags = crate::cli_support::shell_words(flags);
    assert!(
        flags.iter().any(|f| f.starts_with("parallel.mesh={")),
        "{flags:?}"
    );
    let mut args: Vec<&str> = vec!["check", "examples/tiny.par"];
    args.extend(flags.iter().map(String::as_str));
    args.extend([
        "--set",
        "cluster.nodes=1",
        "--set",
        "cluster.gpus_per_node=4",
    ]);
    let checked = Command::new(env!("CARGO_BIN_EXE_parc"))
        .args(&args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run parc");
    assert!(
        checked.status.success(),
        "{}",
        String::from_utf8_lossy(&checked.stderr)
    );
}

#[test]
fn search_without_a_fitting_plan_names_the_rule_and_the_closest() {
    let gpu = "cluster.gpu=custom { memory: 1 GB, flops: 100 TFLOP/s, flops_fp32: 50 TFLOP/s, bandwidth: 1 TB/s }";
    let (code, out, err) = plan(&["--search", "examples/gpt2-124m.par", "--set", gpu]);
    assert_eq!(code, 1, "{err}");
    assert!(
        out.contains("no plan fits on 1 GPU: of the ") && out.contains("rejected the most"),
        "{out}"
    );
    assert!(
        out.contains("per GPU at best") && out.contains("the GPU has 953.7 MiB"),
        "{out}"
    );
    let (code, _, err) = plan(&[
        "--search",
        "examples/tiny.par",
        "--gpus",
        "6",
        "--nodes",
        "4",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("--nodes 4"), "{err}");
}

#[test]
fn search_replaces_a_layers_list_of_the_spec() {
    // The spec splits its own 2-stage pipeline by a list; every candidate's `balance` replaces
    // it (the two spell one choice), so candidates of other shapes still check.
    let (code, out, err) = plan(&[
        "--search",
        "examples/tiny.par",
        "--set",
        "parallel.layers=[3,1]",
        "--set",
        "parallel.pp=2",
        "--set",
        "cluster.gpus_per_node=2",
        "--top",
        "2",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("E0417") && !out.contains("E0418"), "{out}");
}
