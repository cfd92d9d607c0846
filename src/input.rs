//! What every command reads from the user before compiling: the spec file (UTF-8, at most
//! 16 MiB, a leading byte-order mark dropped) and the `--set PATH=VALUE` overrides. Errors are full sentences naming the file or
//! the flag.
use parc_compiler::Override;
use std::path::Path;

/// Files larger than this are refused before parsing.
const MAX_BYTES: u64 = 16 * 1024 * 1024;

/// Read a spec file: UTF-8, at most 16 MiB. The error is a full sentence.
pub fn read_spec(path: &Path) -> Result<String, String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    if meta.is_dir() {
        return Err(format!("{shown} is a folder, not a .par file"));
    }
    if meta.len() > MAX_BYTES {
        return Err(format!(
            "{shown} is {:.1} MiB; parc reads spec files up to 16 MiB",
            meta.len() as f64 / (1024.0 * 1024.0)
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        format!(
            "{shown} is not UTF-8 text (invalid byte at offset {}); .par files are UTF-8",
            e.utf8_error().valid_up_to()
        )
    })?;
    Ok(without_bom(text))
}

/// The text without a leading byte-order mark, which Windows editors write at the start of
/// UTF-8 files: invisible in an editor, it would be a syntax error before the first character.
fn without_bom(text: String) -> String {
    match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    }
}

/// Parse every `--set` flag; the message names the bad flag.
pub fn parse_overrides(set: &[String]) -> Result<Vec<Override>, String> {
    set.iter()
        .map(|s| parc_compiler::parse_override(s))
        .collect()
}
