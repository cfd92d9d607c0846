#!/usr/bin/env bash
# bench/generated_call.sh [DIR]: a short device call (about 4 minutes) for the generated kernels: the Llama 3.2 1B profile with
# fusion on, GPT-2 124M/350M tokens/s against BASE (default .device-base), the `.par`-function
# activation's CUDA-vs-CPU run, the Llama profile with fusion off. Most important first: a
# call cut short by its limit still reports what finished.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
device_dirs "${1:-}"
base=${BASE:-.device-base}
S=(--backend cuda --set train.data=synthetic)
L=(--set train.global_batch=8 --set train.micro_batch=8 --set train.steps=3 --profile)
gpt() { # gpt BUILD MODEL BATCH
    timeout 60 "$1/parc" run "examples/gpt2-$2.par" "${S[@]}" --log-format json --set train.steps=8 \
        --set train.global_batch="$3" --set train.micro_batch="$3" --set parallel.recompute=none \
        --set "train.checkpoint.dir=\"/tmp/ck-$2-$(basename "$1")\"" > "$out/$2-$(basename "$1").jsonl" 2>/dev/null
    rate "$out/$2-$(basename "$1").jsonl" "gpt2-$2 $(basename "$1")"
}
timeout 80 "$dir/parc" run examples/llama3.2-1b.par "${S[@]}" "${L[@]}" > "$out/llama-on.log" 2>&1
grep -E "^step|^profile|^  [a-z_]+ +[0-9]" "$out/llama-on.log"
gpt "$base" 124m 32; gpt "$dir" 124m 32
timeout 40 "$dir/cuda_train" a_par_function --nocapture 2>&1 | grep -E "step 7|test result|panicked"
timeout 60 "$dir/parc" run examples/llama3.2-1b.par "${S[@]}" "${L[@]}" --fusion off > "$out/llama-off.log" 2>&1
grep -E "^step|^profile|^  (elementwise|norm|data_movement) " "$out/llama-off.log"
gpt "$base" 350m 16; gpt "$dir" 350m 16
