//! What lowering knows about one program before emitting it: the rank role's coordinates, the
//! local sizes (rows, sequence segments, head and vocab shards), the process-group families,
//! the pipeline chunk layout and the recompute segments. Also the checks of things `check`
//! could not have caught (E08xx).

use crate::diag::{Diagnostic, Diagnostics};
use crate::fp8::{GemmLayout, PerLayout};
use crate::ir::fp8::Fp8Gemm;
use crate::ir::op::Segment;
use crate::ir::{Group, GroupId};
use crate::spec::{Axis, LayerKind, Mesh, NodeId, Recompute, Spec, ValueId};

/// The process-group families a plan uses (None when the family would be a single rank).
#[derive(Clone, Debug, Default)]
pub struct Groups {
    pub tp: Option<GroupId>,
    pub cp: Option<GroupId>,
    /// Gradient and loss reduction, ZeRO sharding: dp × cp.
    pub dpcp: Option<GroupId>,
    /// The squared-gradient-norm reduction.
    pub norm: Option<GroupId>,
    /// First and last pipeline stage, for parameters used on both (a tied embedding).
    pub embed: Option<GroupId>,
    /// cp × tp: the ranks sharing a tensorwise FP8 scale of an operand split by both (a
    /// row-parallel input under cp; `lower/fp8.rs`).
    pub cptp: Option<GroupId>,
    /// dp alone: delayed FP8 scaling's amax histories, max-reduced over the data-parallel
    /// ranks at the step's end (`lower/fp8.rs`).
    pub dp: Option<GroupId>,
}

/// The GEMMs to run in FP8: for each node (by index), which of its layouts (forward, data
/// gradient, weight gradient), and the attribute they get.
pub struct Fp8Layers {
    pub chosen: Vec<PerLayout<bool>>,
    /// Each node's GEMM weights (`crate::fp8::gemms`' names), for delayed scaling's histories.
    pub weights: Vec<Vec<&'static str>>,
    /// The tensor each of those weights reads as x (`crate::fp8::Gemm::reads`).
    pub reads: Vec<Vec<&'static str>>,
    pub attr: Fp8Gemm,
}

impl Fp8Layers {
    /// From the spec's recipe and `crate::fp8`'s `choices`; None without `train.fp8` or when
    /// every GEMM stays bf16.
    pub fn of(spec: &Spec, choices: &[crate::fp8::Choice]) -> Option<Fp8Layers> {
        let fp8 = spec.train.fp8.as_ref()?;
        let mut chosen = vec![PerLayout::splat(false); spec.model.nodes.len()];
        let mut weights = vec![Vec::new(); spec.model.nodes.len()];
        let mut reads = vec![Vec::new(); spec.model.nodes.len()];
        for c in choices.iter().filter(|c| c.any()) {
            if let Some(slot) = chosen.get_mut(c.node.0 as usize) {
                *slot = c.fp8;
            }
            if let Some(slot) = weights.get_mut(c.node.0 as usize) {
                *slot = c.gemms.iter().map(|g| g.weight).collect();
            }
            if let Some(slot) = reads.get_mut(c.node.0 as usize) {
                *slot = c.gemms.iter().map(|g| g.reads).collect();
            }
        }
        (chosen.iter().flat_map(|c| c.0).any(|f| f)).then(|| Fp8Layers {
            chosen,
            weights,
            reads,
            attr: crate::fp8::gemm_attr(fp8),
        })
    }

    /// The weight of `node` whose delayed-scaling history of tensor `role` (`x`, `w`, `dy`)
    /// `weight`'s GEMMs use: its own, except for `x`, which the first weight reading the same
    /// tensor owns (an MLP's gate and up projections share their input's).
    pub fn history_owner<'a>(&self, node: NodeId, weight: &'a str, role: &str) -> &'a str {
        let i = node.0 as usize;
        let (Some(weights), Some(reads)) = (self.weights.get(i), self.reads.get(i)) else {
            return weight;
        };
        if role != "x" {
            return weight;
        }
        let at = weights.iter().position(|w| *w == weight);
        let tensor = at.and_then(|k| reads.get(k));
        let owner = (weights.iter().zip(reads)).find(|(_, r)| Some(*r) == tensor);
        owner.map_or(weight, |(w, _)| w)
    }

    /// Whether `node`'s GEMM of `layout` runs in FP8.
    pub fn runs(&self, node: NodeId, layout: GemmLayout) -> bool {
        self.chosen.get(node.0 as usize).is_some_and(|c| c[layout])
    }
}

/// One quantized tensor's delayed-scaling state: which tensor (node, weight, role), its
/// history and scale amax (persistent), and the axes its amaxes are shared over (set when a
/// GEMM reading it is emitted; `lower/fp8.rs`).
pub struct Fp8History {
    pub node: NodeId,
    pub weight: &'static str,
    /// The tensor: `x`, `w` or `dy` (each GEMM of the weight reading it shares the history).
    pub role: &'static str,
    pub history: crate::ir::BufferId,
    pub amax: crate::ir::BufferId,
    pub shared: Option<crate::ir::fp8::Axes>,
}

/// Disjoint sets of ranks that differ only on `axes`, each ascending.
pub fn axis_sets(mesh: &Mesh, axes: &[Axis]) -> Vec<Vec<u32>> {
    let mut keys: Vec<Vec<u32>> = Vec::new();
    let mut sets: Vec<Vec<u32>> = Vec::new();
    for r in 0..mesh.world() {
        let key: Vec<u32> = Axis::ALL
            .iter()
            .filter(|a| !axes.contains(a))
            .map(|a| mesh.coord(r, *a))
            .collect();
        match keys.iter().position(|k| *k == key) {
            Some(i) => sets[i].push(r),
            None => {
                keys.push(key);
                sets.push(vec![r]);
            }
        }
    }
    sets
}

pub fn group_family(name: &str, mesh: &Mesh, axes: &[Axis]) -> Group {
    Group {
        name: name.to_string(),
        axes: axes.to_vec(),
        sets: axis_sets(mesh, axes),
    }
}

/// The chunk layout of the pipeline: which nodes each global chunk runs.
pub struct Chunks {
    pub count: u32,
    /// Node index ranges `[start, end)` per global chunk.
    pub ranges: Vec<(usize, usize)>,
    /// Values each chunk receives from the previous one (and the previous one sends), in value
    /// order. `inputs[0]` is empty.
    pub inputs: Vec<Vec<ValueId>>,
}

impl Chunks {
    pub fn chunk_of(&self, node: usize) -> u32 {
        self.ranges
            .iter()
            .position(|(s, e)| node >= *s && node < *e)
            .unwrap_or(0) as u32
    }
    /// Values chunk `c` sends to chunk `c + 1`.
    pub fn outputs(&self, c: u32) -> &[ValueId] {
        self.inputs
            .get(c as usize + 1)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }
}

fn err(code: &'static str, spec: &Spec, msg: String, help: String) -> Diagnostic {
    Diagnostic::error(code, msg)
        .label(spec.parallel.span, "in this parallel plan")
        .help(help)
}

/// Split the model's nodes over `count` chunks at layer boundaries, chunk `c` holding the next
/// `spec.parallel.chunk_layers[c]` repeated layers.
pub fn chunks(spec: &Spec, count: u32) -> Result<Chunks, Diagnostic> {
    let nodes = &spec.model.nodes;
    let layers = spec.model.layers;
    if count > 1 && layers < count {
        return Err(err(
            "E0801",
            spec,
            format!(
                "the pipeline needs {count} model chunks but the model has {layers} repeated layers"
            ),
            format!("use at most {layers} pipeline stages × virtual stages"),
        ));
    }
    check_chunk_layers(spec, count)?;
    let chunk_of_node = |n: usize| -> u32 {
        match nodes[n].layer {
            Some(l) => spec.parallel.chunk_of_layer(l),
            None => {
                let before_any = nodes[..n].iter().all(|m| m.layer.is_none());
                if before_any {
                    0
                } else {
                    count - 1
                }
            }
        }
    };
    let mut ranges = Vec::new();
    let mut start = 0;
    for c in 0..count {
        let mut end = start;
        while end < nodes.len() && chunk_of_node(end) == c {
            end += 1;
        }
        ranges.push((start, end));
        start = end;
    }
    if start != nodes.len() {
        return Err(err(
            "E0801",
            spec,
            "the model's nodes are not in layer order, so they cannot be split into pipeline stages"
                .to_string(),
            "keep the repeated layers contiguous between the embedding and the head".to_string(),
        ));
    }
    // Values produced in chunks < c and consumed in chunks ≥ c (model inputs are loaded, not
    // sent).
    let producer: Vec<Option<usize>> = (0..spec.model.values.len())
        .map(|v| nodes.iter().position(|n| n.output == ValueId(v as u32)))
        .collect();
    let mut inputs = vec![Vec::new(); count as usize];
    for (c, chunk_inputs) in inputs.iter_mut().enumerate().skip(1) {
        let (cs, _) = ranges[c];
        for (v, prod) in producer.iter().enumerate() {
            let Some(p) = prod else { continue };
            if *p >= cs {
                continue;
            }
            let used_later = nodes
                .iter()
                .enumerate()
                .any(|(i, n)| i >= cs && n.inputs.contains(&ValueId(v as u32)));
            if used_later {
                chunk_inputs.push(ValueId(v as u32));
            }
        }
    }
    Ok(Chunks {
        count,
        ranges,
        inputs,
    })
}

/// The per-chunk layer counts must describe this pipeline: one entry per chunk, none 0,
/// summing to the model's repeated layers (`check` ensures it for specs it makes).
fn check_chunk_layers(spec: &Spec, count: u32) -> Result<(), Diagnostic> {
    let list = &spec.parallel.chunk_layers;
    let sum: u64 = list.iter().map(|n| u64::from(*n)).sum();
    let layers = spec.model.layers;
    let fits = list.len() == count as usize
        && sum == u64::from(layers)
        && (count == 1 || list.iter().all(|n| *n > 0));
    if fits {
        return Ok(());
    }
    Err(err(
        "E0801",
        spec,
        format!(
            "the layers per pipeline chunk {list:?} do not split {layers} repeated layers over {count} chunks"
        ),
        format!("give {count} counts of at least 1 that sum to {layers}, or `balance: even`"),
    ))
}

/// Pipeline shape after normalisation: with one stage, virtual chunks are pointless and
/// collapse to one.
pub fn pipeline_shape(spec: &Spec) -> (u32, u32) {
    spec.parallel.pipeline_shape()
}

/// Recompute segments (full / named): maximal runs of consecutive recomputed nodes of one
/// layer, never containing the loss. `None` for nodes outside any.
pub fn recompute_segments(spec: &Spec) -> Vec<Option<u32>> {
    let mut out = vec![None; spec.model.nodes.len()];
    if matches!(
        spec.parallel.recompute,
        Recompute::None | Recompute::Selective
    ) {
        return out;
    }
    let mut next = 0u32;
    let mut prev: Option<(u32, Option<u32>)> = None;
    for (i, n) in spec.model.nodes.iter().enumerate() {
        let eligible = n.recompute && !matches!(n.kind, LayerKind::CrossEntropy);
        if !eligible {
            prev = None;
            continue;
        }
        let seg = match prev {
            Some((s, layer)) if layer == n.layer => s,
            _ => {
                next += 1;
                next - 1
            }
        };
        out[i] = Some(seg);
        prev = Some((seg, n.layer));
    }
    out
}

/// Structural checks lowering relies on that `check` reports differently or not at all.
pub fn validate(spec: &Spec) -> Diagnostics {
    let mut diags = crate::fp8::validate(spec);
    let mesh = &spec.parallel.mesh;
    let tp = u64::from(mesh.size(Axis::Tp));
    let cp = u64::from(mesh.size(Axis::Cp));
    let world = mesh.world();
    if world == 0 || mesh.axes.len() != 4 {
        diags.push(err(
            "E0802",
            spec,
            "the mesh must name dp, pp, cp and tp exactly once with sizes ≥ 1".to_string(),
            "write e.g. mesh = { dp: 1, pp: 1, cp: 1, tp: 1 }".to_string(),
        ));
        return diags;
    }
    let seq = spec.model.seq;
    if cp > 1 && !seq.is_multiple_of(2 * cp) {
        diags.push(err(
            "E0802",
            spec,
            format!("seq = {seq} is not divisible by 2·cp = {}", 2 * cp),
            "choose cp so that 2·cp divides the sequence length".to_string(),
        ));
    }
    if spec.parallel.sequence_parallel && tp > 1 && !(seq / cp).is_multiple_of(tp) {
        diags.push(err(
            "E0802",
            spec,
            format!(
                "sequence parallelism splits each rank's {} positions over tp = {tp}, which does not divide them",
                seq / cp
            ),
            "choose tp dividing seq / cp, or turn sequence_parallel off".to_string(),
        ));
    }
    let (p, v) = pipeline_shape(spec);
    let m = spec.parallel.microbatches;
    if m == 0 {
        diags.push(err(
            "E0802",
            spec,
            "microbatches must be at least 1".to_string(),
            "set parallel.microbatches ≥ 1".to_string(),
        ));
    }
    if v > 1 && !m.is_multiple_of(p) {
        diags.push(err(
            "E0802",
            spec,
            format!("interleaved 1F1B needs microbatches ({m}) divisible by pp = {p}"),
            format!("set microbatches to a multiple of {p}"),
        ));
    }
    for (i, n) in spec.model.nodes.iter().enumerate() {
        let sh = &spec.model.sharding;
        let bad = |what: &str, help: String| {
            Diagnostic::error(
                "E0803",
                format!("{} `{}` {what}", n.kind.kind_name(), n.name),
            )
            .label(n.span, "this layer")
            .help(help)
        };
        match &n.kind {
            LayerKind::Attention {
                heads, kv_heads, ..
            } if tp > 1 => {
                if !sh.attention_heads_on_tp {
                    diags.push(bad(
                        "would be replicated over tp; parc lowers attention only head-parallel",
                        "add `shard Attention.heads on tp`".to_string(),
                    ));
                } else if heads % tp != 0 || kv_heads % tp != 0 {
                    diags.push(bad(
                        &format!(
                            "has {heads} heads / {kv_heads} kv heads, not divisible by tp = {tp}"
                        ),
                        "choose tp dividing both head counts".to_string(),
                    ));
                }
            }
            LayerKind::Mlp { hidden, .. } if tp > 1 => {
                if !sh.mlp_hidden_on_tp {
                    diags.push(bad(
                        "would be replicated over tp; parc lowers the MLP only hidden-parallel",
                        "add `shard MLP.hidden on tp`".to_string(),
                    ));
                } else if hidden % tp != 0 {
                    diags.push(bad(
                        &format!("hidden = {hidden} is not divisible by tp = {tp}"),
                        "choose tp dividing the MLP hidden size".to_string(),
                    ));
                }
            }
            LayerKind::Embedding { vocab, .. }
                if tp > 1 && (!sh.vocab_on_tp || !vocab.is_multiple_of(tp)) =>
            {
                diags.push(bad(
                    &format!("needs its vocab ({vocab}) split over tp = {tp}"),
                    "add `shard Embedding.vocab on tp` with tp dividing the vocab".to_string(),
                ));
            }
            LayerKind::Linear { out_dim, .. } if tp > 1 => {
                let vocab_head = *out_dim == spec.model.vocab && sh.vocab_on_tp;
                let feeds_loss = spec.model.nodes.iter().any(|m| {
                    matches!(m.kind, LayerKind::CrossEntropy) && m.inputs.first() == Some(&n.output)
                });
                if !vocab_head || !feeds_loss {
                    diags.push(bad(
                        "would be replicated over tp; parc supports Linear only as the vocab-parallel head feeding the loss",
                        "split the vocab over tp (`shard Embedding.vocab on tp`) or use tp = 1".to_string(),
                    ));
                }
            }
            LayerKind::CrossEntropy => {
                let producer = n
                    .inputs
                    .first()
                    .and_then(|v| spec.model.nodes.iter().find(|m| m.output == *v));
                match producer.map(|m| &m.kind) {
                    Some(LayerKind::Linear { .. }) => {}
                    Some(LayerKind::Elementwise { f, .. }) => diags.push(bad(
                        &format!(
                            "must take its logits straight from a Linear head, not from the function `{}`",
                            f.name
                        ),
                        "parc's loss reads the head's logits itself: a function of the logits \
                         (e.g. Gemma 2's final soft-capping `30 * tanh(x / 30)`) has no lowering; \
                         apply functions to the hidden state before the head, and write \
                         CrossEntropy(Linear(…)(x), targets)"
                            .to_string(),
                    )),
                    _ => diags.push(bad(
                        "must take its logits straight from a Linear head",
                        "write CrossEntropy(Linear(…)(x), targets)".to_string(),
                    )),
                }
            }
            _ => {}
        }
        let _ = NodeId(i as u32);
    }
    diags
}

/// The cp-local sequence segments of cp rank `i`: chunks `i` and `2cp − 1 − i` of `2cp`
/// (balanced causal context parallelism); the whole sequence without cp.
pub fn cp_segments(seq: u64, cp: u32, i: u32) -> Vec<Segment> {
    if cp <= 1 {
        return vec![Segment {
            start: 0,
            len: seq as u32,
        }];
    }
    let chunk = (seq / (2 * u64::from(cp))) as u32;
    vec![
        Segment {
            start: i * chunk,
            len: chunk,
        },
        Segment {
            start: (2 * cp - 1 - i) * chunk,
            len: chunk,
        },
    ]
}

/// Positions `[start, start + len)` of a local position list, as segments.
pub fn sub_segments(segs: &[Segment], start: u32, len: u32) -> Vec<Segment> {
    let mut out = Vec::new();
    let (mut skip, mut want) = (start, len);
    for s in segs {
        if want == 0 {
            break;
        }
        if skip >= s.len {
            skip -= s.len;
            continue;
        }
        let take = (s.len - skip).min(want);
        out.push(Segment {
            start: s.start + skip,
            len: take,
        });
        want -= take;
        skip = 0;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cp_ranks_hold_balanced_chunks() {
        assert_eq!(
            cp_segments(16, 2, 0),
            vec![Segment { start: 0, len: 4 }, Segment { start: 12, len: 4 }]
        );
        assert_eq!(
            cp_segments(16, 2, 1),
            vec![Segment { start: 4, len: 4 }, Segment { start: 8, len: 4 }]
        );
    }

    /// Chunks cut the model where `chunk_layers` says; a list that does not fit the pipeline
    /// is E0801.
    #[test]
    fn chunks_follow_the_per_chunk_layer_counts() {
        use crate::cost::testspec::{build, Dims, Plan};
        use crate::spec::Balance;
        let spec_of = |layers: Vec<u32>| {
            let plan = Plan {
                pp: 2,
                balance: Balance::Given,
                layers,
                ..Plan::default()
            };
            build(&Dims::tiny(), &plan)
        };
        let spec = spec_of(vec![3, 1]);
        let c = chunks(&spec, 2).unwrap();
        let layers_of = |chunk: u32| -> Vec<Option<u32>> {
            let (s, e) = c.ranges[chunk as usize];
            let mut l: Vec<_> = spec.model.nodes[s..e].iter().map(|n| n.layer).collect();
            l.dedup();
            l
        };
        assert_eq!(layers_of(0), vec![None, Some(0), Some(1), Some(2)]);
        assert_eq!(layers_of(1), vec![Some(3), None]);
        for bad in [vec![4, 0], vec![2, 1], vec![1, 1, 2]] {
            let d = chunks(&spec_of(bad.clone()), 2).err();
            assert_eq!(d.map(|d| d.code), Some("E0801"), "{bad:?}");
        }
    }

    #[test]
    fn sub_segments_cross_boundaries() {
        let segs = cp_segments(16, 2, 0);
        assert_eq!(
            sub_segments(&segs, 0, 4),
            vec![Segment { start: 0, len: 4 }]
        );
        assert_eq!(
            sub_segments(&segs, 2, 4),
            vec![Segment { start: 2, len: 2 }, Segment { start: 12, len: 2 }]
        );
        assert_eq!(
            sub_segments(&segs, 4, 4),
            vec![Segment { start: 12, len: 4 }]
        );
    }
}
