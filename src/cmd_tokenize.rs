//! `parc tokenize IN... --tokenizer T --out DIR [--shard-tokens N] [--dtype u16|u32]`: text
//! files, and folders of `.txt` files (in sorted name order), through a tokenizer into a folder
//! of token shards and its `info.json` (`parc_runtime::data::shards`), which a spec reads with
//! `data = "DIR" as u16` (or `as u32`). Each input file is one document, followed by the
//! tokenizer's end-of-text token when it has one: the same stream `text(...)` tokenizes at the
//! start of a run. A progress bar on stderr (when it is a terminal); the summary on stdout.
//! Exit codes: 0 written, 1 an input could not be tokenized or the shards not written, 2 usage
//! (no such input, an unknown tokenizer, ids too wide for `--dtype`, an output folder in use).
use parc_compiler::spec::{DataFormat, Tokenizer as TokenizerSpec};
use parc_runtime::data::files::folder_files;
use parc_runtime::data::shards::{format_for, ShardInfo, ShardWriter};
use parc_runtime::data::text::tokenize_each;
use parc_runtime::data::Tokenizer;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DtypeArg {
    U16,
    U32,
}

#[derive(clap::Args, Debug)]
pub struct TokenizeArgs {
    /// Text files (UTF-8), or folders of .txt files; each file is one document.
    #[arg(required = true, value_name = "IN")]
    pub inputs: Vec<PathBuf>,
    /// `gpt2`, `bytes`, or the path of a Hugging Face tokenizer.json.
    #[arg(long, value_name = "T")]
    pub tokenizer: String,
    /// The folder to write `shard-00000.bin`, … and `info.json` into (created; must be empty).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Tokens per shard (the last holds the rest).
    #[arg(long, value_name = "N", default_value_t = 100_000_000)]
    pub shard_tokens: u64,
    /// Width of the stored ids (default: u16 when the tokenizer's vocabulary fits, else u32).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
}

/// Bytes of text tokenized at once (in parallel) before their tokens are written.
const GROUP_BYTES: u64 = 256 << 20;

pub fn main(args: TokenizeArgs) -> u8 {
    match run(&args) {
        Ok(()) => 0,
        Err((code, message)) => {
            crate::run_prepare::print_error(&message);
            code
        }
    }
}

fn run(args: &TokenizeArgs) -> Result<(), (u8, String)> {
    let usage = |m: String| (2, m);
    if args.shard_tokens == 0 {
        return Err(usage(
            "--shard-tokens 0: a shard must hold at least one token; give 1 or more, or leave \
             the flag out (100,000,000 tokens a shard)"
                .to_string(),
        ));
    }
    let files = input_files(&args.inputs).map_err(usage)?;
    let tokenizer = open_tokenizer(&args.tokenizer).map_err(usage)?;
    let dtype = dtype(args.dtype, &tokenizer).map_err(usage)?;
    let mut writer = ShardWriter::create(&args.out, dtype, args.shard_tokens)
        .map_err(|e| usage(e.to_string()))?;
    let sizes: Vec<u64> = files.iter().map(|f| file_size(f)).collect();
    let bar = progress_bar(sizes.iter().sum());
    let start = Instant::now();
    let failed = |e: parc_runtime::error::RuntimeError| (1, e.to_string());
    if let Err(e) = write_documents(&tokenizer, &files, &sizes, &mut writer, &bar) {
        bar.abandon();
        writer.discard();
        return Err(failed(e));
    }
    let info = writer
        .finish(&tokenizer, files.len() as u64)
        .map_err(failed)?;
    bar.finish_and_clear();
    print_summary(&info, &args.out, start.elapsed().as_secs_f64());
    Ok(())
}

/// Tokenize `files` group by group (each group in parallel) into `writer`, in order.
fn write_documents(
    tokenizer: &Tokenizer,
    files: &[PathBuf],
    sizes: &[u64],
    writer: &mut ShardWriter,
    bar: &indicatif::ProgressBar,
) -> parc_runtime::error::Result<()> {
    for group in groups(files, sizes) {
        for ids in tokenize_each(tokenizer, group, &|n| bar.inc(n as u64))? {
            writer.push(&ids)?;
        }
    }
    Ok(())
}

/// The files the inputs name: a file itself, a folder's `.txt` files in name order.
fn input_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>, String> {
    let mut files = Vec::new();
    for input in inputs {
        if input.is_dir() {
            files.extend(folder_files(input, "txt").map_err(|e| e.to_string())?);
        } else if input.is_file() {
            files.push(input.clone());
        } else {
            return Err(format!(
                "{}: no such file or folder; give text files or folders of .txt files",
                input.display()
            ));
        }
    }
    Ok(files)
}

/// `gpt2`, `bytes`, or a tokenizer.json path.
fn open_tokenizer(name: &str) -> Result<Tokenizer, String> {
    let spec = match TokenizerSpec::from_name(name) {
        Some(builtin) => builtin,
        None if Path::new(name).exists() => TokenizerSpec::File {
            path: name.to_string(),
        },
        None => {
            return Err(format!(
                "`{name}` is not a tokenizer: use {}, or the path of a Hugging Face \
                 tokenizer.json (no such file)",
                TokenizerSpec::NAMES.join(" or ")
            ))
        }
    };
    Tokenizer::open(&spec, Path::new("")).map_err(|e| e.to_string())
}

/// The id width asked for, or the narrowest that holds every id.
fn dtype(asked: Option<DtypeArg>, tokenizer: &Tokenizer) -> Result<DataFormat, String> {
    let vocab = tokenizer.vocab_size();
    match asked {
        None => Ok(format_for(vocab)),
        Some(DtypeArg::U32) => Ok(DataFormat::U32),
        Some(DtypeArg::U16) if format_for(vocab) == DataFormat::U16 => Ok(DataFormat::U16),
        Some(DtypeArg::U16) => Err(format!(
            "tokenizer {} has {vocab} tokens, more than u16 ids hold (65536); use `--dtype u32`",
            tokenizer.name()
        )),
    }
}

fn file_size(file: &Path) -> u64 {
    std::fs::metadata(file).map(|m| m.len()).unwrap_or(0)
}

/// `files` in consecutive groups of about [`GROUP_BYTES`] of text (at least one file each).
fn groups<'a>(files: &'a [PathBuf], sizes: &[u64]) -> Vec<&'a [PathBuf]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, size) in sizes.iter().enumerate() {
        bytes += size;
        if bytes >= GROUP_BYTES || i + 1 == files.len() {
            out.push(&files[start..=i]);
            (start, bytes) = (i + 1, 0);
        }
    }
    out
}

/// A bar over the input's bytes on stderr; hidden when stderr is not a terminal.
fn progress_bar(total: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total);
    let template = "tokenizing [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}";
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

fn print_summary(info: &ShardInfo, out: &Path, seconds: f64) {
    let dtype = info.dtype.name();
    let plural = |n: usize| if n == 1 { "" } else { "s" };
    let (documents, shards) = (info.documents as usize, info.shards.len());
    println!(
        "wrote {} tokens of {documents} document{} in {shards} {dtype} shard{} to {} ({:.0} \
         tokens/s, tokenizer {})",
        info.tokens,
        plural(documents),
        plural(shards),
        out.display(),
        info.tokens as f64 / seconds.max(1e-9),
        info.tokenizer
    );
    println!("read it with: data = \"{}\" as {dtype}", out.display());
}
