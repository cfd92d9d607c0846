//! Counter-based parameter initialisation. Element `i` (global row-major flat index) of parameter
//! `p` under seed `s` is a pure function of `(s, p, i)`: a splitmix64-style hash of the triple
//! gives two uniforms, Box–Muller turns them into a standard normal. Any shard (a tp block, a
//! ZeRO flat slice, or both) is therefore produced alone and equals the matching slice of the
//! full tensor, whatever the plan.
//!
//! [`fill_local_param`] maps the plan's parameter layout (tp block, then ZeRO flat shard with zero
//! padding; see `parc_compiler::ir::program`) to global indices and fills a local buffer.
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::{Init, ParamId, TpSplit};
use rayon::prelude::*;

/// splitmix64's output mixer: a bijection on u64 with good avalanche.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 64 random bits for counter `counter` of the stream of `(seed, param)`.
fn random_bits(seed: u64, param: u32, counter: u64) -> u64 {
    let key = mix(seed.wrapping_add(0x9e37_79b9_7f4a_7c15));
    let key = mix(key ^ u64::from(param).wrapping_mul(0xd6e8_feb8_6659_fd93));
    mix(key ^ mix(counter.wrapping_add(0x2545_f491_4f6c_dd1d)))
}

/// A uniform in `(0, 1]` from the top 53 bits (never 0, so its logarithm is finite).
fn unit_open_closed(bits: u64) -> f64 {
    ((bits >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Element `index` of parameter `param` under `seed`, drawn from N(0, std²).
pub fn normal(seed: u64, param: ParamId, index: u64, std: f64) -> f32 {
    let u1 = unit_open_closed(random_bits(seed, param.0, index.wrapping_mul(2)));
    let u2 = unit_open_closed(random_bits(
        seed,
        param.0,
        index.wrapping_mul(2).wrapping_add(1),
    ));
    let radius = (-2.0 * u1.ln()).sqrt();
    (std * radius * (std::f64::consts::TAU * u2).cos()) as f32
}

/// The value of element `index` of a parameter initialised with `init`.
pub fn init_value(init: Init, seed: u64, param: ParamId, index: u64) -> f32 {
    match init {
        Init::Normal { std } => normal(seed, param, index, std),
        Init::Zeros => 0.0,
        Init::Ones => 1.0,
    }
}

/// Fill `out[j]` with element `start + j` of the parameter.
pub fn fill_range(out: &mut [f32], init: Init, seed: u64, param: ParamId, start: u64) {
    out.par_chunks_mut(4096)
        .enumerate()
        .for_each(|(chunk, values)| {
            let base = start + (chunk * 4096) as u64;
            for (j, value) in values.iter_mut().enumerate() {
                *value = init_value(init, seed, param, base + j as u64);
            }
        });
}

/// Fill `out[j]` with element `indices[j]` of the parameter; `None` marks padding (zero).
pub fn fill_indices(
    out: &mut [f32],
    init: Init,
    seed: u64,
    param: ParamId,
    indices: &[Option<u64>],
) -> Result<()> {
    if out.len() != indices.len() {
        return Err(RuntimeError::Unsupported(format!(
            "parameter {} init: {} indices for a buffer of {} elements",
            param.0,
            indices.len(),
            out.len()
        )));
    }
    out.par_iter_mut()
        .zip(indices.par_iter())
        .for_each(|(value, index)| {
            *value = index.map_or(0.0, |i| init_value(init, seed, param, i));
        });
    Ok(())
}

/// The tp-local tensor of a parameter: block `tp.index` of `tp.parts` along `tp.dim` of the
/// global tensor (of each of `tp.sections` along it, concatenated; all of it when there is no
/// split), and the map from its row-major flat indices to global ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpBlock {
    global_shape: Vec<u64>,
    local_shape: Vec<u64>,
    /// The split dimension (`global_shape.len()` when there is none).
    dim: usize,
    /// Along `dim`: runs of `(local start, global start, length)`, ascending.
    runs: Vec<(u64, u64, u64)>,
}

impl TpBlock {
    pub fn new(global_shape: &[u64], tp: Option<TpSplit>) -> Result<TpBlock> {
        let mut local_shape = global_shape.to_vec();
        let Some(split) = tp else {
            return Ok(TpBlock {
                global_shape: global_shape.to_vec(),
                local_shape,
                dim: global_shape.len(),
                runs: Vec::new(),
            });
        };
        let dim = split.dim as usize;
        let extent = global_shape.get(dim).copied().ok_or_else(|| {
            RuntimeError::Unsupported(format!(
                "tp split along dimension {dim} of a parameter of shape {global_shape:?}"
            ))
        })?;
        let sections: Vec<u64> = match split.sections {
            None => vec![extent],
            Some(s) => s.iter().copied().filter(|&n| n > 0).collect(),
        };
        let parts = u64::from(split.parts);
        let uneven = sections.iter().any(|&n| n.checked_rem(parts) != Some(0));
        if uneven || split.index >= split.parts || sections.iter().sum::<u64>() != extent {
            return Err(RuntimeError::Unsupported(format!(
                "tp block {} of {} along dimension {dim} (sections {sections:?}) of a parameter \
                 of shape {global_shape:?}: every section must divide evenly, the sections must \
                 cover the dimension and the block must exist",
                split.index, split.parts
            )));
        }
        let (mut runs, mut local, mut global) = (Vec::new(), 0u64, 0u64);
        for n in sections {
            let block = n / parts;
            runs.push((local, global + block * u64::from(split.index), block));
            local += block;
            global += n;
        }
        local_shape[dim] = local;
        Ok(TpBlock {
            global_shape: global_shape.to_vec(),
            local_shape,
            dim,
            runs,
        })
    }

    /// Elements of the tp-local tensor.
    pub fn numel(&self) -> u64 {
        self.local_shape.iter().product()
    }

    /// The global flat index of the tp-local tensor's flat element `local`.
    pub fn global_index(&self, mut local: u64) -> u64 {
        let mut global = 0u64;
        let mut stride = 1u64;
        for d in (0..self.local_shape.len()).rev() {
            let extent = self.local_shape[d].max(1);
            let mut at = local % extent;
            if d == self.dim {
                // The last run starting at or before `at` holds it.
                let run = self.runs.iter().rev().find(|r| r.0 <= at);
                at = run.map_or(at, |&(l, g, _)| g + (at - l));
            }
            global += at * stride;
            local /= extent;
            stride *= self.global_shape[d];
        }
        global
    }

    /// How many tp-local elements from flat element `local` on map to consecutive global
    /// elements (to the end of the block's run along the split dimension, or of the tensor).
    pub fn contiguous_from(&self, local: u64) -> u64 {
        let numel = self.numel();
        if self.dim >= self.local_shape.len() || local >= numel {
            return numel.saturating_sub(local);
        }
        let inner: u64 = self.local_shape[self.dim + 1..]
            .iter()
            .product::<u64>()
            .max(1);
        let extent = self.local_shape[self.dim].max(1);
        let at = (local / inner) % extent;
        let end = self
            .runs
            .iter()
            .find(|r| r.0 <= at && at < r.0 + r.2)
            .map_or(at + 1, |r| r.0 + r.2);
        (end - at) * inner - local % inner
    }

    /// The tp-local flat index of global flat element `global`; None when this block does not
    /// hold it (the inverse of [`TpBlock::global_index`]).
    pub fn local_index(&self, mut global: u64) -> Option<u64> {
        let mut local = 0u64;
        let mut stride = 1u64;
        for d in (0..self.global_shape.len()).rev() {
            let extent = self.global_shape[d].max(1);
            let mut at = global % extent;
            if d == self.dim {
                let &(l, g, _) = self.runs.iter().find(|r| r.1 <= at && at < r.1 + r.2)?;
                at = l + (at - g);
            }
            local += at * stride;
            global /= extent;
            stride *= self.local_shape[d].max(1);
        }
        Some(local)
    }
}

/// Global flat indices of the tp-local tensor's elements, in its row-major order (see
/// [`TpBlock`]).
pub fn tp_local_indices(global_shape: &[u64], tp: Option<TpSplit>) -> Result<Vec<u64>> {
    let block = TpBlock::new(global_shape, tp)?;
    Ok((0..block.numel()).map(|i| block.global_index(i)).collect())
}

/// Where a ZeRO shard sits in the flat, zero-padded tp-local tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroShard {
    pub shard_len: u64,
    /// The caller's index in its ZeRO group set.
    pub index: u64,
}

/// Fill a program's local copy of a parameter: the tp-local tensor (`zero` None, `out` has its
/// element count) or the caller's ZeRO shard of it (`out` has `shard_len` elements; elements past
/// the tensor's end are zero padding).
pub fn fill_local_param(
    out: &mut [f32],
    init: Init,
    seed: u64,
    param: ParamId,
    global_shape: &[u64],
    tp: Option<TpSplit>,
    zero: Option<ZeroShard>,
) -> Result<()> {
    let value = |global| init_value(init, seed, param, global);
    fill_local_with(out, param, global_shape, tp, zero, value)
}

/// [`fill_local_param`] with element values from `value(global flat index)` (a checkpoint's,
/// for `train.init = hf(…)`).
pub fn fill_local_with(
    out: &mut [f32],
    param: ParamId,
    global_shape: &[u64],
    tp: Option<TpSplit>,
    zero: Option<ZeroShard>,
    value: impl Fn(u64) -> f32 + Sync,
) -> Result<()> {
    let block = TpBlock::new(global_shape, tp)?;
    let numel = block.numel();
    let (start, len) = match zero {
        None => (0, numel),
        Some(shard) => (shard.index.saturating_mul(shard.shard_len), shard.shard_len),
    };
    if out.len() as u64 != len {
        return Err(RuntimeError::Unsupported(format!(
            "parameter {} init: a buffer of {} elements for a local copy of {len}",
            param.0,
            out.len()
        )));
    }
    out.par_chunks_mut(4096)
        .enumerate()
        .for_each(|(chunk, values)| {
            let base = start + (chunk * 4096) as u64;
            for (j, out_value) in values.iter_mut().enumerate() {
                let local = base + j as u64;
                *out_value = if local < numel {
                    value(block.global_index(local))
                } else {
                    0.0
                };
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_index_inverts_global_index_and_runs_are_contiguous() {
        for (shape, split) in [
            (vec![6, 4], None),
            (vec![6, 4], Some((0, 2, 1, None))),
            (vec![6, 4], Some((1, 2, 0, None))),
            (vec![12, 2], Some((0, 2, 1, Some([4, 4, 4])))),
        ] {
            let tp = split.map(|(dim, parts, index, sections)| TpSplit {
                dim,
                parts,
                index,
                sections,
            });
            let block = TpBlock::new(&shape, tp).unwrap();
            for local in 0..block.numel() {
                assert_eq!(block.local_index(block.global_index(local)), Some(local));
                let run = block.contiguous_from(local);
                assert!(run >= 1 && local + run <= block.numel());
                let first = block.global_index(local);
                for k in 0..run {
                    assert_eq!(block.global_index(local + k), first + k, "{shape:?} {tp:?}");
                }
                if local + run < block.numel() && split.is_some() {
                    assert_ne!(block.global_index(local + run), first + run);
                }
            }
            let total: u64 = shape.iter().product();
            let held = (0..total).filter(|&g| block.local_index(g).is_some());
            assert_eq!(held.count() as u64, block.numel(), "{shape:?} {tp:?}");
        }
    }

    #[test]
    fn values_depend_only_on_seed_param_and_index() {
        let a = normal(7, ParamId(3), 12345, 0.02);
        assert_eq!(a.to_bits(), normal(7, ParamId(3), 12345, 0.02).to_bits());
        assert_ne!(a, normal(8, ParamId(3), 12345, 0.02));
        assert_ne!(a, normal(7, ParamId(4), 12345, 0.02));
        assert_ne!(a, normal(7, ParamId(3), 12346, 0.02));
    }

    #[test]
    fn normal_has_the_requested_moments() {
        let std = 0.5;
        let n = 200_000u64;
        let samples: Vec<f64> = (0..n)
            .map(|i| f64::from(normal(1, ParamId(0), i, std)))
            .collect();
        let mean = samples.iter().sum::<f64>() / n as f64;
        let var = samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        let kurt = samples.iter().map(|x| (x - mean).powi(4)).sum::<f64>() / n as f64 / var / var;
        // Standard errors: mean 0.5/sqrt(2e5) ≈ 1.1e-3, variance ≈ 0.25·sqrt(2/2e5) ≈ 8e-4.
        assert!(mean.abs() < 5e-3, "mean {mean}");
        assert!((var - std * std).abs() < 5e-3, "variance {var}");
        assert!((kurt - 3.0).abs() < 0.1, "kurtosis {kurt}");
        let within_one_std = samples.iter().filter(|x| x.abs() < std).count() as f64 / n as f64;
        assert!((within_one_std - 0.6827).abs() < 0.01, "{within_one_std}");
    }

    #[test]
    fn a_range_equals_the_slice_of_the_full_tensor() {
        let init = Init::Normal { std: 1.0 };
        let mut full = vec![0.0; 10_000];
        fill_range(&mut full, init, 5, ParamId(2), 0);
        let mut part = vec![0.0; 3_000];
        fill_range(&mut part, init, 5, ParamId(2), 4_321);
        assert_eq!(part, full[4_321..7_321]);
    }

    /// Split `parts` ways along `dim`, part `index`.
    fn split(dim: u32, parts: u32, index: u32) -> TpSplit {
        TpSplit {
            dim,
            parts,
            index,
            sections: None,
        }
    }

    /// What `fill_local_param` writes of parameter 1 (normal, seed 9) of `shape` into `len`
    /// elements (NaN where it writes nothing).
    fn local(len: usize, shape: &[u64], tp: Option<TpSplit>, zero: Option<ZeroShard>) -> Vec<f32> {
        let mut out = vec![f32::NAN; len];
        let init = Init::Normal { std: 1.0 };
        fill_local_param(&mut out, init, 9, ParamId(1), shape, tp, zero).unwrap();
        out
    }

    #[test]
    fn tp_blocks_along_either_dimension_are_slices_of_the_full_tensor() {
        let shape = [6, 8];
        let mut full = vec![0.0; 48];
        fill_range(&mut full, Init::Normal { std: 1.0 }, 9, ParamId(1), 0);
        // Column block 1 of 2: columns 4..8 of every row.
        let cols_block = local(24, &shape, Some(split(1, 2, 1)), None);
        for r in 0..6 {
            assert_eq!(cols_block[r * 4..r * 4 + 4], full[r * 8 + 4..r * 8 + 8]);
        }
        // Row block 2 of 3: rows 4..6.
        assert_eq!(local(16, &shape, Some(split(0, 3, 2)), None), full[32..48]);
    }

    #[test]
    fn zero_shards_are_flat_slices_of_the_tp_local_tensor_with_zero_padding() {
        let tp = Some(split(1, 2, 0));
        let whole = local(15, &[5, 6], tp, None);
        // 15 elements over 4 shards of 4: the last shard holds 3 elements and one pad.
        let gathered: Vec<f32> = (0..4)
            .flat_map(|index| {
                let zero = ZeroShard {
                    shard_len: 4,
                    index,
                };
                local(4, &[5, 6], tp, Some(zero))
            })
            .collect();
        assert_eq!(gathered[..15], whole[..]);
        assert_eq!(gathered[15], 0.0);
    }

    #[test]
    fn listed_indices_pick_elements_and_none_is_padding() {
        let init = Init::Normal { std: 1.0 };
        let mut full = vec![0.0; 8];
        fill_range(&mut full, init, 4, ParamId(6), 0);
        let mut picked = vec![f32::NAN; 3];
        fill_indices(&mut picked, init, 4, ParamId(6), &[Some(5), None, Some(2)]).unwrap();
        assert_eq!(picked, vec![full[5], 0.0, full[2]]);
        assert!(fill_indices(&mut picked, init, 4, ParamId(6), &[Some(1)]).is_err());
    }

    #[test]
    fn tp_block_indices_of_a_3d_tensor_match_brute_force() {
        let mut expected = Vec::new();
        for a in 0..2u64 {
            for b in 2..4u64 {
                for c in 0..3u64 {
                    expected.push((a * 4 + b) * 3 + c);
                }
            }
        }
        let indices = tp_local_indices(&[2, 4, 3], Some(split(1, 2, 1)));
        assert_eq!(indices.unwrap(), expected);
    }

    #[test]
    fn sectioned_tp_blocks_take_the_same_block_of_every_section() {
        // A fused projection of 4 q rows, 2 k rows, 2 v rows (2 columns each), split in 2:
        // rank 1 holds q rows 2..4, k row 5, v row 7.
        let split = TpSplit {
            sections: Some([4, 2, 2]),
            ..split(0, 2, 1)
        };
        let rows: Vec<u64> = tp_local_indices(&[8, 2], Some(split))
            .unwrap()
            .iter()
            .map(|i| i / 2)
            .collect();
        assert_eq!(rows, vec![2, 2, 3, 3, 5, 5, 7, 7]);
        let odd = TpSplit {
            sections: Some([4, 3, 1]),
            ..split
        };
        assert!(tp_local_indices(&[8, 2], Some(odd)).is_err());
    }

    #[test]
    fn layout_errors_are_reported() {
        assert!(tp_local_indices(&[6, 2], Some(split(0, 4, 0))).is_err());
        assert!(tp_local_indices(&[6, 2], Some(split(2, 1, 0))).is_err());
        let mut out = vec![0.0; 3];
        assert!(
            fill_local_param(&mut out, Init::Ones, 0, ParamId(0), &[2, 2], None, None).is_err()
        );
    }
}
