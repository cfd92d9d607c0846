//! Sampling (`parc_runtime::generate`, `parc sample`, `train.sample`).
//!
//! The engine against training: for the tiny GPT-2, Llama and functions examples, with the same
//! parameters, its logits for a whole sequence at once and with the KV cache one token at a
//! time equal, within 1e-5 of each row's largest logit, the logits of parc's training program
//! (rank 0's lowered and fused forward, run on the CPU backend up to the loss, which would
//! overwrite them); the same without attention, and non-causal attention refused. Then the
//! binary: `parc sample` from a short run's checkpoint prints text, greedily the same each
//! time and seeded the same per seed; `train.sample` prints samples
//! while training (one rank, four, four processes under mpiexec); bad input is a clear error.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli_support;

use cli_support::{json_lines, parc, parc_ok, sets, stderr_of};
use parc_compiler::driver::{self, CompileOptions, Stage};
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{BufferId, Init, Instr, Plan};
use parc_compiler::spec::Spec;
use parc_runtime::backend::{Backend, StepScalars};
use parc_runtime::checkpoint::ShardTensor;
use parc_runtime::cpu::CpuBackend;
use parc_runtime::generate::{Engine, Rows};
use std::path::{Path, PathBuf};

/// `file` (from the repository root) as a plan of one sequence per step on one rank.
fn compiled(file: &str) -> (Spec, Plan) {
    let text = std::fs::read_to_string(cli_support::root().join(file)).unwrap();
    compiled_text(file, text)
}

/// The spec `text` (named `name`) as [`compiled`] makes it.
fn compiled_text(name: &str, text: String) -> (Spec, Plan) {
    let overrides: Vec<_> = ["train.micro_batch=1", "train.global_batch=1"]
        .iter()
        .map(|s| parc_compiler::parse_override(s).unwrap())
        .collect();
    let options = CompileOptions::through(Stage::Lower);
    let compiled = driver::compile(name, text, &overrides, &options);
    let shown = format!("{name}: {:?}", compiled.diagnostics.items);
    (compiled.spec.expect(&shown), compiled.plan.expect(&shown))
}

/// splitmix64: a pure function of its input, for parameters and tokens.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in [-1, 1).
fn noise(a: u64, b: u64) -> f32 {
    (mix(mix(a) ^ b) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Every parameter of the plan's table, far from its initialisation (so that every weight, bias
/// and norm matters, and the logits spread over several units): weights uniform with a scale of
/// 1/√fan_in, biases around 0, norm weights around 1.
fn params(plan: &Plan) -> Vec<ShardTensor> {
    plan.params
        .params
        .iter()
        .enumerate()
        .map(|(p, param)| {
            let numel = param.shape.iter().product::<u64>();
            let fan_in = param.shape.get(1).copied().unwrap_or(1) as f32;
            let value = |i: u64| {
                let u = noise(p as u64, i);
                match param.init {
                    Init::Ones => 1.0 + 0.3 * u,
                    Init::Zeros => 0.3 * u,
                    _ => 1.7 * u / fan_in.sqrt(),
                }
            };
            ShardTensor {
                name: param.name.clone(),
                shape: param.shape.clone(),
                data: (0..numel).map(value).collect(),
            }
        })
        .collect()
}

/// The logits `[seq, vocab]` of the training program's forward on `tokens` with `params`:
/// rank 0's program run on the CPU backend up to its loss (which overwrites the logits with
/// their gradient).
fn training_logits(plan: &Plan, params: &[ShardTensor], tokens: &[u32]) -> Vec<f32> {
    let program = plan.program_of(0).unwrap();
    let mut cpu = CpuBackend::new();
    for (i, b) in program.buffers.iter().enumerate() {
        if b.kind.is_persistent() {
            cpu.alloc(BufferId(i as u32), &b.shape, b.dtype).unwrap();
        }
    }
    for local in &program.params {
        let param = &params[local.param.0 as usize];
        cpu.write_f32(local.master, &param.data).unwrap();
    }
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    let scalars = StepScalars {
        lr: 0.0,
        step: 1,
        loss_scale: None,
    };
    for instr in &program.instrs {
        match instr {
            Instr::Alloc { buffer } => {
                let b = program.buffer(*buffer).unwrap();
                cpu.alloc(*buffer, &b.shape, b.dtype).unwrap();
            }
            Instr::Free { buffer } => cpu.free(*buffer).unwrap(),
            Instr::LoadBatch {
                tokens, targets, ..
            } => {
                for id in tokens.iter().chain(targets) {
                    cpu.write_i32(*id, &ids).unwrap();
                }
            }
            Instr::Compute {
                op,
                inputs,
                outputs,
                ..
            } => {
                if matches!(**op, Op::CrossEntropy { .. } | Op::CeMax { .. }) {
                    return cpu.read_f32(inputs[0]).unwrap();
                }
                cpu.compute(op, inputs, outputs, &scalars).unwrap();
            }
            other => panic!("a one-rank forward has no {other:?}"),
        }
    }
    panic!("the program has no loss");
}

/// The largest difference between `got` and `want`, row by row, relative to the row's largest
/// logit in `want`.
fn worst_relative(got: &[f32], want: &[f32], vocab: usize) -> f64 {
    assert_eq!(got.len(), want.len());
    got.chunks(vocab)
        .zip(want.chunks(vocab))
        .map(|(g, w)| {
            let scale = w.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
            let diff = g
                .iter()
                .zip(w)
                .fold(0.0f64, |m, (&a, &b)| m.max(f64::from(a - b).abs()));
            diff / scale
        })
        .fold(0.0, f64::max)
}

/// The engine's logits equal the training forward's, all at once and token by token.
fn engine_matches_training(file: &str) {
    let (spec, plan) = compiled(file);
    engine_matches(file, &spec, &plan);
}

fn engine_matches(file: &str, spec: &Spec, plan: &Plan) {
    let params = params(plan);
    let (seq, vocab) = (spec.model.seq as usize, spec.model.vocab as usize);
    let tokens: Vec<u32> = (0..seq as u64)
        .map(|i| (mix(i ^ 0xdead) % vocab as u64) as u32)
        .collect();
    let want = training_logits(plan, &params, &tokens);
    let spread = want.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
    assert!(spread > 1.0, "{file}: the logits must spread ({spread})");

    let mut engine = Engine::new(spec, &params, CpuBackend::new()).unwrap();
    let whole = engine.feed(&tokens, Rows::All).unwrap();
    let at_once = worst_relative(&whole, &want, vocab);

    engine.reset().unwrap();
    let mut cached = Vec::new();
    for &t in &tokens {
        cached.extend(engine.feed(&[t], Rows::All).unwrap());
    }
    let one_by_one = worst_relative(&cached, &want, vocab);

    // A prefill of 10 tokens (its last row only), then the rest one at a time.
    engine.reset().unwrap();
    let mut mixed = engine.feed(&tokens[..10], Rows::Last).unwrap();
    let prefill = worst_relative(&mixed, &want[9 * vocab..10 * vocab], vocab);
    mixed.clear();
    for &t in &tokens[10..] {
        mixed.extend(engine.feed(&[t], Rows::Last).unwrap());
    }
    let after = worst_relative(&mixed, &want[10 * vocab..], vocab);
    println!(
        "{file}: worst relative difference: whole {at_once:.2e}, cached {one_by_one:.2e}, \
         prefill {prefill:.2e}, after it {after:.2e}"
    );
    for (what, worst) in [
        ("the whole sequence", at_once),
        ("token by token", one_by_one),
        ("a prefill's last row", prefill),
        ("tokens after a prefill", after),
    ] {
        assert!(worst <= 1e-5, "{file}: {what}: {worst:.3e}");
    }
    // Past the model's seq is an error, not a wrap.
    let err = engine.feed(&[1], Rows::Last).unwrap_err().to_string();
    assert!(err.contains(&format!("seq = {seq}")), "{err}");
}

#[test]
fn engine_equals_the_training_forward_gpt2() {
    engine_matches_training("examples/tiny.par");
}

#[test]
fn engine_equals_the_training_forward_llama() {
    engine_matches_training("examples/tiny-llama.par");
}

/// Llama 3's RoPE scaling in the engine (hand-written `Rope` at each fed position, KV cache)
/// against the training forward (fused kernels reading scaled rotation tables): head_dim 8 at
/// theta 10000 has wavelengths 6, 63, 628 and 6283, which an original length of 64 keeps,
/// blends, and divides by 8 twice.
#[test]
fn engine_equals_the_training_forward_scaled_llama() {
    let file = "examples/tiny-llama.par";
    let text = std::fs::read_to_string(cli_support::root().join(file))
        .unwrap()
        .replace(
            "theta = 10000)",
            "theta = 10000, scaling = llama3 { factor: 8, low_freq_factor: 1, \
             high_freq_factor: 4, original_max_position: 64 })",
        );
    let (spec, plan) = compiled_text("scaled tiny-llama", text);
    let scaled = plan.programs[0]
        .instrs
        .iter()
        .any(|i| matches!(i.op(), Some(Op::RopeTable(a)) if !a.scaling.is_none()));
    assert!(
        scaled,
        "the training program's rotation table is not scaled"
    );
    engine_matches("scaled tiny-llama", &spec, &plan);
}

/// An attention's own q·k factor (`scale = 1 / 12`, not tiny-llama's 1/√8) in the engine as in
/// training: an engine that kept 1/√head_dim would give other logits.
#[test]
fn engine_equals_the_training_forward_with_an_attention_scale() {
    let file = "examples/tiny-llama.par";
    let text = std::fs::read_to_string(cli_support::root().join(file))
        .unwrap()
        .replace("theta = 10000)", "theta = 10000, scale = 1 / 12)");
    let (spec, plan) = compiled_text("tiny-llama with scale 1/12", text);
    engine_matches("tiny-llama with scale 1/12", &spec, &plan);
}

/// A partial RoPE (half of each head's features turn) in the engine (hand-written `Rope` at
/// each fed position) as in training (fused kernels reading its rotation table).
#[test]
fn engine_equals_the_training_forward_with_a_partial_rope() {
    let file = "examples/tiny-llama.par";
    let text = std::fs::read_to_string(cli_support::root().join(file))
        .unwrap()
        .replace(
            "Block(d, heads, kv_heads = kv_heads, ffn = ffn, theta = 10000)(x)",
            "x + Attention(d, heads, kv_heads = kv_heads, bias = false,
                 rope = RoPE(theta = 10000, fraction = 0.5))(RMSNorm(d)(x))",
        );
    assert!(text.contains("fraction = 0.5"));
    let (spec, plan) = compiled_text("tiny-llama with a partial rope", text);
    engine_matches("tiny-llama with a partial rope", &spec, &plan);
}

/// Qwen3's per-head q/k norms before RoPE, in the engine as in training.
#[test]
fn engine_equals_the_training_forward_qwen3() {
    engine_matches_training("examples/tiny-qwen3.par");
}

#[test]
fn engine_equals_the_training_forward_functions() {
    engine_matches_training("examples/tiny-functions.par");
}

/// A model `body` (a hidden state `x` from the tokens) of `seq` 16 with its head and loss.
fn small_model(body: &str) -> String {
    format!(
        "model m {{
  let vocab = 256; let d = 32; let seq = 16
  input tokens  : [batch, seq] i32
  input targets : [batch, seq] i32
  x = Embedding(vocab, d)(tokens) + PositionEmbedding(seq, d)
  {body}
  logits = Linear(d, vocab, bias = false, tied = Embedding)(LayerNorm(d)(x) as ln_f) as head
  loss = CrossEntropy(logits, targets)
}}
parallel {{ mesh = {{ dp: 1, pp: 1, cp: 1, tp: 1 }} }}
train {{ global_batch = 1; micro_batch = 1; steps = 1 }}
cluster {{ nodes = 1; gpus_per_node = 1; gpu = cpu }}
"
    )
}

/// Without attention every row is computed alone: the last row's logits need only the last
/// token (`Rows::Last` runs one row), and they still equal the training forward's.
#[test]
fn engine_equals_the_training_forward_without_attention() {
    let text = small_model("x = x + MLP(d, 64, act = gelu)(LayerNorm(d)(x))");
    let (spec, plan) = compiled_text("no-attention.par", text);
    engine_matches("no-attention.par", &spec, &plan);
}

/// A non-causal attention layer cannot be sampled one token at a time: a clear error.
#[test]
fn non_causal_attention_is_refused() {
    let text =
        small_model("a = Attention(d, 4, causal = false)(LayerNorm(d)(x)) as attn\n  x = x + a");
    let (spec, plan) = compiled_text("bidirectional.par", text);
    let err = Engine::new(&spec, &params(&plan), CpuBackend::new())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("attention `attn` is not causal"), "{err}");
    assert!(err.contains("one token at a time"), "{err}");
}

/// A saved model of a short run of the tiny example, in `dir`.
fn trained(dir: &Path) -> PathBuf {
    let ckpt = dir.join("ckpt");
    let set_dir = format!("train.checkpoint.dir=\"{}\"", ckpt.display());
    let mut args = vec!["run", "examples/tiny.par", "--backend", "cpu"];
    args.extend(sets(&[
        "train.steps=10",
        "train.checkpoint.every=10",
        &set_dir,
    ]));
    parc_ok(&args);
    ckpt
}

fn sample(ckpt: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["sample", ckpt.to_str().unwrap(), "--prompt", "ROMEO:"];
    args.extend(extra);
    parc(&args)
}

fn stdout_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn parc_sample_continues_a_prompt_from_a_checkpoint() {
    let dir = cli_support::temp_dir("sample", "cli");
    let ckpt = trained(&dir);
    let greedy = ["--tokens", "24", "--temperature", "0"];
    let out = sample(&ckpt, &greedy);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let text = stdout_of(&out);
    assert!(text.starts_with("ROMEO:"), "{text:?}");
    assert!(text.len() > "ROMEO:".len() + 10, "{text:?}");
    let err = stderr_of(&out);
    assert!(err.contains("sampling tiny (step 10)"), "{err}");
    assert!(
        err.contains("24 tokens in") && err.contains("tokens/s"),
        "{err}"
    );
    assert_eq!(stdout_of(&sample(&ckpt, &greedy)), text, "greedy repeats");

    let seeded = |seed: &str| {
        let out = sample(&ckpt, &["--tokens", "40", "--top-k", "20", "--seed", seed]);
        assert!(out.status.success(), "{}", stderr_of(&out));
        stdout_of(&out)
    };
    assert_eq!(seeded("5"), seeded("5"), "a seed repeats its sample");
    assert_ne!(
        seeded("5"),
        seeded("6"),
        "another seed draws another sample"
    );

    // A model file alone works too, up to the model's seq.
    let out = sample(&ckpt.join("model.safetensors"), &["--tokens", "500"]);
    let err = stderr_of(&out);
    assert!(err.contains("stopped by the model's seq = 64"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A model whose run was warned about its recipe (W0901: the warmup outlasts the run) samples
/// and exports without the warning: it is about training, which neither command does (both
/// used to print it from the spec the model file records).
#[test]
fn sample_and_export_leave_out_the_runs_training_warnings() {
    let dir = cli_support::temp_dir("sample", "warned");
    let ckpt = dir.join("ckpt");
    let set_dir = format!("train.checkpoint.dir=\"{}\"", ckpt.display());
    let mut args = vec!["run", "examples/tiny.par", "--backend", "cpu"];
    args.extend(sets(&[
        "train.steps=2",
        "train.checkpoint.every=2",
        &set_dir,
    ]));
    let run = parc_ok(&args);
    assert!(stderr_of(&run).contains("W0901"), "{}", stderr_of(&run));
    let out = sample(&ckpt, &["--tokens", "4"]);
    let err = stderr_of(&out);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("W0901") && !err.contains("warmup"), "{err}");
    let hf = dir.join("hf");
    let out = parc_ok(&[
        "export",
        ckpt.to_str().unwrap(),
        "--format",
        "hf",
        hf.to_str().unwrap(),
    ]);
    let err = stderr_of(&out);
    assert!(!err.contains("W0901") && !err.contains("warmup"), "{err}");
    // A spec with errors still shows them: they say why the command cannot go on.
    let broken = dir.join("broken.par");
    std::fs::write(&broken, "model m {").unwrap();
    let out = sample(&ckpt, &["--spec", broken.to_str().unwrap()]);
    let err = stderr_of(&out);
    assert!(err.contains("E0101"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The temperature is printed as short as it reads back: `1e300`, not its 301 digits (in the
/// header and in the error of a negative one).
#[test]
fn a_huge_temperature_is_printed_compactly() {
    let dir = cli_support::temp_dir("sample", "temperature");
    let ckpt = trained(&dir);
    let out = sample(&ckpt, &["--tokens", "2", "--temperature", "1e300"]);
    let err = stderr_of(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("temperature 1e300, seed 0"), "{err}");
    let out = sample(&ckpt, &["--temperature", "-1e300"]);
    let err = stderr_of(&out);
    assert!(err.contains("temperature = -1e300 must be"), "{err}");
    assert!(!err.contains("0000000000"), "{err}");
    let out = sample(&ckpt, &["--tokens", "2", "--temperature", "0.8"]);
    assert!(
        stderr_of(&out).contains("temperature 0.8,"),
        "{}",
        stderr_of(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--dump-logits FILE`'s logits, as rows.
fn dumped_logits(file: &Path) -> Vec<Vec<f32>> {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
    serde_json::from_value(json["logits"].clone()).unwrap()
}

#[test]
fn a_hugging_face_export_samples_as_its_model_file_does() {
    let dir = cli_support::temp_dir("sample", "hf");
    let ckpt = trained(&dir);
    let hf = dir.join("hf");
    parc_ok(&[
        "export",
        ckpt.to_str().unwrap(),
        "--format",
        "hf",
        hf.to_str().unwrap(),
    ]);
    let dump = |from: &Path, file: &str, extra: &[&str]| {
        let out_file = dir.join(file);
        let mut args = vec!["sample", from.to_str().unwrap(), "--prompt", "ROMEO: what"];
        args.extend(["--tokens", "0", "--dump-logits", out_file.to_str().unwrap()]);
        args.extend(extra);
        let out = parc(&args);
        assert!(out.status.success(), "{}", stderr_of(&out));
        assert!(stdout_of(&out).is_empty(), "--tokens 0 samples nothing");
        dumped_logits(&out_file)
    };
    let native = dump(&ckpt, "native.json", &[]);
    assert_eq!(native.len(), "ROMEO: what".len());
    assert_eq!(native[0].len(), 256);
    let imported = dump(&hf, "imported.json", &["--spec", "examples/tiny.par"]);
    assert_eq!(native, imported, "the same weights give the same logits");

    let out = parc(&["sample", hf.to_str().unwrap(), "--prompt", "a"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr_of(&out).contains("--spec FILE"),
        "{}",
        stderr_of(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_sample_input_is_a_clear_error() {
    let dir = cli_support::temp_dir("sample", "bad");
    let ckpt = trained(&dir);
    let long = "x".repeat(70);
    let out = parc(&["sample", ckpt.to_str().unwrap(), "--prompt", &long]);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("the prompt is 70 tokens but the model's seq is 64"),
        "{err}"
    );

    // A prompt that begins with `-` is the prompt, not an unknown flag; a negative
    // temperature reaches the temperature's own error.
    let out = parc(&[
        "sample",
        ckpt.to_str().unwrap(),
        "--prompt",
        "- ROMEO",
        "--tokens",
        "4",
    ]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(
        stdout_of(&out).starts_with("- ROMEO"),
        "{}",
        stdout_of(&out)
    );
    let out = sample(&ckpt, &["--temperature", "-1"]);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("temperature = -1 must be a number ≥ 0"),
        "{err}"
    );

    let missing = dir.join("missing");
    let out = parc(&["sample", missing.to_str().unwrap(), "--prompt", "x"]);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("missing: no such file or folder"), "{err}");

    let out = sample(&ckpt, &["--backend", "cuda"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr_of(&out).contains("not built yet"),
        "{}",
        stderr_of(&out)
    );

    // A model file without a recorded spec: the same tensors, no metadata.
    let bytes = std::fs::read(ckpt.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let bare = dir.join("bare.safetensors");
    safetensors::serialize_to_file(file.tensors(), None, &bare).unwrap();
    let out = sample(&bare, &[]);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("records no spec") && err.contains("--spec FILE"),
        "{err}"
    );
    let out = sample(&bare, &["--spec", "examples/tiny.par", "--tokens", "8"]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(stdout_of(&out).starts_with("ROMEO:"));

    // A model whose parameters are not finite (a diverged run, a damaged file) is refused by
    // sample and export naming the tensor, before any logit is computed or any file written.
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let mut data = t.data().to_vec();
            if name == "blocks.1.mlp.fc" {
                data[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
            }
            (name, t.shape().to_vec(), data)
        })
        .collect();
    let views = tensors.iter().map(|(name, shape, data)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data);
        (name.clone(), view.unwrap())
    });
    let diverged = dir.join("diverged.safetensors");
    safetensors::serialize_to_file(views, header.metadata().clone(), &diverged).unwrap();
    let named =
        "tensor blocks.1.mlp.fc holds 1 of 16384 values that are not finite (element 1 is NaN)";
    let out = sample(&diverged, &["--tokens", "4"]);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(named) && err.contains("before the run diverged"),
        "{err}"
    );
    assert!(stdout_of(&out).is_empty(), "{}", stdout_of(&out));
    let hf = dir.join("diverged-hf");
    let out = parc(&[
        "export",
        diverged.to_str().unwrap(),
        "--format",
        "hf",
        hf.to_str().unwrap(),
    ]);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(named), "{err}");
    assert!(!hf.exists());

    // A spec of other shapes names the tensor that does not fit.
    let out = sample(
        &bare,
        &["--spec", "examples/tiny.par", "--set", "model.d=32"],
    );
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("tensor embed.weight has shape [256, 64]"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

const TRAIN_SAMPLE: [&str; 4] = [
    "train.steps=4",
    "train.global_batch=4",
    "train.micro_batch=1",
    "train.sample={every: 2, prompt: \"ROMEO:\", tokens: 12, temperature: 0}",
];

/// Four ranks: dp 2 × tp 2.
const FOUR_RANKS: [&str; 3] = ["parallel.dp=2", "parallel.tp=2", "cluster.gpus_per_node=4"];

/// The `(step, text)` of the `sample` events of a JSON-logged run of the tiny example with
/// [`TRAIN_SAMPLE`], `parallel` and `extra` arguments.
fn samples_of_run(parallel: &[&str], extra: &[&str]) -> Vec<(u64, String)> {
    let mut args = vec!["run", "examples/tiny.par", "--log-format", "json"];
    let all: Vec<&str> = TRAIN_SAMPLE.iter().chain(parallel).copied().collect();
    args.extend(sets(&all));
    args.extend(extra);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_parc"))
        .args(&args)
        .current_dir(cli_support::root())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    json_lines(&out)
        .into_iter()
        .filter(|l| l["event"] == "sample")
        .map(|l| {
            (
                l["step"].as_u64().unwrap(),
                l["text"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// `train.sample` every 2 steps of a 4-step run: JSON `sample` events after steps 2 and 4, the
/// text the prompt and its continuation; the same with four ranks, whose parameters rank 0
/// gathers; on stderr without `--log-format json`.
#[test]
fn train_sample_prints_samples_while_training() {
    for parallel in [&[][..], &FOUR_RANKS[..]] {
        let samples = samples_of_run(parallel, &[]);
        let steps: Vec<u64> = samples.iter().map(|(step, _)| *step).collect();
        assert_eq!(steps, [2, 4], "{parallel:?}");
        for (_, text) in &samples {
            assert!(text.starts_with("ROMEO:") && text.len() > 6, "{text:?}");
        }
    }
    let mut args = vec!["run", "examples/tiny.par"];
    args.extend(sets(&TRAIN_SAMPLE));
    let err = stderr_of(&parc_ok(&args));
    assert!(err.contains("sample at step 2:\nROMEO:"), "{err}");
}

/// One process per rank (mpiexec and the MPI comm): rank 0 gathers the parameters through the
/// comm and prints exactly the samples of the same plan run as threads of one process.
#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a parc built with --features mpi"
)]
fn train_sample_in_one_process_per_rank_equals_one_process() {
    let on_path = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join("mpiexec").is_file()));
    if !on_path {
        eprintln!("skipped: mpiexec is not on PATH (install openmpi-bin)");
        return;
    }
    let threads = samples_of_run(&FOUR_RANKS, &[]);
    let processes = samples_of_run(&FOUR_RANKS, &["--nproc-per-node", "4"]);
    assert_eq!(processes, threads);
    assert_eq!(processes.len(), 2);
}
