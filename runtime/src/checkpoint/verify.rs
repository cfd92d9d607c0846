//! Checkpoint integrity: a CRC-32C per tensor, recorded when a shard is written (in the shard's
//! safetensors metadata, then copied into the manifest when the checkpoint is committed) and
//! verified against the manifest before a run resumes. A checkpoint folder given to `--resume`
//! resumes from its newest checkpoint that verifies, saying on stderr which it skipped and why.
//!
//! CRC-32C (Castagnoli) because it is computed in hardware on x86-64 (SSE 4.2) and aarch64
//! (several GB/s, negligible next to the disk), detects every single-bit flip and every burst
//! of up to 32 bits, and the `crc32c` crate was already in the workspace. It guards against
//! corruption (bit rot, truncated copies, torn writes), not against tampering.
use super::{Manifest, FORMAT};
use crate::error::{Result, RuntimeError};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The shard metadata key holding its tensors' checksums (a JSON map name → CRC-32C).
pub const CHECKSUMS_KEY: &str = "parc.crc32c";

/// Checksums of one shard: tensor name → CRC-32C of its little-endian bytes.
pub type TensorChecksums = BTreeMap<String, u32>;

/// The CRC-32C of a tensor's bytes.
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

fn refuse(path: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Checkpoint(format!("{}: {what}", path.display()))
}

/// A safetensors header: where the data starts, each tensor's byte range in the data, and the
/// file's metadata. Read without the data, so a truncated file still names its tensors.
struct Header {
    data_start: u64,
    ranges: BTreeMap<String, (u64, u64)>,
    metadata: HashMap<String, String>,
}

#[derive(serde::Deserialize)]
struct HeaderEntry {
    data_offsets: (u64, u64),
}

fn read_header(path: &Path, file: &mut impl Read) -> Result<Header> {
    let corrupt = |what: String| refuse(path, format!("{what}; use another checkpoint"));
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|e| corrupt(format!("cannot read the safetensors header ({e})")))?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(corrupt(format!(
            "corrupt safetensors file (a header of {len} bytes)"
        )));
    }
    let mut json = vec![0u8; len as usize];
    file.read_exact(&mut json)
        .map_err(|e| corrupt(format!("the safetensors header is cut short ({e})")))?;
    let mut entries: HashMap<String, serde_json::Value> = serde_json::from_slice(&json)
        .map_err(|e| corrupt(format!("corrupt safetensors header ({e})")))?;
    let metadata = match entries.remove("__metadata__") {
        Some(value) => serde_json::from_value(value)
            .map_err(|e| corrupt(format!("corrupt safetensors metadata ({e})")))?,
        None => HashMap::new(),
    };
    let ranges = entries
        .into_iter()
        .map(|(name, value)| {
            let entry: HeaderEntry = serde_json::from_value(value)
                .map_err(|e| corrupt(format!("corrupt header entry of tensor {name} ({e})")))?;
            Ok((name, entry.data_offsets))
        })
        .collect::<Result<_>>()?;
    Ok(Header {
        data_start: 8 + len,
        ranges,
        metadata,
    })
}

fn open(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| refuse(path, format!("cannot open the shard ({e})")))
}

/// The checksums a shard recorded in its metadata when it was written.
pub fn shard_checksums(path: &Path) -> Result<TensorChecksums> {
    let header = read_header(path, &mut BufReader::new(open(path)?))?;
    let json = header.metadata.get(CHECKSUMS_KEY).ok_or_else(|| {
        refuse(
            path,
            format!("the shard records no checksums (metadata {CHECKSUMS_KEY})"),
        )
    })?;
    serde_json::from_str(json).map_err(|e| refuse(path, format!("corrupt {CHECKSUMS_KEY} ({e})")))
}

/// Check every tensor of the shard at `path` against `expected`: present, inside the file, and
/// with the recorded checksum. The error names the file and the tensor.
fn verify_shard(path: &Path, expected: &TensorChecksums) -> Result<()> {
    let mut file = open(path)?;
    let size = file
        .metadata()
        .map_err(|e| refuse(path, format!("cannot stat the shard ({e})")))?
        .len();
    let header = read_header(path, &mut BufReader::new(&mut file))?;
    let mut order: Vec<(&String, &u32)> = expected.iter().collect();
    order.sort_by_key(|(name, _)| header.ranges.get(*name).map(|r| r.0));
    for (name, &want) in order {
        let &(start, end) = header.ranges.get(name).ok_or_else(|| {
            refuse(
                path,
                format!("has no tensor {name}, which the manifest lists"),
            )
        })?;
        let (from, to) = (header.data_start + start, header.data_start + end);
        if to > size || start > end {
            return Err(refuse(
                path,
                format!(
                    "tensor {name} needs bytes {from}..{to} but the file has {size}: the shard \
                     is truncated; use another checkpoint"
                ),
            ));
        }
        let got = crc_of_range(path, &mut file, from, to - from)?;
        if got != want {
            return Err(refuse(
                path,
                format!(
                    "tensor {name} fails its checksum (CRC-32C {got:08x}, the manifest \
                     records {want:08x}): the data is corrupt; use another checkpoint"
                ),
            ));
        }
    }
    Ok(())
}

/// The CRC-32C of `len` bytes of `file` from `offset`, read in bounded chunks.
fn crc_of_range(path: &Path, file: &mut File, offset: u64, len: u64) -> Result<u32> {
    let read_error = |e: std::io::Error| refuse(path, format!("cannot read the shard ({e})"));
    file.seek(SeekFrom::Start(offset)).map_err(read_error)?;
    let mut reader = BufReader::new(file.take(len));
    let mut crc = 0;
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut chunk).map_err(read_error)?;
        if n == 0 {
            return Ok(crc);
        }
        crc = crc32c::crc32c_append(crc, &chunk[..n]);
    }
}

/// Verify every shard of the checkpoint folder `checkpoint` against its manifest. A manifest
/// of format 1 has no checksums: accepted unverified, with a note on stderr.
pub fn verify(checkpoint: &Path, manifest: &Manifest) -> Result<()> {
    if manifest.format < FORMAT {
        eprintln!(
            "note: {} was written by an older parc (manifest format {}) without checksums; \
             it is loaded unverified",
            checkpoint.display(),
            manifest.format
        );
        return Ok(());
    }
    for (rank, shard) in manifest.shards.iter().enumerate() {
        let expected = manifest.checksums.get(shard).ok_or_else(|| {
            refuse(
                &checkpoint.join("manifest.json"),
                format!("records no checksums for shard {shard} (rank {rank})"),
            )
        })?;
        verify_shard(&checkpoint.join(shard), expected)?;
    }
    Ok(())
}

/// Read and verify the checkpoint `checkpoint`.
fn verified(checkpoint: &Path) -> Result<Manifest> {
    let manifest = super::read_manifest(checkpoint)?;
    verify(checkpoint, &manifest)?;
    Ok(manifest)
}

/// The checkpoint `--resume PATH` continues, verified: `PATH` itself when it is a checkpoint
/// (refused when it does not verify); for a checkpoint folder, its newest checkpoint that
/// verifies, with a note on stderr naming each newer one skipped and why.
pub fn choose_resume(path: &Path) -> Result<(PathBuf, Manifest)> {
    let latest = super::find_latest(path)?;
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

/// Each of `shards` (files in `staging`) with the checksums it recorded when written.
pub fn collect_checksums(
    staging: &Path,
    shards: &[String],
) -> Result<BTreeMap<String, TensorChecksums>> {
    shards
        .iter()
        .map(|shard| Ok((shard.clone(), shard_checksums(&staging.join(shard))?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::store::tests::{save, temp_dir};
    use super::*;
    use crate::checkpoint::shard_file_name;

    fn shard_path(checkpoint: &Path, rank: u32) -> PathBuf {
        checkpoint.join(shard_file_name(rank))
    }

    /// Flip one bit in the data of `shard`'s tensor `name`.
    fn flip_bit(shard: &Path, name: &str) {
        let mut bytes = std::fs::read(shard).unwrap();
        let header = read_header(shard, &mut bytes.as_slice()).unwrap();
        let (start, _) = header.ranges[name];
        bytes[(header.data_start + start) as usize] ^= 0x10;
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
