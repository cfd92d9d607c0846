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
// < 0) 1 / loss_scale. With `scaled` (fp16 loss scaling) a sumsq that is not finite marks an
// overflowed step: coef = NaN, which the update kernels skip.
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
