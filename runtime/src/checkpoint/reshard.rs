//! Re-sharding a checkpoint for another plan: the global view of the checkpoint (its manifest's
//! [`Layout`]: every shard tensor as a slice of a global tensor) against the new plan's layout
//! gives, for each rank of the new plan and each tensor of its shard, the runs of elements to
//! copy from the old shard files ([`plan_rank`]); [`read_rank`] then reads only those byte
//! ranges (each shard file's safetensors header gives the tensors' offsets; the runs are read
//! with seek and read, never the whole file).
//!
//! Parameter values come from the old plan's masters (the optimizer's authoritative copy; the
//! ZeRO-1/2 working copies are only written), optimizer state tensor `k` from the old state
//! tensors `k`. Among replicas (dp copies), the old shard of the same rank number is preferred,
//! then the lowest rank: ranks that keep their place read their own file. Step metrics are
//! zero (every step zeroes them). ZeRO padding past a tensor's end stays zero.
use super::layout::{Layout, Piece, Role};
use super::store::{f32_values, ShardTensor};
use super::{shard_file_name, Manifest};
use crate::error::{Result, RuntimeError};
use crate::init::TpBlock;
use crate::safetensors_header::read_stream;
use safetensors::tensor::{Dtype, Metadata};
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// `len` elements from element `src` of tensor `tensor` of old shard `shard`, to element `dst`
/// of the new tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    pub shard: u32,
    pub tensor: usize,
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// One tensor of a new rank's shard and where its elements come from (none for a metric).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRead {
    pub name: String,
    pub shape: Vec<u64>,
    pub runs: Vec<Run>,
}

/// Everything one rank of the new plan reads.
#[derive(Clone, Debug, PartialEq)]
pub struct RankRead {
    pub rank: u32,
    pub tensors: Vec<TensorRead>,
}

impl RankRead {
    /// Bytes read from the old shards.
    pub fn bytes(&self) -> u64 {
        self.runs().map(|r| 4 * r.len).sum()
    }

    /// The old shard files read from, ascending.
    pub fn shards(&self) -> BTreeSet<u32> {
        self.runs().map(|r| r.shard).collect()
    }

    fn runs(&self) -> impl Iterator<Item = &Run> {
        self.tensors.iter().flat_map(|t| t.runs.iter())
    }
}

fn layout_error(what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Checkpoint(format!(
        "the checkpoint's layout record is inconsistent: {what}; use another checkpoint"
    ))
}

/// A shard tensor's place in its global tensor: its tp block and the range of the block's
/// flat elements it holds (a ZeRO shard's; all of them without ZeRO).
struct Placement {
    block: TpBlock,
    start: u64,
    len: u64,
}

impl Placement {
    fn of(piece: &Piece, global_shape: &[u64]) -> Result<Placement> {
        let block = TpBlock::new(global_shape, piece.tp.map(|t| t.split()))?;
        let (start, len) = match piece.zero {
            Some(z) => (z.index * z.shard_len, z.shard_len),
            None => (0, block.numel()),
        };
        Ok(Placement { block, start, len })
    }

    /// The global element of local element `local`; None for ZeRO padding.
    fn global(&self, local: u64) -> Option<u64> {
        let flat = self.start + local;
        (flat < self.block.numel()).then(|| self.block.global_index(flat))
    }

    /// The local element holding global element `global`, if this tensor holds it.
    fn local(&self, global: u64) -> Option<u64> {
        let flat = self.block.local_index(global)?;
        (self.start..self.start + self.len)
            .contains(&flat)
            .then(|| flat - self.start)
    }

    /// How many local elements from `local` on hold consecutive global elements (within this
    /// tensor and its block; padding excluded).
    fn contiguous_from(&self, local: u64) -> u64 {
        let flat = self.start + local;
        let in_tensor = (self.start + self.len).min(self.block.numel());
        self.block
            .contiguous_from(flat)
            .min(in_tensor.saturating_sub(flat))
    }
}

/// The old shard tensors that hold `param`'s tensor of `role`: (shard, tensor index, place),
/// shard `prefer` first, then ascending.
fn sources(
    old: &Layout,
    param: &str,
    role: Role,
    prefer: u32,
) -> Result<Vec<(u32, usize, Placement)>> {
    let shape = &old
        .param(param)
        .ok_or_else(|| layout_error(format!("parameter {param} is not listed")))?
        .shape;
    let mut found = Vec::new();
    for (shard, pieces) in old.ranks.iter().enumerate() {
        for (index, piece) in pieces.iter().enumerate() {
            if piece.param.as_deref() == Some(param) && piece.role == Some(role) {
                found.push((shard as u32, index, Placement::of(piece, shape)?));
            }
        }
    }
    found.sort_by_key(|(shard, _, _)| (*shard != prefer, *shard));
    Ok(found)
}

/// What rank `rank` of the plan of layout `new` reads from a checkpoint of layout `old`.
pub fn plan_rank(old: &Layout, new: &Layout, rank: u32) -> Result<RankRead> {
    let pieces = new
        .ranks
        .get(rank as usize)
        .ok_or_else(|| layout_error(format!("the new plan has no rank {rank}")))?;
    let mut tensors = Vec::with_capacity(pieces.len());
    for piece in pieces {
        let mut runs = Vec::new();
        if let (Some(param), Some(role)) = (&piece.param, piece.role) {
            let global = new.param(param).ok_or_else(|| {
                layout_error(format!("parameter {param} of the new plan is not listed"))
            })?;
            let place = Placement::of(piece, &global.shape)?;
            let candidates = sources(old, param, role, rank)?;
            let numel = piece.shape.iter().product::<u64>();
            let mut dst = 0;
            // Past the tensor's end a ZeRO shard holds padding, which stays zero.
            while let Some(g) = place.global(dst).filter(|_| dst < numel) {
                let (shard, tensor, src, source) = candidates
                    .iter()
                    .find_map(|(shard, tensor, p)| p.local(g).map(|src| (*shard, *tensor, src, p)))
                    .ok_or_else(|| {
                        RuntimeError::Checkpoint(format!(
                            "element {g} of parameter {param} ({role:?}) is in no shard of the \
                             checkpoint; it cannot be re-sharded"
                        ))
                    })?;
                let len = place
                    .contiguous_from(dst)
                    .min(source.contiguous_from(src))
                    .min(numel - dst)
                    .max(1);
                push_run(&mut runs, shard, tensor, src, dst, len);
                dst += len;
            }
        } else if piece.replicated {
            runs.extend(replicated_source(old, piece, rank)?);
        }
        tensors.push(TensorRead {
            name: piece.tensor.clone(),
            shape: piece.shape.clone(),
            runs,
        });
    }
    Ok(RankRead { rank, tensors })
}

/// The whole-tensor run of a replicated piece (a delayed-scaling FP8 amax history) from the old
/// shard holding its name (or one of its [`earlier_names`]), shard `prefer` first; none where
/// no old shard does (a checkpoint of a run without delayed scaling: the history starts empty,
/// a cold start); an error where the old tensor's shape differs (another history length).
fn replicated_source(old: &Layout, piece: &Piece, prefer: u32) -> Result<Option<Run>> {
    let names: Vec<String> = std::iter::once(piece.tensor.clone())
        .chain(earlier_names(&piece.tensor))
        .collect();
    let mut found: Vec<(u32, usize, &Piece)> = Vec::new();
    for name in &names {
        for (shard, pieces) in old.ranks.iter().enumerate() {
            for (index, p) in pieces.iter().enumerate() {
                if p.replicated && p.tensor == *name {
                    found.push((shard as u32, index, p));
                }
            }
        }
        if !found.is_empty() {
            break;
        }
    }
    found.sort_by_key(|(shard, _, _)| (*shard != prefer, *shard));
    let Some((shard, tensor, source)) = found.first() else {
        return Ok(None);
    };
    if source.shape != piece.shape {
        return Err(RuntimeError::Checkpoint(format!(
            "the checkpoint's FP8 amax history `{}` has shape {:?}, this plan's {:?}: its \
             `train.fp8` history length differs; resume with the checkpoint's `history`",
            piece.tensor, source.shape, piece.shape
        )));
    }
    Ok(Some(Run {
        shard: *shard,
        tensor: *tensor,
        src: 0,
        dst: 0,
        len: piece.shape.iter().product(),
    }))
}

/// The names a delayed-scaling history `NODE.WEIGHT.ROLE.amax_history` (or its `….amax`) had
/// when each GEMM kept its own (`NODE.WEIGHT.LAYOUT.ROLE.…`, before 2026-12-06's per-tensor
/// histories): every one of them recorded the same tensor, so any holds its values.
fn earlier_names(tensor: &str) -> Vec<String> {
    let Some((rest, what)) = tensor.rsplit_once('.') else {
        return Vec::new();
    };
    let Some((prefix, role)) = rest.rsplit_once('.') else {
        return Vec::new();
    };
    if !matches!(what, "amax_history" | "amax") || !matches!(role, "x" | "w" | "dy") {
        return Vec::new();
    }
    ["fwd", "bwd_data", "bwd_weight"]
        .iter()
        .map(|layout| format!("{prefix}.{layout}.{role}.{what}"))
        .collect()
}

/// Extend the last run when these `len` elements continue it, else start a new one.
fn push_run(runs: &mut Vec<Run>, shard: u32, tensor: usize, src: u64, dst: u64, len: u64) {
    if let Some(last) = runs.last_mut() {
        if last.shard == shard
            && last.tensor == tensor
            && last.src + last.len == src
            && last.dst + last.len == dst
        {
            last.len += len;
            return;
        }
    }
    runs.push(Run {
        shard,
        tensor,
        src,
        dst,
        len,
    });
}

/// An old shard file opened for reading ranges: its header parsed, the data's start.
struct OpenShard {
    path: PathBuf,
    file: File,
    data_start: u64,
    metadata: Metadata,
}

fn shard_error(path: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Checkpoint(format!("{}: {what}", path.display()))
}

impl OpenShard {
    fn open(path: PathBuf) -> Result<OpenShard> {
        let mut file =
            File::open(&path).map_err(|e| shard_error(&path, format!("cannot open: {e}")))?;
        let header = read_stream(&mut file).map_err(|e| shard_error(&path, e))?;
        let metadata: Metadata = serde_json::from_slice(&header.json)
            .map_err(|e| shard_error(&path, format!("corrupt safetensors header ({e})")))?;
        Ok(OpenShard {
            path,
            file,
            data_start: header.data_start,
            metadata,
        })
    }

    /// `len` f32 values from element `src` of tensor `name`.
    fn read(&mut self, name: &str, src: u64, len: u64) -> Result<Vec<f32>> {
        let info = self.metadata.info(name).ok_or_else(|| {
            shard_error(
                &self.path,
                format!("has no tensor {name}, which the manifest's layout lists"),
            )
        })?;
        let (begin, end) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        if info.dtype != Dtype::F32 || begin + 4 * (src + len) > end {
            return Err(shard_error(
                &self.path,
                format!(
                    "tensor {name} is {:?} {:?}, too small for elements {src}..{}",
                    info.dtype,
                    info.shape,
                    src + len
                ),
            ));
        }
        let mut bytes = vec![0u8; 4 * len as usize];
        self.file
            .seek(SeekFrom::Start(self.data_start + begin + 4 * src))
            .and_then(|_| self.file.read_exact(&mut bytes))
            .map_err(|e| {
                shard_error(
                    &self.path,
                    format!("cannot read tensor {name} (truncated?): {e}"),
                )
            })?;
        Ok(f32_values(&bytes))
    }
}

/// Read what `read` says from the shards of checkpoint folder `checkpoint` (laid out as `old`):
/// the new rank's tensors, in its shard's order.
pub fn read_rank(checkpoint: &Path, old: &Layout, read: &RankRead) -> Result<Vec<ShardTensor>> {
    let mut open: HashMap<u32, OpenShard> = HashMap::new();
    let mut tensors = Vec::with_capacity(read.tensors.len());
    for t in &read.tensors {
        let mut data = vec![0.0f32; t.shape.iter().product::<u64>() as usize];
        for run in &t.runs {
            let shard = match open.entry(run.shard) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(OpenShard::open(
                    checkpoint.join(shard_file_name(run.shard)),
                )?),
            };
            let name = &old
                .ranks
                .get(run.shard as usize)
                .and_then(|pieces| pieces.get(run.tensor))
                .ok_or_else(|| layout_error(format!("shard {} tensor {}", run.shard, run.tensor)))?
                .tensor;
            let values = shard.read(name, run.src, run.len)?;
            let dst = run.dst as usize;
            data.get_mut(dst..dst + values.len())
                .ok_or_else(|| layout_error(format!("a run overflows tensor {}", t.name)))?
                .copy_from_slice(&values);
        }
        tensors.push(ShardTensor {
            name: t.name.clone(),
            shape: t.shape.clone(),
            data,
        });
    }
    Ok(tensors)
}

/// The layout a checkpoint was written with, or why it cannot be re-sharded.
pub fn recorded_layout(manifest: &Manifest) -> Result<&Layout> {
    manifest.layout.as_ref().ok_or_else(|| {
        RuntimeError::Checkpoint(
            "this checkpoint was written by a parc that did not record its shards' layout, so \
             it cannot be re-sharded; resume it with the plan that wrote it (the same .par file \
             and --set overrides)"
                .to_string(),
        )
    })
}

/// Rank `rank`'s tensors of the plan of layout `new`, re-sharded from checkpoint folder
/// `checkpoint` (its manifest `manifest`).
pub fn load_rank(
    checkpoint: &Path,
    manifest: &Manifest,
    new: &Layout,
    rank: u32,
) -> Result<Vec<ShardTensor>> {
    let old = recorded_layout(manifest)?;
    read_rank(checkpoint, old, &plan_rank(old, new, rank)?)
}

/// What every rank of the plan of layout `new` reads from the checkpoint of `manifest`
/// (`parc check --resume`), or why the checkpoint cannot be re-sharded.
pub fn plan_all(manifest: &Manifest, new: &Layout) -> Result<Vec<RankRead>> {
    let old = recorded_layout(manifest)?;
    (0..new.world())
        .map(|rank| plan_rank(old, new, rank))
        .collect()
}

/// `parc reshard`: write the checkpoint `checkpoint` (manifest `manifest`) re-sharded for the
/// plan of layout `new` and hash `plan_hash` as a finished checkpoint of the same step in the
/// checkpoint folder `out`, which `--resume` of that plan loads without re-sharding (and
/// verifies: each new shard records its checksums). Returns the new checkpoint's folder and
/// what each new rank read.
pub fn write_checkpoint(
    checkpoint: &Path,
    manifest: &Manifest,
    new: &Layout,
    plan_hash: &str,
    out: &Path,
) -> Result<(PathBuf, Vec<RankRead>)> {
    let old = recorded_layout(manifest)?;
    let staging = super::store::prepare(out, manifest.step)?;
    let mut reads = Vec::with_capacity(new.ranks.len());
    for rank in 0..new.world() {
        let read = plan_rank(old, new, rank)?;
        super::store::write_shard(&staging, rank, &read_rank(checkpoint, old, &read)?)?;
        reads.push(read);
    }
    let resharded = Manifest {
        plan_hash: plan_hash.to_string(),
        world: new.world(),
        shards: (0..new.world()).map(shard_file_name).collect(),
        checksums: Default::default(),
        layout: Some(new.clone()),
        samples_seen: Some(super::samples_seen(manifest, new.global_batch)),
        ..manifest.clone()
    };
    Ok((super::store::commit(out, &resharded, 0)?, reads))
}

#[cfg(test)]
mod tests {
    use super::super::layout::{GlobalParam, TpPart, ZeroPart};
    use super::super::store::tests::temp_dir;
    use super::*;

    fn piece(
        tensor: &str,
        shape: Vec<u64>,
        role: Role,
        tp: Option<u32>,
        zero: Option<ZeroPart>,
    ) -> Piece {
        Piece {
            tensor: tensor.to_string(),
            shape,
            param: Some("w".to_string()),
            role: Some(role),
            tp: tp.map(|index| TpPart {
                dim: 1,
                parts: 2,
                index,
                sections: None,
            }),
            zero,
            replicated: false,
        }
    }

    fn layout(ranks: Vec<Vec<Piece>>) -> Layout {
        Layout {
            params: vec![GlobalParam {
                name: "w".to_string(),
                shape: vec![2, 4],
            }],
            optimizer: "adamw".to_string(),
            precision: "fp32".to_string(),
            global_batch: 8,
            ranks,
        }
    }

    fn history(tensor: &str, len: u64) -> Piece {
        Piece {
            tensor: tensor.to_string(),
            shape: vec![1, len],
            param: None,
            role: None,
            tp: None,
            zero: None,
            replicated: true,
        }
    }

    #[test]
    fn an_amax_history_is_read_whole_by_name_or_starts_cold() {
        let h = "blocks.0.mlp.up.fwd.x.amax_history";
        let old = layout(vec![vec![history(h, 5)], vec![history(h, 5)]]);
        // Its own old rank's copy first.
        let read = plan_rank(&old, &layout(vec![vec![], vec![history(h, 5)]]), 1).unwrap();
        let runs = &read.tensors[0].runs;
        assert_eq!((runs.len(), runs[0].shard, runs[0].len), (1, 1, 5));
        // A rank the old plan did not have reads another's.
        let new = layout(vec![vec![], vec![], vec![history(h, 5)]]);
        assert_eq!(
            plan_rank(&old, &new, 2).unwrap().tensors[0].runs[0].shard,
            0
        );
        // Not in the checkpoint (a current-scaling run's): nothing read, it starts at zero.
        let other = layout(vec![vec![history("blocks.1.mlp.up.fwd.x.amax_history", 5)]]);
        assert!(plan_rank(&old, &other, 0).unwrap().tensors[0]
            .runs
            .is_empty());
        // Another history length is refused, naming it.
        let longer = layout(vec![vec![history(h, 9)]]);
        let err = plan_rank(&old, &longer, 0).unwrap_err().to_string();
        assert!(err.contains(h) && err.contains("history length"), "{err}");
    }

    #[test]
    fn a_per_tensor_history_reads_the_per_gemm_history_of_an_earlier_checkpoint() {
        // Saved when each GEMM kept its own history: the forward's history of gate's x.
        let old = layout(vec![vec![
            history("blocks.0.mlp.gate.bwd_weight.x.amax_history", 5),
            history("blocks.0.mlp.gate.fwd.x.amax_history", 5),
        ]]);
        let new = layout(vec![vec![history("blocks.0.mlp.gate.x.amax_history", 5)]]);
        let runs = &plan_rank(&old, &new, 0).unwrap().tensors[0].runs;
        assert_eq!((runs.len(), runs[0].tensor, runs[0].len), (1, 1, 5));
        assert!(earlier_names("blocks.0.mlp.gate.norm").is_empty());
    }

    #[test]
    fn a_zero_shard_reads_its_runs_from_the_tp_blocks_that_hold_them() {
        // w = [[0, 1, 2, 3], [4, 5, 6, 7]]: columns 0-1 on old rank 0, 2-3 on old rank 1.
        let old = layout(vec![
            vec![piece("w@0", vec![2, 2], Role::Master, Some(0), None)],
            vec![piece("w@1", vec![2, 2], Role::Master, Some(1), None)],
        ]);
        // The new rank holds ZeRO shard 1 of 2 (elements 5..10 of the flat tensor, 2 of padding).
        let zero = ZeroPart {
            shard_len: 5,
            index: 1,
        };
        let new = layout(vec![vec![piece(
            "w.master",
            vec![5],
            Role::Master,
            None,
            Some(zero),
        )]]);
        let read = plan_rank(&old, &new, 0).unwrap();
        let run = |shard, src, dst, len| Run {
            shard,
            tensor: 0,
            src,
            dst,
            len,
        };
        assert_eq!(read.tensors[0].runs, [run(0, 3, 0, 1), run(1, 2, 1, 2)]);
        assert_eq!(read.bytes(), 4 * 3);
        assert_eq!(read.shards().into_iter().collect::<Vec<_>>(), [0, 1]);
        let dir = temp_dir("reshard-runs");
        let blocks = [[0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0]];
        for (rank, values) in blocks.iter().enumerate() {
            let tensor = ShardTensor {
                name: old.ranks[rank][0].tensor.clone(),
                shape: vec![2, 2],
                data: values.to_vec(),
            };
            super::super::store::write_shard(&dir, rank as u32, &[tensor]).unwrap();
        }
        let tensors = read_rank(&dir, &old, &read).unwrap();
        assert_eq!(tensors[0].data, [5.0, 6.0, 7.0, 0.0, 0.0]);
        // An element no old shard holds is an error naming the parameter.
        let half = layout(vec![old.ranks[0].clone()]);
        let err = plan_rank(&half, &new, 0).unwrap_err().to_string();
        assert!(err.contains("parameter w"), "{err}");
    }
}
