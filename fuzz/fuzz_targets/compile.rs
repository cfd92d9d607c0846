//! Fuzz `parc check`'s whole pipeline past checking: any bytes (as lossy UTF-8, optionally
//! split into a spec and a `--set` override) that check clean are lowered (one program per
//! class of ranks, as `parc check` does), verified, memory-planned and simulated, with the
//! cost model on. Every stage must give a result or diagnostics, never a panic or a hang;
//! plans larger than `MAX_PLAN` (layers × microbatches) stop after checking, as `--lower auto`
//! does for large plans, so an input's time stays its own stages'.
//! Run: `cargo +nightly fuzz run compile CORPUS examples tests/configs -- -max_total_time=600`
//! with an empty folder CORPUS first (libFuzzer writes new inputs into the first folder).
#![no_main]

#[path = "input.rs"]
mod input;

use libfuzzer_sys::fuzz_target;
use parc_compiler::driver::{compile, CompileOptions, Stage};

/// The largest plan lowered.
const MAX_PLAN: u64 = 256;

fuzz_target!(|data: &[u8]| {
    let (spec_text, overrides) = input::spec_and_overrides(data);
    let options = CompileOptions {
        cost_model: true,
        max_plan_size: Some(MAX_PLAN),
        representatives: true,
        ..CompileOptions::through(Stage::Timeline)
    };
    let compiled = compile("fuzz.par", spec_text, &overrides, &options);
    // A spec without errors, and a plan only of a spec.
    assert!(compiled.spec.is_some() || compiled.diagnostics.has_errors());
    assert!(compiled.plan.is_none() || compiled.spec.is_some());
});
