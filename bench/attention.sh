#!/usr/bin/env bash
# One device call: the bf16 attention differential tests, parc's attention micro-benchmark and
# PyTorch SDPA's on the same shapes, then a table of both. Binaries come from .device/ (built
# here: cargo test --release --features cuda --no-run --test cuda_ops --test cuda_attention_bench,
# copied as .device/cuda_ops and .device/cuda_attention_bench). Logs go to $OUT (or /tmp).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
dev=${DEVICE_DIR:-.device}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader | tee "$out/gpu.txt"
"$dev/cuda_ops" attention --nocapture --test-threads=1 >"$out/ops.log" 2>&1
echo "cuda_ops attention: exit $?"; grep -E "attention|test result|panicked" "$out/ops.log" | cut -c1-200 | tail -60
"$dev/cuda_attention_bench" --ignored --nocapture >"$out/parc.log" 2>&1
echo "cuda_attention_bench: exit $?"; grep -E "^\{|panicked|skipped" "$out/parc.log"
python3 bench/attention.py --parc "$out/parc.log" 2>&1 | tee "$out/sdpa.log"
