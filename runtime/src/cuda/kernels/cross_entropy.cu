// The fused cross-entropy of an unsplit vocabulary (`Op::CrossEntropy`), in place. One block per
// row: the first pass reads the row once for its max and sum of exponentials (online: each
// thread keeps a running max and a sum rescaled whenever the max grows; the block then merges
// the pairs) and thread 0 reads the target logit; thread 0 writes the row's loss
// ln(sumexp) + max - target_logit (f64) to `row_loss`; the second pass overwrites the row with
// dlogits = grad_scale * (exp(x - max) / sumexp - [j == target]). Every element is read by the
// first pass before the block's reduction (a barrier) and written after it, by the thread that
// reads it again, so the update needs no copy of the logits. `cross_entropy_loss_sum` then adds
// scale * the row losses into the loss in a fixed order (deterministic).
//
// Logits are f32 or bf16 (`T`: float or unsigned short; read widened, dlogits rounded once to
// nearest-even). Each row is moved as 16-byte vectors from its first 16-byte boundary on; the
// elements before it (a row of an odd vocabulary can start anywhere) and after the last whole
// vector go one at a time. The second pass walks each thread's vectors backwards (the ones the
// first pass read last are the likeliest still in L2) and loads and stores them as streaming
// (evict-first: the row is not read again here, and dlogits go to DRAM for the head's GEMMs),
// so the rows other blocks are between their two passes keep their L2 lines.

// 16 bytes of `T`, widened to f32 on load and rounded on store; `load_last` reads for the last
// time and `store` writes, both streaming (`__ldcs`/`__stcs`: evict first from L2).
template <typename T> struct XentVec;

template <> struct XentVec<float> {
    static constexpr int N = 4;
    static __device__ __forceinline__ void unpack(float4 x, float* v) {
        v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
    }
    static __device__ __forceinline__ void load(const float* p, float* v) {
        unpack(*reinterpret_cast<const float4*>(p), v);
    }
    static __device__ __forceinline__ void load_last(const float* p, float* v) {
        unpack(__ldcs(reinterpret_cast<const float4*>(p)), v);
    }
    static __device__ __forceinline__ void store(float* p, const float* v) {
        float4 x;
        x.x = v[0]; x.y = v[1]; x.z = v[2]; x.w = v[3];
        __stcs(reinterpret_cast<float4*>(p), x);
    }
    static __device__ __forceinline__ float get(const float* p) { return *p; }
    static __device__ __forceinline__ void put(float* p, float v) { __stcs(p, v); }
};

template <> struct XentVec<unsigned short> {
    static constexpr int N = 8;
    static __device__ __forceinline__ void load(const unsigned short* p, float* v) {
        unpack(*reinterpret_cast<const uint4*>(p), v);
    }
    static __device__ __forceinline__ void load_last(const unsigned short* p, float* v) {
        unpack(__ldcs(reinterpret_cast<const uint4*>(p)), v);
    }
    static __device__ __forceinline__ void unpack(uint4 u, float* v) {
        unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            v[2 * k] = widen_bf16((unsigned short)(w[k] & 0xffffu));
            v[2 * k + 1] = widen_bf16((unsigned short)(w[k] >> 16));
        }
    }
    static __device__ __forceinline__ void store(unsigned short* p, const float* v) {
        unsigned w[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            w[k] = (unsigned)round_bf16(v[2 * k]) | ((unsigned)round_bf16(v[2 * k + 1]) << 16);
        uint4 u;
        u.x = w[0]; u.y = w[1]; u.z = w[2]; u.w = w[3];
        __stcs(reinterpret_cast<uint4*>(p), u);
    }
    static __device__ __forceinline__ float get(const unsigned short* p) { return widen_bf16(*p); }
    static __device__ __forceinline__ void put(unsigned short* p, float v) { __stcs(p, round_bf16(v)); }
};

// A running sum of exp(x - m) rebased to the max mx >= m (exp(0) = 1 needs no rescale; an
// empty part, m = -inf, has s = 0).
__device__ __forceinline__ float xent_rebase(float m, float s, float mx) {
    return m == mx ? s : (m == NEG_INF ? 0.0f : s * expf(m - mx));
}

// (m, s) <- the running (max, sum of exp(x - max)) of both parts. An empty part is (-inf, 0).
__device__ __forceinline__ void xent_merge(float& m, float& s, float m2, float s2) {
    float mx = fmaxf(m, m2);
    if (mx == NEG_INF) return;
    float a = xent_rebase(m, s, mx);
    float b = xent_rebase(m2, s2, mx);
    s = a + b;
    m = mx;
}

// (m, s) <- the running pair with the values v[0..n) added.
template <int N>
__device__ __forceinline__ void xent_add(float& m, float& s, const float* v) {
    float vm = v[0];
#pragma unroll
    for (int k = 1; k < N; k++) vm = fmaxf(vm, v[k]);
    float mx = fmaxf(m, vm);
    if (mx == NEG_INF) return;
    float acc = xent_rebase(m, s, mx);
#pragma unroll
    for (int k = 0; k < N; k++) acc += expf(v[k] - mx);
    s = acc;
    m = mx;
}

// Every thread's (m, s) merged over the block (at most 1024 threads, a multiple of 32); every
// thread gets the result. Only the slots of existing warps are written and read.
__device__ __forceinline__ void xent_block_merge(float& m, float& s) {
    __shared__ float part_m[32];
    __shared__ float part_s[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(FULL_MASK, m, o);
        float s2 = __shfl_xor_sync(FULL_MASK, s, o);
        xent_merge(m, s, m2, s2);
    }
    if (lane == 0) {
        part_m[warp] = m;
        part_s[warp] = s;
    }
    __syncthreads();
    m = NEG_INF;
    s = 0.0f;
    for (int w = 0; w < warps; w++) xent_merge(m, s, part_m[w], part_s[w]);
}

template <typename T>
__device__ __forceinline__ void xent_row(T* logits, const int* targets, double* row_loss, long long vocab, float grad_scale) {
    typedef XentVec<T> V;
    const long long r = blockIdx.x;
    T* row = logits + r * vocab;
    // Elements before the first 16-byte boundary, whole vectors, then the tail.
    const unsigned long long misaligned = (unsigned long long)row & 15ull;
    long long head = misaligned ? (long long)((16ull - misaligned) / sizeof(T)) : 0;
    if (head > vocab) head = vocab;
    const long long vectors = (vocab - head) / V::N;
    const long long tail = head + vectors * V::N;
    const int target = targets[r];
    const bool has_target = target >= 0 && (long long)target < vocab;
    // Read before any thread of the block writes (the merge below is a barrier).
    const float target_logit = (threadIdx.x == 0 && has_target) ? V::get(row + target) : 0.0f;

    float m = NEG_INF, s = 0.0f;
    for (long long j = threadIdx.x; j < head; j += blockDim.x) {
        float v = V::get(row + j);
        xent_add<1>(m, s, &v);
    }
    for (long long k = threadIdx.x; k < vectors; k += blockDim.x) {
        float v[V::N];
        V::load(row + head + k * V::N, v);
        xent_add<V::N>(m, s, v);
    }
    for (long long j = tail + threadIdx.x; j < vocab; j += blockDim.x) {
        float v = V::get(row + j);
        xent_add<1>(m, s, &v);
    }
    xent_block_merge(m, s);
    if (threadIdx.x == 0)
        row_loss[r] = log((double)s) + (double)m - (double)target_logit;

    const float factor = grad_scale / s;
    for (long long j = threadIdx.x; j < head; j += blockDim.x) {
        float d = factor * expf(V::get(row + j) - m);
        if (j == target) d -= grad_scale;
        V::put(row + j, d);
    }
    // This thread's vectors, last first.
    const long long first = threadIdx.x;
    const long long last =
        first < vectors ? first + (vectors - 1 - first) / blockDim.x * blockDim.x : -1;
    for (long long k = last; k >= first; k -= blockDim.x) {
        const long long j0 = head + k * V::N;
        float v[V::N];
        V::load_last(row + j0, v);
#pragma unroll
        for (int i = 0; i < V::N; i++) {
            v[i] = factor * expf(v[i] - m);
            if (j0 + i == target) v[i] -= grad_scale;
        }
        V::store(row + j0, v);
    }
    for (long long j = tail + threadIdx.x; j < vocab; j += blockDim.x) {
        float d = factor * expf(V::get(row + j) - m);
        if (j == target) d -= grad_scale;
        V::put(row + j, d);
    }
}

// One block per row of `logits` [rows, vocab] (f32), blockDim a multiple of 32, at most 1024
// (the bound keeps the registers within what a 1024-thread block may use).
extern "C" __global__ void __launch_bounds__(1024) cross_entropy_rows_f32(float* logits, const int* targets, double* row_loss, long long vocab, float grad_scale) {
    xent_row<float>(logits, targets, row_loss, vocab, grad_scale);
}

// As cross_entropy_rows_f32, for bf16 logits (raw 16-bit patterns).
extern "C" __global__ void __launch_bounds__(1024) cross_entropy_rows_bf16(unsigned short* logits, const int* targets, double* row_loss, long long vocab, float grad_scale) {
    xent_row<unsigned short>(logits, targets, row_loss, vocab, grad_scale);
}

// One block: loss[0] += scale * Σ row_loss (each thread sums a fixed stride of rows, then the
// block's fixed reduction tree: the same order every run).
extern "C" __global__ void cross_entropy_loss_sum(const double* row_loss, float* loss, long long rows, double scale) {
    double s = 0.0;
    for (long long r = threadIdx.x; r < rows; r += blockDim.x) s += row_loss[r];
    s = block_sum_d(s);
    if (threadIdx.x == 0) loss[0] = (float)((double)loss[0] + scale * s);
}
