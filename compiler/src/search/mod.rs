//! Plan search (`parc plan --search`): the plans of [`space`] for a spec on a number of GPUs,
//! each checked, the likely ones lowered, and the ones that fit ranked by predicted step time.
//!
//! 1. **Estimate** every candidate with the cost formulas on the checked spec changed in memory
//!    (microseconds each): their memory rejects only plans over 1.5× the GPU's (the formulas err
//!    low, docs/cost-model.md; the verdict is the lowered plan's).
//! 2. **Order** the rest by the formulas' step estimate: the slowest role's compute and
//!    tp/cp/pp communication over (1 − bubble), plus its gradient reduction, the compute
//!    scaled by how far below the GPU's peak the calibration profile runs the candidate's
//!    GEMMs ([`gemm_rate`]: the formulas price compute at the peak). A candidate whose
//!    formula memory, times the largest underestimate seen on the plans lowered so far, is over
//!    the GPU's waits until the others are tried.
//! 3. **Check and lower** them in that order (the spec with the candidate's `--set` settings
//!    through the checker, whose errors reject it under their code; then one program per class
//!    of ranks as `parc check` does), until `top` fit and at least
//!    [`SearchOptions::lower_at_least`] were lowered, or [`SearchOptions::lower_at_most`] were;
//!    once `top` fit, on while a candidate left could still beat the `top`-th (its estimate at
//!    the smallest simulated-over-estimated ratio seen), up to
//!    [`SearchOptions::extend_at_most`] and a budget of lowered instructions
//!    ([`SearchOptions::lower_work`]: many lowerings of a small model, few of a large one;
//!    counted plan by plan, each lowering predicted before it is made, `work`, so one that would
//!    overrun it waits while cheaper ones are lowered):
//!    memory per GPU from the lowered plan (`fit`, the verdict
//!    E0701 gives) rejects what does not fit; the timeline gives the step time, bubble and
//!    exposed communication of the rest, which are ranked by step time. A candidate with more
//!    microbatches than that is simulated at 2p and 2p + 1 microbatches (interleaved: 2p and
//!    3p) and extrapolated linearly (the steady state repeats; `tests` hold the extrapolation
//!    to the whole simulation); only the larger sample is verified and memory-planned (memory
//!    per GPU does not grow with more microbatches). Every lowering of a batch of candidates
//!    is a job for one thread per core.
//! 4. **Confirm** the fastest: the winner is lowered and simulated whole, as `parc check` would,
//!    so its numbers are check's, where its whole lowering is within the work (else it keeps
//!    its sampled numbers, [`Ranked::sampled`]); the others shown keep their sampled numbers. An `auto` stage
//!    balance that splits the layers evenly is the even candidate and is not tried twice.
//!
//! Every rejection is counted by rule, in plans (the arithmetic's, the checker's by code with its
//! first message, the memory verdicts'), and the plan closest to fitting is kept, so a space
//! with no plan that fits says which constraint rejected the most and by how much; it also
//! looks for the nearest clusters where the formulas put a plan under the GPU's memory
//! ([`FitsOn`]), so it can say what to change.
//!
//! A spec whose own plan fails (a mesh for another cluster, an interleaved schedule its
//! microbatches do not suit, a `layers` list for another pipeline) is still searched, on its
//! own cluster unless told another: the model and recipe are checked under a neutral plan on
//! one GPU ([`prepare`]), and [`Base::own_plan`] says what failed.

mod gemm_rate;
pub mod space;
mod work;

use crate::cost::CostReport;
use crate::diag::Diagnostics;
use crate::driver::{self, analyze_with, prices, CompileOptions, Compiled, Stage};
use crate::ir::Plan;
use crate::lower::{lower_chosen, LowerOptions};
use crate::overrides::Override;
use crate::spec::{Axis, PipelineSchedule, Recompute, Spec, ZeroStage};
pub use space::Candidate;

/// What a search covers.
#[derive(Clone, Debug)]
pub struct SearchOptions {
    /// Nodes and GPUs per node of the cluster searched (the spec's unless given).
    pub nodes: Option<u32>,
    pub gpus_per_node: Option<u32>,
    /// Plans to rank and show.
    pub top: usize,
    /// Candidates lowered at least (when there are that many), so the winner does not depend
    /// on `top`: the formulas' order is only roughly the timeline's. Past it (and `top`
    /// fitting), lowering goes on while a candidate left could still be among the `top`
    /// fastest ([`Lowering::promising`]).
    pub lower_at_least: usize,
    /// Most candidates lowered, in the formulas' order, while fewer than `top` fit.
    pub lower_at_most: usize,
    /// Most candidates lowered once `top` fit, going on while one left is
    /// [`Lowering::promising`] (and `lower_work` is not spent).
    pub extend_at_most: usize,
    /// Instructions lowered (sampled programs, [`Ranked::instructions`]) past which the search
    /// stops going on for candidates that are only [`Lowering::promising`] (and, at four times
    /// this, stops looking for `top` plans that fit, lowers no candidate predicted to take it
    /// past that, and lowers the winner whole only within it): a budget of work, the same on
    /// every machine, so a large model lowers few candidates and a small one many.
    pub lower_work: u64,
    /// Lower with the fusion pass (as the run would).
    pub fusion: bool,
    /// The profile that prices the timeline (`None`: the GPU's peak numbers).
    pub calibration: Option<std::sync::Arc<crate::timeline::Calibration>>,
    /// The backend's verdict on a lowered plan: why it cannot run it, or `None` where it can
    /// (the CUDA backend's for a GPU cluster). A candidate it refuses is rejected under
    /// [`BACKEND_RULE`] with its reason, so the search recommends only plans `parc run` runs.
    pub refuse: Option<Refusal>,
}

/// Why a backend cannot run a lowered plan, or `None` where it can.
pub type Refusal = fn(&Plan) -> Option<String>;

/// How candidates are lowered, priced and judged.
#[derive(Clone, Default)]
struct Pricing {
    fusion: bool,
    calibration: Option<std::sync::Arc<crate::timeline::Calibration>>,
    refuse: Option<Refusal>,
}

/// A plan that fits, with what the lowered plan predicts.
#[derive(Clone, Debug)]
pub struct Ranked {
    pub candidate: Candidate,
    pub step_seconds: f64,
    pub tokens_per_second: f64,
    /// Model FLOPs (no recompute) over the step and the GPUs' peak.
    pub mfu: f64,
    /// Memory per GPU of each program (class of ranks), by role.
    pub memory: Vec<(String, u64)>,
    pub bubble_fraction: f64,
    pub exposed_comm_fraction: f64,
    /// Instructions of the programs lowered to rank it (both samples where it was sampled):
    /// the search's measure of its work.
    pub instructions: u64,
    /// The microbatch counts it was simulated at when its numbers are extrapolated from two
    /// samples (`None`: simulated whole).
    pub sampled: Option<(u32, u32)>,
}

/// How many plans a rule rejected, and the one that came closest (for memory: the smallest
/// need over the GPU's memory).
#[derive(Clone, Debug)]
pub struct Rejection {
    /// An arithmetic rule or a memory verdict in words, or the code of the checker's (or the
    /// lowering's) error.
    pub rule: String,
    /// One of the space's arithmetic rules (a plan that cannot be), not a verdict on a plan
    /// that could (the checker's, memory's).
    pub arithmetic: bool,
    /// For a code, the first rejection's message, numbers and all.
    pub example: Option<String>,
    pub count: u64,
    pub closest: Option<(Candidate, u64)>,
}

impl Rejection {
    /// Whether the rule is memory per GPU (by the formulas, corrected or not, or the lowered
    /// plan).
    pub fn is_memory(&self) -> bool {
        self.rule.starts_with("memory per GPU")
    }
}

/// The nearest clusters, fewer GPUs and more, on which the formulas (times the largest
/// underestimate seen on lowered plans) put a plan of the space under the GPU's memory, each
/// as (nodes, GPUs per node): found only when no plan fits.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FitsOn {
    pub fewer: Option<(u32, u32)>,
    pub more: Option<(u32, u32)>,
}

/// What a search found.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The plans that fit, fastest first (at most `top`).
    pub ranked: Vec<Ranked>,
    /// By rule, the most first.
    pub rejected: Vec<Rejection>,
    /// Plans in the space, the arithmetic's rejections included; those the arithmetic left;
    /// those within the formulas' loose memory bound, ordered by their step estimate; those
    /// checked and lowered.
    pub plans: u64,
    pub candidates: usize,
    pub considered: usize,
    pub lowered: usize,
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub gpus: u32,
    pub gpu_memory_bytes: u64,
    /// The recipe's global batch (sequences per step), which every plan searched keeps.
    pub global_batch: u64,
    /// The largest lowered memory over the formulas' seen (1 when nothing was lowered).
    pub underestimate: f64,
    /// With no plan that fits, where one would (`FitsOn::default()` otherwise).
    pub fits_on: FitsOn,
}

/// What a search starts from: the spec whose model and recipe are searched, the cluster it is
/// searched on, and why the spec's own plan failed when it did.
#[derive(Clone, Debug)]
pub struct Base {
    pub spec: Spec,
    pub nodes: u32,
    pub gpus_per_node: u32,
    /// The spec's own plan's first error (code and message) when it does not check: the
    /// search then starts from a neutral plan ([`neutral_spec`]).
    pub own_plan: Option<String>,
}

/// How far a search is, for a progress bar.
#[derive(Clone, Copy, Debug)]
pub enum Progress {
    Checking { done: usize, total: usize },
    Lowering { done: usize, total: usize },
}

/// Search the plans of the spec `text` (with `overrides`) on its cluster, or on the nodes and
/// GPUs `options` give. `Err` is the base spec's compile, whose diagnostics say why it fails.
pub fn search(
    name: &str,
    text: &str,
    overrides: &[Override],
    options: &SearchOptions,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<Outcome, Box<Compiled>> {
    let base = prepare(name, text, overrides, options)?;
    Ok(search_from(&base, name, text, overrides, options, progress))
}

/// [`search`] from a [`prepare`]d base (whose spec names the GPU, for choosing a calibration
/// profile first).
pub fn search_from(
    base: &Base,
    name: &str,
    text: &str,
    overrides: &[Override],
    options: &SearchOptions,
    progress: &(dyn Fn(Progress) + Sync),
) -> Outcome {
    let sets = with_cluster(overrides, options);
    let spec = &base.spec;
    let (nodes, gpus_per_node) = (base.nodes, base.gpus_per_node);
    let gpus = nodes * gpus_per_node;
    let capacity = spec.cluster.gpu.memory_bytes;
    let space = space::space(spec, gpus, gpus_per_node);
    let plans = space.plans();
    let (total, shape) = (space.candidates.len(), (nodes, gpus_per_node));
    let mut rejected: Vec<Rejection> = space
        .rejected
        .iter()
        .map(|(rule, count)| Rejection {
            rule: rule.clone(),
            arithmetic: true,
            example: None,
            count: *count,
            closest: None,
        })
        .collect();
    let rates = gemm_rate::GemmRates::new(prices(options.calibration.as_deref()));
    let candidates = space.candidates;
    let (mut queue, even) =
        estimate_all(spec, (candidates, &rates), shape, &mut rejected, progress);
    let (plans, candidates) = (plans - even as u64, total - even);
    queue.sort_by(|a, b| a.step.total_cmp(&b.step));
    let estimated = queue.len();
    let how = Pricing {
        fusion: options.fusion,
        calibration: options.calibration.clone(),
        refuse: options.refuse,
    };
    let mut lowering = Lowering {
        name,
        text,
        sets: &sets,
        capacity,
        how: how.clone(),
        underestimate: 1.0,
        lowered: 0,
        fastest_ratio: f64::INFINITY,
        work: 0,
        rate: work::Rate::new(spec.model.layers),
        ranked: 0,
        refused: Vec::new(),
        rejected: &mut rejected,
    };
    let fitting = lowering.run(&mut queue, options, progress);
    let (lowered, underestimate) = (lowering.lowered, lowering.underestimate);
    // The winner is lowered whole where the work that takes is within the search's.
    let (done, rate) = (lowering.work, lowering.rate);
    let cap = work::cap(options.lower_work);
    let affordable = |c: &Candidate| done.saturating_add(rate.whole(c)) <= cap;
    let mut ranked = confirm(
        fitting,
        (options.top, &how),
        capacity,
        &affordable,
        &mut rejected,
    );
    ranked.sort_by(|a, b| a.step_seconds.total_cmp(&b.step_seconds));
    let fits_on = if ranked.is_empty() {
        judge_unlowered(queue, capacity, underestimate, &mut rejected);
        fits_on(spec, shape, underestimate)
    } else {
        FitsOn::default()
    };
    rejected.sort_by_key(|r| std::cmp::Reverse(r.count));
    Outcome {
        ranked,
        rejected,
        plans,
        candidates,
        considered: estimated,
        lowered,
        nodes,
        gpus_per_node,
        gpus,
        gpu_memory_bytes: capacity,
        global_batch: spec.train.global_batch,
        underestimate,
        fits_on,
    }
}

/// `overrides` with the cluster `options` give.
fn with_cluster(overrides: &[Override], options: &SearchOptions) -> Vec<Override> {
    let mut sets = overrides.to_vec();
    if let Some(n) = options.nodes {
        sets.push(set("cluster.nodes", n.to_string()));
    }
    if let Some(g) = options.gpus_per_node {
        sets.push(set("cluster.gpus_per_node", g.to_string()));
    }
    sets
}

/// With no plan that fits, a verdict on the candidates left unlowered too: over the GPU's
/// memory by the formulas times the most a lowered plan ran over them ([`LEARNT_RULE`]), or
/// within it and so only not tried ([`UNTRIED_RULE`]).
fn judge_unlowered(
    queue: Vec<Estimated>,
    capacity: u64,
    underestimate: f64,
    rejected: &mut Vec<Rejection>,
) {
    for e in queue {
        let corrected = e.memory as f64 * underestimate;
        let rule = if corrected > capacity as f64 {
            LEARNT_RULE
        } else {
            UNTRIED_RULE
        };
        count(rejected, &Why::rule(rule), None);
    }
}

/// Where a plan would fit when none does on `(nodes, gpus per node)`: the nearest clusters of
/// [`cluster_shapes`], fewer GPUs and more, with a plan of the space (its arithmetic rules
/// applied) whose leanest form (recompute full, micro batch 1, ZeRO-3 where dp·cp > 1, 1F1B,
/// even stages, or the cost model's where pp does not divide the layers) the formulas, times
/// `underestimate`, put under the GPU's memory.
fn fits_on(spec: &Spec, (nodes, gpus_per_node): (u32, u32), underestimate: f64) -> FitsOn {
    let gpus = nodes * gpus_per_node;
    let capacity = spec.cluster.gpu.memory_bytes as f64;
    let fits = |&(n, g): &(u32, u32)| {
        space::space(spec, n * g, g)
            .candidates
            .into_iter()
            .filter(|c| leanest(c, spec.model.layers.max(1)))
            .filter_map(|c| estimate(spec, c, (n, g), &gemm_rate::GemmRates::new(None)))
            .any(|e| e.memory as f64 * underestimate <= capacity)
    };
    let shapes = cluster_shapes(nodes, gpus_per_node);
    FitsOn {
        fewer: (shapes.iter().rev())
            .filter(|(n, g)| n * g < gpus)
            .find(|s| fits(s))
            .copied(),
        more: (shapes.iter())
            .filter(|(n, g)| n * g > gpus)
            .find(|s| fits(s))
            .copied(),
    }
}

/// Whether a candidate is the leanest in memory of its mesh (of `layers` repeated layers).
fn leanest(c: &Candidate, layers: u32) -> bool {
    let zero = if c.dp * c.cp > 1 {
        ZeroStage::Zero3
    } else {
        ZeroStage::Zero0
    };
    c.recompute == Recompute::Full
        && c.micro_batch == 1
        && c.zero == zero
        && c.schedule == PipelineSchedule::OneFOneB
        && (c.balance == crate::spec::Balance::Even || !layers.is_multiple_of(c.pp))
}

/// The clusters [`fits_on`] tries, fewest GPUs first, as (nodes, GPUs per node): on one node,
/// 1 to 8 GPUs and the powers of two up to the node's size; then nodes of the larger of 8 and
/// that size (or of the given size, over several nodes), every count up to 64 (a model's
/// layers and batch often divide only by odd counts) and doubling after, up to 65,536 GPUs.
fn cluster_shapes(nodes: u32, gpus_per_node: u32) -> Vec<(u32, u32)> {
    const MOST: u32 = 65_536;
    let (mut out, node) = if nodes <= 1 {
        let node = gpus_per_node.max(8);
        let mut counts: Vec<u32> = (1..=8).chain((4..16).map(|k| 1 << k)).collect();
        counts.push(node);
        counts.retain(|&g| g <= node);
        counts.sort_unstable();
        counts.dedup();
        let out: Vec<(u32, u32)> = counts.into_iter().map(|g| (1, g)).collect();
        (out, node)
    } else {
        (vec![(1, gpus_per_node)], gpus_per_node)
    };
    let mut n: u32 = 2;
    while n.saturating_mul(node) <= MOST {
        out.push((n, node));
        n = if n < 64 { n + 1 } else { n.saturating_mul(2) };
    }
    out
}

/// Every candidate estimated by the formulas on `spec` changed in memory, on the cluster of
/// `(nodes, gpus per node)`; those over the formulas' loose memory bound are counted in
/// `rejected`, the rest returned with how many were `auto` balances that split the layers
/// evenly (the even candidate: not a plan of their own).
fn estimate_all(
    spec: &Spec,
    (candidates, rates): (Vec<Candidate>, &gemm_rate::GemmRates),
    (nodes, gpus_per_node): (u32, u32),
    rejected: &mut Vec<Rejection>,
    progress: &(dyn Fn(Progress) + Sync),
) -> (Vec<Estimated>, usize) {
    let capacity = spec.cluster.gpu.memory_bytes as f64;
    let total = candidates.len();
    let mut kept = Vec::new();
    let mut even = 0;
    for (i, c) in candidates.into_iter().enumerate() {
        if i % 256 == 0 {
            progress(Progress::Checking { done: i, total });
        }
        let Some(e) = estimate(spec, c, (nodes, gpus_per_node), rates) else {
            even += 1;
            continue;
        };
        if e.memory as f64 > FORMULA_SLACK * capacity {
            count(
                rejected,
                &Why::rule(FORMULA_RULE),
                Some((e.candidate, e.memory)),
            );
        } else {
            kept.push(e);
        }
    }
    (kept, even)
}

/// The `top` plans shown, fastest first: the winner lowered and simulated whole, so its
/// numbers are check's (a winner that does not fit whole gives way to the next; one simulated
/// whole already is not lowered again), where `affordable` says its whole lowering is within
/// the search's work (else it keeps its samples' numbers, [`Ranked::sampled`]); the others
/// keep their sampled numbers (within 1% of whole, `tests`).
fn confirm(
    fitting: Vec<(Estimated, Ranked)>,
    (top, how): (usize, &Pricing),
    capacity: u64,
    affordable: &dyn Fn(&Candidate) -> bool,
    rejected: &mut Vec<Rejection>,
) -> Vec<Ranked> {
    let mut ranked: Vec<Ranked> = Vec::new();
    for (c, sampled) in fitting {
        if ranked.len() == top {
            break;
        }
        let k = &c.candidate;
        if !ranked.is_empty()
            || sample_points(k.microbatches, k.pp, k.schedule).is_none()
            || !affordable(k)
        {
            ranked.push(sampled);
            continue;
        }
        match evaluate(&c.spec, &c.candidate, how) {
            Ok(r) if fits(&r, capacity) => ranked.push(r),
            Ok(r) => count(
                rejected,
                &Why::rule(MEMORY_RULE),
                Some((c.candidate, need(&r))),
            ),
            Err(why) => count(rejected, &why, None),
        }
    }
    ranked
}

/// The spec whose model and recipe are searched, and the cluster searched: the spec as given
/// (with the cluster `options` set) when it checks; else the spec under a neutral plan on one
/// GPU ([`neutral_spec`]), searched on its own cluster (or the one `options` give): its own plan
/// is what the search replaces, so a mesh that does not match the cluster, a microbatch count
/// tied to its dp, a `layers` list for its pipeline or an interleaved schedule its
/// microbatches do not suit does not stop the search, however many GPUs the cluster has.
/// `Err`: the spec's own errors that are not its plan's (the model's, the recipe's, the
/// cluster's), which the search cannot change.
pub fn prepare(
    name: &str,
    text: &str,
    overrides: &[Override],
    options: &SearchOptions,
) -> Result<Base, Box<Compiled>> {
    let sets = with_cluster(overrides, options);
    let mut compiled = driver::compile(name, text.to_string(), &sets, &check_options());
    if let (Some(spec), false) = (&compiled.spec, compiled.diagnostics.has_errors()) {
        let c = &spec.cluster;
        return Ok(Base {
            spec: spec.clone(),
            nodes: c.nodes,
            gpus_per_node: c.gpus_per_node,
            own_plan: None,
        });
    }
    let errors = || compiled.diagnostics.items.iter().filter(|d| d.is_error());
    if errors().any(|d| !is_plan_error(d.code)) {
        // What the search cannot change; the plan's errors beside them are about a plan it
        // would replace.
        let items = &mut compiled.diagnostics.items;
        items.retain(|d| !(d.is_error() && is_plan_error(d.code)));
        return Err(Box::new(compiled));
    }
    let own_plan = errors().next().map(|d| format!("{} {}", d.code, d.message));
    let own = {
        let mut sources = crate::diag::Sources::default();
        let main = sources.add(name, text.to_string());
        crate::check::cluster_of(&mut sources, main, &sets)
    };
    match (neutral_spec(name, text, overrides), own) {
        (Ok(spec), Some(own)) => Ok(Base {
            spec,
            nodes: options.nodes.unwrap_or(own.nodes),
            gpus_per_node: options.gpus_per_node.unwrap_or(own.gpus_per_node),
            own_plan,
        }),
        // The model's or recipe's own errors, which the spec's plan errors may have hidden
        // (a check stops at a mesh that does not match the cluster).
        (Err(Some(variant)), _) if !variant_errors_are_plans(&variant) => Err(variant),
        _ => Err(Box::new(compiled)),
    }
}

/// Whether an error code is the plan's (mesh, divisibility, batch arithmetic, schedule,
/// placement, memory: E04xx to E07xx), which the search replaces.
fn is_plan_error(code: &str) -> bool {
    ["E04", "E05", "E06", "E07"]
        .iter()
        .any(|p| code.starts_with(p))
}

/// Whether any error of `compiled` is about the plan, whose spans may point at the neutral
/// plan's settings rather than at what the user wrote.
fn variant_errors_are_plans(compiled: &Compiled) -> bool {
    (compiled.diagnostics.items.iter())
        .filter(|d| d.is_error())
        .any(|d| is_plan_error(d.code))
}

/// The spec under the simplest plan on one GPU (dp = 1, so the batch arithmetic holds for any
/// global batch, however many GPUs the cluster searched has): ZeRO 0, 1F1B, micro batch 1, no
/// virtual stages or `layers` list; then the checker's own fixes that change only
/// `parallel.*` (E0501's microbatches) applied, a few rounds. Its cluster is the search's to
/// set. `Err`: it still fails, with the last attempt's diagnostics (an error of the model or
/// the recipe, which the search cannot change; or a plan error no fix of the checker's
/// resolves).
fn neutral_spec(
    name: &str,
    text: &str,
    overrides: &[Override],
) -> Result<Spec, Option<Box<Compiled>>> {
    let mut sets = overrides.to_vec();
    for (path, value) in [
        ("cluster.nodes", "1"),
        ("cluster.gpus_per_node", "1"),
        ("parallel.mesh", "{dp: 1, pp: 1, cp: 1, tp: 1}"),
        ("parallel.zero", "0"),
        ("parallel.schedule", "1f1b"),
        ("parallel.virtual", "1"),
        ("parallel.balance", "even"),
        ("parallel.sequence_parallel", "false"),
        ("train.micro_batch", "1"),
    ] {
        sets.push(set(path, value.to_string()));
    }
    let mut last = None;
    for _ in 0..4 {
        let variant = driver::compile(name, text.to_string(), &sets, &check_options());
        if let (Some(spec), false) = (&variant.spec, variant.diagnostics.has_errors()) {
            return Ok(spec.clone());
        }
        let fixes = plan_fixes(&variant.diagnostics);
        last = Some(Box::new(variant));
        if fixes.is_empty() {
            break;
        }
        sets.extend(fixes);
    }
    Err(last)
}

/// For each error, its first suggested fix that sets only `parallel.*` paths.
fn plan_fixes(diagnostics: &Diagnostics) -> Vec<Override> {
    let parse = |s: &String| {
        s.split_once('=')
            .filter(|(path, _)| path.starts_with("parallel."))
            .map(|(path, value)| set(path, value.to_string()))
    };
    let mut out = Vec::new();
    for d in diagnostics.items.iter().filter(|d| d.is_error()) {
        let first = d.fixes.iter().find_map(|f| {
            let sets: Option<Vec<Override>> = f.sets.iter().map(parse).collect();
            sets.filter(|s| !s.is_empty() && f.edits.is_empty())
        });
        out.extend(first.unwrap_or_default());
    }
    out
}

fn set(path: &str, value: String) -> Override {
    Override {
        path: path.to_string(),
        value,
    }
}

fn check_options() -> CompileOptions {
    CompileOptions::through(Stage::Check)
}

/// Why a candidate was rejected: a rule in words, or a diagnostic's code with its message.
#[derive(Clone, Debug)]
struct Why {
    rule: String,
    example: Option<String>,
    /// Instructions lowered before the rejection (0 where none or unknown).
    lowered: u64,
}

impl Why {
    fn rule(rule: &str) -> Why {
        Why {
            rule: rule.to_string(),
            example: None,
            lowered: 0,
        }
    }

    fn diagnostic(d: &crate::diag::Diagnostic) -> Why {
        Why {
            rule: d.code.to_string(),
            example: Some(d.message.clone()),
            lowered: 0,
        }
    }
}

/// Count a rejection under its rule (a code keeps its first message); keep the closest
/// (smallest need) candidate.
fn count(rejected: &mut Vec<Rejection>, why: &Why, closest: Option<(Candidate, u64)>) {
    let entry = match rejected.iter_mut().position(|r| r.rule == why.rule) {
        Some(i) => &mut rejected[i],
        None => {
            rejected.push(Rejection {
                rule: why.rule.clone(),
                arithmetic: false,
                example: why.example.clone(),
                count: 0,
                closest: None,
            });
            let last = rejected.len() - 1;
            &mut rejected[last]
        }
    };
    entry.count += 1;
    if let Some((c, need)) = closest {
        if entry.closest.as_ref().is_none_or(|(_, n)| need < *n) {
            entry.closest = Some((c, need));
        }
    }
}

/// How far the formulas' memory may sit above the GPU's before a candidate is not even lowered
/// (they err low: the lowered plan is the verdict).
const FORMULA_SLACK: f64 = 1.5;
pub const FORMULA_RULE: &str = "memory per GPU over 1.5× the GPU's by the cost formulas";

/// A candidate with the formulas' estimates, from the base spec changed in memory.
struct Estimated {
    candidate: Candidate,
    spec: Spec,
    step: f64,
    memory: u64,
}

/// The base spec with the candidate's plan and the cluster's shape, estimated by the formulas
/// (the compute at the GEMM rates of `rates`); `None` for an `auto` balance that splits the
/// layers evenly (the even candidate is the same plan).
fn estimate(
    base: &Spec,
    candidate: Candidate,
    (nodes, gpus_per_node): (u32, u32),
    rates: &gemm_rate::GemmRates,
) -> Option<Estimated> {
    let mut spec = base.clone();
    let c = &candidate;
    // In the order the candidate's settings write it (`Candidate::settings`).
    spec.parallel.mesh.axes = vec![
        (Axis::Dp, c.dp),
        (Axis::Pp, c.pp),
        (Axis::Cp, c.cp),
        (Axis::Tp, c.tp),
    ];
    spec.parallel.zero = c.zero;
    spec.parallel.schedule = c.schedule;
    spec.parallel.microbatches = c.microbatches;
    spec.parallel.sequence_parallel = c.tp > 1;
    crate::cost::set_recompute(&mut spec, c.recompute.clone());
    spec.train.micro_batch = c.micro_batch;
    spec.cluster.nodes = nodes;
    spec.cluster.gpus_per_node = gpus_per_node;
    spec.parallel.balance = c.balance;
    crate::cost::balance::rebalance(&mut spec);
    if c.balance == crate::spec::Balance::Auto {
        // The same split as `even` is that candidate's, where there is one (chunks dividing
        // the layers); where there is none, the cost model's split is the only plan.
        let (p, v) = spec.parallel.pipeline_shape();
        let chunks = p * v;
        if spec.model.layers.is_multiple_of(chunks.max(1))
            && spec.parallel.chunk_layers == crate::spec::even_layers(spec.model.layers, chunks)
        {
            return None;
        }
    }
    let cost = crate::cost::estimate(&spec);
    Some(Estimated {
        step: step_estimate(&cost, rates.slowdown(&spec)),
        memory: cost.worst_role().map_or(0, |r| r.memory.total()),
        spec,
        candidate,
    })
}

/// The lowering phase: candidates in the formulas' order, each checked (the checker's errors
/// reject it) and lowered. The formulas' memory errs low by a factor learnt from the plans
/// lowered so far; a candidate that factor puts over the GPU waits until the others are tried.
struct Lowering<'a> {
    name: &'a str,
    text: &'a str,
    /// The user's overrides and the cluster searched, under the candidates' settings.
    sets: &'a [Override],
    capacity: u64,
    how: Pricing,
    /// The largest lowered need over the formulas' seen so far (at least 1).
    underestimate: f64,
    /// Candidates lowered so far.
    lowered: usize,
    /// The smallest ratio of a fitting lowered plan's simulated step to its formula estimate
    /// (infinite before one): how much faster than the formulas say a plan has turned out.
    fastest_ratio: f64,
    /// Instructions lowered so far ([`Ranked::instructions`] of each lowered candidate, a
    /// refused one's own; one that failed otherwise counts as the mean of those ranked).
    work: u64,
    /// What a candidate's lowering is predicted to add to `work`, learnt from those made.
    rate: work::Rate,
    /// Lowered candidates that were ranked.
    ranked: u64,
    /// The meshes (which axes are split) of candidates the backend refused: a candidate of
    /// the same kind waits until the others are tried.
    refused: Vec<Splits>,
    rejected: &'a mut Vec<Rejection>,
}

/// Which of a candidate's mesh axes (dp, pp, cp, tp) split it over more than one rank: what
/// decides, for one spec, whether the backend refuses its plan (amaxes or histories reduced
/// across ranks); only the order of lowering leans on it, the verdict is the lowered plan's.
type Splits = [bool; 4];

fn splits(c: &Candidate) -> Splits {
    [c.dp > 1, c.pp > 1, c.cp > 1, c.tp > 1]
}

impl Lowering<'_> {
    /// Lower candidates from `queue` until `options.top` fit or `options.lower_at_most` were
    /// lowered (up to as many more that the backend refused do not count: a space whose
    /// fastest plans it refuses still reaches the others); returns those that fit with their
    /// (sampled) rankings, fastest first.
    fn run(
        &mut self,
        queue: &mut Vec<Estimated>,
        options: &SearchOptions,
        progress: &(dyn Fn(Progress) + Sync),
    ) -> Vec<(Estimated, Ranked)> {
        let mut fitting = Vec::new();
        let width = std::thread::available_parallelism()
            .map(usize::from)
            .unwrap_or(1);
        let counted = |l: &Self| l.lowered - l.refused.len().min(options.lower_at_most);
        let enough = |l: &Self, fitting: &[(Estimated, Ranked)], queue: &[Estimated]| {
            let counted = counted(l);
            if fitting.len() < options.top {
                return counted >= options.lower_at_most || l.work >= work::cap(options.lower_work);
            }
            let spent = l.work >= options.lower_work || counted >= options.extend_at_most;
            counted >= options.lower_at_least
                && (spent || !l.promising(fitting, queue, options.top))
        };
        while !queue.is_empty() && !enough(self, &fitting, queue) {
            let cap = match fitting.len() < options.top {
                true => options.lower_at_most,
                false => options.extend_at_most.max(options.lower_at_least),
            };
            progress(Progress::Lowering {
                done: counted(self),
                total: cap,
            });
            let room = cap.saturating_sub(counted(self)).clamp(1, width);
            let left = work::cap(options.lower_work).saturating_sub(self.work);
            let batch = self.take_checked(queue, room, left);
            if batch.is_empty() {
                // Every candidate left would take the work past the search's.
                break;
            }
            self.lowered += batch.len();
            for (e, result) in evaluate_all(batch, &self.how) {
                match result {
                    Ok(r) => {
                        self.work += r.instructions;
                        self.rate.learn(&e.candidate, r.instructions);
                        self.ranked += 1;
                        let ratio = need(&r) as f64 / e.memory.max(1) as f64;
                        self.underestimate = self.underestimate.max(ratio);
                        if fits(&r, self.capacity) {
                            let ratio = r.step_seconds / e.step.max(f64::MIN_POSITIVE);
                            self.fastest_ratio = self.fastest_ratio.min(ratio);
                            fitting.push((e, r));
                        } else {
                            let memory = Why::rule(MEMORY_RULE);
                            count(self.rejected, &memory, Some((e.candidate, need(&r))));
                        }
                    }
                    Err(why) => {
                        if why.lowered > 0 {
                            self.rate.learn(&e.candidate, why.lowered);
                        }
                        self.work += match why.lowered {
                            0 => self.work / self.ranked.max(1),
                            n => n,
                        };
                        if why.rule == BACKEND_RULE {
                            self.refused.push(splits(&e.candidate));
                        }
                        count(self.rejected, &why, None)
                    }
                }
            }
        }
        fitting.sort_by(|a, b| a.1.step_seconds.total_cmp(&b.1.step_seconds));
        fitting
    }

    /// Whether a candidate left in `queue` could still be among the `top` fastest of
    /// `fitting`: its formula estimate, at the smallest simulated-over-estimated ratio seen, is
    /// under the `top`-th fastest simulated step.
    fn promising(&self, fitting: &[(Estimated, Ranked)], queue: &[Estimated], top: usize) -> bool {
        let mut steps: Vec<f64> = fitting.iter().map(|(_, r)| r.step_seconds).collect();
        steps.sort_by(f64::total_cmp);
        let Some(&kth) = steps.get(top.saturating_sub(1)) else {
            return true;
        };
        let best_left = queue.iter().map(|e| e.step).fold(f64::INFINITY, f64::min);
        best_left * self.fastest_ratio < kth
    }

    /// Up to `n` candidates from the queue, in order, that pass the checker (the others are
    /// counted under the checker's rule) and whose lowerings together are predicted within
    /// `left` instructions.
    fn take_checked(&mut self, queue: &mut Vec<Estimated>, n: usize, left: u64) -> Vec<Estimated> {
        let mut batch = Vec::new();
        let mut left = left;
        while batch.len() < n {
            // Where no candidate is predicted within the work, the search's first is lowered
            // anyway (a search shows a plan where one fits).
            let first = self.lowered == 0 && batch.is_empty();
            let pick = self.next(queue, left);
            let Some(at) = pick.or_else(|| first.then(|| self.next(queue, u64::MAX)).flatten())
            else {
                break;
            };
            let e = queue.remove(at);
            match self.check(&e.candidate) {
                Ok(()) => {
                    left = left.saturating_sub(self.rate.evaluation(&e.candidate));
                    batch.push(e);
                }
                Err(why) => count(self.rejected, &why, None),
            }
        }
        batch
    }

    /// Of the candidates whose lowering is predicted within `left` instructions: the first the
    /// learnt factor keeps under the GPU's memory and whose mesh the backend has not refused,
    /// else the first under the memory, else the first.
    fn next(&self, queue: &[Estimated], left: u64) -> Option<usize> {
        let limit = self.capacity as f64 / self.underestimate;
        let within = |e: &Estimated| self.rate.evaluation(&e.candidate) <= left;
        let fits = |e: &Estimated| within(e) && e.memory as f64 <= limit;
        let runs = |e: &Estimated| !self.refused.contains(&splits(&e.candidate));
        (queue.iter().position(|e| fits(e) && runs(e)))
            .or_else(|| queue.iter().position(fits))
            .or_else(|| queue.iter().position(within))
    }

    /// The checker's verdict on the candidate's `--set` settings: `Err` names its first error.
    fn check(&self, candidate: &Candidate) -> Result<(), Why> {
        let mut overrides = self.sets.to_vec();
        overrides.extend(candidate.settings().into_iter().map(|(p, v)| set(&p, v)));
        let options = CompileOptions::through(Stage::Check);
        let compiled = driver::compile(self.name, self.text.to_string(), &overrides, &options);
        match compiled.diagnostics.items.iter().find(|d| d.is_error()) {
            Some(d) => Err(Why::diagnostic(d)),
            None => Ok(()),
        }
    }
}

/// The formulas' step: the slowest role's compute (`slowdown` times the formulas', which are
/// at the GPU's peak) and tp/cp/pp communication over (1 − bubble), plus what of its gradient
/// reduction the backward's compute (two thirds of the compute) cannot hide: the runtime
/// reduces each layer's gradients while the backward goes on (the timeline, which decides,
/// overlaps them as the runtime does).
fn step_estimate(cost: &CostReport, slowdown: f64) -> f64 {
    let keep = (1.0 - cost.bubble_fraction).max(0.05);
    cost.roles
        .iter()
        .map(|r| {
            let compute = r.compute_seconds * slowdown;
            let (mut inner, mut dp) = (compute, 0.0);
            for c in &r.comm {
                if c.axis == crate::spec::Axis::Dp {
                    dp += c.seconds;
                } else {
                    inner += c.seconds;
                }
            }
            inner / keep + (dp - BACKWARD_SHARE * compute).max(0.0)
        })
        .fold(0.0, f64::max)
}

/// The backward's share of a step's compute (two of its three GEMMs a layer).
const BACKWARD_SHARE: f64 = 2.0 / 3.0;

pub const MEMORY_RULE: &str = "memory per GPU over the GPU's (lowered plan)";
/// A candidate whose lowered plan the backend refuses ([`SearchOptions::refuse`]).
pub const BACKEND_RULE: &str = "the backend does not run it";
/// A candidate left unlowered when nothing fits whose formula memory, times the most a lowered
/// plan ran over its formulas, is over the GPU's.
pub const LEARNT_RULE: &str =
    "memory per GPU over the GPU's by the cost formulas × what the lowered plans ran over them";
/// A candidate left unlowered when nothing fits that might fit: the search's limit of
/// lowerings ([`SearchOptions::lower_at_most`]) came first.
pub const UNTRIED_RULE: &str = "not lowered: the search stopped at its limit of lowerings";

fn need(r: &Ranked) -> u64 {
    r.memory.iter().map(|(_, b)| *b).max().unwrap_or(0)
}

fn fits(r: &Ranked, capacity: u64) -> bool {
    need(r) <= capacity
}

/// Lower and simulate the candidates of `batch` side by side, results in batch order: every
/// lowering of the batch (a candidate's two samples are two) is a job, and one thread per core
/// takes the next job as it finishes one (a lowering alone leaves cores idle; the samples of
/// one candidate differ in size).
fn evaluate_all(batch: Vec<Estimated>, how: &Pricing) -> Vec<(Estimated, Result<Ranked, Why>)> {
    let jobs: Vec<Job> = batch
        .iter()
        .flat_map(|e| jobs_of(&e.spec, &e.candidate))
        .collect();
    let done = run_jobs(&jobs, how);
    let mut done = done.into_iter();
    let results: Vec<Result<Ranked, Why>> = jobs
        .iter()
        .filter(|j| j.first)
        .map(|job| {
            let first = done.next().unwrap_or_else(|| Err(Why::rule(LOST)));
            match job.sampled {
                None => first,
                Some(points) => {
                    let second = done.next().unwrap_or_else(|| Err(Why::rule(LOST)));
                    Ok(extrapolate(
                        &first?,
                        &second?,
                        points,
                        job.candidate.microbatches,
                    ))
                }
            }
        })
        .collect();
    batch.into_iter().zip(results).collect()
}

const LOST: &str = "a search thread panicked (a bug in parc)";

/// One lowering of a candidate: its spec (at a sample's microbatch count, or whole) and whether
/// its memory is planned (the whole plan and the second sample) or only its step simulated.
struct Job {
    spec: Spec,
    candidate: Candidate,
    planned: bool,
    /// The first job of its candidate (a sampled candidate's second follows it).
    first: bool,
    /// The sample points, when the candidate is sampled.
    sampled: Option<(u32, u32)>,
}

/// The jobs of a candidate: the whole plan, or its two samples in the pipeline's steady state
/// (memory per GPU planned on the second, the larger: in-flight activations are bounded by the
/// stages, so it does not grow with further microbatches; `tests` hold it to the whole plan's).
fn jobs_of(spec: &Spec, candidate: &Candidate) -> Vec<Job> {
    let job = |spec: Spec, planned, first, sampled| Job {
        spec,
        candidate: candidate.clone(),
        planned,
        first,
        sampled,
    };
    match sample_points(candidate.microbatches, candidate.pp, candidate.schedule) {
        None => vec![job(spec.clone(), true, true, None)],
        Some((m1, m2)) => vec![
            job(with_microbatches(spec, m1), false, true, Some((m1, m2))),
            job(with_microbatches(spec, m2), true, false, Some((m1, m2))),
        ],
    }
}

/// Run `jobs` on one thread per core, each thread taking the next job not yet taken (those
/// whose memory is planned, the longer, first); results in job order.
fn run_jobs(jobs: &[Job], how: &Pricing) -> Vec<Result<Ranked, Why>> {
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| !jobs[i].planned);
    let width = std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
        .min(jobs.len())
        .max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<Option<Result<Ranked, Why>>>> =
        jobs.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..width {
            scope.spawn(|| loop {
                let taken = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&i) = order.get(taken) else { break };
                let job = &jobs[i];
                let result = if job.planned {
                    evaluate(&job.spec, &job.candidate, how)
                } else {
                    simulate(&job.spec, &job.candidate, how)
                };
                if let Ok(mut slot) = slots[i].lock() {
                    *slot = Some(result);
                }
            });
        }
    });
    slots
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .ok()
                .flatten()
                .unwrap_or_else(|| Err(Why::rule(LOST)))
        })
        .collect()
}

/// Two microbatch counts in the pipeline's steady state when the candidate runs more than the
/// larger, else `None` (simulate it whole): 2p and 2p + 1 (1F1B and GPipe repeat per
/// microbatch), or 2p and 3p for interleaving (its microbatches come in multiples of p).
fn sample_points(microbatches: u32, pp: u32, schedule: PipelineSchedule) -> Option<(u32, u32)> {
    let p = pp.max(1);
    let m2 = match schedule {
        PipelineSchedule::Interleaved { .. } if p > 1 => 3 * p,
        _ => 2 * p + 1,
    };
    (microbatches > m2).then_some((2 * p, m2))
}

/// `spec` with `m` microbatches per step (the global batch follows).
fn with_microbatches(spec: &Spec, m: u32) -> Spec {
    let mut s = spec.clone();
    let dp = u64::from(s.parallel.mesh.size(crate::spec::Axis::Dp));
    s.parallel.microbatches = m;
    s.train.global_batch = dp * s.train.micro_batch * u64::from(m);
    s
}

/// A candidate's ranking from two simulations in the pipeline's steady state, extrapolated
/// linearly to its microbatch count (see [`jobs_of`]); exact (one whole simulation) when the
/// candidate runs few microbatches.
#[cfg(test)]
fn evaluate_sampled(spec: &Spec, candidate: &Candidate, how: &Pricing) -> Result<Ranked, Why> {
    let jobs = jobs_of(spec, candidate);
    let mut done = run_jobs(&jobs, how).into_iter();
    let first = done.next().unwrap_or_else(|| Err(Why::rule(LOST)))?;
    match (jobs[0].sampled, done.next()) {
        (Some(points), Some(second)) => Ok(extrapolate(
            &first,
            &second?,
            points,
            candidate.microbatches,
        )),
        _ => Ok(first),
    }
}

/// Extrapolate the simulations `a` (at `m1` microbatches) and `b` (at `m2`, its memory
/// planned) to `m`: each further microbatch adds the same time, idle time is the fill and
/// drain's, and memory per GPU is `b`'s.
fn extrapolate(a: &Ranked, b: &Ranked, (m1, m2): (u32, u32), m: u32) -> Ranked {
    let t = f64::from(m - m1) / f64::from(m2 - m1);
    let line = |x: f64, y: f64| x + (y - x) * t;
    let step = line(a.step_seconds, b.step_seconds);
    let idle = line(
        a.bubble_fraction * a.step_seconds,
        b.bubble_fraction * b.step_seconds,
    );
    let exposed = line(
        a.exposed_comm_fraction * a.step_seconds,
        b.exposed_comm_fraction * b.step_seconds,
    );
    let tokens_per_step = b.tokens_per_second * b.step_seconds * f64::from(m) / f64::from(m2);
    Ranked {
        candidate: b.candidate.clone(),
        step_seconds: step,
        tokens_per_second: tokens_per_step / step,
        mfu: b.mfu * b.step_seconds / step * f64::from(m) / f64::from(m2),
        memory: b.memory.clone(),
        bubble_fraction: idle / step,
        exposed_comm_fraction: exposed / step,
        instructions: a.instructions + b.instructions,
        sampled: Some((m1, m2)),
    }
}

/// Lower `spec` for analysis, its FP8 layers priced as its timeline is; `Err` also where the
/// backend refuses the plan.
fn lower(spec: &Spec, how: &Pricing) -> Result<Plan, Why> {
    let options = LowerOptions {
        fusion: how.fusion,
        representatives: true,
        ..LowerOptions::default()
    };
    let fp8 = crate::fp8::choices(spec, prices(how.calibration.as_deref()));
    let plan = lower_chosen(spec, options, &fp8).map_err(|d| first_error(&d, "lowering"))?;
    match how.refuse.and_then(|refuse| refuse(&plan)) {
        Some(why) => Err(Why {
            rule: BACKEND_RULE.to_string(),
            example: Some(why),
            lowered: plan.instructions() as u64,
        }),
        None => Ok(plan),
    }
}

/// Lower, verify, plan and simulate `spec` (the candidate's): its ranking, or why it cannot be.
fn evaluate(spec: &Spec, candidate: &Candidate, how: &Pricing) -> Result<Ranked, Why> {
    let plan = lower(spec, how)?;
    let mut diagnostics = Diagnostics::default();
    let calibration = how.calibration.as_deref();
    let skip = crate::timeline::Events::Skip;
    let analysis = analyze_with(
        spec,
        &plan,
        Stage::Timeline,
        calibration,
        skip,
        &mut diagnostics,
    );
    let (Some(fit), Some(timeline)) = (analysis.fit, analysis.timeline) else {
        return Err(first_error(&diagnostics, "verification"));
    };
    let memory = fit.into_iter().map(|n| (n.role, n.bytes)).collect();
    Ok(ranking((spec, &plan), candidate, &timeline, memory))
}

/// Lower and simulate `spec` only (a first sample, whose second is verified and planned): its
/// ranking without memory.
fn simulate(spec: &Spec, candidate: &Candidate, how: &Pricing) -> Result<Ranked, Why> {
    let plan = lower(spec, how)?;
    let timeline = crate::timeline::simulate_calibrated(
        &plan,
        spec,
        how.calibration.as_deref(),
        crate::timeline::Events::Skip,
    );
    if !timeline.complete {
        return Err(Why::rule(
            "the simulated step does not finish (the plan does not verify)",
        ));
    }
    Ok(ranking((spec, &plan), candidate, &timeline, Vec::new()))
}

fn ranking(
    (spec, plan): (&Spec, &Plan),
    candidate: &Candidate,
    timeline: &crate::timeline::Timeline,
    memory: Vec<(String, u64)>,
) -> Ranked {
    let step = timeline.step_seconds.max(f64::MIN_POSITIVE);
    let tokens = spec.train.global_batch as f64 * spec.model.seq as f64;
    Ranked {
        candidate: candidate.clone(),
        step_seconds: step,
        tokens_per_second: tokens / step,
        mfu: crate::cost::mfu(spec, step),
        memory,
        bubble_fraction: timeline.bubble_fraction,
        exposed_comm_fraction: timeline.exposed_comm_fraction,
        instructions: plan.instructions() as u64,
        sampled: None,
    }
}

fn first_error(d: &Diagnostics, stage: &str) -> Why {
    d.items
        .iter()
        .find(|x| x.is_error())
        .map_or_else(|| Why::rule(&format!("{stage} failed")), Why::diagnostic)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::testspec::{build, Dims, Plan};
    use crate::spec::{PipelineSchedule, Recompute, ZeroStage};

    fn candidate(p: &Plan) -> Candidate {
        Candidate {
            dp: p.dp,
            pp: p.pp,
            cp: p.cp,
            tp: p.tp,
            zero: p.zero,
            schedule: p.schedule,
            micro_batch: p.micro_batch,
            microbatches: p.microbatches,
            recompute: p.recompute.clone(),
            balance: crate::spec::Balance::Even,
        }
    }

    /// The steady-state extrapolation gives the whole simulation's step within 1% and bubble
    /// within 1 point, and never less memory, over pipelines, interleaving, dp with ZeRO and
    /// tp, recompute and precisions.
    #[test]
    fn sampled_simulations_extrapolate_to_the_whole_step() {
        let dims = Dims {
            layers: 8,
            ..Dims::tiny()
        };
        let plans = [
            Plan {
                microbatches: 12,
                ..Plan::default()
            },
            Plan {
                pp: 2,
                microbatches: 16,
                ..Plan::default()
            },
            Plan {
                pp: 4,
                microbatches: 16,
                recompute: Recompute::Selective,
                precision: crate::spec::Precision::Bf16,
                ..Plan::default()
            },
            Plan {
                pp: 4,
                microbatches: 16,
                schedule: PipelineSchedule::Interleaved { virtual_stages: 2 },
                recompute: Recompute::Full,
                ..Plan::default()
            },
            Plan {
                dp: 2,
                pp: 2,
                tp: 2,
                sp: true,
                zero: ZeroStage::Zero1,
                microbatches: 10,
                precision: crate::spec::Precision::Bf16,
                ..Plan::default()
            },
        ];
        for plan in plans {
            let spec = build(&dims, &plan);
            let c = candidate(&plan);
            let how = Pricing {
                fusion: true,
                ..Pricing::default()
            };
            let exact = evaluate(&spec, &c, &how).expect("lowers");
            let sampled = evaluate_sampled(&spec, &c, &how).expect("lowers");
            let what = c.describe();
            let err = (sampled.step_seconds / exact.step_seconds - 1.0).abs();
            assert!(
                err < 0.01,
                "{what}: step {} vs {}",
                sampled.step_seconds,
                exact.step_seconds
            );
            let bubble = (sampled.bubble_fraction - exact.bubble_fraction).abs();
            assert!(
                bubble < 0.01,
                "{what}: bubble {} vs {}",
                sampled.bubble_fraction,
                exact.bubble_fraction
            );
            assert!(need(&sampled) >= need(&exact), "{what}: memory");
            assert!((sampled.mfu / exact.mfu - 1.0).abs() < 0.01, "{what}: mfu");
        }
    }

    /// A backend that refuses every plan splitting dp: on the tiny example on 4 GPUs (whose
    /// fastest plans split dp) none of the plans shown splits dp, each refusal is counted under [`BACKEND_RULE`] with the
    /// backend's reason, and the refusals do not use up the lowering limit (as many plans are
    /// shown as without the rule).
    #[test]
    fn plans_the_backend_refuses_are_counted_and_never_shown() {
        fn no_dp(plan: &crate::ir::Plan) -> Option<String> {
            (plan.mesh.size(Axis::Dp) > 1).then(|| "this backend runs no dp".to_string())
        }
        let text = include_str!("../../../examples/tiny.par");
        let mut options = SearchOptions {
            nodes: Some(1),
            gpus_per_node: Some(4),
            top: 4,
            lower_at_least: 4,
            lower_at_most: 6,
            extend_at_most: 6,
            lower_work: u64::MAX,
            fusion: true,
            calibration: None,
            refuse: None,
        };
        let free = search("tiny.par", text, &[], &options, &|_| {}).expect("searches");
        assert!(
            free.ranked.iter().any(|r| r.candidate.dp > 1),
            "the space's fastest plans split dp, or the test shows nothing"
        );
        options.refuse = Some(no_dp);
        let refused = search("tiny.par", text, &[], &options, &|_| {}).expect("searches");
        assert_eq!(refused.ranked.len(), free.ranked.len());
        assert!(refused.ranked.iter().all(|r| r.candidate.dp == 1));
        let rule = (refused.rejected.iter())
            .find(|r| r.rule == BACKEND_RULE)
            .expect("refusals counted");
        assert!(rule.count > 0);
        assert_eq!(rule.example.as_deref(), Some("this backend runs no dp"));
    }

    /// Mistral 7B on 2 nodes of 8 H100s, priced by the repository's H100 profile: a space where
    /// the formulas' first candidates are not the timeline's fastest.
    const MISTRAL: &str = "use std::llama { Block }
model mistral7b {
  let vocab = 32000; let d = 4096; let heads = 32; let kv_heads = 8
  let layers = 32; let ffn = 14336; let seq = 4096
  input tokens  : [batch, seq] i32
  input targets : [batch, seq] i32
  x = Embedding(vocab, d)(tokens)
  x = repeat layers { Block(d, heads, kv_heads = kv_heads, ffn = ffn, theta = 10000)(x) }
  logits = Linear(d, vocab, bias = false)(RMSNorm(d)(x) as ln_f) as head
  loss = CrossEntropy(logits, targets)
  shard Embedding.vocab on tp
  shard Attention.heads on tp, seq on cp
  shard MLP.hidden on tp
}
parallel { mesh = { dp: 2, pp: 2, cp: 1, tp: 4 }; zero = 1; recompute = selective; sequence_parallel = true }
train {
  global_batch = 128; micro_batch = 2; precision = bf16
  optimizer = adamw { lr: 3e-4 }; schedule = cosine { warmup: 100, min_lr: 3e-5 }
  data = synthetic; steps = 1000
}
cluster {
  nodes = 2; gpus_per_node = 8; gpu = h100_80gb
  intra = nvlink { bandwidth: 450 GB/s }
  inter = infiniband { bandwidth: 50 GB/s }
}";

    /// The search's budget is work, not plans: with a budget of almost no instructions it
    /// lowers its first candidate only (a search shows a plan where one fits), and the winner,
    /// sampled, keeps its samples' numbers (lowering it whole is past the work); with no limit
    /// it lowers many, the winner whole.
    #[test]
    fn the_budget_counts_the_instructions_each_plan_lowers() {
        let options = |lower_work: u64| SearchOptions {
            nodes: Some(1),
            gpus_per_node: Some(4),
            top: 1,
            lower_at_least: 8,
            lower_at_most: 12,
            extend_at_most: 12,
            lower_work,
            fusion: true,
            calibration: None,
            refuse: None,
        };
        let tiny = include_str!("../../../examples/tiny.par");
        let sets = [set("train.global_batch", "128".to_string())];
        let run =
            |o: &SearchOptions| search("tiny.par", tiny, &sets, o, &|_| {}).expect("searches");
        let spent = run(&options(1));
        assert_eq!(spent.lowered, 1);
        let free = run(&options(u64::MAX));
        assert!(free.lowered > 1, "{}", free.lowered);
        let winner = free.ranked.first().expect("a plan");
        assert_eq!(winner.sampled, None, "{}", winner.candidate.describe());
        if let Some(first) = spent.ranked.first() {
            let c = &first.candidate;
            let sampled = sample_points(c.microbatches, c.pp, c.schedule);
            assert_eq!(first.sampled, sampled, "{}", c.describe());
        }
    }

    /// The winner does not hang on `top`: asked for one plan, the search lowers on past its
    /// first few while a candidate left could still beat the best, and finds the plan it finds
    /// when asked for eight; stopped at its first few it would not (Mistral 7B, above).
    #[test]
    fn the_winner_does_not_depend_on_top() {
        let profile = include_str!("../../../calibration/h100_80gb.json");
        let profile = crate::timeline::profile::Profile::parse(profile).expect("the H100 profile");
        let calibration = std::sync::Arc::new(crate::timeline::Calibration {
            profile,
            scale: false,
        });
        let options = |top: usize, extend_at_most: usize| SearchOptions {
            nodes: None,
            gpus_per_node: None,
            top,
            lower_at_least: 8,
            lower_at_most: (3 * top).max(12),
            extend_at_most,
            lower_work: u64::MAX,
            fusion: true,
            calibration: Some(calibration.clone()),
            refuse: None,
        };
        let winner = |o: &SearchOptions| {
            let outcome = search("mistral.par", MISTRAL, &[], o, &|_| {}).expect("searches");
            let first = outcome.ranked.first().expect("a plan");
            (first.candidate.clone(), first.step_seconds, outcome.lowered)
        };
        let (wide, wide_s, _) = winner(&options(8, 128));
        let (one, one_s, lowered) = winner(&options(1, 64));
        assert_eq!(
            one, wide,
            "asked for one plan (lowered {lowered}): {one_s} s against {wide_s} s"
        );
        let (stopped, stopped_s, _) = winner(&options(1, 12));
        assert!(
            stopped_s > wide_s,
            "the first 12 lowered hold the winner ({stopped:?}): the test shows nothing"
        );
    }

    /// On a space small enough to lower whole (the tiny example on 2 GPUs), the search (samples
    /// extrapolated, memory planned on the second, lowerings spread over the cores, the winner
    /// confirmed whole) loses no plan: its winner is the fastest of every candidate that checks,
    /// lowered and simulated whole, and each plan it shows is within 1% of the exhaustive
    /// ranking's step at its place.
    #[test]
    fn search_finds_what_an_exhaustive_ranking_finds() {
        let text = include_str!("../../../examples/tiny.par");
        let top = 5;
        let options = SearchOptions {
            nodes: Some(1),
            gpus_per_node: Some(2),
            top,
            lower_at_least: usize::MAX,
            lower_at_most: usize::MAX,
            extend_at_most: usize::MAX,
            lower_work: u64::MAX,
            fusion: true,
            calibration: None,
            refuse: None,
        };
        let outcome = search("tiny.par", text, &[], &options, &|_| {}).expect("searches");
        assert_eq!(outcome.ranked.len(), top);
        let spec = prepare("tiny.par", text, &[], &options)
            .expect("checks")
            .spec;
        let how = Pricing {
            fusion: true,
            ..Pricing::default()
        };
        let lowering = |c: &Candidate| {
            let mut overrides = vec![
                set("cluster.nodes", "1".to_string()),
                set("cluster.gpus_per_node", "2".to_string()),
            ];
            overrides.extend(c.settings().into_iter().map(|(p, v)| set(&p, v)));
            let compiled =
                driver::compile("tiny.par", text.to_string(), &overrides, &check_options());
            !compiled.diagnostics.has_errors()
        };
        let mut whole: Vec<(f64, Candidate)> = space::space(&spec, 2, 2)
            .candidates
            .into_iter()
            .filter_map(|c| estimate(&spec, c, (1, 2), &gemm_rate::GemmRates::new(None)))
            .filter(|e| lowering(&e.candidate))
            .filter_map(|e| evaluate(&e.spec, &e.candidate, &how).ok())
            .filter(|r| fits(r, outcome.gpu_memory_bytes))
            .map(|r| (r.step_seconds, r.candidate))
            .collect();
        whole.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert_eq!(
            outcome.lowered, outcome.considered,
            "every candidate lowered"
        );
        assert_eq!(outcome.ranked[0].step_seconds, whole[0].0, "the winner");
        for (shown, (step, c)) in outcome.ranked.iter().zip(&whole) {
            let err = (shown.step_seconds / step - 1.0).abs();
            assert!(
                err < 0.01,
                "{}: {} vs {}: {step}",
                shown.candidate.describe(),
                shown.step_seconds,
                c.describe()
            );
        }
    }

    /// Search options for `nodes` × `gpus_per_node` that estimate the space and lower no plan.
    fn lowering_nothing(nodes: u32, gpus_per_node: u32) -> SearchOptions {
        SearchOptions {
            nodes: Some(nodes),
            gpus_per_node: Some(gpus_per_node),
            top: 1,
            lower_at_least: 0,
            lower_at_most: 0,
            extend_at_most: 0,
            lower_work: 0,
            fusion: true,
            calibration: None,
            refuse: None,
        }
    }

    /// The arithmetic rules of the space are the checker's for what they cover: every candidate
    /// it keeps checks clean (placement with the mesh laid out tp innermost, sequence splits,
    /// interleaving's microbatches, tp's shards), so no checker error reaches the rejections
    /// for a candidate the arithmetic could have ruled out; over GPU counts that leave few
    /// splits, on one node and two, for a GPT-2 and a grouped-query Llama.
    #[test]
    fn every_candidate_of_the_space_checks_clean() {
        let tiny = include_str!("../../../examples/tiny.par");
        let llama = include_str!("../../../examples/tiny-llama.par");
        // A mesh written tp first, as a torchtitan spec may: a candidate setting pp or cp alone
        // would put them inside tp's groups.
        let tp_first = [set("parallel.mesh", "{tp: 1, dp: 1}".to_string())];
        let specs: [(&str, &str, &[Override]); 3] = [
            ("tiny.par", tiny, &[]),
            ("tiny-llama.par", llama, &[]),
            ("tiny-llama.par", llama, &tp_first),
        ];
        for (name, text, overrides) in specs {
            for (nodes, gpus_per_node) in [(1, 3), (1, 4), (1, 6), (2, 4)] {
                let options = lowering_nothing(nodes, gpus_per_node);
                let base = prepare(name, text, overrides, &options).expect("checks");
                let space = space::space(&base.spec, nodes * gpus_per_node, gpus_per_node);
                for c in space.candidates {
                    let mut sets = with_cluster(overrides, &options);
                    sets.extend(c.settings().into_iter().map(|(p, v)| set(&p, v)));
                    let compiled = driver::compile(name, text.to_string(), &sets, &check_options());
                    let error = compiled.diagnostics.items.iter().find(|d| d.is_error());
                    assert!(
                        error.is_none(),
                        "{name} on {nodes} × {gpus_per_node}: {}: {error:?}",
                        c.describe()
                    );
                }
            }
        }
    }

    /// A pp that does not divide the layers (Llama 3 405B's 126 on Meta's pp 16) is searched
    /// with the cost model's uneven split, 1F1B only, and every such plan is estimated (none
    /// dropped as the duplicate of an `even` candidate that cannot exist).
    #[test]
    fn a_pp_not_dividing_the_layers_is_searched_split_by_the_cost_model() {
        let llama = include_str!("../../../examples/tiny-llama.par");
        let options = lowering_nothing(1, 3);
        let base = prepare("tiny-llama.par", llama, &[], &options).expect("checks");
        assert_eq!(base.spec.model.layers, 4);
        let space = space::space(&base.spec, 3, 3);
        let pp3: Vec<&Candidate> = space.candidates.iter().filter(|c| c.pp == 3).collect();
        assert!(!pp3.is_empty(), "pp 3 over 4 layers is a plan");
        for c in &pp3 {
            assert_eq!(c.balance, crate::spec::Balance::Auto, "{}", c.describe());
            assert_eq!(c.schedule, PipelineSchedule::OneFOneB, "{}", c.describe());
            let rates = gemm_rate::GemmRates::new(None);
            let e = estimate(&base.spec, (*c).clone(), (1, 3), &rates);
            assert!(e.is_some(), "{} is estimated", c.describe());
        }
        assert!(space
            .candidates
            .iter()
            .filter(|c| c.pp == 3)
            .any(|c| leanest(c, 4)));
        // Six stages over four layers cannot be.
        let six = space::space(&base.spec, 6, 6);
        assert!(six.candidates.iter().all(|c| c.pp <= 4));
    }

    /// The clusters tried for a GPU count that fits grow in GPUs, one node at a time while
    /// that is few, and keep the node's size.
    #[test]
    fn the_clusters_tried_grow_from_one_gpu() {
        let one = cluster_shapes(1, 1);
        assert_eq!(
            &one[..9],
            &[
                (1, 1),
                (1, 2),
                (1, 3),
                (1, 4),
                (1, 5),
                (1, 6),
                (1, 7),
                (1, 8),
                (2, 8)
            ]
        );
        let eight = cluster_shapes(8, 8);
        assert_eq!(&eight[..3], &[(1, 8), (2, 8), (3, 8)]);
        for shapes in [one, eight, cluster_shapes(1, 32), cluster_shapes(3, 6)] {
            assert!(
                shapes.windows(2).all(|w| w[0].0 * w[0].1 < w[1].0 * w[1].1),
                "{shapes:?}"
            );
            assert!(shapes.iter().all(|(n, g)| n * g <= 65_536), "{shapes:?}");
        }
    }

    #[test]
    fn few_microbatches_are_simulated_whole() {
        let one = PipelineSchedule::OneFOneB;
        let interleaved = PipelineSchedule::Interleaved { virtual_stages: 2 };
        assert_eq!(sample_points(5, 2, one), None);
        assert_eq!(sample_points(6, 2, one), Some((4, 5)));
        assert_eq!(sample_points(6, 2, interleaved), None);
        assert_eq!(sample_points(8, 2, interleaved), Some((4, 6)));
        assert_eq!(sample_points(64, 8, one), Some((16, 17)));
        assert_eq!(sample_points(64, 8, interleaved), Some((16, 24)));
    }
}
