//! Tests of the CPU backend: finite-difference gradient checks of every backward op against its
//! forward (`gradients`), known values and decompositions (`reference`: naive attention, context-
//! parallel splits, GQA vs MHA, vocab-parallel cross-entropy, optimizer steps), the fused
//! cross-entropy against its split pieces (`fused_loss`), the GEMMs' fused activation and
//! residual forms against the separate ops (`fused_gemm`), and the buffer table, error reporting
//! and thread-count determinism (`backend`).
mod backend;
mod bf16;
mod fused_gemm;
mod fused_loss;
mod gradients;
mod reference;

use super::CpuBackend;
use crate::backend::{Backend, StepScalars};
use crate::error::Result;
use parc_compiler::ir::op::{AttentionAttrs, Op, Segment};
use parc_compiler::ir::{BufferId, DType};

/// A test input: f32 or i32 elements.
#[derive(Clone, Debug)]
pub(super) enum Input {
    F(Vec<f32>),
    I(Vec<i32>),
}

pub(super) const SCALARS: StepScalars = StepScalars {
    lr: 0.1,
    step: 1,
    loss_scale: None,
};

/// A backend plus an id counter, for running single ops on host data.
pub(super) struct Harness {
    pub backend: CpuBackend,
    next: u32,
}

impl Harness {
    pub fn new() -> Harness {
        Harness {
            backend: CpuBackend::new(),
            next: 0,
        }
    }

    pub fn with_backend(backend: CpuBackend) -> Harness {
        Harness { backend, next: 0 }
    }

    pub fn input(&mut self, input: &Input) -> BufferId {
        let id = BufferId(self.next);
        self.next += 1;
        match input {
            Input::F(v) => {
                self.backend
                    .alloc(id, &[v.len() as u64], DType::F32)
                    .unwrap();
                self.backend.write_f32(id, v).unwrap();
            }
            Input::I(v) => {
                self.backend
                    .alloc(id, &[v.len() as u64], DType::I32)
                    .unwrap();
                self.backend.write_i32(id, v).unwrap();
            }
        }
        id
    }

    pub fn f32(&mut self, v: &[f32]) -> BufferId {
        self.input(&Input::F(v.to_vec()))
    }

    /// Run `op`; outputs start as `initial` (NaN for overwritten outputs catches kernels that
    /// read them, a known value for accumulated outputs checks the `+=`).
    pub fn run(
        &mut self,
        op: &Op,
        inputs: &[Input],
        initial: &[Vec<f32>],
        scalars: &StepScalars,
    ) -> Result<Vec<Vec<f32>>> {
        let ins: Vec<BufferId> = inputs.iter().map(|i| self.input(i)).collect();
        let outs: Vec<BufferId> = initial.iter().map(|v| self.f32(v)).collect();
        self.backend.compute(op, &ins, &outs, scalars)?;
        Ok(outs
            .iter()
            .map(|&id| self.backend.read_f32(id).unwrap())
            .collect())
    }
}

/// Run `op` on a fresh backend with overwritten outputs of the given lengths (prefilled with NaN).
pub(super) fn eval(op: &Op, inputs: &[Input], out_lens: &[usize]) -> Vec<Vec<f32>> {
    let initial: Vec<Vec<f32>> = out_lens.iter().map(|&n| vec![f32::NAN; n]).collect();
    Harness::new().run(op, inputs, &initial, &SCALARS).unwrap()
}

/// Run `op` with outputs starting from `initial`.
pub(super) fn eval_from(op: &Op, inputs: &[Input], initial: &[Vec<f32>]) -> Vec<Vec<f32>> {
    Harness::new().run(op, inputs, initial, &SCALARS).unwrap()
}

/// Deterministic pseudo-random values in `[-scale, scale)` (a tiny LCG; tests only).
pub(super) fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * unit - 1.0) * scale
        })
        .collect()
}

/// max, sumexp, target_logit of a vocab slice, given the global max for sumexp.
pub(super) fn ce_pieces(
    logits: &[f32],
    targets: &[i32],
    vocab_start: u64,
    vocab_local: u64,
    global_max: Option<&[f32]>,
) -> [Vec<f32>; 3] {
    let rows = targets.len();
    let l = Input::F(logits.to_vec());
    let max = eval(
        &Op::CeMax { vocab_local },
        std::slice::from_ref(&l),
        &[rows],
    )
    .remove(0);
    let use_max = global_max.map_or(max.clone(), <[f32]>::to_vec);
    let sumexp = eval(
        &Op::CeSumExp { vocab_local },
        &[l.clone(), Input::F(use_max)],
        &[rows],
    )
    .remove(0);
    let target = eval(
        &Op::CeTargetLogit {
            vocab_start,
            vocab_local,
        },
        &[l, Input::I(targets.to_vec())],
        &[rows],
    )
    .remove(0);
    [max, sumexp, target]
}

/// `Op::AttentionBwd` of `attrs` when `backward`, else `Op::Attention`.
pub(super) fn attention_op(backward: bool, attrs: AttentionAttrs) -> Op {
    if backward {
        Op::AttentionBwd(attrs)
    } else {
        Op::Attention(attrs)
    }
}

pub(super) fn seg(start: u32, len: u32) -> Segment {
    Segment { start, len }
}

/// `Σ_k <cot_k, outputs_k>` in f64 (empty cotangents skip an output).
pub(super) fn pair(outputs: &[Vec<f32>], cotangents: &[Vec<f32>]) -> f64 {
    outputs
        .iter()
        .zip(cotangents)
        .map(|(y, c)| {
            y.iter()
                .zip(c)
                .map(|(&y, &c)| f64::from(y) * f64::from(c))
                .sum::<f64>()
        })
        .sum()
}

/// Central differences of `f` at `x` with step `h` (f64 arithmetic on f32 evaluations).
pub(super) fn numeric_gradient(x: &[f32], h: f32, f: impl Fn(&[f32]) -> f64) -> Vec<f64> {
    let mut probe = x.to_vec();
    (0..x.len())
        .map(|i| {
            probe[i] = x[i] + h;
            let up = f(&probe);
            probe[i] = x[i] - h;
            let down = f(&probe);
            probe[i] = x[i];
            (up - down) / (2.0 * f64::from(h))
        })
        .collect()
}

/// Finite-difference tolerance: `|numeric − analytic| ≤ 1e-4 + 1e-3·|analytic|`. With f32
/// kernels and step 1e-2 on O(1) inputs the observed worst error is about 2e-5 (truncation O(h²)
/// plus rounding O(1e-7/h)); a 1% error in any gradient term fails.
pub(super) fn assert_gradient(what: &str, numeric: &[f64], analytic: &[f32]) {
    assert_eq!(numeric.len(), analytic.len(), "{what}: length");
    for (i, (&n, &a)) in numeric.iter().zip(analytic).enumerate() {
        let a = f64::from(a);
        assert!(
            (n - a).abs() <= 1e-4 + 1e-3 * a.abs(),
            "{what}[{i}]: numeric {n} vs analytic {a}"
        );
    }
}

/// FD gradient of `Σ_k <cot_k, op(inputs)_k>` with respect to f32 input `which`.
pub(super) fn op_gradient(
    op: &Op,
    inputs: &[Input],
    out_lens: &[usize],
    cotangents: &[Vec<f32>],
    which: usize,
) -> Vec<f64> {
    let Input::F(x) = &inputs[which] else {
        panic!("input {which} is not f32")
    };
    numeric_gradient(x, 1e-2, |probe| {
        let mut perturbed = inputs.to_vec();
        perturbed[which] = Input::F(probe.to_vec());
        pair(&eval(op, &perturbed, out_lens), cotangents)
    })
}

/// For every `(what, k, analytic)` of `checks`, [`assert_gradient`] of `analytic` against the
/// FD gradient of `Σ_k <cot_k, op(inputs)_k>` with respect to f32 input `k` ([`op_gradient`]).
pub(super) fn assert_input_gradients(
    op: &Op,
    inputs: &[Input],
    out_lens: &[usize],
    cotangents: &[Vec<f32>],
    checks: &[(&str, usize, &[f32])],
) {
    for &(what, which, analytic) in checks {
        let numeric = op_gradient(op, inputs, out_lens, cotangents, which);
        assert_gradient(what, &numeric, analytic);
    }
}

pub(super) fn assert_close(what: &str, got: &[f32], expected: &[f64], tol: f64) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    for (i, (&g, &e)) in got.iter().zip(expected).enumerate() {
        assert!(
            (f64::from(g) - e).abs() <= tol * (1.0 + e.abs()),
            "{what}[{i}]: got {g}, expected {e}"
        );
    }
}
