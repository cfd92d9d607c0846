// Shared helpers for parc's CUDA kernels (compiled by NVRTC; no standard headers).
// Every kernel is extern "C" so the host finds it by name; sizes are long long, pointers raw.
#define NEG_INF __int_as_float(0xff800000)
#define FULL_MASK 0xffffffffu
#define GRID_STRIDE(i, n) for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

// ---------------------------------------------------------------- bf16 storage
// The one copy of parc's bf16 conversions (every .cu file uses these). Bit arithmetic, so no
// cuda_bf16.h is needed under NVRTC.

// x rounded to the nearest bf16, ties to even (NaN stays a quiet NaN, infinities stay
// infinite, overflow becomes infinite), as the raw 16-bit pattern (cuBLASLt's CUDA_R_16BF).
__device__ __forceinline__ unsigned short round_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The f32 value of a bf16 bit pattern (exact).
__device__ __forceinline__ float widen_bf16(unsigned short h) {
    return __uint_as_float((unsigned int)h << 16);
}

// x rounded to IEEE binary16 (nearest, ties to even; magnitudes from 65520 up become
// infinite; subnormals kept; NaN stays NaN), as the raw 16-bit pattern (CUDA_R_16F). One PTX
// conversion, so no cuda_fp16.h under NVRTC.
__device__ __forceinline__ unsigned short round_f16(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// A Float operand (storage class Float: f32 or bf16), as the host passes it (`FloatArg` in
// runtime/src/cuda/mod.rs: pointer, then the flag, then padding; 16 bytes). The flag is a
// kernel argument, so every thread takes the same branch: one kernel serves every mix of f32
// and bf16 operands. Reads widen exactly; writes round once to nearest-even.
struct Fv {
    void* p;
    int bf16;
    int pad_;
};

__device__ __forceinline__ float ld(Fv a, long long i) {
    return a.bf16 ? widen_bf16(((const unsigned short*)a.p)[i]) : ((const float*)a.p)[i];
}

__device__ __forceinline__ void st(Fv a, long long i, float v) {
    if (a.bf16) ((unsigned short*)a.p)[i] = round_bf16(v);
    else ((float*)a.p)[i] = v;
}

// += in the operand's own type: bf16 reads, adds in f32 and rounds once.
__device__ __forceinline__ void st_add(Fv a, long long i, float v) {
    st(a, i, ld(a, i) + v);
}

// Eight consecutive elements, moved as 16-byte loads and stores (one for bf16, two for f32).
struct F8 {
    float v[8];
};

// Whether 8-element vectors of `a` start on 16-byte boundaries (planned buffers always do).
__device__ __forceinline__ bool vec_ok(Fv a) {
    return ((unsigned long long)a.p & 15ull) == 0;
}

// Elements 8j .. 8j+7 of a (vec_ok(a)).
__device__ __forceinline__ F8 ld8(Fv a, long long j) {
    F8 r;
    if (a.bf16) {
        uint4 u = ((const uint4*)a.p)[j];
        unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            r.v[2 * k] = __uint_as_float(w[k] << 16);
            r.v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        }
    } else {
        float4 x = ((const float4*)a.p)[2 * j], y = ((const float4*)a.p)[2 * j + 1];
        r.v[0] = x.x; r.v[1] = x.y; r.v[2] = x.z; r.v[3] = x.w;
        r.v[4] = y.x; r.v[5] = y.y; r.v[6] = y.z; r.v[7] = y.w;
    }
    return r;
}

__device__ __forceinline__ void st8(Fv a, long long j, const F8& r) {
    if (a.bf16) {
        unsigned w[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            w[k] = (unsigned)round_bf16(r.v[2 * k]) | ((unsigned)round_bf16(r.v[2 * k + 1]) << 16);
        uint4 u;
        u.x = w[0]; u.y = w[1]; u.z = w[2]; u.w = w[3];
        ((uint4*)a.p)[j] = u;
    } else {
        float4 x, y;
        x.x = r.v[0]; x.y = r.v[1]; x.z = r.v[2]; x.w = r.v[3];
        y.x = r.v[4]; y.y = r.v[5]; y.z = r.v[6]; y.w = r.v[7];
        ((float4*)a.p)[2 * j] = x;
        ((float4*)a.p)[2 * j + 1] = y;
    }
}

// y[i] = f(x[i]) over n elements: 8-element vectors where both are 16-byte aligned, the rest
// (the tail, or everything when unaligned) one at a time. Launch with ~n / 8 threads.
template <typename F>
__device__ __forceinline__ void map1(Fv x, Fv y, long long n, F f) {
    long long n8 = (vec_ok(x) && vec_ok(y)) ? n / 8 : 0;
    GRID_STRIDE(j, n8) {
        F8 a = ld8(x, j), r;
#pragma unroll
        for (int k = 0; k < 8; k++) r.v[k] = f(a.v[k]);
        st8(y, j, r);
    }
    GRID_STRIDE(t, n - 8 * n8) {
        long long i = 8 * n8 + t;
        st(y, i, f(ld(x, i)));
    }
}

// y[i] = f(a[i], b[i]), vectorised as map1.
template <typename F>
__device__ __forceinline__ void map2(Fv a, Fv b, Fv y, long long n, F f) {
    long long n8 = (vec_ok(a) && vec_ok(b) && vec_ok(y)) ? n / 8 : 0;
    GRID_STRIDE(j, n8) {
        F8 u = ld8(a, j), w = ld8(b, j), r;
#pragma unroll
        for (int k = 0; k < 8; k++) r.v[k] = f(u.v[k], w.v[k]);
        st8(y, j, r);
    }
    GRID_STRIDE(t, n - 8 * n8) {
        long long i = 8 * n8 + t;
        st(y, i, f(ld(a, i), ld(b, i)));
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over a block of at most 1024 threads (a multiple of 32); every thread gets the total.
__device__ double block_sum_d(double v) {
    __shared__ double partial[32];
    __shared__ double total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum_d(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double s = lane < warps ? partial[lane] : 0.0;
        s = warp_sum_d(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    double r = total;
    __syncthreads();
    return r;
}

__device__ float block_max(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < warps ? partial[lane] : NEG_INF;
        s = warp_max(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    float r = total;
    __syncthreads();
    return r;
}

// Adds per-chunk column partials (chunks x cols, doubles) into out[cols] (+=), or, with
// accumulate 0, writes their sum over out (a gradient's first contribution).
extern "C" __global__ void add_partials(const double* part, float* out, long long cols, long long chunks, int accumulate) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= cols) return;
    double s = 0.0;
    for (long long c = 0; c < chunks; c++) s += part[c * cols + j];
    out[j] = accumulate ? (float)((double)out[j] + s) : (float)s;
}

// Column sums of x[rows, cols] per chunk of rows: part[chunk, j] = sum of x[r, j] over the chunk.
extern "C" __global__ void col_sum_partial(Fv x, double* part, long long rows, long long cols, long long chunk_rows) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long c = blockIdx.y;
    if (j >= cols) return;
    long long r0 = c * chunk_rows, r1 = min(rows, r0 + chunk_rows);
    double s = 0.0;
    for (long long r = r0; r < r1; r++) s += (double)ld(x, r * cols + j);
    part[c * cols + j] = s;
}

// Column partials with 8-column vectors (cols a multiple of 8, operands 16-byte aligned): a
// block of (32, 8) threads takes 256 columns of one chunk of rows; thread (tx, ty) sums rows
// r0 + ty, r0 + ty + 8, … of its 8 columns (`row8(r, c)`: the 8 f32 values of row r from column
// c), then the 8 row phases are added in shared memory in a fixed order (deterministic).
// part[chunk, j] as col_sum_partial writes it.
template <typename F>
__device__ __forceinline__ void col_partial8(long long rows, long long cols, long long chunk_rows, double* part, F row8) {
    __shared__ double acc[8][256];
    long long c0 = (blockIdx.x * 32 + (long long)threadIdx.x) * 8;
    long long chunk = blockIdx.y;
    long long r0 = chunk * chunk_rows, r1 = min(rows, r0 + chunk_rows);
    double s[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    if (c0 < cols) {
        for (long long r = r0 + threadIdx.y; r < r1; r += 8) {
            F8 v = row8(r, c0);
#pragma unroll
            for (int k = 0; k < 8; k++) s[k] += (double)v.v[k];
        }
    }
#pragma unroll
    for (int k = 0; k < 8; k++) acc[threadIdx.y][threadIdx.x * 8 + k] = s[k];
    __syncthreads();
    int t = threadIdx.y * 32 + threadIdx.x;
    long long col = blockIdx.x * 256LL + t;
    if (col < cols) {
        double total = 0.0;
#pragma unroll
        for (int phase = 0; phase < 8; phase++) total += acc[phase][t];
        part[chunk * cols + col] = total;
    }
}

extern "C" __global__ void col_sum_partial8(Fv x, double* part, long long rows, long long cols, long long chunk_rows) {
    col_partial8(rows, cols, chunk_rows, part, [&](long long r, long long c) { return ld8(x, (r * cols + c) / 8); });
}

// Block `block` of `blocks`' sum of squares (double) of x[n], every thread of the block
// getting it (one definition for the per-tensor and the multi-tensor kernel).
__device__ double sum_squares_block(const float* x, long long n, long long block, long long blocks) {
    double s = 0.0;
    for (long long i = block * (long long)blockDim.x + threadIdx.x; i < n; i += blocks * blockDim.x) {
        double v = (double)x[i];
        s += v * v;
    }
    return block_sum_d(s);
}

// Per-block sums of squares (double) of x[n]; part has one slot per block.
extern "C" __global__ void sum_squares_partial(const float* x, double* part, long long n) {
    double s = sum_squares_block(x, n, blockIdx.x, gridDim.x);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// out[0] += sum of part[0..n) (one block).
extern "C" __global__ void sum_partials_into(const double* part, float* out, long long n) {
    double s = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) s += part[i];
    s = block_sum_d(s);
    if (threadIdx.x == 0) out[0] = (float)((double)out[0] + s);
}

// One tensor of a multi-tensor sum of squares (runtime/src/cuda/sum_squares.rs writes them):
// out[0] += Σ x[0..n)², its `blocks` partials at part[first..first + blocks).
struct SsqTensor {
    const float* x;
    float* out;
    long long n;
    long long first;
    long long blocks;
};

// Most virtual blocks (the blocks a per-tensor sum_squares_partial launch over its tensor would
// have) one block of sum_squares_one_pass takes, and the elements per thread of a virtual block the host keeps one real block to
// (runtime/src/cuda/sum_squares.rs `GROUP_ELEMENTS`).
#define SSQ_GROUP 8

// The whole run's sums of squares in one launch, bit for bit those of each tensor's
// sum_squares_partial then sum_partials_into launches, added into the outputs in tensor order
// (an output shared by consecutive tensors rounded to f32 after each add). Block b (256 threads) takes the groups[b] = (first, count)
// virtual blocks first .. first + count - 1 of one tensor: thread t keeps one accumulator per
// virtual block and adds the same elements in the same order as thread t of that block does,
// with up to SSQ_GROUP loads in flight where the virtual block had one (a group of one virtual
// block, a large tensor's, has its own steps in flight instead); each accumulator is then
// reduced as block_sum_d does (the same warp trees: warp j finishes virtual block j). The block
// that completes a tensor's partials (a per-tensor counter) sums them as sum_partials_into
// does into sums[k], and the block that completes the last tensor adds the sums into the
// outputs in tensor order. The counters (count + 1 of them, zero between launches) are reset
// by the blocks that find them complete. Which block finishes does not change any value:
// every sum has a fixed order. The gradient loads are read-only ones (__ldg): with those ptxas
// keeps a step's SSQ_GROUP loads in flight (64 registers); with streaming (.cs) loads it chose 40
// registers and kept two.
extern "C" __global__ void __launch_bounds__(256) sum_squares_one_pass(const SsqTensor* tensors, const int* block_tensor, const int2* groups, double* part, double* sums, unsigned* counters, long long count) {
    __shared__ double warp_part[SSQ_GROUP][8];
    __shared__ double block_part[SSQ_GROUP];
    __shared__ double stage_sum[256];
    __shared__ float* stage_out[256];
    __shared__ int last;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int2 group = groups[blockIdx.x];
    int g0 = group.x, in_group = group.y;
    int k = block_tensor[g0];
    SsqTensor t = tensors[k];
    long long local = (long long)g0 - t.first;
    long long stride = t.blocks * blockDim.x;
    double s[SSQ_GROUP];
#pragma unroll
    for (int j = 0; j < SSQ_GROUP; j++) s[j] = 0.0;
    long long i = local * blockDim.x + threadIdx.x;
    if (in_group == 1) {
        for (; i + (SSQ_GROUP - 1) * stride < t.n; i += SSQ_GROUP * stride) {
            float x[SSQ_GROUP];
#pragma unroll
            for (int u = 0; u < SSQ_GROUP; u++) x[u] = __ldg(t.x + i + u * stride);
#pragma unroll
            for (int u = 0; u < SSQ_GROUP; u++) {
                double v = (double)x[u];
                s[0] += v * v;
            }
        }
        for (; i < t.n; i += stride) {
            double v = (double)t.x[i];
            s[0] += v * v;
        }
    } else {
        for (; i < t.n; i += stride) {
            float x[SSQ_GROUP];
#pragma unroll
            for (int j = 0; j < SSQ_GROUP; j++) {
                long long at = i + j * (long long)blockDim.x;
                x[j] = (j < in_group && at < t.n) ? __ldg(t.x + at) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < SSQ_GROUP; j++) {
                if (j < in_group && i + j * (long long)blockDim.x < t.n) {
                    double v = (double)x[j];
                    s[j] += v * v;
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < SSQ_GROUP; j++) {
        double w = warp_sum_d(s[j]);
        if (lane == 0) warp_part[j][warp] = w;
    }
    __syncthreads();
    if (warp < in_group) {
        double v = warp_sum_d(lane < 8 ? warp_part[warp][lane] : 0.0);
        if (lane == 0) block_part[warp] = v;
    }
    __syncthreads();
    // One writer, a fence, then the count (the threadFenceReduction pattern): the block that
    // sees the count complete reads every partial of the tensor.
    if (threadIdx.x == 0) {
        for (int j = 0; j < in_group; j++) part[g0 + j] = block_part[j];
        __threadfence();
        unsigned done = atomicAdd(&counters[k], (unsigned)in_group);
        last = done + (unsigned)in_group == (unsigned)t.blocks;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    double a = 0.0;
    for (long long p = threadIdx.x; p < t.blocks; p += blockDim.x) a += __ldcg(part + t.first + p);
    a = block_sum_d(a);
    if (threadIdx.x == 0) {
        counters[k] = 0;
        sums[k] = a;
        __threadfence();
        unsigned done = atomicAdd(&counters[count], 1u);
        last = done + 1 == (unsigned)count;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // The in-order adds into the outputs, each round's sums and outputs staged in shared
    // memory so thread 0's serial chain does not wait on global loads.
    float* out = nullptr;
    float value = 0.0f;
    for (long long base = 0; base < count; base += 256) {
        long long kk = base + threadIdx.x;
        if (kk < count) {
            stage_sum[threadIdx.x] = __ldcg(sums + kk);
            stage_out[threadIdx.x] = tensors[kk].out;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int round = (int)min(256LL, count - base);
            for (int q = 0; q < round; q++) {
                float* o = stage_out[q];
                if (o != out) {
                    if (out != nullptr) out[0] = value;
                    out = o;
                    value = out[0];
                }
                value = (float)((double)value + stage_sum[q]);
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        if (out != nullptr) out[0] = value;
        counters[count] = 0;
    }
}
