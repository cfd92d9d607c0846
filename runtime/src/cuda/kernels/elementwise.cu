// Elementwise ops, embeddings, RoPE and conversions. Float operands are `Fv` (f32 or bf16,
// common.cuh); the memory-bound kernels move 8 elements per 16-byte access where their operands
// are aligned (map1/map2) and are launched with ~n / 8 threads (`CudaBackend::launch_vec`).
// Activations and SwiGLU compute in f32 with the CPU backend's formulas, operation for operation
// (runtime/src/cpu/elementwise.rs: gelu_tanh through 0.5·(1 + tanh u) = σ(2u), one exponential
// per element): f64 math made GELU compute-bound (H200 runs f64 at half the f32 rate, and
// f64 tanh/erf take many more instructions).

#define SQRT_2_OVER_PI 0.7978846f
#define GELU_TANH_CUBIC 0.044715f
#define INV_SQRT_2 0.70710677f
#define INV_SQRT_2PI 0.3989423f

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// act: the activation's position in parc_compiler::ir::op::Act::ALL (`Act::code`):
// 0 = gelu (erf), 1 = gelu_tanh, 2 = relu, 3 = silu.
__device__ __forceinline__ float act_value(int act, float x) {
    if (act == 0) return 0.5f * x * (1.0f + erff(x * INV_SQRT_2));
    if (act == 1) {
        float u = SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x);
        return x * sigmoid_f(2.0f * u);
    }
    if (act == 3) return x * sigmoid_f(x);
    return fmaxf(x, 0.0f);
}

__device__ __forceinline__ float act_derivative(int act, float x) {
    if (act == 0) {
        float cdf = 0.5f * (1.0f + erff(x * INV_SQRT_2));
        return cdf + x * INV_SQRT_2PI * expf(-0.5f * x * x);
    }
    if (act == 1) {
        // d/dx x·σ(2u) = σ(2u) + x·σ(2u)(1 − σ(2u))·2u'.
        float u = SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x);
        float du = SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_TANH_CUBIC * x * x);
        float s = sigmoid_f(2.0f * u);
        return s + x * s * (1.0f - s) * 2.0f * du;
    }
    if (act == 3) {
        // d/dx x·σ(x) = σ(x)·(1 + x·(1 − σ(x))).
        float s = sigmoid_f(x);
        return s * (1.0f + x * (1.0f - s));
    }
    return x > 0.0f ? 1.0f : 0.0f;
}

extern "C" __global__ void activation_fwd(int act, Fv x, Fv y, long long n) {
    map1(x, y, n, [act](float v) { return act_value(act, v); });
}

extern "C" __global__ void activation_bwd(int act, Fv dy, Fv x, Fv dx, long long n) {
    map2(dy, x, dx, n, [act](float d, float v) { return d * act_derivative(act, v); });
}

extern "C" __global__ void swiglu_fwd(Fv gate, Fv up, Fv y, long long n) {
    map2(gate, up, y, n, [](float g, float u) { return g * sigmoid_f(g) * u; });
}

__device__ __forceinline__ void swiglu_bwd_element(float dy, float g, float u, float& dg, float& du) {
    float s = sigmoid_f(g);
    dg = dy * u * s * (1.0f + g * (1.0f - s));
    du = dy * g * s;
}

extern "C" __global__ void swiglu_bwd(Fv dy, Fv gate, Fv up, Fv dgate, Fv dup, long long n) {
    bool vec = vec_ok(dy) && vec_ok(gate) && vec_ok(up) && vec_ok(dgate) && vec_ok(dup);
    long long n8 = vec ? n / 8 : 0;
    GRID_STRIDE(j, n8) {
        F8 d = ld8(dy, j), g = ld8(gate, j), u = ld8(up, j), rg, ru;
#pragma unroll
        for (int k = 0; k < 8; k++) swiglu_bwd_element(d.v[k], g.v[k], u.v[k], rg.v[k], ru.v[k]);
        st8(dgate, j, rg);
        st8(dup, j, ru);
    }
    GRID_STRIDE(t, n - 8 * n8) {
        long long i = 8 * n8 + t;
        float rg, ru;
        swiglu_bwd_element(ld(dy, i), ld(gate, i), ld(up, i), rg, ru);
        st(dgate, i, rg);
        st(dup, i, ru);
    }
}

extern "C" __global__ void add_fwd(Fv a, Fv b, Fv y, long long n) {
    map2(a, b, y, n, [](float u, float v) { return u + v; });
}

extern "C" __global__ void scale_fwd(Fv x, Fv y, float factor, long long n) {
    map1(x, y, n, [factor](float v) { return factor * v; });
}

// y = x converted between f32 and bf16 (Copy / CopyRange across types; the host offsets the
// pointers).
extern "C" __global__ void convert(Fv x, Fv y, long long n) {
    map1(x, y, n, [](float v) { return v; });
}

// y[r · y_ld + c] = x[r · x_ld + c] for c < width (SplitColumns / ConcatColumns: one column
// block a launch; the host offsets the pointers to the block's first column), converting
// between f32 and bf16. 8-element vectors where the width, both row strides and both pointers
// allow them (a fused q/k/v projection's blocks always do).
extern "C" __global__ void copy_columns(Fv x, long long x_ld, Fv y, long long y_ld, long long rows, long long width) {
    bool vec = width % 8 == 0 && x_ld % 8 == 0 && y_ld % 8 == 0 && vec_ok(x) && vec_ok(y);
    if (vec) {
        long long w8 = width / 8;
        GRID_STRIDE(j, rows * w8) {
            long long r = j / w8, c8 = j % w8;
            st8(y, (r * y_ld) / 8 + c8, ld8(x, (r * x_ld) / 8 + c8));
        }
    } else {
        GRID_STRIDE(i, rows * width) {
            long long r = i / width, c = i % width;
            st(y, r * y_ld + c, ld(x, r * x_ld + c));
        }
    }
}

// y[r, c] = b[c]: the bias a GEMM with beta = 1 then adds x Wᵀ to.
// y (f32, or bf16: each value rounded) = b in every row.
extern "C" __global__ void broadcast_rows(const float* b, Fv y, long long rows, long long cols) {
    GRID_STRIDE(i, rows * cols) st(y, i, b[i % cols]);
}

// Rows whose id is outside [vocab_start, vocab_start + vocab_local) are zero. The table is f32
// or bf16 (a bf16 run's working copy). Vectors of 8 where dim is a multiple of 8 and table and
// y are aligned.
extern "C" __global__ void embedding_fwd(const int* ids, Fv table, Fv y, long long rows, long long dim, long long vocab_start, long long vocab_local) {
    bool vec = dim % 8 == 0 && vec_ok(y) && vec_ok(table);
    if (vec) {
        long long d8 = dim / 8;
        GRID_STRIDE(j, rows * d8) {
            long long r = j / d8;
            long long local = (long long)ids[r] - vocab_start;
            F8 v;
            if (local >= 0 && local < vocab_local) {
                v = ld8(table, local * d8 + j % d8);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) v.v[k] = 0.0f;
            }
            st8(y, j, v);
        }
        return;
    }
    GRID_STRIDE(i, rows * dim) {
        long long r = i / dim, c = i % dim;
        long long local = (long long)ids[r] - vocab_start;
        st(y, i, (local >= 0 && local < vocab_local) ? ld(table, local * dim + c) : 0.0f);
    }
}

extern "C" __global__ void embedding_bwd(const int* ids, Fv dy, float* dtable, long long rows, long long dim, long long vocab_start, long long vocab_local) {
    GRID_STRIDE(i, rows * dim) {
        long long r = i / dim, c = i % dim;
        long long local = (long long)ids[r] - vocab_start;
        if (local >= 0 && local < vocab_local) atomicAdd(&dtable[local * dim + c], ld(dy, i));
    }
}

// pos[s]: global position of local sequence index s; row = s * batch + b. The table is f32 or
// bf16. Vectors of 8 as embedding_fwd.
extern "C" __global__ void position_add_fwd(Fv x, Fv table, Fv y, const int* pos, long long rows, long long batch, long long dim) {
    bool vec = dim % 8 == 0 && vec_ok(x) && vec_ok(y) && vec_ok(table);
    if (vec) {
        long long d8 = dim / 8;
        GRID_STRIDE(j, rows * d8) {
            long long r = j / d8;
            F8 t = ld8(table, (long long)pos[r / batch] * d8 + j % d8);
            F8 v = ld8(x, j);
#pragma unroll
            for (int k = 0; k < 8; k++) v.v[k] = v.v[k] + t.v[k];
            st8(y, j, v);
        }
        return;
    }
    GRID_STRIDE(i, rows * dim) {
        long long r = i / dim, c = i % dim;
        st(y, i, ld(x, i) + ld(table, (long long)pos[r / batch] * dim + c));
    }
}

// One thread per (s, c): sums the batch's rows of position s, then adds into dtable.
extern "C" __global__ void position_add_bwd(Fv dy, float* dtable, const int* pos, long long seq, long long batch, long long dim) {
    GRID_STRIDE(i, seq * dim) {
        long long s = i / dim, c = i % dim;
        float acc = 0.0f;
        for (long long b = 0; b < batch; b++) acc += ld(dy, (s * batch + b) * dim + c);
        atomicAdd(&dtable[(long long)pos[s] * dim + c], acc);
    }
}

// RoPE's frequency scaling (cuda/elementwise.rs `RopeScale::of`): kind 0 none, 1 linear
// (factor), 2 llama3 (factor, low_freq_factor, high_freq_factor, original_max_position).
struct RopeScale {
    int kind;
    double factor, low, high, original;
};

// The inverse frequency of pair i of a head's rot turned features: theta^(-2i/rot), scaled. This is
// compiler/src/ir/rope.rs's inv_freq (the one definition) operation for operation in double
// (--fmad=false keeps every product and sum rounded as written); tests/cuda_ops compares the
// two through the rotations. Unscaled (kind 0) it is the plain power, as before scaling existed.
__device__ __forceinline__ double rope_inv_freq(double theta, long long i, long long head_dim, RopeScale sc) {
    double base = pow(theta, -2.0 * (double)i / (double)head_dim);
    if (sc.kind == 1) return base / sc.factor;
    if (sc.kind != 2) return base;
    double wavelen = 6.283185307179586 / base;
    if (wavelen < sc.original / sc.high) return base;
    if (wavelen > sc.original / sc.low) return base / sc.factor;
    double smooth = (sc.original / wavelen - sc.low) / (sc.high - sc.low);
    return (1.0 - smooth) * base / sc.factor + smooth * base;
}

// Rotate-half RoPE over each head's first rot features (rot = head_dim but for a partial
// RoPE, whose other features are copied); sign = -1 applies the inverse rotation (the backward).
extern "C" __global__ void rope_fwd(Fv x, Fv y, const int* pos, long long rows, long long batch, long long heads, long long head_dim, long long rot, double theta, RopeScale sc, double sign) {
    long long half = rot / 2, kept = head_dim - rot;
    GRID_STRIDE(t, rows * heads * half) {
        long long i = t % half, h = (t / half) % heads, r = t / (half * heads);
        double inv_freq = rope_inv_freq(theta, i, rot, sc);
        double angle = sign * (double)pos[r / batch] * inv_freq;
        float c = (float)cos(angle), s = (float)sin(angle);
        long long base = r * heads * head_dim + h * head_dim;
        float lo = ld(x, base + i), hi = ld(x, base + i + half);
        st(y, base + i, lo * c - hi * s);
        st(y, base + i + half, hi * c + lo * s);
    }
    GRID_STRIDE(t, rows * heads * kept) {
        long long e = (t / kept) * head_dim + rot + t % kept;
        st(y, e, ld(x, e));
    }
}

// The cos/sin table a fused rope reads (Op::RopeTable): per local position s, cos(angle_i) in
// columns c < rot and -sin / +sin(angle_i) in columns head_dim + c (- in the first half of the
// turned features), i = c mod rot/2, the angle computed as rope_fwd computes it (sign 1); 1 and
// 0 in the columns of a partial RoPE's kept features, which a fused rope so passes unchanged.
extern "C" __global__ void rope_table(float* table, const int* pos, long long positions, long long head_dim, long long rot, double theta, RopeScale sc) {
    long long half = rot / 2, kept = head_dim - rot;
    GRID_STRIDE(t, positions * half) {
        long long i = t % half, s = t / half;
        double inv_freq = rope_inv_freq(theta, i, rot, sc);
        double angle = 1.0 * (double)pos[s] * inv_freq;
        float c = (float)cos(angle), sn = (float)sin(angle);
        float* row = table + s * 2 * head_dim;
        row[i] = c;
        row[i + half] = c;
        row[head_dim + i] = -sn;
        row[head_dim + half + i] = sn;
    }
    GRID_STRIDE(t, positions * kept) {
        float* row = table + (t / kept) * 2 * head_dim + rot + t % kept;
        row[0] = 1.0f;
        row[head_dim] = 0.0f;
    }
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
