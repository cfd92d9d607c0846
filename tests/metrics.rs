//! `parc run --metrics DIR` and `parc plot` through the binary: a short run's metrics.csv and
//! TensorBoard event file read back (every record's checksums verified) with the run's losses;
//! a run killed mid-way keeps its rows, and resuming it appends to them (no header twice, no
//! step twice) in a new event file; a corrupt or truncated event file is an error naming the
//! file and the byte offset; `parc plot` overlays two runs as SVG and PNG, from their CSVs or
//! their event files alone; bad input (a folder that is no metrics folder, an empty CSV, an
//! unknown metric, an unwritable --metrics folder) is a clear error.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "cli_support/mod.rs"]
mod cli_support;
/// The binary's metrics module (what `parc plot` reads with), compiled into this test.
#[path = "../src/metrics/mod.rs"]
#[allow(dead_code)]
mod metrics;

use cli_support::{json_lines, parc, parc_ok, stderr_of, steps};
use metrics::{read_event_file, read_run, Metric};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const HEADER: &str =
    "step,loss,val_loss,lr,grad_norm,tokens,tokens_per_s,mfu,memory_bytes,elapsed_s";

fn temp_dir(name: &str) -> PathBuf {
    cli_support::temp_dir("metrics", name)
}

/// `parc run` of the tiny example, small, with JSON lines, `steps` steps and `extra` arguments.
fn run_args(steps: u32, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["run", "examples/tiny.par", "--log-format", "json"]
        .map(String::from)
        .to_vec();
    for set in [
        "train.micro_batch=2".to_string(),
        "train.global_batch=4".to_string(),
        format!("train.steps={steps}"),
    ] {
        args.extend(["--set".to_string(), set]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn run_ok(steps: u32, extra: &[&str]) -> Output {
    let args = run_args(steps, extra);
    parc_ok(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// (step, loss) of each JSON step line.
fn json_losses(out: &Output) -> Vec<(u64, f32)> {
    steps(&json_lines(out))
        .iter()
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap() as f32,
            )
        })
        .collect()
}

/// (step, loss) of each row `read_run` reads from `dir`.
fn read_losses(dir: &Path) -> Vec<(u64, f32)> {
    read_run(dir)
        .unwrap()
        .iter()
        .map(|r| (r.step, r.get(Metric::Loss).unwrap() as f32))
        .collect()
}

fn event_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("events.out.tfevents.")
        })
        .collect();
    files.sort();
    files
}

fn path_arg(path: &Path) -> String {
    path.display().to_string()
}

#[test]
fn a_run_s_csv_and_event_file_read_back_with_its_losses() {
    let dir = temp_dir("run").join("nested/metrics");
    let out = run_ok(4, &["--metrics", &path_arg(&dir)]);
    let losses = json_losses(&out);
    assert_eq!(losses.len(), 4);

    let text = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], HEADER);
    assert_eq!(lines.len(), 5, "{text}");
    assert_eq!(read_losses(&dir), losses);
    let rows = read_run(&dir).unwrap();
    let json = json_lines(&out);
    let json = steps(&json);
    // The MFU of a step times its seconds is the run's MFU at one second, on every step.
    let mfu_second = |r: &metrics::Row| {
        r.get(Metric::Mfu).unwrap() * r.get(Metric::Tokens).unwrap()
            / r.get(Metric::TokensPerS).unwrap()
    };
    for (row, line) in rows.iter().zip(&json) {
        assert_eq!(row.get(Metric::Lr), line["lr"].as_f64());
        assert_eq!(row.get(Metric::Tokens), Some(256.0));
        assert_eq!(
            row.get(Metric::ValLoss),
            None,
            "no train.eval: an empty cell"
        );
        assert!(row.get(Metric::MemoryBytes).unwrap() > 0.0);
        assert!(row.get(Metric::ElapsedS).unwrap() > 0.0);
        let relative = (mfu_second(row) - mfu_second(&rows[0])).abs() / mfu_second(&rows[0]);
        assert!(mfu_second(row) > 0.0 && relative < 1e-9, "{row:?}");
    }

    let files = event_files(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(std::fs::read(&files[0])
        .unwrap()
        .windows(13)
        .any(|w| w == b"brain.Event:2"));
    let events = read_event_file(&files[0]).unwrap().scalars;
    let event_losses: Vec<(u64, f32)> = events
        .iter()
        .map(|(step, values)| {
            let loss = values.iter().find(|(m, _)| *m == Metric::Loss).unwrap().1;
            (*step, loss as f32)
        })
        .collect();
    assert_eq!(event_losses, losses);
    let tags: Vec<Metric> = events[0].1.iter().map(|(m, _)| *m).collect();
    assert_eq!(
        tags,
        [
            Metric::Loss,
            Metric::Lr,
            Metric::GradNorm,
            Metric::TokensPerS,
            Metric::Mfu,
            Metric::MemoryBytes
        ]
    );
}

#[test]
fn a_killed_run_keeps_its_rows_and_its_resumption_appends() {
    let base = temp_dir("resume");
    let (ckpt, dir) = (base.join("ckpt"), base.join("metrics"));
    let checkpoint = format!("train.checkpoint.dir=\"{}\"", ckpt.display());
    let metrics_dir = path_arg(&dir);
    let mut args = run_args(40, &["--metrics", &metrics_dir]);
    // A shrunk model and many steps: the kill lands long before the end. Synchronous saves:
    // the checkpoint of step 4 is committed before step 5's line appears.
    for set in [
        "model.seq=16",
        "model.d=32",
        "model.ffn=64",
        "train.checkpoint.every=2",
        "train.checkpoint.async=false",
        &checkpoint,
    ] {
        args.extend(["--set".to_string(), set.to_string()]);
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_parc"))
        .args(&args)
        .current_dir(cli_support::root())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        if line["step"].as_u64() == Some(5) {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let kept = read_losses(&dir);
    assert!(kept.len() >= 5 && kept.len() < 40, "{kept:?}");
    assert!(kept
        .iter()
        .enumerate()
        .all(|(i, (step, _))| *step == i as u64 + 1));

    args.extend(["--resume".to_string(), path_arg(&ckpt)]);
    let resumed = parc_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let resumed = json_losses(&resumed);
    let first = resumed[0].0;
    assert!(first > 1 && first <= kept.len() as u64 + 1, "{first}");
    let text = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    assert_eq!(text.matches("step,").count(), 1, "one header");
    let rows = read_losses(&dir);
    let steps: Vec<u64> = rows.iter().map(|r| r.0).collect();
    assert_eq!(steps, (1..=40).collect::<Vec<_>>(), "every step once");
    assert_eq!(rows[..first as usize - 1], kept[..first as usize - 1]);
    assert_eq!(rows[first as usize - 1..], resumed[..]);

    // Resuming again from step 4 replaces the rows of steps 5 to 40, whichever the kill left.
    let last = args.len() - 1;
    args[last] = path_arg(&ckpt.join("step-00000004"));
    let again = parc_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let again = json_losses(&again);
    assert_eq!(again[0].0, 5);
    let text = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    assert_eq!(text.matches("step,").count(), 1, "one header");
    let rows = read_losses(&dir);
    assert_eq!(rows.len(), 40, "every step once");
    assert_eq!(rows[..4], kept[..4]);
    assert_eq!(rows[4..], again[..]);
    assert_eq!(event_files(&dir).len(), 3);

    // Read alone, the event files give the same rows (a later run's values replace an earlier
    // one's for the steps both ran).
    let events_only = base.join("events-only");
    std::fs::create_dir_all(&events_only).unwrap();
    for file in event_files(&dir) {
        std::fs::copy(&file, events_only.join(file.file_name().unwrap())).unwrap();
    }
    assert_eq!(read_losses(&events_only), rows);
}

#[test]
fn a_corrupt_or_truncated_event_file_names_the_file_and_offset() {
    let dir = temp_dir("corrupt");
    run_ok(2, &["--metrics", &path_arg(&dir)]);
    let file = event_files(&dir).remove(0);
    let mut bytes = std::fs::read(&file).unwrap();
    // The second record starts after the first: 8 + 4 bytes of header, its data, 4 of CRC.
    let first_length = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let second = 12 + first_length + 4;
    let original = bytes.clone();
    bytes[second + 14] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let err = read_event_file(&file).err().unwrap();
    assert!(
        err.contains(&path_arg(&file))
            && err.contains(&format!("byte offset {second}:"))
            && err.contains("data does not match"),
        "{err}"
    );
    // Without the CSV, `parc plot` reads the event file and says the same.
    std::fs::remove_file(dir.join("metrics.csv")).unwrap();
    let out = parc(&["plot", &path_arg(&dir), "-o", &path_arg(&dir.join("p.svg"))]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains(&format!("byte offset {second}:")));

    std::fs::write(&file, &original[..original.len() - 3]).unwrap();
    let err = read_event_file(&file).err().unwrap();
    assert!(
        err.contains(&path_arg(&file)) && err.contains("truncated"),
        "{err}"
    );
}

/// A PNG's width and height, after checking its signature.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "the PNG signature");
    assert_eq!(&bytes[12..16], b"IHDR");
    let word = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    (word(16), word(20))
}

#[test]
fn plot_overlays_two_runs_as_svg_and_png() {
    let base = temp_dir("plot");
    let (a, b) = (base.join("run-a"), base.join("run-b"));
    run_ok(3, &["--metrics", &path_arg(&a)]);
    run_ok(5, &["--metrics", &path_arg(&b), "--set", "train.seed=7"]);

    let svg = base.join("runs.svg");
    let out = parc_ok(&["plot", &path_arg(&a), &path_arg(&b), "-o", &path_arg(&svg)]);
    // No run evaluated: the val_loss panel is left out, and said so.
    assert!(stderr_of(&out).contains("no run has values of val_loss"));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..80.min(text.len())]);
    for label in ["run-a", "run-b", "training loss", "learning rate", "step"] {
        assert!(text.contains(label), "{label} is not in the SVG");
    }
    // Three panels in two columns.
    assert!(text.contains(r#"width="1280" height="800""#));

    let png = base.join("runs.png");
    parc_ok(&["plot", &path_arg(&a), &path_arg(&b), "-o", &path_arg(&png)]);
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(png_size(&bytes), (1280, 800));
    assert!(bytes.len() > 10_000, "{} bytes", bytes.len());

    // One panel; run-b from its event file alone.
    std::fs::remove_file(b.join("metrics.csv")).unwrap();
    let one = base.join("loss.png");
    let args = [
        "plot",
        &path_arg(&a),
        &path_arg(&b),
        "--metric",
        "loss",
        "-o",
        &path_arg(&one),
    ];
    parc_ok(&args);
    assert_eq!(png_size(&std::fs::read(&one).unwrap()), (640, 400));
}

#[test]
fn bad_input_is_a_clear_error() {
    let base = temp_dir("bad");
    let output = path_arg(&base.join("p.svg"));
    let plot = |dir: &Path, extra: &[&str]| {
        let dir = path_arg(dir);
        let mut args = vec!["plot", dir.as_str(), "-o", output.as_str()];
        args.extend(extra);
        let out = parc(&args);
        assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
        stderr_of(&out)
    };
    let missing = base.join("missing");
    assert!(plot(&missing, &[]).contains(&format!("{}: no such folder", missing.display())));
    let empty = base.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    assert!(plot(&empty, &[]).contains("neither a metrics.csv nor event files"));
    std::fs::write(empty.join("metrics.csv"), "").unwrap();
    assert!(plot(&empty, &[]).contains("metrics.csv is empty"));
    std::fs::write(empty.join("metrics.csv"), format!("{HEADER}\n")).unwrap();
    assert!(plot(&empty, &[]).contains("has no steps yet"));
    std::fs::write(
        empty.join("metrics.csv"),
        format!("{HEADER}\n1,x,,,,,,,,\n"),
    )
    .unwrap();
    assert!(plot(&empty, &[]).contains("line 2, column loss: `x` is not a number"));
    std::fs::write(
        empty.join("metrics.csv"),
        format!("{HEADER}\n1,2.5,,,,,,,,\n"),
    )
    .unwrap();
    let err = plot(&empty, &["--metric", "loss,perplexity"]);
    assert!(err.contains("unknown metric `perplexity`"), "{err}");
    let out = parc(&["plot", &path_arg(&empty), "-o", "plot.jpg"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("must end in .svg or .png"));

    // A --metrics folder that cannot be made (a file is in the way): refused before step 1.
    let blocked = base.join("file");
    std::fs::write(&blocked, "").unwrap();
    let args = run_args(2, &["--metrics", &path_arg(&blocked.join("m"))]);
    let out = parc(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr_of(&out).contains("--metrics"), "{}", stderr_of(&out));
    assert!(json_losses(&out).is_empty(), "no step ran");
    // A metrics.csv of other columns is not appended to.
    let foreign = base.join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("metrics.csv"), "epoch,acc\n1,0.5\n").unwrap();
    let args = run_args(2, &["--metrics", &path_arg(&foreign)]);
    let out = parc(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr_of(&out).contains("has the columns `epoch,acc`"),
        "{}",
        stderr_of(&out)
    );
}
