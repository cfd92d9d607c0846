//! The layout checker: proves that no two buffers alive at the same instruction share a byte
//! and that every buffer lies inside its region at an aligned offset. Independent of how the
//! planner placed them: it replays the program's `Alloc`/`Free` instructions with the live
//! buffers' byte ranges in an ordered map, checking each new range against its neighbours.
use super::{MemoryLayout, Placement, ALIGN};
use crate::ir::{Buffer, BufferId, Instr, Program};
use std::collections::BTreeMap;
use std::ops::Bound;

/// `Ok` when `layout` is safe for `program`; otherwise what is wrong, naming the buffers and
/// the instruction.
pub fn check_layout(program: &Program, layout: &MemoryLayout) -> Result<(), String> {
    let n = program.buffers.len();
    if layout.placements.len() != n {
        return Err(format!(
            "the layout places {} buffers but the program has {n}",
            layout.placements.len()
        ));
    }
    let name = |b: usize| {
        program
            .buffers
            .get(b)
            .map_or_else(|| format!("b{b}"), |x| format!("b{b} `{}`", x.name))
    };
    let inside = |b: usize, buffer: &Buffer, offset: u64, region: u64, what: &str| {
        if !offset.is_multiple_of(ALIGN) {
            return Err(format!(
                "{} is at offset {offset}, not a multiple of {ALIGN}",
                name(b)
            ));
        }
        if offset
            .checked_add(buffer.bytes())
            .is_none_or(|end| end > region)
        {
            return Err(format!(
                "{} ({} bytes at {offset}) reaches past the {what} ({region} bytes)",
                name(b),
                buffer.bytes()
            ));
        }
        Ok(())
    };
    // Persistent buffers are all alive at once.
    let mut persistent: Vec<(u64, u64, usize)> = Vec::new();
    for (b, buffer) in program.buffers.iter().enumerate() {
        match (buffer.kind.is_persistent(), layout.placements[b]) {
            (true, Placement::Persistent(offset)) => {
                inside(
                    b,
                    buffer,
                    offset,
                    layout.persistent_bytes,
                    "persistent region",
                )?;
                if buffer.bytes() > 0 {
                    persistent.push((offset, offset + buffer.bytes(), b));
                }
            }
            (true, other) => {
                return Err(format!("{} is persistent but placed as {other:?}", name(b)))
            }
            (false, Placement::Persistent(_)) => {
                return Err(format!(
                    "{} is transient but placed in the persistent region",
                    name(b)
                ))
            }
            (false, _) => {}
        }
    }
    persistent.sort_unstable();
    for pair in persistent.windows(2) {
        if let [(_, end, a), (start, _, b)] = pair {
            if start < end {
                return Err(format!("{} and {} share bytes", name(*a), name(*b)));
            }
        }
    }
    // Transients: replay the step with the live ranges keyed by offset.
    let mut live: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
    for (i, instr) in program.instrs.iter().enumerate() {
        match instr {
            Instr::Alloc { buffer } => {
                let b = buffer.0 as usize;
                let Some(buf) = program.buffers.get(b) else {
                    return Err(format!("instruction {i} allocates unknown b{b}"));
                };
                let Placement::Arena(offset) = layout.placement(BufferId(b as u32)) else {
                    return Err(format!(
                        "instruction {i} allocates {}, which has no arena offset",
                        name(b)
                    ));
                };
                inside(b, buf, offset, layout.arena_bytes, "arena")?;
                let end = offset + buf.bytes();
                if end == offset {
                    continue;
                }
                let below = live.range(..=offset).next_back();
                let above = live
                    .range((Bound::Excluded(offset), Bound::Unbounded))
                    .next();
                let clash = below
                    .filter(|(_, &(e, _))| e > offset)
                    .or(above.filter(|(&s, _)| s < end));
                if let Some((_, &(_, other))) = clash {
                    return Err(format!(
                        "instruction {i} allocates {} at bytes {offset}..{end}, which overlap \
                         {}, still alive",
                        name(b),
                        name(other)
                    ));
                }
                live.insert(offset, (end, b));
            }
            Instr::Free { buffer } => {
                if let Placement::Arena(offset) = layout.placement(*buffer) {
                    if live
                        .get(&offset)
                        .is_some_and(|&(_, b)| b == buffer.0 as usize)
                    {
                        live.remove(&offset);
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}
