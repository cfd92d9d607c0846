// Flash-attention-2 on tensor cores, for bf16 runs with head_dim 64 or 128 (FA2's algorithm,
// written for parc's layouts): bf16 `mma.sync.m16n8k16` with fp32 accumulation. The kernels
// read bf16 q, k, v, dO in the stored layout [seq, batch, heads, head_dim] (attention_to_bf16
// makes them from fp32 buffers; bf16 storage will hand them over as they are): tiles go to
// shared memory with cp.async, two stages deep (the next tile loads while this one computes),
// fragments come out with `ldmatrix`. Softmax is online in fp32 registers, in log2 units
// (scores times scale·log2 e, exp2). Visibility is by global position (qpos/kvpos): with
// ascending positions, causal blocks skip whole tiles and mask only the tiles that cross the
// diagonal; otherwise every tile is masked.
//
// Forward: a CTA of TC_WARPS warps takes TC_FWD_BR query rows of one (batch, head), 32 per
// warp; K/V stream through shared memory in tiles of BC rows (64 for head_dim 64, 32 for 128).
// Backward (after attention_delta): a CTA of TC_BWD_WARPS warps takes TC_BC keys of one
// (batch, kv head), 16 per warp, loops over the GQA group's query heads and their query tiles,
// keeps dK/dV in registers and adds dQ into the (zeroed) output with float atomics.
#define TC_WARPS 4
#define TC_THREADS (TC_WARPS * 32)
// The backward's CTA: 8 warps of 16 keys each (more keys per CTA: fewer dQ atomics per FLOP).
#define TC_BWD_WARPS 8
#define TC_BWD_THREADS (TC_BWD_WARPS * 32)
#define TC_BC (TC_BWD_WARPS * 16)
#define TC_LOG2E 1.4426950408889634f
#define TC_LN2 0.6931471805599453f
#define TC_POS_INF __int_as_float(0x7f800000)
#define TC_INT_MAX 0x7fffffff

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

// Starts a 16-byte copy global -> shared (zero-filled when !valid; gmem must still be mapped).
__device__ __forceinline__ void tc_cp16(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(tc_smem_addr(smem)), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void tc_cp_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Starts filling s[ROWS][D + 8] with rows [r0, r0 + ROWS) of one head (columns col..col+D) of
// a bf16 [seq * batch, width] tensor (sequence row j of batch b is row j * batch + b); rows
// past seq are zero.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void tc_fill(bf16_t* s, const bf16_t* src, long long r0, long long seq, long long batch, long long b, long long width, long long col) {
    constexpr int PER_ROW = D / 8;
    static_assert(ROWS * PER_ROW % THREADS == 0, "a tile must split evenly over the threads");
    #pragma unroll
    for (int it = 0; it < ROWS * PER_ROW / THREADS; it++) {
        int idx = it * THREADS + threadIdx.x;
        int r = idx / PER_ROW, c = (idx % PER_ROW) * 8;
        long long j = r0 + r;
        bool valid = j < seq;
        tc_cp16(s + r * (D + 8) + c, src + ((valid ? j : 0) * batch + b) * width + col + c, valid);
    }
}

// fp32 -> bf16 (round to nearest even), 4 elements a thread and step; n4 = elements / 4.
extern "C" __global__ void attention_to_bf16(const float4* x, uint2* y, long long n4) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        float4 a = x[i];
        y[i] = make_uint2(tc_pack(a.x, a.y), tc_pack(a.z, a.w));
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

// Query rows of one forward CTA: each warp takes TC_FWD_MT m-tiles of 16 rows, so every K/V
// fragment read from shared memory feeds TC_FWD_MT tensor-core ops.
#define TC_FWD_MT 2
#define TC_FWD_BR (TC_WARPS * 16 * TC_FWD_MT)

// grid: (ceil(seq_q / TC_FWD_BR), batch * heads); block: TC_THREADS; shared:
// (TC_FWD_BR + 4 BC) * (D + 8) * 2 + 2 BC * 4 bytes (Q; K, V and key positions, two stages).
template <int D, int BC>
__device__ __forceinline__ void tc_attention_fwd(const bf16_t* q, const bf16_t* k, const bf16_t* v, float* o, float* lse, const int* qpos, const int* kvpos, const AttGeom& g) {
    constexpr int LD = D + 8, TILE = BC * LD, MT = TC_FWD_MT, BR = TC_FWD_BR;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    bf16_t* sq = reinterpret_cast<bf16_t*>(tc_smem);
    bf16_t* skv = sq + BR * LD;  // stage s: K at skv + 2 s TILE, V after it
    int* skpos = reinterpret_cast<int*>(skv + 4 * TILE);  // stage s at skpos + s BC
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    long long bh = blockIdx.y, b = bh / g.heads, h = bh % g.heads;
    long long kvh = h / (g.heads / g.kv_heads);
    // Heaviest (latest) causal blocks first.
    long long i0 = (long long)(gridDim.x - 1 - blockIdx.x) * BR;
    long long qw = g.heads * D, kw = g.kv_heads * D, last = g.seq_q - 1;
    // This thread's rows: r = 2 mt + half is row i0 + warp 16 MT + 16 mt + 8 half + gq.
    long long row[2 * MT];
    int pos[2 * MT];
    float m[2 * MT], l[2 * MT];
    #pragma unroll
    for (int r = 0; r < 2 * MT; r++) {
        row[r] = i0 + warp * 16 * MT + 16 * (r >> 1) + 8 * (r & 1) + gq;
        pos[r] = qpos[row[r] < last ? row[r] : last];
        m[r] = NEG_INF;
        l[r] = 0.0f;
    }
    int first_pos = qpos[i0], last_pos = qpos[i0 + BR - 1 < last ? i0 + BR - 1 : last];
    bool sorted = g.q_sorted && g.kv_sorted;
    long long tiles = (g.seq_kv + BC - 1) / BC;
    float sl2 = g.scale * TC_LOG2E;
    float acc[MT][D / 8][4];
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) { acc[mt][nb][0] = 0.0f; acc[mt][nb][1] = 0.0f; acc[mt][nb][2] = 0.0f; acc[mt][nb][3] = 0.0f; }
    }
    tc_fill<D, BR, TC_THREADS>(sq, q, i0, g.seq_q, g.batch, b, qw, h * D);
    // Causal with ascending positions: tiles whose first key is past the block's last query
    // are invisible to the whole block, and so is every later one.
    bool more = !(g.causal && sorted && kvpos[0] > last_pos);
    if (more) {
        tc_fill<D, BC, TC_THREADS>(skv, k, 0, g.seq_kv, g.batch, b, kw, kvh * D);
        tc_fill<D, BC, TC_THREADS>(skv + TILE, v, 0, g.seq_kv, g.batch, b, kw, kvh * D);
        if (threadIdx.x < BC) skpos[threadIdx.x] = threadIdx.x < g.seq_kv ? kvpos[threadIdx.x] : TC_INT_MAX;
    }
    tc_cp_commit();
    for (long long t = 0; more; t++) {
        int stage = (int)(t & 1);
        long long j0 = t * BC;
        tc_cp_wait_all();
        __syncthreads();  // tile t landed everywhere; every warp is done with tile t - 1
        long long jn = j0 + BC;
        more = t + 1 < tiles && !(g.causal && sorted && kvpos[jn] > last_pos);
        if (more) {
            bf16_t* nk = skv + 2 * (stage ^ 1) * TILE;
            tc_fill<D, BC, TC_THREADS>(nk, k, jn, g.seq_kv, g.batch, b, kw, kvh * D);
            tc_fill<D, BC, TC_THREADS>(nk + TILE, v, jn, g.seq_kv, g.batch, b, kw, kvh * D);
            if (threadIdx.x < BC) skpos[(stage ^ 1) * BC + threadIdx.x] = jn + threadIdx.x < g.seq_kv ? kvpos[jn + threadIdx.x] : TC_INT_MAX;
            tc_cp_commit();
        }
        const bf16_t* sk = skv + 2 * stage * TILE;
        const bf16_t* sv = sk + TILE;
        const int* kp_tile = skpos + stage * BC;
        long long jl = j0 + BC - 1 < g.seq_kv - 1 ? j0 + BC - 1 : g.seq_kv - 1;
        bool whole = j0 + BC <= g.seq_kv;
        bool full = g.causal ? (sorted && whole && kvpos[jl] <= first_pos) : whole;
        // S = Q K^T: MT x 16 rows x BC keys per warp.
        float s[MT][BC / 8][4];
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            #pragma unroll
            for (int nb = 0; nb < BC / 8; nb++) { s[mt][nb][0] = 0.0f; s[mt][nb][1] = 0.0f; s[mt][nb][2] = 0.0f; s[mt][nb][3] = 0.0f; }
        }
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            unsigned qf[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; mt++) tc_frag_a(qf[mt], sq, LD, warp * 16 * MT + 16 * mt, kk * 16, lane);
            #pragma unroll
            for (int nb = 0; nb < BC / 8; nb += 2) {
                unsigned bf[4];
                tc_frag_b_rows(bf, sk, LD, nb * 8, kk * 16, lane);
                #pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    tc_mma(s[mt][nb], qf[mt], bf[0], bf[1]);
                    tc_mma(s[mt][nb + 1], qf[mt], bf[2], bf[3]);
                }
            }
        }
        // Online softmax, per row (a row's columns are spread over the 4 lanes of a quad).
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            #pragma unroll
            for (int half = 0; half < 2; half++) {
                int r = 2 * mt + half;
                // The max of the raw scores (scale > 0, so it is the max of the scaled ones).
                float x = NEG_INF;
                #pragma unroll
                for (int nb = 0; nb < BC / 8; nb++) {
                    #pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float val = s[mt][nb][2 * half + e];
                        if (!full) {
                            int kp = kp_tile[nb * 8 + 2 * tq + e];
                            if (kp == TC_INT_MAX || (g.causal && kp > pos[r])) val = NEG_INF;
                        }
                        s[mt][nb][2 * half + e] = val;
                        x = fmaxf(x, val);
                    }
                }
                x = fmaxf(m[r], tc_quad_max(x) * sl2);
                // A row that has seen no key yet keeps max −inf: subtract 0 instead (every p is 0).
                float base = x == NEG_INF ? 0.0f : x;
                float corr = tc_exp2(m[r] - base);
                m[r] = x;
                float sum = 0.0f;
                #pragma unroll
                for (int nb = 0; nb < BC / 8; nb++) {
                    #pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float p = tc_exp2(__fmaf_rn(s[mt][nb][2 * half + e], sl2, -base));
                        s[mt][nb][2 * half + e] = p;
                        sum += p;
                    }
                }
                l[r] = l[r] * corr + sum;
                #pragma unroll
                for (int nb = 0; nb < D / 8; nb++) {
                    acc[mt][nb][2 * half] *= corr;
                    acc[mt][nb][2 * half + 1] *= corr;
                }
            }
        }
        // O += P V.
        #pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            unsigned a[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; mt++) TC_ACC_TO_A(a[mt], s[mt], kk);
            #pragma unroll
            for (int nb = 0; nb < D / 8; nb += 2) {
                unsigned bf[4];
                tc_frag_b_cols(bf, sv, LD, kk * 16, nb * 8, lane);
                #pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    tc_mma(acc[mt][nb], a[mt], bf[0], bf[1]);
                    tc_mma(acc[mt][nb + 1], a[mt], bf[2], bf[3]);
                }
            }
        }
    }
    tc_cp_wait_all();
    #pragma unroll
    for (int r = 0; r < 2 * MT; r++) {
        float sum = tc_quad_sum(l[r]);
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        if (row[r] < g.seq_q) {
            float* out = o + (row[r] * g.batch + b) * qw + h * D + 2 * tq;
            int mt = r >> 1, half = r & 1;
            #pragma unroll
            for (int nb = 0; nb < D / 8; nb++) *reinterpret_cast<float2*>(out + nb * 8) = make_float2(acc[mt][nb][2 * half] * inv, acc[mt][nb][2 * half + 1] * inv);
            if (tq == 0) lse[bh * g.seq_q + row[r]] = sum > 0.0f ? (m[r] + log2f(sum)) * TC_LN2 : NEG_INF;
        }
    }
}

// dK, dV (overwritten) and dQ (+=, zeroed by the caller) for TC_BC keys of one (batch, kv
// head); query tiles of BR rows. grid: (ceil(seq_kv / TC_BC), batch * kv_heads); block:
// TC_BWD_THREADS; shared: 2 TC_BC (D + 8) * 2 (K, V) + 2 stages of [2 BR (D + 8) * 2 (Q, dO) +
// 3 BR * 4 (lse, delta, position)] + TC_BC (BR + 8) * 2 (dS^T) bytes.
template <int D, int BR>
__device__ __forceinline__ void tc_attention_bwd(const bf16_t* dout, const bf16_t* q, const bf16_t* k, const bf16_t* v, const float* lse, const float* delta, float* dq, float* dk, float* dv, const int* qpos, const int* kvpos, const AttGeom& g) {
    constexpr int LD = D + 8, LDS = BR + 8;
    // One stage: Q, dO tiles, then lse (log2 units; +inf: the row sees nothing), delta, position.
    constexpr int STAGE = 2 * BR * LD * 2 + 3 * BR * 4;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    bf16_t* sk = reinterpret_cast<bf16_t*>(tc_smem);
    bf16_t* sv = sk + TC_BC * LD;
    unsigned char* stages = reinterpret_cast<unsigned char*>(sv + TC_BC * LD);
    bf16_t* sds = reinterpret_cast<bf16_t*>(stages + 2 * STAGE);  // dS transposed: [key][query]
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    long long bk = blockIdx.y, b = bk / g.kv_heads, kvh = bk % g.kv_heads;
    long long group = g.heads / g.kv_heads;
    long long j0 = (long long)blockIdx.x * TC_BC;
    long long qw = g.heads * D, kw = g.kv_heads * D;
    long long ka = j0 + warp * 16 + gq, kb = ka + 8;
    int pa = ka < g.seq_kv ? kvpos[ka] : TC_INT_MAX, pb = kb < g.seq_kv ? kvpos[kb] : TC_INT_MAX;
    long long jl = j0 + TC_BC - 1 < g.seq_kv - 1 ? j0 + TC_BC - 1 : g.seq_kv - 1;
    int first_kpos = kvpos[j0], last_kpos = kvpos[jl];
    bool sorted = g.q_sorted && g.kv_sorted;
    bool whole = j0 + TC_BC <= g.seq_kv;
    float sl2 = g.scale * TC_LOG2E;
    // The query tiles this CTA visits, per head: [first, q_tiles). Causal with ascending
    // positions: tiles ending before the first key see none of this CTA's keys.
    long long q_tiles = (g.seq_q + BR - 1) / BR, first = 0;
    if (g.causal && sorted) {
        long long hi = q_tiles;
        while (first < hi) {
            long long mid = (first + hi) / 2, il = mid * BR + BR - 1 < g.seq_q - 1 ? mid * BR + BR - 1 : g.seq_q - 1;
            if (qpos[il] < first_kpos) first = mid + 1; else hi = mid;
        }
    }
    long long per_head = q_tiles - first, total = group * per_head;
    float dka[D / 8][4], dva[D / 8][4];
    #pragma unroll
    for (int nb = 0; nb < D / 8; nb++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) { dka[nb][e] = 0.0f; dva[nb][e] = 0.0f; }
    }
    tc_fill<D, TC_BC, TC_BWD_THREADS>(sk, k, j0, g.seq_kv, g.batch, b, kw, kvh * D);
    tc_fill<D, TC_BC, TC_BWD_THREADS>(sv, v, j0, g.seq_kv, g.batch, b, kw, kvh * D);
    for (long long t = -1; t < total; t++) {
        // Start loading tile t + 1 (then wait for tile t): its stage was last read in t - 1.
        if (t >= 0) {
            tc_cp_wait_all();
            __syncthreads();
        }
        if (t + 1 < total) {
            long long hn = kvh * group + (t + 1) / per_head, in0 = (first + (t + 1) % per_head) * BR;
            long long bhn = b * g.heads + hn;
            unsigned char* st = stages + ((t + 1) & 1) * STAGE;
            bf16_t* nq = reinterpret_cast<bf16_t*>(st);
            tc_fill<D, BR, TC_BWD_THREADS>(nq, q, in0, g.seq_q, g.batch, b, qw, hn * D);
            tc_fill<D, BR, TC_BWD_THREADS>(nq + BR * LD, dout, in0, g.seq_q, g.batch, b, qw, hn * D);
            float* nl = reinterpret_cast<float*>(nq + 2 * BR * LD);
            for (int r = threadIdx.x; r < BR; r += TC_BWD_THREADS) {
                long long i = in0 + r;
                float l = i < g.seq_q ? lse[bhn * g.seq_q + i] : NEG_INF;
                nl[r] = l == NEG_INF ? TC_POS_INF : l * TC_LOG2E;
                nl[BR + r] = i < g.seq_q ? delta[bhn * g.seq_q + i] : 0.0f;
                reinterpret_cast<int*>(nl + 2 * BR)[r] = i < g.seq_q ? qpos[i] : 0;
            }
        }
        tc_cp_commit();
        if (t < 0) continue;
        long long h = kvh * group + t / per_head, i0 = (first + t % per_head) * BR;
        const bf16_t* sq = reinterpret_cast<const bf16_t*>(stages + (t & 1) * STAGE);
        const bf16_t* sdo = sq + BR * LD;
        const float* sl = reinterpret_cast<const float*>(sdo + BR * LD);
        const float* sd = sl + BR;
        const int* sp = reinterpret_cast<const int*>(sd + BR);
        bool full = g.causal ? (sorted && whole && qpos[i0] >= last_kpos) : true;
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
                float xa = tc_exp2(__fmaf_rn(st[nb][e], sl2, -l)), xb = tc_exp2(__fmaf_rn(st[nb][2 + e], sl2, -l));
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
        // dS^T / scale = P^T ∘ (dP^T − delta); kept in dpt and stored (bf16) for dQ (the scale
        // is applied to dK and dQ once, at their ends).
        int ra = warp * 16 + gq;
        #pragma unroll
        for (int nb = 0; nb < BR / 8; nb++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                float dl = sd[nb * 8 + 2 * tq + e];
                dpt[nb][e] = st[nb][e] * (dpt[nb][e] - dl);
                dpt[nb][2 + e] = st[nb][2 + e] * (dpt[nb][2 + e] - dl);
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
        for (int u = warp; u < MQ * (D / 32); u += TC_BWD_WARPS) {
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
                for (int nb = 0; nb < 4; nb++) tc_red2(row + nb * 8, g.scale * dqa[nb][0], g.scale * dqa[nb][1]);
            }
            if (ib < g.seq_q) {
                float* row = dq + (ib * g.batch + b) * qw + h * D + d0 + 2 * tq;
                #pragma unroll
                for (int nb = 0; nb < 4; nb++) tc_red2(row + nb * 8, g.scale * dqa[nb][2], g.scale * dqa[nb][3]);
            }
        }
    }
    tc_cp_wait_all();
    if (ka < g.seq_kv) {
        float* kr = dk + (ka * g.batch + b) * kw + kvh * D + 2 * tq;
        float* vr = dv + (ka * g.batch + b) * kw + kvh * D + 2 * tq;
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) {
            *reinterpret_cast<float2*>(kr + nb * 8) = make_float2(g.scale * dka[nb][0], g.scale * dka[nb][1]);
            *reinterpret_cast<float2*>(vr + nb * 8) = make_float2(dva[nb][0], dva[nb][1]);
        }
    }
    if (kb < g.seq_kv) {
        float* kr = dk + (kb * g.batch + b) * kw + kvh * D + 2 * tq;
        float* vr = dv + (kb * g.batch + b) * kw + kvh * D + 2 * tq;
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) {
            *reinterpret_cast<float2*>(kr + nb * 8) = make_float2(g.scale * dka[nb][2], g.scale * dka[nb][3]);
            *reinterpret_cast<float2*>(vr + nb * 8) = make_float2(dva[nb][2], dva[nb][3]);
        }
    }
}

#define TC_FWD(D, BC)                                                                                \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_fwd_tc_d##D(                 \
        const bf16_t* q, const bf16_t* k, const bf16_t* v, float* o, float* lse, const int* qpos,    \
        const int* kvpos, AttGeom g) {                                                                \
        tc_attention_fwd<D, BC>(q, k, v, o, lse, qpos, kvpos, g);                                     \
    }
#define TC_BWD(D, BR)                                                                                \
    extern "C" __global__ void __launch_bounds__(TC_BWD_THREADS) attention_bwd_tc_d##D(                 \
        const bf16_t* dout, const bf16_t* q, const bf16_t* k, const bf16_t* v, const float* lse,     \
        const float* delta, float* dq, float* dk, float* dv, const int* qpos, const int* kvpos,      \
        AttGeom g) {                                                                                  \
        tc_attention_bwd<D, BR>(dout, q, k, v, lse, delta, dq, dk, dv, qpos, kvpos, g);               \
    }
TC_FWD(64, 64)
TC_FWD(128, 32)
TC_BWD(64, 64)
TC_BWD(128, 32)
