//! Reading and writing checkpoint files: atomic writes (temp file, fsync, rename, fsync of the
//! folder), safetensors shards, the JSON manifest, pruning to the newest `keep`, and loading
//! with errors that say which file is wrong and what to do.
use super::{shard_file_name, step_dir_name, verify, Manifest, SpecSource, FORMAT, SPEC_KEY};
use crate::error::{Result, RuntimeError};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// A named f32 tensor of a rank's shard.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub data: Vec<f32>,
}

fn io_error(context: String) -> impl FnOnce(std::io::Error) -> RuntimeError {
    move |source| {
        if source.kind() == std::io::ErrorKind::StorageFull {
            return RuntimeError::Checkpoint(format!(
                "{context}: no space left on the disk ({source}); free space there or set \
                 train.checkpoint.dir to a disk with room (the unfinished file was removed, \
                 finished checkpoints are untouched)"
            ));
        }
        RuntimeError::Io { context, source }
    }
}

fn ckpt_error(path: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Checkpoint(format!("{}: {what}", path.display()))
}

/// fsync a folder so a rename inside it is durable.
fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_error(format!("syncing folder {}", dir.display())))
}

/// The temporary name `path` is written under before [`publish`] renames it.
fn temp_path(path: &Path) -> PathBuf {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    PathBuf::from(tmp)
}

/// Rename the written and fsynced `tmp` to `path`.
fn publish(tmp: &Path, path: &Path) -> Result<()> {
    std::fs::rename(tmp, path).map_err(io_error(format!(
        "renaming {} to {}",
        tmp.display(),
        path.display()
    )))
}

/// Write `bytes` to `path` atomically: `path.tmp`, fsync, rename.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(path);
    let context = format!("writing {}", tmp.display());
    let mut file = File::create(&tmp).map_err(io_error(context.clone()))?;
    let written = super::fault::write_all(&mut file, bytes).and_then(|()| file.sync_all());
    if let Err(e) = written {
        // A partial file only takes space (a full disk's last bytes).
        let _ = std::fs::remove_file(&tmp);
        return Err(io_error(context)(e));
    }
    publish(&tmp, path)
}

/// The temporary folder the checkpoint of `step` is assembled in.
pub fn staging_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!(".{}.tmp", step_dir_name(step)))
}

/// Create an empty staging folder for the checkpoint after `step` steps (removing leftovers of
/// an interrupted write). Called once, before any rank writes its shard.
pub fn prepare(dir: &Path, step: u64) -> Result<PathBuf> {
    let staging = staging_dir(dir, step);
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(io_error(format!(
            "removing the unfinished checkpoint {}",
            staging.display()
        )))?;
    }
    std::fs::create_dir_all(&staging).map_err(io_error(format!(
        "creating checkpoint folder {} (is the path writable?)",
        staging.display()
    )))?;
    Ok(staging)
}

/// A named f32 tensor to write, borrowed (a snapshot's range, or a [`ShardTensor`]'s data).
#[derive(Clone, Copy, Debug)]
pub struct TensorSlice<'a> {
    pub name: &'a str,
    pub shape: &'a [u64],
    pub data: &'a [f32],
}

impl<'a> From<&'a ShardTensor> for TensorSlice<'a> {
    fn from(t: &'a ShardTensor) -> Self {
        TensorSlice {
            name: &t.name,
            shape: &t.shape,
            data: &t.data,
        }
    }
}

/// The little-endian bytes of `data`: the values themselves on a little-endian machine.
fn le_bytes(data: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(data))
    } else {
        std::borrow::Cow::Owned(data.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// Serialize f32 tensors as one safetensors file at `path`, atomically (streamed from the
/// tensors' memory to `path.tmp`, fsync, rename); with `checksums`, the metadata also records
/// each tensor's CRC-32C (`verify::CHECKSUMS_KEY`).
fn write_safetensors(
    path: &Path,
    tensors: &[TensorSlice<'_>],
    mut metadata: Option<HashMap<String, String>>,
    checksums: bool,
) -> Result<()> {
    let bytes: Vec<std::borrow::Cow<'_, [u8]>> = tensors.iter().map(|t| le_bytes(t.data)).collect();
    if checksums {
        let sums: verify::TensorChecksums = tensors
            .iter()
            .zip(&bytes)
            .map(|(t, b)| (t.name.to_string(), verify::checksum(b)))
            .collect();
        let json = serde_json::to_string(&sums).map_err(|e| ckpt_error(path, e))?;
        metadata
            .get_or_insert_with(Default::default)
            .insert(verify::CHECKSUMS_KEY.to_string(), json);
    }
    let mut views = BTreeMap::new();
    for (tensor, data) in tensors.iter().zip(&bytes) {
        let shape = tensor
            .shape
            .iter()
            .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
            .collect();
        let view = TensorView::new(Dtype::F32, shape, data)
            .map_err(|e| ckpt_error(path, format!("tensor {}: {e}", tensor.name)))?;
        views.insert(tensor.name.to_string(), view);
    }
    if super::fault::is_armed() {
        // The chaos tests' write faults hook plain writes: serialize in memory and write that.
        let bytes = safetensors::serialize(views, metadata)
            .map_err(|e| ckpt_error(path, format!("cannot serialize: {e}")))?;
        return write_atomic(path, &bytes);
    }
    let tmp = temp_path(path);
    if let Err(e) = safetensors::serialize_to_file(views, metadata, &tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(match e {
            safetensors::SafeTensorError::IoError(source) => {
                io_error(format!("writing {}", tmp.display()))(source)
            }
            other => ckpt_error(&tmp, format!("cannot write: {other}")),
        });
    }
    File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(io_error(format!("syncing {}", tmp.display())))?;
    publish(&tmp, path)
}

/// The metadata of a saved model: its step and, when given, its spec.
fn model_metadata(
    step: u64,
    source: Option<&SpecSource>,
) -> Result<std::collections::HashMap<String, String>> {
    let mut metadata = std::collections::HashMap::from([("step".to_string(), step.to_string())]);
    if let Some(source) = source {
        let json = serde_json::to_string(source).map_err(|e| {
            RuntimeError::Checkpoint(format!("cannot record the spec in the model file: {e}"))
        })?;
        metadata.insert(SPEC_KEY.to_string(), json);
    }
    Ok(metadata)
}

/// Write `rank`'s tensors into the staging folder (a re-sharded checkpoint's: no backend
/// choices, which belong to the run that made them).
pub fn write_shard(staging: &Path, rank: u32, tensors: &[ShardTensor]) -> Result<()> {
    let slices: Vec<TensorSlice<'_>> = tensors.iter().map(TensorSlice::from).collect();
    write_shard_slices(staging, rank, &slices, None)
}

/// [`write_shard`] of borrowed tensors (a snapshot's, `super::writer`), with the rank's backend
/// choices (`Backend::choices`) in the file's metadata under [`CHOICES_KEY`].
pub fn write_shard_slices(
    staging: &Path,
    rank: u32,
    tensors: &[TensorSlice<'_>],
    choices: Option<&str>,
) -> Result<()> {
    let metadata = choices.map(|c| HashMap::from([(CHOICES_KEY.to_string(), c.to_string())]));
    write_safetensors(
        &staging.join(shard_file_name(rank)),
        tensors,
        metadata,
        true,
    )
}

/// The shard metadata key of a rank's backend choices (`Backend::choices`).
pub const CHOICES_KEY: &str = "parc.backend_choices";

/// Where [`write_model`] puts the global parameters of a checkpoint folder `dir`.
pub fn model_path(dir: &Path) -> PathBuf {
    dir.join("model.safetensors")
}

/// Export the model's parameters as global tensors (independent of the plan: loadable by any
/// safetensors reader) to `DIR/model.safetensors`, with the step in the file's metadata.
pub fn write_model(
    dir: &Path,
    step: u64,
    params: &[ShardTensor],
    source: Option<&SpecSource>,
) -> Result<PathBuf> {
    let path = model_path(dir);
    write_params(&path, step, params, source)?;
    Ok(path)
}

/// Write global parameters (as [`write_model`] does) to the file `path`, creating its folder,
/// with `step` (the optimizer steps they have had) and the run's spec (`saved::SPEC_KEY`) in
/// the file's metadata.
pub fn write_params(
    path: &Path,
    step: u64,
    params: &[ShardTensor],
    source: Option<&SpecSource>,
) -> Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(io_error(format!(
        "creating folder {} for {} (is the path writable?)",
        dir.display(),
        path.display()
    )))?;
    let slices: Vec<TensorSlice<'_>> = params.iter().map(TensorSlice::from).collect();
    write_safetensors(path, &slices, Some(model_metadata(step, source)?), false)?;
    sync_dir(dir)
}

/// Finish the checkpoint of `manifest.step`: write the manifest (with the checksums the shards
/// recorded), publish the staging folder as `DIR/step-N`, and delete all but the newest `keep`
/// checkpoints (0 keeps all).
pub fn commit(dir: &Path, manifest: &Manifest, keep: u32) -> Result<PathBuf> {
    let staging = staging_dir(dir, manifest.step);
    for shard in &manifest.shards {
        if !staging.join(shard).is_file() {
            return Err(ckpt_error(
                &staging,
                format!("shard {shard} was not written"),
            ));
        }
    }
    let manifest = Manifest {
        checksums: verify::collect_checksums(&staging, &manifest.shards)?,
        ..manifest.clone()
    };
    let json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| ckpt_error(&staging, format!("manifest: {e}")))?;
    write_atomic(&staging.join("manifest.json"), &json)?;
    sync_dir(&staging)?;
    let target = dir.join(step_dir_name(manifest.step));
    if target.exists() {
        std::fs::remove_dir_all(&target).map_err(io_error(format!(
            "replacing the older checkpoint {}",
            target.display()
        )))?;
    }
    std::fs::rename(&staging, &target).map_err(io_error(format!(
        "renaming {} to {}",
        staging.display(),
        target.display()
    )))?;
    sync_dir(dir)?;
    if keep > 0 {
        let mut all = list_steps(dir)?;
        while all.len() > keep as usize {
            let (_, oldest) = all.remove(0);
            if oldest == target {
                eprintln!(
                    "note: {} was removed at once: {} holds {keep} newer checkpoints of an \
                     earlier run (checkpoint.keep = {keep}); give this run its own \
                     checkpoint.dir to keep its checkpoints",
                    target.display(),
                    dir.display()
                );
            }
            std::fs::remove_dir_all(&oldest).map_err(io_error(format!(
                "removing old checkpoint {}",
                oldest.display()
            )))?;
        }
    }
    Ok(target)
}

/// Finished checkpoints in `dir`, oldest first.
fn list_steps(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        ckpt_error(
            dir,
            format!("cannot read the checkpoint folder ({e}); check the --resume path"),
        )
    })?;
    let mut steps: Vec<(u64, PathBuf)> = entries
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step-")?.parse().ok()?;
            entry
                .path()
                .join("manifest.json")
                .is_file()
                .then(|| (step, entry.path()))
        })
        .collect();
    steps.sort();
    Ok(steps)
}

/// The finished checkpoint folders in `dir`, oldest first.
pub fn finished_steps(dir: &Path) -> Result<Vec<PathBuf>> {
    Ok(list_steps(dir)?.into_iter().map(|(_, p)| p).collect())
}

/// What `--resume` is for, for the errors of weights given to it.
const RESUME_IS: &str = "--resume continues a run from its checkpoint folder (the spec's \
                         checkpoint.dir, or one of its step-N folders)";

/// Why `path`, which exists and holds no manifest, is not a checkpoint when it is weights of
/// another kind, and how to start from them (docs/run.md, "Hugging Face weights"): a Hugging
/// Face folder or its safetensors file is `train.init = hf(DIR)`; a run's final
/// model.safetensors is resumed from its folder; another safetensors file is exported to a
/// Hugging Face folder first. `None` for a folder that may hold checkpoints.
fn not_a_checkpoint(path: &Path) -> Option<String> {
    let hf = |dir: &Path| {
        format!(
            "is a Hugging Face model, not a checkpoint: {RESUME_IS}. To start training from \
             these weights, set `train.init = hf(\"{}\")` in the spec (or `--set \
             'train.init=hf(\"{}\")'`; a relative path there is relative to the spec's folder)",
            dir.display(),
            dir.display()
        )
    };
    let has_steps = |dir: &Path| list_steps(dir).is_ok_and(|steps| !steps.is_empty());
    if path.is_dir() {
        return (path.join("config.json").is_file() && !has_steps(path)).then(|| hf(path));
    }
    let folder = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if folder.join("config.json").is_file() {
        return Some(hf(folder));
    }
    if has_steps(folder) {
        return Some(format!(
            "is the final model of the run whose checkpoints are in {}, not a checkpoint: \
             {RESUME_IS}; to continue that run, give its folder: `--resume {}`",
            folder.display(),
            folder.display()
        ));
    }
    let weights = path.extension().is_some_and(|e| e == "safetensors");
    Some(if weights {
        format!(
            "is a model file, not a checkpoint: {RESUME_IS}. To start training from its \
             weights, write it as a Hugging Face folder (`parc export {} --format hf OUT`, for \
             a model file parc wrote) and set `train.init = hf(\"OUT\")` in the spec",
            path.display()
        )
    } else {
        format!("is a file, not a checkpoint: {RESUME_IS}")
    })
}

/// The checkpoint `path` names: `path` itself when it holds a manifest, else the newest
/// finished checkpoint inside it.
pub fn find_latest(path: &Path) -> Result<PathBuf> {
    if !path.exists() {
        return Err(ckpt_error(
            path,
            "no such folder; pass a checkpoint folder (the spec's checkpoint.dir or one of its \
             step-N folders)",
        ));
    }
    if path.join("manifest.json").is_file() {
        return Ok(path.to_path_buf());
    }
    if let Some(what) = not_a_checkpoint(path) {
        return Err(ckpt_error(path, what));
    }
    list_steps(path)?.pop().map(|(_, p)| p).ok_or_else(|| {
        ckpt_error(
            path,
            "holds no finished checkpoint (no step-N folder with a manifest.json)",
        )
    })
}

/// Read and check the manifest of checkpoint folder `checkpoint`.
pub fn read_manifest(checkpoint: &Path) -> Result<Manifest> {
    let path = checkpoint.join("manifest.json");
    let bytes = std::fs::read(&path).map_err(|e| ckpt_error(&path, format!("cannot read: {e}")))?;
    let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
        ckpt_error(
            &path,
            format!("corrupt manifest ({e}); use another checkpoint"),
        )
    })?;
    if manifest.format == 0 || manifest.format > FORMAT {
        return Err(ckpt_error(
            &path,
            format!(
                "manifest format {} is not one this parc reads (1 to {FORMAT}); use the parc \
                 that wrote it",
                manifest.format
            ),
        ));
    }
    Ok(manifest)
}

/// Little-endian f32 values of a tensor's bytes (an F32 safetensors view's data).
pub(super) fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Read `rank`'s shard of checkpoint folder `checkpoint`: the tensors named in `expected` with
/// exactly those shapes, in that order.
/// A rank's shard read back: its tensors in the order asked for, and its backend's choices
/// (`Backend::choices`; None in a CPU run's shard or a re-sharded one).
#[derive(Debug)]
pub struct Shard {
    pub tensors: Vec<Vec<f32>>,
    pub choices: Option<String>,
}

pub fn read_shard(checkpoint: &Path, rank: u32, expected: &[(String, Vec<u64>)]) -> Result<Shard> {
    let path = checkpoint.join(shard_file_name(rank));
    let bytes = std::fs::read(&path)
        .map_err(|e| ckpt_error(&path, format!("cannot read rank {rank}'s shard: {e}")))?;
    let corrupt = |e: safetensors::SafeTensorError| {
        ckpt_error(
            &path,
            format!(
                "corrupt safetensors file: {}; use another checkpoint",
                crate::safetensors_header::explain(&bytes, &e)
            ),
        )
    };
    let file = SafeTensors::deserialize(&bytes).map_err(corrupt)?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(corrupt)?;
    let choices = (header.metadata().as_ref()).and_then(|m| m.get(CHOICES_KEY).cloned());
    let tensors = expected
        .iter()
        .map(|(name, shape)| {
            let view = file.tensor(name).map_err(|_| {
                ckpt_error(
                    &path,
                    format!("has no tensor {name}; it was written by another plan or model"),
                )
            })?;
            let got: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
            if view.dtype() != Dtype::F32 || &got != shape {
                return Err(ckpt_error(
                    &path,
                    format!(
                        "tensor {name} is {:?} {got:?}, but this plan needs F32 {shape:?}",
                        view.dtype()
                    ),
                ));
            }
            Ok(f32_values(view.data()))
        })
        .collect::<Result<_>>()?;
    Ok(Shard { tensors, choices })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::checkpoint) fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("parc-ckpt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn manifest(step: u64, world: u32) -> Manifest {
        Manifest {
            format: FORMAT,
            plan_hash: "0123456789abcdef".to_string(),
            world,
            step,
            optimizer_step: step,
            seed: 3,
            samples: 100,
            loss_scale: None,
            shards: (0..world).map(shard_file_name).collect(),
            checksums: Default::default(),
            layout: None,
            samples_seen: None,
            data: None,
        }
    }

    fn tensors(rank: u32, step: u64) -> Vec<ShardTensor> {
        vec![
            ShardTensor {
                name: "embed.weight".to_string(),
                shape: vec![2, 3],
                data: (0..6)
                    .map(|i| i as f32 + rank as f32 * 10.0 + step as f32)
                    .collect(),
            },
            ShardTensor {
                name: "loss".to_string(),
                shape: vec![1],
                data: vec![f32::from_bits(0x3f80_0001)],
            },
        ]
    }

    pub(in crate::checkpoint) fn save(dir: &Path, step: u64, keep: u32) -> PathBuf {
        let staging = prepare(dir, step).unwrap();
        for rank in 0..2 {
            write_shard(&staging, rank, &tensors(rank, step)).unwrap();
        }
        commit(dir, &manifest(step, 2), keep).unwrap()
    }

    fn expected() -> Vec<(String, Vec<u64>)> {
        vec![
            ("loss".to_string(), vec![1]),
            ("embed.weight".to_string(), vec![2, 3]),
        ]
    }

    #[test]
    fn the_model_export_holds_global_tensors_and_the_step() {
        let dir = temp_dir("model");
        let path = write_model(&dir, 12, &tensors(0, 0), None).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let step = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get("step").cloned());
        assert_eq!(step.as_deref(), Some("12"));
        let back = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(back.tensor("embed.weight").unwrap().shape(), [2, 3]);
    }

    #[test]
    fn a_saved_checkpoint_reads_back_bit_exactly_and_only_the_newest_are_kept() {
        let dir = temp_dir("roundtrip");
        for step in [10, 20, 30] {
            save(&dir, step, 2);
        }
        let latest = find_latest(&dir).unwrap();
        assert!(latest.ends_with("step-00000030"));
        assert!(!dir.join("step-00000010").exists());
        assert!(dir.join("step-00000020").exists());
        let back = read_manifest(&latest).unwrap();
        assert_eq!(back.checksums.len(), 2);
        assert_eq!(
            back.checksums[&shard_file_name(1)]["loss"],
            verify::checksum(&f32::from_bits(0x3f80_0001).to_le_bytes())
        );
        assert_eq!(
            Manifest {
                checksums: Default::default(),
                ..back
            },
            manifest(30, 2)
        );
        let back = read_shard(&latest, 1, &expected()).unwrap().tensors;
        assert_eq!(back[0][0].to_bits(), 0x3f80_0001);
        assert_eq!(back[1], tensors(1, 30)[0].data);
        // Naming a step folder directly works too; leftovers of a crashed write are ignored.
        std::fs::create_dir_all(dir.join(".step-00000040.tmp")).unwrap();
        let step20 = find_latest(&dir.join("step-00000020")).unwrap();
        assert_eq!(read_manifest(&step20).unwrap().step, 20);
        assert!(find_latest(&dir).unwrap().ends_with("step-00000030"));
    }

    fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn missing_corrupt_and_mismatched_checkpoints_are_clear_errors() {
        let dir = temp_dir("errors");
        let missing = err(find_latest(&dir.join("absent")));
        assert!(
            missing.contains("absent") && missing.contains("no such folder"),
            "{missing}"
        );
        let empty = err(find_latest(&dir));
        assert!(empty.contains("no finished checkpoint"), "{empty}");
        let ckpt = save(&dir, 5, 0);
        let shape = err(read_shard(
            &ckpt,
            0,
            &[("embed.weight".to_string(), vec![3, 2])],
        ));
        assert!(
            shape.contains("embed.weight") && shape.contains("[3, 2]"),
            "{shape}"
        );
        let name = err(read_shard(
            &ckpt,
            0,
            &[("head.weight".to_string(), vec![1])],
        ));
        assert!(name.contains("no tensor head.weight"), "{name}");
        let shard = ckpt.join(shard_file_name(0));
        std::fs::write(&shard, b"not a safetensors file").unwrap();
        let corrupt = err(read_shard(&ckpt, 0, &expected()));
        assert!(
            corrupt.contains("rank-00000") && corrupt.contains("corrupt"),
            "{corrupt}"
        );
        // A header that is not JSON.
        let mut not_json = 3u64.to_le_bytes().to_vec();
        not_json.extend(b"{x}");
        std::fs::write(&shard, not_json).unwrap();
        let header = err(read_shard(&ckpt, 0, &expected()));
        assert!(
            header.contains("rank-00000") && header.contains("corrupt safetensors file"),
            "{header}"
        );
        // A shard written without choices (a CPU run's) carries none.
        let plain = read_shard(&save(&dir, 7, 0), 1, &expected()).unwrap();
        assert_eq!(plain.choices, None);
        std::fs::write(ckpt.join("manifest.json"), b"{").unwrap();
        let bad = err(read_manifest(&ckpt));
        assert!(bad.contains("corrupt manifest"), "{bad}");
        // A commit whose shards are missing is refused and publishes nothing.
        prepare(&dir, 6).unwrap();
        assert!(commit(&dir, &manifest(6, 2), 0).is_err());
        assert!(!dir.join("step-00000006").exists());
    }

    /// Weights that are not a checkpoint — a Hugging Face folder, its model.safetensors, a
    /// model file of parc's — say how to start a run from them (`train.init = hf(…)`), or, for
    /// a run's final model, which folder resumes that run; `--resume` used to call them an
    /// unreadable or empty checkpoint folder.
    #[test]
    fn weights_that_are_not_a_checkpoint_say_how_to_start_from_them() {
        let dir = temp_dir("not-a-checkpoint");
        let hf = dir.join("hf");
        std::fs::create_dir_all(&hf).unwrap();
        std::fs::write(hf.join("config.json"), b"{}").unwrap();
        std::fs::write(hf.join("model.safetensors"), b"").unwrap();
        let init = format!("train.init = hf(\"{}\")", hf.display());
        for path in [hf.clone(), hf.join("model.safetensors")] {
            let e = err(find_latest(&path));
            assert!(
                e.contains("Hugging Face") && e.contains(&init) && e.contains("not a checkpoint"),
                "{e}"
            );
        }
        let alone = dir.join("weights.safetensors");
        std::fs::write(&alone, b"").unwrap();
        let e = err(find_latest(&alone));
        assert!(
            e.contains("not a checkpoint")
                && e.contains("parc export")
                && e.contains("train.init = hf("),
            "{e}"
        );
        // A run's final model beside its step-N folders: resume the folder.
        let run = dir.join("run");
        save(&run, 5, 0);
        std::fs::write(run.join("model.safetensors"), b"").unwrap();
        let e = err(find_latest(&run.join("model.safetensors")));
        assert!(e.contains(&format!("--resume {}", run.display())), "{e}");
    }
}
