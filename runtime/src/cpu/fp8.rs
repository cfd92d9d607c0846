//! FP8 emulation: a GEMM operand quantized to FP8 with its scale groups' power-of-two scales
//! and dequantized back to f32, exactly as `parc_compiler::ir::fp8` defines it. The linear
//! family runs its usual f32 product on these values, so an FP8 GEMM differs from the exact
//! product of the dequantized operands only by the order of f32 additions.

use crate::error::{Result, RuntimeError};
use float8::{F8E4M3, F8E5M2};
use parc_compiler::ir::fp8::{Along, Fp8Format, Fp8Operand, Fp8Scaling, OperandKind};
use rayon::prelude::*;

/// `data` (`[rows, cols]` row-major) quantized and dequantized as `operand` under `scaling`,
/// with its groups' amaxes given (`amax`: reduced over the ranks sharing them, `Op::Fp8Amax`)
/// or taken from `data` itself.
pub(crate) fn dequantized(
    data: &[f32],
    cols: usize,
    (operand, scaling): (Fp8Operand, Fp8Scaling),
    amax: Option<&[f32]>,
) -> Result<Vec<f32>> {
    let cols = cols.max(1);
    let rows = data.len() / cols;
    let groups = Groups::new(rows, cols, operand, scaling);
    let own;
    let amax = match amax {
        Some(a) => a,
        None => {
            own = group_amax(data, cols, &groups);
            &own
        }
    };
    if amax.len() != groups.count {
        return Err(RuntimeError::Unsupported(format!(
            "an FP8 operand [{rows}, {cols}] has {} {} scale groups, but its amax input holds {}",
            groups.count,
            scaling.name(),
            amax.len()
        )));
    }
    let scales: Vec<f32> = amax.iter().map(|&a| scale(a, operand.format)).collect();
    let mut out = data.to_vec();
    out.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        for (c, v) in row.iter_mut().enumerate() {
            *v = round_trip(*v, scales[groups.of(r, c)], operand.format);
        }
    });
    Ok(out)
}

/// `Op::Fp8Amax`: the largest finite magnitude of each scale group of `data` (`[rows, cols]`
/// row-major, `operand` under `scaling`) into `amax`, one value per group in group order.
pub(crate) fn amax_into(
    data: &[f32],
    cols: usize,
    (operand, scaling): (Fp8Operand, Fp8Scaling),
    amax: &mut [f32],
) -> Result<()> {
    let cols = cols.max(1);
    let groups = Groups::new(data.len() / cols, cols, operand, scaling);
    let found = group_amax(data, cols, &groups);
    if found.len() != amax.len() {
        return Err(RuntimeError::Unsupported(format!(
            "Fp8Amax: {} scale groups into an amax buffer of {}",
            found.len(),
            amax.len()
        )));
    }
    amax.copy_from_slice(&found);
    Ok(())
}

/// `Op::Fp8AmaxRecord`: the largest finite magnitude of `data` (`[rows, cols]`, one tensorwise
/// group) max-accumulated into the history's step amax (element 0).
pub(crate) fn record_amax(data: &[f32], cols: usize, history: &mut [f32]) -> Result<()> {
    let Some(step) = history.first_mut() else {
        return Err(RuntimeError::Unsupported(
            "Fp8AmaxRecord: an empty amax history".to_string(),
        ));
    };
    let cols = cols.max(1);
    let whole = Groups {
        row_block: data.len() / cols + 1,
        col_block: cols,
        per_row: 1,
        count: 1,
    };
    let found = group_amax(data, cols, &whole);
    *step = step.max(found.first().copied().unwrap_or(0.0));
    Ok(())
}

/// `Op::Fp8HistoryRoll`: `history` (the step's amax, then H steps newest first) rolled one step
/// (the step's amax becomes the newest, the oldest is dropped, the step slot is zeroed); the
/// rolled history's largest value, the next step's scale amax.
pub(crate) fn roll_history(history: &mut [f32]) -> Result<f32> {
    if history.len() < 2 {
        return Err(RuntimeError::Unsupported(format!(
            "Fp8HistoryRoll: an amax history of {} values has no step to keep",
            history.len()
        )));
    }
    history.copy_within(0..history.len() - 1, 1);
    history[0] = 0.0;
    Ok(history[1..].iter().copied().fold(0.0, f32::max))
}

/// The largest finite magnitude of each group, over row chunks in parallel (a maximum is exact
/// in any order, so the result does not depend on the chunking).
fn group_amax(data: &[f32], cols: usize, groups: &Groups) -> Vec<f32> {
    let rows_per_chunk = (1 << 16) / cols + 1;
    let merge = |mut a: Vec<f32>, b: Vec<f32>| {
        a.iter_mut().zip(b).for_each(|(x, y)| *x = x.max(y));
        a
    };
    data.par_chunks(cols * rows_per_chunk)
        .enumerate()
        .map(|(chunk, part)| {
            let mut amax = vec![0.0f32; groups.count];
            for (i, v) in part.iter().enumerate() {
                if v.is_finite() {
                    let r = chunk * rows_per_chunk + i / cols;
                    let g = &mut amax[groups.of(r, i % cols)];
                    *g = g.max(v.abs());
                }
            }
            amax
        })
        .reduce(|| vec![0.0f32; groups.count], merge)
}

/// The power-of-two scale of a group whose largest finite magnitude is `amax`:
/// `2^⌊log₂(max / amax)⌋` (from the exponent bits of the f32 quotient, not a logarithm, so any
/// backend gets it bit for bit), 1 for a group of zeros.
pub(crate) fn scale(amax: f32, format: Fp8Format) -> f32 {
    if amax.is_nan() || amax <= 0.0 {
        return 1.0;
    }
    let ratio = format.max() / amax;
    if ratio == 0.0 {
        return f32::from_bits(1 << 23); // 2^-126: amax beyond any finite scale
    }
    let exponent = ((ratio.to_bits() >> 23) & 0xff).clamp(1, 254);
    f32::from_bits(exponent << 23)
}

/// The f32 value of stored FP8 bits of `format` (exact): how the backends widen an FP8 buffer.
pub(crate) fn widen_fp8(bits: u8, format: Fp8Format) -> f32 {
    match format {
        Fp8Format::E4m3 => F8E4M3::from_bits(bits).to_f32(),
        Fp8Format::E5m2 => F8E5M2::from_bits(bits).to_f32(),
    }
}

/// `x` rounded to the nearest value of `format`, ties to even, saturating to its largest
/// finite value; a non-finite `x` becomes NaN (0x7f in both formats), as the CUDA kernels
/// store it (`kernels/fp8.cu`): how the backends write an FP8 buffer from f32 values.
pub(crate) fn round_fp8(x: f32, format: Fp8Format) -> u8 {
    if !x.is_finite() {
        return 0x7f;
    }
    match format {
        Fp8Format::E4m3 => F8E4M3::from_f32(x).to_bits(),
        Fp8Format::E5m2 => F8E5M2::from_f32(x).to_bits(),
    }
}

/// `v` scaled, rounded to `format` (nearest-even, saturating) and unscaled; non-finite values
/// pass through unchanged.
pub(crate) fn round_trip(v: f32, scale: f32, format: Fp8Format) -> f32 {
    if !v.is_finite() {
        return v;
    }
    quantize_value(v, scale, format) / scale
}

/// `fp8(v·scale)`, the stored FP8 value of `v` as an f32 (exact), for finite `v`; NaN for a
/// non-finite one (stored as 0x7f, as the CUDA kernels store it).
fn quantize_value(v: f32, scale: f32, format: Fp8Format) -> f32 {
    if !v.is_finite() {
        return f32::NAN;
    }
    match format {
        Fp8Format::E4m3 => F8E4M3::from_f32(v * scale).to_f32(),
        Fp8Format::E5m2 => F8E5M2::from_f32(v * scale).to_f32(),
    }
}

/// `Op::Fp8Quantize`: `data` (`[rows, cols]` row-major) quantized tensorwise with the scale
/// of `amax` into `q` (the same layout) and `qt` (`[cols, rows]`), each where given, as the
/// f32 values of the FP8 elements (the backend stores them as FP8, exactly).
pub(crate) fn quantize_into(
    data: &[f32],
    cols: usize,
    (format, amax): (Fp8Format, f32),
    q: Option<&mut [f32]>,
    qt: Option<&mut [f32]>,
) -> Result<()> {
    let cols = cols.max(1);
    let rows = data.len() / cols;
    let s = scale(amax, format);
    for out in [q.as_deref(), qt.as_deref()].into_iter().flatten() {
        if out.len() != data.len() {
            return Err(RuntimeError::Unsupported(format!(
                "Fp8Quantize: [{rows}, {cols}] into an output of {} elements",
                out.len()
            )));
        }
    }
    if let Some(q) = q {
        (q.par_iter_mut().zip(data.par_iter()))
            .for_each(|(o, &v)| *o = quantize_value(v, s, format));
    }
    if let Some(qt) = qt {
        qt.par_chunks_mut(rows.max(1))
            .enumerate()
            .for_each(|(c, line)| {
                for (r, o) in line.iter_mut().enumerate() {
                    *o = quantize_value(data[r * cols + c], s, format);
                }
            });
    }
    Ok(())
}

/// An operand of `rows × cols` (`len` elements, `cols` columns) read back from its FP8 values
/// `q` as `Fp8Quantize` wrote them (`transposed`: `[cols, rows]`), dequantized with the scale
/// of `amax`: for finite elements the values [`dequantized`] gives, bit for bit.
pub(crate) fn from_quantized(
    q: &[f32],
    (len, cols): (usize, usize),
    (format, amax): (Fp8Format, f32),
    transposed: bool,
) -> Result<Vec<f32>> {
    let cols = cols.max(1);
    let rows = len / cols;
    if q.len() != len {
        return Err(RuntimeError::Unsupported(format!(
            "a quantized FP8 operand of {} elements read as [{rows}, {cols}]",
            q.len()
        )));
    }
    let s = scale(amax, format);
    let mut out = vec![0.0f32; len];
    out.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        for (c, o) in row.iter_mut().enumerate() {
            let v = if transposed {
                q[c * rows + r]
            } else {
                q[r * cols + c]
            };
            *o = v / s;
        }
    });
    Ok(out)
}

/// The scale group of each element of a `[rows, cols]` operand.
struct Groups {
    /// Group index = (r / row_block) · per_row + c / col_block.
    row_block: usize,
    col_block: usize,
    per_row: usize,
    count: usize,
}

impl Groups {
    fn new(rows: usize, cols: usize, operand: Fp8Operand, scaling: Fp8Scaling) -> Groups {
        let (rows, cols) = (rows.max(1), cols.max(1));
        let (row_block, col_block) = match (scaling, operand.kind, operand.along) {
            (Fp8Scaling::Tensorwise, ..) => (rows, cols),
            (Fp8Scaling::Rowwise, _, Along::Cols) => (1, cols),
            (Fp8Scaling::Rowwise, _, Along::Rows) => (rows, 1),
            (Fp8Scaling::Blockwise { block }, OperandKind::Weight, _) => {
                (block as usize, block as usize)
            }
            (Fp8Scaling::Blockwise { block }, OperandKind::Tokens, Along::Cols) => {
                (1, block as usize)
            }
            (Fp8Scaling::Blockwise { block }, OperandKind::Tokens, Along::Rows) => {
                (block as usize, 1)
            }
        };
        let (row_block, col_block) = (row_block.max(1), col_block.max(1));
        let per_row = cols.div_ceil(col_block);
        Groups {
            row_block,
            col_block,
            per_row,
            count: rows.div_ceil(row_block) * per_row,
        }
    }

    fn of(&self, r: usize, c: usize) -> usize {
        (r / self.row_block) * self.per_row + c / self.col_block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dq(data: &[f32], cols: usize, operand: Fp8Operand, scaling: Fp8Scaling) -> Vec<f32> {
        dequantized(data, cols, (operand, scaling), None).unwrap()
    }

    fn operand(format: Fp8Format, kind: OperandKind, along: Along) -> Fp8Operand {
        Fp8Operand {
            format,
            kind,
            along,
        }
    }

    #[test]
    fn a_history_records_the_steps_largest_amax_and_rolls_it_in() {
        let mut h = vec![0.0f32; 4]; // step slot + 3 steps
        record_amax(&[1.0, -3.0, f32::INFINITY, 2.0], 2, &mut h).unwrap();
        record_amax(&[0.5, -2.5], 2, &mut h).unwrap();
        assert_eq!(h, [3.0, 0.0, 0.0, 0.0]);
        assert_eq!(roll_history(&mut h).unwrap(), 3.0);
        assert_eq!(h, [0.0, 3.0, 0.0, 0.0]);
        record_amax(&[1.0], 1, &mut h).unwrap();
        assert_eq!(roll_history(&mut h).unwrap(), 3.0);
        record_amax(&[2.0], 1, &mut h).unwrap();
        assert_eq!(roll_history(&mut h).unwrap(), 3.0);
        // The 3.0 leaves after three more steps.
        assert_eq!(roll_history(&mut h).unwrap(), 2.0);
        assert_eq!(h, [0.0, 0.0, 2.0, 1.0]);
        assert!(roll_history(&mut [0.0]).is_err());
    }

    #[test]
    fn scales_are_the_largest_powers_of_two_that_keep_amax_in_range() {
        // 448 / 1 = 448 → 256; 448 / 448 = 1 → 1; 448 / 500 < 1 → 0.5.
        assert_eq!(scale(1.0, Fp8Format::E4m3), 256.0);
        assert_eq!(scale(448.0, Fp8Format::E4m3), 1.0);
        assert_eq!(scale(500.0, Fp8Format::E4m3), 0.5);
        assert_eq!(scale(1.0, Fp8Format::E5m2), 32768.0);
        assert_eq!(scale(0.0, Fp8Format::E4m3), 1.0);
        assert_eq!(scale(f32::NAN, Fp8Format::E4m3), 1.0);
        assert!(scale(1e-30, Fp8Format::E4m3).is_finite());
        assert!(scale(f32::MAX, Fp8Format::E4m3) > 0.0);
    }

    #[test]
    fn round_trips_round_to_nearest_even_and_saturate() {
        // E4M3 has 3 mantissa bits: between 1 and 2 the step is 1/8.
        assert_eq!(round_trip(1.0625, 1.0, Fp8Format::E4m3), 1.0); // tie → even
        assert_eq!(round_trip(1.1875, 1.0, Fp8Format::E4m3), 1.25); // tie → even
        assert_eq!(round_trip(1.2, 1.0, Fp8Format::E4m3), 1.25);
        assert_eq!(round_trip(1000.0, 1.0, Fp8Format::E4m3), 448.0);
        assert_eq!(round_trip(-1e6, 1.0, Fp8Format::E5m2), -57344.0);
        // Scaled: 0.3 · 1024 = 307.2 → 320 (step 32 above 256) → 0.3125.
        assert_eq!(round_trip(0.3, 1024.0, Fp8Format::E4m3), 0.3125);
        assert!(round_trip(f32::INFINITY, 1.0, Fp8Format::E4m3).is_infinite());
        assert!(round_trip(f32::NAN, 1.0, Fp8Format::E4m3).is_nan());
    }

    #[test]
    fn groups_follow_the_scaling() {
        // A [2, 4] operand whose second row is 1000× the first.
        let data = [0.1, 0.2, 0.3, 0.4, 100.0, 200.0, 300.0, 400.0];
        let tokens = operand(Fp8Format::E4m3, OperandKind::Tokens, Along::Cols);
        // Rowwise along the columns: each row has its own scale, so the small row keeps
        // its precision (within E4M3's 2^-4 relative step).
        let rowwise = dq(&data, 4, tokens, Fp8Scaling::Rowwise);
        for (q, v) in rowwise.iter().zip(data) {
            assert!((q - v).abs() <= v * 0.0625, "{q} vs {v}");
        }
        // Tensorwise: one scale (from 400), the first row falls to a coarser grid.
        let tensorwise = dq(&data, 4, tokens, Fp8Scaling::Tensorwise);
        let s = scale(400.0, Fp8Format::E4m3);
        for (q, v) in tensorwise.iter().zip(data) {
            assert_eq!(*q, round_trip(v, s, Fp8Format::E4m3));
        }
        // Rowwise along the rows (a weight gradient's operands): one scale per column.
        let by_column = dq(
            &data,
            4,
            operand(Fp8Format::E4m3, OperandKind::Tokens, Along::Rows),
            Fp8Scaling::Rowwise,
        );
        for (i, (q, v)) in by_column.iter().zip(data).enumerate() {
            let s = scale(data[4 + i % 4], Fp8Format::E4m3);
            assert_eq!(*q, round_trip(v, s, Fp8Format::E4m3));
        }
    }

    #[test]
    fn blocks_are_tiles_for_tokens_and_squares_for_weights() {
        // [4, 4] with block 2: tokens along the columns in 1×2 tiles, weights in 2×2 squares.
        let data: Vec<f32> = (0..16).map(|i| 1.0 + i as f32 * 10.0).collect();
        let block = Fp8Scaling::Blockwise { block: 2 };
        let tiles = dq(
            &data,
            4,
            operand(Fp8Format::E4m3, OperandKind::Tokens, Along::Cols),
            block,
        );
        let squares = dq(
            &data,
            4,
            operand(Fp8Format::E4m3, OperandKind::Weight, Along::Cols),
            block,
        );
        for r in 0..4 {
            for c in 0..4 {
                let i = r * 4 + c;
                let tile = data[r * 4 + (c / 2) * 2 + 1];
                let square = data[((r / 2) * 2 + 1) * 4 + (c / 2) * 2 + 1];
                let f = Fp8Format::E4m3;
                assert_eq!(tiles[i], round_trip(data[i], scale(tile, f), f));
                assert_eq!(squares[i], round_trip(data[i], scale(square, f), f));
            }
        }
        // A weight's squares are the same read along the rows (the data gradient's view).
        let along_rows = dq(
            &data,
            4,
            operand(Fp8Format::E4m3, OperandKind::Weight, Along::Rows),
            block,
        );
        assert_eq!(along_rows, squares);
    }

    #[test]
    fn a_partial_last_block_is_its_own_group() {
        let data = [1.0, 1.0, 1.0, 300.0, 0.01];
        let q = dq(
            &data,
            5,
            operand(Fp8Format::E4m3, OperandKind::Tokens, Along::Cols),
            Fp8Scaling::Blockwise { block: 4 },
        );
        // The last element alone: scale from 0.01 keeps it close.
        assert!((q[4] - 0.01).abs() < 0.01 * 0.0625);
    }

    /// An operand split across two ranks: each piece's amaxes, max-reduced, give each piece
    /// the whole operand's scales, so the pieces quantize as the whole does.
    #[test]
    fn reduced_amaxes_give_every_piece_the_whole_operands_scales() {
        // [2, 4]: split by columns (tp of a row-parallel input) into two [2, 2] pieces.
        // The right half is tiny: its own amaxes would scale it far finer than the whole's.
        let data = [0.1, 100.0, 0.0003, 0.0005, 0.2, 200.0, 0.0002, 0.0007];
        let x = operand(Fp8Format::E4m3, OperandKind::Tokens, Along::Cols);
        for scaling in [Fp8Scaling::Tensorwise, Fp8Scaling::Rowwise] {
            let whole = dq(&data, 4, x, scaling);
            let pieces: Vec<Vec<f32>> = (0..2)
                .map(|p| {
                    data.chunks(2)
                        .skip(p)
                        .step_by(2)
                        .flatten()
                        .copied()
                        .collect()
                })
                .collect();
            let groups = x.groups(scaling, 2, 2) as usize;
            let mut reduced = vec![0.0f32; groups];
            for piece in &pieces {
                let mut amax = vec![0.0f32; groups];
                amax_into(piece, 2, (x, scaling), &mut amax).unwrap();
                reduced
                    .iter_mut()
                    .zip(amax)
                    .for_each(|(r, a)| *r = r.max(a));
            }
            for (p, piece) in pieces.iter().enumerate() {
                let q = dequantized(piece, 2, (x, scaling), Some(&reduced)).unwrap();
                let expect: Vec<f32> = whole
                    .chunks(2)
                    .skip(p)
                    .step_by(2)
                    .flatten()
                    .copied()
                    .collect();
                assert_eq!(q, expect, "{scaling:?} piece {p}");
                // The tiny piece's own amaxes would have given other numbers.
                if p == 1 {
                    assert_ne!(dq(piece, 2, x, scaling), expect, "{scaling:?} piece {p}");
                }
            }
        }
        let mut short = [0.0f32; 1];
        assert!(amax_into(&data, 4, (x, Fp8Scaling::Rowwise), &mut short).is_err());
        assert!(dequantized(&data, 4, (x, Fp8Scaling::Rowwise), Some(&short)).is_err());
    }
}
