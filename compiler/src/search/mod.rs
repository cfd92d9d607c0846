//! Plan search (`parc plan --search`): the plans of [`space`] for a spec on a number of GPUs,
//! each checked, the likely ones lowered, and the ones that fit ranked by predicted step time.
//!
//! 1. **Estimate** every candidate with the cost formulas on the checked spec changed in memory
//!    (microseconds each): their memory rejects only plans over 1.5× the GPU's (the formulas err
//!    low, docs/cost-model.md; the verdict is the lowered plan's).
//! 2. **Order** the rest by the formulas' step estimate: the slowest role's compute and
//!    tp/cp/pp communication over (1 − bubble), plus its gradient reduction. A candidate whose
//!    formula memory, times the largest underestimate seen on the plans lowered so far, is over
//!    the GPU's waits until the others are tried.
//! 3. **Check and lower** them in that order (the spec with the candidate's `--set` settings
//!    through the checker, whose errors reject it under their code; then one program per class
//!    of ranks as `parc check` does), until `top` fit and at least
//!    [`SearchOptions::lower_at_least`] were lowered, or [`SearchOptions::lower_at_most`] were: memory per GPU from the lowered plan (`fit`, the verdict
//!    E0701 gives) rejects what does not fit; the timeline gives the step time, bubble and
//!    exposed communication of the rest, which are ranked by step time. A candidate with more
//!    microbatches than that is simulated at 2p and 2p + 1 microbatches (interleaved: 2p and
//!    3p) and extrapolated linearly (the steady state repeats; `tests` hold the extrapolation
//!    to the whole simulation); only the larger sample is verified and memory-planned (memory
//!    per GPU does not grow with more microbatches). Every lowering of a batch of candidates
//!    is a job for one thread per core.
//! 4. **Confirm** the fastest: the winner is lowered and simulated whole, as `parc check` would,
//!    so its numbers are check's; the others shown keep their sampled numbers. An `auto` stage
//!    balance that splits the layers evenly is the even candidate and is not tried twice.
//!
//! Every rejection is counted by rule, and the plan closest to fitting is kept, so a space
//! with no plan that fits says which constraint rejected the most and by how much.

pub mod space;

use crate::cost::CostReport;
use crate::diag::Diagnostics;
use crate::driver::{self, analyze_with, prices, CompileOptions, Compiled, Stage};
use crate::ir::Plan;
use crate::lower::{lower_chosen, LowerOptions};
use crate::overrides::Override;
use crate::spec::{PipelineSchedule, Spec};
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
    /// on `top`: the formulas' order is only roughly the timeline's.
    pub lower_at_least: usize,
    /// Most candidates lowered, in the formulas' order.
    pub lower_at_most: usize,
    /// Lower with the fusion pass (as the run would).
    pub fusion: bool,
    /// The profile that prices the timeline (`None`: the GPU's peak numbers).
    pub calibration: Option<std::sync::Arc<crate::timeline::Calibration>>,
}

/// How candidates are lowered and priced.
#[derive(Clone, Default)]
struct Pricing {
    fusion: bool,
    calibration: Option<std::sync::Arc<crate::timeline::Calibration>>,
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
}

/// How many candidates a rule rejected, and the one that came closest (for memory: the
/// smallest need over the GPU's memory).
#[derive(Clone, Debug)]
pub struct Rejection {
    pub rule: String,
    pub count: u64,
    pub closest: Option<(Candidate, u64)>,
}

/// What a search found.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The plans that fit, fastest first (at most `top`).
    pub ranked: Vec<Ranked>,
    pub rejected: Vec<Rejection>,
    /// Candidates in the space; those within the formulas' loose memory bound, ordered by
    /// their step estimate; those checked and lowered.
    pub candidates: usize,
    pub considered: usize,
    pub lowered: usize,
    pub gpus: u32,
    pub gpu_memory_bytes: u64,
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
    let mut base = overrides.to_vec();
    if let Some(n) = options.nodes {
        base.push(set("cluster.nodes", n.to_string()));
    }
    if let Some(g) = options.gpus_per_node {
        base.push(set("cluster.gpus_per_node", g.to_string()));
    }
    let (spec, nodes, gpus_per_node) = base_spec(name, text, overrides, &base, options)?;
    let gpus = nodes * gpus_per_node;
    let capacity = spec.cluster.gpu.memory_bytes;
    let space = space::space(&spec, gpus, gpus_per_node);
    let mut rejected: Vec<Rejection> = space
        .rejected
        .iter()
        .map(|(rule, count)| Rejection {
            rule: rule.clone(),
            count: *count,
            closest: None,
        })
        .collect();
    let candidates = space.candidates.len();
    let shape = (nodes, gpus_per_node);
    let mut queue = estimate_all(&spec, space.candidates, shape, &mut rejected, progress);
    queue.sort_by(|a, b| a.step.total_cmp(&b.step));
    let estimated = queue.len();
    let how = Pricing {
        fusion: options.fusion,
        calibration: options.calibration.clone(),
    };
    let mut lowering = Lowering {
        name,
        text,
        base: &base,
        capacity,
        how: how.clone(),
        underestimate: 1.0,
        lowered: 0,
        rejected: &mut rejected,
    };
    let fitting = lowering.run(&mut queue, options, progress);
    let lowered = lowering.lowered;
    let mut ranked = confirm(fitting, options.top, &how, capacity, &mut rejected);
    ranked.sort_by(|a, b| a.step_seconds.total_cmp(&b.step_seconds));
    rejected.sort_by_key(|r| std::cmp::Reverse(r.count));
    Ok(Outcome {
        ranked,
        rejected,
        candidates,
        considered: estimated,
        lowered,
        gpus,
        gpu_memory_bytes: capacity,
    })
}

/// Every candidate estimated by the formulas on `spec` changed in memory, on the cluster of
/// `(nodes, gpus per node)`; those over the formulas' loose memory bound are counted in
/// `rejected`, the rest returned.
fn estimate_all(
    spec: &Spec,
    candidates: Vec<Candidate>,
    (nodes, gpus_per_node): (u32, u32),
    rejected: &mut Vec<Rejection>,
    progress: &(dyn Fn(Progress) + Sync),
) -> Vec<Estimated> {
    let capacity = spec.cluster.gpu.memory_bytes as f64;
    let total = candidates.len();
    let mut kept = Vec::new();
    for (i, c) in candidates.into_iter().enumerate() {
        if i % 256 == 0 {
            progress(Progress::Checking { done: i, total });
        }
        let Some(e) = estimate(spec, c, nodes, gpus_per_node) else {
            continue;
        };
        if e.memory as f64 > FORMULA_SLACK * capacity {
            count(rejected, FORMULA_RULE, Some((e.candidate, e.memory)));
        } else {
            kept.push(e);
        }
    }
    kept
}

/// The `top` plans shown, fastest first: the winner lowered and simulated whole, so its
/// numbers are check's (a winner that does not fit whole gives way to the next; one simulated
/// whole already is not lowered again); the others keep their sampled numbers (within 1% of
/// whole, `tests`).
fn confirm(
    fitting: Vec<(Estimated, Ranked)>,
    top: usize,
    how: &Pricing,
    capacity: u64,
    rejected: &mut Vec<Rejection>,
) -> Vec<Ranked> {
    let mut ranked: Vec<Ranked> = Vec::new();
    for (c, sampled) in fitting {
        if ranked.len() == top {
            break;
        }
        let k = &c.candidate;
        if !ranked.is_empty() || sample_points(k.microbatches, k.pp, k.schedule).is_none() {
            ranked.push(sampled);
            continue;
        }
        match evaluate(&c.spec, &c.candidate, how) {
            Ok(r) if fits(&r, capacity) => ranked.push(r),
            Ok(r) => count(rejected, MEMORY_RULE, Some((c.candidate, need(&r)))),
            Err(rule) => count(rejected, &rule, None),
        }
    }
    ranked
}

/// The spec whose model and recipe are searched, and the cluster's nodes and GPUs per node:
/// the spec as given (with the cluster `options` set) when it checks; else the spec under a
/// neutral plan ([`neutral_spec`]): its own plan is what the search replaces, so a mesh that
/// does not match the new cluster, a microbatch count tied to its dp, a `layers` list for its
/// pipeline or an interleaved schedule that does not fit does not stop the search. `Err`: the
/// spec's own errors.
fn base_spec(
    name: &str,
    text: &str,
    overrides: &[Override],
    base: &[Override],
    options: &SearchOptions,
) -> Result<(Spec, u32, u32), Box<Compiled>> {
    let compiled = driver::compile(name, text.to_string(), base, &check_options());
    if let (Some(spec), false) = (&compiled.spec, compiled.diagnostics.has_errors()) {
        let c = &spec.cluster;
        return Ok((spec.clone(), c.nodes, c.gpus_per_node));
    }
    match neutral_spec(name, text, overrides, options) {
        Ok(spec) => {
            let c = &spec.cluster;
            let shape = match (options.nodes, options.gpus_per_node) {
                (None, None) => (c.nodes, c.gpus_per_node),
                (n, g) => (n.unwrap_or(1), g.unwrap_or(1)),
            };
            Ok((spec, shape.0, shape.1))
        }
        // The model's or recipe's own errors, which the spec's plan errors may have hidden
        // (a check stops at a mesh that does not match the cluster).
        Err(Some(variant)) if !variant_errors_are_plans(&variant) => Err(variant),
        Err(_) => Err(Box::new(compiled)),
    }
}

/// Whether any error of `compiled` is about the plan (mesh, divisibility, batch arithmetic,
/// schedule, placement, memory: E04xx to E07xx), whose spans may point at the neutral plan's
/// settings rather than at what the user wrote.
fn variant_errors_are_plans(compiled: &Compiled) -> bool {
    let plan = ["E04", "E05", "E06", "E07"];
    (compiled.diagnostics.items.iter())
        .filter(|d| d.is_error())
        .any(|d| plan.iter().any(|p| d.code.starts_with(p)))
}

/// The spec under the simplest plan: with a cluster from `options`, one GPU (dp = 1, so the
/// batch arithmetic holds); else its own cluster, all of it dp. ZeRO 0, 1F1B, micro batch 1,
/// no virtual stages or `layers` list; then the checker's own fixes that change only
/// `parallel.*` (E0401's dp, E0501's microbatches) applied, a few rounds. `Err`: it still
/// fails, with the last attempt's diagnostics (an error of the model or the recipe, which the
/// search cannot change; or a plan error no fix of the checker's resolves).
fn neutral_spec(
    name: &str,
    text: &str,
    overrides: &[Override],
    options: &SearchOptions,
) -> Result<Spec, Option<Box<Compiled>>> {
    let given = options.nodes.is_some() || options.gpus_per_node.is_some();
    let mut sets = overrides.to_vec();
    if given {
        sets.push(set("cluster.nodes", "1".to_string()));
        sets.push(set("cluster.gpus_per_node", "1".to_string()));
    }
    for (path, value) in [
        ("parallel.dp", "1"),
        ("parallel.pp", "1"),
        ("parallel.cp", "1"),
        ("parallel.tp", "1"),
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

/// Count a rejection under `rule`; keep the closest (smallest need) candidate.
fn count(rejected: &mut Vec<Rejection>, rule: &str, closest: Option<(Candidate, u64)>) {
    let entry = match rejected.iter_mut().position(|r| r.rule == rule) {
        Some(i) => &mut rejected[i],
        None => {
            rejected.push(Rejection {
                rule: rule.to_string(),
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
const FORMULA_RULE: &str = "memory per GPU over 1.5× the GPU's by the cost formulas";

/// A candidate with the formulas' estimates, from the base spec changed in memory.
struct Estimated {
    candidate: Candidate,
    spec: Spec,
    step: f64,
    memory: u64,
}

/// The base spec with the candidate's plan and the cluster's shape, estimated by the formulas;
/// `None` for an `auto` balance that splits the layers evenly (the even candidate is the same
/// plan).
fn estimate(
    base: &Spec,
    candidate: Candidate,
    nodes: u32,
    gpus_per_node: u32,
) -> Option<Estimated> {
    let mut spec = base.clone();
    let c = &candidate;
    for (axis, n) in &mut spec.parallel.mesh.axes {
        *n = match axis {
            crate::spec::Axis::Dp => c.dp,
            crate::spec::Axis::Pp => c.pp,
            crate::spec::Axis::Cp => c.cp,
            crate::spec::Axis::Tp => c.tp,
        };
    }
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
        let (p, v) = spec.parallel.pipeline_shape();
        if spec.parallel.chunk_layers == crate::spec::even_layers(spec.model.layers, p * v) {
            return None;
        }
    }
    let cost = crate::cost::estimate(&spec);
    Some(Estimated {
        step: step_estimate(&cost),
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
    base: &'a [Override],
    capacity: u64,
    how: Pricing,
    /// The largest lowered need over the formulas' seen so far (at least 1).
    underestimate: f64,
    /// Candidates lowered so far.
    lowered: usize,
    rejected: &'a mut Vec<Rejection>,
}

impl Lowering<'_> {
    /// Lower candidates from `queue` until `options.top` fit or `options.lower_at_most` were
    /// lowered; returns those that fit with their (sampled) rankings, fastest first.
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
        let enough = |lowered: usize, fit: usize| {
            lowered >= options.lower_at_most
                || (fit >= options.top && lowered >= options.lower_at_least)
        };
        while !enough(self.lowered, fitting.len()) && !queue.is_empty() {
            progress(Progress::Lowering {
                done: self.lowered,
                total: options.lower_at_most,
            });
            let room = (options.lower_at_most - self.lowered).min(width);
            let batch = self.take_checked(queue, room);
            self.lowered += batch.len();
            for (e, result) in evaluate_all(batch, &self.how) {
                match result {
                    Ok(r) => {
                        let ratio = need(&r) as f64 / e.memory.max(1) as f64;
                        self.underestimate = self.underestimate.max(ratio);
                        if fits(&r, self.capacity) {
                            fitting.push((e, r));
                        } else {
                            count(self.rejected, MEMORY_RULE, Some((e.candidate, need(&r))));
                        }
                    }
                    Err(rule) => count(self.rejected, &rule, None),
                }
            }
        }
        fitting.sort_by(|a, b| a.1.step_seconds.total_cmp(&b.1.step_seconds));
        fitting
    }

    /// Up to `n` candidates from the queue, in order, that pass the checker (the others are
    /// counted under the checker's rule).
    fn take_checked(&mut self, queue: &mut Vec<Estimated>, n: usize) -> Vec<Estimated> {
        let mut batch = Vec::new();
        while batch.len() < n && !queue.is_empty() {
            let e = queue.remove(self.next(queue));
            match self.check(&e.candidate) {
                Ok(()) => batch.push(e),
                Err(rule) => count(self.rejected, &rule, None),
            }
        }
        batch
    }

    /// The first candidate the learnt factor keeps under the GPU's memory, else the first.
    fn next(&self, queue: &[Estimated]) -> usize {
        let limit = self.capacity as f64 / self.underestimate;
        queue
            .iter()
            .position(|e| e.memory as f64 <= limit)
            .unwrap_or(0)
    }

    /// The checker's verdict on the candidate's `--set` settings: `Err` names its first error.
    fn check(&self, candidate: &Candidate) -> Result<(), String> {
        let mut overrides = self.base.to_vec();
        overrides.extend(candidate.settings().into_iter().map(|(p, v)| set(&p, v)));
        let options = CompileOptions::through(Stage::Check);
        let compiled = driver::compile(self.name, self.text.to_string(), &overrides, &options);
        match compiled.diagnostics.items.iter().find(|d| d.is_error()) {
            Some(d) => Err(rule_of(d.code, &d.message)),
            None => Ok(()),
        }
    }
}

/// A diagnostic as a rejection rule: its code and message with the numbers left out, so one
/// rule counts every candidate it rejects.
fn rule_of(code: &str, message: &str) -> String {
    let mut text = String::new();
    let mut in_number = false;
    for ch in message.chars() {
        if ch.is_ascii_digit() {
            if !in_number {
                text.push('N');
            }
            in_number = true;
        } else {
            in_number = false;
            text.push(ch);
        }
    }
    format!("{code} {text}")
}

/// The formulas' step: the slowest role's compute and tp/cp/pp communication over
/// (1 − bubble), plus its gradient reduction (not overlapped).
fn step_estimate(cost: &CostReport) -> f64 {
    let keep = (1.0 - cost.bubble_fraction).max(0.05);
    cost.roles
        .iter()
        .map(|r| {
            let (mut inner, mut dp) = (r.compute_seconds, 0.0);
            for c in &r.comm {
                if c.axis == crate::spec::Axis::Dp {
                    dp += c.seconds;
                } else {
                    inner += c.seconds;
                }
            }
            inner / keep + dp
        })
        .fold(0.0, f64::max)
}

const MEMORY_RULE: &str = "memory per GPU (lowered plan)";

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
fn evaluate_all(batch: Vec<Estimated>, how: &Pricing) -> Vec<(Estimated, Result<Ranked, String>)> {
    let jobs: Vec<Job> = batch
        .iter()
        .flat_map(|e| jobs_of(&e.spec, &e.candidate))
        .collect();
    let done = run_jobs(&jobs, how);
    let mut done = done.into_iter();
    let results: Vec<Result<Ranked, String>> = jobs
        .iter()
        .filter(|j| j.first)
        .map(|job| {
            let first = done.next().unwrap_or_else(|| Err(LOST.to_string()));
            match job.sampled {
                None => first,
                Some(points) => {
                    let second = done.next().unwrap_or_else(|| Err(LOST.to_string()));
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
fn run_jobs(jobs: &[Job], how: &Pricing) -> Vec<Result<Ranked, String>> {
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| !jobs[i].planned);
    let width = std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
        .min(jobs.len())
        .max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<Option<Result<Ranked, String>>>> =
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
                .unwrap_or_else(|| Err(LOST.to_string()))
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
fn evaluate_sampled(spec: &Spec, candidate: &Candidate, how: &Pricing) -> Result<Ranked, String> {
    let jobs = jobs_of(spec, candidate);
    let mut done = run_jobs(&jobs, how).into_iter();
    let first = done.next().unwrap_or_else(|| Err(LOST.to_string()))?;
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
    }
}

/// Lower `spec` for analysis, its FP8 layers priced as its timeline is.
fn lower(spec: &Spec, how: &Pricing) -> Result<Plan, String> {
    let options = LowerOptions {
        fusion: how.fusion,
        representatives: true,
        ..LowerOptions::default()
    };
    let fp8 = crate::fp8::choices(spec, prices(how.calibration.as_deref()));
    lower_chosen(spec, options, &fp8).map_err(|d| first_error(&d, "lowering"))
}

/// Lower, verify, plan and simulate `spec` (the candidate's): its ranking, or why it cannot be.
fn evaluate(spec: &Spec, candidate: &Candidate, how: &Pricing) -> Result<Ranked, String> {
    let plan = lower(spec, how)?;
    let mut diagnostics = Diagnostics::default();
    let calibration = how.calibration.as_deref();
    let analysis = analyze_with(spec, &plan, Stage::Timeline, calibration, &mut diagnostics);
    let (Some(fit), Some(timeline)) = (analysis.fit, analysis.timeline) else {
        return Err(first_error(&diagnostics, "verification"));
    };
    let memory = fit.into_iter().map(|n| (n.role, n.bytes)).collect();
    Ok(ranking(spec, candidate, &timeline, memory))
}

/// Lower and simulate `spec` only (a first sample, whose second is verified and planned): its
/// ranking without memory.
fn simulate(spec: &Spec, candidate: &Candidate, how: &Pricing) -> Result<Ranked, String> {
    let plan = lower(spec, how)?;
    let timeline = crate::timeline::simulate_calibrated(&plan, spec, how.calibration.as_deref());
    if !timeline.complete {
        return Err("the simulated step does not finish (the plan does not verify)".to_string());
    }
    Ok(ranking(spec, candidate, &timeline, Vec::new()))
}

fn ranking(
    spec: &Spec,
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
    }
}

fn first_error(d: &Diagnostics, stage: &str) -> String {
    d.items.iter().find(|x| x.is_error()).map_or_else(
        || format!("{stage} failed"),
        |x| format!("{} {}", x.code, x.message),
    )
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
                calibration: None,
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
            fusion: true,
            calibration: None,
        };
        let outcome = search("tiny.par", text, &[], &options, &|_| {}).expect("searches");
        assert_eq!(outcome.ranked.len(), top);
        let (spec, ..) = base_spec("tiny.par", text, &[], &[], &options).expect("checks");
        let how = Pricing {
            fusion: true,
            calibration: None,
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
            .filter_map(|c| estimate(&spec, c, 1, 2))
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
