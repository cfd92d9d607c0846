//! The loss and the step: cross-entropy's pieces, the gradient norm and clip coefficient,
//! AdamW and SGD updates, and all of them under fp16 loss scaling (an overflowed step's NaN
//! coefficient leaves parameters and optimizer state untouched).
use crate::harness::{
    check, check_on, Case, Data, Rng, BF16_STORED, ELEMENTWISE, REDUCTION, SCALARS,
};
use parc_compiler::ir::op::Op;
use parc_compiler::spec::Precision;
use parc_runtime::backend::StepScalars;

#[test]
fn cross_entropy() {
    let mut r = Rng::new("cross_entropy");
    check("cross_entropy", &cross_entropy_cases(&mut r));
}

/// The split cross-entropy ops on bf16 logits (and a bf16 dlogits): max and target logit
/// select a stored value (exact), the f32 reductions keep their tolerance, dlogits is within
/// one bf16 step.
#[test]
fn cross_entropy_bf16_storage() {
    let mut r = Rng::new("cross_entropy_bf16_storage");
    let cases = cross_entropy_cases(&mut r).into_iter().map(|case| {
        let tol = match case.name() {
            "ce_max" | "ce_target_logit" => 0.0,
            "ce_grad" => BF16_STORED,
            _ => REDUCTION,
        };
        case.stored_bf16(tol)
    });
    let cases: Vec<Case> = cases.collect();
    check_on("cross_entropy_bf16_storage", &cases, Precision::Bf16);
}

fn cross_entropy_cases(r: &mut Rng) -> Vec<Case> {
    let (rows, vocab_start, vocab_local) = (29usize, 100u64, 1000usize);
    let logits = r.vec(rows * vocab_local, 8.0);
    // Targets inside and outside this rank's vocab range.
    let targets = r.ids(rows, 1300);
    let (max, sumexp) = row_max_and_sum_exp(&logits, vocab_local);
    let v = vocab_local as u64;
    let scale = 1.0 / 64.0;
    vec![
        Case::new(
            "ce_max",
            Op::CeMax { vocab_local: v },
            vec![Data::F32(logits.clone())],
            vec![r.vec(rows, 1.0)],
            ELEMENTWISE,
        ),
        Case::new(
            "ce_sum_exp",
            Op::CeSumExp { vocab_local: v },
            vec![Data::F32(logits.clone()), Data::F32(max.clone())],
            vec![r.vec(rows, 1.0)],
            REDUCTION,
        ),
        Case::new(
            "ce_target_logit",
            Op::CeTargetLogit {
                vocab_start,
                vocab_local: v,
            },
            vec![Data::F32(logits.clone()), Data::I32(targets.clone())],
            vec![r.vec(rows, 1.0)],
            ELEMENTWISE,
        ),
        Case::new(
            "ce_loss",
            Op::CeLoss { scale },
            vec![
                Data::F32(max.clone()),
                Data::F32(sumexp.clone()),
                Data::F32(r.vec(rows, 3.0)),
            ],
            vec![r.vec(1, 1.0)],
            REDUCTION,
        ),
        Case::new(
            "ce_grad",
            Op::CeGrad {
                vocab_start,
                vocab_local: v,
                scale,
            },
            vec![
                Data::F32(logits),
                Data::I32(targets),
                Data::F32(max),
                Data::F32(sumexp),
            ],
            vec![r.vec(rows * vocab_local, 1.0)],
            REDUCTION,
        ),
    ]
}

#[test]
fn optimizer() {
    let mut r = Rng::new("optimizer");
    let n = 70_001;
    let g = r.vec(n, 0.1);
    let mut cases = vec![
        Case::new(
            "sum_squares",
            Op::SumSquares,
            vec![Data::F32(g.clone())],
            vec![r.positive(1, 0.0, 5.0)],
            REDUCTION,
        ),
        Case::new(
            "clip_coef none",
            Op::ClipCoef { max_norm: None },
            vec![Data::F32(r.positive(1, 0.0, 9.0))],
            vec![r.vec(1, 1.0)],
            ELEMENTWISE,
        ),
        Case::new(
            "clip_coef clipping",
            Op::ClipCoef {
                max_norm: Some(1.0),
            },
            vec![Data::F32(vec![7.3])],
            vec![r.vec(1, 1.0)],
            ELEMENTWISE,
        ),
        Case::new(
            "clip_coef not clipping",
            Op::ClipCoef {
                max_norm: Some(10.0),
            },
            vec![Data::F32(vec![7.3])],
            vec![r.vec(1, 1.0)],
            ELEMENTWISE,
        ),
    ];
    for step in [1u64, 7] {
        let mut adam = Case::new(
            format!("adamw step {step}"),
            ADAMW,
            vec![Data::F32(g.clone()), Data::F32(vec![0.8])],
            vec![r.vec(n, 1.0), r.vec(n, 0.01), r.positive(n, 0.0, 1e-4)],
            ELEMENTWISE,
        );
        adam.scalars = StepScalars {
            lr: 3e-4,
            step,
            loss_scale: None,
        };
        cases.push(adam);
        let mut sgd = Case::new(
            format!("sgd momentum step {step}"),
            SGD_MOMENTUM,
            vec![Data::F32(g.clone()), Data::F32(vec![0.5])],
            vec![r.vec(n, 1.0), r.vec(n, 0.1)],
            ELEMENTWISE,
        );
        sgd.scalars = StepScalars {
            lr: 0.1,
            step,
            loss_scale: None,
        };
        cases.push(sgd);
    }
    cases.push(Case::new(
        "sgd plain",
        Op::Sgd {
            momentum: 0.0,
            weight_decay: 0.0,
        },
        vec![Data::F32(g), Data::F32(vec![1.0])],
        vec![r.vec(n, 1.0)],
        ELEMENTWISE,
    ));
    check("optimizer", &cases);
}

/// Under fp16 loss scaling (scale 1024 in `StepScalars`): the loss gradient carries the scale,
/// the clip coefficient divides it back out (clipping or not, with or without a max norm) and
/// is NaN for a non-finite squared norm, and the updates skip a non-finite coefficient.
#[test]
fn loss_scaled_ops() {
    let mut r = Rng::new("loss_scaled_ops");
    let scaled = StepScalars {
        loss_scale: Some(1024.0),
        ..SCALARS
    };
    let (rows, vocab) = (13usize, 300usize);
    let logits = r.vec(rows * vocab, 6.0);
    let (max, sumexp) = row_max_and_sum_exp(&logits, vocab);
    let mut cases = vec![Case::new(
        "ce_grad scaled",
        Op::CeGrad {
            vocab_start: 0,
            vocab_local: vocab as u64,
            scale: 1.0 / 26.0,
        },
        vec![
            Data::F32(logits),
            Data::I32(r.ids(rows, vocab as u64)),
            Data::F32(max),
            Data::F32(sumexp),
        ],
        vec![r.vec(rows * vocab, 1.0)],
        REDUCTION,
    )];
    let big = 7.3 * 1024.0 * 1024.0;
    for (name, max_norm, sumsq) in [
        ("no max norm", None, big),
        ("clipping", Some(1.0), big),
        ("not clipping", Some(10.0), big),
        ("overflow", Some(1.0), f32::INFINITY),
        ("nan", None, f32::NAN),
    ] {
        cases.push(Case::new(
            format!("clip_coef scaled {name}"),
            Op::ClipCoef { max_norm },
            vec![Data::F32(vec![sumsq])],
            vec![r.vec(1, 1.0)],
            ELEMENTWISE,
        ));
    }
    let n = 5_003;
    let g = r.vec(n, 100.0);
    for coef in [f32::NAN, f32::INFINITY, 0.8 / 1024.0] {
        cases.push(Case::new(
            format!("adamw coef {coef:e}"),
            ADAMW,
            vec![Data::F32(g.clone()), Data::F32(vec![coef])],
            vec![r.vec(n, 1.0), r.vec(n, 0.01), r.positive(n, 0.0, 1e-4)],
            ELEMENTWISE,
        ));
        cases.push(Case::new(
            format!("sgd momentum coef {coef:e}"),
            SGD_MOMENTUM,
            vec![Data::F32(g.clone()), Data::F32(vec![coef])],
            vec![r.vec(n, 1.0), r.vec(n, 0.1)],
            ELEMENTWISE,
        ));
    }
    for case in &mut cases {
        case.scalars = scaled;
    }
    check("loss_scaled_ops", &cases);
}

/// Each row's maximum logit and its sum of exp(logit − max) (rows of `vocab` logits): the
/// inputs `CeLoss` and `CeGrad` take from `CeMax` and `CeSumExp`.
fn row_max_and_sum_exp(logits: &[f32], vocab: usize) -> (Vec<f32>, Vec<f32>) {
    let max: Vec<f32> = logits
        .chunks(vocab)
        .map(|c| c.iter().copied().fold(f32::NEG_INFINITY, f32::max))
        .collect();
    let sumexp: Vec<f32> = logits
        .chunks(vocab)
        .zip(&max)
        .map(|(c, m)| c.iter().map(|l| f64::from((l - m).exp())).sum::<f64>() as f32)
        .collect();
    (max, sumexp)
}

/// The AdamW update both optimizer tests run.
const ADAMW: Op = Op::AdamW {
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    weight_decay: 0.1,
};

/// The momentum SGD update both optimizer tests run.
const SGD_MOMENTUM: Op = Op::Sgd {
    momentum: 0.9,
    weight_decay: 0.01,
};
