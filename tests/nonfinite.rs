//! `train.on_nonfinite` through `parc run` on the tiny example: a diverging run (SGD at lr 1e9)
//! stops with a non-zero exit naming the step, the rank, the first op whose output was not
//! finite and its spec line; `skip { max: 2 }` skips two steps and then stops; a normal run's
//! losses are unchanged; the checker's errors for the setting.
#![allow(clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli_support;

use cli_support::{json_lines, parc, parc_ok, sets, stderr_of, steps};

const DIVERGING: &str = "train.optimizer=sgd { lr: 1e9 }";

fn run(overrides: &[&str]) -> std::process::Output {
    let mut args = vec!["run", "examples/tiny.par", "--log-format", "json"];
    args.extend(sets(overrides));
    parc(&args)
}

#[test]
fn a_diverging_run_stops_naming_step_rank_op_and_spec_line() {
    for plan in [
        &[][..],
        &["parallel.pp=2", "cluster.gpus_per_node=2"][..],
        &["parallel.dp=2", "cluster.gpus_per_node=2"][..],
    ] {
        let mut overrides = vec![DIVERGING, "train.steps=4"];
        overrides.extend(plan);
        let out = run(&overrides);
        let err = stderr_of(&out);
        assert!(
            !out.status.success(),
            "{plan:?}: a diverging run succeeded:\n{err}"
        );
        assert_eq!(steps(&json_lines(&out)).len(), 1, "{plan:?}: {err}");
        for part in [
            "non-finite values: step 2 on rank 0",
            "global gradient norm NaN",
            "the first instruction whose output is not finite is `matmul_bwd_data`",
            "blocks.0.attn",
            "[rank 0 at instruction",
            "at stdlib/gpt2.par:",
        ] {
            assert!(err.contains(part), "{plan:?}: no `{part}` in:\n{err}");
        }
    }
}

#[test]
fn skip_skips_at_most_max_steps_then_stops() {
    let out = run(&[
        DIVERGING,
        "train.steps=8",
        "train.on_nonfinite=skip { max: 2 }",
    ]);
    let err = stderr_of(&out);
    assert!(!out.status.success(), "{err}");
    let lines = json_lines(&out);
    let skipped: Vec<bool> = steps(&lines)
        .iter()
        .map(|s| s["skipped"].as_bool() == Some(true))
        .collect();
    assert_eq!(skipped, [false, true, true], "{err}");
    assert!(
        err.contains("step 4 on rank 0")
            && err.contains("after skipping 2 step(s) (train.on_nonfinite = skip { max: 2 })"),
        "{err}"
    );
}

/// An fp16 run whose gradients overflow at the dynamic scale's minimum stops as any run with
/// gradients that are not finite does (it used to skip every later step and exit 0 with the
/// loss NaN: DeepSpeed raises at its minimum scale likewise).
#[test]
fn an_fp16_run_that_overflows_at_the_minimum_scale_stops() {
    let out = run(&[
        DIVERGING,
        "train.steps=12",
        "train.precision=fp16 { loss_scale: dynamic { init: 4, window: 1000, hysteresis: 1, min: 1 } }",
    ]);
    let err = stderr_of(&out);
    assert!(!out.status.success(), "{err}");
    let lines = json_lines(&out);
    // Step 1 is clean; 2 and 3 overflow at scales 4 and 2 (skipped); 4 overflows at 1.
    assert_eq!(steps(&lines).len(), 3, "{err}");
    assert!(
        err.contains("non-finite values: step 4 on rank 0")
            && err.contains("at the fp16 loss scale's minimum 1"),
        "{err}"
    );
}

#[test]
fn a_normal_run_keeps_its_losses_under_either_setting() {
    // The losses of main before `on_nonfinite` existed, as f32 values.
    const LOSSES: [f32; 4] = [5.532_305_7, 5.497_279, 5.407_58, 5.308_406_4];
    for setting in [
        "train.on_nonfinite=stop",
        "train.on_nonfinite=skip { max: 3 }",
    ] {
        let out = parc_ok(
            &[
                &["run", "examples/tiny.par", "--log-format", "json"][..],
                &sets(&["train.steps=4", setting]),
            ]
            .concat(),
        );
        let lines = json_lines(&out);
        let losses: Vec<f32> = steps(&lines)
            .iter()
            .map(|s| s["loss"].as_f64().unwrap_or(f64::NAN) as f32)
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&losses), bits(&LOSSES), "{setting}: {losses:?}");
        assert!(
            steps(&lines).iter().all(|s| s["skipped"] == false),
            "{setting}"
        );
    }
}

#[test]
fn the_checker_names_a_wrong_on_nonfinite() {
    for (setting, message) in [
        ("train.on_nonfinite=skip", "`skip` needs `max`"),
        (
            "train.on_nonfinite=halt",
            "`halt` is not a valid on_nonfinite",
        ),
        (
            "train.on_nonfinite=stop { max: 1 }",
            "`stop` has no field `max`",
        ),
    ] {
        let out = parc(&["check", "examples/tiny.par", "--set", setting]);
        let err = stderr_of(&out);
        assert!(!out.status.success(), "{setting} passed");
        assert!(err.contains(message), "{setting}: {err}");
    }
    parc_ok(&[
        "check",
        "examples/tiny.par",
        "--set",
        "train.on_nonfinite=skip { max: 3 }",
    ]);
}
