//! What the CUDA backend's kernels take, known without CUDA: the limits that its host code
//! enforces at launch and that `parc check`, `parc plan --search` and `parc run` read for a GPU
//! plan before any rank starts (`src/cuda_support.rs`), so that a plan the kernels refuse is
//! said to be refused where it is checked, not at its first attention op.
use parc_compiler::ir::op::AttentionAttrs;

/// The largest head the attention kernels take (each lane of the fp32 kernels holds at most 8
/// columns; the tensor-core kernels exist for 64 and 128).
pub const ATTENTION_MAX_HEAD_DIM: u64 = 256;
/// The most (batch, head) pairs an attention launch covers: its grid's y extent.
pub const ATTENTION_MAX_BATCH_HEADS: u64 = 65_535;

/// Why the CUDA attention kernels cannot run an attention of `a` (per rank: its heads after
/// tensor parallelism, its microbatch), or None.
pub fn attention_refusal(a: &AttentionAttrs) -> Option<String> {
    if a.head_dim > ATTENTION_MAX_HEAD_DIM {
        return Some(format!(
            "head_dim = {} is above {ATTENTION_MAX_HEAD_DIM}, the largest head the CUDA attention \
             kernels take (64 and 128 run on tensor cores, other heads on the fp32 kernels): \
             train it with `--backend cpu`, or give the model heads of at most \
             {ATTENTION_MAX_HEAD_DIM}",
            a.head_dim
        ));
    }
    if a.batch * a.heads > ATTENTION_MAX_BATCH_HEADS {
        return Some(format!(
            "a micro batch of {} sequences × {} heads a rank is {} (batch, head) pairs, above \
             {ATTENTION_MAX_BATCH_HEADS}, the most one CUDA attention launch covers: use a \
             smaller micro batch or more tensor parallelism",
            a.batch,
            a.heads,
            a.batch * a.heads
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(batch: u64, heads: u64, head_dim: u64) -> AttentionAttrs {
        AttentionAttrs {
            batch,
            heads,
            kv_heads: heads,
            head_dim,
            causal: true,
            scale: 1.0,
            q_positions: Vec::new(),
            kv_positions: Vec::new(),
            packed: false,
        }
    }

    #[test]
    fn heads_above_256_and_launches_above_the_grid_are_refused() {
        assert_eq!(attention_refusal(&attrs(8, 32, 128)), None);
        assert_eq!(attention_refusal(&attrs(8, 32, 96)), None);
        assert_eq!(attention_refusal(&attrs(8, 16, 256)), None);
        let wide = attention_refusal(&attrs(8, 16, 512)).unwrap_or_default();
        assert!(wide.contains("head_dim = 512"), "{wide}");
        assert_eq!(attention_refusal(&attrs(1, 65_535, 64)), None);
        let wide = attention_refusal(&attrs(1024, 64, 64)).unwrap_or_default();
        assert!(wide.contains("65536 (batch, head) pairs"), "{wide}");
    }
}
