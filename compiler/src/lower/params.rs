//! The global parameter table: every parameter of every node, its name, global shape,
//! initialisation, weight decay and how tensor parallelism splits it.
//!
//! Names are `node.local`: `embed.weight`, `blocks.3.attn.wqkv`, `blocks.3.mlp.proj_bias`.
//! Initialisation follows GPT-2: weights N(0, 0.02), the residual output projections (`wo`,
//! `proj`, `down`) N(0, 0.02/√(2·layers)), biases zeros, norm weights ones. Weight decay applies
//! to 2-D tensors only. A tied `Linear` owns no weight: it reuses its Embedding's.
//!
//! Tensor-parallel splits (Megatron): the fused q/k/v weight and bias (rows: every q head, then
//! every k head, then every v head) are column-parallel per section, MLP fc/gate/up and their
//! biases column-parallel (split dim 0), `wo`/`proj`/`down` row-parallel (split dim 1), the
//! embedding and a vocab-sized head vocab-parallel (dim 0). Everything else is replicated;
//! the per-head q/k norm weights (`q_norm`, `k_norm`: `[head_dim]`, ones) too, with their
//! gradients all-reduced over tp since each rank applies them to its own heads only.

use crate::ir::{Init, Param, ParamId, ParamTable};
use crate::spec::{LayerKind, Node, NodeId, Sharding, Spec};

/// How tp splits a parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpRule {
    Replicated,
    /// Column-parallel or vocab-parallel: split along dim 0.
    Rows,
    /// A fused column-parallel projection: dim 0 is these consecutive sections (q, k, v
    /// rows), each split along dim 0, so every rank holds its own heads of each.
    RowSections([u64; 3]),
    /// Row-parallel weight: split along dim 1.
    Cols,
    /// The bias of a row-parallel linear: replicated, added by tp rank 0 only before the
    /// reduction, so its gradient lives on tp rank 0 and is all-reduced over tp.
    RowParallelBias,
    /// A weight shared by every attention head (the per-head q/k norms): replicated, but each
    /// tp rank applies it to its own heads, so each holds a partial gradient, all-reduced
    /// over tp.
    PerHead,
}

#[derive(Clone, Debug)]
pub struct Slot {
    pub local: &'static str,
    pub param: ParamId,
    pub rule: TpRule,
}

/// The parameter table and, per node, its parameters by local name.
pub struct Params {
    pub table: ParamTable,
    pub by_node: Vec<Vec<Slot>>,
}

impl Params {
    pub fn get(&self, node: NodeId, local: &str) -> Option<&Slot> {
        self.by_node
            .get(node.0 as usize)?
            .iter()
            .find(|s| s.local == local)
    }
    pub fn slots(&self, node: NodeId) -> &[Slot] {
        self.by_node
            .get(node.0 as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }
}

struct TableBuilder<'a> {
    table: ParamTable,
    node: &'a Node,
    node_id: NodeId,
    slots: Vec<Slot>,
}

impl TableBuilder<'_> {
    fn add(&mut self, local: &'static str, shape: Vec<u64>, init: Init, rule: TpRule) {
        let id = ParamId(self.table.params.len() as u32);
        let decay = shape.len() == 2;
        self.table.params.push(Param {
            name: format!("{}.{}", self.node.name, local),
            shape,
            init,
            decay,
            node: self.node_id,
        });
        self.slots.push(Slot {
            local,
            param: id,
            rule,
        });
    }
}

const STD: f64 = 0.02;

/// One parameter a node declares: its local name, global shape, initialisation and tp split.
pub(crate) struct Declared {
    pub local: &'static str,
    pub shape: Vec<u64>,
    pub init: Init,
    pub rule: TpRule,
}

impl Declared {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// The declarations of one node, in table order.
struct Declarations(Vec<Declared>);

impl Declarations {
    fn add(&mut self, local: &'static str, shape: Vec<u64>, init: Init, rule: TpRule) {
        self.0.push(Declared {
            local,
            shape,
            init,
            rule,
        });
    }
}

/// The parameters a node of `kind` owns in `spec`, in table order (see the module docs; a
/// tied head owns none).
pub(crate) fn declared(spec: &Spec, kind: &LayerKind) -> Vec<Declared> {
    let layers = spec.model.layers.max(1) as f64;
    let residual_std = STD / (2.0 * layers).sqrt();
    let sh: &Sharding = &spec.model.sharding;
    let normal = Init::Normal { std: STD };
    let col = |on: bool| if on { TpRule::Rows } else { TpRule::Replicated };
    let row = |on: bool| if on { TpRule::Cols } else { TpRule::Replicated };
    let row_bias = |on: bool| {
        if on {
            TpRule::RowParallelBias
        } else {
            TpRule::Replicated
        }
    };
    let mut d = Declarations(Vec::new());
    match kind {
        LayerKind::Embedding { vocab, dim } => {
            d.add("weight", vec![*vocab, *dim], normal, col(sh.vocab_on_tp));
        }
        LayerKind::PositionEmbedding { seq, dim } => {
            d.add("weight", vec![*seq, *dim], normal, TpRule::Replicated);
        }
        LayerKind::LayerNorm { dim, bias, .. } => {
            d.add("weight", vec![*dim], Init::Ones, TpRule::Replicated);
            if *bias {
                d.add("bias", vec![*dim], Init::Zeros, TpRule::Replicated);
            }
        }
        LayerKind::RmsNorm { dim, .. } => {
            d.add("weight", vec![*dim], Init::Ones, TpRule::Replicated);
        }
        LayerKind::Linear {
            in_dim,
            out_dim,
            bias,
            tied,
        } => {
            let on = sh.vocab_on_tp && *out_dim == spec.model.vocab;
            if tied.is_none() {
                d.add("weight", vec![*out_dim, *in_dim], normal, col(on));
            }
            if *bias {
                d.add("bias", vec![*out_dim], Init::Zeros, col(on));
            }
        }
        LayerKind::Attention {
            dim,
            heads,
            kv_heads,
            head_dim,
            qkv_bias,
            out_bias,
            qk_norm,
            ..
        } => {
            let on = sh.attention_heads_on_tp;
            let q = heads * head_dim;
            let kv = kv_heads * head_dim;
            // One fused projection (GPT-2's c_attn): rows q, then k, then v.
            let qkv = if on {
                TpRule::RowSections([q, kv, kv])
            } else {
                TpRule::Replicated
            };
            d.add("wqkv", vec![q + 2 * kv, *dim], normal, qkv);
            if *qkv_bias {
                d.add("bqkv", vec![q + 2 * kv], Init::Zeros, qkv);
            }
            if qk_norm.is_some() {
                let per_head = if on {
                    TpRule::PerHead
                } else {
                    TpRule::Replicated
                };
                d.add("q_norm", vec![*head_dim], Init::Ones, per_head);
                d.add("k_norm", vec![*head_dim], Init::Ones, per_head);
            }
            let wo_init = Init::Normal { std: residual_std };
            d.add("wo", vec![*dim, q], wo_init, row(on));
            if *out_bias {
                d.add("bo", vec![*dim], Init::Zeros, row_bias(on));
            }
        }
        LayerKind::Mlp {
            dim,
            hidden,
            act,
            bias,
        } => {
            let on = sh.mlp_hidden_on_tp;
            let out_init = Init::Normal { std: residual_std };
            if act.is_gated() {
                d.add("gate", vec![*hidden, *dim], normal, col(on));
                d.add("up", vec![*hidden, *dim], normal, col(on));
                d.add("down", vec![*dim, *hidden], out_init, row(on));
            } else {
                d.add("fc", vec![*hidden, *dim], normal, col(on));
                if *bias {
                    d.add("fc_bias", vec![*hidden], Init::Zeros, col(on));
                }
                d.add("proj", vec![*dim, *hidden], out_init, row(on));
                if *bias {
                    d.add("proj_bias", vec![*dim], Init::Zeros, row_bias(on));
                }
            }
        }
        LayerKind::Add | LayerKind::Elementwise { .. } | LayerKind::CrossEntropy => {}
    }
    d.0
}

pub fn build(spec: &Spec) -> Params {
    let mut table = ParamTable::default();
    let mut by_node: Vec<Vec<Slot>> = Vec::new();
    for (i, node) in spec.model.nodes.iter().enumerate() {
        let mut b = TableBuilder {
            table,
            node,
            node_id: NodeId(i as u32),
            slots: Vec::new(),
        };
        for d in declared(spec, &node.kind) {
            b.add(d.local, d.shape, d.init, d.rule);
        }
        table = b.table;
        by_node.push(b.slots);
    }
    // Tied linears reuse their embedding's weight slot.
    for (i, node) in spec.model.nodes.iter().enumerate() {
        if let LayerKind::Linear {
            tied: Some(owner), ..
        } = &node.kind
        {
            let owner_slot = by_node
                .get(owner.0 as usize)
                .and_then(|slots| slots.iter().find(|s| s.local == "weight"))
                .cloned();
            if let (Some(slot), Some(slots)) = (owner_slot, by_node.get_mut(i)) {
                slots.insert(0, slot);
            }
        }
    }
    Params { table, by_node }
}
