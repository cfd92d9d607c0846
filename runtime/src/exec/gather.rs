//! Reassembling global parameters from the ranks' local pieces (tp blocks, ZeRO flat shards):
//! the inverse of the layout in `parc_compiler::ir::program`, used to compare plans and to
//! export weights independent of the plan; [`collect_on_root`] brings every rank's pieces to
//! rank 0 through the comm first (a multi-process run's model export, `train.sample`).
use super::rank::ParamPiece;
use crate::comm::{Comm, PeerOp};
use crate::error::{Result, RuntimeError};
use crate::init::{tp_local_indices, ZeroShard};
use parc_compiler::ir::{ParamTable, Plan};

/// A parameter as one global tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalParam {
    pub name: String,
    pub shape: Vec<u64>,
    pub data: Vec<f32>,
}

/// Assemble every parameter of `table` from `pieces` (from all ranks). Replicas (dp copies)
/// must hold bit-identical values; replicas that diverged, or an element no piece covers, are
/// errors.
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
                let g = g as usize;
                if covered[g] && global.data[g].to_bits() != value.to_bits() {
                    return Err(RuntimeError::Unsupported(format!(
                        "parameter {} element {g}: replicas on different ranks hold {} and \
                         {value}; they diverged (a lowering or backend bug)",
                        global.name, global.data[g]
                    )));
                }
                global.data[g] = value;
                covered[g] = true;
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

/// Tag of the parameter gather. It runs between steps, when every rank has received all its
/// step's messages, and messages are matched in order per (sender, receiver, tag): no
/// transfer of a step can take its place.
const GATHER_TAG: u32 = 0;

/// Every rank's parameter pieces sent to rank 0, which assembles the global tensors (checking
/// that replicas agree) and returns them; the other ranks return None. Rank 0 knows each
/// rank's pieces and their sizes from the plan, so only the values travel.
pub fn collect_on_root(
    plan: &Plan,
    comm: &mut dyn Comm,
    pieces: Vec<ParamPiece>,
) -> Result<Option<Vec<GlobalParam>>> {
    if comm.rank() != 0 {
        let data: Vec<f32> = pieces.iter().flat_map(|p| p.data.iter().copied()).collect();
        comm.send(0, GATHER_TAG, &data)?;
        return Ok(None);
    }
    let mut all = pieces;
    for rank in 1..plan.world {
        let mut layout = pieces_of(plan, rank)?;
        let total: usize = layout.iter().map(|p| p.data.len()).sum();
        let mut data = vec![0.0f32; total];
        comm.group_p2p(&mut [PeerOp::Recv {
            peer: rank,
            tag: GATHER_TAG,
            out: &mut data,
        }])?;
        let mut values = data.into_iter();
        for piece in &mut layout {
            for (slot, value) in piece.data.iter_mut().zip(values.by_ref()) {
                *slot = value;
            }
        }
        all.extend(layout);
    }
    assemble(&plan.params, &all).map(Some)
}

/// The pieces rank `rank` stores (as `RankExecutor::param_pieces` lists them), with zeroed
/// data of their sizes.
fn pieces_of(plan: &Plan, rank: u32) -> Result<Vec<ParamPiece>> {
    let missing = |what: String| RuntimeError::Op {
        op: format!("rank {rank}"),
        what: format!("{what} (a lowering bug)"),
    };
    let program = plan
        .program_of(rank)
        .ok_or_else(|| missing("has no program".to_string()))?;
    program
        .params
        .iter()
        .map(|local| {
            let len = program
                .buffer(local.master)
                .map(|b| b.numel() as usize)
                .ok_or_else(|| missing(format!("buffer {} is unknown", local.master.0)))?;
            let zero = match local.zero {
                None => None,
                Some(split) => Some(ZeroShard {
                    shard_len: split.shard_len,
                    index: plan.zero_index(&split, rank).ok_or_else(|| {
                        missing(format!("is not in ZeRO group {}", split.group.0))
                    })?,
                }),
            };
            Ok(ParamPiece {
                param: local.param,
                tp: local.tp,
                zero,
                data: vec![0.0; len],
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::ZeroShard;
    use parc_compiler::ir::{Init, Param, ParamId, TpSplit};
    use parc_compiler::spec::NodeId;

    fn table() -> ParamTable {
        ParamTable {
            params: vec![Param {
                name: "w".to_string(),
                shape: vec![2, 3],
                init: Init::Zeros,
                decay: true,
                node: NodeId(0),
            }],
        }
    }

    fn piece(index: u32, zero: Option<ZeroShard>, data: Vec<f32>) -> ParamPiece {
        ParamPiece {
            param: ParamId(0),
            tp: Some(TpSplit {
                dim: 1,
                parts: 3,
                index,
                sections: None,
            }),
            zero,
            data,
        }
    }

    #[test]
    fn tp_blocks_and_zero_shards_reassemble_and_diverged_replicas_are_caught() {
        // Columns split in 3 blocks of [2, 1]; block 1 is stored as two ZeRO shards of 1.
        let shard = |index| {
            Some(ZeroShard {
                shard_len: 1,
                index,
            })
        };
        let pieces = vec![
            piece(0, None, vec![0.0, 3.0]),
            piece(1, shard(0), vec![1.0]),
            piece(1, shard(1), vec![4.0]),
            piece(2, None, vec![2.0, 5.0]),
            piece(2, None, vec![2.0, 5.0]),
        ];
        let params = assemble(&table(), &pieces).unwrap();
        assert_eq!(params[0].data, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let mut diverged = pieces.clone();
        diverged[4].data[1] = 5.5;
        let err = assemble(&table(), &diverged).unwrap_err().to_string();
        assert!(
            err.contains("element 5") && err.contains("diverged"),
            "{err}"
        );
        let missing = assemble(&table(), &pieces[..3]).unwrap_err().to_string();
        assert!(missing.contains("not fully held"), "{missing}");
    }
}
