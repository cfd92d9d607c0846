//! The GEMM ops (`Matmul`, `MatmulBwdData`, `MatmulBwdWeight`) on cuBLASLt: how each maps onto
//! a column-major GEMM (a row-major `[r, c]` matrix is a column-major `c × r` one with leading
//! dimension `c`), which epilogue adds its bias or computes its bias gradient, and what is done
//! where cuBLASLt offers no such epilogue. Activation operands and outputs are f32 or bf16
//! (`Float`), weights, biases and their gradients f32; `gemm_operands` feeds the operands.
//!
//! Bias: the forward adds b in the epilogue (fp32 values; with a bf16 output where cuBLASLt
//! takes no fp32 bias there, b's bf16 cast), else (f32 output) y = b first and the product
//! accumulated onto it. Bias gradient in a 16-bit run: cuBLASLt's BGRADB epilogue on the
//! backward-weight GEMM writes the column sums of dy into a scratch vector, then a k = 1 fp32
//! GEMM adds that into db (`db = t·1 + db`, exact as an add: db is +=); where the epilogue is
//! not offered, and in fp32 runs, a column-sum kernel (`columns::col_sum_into`).
//!
//! Fused residual: a forward with `residual` reads r as the GEMM's C (beta = 1, D = y, or with
//! a fused activation D = a) where r has D's type; otherwise the GEMM writes y and the
//! `add_fwd` kernel adds r in place.
//!
//! Fused activations: a forward with `act` gelu_tanh runs the GELU epilogue (D = the
//! activation, the pre-activation y its auxiliary output), a backward-data product with
//! `act_grad` gelu_tanh and a bf16 dx the DGELU epilogue (the saved pre-activation its
//! auxiliary input); both need the auxiliary matrix in D's type. Otherwise, or where cuBLASLt refuses, the GEMM
//! writes y (dx) as without, then the `activation_fwd` (`activation_bwd`, in place on dx)
//! kernel runs.
//!
//! SwiGLU: a forward with `swiglu` (the up projection) writes u and a = silu(gate) ⊙ u, a
//! backward-data product with `swiglu` (the down projection) dgate and dup: the GEMM writes u
//! (the product into dgate) and elementwise.cu's SwiGLU kernel runs after it (cuBLASLt has no
//! such epilogue; parc's GEMM kernel forming them in its own lost to this on Llama 3.2 1B on an
//! H200, 64.3k against 67.6k tokens/s, 2026-12-06, and was removed).
use super::args::{fv, n, p, Bound, Limits};
use super::columns::col_sum_into;
use super::epilogue::{
    activation_grad_in_place, residual_then_activation, swiglu_apart, swiglu_grad,
};
use super::gemm::{Epilogue, Gemm, Operands, Output};
use super::gemm_operands::Operand;
use super::kernel::Kernel;
use super::{Buf, CudaBackend};
use crate::error::Result;
use cudarc::driver::sys::CUdeviceptr;
use parc_compiler::ir::op::{Act, Op};
use parc_compiler::ir::DType;

/// The GEMM output type of buffer `b` (a `Float` output).
fn output(b: Buf) -> Output {
    match b.dtype {
        DType::Bf16 => Output::Bf16,
        _ => Output::F32,
    }
}

fn activation(buf: Buf) -> Operand {
    Operand { buf, weight: false }
}

fn weight(buf: Buf) -> Operand {
    Operand { buf, weight: true }
}

/// Run an op of the matmul family.
pub(super) fn run(be: &mut CudaBackend, b: &Bound) -> Result<()> {
    match b.op {
        Op::Fp8Amax(a) => return super::fp8::amax(be, b, a),
        Op::Fp8AmaxRecord(a) => return be.record_amax(b, a),
        Op::Fp8HistoryRoll(_) => return super::fp8::roll(be, b),
        Op::Fp8Quantize(a) => return super::fp8_quantize::quantize_op(be, b, a),
        _ => {}
    }
    let (in_dim, out_dim) = match *b.op {
        Op::Matmul {
            in_dim: i,
            out_dim: o,
            ..
        }
        | Op::MatmulBwdData {
            in_dim: i,
            out_dim: o,
            ..
        }
        | Op::MatmulBwdWeight {
            in_dim: i,
            out_dim: o,
            ..
        } => (i, o),
        _ => return Err(b.err("is not a GEMM op")),
    };
    let k_in = b.launch_dim("in_dim", in_dim)?;
    let m_out = b.launch_dim("out_dim", out_dim)?;
    // Input 0 holds the rows: x for the forward, dy for the backwards.
    let rows_of = b.input(0)?;
    let what = if matches!(b.op, Op::Matmul { .. }) {
        "x"
    } else {
        "dy"
    };
    let dims = (b.launch_rows(rows_of, what, b.rows)?, k_in, m_out);
    if let Op::MatmulBwdData {
        act_grad: Some(_),
        accumulate: true,
        ..
    } = *b.op
    {
        return Err(b.err(
            "an activation-gradient product (act_grad) cannot accumulate into dx (the \
             verifier rejects it, E0822)",
        ));
    }
    // A delayed-scaling GEMM with an empty history runs as the plain GEMM below, its
    // operands' records launched on their own.
    if let Some(fp8) = b.op.fp8() {
        if !super::fp8::delayed_cold(be, b, fp8)? {
            return super::fp8::run(be, b, fp8, dims);
        }
        be.flush_records(true)?;
    }
    match *b.op {
        Op::Matmul {
            bias,
            act,
            residual,
            swiglu,
            ..
        } => {
            let bb = bias.then(|| b.input(2)).transpose()?;
            let r = residual
                .then(|| b.input(2 + usize::from(bias)))
                .transpose()?;
            let a = (act.is_some() || swiglu).then(|| b.output(1)).transpose()?;
            let gate = swiglu
                .then(|| b.input(2 + usize::from(bias) + usize::from(residual)))
                .transpose()?;
            let forward = Forward {
                x: rows_of,
                w: b.input(1)?,
                bb,
                r,
                y: b.output(0)?,
                act: act.zip(a),
                swiglu: gate.zip(a),
            };
            matmul(be, b, &forward, dims)
        }
        Op::MatmulBwdData { swiglu: true, .. } => {
            let (w, gate, up) = (b.input(1)?, b.input(2)?, b.input(3)?);
            let (dgate, dup) = (b.output(0)?, b.output(1)?);
            swiglu_backward_data(be, (rows_of, w), (gate, up), (dgate, dup), dims)
        }
        Op::MatmulBwdData {
            accumulate,
            act_grad,
            ..
        } => {
            let act_grad = act_grad.map(|act| Ok((act, b.input(2)?))).transpose()?;
            let (w, dx) = (b.input(1)?, b.output(0)?);
            backward_data(be, (rows_of, w, dx), act_grad, accumulate, dims)
        }
        Op::MatmulBwdWeight {
            bias,
            accumulate_param_grad,
            ..
        } => {
            let (x, dw) = (b.input(1)?, b.output(0)?);
            let db = bias.then(|| b.output(1)).transpose()?;
            backward_weight(be, (rows_of, x, dw, db), accumulate_param_grad, dims)
        }
        _ => Err(b.err("is not a GEMM op")),
    }
}

/// A GEMM's rows, its input width and its output width.
type Dims = (usize, usize, usize);

/// D (m × n, column-major, leading dimension m) = op(A) · op(B), added onto D where
/// `accumulate`, with A and B stored dense (leading dimension k, or m where A is not
/// transposed; k, or n where B is transposed), no epilogue: every GEMM of the matmul ops.
fn dense_gemm(
    (trans_a, trans_b): (bool, bool),
    (m, n, k): (usize, usize, usize),
    (a, b, d): (CUdeviceptr, CUdeviceptr, CUdeviceptr),
    accumulate: bool,
    out: Output,
) -> Gemm {
    Gemm {
        trans_a,
        trans_b,
        m: m as u64,
        n: n as u64,
        k: k as u64,
        a,
        lda: (if trans_a { k } else { m }) as i64,
        b,
        ldb: (if trans_b { n } else { k }) as i64,
        c: d,
        ldc: m as i64,
        c_in: None,
        beta: if accumulate { 1.0 } else { 0.0 },
        out,
        epilogue: Epilogue::None,
    }
}

/// A `Matmul`'s operands: x, w, the bias and residual where it has them; y, and the
/// activation with its output `a` where it fuses one; the gate and `a` with `swiglu`.
struct Forward {
    x: Buf,
    w: Buf,
    bb: Option<Buf>,
    r: Option<Buf>,
    y: Buf,
    act: Option<(Act, Buf)>,
    swiglu: Option<(Buf, Buf)>,
}

/// y = x·Wᵀ (+ b) (+ r), then a = act(y): `rows` rows of `k` into `m` columns.
fn matmul(be: &mut CudaBackend, b: &Bound, f: &Forward, (rows, k, m): Dims) -> Result<()> {
    let Forward { x, w, bb, r, y, .. } = *f;
    // yᵀ (m × rows) = W (m × k, stored k × m) · xᵀ (k × rows) (+ b per row of yᵀ).
    let g = dense_gemm(
        (true, false),
        (m, rows, k),
        (w.ptr, x.ptr, y.ptr),
        false,
        output(y),
    );
    if let Some((gate, a)) = f.swiglu {
        // The verifier keeps a SwiGLU product free of bias, residual and activation (E0822).
        return swiglu_forward(be, &g, (w, x), gate, (y, a));
    }
    let a = f.act.map(|(_, a)| a);
    // The residual as the GEMM's C (beta = 1) beside a D of its type.
    let d = a.unwrap_or(y);
    let with_r = match r {
        Some(r) if r.dtype == d.dtype => Some(Gemm {
            c_in: Some(r.ptr),
            beta: 1.0,
            ..g
        }),
        _ => None,
    };
    let fused = match f.act {
        Some((Act::GeluTanh, a)) if a.dtype == y.dtype && r.is_none_or(|_| with_r.is_some()) => {
            gelu_epilogue(be, &with_r.unwrap_or(g), (w, x), bb, (y, a))?
        }
        None => match with_r {
            Some(gr) => residual_epilogue(be, &gr, (w, x), bb)?,
            None => false,
        },
        _ => false,
    };
    if fused {
        return Ok(());
    }
    // Without a fused form: y as without a residual, y += r (an `Add`), then a =
    // act(y) from y as stored (a bf16 y is rounded before each step reads it).
    matmul_bias(be, b, &g, (w, x), bb, y, rows)?;
    residual_then_activation(be, y, r, f.act)
}

/// u = x·Wᵀ (`g` writes u), then a = silu(gate) ⊙ u.
fn swiglu_forward(
    be: &mut CudaBackend,
    g: &Gemm,
    (w, x): (Buf, Buf),
    gate: Buf,
    (u, a): (Buf, Buf),
) -> Result<()> {
    be.gemm(g, weight(w), activation(x))?;
    swiglu_apart(be, gate, u, a)
}

/// dgate and dup from the product p = dy·W (the down projection's data gradient) through
/// SwiGLU's backward: the GEMM writes p into dgate and the SwiGLU-gradient kernel runs in place.
fn swiglu_backward_data(
    be: &mut CudaBackend,
    (dy, w): (Buf, Buf),
    (gate, up): (Buf, Buf),
    (dgate, dup): (Buf, Buf),
    (rows, k_in, m_out): Dims,
) -> Result<()> {
    let (shape, ptrs) = ((k_in, rows, m_out), (w.ptr, dy.ptr, dgate.ptr));
    let g = dense_gemm((false, false), shape, ptrs, false, output(dgate));
    be.gemm(&g, weight(w), activation(dy))?;
    swiglu_grad(be, dgate, (gate, up), (dgate, dup))
}

/// dx (+)= dy·W, then dx = dx ⊙ act'(pre) where the op has an activation gradient.
fn backward_data(
    be: &mut CudaBackend,
    (dy, w, dx): (Buf, Buf, Buf),
    act_grad: Option<(Act, Buf)>,
    accumulate: bool,
    (rows, k_in, m_out): Dims,
) -> Result<()> {
    // dxᵀ (in × rows) (+)= Wᵀ (in × out, as stored) · dyᵀ (out × rows).
    let (shape, ptrs) = ((k_in, rows, m_out), (w.ptr, dy.ptr, dx.ptr));
    let g = dense_gemm((false, false), shape, ptrs, accumulate, output(dx));
    let Some((act, pre)) = act_grad else {
        return be.gemm(&g, weight(w), activation(dy));
    };
    // DGELU with an fp32 dx (and fp32 pre) ran slower on an H200 than the plain GEMM
    // and the separate kernel (0.95 ms against about 0.6 at 32,768 x 768 x 3,072):
    // bf16 dx only.
    if act == Act::GeluTanh && pre.dtype == dx.dtype && g.out == Output::Bf16 {
        let fused = Gemm {
            epilogue: Epilogue::DGelu { aux: pre.ptr },
            ..g
        };
        if be.blas.supports(&fused, be.operands)? {
            match be.gemm(&fused, weight(w), activation(dy)) {
                // Refused at launch (`gemm::Blas::run`): the separate kernel below.
                Err(_) if !be.blas.supports(&fused, be.operands)? => {}
                done => return done,
            }
        }
    }
    // The product into dx, then dx = dx ⊙ act'(pre) in place (a bf16 dx is rounded
    // in between).
    be.gemm(&g, weight(w), activation(dy))?;
    activation_grad_in_place(be, dx, act, pre)
}

/// dW (+)= dyᵀ·x, and db (+)= the column sums of dy where the op has a bias.
fn backward_weight(
    be: &mut CudaBackend,
    (dy, x, dw, db): (Buf, Buf, Buf, Option<Buf>),
    accumulate: bool,
    (rows, k_in, m_out): Dims,
) -> Result<()> {
    // dWᵀ (in × out) += xᵀ (in × rows, as stored) · dy (rows × out, stored out × rows);
    // beta 0 (dW overwritten) for a first contribution.
    let (shape, ptrs) = ((k_in, m_out, rows), (x.ptr, dy.ptr, dw.ptr));
    let g = dense_gemm((false, true), shape, ptrs, accumulate, Output::F32);
    let Some(db) = db else {
        return be.gemm(&g, activation(x), activation(dy));
    };
    if be.operands != Operands::F32 && bias_grad_epilogue(be, &g, (x, dy, db), accumulate)? {
        return Ok(());
    }
    be.gemm(&g, activation(x), activation(dy))?;
    col_sum_into(be, dy, (db, accumulate), rows, m_out)
}

/// `g` with cuBLASLt's bias-gradient epilogue, which writes the column sums of dy: into db
/// itself for a first contribution, else into a scratch vector added into db by a k = 1 GEMM.
/// False (nothing run) where cuBLASLt offers or launches no such epilogue: the caller sums
/// the columns apart.
fn bias_grad_epilogue(
    be: &mut CudaBackend,
    g: &Gemm,
    (x, dy, db): (Buf, Buf, Buf),
    accumulate: bool,
) -> Result<bool> {
    let m_out = g.n as usize;
    let (one, t) = be.gemm_vectors(m_out)?;
    let with_grad = Gemm {
        epilogue: Epilogue::BiasGradB {
            ptr: if accumulate { t } else { db.ptr },
        },
        ..*g
    };
    // db += t as a k = 1 fp32 GEMM: db = t · [1.0] + 1 · db (one rounding, as an add).
    let add = dense_gemm(
        (false, false),
        (m_out, 1, 1),
        (t, one, db.ptr),
        true,
        Output::F32,
    );
    if !(be.blas.supports(&with_grad, be.operands)?
        && (!accumulate || be.blas.supports(&add, Operands::F32)?))
    {
        return Ok(false);
    }
    match be.gemm(&with_grad, activation(x), activation(dy)) {
        Ok(()) if !accumulate => Ok(true),
        Ok(()) => {
            let stream = be.stream.cu_stream();
            be.blas.run(&add, Operands::F32, stream, None)?;
            Ok(true)
        }
        // Refused at launch (`gemm::Blas::run`): the column sum.
        Err(_) if !be.blas.supports(&with_grad, be.operands)? => Ok(false),
        Err(e) => Err(e),
    }
}

/// `g` (D = y) plus bias `bb` where given: by an epilogue where cuBLASLt offers one, else
/// (f32 y) after y = b was written (`bias_epilogue`).
fn matmul_bias(
    be: &mut CudaBackend,
    b: &Bound,
    g: &Gemm,
    (w, x): (Buf, Buf),
    bb: Option<Buf>,
    y: Buf,
    rows: usize,
) -> Result<()> {
    let Some(bb) = bb else {
        return be.gemm(g, weight(w), activation(x));
    };
    // An epilogue cuBLASLt refuses at launch becomes unsupported (`gemm::Blas::run`): then
    // the next choice (at most fp32 bias, bf16 bias, y = b first).
    loop {
        let epilogue = bias_epilogue(be, b, g, bb, y, rows)?;
        let beta = if epilogue == Epilogue::None { 1.0 } else { 0.0 };
        let with_bias = Gemm {
            epilogue,
            beta,
            ..*g
        };
        match be.gemm(&with_bias, weight(w), activation(x)) {
            Err(_)
                if epilogue != Epilogue::None && !be.blas.supports(&with_bias, be.operands)? => {}
            done => return done,
        }
    }
}

/// `g` with cuBLASLt's GELU epilogue: D = a = gelu(y), the pre-activation y (bias `bb`
/// added where given, fp32 or, beside a bf16 D where cuBLASLt takes no fp32 one, its bf16
/// cast) written as the auxiliary output. False (nothing run) where cuBLASLt offers or
/// launches no such epilogue: the caller runs the separate path.
fn gelu_epilogue(
    be: &mut CudaBackend,
    g: &Gemm,
    (w, x): (Buf, Buf),
    bb: Option<Buf>,
    (y, a): (Buf, Buf),
) -> Result<bool> {
    let at = |bias| Gemm {
        c: a.ptr,
        out: output(a),
        epilogue: Epilogue::GeluAux { bias, aux: y.ptr },
        ..*g
    };
    let mut choices = Vec::new();
    match bb {
        None => choices.push(at(None)),
        Some(bb) => {
            choices.push(at(Some((bb.ptr, false))));
            if output(a) == Output::Bf16 {
                choices.push(at(Some((bias_bf16(be, bb)?, true))));
            }
        }
    }
    for fused in choices {
        if !be.blas.supports(&fused, be.operands)? {
            continue;
        }
        match be.gemm(&fused, weight(w), activation(x)) {
            Ok(()) => return Ok(true),
            // Refused at launch (`gemm::Blas::run`): the next choice.
            Err(_) if !be.blas.supports(&fused, be.operands)? => {}
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

/// `g` (C = the residual, beta = 1, D = y) plus bias `bb` where given, by the bias epilogue
/// (fp32, or beside a bf16 D its bf16 cast). False (nothing run) where cuBLASLt offers or
/// launches none: the caller adds the residual apart.
fn residual_epilogue(
    be: &mut CudaBackend,
    g: &Gemm,
    (w, x): (Buf, Buf),
    bb: Option<Buf>,
) -> Result<bool> {
    let mut choices = Vec::new();
    match bb {
        None => choices.push(Epilogue::None),
        Some(bb) => {
            choices.push(Epilogue::Bias {
                ptr: bb.ptr,
                bf16: false,
            });
            if g.out == Output::Bf16 {
                choices.push(Epilogue::Bias {
                    ptr: bias_bf16(be, bb)?,
                    bf16: true,
                });
            }
        }
    }
    for epilogue in choices {
        let fused = Gemm { epilogue, ..*g };
        if !be.blas.supports(&fused, be.operands)? {
            continue;
        }
        match be.gemm(&fused, weight(w), activation(x)) {
            Ok(()) => return Ok(true),
            Err(_) if epilogue != Epilogue::None && !be.blas.supports(&fused, be.operands)? => {}
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

/// A bf16 copy of the f32 bias `bb`: its cached cast, or a per-use copy in the vector area.
fn bias_bf16(be: &mut CudaBackend, bb: Buf) -> Result<CUdeviceptr> {
    Ok(match be.weight_cast(bb)? {
        Some(ptr) => ptr,
        None => {
            let (_, t) = be.gemm_vectors(bb.len)?;
            be.round_copy(bb.ptr, t, bb.len)?;
            t
        }
    })
}

/// The epilogue that adds bias `bb` to `g` (whose D is `y`, `rows` × m), or `Epilogue::None`
/// after y = b was written for the product to accumulate onto (f32 y only).
fn bias_epilogue(
    be: &mut CudaBackend,
    b: &Bound,
    g: &Gemm,
    bb: Buf,
    y: Buf,
    rows: usize,
) -> Result<Epilogue> {
    let fp32_bias = Epilogue::Bias {
        ptr: bb.ptr,
        bf16: false,
    };
    if be.blas.supports(
        &Gemm {
            epilogue: fp32_bias,
            ..*g
        },
        be.operands,
    )? {
        return Ok(fp32_bias);
    }
    if g.out == Output::Bf16 {
        let ptr = bias_bf16(be, bb)?;
        let bf16_bias = Epilogue::Bias { ptr, bf16: true };
        if be.blas.supports(
            &Gemm {
                epilogue: bf16_bias,
                ..*g
            },
            be.operands,
        )? {
            return Ok(bf16_bias);
        }
        return Err(b.err(
            "cuBLASLt offers no bias epilogue for this bf16-output GEMM (fp32 or bf16 bias)",
        ));
    }
    be.launch_n(
        Kernel::BroadcastRows,
        rows * bb.len,
        &[p(bb), fv(y), n(rows), n(bb.len)],
    )?;
    Ok(Epilogue::None)
}

impl CudaBackend {
    /// Starts (from zero) or stops timing the GEMMs' cuBLASLt kernels alone, without their
    /// operand conversions (for GEMM benchmarks): while on, every GEMM waits for its kernels.
    pub fn time_gemm_kernels(&mut self, on: bool) -> Result<()> {
        self.blas.time_matmuls(on)
    }

    /// The GEMM plans made so far, one line each: shape, operand and output types, epilogue,
    /// and whether cuBLASLt runs it (an unsupported epilogue shows which fallback ran).
    pub fn gemm_plans(&self) -> Vec<String> {
        let mut lines = self.blas.describe_plans();
        lines.extend(self.describe_ws_choices());
        lines
    }

    /// Milliseconds of GEMM kernel time since `time_gemm_kernels(true)`; None when off.
    pub fn gemm_kernel_ms(&self) -> Option<f64> {
        self.blas.matmul_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GEMM of every matmul op as its fields were written out before `dense_gemm`: the
    /// forward, backward-data and backward-weight products and the bias gradient's k = 1 add
    /// ((m, n, k), (lda, ldb, ldc), beta).
    #[test]
    fn dense_gemms_keep_each_ops_layout() {
        let (rows, k_in, m_out) = (37usize, 24usize, 40usize);
        let ptrs = (0x1000, 0x2000, 0x3000);
        let layout = |g: Gemm| {
            assert_eq!((g.a, g.b, g.c, g.c_in), (0x1000, 0x2000, 0x3000, None));
            assert_eq!(g.epilogue, Epilogue::None);
            let dims = [g.m, g.n, g.k].map(|v| v as usize);
            let lds = [g.lda, g.ldb, g.ldc].map(|v| v as usize);
            (dims, lds, g.beta, g.out)
        };
        let forward = dense_gemm(
            (true, false),
            (m_out, rows, k_in),
            ptrs,
            false,
            Output::Bf16,
        );
        assert_eq!(
            layout(forward),
            ([m_out, rows, k_in], [k_in, k_in, m_out], 0.0, Output::Bf16)
        );
        let data = dense_gemm((false, false), (k_in, rows, m_out), ptrs, true, Output::F32);
        assert_eq!(
            layout(data),
            ([k_in, rows, m_out], [k_in, m_out, k_in], 1.0, Output::F32)
        );
        let weight = dense_gemm((false, true), (k_in, m_out, rows), ptrs, false, Output::F32);
        assert_eq!(
            layout(weight),
            ([k_in, m_out, rows], [k_in, m_out, k_in], 0.0, Output::F32)
        );
        let add = dense_gemm((false, false), (m_out, 1, 1), ptrs, true, Output::F32);
        assert_eq!(
            layout(add),
            ([m_out, 1, 1], [m_out, 1, m_out], 1.0, Output::F32)
        );
        assert!(forward.trans_a && !forward.trans_b && weight.trans_b && !data.trans_a);
    }
}
