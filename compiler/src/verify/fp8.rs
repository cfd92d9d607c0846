//! Invariant 9 of the verifier: every FP8 scale is shared by exactly the ranks holding pieces
//! of its group (E0824). The reduction over the wrong group is the bug that diverged a 40B
//! model under tp (Megatron-LM PR#442): over too few ranks, the pieces of one group get
//! different scales; over too many, a rank's scale depends on tensors it holds no piece of.
//!
//! For every FP8 GEMM, each operand's split (`Fp8Gemm::split`) is checked against the plan:
//! its axes split something (size > 1 in the mesh); dp and pp split no operand (each dp
//! rank's microbatch is its own tensor, a stage holds whole layers); a token operand's rows
//! are split by cp exactly when cp > 1 (each cp rank holds its chunks of the sequence); a
//! weight is never split by cp, and one the program holds as a parameter (its master or
//! working copy) is split by tp along the dimension of its `TpSplit`; the two operands agree
//! on the split of the contraction dimension they share. Then each operand whose groups span
//! ranks (`Fp8Gemm::shared`: axes A) reads amaxes that were last written, before the GEMM, by
//! an in-place `all_reduce max` over a group family spanning exactly A, and before that by an
//! `Fp8Amax` of that same operand buffer, as the same operand under the same scaling, with no
//! write to the operand between the `Fp8Amax` and the GEMM.
//!
//! Under delayed scaling (`Fp8Gemm::history`) both operands read a scale amax instead: a
//! persistent `fp8_history` buffer that one `Fp8HistoryRoll` of the program writes, from a
//! history whose step amax is max all-reduced, between its last `Fp8AmaxRecord` and the roll,
//! over group families whose axes together are exactly the operand's shared axes and dp (where
//! dp > 1): every replica and every rank holding a piece then rolls the same value. A GEMM of
//! a training forward or backward must have recorded its own operand into that history
//! (the history's last write before it is an `Fp8AmaxRecord` of the operand buffer, with no
//! write to the operand between them); a recomputed forward records nothing. Conversely every
//! `Fp8AmaxRecord` is followed, past other records, allocations and frees, by a delayed FP8
//! GEMM quantizing the recorded buffer, or by an `Fp8Quantize` of it
//! (`crate::fp8::recording_gemm`): the CUDA backend records the amax inside that quantize
//! pass, and the time model prices records so.
//!
//! A `quantized` FP8 GEMM (`Fp8Gemm::quantized`) reads each operand's amax as above, or, where
//! the scaling gives it no reduced or delayed one, an amax an `Fp8Amax` of that operand buffer
//! wrote with no write to the operand since; and each quantized operand was last written by an
//! `Fp8Quantize` of the operand buffer with that same amax, in the operand's format and layout
//! (`q` for an operand read along its columns, `qt` along its rows), holding as many elements,
//! with no write to the operand or the amax between the quantize and the GEMM: the quantized
//! values are the operand's, scaled as the GEMM unscales them.
use super::{Findings, Violation};
use crate::fp8::recording_gemm;
use crate::ir::fp8::{Along, Axes, Fp8Gemm, Fp8Operand, Fp8Split, OperandKind};
use crate::ir::op::Op;
use crate::ir::{BufferId, CollectiveKind, Instr, Plan, Program, ProgramId, ReduceOp};
use crate::spec::Axis;

/// Every FP8 scale-sharing violation of `program` (run by `rank`, the lowest rank running it).
pub(super) fn check(plan: &Plan, program: &Program, id: ProgramId, rank: u32) -> Vec<Violation> {
    let mut found = Findings::new(id, rank);
    for (i, c) in program.computes() {
        if matches!(c.op, Op::Fp8AmaxRecord(_)) && recording_gemm(program, i).is_none() {
            found.push("E0824", i, c.node, || {
                let of = c
                    .inputs
                    .first()
                    .map_or(String::new(), |b| format!(" of b{}", b.0));
                format!(
                    "Fp8AmaxRecord{of}: the next instruction past records, allocations and \
                     frees is not a delayed-scaling FP8 GEMM quantizing that buffer, which \
                     must record it"
                )
            });
        }
        let Some((g, operands)) = c.op.fp8_operands() else {
            continue;
        };
        let inputs = c.inputs.to_vec();
        let mut problems = split_problems(plan, program, (g, operands), &inputs);
        let shared = g.shared(operands);
        let (amaxes, quantized) = c.op.fp8_inputs(&inputs).unwrap_or_default();
        if let Some(q) = quantized {
            for k in 0..2 {
                let (Some(&buffer), Some(amax)) = (inputs.get(k), amaxes[k]) else {
                    problems.push(format!("quantized operand {k} has no amax input"));
                    continue;
                };
                let want = (buffer, amax, operands[k]);
                if let Err(e) = quantized_before(program, i, q[k], want) {
                    problems.push(format!("quantized operand {k} (b{}): {e}", q[k].0));
                }
                // Current scaling, its groups within the rank: the amax the pass computed.
                if g.history.is_none() && shared[k].is_empty() {
                    if let Err(e) = own_amax_before(program, i, amax, buffer) {
                        problems.push(format!("operand {k} (b{}): {e}", buffer.0));
                    }
                }
            }
        }
        if g.history.is_some() {
            for (k, axes) in shared.into_iter().enumerate() {
                let dp = Axes::NONE.with_if(plan.mesh.size(Axis::Dp) > 1, Axis::Dp);
                let (Some(&buffer), Some(amax)) = (inputs.get(k), amaxes[k]) else {
                    problems.push(format!("operand {k} has no scale amax input"));
                    continue;
                };
                let record = c.phase != crate::ir::Phase::Recompute;
                let want = (buffer, axes.union(dp), record);
                if let Err(e) = delayed_before(plan, program, i, amax, want) {
                    problems.push(format!("operand {k} (b{}): {e}", buffer.0));
                }
            }
            for p in problems {
                found.push("E0824", i, c.node, || {
                    format!("FP8 {}: {p}", c.op.opcode().variant())
                });
            }
            continue;
        }
        for (k, axes) in shared.into_iter().enumerate() {
            if axes.is_empty() {
                continue;
            }
            let (Some(&buffer), Some(amax)) = (inputs.get(k), amaxes[k]) else {
                problems.push(format!("operand {k} has no amax input"));
                continue;
            };
            let want = Want {
                operand: operands[k],
                buffer,
                axes,
                g,
            };
            if let Err(e) = reduced_before(plan, program, i, amax, want) {
                problems.push(format!("operand {k} (b{}): {e}", buffer.0));
            }
        }
        for p in problems {
            found.push("E0824", i, c.node, || {
                format!("FP8 {}: {p}", c.op.opcode().variant())
            });
        }
    }
    found.into_vec()
}

/// The last instruction before `at` that writes `buffer`.
fn last_writer(program: &Program, at: usize, buffer: BufferId) -> Option<usize> {
    (0..at)
        .rev()
        .find(|&j| (program.instrs.get(j)).is_some_and(|x| x.writes().contains(&buffer)))
}

/// Ok where no instruction between `source` (which made what the GEMM at `at` reads: `made`)
/// and the GEMM writes any of `buffers` (`written`, in words); else an error naming the first.
fn unwritten_since(
    program: &Program,
    (source, at): (usize, usize),
    (buffers, written): (&[BufferId], &str),
    made: &str,
) -> Result<(), String> {
    let first = (source + 1..at).find(|&j| {
        (program.instrs.get(j)).is_some_and(|x| x.writes().iter().any(|b| buffers.contains(b)))
    });
    match first {
        Some(j) => Err(format!(
            "instruction {j} writes {written} between {made} ({source}) and the GEMM"
        )),
        None => Ok(()),
    }
}

/// Checks that quantized operand `q`, read by the GEMM at `at`, is the `Fp8Quantize` of
/// `buffer` with scale amax `amax` in `operand`'s format and layout (the module doc).
fn quantized_before(
    program: &Program,
    at: usize,
    q: BufferId,
    (buffer, amax, operand): (BufferId, BufferId, Fp8Operand),
) -> Result<(), String> {
    let source = last_writer(program, at, q).ok_or("it is never written")?;
    let c = (program.instrs.get(source).and_then(Instr::as_compute))
        .filter(|c| matches!(c.op, Op::Fp8Quantize(_)))
        .ok_or_else(|| format!("it is last written by instruction {source}, not an Fp8Quantize"))?;
    let Op::Fp8Quantize(a) = c.op else {
        return Err(format!("instruction {source} is not an Fp8Quantize"));
    };
    if c.inputs.first() != Some(&buffer) || c.inputs.get(1) != Some(&amax) {
        return Err(format!(
            "the Fp8Quantize at instruction {source} quantizes another buffer or with another amax than the GEMM's b{} and b{}",
            buffer.0, amax.0
        ));
    }
    let want_output = match (operand.along, a.direct) {
        (Along::Cols, true) => Some(0),
        (Along::Rows, true) if a.transposed => Some(1),
        (Along::Rows, false) if a.transposed => Some(0),
        _ => None,
    };
    if want_output.and_then(|o| c.outputs.get(o)) != Some(&q) || a.format != operand.format {
        return Err(format!(
            "the Fp8Quantize at instruction {source} does not write it as the {} {} layout the GEMM reads",
            operand.format.name(),
            match operand.along {
                Along::Cols => "direct",
                Along::Rows => "transposed",
            }
        ));
    }
    let numel = |b: BufferId| program.buffer(b).map(|b| b.numel());
    if numel(q) != numel(buffer) {
        return Err(format!(
            "it holds {:?} elements, its operand b{} {:?}",
            numel(q),
            buffer.0,
            numel(buffer)
        ));
    }
    let written = (&[buffer, amax][..], "the operand or its amax");
    unwritten_since(program, (source, at), written, "the Fp8Quantize")
}

/// Checks that `amax`, read by the quantized GEMM at `at` as the scale amax of its unshared
/// operand `buffer` under current scaling, is a tensorwise `Fp8Amax` of that buffer with no
/// write to it since.
fn own_amax_before(
    program: &Program,
    at: usize,
    amax: BufferId,
    buffer: BufferId,
) -> Result<(), String> {
    let source = last_writer(program, at, amax).ok_or("its amax is never written")?;
    let computed = (program.instrs.get(source).and_then(Instr::as_compute)).is_some_and(|c| {
        matches!(c.op, Op::Fp8Amax(a) if a.scaling == crate::ir::fp8::Fp8Scaling::Tensorwise)
            && c.inputs.first() == Some(&buffer)
    });
    if !computed {
        return Err(format!(
            "its amax b{} comes from instruction {source}, not from a tensorwise Fp8Amax of the operand",
            amax.0
        ));
    }
    let written = (&[buffer][..], "the operand");
    unwritten_since(program, (source, at), written, "its Fp8Amax")
}

/// What the amaxes of one operand must be: `operand`'s groups of `buffer`, max-reduced over
/// exactly the ranks of `axes`.
#[derive(Clone, Copy)]
struct Want {
    operand: Fp8Operand,
    buffer: BufferId,
    axes: Axes,
    g: Fp8Gemm,
}

/// Checks that `amax`, read by the GEMM at `at`, was last written by the all-reduce and the
/// `Fp8Amax` that `want` asks for (the module doc).
fn reduced_before(
    plan: &Plan,
    program: &Program,
    at: usize,
    amax: BufferId,
    want: Want,
) -> Result<(), String> {
    let reduce = last_writer(program, at, amax).ok_or("its amaxes are never written")?;
    let Some(Instr::Collective {
        kind: CollectiveKind::AllReduce { op: ReduceOp::Max },
        group,
        input,
        output,
        ..
    }) = program.instrs.get(reduce)
    else {
        return Err(format!(
            "its amaxes (b{}) are last written by instruction {reduce}, not by an all_reduce max over {}",
            amax.0, want.axes
        ));
    };
    let axes = plan.groups.get(group.0 as usize).map(|g| Axes::of(&g.axes));
    if axes != Some(want.axes) || *input != amax || *output != amax {
        let over = axes.map_or_else(|| format!("g{}", group.0), |a| a.to_string());
        return Err(format!(
            "its amaxes are reduced over {over} (instruction {reduce}), but its scale groups are shared over exactly {}",
            want.axes
        ));
    }
    let source =
        last_writer(program, reduce, amax).ok_or("the reduced amaxes are never computed")?;
    let computed = program
        .instrs
        .get(source)
        .and_then(Instr::as_compute)
        .is_some_and(|c| match c.op {
            Op::Fp8Amax(a) => {
                a.operand == want.operand
                    && a.scaling == want.g.scaling
                    && c.inputs.first() == Some(&want.buffer)
            }
            _ => false,
        });
    if !computed {
        return Err(format!(
            "the amaxes reduced at instruction {reduce} come from instruction {source}, not from an Fp8Amax of this operand"
        ));
    }
    let written = (&[want.buffer][..], "the operand");
    unwritten_since(program, (source, at), written, "its Fp8Amax")
}

/// Checks the scale amax `amax` of a delayed-scaling GEMM at `at` whose operand is `buffer`:
/// rolled from a history reduced over exactly `axes` and, where `record`, recorded from this
/// operand before the GEMM (the module doc).
fn delayed_before(
    plan: &Plan,
    program: &Program,
    at: usize,
    amax: BufferId,
    (buffer, axes, record): (BufferId, Axes, bool),
) -> Result<(), String> {
    let kind = program.buffer(amax).map(|b| b.kind);
    if kind != Some(crate::ir::BufferKind::Fp8History) {
        return Err(format!(
            "its scale amax b{} is not an FP8 amax history's",
            amax.0
        ));
    }
    let roll = (program.instrs.iter().enumerate()).find_map(|(j, x)| {
        let c = x.as_compute()?;
        let rolls = matches!(c.op, Op::Fp8HistoryRoll(_)) && c.outputs.contains(&amax);
        rolls.then(|| Some((j, *c.inputs.first()?)))?
    });
    let Some((roll, history)) = roll else {
        return Err(format!(
            "no Fp8HistoryRoll writes its scale amax b{}",
            amax.0
        ));
    };
    let writes = |j: usize| (program.instrs.get(j)).is_some_and(|x| x.writes().contains(&history));
    let is_record = |j: usize, of: Option<BufferId>| {
        (program.instrs.get(j).and_then(Instr::as_compute)).is_some_and(|c| {
            matches!(c.op, Op::Fp8AmaxRecord(_)) && of.is_none_or(|b| c.inputs.first() == Some(&b))
        })
    };
    let last_record = (0..roll).rev().find(|&j| is_record(j, None)).unwrap_or(0);
    let mut reduced = Axes::NONE;
    for j in (last_record + 1..roll).filter(|&j| writes(j)) {
        match program.instrs.get(j) {
            Some(Instr::Collective {
                kind: CollectiveKind::AllReduce { op: ReduceOp::Max },
                group,
                input,
                output,
                ..
            }) if *input == history && *output == history => {
                let of = plan.groups.get(group.0 as usize).map(|g| Axes::of(&g.axes));
                reduced = reduced.union(of.unwrap_or_default());
            }
            _ => {
                return Err(format!(
                    "instruction {j} writes its history b{} between its last record and its roll",
                    history.0
                ))
            }
        }
    }
    if reduced != axes {
        return Err(format!(
            "its history b{} is max-reduced over {reduced} before its roll (instruction {roll}), but its operand is recorded on exactly the ranks of {axes}",
            history.0
        ));
    }
    if !record {
        return Ok(());
    }
    let source = last_writer(program, at, history);
    let Some(source) = source.filter(|&j| is_record(j, Some(buffer))) else {
        return Err(format!(
            "the GEMM's operand is not recorded into its history b{} before it",
            history.0
        ));
    };
    let written = (&[buffer][..], "the operand");
    unwritten_since(program, (source, at), written, "its Fp8AmaxRecord")
}

/// What is wrong with the GEMM's operand splits (the module doc), in words; `inputs` are the
/// instruction's.
fn split_problems(
    plan: &Plan,
    program: &Program,
    (g, operands): (Fp8Gemm, [Fp8Operand; 2]),
    inputs: &[BufferId],
) -> Vec<String> {
    let mut problems = Vec::new();
    let cp = plan.mesh.size(Axis::Cp) > 1;
    for (k, (split, operand)) in g.split.iter().zip(operands).enumerate() {
        let all = split.rows.union(split.cols);
        if let Some(a) = all.iter().find(|a| plan.mesh.size(*a) < 2) {
            problems.push(format!("operand {k} is split by {}, of size 1", a.name()));
        }
        if all.contains(Axis::Dp) || all.contains(Axis::Pp) {
            problems.push(format!("operand {k} is split by dp or pp ({split})"));
        }
        match operand.kind {
            OperandKind::Tokens if split.rows.contains(Axis::Cp) != cp => problems.push(format!(
                "operand {k}'s rows are {}split by cp, but cp {} 1",
                if cp { "not " } else { "" },
                if cp { ">" } else { "=" }
            )),
            OperandKind::Weight => {
                if all.contains(Axis::Cp) {
                    problems.push(format!("weight operand {k} is split by cp"));
                }
                if let Some(e) = inputs
                    .get(k)
                    .and_then(|b| weight_split(program, *b, *split))
                {
                    problems.push(format!("weight operand {k}: {e}"));
                }
            }
            OperandKind::Tokens => {}
        }
    }
    let k_split = |operand: Fp8Operand, split: Fp8Split| match operand.along {
        Along::Cols => split.cols,
        Along::Rows => split.rows,
    };
    let [a, b] = operands;
    if k_split(a, g.split[0]) != k_split(b, g.split[1]) {
        problems.push(format!(
            "its operands split the contraction dimension differently ({} and {})",
            g.split[0], g.split[1]
        ));
    }
    problems
}

/// Where `buffer` is a parameter this program holds (its master or working copy): what is
/// wrong with `split` against the parameter's tp split, if anything.
fn weight_split(program: &Program, buffer: BufferId, split: Fp8Split) -> Option<String> {
    let local =
        (program.params.iter()).find(|l| l.master == buffer || l.working == Some(buffer))?;
    let tp = |dim: u32| local.tp.is_some_and(|t| t.parts > 1 && t.dim == dim);
    let expect = Fp8Split {
        rows: Axes::NONE.with_if(tp(0), Axis::Tp),
        cols: Axes::NONE.with_if(tp(1), Axis::Tp),
    };
    (split != expect).then(|| {
        format!(
            "it holds parameter p{} split {expect}, but the GEMM says {split}",
            local.param.0
        )
    })
}
