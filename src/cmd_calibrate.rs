//! `parc calibrate [--backend cpu|cuda] [--quick] [--gpu NAME] [--precision P] [--fp8 LIST]
//! [--add-to FILE] [-o FILE]`:
//! measure a calibration profile (`parc_runtime::calibrate`) on this machine's backend and write
//! it as JSON, by default to `calibration/<gpu>.json`, where `parc check` and `parc plan` find
//! it for specs on that GPU kind. With `--add-to`, measure only the FP8 GEMM tables and put them
//! into a profile measured before on the same GPU kind, backend and precision (its points of
//! those scalings replaced). Exit 0 when written, 1 when a measurement failed, 2 for usage
//! errors (an unknown gpu name, a backend this build lacks, a file that cannot be written, a
//! profile to add to that does not match).
use parc_compiler::ir::fp8::Fp8Scaling;
use parc_compiler::spec::{Gpu, LossScale, Precision};
use parc_compiler::timeline::profile::{precision_name, GemmDtype, Profile};
use parc_runtime::calibrate::{calibrate, calibrate_fp8, Settings};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CalibrateBackend {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PrecisionArg {
    Fp32,
    Bf16,
    Fp16,
}

#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    /// The backend whose ops are timed.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: CalibrateBackend,
    /// A small grid (seconds on a CPU; for CI) instead of the full one.
    #[arg(long)]
    pub quick: bool,
    /// The spec's `cluster.gpu` name this device is (`h200`, …); default `cpu` on the CPU, and
    /// on CUDA the catalogue's name for the device when parc recognises it.
    #[arg(long, value_name = "NAME")]
    pub gpu: Option<String>,
    /// The precision whose storage the ops run on: default fp32 on the CPU, bf16 on CUDA.
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// Where to write the profile (default `calibration/<gpu>.json`).
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// The FP8 scalings whose GEMMs are measured too, over the same grid (bf16 only): default
    /// all three on a GPU with FP8 tensor cores, none elsewhere; `none` measures none.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "SCALINGS")]
    pub fp8: Option<Vec<Fp8Arg>>,
    /// Measure only the FP8 GEMM tables (of --fp8) and add them to this profile, measured before
    /// on the same GPU kind, backend and precision, replacing its points of those scalings;
    /// written to -o, by default back to this file.
    #[arg(long, value_name = "FILE")]
    pub add_to: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fp8Arg {
    Tensorwise,
    Rowwise,
    Blockwise,
    None,
}

/// The FP8 scalings to measure: those asked for, else all three where the backend is CUDA on
/// a GPU with FP8 tensor cores and the run is bf16.
fn fp8_scalings(args: &CalibrateArgs, gpu: &Gpu, precision: Precision) -> Vec<Fp8Scaling> {
    let all = [Fp8Arg::Tensorwise, Fp8Arg::Rowwise, Fp8Arg::Blockwise];
    let fp8_gpu = args.backend == CalibrateBackend::Cuda && gpu.peak_flops_fp8.is_some();
    let asked = match &args.fp8 {
        Some(list) => list.clone(),
        None if fp8_gpu && precision == Precision::Bf16 => all.to_vec(),
        None => Vec::new(),
    };
    asked
        .into_iter()
        .filter_map(|a| match a {
            Fp8Arg::Tensorwise => Some(Fp8Scaling::Tensorwise),
            Fp8Arg::Rowwise => Some(Fp8Scaling::Rowwise),
            Fp8Arg::Blockwise => Some(Fp8Scaling::Blockwise {
                block: parc_compiler::fp8::CUDA_BLOCK,
            }),
            Fp8Arg::None => None,
        })
        .collect()
}

pub fn main(args: CalibrateArgs) -> u8 {
    match run(&args) {
        Ok(()) => 0,
        Err((code, message)) => {
            eprintln!("error: {message}");
            code
        }
    }
}

fn run(args: &CalibrateArgs) -> Result<(), (u8, String)> {
    let usage = |m: String| (2, m);
    let precision = match args.precision.unwrap_or(match args.backend {
        CalibrateBackend::Cpu => PrecisionArg::Fp32,
        CalibrateBackend::Cuda => PrecisionArg::Bf16,
    }) {
        PrecisionArg::Fp32 => Precision::Fp32,
        PrecisionArg::Bf16 => Precision::Bf16,
        PrecisionArg::Fp16 => Precision::Fp16 {
            loss_scale: LossScale::Static { scale: 1.0 },
        },
    };
    let (mut backend, device, detected) = open_backend(args.backend, precision).map_err(usage)?;
    let gpu = gpu_entry(args.gpu.as_deref().or(detected.as_deref()), &device).map_err(usage)?;
    let output = args.output.clone().unwrap_or_else(|| match &args.add_to {
        Some(base) => base.clone(),
        None => PathBuf::from("calibration").join(format!("{}.json", gpu.name)),
    });
    let fp8 = fp8_scalings(args, &gpu, precision);
    let settings = Settings {
        quick: args.quick,
        precision,
        gpu,
        device,
        date: today(),
        fp8,
    };
    eprintln!(
        "calibrating {} ({}, {}{})",
        settings.device,
        settings.gpu.name,
        precision_name(precision),
        if args.quick { ", quick grid" } else { "" }
    );
    let started = std::time::Instant::now();
    let profile = match &args.add_to {
        Some(base) => add_fp8(base, backend.as_mut(), &settings)?,
        None => {
            let mut profile = calibrate(backend.as_mut(), &settings, &mut |what| {
                eprintln!("  {what}")
            })
            .map_err(|e| (1, format!("calibration failed: {e}")))?;
            if args.backend == CalibrateBackend::Cuda && !args.quick {
                drop(backend);
                add_collectives(&mut profile);
            }
            profile
        }
    };
    let json = serde_json::to_string_pretty(&profile)
        .map_err(|e| (1, format!("cannot encode the profile: {e}")))?;
    if let Some(folder) = output.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(folder)
            .map_err(|e| usage(format!("cannot create {}: {e}", folder.display())))?;
    }
    std::fs::write(&output, json + "\n")
        .map_err(|e| usage(format!("cannot write {}: {e}", output.display())))?;
    eprintln!(
        "wrote {} ({} gemm, {} attention, {} memory, {} collective points) in {:.1} s",
        output.display(),
        profile.gemm.len(),
        profile.attention.len(),
        profile.memory.len(),
        profile.collectives.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The profile at `base` with the FP8 GEMM tables of `settings.fp8` measured now in place of
/// its points of those scalings: refused (usage) where it was measured on another GPU kind,
/// backend or precision, or where no scaling is asked for.
fn add_fp8(
    base: &std::path::Path,
    backend: &mut dyn parc_runtime::backend::Backend,
    settings: &Settings,
) -> Result<Profile, (u8, String)> {
    let usage = |m: String| (2, m);
    let mut profile = crate::calibration::load(base).map_err(usage)?;
    let precision = precision_name(settings.precision);
    let measured_on = (
        profile.gpu.as_str(),
        profile.backend.as_str(),
        profile.precision.as_str(),
    );
    if measured_on != (settings.gpu.name.as_str(), backend.name(), precision) {
        return Err(usage(format!(
            "--add-to {}: that profile was measured on {} ({} backend, {}), this run is {} ({} \
             backend, {precision}); measure a whole profile instead (no --add-to)",
            base.display(),
            profile.gpu,
            profile.backend,
            profile.precision,
            settings.gpu.name,
            backend.name()
        )));
    }
    if settings.fp8.is_empty() || settings.precision != Precision::Bf16 {
        return Err(usage(format!(
            "--add-to {} measures FP8 GEMM tables only: it needs a bf16 run and FP8 scalings \
             (--fp8 tensorwise,rowwise,blockwise, on a GPU with FP8 tensor cores)",
            base.display()
        )));
    }
    let (points, notes) = calibrate_fp8(backend, settings, &mut |what| eprintln!("  {what}"));
    let names: Vec<String> = settings
        .fp8
        .iter()
        .map(|&s| GemmDtype::Fp8(s).name())
        .collect();
    profile.gemm.retain(|g| !names.contains(&g.dtype));
    profile.gemm.extend(points);
    profile
        .notes
        .retain(|n| !names.iter().any(|name| n.starts_with(name.as_str())));
    profile.notes.extend(notes);
    profile.notes.push(format!(
        "{} measured {} and added to this profile (measured {})",
        names.join(", "),
        settings.date,
        profile.date
    ));
    Ok(profile)
}

/// The collective table where several GPUs are visible (`calibrate_nccl`); a failure is a note
/// in the profile, which stands without it (the link model prices collectives then).
#[cfg(feature = "cuda")]
fn add_collectives(profile: &mut Profile) {
    match crate::calibrate_nccl::measure(&mut |what| eprintln!("  {what}")) {
        Ok(points) if points.is_empty() => {}
        Ok(points) => {
            profile
                .notes
                .retain(|n| !n.starts_with("collectives not measured"));
            profile.collectives = points;
        }
        Err(e) => profile.notes.push(format!("collectives not measured: {e}")),
    }
}

#[cfg(not(feature = "cuda"))]
fn add_collectives(_profile: &mut Profile) {}

type Opened = (
    Box<dyn parc_runtime::backend::Backend>,
    String,
    Option<String>,
);

/// The backend, the device's name and the gpu name it is recognised as.
fn open_backend(choice: CalibrateBackend, precision: Precision) -> Result<Opened, String> {
    match choice {
        CalibrateBackend::Cpu => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let backend =
                parc_runtime::cpu::CpuBackend::with_threads(cores).map_err(|e| e.to_string())?;
            let device = format!("cpu ({cores} thread{})", if cores == 1 { "" } else { "s" });
            Ok((Box::new(backend), device, Some("cpu".to_string())))
        }
        CalibrateBackend::Cuda => open_cuda(precision),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(precision: Precision) -> Result<Opened, String> {
    let backend = parc_runtime::cuda::CudaBackend::with_precision(0, precision)
        .map_err(|e| format!("cannot open GPU 0: {e}"))?;
    let device = backend.device_name().map_err(|e| e.to_string())?;
    let detected = if device.contains("H200") {
        Some("h200".to_string())
    } else if device.contains("H100") && device.contains("80GB") {
        Some("h100_80gb".to_string())
    } else {
        None
    };
    Ok((Box::new(backend), device, detected))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_precision: Precision) -> Result<Opened, String> {
    Err("this parc was built without CUDA: build it with `--features cuda`".to_string())
}

/// The catalogue's entry for `name`.
fn gpu_entry(name: Option<&str>, device: &str) -> Result<Gpu, String> {
    let names = parc_compiler::check::GPU_NAMES.join(", ");
    let name = name.ok_or_else(|| {
        format!("parc does not know which gpu `{device}` is: name it with --gpu ({names})")
    })?;
    parc_compiler::check::gpu_named(name)
        .ok_or_else(|| format!("unknown gpu `{name}` for --gpu: one of {names}"))
}

/// Today's date (UTC) as `YYYY-MM-DD`, from the system clock (Howard Hinnant's civil-from-days).
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}
