//! `train.init = hf("DIR")`: a Hugging Face checkpoint opened for a run. [`HfInit::open`]
//! recognises the spec's family, checks config.json against it, maps the safetensors files and
//! checks that every tensor the run needs is there with its shape and a readable dtype, all
//! before any rank starts. [`HfInit::fill_local`] then fills one rank's local copy of a
//! parameter (a tp block, a ZeRO shard or both) by reading only the elements it holds: the
//! walk of the seeded initialisation (`init::fill_local_with`) with another source.
//! Rows of the spec's vocabulary beyond transformers' start at zero.
use super::config::check_config;
use super::family::recognise;
use super::names::{tensor_map, ParamMap};
use super::read::{readable, HfFiles, TensorAt};
use crate::checkpoint::ShardTensor;
use crate::error::{Result, RuntimeError};
use crate::init::{fill_local_with, ZeroShard};
use parc_compiler::ir::{Param, ParamId, ParamTable, TpSplit};
use parc_compiler::spec::Spec;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// Tensors in transformers checkpoints that are not parameters (causal masks, RoPE tables).
const BUFFERS: [&str; 3] = [".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq"];

/// A Hugging Face checkpoint checked against a spec, ready for every rank to read from.
pub struct HfInit {
    dir: PathBuf,
    files: HfFiles,
    /// Per parameter of the plan's table (by id), its map and the tensors of its pieces.
    params: Vec<(ParamMap, Vec<TensorAt>)>,
}

impl std::fmt::Debug for HfInit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HfInit({})", self.dir.display())
    }
}

impl HfInit {
    /// Open the checkpoint in `dir` for `spec`, whose parameters are `table` (see the module
    /// docs). Every missing tensor, wrong shape and unreadable dtype is named in one error.
    pub fn open(dir: &Path, spec: &Spec, table: &ParamTable) -> Result<HfInit> {
        let arch = recognise(spec)?;
        let sizes = check_config(dir, &arch)?;
        let files = HfFiles::open(dir)?;
        let mut maps: HashMap<String, ParamMap> = tensor_map(&arch, sizes)
            .into_iter()
            .map(|m| (m.parc.clone(), m))
            .collect();
        let mut problems = Vec::new();
        let mut params = Vec::with_capacity(table.params.len());
        let mut used = HashSet::new();
        for param in &table.params {
            let Some(map) = maps.remove(&param.name) else {
                return Err(RuntimeError::Hf(format!(
                    "parameter {} has no place in a transformers {} checkpoint (a bug in \
                     parc's mapping)",
                    param.name,
                    arch.family.class()
                )));
            };
            let mut tensors = Vec::new();
            for piece in &map.pieces {
                let (name, found) = find(&files, &piece.hf);
                used.insert(name.to_string());
                let want = piece.hf_shape();
                match found {
                    None => problems.push(format!("tensor {} is missing", piece.hf)),
                    Some(t) if t.shape != want => problems.push(format!(
                        "tensor {} in {} has shape {:?}, the spec needs {want:?} (for {})",
                        piece.hf,
                        files.path(t).display(),
                        t.shape,
                        param.name
                    )),
                    Some(t) if !readable(t.dtype) => problems.push(format!(
                        "tensor {} in {} is {:?}; parc reads F32, BF16 and F16",
                        piece.hf,
                        files.path(t).display(),
                        t.dtype
                    )),
                    Some(t) => tensors.push(t.clone()),
                }
            }
            params.push((map, tensors));
        }
        problems.extend(unexpected(&files, &used, arch.tied));
        if !problems.is_empty() {
            problems.sort();
            return Err(RuntimeError::Hf(format!(
                "{} does not hold the weights of this spec's {}:\n  {}",
                files.describe(),
                arch.family.class(),
                problems.join("\n  ")
            )));
        }
        Ok(HfInit {
            dir: dir.to_path_buf(),
            files,
            params,
        })
    }

    /// Every parameter of `table` (the table [`HfInit::open`] was given) as a global tensor,
    /// named as in parc's parameter table: the weights as one process reads them (sampling).
    pub fn global_params(&self, table: &ParamTable) -> Result<Vec<ShardTensor>> {
        table
            .params
            .iter()
            .enumerate()
            .map(|(i, param)| {
                let numel = param.shape.iter().product::<u64>() as usize;
                let mut data = vec![0.0; numel];
                self.fill_local(&mut data, ParamId(i as u32), param, None, None)?;
                Ok(ShardTensor {
                    name: param.name.clone(),
                    shape: param.shape.clone(),
                    data,
                })
            })
            .collect()
    }

    /// The checkpoint's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Fill `out` with this rank's local copy of parameter `id` (`param` in the table):
    /// block `tp` of it, or ZeRO shard `zero` of that.
    pub fn fill_local(
        &self,
        out: &mut [f32],
        id: ParamId,
        param: &Param,
        tp: Option<TpSplit>,
        zero: Option<ZeroShard>,
    ) -> Result<()> {
        let Some((map, tensors)) = self.params.get(id.0 as usize) else {
            return Err(RuntimeError::Hf(format!(
                "parameter {} was not checked against the checkpoint (a bug)",
                param.name
            )));
        };
        let value = |index: u64| match map.locate(index) {
            Some((piece, at)) => tensors
                .get(piece)
                .map_or(f32::NAN, |t| self.files.value(t, at)),
            None => 0.0,
        };
        fill_local_with(out, id, &param.shape, tp, zero, value)
    }
}

/// The tensor `name` of the checkpoint, or, where the file was saved from the base model
/// (`GPT2Model`, `LlamaModel`: as the original GPT-2 checkpoint), the same name without its
/// `transformer.` or `model.` prefix; and the name found.
fn find<'a>(files: &'a HfFiles, name: &'a str) -> (&'a str, Option<&'a TensorAt>) {
    if let Some(t) = files.get(name) {
        return (name, Some(t));
    }
    let base = ["transformer.", "model."]
        .iter()
        .find_map(|prefix| name.strip_prefix(prefix));
    match base.and_then(|b| Some((b, files.get(b)?))) {
        Some((b, t)) => (b, Some(t)),
        None => (name, None),
    }
}

/// Tensors of the checkpoint that no parameter reads (besides buffers and a tied head's copy):
/// a sign that the spec and the checkpoint differ.
fn unexpected(files: &HfFiles, used: &HashSet<String>, tied: bool) -> Vec<String> {
    let mut extra: Vec<&str> = files
        .names()
        .filter(|n| !used.contains(*n))
        .filter(|n| !BUFFERS.iter().any(|b| n.ends_with(b)))
        .filter(|n| !(tied && *n == "lm_head.weight"))
        .collect();
    extra.sort();
    let shown: Vec<&str> = extra.iter().take(8).copied().collect();
    match extra.len() {
        0 => Vec::new(),
        n => vec![format!(
            "{n} tensor{} the spec has no parameter for: {}{}",
            if n == 1 { "" } else { "s" },
            shown.join(", "),
            if n > 8 { ", …" } else { "" }
        )],
    }
}
