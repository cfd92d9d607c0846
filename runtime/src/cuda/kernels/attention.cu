// Flash-style attention in fp32: a block of ATT_WARPS warps takes ATT_WARPS rows of one
// (batch, head); the other side streams through shared memory in tiles of ATT_TILE rows; each
// lane holds head_dim/32 columns, at most W: 4 (heads up to 128; the kernels named as below) or
// 8 (up to 256: the `_w8` instances, which hold twice the registers). Softmax is online (running max and sum), so no T×T
// matrix exists; the backward recomputes probabilities from lse. Visibility is by global
// position (qpos/kvpos), so context-parallel chunks mask correctly. Every q, k, v, o, dO, dQ,
// dK, dV buffer is f32 or bf16 (AttGeom::bf16, one ATT_BF16_* bit each): bf16 reads widen
// exactly, bf16 writes round once to nearest-even (the CPU backend's semantics).
#define ATT_WARPS 8
#define ATT_TILE 32

struct AttGeom {
    long long batch, heads, kv_heads, head_dim, seq_q, seq_kv;
    // Row strides (elements between consecutive rows of the stored [seq · batch, width]
    // layout) of q; of k and v; of o and dO; of dq; of dk and dv. Each is its tensor's own
    // width (heads or kv_heads times head_dim) unless q, k, v (and dq, dk, dv) are column
    // ranges of one packed qkv (dqkv) buffer, whose rows are (heads + 2 kv_heads) · head_dim
    // wide. (The tensor-core backward's f32 dQ accumulator is always compact, heads ·
    // head_dim wide.) 32-bit, the host checking that batch times any of them fits: fewer
    // registers in the tensor-core kernels.
    int ld_q, ld_kv, ld_o, ld_dq, ld_dkv;
    // The tensor-core kernels' grid order: 0 = (batch · heads, tiles), 1 = (tiles, batch ·
    // heads), so that one head's tiles run together and share its K and V (backward: Q, dO)
    // in L2 (att_tile / att_head below).
    int tiles_first;
    int causal;
    float scale;
    // Positions ascending (every plan's segments are): lets causal blocks skip whole tiles.
    int q_sorted, kv_sorted;
    // Which buffers are bf16 (the rest are f32): ATT_BF16_* bits.
    int bf16;
    int pad_;
};

// The head (batch · heads, or batch · kv_heads) and the tile of this CTA, and the tiles per
// head, under either grid order (AttGeom::tiles_first).
#define ATT_HEAD(g) ((g).tiles_first ? (int)blockIdx.y : (int)blockIdx.x)
#define ATT_TILE_IDX(g) ((g).tiles_first ? (int)blockIdx.x : (int)blockIdx.y)
#define ATT_TILES(g) ((g).tiles_first ? (int)gridDim.x : (int)gridDim.y)

#define ATT_BF16_Q 1
#define ATT_BF16_K 2
#define ATT_BF16_V 4
#define ATT_BF16_O 8
#define ATT_BF16_DO 16
#define ATT_BF16_DQ 32
#define ATT_BF16_DK 64
#define ATT_BF16_DV 128

// The row stride of attention_delta's delta and lse2 scratch: seq_q rounded up to a multiple of
// 4, so every (batch, head)'s rows start on a 16-byte boundary (the tensor-core backward copies
// them with cp.async).
__device__ __forceinline__ int att_rows(const AttGeom& g) {
    return (int)((g.seq_q + 3) & ~3LL);
}

// Element i of an f32 or bf16 buffer, as f32 (exact).
__device__ __forceinline__ float att_ld(const void* p, long long i, bool bf16) {
    return bf16 ? widen_bf16(((const unsigned short*)p)[i]) : ((const float*)p)[i];
}

// Writes element i of an f32 or bf16 buffer (bf16: rounded once, to nearest even).
__device__ __forceinline__ void att_st(void* p, long long i, float v, bool bf16) {
    if (bf16) ((unsigned short*)p)[i] = round_bf16(v);
    else ((float*)p)[i] = v;
}

// The largest query position a block of rows [i0, i0 + ATT_WARPS) can have, when causal with
// sorted positions (keys past it are invisible to the whole block); else INT_MAX.
__device__ __forceinline__ int block_max_qpos(const int* qpos, long long i0, const AttGeom& g) {
    if (!(g.causal && g.q_sorted && g.kv_sorted)) return 0x7fffffff;
    long long last = i0 + ATT_WARPS - 1;
    return qpos[last < g.seq_q ? last : g.seq_q - 1];
}

// This lane's columns of the row at element offset off of src.
template <int W>
__device__ __forceinline__ void load_row(float* dst, const void* src, long long off, bool bf16, int lane, int d) {
    #pragma unroll
    for (int t = 0; t < W; t++) { int e = lane + 32 * t; dst[t] = e < d ? att_ld(src, off + e, bf16) : 0.0f; }
}

template <int W>
__device__ __forceinline__ float dot_lane(const float* a, const float* row, int lane, int d) {
    float s = 0.0f;
    #pragma unroll
    for (int t = 0; t < W; t++) { int e = lane + 32 * t; if (e < d) s += a[t] * row[e]; }
    return warp_sum(s);
}

// Loads rows [j0, j0 + ATT_TILE) of one head (column offset col) of a [seq * batch, width]
// tensor (width: its row stride) into tile[ATT_TILE][d]; rows past seq are zero.
__device__ void load_tile(float* tile, const void* src, bool bf16, long long j0, long long seq, long long batch, long long b, long long width, long long col, int d) {
    for (int i = threadIdx.y * 32 + threadIdx.x; i < ATT_TILE * d; i += 32 * ATT_WARPS) {
        int jj = i / d, e = i % d;
        long long j = j0 + jj;
        tile[i] = j < seq ? att_ld(src, (j * batch + b) * width + col + e, bf16) : 0.0f;
    }
}

// grid: (ceil(seq_q / ATT_WARPS), batch * heads); block: (32, ATT_WARPS).
template <int W>
__device__ __forceinline__ void attention_fwd_body(const void* q, const void* k, const void* v, void* o, float* lse, const int* qpos, const int* kvpos, AttGeom g) {
    extern __shared__ float smem[];
    int d = (int)g.head_dim, lane = threadIdx.x;
    float* kt = smem;
    float* vt = smem + ATT_TILE * d;
    long long bh = blockIdx.y, b = bh / g.heads, h = bh % g.heads;
    long long kvh = h / (g.heads / g.kv_heads);
    long long i = (long long)blockIdx.x * ATT_WARPS + threadIdx.y;
    bool active = i < g.seq_q;
    float qr[W], acc[W];
    if (active) load_row<W>(qr, q, (i * g.batch + b) * g.ld_q + h * d, g.bf16 & ATT_BF16_Q, lane, d);
    #pragma unroll
    for (int t = 0; t < W; t++) acc[t] = 0.0f;
    int pi = active ? qpos[i] : 0;
    float m = NEG_INF, l = 0.0f;
    int limit = block_max_qpos(qpos, (long long)blockIdx.x * ATT_WARPS, g);
    for (long long j0 = 0; j0 < g.seq_kv; j0 += ATT_TILE) {
        if (kvpos[j0] > limit) break;
        __syncthreads();
        load_tile(kt, k, g.bf16 & ATT_BF16_K, j0, g.seq_kv, g.batch, b, g.ld_kv, kvh * d, d);
        load_tile(vt, v, g.bf16 & ATT_BF16_V, j0, g.seq_kv, g.batch, b, g.ld_kv, kvh * d, d);
        __syncthreads();
        if (!active) continue;
        for (int jj = 0; jj < ATT_TILE && j0 + jj < g.seq_kv; jj++) {
            if (g.causal && kvpos[j0 + jj] > pi) continue;
            float s = g.scale * dot_lane<W>(qr, kt + jj * d, lane, d);
            float m_new = fmaxf(m, s);
            float corr = expf(m - m_new);
            float p = expf(s - m_new);
            l = l * corr + p;
            #pragma unroll
            for (int t = 0; t < W; t++) { int e = lane + 32 * t; if (e < d) acc[t] = acc[t] * corr + p * vt[jj * d + e]; }
            m = m_new;
        }
    }
    if (!active) return;
    long long orow = (i * g.batch + b) * g.ld_o + h * d;
    #pragma unroll
    for (int t = 0; t < W; t++) { int e = lane + 32 * t; if (e < d) att_st(o, orow + e, l != 0.0f ? acc[t] / l : 0.0f, g.bf16 & ATT_BF16_O); }
    if (lane == 0) lse[bh * g.seq_q + i] = l != 0.0f ? m + logf(l) : NEG_INF;
}

// delta[(b*heads + h)*att_rows(g) + i] = dO_i · O_i, and lse2 (same index) = lse · log2 e (+inf where
// lse is −inf: the row sees no key), which the tensor-core backward reads.
// grid: (ceil(seq_q / ATT_WARPS), batch*heads).
template <int W>
__device__ __forceinline__ void attention_delta_body(const void* dout, const void* o, const float* lse, float* delta, float* lse2, AttGeom g) {
    int d = (int)g.head_dim, lane = threadIdx.x;
    long long bh = blockIdx.y, b = bh / g.heads, h = bh % g.heads;
    long long i = (long long)blockIdx.x * ATT_WARPS + threadIdx.y;
    if (i >= g.seq_q) return;
    long long off = (i * g.batch + b) * g.ld_o + h * d;
    float a[W], c[W];
    load_row<W>(a, dout, off, g.bf16 & ATT_BF16_DO, lane, d);
    load_row<W>(c, o, off, g.bf16 & ATT_BF16_O, lane, d);
    float s = 0.0f;
    #pragma unroll
    for (int t = 0; t < W; t++) s += a[t] * c[t];
    s = warp_sum(s);
    if (lane == 0) {
        long long r = bh * att_rows(g) + i;
        float l = lse[bh * g.seq_q + i];
        delta[r] = s;
        lse2[r] = l == NEG_INF ? __int_as_float(0x7f800000) : l * 1.4426950408889634f;
    }
}

// dq_i = scale Σ_j p_ij (dO_i·v_j − delta_i) k_j. Same grid as the forward.
template <int W>
__device__ __forceinline__ void attention_bwd_dq_body(const void* dout, const void* q, const void* k, const void* v, const float* lse, const float* delta, void* dq, const int* qpos, const int* kvpos, AttGeom g) {
    extern __shared__ float smem[];
    int d = (int)g.head_dim, lane = threadIdx.x;
    float* kt = smem;
    float* vt = smem + ATT_TILE * d;
    long long bh = blockIdx.y, b = bh / g.heads, h = bh % g.heads;
    long long kvh = h / (g.heads / g.kv_heads);
    long long i = (long long)blockIdx.x * ATT_WARPS + threadIdx.y;
    bool active = i < g.seq_q;
    float qr[W], dor[W], acc[W];
    float li = NEG_INF, di = 0.0f;
    int pi = 0;
    if (active) {
        load_row<W>(qr, q, (i * g.batch + b) * g.ld_q + h * d, g.bf16 & ATT_BF16_Q, lane, d);
        load_row<W>(dor, dout, (i * g.batch + b) * g.ld_o + h * d, g.bf16 & ATT_BF16_DO, lane, d);
        li = lse[bh * g.seq_q + i];
        di = delta[bh * att_rows(g) + i];
        pi = qpos[i];
    }
    #pragma unroll
    for (int t = 0; t < W; t++) acc[t] = 0.0f;
    bool any = active && li != NEG_INF;
    int limit = block_max_qpos(qpos, (long long)blockIdx.x * ATT_WARPS, g);
    for (long long j0 = 0; j0 < g.seq_kv; j0 += ATT_TILE) {
        if (kvpos[j0] > limit) break;
        __syncthreads();
        load_tile(kt, k, g.bf16 & ATT_BF16_K, j0, g.seq_kv, g.batch, b, g.ld_kv, kvh * d, d);
        load_tile(vt, v, g.bf16 & ATT_BF16_V, j0, g.seq_kv, g.batch, b, g.ld_kv, kvh * d, d);
        __syncthreads();
        if (!any) continue;
        for (int jj = 0; jj < ATT_TILE && j0 + jj < g.seq_kv; jj++) {
            if (g.causal && kvpos[j0 + jj] > pi) continue;
            float p = expf(g.scale * dot_lane<W>(qr, kt + jj * d, lane, d) - li);
            float ds = p * (dot_lane<W>(dor, vt + jj * d, lane, d) - di);
            #pragma unroll
            for (int t = 0; t < W; t++) { int e = lane + 32 * t; if (e < d) acc[t] += ds * kt[jj * d + e]; }
        }
    }
    if (!active) return;
    long long row = (i * g.batch + b) * g.ld_dq + h * d;
    #pragma unroll
    for (int t = 0; t < W; t++) { int e = lane + 32 * t; if (e < d) att_st(dq, row + e, g.scale * acc[t], g.bf16 & ATT_BF16_DQ); }
}

// Per key row j of kv head kvh: dv_j = Σ_{h in group, i} p_ij dO_i, dk_j = scale Σ ds_ij q_i.
// grid: (ceil(seq_kv / ATT_WARPS), batch * kv_heads); smem: q and dO tiles, lse and delta.
template <int W>
__device__ __forceinline__ void attention_bwd_dkdv_body(const void* dout, const void* q, const void* k, const void* v, const float* lse, const float* delta, void* dk, void* dv, const int* qpos, const int* kvpos, AttGeom g) {
    extern __shared__ float smem[];
    int d = (int)g.head_dim, lane = threadIdx.x;
    float* qt = smem;
    float* dot_ = smem + ATT_TILE * d;
    float* lt = smem + 2 * ATT_TILE * d;
    float* dt = lt + ATT_TILE;
    long long bk = blockIdx.y, b = bk / g.kv_heads, kvh = bk % g.kv_heads;
    long long group = g.heads / g.kv_heads;
    long long j = (long long)blockIdx.x * ATT_WARPS + threadIdx.y;
    bool active = j < g.seq_kv;
    float kr[W], vr[W], dka[W], dva[W];
    int pj = 0;
    if (active) {
        load_row<W>(kr, k, (j * g.batch + b) * g.ld_kv + kvh * d, g.bf16 & ATT_BF16_K, lane, d);
        load_row<W>(vr, v, (j * g.batch + b) * g.ld_kv + kvh * d, g.bf16 & ATT_BF16_V, lane, d);
        pj = kvpos[j];
    }
    #pragma unroll
    for (int t = 0; t < W; t++) { dka[t] = 0.0f; dva[t] = 0.0f; }
    int first_kpos = kvpos[(long long)blockIdx.x * ATT_WARPS];
    for (long long h = kvh * group; h < (kvh + 1) * group; h++) {
        long long bh = b * g.heads + h;
        for (long long i0 = 0; i0 < g.seq_q; i0 += ATT_TILE) {
            // Causal with sorted positions: a query tile ending before the block's first key
            // sees none of the block's keys.
            long long i_last = i0 + ATT_TILE - 1 < g.seq_q ? i0 + ATT_TILE - 1 : g.seq_q - 1;
            if (g.causal && g.q_sorted && g.kv_sorted && qpos[i_last] < first_kpos) continue;
            __syncthreads();
            load_tile(qt, q, g.bf16 & ATT_BF16_Q, i0, g.seq_q, g.batch, b, g.ld_q, h * d, d);
            load_tile(dot_, dout, g.bf16 & ATT_BF16_DO, i0, g.seq_q, g.batch, b, g.ld_o, h * d, d);
            for (int t = threadIdx.y * 32 + threadIdx.x; t < ATT_TILE; t += 32 * ATT_WARPS) {
                long long i = i0 + t;
                lt[t] = i < g.seq_q ? lse[bh * g.seq_q + i] : NEG_INF;
                dt[t] = i < g.seq_q ? delta[bh * att_rows(g) + i] : 0.0f;
            }
            __syncthreads();
            if (!active) continue;
            for (int ii = 0; ii < ATT_TILE && i0 + ii < g.seq_q; ii++) {
                if (lt[ii] == NEG_INF) continue;
                if (g.causal && pj > qpos[i0 + ii]) continue;
                const float* qi = qt + ii * d;
                const float* doi = dot_ + ii * d;
                float p = expf(g.scale * dot_lane<W>(kr, qi, lane, d) - lt[ii]);
                float ds = p * (dot_lane<W>(vr, doi, lane, d) - dt[ii]);
                #pragma unroll
                for (int t = 0; t < W; t++) {
                    int e = lane + 32 * t;
                    if (e < d) { dva[t] += p * doi[e]; dka[t] += ds * qi[e]; }
                }
            }
        }
    }
    if (!active) return;
    long long row = (j * g.batch + b) * g.ld_dkv + kvh * d;
    #pragma unroll
    for (int t = 0; t < W; t++) {
        int e = lane + 32 * t;
        if (e < d) {
            att_st(dk, row + e, g.scale * dka[t], g.bf16 & ATT_BF16_DK);
            att_st(dv, row + e, dva[t], g.bf16 & ATT_BF16_DV);
        }
    }
}

// The entry points: up to 4 columns a lane (heads up to 128), and up to 8 (`_w8`: up to 256).
extern "C" __global__ void attention_fwd(const void* q, const void* k, const void* v, void* o, float* lse, const int* qpos, const int* kvpos, AttGeom g) { attention_fwd_body<4>(q, k, v, o, lse, qpos, kvpos, g); }
extern "C" __global__ void attention_fwd_w8(const void* q, const void* k, const void* v, void* o, float* lse, const int* qpos, const int* kvpos, AttGeom g) { attention_fwd_body<8>(q, k, v, o, lse, qpos, kvpos, g); }
extern "C" __global__ void attention_delta(const void* dout, const void* o, const float* lse, float* delta, float* lse2, AttGeom g) { attention_delta_body<4>(dout, o, lse, delta, lse2, g); }
extern "C" __global__ void attention_delta_w8(const void* dout, const void* o, const float* lse, float* delta, float* lse2, AttGeom g) { attention_delta_body<8>(dout, o, lse, delta, lse2, g); }
extern "C" __global__ void attention_bwd_dq(const void* dout, const void* q, const void* k, const void* v, const float* lse, const float* delta, void* dq, const int* qpos, const int* kvpos, AttGeom g) { attention_bwd_dq_body<4>(dout, q, k, v, lse, delta, dq, qpos, kvpos, g); }
extern "C" __global__ void attention_bwd_dq_w8(const void* dout, const void* q, const void* k, const void* v, const float* lse, const float* delta, void* dq, const int* qpos, const int* kvpos, AttGeom g) { attention_bwd_dq_body<8>(dout, q, k, v, lse, delta, dq, qpos, kvpos, g); }
extern "C" __global__ void attention_bwd_dkdv(const void* dout, const void* q, const void* k, const void* v, const float* lse, const float* delta, void* dk, void* dv, const int* qpos, const int* kvpos, AttGeom g) { attention_bwd_dkdv_body<4>(dout, q, k, v, lse, delta, dk, dv, qpos, kvpos, g); }
extern "C" __global__ void attention_bwd_dkdv_w8(const void* dout, const void* q, const void* k, const void* v, const float* lse, const float* delta, void* dk, void* dv, const int* qpos, const int* kvpos, AttGeom g) { attention_bwd_dkdv_body<8>(dout, q, k, v, lse, delta, dk, dv, qpos, kvpos, g); }
