// Flash-attention forward on Hopper's warpgroup MMA (`wgmma`, sm_90a): variant `wgmma` of op
// attention_fwd, the default on a Hopper (PARC_ATTENTION_FWD_KERNEL; attention_tc.cu's
// mma.sync kernel, `fa2`, is what other GPUs run). Same semantics as tc_attention_fwd: bf16 q, k, v in the stored layout [seq, batch,
// heads, head_dim], GQA, visibility by global position (ascending positions skip invisible
// tiles and mask only diagonal ones; otherwise every tile is masked), zero-filled rows past
// seq, fully masked rows o = 0 and lse = −inf, O f32 or bf16 (AttGeom::bf16), lse f32 in
// natural log at (batch · heads + head) · seq_q + row.
//
// A CTA of WGS warpgroups takes 64 query rows per warpgroup of one (batch, head): S = Q·Kᵀ with
// Q and K from shared memory (both K-major), online softmax in fp32 registers (exp2), then
// O += P·V with P re-packed from S's accumulators into bf16 A fragments in registers and V from
// shared memory read MN-major (V is stored [key][dim], the transpose wgmma's B wants). Tiles
// are written by cp.async into the 128-byte-swizzled layout the descriptors name (below), K/V
// two stages deep. The structure is the simplest correct one: every thread loads, every
// warpgroup computes, each wgmma group is waited for before its result is used; overlap comes
// from the other warpgroups and (d64) the second CTA on the SM.
//
// Shared-memory tiles: a tile of R rows × D bf16 columns is D/64 column blocks of R rows × 128
// bytes (block c at c · R · 128); the 16-byte chunk j (0..7) of row r sits at chunk j ^ (r % 8)
// of its 128-byte row (Swizzle<3,4,3>, the descriptors' 128-byte swizzle mode), every tile
// 1024-byte aligned so the hardware's swizzle phase starts at row 0. Read as K-major (Q, K: the
// reduction dim along the row) a 64-row slab is 8 groups of 8 rows at 1024 bytes (SBO); read
// MN-major (V: the output dim along the row) the reduction runs over rows, 8 at 1024 bytes
// (SBO), and the 64-column blocks sit R · 128 bytes apart (LBO).
#ifdef __CUDA_ARCH_FEAT_SM90_ALL

#define WG_THREADS 128

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Makes this thread's completed generic-proxy shared-memory writes (cp.async, st.shared)
// visible to the async proxy that wgmma reads through; a barrier must follow.
__device__ __forceinline__ void wg_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Keeps the compiler from moving accesses of r across an asynchronous wgmma that owns it.
template <int N>
__device__ __forceinline__ void wg_hold(float (&r)[N]) {
    #pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}

// A shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte
// offsets (each encoded >> 4 in 14 bits).
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
           ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// K-major operand: rows [row0, row0 + 64) (or the tile's first N rows for B), reduction columns
// [16 kk, 16 kk + 16) of a swizzled tile of R rows at shared address base. The k step moves
// 32 bytes inside the 128-byte row (the hardware applies the swizzle to the final address).
template <int R>
__device__ __forceinline__ unsigned long long wg_desc_k(unsigned base, int row0, int kk) {
    return wg_desc(base + (kk >> 2) * R * 128 + row0 * 128 + (kk & 3) * 32, 16, 1024);
}

// MN-major operand (B = the tile itself, reduction over its rows): rows [16 kk, 16 kk + 16),
// every column block (R · 128 bytes apart) of a swizzled tile of R rows at shared address base.
template <int R>
__device__ __forceinline__ unsigned long long wg_desc_mn(unsigned base, int kk) {
    return wg_desc(base + kk * 16 * 128, R * 128, 1024);
}

// Byte offset of 16-byte chunk c (8 bf16 columns: c · 8 .. c · 8 + 8) of row r in a swizzled
// tile of R rows.
template <int R>
__device__ __forceinline__ int wg_chunk(int r, int c) {
    return (c >> 3) * R * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// Starts filling a swizzled tile s of R rows × D columns with rows [r0, r0 + R) of one head
// of a bf16 tensor (row j at src + j · stride); rows at or past seq are zero.
template <int D, int R, int THREADS>
__device__ __forceinline__ void wg_fill(unsigned char* s, const bf16_t* src, int r0, int seq, long long stride) {
    constexpr int CH = D / 8, ITERS = (R * CH + THREADS - 1) / THREADS;
    #pragma unroll
    for (int it = 0; it < ITERS; it++) {
        int idx = it * THREADS + threadIdx.x;
        if (R * CH % THREADS == 0 || idx < R * CH) {
            int r = idx / CH, c = idx % CH, j = r0 + r;
            bool valid = j < seq;
            tc_cp16(s + wg_chunk<R>(r, c), src + (valid ? j : 0) * stride + c * 8, valid ? 16 : 0);
        }
    }
}

// d (64x64, fp32 accumulators) (+)= A·B, A and B from shared memory (descriptors), both K-major.
__device__ __forceinline__ void wg_mma_ss_n64(float (&d)[32], unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(accumulate));
}

// d (64x64, fp32 accumulators) += A·B, A (64x16 bf16) from registers in the accumulator-like
// fragment layout, B from shared memory, MN-major (imm-trans-b = 1).
__device__ __forceinline__ void wg_mma_rs_n64(float (&d)[32], const unsigned (&a)[4], unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// d (64x128, fp32 accumulators) += A·B, A (64x16 bf16) from registers in the accumulator-like
// fragment layout, B from shared memory, MN-major (imm-trans-b = 1).
__device__ __forceinline__ void wg_mma_rs_n128(float (&d)[64], const unsigned (&a)[4], unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}


// The bf16 A fragment (64 rows × keys [16 kk, 16 kk + 16)) of softmax probabilities held in an
// S accumulator: the accumulator's n8 blocks 2 kk and 2 kk + 1 hold exactly the A fragment's
// two column halves, for the same rows (wgmma's register layouts for A and D agree per warp).
template <int N>
__device__ __forceinline__ void wg_acc_to_a(unsigned (&a)[4], const float (&s)[N], int kk) {
    a[0] = tc_pack(s[8 * kk + 0], s[8 * kk + 1]);
    a[1] = tc_pack(s[8 * kk + 2], s[8 * kk + 3]);
    a[2] = tc_pack(s[8 * kk + 4], s[8 * kk + 5]);
    a[3] = tc_pack(s[8 * kk + 6], s[8 * kk + 7]);
}

// O (+)= P·V for one k step: N = D output columns.
template <int D>
__device__ __forceinline__ void wg_mma_pv(float (&o)[D / 2], const unsigned (&a)[4], unsigned long long b, int accumulate);
template <>
__device__ __forceinline__ void wg_mma_pv<64>(float (&o)[32], const unsigned (&a)[4], unsigned long long b, int accumulate) {
    wg_mma_rs_n64(o, a, b, accumulate);
}
template <>
__device__ __forceinline__ void wg_mma_pv<128>(float (&o)[64], const unsigned (&a)[4], unsigned long long b, int accumulate) {
    wg_mma_rs_n128(o, a, b, accumulate);
}

// The online-softmax step of one (masked) S tile of N accumulators a thread, in place: per row
// half (s[4 nb + 2 half + e]; a row's keys are spread over the 4 lanes of a quad) the running
// max m (of scores times sl2 = scale · log2 e), the factor corr that the running O and sum
// must be scaled by, p = exp2(s sl2 − m) and the running sum l. Shared by the wgmma and the
// warp-specialized forwards.
template <int N>
__device__ __forceinline__ void wg_online_softmax(float (&s)[N], float (&m)[2], float (&l)[2], float (&corr)[2], float sl2) {
    #pragma unroll
    for (int half = 0; half < 2; half++) {
        float x = NEG_INF;
        #pragma unroll
        for (int nb = 0; nb < N / 4; nb++) x = fmaxf(x, fmaxf(s[4 * nb + 2 * half], s[4 * nb + 2 * half + 1]));
        // The max of the raw scores (scale > 0, so it is the max of the scaled ones).
        x = fmaxf(m[half], tc_quad_max(x) * sl2);
        // A row that has seen no key yet keeps max −inf: subtract 0 instead (every p is 0).
        float base = x == NEG_INF ? 0.0f : x;
        corr[half] = tc_exp2(m[half] - base);
        m[half] = x;
        float sum = 0.0f;
        #pragma unroll
        for (int nb = 0; nb < N / 4; nb++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                float p = tc_exp2(__fmaf_rn(s[4 * nb + 2 * half + e], sl2, -base));
                s[4 * nb + 2 * half + e] = p;
                sum += p;
            }
        }
        l[half] = l[half] * corr[half] + sum;
    }
}

// Scales the rows of an accumulator (acc[4 nb + 2 half + e]) by corr[half].
template <int N>
__device__ __forceinline__ void wg_scale_rows(float (&acc)[N], const float (&corr)[2]) {
    #pragma unroll
    for (int nb = 0; nb < N / 4; nb++) {
        acc[4 * nb + 0] *= corr[0];
        acc[4 * nb + 1] *= corr[0];
        acc[4 * nb + 2] *= corr[1];
        acc[4 * nb + 3] *= corr[1];
    }
}

// Bytes of a swizzled tile of R rows × D bf16 columns.
#define WG_TILE_BYTES(R, D) ((R) * (D) * 2)

// grid: (batch * heads, ceil(seq_q / (64 WGS))); block: 128 WGS; shared: 1024 (alignment) +
// Q (64 WGS rows) + two stages of K, V (BC rows) + 2 BC key positions.
// Writes a warpgroup's finished rows of head (b, h): O = acc / l (f32 or bf16: AttGeom::bf16)
// for the rows wg_row0 + 16 warp + 8 half + gq below seq_q, and their lse (natural log) from
// the lanes that hold column 0. Shared by the wgmma and the warp-specialized forwards.
template <int D>
__device__ __forceinline__ void wg_store_o_lse(const float (&acc)[D / 2], const float (&m)[2], const float (&l)[2], void* o, float* lse, const AttGeom& g, int bh, int b, int h, int wg_row0, int warp, int gq, int tq) {
    int seq_q = (int)g.seq_q, o_stride = (int)g.batch * g.ld_o;
    bool o_bf16 = g.bf16 & ATT_BF16_O;
    #pragma unroll
    for (int half = 0; half < 2; half++) {
        float sum = tc_quad_sum(l[half]);
        float inv = sum != 0.0f ? 1.0f / sum : 0.0f;
        int row = wg_row0 + 16 * warp + 8 * half + gq;
        if (row < seq_q) {
            long long out = (long long)row * o_stride + b * g.ld_o + h * D + 2 * tq;
            #pragma unroll
            for (int nb = 0; nb < D / 8; nb++) tc_store2(o, out + nb * 8, acc[4 * nb + 2 * half] * inv, acc[4 * nb + 2 * half + 1] * inv, o_bf16);
            if (tq == 0) lse[(long long)bh * seq_q + row] = sum != 0.0f ? (m[half] + log2f(sum)) * TC_LN2 : NEG_INF;
        }
    }
}

template <int D, int BC, int WGS>
__device__ __forceinline__ void wg_attention_fwd(const bf16_t* q, const bf16_t* k, const bf16_t* v, void* o, float* lse, const int* qpos, const int* kvpos, const AttGeom& g) {
    static_assert(BC == 64, "S is one m64n64 accumulator");
    constexpr int BR = 64 * WGS, THREADS = WG_THREADS * WGS;
    constexpr int Q_BYTES = WG_TILE_BYTES(BR, D), KV_BYTES = WG_TILE_BYTES(BC, D);
    extern __shared__ __align__(16) unsigned char wg_smem_raw[];
    // The swizzle repeats every 1024 bytes of shared address: align the tiles to it.
    unsigned raw = tc_smem_addr(wg_smem_raw);
    unsigned char* smem = wg_smem_raw + ((1024 - (raw & 1023)) & 1023);
    unsigned char* sq = smem;
    unsigned char* skv = sq + Q_BYTES;  // stage s: K at skv + 2 s KV_BYTES, V after it
    int* skpos = reinterpret_cast<int*>(skv + 4 * KV_BYTES);  // stage s at skpos + s BC
    unsigned q_addr = tc_smem_addr(sq), kv_addr = tc_smem_addr(skv);
    int wg = threadIdx.x / WG_THREADS, warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    int gq = lane >> 2, tq = lane & 3;
    int bh = ATT_HEAD(g), b = bh / (int)g.heads, h = bh % (int)g.heads;
    int kvh = h / (int)(g.heads / g.kv_heads);
    int seq_q = (int)g.seq_q, seq_kv = (int)g.seq_kv;
    // The last query tiles (the longest, causal) first.
    int i0 = (ATT_TILES(g) - 1 - ATT_TILE_IDX(g)) * BR;
    // Elements from one sequence position to the next (batch rows of the stored layout).
    int q_stride = (int)g.batch * g.ld_q, kv_stride = (int)g.batch * g.ld_kv;
    const bf16_t* qh = q + b * g.ld_q + h * D;
    const bf16_t* kh = k + b * g.ld_kv + kvh * D;
    const bf16_t* vh = v + b * g.ld_kv + kvh * D;
    wg_fill<D, BR, THREADS>(sq, qh, i0, seq_q, q_stride);
    wg_fill<D, BC, THREADS>(skv, kh, 0, seq_kv, kv_stride);
    wg_fill<D, BC, THREADS>(skv + KV_BYTES, vh, 0, seq_kv, kv_stride);
    if (threadIdx.x < BC / 4) tc_fill_words(skpos + 4 * threadIdx.x, kvpos, 4 * threadIdx.x, seq_kv);
    tc_cp_commit();
    // This thread's rows: half 0 / 1 is row i0 + 64 wg + 16 warp + gq (+ 8).
    int last = seq_q - 1, wg_row0 = i0 + 64 * wg;
    int pos[2];
    float m[2], l[2];
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = wg_row0 + 16 * warp + 8 * r + gq;
        pos[r] = qpos[row < last ? row : last];
        m[r] = NEG_INF;
        l[r] = 0.0f;
    }
    bool sorted = g.q_sorted && g.kv_sorted;
    // Tiles [0, tiles) are loaded (the CTA's), [0, wg_tiles) computed by this warpgroup and
    // [0, wg_full) of them need no mask (every key valid and visible to all its rows).
    int tiles = (seq_kv + BC - 1) / BC, full = seq_kv / BC;
    int wg_tiles = tiles, wg_full = full;
    if (g.causal && sorted) {
        // A tile whose first key is past the last query is invisible, and so is every later
        // one; a whole tile whose last key is at or before the first query is full.
        int last_pos = qpos[i0 + BR - 1 < last ? i0 + BR - 1 : last];
        int wg_first = qpos[wg_row0 < last ? wg_row0 : last];
        int wg_last = qpos[wg_row0 + 63 < last ? wg_row0 + 63 : last];
        tiles = tc_count(0, tiles, [&](int t) { return kvpos[t * BC] <= last_pos; });
        wg_tiles = tc_count(0, tiles, [&](int t) { return kvpos[t * BC] <= wg_last; });
        wg_full = tc_count(0, full, [&](int t) { return kvpos[t * BC + BC - 1] <= wg_first; });
    } else if (g.causal) {
        wg_full = 0;
    }
    // A warpgroup wholly past seq_q computes nothing (it still loads and waits with the CTA).
    if (wg_row0 >= seq_q) wg_tiles = 0;
    float sl2 = g.scale * TC_LOG2E;
    float acc[D / 2];
    #pragma unroll
    for (int i = 0; i < D / 2; i++) acc[i] = 0.0f;
    for (int t = 0; t < tiles; t++) {
        int stage = t & 1, j0 = t * BC;
        tc_cp_wait_all();
        wg_fence_proxy();
        __syncthreads();  // tile t landed everywhere; every warpgroup is done with tile t - 1
        if (t + 1 < tiles) {
            int jn = j0 + BC;
            unsigned char* nk = skv + 2 * (stage ^ 1) * KV_BYTES;
            wg_fill<D, BC, THREADS>(nk, kh, jn, seq_kv, kv_stride);
            wg_fill<D, BC, THREADS>(nk + KV_BYTES, vh, jn, seq_kv, kv_stride);
            if (threadIdx.x < BC / 4) tc_fill_words(skpos + (stage ^ 1) * BC + 4 * threadIdx.x, kvpos, jn + 4 * threadIdx.x, seq_kv);
            tc_cp_commit();
        }
        if (t >= wg_tiles) continue;  // uniform per warpgroup
        unsigned k_addr = kv_addr + 2 * stage * KV_BYTES, v_addr = k_addr + KV_BYTES;
        const int* kp_tile = skpos + stage * BC;
        int kv_left = seq_kv - j0;
        // S = Q Kᵀ: 64 rows × BC keys per warpgroup.
        float s[BC / 2];
        #pragma unroll
        for (int i = 0; i < BC / 2; i++) s[i] = 0.0f;
        wg_fence();
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            wg_mma_ss_n64(s, wg_desc_k<BR>(q_addr, 64 * wg, kk), wg_desc_k<BC>(k_addr, 0, kk), kk > 0);
        }
        wg_commit();
        wg_wait_all();
        wg_hold(s);
        // Online softmax per row; s[4 nb + 2 half + e] is row 16 warp + 8 half + gq, key
        // nb · 8 + 2 tq + e (a row's keys are spread over the 4 lanes of a quad).
        if (t >= wg_full) {
            #pragma unroll
            for (int half = 0; half < 2; half++) {
                #pragma unroll
                for (int nb = 0; nb < BC / 8; nb++) {
                    #pragma unroll
                    for (int e = 0; e < 2; e++) {
                        int c = nb * 8 + 2 * tq + e;
                        if (c >= kv_left || (g.causal && kp_tile[c] > pos[half])) s[4 * nb + 2 * half + e] = NEG_INF;
                    }
                }
            }
        }
        float corr[2];
        wg_online_softmax(s, m, l, corr, sl2);
        wg_scale_rows(acc, corr);
        unsigned pa[BC / 16][4];
        #pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) wg_acc_to_a(pa[kk], s, kk);
        // O += P V: the fence orders the register writes above before the wgmma reads them.
        wg_fence();
        #pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) wg_mma_pv<D>(acc, pa[kk], wg_desc_mn<BC>(v_addr, kk), 1);
        wg_commit();
        wg_wait_all();  // V's stage is overwritten after the next barrier
        wg_hold(acc);
    }
    tc_cp_wait_all();
    wg_store_o_lse<D>(acc, m, l, o, lse, g, bh, b, h, wg_row0, warp, gq, tq);
}

// The layouts above checked on their own (attention.rs's wgmma layout check, one warpgroup):
// a, b, v are 64 × D row-major bf16 and p is 64 × 64; the kernel loads a, b, v into swizzled
// tiles with wg_fill as the attention kernel does and writes s = a·bᵀ (64 × 64: both operands
// K-major from shared memory, every k step of the head dim) and o = p·v (64 × D: p in
// registers as A fragments, v MN-major), both f32 row-major.
template <int D>
__device__ __forceinline__ void wg_layout_check(const bf16_t* a, const bf16_t* b, const bf16_t* p, const bf16_t* v, float* s_out, float* o_out) {
    constexpr int TILE = WG_TILE_BYTES(64, D);
    extern __shared__ __align__(16) unsigned char wg_smem_raw[];
    unsigned raw = tc_smem_addr(wg_smem_raw);
    unsigned char* smem = wg_smem_raw + ((1024 - (raw & 1023)) & 1023);
    wg_fill<D, 64, WG_THREADS>(smem, a, 0, 64, D);
    wg_fill<D, 64, WG_THREADS>(smem + TILE, b, 0, 64, D);
    wg_fill<D, 64, WG_THREADS>(smem + 2 * TILE, v, 0, 64, D);
    tc_cp_commit();
    tc_cp_wait_all();
    wg_fence_proxy();
    __syncthreads();
    unsigned base = tc_smem_addr(smem);
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    float s[32];
    #pragma unroll
    for (int i = 0; i < 32; i++) s[i] = 0.0f;
    wg_fence();
    #pragma unroll
    for (int kk = 0; kk < D / 16; kk++) wg_mma_ss_n64(s, wg_desc_k<64>(base, 0, kk), wg_desc_k<64>(base + TILE, 0, kk), kk > 0);
    wg_commit();
    wg_wait_all();
    wg_hold(s);
    #pragma unroll
    for (int i = 0; i < 32; i++) {
        int row = 16 * warp + gq + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * tq + (i & 1);
        s_out[row * 64 + col] = s[i];
    }
    // p's A fragments straight from global memory: registers 0..3 hold (row gq, keys 2 tq, +1),
    // (row gq + 8, same keys), (row gq, keys 8 + 2 tq, +1), (row gq + 8, those keys), keys
    // offset by 16 kk; rows offset by 16 warp.
    unsigned pa[4][4];
    const unsigned* pw = reinterpret_cast<const unsigned*>(p);
    #pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        int r0 = 16 * warp + gq, c0 = 16 * kk + 2 * tq;
        pa[kk][0] = pw[(r0 * 64 + c0) / 2];
        pa[kk][1] = pw[((r0 + 8) * 64 + c0) / 2];
        pa[kk][2] = pw[(r0 * 64 + c0 + 8) / 2];
        pa[kk][3] = pw[((r0 + 8) * 64 + c0 + 8) / 2];
    }
    float acc[D / 2];
    #pragma unroll
    for (int i = 0; i < D / 2; i++) acc[i] = 0.0f;
    wg_fence();
    #pragma unroll
    for (int kk = 0; kk < 4; kk++) wg_mma_pv<D>(acc, pa[kk], wg_desc_mn<64>(base + 2 * TILE, kk), kk > 0);
    wg_commit();
    wg_wait_all();
    wg_hold(acc);
    #pragma unroll
    for (int i = 0; i < D / 2; i++) {
        int row = 16 * warp + gq + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * tq + (i & 1);
        o_out[row * D + col] = acc[i];
    }
}

#define WG_FWD(D, BC, WGS, MINB)                                                                           \
    extern "C" __global__ void __launch_bounds__(WG_THREADS * WGS, MINB) attention_fwd_wgmma_d##D(      \
        const bf16_t* q, const bf16_t* k, const bf16_t* v, void* o, float* lse, const int* qpos,           \
        const int* kvpos, AttGeom g) {                                                                      \
        wg_attention_fwd<D, BC, WGS>(q, k, v, o, lse, qpos, kvpos, g);                                      \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) attention_wgmma_layout_check_d##D(             \
        const bf16_t* a, const bf16_t* b, const bf16_t* p, const bf16_t* v, float* s_out, float* o_out) {   \
        wg_layout_check<D>(a, b, p, v, s_out, o_out);                                                       \
    }
// d64: two warpgroups, two CTAs an SM (≤ 128 registers a thread); d128: three warpgroups, one
// CTA an SM (O alone is 64 registers a thread).
WG_FWD(64, 64, 2, 2)
WG_FWD(128, 64, 3, 1)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
