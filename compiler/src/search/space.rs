//! The plans a search considers for a checked spec on `gpus` GPUs: every dp × pp × cp × tp whose
//! product is the GPU count, with ZeRO 0–3 (1–3 only where dp·cp > 1), 1F1B or interleaved 1F1B
//! with 2 or 4 virtual stages and layers split evenly or by `balance: auto` (pipelines only;
//! a pp not dividing the layers runs 1F1B split by `balance: auto` alone, as Llama 3 405B's 126
//! layers on Meta's pp 16),
//! every power-of-two micro batch that divides the
//! global batch per dp rank (≤ 64), recompute none, selective or full, and sequence
//! parallelism with every tp > 1 (as Megatron runs it). The global batch is the spec's (the
//! batch rule: global = dp × micro batch × microbatches). The mesh is always laid out
//! `{ dp, pp, cp, tp }`, outermost first (tp innermost, as Megatron places it), whatever order
//! the spec wrote its own in.
//!
//! Candidates the arithmetic alone rules out are counted here by rule, in plans (a mesh ruled
//! out counts every plan it would have given), so every rule of a search counts the same thing:
//! tp or cp × tp groups that do not fit in a node, tp on a model that does not shard on tp, tp
//! not dividing heads, kv heads, the MLP width or the vocabulary, cp on a model that does not
//! shard its sequence or that does not divide it, sequence parallelism's tp not dividing each
//! cp rank's tokens, more pipeline stages than layers, dp not dividing the global batch, fewer
//! microbatches than stages, interleaving with microbatches not a multiple of pp; the checker
//! and the lowering judge the rest.

use crate::spec::{Axis, Balance, LayerKind, PipelineSchedule, Recompute, Spec, ZeroStage};

/// One plan of the search space, as the settings a `--set` writes.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub dp: u32,
    pub pp: u32,
    pub cp: u32,
    pub tp: u32,
    pub zero: ZeroStage,
    pub schedule: PipelineSchedule,
    pub micro_batch: u64,
    pub microbatches: u32,
    pub recompute: Recompute,
    /// How the layers split over the pipeline's chunks: even, or `auto` (the cost model's).
    pub balance: Balance,
}

impl Candidate {
    /// The `--set PATH=VALUE` settings that turn the spec into this plan.
    pub fn settings(&self) -> Vec<(String, String)> {
        // The whole mesh in one record, so its order is this one whatever the spec's was (a
        // `--set parallel.pp=2` alone would add pp innermost, splitting tp's groups).
        let mut out = vec![
            (
                "parallel.mesh",
                format!(
                    "{{dp: {}, pp: {}, cp: {}, tp: {}}}",
                    self.dp, self.pp, self.cp, self.tp
                ),
            ),
            ("parallel.zero", self.zero.level().to_string()),
            (
                "parallel.schedule",
                schedule_name(self.schedule).to_string(),
            ),
            ("parallel.microbatches", self.microbatches.to_string()),
            ("train.micro_batch", self.micro_batch.to_string()),
            (
                "parallel.recompute",
                recompute_name(&self.recompute).to_string(),
            ),
            ("parallel.sequence_parallel", (self.tp > 1).to_string()),
        ];
        // One chunk per stage unless interleaved (so a spec's own `virtual` does not linger).
        let virtual_stages = match self.schedule {
            PipelineSchedule::Interleaved { virtual_stages } => virtual_stages,
            _ => 1,
        };
        out.push(("parallel.virtual", virtual_stages.to_string()));
        // Always: it replaces a `layers` list the spec may give for its own pipeline.
        out.push(("parallel.balance", balance_name(self.balance).to_string()));
        out.into_iter().map(|(p, v)| (p.to_string(), v)).collect()
    }

    /// A one-line description: `dp 8 pp 1 cp 1 tp 8, zero 1, 1f1b, micro batch 1 × 16, full`.
    pub fn describe(&self) -> String {
        let schedule = match self.schedule {
            PipelineSchedule::Interleaved { virtual_stages } => {
                format!("interleaved v{virtual_stages}")
            }
            s => schedule_name(s).to_string(),
        };
        let balance = if self.pp > 1 {
            format!(" ({})", balance_name(self.balance))
        } else {
            String::new()
        };
        format!(
            "dp {} pp {} cp {} tp {}{}, zero {}, {schedule}{balance}, {} × {}, recompute {}",
            self.dp,
            self.pp,
            self.cp,
            self.tp,
            if self.tp > 1 { " +sp" } else { "" },
            self.zero.level(),
            self.micro_batch,
            self.microbatches,
            recompute_name(&self.recompute)
        )
    }
}

fn schedule_name(s: PipelineSchedule) -> &'static str {
    match s {
        PipelineSchedule::Gpipe => "gpipe",
        PipelineSchedule::OneFOneB => "1f1b",
        PipelineSchedule::Interleaved { .. } => "interleaved",
    }
}

fn balance_name(b: Balance) -> &'static str {
    match b {
        Balance::Even | Balance::Given => "even",
        Balance::Auto => "auto",
    }
}

fn recompute_name(r: &Recompute) -> &'static str {
    match r {
        Recompute::None => "none",
        Recompute::Selective => "selective",
        Recompute::Full | Recompute::Named(_) => "full",
    }
}

/// The space: candidates to check, and how many plans each arithmetic rule ruled out.
pub struct Space {
    pub candidates: Vec<Candidate>,
    pub rejected: Vec<(String, u64)>,
}

impl Space {
    /// Every plan of the space: the candidates and those the arithmetic ruled out.
    pub fn plans(&self) -> u64 {
        self.candidates.len() as u64 + self.rejected.iter().map(|(_, n)| n).sum::<u64>()
    }
}

/// Count `n` plans rejected under `rule`.
fn reject(rejected: &mut Vec<(String, u64)>, rule: &str, n: u64) {
    match rejected.iter_mut().find(|(r, _)| r == rule) {
        Some((_, count)) => *count += n,
        None => rejected.push((rule.to_string(), n)),
    }
}

/// Every ordered (dp, pp, cp, tp) with product `gpus`.
fn meshes(gpus: u32) -> Vec<[u32; 4]> {
    let divisors = |n: u32| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut out = Vec::new();
    for tp in divisors(gpus) {
        for cp in divisors(gpus / tp) {
            for pp in divisors(gpus / tp / cp) {
                out.push([gpus / tp / cp / pp, pp, cp, tp]);
            }
        }
    }
    out
}

/// Why tp cannot split the model: a layer it would split that the model does not shard on tp
/// (E0411, E0413, E0414), or a width it does not divide: heads and kv heads, the MLP hidden
/// width, the vocabulary (E0402–E0405).
fn tp_rule(spec: &Spec, tp: u32) -> Option<&'static str> {
    if tp <= 1 {
        return None;
    }
    let t = u64::from(tp);
    let sh = &spec.model.sharding;
    let has = |f: fn(&LayerKind) -> bool| spec.model.nodes.iter().any(|n| f(&n.kind));
    let unsharded = !sh.attention_heads_on_tp
        || (has(|k| matches!(k, LayerKind::Mlp { .. })) && !sh.mlp_hidden_on_tp)
        || (has(|k| matches!(k, LayerKind::Embedding { .. })) && !sh.vocab_on_tp);
    if unsharded {
        return Some("tp on a model that does not shard its layers on tp");
    }
    if sh.vocab_on_tp && !spec.model.vocab.is_multiple_of(t) {
        return Some("tp does not divide the vocabulary");
    }
    for node in &spec.model.nodes {
        match node.kind {
            LayerKind::Attention {
                heads, kv_heads, ..
            } if !heads.is_multiple_of(t) || !kv_heads.is_multiple_of(t) => {
                return Some("tp does not divide the (kv) heads");
            }
            LayerKind::Mlp { hidden, .. } if !hidden.is_multiple_of(t) => {
                return Some("tp does not divide the MLP width");
            }
            _ => {}
        }
    }
    None
}

/// Why cp cannot split the sequence (E0412, E0406), or sequence parallelism the tokens of each
/// cp rank (E0410; the search runs SP with every tp > 1).
fn sequence_rule(spec: &Spec, cp: u32, tp: u32) -> Option<&'static str> {
    let seq = spec.model.seq;
    let causal = spec
        .model
        .nodes
        .iter()
        .any(|n| matches!(n.kind, LayerKind::Attention { causal: true, .. }));
    if cp > 1 && !spec.model.sharding.seq_on_cp {
        return Some("cp on a model that does not shard its sequence");
    }
    let cp = u64::from(cp);
    if cp > 1 && causal && !seq.is_multiple_of(2 * cp) {
        return Some(
            "2·cp does not divide the sequence (causal attention gives each cp rank two chunks)",
        );
    }
    if cp > 1 && !seq.is_multiple_of(cp) {
        return Some("cp does not divide the sequence");
    }
    if tp > 1 && !(seq / cp.max(1)).is_multiple_of(u64::from(tp)) {
        return Some("tp does not divide each cp rank's tokens (sequence parallelism)");
    }
    None
}

/// Why the mesh `[dp, pp, cp, tp]` cannot be, by arithmetic alone (a tp or cp group must fit in
/// a node as E0601 places it: with tp innermost, tp and cp × tp dividing the node's GPUs, unless
/// the spec lets that axis span nodes with `cross_node`).
fn mesh_rule(spec: &Spec, [dp, pp, cp, tp]: [u32; 4], gpus_per_node: u32) -> Option<&'static str> {
    let allowed = |axis: Axis| spec.parallel.cross_node.contains(&axis);
    let fits = |ranks: u32, axis: Axis| gpus_per_node.is_multiple_of(ranks) || allowed(axis);
    if !fits(tp, Axis::Tp) {
        Some("tp groups do not fit in a node")
    } else if cp > 1 && !fits(cp * tp, Axis::Cp) {
        Some("cp × tp groups do not fit in a node")
    } else if pp > spec.model.layers.max(1) {
        Some("more pipeline stages than layers")
    } else if !spec.train.global_batch.is_multiple_of(u64::from(dp)) {
        Some("dp does not divide the global batch")
    } else {
        tp_rule(spec, tp).or_else(|| sequence_rule(spec, cp, tp))
    }
}

/// The schedules a pipeline of `pp` stages may run for `layers` repeated layers.
fn schedules(pp: u32, layers: u32) -> Vec<PipelineSchedule> {
    if pp == 1 {
        return vec![PipelineSchedule::OneFOneB];
    }
    let mut out = vec![PipelineSchedule::OneFOneB];
    for v in [2, 4] {
        if layers.is_multiple_of(pp * v) {
            out.push(PipelineSchedule::Interleaved { virtual_stages: v });
        }
    }
    out
}

/// The power-of-two micro batches (≤ 64) dividing `per_dp` sequences.
fn micro_batches(per_dp: u64) -> impl Iterator<Item = u64> {
    (0..7)
        .map(|k| 1u64 << k)
        .filter(move |b| per_dp.is_multiple_of(*b))
}

/// The plans of one (mesh, schedule, micro batch) ruled out: its ZeRO stages × recomputes
/// (an `auto` balance is a plan of its own only where it splits the layers unevenly, which
/// only the cost model knows: `search::estimate`).
fn variants(dp: u32, cp: u32) -> u64 {
    zero_stages(dp * cp).len() as u64 * 3
}

/// The plans a mesh gives: its schedules × micro batches × [`variants`] (for a dp that does
/// not divide the global batch, the micro batches dividing the global batch).
fn plans_of_mesh(spec: &Spec, [dp, pp, cp, _]: [u32; 4]) -> u64 {
    let global = spec.train.global_batch;
    let per_dp = match global.checked_div(u64::from(dp)) {
        Some(q) if q * u64::from(dp) == global => q,
        _ => global,
    };
    let schedules = schedules(pp, spec.model.layers.max(1)).len() as u64;
    schedules * micro_batches(per_dp).count() as u64 * variants(dp, cp)
}

/// The space of `spec` (checked) on `gpus` GPUs of `gpus_per_node` each.
pub fn space(spec: &Spec, gpus: u32, gpus_per_node: u32) -> Space {
    let mut rejected = Vec::new();
    let mut candidates = Vec::new();
    let global = spec.train.global_batch;
    let layers = spec.model.layers.max(1);
    for mesh in meshes(gpus) {
        if let Some(rule) = mesh_rule(spec, mesh, gpus_per_node) {
            reject(&mut rejected, rule, plans_of_mesh(spec, mesh));
            continue;
        }
        let [dp, pp, cp, tp] = mesh;
        let per_dp = global / u64::from(dp);
        for schedule in schedules(pp, layers) {
            for micro_batch in micro_batches(per_dp) {
                let microbatches = (per_dp / micro_batch).min(u64::from(u32::MAX)) as u32;
                let interleaved = matches!(schedule, PipelineSchedule::Interleaved { .. });
                let rule = if pp > 1 && microbatches < pp {
                    Some("fewer microbatches than pipeline stages")
                } else if interleaved && !microbatches.is_multiple_of(pp) {
                    Some("interleaved with microbatches not a multiple of pp")
                } else {
                    None
                };
                if let Some(rule) = rule {
                    reject(&mut rejected, rule, variants(dp, cp));
                    continue;
                }
                let balances: &[Balance] = if pp > 1 && !layers.is_multiple_of(pp) {
                    // No even split: only the cost model's uneven one (E0407 refuses `even`).
                    &[Balance::Auto]
                } else if pp > 1 {
                    &[Balance::Even, Balance::Auto]
                } else {
                    &[Balance::Even]
                };
                for zero in zero_stages(dp * cp) {
                    for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                        for &balance in balances {
                            candidates.push(Candidate {
                                dp,
                                pp,
                                cp,
                                tp,
                                zero,
                                schedule,
                                micro_batch,
                                microbatches,
                                recompute: recompute.clone(),
                                balance,
                            });
                        }
                    }
                }
            }
        }
    }
    Space {
        candidates,
        rejected,
    }
}

fn zero_stages(shards: u32) -> Vec<ZeroStage> {
    if shards > 1 {
        vec![
            ZeroStage::Zero0,
            ZeroStage::Zero1,
            ZeroStage::Zero2,
            ZeroStage::Zero3,
        ]
    } else {
        vec![ZeroStage::Zero0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meshes_multiply_to_the_gpus_and_are_all_there() {
        let all = meshes(64);
        assert!(all.iter().all(|m| m.iter().product::<u32>() == 64));
        // 64 = 2^6 over four axes: C(6 + 3, 3) = 84 ordered factorizations.
        assert_eq!(all.len(), 84);
        let mut sorted = all.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), all.len());
    }

    #[test]
    fn pipelines_get_interleaving_only_where_the_layers_divide() {
        assert_eq!(schedules(1, 12), vec![PipelineSchedule::OneFOneB]);
        assert_eq!(schedules(4, 12), vec![PipelineSchedule::OneFOneB]);
        assert_eq!(
            schedules(4, 16),
            vec![
                PipelineSchedule::OneFOneB,
                PipelineSchedule::Interleaved { virtual_stages: 2 },
                PipelineSchedule::Interleaved { virtual_stages: 4 }
            ]
        );
    }
}
