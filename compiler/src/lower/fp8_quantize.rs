//! The FP8 quantization pass: on a lowered program, each tensorwise FP8 GEMM reads its two
//! operands already quantized (`Fp8Gemm::quantized`), from an `Fp8Quantize` op that quantizes
//! a tensor once for every FP8 GEMM near it that reads it with the same scale. A data gradient
//! and the weight gradient after it then read one quantization of dy, the first along its
//! columns and the second transposed, both written by one op; GEMMs reading one input (two
//! projections of the same activation) share it too.
//!
//! **Groups.** Walking the program in order, an operand joins the open group of its tensor: the
//! same buffer, scale amax (the GEMM's amax input, or none: the pass then computes one with an
//! `Fp8Amax`, tensorwise, shared by the group) and format. A group closes when an instruction
//! writes or frees its buffer or its scale amax, or once it spans [`WINDOW`] instructions, so
//! the quantized copies live beside the GEMMs that read them, as a GEMM's own quantization
//! scratch did. Its op goes right before its first GEMM (after any amax record of the operand,
//! which then rides on it: `crate::fp8::recording_gemm`), its buffers are allocated there and
//! freed after its last GEMM. A tensor that a GEMM's SwiGLU epilogue wrote (the gated product,
//! dgate, dup) is quantized right after that GEMM instead, its records moved with the op and its
//! buffers allocated before the GEMM, where its scale amax is delayed scaling's (nothing between
//! writes it): a backend may then make the epilogue and the quantization in one pass
//! (`crate::ir::swiglu_runs`). Under delayed scaling a later GEMM's record of the same tensor
//! into a history the group has recorded into is dropped: its value is the one recorded (a
//! maximum is idempotent, and the group saw no write to the tensor); a GEMM recording into
//! one the group has not (a training forward after a recomputed one) starts a new group, so
//! every record rides on a quantize pass.
//!
//! **Which GEMMs.** Tensorwise (the one scaling with a single scale a tensor, which every
//! layout shares), with each written layout's contraction extent a multiple of 16 (cuBLASLt
//! reads FP8 operands K-major with a leading dimension of 16 bytes; the copies carry no
//! padding). Any other FP8 GEMM quantizes its operands itself, as before. The numbers are the
//! unquantized program's bit for bit on finite operands (`ir::fp8::Fp8QuantizeAttrs`).
use crate::fp8::recording_gemm;
use crate::ir::fp8::{
    Along, Fp8AmaxAttrs, Fp8Format, Fp8Gemm, Fp8Operand, Fp8QuantizeAttrs, Fp8Scaling, OperandKind,
};
use crate::ir::op::Op;
use crate::ir::{Buffer, BufferId, BufferKind, DType, Inputs, Instr, Outputs, Phase, Program};
use crate::spec::NodeId;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The most instructions from the first to the last GEMM of one group.
pub const WINDOW: usize = 64;
/// The contraction extent a quantized layout must be a multiple of.
const K_MULTIPLE: u64 = 16;

/// What the pass did to one program.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuantizeSummary {
    /// GEMMs now reading quantized operands.
    pub gemms: usize,
    /// `Fp8Quantize` ops made (fewer than twice the GEMMs where they share).
    pub quantizes: usize,
}

/// One tensor quantized for the GEMMs of a group.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key {
    x: BufferId,
    amax: Option<BufferId>,
    format: Fp8Format,
}

/// One operand of an eligible GEMM.
#[derive(Clone, Copy)]
struct Use {
    key: Key,
    operand: Fp8Operand,
    rows: u64,
    cols: u64,
}

/// A group of GEMMs sharing one quantization (the module doc).
struct Group {
    key: Key,
    operand: Fp8Operand,
    rows: u64,
    cols: u64,
    first: usize,
    last: usize,
    /// The histories its GEMMs record the tensor into (delayed scaling), with the records.
    recorded: Vec<(BufferId, Vec<usize>)>,
    direct: bool,
    transposed: bool,
    node: Option<NodeId>,
    phase: Phase,
}

/// The quantized buffers of a group, once made.
#[derive(Clone, Copy)]
struct Made {
    amax: BufferId,
    own_amax: bool,
    q: Option<BufferId>,
    qt: Option<BufferId>,
}

/// Whether `spec`'s FP8 recipe shares quantization (`quantize: shared`, tensorwise).
pub fn wanted(spec: &crate::spec::Spec) -> bool {
    (spec.train.fp8.as_ref())
        .is_some_and(|f| f.shared_quantization && f.scaling == Fp8Scaling::Tensorwise)
}

/// Runs the pass on `program` (the module doc).
pub fn quantize_operands(program: &mut Program) -> QuantizeSummary {
    let rides = records_by_gemm(program);
    let (groups, uses) = find_groups(program, &rides);
    if groups.is_empty() {
        return QuantizeSummary::default();
    }
    let made: Vec<Made> = groups.iter().map(|g| make_buffers(program, g)).collect();
    let mut dropped = duplicate_records(&groups);
    let mut before: Vec<Vec<Instr>> = vec![Vec::new(); program.instrs.len()];
    let mut next_to: Vec<Vec<Instr>> = vec![Vec::new(); program.instrs.len()];
    let mut after: Vec<Vec<Instr>> = vec![Vec::new(); program.instrs.len()];
    for (g, m) in groups.iter().zip(&made) {
        match swiglu_producer(program, g) {
            Some(p) => {
                before[p].extend(alloc_instrs(m));
                for at in g.recorded.iter().filter_map(|(_, at)| at.first().copied()) {
                    next_to[p].push(program.instrs[at].clone());
                    dropped.insert(at);
                }
                next_to[p].extend(quantize_op(g, m));
            }
            None => {
                before[g.first].extend(own_amax_instrs(g, m));
                before[g.first].extend(alloc_instrs(m));
                before[g.first].extend(quantize_op(g, m));
            }
        }
        after[g.last].extend(free_instrs(m));
    }
    let mut rewritten: Vec<Option<Instr>> = vec![None; program.instrs.len()];
    let mut gemms = 0;
    for (at, pair) in &uses {
        if let Some(instr) = quantized_gemm(&program.instrs[*at], pair.map(|g| made[g])) {
            rewritten[*at] = Some(instr);
            gemms += 1;
        }
    }
    let old = std::mem::take(&mut program.instrs);
    let mut instrs = Vec::with_capacity(old.len() + 6 * groups.len());
    for (i, instr) in old.into_iter().enumerate() {
        instrs.append(&mut before[i]);
        if !dropped.contains(&i) {
            instrs.push(rewritten[i].take().unwrap_or(instr));
        }
        instrs.append(&mut next_to[i]);
        instrs.append(&mut after[i]);
    }
    program.instrs = instrs;
    QuantizeSummary {
        gemms,
        quantizes: groups.len(),
    }
}

/// A delayed-scaling record: where it is, the tensor and the history.
#[derive(Clone, Copy)]
struct Record {
    at: usize,
    x: BufferId,
    history: BufferId,
}

/// The records of `program` by the GEMM they ride on (`crate::fp8::recording_gemm`), in
/// instruction order.
fn records_by_gemm(program: &Program) -> HashMap<usize, Vec<Record>> {
    let mut out: HashMap<usize, Vec<Record>> = HashMap::new();
    for (at, c) in program.computes() {
        if !matches!(c.op, Op::Fp8AmaxRecord(_)) {
            continue;
        }
        let (Some(&x), Some(&history), Some(gemm)) = (
            c.inputs.first(),
            c.inputs.get(1),
            recording_gemm(program, at),
        ) else {
            continue;
        };
        out.entry(gemm).or_default().push(Record { at, x, history });
    }
    out
}

/// The groups of `program` and, per eligible GEMM instruction, the groups of its two operands.
fn find_groups(
    program: &Program,
    rides: &HashMap<usize, Vec<Record>>,
) -> (Vec<Group>, Vec<(usize, [usize; 2])>) {
    let mut groups: Vec<Group> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    let mut uses = Vec::new();
    for (i, instr) in program.instrs.iter().enumerate() {
        if !open.is_empty() {
            close_groups(&groups, &mut open, instr, i);
        }
        let Some(operands) = eligible(program, instr) else {
            continue;
        };
        let node_phase = instr.as_compute().map(|c| (c.node, c.phase));
        let (node, phase) = node_phase.unwrap_or((None, Phase::Forward));
        let records = rides.get(&i).map_or(&[][..], Vec::as_slice);
        let pair = operands.map(|u| {
            let mine: Vec<Record> = (records.iter().copied())
                .filter(|r| r.x == u.key.x)
                .collect();
            let found = open.iter().copied().find(|&k| {
                let g = &groups[k];
                let recorded = |r: &Record| g.recorded.iter().any(|(h, _)| *h == r.history);
                g.key == u.key && (g.rows, g.cols) == (u.rows, u.cols) && mine.iter().all(recorded)
            });
            let index = match found {
                Some(index) => index,
                None => {
                    open.push(groups.len());
                    groups.push(Group {
                        key: u.key,
                        operand: u.operand,
                        rows: u.rows,
                        cols: u.cols,
                        first: i,
                        last: i,
                        recorded: Vec::new(),
                        direct: false,
                        transposed: false,
                        node,
                        phase,
                    });
                    groups.len() - 1
                }
            };
            let g = &mut groups[index];
            g.last = i;
            for r in mine {
                match g.recorded.iter_mut().find(|(h, _)| *h == r.history) {
                    Some((_, at)) => at.push(r.at),
                    None => g.recorded.push((r.history, vec![r.at])),
                }
            }
            match u.operand.along {
                Along::Cols => g.direct = true,
                Along::Rows => g.transposed = true,
            }
            index
        });
        uses.push((i, pair));
    }
    (groups, uses)
}

/// Closes the `open` groups that `instr` (at `i`) ends: it writes or frees their tensor or
/// scale amax, or they would span more than [`WINDOW`] instructions.
fn close_groups(groups: &[Group], open: &mut Vec<usize>, instr: &Instr, i: usize) {
    let writes = instr.writes();
    let freed = match instr {
        Instr::Free { buffer } => Some(*buffer),
        _ => None,
    };
    let ends = |b: BufferId| writes.contains(&b) || freed == Some(b);
    open.retain(|&k| {
        let g = &groups[k];
        !(ends(g.key.x) || g.key.amax.is_some_and(ends) || i - g.first > WINDOW)
    });
}

/// The two operands of `instr` where it is an FP8 GEMM the pass quantizes (the module doc).
fn eligible(program: &Program, instr: &Instr) -> Option<[Use; 2]> {
    let c = instr.as_compute()?;
    let (g, of) = c.op.fp8_operands()?;
    if g.scaling != Fp8Scaling::Tensorwise || g.quantized {
        return None;
    }
    let (in_dim, out_dim) = c.op.gemm_dims()?;
    // x and W are `in` wide; dy, the first operand of either gradient, `out`.
    let widths = match c.op {
        Op::Matmul { .. } => [in_dim, in_dim],
        _ => [out_dim, in_dim],
    };
    let (amax, _) = c.op.fp8_inputs(c.inputs)?;
    let mut out = [None, None];
    for k in 0..2 {
        let x = *c.inputs.get(k)?;
        let cols = widths[k];
        let numel = program.buffer(x)?.numel();
        if cols == 0 || numel % cols != 0 {
            return None;
        }
        let rows = numel / cols;
        let extent = match of[k].along {
            Along::Cols => cols,
            Along::Rows => rows,
        };
        if extent % K_MULTIPLE != 0 {
            return None;
        }
        let key = Key {
            x,
            amax: amax[k],
            format: of[k].format,
        };
        out[k] = Some(Use {
            key,
            operand: of[k],
            rows,
            cols,
        });
    }
    Some([out[0]?, out[1]?])
}

/// The buffers of group `g`'s quantization, declared in `program`.
fn make_buffers(program: &mut Program, g: &Group) -> Made {
    let name =
        (program.buffer(g.key.x)).map_or_else(|| format!("b{}", g.key.x.0), |b| b.name.clone());
    let mut declare = |what: &str, shape: Vec<u64>, dtype: DType| {
        let id = BufferId(program.buffers.len() as u32);
        program.buffers.push(Buffer {
            name: format!("{name}.{what}@{}", g.first),
            shape,
            dtype,
            kind: BufferKind::Activation,
        });
        id
    };
    let fp8 = DType::Fp8(g.key.format);
    let q = g.direct.then(|| declare("fp8", vec![g.rows, g.cols], fp8));
    let qt = (g.transposed).then(|| declare("fp8t", vec![g.cols, g.rows], fp8));
    let (amax, own_amax) = match g.key.amax {
        Some(a) => (a, false),
        None => (declare("fp8_amax", vec![1], DType::F32), true),
    };
    Made {
        amax,
        own_amax,
        q,
        qt,
    }
}

/// Where group `g`'s quantization goes right after the GEMM with a SwiGLU epilogue that wrote
/// its tensor (the gated product `a` of a gate/up forward, or dgate or dup of a down
/// projection's data gradient), so that a backend may make both in one pass
/// (`crate::ir::swiglu_runs`): that GEMM's instruction, where the group has a scale amax of its
/// own input (delayed scaling's, written by rolls only) that nothing between writes. Its
/// buffers are then allocated before that GEMM and its records move with its op. None
/// elsewhere: the op goes before the group's first GEMM.
fn swiglu_producer(program: &Program, g: &Group) -> Option<usize> {
    let amax = g.key.amax?;
    let x = g.key.x;
    let from = g.first.saturating_sub(WINDOW);
    let producer = (from..g.first).rev().find(|&i| {
        let instr = &program.instrs[i];
        instr.writes().contains(&x) || matches!(instr, Instr::Alloc { buffer } if *buffer == x)
    })?;
    let c = program.instrs[producer].as_compute()?;
    let gated = match *c.op {
        Op::Matmul { swiglu: true, .. } => c.outputs.get(1) == Some(&x),
        Op::MatmulBwdData { swiglu: true, .. } => c.outputs.get(..2)?.contains(&x),
        _ => false,
    };
    let amax_written = (producer..g.first).any(|i| program.instrs[i].writes().contains(&amax));
    (gated && !amax_written).then_some(producer)
}

/// The scale amax group `g` computes where its GEMMs read none (an `Fp8Amax`, allocated).
fn own_amax_instrs(g: &Group, m: &Made) -> Vec<Instr> {
    if !m.own_amax {
        return Vec::new();
    }
    let attrs = Fp8AmaxAttrs {
        operand: g.operand,
        scaling: Fp8Scaling::Tensorwise,
        rows: weight_rows(g),
        cols: g.cols,
    };
    let mut out = vec![Instr::Alloc { buffer: m.amax }];
    out.extend(group_compute(g, Op::Fp8Amax(attrs), &[g.key.x], &[m.amax]));
    out
}

/// The allocations of the layouts group `g` writes.
fn alloc_instrs(m: &Made) -> Vec<Instr> {
    (m.q.into_iter().chain(m.qt))
        .map(|buffer| Instr::Alloc { buffer })
        .collect()
}

/// Group `g`'s `Fp8Quantize`.
fn quantize_op(g: &Group, m: &Made) -> Option<Instr> {
    let written: Vec<BufferId> = m.q.into_iter().chain(m.qt).collect();
    let attrs = Fp8QuantizeAttrs {
        format: g.key.format,
        rows: weight_rows(g),
        cols: g.cols,
        direct: m.q.is_some(),
        transposed: m.qt.is_some(),
    };
    group_compute(g, Op::Fp8Quantize(attrs), &[g.key.x, m.amax], &written)
}

/// x's rows where they are fixed: a weight's.
fn weight_rows(g: &Group) -> Option<u64> {
    (g.operand.kind == OperandKind::Weight).then_some(g.rows)
}

/// A compute instruction of group `g` (its node and phase).
fn group_compute(g: &Group, op: Op, inputs: &[BufferId], outputs: &[BufferId]) -> Option<Instr> {
    Some(Instr::Compute {
        op: Arc::new(op),
        inputs: Inputs::from_slice(inputs)?,
        outputs: Outputs::from_slice(outputs)?,
        node: g.node,
        phase: g.phase,
    })
}

/// The instructions after a group's last GEMM: its buffers freed.
fn free_instrs(m: &Made) -> Vec<Instr> {
    let own = m.own_amax.then_some(m.amax);
    (m.q.into_iter().chain(m.qt).chain(own))
        .map(|buffer| Instr::Free { buffer })
        .collect()
}

/// GEMM `instr` reading its operands from their groups' quantizations (`made`, per operand):
/// `quantized` set, both amax inputs present, the quantized operands last.
fn quantized_gemm(instr: &Instr, made: [Made; 2]) -> Option<Instr> {
    let c = instr.as_compute()?;
    let (g, of) = c.op.fp8_operands()?;
    let (amax, _) = c.op.fp8_inputs(c.inputs)?;
    let base = c.inputs.len() - amax.iter().flatten().count();
    let mut inputs: Vec<BufferId> = c.inputs.get(..base)?.to_vec();
    for (k, m) in made.iter().enumerate() {
        inputs.push(amax[k].unwrap_or(m.amax));
    }
    for (k, m) in made.iter().enumerate() {
        inputs.push(match of[k].along {
            Along::Cols => m.q?,
            Along::Rows => m.qt?,
        });
    }
    let op = c.op.with_fp8(Some(Fp8Gemm {
        quantized: true,
        ..g
    }));
    Some(Instr::Compute {
        op: Arc::new(op),
        inputs: Inputs::from_slice(&inputs)?,
        outputs: *c.outputs,
        node: c.node,
        phase: c.phase,
    })
}

/// The delayed-scaling records that repeat one already made in their group (the module doc):
/// each record of a group's tensor into a history after the group's first into it (a group
/// only takes a GEMM whose records it has made: [`find_groups`]).
fn duplicate_records(groups: &[Group]) -> HashSet<usize> {
    (groups.iter())
        .flat_map(|g| {
            g.recorded
                .iter()
                .flat_map(|(_, at)| at.iter().skip(1).copied())
        })
        .collect()
}
