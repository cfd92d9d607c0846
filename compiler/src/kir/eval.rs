//! The reference evaluator of the kernel IR: the exact semantics every generated kernel has,
//! and the CPU backend's implementation of them.
//!
//! [`run`] evaluates an expanded kernel over a block of rows with [`super::prim`]'s f32
//! semantics (each op rounded once, no contraction) and row sums in the [`REDUCE_LANES`] order
//! of the module docs of `kir` (each lane starts from `+0.0`). It interprets node by node, each
//! node a loop over the columns of a row; values that do not vary along the row (constants,
//! row values) are one number, and values that do not vary across rows (constants, column
//! inputs and what is computed from them only) are computed once per call. Comparisons are held
//! as 1.0 / 0.0. Buffers are f32: the caller widens bf16 inputs and rounds bf16 outputs.
//!
//! [`eval_f64`] is a high-precision reference for tests: a graph's value in f64, composites by
//! f64 math.
use super::{prim, Access, Bin, Cmp, Kernel, Level, Node, NodeId, Un, REDUCE_LANES};
use super::{ColMap, Graph};

/// Runs an expanded `kernel` on rows `[first_row, first_row + rows)`.
///
/// `Elem` and `Row` inputs and all outputs are the slices of those rows (`rows × width` and
/// `rows` elements); `Col` inputs are whole (`cols` elements) and `PerPosition` inputs are
/// whole tables, read at the absolute row `first_row + r`. Errors (without writing anything)
/// on a kernel that is not expanded or not valid, and on slices whose lengths do not match.
pub fn run(
    kernel: &Kernel,
    first_row: usize,
    rows: usize,
    inputs: &[&[f32]],
    outputs: &mut [&mut [f32]],
) -> Result<(), String> {
    if !kernel.is_expanded() {
        return Err("kir::eval::run: the kernel has composite ops (expand it first)".into());
    }
    kernel
        .validate()
        .map_err(|e| format!("kir::eval::run: invalid kernel: {e}"))?;
    check_inputs(kernel, first_row, rows, inputs)?;
    check_outputs(kernel, rows, outputs)?;
    let mut state = State::new(kernel);
    state.eval_fixed(inputs);
    for r in 0..rows {
        state.eval_row(inputs, r, first_row + r);
        state.store(outputs, r);
    }
    Ok(())
}

fn checked_len(rows: usize, width: u64, what: &str) -> Result<usize, String> {
    usize::try_from(width)
        .ok()
        .and_then(|w| w.checked_mul(rows))
        .ok_or_else(|| format!("kir::eval::run: {what}: {rows} rows of {width} overflow"))
}

fn check_inputs(
    kernel: &Kernel,
    first_row: usize,
    rows: usize,
    inputs: &[&[f32]],
) -> Result<(), String> {
    if inputs.len() != kernel.inputs.len() {
        return Err(format!(
            "kir::eval::run: {} input slices for a kernel of {} inputs",
            inputs.len(),
            kernel.inputs.len()
        ));
    }
    for (i, (access, data)) in kernel.inputs.iter().zip(inputs).enumerate() {
        let what = format!("input {i} ({access:?})");
        let ok = match *access {
            Access::Elem { width } => data.len() == checked_len(rows, width, &what)?,
            Access::Row => data.len() == rows,
            Access::Col => data.len() as u64 == kernel.cols,
            Access::PerPosition { batch, width } => {
                let table_rows = data.len() as u64 / width.max(1);
                let needed = match rows {
                    0 => 0,
                    _ => (first_row + rows - 1) as u64 / batch.max(1) + 1,
                };
                width > 0 && (data.len() as u64).is_multiple_of(width) && table_rows >= needed
            }
        };
        if !ok {
            return Err(format!(
                "kir::eval::run: {what} has {} elements, which does not fit rows {first_row}..{} of a {}-column domain",
                data.len(),
                first_row + rows,
                kernel.cols
            ));
        }
    }
    Ok(())
}

fn check_outputs(kernel: &Kernel, rows: usize, outputs: &[&mut [f32]]) -> Result<(), String> {
    if outputs.len() != kernel.outputs.len() {
        return Err(format!(
            "kir::eval::run: {} output slices for a kernel of {} outputs",
            outputs.len(),
            kernel.outputs.len()
        ));
    }
    for (o, (access, data)) in kernel.outputs.iter().zip(outputs).enumerate() {
        let what = format!("output {o} ({access:?})");
        let expected = match *access {
            Access::Elem { width } => checked_len(rows, width, &what)?,
            _ => rows,
        };
        if data.len() != expected {
            return Err(format!(
                "kir::eval::run: {what} has {} elements for {rows} rows, expected {expected}",
                data.len()
            ));
        }
    }
    Ok(())
}

/// The values of the nodes: one number (constant or row value) or one per column, each in a
/// buffer (slot). A value that varies across rows gives its slot back after its last use in
/// the row, so a row's working set is its live values, not its whole graph.
struct State<'k> {
    kernel: &'k Kernel,
    levels: Vec<Level>,
    slot_of: Vec<usize>,
    slots: Vec<Vec<f32>>,
    cols: usize,
}

impl<'k> State<'k> {
    fn new(kernel: &'k Kernel) -> State<'k> {
        let levels = kernel.levels();
        let cols = kernel.cols as usize;
        let per_row = |l: Level| matches!(l, Level::Row | Level::Elem);
        let nodes = kernel.graph.nodes();
        let mut last_use = vec![0usize; nodes.len()];
        for (i, node) in nodes.iter().enumerate() {
            for a in node.operands() {
                last_use[a.index()] = i;
            }
        }
        for s in &kernel.stores {
            last_use[s.value.index()] = usize::MAX;
        }
        let mut slots: Vec<Vec<f32>> = Vec::new();
        let mut free: [Vec<usize>; 2] = [Vec::new(), Vec::new()];
        let mut slot_of = Vec::with_capacity(nodes.len());
        for (i, node) in nodes.iter().enumerate() {
            let wide = matches!(levels[i], Level::Col | Level::Elem) as usize;
            let reused = match per_row(levels[i]) {
                true => free[wide].pop(),
                false => None,
            };
            let slot = reused.unwrap_or_else(|| {
                slots.push(vec![0.0; if wide == 1 { cols } else { 1 }]);
                slots.len() - 1
            });
            slot_of.push(slot);
            for a in node.operands() {
                let a = a.index();
                if per_row(levels[a]) && last_use[a] == i {
                    let wide_a = matches!(levels[a], Level::Elem) as usize;
                    if !free[wide_a].contains(&slot_of[a]) {
                        free[wide_a].push(slot_of[a]);
                    }
                }
            }
        }
        State {
            kernel,
            levels,
            slot_of,
            slots,
            cols,
        }
    }

    /// The nodes that are the same on every row: constants and column values.
    fn eval_fixed(&mut self, inputs: &[&[f32]]) {
        for i in 0..self.levels.len() {
            if matches!(self.levels[i], Level::Const | Level::Col) {
                self.eval_node(i, inputs, 0, 0);
            }
        }
    }

    /// The nodes that vary across rows, at local row `r` (absolute row `abs`).
    fn eval_row(&mut self, inputs: &[&[f32]], r: usize, abs: usize) {
        for i in 0..self.levels.len() {
            if matches!(self.levels[i], Level::Row | Level::Elem) {
                self.eval_node(i, inputs, r, abs);
            }
        }
    }

    fn eval_node(&mut self, i: usize, inputs: &[&[f32]], r: usize, abs: usize) {
        let node = self.kernel.graph.nodes()[i];
        // The node's slot is none of its operands' (they are live when it is assigned).
        let mut out = std::mem::take(&mut self.slots[self.slot_of[i]]);
        let (slots, slot_of) = (&self.slots, &self.slot_of);
        let v = |id: NodeId| slots[slot_of[id.index()]].as_slice();
        match node {
            Node::Param(_) => out.fill(f32::NAN),
            Node::Const(bits) => out.fill(f32::from_bits(bits)),
            Node::Load {
                input,
                col_offset,
                map,
            } => {
                let access = self.kernel.inputs[input as usize];
                let loc = load_loc(access, inputs[input as usize], col_offset, map, (r, abs));
                load(&mut out, &loc);
            }
            Node::Un(op, a) => un(&mut out, op, v(a)),
            Node::Bin(op, a, b) => bin(&mut out, op, v(a), v(b)),
            Node::Cmp(op, a, b) => cmp(&mut out, op, v(a), v(b)),
            Node::Select(c, a, b) => select(&mut out, v(c), v(a), v(b)),
            Node::Fma(a, b, c) => fma(&mut out, v(a), v(b), v(c)),
            Node::RowSum(a) => out[0] = row_sum(v(a)),
        }
        self.slots[self.slot_of[i]] = out;
    }

    fn store(&self, outputs: &mut [&mut [f32]], r: usize) {
        for s in &self.kernel.stores {
            let value = &self.slots[self.slot_of[s.value.index()]];
            let out = &mut outputs[s.output as usize];
            match self.kernel.outputs[s.output as usize] {
                Access::Elem { width } => {
                    let start = r * width as usize + s.col_offset as usize;
                    let dst = &mut out[start..start + self.cols];
                    match value.len() {
                        1 => dst.fill(value[0]),
                        _ => dst.copy_from_slice(value),
                    }
                }
                _ => out[r] = value[0],
            }
        }
    }
}

/// Where a load reads: the row's first element and the column map.
struct Loc<'a> {
    data: &'a [f32],
    base: usize,
    offset: usize,
    map: ColMap,
}

/// Where input `data` (read as `access`) is read at local row `r`, absolute row `abs`.
fn load_loc(
    access: Access,
    data: &[f32],
    col_offset: u64,
    map: ColMap,
    (r, abs): (usize, usize),
) -> Loc<'_> {
    let base = match access {
        Access::Elem { width } => r * width as usize,
        Access::Row => r,
        Access::Col => 0,
        Access::PerPosition { batch, width } => (abs / batch as usize) * width as usize,
    };
    Loc {
        data,
        base,
        offset: col_offset as usize,
        map,
    }
}

fn load(out: &mut [f32], loc: &Loc<'_>) {
    let start = loc.base + loc.offset;
    match loc.map {
        ColMap::Id => {
            let n = out.len();
            out.copy_from_slice(&loc.data[start..start + n]);
        }
        map => {
            for (c, o) in out.iter_mut().enumerate() {
                *o = loc.data[start + map.apply(c as u64) as usize];
            }
        }
    }
}

/// `out = f(a)`, `a` one value or one per element of `out`.
fn map1(out: &mut [f32], a: &[f32], f: impl Fn(f32) -> f32) {
    if a.len() == out.len() {
        for (o, &x) in out.iter_mut().zip(a) {
            *o = f(x);
        }
    } else {
        out.fill(f(a[0]));
    }
}

/// `out = f(a, b)`, each operand one value or one per element of `out`.
fn zip(out: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) {
    let n = out.len();
    match (a.len() == n, b.len() == n) {
        (true, true) => {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                *o = f(x, y);
            }
        }
        (true, false) => map1(out, a, |x| f(x, b[0])),
        (false, true) => map1(out, b, |y| f(a[0], y)),
        (false, false) => out.fill(f(a[0], b[0])),
    }
}

fn un(out: &mut [f32], op: Un, a: &[f32]) {
    match op {
        Un::Neg => map1(out, a, |x| -x),
        Un::Abs => map1(out, a, f32::abs),
        Un::Sqrt => map1(out, a, f32::sqrt),
        Un::Floor => map1(out, a, floor),
        Un::Exp2i => map1(out, a, exp2i),
        Un::Exp2Bits => map1(out, a, prim::exp2bits),
        _ => map1(out, a, |x| prim::un(op, x)),
    }
}

/// `f32::floor` in a form the compiler vectorizes (the baseline x86-64 target has no rounding
/// instruction, so `floor` is a call per element): below 2^23, where every f32 with a fraction
/// lies, `(|x| + 2^23) - 2^23` rounds |x| to an integer exactly; with x's sign back, one less
/// where that went up. The same bits as `prim` (tested), -0 and NaN included.
fn floor(x: f32) -> f32 {
    const TWO_23: f32 = 8_388_608.0;
    if x.abs() < TWO_23 {
        let r = ((x.abs() + TWO_23) - TWO_23).copysign(x);
        if r > x {
            r - 1.0
        } else {
            r
        }
    } else {
        x
    }
}

/// `prim::exp2i` without `clamp`'s NaN check in the loop: same bits (tested).
#[allow(clippy::manual_clamp)] // `clamp` is what this avoids: it does not vectorize here.
fn exp2i(k: f32) -> f32 {
    let k = if k < -126.0 {
        -126.0
    } else if k > 127.0 {
        127.0
    } else {
        k
    };
    f32::from_bits(((k as i32 + 127) as u32) << 23)
}

fn bin(out: &mut [f32], op: Bin, a: &[f32], b: &[f32]) {
    match op {
        Bin::Add => zip(out, a, b, |x, y| x + y),
        Bin::Sub => zip(out, a, b, |x, y| x - y),
        Bin::Mul => zip(out, a, b, |x, y| x * y),
        Bin::Div => zip(out, a, b, |x, y| x / y),
        _ => zip(out, a, b, |x, y| prim::bin(op, x, y)),
    }
}

/// A comparison as 1.0 / 0.0, one loop per op so each vectorizes.
fn cmp(out: &mut [f32], op: Cmp, a: &[f32], b: &[f32]) {
    let f = |t: bool| if t { 1.0 } else { 0.0 };
    match op {
        Cmp::Lt => zip(out, a, b, |x, y| f(x < y)),
        Cmp::Le => zip(out, a, b, |x, y| f(x <= y)),
        Cmp::Gt => zip(out, a, b, |x, y| f(x > y)),
        Cmp::Ge => zip(out, a, b, |x, y| f(x >= y)),
        Cmp::Eq => zip(out, a, b, |x, y| f(x == y)),
        Cmp::Ne => zip(out, a, b, |x, y| f(x != y)),
    }
}

fn select(out: &mut [f32], c: &[f32], a: &[f32], b: &[f32]) {
    let n = out.len();
    if c.len() == n && a.len() == n && b.len() == n {
        for (((o, &c), &a), &b) in out.iter_mut().zip(c).zip(a).zip(b) {
            *o = if c != 0.0 { a } else { b };
        }
        return;
    }
    let at = |s: &[f32], i: usize| if s.len() == n { s[i] } else { s[0] };
    for (i, o) in out.iter_mut().enumerate() {
        *o = if at(c, i) != 0.0 { at(a, i) } else { at(b, i) };
    }
}

/// `out = a · b + c` rounded once (`f32::mul_add`, [`prim::fma`]).
fn fma(out: &mut [f32], a: &[f32], b: &[f32], c: &[f32]) {
    let n = out.len();
    if a.len() == n && b.len() == n && c.len() == n {
        for (((o, &a), &b), &c) in out.iter_mut().zip(a).zip(b).zip(c) {
            *o = a.mul_add(b, c);
        }
        return;
    }
    let at = |s: &[f32], i: usize| if s.len() == n { s[i] } else { s[0] };
    for (i, o) in out.iter_mut().enumerate() {
        *o = at(a, i).mul_add(at(b, i), at(c, i));
    }
}

/// The sum of a row in the fixed order: lane `l` sums columns `l, l + LANES, …` from +0.0, then
/// the lanes combine in a halving tree.
pub fn row_sum(values: &[f32]) -> f32 {
    let mut lanes = [0.0f32; REDUCE_LANES];
    for chunk in values.chunks(REDUCE_LANES) {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += x;
        }
    }
    let mut s = REDUCE_LANES / 2;
    while s >= 1 {
        for i in 0..s {
            lanes[i] += lanes[i + s];
        }
        s /= 2;
    }
    lanes[0]
}

/// The value of `root` in f64: `Param(i)` and a load of input `i` are `params[i]` (NaN if
/// missing; column maps ignored), a row sum is its operand (a row of one column), comparisons
/// are 1 or 0, composites are f64 math (erf from `libm`; min and max NaN if either operand is),
/// `exponent` and `mantissa` split `x = mantissa · 2^exponent` with |mantissa| in [1, 2), and
/// `exp2i` is `2^k` for `k` clamped to [-126, 127]. NaN for a root outside the graph.
pub fn eval_f64(g: &Graph, root: NodeId, params: &[f64]) -> f64 {
    let Some(nodes) = g.nodes().get(..=root.index()) else {
        return f64::NAN;
    };
    let mut values: Vec<f64> = Vec::with_capacity(nodes.len());
    for node in nodes {
        let v = |id: NodeId| values[id.index()];
        let value = match *node {
            Node::Param(i) | Node::Load { input: i, .. } => {
                params.get(i as usize).copied().unwrap_or(f64::NAN)
            }
            Node::Const(bits) => f32::from_bits(bits) as f64,
            Node::Un(op, a) => un_f64(op, v(a)),
            Node::Bin(op, a, b) => bin_f64(op, v(a), v(b)),
            Node::Cmp(op, a, b) => cmp_f64(op, v(a), v(b)),
            Node::Select(c, a, b) => {
                if v(c) != 0.0 {
                    v(a)
                } else {
                    v(b)
                }
            }
            Node::Fma(a, b, c) => v(a) * v(b) + v(c),
            Node::RowSum(a) => v(a),
        };
        values.push(value);
    }
    values[root.index()]
}

fn un_f64(op: Un, x: f64) -> f64 {
    match op {
        Un::Neg => -x,
        Un::Abs => x.abs(),
        Un::Sqrt => x.sqrt(),
        Un::Floor => x.floor(),
        Un::Exp2i if x.is_nan() => 1.0,
        Un::Exp2i => 2f64.powi(x.clamp(-126.0, 127.0) as i32),
        Un::Exp2Bits => prim::exp2bits(x as f32) as f64,
        Un::Exponent => (libm::frexp(x).1 - 1) as f64,
        Un::Mantissa => libm::frexp(x).0 * 2.0,
        Un::Exp => x.exp(),
        Un::Log => x.ln(),
        Un::Tanh => x.tanh(),
        Un::Erf => libm::erf(x),
        Un::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        Un::Rsqrt => 1.0 / x.sqrt(),
    }
}

fn bin_f64(op: Bin, a: f64, b: f64) -> f64 {
    match op {
        Bin::Add => a + b,
        Bin::Sub => a - b,
        Bin::Mul => a * b,
        Bin::Div => a / b,
        Bin::Min if a.is_nan() || b.is_nan() => f64::NAN,
        Bin::Max if a.is_nan() || b.is_nan() => f64::NAN,
        Bin::Min => a.min(b),
        Bin::Max => a.max(b),
        Bin::Pow => a.powf(b),
    }
}

fn cmp_f64(op: Cmp, a: f64, b: f64) -> f64 {
    if op.holds(a, b) {
        1.0
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests;
