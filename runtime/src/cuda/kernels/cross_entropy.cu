// The fused cross-entropy of an unsplit vocabulary (`Op::CrossEntropy`), in place. Variant `rows`
// (what the default, `staged` further down, falls back to), one block per row: the first pass reads the row once
// for its max and sum of exponentials (online: each thread keeps a running max and a sum
// rescaled whenever the max grows; the block then merges the pairs) and thread 0 reads the
// target logit; thread 0 writes the row's loss ln(sumexp) + max - target_logit (f64) to
// `row_loss`; the second pass overwrites the row with
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

// ---------------------------------------------------------------- staged (the default)
// The same op and semantics, with each row staged in shared memory so it crosses HBM once each
// way: a persistent CTA of up to 1024 threads (one per SM) takes rows blockIdx.x, + gridDim.x,
// ...; with `stages` = 2 the next row's copy (cp.async, issued up front: ~100 KB in flight per
// SM for GPT-2's bf16 rows) lands in one buffer while the CTA works on the row in the other,
// with 1 (rows too long for two buffers, e.g. GPT-2's in f32) it is fetched then processed.
// A row is moved as the 16-byte chunks that cover it, from the 16-byte boundary at or before
// its first element (an odd vocabulary starts rows anywhere): chunk k of a row holds columns
// k·N - h .. k·N - h + N - 1 (N elements a chunk, h the elements before the row in chunk 0);
// only the edge chunks hold columns outside the row, which count as -inf and are never
// written. The copy moves whole chunks without a source size and the last one with its size,
// so it stops at the row's end (cp.async zero-fills the rest) and nothing past the buffer is
// read; the buffer starts on a 16-byte boundary (the host checks), so nothing before it is
// either. Chunk k is copied, read and written only by thread k mod blockDim.x, in every row,
// so a thread's own cp.async wait orders the copy before its reads and its pass-2 reads before
// the next copy into that buffer: the only barrier per row is the (max, sum) merge. Per row:
// pass 1a takes the thread's max over its chunks (bf16 pairs compared packed, exact), 1b its
// sum of e^(x - max), the block merges the pairs, the owner of the target's chunk writes the
// row loss ln(sum) + max - target logit (f64, as above), and pass 2 writes
// grad_scale / sum · e^(x - max) as 16-byte streaming stores, minus grad_scale at the target,
// rounded once. Whole bf16 chunks are rounded by cvt.rn.bf16x2.f32, one instruction a pair
// where round_bf16 takes about six an element: both round to nearest even and differ only in
// the bits of a NaN, so a row whose max or grad_scale / sum is not finite (a NaN logit makes
// the sum NaN) is written by xent_write_nonfinite instead (expf, round_bf16 throughout).
//
// The kernel is built for few instructions an element, so that the SMs' arithmetic hides
// under the rows' HBM traffic. Its first version (expf, ~9 instructions each, every chunk
// tested for being an edge, and a block merge of 32 serial merges with an expf each) ran ~30
// SASS instructions an element (sm_90a, bf16) plus ~700 a warp and row for the merge (~14 an
// element more at 32 warps): ~10 µs a row an SM, more than HBM's ~7.5 µs for the row's 200 KB.
// This one runs ~14 (per 16-byte chunk of 8 elements: the copy 9, the max 8, the sum 45, the
// dlogits 53) and ~60 a warp for the merge, ~4 µs a row, under the memory time (measured on
// one H200 for GPT-2 124M's 32,768 × 50,257 bf16 logits: 1.77 ms, 3.71 TB/s, against the first
// version's 3.08 ms).
// - e^(x - max) is ex2.approx.ftz((x - max)·L), L = log2(e) as an f32: an FADD, an FMUL and one
//   MUFU.EX2 (~2 ulp; results below 2^-126 flush to 0). x - max is rounded once and 0 at the
//   max, whose term is then exactly 1, as expf(0) is: a row that is all its max (large logits)
//   gets sum 1, dlogit grad_scale there and exactly 0 at a target there. Folding 1/sum into
//   the exponent (2^(x·L - B)) would save the FMUL but leave ~1e-6 of grad_scale at such a
//   target, and buy nothing: with two MUFUs an element and 16 MUFU results a clock an SM (8
//   issue slots a MUFU) the ~14 instructions already fit under the MUFU's time. L's rounding
//   (1.3e-8) scales each exponent by 1 + 1.3e-8: negligible where e^(x - max) is not.
// - The block merge: each warp reduces its lanes' (max, sum) pairs with shuffles (the max,
//   then the sums rebased to it), lane w of every warp then reads warp w's pair after the
//   barrier and reduces those the same way: every thread gets the same result, in a fixed
//   order.
// - A row's partial edge chunks (chunk 0 when the row starts off the 16-byte grid, the last
//   one when it ends off it) are done by their owners after the loops, so the loops test
//   nothing per chunk; the target's dlogit is written with its chunk, then again by the same
//   thread with -grad_scale (a thread's stores to one address stay in order).
// - The next row's copy is issued whole at the start of a row, before the wait for this one:
//   it then has a whole row's time to land (~100 KB in flight an SM, far more than HBM's
//   latency needs), and splitting it would move only its ~0.6 instructions an element.

__device__ __forceinline__ unsigned xent_smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// Starts a 16-byte copy global -> shared of which the first `bytes` (1..16) come from `src`
// (16-byte aligned) and the rest are zero.
__device__ __forceinline__ void xent_cp16(uint4* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(xent_smem_addr(dst)), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void xent_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most `PENDING` of this thread's newest copy groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void xent_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory"); }

__device__ __forceinline__ bool xent_finite(float x) {
    return (__float_as_uint(x) & 0x7fffffffu) < 0x7f800000u;
}

// One 16-byte chunk of `T` in shared memory: N elements; `Max` the running max of a thread's
// chunks (bf16: a packed pair, compared two at a time).
template <typename T> struct XentChunk;

template <> struct XentChunk<float> {
    static constexpr int N = 4;
    typedef float Max;
    static __device__ __forceinline__ Max max_init() { return NEG_INF; }
    static __device__ __forceinline__ Max fold(Max m, uint4 u) {
        return fmaxf(m, fmaxf(fmaxf(__uint_as_float(u.x), __uint_as_float(u.y)),
                              fmaxf(__uint_as_float(u.z), __uint_as_float(u.w))));
    }
    static __device__ __forceinline__ float finish(Max m) { return m; }
    static __device__ __forceinline__ void unpack(uint4 u, float* v) {
        v[0] = __uint_as_float(u.x); v[1] = __uint_as_float(u.y);
        v[2] = __uint_as_float(u.z); v[3] = __uint_as_float(u.w);
    }
    // Elements whose column c0 + e is outside [0, cols) become -inf.
    static __device__ __forceinline__ uint4 mask(uint4 u, int c0, int cols) {
        const unsigned inf = 0xff800000u;
        if (c0 < 0 || c0 >= cols) u.x = inf;
        if (c0 + 1 < 0 || c0 + 1 >= cols) u.y = inf;
        if (c0 + 2 < 0 || c0 + 2 >= cols) u.z = inf;
        if (c0 + 3 < 0 || c0 + 3 >= cols) u.w = inf;
        return u;
    }
    static __device__ __forceinline__ uint4 pack(const float* v, bool) {
        uint4 u;
        u.x = __float_as_uint(v[0]); u.y = __float_as_uint(v[1]);
        u.z = __float_as_uint(v[2]); u.w = __float_as_uint(v[3]);
        return u;
    }
    static __device__ __forceinline__ float get(const float* p) { return *p; }
    static __device__ __forceinline__ void put(float* p, float v) { __stcs(p, v); }
};

// max.bf16x2 returns the other operand where one is NaN, as fmaxf does, and is exact.
__device__ __forceinline__ unsigned xent_bmax2(unsigned a, unsigned b) {
    unsigned d;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

template <> struct XentChunk<unsigned short> {
    static constexpr int N = 8;
    typedef unsigned Max;
    static __device__ __forceinline__ Max max_init() { return 0xff80ff80u; }
    static __device__ __forceinline__ Max fold(Max m, uint4 u) {
        return xent_bmax2(m, xent_bmax2(xent_bmax2(u.x, u.y), xent_bmax2(u.z, u.w)));
    }
    static __device__ __forceinline__ float finish(Max m) {
        return fmaxf(__uint_as_float(m << 16), __uint_as_float(m & 0xffff0000u));
    }
    static __device__ __forceinline__ void unpack(uint4 u, float* v) {
        unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            v[2 * k] = __uint_as_float(w[k] << 16);
            v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        }
    }
    static __device__ __forceinline__ uint4 mask(uint4 u, int c0, int cols) {
        unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int e = 0; e < 8; e++) {
            if (c0 + e < 0 || c0 + e >= cols)
                w[e >> 1] = (e & 1) ? ((w[e >> 1] & 0xffffu) | 0xff800000u) : ((w[e >> 1] & 0xffff0000u) | 0xff80u);
        }
        u.x = w[0]; u.y = w[1]; u.z = w[2]; u.w = w[3];
        return u;
    }
    // `finite`: every value is finite, so the hardware's nearest-even conversion gives
    // round_bf16's bits.
    static __device__ __forceinline__ uint4 pack(const float* v, bool finite) {
        unsigned w[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (finite)
                asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[k]) : "f"(v[2 * k + 1]), "f"(v[2 * k]));
            else
                w[k] = (unsigned)round_bf16(v[2 * k]) | ((unsigned)round_bf16(v[2 * k + 1]) << 16);
        }
        uint4 u;
        u.x = w[0]; u.y = w[1]; u.z = w[2]; u.w = w[3];
        return u;
    }
    static __device__ __forceinline__ float get(const unsigned short* p) { return widen_bf16(*p); }
    static __device__ __forceinline__ void put(unsigned short* p, float v) { __stcs(p, round_bf16(v)); }
};

// Where row r of `logits` lies in memory: `a0` the 16-byte boundary at or before its first
// element, `h` the elements between them, `chunks` the 16-byte chunks from a0 that cover it.
template <typename T>
struct XentSpan {
    unsigned long long a0;
    int h;
    int chunks;
    __device__ __forceinline__ XentSpan(const T* logits, long long r, int cols) {
        const unsigned long long a = (unsigned long long)(logits + r * cols);
        a0 = a & ~15ull;
        h = (int)((a - a0) / sizeof(T));
        chunks = (h + cols + XentChunk<T>::N - 1) / XentChunk<T>::N;
    }
};

// Pass 2 of row r for a row whose max or factor (grad_scale / sum) is not finite: dlogits over
// this thread's chunks of the row, e^(x - max) by expf and bf16 rounded by round_bf16
// (XentChunk::pack), so NaNs keep round_bf16's bits, the target's dlogit with its chunk.
template <typename T>
__device__ __forceinline__ void xent_write_nonfinite(const uint4* stage, T* logits, const XentSpan<T>& sp, long long r, int cols, int target, float m, float factor, float grad_scale) {
    typedef XentChunk<T> C;
    T* row = logits + r * cols;
    uint4* chunk = reinterpret_cast<uint4*>(sp.a0);
    for (int k = threadIdx.x; k < sp.chunks; k += blockDim.x) {
        float v[C::N];
        C::unpack(stage[k], v);
#pragma unroll
        for (int e = 0; e < C::N; e++) v[e] = factor * expf(v[e] - m);
        const int c0 = k * C::N - sp.h;
        if (c0 >= 0 && c0 + C::N <= cols && (unsigned)target - (unsigned)c0 >= (unsigned)C::N) {
            __stcs(chunk + k, C::pack(v, false));
        } else {
#pragma unroll
            for (int e = 0; e < C::N; e++) {
                const int j = c0 + e;
                if (j == target) v[e] -= grad_scale;
                if (j >= 0 && j < cols) C::put(row + j, v[e]);
            }
        }
    }
}

#define XENT_LOG2E 1.44269504088896340736f

__device__ __forceinline__ float xent_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// e^(x - m) as above (the difference and the product rounded once each, 0 at x = m).
__device__ __forceinline__ float xent_exp_approx(float x, float m) {
    return xent_ex2(__fmul_rn(__fadd_rn(x, -m), XENT_LOG2E));
}

// A running sum of e^(x - m) rebased to the max mx >= m, in the same base-2 form (m == mx
// covers both being -inf; an empty part, m = -inf, has s = 0, and exp2f(-inf) is 0).
__device__ __forceinline__ float xent_rebase_approx(float m, float s, float mx) {
    return m == mx ? s : s * exp2f(__fmul_rn(m - mx, XENT_LOG2E));
}

// (m, s) of the whole block in every thread (blockDim a multiple of 32, at most 1024), through
// `part` (2 × 32 floats: maxes, then sums; the caller alternates two of them between rows, so a
// warp that runs ahead into the next row's merge never overwrites slots another warp still
// reads).
__device__ __forceinline__ void xent_block_merge_staged(float& m, float& s, float* part) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const float wm = warp_max(m);
    s = warp_sum(xent_rebase_approx(m, s, wm));
    if (lane == 0) {
        part[warp] = wm;
        part[32 + warp] = s;
    }
    __syncthreads();
    const float pm = lane < warps ? part[lane] : NEG_INF;
    const float ps = lane < warps ? part[32 + lane] : 0.0f;
    m = warp_max(pm);
    s = warp_sum(xent_rebase_approx(pm, ps, m));
}

// Calls f(k, edge) for each of this thread's chunks k of a row of `chunks` chunks (k mod
// blockDim.x == threadIdx.x) whose interior chunks are [first, end): those with edge = false
// in a loop, then chunk 0 (if first == 1) and chunk `end` (if end < chunks: a partial last
// chunk) with edge = true. end < first only for a row of one partial chunk, visited once.
template <typename F>
__device__ __forceinline__ void xent_each_chunk(int first, int end, int chunks, F f) {
    int k = threadIdx.x;
    if (k < first) {
        f(0, true);
        k += blockDim.x;
    }
    for (; k < end; k += blockDim.x) f(k, false);
    if (k == end && end < chunks) f(end, true);
}

// Starts copying row r (if r < rows) into `stage`: this thread's chunks, the last one cut at
// the row's end.
template <typename T>
__device__ __forceinline__ void xent_fetch(uint4* stage, const T* logits, long long r, long long rows, int cols) {
    if (r >= rows) return;
    const XentSpan<T> sp(logits, r, cols);
    const char* src = reinterpret_cast<const char*>(sp.a0);
    const int last = sp.chunks - 1;
    int k = threadIdx.x;
    for (; k < last; k += blockDim.x)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(xent_smem_addr(stage + k)), "l"(src + 16ll * k) : "memory");
    if (k == last) {
        const unsigned long long end = (unsigned long long)(logits + r * cols + cols);
        xent_cp16(stage + last, src + 16ll * last, (int)(end - (sp.a0 + 16ull * last)));
    }
}

// Row r, whose copy in `stage` this thread's wait has completed (for its own chunks).
template <typename T>
__device__ __forceinline__ void xent_staged_row(const uint4* stage, T* logits, const int* targets, double* row_loss, long long r, int cols, float grad_scale, float* part) {
    typedef XentChunk<T> C;
    const XentSpan<T> sp(logits, r, cols);
    const int target = targets[r];
    const int first = sp.h ? 1 : 0;
    const int end = (sp.h + cols) % C::N ? sp.chunks - 1 : sp.chunks;

    typename C::Max mx = C::max_init();
    xent_each_chunk(first, end, sp.chunks, [&](int k, bool edge) {
        uint4 u = stage[k];
        if (edge) u = C::mask(u, k * C::N - sp.h, cols);
        mx = C::fold(mx, u);
    });
    float m = C::finish(mx), s = 0.0f;
    // A thread without elements (or with only -inf) keeps the empty pair (-inf, 0).
    if (m != NEG_INF) {
        xent_each_chunk(first, end, sp.chunks, [&](int k, bool edge) {
            uint4 u = stage[k];
            if (edge) u = C::mask(u, k * C::N - sp.h, cols);
            float v[C::N];
            C::unpack(u, v);
#pragma unroll
            for (int e = 0; e < C::N; e++) v[e] = xent_exp_approx(v[e], m);
            // A tree, not a chain: the same number of additions, half the latency.
#pragma unroll
            for (int w = C::N / 2; w > 0; w /= 2)
#pragma unroll
                for (int e = 0; e < w; e++) v[e] += v[e + w];
            s += v[0];
        });
    }
    xent_block_merge_staged(m, s, part);

    // The target logit lives in its chunk, which its owner copied (so may read) itself.
    const bool has_target = target >= 0 && target < cols;
    const int owner = has_target ? (int)(((sp.h + target) / C::N) % blockDim.x) : 0;
    const bool owns_target = has_target && (int)threadIdx.x == owner;
    const float target_logit = owns_target ? C::get(reinterpret_cast<const T*>(stage) + sp.h + target) : 0.0f;
    if ((int)threadIdx.x == owner)
        row_loss[r] = log((double)s) + (double)m - (double)target_logit;

    const float factor = grad_scale / s;
    if (!(xent_finite(m) && xent_finite(factor))) {
        xent_write_nonfinite<T>(stage, logits, sp, r, cols, target, m, factor, grad_scale);
        return;
    }
    T* row = logits + r * cols;
    uint4* chunk = reinterpret_cast<uint4*>(sp.a0);
    xent_each_chunk(first, end, sp.chunks, [&](int k, bool edge) {
        float v[C::N];
        C::unpack(stage[k], v);
#pragma unroll
        for (int e = 0; e < C::N; e++) v[e] = __fmul_rn(factor, xent_exp_approx(v[e], m));
        if (!edge) {
            __stcs(chunk + k, C::pack(v, true));
        } else {
#pragma unroll
            for (int e = 0; e < C::N; e++) {
                const int j = k * C::N - sp.h + e;
                if (j >= 0 && j < cols) C::put(row + j, v[e]);
            }
        }
    });
    if (owns_target) C::put(row + target, __fmul_rn(factor, xent_exp_approx(target_logit, m)) - grad_scale);
}

// The persistent loop: rows blockIdx.x, + gridDim.x, ...; `stages` (1 or 2) buffers of
// `stage_chunks` 16-byte chunks each in dynamic shared memory (at least every row's chunks).
template <typename T>
__device__ __forceinline__ void xent_staged(T* logits, const int* targets, double* row_loss, long long rows, long long vocab, float grad_scale, int stages, int stage_chunks) {
    extern __shared__ uint4 xent_stage[];
    __shared__ float part[2][64];
    const int cols = (int)vocab;
    const long long step = gridDim.x;
    long long r = blockIdx.x;
    if (stages == 2) {
        xent_fetch<T>(xent_stage, logits, r, rows, cols);
        xent_commit();
    }
    for (int it = 0; r < rows; it++, r += step) {
        uint4* stage = xent_stage;
        if (stages == 2) {
            stage += (it & 1) * stage_chunks;
            // The other buffer held the previous row, which this thread has finished with.
            xent_fetch<T>(xent_stage + ((it + 1) & 1) * stage_chunks, logits, r + step, rows, cols);
            xent_commit();
            xent_wait<1>();
        } else {
            xent_fetch<T>(stage, logits, r, rows, cols);
            xent_commit();
            xent_wait<0>();
        }
        xent_staged_row<T>(stage, logits, targets, row_loss, r, cols, grad_scale, part[it & 1]);
    }
}

// Rows of `logits` [rows, vocab] (f32) staged in shared memory (above); one CTA per SM.
extern "C" __global__ void __launch_bounds__(1024, 1) cross_entropy_staged_f32(float* logits, const int* targets, double* row_loss, long long rows, long long vocab, float grad_scale, int stages, int stage_chunks) {
    xent_staged<float>(logits, targets, row_loss, rows, vocab, grad_scale, stages, stage_chunks);
}

// As cross_entropy_staged_f32, for bf16 logits (raw 16-bit patterns).
extern "C" __global__ void __launch_bounds__(1024, 1) cross_entropy_staged_bf16(unsigned short* logits, const int* targets, double* row_loss, long long rows, long long vocab, float grad_scale, int stages, int stage_chunks) {
    xent_staged<unsigned short>(logits, targets, row_loss, rows, vocab, grad_scale, stages, stage_chunks);
}

// One block: loss[0] += scale * Σ row_loss (each thread sums a fixed stride of rows, then the
// block's fixed reduction tree: the same order every run).
extern "C" __global__ void cross_entropy_loss_sum(const double* row_loss, float* loss, long long rows, double scale) {
    double s = 0.0;
    for (long long r = threadIdx.x; r < rows; r += blockDim.x) s += row_loss[r];
    s = block_sum_d(s);
    if (threadIdx.x == 0) loss[0] = (float)((double)loss[0] + scale * s);
}
