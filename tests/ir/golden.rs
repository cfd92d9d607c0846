//! Golden text of small plans, one per axis: `tests/ir/golden/<name>.txt`. A difference fails
//! with the first differing line; `PARC_BLESS=1 cargo test --test ir golden` rewrites them.

use super::fixtures::{spec, PlanChoice, TinyModel};
use parc_compiler::ir::text::PlanText;
use parc_compiler::lower::lower;
use parc_compiler::spec::{PipelineSchedule, Recompute, ZeroStage};
use std::path::PathBuf;

fn golden(name: &str, layers: u32, llama: bool, plan: PlanChoice) {
    let s = spec(
        TinyModel {
            layers,
            llama,
            tied: !llama,
        },
        plan,
    );
    let names: Vec<String> = s.model.nodes.iter().map(|n| n.name.clone()).collect();
    let p = lower(&s).unwrap_or_else(|d| panic!("{name}: {:?}", d.items));
    let text = PlanText::new(&p).with_names(&names).to_string();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/ir/golden")
        .join(format!("{name}.txt"));
    if std::env::var_os("PARC_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("{} is missing: run with PARC_BLESS=1", path.display()));
    if expected != text {
        let line = expected
            .lines()
            .zip(text.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| expected.lines().count().min(text.lines().count()));
        panic!(
            "{name}: plan text differs from {} at line {}:\n expected: {}\n      got: {}\n(PARC_BLESS=1 rewrites it)",
            path.display(),
            line + 1,
            expected.lines().nth(line).unwrap_or("<end>"),
            text.lines().nth(line).unwrap_or("<end>")
        );
    }
}

fn one_mb() -> PlanChoice {
    PlanChoice {
        microbatches: 1,
        ..PlanChoice::default()
    }
}

#[test]
fn golden_single_rank() {
    golden("single", 1, false, one_mb());
}

#[test]
fn golden_dp_buckets_and_zero() {
    golden("dp2", 1, false, PlanChoice { dp: 2, ..one_mb() });
    golden(
        "dp2_zero1",
        1,
        false,
        PlanChoice {
            dp: 2,
            zero: ZeroStage::Zero1,
            ..one_mb()
        },
    );
    golden(
        "dp2_zero3",
        1,
        false,
        PlanChoice {
            dp: 2,
            zero: ZeroStage::Zero3,
            ..one_mb()
        },
    );
}

#[test]
fn golden_tp() {
    golden("tp2", 1, false, PlanChoice { tp: 2, ..one_mb() });
    golden(
        "tp2_sp_llama",
        1,
        true,
        PlanChoice {
            tp: 2,
            sp: true,
            ..one_mb()
        },
    );
}

#[test]
fn golden_pp() {
    golden(
        "pp2_1f1b",
        2,
        false,
        PlanChoice {
            pp: 2,
            microbatches: 2,
            ..one_mb()
        },
    );
    golden(
        "pp2_interleaved",
        4,
        true,
        PlanChoice {
            pp: 2,
            microbatches: 2,
            schedule: PipelineSchedule::Interleaved { virtual_stages: 2 },
            ..one_mb()
        },
    );
}

#[test]
fn golden_cp_and_recompute() {
    golden("cp2_llama", 1, true, PlanChoice { cp: 2, ..one_mb() });
    golden(
        "recompute_full",
        1,
        true,
        PlanChoice {
            recompute: Recompute::Full,
            ..one_mb()
        },
    );
    golden(
        "recompute_selective",
        1,
        false,
        PlanChoice {
            recompute: Recompute::Selective,
            ..one_mb()
        },
    );
}
