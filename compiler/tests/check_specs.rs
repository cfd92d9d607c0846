//! The checker through its public entry point on the shipped specs: the Spec it builds (names,
//! shapes, defaults, recompute marks), `--set` semantics, and that the tiny examples admit every
//! dp/tp/pp/cp ∈ {1, 2} plan by overrides alone.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use parc_compiler::diag::Sources;
use parc_compiler::spec::*;
use parc_compiler::{check, parse_override, Override};

fn example(name: &str) -> String {
    std::fs::read_to_string(format!("{}/../examples/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

fn run(text: &str, sets: &[&str]) -> (Option<Spec>, Vec<&'static str>) {
    let mut sources = Sources::default();
    let main = sources.add("test.par", text);
    let overrides: Vec<Override> = sets.iter().map(|s| parse_override(s).unwrap()).collect();
    let (spec, diags) = check(&mut sources, main, &overrides);
    (spec, diags.items.iter().map(|d| d.code).collect())
}

/// `examples/tiny.par` checked with `sets`, which must leave warnings at most.
fn tiny_with(sets: &[&str]) -> Spec {
    let (spec, codes) = run(&example("tiny.par"), sets);
    assert!(codes.iter().all(|c| c.starts_with('W')), "{codes:?}");
    spec.unwrap()
}

/// `spec`'s node `name`.
fn node<'a>(spec: &'a Spec, name: &str) -> &'a Node {
    spec.model.nodes.iter().find(|n| n.name == name).unwrap()
}

/// The names of `spec`'s recomputed nodes.
fn recomputed(spec: &Spec) -> Vec<&str> {
    let nodes = spec.model.nodes.iter().filter(|n| n.recompute);
    nodes.map(|n| n.name.as_str()).collect()
}

#[test]
fn tiny_lowers_to_the_documented_node_names() {
    let (spec, codes) = run(&example("tiny.par"), &[]);
    assert!(codes.is_empty(), "{codes:?}");
    let spec = spec.unwrap();
    let names: Vec<&str> = spec.model.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(
        &names[..8],
        [
            "embed",
            "pos",
            "blocks.0.ln1",
            "blocks.0.attn",
            "blocks.0.add1",
            "blocks.0.ln2",
            "blocks.0.mlp",
            "blocks.0.add2"
        ]
    );
    assert_eq!(&names[names.len() - 3..], ["ln_f", "head", "loss"]);
    assert_eq!(
        (
            spec.model.seq,
            spec.model.vocab,
            spec.model.dim,
            spec.model.layers
        ),
        (64, 256, 64, 4)
    );
    let head = node(&spec, "head");
    assert!(matches!(
        head.kind,
        LayerKind::Linear {
            tied: Some(NodeId(0)),
            ..
        }
    ));
    assert_eq!(spec.model.nodes[3].layer, Some(0));
    assert_eq!(spec.parallel.microbatches, 4);
    assert_eq!(spec.train.precision, Precision::Fp32);
    assert_eq!(spec.parallel.bucket_bytes, 25 * 1024 * 1024);
    assert!(matches!(
        spec.train.data,
        DataSource::File {
            format: DataFormat::Bytes,
            ..
        }
    ));
}

/// Qwen2's attention: `qkv_bias = true` through std::llama's Block puts biases on q, k and v
/// alone; `bias = true` on both projections; and `train.init` names the weights to start from.
#[test]
fn qkv_bias_alone_and_hf_init() {
    let (spec, codes) = run(&example("tiny-qwen.par"), &["train.init=hf(\"qwen-hf\")"]);
    assert!(codes.is_empty(), "{codes:?}");
    let spec = spec.unwrap();
    let biases = |s: &Spec| match node(s, "blocks.1.attn").kind {
        LayerKind::Attention {
            qkv_bias, out_bias, ..
        } => (qkv_bias, out_bias),
        _ => panic!("not attention"),
    };
    assert_eq!(biases(&spec), (true, false));
    assert!(matches!(&spec.train.init, InitFrom::Hf { path, .. } if path == "qwen-hf"));
    let llama = example("tiny-llama.par").replace("theta = 10000)", "theta = 10000, bias = true)");
    let (spec, codes) = run(&llama, &[]);
    assert!(codes.is_empty(), "{codes:?}");
    assert_eq!(biases(&spec.unwrap()), (true, true));
    assert_eq!(tiny_with(&[]).train.init, InitFrom::Seeded);
}

/// `scaling` through std::llama's Block into every attention's RoPE: Llama 3.2's published
/// rule, a linear stretch, and `none` (the default, as before scaling existed).
#[test]
fn rope_scaling_reaches_every_attention() {
    let rope_of = |spec: &Spec, name: &str| match node(spec, name).kind {
        LayerKind::Attention { rope, .. } => rope,
        _ => panic!("{name} is not attention"),
    };
    let with = |scaling: &str| {
        let text = example("tiny-llama.par").replace(
            "theta = 10000)",
            &format!("theta = 500000, scaling = {scaling})"),
        );
        let (spec, codes) = run(&text, &[]);
        assert!(codes.is_empty(), "{scaling}: {codes:?}");
        spec.unwrap()
    };
    let llama3 = with(
        "llama3 { factor: 32, low_freq_factor: 1, high_freq_factor: 4, \
         original_max_position: 8192 }",
    );
    let published = RopeScaling::Llama3 {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192,
    };
    for layer in 0..4 {
        let rope = rope_of(&llama3, &format!("blocks.{layer}.attn"));
        assert_eq!(
            rope.map(|r| (r.theta, r.scaling)),
            Some((500000.0, published))
        );
    }
    let linear = with("linear { factor: 2.5 }");
    let scaling = rope_of(&linear, "blocks.0.attn").map(|r| r.scaling);
    assert_eq!(scaling, Some(RopeScaling::Linear { factor: 2.5 }));
    let plain = with("none");
    let scaling = rope_of(&plain, "blocks.3.attn").map(|r| r.scaling);
    assert_eq!(scaling, Some(RopeScaling::None));
}

/// An attention's own q·k factor through std::llama's Block: `scale = 1 / 12` (Gemma 2 27B's
/// query_pre_attn_scalar of 144) reaches every attention; left out it is none (1/√head_dim);
/// zero or a negative factor is E0903, a flag E0902; Gemma's name for it is E0207 with a note.
#[test]
fn an_attention_scale_through_the_llama_block() {
    let with = |scale: &str| {
        let text = example("tiny-llama.par").replace(
            "theta = 10000)",
            &format!("theta = 10000, scale = {scale})"),
        );
        run(&text, &[])
    };
    let scale_of = |spec: &Spec| match node(spec, "blocks.3.attn").kind {
        LayerKind::Attention { scale, .. } => scale,
        _ => panic!("blocks.3.attn is not an attention"),
    };
    let (spec, codes) = with("1 / 12");
    assert!(codes.is_empty(), "{codes:?}");
    assert_eq!(scale_of(&spec.unwrap()), Some(1.0 / 12.0));
    let (spec, codes) = with("none");
    assert!(codes.is_empty(), "{codes:?}");
    assert_eq!(scale_of(&spec.unwrap()), None);
    assert_eq!(with("0").1, ["E0903"]);
    assert_eq!(with("-0.5").1, ["E0903"]);
    assert_eq!(with("true").1, ["E0902"]);
    let gemma = example("tiny-llama.par").replace(
        "  logits = ",
        "  x = x + Attention(d, heads, query_pre_attn_scalar = 144)(x)\n  logits = ",
    );
    assert_eq!(run(&gemma, &[]).1, ["E0207"]);
}

/// A partial RoPE as GPT-NeoX and Phi write it: `RoPE(theta = …, fraction = 0.25)` over heads
/// of 8 turns 2 features; a fraction making an odd or fractional count of features is E0311
/// naming the fractions that work, one outside (0, 1] E0903, transformers' name E0207.
#[test]
fn a_partial_rope_fraction() {
    let rope_of = |spec: &Spec, name: &str| match node(spec, name).kind {
        LayerKind::Attention { rope, .. } => rope,
        _ => panic!("{name} is not attention"),
    };
    let with = |fraction: &str| {
        let text = example("tiny-llama.par").replace(
            "Block(d, heads, kv_heads = kv_heads, ffn = ffn, theta = 10000)(x)",
            &format!("Attention(d, heads, rope = RoPE(theta = 10000, {fraction}))(x) + x"),
        );
        run(&text, &[])
    };
    let (spec, codes) = with("fraction = 0.25");
    assert!(codes.is_empty(), "{codes:?}");
    let rope = rope_of(&spec.unwrap(), "blocks.0.attn").unwrap();
    assert_eq!((rope.fraction, rope.rotary_dim(8)), (0.25, 2));
    assert_eq!(with("fraction = 0.125").1, ["E0311"]);
    assert_eq!(with("fraction = 0.3").1, ["E0311"]);
    assert_eq!(with("fraction = 1.5").1, ["E0903"]);
    assert_eq!(with("fraction = 0").1, ["E0903"]);
    assert_eq!(with("rotary_pct = 0.25").1, ["E0207"]);
}

/// Qwen3 through std::llama's Block: `qk_norm = true` takes the block's eps, `head_dim` sets
/// heads wider than d / heads; left out, the Block's `head_dim = none` is d / heads and its
/// `qk_norm = false` none.
#[test]
fn qk_norm_and_head_dim_through_the_llama_block() {
    let (spec, codes) = run(&example("tiny-qwen3.par"), &[]);
    assert!(codes.is_empty(), "{codes:?}");
    let spec = spec.unwrap();
    assert_eq!(
        node(&spec, "blocks.1.attn").kind,
        LayerKind::Attention {
            dim: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            causal: true,
            rope: Some(Rope {
                theta: 1000000.0,
                scaling: RopeScaling::None,
                fraction: 1.0,
            }),
            qkv_bias: false,
            out_bias: false,
            qk_norm: Some(1e-6),
            scale: None,
        }
    );
    let (spec, codes) = run(&example("tiny-llama.par"), &[]);
    assert!(codes.is_empty(), "{codes:?}");
    let spec = spec.unwrap();
    assert!(matches!(
        node(&spec, "blocks.0.attn").kind,
        LayerKind::Attention {
            head_dim: 8,
            qk_norm: None,
            ..
        }
    ));
}

#[test]
fn tiny_llama_has_gqa_rope_and_swiglu() {
    let (spec, codes) = run(&example("tiny-llama.par"), &[]);
    assert!(codes.is_empty(), "{codes:?}");
    let spec = spec.unwrap();
    let attn = node(&spec, "blocks.2.attn");
    assert_eq!(
        attn.kind,
        LayerKind::Attention {
            dim: 64,
            heads: 8,
            kv_heads: 4,
            head_dim: 8,
            causal: true,
            rope: Some(Rope {
                theta: 10000.0,
                scaling: RopeScaling::None,
                fraction: 1.0,
            }),
            qkv_bias: false,
            out_bias: false,
            qk_norm: None,
            scale: None,
        }
    );
    let mlp = node(&spec, "blocks.2.mlp");
    assert!(matches!(
        mlp.kind,
        LayerKind::Mlp {
            act: Activation::Swiglu,
            bias: false,
            hidden: 256,
            ..
        }
    ));
}

#[test]
fn tiny_admits_every_small_plan_by_overrides_alone() {
    for file in ["tiny.par", "tiny-llama.par"] {
        let text = example(file);
        for dp in [1, 2] {
            for pp in [1, 2] {
                for cp in [1, 2] {
                    for tp in [1, 2] {
                        let world = dp * pp * cp * tp;
                        let sets = [
                            format!("parallel.dp={dp}"),
                            format!("parallel.pp={pp}"),
                            format!("parallel.cp={cp}"),
                            format!("parallel.tp={tp}"),
                            format!("cluster.gpus_per_node={world}"),
                        ];
                        let refs: Vec<&str> = sets.iter().map(String::as_str).collect();
                        let (spec, codes) = run(&text, &refs);
                        let errors: Vec<_> = codes.iter().filter(|c| c.starts_with('E')).collect();
                        assert!(
                            errors.is_empty(),
                            "{file} dp{dp} pp{pp} cp{cp} tp{tp}: {codes:?}"
                        );
                        let spec = spec.unwrap();
                        assert_eq!(spec.parallel.mesh.world(), world);
                        assert_eq!(
                            spec.train.global_batch,
                            spec.train.micro_batch
                                * u64::from(spec.parallel.microbatches)
                                * dp as u64
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn overrides_last_wins_and_reach_every_section() {
    let spec = tiny_with(&[
        "parallel.pp=4",
        "parallel.pp=2",
        "cluster.gpus_per_node=2",
        "parallel.schedule=gpipe",
        "parallel.recompute=selective",
        "parallel.zero=1",
        "train.steps=7",
        "train.seed=3",
        "train.micro_batch=1",
        "model.layers=6",
    ]);
    assert_eq!(spec.parallel.mesh.size(Axis::Pp), 2);
    assert_eq!(spec.parallel.schedule, PipelineSchedule::Gpipe);
    assert_eq!(spec.parallel.zero, ZeroStage::Zero1);
    assert_eq!(
        (
            spec.train.steps,
            spec.train.seed,
            spec.parallel.microbatches
        ),
        (7, 3, 8)
    );
    assert_eq!(spec.model.layers, 6);
    let recomputed = recomputed(&spec);
    assert_eq!(recomputed.len(), 6);
    assert!(recomputed.iter().all(|n| n.ends_with(".attn")));
}

#[test]
fn interleaved_and_named_recompute_by_override() {
    let spec = tiny_with(&[
        "parallel.pp=2",
        "cluster.gpus_per_node=2",
        "parallel.schedule=interleaved",
        "parallel.virtual=2",
        "parallel.recompute=[MLP, blocks.1]",
    ]);
    assert_eq!(
        spec.parallel.schedule,
        PipelineSchedule::Interleaved { virtual_stages: 2 }
    );
    let r = recomputed(&spec);
    assert!(
        r.contains(&"blocks.3.mlp") && r.contains(&"blocks.1.ln1") && !r.contains(&"blocks.2.attn")
    );
}

#[test]
fn many_errors_in_one_run() {
    let (spec, codes) = run(
        &example("tiny.par"),
        &[
            "parallel.tp=3",
            "parallel.pp=3",
            "cluster.gpus_per_node=2",
            "train.global_batch=7",
        ],
    );
    assert!(spec.is_none());
    for c in ["E0401", "E0402", "E0407", "E0501"] {
        assert!(codes.contains(&c), "{c} missing from {codes:?}");
    }
}

#[test]
fn big_examples_check_clean() {
    for f in [
        "gpt2-124m.par",
        "gpt2-350m.par",
        "gpt2-1.5b-8gpu.par",
        "llama3-8b-8gpu.par",
        "llama3-70b-64gpu.par",
    ] {
        let (spec, codes) = run(&example(f), &[]);
        assert!(codes.is_empty(), "{f}: {codes:?}");
        assert!(spec.is_some());
    }
    let (spec, _) = run(&example("llama3-70b-64gpu.par"), &[]);
    let spec = spec.unwrap();
    assert_eq!(spec.model.nodes.len(), 2 + 6 * 80 + 2);
    assert_eq!(spec.cluster.world(), 64);
    assert_eq!(spec.cluster.inter.bandwidth, 50e9);
    assert!(spec
        .model
        .nodes
        .iter()
        .filter(|n| n.layer.is_some())
        .all(|n| n.recompute));
}

#[test]
fn a_record_override_sets_each_field() {
    let spec = tiny_with(&[
        "parallel.mesh={dp: 2, tp: 2}",
        "cluster.gpus_per_node=4",
        "train.optimizer=sgd { lr: 0.1, momentum: 0.9 }",
    ]);
    assert_eq!(
        (
            spec.parallel.mesh.size(Axis::Dp),
            spec.parallel.mesh.size(Axis::Tp)
        ),
        (2, 2)
    );
    assert_eq!(
        spec.train.optimizer,
        Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0
        }
    );
}

const FEATURES: &str = r#"
// Every language feature in one spec.
let width = 32 + 4 * 8            // 64: * binds tighter than +
block Mix(d, hidden = 2 * d, act = relu)(x) {
  let half = d / 2
  y = x + MLP(d, hidden, act = act)(RMSNorm(d, eps = 1e-6)(x))
  y + Attention(d, 4, head_dim = half, causal = false, bias = false)(LayerNorm(d, bias = false)(y)) as mix
}

model features {
  let vocab = 512; let d = width; let seq = (16 + 16) * 2
  input tokens  : [batch, seq] i32
  input targets : [batch, seq] i32
  x = PositionEmbedding(seq, d)(Embedding(vocab, d)(tokens))
  x = repeat 2 as layers { Mix(d)(x) }
  loss = CrossEntropy(Linear(d, vocab, tied = embed)(x) as out, targets)
  shard Embedding.vocab on tp
}

parallel {
  dp = 2
  zero = 2
  bucket = 4 MiB
  recompute = full
}

train {
  global_batch = 2 * 8; micro_batch = 2
  precision = fp16 { loss_scale: dynamic { init: 1024, window: 100 } }
  optimizer = sgd { lr: 0.1, momentum: 0.9, weight_decay: 1e-4 }
  schedule = linear { warmup: 5, min_lr: 0.001, decay_steps: 50 }
  steps = 60; seed = 7; log_every = 5
  checkpoint = { every: 20, dir: "ckpt/", keep: 2, async: false }
  data = "tokens.bin" as u16
}

cluster {
  nodes = 2; gpus_per_node = 1
  gpu = custom { memory: 24 GiB, flops: 165 TFLOP/s, bandwidth: 1 TB/s }
  intra = pcie { bandwidth: 32 GB/s }
  inter = roce { bandwidth: 2 * 100 Gb/s, latency: 10 us }
}
"#;

#[test]
fn every_language_feature_reaches_the_spec() {
    let (spec, codes) = run(FEATURES, &[]);
    assert!(codes.is_empty(), "{codes:?}");
    let s = spec.unwrap();
    assert_eq!((s.model.dim, s.model.seq, s.model.layers), (64, 64, 2));
    let names: Vec<&str> = s.model.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "embed",
            "pos",
            "layers.0.ln1",
            "layers.0.mlp",
            "layers.0.add1",
            "layers.0.ln2",
            "layers.0.mix",
            "layers.0.add2",
            "layers.1.ln1",
            "layers.1.mlp",
            "layers.1.add1",
            "layers.1.ln2",
            "layers.1.mix",
            "layers.1.add2",
            "out",
            "loss"
        ]
    );
    assert!(matches!(s.model.nodes[2].kind, LayerKind::RmsNorm { eps, .. } if eps == 1e-6));
    assert!(matches!(
        s.model.nodes[3].kind,
        LayerKind::Mlp {
            hidden: 128,
            act: Activation::Plain(parc_compiler::ir::op::Act::Relu),
            bias: true,
            ..
        }
    ));
    assert_eq!(
        s.model.nodes[6].kind,
        LayerKind::Attention {
            dim: 64,
            heads: 4,
            kv_heads: 4,
            head_dim: 32,
            causal: false,
            rope: None,
            qkv_bias: false,
            out_bias: false,
            qk_norm: None,
            scale: None,
        }
    );
    assert!(matches!(
        s.model.nodes[14].kind,
        LayerKind::Linear {
            tied: Some(NodeId(0)),
            bias: true,
            ..
        }
    ));
    assert!(s
        .model
        .nodes
        .iter()
        .all(|n| n.recompute == n.layer.is_some()));
    assert!(s.model.sharding.vocab_on_tp && !s.model.sharding.attention_heads_on_tp);
    assert_eq!(
        (
            s.parallel.mesh.size(Axis::Dp),
            s.parallel.zero,
            s.parallel.microbatches
        ),
        (2, ZeroStage::Zero2, 4)
    );
    assert_eq!(s.parallel.bucket_bytes, 4 << 20);
    assert_eq!(
        s.train.precision,
        Precision::Fp16 {
            loss_scale: LossScale::Dynamic {
                init: 1024.0,
                window: 100,
                hysteresis: 2,
                min: 1.0
            }
        }
    );
    assert_eq!(
        s.train.optimizer,
        Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 1e-4
        }
    );
    assert_eq!(
        s.train.schedule,
        LrSchedule::Linear {
            warmup: 5,
            min_lr: 0.001,
            decay_steps: 50
        }
    );
    assert_eq!((s.train.steps, s.train.seed, s.train.log_every), (60, 7, 5));
    assert_eq!(
        s.train.checkpoint,
        Some(Checkpointing {
            every: 20,
            dir: "ckpt/".into(),
            keep: 2,
            asynchronous: false
        })
    );
    assert!(
        matches!(&s.train.data, DataSource::File { path, format: DataFormat::U16, .. } if path == "tokens.bin")
    );
    assert_eq!(s.cluster.gpu.memory_bytes, 24 << 30);
    assert_eq!(s.cluster.gpu.peak_flops, 165e12);
    assert_eq!(
        (s.cluster.intra.kind.as_str(), s.cluster.intra.bandwidth),
        ("pcie", 32e9)
    );
    assert_eq!(
        (s.cluster.inter.bandwidth, s.cluster.inter.latency),
        (25e9, 10e-6)
    );
}

#[test]
fn text_data_names_its_tokenizer_by_word_or_file_in_either_argument_form() {
    let spec = run(&example("tiny-gpt2-text.par"), &[]).0.unwrap();
    assert!(matches!(
        &spec.train.data,
        DataSource::Text { path, tokenizer: Tokenizer::Gpt2, .. } if path == "data/tiny-shakespeare.txt"
    ));
    let data = |set: &str| tiny_with(&[set]).train.data;
    let bytes = data(r#"train.data=text("a.txt", tokenizer = bytes)"#);
    assert!(matches!(
        bytes,
        DataSource::Text {
            tokenizer: Tokenizer::Bytes,
            ..
        }
    ));
    let file = data(r#"train.data=text("corpus/*.txt", tokenizer: "tok/tokenizer.json")"#);
    let want = Tokenizer::File {
        path: "tok/tokenizer.json".into(),
    };
    assert!(
        matches!(&file, DataSource::Text { path, tokenizer, .. } if path == "corpus/*.txt" && *tokenizer == want)
    );
    // The model's vocab must hold a built-in tokenizer's ids (tiny.par's is 256).
    let (_, codes) = run(
        &example("tiny.par"),
        &[r#"train.data=text("a.txt", tokenizer: gpt2)"#],
    );
    assert_eq!(codes, ["E0310"]);
    for (set, code) in [
        (r#"train.data=text("", tokenizer: bytes)"#, "E0903"),
        (r#"train.data=text("a.txt", tokenizer: "")"#, "E0903"),
        (r#"train.data=text("a.txt")"#, "E0207"),
        (r#"train.data=text(tokenizer: bytes)"#, "E0207"),
        (r#"train.data=text(3, tokenizer: bytes)"#, "E0902"),
        (r#"train.data=txt("a.txt", tokenizer: bytes)"#, "E0904"),
    ] {
        assert_eq!(run(&example("tiny.par"), &[set]).1, [code], "{set}");
    }
}

#[test]
fn a_dynamic_loss_scale_must_be_positive_finite_in_f32_and_min_at_most_init() {
    let tiny = example("tiny.par");
    let fp16 = "train.precision=fp16";
    let codes = |sets: &[&str]| {
        let mut all = vec![fp16];
        all.extend_from_slice(sets);
        run(&tiny, &all).1
    };
    assert!(codes(&[]).is_empty());
    assert!(codes(&["train.precision.loss_scale.init=1.329227995784916e36"]).is_empty());
    assert_eq!(codes(&["train.precision.loss_scale.init=0"]), ["E0903"]);
    assert_eq!(codes(&["train.precision.loss_scale.min=0"]), ["E0903"]);
    assert_eq!(codes(&["train.precision.loss_scale.init=1e39"]), ["E0903"]);
    assert_eq!(
        codes(&[
            "train.precision.loss_scale.init=1024",
            "train.precision.loss_scale.min=2048"
        ]),
        ["E0903"]
    );
    // A default min above a small init is reported at the init.
    assert_eq!(codes(&["train.precision.loss_scale.init=0.5"]), ["E0903"]);
}

/// `layers` and `balance` reach the spec from the file and from `--set`, and the per-chunk
/// counts are always filled: even by default, as given, or the cost model's.
#[test]
fn pipeline_layers_from_the_file_and_overrides() {
    let split = |spec: &Spec| (spec.parallel.balance, spec.parallel.chunk_layers.clone());
    let pp2 = ["parallel.pp=2", "cluster.gpus_per_node=2"];
    assert_eq!(split(&tiny_with(&[])), (Balance::Even, vec![4]));
    assert_eq!(split(&tiny_with(&pp2)), (Balance::Even, vec![2, 2]));
    let given = tiny_with(&[pp2[0], pp2[1], "parallel.layers=[3,1]"]);
    assert_eq!(split(&given), (Balance::Given, vec![3, 1]));
    // A head of about 2.3 layers' FLOPs (vocab 2048 at d 64): auto gives its stage one layer.
    let big_head = [pp2[0], pp2[1], "model.vocab=2048", "parallel.balance=auto"];
    assert_eq!(split(&tiny_with(&big_head)), (Balance::Auto, vec![3, 1]));
    let text = example("tiny.par")
        .replace(
            "mesh = { dp: 1, pp: 1, cp: 1, tp: 1 }",
            "mesh = { dp: 1, pp: 2, cp: 1, tp: 1 }\n  pipeline = interleaved { virtual: 2, microbatches: 4, layers: [1, 2, 2, 1] }",
        )
        .replace("gpus_per_node = 1", "gpus_per_node = 2");
    let six = ["model.layers=6"];
    let (spec, codes) = run(&text, &six);
    assert!(codes.is_empty(), "{codes:?}");
    assert_eq!(split(&spec.unwrap()), (Balance::Given, vec![1, 2, 2, 1]));
    let (spec, codes) = run(&text.replace("layers: [1, 2, 2, 1]", "balance: auto"), &six);
    assert!(codes.is_empty(), "{codes:?}");
    assert_eq!(split(&spec.unwrap()), (Balance::Auto, vec![2, 2, 1, 1]));
}

/// The help of the first `code` diagnostic of tiny.par under `sets`.
fn help_of(sets: &[&str], code: &str) -> String {
    help_in(&example("tiny.par"), sets, code)
}

/// The help of the first `code` diagnostic of the spec `text` under `sets`.
fn help_in(text: &str, sets: &[&str], code: &str) -> String {
    let mut sources = Sources::default();
    let main = sources.add("test.par", text.to_string());
    let overrides: Vec<Override> = sets.iter().map(|s| parse_override(s).unwrap()).collect();
    let (_, diags) = check(&mut sources, main, &overrides);
    let d = diags.items.iter().find(|d| d.code == code);
    let help = d.and_then(|d| d.help.clone());
    help.unwrap_or_else(|| panic!("no {code} with a help under {sets:?}: {:?}", diags.items))
}

/// Each pipeline-layers diagnostic's help leads to a spec that checks clean: the list it
/// suggests, or the setting it says to remove.
#[test]
fn pipeline_layer_helps_lead_to_specs_that_check() {
    let pp = |n: &'static str| [n, "cluster.gpus_per_node=2"];
    let [p2, g2] = pp("parallel.pp=2");
    let cases: [(&str, Vec<&str>); 4] = [
        ("E0409", vec![p2, g2, "parallel.layers=[2,1,1]"]),
        ("E0415", vec![p2, g2, "parallel.layers=[3,2]"]),
        ("E0416", vec![p2, g2, "parallel.layers=[4,0]"]),
        ("E0407", vec!["parallel.pp=3", "cluster.gpus_per_node=3"]),
    ];
    for (code, sets) in cases {
        let help = help_of(&sets, code);
        let list = help
            .split("`layers = ")
            .nth(1)
            .and_then(|rest| rest.split('`').next())
            .unwrap_or_else(|| panic!("{code}: no list in {help:?}"));
        let fixed = format!("parallel.layers={list}");
        let mut with = sets.clone();
        with.push(&fixed);
        tiny_with(&with);
    }
    // E0407 also offers `balance = auto`.
    assert!(
        help_of(&["parallel.pp=3", "cluster.gpus_per_node=3"], "E0407").contains("balance = auto")
    );
    tiny_with(&[
        "parallel.pp=3",
        "cluster.gpus_per_node=3",
        "parallel.balance=auto",
    ]);
    // E0417 (both written in the file): remove `balance`. Set by `--set`, one replaces the
    // other (they spell one choice), as a path set twice keeps the last.
    let both = example("tiny.par")
        .replace(
            "mesh = { dp: 1, pp: 1, cp: 1, tp: 1 }",
            "mesh = { dp: 1, pp: 2, cp: 1, tp: 1 }\n  pipeline = 1f1b { microbatches: 4, layers: [3, 1], balance: auto }",
        )
        .replace("gpus_per_node = 1", "gpus_per_node = 2");
    assert!(help_in(&both, &[], "E0417").contains("remove `balance`"));
    let removed = both.replace(", balance: auto", "");
    assert!(run(&removed, &[]).1.is_empty());
    let sets = [p2, g2, "parallel.layers=[3,1]", "parallel.balance=auto"];
    assert!(tiny_with(&sets).parallel.balance == Balance::Auto);
    // E0418: remove `layers`.
    let no_pipeline = ["parallel.layers=[2,2]"];
    assert!(help_of(&no_pipeline, "E0418").contains("remove `layers`"));
    tiny_with(&[]);
}

#[test]
fn an_override_replaces_the_whole_value_of_its_path() {
    // A choice by word drops the file's fields of the other choice (FEATURES writes
    // `fp16 { loss_scale: dynamic { … } }` and `linear { warmup, min_lr, decay_steps }`).
    let (spec, codes) = run(
        FEATURES,
        &[
            "train.precision=bf16",
            "train.schedule=cosine",
            "train.optimizer=adamw",
        ],
    );
    assert!(codes.is_empty(), "{codes:?}");
    let spec = spec.unwrap();
    assert_eq!(spec.train.precision, Precision::Bf16);
    assert!(matches!(
        spec.train.schedule,
        LrSchedule::Cosine {
            warmup: 0,
            decay_steps: 60,
            ..
        }
    ));
    // A mesh record is the whole mesh: the axes it leaves out are 1, its order is the ranks'.
    let spec = tiny_with(&[
        "parallel.dp=2",
        "parallel.mesh={tp: 2, dp: 2}",
        "cluster.gpus_per_node=4",
        "parallel.mesh={tp: 2}",
        "parallel.mesh={tp: 2, dp: 2}",
    ]);
    assert_eq!(spec.parallel.mesh.sizes(), (2, 1, 1, 2));
    assert_eq!(
        (
            spec.parallel.mesh.stride(Axis::Tp),
            spec.parallel.mesh.stride(Axis::Dp)
        ),
        (2, 1)
    );
    let (_, codes) = run(
        &example("tiny.par"),
        &[
            "parallel.dp=2",
            "parallel.mesh={tp: 2}",
            "cluster.gpus_per_node=2",
        ],
    );
    assert!(codes.iter().all(|c| c.starts_with('W')), "{codes:?}");
}

#[test]
fn an_unknown_choice_is_judged_alone() {
    // Its fields are not reported as another choice's (`constant` has no `min_lr`, …).
    for set in [
        "train.schedule=wsd { warmup: 10, min_lr: 0 }",
        "train.optimizer=lion { lr: 1e-4, momentum: 0.9 }",
        "train.precision=fp8 { loss_scale: 1024 }",
    ] {
        let (_, codes) = run(&example("tiny.par"), &[set]);
        assert_eq!(codes, ["E0904"], "{set}");
    }
}
