//! The compile driver: the one place where the stages are chained. [`compile`] takes a spec's
//! text and its `--set` overrides through check → cost model → lower → verify → memory plan →
//! timeline, as far as [`CompileOptions`] asks, and hands back what every stage produced with
//! all diagnostics in the order they were found ([`Compiled`]). [`analyze`] runs the stages
//! after lowering on a plan lowered elsewhere (the runtime verifies the plans it is given
//! through it).
//!
//! It owns the order of the stages and one rule: a stage runs only when every diagnostic so
//! far is a warning, so a later stage never sees the input an earlier one refused. The stages
//! themselves live in their modules; reading files and showing results is the caller's.

use crate::cost::{self, CostReport};
use crate::diag::{Diagnostic, Diagnostics, Sources};
use crate::ir::Plan;
use crate::memplan::{self, DeviceMemory, PlanSummary};
use crate::overrides::Override;
use crate::spec::Spec;
use crate::timeline::{self, Timeline};
use crate::verify::{self, VerifyReport};

/// The stages, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// Parse and check the spec (and run the cost model when asked).
    Check,
    /// Lower the spec to a plan: one program per rank role.
    Lower,
    /// Verify the plan and measure each program's peak memory.
    Verify,
    /// Plan each program's memory and predict the memory per GPU on the CUDA backend.
    MemoryPlan,
    /// Simulate one step of the plan.
    Timeline,
}

/// Which stages [`compile`] runs.
#[derive(Clone, Debug, PartialEq)]
pub struct CompileOptions {
    /// The last stage to run.
    pub through: Stage,
    /// Estimate the spec's costs with the cost model after checking; its diagnostics (memory
    /// that does not fit, …) join the others and, when errors, stop lowering.
    pub cost_model: bool,
    /// Stop after checking, without an error, when the plan is larger than this
    /// ([`plan_size`]); `None` lowers plans of any size.
    pub max_plan_size: Option<u64>,
    /// Run the fusion pass on the lowered programs (`crate::fuse`; on by default): the verifier,
    /// memory planner and timeline then see the fused programs.
    pub fusion: bool,
    /// Lower one program per class of roles (`lower::LowerOptions::representatives`): the
    /// stages after lowering give the full plan's results for a fraction of the work, but the
    /// plan cannot run. For `parc check`.
    pub representatives: bool,
    /// The measured profile that prices the timeline (`timeline::ProfileCosts`); `None`: the
    /// GPU's peak numbers.
    pub calibration: Option<std::sync::Arc<timeline::Calibration>>,
    /// Whether the timeline records its trace events (`timeline::Events`; `parc plan --emit
    /// trace` shows them); without, its numbers are the same.
    pub trace: bool,
}

impl CompileOptions {
    /// Run every stage up to `stage`, without the cost model and at any plan size.
    pub fn through(stage: Stage) -> CompileOptions {
        CompileOptions {
            through: stage,
            cost_model: false,
            max_plan_size: None,
            fusion: true,
            representatives: false,
            calibration: None,
            trace: false,
        }
    }
}

/// What [`compile`] produced: each stage's result, `None` for a stage that did not run or
/// failed (its errors are in `diagnostics`).
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The main file, the stdlib modules it uses and the overrides: what spans point into.
    pub sources: Sources,
    /// Every diagnostic of every stage that ran, in the order found.
    pub diagnostics: Diagnostics,
    /// The checked spec (`None` when checking found errors).
    pub spec: Option<Spec>,
    /// The cost model's estimate, with [`CompileOptions::cost_model`].
    pub cost: Option<CostReport>,
    /// Each linear layer's precision under `train.fp8` and why (`crate::fp8::choices`,
    /// priced by the calibration profile when given): what the lowered plan runs.
    pub fp8: Vec<crate::fp8::Choice>,
    pub plan: Option<Plan>,
    /// The stages after lowering.
    pub analysis: Analysis,
}

/// What the stages after lowering produced.
#[derive(Clone, Debug, Default)]
pub struct Analysis {
    /// The verifier's report: the runtime runs only plans that have one.
    pub verified: Option<VerifyReport>,
    pub memory: Option<MemoryPlans>,
    pub timeline: Option<Timeline>,
    /// What each program holds per GPU, by term (with the memory plan): what the memory
    /// verdict judges.
    pub fit: Option<Vec<crate::fit::Need>>,
}

/// Every program's memory plan, in program order.
#[derive(Clone, Debug)]
pub struct MemoryPlans {
    /// Each plan beside the verifier's liveness peak.
    pub programs: Vec<PlanSummary>,
    /// Each program's predicted memory per GPU on the CUDA backend.
    pub device: Vec<DeviceMemory>,
}

/// A plan's size as lowering's time grows with it: layers × microbatches.
pub fn plan_size(spec: &Spec) -> u64 {
    u64::from(spec.model.layers.max(1)) * u64::from(spec.parallel.microbatches)
}

/// Compile the spec `text` (shown as `name` in diagnostics) with `overrides` through the
/// stages `options` asks for.
pub fn compile(
    name: &str,
    text: String,
    overrides: &[Override],
    options: &CompileOptions,
) -> Compiled {
    let mut sources = Sources::default();
    let main = sources.add(name, text);
    let (spec, mut diagnostics, assumed) =
        crate::check::check_assuming(&mut sources, main, overrides);
    if let Some(assumed) = assumed.filter(|_| options.cost_model) {
        diagnostics.extend(memory_assuming(&assumed));
    }
    // A plan that will be lowered and planned gets its memory verdict from that (`fit`); the
    // formulas judge memory only for a plan that is not.
    let judged_lowered = spec
        .as_ref()
        .is_some_and(|s| wants_plan(s, options) && options.through >= Stage::MemoryPlan);
    let cost = match &spec {
        Some(spec) if options.cost_model => {
            Some(estimate_costs(spec, !judged_lowered, &mut diagnostics))
        }
        _ => None,
    };
    // The lowering's checks of the spec, once: their warnings (W1201) are the driver's to
    // report (`lower_with` refuses a spec they find errors in, and reports only those).
    let lowering_checks = (spec.as_ref())
        .filter(|_| !diagnostics.has_errors())
        .map(crate::lower::validate)
        .unwrap_or_default();
    let (check_errors, check_warnings): (Vec<_>, Vec<_>) = (lowering_checks.items.into_iter())
        .partition(|d| d.severity == crate::diag::Severity::Error);
    check_warnings.into_iter().for_each(|d| diagnostics.push(d));
    let calibration = options.calibration.as_deref();
    let fp8 = (spec.as_ref())
        .map(|spec| crate::fp8::choices(spec, prices(calibration)))
        .unwrap_or_default();
    let plan = match &spec {
        Some(spec) if !diagnostics.has_errors() && wants_plan(spec, options) => {
            let lowering = crate::lower::LowerOptions {
                fusion: options.fusion,
                representatives: options.representatives,
                ..crate::lower::LowerOptions::default()
            };
            keep(
                crate::lower::lower_chosen(spec, lowering, &fp8),
                &mut diagnostics,
            )
        }
        // Not lowered (`--lower never`): the lowering's checks of the spec still run, so a
        // spec it would refuse is not reported ok.
        Some(_) if !diagnostics.has_errors() => {
            check_errors.into_iter().for_each(|d| diagnostics.push(d));
            None
        }
        _ => None,
    };
    let analysis = match (&spec, &plan) {
        (Some(spec), Some(plan)) => {
            let events = if options.trace {
                timeline::Events::Record
            } else {
                timeline::Events::Skip
            };
            let through = options.through;
            analyze_with(spec, plan, through, calibration, events, &mut diagnostics)
        }
        _ => Analysis::default(),
    };
    if let (Some(spec), Some(fit)) = (&spec, &analysis.fit) {
        let measure = |changed: &Spec| measured_need(changed, options.fusion, calibration);
        if let Some(d) = crate::fit::memory_verdict(spec, fit, &measure) {
            diagnostics.push(d);
        }
    }
    Compiled {
        sources,
        diagnostics,
        spec,
        cost,
        fp8,
        plan,
        analysis,
    }
}

/// The FP8 choice's prices from `calibration`, if any.
pub fn prices(calibration: Option<&timeline::Calibration>) -> Option<&dyn crate::fp8::GemmPrices> {
    calibration.map(|c| c as &dyn crate::fp8::GemmPrices)
}

/// Run the stages after lowering, up to `through`, on `plan` (lowered from `spec`); their
/// diagnostics join `diagnostics`. The timeline records no trace events.
pub fn analyze(
    spec: &Spec,
    plan: &Plan,
    through: Stage,
    diagnostics: &mut Diagnostics,
) -> Analysis {
    analyze_with(
        spec,
        plan,
        through,
        None,
        timeline::Events::Skip,
        diagnostics,
    )
}

/// [`analyze`], its timeline priced by `calibration` when given and recording its trace
/// events as `events` says.
pub fn analyze_with(
    spec: &Spec,
    plan: &Plan,
    through: Stage,
    calibration: Option<&timeline::Calibration>,
    events: timeline::Events,
    diagnostics: &mut Diagnostics,
) -> Analysis {
    let verified = if through >= Stage::Verify {
        verified(spec, plan, diagnostics)
    } else {
        None
    };
    // The timeline reads only the verified plan, so it is simulated beside the memory plan
    // (on its own thread) and kept only when the memory plan succeeds.
    let (memory, timeline) = match &verified {
        Some(verified) if through >= Stage::MemoryPlan => std::thread::scope(|scope| {
            let simulated = (through >= Stage::Timeline).then(|| {
                scope.spawn(move || timeline::simulate_calibrated(plan, spec, calibration, events))
            });
            let memory = plan_memory(spec, plan, verified, diagnostics);
            // A panic in the simulation stays a panic, as it was on this thread.
            let timeline = simulated.map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            });
            match memory {
                Some(memory) => (Some(memory), timeline),
                None => (None, None),
            }
        }),
        _ => (None, None),
    };
    let fit = match (&verified, &memory) {
        (Some(verified), Some(memory)) => Some(crate::fit::needs(
            spec,
            plan,
            verified,
            &memory.programs,
            &memory.device,
        )),
        _ => None,
    };
    Analysis {
        verified,
        memory,
        timeline,
        fit,
    }
}

/// The verifier's report on `plan` and, where it has one, on its evaluation steps (they run on
/// the same ranks: verified as a plan of their own); `None` when either fails.
fn verified(spec: &Spec, plan: &Plan, diagnostics: &mut Diagnostics) -> Option<VerifyReport> {
    keep(verify::verify_spec(plan, spec), diagnostics).filter(|_| {
        plan.eval_plan()
            .is_none_or(|eval| keep(verify::verify_spec(&eval, spec), diagnostics).is_some())
    })
}

fn wants_plan(spec: &Spec, options: &CompileOptions) -> bool {
    options.through >= Stage::Lower
        && options
            .max_plan_size
            .is_none_or(|largest| plan_size(spec) <= largest)
}

/// The cost model's estimate; its diagnostics join `diagnostics` (its memory error only with
/// `judge_memory`).
fn estimate_costs(spec: &Spec, judge_memory: bool, diagnostics: &mut Diagnostics) -> CostReport {
    let report = cost::estimate(spec);
    if judge_memory {
        diagnostics.extend(cost::diagnose(spec, &report));
    } else {
        diagnostics.extend(cost::warnings(spec, &report));
    }
    report
}

/// The cost formulas' memory verdict (E0701) on a spec whose batch arithmetic failed, judged
/// with E0501's fix assumed, so both errors are reported in one run.
fn memory_assuming(assumed: &crate::check::Assumed) -> Diagnostics {
    let report = cost::estimate(&assumed.spec);
    let mut out = Diagnostics::default();
    for d in cost::diagnose(&assumed.spec, &report).items {
        if d.code == "E0701" {
            let judged = format!("judged as if {}, E0501's fix", assumed.fix);
            let message = match d.message.strip_suffix(')') {
                Some(head) => format!("{head}; {judged})"),
                None => format!("{} ({judged})", d.message),
            };
            out.push(Diagnostic {
                message,
                ..d.note("fixing the batch alone does not make it fit")
            });
        }
    }
    out
}

/// The largest memory any rank of `spec`'s plan holds, lowered (one program per class),
/// verified and planned (`fit::largest_need`: as `analyze` would judge it, planning in full
/// only the programs that may hold the most); `None` when it does not lower, verify or plan.
fn measured_need(
    spec: &Spec,
    fusion: bool,
    calibration: Option<&timeline::Calibration>,
) -> Option<u64> {
    let options = crate::lower::LowerOptions {
        fusion,
        representatives: true,
        ..crate::lower::LowerOptions::default()
    };
    let fp8 = crate::fp8::choices(spec, prices(calibration));
    let plan = crate::lower::lower_chosen(spec, options, &fp8).ok()?;
    // The verdict and the need read the plan alone: the verifier runs beside the planner.
    let (verifies, largest) = std::thread::scope(|scope| {
        let verifying = scope.spawn(|| verified(spec, &plan, &mut Diagnostics::default()));
        let largest = crate::fit::largest_need(spec, &plan);
        (verifying.join().ok().flatten().is_some(), largest)
    });
    let largest = largest.ok()??;
    verifies.then_some(largest.bytes)
}

/// A stage's result, its errors moved into `diagnostics`.
fn keep<T>(result: Result<T, Diagnostics>, diagnostics: &mut Diagnostics) -> Option<T> {
    result.map_err(|errors| diagnostics.extend(errors)).ok()
}

/// Plan every program's memory, check it against the verified liveness peaks and predict the
/// memory per GPU. A failure is a planner bug (the plan verified), reported as E0818.
fn plan_memory(
    spec: &Spec,
    plan: &Plan,
    verified: &VerifyReport,
    diagnostics: &mut Diagnostics,
) -> Option<MemoryPlans> {
    let programs = match memplan::plan_summaries(plan, verified) {
        Ok(programs) => programs,
        Err(e) => {
            diagnostics
                .push(Diagnostic::error("E0818", e.to_string()).help(
                    "this is a bug in parc's memory planner: please report it with the spec",
                ));
            return None;
        }
    };
    let target = memplan::KernelTarget::of_spec(spec);
    let device = memplan::device_memory(plan, &programs, target);
    Some(MemoryPlans { programs, device })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = include_str!("../../examples/tiny.par");

    fn tiny(options: &CompileOptions) -> Compiled {
        compile("tiny.par", TINY.to_string(), &[], options)
    }

    #[test]
    fn every_stage_runs_through_the_timeline() {
        let mut options = CompileOptions::through(Stage::Timeline);
        options.cost_model = true;
        let compiled = tiny(&options);
        assert!(!compiled.diagnostics.has_errors());
        assert!(compiled.spec.is_some() && compiled.cost.is_some() && compiled.plan.is_some());
        let analysis = &compiled.analysis;
        assert!(analysis.verified.is_some() && analysis.timeline.is_some());
        let memory = analysis
            .memory
            .as_ref()
            .map(|m| (m.programs.len(), m.device.len()));
        assert_eq!(memory, Some((1, 1)));
    }

    #[test]
    fn stages_after_through_do_not_run() {
        let compiled = tiny(&CompileOptions::through(Stage::Lower));
        assert!(compiled.plan.is_some() && compiled.cost.is_none());
        assert!(compiled.analysis.verified.is_none());
        let checked = tiny(&CompileOptions::through(Stage::Check));
        assert!(checked.spec.is_some() && checked.plan.is_none());
    }

    #[test]
    fn a_plan_over_the_size_limit_stops_after_checking_without_an_error() {
        let mut options = CompileOptions::through(Stage::Timeline);
        options.max_plan_size = Some(1);
        let compiled = tiny(&options);
        assert!(compiled.spec.is_some() && compiled.plan.is_none());
        assert!(!compiled.diagnostics.has_errors());
    }

    #[test]
    fn a_spec_with_errors_is_not_lowered() {
        let broken = compile(
            "broken.par",
            "model m {".to_string(),
            &[],
            &CompileOptions::through(Stage::Timeline),
        );
        assert!(broken.diagnostics.has_errors());
        assert!(broken.spec.is_none() && broken.plan.is_none());
        assert_eq!(broken.sources.files.len(), 1);
    }
}
