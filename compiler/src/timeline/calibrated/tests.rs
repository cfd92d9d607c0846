use super::*;
use crate::driver::{compile, CompileOptions, Stage};
use crate::timeline::profile::{AttentionPoint, GemmPoint, MemoryPoint};
use crate::timeline::{simulate, simulate_with};

const TINY: &str = include_str!("../../../../examples/tiny.par");

fn tiny() -> (Spec, Plan) {
    let c = compile(
        "tiny.par",
        TINY.to_string(),
        &[],
        &CompileOptions::through(Stage::Lower),
    );
    match (c.spec, c.plan) {
        (Some(spec), Some(plan)) => (spec, plan),
        _ => panic!("tiny.par lowers"),
    }
}

/// A profile whose GEMMs and attention run at `flops`/s and memory-bound ops at `bytes`/s at
/// every measured size.
fn uniform(flops: f64, bytes: f64) -> Profile {
    let mut gemm = Vec::new();
    for layout in [GemmLayout::Fwd, GemmLayout::BwdData, GemmLayout::BwdWeight] {
        for (m, n, k) in [
            (64, 64, 64),
            (1024, 64, 256),
            (64, 1024, 1024),
            (1024, 1024, 1024),
        ] {
            let seconds = 2.0 * (m * n * k) as f64 / flops;
            let dtype = "f32".to_string();
            gemm.push(GemmPoint {
                layout,
                m,
                n,
                k,
                dtype,
                seconds,
            });
        }
    }
    let mut attention = Vec::new();
    for pass in [Pass::Fwd, Pass::Bwd] {
        for seq in [32, 256] {
            let mut p = AttentionPoint {
                pass,
                batch_heads: 8,
                group: 1,
                seq,
                head_dim: 16,
                causal: true,
                packed: true,
                seconds: 1.0,
            };
            p.seconds = p.flops() / flops;
            attention.push(p);
        }
    }
    let kinds = [
        MemoryKind::Elementwise,
        MemoryKind::Norm,
        MemoryKind::CrossEntropy,
        MemoryKind::Optimizer,
        MemoryKind::Embedding,
    ];
    let memory = (kinds.iter())
        .flat_map(|&kind| {
            [1e3, 1e7].map(|b| MemoryPoint {
                kind,
                bytes: b,
                seconds: b / bytes,
            })
        })
        .collect();
    Profile {
        launch_overhead_s: 0.0,
        gemm,
        attention,
        memory,
        ..crate::timeline::profile::tests::sample()
    }
}

fn step(spec: &Spec, plan: &Plan, profile: Profile, scale: bool) -> f64 {
    let calibration = Calibration { profile, scale };
    simulate_with(plan, spec, &ProfileCosts::new(&calibration, spec)).step_seconds
}

fn close(a: f64, b: f64) -> bool {
    (a / b - 1.0).abs() < 1e-9
}

#[test]
fn halving_every_measured_rate_doubles_the_step() {
    let (spec, plan) = tiny();
    let fast = step(&spec, &plan, uniform(4e10, 8e9), false);
    let slow = step(&spec, &plan, uniform(2e10, 4e9), false);
    assert!(fast > 0.0 && close(slow, 2.0 * fast), "{fast} {slow}");
    // Not the roofline's step: the profile's rates are below the spec's peak numbers.
    assert!(fast > simulate(&plan, &spec).step_seconds);
}

#[test]
fn slower_gemms_slow_the_step_by_the_time_the_gemms_take() {
    let (spec, plan) = tiny();
    let base = step(&spec, &plan, uniform(4e10, 8e9), false);
    let mut slow_gemms = uniform(4e10, 8e9);
    for g in &mut slow_gemms.gemm {
        g.seconds *= 3.0;
    }
    let slowed = step(&spec, &plan, slow_gemms, false);
    // The step's GEMMs at 4e10 FLOP/s, three times over.
    let gemm_seconds: f64 = (plan.programs.iter().flat_map(|p| &p.instrs))
        .filter_map(|i| i.as_compute())
        .filter(|c| c.op.opcode().family() == Family::Matmul)
        .map(|c| {
            let rows = c.op.signature().rows_from_inputs(|i| {
                c.inputs
                    .get(i)
                    .and_then(|b| plan.programs[0].buffer(*b))
                    .map_or(0, Buffer::numel)
            });
            c.op.flops(rows.unwrap_or(0) as f64, FlopCount::Model) / 4e10
        })
        .sum();
    assert!(
        close(slowed - base, 2.0 * gemm_seconds),
        "{base} {slowed} {gemm_seconds}"
    );
}

#[test]
fn missing_tables_fall_back_to_the_roofline_and_are_named() {
    let (spec, plan) = tiny();
    let mut only_gemms = uniform(4e10, 8e9);
    only_gemms.attention.clear();
    only_gemms.memory.retain(|m| m.kind != MemoryKind::Norm);
    let calibration = Calibration {
        profile: only_gemms,
        scale: false,
    };
    let costs = ProfileCosts::new(&calibration, &spec);
    assert_eq!(
        costs.roofline_kinds(&plan),
        ["attention_bwd", "attention_fwd", "norm"]
    );
    let all = Calibration {
        profile: uniform(4e10, 8e9),
        scale: false,
    };
    assert!(ProfileCosts::new(&all, &spec)
        .roofline_kinds(&plan)
        .is_empty());
}

#[test]
fn the_launch_overhead_is_every_op_s_floor() {
    let (spec, plan) = tiny();
    let mut profile = uniform(1e15, 1e15);
    profile.launch_overhead_s = 1e-3;
    let compute_ops = plan.programs[0]
        .instrs
        .iter()
        .filter(|i| i.as_compute().is_some())
        .count();
    let seconds = step(&spec, &plan, profile, false);
    assert!(
        close(seconds, compute_ops as f64 * 1e-3),
        "{seconds} for {compute_ops} ops"
    );
}

#[test]
fn scaling_multiplies_rates_by_the_peak_ratio() {
    let (spec, plan) = tiny();
    let mut h200 = uniform(4e10, 8e9);
    h200.gpu = "h200".into();
    // Ten times the cpu's peak numbers: scaled to the cpu, every op takes ten times as long.
    h200.peak_flops = 10.0 * spec.cluster.gpu.peak_flops_fp32;
    h200.memory_bandwidth = 10.0 * spec.cluster.gpu.memory_bandwidth;
    let unscaled = step(&spec, &plan, h200.clone(), false);
    let scaled = step(&spec, &plan, h200, true);
    assert!(close(scaled, 10.0 * unscaled), "{unscaled} {scaled}");
}

#[test]
fn a_gemm_beyond_the_grid_runs_at_the_rate_of_its_edge() {
    let (spec, _) = tiny();
    let mut profile = uniform(4e10, 8e9);
    // The largest GEMM measured twice as fast as the rest.
    for g in profile
        .gemm
        .iter_mut()
        .filter(|g| g.m == 1024 && g.n == 1024)
    {
        g.seconds /= 2.0;
    }
    let calibration = Calibration {
        profile,
        scale: false,
    };
    let costs = ProfileCosts::new(&calibration, &spec);
    let huge = [1 << 16, 1 << 14, 1 << 14];
    let seconds = costs.gemm(GemmLayout::Fwd, huge, false).unwrap_or(0.0);
    let flops = 2.0 * huge.iter().map(|&x| x as f64).product::<f64>();
    assert!(close(flops / seconds, 8e10), "{}", flops / seconds);
}
