// Flash-attention-2 on tensor cores, for bf16 runs with head_dim 64 or 128 (FA2's algorithm,
// written for parc's layouts): bf16 `mma.sync.m16n8k16` with fp32 accumulation. The kernels
// read bf16 q, k, v, dO in the stored layout [seq, batch, heads, head_dim] — the buffers
// themselves when they are bf16, else attention_to_bf16's copies — and write O, dK, dV as f32 or
// bf16 (AttGeom::bf16; each bf16 element rounded once) and dQ into an f32 accumulator (the
// caller rounds it to a bf16 dQ once). Tiles go to shared memory with cp.async, two stages deep
// (the next tile loads while this one computes); key and query positions, lse and delta ride
// along in the same cp.async groups, so the loops issue no blocking global load. Fragments come
// out with `ldmatrix`. Softmax is online in fp32 registers, in log2 units (scores times
// scale·log2 e, exp2). Visibility is by global position (qpos/kvpos): with ascending positions,
// causal blocks skip whole tiles and mask only the tiles that cross the diagonal (the ranges are
// counted once per CTA, a warp testing 32 tiles at a time); otherwise every tile is masked.
//
// Forward: a CTA of TC_WARPS warps takes TC_FWD_BR query rows of one (batch, head), 32 per
// warp; K/V stream through shared memory in tiles of BC rows. The grid is (batch·heads, query
// tiles), the last query tiles (the longest, causal) launched first for every head.
// Backward (after attention_delta_tc, which also zeroes the dQ accumulator): a CTA of TC_BWD_WARPS warps takes TC_BC keys of one
// (batch, kv head), 16 per warp, loops over the GQA group's query heads and their query tiles,
// keeps dK/dV in registers and adds dQ into the (zeroed) f32 accumulator with float atomics;
// the grid is (batch·kv heads, key blocks), the first key blocks (the longest) launched first.
#define TC_WARPS 4
#define TC_THREADS (TC_WARPS * 32)
// The backward's CTA: 8 warps of 16 keys each (more keys per CTA: fewer dQ atomics per FLOP).
#define TC_BWD_WARPS 8
#define TC_BWD_THREADS (TC_BWD_WARPS * 32)
#define TC_BC (TC_BWD_WARPS * 16)
#define TC_LOG2E 1.4426950408889634f
#define TC_LN2 0.6931471805599453f
#define TC_INT_MAX 0x7fffffff
#define TC_INT_MIN (-0x7fffffff - 1)

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
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    // Vector reductions are sm_90's; earlier GPUs add the two floats one by one.
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// Starts a 16-byte copy global -> shared of which the first `bytes` (0..16) come from gmem and
// the rest are zero (gmem must be mapped and 16-byte aligned even when bytes is 0).
__device__ __forceinline__ void tc_cp16(void* smem, const void* gmem, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(tc_smem_addr(smem)), "l"(gmem), "r"(bytes) : "memory");
}

__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void tc_cp_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Starts filling s[ROWS][D + 8] with rows [r0, r0 + ROWS) of one head of a bf16 tensor: row j
// starts at src + j * stride (src points at the head's first column of row 0); rows at or past
// seq are zero.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void tc_fill(bf16_t* s, const bf16_t* src, int r0, int seq, long long stride) {
    constexpr int PER_ROW = D / 8;
    static_assert(ROWS * PER_ROW % THREADS == 0, "a tile must split evenly over the threads");
    #pragma unroll
    for (int it = 0; it < ROWS * PER_ROW / THREADS; it++) {
        int idx = it * THREADS + threadIdx.x;
        int r = idx / PER_ROW, c = (idx % PER_ROW) * 8;
        int j = r0 + r;
        bool valid = j < seq;
        tc_cp16(s + r * (D + 8) + c, src + (valid ? j : 0) * stride + c, valid ? 16 : 0);
    }
}

// Starts a 4-byte copy global -> shared (zero when bytes is 0; gmem must still be mapped).
__device__ __forceinline__ void tc_cp4(void* smem, const void* gmem, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(tc_smem_addr(smem)), "l"(gmem), "r"(bytes) : "memory");
}

// Starts copying the 4-byte words src[first .. first + 4) to s (16-byte aligned both); words
// at or past `end` are zero and never read (the last few go one word at a time, so nothing
// past the allocation is touched).
__device__ __forceinline__ void tc_fill_words(void* s, const void* src, int first, int end) {
    const int* w = static_cast<const int*>(src);
    int left = end - first;
    if (left >= 4) {
        tc_cp16(s, w + first, 16);
    } else {
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            bool valid = i < left;
            tc_cp4(static_cast<int*>(s) + i, w + (valid ? first + i : 0), valid ? 4 : 0);
        }
    }
}

// fp32 -> bf16 (round to nearest even), 4 elements a thread and step; n4 = elements / 4.
extern "C" __global__ void attention_to_bf16(const float4* x, uint2* y, long long n4) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        float4 a = x[i];
        y[i] = make_uint2(tc_pack(a.x, a.y), tc_pack(a.z, a.w));
    }
}

// The tensor-core backward's f32 dQ accumulator (compact rows of heads · head_dim) into dq
// (row stride ld_dq: its own width, or a packed dqkv's), as bf16 rounded once to nearest even
// or (a packed f32 dqkv) as f32; 4 elements a thread and step (16-byte loads, 8- or 16-byte
// stores: the strides are multiples of 4).
extern "C" __global__ void attention_dq_out(const float* acc, void* dq, AttGeom g) {
    long long w = g.heads * g.head_dim, w4 = w / 4, n4 = g.seq_q * g.batch * w4;
    bool bf16 = g.bf16 & ATT_BF16_DQ;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / w4, c = (i % w4) * 4, at = r * g.ld_dq + c;
        float4 a = reinterpret_cast<const float4*>(acc)[i];
        if (bf16) *reinterpret_cast<uint2*>(static_cast<bf16_t*>(dq) + at) = make_uint2(tc_pack(a.x, a.y), tc_pack(a.z, a.w));
        else *reinterpret_cast<float4*>(static_cast<float*>(dq) + at) = a;
    }
}

// The warp-specialized backward's f32 dK and dV accumulators (head dim 128 under GQA: compact rows
// of kv_heads · head_dim, dV's after all of dK's) into dk and dv (row stride ld_dkv), each as
// bf16 rounded once to nearest even or as f32 (ATT_BF16_DK, ATT_BF16_DV); 4 elements a thread
// and step, as attention_dq_out.
extern "C" __global__ void attention_dkv_out(const float* acc, void* dk, void* dv, AttGeom g) {
    long long w4 = g.kv_heads * g.head_dim / 4, n4 = g.seq_kv * g.batch * w4;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < 2 * n4; i += (long long)gridDim.x * blockDim.x) {
        bool is_v = i >= n4;
        long long j = is_v ? i - n4 : i, at = (j / w4) * g.ld_dkv + (j % w4) * 4;
        void* out = is_v ? dv : dk;
        float4 a = reinterpret_cast<const float4*>(acc)[i];
        if (g.bf16 & (is_v ? ATT_BF16_DV : ATT_BF16_DK)) *reinterpret_cast<uint2*>(static_cast<bf16_t*>(out) + at) = make_uint2(tc_pack(a.x, a.y), tc_pack(a.z, a.w));
        else *reinterpret_cast<float4*>(static_cast<float*>(out) + at) = a;
    }
}

// Before the tensor-core backward, per (query, batch, head) row of the stored layout: delta =
// dO·O and lse2 = lse · log2 e (+inf where lse is −inf: the row sees no key), indexed as
// attention_delta's (att_rows), and the row of the (compact) f32 dQ accumulator zeroed. D/8
// threads a row, 8 elements each (16-byte loads and stores: the head dim and dO's and O's row
// stride are multiples of 8 and the buffers 16-byte aligned); any grid of 256-thread blocks
// (grid-stride).
template <int D>
__device__ __forceinline__ void tc_attention_delta(const void* dout, const void* o, const float* lse, float* delta, float* lse2, float* dq_acc, const AttGeom& g) {
    constexpr int PER_ROW = D / 8;
    static_assert(32 % PER_ROW == 0, "a row's threads share a warp");
    long long rows = g.seq_q * g.batch * g.heads, n = rows * PER_ROW;
    Fv a = {const_cast<void*>(dout), (g.bf16 & ATT_BF16_DO) != 0, 0};
    Fv b = {const_cast<void*>(o), (g.bf16 & ATT_BF16_O) != 0, 0};
    // Grid-stride by whole warps, so every lane of a warp takes part in each shuffle.
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long t0 = blockIdx.x * (long long)blockDim.x + (threadIdx.x & ~31); t0 < n; t0 += step) {
        long long t = t0 + (threadIdx.x & 31), r = t / PER_ROW;
        bool valid = t < n;
        float s = 0.0f;
        if (valid) {
            // Row r / heads of the stored layout, head r % heads, columns 8 (t % PER_ROW) on.
            long long at = (r / g.heads) * g.ld_o + (r % g.heads) * D + (t % PER_ROW) * 8;
            F8 x = ld8(a, at / 8), y = ld8(b, at / 8);
            #pragma unroll
            for (int e = 0; e < 8; e++) s += x.v[e] * y.v[e];
            float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            reinterpret_cast<float4*>(dq_acc)[2 * t] = zero;
            reinterpret_cast<float4*>(dq_acc)[2 * t + 1] = zero;
        }
        #pragma unroll
        for (int off = PER_ROW / 2; off > 0; off >>= 1) s += __shfl_xor_sync(FULL_MASK, s, off);
        if (valid && t % PER_ROW == 0) {
            long long h = r % g.heads, bb = (r / g.heads) % g.batch, i = r / (g.heads * g.batch);
            long long bh = bb * g.heads + h;
            float l = lse[bh * g.seq_q + i];
            delta[bh * att_rows(g) + i] = s;
            lse2[bh * att_rows(g) + i] = l == NEG_INF ? __int_as_float(0x7f800000) : l * TC_LOG2E;
        }
    }
}

// Writes two adjacent output elements (index i even) as f32 or, when bf16, rounded to bf16.
__device__ __forceinline__ void tc_store2(void* p, long long i, float a, float b, bool bf16) {
    if (bf16) *reinterpret_cast<unsigned*>(static_cast<bf16_t*>(p) + i) = tc_pack(a, b);
    else *reinterpret_cast<float2*>(static_cast<float*>(p) + i) = make_float2(a, b);
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

// The number of t in [lo, hi) for which pred(t) holds (a prefix of them, where the callers use
// it), counted a warp at a time: each lane tests one t per round, the loads of a round in
// flight together.
template <typename P>
__device__ __forceinline__ int tc_count(int lo, int hi, P pred) {
    int n = 0;
    for (int base = lo; base < hi; base += 32) {
        int t = base + (threadIdx.x & 31);
        n += __popc(__ballot_sync(FULL_MASK, t < hi && pred(t)));
    }
    return n;
}

// Query rows of one forward CTA: each warp takes TC_FWD_MT m-tiles of 16 rows, so every K/V
// fragment read from shared memory feeds TC_FWD_MT tensor-core ops.
#define TC_FWD_MT 2
#define TC_FWD_BR (TC_WARPS * 16 * TC_FWD_MT)

// grid: (batch * heads, ceil(seq_q / TC_FWD_BR)); block: TC_THREADS; shared:
// (TC_FWD_BR + 4 BC) * (D + 8) * 2 + 2 BC * 4 bytes (Q; K, V and key positions, two stages).
template <int D, int BC>
__device__ __forceinline__ void tc_attention_fwd(const bf16_t* q, const bf16_t* k, const bf16_t* v, void* o, float* lse, const int* qpos, const int* kvpos, const AttGeom& g) {
    constexpr int LD = D + 8, TILE = BC * LD, MT = TC_FWD_MT, BR = TC_FWD_BR;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    bf16_t* sq = reinterpret_cast<bf16_t*>(tc_smem);
    bf16_t* skv = sq + BR * LD;  // stage s: K at skv + 2 s TILE, V after it
    int* skpos = reinterpret_cast<int*>(skv + 4 * TILE);  // stage s at skpos + s BC
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    int bh = ATT_HEAD(g), b = bh / (int)g.heads, h = bh % (int)g.heads;
    int kvh = h / (int)(g.heads / g.kv_heads);
    int seq_q = (int)g.seq_q, seq_kv = (int)g.seq_kv;
    // The last query tiles (the longest, causal) first.
    int i0 = (ATT_TILES(g) - 1 - ATT_TILE_IDX(g)) * BR;
    // Elements from one sequence position to the next (batch rows of the stored layout).
    int q_stride = (int)g.batch * g.ld_q, kv_stride = (int)g.batch * g.ld_kv, o_stride = (int)g.batch * g.ld_o;
    const bf16_t* qh = q + b * g.ld_q + h * D;
    const bf16_t* kh = k + b * g.ld_kv + kvh * D;
    const bf16_t* vh = v + b * g.ld_kv + kvh * D;
    tc_fill<D, BR, TC_THREADS>(sq, qh, i0, seq_q, q_stride);
    // This thread's rows: r = 2 mt + half is row i0 + warp 16 MT + 16 mt + 8 half + gq.
    int last = seq_q - 1;
    int pos[2 * MT];
    float m[2 * MT], l[2 * MT];
    #pragma unroll
    for (int r = 0; r < 2 * MT; r++) {
        int row = i0 + warp * 16 * MT + 16 * (r >> 1) + 8 * (r & 1) + gq;
        pos[r] = qpos[row < last ? row : last];
        m[r] = NEG_INF;
        l[r] = 0.0f;
    }
    // Tile 0 loads while the visited range is found (unused when the block sees no key).
    tc_fill<D, BC, TC_THREADS>(skv, kh, 0, seq_kv, kv_stride);
    tc_fill<D, BC, TC_THREADS>(skv + TILE, vh, 0, seq_kv, kv_stride);
    if (threadIdx.x < BC / 4) tc_fill_words(skpos + 4 * threadIdx.x, kvpos, 4 * threadIdx.x, seq_kv);
    tc_cp_commit();
    int first_pos = qpos[i0], last_pos = qpos[i0 + BR - 1 < last ? i0 + BR - 1 : last];
    bool sorted = g.q_sorted && g.kv_sorted;
    // Tiles [0, tiles) are visited; [0, full) need no mask (every key valid and visible).
    int tiles = (seq_kv + BC - 1) / BC, full = seq_kv / BC;
    if (g.causal && sorted) {
        // A tile whose first key is past the block's last query is invisible to it, and so is
        // every later one; a whole tile whose last key is at or before the first query is full.
        tiles = tc_count(0, tiles, [&](int t) { return kvpos[t * BC] <= last_pos; });
        full = tc_count(0, full, [&](int t) { return kvpos[t * BC + BC - 1] <= first_pos; });
    } else if (g.causal) {
        full = 0;
    }
    float sl2 = g.scale * TC_LOG2E;
    float acc[MT][D / 8][4];
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) { acc[mt][nb][0] = 0.0f; acc[mt][nb][1] = 0.0f; acc[mt][nb][2] = 0.0f; acc[mt][nb][3] = 0.0f; }
    }
    for (int t = 0; t < tiles; t++) {
        int stage = t & 1;
        int j0 = t * BC;
        tc_cp_wait_all();
        __syncthreads();  // tile t landed everywhere; every warp is done with tile t - 1
        if (t + 1 < tiles) {
            int jn = j0 + BC;
            bf16_t* nk = skv + 2 * (stage ^ 1) * TILE;
            tc_fill<D, BC, TC_THREADS>(nk, kh, jn, seq_kv, kv_stride);
            tc_fill<D, BC, TC_THREADS>(nk + TILE, vh, jn, seq_kv, kv_stride);
            if (threadIdx.x < BC / 4) tc_fill_words(skpos + (stage ^ 1) * BC + 4 * threadIdx.x, kvpos, jn + 4 * threadIdx.x, seq_kv);
            tc_cp_commit();
        }
        const bf16_t* sk = skv + 2 * stage * TILE;
        const bf16_t* sv = sk + TILE;
        const int* kp_tile = skpos + stage * BC;
        int kv_left = seq_kv - j0;
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
        bool masked = t >= full;
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
                        if (masked) {
                            int c = nb * 8 + 2 * tq + e;
                            if (c >= kv_left || (g.causal && kp_tile[c] > pos[r])) val = NEG_INF;
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
    bool o_bf16 = g.bf16 & ATT_BF16_O;
    #pragma unroll
    for (int r = 0; r < 2 * MT; r++) {
        float sum = tc_quad_sum(l[r]);
        float inv = sum != 0.0f ? 1.0f / sum : 0.0f;
        int row = i0 + warp * 16 * MT + 16 * (r >> 1) + 8 * (r & 1) + gq;
        if (row < seq_q) {
            long long out = (long long)row * o_stride + b * g.ld_o + h * D + 2 * tq;
            int mt = r >> 1, half = r & 1;
            #pragma unroll
            for (int nb = 0; nb < D / 8; nb++) tc_store2(o, out + nb * 8, acc[mt][nb][2 * half] * inv, acc[mt][nb][2 * half + 1] * inv, o_bf16);
            if (tq == 0) lse[(long long)bh * seq_q + row] = sum != 0.0f ? (m[r] + log2f(sum)) * TC_LN2 : NEG_INF;
        }
    }
}

// dK, dV (overwritten, f32 or bf16) and dQ (+= into the zeroed f32 dq_acc) for TC_BC keys of
// one (batch, kv head); query tiles of BR rows. lse2 and delta (attention_delta's) are indexed
// (batch · heads + head) · att_rows(g) + query. grid: (batch * kv_heads, ceil(seq_kv / TC_BC));
// block: TC_BWD_THREADS; shared: 2 TC_BC (D + 8) * 2 (K, V) + 2 stages of [2 BR (D + 8) * 2
// (Q, dO) + 3 BR * 4 (lse2, delta, position)] + TC_BC (BR + 8) * 2 (dS^T) bytes.
template <int D, int BR>
__device__ __forceinline__ void tc_attention_bwd(const bf16_t* dout, const bf16_t* q, const bf16_t* k, const bf16_t* v, const float* lse2, const float* delta, float* dq_acc, void* dk, void* dv, const int* qpos, const int* kvpos, const AttGeom& g) {
    constexpr int LD = D + 8, LDS = BR + 8;
    // One stage: Q, dO tiles, then lse2 (+inf: the row sees nothing), delta, position.
    constexpr int STAGE = 2 * BR * LD * 2 + 3 * BR * 4;
    static_assert(3 * BR / 4 <= TC_BWD_THREADS, "one 16-byte piece of a stage's rows a thread");
    extern __shared__ __align__(16) unsigned char tc_smem[];
    bf16_t* sk = reinterpret_cast<bf16_t*>(tc_smem);
    bf16_t* sv = sk + TC_BC * LD;
    unsigned char* stages = reinterpret_cast<unsigned char*>(sv + TC_BC * LD);
    bf16_t* sds = reinterpret_cast<bf16_t*>(stages + 2 * STAGE);  // dS transposed: [key][query]
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    int bk = ATT_HEAD(g), b = bk / (int)g.kv_heads, kvh = bk % (int)g.kv_heads;
    int group = (int)(g.heads / g.kv_heads);
    int seq_q = (int)g.seq_q, seq_kv = (int)g.seq_kv, rows_ld = att_rows(g);
    int j0 = ATT_TILE_IDX(g) * TC_BC;
    // Elements from one sequence position to the next (batch rows of the stored layout).
    int kv_stride = (int)g.batch * g.ld_kv;
    const bf16_t* kh = k + b * g.ld_kv + kvh * D;
    const bf16_t* vh = v + b * g.ld_kv + kvh * D;
    tc_fill<D, TC_BC, TC_BWD_THREADS>(sk, kh, j0, seq_kv, kv_stride);
    tc_fill<D, TC_BC, TC_BWD_THREADS>(sv, vh, j0, seq_kv, kv_stride);
    int ka = j0 + warp * 16 + gq, kb = ka + 8;
    // Causal masking: a key hides from queries at earlier positions; keys past seq_kv hide from
    // every query (INT_MAX); non-causal valid keys from none (INT_MIN).
    int pa = ka < seq_kv ? (g.causal ? kvpos[ka] : TC_INT_MIN) : TC_INT_MAX;
    int pb = kb < seq_kv ? (g.causal ? kvpos[kb] : TC_INT_MIN) : TC_INT_MAX;
    int jl = j0 + TC_BC - 1 < seq_kv - 1 ? j0 + TC_BC - 1 : seq_kv - 1;
    int first_kpos = kvpos[j0], last_kpos = kvpos[jl];
    bool sorted = g.q_sorted && g.kv_sorted;
    bool whole = j0 + TC_BC <= seq_kv;
    float sl2 = g.scale * TC_LOG2E;
    // The query tiles this CTA visits, per head: [first, q_tiles); of them [first_full,
    // q_tiles) need no mask. Causal with ascending positions: tiles ending before the first
    // key see none of this CTA's keys; tiles starting at or after the last key see all.
    int q_tiles = (seq_q + BR - 1) / BR, first = 0, first_full = whole ? 0 : q_tiles;
    if (g.causal && sorted) {
        first = tc_count(0, q_tiles, [&](int t) {
            int il = t * BR + BR - 1 < seq_q - 1 ? t * BR + BR - 1 : seq_q - 1;
            return qpos[il] < first_kpos;
        });
        first_full = whole ? tc_count(0, q_tiles, [&](int t) { return qpos[t * BR] < last_kpos; }) : q_tiles;
    } else if (g.causal) {
        first_full = q_tiles;
    }
    int per_head = q_tiles - first, total = group * per_head;
    // head_dim 64: this warp's K and V fragments stay in registers (16 each) instead of being
    // read from shared memory every tile (the backward is bound by shared-memory reads).
    constexpr bool KV_REGS = D <= 64;
    unsigned kf[KV_REGS ? D / 16 : 1][4], vf[KV_REGS ? D / 16 : 1][4];
    float dka[D / 8][4], dva[D / 8][4];
    #pragma unroll
    for (int nb = 0; nb < D / 8; nb++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) { dka[nb][e] = 0.0f; dva[nb][e] = 0.0f; }
    }
    for (int t = -1; t < total; t++) {
        // Start loading tile t + 1 (then wait for tile t): its stage was last read in t - 1.
        if (t >= 0) {
            tc_cp_wait_all();
            __syncthreads();
        }
        if (t + 1 < total) {
            int hn = kvh * group + (t + 1) / per_head, in0 = (first + (t + 1) % per_head) * BR;
            long long bhn = (long long)b * g.heads + hn;
            unsigned char* st = stages + ((t + 1) & 1) * STAGE;
            bf16_t* nq = reinterpret_cast<bf16_t*>(st);
            tc_fill<D, BR, TC_BWD_THREADS>(nq, q + b * g.ld_q + hn * D, in0, seq_q, (int)g.batch * g.ld_q);
            tc_fill<D, BR, TC_BWD_THREADS>(nq + BR * LD, dout + b * g.ld_o + hn * D, in0, seq_q, (int)g.batch * g.ld_o);
            float* nl = reinterpret_cast<float*>(nq + 2 * BR * LD);
            int piece = threadIdx.x;
            if (piece < BR / 4) {
                tc_fill_words(nl + 4 * piece, lse2 + bhn * rows_ld, in0 + 4 * piece, seq_q);
            } else if (piece < BR / 2) {
                piece -= BR / 4;
                tc_fill_words(nl + BR + 4 * piece, delta + bhn * rows_ld, in0 + 4 * piece, seq_q);
            } else if (piece < 3 * BR / 4) {
                piece -= BR / 2;
                tc_fill_words(nl + 2 * BR + 4 * piece, qpos, in0 + 4 * piece, seq_q);
            }
        }
        tc_cp_commit();
        if (t < 0) continue;
        int h = kvh * group + t / per_head, tile = first + t % per_head, i0 = tile * BR;
        const bf16_t* sq = reinterpret_cast<const bf16_t*>(stages + (t & 1) * STAGE);
        const bf16_t* sdo = sq + BR * LD;
        const float* sl = reinterpret_cast<const float*>(sdo + BR * LD);
        const float* sd = sl + BR;
        const int* sp = reinterpret_cast<const int*>(sd + BR);
        bool masked = tile < first_full;
        if (KV_REGS && t == 0) {
            // K and V landed with tile 0: this warp's A fragments of them, for every tile.
            #pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                tc_frag_a(kf[kk], sk, LD, warp * 16, kk * 16, lane);
                tc_frag_a(vf[kk], sv, LD, warp * 16, kk * 16, lane);
            }
        }
        // S^T = K Q^T: this warp's 16 keys x BR queries.
        float st[BR / 8][4];
        #pragma unroll
        for (int nb = 0; nb < BR / 8; nb++) { st[nb][0] = 0.0f; st[nb][1] = 0.0f; st[nb][2] = 0.0f; st[nb][3] = 0.0f; }
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            unsigned a[4];
            if (KV_REGS) { a[0] = kf[kk][0]; a[1] = kf[kk][1]; a[2] = kf[kk][2]; a[3] = kf[kk][3]; }
            else tc_frag_a(a, sk, LD, warp * 16, kk * 16, lane);
            #pragma unroll
            for (int nb = 0; nb < BR / 8; nb += 2) {
                unsigned bf[4];
                tc_frag_b_rows(bf, sq, LD, nb * 8, kk * 16, lane);
                tc_mma(st[nb], a, bf[0], bf[1]);
                tc_mma(st[nb + 1], a, bf[2], bf[3]);
            }
        }
        // P^T = exp(S^T scale − lse), masked. Query rows past seq_q have zero Q and dO, so
        // whatever P they get adds nothing.
        #pragma unroll
        for (int nb = 0; nb < BR / 8; nb++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                int c = nb * 8 + 2 * tq + e;
                float l = sl[c];
                float xa = tc_exp2(__fmaf_rn(st[nb][e], sl2, -l)), xb = tc_exp2(__fmaf_rn(st[nb][2 + e], sl2, -l));
                if (masked) {
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
            if (KV_REGS) { a[0] = vf[kk][0]; a[1] = vf[kk][1]; a[2] = vf[kk][2]; a[3] = vf[kk][3]; }
            else tc_frag_a(a, sv, LD, warp * 16, kk * 16, lane);
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
        // The accumulator is compact: (batch, head) rows of D, a sequence position apart by
        // batch · heads · D.
        float* dqh = dq_acc + ((long long)b * g.heads + h) * D;
        long long dqa_stride = g.batch * g.heads * D;
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
            int ia = i0 + m0 + gq, ib = ia + 8;
            if (ia < seq_q) {
                float* row = dqh + ia * dqa_stride + d0 + 2 * tq;
                #pragma unroll
                for (int nb = 0; nb < 4; nb++) tc_red2(row + nb * 8, g.scale * dqa[nb][0], g.scale * dqa[nb][1]);
            }
            if (ib < seq_q) {
                float* row = dqh + ib * dqa_stride + d0 + 2 * tq;
                #pragma unroll
                for (int nb = 0; nb < 4; nb++) tc_red2(row + nb * 8, g.scale * dqa[nb][2], g.scale * dqa[nb][3]);
            }
        }
    }
    tc_cp_wait_all();
    bool dk_bf16 = g.bf16 & ATT_BF16_DK, dv_bf16 = g.bf16 & ATT_BF16_DV;
    int dkv_stride = (int)g.batch * g.ld_dkv, head = b * g.ld_dkv + kvh * D + 2 * tq;
    if (ka < seq_kv) {
        long long row = (long long)ka * dkv_stride + head;
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) {
            tc_store2(dk, row + nb * 8, g.scale * dka[nb][0], g.scale * dka[nb][1], dk_bf16);
            tc_store2(dv, row + nb * 8, dva[nb][0], dva[nb][1], dv_bf16);
        }
    }
    if (kb < seq_kv) {
        long long row = (long long)kb * dkv_stride + head;
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) {
            tc_store2(dk, row + nb * 8, g.scale * dka[nb][2], g.scale * dka[nb][3], dk_bf16);
            tc_store2(dv, row + nb * 8, dva[nb][2], dva[nb][3], dv_bf16);
        }
    }
}

#define TC_FWD(D, BC)                                                                                \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_fwd_tc_d##D(                 \
        const bf16_t* q, const bf16_t* k, const bf16_t* v, void* o, float* lse, const int* qpos,     \
        const int* kvpos, AttGeom g) {                                                                \
        tc_attention_fwd<D, BC>(q, k, v, o, lse, qpos, kvpos, g);                                     \
    }
#define TC_DELTA(D)                                                                                  \
    extern "C" __global__ void attention_delta_tc_d##D(const void* dout, const void* o,               \
        const float* lse, float* delta, float* lse2, float* dq_acc, AttGeom g) {                      \
        tc_attention_delta<D>(dout, o, lse, delta, lse2, dq_acc, g);                                  \
    }
#define TC_BWD(D, BR)                                                                                \
    extern "C" __global__ void __launch_bounds__(TC_BWD_THREADS) attention_bwd_tc_d##D(              \
        const bf16_t* dout, const bf16_t* q, const bf16_t* k, const bf16_t* v, const float* lse2,    \
        const float* delta, float* dq_acc, void* dk, void* dv, const int* qpos, const int* kvpos,    \
        AttGeom g) {                                                                                  \
        tc_attention_bwd<D, BR>(dout, q, k, v, lse2, delta, dq_acc, dk, dv, qpos, kvpos, g);          \
    }
TC_FWD(64, 64)
TC_FWD(128, 32)
TC_DELTA(64)
TC_DELTA(128)
TC_BWD(64, 64)
TC_BWD(128, 64)
