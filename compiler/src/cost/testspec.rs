//! Hand-built specs of any size for cost-model, verifier and timeline tests (the parser is not
//! needed): a GPT-2-style or Llama-style decoder with the given dimensions and plan.

use crate::diag::Span;
use crate::spec::*;

#[derive(Clone, Debug)]
pub struct Dims {
    pub vocab: u64,
    pub dim: u64,
    pub seq: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub ffn: u64,
    pub layers: u32,
    pub llama: bool,
    pub tied: bool,
}

impl Dims {
    pub fn tiny() -> Dims {
        Dims {
            vocab: 32,
            dim: 16,
            seq: 8,
            heads: 4,
            kv_heads: 4,
            ffn: 64,
            layers: 4,
            llama: false,
            tied: true,
        }
    }
    /// Llama-3-70B: 80 layers, d 8192, 64 heads, 8 kv heads, ffn 28672, vocab 128256.
    pub fn llama3_70b() -> Dims {
        Dims {
            vocab: 128256,
            dim: 8192,
            seq: 8192,
            heads: 64,
            kv_heads: 8,
            ffn: 28672,
            layers: 80,
            llama: true,
            tied: false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub dp: u32,
    pub pp: u32,
    pub cp: u32,
    pub tp: u32,
    pub zero: ZeroStage,
    pub schedule: PipelineSchedule,
    pub microbatches: u32,
    pub micro_batch: u64,
    pub recompute: Recompute,
    pub sp: bool,
    pub precision: Precision,
    pub gpus_per_node: u32,
}

impl Default for Plan {
    fn default() -> Plan {
        Plan {
            dp: 1,
            pp: 1,
            cp: 1,
            tp: 1,
            zero: ZeroStage::Zero0,
            schedule: PipelineSchedule::OneFOneB,
            microbatches: 4,
            micro_batch: 2,
            recompute: Recompute::None,
            sp: false,
            precision: Precision::Fp32,
            gpus_per_node: 8,
        }
    }
}

pub fn build(d: &Dims, plan: &Plan) -> Spec {
    let mut values: Vec<Value> = Vec::new();
    let mut nodes: Vec<Node> = Vec::new();
    let mut value = |name: &str, shape: Shape| {
        values.push(Value {
            name: name.to_string(),
            shape,
            span: Span::default(),
        });
        ValueId(values.len() as u32 - 1)
    };
    let tokens = value("tokens", Shape::Tokens);
    let targets = value("targets", Shape::Tokens);
    let mut node_values = Vec::new();
    let mut add = |name: String, kind: LayerKind, inputs: Vec<ValueId>, layer: Option<u32>| {
        let out = ValueId((2 + node_values.len()) as u32);
        node_values.push(name.clone());
        let recompute = match (&plan.recompute, &kind, layer) {
            (Recompute::Selective, LayerKind::Attention { .. }, _) => true,
            (Recompute::Full, _, Some(_)) => true,
            (Recompute::Named(names), k, _) => names.iter().any(|n| n == k.kind_name()),
            _ => false,
        };
        nodes.push(Node {
            name,
            kind,
            inputs,
            output: out,
            layer,
            recompute,
            span: Span::default(),
        });
        out
    };
    let dim = d.dim;
    let norm = || {
        if d.llama {
            LayerKind::RmsNorm { dim, eps: 1e-5 }
        } else {
            LayerKind::LayerNorm {
                dim,
                eps: 1e-5,
                bias: true,
            }
        }
    };
    let mut x = add(
        "embed".into(),
        LayerKind::Embedding {
            vocab: d.vocab,
            dim,
        },
        vec![tokens],
        None,
    );
    if !d.llama {
        x = add(
            "pos".into(),
            LayerKind::PositionEmbedding { seq: d.seq, dim },
            vec![x],
            None,
        );
    }
    for l in 0..d.layers {
        let p = format!("blocks.{l}");
        let a = add(format!("{p}.ln1"), norm(), vec![x], Some(l));
        let a = add(
            format!("{p}.attn"),
            LayerKind::Attention {
                dim,
                heads: d.heads,
                kv_heads: d.kv_heads,
                head_dim: dim / d.heads,
                causal: true,
                rope: d.llama.then_some(Rope { theta: 10000.0 }),
                bias: !d.llama,
            },
            vec![a],
            Some(l),
        );
        x = add(format!("{p}.add1"), LayerKind::Add, vec![x, a], Some(l));
        let m = add(format!("{p}.ln2"), norm(), vec![x], Some(l));
        let m = add(
            format!("{p}.mlp"),
            LayerKind::Mlp {
                dim,
                hidden: d.ffn,
                act: if d.llama {
                    Activation::Swiglu
                } else {
                    Activation::GeluTanh
                },
                bias: !d.llama,
            },
            vec![m],
            Some(l),
        );
        x = add(format!("{p}.add2"), LayerKind::Add, vec![x, m], Some(l));
    }
    let xf = add("ln_f".into(), norm(), vec![x], None);
    let logits = add(
        "head".into(),
        LayerKind::Linear {
            in_dim: dim,
            out_dim: d.vocab,
            bias: false,
            tied: d.tied.then_some(NodeId(0)),
        },
        vec![xf],
        None,
    );
    let loss = add(
        "loss".into(),
        LayerKind::CrossEntropy,
        vec![logits, targets],
        None,
    );
    for (i, name) in node_values.iter().enumerate() {
        let shape = if i + 1 == node_values.len() {
            Shape::Scalar
        } else if name == "head" {
            Shape::Hidden(d.vocab)
        } else {
            Shape::Hidden(dim)
        };
        value(name, shape);
    }
    let world = plan.dp * plan.pp * plan.cp * plan.tp;
    let gpn = plan.gpus_per_node.min(world).max(1);
    Spec {
        model: Model {
            name: "test".into(),
            span: Span::default(),
            seq: d.seq,
            vocab: d.vocab,
            dim,
            layers: d.layers,
            values,
            nodes,
            tokens,
            targets,
            loss,
            sharding: Sharding {
                attention_heads_on_tp: plan.tp > 1,
                mlp_hidden_on_tp: plan.tp > 1,
                vocab_on_tp: plan.tp > 1,
                seq_on_cp: plan.cp > 1,
                spans: Vec::new(),
            },
        },
        parallel: Parallel {
            mesh: Mesh {
                axes: vec![
                    (Axis::Dp, plan.dp),
                    (Axis::Pp, plan.pp),
                    (Axis::Cp, plan.cp),
                    (Axis::Tp, plan.tp),
                ],
            },
            zero: plan.zero,
            schedule: plan.schedule,
            microbatches: plan.microbatches,
            recompute: plan.recompute.clone(),
            sequence_parallel: plan.sp,
            bucket_bytes: 25 << 20,
            span: Span::new(crate::diag::FileId(0), 10, 20),
        },
        train: Train {
            global_batch: plan.micro_batch * u64::from(plan.microbatches) * u64::from(plan.dp),
            micro_batch: plan.micro_batch,
            precision: plan.precision,
            optimizer: Optimizer::AdamW {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            schedule: LrSchedule::Constant { warmup: 0 },
            grad_clip: Some(1.0),
            data: DataSource::Synthetic,
            steps: 5,
            seed: 0,
            checkpoint: None,
            log_every: 1,
            span: Span::default(),
        },
        cluster: Cluster {
            nodes: world.div_ceil(gpn),
            gpus_per_node: gpn,
            gpu: Gpu {
                name: "h100_80gb".into(),
                memory_bytes: 80 << 30,
                peak_flops: 989e12,
                peak_flops_fp32: 67e12,
                memory_bandwidth: 3.35e12,
            },
            intra: Link {
                kind: "nvlink".into(),
                bandwidth: 450e9,
                latency: 5e-6,
            },
            inter: Link {
                kind: "infiniband".into(),
                bandwidth: 50e9,
                latency: 1e-5,
            },
            span: Span::new(crate::diag::FileId(0), 30, 40),
        },
    }
}
