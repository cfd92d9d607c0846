//! Kernel variants: which implementation of an op a CUDA backend runs, where a new kernel waits
//! to be measured against the one it may replace (docs/decisions.md, "GPU kernels land
//! behind a variant until a GPU chose them"). Each op with variants has a typed choice (an
//! enum, e.g. [`GemmKernel`]) and one environment variable, `PARC_<OP>_KERNEL`, read once when
//! the backend is made; tests set a variant on a backend directly
//! (`CudaBackend::set_kernel_variant`). The first variant of an op is its default. Once a
//! device call has measured them, the winner becomes the only implementation and its entry
//! here goes.
use crate::error::{Result, RuntimeError};

/// An op's kernel choice: its name, its environment variable and its variants' names.
pub trait Variant: Copy + Sized + 'static {
    /// The op's name (`gemm`, `attention_fwd`, …).
    const OP: &'static str;
    /// `PARC_<OP>_KERNEL`.
    const ENV: &'static str;
    /// Every variant, the default first.
    const ALL: &'static [Self];

    /// The variant's name, as the environment variable spells it.
    fn name(self) -> &'static str;

    /// The variant named `name`, or an error that lists the choices.
    fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|v| v.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|v| v.name()).collect();
                RuntimeError::Unsupported(format!(
                    "`{name}` is not a kernel variant of {}; choose one of: {}",
                    Self::OP,
                    names.join(", ")
                ))
            })
    }

    /// `op (ENV): a|b|c`, for errors and docs.
    fn describe() -> String {
        let names: Vec<&str> = Self::ALL.iter().map(|v| v.name()).collect();
        format!("{} ({}): {}", Self::OP, Self::ENV, names.join("|"))
    }
}

macro_rules! variants {
    ($(
        $(#[$doc:meta])*
        $field:ident: $choice:ident $op:literal $env:literal { $($variant:ident $name:literal),+ }
    )*) => {
        $(
            $(#[$doc])*
            #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
            pub enum $choice {
                $($variant,)+
            }

            impl Variant for $choice {
                const OP: &'static str = $op;
                const ENV: &'static str = $env;
                const ALL: &'static [Self] = &[$($choice::$variant,)+];

                fn name(self) -> &'static str {
                    match self {
                        $($choice::$variant => $name,)+
                    }
                }
            }

            impl From<$choice> for KernelVariant {
                fn from(v: $choice) -> KernelVariant {
                    KernelVariant::$choice(v)
                }
            }
        )*

        /// One op's chosen variant, as `CudaBackend::set_kernel_variant` takes it (`From` each
        /// op's enum).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum KernelVariant {
            $($choice($choice),)*
        }

        impl KernelVariant {
            /// Variant `name` of op `op` (the names `PARC_<OP>_KERNEL` takes): an unknown op or
            /// name is an error listing the choices.
            pub fn parse(op: &str, name: &str) -> Result<KernelVariant> {
                match op {
                    $($op => Ok($choice::parse(name)?.into()),)*
                    _ => Err(unknown_op(op)),
                }
            }

            /// The op's name.
            pub fn op(self) -> &'static str {
                match self {
                    $(KernelVariant::$choice(_) => $op,)*
                }
            }

            /// The variant's name.
            pub fn name(self) -> &'static str {
                match self {
                    $(KernelVariant::$choice(v) => v.name(),)*
                }
            }
        }

        /// The variant chosen for each op that has variants.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct KernelVariants {
            $(pub $field: $choice,)*
        }

        impl Default for KernelVariants {
            fn default() -> Self {
                KernelVariants {
                    $($field: $choice::ALL[0],)*
                }
            }
        }

        impl KernelVariants {
            /// Run `variant` from now on.
            pub fn set(&mut self, variant: KernelVariant) {
                match variant {
                    $(KernelVariant::$choice(v) => self.$field = v,)*
                }
            }

            /// The defaults, overridden by each `PARC_<OP>_KERNEL` that is set (and not
            /// empty), in the order the ops are listed. A name that is not one of the op's
            /// variants is an error that lists them.
            pub fn from_env() -> Result<KernelVariants> {
                let mut v = KernelVariants::default();
                $(v.$field = from_env::<$choice>()?.unwrap_or(v.$field);)*
                Ok(v)
            }

            /// Every op's variants as `op (ENV): a|b|c` lines (the default first).
            pub fn describe() -> Vec<String> {
                vec![$($choice::describe(),)*]
            }
        }
    };
}

variants! {
    /// 16-bit GEMMs on a Hopper (`gemm`, PARC_GEMM_KERNEL): parc's warp-specialized kernel
    /// (gemm_ws.cu) timed against cuBLASLt's fastest algorithm on each GEMM's first run, the
    /// faster then kept (`auto`), parc's kernel wherever it takes the GEMM (`ws`, for the
    /// tests), or cuBLASLt alone (`cublaslt`).
    gemm: GemmKernel "gemm" "PARC_GEMM_KERNEL" {
        Auto "auto", Ws "ws", CuBlasLt "cublaslt"
    }
    /// bf16 attention forward on a Hopper (`attention_fwd`, PARC_ATTENTION_FWD_KERNEL): the
    /// warp-specialized, TMA-fed kernel for head_dim 64 and 128 (attention_ws_fwd.cu), or
    /// attention_wgmma_fwd.cu's warpgroup-MMA kernel for both (`wgmma`), or attention_tc.cu's
    /// mma.sync kernel (`fa2`, what other GPUs run).
    attention_fwd: AttentionFwdKernel "attention_fwd" "PARC_ATTENTION_FWD_KERNEL" {
        Ws "ws", Wgmma "wgmma", Fa2 "fa2"
    }
    /// The bf16 attention backward (`attention_bwd`, PARC_ATTENTION_BWD_KERNEL):
    /// attention_ws_bwd.cu's warp-specialized, TMA-fed kernel (Hopper, head_dim 64 and 128,
    /// tensor maps the driver can encode; otherwise `fa2`), or attention_tc.cu's mma.sync
    /// kernel (`fa2`).
    attention_bwd: AttentionBwdKernel "attention_bwd" "PARC_ATTENTION_BWD_KERNEL" {
        Ws "ws", Fa2 "fa2"
    }
    /// The fused cross-entropy (`cross_entropy`, PARC_CROSS_ENTROPY_KERNEL): persistent CTAs
    /// that stage each row in shared memory (`staged`; `rows` where a row does not fit or the
    /// logits are unaligned), or a block per row with two passes over it in global memory
    /// (`rows`).
    cross_entropy: CrossEntropyKernel "cross_entropy" "PARC_CROSS_ENTROPY_KERNEL" {
        Staged "staged", Rows "rows"
    }
    /// LayerNorm/RMSNorm forwards (`norm_fwd`, PARC_NORM_FWD_KERNEL): two rows per warp
    /// (`multirow`; `warp` for rows wider than 8192, not a multiple of 8, or unaligned), or one
    /// row per warp (`warp`).
    norm_fwd: NormFwdKernel "norm_fwd" "PARC_NORM_FWD_KERNEL" {
        Multirow "multirow", Warp "warp"
    }
    /// LayerNorm/RMSNorm backwards (`norm_bwd`, PARC_NORM_BWD_KERNEL): dx and the dw/db column
    /// partials in one pass over dy and x (`fused`; `warp` where the forward's conditions or
    /// one dtype for dy, x, dx do not hold), or dx, then the partials in two more passes
    /// (`warp`).
    norm_bwd: NormBwdKernel "norm_bwd" "PARC_NORM_BWD_KERNEL" {
        Fused "fused", Warp "warp"
    }
    /// How cuBLASLt accumulates FP8 GEMMs (`fp8_accum`, PARC_FP8_ACCUM_KERNEL): the forward
    /// GEMMs in the tensor cores' own accumulator, the gradients' promoted into fp32 every few
    /// K steps (`forward`, as Transformer Engine and torchao do: Llama 3.2 1B 1.01× `split` on
    /// an H100), or every GEMM promoted (`split`). `CUBLASLT_MATMUL_DESC_FAST_ACCUM`.
    fp8_accum: Fp8AccumKernel "fp8_accum" "PARC_FP8_ACCUM_KERNEL" {
        Forward "forward", Split "split"
    }
    /// The amaxes of FP8 scale groups smaller than an operand (`fp8_amax`,
    /// PARC_FP8_AMAX_KERNEL): a block reducing one group at a time with scalar loads
    /// (`groups`, kernels/fp8.cu's `fp8_amax`), or each thread reading one 8-vector column
    /// slot down a run of rows and the lanes of a group adding one atomic (`vectors`:
    /// `fp8_amax_rows8` where groups hold whole 8-vectors of a row, `fp8_amax_cols8` where
    /// they are single columns; `groups` for any other shape or an unaligned operand).
    fp8_amax: Fp8AmaxKernel "fp8_amax" "PARC_FP8_AMAX_KERNEL" {
        Groups "groups", Vectors "vectors"
    }
    /// parc's FP8 GEMM kernels (`fp8_gemm`, PARC_FP8_GEMM_KERNEL): blockwise folds load the
    /// factor of each of a thread's 32 columns per K group, rowwise runs 128 × 128 tiles
    /// (`columns`); blockwise folds load one factor per tile where the columns' factors are
    /// 128 × 128 squares, whose block spans the whole 128-column tile (`tiles`: the weight of
    /// forward and data-gradient GEMMs; the same products, so the same results); or `tiles`
    /// with rowwise in 128 × 256 tiles, gemm_ws.cu's shape (`wide`).
    fp8_gemm: Fp8GemmKernel "fp8_gemm" "PARC_FP8_GEMM_KERNEL" {
        Columns "columns", Tiles "tiles", Wide "wide"
    }
    /// Where a quantized tensorwise GEMM (delayed scaling) finds its operands' dequantization
    /// factors (`fp8_factors`, PARC_FP8_FACTORS_KERNEL): an `fp8_scales` launch per operand
    /// per GEMM (`per_gemm`), or, where a run of rolls wrote the scale amax at the last step's
    /// end and nothing wrote it since, the factors that run's launch wrote beside it
    /// (`rolled`, `fp8_roll.rs`; the same arithmetic, so the same factors).
    fp8_factors: Fp8FactorsKernel "fp8_factors" "PARC_FP8_FACTORS_KERNEL" {
        PerGemm "per_gemm", Rolled "rolled"
    }
    /// Whether a fused SwiGLU-and-FP8 pass (`swiglu_fp8.rs`) stores the epilogue's outputs
    /// (`swiglu_fp8_store`, PARC_SWIGLU_FP8_STORE_KERNEL): always (`always`), or only where a
    /// reader needs them (`needed`): an output read, besides its run, only by delayed-scaling
    /// GEMMs that run quantized this step (`ir::swiglu_runs::quantized_readers`) is left
    /// unstored, as no reader loads it.
    swiglu_fp8_store: SwigluFp8StoreKernel "swiglu_fp8_store" "PARC_SWIGLU_FP8_STORE_KERNEL" {
        Always "always", Needed "needed"
    }
}

impl std::fmt::Display for KernelVariant {
    /// `op=name`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.op(), self.name())
    }
}

/// The variant `V::ENV` names, if it is set and not empty.
fn from_env<V: Variant>() -> Result<Option<V>> {
    match std::env::var(V::ENV) {
        Ok(name) if !name.is_empty() => V::parse(&name)
            .map(Some)
            .map_err(|e| RuntimeError::Unsupported(format!("{}={name}: {e}", V::ENV))),
        _ => Ok(None),
    }
}

fn unknown_op(op: &str) -> RuntimeError {
    let ops = KernelVariants::describe();
    RuntimeError::Unsupported(format!(
        "no op `{op}` has kernel variants; ops with variants: {}",
        if ops.is_empty() {
            "none".to_string()
        } else {
            ops.join("; ")
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each op's (name, env, variant names) and its default, through the typed API.
    fn ops() -> Vec<(&'static str, &'static str, Vec<&'static str>)> {
        fn of<V: Variant>() -> (&'static str, &'static str, Vec<&'static str>) {
            (V::OP, V::ENV, V::ALL.iter().map(|v| v.name()).collect())
        }
        vec![
            of::<GemmKernel>(),
            of::<AttentionFwdKernel>(),
            of::<AttentionBwdKernel>(),
            of::<CrossEntropyKernel>(),
            of::<NormFwdKernel>(),
            of::<NormBwdKernel>(),
            of::<Fp8AccumKernel>(),
            of::<Fp8AmaxKernel>(),
            of::<Fp8GemmKernel>(),
            of::<Fp8FactorsKernel>(),
            of::<SwigluFp8StoreKernel>(),
        ]
    }

    #[test]
    fn unknown_ops_and_names_are_errors_that_list_the_choices() {
        let e = KernelVariant::parse("no_such_op", "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no op `no_such_op`"), "{e}");
        let mut chosen = KernelVariants::default();
        for (op, _, names) in ops() {
            let e = KernelVariant::parse(op, "no_such_kernel")
                .unwrap_err()
                .to_string();
            assert!(e.contains(names[0]) && e.contains(op), "{e}");
            for name in &names {
                let v = KernelVariant::parse(op, name).unwrap();
                assert_eq!((v.op(), v.name()), (op, *name));
                assert_eq!(v.to_string(), format!("{op}={name}"));
                chosen.set(v);
            }
        }
        assert_eq!(chosen.gemm, GemmKernel::CuBlasLt);
        assert_eq!(chosen.norm_bwd, NormBwdKernel::Warp);
        assert_eq!(chosen.fp8_accum, Fp8AccumKernel::Split);
        assert_eq!(chosen.fp8_amax, Fp8AmaxKernel::Vectors);
        assert_eq!(chosen.fp8_gemm, Fp8GemmKernel::Wide);
        assert_eq!(chosen.fp8_factors, Fp8FactorsKernel::Rolled);
        assert_eq!(chosen.swiglu_fp8_store, SwigluFp8StoreKernel::Needed);
    }

    #[test]
    fn the_first_variant_is_the_default() {
        let d = KernelVariants::default();
        assert_eq!(d.gemm, GemmKernel::Auto);
        assert_eq!(d.attention_fwd, AttentionFwdKernel::Ws);
        assert_eq!(d.attention_bwd, AttentionBwdKernel::Ws);
        assert_eq!(d.cross_entropy, CrossEntropyKernel::Staged);
        assert_eq!(d.norm_fwd, NormFwdKernel::Multirow);
        assert_eq!(d.norm_bwd, NormBwdKernel::Fused);
        assert_eq!(d.fp8_accum, Fp8AccumKernel::Forward);
        assert_eq!(d.fp8_amax, Fp8AmaxKernel::Groups);
        assert_eq!(d.fp8_gemm, Fp8GemmKernel::Columns);
        assert_eq!(d.fp8_factors, Fp8FactorsKernel::PerGemm);
        assert_eq!(d.swiglu_fp8_store, SwigluFp8StoreKernel::Always);
    }

    #[test]
    fn names_are_unique_per_op_and_env_names_follow_the_op() {
        for (op, env, names) in ops() {
            let mut unique = names.clone();
            unique.sort_unstable();
            unique.dedup();
            assert_eq!(unique.len(), names.len(), "{op}");
            assert!(names.len() >= 2, "{op}: a variant needs a rival");
            assert_eq!(env, format!("PARC_{}_KERNEL", op.to_uppercase()), "{op}");
        }
        assert_eq!(
            ops().len(),
            KernelVariants::describe().len(),
            "one line per op"
        );
    }
}
