// Flash-attention backward on Hopper's warpgroup MMA (`wgmma`, compute_90a only: everything
// here sits under __CUDA_ARCH_FEAT_SM90_ALL and the host runs `fa2` on other GPUs), for bf16
// runs with head_dim 64: attention_bwd_wgmma_d64, variant `wgmma` of op attention_bwd, the
// default on a Hopper. Same contract as attention_tc.cu's tc_attention_bwd (whose helpers it uses: tc_cp16, tc_count, tc_red2, …):
// after attention_delta_tc, a CTA takes WB_BC keys of one (batch, kv head), loops over the GQA
// group's query heads and their query tiles of WB_BR rows (two cp.async stages), keeps dK / dV
// in registers, writes them (f32 or bf16, AttGeom::bf16) and adds dQ into the zeroed f32
// accumulator with vector atomics; causal masking by global position exactly as there.
//
// Why it is faster: mma.sync makes each warp pull its B fragments through registers with
// ldmatrix (each warp re-reads the whole Q and dO tile); wgmma reads shared memory once per
// warpgroup of 64 keys, and its accumulators stay in registers for the exp / dS work.
// Two warpgroups, warpgroup w owning keys [64 w, 64 w + 64) of the CTA. Per query tile:
//   S^T  = K_w Q^T     m64n64k16 x4, A (K) and B (Q) K-major in shared memory
//   dP^T = V_w dO^T    likewise
//   P^T, dS^T          in the accumulators' registers (fp32), as tc_attention_bwd
//   dV  += P^T dO      A from registers (bf16), B (dO) MN-major in shared memory
//   dK  += dS^T Q      likewise
//   dS^T -> shared memory (bf16), then dQ = dS K: warpgroup w takes head-dim columns
//   [32 w, 32 w + 32), m64n32k16 x8, A (dS^T) and B (K) both MN-major; f32 atomics.
// Each product is its own wgmma group, so exp(S^T) overlaps dP^T's multiply and dS^T's
// arithmetic overlaps dV's; and the loop is software-pipelined across query tiles so that the
// tensor cores stay busy through the dQ step (at the kernel below; measured on one H200 at
// 166 TFLOP/s against 163 for the same kernel unpipelined, 32 x 12 heads x 1024 x 64, causal).
// Shared-memory tiles are in wgmma's no-swizzle ("interleaved") layout: 8 x 8 core matrices of
// 16-byte rows, 128 contiguous bytes each; a tile of 64 columns keeps its core matrix (row
// group rg, column group cg) at byte (8 rg + cg) * 128 (wb_off). So one tile serves as a K-major
// operand (rows = M/N) and as an MN-major one (rows = K) through the descriptor alone: the
// leading byte offset (LBO) steps between core matrices along K, the stride byte offset (SBO)
// along M/N, 128 for the column direction and 1024 for the row direction.
// attention_wgmma_selftest checks these layouts and the accumulator -> A-register mapping with
// exact small-integer products (tests/cuda_ops/attention.rs names a failing mode precisely).
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
#define WB_BC 128
#define WB_BR 64
#define WB_THREADS 256

// Byte offset of element (r, c) in a 64-column tile of the interleaved layout above.
__device__ __forceinline__ int wb_off(int r, int c) {
    return (((r >> 3) * 8 + (c >> 3)) << 7) + ((r & 7) << 4) + ((c & 7) << 1);
}

// A shared-memory matrix descriptor, no swizzle: start address, LBO, SBO (bytes, all /16).
__device__ __forceinline__ unsigned long long wb_desc(const void* p, unsigned lbo, unsigned sbo) {
    unsigned a = tc_smem_addr(p);
    return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) | ((unsigned long long)(sbo >> 4) << 32);
}

// A tile as K-major operand (rows are M or N, columns K) and as MN-major one (rows K).
__device__ __forceinline__ unsigned long long wb_kmajor(const void* p) { return wb_desc(p, 128, 1024); }
__device__ __forceinline__ unsigned long long wb_mnmajor(const void* p) { return wb_desc(p, 1024, 128); }

__device__ __forceinline__ void wb_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wb_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wb_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Waits for all but the latest committed group.
__device__ __forceinline__ void wb_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
// Ordinary shared-memory writes (st, cp.async) become visible to wgmma (the async proxy).
__device__ __forceinline__ void wb_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Pins n accumulator registers at this point of the program: wgmma writes them behind the
// compiler's back until wgmma.wait_group, so reads must not move above the wait.
template <int N>
__device__ __forceinline__ void wb_pin(float* d) {
    #pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x 64, f32) (+)= A B, both from shared memory (descriptors); TA / TB: A / B MN-major.
template <int TA, int TB>
__device__ __forceinline__ void wb_mma64_ss(float* d, unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(accumulate), "n"(TA), "n"(TB));
}

// d (64 x 32, f32) (+)= A B, both from shared memory (descriptors); TA / TB: A / B MN-major.
template <int TA, int TB>
__device__ __forceinline__ void wb_mma32_ss(float* d, unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(accumulate), "n"(TA), "n"(TB));
}

// d (64 x 64, f32) += A B, A (64 x 16 bf16) from registers in the accumulator's layout, B from
// shared memory, MN-major when TB.
template <int TB>
__device__ __forceinline__ void wb_mma64_rs(float* d, const unsigned* a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TB), "r"(1));
}

// The A fragments (bf16, k-steps of 16 columns) of a 64 x 64 accumulator: wgmma's accumulator
// and A-register layouts agree (per warp those of mma.sync's m16n8 C and m16k16 A).
__device__ __forceinline__ void wb_acc_to_a(unsigned (*a)[4], const float* c) {
    #pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        a[kk][0] = tc_pack(c[8 * kk + 0], c[8 * kk + 1]);
        a[kk][1] = tc_pack(c[8 * kk + 2], c[8 * kk + 3]);
        a[kk][2] = tc_pack(c[8 * kk + 4], c[8 * kk + 5]);
        a[kk][3] = tc_pack(c[8 * kk + 6], c[8 * kk + 7]);
    }
}

// Starts filling a ROWS x 64 tile (interleaved layout) with rows [r0, r0 + ROWS) of one head of
// a bf16 tensor (row j at src + j * stride; rows at or past seq are zero). Piece idx (16 bytes)
// lands at byte 16 idx, which is row 8 (idx >> 6) + (idx & 7), column 8 ((idx >> 3) & 7) of
// wb_off: eight consecutive threads fill one core matrix (conflict-free 128-byte stores).
template <int ROWS>
__device__ __forceinline__ void wb_fill(unsigned char* s, const bf16_t* src, int r0, int seq, long long stride) {
    static_assert(ROWS * 8 % WB_THREADS == 0, "a tile must split evenly over the threads");
    #pragma unroll
    for (int it = 0; it < ROWS * 8 / WB_THREADS; it++) {
        int idx = it * WB_THREADS + threadIdx.x;
        int r = ((idx >> 6) << 3) + (idx & 7), c = ((idx >> 3) & 7) * 8;
        int j = r0 + r;
        bool valid = j < seq;
        tc_cp16(s + 16 * idx, src + (valid ? j : 0) * stride + c, valid ? 16 : 0);
    }
}

// Adds four adjacent floats into global memory (16-byte aligned; one vector reduction, sm_90).
__device__ __forceinline__ void wb_red4(float* p, float a, float b, float c, float d) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// Adds a warpgroup's dQ tile (64 queries x 32 head-dim columns, accumulator layout: rows
// wi 16 + gq (+ 8), columns 8 nb + 2 tq) times scale into row-major dq rows (row i at
// dqh + i stride; rows at or past seq_q skipped). Lanes tq and tq ^ 1 swap halves so that an
// even tq adds four adjacent columns of row ia and an odd one four of row ib: half the
// reductions of two-float ones, each 16-byte aligned (dq_acc is, and so is every row).
__device__ __forceinline__ void wb_dq_add(float* dqh, const float* dq, int ia, int seq_q, long long stride, float scale, int tq) {
    bool odd = tq & 1;
    int i = odd ? ia + 8 : ia;
    float* row = dqh + i * stride + 2 * (tq & ~1);
    #pragma unroll
    for (int nb = 0; nb < 4; nb++) {
        // Even lanes keep row ia's pair and send row ib's; odd lanes the other way round.
        float k0 = odd ? dq[4 * nb + 2] : dq[4 * nb], k1 = odd ? dq[4 * nb + 3] : dq[4 * nb + 1];
        float s0 = odd ? dq[4 * nb] : dq[4 * nb + 2], s1 = odd ? dq[4 * nb + 1] : dq[4 * nb + 3];
        float r0 = __shfl_xor_sync(FULL_MASK, s0, 1), r1 = __shfl_xor_sync(FULL_MASK, s1, 1);
        if (i < seq_q) {
            if (odd) wb_red4(row + nb * 8, scale * r0, scale * r1, scale * k0, scale * k1);
            else wb_red4(row + nb * 8, scale * k0, scale * k1, scale * r0, scale * r1);
        }
    }
}

// The products above, software-pipelined across query tiles. Tile t's dQ = dS K is issued and
// left running: the loop goes on to the barrier of tile t + 1 and the issue of its loads, waits
// for dQ(t) only then, issues S^T / dP^T(t + 1), and adds dQ(t) into dq_acc while they multiply. (dQ(t) is waited for with wait_group 0
// before S^T(t + 1) is issued, not with wait_group 2 after it: ptxas serializes every wgmma of
// the kernel, C7514, when accumulators are read after a wait_group N > 0 that completes a
// group committed in the previous loop iteration.) Because dQ(t) of one warpgroup may still
// read dS^T(t) while the other warpgroup forms dS^T(t + 1), dS^T is double-buffered
// (sds[t & 1]): dS^T(t + 2) is stored after a barrier that follows every thread's wait for
// dQ(t). Before each top barrier a thread waits for all but its latest group (dQ), so the
// Q / dO stage refilled after that barrier is read by no wgmma in flight. dQ's reductions are
// four floats wide (wb_dq_add): the host launches this kernel only on a 16-byte aligned dq_acc
// (else `fa2`). grid: (batch * kv_heads, ceil(seq_kv / WB_BC)); block: WB_THREADS; shared:
// 2 WB_BC 64 * 2 (K, V) + 2 stages of [2 WB_BR 64 * 2 (Q, dO) + 3 WB_BR * 4 (lse2, delta,
// position)] + 2 WB_BC 64 * 2 (dS^T, two buffers) bytes = 99840. Arguments as
// attention_bwd_tc_d64's.
extern "C" __global__ void __launch_bounds__(WB_THREADS, 1) attention_bwd_wgmma_d64(const bf16_t* dout, const bf16_t* q, const bf16_t* k, const bf16_t* v, const float* lse2, const float* delta, float* dq_acc, void* dk, void* dv, const int* qpos, const int* kvpos, AttGeom g) {
    constexpr int D = 64, BR = WB_BR, BC = WB_BC;
    constexpr int QT = BR * D * 2, KT = BC * D * 2;  // bytes of a Q (dO) and of a K (V, dS^T) tile
    constexpr int STAGE = 2 * QT + 3 * BR * 4;
    static_assert(3 * BR / 4 <= WB_THREADS, "one 16-byte piece of a stage's rows a thread");
    extern __shared__ __align__(128) unsigned char wb_smem[];
    unsigned char* sk = wb_smem;
    unsigned char* sv = sk + KT;
    unsigned char* stages = sv + KT;
    unsigned char* sds0 = stages + 2 * STAGE;  // dS^T: [key][query], two buffers of KT bytes
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    int wg = warp >> 2, wi = warp & 3;
    int bk = ATT_HEAD(g), b = bk / (int)g.kv_heads, kvh = bk % (int)g.kv_heads;
    int group = (int)(g.heads / g.kv_heads);
    int seq_q = (int)g.seq_q, seq_kv = (int)g.seq_kv, rows_ld = att_rows(g);
    int j0 = ATT_TILE_IDX(g) * BC;
    // Elements from one sequence position to the next (batch rows of the stored layout).
    int q_stride = (int)g.batch * g.ld_q, kv_stride = (int)g.batch * g.ld_kv, o_stride = (int)g.batch * g.ld_o;
    // The dQ accumulator is compact: (batch, head) rows of D.
    long long dqa_stride = g.batch * g.heads * D;
    const bf16_t* kh = k + b * g.ld_kv + kvh * D;
    const bf16_t* vh = v + b * g.ld_kv + kvh * D;
    wb_fill<BC>(sk, kh, j0, seq_kv, kv_stride);
    wb_fill<BC>(sv, vh, j0, seq_kv, kv_stride);
    // This thread's accumulator rows are keys warp 16 + gq and + 8 (warpgroup wg's rows 16 wi
    // + gq), as in tc_attention_bwd; masking by key position exactly as there.
    int ka = j0 + warp * 16 + gq, kb = ka + 8;
    int pa = ka < seq_kv ? (g.causal ? kvpos[ka] : TC_INT_MIN) : TC_INT_MAX;
    int pb = kb < seq_kv ? (g.causal ? kvpos[kb] : TC_INT_MIN) : TC_INT_MAX;
    int jl = j0 + BC - 1 < seq_kv - 1 ? j0 + BC - 1 : seq_kv - 1;
    int first_kpos = kvpos[j0], last_kpos = kvpos[jl];
    bool sorted = g.q_sorted && g.kv_sorted;
    bool whole = j0 + BC <= seq_kv;
    float sl2 = g.scale * TC_LOG2E;
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
    float dka[32], dva[32], dq[16];
    #pragma unroll
    for (int i = 0; i < 32; i++) { dka[i] = 0.0f; dva[i] = 0.0f; }
    // The previous tile's dQ destination: its head's dq_acc and its first query row of this
    // thread (wi 16 + gq of the tile).
    float* prev_dqh = dq_acc;
    int prev_ia = 0;
    for (int t = -1; t < total; t++) {
        // Start loading tile t + 1 (then wait for tile t): its stage was last read in t - 1,
        // by wgmmas (S^T, dP^T, dV, dK of t - 1) every thread waited for before this barrier;
        // only dQ(t - 1) may still run, reading sds[(t - 1) & 1] and K.
        if (t >= 0) {
            wb_wait1();
            tc_cp_wait_all();
            wb_fence_proxy();
            __syncthreads();
        }
        if (t + 1 < total) {
            int hn = kvh * group + (t + 1) / per_head, in0 = (first + (t + 1) % per_head) * BR;
            long long bhn = (long long)b * g.heads + hn;
            unsigned char* st = stages + ((t + 1) & 1) * STAGE;
            wb_fill<BR>(st, q + b * g.ld_q + hn * D, in0, seq_q, q_stride);
            wb_fill<BR>(st + QT, dout + b * g.ld_o + hn * D, in0, seq_q, o_stride);
            float* nl = reinterpret_cast<float*>(st + 2 * QT);
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
        const unsigned char* sq = stages + (t & 1) * STAGE;
        const unsigned char* sdo = sq + QT;
        const float* sl = reinterpret_cast<const float*>(sdo + QT);
        const float* sd = sl + BR;
        const int* sp = reinterpret_cast<const int*>(sd + BR);
        unsigned char* sds = sds0 + (t & 1) * KT;
        bool masked = tile < first_full;
        wb_wait0();
        wb_pin<16>(dq);
        // S^T = K_w Q^T and dP^T = V_w dO^T (k-steps of 16 head-dim columns: 256 bytes), two
        // groups: the exponentials of S^T run while dP^T is still being multiplied (and the
        // previous tile's dQ is added into dq_acc).
        float s[32], dp[32];
        wb_fence();
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++) wb_mma64_ss<0, 0>(s, wb_kmajor(sk + wg * 8192 + kk * 256), wb_kmajor(sq + kk * 256), kk);
        wb_commit();
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++) wb_mma64_ss<0, 0>(dp, wb_kmajor(sv + wg * 8192 + kk * 256), wb_kmajor(sdo + kk * 256), kk);
        wb_commit();
        if (t > 0) wb_dq_add(prev_dqh, dq, prev_ia, seq_q, dqa_stride, g.scale, tq);
        wb_wait1();
        wb_pin<32>(s);
        // P^T = exp(S^T scale − lse), masked. Element (nb, e) of the accumulators is query
        // column nb 8 + 2 tq + (e & 1), key row gq + 8 (e >> 1).
        #pragma unroll
        for (int nb = 0; nb < BR / 8; nb++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                int c = nb * 8 + 2 * tq + e;
                float l = sl[c];
                float xa = tc_exp2(__fmaf_rn(s[4 * nb + e], sl2, -l)), xb = tc_exp2(__fmaf_rn(s[4 * nb + 2 + e], sl2, -l));
                if (masked) {
                    int qp = sp[c];
                    if (pa > qp) xa = 0.0f;
                    if (pb > qp) xb = 0.0f;
                }
                s[4 * nb + e] = xa;
                s[4 * nb + 2 + e] = xb;
            }
        }
        // dV += P^T dO (k-steps of 16 queries: two row groups, 2048 bytes), running while dS is
        // formed; then dP^T's group is done (wait for all but the latest).
        unsigned pf[4][4], dsf[4][4];
        wb_acc_to_a(pf, s);
        wb_fence();
        #pragma unroll
        for (int kk = 0; kk < BR / 16; kk++) wb_mma64_rs<1>(dva, pf[kk], wb_mnmajor(sdo + kk * 2048));
        wb_commit();
        wb_wait1();
        wb_pin<32>(dp);
        // dS^T / scale = P^T ∘ (dP^T − delta) (the scale is applied to dK and dQ once, at their
        // ends).
        #pragma unroll
        for (int nb = 0; nb < BR / 8; nb++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                float dl = sd[nb * 8 + 2 * tq + e];
                dp[4 * nb + e] = s[4 * nb + e] * (dp[4 * nb + e] - dl);
                dp[4 * nb + 2 + e] = s[4 * nb + 2 + e] * (dp[4 * nb + 2 + e] - dl);
            }
        }
        wb_acc_to_a(dsf, dp);
        // dS^T to shared memory for dQ: rows warp 16 + gq (+ 8), query columns 8 nb + 2 tq
        // (one 128-byte core-matrix row set per warp and nb: no bank conflicts).
        #pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            int r = warp * 16 + gq, c = kk * 16 + 2 * tq;
            *reinterpret_cast<unsigned*>(sds + wb_off(r, c)) = dsf[kk][0];
            *reinterpret_cast<unsigned*>(sds + wb_off(r + 8, c)) = dsf[kk][1];
            *reinterpret_cast<unsigned*>(sds + wb_off(r, c + 8)) = dsf[kk][2];
            *reinterpret_cast<unsigned*>(sds + wb_off(r + 8, c + 8)) = dsf[kk][3];
        }
        // dK += dS^T Q.
        wb_fence();
        #pragma unroll
        for (int kk = 0; kk < BR / 16; kk++) wb_mma64_rs<1>(dka, dsf[kk], wb_mnmajor(sq + kk * 2048));
        wb_commit();
        wb_fence_proxy();
        __syncthreads();
        // dQ = dS K for head-dim columns [32 wg, 32 wg + 32) (k-steps of 16 keys), left running.
        wb_fence();
        #pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) wb_mma32_ss<1, 1>(dq, wb_mnmajor(sds + kk * 2048), wb_mnmajor(sk + kk * 2048 + wg * 512), kk);
        wb_commit();
        prev_dqh = dq_acc + ((long long)b * g.heads + h) * D + wg * 32;
        prev_ia = i0 + wi * 16 + gq;
    }
    wb_wait0();
    wb_pin<16>(dq);
    wb_pin<32>(dva);
    wb_pin<32>(dka);
    if (total > 0) wb_dq_add(prev_dqh, dq, prev_ia, seq_q, dqa_stride, g.scale, tq);
    tc_cp_wait_all();
    bool dk_bf16 = g.bf16 & ATT_BF16_DK, dv_bf16 = g.bf16 & ATT_BF16_DV;
    int dkv_stride = (int)g.batch * g.ld_dkv, head = b * g.ld_dkv + kvh * D + 2 * tq;
    if (ka < seq_kv) {
        long long row = (long long)ka * dkv_stride + head;
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) {
            tc_store2(dk, row + nb * 8, g.scale * dka[4 * nb], g.scale * dka[4 * nb + 1], dk_bf16);
            tc_store2(dv, row + nb * 8, dva[4 * nb], dva[4 * nb + 1], dv_bf16);
        }
    }
    if (kb < seq_kv) {
        long long row = (long long)kb * dkv_stride + head;
        #pragma unroll
        for (int nb = 0; nb < D / 8; nb++) {
            tc_store2(dk, row + nb * 8, g.scale * dka[4 * nb + 2], g.scale * dka[4 * nb + 3], dk_bf16);
            tc_store2(dv, row + nb * 8, dva[4 * nb + 2], dva[4 * nb + 3], dv_bf16);
        }
    }
}

// The wgmma layouts above, checked exactly with small integers (one warpgroup; shared tiles in
// wb_off's layout; out row-major 64 x 64):
// mode 0: out = A B^T, a [64 m][64 k], b [64 n][64 k]: K-major A and B (S^T's operands);
// mode 1: out = bf16(A B^T) C, c [64 k][64 n]: mode 0's accumulators as A registers, C MN-major
//         (dV's and dK's operands);
// mode 2: out = A^T B, a [128 k][64 m], b [128 k][64 n]: MN-major A and B, m64n32 at columns 0
//         and 32 (dQ's operands).
extern "C" __global__ void __launch_bounds__(128) attention_wgmma_selftest(const float* a, const float* b, const float* c, float* out, int mode) {
    __shared__ __align__(128) unsigned char sa[128 * 64 * 2], sb[128 * 64 * 2], sc[64 * 64 * 2];
    int rows = mode == 2 ? 128 : 64;
    for (int i = threadIdx.x; i < rows * 64; i += 128) {
        int r = i / 64, col = i % 64;
        *reinterpret_cast<bf16_t*>(sa + wb_off(r, col)) = (bf16_t)(tc_pack(a[i], 0.0f) & 0xffff);
        *reinterpret_cast<bf16_t*>(sb + wb_off(r, col)) = (bf16_t)(tc_pack(b[i], 0.0f) & 0xffff);
        if (r < 64) *reinterpret_cast<bf16_t*>(sc + wb_off(r, col)) = (bf16_t)(tc_pack(c[i], 0.0f) & 0xffff);
    }
    wb_fence_proxy();
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    if (mode == 2) {
        #pragma unroll
        for (int half = 0; half < 2; half++) {
            float d[16];
            wb_fence();
            #pragma unroll
            for (int kk = 0; kk < 8; kk++) wb_mma32_ss<1, 1>(d, wb_mnmajor(sa + kk * 2048), wb_mnmajor(sb + kk * 2048 + half * 512), kk);
            wb_commit();
            wb_wait0();
            wb_pin<16>(d);
            #pragma unroll
            for (int i = 0; i < 16; i++) out[(warp * 16 + gq + 8 * ((i >> 1) & 1)) * 64 + half * 32 + 8 * (i >> 2) + 2 * tq + (i & 1)] = d[i];
        }
        return;
    }
    float s[32];
    wb_fence();
    #pragma unroll
    for (int kk = 0; kk < 4; kk++) wb_mma64_ss<0, 0>(s, wb_kmajor(sa + kk * 256), wb_kmajor(sb + kk * 256), kk);
    wb_commit();
    wb_wait0();
    wb_pin<32>(s);
    if (mode == 1) {
        unsigned f[4][4];
        wb_acc_to_a(f, s);
        #pragma unroll
        for (int i = 0; i < 32; i++) s[i] = 0.0f;
        wb_fence();
        #pragma unroll
        for (int kk = 0; kk < 4; kk++) wb_mma64_rs<1>(s, f[kk], wb_mnmajor(sc + kk * 2048));
        wb_commit();
        wb_wait0();
        wb_pin<32>(s);
    }
    #pragma unroll
    for (int i = 0; i < 32; i++) out[(warp * 16 + gq + 8 * ((i >> 1) & 1)) * 64 + 8 * (i >> 2) + 2 * tq + (i & 1)] = s[i];
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
