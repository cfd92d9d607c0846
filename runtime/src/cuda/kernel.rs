//! The CUDA C kernels: their sources (`kernels/*.cu`, concatenated into one NVRTC program by
//! `compile`) and every entry point of them by a typed handle, [`Kernel`], whose C symbol is
//! written once, in the table below. A launch names a `Kernel`, never a string; the test at the
//! end holds the table to the sources (every `Kernel` is an `extern "C" __global__` function of
//! them, and every such function, macro instances included, has a `Kernel`).

/// The kernel sources, in the order they are concatenated (helpers first).
pub(super) const SOURCES: [&str; 14] = [
    include_str!("kernels/common.cuh"),
    include_str!("kernels/elementwise.cu"),
    include_str!("kernels/norm_loss.cu"),
    include_str!("kernels/optimizer.cu"),
    include_str!("kernels/attention.cu"),
    include_str!("kernels/attention_tc.cu"),
    include_str!("kernels/attention_wgmma_fwd.cu"),
    include_str!("kernels/hopper_async.cuh"),
    include_str!("kernels/attention_ws_fwd.cu"),
    include_str!("kernels/attention_ws_bwd.cu"),
    include_str!("kernels/gemm_ws.cu"),
    include_str!("kernels/cross_entropy.cu"),
    include_str!("kernels/fp8.cu"),
    include_str!("kernels/fp8_gemm.cu"),
];

macro_rules! kernels {
    ($($variant:ident $symbol:literal,)*) => {
        /// One `extern "C" __global__` function of the kernel sources.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub(crate) enum Kernel {
            $($variant,)*
        }

        impl Kernel {
            /// The kernel's C symbol in the compiled module.
            pub fn symbol(self) -> &'static str {
                match self { $(Kernel::$variant => $symbol),* }
            }

            /// Every kernel, in the table's order (`kernel as usize` indexes it).
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant),*];
        }
    };
}

kernels! {
    // kernels/common.cuh
    AddPartials "add_partials",
    ColSumPartial "col_sum_partial",
    ColSumPartial8 "col_sum_partial8",
    SumSquaresPartial "sum_squares_partial",
    SumPartialsInto "sum_partials_into",
    SumSquaresOnePass "sum_squares_one_pass",
    // kernels/elementwise.cu
    ActivationFwd "activation_fwd",
    ActivationBwd "activation_bwd",
    SwigluFwd "swiglu_fwd",
    SwigluBwd "swiglu_bwd",
    AddFwd "add_fwd",
    ScaleFwd "scale_fwd",
    Convert "convert",
    CopyColumns "copy_columns",
    BroadcastRows "broadcast_rows",
    EmbeddingFwd "embedding_fwd",
    EmbeddingBwd "embedding_bwd",
    PositionAddFwd "position_add_fwd",
    PositionAddBwd "position_add_bwd",
    RopeFwd "rope_fwd",
    RopeTable "rope_table",
    F32ToBf16Pair "f32_to_bf16_pair",
    F32ToF16Pair "f32_to_f16_pair",
    // kernels/norm_loss.cu
    CeGrad "ce_grad",
    CeLoss "ce_loss",
    CeMax "ce_max",
    CeSumExp "ce_sum_exp",
    CeTargetLogit "ce_target_logit",
    ClipCoef "clip_coef",
    LayerNormBwdDx "layer_norm_bwd_dx",
    LayerNormBwdFused1Bf16 "layer_norm_bwd_fused1_bf16",
    LayerNormBwdFused1F32 "layer_norm_bwd_fused1_f32",
    LayerNormBwdFused2Bf16 "layer_norm_bwd_fused2_bf16",
    LayerNormBwdFused2F32 "layer_norm_bwd_fused2_f32",
    LayerNormBwdFused3Bf16 "layer_norm_bwd_fused3_bf16",
    LayerNormBwdFused3F32 "layer_norm_bwd_fused3_f32",
    LayerNormBwdFused4Bf16 "layer_norm_bwd_fused4_bf16",
    LayerNormBwdFused4F32 "layer_norm_bwd_fused4_f32",
    LayerNormBwdWideBf16 "layer_norm_bwd_wide_bf16",
    LayerNormBwdWideF32 "layer_norm_bwd_wide_f32",
    LayerNormFwd "layer_norm_fwd",
    LayerNormFwdMultirow1Bf16 "layer_norm_fwd_multirow1_bf16",
    LayerNormFwdMultirow1F32 "layer_norm_fwd_multirow1_f32",
    LayerNormFwdMultirow2Bf16 "layer_norm_fwd_multirow2_bf16",
    LayerNormFwdMultirow2F32 "layer_norm_fwd_multirow2_f32",
    LayerNormFwdMultirow3Bf16 "layer_norm_fwd_multirow3_bf16",
    LayerNormFwdMultirow3F32 "layer_norm_fwd_multirow3_f32",
    LayerNormFwdMultirow4Bf16 "layer_norm_fwd_multirow4_bf16",
    LayerNormFwdMultirow4F32 "layer_norm_fwd_multirow4_f32",
    LayerNormFwdWideBf16 "layer_norm_fwd_wide_bf16",
    LayerNormFwdWideF32 "layer_norm_fwd_wide_f32",
    NormBwdFusedFinish "norm_bwd_fused_finish",
    NormDwPartial "norm_dw_partial",
    NormDwPartial8 "norm_dw_partial8",
    RmsNormBwdDx "rms_norm_bwd_dx",
    RmsNormBwdFused1Bf16 "rms_norm_bwd_fused1_bf16",
    RmsNormBwdFused1F32 "rms_norm_bwd_fused1_f32",
    RmsNormBwdFused2Bf16 "rms_norm_bwd_fused2_bf16",
    RmsNormBwdFused2F32 "rms_norm_bwd_fused2_f32",
    RmsNormBwdFused3Bf16 "rms_norm_bwd_fused3_bf16",
    RmsNormBwdFused3F32 "rms_norm_bwd_fused3_f32",
    RmsNormBwdFused4Bf16 "rms_norm_bwd_fused4_bf16",
    RmsNormBwdFused4F32 "rms_norm_bwd_fused4_f32",
    RmsNormBwdWideBf16 "rms_norm_bwd_wide_bf16",
    RmsNormBwdWideF32 "rms_norm_bwd_wide_f32",
    RmsNormFwd "rms_norm_fwd",
    RmsNormFwdMultirow1Bf16 "rms_norm_fwd_multirow1_bf16",
    RmsNormFwdMultirow1F32 "rms_norm_fwd_multirow1_f32",
    RmsNormFwdMultirow2Bf16 "rms_norm_fwd_multirow2_bf16",
    RmsNormFwdMultirow2F32 "rms_norm_fwd_multirow2_f32",
    RmsNormFwdMultirow3Bf16 "rms_norm_fwd_multirow3_bf16",
    RmsNormFwdMultirow3F32 "rms_norm_fwd_multirow3_f32",
    RmsNormFwdMultirow4Bf16 "rms_norm_fwd_multirow4_bf16",
    RmsNormFwdMultirow4F32 "rms_norm_fwd_multirow4_f32",
    RmsNormFwdWideBf16 "rms_norm_fwd_wide_bf16",
    RmsNormFwdWideF32 "rms_norm_fwd_wide_f32",
    // kernels/optimizer.cu
    Adamw "adamw",
    Sgd "sgd",
    AdamwMulti "adamw_multi",
    SgdMulti "sgd_multi",
    // kernels/attention.cu
    AttentionFwd "attention_fwd",
    AttentionFwdW8 "attention_fwd_w8",
    AttentionDelta "attention_delta",
    AttentionDeltaW8 "attention_delta_w8",
    AttentionBwdDq "attention_bwd_dq",
    AttentionBwdDqW8 "attention_bwd_dq_w8",
    AttentionBwdDkdv "attention_bwd_dkdv",
    AttentionBwdDkdvW8 "attention_bwd_dkdv_w8",
    // kernels/attention_tc.cu
    AttentionToBf16 "attention_to_bf16",
    AttentionDqOut "attention_dq_out",
    AttentionDkvOut "attention_dkv_out",
    AttentionFwdTcD64 "attention_fwd_tc_d64",
    AttentionFwdTcD128 "attention_fwd_tc_d128",
    AttentionDeltaTcD64 "attention_delta_tc_d64",
    AttentionDeltaTcD128 "attention_delta_tc_d128",
    AttentionBwdTcD64 "attention_bwd_tc_d64",
    AttentionBwdTcD128 "attention_bwd_tc_d128",
    // kernels/attention_wgmma_fwd.cu
    AttentionFwdWgmmaD64 "attention_fwd_wgmma_d64",
    AttentionWgmmaLayoutCheckD64 "attention_wgmma_layout_check_d64",
    AttentionFwdWgmmaD128 "attention_fwd_wgmma_d128",
    AttentionWgmmaLayoutCheckD128 "attention_wgmma_layout_check_d128",
    // kernels/attention_ws_fwd.cu
    AttentionFwdWsD64 "attention_fwd_ws_d64",
    AttentionFwdWsD128 "attention_fwd_ws_d128",
    // kernels/attention_ws_bwd.cu
    AttentionBwdWsD64 "attention_bwd_ws_d64",
    AttentionBwdWsD128 "attention_bwd_ws_d128",
    AttentionBwdWsHeadsD128 "attention_bwd_wsheads_d128",
    // kernels/gemm_ws.cu
    GemmWsKkBf16 "gemm_ws_kk_bf16",
    GemmWsKkGelu "gemm_ws_kk_gelu",
    GemmWsKmBf16 "gemm_ws_km_bf16",
    GemmWsKmDgelu "gemm_ws_km_dgelu",
    GemmWsMmF32 "gemm_ws_mm_f32",
    GemmWsMmF32Db "gemm_ws_mm_f32_db",
    // kernels/cross_entropy.cu
    CrossEntropyRowsF32 "cross_entropy_rows_f32",
    CrossEntropyRowsBf16 "cross_entropy_rows_bf16",
    CrossEntropyStagedF32 "cross_entropy_staged_f32",
    CrossEntropyStagedBf16 "cross_entropy_staged_bf16",
    CrossEntropyLossSum "cross_entropy_loss_sum",
    // kernels/fp8.cu
    Fp8Amax "fp8_amax",
    Fp8AmaxOne "fp8_amax_one",
    Fp8AmaxRows8 "fp8_amax_rows8",
    Fp8AmaxCols8 "fp8_amax_cols8",
    Fp8QuantizeLines "fp8_quantize_lines",
    Fp8QuantizeCols "fp8_quantize_cols",
    Fp8QuantizeDual "fp8_quantize_dual",
    SwigluFwdFp8 "swiglu_fwd_fp8",
    SwigluBwdFp8 "swiglu_bwd_fp8",
    Fp8Scales "fp8_scales",
    Fp8HistoryRoll "fp8_history_roll",
    Fp8HistoryRolls "fp8_history_rolls",
    // kernels/fp8_gemm.cu
    Fp8GemmE4e4Lines "fp8_gemm_e4e4_lines",
    Fp8GemmE4e5Lines "fp8_gemm_e4e5_lines",
    Fp8GemmE5e4Lines "fp8_gemm_e5e4_lines",
    Fp8GemmE5e5Lines "fp8_gemm_e5e5_lines",
    Fp8GemmE4e4Blocks "fp8_gemm_e4e4_blocks",
    Fp8GemmE4e5Blocks "fp8_gemm_e4e5_blocks",
    Fp8GemmE5e4Blocks "fp8_gemm_e5e4_blocks",
    Fp8GemmE5e5Blocks "fp8_gemm_e5e5_blocks",
    Fp8GemmE4e4Wide "fp8_gemm_e4e4_wide",
    Fp8GemmE4e5Wide "fp8_gemm_e4e5_wide",
    Fp8GemmE5e4Wide "fp8_gemm_e5e4_wide",
    Fp8GemmE5e5Wide "fp8_gemm_e5e5_wide",
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.symbol())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The function names after each `extern "C" __global__` of `text` (skipping the return
    /// type and `__launch_bounds__(…)`); a macro body's names keep their `##` pastes.
    fn globals_in(text: &str) -> Vec<String> {
        text.split("extern \"C\" __global__")
            .skip(1)
            .map(|rest| {
                let rest = rest.trim_start();
                let rest = rest.strip_prefix("void").unwrap_or(rest).trim_start();
                let rest = match rest.strip_prefix("__launch_bounds__") {
                    Some(bounds) => bounds[bounds.find(')').map_or(0, |i| i + 1)..].trim_start(),
                    None => rest,
                };
                rest.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '#')
                    .collect()
            })
            .collect()
    }

    /// The `__global__` functions `source` defines, with each instance `M(args)` (on a line
    /// of its own) of a `#define M(params)` that defines some expanded.
    fn global_functions(source: &str) -> Vec<String> {
        let joined = source.replace("\\\n", " ");
        let mut macros: Vec<(&str, Vec<&str>, Vec<String>)> = Vec::new();
        let mut names = Vec::new();
        for line in joined.lines() {
            let trimmed = line.trim();
            if let Some(definition) = trimmed.strip_prefix("#define ") {
                let head = definition.split_once(')').and_then(|(h, body)| {
                    let (name, params) = h.split_once('(')?;
                    Some((name.trim(), params, globals_in(body)))
                });
                if let Some((name, params, templates)) = head.filter(|h| !h.2.is_empty()) {
                    macros.push((name, params.split(',').map(str::trim).collect(), templates));
                }
                continue;
            }
            names.extend(globals_in(line));
            let call = trimmed.strip_suffix(')').and_then(|t| t.split_once('('));
            let Some((name, args)) = call else { continue };
            let Some((_, params, templates)) = macros.iter().find(|m| m.0 == name.trim()) else {
                continue;
            };
            let args: Vec<&str> = args.split(',').map(str::trim).collect();
            for template in templates {
                let paste = |piece: &str| match params.iter().position(|p| *p == piece) {
                    Some(i) => args[i].to_string(),
                    None => piece.to_string(),
                };
                names.push(template.split("##").map(paste).collect());
            }
        }
        names
    }

    #[test]
    fn every_kernel_is_a_global_function_of_the_sources_and_back() {
        let defined: Vec<String> = SOURCES.iter().flat_map(|s| global_functions(s)).collect();
        let symbols: Vec<&str> = Kernel::ALL.iter().map(|k| k.symbol()).collect();
        for symbol in &symbols {
            assert!(
                defined.iter().any(|d| d == symbol),
                "Kernel `{symbol}` is not a __global__ function of kernels/*.cu"
            );
        }
        for name in &defined {
            assert!(
                symbols.contains(&name.as_str()),
                "__global__ `{name}` of kernels/*.cu has no Kernel (add it to the table)"
            );
        }
        let mut unique = defined.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), defined.len(), "a __global__ is defined twice");
        assert_eq!(symbols.len(), defined.len(), "a Kernel is listed twice");
        // The parser sees the macro instances (e.g. the norm variants' 40 entry points).
        assert!(defined.len() >= 100, "found only {}", defined.len());
    }

    #[test]
    fn kernels_index_their_table() {
        for (i, k) in Kernel::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i);
        }
    }
}
