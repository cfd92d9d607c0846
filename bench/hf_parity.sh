#!/usr/bin/env bash
# Hugging Face parity, on the CPU in fp32: for the tiny GPT-2 (examples/tiny.par), the tiny
# Llama with GQA and an untied head (examples/tiny-llama.par), the tiny Qwen2 (q/k/v biases,
# examples/tiny-qwen.par) and the tiny Qwen3 (per-head q/k norms, heads wider than d / heads,
# examples/tiny-qwen3.par; transformers 4.51 or later),
#   1. parc trains it a few steps and `parc export --format hf` writes a transformers folder;
#   2. transformers loads that folder with no warning (bench/hf_parity.py fails on any);
#   3. `parc run` with `train.init = hf("…")` trains one step, and its loss equals transformers'
#      loss on the same global batch (`--log-batches`) within 1e-5 relative.
#   4. `parc sample` on the exported folder (`--spec`, `--dump-logits`) writes parc's fp32 logits
#      of the data's first 64 tokens; transformers' logits on the same tokens equal them within
#      1e-5 relative (of the largest logit).
# Exit code: 0 every model within tolerance, 1 a check failed, 2 setup.
#
# Environment: PARC (default $CARGO_TARGET_DIR/release/parc, else target/release/parc),
# PYTHON (default /work/pyenv/bin/python, else python3), STEPS (training steps before the export,
# default 20), TOLERANCE (default 1e-5), MODELS (the examples to compare, default all four).
# Output: $OUT/hf-parity/ (default .device/out/hf-parity/): per model its export, the parc logs
# and result-NAME.json.
set -euo pipefail
cd "$(dirname "$0")/.."

parc="${PARC:-${CARGO_TARGET_DIR:-target}/release/parc}"
if [[ ! -x "$parc" ]]; then
    echo "error: no parc binary at $parc: build one (cargo build --release) or set PARC" >&2
    exit 2
fi
python="${PYTHON:-/work/pyenv/bin/python}"
[[ -x "$python" ]] || python=python3
if ! "$python" -c "import torch, transformers" 2>/dev/null; then
    echo "error: $python cannot import torch and transformers; set PYTHON" >&2
    exit 2
fi
steps="${STEPS:-20}"
tolerance="${TOLERANCE:-1e-5}"
out="$(realpath -m "${OUT:-.device/out}/hf-parity")"
rm -rf "$out"
mkdir -p "$out"
data=examples/data/tiny-shakespeare.txt

status=0
for name in ${MODELS:-tiny tiny-llama tiny-qwen tiny-qwen3}; do
    spec="examples/$name.par"
    echo "== $name ($spec)"
    base=(--set "train.precision=fp32" --backend cpu --log-format json)
    "$parc" run "$spec" "${base[@]}" --set "train.steps=$steps" \
        --set "train.checkpoint.dir=\"$out/$name-trained\"" --set train.checkpoint.every=100000 \
        > "$out/$name-train.jsonl" 2> "$out/$name-train.stderr" || {
        echo "error: parc run failed; see $out/$name-train.stderr" >&2; exit 1; }
    "$parc" export "$out/$name-trained" --format hf "$out/$name-hf" 2> "$out/$name-export.stderr" || {
        echo "error: parc export failed; see $out/$name-export.stderr" >&2; exit 1; }
    "$parc" run "$spec" "${base[@]}" --set "train.steps=1" \
        --set "train.init=hf(\"$out/$name-hf\")" --log-batches "$out/$name-batches.jsonl" \
        > "$out/$name-init.jsonl" 2> "$out/$name-init.stderr" || {
        echo "error: parc run from the export failed; see $out/$name-init.stderr" >&2; exit 1; }
    "$parc" sample "$out/$name-hf" --spec "$spec" --prompt "$(head -c 64 "$data")" --tokens 0 \
        --dump-logits "$out/$name-logits.json" 2> "$out/$name-logits.stderr" || {
        echo "error: parc sample --dump-logits failed; see $out/$name-logits.stderr" >&2; exit 1; }
    logits=(--parc-logits "$out/$name-logits.json")
    if "$python" bench/hf_parity.py --model "$out/$name-hf" --batches "$out/$name-batches.jsonl" \
        --data "$data" --format bytes --parc-log "$out/$name-init.jsonl" \
        --tolerance "$tolerance" "${logits[@]}" > "$out/result-$name.json"; then
        echo "ok: $(cat "$out/result-$name.json")"
    else
        echo "FAILED: $(cat "$out/result-$name.json")"
        status=1
    fi
done
exit "$status"
