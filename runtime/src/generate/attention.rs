//! One attention layer with its KV cache: the keys and values (after RoPE) of every position
//! fed so far, `[seq, kv_heads·head_dim]` each, zeroed when a sample starts.
//!
//! New tokens at positions `[start, start + n)` run the training forward's ops with those
//! positions: the fused q/k/v projection, the split, the per-head q/k norms (`qk_norm`), RoPE
//! on q and k, then their k and v rows are
//! copied into the cache at `start` and `Op::Attention` reads q against the whole cache
//! (`kv_positions = [0, seq)`): causal masking by global position hides the rows not written
//! yet, so no key is read twice and no buffer grows. Only causal attention can be cached this
//! way (a non-causal layer's earlier outputs depend on later tokens): [`Cache::new`] refuses
//! the others.
use super::device::{Device, Tensor};
use super::weights::Weights;
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::{AttentionAttrs, Op, RopeAttrs, Segment};
use parc_compiler::ir::{BufferId, DType};
use parc_compiler::spec::{attention_scale, LayerKind, Node, NodeId, Rope};

/// The sizes of an attention layer.
#[derive(Clone, Copy, Debug)]
struct Heads {
    dim: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    rope: Option<Rope>,
    /// Biases on q, k, v (`bqkv`) and on the output projection (`bo`).
    qkv_bias: bool,
    out_bias: bool,
    /// Each head of q and k RMS-normalized with this epsilon (`q_norm`, `k_norm`).
    qk_norm: Option<f64>,
    /// The factor q·k is multiplied by (`spec::attention_scale`).
    scale: f64,
}

impl Heads {
    fn q_cols(&self) -> u64 {
        self.heads * self.head_dim
    }
    fn kv_cols(&self) -> u64 {
        self.kv_heads * self.head_dim
    }
}

/// An attention layer's cache and sizes.
pub(super) struct Cache {
    node: NodeId,
    heads: Heads,
    seq: u64,
    k: BufferId,
    v: BufferId,
}

impl Cache {
    /// The cache of attention node `node` (`id`) for `seq` positions; None for other kinds.
    pub fn new<B: Backend>(
        device: &mut Device<B>,
        id: NodeId,
        node: &Node,
        seq: u64,
    ) -> Result<Option<Cache>> {
        let LayerKind::Attention {
            dim,
            heads,
            kv_heads,
            head_dim,
            causal,
            rope,
            qkv_bias,
            out_bias,
            qk_norm,
            scale,
        } = node.kind
        else {
            return Ok(None);
        };
        if !causal {
            return Err(RuntimeError::Unsupported(format!(
                "attention `{}` is not causal: its outputs at earlier positions depend on later \
                 tokens, so the model cannot generate text one token at a time",
                node.name
            )));
        }
        let heads = Heads {
            dim,
            heads,
            kv_heads,
            head_dim,
            rope,
            qkv_bias,
            out_bias,
            qk_norm,
            scale: attention_scale(head_dim, scale),
        };
        let k = device.alloc(&[seq, heads.kv_cols()], DType::F32)?;
        let v = device.alloc(&[seq, heads.kv_cols()], DType::F32)?;
        Ok(Some(Cache {
            node: id,
            heads,
            seq,
            k,
            v,
        }))
    }

    /// Forget every cached position.
    pub fn clear<B: Backend>(&self, device: &mut Device<B>) -> Result<()> {
        device.run(&Op::Zero, &[], &[self.k])?;
        device.run(&Op::Zero, &[], &[self.v])
    }

    /// The layer's output for `x` (`[n, dim]`, the tokens at `at`), their k and v cached.
    pub fn forward<B: Backend>(
        &self,
        device: &mut Device<B>,
        weights: &Weights,
        x: Tensor,
        at: Segment,
    ) -> Result<Tensor> {
        let h = self.heads;
        let qkv_cols = h.q_cols() + 2 * h.kv_cols();
        let qkv = weights.linear(
            device,
            self.node,
            x,
            ("wqkv", h.qkv_bias.then_some("bqkv")),
            qkv_cols,
        )?;
        let [q, k, v] = self.split(device, weights, qkv, at)?;
        for (part, cache) in [(k, self.k), (v, self.v)] {
            let op = Op::CopyRange {
                src_offset: 0,
                dst_offset: u64::from(at.start) * h.kv_cols(),
                len: part.rows * h.kv_cols(),
            };
            device.run(&op, &[part.buf], &[cache])?;
            device.free(part.buf)?;
        }
        let o = device.tensor(q.rows, h.q_cols())?;
        let lse = device.alloc(&[1, h.heads, q.rows], DType::F32)?;
        let op = Op::Attention(AttentionAttrs {
            batch: 1,
            heads: h.heads,
            kv_heads: h.kv_heads,
            head_dim: h.head_dim,
            causal: true,
            scale: h.scale,
            q_positions: vec![at],
            kv_positions: vec![Segment {
                start: 0,
                len: self.seq as u32,
            }],
            packed: false,
        });
        device.run(&op, &[q.buf, self.k, self.v], &[o.buf, lse])?;
        device.free(lse)?;
        device.free(q.buf)?;
        let y = weights.linear(
            device,
            self.node,
            o,
            ("wo", h.out_bias.then_some("bo")),
            h.dim,
        )?;
        device.free(o.buf)?;
        Ok(y)
    }

    /// The projection (consumed) split into q, k and v, q and k normalized per head under
    /// qk_norm and rotated under RoPE.
    fn split<B: Backend>(
        &self,
        device: &mut Device<B>,
        weights: &Weights,
        qkv: Tensor,
        at: Segment,
    ) -> Result<[Tensor; 3]> {
        let h = self.heads;
        let (rows, widths) = (qkv.rows, [h.q_cols(), h.kv_cols(), h.kv_cols()]);
        let [q, k, v] = [
            device.tensor(rows, widths[0])?,
            device.tensor(rows, widths[1])?,
            device.tensor(rows, widths[2])?,
        ];
        let op = Op::SplitColumns {
            widths: widths.to_vec(),
        };
        device.run(&op, &[qkv.buf], &[q.buf, k.buf, v.buf])?;
        device.free(qkv.buf)?;
        let (q, k) = match h.qk_norm {
            Some(eps) => (
                self.head_norm(device, weights, q, "q_norm", eps)?,
                self.head_norm(device, weights, k, "k_norm", eps)?,
            ),
            None => (q, k),
        };
        let Some(rope) = h.rope else {
            return Ok([q, k, v]);
        };
        let mut rotate = |x: Tensor, heads: u64| -> Result<Tensor> {
            let op = Op::Rope(RopeAttrs {
                batch: 1,
                heads,
                head_dim: h.head_dim,
                theta: rope.theta,
                scaling: rope.scaling,
                positions: vec![at],
                rotary_dim: rope.partial_dim(h.head_dim),
            });
            let y = device.apply(&op, &[x.buf], x, x.cols)?;
            device.free(x.buf)?;
            Ok(y)
        };
        Ok([rotate(q, h.heads)?, rotate(k, h.kv_heads)?, v])
    }

    /// Each head of `x` (consumed) RMS-normalized with the shared weight `local`, as the
    /// training forward does: `RmsNorm` over rows of head_dim.
    fn head_norm<B: Backend>(
        &self,
        device: &mut Device<B>,
        weights: &Weights,
        x: Tensor,
        local: &str,
        eps: f64,
    ) -> Result<Tensor> {
        let head_dim = self.heads.head_dim;
        let w = weights.get(self.node, local)?;
        let rstd = device.alloc(&[x.rows * x.cols / head_dim.max(1)], DType::F32)?;
        let y = device.tensor(x.rows, x.cols)?;
        let op = Op::RmsNorm { dim: head_dim, eps };
        device.run(&op, &[x.buf, w], &[y.buf, rstd])?;
        device.free(rstd)?;
        device.free(x.buf)?;
        Ok(y)
    }
}
