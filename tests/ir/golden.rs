//! Golden IR tests: every `tests/ir/*.par` is checked, lowered and verified, and its plan text
//! must equal `tests/ir/<name>.txt` (lowered without fusion) and, where the fusion pass changes
//! the plan, `tests/ir/<name>.fused.txt` (with it; a spec fusion leaves alone has no such
//! file). A difference fails with the first differing line; `PARC_BLESS=1 cargo test --test ir
//! golden` rewrites the expected files.

use parc_compiler::diag::Sources;
use parc_compiler::ir::text::PlanText;
use parc_compiler::lower::{lower_with, LowerOptions};
use std::path::{Path, PathBuf};

fn plan_text(path: &Path, fusion: bool) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let mut sources = Sources::default();
    let main = sources.add(path.display().to_string(), text);
    let (spec, diags) = parc_compiler::check(&mut sources, main, &[]);
    let spec = spec.unwrap_or_else(|| panic!("{}: {:?}", path.display(), diags.items));
    let options = LowerOptions {
        fusion,
        ..LowerOptions::default()
    };
    let plan =
        lower_with(&spec, options).unwrap_or_else(|d| panic!("{}: {:?}", path.display(), d.items));
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
        let text = plan_text(spec, false);
        let fused = plan_text(spec, true);
        let fused_path = spec.with_extension("fused.txt");
        let expected_fused = (fused != text).then_some(fused);
        let expected_path = spec.with_extension("txt");
        if bless {
            std::fs::write(&expected_path, &text).unwrap();
            match &expected_fused {
                Some(fused) => std::fs::write(&fused_path, fused).unwrap(),
                None if fused_path.exists() => std::fs::remove_file(&fused_path).unwrap(),
                None => {}
            }
            continue;
        }
        compare(&expected_path, Some(&text), &mut failures);
        compare(&fused_path, expected_fused.as_ref(), &mut failures);
    }
    assert!(
        failures.is_empty(),
        "{}\n(PARC_BLESS=1 rewrites the expected plans)",
        failures.join("\n")
    );
}

/// Records in `failures` how the file at `path` differs from `text` (`None`: the file must not
/// exist).
fn compare(path: &Path, text: Option<&String>, failures: &mut Vec<String>) {
    let expected = std::fs::read_to_string(path).ok();
    let (expected, text) = match (expected, text) {
        (None, None) => return,
        (Some(_), None) => {
            failures.push(format!(
                "{} is stale (PARC_BLESS=1 removes it)",
                path.display()
            ));
            return;
        }
        (None, Some(_)) => {
            failures.push(format!(
                "{} is missing (PARC_BLESS=1 writes it)",
                path.display()
            ));
            return;
        }
        (Some(expected), Some(text)) => (expected, text),
    };
    if expected != *text {
        let line = expected
            .lines()
            .zip(text.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| expected.lines().count().min(text.lines().count()));
        failures.push(format!(
            "{} differs at line {}:\n expected: {}\n      got: {}",
            path.display(),
            line + 1,
            expected.lines().nth(line).unwrap_or("<end>"),
            text.lines().nth(line).unwrap_or("<end>")
        ));
    }
}
