//! Which checkpoint `--resume PATH` continues: a checkpoint named directly must verify
//! (`super::verify`); from a checkpoint folder, the newest one that verifies, with a note on
//! stderr for each newer one skipped and why.
use super::Manifest;
use crate::error::{Result, RuntimeError};
use std::path::{Path, PathBuf};

fn refuse(path: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Checkpoint(format!("{}: {what}", path.display()))
}

/// Read and verify the checkpoint `checkpoint`.
fn verified(checkpoint: &Path) -> Result<Manifest> {
    let manifest = super::store::read_manifest(checkpoint)?;
    super::verify::verify(checkpoint, &manifest)?;
    Ok(manifest)
}

/// The checkpoint `--resume PATH` continues, verified: `PATH` itself when it is a checkpoint
/// (refused when it does not verify); for a checkpoint folder, its newest checkpoint that
/// verifies, with a note on stderr naming each newer one skipped and why.
pub fn choose_resume(path: &Path) -> Result<(PathBuf, Manifest)> {
    let latest = super::store::find_latest(path)?;
    if latest == path {
        return verified(path).map(|m| (latest, m));
    }
    let mut skipped: Vec<(PathBuf, String)> = Vec::new();
    for candidate in super::store::finished_steps(path)?.into_iter().rev() {
        match verified(&candidate) {
            Ok(manifest) => {
                for (older, why) in &skipped {
                    eprintln!(
                        "warning: skipping checkpoint {} ({why}); resuming from {}",
                        older.display(),
                        candidate.display()
                    );
                }
                return Ok((candidate, manifest));
            }
            Err(e) => skipped.push((candidate, e.to_string())),
        }
    }
    let reasons: Vec<String> = skipped.into_iter().map(|(_, why)| why).collect();
    Err(refuse(
        path,
        format!(
            "no checkpoint in this folder verifies: {}",
            reasons.join("; ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::super::store::tests::{save, temp_dir};
    use super::*;
    use crate::checkpoint::shard_file_name;
    use safetensors::SafeTensors;

    fn shard_path(checkpoint: &Path, rank: u32) -> PathBuf {
        checkpoint.join(shard_file_name(rank))
    }

    /// Flip one bit in the data of `shard`'s tensor `name`.
    fn flip_bit(shard: &Path, name: &str) {
        let mut bytes = std::fs::read(shard).unwrap();
        let (header_len, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
        let start = metadata.info(name).unwrap().data_offsets.0;
        bytes[8 + header_len + start] ^= 0x10;
        std::fs::write(shard, bytes).unwrap();
    }

    #[test]
    fn a_flipped_bit_is_refused_naming_file_and_tensor_and_the_folder_falls_back() {
        let dir = temp_dir("verify-flip");
        save(&dir, 10, 0);
        let newest = save(&dir, 20, 0);
        assert_eq!(choose_resume(&dir).unwrap().0, newest);
        flip_bit(&shard_path(&newest, 1), "embed.weight");
        let err = choose_resume(&newest).unwrap_err().to_string();
        assert!(
            err.contains("rank-00001.safetensors")
                && err.contains("tensor embed.weight fails its checksum"),
            "{err}"
        );
        let (chosen, manifest) = choose_resume(&dir).unwrap();
        assert!(chosen.ends_with("step-00000010"), "{}", chosen.display());
        assert_eq!(manifest.step, 10);
        flip_bit(&shard_path(&chosen, 0), "loss");
        let none = choose_resume(&dir).unwrap_err().to_string();
        assert!(
            none.contains("no checkpoint in this folder verifies") && none.contains("loss"),
            "{none}"
        );
    }

    #[test]
    fn a_truncated_shard_is_refused_naming_file_and_tensor() {
        let dir = temp_dir("verify-truncated");
        let ckpt = save(&dir, 10, 0);
        let shard = shard_path(&ckpt, 0);
        let bytes = std::fs::read(&shard).unwrap();
        std::fs::write(&shard, &bytes[..bytes.len() - 3]).unwrap();
        let err = choose_resume(&ckpt).unwrap_err().to_string();
        assert!(
            err.contains("rank-00000.safetensors")
                && err.contains("tensor ")
                && err.contains("truncated"),
            "{err}"
        );
    }

    #[test]
    fn a_format_1_manifest_without_checksums_is_accepted_unverified() {
        let dir = temp_dir("verify-v1");
        let ckpt = save(&dir, 10, 0);
        let path = ckpt.join("manifest.json");
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        json["format"] = 1.into();
        json.as_object_mut().unwrap().remove("checksums");
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        flip_bit(&shard_path(&ckpt, 0), "loss");
        let (_, manifest) = choose_resume(&dir).unwrap();
        assert_eq!((manifest.format, manifest.checksums.len()), (1, 0));
    }
}
