//! Column sums over rows, deterministically: each chunk of rows writes its f64 partial sums per
//! column into the reduction scratch (`storage::program_needs` reserves at most 128 chunks a
//! column), then `add_partials` adds the chunks in order into the f32 output (or overwrites
//! it). The norms' weight gradients (`norm`) and the bias gradient of fp32 GEMMs (`matmul`)
//! reduce through it.
use super::args::{fv, n, p};
use super::kernel::Kernel;
use super::{Arg, Buf, CudaBackend};
use crate::error::Result;
use parc_compiler::memplan::REDUCTION_CHUNKS;

/// Rows of a column-partial reduction: enough chunks to fill the GPU, each of ≥ 64 rows.
fn chunking(rows: usize) -> (usize, usize) {
    let chunk_rows = rows.div_ceil(REDUCTION_CHUNKS as usize).max(64);
    (chunk_rows, rows.div_ceil(chunk_rows))
}

/// out[cols] (+= when `accumulate`, else overwritten) the column sums over `rows` rows that
/// the partial kernels `partial` (scalar, vector) compute from their `leading` arguments
/// (followed by the partials' pointer, rows, cols and rows per chunk). The vector kernel
/// (blocks of 32 × 8 threads, 256 columns of 8-element vectors each) runs where `cols` is a
/// multiple of 8 and every one of `operands` is 16-byte aligned, else the scalar one (a thread
/// per column); both write the same partials.
pub(super) fn column_sums(
    be: &mut CudaBackend,
    partial: (Kernel, Kernel),
    (leading, operands): (&[Arg], &[Buf]),
    (out, accumulate): (Buf, bool),
    rows: usize,
    cols: usize,
) -> Result<()> {
    let (chunk_rows, chunks) = chunking(rows);
    let part = be.scratch(chunks * cols * 8)?;
    let mut args = leading.to_vec();
    args.extend([Arg::Ptr(part), n(rows), n(cols), n(chunk_rows)]);
    let grid = (cols.div_ceil(256) as u32, chunks as u32, 1);
    let (scalar, vector) = partial;
    if cols.is_multiple_of(8) && operands.iter().all(|b| b.ptr % 16 == 0) {
        be.launch(vector, grid, (32, 8, 1), 0, &args)?;
    } else {
        be.launch(scalar, grid, (256, 1, 1), 0, &args)?;
    }
    be.launch(
        Kernel::AddPartials,
        (cols.div_ceil(256) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(part),
            p(out),
            n(cols),
            n(chunks),
            Arg::I32(i32::from(accumulate)),
        ],
    )
}

/// out[cols] (+= when `accumulate`, else overwritten) column sums of x[rows, cols].
pub(super) fn col_sum_into(
    be: &mut CudaBackend,
    x: Buf,
    out: (Buf, bool),
    rows: usize,
    cols: usize,
) -> Result<()> {
    let partial = (Kernel::ColSumPartial, Kernel::ColSumPartial8);
    column_sums(be, partial, (&[fv(x)], &[x]), out, rows, cols)
}
