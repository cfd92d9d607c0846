//! Text to token ids, file by file. Each file is one document: its tokens, then the tokenizer's
//! end-of-text token when it has one (GPT-2's `<|endoftext|>` = 50256; `bytes` has none, so
//! byte-tokenized files simply follow one another). Files are UTF-8 text; they are tokenized in
//! parallel and their tokens concatenated in the order given.
use super::tokenizer::Tokenizer;
use crate::error::{Result, RuntimeError};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

fn text_error(file: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Data(format!("{}: {what}", file.display()))
}

/// The text of `file`, or an error naming it (missing, unreadable, not UTF-8).
pub fn read_text(file: &Path) -> Result<String> {
    let bytes = std::fs::read(file).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            text_error(file, "no such file; create it or fix the path")
        } else {
            text_error(file, format!("cannot read it: {e}"))
        }
    })?;
    String::from_utf8(bytes).map_err(|e| {
        text_error(
            file,
            format!(
                "not UTF-8 text (an invalid byte at offset {}); convert it to UTF-8, or read it \
                 as raw bytes with `data = \"…\" as bytes`",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// The tokens of one document: `file`'s text, then the end-of-text token when the tokenizer
/// has one; `progress` gets the bytes of text done as parts of it finish.
pub fn tokenize_document(
    tokenizer: &Tokenizer,
    file: &Path,
    progress: &(dyn Fn(usize) + Sync),
) -> Result<Vec<u32>> {
    let text = read_text(file)?;
    let mut ids = tokenizer
        .encode_with_progress(&text, progress)
        .map_err(|e| text_error(file, e))?;
    ids.extend(tokenizer.end_of_text());
    Ok(ids)
}

/// The documents of `files`, tokenized in parallel, in the order given.
pub fn tokenize_each(
    tokenizer: &Tokenizer,
    files: &[PathBuf],
    progress: &(dyn Fn(usize) + Sync),
) -> Result<Vec<Vec<u32>>> {
    files
        .par_iter()
        .map(|f| tokenize_document(tokenizer, f, progress))
        .collect()
}

/// The documents of `files`, tokenized in parallel, as one stream in the order given.
pub fn tokenize_files(tokenizer: &Tokenizer, files: &[PathBuf]) -> Result<Vec<u32>> {
    Ok(tokenize_each(tokenizer, files, &|_| {})?.concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("parc-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join(name);
        std::fs::write(&file, bytes).unwrap();
        file
    }

    #[test]
    fn each_file_is_a_document_ended_by_end_of_text() {
        let (a, b) = (write("a.txt", b"Hello world"), write("b.txt", b"Hello"));
        let gpt2 = tokenize_files(&Tokenizer::gpt2(), &[a.clone(), b.clone()]).unwrap();
        assert_eq!(gpt2, [15496, 995, 50256, 15496, 50256]);
        let bytes = tokenize_files(&Tokenizer::bytes(), &[a, b]).unwrap();
        assert_eq!(bytes, b"Hello worldHello".map(u32::from));
    }

    #[test]
    fn missing_and_non_utf8_files_are_named() {
        let missing = Path::new("/nonexistent-parc/c.txt");
        let err = tokenize_document(&Tokenizer::gpt2(), missing, &|_| {})
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("c.txt") && err.contains("no such file"),
            "{err}"
        );
        let latin1 = write("latin1.txt", b"caf\xe9");
        let err = read_text(&latin1).unwrap_err().to_string();
        assert!(
            err.contains("latin1.txt") && err.contains("offset 3"),
            "{err}"
        );
    }
}
