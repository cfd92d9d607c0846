use super::*;
use crate::driver::{compile, CompileOptions, Stage};
use crate::timeline::fused::Role;
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
                accumulate: false,
                bias: false,
                act: false,
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
                op: None,
                cols: None,
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

/// A profile from an older calibrate (no GEMM epilogue points, no memory op measured on its
/// own) is named as coarser than today's; FP8 GEMMs without points of their scaling are named
/// among the work priced by the GPU's peak numbers.
#[test]
fn a_profile_coarser_than_calibrate_measures_now_is_named() {
    let (spec, plan) = tiny();
    let old = uniform(4e10, 8e9);
    let calibration = Calibration {
        profile: old.clone(),
        scale: false,
    };
    assert_eq!(
        ProfileCosts::new(&calibration, &spec).coarse_tables(&plan),
        [
            "GEMM epilogues (as plain GEMMs)",
            "memory-bound ops (by their kind's rate, not their own)"
        ]
    );
    let mut current = old;
    let plain = current.gemm[0].clone();
    current.gemm.push(GemmPoint {
        bias: true,
        ..plain
    });
    let point = current.memory[0].clone();
    current.memory.push(MemoryPoint {
        op: Some("add".into()),
        ..point
    });
    let calibration = Calibration {
        profile: current,
        scale: false,
    };
    assert!(ProfileCosts::new(&calibration, &spec)
        .coarse_tables(&plan)
        .is_empty());
    let text = include_str!("../../../../examples/tiny-llama.par").to_string();
    let overrides = [
        "train.precision=bf16",
        "train.fp8=tensorwise",
        "train.fp8.fp8=[MLP]",
    ]
    .map(|s| crate::overrides::parse_override(s).unwrap());
    let fp8 = compile(
        "tiny-llama.par",
        text,
        &overrides,
        &CompileOptions::through(Stage::Lower),
    );
    let (spec, plan) = (fp8.spec.expect("checks"), fp8.plan.expect("lowers"));
    let kinds = ProfileCosts::new(&bf16_profile(None), &spec).roofline_kinds(&plan);
    assert!(
        kinds.contains(&"FP8 GEMMs (tensorwise)".to_string()),
        "{kinds:?}"
    );
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
    let seconds = costs
        .gemm(GemmLayout::Fwd, huge, GemmDtype::F32, GemmEpilogue::PLAIN)
        .unwrap_or(0.0);
    let flops = 2.0 * huge.iter().map(|&x| x as f64).product::<f64>();
    assert!(close(flops / seconds, 8e10), "{}", flops / seconds);
}

/// tiny-llama in bf16 with blockwise FP8, on the `cpu` gpu (whose FP8 peak is its bf16 one,
/// so the roofline never puts a layer in FP8), compiled with `options`.
fn tiny_llama_fp8_with(options: &CompileOptions) -> crate::driver::Compiled {
    let text = include_str!("../../../../examples/tiny-llama.par").to_string();
    let overrides = [
        "train.precision=bf16",
        "train.fp8=blockwise { block_size: 16 }",
    ]
    .map(|s| crate::overrides::parse_override(s).unwrap());
    compile("tiny-llama.par", text, &overrides, options)
}

/// [`tiny_llama_fp8_with`]'s checked spec.
fn tiny_llama_fp8() -> Spec {
    let c = tiny_llama_fp8_with(&CompileOptions::through(Stage::Check));
    c.spec.expect("tiny-llama.par checks")
}

/// `uniform`'s rates for bf16 GEMMs, and FP8 blockwise points `fp8_speedup` times faster
/// (none when `None`).
fn bf16_profile(fp8_speedup: Option<f64>) -> Calibration {
    bf16_profile_per_layout(fp8_speedup.map(crate::fp8::PerLayout::splat))
}

/// [`bf16_profile`] with each layout's FP8 points its own `fp8_speedup` faster than bf16.
fn bf16_profile_per_layout(fp8_speedup: Option<crate::fp8::PerLayout<f64>>) -> Calibration {
    let mut profile = uniform(1e12, 1e11);
    profile.precision = "bf16".into();
    for g in &mut profile.gemm {
        g.dtype = GemmDtype::Bf16.name();
    }
    if let Some(speedup) = fp8_speedup {
        let scaling = Fp8Scaling::Blockwise { block: 128 };
        let fp8: Vec<GemmPoint> = (profile.gemm.iter())
            .map(|g| GemmPoint {
                dtype: GemmDtype::Fp8(scaling).name(),
                seconds: g.seconds / speedup[g.layout],
                ..g.clone()
            })
            .collect();
        profile.gemm.extend(fp8);
    }
    Calibration {
        profile,
        scale: false,
    }
}

/// Each linear layer's name, which layouts run FP8 and (cost-decided ones) what priced them.
type Chosen = (String, crate::fp8::PerLayout<bool>, Option<Pricing>);

fn chosen(spec: &Spec, calibration: &Calibration) -> Vec<Chosen> {
    (crate::fp8::choices(spec, Some(calibration)).into_iter())
        .map(|c| {
            let priced_by = match c.reason {
                crate::fp8::Reason::Cost(p) => Some(p.priced_by),
                _ => None,
            };
            (c.name, c.fp8, priced_by)
        })
        .collect()
}

#[test]
fn the_fp8_choice_follows_the_profiles_measured_fp8_gemms() {
    use crate::fp8::PerLayout;
    let spec = tiny_llama_fp8();
    let all = PerLayout::splat(true);
    let none = PerLayout::splat(false);
    // FP8 measured 4× faster than bf16: every GEMM of every layer but the LM head pays.
    let fast = chosen(&spec, &bf16_profile(Some(4.0)));
    assert!(fast.iter().any(|c| c.1 == all), "{fast:?}");
    for (name, fp8, priced_by) in &fast {
        match priced_by {
            Some(p) => assert!(*fp8 == all && *p == Pricing::Measured, "{name}: {fast:?}"),
            None => assert!(*fp8 == none, "{name} is the head: {fast:?}"),
        }
    }
    // Measured slower: none does.
    let slow = chosen(&spec, &bf16_profile(Some(0.5)));
    assert!(slow.iter().all(|c| c.1 == none), "{slow:?}");
    // No FP8 points: bf16 measured, FP8 at the cpu's peak ratio (1) plus quantization: none.
    let unmeasured = chosen(&spec, &bf16_profile(None));
    assert!(unmeasured.iter().all(|c| c.1 == none), "{unmeasured:?}");
    assert!(
        unmeasured
            .iter()
            .any(|c| c.2 == Some(Pricing::MeasuredBf16)),
        "{unmeasured:?}"
    );
}

/// The H100 measurement the per-GEMM choice was built for: FP8 forward and data-gradient GEMMs
/// faster than bf16, the weight gradient (both operands quantized along the tokens) slower.
#[test]
fn each_layout_runs_fp8_where_its_measured_points_pay() {
    use crate::fp8::PerLayout;
    let speedup = PerLayout([2.0, 1.5, 0.9]);
    let calibration = bf16_profile_per_layout(Some(speedup));
    let spec = tiny_llama_fp8();
    let fwd_data = PerLayout([true, true, false]);
    let picked = chosen(&spec, &calibration);
    for (name, fp8, priced_by) in &picked {
        match priced_by {
            Some(p) => assert!(
                *fp8 == fwd_data && *p == Pricing::Measured,
                "{name}: {picked:?}"
            ),
            None => assert!(*fp8 == PerLayout::splat(false), "{name}: {picked:?}"),
        }
    }
    // The lowered plan, priced by the same profile, runs exactly those GEMMs in FP8.
    let options = CompileOptions {
        calibration: Some(std::sync::Arc::new(calibration)),
        ..CompileOptions::through(Stage::Lower)
    };
    let plan = tiny_llama_fp8_with(&options).plan.expect("lowers");
    let mut seen = PerLayout::splat((0, 0));
    for c in (plan.programs.iter())
        .flat_map(|p| &p.instrs)
        .filter_map(|i| i.as_compute())
    {
        let Some(layout) = GemmLayout::of(c.op) else {
            continue;
        };
        let (all, fp8) = &mut seen[layout];
        *all += 1;
        *fp8 += usize::from(c.op.fp8().is_some());
    }
    let [fwd, data, weight] = seen.0;
    // Every forward and data-gradient GEMM but the head's in FP8, no weight gradient.
    assert!(fwd.1 > 0 && fwd.1 < fwd.0, "{seen:?}");
    assert!(data.1 > 0 && data.1 < data.0, "{seen:?}");
    assert_eq!(weight.1, 0, "{seen:?}");
}

#[test]
fn an_fp8_gemm_op_is_priced_by_its_scalings_points_when_measured() {
    let spec = tiny_llama_fp8();
    let options = CompileOptions {
        calibration: Some(std::sync::Arc::new(bf16_profile(Some(4.0)))),
        ..CompileOptions::through(Stage::Lower)
    };
    let plan = tiny_llama_fp8_with(&options).plan.expect("lowers");
    let fp8_ops = (plan.programs.iter())
        .flat_map(|p| &p.instrs)
        .filter_map(|i| i.as_compute())
        .filter(|c| c.op.fp8().is_some())
        .count();
    assert!(fp8_ops > 0, "the measured profile puts layers in FP8");
    // Measured 4× faster FP8 GEMMs make the step faster than the same plan's bf16 pricing.
    let measured = step(&spec, &plan, bf16_profile(Some(4.0)).profile, false);
    let modelled = step(&spec, &plan, bf16_profile(None).profile, false);
    assert!(measured < modelled, "{measured} {modelled}");
}

#[test]
fn gemms_are_priced_by_the_points_of_their_epilogue_or_the_nearest_measured() {
    let (spec, _) = tiny();
    let mut profile = uniform(4e10, 8e9);
    let mnk = [1024, 1024, 1024];
    let bias = GemmEpilogue {
        bias: true,
        ..GemmEpilogue::PLAIN
    };
    let adding_bias = GemmEpilogue {
        accumulate: true,
        ..bias
    };
    let price = |profile: &Profile, epilogue| {
        let calibration = Calibration {
            profile: profile.clone(),
            scale: false,
        };
        let costs = ProfileCosts::new(&calibration, &spec);
        (costs.gemm(GemmLayout::BwdWeight, mnk, GemmDtype::F32, epilogue)).unwrap()
    };
    let plain = price(&profile, GemmEpilogue::PLAIN);
    // Without points of their own, every epilogue is priced as the plain GEMM.
    assert!(close(price(&profile, adding_bias), plain));
    let with_bias: Vec<GemmPoint> = (profile.gemm.iter())
        .filter(|g| g.layout == GemmLayout::BwdWeight)
        .map(|g| GemmPoint {
            bias: true,
            seconds: 1.5 * g.seconds,
            ..g.clone()
        })
        .collect();
    profile.gemm.extend(with_bias);
    assert!(close(price(&profile, bias), 1.5 * plain));
    // Accumulating with a bias, not measured: relaxed to accumulating alone (the bias dropped
    // first), not measured either, then to the plain GEMM's points.
    assert!(close(price(&profile, adding_bias), plain));
}

#[test]
fn memory_ops_take_their_own_points_and_interpolate_between_row_widths() {
    let (spec, _) = tiny();
    let mut profile = uniform(4e10, 8e9);
    // rms_norm measured at dims 1024 (1e9 B/s) and 4096 (4e9 B/s).
    for (cols, rate) in [(1024, 1e9), (4096, 4e9)] {
        profile.memory.extend([1e3, 1e7].map(|bytes| MemoryPoint {
            kind: MemoryKind::Norm,
            bytes,
            op: Some("rms_norm".into()),
            cols: Some(cols),
            seconds: bytes / rate,
        }));
    }
    let calibration = Calibration {
        profile,
        scale: false,
    };
    let costs = ProfileCosts::new(&calibration, &spec);
    let bytes = 1e5;
    let rms = |width| costs.memory(MemoryKind::Norm, Opcode::RmsNorm, Some(width), bytes);
    // Between the widths, linear in log-width: 2048 is halfway, 2.5e9 B/s.
    assert!(close(rms(2048).unwrap(), bytes / 2.5e9));
    // Outside them, the nearest width's rate.
    assert!(close(rms(512).unwrap(), bytes / 1e9));
    assert!(close(rms(8192).unwrap(), bytes / 4e9));
    // An op without points of its own: its kind's (the uniform 8e9 B/s, no widths).
    let layer = costs.memory(MemoryKind::Norm, Opcode::LayerNorm, Some(2048), bytes);
    assert!(close(layer.unwrap(), bytes / 8e9));
}

/// FP8 points that are a GEMM at one rate plus their two operands' quantization at the
/// profile's memory rate: between the grid's shapes an FP8 GEMM is priced as that GEMM plus its
/// own operands' quantization (interpolating the points whole, whose quantization shares
/// differ, is not), as a bf16 GEMM is priced by its rate.
#[test]
fn an_fp8_gemm_is_priced_as_its_gemm_plus_its_quantization() {
    let spec = tiny_llama_fp8();
    // Below the spec's GPU's peak (a point faster than the peak says nothing of its GEMM).
    let gemm_rate = 0.5 * spec.cluster.gpu.peak_flops;
    let bandwidth = 0.5 * spec.cluster.gpu.memory_bandwidth;
    let mut profile = uniform(0.25 * spec.cluster.gpu.peak_flops, bandwidth);
    profile.precision = "bf16".into();
    for g in &mut profile.gemm {
        g.dtype = GemmDtype::Bf16.name();
    }
    let fp8 = GemmDtype::Fp8(Fp8Scaling::Tensorwise);
    // An amax pass reading each bf16 operand, a pass reading it again and writing a byte.
    let quantize = |layout, mnk| crate::fp8::quantize_elements(layout, mnk) * 5.0 / bandwidth;
    let points: Vec<GemmPoint> = (profile.gemm.iter())
        .map(|g| GemmPoint {
            dtype: fp8.name(),
            seconds: g.flops() / gemm_rate + quantize(g.layout, [g.m, g.n, g.k]),
            ..g.clone()
        })
        .collect();
    profile.gemm.extend(points);
    let calibration = Calibration {
        profile,
        scale: false,
    };
    let costs = ProfileCosts::new(&calibration, &spec);
    for layout in GemmLayout::ALL {
        for [m, n, k] in [[512, 256, 512], [1024, 128, 1024], [128, 512, 256]] {
            let flops = 2.0 * (m * n * k) as f64;
            let expected = flops / gemm_rate + quantize(layout, [m, n, k]);
            let priced = costs
                .gemm(layout, [m, n, k], fp8, GemmEpilogue::PLAIN)
                .expect("priced");
            assert!(
                (priced / expected - 1.0).abs() < 0.02,
                "{layout:?} {m}x{n}x{k}: priced {priced:e} s, the GEMM and its quantization \
                 {expected:e} s"
            );
        }
    }
}

/// tiny-llama.par in bf16 with every attention and MLP projection in tensorwise FP8 with
/// `fields` (`scaling: delayed`, …), lowered: its spec and plan (also `ir::swiglu_runs`' tests).
pub(crate) fn tiny_llama_tensorwise(fields: &str) -> (Spec, Plan) {
    let text = include_str!("../../../../examples/tiny-llama.par").to_string();
    let overrides = [
        "train.precision=bf16".to_string(),
        format!("train.fp8=tensorwise {{ {fields} }}"),
        "train.fp8.fp8=[Attention, MLP]".to_string(),
    ]
    .map(|s| crate::overrides::parse_override(&s).unwrap());
    let options = CompileOptions::through(Stage::Lower);
    let c = compile("tiny-llama.par", text, &overrides, &options);
    (c.spec.expect("checks"), c.plan.expect("lowers"))
}

/// Delayed scaling makes no amax passes: its GEMMs are priced below current scaling's by
/// those passes (on measured FP8 points: exactly the passes' traffic at the profile's rate),
/// and its `Fp8AmaxRecord`s cost nothing, as the CUDA backend takes them in the GEMMs'
/// quantize passes; on the roofline too. (GEMMs that quantize their own operands: `quantize:
/// per_gemm`.)
#[test]
fn delayed_scaling_saves_the_amax_passes_and_its_records_ride_on_the_gemms() {
    let lowered =
        |scaling: &str| tiny_llama_tensorwise(&format!("scaling: {scaling}, quantize: per_gemm"));
    let (spec, current) = lowered("current");
    let (_, delayed) = lowered("delayed");
    // Tensorwise points at twice the GEMM rate of the bf16 ones plus their quantization (an
    // amax pass and a quantizing pass over each bf16 operand at the profile's 1e11 B/s, and
    // their six launches), and none (the roofline's FP8).
    let quantize =
        |layout, mnk| crate::fp8::quantize_elements(layout, mnk) * 5.0 / 1e11 + 6.0 * 4e-6;
    let mut measured = bf16_profile(None);
    let fp8: Vec<GemmPoint> = (measured.profile.gemm.iter())
        .map(|g| GemmPoint {
            dtype: GemmDtype::Fp8(Fp8Scaling::Tensorwise).name(),
            seconds: 0.5 * g.seconds + quantize(g.layout, [g.m, g.n, g.k]),
            ..g.clone()
        })
        .collect();
    measured.profile.gemm.extend(fp8);
    // The amax passes of the current plan's FP8 GEMMs at the measured points' rates: two bytes
    // an element at 1e11 B/s and a launch per operand.
    let amax_passes: f64 = (current.programs[0].computes())
        .filter_map(|(_, c)| {
            let layout = crate::fp8::GemmLayout::of(c.op)?;
            c.op.fp8()?;
            let rows = current.programs[0].buffer(c.inputs[0])?.shape[0];
            let (in_dim, out_dim) = c.op.gemm_dims()?;
            let elements = crate::fp8::quantize_elements(layout, [rows, out_dim, in_dim]);
            Some(elements * 2.0 / 1e11 + 2.0 * 4e-6)
        })
        .sum();
    for (mut calibration, measured_points) in [(measured, true), (bf16_profile(None), false)] {
        calibration.profile.launch_overhead_s = 4e-6;
        let costs = ProfileCosts::new(&calibration, &spec);
        let priced = |plan: &Plan, keep: &dyn Fn(&Op) -> bool| -> f64 {
            let program = &plan.programs[0];
            (program.instrs.iter())
                .filter(|i| i.op().is_some_and(keep))
                .map(|i| costs.compute(program, i))
                .sum()
        };
        let fp8_gemm = |op: &Op| op.fp8().is_some();
        let record = |op: &Op| matches!(op, Op::Fp8AmaxRecord(_));
        let (gemms, records) = (priced(&current, &fp8_gemm), priced(&delayed, &record));
        let delayed_gemms = priced(&delayed, &fp8_gemm);
        assert!(
            records == 0.0 && delayed_gemms < gemms,
            "{records} {delayed_gemms} {gemms}"
        );
        if measured_points {
            let saved = gemms - delayed_gemms;
            assert!(
                (saved / amax_passes - 1.0).abs() < 0.05,
                "delayed scaling saves {saved:e} s, the amax passes are {amax_passes:e} s"
            );
        }
    }
}

/// tiny.par's compute instructions, its AdamW updates and its sums of squares (program 0).
fn optimizer_counts(plan: &Plan) -> (usize, usize, usize) {
    let program = &plan.programs[0];
    let count = |f: &dyn Fn(&Op) -> bool| {
        program
            .instrs
            .iter()
            .filter_map(Instr::op)
            .filter(|op| f(op))
            .count()
    };
    (
        count(&|_| true),
        count(&|op| matches!(op, Op::AdamW { .. })),
        count(&|op| matches!(op, Op::SumSquares)),
    )
}

/// With every op at the launch floor, the step counts launches: on a backend that fuses (CUDA)
/// the N updates are one launch and the sums of squares another; on the CPU each is its own.
#[test]
fn a_run_of_updates_is_one_launch_where_the_backend_fuses_it() {
    let (spec, plan) = tiny();
    let (ops, updates, sums) = optimizer_counts(&plan);
    assert!(
        updates > 2 && sums > 2,
        "{updates} updates, {sums} sums of squares"
    );
    let mut profile = uniform(1e15, 1e15);
    profile.launch_overhead_s = 1e-3;
    assert_eq!(profile.backend, "cpu");
    let per_instruction = step(&spec, &plan, profile.clone(), false);
    assert!(
        close(per_instruction, ops as f64 * 1e-3),
        "{per_instruction}"
    );
    profile.backend = "cuda".into();
    let fused = step(&spec, &plan, profile, false);
    let launches = ops - updates - sums + 2;
    assert!(
        close(fused, launches as f64 * 1e-3),
        "{fused} for {launches} launches"
    );
}

/// A program of `sizes.len()` AdamW updates (buffer 0 the clip coefficient; tensor t's g,
/// param, m, v at 1 + 4t ..) of `sizes` elements, and its instructions.
fn updates(sizes: &[u64]) -> Program {
    let f32_buffer = |n: u64| Buffer {
        name: format!("b{n}"),
        shape: vec![n],
        dtype: DType::F32,
        kind: crate::ir::BufferKind::Activation,
    };
    let mut buffers = vec![f32_buffer(1)];
    let mut instrs = Vec::new();
    for (t, &n) in sizes.iter().enumerate() {
        let b = 1 + 4 * t as u32;
        buffers.extend((0..4).map(|_| f32_buffer(n)));
        let adam = Op::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        instrs.push(Instr::compute(adam, &[b, 0], &[b + 1, b + 2, b + 3]));
    }
    Program::new("updates", buffers, instrs)
}

/// A fused run is priced as one op of its members' summed bytes: by the profile's points of the
/// multi-tensor launch where it has them, else by the op's own points at that size (not each
/// member at its own size), never below one launch.
#[test]
fn a_fused_run_is_priced_by_its_summed_bytes() {
    let (spec, _) = tiny();
    // adam_w measured at 1e9 B/s for small ops, 1e10 for large.
    let mut profile = uniform(4e10, 8e9);
    profile.backend = "cuda".into();
    profile.launch_overhead_s = 1e-6;
    profile.memory.retain(|m| m.kind != MemoryKind::Optimizer);
    let point = |op: &str, bytes: f64, rate: f64| MemoryPoint {
        kind: MemoryKind::Optimizer,
        bytes,
        op: Some(op.into()),
        cols: None,
        seconds: bytes / rate,
    };
    profile
        .memory
        .extend([point("adam_w", 1e3, 1e9), point("adam_w", 1e7, 1e10)]);
    // 20 tensors of 1,000 elements; the cpu gpu counts f32 as 4 bytes: an update reads g and
    // coef and reads and writes param, m, v, 28,004 bytes, the run 560,080.
    let program = updates(&[1000; 20]);
    let members: Vec<&Instr> = program.instrs.iter().collect();
    let run_bytes = 20.0 * 28_004.0;
    let single_rate =
        |bytes: f64| 1e9 + (bytes.log2() - 1e3f64.log2()) / (1e7f64.log2() - 1e3f64.log2()) * 9e9;
    let priced = |profile: &Profile| {
        let calibration = Calibration {
            profile: profile.clone(),
            scale: false,
        };
        ProfileCosts::new(&calibration, &spec).fused_run(&program, &members, &[])
    };
    // No multi-tensor points: adam_w's rate at the run's size.
    assert!(close(priced(&profile), run_bytes / single_rate(run_bytes)));
    let each: f64 = 20.0 * 28_004.0 / single_rate(28_004.0);
    assert!(priced(&profile) < each);
    // With them, theirs.
    profile.memory.extend([
        point("adam_w_multi", 1e4, 2e9),
        point("adam_w_multi", 1e8, 2e9),
    ]);
    assert!(close(priced(&profile), run_bytes / 2e9));
    // One launch at least.
    profile.launch_overhead_s = 1.0;
    assert!(close(priced(&profile), 1.0));
    // The runs a simulation takes, found once and priced so.
    let calibration = Calibration {
        profile,
        scale: false,
    };
    let costs = ProfileCosts::new(&calibration, &spec);
    let fused = crate::timeline::FusedRuns::of(&program, &costs);
    let op = |i: usize| program.instrs[i].op().unwrap();
    let Some(Role::First(run)) = fused.role(0, op(0)) else {
        panic!("the first update starts the run");
    };
    assert_eq!(run.members, (0..20).collect::<Vec<_>>());
    assert!((1..20).all(|i| fused.role(i, op(i)) == Some(Role::Later)));
    let seconds = crate::timeline::compute_seconds(&program, &costs);
    assert_eq!(seconds[0], 1.0);
    assert!(seconds[1..].iter().all(|&s| s == 0.0));
}

/// A run of updates that absorbed its refresh copies (`Copy`s of the updated params into bf16
/// working copies) is one launch that also writes the working copies, 2 bytes an element: the
/// copies take no time of their own, by the profile and by the roofline alike.
#[test]
fn a_fused_run_writes_the_refresh_copies_it_absorbed() {
    let (spec, _) = tiny();
    let mut profile = uniform(4e10, 8e9);
    profile.backend = "cuda".into();
    profile.launch_overhead_s = 1e-9;
    profile.memory.retain(|m| m.kind != MemoryKind::Optimizer);
    profile.memory.extend([1e4, 1e8].map(|bytes| MemoryPoint {
        kind: MemoryKind::Optimizer,
        bytes,
        op: Some("adam_w_multi".into()),
        cols: None,
        seconds: bytes / 2e9,
    }));
    // 20 updates of 1,000 elements, each followed by its refresh copy into a bf16 buffer.
    let mut program = updates(&[1000; 20]);
    let mut instrs = Vec::new();
    for (t, update) in program.instrs.iter().enumerate() {
        let working = program.buffers.len() as u32;
        program.buffers.push(Buffer {
            name: format!("w{t}"),
            shape: vec![1000],
            dtype: DType::Bf16,
            kind: crate::ir::BufferKind::Activation,
        });
        instrs.push(update.clone());
        instrs.push(Instr::compute(Op::Copy, &[2 + 4 * t as u32], &[working]));
    }
    program.instrs = instrs;
    let calibration = Calibration {
        profile,
        scale: false,
    };
    let costs = ProfileCosts::new(&calibration, &spec);
    let fused = crate::timeline::FusedRuns::of(&program, &costs);
    let Some(Role::First(run)) = fused.role(0, program.instrs[0].op().unwrap()) else {
        panic!("the first update starts the run");
    };
    let copies: Vec<usize> = (0..20).map(|t| 2 * t + 1).collect();
    assert_eq!(run.refreshes, copies);
    // 28,004 bytes an update (f32 at 4 bytes), 2,000 more written for its working copy.
    assert!(close(run.seconds, 20.0 * 30_004.0 / 2e9), "{}", run.seconds);
    let seconds = crate::timeline::compute_seconds(&program, &costs);
    assert_eq!(seconds[0], run.seconds);
    assert!(seconds[1..].iter().all(|&s| s == 0.0));
    // Without points for the run: the roofline's updates plus the working copies' writes.
    let members: Vec<&Instr> = program.instrs.iter().step_by(2).collect();
    let refreshes: Vec<&Instr> = program.instrs.iter().skip(1).step_by(2).collect();
    let roofline = crate::timeline::costs::SpecCosts { spec: &spec };
    let bandwidth = spec.cluster.gpu.memory_bandwidth;
    let alone: f64 = members.iter().map(|m| roofline.compute(&program, m)).sum();
    let mut no_points = calibration.clone();
    no_points.profile.memory.clear();
    let priced = ProfileCosts::new(&no_points, &spec).fused_run(&program, &members, &refreshes);
    assert!(
        close(priced, alone + 20.0 * 2_000.0 / bandwidth),
        "{priced}"
    );
}

/// Shared quantization (`quantize: shared`): each `Fp8Quantize` is priced as the memory-bound
/// op it is, each quantized GEMM by its GEMM part alone, and the plan, which quantizes each
/// shared tensor once, is priced below the per-GEMM plan of the same recipe; on the roofline
/// too.
#[test]
fn shared_quantization_is_priced_once_per_tensor() {
    let lowered = |quantize: &str| tiny_llama_tensorwise(&format!("quantize: {quantize}"));
    let (spec, shared) = lowered("shared");
    let (_, own) = lowered("per_gemm");
    let quantizes = (shared.programs[0].instrs.iter())
        .filter(|i| i.op().is_some_and(|op| matches!(op, Op::Fp8Quantize(_))))
        .count();
    assert!(quantizes > 0);
    let calibration = bf16_profile(None);
    let costs = ProfileCosts::new(&calibration, &spec);
    let program = &shared.programs[0];
    for instr in program
        .instrs
        .iter()
        .filter(|i| i.op().is_some_and(|op| matches!(op, Op::Fp8Quantize(_))))
    {
        assert!(costs.compute(program, instr) > 0.0);
    }
    for costs in [
        &costs as &dyn StepCosts,
        &crate::timeline::costs::SpecCosts { spec: &spec },
    ] {
        let (a, b) = (
            simulate_with(&shared, &spec, costs).step_seconds,
            simulate_with(&own, &spec, costs).step_seconds,
        );
        assert!(a < b, "shared {a} s, per GEMM {b} s");
    }
}

/// Under delayed scaling a SwiGLU GEMM and the quantizations of what its epilogue wrote
/// (`ir::swiglu_runs`) are one run where the backend fuses: priced as the GEMM and each
/// quantization's writes (bf16 in, both layouts out: half its own price; one layout: a third),
/// above the GEMM alone and below every member priced alone; the members take no time.
#[test]
fn a_swiglu_gemm_absorbs_the_reads_of_its_quantizations() {
    let (spec, plan) = tiny_llama_tensorwise("scaling: delayed");
    let program = &plan.programs[0];
    let mut calibration = bf16_profile(None);
    calibration.profile.backend = "cuda".into();
    let costs = ProfileCosts::new(&calibration, &spec);
    assert!(costs.fuses_optimizer_runs());
    let runs = crate::ir::swiglu_runs::find_swiglu_runs(program);
    assert!(!runs.is_empty());
    let fused = crate::timeline::FusedRuns::of(program, &costs);
    let seconds = crate::timeline::compute_seconds(program, &costs);
    for run in &runs {
        let op = |i: usize| program.instrs[i].op().unwrap();
        let Some(Role::First(priced)) = fused.role(run.producer, op(run.producer)) else {
            panic!("the SwiGLU GEMM {} starts its run", run.producer);
        };
        assert_eq!(priced.members, run.instructions());
        let alone = |i: usize| costs.compute(program, &program.instrs[i]);
        let gemm = alone(run.producer);
        let members: f64 = run.quantizes.iter().map(|&q| alone(q)).sum();
        let share = |q: usize| match op(q) {
            Op::Fp8Quantize(a) if a.direct && a.transposed => 0.5,
            _ => 1.0 / 3.0,
        };
        let expect = gemm
            + run
                .quantizes
                .iter()
                .map(|&q| share(q) * alone(q))
                .sum::<f64>();
        assert!(
            close(priced.seconds, expect),
            "{} against {expect}",
            priced.seconds
        );
        assert!(gemm < priced.seconds && priced.seconds < gemm + members);
        assert_eq!(seconds[run.producer], priced.seconds);
        for &m in &run.instructions()[1..] {
            assert_eq!(fused.role(m, op(m)), Some(Role::Later));
            assert_eq!(seconds[m], 0.0);
        }
    }
}
