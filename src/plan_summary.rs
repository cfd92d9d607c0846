//! The summary of a lowered plan, as `parc plan` prints it above the plan and `parc check`
//! under its report: per program the verified peak memory, the memory plan's arena and the
//! collectives' overlap; the simulated step; then the predicted memory per GPU.
use crate::report::{bytes, render_device_memory};
use parc_compiler::driver::MemoryPlans;
use parc_compiler::ir::Plan;
use parc_compiler::memplan::PlanSummary;
use parc_compiler::timeline::Timeline;
use parc_compiler::verify::{ProgramMemory, VerifyReport};
use std::fmt::Write as _;

/// The whole summary, each line but the per-GPU table starting with `# `.
pub fn render(
    plan: &Plan,
    verified: &VerifyReport,
    memory: &MemoryPlans,
    timeline: &Timeline,
) -> String {
    let instrs = plan.instructions();
    let mut out = format!(
        "# {} ranks, {} programs, {instrs} instructions; verified ({} ranks simulated)\n",
        plan.world,
        plan.programs.len(),
        verified.ranks_simulated
    );
    for program in &verified.programs {
        out.push_str(&program_lines(
            program,
            memory.programs.get(program.program.0 as usize),
        ));
    }
    let _ = writeln!(
        out,
        "# simulated step {:.3} s, bubble {:.1}%, exposed communication {:.1}%",
        timeline.step_seconds,
        timeline.bubble_fraction * 100.0,
        timeline.exposed_comm_fraction * 100.0
    );
    let roles: Vec<String> = plan.programs.iter().map(|p| p.role.clone()).collect();
    out.push_str(&render_device_memory(&roles, &memory.device));
    out
}

/// One program's verified memory, then its memory plan and collective overlap.
fn program_lines(m: &ProgramMemory, memory_plan: Option<&PlanSummary>) -> String {
    let mut out = format!(
        "# program {} ({}): peak {} = {} persistent + {} transient, {} microbatches in flight\n",
        m.program.0,
        m.role,
        bytes(m.peak_bytes as f64),
        bytes(m.persistent_bytes as f64),
        bytes(m.peak_transient_bytes as f64),
        m.peak_microbatches_in_flight
    );
    let Some(p) = memory_plan else {
        return out;
    };
    let _ = writeln!(
        out,
        "#   memory plan: arena {} (liveness peak {}, {:+.1}%), {} of {} allocations \
         need zeroing",
        bytes(p.arena_bytes as f64),
        bytes(p.liveness_peak_bytes as f64),
        p.overhead * 100.0,
        p.zeroed_allocs,
        p.allocs
    );
    let o = &p.comm_overlap;
    if o.collectives > 0 {
        let _ = writeln!(
            out,
            "#   collective overlap: {} collectives, {} waited for by the next \
             instruction, {} waiting instruction(s), median run-ahead {} instructions",
            o.collectives,
            o.waited_at_once,
            o.waiting_instructions,
            o.median_run_ahead()
        );
    }
    out
}
