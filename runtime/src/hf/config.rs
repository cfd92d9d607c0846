//! config.json: the one transformers reads a model's architecture from. [`config_json`]
//! writes it for an export; [`check_config`] reads a checkpoint's against the spec, naming
//! every field that disagrees in one error.
//!
//! A field missing from a file takes transformers' default for its model type. Fields that
//! change no weight and no computation parc does in training (dropout, token ids,
//! `max_position_embeddings` of a RoPE model) are written but not checked. RoPE's frequency
//! scaling (`rope_scaling`, `rope_parameters`) is `rope`'s.
use super::family::{Arch, Family};
use super::names::HfSizes;
use super::rope;
use crate::error::{Result, RuntimeError};
use serde_json::{json, Map, Value};
use std::path::Path;

/// The config.json of `arch` with `sizes`' vocabulary, its weights stored as `dtype`
/// (`float32`, `bfloat16`).
pub fn config_json(arch: &Arch, sizes: HfSizes, dtype: &str) -> Value {
    let mut config = match arch.family {
        Family::Gpt2 => json!({
            "vocab_size": sizes.vocab,
            "n_positions": sizes.positions,
            "n_embd": arch.dim,
            "n_layer": arch.blocks.len(),
            "n_head": arch.heads,
            "n_inner": arch.ffn,
            "activation_function": arch.activation,
            "layer_norm_epsilon": arch.eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": true,
            "scale_attn_by_inverse_layer_idx": false,
            "reorder_and_upcast_attn": false,
            "tie_word_embeddings": true,
        }),
        Family::Llama | Family::Qwen2 | Family::Qwen3 => {
            let (rope_scaling, rope_parameters) = rope::written(arch.theta, arch.rope_scaling);
            let mut c = json!({
                "vocab_size": sizes.vocab,
                "hidden_size": arch.dim,
                "intermediate_size": arch.ffn,
                "num_hidden_layers": arch.blocks.len(),
                "num_attention_heads": arch.heads,
                "num_key_value_heads": arch.kv_heads,
                "head_dim": arch.head_dim,
                "hidden_act": "silu",
                "max_position_embeddings": arch.seq,
                "rms_norm_eps": arch.eps,
                "rope_theta": arch.theta,
                "rope_parameters": rope_parameters,
                "attention_dropout": 0.0,
                "tie_word_embeddings": arch.tied,
            });
            if let Some(scaling) = rope_scaling {
                c["rope_scaling"] = scaling;
            }
            match arch.family {
                Family::Llama => {
                    c["attention_bias"] = json!(arch.qkv_bias);
                    c["mlp_bias"] = json!(false);
                }
                Family::Qwen3 => {
                    c["attention_bias"] = json!(arch.qkv_bias);
                    c["use_sliding_window"] = json!(false);
                }
                _ => c["use_sliding_window"] = json!(false),
            }
            c
        }
    };
    config["architectures"] = json!([arch.family.class()]);
    config["model_type"] = json!(arch.family.model_type());
    config["initializer_range"] = json!(0.02);
    config["bos_token_id"] = Value::Null;
    config["eos_token_id"] = Value::Null;
    config["torch_dtype"] = json!(dtype);
    config
}

/// What a field must be for the spec.
enum Want {
    Int(u64),
    /// An integer of at most this (the spec's padded vocabulary).
    AtMost(u64),
    /// An integer of at least this (GPT-2's positions).
    AtLeast(u64),
    Float(f64),
    Bool(bool),
    Str(&'static str),
}

/// One checked field: its key, what the spec says (`spec kv_heads = 4`), what it must be,
/// and transformers' default when the file leaves it out.
struct Field {
    key: &'static str,
    spec: String,
    want: Want,
    default: Value,
}

fn field(key: &'static str, spec: impl Into<String>, want: Want, default: Value) -> Field {
    Field {
        key,
        spec: spec.into(),
        want,
        default,
    }
}

/// The fields of `arch`'s family that must agree with the spec.
fn fields(arch: &Arch) -> Vec<Field> {
    let layers = arch.blocks.len() as u64;
    let a = arch;
    match arch.family {
        Family::Gpt2 => vec![
            field(
                "n_embd",
                format!("d = {}", a.dim),
                Want::Int(a.dim),
                json!(768),
            ),
            field(
                "n_layer",
                format!("layers = {layers}"),
                Want::Int(layers),
                json!(12),
            ),
            field(
                "n_head",
                format!("heads = {}", a.heads),
                Want::Int(a.heads),
                json!(12),
            ),
            field(
                "n_inner",
                format!("ffn = {}", a.ffn),
                Want::Int(a.ffn),
                Value::Null,
            ),
            field(
                "vocab_size",
                format!("vocab = {}", a.vocab),
                Want::AtMost(a.vocab),
                json!(50257),
            ),
            field(
                "n_positions",
                format!("seq = {}", a.seq),
                Want::AtLeast(a.seq),
                json!(1024),
            ),
            field(
                "layer_norm_epsilon",
                format!("LayerNorm eps = {}", a.eps),
                Want::Float(a.eps),
                json!(1e-5),
            ),
            field(
                "activation_function",
                format!(
                    "act = {}",
                    if a.activation == "gelu" {
                        "gelu"
                    } else {
                        "gelu_tanh"
                    }
                ),
                Want::Str(a.activation),
                json!("gelu_new"),
            ),
            field(
                "tie_word_embeddings",
                "head tied = Embedding",
                Want::Bool(true),
                json!(true),
            ),
            field(
                "scale_attn_weights",
                "attention scaled by 1/sqrt(head_dim)",
                Want::Bool(true),
                json!(true),
            ),
            field(
                "scale_attn_by_inverse_layer_idx",
                "attention not scaled by layer",
                Want::Bool(false),
                json!(false),
            ),
        ],
        Family::Llama | Family::Qwen2 | Family::Qwen3 => {
            let default_eps = json!(1e-6);
            // Qwen3's config defaults head_dim to 128; the others' to hidden / heads.
            let head_dim_default = match a.family {
                Family::Qwen3 => json!(128),
                _ => Value::Null,
            };
            let mut f = vec![
                field(
                    "hidden_size",
                    format!("d = {}", a.dim),
                    Want::Int(a.dim),
                    json!(4096),
                ),
                field(
                    "num_hidden_layers",
                    format!("layers = {layers}"),
                    Want::Int(layers),
                    json!(32),
                ),
                field(
                    "num_attention_heads",
                    format!("heads = {}", a.heads),
                    Want::Int(a.heads),
                    json!(32),
                ),
                field(
                    "num_key_value_heads",
                    format!("kv_heads = {}", a.kv_heads),
                    Want::Int(a.kv_heads),
                    Value::Null,
                ),
                field(
                    "head_dim",
                    format!("head_dim = {}", a.head_dim),
                    Want::Int(a.head_dim),
                    head_dim_default,
                ),
                field(
                    "intermediate_size",
                    format!("ffn = {}", a.ffn),
                    Want::Int(a.ffn),
                    json!(11008),
                ),
                field(
                    "vocab_size",
                    format!("vocab = {}", a.vocab),
                    Want::AtMost(a.vocab),
                    json!(32000),
                ),
                field(
                    "rms_norm_eps",
                    format!("RMSNorm eps = {}", a.eps),
                    Want::Float(a.eps),
                    default_eps,
                ),
                field(
                    "rope_theta",
                    format!("RoPE theta = {}", a.theta),
                    Want::Float(a.theta),
                    json!(10000.0),
                ),
                field(
                    "hidden_act",
                    "act = swiglu",
                    Want::Str("silu"),
                    json!("silu"),
                ),
                field(
                    "tie_word_embeddings",
                    format!(
                        "head {}",
                        if a.tied { "tied = Embedding" } else { "untied" }
                    ),
                    Want::Bool(a.tied),
                    json!(false),
                ),
            ];
            if matches!(a.family, Family::Llama | Family::Qwen3) {
                f.push(field(
                    "attention_bias",
                    format!("attention bias = {}", a.qkv_bias),
                    Want::Bool(a.qkv_bias),
                    json!(false),
                ));
            }
            if a.family == Family::Llama {
                f.push(field(
                    "mlp_bias",
                    "MLP without biases",
                    Want::Bool(false),
                    json!(false),
                ));
            } else {
                f.push(field(
                    "use_sliding_window",
                    "full attention",
                    Want::Bool(false),
                    json!(false),
                ));
            }
            f
        }
    }
}

/// Fields whose null transformers resolves as it resolves a missing one (from other fields):
/// `num_key_value_heads` (the heads), `head_dim` (d / heads), GPT-2's `n_inner` (4 × d).
/// Any other null reaches the model as `None`, not as the field's default.
const NULL_RESOLVED: [&str; 3] = ["num_key_value_heads", "head_dim", "n_inner"];

/// A field's value in `config`: the file's, else transformers' default; the defaults that
/// follow other fields (`num_key_value_heads`, `head_dim`, `n_inner`) resolved, also from a
/// null; RoPE's base read from `rope_parameters` where newer files keep it. Another field's
/// null is the file's value, null.
fn value_of(config: &Map<String, Value>, f: &Field) -> Value {
    let get = |key: &str| config.get(key).filter(|v| !v.is_null());
    if f.key == "rope_theta" {
        if let Some(theta) = config
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
        {
            return theta.clone();
        }
    }
    if let Some(v) = config.get(f.key) {
        if !v.is_null() || !NULL_RESOLVED.contains(&f.key) {
            return v.clone();
        }
    }
    let int = |key: &str| get(key).and_then(Value::as_u64);
    match f.key {
        "num_key_value_heads" => int("num_attention_heads").map_or(json!(32), Value::from),
        "head_dim" if !f.default.is_null() => f.default.clone(),
        "head_dim" => match (int("hidden_size"), int("num_attention_heads")) {
            (Some(d), Some(h)) if h > 0 => json!(d / h),
            _ => json!(128),
        },
        "n_inner" => json!(4 * int("n_embd").unwrap_or(768)),
        _ => f.default.clone(),
    }
}

/// Whether `got` is what `want` asks.
fn agrees(got: &Value, want: &Want) -> bool {
    match want {
        Want::Int(n) => got.as_u64() == Some(*n),
        Want::AtMost(n) => got.as_u64().is_some_and(|g| g >= 1 && g <= *n),
        Want::AtLeast(n) => got.as_u64().is_some_and(|g| g >= *n),
        // Files written through float32 keep 7 digits (9.999999747378752e-06 for 1e-5).
        Want::Float(x) => got
            .as_f64()
            .is_some_and(|g| (g - x).abs() <= 1e-6 * x.abs().max(f64::MIN_POSITIVE)),
        Want::Bool(b) => got.as_bool() == Some(*b),
        Want::Str(s) => got.as_str() == Some(*s),
    }
}

/// What a field must hold when `got` is not of its kind at all (null, `4.0` for a count, a
/// string for a number): said instead of a comparison of the two values.
fn kind_expected(got: &Value, want: &Want) -> Option<String> {
    let integer = got.as_u64().is_some() || got.as_i64().is_some();
    let expected = match want {
        Want::Int(n) if !integer => format!("a whole number is expected (write {n})"),
        Want::AtMost(n) if !integer => format!("a whole number from 1 to {n} is expected"),
        Want::AtLeast(n) if !integer => format!("a whole number of at least {n} is expected"),
        Want::Float(x) if got.as_f64().is_none() => format!("a number is expected (write {x})"),
        Want::Bool(b) if !got.is_boolean() => format!("true or false is expected (write {b})"),
        Want::Str(s) if !got.is_string() => format!("a string is expected (write \"{s}\")"),
        _ => return None,
    };
    Some(if got.is_null() {
        format!("{expected}; transformers reads null as no value, not as the field's default")
    } else {
        expected
    })
}

/// Model types whose checkpoints are another family's tensors and computation:
/// `MistralForCausalLM` is Llama without attention biases, plus a sliding window
/// ([`sliding_window_mismatch`]).
const SAME_AS: [(&str, Family); 1] = [("mistral", Family::Llama)];

/// The model types parc reads, for messages.
const KNOWN: &str = "gpt2, llama, qwen2, qwen3 and mistral";

/// Whether `model_type` is read as `family`.
fn reads_as(model_type: &str, family: Family) -> bool {
    model_type == family.model_type() || SAME_AS.contains(&(model_type, family))
}

/// The model types of parc's families, and what `config` says it is.
fn family_mismatch(config: &Map<String, Value>, arch: &Arch) -> Option<String> {
    let model_type = config.get("model_type").and_then(Value::as_str);
    if model_type.is_some_and(|t| reads_as(t, arch.family)) {
        return None;
    }
    let spec = match arch.family {
        Family::Gpt2 => "a GPT-2 model (GPT2LMHeadModel)",
        Family::Llama => "a Llama model (LlamaForCausalLM: RMSNorm, RoPE, SwiGLU)",
        Family::Qwen2 => "a Qwen2 model (Qwen2ForCausalLM: Llama with q/k/v biases only)",
        Family::Qwen3 => "a Qwen3 model (Qwen3ForCausalLM: Llama with per-head q/k norms)",
    };
    let got = model_type.map_or("missing".to_string(), |t| format!("{t:?}"));
    let known = [Family::Gpt2, Family::Llama, Family::Qwen2, Family::Qwen3];
    let supported = model_type.is_some_and(|t| known.iter().any(|f| reads_as(t, *f)));
    let hint = if supported {
        String::new()
    } else {
        format!(" (parc reads the model types {KNOWN}; {got} is not one of them)")
    };
    Some(format!(
        "config.json model_type = {got}, the spec is {spec}{hint}"
    ))
}

/// Mistral's sliding window: attention to the last `sliding_window` tokens only. It changes
/// nothing while the spec's `seq` fits in the window; a smaller window is refused.
fn sliding_window_mismatch(config: &Map<String, Value>, arch: &Arch) -> Option<String> {
    if config.get("model_type").and_then(Value::as_str) != Some("mistral") {
        return None;
    }
    let window = config.get("sliding_window").filter(|v| !v.is_null())?;
    match window.as_u64() {
        Some(w) if w >= arch.seq => None,
        _ => Some(format!(
            "config.json sliding_window = {window}, spec seq = {}: parc's attention is full \
             causal, which is Mistral's only while seq fits in the window (set seq to at most \
             the window)",
            arch.seq
        )),
    }
}

/// Read `dir/config.json` and check it against `arch`: the family and every field parc's
/// weights and computation depend on. Returns transformers' vocabulary and positions.
pub fn check_config(dir: &Path, arch: &Arch) -> Result<HfSizes> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        RuntimeError::Hf(format!(
            "cannot read {} ({e}); `train.init = hf(\"DIR\")` takes a Hugging Face model \
             folder with config.json and model.safetensors (as `save_pretrained` or \
             `parc export --format hf` write it)",
            path.display()
        ))
    })?;
    let config: Map<String, Value> = serde_json::from_str(&text)
        .map_err(|e| RuntimeError::Hf(format!("{} is not a JSON object: {e}", path.display())))?;
    // Another family's fields would all read as mismatches: the family alone says it.
    if let Some(family) = family_mismatch(&config, arch) {
        return Err(disagrees(&path, &[family]));
    }
    let mut problems = Vec::new();
    if arch.family != Family::Gpt2 {
        problems.extend(rope::mismatches(&config, arch.rope_scaling));
        problems.extend(sliding_window_mismatch(&config, arch));
    }
    let mut sizes = HfSizes {
        vocab: arch.vocab,
        positions: arch.seq,
    };
    for f in fields(arch) {
        let got = value_of(&config, &f);
        if let Some(expected) = kind_expected(&got, &f.want) {
            problems.push(format!(
                "config.json {} = {got}, spec {}: {expected}",
                f.key, f.spec
            ));
        } else if !agrees(&got, &f.want) {
            let rule = match f.want {
                Want::AtMost(_) => " (transformers' vocabulary must fit the spec's)",
                Want::AtLeast(_) => " (transformers' positions must cover the spec's seq)",
                _ => "",
            };
            problems.push(format!(
                "config.json {} = {got}, spec {}{rule}",
                f.key, f.spec
            ));
        } else if f.key == "vocab_size" {
            sizes.vocab = got.as_u64().unwrap_or(arch.vocab);
        } else if f.key == "n_positions" {
            sizes.positions = got.as_u64().unwrap_or(arch.seq);
        }
    }
    if problems.is_empty() {
        Ok(sizes)
    } else {
        Err(disagrees(&path, &problems))
    }
}

fn disagrees(path: &Path, problems: &[String]) -> RuntimeError {
    RuntimeError::Hf(format!(
        "{} disagrees with the spec:\n  {}\nchange the spec (or `--set`) to match the \
         checkpoint, or start from another one",
        path.display(),
        problems.join("\n  ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use parc_compiler::spec::RopeScaling;

    fn llama() -> Arch {
        Arch {
            family: Family::Llama,
            vocab: 512,
            dim: 64,
            seq: 32,
            heads: 8,
            kv_heads: 8,
            head_dim: 8,
            ffn: 128,
            eps: 1e-5,
            activation: "gelu_new",
            theta: 500000.0,
            rope_scaling: RopeScaling::None,
            qkv_bias: false,
            out_bias: false,
            tied: false,
            embed: "embed".into(),
            pos: None,
            blocks: Vec::new(),
            ln_f: "ln_f".into(),
            head: "head".into(),
        }
    }

    /// Check `config` (written to a folder of its own, `name`) against [`llama`].
    fn check(name: &str, config: Value) -> Result<HfSizes> {
        check_against(name, config, &llama())
    }

    fn check_against(name: &str, config: Value, arch: &Arch) -> Result<HfSizes> {
        let pid = std::process::id();
        let dir = std::env::temp_dir().join(format!("parc-hf-config-{pid}-{name}"));
        std::fs::create_dir_all(&dir).map_err(|e| RuntimeError::Hf(e.to_string()))?;
        std::fs::write(dir.join("config.json"), config.to_string())
            .map_err(|e| RuntimeError::Hf(e.to_string()))?;
        check_config(&dir, arch)
    }

    /// Llama 3.2 1B as a spec describes it: 16 blocks, d 2048, 32 heads of 64 over 8 kv heads,
    /// SwiGLU 8192, theta 500000, a tied head, with RoPE scaled by `scaling`.
    fn llama3_2_1b(scaling: RopeScaling) -> Arch {
        let block = |i: usize| crate::hf::family::BlockNodes {
            ln1: format!("blocks.{i}.ln1"),
            attn: format!("blocks.{i}.attn"),
            ln2: format!("blocks.{i}.ln2"),
            mlp: format!("blocks.{i}.mlp"),
        };
        Arch {
            vocab: 128256,
            dim: 2048,
            seq: 8192,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            rope_scaling: scaling,
            tied: true,
            blocks: (0..16).map(block).collect(),
            ..llama()
        }
    }

    /// The published config.json of Llama 3.2 1B (tests/configs/hf/Llama-3.2-1B: rope_scaling
    /// llama3, factor 32) against a spec with its scaling (it checks) and one without (the
    /// scaling named, with what to write on the spec).
    #[test]
    fn llama3_2_1b_published_config_checks_with_its_scaling() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/configs/hf/Llama-3.2-1B/config.json"
        );
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let config: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
        let published = RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        };
        let scaled = llama3_2_1b(published);
        let sizes = check_against("llama3.2", config.clone(), &scaled);
        assert_eq!(
            sizes.map(|s| s.vocab).map_err(|e| e.to_string()),
            Ok(128256)
        );
        let plain = llama3_2_1b(RopeScaling::None);
        let err = check_against("llama3.2-plain", config, &plain)
            .map(|_| ())
            .unwrap_err();
        let err = err.to_string();
        for expected in [
            "config.json rope_scaling scales RoPE by `llama3 { factor: 32, low_freq_factor: 1, \
             high_freq_factor: 4, original_max_position: 8192 }`, the spec by `none`",
            "write the file's as the spec RoPE's `scaling`",
        ] {
            assert!(err.contains(expected), "{expected:?} not in {err}");
        }
        // The export of the scaled spec writes the same scaling, which checks again.
        let written = config_json(
            &scaled,
            HfSizes {
                vocab: 128256,
                positions: 8192,
            },
            "bfloat16",
        );
        for key in ["rope_scaling", "rope_parameters"] {
            assert_eq!(written[key]["rope_type"], json!("llama3"), "{key}");
            assert_eq!(written[key]["factor"], json!(32.0), "{key}");
            assert_eq!(
                written[key]["original_max_position_embeddings"],
                json!(8192),
                "{key}"
            );
        }
        assert!(check_against("llama3.2-written", written, &scaled).is_ok());
    }

    /// A YaRN-scaled file (Qwen2.5's long-context variants) is refused naming its rope_type.
    #[test]
    fn a_rope_type_parc_lacks_is_named() {
        let mut config = older_file();
        config["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 32768});
        let err = check("yarn", config).map(|_| ()).unwrap_err().to_string();
        assert!(
            err.contains("rope_scaling has rope_type \"yarn\", which parc's RoPE does not have"),
            "{err}"
        );
    }

    /// A file as older transformers wrote it: no head_dim, no num_key_value_heads, RoPE's
    /// base at the top level, eps through float32, fewer (real) tokens than the padded spec.
    fn older_file() -> Value {
        json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 0, "num_attention_heads": 8, "vocab_size": 500,
            "rms_norm_eps": 9.999999747378752e-06, "rope_theta": 500000.0,
            "max_position_embeddings": 8192, "rope_scaling": null
        })
    }

    #[test]
    fn missing_fields_take_transformers_defaults_and_the_vocab_may_be_smaller() {
        let sizes = check("defaults", older_file()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(sizes.vocab, 500);
    }

    #[test]
    fn scaled_rope_and_other_fields_are_all_named() {
        let mut config = older_file();
        config["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        config["num_key_value_heads"] = json!(2);
        config["tie_word_embeddings"] = json!(true);
        let err = check("named", config).map(|_| ()).unwrap_err().to_string();
        for expected in [
            "rope_scaling scales RoPE by `llama3 { factor: 8,",
            "num_key_value_heads = 2, spec kv_heads = 8",
            "tie_word_embeddings = true, spec head untied",
        ] {
            assert!(err.contains(expected), "{expected:?} not in {err}");
        }
    }

    #[test]
    fn the_written_config_checks_against_its_own_arch() {
        let arch = llama();
        let sizes = HfSizes {
            vocab: 300,
            positions: 32,
        };
        let mut written = config_json(&arch, sizes, "float32");
        written["num_hidden_layers"] = json!(0);
        assert_eq!(
            check("written", written).map_err(|e| e.to_string()),
            Ok(sizes)
        );
    }

    /// Qwen3's config.json reads back as written, and one without `head_dim` means
    /// transformers' Qwen3 default, 128, not hidden_size / heads as for Llama.
    #[test]
    fn qwen3_config_reads_back_and_head_dim_defaults_to_128() {
        let arch = Arch {
            family: Family::Qwen3,
            head_dim: 128,
            ..llama()
        };
        let sizes = HfSizes {
            vocab: 512,
            positions: 32,
        };
        let mut written = config_json(&arch, sizes, "float32");
        written["num_hidden_layers"] = json!(0);
        assert_eq!(written["model_type"], "qwen3");
        assert_eq!(written["attention_bias"], false);
        let read = check_against("qwen3", written.clone(), &arch).map_err(|e| e.to_string());
        assert_eq!(read, Ok(sizes));
        if let Some(c) = written.as_object_mut() {
            c.remove("head_dim");
        }
        let read = check_against("qwen3-default", written.clone(), &arch);
        assert_eq!(read.map_err(|e| e.to_string()), Ok(sizes));
        let narrow = Arch {
            head_dim: 8,
            ..arch
        };
        let err = check_against("qwen3-narrow", written, &narrow)
            .map(|_| ())
            .unwrap_err();
        let err = err.to_string();
        assert!(err.contains("head_dim = 128, spec head_dim = 8"), "{err}");
    }
}
