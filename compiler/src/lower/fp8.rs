//! FP8 GEMMs in a lowered program: the GEMM ops (forward, data and weight gradient, and their
//! recomputed and evaluation copies) of the layers `crate::fp8` chose get the recipe's `fp8`
//! attribute. Run on a finished program, before fusion: which layers and why is decided once
//! per plan, not here.

use crate::ir::fp8::Fp8Gemm;
use crate::ir::{Instr, Program};
use std::sync::Arc;

/// The layers to run in FP8, by node index, and their GEMMs' attribute.
pub(super) struct Fp8Layers {
    pub chosen: Vec<bool>,
    pub attr: Fp8Gemm,
}

impl Fp8Layers {
    /// From the spec's recipe and `crate::fp8`'s `choices`; None without `train.fp8` or when
    /// every layer stays bf16.
    pub fn of(spec: &crate::spec::Spec, choices: &[crate::fp8::Choice]) -> Option<Fp8Layers> {
        let fp8 = spec.train.fp8.as_ref()?;
        let mut chosen = vec![false; spec.model.nodes.len()];
        for c in choices.iter().filter(|c| c.fp8) {
            if let Some(slot) = chosen.get_mut(c.node.0 as usize) {
                *slot = true;
            }
        }
        chosen.iter().any(|&c| c).then(|| Fp8Layers {
            chosen,
            attr: crate::fp8::gemm_attr(fp8),
        })
    }

    /// Set the attribute on every GEMM of a chosen layer in `program`.
    pub fn mark(&self, program: &mut Program) {
        for instr in &mut program.instrs {
            let Instr::Compute { op, node, .. } = instr else {
                continue;
            };
            let chosen = node.is_some_and(|n| self.chosen.get(n.0 as usize) == Some(&true));
            if chosen && op.is_gemm() {
                *op = Arc::new(op.with_fp8(Some(self.attr)));
            }
        }
    }
}
