#!/usr/bin/env bash
# Registers, spills and shared memory of every parc CUDA kernel, without a GPU: NVRTC compiles
# the kernels to PTX (the runtime's own compile path, through its unit test) and ptxas reports
# what each kernel uses on the chosen SM. For working on kernels on a machine with no GPU.
#
# Needs NVRTC and ptxas, e.g. from PyPI:
#   pip install --target /opt/cuda-pip "nvidia-cuda-nvrtc==13.0.*" nvidia-cuda-nvcc   (13.0: the GPU machine's NVRTC)
#   CUDA_PIP=/opt/cuda-pip bench/kernel_stats.sh [sm_90a] [kernel-name-filter]
# (sm_90a: what an H100/H200 runs, docs/cuda.md; sm_80 or sm_90 for the other targets.)
# Output: one line per kernel: name, registers, spill stores/loads and static shared memory
# (bytes; dynamic shared memory is set at launch and not shown).
set -euo pipefail
cd "$(dirname "$0")/.."
sm=${1:-sm_90a}
filter=${2:-}
pip_root=${CUDA_PIP:-$(python3 -c 'import site; print(site.getsitepackages()[0])')}
lib=$(dirname "$(find "$pip_root" -name 'libnvrtc.so*' -print -quit 2>/dev/null || true)")
ptxas=${PTXAS:-$(find "$pip_root" -name ptxas -type f -print -quit 2>/dev/null || true)}
[ -n "$lib" ] && [ "$lib" != . ] || { echo "no libnvrtc under $pip_root (pip install nvidia-cuda-nvrtc)" >&2; exit 2; }
[ -x "$ptxas" ] || { echo "no ptxas under $pip_root (pip install nvidia-cuda-nvcc, or set PTXAS)" >&2; exit 2; }
arch=compute_${sm#sm_}
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" XDG_CACHE_HOME="$cache" \
  cargo test --release -q -p parc-runtime --features cuda --lib \
  cuda::compile::tests::kernels_compile_with_nvrtc >/dev/null
ptx=$(ls "$cache"/parc/kernels-"$arch"-*.ptx)
"$ptxas" -arch="$sm" -v "$ptx" -o "$cache/kernels.cubin" 2>&1 | awk -v filter="$filter" '
  /Compiling entry function/ { split($0, q, "\047"); name = q[2] }
  /bytes spill stores/ { st = $5; ld = $9 }
  /Used [0-9]+ registers/ {
    regs = $5; smem = 0
    for (i = 1; i <= NF; i++) if ($(i) ~ /^smem/) smem = $(i - 2)
    if (filter == "" || index(name, filter)) printf "%-36s %4d regs  spill %5d/%-5d  static smem %6d\n", name, regs, st, ld, smem
  }'
