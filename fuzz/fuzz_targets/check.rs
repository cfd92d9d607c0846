//! Fuzz `parc check`'s core: any bytes (as lossy UTF-8), optionally split into a spec and a
//! `--set` override, must give a spec or diagnostics, never a panic or a hang.
//! Run: `cargo +nightly fuzz run check -- -max_total_time=600` from the repository root,
//! seeded with the examples: `cargo +nightly fuzz run check examples/`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use parc_compiler::diag::Sources;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (spec_text, set) = match text.split_once("\n--set ") {
        Some((a, b)) => (a.to_string(), Some(b.to_string())),
        None => (text.into_owned(), None),
    };
    let overrides: Vec<_> = set
        .iter()
        .filter_map(|s| parc_compiler::parse_override(s).ok())
        .collect();
    let mut sources = Sources::default();
    let main = sources.add("fuzz.par", spec_text);
    let (spec, diags) = parc_compiler::check(&mut sources, main, &overrides);
    assert!(spec.is_some() != diags.has_errors());
});
