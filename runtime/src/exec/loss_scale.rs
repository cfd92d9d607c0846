//! fp16 loss scaling: the scaler each rank keeps (PyTorch's `GradScaler`, Megatron's
//! `DynamicGradScaler`, DeepSpeed's consecutive hysteresis).
//!
//! The ops do the arithmetic from `StepScalars::loss_scale` (`CeGrad` and the fused
//! `CrossEntropy` multiply the loss gradient by the scale, `ClipCoef` divides it back out of the
//! global gradient norm and of the update, and marks a step whose global squared norm is not
//! finite, after which `AdamW`/`Sgd` leave parameters and state untouched). This module only
//! decides the scale of the next step from whether this one overflowed. Every rank reads the
//! same global squared norm, so every rank's scaler makes the same decisions without talking to
//! the others.
//!
//! Rules (`precision = fp16 { loss_scale: … }` in the spec):
//! - static `N`: the scale is always `N`; an overflowing step is still skipped.
//! - `dynamic { init, window, hysteresis, min }`: start at `init`. An overflowing step counts
//!   one more *consecutive* overflow; from the `hysteresis`-th consecutive one on, each halves
//!   the scale (never below `min`). A clean step resets that count and counts one more clean
//!   step; after `window` clean steps in a row the scale doubles and the count restarts.
//!
//! A skipped step does not advance the optimizer's step count (Adam's bias correction), as in
//! PyTorch and Megatron, where `optimizer.step()` is not called; the learning-rate schedule
//! follows the training step, as in PyTorch's usual loop (the scheduler steps every iteration),
//! and the step's batch is consumed.
use crate::checkpoint::LossScaleState;
use crate::error::{Result, RuntimeError};
use parc_compiler::spec::{LossScale, Precision};

/// One rank's loss scaler. See the module docs for the rules.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    config: LossScale,
    scale: f64,
    /// Consecutive clean steps since the last overflow or growth.
    good_steps: u32,
    /// Consecutive overflowing steps.
    bad_steps: u32,
}

/// What loss scaling did in one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaleStep {
    /// The scale this step's loss gradient was multiplied by.
    pub scale: f64,
    /// The scale of the next step.
    pub next_scale: f64,
    /// The global gradient norm was not finite: parameters and optimizer state were left
    /// as they were.
    pub skipped: bool,
    /// The step overflowed where a dynamic scale could not be lowered any more: it was at its
    /// `min` and this overflow would have halved it. Scaling cannot make such gradients finite,
    /// so `train.on_nonfinite` decides (DeepSpeed raises at its minimum scale likewise), rather
    /// than every later step being skipped in silence.
    pub exhausted: bool,
}

impl LossScaler {
    /// The scaler of a run in `precision`: None unless it is fp16.
    pub fn for_precision(precision: Precision) -> Option<LossScaler> {
        let Precision::Fp16 { loss_scale } = precision else {
            return None;
        };
        let scale = match loss_scale {
            LossScale::Static { scale } => scale,
            LossScale::Dynamic { init, .. } => init,
        };
        Some(LossScaler {
            config: loss_scale,
            scale,
            good_steps: 0,
            bad_steps: 0,
        })
    }

    /// The scale of the next step.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Record whether the step just run at [`Self::scale`] overflowed, and choose the next
    /// scale.
    pub fn update(&mut self, overflow: bool) -> LossScaleStep {
        let used = self.scale;
        let mut exhausted = false;
        if let LossScale::Dynamic {
            window,
            hysteresis,
            min,
            ..
        } = self.config
        {
            if overflow {
                self.good_steps = 0;
                self.bad_steps = self.bad_steps.saturating_add(1);
                if self.bad_steps >= hysteresis {
                    exhausted = self.scale <= min;
                    self.scale = (self.scale / 2.0).max(min);
                }
            } else {
                self.bad_steps = 0;
                self.good_steps = self.good_steps.saturating_add(1);
                if self.good_steps >= window {
                    self.scale *= 2.0;
                    self.good_steps = 0;
                }
            }
        }
        LossScaleStep {
            scale: used,
            next_scale: self.scale,
            skipped: overflow,
            exhausted,
        }
    }

    /// The state a checkpoint keeps.
    pub fn state(&self) -> LossScaleState {
        LossScaleState {
            scale: self.scale,
            good_steps: self.good_steps,
            bad_steps: self.bad_steps,
        }
    }

    /// Continue from a checkpoint's state. A static scale stays the spec's (it may have been
    /// changed for the resumed run); a dynamic one continues where the checkpoint left it.
    pub fn restore(&mut self, state: LossScaleState) -> Result<()> {
        if !(state.scale.is_finite() && state.scale > 0.0) {
            return Err(RuntimeError::Checkpoint(format!(
                "the checkpoint's loss scale {} is not a positive number; the manifest is \
                 damaged (resume from another checkpoint)",
                state.scale
            )));
        }
        if matches!(self.config, LossScale::Dynamic { .. }) {
            self.scale = state.scale;
            self.good_steps = state.good_steps;
            self.bad_steps = state.bad_steps;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dynamic(init: f64, window: u32, hysteresis: u32, min: f64) -> LossScaler {
        LossScaler::for_precision(Precision::Fp16 {
            loss_scale: LossScale::Dynamic {
                init,
                window,
                hysteresis,
                min,
            },
        })
        .unwrap()
    }

    #[test]
    fn only_fp16_scales() {
        assert!(LossScaler::for_precision(Precision::Fp32).is_none());
        assert!(LossScaler::for_precision(Precision::Bf16).is_none());
    }

    #[test]
    fn hysteresis_delays_halving_until_consecutive_overflows() {
        let mut s = dynamic(65536.0, 1000, 2, 1.0);
        let first = s.update(true);
        assert_eq!(
            (first.scale, first.next_scale, first.skipped),
            (65536.0, 65536.0, true)
        );
        // A clean step in between resets the count.
        assert!(!s.update(false).skipped);
        assert_eq!(s.update(true).next_scale, 65536.0);
        assert_eq!(s.update(true).next_scale, 32768.0);
        // Every further consecutive overflow halves.
        assert_eq!(s.update(true).next_scale, 16384.0);
        assert_eq!(
            s.state(),
            LossScaleState {
                scale: 16384.0,
                good_steps: 0,
                bad_steps: 3
            }
        );
    }

    #[test]
    fn the_scale_never_drops_below_min() {
        let mut s = dynamic(8.0, 1000, 1, 2.0);
        let scales: Vec<f64> = (0..4).map(|_| s.update(true).next_scale).collect();
        assert_eq!(scales, [4.0, 2.0, 2.0, 2.0]);
    }

    #[test]
    fn an_overflow_that_cannot_lower_the_scale_is_exhausted() {
        let mut s = dynamic(4.0, 1000, 2, 2.0);
        let steps: Vec<(f64, bool)> = (0..5)
            .map(|_| s.update(true))
            .map(|u| (u.next_scale, u.exhausted))
            .collect();
        // 4 → 4 (hysteresis), 4 → 2, then at the minimum every overflow would halve it.
        assert_eq!(
            steps,
            [
                (4.0, false),
                (2.0, false),
                (2.0, true),
                (2.0, true),
                (2.0, true)
            ]
        );
        // A static scale is never exhausted: its overflows are skipped as before.
        let mut s = LossScaler::for_precision(Precision::Fp16 {
            loss_scale: LossScale::Static { scale: 1.0 },
        })
        .unwrap();
        assert!(!s.update(true).exhausted);
    }

    #[test]
    fn window_clean_steps_double_the_scale() {
        let mut s = dynamic(1024.0, 3, 2, 1.0);
        let scales: Vec<f64> = (0..7).map(|_| s.update(false).next_scale).collect();
        assert_eq!(
            scales,
            [1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0, 4096.0]
        );
        // An overflow restarts the window.
        s.update(true);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 4096.0);
        assert_eq!(s.update(false).next_scale, 8192.0);
    }

    #[test]
    fn a_static_scale_never_changes_but_overflows_still_skip() {
        let mut s = LossScaler::for_precision(Precision::Fp16 {
            loss_scale: LossScale::Static { scale: 1024.0 },
        })
        .unwrap();
        let step = s.update(true);
        assert!(step.skipped);
        assert_eq!((step.scale, step.next_scale), (1024.0, 1024.0));
        assert_eq!(s.update(false).next_scale, 1024.0);
        s.restore(LossScaleState {
            scale: 8.0,
            good_steps: 1,
            bad_steps: 0,
        })
        .unwrap();
        assert_eq!(s.scale(), 1024.0);
    }

    #[test]
    fn restore_continues_a_dynamic_scaler_and_rejects_damaged_state() {
        let mut s = dynamic(65536.0, 4, 2, 1.0);
        let saved = LossScaleState {
            scale: 512.0,
            good_steps: 3,
            bad_steps: 0,
        };
        s.restore(saved).unwrap();
        assert_eq!(s.state(), saved);
        assert_eq!(s.update(false).next_scale, 1024.0);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let err = s
                .restore(LossScaleState {
                    scale: bad,
                    ..saved
                })
                .unwrap_err()
                .to_string();
            assert!(err.contains("loss scale"), "{err}");
        }
    }
}
