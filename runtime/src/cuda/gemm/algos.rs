//! Algorithm candidates beyond cuBLASLt's heuristic, for the `wide` and `enumerate` GEMM
//! searches (`gemm_search` variants): split-K variants of the heuristic's kernels on
//! small-output, long-k GEMMs, and algorithms built from cuBLASLt's ids and tiles, each
//! validated by `cublasLtMatmulAlgoCheck`; and the one-line summary of an algorithm that
//! `gemm_plans` prints.
use super::*;

impl Blas {
    /// Split-K variants of the first [`SPLIT_BASES`] of `found` that support it, for a GEMM
    /// whose k is at least twice m and n (none otherwise): each count of [`SPLITS`] leaving at
    /// least [`MIN_SPLIT_K`] per slice, with the first reduction scheme the algorithm offers of
    /// fp32 workspace (`COMPUTE_TYPE`), in place and output type, that `cublasLtMatmulAlgoCheck`
    /// accepts within the workspace. A query cuBLASLt refuses drops that variant only: the
    /// search is an optimisation, and the heuristic's own candidates remain.
    pub(super) fn split_k_variants(
        &self,
        key: &PlanKey,
        descs: Descriptors<'_>,
        found: &[sys::cublasLtMatmulAlgo_t],
    ) -> Vec<sys::cublasLtMatmulAlgo_t> {
        use sys::cublasLtMatmulAlgoCapAttributes_t as Cap;
        use sys::cublasLtMatmulAlgoConfigAttributes_t as Config;
        use sys::cublasLtReductionScheme_t as R;
        let mut variants = Vec::new();
        if key.k < 2 * key.m.max(key.n) {
            return variants;
        }
        let mut bases: Vec<sys::cublasLtMatmulAlgo_t> = Vec::new();
        for algo in found {
            if bases.len() == SPLIT_BASES {
                break;
            }
            // The same kernel with another split count is the same base.
            let mut base = *algo;
            if set_config(&mut base, Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 1).is_some()
                && !bases.contains(&base)
            {
                bases.push(base);
            }
        }
        for base in bases {
            if cap(&base, Cap::CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) != Some(1) {
                continue;
            }
            let mask = cap(&base, Cap::CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK).unwrap_or(0);
            let Some(scheme) = [
                R::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                R::CUBLASLT_REDUCTION_SCHEME_INPLACE,
                R::CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE,
            ]
            .into_iter()
            .find(|&s| mask & s as u32 != 0) else {
                continue;
            };
            for splits in SPLITS {
                if key.k / u64::from(splits) < MIN_SPLIT_K {
                    continue;
                }
                let mut algo = base;
                if set_config(&mut algo, Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, splits).is_none()
                    || set_config(
                        &mut algo,
                        Config::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                        scheme as u32,
                    )
                    .is_none()
                    || found.contains(&algo)
                    || variants.contains(&algo)
                {
                    continue;
                }
                if self.check(&algo, descs) {
                    variants.push(algo);
                }
            }
        }
        variants
    }
}

impl Blas {
    /// Whether `cublasLtMatmulAlgoCheck` accepts `algo` for the descriptors within the
    /// workspace.
    fn check(&self, algo: &sys::cublasLtMatmulAlgo_t, (desc, a, b, c): Descriptors<'_>) -> bool {
        // SAFETY: an all-zero heuristic result is a valid value of this C struct.
        let mut checked: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: every descriptor is live for the call; `algo` and `checked` are valid for
        // reads and writes of their types.
        let status = unsafe {
            sys::cublasLtMatmulAlgoCheck(
                self.handle,
                desc.0,
                a.0,
                b.0,
                c.0,
                c.0,
                algo,
                &mut checked,
            )
        };
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && checked.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && checked.workspaceSize <= self.workspace_size
    }

    /// Up to [`ENUMERATED`] algorithms for `key` built from cuBLASLt's ids for its types: per
    /// id its supported tiles, largest first, each with the stage count left to cuBLASLt or
    /// else the first one `check` accepts (split-K 1), that `found` lacks (see
    /// [`Search::Enumerate`]). None where cuBLASLt lists nothing.
    pub(super) fn enumerated(
        &self,
        key: &PlanKey,
        descs: Descriptors<'_>,
        found: &[sys::cublasLtMatmulAlgo_t],
    ) -> Vec<sys::cublasLtMatmulAlgo_t> {
        use sys::cublasLtMatmulAlgoCapAttributes_t as Cap;
        use sys::cublasLtMatmulAlgoConfigAttributes_t as Config;
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let scale = sys::cudaDataType_t::CUDA_R_32F;
        let (ab, cd) = (key.operands.data_type(), key.out.data_type());
        let mut ids = vec![0i32; 256];
        let mut count: i32 = 0;
        // SAFETY: the handle is live; `ids` has room for the count asked for.
        let status = unsafe {
            sys::cublasLtMatmulAlgoGetIds(
                self.handle,
                compute,
                scale,
                ab,
                ab,
                cd,
                cd,
                ids.len() as i32,
                ids.as_mut_ptr(),
                &mut count,
            )
        };
        let mut out = Vec::new();
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return out;
        }
        ids.truncate(count.clamp(0, 256) as usize);
        // Spread over the ids: each keeps at most its share of ENUMERATED and makes at most
        // four checks per algorithm it may keep (a check costs microseconds of host time, and
        // most tile × stage pairs of an id do not fit the shape or epilogue).
        let share = (ENUMERATED / ids.len().max(1)).max(1);
        for id in ids {
            // SAFETY: an all-zero algorithm is a valid value of this plain C struct, which
            // AlgoInit overwrites.
            let mut base: sys::cublasLtMatmulAlgo_t = unsafe { std::mem::zeroed() };
            // SAFETY: the handle is live; `base` is writable.
            let status = unsafe {
                sys::cublasLtMatmulAlgoInit(
                    self.handle,
                    compute,
                    scale,
                    ab,
                    ab,
                    cd,
                    cd,
                    id,
                    &mut base,
                )
            };
            if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                continue;
            }
            let mut tiles = cap_list(&base, Cap::CUBLASLT_ALGO_CAP_TILE_IDS);
            // Largest tiles first (the ones a big GEMM wants; the share may cut the rest); an
            // id without a list takes the undefined (0) tile: its kernel decides.
            tiles.sort_by_key(|&t| std::cmp::Reverse(tile_area(t)));
            if tiles.is_empty() {
                tiles.push(0);
            }
            // Per tile the stage count is left to cuBLASLt (0) where it accepts that, else
            // the first supported count it accepts.
            let mut stages = cap_list(&base, Cap::CUBLASLT_ALGO_CAP_STAGES_IDS);
            stages.retain(|&s| s != 0);
            stages.insert(0, 0);
            let (mut kept, mut checks) = (0, 0);
            'tiles: for &tile in &tiles {
                for &stage in &stages {
                    if out.len() == ENUMERATED {
                        return out;
                    }
                    if kept == share || checks == 4 * share {
                        break 'tiles;
                    }
                    let mut algo = base;
                    if set_config(&mut algo, Config::CUBLASLT_ALGO_CONFIG_TILE_ID, tile).is_none()
                        || set_config(&mut algo, Config::CUBLASLT_ALGO_CONFIG_STAGES_ID, stage)
                            .is_none()
                    {
                        continue;
                    }
                    if found.contains(&algo) || out.contains(&algo) {
                        continue 'tiles;
                    }
                    checks += 1;
                    if self.check(&algo, descs) {
                        out.push(algo);
                        kept += 1;
                        continue 'tiles;
                    }
                }
            }
        }
        out
    }
}

/// A plan's matmul descriptor and its A, B and C/D layouts.
type Descriptors<'a> = (
    &'a Guard<sys::cublasLtMatmulDesc_t>,
    &'a Guard<sys::cublasLtMatrixLayout_t>,
    &'a Guard<sys::cublasLtMatrixLayout_t>,
    &'a Guard<sys::cublasLtMatrixLayout_t>,
);

/// A list-valued capability of `algo` (tile or stage ids, `uint32_t` each; empty where
/// cuBLASLt does not answer).
fn cap_list(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoCapAttributes_t,
) -> Vec<u32> {
    let mut bytes: usize = 0;
    // SAFETY: a null buffer of size 0 asks only for the size, written to `bytes`.
    let status = unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(algo, attr, std::ptr::null_mut(), 0, &mut bytes)
    };
    if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || bytes == 0 {
        return Vec::new();
    }
    let mut values = vec![0u32; bytes.div_ceil(size_of::<u32>())];
    let mut written: usize = 0;
    // SAFETY: `values` has room for `bytes` bytes.
    let status = unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(
            algo,
            attr,
            values.as_mut_ptr().cast(),
            values.len() * size_of::<u32>(),
            &mut written,
        )
    };
    if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Vec::new();
    }
    values.truncate(written / size_of::<u32>());
    values
}

/// A 4-byte capability of `algo` (None where cuBLASLt does not answer).
fn cap(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoCapAttributes_t,
) -> Option<u32> {
    let mut value: u32 = 0;
    let mut written: usize = 0;
    // SAFETY: `algo` is an initialised algorithm; `value` has room for the 4 bytes asked for.
    let status = unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(
            algo,
            attr,
            (&mut value as *mut u32).cast(),
            size_of::<u32>(),
            &mut written,
        )
    };
    (status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && written == size_of::<u32>())
        .then_some(value)
}

/// A 4-byte configuration value of `algo` (None where cuBLASLt does not answer).
fn config(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
) -> Option<u32> {
    let mut value: u32 = 0;
    let mut written: usize = 0;
    // SAFETY: as in `cap`.
    let status = unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            attr,
            (&mut value as *mut u32).cast(),
            size_of::<u32>(),
            &mut written,
        )
    };
    (status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && written == size_of::<u32>())
        .then_some(value)
}

/// Sets a 4-byte configuration value of `algo` (the split count and reduction scheme are
/// `int32_t` / `uint32_t`); None where cuBLASLt refuses it.
fn set_config(
    algo: &mut sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
    value: u32,
) -> Option<()> {
    // SAFETY: `algo` is an initialised algorithm; `value` is 4 readable bytes.
    let status = unsafe {
        sys::cublasLtMatmulAlgoConfigSetAttribute(
            algo,
            attr,
            (&value as *const u32).cast(),
            size_of::<u32>(),
        )
    };
    (status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(())
}

/// The names of cuBLASLt's first tile ids (`cublasLtMatmulTile_t`, m × n per CTA).
const TILES: [&str; 36] = [
    "undefined",
    "8x8",
    "8x16",
    "16x8",
    "8x32",
    "16x16",
    "32x8",
    "8x64",
    "16x32",
    "32x16",
    "64x8",
    "32x32",
    "32x64",
    "64x32",
    "32x128",
    "64x64",
    "128x32",
    "64x128",
    "128x64",
    "64x256",
    "128x128",
    "256x64",
    "64x512",
    "128x256",
    "256x128",
    "512x64",
    "64x96",
    "96x64",
    "96x128",
    "128x160",
    "160x128",
    "192x128",
    "128x192",
    "128x96",
    "32x256",
    "256x32",
];

/// A tile's m × n elements from its [`TILES`] name (0 for the undefined and unnamed ones).
fn tile_area(tile: u32) -> u32 {
    TILES
        .get(tile as usize)
        .and_then(|name| name.split_once('x'))
        .and_then(|(m, n)| Some(m.parse::<u32>().ok()? * n.parse::<u32>().ok()?))
        .unwrap_or(0)
}

/// `algo`'s configuration in a few words: id, tile, stages, split-K and its reduction
/// scheme, CTA swizzling, custom option (for plan listings; `?` where cuBLASLt does not say).
pub(super) fn algo_summary(algo: &sys::cublasLtMatmulAlgo_t) -> String {
    use sys::cublasLtMatmulAlgoConfigAttributes_t as Config;
    let get = |attr| config(algo, attr).map_or("?".to_string(), |v| v.to_string());
    let tile = config(algo, Config::CUBLASLT_ALGO_CONFIG_TILE_ID).map_or("?".to_string(), |t| {
        TILES
            .get(t as usize)
            .map_or(format!("#{t}"), |name| name.to_string())
    });
    format!(
        "algo {} tile {tile} stages {} split-K {} (reduction {}) swizzle {} custom {}",
        get(Config::CUBLASLT_ALGO_CONFIG_ID),
        get(Config::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        get(Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
        get(Config::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
        get(Config::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        get(Config::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
    )
}
