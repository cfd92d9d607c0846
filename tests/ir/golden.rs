//! Golden IR tests: every `tests/ir/*.par` is checked, lowered and verified, and its plan text
//! must equal `tests/ir/<name>.txt`. A difference fails with the first differing line;
//! `PARC_BLESS=1 cargo test --test ir golden` rewrites the expected files.

use parc_compiler::diag::Sources;
use parc_compiler::ir::text::PlanText;
use parc_compiler::lower::lower;
use std::path::{Path, PathBuf};

fn plan_text(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let mut sources = Sources::default();
    let main = sources.add(path.display().to_string(), text);
    let (spec, diags) = parc_compiler::check(&mut sources, main, &[]);
    let spec = spec.unwrap_or_else(|| panic!("{}: {:?}", path.display(), diags.items));
    let plan = lower(&spec).unwrap_or_else(|d| panic!("{}: {:?}", path.display(), d.items));
    if let Err(d) = parc_compiler::verify::verify_spec(&plan, &spec) {
        panic!("{}: verifier: {:?}", path.display(), d.items);
    }
    let names: Vec<String> = spec.model.nodes.iter().map(|n| n.name.clone()).collect();
    PlanText::new(&plan).with_names(&names).to_string()
}

#[test]
fn golden_plans() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/ir");
    let mut specs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "par"))
        .collect();
    specs.sort();
    assert!(
        specs.len() >= 10,
        "expected the per-axis specs in {}",
        dir.display()
    );
    let bless = std::env::var_os("PARC_BLESS").is_some();
    let mut failures = Vec::new();
    for spec in &specs {
        let text = plan_text(spec);
        let expected_path = spec.with_extension("txt");
        if bless {
            std::fs::write(&expected_path, &text).unwrap();
            continue;
        }
        let Ok(expected) = std::fs::read_to_string(&expected_path) else {
            failures.push(format!(
                "{} is missing (PARC_BLESS=1 writes it)",
                expected_path.display()
            ));
            continue;
        };
        if expected != text {
            let line = expected
                .lines()
                .zip(text.lines())
                .position(|(a, b)| a != b)
                .unwrap_or_else(|| expected.lines().count().min(text.lines().count()));
            failures.push(format!(
                "{} differs at line {}:\n expected: {}\n      got: {}",
                expected_path.display(),
                line + 1,
                expected.lines().nth(line).unwrap_or("<end>"),
                text.lines().nth(line).unwrap_or("<end>")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{}\n(PARC_BLESS=1 rewrites the expected plans)",
        failures.join("\n")
    );
}
