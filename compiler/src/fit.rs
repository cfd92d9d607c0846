//! The memory verdict of a lowered plan: E0701 when a rank needs more memory than its GPU has,
//! judged on what the runtime would hold, not on formulas. A rank's need is its program's
//! memory plan (persistent region + arena) plus, on a GPU, the CUDA backend's scratch and
//! weight casts, the CUDA context and NCCL's buffers (`memplan::device_memory`, within 0.2% of
//! nvidia-smi on the measured runs, docs/memory.md); on the CPU backend the plan alone.
//!
//! The help is measured the same way: each single change the cost model proposes
//! (`cost::alternatives`: a higher ZeRO stage, recompute, doubling tp or pp, halving the micro
//! batch) is lowered and planned by the caller's `measure`, and the help names the first that
//! fits, else the greedy combination that fits, else the largest saving.

use crate::cost::{alternatives, gib, memory_error_head, memory_help, Measure};
use crate::diag::Diagnostic;
use crate::ir::{BufferKind, Plan};
use crate::memplan::{DeviceMemory, PlanSummary};
use crate::spec::Spec;
use crate::verify::VerifyReport;

/// What one program of a lowered plan holds.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Need {
    pub role: String,
    pub bytes: u64,
    /// The terms of `bytes`, largest first.
    pub terms: Vec<(String, u64)>,
}

/// The bytes a rank of `spec` holds with `device` (the plan alone on the CPU backend).
pub fn held(spec: &Spec, device: &DeviceMemory) -> u64 {
    if spec.cluster.gpu.name == "cpu" {
        device.planned_bytes
    } else {
        device.total_bytes
    }
}

/// Each program's need, in program order: the memory plan's persistent region by buffer kind,
/// the arena by the kinds alive at the liveness peak (fragmentation as its own term) and the
/// backend's and runtime's lines.
pub fn needs(
    spec: &Spec,
    plan: &Plan,
    verified: &VerifyReport,
    summaries: &[PlanSummary],
    device: &[DeviceMemory],
) -> Vec<Need> {
    let cpu = spec.cluster.gpu.name == "cpu";
    plan.programs
        .iter()
        .zip(summaries.iter().zip(device))
        .enumerate()
        .map(|(i, (program, (summary, device)))| {
            let mut terms = persistent_terms(program);
            if let Some(memory) = verified.programs.get(i) {
                terms.extend(memory.peak_by_kind.iter().map(|(kind, bytes)| {
                    let words =
                        BufferKind::from_name(kind).map_or(kind.as_str(), |k| k.description());
                    (format!("{words} at the peak"), *bytes)
                }));
            }
            let fragmentation = summary
                .arena_bytes
                .saturating_sub(summary.liveness_peak_bytes);
            terms.push(("arena fragmentation".to_string(), fragmentation));
            if !cpu {
                for line in device.backend.iter().chain(&device.runtime) {
                    terms.push((line.what.to_string(), line.bytes));
                }
            }
            terms.retain(|(_, b)| *b > 0);
            terms.sort_by_key(|t| std::cmp::Reverse(t.1));
            Need {
                role: program.role.clone(),
                bytes: held(spec, device),
                terms,
            }
        })
        .collect()
}

/// The persistent region by buffer kind (parameters, optimizer state, metrics).
fn persistent_terms(program: &crate::ir::Program) -> Vec<(String, u64)> {
    let mut terms: Vec<(String, u64)> = Vec::new();
    for buffer in program.buffers.iter().filter(|b| b.kind.is_persistent()) {
        let name = buffer.kind.description();
        let bytes = crate::memplan::aligned_size(buffer.bytes());
        match terms.iter_mut().find(|(n, _)| n == name) {
            Some((_, b)) => *b += bytes,
            None => terms.push((name.to_string(), bytes)),
        }
    }
    terms
}

/// E0701 when some program of the plan needs more than `spec`'s GPU has. `measure` lowers and
/// plans a changed spec and returns its largest need (`None` when it does not lower).
pub fn memory_verdict(
    spec: &Spec,
    needs: &[Need],
    measure: &dyn Fn(&Spec) -> Option<u64>,
) -> Option<Diagnostic> {
    let capacity = spec.cluster.gpu.memory_bytes;
    let worst = needs.iter().max_by_key(|n| n.bytes)?;
    let need = worst.bytes;
    if need <= capacity {
        return None;
    }
    let what = format!("program `{}` needs {} per GPU", worst.role, gib(need));
    let mut d = memory_error_head(spec, &what, "").note(format!(
        "measured on the lowered plan: {}",
        terms_text(&worst.terms)
    ));
    let over: Vec<String> = needs
        .iter()
        .filter(|n| n.bytes > capacity)
        .map(|n| format!("{} ({})", n.role, gib(n.bytes)))
        .collect();
    if over.len() > 1 {
        d = d.note(format!("over the limit: {}", over.join(", ")));
    }
    let mut options: Vec<(String, u64)> = alternatives(spec)
        .into_iter()
        .filter_map(|alt| Some((alt.change, measure(&alt.spec)?)))
        .filter(|(_, after)| *after < need)
        .collect();
    options.sort_by_key(|(_, after)| *after);
    for (change, after) in &options {
        d = d.note(format!(
            "{change} saves {} per GPU (peak {}, lowered)",
            gib(need - after),
            gib(*after)
        ));
    }
    let measure = Measure {
        need: measure,
        per: "GPU",
    };
    Some(d.help(memory_help(spec, need, &options, &measure)))
}

/// The terms of a need over 64 MiB, as `name 1.2 GiB, …`.
fn terms_text(terms: &[(String, u64)]) -> String {
    let shown: Vec<String> = terms
        .iter()
        .filter(|(_, b)| *b >= 1 << 26)
        .map(|(name, b)| format!("{name} {}", gib(*b)))
        .collect();
    if shown.is_empty() {
        "every term under 64 MiB".to_string()
    } else {
        shown.join(", ")
    }
}
