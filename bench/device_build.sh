#!/usr/bin/env bash
# Build here what a one-GPU device call runs, into DIR (default .device, git-ignored): the parc
# binary with the CUDA backend and the GPU test binaries, stripped. The device machine builds
# nothing; carry DIR in the call and run bench/device_call.sh there. FEATURES (default cuda)
# adds features: FEATURES=cuda,llvm builds the LLVM emitter in (its emitter test, docs/llvm.md).
# BINS (default: all) keeps only the binaries it names in DIR: a call carries at most 64 MiB, and
# all of them strip to about 77 MB (bench/fp8_call.sh needs "parc cuda_ops cuda_train
# cuda_gemm_bench").
#
#   [BINS="..."] bench/device_build.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.device}
features=${FEATURES:-cuda}
mkdir -p "$dir"
cargo build --release --features "$features"
target=${CARGO_TARGET_DIR:-target}
install -m 755 "$target/release/parc" "$dir/parc"
# The test binaries' paths, from cargo's JSON messages.
# Every GPU test binary: tests/cuda_*(.rs or folder) and memplan.
tests=(--test memplan)
for t in tests/cuda_*; do tests+=(--test "$(basename "$t" .rs)"); done
cargo test --release --features "$features" --no-run --message-format=json "${tests[@]}" \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' \
  | while read -r name exe; do install -m 755 "$exe" "$dir/$name"; done
strip "$dir"/parc "$dir"/cuda_*  "$dir"/memplan
if [[ -n ${BINS:-} ]]; then
    for f in "$dir"/*; do
        if [[ -f $f && " $BINS " != *" $(basename "$f") "* ]]; then rm -f "$f"; fi
    done
fi
ls -la "$dir"
du -sh "$dir"
