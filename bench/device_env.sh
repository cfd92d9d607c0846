# Sourced by the device scripts (bench/device_call.sh, bench/variants_call.sh, bench/multi_gpu.sh): the GPU machine's CUDA
# libraries on the library path and NVLink multicast off (issue 8: every run keeps it off).
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0

# link_nccl DIR: cudarc looks for libnccl.so, Debian's libnccl2 installs only libnccl.so.2
# (docs/cuda.md, NCCL): link that name in DIR and put DIR on the library path. Nothing where
# libnccl2 is absent (the CPU dry runs).
link_nccl() {
    if [[ -e /usr/lib/x86_64-linux-gnu/libnccl.so.2 ]]; then
        mkdir -p "$1" && ln -sf /usr/lib/x86_64-linux-gnu/libnccl.so.2 "$1/libnccl.so"
        export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(cd "$1" && pwd)"
    fi
}

# device_dirs [DIR]: the carried binaries' folder DIR (default .device) as $dir, the output
# folder ($OUT, else $dir/out) as $out, made, and NCCL linked under $dir.
device_dirs() {
    dir=${1:-.device}
    out=${OUT:-$dir/out}
    mkdir -p "$out"
    link_nccl "$dir/nccl"
}

# rate LOG LABEL: one line with the mean tokens/s of steps 2.. of a JSON-lines `parc run` log
# (the first step includes compiling and algorithm timing).
rate() {
    PYTHONPATH=bench/parity python3 - "$1" "$2" <<'PY'
import sys
from jsonl import json_lines
steps = [e["tokens_per_s"] for e in json_lines(sys.argv[1])
         if e.get("event") == "step" and "tokens_per_s" in e]
r = steps[1:]
if r:
    print(f"{sys.argv[2]:<60} {sum(r) / len(r):>10,.0f} tokens/s (max {max(r):,.0f}, steps 2..{len(steps)})")
else:
    print(f"{sys.argv[2]:<60} no timed steps (see its log)")
PY
}

# step NAME TIMEOUT [VAR=VALUE...] -- COMMAND...: run COMMAND (with the VARs set) into
# $out/NAME.log, then print its outcome lines and the seconds since $t0.
step() {
    local name=$1 limit=$2; shift 2
    local envs=()
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    env "${envs[@]}" timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name rc=$? at $((SECONDS - t0)) s"
    grep -E "test result|FAILED|panicked|^error|failures:" "$out/$name.log" | head -12
}
