// Elementwise ops, embeddings and RoPE. Math in double where the CPU reference uses f64.
#define GRID_STRIDE(i, n) for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

#define SQRT_2_OVER_PI 0.7978845608028654
#define GELU_TANH_CUBIC 0.044715
#define FRAC_1_SQRT_2 0.7071067811865476
#define INV_SQRT_2PI 0.3989422804014327

// act: 0 = gelu (erf), 1 = gelu_tanh, 2 = relu
__device__ __forceinline__ double act_value(int act, double x) {
    if (act == 0) return 0.5 * x * (1.0 + erf(x * FRAC_1_SQRT_2));
    if (act == 1) return 0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x)));
    return x > 0.0 ? x : 0.0;
}

__device__ __forceinline__ double act_derivative(int act, double x) {
    if (act == 0) {
        double cdf = 0.5 * (1.0 + erf(x * FRAC_1_SQRT_2));
        double pdf = exp(-0.5 * x * x) * INV_SQRT_2PI;
        return cdf + x * pdf;
    }
    if (act == 1) {
        double t = tanh(SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x));
        double d_inner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_CUBIC * x * x);
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner;
    }
    return x > 0.0 ? 1.0 : 0.0;
}

extern "C" __global__ void activation_fwd(int act, const float* x, float* y, long long n) {
    GRID_STRIDE(i, n) y[i] = (float)act_value(act, (double)x[i]);
}

extern "C" __global__ void activation_bwd(int act, const float* dy, const float* x, float* dx, long long n) {
    GRID_STRIDE(i, n) dx[i] = (float)((double)dy[i] * act_derivative(act, (double)x[i]));
}

__device__ __forceinline__ double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }

extern "C" __global__ void swiglu_fwd(const float* gate, const float* up, float* y, long long n) {
    GRID_STRIDE(i, n) {
        double g = (double)gate[i];
        y[i] = (float)(g * sigmoid_d(g) * (double)up[i]);
    }
}

extern "C" __global__ void swiglu_bwd(const float* dy, const float* gate, const float* up, float* dgate, float* dup, long long n) {
    GRID_STRIDE(i, n) {
        double g = (double)gate[i], d = (double)dy[i], u = (double)up[i];
        double s = sigmoid_d(g);
        dgate[i] = (float)(d * u * s * (1.0 + g * (1.0 - s)));
        dup[i] = (float)(d * g * s);
    }
}

extern "C" __global__ void add_fwd(const float* a, const float* b, float* y, long long n) {
    GRID_STRIDE(i, n) y[i] = a[i] + b[i];
}

extern "C" __global__ void scale_fwd(const float* x, float* y, float factor, long long n) {
    GRID_STRIDE(i, n) y[i] = factor * x[i];
}

// y[r, c] = b[c]: the bias a GEMM with beta = 1 then adds x Wᵀ to.
extern "C" __global__ void broadcast_rows(const float* b, float* y, long long rows, long long cols) {
    GRID_STRIDE(i, rows * cols) y[i] = b[i % cols];
}

// Rows whose id is outside [vocab_start, vocab_start + vocab_local) are zero.
extern "C" __global__ void embedding_fwd(const int* ids, const float* table, float* y, long long rows, long long dim, long long vocab_start, long long vocab_local) {
    GRID_STRIDE(i, rows * dim) {
        long long r = i / dim, c = i % dim;
        long long local = (long long)ids[r] - vocab_start;
        y[i] = (local >= 0 && local < vocab_local) ? table[local * dim + c] : 0.0f;
    }
}

extern "C" __global__ void embedding_bwd(const int* ids, const float* dy, float* dtable, long long rows, long long dim, long long vocab_start, long long vocab_local) {
    GRID_STRIDE(i, rows * dim) {
        long long r = i / dim, c = i % dim;
        long long local = (long long)ids[r] - vocab_start;
        if (local >= 0 && local < vocab_local) atomicAdd(&dtable[local * dim + c], dy[i]);
    }
}

// pos[s]: global position of local sequence index s; row = s * batch + b.
extern "C" __global__ void position_add_fwd(const float* x, const float* table, float* y, const int* pos, long long rows, long long batch, long long dim) {
    GRID_STRIDE(i, rows * dim) {
        long long r = i / dim, c = i % dim;
        y[i] = x[i] + table[(long long)pos[r / batch] * dim + c];
    }
}

// One thread per (s, c): sums the batch's rows of position s, then adds into dtable.
extern "C" __global__ void position_add_bwd(const float* dy, float* dtable, const int* pos, long long seq, long long batch, long long dim) {
    GRID_STRIDE(i, seq * dim) {
        long long s = i / dim, c = i % dim;
        float acc = 0.0f;
        for (long long b = 0; b < batch; b++) acc += dy[(s * batch + b) * dim + c];
        atomicAdd(&dtable[(long long)pos[s] * dim + c], acc);
    }
}

// Rotate-half RoPE; sign = -1 applies the inverse rotation (the backward).
extern "C" __global__ void rope_fwd(const float* x, float* y, const int* pos, long long rows, long long batch, long long heads, long long head_dim, double theta, double sign) {
    long long half = head_dim / 2;
    GRID_STRIDE(t, rows * heads * half) {
        long long i = t % half, h = (t / half) % heads, r = t / (half * heads);
        double inv_freq = pow(theta, -2.0 * (double)i / (double)head_dim);
        double angle = sign * (double)pos[r / batch] * inv_freq;
        float c = (float)cos(angle), s = (float)sin(angle);
        long long base = r * heads * head_dim + h * head_dim;
        float lo = x[base + i], hi = x[base + i + half];
        y[base + i] = lo * c - hi * s;
        y[base + i + half] = hi * c + lo * s;
    }
}

// GEMM operands for bf16 runs: x rounded to bf16 (nearest, ties to even; NaN stays a quiet NaN,
// infinities stay infinite), as the raw 16-bit pattern cuBLASLt reads as CUDA_R_16BF. Bit
// arithmetic, so no cuda_bf16.h is needed under NVRTC.
__device__ __forceinline__ unsigned short round_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// GEMM operands for fp16 runs: x rounded to IEEE binary16 (nearest, ties to even; magnitudes
// from 65520 up become infinite, as a scaled gradient that overflows fp16 must, so the step's
// norm is not finite and it is skipped; subnormals kept; NaN stays NaN), as the raw 16-bit
// pattern cuBLASLt reads as CUDA_R_16F. One PTX conversion, so no cuda_fp16.h under NVRTC.
__device__ __forceinline__ unsigned short round_f16(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

template <bool BF16>
__device__ __forceinline__ unsigned short round16(float x) {
    return BF16 ? round_bf16(x) : round_f16(x);
}

// Both operands of one GEMM in one launch: a16[i] = round(a[i]) for i < na, b16[i] = round(b[i])
// for i < nb. Where an array and its copy are 16- and 8-byte aligned, four elements move per
// load and store (the grid strides over the quads of a, then of b; block 0 rounds the tails);
// otherwise one element at a time.
template <bool BF16>
__device__ void round_pair(const float* a, unsigned short* a16, long long na,
                           const float* b, unsigned short* b16, long long nb) {
    bool va = ((unsigned long long)a % 16 == 0) && ((unsigned long long)a16 % 8 == 0);
    bool vb = ((unsigned long long)b % 16 == 0) && ((unsigned long long)b16 % 8 == 0);
    long long qa = va ? na / 4 : 0, qb = vb ? nb / 4 : 0;
    GRID_STRIDE(q, qa + qb) {
        const float* src = q < qa ? a : b;
        unsigned short* dst = q < qa ? a16 : b16;
        long long j = q < qa ? q : q - qa;
        float4 v = reinterpret_cast<const float4*>(src)[j];
        ushort4 r;
        r.x = round16<BF16>(v.x);
        r.y = round16<BF16>(v.y);
        r.z = round16<BF16>(v.z);
        r.w = round16<BF16>(v.w);
        reinterpret_cast<ushort4*>(dst)[j] = r;
    }
    // Elements past the quads: the tails of vectorised arrays, all of a scalar one.
    long long ra = na - 4 * qa, rb = nb - 4 * qb;
    GRID_STRIDE(i, ra + rb) {
        if (i < ra) {
            a16[4 * qa + i] = round16<BF16>(a[4 * qa + i]);
        } else {
            long long j = 4 * qb + (i - ra);
            b16[j] = round16<BF16>(b[j]);
        }
    }
}

extern "C" __global__ void f32_to_bf16_pair(const float* a, unsigned short* a16, long long na,
                                            const float* b, unsigned short* b16, long long nb) {
    round_pair<true>(a, a16, na, b, b16, nb);
}

extern "C" __global__ void f32_to_f16_pair(const float* a, unsigned short* a16, long long na,
                                           const float* b, unsigned short* b16, long long nb) {
    round_pair<false>(a, a16, na, b, b16, nb);
}
