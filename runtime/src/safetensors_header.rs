//! What is wrong with a safetensors file whose header the `safetensors` crate refuses, in words
//! that name the tensor: the crate's `TensorInvalidInfo` ("invalid shape, data type, or offset
//! for tensor") names none, and its `MetadataIncompleteBuffer` does not say that the usual cause
//! is a file cut short. Every reader of safetensors files (Hugging Face folders, parc's model
//! files and checkpoint shards) words the error through [`explain`].
//!
//! Readers that open a file as a stream and want only its header (a checkpoint's resharding
//! and its verification, which never load the data) read it through [`read_stream`]: one
//! length bound, one set of words for a header that cannot be read.
use safetensors::{Dtype, SafeTensorError};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::io::Read;

/// Headers longer than this are refused as corrupt (the `safetensors` crate's own limit).
pub const MAX_HEADER: u64 = 100_000_000;

/// A safetensors header read from the start of a stream: its JSON bytes, and the offset in
/// the file where the tensors' data begins.
pub struct StreamHeader {
    pub json: Vec<u8>,
    pub data_start: u64,
}

/// Reads the header at the start of `file` (8 bytes of its length, then the JSON), or says in
/// words why it cannot: unreadable, longer than [`MAX_HEADER`] (a corrupt length), or cut short.
pub fn read_stream(file: &mut impl Read) -> Result<StreamHeader, String> {
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|e| format!("cannot read the safetensors header ({e})"))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER {
        return Err(format!(
            "corrupt safetensors file (a header of {len} bytes, more than the format allows)"
        ));
    }
    let mut json = vec![0u8; len as usize];
    file.read_exact(&mut json)
        .map_err(|e| format!("the safetensors header is cut short ({e})"))?;
    Ok(StreamHeader {
        json,
        data_start: 8 + len,
    })
}

#[derive(Deserialize)]
struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// Where the header ends and the tensors' bytes begin: 8 bytes of its length, then the header
/// (None where the file is shorter than 8 bytes or the length overflows).
fn header_end(bytes: &[u8]) -> Option<usize> {
    let len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    usize::try_from(len).ok()?.checked_add(8)
}

/// The header's tensor entries (the `__metadata__` entry left out), or None when the header
/// does not parse as a table of them.
fn entries(bytes: &[u8]) -> Option<BTreeMap<String, Entry>> {
    let header = bytes.get(8..header_end(bytes)?)?;
    let table: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    let mut entries = BTreeMap::new();
    for (name, value) in table {
        if name == "__metadata__" {
            continue;
        }
        entries.insert(name, serde_json::from_value(value).ok()?);
    }
    Some(entries)
}

/// The bytes `entry`'s dtype and shape need, if that does not overflow.
fn needed(entry: &Entry) -> Option<usize> {
    let elements = (entry.shape.iter()).try_fold(1usize, |n, &d| n.checked_mul(d))?;
    Some(elements.checked_mul(entry.dtype.bitsize())?.div_ceil(8))
}

/// Why `bytes`, refused by the `safetensors` crate with `error`, is not a readable safetensors
/// file: the tensor whose dtype and shape disagree with its offsets, or that the header
/// describes more bytes than the file holds (a file cut short), else the crate's own words.
pub fn explain(bytes: &[u8], error: &SafeTensorError) -> String {
    let truncated = |described: Option<usize>| {
        let held = format!("the file's {} bytes", bytes.len());
        let what = match described {
            Some(n) => format!("its safetensors header describes {n} bytes, more than {held}"),
            None => format!("its safetensors header describes other bytes than {held}"),
        };
        format!(
            "{what}: the file is truncated or was not completely written (an interrupted \
             download, copy or save); download or save it again"
        )
    };
    match error {
        SafeTensorError::InvalidHeaderLength => truncated(header_end(bytes)),
        SafeTensorError::MetadataIncompleteBuffer | SafeTensorError::TensorInvalidInfo => {
            let Some(entries) = entries(bytes) else {
                return format!("not a safetensors file ({error})");
            };
            for (name, entry) in &entries {
                let (start, end) = entry.data_offsets;
                let Some(need) = needed(entry) else {
                    return format!("tensor `{name}`: its shape {:?} overflows", entry.shape);
                };
                if end.checked_sub(start) != Some(need) {
                    return format!(
                        "tensor `{name}` is {:?} of shape {:?}, {need} bytes, but its header \
                         entry gives it bytes {start}..{end} ({} bytes): the header is corrupt \
                         or the file was written by a broken tool; save or download it again",
                        entry.dtype,
                        entry.shape,
                        end.saturating_sub(start)
                    );
                }
            }
            let data_end = entries.values().map(|e| e.data_offsets.1).max();
            let described = header_end(bytes).and_then(|h| h.checked_add(data_end.unwrap_or(0)));
            match described {
                Some(n) if n > bytes.len() => truncated(Some(n)),
                _ => format!(
                    "not a safetensors file ({error}): its tensors' bytes do not cover the \
                     file's {} bytes after the header",
                    bytes.len()
                ),
            }
        }
        e => format!("not a safetensors file ({e})"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + data, 0);
        bytes
    }

    fn refused(bytes: &[u8]) -> String {
        let error = safetensors::SafeTensors::read_metadata(bytes)
            .err()
            .unwrap();
        explain(bytes, &error)
    }

    #[test]
    fn a_stream_header_is_read_or_refused_in_words() {
        let bytes = file(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
            4,
        );
        let h = read_stream(&mut bytes.as_slice()).unwrap();
        assert_eq!(h.data_start, bytes.len() as u64 - 4);
        assert_eq!(h.json, &bytes[8..bytes.len() - 4]);
        let err = |b: &[u8]| read_stream(&mut &b[..]).err().unwrap();
        assert!(
            err(&bytes[..5]).contains("cannot read"),
            "{}",
            err(&bytes[..5])
        );
        assert!(
            err(&bytes[..12]).contains("cut short"),
            "{}",
            err(&bytes[..12])
        );
        let huge = (MAX_HEADER + 1).to_le_bytes();
        assert!(err(&huge).contains("corrupt"), "{}", err(&huge));
    }

    #[test]
    fn a_tensor_whose_offsets_disagree_with_its_shape_is_named() {
        let bytes = file(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[4,4],"data_offsets":[8,40]}}"#,
            40,
        );
        let text = refused(&bytes);
        assert!(
            text.contains("tensor `b` is F32 of shape [4, 4], 64 bytes"),
            "{text}"
        );
        assert!(text.contains("bytes 8..40 (32 bytes)"), "{text}");
    }

    #[test]
    fn a_file_cut_short_is_said_to_be_truncated() {
        let bytes = file(
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            16,
        );
        let text = refused(&bytes[..bytes.len() - 4]);
        assert!(text.contains("the file is truncated"), "{text}");
        let text = refused(&bytes[..20]);
        assert!(text.contains("the file is truncated"), "{text}");
    }
}
