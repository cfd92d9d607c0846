//! IR tests: lowering over the plan matrix (structure and rendezvous progress), golden text of
//! small plans (`tests/ir/*.txt`, rewrite with `PARC_BLESS=1`), and numeric equivalence of
//! plans against one rank on the CPU backend with a lock-step in-process executor.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers, not library code
#[path = "ir/cli.rs"]
mod cli;
#[path = "ir/equivalence.rs"]
mod equivalence;
#[path = "ir/fixtures.rs"]
mod fixtures;
#[path = "ir/golden.rs"]
mod golden;
#[path = "ir/lockstep.rs"]
mod lockstep;
#[path = "ir/lowering.rs"]
mod lowering;
#[path = "ir/scale.rs"]
mod scale;
