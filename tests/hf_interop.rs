//! Hugging Face weights in and out (`runtime::hf`), on the CPU: a trained tiny model exported
//! to transformers' layout, loaded back with `train.init = hf("DIR")` under one rank and under
//! parallel plans (tp 2 with SP, pp 2 with dp 2 and ZeRO 3), and exported again gives the same
//! tensors bit for bit, for GPT-2, Llama (GQA, untied head), Qwen2 (q/k/v biases) and Qwen3
//! (per-head q/k norms, heads wider than d / heads). A
//! vocabulary cut back on export is padded with zero rows on import; sharded checkpoints and the
//! original GPT-2 layout (no `transformer.` prefix, mask buffers, more positions) load. Bad input — no
//! config.json, a config.json that disagrees with the spec (every field named), a missing
//! tensor, a misshapen one — is a clear error naming it. (transformers itself reads the exports
//! in bench/hf_parity.sh.)
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli;

use parc_compiler::driver::{self, CompileOptions, Stage};
use parc_compiler::ir::Plan;
use parc_compiler::spec::{LayerKind, Spec};
use parc_runtime::exec::{global_tensors, GlobalParam, TrainOptions};
use parc_runtime::hf::{self, ExportOptions, HfDtype};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Two layers and a batch of 4 keep every run here well under a second.
const SMALL: [&str; 3] = ["model.layers=2", "train.global_batch=4", "train.steps=2"];

/// `examples/NAME.par`'s text.
fn example(name: &str) -> String {
    std::fs::read_to_string(cli::root().join(format!("examples/{name}.par"))).unwrap()
}

/// `examples/NAME.par` with `SMALL` and `sets`, checked and lowered.
fn compile(name: &str, sets: &[&str]) -> (Spec, Plan) {
    compile_text(name, example(name), sets)
}

/// `text` (spec `name`) with `SMALL` and `sets`, checked and lowered.
fn compile_text(name: &str, text: String, sets: &[&str]) -> (Spec, Plan) {
    let overrides: Vec<_> = SMALL
        .iter()
        .chain(sets)
        .map(|s| parc_compiler::parse_override(s).unwrap())
        .collect();
    let options = CompileOptions::through(Stage::Lower);
    let compiled = driver::compile(name, text, &overrides, &options);
    let errors: Vec<_> = compiled
        .diagnostics
        .items
        .iter()
        .map(|d| &d.message)
        .collect();
    (
        compiled
            .spec
            .unwrap_or_else(|| panic!("{name}: {errors:?}")),
        compiled
            .plan
            .unwrap_or_else(|| panic!("{name}: {errors:?}")),
    )
}

/// Train `spec` for `steps` steps (0: only initialise) and return its parameters.
fn train(spec: &Spec, plan: &Plan, steps: u64) -> parc_runtime::error::Result<Vec<GlobalParam>> {
    let mut options = TrainOptions::new(cli::root().join("examples"));
    options.comm_timeout = Duration::from_secs(30);
    options.threads_per_rank = Some(1);
    options.stop_after = Some(steps);
    let backend = |_, threads| parc_runtime::cpu::CpuBackend::with_threads(threads);
    parc_runtime::exec::train(spec, plan, &options, backend, &|_| {}).map(|r| r.params)
}

fn export(spec: &Spec, params: Vec<GlobalParam>, out: &Path, vocab: Option<u64>) {
    let options = ExportOptions {
        vocab,
        dtype: HfDtype::F32,
    };
    hf::export(spec, &global_tensors(params), out, options).unwrap_or_else(|e| panic!("{e}"));
}

/// Every tensor of `dir/model.safetensors`: name, dtype, shape and bytes.
fn read_tensors(dir: &Path) -> Vec<(String, String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = file
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let dtype = format!("{:?}", t.dtype());
            (name, dtype, t.shape().to_vec(), t.data().to_vec())
        })
        .collect();
    out.sort();
    out
}

/// `train.init = hf("DIR")`.
fn init_from(dir: &Path) -> String {
    format!("train.init=hf(\"{}\")", dir.display())
}

/// Train `name` two steps, export it, load the export under each of `plans` and export again:
/// the same tensors, bit for bit, and the same parameters as trained.
fn assert_round_trip(name: &str, plans: &[&[&str]]) {
    let dir = cli::temp_dir("hf", name);
    let (spec, plan) = compile(name, &[]);
    let trained = train(&spec, &plan, 2).unwrap();
    let first = dir.join("first");
    export(&spec, trained.clone(), &first, None);
    let exported = read_tensors(&first);
    assert!(exported.len() > 10, "{name}: {} tensors", exported.len());
    for (i, sets) in plans.iter().enumerate() {
        let mut all = sets.to_vec();
        let init = init_from(&first);
        all.push(&init);
        let (spec, plan) = compile(name, &all);
        let loaded = train(&spec, &plan, 0).unwrap_or_else(|e| panic!("{name} {sets:?}: {e}"));
        for (a, b) in trained.iter().zip(&loaded) {
            let bits = |p: &GlobalParam| p.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(a.name, b.name);
            assert!(bits(a) == bits(b), "{name} {sets:?}: {} changed", a.name);
        }
        let again = dir.join(format!("again-{i}"));
        export(&spec, loaded, &again, None);
        assert!(
            read_tensors(&again) == exported,
            "{name} {sets:?}: the export changed"
        );
        let config = |d: &Path| std::fs::read_to_string(d.join("config.json")).unwrap();
        assert_eq!(config(&first), config(&again), "{name} {sets:?}");
    }
}

#[test]
fn gpt2_round_trip_is_bit_identical_on_one_rank_and_under_tp() {
    assert_round_trip(
        "tiny",
        &[
            &[],
            &[
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "cluster.gpus_per_node=2",
            ],
        ],
    );
}

#[test]
fn llama_round_trip_is_bit_identical_on_one_rank_and_under_pp_with_zero3() {
    assert_round_trip(
        "tiny-llama",
        &[
            &[],
            &[
                "parallel.pp=2",
                "parallel.dp=2",
                "parallel.zero=3",
                "train.micro_batch=1",
                "cluster.gpus_per_node=4",
            ],
        ],
    );
}

/// The tiny Llama at theta 500000, with `scaling` on its RoPE.
fn llama_scaled(scaling: &str) -> String {
    let theta = format!("theta = 500000, scaling = {scaling})");
    example("tiny-llama").replace("theta = 10000)", &theta)
}

/// Llama 3.2's published RoPE scaling goes out in config.json as transformers 4.x
/// (`rope_scaling`) and 5.x (`rope_parameters`) read it, loads back bit for bit under tp 2 with
/// SP and exports the same file again; a spec without the scaling refuses the folder naming
/// both keys' scaling.
#[test]
fn a_scaled_llama_round_trips_and_its_scaling_is_checked() {
    let llama3_2 = "llama3 { factor: 32, low_freq_factor: 1, high_freq_factor: 4, \
                    original_max_position: 8192 }";
    let dir = cli::temp_dir("hf", "scaled");
    let (spec, plan) = compile_text("scaled", llama_scaled(llama3_2), &[]);
    let trained = train(&spec, &plan, 2).unwrap();
    export(&spec, trained.clone(), &dir, None);
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&text).unwrap();
    for key in ["rope_scaling", "rope_parameters"] {
        let r = &config[key];
        assert_eq!(r["rope_type"], "llama3", "{key}: {text}");
        assert_eq!(r["factor"], 32.0, "{key}");
        assert_eq!(r["low_freq_factor"], 1.0, "{key}");
        assert_eq!(r["high_freq_factor"], 4.0, "{key}");
        assert_eq!(r["original_max_position_embeddings"], 8192, "{key}");
    }
    assert_eq!(config["rope_parameters"]["rope_theta"], 500000.0);
    let tp = [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "cluster.gpus_per_node=2",
    ];
    let init = init_from(&dir);
    let sets: Vec<&str> = tp.iter().copied().chain([init.as_str()]).collect();
    let (spec, plan) = compile_text("scaled", llama_scaled(llama3_2), &sets);
    let loaded = train(&spec, &plan, 0).unwrap_or_else(|e| panic!("{e}"));
    for (a, b) in trained.iter().zip(&loaded) {
        let bits = |p: &GlobalParam| p.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(a) == bits(b), "{} changed", a.name);
    }
    let again = dir.join("again");
    export(&spec, loaded, &again, None);
    let text_again = std::fs::read_to_string(again.join("config.json")).unwrap();
    assert_eq!(text, text_again);
    let (spec, plan) = compile_text("plain", llama_scaled("none"), &[&init]);
    let err = load_error(&spec, &plan);
    for key in ["rope_scaling", "rope_parameters"] {
        let named = format!("config.json {key} scales RoPE by `llama3 {{ factor: 32,");
        assert!(err.contains(&named), "{named} not in {err}");
    }
}

#[test]
fn qwen2_round_trip_is_bit_identical_under_tp() {
    assert_round_trip(
        "tiny-qwen",
        &[&["parallel.tp=2", "cluster.gpus_per_node=2"]],
    );
}

/// Qwen3: the per-head q/k norm weights are `self_attn.{q,k}_norm.weight`, replicated over tp
/// (their gradients all-reduced) and sharded by ZeRO-3; config.json says `qwen3` with head_dim.
#[test]
fn qwen3_round_trip_is_bit_identical_under_tp_and_under_pp_with_zero3() {
    assert_round_trip(
        "tiny-qwen3",
        &[
            &[
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "cluster.gpus_per_node=2",
            ],
            &[
                "parallel.pp=2",
                "parallel.dp=2",
                "parallel.zero=3",
                "train.micro_batch=1",
                "cluster.gpus_per_node=4",
            ],
        ],
    );
    let dir = cli::temp_dir("hf", "qwen3-names");
    let (spec, plan) = compile("tiny-qwen3", &[]);
    export(&spec, train(&spec, &plan, 1).unwrap(), &dir, None);
    let tensors = read_tensors(&dir);
    let shape_of = |name: &str| {
        let t = tensors.iter().find(|t| t.0 == name);
        t.map(|t| t.2.clone())
            .unwrap_or_else(|| panic!("no {name}"))
    };
    for norm in ["q_norm", "k_norm"] {
        let name = format!("model.layers.1.self_attn.{norm}.weight");
        assert_eq!(shape_of(&name), vec![32]);
    }
    assert_eq!(
        shape_of("model.layers.0.self_attn.q_proj.weight"),
        vec![128, 64]
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "qwen3");
    assert_eq!(config["architectures"][0], "Qwen3ForCausalLM");
    assert_eq!(config["head_dim"], 32);
    assert_eq!(config["attention_bias"], false);
}

/// A checkpoint of another family (a Llama one: no q/k norms) does not load into a qk_norm
/// spec: config.json's model_type is named against the spec's family.
#[test]
fn a_llama_checkpoint_does_not_load_into_a_qwen3_spec() {
    let dir = cli::temp_dir("hf", "qwen3-cross");
    let (spec, plan) = compile("tiny-qwen3", &[]);
    export(&spec, train(&spec, &plan, 0).unwrap(), &dir, None);
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["model_type"] = "llama".into();
    std::fs::write(&path, config.to_string()).unwrap();
    let (spec, plan) = compile("tiny-qwen3", &[&init_from(&dir)]);
    let err = load_error(&spec, &plan);
    assert!(
        err.contains("model_type = \"llama\", the spec is a Qwen3 model"),
        "{err}"
    );
}

#[test]
fn an_exported_vocabulary_cut_back_is_padded_with_zero_rows() {
    let dir = cli::temp_dir("hf", "vocab");
    let (spec, plan) = compile("tiny-llama", &[]);
    let trained = train(&spec, &plan, 0).unwrap();
    export(&spec, trained.clone(), &dir, Some(200));
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    assert!(config.contains("\"vocab_size\": 200"), "{config}");
    let (spec, plan) = compile("tiny-llama", &[&init_from(&dir)]);
    let loaded = train(&spec, &plan, 0).unwrap();
    for name in ["embed.weight", "head.weight"] {
        let find = |ps: &[GlobalParam]| ps.iter().find(|p| p.name == name).unwrap().data.clone();
        let (before, after) = (find(&trained), find(&loaded));
        let kept = 200 * 64;
        assert_eq!(before[..kept], after[..kept], "{name}");
        assert!(after[kept..].iter().all(|&x| x == 0.0), "{name}");
    }
    // A checkpoint's vocabulary larger than the spec's does not fit.
    let sets = ["model.vocab=128", "train.data=synthetic", &init_from(&dir)];
    let (spec, plan) = compile("tiny-llama", &sets);
    let err = train(&spec, &plan, 0).unwrap_err().to_string();
    assert!(err.contains("vocab_size = 200, spec vocab = 128"), "{err}");
}

/// A GPT-2 export to break, and the spec that loads it.
fn broken_export(name: &str) -> (PathBuf, Spec, Plan) {
    let dir = cli::temp_dir("hf", name);
    let (spec, plan) = compile("tiny", &[]);
    export(&spec, train(&spec, &plan, 0).unwrap(), &dir, None);
    let (spec, plan) = compile("tiny", &[&init_from(&dir)]);
    (dir, spec, plan)
}

/// Rewrite `dir/model.safetensors` through `edit` (on name → (shape, f32 values)).
fn rewrite(dir: &Path, edit: impl Fn(&mut Vec<(String, Vec<usize>, Vec<u8>)>)) {
    let mut tensors: Vec<_> = read_tensors(dir)
        .into_iter()
        .map(|(name, _, shape, data)| (name, shape, data))
        .collect();
    edit(&mut tensors);
    let views: Vec<_> = tensors
        .iter()
        .map(|(name, shape, data)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data);
            (name.clone(), view.unwrap())
        })
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

/// As the original GPT-2 checkpoint stores it — names without `transformer.`, the causal-mask
/// buffers, more positions than the spec's seq — it loads too: the first seq positions.
#[test]
fn the_original_gpt2_layout_loads() {
    let dir = cli::temp_dir("hf", "original");
    let (spec, plan) = compile("tiny", &[]);
    let initial = train(&spec, &plan, 0).unwrap();
    export(&spec, initial.clone(), &dir, None);
    rewrite(&dir, |tensors| {
        for (name, shape, data) in tensors.iter_mut() {
            *name = name.trim_start_matches("transformer.").to_string();
            if name == "wpe.weight" {
                shape[0] = 100;
                data.resize(100 * 64 * 4, 0x3f);
            }
        }
        tensors.push((
            "h.0.attn.bias".into(),
            vec![1, 1, 64, 64],
            vec![0; 64 * 64 * 4],
        ));
    });
    let path = dir.join("config.json");
    let config = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        config.replace("\"n_positions\": 64", "\"n_positions\": 100"),
    )
    .unwrap();
    let (spec, plan) = compile("tiny", &[&init_from(&dir)]);
    let loaded = train(&spec, &plan, 0).unwrap_or_else(|e| panic!("{e}"));
    assert!(initial == loaded);
}

/// A checkpoint sharded over several files (`model.safetensors.index.json`) loads as one.
#[test]
fn a_sharded_checkpoint_loads() {
    let dir = cli::temp_dir("hf", "sharded");
    let (spec, plan) = compile("tiny-llama", &[]);
    let initial = train(&spec, &plan, 0).unwrap();
    export(&spec, initial.clone(), &dir, None);
    write_shards(&dir);
    let (spec, plan) = compile("tiny-llama", &[&init_from(&dir)]);
    let loaded = train(&spec, &plan, 0).unwrap_or_else(|e| panic!("{e}"));
    assert!(initial == loaded);
}

/// A tensor stored in two shards is refused naming it and both files: transformers keeps
/// whichever copy it reads last whatever the index says, so parc used to pick one silently.
#[test]
fn a_tensor_in_two_shards_is_refused_naming_both_files() {
    let dir = cli::temp_dir("hf", "sharded-twice");
    let (spec, plan) = compile("tiny-llama", &[]);
    export(&spec, train(&spec, &plan, 0).unwrap(), &dir, None);
    write_shards(&dir);
    let (first, second) = (
        dir.join("model-00001-of-00002.safetensors"),
        dir.join("model-00002-of-00002.safetensors"),
    );
    let read = |path: &Path| std::fs::read(path).unwrap();
    let (bytes1, bytes2) = (read(&first), read(&second));
    let (one, two) = (
        SafeTensors::deserialize(&bytes1).unwrap(),
        SafeTensors::deserialize(&bytes2).unwrap(),
    );
    let mut views = two.tensors();
    let twice = "model.embed_tokens.weight";
    views.push((twice.to_string(), one.tensor(twice).unwrap()));
    std::fs::write(&second, safetensors::serialize(views, None).unwrap()).unwrap();
    let (spec, plan) = compile("tiny-llama", &[&init_from(&dir)]);
    let Err(err) = train(&spec, &plan, 0) else {
        panic!("a tensor stored twice loaded");
    };
    let err = err.to_string();
    assert!(
        err.contains(&format!("tensor {twice} is stored twice"))
            && err.contains(&first.display().to_string())
            && err.contains(&second.display().to_string())
            && err.contains("weight_map names model-00001-of-00002.safetensors"),
        "{err}"
    );
}

/// Replace `dir/model.safetensors` by two shards and their `model.safetensors.index.json`.
fn write_shards(dir: &Path) {
    let tensors = read_tensors(dir);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let mut weight_map = serde_json::Map::new();
    for (part, half) in tensors.chunks(tensors.len() / 2 + 1).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", part + 1);
        let views: Vec<_> = half
            .iter()
            .map(|(name, _, shape, data)| {
                weight_map.insert(name.clone(), file.clone().into());
                let view = safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    shape.clone(),
                    data,
                );
                (name.clone(), view.unwrap())
            })
            .collect();
        std::fs::write(
            dir.join(&file),
            safetensors::serialize(views, None).unwrap(),
        )
        .unwrap();
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

/// A folder holding a sharded checkpoint and a `model.safetensors` is read as transformers
/// reads it, from the single file (the shards were read before: another model than
/// transformers'). An export that would leave such a folder, or overwrite parc's own model file
/// (`parc export CKPT --format hf CKPT`), is refused naming the file, and writes nothing.
#[test]
fn an_export_replaces_no_model_and_stale_shards_are_not_read() {
    let dir = cli::temp_dir("hf", "stale-shards");
    let (spec, plan) = compile("tiny-llama", &[]);
    let initial = train(&spec, &plan, 0).unwrap();
    let trained = train(&spec, &plan, 2).unwrap();
    assert!(initial != trained);
    let stale = dir.join("stale");
    export(&spec, initial, &stale, None);
    write_shards(&stale);
    let options = ExportOptions {
        vocab: None,
        dtype: HfDtype::F32,
    };
    let err = hf::export(&spec, &global_tensors(trained.clone()), &stale, options)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("holds model.safetensors.index.json") && err.contains("new or empty folder"),
        "{err}"
    );
    assert!(!stale.join("model.safetensors").exists());
    // The same folder with a model.safetensors beside the shards: that file is the model.
    let fresh = dir.join("fresh");
    export(&spec, trained.clone(), &fresh, None);
    std::fs::copy(
        fresh.join("model.safetensors"),
        stale.join("model.safetensors"),
    )
    .unwrap();
    let (spec_hf, plan_hf) = compile("tiny-llama", &[&init_from(&stale)]);
    let loaded = train(&spec_hf, &plan_hf, 0).unwrap_or_else(|e| panic!("{e}"));
    assert!(loaded == trained, "the stale shards were read");

    // parc's model file (its metadata records the run's spec) is never replaced.
    let ckpt = dir.join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let model = ckpt.join("model.safetensors");
    let data = [0u8; 4];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &data);
    let metadata = std::collections::HashMap::from([("parc.spec".to_string(), "{}".to_string())]);
    safetensors::serialize_to_file([("x", view.unwrap())], Some(metadata), &model).unwrap();
    let before = std::fs::read(&model).unwrap();
    let err = hf::export(&spec, &global_tensors(trained), &ckpt, options)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("is parc's model file of a run") && err.contains("another folder"),
        "{err}"
    );
    assert_eq!(std::fs::read(&model).unwrap(), before);
    assert!(!ckpt.join("config.json").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

fn load_error(spec: &Spec, plan: &Plan) -> String {
    train(spec, plan, 0).unwrap_err().to_string()
}

#[test]
fn a_missing_config_is_named() {
    let (dir, spec, plan) = broken_export("no-config");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let err = load_error(&spec, &plan);
    assert!(
        err.contains("config.json") && err.contains("cannot read"),
        "{err}"
    );
}

#[test]
fn every_config_field_that_disagrees_is_named() {
    let (dir, spec, plan) = broken_export("config");
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["n_head"] = 8.into();
    config["n_layer"] = 3.into();
    config["activation_function"] = "relu".into();
    std::fs::write(&path, config.to_string()).unwrap();
    let err = load_error(&spec, &plan);
    for expected in [
        "config.json n_head = 8, spec heads = 4",
        "config.json n_layer = 3, spec layers = 2",
        "config.json activation_function = \"relu\", spec act = gelu_tanh",
    ] {
        assert!(err.contains(expected), "{expected:?} not in {err}");
    }
    config["model_type"] = "llama".into();
    std::fs::write(&path, config.to_string()).unwrap();
    let err = load_error(&spec, &plan);
    assert!(
        err.contains("model_type = \"llama\", the spec is a GPT-2 model"),
        "{err}"
    );
}

/// A field the file writes as null or as a float is shown as the file writes it, with what the
/// spec needs: `vocab_size: null` used to read as transformers' default (`vocab_size = 50257`,
/// which the file does not hold) and `n_layer: 2.0` as a mismatch of 2.0 with 2. A null that
/// transformers itself resolves (`n_inner`: 4 × n_embd) still reads as its default.
#[test]
fn a_null_or_float_config_field_is_shown_as_written() {
    let (dir, spec, plan) = broken_export("null-float");
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["vocab_size"] = serde_json::Value::Null;
    config["n_layer"] = 2.0.into();
    config["n_inner"] = serde_json::Value::Null;
    std::fs::write(&path, config.to_string()).unwrap();
    let err = load_error(&spec, &plan);
    for expected in [
        "config.json vocab_size = null, spec vocab = 256: a whole number from 1 to 256 is \
         expected",
        "config.json n_layer = 2.0, spec layers = 2: a whole number is expected (write 2)",
    ] {
        assert!(err.contains(expected), "{expected:?} not in {err}");
    }
    assert!(!err.contains("50257") && !err.contains("n_inner"), "{err}");
}

#[test]
fn a_missing_tensor_is_named_with_its_file() {
    let (dir, spec, plan) = broken_export("missing");
    rewrite(&dir, |t| {
        t.retain(|(name, ..)| name != "transformer.h.1.mlp.c_fc.bias")
    });
    let err = load_error(&spec, &plan);
    assert!(
        err.contains("tensor transformer.h.1.mlp.c_fc.bias is missing")
            && err.contains("model.safetensors"),
        "{err}"
    );
}

#[test]
fn a_misshapen_tensor_is_named_with_both_shapes() {
    let (dir, spec, plan) = broken_export("shape");
    rewrite(&dir, |tensors| {
        for (name, shape, _) in tensors.iter_mut() {
            if name == "transformer.h.0.attn.c_attn.weight" {
                // Stored [out, in] as a Linear, not [in, out] as GPT-2's Conv1D.
                *shape = vec![192, 64];
            }
        }
    });
    let err = load_error(&spec, &plan);
    assert!(
        err.contains("tensor transformer.h.0.attn.c_attn.weight")
            && err.contains("has shape [192, 64], the spec needs [64, 192]"),
        "{err}"
    );
}

#[test]
fn a_graph_transformers_does_not_have_is_refused_naming_the_layer() {
    let (spec, plan) = compile("tiny-functions", &[]);
    let params = train(&spec, &plan, 0).unwrap();
    let dir = cli::temp_dir("hf", "functions");
    let options = ExportOptions {
        vocab: None,
        dtype: HfDtype::F32,
    };
    let err = hf::export(&spec, &global_tensors(params), &dir, options)
        .unwrap_err()
        .to_string();
    assert!(err.contains("has no counterpart in transformers"), "{err}");
}

/// An attention whose q·k factor is not 1/√head_dim (`scale = …`) has no transformers class:
/// export refuses it naming the layer and both factors; written as the usual value it exports.
#[test]
fn an_attention_scale_transformers_lacks_is_refused_naming_it() {
    let (spec, plan) = compile("tiny-llama", &[]);
    let tensors = global_tensors(train(&spec, &plan, 0).unwrap());
    let export = |scale: f64| {
        let mut spec = spec.clone();
        for node in &mut spec.model.nodes {
            if let LayerKind::Attention { scale: own, .. } = &mut node.kind {
                *own = Some(scale);
            }
        }
        let dir = cli::temp_dir("hf", &format!("scale-{scale}"));
        let options = ExportOptions {
            vocab: None,
            dtype: HfDtype::F32,
        };
        hf::export(&spec, &tensors, &dir, options).map_err(|e| e.to_string())
    };
    let err = export(0.3).unwrap_err();
    assert!(
        err.contains("layer `blocks.0.attn`") && err.contains("scale = 0.3 is not 1/√head_dim"),
        "{err}"
    );
    // tiny-llama's heads are 8 wide: 1/√8, exactly as parc computes it.
    export(1.0 / 8f64.sqrt()).unwrap();
}

/// A partial RoPE (`fraction = 0.5`) has no Llama-family class: recognition names it.
#[test]
fn a_partial_rope_is_refused_as_one() {
    let partial = std::fs::read_to_string("stdlib/llama.par")
        .unwrap()
        .replace(
            "RoPE(theta = theta, scaling = scaling)",
            "RoPE(theta = theta, fraction = 0.5)",
        );
    let block = partial.split("block Block").nth(1).unwrap();
    let text =
        example("tiny-llama").replace("use std::llama { Block }", &format!("block Block{block}"));
    let err = refusal("partial-rope", text);
    assert!(err.contains("not a part of them"), "{err}");
}

/// Why `text` (a tiny-llama variant) has no transformers counterpart.
fn refusal(name: &str, text: String) -> String {
    let (spec, _) = compile_text(name, text, &[]);
    hf::recognise(&spec).unwrap_err().to_string()
}

/// A scaled embedding (Gemma's sqrt(d)) is refused as one, naming the layer and its function,
/// not as a norm of the wrong kind (it was: "the Llama family's norms are RMSNorms").
#[test]
fn a_scaled_embedding_is_refused_as_one() {
    let text = format!(
        "fn embed_scale(x) = x * 8\n{}",
        example("tiny-llama").replace(
            "x = Embedding(vocab, d)(tokens)",
            "x = embed_scale(Embedding(vocab, d)(tokens))"
        )
    );
    let err = refusal("scaled-embedding", text);
    assert!(err.contains("`embed_scale(x) = x * 8`"), "{err}");
    assert!(err.contains("scaled embedding"), "{err}");
    assert!(err.contains("remove the layer"), "{err}");
    assert!(!err.contains("RMSNorm"), "{err}");
}

/// A post-norm block (the norm after the residual add) is refused as one, naming the
/// attention that reads the unnormed stream and the pre-norm form to write, not as a norm of
/// the wrong kind.
#[test]
fn a_post_norm_block_is_refused_as_one() {
    let post_norm = "block Block(d, heads, kv_heads = heads, ffn = 4 * d, theta = 10000)(x) {
  h = RMSNorm(d)(x + Attention(d, heads, kv_heads = kv_heads, causal = true, bias = false,
                                rope = RoPE(theta = theta))(x))
  RMSNorm(d)(h + MLP(d, ffn, act = swiglu)(h))
}";
    let text = example("tiny-llama").replace("use std::llama { Block }", post_norm);
    let err = refusal("post-norm", text);
    assert!(err.contains("`blocks.0.attn` (Attention)"), "{err}");
    assert!(err.contains("a post-norm block"), "{err}");
    assert!(err.contains("write the block pre-norm"), "{err}");
    assert!(!err.contains("are RMSNorms"), "{err}");
}

/// An elementwise layer is refused by its function and its place, and a missing final norm
/// as missing, not with a reason meant for another layer (both read "the Llama family's norms
/// are RMSNorms").
#[test]
fn an_elementwise_layer_and_a_missing_final_norm_are_named_as_such() {
    let head = "logits = Linear(d, vocab, bias = false)(RMSNorm(d)(x) as ln_f) as head";
    let softcap = format!("x = softcap(x)\n  {head}");
    let text = format!(
        "fn softcap(x) = 30 * tanh(x / 30)\n{}",
        example("tiny-llama").replace(head, &softcap)
    );
    let err = refusal("softcap", text);
    assert!(err.contains("`softcap(x) = 30 * tanh(x / 30)`"), "{err}");
    assert!(err.contains("they have a block's first norm here"), "{err}");
    assert!(!err.contains("RMSNorms"), "{err}");
    let no_norm = "logits = Linear(d, vocab, bias = false)(x) as head";
    let err = refusal(
        "no-final-norm",
        example("tiny-llama").replace(head, no_norm),
    );
    assert!(err.contains("layer `head` (Linear)"), "{err}");
    assert!(
        err.contains("a final norm between the last block and the head"),
        "{err}"
    );
    assert!(!err.contains("RMSNorms"), "{err}");
}

/// A Llama-style model with LayerNorms is told both families' norms, not GPT-2's alone ("GPT-2's
/// LayerNorms have biases" for a model with RoPE, SwiGLU and no position table).
#[test]
fn layer_norms_in_a_llama_style_model_name_both_families() {
    let blocks = "Block(d, heads, kv_heads = kv_heads, ffn = ffn, theta = 10000)";
    let llama_ln =
        "block Block(d, heads, kv_heads = heads, ffn = 4 * d, theta = 10000, bias = true)(x) {
  h = x + Attention(d, heads, kv_heads = kv_heads, causal = true, bias = false,
                    rope = RoPE(theta = theta))(LayerNorm(d, bias = bias)(x))
  h + MLP(d, ffn, act = swiglu)(LayerNorm(d, bias = bias)(h))
}";
    let text = example("tiny-llama")
        .replace("use std::llama { Block }", llama_ln)
        .replace("RMSNorm(d)(x) as ln_f", "LayerNorm(d)(x) as ln_f");
    let err = refusal("layernorm-llama", text.clone());
    assert!(
        err.contains("the Llama family's norms are RMSNorms"),
        "{err}"
    );
    let unbiased = text.replace(
        blocks,
        "Block(d, heads, kv_heads = kv_heads, ffn = ffn, bias = false)",
    );
    let err = refusal("unbiased-layernorm-llama", unbiased);
    assert!(err.contains("neither GPT-2's"), "{err}");
    assert!(err.contains("the Llama family's (RMSNorms)"), "{err}");
}

/// The command line: `--resume` winning over `train.init`, `parc export` of a finished run's
/// folder (in bf16), `parc run` from the export, and a config.json that disagrees stopping
/// that run with exit code 1.
#[test]
fn parc_export_and_run_from_the_export() {
    let dir = cli::temp_dir("hf", "cli");
    let ckpt = format!("train.checkpoint.dir=\"{}\"", dir.join("ckpt").display());
    let mut args = vec!["run", "examples/tiny-llama.par", "--log-format", "json"];
    args.extend(cli::sets(&SMALL));
    args.extend(cli::sets(&[&ckpt, "train.checkpoint.every=2"]));
    cli::parc_ok(&args);
    // --resume wins over train.init, which it does not read (the folder does not exist).
    let mut resume = args[..2].to_vec();
    resume.extend(&args[4..]);
    let ckpt_dir = dir.join("ckpt");
    let nowhere = init_from(&dir.join("nowhere"));
    resume.extend(cli::sets(&["train.steps=3", &nowhere]));
    resume.extend(["--resume", ckpt_dir.to_str().unwrap()]);
    let resumed = cli::stderr_of(&cli::parc_ok(&resume));
    assert!(
        resumed.contains("--resume continues its checkpoint"),
        "{resumed}"
    );
    let out = dir.join("hf");
    let export = [
        "export",
        ckpt_dir.to_str().unwrap(),
        "--format",
        "hf",
        out.to_str().unwrap(),
        "--dtype",
        "bf16",
    ];
    let done = cli::parc_ok(&export);
    assert!(cli::stderr_of(&done).contains("LlamaForCausalLM"));
    let bf16 = read_tensors(&out);
    assert!(bf16.iter().all(|(_, dtype, ..)| dtype == "BF16"));
    let init = init_from(&out);
    let mut run = vec!["run", "examples/tiny-llama.par", "--log-format", "json"];
    run.extend(cli::sets(&SMALL));
    run.extend(cli::sets(&[&init]));
    let lines = cli::json_lines(&cli::parc_ok(&run));
    assert_eq!(cli::steps(&lines).len(), 2);
    // A config.json that disagrees stops the run before it trains.
    let config = out.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let wrong = text.replace("\"num_key_value_heads\": 4", "\"num_key_value_heads\": 8");
    std::fs::write(&config, wrong).unwrap();
    let failed = cli::parc(&run);
    assert_eq!(failed.status.code(), Some(1));
    let err = cli::stderr_of(&failed);
    assert!(
        err.contains("config.json num_key_value_heads = 8, spec kv_heads = 4"),
        "{err}"
    );
}

/// A tiny Llama export whose config.json `edit` changes, and whether it loads (the error if not).
fn llama_with_config(name: &str, edit: impl Fn(&mut serde_json::Value)) -> Result<(), String> {
    let dir = cli::temp_dir("hf", name);
    let (spec, plan) = compile("tiny-llama", &[]);
    export(&spec, train(&spec, &plan, 0).unwrap(), &dir, None);
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    let (spec, plan) = compile("tiny-llama", &[&init_from(&dir)]);
    train(&spec, &plan, 0)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// `MistralForCausalLM` is Llama's tensors and computation plus a sliding window: a Mistral
/// folder loads into a Llama spec when the window is off or covers the spec's seq (64), and
/// a smaller window is refused naming both (it was refused as "the spec is a Llama model"
/// whatever the window). A model type parc does not read says which it reads.
#[test]
fn a_mistral_folder_loads_as_llama_unless_its_window_is_shorter_than_seq() {
    let mistral = |window: serde_json::Value| {
        move |c: &mut serde_json::Value| {
            c["model_type"] = "mistral".into();
            c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
            c.as_object_mut().unwrap().remove("attention_bias");
            c.as_object_mut().unwrap().remove("mlp_bias");
            c["sliding_window"] = window.clone();
        }
    };
    llama_with_config("mistral-none", mistral(serde_json::Value::Null)).unwrap();
    llama_with_config("mistral-4096", mistral(4096.into())).unwrap();
    let err = llama_with_config("mistral-32", mistral(32.into())).unwrap_err();
    assert!(err.contains("sliding_window = 32, spec seq = 64"), "{err}");
    let err = llama_with_config("gemma", |c| c["model_type"] = "gemma".into()).unwrap_err();
    assert!(
        err.contains(
            "parc reads the model types gpt2, llama, qwen2, qwen3 and mistral; \"gemma\" is not"
        ),
        "{err}"
    );
}

/// A model file cut short (an interrupted download) is said to be truncated, with what to do
/// (it was "not a safetensors file (incomplete metadata, file not fully covered)").
#[test]
fn a_truncated_model_file_is_said_to_be_truncated() {
    let (dir, spec, plan) = broken_export("truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    let err = load_error(&spec, &plan);
    assert!(
        err.contains("model.safetensors")
            && err.contains("the file is truncated")
            && err.contains("download or save it again"),
        "{err}"
    );
}

/// A header entry whose offsets disagree with its dtype and shape names the tensor (the
/// `safetensors` crate's "invalid shape, data type, or offset for tensor" named none).
#[test]
fn a_header_entry_that_disagrees_with_its_shape_names_the_tensor() {
    let (dir, spec, plan) = broken_export("bad-offsets");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    header["transformer.wte.weight"]["shape"] = serde_json::json!([128, 64]);
    let mut text = header.to_string().into_bytes();
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + len..]);
    std::fs::write(&path, out).unwrap();
    let err = load_error(&spec, &plan);
    assert!(
        err.contains("model.safetensors")
            && err.contains("tensor `transformer.wte.weight` is F32 of shape [128, 64]"),
        "{err}"
    );
}

/// Weights that hold a NaN stop the first step naming the parameter that held it, not the
/// first instruction that read it (and a NaN query is not hidden by attention: the loss is
/// NaN, as transformers' would be).
#[test]
fn imported_weights_that_are_not_finite_are_named_when_the_run_stops() {
    let (dir, spec, plan) = broken_export("nan");
    rewrite(&dir, |tensors| {
        let (_, _, data) = tensors
            .iter_mut()
            .find(|(name, _, _)| name == "transformer.h.0.attn.c_attn.weight")
            .unwrap();
        data[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    let err = train(&spec, &plan, 2).unwrap_err().to_string();
    assert!(err.contains("loss NaN"), "{err}");
    assert!(
        err.contains("the parameter `blocks.0.attn.wqkv` already held 1 of"),
        "{err}"
    );
}
