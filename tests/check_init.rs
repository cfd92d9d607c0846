//! `parc check` on `train.init = hf("DIR")` makes the checks `parc run` makes before any rank
//! starts (src/init_check.rs): a model with no Hugging Face family is E1002, a config.json that
//! disagrees is E1003 (Llama 3.2's published `rope_scaling` of type llama3, which parc's RoPE
//! does not have, or another size), a folder that is not here W1003; a config.json that fits
//! passes.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli;

use std::path::Path;

/// The codes of `parc check SPEC --set train.init=hf("DIR")`, and its exit code.
fn codes(spec: &str, dir: &Path) -> (Vec<String>, Option<i32>) {
    let init = format!("train.init=hf(\"{}\")", dir.display());
    let out = cli::parc(&[
        "check", spec, "--format", "json", "--lower", "never", "--set", &init,
    ]);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let codes = doc["files"][0]["diagnostics"].as_array().unwrap().iter();
    let codes = codes
        .map(|d| d["code"].as_str().unwrap().to_string())
        .collect();
    (codes, out.status.code())
}

/// A folder holding tiny-llama's config.json as transformers writes it, with `changes`.
fn config_dir(name: &str, changes: serde_json::Value) -> std::path::PathBuf {
    let dir = cli::temp_dir("check_init", name);
    let mut config = serde_json::json!({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 256,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "hidden_act": "silu", "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": false, "attention_bias": false,
        "mlp_bias": false
    });
    for (k, v) in changes.as_object().unwrap() {
        config[k] = v.clone();
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

#[test]
fn a_fitting_config_passes_and_a_missing_folder_warns() {
    let fits = config_dir("fits", serde_json::json!({}));
    assert_eq!(codes("examples/tiny-llama.par", &fits), (vec![], Some(0)));
    let absent = fits.join("not-here");
    assert_eq!(
        codes("examples/tiny-llama.par", &absent),
        (vec!["W1003".to_string()], Some(0))
    );
}

#[test]
fn a_config_that_disagrees_is_e1003() {
    let llama3 = serde_json::json!({ "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192 } });
    for (name, changes) in [
        ("rope-scaling", llama3),
        ("kv-heads", serde_json::json!({ "num_key_value_heads": 2 })),
    ] {
        let dir = config_dir(name, changes);
        let got = codes("examples/tiny-llama.par", &dir);
        assert_eq!(got, (vec!["E1003".to_string()], Some(1)), "{name}");
    }
}

#[test]
fn a_model_without_a_hugging_face_family_is_e1002() {
    // tiny-functions.par applies a .par function to the residual stream.
    let dir = config_dir("functions", serde_json::json!({}));
    assert_eq!(
        codes("examples/tiny-functions.par", &dir),
        (vec!["E1002".to_string()], Some(1))
    );
}
