//! The search's budget counts work, instructions lowered, plan by plan. A candidate's lowering
//! is predicted before it is made from its *units*: repeated layers × microbatches lowered ×
//! program classes (a class plan's instructions, whatever its pp, are about proportional to
//! them: 115 to 128 per unit on Llama 3.1 405B plans, with or without recompute), at the most
//! instructions per unit the lowered candidates have shown. A candidate whose lowering would
//! take the work past the budget waits while cheaper ones are lowered: a pp-64 plan of Llama 3.1
//! 405B lowers 7.5 M instructions sampled and 30 M whole, the 70B example's plans about a
//! million.
use super::space::Candidate;

/// Instructions per unit before any candidate is lowered (about a Llama layer's).
const FIRST_PER_UNIT: f64 = 128.0;

/// The work a search may do, in instructions: the budget past which it stops going on for
/// merely promising candidates (`SearchOptions::lower_work`), and twice that for the whole
/// search, the winner's whole lowering included.
pub(super) fn cap(lower_work: u64) -> u64 {
    lower_work.saturating_mul(4)
}

/// The units of `candidate`'s plan lowered at `microbatches` (of a spec of `layers` repeated
/// layers): one program per class of tp and cp ranks (index 0 and the rest).
fn units(candidate: &Candidate, layers: u32, microbatches: u32) -> f64 {
    let classes = |n: u32| if n > 1 { 2.0 } else { 1.0 };
    f64::from(layers.max(1))
        * f64::from(microbatches)
        * classes(candidate.tp)
        * classes(candidate.cp)
}

/// The microbatches a candidate's evaluation lowers: both samples where it is sampled
/// (`super::sample_points`), else all of them.
fn evaluated_microbatches(c: &Candidate) -> u32 {
    match super::sample_points(c.microbatches, c.pp, c.schedule) {
        Some((a, b)) => a + b,
        None => c.microbatches,
    }
}

/// Instructions per unit: the most seen so far.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rate {
    per_unit: f64,
    layers: u32,
}

impl Rate {
    /// Before any lowering of a spec of `layers` repeated layers.
    pub fn new(layers: u32) -> Rate {
        Rate {
            per_unit: FIRST_PER_UNIT,
            layers,
        }
    }

    /// Learn from a candidate's evaluation that lowered `instructions`.
    pub fn learn(&mut self, candidate: &Candidate, instructions: u64) {
        let units = units(candidate, self.layers, evaluated_microbatches(candidate));
        self.per_unit = self.per_unit.max(instructions as f64 / units);
    }

    /// The instructions evaluating `candidate` lowers (both samples where it is sampled).
    pub fn evaluation(&self, candidate: &Candidate) -> u64 {
        let m = evaluated_microbatches(candidate);
        (units(candidate, self.layers, m) * self.per_unit) as u64
    }

    /// The instructions lowering `candidate`'s plan whole takes.
    pub fn whole(&self, candidate: &Candidate) -> u64 {
        (units(candidate, self.layers, candidate.microbatches) * self.per_unit) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::{Rate, FIRST_PER_UNIT};
    use crate::search::space::Candidate;
    use crate::spec::{Balance, PipelineSchedule, Recompute, ZeroStage};

    fn candidate(pp: u32, tp: u32, microbatches: u32) -> Candidate {
        Candidate {
            dp: 2,
            pp,
            cp: 1,
            tp,
            zero: ZeroStage::Zero1,
            schedule: PipelineSchedule::OneFOneB,
            micro_batch: 1,
            microbatches,
            recompute: Recompute::Selective,
            balance: Balance::Auto,
        }
    }

    /// Llama 3.1 405B's pp-64 plan of 1,024 microbatches: sampled at 128 and 129 microbatches,
    /// a quarter of its whole lowering, predicted at about 128 instructions a unit before any
    /// lowering (it lowers 7.5 M sampled, 30 M whole), then at the most a lowering showed.
    #[test]
    fn a_plan_is_predicted_from_its_layers_microbatches_and_classes() {
        let mut rate = Rate::new(126);
        let pp64 = candidate(64, 8, 1024);
        let units = 126.0 * 257.0 * 2.0;
        assert_eq!(rate.evaluation(&pp64), (units * FIRST_PER_UNIT) as u64);
        let ratio = rate.whole(&pp64) as f64 / rate.evaluation(&pp64) as f64;
        assert!((ratio - 1024.0 / 257.0).abs() < 1e-6, "{ratio}");
        rate.learn(&pp64, 9_000_000);
        assert!(rate.evaluation(&pp64).abs_diff(9_000_000) <= 1);
        // tp 1 runs one class of programs, half of tp 8's two; the rate keeps its largest.
        let tp1 = candidate(64, 1, 1024);
        assert!(rate.evaluation(&tp1).abs_diff(4_500_000) <= 1);
        rate.learn(&tp1, 1);
        assert!(rate.evaluation(&pp64).abs_diff(9_000_000) <= 1);
    }
}
