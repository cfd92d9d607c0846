//! Reading a Hugging Face checkpoint's tensors: `model.safetensors`, or the files a sharded
//! `model.safetensors.index.json` names, memory-mapped so that a rank reading its elements
//! touches only the pages that hold them. F32, BF16 and F16 tensors are read as f32.
use crate::error::{Result, RuntimeError};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// One tensor's place: its file, element type, shape and first byte.
#[derive(Clone, Debug)]
pub struct TensorAt {
    pub file: usize,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    start: usize,
}

/// A checkpoint's safetensors files, mapped, and where each tensor is.
pub struct HfFiles {
    paths: Vec<PathBuf>,
    maps: Vec<Mmap>,
    tensors: HashMap<String, TensorAt>,
}

fn read_error(path: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Hf(format!("{}: {what}", path.display()))
}

/// A file whose safetensors header does not read, said in words that name the tensor or say
/// that the file was cut short (`safetensors_header::explain`).
fn unreadable(path: &Path, error: &SafeTensorError, bytes: &[u8]) -> RuntimeError {
    read_error(path, crate::safetensors_header::explain(bytes, error))
}

/// The files of the checkpoint in `dir`: `model.safetensors`, else those its index names, and
/// the index's `weight_map` (tensor → file name; empty for the single file).
/// A folder holding both is read as transformers reads it (`from_pretrained` takes the single
/// file first), so a `model.safetensors` written beside an older sharded checkpoint is the
/// model, not the stale shards.
fn shard_files(dir: &Path) -> Result<(Vec<PathBuf>, HashMap<String, String>)> {
    let index = dir.join("model.safetensors.index.json");
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok((vec![single], HashMap::new()));
    }
    if !index.is_file() {
        return Err(read_error(
            dir,
            "holds neither model.safetensors nor model.safetensors.index.json (a PyTorch \
             `.bin` checkpoint must be saved as safetensors first: `save_pretrained(DIR, \
             safe_serialization=True)`)",
        ));
    }
    let text = std::fs::read_to_string(&index)
        .map_err(|e| read_error(&index, format!("cannot read ({e})")))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| read_error(&index, format!("is not JSON ({e})")))?;
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(read_error(&index, "has no `weight_map` object"));
    };
    let mut files: Vec<PathBuf> = Vec::new();
    let mut weight_map = HashMap::new();
    for (tensor, file) in map {
        let Some(name) = file.as_str() else {
            return Err(read_error(
                &index,
                format!("names no file for tensor {tensor}"),
            ));
        };
        let path = dir.join(name);
        if !files.contains(&path) {
            files.push(path);
        }
        weight_map.insert(tensor.clone(), name.to_string());
    }
    Ok((files, weight_map))
}

/// A tensor stored in two of a sharded checkpoint's files. transformers loads every tensor of
/// every shard the index names, so which copy it keeps is the order it reads the files in, not
/// the index's `weight_map`; with two copies there is no one model to read.
fn stored_twice(
    tensor: &str,
    first: &Path,
    second: &Path,
    weight_map: &HashMap<String, String>,
) -> RuntimeError {
    let index = weight_map.get(tensor).map_or_else(
        || "the index's weight_map names neither".to_string(),
        |file| format!("the index's weight_map names {file}"),
    );
    RuntimeError::Hf(format!(
        "tensor {tensor} is stored twice, in {} and in {} ({index}); a checkpoint holds each \
         tensor once, so which copy is the model is not known: remove it from the shard that \
         should not hold it, or save the model again (`save_pretrained`)",
        first.display(),
        second.display()
    ))
}

impl HfFiles {
    /// Map the checkpoint's files in `dir` and read their headers.
    pub fn open(dir: &Path) -> Result<HfFiles> {
        let (paths, weight_map) = shard_files(dir)?;
        let mut maps = Vec::with_capacity(paths.len());
        let mut tensors = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file =
                File::open(path).map_err(|e| read_error(path, format!("cannot open ({e})")))?;
            // SAFETY: the map is read only; as with every memory-mapped reader, the file must
            // not be truncated or rewritten while the run reads it.
            let map = unsafe { Mmap::map(&file) }
                .map_err(|e| read_error(path, format!("cannot map ({e})")))?;
            let (header, metadata) =
                SafeTensors::read_metadata(&map).map_err(|e| unreadable(path, &e, &map))?;
            for (name, info) in metadata.tensors() {
                let at = TensorAt {
                    file: i,
                    dtype: info.dtype,
                    shape: info.shape.iter().map(|&d| d as u64).collect(),
                    start: 8 + header + info.data_offsets.0,
                };
                if let Some(before) = tensors
                    .get(&name)
                    .and_then(|t: &TensorAt| paths.get(t.file))
                {
                    return Err(stored_twice(&name, before, path, &weight_map));
                }
                tensors.insert(name, at);
            }
            maps.push(map);
        }
        Ok(HfFiles {
            paths,
            maps,
            tensors,
        })
    }

    pub fn get(&self, name: &str) -> Option<&TensorAt> {
        self.tensors.get(name)
    }

    /// Every tensor's name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The file `tensor` is in.
    pub fn path(&self, tensor: &TensorAt) -> &Path {
        self.paths.get(tensor.file).map_or(Path::new("?"), |p| p)
    }

    /// The files, for messages: one path, or the folder and how many.
    pub fn describe(&self) -> String {
        match self.paths.as_slice() {
            [one] => one.display().to_string(),
            more => format!(
                "the {} files of {}",
                more.len(),
                more.first()
                    .and_then(|p| p.parent())
                    .map_or("?".into(), |d| d.display().to_string())
            ),
        }
    }

    /// Element `index` of `tensor` as f32. `tensor` must be one of this checkpoint's, of a
    /// readable dtype ([`readable`]), and `index` inside it: the safetensors header was
    /// validated against the file's size when it was opened.
    pub fn value(&self, tensor: &TensorAt, index: u64) -> f32 {
        let bytes = self.maps.get(tensor.file).map_or(&[][..], |m| &m[..]);
        let size = tensor.dtype.bitsize() / 8;
        let at = tensor.start + index as usize * size;
        let Some(b) = bytes.get(at..at + size) else {
            return f32::NAN;
        };
        match tensor.dtype {
            Dtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            Dtype::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            Dtype::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            _ => f32::NAN,
        }
    }
}

/// Whether [`HfFiles::value`] reads tensors of `dtype`.
pub fn readable(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16)
}
