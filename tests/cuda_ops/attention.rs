//! Attention, forward and backward: the fp32 kernels on small and GQA shapes, context-parallel
//! segments and kv ahead of q, and in a bf16 run the tensor-core kernels (head_dim 64 or 128)
//! within `BF16_ATTENTION`, while other head dims stay exact fp32; then bf16 storage (bf16
//! q/k/v/o/dO/dQ/dK/dV buffers) on both kernel families against the CPU's bf16 run. On a
//! Hopper GPU the same again for the warp-specialized `ws` kernels (the defaults there) and the
//! `wgmma` forward variant (set on its backend), after an exact check of the wgmma layouts on
//! their own.
#[cfg(feature = "cuda")]
use crate::harness::BF16_ATTENTION_LONG;
use crate::harness::{
    check, check_on, gpu_with, seg, Case, Data, Rng, BF16_ATTENTION, BF16_ROUNDED, REDUCTION,
    SCALARS,
};
use parc_compiler::ir::op::AttentionAttrs;
use parc_compiler::ir::op::{Op, Segment};
use parc_compiler::ir::{BufferId, DType};
use parc_compiler::spec::Precision;
use parc_runtime::backend::Backend;
use parc_runtime::cpu::CpuBackend;
#[cfg(feature = "cuda")]
use parc_runtime::cuda::{AttentionBwdKernel, AttentionFwdKernel, Variant};

/// One attention shape: batch, heads, kv heads (GQA when fewer), head dim, causal mask, and the
/// global positions of the q rows and of the kv rows.
struct AttConfig {
    batch: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    causal: bool,
    q_positions: Vec<Segment>,
    kv_positions: Vec<Segment>,
}

impl AttConfig {
    /// The positions are `(start, len)` segments.
    fn new(
        batch: u64,
        heads: u64,
        kv_heads: u64,
        head_dim: u64,
        causal: bool,
        q_positions: &[(u32, u32)],
        kv_positions: &[(u32, u32)],
    ) -> AttConfig {
        let segments = |s: &[(u32, u32)]| s.iter().map(|&(start, len)| seg(start, len)).collect();
        AttConfig {
            batch,
            heads,
            kv_heads,
            head_dim,
            causal,
            q_positions: segments(q_positions),
            kv_positions: segments(kv_positions),
        }
    }
}

/// `x` rounded to the nearest bf16 (ties to even; finite inputs).
fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1));
    f32::from_bits(rounded & 0xffff_0000)
}

/// The forward and backward ops of `c`, with scale 1/√head_dim.
fn attention_ops(c: &AttConfig) -> (Op, Op) {
    let scale = 1.0 / (c.head_dim as f64).sqrt();
    let fwd = Op::Attention(AttentionAttrs {
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        causal: c.causal,
        scale,
        q_positions: c.q_positions.clone(),
        kv_positions: c.kv_positions.clone(),
        packed: false,
    });
    let bwd = Op::AttentionBwd(AttentionAttrs {
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        causal: c.causal,
        scale,
        q_positions: c.q_positions.clone(),
        kv_positions: c.kv_positions.clone(),
        packed: false,
    });
    (fwd, bwd)
}

/// Forward and backward cases of `c`, held to `tol` (forward, backward). With `bf16_inputs`, q, k, v and dO are
/// bf16 values (as a bf16 run's tensor cores read them), so the comparison measures the
/// kernels' own rounding (P and dS in bf16) rather than the inputs'.
fn attention_cases(r: &mut Rng, c: &AttConfig, tol: (f32, f32), bf16_inputs: bool) -> Vec<Case> {
    let seq_q: u32 = c.q_positions.iter().map(|s| s.len).sum();
    let seq_kv: u32 = c.kv_positions.iter().map(|s| s.len).sum();
    let q_len = (u64::from(seq_q) * c.batch * c.heads * c.head_dim) as usize;
    let kv_len = (u64::from(seq_kv) * c.batch * c.kv_heads * c.head_dim) as usize;
    let lse_len = (c.batch * c.heads * u64::from(seq_q)) as usize;
    let (fwd, bwd) = attention_ops(c);
    let name = format!(
        "b{} h{} kv{} d{} causal={} q{:?} kv{:?}",
        c.batch, c.heads, c.kv_heads, c.head_dim, c.causal, c.q_positions, c.kv_positions
    );
    let (mut q, mut k, mut v) = (r.vec(q_len, 2.0), r.vec(kv_len, 2.0), r.vec(kv_len, 1.0));
    let mut dout = r.vec(q_len, 1.0);
    if bf16_inputs {
        for x in [&mut q, &mut k, &mut v, &mut dout] {
            x.iter_mut().for_each(|e| *e = round_bf16(*e));
        }
    }
    let fwd_case = Case::new(
        format!("attention {name}"),
        fwd,
        vec![
            Data::F32(q.clone()),
            Data::F32(k.clone()),
            Data::F32(v.clone()),
        ],
        vec![r.vec(q_len, 1.0), r.vec(lse_len, 1.0)],
        tol.0,
    );
    let out = fwd_case.run(&mut CpuBackend::new());
    let bwd_case = Case::new(
        format!("attention_bwd {name}"),
        bwd,
        vec![
            Data::F32(dout),
            Data::F32(q),
            Data::F32(k),
            Data::F32(v),
            Data::F32(out[0].clone()),
            Data::F32(out[1].clone()),
        ],
        vec![r.vec(q_len, 1.0), r.vec(kv_len, 1.0), r.vec(kv_len, 1.0)],
        tol.1,
    );
    // Over a single key, dQ and dK vanish in exact arithmetic (dS = P·(dP − D) with P = 1 and
    // dP = D): the reference's values are its own rounding (~1e-7, either sign), so both sides'
    // rounding is judged against dV's scale (dV = dO there), not their own.
    let bwd_case = if seq_kv == 1 {
        bwd_case.errors_scaled_by_output(2)
    } else {
        bwd_case
    };
    vec![fwd_case, bwd_case]
}

#[test]
fn attention() {
    let mut r = Rng::new("attention");
    let configs = [
        // Small head dim, GQA, causal, one segment.
        AttConfig::new(2, 4, 2, 16, true, &[(0, 40)], &[(0, 40)]),
        // Context parallel: the rank's q chunk is two segments, kv the whole sequence.
        AttConfig::new(1, 2, 2, 32, true, &[(8, 8), (40, 8)], &[(0, 48)]),
        // kv ahead of q: the first queries see no key (o = 0, lse = −inf).
        AttConfig::new(1, 2, 1, 8, true, &[(0, 6)], &[(3, 6)]),
        AttConfig::new(2, 3, 3, 64, false, &[(0, 70)], &[(0, 70)]),
        AttConfig::new(1, 4, 1, 128, true, &[(0, 65)], &[(0, 65)]),
        AttConfig::new(2, 2, 2, 64, true, &[(0, 300)], &[(0, 300)]),
        // Heads above 128 take the kernels with 8 columns a lane (`_w8`) and more than 48 KiB
        // of shared memory a block: Gemma's 256 (GQA, several tiles), and 160.
        AttConfig::new(1, 4, 2, 256, true, &[(0, 70)], &[(0, 70)]),
        AttConfig::new(2, 2, 1, 160, false, &[(0, 40)], &[(0, 40)]),
        // Context parallel at 256: two q segments, kv ahead of part of them.
        AttConfig::new(1, 2, 2, 256, true, &[(8, 8), (40, 8)], &[(0, 48)]),
    ];
    let cases: Vec<Case> = configs
        .iter()
        .flat_map(|c| attention_cases(&mut r, c, (REDUCTION, REDUCTION), false))
        .collect();
    check("attention", &cases);
}

/// In a bf16 run, attention with head_dim 64 or 128 runs on tensor cores (bf16 operands, fp32
/// accumulation and softmax): within BF16_ATTENTION of the fp32 CPU, and its worst error must
/// exceed BF16_ROUNDED (the operands were rounded, so the tensor-core kernels ran). Other head
/// dims keep the exact fp32 kernels and the fp32 tolerance in a bf16 run.
/// The shapes the tensor-core kernels are checked on in a bf16 run.
fn tc_configs() -> Vec<AttConfig> {
    vec![
        // GQA, causal, a partial tile.
        AttConfig::new(2, 4, 2, 64, true, &[(0, 40)], &[(0, 40)]),
        // Several tiles: skipped, masked and whole ones.
        AttConfig::new(2, 2, 2, 64, true, &[(0, 300)], &[(0, 300)]),
        // Context parallel: two q segments, kv the whole sequence.
        AttConfig::new(1, 2, 2, 128, true, &[(16, 48), (160, 48)], &[(0, 208)]),
        // kv ahead of q: the first queries see no key (o = 0, lse = −inf).
        AttConfig::new(1, 2, 1, 64, true, &[(0, 70)], &[(5, 70)]),
        // Positions not ascending: every tile masked, none skipped.
        AttConfig::new(
            1,
            2,
            2,
            64,
            true,
            &[(64, 64), (0, 64)],
            &[(64, 64), (0, 64)],
        ),
        AttConfig::new(2, 3, 3, 64, false, &[(0, 70)], &[(0, 70)]),
        AttConfig::new(1, 4, 1, 128, true, &[(0, 200)], &[(0, 200)]),
    ]
}

#[test]
fn attention_bf16() {
    let mut r = Rng::new("attention_bf16");
    let tc = tc_configs();
    let cases: Vec<Case> = tc
        .iter()
        .flat_map(|c| attention_cases(&mut r, c, BF16_ATTENTION, true))
        .collect();
    let worst = check_on("attention_bf16", &cases, Precision::Bf16);
    // Every output but lse (which can round to its fp32 value) must show bf16 rounding.
    let rounded = worst.iter().filter(|&&e| e > BF16_ROUNDED).count();
    assert!(
        worst.is_empty() || rounded >= worst.len() - tc.len(),
        "bf16 attention agrees with fp32 to {BF16_ROUNDED:.0e} in {} of {} outputs: the \
         tensor-core kernels did not run",
        worst.len() - rounded,
        worst.len()
    );
    for exact in [
        AttConfig::new(2, 4, 2, 32, true, &[(0, 40)], &[(0, 40)]),
        AttConfig::new(1, 4, 2, 256, true, &[(0, 70)], &[(0, 70)]),
    ] {
        check_on(
            "attention_bf16_other_head_dims_stay_fp32",
            &attention_cases(&mut r, &exact, (REDUCTION, REDUCTION), false),
            Precision::Bf16,
        );
    }
}

/// One buffer of a bf16-storage case: its data and how it is stored.
type Typed = (Vec<f32>, DType);

/// Runs `op` on `b` with every input and output buffer allocated in its own dtype (inputs
/// written, outputs filled with their initial data first); returns the outputs, widened.
fn run_typed(b: &mut dyn Backend, op: &Op, inputs: &[Typed], outputs: &[Typed]) -> Vec<Vec<f32>> {
    let mut ids = Vec::new();
    for (i, (data, dtype)) in inputs.iter().chain(outputs).enumerate() {
        let id = BufferId(i as u32);
        b.alloc(id, &[data.len() as u64], *dtype).unwrap();
        b.write_f32(id, data).unwrap();
        ids.push(id);
    }
    let (ins, outs) = ids.split_at(inputs.len());
    b.compute(op, ins, outs, &SCALARS)
        .unwrap_or_else(|e| panic!("{op:?} on {}: {e}", b.name()));
    let got = outs.iter().map(|&id| b.read_f32(id).unwrap()).collect();
    for &id in &ids {
        b.free(id).unwrap();
    }
    got
}

/// The worst `|got − want| / (|want| + rms(want))` and where it is (the harness's measure).
fn worst_error(got: &[f32], want: &[f32]) -> (f32, usize) {
    assert_eq!(got.len(), want.len());
    let rms = (want.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / want.len().max(1) as f64)
        .sqrt() as f32;
    let mut worst = (0.0f32, 0usize);
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let err = if a.is_finite() && b.is_finite() {
            (a - b).abs() / (b.abs() + rms).max(f32::MIN_POSITIVE)
        } else if a == b {
            0.0
        } else {
            f32::INFINITY
        };
        if err > worst.0 || err.is_nan() {
            worst = (err, i);
        }
    }
    worst
}

/// One bf16 ulp at the output's scale: the exact kernels and the CPU compute the same f32
/// values up to summation order, then each round once, so they differ by at most one bf16
/// step (2^-8 relative) where a value sits near a rounding boundary.
const BF16_STORED_EXACT: f32 = 8e-3;

/// Buffers stored bf16 (as a bf16 run's plan stores activations): the tensor-core kernels read
/// q, k, v, dO in place and write O, dQ, dK, dV as bf16 (lse stays f32), the exact kernels
/// (other head dims) read and write bf16 too; both against the CPU backend's run on the same
/// bf16 buffers (widen, compute in f32, round each output once). Also one case with q and o
/// kept f32 (q copied to bf16 for the tensor cores, o written f32).
#[test]
fn attention_bf16_storage() {
    let Some(mut gpu) = gpu_with(Precision::Bf16) else {
        return;
    };
    check_storage("attention_bf16_storage", gpu.as_mut());
}

/// `attention_bf16_storage`'s cases on `gpu` (a bf16 backend), reported under `test`.
fn check_storage(test: &str, gpu: &mut dyn Backend) {
    let mut r = Rng::new(test);
    let (bf, f32) = (DType::Bf16, DType::F32);
    // q, k, v, o, lse, dO, dq, dk, dv (lse is always f32).
    let all_bf16 = [bf, bf, bf, bf, f32, bf, bf, bf, bf];
    // q, o and dq f32, the rest bf16.
    let mixed = [f32, bf, bf, f32, f32, bf, f32, bf, bf];
    let tc = BF16_ATTENTION;
    let exact = (BF16_STORED_EXACT, BF16_STORED_EXACT);
    let cases: Vec<(AttConfig, [DType; 9], (f32, f32))> = vec![
        // GQA, causal, a partial tile.
        (
            AttConfig::new(2, 4, 2, 64, true, &[(0, 40)], &[(0, 40)]),
            all_bf16,
            tc,
        ),
        // Several tiles: skipped, masked and whole ones; load balance over 3 query tiles.
        (
            AttConfig::new(2, 2, 2, 64, true, &[(0, 300)], &[(0, 300)]),
            all_bf16,
            tc,
        ),
        // Context parallel: two q segments, kv the whole sequence.
        (
            AttConfig::new(1, 2, 2, 128, true, &[(16, 48), (160, 48)], &[(0, 208)]),
            all_bf16,
            tc,
        ),
        // kv ahead of q: the first queries see no key (o = 0, lse = −inf).
        (
            AttConfig::new(1, 2, 1, 64, true, &[(0, 70)], &[(5, 70)]),
            all_bf16,
            tc,
        ),
        // Positions not ascending: every tile masked, none skipped.
        (
            AttConfig::new(
                1,
                2,
                2,
                64,
                true,
                &[(64, 64), (0, 64)],
                &[(64, 64), (0, 64)],
            ),
            all_bf16,
            tc,
        ),
        // Not causal, a partial key block (masked keys past seq_kv).
        (
            AttConfig::new(2, 3, 3, 64, false, &[(0, 70)], &[(0, 70)]),
            all_bf16,
            tc,
        ),
        // GQA 4:1, head dim 128, several key blocks.
        (
            AttConfig::new(1, 4, 1, 128, true, &[(0, 200)], &[(0, 200)]),
            mixed,
            tc,
        ),
        // The exact kernels (head dim 32) on bf16 buffers, GQA, CP segments.
        (
            AttConfig::new(2, 4, 2, 32, true, &[(8, 24), (48, 16)], &[(0, 64)]),
            all_bf16,
            exact,
        ),
        (
            AttConfig::new(1, 2, 1, 16, false, &[(0, 33)], &[(0, 33)]),
            mixed,
            exact,
        ),
    ];
    let mut failures = Vec::new();
    for (c, dtypes, tol) in &cases {
        let seq_q: u32 = c.q_positions.iter().map(|s| s.len).sum();
        let seq_kv: u32 = c.kv_positions.iter().map(|s| s.len).sum();
        let q_len = (u64::from(seq_q) * c.batch * c.heads * c.head_dim) as usize;
        let kv_len = (u64::from(seq_kv) * c.batch * c.kv_heads * c.head_dim) as usize;
        let lse_len = (c.batch * c.heads * u64::from(seq_q)) as usize;
        let (fwd, bwd) = attention_ops(c);
        let name = format!(
            "b{} h{} kv{} d{} causal={} q{:?} kv{:?} {:?}",
            c.batch,
            c.heads,
            c.kv_heads,
            c.head_dim,
            c.causal,
            c.q_positions,
            c.kv_positions,
            dtypes
        );
        let [qt, kt, vt, ot, lt, dot, dqt, dkt, dvt] = *dtypes;
        // bf16 values even in f32 buffers, so the tensor cores' copies of them are exact and the
        // comparison measures the kernels' own rounding.
        let input = |r: &mut Rng, n: usize, scale: f32| -> Vec<f32> {
            r.vec(n, scale).into_iter().map(round_bf16).collect()
        };
        let fwd_in = [
            (input(&mut r, q_len, 2.0), qt),
            (input(&mut r, kv_len, 2.0), kt),
            (input(&mut r, kv_len, 1.0), vt),
        ];
        let fwd_out = [(r.vec(q_len, 1.0), ot), (r.vec(lse_len, 1.0), lt)];
        let want = run_typed(&mut CpuBackend::new(), &fwd, &fwd_in, &fwd_out);
        let got = run_typed(gpu, &fwd, &fwd_in, &fwd_out);
        let bwd_in = [
            (input(&mut r, q_len, 1.0), dot),
            fwd_in[0].clone(),
            fwd_in[1].clone(),
            fwd_in[2].clone(),
            (want[0].clone(), ot),
            (want[1].clone(), lt),
        ];
        let bwd_out = [
            (r.vec(q_len, 1.0), dqt),
            (r.vec(kv_len, 1.0), dkt),
            (r.vec(kv_len, 1.0), dvt),
        ];
        let want_b = run_typed(&mut CpuBackend::new(), &bwd, &bwd_in, &bwd_out);
        let got_b = run_typed(gpu, &bwd, &bwd_in, &bwd_out);
        let outputs = [
            ("o", ot, tol.0, &got[0], &want[0]),
            ("lse", lt, tol.0, &got[1], &want[1]),
            ("dq", dqt, tol.1, &got_b[0], &want_b[0]),
            ("dk", dkt, tol.1, &got_b[1], &want_b[1]),
            ("dv", dvt, tol.1, &got_b[2], &want_b[2]),
        ];
        for (what, dtype, tol, g, w) in outputs {
            let (err, i) = worst_error(g, w);
            println!(
                "{test}/{name} {what} ({dtype:?}): {} values, worst relative error {err:.3e} at {i} (cuda {} cpu {}), tol {tol:.0e}",
                w.len(), g[i], w[i]
            );
            if err.is_nan() || err > tol {
                failures.push(format!("{name} {what}: error {err:.3e} > {tol:.0e} at {i}"));
            }
            // A bf16 output holds only bf16 values (read back widened).
            if dtype == DType::Bf16 {
                if let Some(x) = g.iter().find(|x| x.is_finite() && round_bf16(**x) != **x) {
                    failures.push(format!("{name} {what}: {x} is not a bf16 value"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{test}: CUDA differs from CPU:\n{}",
        failures.join("\n")
    );
}

/// More work items than a GPU has SMs, both ways: a persistent CTA takes several, its rings
/// wrapping across them (causal GQA 2:1; partial non-causal tiles).
#[cfg(feature = "cuda")]
fn many_items_configs() -> [AttConfig; 2] {
    [
        AttConfig::new(2, 80, 40, 64, true, &[(0, 256)], &[(0, 256)]),
        AttConfig::new(3, 50, 50, 64, false, &[(0, 200)], &[(0, 200)]),
    ]
}

/// GPT-2's sequence (T 1024, d 64) on a few heads, GQA 2:1: 8 key blocks, every tile kind.
#[cfg(feature = "cuda")]
fn gpt2_length_config() -> AttConfig {
    AttConfig::new(1, 4, 2, 64, true, &[(0, 1024)], &[(0, 1024)])
}

/// The warp-specialized attention backward (`ws`, PARC_ATTENTION_BWD_KERNEL's Hopper default,
/// head_dim 64 and 128): the test sets it on its own backend, whatever the environment says,
/// and runs more heads than SMs (a persistent CTA's rings wrap across work items),
/// attention_bf16's and attention_bf16_storage's cases and a GPT-2-length sequence against the
/// CPU under the same tolerances (head dim 128 has its own cases in `attention_bf16_ws_d128`).
#[cfg(feature = "cuda")]
#[test]
fn attention_bf16_ws_bwd() {
    let Some(mut gpu) = crate::harness::hopper_variant(Precision::Bf16, AttentionBwdKernel::Ws)
    else {
        return;
    };
    let test = "attention_bf16_ws_bwd";
    let mut r = Rng::new(test);
    for c in many_items_configs() {
        crate::harness::check_with(
            &format!("{test}_many_items"),
            &attention_cases(&mut r, &c, BF16_ATTENTION, true),
            &mut gpu,
        );
    }
    let cases: Vec<Case> = tc_configs()
        .iter()
        .flat_map(|c| attention_cases(&mut r, c, BF16_ATTENTION, true))
        .collect();
    crate::harness::check_with(test, &cases, &mut gpu);
    let gpt2 = gpt2_length_config();
    crate::harness::check_with(
        &format!("{test}_gpt2"),
        &attention_cases(&mut r, &gpt2, BF16_ATTENTION, true),
        &mut gpu,
    );
    check_storage("attention_bf16_storage_ws_bwd", &mut gpu);
}

/// The warp-specialized kernels for head_dim 128 (the `ws` forward and backward, set on the
/// test's backend): GQA ratios 1, 4 and 6, causal and not, sequences no multiple of a tile
/// (128 queries or keys an item, 64-row backward slots), kv ahead of q, unsorted positions, CP
/// segments, more work items than SMs (a persistent CTA's rings, and the backward's single K/V
/// buffer, wrapping across items), against the CPU under BF16_ATTENTION, then one GQA 6:1 causal
/// sequence of 8192 (`attention_bf16_ws_d128_long`) under BF16_ATTENTION_LONG.
#[cfg(feature = "cuda")]
#[test]
fn attention_bf16_ws_d128() {
    let Some(mut gpu) = crate::harness::hopper_variant(Precision::Bf16, AttentionFwdKernel::Ws)
    else {
        return;
    };
    gpu.set_kernel_variant(AttentionBwdKernel::Ws);
    let test = "attention_bf16_ws_d128";
    let mut r = Rng::new(test);
    crate::harness::check_with(test, &ws_d128_cases(&mut r), &mut gpu);
    let long = AttConfig::new(1, 6, 1, 128, true, &[(0, 8192)], &[(0, 8192)]);
    crate::harness::check_with(
        &format!("{test}_long"),
        &attention_cases(&mut r, &long, BF16_ATTENTION_LONG, true),
        &mut gpu,
    );
}

/// `ws_d128_configs`' cases under BF16_ATTENTION, drawn from `r`.
#[cfg(feature = "cuda")]
fn ws_d128_cases(r: &mut Rng) -> Vec<Case> {
    ws_d128_configs()
        .iter()
        .flat_map(|c| attention_cases(r, c, BF16_ATTENTION, true))
        .collect()
}

/// `attention_bf16_ws_d128`'s cases: GQA 1:1, 4:1 and 6:1, causal and not, one query and key,
/// kv ahead of q, unsorted positions, CP segments, more work items than SMs both ways.
#[cfg(feature = "cuda")]
fn ws_d128_configs() -> Vec<AttConfig> {
    vec![
        // GQA 1:1.
        AttConfig::new(2, 4, 4, 128, true, &[(0, 200)], &[(0, 200)]),
        AttConfig::new(1, 3, 3, 128, false, &[(0, 77)], &[(0, 77)]),
        // GQA 4:1.
        AttConfig::new(1, 8, 2, 128, true, &[(0, 300)], &[(0, 300)]),
        AttConfig::new(2, 4, 1, 128, false, &[(0, 130)], &[(0, 130)]),
        // GQA 6:1.
        AttConfig::new(1, 12, 2, 128, true, &[(0, 333)], &[(0, 333)]),
        AttConfig::new(1, 6, 1, 128, false, &[(0, 190)], &[(0, 190)]),
        // One query row, one key.
        AttConfig::new(1, 1, 1, 128, true, &[(0, 1)], &[(0, 1)]),
        // kv ahead of q: the first queries see no key (o = 0, lse = −inf).
        AttConfig::new(1, 6, 1, 128, true, &[(0, 70)], &[(5, 70)]),
        // Positions not ascending: every tile masked, none skipped.
        AttConfig::new(
            1,
            4,
            1,
            128,
            true,
            &[(128, 128), (0, 128)],
            &[(128, 128), (0, 128)],
        ),
        // Context parallel: two q segments, kv the whole sequence.
        AttConfig::new(1, 6, 1, 128, true, &[(8, 56), (200, 72)], &[(0, 272)]),
        // More work items than SMs, both ways (forward: query tiles × heads; backward: key
        // tiles × kv heads), GQA 1:1 and 6:1.
        AttConfig::new(3, 60, 60, 128, false, &[(0, 200)], &[(0, 200)]),
        AttConfig::new(2, 120, 20, 128, true, &[(0, 256)], &[(0, 256)]),
    ]
}

/// The long case of `attention_bf16_ws_d128` (one GQA 6:1 causal sequence of 8192) through
/// the pre-Hopper-style `fa2` backward and the `wgmma` forward: the error the older kernels
/// reach at this length under bf16 P and dS, beside which the `ws` kernels' is judged.
#[cfg(feature = "cuda")]
#[test]
fn attention_bf16_fa2_d128_long() {
    let Some(mut gpu) = crate::harness::hopper_variant(Precision::Bf16, AttentionFwdKernel::Wgmma)
    else {
        return;
    };
    gpu.set_kernel_variant(AttentionBwdKernel::Fa2);
    let mut r = Rng::new("attention_bf16_ws_d128");
    let long = AttConfig::new(1, 6, 1, 128, true, &[(0, 8192)], &[(0, 8192)]);
    crate::harness::check_with(
        "attention_bf16_fa2_d128_long",
        &attention_cases(&mut r, &long, BF16_ATTENTION_LONG, true),
        &mut gpu,
    );
}

/// The wgmma forward's building blocks on their own, exactly (small integers): the swizzled
/// shared-memory tiles, both descriptor kinds (K-major Q and K, MN-major V), the accumulator
/// and A-register fragment layouts, for head_dim 64 and 128. A failure names the product.
#[test]
fn attention_wgmma_layouts() {
    #[cfg(not(feature = "cuda"))]
    println!("skipped: no CUDA device (this build has no `cuda` feature)");
    #[cfg(feature = "cuda")]
    {
        let Some(mut gpu) =
            crate::harness::hopper_variant(Precision::Bf16, AttentionFwdKernel::Wgmma)
        else {
            return;
        };
        let mut wrong = Vec::new();
        for d in [64, 128] {
            let lines = gpu.attention_wgmma_layout_check(d).unwrap();
            println!(
                "attention_wgmma_layouts d{d}: {} wrong products",
                lines.len()
            );
            wrong.extend(lines);
        }
        assert!(
            wrong.is_empty(),
            "wgmma layouts wrong:\n{}",
            wrong.join("\n")
        );
    }
}

/// The Hopper forwards (`ws`, the default, and `wgmma`) against the CPU on the tensor-core
/// shapes and more, more heads than SMs (the persistent `ws` CTAs take several work items),
/// 3-warpgroup d128 CTAs with warpgroups wholly past seq_q, GQA, CP segments, kv ahead of q,
/// unsorted positions, a partial key tile, and a GPT-2-length causal sequence. Forward
/// tolerance of `BF16_ATTENTION`; the backward runs in `attention_bf16` and its siblings.
#[test]
fn attention_bf16_wgmma() {
    #[cfg(not(feature = "cuda"))]
    println!("skipped: no CUDA device (this build has no `cuda` feature)");
    #[cfg(feature = "cuda")]
    {
        for variant in [AttentionFwdKernel::Ws, AttentionFwdKernel::Wgmma] {
            wgmma_forward_cases(variant);
        }
    }
}

/// attention_bf16_wgmma's cases on the Hopper forward `variant` (the warp-specialized `ws`,
/// for head_dim 64 and 128, or `wgmma` for both).
#[cfg(feature = "cuda")]
fn wgmma_forward_cases(kernel: AttentionFwdKernel) {
    let Some(mut gpu) = crate::harness::hopper_variant(Precision::Bf16, kernel) else {
        return;
    };
    let variant = kernel.name();
    let mut r = Rng::new("attention_bf16_wgmma");
    let mut configs = tc_configs();
    configs.extend([
        // d128: 3 warpgroups of 64 rows; the second CTA holds 8 rows (2 warpgroups idle).
        AttConfig::new(1, 2, 2, 128, true, &[(0, 200)], &[(0, 200)]),
        AttConfig::new(2, 2, 1, 128, false, &[(0, 77)], &[(0, 77)]),
        AttConfig::new(1, 2, 1, 128, true, &[(0, 70)], &[(5, 70)]),
        AttConfig::new(
            1,
            2,
            2,
            128,
            true,
            &[(64, 64), (0, 64)],
            &[(64, 64), (0, 64)],
        ),
        // One query row, one key.
        AttConfig::new(1, 1, 1, 64, true, &[(0, 1)], &[(0, 1)]),
        // CP with d64: q segments inside one tile and across tiles.
        AttConfig::new(2, 4, 2, 64, true, &[(8, 56), (200, 72)], &[(0, 272)]),
        // GPT-2's sequence length and head dim, causal: many skipped and diagonal tiles.
        AttConfig::new(1, 2, 2, 64, true, &[(0, 1024)], &[(0, 1024)]),
    ]);
    configs.extend(many_items_configs());
    // Forward cases only (every other one).
    let cases: Vec<Case> = configs
        .iter()
        .flat_map(|c| attention_cases(&mut r, c, BF16_ATTENTION, true))
        .step_by(2)
        .collect();
    crate::harness::check_with(&format!("attention_bf16_{variant}"), &cases, &mut gpu);
}

/// The `fa2` (mma.sync) kernels both ways, which every GPU but a Hopper runs by default: on a
/// Hopper they run only where a test asks for them, so this one does, on attention_bf16's and
/// attention_bf16_storage's cases and a GPT-2-length sequence.
#[test]
fn attention_bf16_mma_sync() {
    #[cfg(not(feature = "cuda"))]
    println!("skipped: no CUDA device (this build has no `cuda` feature)");
    #[cfg(feature = "cuda")]
    {
        let Some(mut gpu) = crate::harness::cuda_backend(Precision::Bf16) else {
            return;
        };
        gpu.set_kernel_variant(AttentionFwdKernel::Fa2);
        gpu.set_kernel_variant(AttentionBwdKernel::Fa2);
        let mut r = Rng::new("attention_bf16_mma_sync");
        let mut configs = tc_configs();
        configs.push(AttConfig::new(
            1,
            4,
            2,
            64,
            true,
            &[(0, 1024)],
            &[(0, 1024)],
        ));
        let cases: Vec<Case> = configs
            .iter()
            .flat_map(|c| attention_cases(&mut r, c, BF16_ATTENTION, true))
            .collect();
        crate::harness::check_with("attention_bf16_mma_sync", &cases, &mut gpu);
        check_storage("attention_bf16_storage_mma_sync", &mut gpu);
    }
}

/// `c`'s ops with q, k, v packed into one qkv (and dq, dk, dv into one dqkv).
#[cfg(feature = "cuda")]
fn packed_ops(c: &AttConfig) -> (Op, Op) {
    let (mut fwd, mut bwd) = attention_ops(c);
    for op in [&mut fwd, &mut bwd] {
        if let Op::Attention(AttentionAttrs { packed, .. })
        | Op::AttentionBwd(AttentionAttrs { packed, .. }) = op
        {
            *packed = true;
        }
    }
    (fwd, bwd)
}

/// Rows of q, k, v (`widths` elements each) interleaved into one packed buffer, each row q's
/// heads, then k's, then v's (what one fused projection writes).
#[cfg(feature = "cuda")]
fn pack(parts: [&[f32]; 3], widths: [usize; 3]) -> Vec<f32> {
    let rows = parts[0].len() / widths[0];
    let mut out = Vec::with_capacity(rows * widths.iter().sum::<usize>());
    for r in 0..rows {
        for (part, &w) in parts.iter().zip(&widths) {
            out.extend_from_slice(&part[r * w..(r + 1) * w]);
        }
    }
    out
}

/// `pack` undone: the three column ranges of every row, each gathered into its own tensor.
#[cfg(feature = "cuda")]
fn unpack(packed: &[f32], widths: [usize; 3]) -> [Vec<f32>; 3] {
    let mut out = [Vec::new(), Vec::new(), Vec::new()];
    for row in packed.chunks(widths.iter().sum()) {
        let mut at = 0;
        for (part, &w) in out.iter_mut().zip(&widths) {
            part.extend_from_slice(&row[at..at + w]);
            at += w;
        }
    }
    out
}

/// The shapes packed attention is checked on: head dims 64 and 128, GQA (128: ratios 1, 4 and
/// 6), batch > 1, sequences that are no multiple of any tile, unsorted positions (every tile
/// masked), one causal GPT-2-length sequence; head dims 32 and 16 for the exact kernels of a
/// bf16 run.
#[cfg(feature = "cuda")]
fn packed_configs() -> Vec<AttConfig> {
    vec![
        AttConfig::new(2, 4, 2, 64, true, &[(0, 200)], &[(0, 200)]),
        AttConfig::new(3, 2, 2, 64, false, &[(0, 77)], &[(0, 77)]),
        AttConfig::new(2, 4, 1, 128, true, &[(0, 130)], &[(0, 130)]),
        AttConfig::new(1, 3, 3, 128, false, &[(0, 45)], &[(0, 45)]),
        // GQA 6:1 at head dim 128.
        AttConfig::new(1, 12, 2, 128, true, &[(0, 190)], &[(0, 190)]),
        AttConfig::new(
            2,
            2,
            1,
            64,
            true,
            &[(64, 64), (0, 64)],
            &[(64, 64), (0, 64)],
        ),
        AttConfig::new(2, 2, 2, 64, true, &[(0, 1024)], &[(0, 1024)]),
        AttConfig::new(2, 4, 2, 32, true, &[(0, 45)], &[(0, 45)]),
        AttConfig::new(1, 2, 1, 16, false, &[(0, 33)], &[(0, 33)]),
    ]
}

/// Packed q/k/v (`packed: true`) against the unpacked op on the same GPU backend `gpu`, every
/// float buffer stored `dtype` (lse f32): o, lse, dk and dv must be bit-identical (the same
/// kernels read the same values through other row strides), dq within `dq_tol` (the
/// tensor-core backward adds it with atomics in no fixed order; exact kernels give 0 error),
/// and so dk and dv where the `ws` backward (`ws_bwd`) adds them per query head.
/// dqkv starts from random values, so an element the backward leaves unwritten shows. Returns
/// one line per mismatch.
#[cfg(feature = "cuda")]
fn packed_vs_unpacked(
    test: &str,
    gpu: &mut dyn Backend,
    dtype: DType,
    (dq_tol, ws_bwd): (f32, bool),
) -> Vec<String> {
    let mut r = Rng::new(test);
    let f32t = DType::F32;
    let mut failures = Vec::new();
    for c in &packed_configs() {
        let seq: u32 = c.q_positions.iter().map(|s| s.len).sum();
        let rows = seq as usize * c.batch as usize;
        let (qw, kw) = (
            (c.heads * c.head_dim) as usize,
            (c.kv_heads * c.head_dim) as usize,
        );
        let widths = [qw, kw, kw];
        let lse_len = (c.batch * c.heads) as usize * seq as usize;
        let name = format!(
            "{test} b{} h{} kv{} d{} causal={} q{:?} {dtype:?}",
            c.batch, c.heads, c.kv_heads, c.head_dim, c.causal, c.q_positions
        );
        let (fwd, bwd) = attention_ops(c);
        let (pfwd, pbwd) = packed_ops(c);
        // bf16 values even in f32 buffers (the tensor cores' copies are exact).
        let mut input = |n: usize, scale: f32| -> Vec<f32> {
            r.vec(n, scale).into_iter().map(round_bf16).collect()
        };
        let (q, k, v, dout) = (
            input(rows * qw, 2.0),
            input(rows * kw, 2.0),
            input(rows * kw, 1.0),
            input(rows * qw, 1.0),
        );
        let (o0, lse0) = (input(rows * qw, 1.0), input(lse_len, 1.0));
        let grads0 = [
            input(rows * qw, 1.0),
            input(rows * kw, 1.0),
            input(rows * kw, 1.0),
        ];
        let qkv = pack([&q, &k, &v], widths);
        let dqkv0 = pack([&grads0[0], &grads0[1], &grads0[2]], widths);
        let fwd_out = [(o0, dtype), (lse0, f32t)];
        let want = run_typed(
            gpu,
            &fwd,
            &[(q.clone(), dtype), (k.clone(), dtype), (v.clone(), dtype)],
            &fwd_out,
        );
        let got = run_typed(gpu, &pfwd, &[(qkv.clone(), dtype)], &fwd_out);
        let saved = [(want[0].clone(), dtype), (want[1].clone(), f32t)];
        let mut bwd_in = vec![(dout.clone(), dtype), (q, dtype), (k, dtype), (v, dtype)];
        bwd_in.extend(saved.iter().cloned());
        let bwd_out: Vec<Typed> = grads0.iter().map(|g| (g.clone(), dtype)).collect();
        let want_b = run_typed(gpu, &bwd, &bwd_in, &bwd_out);
        let mut pbwd_in = vec![(dout, dtype), (qkv, dtype)];
        pbwd_in.extend(saved.iter().cloned());
        let got_b = run_typed(gpu, &pbwd, &pbwd_in, &[(dqkv0, dtype)]);
        let [dq, dk, dv] = unpack(&got_b[0], widths);
        // The `ws` backward at head dim 128 under GQA adds each query head's dK and dV into
        // f32 accumulators, in whatever order the heads' items finish: dQ's tolerance.
        let per_head = ws_bwd && c.head_dim == 128 && c.kv_heads < c.heads;
        let dkv_tol = if per_head { dq_tol } else { 0.0 };
        let outputs = [
            ("o", &got[0], &want[0], 0.0),
            ("lse", &got[1], &want[1], 0.0),
            ("dq", &dq, &want_b[0], dq_tol),
            ("dk", &dk, &want_b[1], dkv_tol),
            ("dv", &dv, &want_b[2], dkv_tol),
        ];
        for (what, g, w, tol) in outputs {
            let differ = g
                .iter()
                .zip(w.iter())
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            let (err, i) = worst_error(g, w);
            println!(
                "{name} {what}: {differ} of {} values differ from unpacked, worst relative \
                 error {err:.3e} at {i}, tol {tol:.0e}",
                w.len()
            );
            if g.len() != w.len() || err.is_nan() || err > tol || (tol == 0.0 && differ > 0) {
                failures.push(format!(
                    "{name} {what}: {differ} values differ, worst error {err:.3e} at {i} \
                     (packed {} unpacked {}), tol {tol:.0e}",
                    g[i], w[i]
                ));
            }
        }
    }
    failures
}

/// Packed q/k/v on every CUDA kernel path against the unpacked op on the same GPU: the `ws`
/// forward and backward and the `wgmma` forward (Hopper only) and `fa2`'s forward and backward,
/// each on bf16 buffers and on f32 ones (copied to bf16 whole; the backward then accumulates dQ
/// in dqkv's own q columns), head dims 64 and 128 (and 32 / 16 on the exact kernels of a bf16
/// run); and the exact fp32 kernels of an fp32 run on f32 buffers.
#[test]
fn attention_packed() {
    #[cfg(not(feature = "cuda"))]
    println!("skipped: no CUDA device (this build has no `cuda` feature)");
    #[cfg(feature = "cuda")]
    {
        let mut failures = Vec::new();
        use AttentionBwdKernel as Bwd;
        use AttentionFwdKernel as Fwd;
        for (fwd, bwd) in [
            (Fwd::Ws, Bwd::Ws),
            (Fwd::Wgmma, Bwd::Ws),
            (Fwd::Fa2, Bwd::Fa2),
        ] {
            let Some(mut gpu) = crate::harness::cuda_backend(Precision::Bf16) else {
                return;
            };
            let name = fwd.name();
            if fwd != Fwd::Fa2 && !gpu.is_hopper() {
                println!("skipped: attention_packed with {name} runs on Hopper GPUs only");
                continue;
            }
            gpu.set_kernel_variant(fwd);
            gpu.set_kernel_variant(bwd);
            let test = format!("attention_packed_{name}");
            let ws_bwd = bwd == Bwd::Ws;
            // bf16 dq: the atomics' order can move a value across a bf16 rounding boundary.
            let bf16_tol = (BF16_STORED_EXACT, ws_bwd);
            failures.extend(packed_vs_unpacked(&test, &mut gpu, DType::Bf16, bf16_tol));
            failures.extend(packed_vs_unpacked(
                &test,
                &mut gpu,
                DType::F32,
                (1e-5, ws_bwd),
            ));
        }
        if let Some(mut gpu) = crate::harness::cuda_backend(Precision::Fp32) {
            failures.extend(packed_vs_unpacked(
                "attention_packed_fp32",
                &mut gpu,
                DType::F32,
                (0.0, false),
            ));
        }
        assert!(
            failures.is_empty(),
            "packed attention differs from unpacked:\n{}",
            failures.join("\n")
        );
    }
}

/// A NaN in one query row makes that row's output, and the gradients it reaches, non-finite on
/// every attention kernel family (fp32 exact, bf16 tensor cores, and on Hopper the
/// warp-specialized ones), as on the CPU: a NaN must reach the non-finite check, never be read
/// as a fully masked row (whose output is zero).
#[test]
fn a_nan_in_a_query_row_makes_its_outputs_non_finite() {
    for precision in [Precision::Fp32, Precision::Bf16] {
        let Some(mut gpu) = gpu_with(precision) else {
            return;
        };
        for head_dim in [64u64, 128] {
            let c = AttConfig::new(1, 2, 1, head_dim, true, &[(0, 128)], &[(0, 128)]);
            let (fwd, bwd) = attention_ops(&c);
            let d = head_dim as usize;
            let (q_len, kv_len, rows) = (128 * 2 * d, 128 * d, 2 * 128);
            let mut r = Rng::new("a_nan_in_a_query_row_makes_its_outputs_non_finite");
            let mut q = r.vec(q_len, 1.0);
            // Query row 5 of head 1 ([batch, seq, heads, head_dim] layout).
            let nan_row = 5 * 2 + 1;
            q[nan_row * d + 7] = f32::NAN;
            let inputs = [q, r.vec(kv_len, 1.0), r.vec(kv_len, 1.0)];
            let ids: Vec<BufferId> = (0..11).map(BufferId).collect();
            let lens = [
                q_len, kv_len, kv_len, q_len, rows, q_len, q_len, kv_len, kv_len,
            ];
            for (id, len) in ids.iter().zip(lens) {
                gpu.alloc(*id, &[len as u64], DType::F32).unwrap();
            }
            for (id, v) in ids.iter().zip(&inputs) {
                gpu.write_f32(*id, v).unwrap();
            }
            gpu.write_f32(ids[5], &r.vec(q_len, 1.0)).unwrap();
            gpu.compute(&fwd, &ids[..3], &ids[3..5], &SCALARS).unwrap();
            let out = gpu.read_f32(ids[3]).unwrap();
            let what = format!("{precision:?} head_dim {head_dim}");
            for (row, values) in out.chunks(d).enumerate() {
                let finite = values.iter().all(|v| v.is_finite());
                assert_eq!(
                    finite,
                    row != nan_row,
                    "{what}: output row {row} finite = {finite}"
                );
            }
            // dO, q, k, v, o, lse -> dq, dk, dv.
            let bwd_in = [ids[5], ids[0], ids[1], ids[2], ids[3], ids[4]];
            gpu.compute(&bwd, &bwd_in, &ids[6..9], &SCALARS).unwrap();
            for (name, id) in [("dQ", ids[6]), ("dK", ids[7]), ("dV", ids[8])] {
                let g = gpu.read_f32(id).unwrap();
                assert!(
                    g.iter().any(|v| !v.is_finite()),
                    "{what}: {name} is finite although a query row held a NaN"
                );
            }
            for id in &ids[..9] {
                gpu.free(*id).unwrap();
            }
        }
    }
}
