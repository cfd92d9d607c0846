//! Resume: a run stopped after step k and resumed from its checkpoint gives the remaining
//! losses and final parameters of an uninterrupted run bit for bit, on sharded plans too
//! (ZeRO optimizer shards, pipeline stages, tp blocks); the exported `model.safetensors` holds
//! the final global parameters. A checkpoint of another global batch is refused. An fp16 run resumes
//! its dynamic loss scaler where it stopped (scale and the clean/overflow step counts).
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;

use fixtures::{spec, spec_variant, train_cpu, PlanChoice, Split, TinyModel, Variant};
use parc_compiler::lower::lower;
use parc_compiler::spec::{Checkpointing, LossScale, Precision, Spec, ZeroStage};
use parc_runtime::exec::{TrainOptions, TrainResult};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("parc-resume-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn with_checkpoints(plan: PlanChoice, dir: &Path) -> Spec {
    with_checkpoints_split(plan, Split::Even, dir)
}

/// [`with_checkpoints`] with the pipeline's layers split as `split` says.
fn with_checkpoints_split(plan: PlanChoice, split: Split, dir: &Path) -> Spec {
    let model = TinyModel {
        layers: 4,
        llama: true,
        tied: false,
    };
    let mut s = match split {
        Split::Even => spec(model, plan),
        _ => spec_variant(
            model,
            plan,
            Variant {
                split,
                ..Variant::default()
            },
        ),
    };
    s.train.steps = 7;
    s.train.checkpoint = Some(Checkpointing {
        every: 2,
        dir: dir.display().to_string(),
        keep: 2,
        asynchronous: true,
    });
    s
}

fn run(s: &Spec, stop_after: Option<u64>, resume: Option<&Path>) -> TrainResult {
    let plan = lower(s).unwrap_or_else(|d| panic!("{:?}", d.items));
    let mut options = TrainOptions::new(".");
    options.comm_timeout = Duration::from_secs(30);
    options.threads_per_rank = Some(1);
    options.stop_after = stop_after;
    options.resume = resume.map(Path::to_path_buf);
    train_cpu(s, &plan, &options).unwrap_or_else(|e| panic!("{e}"))
}

fn bits(values: impl IntoIterator<Item = f32>) -> Vec<u32> {
    values.into_iter().map(f32::to_bits).collect()
}

fn assert_resume_is_exact(name: &str, plan: impl Fn() -> PlanChoice) {
    assert_resume_of_spec_is_exact(name, |dir| with_checkpoints(plan(), dir));
}

fn assert_resume_of_spec_is_exact(name: &str, make: impl Fn(&Path) -> Spec) {
    let full = run(&make(&temp_dir(&format!("{name}-full"))), None, None);
    assert_eq!(full.records.len(), 7);
    let dir = temp_dir(name);
    let s = make(&dir);
    // "Kill" after step 5: checkpoints after steps 2 and 4 exist, step 5's work is lost.
    let first = run(&s, Some(5), None);
    assert_eq!(first.records.len(), 5);
    assert_eq!(first.checkpoints.len(), 2);
    let resumed = run(&s, None, Some(&dir));
    assert_eq!(resumed.start_step, 4, "{name}");
    assert_eq!(
        bits(resumed.records.iter().map(|r| r.loss)),
        bits(full.records[4..].iter().map(|r| r.loss)),
        "{name}: losses after resume"
    );
    let scales = |records: &[parc_runtime::exec::StepRecord]| -> Vec<_> {
        records.iter().map(|r| r.loss_scale).collect()
    };
    assert_eq!(
        scales(&resumed.records),
        scales(&full.records[4..]),
        "{name}: loss scales after resume"
    );
    for (a, b) in full.params.iter().zip(&resumed.params) {
        assert_eq!(
            bits(a.data.clone()),
            bits(b.data.clone()),
            "{name}: {}",
            a.name
        );
    }
    // The losses moved: the comparison above is not between constants.
    assert_ne!(full.records[0].loss, full.records[6].loss);
    // The exported model holds the same global tensors as the run's result.
    let export = std::fs::read(resumed.model_export.as_ref().unwrap()).unwrap();
    let export = safetensors::SafeTensors::deserialize(&export).unwrap();
    for p in &resumed.params {
        let t = export.tensor(&p.name).unwrap();
        let data: Vec<u32> = t
            .data()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(data, bits(p.data.clone()), "{}", p.name);
    }
}

#[test]
fn resume_on_one_rank_is_bit_identical() {
    assert_resume_is_exact("single", PlanChoice::default);
}

#[test]
fn resume_with_sharded_optimizer_pipeline_and_tp_is_bit_identical() {
    assert_resume_is_exact("sharded", || PlanChoice {
        dp: 2,
        pp: 2,
        tp: 2,
        zero: ZeroStage::Zero3,
        microbatches: 2,
        ..PlanChoice::default()
    });
}

/// bf16 runs keep weight matrices in bf16 working copies, which checkpoints leave out: a
/// resumed rank rebuilds them from its masters (rounded; under ZeRO-1/2 gathered over the
/// shards' group), bit for bit what the uninterrupted run holds.
#[test]
fn resume_of_bf16_runs_rebuilds_the_working_copies_bit_identically() {
    for (name, zero) in [
        ("bf16-zero0", ZeroStage::Zero0),
        ("bf16-zero1", ZeroStage::Zero1),
        ("bf16-zero2", ZeroStage::Zero2),
    ] {
        assert_resume_of_spec_is_exact(name, |dir| {
            let plan = PlanChoice {
                dp: 2,
                tp: 2,
                zero,
                microbatches: 2,
                ..PlanChoice::default()
            };
            let mut s = with_checkpoints(plan, dir);
            s.train.precision = Precision::Bf16;
            s
        });
    }
    // The shards hold no working copy: a bf16 weight's tensor is its f32 master.
    let dir = temp_dir("bf16-shard");
    let mut s = with_checkpoints(PlanChoice::default(), &dir);
    s.train.precision = Precision::Bf16;
    let plan = lower(&s).unwrap();
    let program = &plan.programs[0];
    let names: Vec<&str> = program
        .checkpointed()
        .map(|(_, b)| b.name.as_str())
        .collect();
    let working = program.params.iter().filter_map(|l| l.working);
    let working: Vec<&str> = working
        .map(|w| program.buffers[w.0 as usize].name.as_str())
        .collect();
    assert!(!working.is_empty());
    assert!(working.iter().all(|w| !names.contains(w)), "{names:?}");
}

/// Dynamic scaling that doubles every 3 clean steps: the checkpoint after step 4 holds scale
/// 2048 with one clean step counted, so the resumed run must double at step 6 as the
/// uninterrupted one does (a scaler restarted from `init` would not).
#[test]
fn resume_of_an_fp16_run_keeps_the_loss_scaler() {
    assert_resume_of_spec_is_exact("fp16", |dir| {
        let mut s = with_checkpoints(PlanChoice::default(), dir);
        s.train.precision = Precision::Fp16 {
            loss_scale: LossScale::Dynamic {
                init: 1024.0,
                window: 3,
                hysteresis: 2,
                min: 1.0,
            },
        };
        s
    });
    let dir = temp_dir("fp16-manifest");
    let mut s = with_checkpoints(PlanChoice::default(), &dir);
    s.train.precision = Precision::Fp16 {
        loss_scale: LossScale::Static { scale: 512.0 },
    };
    let result = run(&s, Some(2), None);
    let manifest = parc_runtime::checkpoint::read_manifest(&result.checkpoints[0]).unwrap();
    assert_eq!(manifest.loss_scale.map(|l| l.scale), Some(512.0));
}

/// Stages of 3 and 1 layers: each rank's shard holds its stage's layers, so the checkpoint
/// resumes under the same split bit-identically and under another re-sharded on load (its
/// plan hash differs; tests/reshard.rs compares such resumes with the uninterrupted run).
#[test]
fn resume_with_uneven_pipeline_stages_is_bit_identical() {
    let pp2 = || PlanChoice {
        pp: 2,
        microbatches: 2,
        ..PlanChoice::default()
    };
    let split = |counts| move |dir: &Path| with_checkpoints_split(pp2(), Split::Given(counts), dir);
    assert_resume_of_spec_is_exact("uneven", split(&[3, 1]));
    let dir = temp_dir("uneven-other");
    run(&split(&[3, 1])(&dir), Some(2), None);
    let other = split(&[1, 3])(&dir);
    let plan = lower(&other).unwrap();
    let mut options = TrainOptions::new(".");
    options.resume = Some(dir);
    let resumed = train_cpu(&other, &plan, &options).unwrap();
    assert_eq!(resumed.start_step, 2);
    assert!(resumed.records.iter().all(|r| r.loss.is_finite()));
}

#[test]
fn a_checkpoint_of_another_global_batch_is_refused() {
    let dir = temp_dir("other-plan");
    run(
        &with_checkpoints(PlanChoice::default(), &dir),
        Some(2),
        None,
    );
    // Another plan of the same global batch re-shards (tests/reshard.rs); another global
    // batch is refused naming the field.
    let other = with_checkpoints(
        PlanChoice {
            dp: 2,
            microbatches: 2,
            ..PlanChoice::default()
        },
        &dir,
    );
    let plan = lower(&other).unwrap();
    let mut options = TrainOptions::new(".");
    options.resume = Some(dir);
    let err = train_cpu(&other, &plan, &options).unwrap_err().to_string();
    assert!(
        err.contains("E1104 (train.global_batch)") && err.contains("train.global_batch = 4"),
        "{err}"
    );
}

/// `spec` with every attention and MLP projection in tensorwise FP8 (bf16 storage), with
/// delayed scaling of an amax history of `history` steps (None: current scaling).
fn with_fp8(mut s: Spec, history: Option<u32>) -> Spec {
    use parc_compiler::ir::fp8::{Fp8Format, Fp8Scaling};
    s.train.precision = Precision::Bf16;
    s.train.fp8 = Some(parc_compiler::spec::Fp8 {
        scaling: Fp8Scaling::Tensorwise,
        grad: Fp8Format::E4m3,
        history,
        keep_bf16: Vec::new(),
        force_fp8: vec!["Attention".into(), "MLP".into()],
        shared_quantization: true,
        span: Default::default(),
    });
    s
}

fn dp_tp() -> PlanChoice {
    PlanChoice {
        dp: 2,
        tp: 2,
        microbatches: 2,
        ..PlanChoice::default()
    }
}

/// Delayed FP8 scaling: the checkpoints carry every quantized tensor's amax history (a history
/// of 2 steps, so the resumed steps scale by amaxes recorded before the checkpoint), and the
/// resumed run continues bit for bit. A history per tensor a weight's GEMMs read (x, w, dy),
/// an MLP's gate and up projections sharing their input's.
#[test]
fn resume_of_a_delayed_fp8_run_is_bit_identical() {
    assert_resume_of_spec_is_exact("fp8-delayed", |dir| {
        with_fp8(with_checkpoints(dp_tp(), dir), Some(2))
    });
    let s = with_fp8(with_checkpoints(dp_tp(), &temp_dir("fp8-names")), Some(2));
    let plan = lower(&s).unwrap();
    let names: Vec<&str> = (plan.programs[0].checkpointed())
        .map(|(_, b)| b.name.as_str())
        .collect();
    assert!(
        names.contains(&"blocks.0.mlp.gate.x.amax_history")
            && names.contains(&"blocks.0.mlp.gate.dy.amax")
            && names.contains(&"blocks.0.mlp.up.w.amax")
            && !names.contains(&"blocks.0.mlp.up.x.amax"),
        "{names:?}"
    );
}

/// Under another plan a delayed run's histories are read by name (each is whole on every rank
/// of its stage). A checkpoint of a current-scaling run holds no history: resumed under
/// delayed scaling it starts cold, so its first step computes what the plain bf16 run
/// computes from those weights, bit for bit. A resume that lost the histories would so run
/// its first step unquantized: the resumed loss of the carried histories must follow the
/// uninterrupted run far closer than an unquantized step moves it.
#[test]
fn delayed_fp8_histories_reshard_by_name_and_start_cold_without_them() {
    let single = || PlanChoice {
        microbatches: 4,
        ..PlanChoice::default()
    };
    let delayed = |dir: &Path, plan: PlanChoice| with_fp8(with_checkpoints(plan, dir), Some(2));
    // The resumed runs save no checkpoint, so that each resumes from the same one.
    let unsaved = |mut s: Spec| {
        s.train.checkpoint = None;
        s
    };
    let rel = |a: f32, b: f32| (a - b).abs() / a.abs();
    // A current-scaling checkpoint: no history to carry.
    let dir = temp_dir("fp8-cold");
    let current = |plan| with_fp8(with_checkpoints(plan, &dir), None);
    run(&current(single()), Some(5), None);
    let cold = run(&unsaved(delayed(&dir, single())), None, Some(&dir));
    let mut plain = with_checkpoints(single(), &dir);
    plain.train.precision = Precision::Bf16;
    let bf16 = run(&unsaved(plain), None, Some(&dir));
    let warm = run(&unsaved(current(single())), None, Some(&dir));
    for r in [&cold, &bf16, &warm] {
        assert_eq!(r.start_step, 4);
    }
    assert_eq!(
        cold.records[0].loss.to_bits(),
        bf16.records[0].loss.to_bits()
    );
    let unquantized = rel(warm.records[0].loss, cold.records[0].loss);
    assert!(unquantized > 0.0);
    // Its steps after the first scale by the history recorded since: FP8 again.
    assert_ne!(cold.records[1].loss, bf16.records[1].loss);
    // A delayed checkpoint of dp × tp resumed on one rank, in f32 storage (whose plans differ
    // by the order of f32 sums only, not by where bf16 rounds).
    let f32 = |mut s: Spec| {
        s.train.precision = Precision::Fp32;
        s
    };
    let full = run(&f32(delayed(&temp_dir("fp8-full"), single())), None, None);
    let dir = temp_dir("fp8-reshard");
    run(&f32(delayed(&dir, dp_tp())), Some(5), None);
    let resumed = run(&unsaved(f32(delayed(&dir, single()))), None, Some(&dir));
    assert_eq!(resumed.start_step, 4);
    let (a, b) = (&full.records[4], &resumed.records[0]);
    assert!(
        rel(a.loss, b.loss) < unquantized / 10.0,
        "step 4: {} vs {} (an unquantized step moves it by {unquantized:e})",
        b.loss,
        a.loss
    );
}

/// Each step's record reaches `on_step` twice: before the step's checkpoint save
/// (`RecordStage::BeforeSave`, what a metrics file writes) and after it (`Complete`, with the
/// save). With synchronous saves the checkpoint of a step is not yet on disk at its first
/// report and is at its second, so a metrics row always precedes the checkpoint a resume
/// starts after.
#[test]
fn a_steps_first_report_precedes_its_checkpoint() {
    use parc_runtime::exec::{RecordStage, StepRecord};
    use std::sync::Mutex;
    let dir = temp_dir("record-stages");
    let mut s = with_checkpoints(PlanChoice::default(), &dir);
    if let Some(c) = s.train.checkpoint.as_mut() {
        c.asynchronous = false;
    }
    let plan = lower(&s).unwrap_or_else(|d| panic!("{:?}", d.items));
    let mut options = TrainOptions::new(".");
    options.threads_per_rank = Some(1);
    let seen = Mutex::new(Vec::new());
    let on_step = |r: &StepRecord| {
        let saved = dir.join(format!("step-{:08}", r.step + 1)).exists();
        seen.lock()
            .unwrap()
            .push((r.step, r.stage, saved, r.save.is_some()));
    };
    let backend = |_, threads| parc_runtime::cpu::CpuBackend::with_threads(threads);
    let result = parc_runtime::exec::train(&s, &plan, &options, backend, &on_step).unwrap();
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.len(), 2 * result.records.len(), "{seen:?}");
    for pair in seen.chunks(2) {
        let [(step, first, saved_before, _), (step2, second, saved_after, save)] = pair else {
            panic!("{seen:?}");
        };
        assert_eq!(
            (step, first, second),
            (step2, &RecordStage::BeforeSave, &RecordStage::Complete)
        );
        assert!(
            !saved_before,
            "step {step}: checkpoint before its first report"
        );
        // Checkpoints after steps 2, 4 and 6 (every 2; `keep` 2 leaves the newest on disk).
        let due = (step + 1) % 2 == 0;
        assert_eq!((*saved_after, *save), (due, due), "step {step}");
    }
}
