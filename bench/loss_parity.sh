#!/usr/bin/env bash
# Loss parity with PyTorch: parc and the PyTorch peer (bench/torch_peer.py parity) train the same
# GPT-2 from the same initial weights (`parc run --save-init`) on the same batches
# (`parc run --log-batches`) with the same recipe, and bench/parity/compare.py compares the two
# loss curves step by step. Exit code: 0 within tolerance, 1 over it (or a run failed), 2 setup.
#
#   bench/loss_parity.sh          the device run: examples/gpt2-124m.par on one GPU (--backend cuda)
#                                 against the peer on CUDA, bf16, 200 steps of global batch 8 ×
#                                 1024, gated on the 10-step moving averages within 1%
#   bench/loss_parity.sh --cpu    the mapping proof, here: a 2-layer examples/tiny.par on the CPU
#                                 backend against the peer on the CPU in fp32, 30 steps, gated on
#                                 every step within 1e-4 relative
#
# Data: examples/data/tiny-shakespeare.txt as bytes (one token per byte; the 124M model keeps its
# 50,304-token vocabulary). GPT-2's BPE cannot be used: its vocabulary file needs the network,
# which neither this machine's tools nor the device machine have.
# MODEL=llama: the Llama family instead (bench/torch_llama_peer.py parity): examples/llama3.2-1b.par
# on the GPU (8 × 2048, bf16, 200 steps), a 2-layer examples/tiny-llama.par on the CPU.
# Environment: PARC (the binary; default .device/parc, else target/{release,debug}/parc),
# PYTHON (default python3), STEPS, BATCH, PRECISION (bf16|fp32), TOLERANCE, GATE (step|window),
# LR, WARMUP, MIN_LR (the recipe; defaults per mode below), RESIDUAL (fp32|bf16: a bf16 run's
# residual stream, parc's `bf16 { residual: … }` and the peer's `--residual`; default fp32, as
# autocast keeps it, so that the two runs round alike), FLOOR=1 (also the peer against itself at
# half the micro batch: floor.txt, and the gate becomes the larger of TOLERANCE and
# FLOOR_FACTOR (default 2) times the floor's: a recipe whose loss spikes is chaotic, and two
# correct runs drift apart by percents there (issue 19; bench/parity/compare.py --floor)).
# Arguments after the mode: `--set PATH=VALUE` overrides for both runs' spec (e.g. a larger
# CPU model: --set model.d=256 --set model.seq=128).
# Output: $OUT/loss-parity-MODEL-MODE/ (or .device/out/… without $OUT): plan.json,
# batches.jsonl, parc.jsonl, peer.jsonl, parc.stderr, peer.stderr, comparison.txt,
# comparison.json; the init weights are written to a temporary folder and removed.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=gpu
if [[ "${1:-}" == "--cpu" ]]; then mode=cpu; shift; fi
overrides=()
while [[ $# -gt 0 ]]; do
    if [[ "$1" == --set && $# -ge 2 && "$2" == *=* ]]; then
        overrides+=(--set "$2"); shift 2
    else
        echo "usage: bench/loss_parity.sh [--cpu] [--set PATH=VALUE]...   (settings through STEPS, BATCH, PRECISION, RESIDUAL, LR, WARMUP, MIN_LR, TOLERANCE, GATE, FLOOR)" >&2
        exit 2
    fi
done

target="${CARGO_TARGET_DIR:-target}"
parc="${PARC:-}"
if [[ -z "$parc" ]]; then
    candidates=(.device/parc "$target/release/parc" "$target/debug/parc")
    # here (--cpu) a fresh cargo build wins over a copy left in .device/
    [[ "$mode" == cpu ]] && candidates=("$target/release/parc" "$target/debug/parc" .device/parc)
    for candidate in "${candidates[@]}"; do
        if [[ -x "$candidate" ]]; then parc="$candidate"; break; fi
    done
fi
if [[ -z "$parc" || ! -x "$parc" ]]; then
    echo "error: no parc binary: build one (cargo build --release [--features cuda]) and copy it to .device/parc, or set PARC" >&2
    exit 2
fi
if ! "$parc" run --help | grep -q -- --save-init; then
    echo "error: $parc has no --save-init (an older build): rebuild it and copy it to .device/parc" >&2
    exit 2
fi
python="${PYTHON:-python3}"
if ! "$python" -c "import torch" 2>/dev/null; then
    echo "error: $python cannot import torch; install PyTorch (pip install torch) or set PYTHON" >&2
    exit 2
fi

data=examples/data/tiny-shakespeare.txt
case "${MODEL:-gpt2}" in
    gpt2) peer=bench/torch_peer.py; gpu_spec=examples/gpt2-124m.par; cpu_spec=examples/tiny.par ;;
    llama) peer=bench/torch_llama_peer.py; gpu_spec=examples/llama3.2-1b.par; cpu_spec=examples/tiny-llama.par ;;
    *) echo "error: MODEL=${MODEL}: use gpt2 or llama" >&2; exit 2 ;;
esac
if [[ "$mode" == gpu ]]; then
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    spec=$gpu_spec
    steps="${STEPS:-200}"; batch="${BATCH:-8}"; precision="${PRECISION:-bf16}"
    tolerance="${TOLERANCE:-0.01}"; gate="${GATE:-window}"
    backend=cuda; device=cuda
    lr="${LR:-6e-4}"; warmup="${WARMUP:-20}"; min_lr="${MIN_LR:-6e-5}"
    sets=(--set "train.global_batch=$batch" --set "train.micro_batch=$batch")
else
    spec=$cpu_spec
    steps="${STEPS:-30}"; batch="${BATCH:-8}"; precision="${PRECISION:-fp32}"
    tolerance="${TOLERANCE:-1e-4}"; gate="${GATE:-step}"
    backend=cpu; device=cpu
    lr="${LR:-1e-3}"; warmup="${WARMUP:-5}"; min_lr="${MIN_LR:-1e-4}"
    # parc splits the batch into microbatches of 2 (gradient accumulation); the peer takes it whole
    sets=(--set model.layers=2 --set "train.global_batch=$batch")
fi
residual="${RESIDUAL:-fp32}"
case "$residual" in
    fp32|bf16) ;;
    *) echo "error: RESIDUAL=$residual: use fp32 or bf16" >&2; exit 2 ;;
esac
precision_value="$precision"
[[ "$precision" == bf16 ]] && precision_value="bf16 { residual: $residual }"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
sets+=(
    --set "train.steps=$steps" --set "train.precision=$precision_value"
    --set "train.data=\"data/tiny-shakespeare.txt\" as bytes"
    --set "train.optimizer.lr=$lr" --set "train.schedule.warmup=$warmup"
    --set "train.schedule.min_lr=$min_lr" --set "train.schedule.decay_steps=$steps"
    --set "train.checkpoint.dir=\"$scratch/ckpt\""
    ${overrides[@]+"${overrides[@]}"}
)
out="${OUT:-.device/out}/loss-parity-${MODEL:-gpt2}-$mode"
mkdir -p "$out"
echo "loss parity ($mode): $spec, $steps steps, global batch $batch, $precision (residual $residual), lr $lr, backend $backend; parc $parc; logs in $out"

"$parc" plan "$spec" "${sets[@]}" --emit json > "$out/plan.json"

echo "== parc run ($backend)"
started=$SECONDS
"$parc" run "$spec" "${sets[@]}" --backend "$backend" --log-format json \
    --save-init "$scratch/init.safetensors" --log-batches "$out/batches.jsonl" \
    > "$out/parc.jsonl" 2> "$out/parc.stderr" || {
    echo "error: parc run failed; its stderr ($out/parc.stderr) ends with:" >&2
    tail -20 "$out/parc.stderr" >&2
    exit 1
}
echo "parc: $((SECONDS - started)) s"

echo "== PyTorch peer ($device, $precision)"
started=$SECONDS
"$python" "$peer" parity --plan "$out/plan.json" --init "$scratch/init.safetensors" \
    --batches "$out/batches.jsonl" --data "$data" --format bytes \
    --lr "$lr" --schedule cosine --warmup "$warmup" --min-lr "$min_lr" --decay-steps "$steps" \
    --device "$device" --precision "$precision" --residual "$residual" --out "$out/peer.jsonl" \
    > /dev/null 2> "$out/peer.stderr" || {
    echo "error: the PyTorch peer failed; its stderr ($out/peer.stderr) ends with:" >&2
    tail -20 "$out/peer.stderr" >&2
    exit 1
}
echo "peer: $((SECONDS - started)) s"

# FLOOR=1: the peer again, its batch in two micro batches (the same samples, the same recipe,
# gradients summed in another order): how far two correct bf16 runs drift apart on this
# recipe, the floor under parc's distance from the peer.
if [[ -n "${FLOOR:-}" ]]; then
    echo "== PyTorch peer again, micro batch $((batch / 2)) (the floor)"
    started=$SECONDS
    "$python" "$peer" parity --plan "$out/plan.json" --init "$scratch/init.safetensors" \
        --batches "$out/batches.jsonl" --data "$data" --format bytes \
        --lr "$lr" --schedule cosine --warmup "$warmup" --min-lr "$min_lr" --decay-steps "$steps" \
        --device "$device" --precision "$precision" --residual "$residual" --micro-batch "$((batch / 2))" \
        --out "$out/peer-half.jsonl" > /dev/null 2> "$out/peer-half.stderr" || {
        echo "error: the second peer run failed; its stderr ($out/peer-half.stderr) ends with:" >&2
        tail -20 "$out/peer-half.stderr" >&2
        exit 1
    }
    echo "peer again: $((SECONDS - started)) s"
    echo "== the floor: the peer against itself"
    "$python" bench/parity/compare.py "$out/peer-half.jsonl" "$out/peer.jsonl" --tolerance "$tolerance" \
        --gate "$gate" --json "$out/floor.json" | tee "$out/floor.txt" || true
fi

echo "== comparison"
floor_args=()
[[ -n "${FLOOR:-}" && -s "$out/floor.json" ]] && floor_args=(--floor "$out/floor.json" --floor-factor "${FLOOR_FACTOR:-2}")
set +e
"$python" bench/parity/compare.py "$out/parc.jsonl" "$out/peer.jsonl" --tolerance "$tolerance" \
    --gate "$gate" --json "$out/comparison.json" ${floor_args[@]+"${floor_args[@]}"} | tee "$out/comparison.txt"
status=${PIPESTATUS[0]}
exit "$status"
