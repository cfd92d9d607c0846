#!/usr/bin/env bash
# One call on a one-GPU device machine (nvidia-h200): the GPU tests, then the benchmarks that
# issue 6 is judged by, with binaries built here by bench/device_build.sh (carry that folder).
#
#   PHASES="tests rates" VARIANTS="default;PARC_CE_KERNEL=smem" bench/device_call.sh [DIR]
#
# Phases (PHASES, default "tests rates"), each line of the log says how long it took:
#   tests     cuda_ops, cuda_train, memplan's no-allocation test, cuda_nccl (one GPU)
#   rates     parc alone on GPT-2 124M (32 × 1024) and 350M (16 × 1024), 8 steps, mean tokens/s
#             of steps 2..8, once per variant
#   attention bench/attention.sh: parc's attention micro-benchmark beside PyTorch SDPA
#   membound  bench/membound.sh where it exists: the norm and cross-entropy kernel variants
#   profile   `parc run --profile` of a 124M step (default variant)
#   bench     bench/gpu.sh: PyTorch (MODES, default compile) and parc side by side, ratios
#   parity    bench/loss_parity.sh: 200 bf16 steps of parc and PyTorch from the same weights
# VARIANTS: `;`-separated environment settings, one variant each (`default` = none), e.g. the
# kernel variants that docs/cuda.md lists; the rates phase runs each.
# Output: $OUT (or DIR/out): one log per run; a summary on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
device_dirs "${1:-}"
phases=" ${PHASES:-tests rates} "
t0=$SECONDS
parc_run() { # parc_run NAME MODEL BATCH [VAR=VALUE...]: 8 steps of GPT-2 MODEL, JSON into $out/NAME.jsonl
    local name=$1 model=$2 batch=$3; shift 3
    env "$@" timeout 120 "$dir/parc" run "examples/gpt2-$model.par" --backend cuda --log-format json \
        --set train.global_batch="$batch" --set train.micro_batch="$batch" --set train.steps=8 \
        --set train.data=synthetic --set parallel.recompute=none \
        --set "train.checkpoint.dir=\"/tmp/parc-ck-$name\"" > "$out/$name.jsonl" 2> "$out/$name.stderr"
}
if [[ $phases == *" tests "* ]]; then
    step cuda_ops 200 -- "$dir/cuda_ops" --nocapture --test-threads 1
    step cuda_train 150 -- "$dir/cuda_train" --nocapture --test-threads 1
    step memplan 90 -- "$dir/memplan" cuda_steps_allocate_nothing --nocapture
    step cuda_nccl 150 "PARC_BIN=$PWD/$dir/parc" -- "$dir/cuda_nccl" --nocapture --test-threads 1
fi
if [[ $phases == *" rates "* ]]; then
    IFS=';' read -r -a variants <<< "${VARIANTS:-default}"
    for variant in "${variants[@]}"; do
        settings=()
        [[ $variant != default ]] && read -r -a settings <<< "$variant"
        for shape in "124m 32" "350m 16"; do
            set -- $shape
            name="rate-$1-$(printf '%s' "$variant" | tr -c 'A-Za-z0-9=_' '_')"
            parc_run "$name" "$1" "$2" "${settings[@]}"
            echo "rc=$? $(rate "$out/$name.jsonl" "$variant $1")"
        done
    done
fi
if [[ $phases == *" attention "* ]]; then
    step attention 240 -- bash bench/attention.sh "$dir"
    tail -20 "$out/attention.log"
fi
if [[ $phases == *" membound "* && -f bench/membound.sh ]]; then
    step membound-call 400 -- bash bench/membound.sh "$dir"
    tail -30 "$out/membound-call.log"
fi
if [[ $phases == *" profile "* ]]; then
    step profile 120 -- "$dir/parc" run examples/gpt2-124m.par --backend cuda --set train.global_batch=32 \
        --set train.micro_batch=32 --set train.steps=3 --set train.data=synthetic \
        --set parallel.recompute=none --set 'train.checkpoint.dir="/tmp/parc-ck-profile"' --profile
    tail -40 "$out/profile.log"
fi
if [[ $phases == *" bench "* ]]; then
    step gpubench 300 "MODES=${MODES:-compile}" "PARC=$dir/parc" -- bash bench/gpu.sh
    tail -20 "$out/gpu-bench/summary.txt" 2>/dev/null
fi
if [[ $phases == *" parity "* ]]; then
    step parity 220 "PARC=$dir/parc" -- bash bench/loss_parity.sh
    tail -7 "$out/parity.log"
fi
echo "total $((SECONDS - t0)) s"
