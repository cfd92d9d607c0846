//! Reassembling global parameters from the ranks' local pieces (tp blocks, ZeRO flat shards):
//! the inverse of the layout in `parc_compiler::ir::program`, used to compare plans and to
//! export weights independent of the plan.
use super::rank::ParamPiece;
use crate::error::{Result, RuntimeError};
use crate::init::tp_local_indices;
use parc_compiler::ir::ParamTable;

/// A parameter as one global tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalParam {
    pub name: String,
    pub shape: Vec<u64>,
    pub data: Vec<f32>,
}

/// Assemble every parameter of `table` from `pieces` (from all ranks). Replicas (dp copies)
/// write the same elements; a parameter element no piece covers is an error.
pub fn assemble(table: &ParamTable, pieces: &[ParamPiece]) -> Result<Vec<GlobalParam>> {
    let mut params: Vec<(GlobalParam, Vec<bool>)> = table
        .params
        .iter()
        .map(|p| {
            let numel = p.shape.iter().product::<u64>() as usize;
            (
                GlobalParam {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    data: vec![0.0; numel],
                },
                vec![false; numel],
            )
        })
        .collect();
    for piece in pieces {
        let Some((global, covered)) = params.get_mut(piece.param.0 as usize) else {
            return Err(RuntimeError::Unsupported(format!(
                "a rank holds parameter {} that the plan does not list",
                piece.param.0
            )));
        };
        let local = tp_local_indices(&global.shape, piece.tp)?;
        let start = piece.zero.map_or(0, |z| (z.index * z.shard_len) as usize);
        for (j, &value) in piece.data.iter().enumerate() {
            if let Some(&g) = local.get(start + j) {
                global.data[g as usize] = value;
                covered[g as usize] = true;
            }
        }
    }
    params
        .into_iter()
        .map(|(global, covered)| {
            if covered.iter().all(|&c| c) {
                Ok(global)
            } else {
                Err(RuntimeError::Unsupported(format!(
                    "parameter {} is not fully held by any set of ranks (a lowering bug)",
                    global.name
                )))
            }
        })
        .collect()
}
