//! Fuzz `parc check`'s core: any bytes (as lossy UTF-8), optionally split into a spec and a
//! `--set` override, must give a spec or diagnostics, never a panic or a hang.
//! Run from the repository root, seeded with the examples:
//! `cargo +nightly fuzz run check CORPUS examples tests/configs -- -max_total_time=600`, with
//! an empty folder CORPUS first (libFuzzer writes new inputs into the first folder).
#![no_main]

#[path = "input.rs"]
mod input;

use libfuzzer_sys::fuzz_target;
use parc_compiler::diag::Sources;

fuzz_target!(|data: &[u8]| {
    let (spec_text, overrides) = input::spec_and_overrides(data);
    let mut sources = Sources::default();
    let main = sources.add("fuzz.par", spec_text);
    let (spec, diags) = parc_compiler::check(&mut sources, main, &overrides);
    assert!(spec.is_some() != diags.has_errors());
});
