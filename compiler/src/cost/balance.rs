//! Where the repeated layers go: the per-chunk layer counts of `Spec.parallel.chunk_layers`
//! for each `parallel.balance` (docs/cost-model.md, "Where the layers go").
//!
//! `balance: auto` weighs every node by its FLOPs in this cost model ([`super::flops`]): the
//! nodes before the repeat (the embedding) belong to chunk 0, those after it (final norm, head,
//! loss) to the last chunk, and each repeated layer costs what its nodes cost. It chooses the
//! counts, at least one layer per chunk, that minimise the most loaded stage:
//! - one chunk per stage: an exact bottleneck search. A bound B is feasible when greedy
//!   chunks of at most B (each as long as it may be) need no more chunks than there are
//!   stages; the smallest feasible B is found by bisection over the bound's f64 bits (at most
//!   64 greedy passes). Among the splits within B, each chunk then takes the count whose
//!   load is closest to an equal share of what remains (ties: the count closest to an equal
//!   share of the remaining layers, then the fewer), so the slack is spread evenly;
//! - interleaved (v chunks per stage): a stage's load is its layers times the layers' mean
//!   cost plus its share of the embedding and head, so layers go one at a time to the stage
//!   they load least (exact for equal layers, which `repeat` makes unless some layers alone are
//!   recomputed), starting from v per stage; each stage's layers then go to its chunks the
//!   same way, so the head's chunk gets fewer.

use super::flops;
use crate::spec::{even_layers, Balance, Spec};

/// The per-chunk layer counts `spec.parallel.balance` asks for: the even split, the given
/// list, or [`auto`]'s.
pub fn chunk_layers(spec: &Spec) -> Vec<u32> {
    let (p, v) = spec.parallel.pipeline_shape();
    match spec.parallel.balance {
        Balance::Even => even_layers(spec.model.layers, p * v),
        Balance::Given => spec.parallel.chunk_layers.clone(),
        Balance::Auto => auto(spec),
    }
}

/// Fill `spec.parallel.chunk_layers` from its balance after a change of the plan.
pub fn rebalance(spec: &mut Spec) {
    spec.parallel.chunk_layers = chunk_layers(spec);
}

/// The FLOPs of the nodes before the repeat, of each repeated layer, and after the repeat.
pub fn work(spec: &Spec) -> (f64, Vec<f64>, f64) {
    let mut layers = vec![0.0; spec.model.layers as usize];
    let (mut pre, mut post, mut seen_layer) = (0.0, 0.0, false);
    for node in &spec.model.nodes {
        let f = flops::node_flops(spec, node).total();
        match node.layer {
            Some(l) => {
                seen_layer = true;
                if let Some(w) = layers.get_mut(l as usize) {
                    *w += f;
                }
            }
            None if seen_layer => post += f,
            None => pre += f,
        }
    }
    (pre, layers, post)
}

/// `balance: auto`'s counts (see the module header). With fewer layers than chunks (which
/// `check` refuses) it returns the even split.
pub fn auto(spec: &Spec) -> Vec<u32> {
    let (p, v) = spec.parallel.pipeline_shape();
    let layers = spec.model.layers;
    if p * v <= 1 || layers < p * v {
        return even_layers(layers, p * v);
    }
    let (pre, weights, post) = work(spec);
    if v == 1 {
        return Partition::new(pre, &weights, post).split(p as usize);
    }
    let mean = weights.iter().sum::<f64>() / f64::from(layers);
    let mut stage_extra = vec![0.0; p as usize];
    stage_extra[0] += pre;
    stage_extra[p as usize - 1] += post;
    let stages = fill(&stage_extra, mean, v, layers);
    let mut out = vec![0; (p * v) as usize];
    for (s, &total) in stages.iter().enumerate() {
        let mut extra = vec![0.0; v as usize];
        if s == 0 {
            extra[0] += pre;
        }
        if s + 1 == p as usize {
            extra[v as usize - 1] += post;
        }
        for (j, n) in fill(&extra, mean, 1, total).into_iter().enumerate() {
            out[j * p as usize + s] = n;
        }
    }
    out
}

/// `total` layers of cost `w` over bins of fixed cost `extra`, at least `min` each, one at a
/// time to the bin they load least (ties: the bin with fewer layers, then the first): the
/// split that minimises the most loaded bin.
fn fill(extra: &[f64], w: f64, min: u32, total: u32) -> Vec<u32> {
    let mut counts = vec![min; extra.len()];
    let placed = min as usize * extra.len();
    for _ in placed..total as usize {
        let load = |i: usize| extra[i] + w * f64::from(counts[i] + 1);
        let best = (0..counts.len()).min_by(|&a, &b| {
            load(a)
                .total_cmp(&load(b))
                .then(counts[a].cmp(&counts[b]))
                .then(a.cmp(&b))
        });
        if let Some(i) = best {
            counts[i] += 1;
        }
    }
    counts
}

/// The layers in order with the work before the first (`pre`) and after the last (`post`):
/// chunk loads are prefix-sum differences.
struct Partition {
    pre: f64,
    post: f64,
    /// `prefix[i]`: the work of layers `[0, i)`.
    prefix: Vec<f64>,
}

impl Partition {
    fn new(pre: f64, weights: &[f64], post: f64) -> Partition {
        let mut prefix = Vec::with_capacity(weights.len() + 1);
        let mut sum = 0.0;
        prefix.push(sum);
        for w in weights {
            sum += w;
            prefix.push(sum);
        }
        Partition { pre, post, prefix }
    }

    fn layers(&self) -> usize {
        self.prefix.len() - 1
    }

    /// The work of a chunk of layers `[a, b)`.
    fn load(&self, a: usize, b: usize) -> f64 {
        let mut w = self.prefix[b] - self.prefix[a];
        if a == 0 {
            w += self.pre;
        }
        if b == self.layers() {
            w += self.post;
        }
        w
    }

    /// Per start layer `i`, the fewest chunks of at most `bound` that cover layers `[i, L)`
    /// (`None`: a single layer there exceeds it); the greedy (each chunk as long as it may be)
    /// needs the fewest.
    fn needed(&self, bound: f64) -> Vec<Option<usize>> {
        let n = self.layers();
        let mut need = vec![None; n + 1];
        need[n] = Some(0);
        let mut end = n;
        for i in (0..n).rev() {
            while end > i + 1 && self.load(i, end) > bound {
                end -= 1;
            }
            if self.load(i, end) <= bound {
                need[i] = need[end].map(|k| k + 1);
            }
        }
        need
    }

    fn feasible(&self, bound: f64, chunks: usize) -> bool {
        self.needed(bound)[0].is_some_and(|k| k <= chunks)
    }

    /// The smallest bound on the most loaded of `chunks` chunks, by bisection over the bits
    /// of non-negative f64s (ordered as their values).
    fn bottleneck(&self, chunks: usize) -> f64 {
        let (mut lo, mut hi) = (0u64, self.load(0, self.layers()).to_bits());
        if self.feasible(0.0, chunks) {
            return 0.0;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.feasible(f64::from_bits(mid), chunks) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        f64::from_bits(hi)
    }

    /// Counts of `chunks` chunks (at most the layers) whose most loaded is the bottleneck,
    /// each chunk as close to an equal share of what remains as the bound allows.
    fn split(&self, chunks: usize) -> Vec<u32> {
        let n = self.layers();
        let bound = self.bottleneck(chunks);
        let need = self.needed(bound);
        let mut out = Vec::with_capacity(chunks);
        let mut start = 0;
        for c in 0..chunks {
            let left = chunks - c;
            let end = if left == 1 {
                n
            } else {
                let share = self.load(start, n) / left as f64;
                let layer_share = (n - start) as f64 / left as f64;
                let fits =
                    |&b: &usize| self.load(start, b) <= bound && need[b].is_some_and(|k| k < left);
                let key = |b: usize| {
                    let by_work = (self.load(start, b) - share).abs();
                    let by_layers = ((b - start) as f64 - layer_share).abs();
                    (by_work, by_layers, b)
                };
                (start + 1..=n + 1 - left)
                    .filter(fits)
                    .min_by(|&a, &b| {
                        let (x, y) = (key(a), key(b));
                        x.0.total_cmp(&y.0)
                            .then(x.1.total_cmp(&y.1))
                            .then(x.2.cmp(&y.2))
                    })
                    .unwrap_or(start + 1)
            };
            out.push((end - start) as u32);
            start = end;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The most loaded chunk of `counts` over `p`.
    fn worst(p: &Partition, counts: &[u32]) -> f64 {
        let mut start = 0;
        let mut most = 0.0f64;
        for &n in counts {
            let end = start + n as usize;
            most = most.max(p.load(start, end));
            start = end;
        }
        most
    }

    /// Every split of `n` layers into `k` chunks of at least one, by brute force.
    fn compositions(n: u32, k: u32) -> Vec<Vec<u32>> {
        if k == 1 {
            return vec![vec![n]];
        }
        (1..=n.saturating_sub(k - 1))
            .flat_map(|first| {
                compositions(n - first, k - 1)
                    .into_iter()
                    .map(move |mut rest| {
                        rest.insert(0, first);
                        rest
                    })
            })
            .collect()
    }

    #[test]
    fn the_split_reaches_the_brute_force_bottleneck() {
        let weights = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0];
        for (pre, post) in [(0.0, 0.0), (2.0, 7.0), (0.0, 20.0), (12.0, 1.0)] {
            let p = Partition::new(pre, &weights, post);
            for k in 1..=weights.len() as u32 {
                let best = compositions(weights.len() as u32, k)
                    .iter()
                    .map(|c| worst(&p, c))
                    .fold(f64::INFINITY, f64::min);
                let split = p.split(k as usize);
                assert_eq!(split.len(), k as usize);
                assert!(split.iter().all(|n| *n >= 1), "{split:?}");
                assert_eq!(split.iter().sum::<u32>(), weights.len() as u32);
                assert_eq!(
                    worst(&p, &split),
                    best,
                    "pre {pre} post {post} k {k}: {split:?}"
                );
            }
        }
    }

    #[test]
    fn equal_layers_spread_the_slack_evenly() {
        // Twelve equal layers and a head of 4.5 layers over four stages: the head's stage
        // takes one layer, the others share the rest.
        let p = Partition::new(0.0, &[1.0; 12], 4.5);
        assert_eq!(p.split(4), vec![4, 4, 3, 1]);
        // Nothing to weigh: the even split.
        let p = Partition::new(0.0, &[0.0; 12], 0.0);
        assert_eq!(p.split(4), vec![3, 3, 3, 3]);
    }

    #[test]
    fn filling_loads_the_least_loaded_bin() {
        assert_eq!(fill(&[0.0, 0.0, 4.5], 1.0, 2, 12), vec![5, 5, 2]);
        assert_eq!(fill(&[0.0; 4], 0.0, 1, 10), vec![3, 3, 2, 2]);
    }
}
