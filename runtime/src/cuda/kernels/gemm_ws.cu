// GEMMs on Hopper's warpgroup MMA, warp-specialized and TMA-fed (compute_90a; variant `ws` of
// the 16-bit GEMMs, gemm_ws.rs): parc's own kernel beside cuBLASLt, for the shapes of a
// transformer layer where cuBLASLt leaves the tensor cores idle (long-k weight gradients with
// few output tiles, epilogues that write or read a second matrix). Each GEMM is timed once
// against cuBLASLt's fastest algorithm and the faster one runs (gemm_ws.rs).
//
// Row-major view: C[mr × nr] (ldc) = P[mr × k] · Q[k × nr], bf16 operands, fp32 accumulation.
// P and Q are each K-major (the reduction dimension contiguous) or MN-major (their own
// dimension contiguous), read through tensor maps into 128-byte-swizzled shared memory:
//   K-major P: boxes of 64 k × 128 rows (one 128-byte row per matrix row);
//   MN-major P: two boxes of 64 rows (columns of P) × 64 k, 8 KB apart;
//   K-major Q: one box of 64 k × 256 columns of C; MN-major Q: four boxes of 64 × 64.
// A persistent CTA (one an SM) of three warpgroups walks the work items (a 128 × 256 tile of
// C and, for a split reduction, one of `splits` ranges of k) blockIdx.x, + gridDim.x, …: one
// producer thread issues the loads into a ring of GW_STAGES slots; two consumer warpgroups
// each own 64 rows of the tile (m64n256k16, 128 accumulators a thread), keep one wgmma group
// in flight and release a slot when the group after it has been issued.
//
// Epilogues (GW_EPI_*), from the accumulators in registers:
//   F32    C = acc (+ beta·C), fp32; a split reduction writes its partial tile into `ws`
//          ([splits][mr][nr]) and the last split of a tile to arrive (a counter per tile,
//          reset by that split) adds the partials in split order, so the result does not
//          depend on timing; with `db`, also the row sums of P (a bias gradient: an extra
//          m64n8k16 against a tile of ones), written, not added;
//   BF16   C = bf16(acc + bias[j] + beta·R[i][j]) (bias f32 or bf16, R bf16 at c_in);
//   GELU   pre = acc + bias + beta·R as above, aux = bf16(pre), C = bf16(gelu_tanh(pre));
//   DGELU  C = bf16(acc · gelu_tanh'(aux[i][j])).
#ifdef __CUDA_ARCH_FEAT_SM90_ALL

#define GW_THREADS 384
#define GW_BM 128
#define GW_BN 256
#define GW_BK 64
#define GW_STAGES 4
#define GW_P_BYTES (GW_BM * GW_BK * 2)
#define GW_Q_BYTES (GW_BN * GW_BK * 2)
#define GW_STAGE_BYTES (GW_P_BYTES + GW_Q_BYTES)
// Shared memory: the ring, the tile of ones (1 KB), the barriers (ws_pipeline_init's), a flag.
#define GW_SMEM (1024 + GW_STAGES * GW_STAGE_BYTES + 1024 + 16 * GW_STAGES + 48)

#define GW_EPI_F32 0
#define GW_EPI_BF16 1
#define GW_EPI_GELU 2
#define GW_EPI_DGELU 3

// d (64 × 256, fp32) (+)= A·B, both from shared memory; TA / TB: A / B MN-major.
template <int TA, int TB>
__device__ __forceinline__ void gw_mma(float (&d)[128], unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b), "r"(accumulate), "n"(TA), "n"(TB));
}

// d (64 × 8, fp32) (+)= A·B with B a K-major tile of ones: every column the row sums of A over
// this k step (the bias gradient's column sums of dy).
template <int TA>
__device__ __forceinline__ void gw_mma_n8(float (&d)[4], unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, %7, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(a), "l"(b), "r"(accumulate), "n"(TA));
}

// Descriptor of consumer cw's 64 rows of P in a slot at p, k step kk (16 of the slot's 64):
// K-major, rows 64 cw.. at 128 bytes each (the k step 32 bytes into the swizzled row); MN-major,
// the column block cw (64 rows of P × 64 k, 8 KB), the k step 16 of its 128-byte rows.
template <int TA>
__device__ __forceinline__ unsigned long long gw_desc_p(unsigned p, int cw, int kk) {
    return TA ? wg_desc(p + cw * 8192 + kk * 2048, 8192, 1024) : wg_desc(p + cw * 8192 + kk * 32, 16, 1024);
}

// Descriptor of the slot's Q tile at q (256 columns of C), k step kk: K-major, 256 rows of
// 128 bytes; MN-major, four column blocks of 64, 8 KB apart (the leading byte offset).
template <int TB>
__device__ __forceinline__ unsigned long long gw_desc_q(unsigned q, int kk) {
    return TB ? wg_desc(q + kk * 2048, 8192, 1024) : wg_desc(q + kk * 32, 16, 1024);
}

// One work item: its tile of C (first row i0, column j0), the k blocks [kb0, kb1) of its
// split, the tile's index and the split's.
struct GwItem {
    int i0, j0, kb0, kb1, tile, split;
};

// Item w: splits slowest, so the items running at once share their k range (P and Q rows
// come from L2 for all but the first tile that reads them); tiles row-major.
__device__ __forceinline__ GwItem gw_item(int w, int tiles, int tiles_n, int splits, int kbs) {
    GwItem m;
    m.split = w / tiles;
    m.tile = w % tiles;
    m.i0 = (m.tile / tiles_n) * GW_BM;
    m.j0 = (m.tile % tiles_n) * GW_BN;
    m.kb0 = (int)((long long)kbs * m.split / splits);
    m.kb1 = (int)((long long)kbs * (m.split + 1) / splits);
    return m;
}

// gelu_tanh and its derivative as elementwise.cu computes them (x·σ(2u)), with the fast
// exponential and division: within bf16 rounding of the exact forms.
__device__ __forceinline__ float gw_gelu(float x) {
    float u = SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x);
    return __fdividef(x, 1.0f + __expf(-2.0f * u));
}
__device__ __forceinline__ float gw_dgelu(float x) {
    float u = SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x);
    float du = SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_TANH_CUBIC * x * x);
    float s = __fdividef(1.0f, 1.0f + __expf(-2.0f * u));
    return s + x * s * (1.0f - s) * 2.0f * du;
}

__device__ __forceinline__ unsigned gw_pack(float lo, float hi) {
    return (unsigned)round_bf16(lo) | ((unsigned)round_bf16(hi) << 16);
}

// A barrier of the two consumer warpgroups (256 threads, named barrier 1).
__device__ __forceinline__ void gw_consumers_bar() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

template <int TA, int TB, int EPI, bool DB>
__device__ __forceinline__ void gw_gemm(const TmaMap& tp, const TmaMap& tq, int mr, int nr, int k, int splits, long long ldc, float beta, void* c, const unsigned short* c_in, const void* bias, int bias_bf16, void* aux, float* db, float* ws, int* counters) {
    extern __shared__ __align__(16) unsigned char gw_smem_raw[];
    unsigned raw = tc_smem_addr(gw_smem_raw);
    unsigned char* smem = gw_smem_raw + ((1024 - (raw & 1023)) & 1023);
    unsigned ring = tc_smem_addr(smem);  // slot s at ring + s GW_STAGE_BYTES: P, then Q
    unsigned ones = ring + GW_STAGES * GW_STAGE_BYTES;
    unsigned bars = ones + 1024;  // full[s] at bars + 8 s, empty[s] at bars + 8 (GW_STAGES + s)
    volatile int* last_flag = reinterpret_cast<volatile int*>(smem + GW_STAGES * GW_STAGE_BYTES + 1024 + 16 * GW_STAGES + 32);
    int tiles_n = (nr + GW_BN - 1) / GW_BN;
    int tiles = ((mr + GW_BM - 1) / GW_BM) * tiles_n;
    int kbs = (k + GW_BK - 1) / GW_BK;
    int work = tiles * splits;
    int wg = __shfl_sync(FULL_MASK, (int)threadIdx.x / WG_THREADS, 0);
    if (DB) {
        unsigned* o = reinterpret_cast<unsigned*>(smem + GW_STAGES * GW_STAGE_BYTES);
        for (int i = threadIdx.x; i < 256; i += GW_THREADS) o[i] = 0x3f803f80u;  // bf16 1.0 pairs
        wg_fence_proxy();
    }
    // The ring's barriers (the pipeline's two item barriers after them go unused).
    if (threadIdx.x == 0) ws_pipeline_init(bars, GW_STAGES, 8);  // 8: the consumers' warps
    __syncthreads();
    if (wg == 0) {
        regs_dealloc<24>();
        if (threadIdx.x != 0) return;
        tma_prefetch(tp);
        tma_prefetch(tq);
        int it = 0;
        for (int w = blockIdx.x; w < work; w += gridDim.x) {
            GwItem m = gw_item(w, tiles, tiles_n, splits, kbs);
            for (int kb = m.kb0; kb < m.kb1; kb++, it++) {
                int s = it % GW_STAGES;
                unsigned full = bars + 8 * s, slot = ring + s * GW_STAGE_BYTES, qs = slot + GW_P_BYTES;
                mbar_wait(bars + 8 * (GW_STAGES + s), ((it / GW_STAGES) & 1) ^ 1);
                mbar_expect_tx(full, GW_STAGE_BYTES);
                int k0 = kb * GW_BK;
                if (TA) {
                    tma_load_2d(slot, tp, full, m.i0, k0);
                    tma_load_2d(slot + 8192, tp, full, m.i0 + 64, k0);
                } else {
                    tma_load_2d(slot, tp, full, k0, m.i0);
                }
                if (TB) {
                    #pragma unroll
                    for (int b = 0; b < 4; b++) tma_load_2d(qs + b * 8192, tq, full, m.j0 + 64 * b, k0);
                } else {
                    tma_load_2d(qs, tq, full, k0, m.j0);
                }
            }
        }
        return;
    }
    regs_alloc<240>();
    int cw = wg - 1, warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    int gq = lane >> 2, tq4 = lane & 3;
    int it = 0;
    for (int w = blockIdx.x; w < work; w += gridDim.x) {
        GwItem m = gw_item(w, tiles, tiles_n, splits, kbs);
        // Every item of a DB kernel sums P's rows (so no wgmma is on a divergent path, which
        // ptxas would serialize: C7520); the tiles of column 0 write them.
        bool item_db = DB && m.j0 == 0;
        float acc[128], dacc[4];
        #pragma unroll
        for (int i = 0; i < 128; i++) acc[i] = 0.0f;
        #pragma unroll
        for (int i = 0; i < 4; i++) dacc[i] = 0.0f;
        int n = m.kb1 - m.kb0;
        for (int t = 0; t < n; t++, it++) {
            int s = it % GW_STAGES;
            unsigned slot = ring + s * GW_STAGE_BYTES;
            mbar_wait(bars + 8 * s, (it / GW_STAGES) & 1);
            wg_hold(acc);
            wg_fence();
            #pragma unroll
            for (int kk = 0; kk < 4; kk++) gw_mma<TA, TB>(acc, gw_desc_p<TA>(slot, cw, kk), gw_desc_q<TB>(slot + GW_P_BYTES, kk), 1);
            if (DB) {
                #pragma unroll
                for (int kk = 0; kk < 4; kk++) gw_mma_n8<TA>(dacc, gw_desc_p<TA>(slot, cw, kk), wg_desc(ones + kk * 32, 16, 1024), 1);
            }
            wg_commit();
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            wg_hold(acc);
            // The group before this one has finished reading its slot.
            if (t > 0) mbar_arrive_warp(bars + 8 * (GW_STAGES + (it - 1) % GW_STAGES));
        }
        wg_wait_all();
        wg_hold(acc);
        wg_hold(dacc);
        if (n > 0) mbar_arrive_warp(bars + 8 * (GW_STAGES + (it - 1) % GW_STAGES));
        int row0 = m.i0 + 64 * cw + 16 * warp + gq;
        int col0 = m.j0 + 2 * tq4;
        if (EPI == GW_EPI_F32) {
            float* out = static_cast<float*>(c);
            if (splits > 1) {
                // This split's partial tile, then the tile's last split adds them all.
                float* part = ws + (long long)m.split * mr * nr;
                float* dpart = ws + (long long)splits * mr * nr + (long long)m.split * mr;
                #pragma unroll
                for (int half = 0; half < 2; half++) {
                    int i = row0 + 8 * half;
                    if (i < mr) {
                        #pragma unroll
                        for (int nb = 0; nb < 32; nb++) {
                            int j = col0 + 8 * nb;
                            if (j < nr) *reinterpret_cast<float2*>(part + (long long)i * nr + j) = make_float2(acc[4 * nb + 2 * half], acc[4 * nb + 2 * half + 1]);
                        }
                        if (item_db && tq4 == 0) dpart[i] = dacc[2 * half];
                    }
                }
                __threadfence();
                gw_consumers_bar();
                if (threadIdx.x == WG_THREADS) *last_flag = atomicAdd(counters + m.tile, 1) == splits - 1;
                gw_consumers_bar();
                if (!*last_flag) continue;
                __threadfence();
                #pragma unroll
                for (int half = 0; half < 2; half++) {
                    int i = row0 + 8 * half;
                    if (i < mr) {
                        #pragma unroll
                        for (int nb = 0; nb < 32; nb++) {
                            int j = col0 + 8 * nb;
                            if (j < nr) {
                                float2 v = make_float2(0.0f, 0.0f);
                                for (int s2 = 0; s2 < splits; s2++) {
                                    float2 p = s2 == m.split ? make_float2(acc[4 * nb + 2 * half], acc[4 * nb + 2 * half + 1])
                                                             : __ldcg(reinterpret_cast<const float2*>(ws + (long long)s2 * mr * nr + (long long)i * nr + j));
                                    v.x += p.x;
                                    v.y += p.y;
                                }
                                acc[4 * nb + 2 * half] = v.x;
                                acc[4 * nb + 2 * half + 1] = v.y;
                            }
                        }
                        if (item_db && tq4 == 0) {
                            float v = 0.0f;
                            for (int s2 = 0; s2 < splits; s2++) v += s2 == m.split ? dacc[2 * half] : __ldcg(ws + (long long)splits * mr * nr + (long long)s2 * mr + i);
                            dacc[2 * half] = v;
                        }
                    }
                }
                if (threadIdx.x == WG_THREADS) counters[m.tile] = 0;
            }
            #pragma unroll
            for (int half = 0; half < 2; half++) {
                int i = row0 + 8 * half;
                if (i < mr) {
                    float* crow = out + (long long)i * ldc;
                    #pragma unroll
                    for (int nb = 0; nb < 32; nb++) {
                        int j = col0 + 8 * nb;
                        if (j < nr) {
                            float2 v = make_float2(acc[4 * nb + 2 * half], acc[4 * nb + 2 * half + 1]);
                            if (beta != 0.0f) {
                                float2 o = *reinterpret_cast<const float2*>(crow + j);
                                v.x += beta * o.x;
                                v.y += beta * o.y;
                            }
                            *reinterpret_cast<float2*>(crow + j) = v;
                        }
                    }
                    if (item_db && tq4 == 0) db[i] = dacc[2 * half];
                }
            }
        } else {
            unsigned short* out = static_cast<unsigned short*>(c);
            const unsigned short* r = c_in ? c_in : out;
            const unsigned short* side = EPI == GW_EPI_DGELU ? static_cast<const unsigned short*>(aux) : r;
            bool read_side = EPI == GW_EPI_DGELU || beta != 0.0f;
            #pragma unroll
            for (int half = 0; half < 2; half++) {
                int i = row0 + 8 * half;
                if (i >= mr) continue;
                long long ro = (long long)i * ldc;
                // Eight column pairs at a time: their loads (bias, residual or pre-activation)
                // all issued before any store, which the compiler cannot move them past.
                #pragma unroll
                for (int c8 = 0; c8 < 4; c8++) {
                    float2 bv[8];
                    unsigned sv[8];
                    #pragma unroll
                    for (int q = 0; q < 8; q++) {
                        int j = col0 + 8 * (8 * c8 + q);
                        bv[q] = make_float2(0.0f, 0.0f);
                        sv[q] = 0u;
                        if (j < nr) {
                            if (EPI != GW_EPI_DGELU && bias) {
                                if (bias_bf16) {
                                    unsigned bb = *reinterpret_cast<const unsigned*>(static_cast<const unsigned short*>(bias) + j);
                                    bv[q] = make_float2(widen_bf16((unsigned short)(bb & 0xffffu)), widen_bf16((unsigned short)(bb >> 16)));
                                } else {
                                    bv[q] = *reinterpret_cast<const float2*>(static_cast<const float*>(bias) + j);
                                }
                            }
                            if (read_side) sv[q] = *reinterpret_cast<const unsigned*>(side + ro + j);
                        }
                    }
                    #pragma unroll
                    for (int q = 0; q < 8; q++) {
                        int nb = 8 * c8 + q, j = col0 + 8 * nb;
                        if (j >= nr) continue;
                        float x0 = acc[4 * nb + 2 * half], x1 = acc[4 * nb + 2 * half + 1];
                        float s0 = widen_bf16((unsigned short)(sv[q] & 0xffffu)), s1 = widen_bf16((unsigned short)(sv[q] >> 16));
                        if (EPI == GW_EPI_DGELU) {
                            x0 = x0 * gw_dgelu(s0);
                            x1 = x1 * gw_dgelu(s1);
                        } else {
                            x0 += bv[q].x;
                            x1 += bv[q].y;
                            if (beta != 0.0f) {
                                x0 += beta * s0;
                                x1 += beta * s1;
                            }
                            if (EPI == GW_EPI_GELU) {
                                *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(aux) + ro + j) = gw_pack(x0, x1);
                                x0 = gw_gelu(x0);
                                x1 = gw_gelu(x1);
                            }
                        }
                        *reinterpret_cast<unsigned*>(out + ro + j) = gw_pack(x0, x1);
                    }
                }
            }
        }
    }
}

// Entry points: P and Q K-major (`kk`: a forward, y = x Wᵀ), P K-major and Q MN-major (`km`:
// a backward-data product, dx = dy W), both MN-major (`mm`: a backward-weight product,
// dW = dyᵀ x).
#define GW_KERNEL(NAME, TA, TB, EPI, DB)                                                                                                    \
    extern "C" __global__ void __launch_bounds__(GW_THREADS, 1) NAME(                                                                  \
        const __grid_constant__ TmaMap tp, const __grid_constant__ TmaMap tq, int mr, int nr, int k, int splits, long long ldc,         \
        float beta, void* c, const unsigned short* c_in, const void* bias, int bias_bf16, void* aux, float* db, float* ws, int* counters) { \
        gw_gemm<TA, TB, EPI, DB>(tp, tq, mr, nr, k, splits, ldc, beta, c, c_in, bias, bias_bf16, aux, db, ws, counters);                   \
    }
GW_KERNEL(gemm_ws_kk_bf16, 0, 0, GW_EPI_BF16, false)
GW_KERNEL(gemm_ws_kk_gelu, 0, 0, GW_EPI_GELU, false)
GW_KERNEL(gemm_ws_km_bf16, 0, 1, GW_EPI_BF16, false)
GW_KERNEL(gemm_ws_km_dgelu, 0, 1, GW_EPI_DGELU, false)
GW_KERNEL(gemm_ws_mm_f32, 1, 1, GW_EPI_F32, false)
GW_KERNEL(gemm_ws_mm_f32_db, 1, 1, GW_EPI_F32, true)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
