// Flash-attention backward, warp-specialized (variant `ws` of op attention_bwd, the default on a
// Hopper; compute_90a, head_dim 64 and 128 (attention_bwd_ws_d64, _d128; the budgets of d128 at
// wsb_attention_bwd); other GPUs, unaligned rows and `fa2` run attention_tc.cu's kernel):
// FlashAttention-3's backward structure, written for parc's layouts with the contract of
// tc_attention_bwd (after attention_delta_tc: lse2 and delta per query row, the f32 dQ
// accumulator zeroed; dK, dV f32 or bf16; causal masking by global position, whole invisible
// query tiles skipped when positions ascend). Measured on one H200 at 32·12·1024·64 causal:
// 187 TFLOP/s against 168 for the wgmma kernel it replaced (bench/RESULTS.md, session 7).
//
// A persistent CTA (one an SM) of three warpgroups walks the work items (key tile of WSB_BC
// keys, batch · kv head) blockIdx.x, + gridDim.x, ...: the first key tiles (the longest,
// causal) of every head first. Warpgroup 0 is the producer: its first warp walks the items and
// one lane issues the TMA loads, 128-byte swizzled (attention_wgmma_fwd.cu's tile layout): the
// item's K and V once, then for each of its query tiles (the GQA group's heads in turn) Q, dO
// (WSB_BR rows each) and their rows of lse2 and delta into a ring of WSB_STAGES slots.
// Warpgroups 1 and 2 each own 64 of the item's keys, keep their dK, dV in registers, and per
// query tile run
//   Sᵀ = K_w Qᵀ, dPᵀ = V_w dOᵀ                 (issued together)
//   Pᵀ = exp2(Sᵀ scale log2 e − lse2)           while dPᵀ multiplies
//   dV += Pᵀ dO                                 (A = Pᵀ from registers)
//   dSᵀ = Pᵀ ∘ (dPᵀ − delta)                    while dV multiplies; dSᵀ to shared memory
//   dK += dSᵀ Q, dQ_w = dS K_w                  (dQ over this warpgroup's 64 keys)
// then release the slot, put dQ_w (times scale) in shared memory and add it into the f32
// accumulator with one TMA reduction per 32 columns (cp.reduce.async.bulk.tensor, double
// buffered): no atomics issued by the threads, and the two consumers never wait for each other.
#ifdef __CUDA_ARCH_FEAT_SM90_ALL

#define WSB_BC 128
#define WSB_BR 64
#define WSB_THREADS 384
#define WSB_STAGES 3

// d (64 x 64, f32) (+)= A B, A and B from shared memory, both MN-major (dQ = dS K: A is dSᵀ
// stored [key][query], B is K stored [key][dim]; a consumer's dQ tile is 64 columns at both
// head dims).
__device__ __forceinline__ void wsb_mma_ss_n64_mn(float (&d)[32], unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(accumulate));
}

// Adds a shared-memory box into a 2-d f32 tensor in global memory (TMA reduction; rows or
// columns out of bounds are dropped), as one bulk async group of this thread.
__device__ __forceinline__ void tma_reduce_add_2d(const TmaMap& map, unsigned src, int c0, int c1) {
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"(reinterpret_cast<unsigned long long>(&map)), "r"(src), "r"(c0), "r"(c1)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's bulk groups still read their shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Adds a dQ tile (shared memory at src: two swizzled 32-column blocks of WSB_BR rows) into the
// f32 accumulator at column col, query row i0, as one bulk group of this thread.
__device__ __forceinline__ void wsb_reduce_dq(const TmaMap& tdq, unsigned src, int col, int i0) {
    tma_reduce_add_2d(tdq, src, col, i0);
    tma_reduce_add_2d(tdq, src + WSB_BR * 128, col + 32, i0);
    bulk_commit();
}
// A barrier of one warpgroup's 128 threads (named barrier id).
__device__ __forceinline__ void wg_bar(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }
// A barrier of both consumer warpgroups (256 threads; named barrier 3: the warpgroups' own are 1
// and 2).
__device__ __forceinline__ void consumers_bar() { asm volatile("bar.sync 3, 256;" ::: "memory"); }

// The query tiles of one item: the tiles [first, q_tiles) of each of the group's heads that
// some key of [j0, j0 + WSB_BC) is visible to, those before first_full masked. The producer
// computes them and hands them to the consumers in shared memory.
struct WsbRange {
    int first, first_full, per_head, total;
};

__device__ __forceinline__ WsbRange wsb_range(const int* qpos, const int* kvpos, const AttGeom& g, int j0, int group) {
    int seq_q = (int)g.seq_q, seq_kv = (int)g.seq_kv;
    int jl = j0 + WSB_BC - 1 < seq_kv - 1 ? j0 + WSB_BC - 1 : seq_kv - 1;
    int first_kpos = kvpos[j0], last_kpos = kvpos[jl];
    bool whole = j0 + WSB_BC <= seq_kv;
    int q_tiles = (seq_q + WSB_BR - 1) / WSB_BR;
    WsbRange r;
    r.first = 0;
    r.first_full = whole ? 0 : q_tiles;
    if (g.causal && g.q_sorted && g.kv_sorted) {
        // Tiles whose last query is before the first key are invisible (a prefix); tiles whose
        // first query is before the last key need masking (a prefix).
        int lo = 0, hi = q_tiles;
        while (lo < hi) {
            int mid = (lo + hi) / 2, il = mid * WSB_BR + WSB_BR - 1 < seq_q - 1 ? mid * WSB_BR + WSB_BR - 1 : seq_q - 1;
            if (qpos[il] < first_kpos) lo = mid + 1; else hi = mid;
        }
        r.first = lo;
        if (whole) {
            lo = 0; hi = q_tiles;
            while (lo < hi) { int mid = (lo + hi) / 2; if (qpos[mid * WSB_BR] < last_kpos) lo = mid + 1; else hi = mid; }
            r.first_full = lo;
        }
    } else if (g.causal) {
        r.first_full = q_tiles;
    }
    r.per_head = q_tiles - r.first;
    r.total = group * r.per_head;
    return r;
}

// Byte offset of the f32 pair at (row r, column c, c even) of a dQ tile in shared memory: two
// 128-byte-swizzled column blocks of 32 floats × WSB_BR rows (the reduction's tensor-map boxes).
__device__ __forceinline__ int wsb_dq_off(int r, int c) {
    return (c >> 5) * (WSB_BR * 128) + r * 128 + (((((c & 31) >> 2) ^ (r & 7))) << 4) + (c & 3) * 4;
}

// Pᵀ = exp2(Sᵀ scale log2 e − lse2) in place; MASKED: zero where the key (position pa, pb for
// this thread's two key rows) is after the query. Element (nb, half, e) of s is key row half,
// query column nb 8 + 2 tq + e of the tile at i0; the masked instantiation loads its queries'
// positions together before it uses any.
template <bool MASKED>
__device__ __forceinline__ void wsb_probs(float (&s)[32], const float* sl, const int* qpos, int i0, int last_q, int pa, int pb, float sl2, int tq) {
    int qp[WSB_BR / 4];
    if (MASKED) {
        #pragma unroll
        for (int nb = 0; nb < WSB_BR / 8; nb++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                int row = i0 + nb * 8 + 2 * tq + e;
                qp[2 * nb + e] = __ldg(qpos + (row < last_q ? row : last_q));
            }
        }
    }
    #pragma unroll
    for (int nb = 0; nb < WSB_BR / 8; nb++) {
        #pragma unroll
        for (int e = 0; e < 2; e++) {
            float l = sl[nb * 8 + 2 * tq + e];
            float xa = tc_exp2(__fmaf_rn(s[4 * nb + e], sl2, -l)), xb = tc_exp2(__fmaf_rn(s[4 * nb + 2 + e], sl2, -l));
            if (MASKED) {
                if (pa > qp[2 * nb + e]) xa = 0.0f;
                if (pb > qp[2 * nb + e]) xb = 0.0f;
            }
            s[4 * nb + e] = xa;
            s[4 * nb + 2 + e] = xb;
        }
    }
}

// grid: min(items, SMs); block: WSB_THREADS; shared: 1024 (alignment) + KV_BUFS K, V buffers
// (WSB_BC rows) + WSB_STAGES slots + dSᵀ (64 keys × WSB_BR bf16) per consumer + DQ_BUFS dQ tiles
// (WSB_BR × 64 f32) per consumer + 2 WSB_STAGES + 4 mbarriers + the ranges.
//
// Head dim 128 keeps the roles and tiles (128 keys an item, 64 a consumer, dK and dV 64 × 128
// f32 in its registers; 64-row Q, dO slots) with one K/V buffer (no next-item prefetch) and one
// dQ tile a consumer, its reduction issued at its tile's end behind a barrier and waited for
// (bulk_wait_read) before the next tile's dSᵀ barrier. Its dQ is FlashAttention-3's (SHARE):
// each consumer writes its dSᵀ half into one 128-key dSᵀ tile and, after a barrier of both
// consumers, computes dQ for its 64 of the 128 columns over all 128 keys (dQ = dS K[:, 64 cw
// ..]), reducing 64 × 64 f32 a tile; a second barrier of both, at the tile's end, frees the
// shared dSᵀ for the next tile and releases dQ to its reduction. Shared memory (WSB_SMEM_D128):
// 1024 alignment slack + K, V 128 × 128 bf16 (64 KiB) + 3 slots of Q, dO 64 × 128 bf16 and
// 1 KiB of lse2 / delta (3 × 33 KiB) + dSᵀ 128 × 64 bf16 (16 KiB) + 2 dQ tiles 64 × 64 f32
// (32 KiB) + 80 + 64 = 217,232 bytes (212.1 KiB) of the 227 KiB a block may opt in to (K/V
// double-buffered: +64 KiB, too many). Registers a consumer thread (setmaxnreg 240): dK, dV
// (128), Sᵀ and dPᵀ (64), Pᵀ's and dSᵀ's bf16 fragments (16 + 16), dQ 64 × 64 (32): at most 192
// live plus addressing. (d64's scheme at d128, each consumer's dQ over its own 64 keys for all
// 128 columns in 2 slots, was the variant `ws_split`: slower at every point measured on an
// H100, and removed.)
template <int D>
__device__ __forceinline__ void wsb_attention_bwd(const TmaMap& tq, const TmaMap& tdo, const TmaMap& tk, const TmaMap& tv, const TmaMap& tlse, const TmaMap& tdelta, const TmaMap& tdq, void* dk, void* dv, const int* qpos, const int* kvpos, const AttGeom& g) {
    constexpr int BC = WSB_BC, BR = WSB_BR, STAGES = WSB_STAGES;
    constexpr int KV_BUFS = D == 64 ? 2 : 1, DQ_BUFS = D == 64 ? 2 : 1;
    // d128 (SHARE) splits dQ's columns over the consumers, which share one dSᵀ tile; d64's
    // consumers each compute dQ over their own keys.
    constexpr bool SHARE = D == 128;
    // The dQ columns a consumer computes: all (over its own keys), or SHARE its half (over all).
    constexpr int DQC = SHARE ? D / 2 : D;
    static_assert(DQC == 64, "a consumer's dQ tile is 64 columns (wsb_mma_ss_n64_mn, wsb_reduce_dq)");
    constexpr int KT = BC * D * 2, QT = BR * D * 2, DST = 64 * BR * 2, DQT = BR * DQC * 4;
    // One ring slot: Q and dO tiles, then lse2 and delta rows (f32), padded so the next slot's
    // tiles stay 1024-byte aligned.
    constexpr int SLOT = 2 * QT + 1024;
    extern __shared__ __align__(16) unsigned char wsb_smem_raw[];
    unsigned raw = tc_smem_addr(wsb_smem_raw);
    int align = (1024 - (raw & 1023)) & 1023;
    unsigned char* smem = wsb_smem_raw + align;
    unsigned base = raw + align;
    // KV_BUFS K/V buffers (d64: item parity): K of buffer u at base + 2 u KT, V after it.
    unsigned slots = base + 2 * KV_BUFS * KT;       // slot s at slots + s SLOT
    unsigned ds_addr0 = slots + STAGES * SLOT;      // consumer c's dSᵀ at + c DST
    unsigned dq_addr0 = ds_addr0 + 2 * DST;         // consumer c's buffer u at + (DQ_BUFS c + u) DQT
    unsigned bars = dq_addr0 + 2 * DQ_BUFS * DQT;
    // full[s] at bars + 8 s, empty[s] at bars + 8 (STAGES + s), then kv_full[u],
    // kv_empty[u]; then per K/V buffer the item's query ranges (WsbRange, 8 ints a buffer).
    unsigned kv_full0 = bars + 16 * STAGES, kv_empty0 = kv_full0 + 16;
    int* ranges = reinterpret_cast<int*>(smem + (kv_empty0 + 16 - base));
    int bkh_count = (int)(g.batch * g.kv_heads), group = (int)(g.heads / g.kv_heads);
    int k_tiles = ((int)g.seq_kv + BC - 1) / BC;
    int work = k_tiles * bkh_count;
    int wg = __shfl_sync(FULL_MASK, (int)threadIdx.x / WG_THREADS, 0);
    if (threadIdx.x == 0) ws_pipeline_init(bars, STAGES, 8);  // 8: the consumers' warps
    __syncthreads();
    if (wg == 0) {
        // The producer: one thread walks the items and issues every load. K/V are
        // double-buffered, so the next item's load overlaps this one's last query tiles, and
        // its ranges (dependent loads of the positions) travel with it, off the consumers' path.
        regs_dealloc<24>();
        if (threadIdx.x != 0) return;
        tma_prefetch(tq);
        tma_prefetch(tdo);
        tma_prefetch(tk);
        tma_prefetch(tv);
        int it = 0, item = 0;
        for (int w = blockIdx.x; w < work; w += gridDim.x, item++) {
            int bk = w % bkh_count, j0 = (w / bkh_count) * BC;
            int b = bk / (int)g.kv_heads, kvh = bk % (int)g.kv_heads;
            WsbRange r = wsb_range(qpos, kvpos, g, j0, group);
            // The item's K/V buffer and the phase of its barriers (one buffer: every item's).
            int u = KV_BUFS == 2 ? item & 1 : 0;
            unsigned kv_full = kv_full0 + 8 * u, k_addr = base + 2 * u * KT;
            mbar_wait(kv_empty0 + 8 * u, (KV_BUFS == 2 ? (item >> 1) & 1 : item & 1) ^ 1);
            int* rg = ranges + 8 * u;
            rg[0] = r.first;
            rg[1] = r.first_full;
            rg[2] = r.per_head;
            rg[3] = r.total;
            mbar_expect_tx(kv_full, 2 * KT);  // releases the ranges with it
            ws_load_tile<D, BC>(k_addr, tk, kv_full, b * g.ld_kv + kvh * D, j0);
            ws_load_tile<D, BC>(k_addr + KT, tv, kv_full, b * g.ld_kv + kvh * D, j0);
            for (int t = 0; t < r.total; t++, it++) {
                int h = kvh * group + t / r.per_head, i0 = (r.first + t % r.per_head) * BR;
                int s = it % STAGES;
                unsigned full = bars + 8 * s, slot = slots + s * SLOT;
                mbar_wait(bars + 8 * (STAGES + s), ((it / STAGES) & 1) ^ 1);
                mbar_expect_tx(full, 2 * QT + 2 * BR * 4);
                ws_load_tile<D, BR>(slot, tq, full, b * g.ld_q + h * D, i0);
                ws_load_tile<D, BR>(slot + QT, tdo, full, b * g.ld_o + h * D, i0);
                int bh = b * (int)g.heads + h;
                tma_load_2d(slot + 2 * QT, tlse, full, i0, bh);
                tma_load_2d(slot + 2 * QT + BR * 4, tdelta, full, i0, bh);
            }
        }
        return;
    }
    regs_alloc<240>();
    int cw = wg - 1, warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    int gq = lane >> 2, tq4 = lane & 3;
    bool elected = (threadIdx.x & 127) == 0;
    int seq_q = (int)g.seq_q, seq_kv = (int)g.seq_kv, last_q = seq_q - 1;
    unsigned ds_addr = ds_addr0 + cw * DST;
    unsigned char* sds = smem + (ds_addr - base);
    float sl2 = g.scale * TC_LOG2E;
    bool dk_bf16 = g.bf16 & ATT_BF16_DK, dv_bf16 = g.bf16 & ATT_BF16_DV;
    // bf16 dK and dV on 16-byte aligned rows go out a row at a time (epilogue below).
    bool vec_out = dk_bf16 && dv_bf16 && g.ld_dkv % 8 == 0 && ((reinterpret_cast<unsigned long long>(dk) | reinterpret_cast<unsigned long long>(dv)) & 15) == 0;
    // The dQ tile written at the previous tile and not yet reduced: its first accumulator
    // column (−1: none) and query row.
    int pend_col = -1, pend_i0 = 0;
    int it = 0, item = 0;
    for (int w = blockIdx.x; w < work; w += gridDim.x, item++) {
        int bk = w % bkh_count, j0 = (w / bkh_count) * BC;
        int b = bk / (int)g.kv_heads, kvh = bk % (int)g.kv_heads;
        int u = KV_BUFS == 2 ? item & 1 : 0;
        unsigned k_addr = base + 2 * u * KT, v_addr = k_addr + KT;
        // This thread's key rows: 64 cw + 16 warp + gq and + 8 of the item.
        int ka = j0 + 64 * cw + 16 * warp + gq, kb = ka + 8;
        int pa = ka < seq_kv ? (g.causal ? kvpos[ka] : TC_INT_MIN) : TC_INT_MAX;
        int pb = kb < seq_kv ? (g.causal ? kvpos[kb] : TC_INT_MIN) : TC_INT_MAX;
        float dka[D / 2], dva[D / 2];
        #pragma unroll
        for (int i = 0; i < D / 2; i++) { dka[i] = 0.0f; dva[i] = 0.0f; }
        unsigned kw = k_addr + cw * 64 * 128;  // this consumer's keys of K (rows of each column block)
        mbar_wait(kv_full0 + 8 * u, KV_BUFS == 2 ? (item >> 1) & 1 : item & 1);
        // Read through lane 0: uniform to the compiler (the wgmma loop they bound is then not on
        // a divergent path, which ptxas serializes: C7520).
        const int* rg = ranges + 8 * u;
        WsbRange r;
        r.first = __shfl_sync(FULL_MASK, rg[0], 0);
        r.first_full = __shfl_sync(FULL_MASK, rg[1], 0);
        r.per_head = __shfl_sync(FULL_MASK, rg[2], 0);
        r.total = __shfl_sync(FULL_MASK, rg[3], 0);
        for (int t = 0; t < r.total; t++, it++) {
            int h = kvh * group + t / r.per_head, tile = r.first + t % r.per_head, i0 = tile * BR;
            int s = it % STAGES;
            unsigned slot = slots + s * SLOT, q_addr = slot, do_addr = slot + QT;
            const float* sl = reinterpret_cast<const float*>(smem + (slot - base) + 2 * QT);
            const float* sd = sl + BR;
            bool masked = tile < r.first_full;
            mbar_wait(bars + 8 * s, (it / STAGES) & 1);
            float sa[32], dp[32], dq[DQC / 2];
            wg_fence();
            #pragma unroll
            for (int kk = 0; kk < D / 16; kk++) wg_mma_ss_n64(sa, wg_desc_k<BC>(k_addr, 64 * cw, kk), wg_desc_k<BR>(q_addr, 0, kk), kk > 0);
            wg_commit();
            wg_fence();
            #pragma unroll
            for (int kk = 0; kk < D / 16; kk++) wg_mma_ss_n64(dp, wg_desc_k<BC>(v_addr, 64 * cw, kk), wg_desc_k<BR>(do_addr, 0, kk), kk > 0);
            wg_commit();
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            wg_hold(sa);
            // Pᵀ: element (nb, half, e) is key row 16 warp + 8 half + gq, query column
            // nb 8 + 2 tq + e.
            if (masked) wsb_probs<true>(sa, sl, qpos, i0, last_q, pa, pb, sl2, tq4);
            else wsb_probs<false>(sa, sl, qpos, i0, last_q, pa, pb, sl2, tq4);
            unsigned pf[4][4], dsf[4][4];
            #pragma unroll
            for (int kk = 0; kk < 4; kk++) wg_acc_to_a(pf[kk], sa, kk);
            wg_fence();
            #pragma unroll
            for (int kk = 0; kk < BR / 16; kk++) wg_mma_pv<D>(dva, pf[kk], wg_desc_mn<BR>(do_addr, kk), 1);
            wg_commit();
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            wg_hold(dp);
            #pragma unroll
            for (int nb = 0; nb < BR / 8; nb++) {
                #pragma unroll
                for (int e = 0; e < 2; e++) {
                    float dl = sd[nb * 8 + 2 * tq4 + e];
                    dp[4 * nb + e] = sa[4 * nb + e] * (dp[4 * nb + e] - dl);
                    dp[4 * nb + 2 + e] = sa[4 * nb + 2 + e] * (dp[4 * nb + 2 + e] - dl);
                }
            }
            #pragma unroll
            for (int kk = 0; kk < 4; kk++) wg_acc_to_a(dsf[kk], dp, kk);
            // dSᵀ (this warpgroup's 64 keys × the tile's queries) for dQ's A operand.
            #pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                int rr = warp * 16 + gq, c = kk * 16 + 2 * tq4;
                *reinterpret_cast<unsigned*>(sds + wg_chunk<64>(rr, c >> 3) + (c & 7) * 2) = dsf[kk][0];
                *reinterpret_cast<unsigned*>(sds + wg_chunk<64>(rr + 8, c >> 3) + (c & 7) * 2) = dsf[kk][1];
                *reinterpret_cast<unsigned*>(sds + wg_chunk<64>(rr, (c + 8) >> 3) + (c & 7) * 2) = dsf[kk][2];
                *reinterpret_cast<unsigned*>(sds + wg_chunk<64>(rr + 8, (c + 8) >> 3) + (c & 7) * 2) = dsf[kk][3];
            }
            // One fence and barrier a tile make dSᵀ (for dQ's wgmma) and the previous tile's dQ
            // (for its reduction, issued only now) visible to the async proxy. The dQ buffer
            // written at this tile's end was last read by the reduction issued at the previous
            // tile: the elected thread waits for it before the barrier.
            // SHARE: both consumers' dSᵀ halves written before either's dQ reads them.
            if (elected) bulk_wait_read<0>();
            wg_fence_proxy();
            if (SHARE) consumers_bar();
            else wg_bar(1 + cw);
            if (DQ_BUFS == 2 && elected && pend_col >= 0) wsb_reduce_dq(tdq, dq_addr0 + (2 * cw + ((it - 1) & 1)) * DQT, pend_col, pend_i0);
            wg_fence();
            #pragma unroll
            for (int kk = 0; kk < BR / 16; kk++) wg_mma_pv<D>(dka, dsf[kk], wg_desc_mn<BR>(q_addr, kk), 1);
            wg_commit();
            wg_fence();
            if (SHARE) {
                // dQ[:, 64 cw ..] over all 128 keys: A = both consumers' dSᵀ (128 key rows, the
                // two 64-row tiles adjacent), B = K's column block cw.
                #pragma unroll
                for (int kk = 0; kk < BC / 16; kk++) wsb_mma_ss_n64_mn(dq, wg_desc_mn<BC>(ds_addr0, kk), wg_desc_mn<BC>(k_addr + cw * BC * 128, kk), kk > 0);
            } else {
                #pragma unroll
                for (int kk = 0; kk < 4; kk++) wsb_mma_ss_n64_mn(dq, wg_desc_mn<64>(ds_addr, kk), wg_desc_mn<BC>(kw, kk), kk > 0);
            }
            wg_commit();
            wg_wait_all();
            wg_hold(dva);
            wg_hold(dka);
            wg_hold(dq);
            ws_hold_u(pf);
            ws_hold_u(dsf);
            mbar_arrive_warp(bars + 8 * (STAGES + s));
            // dQ_w · scale into this consumer's buffer (d64: it & 1), reduced (d64: at the next
            // tile or the kernel's end; d128: now) with one reduction per 32-column block into
            // the accumulator's rows [i0, i0 + BR) of head (b, h).
            unsigned dq_addr = dq_addr0 + (DQ_BUFS * cw + (DQ_BUFS == 2 ? it & 1 : 0)) * DQT;
            unsigned char* sdq = smem + (dq_addr - base);
            #pragma unroll
            for (int nb = 0; nb < DQC / 8; nb++) {
                int rr = warp * 16 + gq, c = nb * 8 + 2 * tq4;
                *reinterpret_cast<float2*>(sdq + wsb_dq_off(rr, c)) = make_float2(g.scale * dq[4 * nb], g.scale * dq[4 * nb + 1]);
                *reinterpret_cast<float2*>(sdq + wsb_dq_off(rr + 8, c)) = make_float2(g.scale * dq[4 * nb + 2], g.scale * dq[4 * nb + 3]);
            }
            if (DQ_BUFS == 1) {
                // Its last reader waited for (bulk_wait_read) before the barrier above. SHARE:
                // the barrier of both also frees the shared dSᵀ (both dQ products are done).
                wg_fence_proxy();
                if (SHARE) consumers_bar();
                else wg_bar(1 + cw);
                if (elected) wsb_reduce_dq(tdq, dq_addr, (b * (int)g.heads + h) * D + (SHARE ? 64 * cw : 0), i0);
            } else {
                pend_col = (b * (int)g.heads + h) * D;
                pend_i0 = i0;
            }
        }
        mbar_arrive_warp(kv_empty0 + 8 * u);
        int dkv_stride = (int)g.batch * g.ld_dkv, head = b * g.ld_dkv + kvh * D + 2 * tq4;
        if (vec_out) {
            // bf16 dK, dV through this consumer's dSᵀ tile (free: its last reader, the last
            // dQ product, is done): 16-byte rows out instead of 4-byte pairs.
            // d128: 64 columns (one 64 × 64 bf16 tile) at a time.
            #pragma unroll
            for (int which = 0; which < 2; which++) {
                #pragma unroll
                for (int half = 0; half < D / 64; half++) {
                    const float* a = which == 0 ? dka : dva;
                    float sc = which == 0 ? g.scale : 1.0f;
                    #pragma unroll
                    for (int nb = 0; nb < 8; nb++) {
                        int rr = warp * 16 + gq, off = (2 * tq4) * 2, ab = 4 * (8 * half + nb);
                        *reinterpret_cast<unsigned*>(sds + wg_chunk<64>(rr, nb) + off) = tc_pack(sc * a[ab], sc * a[ab + 1]);
                        *reinterpret_cast<unsigned*>(sds + wg_chunk<64>(rr + 8, nb) + off) = tc_pack(sc * a[ab + 2], sc * a[ab + 3]);
                    }
                    wg_bar(1 + cw);
                    bf16_t* out = static_cast<bf16_t*>(which == 0 ? dk : dv);
                    #pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int idx = i * WG_THREADS + (threadIdx.x & 127), rr = idx >> 3, j = idx & 7;
                        int key = j0 + 64 * cw + rr;
                        uint4 v = *reinterpret_cast<const uint4*>(sds + wg_chunk<64>(rr, j));
                        if (key < seq_kv) *reinterpret_cast<uint4*>(out + (long long)key * dkv_stride + b * g.ld_dkv + kvh * D + 64 * half + 8 * j) = v;
                    }
                    wg_bar(1 + cw);
                }
            }
        } else if (ka < seq_kv) {
            long long row = (long long)ka * dkv_stride + head;
            #pragma unroll
            for (int nb = 0; nb < D / 8; nb++) {
                tc_store2(dk, row + nb * 8, g.scale * dka[4 * nb], g.scale * dka[4 * nb + 1], dk_bf16);
                tc_store2(dv, row + nb * 8, dva[4 * nb], dva[4 * nb + 1], dv_bf16);
            }
        }
        if (!vec_out && kb < seq_kv) {
            long long row = (long long)kb * dkv_stride + head;
            #pragma unroll
            for (int nb = 0; nb < D / 8; nb++) {
                tc_store2(dk, row + nb * 8, g.scale * dka[4 * nb + 2], g.scale * dka[4 * nb + 3], dk_bf16);
                tc_store2(dv, row + nb * 8, dva[4 * nb + 2], dva[4 * nb + 3], dv_bf16);
            }
        }
    }
    // The last tile's dQ, then every reduction done (they read shared memory until they
    // complete: the CTA must outlive them).
    if (DQ_BUFS == 2) {
        wg_fence_proxy();
        wg_bar(1 + cw);
        if (elected && pend_col >= 0) wsb_reduce_dq(tdq, dq_addr0 + (2 * cw + ((it - 1) & 1)) * DQT, pend_col, pend_i0);
    }
    if (elected) bulk_wait_all();
}

#define WSB_BWD(NAME, D)                                                                                            \
    extern "C" __global__ void __launch_bounds__(WSB_THREADS, 1) NAME(                                              \
        const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tdo, const __grid_constant__ TmaMap tk,   \
        const __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap tlse,                                     \
        const __grid_constant__ TmaMap tdelta, const __grid_constant__ TmaMap tdq, void* dk, void* dv,              \
        const int* qpos, const int* kvpos, AttGeom g) {                                                              \
        wsb_attention_bwd<D>(tq, tdo, tk, tv, tlse, tdelta, tdq, dk, dv, qpos, kvpos, g);                           \
    }
WSB_BWD(attention_bwd_ws_d64, 64)
WSB_BWD(attention_bwd_ws_d128, 128)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
