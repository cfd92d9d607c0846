//! Generated kernels for the tests of `Op::Fused`: the CPU-against-CUDA cases
//! (tests/cuda_ops/fused.rs), the emitters' tests (the NVRTC compile test, runtime/src/cuda/
//! codegen/tests.rs; the LLVM emitter's PTX and GPU tests, runtime/src/llvm; the
//! NVRTC-against-LLVM case, tests/cuda_ops/emitters.rs) and the bandwidth benchmark. Together they use every primitive op, every column map
//! and every access, outputs of rows, and row sums one and two deep; `composite` adds kernels
//! written with composite ops (SwiGLU and its gradient, GELU), which `kir::expand` rewrites.
//! Built with `kir`'s public builders only.
#![allow(dead_code)] // each includer uses a part

use parc_compiler::kir::{Access, Bin, Cmp, ColMap, Graph, Kernel, NodeId, Store, Un};

/// A kernel of `cols` columns writing `values` to outputs `0..` at offset 0 (one store each).
fn kernel(
    cols: u64,
    inputs: Vec<Access>,
    outputs: Vec<Access>,
    g: Graph,
    values: &[NodeId],
) -> Kernel {
    let stores = (values.iter().enumerate())
        .map(|(o, &value)| Store {
            output: o as u32,
            col_offset: 0,
            value,
        })
        .collect();
    Kernel {
        cols,
        inputs,
        outputs,
        graph: g,
        stores,
    }
}

fn elem(width: u64) -> Access {
    Access::Elem { width }
}

/// `+ - * /`, abs, sqrt, neg, floor (flat: every operand `[rows, cols]`).
pub fn arith(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x0, x1) = (g.load(0, 0), g.load(1, 0));
    let s = g.bin(Bin::Add, x0, x1);
    let d = g.bin(Bin::Sub, x0, x1);
    let p = g.bin(Bin::Mul, s, d);
    let half = g.constant(0.5);
    let a = g.un(Un::Abs, x1);
    let den = g.bin(Bin::Add, a, half);
    let q = g.bin(Bin::Div, p, den);
    let ad = g.un(Un::Abs, d);
    let r = g.un(Un::Sqrt, ad);
    let three = g.constant(3.0);
    let t = g.bin(Bin::Mul, x0, three);
    let f = g.un(Un::Floor, t);
    let nf = g.un(Un::Neg, f);
    let y1 = g.bin(Bin::Add, r, nf);
    kernel(cols, vec![elem(cols); 2], vec![elem(cols); 2], g, &[q, y1])
}

/// The fused multiply-add: `fma(x0, x1, x2)` and the product's rounding error
/// `fma(x0, x1, -(x0 · x1))` (zero unless the fma is really fused).
pub fn fma(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x0, x1, x2) = (g.load(0, 0), g.load(1, 0), g.load(2, 0));
    let y0 = g.fma(x0, x1, x2);
    let p = g.bin(Bin::Mul, x0, x1);
    let np = g.un(Un::Neg, p);
    let y1 = g.fma(x0, x1, np);
    kernel(cols, vec![elem(cols); 3], vec![elem(cols); 2], g, &[y0, y1])
}

/// exp2i (integral, clamped and truncated arguments), exponent, mantissa, exp2bits (of an
/// integer rounded by exp's constant, `1.5 · 2^23 + 127 + round(16 x)`, and of raw bits).
pub fn bits(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let four = g.constant(4.0);
    let x4 = g.bin(Bin::Mul, x, four);
    let k = g.un(Un::Floor, x4);
    let p = g.un(Un::Exp2i, k);
    let m = g.un(Un::Mantissa, x);
    let pm = g.bin(Bin::Mul, p, m);
    let e = g.un(Un::Exponent, x);
    let y0 = g.bin(Bin::Add, pm, e);
    let fifty = g.constant(50.5);
    let big = g.bin(Bin::Mul, x, fifty);
    let p_big = g.un(Un::Exp2i, big);
    let sixteen = g.constant(16.0);
    let magic = g.constant(12_582_912.0 + 127.0);
    let t = g.fma(x, sixteen, magic);
    let p_t = g.un(Un::Exp2Bits, t);
    let y1 = g.bin(Bin::Add, p_big, p_t);
    let y2 = g.un(Un::Exp2Bits, x);
    kernel(
        cols,
        vec![elem(cols)],
        vec![elem(cols); 3],
        g,
        &[y0, y1, y2],
    )
}

/// Every comparison, as selects.
pub fn select(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x0, x1) = (g.load(0, 0), g.load(1, 0));
    let zero = g.constant(0.0);
    let quarter = g.constant(0.25);
    let lt = g.cmp(Cmp::Lt, x0, x1);
    let y0 = g.select(lt, x0, x1);
    let le = g.cmp(Cmp::Le, x0, zero);
    let gt = g.cmp(Cmp::Gt, x1, quarter);
    let nx0 = g.un(Un::Neg, x0);
    let a = g.select(gt, x1, nx0);
    let ge = g.cmp(Cmp::Ge, x0, x1);
    let prod = g.bin(Bin::Mul, x0, x1);
    let eq = g.cmp(Cmp::Eq, x0, x1);
    let inner = g.select(eq, quarter, x0);
    let b = g.select(ge, prod, inner);
    let sel = g.select(le, a, b);
    let ne = g.cmp(Cmp::Ne, sel, zero);
    let y1 = g.select(ne, sel, quarter);
    kernel(cols, vec![elem(cols); 2], vec![elem(cols); 2], g, &[y0, y1])
}

/// Column blocks: input 0 is `[rows, 2·cols]` (gate | up); y0 = gate · up, y1 the two halves
/// swapped (stores at offsets 0 and cols).
pub fn columns(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (gate, up) = (g.load(0, 0), g.load(0, cols));
    let y0 = g.bin(Bin::Mul, gate, up);
    let mut k = kernel(
        cols,
        vec![elem(2 * cols)],
        vec![elem(cols), elem(2 * cols)],
        g,
        &[y0],
    );
    k.stores.push(Store {
        output: 1,
        col_offset: 0,
        value: up,
    });
    k.stores.push(Store {
        output: 1,
        col_offset: cols,
        value: gate,
    });
    k
}

/// Rotary embedding from per-position tables, of the second column block of x `[rows,
/// 2·cols]` (heads of `hd` columns), with the first block copied: output `[rows, 2·cols]`
/// written by two stores (offsets 0 and cols), as the fused q/k/v split + RoPE does. Table
/// `[rows / 3, 2·hd]` (cos | sin) per position (batch 3): y = x·cos + rot(x)·sin, the tables
/// read through `Periodic(hd)` and x's partner through `RotateHalf(hd)` at x's offset.
pub fn rope(cols: u64, hd: u64) -> Kernel {
    rope_turning(cols, hd, hd)
}

/// [`rope`] with only the first `rot` columns of each head turning (a partial RoPE): x's
/// partner read through `RotatePart`, the kept columns' own (the tables hold 1 and 0 there
/// where a lowered program makes them; here they are any values).
pub fn partial_rope(cols: u64, hd: u64) -> Kernel {
    rope_turning(cols, hd, (hd / 2) & !1)
}

fn rope_turning(cols: u64, hd: u64, rot: u64) -> Kernel {
    let mut g = Graph::new();
    let x = g.load(0, cols);
    let partner = g.load_mapped(0, cols, ColMap::rotation(hd, rot));
    let cos = g.load_mapped(1, 0, ColMap::Periodic(hd));
    let sin = g.load_mapped(1, hd, ColMap::Periodic(hd));
    let a = g.bin(Bin::Mul, x, cos);
    let b = g.bin(Bin::Mul, partner, sin);
    let y = g.bin(Bin::Add, a, b);
    let copy = g.load(0, 0);
    let table = Access::PerPosition {
        batch: 3,
        width: 2 * hd,
    };
    let mut k = kernel(
        cols,
        vec![elem(2 * cols), table],
        vec![elem(2 * cols)],
        g,
        &[copy],
    );
    k.stores.push(Store {
        output: 0,
        col_offset: cols,
        value: y,
    });
    k
}

/// Row and column inputs and a row output: y0 = x · rstd · w + b, y1 = rstd · rstd.
pub fn row_col(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x, rstd, w, b) = (g.load(0, 0), g.load(1, 0), g.load(2, 0), g.load(3, 0));
    let xr = g.bin(Bin::Mul, x, rstd);
    let xw = g.bin(Bin::Mul, xr, w);
    let y0 = g.bin(Bin::Add, xw, b);
    let y1 = g.bin(Bin::Mul, rstd, rstd);
    let ins = vec![elem(cols), Access::Row, Access::Col, Access::Col];
    kernel(cols, ins, vec![elem(cols), Access::Row], g, &[y0, y1])
}

/// RMSNorm: one row sum. y0 = x · rstd · w, y1 = rstd = 1 / sqrt(Σx² / cols + 1e-5).
pub fn rms(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x, w) = (g.load(0, 0), g.load(1, 0));
    let xx = g.bin(Bin::Mul, x, x);
    let ss = g.row_sum(xx);
    let n = g.constant(cols as f32);
    let ms = g.bin(Bin::Div, ss, n);
    let eps = g.constant(1e-5);
    let mse = g.bin(Bin::Add, ms, eps);
    let root = g.un(Un::Sqrt, mse);
    let one = g.constant(1.0);
    let rstd = g.bin(Bin::Div, one, root);
    let xr = g.bin(Bin::Mul, x, rstd);
    let y0 = g.bin(Bin::Mul, xr, w);
    let ins = vec![elem(cols), Access::Col];
    kernel(cols, ins, vec![elem(cols), Access::Row], g, &[y0, rstd])
}

/// A residual add and LayerNorm without weights: two row sums, the second of a value that
/// needs the first. y0 = h = x0 + x1, y1 = (h − mean) · rstd, y2 = rstd.
pub fn layer(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x0, x1) = (g.load(0, 0), g.load(1, 0));
    let h = g.bin(Bin::Add, x0, x1);
    let n = g.constant(cols as f32);
    let sum = g.row_sum(h);
    let mean = g.bin(Bin::Div, sum, n);
    let hc = g.bin(Bin::Sub, h, mean);
    let sq = g.bin(Bin::Mul, hc, hc);
    let ssq = g.row_sum(sq);
    let var = g.bin(Bin::Div, ssq, n);
    let eps = g.constant(1e-5);
    let ve = g.bin(Bin::Add, var, eps);
    let root = g.un(Un::Sqrt, ve);
    let one = g.constant(1.0);
    let rstd = g.bin(Bin::Div, one, root);
    let y1 = g.bin(Bin::Mul, hc, rstd);
    let outs = vec![elem(cols), elem(cols), Access::Row];
    kernel(cols, vec![elem(cols); 2], outs, g, &[h, y1, rstd])
}

/// Every kernel above built only of primitive ops, named, for `cols` columns (rope's heads
/// of `hd` columns; `hd` divides `cols`).
pub fn primitive(cols: u64, hd: u64) -> Vec<(&'static str, Kernel)> {
    vec![
        ("arith", arith(cols)),
        ("fma", fma(cols)),
        ("bits", bits(cols)),
        ("select", select(cols)),
        ("columns", columns(cols)),
        ("rope", rope(cols, hd)),
        ("partial_rope", partial_rope(cols, hd)),
        ("row_col", row_col(cols)),
        ("rms", rms(cols)),
        ("layer", layer(cols)),
    ]
}

/// y = silu(gate) · up, written with sigmoid (composite).
pub fn swiglu(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (gate, up) = (g.load(0, 0), g.load(1, 0));
    let s = g.un(Un::Sigmoid, gate);
    let silu = g.bin(Bin::Mul, gate, s);
    let y = g.bin(Bin::Mul, silu, up);
    kernel(cols, vec![elem(cols); 2], vec![elem(cols)], g, &[y])
}

/// SwiGLU's gradient: dgate = dy · up · σ(g)(1 + g(1 − σ(g))), dup = dy · g · σ(g).
pub fn swiglu_bwd(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (dy, gate, up) = (g.load(0, 0), g.load(1, 0), g.load(2, 0));
    let s = g.un(Un::Sigmoid, gate);
    let one = g.constant(1.0);
    let oms = g.bin(Bin::Sub, one, s);
    let goms = g.bin(Bin::Mul, gate, oms);
    let inner = g.bin(Bin::Add, one, goms);
    let ds = g.bin(Bin::Mul, s, inner);
    let dyu = g.bin(Bin::Mul, dy, up);
    let dgate = g.bin(Bin::Mul, dyu, ds);
    let gs = g.bin(Bin::Mul, gate, s);
    let dup = g.bin(Bin::Mul, dy, gs);
    kernel(
        cols,
        vec![elem(cols); 3],
        vec![elem(cols); 2],
        g,
        &[dgate, dup],
    )
}

/// y = relu(x)², with max (composite).
pub fn squared_relu(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let zero = g.constant(0.0);
    let r = g.bin(Bin::Max, x, zero);
    let y = g.bin(Bin::Mul, r, r);
    kernel(cols, vec![elem(cols)], vec![elem(cols)], g, &[y])
}

/// y = x (a copy: the bandwidth benchmark's baseline kernel).
pub fn copy(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    kernel(cols, vec![elem(cols)], vec![elem(cols)], g, &[x])
}

/// GELU (erf form) and the other composites: exp, log, tanh, erf, rsqrt, pow, min.
pub fn composites(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x0, x1) = (g.load(0, 0), g.load(1, 0));
    let c = g.constant(std::f32::consts::FRAC_1_SQRT_2);
    let xs = g.bin(Bin::Mul, x0, c);
    let erf = g.un(Un::Erf, xs);
    let one = g.constant(1.0);
    let half = g.constant(0.5);
    let e1 = g.bin(Bin::Add, one, erf);
    let hx = g.bin(Bin::Mul, half, x0);
    let gelu = g.bin(Bin::Mul, hx, e1);
    let ex = g.un(Un::Exp, x1);
    let lg = g.un(Un::Log, ex);
    let th = g.un(Un::Tanh, lg);
    let ax = g.un(Un::Abs, x0);
    let axp = g.bin(Bin::Add, ax, half);
    let rs = g.un(Un::Rsqrt, axp);
    let pw = g.bin(Bin::Pow, axp, x1);
    let mn = g.bin(Bin::Min, rs, pw);
    let y1 = g.bin(Bin::Add, th, mn);
    kernel(
        cols,
        vec![elem(cols); 2],
        vec![elem(cols); 2],
        g,
        &[gelu, y1],
    )
}

/// The kernels written with composite ops, named (expand them before an emitter sees them).
pub fn composite(cols: u64) -> Vec<(&'static str, Kernel)> {
    vec![
        ("swiglu", swiglu(cols)),
        ("swiglu_bwd", swiglu_bwd(cols)),
        ("squared_relu", squared_relu(cols)),
        ("composites", composites(cols)),
    ]
}
