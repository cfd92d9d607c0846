//! `--set PATH=VALUE` overrides: parsing the flag's text. The checker applies them (see
//! `check::settings` for the paths): the value is parsed with the language's expression syntax,
//! from its own source named `--set PATH=VALUE` so diagnostics can point into it.

/// One `--set` flag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Override {
    /// Dotted path, e.g. `parallel.tp` or `model.layers`.
    pub path: String,
    /// The value as written, e.g. `4`, `interleaved`, `"data.bin" as u16`.
    pub value: String,
}

impl Override {
    /// The text of the source this override is checked from.
    pub fn source_text(&self) -> String {
        format!("{}={}", self.path, self.value)
    }
}

/// Parse `PATH=VALUE`. The path is dotted names; the value is anything non-empty.
pub fn parse_override(s: &str) -> Result<Override, String> {
    let Some((path, value)) = s.split_once('=') else {
        return Err(format!(
            "`--set {s}` needs the form PATH=VALUE, e.g. `--set parallel.tp=2`"
        ));
    };
    let path = path.trim();
    let value = value.trim();
    let valid = !path.is_empty()
        && path.split('.').all(|seg| {
            !seg.is_empty() && seg.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
    if !valid {
        return Err(format!(
            "`--set {s}`: `{path}` is not a dotted path like `parallel.tp`"
        ));
    }
    if value.is_empty() {
        return Err(format!("`--set {s}` has no value after `=`"));
    }
    Ok(Override {
        path: path.to_string(),
        value: value.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_path_and_value() {
        let o = parse_override("parallel.tp=4").unwrap();
        assert_eq!((o.path.as_str(), o.value.as_str()), ("parallel.tp", "4"));
        let o = parse_override("train.data=\"a=b.txt\" as bytes").unwrap();
        assert_eq!(o.value, "\"a=b.txt\" as bytes");
    }

    #[test]
    fn refuses_malformed_flags() {
        assert!(parse_override("parallel.tp").is_err());
        assert!(parse_override("=4").is_err());
        assert!(parse_override("parallel..tp=4").is_err());
        assert!(parse_override("parallel.tp=").is_err());
    }
}
