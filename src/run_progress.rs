//! What `parc run` prints while it trains: a human progress line (step, bar, loss, lr,
//! tokens/s, ETA) on stderr, or one JSON object per step on stdout (`--log-format json`), and a
//! final summary in either form, which [`finish_report`] follows with the profiled step and the
//! memory the backend held.
//!
//! JSON lines: `{"event":"step","step":N,"loss":…,"lr":…,"grad_norm":…,"tokens":…,
//! "tokens_per_s":…,"elapsed_s":…,"loss_scale":…,"skipped":…,"val_loss":…,"saving":…,
//! "save_s":…,"save_wait_s":…}` where `step` counts
//! completed steps (1-based, so the last line of a run has `step = train.steps`), then one
//! `{"event":"summary",…}` line. `loss_scale` is the fp16 loss scale the step used (null in
//! other precisions); `skipped` is true for a step whose gradients overflowed (its update was
//! skipped); `val_loss` is the validation loss of a step after which `train.eval` ran (null on
//! the others); `saving` is true for a step that ran while a checkpoint was written in the
//! background, and `save_s` is what the checkpoint save started after the step cost the step
//! loop (the snapshot copy, any wait for the previous save, which `save_wait_s` gives, and, for
//! `checkpoint.async = false`, the whole write; null where no save started). A step whose save
//! waited for the previous one says so on its human line. A skipped step's human line, and an evaluated step's (`… loss 2.5000  val
//! 2.3456 (ppl 10.45) …`), are always printed (and kept on a terminal). The summary's
//! `memory_reserved_bytes` is the most memory one rank's backend held, over all ranks also when
//! each rank is its own process (null when the run does not know it); its `val_loss` and
//! `val_ppl` are the last evaluation's (null without one).
//! Throughput: a step's `tokens_per_s` is its own; the summary's `tokens_per_s` averages over
//! the whole run, warm-up included, and `tokens_per_s_after_first` over the steps after the
//! first (which compiles, times algorithms and loads data; null for a run of one step), which is
//! the figure the human summary gives: `… 85.1k tok/s (after the first step)`.
//! Until the first step ends, a human run says on stderr that it is still in it (see
//! [`Waiting`]); JSON runs print nothing extra.
//! `train.sample`'s samples: `sample at step N:` and the text on stderr, or
//! `{"event":"sample","step":N,"text":…}` (steps done, as `step`'s).
use crate::report::bytes;
use parc_runtime::data::EpochProgress;
use parc_runtime::exec::{LossScaleStep, StepRecord};
use parc_runtime::generate::SampleSink;
use serde_json::json;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Human,
    Json,
}

/// Renders step records as they arrive.
pub struct Progress {
    format: LogFormat,
    total_steps: u64,
    log_every: u64,
    /// Rewrite one line in place (stderr is a terminal) instead of printing a line per step.
    in_place: bool,
    /// The first step this run reports (a resumed run starts past 0), `u64::MAX` until then:
    /// rates and the ETA count from it.
    first_step: AtomicU64,
    /// The status line while the first step runs (human format), until a step arrives.
    waiting: Mutex<Option<Waiting>>,
}

/// What a human run prints while its first step has not ended (compiling the plan, timing
/// algorithms, loading data): on a terminal a line rewritten every second with a spinner and
/// the time so far, else a line after `first_note` and then every `every`. The first step's
/// line (or the end of the run) stops it.
pub struct Waiting {
    state: Arc<(Mutex<WaitState>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct WaitState {
    /// A step arrived or the run ended.
    done: bool,
    /// A line is on a terminal, to clear if the run ends without a step.
    shown: bool,
}

/// Where [`Waiting`] writes, and how.
pub struct WaitSink {
    pub out: Box<dyn Write + Send>,
    /// Rewrite one line in place (a terminal).
    pub in_place: bool,
    /// The first note's delay, then the interval between notes (lines not in place).
    pub first_note: Duration,
    pub every: Duration,
}

const SPINNER: [char; 4] = ['|', '/', '-', '\\'];

/// The status line of a run `seconds` into its first step.
pub fn waiting_line(total_steps: u64, seconds: f64) -> String {
    format!(
        "step 1/{total_steps}: compiling, timing algorithms and loading data (the first step \
         does it once)… {}",
        format_duration(seconds)
    )
}

impl Waiting {
    pub fn start(total_steps: u64, mut sink: WaitSink) -> Waiting {
        let state: Arc<(Mutex<WaitState>, Condvar)> = Arc::default();
        let shared = Arc::clone(&state);
        let thread = std::thread::spawn(move || {
            let started = Instant::now();
            let (lock, wake) = &*shared;
            let mut next = sink.first_note;
            let mut turn = 0;
            loop {
                let Ok(guard) = lock.lock() else { return };
                let wait = next.saturating_sub(started.elapsed());
                let Ok((mut state, _)) = wake.wait_timeout_while(guard, wait, |s| !s.done) else {
                    return;
                };
                if state.done {
                    return;
                }
                let line = waiting_line(total_steps, started.elapsed().as_secs_f64());
                let _ = if sink.in_place {
                    turn += 1;
                    write!(sink.out, "\r{} {line}\x1b[K", SPINNER[turn % SPINNER.len()])
                } else {
                    writeln!(sink.out, "{line}")
                };
                let _ = sink.out.flush();
                state.shown = sink.in_place;
                next = started.elapsed()
                    + if sink.in_place {
                        Duration::from_secs(1)
                    } else {
                        sink.every
                    };
            }
        });
        Waiting {
            state,
            thread: Some(thread),
        }
    }

    /// Stop: a step's line comes next (it overwrites a line in place). Holding the lock while
    /// marking done, so no status line is written after this returns.
    fn stop(&mut self) -> bool {
        let (lock, wake) = &*self.state;
        let shown = lock.lock().is_ok_and(|mut state| {
            state.done = true;
            state.shown
        });
        wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        shown
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.thread.is_some() && self.stop() {
            // The run ended without a step: clear the status line for what follows.
            eprint!("\r\x1b[K");
        }
    }
}

/// `h:mm:ss` or `m:ss`.
pub fn format_duration(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    let (h, m, s) = (s / 3600, (s / 60) % 60, s % 60);
    if h > 0 {
        format!("{h}:{m:02}:{s:02}")
    } else {
        format!("{m}:{s:02}")
    }
}

/// `950`, `12.3k`, `4.56M`.
pub fn format_rate(per_s: f64) -> String {
    if per_s >= 1e6 {
        format!("{:.2}M", per_s / 1e6)
    } else if per_s >= 1e3 {
        format!("{:.1}k", per_s / 1e3)
    } else {
        format!("{per_s:.0}")
    }
}

/// Seconds left for the remaining steps at the average pace of the steps run so far.
pub fn eta_seconds(record: &StepRecord, first_step: u64, total_steps: u64) -> f64 {
    let done = record.step + 1 - first_step;
    let left = total_steps.saturating_sub(record.step + 1);
    record.elapsed_s / done.max(1) as f64 * left as f64
}

/// A loss scale for people: `65536`, or `1.329e36` past nine digits.
fn format_scale(scale: f64) -> String {
    if scale.fract() == 0.0 && scale < 1e9 {
        format!("{scale}")
    } else {
        format!("{scale:.3e}")
    }
}

/// `scale 65536`, `scale 1024 → 2048`, or `skipped (overflow), scale 32768 → 16384`.
fn scale_note(step: &LossScaleStep) -> String {
    let scale = if step.next_scale == step.scale {
        format!("scale {}", format_scale(step.scale))
    } else {
        format!(
            "scale {} → {}",
            format_scale(step.scale),
            format_scale(step.next_scale)
        )
    };
    if step.skipped {
        format!("skipped (overflow), {scale}")
    } else {
        scale
    }
}

fn skipped(record: &StepRecord) -> bool {
    record.loss_scale.is_some_and(|s| s.skipped) || record.skipped_nonfinite
}

/// A line that stays on a terminal: a skipped step's, an evaluated one's, or one that waited
/// for a checkpoint.
fn kept(record: &StepRecord) -> bool {
    skipped(record) || record.val_loss.is_some() || save_waited(record).is_some()
}

/// The seconds a checkpoint save after `record`'s step waited for the previous save, when
/// that was long enough to mention (a tenth of a second or more).
fn save_waited(record: &StepRecord) -> Option<f64> {
    record
        .save
        .map(|s| s.waited_s)
        .filter(|&waited| waited >= 0.1)
}

/// Perplexity: e to the mean token cross-entropy.
fn perplexity(loss: f32) -> f64 {
    f64::from(loss).exp()
}

/// `val 2.3456 (ppl 10.45)`.
fn val_note(loss: f32) -> String {
    format!("val {loss:.4} (ppl {:.2})", perplexity(loss))
}

/// The human progress line for `record`.
pub fn human_line(record: &StepRecord, first_step: u64, total_steps: u64) -> String {
    const WIDTH: u64 = 20;
    let done = record.step + 1;
    let filled = (done * WIDTH)
        .checked_div(total_steps)
        .unwrap_or(WIDTH)
        .min(WIDTH) as usize;
    let bar = format!(
        "{}{}",
        "#".repeat(filled),
        "-".repeat(WIDTH as usize - filled)
    );
    let digits = total_steps.to_string().len();
    let val = record
        .val_loss
        .map_or_else(String::new, |loss| format!("  {}", val_note(loss)));
    let mut line = format!(
        "step {done:>digits$}/{total_steps} [{bar}] loss {:.4}{val}  lr {:.2e}  {} tok/s  ETA {}",
        record.loss,
        record.lr,
        format_rate(record.tokens_per_s),
        format_duration(eta_seconds(record, first_step, total_steps))
    );
    if let Some(step) = &record.loss_scale {
        line.push_str("  ");
        line.push_str(&scale_note(step));
    }
    if record.skipped_nonfinite {
        line.push_str("  skipped (non-finite gradients)");
    }
    if let Some(waited) = save_waited(record) {
        line.push_str(&format!(
            "  waited {waited:.1}s for the previous checkpoint to finish writing"
        ));
    }
    line
}

/// The JSON line for `record`.
pub fn json_line(record: &StepRecord) -> String {
    json!({
        "event": "step",
        "step": record.step + 1,
        "loss": record.loss,
        "lr": record.lr,
        "grad_norm": record.grad_norm,
        "tokens": record.tokens,
        "tokens_per_s": record.tokens_per_s,
        "elapsed_s": record.elapsed_s,
        "loss_scale": record.loss_scale.map(|s| s.scale),
        "skipped": skipped(record),
        "val_loss": record.val_loss,
        "saving": record.saving,
        "save_s": record.save.map(|s| s.total_s),
        "save_wait_s": record.save.map(|s| s.waited_s),
    })
    .to_string()
}

/// What the summary reports about a finished run.
pub struct Summary<'a> {
    pub records: &'a [StepRecord],
    pub epochs: &'a [EpochProgress],
    pub checkpoints: &'a [PathBuf],
    /// The final parameters as global tensors, when the run checkpoints.
    pub model_export: Option<&'a PathBuf>,
    pub backend: &'a str,
    pub world: u32,
    /// The most memory one rank's backend held (`TrainResult::reserved_bytes`), when known.
    pub reserved_bytes: Option<u64>,
}

impl Summary<'_> {
    fn tokens_per_s(&self) -> f64 {
        let tokens: u64 = self.records.iter().map(|r| r.tokens).sum();
        let elapsed = self.records.last().map_or(0.0, |r| r.elapsed_s);
        if elapsed > 0.0 {
            tokens as f64 / elapsed
        } else {
            0.0
        }
    }

    /// Tokens per second over the steps after the first (the warm-up: compiling, timing
    /// algorithms, loading data); `None` for a run of one step.
    fn tokens_per_s_after_first(&self) -> Option<f64> {
        let [first, rest @ ..] = self.records else {
            return None;
        };
        let last = rest.last()?;
        let tokens: u64 = rest.iter().map(|r| r.tokens).sum();
        let elapsed = last.elapsed_s - first.elapsed_s;
        Some(if elapsed > 0.0 {
            tokens as f64 / elapsed
        } else {
            0.0
        })
    }

    /// The human summary's throughput: after the first step, or the one step's with its
    /// warm-up.
    fn throughput_note(&self) -> String {
        match self.tokens_per_s_after_first() {
            Some(rate) => format!("{} tok/s (after the first step)", format_rate(rate)),
            None => format!(
                "{} tok/s (one step, warm-up included)",
                format_rate(self.tokens_per_s())
            ),
        }
    }

    pub fn json(&self) -> String {
        let first = self.records.first();
        let last = self.records.last();
        json!({
            "event": "summary",
            "steps": last.map_or(0, |r| r.step + 1),
            "steps_run": self.records.len(),
            "first_loss": first.map(|r| r.loss),
            "final_loss": last.map(|r| r.loss),
            "elapsed_s": last.map_or(0.0, |r| r.elapsed_s),
            "tokens_per_s": self.tokens_per_s(),
            "tokens_per_s_after_first": self.tokens_per_s_after_first(),
            "backend": self.backend,
            "world": self.world,
            "epochs": self.epochs.iter().map(|e| json!({
                "epoch": e.epoch, "samples_seen": e.seen, "samples": e.total,
            })).collect::<Vec<_>>(),
            "checkpoints": self.checkpoints.iter().map(|p| p.display().to_string())
                .collect::<Vec<_>>(),
            "model": self.model_export.map(|p| p.display().to_string()),
            "skipped_steps": self.skipped_steps(),
            "loss_scale": last.and_then(|r| r.loss_scale).map(|s| s.next_scale),
            "memory_reserved_bytes": self.reserved_bytes,
            "val_loss": self.last_eval().map(|(_, loss)| loss),
            "val_ppl": self.last_eval().map(|(_, loss)| perplexity(loss)),
        })
        .to_string()
    }

    /// The last evaluation: its step (1-based) and validation loss.
    fn last_eval(&self) -> Option<(u64, f32)> {
        self.records
            .iter()
            .rev()
            .find_map(|r| Some((r.step + 1, r.val_loss?)))
    }

    /// Steps whose update was skipped because their gradients overflowed (fp16) or were not
    /// finite (`train.on_nonfinite = skip { … }`).
    fn skipped_steps(&self) -> usize {
        self.records.iter().filter(|r| skipped(r)).count()
    }

    pub fn human(&self) -> String {
        let (Some(first), Some(last)) = (self.records.first(), self.records.last()) else {
            // A resumed checkpoint at or past train.steps: nothing trains, but the final
            // parameters are still written (the way to get a step's global model).
            let mut text = "nothing to do: the resumed checkpoint had already reached \
                            train.steps (raise it, e.g. --set train.steps=N, to train on)"
                .to_string();
            if let Some(path) = self.model_export {
                text.push_str(&format!("\nfinal parameters: {}", path.display()));
            }
            return text;
        };
        let epochs: Vec<String> = self
            .epochs
            .iter()
            .map(|e| format!("epoch {} {}/{}", e.epoch, e.seen, e.total))
            .collect();
        let mut text = format!(
            "done: {} steps in {} on {} rank{} ({}), loss {:.4} → {:.4}, {}\n\
             samples seen: {}",
            self.records.len(),
            format_duration(last.elapsed_s),
            self.world,
            if self.world == 1 { "" } else { "s" },
            self.backend,
            first.loss,
            last.loss,
            self.throughput_note(),
            epochs.join(", ")
        );
        if let Some((step, loss)) = self.last_eval() {
            text.push_str(&format!(
                "\nvalidation after step {step}: {}",
                val_note(loss)
            ));
        }
        if let Some(scale) = last.loss_scale {
            text.push_str(&format!(
                "\nfp16 loss scale: {} at the end; {} of {} steps skipped (overflow)",
                format_scale(scale.next_scale),
                self.skipped_steps(),
                self.records.len()
            ));
        }
        let nonfinite = self.records.iter().filter(|r| r.skipped_nonfinite).count();
        if nonfinite > 0 {
            text.push_str(&format!(
                "\n{nonfinite} of {} steps skipped (non-finite gradients, train.on_nonfinite)",
                self.records.len()
            ));
        }
        if let Some(path) = self.checkpoints.last() {
            text.push_str(&format!("\nlast checkpoint: {}", path.display()));
        }
        if let Some(path) = self.model_export {
            text.push_str(&format!("\nfinal parameters: {}", path.display()));
        }
        text
    }
}

impl Progress {
    pub fn new(format: LogFormat, total_steps: u64, log_every: u64, in_place: bool) -> Progress {
        Progress {
            format,
            total_steps,
            log_every: log_every.max(1),
            in_place,
            first_step: AtomicU64::new(u64::MAX),
            waiting: Mutex::new(None),
        }
    }

    /// Say on stderr, until the first step's record arrives, that the first step is still
    /// running (human format; see [`Waiting`]).
    pub fn show_first_step(&self) {
        if self.format != LogFormat::Human {
            return;
        }
        let waiting = Waiting::start(
            self.total_steps,
            WaitSink {
                out: Box::new(std::io::stderr()),
                in_place: self.in_place,
                first_note: Duration::from_secs(if self.in_place { 1 } else { 10 }),
                every: Duration::from_secs(60),
            },
        );
        if let Ok(mut slot) = self.waiting.lock() {
            *slot = Some(waiting);
        }
    }

    /// Print `record`: every step as JSON; as a human line every `log_every` steps (and the
    /// first and last, and every skipped step), or every step when the line is rewritten in
    /// place (a skipped step's line is kept).
    pub fn step(&self, record: &StepRecord) {
        let _ = self.first_step.compare_exchange(
            u64::MAX,
            record.step,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        if let Ok(mut waiting) = self.waiting.lock() {
            if let Some(mut waiting) = waiting.take() {
                waiting.stop();
            }
        }
        let first_step = self.first_step.load(Ordering::Relaxed);
        let done = record.step + 1;
        let due = self.in_place
            || done.is_multiple_of(self.log_every)
            || done == self.total_steps
            || record.step == first_step
            || kept(record);
        if self.format == LogFormat::Human && !due {
            return;
        }
        match self.format {
            LogFormat::Json => {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{}", json_line(record));
                let _ = out.flush();
            }
            LogFormat::Human => {
                let line = human_line(record, first_step, self.total_steps);
                let mut err = std::io::stderr().lock();
                if self.in_place && !kept(record) {
                    let _ = write!(err, "\r{line}\x1b[K");
                } else if self.in_place {
                    let _ = writeln!(err, "\r{line}\x1b[K");
                } else {
                    let _ = writeln!(err, "{line}");
                }
                let _ = err.flush();
            }
        }
    }

    pub fn finish(&self, summary: &Summary<'_>) {
        // A run with no step: its status line is cleared (dropping it).
        if let Ok(mut waiting) = self.waiting.lock() {
            waiting.take();
        }
        match self.format {
            LogFormat::Json => println!("{}", summary.json()),
            LogFormat::Human => {
                if self.in_place {
                    eprintln!();
                }
                eprintln!("{}", summary.human());
            }
        }
    }
}

/// Where `train.sample`'s samples go in `format` (see the module docs).
pub fn sample_sink(format: LogFormat) -> SampleSink {
    SampleSink::new(move |step, text| match format {
        LogFormat::Json => {
            let line = json!({"event": "sample", "step": step, "text": text});
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }
        LogFormat::Human => {
            let mut err = std::io::stderr().lock();
            // Below a progress line rewritten in place, not over it.
            let start = if err.is_terminal() { "\r\x1b[K" } else { "" };
            let _ = write!(err, "{start}sample at step {step}:\n{text}\n");
            let _ = err.flush();
        }
    })
}

/// What the report rank prints when training has ended: the profiled step as JSON (before the
/// summary line), the summary, then in the human format the memory the backend held and the
/// profile's table.
pub(crate) fn finish_report(
    progress: &Progress,
    summary: &Summary,
    profile: Option<&crate::run_profile::Profiled>,
    format: LogFormat,
) {
    if let (Some(profile), LogFormat::Json) = (profile, format) {
        println!("{}", crate::run_profile::json(profile));
    }
    progress.finish(summary);
    if format == LogFormat::Human {
        if let Some(reserved) = summary.reserved_bytes {
            print_reserved(summary.backend, reserved);
        }
        if let Some(profile) = profile {
            eprint!("{}", crate::run_profile::human(profile));
        }
    }
}

/// The human summary's line on the most memory one rank's backend held.
fn print_reserved(backend: &str, reserved: u64) {
    eprintln!(
        "memory held by the {backend} backend: {} per rank at most (buffers as planned, scratch, \
         workspace)",
        bytes(reserved as f64)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The summary of `records` of a one-rank CPU run with no epochs, checkpoints or memory.
    fn cpu_summary(records: &[StepRecord]) -> Summary<'_> {
        Summary {
            records,
            epochs: &[],
            checkpoints: &[],
            model_export: None,
            backend: "cpu",
            world: 1,
            reserved_bytes: None,
        }
    }

    fn record(step: u64, elapsed_s: f64) -> StepRecord {
        StepRecord {
            stage: parc_runtime::exec::RecordStage::Complete,
            step,
            loss: 2.5,
            lr: 6e-4,
            grad_norm: 1.25,
            tokens: 512,
            tokens_per_s: 12_345.0,
            elapsed_s,
            loss_scale: None,
            skipped_nonfinite: false,
            memory_bytes: None,
            val_loss: None,
            saving: false,
            save: None,
        }
    }

    #[test]
    fn the_closing_throughput_leaves_out_the_first_step() {
        // The first step (compiling) took 10 s, the two after it 1 s each for 512 tokens.
        let records = [record(0, 10.0), record(1, 11.0), record(2, 12.0)];
        let summary = cpu_summary(&records);
        let human = summary.human();
        assert!(
            human.contains(", 512 tok/s (after the first step)\n"),
            "{human}"
        );
        let value: serde_json::Value = serde_json::from_str(&summary.json()).unwrap();
        assert_eq!(value["tokens_per_s_after_first"], 512.0);
        assert_eq!(value["tokens_per_s"], 128.0);
        let one = Summary {
            records: &records[..1],
            ..summary
        };
        assert!(one
            .human()
            .contains("51 tok/s (one step, warm-up included)"));
        let value: serde_json::Value = serde_json::from_str(&one.json()).unwrap();
        assert!(value["tokens_per_s_after_first"].is_null());
    }

    /// A `Write` whose bytes a test reads back.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn sink(out: &Shared, in_place: bool) -> WaitSink {
        WaitSink {
            out: Box::new(out.clone()),
            in_place,
            first_note: Duration::from_millis(20),
            every: Duration::from_millis(20),
        }
    }

    #[test]
    fn a_long_first_step_says_so_until_it_ends() {
        let out = Shared::default();
        let mut waiting = Waiting::start(40, sink(&out, false));
        std::thread::sleep(Duration::from_millis(110));
        assert!(!waiting.stop(), "lines, not a line in place");
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.len() >= 2, "{text}");
        assert_eq!(lines[0], waiting_line(40, 0.0));
        // Nothing after the stop.
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(out.0.lock().unwrap().len(), text.len());
        // A first step sooner than the first note: nothing at all.
        let quiet = Shared::default();
        let mut fast = Waiting::start(
            40,
            WaitSink {
                first_note: Duration::from_secs(5),
                ..sink(&quiet, true)
            },
        );
        assert!(!fast.stop());
        assert!(quiet.0.lock().unwrap().is_empty());
        // On a terminal the line is rewritten in place.
        let terminal = Shared::default();
        let mut spinning = Waiting::start(3, sink(&terminal, true));
        std::thread::sleep(Duration::from_millis(60));
        assert!(spinning.stop());
        let text = String::from_utf8(terminal.0.lock().unwrap().clone()).unwrap();
        assert!(
            text.starts_with("\r/ step 1/3: compiling") && !text.contains('\n'),
            "{text:?}"
        );
    }

    #[test]
    fn durations_rates_and_eta() {
        assert_eq!(format_duration(59.6), "1:00");
        assert_eq!(format_duration(3725.0), "1:02:05");
        assert_eq!(format_rate(950.0), "950");
        assert_eq!(format_rate(12_345.0), "12.3k");
        assert_eq!(format_rate(4_560_000.0), "4.56M");
        // 10 steps (0..=9) took 5 s: 90 left at 0.5 s each.
        assert_eq!(eta_seconds(&record(9, 5.0), 0, 100), 45.0);
        // Resumed at step 50: 10 steps (50..=59) in 5 s, 40 left.
        assert_eq!(eta_seconds(&record(59, 5.0), 50, 100), 20.0);
    }

    #[test]
    fn the_human_line_has_step_bar_loss_lr_rate_and_eta() {
        let line = human_line(&record(49, 10.0), 0, 200);
        assert_eq!(
            line,
            "step  50/200 [#####---------------] loss 2.5000  lr 6.00e-4  12.3k tok/s  ETA 0:30"
        );
    }

    #[test]
    fn steps_show_background_saves_and_a_wait_for_the_previous_one() {
        let mut saved = record(9, 3.0);
        saved.saving = true;
        saved.save = Some(parc_runtime::exec::SaveStall {
            waited_s: 1.34,
            total_s: 1.5,
        });
        let value: serde_json::Value = serde_json::from_str(&json_line(&saved)).unwrap();
        assert_eq!(value["saving"], true);
        assert_eq!(
            (value["save_s"].as_f64(), value["save_wait_s"].as_f64()),
            (Some(1.5), Some(1.34))
        );
        let line = human_line(&saved, 0, 20);
        assert!(
            line.ends_with("waited 1.3s for the previous checkpoint to finish writing"),
            "{line}"
        );
        assert!(kept(&saved));
        let plain: serde_json::Value = serde_json::from_str(&json_line(&record(1, 1.0))).unwrap();
        assert!(plain["save_s"].is_null() && plain["saving"] == false);
        assert!(!human_line(&record(1, 1.0), 0, 20).contains("waited"));
    }

    #[test]
    fn json_lines_carry_every_field_and_count_steps_from_one() {
        let value: serde_json::Value = serde_json::from_str(&json_line(&record(0, 0.5))).unwrap();
        assert_eq!(value["event"], "step");
        assert_eq!(value["step"], 1);
        assert_eq!(value["tokens"], 512);
        for key in ["loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"] {
            assert!(value[key].is_number(), "{key}");
        }
        let records = [record(0, 1.0), record(1, 2.0)];
        let epochs = [EpochProgress {
            epoch: 0,
            seen: 16,
            total: 100,
        }];
        let summary = Summary {
            records: &records,
            epochs: &epochs,
            checkpoints: &[],
            model_export: None,
            backend: "cpu",
            world: 2,
            reserved_bytes: Some(4096),
        };
        let value: serde_json::Value = serde_json::from_str(&summary.json()).unwrap();
        assert_eq!(value["event"], "summary");
        assert_eq!(value["steps"], 2);
        assert_eq!(value["tokens_per_s"], 512.0);
        assert_eq!(value["epochs"][0]["samples_seen"], 16);
        assert_eq!(value["memory_reserved_bytes"], 4096);
        assert_eq!(value["skipped_steps"], 0);
        assert!(value["loss_scale"].is_null());
        assert!(summary.human().contains("samples seen: epoch 0 16/100"));
    }

    #[test]
    fn evaluated_steps_show_validation_loss_and_perplexity() {
        let mut evaluated = record(49, 10.0);
        evaluated.val_loss = Some(2.3456);
        assert_eq!(
            human_line(&evaluated, 0, 200),
            "step  50/200 [#####---------------] loss 2.5000  val 2.3456 (ppl 10.44)  lr 6.00e-4  \
             12.3k tok/s  ETA 0:30"
        );
        let value: serde_json::Value = serde_json::from_str(&json_line(&evaluated)).unwrap();
        assert_eq!(value["val_loss"], f64::from(2.3456f32));
        let plain: serde_json::Value = serde_json::from_str(&json_line(&record(50, 10.2))).unwrap();
        assert!(plain["val_loss"].is_null());
        let records = [evaluated, record(50, 10.2)];
        let summary = cpu_summary(&records);
        let value: serde_json::Value = serde_json::from_str(&summary.json()).unwrap();
        assert_eq!(value["val_loss"], f64::from(2.3456f32));
        let ppl = value["val_ppl"].as_f64().unwrap();
        assert!((ppl - 2.3456f64.exp()).abs() < 1e-5, "{ppl}");
        assert!(
            summary
                .human()
                .contains("validation after step 50: val 2.3456 (ppl 10.44)"),
            "{}",
            summary.human()
        );
        let none = Summary {
            records: &records[1..],
            ..summary
        };
        let value: serde_json::Value = serde_json::from_str(&none.json()).unwrap();
        assert!(value["val_loss"].is_null() && value["val_ppl"].is_null());
    }

    /// A resume at or past train.steps trains nothing but still names the model it wrote.
    #[test]
    fn nothing_to_do_still_names_the_final_parameters() {
        let model = PathBuf::from("ckpt/model.safetensors");
        let summary = Summary {
            records: &[],
            epochs: &[],
            checkpoints: &[],
            model_export: Some(&model),
            backend: "cpu",
            world: 1,
            reserved_bytes: None,
        };
        let text = summary.human();
        assert!(
            text.starts_with("nothing to do: the resumed checkpoint"),
            "{text}"
        );
        assert!(
            text.ends_with("final parameters: ckpt/model.safetensors"),
            "{text}"
        );
    }

    #[test]
    fn fp16_steps_show_their_scale_and_skips() {
        let mut skipped = record(4, 1.0);
        skipped.grad_norm = f32::INFINITY;
        skipped.loss_scale = Some(LossScaleStep {
            scale: 32768.0,
            next_scale: 16384.0,
            skipped: true,
            exhausted: false,
        });
        let line = human_line(&skipped, 0, 200);
        assert!(
            line.ends_with("  skipped (overflow), scale 32768 → 16384"),
            "{line}"
        );
        let value: serde_json::Value = serde_json::from_str(&json_line(&skipped)).unwrap();
        assert_eq!(value["skipped"], true);
        assert_eq!(value["loss_scale"], 32768.0);
        assert!(value["grad_norm"].is_null());
        let mut grown = record(5, 1.2);
        grown.loss_scale = Some(LossScaleStep {
            scale: 16384.0,
            next_scale: 32768.0,
            skipped: false,
            exhausted: false,
        });
        assert!(human_line(&grown, 0, 200).ends_with("  scale 16384 → 32768"));
        let value: serde_json::Value = serde_json::from_str(&json_line(&grown)).unwrap();
        assert_eq!(value["skipped"], false);
        let plain: serde_json::Value = serde_json::from_str(&json_line(&record(0, 0.1))).unwrap();
        assert!(plain["loss_scale"].is_null() && plain["skipped"] == false);
        let records = [skipped, grown];
        let summary = cpu_summary(&records);
        let value: serde_json::Value = serde_json::from_str(&summary.json()).unwrap();
        assert_eq!(value["skipped_steps"], 1);
        assert_eq!(value["loss_scale"], 32768.0);
        assert!(summary
            .human()
            .contains("fp16 loss scale: 32768 at the end; 1 of 2 steps skipped (overflow)"));
        assert_eq!(format_scale(2f64.powi(120)), "1.329e36");
    }

    #[test]
    fn steps_skipped_for_non_finite_gradients_are_shown_and_counted() {
        let mut skipped = record(1, 1.0);
        skipped.grad_norm = f32::NAN;
        skipped.skipped_nonfinite = true;
        let line = human_line(&skipped, 0, 200);
        assert!(line.ends_with("  skipped (non-finite gradients)"), "{line}");
        let value: serde_json::Value = serde_json::from_str(&json_line(&skipped)).unwrap();
        assert_eq!(value["skipped"], true);
        let records = [record(0, 0.5), skipped];
        let summary = cpu_summary(&records);
        let value: serde_json::Value = serde_json::from_str(&summary.json()).unwrap();
        assert_eq!(value["skipped_steps"], 1);
        let human = summary.human();
        assert!(
            human.contains("1 of 2 steps skipped (non-finite gradients, train.on_nonfinite)"),
            "{human}"
        );
    }
}
