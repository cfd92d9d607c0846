#!/usr/bin/env bash
# One device call: the attention differential tests (fp32 and bf16), parc's attention
# micro-benchmark and PyTorch SDPA's on the same shapes, then a table of both.
# Usage: bench/attention.sh [DIR...]: each DIR holds a build's `cuda_ops` and
# `cuda_attention_bench` test binaries (built here with `cargo test --release --features cuda
# --no-run --test cuda_ops --test cuda_attention_bench`, copied and stripped), default .device;
# several DIRs compare builds in one call. Logs go to $OUT (or /tmp), one folder per DIR.
# PARC_ATT_GRID=1: the bench and SDPA on issue 19's grid (head dim x T x GQA ratio) instead.
# PARC_ATT_PAIRS=ws: parc's warp-specialized pair only; =variants: that pair and the kernel
# variants awaiting measurement (tests/cuda_attention_bench.rs).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader | tee "$out/gpu.txt"
logs=()
for dev in "${@:-.device}"; do
    name=$(basename "$dev")
    mkdir -p "$out/$name"
    "$dev/cuda_ops" attention --nocapture --test-threads=1 >"$out/$name/ops.log" 2>&1
    echo "== $name: cuda_ops attention exit $?"
    # The worst relative error per test (each line: "<test>/<case> ... worst relative error E").
    awk '/worst relative error/ { split($0, a, "/"); t = a[1]; for (i = 1; i < NF; i++) if ($i == "error") e = $(i + 1) + 0; if (!(t in w) || e > w[t]) w[t] = e } END { for (t in w) printf "  %s: worst %.3e\n", t, w[t] }' "$out/$name/ops.log" | sort
    grep -E "test result|panicked" "$out/$name/ops.log"
    "$dev/cuda_attention_bench" --ignored --nocapture >"$out/$name/parc.log" 2>&1
    echo "== $name: cuda_attention_bench exit $?"
    grep -E "panicked|skipped" "$out/$name/parc.log"
    sed -i "s/\"impl\": \"parc-/\"impl\": \"$name-/" "$out/$name/parc.log"
    logs+=("$out/$name/parc.log")
done
cat "${logs[@]}" >"$out/parc_all.log"
grid=$([ "${PARC_ATT_GRID:-}" = 1 ] && echo --grid)
python3 bench/attention.py $grid --parc "$out/parc_all.log" 2>&1 | tee "$out/sdpa.log"
