//! `parc sample CKPT --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]
//! [--tokenizer bytes|gpt2|FILE] [--spec FILE [--set PATH=VALUE]…] [--backend auto|cpu|cuda]`:
//! continue a prompt with a saved model (a checkpoint folder's `model.safetensors`, or the file,
//! or a Hugging Face folder with `--spec`), streaming the text to stdout as the tokens come,
//! with a header and a summary (tokens/s) on stderr. The model's spec is the one the file
//! records (`checkpoint::saved`), or `--spec`. `--dump-logits FILE` also writes the prompt's
//! logits, for comparing parc's forward with another implementation's.
//! Exit codes as `main`: 0 sampled, 1 the spec or the sampling failed, 2 usage or unreadable
//! input.
use crate::input::read_spec;
use crate::run_args::{spec_folder, BackendChoice};
use crate::run_prepare::{check_recorded, print_error};
use parc_compiler::spec::{Spec, Tokenizer as TokenizerSpec};
use parc_runtime::checkpoint::{SavedModel, SpecSource};
use parc_runtime::cpu::CpuBackend;
use parc_runtime::data::{StreamDecoder, Tokenizer};
use parc_runtime::generate::{
    compact, data_tokenizer, encode_prompt, generate, Engine, Generated, Limits, Rows, Sampler,
};
use parc_runtime::hf::HfInit;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct SampleArgs {
    /// A checkpoint folder (the spec's `checkpoint.dir`), a model.safetensors file, or a Hugging
    /// Face model folder (with `--spec`).
    pub checkpoint: PathBuf,
    /// The text the model continues (it may begin with `-`: a list item, a negative number).
    #[arg(long, allow_hyphen_values = true)]
    pub prompt: String,
    /// New tokens at most (fewer when the model ends the text or fills its seq).
    #[arg(long, default_value_t = 128)]
    pub tokens: u64,
    /// Softmax temperature; 0 always picks the most likely token.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub temperature: f64,
    /// Draw from the K most likely tokens only.
    #[arg(long = "top-k", value_name = "K")]
    pub top_k: Option<u64>,
    /// The seed of the draws: the same seed gives the same sample.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// `bytes`, `gpt2`, or a Hugging Face tokenizer.json (default: the spec's).
    #[arg(long, value_name = "bytes|gpt2|FILE")]
    pub tokenizer: Option<String>,
    /// The .par file the model was trained from, for a model file that records none (or to
    /// override the one it records).
    #[arg(long, value_name = "FILE")]
    pub spec: Option<PathBuf>,
    /// Overrides for `--spec`, as the run was given them.
    #[arg(long = "set", value_name = "PATH=VALUE", requires = "spec")]
    pub set: Vec<String>,
    /// Write the logits of every position of the prompt (f32) to FILE as JSON
    /// `{"tokens": [...], "logits": [[...], ...]}` before sampling; with `--tokens 0` the prompt
    /// may fill the model's whole `seq`.
    #[arg(long = "dump-logits", value_name = "FILE")]
    pub dump_logits: Option<PathBuf>,
    /// Where the model runs (sampling runs on the CPU; `cuda` is not built yet).
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendChoice,
}

/// A failure and its exit code: 2 for usage or unreadable input, 1 otherwise.
struct Failure(u8, String);

fn usage(message: impl Into<String>) -> Failure {
    Failure(2, message.into())
}

fn failed(message: impl std::fmt::Display) -> Failure {
    Failure(1, message.to_string())
}

pub fn main(args: SampleArgs) -> u8 {
    match run(&args) {
        Ok(()) => 0,
        Err(Failure(code, message)) => {
            print_error(&message);
            code
        }
    }
}

/// What sampling starts from: the model's parameters, its spec and the tokenizer.
struct Loaded {
    saved: SavedModel,
    spec: Spec,
    tokenizer: Tokenizer,
}

fn run(args: &SampleArgs) -> Result<(), Failure> {
    if args.backend == BackendChoice::Cuda {
        return Err(usage(
            "--backend cuda: sampling on the GPU is not built yet; `parc sample` runs on the CPU \
             (--backend cpu), in f32",
        ));
    }
    let sampler = Sampler {
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    sampler.check().map_err(|e| usage(e.to_string()))?;
    let Loaded {
        saved,
        spec,
        tokenizer,
    } = load(args)?;
    if let Some(what) = saved.nonfinite() {
        return Err(failed(format!(
            "{what}: the model's logits would not be numbers; sample a model saved before the \
             run diverged (`parc run SPEC --resume DIR/step-N --set train.steps=N` writes an \
             earlier checkpoint's model.safetensors)"
        )));
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let backend = CpuBackend::with_threads(threads).map_err(failed)?;
    let mut engine = Engine::new(&spec, &saved.params, backend).map_err(failed)?;
    if let Some(file) = &args.dump_logits {
        dump_logits(&mut engine, &tokenizer, &args.prompt, file)?;
        if args.tokens == 0 {
            return Ok(());
        }
    }
    let prompt =
        encode_prompt(&tokenizer, &args.prompt, &spec.model).map_err(|e| usage(e.to_string()))?;
    eprintln!(
        "sampling {} (step {}) from {}: a prompt of {} tokens, up to {} more, {}, tokenizer {}, \
         on the cpu",
        spec.model.name,
        saved.step,
        saved.path.display(),
        prompt.len(),
        args.tokens,
        describe(&sampler),
        tokenizer.name()
    );
    let limits = Limits {
        tokens: args.tokens,
        end_of_text: tokenizer.end_of_text(),
        allowed: tokenizer.vocab_size(),
    };
    let mut out = std::io::stdout().lock();
    let write_err = |e: std::io::Error| failed(format!("cannot write the sample: {e}"));
    out.write_all(args.prompt.as_bytes()).map_err(write_err)?;
    out.flush().map_err(write_err)?;
    let mut decoder = StreamDecoder::new(&tokenizer);
    let generated = generate(&mut engine, &prompt, &sampler, &limits, |id| {
        let text = decoder.push(id)?;
        out.write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .map_err(|e| parc_runtime::error::RuntimeError::Io {
                context: "writing the sample to stdout".to_string(),
                source: e,
            })
    })
    .map_err(failed)?;
    let rest = decoder.finish().map_err(failed)?;
    writeln!(out, "{rest}").map_err(write_err)?;
    drop(out);
    eprintln!("{}", summary(&generated, prompt.len(), spec.model.seq));
    Ok(())
}

/// `temperature 0.8, top-k 40, seed 3`, or `greedy`.
fn describe(sampler: &Sampler) -> String {
    if sampler.temperature == 0.0 {
        return "greedy".to_string();
    }
    let top_k = sampler
        .top_k
        .map_or_else(String::new, |k| format!(", top-k {k}"));
    format!(
        "temperature {}{top_k}, seed {}",
        compact(sampler.temperature),
        sampler.seed
    )
}

/// `40 tokens in 0.21 s (190.5 tokens/s; the prompt's 6 in 0.01 s), stopped by …`.
fn summary(generated: &Generated, prompt: usize, seq: u64) -> String {
    let n = generated.tokens.len();
    let seconds = generated.prefill_s + generated.decode_s;
    let rate = if generated.decode_s > 0.0 && n > 1 {
        (n - 1) as f64 / generated.decode_s
    } else {
        n as f64 / seconds.max(1e-9)
    };
    format!(
        "{n} tokens in {seconds:.2} s ({rate:.1} tokens/s after the prompt's {prompt} in {:.3} \
         s); stopped by {}",
        generated.prefill_s,
        generated.stop.describe(seq)
    )
}

/// The logits of every position of `prompt` as JSON in `file`; the engine is reset after.
fn dump_logits(
    engine: &mut Engine<CpuBackend>,
    tokenizer: &Tokenizer,
    prompt: &str,
    file: &Path,
) -> Result<(), Failure> {
    let tokens = tokenizer.encode(prompt).map_err(|e| usage(e.to_string()))?;
    if tokens.is_empty() || tokens.len() as u64 > engine.seq() {
        return Err(usage(format!(
            "--dump-logits: the prompt is {} tokens; give 1 to {} (the model's seq)",
            tokens.len(),
            engine.seq()
        )));
    }
    let logits = engine.feed(&tokens, Rows::All).map_err(failed)?;
    engine.reset().map_err(failed)?;
    let rows: Vec<&[f32]> = logits.chunks(engine.vocab() as usize).collect();
    let json = serde_json::json!({ "tokens": tokens, "logits": rows });
    std::fs::write(file, json.to_string())
        .map_err(|e| usage(format!("cannot write {}: {e}", file.display())))
}

/// A Hugging Face model folder (`config.json` beside its weights), not a parc model file.
fn is_hf_folder(path: &Path) -> bool {
    path.is_dir() && path.join("config.json").is_file()
}

/// `--spec FILE` with its `--set`s, as a recorded spec.
fn given_spec(file: &Path, set: &[String]) -> Result<SpecSource, Failure> {
    Ok(SpecSource {
        file: file.display().to_string(),
        dir: spec_folder(file),
        text: read_spec(file).map_err(usage)?,
        overrides: set.to_vec(),
    })
}

/// A Hugging Face folder's weights for `--spec`'s model (its config.json checked against it),
/// read whole as `train.init = hf(…)` reads a rank's part.
fn load_hf(args: &SampleArgs) -> Result<Loaded, Failure> {
    let dir = &args.checkpoint;
    let file = args.spec.as_ref().ok_or_else(|| {
        usage(format!(
            "{} is a Hugging Face model folder; give the .par file of its model with `--spec \
             FILE` (its config.json is checked against it)",
            dir.display()
        ))
    })?;
    let source = given_spec(file, &args.set)?;
    let spec = compile(&source)?;
    let table = parc_compiler::lower::params::build(&spec).table;
    let weights = HfInit::open(dir, &spec, &table).map_err(failed)?;
    let params = weights.global_params(&table).map_err(failed)?;
    let tokenizer = tokenizer(args.tokenizer.as_deref(), &spec, &source.dir)?;
    let saved = SavedModel {
        path: dir.clone(),
        step: 0,
        source: Some(source),
        params,
    };
    Ok(Loaded {
        saved,
        spec,
        tokenizer,
    })
}

/// The saved model, its spec compiled, and the tokenizer.
fn load(args: &SampleArgs) -> Result<Loaded, Failure> {
    if is_hf_folder(&args.checkpoint) {
        return load_hf(args);
    }
    let saved = SavedModel::open(&args.checkpoint).map_err(|e| usage(e.to_string()))?;
    let source = match &args.spec {
        Some(file) => given_spec(file, &args.set)?,
        None => saved.source.clone().ok_or_else(|| {
            usage(format!(
                "{} records no spec (it was written by an older parc or another tool); give \
                 the .par file the model was trained from with `--spec FILE` (and the run's \
                 `--set` overrides)",
                saved.path.display()
            ))
        })?,
    };
    let spec = compile(&source)?;
    let tokenizer = tokenizer(args.tokenizer.as_deref(), &spec, &source.dir)?;
    Ok(Loaded {
        saved,
        spec,
        tokenizer,
    })
}

/// The spec of `source`, its diagnostics on stderr.
fn compile(source: &SpecSource) -> Result<Spec, Failure> {
    check_recorded(source).map_err(usage)?.ok_or_else(|| {
        failed(format!(
            "the model's spec ({}) has errors; `parc check` shows them all",
            source.file
        ))
    })
}

/// `--tokenizer` (a file relative to the working folder), else the spec's (relative to its
/// folder).
fn tokenizer(flag: Option<&str>, spec: &Spec, spec_dir: &Path) -> Result<Tokenizer, Failure> {
    let (kind, dir) = match flag {
        Some("bytes") => (TokenizerSpec::Bytes, Path::new(".")),
        Some("gpt2") => (TokenizerSpec::Gpt2, Path::new(".")),
        Some(path) => (
            TokenizerSpec::File {
                path: path.to_string(),
            },
            Path::new("."),
        ),
        None => {
            let named = data_tokenizer(spec, spec_dir).map_err(|e| usage(e.to_string()))?;
            let kind = named.ok_or_else(|| {
                usage(
                    "the model's spec names no tokenizer (its training data is token ids); give \
                     --tokenizer gpt2, --tokenizer bytes or --tokenizer FILE (a tokenizer.json)",
                )
            })?;
            (kind, spec_dir)
        }
    };
    Tokenizer::open(&kind, dir).map_err(|e| usage(e.to_string()))
}
