// FP8 GEMM operands (runtime/src/cuda/fp8.rs): the amax of each scale group, the quantized
// operand in the K-major layout cuBLASLt's FP8 GEMM reads, and the dequantization factors in the
// layout of its scale mode. The numbers are parc_compiler::ir::fp8's, as the CPU backend
// emulates them (runtime/src/cpu/fp8.rs), bit for bit:
// - the scale of a group is 2^floor(log2(max / amax)) read from the exponent bits of the f32
//   quotient (1 for a group of zeros), so scaling is exact;
// - fp8(v * s) rounds to nearest-even and saturates to the largest finite value, the float8
//   crate's conversion (NVIDIA's __nv_cvt_double_to_fp8 with __NV_SATFINITE): the conversion
//   instruction (cvt.rn.satfinite) on sm_89 and later, written out (fp8_encode) for compute_80,
//   which has none (NVRTC compiles these kernels without cuda_fp8.h);
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

// m max |v| as f32 bits (non-negative floats order as their bits), where v is finite: NaN and
// infinities never raise an amax.
__device__ __forceinline__ unsigned int fp8_finite_max1(unsigned int m, float v) {
    float a = fabsf(v);
    return a <= 3.402823466e38f ? max(m, __float_as_uint(a)) : m;
}

// fp8_finite_max1 over eight values.
__device__ __forceinline__ unsigned int fp8_finite_max(unsigned int m, const float (&v)[8]) {
#pragma unroll
    for (int e = 0; e < 8; e++) m = fp8_finite_max1(m, v[e]);
    return m;
}

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
            m = fp8_finite_max1(m, ld(x, (r0 + e / wd) * cols + c0 + e % wd));
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

// amax[g] = max(amax[g], largest finite |element| of group g), as fp8_amax, where every group
// holds whole 8-vectors of its rows (cb % 8 == 0: COLUMNS false) or is one column (cb == 1:
// COLUMNS true); cols % 8 == 0 and x is vec_ok. A work item is one 8-vector column slot `v`
// (x: blockIdx.x * blockDim.x + threadIdx.x < cols / 8) over one run of at most `span` rows
// inside a row group (y: `runs` runs a row group, of `total` runs; where the last row group is
// clipped its later runs are empty). Its thread reads the run row by row, a warp 32
// consecutive vectors of a row. For row groups each lane keeps one maximum, and the lanes
// holding the same group (__match_any_sync) reduce it and add it with one atomic; for column
// groups each lane adds its 8 columns' maxima. The y loop is uniform over a block, so a warp's
// lanes converge at the reduction. Launch with FP8_THREADS threads in x.
template <bool COLUMNS>
__device__ __forceinline__ void fp8_amax_vec(Fv x, long long rows, long long cols, long long rb, unsigned int cb,
                                             unsigned int gpr, unsigned int span, unsigned int runs,
                                             unsigned int total, unsigned int* amax) {
    const unsigned int vpr = (unsigned int)(cols / 8);
    const unsigned int v = blockIdx.x * blockDim.x + threadIdx.x;
    const bool active = v < vpr;
    for (unsigned int run = blockIdx.y; run < total; run += gridDim.y) {
        const unsigned int gr = run / runs;
        const long long group_end = (gr + 1) * rb < rows ? (gr + 1) * rb : rows;
        const long long r0 = gr * rb + (long long)(run - gr * runs) * span;
        const long long r1 = r0 + span < group_end ? r0 + span : group_end;
        unsigned int m[COLUMNS ? 8 : 1] = {};
        for (long long r = r0; active && r < r1; r++) {
            F8 f = ld8(x, r * vpr + v);
            if (COLUMNS) {
#pragma unroll
                for (int e = 0; e < 8; e++) m[e] = fp8_finite_max1(m[e], f.v[e]);
            } else {
                m[0] = fp8_finite_max(m[0], f.v);
            }
        }
        const unsigned long long g0 = (unsigned long long)gr * gpr;
        if (COLUMNS) {
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (active && m[e] > 0u) atomicMax(amax + g0 + 8 * v + e, m[e]);
            continue;
        }
        const unsigned long long g = g0 + 8 * v / cb;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        const unsigned int lanes = __ballot_sync(0xffffffffu, active);
        if (active) {
            const unsigned int peers = __match_any_sync(lanes, g);
            const unsigned int best = __reduce_max_sync(peers, m[0]);
            if ((threadIdx.x & 31) == __ffs(peers) - 1 && best > 0u) atomicMax(amax + g, best);
        }
#else
        if (active && m[0] > 0u) atomicMax(amax + g, m[0]);
#endif
    }
}

extern "C" __global__ void fp8_amax_rows8(Fv x, long long rows, long long cols, long long rb, unsigned int cb,
                                          unsigned int gpr, unsigned int span, unsigned int runs,
                                          unsigned int total, unsigned int* amax) {
    fp8_amax_vec<false>(x, rows, cols, rb, cb, gpr, span, runs, total, amax);
}

extern "C" __global__ void fp8_amax_cols8(Fv x, long long rows, long long cols, long long rb, unsigned int cb,
                                          unsigned int gpr, unsigned int span, unsigned int runs,
                                          unsigned int total, unsigned int* amax) {
    fp8_amax_vec<true>(x, rows, cols, rb, cb, gpr, span, runs, total, amax);
}

// The block's largest finite magnitude (m, each thread's, as f32 bits) max-added into *out
// with one atomic a block, and none where *out already holds at least as much (most blocks,
// once one has written the operand's amax): fp8_amax_one's, and delayed scaling's record taken
// in a quantize pass (runtime/src/cuda/fp8_record.rs). Every thread of the block (FP8_THREADS
// of them) calls it.
__device__ __forceinline__ void fp8_block_max_into(unsigned int* out, unsigned int m) {
    __shared__ unsigned int best[FP8_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) best[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < FP8_THREADS / 32 ? best[threadIdx.x] : 0u;
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (threadIdx.x == 0 && m > *(volatile unsigned int*)out) atomicMax(out, m);
    }
}

// amax[0] = max(amax[0], largest finite |x[i]|, i < n): fp8_amax for an operand with one scale
// group (tensorwise), reading 16-byte vectors where x is aligned (the tail and an unaligned x
// one element at a time). Each thread keeps its running maximum over its grid-stride elements;
// warps then blocks reduce it, and a block adds one atomic. Launch with FP8_THREADS threads.
extern "C" __global__ void fp8_amax_one(Fv x, long long n, unsigned int* amax) {
    unsigned int m = 0;
    long long n8 = vec_ok(x) ? n / 8 : 0;
    GRID_STRIDE(j, n8) {
        F8 f = ld8(x, j);
        m = fp8_finite_max(m, f.v);
    }
    GRID_STRIDE(t, n - 8 * n8) m = fp8_finite_max1(m, ld(x, 8 * n8 + t));
    fp8_block_max_into(amax, m);
}

// Two floats as FP8 (lo in the low byte): the conversion instruction on GPUs that have one
// (sm_89 and later: round to nearest-even, saturating to the largest finite value, which is
// fp8_encode's rounding), else fp8_encode. Callers replace non-finite inputs themselves.
__device__ __forceinline__ unsigned int fp8_pair(float lo, float hi, int e5m2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    if (e5m2) asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (unsigned int)fp8_encode(lo, e5m2) | ((unsigned int)fp8_encode(hi, e5m2) << 8);
#endif
}

// How a quantize kernel finds an element's scale: the one scale of an operand with one group
// (`single`: tensorwise, read once), else that of the rb x cb group of element (r, c) (32-bit
// arithmetic: an operand's rows and columns each fit).
struct Fp8Groups {
    long long rb, cb, gpr;
    const unsigned int* amax;
    float maxv, single_scale;
    bool single;
};

__device__ __forceinline__ Fp8Groups fp8_groups(long long rb, long long cb, long long gpr, int single, const unsigned int* amax, float maxv) {
    Fp8Groups g;
    g.rb = rb;
    g.cb = cb;
    g.gpr = gpr;
    g.amax = amax;
    g.maxv = maxv;
    g.single = single != 0;
    g.single_scale = g.single ? fp8_scale(amax[0], maxv) : 1.0f;
    return g;
}

__device__ __forceinline__ float fp8_scale_at(const Fp8Groups& g, long long r, long long c) {
    if (g.single) return g.single_scale;
    long long group = (long long)((unsigned)r / (unsigned)g.rb) * g.gpr + (unsigned)c / (unsigned)g.cb;
    return fp8_scale(g.amax[group], g.maxv);
}

// Eight values v[e] (scales s[e]) as eight FP8 bytes, v[e] past `valid` written as 0 (the K
// padding) and a non-finite v[e] as FP8 NaN (0x7f).
__device__ __forceinline__ uint2 fp8_pack8(const float (&v)[8], const float (&s)[8], int valid, int e5m2) {
    unsigned int w[2] = {0u, 0u};
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            int i = 4 * h + e;
            unsigned int pair = fp8_pair(v[i] * s[i], v[i + 1] * s[i + 1], e5m2);
            unsigned int lo = i < valid ? (isfinite(v[i]) ? (pair & 0xffu) : 0x7fu) : 0u;
            unsigned int hi = i + 1 < valid ? (isfinite(v[i + 1]) ? (pair >> 8) : 0x7fu) : 0u;
            w[h] |= (lo | (hi << 8)) << (8 * e);
        }
    }
    return make_uint2(w[0], w[1]);
}

#define FP8_LINE_VECS 256

// K along the columns (line l = row l of x, element kk = column kk; cols = k):
// q[l * ldq + kk] = fp8(x(l, kk) · s), 0 for k <= kk < ldq (ldq a multiple of 8, q 8-byte
// aligned). Thread t of block (bx, by) writes the 8 bytes kk = 8 (bx · 256 + t) .. + 8 of lines
// by, by + gridDim.y, …, reading 16-byte vectors where x is aligned and k a multiple of 8. The
// scale groups: rb x cb, gpr a row, `single` where there is one; maxv: the format's largest
// finite value. A non-null `record` takes the operand's largest finite magnitude
// (fp8_block_max_into). Launch with FP8_LINE_VECS threads.
extern "C" __global__ void fp8_quantize_lines(Fv x, long long lines, long long k, long long ldq, long long rb,
                                              long long cb, long long gpr, int single, const unsigned int* amax,
                                              float maxv, int e5m2, unsigned char* q, unsigned int* record) {
    Fp8Groups g = fp8_groups(rb, cb, gpr, single, amax, maxv);
    long long kk = 8 * (blockIdx.x * (long long)FP8_LINE_VECS + threadIdx.x);
    bool vec = vec_ok(x) && k % 8 == 0;
    int valid = kk >= k ? 0 : (k - kk < 8 ? (int)(k - kk) : 8);
    unsigned int m = 0;
    // Threads past the padded line take no line (but reach the record's block reduction).
    for (long long l = kk < ldq ? blockIdx.y : lines; l < lines; l += gridDim.y) {
        float v[8], s[8];
        if (vec && valid == 8) {
            F8 f = ld8(x, (l * k + kk) / 8);
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = f.v[e];
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = e < valid ? ld(x, l * k + kk + e) : 0.0f;
        }
#pragma unroll
        for (int e = 0; e < 8; e++) s[e] = e < valid ? fp8_scale_at(g, l, kk + e) : 1.0f;
        ((uint2*)q)[(l * ldq + kk) / 8] = fp8_pack8(v, s, valid, e5m2);
        if (record) m = fp8_finite_max(m, v);
    }
    if (record) fp8_block_max_into(record, m);
}

#define FP8_TILE 64

// K along the rows (line l = column l of x, element kk = row kk; rows = k, lines = cols):
// q[l * ldq + kk] = fp8(x(kk, l) · s), 0 for k <= kk < ldq (ldq a multiple of 8, q 8-byte
// aligned): x transposed through shared memory, one FP8_TILE x FP8_TILE tile (rows kk0 + …,
// columns l0 + …) a block at a time: read along x's rows (16-byte vectors where x is aligned
// and its columns a multiple of 8), written along q's lines, 8 bytes a thread. A non-null
// `record` takes the operand's largest finite magnitude (fp8_block_max_into). Launch with 256
// threads.
extern "C" __global__ void fp8_quantize_cols(Fv x, long long lines, long long k, long long ldq, long long rb,
                                             long long cb, long long gpr, int single, const unsigned int* amax,
                                             float maxv, int e5m2, unsigned char* q, unsigned int* record) {
    Fp8Groups g = fp8_groups(rb, cb, gpr, single, amax, maxv);
    // [kk][l], padded by one so the transposed reads spread over the banks.
    __shared__ float tile[FP8_TILE][FP8_TILE + 1];
    bool vec = vec_ok(x) && lines % 8 == 0;
    int t = threadIdx.x, lane8 = t & 7, row8 = t >> 3;  // 8 threads a tile row, 32 rows a pass
    long long l0 = blockIdx.x * (long long)FP8_TILE;
    unsigned int m = 0;
    long long kk_tiles = (ldq + FP8_TILE - 1) / FP8_TILE;
    for (long long ty = blockIdx.y; ty < kk_tiles; ty += gridDim.y) {
        long long kk0 = ty * FP8_TILE;
        __syncthreads();
        for (int r = row8; r < FP8_TILE; r += 32) {
            long long kk = kk0 + r, c = l0 + 8 * lane8;
            float v[8];
            if (kk < k && vec && c + 8 <= lines) {
                F8 f = ld8(x, (kk * lines + c) / 8);
#pragma unroll
                for (int e = 0; e < 8; e++) v[e] = f.v[e];
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) v[e] = kk < k && c + e < lines ? ld(x, kk * lines + c + e) : 0.0f;
            }
#pragma unroll
            for (int e = 0; e < 8; e++) tile[r][8 * lane8 + e] = v[e];
            if (record) m = fp8_finite_max(m, v);
        }
        __syncthreads();
        // Writes: 8 threads a line (8 bytes each: the tile's 64 rows), 32 lines a pass.
        for (int li = row8; li < FP8_TILE; li += 32) {
            long long l = l0 + li, kk = kk0 + 8 * lane8;
            if (l >= lines || kk >= ldq) continue;
            int valid = kk >= k ? 0 : (k - kk < 8 ? (int)(k - kk) : 8);
            float v[8], s[8];
#pragma unroll
            for (int e = 0; e < 8; e++) {
                v[e] = tile[8 * lane8 + e][li];
                s[e] = e < valid ? fp8_scale_at(g, kk + e, l) : 1.0f;
            }
            ((uint2*)q)[(l * ldq + kk) / 8] = fp8_pack8(v, s, valid, e5m2);
        }
    }
    if (record) fp8_block_max_into(record, m);
}

#define FP8_DUAL_COLS 128
#define FP8_DUAL_THREADS 256
// Rows of a tile one pass of the block reads: 16 threads (8 elements each) a row.
#define FP8_DUAL_PASS (FP8_DUAL_THREADS / (FP8_DUAL_COLS / 8))
// Passes a tile takes: 4 for an f32 x (64-row tiles), 8 for bf16 (128 rows), so that each
// thread has 128 bytes of x in flight (eight 16-byte loads) whichever it reads.
#define FP8_DUAL_PASSES(bf16) ((bf16) ? 8 : 4)
#define FP8_DUAL_MAX_ROWS (FP8_DUAL_PASSES(true) * FP8_DUAL_PASS)

// The word of shared tile row `row` holding word `word` of its bytes, where each transposing
// thread reads `span` consecutive rows: XOR-swizzled by the row's span (a multiple of 4, so the
// two words of an 8-byte store stay together), so that the transposed reads of 8 spans x 4
// column groups hit 32 different banks.
template <int span>
__device__ __forceinline__ int fp8_dual_word(int row, int word) {
    return word ^ (((row / span) & 7) << 2);
}

// Column j (0..3) of the 4 x 4 bytes a, b, c, d (rows; byte j of each is column j) as one
// word, row a in the low byte.
__device__ __forceinline__ unsigned int fp8_column4(unsigned int a, unsigned int b, unsigned int c,
                                                    unsigned int d, int j) {
    // Bytes j of a and b, then of c and d (selector nibble n picks byte n of the pair).
    unsigned int sel = (unsigned int)j | ((unsigned int)(j + 4) << 4);
    unsigned int ab = __byte_perm(a, b, sel), cd = __byte_perm(c, d, sel);
    return __byte_perm(ab, cd, 0x5410u);
}

// The raw bits of x's elements i .. i + n (n <= 8; the rest zero) in `raw`: one 16-byte
// vector for bf16, two for f32; a 16-byte load each where n is 8 and `vec` (x aligned, rows
// whole vectors), else element by element. Widened later (fp8_dual_widen), so that a thread's
// loads are all issued before any of them is waited for.
template <bool bf16>
__device__ __forceinline__ void fp8_dual_load(Fv x, long long i, int n, bool vec, uint4 (&raw)[bf16 ? 1 : 2]) {
    constexpr int vecs = bf16 ? 1 : 2;
    if (n == 8 && vec) {
        const uint4* p = (const uint4*)x.p + i / (8 / vecs);
#pragma unroll
        for (int k = 0; k < vecs; k++) raw[k] = p[k];
        return;
    }
    unsigned int w[4 * vecs] = {};
#pragma unroll
    for (int e = 0; e < 8; e++) {
        if (e >= n) break;
        if (bf16) w[e / 2] |= (unsigned int)((const unsigned short*)x.p)[i + e] << (16 * (e & 1));
        else w[e] = ((const unsigned int*)x.p)[i + e];
    }
#pragma unroll
    for (int k = 0; k < vecs; k++) raw[k] = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
}

// The eight f32 values of fp8_dual_load's bits (bf16 widens exactly).
template <bool bf16>
__device__ __forceinline__ void fp8_dual_widen(const uint4 (&raw)[bf16 ? 1 : 2], float (&v)[8]) {
    constexpr int vecs = bf16 ? 1 : 2;
    unsigned int w[4 * vecs];
#pragma unroll
    for (int k = 0; k < vecs; k++) {
        w[4 * k] = raw[k].x;
        w[4 * k + 1] = raw[k].y;
        w[4 * k + 2] = raw[k].z;
        w[4 * k + 3] = raw[k].w;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) v[e] = __uint_as_float(bf16 ? (e & 1 ? w[e / 2] & 0xffff0000u : w[e / 2] << 16) : w[e]);
}

// The FP8 bytes of a tile in shared memory (`span` * 8 rows by FP8_DUAL_COLS columns, each row's
// words swizzled by fp8_dual_word), rows r0.. and columns c0.. of a [rows, cols] tensor, stored
// transposed into qt [cols, rows]: each thread reads 4 columns x `span` rows of it (4-byte
// words), transposes them with byte permutes and writes them to 4 rows of qt (16-byte stores
// where `qt16`: qt 16-byte aligned and rows a multiple of 16; else 8-byte stores where `qt8`;
// else, at the edges, a byte at a time). Every thread of the block (FP8_DUAL_THREADS) calls it
// after a barrier that follows the tile's writes.
template <int span>
__device__ __forceinline__ void fp8_tile_store_t(unsigned int (*tile)[FP8_DUAL_COLS / 4], unsigned char* qt,
                                                 long long rows, long long cols, long long r0, long long c0,
                                                 bool qt8, bool qt16) {
    int tk = threadIdx.x & 7, tg = threadIdx.x >> 3;
    unsigned int w[span];
#pragma unroll
    for (int e = 0; e < span; e++) w[e] = tile[span * tk + e][fp8_dual_word<span>(span * tk + e, tg)];
    long long r = r0 + span * tk;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        long long cj = c0 + 4 * tg + j;
        if (cj >= cols || r >= rows) continue;
        unsigned int col[span / 4];
#pragma unroll
        for (int h = 0; h < span / 4; h++) col[h] = fp8_column4(w[4 * h], w[4 * h + 1], w[4 * h + 2], w[4 * h + 3], j);
        unsigned char* line = qt + cj * rows + r;
        if constexpr (span == 16) {
            if (qt16 && r + 16 <= rows) {
                *(uint4*)line = make_uint4(col[0], col[1], col[2], col[3]);
                continue;
            }
        }
#pragma unroll
        for (int h = 0; h < span / 8; h++) {
            if (r + 8 * h >= rows) break;
            uint2 b = make_uint2(col[2 * h], col[2 * h + 1]);
            if (qt8 && r + 8 * h + 8 <= rows) {
                *(uint2*)(line + 8 * h) = b;
            } else {
                for (int e = 0; e < 8 && r + 8 * h + e < rows; e++) line[8 * h + e] = (unsigned char)((e < 4 ? b.x : b.y) >> (8 * (e & 3)));
            }
        }
    }
}

// fp8_quantize_dual's tiles for an x of one type: FP8_DUAL_PASSES(bf16) x 16 rows by
// FP8_DUAL_COLS columns, one tile per block where the grid covers them (the host's launch),
// else grid-stride. Returns the thread's largest finite magnitude of x where `record`.
template <bool bf16>
__device__ __forceinline__ unsigned int fp8_dual_tiles(Fv x, long long rows, long long cols, float s, int e5m2,
                                                       unsigned char* q, unsigned char* qt, bool record,
                                                       unsigned int (*tile)[FP8_DUAL_COLS / 4]) {
    constexpr int passes = FP8_DUAL_PASSES(bf16), vecs = bf16 ? 1 : 2;
    constexpr int tile_rows = passes * FP8_DUAL_PASS;
    // Transposing: each thread takes `span` rows (8 or 16 bytes of each qt line it writes).
    constexpr int span = tile_rows / 8;
    float s8[8] = {s, s, s, s, s, s, s, s};
    bool vec = vec_ok(x) && cols % 8 == 0;
    bool q8 = ((unsigned long long)q & 7ull) == 0 && cols % 8 == 0;
    bool qt8 = ((unsigned long long)qt & 7ull) == 0 && rows % 8 == 0;
    bool qt16 = ((unsigned long long)qt & 15ull) == 0 && rows % 16 == 0;
    long long col_tiles = (cols + FP8_DUAL_COLS - 1) / FP8_DUAL_COLS;
    long long tiles = (rows + tile_rows - 1) / tile_rows * col_tiles;
    int t = threadIdx.x;
    // Reading: vector `rv` of tile rows `rr`, rr + FP8_DUAL_PASS, ...
    int rv = t % (FP8_DUAL_COLS / 8), rr = t / (FP8_DUAL_COLS / 8);
    unsigned int m = 0;
    for (long long i = blockIdx.x; i < tiles; i += gridDim.x) {
        long long r0 = i / col_tiles * tile_rows, c0 = i % col_tiles * FP8_DUAL_COLS;
        long long c = c0 + 8 * rv;
        int valid = c >= cols ? 0 : (cols - c < 8 ? (int)(cols - c) : 8);
        uint4 raw[passes][vecs];
#pragma unroll
        for (int p = 0; p < passes; p++) {
            long long r = r0 + rr + p * FP8_DUAL_PASS;
            fp8_dual_load<bf16>(x, r * cols + c, r < rows ? valid : 0, vec, raw[p]);
        }
        // The previous tile's transposed reads are done before its bytes are overwritten.
        if (qt) __syncthreads();
#pragma unroll
        for (int p = 0; p < passes; p++) {
            int row = rr + p * FP8_DUAL_PASS;
            long long r = r0 + row;
            float v[8];
            fp8_dual_widen<bf16>(raw[p], v);
            uint2 b = fp8_pack8(v, s8, 8, e5m2);
            if (record) m = fp8_finite_max(m, v);
            if (q && r < rows) {
                if (q8 && valid == 8) {
                    *(uint2*)(q + r * cols + c) = b;
                } else {
                    for (int e = 0; e < valid; e++) q[r * cols + c + e] = (unsigned char)((e < 4 ? b.x : b.y) >> (8 * (e & 3)));
                }
            }
            if (qt) *(uint2*)&tile[row][fp8_dual_word<span>(row, 2 * rv)] = b;
        }
        if (!qt) continue;
        __syncthreads();
        fp8_tile_store_t<span>(tile, qt, rows, cols, r0, c0, qt8, qt16);
    }
    return m;
}

// Op::Fp8Quantize (parc_compiler::ir::fp8): x [rows, cols] quantized with the one tensorwise
// scale of amax[0] (f32 bits; fp8_scale) into, each where its pointer is not null,
// q [rows, cols] (K along x's columns) and qt [cols, rows] (its transpose: K along x's rows),
// fp8(x · s) as fp8_quantize_lines and fp8_quantize_cols write it (fp8_pack8: nearest-even,
// saturating, a non-finite element as NaN, 0x7f). x is read once: each block takes tiles of
// FP8_DUAL_PASSES x 16 rows (64 for f32, 128 for bf16) by FP8_DUAL_COLS columns, one a block
// as the host launches it (grid-stride beyond). Its threads first load all their rows of the
// tile, 8 elements of each (16-byte vectors where x is aligned and cols a multiple of 8; kept
// raw so that all the loads are in flight at once), then convert each element once, write it
// to q (8-byte stores where q is 8-byte aligned and cols a multiple of 8) and into a shared tile
// of FP8 bytes; after a barrier each thread reads 4 columns x 8 (f32) or 16 (bf16) rows of it
// (4-byte words), transposes them with byte permutes and writes them to 4 rows of qt (16-byte
// stores where qt is 16-byte aligned and rows a multiple of 16, else 8-byte stores where qt is
// aligned and rows a multiple of 8). Elsewhere (edges, unaligned shapes) bytes are written one
// at a time. A non-null `record` takes x's largest finite magnitude (fp8_block_max_into).
// Launch with FP8_DUAL_THREADS threads. The kernel is bound by the bytes of x in flight, not
// by instructions: the bound of 3 blocks an SM (80 registers) keeps 768 threads' 128 bytes
// each in flight, where an f32 x ran at copy bandwidth before bf16 tiles grew to match it.
extern "C" __global__ void __launch_bounds__(FP8_DUAL_THREADS, 3) fp8_quantize_dual(
    Fv x, long long rows, long long cols, const unsigned int* amax, float maxv, int e5m2, unsigned char* q,
    unsigned char* qt, unsigned int* record) {
    __shared__ __align__(16) unsigned int tile[FP8_DUAL_MAX_ROWS][FP8_DUAL_COLS / 4];
    float s = fp8_scale(amax[0], maxv);
    unsigned int m = x.bf16 ? fp8_dual_tiles<true>(x, rows, cols, s, e5m2, q, qt, record != nullptr, tile)
                            : fp8_dual_tiles<false>(x, rows, cols, s, e5m2, q, qt, record != nullptr, tile);
    if (record) fp8_block_max_into(record, m);
}

// ---------------------------------------------------------------- SwiGLU epilogues into FP8
// A GEMM's SwiGLU epilogue making the FP8 quantizations of what it writes in the same pass
// (parc_compiler::ir::swiglu_runs; cuda/swiglu_fp8.rs): each element is computed as swiglu_fwd
// and swiglu_bwd compute it, stored in its tensor's type, and the stored value quantized as
// fp8_quantize_dual quantizes it (the same bytes), its largest finite magnitude recorded where
// a record rides on the quantization. Tiles of SWIGLU_FP8_ROWS rows by FP8_DUAL_COLS columns,
// one a block as the host launches them; every input and output of one type (`bf16`), cols a
// multiple of 8 and every tensor 16-byte aligned (the host checks, else runs them apart).
#define SWIGLU_FP8_PASSES 4
#define SWIGLU_FP8_ROWS (SWIGLU_FP8_PASSES * FP8_DUAL_PASS)

// One output's quantization: its layouts (null: not written), scale, format and record.
struct SwigluFp8Out {
    unsigned char* q;
    unsigned char* qt;
    unsigned int* record;
    float s;
    int e5m2;
};

__device__ __forceinline__ SwigluFp8Out swiglu_fp8_out(const unsigned int* amax, float maxv, int e5m2,
                                                       unsigned char* q, unsigned char* qt, unsigned int* record) {
    SwigluFp8Out o;
    o.q = q;
    o.qt = qt;
    o.record = record;
    o.s = amax ? fp8_scale(amax[0], maxv) : 1.0f;
    o.e5m2 = e5m2;
    return o;
}

// The tiles of one launch: `ins` inputs x (forward: gate, up; backward: dy, gate, up), `outs`
// outputs y (forward: a; backward: dgate, dup; dgate may be dy itself: each thread reads its
// elements before it writes them; a null pointer: quantized, not stored), their quantizations
// d. Returns each output's thread maximum.
template <bool bf16, bool bwd>
__device__ __forceinline__ void swiglu_fp8_tiles(const Fv (&x)[3], const Fv (&y)[2], long long rows, long long cols,
                                                 const SwigluFp8Out (&d)[2], unsigned int (&m)[2],
                                                 unsigned int (*tiles)[SWIGLU_FP8_ROWS][FP8_DUAL_COLS / 4]) {
    constexpr int passes = SWIGLU_FP8_PASSES, vecs = bf16 ? 1 : 2, ins = bwd ? 3 : 2, outs = bwd ? 2 : 1;
    constexpr int span = SWIGLU_FP8_ROWS / 8;
    bool any_qt = false;
#pragma unroll
    for (int o = 0; o < outs; o++) any_qt |= d[o].qt != nullptr;
    long long col_tiles = (cols + FP8_DUAL_COLS - 1) / FP8_DUAL_COLS;
    long long count = (rows + SWIGLU_FP8_ROWS - 1) / SWIGLU_FP8_ROWS * col_tiles;
    int t = threadIdx.x;
    int rv = t % (FP8_DUAL_COLS / 8), rr = t / (FP8_DUAL_COLS / 8);
    for (long long i = blockIdx.x; i < count; i += gridDim.x) {
        long long r0 = i / col_tiles * SWIGLU_FP8_ROWS, c0 = i % col_tiles * FP8_DUAL_COLS;
        long long c = c0 + 8 * rv;
        int valid = c < cols ? 8 : 0;
        // The previous tile's transposed reads are done before its bytes are overwritten.
        if (any_qt) __syncthreads();
#pragma unroll
        for (int p = 0; p < passes; p++) {
            int row = rr + p * FP8_DUAL_PASS;
            long long r = r0 + row;
            // Each pass loads its own rows: 64-71 registers, 3 blocks an SM, whose warps hide the
            // arithmetic (all of a tile's loads issued first took 108-128 registers, 2 blocks,
            // and ran 1% slower end to end: bench/RESULTS.md, session 48).
            uint4 raw[ins][vecs];
#pragma unroll
            for (int k = 0; k < ins; k++) fp8_dual_load<bf16>(x[k], r * cols + c, r < rows ? valid : 0, true, raw[k]);
            float a[ins][8], v[outs][8];
#pragma unroll
            for (int k = 0; k < ins; k++) fp8_dual_widen<bf16>(raw[k], a[k]);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                if constexpr (bwd) {
                    swiglu_bwd_element(a[0][e], a[1][e], a[2][e], v[0][e], v[outs - 1][e]);
                } else {
                    v[0][e] = a[0][e] * sigmoid_f(a[0][e]) * a[1][e];
                }
            }
#pragma unroll
            for (int o = 0; o < outs; o++) {
                F8 stored;
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    stored.v[e] = bf16 ? widen_bf16(round_bf16(v[o][e])) : v[o][e];
                    v[o][e] = stored.v[e];
                }
                if (r < rows && valid && y[o].p) st8(y[o], (r * cols + c) / 8, stored);
                if (!d[o].q && !d[o].qt) continue;
                float s8[8] = {d[o].s, d[o].s, d[o].s, d[o].s, d[o].s, d[o].s, d[o].s, d[o].s};
                uint2 b = fp8_pack8(v[o], s8, 8, d[o].e5m2);
                if (d[o].record && r < rows) m[o] = fp8_finite_max(m[o], v[o]);
                if (d[o].q && r < rows && valid) *(uint2*)(d[o].q + r * cols + c) = b;
                if (d[o].qt) *(uint2*)&tiles[o][row][fp8_dual_word<span>(row, 2 * rv)] = b;
            }
        }
        if (!any_qt) continue;
        __syncthreads();
        bool qt8 = rows % 8 == 0;
#pragma unroll
        for (int o = 0; o < outs; o++) {
            if (d[o].qt) fp8_tile_store_t<span>(tiles[o], d[o].qt, rows, cols, r0, c0, qt8 && ((unsigned long long)d[o].qt & 7ull) == 0, false);
        }
    }
}

// Each output's record: its block maximum max-added into the step amax (fp8_block_max_into,
// whose shared slots are free again after the barrier).
template <int outs>
__device__ __forceinline__ void swiglu_fp8_records(const SwigluFp8Out (&d)[2], const unsigned int (&m)[2]) {
#pragma unroll
    for (int o = 0; o < outs; o++) {
        if (!d[o].record) continue;
        __syncthreads();
        fp8_block_max_into(d[o].record, m[o]);
    }
}

// The forward: a = silu(gate) ⊙ up [rows, cols], quantized with the scale of amax[0] into q
// and/or qt, a record into `record`.
extern "C" __global__ void __launch_bounds__(FP8_DUAL_THREADS, 3) swiglu_fwd_fp8(
    Fv gate, Fv up, Fv a, long long rows, long long cols, const unsigned int* amax, float maxv, int e5m2,
    unsigned char* q, unsigned char* qt, unsigned int* record) {
    __shared__ __align__(16) unsigned int tiles[1][SWIGLU_FP8_ROWS][FP8_DUAL_COLS / 4];
    const Fv x[3] = {gate, up, up};
    const Fv y[2] = {a, a};
    const SwigluFp8Out d[2] = {swiglu_fp8_out(amax, maxv, e5m2, q, qt, record),
                               swiglu_fp8_out(nullptr, maxv, e5m2, nullptr, nullptr, nullptr)};
    unsigned int m[2] = {0u, 0u};
    if (a.bf16) swiglu_fp8_tiles<true, false>(x, y, rows, cols, d, m, tiles);
    else swiglu_fp8_tiles<false, false>(x, y, rows, cols, d, m, tiles);
    swiglu_fp8_records<1>(d, m);
}

// The backward: dgate and dup from the product dy (may be dgate itself), gate and up, each
// quantized with the scale of its amax (null: not quantized) into its layouts, with its record.
extern "C" __global__ void __launch_bounds__(FP8_DUAL_THREADS, 3) swiglu_bwd_fp8(
    Fv dy, Fv gate, Fv up, Fv dgate, Fv dup, long long rows, long long cols,
    const unsigned int* amax_g, float maxv_g, int e5m2_g, unsigned char* qg, unsigned char* qgt, unsigned int* record_g,
    const unsigned int* amax_u, float maxv_u, int e5m2_u, unsigned char* qu, unsigned char* qut, unsigned int* record_u) {
    __shared__ __align__(16) unsigned int tiles[2][SWIGLU_FP8_ROWS][FP8_DUAL_COLS / 4];
    const Fv x[3] = {dy, gate, up};
    const Fv y[2] = {dgate, dup};
    const SwigluFp8Out d[2] = {swiglu_fp8_out(amax_g, maxv_g, e5m2_g, qg, qgt, record_g),
                               swiglu_fp8_out(amax_u, maxv_u, e5m2_u, qu, qut, record_u)};
    unsigned int m[2] = {0u, 0u};
    if (dgate.bf16) swiglu_fp8_tiles<true, true>(x, y, rows, cols, d, m, tiles);
    else swiglu_fp8_tiles<false, true>(x, y, rows, cols, d, m, tiles);
    swiglu_fp8_records<2>(d, m);
}

// The dequantization factors 1 / s (exact: s is a power of two) in the layout `layout`
// (Fp8ScaleLayout in compiler/src/memplan/scratch.rs) that cuBLASLt (tensorwise) and
// fp8_gemm.cu (rowwise, blockwise) read: 0 scalar; 1 one per line; 2 1 x block tiles along K,
// factor (l, kb) at l + kb * lines; 3 block x block squares, factor (lb, kb) at kb + lb * kb4
// with kb4 = ceil(k / block) rounded up to 4, the padding 1. n: factors written.
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

// Delayed scaling's step end (Op::Fp8HistoryRoll; parc_compiler::ir::fp8): history[0] is the
// step's amax, history[1..len) the amax history, newest first. Rolls it one step (history[k+1]
// = history[k] for k < len - 1, the oldest dropped, history[0] = 0) and writes the rolled
// history's largest value to amax[0], the scale amax the next step's GEMMs read. One thread:
// a history holds at most 1025 values (MAX_HISTORY + 1) and rolls once a step.
__device__ float fp8_roll(float* history, long long len) {
    float m = 0.0f;
    for (long long k = len - 1; k > 0; --k) {
        history[k] = history[k - 1];
        m = fmaxf(m, history[k]);
    }
    history[0] = 0.0f;
    return m;
}

extern "C" __global__ void fp8_history_roll(float* history, long long len, float* amax) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    amax[0] = fp8_roll(history, len);
}

// A run of consecutive Op::Fp8HistoryRoll instructions in one launch (cuda/fp8_roll.rs): entry i
// of `table` is {history, amax, len} (three 8-byte words) and thread i rolls it exactly as
// fp8_history_roll does, also writing the new scale amax to staging[i] for the run's one copy to
// the host, and its tensorwise dequantization factors 1 / s, as fp8_scales computes them, to
// factors[8i] (E4M3, largest value max_e4m3) and factors[8i + 4] (E5M2) for the step's GEMMs:
// each at its own 16 bytes, as cuBLASLt reads a scale pointer only at that alignment.
extern "C" __global__ void fp8_history_rolls(const unsigned long long* table, long long count,
                                             float* staging, float* factors, float max_e4m3,
                                             float max_e5m2) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float* amax = (float*)table[3 * i + 1];
    float m = fp8_roll((float*)table[3 * i], (long long)table[3 * i + 2]);
    amax[0] = m;
    staging[i] = m;
    unsigned int bits = __float_as_uint(m);
    factors[8 * i] = 1.0f / fp8_scale(bits, max_e4m3);
    factors[8 * i + 4] = 1.0f / fp8_scale(bits, max_e5m2);
}
