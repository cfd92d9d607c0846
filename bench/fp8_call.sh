#!/usr/bin/env bash
# Issue 24's rowwise and blockwise FP8 on the CUDA backend in one call on one GPU: the kernel
# variants' tests, their GEMMs alone, their training speed on Llama 3.2 1B, and the profile
# points that let `parc check` price them as measured. Binaries from bench/device_build.sh
# (carry DIR).
#
#   OUT=$OUT bench/fp8_call.sh [DIR]
#
# Build: BINS="parc cuda_ops cuda_train cuda_gemm_bench" bench/device_build.sh .device-fp8.
# All four phases take longer than one device command may (600 s): run PHASES="tests gemms",
# then PHASES="llama calibrate", on the same warm machine.
#
# PHASES (default "tests gemms llama calibrate") picks parts (or "quick" or "mini", below):
# - tests: `cuda_ops fp8` (the FP8 GEMMs, and the group amaxes bit for bit against the CPU,
#   each kernel variant, and the rolled tensorwise factors), `cuda_train` rowwise/blockwise
#   against the CPU emulation, with the default kernels and with NEW, and delayed scaling's
#   variants (rolled factors, unstored SwiGLU outputs) against the defaults;
# - gemms: cuda_gemm_bench on d 2048 × 16384 rows in bf16 and each FP8 recipe, default and
#   NEW: each op's time (quantization included) and its GEMM kernel's alone;
# - llama: Llama 3.2 1B, 8 × 2048, 12 synthetic steps, tokens/s: bf16, and delayed tensorwise,
#   rowwise and blockwise with every projection pinned, each default and NEW;
# NEW (default "PARC_FP8_AMAX_KERNEL=vectors PARC_FP8_GEMM_KERNEL=wide
# PARC_FP8_FACTORS_KERNEL=rolled PARC_SWIGLU_FP8_STORE_KERNEL=needed"): the variants judged,
# space-separated VAR=name settings, all on together;
# - calibrate: `parc calibrate --fp8 rowwise,blockwise` added to calibration/GPU.json (GPU from
#   nvidia-smi: h100_80gb or h200), written to $out/GPU.json for the repository, measured with
#   the settings CAL (default NEW: the profile must price the kernels that stay default).
# Output: one log per step under $OUT (or DIR/out); a summary on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
device_dirs "${1:-}"
phases=" ${PHASES:-tests gemms llama calibrate} "
read -r -a new <<< "${NEW:-PARC_FP8_AMAX_KERNEL=vectors PARC_FP8_GEMM_KERNEL=wide PARC_FP8_FACTORS_KERNEL=rolled PARC_SWIGLU_FP8_STORE_KERNEL=needed}"
read -r -a cal <<< "${CAL:-${new[*]}}"
t0=$SECONDS
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu_name"

# llama NAME [VAR=VALUE...] -- [--set ...]: Llama 3.2 1B, 8 × 2048, 12 synthetic steps.
llama() {
    local name=$1; shift
    local envs=()
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    env "${envs[@]}" timeout 240 "$dir/parc" run examples/llama3.2-1b.par --backend cuda \
        --log-format json --set model.seq=2048 --set train.global_batch=8 \
        --set train.micro_batch=8 --set train.steps=12 --set train.data=synthetic \
        --set parallel.recompute=none --set "train.checkpoint.dir=\"/tmp/parc-fp8-$name\"" \
        "$@" > "$out/llama-$name.log" 2>&1
    echo "== llama-$name rc=$? at $((SECONDS - t0)) s"
    table+=("$(rate "$out/llama-$name.log" "llama3.2-1b $name")")
}

# fp8 LABEL RECIPE MODE...: `llama` with every attention and MLP projection pinned to FP8 under
# RECIPE, once per MODE (default: the default kernels; new: NEW), named LABEL-MODE.
delayed="tensorwise { scaling: delayed }"
fp8() {
    local label=$1 recipe=$2 mode; shift 2
    for mode in "$@"; do
        local envs=()
        [[ $mode == new ]] && envs=("${new[@]}")
        llama "$label-$mode" "${envs[@]}" -- --set "train.fp8=$recipe" \
            --set "train.fp8.fp8=[Attention, MLP]"
    done
}

# quick: the variants' own tests and the runs that judge them, for a call with little device
# time left: each variant's tests, then Llama delayed tensorwise and rowwise default and NEW,
# blockwise NEW, and bf16 last.
if [[ $phases == *" quick "* ]]; then
    step ops-quick 150 -- "$dir/cuda_ops" fp8_amax kernel_variants a_run_of_rolls \
        --nocapture --test-threads 1
    step train-quick-new 100 "${new[@]}" -- "$dir/cuda_train" rowwise_and_blockwise \
        --nocapture --test-threads 1
    # These set their variants themselves, against the defaults: no NEW in the environment.
    step train-quick-variants 120 -- "$dir/cuda_train" delayed_fp8_variants \
        swiglu_outputs_only --nocapture --test-threads 1
    table=()
    fp8 delayed "$delayed" default new
    fp8 rowwise rowwise default new
    fp8 blockwise blockwise new
    llama bf16 --
    printf '%s\n' "${table[@]}"
fi

# mini: for a call of about three minutes, the delayed-scaling variants alone: their tests and
# Llama delayed tensorwise default and NEW.
if [[ $phases == *" mini "* ]]; then
    step ops-mini 60 -- "$dir/cuda_ops" a_run_of_rolls --nocapture --test-threads 1
    step train-mini 90 -- "$dir/cuda_train" delayed_fp8_variants swiglu_outputs_only \
        --nocapture --test-threads 1
    table=()
    fp8 delayed "$delayed" default new
    printf '%s\n' "${table[@]}"
fi

if [[ $phases == *" tests "* ]]; then
    step ops-fp8 300 -- "$dir/cuda_ops" fp8 --nocapture --test-threads 1
    step train-fp8-default 200 -- "$dir/cuda_train" rowwise_and_blockwise --nocapture --test-threads 1
    step train-fp8-new 200 "${new[@]}" -- "$dir/cuda_train" rowwise_and_blockwise --nocapture \
        --test-threads 1
    step train-fp8-factors 200 -- "$dir/cuda_train" delayed_fp8_variants swiglu_outputs_only --nocapture --test-threads 1
fi

if [[ $phases == *" gemms "* ]]; then
    for mode in default new; do
        envs=()
        [[ $mode == new ]] && envs=("${new[@]}")
        step "gemms-$mode" 240 "${envs[@]}" PARC_BENCH_MODELS=d2048 \
            PARC_BENCH_FP8=bf16,tensorwise,rowwise,blockwise -- \
            "$dir/cuda_gemm_bench" --ignored --nocapture --test-threads 1
        grep -E "^\||one d2048 step" "$out/gemms-$mode.log" | head -70
    done
fi

if [[ $phases == *" llama "* ]]; then
    table=()
    llama bf16 --
    fp8 delayed "$delayed" default new
    fp8 rowwise rowwise default new
    fp8 blockwise blockwise default new
    printf '%s\n' "${table[@]}"
fi

if [[ $phases == *" calibrate "* ]]; then
    case $gpu_name in
        *H200*) gpu=h200 ;;
        *H100*) gpu=h100_80gb ;;
        *) gpu= ;;
    esac
    if [[ -n $gpu ]]; then
        step calibrate 420 "${cal[@]}" -- "$dir/parc" calibrate --backend cuda \
            --gpu "$gpu" --fp8 rowwise,blockwise --add-to "calibration/$gpu.json" -o "$out/$gpu.json"
        tail -5 "$out/calibrate.log"
    else
        echo "== calibrate skipped: no profile for $gpu_name"
    fi
fi
echo "total $((SECONDS - t0)) s"
