#!/usr/bin/env bash
# Wall time of `parc check` on the largest example (Llama-3-70B on 64 GPUs: parse, stdlib
# import, 80-layer expansion, every check, the cost model and the report). Target: < 50 ms.
# Usage: bench/check-speed.sh [RUNS] [SPEC]   (builds the release binary first)
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-30}"
spec="${2:-examples/llama3-70b-64gpu.par}"
cargo build --release --quiet --bin parc
target="${CARGO_TARGET_DIR:-target}"
bin="$target/release/parc"
"$bin" check "$spec" > /dev/null 2>&1 || { echo "parc check $spec failed" >&2; exit 1; }
times=()
for _ in $(seq "$runs"); do
  start=$(date +%s%N)
  "$bin" check "$spec" > /dev/null 2>&1
  end=$(date +%s%N)
  times+=($(( (end - start) / 1000 )))
done
sorted=($(printf '%s\n' "${times[@]}" | sort -n))
median=${sorted[$(( runs / 2 ))]}
printf 'parc check %s: %d runs, min %.1f ms, median %.1f ms, max %.1f ms\n' "$spec" "$runs" \
  "$(echo "${sorted[0]} / 1000" | bc -l)" "$(echo "$median / 1000" | bc -l)" \
  "$(echo "${sorted[$(( runs - 1 ))]} / 1000" | bc -l)"
