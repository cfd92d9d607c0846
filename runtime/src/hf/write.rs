//! `parc export --format hf`: a spec's global parameters as a transformers model folder,
//! `OUT/config.json` and `OUT/model.safetensors` (metadata `{"format": "pt"}`), in
//! transformers' names and layouts ([`super::names`]), the padded vocabulary cut back.
use super::config::config_json;
use super::family::{recognise, Family};
use super::names::{tensor_map, HfSizes, ParamMap};
use crate::checkpoint::{ShardTensor, SPEC_KEY};
use crate::data::Tokenizer;
use crate::error::{Result, RuntimeError};
use parc_compiler::spec::{DataSource, Spec};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The element type of the exported tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfDtype {
    F32,
    /// Rounded to nearest even from parc's f32.
    Bf16,
}

impl HfDtype {
    /// Its name in config.json.
    fn torch_name(self) -> &'static str {
        match self {
            HfDtype::F32 => "float32",
            HfDtype::Bf16 => "bfloat16",
        }
    }

    fn bytes(self, values: &[f32]) -> Vec<u8> {
        match self {
            HfDtype::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HfDtype::Bf16 => values
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            HfDtype::F32 => Dtype::F32,
            HfDtype::Bf16 => Dtype::BF16,
        }
    }
}

/// How to export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportOptions {
    /// Rows of the vocabulary to keep (default: all; the CLI's default is [`default_vocab`]).
    pub vocab: Option<u64>,
    pub dtype: HfDtype,
}

/// What [`export`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Exported {
    pub family: Family,
    pub config: PathBuf,
    pub model: PathBuf,
    pub tensors: usize,
    pub vocab: u64,
}

/// The vocabulary an export keeps without `--vocab`: the tokenizer's when the spec's data is
/// text through one (`text(…, tokenizer: T)`, a tokenizer.json relative to `spec_dir`), so the
/// padding rows are cut; else the model's whole vocabulary.
pub fn default_vocab(spec: &Spec, spec_dir: &Path) -> Result<u64> {
    match &spec.train.data {
        DataSource::Text { tokenizer, .. } => {
            let tokens = Tokenizer::open(tokenizer, spec_dir)?.vocab_size();
            Ok(tokens.min(spec.model.vocab))
        }
        _ => Ok(spec.model.vocab),
    }
}

fn export_error(what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Hf(what.to_string())
}

/// Write `params` (global tensors named as in parc's parameter table, e.g. a model file's)
/// of `spec`'s model to the folder `out` (see the module docs).
pub fn export(
    spec: &Spec,
    params: &[ShardTensor],
    out: &Path,
    options: ExportOptions,
) -> Result<Exported> {
    let arch = recognise(spec)?;
    let vocab = options.vocab.unwrap_or(spec.model.vocab);
    if vocab == 0 || vocab > arch.vocab {
        return Err(export_error(format!(
            "--vocab {vocab}: the model's vocabulary has {} rows; keep 1 to {} of them",
            arch.vocab, arch.vocab
        )));
    }
    let sizes = HfSizes {
        vocab,
        positions: arch.seq,
    };
    let maps = tensor_map(&arch, sizes);
    check_params(params, &maps)?;
    let by_name: HashMap<&str, &ShardTensor> =
        params.iter().map(|p| (p.name.as_str(), p)).collect();
    let mut tensors: BTreeMap<String, (Vec<u64>, Vec<f32>)> = BTreeMap::new();
    for map in &maps {
        if let Some(param) = by_name.get(map.parc.as_str()) {
            scatter(map, &param.data, &mut tensors);
        }
    }
    refuse_to_replace(out)?;
    std::fs::create_dir_all(out).map_err(|e| RuntimeError::Io {
        context: format!("creating the export folder {}", out.display()),
        source: e,
    })?;
    let model = out.join("model.safetensors");
    write_tensors(&model, &tensors, options.dtype)?;
    let config = out.join("config.json");
    let json = config_json(&arch, sizes, options.dtype.torch_name());
    let text = serde_json::to_string_pretty(&json).map_err(export_error)?;
    std::fs::write(&config, text + "\n").map_err(|e| RuntimeError::Io {
        context: format!("writing {}", config.display()),
        source: e,
    })?;
    Ok(Exported {
        family: arch.family,
        config,
        model,
        tensors: tensors.len(),
        vocab,
    })
}

/// Refuses an `out` whose files an export would replace or leave beside a model of its own:
/// parc's model file of a run (`parc export CKPT --format hf CKPT` would overwrite the file it
/// reads, the run's only global parameters), or a sharded checkpoint's index (a folder of two
/// models, the old shards beside the new `model.safetensors`). A `model.safetensors` of an
/// earlier export (no recorded spec) is replaced.
fn refuse_to_replace(out: &Path) -> Result<()> {
    let index = out.join("model.safetensors.index.json");
    if index.exists() {
        return Err(export_error(format!(
            "{} holds model.safetensors.index.json, a sharded checkpoint: the export's \
             model.safetensors beside it would make a folder of two models; export into a new \
             or empty folder (or remove the index and the shards it names)",
            out.display()
        )));
    }
    let model = out.join("model.safetensors");
    if records_a_spec(&model) {
        return Err(export_error(format!(
            "{} is parc's model file of a run (it records the run's spec), which the export \
             would replace with transformers' layout; give the export another folder",
            model.display()
        )));
    }
    Ok(())
}

/// Whether `path` is a safetensors file whose metadata records a parc spec (`SPEC_KEY`); a
/// file that is missing or unreadable records none.
fn records_a_spec(path: &Path) -> bool {
    let Ok(mut file) = std::fs::File::open(path) else {
        return false;
    };
    let Ok(header) = crate::safetensors_header::read_stream(&mut file) else {
        return false;
    };
    serde_json::from_slice::<serde_json::Value>(&header.json)
        .ok()
        .and_then(|h| h.get("__metadata__")?.get(SPEC_KEY).cloned())
        .is_some()
}

/// The model file's parameters are exactly the spec's, at its shapes.
fn check_params(params: &[ShardTensor], maps: &[ParamMap]) -> Result<()> {
    let wanted: HashMap<&str, &ParamMap> = maps.iter().map(|m| (m.parc.as_str(), m)).collect();
    let mut problems = Vec::new();
    for p in params {
        match wanted.get(p.name.as_str()) {
            None => problems.push(format!("{} has no place in transformers' model", p.name)),
            Some(m) if m.shape != p.shape => problems.push(format!(
                "{} has shape {:?}, the spec's is {:?}",
                p.name, p.shape, m.shape
            )),
            Some(_) => {}
        }
    }
    for m in maps {
        if !params.iter().any(|p| p.name == m.parc) {
            problems.push(format!("{} is missing", m.parc));
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(export_error(format!(
        "the model file's parameters are not its spec's (was it written by another spec?):\n  {}",
        problems.join("\n  ")
    )))
}

/// Copy a parameter's rows into its pieces' tensors (padding rows are dropped).
fn scatter(map: &ParamMap, data: &[f32], tensors: &mut BTreeMap<String, (Vec<u64>, Vec<f32>)>) {
    for piece in &map.pieces {
        let shape = piece.hf_shape();
        let mut values = vec![0.0f32; shape.iter().product::<u64>() as usize];
        for row in piece.rows.clone() {
            for col in 0..piece.cols {
                let from = (row * piece.cols + col) as usize;
                let to = piece.hf_index(row, col) as usize;
                if let (Some(v), Some(x)) = (values.get_mut(to), data.get(from)) {
                    *v = *x;
                }
            }
        }
        tensors.insert(piece.hf.clone(), (shape, values));
    }
}

fn write_tensors(
    path: &Path,
    tensors: &BTreeMap<String, (Vec<u64>, Vec<f32>)>,
    dtype: HfDtype,
) -> Result<()> {
    let bytes: Vec<(&String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, (shape, values))| {
            let shape = shape.iter().map(|&d| d as usize).collect();
            (name, shape, dtype.bytes(values))
        })
        .collect();
    let mut views = Vec::with_capacity(bytes.len());
    for (name, shape, data) in &bytes {
        let view = TensorView::new(dtype.safetensors(), shape.clone(), data)
            .map_err(|e| export_error(format!("tensor {name}: {e}")))?;
        views.push((name.as_str(), view));
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| export_error(format!("writing {}: {e}", path.display())))
}
