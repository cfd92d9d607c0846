//! A model's parameters on a backend: every parameter of the spec's table
//! (`parc_compiler::lower::params`, the names of `parc plan` and of `model.safetensors`) read
//! from global tensors, checked against its shape, and found again by node and local name (a
//! tied head finds its embedding's table).
use super::device::{Device, Tensor};
use crate::backend::Backend;
use crate::checkpoint::ShardTensor;
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{BufferId, DType};
use parc_compiler::lower::params::{self, Params};
use parc_compiler::spec::{NodeId, Spec};
use std::collections::HashMap;

/// The parameters, each in one buffer of the backend.
pub struct Weights {
    params: Params,
    /// Buffer of each parameter, by its index in the table.
    buffers: Vec<BufferId>,
}

fn weights_error(what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Checkpoint(what.to_string())
}

impl Weights {
    /// Upload every parameter `spec` declares from `tensors` (named as in `model.safetensors`;
    /// others are ignored). A missing tensor or one of another shape is an error naming it.
    pub(super) fn load<B: Backend>(
        spec: &Spec,
        tensors: &[ShardTensor],
        device: &mut Device<B>,
    ) -> Result<Weights> {
        let params = params::build(spec);
        let by_name: HashMap<&str, &ShardTensor> =
            tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let mut buffers = Vec::with_capacity(params.table.params.len());
        for param in &params.table.params {
            let tensor = by_name.get(param.name.as_str()).ok_or_else(|| {
                weights_error(format!(
                    "the model file has no tensor {} (shape {:?}), which model {} declares; \
                     was it saved from another spec?",
                    param.name, param.shape, spec.model.name
                ))
            })?;
            if tensor.shape != param.shape {
                return Err(weights_error(format!(
                    "tensor {} has shape {:?} in the model file but model {} declares {:?}; \
                     was it saved from another spec (or other --set overrides)?",
                    param.name, tensor.shape, spec.model.name, param.shape
                )));
            }
            let id = device.alloc(&param.shape, DType::F32)?;
            device.backend.write_f32(id, &tensor.data)?;
            buffers.push(id);
        }
        Ok(Weights { params, buffers })
    }

    /// The buffer of `node`'s parameter `local` (`weight`, `wqkv`, `fc_bias`, …).
    pub(super) fn get(&self, node: NodeId, local: &str) -> Result<BufferId> {
        self.params
            .get(node, local)
            .and_then(|slot| self.buffers.get(slot.param.0 as usize).copied())
            .ok_or_else(|| {
                RuntimeError::Unsupported(format!(
                    "node {} has no parameter `{local}` (an engine bug)",
                    node.0
                ))
            })
    }

    /// `x Wᵀ (+ b)` with `node`'s parameters `w` and, when given, `b`: a new `[rows, out_dim]`.
    pub(super) fn linear<B: Backend>(
        &self,
        device: &mut Device<B>,
        node: NodeId,
        x: Tensor,
        (w, b): (&str, Option<&str>),
        out_dim: u64,
    ) -> Result<Tensor> {
        let mut inputs = vec![x.buf, self.get(node, w)?];
        if let Some(b) = b {
            inputs.push(self.get(node, b)?);
        }
        let op = Op::Matmul {
            in_dim: x.cols,
            out_dim,
            bias: b.is_some(),
            act: None,
            residual: false,
            swiglu: false,
            fp8: None,
        };
        device.apply(&op, &inputs, x, out_dim)
    }
}
