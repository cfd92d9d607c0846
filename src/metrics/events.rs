//! TensorBoard event files: `DIR/events.out.tfevents.<secs>.<host>.<pid>`, TFRecords of
//! `Event` protobufs (tensorflow/core/util/event.proto and framework/summary.proto; only the
//! fields parc writes are declared here, with their numbers from those files). The first event
//! names the format (`file_version: "brain.Event:2"`), then one event per step carries a
//! `Summary` with a `simple_value` for each of the row's metrics that has a tag
//! ([`Metric::tag`]). [`EventWriter`] writes one file and flushes per step; [`read_event_file`]
//! reads one back, checksums verified.

use super::tfrecord;
use super::{Metric, Row};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// What the first event of a file names: the event format TensorBoard reads.
const FILE_VERSION: &str = "brain.Event:2";

/// The prefix of an event file's name.
const PREFIX: &str = "events.out.tfevents.";

#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `Summary.Value`: a tag and (of its `value` oneof, whose other members parc does not write)
/// the scalar. Optional, so that a 0.0 is written and TensorBoard sees the oneof set.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// Writes one event file.
pub struct EventWriter {
    path: PathBuf,
    file: File,
}

impl EventWriter {
    /// A new event file in `dir`, its first event written.
    pub fn create(dir: &Path) -> Result<EventWriter, String> {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let host = parc_runtime::launch::rendezvous::host_name();
        let name = format!("{PREFIX}{secs}.{host}.{}", std::process::id());
        let path = dir.join(name);
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let mut writer = EventWriter { path, file };
        writer.append(&Event {
            wall_time: wall_time(),
            step: 0,
            what: Some(What::FileVersion(FILE_VERSION.to_string())),
        })?;
        Ok(writer)
    }

    /// `row`'s scalars as one event at its step.
    pub fn write(&mut self, row: &Row) -> Result<(), String> {
        let value = Metric::ALL
            .into_iter()
            .filter_map(|metric| {
                let tag = metric.tag()?;
                let value = row.get(metric)?;
                Some(SummaryValue {
                    tag: tag.to_string(),
                    simple_value: Some(value as f32),
                })
            })
            .collect();
        self.append(&Event {
            wall_time: wall_time(),
            step: i64::try_from(row.step).unwrap_or(i64::MAX),
            what: Some(What::Summary(Summary { value })),
        })
    }

    fn append(&mut self, event: &Event) -> Result<(), String> {
        let record = tfrecord::frame(&prost::Message::encode_to_vec(event));
        self.file
            .write_all(&record)
            .and_then(|()| self.file.flush())
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))
    }
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The event files in `dir`.
pub fn event_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    Ok(entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with(PREFIX))
        })
        .collect())
}

/// What one event file holds.
pub struct EventFile {
    /// The wall time of its first event (when its run started), in seconds since 1970.
    pub started: f64,
    /// For each of its summary events, the step and the metrics it holds (tags parc does not
    /// write are left out).
    pub scalars: Vec<(u64, Vec<(Metric, f64)>)>,
}

/// Read the event file at `path`, every record's checksums verified: a corrupt or truncated
/// file is an error naming the file and the byte offset of the bad record.
pub fn read_event_file(path: &Path) -> Result<EventFile, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let records = tfrecord::records(&bytes).map_err(|c| {
        format!(
            "{}: corrupt event file at byte offset {}: {}",
            path.display(),
            c.offset,
            c.what
        )
    })?;
    let mut file = EventFile {
        started: f64::INFINITY,
        scalars: Vec::new(),
    };
    for (offset, data) in records {
        let event: Event = prost::Message::decode(data).map_err(|e| {
            format!(
                "{}: the record at byte offset {offset} is not a TensorBoard event: {e}",
                path.display()
            )
        })?;
        file.started = file.started.min(event.wall_time);
        if let Some(What::Summary(summary)) = event.what {
            let values = summary
                .value
                .iter()
                .filter_map(|v| Some((Metric::from_tag(&v.tag)?, f64::from(v.simple_value?))))
                .collect();
            file.scalars
                .push((u64::try_from(event.step).unwrap_or(0), values));
        }
    }
    Ok(file)
}
