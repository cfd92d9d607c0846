//! Expansion of composite ops into primitives: the "libm in kir".
//!
//! [`expand`] rewrites every composite op of a kernel (exp, log, tanh, erf, sigmoid, rsqrt,
//! min, max, pow) into the primitive ops of [`super::prim`], built with the graph's builders, so
//! one expansion, made once in the compiler, gives the same bits on every backend. It also drops
//! the nodes no store reads. Polynomials are Horner steps of one fma each ([`Node::Fma`], rounded
//! once), range reductions fmas too: fewer nodes and roundings than a multiply and an add.
//!
//! Accuracy promised (f32 results against the exact value; `expand/tests.rs` measures it on
//! sweeps of every 5th f32 of each range, `dense_sweeps`, and the maxima found are given):
//! - `exp`: ≤ 2 ulp (measured 1.09); `exp(x) = +inf` above ~88.72, subnormal results rounded
//!   once, 0 below ~-103.9; NaN → NaN, ±inf → +inf / 0.
//! - `log`: ≤ 2 ulp (0.83), subnormal inputs included; `log(0) = -inf`, `log(x < 0) = NaN`,
//!   `log(+inf) = +inf`, NaN → NaN.
//! - `tanh`: ≤ 2 ulp (1.58), odd (`tanh(-0) = -0`), exactly ±1 from |x| ≈ 9.01 on.
//! - `erf`: ≤ 3e-7 absolute (1.85e-7); relative error near 0 small enough that `erf(x)/x` is
//!   right to 1e-6 (1.6e-7); odd; exactly ±1 for |x| ≥ 4.
//! - `sigmoid`: ≤ 2 ulp (1.59), subnormal results for x < ~-87 included; no division.
//! - `rsqrt(x) = 1 / sqrt(x)` (two correctly rounded ops: ≤ 2 ulp, measured 1.49).
//! - `min`, `max`: exact; NaN if either operand is NaN (as `torch.minimum`); of two equal operands
//!   (`-0` and `+0`) the first.
//! - `pow(x, y)`: a constant integral `y` in [-4, 4] by multiplications (`1 / …` for a negative
//!   one; `pow(x, 0) = 1` even for NaN); `y = 0.5` is `sqrt(x)` and `y = -0.5` is `1 / sqrt(x)`
//!   (so `pow(-0, 0.5) = -0`); otherwise `exp(y · log(x))`: NaN for `x < 0` (even for an integral
//!   `y`), `pow(0, y) = 0` for `y > 0`, `+inf` for `y < 0`, NaN for `y = 0`; its relative error
//!   grows with `|y · log(x)|`: about `2 |y · log x|` ulp on top of exp's.
//!
//! The coefficients are derived here, not copied: Taylor series (tanh, erf near 0, the `atanh`
//! series of log) computed from their defining recurrences in f64, Chebyshev polynomials for
//! exp (interpolation at the Chebyshev nodes) and sigmoid's first reciprocal guess (the
//! polynomial of least relative error), and for erf above 1 the published rational
//! approximation of Abramowitz & Stegun, *Handbook of Mathematical Functions* (1964), formula
//! 7.1.26 (absolute error ≤ 1.5e-7).
use super::{Bin, Cmp, Graph, Kernel, Node, NodeId, Store, Un};

/// `kernel` with every composite op rewritten into primitives and the nodes no store reads
/// dropped: the result [`Kernel::is_expanded`], and validates when `kernel` does.
pub fn expand(kernel: &Kernel) -> Kernel {
    let roots: Vec<NodeId> = kernel.stores.iter().map(|s| s.value).collect();
    let (graph, values) = expand_graph(&kernel.graph, &roots);
    let stores = kernel
        .stores
        .iter()
        .zip(values)
        .map(|(s, value)| Store { value, ..*s })
        .collect();
    Kernel {
        cols: kernel.cols,
        inputs: kernel.inputs.clone(),
        outputs: kernel.outputs.clone(),
        graph,
        stores,
    }
}

/// The nodes `roots` depend on, copied into a new graph with every composite op expanded; the
/// copies of `roots`, in order. A root that is not a node of `g` becomes a NaN constant.
pub fn expand_graph(g: &Graph, roots: &[NodeId]) -> (Graph, Vec<NodeId>) {
    let live = reachable(g, roots);
    let mut out = Graph::new();
    let mut map: Vec<NodeId> = Vec::with_capacity(g.len());
    for (i, node) in g.nodes().iter().enumerate() {
        let new = if live[i] {
            let m = |id: NodeId| map[id.index()];
            match *node {
                Node::Param(_) | Node::Load { .. } | Node::Const(_) => out.intern(*node),
                Node::Un(op, a) => un(&mut out, op, m(a)),
                Node::Bin(op, a, b) => bin(&mut out, op, m(a), m(b)),
                Node::Cmp(op, a, b) => out.cmp(op, m(a), m(b)),
                Node::Select(c, a, b) => out.select(m(c), m(a), m(b)),
                Node::Fma(a, b, c) => out.fma(m(a), m(b), m(c)),
                Node::RowSum(a) => out.row_sum(m(a)),
            }
        } else {
            NodeId(0)
        };
        map.push(new);
    }
    let values = roots
        .iter()
        .map(|r| match map.get(r.index()) {
            Some(&id) => id,
            None => out.constant(f32::NAN),
        })
        .collect();
    (out, values)
}

/// Which nodes the roots depend on.
fn reachable(g: &Graph, roots: &[NodeId]) -> Vec<bool> {
    let mut live = vec![false; g.len()];
    for r in roots {
        if let Some(l) = live.get_mut(r.index()) {
            *l = true;
        }
    }
    for i in (0..g.len()).rev() {
        if live[i] {
            for a in g.node(NodeId(i as u32)).operands() {
                live[a.index()] = true;
            }
        }
    }
    live
}

/// `op(a)` in primitives.
pub fn un(g: &mut Graph, op: Un, a: NodeId) -> NodeId {
    let mut b = B { g };
    match op {
        Un::Exp => b.exp(a, Range::Any),
        Un::Log => b.log(a),
        Un::Tanh => b.tanh(a),
        Un::Erf => b.erf(a),
        Un::Sigmoid => b.sigmoid(a),
        Un::Rsqrt => {
            let s = b.un(Un::Sqrt, a);
            let one = b.c(1.0);
            b.div(one, s)
        }
        Un::Neg
        | Un::Abs
        | Un::Sqrt
        | Un::Floor
        | Un::Exp2i
        | Un::Exp2Bits
        | Un::Exponent
        | Un::Mantissa => b.un(op, a),
    }
}

/// `a op b` in primitives.
pub fn bin(g: &mut Graph, op: Bin, a: NodeId, b: NodeId) -> NodeId {
    let mut bld = B { g };
    match op {
        Bin::Min => bld.min(a, b),
        Bin::Max => bld.max(a, b),
        Bin::Pow => bld.pow(a, b),
        Bin::Add | Bin::Sub | Bin::Mul | Bin::Div => bld.g.bin(op, a, b),
    }
}

/// ln 2 split: `LN2_HI` keeps 12 significant bits, so `k · LN2_HI` is exact for |k| < 2^12.
const LN2_HI: f32 = f32::from_bits(std::f32::consts::LN_2.to_bits() & 0xffff_f000);
/// `ln 2 - LN2_HI`, rounded.
fn ln2_lo() -> f32 {
    (std::f64::consts::LN_2 - LN2_HI as f64) as f32
}

/// exp's input clamp: above, the result overflows to +inf; below, it rounds to 0.
const EXP_MAX_ARG: f32 = 89.0;
const EXP_MIN_ARG: f32 = -105.0;
/// `1.5 · 2^23`: floats in [2^23, 2^24) are the integers, so `y + ROUND_MAGIC` rounded holds
/// `round(y)` (ties to even) in its low bits for |y| < 2^22, and subtracting it again is exact.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// The exponent bias of f32.
const EXP_BIAS: f32 = 127.0;
/// The exponent offset of exp's one-sided scaling (`B::scale`): `k + 64` for `k` in
/// [-151, 0] (and `k - 64` for `k` in [0, 128]) is a normal number's exponent.
const SCALE_OFFSET: f32 = 64.0;
/// The degree of exp's polynomial on [-ln2/2, ln2/2] (Chebyshev interpolation: error
/// 2.8e-9, 0.05 ulp).
const EXP_DEGREE: usize = 6;
/// The degree of the first guess of sigmoid's reciprocal (`B::reciprocal_1_2`): relative
/// error 1/99, 1.0e-4 after its one Newton step.
const RECIPROCAL_GUESS_DEGREE: usize = 2;
/// tanh's switch from its Taylor series to the exp form (tanh(0.55) ≈ 0.5).
const TANH_SERIES_MAX: f32 = 0.55;
/// Terms of tanh's series (to x^19: truncation < 0.1 ulp below 0.55) and of erf's (to x^19:
/// < 2e-8 absolute below 1).
const TANH_TERMS: usize = 10;
const ERF_TERMS: usize = 10;
/// erf's switch from its Taylor series to A&S 7.1.26, and where it is ±1.
const ERF_SERIES_MAX: f32 = 1.0;
const ERF_ONE_FROM: f32 = 4.0;

/// The monomial coefficients of the Chebyshev polynomials `T_0 … T_n` (`T_{k+1} = 2u T_k -
/// T_{k-1}`), lowest power first.
fn chebyshev_polynomials(n: usize) -> Vec<Vec<f64>> {
    let mut t = vec![vec![1.0f64], vec![0.0, 1.0]];
    for k in 1..n {
        let mut next = vec![0.0f64; k + 2];
        for (i, &c) in t[k].iter().enumerate() {
            next[i + 1] += 2.0 * c;
        }
        for (i, &c) in t[k - 1].iter().enumerate() {
            next[i] -= c;
        }
        t.push(next);
    }
    t.truncate(n + 1);
    t
}

/// The coefficients (of `r^0 … r^degree`) of the polynomial that interpolates `e^r` at the
/// `degree + 1` Chebyshev nodes of [-h, h]: within a factor of two of the best (minimax)
/// polynomial's error, at most `2 (h/2)^(degree+1) / (degree+1)! · e^h`.
fn exp_coefficients(degree: usize, h: f64) -> Vec<f64> {
    let n = degree + 1;
    let angle = |j: usize| std::f64::consts::PI * (j as f64 + 0.5) / n as f64;
    let t = chebyshev_polynomials(degree);
    let mut coeffs = vec![0.0f64; n];
    for (k, tk) in t.iter().enumerate() {
        // The Chebyshev series coefficient of T_k, from the values at the nodes.
        let sum: f64 = (0..n)
            .map(|j| (h * angle(j).cos()).exp() * (k as f64 * angle(j)).cos())
            .sum();
        let a = sum * if k == 0 { 1.0 } else { 2.0 } / n as f64;
        for (i, &c) in tk.iter().enumerate() {
            coeffs[i] += a * c / h.powi(i as i32);
        }
    }
    coeffs
}

/// The coefficients (of `d^0 … d^degree`) of the first guess `p` of `1 / d` on [1, 2] whose
/// relative error `1 - d p(d)` is smallest: that error is a degree + 1 polynomial equal to 1 at
/// `d = 0`, so the best is the Chebyshev polynomial `T_{degree+1}(2d - 3) / T_{degree+1}(-3)`
/// (error `1 / |T_{degree+1}(-3)|`: 1/17 for a line, 1/99 for a parabola), and `p(d) = (1 -
/// T(2d - 3) / T(-3)) / d`.
fn reciprocal_guess_coefficients(degree: usize) -> Vec<f64> {
    let t = &chebyshev_polynomials(degree + 1)[degree + 1];
    // T(2d - 3) in powers of d: expand each (2d - 3)^i by the binomial theorem.
    let mut in_d = vec![0.0f64; degree + 2];
    for (i, &c) in t.iter().enumerate() {
        let mut binomial = 1.0f64;
        for (j, term) in in_d.iter_mut().enumerate().take(i + 1) {
            *term += c * binomial * 2f64.powi(j as i32) * (-3f64).powi((i - j) as i32);
            binomial = binomial * (i - j) as f64 / (j + 1) as f64;
        }
    }
    // 1 - T(2d - 3) / T(-3) has no constant term (T(-3) is in_d[0]): divide by d.
    in_d[1..].iter().map(|&c| -c / in_d[0]).collect()
}

/// The Taylor coefficients `a_1, a_3, a_5, …` (`n` of them) of tanh at 0, from
/// `tanh' = 1 - tanh²`: `(k + 1) a_{k+1} = [k = 0] - Σ_{i+j=k} a_i a_j`.
fn tanh_coefficients(n: usize) -> Vec<f64> {
    let degree = 2 * n;
    let mut a = vec![0.0f64; degree + 1];
    for k in 0..degree {
        let square: f64 = (0..=k).map(|i| a[i] * a[k - i]).sum();
        let delta = if k == 0 { 1.0 } else { 0.0 };
        a[k + 1] = (delta - square) / (k + 1) as f64;
    }
    a.into_iter().skip(1).step_by(2).collect()
}

/// The coefficients of `erf(x) / x` as a series in `x²` (`n` of them):
/// `2/√π · (-1)^k / (k! (2k + 1))`.
fn erf_coefficients(n: usize) -> Vec<f64> {
    let two_over_sqrt_pi = 2.0 / std::f64::consts::PI.sqrt();
    let mut factorial = 1.0f64;
    (0..n)
        .map(|k| {
            if k > 0 {
                factorial *= k as f64;
            }
            let sign = if k % 2 == 0 { 1.0 } else { -1.0 };
            two_over_sqrt_pi * sign / (factorial * (2 * k + 1) as f64)
        })
        .collect()
}

/// Abramowitz & Stegun 7.1.26: `erf x ≈ 1 - t (a1 + t (a2 + …)) e^{-x²}`, `t = 1/(1 + p x)`.
const AS_P: f64 = 0.327_591_1;
const AS_A: [f64; 5] = [
    0.254_829_592,
    -0.284_496_736,
    1.421_413_741,
    -1.453_152_027,
    1.061_405_429,
];

/// What an expansion knows of exp's argument: a clamp that cannot apply is left out.
#[derive(Clone, Copy, PartialEq)]
enum Range {
    Any,
    /// ≥ 0 or NaN: no clamp below.
    NonNegative,
    /// ≤ 0 or NaN: no clamp above.
    NonPositive,
}

/// The exponent offset of exp's one-sided scaling for arguments in `range` (`B::scale`); none
/// for an argument of either sign.
fn scale_offset(range: Range) -> Option<f32> {
    match range {
        Range::NonPositive => Some(SCALE_OFFSET),
        Range::NonNegative => Some(-SCALE_OFFSET),
        Range::Any => None,
    }
}

/// The builders with short names, for writing the expansions as formulas.
struct B<'a> {
    g: &'a mut Graph,
}

impl B<'_> {
    fn c(&mut self, v: f32) -> NodeId {
        self.g.constant(v)
    }
    fn un(&mut self, op: Un, a: NodeId) -> NodeId {
        self.g.un(op, a)
    }
    fn add(&mut self, a: NodeId, b: NodeId) -> NodeId {
        self.g.bin(Bin::Add, a, b)
    }
    fn sub(&mut self, a: NodeId, b: NodeId) -> NodeId {
        self.g.bin(Bin::Sub, a, b)
    }
    fn mul(&mut self, a: NodeId, b: NodeId) -> NodeId {
        self.g.bin(Bin::Mul, a, b)
    }
    fn div(&mut self, a: NodeId, b: NodeId) -> NodeId {
        self.g.bin(Bin::Div, a, b)
    }
    fn mulc(&mut self, a: NodeId, v: f32) -> NodeId {
        let c = self.c(v);
        self.mul(a, c)
    }
    fn addc(&mut self, a: NodeId, v: f32) -> NodeId {
        let c = self.c(v);
        self.add(a, c)
    }
    /// `op(a, constant v)`, a comparison.
    fn cmpc(&mut self, op: Cmp, a: NodeId, v: f32) -> NodeId {
        let c = self.c(v);
        self.g.cmp(op, a, c)
    }
    fn sel(&mut self, cond: NodeId, a: NodeId, b: NodeId) -> NodeId {
        self.g.select(cond, a, b)
    }
    /// `-v` where `x < 0`, else `v` (NaN `x` keeps `v`).
    fn with_sign_of(&mut self, x: NodeId, v: NodeId) -> NodeId {
        let negative = self.cmpc(Cmp::Lt, x, 0.0);
        let neg = self.un(Un::Neg, v);
        self.sel(negative, neg, v)
    }

    /// `a · b + c`, rounded once.
    fn fma(&mut self, a: NodeId, b: NodeId, c: NodeId) -> NodeId {
        self.g.fma(a, b, c)
    }
    /// `a · constant v + c`, rounded once.
    fn fmac(&mut self, a: NodeId, v: f32, c: NodeId) -> NodeId {
        let k = self.c(v);
        self.fma(a, k, c)
    }

    /// `Σ coeffs[i] · z^i` by Horner's rule in f32 (coefficients rounded from f64), each step
    /// one fma.
    fn poly(&mut self, z: NodeId, coeffs: &[f64]) -> NodeId {
        let mut acc = self.c(coeffs.last().copied().unwrap_or(0.0) as f32);
        for &c in coeffs.iter().rev().skip(1) {
            let k = self.c(c as f32);
            acc = self.fma(acc, z, k);
        }
        acc
    }

    /// exp: `2^k · e^r` with `k = round(x / ln 2)`, `r = x - k ln 2` by two fmas (Cody–Waite:
    /// ln 2 split, so `r` is within a rounding of exact), `e^r` by a degree-6 polynomial in
    /// Horner form, one fma a step (Chebyshev interpolation on |r| ≤ ln2/2: error < 0.05 ulp),
    /// and `2^k` applied so 2^128 and subnormal results work (`scale`). `k` comes from one
    /// fma, `t = x · log2 e + ROUND_MAGIC + bias` (rounded once to an integer), and one exact
    /// subtraction; a one-sided scaling takes `2^(k ± 64)` from `t`'s low bits (`bias` is
    /// that exponent's bias). The clamps keep NaN (a NaN fails both comparisons).
    fn exp(&mut self, x: NodeId, range: Range) -> NodeId {
        let mut x = x;
        if range != Range::NonPositive {
            let over = self.cmpc(Cmp::Gt, x, EXP_MAX_ARG);
            let max = self.c(EXP_MAX_ARG);
            x = self.sel(over, max, x);
        }
        if range != Range::NonNegative {
            let under = self.cmpc(Cmp::Lt, x, EXP_MIN_ARG);
            let min = self.c(EXP_MIN_ARG);
            x = self.sel(under, min, x);
        }

        let magic = ROUND_MAGIC + scale_offset(range).map_or(0.0, |o| EXP_BIAS + o);
        let magic_c = self.c(magic);
        let t = self.fmac(x, std::f32::consts::LOG2_E, magic_c);
        let k = self.addc(t, -magic);
        let r_hi = self.fmac(k, -LN2_HI, x);
        let r = self.fmac(k, -ln2_lo(), r_hi);
        let h = std::f64::consts::LN_2 / 2.0;
        let er = self.poly(r, &exp_coefficients(EXP_DEGREE, h));
        self.scale(er, k, t, range)
    }

    /// `er · 2^k` rounded once, for exp (`er` = `e^r` in about [0.7, 1.42], `k` integral in
    /// [-151, 128] or NaN, `t` the float holding `k + 127 + offset` in its low bits): an exact
    /// scaling into the normal range, then one that rounds. Where the argument's range bounds
    /// `k` on one side (`k ≤ 0` or `k ≥ 0`) one power of two does, `2^(k ± 64)` from `t`'s bits
    /// (`exp2bits`): `er · 2^(k ± 64)` is exact, then `· 2^∓64` (a constant) rounds; otherwise
    /// `2^k` in two steps, `2^⌊k/2⌋ · 2^(k - ⌊k/2⌋)`, the first exact. Both give the same bits
    /// (the correctly rounded `er · 2^k`); the one-sided form is a shift and two multiplies
    /// (sigmoid's, tanh's and erf's exp), the other two clamped conversions besides.
    fn scale(&mut self, er: NodeId, k: NodeId, t: NodeId, range: Range) -> NodeId {
        let Some(offset) = scale_offset(range) else {
            let half_k = self.mulc(k, 0.5);
            let k1 = self.un(Un::Floor, half_k);
            let k2 = self.sub(k, k1);
            let s1 = self.un(Un::Exp2i, k1);
            let s2 = self.un(Un::Exp2i, k2);
            let y = self.mul(er, s1);
            return self.mul(y, s2);
        };
        let s = self.un(Un::Exp2Bits, t);
        let y = self.mul(er, s);
        self.mulc(y, (-offset).exp2())
    }

    /// log: `x = 2^e · m` with `m` in [√½, √2) (subnormals scaled by 2^23 first), then with
    /// `f = m - 1`, `s = f / (2 + f)`: `log m = f - f²/2 + s (f²/2 + R(s²))`, `R` the tail of
    /// `2 atanh(s) = 2 (s + s³/3 + …)` (terms to s^11: truncation < 0.1 ulp), plus `e ln 2`
    /// with ln 2 split.
    fn log(&mut self, x: NodeId) -> NodeId {
        let subnormal = self.cmpc(Cmp::Lt, x, f32::MIN_POSITIVE);
        let x_up = self.mulc(x, 8_388_608.0);
        let xs = self.sel(subnormal, x_up, x);
        let e_raw = self.un(Un::Exponent, xs);
        let e_fix = self.addc(e_raw, -23.0);
        let e0 = self.sel(subnormal, e_fix, e_raw);
        let m0 = self.un(Un::Mantissa, xs);
        let big = self.cmpc(Cmp::Gt, m0, std::f32::consts::SQRT_2);
        let m_half = self.mulc(m0, 0.5);
        let m = self.sel(big, m_half, m0);
        let e_up = self.addc(e0, 1.0);
        let e = self.sel(big, e_up, e0);

        let f = self.addc(m, -1.0);
        let two_f = self.addc(f, 2.0);
        let s = self.div(f, two_f);
        let z = self.mul(s, s);
        let coeffs: Vec<f64> = (1..=5).map(|k| 2.0 / (2 * k + 1) as f64).collect();
        let p = self.poly(z, &coeffs);
        let r = self.mul(z, p);
        let ff = self.mul(f, f);
        let hfsq = self.mulc(ff, 0.5);
        let inner = self.add(hfsq, r);
        let s_inner = self.mul(s, inner);
        let e_lo = self.mulc(e, ln2_lo());
        let corr = self.add(s_inner, e_lo);
        let t = self.sub(hfsq, corr);
        let t_f = self.sub(t, f);
        let e_hi = self.mulc(e, LN2_HI);
        let main = self.sub(e_hi, t_f);

        let finite = self.cmpc(Cmp::Lt, x, f32::INFINITY);
        let inf = self.c(f32::INFINITY);
        let positive_value = self.sel(finite, main, inf);
        let zero = self.cmpc(Cmp::Eq, x, 0.0);
        let neg_inf = self.c(f32::NEG_INFINITY);
        let nan = self.c(f32::NAN);
        let other = self.sel(zero, neg_inf, nan);
        let positive = self.cmpc(Cmp::Gt, x, 0.0);
        self.sel(positive, positive_value, other)
    }

    /// tanh: `x + (x z) · P(z)` (`z = x²`, the Taylor series to x^19, the last step an fma) for |x| < 0.55, else
    /// `±(1 - 2 / (e^{2|x|} + 1))`, which is 1 once e^{2|x|} overflows.
    fn tanh(&mut self, x: NodeId) -> NodeId {
        let a = self.un(Un::Abs, x);
        let z = self.mul(x, x);
        let coeffs = tanh_coefficients(TANH_TERMS);
        let p = self.poly(z, &coeffs[1..]);
        let xz = self.mul(x, z);
        let series = self.fma(xz, p, x);

        let two_a = self.add(a, a);
        let e = self.exp(two_a, Range::NonNegative);
        let e1 = self.addc(e, 1.0);
        let two = self.c(2.0);
        let q = self.div(two, e1);
        let one = self.c(1.0);
        let t = self.sub(one, q);
        let signed = self.with_sign_of(x, t);

        let small = self.cmpc(Cmp::Lt, a, TANH_SERIES_MAX);
        let value = self.sel(small, series, signed);
        // The series gives +0 for -0 (a product with the negative P flips the zero's sign).
        let zero = self.cmpc(Cmp::Eq, x, 0.0);
        self.sel(zero, x, value)
    }

    /// erf: `x · S(x²)` (Taylor series, 10 terms; A&S's error and the rounding of `1 - q` pass
    /// 3e-7 below |x| ≈ 0.6) for |x| ≤ 1, else A&S 7.1.26 with the sign of
    /// x, and ±1 for |x| ≥ 4.
    fn erf(&mut self, x: NodeId) -> NodeId {
        let a = self.un(Un::Abs, x);
        let z = self.mul(x, x);
        let coeffs = erf_coefficients(ERF_TERMS);
        let s = self.poly(z, &coeffs);
        let series = self.mul(x, s);

        let pa = self.mulc(a, AS_P as f32);
        let den = self.addc(pa, 1.0);
        let one = self.c(1.0);
        let t = self.div(one, den);
        let p = self.poly(t, &AS_A);
        let tp = self.mul(t, p);
        let neg_z = self.un(Un::Neg, z);
        let e = self.exp(neg_z, Range::NonPositive);
        let neg_tp = self.un(Un::Neg, tp);
        let approx = self.fma(neg_tp, e, one);
        let beyond = self.cmpc(Cmp::Ge, a, ERF_ONE_FROM);
        let magnitude = self.sel(beyond, one, approx);
        let signed = self.with_sign_of(x, magnitude);

        let small = self.cmpc(Cmp::Le, a, ERF_SERIES_MAX);
        self.sel(small, series, signed)
    }

    /// sigmoid: `n / D` with `e = exp(-|x|)`, `D = 1 + e`, `n = 1` for x ≥ 0 and `n = e` for
    /// x < 0 (so tiny results keep their precision instead of `1 / (1 + huge)`), without a
    /// division: `inv ≈ 1 / d` (`d = 1 + e` rounded, in [1, 2]; relative error ≤ 1.1e-4, and
    /// `inv` in [1/2, 1]), `q = n · inv`, the residual `c = n - q D = (n - q) - q e` by one fma
    /// (`n - q` is exact: `q` is in [n/2, n], Sterbenz; subnormals subtract exactly), and the
    /// result `q + c · inv` (another): `c / D` is at most `1.1e-4 q`, so taking `inv` for `1 /
    /// D` in it errs by about `1.2e-8 q`, 0.2 ulp. (A correctly rounded division is about ten
    /// instructions and a call on a GPU; the reciprocal is five.)
    fn sigmoid(&mut self, x: NodeId) -> NodeId {
        let a = self.un(Un::Abs, x);
        let na = self.un(Un::Neg, a);
        let e = self.exp(na, Range::NonPositive);
        let d = self.addc(e, 1.0);
        let negative = self.cmpc(Cmp::Lt, x, 0.0);
        let one = self.c(1.0);
        let n = self.sel(negative, e, one);
        let inv = self.reciprocal_1_2(d);
        let q = self.mul(n, inv);
        let n_minus_q = self.sub(n, q);
        let neg_q = self.un(Un::Neg, q);
        let c = self.fma(neg_q, e, n_minus_q);
        self.fma(c, inv, q)
    }

    /// `1 / d` for `d` in [1, 2] (or NaN) to a relative error of 1.1e-4, at least 1/2, without
    /// a division: the quadratic guess of least relative error (1/99,
    /// [`reciprocal_guess_coefficients`]), one Newton step `y + y (1 - d y)` of two fmas (the
    /// error squares), and a clamp to 1/2 (Newton's step comes from below: near `d = 2` it may
    /// fall short of 1/2, which `1 / d` is not). NaN stays NaN.
    fn reciprocal_1_2(&mut self, d: NodeId) -> NodeId {
        let guess = reciprocal_guess_coefficients(RECIPROCAL_GUESS_DEGREE);
        let y = self.poly(d, &guess);
        let neg_d = self.un(Un::Neg, d);
        let one = self.c(1.0);
        let err = self.fma(neg_d, y, one);
        let y = self.fma(y, err, y);
        let below_half = self.cmpc(Cmp::Lt, y, 0.5);
        let half = self.c(0.5);
        self.sel(below_half, half, y)
    }

    /// min: `b` if `b < a`, else `a` if `a <= b`, else (a NaN) `a + b`, which is NaN.
    fn min(&mut self, a: NodeId, b: NodeId) -> NodeId {
        let nan = self.add(a, b);
        let le = self.g.cmp(Cmp::Le, a, b);
        let ordered = self.sel(le, a, nan);
        let lt = self.g.cmp(Cmp::Lt, b, a);
        self.sel(lt, b, ordered)
    }

    /// max: `b` if `a < b`, else `a` if `b <= a`, else (a NaN) `a + b`, which is NaN.
    fn max(&mut self, a: NodeId, b: NodeId) -> NodeId {
        let nan = self.add(a, b);
        let le = self.g.cmp(Cmp::Le, b, a);
        let ordered = self.sel(le, a, nan);
        let lt = self.g.cmp(Cmp::Lt, a, b);
        self.sel(lt, b, ordered)
    }

    /// pow (see the module docs for which exponents take which form).
    fn pow(&mut self, x: NodeId, y: NodeId) -> NodeId {
        match self.g.node(y).constant() {
            Some(c) if c == c.trunc() && c.abs() <= 4.0 => self.int_pow(x, c as i32),
            Some(0.5) => self.un(Un::Sqrt, x),
            Some(-0.5) => {
                let s = self.un(Un::Sqrt, x);
                let one = self.c(1.0);
                self.div(one, s)
            }
            _ => {
                let l = self.log(x);
                let yl = self.mul(y, l);
                self.exp(yl, Range::Any)
            }
        }
    }

    /// `x^n` for |n| ≤ 4 by squaring.
    fn int_pow(&mut self, x: NodeId, n: i32) -> NodeId {
        let positive = match n.abs() {
            0 => return self.c(1.0),
            1 => x,
            2 => self.mul(x, x),
            3 => {
                let x2 = self.mul(x, x);
                self.mul(x2, x)
            }
            _ => {
                let x2 = self.mul(x, x);
                self.mul(x2, x2)
            }
        };
        if n < 0 {
            let one = self.c(1.0);
            self.div(one, positive)
        } else {
            positive
        }
    }
}

#[cfg(test)]
mod tests;
