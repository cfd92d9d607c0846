//! Kernel variants: which implementation of an op a CUDA backend runs, where a new kernel waits
//! to be measured against the one it may replace (docs/architecture.md, "GPU kernels land
//! behind a variant until a GPU chose them"). Each op with variants has one environment
//! variable, `PARC_<OP>_KERNEL`, read once when the backend is made; tests set a variant on a
//! backend directly. The first name of an op's list is its default. Once a device call has
//! measured them, the winner becomes the only implementation and its entry here goes.
use crate::error::{Result, RuntimeError};

/// An op with variants: its environment variable and its variants' names, the default first.
struct Choice {
    op: &'static str,
    env: &'static str,
    names: &'static [&'static str],
}

/// Every op that has more than one implementation now.
const CHOICES: &[Choice] = &[
    // A 16-bit run's bias gradient: cuBLASLt's BGRADB epilogue on the backward-weight GEMM
    // (plus a k = 1 GEMM where db accumulates), or the GEMM alone and the column-sum kernels
    // over dy (`dispatch::col_sum_into`, what fp32 runs use).
    Choice {
        op: "bias_grad",
        env: "PARC_BIAS_GRAD_KERNEL",
        names: &["epilogue", "colsum"],
    },
    // bf16 attention forward, head_dim 64 / 128: attention_tc.cu's mma.sync kernel, or the
    // Hopper warpgroup-MMA one (attention_wgmma_fwd.cu; Hopper GPUs only).
    Choice {
        op: "attention_fwd",
        env: "PARC_ATTENTION_FWD_KERNEL",
        names: &["fa2", "wgmma"],
    },
    // The fused AdamW launch (cuda/optimizer.rs): one block per chunk (`adamw_multi`), or a
    // grid sized to the GPU striding over the chunks with 4 float4s per operand in flight per
    // thread (`adamw_multi_persistent`). SGD runs `sgd_multi` under both.
    Choice {
        op: "optimizer",
        env: "PARC_OPTIMIZER_KERNEL",
        names: &["chunked", "persistent"],
    },
    // The fused SumSquares run (cuda/sum_squares.rs): two launches (`sum_squares_partial_multi`,
    // then one block of `sum_partials_into_multi`), or one (`sum_squares_one_pass`: grouped
    // virtual blocks, the last block of each tensor and of the run finishing the sums).
    Choice {
        op: "sum_squares",
        env: "PARC_SUM_SQUARES_KERNEL",
        names: &["two_pass", "one_pass"],
    },
    // The attention backward (bf16 runs, head_dim 64): attention_tc.cu's mma.sync kernel, or
    // attention_wgmma_bwd.cu's warpgroup-MMA one (Hopper only).
    Choice {
        op: "attention_bwd",
        env: "PARC_ATTENTION_BWD_KERNEL",
        names: &["fa2", "wgmma"],
    },
    // `rows`: a block per row, two passes over the row in global memory; `staged`: persistent
    // CTAs that stage each row in shared memory (cross_entropy.rs); `staged_fast`: `staged`
    // in fewer instructions (ex2.approx exponentials, a shuffle-only merge).
    Choice {
        op: "cross_entropy",
        env: "PARC_CROSS_ENTROPY_KERNEL",
        names: &["rows", "staged", "staged_fast"],
    },
    // LayerNorm/RMSNorm forwards: one row per warp, or two (`norm_variants`).
    Choice {
        op: "norm_fwd",
        env: "PARC_NORM_FWD_KERNEL",
        names: &["warp", "multirow"],
    },
    // LayerNorm/RMSNorm backwards: dx, then the dw/db column partials in two more passes, or
    // all in one pass (`norm_variants`).
    Choice {
        op: "norm_bwd",
        env: "PARC_NORM_BWD_KERNEL",
        names: &["warp", "fused"],
    },
];

/// The variant chosen for each op of [`CHOICES`] (an index into its `names`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelVariants {
    chosen: Vec<usize>,
}

impl Default for KernelVariants {
    fn default() -> Self {
        KernelVariants {
            chosen: vec![0; CHOICES.len()],
        }
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

impl KernelVariants {
    /// The defaults, overridden by each `PARC_<OP>_KERNEL` that is set (and not empty). A name
    /// that is not one of the op's variants is an error that lists them.
    pub fn from_env() -> Result<KernelVariants> {
        let mut v = KernelVariants::default();
        for c in CHOICES {
            if let Ok(name) = std::env::var(c.env) {
                if !name.is_empty() {
                    v.set(c.op, &name)
                        .map_err(|e| RuntimeError::Unsupported(format!("{}={name}: {e}", c.env)))?;
                }
            }
        }
        Ok(v)
    }

    /// Choose variant `name` of `op`.
    pub fn set(&mut self, op: &str, name: &str) -> Result<()> {
        let i = CHOICES
            .iter()
            .position(|c| c.op == op)
            .ok_or_else(|| unknown_op(op))?;
        let c = &CHOICES[i];
        let n = c.names.iter().position(|&x| x == name).ok_or_else(|| {
            RuntimeError::Unsupported(format!(
                "`{name}` is not a kernel variant of {op}; choose one of: {}",
                c.names.join(", ")
            ))
        })?;
        self.chosen[i] = n;
        Ok(())
    }

    /// The name of the variant chosen for `op` (the op must be in the table: a caller asks
    /// for its own op by a literal; an unknown one reads as the empty name and so matches
    /// none of its variants).
    pub fn chosen(&self, op: &str) -> &'static str {
        CHOICES
            .iter()
            .zip(&self.chosen)
            .find(|(c, _)| c.op == op)
            .map_or("", |(c, &n)| c.names[n])
    }

    /// Whether `op` runs variant `name`.
    pub fn is(&self, op: &str, name: &str) -> bool {
        self.chosen(op) == name
    }

    /// Every op's variants as `op: a|b|c` lines (the environment variable, the names, the
    /// default first), for errors and docs.
    pub fn describe() -> Vec<String> {
        CHOICES
            .iter()
            .map(|c| format!("{} ({}): {}", c.op, c.env, c.names.join("|")))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_ops_and_names_are_errors_that_list_the_choices() {
        let mut v = KernelVariants::default();
        let e = v.set("no_such_op", "x").unwrap_err().to_string();
        assert!(e.contains("no op `no_such_op`"), "{e}");
        for c in CHOICES {
            assert_eq!(v.chosen(c.op), c.names[0], "the first name is the default");
            let e = v.set(c.op, "no_such_kernel").unwrap_err().to_string();
            assert!(e.contains(c.names[0]), "{e}");
            for name in c.names {
                v.set(c.op, name).unwrap();
                assert!(v.is(c.op, name));
            }
        }
    }

    #[test]
    fn names_are_unique_per_op_and_env_names_follow_the_op() {
        for c in CHOICES {
            let mut names = c.names.to_vec();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), c.names.len(), "{}", c.op);
            assert!(c.names.len() >= 2, "{}: a variant needs a rival", c.op);
            assert_eq!(
                c.env,
                format!("PARC_{}_KERNEL", c.op.to_uppercase()),
                "{}",
                c.op
            );
        }
        assert_eq!(
            CHOICES.len(),
            KernelVariants::describe().len(),
            "one line per op"
        );
    }
}
