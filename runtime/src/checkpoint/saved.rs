//! A saved model: global parameters together with the spec that describes them, so that
//! `parc sample` and `parc export` can open `DIR/model.safetensors` alone.
//!
//! A run that writes global parameters (`DIR/model.safetensors`, `--save-init FILE`) puts the
//! spec it ran in the file's metadata under [`SPEC_KEY`]: the `.par` text, the `--set`
//! overrides and the spec's folder (for paths inside it, such as a tokenizer file), as JSON.
//! [`SavedModel::open`] reads a model file, or a checkpoint folder holding one.
use super::store::{f32_values, model_path, ShardTensor};
use super::{SpecSource, SPEC_KEY};
use crate::error::{Result, RuntimeError};
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

/// Global parameters read back from a saved model file.
#[derive(Clone, Debug)]
pub struct SavedModel {
    /// The file they were read from.
    pub path: PathBuf,
    /// Optimizer steps the parameters have had.
    pub step: u64,
    /// The spec of the run that saved them (absent in files of older builds or other tools).
    pub source: Option<SpecSource>,
    pub params: Vec<ShardTensor>,
}

fn saved_error(path: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Checkpoint(format!("{}: {what}", path.display()))
}

impl SavedModel {
    /// Open `path`: a `.safetensors` file of global parameters, or a checkpoint folder holding
    /// `model.safetensors`.
    pub fn open(path: &Path) -> Result<SavedModel> {
        let file = if path.is_dir() {
            let model = model_path(path);
            if !model.is_file() {
                return Err(saved_error(path, no_model_help(path)));
            }
            model
        } else if path.is_file() {
            path.to_path_buf()
        } else {
            return Err(saved_error(
                path,
                "no such file or folder; give a checkpoint folder (`checkpoint.dir`) or its \
                 model.safetensors",
            ));
        };
        read_model(&file)
    }

    /// The first parameter that holds values that are not finite (NaN or ±inf: a diverged run,
    /// a damaged file), named with its file and counted; None when every value is finite.
    /// Such parameters give logits that are not numbers, so sampling and export refuse them.
    pub fn nonfinite(&self) -> Option<String> {
        self.params.iter().find_map(|p| {
            let first = p.data.iter().position(|x| !x.is_finite())?;
            let count = p.data.iter().filter(|x| !x.is_finite()).count();
            Some(format!(
                "{}: tensor {} holds {count} of {} values that are not finite (element {first} \
                 is {})",
                self.path.display(),
                p.name,
                p.data.len(),
                p.data[first]
            ))
        })
    }
}

/// What a step's per-rank shards are, and how to get the global model of that step.
const SHARDS: &str = "the global parameters are the checkpoint folder's model.safetensors, \
     written when a run ends (reading a step's shards without their run is not built yet: \
     resume it with `parc run --resume` and `--set train.steps` at that step to write it)";

fn no_model_help(dir: &Path) -> String {
    if dir.join("manifest.json").is_file() {
        format!("is one step's checkpoint, saved as per-rank shards of its plan; {SHARDS}")
    } else {
        "holds no model.safetensors; give the `checkpoint.dir` of a finished run, or a \
         .safetensors file"
            .to_string()
    }
}

fn read_model(path: &Path) -> Result<SavedModel> {
    let bytes = std::fs::read(path).map_err(|e| saved_error(path, format!("cannot read: {e}")))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| saved_error(path, crate::safetensors_header::explain(&bytes, &e)))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    // A checkpoint shard records its tensors' checksums and no spec: one rank's pieces of the
    // parameters (tp blocks, ZeRO shards) beside its optimizer state, not the global model.
    if metadata.contains_key(super::verify::CHECKSUMS_KEY) && !metadata.contains_key(SPEC_KEY) {
        let folder = path.parent().unwrap_or(Path::new("."));
        return Err(saved_error(
            path,
            format!(
                "is one rank's shard of a step's checkpoint ({}), not a model file: {SHARDS}",
                folder.display()
            ),
        ));
    }
    let step = metadata
        .get("step")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let source = match metadata.get(SPEC_KEY) {
        Some(json) => Some(
            serde_json::from_str(json)
                .map_err(|e| saved_error(path, format!("its recorded spec is unreadable ({e})")))?,
        ),
        None => None,
    };
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| saved_error(path, crate::safetensors_header::explain(&bytes, &e)))?;
    let mut params = Vec::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(saved_error(
                path,
                format!(
                    "tensor {name} is {:?}; parc's model files hold F32 (a Hugging Face model \
                     is read with `train.init = hf(\"DIR\")`)",
                    view.dtype()
                ),
            ));
        }
        params.push(ShardTensor {
            name,
            shape: view.shape().iter().map(|&d| d as u64).collect(),
            data: f32_values(view.data()),
        });
    }
    params.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(SavedModel {
        path: path.to_path_buf(),
        step,
        source,
        params,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::store::write_params;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("parc-saved-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_model_file_carries_its_spec() {
        let dir = temp_dir("spec");
        let source = SpecSource {
            file: "tiny.par".into(),
            dir: "/specs".into(),
            text: "model m {}".into(),
            overrides: vec!["train.steps=3".into()],
        };
        let params = vec![ShardTensor {
            name: "embed.weight".into(),
            shape: vec![2, 2],
            data: vec![1.0, 2.0, 3.0, 4.0],
        }];
        write_params(&model_path(&dir), 7, &params, Some(&source)).unwrap();
        let saved = SavedModel::open(&dir).unwrap();
        assert_eq!(saved.step, 7);
        assert_eq!(saved.source, Some(source));
        assert_eq!(saved.params, params);
    }

    #[test]
    fn a_step_folder_is_explained() {
        let dir = temp_dir("step");
        std::fs::write(dir.join("manifest.json"), "{}").unwrap();
        let err = SavedModel::open(&dir).unwrap_err().to_string();
        assert!(err.contains("per-rank shards"), "{err}");
        let err = SavedModel::open(&dir.join("missing"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no such file"), "{err}");
    }

    /// A rank's shard given where a model file is meant (`parc sample DIR/step-N/rank-0.safetensors
    /// --spec FILE` sampled from it as from a model of step 0) is named as a shard.
    #[test]
    fn a_checkpoint_shard_is_not_read_as_a_model() {
        let dir = temp_dir("shard");
        let params = [ShardTensor {
            name: "embed.weight".into(),
            shape: vec![2],
            data: vec![1.0, 2.0],
        }];
        crate::checkpoint::store::write_shard(&dir, 0, &params).unwrap();
        let shard = dir.join("rank-00000.safetensors");
        assert!(shard.is_file());
        let err = SavedModel::open(&shard).unwrap_err().to_string();
        assert!(
            err.contains("is one rank's shard of a step's checkpoint") && err.contains("--resume"),
            "{err}"
        );
    }
}
