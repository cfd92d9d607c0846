//! Lowering: a checked [`Spec`] → a [`Plan`] of per-rank programs, for any product of dp, pp,
//! cp and tp in the spec's mesh order, with ZeRO 0–3, GPipe / 1F1B / interleaved 1F1B,
//! sequence parallelism and recompute. `docs/ir.md` states the rules per axis; each submodule's
//! header states its part:
//! - `params`: the global parameter table and tp split rules;
//! - `context`: groups, pipeline chunks, sequence segments, recompute segments, E08xx checks;
//! - `schedule`: pipeline unit orders and deadlock-free transfer placement;
//! - `layers` / `backward`: forward and backward of each layer kind (autodiff at op level);
//! - `pipeline`: one program's step (units, transfers, recompute, lifetimes);
//! - `optim`: gradient reductions (buckets, ZeRO), gradient norm, optimizer;
//! - `eval`: with `train.eval`, each role's evaluation step (forward and loss only);
//! - `builder` / `emitter`: buffer and instruction emission state;
//! - `storage`: which buffers a bf16 run stores in bf16;
//! - then, where the FP8 recipe shares quantization (`Fp8::shared_quantization`), the FP8
//!   quantization pass (`fp8_quantize`) on each program;
//! - then, with `LowerOptions::fusion`, the fusion pass (`crate::fuse`) on each program.
//!
//! Programs are shared by ranks that differ only in their dp coordinate.

pub mod act_kernels;
mod backward;
mod builder;
mod context;
pub(crate) use context::validate;
mod emitter;
mod eval;
pub(crate) mod first_write;
mod fp8;
pub mod fp8_quantize;
mod idmap;
mod layers;
mod optim;
pub mod params;
mod pipeline;
mod schedule;
mod storage;

pub use schedule::{stage_order, Dir, Unit};

use crate::diag::{Diagnostic, Diagnostics};
use crate::ir::op::Segment;
use crate::ir::{
    BufferId, BufferKind, DType, Group, GroupId, LocalParam, Param, ParamId, Plan, Program,
    ProgramId, TpSplit, ZeroSplit,
};
use crate::spec::{Axis, Precision, Spec, ZeroStage};
use builder::ProgramBuilder;
use context::{Chunks, Groups};
use emitter::{Emitter, LocalState, MbState};
use idmap::IdMap;
use params::{Params, Slot, TpRule};
use std::collections::HashMap;

/// Choices of the lowering that do not change what a plan computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LowerOptions {
    /// Add a gradient contribution into the gradient already there through the producing op's
    /// `+=` where that is safe (see `Emitter::accumulation_target`), and hand one gradient to
    /// both inputs of an `Add` without a copy. Off: every contribution is summed by an `Add`
    /// into a fresh buffer and an `Add`'s backward copies its gradient (the plain form, which
    /// computes bit-identical f32 results; tests compare the two).
    pub accumulate_in_place: bool,
    /// Fuse an MLP's activation into its GEMMs (GPT-2's `gelu_tanh`, the one activation a
    /// cuBLASLt epilogue computes by its exact definition): the first projection's `Matmul`
    /// also writes the activation (`act`), and the second projection's backward-data product
    /// writes the pre-activation's gradient (`act_grad`), with no `Activation` /
    /// `ActivationBwd` op between; and a residual `Add` of a GEMM's output is added by that GEMM
    /// (`Matmul { residual }`) where exact (`Emitter::fused_residual`: no tp, one reader).
    /// Off: the separate ops (bit-identical in f32; tests compare).
    pub fuse_epilogues: bool,
    /// The first contribution to a freshly allocated parameter gradient overwrites it
    /// (`accumulate_param_grad` = false) instead of adding into its zero-fill, which a backend
    /// then skips (see `first_write`). Off: every contribution adds (bit-identical in f32;
    /// tests compare).
    pub overwrite_first_grads: bool,
    /// Run the fusion pass (`fuse`) on every program after its storage types are chosen:
    /// groups of elementwise, data-movement and RoPE ops become one `Op::Fused` each. Off: the
    /// hand-written ops only (the same values in f32, up to a few ulp of exp and erf; tests
    /// compare).
    pub fusion: bool,
    /// Lower one program per *class* of roles instead of one per role, for analysis: the ranks
    /// of a stage whose tp index is 1 or more run the program of tp index 1, those whose cp
    /// index is 1 or more that of cp index 1. A class's programs differ only in which shard of
    /// each parameter and which slice of the vocabulary and sequence positions they hold (the
    /// parts of a `TpSplit`, `vocab_start`, the positions of RoPE and SP), never in buffers,
    /// instructions or their costs; index 0 differs (it alone adds replicated parameters to
    /// the gradient norm), so it is a class of its own. The verifier, memory planner and
    /// timeline give a class plan the results of the full plan (`tests/classes.rs` checks it);
    /// the plan is marked [`Plan::representative`] and is never run.
    pub representatives: bool,
}

impl Default for LowerOptions {
    fn default() -> Self {
        LowerOptions {
            accumulate_in_place: true,
            fuse_epilogues: true,
            overwrite_first_grads: true,
            fusion: true,
            representatives: false,
        }
    }
}

/// Lower a checked spec to per-rank programs.
pub fn lower(spec: &Spec) -> Result<Plan, Diagnostics> {
    lower_with(spec, LowerOptions::default())
}

/// [`lower`] with explicit [`LowerOptions`], FP8 layers chosen by the roofline.
pub fn lower_with(spec: &Spec, options: LowerOptions) -> Result<Plan, Diagnostics> {
    lower_chosen(spec, options, &crate::fp8::choices(spec, None))
}

/// [`lower_with`] with the FP8 layers `fp8` (`crate::fp8::choices`, priced by the compile's
/// calibration profile): the GEMMs of the chosen ones run in FP8.
pub fn lower_chosen(
    spec: &Spec,
    options: LowerOptions,
    fp8: &[crate::fp8::Choice],
) -> Result<Plan, Diagnostics> {
    let setup = Setup::new(spec, fp8)?;
    let mesh = &spec.parallel.mesh;
    let world = mesh.world();
    let (roles, rank_program) = roles(spec, options.representatives);
    let shared = setup.shared(options);
    let programs = emit_all(&roles, |_, key| emit_program(&shared, key))?;
    // An analysis plan is never run, so it is never evaluated either.
    let eval = match (&setup.eval_table, options.representatives) {
        (Some(table), false) => emit_all(&roles, |i, key| {
            eval::program(&shared, table, key, &programs[i])
        })?,
        _ => Vec::new(),
    };
    let (p, _) = context::pipeline_shape(spec);
    let report_rank = mesh.rank_of(&[(Axis::Pp, p - 1)]);
    Ok(Plan {
        world,
        mesh: mesh.clone(),
        micro_batch: spec.train.micro_batch,
        microbatches: spec.parallel.microbatches,
        seq: spec.model.seq,
        params: setup.params.table.clone(),
        groups: setup.plan_groups,
        programs,
        rank_program,
        report_rank,
        representative: options.representatives,
        eval,
    })
}

/// The exact program of global rank `rank` alone (as [`lower_with`] would give it, whatever
/// `options.representatives` says): what `parc plan --rank R` prints without lowering the
/// whole plan.
pub fn lower_rank(
    spec: &Spec,
    options: LowerOptions,
    rank: u32,
    fp8: &[crate::fp8::Choice],
) -> Result<Program, Diagnostics> {
    let setup = Setup::new(spec, fp8)?;
    let options = LowerOptions {
        representatives: false,
        ..options
    };
    emit_program(&setup.shared(options), role_key(spec, rank, false))
}

/// The plan's programs: one per (pp, cp, tp) coordinate (per class of them with `classes`), in
/// order of first rank, as role keys; and each rank's program.
fn roles(spec: &Spec, classes: bool) -> (Vec<(u32, u32, u32)>, Vec<ProgramId>) {
    let world = spec.parallel.mesh.world();
    let mut role_index: HashMap<(u32, u32, u32), ProgramId> = HashMap::new();
    let mut roles = Vec::new();
    let mut rank_program = Vec::with_capacity(world as usize);
    for r in 0..world {
        let key = role_key(spec, r, classes);
        let next = ProgramId(roles.len() as u32);
        let id = *role_index.entry(key).or_insert_with(|| {
            roles.push(key);
            next
        });
        rank_program.push(id);
    }
    (roles, rank_program)
}

/// The id rank `rank`'s program has in the full plan ([`lower_with`] without
/// representatives); `None` for a rank outside the mesh.
pub fn full_program_id(spec: &Spec, rank: u32) -> Option<ProgramId> {
    roles(spec, false).1.get(rank as usize).copied()
}

/// The role of global rank `r`: its (pp, cp, tp) coordinates, the cp and tp indices capped at
/// 1 for a class plan ([`LowerOptions::representatives`]).
fn role_key(spec: &Spec, r: u32, classes: bool) -> (u32, u32, u32) {
    let mesh = &spec.parallel.mesh;
    let class = |index: u32| if classes { index.min(1) } else { index };
    (
        mesh.coord(r, Axis::Pp),
        class(mesh.coord(r, Axis::Cp)),
        class(mesh.coord(r, Axis::Tp)),
    )
}

/// What every program of a plan is lowered from: the parameters, chunks, groups and pipeline
/// timetable, built once.
struct Setup<'a> {
    spec: &'a Spec,
    params: Params,
    chunks: Chunks,
    groups: Groups,
    plan_groups: Vec<Group>,
    zero: ZeroStage,
    table: schedule::Timetable,
    /// The evaluation step's forward-only timetable, with `train.eval`.
    eval_table: Option<schedule::Timetable>,
    param_stages: HashMap<u32, Vec<u32>>,
    /// The layers whose GEMMs run in FP8 (`train.fp8`).
    fp8: Option<context::Fp8Layers>,
}

impl<'a> Setup<'a> {
    fn new(spec: &'a Spec, fp8: &[crate::fp8::Choice]) -> Result<Setup<'a>, Diagnostics> {
        let diags = context::validate(spec);
        if diags.has_errors() {
            return Err(diags);
        }
        let mesh = &spec.parallel.mesh;
        let (p, v) = context::pipeline_shape(spec);
        let chunks = context::chunks(spec, p * v).map_err(one)?;
        let params = params::build(spec);
        let (cp, dp) = (mesh.size(Axis::Cp), mesh.size(Axis::Dp));
        let zero = if dp * cp > 1 {
            spec.parallel.zero
        } else {
            ZeroStage::Zero0
        };
        let param_stages = param_stages(spec, &chunks, &params, p);
        let fp8 = context::Fp8Layers::of(spec, fp8);
        let (groups, plan_groups) = make_groups(spec, zero, &param_stages, p, fp8.as_ref());
        let table = timetable(spec, p, v, false)?;
        let eval_table = match spec.train.eval {
            Some(_) => Some(timetable(spec, p, v, true)?),
            None => None,
        };
        Ok(Setup {
            spec,
            params,
            chunks,
            groups,
            plan_groups,
            zero,
            table,
            eval_table,
            param_stages,
            fp8,
        })
    }

    fn shared(&self, options: LowerOptions) -> Shared<'_> {
        Shared {
            spec: self.spec,
            params: &self.params,
            chunks: &self.chunks,
            groups: &self.groups,
            zero: self.zero,
            table: &self.table,
            param_stages: &self.param_stages,
            fp8: self.fp8.as_ref(),
            options,
        }
    }
}

/// Where each parameter is used: the pipeline stages of the nodes holding it.
fn param_stages(spec: &Spec, chunks: &Chunks, params: &Params, p: u32) -> HashMap<u32, Vec<u32>> {
    let stage_of_chunk = |c: u32| c % p;
    let mut param_stages: HashMap<u32, Vec<u32>> = HashMap::new();
    for (i, _) in spec.model.nodes.iter().enumerate() {
        let stage = stage_of_chunk(chunks.chunk_of(i));
        for slot in params.slots(crate::spec::NodeId(i as u32)) {
            let e = param_stages.entry(slot.param.0).or_default();
            if !e.contains(&stage) {
                e.push(stage);
            }
        }
    }
    param_stages
}

/// The plan's groups (tp, cp, dp+cp, the gradient norm's, and the tied embedding's pair of
/// stages when a parameter is used on two), as the lowering names them and as the plan lists
/// them.
fn make_groups(
    spec: &Spec,
    zero: ZeroStage,
    param_stages: &HashMap<u32, Vec<u32>>,
    p: u32,
    fp8: Option<&context::Fp8Layers>,
) -> (Groups, Vec<Group>) {
    let mesh = &spec.parallel.mesh;
    let (tp, cp, dp) = (
        mesh.size(Axis::Tp),
        mesh.size(Axis::Cp),
        mesh.size(Axis::Dp),
    );
    let mut plan_groups: Vec<Group> = Vec::new();
    let mut add = |g: Group| {
        plan_groups.push(g);
        Some(GroupId(plan_groups.len() as u32 - 1))
    };
    let mut groups = Groups::default();
    if tp > 1 {
        groups.tp = add(context::group_family("tp", mesh, &[Axis::Tp]));
    }
    if cp > 1 {
        groups.cp = add(context::group_family("cp", mesh, &[Axis::Cp]));
    }
    if dp * cp > 1 {
        let name = if cp > 1 && dp > 1 {
            "dp+cp"
        } else if cp > 1 {
            "cp"
        } else {
            "dp"
        };
        groups.dpcp = add(context::group_family(name, mesh, &[Axis::Dp, Axis::Cp]));
    }
    let norm_axes: Vec<Axis> = if zero == ZeroStage::Zero0 {
        vec![Axis::Pp, Axis::Cp, Axis::Tp]
    } else {
        Axis::ALL.to_vec()
    };
    let norm_size: u32 = norm_axes.iter().map(|a| mesh.size(*a)).product();
    if norm_size > 1 {
        groups.norm = add(context::group_family("norm", mesh, &norm_axes));
    }
    let shared: Vec<u32> = param_stages
        .iter()
        .filter(|(_, s)| s.len() > 1)
        .map(|(p, _)| *p)
        .collect();
    if !shared.is_empty() {
        let mut sets = Vec::new();
        for set in context::axis_sets(mesh, &[Axis::Pp]) {
            let pair: Vec<u32> = set
                .iter()
                .copied()
                .filter(|r| {
                    let c = mesh.coord(*r, Axis::Pp);
                    c == 0 || c == p - 1
                })
                .collect();
            sets.push(pair);
        }
        groups.embed = add(Group {
            name: "embed".to_string(),
            axes: vec![Axis::Pp],
            sets,
        });
    }
    if cp > 1 && tp > 1 && needs_cptp(fp8) {
        groups.cptp = add(context::group_family("cp+tp", mesh, &[Axis::Cp, Axis::Tp]));
    }
    if dp > 1 && fp8.is_some_and(|l| l.attr.history.is_some()) {
        groups.dp = add(context::group_family("dp", mesh, &[Axis::Dp]));
    }
    (groups, plan_groups)
}

/// Whether a GEMM operand's scale group spans cp and tp together: tensorwise FP8 scaling of
/// some layer (a row-parallel input's whole tensor is split by both; `lower/fp8.rs`).
fn needs_cptp(fp8: Option<&context::Fp8Layers>) -> bool {
    fp8.is_some_and(|l| l.attr.scaling == crate::ir::fp8::Fp8Scaling::Tensorwise)
}

/// Every stage's unit order, simulated into the timetable of transfers (E0805 when it cannot
/// complete); with `forward_only`, the forward units alone in the same order (an evaluation
/// step's).
fn timetable(
    spec: &Spec,
    p: u32,
    v: u32,
    forward_only: bool,
) -> Result<schedule::Timetable, Diagnostics> {
    let m = spec.parallel.microbatches;
    let orders: Vec<Vec<Unit>> = (0..p)
        .map(|s| {
            let mut order = schedule::stage_order(spec.parallel.schedule, p, v, m, s);
            order.retain(|u| !forward_only || u.dir == Dir::Forward);
            order
        })
        .collect();
    schedule::simulate(orders, p * v).ok_or_else(|| {
        one(Diagnostic::error(
            "E0805",
            "the pipeline schedule cannot complete: a stage waits on a unit that never runs",
        )
        .label(spec.parallel.span, "this schedule")
        .help("use gpipe, or 1f1b with microbatches ≥ pp"))
    })
}

fn one(d: Diagnostic) -> Diagnostics {
    let mut ds = Diagnostics::default();
    ds.push(d);
    ds
}

struct Shared<'a> {
    spec: &'a Spec,
    params: &'a Params,
    chunks: &'a Chunks,
    groups: &'a Groups,
    zero: ZeroStage,
    table: &'a schedule::Timetable,
    param_stages: &'a HashMap<u32, Vec<u32>>,
    fp8: Option<&'a context::Fp8Layers>,
    options: LowerOptions,
}

/// Emit every role's program with `emit` (given the role's index and key), spread over the
/// machine's cores (programs are independent).
fn emit_all<F>(roles: &[(u32, u32, u32)], emit: F) -> Result<Vec<Program>, Diagnostics>
where
    F: Fn(usize, (u32, u32, u32)) -> Result<Program, Diagnostics> + Sync,
{
    let threads = std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
        .clamp(1, roles.len().max(1));
    let per = roles.len().div_ceil(threads).max(1);
    let indexed: Vec<(usize, (u32, u32, u32))> = roles.iter().copied().enumerate().collect();
    let emit = &emit;
    let results: Vec<Result<Program, Diagnostics>> = std::thread::scope(|scope| {
        let handles: Vec<_> = indexed
            .chunks(per)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|&(i, key)| emit(i, key))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join().unwrap_or_else(|_| {
                    vec![Err(one(Diagnostic::error(
                        "E0806",
                        "internal lowering error: a lowering thread panicked",
                    )))]
                })
            })
            .collect()
    });
    let mut programs = Vec::with_capacity(roles.len());
    let mut errors = Diagnostics::default();
    for r in results {
        match r {
            Ok(p) => programs.push(p),
            Err(e) => errors.extend(e),
        }
    }
    if errors.has_errors() {
        return Err(errors);
    }
    Ok(programs)
}

/// Where one program sits in the mesh, with the mesh sizes its lowering reads.
#[derive(Clone, Copy)]
struct Role {
    stage: u32,
    cp_index: u32,
    tp_index: u32,
    tp: u32,
    cp: u32,
    dp: u32,
    p: u32,
    /// Whether the program stands for a class of roles ([`LowerOptions::representatives`]).
    class: bool,
}

impl Role {
    /// The role at `(stage, cp_index, tp_index)` of `sh`'s mesh.
    fn new(sh: &Shared, (stage, cp_index, tp_index): (u32, u32, u32)) -> Role {
        let mesh = &sh.spec.parallel.mesh;
        Role {
            stage,
            cp_index,
            tp_index,
            tp: mesh.size(Axis::Tp),
            cp: mesh.size(Axis::Cp),
            dp: mesh.size(Axis::Dp),
            p: mesh.size(Axis::Pp),
            class: sh.options.representatives,
        }
    }

    /// The pipeline chunks this role runs (chunk `c` lives on stage `c mod p`).
    fn chunks(&self, sh: &Shared) -> Vec<u32> {
        (0..sh.chunks.count)
            .filter(|c| c % self.p == self.stage)
            .collect()
    }

    /// `pp S cp C tp T`: the program's role name, also the place its diagnostics name. A class
    /// program names the range of indices it stands for (`tp 1-7`).
    fn name(&self) -> String {
        let index = |i: u32, size: u32| {
            if self.class && i == 1 && size > 2 {
                format!("1-{}", size - 1)
            } else {
                i.to_string()
            }
        };
        format!(
            "pp {} cp {} tp {}",
            self.stage,
            index(self.cp_index, self.cp),
            index(self.tp_index, self.tp)
        )
    }
}

/// Emit the program of one role: its parameters and metrics, its step, then its checks and
/// storage types.
fn emit_program(sh: &Shared, key: (u32, u32, u32)) -> Result<Program, Diagnostics> {
    let role = Role::new(sh, key);
    let my_chunks = role.chunks(sh);
    let mut b = sized_builder(sh, &my_chunks);
    let locals = declare_locals(&mut b, sh, role, &my_chunks);
    let metrics = declare_metrics(&mut b, sh, &my_chunks);
    let histories =
        fp8::declare_histories(&mut b, (sh.spec, sh.fp8), &sh.chunks.ranges, &my_chunks);
    let mut em = new_emitter(sh, role, b, locals, metrics);
    em.fp8_histories = histories;
    em.emit_step(sh.table);
    check_step(&mut em, sh, role)?;
    let residual = em.residual.take();
    let mut program = finish_program(em, role);
    if sh.options.overwrite_first_grads {
        first_write::overwrite_first_contributions(&mut program);
    }
    let keep_f32 = residual.as_ref().map_or(&[][..], |r| r.buffers());
    storage::assign(&mut program, sh.spec.train.precision, keep_f32);
    if fp8_quantize::wanted(sh.spec) {
        fp8_quantize::quantize_operands(&mut program);
    }
    if sh.options.fusion {
        crate::fuse::fuse_program(&mut program).map_err(|e| {
            one(internal_error(
                sh,
                format!("internal fusion error on {}: {e}", role.name()),
            ))
        })?;
    }
    // The builder reserved for an estimate and fusion for the unfused step: a plan holds its
    // programs through every later stage, so they keep only what they use.
    program.instrs.shrink_to_fit();
    program.buffers.shrink_to_fit();
    Ok(program)
}

/// An empty builder with room for the step of `my_chunks`' nodes.
fn sized_builder(sh: &Shared, my_chunks: &[u32]) -> ProgramBuilder {
    let my_nodes: usize = my_chunks
        .iter()
        .filter_map(|&c| sh.chunks.ranges.get(c as usize))
        .map(|(s, e)| e - s)
        .sum();
    // About 40 instructions and 16 buffers per node and microbatch, forward and backward.
    let work = my_nodes * sh.spec.parallel.microbatches as usize;
    ProgramBuilder::with_capacity(work * 40, work * 16)
}

/// Declares the buffers of the parameters `my_chunks` use, in order of first use, and counts
/// their uses over the step; returns them with their index by parameter.
fn declare_locals(
    b: &mut ProgramBuilder,
    sh: &Shared,
    role: Role,
    my_chunks: &[u32],
) -> (Vec<LocalState>, IdMap<ParamId, usize>) {
    let mut locals: Vec<LocalState> = Vec::new();
    let mut local_of = IdMap::default();
    let mut uses: HashMap<u32, u32> = HashMap::new();
    for &c in my_chunks {
        let (s, e) = sh.chunks.ranges[c as usize];
        for i in s..e {
            for slot in sh.params.slots(crate::spec::NodeId(i as u32)) {
                *uses.entry(slot.param.0).or_default() += 1;
                if local_of.contains_key(&slot.param) {
                    continue;
                }
                let Some(param) = sh.params.table.params.get(slot.param.0 as usize) else {
                    continue;
                };
                let local = declare_local(b, sh, role, slot, param);
                local_of.insert(slot.param, locals.len());
                locals.push(local);
            }
        }
    }
    let m = sh.spec.parallel.microbatches.max(1);
    let per_microbatch = matches!(sh.zero, ZeroStage::Zero2 | ZeroStage::Zero3);
    for l in &mut locals {
        let step_uses = uses.get(&l.param.0).copied().unwrap_or(0) * m;
        l.groups_left = if per_microbatch && l.zero.is_some() {
            m
        } else {
            1
        };
        l.group_uses = step_uses / l.groups_left;
        l.uses_left = l.group_uses;
    }
    (locals, local_of)
}

/// Declares one parameter's buffers on this role (see [`declare_param_buffers`]) and its
/// state: tp and ZeRO splits, and whether this rank adds it to the gradient norm.
fn declare_local(
    b: &mut ProgramBuilder,
    sh: &Shared,
    role: Role,
    slot: &Slot,
    param: &Param,
) -> LocalState {
    let split = tp_split(slot.rule, role);
    let mut shape = param.shape.clone();
    if let Some(t) = split {
        if let Some(d) = shape.get_mut(t.dim as usize) {
            *d /= u64::from(role.tp);
        }
    }
    let numel: u64 = shape.iter().product();
    let zero = zero_split(sh, role, numel);
    let bf16 = computes_in_bf16(sh.spec, &param.shape);
    let (master, working, state) = declare_param_buffers(b, sh, &param.name, &shape, (zero, bf16));
    let owner_chunk_stage = sh.chunks.chunk_of(param.node.0 as usize) % role.p;
    let stages_using = sh
        .param_stages
        .get(&slot.param.0)
        .map(Vec::len)
        .unwrap_or(1);
    let tp_owned = split.is_some() || role.tp_index == 0;
    let in_norm =
        tp_owned && owner_chunk_stage == role.stage && (zero.is_some() || role.cp_index == 0);
    LocalState {
        param: slot.param,
        rule: slot.rule,
        shape,
        numel,
        master,
        working,
        bf16,
        state,
        tp: split,
        zero,
        grad: None,
        final_grad: None,
        uses_left: 0,
        group_uses: 0,
        groups_left: 1,
        groups_done: 0,
        complete: false,
        in_norm,
        shared: stages_using > 1,
    }
}

/// The tp split of a parameter with `rule` on this role (`None`: every tp rank holds it whole).
fn tp_split(rule: TpRule, role: Role) -> Option<TpSplit> {
    if role.tp <= 1 {
        return None;
    }
    let (dim, sections) = match rule {
        TpRule::Rows => (0, None),
        TpRule::RowSections(sections) => (0, Some(sections)),
        TpRule::Cols => (1, None),
        _ => return None,
    };
    Some(TpSplit {
        dim,
        parts: role.tp,
        index: role.tp_index,
        sections,
    })
}

/// The ZeRO shard of a tp-local tensor of `numel` elements (`None` under ZeRO-0 or without a
/// dp+cp group).
fn zero_split(sh: &Shared, role: Role, numel: u64) -> Option<ZeroSplit> {
    match (sh.zero, sh.groups.dpcp) {
        (ZeroStage::Zero0, _) | (_, None) => None,
        (_, Some(g)) => {
            let parts = role.dp * role.cp;
            Some(ZeroSplit {
                parts,
                shard_len: numel.div_ceil(u64::from(parts)),
                group: g,
            })
        }
    }
}

/// Whether compute reads a parameter of global `shape` in bf16: in a bf16 run, every weight
/// matrix (GEMM weights, embedding and position tables: the 2-D parameters) is kept in bf16 for
/// compute beside its f32 master, as Megatron's distributed optimizer does; vectors (norm
/// weights, biases, under 0.1% of a model) are read in f32 from the master itself.
pub(crate) fn computes_in_bf16(spec: &Spec, shape: &[u64]) -> bool {
    spec.train.precision == Precision::Bf16 && shape.len() == 2
}

/// Declares a parameter's master, the f32 tensor the optimizer updates (its ZeRO shard,
/// `NAME.shard`; else the tp-local tensor, `NAME.master` where a working copy exists, else
/// `NAME`), the working copy compute reads (`NAME`: the full tp-local tensor, in bf16 where
/// `bf16` says so, under ZeRO-1/2 with a shard or wherever it is bf16 and unsharded; ZeRO-3
/// gathers its shards per use instead), and its optimizer state (`NAME.m`, …), in that order.
fn declare_param_buffers(
    b: &mut ProgramBuilder,
    sh: &Shared,
    name: &str,
    shape: &[u64],
    (zero, bf16): (Option<ZeroSplit>, bool),
) -> (BufferId, Option<BufferId>, Vec<BufferId>) {
    let master_shape = match zero {
        Some(z) => vec![z.shard_len],
        None => shape.to_vec(),
    };
    let has_working = match zero {
        Some(_) => matches!(sh.zero, ZeroStage::Zero1 | ZeroStage::Zero2),
        None => bf16,
    };
    let master_name = match (zero, has_working) {
        (Some(_), _) => format!("{name}.shard"),
        (None, true) => format!("{name}.master"),
        (None, false) => name.to_string(),
    };
    let master = b.declare(
        master_name,
        master_shape.clone(),
        DType::F32,
        BufferKind::Param,
    );
    let working_dtype = if bf16 { DType::Bf16 } else { DType::F32 };
    let working = has_working.then(|| {
        b.declare(
            name.to_string(),
            shape.to_vec(),
            working_dtype,
            BufferKind::Param,
        )
    });
    let state = optimizer_state_names(sh.spec)
        .iter()
        .map(|n| {
            b.declare(
                format!("{name}.{n}"),
                master_shape.clone(),
                DType::F32,
                BufferKind::OptState,
            )
        })
        .collect();
    (master, working, state)
}

/// The names of the optimizer's state tensors per parameter.
fn optimizer_state_names(spec: &Spec) -> &'static [&'static str] {
    match spec.train.optimizer {
        crate::spec::Optimizer::AdamW { .. } => &["m", "v"],
        crate::spec::Optimizer::Sgd { momentum, .. } if momentum != 0.0 => &["momentum"],
        crate::spec::Optimizer::Sgd { .. } => &[],
    }
}

/// Declares the metric buffers: `loss` where `my_chunks` hold the cross-entropy, and
/// `grad_sumsq`.
fn declare_metrics(
    b: &mut ProgramBuilder,
    sh: &Shared,
    my_chunks: &[u32],
) -> (Option<BufferId>, BufferId) {
    let has_loss = my_chunks.iter().any(|&c| {
        let (s, e) = sh.chunks.ranges[c as usize];
        sh.spec.model.nodes[s..e]
            .iter()
            .any(|n| matches!(n.kind, crate::spec::LayerKind::CrossEntropy))
    });
    let loss =
        has_loss.then(|| b.declare("loss".to_string(), vec![1], DType::F32, BufferKind::Metric));
    let grad_sumsq = b.declare(
        "grad_sumsq".to_string(),
        vec![1],
        DType::F32,
        BufferKind::Metric,
    );
    (loss, grad_sumsq)
}

/// This role's sequence positions: its cp segments, every cp rank's in cp order, and its
/// sequence-parallel shard of its own (its own segments without SP).
fn sequence_positions(
    sh: &Shared,
    role: Role,
    sp: bool,
) -> (Vec<Segment>, Vec<Segment>, Vec<Segment>) {
    let seq = sh.spec.model.seq;
    let positions = context::cp_segments(seq, role.cp, role.cp_index);
    let kv_positions: Vec<_> = (0..role.cp)
        .flat_map(|i| context::cp_segments(seq, role.cp, i))
        .collect();
    let local_seq = crate::ir::op::segments_len(&positions);
    let sp_positions = if sp {
        let shard = local_seq / role.tp;
        context::sub_segments(&positions, role.tp_index * shard, shard)
    } else {
        positions.clone()
    };
    (positions, kv_positions, sp_positions)
}

/// The emitter of this role's step, holding the declared parameters and metrics.
fn new_emitter<'a>(
    sh: &Shared<'a>,
    role: Role,
    b: ProgramBuilder,
    (locals, local_of): (Vec<LocalState>, IdMap<ParamId, usize>),
    (loss, grad_sumsq): (Option<BufferId>, BufferId),
) -> Emitter<'a> {
    let spec = sh.spec;
    let sp = spec.parallel.sequence_parallel && role.tp > 1;
    let (positions, kv_positions, sp_positions) = sequence_positions(sh, role, sp);
    Emitter {
        spec,
        params: sh.params,
        chunks: sh.chunks,
        groups: sh.groups,
        b,
        tp: role.tp,
        tp_index: role.tp_index,
        cp: role.cp,
        stage: role.stage,
        sp,
        zero: sh.zero,
        micro_batch: spec.train.micro_batch,
        positions,
        kv_positions,
        sp_positions,
        locals,
        local_of,
        mbs: (0..spec.parallel.microbatches)
            .map(|_| MbState::default())
            .collect(),
        segments: context::recompute_segments(spec),
        selective: spec.parallel.recompute == crate::spec::Recompute::Selective,
        loss,
        grad_sumsq,
        bucket: Vec::new(),
        bucket_bytes: spec.parallel.bucket_bytes,
        reduced: Vec::new(),
        scattered: Vec::new(),
        scattered_parts: Vec::new(),
        gathered: Vec::new(),
        prefetched: Vec::new(),
        keep: Vec::new(),
        kept: Vec::new(),
        errors: Vec::new(),
        phase: crate::ir::Phase::Forward,
        accumulate_in_place: sh.options.accumulate_in_place,
        fuse_epilogues: sh.options.fuse_epilogues,
        evaluating: false,
        residual: storage::ResidualStream::of(&spec.model, &spec.train),
        fp8: sh.fp8,
        fp8_histories: Vec::new(),
    }
}

/// The step's internal lowering errors (E0806): the emitter's own, compute ops with too many
/// operands, and transient buffers that outlive the step.
fn check_step(em: &mut Emitter, sh: &Shared, role: Role) -> Result<(), Diagnostics> {
    let mut diags = Diagnostics::default();
    for e in em.errors.drain(..) {
        diags.push(e);
    }
    if em.b.oversized > 0 {
        diags.push(internal_error(
            sh,
            format!(
                "internal lowering error: {} compute op(s) on {} take more than {} inputs or {} outputs",
                em.b.oversized,
                role.name(),
                crate::ir::operands::MAX_INPUTS,
                crate::ir::operands::MAX_OUTPUTS
            ),
        ));
    }
    let leaked = em.b.live_transients();
    if !leaked.is_empty() {
        let names: Vec<String> = leaked
            .iter()
            .take(5)
            .filter_map(|b| em.b.buffers.get(b.0 as usize).map(|x| x.name.clone()))
            .collect();
        diags.push(internal_error(
            sh,
            format!(
                "internal lowering error: {} buffer(s) outlive the step on {} ({})",
                leaked.len(),
                role.name(),
                names.join(", ")
            ),
        ));
    }
    if diags.has_errors() {
        return Err(diags);
    }
    Ok(())
}

/// An E0806 internal lowering error with `message`, pointing at the plan.
fn internal_error(sh: &Shared, message: String) -> Diagnostic {
    Diagnostic::error("E0806", message)
        .label(sh.spec.parallel.span, "while lowering this plan")
        .help("please report this with the spec file")
}

/// The program of the emitted step: the role's coordinates, buffers, local parameters,
/// instructions and metrics.
fn finish_program(em: Emitter, role: Role) -> Program {
    let params_out = em
        .locals
        .iter()
        .map(|l| LocalParam {
            param: l.param,
            master: l.master,
            working: l.working,
            state: l.state.clone(),
            tp: l.tp,
            zero: l.zero,
        })
        .collect();
    Program {
        role: role.name(),
        coords: vec![
            (Axis::Pp, role.stage),
            (Axis::Cp, role.cp_index),
            (Axis::Tp, role.tp_index),
        ],
        buffers: em.b.buffers,
        params: params_out,
        instrs: em.b.instrs,
        loss: em.loss,
        grad_sumsq: Some(em.grad_sumsq),
    }
}
