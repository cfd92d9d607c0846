//! The fused cross-entropy (`Op::CrossEntropy`): dlogits written over the logits (the op's output 0
//! is its input 0's buffer) and the loss accumulated, against the CPU reference, with f32 and bf16
//! logits, for every kernel variant (`staged`, `rows`: cuda/cross_entropy.rs); vocabularies that
//! are not multiples of 8 or 128 (rows then start off the 16-byte grid, so the kernels' partial
//! edge chunks run), GPT-2's 50,257, a target at its row's max, targets at a row's
//! first and last column (in its edge chunks), targets outside the vocabulary, large logits (exp
//! underflows for all but the max), and fp16's loss scale; enough rows that the staged kernel's
//! persistent CTAs take several rows each (their double-buffered path). The in-place update takes
//! no copy of the logits (no allocation after the first call) and the loss is the same, bit for
//! bit, on every run.
use crate::harness::{check_variant, Case, Data, Rng, BF16_STORED, ELEMENTWISE};
use parc_compiler::ir::op::Op;
use parc_compiler::spec::Precision;
use parc_runtime::backend::StepScalars;

/// The kernel variants of `Op::CrossEntropy`, each tested against the CPU.
const VARIANTS: [&str; 2] = ["staged", "rows"];

const SCALE: f64 = 1.0 / 4096.0;

/// Logits `rows × vocab` of size `spread` and targets: row 0's target holds the row's max,
/// row 1's is `vocab` and row 2's −1 (outside: no target logit, no one-hot), row 3's is the
/// first column and row 4's the last, the others random inside.
fn data(r: &mut Rng, rows: usize, vocab: usize, spread: f32) -> (Vec<f32>, Vec<i32>) {
    let mut logits = r.vec(rows * vocab, spread);
    let mut targets = r.ids(rows, vocab as u64);
    let top = logits[..vocab].iter().copied().fold(f32::MIN, f32::max);
    logits[targets[0] as usize] = top + spread.max(1.0);
    let ends = [vocab as i32, -1, 0, vocab as i32 - 1];
    for (t, end) in targets.iter_mut().skip(1).zip(ends) {
        *t = end;
    }
    (logits, targets)
}

/// The op on `logits`, its output 0 bound to input 0 (in place), the loss starting from a
/// random value (checks the +=).
fn case(r: &mut Rng, name: String, rows: usize, vocab: usize, spread: f32, tol: f32) -> Case {
    let (logits, targets) = data(r, rows, vocab, spread);
    let mut c = Case::new(
        name,
        Op::CrossEntropy {
            vocab: vocab as u64,
            scale: SCALE,
        },
        vec![Data::F32(logits), Data::I32(targets)],
        vec![Vec::new(), r.vec(1, 2.0)],
        tol,
    );
    c.aliases = vec![Some(0), None];
    c
}

/// (rows, vocab): tiny and odd vocabularies, GPT-2's padded (50,304) and real (50,257) one;
/// the last three have more rows than the staged kernel starts CTAs on an H200 (132 for GPT-2's
/// rows, at most 2,112 for the small ones), so each CTA takes several rows and prefetches.
const SHAPES: [(usize, usize); 9] = [
    (7, 1),
    (19, 37),
    (33, 1000),
    (9, 5003),
    (5, 50_304),
    (6, 50_257),
    (300, 50_257),
    (4_500, 37),
    (2_500, 1000),
];

/// A case per shape of [`SHAPES`] and logit spread (3e4: exp underflows for all but the max).
fn shape_cases(r: &mut Rng, tol: f32) -> Vec<Case> {
    let mut cases = Vec::new();
    for (rows, vocab) in SHAPES {
        for spread in [8.0, 3.0e4] {
            let name = format!("rows {rows} vocab {vocab} spread {spread}");
            cases.push(case(r, name, rows, vocab, spread, tol));
        }
    }
    cases
}

#[test]
fn fused_cross_entropy_f32() {
    for variant in VARIANTS {
        let test = format!("fused_cross_entropy_f32 {variant}");
        let mut r = Rng::new(&test);
        let mut cases = shape_cases(&mut r, ELEMENTWISE);
        // fp16: dlogits carry the step's loss scale, the loss does not.
        let mut scaled = case(&mut r, "loss scale".into(), 11, 3001, 8.0, ELEMENTWISE);
        scaled.scalars = StepScalars {
            loss_scale: Some(65536.0),
            ..scaled.scalars
        };
        cases.push(scaled);
        check_variant(&test, &cases, Precision::Fp32, ("cross_entropy", variant));
    }
}

/// bf16 logits: both backends read the same bf16 values and round their dlogits once, so
/// they differ by at most one bf16 step where the f32 results differ in their last bits.
#[test]
fn fused_cross_entropy_bf16() {
    for variant in VARIANTS {
        let test = format!("fused_cross_entropy_bf16 {variant}");
        let mut r = Rng::new(&test);
        let cases: Vec<Case> = shape_cases(&mut r, BF16_STORED)
            .into_iter()
            .map(|c| c.stored_bf16(BF16_STORED))
            .collect();
        check_variant(&test, &cases, Precision::Bf16, ("cross_entropy", variant));
    }
}

/// No copy of the logits: after the first call (which sizes the row-loss scratch) a call
/// allocates nothing, where an aliased input would take a copy of its own. Two runs on the
/// same data give the same loss bits and dlogits.
#[cfg(feature = "cuda")]
#[test]
fn fused_cross_entropy_is_in_place_and_deterministic() {
    use parc_runtime::cuda::{CrossEntropyKernel, Variant};
    for &variant in CrossEntropyKernel::ALL {
        in_place_and_deterministic(variant.into(), variant.name());
    }
}

#[cfg(feature = "cuda")]
fn in_place_and_deterministic(kernel: parc_runtime::cuda::KernelVariant, variant: &str) {
    use parc_compiler::ir::{BufferId, DType};
    use parc_runtime::backend::Backend;
    use parc_runtime::cuda::CudaBackend;
    // CudaBackend::new(0) is the fp32 backend.
    let Some(mut gpu) = crate::harness::cuda_backend(Precision::Fp32) else {
        return;
    };
    gpu.set_kernel_variant(kernel);
    let mut r = Rng::new(&format!(
        "fused_cross_entropy_is_in_place_and_deterministic {variant}"
    ));
    let (rows, vocab) = (64, 50_304);
    let (logits, targets) = data(&mut r, rows, vocab, 8.0);
    let op = Op::CrossEntropy {
        vocab: vocab as u64,
        scale: SCALE,
    };
    let (l, t, loss) = (BufferId(0), BufferId(1), BufferId(2));
    let scalars = StepScalars {
        lr: 0.0,
        step: 1,
        loss_scale: None,
    };
    let run = |gpu: &mut CudaBackend| {
        gpu.write_f32(l, &logits).unwrap();
        gpu.write_f32(loss, &[0.0]).unwrap();
        gpu.compute(&op, &[l, t], &[l, loss], &scalars).unwrap();
        (gpu.read_f32(l).unwrap(), gpu.read_f32(loss).unwrap()[0])
    };
    gpu.alloc(l, &[logits.len() as u64], DType::F32).unwrap();
    gpu.alloc(t, &[rows as u64], DType::I32).unwrap();
    gpu.write_i32(t, &targets).unwrap();
    gpu.alloc(loss, &[1], DType::F32).unwrap();
    let first = run(&mut gpu);
    let allocations = gpu.driver_allocations();
    let second = run(&mut gpu);
    assert_eq!(
        gpu.driver_allocations(),
        allocations,
        "{variant}: the in-place update allocated (a copy of the logits?)"
    );
    assert_eq!(
        first.1.to_bits(),
        second.1.to_bits(),
        "{variant}: loss differs between runs"
    );
    assert_eq!(first.0, second.0, "{variant}: dlogits differ between runs");
    // Each row of dlogits sums to ~0 (softmax sums to 1, minus the one-hot) where the target
    // is inside the vocabulary.
    for (row, &target) in first.0.chunks(vocab).zip(&targets) {
        let sum: f64 = row.iter().map(|&d| f64::from(d)).sum();
        if (0..vocab as i32).contains(&target) {
            assert!(sum.abs() < 1e-5 * SCALE, "{variant}: row {sum} is not ~0");
        }
    }
}
