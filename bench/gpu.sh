#!/usr/bin/env bash
# One device call: the PyTorch peer (bench/torch_peer.py bench: bf16 autocast, SDPA flash attention,
# fused AdamW; eager and torch.compile) and `parc run --backend cuda` train the same GPT-2 shapes
# on random tokens, one after the other on the same GPU; bench/parity/gpu_summary.py prints
# tokens/s, MFU (6N + 12·L·d·T FLOPs per token over 989 TFLOP/s, as torch_gpt.py counts), peak GPU
# memory and the ratios parc / torch.compile and parc / eager.
#
#   bench/gpu.sh                 GPT-2 124M (B×T 32×1024) and 350M (16×1024)
#
# Environment: PARC (default .device/parc), PYTHON (python3), MODELS ("124m 350m"), MODES
# ("eager compile"), TORCH_STEPS (20 timed steps after TORCH_WARM = 10; compile time falls in the
# warm-up), PARC_STEPS (6: parc's rate is taken over steps 2..N), PARC_SETS (extra --set flags for
# both parc runs), PHASE_TIMEOUT (seconds per run, 200).
# parc runs the examples' specs with synthetic data, recompute none (the peer recomputes
# nothing) and the batch above as one microbatch; its checkpoint export goes to a temporary folder.
# Peak memory: PyTorch's allocator maximum, and for both the largest `memory.used` that
# nvidia-smi reports while the run's process lives (CUDA context and workspaces included), above
# the reading before it started; for parc also its JSON summary's memory_reserved_bytes (what its
# backend held: planned buffers, scratch, cuBLASLt workspace).
# Output: $OUT/gpu-bench/ (or .device/out/gpu-bench/): every run's JSON lines, stderr and memory
# samples, and summary.txt / summary.json.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0

parc="${PARC:-.device/parc}"
python="${PYTHON:-python3}"
models="${MODELS:-124m 350m}"
modes="${MODES:-eager compile}"
torch_steps="${TORCH_STEPS:-20}"; torch_warm="${TORCH_WARM:-10}"
parc_steps="${PARC_STEPS:-6}"
phase_timeout="${PHASE_TIMEOUT:-200}"
read -r -a extra_sets <<< "${PARC_SETS:-}"
out="${OUT:-.device/out}/gpu-bench"
mkdir -p "$out"

if [[ ! -x "$parc" ]]; then
    echo "error: no parc binary at $parc: build it with cargo build --release --features cuda and copy it there, or set PARC" >&2
    exit 2
fi
if ! "$python" -c "import torch" 2>/dev/null; then
    echo "error: $python cannot import torch; set PYTHON" >&2
    exit 2
fi
if ! command -v nvidia-smi >/dev/null; then
    echo "error: nvidia-smi is missing: this script runs on the GPU machine" >&2
    exit 2
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

# run NAME CMD...: run CMD (stdout to NAME.jsonl, stderr to NAME.stderr) under PHASE_TIMEOUT,
# sampling GPU 0's memory.used every 100 ms into NAME.smi (first line: the reading before).
run() {
    local name="$1"; shift
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 > "$out/$name.smi"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 100 >> "$out/$name.smi" &
    local sampler=$!
    local started=$SECONDS
    timeout "$phase_timeout" "$@" > "$out/$name.jsonl" 2> "$out/$name.stderr"
    local status=$?
    kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
    echo "$name: exit $status after $((SECONDS - started)) s"
    if [[ $status -ne 0 ]]; then tail -5 "$out/$name.stderr"; fi
}

batch_of() { case "$1" in 124m) echo 32 ;; 350m) echo 16 ;; *) echo 16 ;; esac; }

for model in $models; do
    batch=$(batch_of "$model")
    for mode in $modes; do
        run "torch-$model-$mode" "$python" bench/torch_peer.py bench "$model" --batch "$batch" \
            --steps "$torch_steps" --warm "$torch_warm" --modes "$mode"
    done
    spec="examples/gpt2-$model.par"
    sets=(--set "train.global_batch=$batch" --set "train.micro_batch=$batch"
          --set "train.steps=$parc_steps" --set "train.data=synthetic"
          --set "parallel.recompute=none" --set "train.checkpoint.dir=\"$scratch/ckpt-$model\""
          "${extra_sets[@]}")
    "$parc" check "$spec" "${sets[@]}" --format json --lower never > "$out/parc-$model-check.json" 2> /dev/null
    run "parc-$model" "$parc" run "$spec" "${sets[@]}" --backend cuda --log-format json
    rm -rf "$scratch/ckpt-$model"
done

"$python" bench/parity/gpu_summary.py "$out" --models $models --modes $modes | tee "$out/summary.txt"
exit "${PIPESTATUS[0]}"
