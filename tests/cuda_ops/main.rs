//! Differential test of the CUDA backend against the CPU backend (the exact reference): every
//! op of `parc_compiler::ir::op`, forward and backward, on fresh random inputs each run (the
//! seed is printed; set PARC_TEST_SEED to replay one). Outputs start from random values too, so
//! (+=) accumulation and "rest untouched" are checked, not only the written values.
//!
//! Tolerance, per op, on `|gpu − cpu| ≤ tol · (|cpu| + rms(cpu))` (rms: the output's typical
//! size, so values near zero after cancellation are judged on the output's scale):
//! fp32 elementwise 1e-5; reductions, GEMMs, norms, cross-entropy, attention 1e-4.
//! bf16 (`precision = bf16`: GEMM operands rounded to bf16, fp32 accumulation): GEMMs 2e-2
//! against the fp32 CPU (each operand carries up to 2^-9 relative rounding; the sum's error is
//! a random walk on the output's scale, a few 1e-3 in practice), and the worst error must also
//! be above 1e-4, so a bf16 run that silently stayed fp32 fails; attention with head_dim 64 or
//! 128 runs on tensor cores in a bf16 run (bf16 operands; the cases give it bf16-valued inputs,
//! so P and dS carry the rounding): forward 2e-2, backward 5e-2, and it too must be above 1e-4;
//! every other op on f32 buffers keeps the fp32 tolerances in a bf16 run.
//! bf16 storage (`*_bf16_storage`: both backends store the op's float operands in bf16, as a
//! bf16 plan does): exact where both backends round the same f32 result (add, scale, relu,
//! copies and conversions, zero, embedding and position-add forward, `CeMax`,
//! `CeTargetLogit`), 2e-2 where the f32 results may differ in their last bits and so round to
//! neighbouring bf16 values, the fp32 tolerances for fp32 outputs; every bf16 output must hold
//! bf16 values.
//! fp16 (`precision = fp16`: GEMM operands rounded to IEEE half, fp32 accumulation): GEMMs 5e-3
//! (2^-11 relative rounding per operand, 4× finer than bf16), and the worst error must be above
//! 2e-5; the conversion is checked bit-exactly (ties to even, subnormals, overflow to infinity
//! past 65504). Under fp16 loss scaling (`StepScalars::loss_scale`) `CeGrad`, `ClipCoef` and
//! the updates hold the fp32 tolerances, and an overflowed step's NaN coefficient leaves the
//! parameters and optimizer state untouched on both backends.
//!
//! FP8 GEMMs (`fp8`): against the CPU's exact emulation, 1e-3 on f32 outputs (identical
//! FP8 products summed in another order), `BF16_STORED` on bf16 outputs.
//!
//! Without a GPU (or built without `--features cuda`) every test prints
//! `skipped: no CUDA device (…)` and passes.
//!
//! `harness` holds the shared machinery (random inputs, one op call on a backend, the
//! CUDA-against-CPU comparison, the tolerances); each other module is one op group.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod attention;
mod cross_entropy;
mod elementwise;
mod emitters;
mod errors;
mod fp8;
mod fp8_amax;
mod fused;
mod fused_kernels;
#[cfg(feature = "cuda")]
#[path = "../gpu_support/mod.rs"]
mod gpu_support;
mod harness;
mod layers;
mod loss_and_optimizer;
mod matmul;
