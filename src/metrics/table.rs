//! `metrics.csv`: a header `step,loss,val_loss,…` (`step` then [`Metric::ALL`]'s columns) and
//! one row per step, an empty cell where a value is absent. [`TableWriter`] appends rows,
//! flushing each; a file that exists already (a resumed run's) keeps its header and the rows of
//! steps before the first step written now, so that steps a resumed run repeats are not listed
//! twice. [`read`] parses a file back.

use super::{Metric, Row};
use std::fs::File;
use std::path::{Path, PathBuf};

/// The header's cells.
fn header() -> Vec<&'static str> {
    std::iter::once("step")
        .chain(Metric::ALL.iter().map(|m| m.column()))
        .collect()
}

/// Appends rows to one CSV file.
pub struct TableWriter {
    path: PathBuf,
    writer: csv::Writer<File>,
    /// The rows the file held when it was opened, until the first row is written.
    earlier: Option<Vec<Row>>,
}

impl TableWriter {
    /// Open `path` for appending, writing the header when the file is new or empty. An existing
    /// file must have parc's header.
    pub fn open(path: &Path) -> Result<TableWriter, String> {
        let has_rows = path.metadata().is_ok_and(|m| m.len() > 0);
        let earlier = if has_rows {
            check_header(path)?;
            Some(read(path)?)
        } else {
            None
        };
        let file = File::options()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| format!("cannot open {} for writing: {e}", path.display()))?;
        let mut table = TableWriter {
            path: path.to_path_buf(),
            writer: csv::Writer::from_writer(file),
            earlier,
        };
        if !has_rows {
            table.write_cells(header())?;
        }
        Ok(table)
    }

    /// Append `row` (the first row written first drops the file's rows of its step and later).
    pub fn write(&mut self, row: &Row) -> Result<(), String> {
        if let Some(earlier) = self.earlier.take() {
            if earlier.iter().any(|r| r.step >= row.step) {
                self.rewrite(earlier.iter().filter(|r| r.step < row.step))?;
            }
        }
        let cells = std::iter::once(row.step.to_string())
            .chain(Metric::ALL.iter().map(|&m| cell(m, row.get(m))))
            .collect::<Vec<_>>();
        self.write_cells(cells)
    }

    /// Replace the file by its header and `rows` (written to a temporary file renamed over
    /// it, so that a crash leaves the old file or the new one), and go on appending to it.
    fn rewrite<'a>(&mut self, rows: impl Iterator<Item = &'a Row>) -> Result<(), String> {
        let temporary = self.path.with_extension("csv.tmp");
        let shown = self.path.display().to_string();
        let fail = |e: &dyn std::fmt::Display| format!("cannot rewrite {shown}: {e}");
        let file = File::create(&temporary).map_err(|e| fail(&e))?;
        self.writer = csv::Writer::from_writer(file);
        self.write_cells(header())?;
        for row in rows {
            self.write(row)?;
        }
        std::fs::rename(&temporary, &self.path).map_err(|e| fail(&e))?;
        let file = File::options()
            .append(true)
            .open(&self.path)
            .map_err(|e| fail(&e))?;
        self.writer = csv::Writer::from_writer(file);
        Ok(())
    }

    fn write_cells<I, T>(&mut self, cells: I) -> Result<(), String>
    where
        I: IntoIterator<Item = T>,
        T: AsRef<[u8]>,
    {
        self.writer
            .write_record(cells)
            .map_err(|e| e.to_string())
            .and_then(|()| self.writer.flush().map_err(|e| e.to_string()))
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))
    }
}

/// A value as its cell: empty when absent, whole numbers for counts, the shortest text that
/// reads back as the same number in the precision the run measured it in.
fn cell(metric: Metric, value: Option<f64>) -> String {
    match value {
        None => String::new(),
        Some(v) if metric.is_count() => format!("{}", v.round() as u64),
        Some(v) if metric.is_f32() => format!("{}", v as f32),
        Some(v) => format!("{v}"),
    }
}

fn check_header(path: &Path) -> Result<(), String> {
    let mut reader = reader(path)?;
    let found = reader
        .headers()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if found.iter().eq(header()) {
        return Ok(());
    }
    Err(format!(
        "{} has the columns `{}`, not parc's `{}`: it is not this parc's metrics file; give \
         --metrics another folder, or move the file away",
        path.display(),
        found.iter().collect::<Vec<_>>().join(","),
        header().join(",")
    ))
}

fn reader(path: &Path) -> Result<csv::Reader<File>, String> {
    let file = File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(csv::Reader::from_reader(file))
}

/// The rows of the CSV at `path`. Its header must have `step`; columns are found by name
/// (others are ignored, missing ones read as absent).
pub fn read(path: &Path) -> Result<Vec<Row>, String> {
    let shown = path.display();
    if path.metadata().is_ok_and(|m| m.len() == 0) {
        return Err(format!("{shown} is empty: not even a header"));
    }
    let mut reader = reader(path)?;
    let headers = reader
        .headers()
        .map_err(|e| format!("{shown}: {e}"))?
        .clone();
    let position = |name: &str| headers.iter().position(|h| h == name);
    let step_at = position("step")
        .ok_or_else(|| format!("{shown} has no `step` column: it is not a metrics file"))?;
    let columns: Vec<(Metric, usize)> = Metric::ALL
        .into_iter()
        .filter_map(|m| Some((m, position(m.column())?)))
        .collect();
    let mut rows = Vec::new();
    for record in reader.records() {
        let record = record.map_err(|e| format!("{shown}: {e}"))?;
        let line = record.position().map_or(0, |p| p.line());
        let at = |column: &str| format!("{shown} line {line}, column {column}");
        let step = record.get(step_at).unwrap_or("");
        let step = step
            .parse()
            .map_err(|_| format!("{}: `{step}` is not a step number", at("step")))?;
        let mut row = Row::new(step);
        for &(metric, index) in &columns {
            let text = record.get(index).unwrap_or("");
            if text.is_empty() {
                continue;
            }
            let value = text
                .parse::<f64>()
                .map_err(|_| format!("{}: `{text}` is not a number", at(metric.column())))?;
            row.set(metric, Some(value));
        }
        rows.push(row);
    }
    Ok(rows)
}
