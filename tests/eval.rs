//! Evaluation (`train.eval`) through the real executor (one thread per rank, local comm, CPU
//! backend): every plan's validation losses equal the single-rank run's (1e-5 relative) on the
//! tiny GPT-2 and Llama models; evaluating changes no bit of training; a resumed run gives the
//! uninterrupted run's validation losses bit for bit, on the training data's held-out tail; and
//! evaluation data too short for what is asked of it is an error naming it.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#[allow(dead_code)]
#[path = "ir/fixtures.rs"]
mod fixtures;

use fixtures::{spec, train_cpu, PlanChoice, TinyModel};
use parc_compiler::diag::Span;
use parc_compiler::lower::lower;
use parc_compiler::spec::{
    Checkpointing, DataFormat, DataSource, Eval, PipelineSchedule, Recompute, Spec, ZeroStage,
};
use parc_runtime::exec::{TrainOptions, TrainResult};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn model(llama: bool) -> TinyModel {
    TinyModel {
        layers: 4,
        llama,
        tied: !llama,
    }
}

/// The tiny model trained with `plan` (synthetic data, 5 steps), evaluated on 2 batches after
/// steps 2, 4 and 5.
fn evaluated(llama: bool, plan: PlanChoice) -> Spec {
    let mut s = spec(model(llama), plan);
    s.train.eval = Some(eval(2, 2, None));
    s
}

fn eval(every: u64, batches: u64, data: Option<DataSource>) -> Eval {
    Eval {
        every,
        batches,
        data,
        span: Span::default(),
    }
}

fn options(dir: &Path) -> TrainOptions {
    let mut options = TrainOptions::new(dir);
    options.comm_timeout = Duration::from_secs(30);
    options.threads_per_rank = Some(1);
    options
}

fn train(s: &Spec, options: &TrainOptions) -> parc_runtime::error::Result<TrainResult> {
    let plan = lower(s).unwrap_or_else(|d| panic!("{:?}", d.items));
    train_cpu(s, &plan, options)
}

fn run(s: &Spec) -> TrainResult {
    train(s, &options(Path::new("."))).unwrap_or_else(|e| panic!("{e}"))
}

/// The steps (1-based) evaluated and their validation losses.
fn val_losses(r: &TrainResult) -> Vec<(u64, f32)> {
    r.records
        .iter()
        .filter_map(|x| Some((x.step + 1, x.val_loss?)))
        .collect()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("parc-eval-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `tokens` pseudo-random u16 tokens below the tiny vocabulary (32) in `dir/name`.
fn token_file(dir: &Path, name: &str, tokens: u64) -> DataSource {
    let bytes: Vec<u8> = (0..tokens)
        .flat_map(|i| (((i * 7919 + i / 3) % 32) as u16).to_le_bytes())
        .collect();
    std::fs::write(dir.join(name), bytes).unwrap();
    DataSource::File {
        path: name.to_string(),
        format: DataFormat::U16,
        span: Span::default(),
    }
}

#[test]
fn val_losses_of_every_plan_equal_the_single_rank_run() {
    let p = PlanChoice::default;
    let plans = [
        (false, PlanChoice { dp: 2, ..p() }),
        (
            false,
            PlanChoice {
                tp: 2,
                sp: true,
                ..p()
            },
        ),
        (false, PlanChoice { pp: 2, ..p() }),
        (
            false,
            PlanChoice {
                pp: 2,
                schedule: PipelineSchedule::Interleaved { virtual_stages: 2 },
                microbatches: 4,
                ..p()
            },
        ),
        (false, PlanChoice { cp: 2, ..p() }),
        (
            false,
            PlanChoice {
                dp: 2,
                zero: ZeroStage::Zero3,
                ..p()
            },
        ),
        (
            false,
            PlanChoice {
                recompute: Recompute::Full,
                ..p()
            },
        ),
        (
            true,
            PlanChoice {
                tp: 2,
                sp: true,
                ..p()
            },
        ),
        (true, PlanChoice { pp: 2, ..p() }),
        (true, PlanChoice { cp: 2, ..p() }),
        (
            true,
            PlanChoice {
                dp: 2,
                zero: ZeroStage::Zero3,
                recompute: Recompute::Selective,
                ..p()
            },
        ),
    ];
    for (llama, plan) in plans {
        let desc = format!(
            "{} dp {} pp {} cp {} tp {} {:?} {:?} {:?}",
            if llama { "llama" } else { "gpt" },
            plan.dp,
            plan.pp,
            plan.cp,
            plan.tp,
            plan.zero,
            plan.schedule,
            plan.recompute
        );
        let single = PlanChoice {
            microbatches: plan.microbatches * plan.dp,
            ..PlanChoice::default()
        };
        let want = val_losses(&run(&evaluated(llama, single)));
        let got = val_losses(&run(&evaluated(llama, plan)));
        assert_eq!(
            want.iter().map(|v| v.0).collect::<Vec<_>>(),
            [2, 4, 5],
            "{desc}"
        );
        // Training moved the validation loss, so equal values are not equal constants.
        assert_ne!(want[0].1, want[2].1, "{desc}");
        for ((step, x), (at, y)) in want.iter().zip(&got) {
            assert_eq!(step, at, "{desc}");
            let rel = (x - y).abs() / x.abs();
            assert!(
                rel < 1e-5,
                "{desc}: val loss after step {step} {y} vs single rank {x} (rel {rel:e})"
            );
        }
    }
}

#[test]
fn evaluating_changes_no_bit_of_training() {
    let bits = |r: &TrainResult| {
        let steps: Vec<_> = r
            .records
            .iter()
            .map(|x| (x.loss.to_bits(), x.grad_norm.to_bits()))
            .collect();
        let params: Vec<u32> = r
            .params
            .iter()
            .flat_map(|p| p.data.iter().map(|v| v.to_bits()))
            .collect();
        (steps, params)
    };
    let dir = temp_dir("bits");
    for plan in [
        PlanChoice::default(),
        PlanChoice {
            dp: 2,
            pp: 2,
            zero: ZeroStage::Zero1,
            ..PlanChoice::default()
        },
    ] {
        let mut plain = spec(model(true), plan);
        // Training on a file, evaluating on another: the training samples are the same.
        plain.train.data = token_file(&dir, "train.bin", 4000);
        let mut with_eval = plain.clone();
        let val = token_file(&dir, "val.bin", 200);
        with_eval.train.eval = Some(eval(1, 3, Some(val)));
        let (a, b) = (
            train(&plain, &options(&dir)).unwrap(),
            train(&with_eval, &options(&dir)).unwrap(),
        );
        assert!(a.records.iter().all(|r| r.val_loss.is_none()));
        assert_eq!(val_losses(&b).len(), 5);
        assert!(bits(&a) == bits(&b), "evaluating changed the training run");
        assert_eq!(a.epochs, b.epochs);
    }
}

#[test]
fn a_resumed_run_gives_the_uninterrupted_val_losses_on_the_held_out_tail() {
    let make = |dir: &Path| {
        let mut s = spec(
            model(false),
            PlanChoice {
                dp: 2,
                zero: ZeroStage::Zero2,
                ..PlanChoice::default()
            },
        );
        s.train.steps = 7;
        s.train.data = token_file(dir, "corpus.bin", 2000);
        s.train.eval = Some(eval(2, 4, None));
        s.train.checkpoint = Some(Checkpointing {
            every: 2,
            dir: "ckpt".to_string(),
            keep: 0,
            asynchronous: true,
        });
        s
    };
    let full_dir = temp_dir("full");
    let full = train(&make(&full_dir), &options(&full_dir)).unwrap();
    let evaluated: Vec<u64> = val_losses(&full).iter().map(|v| v.0).collect();
    assert_eq!(evaluated, [2, 4, 6, 7]);
    // 2000 tokens are 249 samples of 8 (+1); 4 batches of 8 are held out.
    assert_eq!(full.epochs[0].total, 249 - 32);
    let dir = temp_dir("resumed");
    let s = make(&dir);
    let mut stopped = options(&dir);
    stopped.stop_after = Some(5);
    train(&s, &stopped).unwrap();
    let mut resumed = options(&dir);
    resumed.resume = Some(dir.join("ckpt"));
    let rest = train(&s, &resumed).unwrap();
    assert_eq!(rest.start_step, 4);
    let bits = |v: Vec<(u64, f32)>| -> Vec<(u64, u32)> {
        v.into_iter().map(|(s, x)| (s, x.to_bits())).collect()
    };
    assert_eq!(
        bits(val_losses(&rest)),
        bits(val_losses(&full)[2..].to_vec())
    );
}

#[test]
fn evaluation_data_too_short_is_an_error_naming_it() {
    let dir = temp_dir("short");
    let mut s = spec(model(false), PlanChoice::default());
    // A global batch is 4 samples of 9 tokens: 20 tokens hold 2.
    let val = token_file(&dir, "tiny-val.bin", 20);
    s.train.eval = Some(eval(2, 1, Some(val)));
    let err = train(&s, &options(&dir)).unwrap_err().to_string();
    assert!(
        err.contains("tiny-val.bin") && err.contains("fewer than one global batch"),
        "{err}"
    );
    // 1000 tokens are 124 samples: holding out 31 batches of 4 leaves none to train on.
    s.train.data = token_file(&dir, "small.bin", 1000);
    s.train.eval = Some(eval(2, 31, None));
    let err = train(&s, &options(&dir)).unwrap_err().to_string();
    assert!(
        err.contains("small.bin") && err.contains("31 × 4 = 124"),
        "{err}"
    );
}
