// Flash-attention backward, warp-specialized (variant `ws` of op attention_bwd, the default on a
// Hopper; compute_90a, head_dim 64 and 128 (attention_bwd_ws_d64, _d128, and under GQA at 128
// attention_bwd_wsheads_d128; the budgets of each at wsb_attention_bwd); other GPUs, unaligned
// rows and `fa2` run attention_tc.cu's kernel):
// FlashAttention-3's backward structure, written for parc's layouts with the contract of
// tc_attention_bwd (after attention_delta_tc: lse2 and delta per query row, the f32 dQ
// accumulator zeroed; dK, dV f32 or bf16; causal masking by global position, whole invisible
// query tiles skipped when positions ascend).
//
// A persistent CTA (one an SM) of three warpgroups works through the items (key tile of WSB_BC
// keys, batch · kv head, or batch · query head: wsb_heads; in ws_claimed_item's order): item
// blockIdx.x first, then each the next not yet claimed (a global counter), so CTAs that drew
// short items (causal) take more. Warpgroup 0 is the producer: its first warp walks the items and
// one lane issues the TMA loads, 128-byte swizzled (attention_wgmma_fwd.cu's tile layout): the
// item's K and V once, then for each of its query tiles (the GQA group's heads in turn) Q, dO
// (BR rows each: 128 at head dim 64, 64 at 128) and their rows of lse2 and delta into a ring of
// slots. Warpgroups 1 and 2 each own 64 of the item's keys, keep their dK, dV in registers, and
// per query tile run
//   Sᵀ = K_w Qᵀ, dPᵀ = V_w dOᵀ                 (issued together; 64 keys × BR queries)
//   Pᵀ = exp2(Sᵀ scale log2 e − lse2)           while dPᵀ multiplies
//   dV += Pᵀ dO                                 (A = Pᵀ from registers)
//   dSᵀ = Pᵀ ∘ (dPᵀ − delta)                    while dV multiplies; dSᵀ to shared memory
//   dK += dSᵀ Q                                 (A = dSᵀ from registers)
// and, after a barrier of both consumers, dQ = dS K over all 128 keys from the shared dSᵀ
// tile, each consumer a 64 × 64 part of it (head dim 64: its 64 of the BR = 128 query rows;
// 128: its 64 of the 128 columns), issued before dK's product, which multiplies while the part
// (times scale) goes to shared memory; the part is added into the f32 accumulator with one TMA
// reduction per 32 columns (cp.reduce.async.bulk.tensor; no atomics issued by the threads):
// head dim 64 by the consumer's elected thread after a barrier of both (the dSᵀ tile free
// again), 128 by the consumer's dQ writer, a warp of the producer warpgroup (the next tile
// writing the other of two dSᵀ tiles). The slot is released once dK's product is done.
#ifdef __CUDA_ARCH_FEAT_SM90_ALL

#define WSB_BC 128
#define WSB_THREADS 384
// A consumer's dQ part: 64 query rows (one m64 wgmma's) × 64 columns, f32.
#define WSB_DQ_ROWS 64

// Query rows a ring slot holds for head dim D: head dim 64 takes 128, so each consumer's Sᵀ
// and dPᵀ are 64 keys × 128 queries (m64n128 wgmmas, half the per-tile waits and barriers a
// key); head dim 128 takes 64 (its consumers hold dK and dV, 64 × 128 each, in registers).
__device__ constexpr int wsb_br(int d) { return d == 64 ? 128 : 64; }
// Ring slots: 2 at both head dims (64: 128 query rows each; 128: 64 rows each, beside two dSᵀ
// tiles).
#define WSB_STAGES 2

// d (64 x 64, f32) (+)= A B, A and B from shared memory, both MN-major (dQ = dS K: A is dSᵀ
// stored [key][query], B is K stored [key][dim]; a consumer's dQ part is 64 columns at both
// head dims).
__device__ __forceinline__ void wsb_mma_ss_n64_mn(float (&d)[32], unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(accumulate));
}

// Sᵀ (or dPᵀ) (64 keys × BR queries, f32) (+)= one k step of K_w Qᵀ: both K-major in shared
// memory.
template <int BR>
__device__ __forceinline__ void wsb_mma_kq(float (&d)[BR / 2], unsigned long long a, unsigned long long b, int accumulate);
template <>
__device__ __forceinline__ void wsb_mma_kq<64>(float (&d)[32], unsigned long long a, unsigned long long b, int accumulate) {
    wg_mma_ss_n64(d, a, b, accumulate);
}
template <>
__device__ __forceinline__ void wsb_mma_kq<128>(float (&d)[64], unsigned long long a, unsigned long long b, int accumulate) {
    wg_mma_ss_n128(d, a, b, accumulate);
}

// Sᵀ = K_w Qᵀ (or dPᵀ = V_w dOᵀ: k_addr at V, q_addr at dO) for one query tile, this
// consumer's 64 keys from row 64 cw: issued as one group.
template <int D, int BR>
__device__ __forceinline__ void wsb_issue_kq(float (&d)[BR / 2], unsigned k_addr, unsigned q_addr, int cw) {
    wg_fence();
    #pragma unroll
    for (int kk = 0; kk < D / 16; kk++) wsb_mma_kq<BR>(d, wg_desc_k<WSB_BC>(k_addr, 64 * cw, kk), wg_desc_k<BR>(q_addr, 0, kk), kk > 0);
    wg_commit();
}

// dV (+)= Pᵀ dO, Pᵀ (64 keys × BR queries) from registers, dO (BR × D) from shared memory
// (MN-major): issued and committed as one group.
template <int D, int BR>
__device__ __forceinline__ void wsb_mma_dv(float (&dva)[D / 2], const unsigned (&pf)[BR / 16][4], unsigned do_addr) {
    wg_fence();
    #pragma unroll
    for (int kk = 0; kk < BR / 16; kk++) wg_mma_pv<D>(dva, pf[kk], wg_desc_mn<BR>(do_addr, kk), 1);
    wg_commit();
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
// Adds a part (shared memory at src: two swizzled 32-column blocks of WSB_DQ_ROWS rows, f32)
// into the f32 accumulator of `map` (dQ's, or under GQA at head dim 128 dK's or dV's) at column
// col, row i0, as one bulk group of this thread.
__device__ __forceinline__ void wsb_reduce_part(const TmaMap& map, unsigned src, int col, int i0) {
    tma_reduce_add_2d(map, src, col, i0);
    tma_reduce_add_2d(map, src + WSB_DQ_ROWS * 128, col + 32, i0);
    bulk_commit();
}
// A barrier of one warpgroup's 128 threads (named barrier id).
__device__ __forceinline__ void wg_bar(int id) { named_bar_sync<128>(id); }
// A barrier of both consumer warpgroups (256 threads; named barrier 3: the warpgroups' own are 1
// and 2).
__device__ __forceinline__ void consumers_bar() { named_bar_sync<256>(3); }
// The dQ writers' named barriers (a consumer warpgroup's 128 threads and its writer warp's 32:
// WSB_DQ_BAR_THREADS): consumer cw's part full at 4 + cw, free again at 6 + cw. The consumer
// arrives on full and waits on free; its writer waits on full and arrives on free.
#define WSB_DQ_FULL_BAR 4
#define WSB_DQ_FREE_BAR 6
#define WSB_DQ_BAR_THREADS 160

// Work item w: key tile w % k_tiles (its first key j0) of pair w / k_tiles (wsb_heads). Items
// are claimed in about this order (ws_claimed_item; wsb_attention_bwd: the first one an SM,
// then from a global counter as each CTA frees up), so each pair's first key tile (causal: the
// longest) comes first and the CTAs working at once share a few heads, whose dQ rows stay in
// L2 while they add into them. (Every pair's first key tile first, each CTA's items fixed by blockIdx.x as
// until 2026-12-06, spread the reductions over the whole f32 accumulator: 69% of DRAM's
// bandwidth at Llama 3.2 1B's shape, L2 hit rate 30%; fixed items in head order instead left
// the CTAs unbalanced under causal masking, GQA 4 and 6 slower.)
struct WsbItem {
    int bk, j0;
};

__device__ __forceinline__ WsbItem wsb_item(int w, int k_tiles) {
    WsbItem it;
    it.bk = w / k_tiles;
    it.j0 = (w % k_tiles) * WSB_BC;
    return it;
}

// The heads of one item's pair number bk: with items per kv head pair bk is (batch, kv head)
// and the item covers the kv head's whole group of query heads; with items per query head
// (PER_HEAD: head dim 128 under GQA) pair bk is (batch, query head), one head.
struct WsbHeads {
    int b, kvh, h0, count;
};

__device__ __forceinline__ WsbHeads wsb_heads(int bk, const AttGeom& g, int group, bool per_head) {
    WsbHeads hd;
    if (per_head) {
        hd.b = bk / (int)g.heads;
        hd.h0 = bk % (int)g.heads;
        hd.kvh = hd.h0 / group;
        hd.count = 1;
    } else {
        hd.b = bk / (int)g.kv_heads;
        hd.kvh = bk % (int)g.kv_heads;
        hd.h0 = hd.kvh * group;
        hd.count = group;
    }
    return hd;
}

// The query tiles (BR rows) of one item: the tiles [first, q_tiles) of each of the group's
// heads that some key of [j0, j0 + WSB_BC) is visible to, those before first_full masked. The
// producer computes them and hands them to the consumers in shared memory.
struct WsbRange {
    int first, first_full, per_head, total;
};

template <int BR>
__device__ __forceinline__ WsbRange wsb_range(const int* qpos, const int* kvpos, const AttGeom& g, int j0, int group) {
    int seq_q = (int)g.seq_q, seq_kv = (int)g.seq_kv;
    int jl = j0 + WSB_BC - 1 < seq_kv - 1 ? j0 + WSB_BC - 1 : seq_kv - 1;
    int first_kpos = kvpos[j0], last_kpos = kvpos[jl];
    bool whole = j0 + WSB_BC <= seq_kv;
    int q_tiles = (seq_q + BR - 1) / BR;
    WsbRange r;
    r.first = 0;
    r.first_full = whole ? 0 : q_tiles;
    if (g.causal && g.q_sorted && g.kv_sorted) {
        // Tiles whose last query is before the first key are invisible (a prefix); tiles whose
        // first query is before the last key need masking (a prefix).
        int lo = 0, hi = q_tiles;
        while (lo < hi) {
            int mid = (lo + hi) / 2, il = mid * BR + BR - 1 < seq_q - 1 ? mid * BR + BR - 1 : seq_q - 1;
            if (qpos[il] < first_kpos) lo = mid + 1; else hi = mid;
        }
        r.first = lo;
        if (whole) {
            lo = 0; hi = q_tiles;
            while (lo < hi) { int mid = (lo + hi) / 2; if (qpos[mid * BR] < last_kpos) lo = mid + 1; else hi = mid; }
            r.first_full = lo;
        }
    } else if (g.causal) {
        r.first_full = q_tiles;
    }
    r.per_head = q_tiles - r.first;
    r.total = group * r.per_head;
    return r;
}

// Byte offset of the f32 pair at (row r, column c, c even) of a dQ part in shared memory: two
// 128-byte-swizzled column blocks of 32 floats × WSB_DQ_ROWS rows (the reduction's tensor-map
// boxes). A half-warp's stores (rows gq 0..3, columns 2 tq4) meet rows gq and gq ^ 1 on the
// same banks: ncu counts 2.9 wavefronts a shared store request at head dim 128 (H100,
// 2026-12-06). Unswizzled blocks of 8 columns, free of the conflicts, made the reductions 8
// boxes of 32-byte rows: L2 throughput 62 → 75%, the backward 4–17% slower; permuting each
// lane's stores instead (conflict-free under this swizzle) gained nothing, −2 to 0%: the
// conflicted stores are not on the critical path (bench/RESULTS.md).
__device__ __forceinline__ int wsb_dq_off(int r, int c) {
    return (c >> 5) * (WSB_DQ_ROWS * 128) + r * 128 + (((((c & 31) >> 2) ^ (r & 7))) << 4) + (c & 3) * 4;
}

// Pᵀ = exp2(Sᵀ scale log2 e − lse2) in place; MASKED: zero where the key (position pa, pb for
// this thread's two key rows) is after the query. Element (nb, half, e) of s is key row half,
// query column nb 8 + 2 tq + e of the BR-row tile at i0. The masked instantiation loads the
// positions of 16 queries (of 4 nb) together before it uses any: all 32 of a 128-row tile at
// once would not fit beside Sᵀ, dPᵀ, dK and dV in 240 registers.
template <int BR, bool MASKED>
__device__ __forceinline__ void wsb_probs(float (&s)[BR / 2], const float* sl, const int* qpos, int i0, int last_q, int pa, int pb, float sl2, int tq) {
    constexpr int NB = 4;
    #pragma unroll
    for (int n0 = 0; n0 < BR / 8; n0 += NB) {
        int qp[2 * NB];
        if (MASKED) {
            #pragma unroll
            for (int nb = 0; nb < NB; nb++) {
                #pragma unroll
                for (int e = 0; e < 2; e++) {
                    int row = i0 + (n0 + nb) * 8 + 2 * tq + e;
                    qp[2 * nb + e] = __ldg(qpos + (row < last_q ? row : last_q));
                }
            }
        }
        #pragma unroll
        for (int nb = n0; nb < n0 + NB; nb++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                float l = sl[nb * 8 + 2 * tq + e];
                float xa = tc_exp2(__fmaf_rn(s[4 * nb + e], sl2, -l)), xb = tc_exp2(__fmaf_rn(s[4 * nb + 2 + e], sl2, -l));
                if (MASKED) {
                    if (pa > qp[2 * (nb - n0) + e]) xa = 0.0f;
                    if (pb > qp[2 * (nb - n0) + e]) xb = 0.0f;
                }
                s[4 * nb + e] = xa;
                s[4 * nb + 2 + e] = xb;
            }
        }
    }
}

// grid: min(items, SMs); block: WSB_THREADS; shared: 1024 (alignment) + KV_BUFS K, V buffers
// (WSB_BC rows) + WSB_STAGES slots (Q, dO: BR rows; lse2, delta) + DS_BUFS dSᵀ tiles (WSB_BC
// keys × BR queries, bf16) + a dQ part (64 × 64 f32) per consumer + 2 WSB_STAGES + 4 mbarriers
// + the ranges + the parts' places (6 ints).
//
// Head dim 64 (BR 128): K, V 16 KiB each, double-buffered, so the next item's load overlaps
// this one's last query tiles (64 KiB); 2 slots of 33 KiB; dSᵀ 32 KiB; dQ parts 2 × 16 KiB:
// 199,808 bytes (195.1 KiB). Registers a consumer thread (setmaxnreg 240): dK, dV (64), Sᵀ and
// dPᵀ (128), Pᵀ's bf16 fragments (32) live together while dPᵀ is turned into dSᵀ.
// Head dim 128 (BR 64): one K/V buffer (double: +64 KiB, too many) of 64 KiB; 2 slots of
// 33 KiB; two dSᵀ tiles of 16 KiB, tile it writing and reading dSᵀ tile it % 2
// (FlashAttention-3's causal head-dim-128 backward: 2 Q/dO stages, a double-buffered dS); dQ
// parts 2 × 16 KiB: 199,808 bytes. Registers: dK, dV (128), Sᵀ and dPᵀ (64), Pᵀ's and dSᵀ's
// bf16 fragments (16 + 16), dQ 64 × 64 (32): at most 192 live plus addressing. With two dSᵀ
// tiles a tile needs one barrier of both consumers, not two: my next write into a dSᵀ tile
// comes after the next tile's first barrier, which the other consumer reaches only once its dQ
// product over that tile (two tiles back) is done; only my own warpgroup's barrier stays, for
// my dQ part's reduction. Measured on an H100 (2026-12-06, bench/RESULTS.md): +1–3% at every
// head-dim-128 point of issue 19's grid over 3 slots and one dSᵀ tile (217,232 bytes, two
// barriers of both a tile), the default until then; issuing each tile's Sᵀ product from the
// tile before, ahead of its dQ part's store (variant `ws_pipe`), lost 8–14%.
// (Each consumer computing dQ over its own 64 keys for every query and column, never waiting
// for the other, was the head-dim-64 kernel until 2026-12-06, with 64-row slots, and the
// variant `ws_split` at 128: slower, bench/RESULTS.md.)
template <int D, bool PER_HEAD>
__device__ __forceinline__ void wsb_attention_bwd(const TmaMap& tq, const TmaMap& tdo, const TmaMap& tk, const TmaMap& tv, const TmaMap& tlse, const TmaMap& tdelta, const TmaMap& tdq, const TmaMap& tdk_acc, const TmaMap& tdv_acc, void* dk, void* dv, int* work_counter, const int* qpos, const int* kvpos, const AttGeom& g) {
    constexpr int BC = WSB_BC, BR = wsb_br(D), STAGES = WSB_STAGES;
    constexpr int KV_BUFS = D == 64 ? 2 : 1, DS_BUFS = D == 128 ? 2 : 1;
    // How the consumers split dQ = dS K (64 × 64 each): by query rows (head dim 64: BR = 128
    // rows, 64 columns) or by columns (128: 64 rows, 128 columns).
    constexpr bool DQ_BY_ROWS = BR == 128;
    // Who adds a consumer's dQ part into the accumulator: its writer warp in the producer
    // warpgroup (head dim 128, two dSᵀ tiles: FlashAttention-3's dQ writer), or the consumer's
    // elected thread after a barrier (head dim 64, whose one dSᵀ tile needs a barrier of both
    // consumers there anyway). Measured on an H100 (2026-12-06, bench/RESULTS.md): the writers
    // gained 1–7% at every head-dim-128 point of issue 19's grid and lost 1–2% at head dim 64.
    constexpr bool DQ_WRITER = DS_BUFS == 2;
    // Items per query head add their dK and dV through the writers too (below).
    static_assert(!PER_HEAD || DQ_WRITER, "items per query head run at head dim 128");
    static_assert(DQ_BY_ROWS ? D == 64 : (BR == 64 && D == 128), "a consumer's dQ part is 64 × 64");
    constexpr int KT = BC * D * 2, QT = BR * D * 2, DST = BC * BR * 2, DQT = WSB_DQ_ROWS * 64 * 4;
    // One ring slot: Q and dO tiles, then lse2 and delta rows (f32, BR each), padded so the next
    // slot's tiles stay 1024-byte aligned.
    constexpr int SLOT = 2 * QT + 1024;
    static_assert(2 * BR * 4 <= 1024, "lse2 and delta fit a slot's 1 KiB");
    extern __shared__ __align__(16) unsigned char wsb_smem_raw[];
    unsigned raw = tc_smem_addr(wsb_smem_raw);
    int align = (1024 - (raw & 1023)) & 1023;
    unsigned char* smem = wsb_smem_raw + align;
    unsigned base = raw + align;
    // KV_BUFS K/V buffers (d64: item parity): K of buffer u at base + 2 u KT, V after it.
    unsigned slots = base + 2 * KV_BUFS * KT;       // slot s at slots + s SLOT
    unsigned ds_addr0 = slots + STAGES * SLOT;      // dSᵀ tile i at + i DST: WSB_BC key rows, BR / 64 column blocks
    unsigned dq_addr0 = ds_addr0 + DS_BUFS * DST;   // consumer c's dQ part at + c DQT
    unsigned bars = dq_addr0 + 2 * DQT;
    // full[s] at bars + 8 s, empty[s] at bars + 8 (STAGES + s), then kv_full[u],
    // kv_empty[u]; then per K/V buffer the item's query ranges (WsbRange, 8 ints a buffer).
    unsigned kv_full0 = bars + 16 * STAGES, kv_empty0 = kv_full0 + 16;
    int* ranges = reinterpret_cast<int*>(smem + (kv_empty0 + 16 - base));
    // Consumer cw's part's place, for its writer: dq_at[3 cw] the accumulator (0 dQ's, 1 dK's,
    // 2 dV's; −1: no more parts), dq_at[3 cw + 1] its column, dq_at[3 cw + 2] its row.
    int* dq_at = ranges + 16;
    // Items per query head (PER_HEAD: dK, dV added into f32 accumulators), else per kv head
    // (wsb_heads).
    constexpr bool per_head = PER_HEAD;
    int group = (int)(g.heads / g.kv_heads);
    int pairs = (int)(g.batch * (per_head ? g.heads : g.kv_heads));
    int k_tiles = ((int)g.seq_kv + BC - 1) / BC;
    int work = k_tiles * pairs;
    int wg = __shfl_sync(FULL_MASK, (int)threadIdx.x / WG_THREADS, 0);
    if (threadIdx.x == 0) ws_pipeline_init(bars, STAGES, 8);  // 8: the consumers' warps
    __syncthreads();
    if (wg == 0) {
        // The producer: one thread walks the items and issues every load. d64's K/V are
        // double-buffered, so the next item's load overlaps this one's last query tiles, and
        // its ranges (dependent loads of the positions) travel with it, off the consumers' path.
        regs_dealloc<24>();
        int pw = (int)threadIdx.x / 32;
        if (DQ_WRITER && (pw == 1 || pw == 2)) {
            // Consumer (pw − 1)'s dQ writer (FlashAttention-3's): adds each part into the f32
            // accumulator once the consumer has stored it, and frees the part when the
            // reduction has read it, so the consumers neither issue nor wait for reductions.
            int cw = pw - 1;
            unsigned part = dq_addr0 + cw * DQT;
            named_bar_arrive<WSB_DQ_BAR_THREADS>(WSB_DQ_FREE_BAR + cw);
            for (;;) {
                named_bar_sync<WSB_DQ_BAR_THREADS>(WSB_DQ_FULL_BAR + cw);
                int acc = dq_at[3 * cw], col = dq_at[3 * cw + 1], row = dq_at[3 * cw + 2];
                if (acc < 0) break;
                if ((threadIdx.x & 31) == 0) {
                    wsb_reduce_part(acc == 0 ? tdq : acc == 1 ? tdk_acc : tdv_acc, part, col, row);
                    bulk_wait_read<0>();
                }
                __syncwarp();
                named_bar_arrive<WSB_DQ_BAR_THREADS>(WSB_DQ_FREE_BAR + cw);
            }
            // Every reduction done (they read shared memory until they complete: the CTA
            // must outlive them).
            if ((threadIdx.x & 31) == 0) bulk_wait_all();
            return;
        }
        if (threadIdx.x != 0) return;
        tma_prefetch(tq);
        tma_prefetch(tdo);
        tma_prefetch(tk);
        tma_prefetch(tv);
        int it = 0, item = 0, tail = ws_claim_tail(work);
        for (int w = blockIdx.x;; item++) {
            // The item's K/V buffer and the phase of its barriers (one buffer: every item's).
            int u = KV_BUFS == 2 ? item & 1 : 0;
            unsigned kv_full = kv_full0 + 8 * u, k_addr = base + 2 * u * KT;
            mbar_wait(kv_empty0 + 8 * u, (KV_BUFS == 2 ? (item >> 1) & 1 : item & 1) ^ 1);
            int* rg = ranges + 8 * u;
            if (w >= work) {
                // No work left: a bare arrival hands the consumers w = −1, their signal to stop.
                rg[4] = -1;
                mbar_arrive(kv_full);
                break;
            }
            // The claim's item in pair-major numbering.
            int c = ws_claimed_item(w, k_tiles, pairs, tail);
            WsbItem wi = wsb_item(c, k_tiles);
            WsbHeads hd = wsb_heads(wi.bk, g, group, per_head);
            int b = hd.b, kvh = hd.kvh, j0 = wi.j0;
            WsbRange r = wsb_range<BR>(qpos, kvpos, g, j0, hd.count);
            rg[0] = r.first;
            rg[1] = r.first_full;
            rg[2] = r.per_head;
            rg[3] = r.total;
            rg[4] = c;
            mbar_expect_tx(kv_full, 2 * KT);  // releases the ranges with it
            ws_load_tile<D, BC>(k_addr, tk, kv_full, b * g.ld_kv + kvh * D, j0);
            ws_load_tile<D, BC>(k_addr + KT, tv, kv_full, b * g.ld_kv + kvh * D, j0);
            for (int t = 0; t < r.total; t++, it++) {
                int h = (per_head ? hd.h0 : kvh * group + t / r.per_head), i0 = (r.first + t % r.per_head) * BR;
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
            // The next item, claimed once this one's loads are all issued (the CTA frees up a
            // ring's depth of tiles later).
            w = ws_claim_next(work_counter);
        }
        ws_claims_done(work_counter);
        return;
    }
    regs_alloc<240>();
    int cw = wg - 1, warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    int gq = lane >> 2, tq4 = lane & 3;
    bool elected = (threadIdx.x & 127) == 0;
    int seq_q = (int)g.seq_q, seq_kv = (int)g.seq_kv, last_q = seq_q - 1;
    unsigned char* sds = smem + (ds_addr0 - base);
    // This consumer's 64 key rows of the dSᵀ tile (also, between items, its staging tile for
    // bf16 dK, dV rows: rows 64 cw .. of the first column block, which only it writes).
    int ds_row0 = 64 * cw;
    unsigned dq_addr = dq_addr0 + cw * DQT;
    unsigned char* sdq = smem + (dq_addr - base);
    // dQ = dS K: this consumer's A (dS's query rows: a column block of dSᵀ) and B (K's columns).
    unsigned dq_a = ds_addr0 + (DQ_BY_ROWS ? cw * BC * 128 : 0);
    float sl2 = g.scale * TC_LOG2E;
    bool dk_bf16 = g.bf16 & ATT_BF16_DK, dv_bf16 = g.bf16 & ATT_BF16_DV;
    // bf16 dK and dV on 16-byte aligned rows go out a row at a time (epilogue below).
    bool vec_out = dk_bf16 && dv_bf16 && g.ld_dkv % 8 == 0 && ((reinterpret_cast<unsigned long long>(dk) | reinterpret_cast<unsigned long long>(dv)) & 15) == 0;
    int it = 0;
    for (int item = 0;; item++) {
        int u = KV_BUFS == 2 ? item & 1 : 0;
        unsigned k_addr = base + 2 * u * KT, v_addr = k_addr + KT;
        unsigned dq_b = k_addr + (DQ_BY_ROWS ? 0 : cw * BC * 128);
        mbar_wait(kv_full0 + 8 * u, KV_BUFS == 2 ? (item >> 1) & 1 : item & 1);
        const int* rg = ranges + 8 * u;
        int w = __shfl_sync(FULL_MASK, rg[4], 0);
        if (w < 0) break;
        WsbItem wi = wsb_item(w, k_tiles);
        WsbHeads hd = wsb_heads(wi.bk, g, group, per_head);
        int b = hd.b, kvh = hd.kvh, j0 = wi.j0;
        // This thread's key rows: 64 cw + 16 warp + gq and + 8 of the item.
        int ka = j0 + 64 * cw + 16 * warp + gq, kb = ka + 8;
        int pa = ka < seq_kv ? (g.causal ? kvpos[ka] : TC_INT_MIN) : TC_INT_MAX;
        int pb = kb < seq_kv ? (g.causal ? kvpos[kb] : TC_INT_MIN) : TC_INT_MAX;
        float dka[D / 2], dva[D / 2];
        #pragma unroll
        for (int i = 0; i < D / 2; i++) { dka[i] = 0.0f; dva[i] = 0.0f; }
        // Read through lane 0: uniform to the compiler (the wgmma loop they bound is then not on
        // a divergent path, which ptxas serializes: C7520).
        WsbRange r;
        r.first = __shfl_sync(FULL_MASK, rg[0], 0);
        r.first_full = __shfl_sync(FULL_MASK, rg[1], 0);
        r.per_head = __shfl_sync(FULL_MASK, rg[2], 0);
        r.total = __shfl_sync(FULL_MASK, rg[3], 0);
        for (int t = 0; t < r.total; t++, it++) {
            int h = (per_head ? hd.h0 : kvh * group + t / r.per_head), tile = r.first + t % r.per_head, i0 = tile * BR;
            int s = it % STAGES;
            unsigned slot = slots + s * SLOT, q_addr = slot, do_addr = slot + QT;
            // This tile's dSᵀ tile (head dim 128: alternating), as bytes from sds and from ds_addr0.
            int ds_off = DS_BUFS == 2 ? (it & 1) * DST : 0;
            const float* sl = reinterpret_cast<const float*>(smem + (slot - base) + 2 * QT);
            const float* sd = sl + BR;
            bool masked = tile < r.first_full;
            mbar_wait(bars + 8 * s, (it / STAGES) & 1);
            float sa[BR / 2], dp[BR / 2], dq[32];
            wsb_issue_kq<D, BR>(sa, k_addr, q_addr, cw);
            wsb_issue_kq<D, BR>(dp, v_addr, do_addr, cw);
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            wg_hold(sa);
            // Pᵀ: element (nb, half, e) is key row 16 warp + 8 half + gq, query column
            // nb 8 + 2 tq + e.
            if (masked) wsb_probs<BR, true>(sa, sl, qpos, i0, last_q, pa, pb, sl2, tq4);
            else wsb_probs<BR, false>(sa, sl, qpos, i0, last_q, pa, pb, sl2, tq4);
            // dV += Pᵀ dO and dSᵀ = Pᵀ ∘ (dPᵀ − delta), Pᵀ and dSᵀ as bf16 A fragments. With
            // 64-row tiles dV's product is issued first, so it multiplies during the dSᵀ
            // arithmetic; with 128-row tiles (head dim 64) after it, once Sᵀ's and dPᵀ's f32
            // registers are free: Sᵀ, dPᵀ and Pᵀ live at once do not fit 240 registers there
            // (ptxas serializes the wgmmas).
            constexpr bool DV_FIRST = BR == 64;
            unsigned pf[BR / 16][4], dsf[BR / 16][4];
            #pragma unroll
            for (int kk = 0; kk < BR / 16; kk++) wg_acc_to_a(pf[kk], sa, kk);
            if constexpr (DV_FIRST) wsb_mma_dv<D, BR>(dva, pf, do_addr);
            asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(DV_FIRST ? 1 : 0) : "memory");
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
            for (int kk = 0; kk < BR / 16; kk++) wg_acc_to_a(dsf[kk], dp, kk);
            if constexpr (!DV_FIRST) wsb_mma_dv<D, BR>(dva, pf, do_addr);
            // This consumer's 64 key rows of dSᵀ (× the tile's BR queries) for dQ's A operand.
            #pragma unroll
            for (int kk = 0; kk < BR / 16; kk++) {
                int rr = ds_row0 + warp * 16 + gq, c = kk * 16 + 2 * tq4;
                unsigned char* sdt = sds + ds_off;
                *reinterpret_cast<unsigned*>(sdt + wg_chunk<BC>(rr, c >> 3) + (c & 7) * 2) = dsf[kk][0];
                *reinterpret_cast<unsigned*>(sdt + wg_chunk<BC>(rr + 8, c >> 3) + (c & 7) * 2) = dsf[kk][1];
                *reinterpret_cast<unsigned*>(sdt + wg_chunk<BC>(rr, (c + 8) >> 3) + (c & 7) * 2) = dsf[kk][2];
                *reinterpret_cast<unsigned*>(sdt + wg_chunk<BC>(rr + 8, (c + 8) >> 3) + (c & 7) * 2) = dsf[kk][3];
            }
            // Both consumers' dSᵀ rows written (and, through the proxy fence, visible to the
            // async proxy) before either's dQ reads them. Without a writer, this consumer's dQ
            // part, written after the barrier, was last read by the reduction its elected thread
            // issued at the previous tile: that thread waits for it first.
            if (!DQ_WRITER && elected) bulk_wait_read<0>();
            wg_fence_proxy();
            consumers_bar();
            // dQ's product first, then dK's: dK multiplies while dQ's part goes to shared memory
            // and its reduction is issued (wgmma groups complete in order).
            wg_fence();
            #pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) wsb_mma_ss_n64_mn(dq, wg_desc_mn<BC>(dq_a + ds_off, kk), wg_desc_mn<BC>(dq_b, kk), kk > 0);
            wg_commit();
            wg_fence();
            #pragma unroll
            for (int kk = 0; kk < BR / 16; kk++) wg_mma_pv<D>(dka, dsf[kk], wg_desc_mn<BR>(q_addr, kk), 1);
            wg_commit();
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            wg_hold(dva);
            wg_hold(dq);
            // dQ · scale into this consumer's part (free once the last reduction has read it),
            // added into the accumulator's 64 rows of head (b, h) at its first column: one
            // reduction per 32-column block.
            if (DQ_WRITER) named_bar_sync<WSB_DQ_BAR_THREADS>(WSB_DQ_FREE_BAR + cw);
            #pragma unroll
            for (int nb = 0; nb < 8; nb++) {
                int rr = warp * 16 + gq, c = nb * 8 + 2 * tq4;
                *reinterpret_cast<float2*>(sdq + wsb_dq_off(rr, c)) = make_float2(g.scale * dq[4 * nb], g.scale * dq[4 * nb + 1]);
                *reinterpret_cast<float2*>(sdq + wsb_dq_off(rr + 8, c)) = make_float2(g.scale * dq[4 * nb + 2], g.scale * dq[4 * nb + 3]);
            }
            int dq_col = (b * (int)g.heads + h) * D + (DQ_BY_ROWS ? 0 : 64 * cw), dq_row = i0 + (DQ_BY_ROWS ? 64 * cw : 0);
            // The part visible to the async proxy (the fence), then: with a writer, its place to
            // the writer; without, the barrier of both (which also frees the one dSᵀ tile, both
            // dQ products being done, for the next tile's writes) and the elected thread's
            // reduction.
            wg_fence_proxy();
            if constexpr (DQ_WRITER) {
                if (elected) {
                    dq_at[3 * cw] = 0;
                    dq_at[3 * cw + 1] = dq_col;
                    dq_at[3 * cw + 2] = dq_row;
                }
                named_bar_arrive<WSB_DQ_BAR_THREADS>(WSB_DQ_FULL_BAR + cw);
            } else {
                consumers_bar();
                if (elected) wsb_reduce_part(tdq, dq_addr, dq_col, dq_row);
            }
            // dK's product done: the slot's Q and the dSᵀ fragments it reads are free.
            wg_wait_all();
            wg_hold(dka);
            ws_hold_u(pf);
            ws_hold_u(dsf);
            mbar_arrive_warp(bars + 8 * (STAGES + s));
        }
        mbar_arrive_warp(kv_empty0 + 8 * u);
        int dkv_stride = (int)g.batch * g.ld_dkv, head = b * g.ld_dkv + kvh * D + 2 * tq4;
        if (per_head) {
            // One query head's share: dK · scale and dV added into the f32 accumulators
            // (compact rows of batch · kv_heads · D a key; tdk_acc, tdv_acc), which
            // attention_dkv_out rounds into dk, dv after the kernel: 64 × 64 parts through this
            // consumer's dQ part and its writer's TMA reductions, as dQ's (rows past seq_kv
            // dropped by the maps). Until 2026-12-06 each thread added its pairs with
            // red.global.add.v2.f32, 64 a thread an item.
            int acc_col = (b * (int)g.kv_heads + kvh) * D;
            #pragma unroll
            for (int which = 0; which < 2; which++) {
                #pragma unroll
                for (int half = 0; half < D / 64; half++) {
                    const float* a = which == 0 ? dka : dva;
                    float sc = which == 0 ? g.scale : 1.0f;
                    named_bar_sync<WSB_DQ_BAR_THREADS>(WSB_DQ_FREE_BAR + cw);
                    #pragma unroll
                    for (int nb = 0; nb < 8; nb++) {
                        int rr = warp * 16 + gq, c = nb * 8 + 2 * tq4, ab = 4 * (8 * half + nb);
                        *reinterpret_cast<float2*>(sdq + wsb_dq_off(rr, c)) = make_float2(sc * a[ab], sc * a[ab + 1]);
                        *reinterpret_cast<float2*>(sdq + wsb_dq_off(rr + 8, c)) = make_float2(sc * a[ab + 2], sc * a[ab + 3]);
                    }
                    if (elected) {
                        dq_at[3 * cw] = 1 + which;
                        dq_at[3 * cw + 1] = acc_col + 64 * half;
                        dq_at[3 * cw + 2] = j0 + 64 * cw;
                    }
                    wg_fence_proxy();
                    named_bar_arrive<WSB_DQ_BAR_THREADS>(WSB_DQ_FULL_BAR + cw);
                }
            }
        } else if (vec_out) {
            // bf16 dK, dV through this consumer's rows of the dSᵀ tile (free: its last readers,
            // the last dQ products, are done; two dSᵀ tiles: the one the last tile did not use, whose
            // readers, two tiles back, finished before the last tile's first barrier) as a
            // 64 × 64 tile: 16-byte rows out instead of 4-byte pairs, 64 columns at a time.
            unsigned char* stage = sds + (DS_BUFS == 2 ? (it & 1) * DST : 0) + ds_row0 * 128;
            #pragma unroll
            for (int which = 0; which < 2; which++) {
                #pragma unroll
                for (int half = 0; half < D / 64; half++) {
                    const float* a = which == 0 ? dka : dva;
                    float sc = which == 0 ? g.scale : 1.0f;
                    #pragma unroll
                    for (int nb = 0; nb < 8; nb++) {
                        int rr = warp * 16 + gq, off = (2 * tq4) * 2, ab = 4 * (8 * half + nb);
                        *reinterpret_cast<unsigned*>(stage + wg_chunk<64>(rr, nb) + off) = tc_pack(sc * a[ab], sc * a[ab + 1]);
                        *reinterpret_cast<unsigned*>(stage + wg_chunk<64>(rr + 8, nb) + off) = tc_pack(sc * a[ab + 2], sc * a[ab + 3]);
                    }
                    wg_bar(1 + cw);
                    bf16_t* out = static_cast<bf16_t*>(which == 0 ? dk : dv);
                    #pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int idx = i * WG_THREADS + (threadIdx.x & 127), rr = idx >> 3, j = idx & 7;
                        int key = j0 + 64 * cw + rr;
                        uint4 v = *reinterpret_cast<const uint4*>(stage + wg_chunk<64>(rr, j));
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
        if (!per_head && !vec_out && kb < seq_kv) {
            long long row = (long long)kb * dkv_stride + head;
            #pragma unroll
            for (int nb = 0; nb < D / 8; nb++) {
                tc_store2(dk, row + nb * 8, g.scale * dka[4 * nb + 2], g.scale * dka[4 * nb + 3], dk_bf16);
                tc_store2(dv, row + nb * 8, dva[4 * nb + 2], dva[4 * nb + 3], dv_bf16);
            }
        }
    }
    if constexpr (DQ_WRITER) {
        // No more parts: the writer stops.
        named_bar_sync<WSB_DQ_BAR_THREADS>(WSB_DQ_FREE_BAR + cw);
        if (elected) dq_at[3 * cw] = -1;
        named_bar_arrive<WSB_DQ_BAR_THREADS>(WSB_DQ_FULL_BAR + cw);
    } else if (elected) {
        // Every reduction done (they read shared memory until they complete: the CTA must
        // outlive them).
        bulk_wait_all();
    }
}

#define WSB_BWD(NAME, D, PER_HEAD)                                                                                   \
    extern "C" __global__ void __launch_bounds__(WSB_THREADS, 1) NAME(                                              \
        const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tdo, const __grid_constant__ TmaMap tk,   \
        const __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap tlse,                                     \
        const __grid_constant__ TmaMap tdelta, const __grid_constant__ TmaMap tdq,                                  \
        const __grid_constant__ TmaMap tdk_acc, const __grid_constant__ TmaMap tdv_acc, void* dk, void* dv,         \
        int* work_counter, const int* qpos, const int* kvpos, AttGeom g) {                                          \
        wsb_attention_bwd<D, PER_HEAD>(tq, tdo, tk, tv, tlse, tdelta, tdq, tdk_acc, tdv_acc, dk, dv, work_counter, qpos, kvpos, g); \
    }
WSB_BWD(attention_bwd_ws_d64, 64, false)
WSB_BWD(attention_bwd_ws_d128, 128, false)
// Head dim 128 under GQA: an item per query head, dK and dV added into f32 accumulators
// (FlashAttention-3's GQA backward). An item per kv head covers its group's heads, so at GQA
// 6:1 and T 8192 one item is as long as a CTA's even share of the work and the CTAs that draw
// the longest finish last in any claim order. Measured on an H100 (2026-12-06, bench/
// RESULTS.md; items per query head without the sorted tail): at head dim 128, GQA 4:1 and 6:1,
// 0–35% over items per kv head (T 8192 GQA 6:1: 327 → 435 TFLOP/s) and 7–24% over the sorted
// tail alone; at head dim 64 the sorted tail alone won by 7–12%, so head dim 64 keeps items
// per kv head.
WSB_BWD(attention_bwd_wsheads_d128, 128, true)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
