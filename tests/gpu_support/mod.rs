//! What the GPU tests and micro-benchmarks (`tests/cuda_*`, `tests/memplan.rs`) share: the
//! backend they run on, or the visible skip without a GPU, and for the benchmarks their test
//! (skipped without the `cuda` feature), reproducible inputs and the median of timed samples.
//! Each test binary includes this file as a module (`#[path]`), so it is compiled once per
//! binary.
#![allow(dead_code)] // each binary uses a part

/// The ignored test `$name` of a benchmark: it runs `$run` in a `cuda` build, and otherwise
/// prints the skip.
#[allow(unused_macros)] // the benchmarks' binaries use it
macro_rules! gpu_benchmark {
    ($name:ident, $run:path) => {
        #[test]
        #[ignore = "needs a GPU: run on the device machine with --ignored"]
        fn $name() {
            #[cfg(not(feature = "cuda"))]
            println!("skipped: no CUDA device (this build has no `cuda` feature)");
            #[cfg(feature = "cuda")]
            $run();
        }
    };
}
#[allow(unused_imports)]
pub(crate) use gpu_benchmark;

/// `len` values uniform in [lo, hi) from a fixed LCG stream of `seed`. The speeds measured do
/// not depend on the values, but zeros would hide outputs a kernel never wrote (and can run
/// faster), so inputs are never all zero.
pub fn uniform(len: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (state >> 40) as f32 / (1u64 << 24) as f32 * (hi - lo)
        })
        .collect()
}

/// The median of timed samples (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Where `program`'s optimizer phase starts (its first optimizer-phase instruction), and the
/// transient buffers live there (allocated before it and not freed), for the tests and
/// benchmarks that drive the phase alone.
pub fn optimizer_phase_start(
    program: &parc_compiler::ir::Program,
) -> (usize, Vec<parc_compiler::ir::BufferId>) {
    use parc_compiler::ir::{Instr, Phase};
    let start = (program.instrs.iter())
        .position(|i| i.as_compute().is_some_and(|c| c.phase == Phase::Optimizer))
        .expect("an optimizer phase");
    let mut live = Vec::new();
    for instr in &program.instrs[..start] {
        match instr {
            Instr::Alloc { buffer } => live.push(*buffer),
            Instr::Free { buffer } => live.retain(|b| b != buffer),
            _ => {}
        }
    }
    (start, live)
}

/// Runs `instr` of `program` on `backend` if it is an `Alloc` or a `Free`, keeping
/// `allocated` (what is left to free) up to date; false for any other instruction.
#[cfg(feature = "cuda")]
pub fn alloc_or_free(
    backend: &mut parc_runtime::cuda::CudaBackend,
    program: &parc_compiler::ir::Program,
    instr: &parc_compiler::ir::Instr,
    allocated: &mut std::collections::HashSet<parc_compiler::ir::BufferId>,
) -> bool {
    use parc_compiler::ir::Instr;
    use parc_runtime::backend::Backend;
    match instr {
        Instr::Alloc { buffer } => {
            let b = program.buffer(*buffer).unwrap();
            backend.alloc(*buffer, &b.shape, b.dtype).unwrap();
            allocated.insert(*buffer);
        }
        Instr::Free { buffer } => {
            backend.free(*buffer).unwrap();
            allocated.remove(buffer);
        }
        _ => return false,
    }
    true
}

/// A CUDA backend on GPU 0 in `precision`, or None after printing the skip when there is no
/// GPU (a GPU that is there but fails to give a backend fails the benchmark instead).
#[cfg(feature = "cuda")]
pub fn backend_or_skip(
    precision: parc_compiler::spec::Precision,
) -> Option<parc_runtime::cuda::CudaBackend> {
    match parc_runtime::cuda::CudaBackend::with_precision(0, precision) {
        Ok(b) => Some(b),
        Err(e) => {
            assert!(
                parc_runtime::cuda::gpu_absent(&e),
                "a GPU is there, but the CUDA backend failed: {e}"
            );
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}
