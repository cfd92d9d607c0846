//! The end of model elaboration: node names assigned, tied weights resolved and checked, the
//! model's Embedding/CrossEntropy/inputs validated, `shard` lines resolved to targets.

use super::*;

impl Elab<'_> {
    pub(super) fn finish(
        mut self,
        def: &ModelDef,
        inputs: Vec<(Ident, ValueId, Span)>,
        seq: Option<(u64, Span)>,
        consts: HashMap<String, Number>,
        shard_lines: &[ShardItem],
        quiet: bool,
    ) -> Option<Elaborated> {
        let names = self.assign_names();
        let nodes = self.nodes.iter().zip(&names);
        let mut out_nodes: Vec<Node> = Vec::with_capacity(self.nodes.len());
        let mut arg_spans = Vec::with_capacity(self.nodes.len());
        for (p, name) in nodes {
            self.values[p.output.0 as usize].name = name.clone();
            out_nodes.push(Node {
                name: name.clone(),
                kind: p.kind.clone(),
                inputs: p.inputs.clone(),
                output: p.output,
                layer: p.layer,
                recompute: false,
                span: p.span,
            });
            arg_spans.push(p.arg_spans.clone());
        }
        self.resolve_tied(&mut out_nodes);
        let embeds: Vec<usize> = (0..out_nodes.len())
            .filter(|&i| matches!(out_nodes[i].kind, LayerKind::Embedding { .. }))
            .collect();
        let losses: Vec<usize> = (0..out_nodes.len())
            .filter(|&i| out_nodes[i].kind == LayerKind::CrossEntropy)
            .collect();
        let missing = |what: &str, help: &str| {
            Diagnostic::error("E0206", format!("the model has no {what}"))
                .label(def.name.span, "in this model")
                .help(help.to_string())
        };
        let mut ok = true;
        let (vocab, dim) = match embeds.as_slice() {
            [i] => match out_nodes[*i].kind {
                LayerKind::Embedding { vocab, dim } => (vocab, dim),
                _ => (0, 0),
            },
            [] if quiet => {
                ok = false;
                (0, 0)
            }
            [] => {
                ok = false;
                self.diags.push(missing(
                    "Embedding",
                    "start with `x = Embedding(vocab, d)(tokens)`",
                ));
                (0, 0)
            }
            [_, second, ..] => {
                ok = false;
                self.diags.push(
                    Diagnostic::error("E0204", "the model has more than one Embedding")
                        .label(out_nodes[*second].span, "second Embedding")
                        .help("parc trains decoder-only language models with one token embedding"),
                );
                (0, 0)
            }
        };
        let loss = match losses.as_slice() {
            [i] => Some(out_nodes[*i].output),
            [] if quiet => None,
            [] => {
                self.diags.push(missing(
                    "CrossEntropy loss",
                    "end with `loss = CrossEntropy(logits, targets)`",
                ));
                None
            }
            [_, second, ..] => {
                self.diags.push(
                    Diagnostic::error("E0204", "the model has more than one CrossEntropy")
                        .label(out_nodes[*second].span, "second loss")
                        .help("keep one loss"),
                );
                None
            }
        };
        if let (Some(l), true) = (loss, ok) {
            if let Some(n) = out_nodes.iter().find(|n| n.output == l) {
                if let Some(&logits) = n.inputs.first() {
                    if let Shape::Hidden(w) = self.values[logits.0 as usize].shape {
                        if w != vocab {
                            self.diags.push(
                                Diagnostic::error(
                                    "E0306",
                                    format!(
                                        "the logits have width {w} but the vocabulary is {vocab}"
                                    ),
                                )
                                .label(n.span, format!("logits of width {w}"))
                                .help(format!("project to the vocabulary: `Linear(d, {vocab})`")),
                            );
                        }
                    }
                }
            }
        }
        let tokens = embeds
            .first()
            .and_then(|&i| out_nodes[i].inputs.first().copied());
        let targets = losses
            .first()
            .and_then(|&i| out_nodes[i].inputs.get(1).copied());
        for (name, id, _) in &inputs {
            if !quiet && Some(*id) != tokens && Some(*id) != targets {
                self.diags.push(
                    Diagnostic::warning("W0201", format!("input `{}` is never used", name.name))
                        .label(name.span, "declared here")
                        .help(
                            "remove it, or feed it to Embedding (tokens) or CrossEntropy (targets)",
                        ),
                );
            }
        }
        if inputs.is_empty() {
            self.diags.push(missing(
                "inputs",
                "declare `input tokens : [batch, seq] i32` and `input targets : [batch, seq] i32`",
            ));
        }
        let (seq, seq_span) = seq.unwrap_or((0, def.name.span));
        for n in &out_nodes {
            if let LayerKind::PositionEmbedding { seq: p, .. } = n.kind {
                if p < seq {
                    self.diags.push(
                        Diagnostic::error("E0308", format!("PositionEmbedding has {p} positions but sequences are {seq} tokens"))
                            .label(n.span, format!("{p} positions"))
                            .label(seq_span, format!("seq = {seq}"))
                            .help(format!("use PositionEmbedding({seq}, d)")),
                    );
                }
            }
        }
        let shard_items = self.shard(shard_lines);
        let (Some(tokens), Some(targets), Some(loss), true) = (tokens, targets, loss, ok) else {
            return None;
        };
        let (layers, layers_span) = self.repeat.unwrap_or((0, def.name.span));
        Some(Elaborated {
            model: Model {
                name: def.name.name.clone(),
                span: def.span,
                seq,
                vocab,
                dim,
                layers,
                values: std::mem::take(&mut self.values),
                nodes: out_nodes,
                tokens,
                targets,
                loss,
                sharding: Sharding::default(),
            },
            layers_span,
            consts,
            arg_spans,
            seq_span,
            name_span: def.name.span,
            shard_items,
        })
    }

    fn assign_names(&mut self) -> Vec<String> {
        let mut counts: HashMap<(String, &'static str), u32> = HashMap::new();
        for p in self.nodes.iter().filter(|p| p.explicit.is_none()) {
            *counts
                .entry((p.scope.clone(), layers::default_name(&p.kind)))
                .or_default() += 1;
        }
        let mut seen: HashMap<(String, &'static str), u32> = HashMap::new();
        let mut taken: HashMap<String, Span> = HashMap::new();
        let mut names = Vec::with_capacity(self.nodes.len());
        for p in &self.nodes {
            let local = match &p.explicit {
                Some(id) => id.name.clone(),
                None => {
                    let base = layers::default_name(&p.kind);
                    let key = (p.scope.clone(), base);
                    if counts.get(&key).copied().unwrap_or(0) > 1 {
                        let i = seen.entry(key).or_default();
                        *i += 1;
                        format!("{base}{i}")
                    } else {
                        base.to_string()
                    }
                }
            };
            let full = if p.scope.is_empty() {
                local
            } else {
                format!("{}.{local}", p.scope)
            };
            if let Some(first) = taken.insert(full.clone(), p.span) {
                if let Some(id) = &p.explicit {
                    self.diags.push(
                        Diagnostic::error("E0204", format!("two layers are named `{full}`"))
                            .label(id.span, "named again here")
                            .label(first, "first layer with this name")
                            .help("give each layer its own name"),
                    );
                }
            }
            names.push(full);
        }
        names
    }

    fn resolve_tied(&mut self, nodes: &mut [Node]) {
        let tied: Vec<(usize, String, Span)> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.tied.clone().map(|(n, s)| (i, n, s)))
            .collect();
        for (i, target, span) in tied {
            let found: Vec<usize> = (0..nodes.len())
                .filter(|&j| nodes[j].name == target || nodes[j].kind.kind_name() == target)
                .collect();
            let j = match found.as_slice() {
                [j] => *j,
                [] => {
                    let mut names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
                    names.extend(nodes.iter().map(|n| n.kind.kind_name()));
                    let tie = "tie to `Embedding` (the token embedding)";
                    let help = suggest::did_you_mean(&target, names.iter().copied(), tie);
                    self.diags.push(
                        Diagnostic::error("E0208", format!("`tied = {target}` names no layer"))
                            .label(span, "no such layer")
                            .help(help),
                    );
                    continue;
                }
                _ => {
                    self.diags.push(
                        Diagnostic::error(
                            "E0208",
                            format!("`tied = {target}` matches several layers"),
                        )
                        .label(span, "ambiguous")
                        .help("name the layer with `as` and tie to that name"),
                    );
                    continue;
                }
            };
            let (
                LayerKind::Embedding { vocab, dim },
                LayerKind::Linear {
                    in_dim, out_dim, ..
                },
            ) = (nodes[j].kind.clone(), nodes[i].kind.clone())
            else {
                self.diags.push(
                    Diagnostic::error(
                        "E0208",
                        format!(
                            "`{target}` is a {}, and only an Embedding can be tied",
                            nodes[j].kind.kind_name()
                        ),
                    )
                    .label(span, "tied here")
                    .label(nodes[j].span, "this layer")
                    .help("tie the output projection to the token Embedding"),
                );
                continue;
            };
            if (out_dim, in_dim) != (vocab, dim) {
                self.diags.push(
                    Diagnostic::error("E0305", format!("a tied Linear({in_dim}, {out_dim}) must have the Embedding's shape [vocab, dim] = [{vocab}, {dim}]"))
                        .label(nodes[i].span, format!("weight [{out_dim}, {in_dim}]"))
                        .label(nodes[j].span, format!("table [{vocab}, {dim}]"))
                        .help(format!("use Linear({dim}, {vocab}, tied = {target})")),
                );
                continue;
            }
            if let LayerKind::Linear { tied, .. } = &mut nodes[i].kind {
                *tied = Some(NodeId(j as u32));
            }
        }
    }

    fn shard(&mut self, items: &[ShardItem]) -> Vec<(ShardTarget, Span, Span)> {
        let mut out = Vec::new();
        let mut last_kind: Option<String> = None;
        for item in items {
            let kind = match &item.kind {
                Some(k) => {
                    last_kind = Some(k.name.clone());
                    k.name.clone()
                }
                None => last_kind.clone().unwrap_or_default(),
            };
            let axis = item.axis.name.as_str();
            if !matches!(axis, "dp" | "pp" | "cp" | "tp") {
                self.diags.push(
                    Diagnostic::error("E0408", format!("`{axis}` is not a mesh axis"))
                        .label(item.axis.span, "unknown axis")
                        .help("the mesh axes are `dp`, `pp`, `cp` and `tp`"),
                );
                continue;
            }
            let target = match (kind.as_str(), item.dim.name.as_str(), axis) {
                ("Attention", "heads", "tp") => ShardTarget::AttentionHeadsTp,
                ("Attention" | "", "seq", "cp") => ShardTarget::AttentionSeqCp,
                ("MLP", "hidden", "tp") => ShardTarget::MlpHiddenTp,
                ("Embedding" | "Linear" | "CrossEntropy", "vocab", "tp") => ShardTarget::VocabTp,
                (k, d, a) => {
                    self.diags.push(
                        Diagnostic::error("E0209", format!("parc cannot shard {}{d} on {a}", if k.is_empty() { String::new() } else { format!("{k}.") }))
                            .label(item.span, "this shard line")
                            .help("shardable: `Attention.heads on tp`, `Attention.seq on cp`, `MLP.hidden on tp`, `Embedding.vocab on tp`"),
                    );
                    continue;
                }
            };
            out.push((target, item.span, item.axis.span));
        }
        out
    }
}
