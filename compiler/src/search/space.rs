//! The plans a search considers for a checked spec on `gpus` GPUs: every dp × pp × cp × tp whose
//! product is the GPU count, with ZeRO 0–3 (1–3 only where dp·cp > 1), 1F1B or interleaved 1F1B
//! with 2 or 4 virtual stages and layers split evenly or by `balance: auto` (pipelines only),
//! every power-of-two micro batch that divides the
//! global batch per dp rank (≤ 64), recompute none, selective or full, and sequence
//! parallelism with every tp > 1 (as Megatron runs it). The global batch is the spec's (the
//! batch rule: global = dp × micro batch × microbatches).
//!
//! Candidates the arithmetic alone rules out are counted here by rule (tp over a node, tp not
//! dividing heads, kv heads, the MLP width or the vocabulary, pp × virtual not dividing the
//! layers, fewer microbatches than stages, cp × tp over a node, cp on a model that does not
//! shard its sequence);
//! the checker and the lowering judge the rest.

use crate::spec::{Balance, LayerKind, PipelineSchedule, Recompute, Spec, ZeroStage};

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
        let mut out = vec![
            ("parallel.dp", self.dp.to_string()),
            ("parallel.pp", self.pp.to_string()),
            ("parallel.cp", self.cp.to_string()),
            ("parallel.tp", self.tp.to_string()),
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

/// The space: candidates to check, and how many each arithmetic rule ruled out.
pub struct Space {
    pub candidates: Vec<Candidate>,
    pub rejected: Vec<(String, u64)>,
}

/// Count one rejection under `rule`.
fn reject(rejected: &mut Vec<(String, u64)>, rule: &str) {
    match rejected.iter_mut().find(|(r, _)| r == rule) {
        Some((_, n)) => *n += 1,
        None => rejected.push((rule.to_string(), 1)),
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

/// The widths tp must divide: heads and kv heads (attention sharded on tp), the MLP hidden
/// width, the vocabulary (vocab-parallel embedding and head).
fn tp_divides(spec: &Spec, tp: u32) -> Option<&'static str> {
    let t = u64::from(tp);
    if spec.model.sharding.vocab_on_tp && !spec.model.vocab.is_multiple_of(t) {
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

/// The space of `spec` (checked) on `gpus` GPUs of `gpus_per_node` each.
pub fn space(spec: &Spec, gpus: u32, gpus_per_node: u32) -> Space {
    let mut rejected = Vec::new();
    let mut candidates = Vec::new();
    let global = spec.train.global_batch;
    let layers = spec.model.layers.max(1);
    for [dp, pp, cp, tp] in meshes(gpus) {
        let rule = if tp > gpus_per_node {
            Some("tp spans more than one node")
        } else if cp * tp > gpus_per_node && cp > 1 {
            Some("cp × tp spans more than one node")
        } else if cp > 1 && !spec.model.sharding.seq_on_cp {
            Some("cp on a model that does not shard its sequence")
        } else if !layers.is_multiple_of(pp) {
            Some("pp does not divide the layers")
        } else if !global.is_multiple_of(u64::from(dp)) {
            Some("dp does not divide the global batch")
        } else {
            tp_divides(spec, tp)
        };
        if let Some(rule) = rule {
            reject(&mut rejected, rule);
            continue;
        }
        let per_dp = global / u64::from(dp);
        for schedule in schedules(pp, layers) {
            for micro_batch in (0..7)
                .map(|k| 1u64 << k)
                .filter(|b| per_dp.is_multiple_of(*b))
            {
                let microbatches = (per_dp / micro_batch).min(u64::from(u32::MAX)) as u32;
                if pp > 1 && microbatches < pp {
                    reject(&mut rejected, "fewer microbatches than pipeline stages");
                    continue;
                }
                let balances: &[Balance] = if pp > 1 {
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
