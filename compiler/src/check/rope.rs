//! `RoPE(theta = …, scaling = …, fraction = …)` as the language writes it: `theta` a positive
//! base (default 10000), `fraction` the share of each head's features that turn (above 0, at
//! most 1, the default; the attention checks that it makes an even number), `scaling` one of
//!
//! ```text
//! scaling = none                                  // plain RoPE (the default)
//! scaling = linear { factor: 4 }                  // position interpolation: every frequency / 4
//! scaling = llama3 { factor: 32, low_freq_factor: 1, high_freq_factor: 4,
//!                    original_max_position: 8192 } // Llama 3.1–3.3's published rule
//! ```
//!
//! `llama3` needs all four fields, as transformers does. What the frequencies then are is
//! `ir::rope`'s; this module only reads and checks the values: an unknown kind (E0904, with a
//! note for the kinds parc lacks), an unknown field (E0203) or one given twice (E0204), a
//! missing field (E0207), a value that is not a plain number (E0902, E0908) or is out of range
//! (E0903: a factor or `low_freq_factor` not positive, `low_freq_factor` not below
//! `high_freq_factor`, an `original_max_position` of 0).
use super::layers::{ArgValue, Tagged};
use super::number::{Number, Unit};
use super::suggest;
use crate::diag::{Diagnostic, Span};
use crate::spec::{Rope, RopeScaling};
use std::collections::HashMap;

/// The scaling kinds parc has, by their `rope_type` names.
const KINDS: [&str; 2] = ["llama3", "linear"];

/// Each kind's fields, in the order its help lists them.
fn fields_of(kind: &str) -> &'static [&'static str] {
    match kind {
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position",
        ],
        _ => &["factor"],
    }
}

/// Llama 3.1's published scaling, written as the language takes it (for helps).
const PUBLISHED: &str = "Llama 3.1 publishes `llama3 { factor: 8, low_freq_factor: 1, \
                         high_freq_factor: 4, original_max_position: 8192 }` (Llama 3.2: factor 32)";

/// The rotation of `RoPE(…)`'s bound arguments.
pub fn rope(values: &HashMap<&'static str, ArgValue>) -> Result<Rope, Diagnostic> {
    let theta = match values.get("theta") {
        None => 10000.0,
        Some(ArgValue::Num(n)) if n.value > 0.0 => n.value,
        Some(a) => {
            return Err(
                Diagnostic::error("E0903", "RoPE's theta must be a positive number")
                    .label(a.span(), "this value")
                    .help("the usual values are 10000 (Llama 2) and 500000 (Llama 3)"),
            )
        }
    };
    let scaling = match values.get("scaling") {
        None => RopeScaling::None,
        Some(ArgValue::Word(w, _)) if w == "none" => RopeScaling::None,
        Some(ArgValue::Tagged(t)) => scaling(t)?,
        Some(other) => {
            return Err(Diagnostic::error(
                "E0902",
                "RoPE's `scaling` must be `none`, `llama3 { … }` or `linear { … }`",
            )
            .label(other.span(), "this value")
            .help(format!("write the kind and its fields: {PUBLISHED}")))
        }
    };
    let fraction = match values.get("fraction") {
        None => 1.0,
        Some(ArgValue::Num(n)) if n.value > 0.0 && n.value <= 1.0 => n.value,
        Some(a) => {
            return Err(Diagnostic::error(
                "E0903",
                "RoPE's fraction must be a number above 0 and at most 1",
            )
            .label(a.span(), "this value")
            .help(
                "the share of each head's features that turn: 1 (all, the default), GPT-NeoX \
                 and Pythia 0.25 (rotary_pct), Phi-2 0.4 (partial_rotary_factor)",
            ))
        }
    };
    Ok(Rope {
        theta,
        scaling,
        fraction,
    })
}

/// `llama3 { … }` or `linear { … }`.
fn scaling(t: &Tagged) -> Result<RopeScaling, Diagnostic> {
    let kind = t.tag.name.as_str();
    if !KINDS.contains(&kind) {
        return Err(unknown_kind(t));
    }
    let f = Fields::read(t, fields_of(kind))?;
    if kind == "linear" {
        return Ok(RopeScaling::Linear {
            factor: f.positive("factor")?.0,
        });
    }
    let factor = f.positive("factor")?.0;
    let (low, low_span) = f.positive("low_freq_factor")?;
    let (high, high_span) = f.positive("high_freq_factor")?;
    if low >= high {
        return Err(Diagnostic::error(
            "E0903",
            format!(
                "`llama3`'s low_freq_factor = {low} must be below its high_freq_factor = {high}"
            ),
        )
        .label(low_span, "low_freq_factor")
        .label(high_span, "high_freq_factor")
        .help(format!(
            "frequencies blend between the two, so low must be the smaller; {PUBLISHED}"
        )));
    }
    let original_max_position = f.count("original_max_position")?;
    Ok(RopeScaling::Llama3 {
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position,
    })
}

/// E0904 for `yarn { … }` and other kinds parc does not have.
fn unknown_kind(t: &Tagged) -> Diagnostic {
    let kind = t.tag.name.as_str();
    let one_of = format!("RoPE's scaling is {}", suggest::one_of(&KINDS));
    let d = Diagnostic::error("E0904", format!("`{kind}` is not a valid RoPE scaling"))
        .label(t.tag.span, "unknown scaling")
        .help(suggest::help(kind, KINDS, &one_of));
    let lacks = match kind {
        "yarn" => Some("YaRN (transformers' `rope_type: yarn`: DeepSeek, Qwen's long contexts)"),
        "dynamic" | "ntk" | "dynamic_ntk" => Some("dynamic NTK scaling (`rope_type: dynamic`)"),
        "longrope" | "su" => Some("LongRoPE (`rope_type: longrope`: Phi-3's long contexts)"),
        _ => None,
    };
    match lacks {
        Some(what) => d.note(format!(
            "parc's RoPE has no {what}: only `llama3` (Llama 3.1–3.3) and `linear` scaling"
        )),
        None => d,
    }
}

/// A tagged value's fields by name, each given once and each one the kind has.
struct Fields<'a> {
    tag: &'a Tagged,
    by_name: HashMap<&'a str, &'a ArgValue>,
}

impl<'a> Fields<'a> {
    fn read(t: &'a Tagged, allowed: &[&str]) -> Result<Fields<'a>, Diagnostic> {
        let kind = t.tag.name.as_str();
        let mut by_name = HashMap::new();
        for (name, value) in &t.fields {
            let field = name.name.as_str();
            if !allowed.contains(&field) {
                return Err(unknown_field(kind, name.span, field, allowed));
            }
            if by_name.insert(field, value).is_some() {
                return Err(Diagnostic::error(
                    "E0204",
                    format!("`{kind}`'s `{field}` is set twice"),
                )
                .label(name.span, "set again here")
                .help("keep one of the two"));
            }
        }
        let missing: Vec<&str> = allowed
            .iter()
            .copied()
            .filter(|f| !by_name.contains_key(f))
            .collect();
        if !missing.is_empty() {
            let what = if kind == "llama3" {
                PUBLISHED.to_string()
            } else {
                "e.g. `linear { factor: 4 }` stretches the positions fourfold".to_string()
            };
            return Err(Diagnostic::error(
                "E0207",
                format!("`{kind}` scaling is missing {}", all_of(&missing)),
            )
            .label(t.span, "here")
            .help(format!("`{kind}` takes {}; {what}", all_of(allowed))));
        }
        Ok(Fields { tag: t, by_name })
    }

    /// A field's plain number (every field was checked present).
    fn number(&self, field: &str) -> Result<Number, Diagnostic> {
        let kind = &self.tag.tag.name;
        match self.by_name.get(field) {
            Some(ArgValue::Num(n)) if n.unit == Unit::None => Ok(*n),
            Some(ArgValue::Num(n)) => Err(Diagnostic::error(
                "E0908",
                format!(
                    "`{kind}`'s {field} must be a plain number, not {}",
                    n.unit.describe()
                ),
            )
            .label(n.span, "this value")
            .help(format!("write {field} without a unit"))),
            Some(other) => Err(Diagnostic::error(
                "E0902",
                format!("`{kind}`'s {field} must be a number"),
            )
            .label(other.span(), "this value")
            .help(format!("write a number: {PUBLISHED}"))),
            None => Err(
                Diagnostic::error("E0207", format!("`{kind}` has no {field}"))
                    .label(self.tag.span, "here"),
            ),
        }
    }

    /// A positive, finite factor and where it is written.
    fn positive(&self, field: &str) -> Result<(f64, Span), Diagnostic> {
        let n = self.number(field)?;
        if n.value.is_finite() && n.value > 0.0 {
            return Ok((n.value, n.span));
        }
        let kind = &self.tag.tag.name;
        Err(Diagnostic::error(
            "E0903",
            format!("`{kind}`'s {field} must be positive, found {}", n.value),
        )
        .label(n.span, "not positive")
        .help(format!("use a positive {field}; {PUBLISHED}")))
    }

    /// A whole number of positions, at least 1.
    fn count(&self, field: &str) -> Result<u64, Diagnostic> {
        let n = self.number(field)?;
        let kind = &self.tag.tag.name;
        let v = n.as_count_in(&format!("`{kind}`'s {field}"), 1, None)?;
        if v == 0 {
            return Err(Diagnostic::error(
                "E0903",
                format!("`{kind}`'s {field} must be at least 1, found 0"),
            )
            .label(n.span, "zero")
            .help(format!(
                "give the context length the model was trained at before scaling; {PUBLISHED}"
            )));
        }
        Ok(v)
    }
}

/// `a`, `b` and `c`, each in backticks.
fn all_of(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|i| format!("`{i}`")).collect();
    match quoted.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => quoted.concat(),
    }
}

/// E0203 for a field `kind` does not have; transformers' `original_max_position_embeddings`
/// gets parc's name as an edit.
fn unknown_field(kind: &str, span: Span, field: &str, allowed: &[&str]) -> Diagnostic {
    let takes = format!("`{kind}` takes {}", suggest::one_of(allowed));
    let d = Diagnostic::error("E0203", format!("`{kind}` has no field `{field}`"))
        .label(span, "not a field of this choice")
        .help(suggest::help(field, allowed.iter().copied(), &takes));
    match (field, kind) {
        ("original_max_position_embeddings", "llama3") => d.edit(span, "original_max_position"),
        _ => d,
    }
}
