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
//! - `builder` / `emitter`: buffer and instruction emission state;
//! - `storage`: which buffers a bf16 run stores in bf16.
//!
//! Programs are shared by ranks that differ only in their dp coordinate.

mod backward;
mod builder;
mod context;
mod emitter;
pub(crate) mod first_write;
mod idmap;
mod layers;
mod optim;
pub(crate) mod params;
mod pipeline;
mod schedule;
mod storage;

pub use schedule::{stage_order, Dir, Unit};

use crate::diag::{Diagnostic, Diagnostics};
use crate::ir::{
    BufferKind, DType, Group, GroupId, LocalParam, Plan, Program, ProgramId, TpSplit, ZeroSplit,
};
use crate::spec::{Axis, Spec, ZeroStage};
use builder::ProgramBuilder;
use context::{Chunks, Groups};
use emitter::{Emitter, LocalState, MbState};
use idmap::IdMap;
use params::{Params, TpRule};
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
}

impl Default for LowerOptions {
    fn default() -> Self {
        LowerOptions {
            accumulate_in_place: true,
            fuse_epilogues: true,
            overwrite_first_grads: true,
        }
    }
}

/// Lower a checked spec to per-rank programs.
pub fn lower(spec: &Spec) -> Result<Plan, Diagnostics> {
    lower_with(spec, LowerOptions::default())
}

/// [`lower`] with explicit [`LowerOptions`].
pub fn lower_with(spec: &Spec, options: LowerOptions) -> Result<Plan, Diagnostics> {
    let diags = context::validate(spec);
    if diags.has_errors() {
        return Err(diags);
    }
    let mesh = &spec.parallel.mesh;
    let world = mesh.world();
    let (p, v) = context::pipeline_shape(spec);
    let chunk_count = p * v;
    let chunks = context::chunks(spec, chunk_count).map_err(one)?;
    let params = params::build(spec);

    let (tp, cp, dp) = (
        mesh.size(Axis::Tp),
        mesh.size(Axis::Cp),
        mesh.size(Axis::Dp),
    );
    let zero = if dp * cp > 1 {
        spec.parallel.zero
    } else {
        ZeroStage::Zero0
    };
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
    // Parameters used on more than one pipeline stage (tied embedding and head).
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

    let orders: Vec<Vec<Unit>> = (0..p)
        .map(|s| schedule::stage_order(spec.parallel.schedule, p, v, spec.parallel.microbatches, s))
        .collect();
    let Some(table) = schedule::simulate(orders, chunk_count) else {
        return Err(one(Diagnostic::error(
            "E0805",
            "the pipeline schedule cannot complete: a stage waits on a unit that never runs",
        )
        .label(spec.parallel.span, "this schedule")
        .help("use gpipe, or 1f1b with microbatches ≥ pp")));
    };

    // One program per (pp, cp, tp) coordinate, in order of first rank.
    let mut role_index: HashMap<(u32, u32, u32), ProgramId> = HashMap::new();
    let mut roles = Vec::new();
    let mut rank_program = Vec::with_capacity(world as usize);
    for r in 0..world {
        let key = (
            mesh.coord(r, Axis::Pp),
            mesh.coord(r, Axis::Cp),
            mesh.coord(r, Axis::Tp),
        );
        let next = ProgramId(roles.len() as u32);
        let id = *role_index.entry(key).or_insert_with(|| {
            roles.push(key);
            next
        });
        rank_program.push(id);
    }
    let shared_ctx = Shared {
        spec,
        params: &params,
        chunks: &chunks,
        groups: &groups,
        zero,
        table: &table,
        param_stages: &param_stages,
        options,
    };
    let programs = emit_all(&shared_ctx, &roles)?;
    let report_rank = mesh.rank_of(&[(Axis::Pp, p - 1)]);
    Ok(Plan {
        world,
        mesh: mesh.clone(),
        micro_batch: spec.train.micro_batch,
        microbatches: spec.parallel.microbatches,
        seq: spec.model.seq,
        params: params.table.clone(),
        groups: plan_groups,
        programs,
        rank_program,
        report_rank,
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
    options: LowerOptions,
}

/// Emit every role's program, spread over the machine's cores (programs are independent).
fn emit_all(sh: &Shared, roles: &[(u32, u32, u32)]) -> Result<Vec<Program>, Diagnostics> {
    let threads = std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
        .clamp(1, roles.len().max(1));
    let per = roles.len().div_ceil(threads).max(1);
    let results: Vec<Result<Program, Diagnostics>> = std::thread::scope(|scope| {
        let handles: Vec<_> = roles
            .chunks(per)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|&key| emit_program(sh, key))
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

fn emit_program(
    sh: &Shared,
    (stage, cp_index, tp_index): (u32, u32, u32),
) -> Result<Program, Diagnostics> {
    let spec = sh.spec;
    let mesh = &spec.parallel.mesh;
    let (tp, cp, dp, p) = (
        mesh.size(Axis::Tp),
        mesh.size(Axis::Cp),
        mesh.size(Axis::Dp),
        mesh.size(Axis::Pp),
    );
    let sp = spec.parallel.sequence_parallel && tp > 1;
    let positions = context::cp_segments(spec.model.seq, cp, cp_index);
    let kv_positions: Vec<_> = (0..cp)
        .flat_map(|i| context::cp_segments(spec.model.seq, cp, i))
        .collect();
    let local_seq = crate::ir::op::segments_len(&positions);
    let sp_positions = if sp {
        let shard = local_seq / tp;
        context::sub_segments(&positions, tp_index * shard, shard)
    } else {
        positions.clone()
    };
    let my_chunks: Vec<u32> = (0..sh.chunks.count).filter(|c| c % p == stage).collect();
    let my_nodes: usize = my_chunks
        .iter()
        .filter_map(|&c| sh.chunks.ranges.get(c as usize))
        .map(|(s, e)| e - s)
        .sum();
    // About 40 instructions and 16 buffers per node and microbatch, forward and backward.
    let work = my_nodes * spec.parallel.microbatches as usize;
    let mut b = ProgramBuilder::with_capacity(work * 40, work * 16);

    // Local parameters in order of first use.
    let mut locals: Vec<LocalState> = Vec::new();
    let mut local_of = IdMap::default();
    let mut uses: HashMap<u32, u32> = HashMap::new();
    for &c in &my_chunks {
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
                let split = match slot.rule {
                    TpRule::Rows if tp > 1 => Some(TpSplit {
                        dim: 0,
                        parts: tp,
                        index: tp_index,
                        sections: None,
                    }),
                    TpRule::RowSections(sections) if tp > 1 => Some(TpSplit {
                        dim: 0,
                        parts: tp,
                        index: tp_index,
                        sections: Some(sections),
                    }),
                    TpRule::Cols if tp > 1 => Some(TpSplit {
                        dim: 1,
                        parts: tp,
                        index: tp_index,
                        sections: None,
                    }),
                    _ => None,
                };
                let mut shape = param.shape.clone();
                if let Some(t) = split {
                    if let Some(d) = shape.get_mut(t.dim as usize) {
                        *d /= u64::from(tp);
                    }
                }
                let numel: u64 = shape.iter().product();
                let zero = match (sh.zero, sh.groups.dpcp) {
                    (ZeroStage::Zero0, _) | (_, None) => None,
                    (_, Some(g)) => {
                        let parts = dp * cp;
                        Some(ZeroSplit {
                            parts,
                            shard_len: numel.div_ceil(u64::from(parts)),
                            group: g,
                        })
                    }
                };
                let master_shape = match zero {
                    Some(z) => vec![z.shard_len],
                    None => shape.clone(),
                };
                let master_name = if zero.is_some() {
                    format!("{}.shard", param.name)
                } else {
                    param.name.clone()
                };
                let master = b.declare(
                    master_name,
                    master_shape.clone(),
                    DType::F32,
                    BufferKind::Param,
                );
                let working = match sh.zero {
                    ZeroStage::Zero1 | ZeroStage::Zero2 if zero.is_some() => Some(b.declare(
                        param.name.clone(),
                        shape.clone(),
                        DType::F32,
                        BufferKind::Param,
                    )),
                    _ => None,
                };
                let state_names: &[&str] = match spec.train.optimizer {
                    crate::spec::Optimizer::AdamW { .. } => &["m", "v"],
                    crate::spec::Optimizer::Sgd { momentum, .. } if momentum != 0.0 => {
                        &["momentum"]
                    }
                    crate::spec::Optimizer::Sgd { .. } => &[],
                };
                let state = state_names
                    .iter()
                    .map(|n| {
                        b.declare(
                            format!("{}.{n}", param.name),
                            master_shape.clone(),
                            DType::F32,
                            BufferKind::OptState,
                        )
                    })
                    .collect();
                let owner_chunk_stage = sh.chunks.chunk_of(param.node.0 as usize) % p;
                let stages_using = sh
                    .param_stages
                    .get(&slot.param.0)
                    .map(Vec::len)
                    .unwrap_or(1);
                let tp_owned = split.is_some() || tp_index == 0;
                let in_norm =
                    tp_owned && owner_chunk_stage == stage && (zero.is_some() || cp_index == 0);
                local_of.insert(slot.param, locals.len());
                locals.push(LocalState {
                    param: slot.param,
                    rule: slot.rule,
                    shape,
                    numel,
                    master,
                    working,
                    state,
                    tp: split,
                    zero,
                    grad: None,
                    final_grad: None,
                    uses_left: 0,
                    complete: false,
                    in_norm,
                    shared: stages_using > 1,
                });
            }
        }
    }
    let m = spec.parallel.microbatches;
    for l in &mut locals {
        l.uses_left = uses.get(&l.param.0).copied().unwrap_or(0) * m;
    }
    let has_loss = my_chunks.iter().any(|&c| {
        let (s, e) = sh.chunks.ranges[c as usize];
        spec.model.nodes[s..e]
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

    let mut em = Emitter {
        spec,
        params: sh.params,
        chunks: sh.chunks,
        groups: sh.groups,
        b,
        tp,
        tp_index,
        cp,
        stage,
        sp,
        zero: sh.zero,
        micro_batch: spec.train.micro_batch,
        positions,
        kv_positions,
        sp_positions,
        locals,
        local_of,
        mbs: (0..m).map(|_| MbState::default()).collect(),
        segments: context::recompute_segments(spec),
        selective: spec.parallel.recompute == crate::spec::Recompute::Selective,
        loss,
        grad_sumsq,
        bucket: Vec::new(),
        bucket_bytes: spec.parallel.bucket_bytes,
        reduced: Vec::new(),
        scattered: Vec::new(),
        gathered: Vec::new(),
        prefetched: Vec::new(),
        keep: Vec::new(),
        kept: Vec::new(),
        errors: Vec::new(),
        phase: crate::ir::Phase::Forward,
        accumulate_in_place: sh.options.accumulate_in_place,
        fuse_epilogues: sh.options.fuse_epilogues,
    };
    em.emit_step(sh.table);
    let mut diags = Diagnostics::default();
    for e in em.errors.drain(..) {
        diags.push(e);
    }
    if em.b.oversized > 0 {
        diags.push(
            Diagnostic::error(
                "E0806",
                format!(
                    "internal lowering error: {} compute op(s) on pp {stage} cp {cp_index} tp {tp_index} take more than {} inputs or {} outputs",
                    em.b.oversized,
                    crate::ir::operands::MAX_INPUTS,
                    crate::ir::operands::MAX_OUTPUTS
                ),
            )
            .label(spec.parallel.span, "while lowering this plan")
            .help("please report this with the spec file"),
        );
    }
    let leaked = em.b.live_transients();
    if !leaked.is_empty() {
        let names: Vec<String> = leaked
            .iter()
            .take(5)
            .filter_map(|b| em.b.buffers.get(b.0 as usize).map(|x| x.name.clone()))
            .collect();
        diags.push(
            Diagnostic::error(
                "E0806",
                format!(
                    "internal lowering error: {} buffer(s) outlive the step on pp {stage} cp {cp_index} tp {tp_index} ({})",
                    leaked.len(),
                    names.join(", ")
                ),
            )
            .label(spec.parallel.span, "while lowering this plan")
            .help("please report this with the spec file"),
        );
    }
    if diags.has_errors() {
        return Err(diags);
    }
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
    let mut program = Program {
        role: format!("pp {stage} cp {cp_index} tp {tp_index}"),
        coords: vec![
            (Axis::Pp, stage),
            (Axis::Cp, cp_index),
            (Axis::Tp, tp_index),
        ],
        buffers: em.b.buffers,
        params: params_out,
        instrs: em.b.instrs,
        loss,
        grad_sumsq: Some(grad_sumsq),
    };
    if sh.options.overwrite_first_grads {
        first_write::overwrite_first_contributions(&mut program);
    }
    storage::assign(&mut program, spec.train.precision);
    Ok(program)
}
