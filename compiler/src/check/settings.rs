//! The `parallel`, `train` and `cluster` sections as one flat map of dotted paths
//! (`parallel.tp`, `train.optimizer.lr`), with `--set` overrides applied on top. Records and
//! tagged values flatten into sub-paths (`pipeline = 1f1b { microbatches: 8, layers: [3, 1] }`
//! sets `parallel.schedule`, `parallel.microbatches` and `parallel.layers`), so the file and
//! `--set` address every value the same way.

use super::suggest;
use crate::diag::{Diagnostic, Diagnostics, Span};
use crate::spec::Axis;
use crate::syntax::ast::{Expr, ExprKind, Ident, Section};
use std::collections::BTreeMap;

/// Every path a section or `--set` may name (canonical spelling).
pub const PATHS: &[&str] = &[
    "parallel.dp",
    "parallel.pp",
    "parallel.cp",
    "parallel.tp",
    "parallel.zero",
    "parallel.schedule",
    "parallel.microbatches",
    "parallel.virtual",
    "parallel.layers",
    "parallel.balance",
    "parallel.recompute",
    "parallel.sequence_parallel",
    "parallel.sp_save",
    "parallel.bucket",
    "parallel.cross_node",
    "train.global_batch",
    "train.micro_batch",
    "train.precision",
    "train.precision.loss_scale",
    "train.precision.loss_scale.init",
    "train.precision.loss_scale.window",
    "train.precision.loss_scale.hysteresis",
    "train.precision.loss_scale.min",
    "train.precision.residual",
    "train.optimizer",
    "train.optimizer.lr",
    "train.optimizer.betas",
    "train.optimizer.eps",
    "train.optimizer.weight_decay",
    "train.optimizer.momentum",
    "train.schedule",
    "train.schedule.warmup",
    "train.schedule.min_lr",
    "train.schedule.decay_steps",
    "train.grad_clip",
    "train.data",
    "train.steps",
    "train.seed",
    "train.init",
    "train.checkpoint.every",
    "train.checkpoint.dir",
    "train.checkpoint.keep",
    "train.checkpoint.async",
    "train.log_every",
    "train.eval.every",
    "train.eval.batches",
    "train.eval.data",
    "train.sample.every",
    "train.sample.prompt",
    "train.sample.tokens",
    "train.sample.temperature",
    "train.sample.top_k",
    "train.on_nonfinite",
    "train.on_nonfinite.max",
    "train.fp8",
    "train.fp8.block_size",
    "train.fp8.grad",
    "train.fp8.scaling",
    "train.fp8.history",
    "train.fp8.quantize",
    "train.fp8.bf16",
    "train.fp8.fp8",
    "cluster.nodes",
    "cluster.gpus_per_node",
    "cluster.gpu",
    "cluster.gpu.memory",
    "cluster.gpu.flops",
    "cluster.gpu.flops_fp32",
    "cluster.gpu.flops_fp8",
    "cluster.gpu.bandwidth",
    "cluster.intra",
    "cluster.intra.bandwidth",
    "cluster.intra.latency",
    "cluster.inter",
    "cluster.inter.bandwidth",
    "cluster.inter.latency",
];

/// Other spellings of canonical paths.
fn canonical(path: &str) -> String {
    let p = path
        .strip_prefix("parallel.mesh.")
        .map(|axis| format!("parallel.{axis}"))
        .unwrap_or_else(|| path.to_string());
    match p.as_str() {
        "parallel.pipeline" => "parallel.schedule".into(),
        "parallel.pipeline.microbatches" | "parallel.schedule.microbatches" => {
            "parallel.microbatches".into()
        }
        "parallel.pipeline.virtual" | "parallel.schedule.virtual" => "parallel.virtual".into(),
        "parallel.pipeline.layers" | "parallel.schedule.layers" => "parallel.layers".into(),
        "parallel.pipeline.balance" | "parallel.schedule.balance" => "parallel.balance".into(),
        "parallel.sp" => "parallel.sequence_parallel".into(),
        _ => p,
    }
}

#[derive(Default)]
pub struct Settings {
    pub values: BTreeMap<String, Expr>,
    /// Mesh axes in the order the file wrote them (outermost first).
    pub mesh_order: Vec<Axis>,
    /// Spans of the sections, by name.
    pub sections: BTreeMap<String, Span>,
}

impl Settings {
    pub fn get(&self, path: &str) -> Option<&Expr> {
        self.values.get(path)
    }

    /// Read the sections of the main file.
    pub fn from_sections(sections: &[&Section], diags: &mut Diagnostics) -> Settings {
        let mut s = Settings::default();
        for sec in sections {
            let name = sec.name.name.as_str();
            if !matches!(name, "parallel" | "train" | "cluster") {
                let sections = ["parallel", "train", "cluster"];
                let all = "the sections are `model`, `parallel`, `train` and `cluster`";
                let help = suggest::did_you_mean(name, sections, all);
                diags.push(
                    Diagnostic::error("E0203", format!("unknown section `{name}`"))
                        .label(sec.name.span, "unknown section")
                        .help(help),
                );
                continue;
            }
            if let Some(first) = s.sections.insert(name.to_string(), sec.span) {
                diags.push(
                    Diagnostic::error("E0204", format!("section `{name}` is written twice"))
                        .label(sec.name.span, "again here")
                        .label(first, "first here")
                        .help("merge the two sections"),
                );
            }
            for setting in &sec.settings {
                let mut path = name.to_string();
                for seg in &setting.path {
                    path.push('.');
                    path.push_str(&seg.name);
                }
                let mut flat = Vec::new();
                flatten(&path, &setting.value, &mut flat);
                for (p, e) in flat {
                    let c = canonical(&p);
                    if !PATHS.contains(&c.as_str()) {
                        let span = path_span(setting.path.as_slice(), &e);
                        diags.push(
                            mesh_problem(&p, span).unwrap_or_else(|| unknown_path(&p, name, span)),
                        );
                        continue;
                    }
                    if let Some(axis) = axis_of(&c) {
                        if !s.mesh_order.contains(&axis) {
                            s.mesh_order.push(axis);
                        }
                    }
                    if s.values.contains_key(&c) {
                        diags.push(set_twice(&c, e.span));
                        continue;
                    }
                    s.values.insert(c, e);
                }
            }
        }
        s
    }

    /// Apply one `--set` override (already parsed). Returns false when the path is not a section
    /// path (the caller then tries the model's constants). A record that sets one path twice
    /// (`parallel.mesh={dp: 1, dp: 1}`) is E0204, as in a file; its first value is kept.
    pub fn apply_override(&mut self, path: &str, value: &Expr, diags: &mut Diagnostics) -> bool {
        let c = canonical(path);
        let mut flat = Vec::new();
        flatten(&c, value, &mut flat);
        // `--set parallel.mesh={dp: 2, tp: 2}`: a record for a path that only has sub-paths.
        let known = |p: &str| PATHS.contains(&canonical(p).as_str());
        let record_of_known =
            matches!(value.kind, ExprKind::Record(_)) && flat.iter().all(|(p, _)| known(p));
        if !known(&c) && !record_of_known {
            return false;
        }
        // A value replaces the path's whole value, fields included: `train.precision=bf16`
        // drops the file's `fp16 { loss_scale: … }`, and `parallel.mesh={tp: 2, dp: 4}` is the
        // whole mesh (the axes it leaves out are 1; its order is the rank order).
        let prefix = format!("{c}.");
        self.values.retain(|k, _| !k.starts_with(&prefix));
        if c == "parallel.mesh" {
            self.values.retain(|k, _| axis_of(k).is_none());
            self.mesh_order.clear();
        }
        // `layers` and `balance` spell one choice (how the pipeline splits the layers): setting
        // one replaces what the file said with the other.
        for (set, other) in [
            ("parallel.layers", "parallel.balance"),
            ("parallel.balance", "parallel.layers"),
        ] {
            if flat.iter().any(|(p, _)| canonical(p) == set) {
                self.values.remove(other);
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for (p, e) in flat {
            let pc = canonical(&p);
            if !seen.insert(pc.clone()) {
                diags.push(set_twice(&pc, e.span));
                continue;
            }
            if let Some(axis) = axis_of(&pc) {
                if !self.mesh_order.contains(&axis) {
                    self.mesh_order.push(axis);
                }
            }
            self.values.insert(pc, e);
        }
        true
    }
}

/// E0204 for a path given a second value at `span` (in a section, or in one `--set` record).
fn set_twice(path: &str, span: Span) -> Diagnostic {
    Diagnostic::error("E0204", format!("`{path}` is set twice"))
        .label(span, "set again here")
        .help("keep one of the two")
}

fn path_span(path: &[Ident], e: &Expr) -> Span {
    match (path.first(), path.last()) {
        (Some(a), Some(b)) => a.span.to(b.span),
        _ => e.span,
    }
}

fn axis_of(path: &str) -> Option<Axis> {
    match path {
        "parallel.dp" => Some(Axis::Dp),
        "parallel.pp" => Some(Axis::Pp),
        "parallel.cp" => Some(Axis::Cp),
        "parallel.tp" => Some(Axis::Tp),
        _ => None,
    }
}

/// A `mesh` that is not a record of the four axes' sizes (`mesh = 4`, `mesh = { ep: 2 }`): said
/// of the mesh, where E0203's "no setting `mesh`" would read as if `mesh` were not a setting.
/// `path` is the written path, before `canonical`; None for other paths.
pub fn mesh_problem(path: &str, span: Span) -> Option<Diagnostic> {
    let axes = ["dp", "pp", "cp", "tp"];
    if path == "parallel.mesh" {
        return Some(
            Diagnostic::error("E0902", "`mesh` is a record of axis sizes")
                .label(span, "not a record")
                .help("write the sizes by axis, outermost first: `mesh = { dp: 4, tp: 2 }`"),
        );
    }
    let axis = path.strip_prefix("parallel.mesh.")?;
    if axes.contains(&axis) {
        return None;
    }
    Some(
        Diagnostic::error("E0203", format!("the mesh has no axis `{axis}`"))
            .label(span, "unknown axis")
            .help(
                "the mesh's axes are dp, pp, cp and tp: parc has no other kind of parallelism \
                 (no expert parallelism)",
            ),
    )
}

/// The first mesh problem of a `--set PATH=VALUE` whose path no section has, if any.
pub fn override_mesh_problem(path: &str, value: &Expr, span: Span) -> Option<Diagnostic> {
    let mut flat = Vec::new();
    flatten(path, value, &mut flat);
    flat.iter().find_map(|(p, _)| mesh_problem(p, span))
}

/// The diagnostic for a path no section has.
pub fn unknown_path(path: &str, section: &str, span: Span) -> Diagnostic {
    let prefix = format!("{section}.");
    let valid: Vec<&str> = PATHS
        .iter()
        .filter(|p| p.starts_with(&prefix))
        .map(|p| &p[prefix.len()..])
        .collect();
    let leaf = path.strip_prefix(&prefix).unwrap_or(path);
    let has = format!("{section} has: {}", valid.join(", "));
    let help = match suggest::known_as(leaf) {
        Some((_, known)) => known,
        None => suggest::help(leaf, valid.iter().copied(), &has),
    };
    Diagnostic::error("E0203", format!("`{section}` has no setting `{leaf}`"))
        .label(span, "unknown setting")
        .help(help)
}

fn flatten(prefix: &str, e: &Expr, out: &mut Vec<(String, Expr)>) {
    match &e.kind {
        ExprKind::Tagged { tag, fields } => {
            out.push((
                prefix.to_string(),
                Expr {
                    kind: ExprKind::Path(vec![tag.clone()]),
                    span: tag.span,
                },
            ));
            for f in fields {
                flatten(&format!("{prefix}.{}", f.name.name), &f.value, out);
            }
        }
        ExprKind::Record(fields) => {
            for f in fields {
                flatten(&format!("{prefix}.{}", f.name.name), &f.value, out);
            }
        }
        _ => out.push((prefix.to_string(), e.clone())),
    }
}
