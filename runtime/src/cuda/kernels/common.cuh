// Shared helpers for parc's CUDA kernels (compiled by NVRTC; no standard headers).
// Every kernel is extern "C" so the host finds it by name; sizes are long long, pointers raw.
#define NEG_INF __int_as_float(0xff800000)
#define FULL_MASK 0xffffffffu

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

// Adds per-chunk column partials (chunks x cols, doubles) into out[cols] (+=).
extern "C" __global__ void add_partials(const double* part, float* out, long long cols, long long chunks) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= cols) return;
    double s = 0.0;
    for (long long c = 0; c < chunks; c++) s += part[c * cols + j];
    out[j] = (float)((double)out[j] + s);
}

// Column sums of x[rows, cols] per chunk of rows: part[chunk, j] = sum of x[r, j] over the chunk.
extern "C" __global__ void col_sum_partial(const float* x, double* part, long long rows, long long cols, long long chunk_rows) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long c = blockIdx.y;
    if (j >= cols) return;
    long long r0 = c * chunk_rows, r1 = min(rows, r0 + chunk_rows);
    double s = 0.0;
    for (long long r = r0; r < r1; r++) s += (double)x[r * cols + j];
    part[c * cols + j] = s;
}

// Per-block sums of squares (double) of x[n]; part has one slot per block.
extern "C" __global__ void sum_squares_partial(const float* x, double* part, long long n) {
    double s = 0.0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        double v = (double)x[i];
        s += v * v;
    }
    s = block_sum_d(s);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// out[0] += sum of part[0..n) (one block).
extern "C" __global__ void sum_partials_into(const double* part, float* out, long long n) {
    double s = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) s += part[i];
    s = block_sum_d(s);
    if (threadIdx.x == 0) out[0] = (float)((double)out[0] + s);
}
