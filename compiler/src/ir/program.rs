//! The structure of a lowered plan: the parameter table, process groups, and one [`Program`]
//! (buffers + straight-line instructions) per distinct rank role. This is everything the
//! executor needs; it contains no parallelism logic of its own.
//!
//! One step of training on rank `r` = run `plan.programs[plan.rank_program[r]].instrs` once, in
//! order. Conventions every consumer relies on:
//!
//! - **Sharing.** Ranks that differ only in their dp coordinate share one program, so nothing in
//!   a program names a global rank: collectives name a [`Group`] family (the calling rank's set
//!   in it is meant), point-to-point transfers name a [`Peer`] (the rank with the caller's
//!   coordinates except one axis), and ZeRO shard indices are the caller's index in a group.
//! - **Lifetimes.** Buffers whose [`BufferKind::is_persistent`] is true (parameters, optimizer
//!   state, metrics) are allocated by the executor once, before the first step (parameters
//!   initialised as [`LocalParam`] says, optimizer state and metrics zeroed), and live across
//!   steps; the instructions never `Alloc`/`Free` them. Every other buffer is created by an
//!   [`Instr::Alloc`] (zero-filled) and destroyed by an [`Instr::Free`] within the same step, so
//!   a step starts and ends with only the persistent buffers alive.
//! - **Shapes** are local (already sharded). Token buffers are `[local_seq, micro_batch]` i32,
//!   sequence-major (row `s * batch + b`); activations `[local_seq * micro_batch, cols]`.
//! - **Collectives** are collective over the caller's set in the named group family, ranks in
//!   group-rank order (ascending global rank). All-gather concatenates the members' inputs along
//!   the first dimension in group-rank order (output = n × input elements); reduce-scatter sums
//!   the members' inputs and gives member `i` the `i`-th of n equal contiguous chunks (input =
//!   n × output elements); all-reduce and broadcast keep the shape and may be in place
//!   (`input == output`). Reductions add in group-rank order, so every member gets bit-identical
//!   results.
//! - **Point-to-point** transfers have rendezvous semantics: a `Send` completes with the matching
//!   `Recv` (same peer pair and tag). [`Instr::P2p`] issues several at once and completes when all
//!   of them have (NCCL group semantics); lowering uses it where two stages exchange in both
//!   directions, so no program can deadlock.
//! - **Parameter layout.** A global parameter (see [`ParamTable`]) is first split over tp by
//!   [`TpSplit`] (contiguous blocks along one dimension; block `index` of `parts`, or that block
//!   of each of a fused projection's sections), giving the *tp-local tensor*. Under ZeRO ≥ 1 that tensor is flattened (row-major) and padded with zeros
//!   to `parts * shard_len` elements, `shard_len = ceil(numel / parts)`; the caller's shard is
//!   flat elements `[i * shard_len, (i + 1) * shard_len)` where `i` is its index in the
//!   [`ZeroSplit::group`] set. Elements past `numel` are padding: initialised to zero and never
//!   read back into the tensor.
//! - **Metrics.** On [`Plan::report_rank`]'s program, `loss` holds the step's loss (the mean token
//!   cross-entropy over the global batch, already reduced) and `grad_sumsq` the squared global
//!   gradient norm (before clipping) after the step; every rank's program that has them holds the
//!   same values.

use super::op::{Op, Segment};
use super::operands::{Inputs, Outputs};
use super::{BufferId, DType};
use crate::spec::{Axis, Mesh, NodeId};
use serde::{Serialize, Serializer};
use std::sync::Arc;

/// Index into [`ParamTable::params`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct ParamId(pub u32);

/// Index into [`Plan::programs`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct ProgramId(pub u32);

/// Index into [`Plan::groups`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct GroupId(pub u32);

/// A lowered plan: every rank's program for one training step.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub world: u32,
    pub mesh: Mesh,
    /// Sequences per microbatch per data-parallel rank.
    pub micro_batch: u64,
    /// Microbatches per step per data-parallel rank.
    pub microbatches: u32,
    /// Global sequence length.
    pub seq: u64,
    pub params: ParamTable,
    pub groups: Vec<Group>,
    pub programs: Vec<Program>,
    /// Rank → its program.
    pub rank_program: Vec<ProgramId>,
    /// The rank whose `loss` and `grad_sumsq` buffers the executor reports.
    pub report_rank: u32,
    /// An analysis plan: one program per class of roles (`lower::LowerOptions::representatives`),
    /// so ranks with tp or cp index ≥ 2 run their class's program, whose shard offsets are
    /// those of index 1. Verified, planned and simulated like any plan; never run.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub representative: bool,
    /// With `train.eval`: each program's evaluation step, at its program's index (rank `r`
    /// evaluates with `eval[rank_program[r]]`); empty without evaluation and in an analysis
    /// plan. An evaluation program is its training program's forward through the loss and
    /// nothing after it (no backward, gradient reduction or optimizer), for one global batch
    /// of evaluation data (its `LoadBatch`es read the evaluation set), leaving the batch's loss
    /// in the same `loss` metric. Its buffer table begins with its training program's whole
    /// table, so the two share every parameter and metric, and one memory layout planned over
    /// both steps ([`Program::followed_by`]) serves both. It writes no persistent buffer but
    /// `loss`. Not serialized: the plan's JSON and a checkpoint's plan hash describe the
    /// training step, so a run may add or change evaluation and resume the same checkpoints.
    #[serde(skip)]
    pub eval: Vec<Program>,
}

/// Every global parameter of the model, in node order.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ParamTable {
    pub params: Vec<Param>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Param {
    /// `node name . local name`, e.g. `blocks.3.attn.wqkv`.
    pub name: String,
    /// Global shape, e.g. `[out, in]` for a linear weight.
    pub shape: Vec<u64>,
    pub init: Init,
    /// Whether weight decay applies (2-D weights only).
    pub decay: bool,
    /// The spec node that owns it (for diagnostics).
    pub node: NodeId,
}

/// How the runtime initialises a parameter. Element `i` (global row-major flat index) of
/// parameter `p` under seed `s` is a pure function of `(s, p, i)`, so any shard can be
/// generated alone and equals the slice of the full tensor.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Init {
    Normal { std: f64 },
    Zeros,
    Ones,
}

/// A family of disjoint process groups of one kind, e.g. `tp`: one set per combination of the
/// other coordinates. A collective naming this family runs over the caller's set.
#[derive(Clone, Debug, Serialize)]
pub struct Group {
    /// Short name used in the text form (`tp`, `dp`, `dp+cp`, `embed`, …).
    pub name: String,
    /// The mesh axes the sets span (the `embed` family spans pp but holds only the first and
    /// last stage).
    pub axes: Vec<Axis>,
    /// The sets, each in group-rank order (ascending global rank).
    pub sets: Vec<Vec<u32>>,
}

impl Group {
    /// The caller's set and its index in it, if `rank` belongs to this family.
    pub fn set_of(&self, rank: u32) -> Option<(&[u32], usize)> {
        self.sets.iter().find_map(|set| {
            set.iter()
                .position(|&r| r == rank)
                .map(|i| (set.as_slice(), i))
        })
    }
}

/// The rank with the caller's coordinates on every axis except `axis`, where it has `coord`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Peer {
    pub axis: Axis,
    pub coord: u32,
}

impl Plan {
    /// Instructions over all its programs.
    pub fn instructions(&self) -> usize {
        self.programs.iter().map(|p| p.instrs.len()).sum()
    }

    /// The plan's fields without its programs and rank map (for a view holding some of them).
    pub fn header(&self) -> Plan {
        Plan {
            world: self.world,
            mesh: self.mesh.clone(),
            micro_batch: self.micro_batch,
            microbatches: self.microbatches,
            seq: self.seq,
            params: self.params.clone(),
            groups: self.groups.clone(),
            programs: Vec::new(),
            rank_program: Vec::new(),
            report_rank: self.report_rank,
            representative: self.representative,
            eval: Vec::new(),
        }
    }

    /// The evaluation steps as a plan of their own (each rank's evaluation program in its
    /// training program's place), for the verifier; `None` without evaluation.
    pub fn eval_plan(&self) -> Option<Plan> {
        (!self.eval.is_empty()).then(|| Plan {
            programs: self.eval.clone(),
            rank_program: self.rank_program.clone(),
            ..self.header()
        })
    }

    /// Rank `rank`'s evaluation program, when the plan evaluates.
    pub fn eval_of(&self, rank: u32) -> Option<&Program> {
        let id = self.rank_program.get(rank as usize)?;
        self.eval.get(id.0 as usize)
    }

    /// Global rank of `peer` as seen from `rank`.
    pub fn peer_rank(&self, rank: u32, peer: Peer) -> u32 {
        let own = self.mesh.coord(rank, peer.axis);
        rank - own * self.mesh.stride(peer.axis) + peer.coord * self.mesh.stride(peer.axis)
    }
    pub fn program_of(&self, rank: u32) -> Option<&Program> {
        let id = self.rank_program.get(rank as usize)?;
        self.programs.get(id.0 as usize)
    }
    pub fn group(&self, id: GroupId) -> Option<&Group> {
        self.groups.get(id.0 as usize)
    }
    /// Which shard of `split` `rank` holds (its index in the ZeRO group); None when `rank` is
    /// not in the group.
    pub fn zero_index(&self, split: &ZeroSplit, rank: u32) -> Option<u64> {
        let (_, index) = self.group(split.group)?.set_of(rank)?;
        Some(index as u64)
    }
    /// Ranks that run `program`, ascending.
    pub fn ranks_of(&self, program: ProgramId) -> Vec<u32> {
        (0..self.world)
            .filter(|&r| self.rank_program.get(r as usize) == Some(&program))
            .collect()
    }
}

/// The instructions of one rank role and the buffers they use.
#[derive(Clone, Debug, Serialize)]
pub struct Program {
    /// What this program is: its coordinates on pp, cp and tp (dp is shared), e.g.
    /// `pp 1 cp 0 tp 1`.
    pub role: String,
    /// Coordinate on each mesh axis except dp (dp ranks share the program).
    pub coords: Vec<(Axis, u32)>,
    pub buffers: Vec<Buffer>,
    /// The parameters this program holds, with their local layout.
    pub params: Vec<LocalParam>,
    pub instrs: Vec<Instr>,
    /// Persistent `[1]` buffer holding the step's global mean loss (last pipeline stage).
    pub loss: Option<BufferId>,
    /// Persistent `[1]` buffer holding the squared global gradient norm.
    pub grad_sumsq: Option<BufferId>,
}

impl Program {
    /// A program of `buffers` and `instrs` with no mesh coordinates, parameters, loss or
    /// gradient-norm buffer: for programs written by hand (tests, tools).
    pub fn new(role: &str, buffers: Vec<Buffer>, instrs: Vec<Instr>) -> Program {
        Program {
            role: role.into(),
            coords: Vec::new(),
            buffers,
            params: Vec::new(),
            instrs,
            loss: None,
            grad_sumsq: None,
        }
    }

    pub fn buffer(&self, id: BufferId) -> Option<&Buffer> {
        self.buffers.get(id.0 as usize)
    }

    /// The persistent buffers a checkpoint holds, in buffer order: all but the parameters'
    /// working copies, which are their masters' values (rounded to bf16 where they are bf16,
    /// gathered from the ZeRO shards) and so are rebuilt from them on load.
    pub fn checkpointed(&self) -> impl Iterator<Item = (BufferId, &Buffer)> {
        let working: std::collections::HashSet<BufferId> =
            self.params.iter().filter_map(|l| l.working).collect();
        (self.buffers.iter().enumerate())
            .map(|(i, b)| (BufferId(i as u32), b))
            .filter(move |(id, b)| b.kind.is_persistent() && !working.contains(id))
    }

    /// Whether any buffer is stored in bf16.
    pub fn uses_bf16(&self) -> bool {
        self.buffers.iter().any(|b| b.dtype == DType::Bf16)
    }
    /// This program with its bf16 buffers stored in f32: the same computation without the
    /// rounding on write, for a backend that does not store bf16 (`Backend::stores_bf16`).
    pub fn with_f32_storage(&self) -> Program {
        let mut program = self.clone();
        for b in &mut program.buffers {
            if b.dtype == DType::Bf16 {
                b.dtype = DType::F32;
            }
        }
        program
    }
    /// This program's step followed by `next`'s, as one program over `next`'s buffers, which
    /// must begin with this program's whole table (an evaluation program's do, see
    /// [`Plan::eval`]): its memory plan is one layout both steps run in. Its parameters and
    /// metrics are this program's.
    pub fn followed_by(&self, next: &Program) -> Result<Program, String> {
        if next.buffers.get(..self.buffers.len()) != Some(self.buffers.as_slice()) {
            return Err(format!(
                "the buffers of `{}` do not begin with those of `{}`",
                next.role, self.role
            ));
        }
        Ok(Program {
            role: self.role.clone(),
            coords: self.coords.clone(),
            buffers: next.buffers.clone(),
            params: self.params.clone(),
            instrs: self.instrs.iter().chain(&next.instrs).cloned().collect(),
            loss: self.loss,
            grad_sumsq: self.grad_sumsq,
        })
    }

    /// Each compute instruction's index in [`Program::instrs`] and its parts, in order.
    pub fn computes(&self) -> impl Iterator<Item = (usize, Compute<'_>)> {
        self.instrs
            .iter()
            .enumerate()
            .filter_map(|(i, instr)| Some((i, instr.as_compute()?)))
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Buffer {
    /// Readable name, unique within the program (`blocks.0.attn.q@mb2`).
    pub name: String,
    /// Local shape.
    pub shape: Vec<u64>,
    pub dtype: DType,
    pub kind: BufferKind,
}

impl Buffer {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> u64 {
        self.numel() * self.dtype.bytes()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferKind {
    /// A parameter tensor the compute ops read (tp-local; or a ZeRO master shard). Persistent.
    Param,
    /// Optimizer state (Adam m/v, SGD momentum), shaped like the master it belongs to. Persistent.
    OptState,
    /// Step metrics (loss, squared grad norm). Persistent; zeroed by the program each step.
    Metric,
    /// Delayed FP8 scaling's amax histories and scale amaxes, one pair per quantized operand
    /// of each FP8 GEMM (`ir::fp8`). Persistent, checkpointed, zero at the start of a run.
    Fp8History,
    /// A ZeRO-3 parameter all-gathered for use and freed after.
    GatheredParam,
    /// Gradient accumulators and sharded gradients.
    Grad,
    /// Forward activations and what backward keeps of them.
    Activation,
    /// Gradients of activations.
    ActivationGrad,
    /// Token ids and targets loaded by `LoadBatch`.
    Input,
    /// Staging buffers for collectives (buckets, padded flat copies, reduction scalars).
    Comm,
}

impl BufferKind {
    /// Allocated once by the executor and live across steps (never `Alloc`/`Free`d).
    pub fn is_persistent(self) -> bool {
        matches!(
            self,
            BufferKind::Param | BufferKind::OptState | BufferKind::Metric | BufferKind::Fp8History
        )
    }
    pub fn name(self) -> &'static str {
        match self {
            BufferKind::Param => "param",
            BufferKind::OptState => "opt_state",
            BufferKind::Metric => "metric",
            BufferKind::Fp8History => "fp8_history",
            BufferKind::GatheredParam => "gathered_param",
            BufferKind::Grad => "grad",
            BufferKind::Activation => "act",
            BufferKind::ActivationGrad => "act_grad",
            BufferKind::Input => "input",
            BufferKind::Comm => "comm",
        }
    }

    /// What the kind holds, in words for reports (`optimizer state`).
    pub fn description(self) -> &'static str {
        match self {
            BufferKind::Param => "parameters",
            BufferKind::OptState => "optimizer state",
            BufferKind::Metric => "metrics",
            BufferKind::Fp8History => "FP8 amax histories",
            BufferKind::GatheredParam => "gathered weights",
            BufferKind::Grad => "gradients",
            BufferKind::Activation => "activations",
            BufferKind::ActivationGrad => "activation gradients",
            BufferKind::Input => "batch inputs",
            BufferKind::Comm => "communication buffers",
        }
    }

    /// Every kind, in declaration order.
    pub const ALL: [BufferKind; 10] = [
        BufferKind::Param,
        BufferKind::OptState,
        BufferKind::Metric,
        BufferKind::Fp8History,
        BufferKind::GatheredParam,
        BufferKind::Grad,
        BufferKind::Activation,
        BufferKind::ActivationGrad,
        BufferKind::Input,
        BufferKind::Comm,
    ];

    /// The kind whose [`BufferKind::name`] is `name`.
    pub fn from_name(name: &str) -> Option<BufferKind> {
        BufferKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// A parameter held by a program and how its local elements map to the global tensor.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LocalParam {
    pub param: ParamId,
    /// The tensor the optimizer updates (persistent): the full tp-local tensor without ZeRO, the
    /// flat padded `[shard_len]` shard with ZeRO ≥ 1.
    pub master: BufferId,
    /// A persistent full tp-local copy the compute ops read, refreshed from the master after
    /// the optimizer (by all-gather under ZeRO-1/2, by a rounding copy without shards): under
    /// ZeRO-1/2, and in a bf16 run for every weight matrix, which it holds in bf16. Elsewhere
    /// the master is that copy, and ZeRO-3 gathers its shards per use into a transient buffer.
    pub working: Option<BufferId>,
    /// Optimizer state buffers, shaped like `master` (AdamW: m, v; SGD: momentum or none).
    pub state: Vec<BufferId>,
    /// The tp split of the global tensor, if any.
    pub tp: Option<TpSplit>,
    /// The ZeRO flat split of the tp-local tensor, if any.
    pub zero: Option<ZeroSplit>,
}

/// Block `index` of `parts` equal contiguous blocks along dimension `dim` of the global tensor;
/// or, with `sections`, dimension `dim` is that many consecutive sections of these extents (a
/// fused q/k/v projection's q rows, k rows, v rows) and the tp-local tensor is block `index` of
/// `parts` of each section, concatenated in section order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TpSplit {
    pub dim: u32,
    pub parts: u32,
    pub index: u32,
    pub sections: Option<[u64; 3]>,
}

/// Flat split of the tp-local tensor: `parts` shards of `shard_len` elements (the last padded);
/// the caller's shard index is its index in its set of `group`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ZeroSplit {
    pub parts: u32,
    pub shard_len: u64,
    pub group: GroupId,
}

/// What a compute instruction belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Forward,
    Backward,
    /// Forward ops re-run in backward to rebuild freed activations.
    Recompute,
    Optimizer,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "fwd",
            Phase::Backward => "bwd",
            Phase::Recompute => "recompute",
            Phase::Optimizer => "opt",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ReduceOp {
    Sum,
    Max,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum CollectiveKind {
    AllReduce {
        op: ReduceOp,
    },
    AllGather,
    ReduceScatter,
    /// From the member with group-rank index `root`.
    Broadcast {
        root: u32,
    },
}

/// One send or receive inside an [`Instr::P2p`] group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "dir")]
pub enum P2pOp {
    Send {
        peer: Peer,
        buffer: BufferId,
        tag: u32,
    },
    Recv {
        peer: Peer,
        buffer: BufferId,
        tag: u32,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "instr")]
pub enum Instr {
    /// A compute op on local buffers; `inputs`/`outputs` follow the op's documented order.
    /// The op is behind a shared pointer so instructions stay small (most are `Alloc`/`Free`)
    /// and equal ops (the same layer shape in every microbatch) share one allocation.
    Compute {
        #[serde(serialize_with = "serialize_shared_op")]
        op: Arc<Op>,
        inputs: Inputs,
        outputs: Outputs,
        /// The spec node this op implements (None for optimizer bookkeeping).
        node: Option<NodeId>,
        phase: Phase,
    },
    /// A collective over the caller's set of `group` (see the module header for shapes).
    Collective {
        kind: CollectiveKind,
        group: GroupId,
        input: BufferId,
        output: BufferId,
        node: Option<NodeId>,
    },
    /// Blocking send of `buffer` to `peer` (completes with the matching `Recv`).
    Send {
        peer: Peer,
        buffer: BufferId,
        tag: u32,
    },
    /// Blocking receive into `buffer` from `peer`.
    Recv {
        peer: Peer,
        buffer: BufferId,
        tag: u32,
    },
    /// Several sends/receives issued together; completes when all have.
    P2p { ops: Vec<P2pOp> },
    /// Fill `tokens` / `targets` (`[segments_len(positions), micro_batch]` i32, sequence-major)
    /// with this dp rank's microbatch `microbatch` of the step, at the global sequence
    /// `positions` (context parallelism loads two segments). Targets are the tokens shifted by
    /// one (the sampler's `seq + 1` windows).
    LoadBatch {
        microbatch: u32,
        positions: Vec<Segment>,
        tokens: Option<BufferId>,
        targets: Option<BufferId>,
    },
    /// Create a zero-filled transient buffer. (A backend may skip the fill where no
    /// instruction can see it: `memplan::zero_needs`.)
    Alloc { buffer: BufferId },
    /// Destroy a transient buffer.
    Free { buffer: BufferId },
}

/// An [`Instr::Compute`]'s parts, borrowed ([`Instr::as_compute`], [`Program::computes`]), for
/// code that reads compute instructions and passes over the rest.
#[derive(Clone, Copy, Debug)]
pub struct Compute<'a> {
    pub op: &'a Op,
    pub inputs: &'a Inputs,
    pub outputs: &'a Outputs,
    pub node: Option<NodeId>,
    pub phase: Phase,
}

/// The buffers a grouped transfer sends (`sends`) or receives.
fn p2p_buffers(ops: &[P2pOp], sends: bool) -> Vec<BufferId> {
    ops.iter()
        .filter_map(|op| match (op, sends) {
            (P2pOp::Send { buffer, .. }, true) | (P2pOp::Recv { buffer, .. }, false) => {
                Some(*buffer)
            }
            _ => None,
        })
        .collect()
}

impl Instr {
    /// A forward-phase compute instruction of `op`, with no spec node, on the buffers numbered
    /// `inputs` and `outputs` (in the op's order): for programs written by hand (tests, tools).
    /// An op with more operands than an instruction holds does not compile. The lowering uses
    /// its builder instead, which shares equal ops between instructions.
    pub fn compute<const I: usize, const O: usize>(
        op: Op,
        inputs: &[u32; I],
        outputs: &[u32; O],
    ) -> Instr {
        Instr::Compute {
            op: Arc::new(op),
            inputs: Inputs::numbered(inputs),
            outputs: Outputs::numbered(outputs),
            node: None,
            phase: Phase::Forward,
        }
    }

    /// This instruction with every buffer `id` it names replaced by `to(id)`.
    pub fn with_buffers(&self, to: impl Fn(BufferId) -> BufferId) -> Instr {
        let mut out = self.clone();
        match &mut out {
            Instr::Compute {
                inputs, outputs, ..
            } => {
                *inputs = inputs.map(&to);
                *outputs = outputs.map(&to);
            }
            Instr::Collective { input, output, .. } => {
                *input = to(*input);
                *output = to(*output);
            }
            Instr::Send { buffer, .. }
            | Instr::Recv { buffer, .. }
            | Instr::Alloc { buffer }
            | Instr::Free { buffer } => *buffer = to(*buffer),
            Instr::P2p { ops } => {
                for op in ops {
                    let (P2pOp::Send { buffer, .. } | P2pOp::Recv { buffer, .. }) = op;
                    *buffer = to(*buffer);
                }
            }
            Instr::LoadBatch {
                tokens, targets, ..
            } => {
                *tokens = tokens.map(&to);
                *targets = targets.map(&to);
            }
        }
        out
    }

    /// The parts of a compute instruction; `None` for every other kind.
    pub fn as_compute(&self) -> Option<Compute<'_>> {
        match self {
            Instr::Compute {
                op,
                inputs,
                outputs,
                node,
                phase,
            } => Some(Compute {
                op,
                inputs,
                outputs,
                node: *node,
                phase: *phase,
            }),
            _ => None,
        }
    }

    /// The op of a compute instruction; `None` for every other kind.
    pub fn op(&self) -> Option<&Op> {
        match self {
            Instr::Compute { op, .. } => Some(op),
            _ => None,
        }
    }

    /// Buffers this instruction reads.
    pub fn reads(&self) -> Vec<BufferId> {
        match self {
            Instr::Compute { inputs, .. } => inputs.to_vec(),
            Instr::Collective { input, .. } => vec![*input],
            Instr::Send { buffer, .. } => vec![*buffer],
            Instr::P2p { ops } => p2p_buffers(ops, true),
            Instr::Recv { .. } | Instr::LoadBatch { .. } | Instr::Alloc { .. } => Vec::new(),
            Instr::Free { .. } => Vec::new(),
        }
    }
    /// Buffers this instruction writes.
    pub fn writes(&self) -> Vec<BufferId> {
        match self {
            Instr::Compute { outputs, .. } => outputs.to_vec(),
            Instr::Collective { output, .. } => vec![*output],
            Instr::Recv { buffer, .. } => vec![*buffer],
            Instr::P2p { ops } => p2p_buffers(ops, false),
            Instr::LoadBatch {
                tokens, targets, ..
            } => tokens.iter().chain(targets.iter()).copied().collect(),
            Instr::Send { .. } | Instr::Alloc { .. } | Instr::Free { .. } => Vec::new(),
        }
    }
}

fn serialize_shared_op<S: Serializer>(op: &Arc<Op>, s: S) -> Result<S::Ok, S::Error> {
    Op::serialize(op, s)
}
