//! `parc export CKPT --format hf OUT [--vocab N] [--dtype f32|bf16]`: a saved model (a
//! checkpoint folder's model.safetensors, or a `--save-init` file) as a Hugging Face
//! transformers folder, `OUT/config.json` and `OUT/model.safetensors`. The model file records
//! the spec it was trained from; that spec, checked again, says the family and the sizes.
//! Exit codes as `main`: 0 exported, 1 the spec or the export failed, 2 usage or unreadable
//! input.
use crate::run_prepare::{check_recorded, print_error};
use parc_compiler::spec::Spec;
use parc_runtime::checkpoint::{SavedModel, SpecSource};
use parc_runtime::hf::{self, ExportOptions, HfDtype};
use std::path::PathBuf;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// transformers' names and layouts, config.json beside the weights.
    Hf,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
}

#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// The saved model: a `checkpoint.dir` holding model.safetensors, or a model file.
    pub checkpoint: PathBuf,
    /// The folder to write.
    pub out: PathBuf,
    /// What to write.
    #[arg(long, value_enum)]
    pub format: Format,
    /// Rows of the vocabulary to keep (default: the tokenizer's when the spec trains on text through
    /// one, else the model's whole vocabulary), cutting the padding.
    #[arg(long, value_name = "N")]
    pub vocab: Option<u64>,
    /// The exported tensors' element type.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: Dtype,
}

pub fn main(args: ExportArgs) -> u8 {
    let saved = match SavedModel::open(&args.checkpoint) {
        Ok(saved) => saved,
        Err(e) => {
            print_error(&e.to_string());
            return 2;
        }
    };
    let Some(source) = &saved.source else {
        print_error(&format!(
            "{} records no spec (it was written by an older parc or another tool); export \
             needs the spec the model was trained from: run it again with this parc",
            saved.path.display()
        ));
        return 2;
    };
    if let Some(what) = saved.nonfinite() {
        print_error(&format!(
            "{what}: the exported model would give logits that are not numbers; export a model \
             saved before the run diverged (`parc run SPEC --resume DIR/step-N --set \
             train.steps=N` writes an earlier checkpoint's model.safetensors)"
        ));
        return 1;
    }
    let spec = match spec_of(source) {
        Ok(spec) => spec,
        Err(code) => return code,
    };
    let Format::Hf = args.format;
    let vocab = match args.vocab {
        Some(vocab) => vocab,
        None => match hf::default_vocab(&spec, &source.dir) {
            Ok(vocab) => vocab,
            Err(e) => {
                print_error(&format!("{e}; give the vocabulary to keep with --vocab N"));
                return 2;
            }
        },
    };
    let options = ExportOptions {
        vocab: Some(vocab),
        dtype: match args.dtype {
            Dtype::F32 => HfDtype::F32,
            Dtype::Bf16 => HfDtype::Bf16,
        },
    };
    match hf::export(&spec, &saved.params, &args.out, options) {
        Ok(done) => {
            eprintln!(
                "exported {} ({} tensors, vocabulary {}, {:?}) to {} and {}",
                done.family.class(),
                done.tensors,
                done.vocab,
                args.dtype,
                done.config.display(),
                done.model.display()
            );
            0
        }
        Err(e) => {
            print_error(&e.to_string());
            1
        }
    }
}

/// The spec a model file records, checked again; its diagnostics on stderr. `Err` is the
/// exit code.
fn spec_of(source: &SpecSource) -> Result<Spec, u8> {
    let checked = check_recorded(source).map_err(|message| {
        print_error(&format!("the model file's recorded --set: {message}"));
        2
    })?;
    checked.ok_or_else(|| {
        print_error(&format!(
            "the spec recorded in the model file ({}) has errors with this parc",
            source.file
        ));
        1
    })
}
