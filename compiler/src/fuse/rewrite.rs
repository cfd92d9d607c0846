//! Rewriting a program with its groups (`group`): each group's members become one
//! `Op::Fused` instruction at the group's place; a buffer only members used disappears with
//! its `Alloc` and `Free`; a `Free` that fell between a group's members and its place moves
//! right after it; and each distinct rotation table the kernels read is made once, by an
//! `Op::RopeTable` allocated before its first reader and freed after its last.
use super::group::Group;
use super::kernel::{Source, TableKey};
use crate::ir::op::{segments_len, FusedAttrs, Op};
use crate::ir::operands::{Inputs, Outputs};
use crate::ir::{Buffer, BufferId, BufferKind, DType, Instr, Program};
use std::collections::HashMap;
use std::sync::Arc;

/// One rotation table of the program: its buffer and first and last reader's place.
struct Table {
    key: Arc<TableKey>,
    buffer: BufferId,
    first: usize,
    last: usize,
}

/// What the rewrite does with an instruction.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Action {
    Keep,
    /// A member moved to its group's place, a free moved after it, or the `Alloc`/`Free` of a
    /// buffer that disappeared.
    Drop,
    /// The place of group `k`.
    Place(usize),
}

/// Replace `groups`' members in `program` by fused instructions (see the module docs).
pub(super) fn rewrite(program: &mut Program, groups: &[Group]) -> Result<(), String> {
    let tables = declare_tables(program, groups);
    let table_of: HashMap<&TableKey, BufferId> =
        tables.iter().map(|t| (&*t.key, t.buffer)).collect();
    let mut internal = vec![false; program.buffers.len()];
    for b in groups.iter().flat_map(|g| g.built.internal.iter()) {
        if let Some(slot) = internal.get_mut(b.0 as usize) {
            *slot = true;
        }
    }
    let mut action: Vec<Action> = program
        .instrs
        .iter()
        .map(|instr| match instr {
            Instr::Alloc { buffer } | Instr::Free { buffer }
                if internal.get(buffer.0 as usize) == Some(&true) =>
            {
                Action::Drop
            }
            _ => Action::Keep,
        })
        .collect();
    for (k, g) in groups.iter().enumerate() {
        for m in &g.members {
            action[*m] = Action::Drop;
        }
        action[g.place] = Action::Place(k);
    }
    let after = deferred_frees(program, groups);
    for (j, _) in after.iter().flatten() {
        action[*j] = Action::Drop;
    }
    let ops = fused_ops(groups);
    let ctx = Emit {
        groups,
        ops: &ops,
        tables: &tables,
        table_of: &table_of,
        after: &after,
    };
    let mut out = InPlace::new(&mut program.instrs);
    for (i, action) in action.into_iter().enumerate() {
        let instr = out.take(i);
        match action {
            Action::Keep => out.push(instr),
            Action::Drop => {}
            Action::Place(k) => ctx.place(i, k, instr, &mut out)?,
        }
        out.settle(i);
    }
    out.finish();
    Ok(())
}

/// What the fused instructions are made from.
struct Emit<'a> {
    groups: &'a [Group],
    ops: &'a [Arc<Op>],
    tables: &'a [Table],
    table_of: &'a HashMap<&'a TableKey, BufferId>,
    after: &'a [Vec<(usize, BufferId)>],
}

impl Emit<'_> {
    /// At `instr` (instruction `i`, the place of group `k`): the rotation tables first read
    /// here, the fused instruction, the tables last read here and the frees moved after it.
    fn place(&self, i: usize, k: usize, instr: Instr, out: &mut InPlace) -> Result<(), String> {
        let (Some(group), Some(op)) = (self.groups.get(k), self.ops.get(k)) else {
            return Err(format!(
                "instruction {i} is the place of a group that is missing"
            ));
        };
        let Instr::Compute { node, phase, .. } = instr else {
            return Err(format!(
                "instruction {i} is a group's place but not a compute"
            ));
        };
        let compute = |op: Arc<Op>, inputs: &[BufferId], outputs: &[BufferId]| {
            Ok::<_, String>(Instr::Compute {
                op,
                inputs: Inputs::from_slice(inputs).ok_or("too many inputs")?,
                outputs: Outputs::from_slice(outputs).ok_or("too many outputs")?,
                node,
                phase,
            })
        };
        for t in self.tables.iter().filter(|t| t.first == i) {
            out.push(Instr::Alloc { buffer: t.buffer });
            let op = Arc::new(Op::RopeTable(t.key.attrs()));
            out.push(compute(op, &[], &[t.buffer])?);
        }
        let inputs = group
            .built
            .inputs
            .iter()
            .map(|s| match s {
                Source::Buffer(b) => Ok(*b),
                Source::Table(key) => self
                    .table_of
                    .get(&**key)
                    .copied()
                    .ok_or_else(|| "a rotation table was not declared".to_string()),
            })
            .collect::<Result<Vec<_>, String>>()?;
        out.push(compute(op.clone(), &inputs, &group.built.outputs)?);
        for t in self.tables.iter().filter(|t| t.last == i) {
            out.push(Instr::Free { buffer: t.buffer });
        }
        for &(_, buffer) in self.after.get(k).into_iter().flatten() {
            out.push(Instr::Free { buffer });
        }
        Ok(())
    }
}

/// Rewriting an instruction list in its own memory: instruction `i` is taken out before
/// anything is written for it, and what is written goes to the first free slot, at or before
/// the last taken one, or waits (in order) until one is free. The rewrite mostly shrinks the
/// list (a group's members become one instruction), so little ever waits.
struct InPlace<'a> {
    instrs: &'a mut Vec<Instr>,
    /// The next slot to write.
    written: usize,
    /// How many instructions were taken out.
    taken: usize,
    waiting: std::collections::VecDeque<Instr>,
}

impl<'a> InPlace<'a> {
    fn new(instrs: &'a mut Vec<Instr>) -> InPlace<'a> {
        InPlace {
            instrs,
            written: 0,
            taken: 0,
            waiting: std::collections::VecDeque::new(),
        }
    }

    /// Instruction `i`, taken out (a placeholder left in its slot).
    fn take(&mut self, i: usize) -> Instr {
        let hole = Instr::Free {
            buffer: BufferId(u32::MAX),
        };
        self.taken = i + 1;
        match self.instrs.get_mut(i) {
            Some(slot) => std::mem::replace(slot, hole),
            None => hole,
        }
    }

    /// Write `instr` next.
    fn push(&mut self, instr: Instr) {
        if self.waiting.is_empty() && self.written < self.taken {
            if let Some(slot) = self.instrs.get_mut(self.written) {
                *slot = instr;
                self.written += 1;
                return;
            }
        }
        self.waiting.push_back(instr);
    }

    /// Write what waits into the slots up to `i`, all taken.
    fn settle(&mut self, i: usize) {
        while self.written <= i {
            let Some(instr) = self.waiting.pop_front() else {
                return;
            };
            if let Some(slot) = self.instrs.get_mut(self.written) {
                *slot = instr;
            }
            self.written += 1;
        }
    }

    /// The written instructions and, after them, what still waits.
    fn finish(self) {
        self.instrs.truncate(self.written);
        self.instrs.extend(self.waiting);
    }
}

/// Per group, the `Free`s (instruction, buffer) between its first member and its place of a
/// buffer its fused op binds, in order: they move right after the fused op (a free several
/// groups span moves after the latest).
fn deferred_frees(program: &Program, groups: &[Group]) -> Vec<Vec<(usize, BufferId)>> {
    let mut claimed: HashMap<usize, (usize, BufferId)> = HashMap::new();
    for (k, g) in groups.iter().enumerate() {
        let bound = |b: &BufferId| {
            g.built.outputs.contains(b) || g.built.inputs.contains(&Source::Buffer(*b))
        };
        let first = g.members.first().copied().unwrap_or(g.place);
        for j in first + 1..g.place {
            let Some(Instr::Free { buffer }) = program.instrs.get(j) else {
                continue;
            };
            if bound(buffer) {
                let slot = claimed.entry(j).or_insert((k, *buffer));
                if groups.get(slot.0).is_some_and(|h| h.place < g.place) {
                    slot.0 = k;
                }
            }
        }
    }
    let mut after: Vec<Vec<(usize, BufferId)>> = vec![Vec::new(); groups.len()];
    for (j, (k, buffer)) in claimed {
        if let Some(list) = after.get_mut(k) {
            list.push((j, buffer));
        }
    }
    for list in &mut after {
        list.sort_unstable();
    }
    after
}

/// Declares a buffer for each distinct rotation table the groups read, with its first and
/// last reader.
fn declare_tables(program: &mut Program, groups: &[Group]) -> Vec<Table> {
    let mut tables: Vec<Table> = Vec::new();
    let mut ordered: Vec<&Group> = groups.iter().collect();
    ordered.sort_by_key(|g| g.place);
    for g in ordered {
        for source in &g.built.inputs {
            let Source::Table(key) = source else {
                continue;
            };
            if let Some(t) = tables.iter_mut().find(|t| *t.key == **key) {
                t.last = g.place;
                continue;
            }
            let buffer = BufferId(program.buffers.len() as u32);
            program.buffers.push(Buffer {
                name: format!("rope_table.{}", tables.len()),
                shape: vec![u64::from(segments_len(&key.positions)), key.head_dim * 2],
                dtype: DType::F32,
                kind: BufferKind::Activation,
            });
            tables.push(Table {
                key: key.clone(),
                buffer,
                first: g.place,
                last: g.place,
            });
        }
    }
    tables
}

/// The fused op of each group; groups with one kernel, name and rows share one op.
fn fused_ops(groups: &[Group]) -> Vec<Arc<Op>> {
    let mut shared: HashMap<(usize, usize, Option<u64>), Arc<Op>> = HashMap::new();
    groups
        .iter()
        .map(|g| {
            let built = &g.built;
            let rows = built.fixes_rows.then_some(built.rows);
            let kernel = Arc::as_ptr(&built.kernel) as usize;
            let name = Arc::as_ptr(&built.name).cast::<u8>() as usize;
            shared
                .entry((kernel, name, rows))
                .or_insert_with(|| {
                    Arc::new(Op::Fused(FusedAttrs {
                        name: built.name.to_string(),
                        rows,
                        kernel: built.kernel.clone(),
                    }))
                })
                .clone()
        })
        .collect()
}
