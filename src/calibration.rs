//! Which model prices a spec's timeline (`parc check`, `parc plan`): the calibration profile
//! given with `--calibration FILE`, else the repository's `calibration/<gpu>.json` for the
//! spec's GPU kind when it exists, else the GPU's peak numbers. A profile of another GPU kind is
//! refused unless `--scale-calibration` asks to scale it by the two GPUs' peak numbers (then,
//! without a profile of its own kind, the first `calibration/*.json` is scaled). Errors name the
//! file and what to do.
use parc_compiler::driver::{self, CompileOptions, Stage};
use parc_compiler::ir::Plan;
use parc_compiler::spec::Spec;
use parc_compiler::timeline::profile::{Profile, ProfileError};
use parc_compiler::timeline::{Calibration, ProfileCosts};
use parc_compiler::Override;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The flags `check`, `plan` and `run` share.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CalibrationArgs {
    /// A calibration profile (`parc calibrate -o FILE`) that prices the simulated step; by
    /// default `calibration/<gpu>.json` when one exists for the spec's gpu, else the GPU's peak
    /// numbers.
    #[arg(long, value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// Accept a profile measured on another GPU kind, its rates scaled by the two GPUs' peak
    /// numbers (an approximation: the report says so).
    #[arg(long)]
    pub scale_calibration: bool,
}

/// The model chosen for one spec.
#[derive(Clone, Debug, Default)]
pub struct Chosen {
    pub calibration: Option<Arc<Calibration>>,
    /// The profile's file, as found.
    pub file: Option<String>,
    /// Why the default profile of the spec's gpu was not used (it was measured in another
    /// precision), when it was not.
    pub passed_over: Option<String>,
}

/// How the step was priced, for the reports (`priced_by` in `check`'s JSON).
#[derive(Clone, Debug, Serialize)]
pub struct PricedBy {
    /// `calibration` or `peak`.
    pub model: &'static str,
    pub file: Option<String>,
    /// The profile's date and device.
    pub measured: Option<String>,
    pub device: Option<String>,
    /// The profile's GPU kind when it was scaled to the spec's.
    pub scaled_from: Option<String>,
    /// Kinds of work the profile has no points for, priced by the GPU's peak numbers.
    pub roofline_kinds: Vec<String>,
    /// Work the profile prices more coarsely than `parc calibrate` measures now (an older
    /// profile's: `ProfileCosts::coarse_tables`).
    pub coarse: Vec<String>,
    /// One sentence saying all of the above.
    pub note: String,
}

/// `options` with the profile that prices the timeline of `text`'s spec (checked first, to
/// learn its gpu), and that choice; `options` unchanged when it stops before the timeline or
/// the spec does not check (its errors come from the compile that follows).
pub fn with_profile(
    args: &CalibrationArgs,
    name: &str,
    text: &str,
    overrides: &[Override],
    options: &CompileOptions,
) -> Result<(CompileOptions, Chosen), String> {
    let mut options = options.clone();
    let mut chosen = Chosen::default();
    // The FP8 choice is priced too: a spec with `train.fp8` needs the profile to lower.
    let priced = |spec: &Spec| options.through >= Stage::Timeline || spec.train.fp8.is_some();
    if options.through >= Stage::Lower {
        let check = CompileOptions::through(Stage::Check);
        let checked = driver::compile(name, text.to_string(), overrides, &check);
        if let Some(spec) = checked.spec.as_ref().filter(|s| priced(s)) {
            chosen = choose(args, spec)?;
            options.calibration = chosen.calibration.clone();
        }
    }
    Ok((options, chosen))
}

/// The profile that prices `spec`'s timeline, or none (the GPU's peak numbers).
pub fn choose(args: &CalibrationArgs, spec: &Spec) -> Result<Chosen, String> {
    let gpu = &spec.cluster.gpu.name;
    let path = match &args.calibration {
        Some(path) => Some(path.clone()),
        None => default_profile(gpu, args.scale_calibration),
    };
    let Some(path) = path else {
        return Ok(Chosen::default());
    };
    let profile = load(&path)?;
    let shown = path.display();
    match profile.check_for(spec, args.scale_calibration) {
        // A default profile of another precision prices nothing: the peak numbers do, and the
        // report says why (one named with --calibration is an error).
        Err(e @ ProfileError::OtherPrecision { .. }) if args.calibration.is_none() => {
            return Ok(Chosen {
                passed_over: Some(format!("calibration profile {shown} {e}")),
                ..Chosen::default()
            });
        }
        Err(e) => return Err(format!("calibration profile {shown} {e}")),
        Ok(()) => {}
    }
    let scale = profile.gpu != *gpu;
    Ok(Chosen {
        calibration: Some(Arc::new(Calibration { profile, scale })),
        file: Some(shown.to_string()),
        passed_over: None,
    })
}

/// Read and check the profile at `path`.
pub fn load(path: &Path) -> Result<Profile, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "cannot read calibration profile {shown}: {e}; measure one with \
             `parc calibrate -o {shown}`"
        )
    })?;
    Profile::parse(&text).map_err(|e| format!("calibration profile {shown}: {e}"))
}

/// `calibration/<gpu>.json` in this folder or in parc's source tree; with `scale`, failing
/// that, the first profile there.
fn default_profile(gpu: &str, scale: bool) -> Option<PathBuf> {
    let folders = [
        PathBuf::from("calibration"),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("calibration"),
    ];
    let own = folders.iter().map(|f| f.join(format!("{gpu}.json")));
    if let Some(found) = own.clone().find(|p| p.is_file()) {
        return Some(found);
    }
    if !scale {
        return None;
    }
    folders.iter().find_map(|folder| {
        let mut profiles: Vec<PathBuf> = std::fs::read_dir(folder)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        profiles.sort();
        profiles.into_iter().next()
    })
}

/// How `chosen` priced `plan`'s step.
pub fn priced_by(chosen: &Chosen, spec: &Spec, plan: &Plan) -> PricedBy {
    let gpu = &spec.cluster.gpu.name;
    let Some(calibration) = &chosen.calibration else {
        return PricedBy {
            model: "peak",
            file: None,
            measured: None,
            device: None,
            scaled_from: None,
            roofline_kinds: Vec::new(),
            coarse: Vec::new(),
            note: match &chosen.passed_over {
                Some(why) => format!("timeline priced by the GPU's peak numbers: {why}"),
                None => format!(
                    "timeline priced by the GPU's peak numbers: no calibration profile for \
                     {gpu}; `parc calibrate` makes one"
                ),
            },
        };
    };
    let profile = &calibration.profile;
    let costs = ProfileCosts::new(calibration, spec);
    let (roofline_kinds, coarse) = (costs.roofline_kinds(plan), costs.coarse_tables(plan));
    let file = chosen.file.clone().unwrap_or_default();
    let mut note = format!(
        "timeline priced by {file} (measured {} on {})",
        profile.date, profile.device
    );
    let scaled_from = calibration.scale.then(|| profile.gpu.clone());
    if let Some(from) = &scaled_from {
        note.push_str(&format!(
            ", scaled from {from} to {gpu} by their peak numbers (an approximation)"
        ));
    }
    if !roofline_kinds.is_empty() {
        note.push_str(&format!(
            "; by the GPU's peak numbers where it measured nothing: {}",
            roofline_kinds.join(", ")
        ));
    }
    if !coarse.is_empty() {
        note.push_str(&format!(
            "; coarser than `parc calibrate` measures now: {} (re-run it on this GPU)",
            coarse.join(", ")
        ));
    }
    PricedBy {
        model: "calibration",
        file: Some(file),
        measured: Some(profile.date.clone()),
        device: Some(profile.device.clone()),
        scaled_from,
        roofline_kinds,
        coarse,
        note,
    }
}
