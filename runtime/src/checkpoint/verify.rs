//! Checkpoint integrity: a CRC-32C per tensor, recorded when a shard is written (in the shard's
//! safetensors metadata, then copied into the manifest when the checkpoint is committed) and
//! verified against the manifest before a run resumes (`super::resume` chooses the checkpoint).
//!
//! CRC-32C (Castagnoli) because it is computed in hardware on x86-64 (SSE 4.2) and aarch64
//! (several GB/s, negligible next to the disk), detects every single-bit flip and every burst
//! of up to 32 bits, and the `crc32c` crate was already in the workspace. It guards against
//! corruption (bit rot, truncated copies, torn writes), not against tampering.
use super::{Manifest, FORMAT};
use crate::error::{Result, RuntimeError};
use crate::safetensors_header::read_stream;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

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
    let header = read_stream(file).map_err(&corrupt)?;
    let mut entries: HashMap<String, serde_json::Value> = serde_json::from_slice(&header.json)
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
        data_start: header.data_start,
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
