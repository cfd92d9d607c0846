// FP8 GEMM operands (runtime/src/cuda/fp8.rs): the amax of each scale group, the quantized
// operand in the K-major layout cuBLASLt's FP8 GEMM reads, and the dequantization factors in the
// layout of its scale mode. The numbers are parc_compiler::ir::fp8's, as the CPU backend
// emulates them (runtime/src/cpu/fp8.rs), bit for bit:
// - the scale of a group is 2^floor(log2(max / amax)) read from the exponent bits of the f32
//   quotient (1 for a group of zeros), so scaling is exact;
// - fp8(v * s) rounds to nearest-even and saturates to the largest finite value, the float8
//   crate's conversion (NVIDIA's __nv_cvt_double_to_fp8 with __NV_SATFINITE), written out here
//   because NVRTC compiles these kernels without cuda_fp8.h (and for compute_80, which has no
//   FP8 conversion instruction);
// - a non-finite element is written as FP8 NaN (0x7f in both formats), so the GEMM's output
//   is non-finite where the emulation's is and the step's non-finite check still fires.
//
// An operand is stored [rows, cols] (f32 or bf16, `Fv`). Its scale groups are rb x cb blocks
// (clipped at the edges): group (r / rb) * gpr + c / cb, gpr = ceil(cols / cb). Its quantized
// form has `lines` lines of `k` elements along K (K = cols, lines = rows when K runs along the
// columns; transposed when it runs along the rows), leading dimension `ld` >= k, the padding
// zero.

__device__ __forceinline__ long long fp8_group(long long r, long long c, long long rb, long long cb, long long gpr) {
    return (r / rb) * gpr + c / cb;
}

// The scale of a group whose largest finite magnitude has bits `amax_bits` (runtime/src/cpu/fp8.rs
// `scale`): 2^floor(log2(maxv / amax)), the exponent clamped to [1, 254]; 1 for amax 0.
__device__ __forceinline__ float fp8_scale(unsigned int amax_bits, float maxv) {
    float amax = __uint_as_float(amax_bits);
    if (!(amax > 0.0f)) return 1.0f;
    float ratio = maxv / amax;
    if (ratio == 0.0f) return __uint_as_float(1u << 23);
    unsigned int e = (__float_as_uint(ratio) >> 23) & 0xffu;
    e = e < 1u ? 1u : (e > 254u ? 254u : e);
    return __uint_as_float(e << 23);
}

// f rounded to E4M3 (e5m2 = 0) or E5M2 (e5m2 = 1): nearest-even, saturating to the largest
// finite value, NaN kept (the float8 crate's `convert_to_fp8` with SatFinite, on the exact
// double of f).
__device__ __forceinline__ unsigned char fp8_encode(float f, int e5m2) {
    unsigned long long x = (unsigned long long)__double_as_longlong((double)f);
    unsigned int maxnorm = e5m2 ? 0x7Bu : 0x7Eu;
    unsigned int mmask = e5m2 ? 0x3u : 0x7u;
    unsigned int bias = e5m2 ? 15u : 7u;
    unsigned int sigbits = e5m2 ? 3u : 4u;
    unsigned long long mindenorm_o2 = e5m2 ? 0x3EE0000000000000ull : 0x3F50000000000000ull;
    unsigned long long overflow = e5m2 ? 0x40EE000000000000ull - 1ull : 0x407D000000000000ull;
    unsigned long long minnorm = e5m2 ? 0x3F10000000000000ull : 0x3F90000000000000ull;
    unsigned long long half_ulp = 1ull << (53u - sigbits - 1u);
    unsigned int sign = (unsigned int)((x >> 63) << 7);
    unsigned char ex = (unsigned char)((unsigned int)((x >> 52) & 0x7FFull) - 1023u + bias);
    unsigned char mant = (unsigned char)((x >> (53u - sigbits)) & mmask);
    unsigned long long absx = x & 0x7FFFFFFFFFFFFFFFull;
    unsigned char res;
    if (absx <= mindenorm_o2) {
        res = 0;
    } else if (absx > 0x7FF0000000000000ull) {
        res = e5m2 ? (unsigned char)(0x7Eu | mant) : (unsigned char)0x7Fu;
    } else if (absx > overflow) {
        res = (unsigned char)maxnorm;
    } else if (absx >= minnorm) {
        res = (unsigned char)(((unsigned int)ex << (sigbits - 1u)) | mant);
        unsigned long long round = x & ((half_ulp << 1) - 1ull);
        if (round > half_ulp || (round == half_ulp && (mant & 1u))) res = (unsigned char)(res + 1u);
    } else {
        unsigned char shift = (unsigned char)(1u - (unsigned int)ex);
        unsigned char m = (unsigned char)(mant | (1u << (sigbits - 1u)));
        res = (unsigned char)(m >> shift);
        unsigned long long round = (x | (1ull << 52)) & ((half_ulp << (shift + 1u)) - 1ull);
        unsigned long long tie = half_ulp << shift;
        if (round > tie || (round == tie && (res & 1u))) res = (unsigned char)(res + 1u);
    }
    return (unsigned char)(res | sign);
}

#define FP8_THREADS 256
#define FP8_PIECE (FP8_THREADS * 16)

// amax[g] = max(amax[g], largest finite |element| of group g); amax holds the f32 bit patterns
// (non-negative floats order as their bits) and starts zeroed. Work item w is piece w % pieces
// (FP8_PIECE elements) of group w / pieces; a block reduces one item and adds it with one
// atomic. Launch with FP8_THREADS threads.
extern "C" __global__ void fp8_amax(Fv x, long long rows, long long cols, long long rb, long long cb,
                                    long long gpr, long long pieces, long long items,
                                    unsigned int* amax) {
    __shared__ unsigned int best[FP8_THREADS];
    for (long long w = blockIdx.x; w < items; w += gridDim.x) {
        long long g = w / pieces, piece = w % pieces;
        long long r0 = (g / gpr) * rb, c0 = (g % gpr) * cb;
        long long h = rows - r0 < rb ? rows - r0 : rb;
        long long wd = cols - c0 < cb ? cols - c0 : cb;
        long long n = h * wd;
        long long end = (piece + 1) * FP8_PIECE < n ? (piece + 1) * FP8_PIECE : n;
        unsigned int m = 0;
        for (long long e = piece * FP8_PIECE + threadIdx.x; e < end; e += FP8_THREADS) {
            float v = fabsf(ld(x, (r0 + e / wd) * cols + c0 + e % wd));
            // NaN and infinities are not finite: they never raise the amax.
            if (v <= 3.402823466e38f) m = max(m, __float_as_uint(v));
        }
        best[threadIdx.x] = m;
        __syncthreads();
        for (int s = FP8_THREADS / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) best[threadIdx.x] = max(best[threadIdx.x], best[threadIdx.x + s]);
            __syncthreads();
        }
        if (threadIdx.x == 0 && best[0] > 0u) atomicMax(amax + g, best[0]);
        __syncthreads();
    }
}

// q[l * ldq + kk] = fp8(x(r, c) * s(group(r, c))) for kk < k, 0 in the padding, where (r, c) =
// (l, kk) (along_rows = 0) or (kk, l) (along_rows = 1). maxv: the format's largest finite value.
extern "C" __global__ void fp8_quantize(Fv x, long long cols, int along_rows, long long rb, long long cb,
                                        long long gpr, const unsigned int* amax, float maxv, int e5m2,
                                        unsigned char* q, long long lines, long long k, long long ldq) {
    GRID_STRIDE(i, lines * ldq) {
        long long l = i / ldq, kk = i % ldq;
        if (kk >= k) {
            q[i] = 0;
            continue;
        }
        long long r = along_rows ? kk : l, c = along_rows ? l : kk;
        float v = ld(x, r * cols + c);
        if (!isfinite(v)) {
            q[i] = 0x7Fu;
            continue;
        }
        float s = fp8_scale(amax[fp8_group(r, c, rb, cb, gpr)], maxv);
        q[i] = fp8_encode(v * s, e5m2);
    }
}

// The dequantization factors 1 / s (exact: s is a power of two) in cuBLASLt's layout for the
// scale mode `layout` (Fp8ScaleLayout in compiler/src/memplan/scratch.rs):
// 0 scalar; 1 one per line (OUTER_VEC_32F); 2 1 x block tiles along K, factor (l, kb) at
// l + kb * lines (VEC128_32F); 3 block x block squares, factor (lb, kb) at kb + lb * kb4 with
// kb4 = ceil(k / block) rounded up to 4, the padding 1 (BLK128x128_32F). n: factors written.
extern "C" __global__ void fp8_scales(const unsigned int* amax, float maxv, int along_rows, long long rb,
                                      long long cb, long long gpr, int layout, long long block,
                                      long long lines, long long k, float* out, long long n) {
    GRID_STRIDE(i, n) {
        long long l = 0, kk = 0;
        if (layout == 1) {
            l = i;
        } else if (layout == 2) {
            l = i % lines;
            kk = (i / lines) * block;
        } else if (layout == 3) {
            long long kb4 = (k + block - 1) / block;
            kb4 = (kb4 + 3) / 4 * 4;
            l = (i / kb4) * block;
            kk = (i % kb4) * block;
        }
        if (l >= lines || kk >= k) {
            out[i] = 1.0f;
            continue;
        }
        long long r = along_rows ? kk : l, c = along_rows ? l : kk;
        out[i] = 1.0f / fp8_scale(amax[fp8_group(r, c, rb, cb, gpr)], maxv);
    }
}
