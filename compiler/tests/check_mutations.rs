//! Property test: thousands of mutated example files (byte flips, truncations, token swaps,
//! duplicated and deleted spans) go through `check`; none may panic. The checker must answer
//! every input with a spec or diagnostics.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use parc_compiler::diag::Sources;
use proptest::prelude::*;

const EXAMPLES: [&str; 3] = [
    include_str!("../../examples/tiny.par"),
    include_str!("../../examples/tiny-llama.par"),
    include_str!("../../examples/gpt2-124m.par"),
];

const TOKENS: [&str; 24] = [
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    ",",
    "=",
    "+",
    "*",
    "/",
    "-",
    "as",
    "repeat",
    "0",
    "1e400",
    "99999999999999999999",
    "Block",
    "tp",
    "\"",
    "//",
    "model",
    "let x = ",
    "1f1b",
];

/// Large but valid numbers, to find overflow in what consumes the spec.
const BIG: [&str; 4] = ["1048576", "4294967296", "1000000000000", "65536"];

fn apply(text: &str, ops: &[(u8, usize, usize)]) -> String {
    let mut bytes = text.as_bytes().to_vec();
    for &(op, a, b) in ops {
        if bytes.is_empty() {
            break;
        }
        let i = a % bytes.len();
        match op % 5 {
            0 if b % 3 == 0 => {
                // Replace a run of digits with a large number.
                let start = (i..bytes.len())
                    .find(|&k| bytes[k].is_ascii_digit())
                    .unwrap_or(i);
                let end = (start..bytes.len())
                    .find(|&k| !bytes[k].is_ascii_digit())
                    .unwrap_or(start);
                let t = BIG[b % BIG.len()].as_bytes();
                bytes.splice(start..end, t.iter().copied());
            }
            0 => bytes[i] ^= 1 << (b % 8),
            1 => bytes.truncate(i),
            2 => {
                let t = TOKENS[b % TOKENS.len()].as_bytes();
                bytes.splice(i..i, t.iter().copied());
            }
            3 => {
                let end = (i + b % 40).min(bytes.len());
                bytes.drain(i..end);
            }
            _ => {
                let end = (i + b % 60).min(bytes.len());
                let chunk = bytes[i..end].to_vec();
                bytes.splice(i..i, chunk);
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn mutated_examples_never_panic(
        which in 0usize..EXAMPLES.len(),
        ops in proptest::collection::vec((any::<u8>(), any::<usize>(), any::<usize>()), 1..6),
    ) {
        let text = apply(EXAMPLES[which], &ops);
        let mut sources = Sources::default();
        let main = sources.add("mutated.par", text);
        let (spec, diags) = parc_compiler::check(&mut sources, main, &[]);
        prop_assert!(spec.is_some() != diags.has_errors());
        // What `parc check` does next: the cost model must take any spec the checker accepts.
        if let Some(spec) = spec {
            let report = parc_compiler::cost::estimate(&spec);
            let _ = parc_compiler::cost::diagnose(&spec, &report);
        }
    }
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    for text in [
        format!("let x = {}1{}", "(".repeat(100_000), ")".repeat(100_000)),
        format!("let x = 1{}", " + 1".repeat(200_000)),
        format!("let x = {}1", "-".repeat(200_000)),
    ] {
        let mut sources = Sources::default();
        let main = sources.add("deep.par", text);
        let (spec, diags) = parc_compiler::check(&mut sources, main, &[]);
        assert!(spec.is_none() && diags.has_errors());
    }
}
