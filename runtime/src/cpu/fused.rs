//! Generated kernels on the CPU (`Op::Fused`): the compiler's reference evaluator
//! (`kir::eval::run`) on the kernel expanded into primitive ops (`kir::expand`), so the CPU
//! computes exactly the bits every emitter must. Rows are split into chunks whose size depends
//! only on the kernel (`par`), run in parallel: a row's values never depend on another row's,
//! so the result is the same for any thread count. `Elem` and `Row` operands are handed as
//! each chunk's rows; `Col` and `PerPosition` inputs whole (a table is indexed by the absolute
//! row, hence each chunk's first row). bf16 operands arrive staged through f32 (`staging`).
//!
//! The expansion is made once per kernel: cached by the address of the op's `Arc<Kernel>`,
//! the entry keeping a `Weak` of it so the address cannot be reused by another kernel while
//! the entry lives; entries of dropped kernels are pruned when a new one is added.
use super::args::{Inputs, Outputs};
use super::par::rows_per_task;
use crate::error::Result;
use parc_compiler::ir::op::FusedAttrs;
use parc_compiler::kir::{self, Access, Kernel};
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// Runs an `Op::Fused` on its bound, staged buffers.
pub(crate) fn run(attrs: &FusedAttrs, ins: &Inputs, outs: &mut Outputs) -> Result<()> {
    let kernel = expanded(&attrs.kernel);
    let inputs = ins.all_f32()?;
    let mut outputs = outs.all_f32()?;
    let Some(rows) = rows(&kernel, &outputs) else {
        return Ok(());
    };
    check_tables(ins, &kernel, &inputs, rows)?;
    let chunk = rows_per_task(row_elements(&kernel) as usize);
    // Each output cut into chunks of `chunk` rows, then regrouped by chunk.
    let mut per_chunk: Vec<Vec<&mut [f32]>> =
        (0..rows.div_ceil(chunk)).map(|_| Vec::new()).collect();
    for (out, access) in outputs.iter_mut().zip(&kernel.outputs) {
        let width = row_width(access);
        for (i, part) in out.chunks_mut(chunk * width).enumerate() {
            if let Some(slot) = per_chunk.get_mut(i) {
                slot.push(part);
            }
        }
    }
    let failed: Option<String> = per_chunk
        .into_par_iter()
        .enumerate()
        .filter_map(|(i, mut outs)| {
            let first = i * chunk;
            let n = chunk.min(rows - first);
            let ins: Vec<&[f32]> = (inputs.iter().zip(&kernel.inputs))
                .map(|(x, a)| chunk_rows(x, a, first, n))
                .collect();
            kir::eval::run(&kernel, first, n, &ins, &mut outs).err()
        })
        .find_any(|_| true);
    match failed {
        Some(e) => Err(ins.err(format!("kernel `{}`: {e}", attrs.kernel))),
        None => Ok(()),
    }
}

/// Values a row has in an operand of this access that is cut by rows (`Elem`, `Row`).
fn row_width(access: &Access) -> usize {
    match *access {
        Access::Elem { width } => width as usize,
        _ => 1,
    }
}

/// Rows `first .. first + n` of an operand cut by rows; a `Col` or `PerPosition` input whole.
fn chunk_rows<'a>(x: &'a [f32], access: &Access, first: usize, n: usize) -> &'a [f32] {
    match access {
        Access::Elem { .. } | Access::Row => {
            let w = row_width(access);
            x.get(first * w..(first + n) * w).unwrap_or(&[])
        }
        Access::Col | Access::PerPosition { .. } => x,
    }
}

/// The rows of the op (from its first output, which binding checked), or None without outputs.
fn rows(kernel: &Kernel, outputs: &[&mut [f32]]) -> Option<usize> {
    let (out, access) = outputs.first().zip(kernel.outputs.first())?;
    Some(out.len() / row_width(access).max(1))
}

/// The elements one row of the op touches (its chunking weight).
fn row_elements(kernel: &Kernel) -> u64 {
    let elem = |a: &Access| match *a {
        Access::Elem { width } => width,
        _ => 1,
    };
    (kernel.inputs.iter().chain(&kernel.outputs))
        .map(elem)
        .sum::<u64>()
        .max(1)
}

/// A per-position table must have a row for every position the rows reach (binding checked
/// only that it is whole rows).
fn check_tables(ins: &Inputs, kernel: &Kernel, inputs: &[&[f32]], rows: usize) -> Result<()> {
    for (i, (access, x)) in kernel.inputs.iter().zip(inputs).enumerate() {
        if let Access::PerPosition { batch, width } = *access {
            let have = x.len() as u64 / width.max(1);
            let need = (rows as u64).div_ceil(batch.max(1));
            if have < need {
                return Err(ins.err(format!(
                    "input {i} is a table of {have} positions, but {rows} rows of batch {batch} read {need}"
                )));
            }
        }
    }
    Ok(())
}

/// Expansions made so far, by the address of the kernel they expand (see the module docs).
type Expansions = HashMap<usize, (Weak<Kernel>, Arc<Kernel>)>;

/// `kernel` expanded into primitive ops (cached).
fn expanded(kernel: &Arc<Kernel>) -> Arc<Kernel> {
    static CACHE: OnceLock<Mutex<Expansions>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = Arc::as_ptr(kernel) as usize;
    if let Ok(map) = cache.lock() {
        if let Some((weak, done)) = map.get(&key) {
            if weak.upgrade().is_some_and(|k| Arc::ptr_eq(&k, kernel)) {
                return done.clone();
            }
        }
    }
    let done = Arc::new(kir::expand::expand(kernel));
    if let Ok(mut map) = cache.lock() {
        map.retain(|_, (weak, _)| weak.strong_count() > 0);
        map.insert(key, (Arc::downgrade(kernel), done.clone()));
    }
    done
}

#[cfg(test)]
pub(crate) mod tests;
