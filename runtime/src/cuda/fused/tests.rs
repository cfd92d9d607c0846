#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::super::codegen::tests::{dtypes, fixtures};
use super::*;
use parc_compiler::kir::expand::expand;

/// Every fixture kernel (primitive and, expanded, composite) for `cols` columns, named.
fn kernels(cols: u64, hd: u64) -> Vec<(String, Kernel)> {
    let mut all: Vec<(String, Kernel)> = fixtures::primitive(cols, hd)
        .into_iter()
        .map(|(n, k)| (format!("{n}/{cols}"), k))
        .collect();
    for (n, k) in fixtures::composite(cols) {
        all.push((format!("{n}/{cols} expanded"), expand(&k)));
    }
    all
}

/// The operand types the tests compile each kernel for: every Elem operand f32, every one
/// bf16, and a mix (even operands bf16).
fn type_sets(k: &Kernel) -> Vec<Vec<DType>> {
    let mut mixed = dtypes(k, DType::F32);
    let accesses: Vec<&Access> = k.inputs.iter().chain(&k.outputs).collect();
    for (i, (d, a)) in mixed.iter_mut().zip(accesses).enumerate() {
        if i % 2 == 0 && matches!(a, Access::Elem { .. }) {
            *d = DType::Bf16;
        }
    }
    vec![dtypes(k, DType::F32), dtypes(k, DType::Bf16), mixed]
}

/// Every fixture's generated source compiles with NVRTC and assembles for sm_90 (ptxas runs
/// for a real architecture): vectorised shapes and scalar ones, one and two levels of row
/// sums, each kernel with two of the three operand type sets (f32, bf16, mixed: rotated, to
/// keep the test near a minute on two cores); the PTX has the ABI's entry and keeps the
/// arithmetic exact (no contraction, no approximate or flush-to-zero instruction). Needs only
/// NVRTC, no GPU; without it the test says so and passes (CI installs it, .ci/run).
#[test]
fn generated_kernels_compile_with_nvrtc() {
    // SAFETY: only tries to load the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("skipped: NVRTC not found (put libnvrtc on LD_LIBRARY_PATH)");
        return;
    }
    let mut compiled = 0;
    for (set, (cols, hd)) in [(64, 16), (42, 14)].into_iter().enumerate() {
        for (i, (name, k)) in kernels(cols, hd).into_iter().enumerate() {
            for types in type_sets(&k).into_iter().skip((i + set) % 3).take(1) {
                let what = format!("{name} {types:?}");
                let ptx = NvrtcEmitter
                    .ptx(&k, &types, "sm_90")
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(ptx.contains(".visible .entry parc_fused("), "{what}");
                let params = k.inputs.len() + k.outputs.len() + 1;
                assert!(
                    ptx.contains(&format!("parc_fused_param_{}", params - 1))
                        && !ptx.contains(&format!("parc_fused_param_{params}")),
                    "{what}: not {params} parameters"
                );
                for bad in [".ftz.", ".approx."] {
                    assert!(!ptx.contains(bad), "{what}: {bad} in the PTX");
                }
                // No fma but the IR's own: none in a kernel without `Node::Fma` (so nothing is
                // contracted), some in one with (NVRTC may unroll a tail, so not counted).
                let mut fused = k.graph.nodes().iter();
                let fused = fused.any(|n| matches!(n, parc_compiler::kir::Node::Fma(..)));
                assert_eq!(ptx.contains("fma.rn.f32"), fused, "{what}: fma in the PTX");
                compiled += 1;
            }
        }
    }
    println!("{compiled} generated kernels compiled");
}

#[test]
fn the_emitter_is_chosen_by_name() {
    assert_eq!(emitter_named("").unwrap().name(), "nvrtc");
    assert_eq!(emitter_named("nvrtc").unwrap().name(), "nvrtc");
    let e = emitter_named("gcc").err().unwrap().to_string();
    assert!(e.contains("PARC_CODEGEN=gcc"), "{e}");
    // LLVM's emitter where this build has it, else an error naming the feature.
    match emitter_named("llvm") {
        Ok(e) => assert_eq!(e.name(), "llvm"),
        Err(e) => assert!(e.to_string().contains("`llvm` feature"), "{e}"),
    }
}

#[test]
fn launches_take_a_thread_per_vector_and_reduce_rows_per_block() {
    // 2^32 elements in vectors of 8: more blocks than a launch starts.
    let cfg = launch_config(Shape::Flat, 1 << 20, 4096, 8);
    assert_eq!((cfg.grid_dim.0, cfg.block_dim.0), (1 << 16, 256));
    let cfg = launch_config(Shape::Flat, 4096, 4096, 8);
    assert_eq!(cfg.grid_dim.0, 4096 * 4096 / 8 / 256);
    let cfg = launch_config(Shape::Flat, 3, 37, 8);
    assert_eq!((cfg.grid_dim.0, cfg.block_dim.0), (1, 256));
    // NVRTC's row sums: a row per warp, 8 a block; LLVM's: a row per block.
    let nvrtc = NvrtcEmitter.reduce_rows_per_block();
    assert_eq!(nvrtc, 8);
    let cfg = launch_config(Shape::Reduce, 5, 4096, nvrtc);
    assert_eq!((cfg.grid_dim.0, cfg.block_dim.0), (1, REDUCE_LANES as u32));
    let cfg = launch_config(Shape::Reduce, 17, 4096, nvrtc);
    assert_eq!(cfg.grid_dim.0, 3);
    let cfg = launch_config(Shape::Reduce, 5, 4096, 1);
    assert_eq!((cfg.grid_dim.0, cfg.block_dim.0), (5, REDUCE_LANES as u32));
    let cfg = launch_config(Shape::Reduce, 1 << 20, 64, 1);
    assert_eq!(cfg.grid_dim.0, 1 << 16);
    let cfg = launch_config(Shape::Rows(2), 64, 42, 8);
    assert_eq!(cfg.grid_dim.0, 6);
}

#[test]
fn bf16_masks_name_the_bf16_operands() {
    assert_eq!(bf16_mask(&[DType::F32, DType::Bf16, DType::Bf16]), 0b110);
    assert_eq!(bf16_mask(&[DType::F32]), 0);
}

/// The kernels `tests/cuda_fused_bench.rs` times, as it builds them (expanded, as the backend
/// compiles them), named as the bench reports them.
fn bench_kernels() -> Vec<(&'static str, Kernel)> {
    let cols = 8192;
    [
        ("copy", fixtures::copy(cols)),
        ("swiglu", fixtures::swiglu(cols)),
        ("swiglu_bwd", fixtures::swiglu_bwd(cols)),
        ("squared_relu", fixtures::squared_relu(cols)),
        ("rms_norm", fixtures::rms(2048)),
    ]
    .into_iter()
    .map(|(name, k)| (name, expand(&k)))
    .collect()
}

/// Writes the CUDA C source and the sm_90a PTX of every kernel of the bandwidth bench, bf16
/// and f32, into `$PARC_FUSED_DUMP` (`<kernel>-<dtype>.cu` and `.ptx`), for
/// bench/fused_kernel_stats.sh to assemble and count without a GPU. Ignored: run by the script.
#[test]
#[ignore = "writes files: run by bench/fused_kernel_stats.sh"]
fn dump_bench_kernels() {
    let dir = std::env::var("PARC_FUSED_DUMP").expect("PARC_FUSED_DUMP: the folder to write to");
    for (name, k) in bench_kernels() {
        for elem in [DType::Bf16, DType::F32] {
            let types = dtypes(&k, elem);
            let stem = format!("{dir}/{name}-{}", elem.name());
            std::fs::write(
                format!("{stem}.cu"),
                NvrtcEmitter::source(&k, &types).unwrap(),
            )
            .unwrap();
            let ptx = NvrtcEmitter.ptx(&k, &types, "sm_90a").unwrap();
            std::fs::write(format!("{stem}.ptx"), ptx).unwrap();
        }
    }
}
