//! Attention, forward and backward: the fp32 kernels on small and GQA shapes, context-parallel
//! segments and kv ahead of q, and in a bf16 run the tensor-core kernels (head_dim 64 or 128)
//! within `BF16_ATTENTION`, while other head dims stay exact fp32.
use crate::harness::{
    check, check_on, seg, Case, Data, Rng, BF16_ATTENTION, BF16_ROUNDED, REDUCTION,
};
use parc_compiler::ir::op::{Op, Segment};
use parc_compiler::spec::Precision;
use parc_runtime::cpu::CpuBackend;

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

/// Forward and backward cases of `c`, held to `tol` (forward, backward). With `bf16_inputs`, q, k, v and dO are
/// bf16 values (as a bf16 run's tensor cores read them), so the comparison measures the
/// kernels' own rounding (P and dS in bf16) rather than the inputs'.
fn attention_cases(r: &mut Rng, c: &AttConfig, tol: (f32, f32), bf16_inputs: bool) -> Vec<Case> {
    let seq_q: u32 = c.q_positions.iter().map(|s| s.len).sum();
    let seq_kv: u32 = c.kv_positions.iter().map(|s| s.len).sum();
    let q_len = (u64::from(seq_q) * c.batch * c.heads * c.head_dim) as usize;
    let kv_len = (u64::from(seq_kv) * c.batch * c.kv_heads * c.head_dim) as usize;
    let lse_len = (c.batch * c.heads * u64::from(seq_q)) as usize;
    let scale = 1.0 / (c.head_dim as f64).sqrt();
    let fwd = Op::Attention {
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        causal: c.causal,
        scale,
        q_positions: c.q_positions.clone(),
        kv_positions: c.kv_positions.clone(),
    };
    let bwd = Op::AttentionBwd {
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        causal: c.causal,
        scale,
        q_positions: c.q_positions.clone(),
        kv_positions: c.kv_positions.clone(),
    };
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
#[test]
fn attention_bf16() {
    let mut r = Rng::new("attention_bf16");
    let tc = [
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
    ];
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
    let exact = AttConfig::new(2, 4, 2, 32, true, &[(0, 40)], &[(0, 40)]);
    check_on(
        "attention_bf16_other_head_dims_stay_fp32",
        &attention_cases(&mut r, &exact, (REDUCTION, REDUCTION), false),
        Precision::Bf16,
    );
}
