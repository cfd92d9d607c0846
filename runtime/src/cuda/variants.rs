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

/// Every op that has more than one implementation now. The measured kernel is first (the
/// default); a name after it is a kernel the default falls back to where its own conditions do
/// not hold, kept selectable so the device tests can run it on a GPU where the default would
/// not fall back (e.g. the mma.sync attention on a Hopper, which other GPUs run).
const CHOICES: &[Choice] = &[
    // 16-bit GEMMs on a Hopper: parc's warp-specialized kernel (gemm_ws.cu) timed against
    // cuBLASLt's fastest algorithm on each GEMM's first run, the faster then kept (`auto`),
    // parc's kernel wherever it takes the GEMM (`ws`, for the tests), or cuBLASLt alone
    // (`cublaslt`).
    Choice {
        op: "gemm",
        env: "PARC_GEMM_KERNEL",
        names: &["auto", "ws", "cublaslt"],
    },
    // bf16 attention forward on a Hopper: the warp-specialized, TMA-fed kernel for head_dim 64
    // (attention_ws_fwd.cu; the warpgroup-MMA one for 128), or attention_wgmma_fwd.cu's
    // warpgroup-MMA kernel for both (`wgmma`), or attention_tc.cu's mma.sync kernel (`fa2`,
    // what other GPUs run).
    Choice {
        op: "attention_fwd",
        env: "PARC_ATTENTION_FWD_KERNEL",
        names: &["ws", "wgmma", "fa2"],
    },
    // The bf16 attention backward: attention_ws_bwd.cu's warp-specialized, TMA-fed kernel
    // (Hopper, head_dim 64, tensor maps the driver can encode; otherwise `fa2`), or
    // attention_tc.cu's mma.sync kernel (`fa2`).
    Choice {
        op: "attention_bwd",
        env: "PARC_ATTENTION_BWD_KERNEL",
        names: &["ws", "fa2"],
    },
    // The fused cross-entropy: persistent CTAs that stage each row in shared memory (`staged`;
    // `rows` where a row does not fit or the logits are unaligned), or a block per row with
    // two passes over it in global memory (`rows`).
    Choice {
        op: "cross_entropy",
        env: "PARC_CROSS_ENTROPY_KERNEL",
        names: &["staged", "rows"],
    },
    // LayerNorm/RMSNorm forwards: two rows per warp (`multirow`; `warp` for rows wider than
    // 1024, not a multiple of 8, or unaligned), or one row per warp (`norm_variants`).
    Choice {
        op: "norm_fwd",
        env: "PARC_NORM_FWD_KERNEL",
        names: &["multirow", "warp"],
    },
    // LayerNorm/RMSNorm backwards: dx and the dw/db column partials in one pass over dy and x
    // (`fused`; `warp` where the forward's conditions or one dtype for dy, x, dx do not hold),
    // or dx, then the partials in two more passes (`warp`).
    Choice {
        op: "norm_bwd",
        env: "PARC_NORM_BWD_KERNEL",
        names: &["fused", "warp"],
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
