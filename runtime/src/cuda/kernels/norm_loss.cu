// LayerNorm, RMSNorm (one warp per row, double statistics) and the cross-entropy pieces.
// Activation operands are `Fv` (f32 or bf16, common.cuh); weights and statistics are f32. A
// norm backward's dx is overwritten, or added to when `accumulate_dx` is set (read-add-round
// for bf16).

// The norms run one warp per row (8 rows per block of 256): a row's elements are read in
// 8-wide 16-byte vectors where dim is a multiple of 8 and x, y (dy, dx) are aligned, else one
// at a time; the repeated passes over a row hit L1. Statistics are double, reduced with warp
// shuffles (no block barrier).

// Runs f8(j) for the 8-element vectors of a row lane `lane` owns (j = 8·lane + 256·k) when
// `vec`, else f1(j) for its single elements (j = lane + 32·k).
template <typename F8f, typename F1f>
__device__ __forceinline__ void row_loop(bool vec, long long dim, int lane, F8f f8, F1f f1) {
    if (vec) {
        for (long long j = 8 * lane; j < dim; j += 256) f8(j);
    } else {
        for (long long j = lane; j < dim; j += 32) f1(j);
    }
}

// The forwards hold a row of at most NORM_REG_DIM elements in registers: lane `lane` owns the
// 8-element vectors j = 8·lane + 256·k, k < NORM_REG_VECS (those with j < dim). The row is
// read from memory once; the statistics are summed in the same order as row_loop's vector
// path, so the values are those of the loops.
#define NORM_REG_VECS 4
#define NORM_REG_DIM (256 * NORM_REG_VECS)

// Whether f32 vectors of `p` (weights, biases) start on 16-byte boundaries.
__device__ __forceinline__ bool f32_vec_ok(const float* p) {
    return ((unsigned long long)p & 15ull) == 0;
}

// w[j .. j+8) of an f32 vector (f32_vec_ok(w), j a multiple of 8).
__device__ __forceinline__ F8 ld8_f32(const float* w, long long j) {
    F8 r;
    float4 a = ((const float4*)w)[j / 4], b = ((const float4*)w)[j / 4 + 1];
    r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
    r.v[4] = b.x; r.v[5] = b.y; r.v[6] = b.z; r.v[7] = b.w;
    return r;
}

// Whether a row of `dim` elements takes the register path (vectors, aligned operands).
__device__ __forceinline__ bool norm_regs_ok(long long dim, const float* w) {
    return dim % 8 == 0 && dim <= NORM_REG_DIM && f32_vec_ok(w);
}

extern "C" __global__ void layer_norm_fwd(Fv x, const float* w, const float* b, Fv y, float* mean, float* rstd, long long rows, long long dim, double eps) {
    long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    long long o = r * dim;
    bool vec = dim % 8 == 0 && vec_ok(x) && vec_ok(y);
    if (vec && norm_regs_ok(dim, w) && (!b || f32_vec_ok(b))) {
        F8 v[NORM_REG_VECS];
        double s = 0.0;
#pragma unroll
        for (int k = 0; k < NORM_REG_VECS; k++) {
            long long j = 8 * lane + 256 * k;
            if (j < dim) {
                v[k] = ld8(x, (o + j) / 8);
                for (int e = 0; e < 8; e++) s += (double)v[k].v[e];
            }
        }
        double m = warp_sum_d(s) / (double)dim;
        double q = 0.0;
#pragma unroll
        for (int k = 0; k < NORM_REG_VECS; k++) {
            if (8 * lane + 256 * k < dim) {
                for (int e = 0; e < 8; e++) { double d = (double)v[k].v[e] - m; q += d * d; }
            }
        }
        double var = warp_sum_d(q) / (double)dim;
        float mf = (float)m, rf = (float)(1.0 / sqrt(var + eps));
        if (lane == 0) { mean[r] = mf; rstd[r] = rf; }
#pragma unroll
        for (int k = 0; k < NORM_REG_VECS; k++) {
            long long j = 8 * lane + 256 * k;
            if (j < dim) {
                F8 wv = ld8_f32(w, j), out;
                F8 bv;
                if (b) bv = ld8_f32(b, j);
                for (int e = 0; e < 8; e++) out.v[e] = (v[k].v[e] - mf) * rf * wv.v[e] + (b ? bv.v[e] : 0.0f);
                st8(y, (o + j) / 8, out);
            }
        }
        return;
    }
    double s = 0.0;
    row_loop(vec, dim, lane,
        [&](long long j) { F8 v = ld8(x, (o + j) / 8); for (int k = 0; k < 8; k++) s += (double)v.v[k]; },
        [&](long long j) { s += (double)ld(x, o + j); });
    double m = warp_sum_d(s) / (double)dim;
    double q = 0.0;
    row_loop(vec, dim, lane,
        [&](long long j) { F8 v = ld8(x, (o + j) / 8); for (int k = 0; k < 8; k++) { double d = (double)v.v[k] - m; q += d * d; } },
        [&](long long j) { double d = (double)ld(x, o + j) - m; q += d * d; });
    double var = warp_sum_d(q) / (double)dim;
    float mf = (float)m, rf = (float)(1.0 / sqrt(var + eps));
    if (lane == 0) { mean[r] = mf; rstd[r] = rf; }
    row_loop(vec, dim, lane,
        [&](long long j) {
            F8 v = ld8(x, (o + j) / 8);
            for (int k = 0; k < 8; k++) v.v[k] = (v.v[k] - mf) * rf * w[j + k] + (b ? b[j + k] : 0.0f);
            st8(y, (o + j) / 8, v);
        },
        [&](long long j) { st(y, o + j, (ld(x, o + j) - mf) * rf * w[j] + (b ? b[j] : 0.0f)); });
}

extern "C" __global__ void layer_norm_bwd_dx(Fv dy, Fv x, const float* w, const float* mean, const float* rstd, Fv dx, long long rows, long long dim, int accumulate_dx) {
    long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    long long o = r * dim;
    bool vec = dim % 8 == 0 && vec_ok(dy) && vec_ok(x) && vec_ok(dx);
    float mf = mean[r], rf = rstd[r];
    double sg = 0.0, sgx = 0.0;
    row_loop(vec, dim, lane,
        [&](long long j) {
            F8 d = ld8(dy, (o + j) / 8), v = ld8(x, (o + j) / 8);
            for (int k = 0; k < 8; k++) {
                double g = (double)(d.v[k] * w[j + k]);
                sg += g;
                sgx += g * (double)((v.v[k] - mf) * rf);
            }
        },
        [&](long long j) {
            double g = (double)(ld(dy, o + j) * w[j]);
            sg += g;
            sgx += g * (double)((ld(x, o + j) - mf) * rf);
        });
    float mean_g = (float)(warp_sum_d(sg) / (double)dim);
    float mean_gx = (float)(warp_sum_d(sgx) / (double)dim);
    row_loop(vec, dim, lane,
        [&](long long j) {
            F8 d = ld8(dy, (o + j) / 8), v = ld8(x, (o + j) / 8), out;
            if (accumulate_dx) out = ld8(dx, (o + j) / 8);
            for (int k = 0; k < 8; k++) {
                float xhat = (v.v[k] - mf) * rf;
                float g = rf * (d.v[k] * w[j + k] - mean_g - xhat * mean_gx);
                out.v[k] = accumulate_dx ? out.v[k] + g : g;
            }
            st8(dx, (o + j) / 8, out);
        },
        [&](long long j) {
            float xhat = (ld(x, o + j) - mf) * rf;
            float g = rf * (ld(dy, o + j) * w[j] - mean_g - xhat * mean_gx);
            st(dx, o + j, accumulate_dx ? ld(dx, o + j) + g : g);
        });
}

// part_w[chunk, j] = Σ dy·xhat over the chunk's rows (layer norm: xhat = (x − mean)·rstd,
// rms norm: mean == null, xhat = x·rstd).
extern "C" __global__ void norm_dw_partial(Fv dy, Fv x, const float* mean, const float* rstd, double* part, long long rows, long long dim, long long chunk_rows) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long c = blockIdx.y;
    if (j >= dim) return;
    long long r0 = c * chunk_rows, r1 = min(rows, r0 + chunk_rows);
    double s = 0.0;
    for (long long r = r0; r < r1; r++) {
        float xv = ld(x, r * dim + j);
        float xhat = mean ? (xv - mean[r]) * rstd[r] : xv * rstd[r];
        s += (double)(ld(dy, r * dim + j) * xhat);
    }
    part[c * dim + j] = s;
}

// norm_dw_partial with 8-column vectors (col_partial8's conditions and layout).
extern "C" __global__ void norm_dw_partial8(Fv dy, Fv x, const float* mean, const float* rstd, double* part, long long rows, long long dim, long long chunk_rows) {
    col_partial8(rows, dim, chunk_rows, part, [&](long long r, long long c) {
        F8 d = ld8(dy, (r * dim + c) / 8), v = ld8(x, (r * dim + c) / 8);
        float m = mean ? mean[r] : 0.0f, rs = rstd[r];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float xhat = mean ? (v.v[k] - m) * rs : v.v[k] * rs;
            d.v[k] = d.v[k] * xhat;
        }
        return d;
    });
}

extern "C" __global__ void rms_norm_fwd(Fv x, const float* w, Fv y, float* rstd, long long rows, long long dim, double eps) {
    long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    long long o = r * dim;
    bool vec = dim % 8 == 0 && vec_ok(x) && vec_ok(y);
    if (vec && norm_regs_ok(dim, w)) {
        F8 v[NORM_REG_VECS];
        double s = 0.0;
#pragma unroll
        for (int k = 0; k < NORM_REG_VECS; k++) {
            long long j = 8 * lane + 256 * k;
            if (j < dim) {
                v[k] = ld8(x, (o + j) / 8);
                for (int e = 0; e < 8; e++) s += (double)v[k].v[e] * (double)v[k].v[e];
            }
        }
        double ms = warp_sum_d(s) / (double)dim;
        float rf = (float)(1.0 / sqrt(ms + eps));
        if (lane == 0) rstd[r] = rf;
#pragma unroll
        for (int k = 0; k < NORM_REG_VECS; k++) {
            long long j = 8 * lane + 256 * k;
            if (j < dim) {
                F8 wv = ld8_f32(w, j), out;
                for (int e = 0; e < 8; e++) out.v[e] = v[k].v[e] * rf * wv.v[e];
                st8(y, (o + j) / 8, out);
            }
        }
        return;
    }
    double s = 0.0;
    row_loop(vec, dim, lane,
        [&](long long j) { F8 v = ld8(x, (o + j) / 8); for (int k = 0; k < 8; k++) s += (double)v.v[k] * (double)v.v[k]; },
        [&](long long j) { double v = (double)ld(x, o + j); s += v * v; });
    double ms = warp_sum_d(s) / (double)dim;
    float rf = (float)(1.0 / sqrt(ms + eps));
    if (lane == 0) rstd[r] = rf;
    row_loop(vec, dim, lane,
        [&](long long j) {
            F8 v = ld8(x, (o + j) / 8);
            for (int k = 0; k < 8; k++) v.v[k] = v.v[k] * rf * w[j + k];
            st8(y, (o + j) / 8, v);
        },
        [&](long long j) { st(y, o + j, ld(x, o + j) * rf * w[j]); });
}

extern "C" __global__ void rms_norm_bwd_dx(Fv dy, Fv x, const float* w, const float* rstd, Fv dx, long long rows, long long dim, int accumulate_dx) {
    long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    long long o = r * dim;
    bool vec = dim % 8 == 0 && vec_ok(dy) && vec_ok(x) && vec_ok(dx);
    float rf = rstd[r];
    double sgx = 0.0;
    row_loop(vec, dim, lane,
        [&](long long j) {
            F8 d = ld8(dy, (o + j) / 8), v = ld8(x, (o + j) / 8);
            for (int k = 0; k < 8; k++) sgx += (double)(d.v[k] * w[j + k]) * (double)(v.v[k] * rf);
        },
        [&](long long j) { sgx += (double)(ld(dy, o + j) * w[j]) * (double)(ld(x, o + j) * rf); });
    float mean_gx = (float)(warp_sum_d(sgx) / (double)dim);
    row_loop(vec, dim, lane,
        [&](long long j) {
            F8 d = ld8(dy, (o + j) / 8), v = ld8(x, (o + j) / 8), out;
            if (accumulate_dx) out = ld8(dx, (o + j) / 8);
            for (int k = 0; k < 8; k++) {
                float g = rf * (d.v[k] * w[j + k] - v.v[k] * rf * mean_gx);
                out.v[k] = accumulate_dx ? out.v[k] + g : g;
            }
            st8(dx, (o + j) / 8, out);
        },
        [&](long long j) {
            float g = rf * (ld(dy, o + j) * w[j] - ld(x, o + j) * rf * mean_gx);
            st(dx, o + j, accumulate_dx ? ld(dx, o + j) + g : g);
        });
}

// ---------------------------------------------------------------- norm variants
// The `multirow` forwards (PARC_NORM_FWD_KERNEL) and the `fused` backwards
// (PARC_NORM_BWD_KERNEL), for rows of a multiple of 8 elements, at most NORM_WIDE_MAX_DIM,
// with every operand 16-byte aligned (the host falls back to the kernels above otherwise).
// Rows of at most 256·NV elements (NV ≤ 4: 1,024) run one warp a row (`*_multirow<NV>`,
// `*_fused<NV>`), keeping the arithmetic of the kernel they replace: the same per-lane element
// order, double statistics and the same f32 expressions, so forward outputs and dx are those
// of the `warp` kernels. Wider rows run split over the warps of a row group (`*_wide`, below):
// the same f32 expressions and double statistics, with each row's double sums added in
// another order.

// One 8-element vector as it is stored, kept in registers between the passes of a multirow
// forward or a fused backward (bf16: 4 words, not the 8 floats it widens to).
struct RawB {
    uint4 u;
};
struct RawF {
    float4 a, b;
};
template <bool B16> struct RawOf { typedef RawF T; };
template <> struct RawOf<true> { typedef RawB T; };

__device__ __forceinline__ void ld_raw(const void* p, long long j, RawB& r) { r.u = ((const uint4*)p)[j]; }
__device__ __forceinline__ void ld_raw(const void* p, long long j, RawF& r) {
    r.a = ((const float4*)p)[2 * j];
    r.b = ((const float4*)p)[2 * j + 1];
}
__device__ __forceinline__ F8 widen(const RawB& r) {
    F8 f;
    unsigned w[4] = {r.u.x, r.u.y, r.u.z, r.u.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f.v[2 * k] = __uint_as_float(w[k] << 16);
        f.v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
    return f;
}
__device__ __forceinline__ F8 widen(const RawF& r) {
    F8 f;
    f.v[0] = r.a.x; f.v[1] = r.a.y; f.v[2] = r.a.z; f.v[3] = r.a.w;
    f.v[4] = r.b.x; f.v[5] = r.b.y; f.v[6] = r.b.z; f.v[7] = r.b.w;
    return f;
}

// The per-vector arithmetic every norm variant shares, so each computes the same f32
// expressions. A forward's first row sum: adds one stored vector's x (LN) or x² (RMS), in
// double.
template <bool LN, typename Raw>
__device__ __forceinline__ void fwd_first_sum(const Raw& r, double& s) {
    F8 f = widen(r);
#pragma unroll
    for (int e = 0; e < 8; e++) {
        double t = (double)f.v[e];
        s += LN ? t : t * t;
    }
}

// A LayerNorm forward's second row sum: adds one stored vector's (x − m)², in double.
template <typename Raw>
__device__ __forceinline__ void fwd_dev_sum(const Raw& r, double m, double& q) {
    F8 f = widen(r);
#pragma unroll
    for (int e = 0; e < 8; e++) {
        double d = (double)f.v[e] - m;
        q += d * d;
    }
}

// y's 8 elements from one stored vector of x: LN (x − mean)·rstd·w + b (without a bias,
// + 0), RMS x·rstd·w.
template <bool LN, typename Raw>
__device__ __forceinline__ F8 fwd_out(const Raw& r, float mf, float rf, const F8& wv, const F8& bv, bool has_b) {
    F8 f = widen(r), out;
#pragma unroll
    for (int e = 0; e < 8; e++)
        out.v[e] = LN ? (f.v[e] - mf) * rf * wv.v[e] + (has_b ? bv.v[e] : 0.0f) : f.v[e] * rf * wv.v[e];
    return out;
}

// A fused backward's first pass over one vector of dy (rd) and x (rx): adds its terms of the
// row sums Σ g (LN only) and Σ g·xhat (g = dy·w, in double) and of its 8 columns' Σ dy·xhat
// (aw) and Σ dy (ab, LN only), in f32.
template <bool LN, typename Raw>
__device__ __forceinline__ void bwd_sums(const Raw& rd, const Raw& rx, const F8& wv, float mf, float rf, double& sg, double& sgx, float* aw, float* ab) {
    F8 d = widen(rd), v = widen(rx);
#pragma unroll
    for (int e = 0; e < 8; e++) {
        float xhat = LN ? (v.v[e] - mf) * rf : v.v[e] * rf;
        double g = (double)(d.v[e] * wv.v[e]);
        if (LN) sg += g;
        sgx += g * (double)xhat;
        aw[e] += d.v[e] * xhat;
        if (LN) ab[e] += d.v[e];
    }
}

// One vector of a fused backward's dx from dy (rd), x (rx) and the row's means of g and
// g·xhat; added to `acc` when accumulate_dx (acc is not read otherwise).
template <bool LN, typename Raw>
__device__ __forceinline__ F8 bwd_dx(const Raw& rd, const Raw& rx, const F8& wv, float mf, float rf, float mean_g, float mean_gx, const F8& acc, int accumulate_dx) {
    F8 d = widen(rd), v = widen(rx), out;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        float g;
        if (LN) {
            float xhat = (v.v[e] - mf) * rf;
            g = rf * (d.v[e] * wv.v[e] - mean_g - xhat * mean_gx);
        } else {
            g = rf * (d.v[e] * wv.v[e] - v.v[e] * rf * mean_gx);
        }
        out.v[e] = accumulate_dx ? acc.v[e] + g : g;
    }
    return out;
}

// Rows one warp of a multirow forward normalises together: all their vectors are loaded
// before the first reduction, so twice the bytes of a one-row warp are in flight, and the two
// rows' shuffle chains interleave.
#define NORM_FWD_RPW 2

// LayerNorm (LN: mean, optional bias) or RMSNorm forward of rows r0, r0 + 1 (those < rows);
// lane `lane` owns vectors j = 8·lane + 256·k, k < NV, j < dim, holding x as stored (`B16`:
// bf16, else f32; y may be either). Blocks of 256 threads.
template <int NV, bool B16, bool LN>
__device__ __forceinline__ void norm_fwd_multirow(Fv x, const float* w, const float* b, Fv y, float* mean, float* rstd, long long rows, long long dim, double eps) {
    int lane = threadIdx.x & 31;
    long long r0 = (blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5)) * NORM_FWD_RPW;
    if (r0 >= rows) return;
    typedef typename RawOf<B16>::T Raw;
    Raw v[NORM_FWD_RPW][NV];
#pragma unroll
    for (int i = 0; i < NORM_FWD_RPW; i++) {
        if (r0 + i < rows) {
#pragma unroll
            for (int k = 0; k < NV; k++) {
                long long j = 8 * lane + 256 * k;
                if (j < dim) ld_raw(x.p, ((r0 + i) * dim + j) / 8, v[i][k]);
            }
        }
    }
    double s[NORM_FWD_RPW];
#pragma unroll
    for (int i = 0; i < NORM_FWD_RPW; i++) {
        s[i] = 0.0;
        if (r0 + i < rows) {
#pragma unroll
            for (int k = 0; k < NV; k++) {
                if (8 * lane + 256 * k < dim) fwd_first_sum<LN>(v[i][k], s[i]);
            }
        }
    }
    float mf[NORM_FWD_RPW], rf[NORM_FWD_RPW];
    if (LN) {
        double m[NORM_FWD_RPW], q[NORM_FWD_RPW];
#pragma unroll
        for (int i = 0; i < NORM_FWD_RPW; i++) m[i] = warp_sum_d(s[i]) / (double)dim;
#pragma unroll
        for (int i = 0; i < NORM_FWD_RPW; i++) {
            q[i] = 0.0;
            if (r0 + i < rows) {
#pragma unroll
                for (int k = 0; k < NV; k++) {
                    if (8 * lane + 256 * k < dim) fwd_dev_sum(v[i][k], m[i], q[i]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < NORM_FWD_RPW; i++) {
            double var = warp_sum_d(q[i]) / (double)dim;
            mf[i] = (float)m[i];
            rf[i] = (float)(1.0 / sqrt(var + eps));
        }
    } else {
#pragma unroll
        for (int i = 0; i < NORM_FWD_RPW; i++) {
            double ms = warp_sum_d(s[i]) / (double)dim;
            mf[i] = 0.0f;
            rf[i] = (float)(1.0 / sqrt(ms + eps));
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < NORM_FWD_RPW; i++) {
            if (r0 + i < rows) {
                if (LN) mean[r0 + i] = mf[i];
                rstd[r0 + i] = rf[i];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < NV; k++) {
        long long j = 8 * lane + 256 * k;
        if (j < dim) {
            F8 wv = ld8_f32(w, j), bv;
            if (LN && b) bv = ld8_f32(b, j);
#pragma unroll
            for (int i = 0; i < NORM_FWD_RPW; i++) {
                if (r0 + i < rows) st8(y, ((r0 + i) * dim + j) / 8, fwd_out<LN>(v[i][k], mf[i], rf[i], wv, bv, b != nullptr));
            }
        }
    }
}

#define NORM_FWD_MULTIROW(NV, B16, SUFFIX)                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) layer_norm_fwd_multirow##NV##SUFFIX(Fv x, const float* w, const float* b, Fv y, float* mean, float* rstd, long long rows, long long dim, double eps) { \
        norm_fwd_multirow<NV, B16, true>(x, w, b, y, mean, rstd, rows, dim, eps);                                                              \
    }                                                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) rms_norm_fwd_multirow##NV##SUFFIX(Fv x, const float* w, Fv y, float* rstd, long long rows, long long dim, double eps) { \
        norm_fwd_multirow<NV, B16, false>(x, w, nullptr, y, nullptr, rstd, rows, dim, eps);                                                     \
    }
NORM_FWD_MULTIROW(1, true, _bf16)
NORM_FWD_MULTIROW(2, true, _bf16)
NORM_FWD_MULTIROW(3, true, _bf16)
NORM_FWD_MULTIROW(4, true, _bf16)
NORM_FWD_MULTIROW(1, false, _f32)
NORM_FWD_MULTIROW(2, false, _f32)
NORM_FWD_MULTIROW(3, false, _f32)
NORM_FWD_MULTIROW(4, false, _f32)

// Warps of a fused backward's block (most 16): 16 while the row and the dw/db partials fit in
// 128 registers, fewer for wider rows (norm.rs's BWD_THREADS mirrors the __launch_bounds__
// below).
#define NORM_BWD_MAX_WARPS 16

// A fused LayerNorm (LN) or RMSNorm backward: dx and the dw (and db) column partials in one
// pass over dy and x. Block c owns rows [c·band, (c+1)·band); each warp takes rows warp,
// warp + warps, … of the band, lane `lane` the vectors j = 8·lane + 256·k (k < NV, j < dim),
// keeping the row's dy and x (and an accumulated dx) as stored (`B16`: all bf16, else all
// f32) for dx's second pass, and its columns' Σ dy·xhat and Σ dy over its rows in f32
// registers. The block then adds its warps' sums in warp order in double and writes one f32
// partial row per block: part[c, j] (dw), part[blocks + c, j] (db, when `with_db`). Row
// statistics and dx are exactly layer_norm_bwd_dx's / rms_norm_bwd_dx's.
template <int NV, bool B16, bool LN>
__device__ __forceinline__ void norm_bwd_fused(Fv dy, Fv x, const float* w, const float* mean, const float* rstd, Fv dx, float* part, long long rows, long long dim, long long band, int accumulate_dx, int with_db) {
    typedef typename RawOf<B16>::T Raw;
    // 16-byte aligned: each lane stores its 8 columns as two float4s.
    __shared__ __align__(16) float red[LN ? 2 : 1][NORM_BWD_MAX_WARPS][256];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    long long r0 = blockIdx.x * band, r1 = min(rows, r0 + band);
    float aw[NV][8], ab[NV][8];
#pragma unroll
    for (int k = 0; k < NV; k++) {
#pragma unroll
        for (int e = 0; e < 8; e++) { aw[k][e] = 0.0f; ab[k][e] = 0.0f; }
    }
    for (long long r = r0 + warp; r < r1; r += warps) {
        long long o = r * dim;
        Raw rd[NV], rx[NV];
#pragma unroll
        for (int k = 0; k < NV; k++) {
            long long j = 8 * lane + 256 * k;
            if (j < dim) {
                ld_raw(dy.p, (o + j) / 8, rd[k]);
                ld_raw(x.p, (o + j) / 8, rx[k]);
            }
        }
        float mf = LN ? mean[r] : 0.0f, rf = rstd[r];
        double sg = 0.0, sgx = 0.0;
#pragma unroll
        for (int k = 0; k < NV; k++) {
            long long j = 8 * lane + 256 * k;
            if (j < dim) bwd_sums<LN>(rd[k], rx[k], ld8_f32(w, j), mf, rf, sg, sgx, aw[k], ab[k]);
        }
        // An accumulated dx is loaded before the row's shuffle reductions, which hide its
        // latency.
        Raw rdx[NV];
        if (accumulate_dx) {
#pragma unroll
            for (int k = 0; k < NV; k++) {
                long long j = 8 * lane + 256 * k;
                if (j < dim) ld_raw(dx.p, (o + j) / 8, rdx[k]);
            }
        }
        float mean_g = LN ? (float)(warp_sum_d(sg) / (double)dim) : 0.0f;
        float mean_gx = (float)(warp_sum_d(sgx) / (double)dim);
#pragma unroll
        for (int k = 0; k < NV; k++) {
            long long j = 8 * lane + 256 * k;
            if (j < dim) {
                F8 acc;
                if (accumulate_dx) acc = widen(rdx[k]);
                st8(dx, (o + j) / 8, bwd_dx<LN>(rd[k], rx[k], ld8_f32(w, j), mf, rf, mean_g, mean_gx, acc, accumulate_dx));
            }
        }
    }
    // The block's column sums, one 256-column slice (k) at a time through shared memory.
    int sums = (LN && with_db) ? 2 : 1;
#pragma unroll
    for (int k = 0; k < NV; k++) {
        __syncthreads();
        float4* dwv = (float4*)&red[0][warp][8 * lane];
        dwv[0] = make_float4(aw[k][0], aw[k][1], aw[k][2], aw[k][3]);
        dwv[1] = make_float4(aw[k][4], aw[k][5], aw[k][6], aw[k][7]);
        if (LN) {
            float4* dbv = (float4*)&red[LN ? 1 : 0][warp][8 * lane];
            dbv[0] = make_float4(ab[k][0], ab[k][1], ab[k][2], ab[k][3]);
            dbv[1] = make_float4(ab[k][4], ab[k][5], ab[k][6], ab[k][7]);
        }
        __syncthreads();
        for (int t = threadIdx.x; t < 256 * sums; t += blockDim.x) {
            int q = t >> 8, c = t & 255;
            long long col = 256LL * k + c;
            if (col < dim) {
                double s = 0.0;
                for (int u = 0; u < warps; u++) s += (double)red[q][u][c];
                part[((long long)q * gridDim.x + blockIdx.x) * dim + col] = (float)s;
            }
        }
    }
}

#define NORM_BWD_FUSED(NV, B16, SUFFIX, THREADS)                                                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) layer_norm_bwd_fused##NV##SUFFIX(Fv dy, Fv x, const float* w, const float* mean, const float* rstd, Fv dx, float* part, long long rows, long long dim, long long band, int accumulate_dx, int with_db) { \
        norm_bwd_fused<NV, B16, true>(dy, x, w, mean, rstd, dx, part, rows, dim, band, accumulate_dx, with_db);                               \
    }                                                                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) rms_norm_bwd_fused##NV##SUFFIX(Fv dy, Fv x, const float* w, const float* rstd, Fv dx, float* part, long long rows, long long dim, long long band, int accumulate_dx) { \
        norm_bwd_fused<NV, B16, false>(dy, x, w, nullptr, rstd, dx, part, rows, dim, band, accumulate_dx, 0);                                  \
    }
NORM_BWD_FUSED(1, true, _bf16, 512)
NORM_BWD_FUSED(2, true, _bf16, 512)
NORM_BWD_FUSED(3, true, _bf16, 512)
NORM_BWD_FUSED(4, true, _bf16, 384)
NORM_BWD_FUSED(1, false, _f32, 512)
NORM_BWD_FUSED(2, false, _f32, 512)
NORM_BWD_FUSED(3, false, _f32, 384)
NORM_BWD_FUSED(4, false, _f32, 256)

// dw[j] (+= when `accumulate`, else =) the sum over the fused backward's `chunks` partial rows
// part[c, j], in chunk order in double; db from part[chunks + c, j] likewise when db is set.
extern "C" __global__ void norm_bwd_fused_finish(const float* part, float* dw, float* db, long long dim, long long chunks, int accumulate) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= dim) return;
    double s = 0.0;
    for (long long c = 0; c < chunks; c++) s += (double)part[c * dim + j];
    dw[j] = accumulate ? (float)((double)dw[j] + s) : (float)s;
    if (db) {
        double t = 0.0;
        for (long long c = 0; c < chunks; c++) t += (double)part[(chunks + c) * dim + j];
        db[j] = accumulate ? (float)((double)db[j] + t) : (float)t;
    }
}

// ---------------------------------------------------------------- wide norm rows
// Rows of 1,025..=NORM_WIDE_MAX_DIM elements (the `*_wide` kernels) are split over a row
// group of W warps (the host's W = ⌈dim / (256·NORM_WIDE_VECS)⌉: 2 to 8): thread
// t = lane + 32·w (w < W) owns the 8-element vectors j = 8·t + 256·W·k, k < NORM_WIDE_VECS,
// j < dim, and holds them as stored, so a row is read from memory once. A block of
// NORM_WIDE_THREADS threads at most holds ⌊8 / W⌋ row groups, each with its own named barrier,
// so groups never wait for each other. A row's double sums are each warp's butterfly, then the
// group's W warp sums added in warp order through shared memory: deterministic and the same
// in every thread of the group, but in another order than the one-warp kernels', so
// statistics and dx may differ from theirs in the last bits. The f32 expressions are theirs.
#define NORM_WIDE_VECS 4
#define NORM_WIDE_MAX_DIM 8192
#define NORM_WIDE_THREADS 256

// Where a thread of a wide kernel is: its row group g of W = row_warps warps, its index t in
// the group, its first column j0 = 8·t and the columns between its vectors (step = 256·W).
struct WideAt {
    int g, row_warps, t;
    long long j0, step;
};

__device__ __forceinline__ WideAt wide_at(int row_warps) {
    WideAt at;
    at.row_warps = row_warps;
    at.g = (threadIdx.x >> 5) / row_warps;
    at.t = threadIdx.x - 32 * row_warps * at.g;
    at.j0 = 8LL * at.t;
    at.step = 256LL * row_warps;
    return at;
}

// Waits for the 32·W threads of row group g (named barrier 1 + g; 0 is __syncthreads'), which
// also orders their shared-memory accesses.
__device__ __forceinline__ void group_barrier(const WideAt& at) {
    asm volatile("bar.sync %0, %1;" ::"r"(at.g + 1), "r"(32 * at.row_warps) : "memory");
}

// The sum over the thread's row group of each thread's `v`, in every thread of the group: each
// warp's butterfly into slot[warp], the group's barrier, then the group's slots in warp order.
// The caller writes a slot array once per row (the forward: one row per group).
__device__ __forceinline__ double group_sum(double v, double* slot, const WideAt& at) {
    v = warp_sum_d(v);
    if ((threadIdx.x & 31) == 0) slot[threadIdx.x >> 5] = v;
    group_barrier(at);
    double s = 0.0;
    for (int u = at.g * at.row_warps; u < (at.g + 1) * at.row_warps; u++) s += slot[u];
    return s;
}

// A wide LayerNorm (LN: mean, optional bias) or RMSNorm forward: group g of block c
// normalises row c·G + g (G = groups a block), x held as stored (`B16`: bf16, else f32; y
// may be either), y by multirow's f32 expressions.
template <bool B16, bool LN>
__device__ __forceinline__ void norm_fwd_wide(Fv x, const float* w, const float* b, Fv y, float* mean, float* rstd, long long rows, long long dim, double eps, int row_warps) {
    typedef typename RawOf<B16>::T Raw;
    __shared__ double red[2][NORM_WIDE_THREADS / 32];
    WideAt at = wide_at(row_warps);
    long long r = blockIdx.x * (long long)((blockDim.x >> 5) / row_warps) + at.g, o = r * dim;
    if (r >= rows) return;
    Raw v[NORM_WIDE_VECS];
#pragma unroll
    for (int k = 0; k < NORM_WIDE_VECS; k++) {
        long long j = at.j0 + at.step * k;
        if (j < dim) ld_raw(x.p, (o + j) / 8, v[k]);
    }
    double s = 0.0;
#pragma unroll
    for (int k = 0; k < NORM_WIDE_VECS; k++) {
        if (at.j0 + at.step * k < dim) fwd_first_sum<LN>(v[k], s);
    }
    float mf = 0.0f, rf;
    if (LN) {
        double m = group_sum(s, red[0], at) / (double)dim, q = 0.0;
#pragma unroll
        for (int k = 0; k < NORM_WIDE_VECS; k++) {
            if (at.j0 + at.step * k < dim) fwd_dev_sum(v[k], m, q);
        }
        double var = group_sum(q, red[1], at) / (double)dim;
        mf = (float)m;
        rf = (float)(1.0 / sqrt(var + eps));
    } else {
        double ms = group_sum(s, red[0], at) / (double)dim;
        rf = (float)(1.0 / sqrt(ms + eps));
    }
    if (at.t == 0) {
        if (LN) mean[r] = mf;
        rstd[r] = rf;
    }
#pragma unroll
    for (int k = 0; k < NORM_WIDE_VECS; k++) {
        long long j = at.j0 + at.step * k;
        if (j < dim) {
            F8 wv = ld8_f32(w, j), bv;
            if (LN && b) bv = ld8_f32(b, j);
            st8(y, (o + j) / 8, fwd_out<LN>(v[k], mf, rf, wv, bv, b != nullptr));
        }
    }
}

// Launch: grid ⌈rows / G⌉, block 32·W·G threads (G = ⌊8 / W⌋ row groups).
#define NORM_FWD_WIDE(B16, SUFFIX)                                                                                                              \
    extern "C" __global__ void __launch_bounds__(NORM_WIDE_THREADS) layer_norm_fwd_wide##SUFFIX(Fv x, const float* w, const float* b, Fv y, float* mean, float* rstd, long long rows, long long dim, double eps, int row_warps) { \
        norm_fwd_wide<B16, true>(x, w, b, y, mean, rstd, rows, dim, eps, row_warps);                                                           \
    }                                                                                                                                            \
    extern "C" __global__ void __launch_bounds__(NORM_WIDE_THREADS) rms_norm_fwd_wide##SUFFIX(Fv x, const float* w, Fv y, float* rstd, long long rows, long long dim, double eps, int row_warps) { \
        norm_fwd_wide<B16, false>(x, w, nullptr, y, nullptr, rstd, rows, dim, eps, row_warps);                                                  \
    }
NORM_FWD_WIDE(true, _bf16)
NORM_FWD_WIDE(false, _f32)

// A backward's two row sums over the thread's row group, (Σ g, Σ g·xhat) (Σ g only for LN),
// in every thread of the group, as group_sum. Rows alternate between two slot buffers, so a
// warp writes a buffer again only after every warp of its group has passed the barrier of the
// row between, that is, has read it.
template <bool LN>
__device__ __forceinline__ double2 group_sums(double sg, double sgx, double2* slot, const WideAt& at) {
    if (LN) sg = warp_sum_d(sg);
    sgx = warp_sum_d(sgx);
    if ((threadIdx.x & 31) == 0) slot[threadIdx.x >> 5] = make_double2(sg, sgx);
    group_barrier(at);
    double2 s = make_double2(0.0, 0.0);
    for (int u = at.g * at.row_warps; u < (at.g + 1) * at.row_warps; u++) {
        if (LN) s.x += slot[u].x;
        s.y += slot[u].y;
    }
    return s;
}

// Loads row r's vectors of dy and x that a wide thread owns, and the row's mean (LN) and rstd.
template <bool LN, typename Raw>
__device__ __forceinline__ void wide_row_load(Fv dy, Fv x, const float* mean, const float* rstd, long long r, long long dim, const WideAt& at, Raw (&rd)[NORM_WIDE_VECS], Raw (&rx)[NORM_WIDE_VECS], float& mf, float& rf) {
#pragma unroll
    for (int k = 0; k < NORM_WIDE_VECS; k++) {
        long long j = at.j0 + at.step * k;
        if (j < dim) {
            ld_raw(dy.p, (r * dim + j) / 8, rd[k]);
            ld_raw(x.p, (r * dim + j) / 8, rx[k]);
        }
    }
    mf = LN ? mean[r] : 0.0f;
    rf = rstd[r];
}

// One row of a wide backward, its dy (rd) and x (rx) loaded: adds the row to the thread's
// column sums (aw, ab), reduces the row sums over the group (`slot`: this row's buffer) and
// writes the row's dx (at element offset o), as norm_bwd_fused does.
template <bool LN, typename Raw>
__device__ __forceinline__ void wide_bwd_row(const Raw (&rd)[NORM_WIDE_VECS], const Raw (&rx)[NORM_WIDE_VECS], const float* w, float mf, float rf, Fv dx, long long o, long long dim, const WideAt& at, double2* slot, int accumulate_dx, float (&aw)[NORM_WIDE_VECS][8], float (&ab)[NORM_WIDE_VECS][8]) {
    double sg = 0.0, sgx = 0.0;
#pragma unroll
    for (int k = 0; k < NORM_WIDE_VECS; k++) {
        long long j = at.j0 + at.step * k;
        if (j < dim) bwd_sums<LN>(rd[k], rx[k], ld8_f32(w, j), mf, rf, sg, sgx, aw[k], ab[k]);
    }
    // An accumulated dx is loaded before the row's reductions, which hide its latency.
    Raw rdx[NORM_WIDE_VECS];
#pragma unroll
    for (int k = 0; k < NORM_WIDE_VECS; k++) {
        long long j = at.j0 + at.step * k;
        if (accumulate_dx && j < dim) ld_raw(dx.p, (o + j) / 8, rdx[k]);
    }
    double2 s = group_sums<LN>(sg, sgx, slot, at);
    float mean_g = LN ? (float)(s.x / (double)dim) : 0.0f, mean_gx = (float)(s.y / (double)dim);
#pragma unroll
    for (int k = 0; k < NORM_WIDE_VECS; k++) {
        long long j = at.j0 + at.step * k;
        if (j < dim) {
            F8 acc;
            if (accumulate_dx) acc = widen(rdx[k]);
            st8(dx, (o + j) / 8, bwd_dx<LN>(rd[k], rx[k], ld8_f32(w, j), mf, rf, mean_g, mean_gx, acc, accumulate_dx));
        }
    }
}

// The column sums of a wide backward's block: for each sum (dw, then db when `with_db`) and
// each vector k, every group's f32 sums of its columns through shared memory, added in group
// order in double: part[c, j] (dw), part[blocks + c, j] (db), as norm_bwd_fused writes them.
// Thread t of group g holds columns 256·W·k + 8·t + e.
template <bool LN>
__device__ __forceinline__ void wide_bwd_partials(const float (&aw)[NORM_WIDE_VECS][8], const float (&ab)[NORM_WIDE_VECS][8], float* part, long long dim, const WideAt& at, int with_db) {
    // 16-byte aligned: each thread stores its 8 columns as two float4s.
    __shared__ __align__(16) float red[8 * NORM_WIDE_THREADS];
    int cols = 256 * at.row_warps, groups = (blockDim.x >> 5) / at.row_warps;
#pragma unroll
    for (int q = 0; q < 2; q++) {
        if (q == 1 && !(LN && with_db)) break;
#pragma unroll
        for (int k = 0; k < NORM_WIDE_VECS; k++) {
            const float* a = q == 0 ? aw[k] : ab[k];
            __syncthreads();
            float4* mine = (float4*)&red[at.g * cols + 8 * at.t];
            mine[0] = make_float4(a[0], a[1], a[2], a[3]);
            mine[1] = make_float4(a[4], a[5], a[6], a[7]);
            __syncthreads();
            for (int c = threadIdx.x; c < cols; c += blockDim.x) {
                long long col = (long long)cols * k + c;
                if (col < dim) {
                    double s = 0.0;
                    for (int u = 0; u < groups; u++) s += (double)red[u * cols + c];
                    part[((long long)q * gridDim.x + blockIdx.x) * dim + col] = (float)s;
                }
            }
        }
    }
}

// A wide fused LayerNorm (LN) or RMSNorm backward: norm_bwd_fused with each row split over a
// row group of `row_warps` warps. Block c (G = blockDim.x / (32·row_warps) groups) owns rows
// [c·band, (c+1)·band); group g takes rows g, g + G, … of the band, each thread its vectors
// of the row's dy and x (and an accumulated dx) as stored, and its columns' Σ dy·xhat and
// Σ dy over the group's rows in f32 registers. With `PF` a group loads its next row before
// working on the current one, so its loads overlap its arithmetic and barrier (twice the row
// registers: for bf16, whose rows take half those of f32).
template <bool B16, bool LN, bool PF>
__device__ __forceinline__ void norm_bwd_wide(Fv dy, Fv x, const float* w, const float* mean, const float* rstd, Fv dx, float* part, long long rows, long long dim, long long band, int row_warps, int accumulate_dx, int with_db) {
    typedef typename RawOf<B16>::T Raw;
    __shared__ double2 rowred[2][NORM_WIDE_THREADS / 32];
    WideAt at = wide_at(row_warps);
    int groups = (blockDim.x >> 5) / row_warps, buf = 0;
    float aw[NORM_WIDE_VECS][8], ab[NORM_WIDE_VECS][8];
#pragma unroll
    for (int k = 0; k < NORM_WIDE_VECS; k++) {
#pragma unroll
        for (int e = 0; e < 8; e++) { aw[k][e] = 0.0f; ab[k][e] = 0.0f; }
    }
    long long r = blockIdx.x * band + at.g, r1 = min(rows, (blockIdx.x + 1) * band);
    Raw rd[NORM_WIDE_VECS], rx[NORM_WIDE_VECS];
    float mf = 0.0f, rf = 0.0f;
    if (PF && r < r1) wide_row_load<LN>(dy, x, mean, rstd, r, dim, at, rd, rx, mf, rf);
    for (; r < r1; r += groups, buf ^= 1) {
        Raw nd[NORM_WIDE_VECS], nx[NORM_WIDE_VECS];
        float nmf = 0.0f, nrf = 0.0f;
        if (!PF) wide_row_load<LN>(dy, x, mean, rstd, r, dim, at, rd, rx, mf, rf);
        else if (r + groups < r1) wide_row_load<LN>(dy, x, mean, rstd, r + groups, dim, at, nd, nx, nmf, nrf);
        wide_bwd_row<LN>(rd, rx, w, mf, rf, dx, r * dim, dim, at, rowred[buf], accumulate_dx, aw, ab);
        if (PF) {
#pragma unroll
            for (int k = 0; k < NORM_WIDE_VECS; k++) { rd[k] = nd[k]; rx[k] = nx[k]; }
            mf = nmf;
            rf = nrf;
        }
    }
    wide_bwd_partials<LN>(aw, ab, part, dim, at, with_db);
}

// Launch: at most 128 blocks of row bands, block 32·W·G threads (G = ⌊8 / W⌋ row groups),
// then norm_bwd_fused_finish. bf16 prefetches (ptxas, sm_90a: 230 registers for LN, 196 for
// RMS), f32 does not (232, 202): one block of 8 warps an SM either way.
#define NORM_BWD_WIDE(B16, PF, SUFFIX)                                                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_WIDE_THREADS, 1) layer_norm_bwd_wide##SUFFIX(Fv dy, Fv x, const float* w, const float* mean, const float* rstd, Fv dx, float* part, long long rows, long long dim, long long band, int row_warps, int accumulate_dx, int with_db) { \
        norm_bwd_wide<B16, true, PF>(dy, x, w, mean, rstd, dx, part, rows, dim, band, row_warps, accumulate_dx, with_db);                     \
    }                                                                                                                                            \
    extern "C" __global__ void __launch_bounds__(NORM_WIDE_THREADS, 1) rms_norm_bwd_wide##SUFFIX(Fv dy, Fv x, const float* w, const float* rstd, Fv dx, float* part, long long rows, long long dim, long long band, int row_warps, int accumulate_dx) { \
        norm_bwd_wide<B16, false, PF>(dy, x, w, nullptr, rstd, dx, part, rows, dim, band, row_warps, accumulate_dx, 0);                        \
    }
NORM_BWD_WIDE(true, true, _bf16)
NORM_BWD_WIDE(false, false, _f32)

// ---------------------------------------------------------------- cross-entropy
// The split form (vocab split across tensor-parallel ranks): one pass over the [rows, vocab]
// logits per op. Logits and dlogits are `Fv`; the reductions are f32.
__device__ __forceinline__ long long local_column(int target, long long vocab_start, long long vocab_local) {
    long long c = (long long)target - vocab_start;
    return (c >= 0 && c < vocab_local) ? c : -1;
}

extern "C" __global__ void ce_max(Fv logits, float* max, long long vocab) {
    long long r = blockIdx.x;
    float m = NEG_INF;
    for (long long j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, ld(logits, r * vocab + j));
    m = block_max(m);
    if (threadIdx.x == 0) max[r] = m;
}

extern "C" __global__ void ce_sum_exp(Fv logits, const float* max, float* sumexp, long long vocab) {
    long long r = blockIdx.x;
    float m = max[r];
    double s = 0.0;
    for (long long j = threadIdx.x; j < vocab; j += blockDim.x) s += (double)expf(ld(logits, r * vocab + j) - m);
    s = block_sum_d(s);
    if (threadIdx.x == 0) sumexp[r] = (float)s;
}

extern "C" __global__ void ce_target_logit(Fv logits, const int* targets, float* out, long long rows, long long vocab_start, long long vocab_local) {
    long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (r >= rows) return;
    long long c = local_column(targets[r], vocab_start, vocab_local);
    out[r] = c >= 0 ? ld(logits, r * vocab_local + c) : 0.0f;
}

// One block: loss[0] += scale · Σ (ln sumexp + max − target_logit).
extern "C" __global__ void ce_loss(const float* max, const float* sumexp, const float* target_logit, float* loss, long long rows, double scale) {
    double s = 0.0;
    for (long long r = threadIdx.x; r < rows; r += blockDim.x)
        s += log((double)sumexp[r]) + (double)max[r] - (double)target_logit[r];
    s = block_sum_d(s);
    if (threadIdx.x == 0) loss[0] = (float)((double)loss[0] + scale * s);
}

__device__ __forceinline__ float ce_grad_element(float logit, long long j, long long target_col, float max, float sumexp, float scale) {
    float d = (scale / sumexp) * expf(logit - max);
    if (target_col == j) d -= scale;
    return d;
}

// dlogits = scale · (softmax − onehot(target)), without storing probabilities (in an fp16 run
// `scale` includes the loss scale). Vectors of 8 where vocab_local is a multiple of 8.
extern "C" __global__ void ce_grad(Fv logits, const int* targets, const float* max, const float* sumexp, Fv dlogits, long long rows, long long vocab_start, long long vocab_local, float scale) {
    if (vocab_local % 8 == 0 && vec_ok(logits) && vec_ok(dlogits)) {
        long long v8 = vocab_local / 8;
        GRID_STRIDE(q, rows * v8) {
            long long r = q / v8, j0 = (q % v8) * 8;
            long long t = local_column(targets[r], vocab_start, vocab_local);
            float m = max[r], se = sumexp[r];
            F8 x = ld8(logits, q), d;
#pragma unroll
            for (int k = 0; k < 8; k++) d.v[k] = ce_grad_element(x.v[k], j0 + k, t, m, se, scale);
            st8(dlogits, q, d);
        }
        return;
    }
    GRID_STRIDE(i, rows * vocab_local) {
        long long r = i / vocab_local, j = i % vocab_local;
        long long t = local_column(targets[r], vocab_start, vocab_local);
        st(dlogits, i, ce_grad_element(ld(logits, i), j, t, max[r], sumexp[r], scale));
    }
}

// ---------------------------------------------------------------- optimizer
// Infinite or NaN (exponent bits all set).
__device__ __forceinline__ bool not_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

// coef = min(1, max_norm / (√sumsq / loss_scale + 1e-6)) / loss_scale, without clipping (max_norm
// < 0) 1 / loss_scale. With `scaled` (always set by the runtime) a sumsq that is not finite
// marks the step: coef = NaN, which the update kernels skip (fp16 overflow, train.on_nonfinite).
extern "C" __global__ void clip_coef(const float* sumsq, float* coef, double max_norm, double loss_scale, int scaled) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        if (scaled && not_finite(sumsq[0])) {
            coef[0] = __int_as_float(0x7fc00000);
            return;
        }
        double c = 1.0;
        if (max_norm >= 0.0) {
            c = max_norm / (sqrt((double)sumsq[0]) / loss_scale + 1e-6);
            c = c < 1.0 ? c : 1.0;
        }
        coef[0] = (float)(c / loss_scale);
    }
}
