//! Deterministic data parallelism for the CPU kernels. Work is split into pieces whose boundaries
//! depend only on the problem size (never on the thread count), each piece is computed
//! sequentially, and partial results are combined in piece order — so every kernel returns
//! bit-identical results on 1 or 64 threads.
//!
//! Every parallel loop gives each rayon task at least [`TASK_ELEMENTS`] elements, so a loop over
//! a buffer of at most that size never splits: it runs on the calling thread without touching any
//! pool, which is what lets the backend run small ops inline (see `CpuBackend::compute`).
use rayon::prelude::*;

/// The least work (elements) per rayon task in every kernel.
pub(crate) const TASK_ELEMENTS: usize = 16_384;

/// Rows per partial sum in [`accumulate_rows`]: fixed, so the summation order is too.
const ROW_BLOCK: usize = 32;
/// Elements per partial sum in [`sum_chunks`].
const SUM_CHUNK: usize = 8192;

/// Rows per rayon task for row-parallel kernels over rows of `cols` elements: enough work per task
/// that scheduling costs stay small on tiny tensors.
pub(crate) fn rows_per_task(cols: usize) -> usize {
    (TASK_ELEMENTS / cols.max(1)).max(1)
}

/// `acc[j] += Σ_rows contribution[j]`, where `contribute(row, partial)` adds one row's
/// contribution into a zeroed f64 `partial` of `acc.len()` elements. Rows are summed in fixed
/// blocks in parallel, blocks combined in order.
pub(crate) fn accumulate_rows<F>(rows: usize, acc: &mut [f32], contribute: F)
where
    F: Fn(usize, &mut [f64]) + Sync,
{
    let width = acc.len();
    let partials: Vec<Vec<f64>> = (0..rows.div_ceil(ROW_BLOCK))
        .into_par_iter()
        .with_min_len(rows_per_task(ROW_BLOCK * width))
        .map(|block| {
            let mut partial = vec![0.0f64; width];
            for row in block * ROW_BLOCK..((block + 1) * ROW_BLOCK).min(rows) {
                contribute(row, &mut partial);
            }
            partial
        })
        .collect();
    let mut total = vec![0.0f64; width];
    for partial in partials {
        for (t, p) in total.iter_mut().zip(partial) {
            *t += p;
        }
    }
    for (a, t) in acc.iter_mut().zip(total) {
        *a = (f64::from(*a) + t) as f32;
    }
}

/// `acc[j] += Σ_rows m[row, j]` for a row-major `m` of rows of `acc.len()` elements (a bias
/// gradient: the column sums of the output gradient), summed as [`accumulate_rows`] does.
pub(crate) fn accumulate_column_sums(acc: &mut [f32], m: &[f32]) {
    let width = acc.len();
    accumulate_rows(m.len() / width.max(1), acc, |row, partial| {
        for (p, &g) in partial.iter_mut().zip(&m[row * width..(row + 1) * width]) {
            *p += f64::from(g);
        }
    });
}

/// `Σ_{i < len} term(i)` in f64, summed in fixed chunks in parallel and combined in order.
pub(crate) fn sum_chunks<F>(len: usize, term: F) -> f64
where
    F: Fn(usize) -> f64 + Sync,
{
    let partials: Vec<f64> = (0..len.div_ceil(SUM_CHUNK))
        .into_par_iter()
        .with_min_len(TASK_ELEMENTS.div_ceil(SUM_CHUNK))
        .map(|chunk| {
            (chunk * SUM_CHUNK..((chunk + 1) * SUM_CHUNK).min(len))
                .map(&term)
                .sum::<f64>()
        })
        .collect();
    partials.into_iter().sum()
}
