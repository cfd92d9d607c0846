//! The memory verdict of a lowered plan: E0701 when a rank needs more memory than its GPU has,
//! judged on what the runtime would hold, not on formulas. A rank's need is its program's
//! memory plan (persistent region + arena) plus, on a GPU, the CUDA backend's scratch and
//! weight casts, the CUDA context and NCCL's buffers (`memplan::device_memory`, within 0.2% of
//! nvidia-smi on the measured runs, docs/memory.md); on the CPU backend the plan alone.
//!
//! The help is measured the same way: each single change the cost model proposes
//! (`cost::alternatives`: 1F1B for GPipe, a higher ZeRO stage, recompute, doubling tp, cp or pp,
//! halving the micro batch) is lowered and planned by the caller's `measure`, and the help names the first that
//! fits, else the greedy combination that fits, else the largest saving. Each distinct plan is
//! measured once (the combination's first round is the single changes again), and a measured
//! plan's largest need is found without planning every program in full ([`largest_need`]).

use crate::cost::{alternatives, gib, memory_error_head, memory_help, Measure};
use crate::diag::Diagnostic;
use crate::ir::{BufferKind, Plan, Program, ProgramId};
use crate::memplan::{self, ArenaBound, DeviceMemory, KernelTarget, MemPlanError, PlanSummary};
use crate::spec::Spec;
use crate::verify::VerifyReport;
use std::cell::RefCell;
use std::collections::HashMap;

/// What one program of a lowered plan holds.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Need {
    pub role: String,
    pub bytes: u64,
    /// The terms of `bytes`, largest first.
    pub terms: Vec<(String, u64)>,
    /// Its model state by purpose.
    pub model_state: ModelState,
}

/// The model state one program holds (weights, master weights, gradients, optimizer state),
/// by what each parameter's buffers are for, and how many parameters it is the state of:
/// `docs/memory.md`'s bytes per parameter.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct ModelState {
    /// Elements of the parameters the program holds (tp-local, before ZeRO sharding).
    pub params: u64,
    /// The persistent copies compute reads (bf16 working copies; f32 tensors that are their
    /// own master).
    pub weights: u64,
    /// f32 master copies beside the working copies, and ZeRO shards.
    pub master: u64,
    /// Gradients alive at the liveness peak (full accumulators, reduced shards).
    pub gradients: u64,
    /// Optimizer state (Adam's m and v, SGD's momentum).
    pub optimizer: u64,
    /// ZeRO-3's gathered parameters alive at the liveness peak.
    pub gathered: u64,
}

impl ModelState {
    /// What `program` holds, with `peak_by_kind` the verifier's transient bytes at its peak.
    pub fn of(program: &crate::ir::Program, peak_by_kind: &[(String, u64)]) -> ModelState {
        let bytes = |id| program.buffer(id).map_or(0, crate::ir::Buffer::bytes);
        let at_peak = |kind: BufferKind| {
            (peak_by_kind.iter())
                .find(|(name, _)| name == kind.name())
                .map_or(0, |(_, b)| *b)
        };
        let mut state = ModelState {
            gradients: at_peak(BufferKind::Grad),
            gathered: at_peak(BufferKind::GatheredParam),
            ..ModelState::default()
        };
        for local in &program.params {
            let full = match local.working {
                Some(w) => {
                    state.weights += bytes(w);
                    program.buffer(w).map_or(0, crate::ir::Buffer::numel)
                }
                None if local.zero.is_none() => {
                    state.weights += bytes(local.master);
                    program
                        .buffer(local.master)
                        .map_or(0, crate::ir::Buffer::numel)
                }
                None => program.buffer(local.master).map_or(0, |b| {
                    b.numel() * local.zero.map_or(1, |z| u64::from(z.parts))
                }),
            };
            state.params += full;
            if local.working.is_some() || local.zero.is_some() {
                state.master += bytes(local.master);
            }
            state.optimizer += local.state.iter().map(|&s| bytes(s)).sum::<u64>();
        }
        state
    }

    /// Bytes per parameter of (weights, master, gradients, optimizer, gathered, total).
    pub fn per_param(&self) -> [f64; 6] {
        let parts = [
            self.weights,
            self.master,
            self.gradients,
            self.optimizer,
            self.gathered,
        ];
        let total: u64 = parts.iter().sum();
        let mut out = [0.0; 6];
        for (o, b) in out.iter_mut().zip(parts.into_iter().chain([total])) {
            *o = b as f64 / self.params.max(1) as f64;
        }
        out
    }
}

/// The bytes a rank of `spec` holds with `device` (the plan alone on the CPU backend).
pub fn held(spec: &Spec, device: &DeviceMemory) -> u64 {
    if spec.cluster.gpu.name == "cpu" {
        device.planned_bytes
    } else {
        device.total_bytes
    }
}

/// Each program's need, in program order: the memory plan's persistent region by buffer kind,
/// the arena by the kinds alive at the liveness peak (fragmentation as its own term) and the
/// backend's and runtime's lines.
pub fn needs(
    spec: &Spec,
    plan: &Plan,
    verified: &VerifyReport,
    summaries: &[PlanSummary],
    device: &[DeviceMemory],
) -> Vec<Need> {
    let cpu = spec.cluster.gpu.name == "cpu";
    plan.programs
        .iter()
        .zip(summaries.iter().zip(device))
        .enumerate()
        .map(|(i, (program, (summary, device)))| {
            let mut terms = persistent_terms(program);
            let peak_by_kind = verified.programs.get(i).map(|m| m.peak_by_kind.as_slice());
            let model_state = ModelState::of(program, peak_by_kind.unwrap_or(&[]));
            if let Some(memory) = verified.programs.get(i) {
                terms.extend(memory.peak_by_kind.iter().map(|(kind, bytes)| {
                    let words =
                        BufferKind::from_name(kind).map_or(kind.as_str(), |k| k.description());
                    (format!("{words} at the peak"), *bytes)
                }));
            }
            let fragmentation = summary
                .arena_bytes
                .saturating_sub(summary.liveness_peak_bytes);
            terms.push(("arena fragmentation".to_string(), fragmentation));
            if !cpu {
                for line in device.backend.iter().chain(&device.runtime) {
                    terms.push((line.what.to_string(), line.bytes));
                }
            }
            terms.retain(|(_, b)| *b > 0);
            terms.sort_by_key(|t| std::cmp::Reverse(t.1));
            Need {
                role: program.role.clone(),
                bytes: held(spec, device),
                terms,
                model_state,
            }
        })
        .collect()
}

/// The persistent region by buffer kind (parameters, optimizer state, metrics).
fn persistent_terms(program: &crate::ir::Program) -> Vec<(String, u64)> {
    let mut terms: Vec<(String, u64)> = Vec::new();
    for buffer in program.buffers.iter().filter(|b| b.kind.is_persistent()) {
        let name = buffer.kind.description();
        let bytes = crate::memplan::aligned_size(buffer.bytes());
        match terms.iter_mut().find(|(n, _)| n == name) {
            Some((_, b)) => *b += bytes,
            None => terms.push((name.to_string(), bytes)),
        }
    }
    terms
}

/// E0701 when some program of the plan needs more than `spec`'s GPU has. `measure` lowers and
/// plans a changed spec and returns its largest need (`None` when it does not lower).
pub fn memory_verdict(
    spec: &Spec,
    needs: &[Need],
    measure: &dyn Fn(&Spec) -> Option<u64>,
) -> Option<Diagnostic> {
    let measured = RefCell::new(HashMap::new());
    let measure = |changed: &Spec| once(&measured, changed, measure);
    let measure: &dyn Fn(&Spec) -> Option<u64> = &measure;
    let capacity = spec.cluster.gpu.memory_bytes;
    let worst = needs.iter().max_by_key(|n| n.bytes)?;
    let need = worst.bytes;
    if need <= capacity {
        return None;
    }
    let what = format!("program `{}` needs {} per GPU", worst.role, gib(need));
    let mut d = memory_error_head(spec, &what, "").note(format!(
        "measured on the lowered plan: {}",
        terms_text(&worst.terms)
    ));
    let over: Vec<String> = needs
        .iter()
        .filter(|n| n.bytes > capacity)
        .map(|n| format!("{} ({})", n.role, gib(n.bytes)))
        .collect();
    if over.len() > 1 {
        d = d.note(format!("over the limit: {}", over.join(", ")));
    }
    let mut options: Vec<(String, u64)> = alternatives(spec)
        .into_iter()
        .filter_map(|alt| Some((alt.change, measure(&alt.spec)?)))
        .filter(|(_, after)| *after < need)
        .collect();
    options.sort_by_key(|(_, after)| *after);
    for (change, after) in &options {
        d = d.note(format!(
            "{change} saves {} per GPU (peak {}, lowered)",
            gib(need - after),
            gib(*after)
        ));
    }
    let measure = Measure {
        need: measure,
        per: "GPU",
    };
    Some(d.help(memory_help(spec, need, &options, &measure)))
}

/// `measure(spec)`, measured once per distinct spec: `measured` keeps each result by the spec's
/// whole text (its `Debug` form, every field).
fn once(
    measured: &RefCell<HashMap<String, Option<u64>>>,
    spec: &Spec,
    measure: &dyn Fn(&Spec) -> Option<u64>,
) -> Option<u64> {
    let key = format!("{spec:?}");
    if let Some(known) = measured.borrow().get(&key) {
        return *known;
    }
    let need = measure(spec);
    measured.borrow_mut().insert(key, need);
    need
}

/// The largest need of a plan's programs, and how many of them it planned in full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LargestNeed {
    /// The largest `bytes` [`needs`] gives for the plan.
    pub bytes: u64,
    /// The programs whose planned arena was computed (for some, the planner's first order is
    /// all it runs); every other program's first order bounded its need at or below `bytes`.
    pub planned_in_full: usize,
}

/// One program of [`largest_need`]: its arena's bound and what it holds at that bound.
struct Bounded<'p> {
    program: &'p Program,
    bound: ArenaBound,
    device: DeviceMemory,
    /// Its need with the bound's arena: at least its need (a need grows with the arena).
    upper: u64,
}

/// The largest need of `plan`'s programs (lowered from `spec`), as [`needs`] would give it,
/// without planning every program's memory in full: each program's need with the planner's
/// first arena bounds its need from above (`memplan::ArenaBound`), so the planner's other
/// orders run only for the programs, largest bound first, whose bound exceeds the largest need
/// found so far; the rest cannot change it. `None` for a plan without programs.
pub fn largest_need(spec: &Spec, plan: &Plan) -> Result<Option<LargestNeed>, MemPlanError> {
    let target = KernelTarget::of_spec(spec);
    let bounds = memplan::arena_bounds(&plan.programs)?;
    let mut bounded: Vec<Bounded> = (plan.programs.iter().zip(bounds).enumerate())
        .map(|(i, (program, bound))| {
            let id = (ProgramId(i as u32), program);
            let planned = bound.persistent_bytes + bound.upper_bytes;
            let device = memplan::program_device_memory(plan, id, planned, target);
            let upper = held(spec, &device);
            Bounded {
                program,
                bound,
                device,
                upper,
            }
        })
        .collect();
    bounded.sort_by_key(|b| std::cmp::Reverse(b.upper));
    // The largest bound alone first (it is usually the largest need), then as many at once as
    // there are cores of those whose bound still exceeds the largest need.
    let Some((first, mut rest)) = bounded.split_first() else {
        return Ok(None);
    };
    let mut largest = plan_batch(spec, std::slice::from_ref(first), None)?;
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    loop {
        let open = |b: &&Bounded| b.upper > largest.bytes;
        let take = rest.iter().take(threads).take_while(open).count();
        if take == 0 {
            return Ok(Some(largest));
        }
        let (batch, after) = rest.split_at(take);
        largest = plan_batch(spec, batch, Some(largest))?;
        rest = after;
    }
}

/// `largest` with the needs of `batch`'s programs, their arenas planned in full.
fn plan_batch(
    spec: &Spec,
    batch: &[Bounded],
    largest: Option<LargestNeed>,
) -> Result<LargestNeed, MemPlanError> {
    let programs: Vec<(&Program, ArenaBound)> =
        batch.iter().map(|b| (b.program, b.bound)).collect();
    let arenas = memplan::exact_arenas(&programs)?;
    let mut out = largest.unwrap_or(LargestNeed {
        bytes: 0,
        planned_in_full: 0,
    });
    for (b, arena) in batch.iter().zip(arenas) {
        let planned = b.bound.persistent_bytes + arena;
        let need = held(spec, &b.device.clone().with_planned_bytes(planned));
        out.bytes = out.bytes.max(need);
        out.planned_in_full += 1;
    }
    Ok(out)
}

/// The terms of a need over 64 MiB, as `name 1.2 GiB, …`.
fn terms_text(terms: &[(String, u64)]) -> String {
    let shown: Vec<String> = terms
        .iter()
        .filter(|(_, b)| *b >= 1 << 26)
        .map(|(name, b)| format!("{name} {}", gib(*b)))
        .collect();
    if shown.is_empty() {
        "every term under 64 MiB".to_string()
    } else {
        shown.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::ModelState;
    use crate::cost::testspec::{build, Dims, Plan as PlanChoice};
    use crate::spec::{Precision, ZeroStage};

    /// The largest program's model state of GPT-2 350M on `dp` ranks, bf16, AdamW.
    fn state(zero: ZeroStage, dp: u32) -> ModelState {
        let choice = PlanChoice {
            dp,
            zero,
            microbatches: 2,
            micro_batch: 2,
            precision: Precision::Bf16,
            ..PlanChoice::default()
        };
        let spec = build(&Dims::gpt2_350m(), &choice);
        let plan = crate::lower::lower(&spec).expect("lowers");
        let report = crate::verify::verify_spec(&plan, &spec).expect("verifies");
        let (program, memory) = plan
            .programs
            .iter()
            .zip(&report.programs)
            .next()
            .expect("one");
        ModelState::of(program, &memory.peak_by_kind)
    }

    #[test]
    fn bf16_adamw_bytes_per_parameter_follow_the_zero_stage() {
        let n = 4.0;
        // A gradient reduce-scatter in flight holds one bucket, or the largest gradient where
        // that is larger (the tied 50257 × 1024 embedding: 0.58 bytes per parameter).
        let in_flight = 0.8;
        let at = |zero| state(zero, 4).per_param();
        let [w, m, g, o, _, total] = at(ZeroStage::Zero0);
        assert!((w - 2.0).abs() < 0.01 && (m - 4.0).abs() < 0.01, "{w} {m}");
        assert!((g - 4.0).abs() < 0.01 && (o - 8.0).abs() < 0.01, "{g} {o}");
        assert!(total <= 18.01, "ZeRO-0 {total}");
        let total = at(ZeroStage::Zero1)[5];
        assert!(total <= 6.0 + 12.0 / n + 0.05, "ZeRO-1 {total}");
        let total = at(ZeroStage::Zero2)[5];
        assert!(total <= 2.0 + 16.0 / n + in_flight, "ZeRO-2 {total}");
        let [w, .., gathered, total] = at(ZeroStage::Zero3);
        assert_eq!(w, 0.0, "ZeRO-3 keeps no working copies");
        assert!(total - gathered <= 16.0 / n + in_flight, "ZeRO-3 {total}");
    }

    #[test]
    fn fp32_runs_keep_one_f32_copy_of_each_weight() {
        let choice = PlanChoice {
            precision: Precision::Fp32,
            ..PlanChoice::default()
        };
        let spec = build(&crate::memplan::tests::small_model(), &choice);
        let plan = crate::lower::lower(&spec).expect("lowers");
        let program = &plan.programs[0];
        let s = ModelState::of(program, &[]);
        let [w, m, ..] = s.per_param();
        assert_eq!((w, m), (4.0, 0.0));
        assert!(program.params.iter().all(|l| l.working.is_none()));
    }
}

/// The memory verdict's cost: each distinct plan measured once, and a plan's largest need found
/// without planning every program in full.
#[cfg(test)]
mod cost_tests {
    use super::{largest_need, memory_verdict, needs, ModelState, Need};
    use crate::cost::testspec::{build, Dims, Plan as PlanChoice};
    use crate::ir::Plan;
    use crate::lower::{lower_with, LowerOptions};
    use crate::memplan::{device_memory, plan_summaries, KernelTarget};
    use crate::spec::{PipelineSchedule, Recompute, Spec, ZeroStage};
    use std::cell::RefCell;
    use std::collections::HashSet;

    /// `choice`'s plan of the small model, lowered as `parc check` lowers it, and every
    /// program's need.
    fn lowered(choice: &PlanChoice) -> (Spec, Plan, Vec<Need>) {
        let spec = build(&crate::memplan::tests::small_model(), choice);
        let options = LowerOptions {
            representatives: true,
            ..LowerOptions::default()
        };
        let plan = lower_with(&spec, options).expect("lowers");
        let report = crate::verify::verify_spec(&plan, &spec).expect("verifies");
        let summaries = plan_summaries(&plan, &report).expect("plans");
        let device = device_memory(&plan, &summaries, KernelTarget::of_spec(&spec));
        let needs = needs(&spec, &plan, &report, &summaries, &device);
        (spec, plan, needs)
    }

    #[test]
    fn the_largest_need_is_the_largest_of_every_programs_need() {
        let choices = [
            PlanChoice::default(),
            PlanChoice {
                pp: 4,
                microbatches: 8,
                ..PlanChoice::default()
            },
            PlanChoice {
                dp: 2,
                pp: 2,
                tp: 2,
                zero: ZeroStage::Zero3,
                recompute: Recompute::Selective,
                ..PlanChoice::default()
            },
            PlanChoice {
                pp: 2,
                schedule: PipelineSchedule::Interleaved { virtual_stages: 2 },
                ..PlanChoice::default()
            },
        ];
        for choice in &choices {
            let (spec, plan, needs) = lowered(choice);
            let largest = largest_need(&spec, &plan).expect("plans");
            let want = needs.iter().map(|n| n.bytes).max();
            assert_eq!(largest.map(|l| l.bytes), want, "{choice:?}");
        }
    }

    #[test]
    fn the_largest_need_plans_only_the_programs_that_may_hold_it() {
        // 1F1B over 4 stages: the first holds 4 microbatches' activations, the last one.
        let choice = PlanChoice {
            pp: 4,
            microbatches: 8,
            ..PlanChoice::default()
        };
        let (spec, plan, _) = lowered(&choice);
        let largest = largest_need(&spec, &plan)
            .expect("plans")
            .expect("programs");
        assert_eq!((plan.programs.len(), largest.planned_in_full), (4, 1));
    }

    #[test]
    fn a_need_above_what_a_process_can_hold_does_not_fit_an_h100() {
        // nvidia-smi shows an H100 80GB HBM3 of 81,559 MiB, 480 of them reserved by the
        // driver (`memory.reserved`): cuMemGetInfo's total, and the most one process held
        // (nvidia-smi's `memory.used` with every byte allocated), is 81,079 MiB. A need
        // between the two is a run that fails to allocate, so it does not fit.
        let mut spec = build(&Dims::gpt2_350m(), &PlanChoice::default());
        spec.cluster.gpu = crate::check::gpu_named("h100_80gb").expect("catalogued");
        let need = |mib: u64| Need {
            role: "pp 0 cp 0 tp 0".into(),
            bytes: mib << 20,
            terms: Vec::new(),
            model_state: ModelState::default(),
        };
        let measure = |_: &Spec| None;
        assert!(memory_verdict(&spec, &[need(81_079)], &measure).is_none());
        let over = memory_verdict(&spec, &[need(81_400)], &measure).expect("E0701");
        assert_eq!(over.code, "E0701");
    }

    #[test]
    fn the_memory_verdict_measures_each_distinct_plan_once() {
        // No change fits: the help measures the single changes, then greedy combinations of
        // them, whose first round is the single changes again.
        let mut spec = build(&Dims::gpt2_350m(), &PlanChoice::default());
        spec.cluster.gpu.memory_bytes = 1 << 30;
        let need = Need {
            role: "pp 0 cp 0 tp 0".into(),
            bytes: 1 << 40,
            terms: Vec::new(),
            model_state: ModelState::default(),
        };
        let measured = RefCell::new(Vec::new());
        let measure = |s: &Spec| {
            let text = format!("{s:?}");
            let saving = text.len() as u64 % 4096;
            measured.borrow_mut().push(text);
            Some((1 << 40) - saving - 1)
        };
        let d = memory_verdict(&spec, &[need], &measure).expect("E0701");
        assert!(d
            .help
            .as_deref()
            .is_some_and(|h| h.contains("no combination")));
        let measured = measured.into_inner();
        let distinct: HashSet<&String> = measured.iter().collect();
        assert!(measured.len() > 3, "{} plans measured", measured.len());
        assert_eq!(distinct.len(), measured.len(), "a plan was measured twice");
    }
}
