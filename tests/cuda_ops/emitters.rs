//! The two emitters of generated kernels against each other (feature `llvm`): every kernel of
//! the fused-op tests (fused_kernels.rs, composite ones expanded by the launcher) runs as an `Op::Fused` on two
//! CUDA backends, one generating with NVRTC and one with LLVM, on the same random inputs, with
//! every `Elem` operand f32, bf16, or mixed; each output must be bit-identical (both follow
//! `kir::prim` and the `REDUCE_LANES` order). Row counts below and above the launch's grid, so
//! the grid-stride loops take several steps.

#[cfg(feature = "llvm")]
mod on_gpu {
    use crate::fused_kernels as fixtures;
    use crate::harness::{cuda_backend, Case, Data, Rng};
    use parc_compiler::ir::op::{FusedAttrs, Op};
    use parc_compiler::ir::{BufferId, DType};
    use parc_compiler::kir::{Access, Kernel};
    use parc_compiler::spec::Precision;
    use parc_runtime::backend::Backend;
    use parc_runtime::cuda::{emitter_named, CudaBackend};
    use std::sync::Arc;

    /// Every kernel both emitters run, named.
    fn kernels() -> Vec<(String, Kernel)> {
        let mut all: Vec<(String, Kernel)> = Vec::new();
        // Head dims dividing the columns (RoPE's rotation needs it), 1000 wide rows below and
        // above a vector's multiple.
        for (cols, hd) in [(64, 32), (1000, 40), (42, 14)] {
            let fixtures = fixtures::primitive(cols, hd)
                .into_iter()
                .chain(fixtures::composite(cols));
            all.extend(fixtures.map(|(n, k)| (format!("{n}/{cols}"), k)));
        }
        all
    }

    /// The operand types: every `Elem` operand f32, every one bf16, and even ones bf16.
    fn type_sets(k: &Kernel) -> Vec<Vec<DType>> {
        let accesses: Vec<&Access> = k.inputs.iter().chain(&k.outputs).collect();
        let with = |bf16: &dyn Fn(usize) -> bool| -> Vec<DType> {
            (accesses.iter().enumerate())
                .map(|(i, a)| match a {
                    Access::Elem { .. } if bf16(i) => DType::Bf16,
                    _ => DType::F32,
                })
                .collect()
        };
        vec![with(&|_| false), with(&|_| true), with(&|i| i % 2 == 0)]
    }

    /// Elements of an operand of `access` for `rows` rows of a kernel of `cols` columns.
    fn len(access: &Access, rows: u64, cols: u64) -> usize {
        (match *access {
            Access::Elem { width } => rows * width,
            Access::Row => rows,
            Access::Col => cols,
            Access::PerPosition { batch, width } => rows.div_ceil(batch) * width,
        }) as usize
    }

    fn case(name: &str, k: &Kernel, rows: u64, dtypes: &[DType], rng: &mut Rng) -> Case {
        let op = Op::Fused(FusedAttrs {
            name: name.into(),
            rows: None,
            kernel: Arc::new(k.clone()),
        });
        let inputs = (k.inputs.iter())
            .map(|a| Data::F32(rng.vec(len(a, rows, k.cols), 2.0)))
            .collect();
        let outputs = (k.outputs.iter())
            .map(|a| rng.vec(len(a, rows, k.cols), 1.0))
            .collect();
        let (ins, outs) = dtypes.split_at(k.inputs.len());
        Case::new(format!("{name} rows {rows}"), op, inputs, outputs, 0.0)
            .with_dtypes(ins, outs, 0.0)
    }

    /// The case's outputs on `backend`, its buffers freed after.
    fn run(case: &Case, backend: &mut CudaBackend, k: &Kernel) -> Vec<Vec<f32>> {
        let outputs = case.run(backend as &mut dyn Backend);
        for i in 0..k.inputs.len() + k.outputs.len() {
            backend.free(BufferId(i as u32)).unwrap();
        }
        outputs
    }

    #[test]
    fn llvm_and_nvrtc_kernels_agree_bit_for_bit() {
        let Some(mut nvrtc) = cuda_backend(Precision::Fp32) else {
            return;
        };
        let Some(mut llvm) = cuda_backend(Precision::Fp32) else {
            return;
        };
        nvrtc.set_emitter(emitter_named("nvrtc").unwrap());
        llvm.set_emitter(emitter_named("llvm").unwrap());
        let mut rng = Rng::new("emitters");
        let (mut cases, mut values) = (0, 0);
        for (name, k) in kernels() {
            for dtypes in type_sets(&k) {
                for rows in [3, 2500] {
                    let case = case(&name, &k, rows, &dtypes, &mut rng);
                    let a = run(&case, &mut nvrtc, &k);
                    let b = run(&case, &mut llvm, &k);
                    for (o, (a, b)) in a.iter().zip(&b).enumerate() {
                        let bad = (a.iter().zip(b).enumerate())
                            .find(|(_, (x, y))| x.to_bits() != y.to_bits());
                        if let Some((i, (x, y))) = bad {
                            panic!(
                                "{} {dtypes:?}: output {o}[{i}]: nvrtc {x:e} ({:#010x}), llvm {y:e} ({:#010x})",
                                case.name(),
                                x.to_bits(),
                                y.to_bits()
                            );
                        }
                        values += a.len();
                    }
                    cases += 1;
                }
            }
        }
        println!("emitters: {cases} cases, {values} output values bit-identical");
    }
}
