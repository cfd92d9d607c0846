#!/usr/bin/env bash
# Registers, spills and SASS instruction counts of the generated kernels (`Op::Fused`) that
# tests/cuda_fused_bench.rs times, without a GPU: the runtime's ignored test
# `dump_bench_kernels` writes each kernel's CUDA C and NVRTC's PTX (bf16 and f32), ptxas
# assembles it for the chosen SM and cuobjdump lists its SASS.
#
# Needs NVRTC and ptxas as bench/kernel_stats.sh does, and cuobjdump
# (pip install --target DIR nvidia-cuda-cuobjdump; CUOBJDUMP=DIR/nvidia/cu13/bin/cuobjdump):
#   CUDA_PIP=/opt/cuda-pip CUOBJDUMP=… bench/fused_kernel_stats.sh [sm_90a] [out-dir]
# Output, per kernel: registers, spill stores/loads, SASS instructions in all and in its
# largest loop that loads 16-byte vectors (the flat kernels' 8-element vector loop; a row-sum
# kernel's row loop; else its largest loop), and of them the memory, shuffle, barrier and
# special-function (MUFU) ones, and `nan`: the bf16 stores' NaN fix-ups, the instructions a
# branch right after a vector's cvt.rn.bf16x2 packs (F2FP.BF16) jumps over when no value is
# NaN (codegen's bf16_vector_store); `hot` is the loop without them, what a vector of numbers
# runs. The sources, PTX and SASS stay in out-dir when one is given.
set -euo pipefail
cd "$(dirname "$0")/.."
sm=${1:-sm_90a}
pip_root=${CUDA_PIP:-$(python3 -c 'import site; print(site.getsitepackages()[0])')}
lib=$(dirname "$(find "$pip_root" -name 'libnvrtc.so*' -print -quit 2>/dev/null || true)")
ptxas=${PTXAS:-$(find "$pip_root" -name ptxas -type f -print -quit 2>/dev/null || true)}
cuobjdump=${CUOBJDUMP:-$(find "$pip_root" -name cuobjdump -type f -print -quit 2>/dev/null || true)}
[ -n "$lib" ] && [ "$lib" != . ] || { echo "no libnvrtc under $pip_root (pip install nvidia-cuda-nvrtc)" >&2; exit 2; }
[ -x "$ptxas" ] || { echo "no ptxas under $pip_root (pip install nvidia-cuda-nvcc, or set PTXAS)" >&2; exit 2; }
[ -x "$cuobjdump" ] || { echo "no cuobjdump (pip install nvidia-cuda-cuobjdump, set CUOBJDUMP)" >&2; exit 2; }
out=${2:-}
if [ -z "$out" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
cache=$(mktemp -d)
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" XDG_CACHE_HOME="$cache" PARC_FUSED_DUMP="$out" \
  cargo test --release -q -p parc-runtime --features cuda --lib \
  cuda::fused::tests::dump_bench_kernels -- --ignored >/dev/null
rm -rf "$cache"
for ptx in "$out"/*.ptx; do
  stem=${ptx%.ptx}
  "$ptxas" -arch="$sm" -v "$ptx" -o "$stem.cubin" 2>"$stem.ptxas"
  "$cuobjdump" -sass "$stem.cubin" >"$stem.sass"
  python3 - "$stem" <<'PY'
import re, sys
stem = sys.argv[1]
info = open(stem + ".ptxas").read()
regs = re.search(r"Used (\d+) registers", info).group(1)
spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info).groups()
code = []
for line in open(stem + ".sass"):
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m:
        code.append((int(m.group(1), 16), m.group(2)))
loops = []
for addr, text in code:
    b = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
    if b and int(b.group(1), 16) <= addr:
        loops.append((int(b.group(1), 16), addr))
body = lambda lo, hi: [t for a, t in code if lo <= a <= hi and not t.startswith("NOP")]
vector = [l for l in loops if any(re.search(r"LDG\.E\.128", t) for t in body(*l))]
lo, hi = max(vector or loops, key=lambda l: l[1] - l[0]) if loops else (0, -1)
loop = body(lo, hi)
kind = lambda pat: sum(1 for t in loop if re.search(pat, t))
inside = [(a, t) for a, t in code if lo <= a <= hi]
nan = 0
for i, (a, t) in enumerate(inside):
    b = re.match(r"@!?P\d\s+BRA\b.*?(0x[0-9a-f]+)", t)
    before = [u for _, u in inside[max(0, i - 3):i]]
    if b and int(b.group(1), 16) > a and any(u.startswith("F2FP.BF16") for u in before):
        nan += len(body(a + 1, int(b.group(1), 16) - 1))
name = stem.rsplit("/", 1)[1]
print(f"{name:22} {regs:>4} regs  spill {spill[0]}/{spill[1]}  sass {len(body(0, 1 << 40)):5}  loop {len(loop):5}"
      f"  hot {len(loop) - nan:5}  (ld {kind(r'LDG|LDS')} st {kind(r'STG|STS')} shfl {kind('SHFL')} bar {kind('BAR')} mufu {kind('MUFU')} nan {nan})")
PY
done
