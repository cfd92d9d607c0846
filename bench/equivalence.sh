#!/usr/bin/env bash
# The whole equivalence matrix through the real executor (threads per rank, local comm, CPU
# backend): every plan over dp, pp, cp, tp in {1,2}, ZeRO 0-3, GPipe/1F1B/interleaved, recompute
# none/selective/full and sequence parallel on/off, for a GPT-2-style and a Llama-style tiny model,
# against the single-rank run (losses and gradient norms over 5 steps within 1e-5 relative, final
# parameters within 1e-5). CI runs a sample of it (`cargo test --test equivalence`).
# Usage: bench/equivalence.sh            (release build; prints one line per plan and a total)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --release --test equivalence matrix_full -- --ignored --nocapture
