//! The LLVM emitter's kernels run on the GPU against the reference evaluator
//! (`kir::eval::run`), bit for bit: every fused-op
//! fixture (tests/cuda_ops/fused_kernels.rs) with its `Elem` operands f32, bf16 and mixed, launched as the ABI allows (odd grids and blocks for
//! elementwise kernels; `REDUCE_LANES` threads and fewer blocks than rows for row sums), for a
//! few rows and for more rows than the grid covers at once. The NVRTC emitter meets the same
//! reference (tests/cuda_ops), so the two agree. Skips visibly without a GPU.
use super::tests::{kernels, type_sets};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use parc_compiler::ir::DType;
use parc_compiler::kir::{eval, Access, Kernel, Node, REDUCE_LANES};
use std::sync::Arc;

/// Device 0's stream, or None (printed as skipped) without a driver or a device.
fn gpu() -> Option<Arc<CudaStream>> {
    // SAFETY: only tries to load libcuda; calls nothing in it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("skipped: no CUDA device (libcuda could not be loaded)");
        return None;
    }
    if CudaContext::device_count().map_or(true, |n| n < 1) {
        println!("skipped: no CUDA device");
        return None;
    }
    Some(CudaContext::new(0).unwrap().default_stream())
}

/// x rounded to the nearest bf16, ties to even (common.cuh's `round_bf16`).
fn round_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

fn widen(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

enum Buf {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl Buf {
    fn upload(stream: &Arc<CudaStream>, values: &[f32], dtype: DType) -> Buf {
        match dtype {
            DType::Bf16 => {
                let h: Vec<u16> = values.iter().map(|&v| round_bf16(v)).collect();
                Buf::Bf16(stream.clone_htod(&h).unwrap())
            }
            _ => Buf::F32(stream.clone_htod(values).unwrap()),
        }
    }

    fn download(&self, stream: &Arc<CudaStream>) -> Vec<f32> {
        match self {
            Buf::F32(b) => stream.clone_dtoh(b).unwrap(),
            Buf::Bf16(b) => stream
                .clone_dtoh(b)
                .unwrap()
                .into_iter()
                .map(widen)
                .collect(),
        }
    }
}

fn len(access: &Access, rows: u64, cols: u64) -> usize {
    (match *access {
        Access::Elem { width } => rows * width,
        Access::Row => rows,
        Access::Col => cols,
        Access::PerPosition { batch, width } => rows.div_ceil(batch) * width,
    }) as usize
}

/// splitmix64 values uniform in [-2, 2).
fn random(n: usize, seed: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = *seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 22) as f32 - 2.0
        })
        .collect()
}

/// The kernel's outputs on the GPU for these inputs (as stored: bf16 ones widened).
fn on_gpu(
    stream: &Arc<CudaStream>,
    k: &Kernel,
    types: &[DType],
    rows: u64,
    inputs: &[Vec<f32>],
) -> Vec<Vec<f32>> {
    let text = super::ptx(k, types, "sm_90").unwrap();
    let module = stream.context().load_module(Ptx::from_src(text)).unwrap();
    let f = module.load_function("parc_fused").unwrap();
    let (in_types, out_types) = types.split_at(k.inputs.len());
    let ins: Vec<Buf> = (inputs.iter().zip(in_types))
        .map(|(v, &t)| Buf::upload(stream, v, t))
        .collect();
    let outs: Vec<Buf> = (k.outputs.iter().zip(out_types))
        .map(|(a, &t)| Buf::upload(stream, &vec![f32::NAN; len(a, rows, k.cols)], t))
        .collect();
    let reduce = k.graph.nodes().iter().any(|n| matches!(n, Node::RowSum(_)));
    let (grid, block) = if reduce {
        ((rows as u32).min(37), REDUCE_LANES as u32)
    } else {
        (13, 96)
    };
    let mut launch = stream.launch_builder(&f);
    for b in ins.iter().chain(&outs) {
        match b {
            Buf::F32(s) => launch.arg(s),
            Buf::Bf16(s) => launch.arg(s),
        };
    }
    let rows_arg = rows as i64;
    launch.arg(&rows_arg);
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: every buffer holds the elements the kernel's accesses reach for `rows` rows; the
    // arguments follow the ABI (a pointer per operand, then the rows).
    unsafe { launch.launch(cfg) }.unwrap();
    outs.iter().map(|b| b.download(stream)).collect()
}

/// The reference: `kir::eval::run` on the inputs as stored, outputs rounded as stored.
fn reference(k: &Kernel, types: &[DType], rows: u64, inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let (in_types, out_types) = types.split_at(k.inputs.len());
    let stored: Vec<Vec<f32>> = (inputs.iter().zip(in_types))
        .map(|(v, t)| match t {
            DType::Bf16 => v.iter().map(|&x| widen(round_bf16(x))).collect(),
            _ => v.clone(),
        })
        .collect();
    let slices: Vec<&[f32]> = stored.iter().map(Vec::as_slice).collect();
    let mut outs: Vec<Vec<f32>> = (k.outputs.iter())
        .map(|a| vec![0.0; len(a, rows, k.cols)])
        .collect();
    let mut views: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
    eval::run(k, 0, rows as usize, &slices, &mut views).unwrap();
    (outs.into_iter().zip(out_types))
        .map(|(v, t)| match t {
            DType::Bf16 => v.into_iter().map(|x| widen(round_bf16(x))).collect(),
            _ => v,
        })
        .collect()
}

#[test]
fn kernels_on_the_gpu_equal_the_reference_evaluator_bit_for_bit() {
    let Some(stream) = gpu() else {
        return;
    };
    let mut seed = 0x5eed_u64;
    let (mut cases, mut values) = (0, 0);
    for (name, k) in kernels() {
        for types in type_sets(&k) {
            for rows in [3u64, 2500] {
                let inputs: Vec<Vec<f32>> = (k.inputs.iter())
                    .map(|a| random(len(a, rows, k.cols), &mut seed))
                    .collect();
                let got = on_gpu(&stream, &k, &types, rows, &inputs);
                let want = reference(&k, &types, rows, &inputs);
                for (o, (g, w)) in got.iter().zip(&want).enumerate() {
                    let bad = (g.iter().zip(w).enumerate())
                        .find(|(_, (a, b))| a.to_bits() != b.to_bits());
                    if let Some((i, (a, b))) = bad {
                        panic!(
                            "{name} {types:?} rows {rows}: output {o}[{i}]: gpu {a:e} ({:#010x}), reference {b:e} ({:#010x})",
                            a.to_bits(),
                            b.to_bits()
                        );
                    }
                    values += g.len();
                }
                cases += 1;
            }
        }
    }
    println!(
        "llvm kernels on the GPU: {cases} cases, {values} values equal to kir::eval bit for bit"
    );
}
