//! Each fusible op as a kernel fragment: which buffers it reads and writes with which
//! [`Access`], and the expression it stores at every column block of a domain `cols` wide
//! ([`emit`]), with exactly the arithmetic of the hand-written CPU kernels
//! (`runtime/src/cpu/elementwise.rs`, `rope.rs`, `movement.rs`), operation for operation, so a
//! fused program computes what the unfused one does. The only differences are the composite
//! `kir` ops (`exp`, `erf`), whose expansion may differ from libm by a few ulp.
//!
//! Fusible: `Activation`/`ActivationBwd` (every `Act`), `SwiGlu`/`SwiGluBwd`, `Add`, `Scale`,
//! `Copy`, `SplitColumns`, `ConcatColumns`, `Rope`/`RopeBwd` (through an `Op::RopeTable`) and
//! `Op::Fused` kernels without row sums or row/column operands. An instruction whose output is
//! also one of its inputs is not fused (its op would read what it writes).
use crate::ir::op::{Act, Op, RopeAttrs};
use crate::ir::{BufferId, Compute, Program};
use crate::kir::{Access, Bin, Cmp, ColMap, Graph, Kernel, Node, NodeId, Un};

/// How one member reaches its buffers while its expression is built: the kernel builder
/// resolves a read to a load of a kernel input or to a value an earlier member stored.
pub(super) trait Env {
    /// Input `input` of the op at column `offset + map(c)` of domain column `c`.
    fn read(
        &mut self,
        g: &mut Graph,
        input: usize,
        offset: u64,
        map: ColMap,
    ) -> Result<NodeId, String>;
    /// Column `offset + (c mod head_dim)` of the rotation table of `attrs` (`Op::RopeTable`).
    fn table(&mut self, g: &mut Graph, attrs: &RopeAttrs, offset: u64) -> Result<NodeId, String>;
    /// `value` is output `output` at columns `offset .. offset + cols`.
    fn store(&mut self, output: usize, offset: u64, value: NodeId) -> Result<(), String>;
}

/// A fusible instruction as a kernel fragment.
pub(super) struct Fragment<'a> {
    pub op: &'a Op,
    /// The instruction's input buffers, then its output buffers, in the op's order.
    pub reads: Vec<BufferId>,
    pub writes: Vec<BufferId>,
    /// How the op reads each input (`Elem` or `PerPosition`).
    pub inputs: Vec<Access>,
    /// Each output's width (outputs are `Elem`).
    pub outputs: Vec<u64>,
    /// The op's rows.
    pub rows: u64,
    /// Whether the op's attributes fix its rows (a rope's positions × batch).
    pub fixes_rows: bool,
    /// Column counts the kernel's domain must divide (operand widths, a fused kernel's domain).
    pub granules: Vec<u64>,
    /// Periods that must divide the domain's columns (a head for RoPE's rotate-half partner).
    pub periods: Vec<u64>,
}

/// Whether `op` is of a kind that fuses (its instruction may still not: see [`fragment`]).
pub(super) fn fusible(op: &Op) -> bool {
    matches!(
        op,
        Op::Activation(_)
            | Op::ActivationBwd(_)
            | Op::SwiGlu
            | Op::SwiGluBwd
            | Op::Add
            | Op::Scale { .. }
            | Op::Copy
            | Op::Rope(_)
            | Op::RopeBwd(_)
            | Op::SplitColumns { .. }
            | Op::ConcatColumns { .. }
            | Op::Fused(_)
    )
}

/// The fragment of a compute instruction, or `None` if it is not fusible.
pub(super) fn fragment<'a>(program: &Program, c: &Compute<'a>) -> Option<Fragment<'a>> {
    if c.outputs.iter().any(|o| c.inputs.contains(o)) {
        return None;
    }
    let signature = c.op.signature();
    if signature
        .outputs
        .iter()
        .any(|o| o.write != crate::ir::table::Write::Overwrite)
    {
        return None;
    }
    let numel = |b: &BufferId| program.buffer(*b).map(|b| b.numel());
    let in_numel: Vec<u64> = c.inputs.iter().map(numel).collect::<Option<_>>()?;
    let out_numel: Vec<u64> = c.outputs.iter().map(numel).collect::<Option<_>>()?;
    let (inputs, outputs, periods, fixes_rows) = match c.op {
        Op::Activation(_)
        | Op::ActivationBwd(_)
        | Op::SwiGlu
        | Op::SwiGluBwd
        | Op::Add
        | Op::Scale { .. }
        | Op::Copy => {
            let width = same_matrix(program, c)?;
            (
                vec![elem(width); c.inputs.len()],
                vec![width; c.outputs.len()],
                vec![],
                false,
            )
        }
        Op::Rope(a) | Op::RopeBwd(a) => {
            let width = a.heads.checked_mul(a.head_dim)?;
            let rot = a.rotary();
            if !rot.is_multiple_of(2) || rot == 0 || rot > a.head_dim {
                return None;
            }
            (vec![elem(width)], vec![width], vec![a.head_dim], true)
        }
        Op::SplitColumns { widths } => (
            vec![elem(widths.iter().sum())],
            widths.clone(),
            vec![],
            false,
        ),
        Op::ConcatColumns { widths } => (
            widths.iter().map(|w| elem(*w)).collect(),
            vec![widths.iter().sum()],
            vec![],
            false,
        ),
        Op::Fused(a) => fused_operands(&a.kernel)?,
        _ => return None,
    };
    let rows = rows_of(&inputs, &in_numel, &outputs, &out_numel)?;
    if fixes_rows && signature.rows != Some(rows) {
        return None;
    }
    let mut granules: Vec<u64> = inputs.iter().filter_map(elem_width).collect();
    granules.extend(&outputs);
    if let Op::Fused(a) = c.op {
        granules.push(a.kernel.cols);
    }
    Some(Fragment {
        op: c.op,
        reads: c.inputs.to_vec(),
        writes: c.outputs.to_vec(),
        inputs,
        outputs,
        rows,
        fixes_rows,
        granules,
        periods,
    })
}

type Operands = (Vec<Access>, Vec<u64>, Vec<u64>, bool);

/// A fused kernel's operands, if it can join a group: elementwise and per-position inputs,
/// elementwise outputs, no row sums; its column maps' periods.
fn fused_operands(k: &Kernel) -> Option<Operands> {
    let inputs_ok = k
        .inputs
        .iter()
        .all(|a| matches!(a, Access::Elem { .. } | Access::PerPosition { .. }));
    let outputs: Option<Vec<u64>> = k.outputs.iter().map(elem_width).collect();
    let outputs = outputs?;
    if !inputs_ok || k.graph.nodes().iter().any(|n| matches!(n, Node::RowSum(_))) {
        return None;
    }
    let periods = k
        .graph
        .nodes()
        .iter()
        .filter_map(|n| match n {
            Node::Load { map, .. } => map.period(),
            _ => None,
        })
        .collect();
    Some((k.inputs.clone(), outputs, periods, false))
}

fn elem(width: u64) -> Access {
    Access::Elem { width }
}

fn elem_width(a: &Access) -> Option<u64> {
    match a {
        Access::Elem { width } => Some(*width),
        _ => None,
    }
}

/// The width of every operand of an op whose signature says only "same elements" (its
/// operands are `[n, 1]` in the table): the operands' common matrix shape `[rows, width]`.
fn same_matrix(program: &Program, c: &Compute) -> Option<u64> {
    let shapes: Option<Vec<&Vec<u64>>> = c
        .inputs
        .iter()
        .chain(c.outputs.iter())
        .map(|b| program.buffer(*b).map(|b| &b.shape))
        .collect();
    let shapes = shapes?;
    let first = shapes.first()?;
    if shapes.iter().any(|s| s != first) {
        return None;
    }
    let rows = *first.first()?;
    let numel: u64 = first.iter().product();
    (rows > 0 && numel > 0).then(|| numel / rows)
}

/// The rows every elementwise operand agrees on (each buffer `rows × width` exactly).
fn rows_of(inputs: &[Access], in_numel: &[u64], outputs: &[u64], out_numel: &[u64]) -> Option<u64> {
    let elems = inputs
        .iter()
        .zip(in_numel)
        .filter_map(|(a, n)| elem_width(a).map(|w| (w, *n)))
        .chain(outputs.iter().copied().zip(out_numel.iter().copied()));
    let mut rows = None;
    for (width, numel) in elems {
        if width == 0
            || !numel.is_multiple_of(width)
            || *rows.get_or_insert(numel / width) != numel / width
        {
            return None;
        }
    }
    rows.filter(|r| *r > 0)
}

/// Emits `f`'s loads, arithmetic and stores over a domain of `cols` columns.
pub(super) fn emit(
    f: &Fragment,
    cols: u64,
    g: &mut Graph,
    env: &mut dyn Env,
) -> Result<(), String> {
    match f.op {
        Op::SplitColumns { widths } => {
            let mut offset = 0;
            for (part, width) in widths.iter().enumerate() {
                for block in blocks(*width, cols) {
                    let x = env.read(g, 0, offset + block, ColMap::Id)?;
                    env.store(part, block, x)?;
                }
                offset += width;
            }
            Ok(())
        }
        Op::ConcatColumns { widths } => {
            let mut offset = 0;
            for (part, width) in widths.iter().enumerate() {
                for block in blocks(*width, cols) {
                    let x = env.read(g, part, block, ColMap::Id)?;
                    env.store(0, offset + block, x)?;
                }
                offset += width;
            }
            Ok(())
        }
        Op::Rope(a) | Op::RopeBwd(a) => {
            let backward = matches!(f.op, Op::RopeBwd(_));
            for block in blocks(f.outputs[0], cols) {
                let y = rope(g, env, a, block, backward)?;
                env.store(0, block, y)?;
            }
            Ok(())
        }
        Op::Fused(a) => emit_kernel(&a.kernel, cols, g, env),
        _ => {
            for block in blocks(f.outputs.first().copied().unwrap_or(0), cols) {
                let xs = (0..f.inputs.len())
                    .map(|i| env.read(g, i, block, ColMap::Id))
                    .collect::<Result<Vec<_>, _>>()?;
                for (o, y) in elementwise(f.op, g, &xs)?.into_iter().enumerate() {
                    env.store(o, block, y)?;
                }
            }
            Ok(())
        }
    }
}

/// The column offsets of the blocks of `cols` columns in `width`.
fn blocks(width: u64, cols: u64) -> impl Iterator<Item = u64> {
    (0..width / cols.max(1)).map(move |b| b * cols)
}

/// One block of a rope: `x(c)·cos(c) + x(rot(c))·ssin(c)`, or `−` for the backward (see
/// `Op::RopeTable`): per element exactly the CPU kernel's `lo·cos − hi·sin` and `hi·cos +
/// lo·sin` (with `−sin` for the backward's negative angle), as `a + b·(−s) = a − b·s` in IEEE
/// arithmetic.
fn rope(
    g: &mut Graph,
    env: &mut dyn Env,
    a: &RopeAttrs,
    block: u64,
    backward: bool,
) -> Result<NodeId, String> {
    let x = env.read(g, 0, block, ColMap::Id)?;
    let partner = env.read(g, 0, block, ColMap::rotation(a.head_dim, a.rotary()))?;
    let cos = env.table(g, a, 0)?;
    let ssin = env.table(g, a, a.head_dim)?;
    let straight = g.bin(Bin::Mul, x, cos);
    let turned = g.bin(Bin::Mul, partner, ssin);
    let op = if backward { Bin::Sub } else { Bin::Add };
    Ok(g.bin(op, straight, turned))
}

/// A member kernel re-blocked to `cols` columns: each of its stores becomes `kc / cols`
/// stores, each reading its inputs shifted by the block's offset.
fn emit_kernel(k: &Kernel, cols: u64, g: &mut Graph, env: &mut dyn Env) -> Result<(), String> {
    if cols == 0 || !k.cols.is_multiple_of(cols) {
        return Err(format!(
            "a kernel of {} columns in a domain of {cols}",
            k.cols
        ));
    }
    for store in &k.stores {
        for shift in blocks(k.cols, cols) {
            let value =
                super::graph::rebuild_one(&k.graph, store.value, g, &mut |g, node| match node {
                    Node::Load {
                        input,
                        col_offset,
                        map,
                    } => {
                        let map = shifted(map, cols)?;
                        env.read(g, input as usize, col_offset + shift, map)
                    }
                    other => Err(format!("cannot fuse a kernel node {other:?}")),
                })?;
            env.store(store.output as usize, store.col_offset + shift, value)?;
        }
    }
    Ok(())
}

/// The map of a load shifted by a multiple of `cols`, as a map of the shifted domain.
fn shifted(map: ColMap, cols: u64) -> Result<ColMap, String> {
    match map {
        ColMap::Id => Ok(map),
        _ if map
            .period()
            .is_some_and(|p| p > 0 && cols.is_multiple_of(p)) =>
        {
            Ok(map)
        }
        _ => Err(format!(
            "a column map {map:?} does not repeat every {cols} columns"
        )),
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_TANH_CUBIC: f32 = 0.044_715;
const INV_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// The outputs of an elementwise op from its inputs' values.
fn elementwise(op: &Op, g: &mut Graph, xs: &[NodeId]) -> Result<Vec<NodeId>, String> {
    let x = |i: usize| {
        xs.get(i)
            .copied()
            .ok_or_else(|| format!("{} has no input {i}", op.opcode().name()))
    };
    Ok(match op {
        Op::Activation(a) => vec![activation_value(g, a.act, x(0)?)],
        Op::ActivationBwd(a) => {
            let d = activation_derivative(g, a.act, x(1)?);
            vec![g.bin(Bin::Mul, x(0)?, d)]
        }
        Op::SwiGlu => {
            let (gate, up) = (x(0)?, x(1)?);
            let s = sigmoid(g, gate);
            let silu = g.bin(Bin::Mul, gate, s);
            vec![g.bin(Bin::Mul, silu, up)]
        }
        Op::SwiGluBwd => swiglu_bwd(g, x(0)?, x(1)?, x(2)?),
        Op::Add => vec![g.bin(Bin::Add, x(0)?, x(1)?)],
        Op::Scale { factor } => {
            let f = g.constant(*factor as f32);
            vec![g.bin(Bin::Mul, f, x(0)?)]
        }
        Op::Copy => vec![x(0)?],
        other => return Err(format!("{} is not elementwise", other.opcode().name())),
    })
}

/// `1 / (1 + exp(−x))`, the CPU's sigmoid.
fn sigmoid(g: &mut Graph, x: NodeId) -> NodeId {
    let minus = g.un(Un::Neg, x);
    let e = g.un(Un::Exp, minus);
    let one = g.constant(1.0);
    let denominator = g.bin(Bin::Add, one, e);
    g.bin(Bin::Div, one, denominator)
}

/// `c · x` for a constant `c`.
fn times(g: &mut Graph, c: f32, x: NodeId) -> NodeId {
    let c = g.constant(c);
    g.bin(Bin::Mul, c, x)
}

/// `1 + x`.
fn one_plus(g: &mut Graph, x: NodeId) -> NodeId {
    let one = g.constant(1.0);
    g.bin(Bin::Add, one, x)
}

/// `1 + erf(x·(1/√2))`, the erf term of the CPU's gelu and its derivative.
fn erf_term(g: &mut Graph, x: NodeId) -> NodeId {
    let c = g.constant(INV_SQRT_2);
    let scaled = g.bin(Bin::Mul, x, c);
    let e = g.un(Un::Erf, scaled);
    one_plus(g, e)
}

/// `σ(2u)` and `du/dx` of gelu_tanh, `u = √(2/π)(x + 0.044715·x³)` (the CPU's
/// `gelu_tanh_gate`).
fn gelu_tanh_gate(g: &mut Graph, x: NodeId) -> (NodeId, NodeId) {
    let cx = times(g, GELU_TANH_CUBIC, x);
    let cxx = g.bin(Bin::Mul, cx, x);
    let cubic = g.bin(Bin::Mul, cxx, x);
    let inner = g.bin(Bin::Add, x, cubic);
    let u = times(g, SQRT_2_OVER_PI, inner);
    let three_c = g.constant(3.0 * GELU_TANH_CUBIC);
    let t = g.bin(Bin::Mul, three_c, x);
    let t = g.bin(Bin::Mul, t, x);
    let t = one_plus(g, t);
    let du = times(g, SQRT_2_OVER_PI, t);
    let two_u = times(g, 2.0, u);
    (sigmoid(g, two_u), du)
}

fn activation_value(g: &mut Graph, act: Act, x: NodeId) -> NodeId {
    match act {
        Act::Gelu => {
            // 0.5·x·(1 + erf(x/√2)), as (0.5·x)·(1 + erf).
            let half_x = times(g, 0.5, x);
            let sum = erf_term(g, x);
            g.bin(Bin::Mul, half_x, sum)
        }
        Act::GeluTanh => {
            let (s, _) = gelu_tanh_gate(g, x);
            g.bin(Bin::Mul, x, s)
        }
        Act::Relu => positive_part(g, x),
        Act::Silu => {
            let s = sigmoid(g, x);
            g.bin(Bin::Mul, x, s)
        }
    }
}

/// `x > 0 ? x : 0`: `max(x, 0)` with a NaN giving 0, as `f32::max` does.
fn positive_part(g: &mut Graph, x: NodeId) -> NodeId {
    let zero = g.constant(0.0);
    let positive = g.cmp(Cmp::Gt, x, zero);
    g.select(positive, x, zero)
}

fn activation_derivative(g: &mut Graph, act: Act, x: NodeId) -> NodeId {
    match act {
        Act::Gelu => {
            // cdf + x·(1/√(2π))·exp(−0.5·x·x), cdf = 0.5·(1 + erf(x/√2)).
            let sum = erf_term(g, x);
            let cdf = times(g, 0.5, sum);
            let xc = g.constant(INV_SQRT_2PI);
            let xc = g.bin(Bin::Mul, x, xc);
            let q = times(g, -0.5, x);
            let q = g.bin(Bin::Mul, q, x);
            let density = g.un(Un::Exp, q);
            let tail = g.bin(Bin::Mul, xc, density);
            g.bin(Bin::Add, cdf, tail)
        }
        Act::GeluTanh => {
            // s + x·s·(1 − s)·2·du
            let (s, du) = gelu_tanh_gate(g, x);
            let one = g.constant(1.0);
            let xs = g.bin(Bin::Mul, x, s);
            let rest = g.bin(Bin::Sub, one, s);
            let t = g.bin(Bin::Mul, xs, rest);
            let two = g.constant(2.0);
            let t = g.bin(Bin::Mul, t, two);
            let t = g.bin(Bin::Mul, t, du);
            g.bin(Bin::Add, s, t)
        }
        Act::Relu => {
            let zero = g.constant(0.0);
            let one = g.constant(1.0);
            let positive = g.cmp(Cmp::Gt, x, zero);
            g.select(positive, one, zero)
        }
        Act::Silu => {
            // σ(x)·(1 + x·(1 − σ(x)))
            let s = sigmoid(g, x);
            let factor = silu_factor(g, x, s);
            g.bin(Bin::Mul, s, factor)
        }
    }
}

/// `1 + x·(1 − s)`.
fn silu_factor(g: &mut Graph, x: NodeId, s: NodeId) -> NodeId {
    let one = g.constant(1.0);
    let rest = g.bin(Bin::Sub, one, s);
    let t = g.bin(Bin::Mul, x, rest);
    one_plus(g, t)
}

/// `dgate = dy·up·σ(g)·(1 + g(1 − σ(g)))`, `dup = dy·g·σ(g)` (the CPU's `swiglu_bwd`).
fn swiglu_bwd(g: &mut Graph, dy: NodeId, gate: NodeId, up: NodeId) -> Vec<NodeId> {
    let s = sigmoid(g, gate);
    let t = g.bin(Bin::Mul, dy, up);
    let t = g.bin(Bin::Mul, t, s);
    let factor = silu_factor(g, gate, s);
    let dgate = g.bin(Bin::Mul, t, factor);
    let dyg = g.bin(Bin::Mul, dy, gate);
    let dup = g.bin(Bin::Mul, dyg, s);
    vec![dgate, dup]
}
