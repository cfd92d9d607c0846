//! A run's metrics on disk: what `parc run --metrics DIR` writes and `parc plot` reads. One
//! [`Row`] per step goes, as the run goes, to `DIR/metrics.csv` (`table`) and to a TensorBoard
//! event file (`events`, framed as TFRecords by `tfrecord`), each flushed per row so that a
//! crashed run keeps its rows. [`RunMetrics`] is the writer a run's step callback feeds;
//! [`read_run`] reads a folder back, from its CSV or, where it has none, its event files.

mod events;
mod table;
mod tfrecord;

pub use events::read_event_file;

use parc_compiler::spec::Spec;
use parc_runtime::exec::StepRecord;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The CSV's name in a metrics folder.
pub const CSV_NAME: &str = "metrics.csv";

/// What a row holds besides its step: the CSV's columns after `step`, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    Loss,
    ValLoss,
    Lr,
    GradNorm,
    Tokens,
    TokensPerS,
    Mfu,
    MemoryBytes,
    ElapsedS,
}

impl Metric {
    pub const ALL: [Metric; 9] = [
        Metric::Loss,
        Metric::ValLoss,
        Metric::Lr,
        Metric::GradNorm,
        Metric::Tokens,
        Metric::TokensPerS,
        Metric::Mfu,
        Metric::MemoryBytes,
        Metric::ElapsedS,
    ];

    /// Its CSV column, also its name in `parc plot --metric`.
    pub fn column(self) -> &'static str {
        match self {
            Metric::Loss => "loss",
            Metric::ValLoss => "val_loss",
            Metric::Lr => "lr",
            Metric::GradNorm => "grad_norm",
            Metric::Tokens => "tokens",
            Metric::TokensPerS => "tokens_per_s",
            Metric::Mfu => "mfu",
            Metric::MemoryBytes => "memory_bytes",
            Metric::ElapsedS => "elapsed_s",
        }
    }

    /// Its TensorBoard tag; none for the batch's tokens and the elapsed time (TensorBoard shows
    /// every scalar against the step and the wall time already).
    pub fn tag(self) -> Option<&'static str> {
        match self {
            Metric::Loss => Some("train/loss"),
            Metric::ValLoss => Some("val/loss"),
            Metric::Lr => Some("train/lr"),
            Metric::GradNorm => Some("train/grad_norm"),
            Metric::TokensPerS => Some("perf/tokens_per_s"),
            Metric::Mfu => Some("perf/mfu"),
            Metric::MemoryBytes => Some("perf/memory_bytes"),
            Metric::Tokens | Metric::ElapsedS => None,
        }
    }

    /// What a plot calls it.
    pub fn label(self) -> &'static str {
        match self {
            Metric::Loss => "training loss",
            Metric::ValLoss => "validation loss",
            Metric::Lr => "learning rate",
            Metric::GradNorm => "gradient norm",
            Metric::Tokens => "tokens per step",
            Metric::TokensPerS => "throughput (tokens/s)",
            Metric::Mfu => "MFU",
            Metric::MemoryBytes => "memory held (bytes)",
            Metric::ElapsedS => "elapsed (s)",
        }
    }

    /// Whether its values are whole numbers (written without a fraction).
    fn is_count(self) -> bool {
        matches!(self, Metric::Tokens | Metric::MemoryBytes)
    }

    /// Whether the run measures it in f32 (written with f32's digits, not f64's of the widened
    /// value).
    fn is_f32(self) -> bool {
        matches!(self, Metric::Loss | Metric::ValLoss | Metric::GradNorm)
    }

    pub fn from_column(name: &str) -> Option<Metric> {
        Metric::ALL.into_iter().find(|m| m.column() == name)
    }

    pub fn from_tag(tag: &str) -> Option<Metric> {
        Metric::ALL.into_iter().find(|m| m.tag() == Some(tag))
    }
}

/// One step's metrics. `step` counts completed steps (1-based, as the JSON lines' `step`); a
/// value is absent where it does not apply (no evaluation on this step, memory the backend does
/// not report) or is not finite (a skipped fp16 step's gradient norm), as JSON's `null`.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub step: u64,
    values: [Option<f64>; Metric::ALL.len()],
}

impl Row {
    pub fn new(step: u64) -> Row {
        Row {
            step,
            values: [None; Metric::ALL.len()],
        }
    }

    pub fn get(&self, metric: Metric) -> Option<f64> {
        self.values[metric as usize]
    }

    /// Set `metric` to `value`, or clear it when `value` is not finite.
    pub fn set(&mut self, metric: Metric, value: Option<f64>) {
        self.values[metric as usize] = value.filter(|v| v.is_finite());
    }

    /// The row of `record`; `mfu_one_second` is the run's MFU at a step of one second
    /// ([`parc_compiler::cost::mfu`]), which a step of `s` seconds divides by `s`.
    pub fn from_record(record: &StepRecord, mfu_one_second: f64) -> Row {
        let mut row = Row::new(record.step + 1);
        let tokens = record.tokens as f64;
        // tokens_per_s = tokens / the step's seconds.
        let step_seconds = (record.tokens_per_s > 0.0).then(|| tokens / record.tokens_per_s);
        row.set(Metric::Loss, Some(f64::from(record.loss)));
        row.set(Metric::ValLoss, record.val_loss.map(f64::from));
        row.set(Metric::Lr, Some(record.lr));
        row.set(Metric::GradNorm, Some(f64::from(record.grad_norm)));
        row.set(Metric::Tokens, Some(tokens));
        row.set(Metric::TokensPerS, Some(record.tokens_per_s));
        row.set(Metric::Mfu, step_seconds.map(|s| mfu_one_second / s));
        row.set(Metric::MemoryBytes, record.memory_bytes.map(|b| b as f64));
        row.set(Metric::ElapsedS, Some(record.elapsed_s));
        row
    }
}

/// The metrics writer of one run: the report rank's step callback hands it every step. A write
/// that fails is said once on stderr, stops further rows, and fails the run at its end
/// ([`RunMetrics::finish`]), so that a run never looks complete with rows missing.
pub struct RunMetrics {
    dir: PathBuf,
    state: Mutex<State>,
    mfu_one_second: f64,
}

struct State {
    csv: table::TableWriter,
    events: events::EventWriter,
    failed: Option<String>,
}

impl RunMetrics {
    /// [`RunMetrics::create`] for `--metrics DIR`; none without it.
    pub fn open(dir: Option<&Path>, spec: &Spec) -> Result<Option<RunMetrics>, String> {
        dir.map(|dir| RunMetrics::create(dir, spec)).transpose()
    }

    /// Create `dir` if needed and open its CSV (appending, after the rows of earlier steps, when
    /// it has one) and a new event file: an error here (an unwritable folder, a CSV of other
    /// columns) comes before training starts.
    pub fn create(dir: &Path, spec: &Spec) -> Result<RunMetrics, String> {
        std::fs::create_dir_all(dir).map_err(|e| {
            format!(
                "--metrics {}: cannot create the folder: {e}; pick a folder you can write",
                dir.display()
            )
        })?;
        let csv = table::TableWriter::open(&dir.join(CSV_NAME))?;
        let events = events::EventWriter::create(dir)?;
        Ok(RunMetrics {
            dir: dir.to_path_buf(),
            state: Mutex::new(State {
                csv,
                events,
                failed: None,
            }),
            mfu_one_second: parc_compiler::cost::mfu(spec, 1.0),
        })
    }

    /// Write `record`'s row to the CSV and the event file.
    pub fn step(&self, record: &StepRecord) {
        let row = Row::from_record(record, self.mfu_one_second);
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        if state.failed.is_some() {
            return;
        }
        let written = state
            .csv
            .write(&row)
            .and_then(|()| state.events.write(&row));
        if let Err(message) = written {
            eprintln!(
                "warning: metrics: {message}; no further rows are written to {} (the run goes on \
                 and fails at its end)",
                self.dir.display()
            );
            state.failed = Some(format!("at step {}: {message}", row.step));
        }
    }

    /// `Err` when a row could not be written.
    pub fn finish(self) -> Result<(), String> {
        let state = self
            .state
            .into_inner()
            .map_err(|_| "metrics: a step callback panicked while writing".to_string())?;
        match state.failed {
            None => Ok(()),
            Some(why) => Err(format!(
                "--metrics {}: writing the metrics failed {why}",
                self.dir.display()
            )),
        }
    }
}

/// The rows of the metrics folder `dir`, by step: from its `metrics.csv`, or, where it has none,
/// from its event files (where runs wrote the same step, the value of the run that started
/// last, as a resumed run's replaces the rows it repeats in the CSV).
pub fn read_run(dir: &Path) -> Result<Vec<Row>, String> {
    if !dir.is_dir() {
        return Err(format!(
            "{}: no such folder (give folders that `parc run --metrics DIR` wrote)",
            dir.display()
        ));
    }
    let csv = dir.join(CSV_NAME);
    if csv.exists() {
        return table::read(&csv);
    }
    let files = events::event_files(dir)?;
    if files.is_empty() {
        return Err(format!(
            "{}: neither a {CSV_NAME} nor event files (events.out.tfevents.*) are in it; is it \
             a folder that `parc run --metrics` wrote?",
            dir.display()
        ));
    }
    let mut files = files
        .iter()
        .map(|file| read_event_file(file))
        .collect::<Result<Vec<_>, _>>()?;
    files.sort_by(|a, b| a.started.total_cmp(&b.started));
    let mut rows = std::collections::BTreeMap::new();
    for file in files {
        for (step, scalars) in file.scalars {
            let row = rows.entry(step).or_insert_with(|| Row::new(step));
            for (metric, value) in scalars {
                row.set(metric, Some(value));
            }
        }
    }
    Ok(rows.into_values().collect())
}
