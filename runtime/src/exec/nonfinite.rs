//! `train.on_nonfinite`: what a step whose loss or global gradient norm is not finite does in
//! a run without fp16 loss scaling (whose overflows stay the loss scaler's, see `loss_scale`).
//!
//! `ClipCoef` marks a step whose global squared gradient norm is not finite and the updates
//! skip it, so parameters and optimizer state stay those before the step. `stop` (the default)
//! then has every rank re-run that step with a check after each instruction
//! ([`RankExecutor::first_nonfinite`](super::rank::RankExecutor::first_nonfinite)) and ends the
//! run naming the step, the rank and the first instruction whose output was not finite;
//! `skip { max: N }` goes on without the update, at most N times in the run. Every rank reads
//! the same global norm, so all decide alike; a loss that is not finite beside a finite norm
//! (seen only where the loss is) stops that rank without a re-run, since its update was made.
use super::rank::{NonFiniteOutput, StepMetrics};
use crate::error::RuntimeError;
use parc_compiler::spec::OnNonFinite;

/// What the run does after a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Continue,
    /// The step's update was skipped (`skip { max }`); the run goes on.
    Skipped,
    /// Stop the run; with `rerun`, every rank re-runs the step to find the first op.
    Stop {
        rerun: bool,
    },
}

/// One rank's count of skipped steps under its `train.on_nonfinite`.
#[derive(Clone, Copy, Debug)]
pub struct NonFiniteGuard {
    policy: OnNonFinite,
    skipped: u64,
}

impl NonFiniteGuard {
    pub fn new(policy: OnNonFinite) -> NonFiniteGuard {
        NonFiniteGuard { policy, skipped: 0 }
    }

    /// Judge a step from what it left in the metric buffers.
    pub fn judge(&mut self, metrics: &StepMetrics) -> Verdict {
        if let Some(scaled) = metrics.loss_scale {
            // The loss scaler's overflow, unless the scale is at its minimum and still
            // overflows: then the policy decides as for any step that is not finite.
            if !scaled.exhausted {
                return Verdict::Continue;
            }
        }
        if update_not_made(metrics) {
            return match self.policy {
                OnNonFinite::Skip { max } if self.skipped < max => {
                    self.skipped += 1;
                    Verdict::Skipped
                }
                _ => Verdict::Stop { rerun: true },
            };
        }
        if metrics.loss.is_some_and(|l| !l.is_finite()) {
            return Verdict::Stop { rerun: false };
        }
        Verdict::Continue
    }

    /// The error that stops the run at 0-based `step` on `rank`, with what re-running the
    /// step found there (None: nothing, or no re-run).
    pub fn error(
        &self,
        step: u64,
        rank: u32,
        metrics: &StepMetrics,
        found: Option<NonFiniteOutput>,
    ) -> RuntimeError {
        let shown = |v: Option<f32>| v.map_or_else(|| "not on this rank".into(), |v| v.to_string());
        let mut values = format!(
            "step {} on rank {rank}: loss {}, global gradient norm {}",
            step + 1,
            shown(metrics.loss),
            shown(metrics.grad_sumsq.map(f32::sqrt)),
        );
        if let Some(scaled) = metrics.loss_scale.filter(|s| s.exhausted) {
            values.push_str(&format!(
                " at the fp16 loss scale's minimum {} (the scale cannot be lowered further, \
                 so skipping more steps would train nothing)",
                scaled.scale
            ));
        }
        let skipped_update = update_not_made(metrics);
        let skipped = match self.policy {
            OnNonFinite::Skip { max } => {
                format!(
                    " after skipping {} step(s) (train.on_nonfinite = skip {{ max: {max} }})",
                    self.skipped
                )
            }
            OnNonFinite::Stop => String::new(),
        };
        let advice = match self.policy {
            OnNonFinite::Stop => {
                "lower the learning rate or clip gradients (train.grad_clip), or let \
                 `train.on_nonfinite = skip { max: N }` skip such steps"
            }
            OnNonFinite::Skip { .. } => {
                "lower the learning rate or clip gradients (train.grad_clip), or raise \
                 `max` to skip more steps"
            }
        };
        if !skipped_update {
            return RuntimeError::NonFinite {
                message: format!(
                    "{values}; the gradient norm was finite, so the update was made; {advice}"
                ),
                origin: true,
            };
        }
        let Some(found) = found else {
            return RuntimeError::NonFinite {
                message: format!(
                    "{values}{skipped}; re-running the step with checks found no output on this \
                     rank that is not finite; {advice}"
                ),
                origin: false,
            };
        };
        let found_it = if found.held {
            format!(
                "the parameter `{}` already held {} of {} values that are not finite before the \
                 step, read first by `{}`: the weights it started from (train.init, a resumed \
                 checkpoint) or an earlier update made them so; check those weights or resume \
                 from an earlier checkpoint",
                found.buffer, found.count, found.len, found.instr
            )
        } else {
            let how = if found.computed {
                format!("is `{}`", found.instr)
            } else {
                format!("received it: {}", found.instr)
            };
            format!(
                "the first instruction whose output is not finite {how}, writing `{}` ({} of {} \
                 values); {advice}",
                found.buffer, found.count, found.len
            )
        };
        let message = format!(
            "{values}{skipped}; the parameters are those before the step (its update was \
             skipped). Re-run with checks, {found_it}"
        );
        // A held parameter counts as computed (`NonFiniteOutput::computed`): the origin.
        let origin = found.computed;
        RuntimeError::AtInstruction {
            rank,
            role: found.role,
            index: found.index,
            instr: found.instr.clone(),
            node: found.node,
            source: Box::new(RuntimeError::NonFinite { message, origin }),
        }
    }
}

/// Whether the step left parameters and optimizer state as they were: its gradient norm was not
/// finite, or in fp16 its loss scaler saw an overflow (which skips the update).
fn update_not_made(metrics: &StepMetrics) -> bool {
    metrics.update_skipped || metrics.loss_scale.is_some_and(|s| s.skipped)
}

/// Of the ranks' errors, the index of one whose re-run found where the values stopped being
/// finite (a compute instruction, not a transfer that brought them), if any.
pub fn origin(errors: &[RuntimeError]) -> Option<usize> {
    errors.iter().position(|e| match e {
        RuntimeError::AtInstruction { source, .. } => {
            matches!(**source, RuntimeError::NonFinite { origin: true, .. })
        }
        RuntimeError::NonFinite { origin, .. } => *origin,
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::loss_scale::LossScaleStep;

    fn metrics(loss: f32, sumsq: f32) -> StepMetrics {
        StepMetrics {
            loss: Some(loss),
            grad_sumsq: Some(sumsq),
            loss_scale: None,
            update_skipped: !sumsq.is_finite(),
        }
    }

    #[test]
    fn stop_stops_at_the_first_nonfinite_norm_and_a_finite_step_continues() {
        let mut guard = NonFiniteGuard::new(OnNonFinite::Stop);
        assert_eq!(guard.judge(&metrics(2.0, 4.0)), Verdict::Continue);
        assert_eq!(
            guard.judge(&metrics(2.0, f32::NAN)),
            Verdict::Stop { rerun: true }
        );
        // A loss that is not finite beside a finite norm: the update was made, no re-run.
        assert_eq!(
            guard.judge(&metrics(f32::INFINITY, 4.0)),
            Verdict::Stop { rerun: false }
        );
    }

    #[test]
    fn skip_skips_max_times_then_stops() {
        let mut guard = NonFiniteGuard::new(OnNonFinite::Skip { max: 2 });
        let bad = metrics(f32::NAN, f32::INFINITY);
        assert_eq!(guard.judge(&bad), Verdict::Skipped);
        assert_eq!(guard.judge(&metrics(2.0, 4.0)), Verdict::Continue);
        assert_eq!(guard.judge(&bad), Verdict::Skipped);
        assert_eq!(guard.judge(&bad), Verdict::Stop { rerun: true });
        let text = guard.error(7, 3, &bad, None).to_string();
        assert!(text.contains("step 8 on rank 3"), "{text}");
        assert!(text.contains("after skipping 2 step(s)"), "{text}");
        assert!(text.contains("raise `max`"), "{text}");
    }

    #[test]
    fn an_fp16_overflow_is_the_loss_scalers() {
        let mut guard = NonFiniteGuard::new(OnNonFinite::Stop);
        let mut overflow = metrics(2.0, f32::INFINITY);
        overflow.update_skipped = false;
        overflow.loss_scale = Some(LossScaleStep {
            scale: 65536.0,
            next_scale: 32768.0,
            skipped: true,
            exhausted: false,
        });
        assert_eq!(guard.judge(&overflow), Verdict::Continue);
    }

    #[test]
    fn an_fp16_overflow_at_the_minimum_scale_is_the_policys() {
        let mut overflow = metrics(f32::NAN, f32::INFINITY);
        overflow.update_skipped = false;
        overflow.loss_scale = Some(LossScaleStep {
            scale: 1.0,
            next_scale: 1.0,
            skipped: true,
            exhausted: true,
        });
        let mut guard = NonFiniteGuard::new(OnNonFinite::Stop);
        assert_eq!(guard.judge(&overflow), Verdict::Stop { rerun: true });
        let text = guard.error(4, 0, &overflow, None).to_string();
        assert!(
            text.contains("at the fp16 loss scale's minimum 1"),
            "{text}"
        );
        assert!(text.contains("re-running the step"), "{text}");
        let mut guard = NonFiniteGuard::new(OnNonFinite::Skip { max: 1 });
        assert_eq!(guard.judge(&overflow), Verdict::Skipped);
        assert_eq!(guard.judge(&overflow), Verdict::Stop { rerun: true });
    }

    #[test]
    fn the_origin_is_a_computed_value_not_a_received_one() {
        let at = |origin| RuntimeError::AtInstruction {
            rank: 1,
            role: "train".into(),
            index: 3,
            instr: "matmul".into(),
            node: None,
            source: Box::new(RuntimeError::NonFinite {
                message: String::new(),
                origin,
            }),
        };
        let errors = [
            RuntimeError::Comm("stopped because rank 1".into()),
            at(false),
            at(true),
        ];
        assert_eq!(origin(&errors), Some(2));
        assert_eq!(origin(&errors[..2]), None);
    }
}
