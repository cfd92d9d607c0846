#!/usr/bin/env bash
# Same-call A/B of two parc builds on one GPU: tokens/s of GPT-2 124M (32 × 1024) and 350M
# (16 × 1024), the two builds interleaved ROUNDS times (default 2) so machine drift hits both
# alike. Each run: STEPS (default 20) synthetic steps, mean tokens/s of steps 2.. . Binaries
# from bench/device_build.sh; BASE is a folder holding the other build's `parc`.
#
#   BASE=.device-base bench/ab_call.sh [DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.device}
base=${BASE:?BASE names the folder of the build to compare against}
out=${OUT:-$dir/out}
mkdir -p "$out"
source bench/device_env.sh
link_nccl "$dir/nccl"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for round in $(seq "${ROUNDS:-2}"); do
    for shape in "124m 32" "350m 16"; do
        set -- $shape
        for build in "$base" "$dir"; do
            name="ab-$1-$(basename "$build")-$round"
            timeout 180 "$build/parc" run "examples/gpt2-$1.par" --backend cuda --log-format json \
                --set train.global_batch="$2" --set train.micro_batch="$2" \
                --set train.steps="${STEPS:-20}" --set train.data=synthetic \
                --set parallel.recompute=none --set "train.checkpoint.dir=\"/tmp/parc-ab-$name\"" \
                > "$out/$name.jsonl" 2> "$out/$name.stderr"
            echo "rc=$? $(rate "$out/$name.jsonl" "$1 $(basename "$build") round $round")"
        done
    done
done
