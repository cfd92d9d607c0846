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
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

/// One rotation table of the program: its buffer and first and last reader's place.
struct Table {
    key: TableKey,
    buffer: BufferId,
    first: usize,
    last: usize,
}

/// Replace `groups`' members in `program` by fused instructions (see the module docs).
pub(super) fn rewrite(program: &mut Program, groups: &[Group]) -> Result<(), String> {
    let tables = declare_tables(program, groups);
    let table_of: HashMap<&TableKey, BufferId> =
        tables.iter().map(|t| (&t.key, t.buffer)).collect();
    let internal: HashSet<BufferId> = groups
        .iter()
        .flat_map(|g| g.built.internal.iter().copied())
        .collect();
    let deferred = deferred_frees(program, groups);
    let mut after: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (&j, &place) in &deferred {
        after.entry(place).or_default().push(j);
    }
    for frees in after.values_mut() {
        frees.sort_unstable();
    }
    let moved: HashSet<usize> = groups
        .iter()
        .flat_map(|g| g.members.iter().copied().filter(|m| *m != g.place))
        .collect();
    let by_place: HashMap<usize, &Group> = groups.iter().map(|g| (g.place, g)).collect();
    let mut ops: HashMap<String, Arc<Op>> = HashMap::new();
    let old = std::mem::take(&mut program.instrs);
    let mut instrs = Vec::with_capacity(old.len());
    for (i, instr) in old.iter().enumerate() {
        if moved.contains(&i) || deferred.contains_key(&i) || drops(instr, &internal) {
            continue;
        }
        let Some(group) = by_place.get(&i) else {
            instrs.push(instr.clone());
            continue;
        };
        let (node, phase) = match instr {
            Instr::Compute { node, phase, .. } => (*node, *phase),
            _ => {
                return Err(format!(
                    "instruction {i} is a group's place but not a compute"
                ))
            }
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
        for t in tables.iter().filter(|t| t.first == i) {
            instrs.push(Instr::Alloc { buffer: t.buffer });
            instrs.push(compute(
                Arc::new(Op::RopeTable(t.key.attrs())),
                &[],
                &[t.buffer],
            )?);
        }
        let inputs = group
            .built
            .inputs
            .iter()
            .map(|s| match s {
                Source::Buffer(b) => Ok(*b),
                Source::Table(key) => table_of
                    .get(key)
                    .copied()
                    .ok_or_else(|| "a rotation table was not declared".to_string()),
            })
            .collect::<Result<Vec<_>, String>>()?;
        let op = shared_op(&mut ops, fused_attrs(&old, group));
        instrs.push(compute(op, &inputs, &group.built.outputs)?);
        for t in tables.iter().filter(|t| t.last == i) {
            instrs.push(Instr::Free { buffer: t.buffer });
        }
        for j in after.get(&i).into_iter().flatten() {
            if let Some(free) = old.get(*j) {
                instrs.push(free.clone());
            }
        }
    }
    program.instrs = instrs;
    Ok(())
}

/// Whether `instr` allocates or frees a buffer that disappeared.
fn drops(instr: &Instr, internal: &HashSet<BufferId>) -> bool {
    match instr {
        Instr::Alloc { buffer } | Instr::Free { buffer } => internal.contains(buffer),
        _ => false,
    }
}

/// The `Free`s between a group's first member and its place of a buffer the fused op binds,
/// by instruction, each with the latest such place (where it moves).
fn deferred_frees(program: &Program, groups: &[Group]) -> HashMap<usize, usize> {
    let mut deferred: HashMap<usize, usize> = HashMap::new();
    for g in groups {
        let bound: HashSet<BufferId> = g
            .built
            .inputs
            .iter()
            .filter_map(|s| match s {
                Source::Buffer(b) => Some(*b),
                Source::Table(_) => None,
            })
            .chain(g.built.outputs.iter().copied())
            .collect();
        let first = g.members.first().copied().unwrap_or(g.place);
        for j in first + 1..g.place {
            if let Some(Instr::Free { buffer }) = program.instrs.get(j) {
                if bound.contains(buffer) {
                    let place = deferred.entry(j).or_insert(g.place);
                    *place = (*place).max(g.place);
                }
            }
        }
    }
    deferred
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
            if let Some(t) = tables.iter_mut().find(|t| t.key == *key) {
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

/// The fused op of `group`: named after the ops it replaces (`split_columns+rope`).
fn fused_attrs(instrs: &[Instr], group: &Group) -> FusedAttrs {
    let mut names: Vec<String> = Vec::new();
    for op in group.members.iter().filter_map(|m| instrs.get(*m)?.op()) {
        let name = match op {
            Op::Fused(a) => a.name.clone(),
            other => other.opcode().name().to_string(),
        };
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let built = &group.built;
    FusedAttrs {
        name: names.join("+"),
        rows: built.fixes_rows.then_some(built.rows),
        kernel: Arc::new(built.kernel.clone()),
    }
}

/// The fused op of `attrs`, or an equal one made before (the same layer in every microbatch
/// shares one).
fn shared_op(ops: &mut HashMap<String, Arc<Op>>, attrs: FusedAttrs) -> Arc<Op> {
    let key = format!("{attrs:?}");
    ops.entry(key)
        .or_insert_with(|| Arc::new(Op::Fused(attrs)))
        .clone()
}
