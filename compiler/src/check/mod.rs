//! The checker: from a parsed `.par` file (plus stdlib modules and `--set` overrides) to a
//! [`Spec`] and every diagnostic found on the way. Sections are checked independently, so an
//! error in one does not hide the others.
//!
//! Order: parse → load `use`d stdlib modules → apply overrides to the sections → elaborate the
//! model ([`model`]) → read `cluster`, `parallel`, `train` ([`sections`]) → cross-checks
//! ([`grid`]: mesh vs cluster, sharding, sequence splits, pipeline layers, batch rule, schedule,
//! placement, data, a text source's tokenizer ([`data`])) → recompute marks → the layers of
//! each pipeline chunk (`cost::balance`: even, as given, or the cost model's split).

mod data;
mod fixes;
mod fp8;
pub mod functions;
mod gpu;
mod grid;
mod layers;
mod model;
mod number;
mod rope;
mod sections;
mod settings;
mod suggest;
pub(crate) use suggest::closest as closest_name;
pub(crate) use suggest::past_the_last_layer;

use crate::diag::{Diagnostic, Diagnostics, FileId, Sources, Span};
use crate::overrides::Override;
use crate::spec::{Spec, Train};
use crate::stdlib;
use crate::syntax::ast::{BlockDef, Expr, File, FnDef, Ident, Item, LetDecl, ModelDef, UseDecl};
use crate::syntax::{parse_file, parse_value};
use number::Number;
use std::collections::HashMap;

pub use gpu::{lookup as gpu_named, NAMES as GPU_NAMES};
pub use settings::PATHS as SETTING_PATHS;

/// The names one module (the main file or a stdlib module) sees.
#[derive(Default)]
pub struct Namespace {
    /// File-level `let` constants.
    pub consts: HashMap<String, Number>,
    /// Blocks visible by name: `(module index, name in that module)`.
    pub blocks: HashMap<String, (usize, String)>,
    /// Blocks this module defines.
    pub defs: HashMap<String, BlockDef>,
    /// Where each imported block is named in this module's `use`.
    pub imports: HashMap<String, Span>,
    /// Functions in scope: the prelude's and this module's (`fn`).
    pub fns: functions::FnTable,
    /// This module's functions that have errors (reported; their uses stay quiet).
    pub broken_fns: Vec<String>,
}

/// `model.NAME` overrides, taken by the model's `let`s as they are evaluated.
#[derive(Default)]
pub struct Overrides {
    model: HashMap<String, Expr>,
}

impl Overrides {
    pub fn take(&mut self, path: &str) -> Option<Expr> {
        self.model.remove(path)
    }
}

/// A spec that later stages may still judge although checking failed: the only errors were the
/// batch arithmetic's (E0501), and this is the checked spec with its suggested fix applied.
#[derive(Clone, Debug)]
pub struct Assumed {
    pub spec: Spec,
    /// The fix assumed, in words: `global_batch = 6`.
    pub fix: String,
}

/// Parse and check `main` (already added to `sources`; stdlib modules and overrides are added as
/// sources by the checker). `Some(spec)` when there are no errors.
pub fn check(
    sources: &mut Sources,
    main: FileId,
    overrides: &[Override],
) -> (Option<Spec>, Diagnostics) {
    let (spec, diags, _) = check_assuming(sources, main, overrides);
    (spec, diags)
}

/// [`check`], and when its only errors are E0501 the spec with the batch fix assumed.
pub fn check_assuming(
    sources: &mut Sources,
    main: FileId,
    overrides: &[Override],
) -> (Option<Spec>, Diagnostics, Option<Assumed>) {
    let (spec, diags, assumed, _) = check_reading_cluster(sources, main, overrides);
    (spec, diags, assumed)
}

/// The `cluster` section of `main` with `overrides` as the checker reads it, whatever else
/// fails (`None` when the file does not parse): the search reads it to search a spec's own
/// cluster when the spec's own plan fails, and there is no `Spec`.
pub fn cluster_of(
    sources: &mut Sources,
    main: FileId,
    overrides: &[Override],
) -> Option<crate::spec::Cluster> {
    check_reading_cluster(sources, main, overrides).3
}

/// [`check_assuming`], and the cluster read (`None` when the file does not parse).
fn check_reading_cluster(
    sources: &mut Sources,
    main: FileId,
    overrides: &[Override],
) -> (
    Option<Spec>,
    Diagnostics,
    Option<Assumed>,
    Option<crate::spec::Cluster>,
) {
    let mut diags = Diagnostics::default();
    let text = sources
        .get(main)
        .map(|f| f.text.clone())
        .unwrap_or_default();
    let file = match parse_file(main, &text) {
        Ok(f) => f,
        Err(d) => {
            diags.push(d);
            return (None, diags, None, None);
        }
    };
    let prelude = load_prelude(sources, &mut diags);
    let mut ns: Vec<Namespace> = Vec::new();
    let mut loaded: HashMap<String, usize> = HashMap::new();
    let mut modules = Modules {
        sources,
        ns: &mut ns,
        loaded: &mut loaded,
        prelude: &prelude,
        diags: &mut diags,
    };
    modules.load(&file);

    let (mut sections, mut models) = (Vec::new(), Vec::new());
    for item in &file.items {
        match item {
            Item::Section(s) => sections.push(s),
            Item::Model(m) => models.push(m),
            Item::Use(_) | Item::Let(_) | Item::Block(_) | Item::Fn(_) => {}
        }
    }
    let mut settings = settings::Settings::from_sections(&sections, &mut diags);
    let mut model_overrides = Overrides::default();
    let first_override = sources.files.len() as u32;
    let override_spans = read_overrides(
        sources,
        overrides,
        &mut settings,
        &mut model_overrides,
        &mut diags,
    );

    let mut elaborated = elaborate(main, &models, &ns, &mut model_overrides, &mut diags);
    unknown_model_overrides(&models, &model_overrides, &override_spans, &mut diags);

    let mut consts = ns.first().map(|n| n.consts.clone()).unwrap_or_default();
    if let Some(e) = &elaborated {
        consts.extend(e.consts.iter().map(|(k, v)| (k.clone(), *v)));
    }
    let section_span = |name: &str| {
        settings
            .sections
            .get(name)
            .copied()
            .unwrap_or(Span::new(main, 0, 0))
    };
    let (parallel_span, train_span, cluster_span) = (
        section_span("parallel"),
        section_span("train"),
        section_span("cluster"),
    );
    let mut reader = sections::Reader {
        settings: &settings,
        consts: &consts,
        diags: &mut diags,
    };
    let cluster = sections::cluster(&mut reader, cluster_span);
    let mut pin = sections::parallel(&mut reader, parallel_span);
    let train: Option<Train> = if settings.sections.contains_key("train") {
        sections::train(&mut reader, train_span, cluster.gpu.name == "cpu").map(|mut t| {
            t.fp8 = fp8::fp8(&mut reader);
            t
        })
    } else {
        reader.diags.push(
            Diagnostic::error("E0206", "the file has no `train` section")
                .label(Span::new(main, 0, 0), "in this file")
                .help("add `train { global_batch = 8; steps = 100 }`"),
        );
        None
    };

    let spans = [parallel_span, train_span, cluster_span];
    check_grid(
        &settings,
        &mut diags,
        spans,
        &mut pin,
        &cluster,
        train.as_ref(),
        elaborated.as_mut(),
    );
    let mut diags = dedup(diags);
    grid::complete_mesh_fixes(&mut diags.items, &pin, &cluster, train.as_ref());
    let editable = fixes::Editable {
        sources,
        main,
        file: &file,
        overrides: first_override..first_override + overrides.len() as u32,
    };
    editable.retain(&mut diags.items);
    let read = cluster.clone();
    let (spec, diags, assumed) = conclude(diags, elaborated, pin, train, cluster);
    (spec, diags, assumed, Some(read))
}

/// The checks across sections and model: mesh against cluster, placement, batch arithmetic,
/// schedule, sharding, sequence, pipeline layers, data, sizes and recompute.
fn check_grid(
    settings: &settings::Settings,
    diags: &mut Diagnostics,
    [parallel_span, train_span, cluster_span]: [Span; 3],
    pin: &mut sections::ParallelIn,
    cluster: &crate::spec::Cluster,
    train: Option<&Train>,
    elaborated: Option<&mut model::Elaborated>,
) {
    let mut grid = grid::Grid {
        settings,
        diags,
        parallel_span,
        train_span,
        cluster_span,
    };
    grid.mesh_vs_cluster(&pin.parallel.mesh, cluster);
    grid.placement(&pin.parallel, cluster, &pin.cross_node);
    if let Some(t) = train {
        grid.batch(pin, t);
        grid.schedule(&pin.parallel, t);
    }
    if let Some(e) = elaborated {
        grid.sharding(e, &pin.parallel.mesh);
        grid.sequence(e, &pin.parallel);
        grid.pipeline_layers(e, pin);
        if let Some(t) = train {
            grid.data(e, t);
            grid::sample_prompt(&e.model, t, grid.diags);
            let span = settings
                .get("train.micro_batch")
                .map(|x| x.span)
                .unwrap_or(train_span);
            grid::sizes(&e.model, t, span, grid.diags);
        }
        let rspan = settings
            .get("parallel.recompute")
            .map(|x| x.span)
            .unwrap_or(parallel_span);
        grid::recompute(&mut e.model, &pin.parallel.recompute, rspan, grid.diags);
    }
}

/// Read the `--set` overrides: settings into `settings`, `model.…` ones into `model_overrides`
/// (their spans returned by path, for the ones the model turns out not to have).
fn read_overrides(
    sources: &mut Sources,
    overrides: &[Override],
    settings: &mut settings::Settings,
    model_overrides: &mut Overrides,
    diags: &mut Diagnostics,
) -> HashMap<String, Span> {
    let mut override_spans = HashMap::new();
    for o in overrides {
        let text = o.source_text();
        let id = sources.add(format!("--set {text}"), text.clone());
        let path_span = Span::new(id, 0, o.path.len());
        match parse_value(id, &text, o.path.len() + 1) {
            Ok(expr) => {
                if o.path.starts_with("model.") {
                    model_overrides.model.insert(o.path.clone(), expr);
                    override_spans.insert(o.path.clone(), path_span);
                } else if !settings.apply_override(&o.path, &expr, diags) {
                    diags.push(
                        settings::override_mesh_problem(&o.path, &expr, path_span)
                            .unwrap_or_else(|| unknown_override(&o.path, path_span, &[])),
                    );
                }
            }
            Err(d) => diags.push(d),
        }
    }
    override_spans
}

/// Elaborate the file's one model (E0206 without one, E0204 for each more).
fn elaborate(
    main: FileId,
    models: &[&ModelDef],
    ns: &[Namespace],
    model_overrides: &mut Overrides,
    diags: &mut Diagnostics,
) -> Option<model::Elaborated> {
    match models {
        [] => {
            diags.push(
                Diagnostic::error("E0206", "the file has no `model`")
                    .label(Span::new(main, 0, 0), "in this file")
                    .help("add `model name { … }`; see examples/tiny.par"),
            );
            None
        }
        [m, rest @ ..] => {
            for extra in rest {
                diags.push(
                    Diagnostic::error("E0204", "a file has one `model`")
                        .label(extra.name.span, "second model")
                        .label(m.name.span, "first model")
                        .help("put each model in its own file"),
                );
            }
            model::Elab::new(ns, model_overrides, diags).model(m)
        }
    }
}

/// The `model.…` overrides elaboration did not use: unknown, named with the model's `let`s.
fn unknown_model_overrides(
    models: &[&ModelDef],
    model_overrides: &Overrides,
    override_spans: &HashMap<String, Span>,
    diags: &mut Diagnostics,
) {
    let model_consts: Vec<String> = models
        .first()
        .map(|m| {
            m.stmts
                .iter()
                .filter_map(|s| match s {
                    crate::syntax::ast::Stmt::Let(l) => Some(format!("model.{}", l.name.name)),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let consts: Vec<&str> = model_consts.iter().map(String::as_str).collect();
    let mut left: Vec<_> = model_overrides.model.keys().cloned().collect();
    left.sort();
    for path in left {
        let span = override_spans.get(&path).copied().unwrap_or_default();
        diags.push(unknown_override(&path, span, &consts));
    }
}

/// The spec when there are no errors; when the only errors are the batch arithmetic's (E0501),
/// no spec but the spec with E0501's fix assumed, for later stages to judge.
fn conclude(
    diags: Diagnostics,
    elaborated: Option<model::Elaborated>,
    pin: sections::ParallelIn,
    train: Option<Train>,
    cluster: crate::spec::Cluster,
) -> (Option<Spec>, Diagnostics, Option<Assumed>) {
    let batch_only = diags
        .items
        .iter()
        .all(|d| !d.is_error() || d.code == "E0501");
    let assumed_batch = match &train {
        Some(t) if diags.has_errors() && batch_only => grid::assumed_batch(&pin, t),
        _ => None,
    };
    if diags.has_errors() && assumed_batch.is_none() {
        return (None, diags, None);
    }
    let spec = match (elaborated, train) {
        (Some(e), Some(train)) => {
            let mut spec = Spec {
                model: e.model,
                parallel: pin.parallel,
                train,
                cluster,
            };
            if let Some((global_batch, microbatches)) = assumed_batch {
                spec.train.global_batch = global_batch;
                spec.parallel.microbatches = microbatches;
            }
            crate::cost::balance::rebalance(&mut spec);
            Some(spec)
        }
        _ => None,
    };
    match (spec, assumed_batch) {
        (Some(spec), Some((global_batch, _))) => {
            let fix = format!("global_batch = {global_batch}");
            (None, diags, Some(Assumed { spec, fix }))
        }
        (spec, None) => (spec, diags, None),
        (None, Some(_)) => (None, diags, None),
    }
}

/// The same diagnostic found again (a block called once per layer) is shown once.
fn dedup(diags: Diagnostics) -> Diagnostics {
    let mut seen = std::collections::HashSet::new();
    let mut out = Diagnostics::default();
    for d in diags.items {
        let key = (
            d.code,
            d.message.clone(),
            d.labels.iter().map(|l| l.span).collect::<Vec<_>>(),
        );
        if seen.insert(key) {
            out.push(d);
        }
    }
    out
}

fn unknown_override(path: &str, span: Span, model_consts: &[&str]) -> Diagnostic {
    let mut all: Vec<&str> = settings::PATHS.to_vec();
    all.extend(model_consts);
    let valid = format!("valid paths: {}", all.join(", "));
    // A name another tool uses (`train.lr`, `parallel.tensor_model_parallel_size`) first.
    let known = suggest::known_as(path);
    let (help, close) = match known {
        Some((parc, said)) => (said, Some(parc)),
        None => (
            suggest::help(path, all.iter().copied(), &valid),
            suggest::closest(path, all.iter().copied()),
        ),
    };
    let d = Diagnostic::error("E0905", format!("`--set {path}`: no such setting"))
        .label(span, "unknown path")
        .help(help);
    match close.filter(|c| all.contains(c)) {
        Some(close) => d.edit(span, close),
        None => d,
    }
}

/// The prelude's functions (`stdlib/act.par`), checked; in scope in every module.
fn load_prelude(sources: &mut Sources, diags: &mut Diagnostics) -> functions::FnTable {
    let (name, text) = stdlib::PRELUDE;
    let id = sources.add(name, text);
    let file = match parse_file(id, text) {
        Ok(f) => f,
        Err(d) => {
            diags.push(d);
            return functions::FnTable::new();
        }
    };
    functions::check_module(
        &fn_defs(&file),
        &HashMap::new(),
        &functions::FnTable::new(),
        diags,
    )
    .fns
}

/// The function definitions (`fn name(args) = expr`) of a file, in order.
fn fn_defs(file: &File) -> Vec<&FnDef> {
    file.items
        .iter()
        .filter_map(|i| match i {
            Item::Fn(f) => Some(f),
            _ => None,
        })
        .collect()
}

/// Loading modules: the main file and, recursively, the stdlib modules it uses.
struct Modules<'a> {
    sources: &'a mut Sources,
    ns: &'a mut Vec<Namespace>,
    loaded: &'a mut HashMap<String, usize>,
    prelude: &'a functions::FnTable,
    diags: &'a mut Diagnostics,
}

impl Modules<'_> {
    /// Build the namespace of `file` (and, recursively, of the stdlib modules it uses). Returns
    /// its index in `ns`.
    fn load(&mut self, file: &File) -> usize {
        let me = self.ns.len();
        self.ns.push(Namespace::default());
        for item in &file.items {
            match item {
                Item::Block(b) => self.block(me, b),
                Item::Let(l) => self.file_let(me, l),
                _ => {}
            }
        }
        let defs = fn_defs(file);
        let consts = self.ns[me].consts.clone();
        let checked = functions::check_module(&defs, &consts, self.prelude, self.diags);
        self.ns[me].fns = checked.fns;
        self.ns[me].broken_fns = checked.broken;
        for item in &file.items {
            if let Item::Use(u) = item {
                self.use_decl(me, u);
            }
        }
        self.fn_clashes(me, &defs);
        me
    }

    /// A function of this module named like a block in scope, a built-in layer or a file-level
    /// constant (E0225): a call of that name would reach the other, and the function would be
    /// silently unused.
    fn fn_clashes(&mut self, me: usize, defs: &[&FnDef]) {
        for def in defs {
            let name = def.name.name.as_str();
            let ns = &self.ns[me];
            // (what the name is, what a use of it reaches instead)
            let other = if ns.blocks.contains_key(name) {
                Some(match ns.imports.get(name) {
                    Some(_) => ("an imported block", "the block"),
                    None => ("a block", "the block"),
                })
            } else if layers::BUILTINS.contains(&name) {
                Some(("a built-in layer", "the layer"))
            } else if ns.consts.contains_key(name) {
                Some(("a file-level constant", "the constant"))
            } else if name == "none" {
                Some(("the word `none`", "the word"))
            } else {
                None
            };
            let Some((what, reached)) = other else {
                continue;
            };
            let mut d =
                Diagnostic::error("E0225", format!("function `{name}` has the name of {what}"))
                    .label(def.name.span, "defined here")
                    .help(format!(
                    "`{name}` names {reached}, never this function; give the function another name"
                ));
            if let Some(span) = ns.imports.get(name) {
                d = d.label(*span, "imported here");
            } else if let Some(b) = ns.defs.get(name) {
                d = d.label(b.name.span, "the block");
            }
            self.diags.push(d);
        }
    }

    fn block(&mut self, me: usize, b: &BlockDef) {
        if layers::BUILTINS.contains(&b.name.name.as_str()) {
            self.diags.push(
                Diagnostic::error(
                    "E0204",
                    format!("block `{}` has the name of a built-in layer", b.name.name),
                )
                .label(b.name.span, "defined here")
                .help(format!(
                    "a block may not hide the built-in `{}`; give the block another name",
                    b.name.name
                )),
            );
            return;
        }
        if let Some(first) = self.ns[me].defs.get(&b.name.name) {
            self.diags.push(
                Diagnostic::error("E0204", format!("block `{}` is defined twice", b.name.name))
                    .label(b.name.span, "defined again here")
                    .label(first.name.span, "first definition")
                    .help("rename one of them"),
            );
            return;
        }
        self.ns[me].defs.insert(b.name.name.clone(), b.clone());
        self.ns[me]
            .blocks
            .insert(b.name.name.clone(), (me, b.name.name.clone()));
    }

    fn file_let(&mut self, me: usize, l: &LetDecl) {
        let empty = settings::Settings::default();
        let consts = self.ns[me].consts.clone();
        let mut r = sections::Reader {
            settings: &empty,
            consts: &consts,
            diags: self.diags,
        };
        match r.eval_expr(&l.value) {
            Some(sections::SVal::Num(n)) => {
                self.ns[me].consts.insert(l.name.name.clone(), n);
            }
            Some(other) => {
                self.diags.push(
                    Diagnostic::error("E0902", "a file-level `let` must be a number")
                        .label(other.span(), "not a number")
                        .help("file-level constants are numbers; put layers inside the model"),
                );
            }
            None => {}
        }
    }

    fn use_decl(&mut self, me: usize, u: &UseDecl) {
        let segs: Vec<&str> = u.module.iter().map(|i| i.name.as_str()).collect();
        let (root, name) = match segs.as_slice() {
            [root, name] => (*root, *name),
            _ => ("", ""),
        };
        let source = (root == "std").then(|| stdlib::module(name)).flatten();
        let Some((fname, text)) = source else {
            let names = stdlib::names();
            let help = match suggest::closest(name, names.iter().copied()) {
                Some(c) => format!("did you mean `std::{c}`?"),
                None => format!(
                    "the stdlib modules are {}",
                    names
                        .iter()
                        .map(|n| format!("`std::{n}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            self.diags.push(
                Diagnostic::error("E0205", format!("no module `{}`", segs.join("::")))
                    .label(u.module_span, "not found")
                    .help(help),
            );
            return;
        };
        let idx = match self.loaded.get(name) {
            Some(i) => *i,
            None => {
                let id = self.sources.add(fname, text);
                match parse_file(id, text) {
                    Ok(f) => {
                        // Reserve the slot first so a module that uses itself cannot loop.
                        self.loaded.insert(name.to_string(), self.ns.len());
                        self.load(&f)
                    }
                    Err(d) => {
                        self.diags.push(d);
                        return;
                    }
                }
            }
        };
        for imported in &u.names {
            self.import(me, idx, name, imported);
        }
    }

    fn import(&mut self, me: usize, idx: usize, name: &str, imported: &Ident) {
        let found = self
            .ns
            .get(idx)
            .and_then(|m| m.defs.get(&imported.name))
            .is_some();
        if found {
            let taken = if let Some(first) = self.ns[me].imports.get(&imported.name) {
                Some(
                    Diagnostic::error(
                        "E0204",
                        format!("block `{}` is imported twice", imported.name),
                    )
                    .label(imported.span, "imported again here")
                    .label(*first, "first imported here")
                    .help(
                        "import each name once; blocks of different modules need different names",
                    ),
                )
            } else {
                self.ns[me].defs.get(&imported.name).map(|local| {
                    Diagnostic::error(
                        "E0204",
                        format!(
                            "block `{}` is both defined in this file and imported from std::{name}",
                            imported.name
                        ),
                    )
                    .label(imported.span, "imported here")
                    .label(local.name.span, "defined here")
                    .help(format!(
                        "remove `{}` from the `use`, or rename this file's block",
                        imported.name
                    ))
                })
            };
            if let Some(d) = taken {
                self.diags.push(d);
                return;
            }
            self.ns[me]
                .blocks
                .insert(imported.name.clone(), (idx, imported.name.clone()));
            self.ns[me]
                .imports
                .insert(imported.name.clone(), imported.span);
            return;
        }
        let mut available: Vec<&str> = self
            .ns
            .get(idx)
            .map(|m| m.defs.keys().map(String::as_str).collect())
            .unwrap_or_default();
        available.sort_unstable();
        self.diags.push(
            Diagnostic::error("E0205", format!("`std::{name}` has no `{}`", imported.name))
                .label(imported.span, "not in this module")
                .help(format!(
                    "std::{name} provides {}",
                    suggest::one_of(&available)
                )),
        );
    }
}
