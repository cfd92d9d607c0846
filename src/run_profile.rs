//! The `parc run --profile` report: where the profiled step's time went, per kind of work,
//! with achieved TFLOP/s (matmuls, attention) or GB/s (memory-bound ops) against the spec
//! GPU's ceilings, beside what the timeline predicted for the same program (the pricing of
//! `parc check`: the calibration profile or the GPU's peak numbers), so where the time model and
//! the GPU disagree shows per kind. Human: a table on stderr after the summary; JSON: one
//! `{"event":"profile",…}` line on stdout before the summary line.
use crate::calibration::CalibrationArgs;
use parc_compiler::ir::Plan;
use parc_compiler::spec::{Gpu, Spec};
use parc_compiler::timeline::{self, ProfileCosts, SpecCosts, StepCosts};
use parc_runtime::exec::profile::{predicted_ops, KindTotals, OpKind, OpTotals, StepProfile};
use serde_json::{json, Value};

/// The profiled step and the timeline's prediction of it.
pub struct Profiled<'a> {
    pub measured: &'a StepProfile,
    pub gpu: &'a Gpu,
    /// None when the step could not be priced (the reason is in `unpriced`).
    pub predicted: Option<Prediction>,
    pub unpriced: Option<String>,
}

/// What `parc check`'s timeline predicts for the profiled rank.
pub struct Prediction {
    /// The simulated step (all ranks, communication and bubble included).
    pub step_seconds: f64,
    /// Each op's (`profile::op_label`) kind and compute time on the profiled rank.
    pub ops: Vec<(String, OpKind, f64)>,
    /// What priced it: the calibration profile's file, or the GPU's peak numbers.
    pub pricing: String,
}

impl Prediction {
    /// A kind's compute time: the sum of its ops' (None without any).
    fn of(&self, kind: OpKind) -> Option<f64> {
        let mut of_kind = self.ops.iter().filter(|(_, k, _)| *k == kind).peekable();
        of_kind.peek()?;
        Some(of_kind.map(|(_, _, s)| s).sum())
    }

    fn of_op(&self, label: &str) -> Option<f64> {
        self.ops
            .iter()
            .find(|(l, _, _)| l == label)
            .map(|(_, _, s)| *s)
    }
}

/// The profiled step of `plan` with its prediction, priced as `parc check` prices `spec` (the
/// calibration `args` name, else the default profile of the spec's GPU, else its peak numbers).
pub fn profiled<'a>(
    measured: &'a StepProfile,
    spec: &'a Spec,
    plan: &Plan,
    args: &CalibrationArgs,
) -> Profiled<'a> {
    let (predicted, unpriced) = match predict(measured.rank, spec, plan, args) {
        Ok(p) => (Some(p), None),
        Err(e) => (None, Some(e)),
    };
    Profiled {
        measured,
        gpu: &spec.cluster.gpu,
        predicted,
        unpriced,
    }
}

fn predict(
    rank: u32,
    spec: &Spec,
    plan: &Plan,
    args: &CalibrationArgs,
) -> Result<Prediction, String> {
    let program = plan
        .program_of(rank)
        .ok_or_else(|| format!("the plan has no program for rank {rank}"))?;
    let chosen = crate::calibration::choose(args, spec)?;
    let calibration = chosen.calibration.as_deref();
    let simulated = timeline::simulate_calibrated(plan, spec, calibration, timeline::Events::Skip);
    let costs: Box<dyn StepCosts> = match calibration {
        Some(c) => Box::new(ProfileCosts::new(c, spec)),
        None => Box::new(SpecCosts { spec }),
    };
    let pricing = match chosen.file {
        Some(file) => format!("calibration {file}"),
        None => format!("the peak numbers of gpu `{}`", spec.cluster.gpu.name),
    };
    Ok(Prediction {
        step_seconds: simulated.step_seconds,
        ops: predicted_ops(program, costs.as_ref()),
        pricing,
    })
}

/// One row of the report, with its rates worked out.
struct Row<'a> {
    totals: &'a KindTotals,
    share_pct: f64,
    tflops: Option<f64>,
    gbps: Option<f64>,
    /// Achieved rate as a percentage of the ceiling that applies to this kind.
    ceiling_pct: Option<f64>,
}

fn rows<'a>(profile: &'a StepProfile, gpu: &Gpu) -> Vec<Row<'a>> {
    let step = profile.step_seconds.max(1e-12);
    profile
        .kinds
        .iter()
        .filter(|t| t.count > 0 || t.seconds > 0.0)
        .map(|totals| {
            let seconds = totals.seconds.max(1e-12);
            let kind = totals.kind;
            let tflops = kind.compute_bound().then(|| totals.flops / seconds / 1e12);
            let gbps = kind.memory_bound().then(|| totals.bytes / seconds / 1e9);
            let ceiling_pct = if let Some(t) = tflops {
                (gpu.peak_flops > 0.0).then(|| 100.0 * t * 1e12 / gpu.peak_flops)
            } else if let Some(g) = gbps {
                (gpu.memory_bandwidth > 0.0).then(|| 100.0 * g * 1e9 / gpu.memory_bandwidth)
            } else {
                None
            };
            Row {
                totals,
                share_pct: 100.0 * totals.seconds / step,
                tflops,
                gbps,
                ceiling_pct,
            }
        })
        .collect()
}

fn nominal(gpu: &Gpu) -> bool {
    gpu.name == "cpu"
}

/// How the instructions were timed: `device` (marks on the device's queue, no waiting between
/// instructions) or `synchronized` (on the host, the backend idle before and after each).
fn timing(profile: &StepProfile) -> &'static str {
    if profile.device_timed {
        "device"
    } else {
        "synchronized"
    }
}

/// The `{"event":"profile",…}` line.
pub fn json(p: &Profiled) -> Value {
    let (profile, gpu) = (p.measured, p.gpu);
    let predicted = p.predicted.as_ref();
    let kinds: Vec<Value> = rows(profile, gpu)
        .iter()
        .map(|r| {
            json!({
                "kind": r.totals.kind.name(),
                "count": r.totals.count,
                "ms": r.totals.seconds * 1e3,
                "share_pct": r.share_pct,
                "tflops": r.tflops,
                "gbps": r.gbps,
                "ceiling_pct": r.ceiling_pct,
                "predicted_ms": predicted.and_then(|x| x.of(r.totals.kind)).map(|s| s * 1e3),
            })
        })
        .collect();
    json!({
        "event": "profile",
        "step": profile.step,
        "rank": profile.rank,
        "step_ms": profile.step_seconds * 1e3,
        "predicted_step_ms": predicted.map(|x| x.step_seconds * 1e3),
        "predicted_by": predicted.map(|x| x.pricing.clone()),
        "unpriced": p.unpriced,
        "gpu": gpu.name,
        "peak_tflops": gpu.peak_flops / 1e12,
        "memory_bandwidth_gbps": gpu.memory_bandwidth / 1e9,
        "ceilings_nominal": nominal(gpu),
        "timing": timing(profile),
        "kinds": kinds,
        "ops": ops_json(p),
    })
}

/// The per-op lines of the JSON: every op, slowest first.
fn ops_json(p: &Profiled) -> Vec<Value> {
    by_time(&p.measured.ops)
        .into_iter()
        .map(|o| {
            let seconds = o.seconds.max(1e-12);
            json!({
                "op": o.label,
                "kind": o.kind.name(),
                "count": o.count,
                "ms": o.seconds * 1e3,
                "tflops": o.kind.compute_bound().then(|| o.flops / seconds / 1e12),
                "gbps": o.kind.memory_bound().then(|| o.bytes / seconds / 1e9),
                "predicted_ms": p.predicted.as_ref().and_then(|x| x.of_op(&o.label)).map(|s| s * 1e3),
            })
        })
        .collect()
}

/// `ops` slowest first.
fn by_time(ops: &[OpTotals]) -> Vec<&OpTotals> {
    let mut sorted: Vec<&OpTotals> = ops.iter().collect();
    sorted.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    sorted
}

/// An achieved rate as the human tables print it.
fn achieved(tflops: Option<f64>, gbps: Option<f64>) -> String {
    match (tflops, gbps) {
        (Some(t), _) if t >= 1.0 => format!("{t:.1} TFLOP/s"),
        (Some(t), _) => format!("{:.2} GFLOP/s", t * 1e3),
        (_, Some(g)) => format!("{g:.1} GB/s"),
        _ => "-".to_string(),
    }
}

/// How many ops the human table lists (the JSON has all).
const TOP_OPS: usize = 20;

/// The human table's per-op part: the slowest ops, each with its achieved rate and the
/// timeline's price of it.
fn ops_table(p: &Profiled) -> String {
    let ops = by_time(&p.measured.ops);
    if ops.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "  slowest ops ({} of {}):\n  {:<46} {:>6} {:>10} {:>16} {:>12} {:>9}\n",
        ops.len().min(TOP_OPS),
        ops.len(),
        "op",
        "count",
        "ms",
        "achieved",
        "predicted ms",
        "meas/pred"
    );
    for o in ops.into_iter().take(TOP_OPS) {
        let seconds = o.seconds.max(1e-12);
        let achieved = achieved(
            o.kind.compute_bound().then(|| o.flops / seconds / 1e12),
            o.kind.memory_bound().then(|| o.bytes / seconds / 1e9),
        );
        let predicted = p.predicted.as_ref().and_then(|x| x.of_op(&o.label));
        let (pred, ratio) = match predicted {
            Some(s) if s > 0.0 => (format!("{:.3}", s * 1e3), format!("{:.2}", o.seconds / s)),
            _ => ("-".to_string(), "-".to_string()),
        };
        let label: String = o.label.chars().take(46).collect();
        out.push_str(&format!(
            "  {:<46} {:>6} {:>10.3} {:>16} {:>12} {:>9}\n",
            label,
            o.count,
            o.seconds * 1e3,
            achieved,
            pred,
            ratio
        ));
    }
    out
}

/// The human table.
pub fn human(p: &Profiled) -> String {
    let (profile, gpu) = (p.measured, p.gpu);
    let mut out = format!(
        "profile of step {} on rank {}: {:.2} ms, {}; ceilings of the spec's gpu `{}`: \
         {:.1} TFLOP/s, {:.0} GB/s{}\n",
        profile.step,
        profile.rank,
        profile.step_seconds * 1e3,
        if profile.device_timed {
            "instructions timed on the device (no per-instruction synchronization)"
        } else {
            "each instruction timed between synchronizations"
        },
        gpu.name,
        gpu.peak_flops / 1e12,
        gpu.memory_bandwidth / 1e9,
        if nominal(gpu) {
            " (nominal: the cpu gpu has no real ceilings)"
        } else {
            ""
        }
    );
    match (&p.predicted, &p.unpriced) {
        (Some(x), _) => out.push_str(&format!(
            "  predicted (parc check's timeline, priced by {}): step {:.2} ms, measured / \
             predicted {:.3}\n",
            x.pricing,
            x.step_seconds * 1e3,
            profile.step_seconds / x.step_seconds.max(1e-12)
        )),
        (None, Some(why)) => out.push_str(&format!("  not predicted: {why}\n")),
        (None, None) => {}
    }
    out.push_str(&format!(
        "  {:<18} {:>6} {:>10} {:>7} {:>16} {:>9} {:>12}\n",
        "kind", "count", "ms", "% step", "achieved", "% ceiling", "predicted ms"
    ));
    for r in rows(profile, gpu) {
        let achieved = achieved(r.tflops, r.gbps);
        let ceiling = r
            .ceiling_pct
            .map_or_else(|| "-".to_string(), |p| format!("{p:.1}%"));
        let predicted = (p.predicted.as_ref())
            .and_then(|x| x.of(r.totals.kind))
            .map_or_else(|| "-".to_string(), |s| format!("{:.3}", s * 1e3));
        out.push_str(&format!(
            "  {:<18} {:>6} {:>10.3} {:>6.1}% {:>16} {:>9} {:>12}\n",
            r.totals.kind.name(),
            r.totals.count,
            r.totals.seconds * 1e3,
            r.share_pct,
            achieved,
            ceiling,
            predicted
        ));
    }
    out.push_str(&ops_table(p));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use parc_runtime::exec::profile::OpKind;

    fn gpu() -> Gpu {
        Gpu {
            name: "h200".to_string(),
            memory_bytes: 141 << 30,
            peak_flops: 1e15,
            peak_flops_fp32: 6e13,
            peak_flops_fp8: Some(2e15),
            memory_bandwidth: 4.8e12,
        }
    }

    #[test]
    fn rates_are_against_the_spec_gpu_ceilings() {
        let mut p = StepProfile::new(2, 0);
        // 1e12 FLOPs in 10 ms: 100 TFLOP/s = 10% of 1000.
        p.add_op("matmul+bias".into(), OpKind::MatmulFwd, 0.01, 1e12, 0.0);
        // 4.8e9 bytes in 10 ms: 480 GB/s = 10% of 4800.
        p.add(OpKind::Elementwise, 0.01, 0.0, 4.8e9);
        p.finish(0.04);
        let g = gpu();
        fn measured<'a>(p: &'a StepProfile, g: &'a Gpu) -> Profiled<'a> {
            Profiled {
                measured: p,
                gpu: g,
                predicted: Some(Prediction {
                    step_seconds: 0.02,
                    ops: vec![("matmul+bias".to_string(), OpKind::MatmulFwd, 0.005)],
                    pricing: "a test".to_string(),
                }),
                unpriced: None,
            }
        }
        let v = json(&measured(&p, &g));
        assert_eq!(v["event"], "profile");
        let kinds = v["kinds"].as_array().unwrap();
        assert_eq!(kinds.len(), 3);
        assert!((kinds[0]["tflops"].as_f64().unwrap() - 100.0).abs() < 1e-6);
        assert!((kinds[0]["ceiling_pct"].as_f64().unwrap() - 10.0).abs() < 1e-6);
        assert!((kinds[1]["gbps"].as_f64().unwrap() - 480.0).abs() < 1e-6);
        assert!((kinds[1]["ceiling_pct"].as_f64().unwrap() - 10.0).abs() < 1e-6);
        assert_eq!(kinds[2]["kind"], "other");
        assert!((kinds[2]["share_pct"].as_f64().unwrap() - 50.0).abs() < 1e-6);
        assert!((kinds[0]["predicted_ms"].as_f64().unwrap() - 5.0).abs() < 1e-9);
        assert!(kinds[1]["predicted_ms"].is_null());
        assert!((v["predicted_step_ms"].as_f64().unwrap() - 20.0).abs() < 1e-9);
        let ops = v["ops"].as_array().unwrap();
        assert_eq!(ops.len(), 1);
        assert_eq!(ops[0]["op"], "matmul+bias");
        assert!((ops[0]["predicted_ms"].as_f64().unwrap() - 5.0).abs() < 1e-9);
        let table = human(&measured(&p, &g));
        assert!(table.contains("matmul_fwd"), "{table}");
        assert!(table.contains("measured / predicted 2.000"), "{table}");
        assert!(table.contains("slowest ops (1 of 1)"), "{table}");
        assert_eq!(v["timing"], "synchronized");
        p.device_timed = true;
        assert_eq!(json(&measured(&p, &g))["timing"], "device");
        assert!(human(&measured(&p, &g)).contains("timed on the device"));
    }
}
