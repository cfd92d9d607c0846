//! The distributed sampler: which samples every data-parallel rank reads at every step.
//!
//! - Epoch `e` visits all `n` samples in a seeded random order (Fisher–Yates driven by a
//!   splitmix64 stream keyed by `(seed, e)`).
//! - The epochs' orders are concatenated into one stream; the global batch of step `k` is stream
//!   positions `[k·G, (k+1)·G)` with `G = dp × microbatches × micro_batch`. A batch may straddle
//!   two epochs; within an epoch no sample is dropped or repeated, whatever `G` and `n` are.
//! - dp rank `r`'s microbatch `j` is the fixed slice starting at `(r · microbatches + j) ·
//!   micro_batch` of the global batch, so any dp × microbatches split of the same `G` sees the
//!   same sequences at every step (what makes parallel plans comparable with one rank).
//!
//! The sampler's whole state is `(seed, samples, step)`: resuming at step `k` reproduces the
//! uninterrupted stream exactly.
use super::source::mix64;
use crate::error::{Result, RuntimeError};

/// How a global batch is split among data-parallel ranks and microbatches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLayout {
    pub dp: u32,
    pub microbatches: u32,
    pub micro_batch: u64,
}

impl BatchLayout {
    /// Sequences per step over all ranks.
    pub fn global_batch(&self) -> u64 {
        u64::from(self.dp) * u64::from(self.microbatches) * self.micro_batch
    }

    /// Where dp rank `dp_rank`'s microbatch `microbatch` starts within a global batch: the
    /// fixed slice `(dp_rank · microbatches + microbatch) · micro_batch`; None outside the
    /// layout.
    pub fn slice_start(&self, dp_rank: u32, microbatch: u32) -> Option<u64> {
        (dp_rank < self.dp && microbatch < self.microbatches).then(|| {
            (u64::from(dp_rank) * u64::from(self.microbatches) + u64::from(microbatch))
                * self.micro_batch
        })
    }
}

/// How much of one epoch the steps so far have read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpochProgress {
    pub epoch: u64,
    /// Distinct samples of this epoch read so far.
    pub seen: u64,
    /// Samples in an epoch.
    pub total: u64,
}

/// Seeded per-epoch permutations of `samples` sample indices, cut into global batches.
#[derive(Clone, Debug)]
pub struct Sampler {
    seed: u64,
    samples: u64,
    layout: BatchLayout,
    /// The most recently built epoch order (epoch, permutation): batches read at most two
    /// epochs, so rebuilding on a change is cheap.
    cached: Option<(u64, Vec<u64>)>,
    /// (step, stream position) the batches count from: (0, 0), or where a run resumed under
    /// another global batch continues (`resume_at`).
    origin: (u64, u64),
}

impl Sampler {
    pub fn new(seed: u64, samples: u64, layout: BatchLayout) -> Result<Sampler> {
        if samples == 0 {
            return Err(RuntimeError::Data(
                "the dataset has no samples; use more data or a shorter `seq`".to_string(),
            ));
        }
        if layout.global_batch() == 0 {
            return Err(RuntimeError::Data(format!(
                "a global batch of dp {} × microbatches {} × micro_batch {} = 0 sequences; \
                 every factor must be at least 1",
                layout.dp, layout.microbatches, layout.micro_batch
            )));
        }
        Ok(Sampler {
            seed,
            samples,
            layout,
            cached: None,
            origin: (0, 0),
        })
    }

    /// Continue at step `step` from stream position `position` (the samples a resumed run's
    /// checkpoint had seen): steps from there read consecutive global batches of this layout.
    /// At `position = step · global_batch` nothing changes.
    pub fn resume_at(&mut self, step: u64, position: u64) {
        self.origin = (step, position);
    }

    /// The stream position where 0-based `step` starts: samples seen after `step` steps.
    pub fn position(&self, step: u64) -> u64 {
        let (origin_step, origin) = self.origin;
        let g = self.layout.global_batch();
        match step.checked_sub(origin_step) {
            Some(after) => origin + after * g,
            None => origin.saturating_sub((origin_step - step) * g),
        }
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    pub fn layout(&self) -> BatchLayout {
        self.layout
    }

    /// The order in which epoch `epoch` visits the samples.
    pub fn epoch_order(&self, epoch: u64) -> Vec<u64> {
        let mut order: Vec<u64> = (0..self.samples).collect();
        let mut state = mix64(self.seed ^ 0x5a3b_1e00_0000_0000) ^ mix64(epoch.wrapping_add(1));
        let mut next = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            mix64(state)
        };
        for i in (1..order.len()).rev() {
            // Multiply-shift maps 64 random bits onto [0, i] with negligible bias.
            let j = ((u128::from(next()) * (i as u128 + 1)) >> 64) as usize;
            order.swap(i, j);
        }
        order
    }

    /// Sample at position `position` of the concatenated epoch stream.
    fn at(&mut self, position: u64) -> u64 {
        let epoch = position / self.samples;
        let index = (position % self.samples) as usize;
        if self.cached.as_ref().map(|(e, _)| *e) != Some(epoch) {
            self.cached = Some((epoch, self.epoch_order(epoch)));
        }
        self.cached
            .as_ref()
            .and_then(|(_, order)| order.get(index).copied())
            .unwrap_or(0)
    }

    /// The global batch of 0-based `step`, in stream order.
    pub fn global_batch(&mut self, step: u64) -> Vec<u64> {
        let start = self.position(step);
        (start..start + self.layout.global_batch())
            .map(|p| self.at(p))
            .collect()
    }

    /// The samples of dp rank `dp_rank`'s microbatch `microbatch` at `step`.
    pub fn microbatch(&mut self, step: u64, dp_rank: u32, microbatch: u32) -> Result<Vec<u64>> {
        let l = self.layout;
        let Some(slice) = l.slice_start(dp_rank, microbatch) else {
            return Err(RuntimeError::Data(format!(
                "dp rank {dp_rank} microbatch {microbatch} is outside the batch layout of dp {} \
                 × {} microbatches (a lowering bug)",
                l.dp, l.microbatches
            )));
        };
        let start = self.position(step) + slice;
        Ok((start..start + l.micro_batch).map(|p| self.at(p)).collect())
    }

    /// Samples seen per epoch after `steps` steps: every epoch touched so far, the last one
    /// possibly partial.
    pub fn progress(&self, steps: u64) -> Vec<EpochProgress> {
        let read = self.position(steps);
        let epochs = read.div_ceil(self.samples);
        (0..epochs)
            .map(|epoch| EpochProgress {
                epoch,
                seen: (read - epoch * self.samples).min(self.samples),
                total: self.samples,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn layout(dp: u32, microbatches: u32, micro_batch: u64) -> BatchLayout {
        BatchLayout {
            dp,
            microbatches,
            micro_batch,
        }
    }

    /// Read `steps` steps through every rank's microbatches, in stream order.
    fn read_all(sampler: &mut Sampler, steps: u64) -> Vec<u64> {
        let l = sampler.layout();
        let mut out = Vec::new();
        for step in 0..steps {
            for r in 0..l.dp {
                for j in 0..l.microbatches {
                    out.extend(sampler.microbatch(step, r, j).unwrap());
                }
            }
        }
        out
    }

    #[test]
    fn every_epoch_is_a_permutation_even_when_world_sizes_do_not_divide_it() {
        for (samples, l) in [
            (97, layout(3, 2, 5)),
            (10, layout(4, 1, 3)),
            (7, layout(2, 3, 2)),
            (1, layout(2, 1, 1)),
        ] {
            let mut sampler = Sampler::new(42, samples, l).unwrap();
            let steps = 3 * samples / l.global_batch() + 2;
            let stream = read_all(&mut sampler, steps);
            for epoch in stream.chunks(samples as usize) {
                let distinct: HashSet<_> = epoch.iter().collect();
                assert_eq!(distinct.len(), epoch.len(), "duplicate within an epoch");
                assert!(epoch.iter().all(|&s| s < samples));
            }
            let full_epochs = stream.len() as u64 / samples;
            assert!(full_epochs >= 3);
            let progress = sampler.progress(steps);
            assert_eq!(
                progress.len() as u64,
                stream.len().div_ceil(samples as usize) as u64
            );
            assert!(progress[..full_epochs as usize]
                .iter()
                .all(|p| p.seen == samples && p.total == samples));
        }
    }

    #[test]
    fn any_split_of_the_global_batch_reads_the_same_sequences() {
        let mut one = Sampler::new(7, 50, layout(1, 1, 12)).unwrap();
        for l in [
            layout(2, 3, 2),
            layout(4, 1, 3),
            layout(1, 4, 3),
            layout(3, 2, 2),
        ] {
            let mut split = Sampler::new(7, 50, l).unwrap();
            for step in 0..10 {
                let whole = one.global_batch(step);
                let mut parts = Vec::new();
                for r in 0..l.dp {
                    for j in 0..l.microbatches {
                        parts.extend(split.microbatch(step, r, j).unwrap());
                    }
                }
                assert_eq!(parts, whole, "step {step} with {l:?}");
            }
        }
    }

    #[test]
    fn orders_depend_on_seed_and_epoch_and_resume_reproduces_them() {
        let s = Sampler::new(1, 1000, layout(1, 1, 10)).unwrap();
        assert_ne!(s.epoch_order(0), s.epoch_order(1));
        let t = Sampler::new(2, 1000, layout(1, 1, 10)).unwrap();
        assert_ne!(s.epoch_order(0), t.epoch_order(0));
        assert_ne!(s.epoch_order(0), (0..1000).collect::<Vec<_>>());
        // A fresh sampler asked for step 150 (epoch 1) gives what the continuous one gave.
        let mut continuous = Sampler::new(1, 1000, layout(2, 1, 5)).unwrap();
        let expected: Vec<_> = (0..160).map(|k| continuous.global_batch(k)).collect();
        let mut resumed = Sampler::new(1, 1000, layout(2, 1, 5)).unwrap();
        assert_eq!(resumed.global_batch(150), expected[150]);
    }

    #[test]
    fn progress_counts_partial_epochs_and_bad_layouts_are_errors() {
        let s = Sampler::new(0, 10, layout(1, 1, 4)).unwrap();
        let p = s.progress(3);
        assert_eq!(
            p.iter().map(|e| (e.epoch, e.seen)).collect::<Vec<_>>(),
            [(0, 10), (1, 2)]
        );
        assert!(Sampler::new(0, 0, layout(1, 1, 1)).is_err());
        assert!(Sampler::new(0, 5, layout(1, 0, 1)).is_err());
        let mut s = Sampler::new(0, 5, layout(2, 1, 1)).unwrap();
        assert!(s.microbatch(0, 2, 0).is_err());
    }
}
