//! The layers of each pipeline chunk: `balance = even` needs the chunks to divide the
//! repeated layers (E0407), `balance = auto` a layer per chunk (E0407), and a `layers` list
//! one count per chunk (E0409), none 0 (E0416), summing to the layers (E0415), neither beside
//! `balance` (E0417) nor without a pipeline (E0418). Every help names a split that checks.

use super::super::model::Elaborated;
use super::super::sections::{GivenLayers, ParallelIn};
use super::Grid;
use crate::diag::{Diagnostic, Span};
use crate::spec::{Axis, Balance, PipelineSchedule};

impl Grid<'_> {
    /// Layers per pipeline chunk: the even split must divide them, a given `layers` list must
    /// fit the pipeline and the model, and `balance = auto` needs a layer for every chunk.
    pub fn pipeline_layers(&mut self, e: &Elaborated, pin: &ParallelIn) {
        let p = &pin.parallel;
        let pp = p.mesh.size(Axis::Pp);
        if pp <= 1 {
            if let PipelineSchedule::Interleaved { .. } = p.schedule {
                self.diags.push(
                    Diagnostic::warning("W0503", "the interleaved schedule needs pp > 1; with pp = 1 it is plain gradient accumulation")
                        .label(self.at("parallel.schedule", self.parallel_span), "interleaved")
                        .help("set pp > 1 or use `1f1b`"),
                );
            }
            if let Some(given) = &pin.layers {
                self.layers_without_pipeline(e, given);
            }
            return;
        }
        let (_, v) = p.pipeline_shape();
        let shape = Shape { pp, v };
        match &pin.layers {
            Some(given) => {
                if let Some(balance) = pin.balance {
                    self.layers_and_balance(given, balance);
                }
                self.given_layers(e, given, shape);
            }
            None if p.balance == Balance::Auto => self.auto_layers(e, shape),
            None => self.even_layers(e, shape),
        }
    }

    /// E0407: `balance = even` needs the chunks to divide the layers.
    fn even_layers(&mut self, e: &Elaborated, shape: Shape) {
        let chunks = shape.chunks();
        let layers = e.model.layers;
        if layers > 0 && layers.is_multiple_of(chunks) {
            return;
        }
        let label = shape.label();
        let fits: Vec<String> = (1..=layers.max(1))
            .filter(|d| layers.is_multiple_of(*d))
            .map(|d| d.to_string())
            .collect();
        let mut help = if layers == 0 {
            "put the repeated layers in a `repeat` so parc can split them into stages".to_string()
        } else if shape.v > 1 {
            format!(
                "make pp × virtual a divisor of layers = {layers}: {}",
                fits.join(", ")
            )
        } else {
            format!(
                "set pp to a divisor of layers = {layers}: {}",
                fits.join(", ")
            )
        };
        if layers >= chunks {
            help.push_str(&format!(
                ", or split them unevenly: `balance = auto` (the cost model's split) or `layers = {}`",
                list(&suggested(layers, chunks))
            ));
        }
        let d = Diagnostic::error(
            "E0407",
            format!("layers = {layers} cannot be split evenly into {label} pipeline chunks"),
        )
        .label(self.axis_span(Axis::Pp), label.clone())
        .label(e.layers_span, format!("layers = {layers}"))
        .help(help);
        // The fix: the largest pp below this one that divides the layers.
        let fixed_pp = (1..shape.pp.min(layers))
            .rev()
            .find(|d| layers.is_multiple_of(*d));
        self.diags.push(match fixed_pp {
            Some(pp) if shape.v == 1 && layers > 0 => d.fix([("parallel.pp", pp)]),
            _ => d,
        });
    }

    /// E0407: `balance = auto` gives every chunk at least one layer.
    fn auto_layers(&mut self, e: &Elaborated, shape: Shape) {
        let layers = e.model.layers;
        if layers >= shape.chunks() {
            return;
        }
        let label = shape.label();
        let help = if shape.v > 1 {
            format!("make pp × virtual at most layers = {layers}")
        } else {
            format!("set pp to at most layers = {layers}")
        };
        self.diags.push(
            Diagnostic::error(
                "E0407",
                format!("layers = {layers} cannot give each of {label} pipeline chunks a layer"),
            )
            .label(self.axis_span(Axis::Pp), label)
            .label(e.layers_span, format!("layers = {layers}"))
            .help(help),
        );
    }

    /// E0409, E0415, E0416: a `layers` list has one count per chunk, none 0, summing to the
    /// model's repeated layers. Each help gives a list that fits.
    fn given_layers(&mut self, e: &Elaborated, given: &GivenLayers, shape: Shape) {
        let layers = e.model.layers;
        let chunks = shape.chunks();
        let unit = if shape.v > 1 { "chunk" } else { "stage" };
        if given.counts.len() != chunks as usize {
            self.layers_length(given, shape, layers);
            return;
        }
        let example = match repair(&given.counts, layers) {
            Some(f) => format!("e.g. `layers = {}`", list(&f)),
            None => too_few(layers, chunks),
        };
        let zeros: Vec<usize> = (0..given.counts.len())
            .filter(|i| given.counts[*i] == 0)
            .collect();
        if !zeros.is_empty() {
            let which: Vec<String> = zeros.iter().map(|i| i.to_string()).collect();
            let plural = if zeros.len() > 1 { "s" } else { "" };
            let mut d = Diagnostic::error(
                "E0416",
                format!(
                    "`layers` gives {unit}{plural} {} no layers; every pipeline {unit} needs at least one",
                    which.join(", ")
                ),
            );
            for i in &zeros {
                d = d.label(given.spans[*i], format!("{unit} {i}: 0 layers"));
            }
            self.diags
                .push(d.help(format!("give every {unit} a layer: {example}")));
        }
        let sum: u64 = given.counts.iter().map(|c| u64::from(*c)).sum();
        if sum != u64::from(layers) {
            self.diags.push(
                Diagnostic::error(
                    "E0415",
                    format!("`layers` sums to {sum}, but the model repeats {layers} layers"),
                )
                .label(given.span, format!("sums to {sum}"))
                .label(e.layers_span, format!("layers = {layers}"))
                .help(format!("make the counts sum to {layers}: {example}")),
            );
        }
    }

    /// E0409: a `layers` list of another length than the pipeline's chunks.
    fn layers_length(&mut self, given: &GivenLayers, shape: Shape, layers: u32) {
        let chunks = shape.chunks();
        let n = given.counts.len();
        let example = if layers >= chunks {
            format!(
                "e.g. `layers = {}`; or replace `layers` with `balance = auto`",
                list(&suggested(layers, chunks))
            )
        } else {
            too_few(layers, chunks)
        };
        let per = if shape.v > 1 {
            "chunk in chunk order (chunk c runs on stage c mod pp)"
        } else {
            "stage"
        };
        self.diags.push(
            Diagnostic::error(
                "E0409",
                format!(
                    "`layers` gives {n} counts but the pipeline has {}",
                    shape.count()
                ),
            )
            .label(given.span, format!("{n} counts"))
            .label(self.axis_span(Axis::Pp), shape.label())
            .help(format!("give one count per {per}: {example}")),
        );
    }

    /// E0417: `layers` and `balance` both say how to split the layers.
    fn layers_and_balance(&mut self, given: &GivenLayers, balance: (Balance, Span)) {
        let word = if balance.0 == Balance::Auto {
            "auto"
        } else {
            "even"
        };
        self.diags.push(
            Diagnostic::error(
                "E0417",
                format!("`layers` and `balance = {word}` both say how to split the layers"),
            )
            .label(given.span, "these counts")
            .label(balance.1, format!("balance = {word}"))
            .help(format!(
                "keep one: remove `balance` to use these counts, or remove `layers` for balance = {word}"
            )),
        );
    }

    /// E0418: `layers` without a pipeline.
    fn layers_without_pipeline(&mut self, e: &Elaborated, given: &GivenLayers) {
        let layers = e.model.layers;
        self.diags.push(
            Diagnostic::error("E0418", "`layers` splits a pipeline, but pp = 1")
                .label(given.span, "layers per pipeline stage")
                .label(self.axis_span(Axis::Pp), "pp = 1")
                .help(format!(
                    "remove `layers`: one stage holds all {layers} layers"
                )),
        );
    }
}

/// The pipeline's stages and chunks per stage, for the layer checks.
#[derive(Clone, Copy)]
struct Shape {
    pp: u32,
    v: u32,
}

impl Shape {
    fn chunks(self) -> u32 {
        self.pp * self.v
    }

    /// `pp = 4 stages` or `pp × virtual = 2 × 2 = 4 chunks`.
    fn count(self) -> String {
        let unit = if self.v > 1 { "chunks" } else { "stages" };
        format!("{} {unit}", self.label())
    }

    /// `pp = 4` or `pp × virtual = 2 × 2 = 4`.
    fn label(self) -> String {
        if self.v > 1 {
            format!(
                "pp × virtual = {} × {} = {}",
                self.pp,
                self.v,
                self.chunks()
            )
        } else {
            format!("pp = {}", self.pp)
        }
    }
}

/// The help when no list fits: fewer layers than chunks.
fn too_few(layers: u32, chunks: u32) -> String {
    format!("the model's {layers} layers are fewer than the {chunks} chunks: use fewer stages")
}

/// `layers` over `chunks` chunks as evenly as possible, the larger counts first (the last
/// chunk holds the head): `[2, 2, 1, 1]` for 6 over 4.
fn suggested(layers: u32, chunks: u32) -> Vec<u32> {
    let (q, r) = (layers / chunks.max(1), layers % chunks.max(1));
    (0..chunks).map(|c| q + u32::from(c < r)).collect()
}

/// `[4, 3, 3, 2]`.
fn list(counts: &[u32]) -> String {
    let items: Vec<String> = counts.iter().map(u32::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// `counts` changed as little as it takes to give every entry at least one layer and sum to
/// `layers`: the largest entries give layers up (the last first: it holds the head), the
/// smallest take them (the first first); [`suggested`] when the sum is more than twice off;
/// `None` when `layers` is fewer than the entries.
fn repair(counts: &[u32], layers: u32) -> Option<Vec<u32>> {
    if counts.is_empty() || (layers as usize) < counts.len() {
        return None;
    }
    let mut out: Vec<u32> = counts.iter().map(|c| (*c).max(1)).collect();
    let mut sum: u64 = out.iter().map(|c| u64::from(*c)).sum();
    let target = u64::from(layers);
    if sum > 2 * target {
        return Some(suggested(layers, counts.len() as u32));
    }
    while sum != target {
        let pick = if sum > target {
            out.iter().enumerate().max_by_key(|(i, c)| (**c, *i))
        } else {
            out.iter().enumerate().min_by_key(|(i, c)| (**c, *i))
        };
        let Some((i, _)) = pick else { break };
        if sum > target {
            out[i] -= 1;
            sum -= 1;
        } else {
            out[i] += 1;
            sum += 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repaired_list_fits_and_stays_close() {
        assert_eq!(repair(&[5, 3, 3, 2], 12), Some(vec![4, 3, 3, 2]));
        assert_eq!(repair(&[4, 4, 4, 4], 12), Some(vec![3, 3, 3, 3]));
        assert_eq!(repair(&[6, 0], 6), Some(vec![5, 1]));
        assert_eq!(repair(&[1, 1], 6), Some(vec![3, 3]));
        assert_eq!(repair(&[100, 1], 6), Some(vec![3, 3]));
        assert_eq!(repair(&[1, 1, 1], 2), None);
        assert_eq!(suggested(6, 4), vec![2, 2, 1, 1]);
    }
}
