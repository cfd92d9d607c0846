//! What a checkpoint's shards hold of the model: for each rank, each tensor of its shard and the
//! global tensor it is a slice of (a parameter's values or one of its optimizer-state tensors,
//! through its tp block and ZeRO flat shard), with what else a plan change must keep: the
//! model's parameters and global shapes, the optimizer kind, the precision and the global batch.
//!
//! The manifest records the writing plan's [`Layout`]; resuming under another plan compares it
//! with the new plan's ([`Layout::refuse_change`]) and, when they agree, re-shards on load
//! (`super::reshard`). The layout is derived from the plan alone, the same way on the writing
//! and the reading side: the compiler's `LocalParam`s say which buffers hold a parameter
//! (master, optimizer state), its tp split and ZeRO split. Working copies are not checkpointed
//! (`Program::checkpointed`): a rank rebuilds them from the masters it loads.
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::{BufferKind, Plan, TpSplit};
use parc_compiler::spec::{Optimizer, Precision, Spec};
use serde::{Deserialize, Serialize};

/// Which global tensor of a parameter a shard tensor slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The parameter's values, as the optimizer keeps them (the master: authoritative).
    Master,
    /// A working copy (`LocalParam::working`), listed by checkpoints written before working
    /// copies were left out of them (they are rebuilt from the masters on load): never read.
    Working,
    /// Optimizer state tensor `k` (AdamW: 0 = m, 1 = v; SGD: 0 = momentum), shaped like the
    /// master.
    State(u32),
}

/// The tp block of a global tensor (`parc_compiler::ir::TpSplit`, recorded).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpPart {
    pub dim: u32,
    pub parts: u32,
    pub index: u32,
    pub sections: Option<[u64; 3]>,
}

impl TpPart {
    pub fn split(self) -> TpSplit {
        TpSplit {
            dim: self.dim,
            parts: self.parts,
            index: self.index,
            sections: self.sections,
        }
    }
}

/// A ZeRO flat shard of the (zero-padded) tp-local tensor: elements
/// `index · shard_len .. (index + 1) · shard_len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZeroPart {
    pub shard_len: u64,
    pub index: u64,
}

/// One tensor of a rank's shard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Piece {
    /// The tensor's name in the shard (the buffer's name in the rank's program).
    pub tensor: String,
    /// Its local shape.
    pub shape: Vec<u64>,
    /// The parameter it belongs to (by global name) and which of its tensors; None for a step
    /// metric, which every step zeroes and which a re-sharded load leaves zero, and for a
    /// delayed-scaling FP8 amax history (`BufferKind::Fp8History`), replicated on every rank
    /// of its stage: a re-sharded load copies it whole from the old shard holding that name,
    /// or leaves it zero where none does (a cold start: the next GEMM reading it runs
    /// unquantized, as on a run's first step).
    pub param: Option<String>,
    pub role: Option<Role>,
    pub tp: Option<TpPart>,
    pub zero: Option<ZeroPart>,
    /// A delayed-scaling FP8 amax history or scale amax (`param` None): the same tensor on
    /// every rank that holds its name, re-sharded whole by name.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replicated: bool,
}

/// A global parameter: name and global shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalParam {
    pub name: String,
    pub shape: Vec<u64>,
}

/// What the shards of one plan hold, and what must not change between plans.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    pub params: Vec<GlobalParam>,
    /// `adamw`, `sgd` or `sgd with momentum`: the optimizer state each parameter has.
    pub optimizer: String,
    /// `fp32`, `bf16` or `fp16`.
    pub precision: String,
    pub global_batch: u64,
    /// Each rank's shard, in rank order; each tensor in the shard's (buffer) order.
    pub ranks: Vec<Vec<Piece>>,
}

fn lowering_bug(rank: u32, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Op {
        op: format!("checkpoint layout of rank {rank}"),
        what: format!("{what} (a lowering bug)"),
    }
}

fn optimizer_kind(optimizer: &Optimizer) -> &'static str {
    match optimizer {
        Optimizer::AdamW { .. } => "adamw",
        Optimizer::Sgd { momentum, .. } if *momentum != 0.0 => "sgd with momentum",
        Optimizer::Sgd { .. } => "sgd",
    }
}

fn precision_name(precision: Precision) -> &'static str {
    match precision {
        Precision::Fp32 => "fp32",
        Precision::Bf16 => "bf16",
        Precision::Fp16 { .. } => "fp16",
    }
}

impl Layout {
    /// The layout of `plan`'s shards (lowered from `spec`).
    pub fn of(spec: &Spec, plan: &Plan) -> Result<Layout> {
        let ranks = (0..plan.world)
            .map(|rank| rank_pieces(plan, rank))
            .collect::<Result<_>>()?;
        Ok(Layout {
            params: plan
                .params
                .params
                .iter()
                .map(|p| GlobalParam {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                })
                .collect(),
            optimizer: optimizer_kind(&spec.train.optimizer).to_string(),
            precision: precision_name(spec.train.precision).to_string(),
            global_batch: spec.train.global_batch,
            ranks,
        })
    }

    pub fn world(&self) -> u32 {
        self.ranks.len() as u32
    }

    pub fn param(&self, name: &str) -> Option<&GlobalParam> {
        self.params.iter().find(|p| p.name == name)
    }

    /// Why a checkpoint of layout `self` cannot continue under `new`, naming the field that
    /// changed and what to do; None when it can (re-sharded on load). `any_batch`: the user
    /// consents to another global batch.
    pub fn refuse_change(&self, new: &Layout, any_batch: bool) -> Option<Refusal> {
        const SAME_MODEL: &str = "resume with the model that wrote it";
        for old in &self.params {
            match new.param(&old.name) {
                None => {
                    return Some(Refusal::model(
                        format!(
                            "parameter {} of the checkpoint is not in this model",
                            old.name
                        ),
                        SAME_MODEL,
                    ))
                }
                Some(p) if p.shape != old.shape => {
                    return Some(Refusal::model(
                        format!(
                            "parameter {} is {:?} in the checkpoint but {:?} in this model",
                            old.name, old.shape, p.shape
                        ),
                        SAME_MODEL,
                    ))
                }
                Some(_) => {}
            }
        }
        if let Some(extra) = new.params.iter().find(|p| self.param(&p.name).is_none()) {
            return Some(Refusal::model(
                format!(
                    "parameter {} of this model is not in the checkpoint",
                    extra.name
                ),
                SAME_MODEL,
            ));
        }
        if self.optimizer != new.optimizer {
            return Some(Refusal {
                code: "E1102",
                field: "train.optimizer",
                message: format!(
                    "the checkpoint's optimizer is {} but this run's is {}: its state cannot \
                     carry over",
                    self.optimizer, new.optimizer
                ),
                help: format!(
                    "set train.optimizer to {} (its settings such as lr may change)",
                    self.optimizer
                ),
            });
        }
        if self.precision != new.precision {
            return Some(Refusal {
                code: "E1103",
                field: "train.precision",
                message: format!(
                    "the checkpoint was written at precision {} but this run's is {}: a change \
                     of precision would drop or invent state (the fp16 loss scaler, bf16-rounded \
                     working copies)",
                    self.precision, new.precision
                ),
                help: format!("set train.precision = {}", self.precision),
            });
        }
        if self.global_batch != new.global_batch && !any_batch {
            return Some(Refusal {
                code: "E1104",
                field: "train.global_batch",
                message: format!(
                    "the checkpoint's global batch is {} sequences but this run's is {}: the \
                     data order and the optimizer's trajectory would change",
                    self.global_batch, new.global_batch
                ),
                help: format!(
                    "set train.global_batch = {} (dp, tp, pp, cp, ZeRO and the micro-batch \
                     split may change), or let `parc run --resume-any-batch` continue the data \
                     order at the samples the checkpoint had seen",
                    self.global_batch
                ),
            });
        }
        None
    }
}

/// A plan change a checkpoint cannot follow: the diagnostic code (`docs/diagnostics.md`), the
/// spec field that changed, what is wrong and what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: &'static str,
    pub field: &'static str,
    pub message: String,
    pub help: String,
}

impl Refusal {
    fn model(message: String, help: &str) -> Refusal {
        Refusal {
            code: "E1101",
            field: "model",
            message,
            help: help.to_string(),
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}; {}",
            self.code, self.field, self.message, self.help
        )
    }
}

/// The pieces of `rank`'s shard: every buffer its program checkpoints (`Program::checkpointed`:
/// the persistent ones but working copies), in buffer order.
fn rank_pieces(plan: &Plan, rank: u32) -> Result<Vec<Piece>> {
    let program = plan
        .program_of(rank)
        .ok_or_else(|| lowering_bug(rank, "it has no program"))?;
    let mut pieces: Vec<Piece> = program
        .checkpointed()
        .map(|(_, b)| Piece {
            tensor: b.name.clone(),
            shape: b.shape.clone(),
            param: None,
            role: None,
            tp: None,
            zero: None,
            replicated: b.kind == BufferKind::Fp8History,
        })
        .collect();
    for local in &program.params {
        let param = plan
            .params
            .params
            .get(local.param.0 as usize)
            .ok_or_else(|| lowering_bug(rank, format!("param {} is unknown", local.param.0)))?;
        let zero = match local.zero {
            None => None,
            Some(split) => Some(ZeroPart {
                shard_len: split.shard_len,
                index: plan.zero_index(&split, rank).ok_or_else(|| {
                    lowering_bug(rank, format!("it is not in ZeRO group {}", split.group.0))
                })?,
            }),
        };
        let tp = local.tp.map(|t| TpPart {
            dim: t.dim,
            parts: t.parts,
            index: t.index,
            sections: t.sections,
        });
        let mut roles = vec![(local.master, Role::Master, zero)];
        roles.extend(
            local
                .state
                .iter()
                .enumerate()
                .map(|(k, &s)| (s, Role::State(k as u32), zero)),
        );
        for (id, role, zero) in roles {
            let buffer = program
                .buffer(id)
                .ok_or_else(|| lowering_bug(rank, format!("buffer {} is unknown", id.0)))?;
            let piece = pieces
                .iter_mut()
                .find(|p| p.tensor == buffer.name)
                .ok_or_else(|| {
                    lowering_bug(rank, format!("buffer {} is not persistent", buffer.name))
                })?;
            piece.param = Some(param.name.clone());
            piece.role = Some(role);
            piece.tp = tp;
            piece.zero = zero;
        }
    }
    let persistent_kinds = program.checkpointed().map(|(_, b)| b.kind);
    for (piece, kind) in pieces.iter().zip(persistent_kinds) {
        if piece.param.is_none() && !matches!(kind, BufferKind::Metric | BufferKind::Fp8History) {
            return Err(lowering_bug(
                rank,
                format!(
                    "persistent buffer {} belongs to no parameter and is no metric or FP8 amax history",
                    piece.tensor
                ),
            ));
        }
    }
    Ok(pieces)
}
