//! IR tests: lowering over the plan matrix (structure and rendezvous progress), golden text of
//! small plans (`tests/ir/*.txt`, rewrite with `PARC_BLESS=1`), scale, and `parc plan`'s CLI.
//! Numeric equivalence of plans runs on the real executor in `tests/equivalence.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers, not library code
#[path = "ir/classes.rs"]
mod classes;
#[path = "ir/cli.rs"]
mod cli;
#[path = "cli_support/mod.rs"]
mod cli_support;
#[path = "ir/fixtures.rs"]
mod fixtures;
#[path = "ir/golden.rs"]
mod golden;
#[path = "ir/lowering.rs"]
mod lowering;
#[path = "ir/scale.rs"]
mod scale;
#[path = "ir/storage.rs"]
mod storage;
