//! Sample kernels covering every primitive op, comparison, column map, access and a row sum
//! (nested too), and every composite op through `kir::expand`, for the emitters' tests: the PTX tests here and the NVRTC-vs-LLVM GPU test
//! (tests/cuda_ops/emitters.rs includes this file). Test support only: not compiled into the
//! library.
use parc_compiler::kir::expand::expand;
use parc_compiler::kir::{Access, Bin, Cmp, ColMap, Graph, Kernel, NodeId, Store, Un};

/// Every sample, named.
pub fn all() -> Vec<(&'static str, Kernel)> {
    vec![
        ("unary", unary(96)),
        ("binary", binary(80)),
        ("fma", fma(88)),
        ("rope", rope(128, 32)),
        ("row_input", row_input(72)),
        ("rms_norm", rms_norm(300)),
        ("layer_norm", layer_norm(520)),
        ("composite", expand(&composite(200))),
    ]
}

fn elem(width: u64) -> Access {
    Access::Elem { width }
}

fn store(output: u32, col_offset: u64, value: NodeId) -> Store {
    Store {
        output,
        col_offset,
        value,
    }
}

fn kernel(
    cols: u64,
    inputs: Vec<Access>,
    outputs: Vec<Access>,
    graph: Graph,
    stores: Vec<Store>,
) -> Kernel {
    Kernel {
        cols,
        inputs,
        outputs,
        graph,
        stores,
    }
}

/// Every one-operand primitive: `-sqrt(|x0|)`, `floor(10 x0) · 2^floor(100 x1)` (clamped
/// exponents both ways), `exponent(x0) + mantissa(x1)`.
pub fn unary(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x0, x1) = (g.load(0, 0), g.load(1, 0));
    let a = g.un(Un::Abs, x0);
    let s = g.un(Un::Sqrt, a);
    let y0 = g.un(Un::Neg, s);
    let ten = g.constant(10.0);
    let t = g.bin(Bin::Mul, x0, ten);
    let f = g.un(Un::Floor, t);
    let hundred = g.constant(100.0);
    let k = g.bin(Bin::Mul, x1, hundred);
    let k = g.un(Un::Floor, k);
    let p = g.un(Un::Exp2i, k);
    let y1 = g.bin(Bin::Mul, f, p);
    let e = g.un(Un::Exponent, x0);
    let m = g.un(Un::Mantissa, x1);
    let y2 = g.bin(Bin::Add, e, m);
    let stores = vec![store(0, 0, y0), store(1, 0, y1), store(2, 0, y2)];
    kernel(cols, vec![elem(cols); 2], vec![elem(cols); 3], g, stores)
}

/// Every two-operand primitive and comparison, through selects.
pub fn binary(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x0, x1) = (g.load(0, 0), g.load(1, 0));
    let y0 = g.bin(Bin::Div, x0, x1);
    let sub = g.bin(Bin::Sub, x0, x1);
    let mul = g.bin(Bin::Mul, x0, x1);
    let add = g.bin(Bin::Add, x0, x1);
    let half = g.constant(0.5);
    let quarter = g.constant(0.25);
    let lt = g.cmp(Cmp::Lt, x0, x1);
    let le = g.cmp(Cmp::Le, x0, half);
    let gt = g.cmp(Cmp::Gt, x1, quarter);
    let ge = g.cmp(Cmp::Ge, x0, x1);
    let eq = g.cmp(Cmp::Eq, x0, x1);
    let ne = g.cmp(Cmp::Ne, x1, half);
    let a = g.select(lt, sub, mul);
    let b = g.select(le, add, y0);
    let y1 = g.select(gt, a, b);
    let c = g.select(ge, mul, sub);
    let d = g.select(eq, half, add);
    let y2 = g.select(ne, c, d);
    let stores = vec![store(0, 0, y0), store(1, 0, y1), store(2, 0, y2)];
    kernel(cols, vec![elem(cols); 2], vec![elem(cols); 3], g, stores)
}

/// The fused multiply-add: `fma(x0, x1, x2)`, the product's rounding error
/// `fma(x0, x1, -(x0 · x1))` (zero unless the fma is really fused), and `fma(x0, 3, 0.25)`.
pub fn fma(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x0, x1, x2) = (g.load(0, 0), g.load(1, 0), g.load(2, 0));
    let y0 = g.fma(x0, x1, x2);
    let p = g.bin(Bin::Mul, x0, x1);
    let np = g.un(Un::Neg, p);
    let y1 = g.fma(x0, x1, np);
    let (three, quarter) = (g.constant(3.0), g.constant(0.25));
    let y2 = g.fma(x0, three, quarter);
    let stores = vec![store(0, 0, y0), store(1, 0, y1), store(2, 0, y2)];
    kernel(cols, vec![elem(cols); 3], vec![elem(cols); 3], g, stores)
}

/// Rotary embedding of the second column block of `x0` (`[rows, 2 cols]`, offset `cols`) with
/// per-position cos/sin tables (two rows per position) read through the head's periodic map,
/// and the first block copied: both blocks of one output.
pub fn rope(cols: u64, head_dim: u64) -> Kernel {
    let mut g = Graph::new();
    let x = g.load(0, cols);
    let partner = g.load_mapped(0, cols, ColMap::RotateHalf(head_dim));
    let cos = g.load_mapped(1, 0, ColMap::Periodic(head_dim));
    let sin = g.load_mapped(2, 0, ColMap::Periodic(head_dim));
    let a = g.bin(Bin::Mul, x, cos);
    let b = g.bin(Bin::Mul, partner, sin);
    let rotated = g.bin(Bin::Add, a, b);
    let copy = g.load(0, 0);
    let table = Access::PerPosition {
        batch: 2,
        width: head_dim,
    };
    let stores = vec![store(0, 0, copy), store(0, cols, rotated)];
    kernel(
        cols,
        vec![elem(2 * cols), table, table],
        vec![elem(2 * cols)],
        g,
        stores,
    )
}

/// A row input and a column input: `x0 · s[r] + b[c]`, and `s[r] / 3` to a row output.
pub fn row_input(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x, s, bias) = (g.load(0, 0), g.load(1, 0), g.load(2, 0));
    let scaled = g.bin(Bin::Mul, x, s);
    let y = g.bin(Bin::Add, scaled, bias);
    let three = g.constant(3.0);
    let third = g.bin(Bin::Div, s, three);
    let stores = vec![store(0, 0, y), store(1, 0, third)];
    kernel(
        cols,
        vec![elem(cols), Access::Row, Access::Col],
        vec![elem(cols), Access::Row],
        g,
        stores,
    )
}

/// RMSNorm: `rstd = 1 / sqrt(Σx² / cols + eps)`, `y = x · rstd · w`; rstd to a row output.
pub fn rms_norm(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x, w) = (g.load(0, 0), g.load(1, 0));
    let sq = g.bin(Bin::Mul, x, x);
    let sum = g.row_sum(sq);
    let n = g.constant(cols as f32);
    let ms = g.bin(Bin::Div, sum, n);
    let eps = g.constant(1e-5);
    let v = g.bin(Bin::Add, ms, eps);
    let root = g.un(Un::Sqrt, v);
    let one = g.constant(1.0);
    let rstd = g.bin(Bin::Div, one, root);
    let xr = g.bin(Bin::Mul, x, rstd);
    let y = g.bin(Bin::Mul, xr, w);
    let stores = vec![store(0, 0, y), store(1, 0, rstd)];
    kernel(
        cols,
        vec![elem(cols), Access::Col],
        vec![elem(cols), Access::Row],
        g,
        stores,
    )
}

/// LayerNorm, a row sum inside another's operand: mean, then the variance of `x - mean`;
/// `y = (x - mean) · rstd · w + b`, with mean and rstd to row outputs.
pub fn layer_norm(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x, w, b) = (g.load(0, 0), g.load(1, 0), g.load(2, 0));
    let n = g.constant(cols as f32);
    let sum = g.row_sum(x);
    let mean = g.bin(Bin::Div, sum, n);
    let d = g.bin(Bin::Sub, x, mean);
    let sq = g.bin(Bin::Mul, d, d);
    let var = g.row_sum(sq);
    let var = g.bin(Bin::Div, var, n);
    let eps = g.constant(1e-5);
    let v = g.bin(Bin::Add, var, eps);
    let root = g.un(Un::Sqrt, v);
    let one = g.constant(1.0);
    let rstd = g.bin(Bin::Div, one, root);
    let dr = g.bin(Bin::Mul, d, rstd);
    let dw = g.bin(Bin::Mul, dr, w);
    let y = g.bin(Bin::Add, dw, b);
    let stores = vec![store(0, 0, y), store(1, 0, mean), store(2, 0, rstd)];
    let inputs = vec![elem(cols), Access::Col, Access::Col];
    kernel(
        cols,
        inputs,
        vec![elem(cols), Access::Row, Access::Row],
        g,
        stores,
    )
}

/// Every composite op, to be expanded: `exp(x0) · sigmoid(x1) + tanh(x0)`, `erf(x1) +
/// rsqrt(|x0| + 0.5) - log(|x1| + 0.25)`, `min(x0, x1) + max(pow(|x0|, x1), pow(x1, 2))`.
pub fn composite(cols: u64) -> Kernel {
    let mut g = Graph::new();
    let (x0, x1) = (g.load(0, 0), g.load(1, 0));
    let e = g.un(Un::Exp, x0);
    let s = g.un(Un::Sigmoid, x1);
    let t = g.un(Un::Tanh, x0);
    let es = g.bin(Bin::Mul, e, s);
    let y0 = g.bin(Bin::Add, es, t);
    let erf = g.un(Un::Erf, x1);
    let a0 = g.un(Un::Abs, x0);
    let half = g.constant(0.5);
    let a0h = g.bin(Bin::Add, a0, half);
    let r = g.un(Un::Rsqrt, a0h);
    let a1 = g.un(Un::Abs, x1);
    let quarter = g.constant(0.25);
    let a1q = g.bin(Bin::Add, a1, quarter);
    let l = g.un(Un::Log, a1q);
    let er = g.bin(Bin::Add, erf, r);
    let y1 = g.bin(Bin::Sub, er, l);
    let mn = g.bin(Bin::Min, x0, x1);
    let p = g.bin(Bin::Pow, a0, x1);
    let two = g.constant(2.0);
    let sq = g.bin(Bin::Pow, x1, two);
    let mx = g.bin(Bin::Max, p, sq);
    let y2 = g.bin(Bin::Add, mn, mx);
    let stores = vec![store(0, 0, y0), store(1, 0, y1), store(2, 0, y2)];
    kernel(cols, vec![elem(cols); 2], vec![elem(cols); 3], g, stores)
}
