#!/usr/bin/env bash
# One call on a one-GPU device machine that judges kernel variants (docs/decisions.md: a kernel
# written without a GPU lands as a PARC_<OP>_KERNEL variant): the GPU tests with the default
# kernels and again with every new variant on, each micro-benchmark, a device-timed profile of a
# GPT-2 124M step both ways, and tokens/s of the defaults, of each variant alone and of all of
# them, on 124M and 350M. Binaries come from bench/device_build.sh (carry DIR).
#
#   NEW="PARC_A_KERNEL=x PARC_B_KERNEL=y" bench/variants_call.sh [DIR]
#
# NEW: the variants to judge, space-separated VAR=name settings. PHASES (default
# "tests micro profile rates") picks parts; SHAPES (default "124m 350m") the rates' models;
# SINGLES=0 skips the one-variant-at-a-time rates. Output: one log per step under $OUT (or
# DIR/out); a summary on stdout, the rates table last.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
device_dirs "${1:-}"
read -r -a new <<< "${NEW:-}"
phases=" ${PHASES:-tests micro profile rates} "
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader

if [[ $phases == *" tests "* ]]; then
    for mode in default new; do
        envs=()
        [[ $mode == new ]] && envs=("${new[@]}")
        [[ $mode == new && ${#new[@]} -eq 0 ]] && continue
        step "ops-$mode" 240 "${envs[@]}" -- "$dir/cuda_ops" --nocapture --test-threads 1
        step "train-$mode" 200 "${envs[@]}" -- "$dir/cuda_train" --nocapture --test-threads 1
        step "memplan-$mode" 90 "${envs[@]}" -- "$dir/memplan" cuda_steps_allocate_nothing --nocapture
    done
fi

if [[ $phases == *" micro "* ]]; then
    # Every micro-benchmark but cuda_bench (a whole step: the rates below), the attention one
    # last (it times the variants itself, then PyTorch SDPA on the same points).
    for bench in "$dir"/cuda_*_bench; do
        name=$(basename "$bench")
        [[ $name == cuda_bench || $name == cuda_attention_bench ]] && continue
        step "$name" 150 -- "$bench" --ignored --nocapture --test-threads 1
        # The benches print tables or JSON lines; show them.
        grep -E "\||GB/s|TFLOP/s|gbps|tflops" "$out/$name.log" | head -40
    done
    if [[ -x $dir/cuda_attention_bench ]]; then
        step cuda_attention_bench 200 -- "$dir/cuda_attention_bench" --ignored --nocapture
        grep -hE '^\{' "$out/cuda_attention_bench.log" > "$out/attn_all.log"
        PYTHONUNBUFFERED=1 timeout 150 python3 bench/attention.py --parc "$out/attn_all.log" > "$out/sdpa.log" 2>&1
        echo "== sdpa rc=$?"
        tail -24 "$out/sdpa.log"
    fi
fi

# run_parc NAME MODEL BATCH STEPS [FLAGS...] -- [VAR=VALUE...]
run_parc() {
    local name=$1 model=$2 batch=$3 steps=$4; shift 4
    local flags=()
    while [[ $1 != -- ]]; do flags+=("$1"); shift; done
    shift
    env "$@" timeout 150 "$dir/parc" run "examples/gpt2-$model.par" --backend cuda \
        --set train.global_batch="$batch" --set train.micro_batch="$batch" --set train.steps="$steps" \
        --set train.data=synthetic --set parallel.recompute=none \
        --set "train.checkpoint.dir=\"/tmp/parc-ck-$name\"" "${flags[@]}" > "$out/$name.log" 2>&1
}

if [[ $phases == *" profile "* ]]; then
    for mode in default new; do
        envs=()
        [[ $mode == new ]] && envs=("${new[@]}")
        [[ $mode == new && ${#new[@]} -eq 0 ]] && continue
        run_parc "profile-$mode" 124m 32 3 --profile -- "${envs[@]}"
        echo "== profile-$mode rc=$? at $((SECONDS - t0)) s"
        grep -vE '^\s*(step|$)' "$out/profile-$mode.log" | tail -24
    done
fi


if [[ $phases == *" rates "* ]]; then
    settings=("default")
    if [[ ${SINGLES:-1} != 0 ]]; then
        for v in "${new[@]}"; do settings+=("$v"); done
    fi
    [[ ${#new[@]} -gt 0 ]] && settings+=("${new[*]}")
    table=()
    read -r -a shapes <<< "${SHAPES:-124m 350m}"
    for shape in "${shapes[@]}"; do
        batch=32
        [[ $shape == 350m ]] && batch=16
        for s in "${settings[@]}"; do
            # One-variant runs only on the first shape (they find which variant pays).
            [[ $shape != "${shapes[0]}" && $s != default && $s != "${new[*]}" ]] && continue
            envs=()
            [[ $s != default ]] && read -r -a envs <<< "$s"
            name="rate-$shape-$(printf '%s' "$s" | tr -c 'A-Za-z0-9=_' '_' | cut -c1-80)"
            run_parc "$name" "$shape" "$batch" 8 --log-format json -- "${envs[@]}"
            table+=("$(rate "$out/$name.log" "$shape $s")")
        done
    done
    echo "== rates at $((SECONDS - t0)) s"
    printf '%s\n' "${table[@]}"
fi
echo "total $((SECONDS - t0)) s"
