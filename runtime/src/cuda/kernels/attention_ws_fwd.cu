// Flash-attention forward, warp-specialized (variant `ws` of op attention_fwd, the default on a
// Hopper; compute_90a, head_dim 64 and 128 (attention_fwd_ws_d64: one ring of K and V slots;
// attention_fwd_ws_d128: separate K and V rings, ws_attention_fwd_kv below): where a tensor map
// cannot be encoded attention_wgmma_fwd.cu's kernel runs, on other GPUs `fa2`): the structure
// of FlashAttention-3's forward, written for parc's layouts and with the contract of
// attention_wgmma_fwd.cu (bf16 q, k, v in the stored layout [seq, batch, heads, head_dim] read
// through AttGeom's row strides, GQA, visibility by global
// position with whole invisible tiles skipped and only diagonal tiles masked when positions
// ascend, rows past seq zero, fully masked rows o = 0 and lse = −inf, O f32 or bf16, lse f32 in
// natural log at (batch · heads + head) · seq_q + row).
//
// A persistent CTA (one an SM) of three warpgroups works through the work items (query tile,
// batch · head) in ws_claimed_item's order: item blockIdx.x first, then each the next not yet
// claimed (a global counter), a head's query tiles together, its last (causal: longest) first,
// so the CTAs working at once share a few heads' K and V in L2. Warpgroup 0 is the producer: one thread issues TMA loads (tensor maps of q, k, v,
// 128-byte swizzle: attention_wgmma_fwd.cu's tile layout, so its descriptors serve) of the
// item's Q tile (WS_BR rows) and of its K/V tiles (BC rows) into a ring of WS_STAGES slots,
// each load completing on its slot's mbarrier; the others give their registers back
// (setmaxnreg). Warpgroups 1 and 2 each own 64 query rows and run, per key tile t:
//   S_t = Q K_tᵀ (issued), O += P_{t−1} V_{t−1} (issued), wait for S_t only,
//   online softmax of S_t while P_{t−1} V_{t−1} multiplies, wait, release slot t − 1,
//   rescale O, P_t = bf16(S_t)
// so the tensor cores work through each softmax (FA3's intra-warpgroup overlap). The two
// consumers also take turns issuing their GEMMs (FA3's inter-warpgroup "ping-pong": two named
// barriers, ws_turn_wait / ws_turn_pass), so one's softmax runs while the other's GEMMs hold
// the tensor cores instead of both colliding at random (0–10% on an H100, docs/cuda.md). A
// consumer that has no work on a tile (causal, its rows all before the tile) still waits for
// the slot, releases it and passes its turn, so the ring's phases and the turns stay in step.
#ifdef __CUDA_ARCH_FEAT_SM90_ALL

#define WS_BR 128
#define WS_THREADS 384

// d (64 x 128, fp32 accumulators) (+)= A·B, A and B from shared memory, both K-major.
__device__ __forceinline__ void wg_mma_ss_n128(float (&d)[64], unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
}

// S (64 x BC) = Q Kᵀ over the head dim (D / 16 k steps), both K-major in shared memory.
template <int D, int BC>
__device__ __forceinline__ void ws_qk(float (&s)[BC / 2], unsigned q_addr, int row0, unsigned k_addr);
template <>
__device__ __forceinline__ void ws_qk<64, 64>(float (&s)[32], unsigned q_addr, int row0, unsigned k_addr) {
    #pragma unroll
    for (int kk = 0; kk < 4; kk++) wg_mma_ss_n64(s, wg_desc_k<WS_BR>(q_addr, row0, kk), wg_desc_k<64>(k_addr, 0, kk), kk > 0);
}
template <>
__device__ __forceinline__ void ws_qk<64, 128>(float (&s)[64], unsigned q_addr, int row0, unsigned k_addr) {
    #pragma unroll
    for (int kk = 0; kk < 4; kk++) wg_mma_ss_n128(s, wg_desc_k<WS_BR>(q_addr, row0, kk), wg_desc_k<128>(k_addr, 0, kk), kk > 0);
}
template <>
__device__ __forceinline__ void ws_qk<128, 128>(float (&s)[64], unsigned q_addr, int row0, unsigned k_addr) {
    #pragma unroll
    for (int kk = 0; kk < 8; kk++) wg_mma_ss_n128(s, wg_desc_k<WS_BR>(q_addr, row0, kk), wg_desc_k<128>(k_addr, 0, kk), kk > 0);
}

// Loads rows [r0, r0 + R) of one head (its first column c0) of a bf16 tensor map into a swizzled
// tile of R rows × D columns at dst: one box of 64 columns (the 128-byte swizzle's widest) per
// column block, block c at dst + c · R · 128, all completing on bar.
template <int D, int R>
__device__ __forceinline__ void ws_load_tile(unsigned dst, const TmaMap& map, unsigned bar, int c0, int r0) {
    #pragma unroll
    for (int c = 0; c < D / 64; c++) tma_load_2d(dst + c * R * 128, map, bar, c0 + 64 * c, r0);
}

// Keeps the compiler from reusing P's registers while a wgmma reading them may be in flight.
template <int N>
__device__ __forceinline__ void ws_hold_u(unsigned (&r)[N][4]) {
    #pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i][0]), "+r"(r[i][1]), "+r"(r[i][2]), "+r"(r[i][3])::"memory");
}

// Claimed work items (both warp-specialized attention kernels). Items are numbered pair-major,
// each pair's tiles longest first (causal): the forward's pairs are (batch, head) and its
// tiles query tiles, last first; the backward's are wsb_heads' pairs and its tiles key tiles,
// first first. Each CTA's producer takes item blockIdx.x, then claims the next from a global
// counter (ws_claim_next) once it has issued the current one's loads, so CTAs that drew short
// items take more, and the CTAs working at once share a few pairs, whose K and V (forward) or
// dQ rows (backward) stay in L2. The last CTA out resets the counter (ws_claims_done).
//
// The claim order (ws_claimed_item): the pair-major order, except its last `tail` items (two
// waves of CTAs: ws_claim_tail), which go tile by tile across their pairs, so the last items
// claimed are the shortest and no CTA starts a long one when the others are nearly done. A
// greedy-claim simulation of issue 19's grid (132 CTAs) puts the slowest CTA 7–63% past an even
// share in pair order to the end (GQA 6:1 worst), 0–7% with the sorted tail; measured on an
// H100 (2026-12-06, bench/RESULTS.md) the sorted tail gained the backward 4–46% at every
// head-dim-64 point of the grid (GQA 6:1, T 8192: 294 → 429 TFLOP/s) and 5–7% at head dim 128
// without GQA. Returns claim w's item in pair-major numbering (pair w / tiles, its tile
// w % tiles, 0 the longest); a bijection (checked on the host for up to 70 tiles × 70 pairs × 5
// grid sizes; a missed or repeated tile would fail the many-items GPU tests).
__host__ __device__ __forceinline__ int ws_claimed_item(int w, int tiles, int pairs, int tail) {
    int head = tiles * pairs - tail;
    if (w < head) return w;
    // The tail: pair p0's tiles [j_start, tiles) and every tile of the `full` pairs after it,
    // tile by tile; tile j has `full` of them before j_start, full + 1 (p0's first) from
    // j_start on.
    int p0 = head / tiles, j_start = head % tiles, full = pairs - p0 - 1;
    int t = w - head, before = j_start * full, p, j;
    if (t < before) {
        p = p0 + 1 + t % full;
        j = t / full;
    } else {
        t -= before;
        p = p0 + t % (full + 1);
        j = j_start + t / (full + 1);
    }
    return p * tiles + j;
}

// The sorted tail of the claim order: two waves of CTAs' items, or all of them.
__device__ __forceinline__ int ws_claim_tail(int work) {
    int tail = 2 * (int)gridDim.x;
    return tail < work ? tail : work;
}

// The producer's next claim (the first gridDim.x went one to each CTA).
__device__ __forceinline__ int ws_claim_next(int* work_counter) { return (int)gridDim.x + atomicAdd(work_counter, 1); }

// The producer's exit: the last CTA out resets the counter and the exit count for the next
// launch (every CTA's claims precede its exit count, and the next launch follows this one).
__device__ __forceinline__ void ws_claims_done(int* work_counter) {
    if (atomicAdd(work_counter + 1, 1) == (int)gridDim.x - 1) {
        work_counter[0] = 0;
        work_counter[1] = 0;
    }
}

// The forward's claimed item c: its pair bh and its query tile's first row i0 (ws_claimed_item's
// tile 0 is the pair's last query tile).
struct WsItem {
    int bh, i0;
};

__device__ __forceinline__ WsItem ws_item(int c, int q_tiles) {
    WsItem it;
    it.bh = c / q_tiles;
    it.i0 = (q_tiles - 1 - c % q_tiles) * WS_BR;
    return it;
}

// One work item's tile ranges, the same in the producer and the consumers: the CTA's query
// rows [i0, i0 + WS_BR), the key tiles [0, tiles) it loads, and for one consumer's 64 rows
// starting at row0 the tiles [0, wg_tiles) it computes and [0, wg_full) of them unmasked. The
// producer computes them and hands them to the consumers in shared memory.
struct WsRange {
    int tiles, wg_tiles, wg_full;
};

template <int BC>
__device__ __forceinline__ WsRange ws_range(const int* qpos, const int* kvpos, const AttGeom& g, int i0, int row0) {
    int seq_q = (int)g.seq_q, seq_kv = (int)g.seq_kv, last = seq_q - 1;
    WsRange r;
    r.tiles = (seq_kv + BC - 1) / BC;
    int full = seq_kv / BC;
    r.wg_tiles = r.tiles;
    r.wg_full = full;
    if (g.causal && g.q_sorted && g.kv_sorted) {
        int last_pos = qpos[i0 + WS_BR - 1 < last ? i0 + WS_BR - 1 : last];
        int wg_first = qpos[row0 < last ? row0 : last];
        int wg_last = qpos[row0 + 63 < last ? row0 + 63 : last];
        // Prefix counts (positions ascend): tiles whose first key some row sees, and whole
        // tiles whose last key every row sees.
        int lo = 0, hi = r.tiles;
        while (lo < hi) { int mid = (lo + hi) / 2; if (kvpos[mid * BC] <= last_pos) lo = mid + 1; else hi = mid; }
        r.tiles = lo;
        lo = 0; hi = r.tiles;
        while (lo < hi) { int mid = (lo + hi) / 2; if (kvpos[mid * BC] <= wg_last) lo = mid + 1; else hi = mid; }
        r.wg_tiles = lo;
        lo = 0; hi = full;
        while (lo < hi) { int mid = (lo + hi) / 2; if (kvpos[mid * BC + BC - 1] <= wg_first) lo = mid + 1; else hi = mid; }
        r.wg_full = lo;
    } else if (g.causal) {
        r.wg_full = 0;
    }
    if (row0 >= seq_q) r.wg_tiles = 0;
    if (r.wg_full > r.wg_tiles) r.wg_full = r.wg_tiles;
    return r;
}

// Masks (MASKED) and exponentiates one S tile in place, updating the row maxima m and sums l;
// returns the factors the running O must be scaled by (corr). s[4 nb + 2 half + e] is row
// 16 warp + 8 half + gq of the warpgroup, key nb · 8 + 2 tq + e of the tile (kv_left keys of it
// exist, at positions kp). Two instantiations, so the unmasked one has no per-element test,
// and the masked one loads its keys' positions together before it uses any.
template <int BC, bool MASKED>
__device__ __forceinline__ void ws_softmax(float (&s)[BC / 2], float (&m)[2], float (&l)[2], float (&corr)[2], int kv_left, const int* kp, const int (&pos)[2], bool causal, float sl2, int tq) {
    if (MASKED) {
        // A key masks a row when it is past the tile's keys or, causal, after the row.
        int kpos[BC / 4];
        #pragma unroll
        for (int nb = 0; nb < BC / 8; nb++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                int c = nb * 8 + 2 * tq + e;
                kpos[2 * nb + e] = c < kv_left ? (causal ? __ldg(kp + c) : TC_INT_MIN) : TC_INT_MAX;
            }
        }
        #pragma unroll
        for (int half = 0; half < 2; half++) {
            #pragma unroll
            for (int nb = 0; nb < BC / 8; nb++) {
                #pragma unroll
                for (int e = 0; e < 2; e++) {
                    if (kpos[2 * nb + e] > pos[half]) s[4 * nb + 2 * half + e] = NEG_INF;
                }
            }
        }
    }
    wg_online_softmax(s, m, l, corr, sl2);
}

// The consumers' turns at the tensor cores: consumer cw waits on named barrier WS_TURN_BAR + cw
// (256 threads: both consumer warpgroups) before issuing a turn's wgmmas and, once they are
// issued, arrives on the other's. The first completes with the other consumer's arrival, the
// second with the other's wait, so each turn alternates strictly between the two.
#define WS_TURN_BAR 1
__device__ __forceinline__ void ws_turn_wait(int cw) { named_bar_sync<256>(WS_TURN_BAR + cw); }
__device__ __forceinline__ void ws_turn_pass(int cw) { named_bar_arrive<256>(WS_TURN_BAR + 1 - cw); }

// ws_softmax, masked or not (the choice is uniform per warpgroup).
template <int BC>
__device__ __forceinline__ void ws_softmax_tile(bool masked, float (&s)[BC / 2], float (&m)[2], float (&l)[2], float (&corr)[2], int kv_left, const int* kp, const int (&pos)[2], bool causal, float sl2, int tq) {
    if (masked) ws_softmax<BC, true>(s, m, l, corr, kv_left, kp, pos, causal, sl2, tq);
    else ws_softmax<BC, false>(s, m, l, corr, kv_left, kp, pos, causal, sl2, tq);
}

// grid: min(work items, SMs); block: WS_THREADS; shared: 1024 (alignment) + two Q buffers
// (WS_BR rows) + WS_STAGES slots of K and V (BC rows each) + 2 WS_STAGES + 4 mbarriers + the
// two items' ranges. Q is double-buffered, so the producer loads the next item's Q (and
// K/V) while this one computes; it also computes the item's tile ranges (dependent loads of
// the positions) once and hands them over with Q, off the consumers' path. Head dim D (64 or
// 128): each tile is D / 64 column blocks of 128-byte rows, one TMA box each.
//
// Turns (consumer cw waits on barrier WS_TURN_BAR + cw, arrives on the other's), the invariant
// that keeps them deadlock-free: per item each consumer takes exactly tiles + 1 turns, its n
// (wg_tiles) + 1 with GEMMs (S_0; S_t with P_{t−1} V_{t−1} for t in [1, n); the last
// P_{n−1} V_{n−1}) and one empty turn (wait, pass) for each tile in [n, tiles) it does not
// compute, plus one more if n = 0. Every arrival then meets exactly one wait: consumer 1
// arrives once before its first turn (consumer 0 goes first) and consumer 0 waits once after
// its last item (taking consumer 1's last arrival), so both barriers are idle at exit, and
// turn k of consumer 1 falls between turns k and k + 1 of consumer 0. No cycle through the
// ring: counting tiles and turns over the whole loop (an item has one more turn than tiles),
// turn k waits for the other's turn k − 1 or k, which waits for at most tile k's data; its load
// needs the slot of tile k − 2 released by both, and a consumer releases tile j before it
// waits for turn j + 2 or tile j + 2 (a computed one after its P·V in turn j + 1, one it skips
// at once), so 2 slots suffice as they did without turns. The epilogue (O, lse) is outside the
// turns.
template <int D, int BC, int WS_STAGES>
__device__ __forceinline__ void ws_attention_fwd(const TmaMap& tq_map, const TmaMap& tk_map, const TmaMap& tv_map, void* o, float* lse, int* work_counter, const int* qpos, const int* kvpos, const AttGeom& g) {
    constexpr int Q_BYTES = WG_TILE_BYTES(WS_BR, D), KV_BYTES = WG_TILE_BYTES(BC, D);
    extern __shared__ __align__(16) unsigned char ws_smem_raw[];
    unsigned raw = tc_smem_addr(ws_smem_raw);
    unsigned char* smem = ws_smem_raw + ((1024 - (raw & 1023)) & 1023);
    unsigned q_addr0 = tc_smem_addr(smem);  // buffer u at q_addr0 + u Q_BYTES
    unsigned kv_addr = q_addr0 + 2 * Q_BYTES;  // slot s: K at kv_addr + 2 s KV_BYTES, V after it
    unsigned bars = kv_addr + 2 * WS_STAGES * KV_BYTES;
    // full[s] at bars + 8 s, empty[s] at bars + 8 (WS_STAGES + s), then q_full[u], q_empty[u];
    // then per Q buffer the item's ranges: tiles, and wg_tiles, wg_full of each consumer.
    unsigned q_full0 = bars + 16 * WS_STAGES, q_empty0 = q_full0 + 16;
    int* ranges = reinterpret_cast<int*>(smem + (q_empty0 + 16 - q_addr0));  // 8 ints a buffer
    int bh_count = (int)(g.batch * g.heads);
    int q_tiles = ((int)g.seq_q + WS_BR - 1) / WS_BR;
    int work = q_tiles * bh_count;
    // The warpgroup, warp-uniform to the compiler (as CUTLASS's canonical_warp_group_idx).
    int wg = __shfl_sync(FULL_MASK, (int)threadIdx.x / WG_THREADS, 0);
    if (threadIdx.x == 0) ws_pipeline_init(bars, WS_STAGES, 8);  // 8: the consumers' warps
    __syncthreads();
    if (wg == 0) {
        regs_dealloc<24>();
        // One thread walks the items and issues every load.
        if (threadIdx.x != 0) return;
        tma_prefetch(tq_map);
        tma_prefetch(tk_map);
        tma_prefetch(tv_map);
        int it = 0, item = 0, tail = ws_claim_tail(work);
        for (int w = blockIdx.x;; item++) {
            int u = item & 1;
            unsigned q_full = q_full0 + 8 * u;
            int* rg = ranges + 8 * u;
            if (w >= work) {
                // No work left: a bare arrival hands the consumers item −1, their signal to stop.
                mbar_wait(q_empty0 + 8 * u, ((item >> 1) & 1) ^ 1);
                rg[5] = -1;
                mbar_arrive(q_full);
                break;
            }
            int c = ws_claimed_item(w, q_tiles, bh_count, tail);
            WsItem wi = ws_item(c, q_tiles);
            int bh = wi.bh, i0 = wi.i0;
            int b = bh / (int)g.heads, h = bh % (int)g.heads;
            int kvh = h / (int)(g.heads / g.kv_heads);
            // The CTA's key tiles are those of its later consumer (rows i0 + 64 ..), which
            // sees every key the earlier one does.
            WsRange r0 = ws_range<BC>(qpos, kvpos, g, i0, i0);
            WsRange r1 = ws_range<BC>(qpos, kvpos, g, i0, i0 + 64);
            int tiles = r1.tiles;
            mbar_wait(q_empty0 + 8 * u, ((item >> 1) & 1) ^ 1);
            rg[0] = tiles;
            rg[1] = r0.wg_tiles;
            rg[2] = r0.wg_full;
            rg[3] = r1.wg_tiles;
            rg[4] = r1.wg_full;
            rg[5] = c;
            mbar_expect_tx(q_full, Q_BYTES);  // releases the ranges and the item with it
            ws_load_tile<D, WS_BR>(q_addr0 + u * Q_BYTES, tq_map, q_full, b * g.ld_q + h * D, i0);
            int kc = b * g.ld_kv + kvh * D;
            for (int t = 0; t < tiles; t++, it++) {
                int s = it % WS_STAGES;
                unsigned full = bars + 8 * s, empty = bars + 8 * (WS_STAGES + s);
                mbar_wait(empty, ((it / WS_STAGES) & 1) ^ 1);
                mbar_expect_tx(full, 2 * KV_BYTES);
                unsigned k_addr = kv_addr + 2 * s * KV_BYTES;
                ws_load_tile<D, BC>(k_addr, tk_map, full, kc, t * BC);
                ws_load_tile<D, BC>(k_addr + KV_BYTES, tv_map, full, kc, t * BC);
            }
            w = ws_claim_next(work_counter);
        }
        ws_claims_done(work_counter);
        return;
    }
    regs_alloc<240>();
    int cw = wg - 1, warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    int gq = lane >> 2, tq = lane & 3;
    int seq_q = (int)g.seq_q, seq_kv = (int)g.seq_kv, last = seq_q - 1;
    float sl2 = g.scale * TC_LOG2E;
    if (cw == 1) ws_turn_pass(cw);  // consumer 0 takes the first turn (invariant above)
    int it = 0;
    for (int item = 0;; item++) {
        int u = item & 1;
        unsigned q_addr = q_addr0 + u * Q_BYTES, q_empty = q_empty0 + 8 * u;
        mbar_wait(q_full0 + 8 * u, (item >> 1) & 1);
        const int* rg = ranges + 8 * u;
        // Read from shared memory through lane 0: uniform to the compiler, so the wgmma loops
        // they bound are not on a divergent path (which ptxas serializes, C7520).
        int c = __shfl_sync(FULL_MASK, rg[5], 0);
        if (c < 0) break;
        WsItem wi = ws_item(c, q_tiles);
        int bh = wi.bh, i0 = wi.i0;
        int b = bh / (int)g.heads, h = bh % (int)g.heads;
        int wg_row0 = i0 + 64 * cw;
        int pos[2];
        float m[2], l[2];
        #pragma unroll
        for (int half = 0; half < 2; half++) {
            int row = wg_row0 + 16 * warp + 8 * half + gq;
            pos[half] = qpos[row < last ? row : last];
            m[half] = NEG_INF;
            l[half] = 0.0f;
        }
        float acc[D / 2];
        #pragma unroll
        for (int i = 0; i < D / 2; i++) acc[i] = 0.0f;
        WsRange r;
        r.tiles = __shfl_sync(FULL_MASK, rg[0], 0);
        r.wg_tiles = __shfl_sync(FULL_MASK, rg[1 + 2 * cw], 0);
        r.wg_full = __shfl_sync(FULL_MASK, rg[2 + 2 * cw], 0);
        int tiles = r.tiles;
        int n = r.wg_tiles;
        float s[BC / 2];
        unsigned pa[BC / 16][4];
        if (n == 0) {
            mbar_arrive_warp(q_empty);
            ws_turn_wait(cw);  // the one extra empty turn (tiles + 1 in all)
            ws_turn_pass(cw);
        } else {
            // Tile 0: S_0 alone (O is still zero).
            mbar_wait(bars + 8 * (it % WS_STAGES), (it / WS_STAGES) & 1);
            ws_turn_wait(cw);
            wg_fence();
            ws_qk<D, BC>(s, q_addr, 64 * cw, kv_addr + 2 * (it % WS_STAGES) * KV_BYTES);
            wg_commit();
            ws_turn_pass(cw);
            wg_wait_all();
            wg_hold(s);
            if (n == 1) mbar_arrive_warp(q_empty);
            float corr[2];
            ws_softmax_tile<BC>(0 >= r.wg_full, s, m, l, corr, seq_kv, kvpos, pos, g.causal, sl2, tq);
            #pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) wg_acc_to_a(pa[kk], s, kk);
            for (int t = 1; t < n; t++) {
                int slot = (it + t) % WS_STAGES, prev = (it + t - 1) % WS_STAGES;
                mbar_wait(bars + 8 * slot, ((it + t) / WS_STAGES) & 1);
                ws_turn_wait(cw);
                wg_fence();
                ws_qk<D, BC>(s, q_addr, 64 * cw, kv_addr + 2 * slot * KV_BYTES);
                wg_commit();
                // O += P_{t-1} V_{t-1}, its own pipeline stage, multiplying while S_t's
                // softmax runs.
                unsigned v_prev = kv_addr + 2 * prev * KV_BYTES + KV_BYTES;
                wg_fence();
                #pragma unroll
                for (int kk = 0; kk < BC / 16; kk++) wg_mma_pv<D>(acc, pa[kk], wg_desc_mn<BC>(v_prev, kk), 1);
                wg_commit();
                ws_turn_pass(cw);
                asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                wg_hold(s);
                if (t == n - 1) mbar_arrive_warp(q_empty);  // this consumer's last read of Q
                int j0 = t * BC;
                ws_softmax_tile<BC>(t >= r.wg_full, s, m, l, corr, seq_kv - j0, kvpos + j0, pos, g.causal, sl2, tq);
                wg_wait_all();
                wg_hold(acc);
                ws_hold_u(pa);
                mbar_arrive_warp(bars + 8 * (WS_STAGES + prev));
                wg_scale_rows(acc, corr);
                #pragma unroll
                for (int kk = 0; kk < BC / 16; kk++) wg_acc_to_a(pa[kk], s, kk);
            }
            int slot = (it + n - 1) % WS_STAGES;
            ws_turn_wait(cw);
            wg_fence();
            #pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) wg_mma_pv<D>(acc, pa[kk], wg_desc_mn<BC>(kv_addr + 2 * slot * KV_BYTES + KV_BYTES, kk), 1);
            wg_commit();
            ws_turn_pass(cw);
            wg_wait_all();
            wg_hold(acc);
            ws_hold_u(pa);
            mbar_arrive_warp(bars + 8 * (WS_STAGES + slot));
        }
        // The CTA's tiles this consumer does not compute: wait for each, release it and pass
        // an empty turn, keeping the turns in step with the other consumer's.
        for (int t = n; t < tiles; t++) {
            int slot = (it + t) % WS_STAGES;
            mbar_wait(bars + 8 * slot, ((it + t) / WS_STAGES) & 1);
            mbar_arrive_warp(bars + 8 * (WS_STAGES + slot));
            ws_turn_wait(cw);
            ws_turn_pass(cw);
        }
        it += tiles;
        wg_store_o_lse<D>(acc, m, l, o, lse, g, bh, b, h, wg_row0, warp, gq, tq);
    }
    if (cw == 0) ws_turn_wait(cw);  // consumer 1's last arrival: no barrier left half-arrived
}

#define WS_FWD(NAME, D, BC, STAGES)                                                                      \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) NAME(                                   \
        const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,                           \
        const __grid_constant__ TmaMap tv, void* o, float* lse, int* work_counter, const int* qpos,     \
        const int* kvpos, AttGeom g) {                                                                  \
        ws_attention_fwd<D, BC, STAGES>(tq, tk, tv, o, lse, work_counter, qpos, kvpos, g);             \
    }
// 128-key tiles: 246 TFLOP/s at 32·12·1024·64 causal on one H200 against 211 with 64-key ones
// and 171 for the wgmma kernel (bench/RESULTS.md, session 7).
WS_FWD(attention_fwd_ws_d64, 64, 128, 4)

// Head dim 128: the kernel above with separate K and V rings, so K_t's slot is free once S_t is
// (FlashAttention-3's separate K and V pipelines) instead of a tile later with V_t's, and
// shared memory fits 3 K + 2 V slots where one ring of K and V fits 2. Measured on an H100
// (2026-12-06, bench/RESULTS.md): +9–45% over the shared ring at every head-dim-128 point of
// issue 19's grid (T 8192 GQA 4:1: 422 → 587 TFLOP/s), where the shared ring's consumers had
// waited on it with the tensor pipe 40% busy; at head dim 64 (4 + 4 slots against 4 shared)
// the separate rings lost up to 7% (−7 to +1%), so head dim 64 keeps the shared ring.
// A ring of STAGES tile slots (full barrier of slot s at full0 + 8 s, empty at empty0 + 8 s,
// tile at addr0 + s · TILE bytes); j counts the ring's tiles over all of a CTA's items, slot
// j % STAGES in round j / STAGES. Unsigned: the divisions by a stage count of 3 stay a multiply.
template <int STAGES, int TILE>
struct WsRing {
    unsigned full0, empty0, addr0;
    __device__ __forceinline__ unsigned addr(unsigned j) const { return addr0 + (j % STAGES) * TILE; }
    // Consumer: waits until tile j has landed.
    __device__ __forceinline__ void wait(unsigned j) const { mbar_wait(full0 + 8 * (j % STAGES), (j / STAGES) & 1); }
    // Consumer warp: done reading tile j.
    __device__ __forceinline__ void release(unsigned j) const { mbar_arrive_warp(empty0 + 8 * (j % STAGES)); }
    // Producer: waits for tile j's slot to be free (both consumers released tile j − STAGES)
    // and loads rows [r0, r0 + R) of map into it.
    template <int D, int R>
    __device__ __forceinline__ void fill(unsigned j, const TmaMap& map, int c0, int r0) const {
        unsigned s = j % STAGES, full = full0 + 8 * s;
        mbar_wait(empty0 + 8 * s, ((j / STAGES) & 1) ^ 1);
        mbar_expect_tx(full, TILE);
        ws_load_tile<D, R>(addr0 + s * TILE, map, full, c0, r0);
    }
};

// grid: min(work items, SMs); block: WS_THREADS; shared: 1024 (alignment) + two Q buffers
// (WS_BR rows) + K_STAGES slots of K and V_STAGES of V (BC rows each) + 2 (K_STAGES +
// V_STAGES) + 4 mbarriers + the two items' ranges. Q is double-buffered, so the producer loads
// the next item's Q (and K/V) while this one computes; it also computes the item's tile ranges
// (dependent loads of the positions) once and hands them over with Q, off the consumers' path.
// Head dim D (64 or 128): each tile is D / 64 column blocks of 128-byte rows, one TMA box each.
//
// Turns (consumer cw waits on barrier WS_TURN_BAR + cw, arrives on the other's), the invariant
// that keeps them deadlock-free: per item each consumer takes exactly tiles + 1 turns, its n
// (wg_tiles) + 1 with GEMMs (S_0; S_t with P_{t−1} V_{t−1} for t in [1, n); the last
// P_{n−1} V_{n−1}) and one empty turn (wait, pass) for each tile in [n, tiles) it does not
// compute, plus one more if n = 0. Every arrival then meets exactly one wait: consumer 1
// arrives once before its first turn (consumer 0 goes first) and consumer 0 waits once after
// its last item (taking consumer 1's last arrival), so both barriers are idle at exit, and
// turn k of consumer 1 falls between turns k and k + 1 of consumer 0.
//
// No cycle through the rings. Number an item's turns k = 0 .. tiles. Before turn k a consumer
// waits for at most K_k and V_{k−1} (turn k < n: K_k, V_{k−1}; turn n: V_{n−1}; the empty turn
// of a skipped tile t = k − 1: K_t, V_t, each released at once) and by then it has released
// every K_j, j < k, and V_j, j < k − 1, of the item (K_t right after S_t completes in turn t,
// V_t after P_t V_t in turn t + 1) and all of earlier items. The producer issues K_0, K_1, V_0,
// K_2, V_1, .., K_{tiles−1}, V_{tiles−2}, V_{tiles−1}, then the next item's Q (its buffer freed
// in the item before this one) and tiles, so the loads turn k needs (up to V_{k−1}, right
// after K_k) wait only for the slots of K_{j−K_STAGES}, j ≤ k, and V_{j−V_STAGES}, j ≤ k − 1:
// tiles < k and < k − 1, released by both consumers before turn k. So a consumer at the lower
// turn k (both, if equal) gets its data, and one of them its turn: consumer 0's turn k waits
// for consumer 1's turn k − 1, consumer 1's for consumer 0's turn k. One slot a ring would
// suffice; more let the producer run ahead. The epilogue (O, lse) is outside the turns.
template <int D, int BC, int K_STAGES, int V_STAGES>
__device__ __forceinline__ void ws_attention_fwd_kv(const TmaMap& tq_map, const TmaMap& tk_map, const TmaMap& tv_map, void* o, float* lse, int* work_counter, const int* qpos, const int* kvpos, const AttGeom& g) {
    constexpr int Q_BYTES = WG_TILE_BYTES(WS_BR, D), KV_BYTES = WG_TILE_BYTES(BC, D);
    constexpr int SLOTS = K_STAGES + V_STAGES;
    extern __shared__ __align__(16) unsigned char ws_smem_raw[];
    unsigned raw = tc_smem_addr(ws_smem_raw);
    unsigned char* smem = ws_smem_raw + ((1024 - (raw & 1023)) & 1023);
    unsigned q_addr0 = tc_smem_addr(smem);  // buffer u at q_addr0 + u Q_BYTES
    unsigned k_addr0 = q_addr0 + 2 * Q_BYTES, v_addr0 = k_addr0 + K_STAGES * KV_BYTES;
    unsigned bars = v_addr0 + V_STAGES * KV_BYTES;
    // One pipeline of SLOTS slots (ws_pipeline_init's layout: full[i] at bars + 8 i, empty[i]
    // at bars + 8 (SLOTS + i)): the K ring's first, the V ring's after them. Then q_full[u],
    // q_empty[u]; then per Q buffer the item's ranges: tiles, and wg_tiles, wg_full of each
    // consumer.
    const WsRing<K_STAGES, KV_BYTES> kr = {bars, bars + 8 * SLOTS, k_addr0};
    const WsRing<V_STAGES, KV_BYTES> vr = {bars + 8 * K_STAGES, bars + 8 * (SLOTS + K_STAGES), v_addr0};
    unsigned q_full0 = bars + 16 * SLOTS, q_empty0 = q_full0 + 16;
    int* ranges = reinterpret_cast<int*>(smem + (q_empty0 + 16 - q_addr0));  // 8 ints a buffer
    int bh_count = (int)(g.batch * g.heads);
    int q_tiles = ((int)g.seq_q + WS_BR - 1) / WS_BR;
    int work = q_tiles * bh_count;
    // The warpgroup, warp-uniform to the compiler (as CUTLASS's canonical_warp_group_idx).
    int wg = __shfl_sync(FULL_MASK, (int)threadIdx.x / WG_THREADS, 0);
    if (threadIdx.x == 0) ws_pipeline_init(bars, SLOTS, 8);  // 8: the consumers' warps
    __syncthreads();
    if (wg == 0) {
        regs_dealloc<24>();
        // One thread walks the items and issues every load.
        if (threadIdx.x != 0) return;
        tma_prefetch(tq_map);
        tma_prefetch(tk_map);
        tma_prefetch(tv_map);
        unsigned it = 0;
        int item = 0, tail = ws_claim_tail(work);
        for (int w = blockIdx.x;; item++) {
            int u = item & 1;
            unsigned q_full = q_full0 + 8 * u;
            int* rg = ranges + 8 * u;
            if (w >= work) {
                // No work left: a bare arrival hands the consumers item −1, their signal to stop.
                mbar_wait(q_empty0 + 8 * u, ((item >> 1) & 1) ^ 1);
                rg[5] = -1;
                mbar_arrive(q_full);
                break;
            }
            int c = ws_claimed_item(w, q_tiles, bh_count, tail);
            WsItem wi = ws_item(c, q_tiles);
            int bh = wi.bh, i0 = wi.i0;
            int b = bh / (int)g.heads, h = bh % (int)g.heads;
            int kvh = h / (int)(g.heads / g.kv_heads);
            // The CTA's key tiles are those of its later consumer (rows i0 + 64 ..), which
            // sees every key the earlier one does.
            WsRange r0 = ws_range<BC>(qpos, kvpos, g, i0, i0);
            WsRange r1 = ws_range<BC>(qpos, kvpos, g, i0, i0 + 64);
            int tiles = r1.tiles;
            mbar_wait(q_empty0 + 8 * u, ((item >> 1) & 1) ^ 1);
            rg[0] = tiles;
            rg[1] = r0.wg_tiles;
            rg[2] = r0.wg_full;
            rg[3] = r1.wg_tiles;
            rg[4] = r1.wg_full;
            rg[5] = c;
            mbar_expect_tx(q_full, Q_BYTES);  // releases the ranges and the item with it
            ws_load_tile<D, WS_BR>(q_addr0 + u * Q_BYTES, tq_map, q_full, b * g.ld_q + h * D, i0);
            int kc = b * g.ld_kv + kvh * D;
            // In the consumers' order: K_t, then V_{t−1} (needed with S_t's turn, after K_t).
            for (int t = 0; t <= tiles; t++) {
                if (t < tiles) kr.template fill<D, BC>(it + t, tk_map, kc, t * BC);
                if (t > 0) vr.template fill<D, BC>(it + t - 1, tv_map, kc, (t - 1) * BC);
            }
            it += tiles;
            w = ws_claim_next(work_counter);
        }
        ws_claims_done(work_counter);
        return;
    }
    regs_alloc<240>();
    int cw = wg - 1, warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    int gq = lane >> 2, tq = lane & 3;
    int seq_q = (int)g.seq_q, seq_kv = (int)g.seq_kv, last = seq_q - 1;
    float sl2 = g.scale * TC_LOG2E;
    if (cw == 1) ws_turn_pass(cw);  // consumer 0 takes the first turn (invariant above)
    unsigned it = 0;  // the item's first tile in both rings
    for (int item = 0;; item++) {
        int u = item & 1;
        unsigned q_addr = q_addr0 + u * Q_BYTES, q_empty = q_empty0 + 8 * u;
        mbar_wait(q_full0 + 8 * u, (item >> 1) & 1);
        const int* rg = ranges + 8 * u;
        // Read from shared memory through lane 0: uniform to the compiler, so the wgmma loops
        // they bound are not on a divergent path (which ptxas serializes, C7520).
        int c = __shfl_sync(FULL_MASK, rg[5], 0);
        if (c < 0) break;
        WsItem wi = ws_item(c, q_tiles);
        int bh = wi.bh, i0 = wi.i0;
        int b = bh / (int)g.heads, h = bh % (int)g.heads;
        int wg_row0 = i0 + 64 * cw;
        int pos[2];
        float m[2], l[2];
        #pragma unroll
        for (int half = 0; half < 2; half++) {
            int row = wg_row0 + 16 * warp + 8 * half + gq;
            pos[half] = qpos[row < last ? row : last];
            m[half] = NEG_INF;
            l[half] = 0.0f;
        }
        float acc[D / 2];
        #pragma unroll
        for (int i = 0; i < D / 2; i++) acc[i] = 0.0f;
        WsRange r;
        r.tiles = __shfl_sync(FULL_MASK, rg[0], 0);
        r.wg_tiles = __shfl_sync(FULL_MASK, rg[1 + 2 * cw], 0);
        r.wg_full = __shfl_sync(FULL_MASK, rg[2 + 2 * cw], 0);
        int tiles = r.tiles;
        int n = r.wg_tiles;
        float s[BC / 2];
        unsigned pa[BC / 16][4];
        if (n == 0) {
            mbar_arrive_warp(q_empty);
            ws_turn_wait(cw);  // the one extra empty turn (tiles + 1 in all)
            ws_turn_pass(cw);
        } else {
            // Tile 0: S_0 alone (O is still zero).
            kr.wait(it);
            ws_turn_wait(cw);
            wg_fence();
            ws_qk<D, BC>(s, q_addr, 64 * cw, kr.addr(it));
            wg_commit();
            ws_turn_pass(cw);
            wg_wait_all();
            wg_hold(s);
            kr.release(it);
            if (n == 1) mbar_arrive_warp(q_empty);
            float corr[2];
            ws_softmax_tile<BC>(0 >= r.wg_full, s, m, l, corr, seq_kv, kvpos, pos, g.causal, sl2, tq);
            #pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) wg_acc_to_a(pa[kk], s, kk);
            for (int t = 1; t < n; t++) {
                unsigned jk = it + t, jv = jk - 1;
                kr.wait(jk);
                vr.wait(jv);
                ws_turn_wait(cw);
                wg_fence();
                ws_qk<D, BC>(s, q_addr, 64 * cw, kr.addr(jk));
                wg_commit();
                // O += P_{t-1} V_{t-1}, its own pipeline stage, multiplying while S_t's
                // softmax runs.
                unsigned v_prev = vr.addr(jv);
                wg_fence();
                #pragma unroll
                for (int kk = 0; kk < BC / 16; kk++) wg_mma_pv<D>(acc, pa[kk], wg_desc_mn<BC>(v_prev, kk), 1);
                wg_commit();
                ws_turn_pass(cw);
                asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                wg_hold(s);
                kr.release(jk);  // S_t is complete: its K slot refills while P V multiplies
                if (t == n - 1) mbar_arrive_warp(q_empty);  // this consumer's last read of Q
                int j0 = t * BC;
                ws_softmax_tile<BC>(t >= r.wg_full, s, m, l, corr, seq_kv - j0, kvpos + j0, pos, g.causal, sl2, tq);
                wg_wait_all();
                wg_hold(acc);
                ws_hold_u(pa);
                vr.release(jv);
                wg_scale_rows(acc, corr);
                #pragma unroll
                for (int kk = 0; kk < BC / 16; kk++) wg_acc_to_a(pa[kk], s, kk);
            }
            unsigned jv = it + n - 1;
            vr.wait(jv);
            ws_turn_wait(cw);
            wg_fence();
            unsigned v_last = vr.addr(jv);
            #pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) wg_mma_pv<D>(acc, pa[kk], wg_desc_mn<BC>(v_last, kk), 1);
            wg_commit();
            ws_turn_pass(cw);
            wg_wait_all();
            wg_hold(acc);
            ws_hold_u(pa);
            vr.release(jv);
        }
        // The CTA's tiles this consumer does not compute: wait for each K and V, release them
        // and pass an empty turn, keeping the turns in step with the other consumer's.
        for (int t = n; t < tiles; t++) {
            kr.wait(it + t);
            kr.release(it + t);
            vr.wait(it + t);
            vr.release(it + t);
            ws_turn_wait(cw);
            ws_turn_pass(cw);
        }
        it += tiles;
        wg_store_o_lse<D>(acc, m, l, o, lse, g, bh, b, h, wg_row0, warp, gq, tq);
    }
    if (cw == 0) ws_turn_wait(cw);  // consumer 1's last arrival: no barrier left half-arrived
}

#define WS_FWD_KV(NAME, D, BC, K_STAGES, V_STAGES)                                                      \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) NAME(                                   \
        const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,                           \
        const __grid_constant__ TmaMap tv, void* o, float* lse, int* work_counter, const int* qpos,     \
        const int* kvpos, AttGeom g) {                                                                  \
        ws_attention_fwd_kv<D, BC, K_STAGES, V_STAGES>(tq, tk, tv, o, lse, work_counter, qpos, kvpos, g); \
    }
// FlashAttention-3's d128 forward tiles: 128 × 128 Q × K, two consumer warpgroups. Shared
// memory (attention.rs's WS_FWD_SMEM_D128): 1024 alignment slack + 2 Q buffers of 128 × 128
// bf16 (2 × 32 KiB) + 3 K and 2 V slots of 128 × 128 bf16 (32 KiB each) + 8 (2 · 5 + 4)
// mbarrier bytes + 64 range bytes = 230,576 bytes of the 232,448 (227 KiB) a block may opt in
// to. Registers a consumer thread (setmaxnreg 240): O 64 × 128 f32 (64), S_t 64 × 128 f32 (64)
// and P_{t−1} in bf16 A fragments (32) live together across the overlapped softmax, 160 plus
// addressing (d64's: 128); ptxas (13.0, sm_90a) assembles it without spills at a cap of 208,
// spills 8 bytes at 200.
WS_FWD_KV(attention_fwd_ws_d128, 128, 128, 3, 2)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
