// Optimizer updates: AdamW and SGD, per tensor (`adamw`, `sgd`: one launch per parameter) and
// multi-tensor (`adamw_multi`, `sgd_multi`: one launch per run of optimizer instructions, see
// runtime/src/cuda/optimizer.rs). Both forms call the same per-element functions, so a fused
// update is bit-identical to the per-tensor one. Uses not_finite (norm_loss.cu) and GRID_STRIDE
// (elementwise.cu), which come earlier in the concatenated source.

// One element of AdamW; cf is the (finite) clip coefficient.
__device__ __forceinline__ void adamw_element(const float* g, float* param, float* m, float* v, long long i, float cf, float beta1, float beta2, float eps, float wd, float lr, float bias1, float bias2) {
    float gi = cf * g[i];
    float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    float m_hat = mi / bias1, v_hat = vi / bias2;
    float p = param[i];
    param[i] = p - lr * (m_hat / (sqrtf(v_hat) + eps) + wd * p);
}

// One element of SGD; buf == null: plain SGD; first != 0: buf = g' (the first step).
__device__ __forceinline__ void sgd_element(const float* g, float* param, float* buf, long long i, float cf, float momentum, float wd, float lr, int first) {
    float p = param[i];
    float gi = cf * g[i] + wd * p;
    if (buf) {
        float b = first ? gi : momentum * buf[i] + gi;
        buf[i] = b;
        param[i] = p - lr * b;
    } else {
        param[i] = p - lr * gi;
    }
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

// One tensor of a multi-tensor launch (56 bytes; the host writes the same layout, see
// optimizer.rs `TENSOR_BYTES`). AdamW: state0 = m, state1 = v. SGD: state0 = the momentum
// buffer (null without momentum), state1 unused (null).
struct OptTensor {
    const float* g;
    const float* coef;
    float* param;
    float* state0;
    float* state1;
    long long n;
    float wd;
    int unused;
};

// One block's work: elements [start, min(start + chunk_len, n)) of tensor `tensor`.
struct OptChunk {
    long long tensor;
    long long start;
};

extern "C" __global__ void adamw_multi(const OptTensor* tensors, const OptChunk* chunks, long long chunk_len, float beta1, float beta2, float eps, float lr, float bias1, float bias2) {
    OptChunk c = chunks[blockIdx.x];
    OptTensor t = tensors[c.tensor];
    float cf = t.coef[0];
    if (not_finite(cf)) return;
    long long end = c.start + chunk_len < t.n ? c.start + chunk_len : t.n;
    for (long long i = c.start + threadIdx.x; i < end; i += blockDim.x) {
        adamw_element(t.g, t.param, t.state0, t.state1, i, cf, beta1, beta2, eps, t.wd, lr, bias1, bias2);
    }
}

extern "C" __global__ void sgd_multi(const OptTensor* tensors, const OptChunk* chunks, long long chunk_len, float momentum, float lr, int first) {
    OptChunk c = chunks[blockIdx.x];
    OptTensor t = tensors[c.tensor];
    float cf = t.coef[0];
    if (not_finite(cf)) return;
    long long end = c.start + chunk_len < t.n ? c.start + chunk_len : t.n;
    for (long long i = c.start + threadIdx.x; i < end; i += blockDim.x) {
        sgd_element(t.g, t.param, t.state0, i, cf, momentum, t.wd, lr, first);
    }
}
