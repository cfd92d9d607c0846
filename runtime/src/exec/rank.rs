//! One rank's interpreter: owns the rank's backend, comm handle and sampler, sets up the
//! persistent buffers (parameters from `init`, or a checkpoint), and runs its program once per
//! step, dispatching every instruction without deciding anything itself. A run that evaluates
//! (`train.eval`) also runs the rank's evaluation program ([`RankExecutor::evaluate`]) on the
//! same backend: its buffer table extends the training program's, and the backend's memory is
//! planned once over both programs' instructions, so the two share the parameters.
use crate::backend::{Backend, DeviceTransfer, HostStaging, StepScalars};
use crate::checkpoint::{self, ShardTensor, Snapshot, SnapshotTensor};
use crate::comm::{Comm, PeerOp};
use crate::data::{fill_microbatch, BatchLayout, EvalSet, RunData, Sampler};
use crate::error::{Result, RuntimeError};
use crate::exec::loss_scale::{LossScaleStep, LossScaler};
use crate::exec::profile::{self, StepProfile};
use crate::hf::HfInit;
use crate::init::{fill_local_param, ZeroShard};
use parc_compiler::ir::op::{segments_len, Segment};
use parc_compiler::ir::{
    BufferId, BufferKind, CollectiveKind, DType, GroupId, Instr, LocalParam, P2pOp, Peer, Plan,
    Program,
};
use parc_compiler::spec::Axis;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// One device-timed instruction's work, for the profile: its op label (compute instructions),
/// kind, FLOPs and bytes.
type Work = (Option<String>, profile::OpKind, f64, f64);

/// A rank's local slice of one parameter, as stored (see [`super::gather`]).
#[derive(Clone, Debug)]
pub struct ParamPiece {
    pub param: parc_compiler::ir::ParamId,
    pub tp: Option<parc_compiler::ir::TpSplit>,
    /// `(shard_len, index)` of a ZeRO flat shard; None for the whole tp-local tensor.
    pub zero: Option<ZeroShard>,
    pub data: Vec<f32>,
}

/// Where a rank's parameters start.
#[derive(Clone, Copy, Debug)]
pub enum ParamStart<'a> {
    /// The counter-based initialisation from this seed (`crate::init`).
    Seeded(u64),
    /// A Hugging Face checkpoint (`train.init = hf(…)`), checked against the spec.
    Hf(&'a HfInit),
}

/// What one step left in the rank's metric buffers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepMetrics {
    pub loss: Option<f32>,
    /// The squared global gradient norm, of the unscaled gradients in an fp16 run.
    pub grad_sumsq: Option<f32>,
    /// What loss scaling did (fp16 runs).
    pub loss_scale: Option<LossScaleStep>,
    /// A run without loss scaling: the global gradient norm was not finite, so the update
    /// left parameters and optimizer state as they were (`ClipCoef` marks the step).
    pub update_skipped: bool,
}

pub struct RankExecutor<'a, B: Backend> {
    plan: &'a Plan,
    program: &'a Program,
    /// The rank's evaluation program, when the run evaluates (its buffer table begins with
    /// `program`'s).
    eval: Option<&'a Program>,
    rank: u32,
    backend: B,
    comm: Box<dyn Comm + 'a>,
    data: RunData,
    sampler: Sampler,
    dp_rank: u32,
    /// Optimizer updates applied so far.
    pub optimizer_step: u64,
    /// The fp16 loss scaler (None: the run does not scale its loss).
    pub loss_scaler: Option<LossScaler>,
}

/// The first output of a re-run step that held a value that is not finite
/// ([`RankExecutor::first_nonfinite`]).
#[derive(Clone, Debug, PartialEq)]
pub struct NonFiniteOutput {
    /// The instruction's index in the rank's program, and what it does (`matmul`,
    /// `all_reduce over its dp group`).
    pub index: usize,
    pub instr: String,
    /// A compute instruction (not a transfer that brought the value from another rank), or a
    /// parameter of this rank (`held`).
    pub computed: bool,
    /// The values were in a parameter before the step began; `index` is the first
    /// instruction that reads it.
    pub held: bool,
    /// The buffer's name, and how many of its values were not finite.
    pub buffer: String,
    pub count: usize,
    pub len: usize,
    /// The spec node the instruction implements (or the nearest before it).
    pub node: Option<parc_compiler::spec::NodeId>,
    /// The program's role.
    pub role: String,
}

/// Which batch an instruction's `LoadBatch` reads.
#[derive(Clone, Copy, Debug)]
enum Batch {
    /// The global batch of this 0-based training step.
    Train(u64),
    /// This batch of the evaluation set.
    Eval(u64),
}

fn plan_error(rank: u32, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Op {
        op: format!("rank {rank}"),
        what: format!("{what} (a lowering bug)"),
    }
}

/// Where a re-run found the first value that is not finite: the instruction, the buffer, how
/// many of its values are not finite, its length, and whether it was held before the step (a
/// parameter).
type NonFiniteAt = (usize, BufferId, usize, usize, bool);

impl<'a, B: Backend> RankExecutor<'a, B> {
    /// The executor of `rank`, training on `data` (a dataset alone: all of it, without
    /// evaluation) with the sampler of `seed`; it evaluates when `data` has an evaluation set.
    pub fn new(
        plan: &'a Plan,
        rank: u32,
        backend: B,
        comm: Box<dyn Comm + 'a>,
        data: impl Into<RunData>,
        seed: u64,
    ) -> Result<RankExecutor<'a, B>> {
        let data = data.into();
        let program = plan
            .program_of(rank)
            .ok_or_else(|| plan_error(rank, "has no program"))?;
        let eval = match &data.eval {
            Some(_) => Some(plan.eval_of(rank).ok_or_else(|| {
                plan_error(rank, "has evaluation data but no evaluation program")
            })?),
            None => None,
        };
        let layout = BatchLayout {
            dp: plan.mesh.size(Axis::Dp),
            microbatches: plan.microbatches,
            micro_batch: plan.micro_batch,
        };
        let sampler = Sampler::new(seed, data.train_samples, layout)?;
        Ok(RankExecutor {
            plan,
            program,
            eval,
            rank,
            backend,
            comm,
            data,
            sampler,
            dp_rank: plan.mesh.coord(rank, Axis::Dp),
            optimizer_step: 0,
            loss_scaler: None,
        })
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// Continue the training data at step `step` from stream position `position` (a resumed
    /// checkpoint's samples seen: `Sampler::resume_at`).
    pub fn resume_sampler_at(&mut self, step: u64, position: u64) {
        self.sampler.resume_at(step, position);
    }

    /// The rank's backend (for inspection: memory held, allocations made).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// What the backend reports holding (`Backend::reserved_bytes`).
    pub fn reserved_bytes(&self) -> Option<u64> {
        self.backend.reserved_bytes()
    }

    pub fn comm(&mut self) -> &mut (dyn Comm + 'a) {
        self.comm.as_mut()
    }

    /// This rank failed with `reason`: tell the other ranks through the comm, then the backend
    /// (a device communicator's peers).
    pub fn abort(&mut self, reason: &str) {
        self.comm.abort(reason);
        self.backend.abort(reason);
    }

    /// The buffer table of every instruction this rank runs: the evaluation program's, which
    /// extends the training program's, when it evaluates.
    fn table(&self) -> &'a Program {
        self.eval.unwrap_or(self.program)
    }

    /// Persistent buffers (parameters, optimizer state, metrics), in buffer order.
    fn persistent(&self) -> impl Iterator<Item = (BufferId, &'a parc_compiler::ir::Buffer)> {
        let program: &'a Program = self.program;
        program
            .buffers
            .iter()
            .enumerate()
            .filter(|(_, b)| b.kind.is_persistent())
            .map(|(i, b)| (BufferId(i as u32), b))
    }

    /// The caller's ZeRO shard of `local`, if it is sharded.
    fn zero_shard(&self, local: &LocalParam) -> Result<Option<ZeroShard>> {
        let Some(split) = local.zero else {
            return Ok(None);
        };
        let (_, index) = self.group_set(split.group).map_err(|_| {
            plan_error(
                self.rank,
                format!("ZeRO group {} of param {}", split.group.0, local.param.0),
            )
        })?;
        Ok(Some(ZeroShard {
            shard_len: split.shard_len,
            index: index as u64,
        }))
    }

    fn group_set(&self, group: GroupId) -> Result<(Vec<u32>, usize)> {
        let family = self
            .plan
            .group(group)
            .ok_or_else(|| plan_error(self.rank, format!("group {} does not exist", group.0)))?;
        family
            .set_of(self.rank)
            .map(|(set, i)| (set.to_vec(), i))
            .ok_or_else(|| {
                plan_error(
                    self.rank,
                    format!("is not a member of group family {}", family.name),
                )
            })
    }

    /// Plan the program's memory (with the evaluation program's after it, when the rank
    /// evaluates: one layout for both) and hand the plan to the backend, allocate the
    /// persistent buffers and initialise the parameters from the seed.
    pub fn init(&mut self, seed: u64) -> Result<()> {
        self.init_from(ParamStart::Seeded(seed))
    }

    /// [`RankExecutor::init`] with the parameters from `start`.
    pub fn init_from(&mut self, start: ParamStart<'_>) -> Result<()> {
        let joint = self
            .eval
            .map(|eval| self.program.followed_by(eval))
            .transpose()
            .map_err(|e| plan_error(self.rank, e))?;
        let steps = joint.as_ref().unwrap_or(self.program);
        // Every buffer's place is decided (and checked) before the first allocation, at the
        // sizes this backend stores (bf16 buffers as f32 on a backend without bf16 storage).
        let widened =
            (!self.backend.stores_bf16() && steps.uses_bf16()).then(|| steps.with_f32_storage());
        let program = widened.as_ref().unwrap_or(steps);
        let layout =
            parc_compiler::memplan::plan_program(program).map_err(|e| plan_error(self.rank, e))?;
        self.backend.prepare(program, &layout)?;
        let buffers: Vec<_> = self.persistent().collect();
        for (id, buffer) in buffers {
            self.backend.alloc(id, &buffer.shape, buffer.dtype)?;
        }
        for local in &self.program.params {
            let param = self
                .plan
                .params
                .params
                .get(local.param.0 as usize)
                .ok_or_else(|| {
                    plan_error(self.rank, format!("param {} is unknown", local.param.0))
                })?;
            let zero = self.zero_shard(local)?;
            let mut copies = vec![(local.master, zero)];
            if let Some(working) = local.working {
                copies.push((working, None));
            }
            for (id, shard) in copies {
                let len = self
                    .program
                    .buffer(id)
                    .map(|b| b.numel() as usize)
                    .ok_or_else(|| plan_error(self.rank, format!("buffer {} is unknown", id.0)))?;
                let mut data = vec![0.0f32; len];
                match start {
                    ParamStart::Seeded(seed) => fill_local_param(
                        &mut data,
                        param.init,
                        seed,
                        local.param,
                        &param.shape,
                        local.tp,
                        shard,
                    )?,
                    ParamStart::Hf(weights) => {
                        weights.fill_local(&mut data, local.param, param, local.tp, shard)?
                    }
                }
                self.backend.write_f32(id, &data)?;
            }
        }
        Ok(())
    }

    /// Run the program once as 0-based training step `step`. With `profile`, every
    /// instruction is timed and added to it: between time marks on the device's queue where
    /// the backend keeps them ([`Backend::mark_time`]: no waiting between instructions, so the
    /// step runs as it does unprofiled), else between backend synchronizations.
    pub fn step(
        &mut self,
        step: u64,
        lr: f64,
        mut profile: Option<&mut StepProfile>,
    ) -> Result<StepMetrics> {
        self.optimizer_step += 1;
        let scalars = StepScalars {
            lr,
            step: self.optimizer_step,
            loss_scale: self.loss_scaler.as_ref().map(LossScaler::scale),
        };
        // Device-timed profiling: the work of each instruction, timed once the step is queued.
        let mut device_timed: Option<Vec<Work>> = None;
        let mut communicated = HashMap::new();
        if profile.is_some() {
            self.backend.synchronize()?;
            if self.backend.mark_time()? {
                device_timed = Some(Vec::with_capacity(self.program.instrs.len()));
                communicated = profile::communicated_buffers(self.program);
            }
        }
        for (index, instr) in self.program.instrs.iter().enumerate() {
            self.backend.begin_instruction(index);
            let result = match (profile.as_deref_mut(), device_timed.as_mut()) {
                (None, _) => self.run(instr, Batch::Train(step), &scalars),
                (Some(_), Some(work)) => {
                    // The device's wait for queued communication is timed apart from the work
                    // of the instruction that waits, as p2p or collective.
                    let waited = match profile::communication_wait(instr, &communicated) {
                        None => Ok(()),
                        Some((kind, buffers)) => self
                            .backend
                            .wait_for_communication(&buffers)
                            .and_then(|()| self.backend.mark_time())
                            .map(|_| work.push((None, kind, 0.0, 0.0))),
                    };
                    waited
                        .and_then(|()| self.run(instr, Batch::Train(step), &scalars))
                        .and_then(|()| {
                            self.backend.mark_time()?;
                            let (flops, bytes) = self.work_of(instr);
                            let label = profile::op_label(instr);
                            work.push((label, profile::classify(instr), flops, bytes));
                            Ok(())
                        })
                }
                (Some(profile), None) => self.run_timed(instr, step, &scalars, profile),
            };
            result.map_err(|e| self.instruction_error(self.program, 0, index, e))?;
        }
        if let (Some(profile), Some(work)) = (profile, device_timed) {
            let intervals = self.backend.marked_intervals()?;
            if intervals.len() != work.len() {
                return Err(plan_error(
                    self.rank,
                    format!(
                        "the backend's profile has {} instruction times for {} instructions \
                         (a backend bug)",
                        intervals.len(),
                        work.len()
                    ),
                ));
            }
            profile.device_timed = true;
            for ((label, kind, flops, bytes), seconds) in work.into_iter().zip(intervals) {
                match label {
                    Some(label) => profile.add_op(label, kind, seconds, flops, bytes),
                    None => profile.add(kind, seconds, flops, bytes),
                }
            }
        }
        let read = |id: Option<BufferId>| -> Result<Option<f32>> {
            id.map(|id| {
                self.backend
                    .read_f32(id)
                    .map(|v| v.first().copied().unwrap_or(0.0))
            })
            .transpose()
        };
        let located = |e| self.locate_comm_error(self.program, 0, None, e);
        let loss = read(self.program.loss).map_err(located)?;
        let mut grad_sumsq = read(self.program.grad_sumsq).map_err(located)?;
        let mut update_skipped = false;
        let loss_scale = match self.loss_scaler.as_mut() {
            None => {
                // Every rank holds the same global value, so all skip (or not) together.
                update_skipped = grad_sumsq.is_some_and(|s| !s.is_finite());
                if update_skipped {
                    self.optimizer_step -= 1;
                }
                None
            }
            Some(scaler) => {
                let sumsq = grad_sumsq.ok_or_else(|| {
                    plan_error(
                        self.rank,
                        "has no grad_sumsq buffer, which fp16 loss scaling reads",
                    )
                })?;
                // Every rank holds the same global value, so all skip (or not) together.
                let update = scaler.update(!sumsq.is_finite());
                if update.skipped {
                    self.optimizer_step -= 1;
                }
                grad_sumsq = Some((f64::from(sumsq) / update.scale.powi(2)) as f32);
                Some(update)
            }
        };
        Ok(StepMetrics {
            loss,
            grad_sumsq,
            loss_scale,
            update_skipped,
        })
    }

    /// Step `step`'s program run with a check of each instruction's outputs after it: the first
    /// whose output holds a value that is not finite (`first` where that is already known).
    fn rerun_checked(
        &mut self,
        step: u64,
        scalars: &StepScalars,
        mut first: Option<NonFiniteAt>,
    ) -> Result<Option<NonFiniteAt>> {
        let program = self.program;
        for (index, instr) in program.instrs.iter().enumerate() {
            self.backend.begin_instruction(index);
            self.run(instr, Batch::Train(step), scalars)
                .map_err(|e| self.instruction_error(program, 0, index, e))?;
            if first.is_none() {
                first = self
                    .nonfinite_output(instr)?
                    .map(|(buffer, count, len)| (index, buffer, count, len, false));
            }
        }
        Ok(first)
    }

    /// Run 0-based training step `step` again (from the state before it: a step whose
    /// gradient norm was not finite left it untouched) with a check after every instruction
    /// that writes buffers, and return the first whose output holds a value that is not
    /// finite. Every rank must re-run together (the step's collectives span them); each
    /// reads its outputs back to the host, so this is for diagnosis only.
    pub fn first_nonfinite(&mut self, step: u64, lr: f64) -> Result<Option<NonFiniteOutput>> {
        let scalars = StepScalars {
            lr,
            step: self.optimizer_step + 1,
            loss_scale: self.loss_scaler.as_ref().map(LossScaler::scale),
        };
        let program = self.program;
        // A parameter that already holds values that are not finite (weights imported or
        // resumed so, or made so by an earlier update) is the origin, not the first
        // instruction that reads it.
        let held = self
            .nonfinite_param()?
            .map(|(index, buffer, count, len)| (index, buffer, count, len, true));
        self.backend.check_outputs(true);
        let first = self.rerun_checked(step, &scalars, held);
        self.backend.check_outputs(false);
        let Some((index, buffer, count, len, held)) = first? else {
            return Ok(None);
        };
        let instr = &program.instrs[index];
        let name = program
            .buffer(buffer)
            .map_or_else(|| format!("#{}", buffer.0), |b| b.name.clone());
        let located = self.at_instruction(
            program,
            index,
            instr,
            RuntimeError::Unsupported(String::new()),
        );
        let RuntimeError::AtInstruction {
            instr: mut what,
            node,
            ..
        } = located
        else {
            return Err(plan_error(self.rank, "an instruction without a location"));
        };
        if let Instr::Compute { op, .. } = instr {
            what = op.opcode().name().to_string();
        }
        Ok(Some(NonFiniteOutput {
            index,
            instr: what,
            computed: held || matches!(instr, Instr::Compute { .. }),
            held,
            buffer: name,
            count,
            len,
            node,
            role: program.role.clone(),
        }))
    }

    /// The first parameter (master values, not a working copy rebuilt from them) that holds
    /// a value that is not finite before the step: the first instruction that reads it, its
    /// id, how many such values and of how many.
    fn nonfinite_param(&self) -> Result<Option<(usize, BufferId, usize, usize)>> {
        let program = self.program;
        for (id, buffer) in program.checkpointed() {
            if buffer.kind != BufferKind::Param || !matches!(buffer.dtype, DType::F32 | DType::Bf16)
            {
                continue;
            }
            let Some(index) = (program.instrs.iter()).position(|i| i.reads().contains(&id)) else {
                continue;
            };
            let values = self.backend.read_f32(id)?;
            let count = values.iter().filter(|v| !v.is_finite()).count();
            if count > 0 {
                return Ok(Some((index, id, count, values.len())));
            }
        }
        Ok(None)
    }

    /// The first f32 or bf16 buffer `instr` writes that holds a value that is not finite:
    /// its id, how many such values and of how many.
    fn nonfinite_output(&self, instr: &Instr) -> Result<Option<(BufferId, usize, usize)>> {
        if matches!(
            instr,
            Instr::LoadBatch { .. } | Instr::Alloc { .. } | Instr::Free { .. }
        ) {
            return Ok(None);
        }
        for id in instr.writes() {
            let dtype = self.table().buffer(id).map(|b| b.dtype);
            if !matches!(dtype, Some(DType::F32 | DType::Bf16)) {
                continue;
            }
            let values = self.backend.read_f32(id)?;
            let count = values.iter().filter(|v| !v.is_finite()).count();
            if count > 0 {
                return Ok(Some((id, count, values.len())));
            }
        }
        Ok(None)
    }

    /// Evaluate: run the evaluation program once per batch of the evaluation set and return
    /// the mean of the batches' losses (each batch has as many tokens, so this is the mean
    /// token cross-entropy over the whole set) where the program holds the loss. The
    /// parameters, gradients, optimizer state and step, and the sampler stay as they were.
    pub fn evaluate(&mut self) -> Result<Option<f32>> {
        let program = self
            .eval
            .ok_or_else(|| plan_error(self.rank, "has no evaluation program"))?;
        let batches = self.data.eval.as_ref().map_or(0, EvalSet::batches);
        let scalars = StepScalars {
            lr: 0.0,
            step: self.optimizer_step,
            loss_scale: None,
        };
        // The backend numbers instructions as the memory plan did: training's, then these.
        let offset = self.program.instrs.len();
        let mut sum = 0.0f64;
        for batch in 0..batches {
            for (index, instr) in program.instrs.iter().enumerate() {
                self.backend.begin_instruction(offset + index);
                self.run(instr, Batch::Eval(batch), &scalars)
                    .map_err(|e| self.instruction_error(program, offset, index, e))?;
            }
            if let Some(id) = program.loss {
                let loss = self
                    .backend
                    .read_f32(id)
                    .map_err(|e| self.locate_comm_error(program, offset, None, e))?;
                sum += f64::from(loss.first().copied().unwrap_or(f32::NAN));
            }
        }
        Ok(program.loss.map(|_| (sum / batches.max(1) as f64) as f32))
    }

    /// `error` from instruction `index` of `program` (whose instructions the backend numbers
    /// from `offset`), with where it happened.
    fn instruction_error(
        &self,
        program: &Program,
        offset: usize,
        index: usize,
        error: RuntimeError,
    ) -> RuntimeError {
        match error {
            RuntimeError::Comm(_) => self.locate_comm_error(program, offset, Some(index), error),
            other => RuntimeError::Op {
                op: format!("rank {} ({}) instruction {index}", self.rank, program.role),
                what: other.to_string(),
            },
        }
    }

    /// Wrap communication error `error`, noticed at instruction `current` of `program` (None:
    /// after the last; the backend numbers its instructions from `offset`), with where this
    /// rank was: the instruction whose queued communication the backend found stuck where it
    /// knows one (an asynchronous device comm notices a peer's failure later, at a wait), else
    /// `current`. Other errors, and a failure after the last instruction with no stuck one,
    /// stay as they are.
    fn locate_comm_error(
        &self,
        program: &Program,
        offset: usize,
        current: Option<usize>,
        error: RuntimeError,
    ) -> RuntimeError {
        if !matches!(error, RuntimeError::Comm(_)) {
            return error;
        }
        let index = self
            .backend
            .stuck_instruction()
            .and_then(|i| i.checked_sub(offset))
            .filter(|&i| i < program.instrs.len())
            .or(current);
        match index.and_then(|i| Some((i, program.instrs.get(i)?))) {
            Some((index, instr)) => self.at_instruction(program, index, instr, error),
            None => error,
        }
    }

    /// Wrap a communication error with where this rank was: the instruction of `program`, and
    /// the spec node it implements (for a transfer, the nearest node before it: the layer whose
    /// activation or gradient it carries).
    fn at_instruction(
        &self,
        program: &Program,
        index: usize,
        instr: &Instr,
        error: RuntimeError,
    ) -> RuntimeError {
        let node_of = |i: &Instr| match i {
            Instr::Compute { node, .. } | Instr::Collective { node, .. } => *node,
            _ => None,
        };
        let node = program
            .instrs
            .get(..=index)
            .unwrap_or(&[])
            .iter()
            .rev()
            .find_map(node_of);
        let what = match instr {
            Instr::Collective { kind, group, .. } => {
                let family = self
                    .plan
                    .group(*group)
                    .map_or_else(|| format!("#{}", group.0), |f| f.name.clone());
                let kind = match kind {
                    CollectiveKind::AllReduce { .. } => "all_reduce",
                    CollectiveKind::AllGather => "all_gather",
                    CollectiveKind::ReduceScatter => "reduce_scatter",
                    CollectiveKind::Broadcast { .. } => "broadcast",
                };
                format!("{kind} over its {family} group")
            }
            Instr::Send { peer, tag, .. } => {
                format!("send to rank {} (tag {tag})", self.peer_rank(*peer))
            }
            Instr::Recv { peer, tag, .. } => {
                format!("receive from rank {} (tag {tag})", self.peer_rank(*peer))
            }
            Instr::P2p { ops } => {
                let peers: Vec<u32> = ops
                    .iter()
                    .map(|op| match *op {
                        P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } => self.peer_rank(peer),
                    })
                    .collect();
                format!("grouped transfers with ranks {peers:?}")
            }
            other => profile::classify(other).name().to_string(),
        };
        RuntimeError::AtInstruction {
            rank: self.rank,
            role: program.role.clone(),
            index,
            instr: what,
            node,
            source: Box::new(error),
        }
    }

    /// Run `instr` with the backend idle before and after, and add its time and work to
    /// `profile`.
    fn run_timed(
        &mut self,
        instr: &Instr,
        step: u64,
        scalars: &StepScalars,
        profile: &mut StepProfile,
    ) -> Result<()> {
        self.backend.synchronize()?;
        let started = Instant::now();
        self.run(instr, Batch::Train(step), scalars)?;
        self.backend.synchronize()?;
        let seconds = started.elapsed().as_secs_f64();
        let (flops, moved) = self.work_of(instr);
        let kind = profile::classify(instr);
        match profile::op_label(instr) {
            Some(label) => profile.add_op(label, kind, seconds, flops, moved),
            None => profile.add(kind, seconds, flops, moved),
        }
        Ok(())
    }

    /// The FLOPs (matmuls, attention) and bytes of the buffers read and written of `instr`,
    /// for the profile.
    fn work_of(&self, instr: &Instr) -> (f64, f64) {
        let buffer =
            |ids: &[BufferId], i: usize| ids.get(i).and_then(|id| self.program.buffer(*id));
        let size = |ids: &[BufferId], i: usize| buffer(ids, i).map_or(0.0, |b| b.bytes() as f64);
        let Some(c) = instr.as_compute() else {
            // Communication and data loading move every buffer they read or write; Alloc and
            // Free read and write none.
            let moved = |ids: Vec<BufferId>| (0..ids.len()).map(|i| size(&ids, i)).sum::<f64>();
            return (0.0, moved(instr.reads()) + moved(instr.writes()));
        };
        let first = buffer(c.inputs, 0).map_or(0, |b| b.numel());
        // The op table's count: inputs read, outputs written, accumulated outputs read too,
        // gathered ones at the op's rows.
        let signature = c.op.signature();
        let rows = signature.rows_from_inputs(|i| buffer(c.inputs, i).map_or(0, |b| b.numel()));
        let touched = signature.bytes_touched(
            rows.unwrap_or(0),
            |i| size(c.inputs, i),
            |i| size(c.outputs, i),
        );
        (profile::flops(c.op, first).unwrap_or(0.0), touched)
    }

    fn numel(&self, id: BufferId) -> Result<usize> {
        self.table()
            .buffer(id)
            .map(|b| b.numel() as usize)
            .ok_or_else(|| plan_error(self.rank, format!("buffer {} is unknown", id.0)))
    }

    fn run(&mut self, instr: &Instr, batch: Batch, scalars: &StepScalars) -> Result<()> {
        match instr {
            Instr::Compute {
                op,
                inputs,
                outputs,
                ..
            } => self.backend.compute(op, inputs, outputs, scalars),
            Instr::Collective {
                kind,
                group,
                input,
                output,
                ..
            } => self.collective(*kind, *group, *input, *output),
            Instr::Send { peer, buffer, tag } => {
                let send = DeviceTransfer::Send {
                    peer: self.peer_rank(*peer),
                    tag: *tag,
                    buffer: *buffer,
                };
                if let Some(done) = self.backend.device_p2p(&[send]) {
                    return done;
                }
                let data = self.backend.read_f32(*buffer)?;
                let to = self.peer_rank(*peer);
                self.comm.send(to, *tag, &data)
            }
            Instr::Recv { peer, buffer, tag } => {
                let recv = DeviceTransfer::Recv {
                    peer: self.peer_rank(*peer),
                    tag: *tag,
                    buffer: *buffer,
                };
                if let Some(done) = self.backend.device_p2p(&[recv]) {
                    return done;
                }
                let mut data = vec![0.0; self.numel(*buffer)?];
                let from = self.peer_rank(*peer);
                self.comm.recv(from, *tag, &mut data)?;
                self.backend.write_f32(*buffer, &data)
            }
            Instr::P2p { ops } => self.p2p(ops),
            Instr::LoadBatch {
                microbatch,
                positions,
                tokens,
                targets,
            } => self.load_batch(batch, *microbatch, positions, *tokens, *targets),
            Instr::Alloc { buffer } => {
                let b = self.table().buffer(*buffer).ok_or_else(|| {
                    plan_error(self.rank, format!("buffer {} is unknown", buffer.0))
                })?;
                let dtype = self.storage_dtype(b.dtype);
                self.backend.alloc(*buffer, &b.shape, dtype)
            }
            Instr::Free { buffer } => self.backend.free(*buffer),
        }
    }

    /// The type this rank's backend stores a buffer of `dtype` in: bf16 only where the backend
    /// stores bf16, f32 otherwise (`Backend::stores_bf16`).
    fn storage_dtype(&self, dtype: DType) -> DType {
        if dtype == DType::Bf16 && !self.backend.stores_bf16() {
            DType::F32
        } else {
            dtype
        }
    }

    fn peer_rank(&self, peer: Peer) -> u32 {
        self.plan.peer_rank(self.rank, peer)
    }

    fn collective(
        &mut self,
        kind: CollectiveKind,
        group: GroupId,
        input: BufferId,
        output: BufferId,
    ) -> Result<()> {
        let (set, _) = self.group_set(group)?;
        if let Some(done) = self.backend.device_collective(kind, &set, input, output) {
            return done;
        }
        let mut data = self.backend.read_f32(input)?;
        let result = match kind {
            CollectiveKind::AllReduce { op } => {
                self.comm.all_reduce(&set, op, &mut data)?;
                data
            }
            CollectiveKind::Broadcast { root } => {
                self.comm.broadcast(&set, root as usize, &mut data)?;
                data
            }
            CollectiveKind::AllGather => {
                let mut out = vec![0.0; self.numel(output)?];
                self.comm.all_gather(&set, &data, &mut out)?;
                out
            }
            CollectiveKind::ReduceScatter => {
                let mut out = vec![0.0; self.numel(output)?];
                self.comm.reduce_scatter(&set, &data, &mut out)?;
                out
            }
        };
        self.backend.write_f32(output, &result)
    }

    fn p2p(&mut self, ops: &[P2pOp]) -> Result<()> {
        let transfers: Vec<DeviceTransfer> = ops
            .iter()
            .map(|op| match *op {
                P2pOp::Send { peer, buffer, tag } => DeviceTransfer::Send {
                    peer: self.peer_rank(peer),
                    tag,
                    buffer,
                },
                P2pOp::Recv { peer, buffer, tag } => DeviceTransfer::Recv {
                    peer: self.peer_rank(peer),
                    tag,
                    buffer,
                },
            })
            .collect();
        if let Some(done) = self.backend.device_p2p(&transfers) {
            return done;
        }
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for op in ops {
            match *op {
                P2pOp::Send { peer, buffer, tag } => {
                    sends.push((self.peer_rank(peer), tag, self.backend.read_f32(buffer)?));
                }
                P2pOp::Recv { peer, buffer, tag } => {
                    recvs.push((
                        self.peer_rank(peer),
                        tag,
                        buffer,
                        vec![0.0; self.numel(buffer)?],
                    ));
                }
            }
        }
        let mut batch: Vec<PeerOp<'_>> = sends
            .iter()
            .map(|(peer, tag, data)| PeerOp::Send {
                peer: *peer,
                tag: *tag,
                data,
            })
            .collect();
        batch.extend(recvs.iter_mut().map(|(peer, tag, _, out)| PeerOp::Recv {
            peer: *peer,
            tag: *tag,
            out,
        }));
        self.comm.group_p2p(&mut batch)?;
        for (_, _, buffer, data) in recvs {
            self.backend.write_f32(buffer, &data)?;
        }
        Ok(())
    }

    fn load_batch(
        &mut self,
        batch: Batch,
        microbatch: u32,
        positions: &[Segment],
        tokens: Option<BufferId>,
        targets: Option<BufferId>,
    ) -> Result<()> {
        let (dataset, samples) = match batch {
            Batch::Train(step) => (
                Arc::clone(&self.data.train),
                self.sampler.microbatch(step, self.dp_rank, microbatch)?,
            ),
            Batch::Eval(index) => {
                let set =
                    self.data.eval.as_ref().ok_or_else(|| {
                        plan_error(self.rank, "evaluates without an evaluation set")
                    })?;
                let samples = set.microbatch(index, self.dp_rank, microbatch)?;
                (Arc::clone(set.dataset()), samples)
            }
        };
        let len = segments_len(positions) as usize * samples.len();
        let (mut ids, mut next) = (vec![0i32; len], vec![0i32; len]);
        fill_microbatch(&dataset, &samples, positions, &mut ids, &mut next)?;
        if let Some(id) = tokens {
            self.backend.write_i32(id, &ids)?;
        }
        if let Some(id) = targets {
            self.backend.write_i32(id, &next)?;
        }
        Ok(())
    }

    /// This rank's parameters as stored: the tp-local tensor, or its ZeRO master shard.
    pub fn param_pieces(&self) -> Result<Vec<ParamPiece>> {
        self.program
            .params
            .iter()
            .map(|local| {
                Ok(ParamPiece {
                    param: local.param,
                    tp: local.tp,
                    zero: self.zero_shard(local)?,
                    data: self.backend.read_f32(local.master)?,
                })
            })
            .collect()
    }

    /// The checkpointed buffers (`Program::checkpointed`), named as in the program, laid out one after another in a
    /// checkpoint snapshot's memory, and how many values that memory holds.
    fn snapshot_layout(&self) -> (Vec<SnapshotTensor>, usize) {
        let mut end = 0usize;
        let tensors = self
            .program
            .checkpointed()
            .map(|(_, b)| {
                let len = b.shape.iter().product::<u64>() as usize;
                let start = end;
                end += len;
                SnapshotTensor {
                    name: b.name.clone(),
                    shape: b.shape.clone(),
                    range: start..end,
                }
            })
            .collect();
        (tensors, end)
    }

    /// Host memory for this rank's checkpoint snapshots (the backend's fastest to copy into).
    pub fn snapshot_memory(&mut self) -> Result<Box<dyn HostStaging>> {
        let (_, len) = self.snapshot_layout();
        self.backend.host_staging(len)
    }

    /// Copy every persistent buffer into `host` (from [`RankExecutor::snapshot_memory`]) for
    /// a checkpoint shard: the device-to-host copy a save waits for.
    pub fn snapshot(&mut self, mut host: Box<dyn HostStaging>) -> Result<Snapshot> {
        let (tensors, len) = self.snapshot_layout();
        let values = host.values_mut()?;
        if values.len() != len {
            return Err(RuntimeError::Checkpoint(format!(
                "the snapshot memory holds {} values, rank {}'s buffers {len} (a checkpoint bug)",
                values.len(),
                self.rank
            )));
        }
        let ids: Vec<BufferId> = self.program.checkpointed().map(|(id, _)| id).collect();
        for (id, tensor) in ids.into_iter().zip(&tensors) {
            self.backend
                .read_f32_into(id, &mut values[tensor.range.clone()])?;
        }
        let choices = self.backend.choices()?;
        Ok(Snapshot {
            tensors,
            host,
            choices,
        })
    }

    /// Overwrite the persistent buffers with this rank's shard of `checkpoint` (the working
    /// copies rebuilt from the masters).
    pub fn load_shard(&mut self, checkpoint_dir: &Path) -> Result<()> {
        let buffers: Vec<_> = self.program.checkpointed().collect();
        let expected: Vec<(String, Vec<u64>)> = buffers
            .iter()
            .map(|(_, b)| (b.name.clone(), b.shape.clone()))
            .collect();
        let shard = checkpoint::read_shard(checkpoint_dir, self.rank, &expected)?;
        for ((id, _), data) in buffers.iter().zip(shard.tensors) {
            self.backend.write_f32(*id, &data)?;
        }
        if let Some(saved) = shard.choices {
            self.adopt_choices(checkpoint_dir, &saved)?;
        }
        self.rebuild_working_copies()
    }

    /// Make the backend choices `saved` (this rank's shard of `checkpoint_dir` carries them),
    /// so the resumed run continues bit for bit (a warning where the backend cannot take them).
    fn adopt_choices(&mut self, checkpoint_dir: &Path, saved: &str) -> Result<()> {
        let adopted = self.backend.adopt_choices(saved).map_err(|e| {
            RuntimeError::Checkpoint(format!(
                "{}: rank {}'s backend choices ({}): {e}",
                checkpoint_dir.display(),
                self.rank,
                checkpoint::CHOICES_KEY
            ))
        })?;
        if let Some(why) = adopted {
            eprintln!(
                "warning: rank {}: the checkpoint's backend choices are not taken ({why}); \
                 this run makes its own, so it may differ from the original run by rounding",
                self.rank
            );
        }
        Ok(())
    }

    /// Overwrite the persistent buffers with `tensors` (a checkpoint re-sharded for this plan,
    /// `checkpoint::reshard`): one per checkpointed buffer (`Program::checkpointed`), in buffer
    /// order, named and shaped as the buffers are; then rebuild the working copies.
    pub fn load_tensors(&mut self, tensors: Vec<ShardTensor>) -> Result<()> {
        let buffers: Vec<_> = self.program.checkpointed().collect();
        if buffers.len() != tensors.len() {
            return Err(plan_error(
                self.rank,
                format!(
                    "{} re-sharded tensors for {} persistent buffers",
                    tensors.len(),
                    buffers.len()
                ),
            ));
        }
        for ((id, buffer), tensor) in buffers.iter().zip(tensors) {
            if buffer.name != tensor.name || buffer.shape != tensor.shape {
                return Err(plan_error(
                    self.rank,
                    format!(
                        "re-sharded tensor {} {:?} does not match buffer {} {:?}",
                        tensor.name, tensor.shape, buffer.name, buffer.shape
                    ),
                ));
            }
            self.backend.write_f32(*id, &tensor.data)?;
        }
        self.rebuild_working_copies()
    }

    /// Set every working copy to its master's values as the step's refresh leaves it: the
    /// tp-local master, or the ZeRO shards gathered over their group, written through
    /// `write_f32` (which rounds into a bf16 copy as the refresh's rounding copy does). Every
    /// member of each group calls this at the same point (after loading), so the gathers meet.
    fn rebuild_working_copies(&mut self) -> Result<()> {
        let program: &Program = self.program;
        for local in &program.params {
            let Some(working) = local.working else {
                continue;
            };
            let len = self.numel(working)?;
            let master = self.backend.read_f32(local.master)?;
            let mut full = match local.zero {
                None => master,
                Some(z) => {
                    let (set, _) = self.group_set(z.group)?;
                    let mut flat = vec![0.0; master.len() * set.len()];
                    self.comm.all_gather(&set, &master, &mut flat)?;
                    flat
                }
            };
            if full.len() < len {
                return Err(plan_error(
                    self.rank,
                    format!(
                        "{} values of {}'s master for its working copy of {len}",
                        full.len(),
                        program.buffer(working).map_or("?", |b| b.name.as_str())
                    ),
                ));
            }
            full.truncate(len);
            self.backend.write_f32(working, &full)?;
        }
        Ok(())
    }
}
