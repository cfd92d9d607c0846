//! `parc plot DIR... [-o FILE] [--metric loss,val_loss,lr,tokens_per_s]`: draw the metrics that
//! `parc run --metrics DIR` wrote against the step, one panel per metric, the runs overlaid
//! (the legend names each run by its folder), as SVG or PNG by FILE's extension. Drawn with
//! plotters; text is laid out (and, in a PNG, drawn) with DejaVu Sans bundled in the binary
//! (the `dejavu` crate), so no system font is needed. Exit codes as `main`: 0 drawn, 1 the
//! picture could not be written, 2 usage or unreadable input.
use crate::metrics::{read_run, Metric, Row};
use crate::run_prepare::print_error;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// Folders written by `parc run --metrics DIR`, one run each.
    #[arg(required = true, value_name = "DIR")]
    pub dirs: Vec<PathBuf>,
    /// The picture to write: SVG or PNG, by its extension.
    #[arg(
        short = 'o',
        long = "output",
        value_name = "FILE",
        default_value = "plot.svg"
    )]
    pub output: PathBuf,
    /// The metrics to draw, one panel each (columns of metrics.csv: loss, val_loss, lr,
    /// grad_norm, tokens, tokens_per_s, mfu, memory_bytes, elapsed_s).
    #[arg(
        long,
        value_name = "NAMES",
        value_delimiter = ',',
        default_value = "loss,val_loss,lr,tokens_per_s"
    )]
    pub metric: Vec<String>,
}

/// One panel's size in pixels.
const PANEL: (u32, u32) = (640, 400);

/// The runs' colours, in order (Tableau 10: distinct and readable on white).
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The font family every text is drawn in (registered to the bundled DejaVu Sans).
const FONT: &str = "sans-serif";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Svg,
    Png,
}

/// A run's name in the legend and its rows.
struct Run {
    name: String,
    rows: Vec<Row>,
}

/// One metric's curves: per run (by index into the runs), its (step, value) points.
struct Panel {
    metric: Metric,
    curves: Vec<(usize, Vec<(f64, f64)>)>,
}

pub fn main(args: PlotArgs) -> u8 {
    match plot(&args) {
        Ok(()) => {
            eprintln!("wrote {}", args.output.display());
            0
        }
        Err((code, message)) => {
            print_error(&message);
            code
        }
    }
}

fn plot(args: &PlotArgs) -> Result<(), (u8, String)> {
    let usage = |message: String| (2, message);
    let format = format_of(&args.output).map_err(usage)?;
    let metrics = parse_metrics(&args.metric).map_err(usage)?;
    let runs = read_runs(&args.dirs).map_err(usage)?;
    let panels = panels(&metrics, &runs).map_err(usage)?;
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    let bytes = render(format, &panels, &names).map_err(|e| (1, e))?;
    std::fs::write(&args.output, bytes).map_err(|e| {
        (
            1,
            format!("cannot write the picture {}: {e}", args.output.display()),
        )
    })
}

fn format_of(output: &Path) -> Result<Format, String> {
    let extension = output
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match extension.as_deref() {
        Some("svg") => Ok(Format::Svg),
        Some("png") => Ok(Format::Png),
        _ => Err(format!(
            "-o {}: the picture's name must end in .svg or .png (its format)",
            output.display()
        )),
    }
}

fn parse_metrics(names: &[String]) -> Result<Vec<Metric>, String> {
    let known = || {
        Metric::ALL
            .iter()
            .map(|m| m.column())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let metrics = names
        .iter()
        .map(|name| {
            Metric::from_column(name.trim()).ok_or_else(|| {
                format!(
                    "--metric: unknown metric `{name}`; the metrics are {}",
                    known()
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if metrics.is_empty() {
        return Err(format!("--metric: name at least one of {}", known()));
    }
    Ok(metrics)
}

/// Each folder's rows, named by the folder (by its whole path where two share a name).
fn read_runs(dirs: &[PathBuf]) -> Result<Vec<Run>, String> {
    let short = |dir: &Path| {
        dir.file_name()
            .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into())
    };
    let mut runs = Vec::new();
    for dir in dirs {
        let rows = read_run(dir)?;
        if rows.is_empty() {
            return Err(format!(
                "{}: the run has no steps yet (its metrics hold no rows)",
                dir.display()
            ));
        }
        let shared = dirs.iter().filter(|d| short(d) == short(dir)).count() > 1;
        let name = if shared {
            dir.display().to_string()
        } else {
            short(dir)
        };
        runs.push(Run { name, rows });
    }
    Ok(runs)
}

/// A panel per metric that some run has values of (the others are named on stderr).
fn panels(metrics: &[Metric], runs: &[Run]) -> Result<Vec<Panel>, String> {
    let mut panels = Vec::new();
    for &metric in metrics {
        let curves: Vec<(usize, Vec<(f64, f64)>)> = runs
            .iter()
            .enumerate()
            .map(|(i, run)| {
                let points = run
                    .rows
                    .iter()
                    .filter_map(|r| Some((r.step as f64, r.get(metric)?)))
                    .collect::<Vec<_>>();
                (i, points)
            })
            .filter(|(_, points)| !points.is_empty())
            .collect();
        if curves.is_empty() {
            eprintln!(
                "note: no run has values of {}; its panel is left out",
                metric.column()
            );
        } else {
            panels.push(Panel { metric, curves });
        }
    }
    if panels.is_empty() {
        return Err("none of the runs has values of the metrics asked for".to_string());
    }
    Ok(panels)
}

/// The picture's bytes.
fn render(format: Format, panels: &[Panel], names: &[&str]) -> Result<Vec<u8>, String> {
    plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "the bundled DejaVu Sans font cannot be read".to_string())?;
    let columns = if panels.len() == 1 { 1 } else { 2 };
    let rows = panels.len().div_ceil(columns);
    let size = (PANEL.0 * columns as u32, PANEL.1 * rows as u32);
    match format {
        Format::Svg => {
            let mut text = String::new();
            draw(
                SVGBackend::with_string(&mut text, size),
                (rows, columns),
                panels,
                names,
            )?;
            Ok(text.into_bytes())
        }
        Format::Png => {
            let mut pixels = vec![0u8; size.0 as usize * size.1 as usize * 3];
            draw(
                BitMapBackend::with_buffer(&mut pixels, size),
                (rows, columns),
                panels,
                names,
            )?;
            encode_png(&pixels, size)
        }
    }
}

fn encode_png(rgb: &[u8], (width, height): (u32, u32)) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let fail = |e: png::EncodingError| format!("cannot encode the PNG: {e}");
    let mut writer = encoder.write_header().map_err(fail)?;
    writer.write_image_data(rgb).map_err(fail)?;
    writer.finish().map_err(fail)?;
    Ok(out)
}

/// Draw `panels` on `backend` in a grid of (rows, columns).
fn draw<DB: DrawingBackend>(
    backend: DB,
    grid: (usize, usize),
    panels: &[Panel],
    names: &[&str],
) -> Result<(), String> {
    let root = backend.into_drawing_area();
    root.fill(&WHITE).map_err(drawing)?;
    for (area, panel) in root.split_evenly(grid).iter().zip(panels) {
        draw_panel(area, panel, names)?;
    }
    root.present().map_err(drawing)
}

fn drawing<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> String {
    format!("cannot draw the plot: {e}")
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    names: &[&str],
) -> Result<(), String> {
    let points = || panel.curves.iter().flat_map(|(_, p)| p.iter());
    let (steps, values) = (
        span(points().map(|p| p.0), 1.0),
        span(points().map(|p| p.1), 0.0),
    );
    let mut chart = ChartBuilder::on(area)
        .caption(panel.metric.label(), (FONT, 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(steps, values)
        .map_err(drawing)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| tick(*y))
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(drawing)?;
    for (run, curve) in &panel.curves {
        let color = COLORS[run % COLORS.len()];
        let style = color.stroke_width(2);
        let drawn = if curve.len() > 1 {
            chart.draw_series(LineSeries::new(curve.iter().copied(), style))
        } else {
            // One point draws no line: a dot instead.
            chart.draw_series(curve.iter().map(|&p| Circle::new(p, 3, color.filled())))
        };
        drawn
            .map_err(drawing)?
            .label(names[*run])
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FONT, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(drawing)
}

/// The range `values` cover, widened by 5% each side (by `pad` or a tenth of the value when
/// they are all equal, so that the range is never empty).
fn span(values: impl Iterator<Item = f64>, pad: f64) -> std::ops::Range<f64> {
    let (low, high) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if high > low {
        let margin = (high - low) * 0.05;
        return low - margin..high + margin;
    }
    let margin = if pad > 0.0 {
        pad
    } else if low != 0.0 {
        low.abs() * 0.1
    } else {
        1.0
    };
    low - margin..high + margin
}

/// An axis value in at most four significant digits, in scientific notation when small or
/// large (a learning rate, bytes of memory).
fn tick(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude == 0.0 {
        return "0".to_string();
    }
    if !(1e-2..1e6).contains(&magnitude) {
        return format!("{value:.1e}");
    }
    let decimals = (3 - magnitude.log10().floor() as i32).clamp(0, 6) as usize;
    let text = format!("{value:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_have_four_digits_at_most() {
        assert_eq!(tick(5.2), "5.2");
        assert_eq!(tick(12_345.0), "12345");
        assert_eq!(tick(0.25), "0.25");
        assert_eq!(tick(1.5e-4), "1.5e-4");
        assert_eq!(tick(5_873_664.0), "5.9e6");
        assert_eq!(tick(0.0), "0");
    }

    #[test]
    fn ranges_are_padded_and_never_empty() {
        assert_eq!(span([1.0, 11.0].into_iter(), 0.0), 0.5..11.5);
        assert_eq!(span([4.0].into_iter(), 1.0), 3.0..5.0);
        assert_eq!(span([5.0, 5.0].into_iter(), 0.0), 4.5..5.5);
        assert_eq!(span([0.0].into_iter(), 0.0), -1.0..1.0);
    }

    #[test]
    fn the_format_is_the_extension_and_metrics_are_columns() {
        assert!(format_of(Path::new("a/b.SVG")) == Ok(Format::Svg));
        assert!(format_of(Path::new("b.png")) == Ok(Format::Png));
        let err = format_of(Path::new("b.jpg")).err().unwrap_or_default();
        assert!(err.contains(".svg or .png"), "{err}");
        let names = ["loss".to_string(), " lr".to_string()];
        assert_eq!(parse_metrics(&names), Ok(vec![Metric::Loss, Metric::Lr]));
        let err = parse_metrics(&["losss".to_string()])
            .err()
            .unwrap_or_default();
        assert!(
            err.contains("unknown metric `losss`") && err.contains("val_loss"),
            "{err}"
        );
    }
}
