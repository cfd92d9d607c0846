#!/usr/bin/env bash
# Issue 19 (and 24's FP8 peer) in one call on one GPU: parc and the PyTorch Llama-family peer
# (bench/torch_llama_peer.py: eager, torch.compile and, with torchao carried, torch.compile +
# torchao float8) on the same shapes, one after the other: tokens/s, MFU (6N + 12·L·d·T per
# token against 989 TFLOP/s), peak memory, and parc's ratio to each peer mode.
#
#   SHAPES="llama3.2-1b:2048:8 qwen2.5-1.5b:2048:8 llama3.2-1b:8192:2" bench/llama_call.sh [DIR]
#
# SHAPES: MODEL:SEQ:BATCH, MODEL an example (examples/MODEL.par) and a peer config. MODES: the
# peer's modes (default "eager compile", plus float8-rowwise float8-tensorwise when torchao
# imports). torchao is not on the GPU machine: download its wheel here into .whl (see the
# device README: `pip download --no-deps --only-binary=:all: ... torchao==0.16.0 -d .whl`),
# carry .whl, and the script installs it under /tmp/site. PARC_SETS: extra --set flags for parc
# (e.g. "train.fp8=blockwise" once the CUDA backend runs FP8). DIR: bench/device_build.sh's folder.
# Output: $OUT (or DIR/out): each run's JSON lines and stderr, and summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
device_dirs "${1:-}"
if ls .whl/torchao-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/torchao-*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
modes=${MODES:-eager compile}
if [[ -z ${MODES:-} ]] && python3 -c "import torchao.float8" 2> /dev/null; then
    modes="$modes float8-rowwise float8-tensorwise"
fi
read -r -a extra <<< "${PARC_SETS:-}"
sets=()
for s in "${extra[@]}"; do sets+=(--set "$s"); done
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
t0=$SECONDS
for shape in ${SHAPES:-llama3.2-1b:2048:8 qwen2.5-1.5b:2048:8 llama3.2-1b:8192:2}; do
    IFS=: read -r model seq batch <<< "$shape"
    name="$model-$seq"
    timeout 300 "$dir/parc" run "examples/$model.par" --backend cuda --log-format json \
        --set "model.seq=$seq" --set train.global_batch="$batch" --set train.micro_batch="$batch" \
        --set train.steps="${PARC_STEPS:-12}" --set train.data=synthetic \
        --set parallel.recompute=none --set "train.checkpoint.dir=\"/tmp/parc-llama-$name\"" \
        "${sets[@]}" > "$out/parc-$name.jsonl" 2> "$out/parc-$name.stderr"
    echo "== parc $name rc=$? at $((SECONDS - t0)) s"
    PYTHONUNBUFFERED=1 timeout 400 python3 bench/torch_llama_peer.py "$model" --seq "$seq" \
        --batch "$batch" --modes "${modes// /,}" > "$out/peer-$name.jsonl" 2> "$out/peer-$name.stderr"
    echo "== peer $name rc=$? at $((SECONDS - t0)) s"
done
python3 - "$out" ${SHAPES:-llama3.2-1b:2048:8 qwen2.5-1.5b:2048:8 llama3.2-1b:8192:2} <<'PY' | tee "$out/summary.txt"
import json, sys
sys.path.insert(0, "bench/parity")
from jsonl import json_lines
out = sys.argv[1]
for shape in sys.argv[2:]:
    model, seq, batch = shape.split(":")
    name = f"{model}-{seq}"
    steps = [e for e in json_lines(f"{out}/parc-{name}.jsonl") if e.get("event") == "step"]
    rates = [e["tokens_per_s"] for e in steps[1:] if "tokens_per_s" in e]
    parc = sum(rates) / len(rates) if rates else None
    peers = list(json_lines(f"{out}/peer-{name}.jsonl"))
    flops = peers[0]["flops_per_token"] if peers else None
    mem = [e.get("memory_reserved_bytes") for e in json_lines(f"{out}/parc-{name}.jsonl")]
    mem = [m for m in mem if m]
    line = f"{name} × {batch}: parc "
    line += f"{parc:,.0f} tokens/s" if parc else "no timed steps (see its stderr)"
    if parc and flops:
        line += f" (MFU {parc * flops / 989e12:.1%})"
    if mem:
        line += f", reserved {mem[-1] / 2**30:.1f} GiB"
    print(line)
    for e in peers:
        ratio = f", parc / this {parc / e['tokens_per_s']:.3f}" if parc else ""
        print(f"  {e['mode']:<18} {e['tokens_per_s']:>10,} tokens/s, MFU {e['mfu']:.1%}, "
              f"peak {e['peak_mem_gib']} GiB{ratio}")
PY
echo "total $((SECONDS - t0)) s"
