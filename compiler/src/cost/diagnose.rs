//! Diagnostics from a [`CostReport`]: warnings for a pipeline bubble over 25% (W0701) and ZeRO
//! over a single data-parallel rank (W0702 for ZeRO-3, W0703 for ZeRO-1/2); and, only for a
//! plan that is not lowered (`parc check --lower never`), E0701 from the formulas, labelled as
//! an estimate, with the biggest terms and what each single change to the plan would save
//! (each re-estimated on a modified copy of the spec). A lowered plan's memory verdict is
//! `crate::fit`'s, which measures the same [`alternatives`] by lowering them.

use super::{estimate, schedule, CostReport};
use crate::diag::{Diagnostic, Diagnostics};
use crate::spec::{Axis, Balance, LayerKind, PipelineSchedule, Recompute, Spec, ZeroStage};

/// The bubble fraction above which W0701 warns.
pub const BUBBLE_LIMIT: f64 = 0.25;

/// Bytes as GiB with one decimal; an amount that would print as 0.0 GiB (under 50 MiB: a
/// tiny model, a GPU of a few MB) in MiB or KiB instead, so no non-zero amount reads as none.
pub fn gib(bytes: u64) -> String {
    let gib = bytes as f64 / f64::from(1u32 << 30);
    if gib >= 0.05 || bytes == 0 {
        return format!("{gib:.1} GiB");
    }
    let mib = bytes as f64 / f64::from(1u32 << 20);
    if mib >= 0.05 {
        format!("{mib:.1} MiB")
    } else {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    }
}

fn peak(report: &CostReport) -> u64 {
    report.worst_role().map(|r| r.memory.total()).unwrap_or(0)
}

/// One alternative plan: what to write and the changed spec.
pub(crate) struct Alternative {
    pub change: String,
    pub spec: Spec,
}

/// Set the plan's recompute and each node's flag as the checker does.
pub(crate) fn set_recompute(spec: &mut Spec, recompute: Recompute) {
    for node in &mut spec.model.nodes {
        node.recompute = match &recompute {
            Recompute::None => false,
            Recompute::Selective => matches!(node.kind, LayerKind::Attention { .. }),
            Recompute::Full => node.layer.is_some(),
            Recompute::Named(names) => names
                .iter()
                .any(|n| n == node.kind.kind_name() || n == &node.name),
        };
    }
    spec.parallel.recompute = recompute;
}

fn set_axis(spec: &mut Spec, axis: Axis, size: u32) {
    for (a, n) in &mut spec.parallel.mesh.axes {
        if *a == axis {
            *n = size;
        }
    }
}

/// `spec` with `axis` (now `size`) twice as large and dp (now `dp`, even) halved, so the world
/// size stays, and the global batch halved with dp.
fn doubled(spec: &Spec, axis: Axis, size: u32, dp: u32) -> Alternative {
    let mut s = spec.clone();
    set_axis(&mut s, axis, size.saturating_mul(2));
    set_axis(&mut s, Axis::Dp, dp / 2);
    s.train.global_batch /= 2;
    Alternative {
        change: format!(
            "{} = {} (dp = {})",
            axis.name(),
            size.saturating_mul(2),
            dp / 2
        ),
        spec: s,
    }
}

/// Whether every dimension tp splits divides by `t`.
fn tp_fits(spec: &Spec, t: u32) -> bool {
    let t = u64::from(t);
    if t > u64::from(spec.cluster.gpus_per_node) || !spec.model.vocab.is_multiple_of(t) {
        return false;
    }
    spec.model.nodes.iter().all(|n| match n.kind {
        LayerKind::Attention {
            heads, kv_heads, ..
        } => heads.is_multiple_of(t) && kv_heads.is_multiple_of(t),
        LayerKind::Mlp { hidden, .. } => hidden.is_multiple_of(t),
        _ => true,
    })
}

/// Whether the model splits attention's sequence over cp (`shard Attention… seq on cp`) and
/// `c` ranks split it as the checker asks: 2·c chunks under causal attention (E0406), each
/// rank's share divisible by tp under sequence parallelism (E0410).
fn cp_fits(spec: &Spec, c: u32) -> bool {
    let c = u64::from(c);
    let (seq, tp) = (spec.model.seq, u64::from(spec.parallel.mesh.size(Axis::Tp)));
    let causal = (spec.model.nodes.iter())
        .any(|n| matches!(n.kind, LayerKind::Attention { causal: true, .. }));
    let chunks = if causal { 2 * c } else { c };
    spec.model.sharding.seq_on_cp
        && seq.is_multiple_of(chunks)
        && (!spec.parallel.sequence_parallel || (seq / c).is_multiple_of(tp))
}

/// The single changes that may lower a plan's memory: 1F1B for GPipe, a higher ZeRO stage,
/// recompute, twice the tp, cp or pp (halving dp), half the micro batch.
pub(crate) fn alternatives(spec: &Spec) -> Vec<Alternative> {
    let mut out = Vec::new();
    let (dp, pp, cp, tp) = spec.parallel.mesh.sizes();
    // GPipe holds every microbatch's activations until the backwards; 1F1B at most pp of them.
    if spec.parallel.schedule == PipelineSchedule::Gpipe && spec.parallel.microbatches > pp {
        let mut s = spec.clone();
        s.parallel.schedule = PipelineSchedule::OneFOneB;
        out.push(Alternative {
            change: "schedule = 1f1b".to_string(),
            spec: s,
        });
    }
    if dp * cp > 1 {
        for zero in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
            if zero > spec.parallel.zero {
                let mut s = spec.clone();
                s.parallel.zero = zero;
                out.push(Alternative {
                    change: format!("zero = {}", zero.level()),
                    spec: s,
                });
            }
        }
    }
    if spec.parallel.recompute == Recompute::None {
        let mut s = spec.clone();
        set_recompute(&mut s, Recompute::Selective);
        out.push(Alternative {
            change: "recompute = selective".to_string(),
            spec: s,
        });
    }
    if spec.parallel.recompute != Recompute::Full {
        let mut s = spec.clone();
        set_recompute(&mut s, Recompute::Full);
        out.push(Alternative {
            change: "recompute = full".to_string(),
            spec: s,
        });
    }
    // Doubling tp, cp or pp keeps the world size by halving dp.
    if dp.is_multiple_of(2) && tp_fits(spec, tp.saturating_mul(2)) {
        let mut alt = doubled(spec, Axis::Tp, tp, dp);
        let sh = &mut alt.spec.model.sharding;
        sh.attention_heads_on_tp = true;
        sh.mlp_hidden_on_tp = true;
        sh.vocab_on_tp = true;
        out.push(alt);
    }
    // Long sequences: twice the cp, where the model splits attention's sequence over cp.
    if dp.is_multiple_of(2) && cp_fits(spec, cp.saturating_mul(2)) {
        out.push(doubled(spec, Axis::Cp, cp, dp));
    }
    if dp.is_multiple_of(2) && splits_over(spec, pp.saturating_mul(2)) {
        out.push(doubled(spec, Axis::Pp, pp, dp));
    }
    let b = spec.train.micro_batch;
    if b.is_multiple_of(2) {
        let mut s = spec.clone();
        s.train.micro_batch = b / 2;
        s.parallel.microbatches = s.parallel.microbatches.saturating_mul(2);
        out.push(Alternative {
            change: format!(
                "micro_batch = {} (microbatches = {})",
                b / 2,
                spec.parallel.microbatches.saturating_mul(2)
            ),
            spec: s,
        });
    }
    // Each plan's layers per chunk as `check` would choose them for it.
    for alt in &mut out {
        super::balance::rebalance(&mut alt.spec);
    }
    out
}

/// Whether the spec's layers split over `pp` stages (each of v chunks) as its balance asks: the
/// even split must divide them, the cost model's needs a layer per chunk, and a given list is
/// for its own pp only.
fn splits_over(spec: &Spec, pp: u32) -> bool {
    let (_, v) = super::pipeline_shape(spec);
    let chunks = pp.saturating_mul(v);
    let layers = spec.model.layers;
    match spec.parallel.balance {
        Balance::Even => layers.is_multiple_of(chunks),
        Balance::Auto => layers >= chunks,
        Balance::Given => false,
    }
}

/// E0701 saying `what` needs more than the GPU has (`… but h100_80gb has 79.2 GiB`, then
/// `tail`), labelled at the plan and the cluster.
pub(crate) fn memory_error_head(spec: &Spec, what: &str, tail: &str) -> Diagnostic {
    let capacity = spec.cluster.gpu.memory_bytes;
    Diagnostic::error(
        "E0701",
        format!(
            "{what} but {} has {}{tail}",
            spec.cluster.gpu.name,
            gib(capacity)
        ),
    )
    .label(spec.parallel.span, "this plan")
    .label(spec.cluster.span, format!("{} per GPU here", gib(capacity)))
}

/// How a memory help measures a changed spec: its largest need per GPU (`None`: the change
/// does not give a plan), and the word for what a saving is per (`rank`, `GPU`).
pub(crate) struct Measure<'a> {
    pub need: &'a dyn Fn(&Spec) -> Option<u64>,
    pub per: &'a str,
}

/// The help of a plan needing `need` bytes per GPU: the first single change of `options`
/// (each with its measured need, smallest first) that fits, else the greedy combination that
/// fits, else the largest saving with the advice to use more or larger GPUs.
pub(crate) fn memory_help(
    spec: &Spec,
    need: u64,
    options: &[(String, u64)],
    measure: &Measure,
) -> String {
    let capacity = spec.cluster.gpu.memory_bytes;
    let per = measure.per;
    if let Some((change, after)) = options.iter().find(|(_, after)| *after <= capacity) {
        return format!(
            "{change} saves {} per {per} and fits: {} of {}",
            gib(need - after),
            gib(*after),
            gib(capacity)
        );
    }
    let Some((change, after)) = options.first() else {
        return format!(
            "use a GPU with at least {} or more GPUs (nodes × gpus_per_node)",
            gib(need)
        );
    };
    match combination(spec, need, measure) {
        Some((changes, peak)) => format!(
            "no single change fits; together {} fit: peak {} of {}",
            join_and(&changes),
            gib(peak),
            gib(capacity)
        ),
        None => format!(
            "no combination of these changes fits; the largest saving is {change} ({} per {per}, \
             peak {}): also use more GPUs or a larger GPU",
            gib(need - after),
            gib(*after)
        ),
    }
}

/// Greedily apply the change that lowers the need most until the plan fits (at most four).
fn combination(spec: &Spec, need: u64, measure: &Measure) -> Option<(Vec<String>, u64)> {
    let capacity = spec.cluster.gpu.memory_bytes;
    let mut current = spec.clone();
    let mut current_need = need;
    let mut changes = Vec::new();
    for _ in 0..4 {
        let (alt, after) = alternatives(&current)
            .into_iter()
            .filter_map(|alt| {
                let after = (measure.need)(&alt.spec)?;
                Some((alt, after))
            })
            .min_by_key(|(_, after)| *after)?;
        if after >= current_need {
            return None;
        }
        changes.push(alt.change);
        current = alt.spec;
        current_need = after;
        if current_need <= capacity {
            return Some((changes, current_need));
        }
    }
    None
}

/// `a`, `a and b`, `a, b and c`.
fn join_and(items: &[String]) -> String {
    match items.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
    }
}

fn memory_error(spec: &Spec, report: &CostReport) -> Option<Diagnostic> {
    let capacity = spec.cluster.gpu.memory_bytes;
    let worst = report.worst_role()?;
    let need = worst.memory.total();
    if need <= capacity {
        return None;
    }
    let over: Vec<String> = report
        .roles
        .iter()
        .filter(|r| r.memory.total() > capacity)
        .map(|r| format!("{} ({})", r.role, gib(r.memory.total())))
        .collect();
    let terms: Vec<String> = worst
        .memory
        .by_size()
        .iter()
        .filter(|(_, b)| *b >= 1 << 26)
        .map(|(name, b)| format!("{name} {}", gib(*b)))
        .collect();
    let what = format!("{} needs an estimated {} per GPU", worst.role, gib(need));
    let mut d = memory_error_head(spec, &what, " (cost formulas; the plan was not lowered)")
        .note(format!("biggest terms: {}", terms.join(", ")));
    if over.len() > 1 {
        d = d.note(format!("over the limit: {}", over.join(", ")));
    }
    let mut options: Vec<(String, u64)> = alternatives(spec)
        .into_iter()
        .map(|alt| (alt.change, peak(&estimate(&alt.spec))))
        .filter(|(_, after)| *after < need)
        .collect();
    options.sort_by_key(|(_, after)| *after);
    for (change, after) in &options {
        d = d.note(format!(
            "{change} saves {} per rank (peak {})",
            gib(need - after),
            gib(*after)
        ));
    }
    let estimated = |s: &Spec| Some(peak(&estimate(s)));
    let measure = Measure {
        need: &estimated,
        per: "rank",
    };
    Some(d.help(memory_help(spec, need, &options, &measure)))
}

/// Diagnose a plan that is not lowered from its cost report: memory over capacity by the
/// formulas (error) and wasteful plans ([`warnings`]).
pub fn diagnose(spec: &Spec, report: &CostReport) -> Diagnostics {
    let mut out = Diagnostics::default();
    if let Some(d) = memory_error(spec, report) {
        out.push(d);
    }
    out.extend(warnings(spec, report));
    out
}

/// The cost model's warnings: a pipeline bubble over 25% (W0701), ZeRO over one data-parallel
/// rank (W0702, W0703).
pub fn warnings(spec: &Spec, report: &CostReport) -> Diagnostics {
    let mut out = Diagnostics::default();
    let (p, v) = super::pipeline_shape(spec);
    if report.bubble_fraction > BUBBLE_LIMIT {
        let m = schedule::microbatches_for_bubble(spec.parallel.schedule, p, v, BUBBLE_LIMIT);
        let after = schedule::bubble_fraction(spec.parallel.schedule, p, v, m);
        let global =
            spec.train.micro_batch * u64::from(m) * u64::from(spec.parallel.mesh.size(Axis::Dp));
        out.push(
            Diagnostic::warning(
                "W0701",
                format!(
                    "the pipeline is idle {:.0}% of the step by the schedule's formula for \
                     equal stages ({} stages, {} microbatches)",
                    report.bubble_fraction * 100.0,
                    p,
                    report.microbatches
                ),
            )
            .label(spec.parallel.span, "this pipeline")
            .help(format!(
                "raise microbatches to {m} for under 25% ({:.1}% by the formula), with \
                 global_batch = {global}",
                after * 100.0
            ))
            .fix([
                ("parallel.microbatches", u64::from(m)),
                ("train.global_batch", global),
            ]),
        );
    }
    let nd = super::model_state::zero_group(spec);
    if nd == 1 && spec.parallel.zero == ZeroStage::Zero3 {
        out.push(
            Diagnostic::warning(
                "W0702",
                "zero = 3 with a single data-parallel rank shards nothing but still gathers every weight twice per microbatch",
            )
            .label(spec.parallel.span, "this plan")
            .help("set zero = 0, or raise dp above 1")
            .fix([("parallel.zero", 0)]),
        );
    } else if nd == 1 && spec.parallel.zero > ZeroStage::Zero0 {
        out.push(
            Diagnostic::warning(
                "W0703",
                format!(
                    "zero = {} with a single data-parallel rank shards nothing",
                    spec.parallel.zero.level()
                ),
            )
            .label(spec.parallel.span, "this plan")
            .help("set zero = 0, or raise dp above 1")
            .fix([("parallel.zero", 0)]),
        );
    }
    out
}
