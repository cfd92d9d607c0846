//! How the fuzz targets read their bytes: as lossy UTF-8, split at the first "\n--set " into a
//! spec and one `--set` override (dropped where it does not parse).
use parc_compiler::Override;

/// The spec's text and its overrides (none or one).
pub fn spec_and_overrides(data: &[u8]) -> (String, Vec<Override>) {
    let text = String::from_utf8_lossy(data);
    let (spec_text, set) = match text.split_once("\n--set ") {
        Some((a, b)) => (a.to_string(), Some(b.to_string())),
        None => (text.into_owned(), None),
    };
    let overrides = set
        .iter()
        .filter_map(|s| parc_compiler::parse_override(s).ok())
        .collect();
    (spec_text, overrides)
}
