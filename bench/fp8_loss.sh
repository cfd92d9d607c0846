#!/usr/bin/env bash
# Issue 24's loss check: parc in FP8 against parc in bf16, from the same initial weights on the
# same batches (one spec, one seed: the runs differ only in `train.fp8`), then the two curves
# compared by bench/parity/compare.py (10-step moving averages, `--gate window`; its columns
# "parc" are the FP8 run, "peer" the bf16 run).
#
#   bench/fp8_loss.sh [--cpu] [--set PATH=VALUE]...
#
# GPU (default): examples/llama3.2-1b.par on the bundled text (tiny-shakespeare as bytes), 8 ×
# 2048 tokens a step, 1000 steps, `--backend cuda`, FP8 as the compiler chooses it per GEMM
# (calibration profile of the GPU); tolerance 0.5% (the issue's). --cpu: examples/tiny-llama.par
# with 2 layers on the CPU backend (FP8 emulated exactly), every attention and MLP layer pinned
# to FP8 (the small GEMMs would stay bf16 otherwise), 300 steps, same tolerance.
# Settings: STEPS, BATCH, RECIPE (the `train.fp8` value; default `tensorwise`, or e.g.
# `tensorwise { scaling: delayed, history: 16 }`), TOLERANCE, LR, WARMUP, MIN_LR. PARC: the
# binary (default .device/parc for the GPU, target/release/parc for --cpu). RUNS (default
# `bf16 fp8`): the runs to make; a run left out is read from an earlier call's log in the output
# folder (a device call's limit can cut a pair). FLOOR=1: bf16 again with its batch in two micro
# batches (the same samples and recipe), compared with the bf16 run (floor.txt), and the gate
# becomes the larger of TOLERANCE and FLOOR_FACTOR (default 2) times that floor: a recipe that
# spikes or memorizes its text drifts apart by more than 0.5% between two correct bf16 runs.
# Output: OUT (default .device/out)/fp8-loss-MODE/: bf16.jsonl, fp8.jsonl, comparison.txt
# (floor.jsonl, floor.txt). Exit status: the comparison's.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=gpu
overrides=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --cpu) mode=cpu; shift ;;
        --set) overrides+=(--set "$2"); shift 2 ;;
        *) echo "usage: bench/fp8_loss.sh [--cpu] [--set PATH=VALUE]..." >&2; exit 2 ;;
    esac
done
if [[ "$mode" == gpu ]]; then
    parc="${PARC:-.device/parc}"; spec=examples/llama3.2-1b.par; backend=cuda
    steps="${STEPS:-1000}"; batch="${BATCH:-8}"; recipe="${RECIPE:-tensorwise}"
    lr="${LR:-3e-4}"; warmup="${WARMUP:-100}"; min_lr="${MIN_LR:-3e-5}"
    sets=(--set "train.global_batch=$batch" --set "train.micro_batch=$batch")
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    parc="${PARC:-target/release/parc}"; spec=examples/tiny-llama.par; backend=cpu
    steps="${STEPS:-300}"; batch="${BATCH:-8}"
    recipe="${RECIPE:-tensorwise { fp8: [Attention, MLP] }}"
    lr="${LR:-1e-3}"; warmup="${WARMUP:-20}"; min_lr="${MIN_LR:-1e-4}"
    sets=(--set model.layers=2 --set "train.global_batch=$batch")
fi
tolerance="${TOLERANCE:-0.005}"
if [[ ! -x "$parc" ]]; then
    echo "error: no parc binary at $parc: build it (cargo build --release, or bench/device_build.sh) or set PARC" >&2
    exit 2
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
sets+=(
    --set "train.steps=$steps" --set "train.precision=bf16"
    --set "train.data=\"data/tiny-shakespeare.txt\" as bytes"
    --set "train.optimizer.lr=$lr" --set "train.schedule.warmup=$warmup"
    --set "train.schedule.min_lr=$min_lr" --set "train.schedule.decay_steps=$steps"
    ${overrides[@]+"${overrides[@]}"}
)
out="${OUT:-.device/out}/fp8-loss-$mode"
mkdir -p "$out"
echo "fp8 loss ($mode): $spec, $steps steps, global batch $batch, FP8 recipe \`$recipe\` against bf16, lr $lr; parc $parc; logs in $out"
# Which GEMMs run FP8, as `parc check` prices them.
"$parc" check "$spec" "${sets[@]}" --set "train.fp8=$recipe" 2> /dev/null | grep "^FP8 GEMMs" | tee "$out/fp8-gemms.txt"
runs="${RUNS-bf16 fp8}"
[[ -n "${FLOOR:-}" ]] && runs="$runs floor"
for run in $runs; do
    extra=()
    [[ "$run" == fp8 ]] && extra=(--set "train.fp8=$recipe")
    [[ "$run" == floor ]] && extra=(--set "train.micro_batch=$((batch / 2))")
    started=$SECONDS
    "$parc" run "$spec" "${sets[@]}" "${extra[@]+"${extra[@]}"}" --set "train.checkpoint.dir=\"$scratch/$run\"" \
        --backend "$backend" --log-format json > "$out/$run.jsonl" 2> "$out/$run.stderr" || {
        echo "error: the $run run failed; its stderr ($out/$run.stderr) ends with:" >&2
        tail -20 "$out/$run.stderr" >&2
        exit 1
    }
    echo "$run: $((SECONDS - started)) s"
done
for run in bf16 fp8; do
    if [[ ! -s "$out/$run.jsonl" ]]; then
        echo "error: no $run run's log at $out/$run.jsonl: make it (RUNS includes $run)" >&2
        exit 2
    fi
done
floor_args=()
if [[ -n "${FLOOR:-}" ]]; then
    echo "== the floor: bf16 against itself at micro batch $((batch / 2))"
    python3 bench/parity/compare.py "$out/floor.jsonl" "$out/bf16.jsonl" --tolerance "$tolerance" \
        --gate window --json "$out/floor.json" | tee "$out/floor.txt" || true
    floor_args=(--floor "$out/floor.json" --floor-factor "${FLOOR_FACTOR:-2}")
fi
echo "== FP8 against bf16"
python3 bench/parity/compare.py "$out/fp8.jsonl" "$out/bf16.jsonl" --tolerance "$tolerance" \
    --gate window --json "$out/comparison.json" ${floor_args[@]+"${floor_args[@]}"} | tee "$out/comparison.txt"
exit "${PIPESTATUS[0]}"
