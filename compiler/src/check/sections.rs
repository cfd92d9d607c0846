//! Reading the flattened sections ([`Settings`]) into the plan, the training recipe and the
//! cluster of the [`Spec`](crate::spec::Spec), with defaults filled in and every bad value
//! reported (each section is read to the end even after an error).

use super::gpu;
use super::number::{arith, Number, Unit};
use super::settings::Settings;
use super::suggest;
use crate::diag::{Diagnostic, Diagnostics, Span};
use crate::spec::*;
use crate::syntax::ast::{Arg, Expr, ExprKind};
use std::collections::HashMap;

/// A section value after evaluation.
#[derive(Clone, Debug)]
pub enum SVal {
    Num(Number),
    Bool(bool, Span),
    Str(String, Span),
    Word(String, Span),
    List(Vec<SVal>, Span),
    /// `"file.txt" as bytes`
    File(String, String, Span, Span),
}

impl SVal {
    pub fn span(&self) -> Span {
        match self {
            SVal::Num(n) => n.span,
            SVal::Bool(_, s) | SVal::Str(_, s) | SVal::Word(_, s) | SVal::List(_, s) => *s,
            SVal::File(_, _, s, _) => *s,
        }
    }
}

pub struct Reader<'a> {
    pub settings: &'a Settings,
    pub consts: &'a HashMap<String, Number>,
    pub diags: &'a mut Diagnostics,
}

impl Reader<'_> {
    pub fn eval_expr(&mut self, e: &Expr) -> Option<SVal> {
        self.eval(e)
    }

    fn eval(&mut self, e: &Expr) -> Option<SVal> {
        match &e.kind {
            ExprKind::Number { text, unit } => match Number::literal(text, unit.as_deref(), e.span)
            {
                Ok(n) => Some(SVal::Num(n)),
                Err(d) => {
                    self.diags.push(d);
                    None
                }
            },
            ExprKind::Bool(b) => Some(SVal::Bool(*b, e.span)),
            ExprKind::Str(s) => Some(SVal::Str(s.clone(), e.span)),
            ExprKind::Path(p) if p.len() == 1 => match self.consts.get(&p[0].name) {
                Some(n) => Some(SVal::Num(Number { span: e.span, ..*n })),
                None => Some(SVal::Word(p[0].name.clone(), e.span)),
            },
            ExprKind::Path(p) => {
                let t: Vec<&str> = p.iter().map(|i| i.name.as_str()).collect();
                Some(SVal::Word(t.join("."), e.span))
            }
            ExprKind::Neg(x) => match self.eval(x)? {
                SVal::Num(n) => Some(SVal::Num(n.neg(e.span))),
                other => self.wrong(&other, "a number"),
            },
            ExprKind::Binary(op, a, b) => {
                let (a, b) = (self.eval(a)?, self.eval(b)?);
                match (a, b) {
                    (SVal::Num(x), SVal::Num(y)) => match arith(*op, x, y, e.span) {
                        Ok(n) => Some(SVal::Num(n)),
                        Err(d) => {
                            self.diags.push(d);
                            None
                        }
                    },
                    (SVal::Word(w, s), _) | (_, SVal::Word(w, s)) => self.unknown_const(&w, s),
                    (other, _) => self.wrong(&other, "a number"),
                }
            }
            ExprKind::List(xs) | ExprKind::Tuple(xs) => {
                let mut out = Vec::new();
                for x in xs {
                    out.push(self.eval(x)?);
                }
                Some(SVal::List(out, e.span))
            }
            ExprKind::Rename(x, fmt) => match self.eval(x)? {
                SVal::Str(s, sp) => Some(SVal::File(s, fmt.name.clone(), sp, fmt.span)),
                other => self.wrong(&other, "a file name string before `as`"),
            },
            ExprKind::Compare(..) => {
                self.diags
                    .push(super::functions::comparison_outside(e.span));
                None
            }
            _ => {
                self.diags.push(
                    Diagnostic::error("E0902", "this kind of value is not allowed here")
                        .label(e.span, "here")
                        .help("settings take numbers, names, strings, lists and `word { field: value }` records"),
                );
                None
            }
        }
    }

    fn unknown_const(&mut self, w: &str, s: Span) -> Option<SVal> {
        let consts = self.consts.keys().map(String::as_str);
        let help = suggest::did_you_mean(w, consts, "define it with `let` in the model");
        self.diags.push(
            Diagnostic::error("E0201", format!("unknown name `{w}`"))
                .label(s, "not defined")
                .help(help),
        );
        None
    }

    pub(super) fn wrong(&mut self, v: &SVal, expected: &str) -> Option<SVal> {
        self.diags.push(
            Diagnostic::error("E0902", format!("expected {expected}"))
                .label(v.span(), "this value")
                .help(format!("write {expected} here")),
        );
        None
    }

    pub fn value(&mut self, path: &str) -> Option<SVal> {
        let e = self.settings.get(path)?.clone();
        self.eval(&e)
    }

    pub fn span(&self, path: &str) -> Option<Span> {
        self.settings.get(path).map(|e| e.span)
    }

    /// A whole number ≥ `min` and at most the path's limit ([`limit`]).
    pub fn count(&mut self, path: &str, min: u64) -> Option<u64> {
        let leaf = path.rsplit('.').next().unwrap_or(path).to_string();
        let max = limit(path);
        let n = match self.value(path)? {
            SVal::Num(n) => n,
            SVal::Word(w, s) => return self.unknown_const(&w, s).and(None),
            other => {
                return self
                    .wrong(&other, &format!("a whole number for {leaf}"))
                    .and(None)
            }
        };
        let v = match n.as_count_in(&leaf, min, Some(max)) {
            Ok(v) => v,
            Err(d) => {
                // Negative or past the limit: the fix is the nearest value allowed.
                let nearest = if n.value < 0.0 { min } else { max };
                let fixable = d.code == "E0903" && (n.value < 0.0 || n.value > max as f64);
                self.diags
                    .push(if fixable { d.fix([(path, nearest)]) } else { d });
                return None;
            }
        };
        let (message, label, help) = if v > max {
            let message = format!("{leaf} = {v} is more than parc supports ({max})");
            (
                message,
                "too large",
                format!("use a {leaf} of at most {max}"),
            )
        } else if v < min {
            let message = format!("{leaf} must be at least {min}, found {v}");
            (message, "too small", format!("set {leaf} to {min} or more"))
        } else {
            return Some(v);
        };
        let error = Diagnostic::error("E0903", message).label(n.span, label);
        self.diags
            .push(error.help(help).fix([(path, v.clamp(min, max))]));
        None
    }

    pub fn float(&mut self, path: &str) -> Option<f64> {
        match self.value(path)? {
            SVal::Num(n) if n.value >= 0.0 && n.unit == Unit::None => Some(n.value),
            SVal::Num(n) if n.unit != Unit::None => {
                let leaf = path.rsplit('.').next().unwrap_or(path);
                self.diags.push(
                    Diagnostic::error(
                        "E0908",
                        format!("{leaf} must be a plain number, not {}", n.unit.describe()),
                    )
                    .label(n.span, "this value")
                    .help(format!("write {leaf} without a unit")),
                );
                None
            }
            SVal::Num(n) => {
                let leaf = path.rsplit('.').next().unwrap_or(path);
                self.diags.push(
                    Diagnostic::error("E0903", format!("{leaf} must be a plain number ≥ 0"))
                        .label(n.span, "this value")
                        .help(format!("write {leaf} as a plain non-negative number")),
                );
                None
            }
            SVal::Word(w, s) => self.unknown_const(&w, s).and(None),
            other => self.wrong(&other, "a number").and(None),
        }
    }

    /// Whether `n`, the cluster's hardware (a GPU's memory or FLOP/s, a link's bandwidth), is a
    /// plain number too small to be meant in base units: E0908 pushed.
    fn unit_left_out(&mut self, path: &str, n: &Number, unit: Unit) -> bool {
        let leaf = path.rsplit('.').next().unwrap_or(path);
        let found = n
            .unitless_too_small(leaf, unit)
            .filter(|_| path.starts_with("cluster."));
        let left_out = found.is_some();
        if let Some(d) = found {
            self.diags.push(d);
        }
        left_out
    }

    pub fn measure(&mut self, path: &str, unit: Unit) -> Option<f64> {
        let leaf = path.rsplit('.').next().unwrap_or(path).to_string();
        match self.value(path)? {
            SVal::Num(n) if self.unit_left_out(path, &n, unit) => None,
            SVal::Num(n) => match n.as_measure(&leaf, unit) {
                Ok(v) if v > 0.0 => Some(v),
                Ok(_) => {
                    self.diags.push(
                        Diagnostic::error("E0903", format!("{leaf} must be positive"))
                            .label(n.span, "not positive")
                            .help(format!("give {leaf} as {}", unit.describe())),
                    );
                    None
                }
                Err(d) => {
                    self.diags.push(d);
                    None
                }
            },
            other => self.wrong(&other, unit.describe()).and(None),
        }
    }

    pub fn flag(&mut self, path: &str) -> Option<bool> {
        match self.value(path)? {
            SVal::Bool(b, _) => Some(b),
            other => self.wrong(&other, "`true` or `false`").and(None),
        }
    }

    /// One of `allowed` words.
    pub fn word(&mut self, path: &str, allowed: &[&str]) -> Option<(String, Span)> {
        let leaf = path.rsplit('.').next().unwrap_or(path).to_string();
        match self.value(path)? {
            SVal::Word(w, s) if allowed.contains(&w.as_str()) => Some((w, s)),
            v => {
                let got = match &v {
                    SVal::Word(w, _) | SVal::Str(w, _) => w.clone(),
                    SVal::Num(n) => n.value.to_string(),
                    _ => "this".into(),
                };
                let one_of = format!("{leaf} is one of {}", suggest::one_of(allowed));
                let help = match &v {
                    SVal::Str(w, _) if allowed.contains(&w.as_str()) => {
                        format!("write it without quotes: `{w}`")
                    }
                    _ => suggest::help(&got, allowed.iter().copied(), &one_of),
                };
                self.diags.push(
                    Diagnostic::error("E0904", format!("`{got}` is not a valid {leaf}"))
                        .label(v.span(), "unknown value")
                        .help(help),
                );
                None
            }
        }
    }

    pub(super) fn reject_fields(&mut self, prefix: &str, allowed: &[&str], tag: &str) {
        let p = format!("{prefix}.");
        let extra: Vec<(String, Span)> = self
            .settings
            .values
            .iter()
            .filter(|(k, _)| k.starts_with(&p))
            .filter(|(k, _)| !allowed.contains(&&k[p.len()..]))
            .map(|(k, e)| (k[p.len()..].to_string(), e.span))
            .collect();
        for (field, span) in extra {
            self.diags.push(
                Diagnostic::error("E0203", format!("`{tag}` has no field `{field}`"))
                    .label(span, "not a field of this choice")
                    .help(if allowed.is_empty() {
                        format!("`{tag}` takes no fields")
                    } else {
                        format!("`{tag}` takes {}", suggest::one_of(allowed))
                    }),
            );
        }
    }
}

/// The largest value a counted setting may have: far above any real job, low enough that every
/// product the cost model and lowering form stays inside 64 bits.
pub fn limit(path: &str) -> u64 {
    match path {
        "parallel.dp"
        | "parallel.pp"
        | "parallel.cp"
        | "parallel.tp"
        | "cluster.nodes"
        | "cluster.gpus_per_node" => 1 << 16,
        "parallel.microbatches" | "parallel.virtual" => 1 << 16,
        "train.micro_batch" => 1 << 20,
        "train.global_batch" => 1 << 32,
        _ => 1 << 48,
    }
}

/// The most ranks (GPUs) a mesh or a cluster may have: far above any real job (the largest
/// published runs use about 2^17 GPUs), low enough that rank numbers and every per-rank
/// product stay inside 32 and 64 bits.
pub const MAX_WORLD: u64 = 1 << 20;

/// E0903 where the product of `sizes` (settings by path, each within its own limit) passes
/// [`MAX_WORLD`]: `what` names the product, the settings above 1 are labelled (else the
/// section, `span`). (Four axes of up to 2^16 each multiply past u32, which rank numbers are.)
fn too_many_ranks(r: &mut Reader, what: &str, sizes: &[(String, u32)], span: Span) {
    let world: u64 = sizes.iter().map(|(_, n)| u64::from(*n)).product();
    if world <= MAX_WORLD {
        return;
    }
    let mut d = Diagnostic::error(
        "E0903",
        format!("{what} has {world} ranks, more than parc supports ({MAX_WORLD})"),
    );
    let mut labelled = false;
    for (path, n) in sizes.iter().filter(|(_, n)| *n > 1) {
        if let Some(at) = r.span(path) {
            let leaf = path.rsplit('.').next().unwrap_or(path);
            d = d.label(at, format!("{leaf} = {n}"));
            labelled = true;
        }
    }
    if !labelled {
        d = d.label(span, format!("{world} ranks"));
    }
    r.diags.push(d.help(format!(
        "use at most {MAX_WORLD} GPUs: smaller dp, pp, cp or tp, fewer nodes or GPUs per node"
    )));
}

/// What the parallel section says, before the cross-checks.
pub struct ParallelIn {
    pub parallel: Parallel,
    /// The microbatch count was written (not derived from the batch rule).
    pub microbatches_given: bool,
    /// Axes the user allows to span nodes (`cross_node = [tp]`).
    pub cross_node: Vec<Axis>,
    /// `layers = [4, 3, 3, 2]` as written (its counts are checked against the pipeline later).
    pub layers: Option<GivenLayers>,
    /// Where `balance` was written, and what it says.
    pub balance: Option<(Balance, Span)>,
}

/// The per-chunk layer counts of `parallel.layers`, each with its place in the text.
pub struct GivenLayers {
    pub counts: Vec<u32>,
    pub spans: Vec<Span>,
    /// The whole list.
    pub span: Span,
}

pub fn parallel(r: &mut Reader, span: Span) -> ParallelIn {
    let mut axes: Vec<(Axis, u32)> = Vec::new();
    let mut order: Vec<Axis> = r.settings.mesh_order.clone();
    // Axes the file does not name have size 1; put them first, in the default order.
    for a in [Axis::Tp, Axis::Cp, Axis::Pp, Axis::Dp] {
        if !order.contains(&a) {
            order.insert(0, a);
        }
    }
    for a in order {
        let n = r
            .count(&format!("parallel.{}", a.name()), 1)
            .map(|v| v.min(u64::from(u32::MAX)) as u32)
            .unwrap_or(1);
        axes.push((a, n));
    }
    let mesh = Mesh { axes };
    let sizes: Vec<(String, u32)> = (mesh.axes.iter())
        .map(|(a, n)| (format!("parallel.{}", a.name()), *n))
        .collect();
    too_many_ranks(r, "the mesh (dp × pp × cp × tp)", &sizes, span);
    let zero = match r.count("parallel.zero", 0) {
        None | Some(0) => ZeroStage::Zero0,
        Some(1) => ZeroStage::Zero1,
        Some(2) => ZeroStage::Zero2,
        Some(3) => ZeroStage::Zero3,
        Some(z) => {
            let span = r.span("parallel.zero").unwrap_or(span);
            r.diags.push(
                Diagnostic::error("E0903", format!("there is no ZeRO stage {z}"))
                    .label(span, "unknown stage")
                    .help("zero is 0 (replicated), 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters)"),
            );
            ZeroStage::Zero0
        }
    };
    let microbatches = r.count("parallel.microbatches", 1);
    let virtual_stages = r.count("parallel.virtual", 1);
    let schedule = match r.word("parallel.schedule", &["gpipe", "1f1b", "interleaved"]) {
        Some((w, _)) if w == "gpipe" => PipelineSchedule::Gpipe,
        Some((w, _)) if w == "interleaved" => PipelineSchedule::Interleaved {
            virtual_stages: virtual_stages.unwrap_or(2).min(u64::from(u32::MAX)) as u32,
        },
        _ => PipelineSchedule::OneFOneB,
    };
    // `virtual: 1` is one chunk per stage: what every other schedule runs, so no warning.
    if let (Some(v), Some(s)) = (virtual_stages, r.span("parallel.virtual")) {
        if v > 1 && !matches!(schedule, PipelineSchedule::Interleaved { .. }) {
            r.diags.push(
                Diagnostic::warning(
                    "W0502",
                    "`virtual` only matters for the interleaved schedule",
                )
                .label(s, "ignored")
                .help("set `pipeline = interleaved { virtual: 2 }`, or remove `virtual` (or set it to 1)"),
            );
        }
    }
    let recompute = recompute(r);
    let sequence_parallel = r.flag("parallel.sequence_parallel").unwrap_or(false);
    let sp_save = match r.word("parallel.sp_save", &["sharded", "gathered"]) {
        Some((w, _)) if w == "gathered" => SpSave::Gathered,
        _ => SpSave::Sharded,
    };
    let bucket_bytes = r
        .measure("parallel.bucket", Unit::Bytes)
        .map(|b| b as u64)
        .unwrap_or(25 * 1024 * 1024);
    let mut cross_node = Vec::new();
    if let Some(v) = r.value("parallel.cross_node") {
        let items = match v {
            SVal::List(xs, _) => xs,
            one => vec![one],
        };
        for item in items {
            match item {
                SVal::Word(w, _) if w == "tp" => cross_node.push(Axis::Tp),
                SVal::Word(w, _) if w == "cp" => cross_node.push(Axis::Cp),
                other => {
                    r.diags.push(
                        Diagnostic::error(
                            "E0904",
                            "cross_node lists the axes allowed to span nodes: `tp`, `cp`",
                        )
                        .label(other.span(), "not tp or cp")
                        .help("write `cross_node = [tp]`"),
                    );
                }
            }
        }
    }
    let balance = balance_word(r);
    let layers = given_layers(r);
    ParallelIn {
        parallel: Parallel {
            mesh,
            zero,
            schedule,
            microbatches: microbatches.unwrap_or(0).min(u64::from(u32::MAX)) as u32,
            recompute,
            sequence_parallel,
            sp_save,
            bucket_bytes,
            balance: match layers {
                Some(_) => Balance::Given,
                None => balance.map_or(Balance::Even, |(b, _)| b),
            },
            chunk_layers: layers
                .as_ref()
                .map(|l| l.counts.clone())
                .unwrap_or_default(),
            cross_node: cross_node.clone(),
            span,
        },
        microbatches_given: microbatches.is_some(),
        cross_node,
        layers,
        balance,
    }
}

/// `parallel.balance` as written: `even` or `auto`, and where.
fn balance_word(r: &mut Reader) -> Option<(Balance, Span)> {
    let (word, span) = r.word("parallel.balance", &["even", "auto"])?;
    let balance = if word == "auto" {
        Balance::Auto
    } else {
        Balance::Even
    };
    Some((balance, span))
}

/// `parallel.layers`: a list of whole numbers (whether they fit the pipeline is
/// `grid::Grid::pipeline_layers`'s to say).
fn given_layers(r: &mut Reader) -> Option<GivenLayers> {
    let (items, span) = match r.value("parallel.layers")? {
        SVal::List(items, span) => (items, span),
        other => {
            let what = "a list of layer counts, one per pipeline chunk, like `[4, 3, 3, 2]`";
            return r.wrong(&other, what).and(None);
        }
    };
    let mut out = GivenLayers {
        counts: Vec::new(),
        spans: Vec::new(),
        span,
    };
    let mut valid = true;
    for item in items {
        let at = item.span();
        let count = match item {
            SVal::Num(n) => n
                .as_count("a layer count")
                .map_err(|d| r.diags.push(d))
                .ok(),
            other => r.wrong(&other, "a layer count").and(None),
        };
        match count {
            Some(c) => {
                out.counts.push(c.min(u64::from(u32::MAX)) as u32);
                out.spans.push(at);
            }
            None => valid = false,
        }
    }
    valid.then_some(out)
}

/// `parallel.recompute`'s words that are modes, not layer names.
const RECOMPUTE_MODES: [&str; 3] = ["none", "selective", "full"];

fn recompute(r: &mut Reader) -> Recompute {
    match r.value("parallel.recompute") {
        None => Recompute::None,
        Some(SVal::Word(w, s)) => match w.as_str() {
            "none" => Recompute::None,
            "selective" => Recompute::Selective,
            "full" => Recompute::Full,
            _ => Recompute::Named(vec![w]).with_span(r, s),
        },
        Some(SVal::Str(w, s)) if RECOMPUTE_MODES.contains(&w.as_str()) => {
            r.diags.push(
                Diagnostic::error(
                    "E0904",
                    format!("`\"{w}\"` is a string, not a recompute mode"),
                )
                .label(s, "quoted")
                .help(format!("write it without quotes: `recompute = {w}`")),
            );
            Recompute::None
        }
        Some(SVal::List(xs, _)) => {
            let mut names = Vec::new();
            for x in xs {
                match x {
                    SVal::Word(w, _) | SVal::Str(w, _) => names.push(w),
                    other => {
                        r.wrong(&other, "a layer kind or path");
                    }
                }
            }
            Recompute::Named(names)
        }
        Some(other) => {
            r.wrong(&other, "`none`, `selective`, `full` or a list of layers");
            Recompute::None
        }
    }
}

trait WithSpan {
    fn with_span(self, r: &mut Reader, s: Span) -> Self;
}

impl WithSpan for Recompute {
    /// A single unknown word: most likely a typo of one of the modes.
    fn with_span(self, r: &mut Reader, s: Span) -> Recompute {
        if let Recompute::Named(names) = &self {
            let w = names.first().map(String::as_str).unwrap_or("");
            if let Some(c) = suggest::closest(w, RECOMPUTE_MODES) {
                r.diags.push(
                    Diagnostic::error("E0904", format!("`{w}` is not a recompute mode"))
                        .label(s, "unknown mode")
                        .help(format!(
                            "did you mean `{c}`? (a list like `[Attention]` names layers)"
                        )),
                );
                return Recompute::None;
            }
        }
        self
    }
}

pub fn train(r: &mut Reader, span: Span, gpu_is_cpu: bool) -> Option<Train> {
    let global_batch = r.count("train.global_batch", 1);
    if r.span("train.global_batch").is_none() {
        r.diags.push(
            Diagnostic::error(
                "E0206",
                "`train` needs `global_batch` (sequences per optimizer step)",
            )
            .label(span, "in this section")
            .help("add `global_batch = 8` (global_batch = micro_batch × microbatches × dp)"),
        );
    }
    let micro_batch = r.count("train.micro_batch", 1).unwrap_or(1);
    let precision = precision(r, gpu_is_cpu);
    let fp32_residual = precision == Precision::Bf16 && residual_is_fp32(r);
    let optimizer = optimizer(r);
    let steps = match r.span("train.steps") {
        Some(_) => r.count("train.steps", 1).unwrap_or(1),
        None => {
            r.diags.push(
                Diagnostic::error("E0206", "`train` needs `steps` (optimizer steps to run)")
                    .label(span, "in this section")
                    .help("add `steps = 1000`"),
            );
            1
        }
    };
    let schedule = lr_schedule(r, steps);
    schedule_bounds(r, &schedule, optimizer.lr(), steps);
    warmup_past_end(r, &schedule, steps);
    let grad_clip = r.float("train.grad_clip").filter(|c| *c > 0.0);
    let data = data(r, "train.data");
    let seed = r.count("train.seed", 0).unwrap_or(0);
    let init = init(r);
    let checkpoint =
        if r.span("train.checkpoint.every").is_some() || r.span("train.checkpoint.dir").is_some() {
            Some(Checkpointing {
                every: r.count("train.checkpoint.every", 1).unwrap_or(1000),
                dir: match r.value("train.checkpoint.dir") {
                    Some(SVal::Str(s, _)) => s,
                    Some(other) => {
                        r.wrong(&other, "a folder name string like \"ckpt/\"");
                        "checkpoints".into()
                    }
                    None => "checkpoints".into(),
                },
                keep: r
                    .count("train.checkpoint.keep", 0)
                    .unwrap_or(0)
                    .min(u64::from(u32::MAX)) as u32,
                asynchronous: r.flag("train.checkpoint.async").unwrap_or(true),
            })
        } else {
            None
        };
    let log_every = r.count("train.log_every", 1).unwrap_or(1);
    let eval = eval(r);
    let sample = sample(r);
    let on_nonfinite = on_nonfinite(r);
    Some(Train {
        global_batch: global_batch?,
        micro_batch,
        precision,
        fp32_residual,
        optimizer,
        schedule,
        grad_clip,
        data,
        steps,
        seed,
        init,
        checkpoint,
        log_every,
        eval,
        sample,
        on_nonfinite,
        // `check::fp8` reads the recipe into it.
        fp8: None,
        span,
    })
}

/// `train.on_nonfinite = stop | skip { max: N }` (default `stop`).
fn on_nonfinite(r: &mut Reader) -> OnNonFinite {
    match r.word("train.on_nonfinite", &["stop", "skip"]) {
        Some((w, at)) if w == "skip" => {
            r.reject_fields("train.on_nonfinite", &["max"], "skip");
            if r.span("train.on_nonfinite.max").is_none() {
                r.diags.push(
                    Diagnostic::error("E0206", "`skip` needs `max` (steps it may skip in the run)")
                        .label(at, "here")
                        .help("write `on_nonfinite = skip { max: 10 }`"),
                );
            }
            let max = r.count("train.on_nonfinite.max", 0).unwrap_or(0);
            OnNonFinite::Skip { max }
        }
        _ => {
            r.reject_fields("train.on_nonfinite", &[], "stop");
            OnNonFinite::Stop
        }
    }
}

/// `train.sample = { every: N, prompt: "…", tokens: 64, temperature: 1, top_k: 40 }`, when
/// any of it is written. Whether the prompt fits the model's `seq` is `grid::sample_prompt`'s.
fn sample(r: &mut Reader) -> Option<Sampling> {
    let first = ["every", "prompt", "tokens", "temperature", "top_k"]
        .iter()
        .find_map(|f| r.span(&format!("train.sample.{f}")))?;
    let span = r.span("train.sample.prompt").unwrap_or(first);
    let needs = |field: &str, example: &str| {
        Diagnostic::error("E0206", format!("`train.sample` needs `{field}`"))
            .label(first, "in this setting")
            .help(format!("add `{field}: {example}`"))
    };
    if r.span("train.sample.every").is_none() {
        r.diags.push(needs("every", "100"));
    }
    let every = r.count("train.sample.every", 1);
    let prompt = match r.value("train.sample.prompt") {
        Some(SVal::Str(text, at)) if text.is_empty() => {
            r.diags.push(
                Diagnostic::error("E0903", "the sample prompt is empty")
                    .label(at, "empty")
                    .help("write the text the model continues, like `prompt: \"To be\"`"),
            );
            None
        }
        Some(SVal::Str(text, _)) => Some(text),
        Some(other) => r.wrong(&other, "the prompt as a string").and(None),
        None => {
            r.diags.push(needs("prompt", "\"To be\""));
            None
        }
    };
    let tokens = match r.span("train.sample.tokens") {
        Some(_) => r.count("train.sample.tokens", 1),
        None => Some(64),
    };
    let temperature = match r.span("train.sample.temperature") {
        Some(_) => r.float("train.sample.temperature"),
        None => Some(1.0),
    };
    let top_k = match r.span("train.sample.top_k") {
        Some(_) => r.count("train.sample.top_k", 1).map(Some),
        None => Some(None),
    };
    Some(Sampling {
        every: every?,
        prompt: prompt?,
        tokens: tokens?,
        temperature: temperature?,
        top_k: top_k?,
        span,
    })
}

/// `train.eval = { every: N, batches: K, data: … }`, when any of its fields is written.
fn eval(r: &mut Reader) -> Option<Eval> {
    let fields = ["every", "batches", "data"].map(|f| format!("train.eval.{f}"));
    let at = fields.iter().find_map(|path| r.span(path))?;
    let every = match r.span("train.eval.every") {
        Some(_) => r.count("train.eval.every", 0).and_then(|n| {
            positive(
                r,
                "every",
                n,
                "`every: N` evaluates after every N-th step and the last: write e.g. `every: 100`",
            )
        }),
        None => {
            r.diags.push(
                Diagnostic::error("E0206", "`eval` needs `every` (steps between evaluations)")
                    .label(at, "evaluation asked for here")
                    .help("write `eval = { every: 100 }`"),
            );
            None
        }
    };
    let batches = match r.span("train.eval.batches") {
        Some(_) => r.count("train.eval.batches", 0).and_then(|n| {
            positive(
                r,
                "batches",
                n,
                "`batches: K` evaluates on K global batches: write e.g. `batches: 8` (the default)",
            )
        }),
        None => Some(Eval::DEFAULT_BATCHES),
    };
    let data = r
        .span("train.eval.data")
        .map(|_| data(r, "train.eval.data"));
    Some(Eval {
        every: every?,
        batches: batches?,
        data,
        span: at,
    })
}

/// `n` when it is at least 1; else an E0903 on `train.eval.FIELD` whose help says what the
/// field means (`meaning`, with an example), or to remove `eval` to not evaluate.
fn positive(r: &mut Reader, field: &str, n: u64, meaning: &str) -> Option<u64> {
    if n > 0 {
        return Some(n);
    }
    let span = r.span(&format!("train.eval.{field}")).unwrap_or_default();
    r.diags.push(
        Diagnostic::error("E0903", format!("eval's `{field}` must be at least 1"))
            .label(span, "zero")
            .help(format!("{meaning}, or remove `eval` to not evaluate")),
    );
    None
}

fn precision(r: &mut Reader, gpu_is_cpu: bool) -> Precision {
    let default = if gpu_is_cpu {
        Precision::Fp32
    } else {
        Precision::Bf16
    };
    match r.word("train.precision", &["fp32", "bf16", "fp16"]) {
        None => {
            // An unknown word is E0904's: its fields are not judged as another choice's.
            if r.settings.get("train.precision").is_none() {
                r.reject_fields("train.precision", &[], "precision");
            }
            default
        }
        Some((w, _)) if w == "fp32" => {
            r.reject_fields("train.precision", &[], "fp32");
            Precision::Fp32
        }
        Some((w, _)) if w == "bf16" => {
            r.reject_fields("train.precision", &["residual"], "bf16");
            Precision::Bf16
        }
        Some(_) => {
            r.reject_fields(
                "train.precision",
                &[
                    "loss_scale",
                    "loss_scale.init",
                    "loss_scale.window",
                    "loss_scale.hysteresis",
                    "loss_scale.min",
                ],
                "fp16",
            );
            let loss_scale = match r.value("train.precision.loss_scale") {
                // A static scale multiplies f32 gradients as a dynamic one does: above f32's
                // largest value it is infinite, and every step would overflow and be skipped.
                Some(SVal::Num(n))
                    if n.value > 0.0 && n.value <= f64::from(f32::MAX) && n.unit == Unit::None =>
                {
                    LossScale::Static { scale: n.value }
                }
                Some(SVal::Word(w, s)) if w != "dynamic" => {
                    r.diags.push(
                        Diagnostic::error("E0904", format!("`{w}` is not a loss scale"))
                            .label(s, "here")
                            .help("use `dynamic`, `dynamic { init: 65536, window: 2000 }` or a number"),
                    );
                    LossScale::Static { scale: 1.0 }
                }
                Some(SVal::Num(n)) => {
                    r.diags.push(
                        Diagnostic::error(
                            "E0903",
                            format!(
                                "a static loss scale must be a plain number above 0 and at \
                                 most {:e} (f32's largest)",
                                f32::MAX
                            ),
                        )
                        .label(n.span, "here")
                        .help("use e.g. 1024, or `dynamic`"),
                    );
                    LossScale::Static { scale: 1.0 }
                }
                _ => LossScale::Dynamic {
                    init: r
                        .float("train.precision.loss_scale.init")
                        .unwrap_or(65536.0),
                    window: r
                        .count("train.precision.loss_scale.window", 1)
                        .unwrap_or(2000) as u32,
                    hysteresis: r
                        .count("train.precision.loss_scale.hysteresis", 1)
                        .unwrap_or(2) as u32,
                    min: r.float("train.precision.loss_scale.min").unwrap_or(1.0),
                },
            };
            check_loss_scale(r, loss_scale);
            Precision::Fp16 { loss_scale }
        }
    }
}

/// `bf16 { residual: fp32 }`: the residual stream stored f32 (default `bf16`).
fn residual_is_fp32(r: &mut Reader) -> bool {
    r.word("train.precision.residual", &["fp32", "bf16"])
        .is_some_and(|(w, _)| w == "fp32")
}

/// A dynamic loss scale must start, and stay, inside f32's range above zero (the scale
/// multiplies f32 gradients: 0 would erase them for good, past f32's largest value every step
/// would overflow), and its `min` may not exceed its `init`.
fn check_loss_scale(r: &mut Reader, loss_scale: LossScale) {
    let LossScale::Dynamic { init, min, .. } = loss_scale else {
        return;
    };
    let largest = f64::from(f32::MAX);
    let mut valid = true;
    for (field, value) in [("init", init), ("min", min)] {
        let path = format!("train.precision.loss_scale.{field}");
        if value > 0.0 && value <= largest {
            continue;
        }
        valid = false;
        if let Some(span) = r.span(&path) {
            r.diags.push(
                Diagnostic::error(
                    "E0903",
                    format!("the loss scale's {field} must be above 0 and at most {largest:e}"),
                )
                .label(span, "this value")
                .help(format!(
                    "fp16 scales gradients by it; use e.g. {field}: {}",
                    if field == "init" { 65536 } else { 1 }
                )),
            );
        }
    }
    if valid && min > init {
        let span = r
            .span("train.precision.loss_scale.min")
            .or_else(|| r.span("train.precision.loss_scale.init"));
        if let Some(span) = span {
            r.diags.push(
                Diagnostic::error(
                    "E0903",
                    format!("the loss scale's min ({min}) is above its init ({init})"),
                )
                .label(span, "this value")
                .help(format!(
                    "set min to at most {init}, or init to at least {min}"
                )),
            );
        }
    }
}

fn optimizer(r: &mut Reader) -> Optimizer {
    let kind = r.word("train.optimizer", &["adamw", "sgd"]).map(|(w, _)| w);
    let lr = r.float("train.optimizer.lr");
    let weight_decay = r.float("train.optimizer.weight_decay");
    if kind.as_deref() == Some("sgd") {
        r.reject_fields(
            "train.optimizer",
            &["lr", "momentum", "weight_decay"],
            "sgd",
        );
        return Optimizer::Sgd {
            lr: lr.unwrap_or(0.01),
            momentum: r.float("train.optimizer.momentum").unwrap_or(0.0),
            weight_decay: weight_decay.unwrap_or(0.0),
        };
    }
    if kind.is_some() || r.settings.get("train.optimizer").is_none() {
        r.reject_fields(
            "train.optimizer",
            &["lr", "betas", "eps", "weight_decay"],
            "adamw",
        );
    }
    let (beta1, beta2) = match r.value("train.optimizer.betas") {
        None => (0.9, 0.999),
        Some(SVal::List(xs, s)) => match xs.as_slice() {
            [SVal::Num(a), SVal::Num(b)]
                if (0.0..1.0).contains(&a.value) && (0.0..1.0).contains(&b.value) =>
            {
                (a.value, b.value)
            }
            _ => {
                r.diags.push(
                    Diagnostic::error("E0903", "betas are two numbers in [0, 1)")
                        .label(s, "here")
                        .help("write `betas: (0.9, 0.95)`"),
                );
                (0.9, 0.999)
            }
        },
        Some(other) => {
            r.wrong(&other, "two numbers `(0.9, 0.95)`");
            (0.9, 0.999)
        }
    };
    Optimizer::AdamW {
        lr: lr.unwrap_or(3e-4),
        beta1,
        beta2,
        eps: r.float("train.optimizer.eps").unwrap_or(1e-8),
        weight_decay: weight_decay.unwrap_or(0.0),
    }
}

fn lr_schedule(r: &mut Reader, steps: u64) -> LrSchedule {
    let kind = r
        .word("train.schedule", &["constant", "cosine", "linear"])
        .map(|(w, _)| w);
    let warmup = r.count("train.schedule.warmup", 0).unwrap_or(0);
    match kind.as_deref() {
        Some("cosine") | Some("linear") => {
            let tag = kind.as_deref().unwrap_or("cosine");
            r.reject_fields("train.schedule", &["warmup", "min_lr", "decay_steps"], tag);
            let min_lr = r.float("train.schedule.min_lr").unwrap_or(0.0);
            let decay_steps = r.count("train.schedule.decay_steps", 1).unwrap_or(steps);
            if tag == "cosine" {
                LrSchedule::Cosine {
                    warmup,
                    min_lr,
                    decay_steps,
                }
            } else {
                LrSchedule::Linear {
                    warmup,
                    min_lr,
                    decay_steps,
                }
            }
        }
        _ => {
            if kind.is_some() || r.settings.get("train.schedule").is_none() {
                r.reject_fields("train.schedule", &["warmup"], "constant");
            }
            LrSchedule::Constant { warmup }
        }
    }
}

/// A decaying schedule's ends: `min_lr` above the peak `lr` would make the "decay" raise the
/// rate, and a `decay_steps` written at or below `warmup` would end the decay before it began
/// (the rate jumps from its peak to `min_lr` when warmup ends). Megatron-LM refuses both.
fn schedule_bounds(r: &mut Reader, schedule: &LrSchedule, lr: f64, steps: u64) {
    let (LrSchedule::Cosine {
        warmup,
        min_lr,
        decay_steps,
    }
    | LrSchedule::Linear {
        warmup,
        min_lr,
        decay_steps,
    }) = *schedule
    else {
        return;
    };
    if let Some(span) = r.span("train.schedule.min_lr").filter(|_| min_lr > lr) {
        r.diags.push(
            Diagnostic::error(
                "E0903",
                format!("min_lr = {min_lr} is above the peak lr = {lr}: the decay would raise it"),
            )
            .label(span, "the rate the schedule decays to")
            .help(format!(
                "set min_lr to at most lr = {lr} (often lr / 10 = {}), or raise \
                 train.optimizer.lr",
                lr / 10.0
            )),
        );
    }
    if let Some(span) = r
        .span("train.schedule.decay_steps")
        .filter(|_| decay_steps <= warmup)
    {
        r.diags.push(
            Diagnostic::error(
                "E0903",
                format!(
                    "decay_steps = {decay_steps} is not past warmup = {warmup}: the decay would \
                     be over before it starts"
                ),
            )
            .label(span, "counted from step 0, warmup included")
            .help(format!(
                "set decay_steps above warmup (e.g. {}: the training steps), or shorten warmup",
                steps.max(warmup + 1)
            )),
        );
    }
}

/// W0901: a warmup longer than the run, which then ends with the rate still rising and never
/// trains at the peak `lr`. A warning, not an error: a short smoke run (`--set train.steps=20`
/// on a spec with a real warmup) does this on purpose.
fn warmup_past_end(r: &mut Reader, schedule: &LrSchedule, steps: u64) {
    let (LrSchedule::Constant { warmup }
    | LrSchedule::Cosine { warmup, .. }
    | LrSchedule::Linear { warmup, .. }) = *schedule;
    let Some(span) = r.span("train.schedule.warmup").filter(|_| warmup > steps) else {
        return;
    };
    // The rate of step s (0-based) in warmup is lr × (s + 1) / warmup: the last step's share.
    let percent = (steps.saturating_mul(100) + warmup / 2) / warmup.max(1);
    let mut d = Diagnostic::warning(
        "W0901",
        format!(
            "warmup = {warmup} is longer than the run's {steps} steps: the run ends inside \
             warmup, at {percent}% of the peak lr, which it never reaches"
        ),
    )
    .label(span, "steps of rising learning rate");
    if let Some(steps_span) = r.span("train.steps") {
        d = d.label(steps_span, "the steps the run has");
    }
    r.diags.push(d.help(format!(
        "a short test run may ignore this; otherwise shorten warmup to at most {steps} (a few \
         percent of the run is usual: `warmup: {}`), or raise steps to at least {warmup}",
        (steps / 20).max(1)
    )));
}

/// The data source written at `path` (`train.data`, `train.eval.data`).
fn data(r: &mut Reader, path: &str) -> DataSource {
    if let Some(e) = r.settings.get(path) {
        if let Some(source) = super::data::call_source(&e.clone(), r.diags) {
            return source;
        }
    }
    match r.value(path) {
        None => DataSource::Synthetic,
        Some(SVal::Word(w, _)) if w == "synthetic" => DataSource::Synthetic,
        Some(SVal::File(path, fmt, span, fmt_span)) => {
            let format = match fmt.as_str() {
                "bytes" => DataFormat::Bytes,
                "u16" => DataFormat::U16,
                "u32" => DataFormat::U32,
                _ => {
                    r.diags.push(
                        Diagnostic::error("E0904", format!("`{fmt}` is not a data format"))
                            .label(fmt_span, "unknown format")
                            .help("use `as bytes` (text, one token per byte), `as u16` or `as u32` (token ids)"),
                    );
                    DataFormat::Bytes
                }
            };
            if path.is_empty() {
                r.diags.push(
                    Diagnostic::error("E0903", "the data file name is empty")
                        .label(span, "empty")
                        .help("write `data = \"data/train.bin\" as u16`"),
                );
            }
            DataSource::File { path, format, span }
        }
        Some(other) => {
            r.wrong(
                &other,
                "`\"file\" as bytes|u16|u32`, `text(\"file\", tokenizer: gpt2)` or `synthetic`",
            );
            DataSource::Synthetic
        }
    }
}

/// `train.init`: `seeded` (the default) or `hf("DIR")`, a Hugging Face checkpoint folder.
fn init(r: &mut Reader) -> InitFrom {
    let Some(e) = r.settings.get("train.init").cloned() else {
        return InitFrom::Seeded;
    };
    if e.as_word().is_some_and(|w| w.name == "seeded") {
        return InitFrom::Seeded;
    }
    let arg = match &e.kind {
        ExprKind::Call { callee, args } if callee.as_word().is_some_and(|f| f.name == "hf") => {
            args.first().filter(|_| args.len() == 1)
        }
        _ => None,
    };
    match arg {
        Some(Arg::Positional(Expr {
            kind: ExprKind::Str(path),
            span,
        })) if !path.is_empty() => InitFrom::Hf {
            path: path.clone(),
            span: *span,
        },
        _ => {
            r.diags.push(
                Diagnostic::error("E0904", "`train.init` is not a way to start a run")
                    .label(e.span, "here")
                    .help(
                        "write `init = hf(\"DIR\")` (a Hugging Face checkpoint folder: \
                         config.json and safetensors) or `init = seeded`",
                    ),
            );
            InitFrom::Seeded
        }
    }
}

pub fn cluster(r: &mut Reader, span: Span) -> Cluster {
    let nodes = r.count("cluster.nodes", 1).unwrap_or(1).min(1 << 20) as u32;
    let gpus_per_node = r
        .count("cluster.gpus_per_node", 1)
        .unwrap_or(1)
        .min(1 << 20) as u32;
    let sizes = [
        ("cluster.nodes".to_string(), nodes),
        ("cluster.gpus_per_node".to_string(), gpus_per_node),
    ];
    too_many_ranks(r, "the cluster (nodes × gpus_per_node)", &sizes, span);
    let mut names: Vec<&str> = gpu::NAMES.to_vec();
    names.push("custom");
    let gpu = match r.word("cluster.gpu", &names) {
        Some((w, s)) if w == "custom" => custom_gpu(r, s),
        Some((w, _)) => {
            r.reject_fields("cluster.gpu", &[], &w);
            gpu::lookup(&w).unwrap_or_else(custom_default)
        }
        None => gpu::lookup("cpu").unwrap_or_else(custom_default),
    };
    let intra = link(r, "cluster.intra", gpu::default_intra(&gpu.name));
    let inter = link(r, "cluster.inter", gpu::default_inter(&gpu.name));
    Cluster {
        nodes,
        gpus_per_node,
        gpu,
        intra,
        inter,
        span,
    }
}

fn custom_default() -> Gpu {
    Gpu {
        name: "custom".into(),
        memory_bytes: 0,
        peak_flops: 1.0,
        peak_flops_fp32: 1.0,
        peak_flops_fp8: None,
        memory_bandwidth: 1.0,
    }
}

fn custom_gpu(r: &mut Reader, span: Span) -> Gpu {
    r.reject_fields(
        "cluster.gpu",
        &["memory", "flops", "flops_fp32", "flops_fp8", "bandwidth"],
        "custom",
    );
    let need = |r: &mut Reader, field: &str, unit: Unit| -> f64 {
        let path = format!("cluster.gpu.{field}");
        if r.span(&path).is_none() {
            r.diags.push(
                Diagnostic::error("E0206", format!("a custom GPU needs `{field}`"))
                    .label(span, "custom GPU")
                    .help("write `gpu = custom { memory: 24 GB, flops: 165 TFLOP/s }`"),
            );
            return 1.0;
        }
        r.measure(&path, unit).unwrap_or(1.0)
    };
    let memory = need(r, "memory", Unit::Bytes);
    let flops = need(r, "flops", Unit::FlopsPerSec);
    let flops_fp32 = if r.span("cluster.gpu.flops_fp32").is_some() {
        r.measure("cluster.gpu.flops_fp32", Unit::FlopsPerSec)
            .unwrap_or(flops / 16.0)
    } else {
        flops / 16.0
    };
    // No FP8 tensor cores unless the spec gives their peak.
    let flops_fp8 = if r.span("cluster.gpu.flops_fp8").is_some() {
        r.measure("cluster.gpu.flops_fp8", Unit::FlopsPerSec)
    } else {
        None
    };
    let bandwidth = if r.span("cluster.gpu.bandwidth").is_some() {
        r.measure("cluster.gpu.bandwidth", Unit::BytesPerSec)
            .unwrap_or(1e12)
    } else {
        1e12
    };
    Gpu {
        name: "custom".into(),
        memory_bytes: memory as u64,
        peak_flops: flops,
        peak_flops_fp32: flops_fp32,
        peak_flops_fp8: flops_fp8,
        memory_bandwidth: bandwidth,
    }
}

fn link(r: &mut Reader, path: &str, default: Link) -> Link {
    let kind = match r.value(path) {
        None => return default_with(r, path, default),
        Some(SVal::Word(w, s)) => match gpu::link_latency(&w) {
            Some(_) => w,
            None => {
                r.diags.push(
                    Diagnostic::error("E0904", format!("`{w}` is not a link kind"))
                        .label(s, "unknown link")
                        .help("use nvlink, pcie, infiniband, roce, ethernet or shm"),
                );
                return default;
            }
        },
        Some(other) => {
            r.wrong(&other, "a link like `nvlink { bandwidth: 450 GB/s }`");
            return default;
        }
    };
    let latency = gpu::link_latency(&kind).unwrap_or(default.latency);
    default_with(r, path, gpu::link(&kind, default.bandwidth, latency))
}

fn default_with(r: &mut Reader, path: &str, mut l: Link) -> Link {
    r.reject_fields(path, &["bandwidth", "latency"], &l.kind.clone());
    if r.span(&format!("{path}.bandwidth")).is_some() {
        if let Some(b) = r.measure(&format!("{path}.bandwidth"), Unit::BytesPerSec) {
            l.bandwidth = b;
        }
    }
    if r.span(&format!("{path}.latency")).is_some() {
        if let Some(t) = r.measure(&format!("{path}.latency"), Unit::Seconds) {
            l.latency = t;
        }
    }
    l
}
