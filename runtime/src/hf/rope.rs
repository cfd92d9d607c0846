//! RoPE's frequency scaling in config.json, as transformers keeps it: `rope_scaling` (4.x:
//! `rope_type` or the older `type`, with the kind's fields) and `rope_parameters` (5.x: the
//! same plus `rope_theta`). [`written`] gives both for an export, so either version reads it;
//! [`mismatches`] reads each one a file has and names where it disagrees with the spec's
//! scaling, or which `rope_type` parc does not have (`yarn`, `dynamic`, `longrope`, …).
//!
//! `llama3` needs `factor`, `low_freq_factor`, `high_freq_factor` and
//! `original_max_position_embeddings` (parc's `original_max_position`), `linear` its `factor`,
//! as transformers' own validation does; `default` (or no `rope_type`) is plain RoPE.
use parc_compiler::spec::RopeScaling;
use serde_json::{json, Map, Value};

/// The keys config.json may keep the scaling under, newest first.
const KEYS: [&str; 2] = ["rope_parameters", "rope_scaling"];

/// `rope_scaling` and `rope_parameters` for a model whose RoPE has base `theta` and `scaling`:
/// for plain RoPE no `rope_scaling` (what transformers writes) and `rope_parameters` of
/// `rope_type: default`.
pub fn written(theta: f64, scaling: RopeScaling) -> (Option<Value>, Value) {
    let fields = match scaling {
        RopeScaling::None => json!({ "rope_type": "default" }),
        RopeScaling::Linear { factor } => json!({ "rope_type": "linear", "factor": factor }),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position,
        }),
    };
    let mut parameters = fields.clone();
    parameters["rope_theta"] = json!(theta);
    let scaling = (!scaling.is_none()).then_some(fields);
    (scaling, parameters)
}

/// What `config`'s RoPE scaling says that the spec's `spec` does not: one line per key that
/// disagrees or that parc cannot read.
pub fn mismatches(config: &Map<String, Value>, spec: RopeScaling) -> Vec<String> {
    let present = KEYS
        .iter()
        .filter_map(|key| Some((*key, config.get(*key).filter(|v| !v.is_null())?)));
    present
        .filter_map(|(key, v)| match read(v) {
            Err(why) => Some(format!("config.json {key} {why}")),
            Ok(got) if agrees(got, spec) => None,
            Ok(got) => Some(format!(
                "config.json {key} scales RoPE by `{got}`, the spec by `{spec}` (write the \
                 file's as the spec RoPE's `scaling`; std::llama's Block takes one too)"
            )),
        })
        .collect()
}

/// The scaling one `rope_scaling` or `rope_parameters` object describes.
fn read(v: &Value) -> Result<RopeScaling, String> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(Value::as_str);
    let number = |field: &str| {
        v.get(field).and_then(Value::as_f64).ok_or_else(|| {
            format!(
                "has rope_type {:?} without a number `{field}`",
                kind.unwrap_or("")
            )
        })
    };
    match kind {
        None | Some("default") => Ok(RopeScaling::None),
        Some("linear") => Ok(RopeScaling::Linear {
            factor: number("factor")?,
        }),
        Some("llama3") => {
            let original = number("original_max_position_embeddings")?;
            if original.fract() != 0.0 || !(0.0..=1e15).contains(&original) {
                return Err(format!(
                    "has original_max_position_embeddings = {original}, not a count of positions"
                ));
            }
            Ok(RopeScaling::Llama3 {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_max_position: original as u64,
            })
        }
        Some(other) => Err(format!(
            "has rope_type {other:?}, which parc's RoPE does not have (parc has `llama3`, \
             Llama 3.1–3.3's, and `linear`; no YaRN, dynamic NTK or LongRoPE)"
        )),
    }
}

/// Whether a file's scaling is the spec's: the same kind and fields, factors within float32's
/// precision (files written through float32 keep 7 digits).
fn agrees(got: RopeScaling, spec: RopeScaling) -> bool {
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(f64::MIN_POSITIVE);
    match (got, spec) {
        (RopeScaling::None, RopeScaling::None) => true,
        (RopeScaling::Linear { factor: a }, RopeScaling::Linear { factor: b }) => close(a, b),
        (
            RopeScaling::Llama3 {
                factor: f1,
                low_freq_factor: l1,
                high_freq_factor: h1,
                original_max_position: o1,
            },
            RopeScaling::Llama3 {
                factor: f2,
                low_freq_factor: l2,
                high_freq_factor: h2,
                original_max_position: o2,
            },
        ) => close(f1, f2) && close(l1, l2) && close(h1, h2) && o1 == o2,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parc_compiler::testing::LLAMA3_2_SCALING as LLAMA3_2;

    fn config(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn what_an_export_writes_reads_back_as_the_same_scaling() {
        for scaling in [
            RopeScaling::None,
            RopeScaling::Linear { factor: 4.0 },
            LLAMA3_2,
        ] {
            let (old, new) = written(500000.0, scaling);
            assert_eq!(new["rope_theta"], json!(500000.0));
            let mut c = json!({ "rope_parameters": new });
            if let Some(old) = old {
                c["rope_scaling"] = old;
            }
            assert_eq!(mismatches(&config(c), scaling), Vec::<String>::new());
        }
        assert_eq!(written(1e4, RopeScaling::None).0, None);
    }

    #[test]
    fn the_older_type_key_and_float32_digits_are_read() {
        let c = config(json!({ "rope_scaling": { "type": "linear", "factor": 4.0000001 } }));
        assert!(mismatches(&c, RopeScaling::Linear { factor: 4.0 }).is_empty());
        let c =
            config(json!({ "rope_scaling": null, "rope_parameters": { "rope_type": "default" } }));
        assert!(mismatches(&c, RopeScaling::None).is_empty());
    }

    #[test]
    fn a_scaling_the_spec_lacks_is_named_with_what_to_write() {
        let c = config(json!({ "rope_scaling": {
            "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3" } }));
        let problems = mismatches(&c, RopeScaling::None);
        assert_eq!(problems.len(), 1, "{problems:?}");
        let named = format!("rope_scaling scales RoPE by `{LLAMA3_2}`, the spec by `none`");
        assert!(problems[0].contains(&named), "{}", problems[0]);
        // Llama 3.1's factor 8 against the file's 32.
        let other = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        };
        assert_eq!(mismatches(&c, other).len(), 1);
        assert!(mismatches(&c, LLAMA3_2).is_empty());
    }

    #[test]
    fn kinds_parc_lacks_and_missing_fields_are_named() {
        for kind in ["yarn", "dynamic", "longrope"] {
            let c = config(json!({ "rope_scaling": { "rope_type": kind, "factor": 4.0 } }));
            let problems = mismatches(&c, RopeScaling::None);
            assert!(
                problems[0].contains(&format!(
                    "rope_type \"{kind}\", which parc's RoPE does not have"
                )),
                "{problems:?}"
            );
        }
        let c = config(json!({ "rope_parameters": { "rope_type": "llama3", "factor": 8.0 } }));
        let problems = mismatches(&c, LLAMA3_2);
        assert!(
            problems[0].contains("rope_parameters has rope_type \"llama3\" without a number"),
            "{problems:?}"
        );
    }
}
