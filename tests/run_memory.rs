//! A plan whose ranks cannot fit in the memory given to `train` is refused before any rank
//! allocates, with the numbers; one that fits runs.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;

use fixtures::{spec, train_cpu, PlanChoice, TinyModel};
use parc_compiler::lower::lower;
use parc_runtime::exec::TrainOptions;

#[test]
fn plans_larger_than_the_memory_limit_are_refused_with_numbers() {
    let s = spec(
        TinyModel {
            layers: 4,
            llama: false,
            tied: true,
        },
        PlanChoice {
            dp: 2,
            tp: 2,
            ..PlanChoice::default()
        },
    );
    let plan = lower(&s).unwrap();
    let mut options = TrainOptions::new(".");
    options.memory_limit = Some(1024);
    let err = train_cpu(&s, &plan, &options).unwrap_err().to_string();
    assert!(
        err.contains("for its 4 ranks") && err.contains("GiB is available"),
        "{err}"
    );
    options.memory_limit = Some(1 << 30);
    options.stop_after = Some(1);
    let ok = train_cpu(&s, &plan, &options).unwrap();
    assert_eq!(ok.records.len(), 1);
}
