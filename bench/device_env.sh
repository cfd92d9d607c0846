# Sourced by the device scripts (bench/device_call.sh, bench/multi_gpu.sh): the GPU machine's CUDA
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
