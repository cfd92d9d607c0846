//! `parc check`'s look at `train.init = hf("DIR")`, which the pure compiler cannot read, making
//! the checks `parc run` makes before any rank starts: a model that is none of the families
//! parc maps to transformers' names is an error (E1002), and so is a config.json that
//! disagrees with the spec (E1003: another family, another size, a RoPE scaling the spec does
//! not have); a folder that is not here is a warning (W1003), as missing training data is.
//! The weights themselves (names, shapes, dtypes) are read by `parc run`.
use parc_compiler::diag::Diagnostic;
use parc_compiler::spec::{InitFrom, Spec};
use parc_runtime::hf;
use std::path::Path;

/// The initial weights' diagnostics for `spec`, whose relative paths start at `spec_dir`.
pub fn diagnose(spec: &Spec, spec_dir: &Path) -> Vec<Diagnostic> {
    let InitFrom::Hf { path, span } = &spec.train.init else {
        return Vec::new();
    };
    let arch = match hf::recognise(spec) {
        Ok(arch) => arch,
        Err(e) => {
            let d = Diagnostic::error(
                "E1002",
                "the model has no Hugging Face counterpart to start from",
            )
            .label(*span, "these weights")
            .help(format!("{e}; start from seeded weights (remove `init`)"));
            return vec![d];
        }
    };
    let dir = spec_dir.join(path);
    if !dir.join("config.json").is_file() {
        let d = Diagnostic::warning(
            "W1003",
            "the Hugging Face weights are not here; `parc run` fails unless they are where the run starts",
        )
        .label(*span, "these weights")
        .help(format!(
            "{}: no config.json (paths in `train.init` are relative to the spec's folder); \
             download the model folder there or fix the path",
            dir.display()
        ));
        return vec![d];
    }
    match hf::check_config(&dir, &arch) {
        Ok(_) => Vec::new(),
        Err(e) => {
            vec![
                Diagnostic::error("E1003", "the Hugging Face weights do not fit this model")
                    .label(*span, "these weights")
                    .help(e.to_string()),
            ]
        }
    }
}
