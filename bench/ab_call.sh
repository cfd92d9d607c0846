#!/usr/bin/env bash
# Same-call A/B of two parc builds on one GPU: tokens/s and memory of each model of MODELS
# (default GPT-2 124M at 32 × 1024, 350M at 16 × 1024 and the Llama 3.2 1B example at 8 × 2048),
# the two builds interleaved ROUNDS times (default 2) so machine drift hits both alike. Each run:
# STEPS (default 20) synthetic steps, mean tokens/s of steps 2.., the run's memory_reserved_bytes,
# nvidia-smi's peak while it ran, and `parc check`'s predicted per-GPU memory of that build
# (docs/memory.md: issue 21 asks nvidia-smi within 3% of it). Binaries from bench/device_build.sh;
# BASE is a folder holding the other build's `parc`.
#
#   BASE=.device-base [MODELS="gpt2-124m:32 llama3.2-1b:8"] bench/ab_call.sh [DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.device}
base=${BASE:?BASE names the folder of the build to compare against}
out=${OUT:-$dir/out}
mkdir -p "$out"
source bench/device_env.sh
link_nccl "$dir/nccl"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
# memory NAME BUILD SPEC ARGS...: reserved, nvidia-smi peak and predicted GiB of run NAME.
memory() {
    local name=$1 build=$2 spec=$3; shift 3
    "$build/parc" check "$spec" "$@" --format json > "$out/$name.check.json" 2> /dev/null
    python3 - "$out/$name.jsonl" "$out/$name.smi" "$out/$name.check.json" <<'PY'
import json, sys
sys.path.insert(0, "bench/parity")
from jsonl import json_lines
gib = 1 << 30
reserved = [e["memory_reserved_bytes"] for e in json_lines(sys.argv[1])
            if e.get("memory_reserved_bytes") is not None]
try:
    smi = max(int(l) for l in open(sys.argv[2]) if l.strip().isdigit()) * (1 << 20)
except (OSError, ValueError):
    smi = None
try:
    doc = json.load(open(sys.argv[3]))
    predicted = max(n["bytes"] for n in doc["files"][0]["lowered"]["memory_per_gpu"])
except (OSError, ValueError, KeyError, TypeError, IndexError):
    predicted = None
fmt = lambda b: "-" if b is None else f"{b / gib:.2f}"
ratio = f"{smi / predicted:.3f}" if smi and predicted else "-"
print(f"    reserved {fmt(reserved[-1] if reserved else None)} GiB, nvidia-smi peak {fmt(smi)} GiB, "
      f"predicted {fmt(predicted)} GiB, nvidia-smi/predicted {ratio}")
PY
}
for round in $(seq "${ROUNDS:-2}"); do
    for model in ${MODELS:-gpt2-124m:32 gpt2-350m:16 llama3.2-1b:8}; do
        spec="examples/${model%%:*}.par" batch=${model##*:}
        for build in "$base" "$dir"; do
            name="ab-${model%%:*}-$(basename "$build")-$round"
            args=(--set train.global_batch="$batch" --set train.micro_batch="$batch"
                --set train.steps="${STEPS:-20}" --set train.data=synthetic
                --set parallel.recompute=none --set "train.checkpoint.dir=\"/tmp/parc-ab-$name\"")
            nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 \
                > "$out/$name.smi" 2> /dev/null &
            smi=$!
            timeout 240 "$build/parc" run "$spec" --backend cuda --log-format json "${args[@]}" \
                > "$out/$name.jsonl" 2> "$out/$name.stderr"
            rc=$?
            kill "$smi" 2> /dev/null; wait "$smi" 2> /dev/null
            echo "rc=$rc $(rate "$out/$name.jsonl" "${model%%:*} $(basename "$build") round $round")"
            memory "$name" "$build" "$spec" "${args[@]}"
        done
    done
done
