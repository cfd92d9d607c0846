// FP8 GEMMs whose scales vary along the operands' lines or along K: the rowwise and blockwise
// recipes (fp8_gemm.rs), which cuBLASLt's algorithm search runs nowhere on Hopper (outer-vector
// scales on the H100 and H200, 2026-12-05; 128-element block scales on the H200, 2026-12-06 and
// 2026-12-07). compute_90a, warpgroup MMA fed by TMA as gemm_ws.cu.
//
// Row-major view as gemm_ws.cu's: C[mr × nr] (ldc) = P[mr × k] · Q[k × nr], P and Q FP8 (E4M3 or
// E5M2 each), both K-major: the lines of the FP8 GEMM's two quantized operands as fp8.rs's
// quantization writes them (`[lines, ld]`, K padded with zeros to ld). Each operand comes with its
// dequantization factors 1/s (powers of two) in one of fp8_scales' layouts: 0 one factor, 1 one a
// line, 2 `1 × block` tiles (line, kg) at line + kg · lines, 3 `block × block` squares (line
// block lb, kg) at kg + lb · kg4; 4 the same squares, for Q, where fg_fold loads one factor for
// the tile's 128 columns (a block spans whole tiles: both start at multiples of 128).
//
// A persistent CTA (one an SM) of three warpgroups walks the 128 × BN tiles of C: one producer
// thread loads 128 k (128 bytes) of the tile's P and Q rows a stage into a ring of stages,
// 128-byte swizzled; two consumer warpgroups each own 64 rows (m64nBNk32, BN / 2 accumulators a
// thread). BN is 128 (5 stages), or 256 (4 stages) for the `_wide` rowwise kernels
// (`Fp8GemmKernel::Wide`, waiting for its measurement: each MMA reads P's rows once for twice the
// columns, as gemm_ws.cu's tiles). Where the factors are constant along K (FOLD false: rowwise,
// tensorwise) the products accumulate as in gemm_ws.cu and the epilogue multiplies each element
// by its row's and column's factor. Blockwise (FOLD true) sums each k group (`fold` stages of 128: block / 128) in a second
// set of accumulators, then adds it times the group's two factors into the first: f32 sums of
// exact FP8 products scaled by powers of two, as the CPU's emulation (cpu/fp8.rs) differing only
// in the order of its additions.
//
// Epilogue: C = acc (+ beta·R), R at c_in or C itself, bf16 or f32 as C (`out_f32`).
#ifdef __CUDA_ARCH_FEAT_SM90_ALL

#define FG_BM 128
#define FG_BK 128
#define FG_TILE_BYTES (FG_BM * FG_BK)
// The ring's stages for tiles BN columns wide, and a stage's bytes (P's tile, then Q's). Shared
// memory (fp8_gemm.rs's `smem`): alignment, the ring, the pipeline's barriers (ws_pipeline_init's):
// 1024 + stages · stage bytes + 16 · stages + 32.
#define FG_STAGES(BN) ((BN) == 128 ? 5 : 4)
#define FG_STAGE_BYTES(BN) (FG_TILE_BYTES + (BN) * FG_BK)

#define FG_MMA(PT, QT)                                                                                          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                 \
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32." PT "." QT " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"   \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                       \
                 : "l"(a), "l"(b), "r"(1))

// d (64 × 128, fp32) += P·Q over 32 k, both K-major FP8 in shared memory; FP / FQ: E5M2 (1) or
// E4M3 (0).
template <int FP, int FQ>
__device__ __forceinline__ void fg_mma(float (&d)[64], unsigned long long a, unsigned long long b) {
    if (FP == 0 && FQ == 0) {
        FG_MMA("e4m3", "e4m3");
    } else if (FP == 0) {
        FG_MMA("e4m3", "e5m2");
    } else if (FQ == 0) {
        FG_MMA("e5m2", "e4m3");
    } else {
        FG_MMA("e5m2", "e5m2");
    }
}

// d (64 × 256, fp32) += P·Q over 32 k, as fg_mma (the wide kernels' MMA).
#define FG_MMA256(PT, QT)                                                                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned.m64n256k32.f32." PT "." QT " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1;\n}\n"   \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])   \
                 : "l"(a), "l"(b), "r"(1))

template <int FP, int FQ>
__device__ __forceinline__ void fg_mma(float (&d)[128], unsigned long long a, unsigned long long b) {
    if (FP == 0 && FQ == 0) {
        FG_MMA256("e4m3", "e4m3");
    } else if (FP == 0) {
        FG_MMA256("e4m3", "e5m2");
    } else if (FQ == 0) {
        FG_MMA256("e5m2", "e4m3");
    } else {
        FG_MMA256("e5m2", "e5m2");
    }
}

// An operand's dequantization factors: where they are and how they are laid out (above).
struct FgScales {
    const float* f;
    int layout;
    long long lines, block, kg4;
};

// The factor of `line` (clamped to the operand's: rows past it are zeros) in k group kg.
__device__ __forceinline__ float fg_factor(const FgScales& s, long long line, long long kg) {
    line = line < s.lines ? line : s.lines - 1;
    switch (s.layout) {
        case 0: return __ldg(s.f);
        case 1: return __ldg(s.f + line);
        case 2: return __ldg(s.f + line + kg * s.lines);
        default: return __ldg(s.f + kg + (line / s.block) * s.kg4);
    }
}

// acc[4 nb + 2 h + e] (row r0 + 8 h, column c0 + 8 nb + e) += part · its row's and column's factors
// of k group kg (gemm_ws.cu's accumulator layout, n = 128). Q's layout 4: one factor for every
// column of the tile, loaded once.
template <int N>
__device__ __forceinline__ void fg_fold(float (&acc)[N], const float (&part)[N], const FgScales& sp, const FgScales& sq, int r0, int c0, long long kg) {
    float fr[2] = {fg_factor(sp, r0, kg), fg_factor(sp, r0 + 8, kg)};
    const bool q_tile = sq.layout == 4;
    const float fq = q_tile ? fg_factor(sq, c0, kg) : 0.0f;
    #pragma unroll
    for (int nb = 0; nb < N / 4; nb++) {
        float fc[2];
        if (q_tile) {
            fc[0] = fq;
            fc[1] = fq;
        } else {
            fc[0] = fg_factor(sq, c0 + 8 * nb, kg);
            fc[1] = fg_factor(sq, c0 + 8 * nb + 1, kg);
        }
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) acc[4 * nb + 2 * h + e] += part[4 * nb + 2 * h + e] * fr[h] * fc[e];
        }
    }
}

// acc[4 nb + 2 h + e] = 0 + acc · its row's and column's factors (K group 0), in place: what
// fg_fold adds onto zeroed accumulators, for the wide tiles' 128 accumulators.
template <int N>
__device__ __forceinline__ void fg_scale(float (&acc)[N], const FgScales& sp, const FgScales& sq, int r0, int c0) {
    float fr[2] = {fg_factor(sp, r0, 0), fg_factor(sp, r0 + 8, 0)};
    #pragma unroll
    for (int nb = 0; nb < N / 4; nb++) {
        float fc[2] = {fg_factor(sq, c0 + 8 * nb, 0), fg_factor(sq, c0 + 8 * nb + 1, 0)};
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                float product = acc[4 * nb + 2 * h + e];
                acc[4 * nb + 2 * h + e] = 0.0f;
                acc[4 * nb + 2 * h + e] += product * fr[h] * fc[e];
            }
        }
    }
}

// Waits for stage `it`'s slot (full[it % stages]) and issues consumer cw's four MMAs of it into
// d (BN / 2 accumulators) as one wgmma group.
template <int FP, int FQ, int BN>
__device__ __forceinline__ void fg_stage(float (&d)[BN / 2], unsigned ring, unsigned bars, int it, int cw) {
    int s = it % FG_STAGES(BN);
    unsigned slot = ring + s * FG_STAGE_BYTES(BN);
    mbar_wait(bars + 8 * s, (it / FG_STAGES(BN)) & 1);
    wg_hold(d);
    wg_fence();
    #pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        fg_mma<FP, FQ>(d, wg_desc(slot + cw * 8192 + kk * 32, 16, 1024), wg_desc(slot + FG_TILE_BYTES + kk * 32, 16, 1024));
    }
    wg_commit();
}

// This warp is done reading stage `it`'s slot (empty[it % stages]).
template <int BN>
__device__ __forceinline__ void fg_release(unsigned bars, int it) {
    mbar_arrive_warp(bars + 8 * (FG_STAGES(BN) + it % FG_STAGES(BN)));
}

template <int FP, int FQ, bool FOLD, int BN>
__device__ __forceinline__ void fg_gemm(const TmaMap& tp, const TmaMap& tq, int mr, int nr, int kblocks, int fold, long long ldc, float beta, void* c, const void* c_in, int out_f32, FgScales sp, FgScales sq) {
    static_assert(BN == 128 || (BN == 256 && !FOLD), "blockwise folds keep two accumulator sets: tiles of 128");
    constexpr int STAGES = FG_STAGES(BN), STAGE_BYTES = FG_STAGE_BYTES(BN), N = BN / 2;
    extern __shared__ __align__(16) unsigned char fg_smem_raw[];
    unsigned raw = tc_smem_addr(fg_smem_raw);
    unsigned ring = raw + ((1024 - (raw & 1023)) & 1023);  // slot s at ring + s STAGE_BYTES
    unsigned bars = ring + STAGES * STAGE_BYTES;             // full[s] at bars + 8 s, empty[s] at bars + 8 (STAGES + s)
    int tiles_n = (nr + BN - 1) / BN;
    int tiles = ((mr + FG_BM - 1) / FG_BM) * tiles_n;
    int wg = __shfl_sync(FULL_MASK, (int)threadIdx.x / WG_THREADS, 0);
    if (threadIdx.x == 0) ws_pipeline_init(bars, STAGES, 8);  // 8: the consumers' warps
    __syncthreads();
    if (wg == 0) {
        regs_dealloc<24>();
        if (threadIdx.x != 0) return;
        tma_prefetch(tp);
        tma_prefetch(tq);
        int it = 0;
        for (int w = blockIdx.x; w < tiles; w += gridDim.x) {
            int i0 = (w / tiles_n) * FG_BM, j0 = (w % tiles_n) * BN;
            for (int kb = 0; kb < kblocks; kb++, it++) {
                int s = it % STAGES;
                unsigned full = bars + 8 * s, slot = ring + s * STAGE_BYTES;
                mbar_wait(bars + 8 * (STAGES + s), ((it / STAGES) & 1) ^ 1);
                mbar_expect_tx(full, STAGE_BYTES);
                tma_load_2d(slot, tp, full, kb * FG_BK, i0);
                tma_load_2d(slot + FG_TILE_BYTES, tq, full, kb * FG_BK, j0);
            }
        }
        return;
    }
    regs_alloc<240>();
    int cw = wg - 1, warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    int it = 0;
    for (int w = blockIdx.x; w < tiles; w += gridDim.x) {
        int i0 = (w / tiles_n) * FG_BM, j0 = (w % tiles_n) * BN;
        int r0 = i0 + 64 * cw + 16 * warp + (lane >> 2), c0 = j0 + 2 * (lane & 3);
        float acc[N];
        #pragma unroll
        for (int i = 0; i < N; i++) acc[i] = 0.0f;
        if (FOLD) {
            float part[N];
            #pragma unroll
            for (int i = 0; i < N; i++) part[i] = 0.0f;
            for (int kb = 0; kb < kblocks; kb++, it++) {
                fg_stage<FP, FQ, BN>(part, ring, bars, it, cw);
                wg_wait_all();
                wg_hold(part);
                fg_release<BN>(bars, it);
                if ((kb + 1) % fold == 0 || kb + 1 == kblocks) {
                    fg_fold(acc, part, sp, sq, r0, c0, kb / fold);
                    #pragma unroll
                    for (int i = 0; i < N; i++) part[i] = 0.0f;
                }
            }
        } else {
            for (int kb = 0; kb < kblocks; kb++, it++) {
                fg_stage<FP, FQ, BN>(acc, ring, bars, it, cw);
                asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                wg_hold(acc);
                // The group before this one has finished reading its slot.
                if (kb > 0) fg_release<BN>(bars, it - 1);
            }
            wg_wait_all();
            wg_hold(acc);
            if (kblocks > 0) fg_release<BN>(bars, it - 1);
            if (BN == 128) {
                float part[N];
                #pragma unroll
                for (int i = 0; i < N; i++) {
                    part[i] = acc[i];
                    acc[i] = 0.0f;
                }
                fg_fold(acc, part, sp, sq, r0, c0, 0);
            } else {
                // In place (a second set of 128 would not fit), the same sum: 0 + product.
                fg_scale(acc, sp, sq, r0, c0);
            }
        }
        // Element pairs stored together where every pair's address is aligned (ldc even).
        bool pairs = (ldc & 1) == 0;
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            int i = r0 + 8 * h;
            if (i >= mr) continue;
            long long ro = (long long)i * ldc;
            #pragma unroll
            for (int nb = 0; nb < N / 4; nb++) {
                int j = c0 + 8 * nb;
                if (j >= nr) continue;
                float v[2] = {acc[4 * nb + 2 * h], acc[4 * nb + 2 * h + 1]};
                int n = j + 1 < nr ? 2 : 1;
                if (out_f32) {
                    float* o = static_cast<float*>(c) + ro + j;
                    const float* r = (c_in ? static_cast<const float*>(c_in) : static_cast<const float*>(c)) + ro + j;
                    for (int e = 0; e < n; e++) {
                        if (beta != 0.0f) v[e] += beta * r[e];
                    }
                    if (n == 2 && pairs) {
                        *reinterpret_cast<float2*>(o) = make_float2(v[0], v[1]);
                    } else {
                        for (int e = 0; e < n; e++) o[e] = v[e];
                    }
                } else {
                    unsigned short* o = static_cast<unsigned short*>(c) + ro + j;
                    const unsigned short* r = (c_in ? static_cast<const unsigned short*>(c_in) : static_cast<const unsigned short*>(c)) + ro + j;
                    for (int e = 0; e < n; e++) {
                        if (beta != 0.0f) v[e] += beta * widen_bf16(r[e]);
                    }
                    if (n == 2 && pairs) {
                        *reinterpret_cast<unsigned*>(o) = gw_pack(v[0], v[1]);
                    } else {
                        for (int e = 0; e < n; e++) o[e] = round_bf16(v[e]);
                    }
                }
            }
        }
    }
}

// Entry points: P's and Q's formats (e4 E4M3, e5 E5M2), then whether the factors change along
// K (`blocks`: blockwise) or not (`lines`: rowwise; `wide`: in 128 × 256 tiles).
#define FG_KERNEL(NAME, FP, FQ, FOLD, BN)                                                                                              \
    extern "C" __global__ void __launch_bounds__(3 * WG_THREADS, 1) NAME(                                                            \
        const __grid_constant__ TmaMap tp, const __grid_constant__ TmaMap tq, int mr, int nr, int kblocks, int fold, long long ldc,   \
        float beta, void* c, const void* c_in, int out_f32, const float* p_f, int p_layout, long long p_lines, long long p_block,     \
        long long p_kg4, const float* q_f, int q_layout, long long q_lines, long long q_block, long long q_kg4) {                      \
        FgScales sp = {p_f, p_layout, p_lines, p_block, p_kg4};                                                                       \
        FgScales sq = {q_f, q_layout, q_lines, q_block, q_kg4};                                                                       \
        fg_gemm<FP, FQ, FOLD, BN>(tp, tq, mr, nr, kblocks, fold, ldc, beta, c, c_in, out_f32, sp, sq);                               \
    }
FG_KERNEL(fp8_gemm_e4e4_lines, 0, 0, false, 128)
FG_KERNEL(fp8_gemm_e4e5_lines, 0, 1, false, 128)
FG_KERNEL(fp8_gemm_e5e4_lines, 1, 0, false, 128)
FG_KERNEL(fp8_gemm_e5e5_lines, 1, 1, false, 128)
FG_KERNEL(fp8_gemm_e4e4_blocks, 0, 0, true, 128)
FG_KERNEL(fp8_gemm_e4e5_blocks, 0, 1, true, 128)
FG_KERNEL(fp8_gemm_e5e4_blocks, 1, 0, true, 128)
FG_KERNEL(fp8_gemm_e5e5_blocks, 1, 1, true, 128)
FG_KERNEL(fp8_gemm_e4e4_wide, 0, 0, false, 256)
FG_KERNEL(fp8_gemm_e4e5_wide, 0, 1, false, 256)
FG_KERNEL(fp8_gemm_e5e4_wide, 1, 0, false, 256)
FG_KERNEL(fp8_gemm_e5e5_wide, 1, 1, false, 256)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
