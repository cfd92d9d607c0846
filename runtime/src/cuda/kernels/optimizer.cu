// Optimizer updates: AdamW and SGD, per tensor (`adamw`, `sgd`: one launch per parameter) and
// multi-tensor (`adamw_multi`, `sgd_multi`: one launch per run of optimizer instructions, see
// runtime/src/cuda/optimizer.rs). Both forms call the same per-element functions, so a fused
// update is bit-identical to the per-tensor one. A multi-tensor launch also makes the refresh
// copies its run absorbed (parc_compiler::ir::optimizer_runs::Refresh): each such tensor's bf16
// working copy gets the updated param rounded by round_bf16, the f32 -> bf16 `Copy`'s rounding
// (the `convert` kernel's), so it is bit-identical to the update followed by the Copy, a skipped
// step included. Uses not_finite (norm_loss.cu) and GRID_STRIDE and round_bf16 (common.cuh),
// which come earlier in the concatenated source. The multi-tensor kernels load
// OPT_UNROLL elements' operands before updating any (the state may alias nothing the compiler
// can prove, so a plain loop waits for each element's stores before the next loads).
#define OPT_UNROLL 4

// AdamW on one element's values; cf is the (finite) clip coefficient.
__device__ __forceinline__ void adamw_update(float g, float& p, float& m, float& v, float cf, float beta1, float beta2, float eps, float wd, float lr, float bias1, float bias2) {
    float gi = cf * g;
    float mi = beta1 * m + (1.0f - beta1) * gi;
    float vi = beta2 * v + (1.0f - beta2) * gi * gi;
    m = mi;
    v = vi;
    float m_hat = mi / bias1, v_hat = vi / bias2;
    p = p - lr * (m_hat / (sqrtf(v_hat) + eps) + wd * p);
}

// One element of AdamW in place; returns the updated param.
__device__ __forceinline__ float adamw_element(const float* g, float* param, float* m, float* v, long long i, float cf, float beta1, float beta2, float eps, float wd, float lr, float bias1, float bias2) {
    float p = param[i], mi = m[i], vi = v[i];
    adamw_update(g[i], p, mi, vi, cf, beta1, beta2, eps, wd, lr, bias1, bias2);
    m[i] = mi;
    v[i] = vi;
    param[i] = p;
    return p;
}

// SGD on one element's values; has_buf false: plain SGD; first != 0: buf = g' (the first step).
__device__ __forceinline__ void sgd_update(float g, float& p, float& b, bool has_buf, float cf, float momentum, float wd, float lr, int first) {
    float gi = cf * g + wd * p;
    if (has_buf) {
        b = first ? gi : momentum * b + gi;
        p = p - lr * b;
    } else {
        p = p - lr * gi;
    }
}

// One element of SGD in place; buf == null: plain SGD.
__device__ __forceinline__ void sgd_element(const float* g, float* param, float* buf, long long i, float cf, float momentum, float wd, float lr, int first) {
    float p = param[i], b = (buf && !first) ? buf[i] : 0.0f;
    sgd_update(g[i], p, b, buf != nullptr, cf, momentum, wd, lr, first);
    if (buf) buf[i] = b;
    param[i] = p;
}

// A non-finite coef (an overflowed fp16 step) leaves param, m and v untouched.
extern "C" __global__ void adamw(const float* g, const float* coef, float* param, float* m, float* v, long long n, float beta1, float beta2, float eps, float wd, float lr, float bias1, float bias2) {
    float cf = coef[0];
    if (not_finite(cf)) return;
    GRID_STRIDE(i, n) adamw_element(g, param, m, v, i, cf, beta1, beta2, eps, wd, lr, bias1, bias2);
}

// A non-finite coef (an overflowed fp16 step) leaves param and buf untouched.
extern "C" __global__ void sgd(const float* g, const float* coef, float* param, float* buf, long long n, float momentum, float wd, float lr, int first) {
    float cf = coef[0];
    if (not_finite(cf)) return;
    GRID_STRIDE(i, n) sgd_element(g, param, buf, i, cf, momentum, wd, lr, first);
}

// One tensor of a multi-tensor launch (64 bytes; the host writes the same layout, see
// optimizer.rs `TENSOR_BYTES`). AdamW: state0 = m, state1 = v. SGD: state0 = the momentum
// buffer (null without momentum), state1 unused (null). working: the bf16 working copy whose
// refresh copy the run absorbed (raw bf16 bits), null for none.
struct OptTensor {
    const float* g;
    const float* coef;
    float* param;
    float* state0;
    float* state1;
    unsigned short* working;
    long long n;
    float wd;
    int unused;
};

// The refresh copy of element i: the working copy (if any) gets p rounded to bf16.
__device__ __forceinline__ void opt_refresh(unsigned short* working, long long i, float p) {
    if (working) working[i] = round_bf16(p);
}

// The refresh copy of elements 4q .. 4q+3 in one 8-byte store (opt_refresh_ok(working)).
__device__ __forceinline__ void opt_refresh4(unsigned short* working, long long q, float4 p) {
    if (!working) return;
    uint2 w;
    w.x = (unsigned)round_bf16(p.x) | ((unsigned)round_bf16(p.y) << 16);
    w.y = (unsigned)round_bf16(p.z) | ((unsigned)round_bf16(p.w) << 16);
    ((uint2*)working)[q] = w;
}

// Whether 4-element groups of the working copy start on 8-byte boundaries (none: trivially).
__device__ __forceinline__ bool opt_refresh_ok(const unsigned short* working) {
    return ((unsigned long long)working & 7ull) == 0;
}

// A chunk of a tensor whose coefficient is not finite (a skipped step): param and state stay
// untouched, but the refresh copy still runs, as the Copy after the skipped update does.
__device__ __forceinline__ void opt_refresh_only(const OptTensor& t, long long start, long long end) {
    if (!t.working) return;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x)
        t.working[i] = round_bf16(t.param[i]);
}

// One block's work: elements [start, min(start + chunk_len, n)) of tensor `tensor`.
struct OptChunk {
    long long tensor;
    long long start;
};

// Whether every pointer starts on a 16-byte boundary (float4 access).
__device__ __forceinline__ bool opt_vec_ok(const void* a, const void* b, const void* c, const void* d) {
    return (((unsigned long long)a | (unsigned long long)b | (unsigned long long)c | (unsigned long long)d) & 15ull) == 0;
}

// AdamW on 4 consecutive elements held in float4s.
__device__ __forceinline__ void adamw_update4(float4 g, float4& p, float4& m, float4& v, float cf, float beta1, float beta2, float eps, float wd, float lr, float bias1, float bias2) {
    adamw_update(g.x, p.x, m.x, v.x, cf, beta1, beta2, eps, wd, lr, bias1, bias2);
    adamw_update(g.y, p.y, m.y, v.y, cf, beta1, beta2, eps, wd, lr, bias1, bias2);
    adamw_update(g.z, p.z, m.z, v.z, cf, beta1, beta2, eps, wd, lr, bias1, bias2);
    adamw_update(g.w, p.w, m.w, v.w, cf, beta1, beta2, eps, wd, lr, bias1, bias2);
}

// Where g, param, m and v are 16-byte aligned and the working copy (if any) 8-byte aligned
// (planned buffers are; chunk starts are multiples of chunk_len, a multiple of 8), a chunk moves
// in float4s (the working copy in 4 × bf16), two per thread per round (all loads before any
// store), its last n % 4 elements one at a time; else one element at a time.
extern "C" __global__ void adamw_multi(const OptTensor* tensors, const OptChunk* chunks, long long chunk_len, float beta1, float beta2, float eps, float lr, float bias1, float bias2) {
    OptChunk c = chunks[blockIdx.x];
    OptTensor t = tensors[c.tensor];
    float cf = t.coef[0];
    long long end = c.start + chunk_len < t.n ? c.start + chunk_len : t.n;
    if (not_finite(cf)) {
        opt_refresh_only(t, c.start, end);
        return;
    }
    if (c.start % 4 == 0 && opt_vec_ok(t.g, t.param, t.state0, t.state1) && opt_refresh_ok(t.working)) {
        const float4* g4 = (const float4*)t.g;
        float4 *p4 = (float4*)t.param, *m4 = (float4*)t.state0, *v4 = (float4*)t.state1;
        long long q0 = c.start / 4, q1 = end / 4;
        for (long long base = q0 + threadIdx.x; base < q1; base += 2 * (long long)blockDim.x) {
            long long q = base, r = base + blockDim.x;
            float4 ga = g4[q], pa = p4[q], ma = m4[q], va = v4[q];
            float4 gb, pb, mb, vb;
            if (r < q1) { gb = g4[r]; pb = p4[r]; mb = m4[r]; vb = v4[r]; }
            adamw_update4(ga, pa, ma, va, cf, beta1, beta2, eps, t.wd, lr, bias1, bias2);
            m4[q] = ma; v4[q] = va; p4[q] = pa;
            opt_refresh4(t.working, q, pa);
            if (r < q1) {
                adamw_update4(gb, pb, mb, vb, cf, beta1, beta2, eps, t.wd, lr, bias1, bias2);
                m4[r] = mb; v4[r] = vb; p4[r] = pb;
                opt_refresh4(t.working, r, pb);
            }
        }
        for (long long i = 4 * q1 + threadIdx.x; i < end; i += blockDim.x)
            opt_refresh(t.working, i, adamw_element(t.g, t.param, t.state0, t.state1, i, cf, beta1, beta2, eps, t.wd, lr, bias1, bias2));
        return;
    }
    for (long long base = c.start + threadIdx.x; base < end; base += OPT_UNROLL * blockDim.x) {
        float g[OPT_UNROLL], p[OPT_UNROLL], m[OPT_UNROLL], v[OPT_UNROLL];
#pragma unroll
        for (int u = 0; u < OPT_UNROLL; u++) {
            long long i = base + u * (long long)blockDim.x;
            if (i < end) { g[u] = t.g[i]; p[u] = t.param[i]; m[u] = t.state0[i]; v[u] = t.state1[i]; }
        }
#pragma unroll
        for (int u = 0; u < OPT_UNROLL; u++) {
            long long i = base + u * (long long)blockDim.x;
            if (i < end) {
                adamw_update(g[u], p[u], m[u], v[u], cf, beta1, beta2, eps, t.wd, lr, bias1, bias2);
                t.state0[i] = m[u];
                t.state1[i] = v[u];
                t.param[i] = p[u];
                opt_refresh(t.working, i, p[u]);
            }
        }
    }
}

extern "C" __global__ void sgd_multi(const OptTensor* tensors, const OptChunk* chunks, long long chunk_len, float momentum, float lr, int first) {
    OptChunk c = chunks[blockIdx.x];
    OptTensor t = tensors[c.tensor];
    float cf = t.coef[0];
    long long end = c.start + chunk_len < t.n ? c.start + chunk_len : t.n;
    if (not_finite(cf)) {
        opt_refresh_only(t, c.start, end);
        return;
    }
    bool has_buf = t.state0 != nullptr;
    for (long long base = c.start + threadIdx.x; base < end; base += OPT_UNROLL * blockDim.x) {
        float g[OPT_UNROLL], p[OPT_UNROLL], b[OPT_UNROLL];
#pragma unroll
        for (int u = 0; u < OPT_UNROLL; u++) {
            long long i = base + u * (long long)blockDim.x;
            if (i < end) { g[u] = t.g[i]; p[u] = t.param[i]; b[u] = (has_buf && !first) ? t.state0[i] : 0.0f; }
        }
#pragma unroll
        for (int u = 0; u < OPT_UNROLL; u++) {
            long long i = base + u * (long long)blockDim.x;
            if (i < end) {
                sgd_update(g[u], p[u], b[u], has_buf, cf, momentum, t.wd, lr, first);
                if (has_buf) t.state0[i] = b[u];
                t.param[i] = p[u];
                opt_refresh(t.working, i, p[u]);
            }
        }
    }
}
