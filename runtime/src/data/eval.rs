//! The evaluation set of `train.eval`: which samples an evaluation reads, and which samples
//! training may read beside it ([`RunData`]).
//!
//! - An evaluation reads `batches` global batches of `G = dp × microbatches × micro_batch`
//!   samples, the same ones every time (so its values compare along a run and across plans):
//!   evaluation batch `b` is the consecutive samples `[first + b·G, first + (b+1)·G)` of its
//!   dataset, split among dp ranks and microbatches as a training batch is (dp rank `r`'s
//!   microbatch `j` is the slice starting at `(r·microbatches + j)·micro_batch`).
//! - Its own data (`train.eval.data`, or synthetic tokens of a seed of their own when training
//!   is synthetic): from sample 0; it must hold `batches × G` samples.
//! - Otherwise the **held-out tail** of the training data: its last `batches × G` samples
//!   (`first = n − batches·G`). Training's sampler then draws from the first `n − batches·G`
//!   samples only, so no evaluation target is ever a training target (the last training
//!   sample's final target is the first evaluation sample's first input, as consecutive samples
//!   always share one token). At least one global batch must be left to train on.
//! - Training data of fewer samples than one global batch is refused with or without
//!   evaluation ([`RunData::whole`]): a step would read samples twice, and `parc check` calls
//!   it E1001.
use super::sampler::BatchLayout;
use super::source::Dataset;
use crate::error::{Result, RuntimeError};
use parc_compiler::spec::{DataSource, Spec};
use std::sync::Arc;

/// The samples every evaluation reads.
#[derive(Clone, Debug)]
pub struct EvalSet {
    dataset: Arc<Dataset>,
    /// The first sample read.
    first: u64,
    batches: u64,
    layout: BatchLayout,
}

/// A run's data: the training dataset, how many of its samples (the first ones) training's
/// sampler draws from, and the evaluation set when the run evaluates.
#[derive(Clone, Debug)]
pub struct RunData {
    pub train: Arc<Dataset>,
    pub train_samples: u64,
    pub eval: Option<EvalSet>,
}

impl From<Arc<Dataset>> for RunData {
    /// Training on every sample of `train`, without evaluation.
    fn from(train: Arc<Dataset>) -> RunData {
        RunData {
            train_samples: train.num_samples(),
            train,
            eval: None,
        }
    }
}

/// The samples training draws from under `spec` when its training data holds `samples`: all of
/// them, less the held-out tail (`train.eval.batches` global batches) when it evaluates on the
/// training data (no evaluation data of its own, training data not synthetic), as
/// `exec::open_run_data` builds the [`RunData`]. For `parc check`, which counts the data's
/// tokens without opening it.
pub fn training_samples(spec: &Spec, samples: u64) -> u64 {
    match &spec.train.eval {
        Some(eval) if eval.data.is_none() && !matches!(spec.train.data, DataSource::Synthetic) => {
            samples.saturating_sub(eval.batches.saturating_mul(spec.train.global_batch))
        }
        _ => samples,
    }
}

impl RunData {
    /// Training on every sample of `train`, without evaluation; an error naming the data when
    /// it holds fewer samples than one global batch (synthetic data excepted: its stream is a
    /// fixed size, unrelated to any file), as `parc check`'s E1001 says.
    pub fn whole(train: Arc<Dataset>, layout: BatchLayout) -> Result<RunData> {
        enough_to_train(&train, layout)?;
        Ok(RunData::from(train))
    }

    /// Training on `train` without its last `batches` global batches, which become the
    /// evaluation set; an error naming the data when fewer than one global batch would be
    /// left to train on.
    pub fn held_out(train: Arc<Dataset>, batches: u64, layout: BatchLayout) -> Result<RunData> {
        let (n, g) = (train.num_samples(), layout.global_batch());
        let held = batches.saturating_mul(g);
        if n < held.saturating_add(g) {
            return Err(RuntimeError::Data(format!(
                "{}: its {n} samples of seq + 1 tokens cannot hold out train.eval.batches × \
                 global_batch = {batches} × {g} = {held} samples for evaluation and keep one \
                 global batch ({g}) to train on; lower `batches` in `train.eval`, or give \
                 evaluation data of its own (`eval = {{ every: …, data: \"val.bin\" as u16 }}`)",
                train.name()
            )));
        }
        let eval = EvalSet {
            dataset: Arc::clone(&train),
            first: n - held,
            batches,
            layout,
        };
        Ok(RunData {
            train,
            train_samples: n - held,
            eval: Some(eval),
        })
    }

    /// Training on all of `train`, evaluating on the first `batches` global batches of
    /// `eval`; an error naming `eval` when it holds fewer.
    pub fn separate(
        train: Arc<Dataset>,
        eval: Arc<Dataset>,
        batches: u64,
        layout: BatchLayout,
    ) -> Result<RunData> {
        enough_to_train(&train, layout)?;
        let (n, g) = (eval.num_samples(), layout.global_batch());
        if n < g {
            return Err(RuntimeError::Data(format!(
                "{}: the evaluation data holds {n} samples of seq + 1 tokens, fewer than one \
                 global batch ({g}); evaluation needs at least one: use more evaluation data",
                eval.name()
            )));
        }
        if n / g < batches {
            return Err(RuntimeError::Data(format!(
                "{}: the evaluation data holds {} global batches of {g} samples, fewer than \
                 train.eval.batches = {batches}; set `batches` to at most {} or use more data",
                eval.name(),
                n / g,
                n / g
            )));
        }
        Ok(RunData {
            train_samples: train.num_samples(),
            train,
            eval: Some(EvalSet {
                dataset: eval,
                first: 0,
                batches,
                layout,
            }),
        })
    }
}

/// An error naming `train` when it holds fewer samples than one global batch of `layout`.
fn enough_to_train(train: &Dataset, layout: BatchLayout) -> Result<()> {
    let (n, g) = (train.num_samples(), layout.global_batch());
    if train.is_synthetic() || n >= g {
        return Ok(());
    }
    let seq = train.seq();
    Err(RuntimeError::Data(format!(
        "`train.data`: {}: its {} tokens make {n} samples of seq + 1 = {} tokens, fewer than one global batch \
         of {g}: every step would read some samples twice (E1001); give at least {} tokens, or \
         lower `train.global_batch` to {}",
        train.name(),
        train.token_count(),
        seq + 1,
        g.saturating_mul(seq).saturating_add(1),
        n.max(1)
    )))
}

impl EvalSet {
    /// Global batches per evaluation.
    pub fn batches(&self) -> u64 {
        self.batches
    }

    pub fn dataset(&self) -> &Arc<Dataset> {
        &self.dataset
    }

    /// The samples of its dataset an evaluation reads, in order.
    pub fn samples(&self) -> std::ops::Range<u64> {
        self.first..self.first + self.batches * self.layout.global_batch()
    }

    /// The samples of dp rank `dp_rank`'s microbatch `microbatch` of evaluation batch `batch`.
    pub fn microbatch(&self, batch: u64, dp_rank: u32, microbatch: u32) -> Result<Vec<u64>> {
        let l = self.layout;
        let slice = l
            .slice_start(dp_rank, microbatch)
            .filter(|_| batch < self.batches);
        let Some(slice) = slice else {
            return Err(RuntimeError::Data(format!(
                "evaluation batch {batch}, dp rank {dp_rank}, microbatch {microbatch} is outside \
                 the evaluation set of {} batches of dp {} × {} microbatches (a lowering bug)",
                self.batches, l.dp, l.microbatches
            )));
        };
        let start = self.first + batch * l.global_batch() + slice;
        Ok((start..start + l.micro_batch).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Sampler;
    use std::collections::HashSet;

    fn layout(dp: u32, microbatches: u32, micro_batch: u64) -> BatchLayout {
        BatchLayout {
            dp,
            microbatches,
            micro_batch,
        }
    }

    /// `samples` samples of 4 tokens (seq 4), named `name`.
    fn dataset(name: &str, samples: u64) -> Arc<Dataset> {
        let tokens = (0..samples * 4 + 1).map(|t| (t % 50) as u32).collect();
        Arc::new(Dataset::from_tokens(name, tokens, 50, 4).unwrap())
    }

    #[test]
    fn training_never_reads_the_held_out_tail_which_every_evaluation_reads_whole() {
        let l = layout(2, 3, 2);
        let data = RunData::held_out(dataset("train.bin", 100), 3, l).unwrap();
        // 3 batches of 12 samples held out of 100.
        assert_eq!(data.train_samples, 64);
        let eval = data.eval.unwrap();
        assert_eq!(eval.samples(), 64..100);
        let mut sampler = Sampler::new(9, data.train_samples, l).unwrap();
        let mut trained = HashSet::new();
        for step in 0..50 {
            for r in 0..l.dp {
                for j in 0..l.microbatches {
                    trained.extend(sampler.microbatch(step, r, j).unwrap());
                }
            }
        }
        assert_eq!(trained.len(), 64, "every training sample is read");
        assert!(trained.iter().all(|&s| s < 64));
        let mut evaluated = Vec::new();
        for batch in 0..eval.batches() {
            for r in 0..l.dp {
                for j in 0..l.microbatches {
                    evaluated.extend(eval.microbatch(batch, r, j).unwrap());
                }
            }
        }
        assert_eq!(evaluated, (64..100).collect::<Vec<_>>());
        assert!(eval.microbatch(3, 0, 0).is_err());
    }

    #[test]
    fn any_split_of_the_global_batch_evaluates_the_same_samples() {
        let read = |l: BatchLayout| {
            let data = RunData::held_out(dataset("t", 60), 2, l).unwrap();
            let eval = data.eval.unwrap();
            let mut out = Vec::new();
            for batch in 0..2 {
                for r in 0..l.dp {
                    for j in 0..l.microbatches {
                        out.extend(eval.microbatch(batch, r, j).unwrap());
                    }
                }
            }
            out
        };
        let one = read(layout(1, 1, 12));
        for l in [layout(2, 3, 2), layout(4, 1, 3), layout(1, 4, 3)] {
            assert_eq!(read(l), one);
        }
    }

    #[test]
    fn a_tail_too_large_and_evaluation_data_too_short_are_errors_naming_the_data() {
        let l = layout(1, 2, 2);
        // 4 batches of 4 held out of 19 samples leave 3, fewer than a batch.
        let err = RunData::held_out(dataset("corpus.bin", 19), 4, l).unwrap_err();
        let err = err.to_string();
        assert!(
            err.contains("corpus.bin") && err.contains("4 × 4 = 16") && err.contains("batches"),
            "{err}"
        );
        assert!(RunData::held_out(dataset("corpus.bin", 20), 4, l).is_ok());
        let train = dataset("train.bin", 100);
        let err = RunData::separate(Arc::clone(&train), dataset("val.bin", 3), 1, l)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("val.bin") && err.contains("fewer than one global batch"),
            "{err}"
        );
        let err = RunData::separate(Arc::clone(&train), dataset("val.bin", 9), 3, l)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("val.bin") && err.contains("at most 2"),
            "{err}"
        );
        let data = RunData::separate(train, dataset("val.bin", 9), 2, l).unwrap();
        assert_eq!(data.train_samples, 100);
        assert_eq!(data.eval.unwrap().samples(), 0..8);
    }
}
