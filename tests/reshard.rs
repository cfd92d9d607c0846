//! Resume under another plan (`parc_runtime::checkpoint::reshard`): 5 steps of plan A, then 5
//! steps of plan B resumed from A's checkpoint, give the losses and gradient norms (1e-5
//! relative) and the final parameters (1e-5 relative, at least 1e-5 absolute: AdamW turns float
//! noise between plans into ~1e-6 differences, see tests/equivalence.rs) of 10 steps of A, for
//! plan pairs that change dp, tp (with and without sequence parallel), pp (interleaved, other
//! stage balances), cp, the ZeRO stage and the micro-batch split at the same global batch, on
//! the tiny GPT-2 and Llama models, each rank of B reading its slices of A's shards. An fp16 run
//! keeps its dynamic loss scaler across the change. Another global batch is refused (E1104)
//! unless the run consents (`resume_any_batch`), and then continues the data order at the
//! samples the checkpoint had seen. (`parc reshard`'s offline checkpoints: tests/reshard_cli.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;

use fixtures::{spec_variant, train_cpu, PlanChoice, Split, TinyModel, Variant};
use parc_compiler::lower::lower;
use parc_compiler::spec::{Checkpointing, LossScale, PipelineSchedule, Precision, Spec, ZeroStage};
use parc_runtime::checkpoint;
use parc_runtime::exec::{TrainOptions, TrainResult};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

const STEPS: u64 = 10;
const SWITCH: u64 = 5;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("parc-reshard-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A plan of the tiny model: the mesh and schedule choice, the layer split, and a micro-batch
/// size other than the fixtures' 2 (its microbatches then cover the same global batch).
#[derive(Clone)]
struct P {
    choice: PlanChoice,
    split: Split,
    micro_batch: Option<(u64, u32)>,
    /// fp16 with a dynamic loss scaler instead of fp32.
    fp16: bool,
}

fn p(dp: u32, pp: u32, cp: u32, tp: u32, zero: ZeroStage, microbatches: u32) -> P {
    P {
        choice: PlanChoice {
            microbatches,
            ..PlanChoice::mesh(dp, pp, cp, tp, zero)
        },
        split: Split::Even,
        micro_batch: None,
        fp16: false,
    }
}

impl P {
    fn sp(mut self) -> P {
        self.choice.sp = true;
        self
    }
    fn interleaved(mut self) -> P {
        self.choice.schedule = PipelineSchedule::Interleaved { virtual_stages: 2 };
        self
    }
    fn split(mut self, layers: &'static [u32]) -> P {
        self.split = Split::Given(layers);
        self
    }
    /// `micro_batch` sequences per microbatch, `microbatches` of them.
    fn micro(mut self, micro_batch: u64, microbatches: u32) -> P {
        self.micro_batch = Some((micro_batch, microbatches));
        self
    }
    fn fp16(mut self) -> P {
        self.fp16 = true;
        self
    }
    fn describe(&self) -> String {
        let c = &self.choice;
        format!(
            "dp{} pp{} cp{} tp{}{} {:?} {:?} m{}{}{}{}",
            c.dp,
            c.pp,
            c.cp,
            c.tp,
            if c.sp { "+sp" } else { "" },
            c.zero,
            c.schedule,
            c.microbatches,
            match self.split {
                Split::Given(l) => format!(" layers {l:?}"),
                _ => String::new(),
            },
            match self.micro_batch {
                Some((b, m)) => format!(" micro_batch {b}×{m}"),
                None => String::new(),
            },
            if self.fp16 { " fp16" } else { "" }
        )
    }

    fn spec(&self, llama: bool, dir: &Path) -> Spec {
        let model = TinyModel {
            layers: 4,
            llama,
            tied: !llama,
        };
        let variant = Variant {
            split: self.split,
            ..Variant::default()
        };
        let mut s = spec_variant(model, self.choice.clone(), variant);
        if let Some((micro_batch, microbatches)) = self.micro_batch {
            s.train.micro_batch = micro_batch;
            s.parallel.microbatches = microbatches;
            s.train.global_batch = micro_batch * u64::from(microbatches * self.choice.dp);
        }
        if self.fp16 {
            // Window 3: the scale doubles after 3 clean steps, so a scaler restarted from
            // `init` on resume would show.
            s.train.precision = Precision::Fp16 {
                loss_scale: LossScale::Dynamic {
                    init: 1024.0,
                    window: 3,
                    hysteresis: 2,
                    min: 1.0,
                },
            };
        }
        s.train.steps = STEPS;
        s.train.checkpoint = Some(Checkpointing {
            every: SWITCH,
            dir: dir.display().to_string(),
            keep: 0,
            asynchronous: true,
        });
        s
    }
}

fn train(s: &Spec, stop_after: Option<u64>, resume: Option<&Path>) -> TrainResult {
    let plan = lower(s).unwrap_or_else(|d| panic!("{:?}", d.items));
    let mut options = TrainOptions::new(".");
    options.comm_timeout = Duration::from_secs(30);
    options.threads_per_rank = Some(1);
    options.stop_after = stop_after;
    options.resume = resume.map(Path::to_path_buf);
    train_cpu(s, &plan, &options).unwrap_or_else(|e| panic!("{e}"))
}

/// The uninterrupted run and the 5-step checkpoint of each plan A, made once.
struct Reference {
    full: TrainResult,
    checkpoint: PathBuf,
}

static REFERENCES: Mutex<Option<HashMap<String, std::sync::Arc<Reference>>>> = Mutex::new(None);

fn reference(llama: bool, a: &P) -> std::sync::Arc<Reference> {
    let key = format!("{} {}", if llama { "llama" } else { "gpt" }, a.describe());
    if let Some(found) = REFERENCES
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return found.clone();
    }
    let slug: String = key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let full = train(
        &a.spec(llama, &temp_dir(&format!("{slug}-full"))),
        None,
        None,
    );
    let dir = temp_dir(&slug);
    train(&a.spec(llama, &dir), Some(SWITCH), None);
    let made = std::sync::Arc::new(Reference {
        full,
        checkpoint: dir.join(checkpoint::step_dir_name(SWITCH)),
    });
    REFERENCES
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .insert(key, made.clone());
    made
}

fn assert_close(desc: &str, full: &TrainResult, resumed: &TrainResult) {
    assert_eq!(resumed.start_step, SWITCH, "{desc}");
    assert_eq!(resumed.records.len() as u64, STEPS - SWITCH, "{desc}");
    assert_ne!(full.records[0].loss, full.records[9].loss);
    for (a, b) in full.records[SWITCH as usize..].iter().zip(&resumed.records) {
        for (what, x, y) in [
            ("loss", a.loss, b.loss),
            ("grad norm", a.grad_norm, b.grad_norm),
        ] {
            let rel = (x - y).abs() / x.abs().max(1e-12);
            assert!(
                rel < 1e-5,
                "{desc}: step {} {what} {y} vs plan A's {x} (rel {rel:e})",
                a.step
            );
        }
    }
    assert_eq!(full.params.len(), resumed.params.len(), "{desc}");
    for (a, b) in full.params.iter().zip(&resumed.params) {
        assert_eq!((&a.name, &a.shape), (&b.name, &b.shape), "{desc}");
        for (i, (x, y)) in a.data.iter().zip(&b.data).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                "{desc}: {}[{i}] {y} vs plan A's {x}",
                a.name
            );
        }
    }
}

/// 5 steps of `a`, then 5 of `b` from `a`'s checkpoint, match 10 steps of `a`.
fn assert_pair(llama: bool, a: P, b: P) {
    let desc = format!(
        "{}: {} → {}",
        if llama { "llama" } else { "gpt" },
        a.describe(),
        b.describe()
    );
    eprintln!("{desc}");
    let reference = reference(llama, &a);
    let slug: String = desc
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let out = temp_dir(&slug);
    let resumed = train(&b.spec(llama, &out), None, Some(&reference.checkpoint));
    assert_close(&desc, &reference.full, &resumed);
}

use ZeroStage::{Zero0, Zero1, Zero2, Zero3};

#[test]
fn gpt_resumes_under_another_plan() {
    let single = || p(1, 1, 1, 1, Zero0, 4);
    for (a, b) in [
        (p(2, 1, 1, 1, Zero0, 2), p(1, 1, 1, 2, Zero0, 4)),
        (p(1, 2, 1, 1, Zero0, 4), p(2, 1, 1, 1, Zero0, 2)),
        (p(2, 1, 1, 1, Zero1, 2), p(2, 1, 1, 1, Zero3, 2)),
        (
            p(1, 1, 1, 2, Zero0, 4).sp(),
            p(1, 2, 1, 1, Zero0, 4).interleaved(),
        ),
        (p(1, 1, 2, 1, Zero0, 4), p(2, 1, 1, 1, Zero0, 2)),
        (p(2, 1, 1, 2, Zero0, 2), p(2, 1, 1, 1, Zero0, 2)),
        (single(), p(1, 1, 1, 1, Zero0, 2).micro(4, 2)),
        (
            p(1, 2, 1, 1, Zero0, 4),
            p(1, 2, 1, 1, Zero0, 4).split(&[1, 3]),
        ),
        (p(4, 1, 1, 1, Zero3, 1), p(1, 2, 1, 2, Zero0, 4)),
        (p(2, 1, 1, 1, Zero2, 2), p(1, 1, 1, 2, Zero1, 4).sp()),
        (single(), p(2, 2, 1, 1, Zero1, 2)),
        (p(2, 1, 1, 2, Zero3, 2), single()),
    ] {
        assert_pair(false, a, b);
    }
}

#[test]
fn llama_resumes_under_another_plan() {
    let single = || p(1, 1, 1, 1, Zero0, 4);
    for (a, b) in [
        (p(2, 1, 1, 1, Zero0, 2), p(1, 1, 1, 2, Zero0, 4)),
        (p(1, 2, 1, 1, Zero0, 4), p(2, 1, 1, 1, Zero0, 2)),
        (p(2, 1, 1, 1, Zero1, 2), p(2, 1, 1, 1, Zero3, 2)),
        (
            p(1, 1, 1, 2, Zero0, 4).sp(),
            p(1, 2, 1, 1, Zero0, 4).interleaved(),
        ),
        (p(1, 1, 2, 1, Zero0, 4), p(2, 1, 1, 1, Zero0, 2)),
        (p(2, 2, 1, 1, Zero0, 2), p(2, 1, 1, 1, Zero0, 2)),
        (single(), p(1, 1, 1, 1, Zero0, 2).micro(4, 2)),
        (
            p(1, 2, 1, 1, Zero0, 4).split(&[3, 1]),
            p(1, 2, 1, 1, Zero0, 4),
        ),
        (p(4, 1, 1, 1, Zero3, 1), p(1, 2, 1, 2, Zero0, 4)),
        (
            p(1, 2, 1, 1, Zero0, 4).interleaved(),
            p(1, 1, 2, 2, Zero0, 4),
        ),
        (single(), p(2, 1, 1, 2, Zero2, 2)),
        (p(1, 1, 1, 2, Zero0, 4), p(1, 1, 1, 2, Zero0, 4).sp()),
    ] {
        assert_pair(true, a, b);
    }
}

/// The token offsets of each 1-based step of a `--log-batches` file.
fn logged_batches(path: &Path) -> HashMap<u64, Vec<u64>> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("step").is_some())
        .map(|v| {
            let offsets = v["offsets"].as_array().unwrap();
            (
                v["step"].as_u64().unwrap(),
                offsets.iter().map(|o| o.as_u64().unwrap()).collect(),
            )
        })
        .collect()
}

#[test]
fn another_global_batch_continues_at_the_samples_seen_only_with_consent() {
    // 5 steps of 8 sequences, then batches of 4.
    let a = p(1, 1, 1, 1, Zero0, 4);
    let b = p(1, 1, 1, 1, Zero0, 2);
    let reference = reference(false, &a);
    let dir = temp_dir("any-batch");
    let s = b.spec(false, &dir);
    let plan = lower(&s).unwrap();
    let mut options = TrainOptions::new(".");
    options.threads_per_rank = Some(1);
    options.resume = Some(reference.checkpoint.clone());
    let refused = train_cpu(&s, &plan, &options).unwrap_err().to_string();
    assert!(
        refused.contains("E1104") && refused.contains("--resume-any-batch"),
        "{refused}"
    );
    options.resume_any_batch = true;
    options.log_batches = Some(dir.join("batches.jsonl"));
    let resumed = train_cpu(&s, &plan, &options).unwrap();
    assert_eq!(resumed.records.len() as u64, STEPS - SWITCH);
    assert!(resumed.records.iter().all(|r| r.loss.is_finite()));
    // Step 6 (1-based) reads the first half of what plan A's step 6 read, step 7 the rest.
    let seq = s.model.seq;
    let layout = parc_runtime::data::BatchLayout {
        dp: 1,
        microbatches: 4,
        micro_batch: 2,
    };
    let samples = parc_runtime::exec::SYNTHETIC_SAMPLES;
    let mut sampler = parc_runtime::data::Sampler::new(s.train.seed, samples, layout).unwrap();
    let a_step6: Vec<u64> = sampler.global_batch(5).iter().map(|i| i * seq).collect();
    let logged = logged_batches(&dir.join("batches.jsonl"));
    assert_eq!(logged[&6], a_step6[..4]);
    assert_eq!(logged[&7], a_step6[4..]);
    let seen: u64 = resumed.epochs.iter().map(|e| e.seen).sum();
    assert_eq!(seen, SWITCH * 8 + (STEPS - SWITCH) * 4);
    // Its own checkpoints record the samples seen, so a further resume continues from there.
    let own = checkpoint::read_manifest(&dir.join(checkpoint::step_dir_name(STEPS))).unwrap();
    assert_eq!(own.samples_seen, Some(seen));
}

#[test]
fn an_fp16_run_keeps_its_loss_scaler_under_another_plan() {
    let a = p(2, 1, 1, 1, Zero1, 2).fp16();
    let b = p(1, 2, 1, 2, Zero0, 4).fp16();
    let reference = reference(false, &a);
    let resumed = train(
        &b.spec(false, &temp_dir("fp16-b")),
        None,
        Some(&reference.checkpoint),
    );
    let scales = |records: &[parc_runtime::exec::StepRecord]| -> Vec<_> {
        records.iter().map(|r| r.loss_scale).collect()
    };
    let expected = &reference.full.records[SWITCH as usize..];
    assert_eq!(scales(&resumed.records), scales(expected));
    assert!(resumed.records.iter().any(|r| r.loss_scale.is_some()));
    for (x, y) in expected.iter().zip(&resumed.records) {
        assert!(
            (x.loss - y.loss).abs() <= 1e-3 * x.loss.abs(),
            "{} vs {}",
            y.loss,
            x.loss
        );
    }
}
