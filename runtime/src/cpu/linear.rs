//! Linear layers: `y = x Wᵀ (+ b)` with `W` `[out, in]` (optionally plus a residual and
//! followed by an activation or SwiGLU's gated product), and its data and weight gradients (the
//! data gradient optionally times an activation's derivative or through SwiGLU's backward), as
//! dense products (`dense`) on the current rayon pool; FP8 GEMMs on their emulated operands
//! (`fp8`), the group amaxes they share (`Fp8Amax`), delayed scaling's amax histories
//! (`Fp8AmaxRecord`, `Fp8HistoryRoll`) and operands quantized once for several GEMMs
//! (`Fp8Quantize`).
use super::args::{Inputs, Outputs};
use super::dense::{gemm_checked, Strided, Threads};
use super::elementwise::{
    activation, activation_bwd_in_place, add_in_place, swiglu as swiglu_fn, swiglu_bwd_in_place,
};
use super::fp8::{
    amax_into, dequantized, from_quantized, quantize_into, record_amax, roll_history,
};
use super::par::{accumulate_column_sums, rows_per_task};
use crate::error::Result;
use parc_compiler::ir::fp8::{
    operands, Along, Fp8AmaxAttrs, Fp8Gemm, Fp8Operand, Fp8QuantizeAttrs,
};
use parc_compiler::ir::op::Op;
use rayon::prelude::*;

/// The matmul family's entry point (see `dispatch`).
pub(crate) fn run(op: &Op, ins: &Inputs, outs: &mut Outputs, threads: Threads) -> Result<()> {
    let name = ins.name();
    let dims = |in_dim: u64, out_dim: u64| -> Result<(usize, usize)> {
        Ok((ins.dim("in_dim", in_dim)?, ins.dim("out_dim", out_dim)?))
    };
    match op {
        Op::Matmul {
            in_dim,
            out_dim,
            act,
            swiglu,
            fp8,
            ..
        } => {
            let (i, o) = dims(*in_dim, *out_dim)?;
            let (x, w, b) = (ins.f32("x")?, ins.f32("w")?, ins.optional_f32("b")?);
            let amax = [ins.optional_f32("x_amax")?, ins.optional_f32("w_amax")?];
            let q = [ins.optional_f32("xq")?, ins.optional_f32("wq")?];
            let [xq, wq] = quantized(*fp8, operands::forward, [(x, i), (w, i)], (amax, q))?;
            let (x, w) = (xq.as_deref().unwrap_or(x), wq.as_deref().unwrap_or(w));
            let y = outs.f32("y")?;
            // y = x Wᵀ + b, then + r (what an `Add` after it computes), then the activation
            // from y's f32 value (before a bf16 y is rounded).
            matmul(name, threads, i, o, x, w, b, y)?;
            if let Some(r) = ins.optional_f32("r")? {
                add_in_place(r, y);
            }
            if let Some(act) = act {
                activation(*act, y, outs.f32("a")?);
            }
            if *swiglu {
                // silu(gate) ⊙ y, from y's f32 value: what a `SwiGlu` after it computes.
                swiglu_fn(ins.f32("gate")?, y, outs.f32("a")?);
            }
        }
        Op::MatmulBwdData {
            in_dim,
            out_dim,
            accumulate,
            act_grad: act,
            swiglu,
            fp8,
        } => {
            let (i, o) = dims(*in_dim, *out_dim)?;
            if (act.is_some() || *swiglu) && *accumulate {
                return Err(ins.err(
                    "an activation-gradient product (act_grad, swiglu) cannot accumulate into \
                     dx (the verifier rejects it, E0822)",
                ));
            }
            let (dy, w) = (ins.f32("dy")?, ins.f32("w")?);
            let amax = [ins.optional_f32("dy_amax")?, ins.optional_f32("w_amax")?];
            let q = [ins.optional_f32("dyq")?, ins.optional_f32("wq")?];
            let [dyq, wq] = quantized(*fp8, operands::bwd_data, [(dy, o), (w, i)], (amax, q))?;
            let (dy, w) = (dyq.as_deref().unwrap_or(dy), wq.as_deref().unwrap_or(w));
            if *swiglu {
                // The product into dgate, then through `SwiGluBwd` from its f32 value.
                let dgate = outs.f32("dgate")?;
                matmul_bwd_data(name, threads, i, o, dy, w, dgate, false)?;
                let (gate, up) = (ins.f32("gate")?, ins.f32("up")?);
                swiglu_bwd_in_place(dgate, gate, up, outs.f32("dup")?);
                return Ok(());
            }
            let dx = outs.f32("dx")?;
            matmul_bwd_data(name, threads, i, o, dy, w, dx, *accumulate)?;
            if let Some(act) = act {
                // The product's f32 value times act'(pre), rounded once when dx is written.
                activation_bwd_in_place(*act, ins.f32("pre")?, dx);
            }
        }
        Op::MatmulBwdWeight {
            in_dim,
            out_dim,
            fp8,
            ..
        } => {
            let (i, o) = dims(*in_dim, *out_dim)?;
            let (dy, x) = (ins.f32("dy")?, ins.f32("x")?);
            let (dw, db) = (outs.accumulator("dw")?, outs.optional_accumulator("db")?);
            let amax = [ins.optional_f32("dy_amax")?, ins.optional_f32("x_amax")?];
            let q = [ins.optional_f32("dyq")?, ins.optional_f32("xq")?];
            let [dyq, xq] = quantized(*fp8, operands::bwd_weight, [(dy, o), (x, i)], (amax, q))?;
            // The bias gradient sums the exact dy; dW = dq(dy)ᵀ dq(x).
            let x = xq.as_deref().unwrap_or(x);
            match (dyq, db) {
                (Some(dyq), Some(db)) => {
                    matmul_bwd_weight(name, threads, i, o, &dyq, x, dw, None)?;
                    accumulate_column_sums(db, dy);
                }
                (dyq, db) => {
                    let dy = dyq.as_deref().unwrap_or(dy);
                    matmul_bwd_weight(name, threads, i, o, dy, x, dw, db)?;
                }
            }
        }
        Op::Fp8Amax(a) => fp8_amax(a, ins, outs)?,
        Op::Fp8Quantize(a) => fp8_quantize(a, ins, outs)?,
        Op::Fp8AmaxRecord(a) => {
            let cols = ins.dim("cols", a.cols)?;
            record_amax(ins.f32("x")?, cols, outs.f32("history")?)?;
        }
        Op::Fp8HistoryRoll(_) => {
            let amax = roll_history(outs.f32("history")?)?;
            match outs.f32("amax")? {
                [out] => *out = amax,
                other => {
                    return Err(ins.err(format!(
                        "writes its scale amax into {} values, not 1",
                        other.len()
                    )))
                }
            }
        }
        _ => return Err(ins.unrouted("matmul")),
    }
    Ok(())
}

/// With `fp8` set, the GEMM's two operands (each with its number of columns) quantized and
/// dequantized as `ir::fp8` defines, each from its reduced group amaxes or its delayed scale
/// amax where the op takes them (`amax`), else from its own; a `quantized` GEMM reads them
/// from their FP8 values (`q`, `Fp8Quantize`'s) instead (`None`s without `fp8`, and for a
/// delayed GEMM either of whose scale amaxes is 0: both operands are used as they are).
#[allow(clippy::type_complexity)]
fn quantized(
    fp8: Option<Fp8Gemm>,
    operands: fn(Fp8Gemm) -> [Fp8Operand; 2],
    data: [(&[f32], usize); 2],
    (amax, q): ([Option<&[f32]>; 2], [Option<&[f32]>; 2]),
) -> Result<[Option<Vec<f32>>; 2]> {
    let Some(g) = fp8 else {
        return Ok([None, None]);
    };
    // Delayed scaling: a GEMM one of whose operands' histories holds no amax yet (its scale
    // amax is 0) quantizes neither operand: it runs at the operands' stored precision.
    let empty = |amax: Option<&[f32]>| amax.is_some_and(|a| a == [0.0]);
    if g.history.is_some() && amax.iter().any(|a| empty(*a)) {
        return Ok([None, None]);
    }
    let of = operands(g);
    let one = |k: usize| -> Result<Option<Vec<f32>>> {
        let (values, cols) = data[k];
        let operand = of[k];
        if !g.quantized {
            return Ok(Some(dequantized(
                values,
                cols,
                (operand, g.scaling),
                amax[k],
            )?));
        }
        let (Some(q), Some(&[a])) = (q[k], amax[k]) else {
            return Err(crate::error::RuntimeError::Unsupported(format!(
                "a quantized FP8 GEMM lacks operand {k}'s FP8 values or its one scale amax"
            )));
        };
        let transposed = operand.along == Along::Rows;
        let shape = (values.len(), cols);
        Ok(Some(from_quantized(
            q,
            shape,
            (operand.format, a),
            transposed,
        )?))
    };
    Ok([one(0)?, one(1)?])
}

/// `Op::Fp8Quantize`: x quantized once into its FP8 layouts.
fn fp8_quantize(a: &Fp8QuantizeAttrs, ins: &Inputs, outs: &mut Outputs) -> Result<()> {
    let cols = ins.dim("cols", a.cols)?;
    let amax = match ins.f32("amax")? {
        [v] => *v,
        other => {
            return Err(ins.err(format!("reads {} scale amaxes, not 1", other.len())));
        }
    };
    let (q, qt) = (outs.optional_f32("q")?, outs.optional_f32("qt")?);
    quantize_into(ins.f32("x")?, cols, (a.format, amax), q, qt)
}

/// `Op::Fp8Amax`: the group amaxes of one FP8 GEMM operand.
fn fp8_amax(a: &Fp8AmaxAttrs, ins: &Inputs, outs: &mut Outputs) -> Result<()> {
    let cols = ins.dim("cols", a.cols)?;
    amax_into(
        ins.f32("x")?,
        cols,
        (a.operand, a.scaling),
        outs.f32("amax")?,
    )
}

/// `y = x Wᵀ (+ b)`: x `[rows, in]`, w `[out, in]`, b `[out]`, y `[rows, out]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    op: &str,
    threads: Threads,
    in_dim: usize,
    out_dim: usize,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    y: &mut [f32],
) -> Result<()> {
    let rows = x.len() / in_dim;
    gemm_checked(
        op,
        (y, Strided::row_major(rows, out_dim)),
        false,
        (x, Strided::row_major(rows, in_dim)),
        (w, Strided::transposed(in_dim, out_dim)),
        threads,
    )?;
    if let Some(b) = b {
        y.par_chunks_mut(out_dim)
            .with_min_len(rows_per_task(out_dim))
            .for_each(|row| {
                for (y, &b) in row.iter_mut().zip(b) {
                    *y += b;
                }
            });
    }
    Ok(())
}

/// `dx = dy W`, or with `accumulate` `dx += dy W`: dy `[rows, out]`, w `[out, in]`, dx
/// `[rows, in]`. Accumulating adds the finished product to each element once (the product is
/// formed apart first: the GEMM's own accumulation would add it in k-blocks), so the result
/// is bit-identical to an `Add` of the old dx and a separate product.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_bwd_data(
    op: &str,
    threads: Threads,
    in_dim: usize,
    out_dim: usize,
    dy: &[f32],
    w: &[f32],
    dx: &mut [f32],
    accumulate: bool,
) -> Result<()> {
    let rows = dy.len() / out_dim;
    let product_into = |out: &mut [f32]| {
        gemm_checked(
            op,
            (out, Strided::row_major(rows, in_dim)),
            false,
            (dy, Strided::row_major(rows, out_dim)),
            (w, Strided::row_major(out_dim, in_dim)),
            threads,
        )
    };
    if !accumulate {
        return product_into(dx);
    }
    let mut part = vec![0.0f32; dx.len()];
    product_into(&mut part)?;
    add_in_place(&part, dx);
    Ok(())
}

/// `dw += dyᵀ x`, `db += Σ_rows dy`: dy `[rows, out]`, x `[rows, in]`, dw `[out, in]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_bwd_weight(
    op: &str,
    threads: Threads,
    in_dim: usize,
    out_dim: usize,
    dy: &[f32],
    x: &[f32],
    dw: &mut [f32],
    db: Option<&mut [f32]>,
) -> Result<()> {
    let rows = dy.len() / out_dim;
    gemm_checked(
        op,
        (dw, Strided::row_major(out_dim, in_dim)),
        true,
        (dy, Strided::transposed(out_dim, rows)),
        (x, Strided::row_major(rows, in_dim)),
        threads,
    )?;
    if let Some(db) = db {
        accumulate_column_sums(db, dy);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use parc_compiler::ir::fp8::{Fp8Format, Fp8Scaling};

    fn gemm(history: Option<u32>) -> Fp8Gemm {
        Fp8Gemm {
            scaling: Fp8Scaling::Tensorwise,
            grad: Fp8Format::E5m2,
            split: Default::default(),
            history,
            quantized: false,
        }
    }

    #[test]
    fn a_delayed_gemm_with_an_empty_history_quantizes_neither_operand() {
        let (x, w) = ([0.3f32, -1.7, 2.2, 0.01], [1.1f32, 0.07, -0.6, 3.3]);
        let ops = [(&x[..], 2), (&w[..], 2)];
        let run = |g, amax: [f32; 2]| {
            let [a, b] = amax.map(|v| vec![v]);
            let amax = [Some(&a[..]), Some(&b[..])];
            quantized(Some(g), operands::forward, ops, (amax, [None, None])).unwrap()
        };
        // Either history empty: both operands as they are.
        assert_eq!(run(gemm(Some(4)), [4.0, 0.0]), [None, None]);
        assert_eq!(run(gemm(Some(4)), [0.0, 4.0]), [None, None]);
        // Both recorded: both quantized (0.01 is not an E4M3 value at x's scale).
        let [xq, wq] = run(gemm(Some(4)), [4.0, 4.0]);
        assert!(xq.is_some_and(|q| q[3] != x[3]) && wq.is_some());
        // Current scaling's reduced amax of 0 (an operand of zeros) is no history: quantized.
        assert!(run(gemm(None), [0.0, 4.0]).iter().all(Option::is_some));
    }

    /// A quantized GEMM reads its operands from `Fp8Quantize`'s values (a data gradient: dy
    /// along its columns, W transposed) and gets what quantizing them itself gives, bit for
    /// bit; its cold step (an empty history) runs on the unquantized operands as before.
    #[test]
    fn a_quantized_gemm_reads_what_it_would_have_quantized() {
        use super::super::fp8::quantize_into;
        let dy: Vec<f32> = (0..6).map(|i| (i as f32 - 2.5) * 0.37).collect();
        let w: Vec<f32> = (0..6).map(|i| 1.0 / (i as f32 + 0.3)).collect();
        let ops = [(&dy[..], 3), (&w[..], 3)];
        let amax = [vec![0.9f32], vec![3.3f32]];
        let amax = [Some(&amax[0][..]), Some(&amax[1][..])];
        let g = gemm(Some(4));
        let own = quantized(Some(g), operands::bwd_data, ops, (amax, [None, None])).unwrap();
        let (mut dyq, mut wqt) = (vec![0.0; 6], vec![0.0; 6]);
        quantize_into(&dy, 3, (Fp8Format::E5m2, 0.9), Some(&mut dyq), None).unwrap();
        quantize_into(&w, 3, (Fp8Format::E4m3, 3.3), None, Some(&mut wqt)).unwrap();
        let q = [Some(&dyq[..]), Some(&wqt[..])];
        let shared = Fp8Gemm {
            quantized: true,
            ..g
        };
        let read = quantized(Some(shared), operands::bwd_data, ops, (amax, q)).unwrap();
        assert_eq!(read, own);
        assert!(own.iter().all(Option::is_some));
        let zero = [vec![0.0f32], vec![3.3f32]];
        let cold = [Some(&zero[0][..]), Some(&zero[1][..])];
        let none = quantized(Some(shared), operands::bwd_data, ops, (cold, q)).unwrap();
        assert_eq!(none, [None, None]);
    }
}
