//! How a failed run's error is shown: a communication failure at an instruction of a rank's
//! program also names the spec line of the layer that instruction belongs to
//! (`at FILE:LINE:COL: layer blocks.1.attn`).
use crate::input::{parse_overrides, read_spec};
use parc_compiler::diag::Sources;
use parc_compiler::driver::{self, CompileOptions, Stage};
use parc_compiler::spec::Spec;
use parc_runtime::error::RuntimeError;
use std::path::Path;

/// `error` as text, with the spec line of the instruction where a rank stopped when known.
/// `file` and `set` are the run's spec and overrides (checked again to map the line).
pub fn describe(error: &RuntimeError, spec: &Spec, file: &Path, set: &[String]) -> String {
    let text = error.to_string();
    let RuntimeError::AtInstruction {
        node: Some(node), ..
    } = error
    else {
        return text;
    };
    let Some(layer) = spec.model.nodes.get(node.0 as usize) else {
        return text;
    };
    match sources(file, set) {
        Some(sources) => {
            let name = sources
                .get(layer.span.file)
                .map_or_else(|| file.display().to_string(), |f| f.name.clone());
            let (line, col) = sources.line_col(layer.span);
            format!("{text}\n  at {name}:{line}:{col}: layer `{}`", layer.name)
        }
        None => format!("{text}\n  at layer `{}`", layer.name),
    }
}

/// The sources of the run's spec, as the compiler saw them (same file ids as its spans).
fn sources(file: &Path, set: &[String]) -> Option<Sources> {
    let overrides = parse_overrides(set).ok()?;
    let text = read_spec(file).ok()?;
    let options = CompileOptions::through(Stage::Check);
    let checked = driver::compile(&file.display().to_string(), text, &overrides, &options);
    Some(checked.sources)
}
