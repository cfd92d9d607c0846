//! Runs of optimizer instructions a backend may update in one multi-tensor launch (the CUDA
//! backend's fused AdamW/SGD, the runtime's `cuda::optimizer`, and its fused sums of squares,
//! `cuda::sum_squares`); the timeline prices and places each run as that one launch
//! (`crate::timeline::fused`). The IR keeps one `AdamW`/`Sgd` instruction per parameter tensor
//! (the CPU backend, ZeRO sharding and checkpoints rely on it); this module only reads a
//! program and finds the maximal runs that can be fused without changing any result:
//! - `AdamW` (or `Sgd`) compute instructions with the same hyper-parameters except the weight
//!   decay (the one per-tensor field), each well formed (the op's documented arity, f32
//!   buffers, a one-element coefficient, param and state as long as the gradient, no buffer
//!   both read and written);
//! - independent of each other: no member writes a buffer an earlier member reads or writes, or
//!   reads one an earlier member writes;
//! - and of what lies between them: the other instructions between the first member and a later
//!   one (gradient `Free`s; with ZeRO 1 and 2 each update's `Alloc`, all-gather, `CopyRange`
//!   and `Free`) neither write (`Alloc` and `Free` count as writes) a buffer that member uses
//!   nor read one it writes.
//!
//! So running every member at the first one's position gives every instruction the values it
//! sees when the members run in turn. A run has at least two members; an update that cannot
//! join the run (other hyper-parameters, a conflict) ends it and may start the next.
//!
//! A member may also absorb its *refresh copy* ([`Refresh`]: a bf16 run's rounding `Copy` of
//! the updated master into its bf16 working copy, `lower::optim`), which the launch then makes
//! (the CUDA backend writes the update rounded to bf16, as the `Copy` rounds it): the first
//! `Copy` after the member whose only input is the member's param and whose one output is a
//! bf16 buffer of the param's element count, where
//! - no instruction between the run's first member and the `Copy` reads or writes (`Alloc` and
//!   `Free` count as writes) that working buffer (the members cannot: theirs are f32), and
//! - none between the member and the `Copy` writes the param (those between the run's first
//!   member and the member may neither read nor write it, by the rules above).
//!
//! So making the copy at the run's first member's position gives the working buffer the value
//! the `Copy` gives it, and every instruction that reads it the value it read.
//!
//! Delayed FP8 scaling's history rolls form runs too ([`find_roll_runs`]): adjacent
//! well-formed `Fp8HistoryRoll` instructions on buffers of their own.
//!
//! Gradient clipping's `SumSquares` instructions (one per gradient tensor, adjacent in the
//! program) form runs too ([`find_sum_squares_runs`]): adjacent well-formed instructions (an
//! f32 input, a one-element f32 output that is not the input) whose input no earlier member
//! writes. A backend may then read every member's input first and add the sums into the
//! outputs afterwards, in program order, with the same result.
use crate::ir::op::Op;
use crate::ir::{BufferId, Compute, DType, Inputs, Instr, Outputs, Program};
use std::collections::{HashMap, HashSet};

/// What every member of a run shares: the op's hyper-parameters other than the weight decay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RunKind {
    AdamW { beta1: f64, beta2: f64, eps: f64 },
    Sgd { momentum: f64 },
}

impl RunKind {
    /// The run kind of `op` and its weight decay, for `AdamW` and `Sgd`.
    pub fn of(op: &Op) -> Option<(RunKind, f64)> {
        match *op {
            Op::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => Some((RunKind::AdamW { beta1, beta2, eps }, weight_decay)),
            Op::Sgd {
                momentum,
                weight_decay,
            } => Some((RunKind::Sgd { momentum }, weight_decay)),
            _ => None,
        }
    }

    /// Outputs a member has: param, m, v (AdamW); param and, with momentum, its buffer (SGD).
    fn outputs(self) -> usize {
        match self {
            RunKind::AdamW { .. } => 3,
            RunKind::Sgd { momentum } => 1 + usize::from(momentum != 0.0),
        }
    }
}

/// One optimizer instruction of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunMember {
    /// Its position in the program's instructions.
    pub index: usize,
    pub op: Op,
    /// g, coef.
    pub inputs: Inputs,
    /// param, then the state (m, v; or the momentum buffer).
    pub outputs: Outputs,
    /// The weight decay of this tensor.
    pub weight_decay: f64,
    /// Elements of the gradient (and of param and each state buffer).
    pub numel: u64,
    /// Its refresh copy, which the run's launch makes (see the module docs).
    pub refresh: Option<Refresh>,
}

/// A member's refresh copy: the `Copy` of its param (the f32 master) into its bf16 working
/// copy that the run's launch makes, the `Copy` itself then a no-op (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refresh {
    /// The `Copy`'s position in the program's instructions.
    pub index: usize,
    /// Its output: the bf16 working copy, as long as the param.
    pub working: BufferId,
}

impl RunMember {
    /// Whether a compute call with these operands is this instruction.
    pub fn is(&self, op: &Op, inputs: &[BufferId], outputs: &[BufferId]) -> bool {
        self.op == *op && *self.inputs == *inputs && *self.outputs == *outputs
    }

    /// Its buffers: inputs, then outputs, then its refresh copy's working buffer.
    pub fn buffers(&self) -> impl Iterator<Item = BufferId> + '_ {
        let working = self.refresh.map(|r| r.working);
        self.inputs
            .iter()
            .chain(self.outputs.iter())
            .copied()
            .chain(working)
    }

    /// Whether a compute call with these operands is this member's absorbed refresh copy.
    pub fn is_refresh(&self, op: &Op, inputs: &[BufferId], outputs: &[BufferId]) -> bool {
        self.refresh.is_some_and(|r| {
            matches!(op, Op::Copy) && inputs == [self.outputs[0]] && outputs == [r.working]
        })
    }
}

/// A maximal run of fusable optimizer instructions (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerRun {
    pub kind: RunKind,
    /// In program order; at least two.
    pub members: Vec<RunMember>,
}

/// The member `instr` (at `index`) would be, if it is a well-formed optimizer instruction.
fn member(program: &Program, index: usize, instr: &Instr) -> Option<(RunKind, RunMember)> {
    let Compute {
        op,
        inputs,
        outputs,
        ..
    } = instr.as_compute()?;
    let (kind, weight_decay) = RunKind::of(op)?;
    if inputs.len() != 2 || outputs.len() != kind.outputs() {
        return None;
    }
    let numel = |id: BufferId| f32_numel(program, id);
    let n = numel(inputs[0])?;
    if numel(inputs[1])? != 1 || outputs.iter().any(|&o| numel(o) != Some(n)) {
        return None;
    }
    let distinct: HashSet<BufferId> = outputs.iter().copied().collect();
    if distinct.len() != outputs.len() || outputs.iter().any(|o| inputs.contains(o)) {
        return None;
    }
    Some((
        kind,
        RunMember {
            index,
            op: op.clone(),
            inputs: *inputs,
            outputs: *outputs,
            weight_decay,
            numel: n,
            refresh: None,
        },
    ))
}

/// A run being collected: the buffers its members read and write, and the buffers the other
/// instructions since its first member read and write.
struct OpenRun {
    run: OptimizerRun,
    read: HashSet<BufferId>,
    written: HashSet<BufferId>,
    between_read: HashSet<BufferId>,
    between_written: HashSet<BufferId>,
}

impl OpenRun {
    fn new(kind: RunKind, first: RunMember) -> OpenRun {
        let mut open = OpenRun {
            run: OptimizerRun {
                kind,
                members: Vec::new(),
            },
            read: HashSet::new(),
            written: HashSet::new(),
            between_read: HashSet::new(),
            between_written: HashSet::new(),
        };
        open.push(first);
        open
    }

    fn accepts(&self, kind: RunKind, m: &RunMember) -> bool {
        let untouched =
            |b: &BufferId| !self.written.contains(b) && !self.between_written.contains(b);
        let unread = |b: &BufferId| !self.read.contains(b) && !self.between_read.contains(b);
        kind == self.run.kind
            && m.inputs.iter().all(untouched)
            && m.outputs.iter().all(|b| untouched(b) && unread(b))
    }

    /// Records an instruction between members.
    fn pass(&mut self, instr: &Instr) {
        self.between_read.extend(instr.reads());
        self.between_written.extend(written(instr));
    }

    fn push(&mut self, m: RunMember) {
        self.read.extend(m.inputs.iter().copied());
        self.written.extend(m.outputs.iter().copied());
        self.run.members.push(m);
    }
}

/// The maximal fusable runs of `program`, in program order (see the module docs).
pub fn find_runs(program: &Program) -> Vec<OptimizerRun> {
    let mut runs = Vec::new();
    let mut open: Option<OpenRun> = None;
    let close = |open: &mut Option<OpenRun>, runs: &mut Vec<OptimizerRun>| {
        if let Some(done) = open.take() {
            if done.run.members.len() >= 2 {
                runs.push(done.run);
            }
        }
    };
    for (index, instr) in program.instrs.iter().enumerate() {
        let Some((kind, m)) = member(program, index, instr) else {
            if let Some(o) = open.as_mut() {
                o.pass(instr);
            }
            continue;
        };
        match open.as_mut() {
            Some(o) if o.accepts(kind, &m) => o.push(m),
            _ => {
                close(&mut open, &mut runs);
                open = Some(OpenRun::new(kind, m));
            }
        }
    }
    close(&mut open, &mut runs);
    for run in &mut runs {
        absorb_refreshes(program, run);
    }
    runs
}

/// The buffers `instr` writes, counting an `Alloc`'s or a `Free`'s buffer as written.
fn written(instr: &Instr) -> Vec<BufferId> {
    let mut buffers = instr.writes();
    if let Instr::Alloc { buffer } | Instr::Free { buffer } = instr {
        buffers.push(*buffer);
    }
    buffers
}

/// The param and working buffer of `instr` if it is a refresh copy of a param of `numel(param)`
/// elements: a `Copy` of one f32 buffer into one bf16 buffer of as many elements.
fn refresh_copy(program: &Program, instr: &Instr) -> Option<(BufferId, BufferId)> {
    let c = instr.as_compute()?;
    let (&[param], &[working]) = (&c.inputs[..], &c.outputs[..]) else {
        return None;
    };
    let out = program.buffer(working)?;
    let well_formed = matches!(c.op, Op::Copy)
        && out.dtype == DType::Bf16
        && f32_numel(program, param) == Some(out.numel());
    well_formed.then_some((param, working))
}

/// Gives each member of `run` the refresh copy it may absorb (see the module docs), in one
/// walk from the run's first member: a member's param is looked for from the member on until
/// its first refresh copy or a write of the param.
fn absorb_refreshes(program: &Program, run: &mut OptimizerRun) {
    let Some(first) = run.members.first().map(|m| m.index) else {
        return;
    };
    // Members reached whose refresh copy is still looked for: param → member.
    let mut looking: HashMap<BufferId, usize> = HashMap::new();
    // Buffers read or written since the run's first member.
    let mut touched: HashSet<BufferId> = HashSet::new();
    let mut reached = 0;
    for (index, instr) in program.instrs.iter().enumerate().skip(first) {
        if reached == run.members.len() && looking.is_empty() {
            break;
        }
        let writes = written(instr);
        for w in &writes {
            looking.remove(w);
        }
        if run.members.get(reached).is_some_and(|m| m.index == index) {
            looking.insert(run.members[reached].outputs[0], reached);
            reached += 1;
        } else if let Some((param, working)) = refresh_copy(program, instr) {
            let member = looking.remove(&param);
            if let Some(m) = member.filter(|_| !touched.contains(&working)) {
                run.members[m].refresh = Some(Refresh { index, working });
            }
        }
        touched.extend(instr.reads());
        touched.extend(writes);
    }
}

/// One `SumSquares` instruction of a run: `output[0] += Σ input²`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SumSquaresMember {
    /// Its position in the program's instructions.
    pub index: usize,
    pub input: BufferId,
    pub output: BufferId,
    /// Elements of the input.
    pub numel: u64,
}

impl SumSquaresMember {
    /// Whether a compute call with these operands is this instruction.
    pub fn is(&self, op: &Op, inputs: &[BufferId], outputs: &[BufferId]) -> bool {
        matches!(op, Op::SumSquares) && inputs == [self.input] && outputs == [self.output]
    }
}

/// A maximal run of adjacent `SumSquares` instructions (see the module docs); at least two
/// members, in program order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SumSquaresRun {
    pub members: Vec<SumSquaresMember>,
}

/// The member `instr` (at `index`) would be, if it is a well-formed `SumSquares`.
fn sum_squares_member(program: &Program, index: usize, instr: &Instr) -> Option<SumSquaresMember> {
    let Compute {
        op,
        inputs,
        outputs,
        ..
    } = instr.as_compute()?;
    if !matches!(op, Op::SumSquares) || inputs.len() != 1 || outputs.len() != 1 {
        return None;
    }
    let (input, output) = (inputs[0], outputs[0]);
    let numel = f32_numel(program, input)?;
    (f32_numel(program, output)? == 1 && input != output).then_some(SumSquaresMember {
        index,
        input,
        output,
        numel,
    })
}

/// The element count of buffer `id` of `program` if it is an f32 buffer.
fn f32_numel(program: &Program, id: BufferId) -> Option<u64> {
    (program.buffer(id))
        .filter(|b| b.dtype == DType::F32)
        .map(|b| b.numel())
}

/// The maximal runs of adjacent `SumSquares` instructions of `program` whose inputs no earlier
/// member of the run writes, in program order (see the module docs).
pub fn find_sum_squares_runs(program: &Program) -> Vec<SumSquaresRun> {
    let conflicts = |earlier: &SumSquaresMember, m: &SumSquaresMember| earlier.output == m.input;
    adjacent_runs(program, sum_squares_member, conflicts)
        .into_iter()
        .map(|members| SumSquaresRun { members })
        .collect()
}

/// The maximal runs (at least two members) of adjacent instructions of `program` that are
/// members (`member`), a run ending before a member that `conflicts` with an earlier one of it.
fn adjacent_runs<M>(
    program: &Program,
    member: impl Fn(&Program, usize, &Instr) -> Option<M>,
    conflicts: impl Fn(&M, &M) -> bool,
) -> Vec<Vec<M>> {
    let mut runs = Vec::new();
    let mut open: Vec<M> = Vec::new();
    let close = |open: &mut Vec<M>, runs: &mut Vec<Vec<M>>| {
        let members = std::mem::take(open);
        if members.len() >= 2 {
            runs.push(members);
        }
    };
    for (index, instr) in program.instrs.iter().enumerate() {
        let Some(m) = member(program, index, instr) else {
            close(&mut open, &mut runs);
            continue;
        };
        if open.iter().any(|earlier| conflicts(earlier, &m)) {
            close(&mut open, &mut runs);
        }
        open.push(m);
    }
    close(&mut open, &mut runs);
    runs
}

/// One history roll of a [`RollRun`]: its instruction, history and scale amax.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RollMember {
    pub index: usize,
    pub history: BufferId,
    pub amax: BufferId,
}

/// Adjacent `Fp8HistoryRoll` instructions (at least two) with their buffers, in program order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RollRun {
    pub members: Vec<RollMember>,
}

/// The member `instr` (at `index`) would be, if it is a well-formed `Fp8HistoryRoll`: an f32
/// history of at least two values rolled in place, one f32 scale amax that is not it.
fn roll_member(program: &Program, index: usize, instr: &Instr) -> Option<RollMember> {
    let Compute {
        op,
        inputs,
        outputs,
        ..
    } = instr.as_compute()?;
    if !matches!(op, Op::Fp8HistoryRoll(_)) || inputs.len() != 1 || outputs.len() != 2 {
        return None;
    }
    let (history, amax) = (outputs[0], outputs[1]);
    let well_formed = inputs[0] == history
        && history != amax
        && f32_numel(program, history)? >= 2
        && f32_numel(program, amax)? == 1;
    well_formed.then_some(RollMember {
        index,
        history,
        amax,
    })
}

/// The maximal runs of adjacent `Fp8HistoryRoll` instructions of `program` (delayed FP8
/// scaling's step end where no all-reduce sits between the rolls: one GPU, no dp) whose
/// buffers no earlier member of the run touches, in program order. Each member reads and
/// writes only its own history and scale amax, so a backend may make the whole run at its
/// first member's position in one launch (`runtime/src/cuda/fp8_roll.rs`) with the same
/// results; the timeline prices it so.
pub fn find_roll_runs(program: &Program) -> Vec<RollRun> {
    let conflicts = |e: &RollMember, m: &RollMember| {
        [e.history, e.amax]
            .iter()
            .any(|b| [m.history, m.amax].contains(b))
    };
    adjacent_runs(program, roll_member, conflicts)
        .into_iter()
        .map(|members| RollRun { members })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Buffer, BufferKind, CollectiveKind, GroupId};

    const ADAM: Op = Op::AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };

    fn adam_wd(weight_decay: f64) -> Op {
        Op::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay,
        }
    }

    /// Buffer 0 is the clip coefficient ([1]); tensor t (from 0) has g, param, m, v at
    /// 1 + 4t .. 4 + 4t, each of 10 + t elements; buffer 99 is a [7] i32 buffer.
    fn program(instrs: Vec<Instr>) -> Program {
        let mut buffers = vec![buffer(1, DType::F32)];
        for t in 0..20u64 {
            for _ in 0..4 {
                buffers.push(buffer(10 + t, DType::F32));
            }
        }
        while buffers.len() < 99 {
            buffers.push(buffer(5, DType::F32));
        }
        buffers.push(buffer(7, DType::I32));
        Program::new("test", buffers, instrs)
    }

    fn buffer(n: u64, dtype: DType) -> Buffer {
        Buffer {
            name: format!("b{n}"),
            shape: vec![n],
            dtype,
            kind: BufferKind::Activation,
        }
    }

    /// AdamW of tensor t with `op`: in g_t, coef; out param_t, m_t, v_t.
    fn adam_of(op: Op, t: u32) -> Instr {
        let b = 1 + 4 * t;
        Instr::compute(op, &[b, 0], &[b + 1, b + 2, b + 3])
    }

    fn grad_free(t: u32) -> Instr {
        Instr::Free {
            buffer: BufferId(1 + 4 * t),
        }
    }

    /// Each run (optimizer or `SumSquares`: both have members with an `index`) as its members'
    /// instruction indices.
    macro_rules! indices {
        ($runs:expr) => {
            ($runs.iter())
                .map(|r| r.members.iter().map(|m| m.index).collect())
                .collect::<Vec<Vec<usize>>>()
        };
    }

    #[test]
    fn updates_with_frees_between_form_one_run_with_per_tensor_decay() {
        let p = program(vec![
            Instr::compute(Op::Zero, &[], &[98]),
            adam_of(ADAM, 0),
            grad_free(0),
            adam_of(adam_wd(0.0), 1),
            grad_free(1),
            adam_of(ADAM, 2),
            grad_free(2),
            Instr::Free {
                buffer: BufferId(0),
            },
        ]);
        let runs = find_runs(&p);
        assert_eq!(indices!(runs), vec![vec![1, 3, 5]]);
        let run = &runs[0];
        assert_eq!(
            run.kind,
            RunKind::AdamW {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8
            }
        );
        let decays: Vec<f64> = run.members.iter().map(|m| m.weight_decay).collect();
        assert_eq!(decays, vec![0.1, 0.0, 0.1]);
        let sizes: Vec<u64> = run.members.iter().map(|m| m.numel).collect();
        assert_eq!(sizes, vec![10, 11, 12]);
        assert!(run.members[1].is(
            &adam_wd(0.0),
            &[BufferId(5), BufferId(0)],
            &[BufferId(6), BufferId(7), BufferId(8)]
        ));
        assert!(!run.members[1].is(
            &ADAM,
            &[BufferId(5), BufferId(0)],
            &[BufferId(6), BufferId(7), BufferId(8)]
        ));
    }

    #[test]
    fn zero_style_gathers_between_updates_stay_inside_the_run() {
        // ZeRO 1/2: each update is followed by its gradient's Free and the all-gather of the
        // updated master into a flat buffer, copied into the working parameter (here tensor
        // t's flat buffer is 81 + 2t, its working copy 82 + 2t).
        let mut instrs = Vec::new();
        for t in 0..3u32 {
            let (flat, working) = (81 + 2 * t, 82 + 2 * t);
            instrs.push(adam_of(ADAM, t));
            instrs.push(grad_free(t));
            instrs.push(Instr::Alloc {
                buffer: BufferId(flat),
            });
            instrs.push(Instr::Collective {
                kind: CollectiveKind::AllGather,
                group: GroupId(0),
                input: BufferId(2 + 4 * t),
                output: BufferId(flat),
                node: None,
            });
            let copy = Op::CopyRange {
                src_offset: 0,
                dst_offset: 0,
                len: 5,
            };
            instrs.push(Instr::compute(copy, &[flat], &[working]));
            instrs.push(Instr::Free {
                buffer: BufferId(flat),
            });
        }
        assert_eq!(indices!(find_runs(&program(instrs))), vec![vec![0, 6, 12]]);
    }

    #[test]
    fn instructions_touching_a_later_update_and_other_hyper_parameters_split_runs() {
        let other_betas = Op::AdamW {
            beta1: 0.8,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let p = program(vec![
            adam_of(ADAM, 0),
            adam_of(ADAM, 1),
            // Writes tensor 2's gradient: tensor 2 must see it.
            Instr::compute(Op::Zero, &[], &[9]),
            adam_of(ADAM, 2),
            adam_of(ADAM, 3),
            // Reads tensor 4's param: it must see the value before tensor 4's update.
            Instr::compute(Op::Copy, &[18], &[98]),
            adam_of(ADAM, 4),
            adam_of(ADAM, 5),
            adam_of(other_betas.clone(), 6),
            adam_of(other_betas, 7),
            adam_of(ADAM, 8),
            // Allocates (zeroes) tensor 9's m.
            Instr::Alloc {
                buffer: BufferId(39),
            },
            adam_of(ADAM, 9),
            // Touches nothing of tensor 10's.
            Instr::compute(Op::Zero, &[], &[98]),
            adam_of(ADAM, 10),
        ]);
        // The lone update 10 is left to the per-tensor path.
        assert_eq!(
            indices!(find_runs(&p)),
            vec![vec![0, 1], vec![3, 4], vec![6, 7], vec![8, 9], vec![12, 14]]
        );
    }

    #[test]
    fn sgd_runs_follow_momentum() {
        let sgd = |momentum: f64, weight_decay: f64| Op::Sgd {
            momentum,
            weight_decay,
        };
        let p = program(vec![
            Instr::compute(sgd(0.9, 0.1), &[1, 0], &[2, 3]),
            Instr::compute(sgd(0.9, 0.0), &[5, 0], &[6, 7]),
            Instr::compute(sgd(0.0, 0.1), &[9, 0], &[10]),
            Instr::compute(sgd(0.0, 0.1), &[13, 0], &[14]),
            // Momentum 0 takes no buffer: with one it is malformed, not a member, and (touching
            // nothing of the next update's) stays between members.
            Instr::compute(sgd(0.0, 0.1), &[17, 0], &[18, 19]),
            Instr::compute(sgd(0.0, 0.1), &[21, 0], &[22]),
        ]);
        assert_eq!(indices!(find_runs(&p)), vec![vec![0, 1], vec![2, 3, 5]]);
        assert_eq!(find_runs(&p)[1].kind, RunKind::Sgd { momentum: 0.0 });
    }

    #[test]
    fn dependent_updates_are_not_fused() {
        // Buffers 81..=98 all hold 5 elements.
        let p = program(vec![
            Instr::compute(ADAM, &[81, 0], &[82, 83, 84]),
            // Reads the param the update before it writes: it must see the update.
            Instr::compute(ADAM, &[82, 0], &[85, 86, 87]),
            Instr::compute(ADAM, &[88, 0], &[89, 90, 91]),
            // Writes the gradient the update before it reads.
            Instr::compute(ADAM, &[92, 0], &[88, 93, 94]),
            // The next update's gradient is freed inside the run, before that update.
            Instr::Free {
                buffer: BufferId(95),
            },
            Instr::compute(ADAM, &[95, 0], &[96, 97, 98]),
            adam_of(ADAM, 6),
            adam_of(ADAM, 7),
        ]);
        assert_eq!(indices!(find_runs(&p)), vec![vec![1, 2], vec![5, 6, 7]]);
    }

    #[test]
    fn malformed_updates_are_left_to_the_per_tensor_path() {
        let p = program(vec![
            // Wrong arity.
            Instr::compute(ADAM, &[1, 0], &[2, 3]),
            Instr::compute(ADAM, &[5, 0], &[6, 7]),
            // m shorter than g.
            Instr::compute(ADAM, &[9, 0], &[10, 11, 1]),
            Instr::compute(ADAM, &[13, 0], &[14, 15, 5]),
            // An i32 gradient; a coefficient of 10 elements.
            Instr::compute(ADAM, &[99, 0], &[17, 18, 19]),
            Instr::compute(ADAM, &[21, 1], &[22, 23, 24]),
            // Param also read as the gradient; param written twice.
            Instr::compute(ADAM, &[25, 0], &[25, 26, 27]),
            Instr::compute(ADAM, &[29, 0], &[30, 30, 31]),
            // Every operand right: the only run.
            adam_of(ADAM, 8),
            adam_of(ADAM, 9),
        ]);
        assert_eq!(indices!(find_runs(&p)), vec![vec![8, 9]]);
    }

    fn copy(from: u32, to: u32) -> Instr {
        Instr::compute(Op::Copy, &[from], &[to])
    }

    /// [`program`] with buffers 81 + t (t < 6) tensor t's bf16 working copy (10 + t elements).
    fn with_working_copies(instrs: Vec<Instr>) -> Program {
        let mut p = program(instrs);
        for t in 0..6 {
            p.buffers[81 + t] = buffer(10 + t as u64, DType::Bf16);
        }
        p
    }

    /// Each member's refresh copy as (copy index, working buffer).
    fn refreshes(run: &OptimizerRun) -> Vec<Option<(usize, u32)>> {
        (run.members.iter())
            .map(|m| m.refresh.map(|r| (r.index, r.working.0)))
            .collect()
    }

    #[test]
    fn refresh_copies_are_absorbed_where_their_values_stay_the_same() {
        let p = with_working_copies(vec![
            adam_of(ADAM, 0),
            grad_free(0),
            copy(2, 81),
            // A norm's update: no working copy.
            adam_of(ADAM, 1),
            grad_free(1),
            adam_of(ADAM, 2),
            grad_free(2),
            // Touches nothing of tensor 2's: its copy after the run's last member is absorbed.
            Instr::compute(Op::Zero, &[], &[98]),
            copy(10, 83),
            // A second copy of the same param is an ordinary one.
            copy(10, 83),
        ]);
        let runs = find_runs(&p);
        assert_eq!(indices!(runs), vec![vec![0, 3, 5]]);
        assert_eq!(
            refreshes(&runs[0]),
            vec![Some((2, 81)), None, Some((8, 83))]
        );
        let first = &runs[0].members[0];
        let (param, working) = ([BufferId(2)], [BufferId(81)]);
        assert!(first.is_refresh(&Op::Copy, &param, &working));
        assert!(!first.is_refresh(&Op::Copy, &param, &[BufferId(83)]));
        assert!(!runs[0].members[1].is_refresh(&Op::Copy, &[BufferId(6)], &[BufferId(82)]));
        assert!(first.buffers().any(|b| b == BufferId(81)));
        // SGD runs absorb theirs alike.
        let sgd = Op::Sgd {
            momentum: 0.9,
            weight_decay: 0.1,
        };
        let p = with_working_copies(vec![
            Instr::compute(sgd.clone(), &[1, 0], &[2, 3]),
            copy(2, 81),
            Instr::compute(sgd, &[5, 0], &[6, 7]),
            copy(6, 82),
        ]);
        assert_eq!(
            refreshes(&find_runs(&p)[0]),
            vec![Some((1, 81)), Some((3, 82))]
        );
    }

    #[test]
    fn refresh_copies_whose_values_could_change_are_left_alone() {
        let mut p = with_working_copies(vec![
            adam_of(ADAM, 0),
            // Reads tensor 0's working copy before its refresh.
            copy(81, 97),
            copy(2, 81),
            adam_of(ADAM, 1),
            // An f32 output (buffer 82 made f32 below).
            copy(6, 82),
            adam_of(ADAM, 2),
            // A bf16 output of another length.
            copy(10, 98),
            adam_of(ADAM, 3),
            // Writes tensor 3's param after its update, before its copy.
            Instr::compute(Op::Zero, &[], &[14]),
            copy(14, 84),
            // Allocates tensor 4's working copy inside the run, before its update.
            Instr::Alloc {
                buffer: BufferId(85),
            },
            adam_of(ADAM, 4),
            copy(18, 85),
            adam_of(ADAM, 5),
            copy(22, 86),
        ]);
        p.buffers[82] = buffer(11, DType::F32);
        p.buffers[98] = buffer(5, DType::Bf16);
        let runs = find_runs(&p);
        assert_eq!(indices!(runs), vec![vec![0, 3, 5, 7, 11, 13]]);
        let mut want = vec![None; 5];
        want.push(Some((14, 86)));
        assert_eq!(refreshes(&runs[0]), want);
    }

    fn sum_squares(input: u32, output: u32) -> Instr {
        Instr::compute(Op::SumSquares, &[input], &[output])
    }

    #[test]
    fn adjacent_sum_squares_into_one_scalar_form_one_run() {
        // Buffer 0 is the [1] accumulator; gradients 1, 5, 9 have 10, 11, 12 elements.
        let p = program(vec![
            Instr::compute(Op::Zero, &[], &[0]),
            sum_squares(1, 0),
            sum_squares(5, 0),
            sum_squares(9, 0),
            Instr::compute(
                Op::ClipCoef {
                    max_norm: Some(1.0),
                },
                &[0],
                &[4],
            ),
        ]);
        let runs = find_sum_squares_runs(&p);
        assert_eq!(indices!(runs), vec![vec![1, 2, 3]]);
        let sizes: Vec<u64> = runs[0].members.iter().map(|m| m.numel).collect();
        assert_eq!(sizes, vec![10, 11, 12]);
        assert!(runs[0].members[1].is(&Op::SumSquares, &[BufferId(5)], &[BufferId(0)]));
        assert!(!runs[0].members[1].is(&Op::SumSquares, &[BufferId(5)], &[BufferId(4)]));
        assert!(!runs[0].members[1].is(&Op::Copy, &[BufferId(5)], &[BufferId(0)]));
    }

    #[test]
    fn other_instructions_and_dependences_split_sum_squares_runs() {
        let mut p = program(vec![
            sum_squares(1, 0),
            sum_squares(5, 0),
            // Anything between ends the run, even a Free of an unrelated buffer.
            Instr::Free {
                buffer: BufferId(98),
            },
            sum_squares(9, 0),
            // A lone member is left to the per-instruction path.
            Instr::compute(Op::Zero, &[], &[98]),
            sum_squares(13, 0),
            sum_squares(17, 0),
            // Reads the output earlier members add into: a new run starts.
            sum_squares(0, 98),
            sum_squares(21, 98),
            // Another output is fine in the same run.
            sum_squares(25, 0),
        ]);
        // A second one-element accumulator.
        p.buffers[98] = buffer(1, DType::F32);
        assert_eq!(
            indices!(find_sum_squares_runs(&p)),
            vec![vec![0, 1], vec![5, 6], vec![7, 8, 9]]
        );
    }

    #[test]
    fn malformed_sum_squares_are_left_to_the_per_instruction_path() {
        let p = program(vec![
            // An i32 input; an output of 10 elements; the input as the output; two inputs.
            sum_squares(99, 0),
            sum_squares(1, 5),
            sum_squares(0, 0),
            Instr::compute(Op::SumSquares, &[1, 5], &[0]),
            sum_squares(9, 0),
            sum_squares(13, 0),
        ]);
        assert_eq!(indices!(find_sum_squares_runs(&p)), vec![vec![4, 5]]);
    }

    #[test]
    fn adjacent_rolls_on_their_own_buffers_form_runs() {
        use crate::ir::fp8::Fp8HistoryAttrs;
        let roll = |history: u32, amax: u32| {
            let attrs = Fp8HistoryAttrs {
                history: 4,
                rows: None,
                cols: 0,
            };
            Instr::compute(Op::Fp8HistoryRoll(attrs), &[history], &[history, amax])
        };
        let mut p = program(vec![
            roll(1, 90),
            roll(2, 91),
            roll(3, 92),
            // The scale amax of an earlier member: a new run starts.
            roll(4, 90),
            roll(5, 93),
            Instr::Free {
                buffer: BufferId(98),
            },
            // A ten-element scale amax; an i32 history; a lone roll.
            roll(6, 7),
            roll(99, 91),
            roll(8, 92),
            Instr::compute(Op::Zero, &[], &[98]),
            roll(9, 91),
            roll(10, 92),
        ]);
        for amax in 90..94 {
            p.buffers[amax] = buffer(1, DType::F32);
        }
        let runs = find_roll_runs(&p);
        assert_eq!(
            indices!(runs),
            vec![vec![0, 1, 2], vec![3, 4], vec![10, 11]]
        );
        let first = runs[0].members[0];
        assert_eq!((first.history, first.amax), (BufferId(1), BufferId(90)));
    }
}
