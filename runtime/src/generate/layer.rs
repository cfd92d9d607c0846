//! One node of the model graph on new tokens: the ops the training forward lowers its kind to
//! (`parc_compiler::lower`), for batch 1 and the rows of the tokens at positions `at`.
//! Attention, which also reads earlier positions, is `attention`'s; a `.par` function (an MLP's
//! activation, an elementwise layer) runs the generated kernel the lowering makes of it
//! (`parc_compiler::lower::act_kernels`).
use super::attention::Cache;
use super::device::{Device, Tensor};
use super::weights::Weights;
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::{ActAttrs, EmbeddingAttrs, FusedAttrs, Op, PositionAttrs, Segment};
use parc_compiler::ir::DType;
use parc_compiler::lower::act_kernels;
use parc_compiler::spec::{Activation, LayerKind, Node, NodeId};

/// What a node needs besides its kind: an attention layer's cache, a function's kernel.
pub(super) enum Layer {
    /// Ops from the node's kind alone.
    Ops,
    Attention(Cache),
    /// The generated kernel of an MLP's function activation or of an elementwise layer.
    Kernel(FusedAttrs),
}

fn kernel_error(node: &Node, e: String) -> RuntimeError {
    RuntimeError::Unsupported(format!("`{}`: its generated kernel: {e}", node.name))
}

impl Layer {
    /// Prepare node `id` for a model of `seq` positions.
    pub fn new<B: Backend>(
        device: &mut Device<B>,
        id: NodeId,
        node: &Node,
        seq: u64,
    ) -> Result<Layer> {
        if let Some(cache) = Cache::new(device, id, node, seq)? {
            return Ok(Layer::Attention(cache));
        }
        let kernel = match &node.kind {
            LayerKind::Mlp {
                hidden,
                act: Activation::Fn(f),
                ..
            } => act_kernels::forward(f, *hidden),
            LayerKind::Elementwise { f, dim } => act_kernels::elementwise(f, *dim),
            _ => return Ok(Layer::Ops),
        };
        kernel.map(Layer::Kernel).map_err(|e| kernel_error(node, e))
    }

    /// The node's output for `inputs` (as the node lists them), the tokens at `at`.
    pub fn forward<B: Backend>(
        &self,
        device: &mut Device<B>,
        weights: &Weights,
        (id, node): (NodeId, &Node),
        inputs: &[Tensor],
        at: Segment,
    ) -> Result<Tensor> {
        let x = *inputs.first().ok_or_else(|| {
            RuntimeError::Unsupported(format!("`{}` has no input (an engine bug)", node.name))
        })?;
        if let Layer::Attention(cache) = self {
            return cache.forward(device, weights, x, at);
        }
        let kernel = match self {
            Layer::Kernel(k) => Some(k),
            _ => None,
        };
        let w = |local: &str| weights.get(id, local);
        let bufs: Vec<_> = inputs.iter().map(|t| t.buf).collect();
        match &node.kind {
            LayerKind::Embedding { vocab, dim } => {
                let op = Op::Embedding(EmbeddingAttrs {
                    vocab_start: 0,
                    vocab_local: *vocab,
                    dim: *dim,
                });
                device.apply(&op, &[x.buf, w("weight")?], x, *dim)
            }
            LayerKind::PositionEmbedding { dim, .. } => {
                let op = Op::PositionAdd(PositionAttrs {
                    batch: 1,
                    dim: *dim,
                    positions: vec![at],
                });
                device.apply(&op, &[x.buf, w("weight")?], x, *dim)
            }
            LayerKind::LayerNorm { dim, eps, bias } => {
                let mut ins = vec![x.buf, w("weight")?];
                if *bias {
                    ins.push(w("bias")?);
                }
                let op = Op::LayerNorm {
                    dim: *dim,
                    eps: *eps,
                    bias: *bias,
                };
                norm(device, &op, &ins, x, 2)
            }
            LayerKind::RmsNorm { dim, eps } => {
                let op = Op::RmsNorm {
                    dim: *dim,
                    eps: *eps,
                };
                norm(device, &op, &[x.buf, w("weight")?], x, 1)
            }
            LayerKind::Linear { out_dim, bias, .. } => {
                let b = bias.then_some("bias");
                weights.linear(device, id, x, ("weight", b), *out_dim)
            }
            LayerKind::Mlp {
                dim,
                hidden,
                act,
                bias,
            } => {
                let mlp = Mlp {
                    node: id,
                    dim: *dim,
                    hidden: *hidden,
                    bias: *bias,
                };
                mlp.forward(device, weights, x, act, kernel)
            }
            LayerKind::Add => device.apply(&Op::Add, &bufs, x, x.cols),
            LayerKind::Elementwise { .. } => match kernel {
                Some(k) => device.apply(&Op::Fused(k.clone()), &bufs, x, x.cols),
                None => Err(kernel_error(node, "not prepared (an engine bug)".into())),
            },
            LayerKind::Attention { .. } | LayerKind::CrossEntropy => {
                Err(RuntimeError::Unsupported(format!(
                    "`{}` is not run as an ordinary layer (an engine bug)",
                    node.name
                )))
            }
        }
    }
}

/// A norm's output `y`; its `stats` per-row statistics (mean and rstd, or rstd) are dropped.
fn norm<B: Backend>(
    device: &mut Device<B>,
    op: &Op,
    inputs: &[parc_compiler::ir::BufferId],
    x: Tensor,
    stats: usize,
) -> Result<Tensor> {
    let y = device.tensor(x.rows, x.cols)?;
    let mut outputs = vec![y.buf];
    for _ in 0..stats {
        outputs.push(device.alloc(&[x.rows], DType::F32)?);
    }
    device.run(op, inputs, &outputs)?;
    for &id in &outputs[1..] {
        device.free(id)?;
    }
    Ok(y)
}

/// An MLP's sizes.
struct Mlp {
    node: NodeId,
    dim: u64,
    hidden: u64,
    bias: bool,
}

impl Mlp {
    /// The projections around the activation, as the lowering makes them: `fc`, `act`, `proj`
    /// (with biases when `bias`); SwiGLU and gated functions `gate`, `up`, then `down` without.
    fn forward<B: Backend>(
        &self,
        device: &mut Device<B>,
        weights: &Weights,
        x: Tensor,
        act: &Activation,
        kernel: Option<&FusedAttrs>,
    ) -> Result<Tensor> {
        let (node, hidden) = (self.node, self.hidden);
        let (inner, out) = if act.is_gated() {
            let g = weights.linear(device, node, x, ("gate", None), hidden)?;
            let u = weights.linear(device, node, x, ("up", None), hidden)?;
            (vec![g, u], ("down", None))
        } else {
            let fc_bias = self.bias.then_some("fc_bias");
            let h = weights.linear(device, node, x, ("fc", fc_bias), hidden)?;
            (vec![h], ("proj", self.bias.then_some("proj_bias")))
        };
        let bufs: Vec<_> = inner.iter().map(|t| t.buf).collect();
        let op = match (act, kernel) {
            (Activation::Plain(a), _) => Op::Activation(ActAttrs { act: *a }),
            (Activation::Swiglu, _) => Op::SwiGlu,
            (Activation::Fn(_), Some(k)) => Op::Fused(k.clone()),
            (Activation::Fn(f), None) => {
                return Err(RuntimeError::Unsupported(format!(
                    "the activation `{}` has no kernel (an engine bug)",
                    f.name
                )))
            }
        };
        let a = device.apply(&op, &bufs, inner[0], self.hidden)?;
        for t in inner {
            device.free(t.buf)?;
        }
        let y = weights.linear(device, self.node, a, out, self.dim)?;
        device.free(a.buf)?;
        Ok(y)
    }
}
