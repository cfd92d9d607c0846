// Hopper's asynchronous data movement, for the warp-specialized kernels (compute_90a; under
// __CUDA_ARCH_FEAT_SM90_ALL like every wgmma kernel): shared-memory mbarriers (a phase
// completes when its expected arrivals and, for TMA, its expected bytes have all come), the
// tensor memory accelerator's tiled loads (`cp.async.bulk.tensor`, described by a tensor map
// the host encodes with cuTensorMapEncodeTiled: runtime/src/cuda/tma.rs) and register
// reallocation between warpgroups (`setmaxnreg`).
//
// Pipeline convention (producer / consumer rings): a slot has a `full` barrier (1 arrival: the
// producer's expect_tx, plus the bytes its copies deliver) and an `empty` barrier (one arrival
// per consumer warp once it is done reading the slot: mbar_arrive_warp). Round r of a slot waits on parity
// r & 1 of `full`; the producer waits on parity (r & 1) ^ 1 of `empty`, which a fresh barrier
// passes at once (its "previous" phase counts as complete), so round 0 needs no special case.
#ifdef __CUDA_ARCH_FEAT_SM90_ALL

// A CUtensorMap as the kernels receive it: 128 opaque bytes, by value, as a __grid_constant__
// parameter (its address is then a valid operand of cp.async.bulk.tensor).
struct __align__(64) TmaMap {
    unsigned long long w[16];
};

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes the barriers' initialization visible to the async proxy (TMA); a __syncthreads must
// follow before any thread uses them.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The barriers of a warp-specialized kernel's pipeline at shared address bars: a ring of
// `stages` slots (full[s] at bars + 8 s, empty[s] at bars + 8 (stages + s)), then two item
// buffers (full[u] at bars + 16 stages + 8 u, empty[u] 16 bytes after), every full barrier
// awaiting the producer's one arrival and every empty one an arrival from each of
// consumer_warps warps. Thread 0 only; a __syncthreads must follow.
__device__ __forceinline__ void ws_pipeline_init(unsigned bars, int stages, unsigned consumer_warps) {
    for (int s = 0; s < stages; s++) {
        mbar_init(bars + 8 * s, 1);
        mbar_init(bars + 8 * (stages + s), consumer_warps);
    }
    for (int u = 0; u < 2; u++) {
        mbar_init(bars + 16 * stages + 8 * u, 1);
        mbar_init(bars + 16 * stages + 16 + 8 * u, consumer_warps);
    }
    mbar_init_fence();
}

// The producer's arrival on a `full` barrier, announcing the bytes its copies will deliver.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// A consumer warp's release of a slot it has finished reading (barrier count: one per
// consumer warp): every lane's reads are ordered before lane 0's arrival by the warp barrier.
__device__ __forceinline__ void mbar_arrive_warp(unsigned bar) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
}

// Waits until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// Loads the box at element coordinates (c0, c1) of a 2-d tensor map into shared memory at dst,
// completing on barrier bar (its expect_tx counted the box's bytes). Out-of-bounds elements
// arrive as zeros.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaMap& map, unsigned bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}

// Fetches a tensor map's descriptor into the TMA unit's cache ahead of its first use.
__device__ __forceinline__ void tma_prefetch(const TmaMap& map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&map)) : "memory");
}

// Named barriers (ids 1..15; 0 is __syncthreads'): named_bar_sync waits until THREADS threads
// (a multiple of 32) have arrived at or synced on barrier id; named_bar_arrive counts this
// warp's threads without waiting. Memory accesses before either are performed for the threads
// the barrier releases.
template <int THREADS>
__device__ __forceinline__ void named_bar_sync(int id) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(THREADS) : "memory");
}
template <int THREADS>
__device__ __forceinline__ void named_bar_arrive(int id) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(THREADS) : "memory");
}

// Register reallocation: every warp of a warpgroup executes the same one (the kernel has a
// register cap at entry: __launch_bounds__(threads, 1)).
template <int N>
__device__ __forceinline__ void regs_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
