//! "Did you mean" suggestions and readable lists for diagnostics.

/// The candidate `name` spells in other letter case; else one that extends `name` or that
/// `name` extends (`h100` → `h100_80gb`, not the nearer `h200`; `cosine_with_warmup` →
/// `cosine`), for names of three or more letters; else the candidate closest by edit
/// distance, if it is close enough to be a typo.
pub fn closest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let lower = name.to_lowercase();
    let candidates: Vec<&'a str> = candidates.into_iter().collect();
    let spelled = WORDS.iter().find(|(other, _)| *other == lower);
    if let Some(c) = spelled.and_then(|(_, parc)| candidates.iter().find(|c| *c == parc)) {
        return Some(c);
    }
    let limit = (name.chars().count() / 3).max(1);
    let scored: Vec<(usize, &str)> = candidates
        .into_iter()
        .map(|c| (edit_distance(&lower, &c.to_lowercase()), c))
        .collect();
    let typo = scored
        .iter()
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, c)| (*d, c.len()));
    let extends = |c: &str| {
        let c = c.to_lowercase();
        lower.len() >= 3 && c.len() >= 3 && (c.starts_with(&lower) || lower.starts_with(&c))
    };
    let prefix = scored
        .iter()
        .filter(|(_, c)| extends(c))
        .min_by_key(|(d, c)| (*d, c.len()));
    let same = typo.filter(|(d, _)| *d == 0);
    same.or(prefix).or(typo).map(|(_, c)| *c)
}

/// Where `pattern` is a repeated layer's path past the last iteration (`blocks.40.mlp` in a
/// model of 32), the iterations there are, e.g. "the model repeats `blocks.0` to `blocks.31`".
pub fn past_the_last_layer(pattern: &str, names: &[&str]) -> Option<String> {
    let mut parts = pattern.splitn(3, '.');
    let (scope, index) = (parts.next()?, parts.next()?.parse::<u64>().ok()?);
    let last = (names.iter())
        .filter_map(|n| n.strip_prefix(scope)?.strip_prefix('.'))
        .filter_map(|rest| rest.split('.').next()?.parse::<u64>().ok())
        .max()?;
    (index > last).then(|| format!("the model repeats `{scope}.0` to `{scope}.{last}`"))
}

/// Words as PyTorch and transformers spell them, and parc's.
const WORDS: &[(&str, &str)] = &[
    ("bfloat16", "bf16"),
    ("float16", "fp16"),
    ("half", "fp16"),
    ("float32", "fp32"),
    ("float", "fp32"),
];

/// Settings as Megatron-LM, NeMo, torchtitan, DeepSpeed and transformers name them, and the
/// path parc gives each (`model.seq` is the model's `let seq`).
const KNOWN_AS: &[(&str, &str)] = &[
    ("tensor_parallel", "parallel.tp"),
    ("tensor_model_parallel_size", "parallel.tp"),
    ("tensor_parallel_degree", "parallel.tp"),
    ("tp_size", "parallel.tp"),
    ("pipeline_parallel", "parallel.pp"),
    ("pipeline_model_parallel_size", "parallel.pp"),
    ("pipeline_parallel_degree", "parallel.pp"),
    ("pp_size", "parallel.pp"),
    ("context_parallel", "parallel.cp"),
    ("context_parallel_size", "parallel.cp"),
    ("context_parallel_degree", "parallel.cp"),
    ("data_parallel", "parallel.dp"),
    ("data_parallel_size", "parallel.dp"),
    ("data_parallel_shard_degree", "parallel.dp"),
    ("virtual_pipeline_model_parallel_size", "parallel.virtual"),
    ("num_microbatches", "parallel.microbatches"),
    ("gradient_accumulation_steps", "parallel.microbatches"),
    ("distributed_optimizer", "parallel.zero"),
    ("use_distributed_optimizer", "parallel.zero"),
    ("zero_stage", "parallel.zero"),
    ("fsdp", "parallel.zero"),
    ("activation_checkpointing", "parallel.recompute"),
    ("checkpoint_activations", "parallel.recompute"),
    ("gradient_checkpointing", "parallel.recompute"),
    ("recompute_granularity", "parallel.recompute"),
    ("lr", "train.optimizer.lr"),
    ("learning_rate", "train.optimizer.lr"),
    ("weight_decay", "train.optimizer.weight_decay"),
    ("warmup", "train.schedule.warmup"),
    ("warmup_steps", "train.schedule.warmup"),
    ("lr_warmup_iters", "train.schedule.warmup"),
    ("lr_warmup_steps", "train.schedule.warmup"),
    ("min_lr", "train.schedule.min_lr"),
    ("lr_decay_iters", "train.schedule.decay_steps"),
    ("lr_decay_style", "train.schedule"),
    ("lr_scheduler", "train.schedule"),
    ("clip_grad", "train.grad_clip"),
    ("max_grad_norm", "train.grad_clip"),
    ("gradient_clipping", "train.grad_clip"),
    ("max_norm", "train.grad_clip"),
    ("micro_batch_size", "train.micro_batch"),
    ("train_micro_batch_size_per_gpu", "train.micro_batch"),
    ("local_batch_size", "train.micro_batch"),
    ("global_batch_size", "train.global_batch"),
    ("train_batch_size", "train.global_batch"),
    ("train_iters", "train.steps"),
    ("max_steps", "train.steps"),
    ("seq_length", "model.seq"),
    ("seq_len", "model.seq"),
    ("max_position_embeddings", "model.seq"),
    ("bf16", "train.precision"),
    ("fp16", "train.precision"),
    ("mixed_precision", "train.precision"),
    ("num_nodes", "cluster.nodes"),
    ("nnodes", "cluster.nodes"),
    ("nproc_per_node", "cluster.gpus_per_node"),
    ("save_interval", "train.checkpoint.every"),
    ("eval_interval", "train.eval.every"),
    ("log_interval", "train.log_every"),
];

/// The help for a setting `path` (`train.lr`, `parallel.tensor_model_parallel_size`) that parc
/// has under another name, by its last segment.
pub fn known_as(path: &str) -> Option<(&'static str, String)> {
    let leaf = path.rsplit('.').next().unwrap_or(path).to_lowercase();
    let (_, parc) = KNOWN_AS.iter().find(|(other, _)| *other == leaf)?;
    let what = match *parc {
        "model.seq" => "the model's `let seq`".to_string(),
        "parallel.zero" => "`parallel.zero` (1: the distributed optimizer; 3: FSDP)".to_string(),
        "parallel.microbatches" => {
            "`parallel.microbatches` (per dp rank; or derived from global_batch)".to_string()
        }
        "train.precision" => "`train.precision = bf16` (or `fp16 { … }`, `fp32`)".to_string(),
        other => format!("`{other}`"),
    };
    Some((parc, format!("`{leaf}` is {what} in parc")))
}

/// The help for a `name` that is none of `candidates`: `rest`, after "did you mean `c`?" where
/// a candidate `c` is close to it.
pub fn help<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>, rest: &str) -> String {
    match closest(name, candidates) {
        Some(c) => format!("did you mean `{c}`? {rest}"),
        None => rest.to_string(),
    }
}

/// "did you mean `c`?" where a candidate `c` is close to `name`, else `otherwise`.
pub fn did_you_mean<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
    otherwise: &str,
) -> String {
    match closest(name, candidates) {
        Some(c) => format!("did you mean `{c}`?"),
        None => otherwise.to_string(),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(cur).min(row[j])
            };
            prev = cur;
        }
    }
    row[b.len()]
}

/// `a, b or c` with each item in backticks.
pub fn one_of(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|i| format!("`{i}`")).collect();
    match quoted.len() {
        0 => String::new(),
        1 => quoted[0].clone(),
        n => format!("{} or {}", quoted[..n - 1].join(", "), quoted[n - 1]),
    }
}

/// `1, 2, 3, 4, 6 or 12`: the divisors of `n` (at most `limit` of them, then the largest).
pub fn divisors(n: u64, up_to: u64) -> String {
    let ds: Vec<String> = (1..=n.min(up_to).min(1 << 20))
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect();
    let refs: Vec<&str> = ds.iter().map(String::as_str).collect();
    match refs.len() {
        0 => String::new(),
        1 => refs[0].to_string(),
        k => format!("{} or {}", refs[..k - 1].join(", "), refs[k - 1]),
    }
}

/// The divisors of `n` (up to 2^20), nearest to `near` first (of two as near, the larger):
/// a help's alternatives in the order a tool should prefer them.
pub fn divisors_nearest(n: u64, near: u64) -> Vec<u64> {
    let mut ds: Vec<u64> = (1..=n.min(1 << 20))
        .filter(|d| n.is_multiple_of(*d))
        .collect();
    ds.sort_by_key(|&d| (d.abs_diff(near), std::cmp::Reverse(d)));
    ds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_nearest_come_first_the_larger_of_two_as_near() {
        assert_eq!(divisors_nearest(4, 3), vec![4, 2, 1]);
        assert_eq!(divisors_nearest(12, 5), vec![6, 4, 3, 2, 1, 12]);
    }

    #[test]
    fn finds_typos_only() {
        assert_eq!(closest("heds", ["heads", "d", "layers"]), Some("heads"));
        assert_eq!(closest("zzz", ["heads", "layers"]), None);
    }

    #[test]
    fn a_name_that_extends_or_is_extended_by_a_candidate_is_suggested() {
        let gpus = crate::check::gpu::NAMES;
        assert_eq!(closest("h100", gpus), Some("h100_80gb"));
        assert_eq!(closest("A100", gpus), Some("a100_80gb"));
        let schedules = ["constant", "cosine", "linear"];
        assert_eq!(closest("cosine_with_warmup", schedules), Some("cosine"));
        assert_eq!(closest("wsd", schedules), None);
        assert_eq!(closest("bfloat16", ["fp32", "bf16", "fp16"]), Some("bf16"));
    }

    #[test]
    fn other_tools_names_map_to_parc_paths() {
        assert_eq!(
            known_as("parallel.tensor_model_parallel_size").unwrap().0,
            "parallel.tp"
        );
        assert_eq!(known_as("train.lr").unwrap().0, "train.optimizer.lr");
        assert_eq!(known_as("train.seq_len").unwrap().0, "model.seq");
        assert!(known_as("train.zzz").is_none());
    }

    #[test]
    fn lists_divisors() {
        assert_eq!(divisors(12, 12), "1, 2, 3, 4, 6 or 12");
        assert_eq!(divisors(12, 4), "1, 2, 3 or 4");
    }
}
