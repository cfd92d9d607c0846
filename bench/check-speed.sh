#!/usr/bin/env bash
# Wall time and peak memory of `parc check` on the largest example (Llama-3-70B on 64 GPUs:
# parse, checks, cost model, then the plan lowered one program per class of ranks, verified,
# memory-planned and simulated, and the report). Issue 20's targets: < 1 s and < 300 MiB on the
# 2-core machine; the 1,024-GPU variant (dp 16) < 5 s; `parc plan --rank R` as fast; the
# search (`parc plan --search`) < 10 s.
# Usage: bench/check-speed.sh [RUNS] [SPEC]   (builds the release binary first)
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-5}"
spec="${2:-examples/llama3-70b-64gpu.par}"
cargo build --release --quiet --bin parc
target="${CARGO_TARGET_DIR:-target}"
bin="$target/release/parc"
"$bin" check "$spec" > /dev/null 2>&1 || { echo "parc check $spec failed" >&2; exit 1; }

# Median wall seconds and the largest peak RSS (MiB) of `runs` runs of the command.
measure() {
  local label="$1"; shift
  local times=() rss=0
  for _ in $(seq "$runs"); do
    local out tmp
    tmp=$(mktemp)
    /usr/bin/time -o "$tmp" -f '%e %M' "$@" > /dev/null 2>&1 || true
    out=$(tail -1 "$tmp")
    rm -f "$tmp"
    times+=("${out%% *}")
    local kb="${out##* }"
    (( kb > rss )) && rss=$kb
  done
  local sorted
  sorted=($(printf '%s\n' "${times[@]}" | sort -n))
  printf '%-34s median %6s s (min %s, max %s), peak %d MiB\n' "$label" \
    "${sorted[$(( runs / 2 ))]}" "${sorted[0]}" "${sorted[$(( runs - 1 ))]}" $(( rss / 1024 ))
}

measure "check" "$bin" check "$spec"
measure "check, 1,024 GPUs (dp 16)" "$bin" check "$spec" --set parallel.dp=16 \
  --set cluster.nodes=128 --set train.global_batch=1024
measure "plan --rank 59" "$bin" plan "$spec" --rank 59
measure "plan --search (top 5)" "$bin" plan --search "$spec"
measure "check --lower never (formulas)" "$bin" check "$spec" --lower never
