//! Cross-section checks: the mesh against the cluster (size and placement), sharded dimensions
//! against their axes, the batch arithmetic and the pipeline schedule, the layers of each
//! pipeline chunk ([`stages`]), sequence/context parallelism, and the data format against the
//! vocabulary. Each check reports on its own, so one run shows every problem.

use super::model::{Elaborated, ShardTarget};
use super::sections::ParallelIn;
use super::settings::Settings;
use super::suggest;
use crate::diag::{Diagnostic, Diagnostics, Span};
use crate::spec::*;
use std::collections::BTreeSet;

mod stages;

pub struct Grid<'a> {
    pub settings: &'a Settings,
    pub diags: &'a mut Diagnostics,
    pub parallel_span: Span,
    pub train_span: Span,
    pub cluster_span: Span,
}

impl Grid<'_> {
    fn at(&self, path: &str, fallback: Span) -> Span {
        self.settings.get(path).map(|e| e.span).unwrap_or(fallback)
    }

    fn axis_span(&self, a: Axis) -> Span {
        self.at(&format!("parallel.{}", a.name()), self.parallel_span)
    }

    /// Where the mesh's size is labelled: an axis set by `--set` (its own source, the likelier
    /// cause of a change), else the file's dp.
    fn mesh_span(&self, mesh: &Mesh) -> Span {
        let file = self.parallel_span.file;
        (mesh.axes.iter())
            .map(|(a, _)| self.axis_span(*a))
            .find(|span| span.file != file)
            .unwrap_or_else(|| self.axis_span(Axis::Dp))
    }

    /// Mesh size against the cluster.
    pub fn mesh_vs_cluster(&mut self, mesh: &Mesh, cluster: &Cluster) {
        let world = u64::from(mesh.world());
        let gpus = u64::from(cluster.nodes) * u64::from(cluster.gpus_per_node);
        // Past the most ranks parc supports is E0903 already (`sections::too_many_ranks`).
        let limit = crate::check::sections::MAX_WORLD;
        if world == gpus || world > limit || gpus > limit {
            return;
        }
        let sizes: Vec<String> = mesh
            .axes
            .iter()
            .map(|(a, n)| format!("{} {n}", a.name()))
            .collect();
        let dp = u64::from(mesh.size(Axis::Dp));
        let others = (world / dp.max(1)).max(1);
        let gpn = u64::from(cluster.gpus_per_node);
        let mut options = Vec::new();
        let mut fixes: Vec<Vec<(&'static str, u64)>> = Vec::new();
        if gpus % others == 0 {
            options.push(format!("set dp to {}", gpus / others));
            fixes.push(vec![("parallel.dp", gpus / others)]);
        }
        // More nodes help only where the tp and cp groups still fit in one (`placement`).
        let span = node_span(mesh);
        if world % gpn == 0 && gpn % span == 0 {
            options.push(format!("set nodes to {}", world / gpn));
            fixes.push(vec![("cluster.nodes", world / gpn)]);
        } else if cluster.nodes == 1 {
            options.push(format!("set gpus_per_node to {world}"));
            fixes.push(vec![("cluster.gpus_per_node", world)]);
        } else {
            options.push(format!(
                "set gpus_per_node to {span} and nodes to {}",
                world / span
            ));
            fixes.push(vec![
                ("cluster.gpus_per_node", span),
                ("cluster.nodes", world / span),
            ]);
        }
        let help = if options.is_empty() {
            format!("the mesh needs {world} GPUs: make dp × pp × cp × tp equal nodes × gpus_per_node = {gpus}")
        } else {
            format!(
                "{} (the mesh needs {world} GPUs, the cluster has {gpus})",
                options.join(", or ")
            )
        };
        let cl = self.at("cluster.nodes", self.cluster_span);
        let mut d = Diagnostic::error(
            "E0401",
            format!(
                "the mesh ({}) has {world} ranks but the cluster has {} × {} = {gpus} GPUs",
                sizes.join(" × "),
                cluster.nodes,
                cluster.gpus_per_node
            ),
        )
        .label(self.mesh_span(mesh), format!("mesh of {world} ranks"))
        .label(cl, format!("{gpus} GPUs"))
        .help(help);
        for fix in fixes {
            d = d.fix(fix);
        }
        self.diags.push(d);
    }

    /// Resolve `shard` lines into the spec's flags and check every sharded dimension.
    pub fn sharding(&mut self, e: &mut Elaborated, mesh: &Mesh) {
        let tp = u64::from(mesh.size(Axis::Tp));
        let cp = u64::from(mesh.size(Axis::Cp));
        let mut sh = Sharding::default();
        for (t, span, _) in &e.shard_items {
            match t {
                ShardTarget::AttentionHeadsTp => sh.attention_heads_on_tp = true,
                ShardTarget::AttentionSeqCp => sh.seq_on_cp = true,
                ShardTarget::MlpHiddenTp => sh.mlp_hidden_on_tp = true,
                ShardTarget::VocabTp => sh.vocab_on_tp = true,
            }
            sh.spans.push(*span);
        }
        let tp_span = self.axis_span(Axis::Tp);
        // The tp sizes (up to 64) that divide every dimension sharded on tp.
        let sharded: Vec<u64> = e
            .model
            .nodes
            .iter()
            .flat_map(|n| match n.kind {
                LayerKind::Attention {
                    heads, kv_heads, ..
                } if sh.attention_heads_on_tp => {
                    vec![heads, kv_heads]
                }
                LayerKind::Mlp { hidden, .. } if sh.mlp_hidden_on_tp => vec![hidden],
                LayerKind::Embedding { vocab, .. } if sh.vocab_on_tp => vec![vocab],
                _ => Vec::new(),
            })
            .collect();
        let fitting: Vec<u64> = (1..=64u64)
            .filter(|t| sharded.iter().all(|v| v.is_multiple_of(*t)))
            .collect();
        // The fix: the largest tp below this one that fits every sharded dimension.
        let fixed_tp = fitting
            .iter()
            .copied()
            .filter(|&t| t < tp)
            .max()
            .unwrap_or(1);
        let fits: Vec<String> = fitting.iter().map(u64::to_string).collect();
        let fits = fits.join(", ");
        let mut reported: BTreeSet<(&'static str, u64)> = BTreeSet::new();
        // `--set model.vocab=N` pads the vocabulary where the model names it `let vocab`.
        let vocab_let = e.consts.contains_key("vocab");
        for (i, n) in e.model.nodes.iter().enumerate() {
            let spans = &e.arg_spans[i];
            let mut check = |code: &'static str,
                             what: &str,
                             param: &str,
                             value: u64,
                             on: bool,
                             diags: &mut Diagnostics| {
                if !on || tp <= 1 || value.is_multiple_of(tp) || !reported.insert((code, value)) {
                    return;
                }
                let at = spans.get(param).copied().unwrap_or(n.span);
                let help = format!(
                    "set tp to a divisor of {what} = {value}: {}; tp sizes that fit every dimension sharded on tp: {fits}",
                    suggest::divisors(value, 64)
                );
                let mut d = Diagnostic::error(
                    code,
                    format!("{what} = {value} is not divisible by tp = {tp}"),
                )
                .label(tp_span, format!("tp = {tp}"))
                .label(at, format!("{what} = {value}"))
                .help(help)
                .fix([("parallel.tp", fixed_tp)]);
                // What the published recipes do instead.
                let padded = value.next_multiple_of(128 * tp);
                if code == "E0405" {
                    d = d.note(format!(
                        "or pad the vocabulary to {padded}, a multiple of 128 × tp as Megatron does (the extra ids are never targets)"
                    ));
                    if vocab_let {
                        d = d.fix([("model.vocab", padded)]);
                    }
                }
                if code == "E0403" && value < tp {
                    d = d.note("parc splits the kv heads over tp and does not replicate them: tp may not exceed kv_heads");
                }
                diags.push(d);
            };
            match &n.kind {
                LayerKind::Attention {
                    heads, kv_heads, ..
                } => {
                    check(
                        "E0402",
                        "heads",
                        "heads",
                        *heads,
                        sh.attention_heads_on_tp,
                        self.diags,
                    );
                    if heads % tp == 0 {
                        check(
                            "E0403",
                            "kv_heads",
                            "kv_heads",
                            *kv_heads,
                            sh.attention_heads_on_tp,
                            self.diags,
                        );
                    }
                }
                LayerKind::Mlp { hidden, .. } => check(
                    "E0404",
                    "the MLP hidden size",
                    "hidden",
                    *hidden,
                    sh.mlp_hidden_on_tp,
                    self.diags,
                ),
                LayerKind::Embedding { vocab, .. } => check(
                    "E0405",
                    "vocab",
                    "vocab",
                    *vocab,
                    sh.vocab_on_tp,
                    self.diags,
                ),
                _ => {}
            }
        }
        let model_span = e.name_span;
        // What tp splits only where the model shards it: (code, in the model, sharded, what
        // tp then cannot split, the model's shard line).
        let has = |kind: &str| e.model.nodes.iter().any(|n| n.kind.kind_name() == kind);
        let sharded = [
            ("E0411", true, sh.attention_heads_on_tp, "attention is not sharded on tp", "Attention.heads"),
            ("E0413", has("MLP"), sh.mlp_hidden_on_tp, "the MLP is not sharded on tp; parc lowers the MLP only hidden-parallel (Megatron column then row)", "MLP.hidden"),
            ("E0414", has("Embedding"), sh.vocab_on_tp, "the vocabulary is not sharded on tp; parc lowers the embedding, head and loss only vocab-parallel", "Embedding.vocab"),
        ];
        for (code, present, on_tp, why, dim) in sharded {
            if tp > 1 && present && !on_tp {
                self.diags.push(
                    Diagnostic::error(code, format!("tp = {tp} but {why}"))
                        .label(tp_span, format!("tp = {tp}"))
                        .label(model_span, format!("this model has no `shard {dim} on tp`"))
                        .help(format!(
                            "add `shard {dim} on tp` to the model, or set tp = 1"
                        ))
                        .fix([("parallel.tp", 1)]),
                );
            }
        }
        if cp > 1 && !sh.seq_on_cp {
            self.diags.push(
                Diagnostic::error("E0412", format!("cp = {cp} but nothing is sharded on cp"))
                    .label(self.axis_span(Axis::Cp), format!("cp = {cp}"))
                    .label(model_span, "this model has no `shard Attention.seq on cp`")
                    .help("add `shard Attention.seq on cp`, or set cp = 1")
                    .fix([("parallel.cp", 1)]),
            );
        }
        e.model.sharding = sh;
    }

    /// Sequence splits: context parallelism (balanced causal: 2·cp chunks) and sequence
    /// parallelism (the sequence of each cp rank split over tp).
    pub fn sequence(&mut self, e: &Elaborated, p: &Parallel) {
        let seq = e.model.seq;
        let cp = u64::from(p.mesh.size(Axis::Cp));
        let tp = u64::from(p.mesh.size(Axis::Tp));
        let causal = e
            .model
            .nodes
            .iter()
            .any(|n| matches!(n.kind, LayerKind::Attention { causal: true, .. }));
        let chunks = if cp > 1 && causal { 2 * cp } else { cp };
        if cp > 1 && !seq.is_multiple_of(chunks) {
            let why = if causal {
                format!("2·cp = {chunks} (causal attention is balanced by giving each cp rank two chunks)")
            } else {
                format!("cp = {cp}")
            };
            let fitting: Vec<u64> = (1..=64u64)
                .filter(|c| seq.is_multiple_of(if causal { 2 * c } else { *c }))
                .collect();
            let fixed_cp = fitting
                .iter()
                .copied()
                .filter(|&c| c < cp)
                .max()
                .unwrap_or(1);
            let ok: Vec<String> = fitting.iter().take(8).map(u64::to_string).collect();
            self.diags.push(
                Diagnostic::error("E0406", format!("seq = {seq} is not divisible by {why}"))
                    .label(self.axis_span(Axis::Cp), format!("cp = {cp}"))
                    .label(e.seq_span, format!("seq = {seq}"))
                    .help(format!(
                        "set cp to one of {}, or seq to a multiple of {chunks}",
                        ok.join(", ")
                    ))
                    .fix([("parallel.cp", fixed_cp)]),
            );
        }
        // A cp that does not split the sequence is E0406's alone: a cp rank's share of it
        // would be a rounded number in E0410.
        if p.sequence_parallel {
            let span = self.at("parallel.sequence_parallel", self.parallel_span);
            if tp <= 1 {
                self.diags.push(
                    Diagnostic::warning("W0501", "sequence_parallel does nothing with tp = 1")
                        .label(span, "sequence_parallel = true")
                        .help("set tp > 1, or remove sequence_parallel"),
                );
            } else if seq.is_multiple_of(chunks) && !(seq / cp.max(1)).is_multiple_of(tp) {
                let local = seq / cp.max(1);
                self.diags.push(
                    Diagnostic::error("E0410", format!("sequence parallelism splits each rank's {local} tokens over tp = {tp}, which does not divide them"))
                        .label(span, "sequence_parallel = true")
                        .label(e.seq_span, format!("seq = {seq}"))
                        .help(format!("set tp to a divisor of {local}: {}", suggest::divisors(local, 64))),
                );
            }
        }
    }

    /// global_batch = micro_batch × microbatches × dp; fills in `microbatches` when omitted.
    pub fn batch(&mut self, pin: &mut ParallelIn, train: &Train) {
        let p = &mut pin.parallel;
        let dp = u64::from(p.mesh.size(Axis::Dp));
        let (g, mb) = (train.global_batch, train.micro_batch);
        let gspan = self.at("train.global_batch", self.train_span);
        if pin.microbatches_given {
            let m = u64::from(p.microbatches);
            let want = mb.saturating_mul(m).saturating_mul(dp);
            if want != g {
                let mut fixes = vec![format!("set global_batch to {want}")];
                let mut sets = vec![("train.global_batch", want)];
                if g % (mb * dp) == 0 {
                    fixes.push(format!("microbatches to {}", g / (mb * dp)));
                    sets.push(("parallel.microbatches", g / (mb * dp)));
                }
                if g % (m * dp) == 0 {
                    fixes.push(format!("micro_batch to {}", g / (m * dp)));
                    sets.push(("train.micro_batch", g / (m * dp)));
                }
                let mut d = Diagnostic::error("E0501", format!("global_batch = {g} but micro_batch × microbatches × dp = {mb} × {m} × {dp} = {want}"))
                    .label(gspan, format!("global_batch = {g}"))
                    .label(self.at("parallel.microbatches", self.parallel_span), format!("microbatches = {m}"))
                    .help(fixes.join(", or "));
                for set in sets {
                    d = d.fix([set]);
                }
                self.diags.push(d);
            }
        } else {
            let per = mb.saturating_mul(dp);
            if per == 0 || g % per != 0 {
                let lo = (g / per.max(1)).max(1) * per;
                let hi = lo + per;
                let mut help = format!("set global_batch to a multiple of micro_batch × dp = {mb} × {dp} = {per} (e.g. {lo} or {hi})");
                let divs: Vec<u64> = (1..=g.min(4096)).filter(|d| g % (d * dp) == 0).collect();
                let best = divs.iter().rev().find(|d| **d <= mb);
                if let Some(best) = best {
                    help.push_str(&format!(", or micro_batch to {best}"));
                }
                let mut d = Diagnostic::error("E0501", format!("global_batch = {g} is not a multiple of micro_batch × dp = {mb} × {dp} = {per}"))
                    .label(gspan, format!("global_batch = {g}"))
                    .label(self.axis_span(Axis::Dp), format!("dp = {dp}"))
                    .help(help)
                    .fix([("train.global_batch", lo)])
                    .fix([("train.global_batch", hi)]);
                if let Some(best) = best {
                    d = d.fix([("train.micro_batch", *best)]);
                }
                self.diags.push(d);
                // As the first fix (and `assumed_batch`) has it, so the schedule's checks judge
                // that count, not a stand-in 1 (a pipeline's E0502 on a batch of 255 was noise).
                p.microbatches = u32::try_from((g / per.max(1)).max(1)).unwrap_or(u32::MAX);
            } else {
                p.microbatches = (g / per).min(u64::from(u32::MAX)) as u32;
            }
        }
    }

    /// Schedule constraints that depend on the microbatch count.
    pub fn schedule(&mut self, p: &Parallel, train: &Train) {
        let pp = p.mesh.size(Axis::Pp);
        let m = p.microbatches;
        let dp = u64::from(p.mesh.size(Axis::Dp));
        let mspan = self.at(
            "parallel.microbatches",
            self.at("train.global_batch", self.parallel_span),
        );
        let global_for = |m: u32| train.micro_batch * u64::from(m) * dp;
        if pp > 1
            && m < pp
            && matches!(
                p.schedule,
                PipelineSchedule::OneFOneB | PipelineSchedule::Interleaved { .. }
            )
        {
            self.diags.push(
                Diagnostic::error("E0502", format!("1F1B with pp = {pp} stages needs at least {pp} microbatches, found {m}"))
                    .label(mspan, format!("{m} microbatches"))
                    .label(self.axis_span(Axis::Pp), format!("pp = {pp}"))
                    .help(format!("set microbatches to {pp} or more (global_batch = {} with micro_batch = {} and dp = {dp})", global_for(pp), train.micro_batch))
                    .fix([("parallel.microbatches", u64::from(pp)), ("train.global_batch", global_for(pp))]),
            );
        }
        if pp <= 1 && m > 1 && p.schedule == PipelineSchedule::Gpipe {
            self.diags.push(
                Diagnostic::warning("W0504", format!("GPipe with pp = 1 runs all {m} microbatches' forwards before any backward, so it holds {m} microbatches of activations where 1F1B holds one"))
                    .label(self.at("parallel.schedule", self.parallel_span), "gpipe")
                    .label(mspan, format!("{m} microbatches"))
                    .help("use `1f1b` (the default): with pp = 1 it is gradient accumulation, one microbatch at a time")
                    .fix([("parallel.schedule", "1f1b")]),
            );
        }
        if let PipelineSchedule::Interleaved { .. } = p.schedule {
            if pp > 1 && !m.is_multiple_of(pp) {
                let up = m.div_ceil(pp) * pp;
                self.diags.push(
                    Diagnostic::error("E0503", format!("the interleaved schedule needs microbatches ({m}) to be a multiple of pp = {pp}"))
                        .label(mspan, format!("{m} microbatches"))
                        .label(self.axis_span(Axis::Pp), format!("pp = {pp}"))
                        .help(format!("set microbatches to {up} (global_batch = {})", global_for(up)))
                        .fix([("parallel.microbatches", u64::from(up)), ("train.global_batch", global_for(up))]),
                );
            }
        }
    }

    /// Axes whose collectives sit on the critical path stay inside a node unless the spec allows
    /// otherwise with `cross_node = [tp]` (then it is a warning).
    pub fn placement(&mut self, p: &Parallel, cluster: &Cluster, cross_node: &[Axis]) {
        let gpn = cluster.gpus_per_node;
        for axis in [Axis::Tp, Axis::Cp] {
            let n = p.mesh.size(axis);
            if n <= 1 {
                continue;
            }
            let reach = p.mesh.stride(axis).saturating_mul(n);
            if reach <= gpn && gpn.is_multiple_of(reach) {
                continue;
            }
            let name = axis.name();
            let inner: Vec<String> = p
                .mesh
                .axes
                .iter()
                .skip_while(|(a, _)| *a != axis)
                .map(|(a, s)| format!("{} {s}", a.name()))
                .collect();
            let msg = format!(
                "{name} = {n} groups span {reach} consecutive ranks ({}), more than one node of {gpn} GPUs",
                inner.join(" × ")
            );
            let allowed = cross_node.contains(&axis);
            let help = placement_help(&p.mesh, axis, gpn, cross_node, allowed);
            let d = if allowed {
                Diagnostic::warning(
                    "W0601",
                    format!("{msg}: its collectives cross the inter-node link"),
                )
            } else {
                Diagnostic::error("E0601", msg)
            };
            self.diags.push(
                d.label(self.axis_span(axis), format!("{name} = {n}"))
                    .label(
                        self.at("cluster.gpus_per_node", self.cluster_span),
                        format!("{gpn} GPUs per node"),
                    )
                    .help(help),
            );
        }
    }

    /// The data's token format, or its tokenizer, must fit the vocabulary.
    pub fn data(&mut self, e: &Elaborated, train: &Train) {
        // `--set model.vocab=N` changes the vocabulary where the model names it `let vocab`.
        let vocab_let = e.consts.contains_key("vocab");
        super::data::check_vocab(&train.data, e.model.vocab, vocab_let, self.diags);
        if let DataSource::File { format, span, .. } = &train.data {
            let (max, name) = match format {
                DataFormat::Bytes => (256u64, "bytes"),
                DataFormat::U16 => (65_536, "u16"),
                DataFormat::U32 => (u64::from(u32::MAX), "u32"),
            };
            let vocab = e.model.vocab;
            if *format == DataFormat::Bytes && vocab < 256 {
                let d = Diagnostic::error(
                    "E0309",
                    format!("byte data has token ids up to 255 but vocab = {vocab}"),
                )
                .label(*span, "read as bytes")
                .help("set vocab to 256 (or more) for byte-level text");
                let fixes = if vocab_let {
                    vec![("model.vocab", 256)]
                } else {
                    vec![]
                };
                self.diags
                    .push(if fixes.is_empty() { d } else { d.fix(fixes) });
            } else if *format == DataFormat::U16 && vocab > max {
                self.diags.push(
                    Diagnostic::error(
                        "E0309",
                        format!("vocab = {vocab} does not fit {name} token ids"),
                    )
                    .label(*span, format!("read as {name}"))
                    .help("store the tokens as u32 and read them `as u32`"),
                );
            }
        }
    }
}

/// A `train.sample` prompt of byte-level text must leave the model room to continue it: a
/// sample, prompt included, holds at most `seq` tokens. (Prompts of other tokenizers are
/// counted when the run starts.)
pub fn sample_prompt(model: &Model, train: &Train, diags: &mut Diagnostics) {
    let (
        Some(sample),
        DataSource::File {
            format: DataFormat::Bytes,
            ..
        },
    ) = (&train.sample, &train.data)
    else {
        return;
    };
    let tokens = sample.prompt.len() as u64;
    if tokens >= model.seq {
        diags.push(
            Diagnostic::error(
                "E0903",
                format!(
                    "the sample prompt is {tokens} tokens (bytes) but the model's seq is {}",
                    model.seq
                ),
            )
            .label(sample.span, "this prompt")
            .help(format!(
                "a sample, prompt and continuation, fits in seq = {} positions: shorten the \
                 prompt to at most {} bytes",
                model.seq,
                model.seq - 1
            )),
        );
    }
}

/// Mark the nodes `parallel.recompute` asks for; named entries must match a kind or a path.
pub fn recompute(model: &mut Model, r: &Recompute, span: Span, diags: &mut Diagnostics) {
    for n in &mut model.nodes {
        n.recompute = match r {
            Recompute::None => false,
            Recompute::Selective => matches!(n.kind, LayerKind::Attention { .. }),
            Recompute::Full => n.layer.is_some(),
            Recompute::Named(names) => names.iter().any(|w| n.matches(w)),
        };
    }
    if let Recompute::Named(names) = r {
        let nodes: Vec<&str> = model.nodes.iter().map(|n| n.name.as_str()).collect();
        for w in names {
            if !model.nodes.iter().any(|n| n.matches(w)) {
                let help = recompute_help(w, &nodes);
                diags.push(
                    Diagnostic::error(
                        "E0213",
                        format!("`recompute` names `{w}`, which matches no layer"),
                    )
                    .label(span, "recompute list")
                    .help(help),
                );
            }
        }
    }
}

/// The help of E0213 for `name`, which matches none of the model's `nodes`: where the model's
/// repeats end (`blocks.30` in a model of 24), the kind or path it likely means, or, for a
/// word that is neither (`partial`, `uniform`, `Block`), what `recompute` takes.
fn recompute_help(name: &str, nodes: &[&str]) -> String {
    const WHAT: &str = "name layer kinds (`Attention`) or node paths (`blocks.3.mlp`)";
    if let Some(range) = suggest::past_the_last_layer(name, nodes) {
        return format!("{range}; {WHAT}");
    }
    let kinds = ["Attention", "MLP", "LayerNorm", "RMSNorm", "Linear"];
    let path = name.contains('.');
    let candidates = (kinds.into_iter().filter(|_| !path))
        .chain(nodes.iter().copied().filter(|n| n.contains('.') == path));
    match suggest::closest(name, candidates) {
        Some(c) => format!("did you mean `{c}`? {WHAT}"),
        None if path => WHAT.to_string(),
        None => format!(
            "`recompute` is `none`, `selective` (attention), `full` (every layer inside the \
             `repeat`) or a list of layers: {WHAT}"
        ),
    }
}

/// Whole-job sizes parc supports: tokens per microbatch and parameters, so that the memory and
/// FLOP estimates (and the buffers lowering sizes) fit in 64 bits.
pub fn sizes(model: &Model, train: &Train, span: Span, diags: &mut Diagnostics) {
    const MAX_TOKENS: u64 = 1 << 24;
    const MAX_PARAMS: u128 = 1 << 46;
    let tokens = u128::from(model.seq) * u128::from(train.micro_batch);
    if tokens > u128::from(MAX_TOKENS) {
        diags.push(
            Diagnostic::error(
                "E0903",
                format!("a microbatch of {} × {} = {tokens} tokens is more than parc supports ({MAX_TOKENS})", train.micro_batch, model.seq),
            )
            .label(span, "micro_batch")
            .help(format!("use micro_batch ≤ {}", (MAX_TOKENS / model.seq.max(1)).max(1))),
        );
    }
    let params: u128 = model
        .nodes
        .iter()
        .map(|n| match n.kind {
            LayerKind::Embedding { vocab, dim } => u128::from(vocab) * u128::from(dim),
            LayerKind::PositionEmbedding { seq, dim } => u128::from(seq) * u128::from(dim),
            LayerKind::Linear {
                in_dim, out_dim, ..
            } => u128::from(in_dim) * u128::from(out_dim),
            LayerKind::Attention {
                dim,
                heads,
                kv_heads,
                head_dim,
                ..
            } => {
                u128::from(dim)
                    * u128::from(head_dim)
                    * (2 * u128::from(heads) + 2 * u128::from(kv_heads))
            }
            LayerKind::Mlp { dim, hidden, .. } => 3 * u128::from(dim) * u128::from(hidden),
            _ => 0,
        })
        .sum();
    if params > MAX_PARAMS {
        diags.push(
            Diagnostic::error("E0903", format!("the model has about {params} parameters, more than parc supports ({MAX_PARAMS})"))
                .label(model.span, "this model")
                .help("use smaller dimensions or fewer layers"),
        );
    }
}

/// How to keep `axis`'s groups inside a node of `gpn` GPUs, offering only what leads there: a
/// smaller axis when it alone outgrows a node, moving it last in the mesh when it is not last
/// and the other of tp/cp still fits after it, and (for E0601) `cross_node`.
fn placement_help(mesh: &Mesh, axis: Axis, gpn: u32, cross_node: &[Axis], allowed: bool) -> String {
    let name = axis.name();
    let n = mesh.size(axis);
    let fits = |ranks: u32| ranks <= gpn && gpn.is_multiple_of(ranks);
    let other = if axis == Axis::Tp { Axis::Cp } else { Axis::Tp };
    let m = mesh.size(other);
    let last = mesh.axes.last().is_some_and(|(a, _)| *a == axis);
    let node = if gpn == 1 {
        "1 GPU".to_string()
    } else {
        format!("{gpn} GPUs")
    };
    let outgrows = format!("{name} = {n} outgrows a node of {node}");
    let mut ways = format!(
        "make the product of {name} and the axes after it in the mesh divide gpus_per_node = {gpn}"
    );
    if !last && (m <= 1 || cross_node.contains(&other) || fits(n.saturating_mul(m))) {
        // The axes rank in the order written (`tp = 8; pp = 4; dp = 2` too, Megatron's order
        // of its flags, puts tp outermost): show the order that fixes it.
        let moved: Vec<String> = (mesh.axes.iter())
            .filter(|(a, size)| *a != axis && *size > 1)
            .chain(std::iter::once(&(axis, n)))
            .map(|(a, size)| format!("{}: {size}", a.name()))
            .collect();
        ways.push_str(&format!(
            ", or move {name} last in the mesh (axes rank in the order written, outermost \
             first: `mesh = {{ {} }}`)",
            moved.join(", ")
        ));
    }
    let allow = format!("`cross_node = [{name}]`");
    match (fits(n), allowed) {
        (false, false) => {
            format!("{outgrows}: set {name} to a divisor of {gpn}, or allow it with {allow}")
        }
        (false, true) => {
            format!("allowed by {allow}: {outgrows} (a divisor of {gpn} would keep it inside one)")
        }
        (true, false) => {
            format!("keep {name} groups inside a node: {ways}; or allow it with {allow}")
        }
        (true, true) => {
            format!("allowed by {allow}; to keep {name} groups inside a node instead, {ways}")
        }
    }
}

/// The consecutive ranks that one node must hold for the tp and cp groups to stay inside it
/// (the largest `stride × size` of the two; 1 without them): `placement`'s rule.
fn node_span(mesh: &Mesh) -> u64 {
    [Axis::Tp, Axis::Cp]
        .into_iter()
        .filter(|&axis| mesh.size(axis) > 1)
        .map(|axis| u64::from(mesh.stride(axis)) * u64::from(mesh.size(axis)))
        .max()
        .unwrap_or(1)
}

/// The global batch and microbatch count E0501's first fix gives, when [`Grid::batch`] refused
/// the batch arithmetic (None when it holds): the global batch that keeps micro_batch and the
/// microbatches as written (what a rank's memory depends on), or without written microbatches
/// the nearest multiple of micro_batch × dp at or below it (at least one).
pub fn assumed_batch(pin: &ParallelIn, train: &Train) -> Option<(u64, u32)> {
    let dp = u64::from(pin.parallel.mesh.size(Axis::Dp));
    let (g, mb) = (train.global_batch, train.micro_batch);
    let per = mb.saturating_mul(dp);
    let m = if pin.microbatches_given {
        u64::from(pin.parallel.microbatches)
    } else {
        (g / per.max(1)).max(1)
    };
    let want = per.saturating_mul(m);
    (per > 0 && want != g).then(|| (want, u32::try_from(m).unwrap_or(u32::MAX)))
}

/// A fix that resizes a mesh axis (`parallel.tp=2`) must not lead into E0401: it keeps the
/// cluster's GPUs by resizing dp (`parallel.dp=4`) where dp can take up the difference with
/// the batch arithmetic and placement still holding, else, on a one-node cluster, sizes the
/// node to the new mesh (`cluster.gpus_per_node`). The help says which.
pub fn complete_mesh_fixes(
    diags: &mut [Diagnostic],
    pin: &ParallelIn,
    cluster: &Cluster,
    train: Option<&Train>,
) {
    let mesh = &pin.parallel.mesh;
    let gpus = u64::from(cluster.nodes) * u64::from(cluster.gpus_per_node);
    let axis_of = |path: &str| {
        [Axis::Dp, Axis::Pp, Axis::Cp, Axis::Tp]
            .into_iter()
            .find(|a| path.strip_prefix("parallel.") == Some(a.name()))
    };
    for d in diags {
        let mut note = None;
        for fix in &mut d.fixes {
            let resizes: Vec<(Axis, u32)> = fix
                .sets
                .iter()
                .filter_map(|s| s.split_once('='))
                .filter_map(|(path, v)| Some((axis_of(path)?, v.parse::<u32>().ok()?)))
                .collect();
            let sets_dp_or_cluster = fix
                .sets
                .iter()
                .any(|s| s.starts_with("cluster.") || s.starts_with("parallel.dp="));
            let Some(&(axis, value)) = resizes.first() else {
                continue;
            };
            if sets_dp_or_cluster {
                continue;
            }
            let mut after = mesh.clone();
            for (a, v) in &resizes {
                if let Some(entry) = after.axes.iter_mut().find(|(x, _)| x == a) {
                    entry.1 = *v;
                }
            }
            if u64::from(after.world()) == gpus {
                continue;
            }
            let change = format!("{} = {value}", axis.name());
            if let Some(dp) = dp_keeping(&after, gpus, pin, cluster, train) {
                fix.sets.push(format!("parallel.dp={dp}"));
                note.get_or_insert(format!(
                    "; with {change}, set dp to {dp} to keep the {gpus} GPUs"
                ));
            } else if cluster.nodes == 1 {
                let size = after.world();
                fix.sets.push(format!("cluster.gpus_per_node={size}"));
                note.get_or_insert(format!(
                    "; with {change}, set gpus_per_node to {size} (the mesh's size)"
                ));
            }
        }
        if let (Some(note), Some(help)) = (note, d.help.as_mut()) {
            help.push_str(&note);
        }
    }
}

/// The dp that brings `mesh` (its other axes resized by a fix) to the cluster's `gpus`, when
/// the global batch still divides into micro batches over it (microbatches not written) and
/// its tp and cp groups stay inside a node.
fn dp_keeping(
    mesh: &Mesh,
    gpus: u64,
    pin: &ParallelIn,
    cluster: &Cluster,
    train: Option<&Train>,
) -> Option<u32> {
    let others = u64::from(mesh.world() / mesh.size(Axis::Dp).max(1));
    if others == 0 || !gpus.is_multiple_of(others) || pin.microbatches_given {
        return None;
    }
    let dp = u32::try_from(gpus / others).ok()?;
    let train = train?;
    if !train
        .global_batch
        .is_multiple_of(train.micro_batch.saturating_mul(u64::from(dp)))
    {
        return None;
    }
    let mut resized = mesh.clone();
    if let Some(entry) = resized.axes.iter_mut().find(|(a, _)| *a == Axis::Dp) {
        entry.1 = dp;
    }
    let span = node_span(&resized);
    (span <= u64::from(cluster.gpus_per_node)
        && u64::from(cluster.gpus_per_node).is_multiple_of(span))
    .then_some(dp)
}
