// Flash-attention-2 on tensor cores, for bf16 runs with head_dim 64 or 128 (FA2's algorithm,
// written for parc's layouts): bf16 `mma.sync.m16n8k16` with fp32 accumulation, operands
// staged through shared memory as bf16 (converted from the stored element type `In` while a
// tile is loaded, so bf16 storage can plug in as another `In`), fragments read with `ldmatrix`.
// Softmax is online in fp32 registers, in log2 units (scores times scale·log2 e, exp2).
// Visibility is by global position (qpos/kvpos): with ascending positions, causal blocks skip
// whole tiles and mask only the tiles that cross the diagonal; otherwise every tile is masked.
//
// Forward: a CTA of TC_WARPS warps takes TC_BR query rows of one (batch, head), 16 per warp;
// K/V stream through shared memory in tiles of TC_BC rows. Backward (after attention_delta):
// a CTA takes TC_BC keys of one (batch, kv head), 16 per warp, loops over the GQA group's query
// heads and their query tiles, keeps dK/dV in registers and adds dQ into the (zeroed) output
// with float atomics.
#define TC_WARPS 4
#define TC_THREADS (TC_WARPS * 32)
#define TC_BR 64
#define TC_BC 64
#define TC_LOG2E 1.4426950408889634f
#define TC_LN2 0.6931471805599453f
#define TC_POS_INF __int_as_float(0x7f800000)
#define TC_INT_MAX 0x7fffffff
// float4 loads a thread keeps in flight while filling a tile.
#define TC_LOADS 8

typedef unsigned short bf16_t;

// Two floats rounded to nearest-even bf16, packed (lo in the low half).
__device__ __forceinline__ unsigned tc_pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float tc_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned tc_smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void tc_ldsm(unsigned* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(tc_smem_addr(p)));
}

__device__ __forceinline__ void tc_ldsm_t(unsigned* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(tc_smem_addr(p)));
}

// c (16x8, fp32) += a (16x16, bf16, row) * b (16x8, bf16, col).
__device__ __forceinline__ void tc_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Adds two adjacent floats into global memory (one vector reduction on sm_90).
__device__ __forceinline__ void tc_red2(float* p, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}

// Stored element type -> 4 floats.
__device__ __forceinline__ float4 tc_load4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// Fills s[ROWS][D + 8] (bf16) with rows [r0, r0 + ROWS) of one head (columns col..col+D) of a
// [seq * batch, width] tensor (sequence row j of batch b is row j * batch + b); rows past seq
// are zero.
template <int D, int ROWS, typename In>
__device__ __forceinline__ void tc_fill(bf16_t* s, const In* src, long long r0, long long seq, long long batch, long long b, long long width, long long col) {
    constexpr int PER_ROW = D / 4;
    constexpr int TOTAL = ROWS * PER_ROW / TC_THREADS;
    static_assert(TOTAL % TC_LOADS == 0, "tile fill must split into whole load batches");
    #pragma unroll
    for (int it0 = 0; it0 < TOTAL; it0 += TC_LOADS) {
        float4 x[TC_LOADS];
        #pragma unroll
        for (int u = 0; u < TC_LOADS; u++) {
            int idx = (it0 + u) * TC_THREADS + threadIdx.x;
            int r = idx / PER_ROW, c = (idx % PER_ROW) * 4;
            long long j = r0 + r;
            x[u] = j < seq ? tc_load4(src + (j * batch + b) * width + col + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        #pragma unroll
        for (int u = 0; u < TC_LOADS; u++) {
            int idx = (it0 + u) * TC_THREADS + threadIdx.x;
            int r = idx / PER_ROW, c = (idx % PER_ROW) * 4;
            *reinterpret_cast<uint2*>(s + r * (D + 8) + c) = make_uint2(tc_pack(x[u].x, x[u].y), tc_pack(x[u].z, x[u].w));
        }
    }
}

// A fragment (16x16) of rows [row0, row0 + 16), columns [col0, col0 + 16) of s (row stride ld).
__device__ __forceinline__ void tc_frag_a(unsigned* r, const bf16_t* s, int ld, int row0, int col0, int lane) {
    tc_ldsm(r, s + (row0 + (lane & 15)) * ld + col0 + (lane >> 4) * 8);
}

// B fragments of two 8-column blocks when B[k][n] = s[n][k] (s rows are B's columns):
// n in [n0, n0 + 16), k in [k0, k0 + 16); r[0..1] for n0, r[2..3] for n0 + 8.
__device__ __forceinline__ void tc_frag_b_rows(unsigned* r, const bf16_t* s, int ld, int n0, int k0, int lane) {
    tc_ldsm(r, s + (n0 + (lane & 7) + ((lane >> 4) << 3)) * ld + k0 + ((lane >> 3) & 1) * 8);
}

// B fragments of two 8-column blocks when B[k][n] = s[k][n]: k in [k0, k0 + 16), n in
// [n0, n0 + 16); r[0..1] for n0, r[2..3] for n0 + 8.
__device__ __forceinline__ void tc_frag_b_cols(unsigned* r, const bf16_t* s, int ld, int k0, int n0, int lane) {
    tc_ldsm_t(r, s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}

// A fragment when A[m][k] = s[k][m]: m in [m0, m0 + 16), k in [k0, k0 + 16).
__device__ __forceinline__ void tc_frag_a_t(unsigned* r, const bf16_t* s, int ld, int m0, int k0, int lane) {
    tc_ldsm_t(r, s + (k0 + (lane & 7) + (lane >> 4) * 8) * ld + m0 + ((lane >> 3) & 1) * 8);
}

// The A fragment of key columns [16 kk, 16 kk + 16) from accumulators c[n-block][4] (fp32).
#define TC_ACC_TO_A(a, c, kk)                                   \
    do {                                                       \
        (a)[0] = tc_pack((c)[2 * (kk)][0], (c)[2 * (kk)][1]);         \
        (a)[1] = tc_pack((c)[2 * (kk)][2], (c)[2 * (kk)][3]);         \
        (a)[2] = tc_pack((c)[2 * (kk) + 1][0], (c)[2 * (kk) + 1][1]); \
        (a)[3] = tc_pack((c)[2 * (kk) + 1][2], (c)[2 * (kk) + 1][3]); \
    } while (0)

__device__ __forceinline__ float tc_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}

__device__ __forceinline__ float tc_quad_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}

// grid: (ceil(seq_q / TC_BR), batch * heads); block: TC_THREADS;
// shared: (TC_BR + 2 TC_BC) * (D + 8) * 2 + TC_BC * 4 bytes (Q, K, V tiles, key positions).
template <int D, typename In>
__device__ __forceinline__ void tc_attention_fwd(const In* q, const In* k, const In* v, float* o, float* lse, const int* qpos, const int* kvpos, const AttGeom& g) {
    constexpr int LD = D + 8;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    bf16_t* sq = reinterpret_cast<bf16_t*>(tc_smem);
    bf16_t* sk = sq + TC_BR * LD;
    bf16_t* sv = sk + TC_BC * LD;
    int* skpos = reinterpret_cast<int*>(sv + TC_BC * LD);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    long long bh = blockIdx.y, b = bh / g.heads, h = bh % g.heads;
    long long kvh = h / (g.heads / g.kv_heads);
    // Heaviest (latest) causal blocks first.
    long long i0 = (long long)(gridDim.x - 1 - blockIdx.x) * TC_BR;
    long long qw = g.heads * D, kw = g.kv_heads * D;
    tc_fill<D, TC_BR>(sq, q, i0, g.seq_q, g.batch, b, qw, h * D);
    long long ra = i0 + warp * 16 + gq, rb = ra + 8, last = g.seq_q - 1;
    int pa = qpos[ra < last ? ra : last], pb = qpos[rb < last ? rb : last];
    int first_pos = qpos[i0], last_pos = qpos[i0 + TC_BR - 1 < last ? i0 + TC_BR - 1 : last];
    bool sorted = g.q_sorted && g.kv_sorted;
    float sl2 = g.scale * TC_LOG2E;
    float acc[D / 8][4];
    #pragma unroll
    for (int nb = 0; nb < D / 8; nb++) { acc[nb][0] = 0.0f; acc[nb][1] = 0.0f; acc[nb][2] = 0.0f; acc[nb][3] = 0.0f; }
    float ma = NEG_INF, mb = NEG_INF, la = 0.0f, lb = 0.0f;
    for (long long j0 = 0; j0 < g.seq_kv; j0 += TC_BC) {
        if (g.causal && sorted && kvpos[j0] > last_pos) break;
        long long jl = j0 + TC_BC - 1 < g.seq_kv - 1 ? j0 + TC_BC - 1 : g.seq_kv - 1;
        bool whole = j0 + TC_BC <= g.seq_kv;
        bool full = g.causal ? (sorted && whole && kvpos[jl] <= first_pos) : whole;
        __syncthreads();
        tc_fill<D, TC_BC>(sk, k, j0, g.seq_kv, g.batch, b, kw, kvh * D);
        tc_fill<D, TC_BC>(sv, v, j0, g.seq_kv, g.batch, b, kw, kvh * D);
        if (threadIdx.x < TC_BC) skpos[threadIdx.x] = j0 + threadIdx.x < g.seq_kv ? kvpos[j0 + threadIdx.x] : TC_INT_MAX;
        __syncthreads();
        float s[TC_BC / 8][4];
        #pragma unroll
        for (int nb = 0; nb < TC_BC / 8; nb++) { s[nb][0] = 0.0f; s[nb][1] = 0.0f; s[nb][2] = 0.0f; s[nb][3] = 0.0f; }
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            unsigned qf[4];
            tc_frag_a(qf, sq, LD, warp * 16, kk * 16, lane);
            #pragma unroll
            for (int nb = 0; nb < TC_BC / 8; nb += 2) {
                unsigned bf[4];
                tc_frag_b_rows(bf, sk, LD, nb * 8, kk * 16, lane);
                tc_mma(s[nb], qf, bf[0], bf[1]);
                tc_mma(s[nb + 1], qf, bf[2], bf[3]);
            }
        }
        float xa = ma, xb = mb;
        #pragma unroll
        for (int nb = 0; nb < TC_BC / 8; nb++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                float va = s[nb][e] * sl2, vb = s[nb][2 + e] * sl2;
                if (!full) {
                    int kp = skpos[nb * 8 + 2 * tq + e];
                    if (kp == TC_INT_MAX || (g.causal && kp > pa)) va = NEG_INF;
                    if (kp == TC_INT_MAX || (g.causal && kp > pb)) vb = NEG_INF;
                }
                s[nb][e] = va;
                s[nb][2 + e] = vb;
                xa = fmaxf(xa, va);
                xb = fmaxf(xb, vb);
            }
        }
        xa = tc_quad_max(xa);
        xb = tc_quad_max(xb);
        // A row that has seen no key yet keeps max −inf: subtract 0 instead (every p is 0).
        float ba = xa == NEG_INF ? 0.0f : xa, bb = xb == NEG_INF ? 0.0f : xb;
        float ca = tc_exp2(ma - ba), cb = tc_exp2(mb - bb);
        ma = xa;
        mb = xb;
        float sa = 0.0f, sb = 0.0f;
        #pragma unroll
        for (int nb = 0; nb < TC_BC / 8; nb++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                s[nb][e] = tc_exp2(s[nb][e] - ba);
                s[nb][2 + e] = tc_exp2(s[nb][2 + e] - bb);
                sa += s[nb][e];
                sb += s[nb][2 + e];
            }
        }
        la = la * ca + sa;
        lb = lb * cb + sb;
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) { acc[nb][0] *= ca; acc[nb][1] *= ca; acc[nb][2] *= cb; acc[nb][3] *= cb; }
        #pragma unroll
        for (int kk = 0; kk < TC_BC / 16; kk++) {
            unsigned a[4];
            TC_ACC_TO_A(a, s, kk);
            #pragma unroll
            for (int nb = 0; nb < D / 8; nb += 2) {
                unsigned bf[4];
                tc_frag_b_cols(bf, sv, LD, kk * 16, nb * 8, lane);
                tc_mma(acc[nb], a, bf[0], bf[1]);
                tc_mma(acc[nb + 1], a, bf[2], bf[3]);
            }
        }
    }
    la = tc_quad_sum(la);
    lb = tc_quad_sum(lb);
    float ia = la > 0.0f ? 1.0f / la : 0.0f, ib = lb > 0.0f ? 1.0f / lb : 0.0f;
    if (ra < g.seq_q) {
        float* row = o + (ra * g.batch + b) * qw + h * D + 2 * tq;
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) *reinterpret_cast<float2*>(row + nb * 8) = make_float2(acc[nb][0] * ia, acc[nb][1] * ia);
        if (tq == 0) lse[bh * g.seq_q + ra] = la > 0.0f ? (ma + log2f(la)) * TC_LN2 : NEG_INF;
    }
    if (rb < g.seq_q) {
        float* row = o + (rb * g.batch + b) * qw + h * D + 2 * tq;
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) *reinterpret_cast<float2*>(row + nb * 8) = make_float2(acc[nb][2] * ib, acc[nb][3] * ib);
        if (tq == 0) lse[bh * g.seq_q + rb] = lb > 0.0f ? (mb + log2f(lb)) * TC_LN2 : NEG_INF;
    }
}

// dK, dV (overwritten) and dQ (+=, zeroed by the caller) for TC_BC keys of one (batch, kv
// head). Query tiles of BR rows. grid: (ceil(seq_kv / TC_BC), batch * kv_heads); block:
// TC_THREADS; shared: see tc_bwd_smem_bytes in attention.rs.
template <int D, int BR, typename In>
__device__ __forceinline__ void tc_attention_bwd(const In* dout, const In* q, const In* k, const In* v, const float* lse, const float* delta, float* dq, float* dk, float* dv, const int* qpos, const int* kvpos, const AttGeom& g) {
    constexpr int LD = D + 8, LDS = BR + 8;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    bf16_t* sk = reinterpret_cast<bf16_t*>(tc_smem);
    bf16_t* sv = sk + TC_BC * LD;
    bf16_t* sq = sv + TC_BC * LD;
    bf16_t* sdo = sq + BR * LD;
    bf16_t* sds = sdo + BR * LD;  // dS transposed: [key][query]
    float* sl = reinterpret_cast<float*>(sds + TC_BC * LDS);  // lse in log2 units; +inf: row sees nothing
    float* sd = sl + BR;                                       // delta
    int* sp = reinterpret_cast<int*>(sd + BR);                 // query positions
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    long long bk = blockIdx.y, b = bk / g.kv_heads, kvh = bk % g.kv_heads;
    long long group = g.heads / g.kv_heads;
    long long j0 = (long long)blockIdx.x * TC_BC;
    long long qw = g.heads * D, kw = g.kv_heads * D;
    tc_fill<D, TC_BC>(sk, k, j0, g.seq_kv, g.batch, b, kw, kvh * D);
    tc_fill<D, TC_BC>(sv, v, j0, g.seq_kv, g.batch, b, kw, kvh * D);
    long long ka = j0 + warp * 16 + gq, kb = ka + 8;
    int pa = ka < g.seq_kv ? kvpos[ka] : TC_INT_MAX, pb = kb < g.seq_kv ? kvpos[kb] : TC_INT_MAX;
    long long jl = j0 + TC_BC - 1 < g.seq_kv - 1 ? j0 + TC_BC - 1 : g.seq_kv - 1;
    int first_kpos = kvpos[j0], last_kpos = kvpos[jl];
    bool sorted = g.q_sorted && g.kv_sorted;
    bool whole = j0 + TC_BC <= g.seq_kv;
    float sl2 = g.scale * TC_LOG2E;
    float dka[D / 8][4], dva[D / 8][4];
    #pragma unroll
    for (int nb = 0; nb < D / 8; nb++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) { dka[nb][e] = 0.0f; dva[nb][e] = 0.0f; }
    }
    for (long long h = kvh * group; h < (kvh + 1) * group; h++) {
        long long bh = b * g.heads + h;
        for (long long i0 = 0; i0 < g.seq_q; i0 += BR) {
            long long il = i0 + BR - 1 < g.seq_q - 1 ? i0 + BR - 1 : g.seq_q - 1;
            // Causal with ascending positions: a tile ending before the first key sees none.
            if (g.causal && sorted && qpos[il] < first_kpos) continue;
            bool full = g.causal ? (sorted && whole && qpos[i0] >= last_kpos) : true;
            __syncthreads();
            tc_fill<D, BR>(sq, q, i0, g.seq_q, g.batch, b, qw, h * D);
            tc_fill<D, BR>(sdo, dout, i0, g.seq_q, g.batch, b, qw, h * D);
            for (int t = threadIdx.x; t < BR; t += TC_THREADS) {
                long long i = i0 + t;
                float l = i < g.seq_q ? lse[bh * g.seq_q + i] : NEG_INF;
                sl[t] = l == NEG_INF ? TC_POS_INF : l * TC_LOG2E;
                sd[t] = i < g.seq_q ? delta[bh * g.seq_q + i] : 0.0f;
                sp[t] = i < g.seq_q ? qpos[i] : 0;
            }
            __syncthreads();
            // S^T = K Q^T: this warp's 16 keys x BR queries.
            float st[BR / 8][4];
            #pragma unroll
            for (int nb = 0; nb < BR / 8; nb++) { st[nb][0] = 0.0f; st[nb][1] = 0.0f; st[nb][2] = 0.0f; st[nb][3] = 0.0f; }
            #pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                unsigned a[4];
                tc_frag_a(a, sk, LD, warp * 16, kk * 16, lane);
                #pragma unroll
                for (int nb = 0; nb < BR / 8; nb += 2) {
                    unsigned bf[4];
                    tc_frag_b_rows(bf, sq, LD, nb * 8, kk * 16, lane);
                    tc_mma(st[nb], a, bf[0], bf[1]);
                    tc_mma(st[nb + 1], a, bf[2], bf[3]);
                }
            }
            // P^T = exp(S^T scale − lse), masked.
            #pragma unroll
            for (int nb = 0; nb < BR / 8; nb++) {
                #pragma unroll
                for (int e = 0; e < 2; e++) {
                    int c = nb * 8 + 2 * tq + e;
                    float l = sl[c];
                    float xa = tc_exp2(st[nb][e] * sl2 - l), xb = tc_exp2(st[nb][2 + e] * sl2 - l);
                    if (!full && g.causal) {
                        int qp = sp[c];
                        if (pa > qp) xa = 0.0f;
                        if (pb > qp) xb = 0.0f;
                    }
                    st[nb][e] = xa;
                    st[nb][2 + e] = xb;
                }
            }
            // dV += P^T dO.
            #pragma unroll
            for (int kk = 0; kk < BR / 16; kk++) {
                unsigned a[4];
                TC_ACC_TO_A(a, st, kk);
                #pragma unroll
                for (int nb = 0; nb < D / 8; nb += 2) {
                    unsigned bf[4];
                    tc_frag_b_cols(bf, sdo, LD, kk * 16, nb * 8, lane);
                    tc_mma(dva[nb], a, bf[0], bf[1]);
                    tc_mma(dva[nb + 1], a, bf[2], bf[3]);
                }
            }
            // dP^T = V dO^T.
            float dpt[BR / 8][4];
            #pragma unroll
            for (int nb = 0; nb < BR / 8; nb++) { dpt[nb][0] = 0.0f; dpt[nb][1] = 0.0f; dpt[nb][2] = 0.0f; dpt[nb][3] = 0.0f; }
            #pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                unsigned a[4];
                tc_frag_a(a, sv, LD, warp * 16, kk * 16, lane);
                #pragma unroll
                for (int nb = 0; nb < BR / 8; nb += 2) {
                    unsigned bf[4];
                    tc_frag_b_rows(bf, sdo, LD, nb * 8, kk * 16, lane);
                    tc_mma(dpt[nb], a, bf[0], bf[1]);
                    tc_mma(dpt[nb + 1], a, bf[2], bf[3]);
                }
            }
            // dS^T = scale · P^T ∘ (dP^T − delta); kept in dpt and stored (bf16) for dQ.
            int ra = warp * 16 + gq;
            #pragma unroll
            for (int nb = 0; nb < BR / 8; nb++) {
                #pragma unroll
                for (int e = 0; e < 2; e++) {
                    float dl = sd[nb * 8 + 2 * tq + e];
                    dpt[nb][e] = g.scale * st[nb][e] * (dpt[nb][e] - dl);
                    dpt[nb][2 + e] = g.scale * st[nb][2 + e] * (dpt[nb][2 + e] - dl);
                }
                *reinterpret_cast<unsigned*>(sds + ra * LDS + nb * 8 + 2 * tq) = tc_pack(dpt[nb][0], dpt[nb][1]);
                *reinterpret_cast<unsigned*>(sds + (ra + 8) * LDS + nb * 8 + 2 * tq) = tc_pack(dpt[nb][2], dpt[nb][3]);
            }
            // dK += dS^T Q.
            #pragma unroll
            for (int kk = 0; kk < BR / 16; kk++) {
                unsigned a[4];
                TC_ACC_TO_A(a, dpt, kk);
                #pragma unroll
                for (int nb = 0; nb < D / 8; nb += 2) {
                    unsigned bf[4];
                    tc_frag_b_cols(bf, sq, LD, kk * 16, nb * 8, lane);
                    tc_mma(dka[nb], a, bf[0], bf[1]);
                    tc_mma(dka[nb + 1], a, bf[2], bf[3]);
                }
            }
            __syncthreads();
            // dQ += dS K, in units of 16 queries x 32 columns spread over the warps.
            constexpr int MQ = BR / 16;
            for (int u = warp; u < MQ * (D / 32); u += TC_WARPS) {
                int m0 = (u % MQ) * 16, d0 = (u / MQ) * 32;
                float dqa[4][4];
                #pragma unroll
                for (int nb = 0; nb < 4; nb++) { dqa[nb][0] = 0.0f; dqa[nb][1] = 0.0f; dqa[nb][2] = 0.0f; dqa[nb][3] = 0.0f; }
                #pragma unroll
                for (int kk = 0; kk < TC_BC / 16; kk++) {
                    unsigned a[4];
                    tc_frag_a_t(a, sds, LDS, m0, kk * 16, lane);
                    #pragma unroll
                    for (int nb = 0; nb < 4; nb += 2) {
                        unsigned bf[4];
                        tc_frag_b_cols(bf, sk, LD, kk * 16, d0 + nb * 8, lane);
                        tc_mma(dqa[nb], a, bf[0], bf[1]);
                        tc_mma(dqa[nb + 1], a, bf[2], bf[3]);
                    }
                }
                long long ia = i0 + m0 + gq, ib = ia + 8;
                if (ia < g.seq_q) {
                    float* row = dq + (ia * g.batch + b) * qw + h * D + d0 + 2 * tq;
                    #pragma unroll
                    for (int nb = 0; nb < 4; nb++) tc_red2(row + nb * 8, dqa[nb][0], dqa[nb][1]);
                }
                if (ib < g.seq_q) {
                    float* row = dq + (ib * g.batch + b) * qw + h * D + d0 + 2 * tq;
                    #pragma unroll
                    for (int nb = 0; nb < 4; nb++) tc_red2(row + nb * 8, dqa[nb][2], dqa[nb][3]);
                }
            }
        }
    }
    if (ka < g.seq_kv) {
        float* kr = dk + (ka * g.batch + b) * kw + kvh * D + 2 * tq;
        float* vr = dv + (ka * g.batch + b) * kw + kvh * D + 2 * tq;
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) {
            *reinterpret_cast<float2*>(kr + nb * 8) = make_float2(dka[nb][0], dka[nb][1]);
            *reinterpret_cast<float2*>(vr + nb * 8) = make_float2(dva[nb][0], dva[nb][1]);
        }
    }
    if (kb < g.seq_kv) {
        float* kr = dk + (kb * g.batch + b) * kw + kvh * D + 2 * tq;
        float* vr = dv + (kb * g.batch + b) * kw + kvh * D + 2 * tq;
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) {
            *reinterpret_cast<float2*>(kr + nb * 8) = make_float2(dka[nb][2], dka[nb][3]);
            *reinterpret_cast<float2*>(vr + nb * 8) = make_float2(dva[nb][2], dva[nb][3]);
        }
    }
}

#define TC_FWD(D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_fwd_tc_d##D(                 \
        const float* q, const float* k, const float* v, float* o, float* lse, const int* qpos,       \
        const int* kvpos, AttGeom g) {                                                                \
        tc_attention_fwd<D, float>(q, k, v, o, lse, qpos, kvpos, g);                                  \
    }
#define TC_BWD(D, BR)                                                                                \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_bwd_tc_d##D(                 \
        const float* dout, const float* q, const float* k, const float* v, const float* lse,         \
        const float* delta, float* dq, float* dk, float* dv, const int* qpos, const int* kvpos,      \
        AttGeom g) {                                                                                  \
        tc_attention_bwd<D, BR, float>(dout, q, k, v, lse, delta, dq, dk, dv, qpos, kvpos, g);        \
    }
TC_FWD(64)
TC_FWD(128)
TC_BWD(64, 64)
TC_BWD(128, 32)
