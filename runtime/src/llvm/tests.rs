use super::plan::Plan;
use super::ptx;
use crate::cuda::codegen::tests::dtypes;
use crate::error::RuntimeError;
use parc_compiler::ir::DType;
use parc_compiler::kir::expand::expand;
use parc_compiler::kir::{Access, Bin, Graph, Kernel, Node, Store, Un};

fn has(kernel: &Kernel, f: impl Fn(&Node) -> bool) -> bool {
    kernel.graph.nodes().iter().any(f)
}

/// The operand types each sample is emitted for: every `Elem` operand f32, every one bf16, and
/// a mix (even operands bf16).
pub(super) fn type_sets(kernel: &Kernel) -> Vec<Vec<DType>> {
    let mut mixed = dtypes(kernel, DType::F32);
    let accesses = kernel.inputs.iter().chain(&kernel.outputs);
    for (i, (d, a)) in mixed.iter_mut().zip(accesses).enumerate() {
        if i % 2 == 0 && matches!(a, Access::Elem { .. }) {
            *d = DType::Bf16;
        }
    }
    vec![
        dtypes(kernel, DType::F32),
        dtypes(kernel, DType::Bf16),
        mixed,
    ]
}

/// The fused-op tests' kernels (tests/cuda_ops/fused_kernels.rs, compiled once in this crate).
use crate::cpu::fused::tests::fixtures;

/// Every kernel the emitter is tested on, expanded: the fused-op fixtures (two widths: under and
/// over `REDUCE_LANES` columns).
pub(super) fn kernels() -> Vec<(String, Kernel)> {
    let mut all: Vec<(String, Kernel)> = Vec::new();
    for (cols, head) in [(64, 32), (1000, 40)] {
        let primitive = fixtures::primitive(cols, head).into_iter();
        all.extend(primitive.map(|(n, k)| (format!("{n}/{cols}"), k)));
        let composite = fixtures::composite(cols).into_iter();
        all.extend(composite.map(|(n, k)| (format!("{n}/{cols} expanded"), expand(&k))));
    }
    all
}

/// Every kernel's PTX for sm_90, for each of its type sets: (name, kernel, types, PTX).
fn every_ptx() -> Vec<(String, Kernel, Vec<DType>, String)> {
    let mut all = Vec::new();
    for (name, kernel) in kernels() {
        for types in type_sets(&kernel) {
            let text =
                ptx(&kernel, &types, "sm_90").unwrap_or_else(|e| panic!("{name} {types:?}: {e}"));
            all.push((name.clone(), kernel.clone(), types, text));
        }
    }
    all
}

#[test]
fn the_kernels_are_valid_and_expanded() {
    for (name, k) in kernels() {
        assert_eq!(k.validate(), Ok(()), "{name}");
        assert!(k.is_expanded(), "{name}");
    }
}

#[test]
fn ptx_has_the_abi_entry_and_parameters() {
    for (name, k, types, text) in every_ptx() {
        let what = format!("{name} {types:?}");
        assert!(
            text.contains(".visible .entry parc_fused("),
            "{what}:\n{text}"
        );
        assert!(text.contains(".target sm_90"), "{what}");
        assert!(text.contains(".version 8.0"), "{what}");
        let operands = k.inputs.len() + k.outputs.len();
        for i in 0..operands {
            let param = format!(".param .u64 .ptr .global .align 1 parc_fused_param_{i}");
            let plain = format!(".param .u64 parc_fused_param_{i}");
            assert!(
                text.contains(&param) || text.contains(&plain),
                "{what}: {param}\n{text}"
            );
        }
        let rows = format!(".param .u64 parc_fused_param_{operands}");
        assert!(
            text.contains(&rows),
            "{what}: rows is the last parameter\n{text}"
        );
        let extra = format!("parc_fused_param_{}", operands + 1);
        assert!(!text.contains(&extra), "{what}: a parameter too many");
    }
}

#[test]
fn ptx_rounds_every_op_as_kir_prim() {
    for (name, k, types, text) in every_ptx() {
        let what = format!("{name} {types:?}");
        for banned in ["approx", ".ftz", "bf16", "mad."] {
            assert!(!text.contains(banned), "{what}: `{banned}` in\n{text}");
        }
        // No fma but the IR's own (`Node::Fma`, each emitted once per pass over the row and
        // once for the stores), every one `fma.rn.f32`: nothing was contracted.
        let nodes = k.graph.nodes().iter();
        let written = nodes.filter(|n| matches!(n, Node::Fma(..))).count();
        let fmas = text.matches("fma.rn.f32").count();
        assert_eq!(
            text.matches("fma").count(),
            fmas,
            "{what}: an fma not .rn.f32"
        );
        let copies = Plan::of(&k).passes.len() + 1;
        assert!(
            fmas <= written * copies,
            "{what}: {fmas} fma for {written} nodes"
        );
        assert_eq!(
            fmas > 0,
            written > 0,
            "{what}: {fmas} fma for {written} nodes"
        );
        if has(&k, |n| matches!(n, Node::Bin(Bin::Div, ..))) {
            // `1 / x` may become `rcp.rn.f32`: the IEEE reciprocal, rounded once, as `div.rn`.
            let rounded = text.contains("div.rn.f32") || text.contains("rcp.rn.f32");
            assert!(rounded, "{what}: division not correctly rounded");
        }
        if has(&k, |n| matches!(n, Node::Un(Un::Sqrt, _))) {
            assert!(
                text.contains("sqrt.rn.f32"),
                "{what}: sqrt not correctly rounded"
            );
        }
        if has(&k, |n| matches!(n, Node::Un(Un::Floor, _))) {
            assert!(text.contains("cvt.rmi.f32.f32"), "{what}: floor");
        }
        if has(&k, |n| matches!(n, Node::Bin(Bin::Mul, ..))) {
            assert!(
                text.contains("mul.rn.f32") || text.contains("mul.f32"),
                "{what}"
            );
        }
    }
}

#[test]
fn bf16_operands_move_as_16_bit_words() {
    for (name, k, types, text) in every_ptx() {
        let (ins, outs) = types.split_at(k.inputs.len());
        let words = text.contains("ld.global.u16") || text.contains("ld.global.nc.u16");
        assert_eq!(words, ins.contains(&DType::Bf16), "{name} {types:?}: loads");
        let stores = text.contains("st.global.u16");
        assert_eq!(
            stores,
            outs.contains(&DType::Bf16),
            "{name} {types:?}: stores"
        );
    }
}

#[test]
fn row_sums_reduce_in_one_block_through_shared_memory() {
    for (name, k, types, text) in every_ptx() {
        let sums = has(&k, |n| matches!(n, Node::RowSum(_)));
        assert_eq!(text.contains("bar.sync"), sums, "{name} {types:?}");
        assert_eq!(text.contains(".shared"), sums, "{name} {types:?}");
    }
}

#[test]
fn nested_row_sums_take_one_pass_each() {
    assert_eq!(Plan::of(&fixtures::arith(8)).passes.len(), 0);
    assert_eq!(Plan::of(&fixtures::rms(8)).passes.len(), 1);
    let layer = Plan::of(&fixtures::layer(8));
    assert_eq!(
        layer.passes.iter().map(Vec::len).collect::<Vec<_>>(),
        [1, 1]
    );
}

#[test]
fn row_sums_no_store_needs_are_not_computed() {
    let mut k = fixtures::rms(16);
    let x = k.graph.load(0, 0);
    let unused = k.graph.row_sum(x);
    assert!(unused.index() > 0);
    assert_eq!(Plan::of(&k).passes.len(), 1);
}

#[test]
fn composite_ops_are_refused() {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let y = g.un(Un::Exp, x);
    let k = Kernel {
        cols: 4,
        inputs: vec![Access::Elem { width: 4 }],
        outputs: vec![Access::Elem { width: 4 }],
        graph: g,
        stores: vec![Store {
            output: 0,
            col_offset: 0,
            value: y,
        }],
    };
    let err = ptx(&k, &[DType::F32; 2], "sm_90").map(|_| ()).unwrap_err();
    assert!(matches!(err, RuntimeError::Unsupported(_)), "{err}");
    assert!(err.to_string().contains("expand"), "{err}");
}

#[test]
fn operand_types_outside_the_abi_are_refused() {
    let k = fixtures::rms(16);
    let short = ptx(&k, &[DType::F32], "sm_90").map(|_| ()).unwrap_err();
    assert!(short.to_string().contains("1 operand types"), "{short}");
    let bf16_col = [DType::F32, DType::Bf16, DType::F32, DType::F32];
    let err = ptx(&k, &bf16_col, "sm_90").map(|_| ()).unwrap_err();
    assert!(
        err.to_string()
            .contains("only elementwise operands may be bf16"),
        "{err}"
    );
    let i32_elem = [DType::I32, DType::F32, DType::F32, DType::F32];
    assert!(ptx(&k, &i32_elem, "sm_90").is_err());
}

#[test]
fn the_arch_is_the_ptx_target() {
    let k = fixtures::arith(8);
    let text = ptx(&k, &dtypes(&k, DType::F32), "sm_80").unwrap();
    assert!(text.contains(".target sm_80"));
}

/// ptxas (PARC_PTXAS, or on PATH; e.g. PyPI's nvidia-cuda-nvcc) assembles every sample's PTX
/// for sm_90: the PTX is valid, not only well-formed text. Skips visibly without ptxas on PATH;
/// a PARC_PTXAS that does not run fails.
#[test]
fn ptxas_assembles_every_sample() {
    let given = std::env::var("PARC_PTXAS").ok();
    let ptxas = given.clone().unwrap_or_else(|| "ptxas".into());
    let runs = std::process::Command::new(&ptxas)
        .arg("--version")
        .output()
        .is_ok();
    match (runs, given) {
        (true, _) => {}
        (false, Some(path)) => panic!("PARC_PTXAS={path} does not run"),
        (false, None) => {
            println!("skipped: no ptxas on PATH (set PARC_PTXAS)");
            return;
        }
    }
    let dir = std::env::temp_dir().join(format!("parc-llvm-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, _, types, text) in every_ptx() {
        let file = dir.join(format!("{}.ptx", name.replace(['/', ' '], "_")));
        std::fs::write(&file, &text).unwrap();
        let out = std::process::Command::new(&ptxas)
            .args(["-arch=sm_90", "-o"])
            .arg(dir.join("out.cubin"))
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name} {types:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
