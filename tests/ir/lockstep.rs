//! A lock-step, single-threaded executor of a whole plan on the CPU backend, for testing the
//! lowering numerically: every rank's program advances until it blocks on communication; a
//! collective runs once all members of the set reached it, a transfer once both sides posted
//! it. Collectives reduce in group-rank order. Tokens are a fixed function of (sample,
//! position); step `k`'s global batch is samples `[k·G, (k+1)·G)`, dp rank `d`'s microbatch `j`
//! the slice starting at `(d·m + j)·micro_batch`.

use parc_compiler::ir::op::position_at;
use parc_compiler::ir::{CollectiveKind, Instr, P2pOp, Plan, ReduceOp};
use parc_compiler::spec::{Axis, Spec};
use parc_runtime::backend::{Backend, StepScalars};
use parc_runtime::cpu::CpuBackend;
use parc_runtime::init::{fill_local_param, ZeroShard};

pub struct Run {
    pub losses: Vec<f64>,
    pub grad_norms: Vec<f64>,
    /// Every global parameter after the last step, reassembled from the ranks' shards.
    pub params: Vec<Vec<f32>>,
}

fn token(sample: u64, pos: u64, vocab: u64) -> i32 {
    ((sample * 131 + pos * 7 + sample * pos * 3 + pos * pos) % vocab) as i32
}

pub fn run(spec: &Spec, plan: &Plan, steps: u64) -> Result<Run, String> {
    let world = plan.world as usize;
    let progs: Vec<_> = (0..plan.world)
        .map(|r| plan.program_of(r).ok_or(format!("rank {r} has no program")))
        .collect::<Result<_, _>>()?;
    let mut backends: Vec<CpuBackend> = (0..world).map(|_| CpuBackend::new()).collect();
    let e = |x: parc_runtime::error::RuntimeError| x.to_string();
    for r in 0..world {
        let prog = progs[r];
        for (i, b) in prog.buffers.iter().enumerate() {
            if b.kind.is_persistent() {
                backends[r]
                    .alloc(parc_compiler::ir::BufferId(i as u32), &b.shape, b.dtype)
                    .map_err(e)?;
            }
        }
        for l in &prog.params {
            let p = &plan.params.params[l.param.0 as usize];
            let zero = match l.zero {
                None => None,
                Some(z) => {
                    let g = plan.group(z.group).ok_or("bad zero group")?;
                    let (_, idx) = g.set_of(r as u32).ok_or("rank not in zero group")?;
                    Some(ZeroShard {
                        shard_len: z.shard_len,
                        index: idx as u64,
                    })
                }
            };
            let n = prog.buffers[l.master.0 as usize].numel() as usize;
            let mut data = vec![0f32; n];
            fill_local_param(
                &mut data,
                p.init,
                spec.train.seed,
                l.param,
                &p.shape,
                l.tp,
                zero,
            )
            .map_err(e)?;
            backends[r].write_f32(l.master, &data).map_err(e)?;
            if let Some(w) = l.working {
                let n = prog.buffers[w.0 as usize].numel() as usize;
                let mut data = vec![0f32; n];
                fill_local_param(
                    &mut data,
                    p.init,
                    spec.train.seed,
                    l.param,
                    &p.shape,
                    l.tp,
                    None,
                )
                .map_err(e)?;
                backends[r].write_f32(w, &data).map_err(e)?;
            }
        }
    }
    let mut out = Run {
        losses: Vec::new(),
        grad_norms: Vec::new(),
        params: Vec::new(),
    };
    for step in 0..steps {
        let scalars = StepScalars {
            lr: spec.train.schedule.lr_at(spec.train.optimizer.lr(), step),
            step: step + 1,
        };
        run_step(spec, plan, &progs, &mut backends, step, &scalars)?;
        let rr = plan.report_rank as usize;
        let prog = progs[rr];
        let loss = prog.loss.ok_or("report rank has no loss")?;
        let sumsq = prog.grad_sumsq.ok_or("report rank has no grad_sumsq")?;
        out.losses
            .push(f64::from(backends[rr].read_f32(loss).map_err(e)?[0]));
        out.grad_norms
            .push(f64::from(backends[rr].read_f32(sumsq).map_err(e)?[0]).sqrt());
    }
    out.params = gather_params(plan, &progs, &backends)?;
    Ok(out)
}

/// Reassemble each global parameter from the first rank holding each of its tp blocks: the
/// working copy, the full master, or (ZeRO-3) the master shards of the rank's ZeRO set.
fn gather_params(
    plan: &Plan,
    progs: &[&parc_compiler::ir::Program],
    backends: &[CpuBackend],
) -> Result<Vec<Vec<f32>>, String> {
    let e = |x: parc_runtime::error::RuntimeError| x.to_string();
    let mut out: Vec<Vec<f32>> = plan
        .params
        .params
        .iter()
        .map(|p| vec![f32::NAN; p.shape.iter().product::<u64>() as usize])
        .collect();
    for r in 0..plan.world as usize {
        for l in &progs[r].params {
            let p = &plan.params.params[l.param.0 as usize];
            let local: Vec<f32> = match (l.working, l.zero) {
                (Some(w), _) => backends[r].read_f32(w).map_err(e)?,
                (None, None) => backends[r].read_f32(l.master).map_err(e)?,
                (None, Some(z)) => {
                    let g = plan.group(z.group).ok_or("bad zero group")?;
                    let (set, _) = g.set_of(r as u32).ok_or("rank not in its zero group")?;
                    let mut flat = Vec::new();
                    for &m in set {
                        let prog = progs[m as usize];
                        let Some(ml) = prog.params.iter().find(|x| x.param == l.param) else {
                            return Err(format!("rank {m} lacks {}", p.name));
                        };
                        flat.extend(backends[m as usize].read_f32(ml.master).map_err(e)?);
                    }
                    let numel = prog_numel(&p.shape, l.tp);
                    flat.truncate(numel);
                    flat
                }
            };
            let global = &mut out[l.param.0 as usize];
            for (i, v) in local.iter().enumerate() {
                global[global_index(&p.shape, l.tp, i as u64) as usize] = *v;
            }
        }
    }
    Ok(out)
}

fn prog_numel(shape: &[u64], tp: Option<parc_compiler::ir::TpSplit>) -> usize {
    let n: u64 = shape.iter().product();
    (n / u64::from(tp.map_or(1, |t| t.parts))) as usize
}

/// Global flat index of tp-local flat element `i`.
fn global_index(shape: &[u64], tp: Option<parc_compiler::ir::TpSplit>, i: u64) -> u64 {
    let mut local = shape.to_vec();
    let mut offset = vec![0u64; shape.len()];
    if let Some(t) = tp {
        let d = t.dim as usize;
        local[d] = shape[d] / u64::from(t.parts);
        offset[d] = local[d] * u64::from(t.index);
    }
    let mut rem = i;
    let mut coords = vec![0u64; shape.len()];
    for d in (0..shape.len()).rev() {
        coords[d] = rem % local[d];
        rem /= local[d];
    }
    coords
        .iter()
        .zip(&offset)
        .zip(shape)
        .fold(0, |acc, ((c, o), n)| acc * n + c + o)
}

type Pending = (bool, u32, u32, parc_compiler::ir::BufferId);

fn run_step(
    spec: &Spec,
    plan: &Plan,
    progs: &[&parc_compiler::ir::Program],
    backends: &mut [CpuBackend],
    step: u64,
    scalars: &StepScalars,
) -> Result<(), String> {
    let world = progs.len();
    let e = |x: parc_runtime::error::RuntimeError| x.to_string();
    let mut pc = vec![0usize; world];
    let mut pending: Vec<Option<Vec<Pending>>> = vec![None; world];
    let m = u64::from(plan.microbatches);
    let mb = plan.micro_batch;
    let global = spec.train.global_batch;
    loop {
        let mut progressed = false;
        for r in 0..world {
            while let Some(instr) = progs[r].instrs.get(pc[r]) {
                let be = &mut backends[r];
                match instr {
                    Instr::Alloc { buffer } => {
                        let b = &progs[r].buffers[buffer.0 as usize];
                        be.alloc(*buffer, &b.shape, b.dtype).map_err(e)?;
                    }
                    Instr::Free { buffer } => be.free(*buffer).map_err(e)?,
                    Instr::Compute {
                        op,
                        inputs,
                        outputs,
                        ..
                    } => be
                        .compute(op, inputs, outputs, scalars)
                        .map_err(|x| format!("rank {r} instr {}: {x}", pc[r]))?,
                    Instr::LoadBatch {
                        microbatch,
                        positions,
                        tokens,
                        targets,
                    } => {
                        let d = u64::from(plan.mesh.coord(r as u32, Axis::Dp));
                        let len = parc_compiler::ir::op::segments_len(positions);
                        let first = step * global + (d * m + u64::from(*microbatch)) * mb;
                        for (buf, shift) in [(tokens, 0u64), (targets, 1u64)] {
                            let Some(buf) = buf else { continue };
                            let mut data = vec![0i32; (u64::from(len) * mb) as usize];
                            for s in 0..len {
                                let pos = u64::from(position_at(positions, s).unwrap_or(0));
                                for b in 0..mb {
                                    data[(u64::from(s) * mb + b) as usize] =
                                        token(first + b, pos + shift, spec.model.vocab);
                                }
                            }
                            be.write_i32(*buf, &data).map_err(e)?;
                        }
                    }
                    _ => break,
                }
                pc[r] += 1;
                progressed = true;
            }
        }
        for r in 0..world {
            let Some(Instr::Collective { kind, group, .. }) = progs[r].instrs.get(pc[r]) else {
                continue;
            };
            let g = plan.group(*group).ok_or("bad group")?;
            let (set, _) = g.set_of(r as u32).ok_or("rank not in its group")?;
            let ready = set.iter().all(|&x| {
                matches!(progs[x as usize].instrs.get(pc[x as usize]),
                    Some(Instr::Collective { kind: k, group: gg, .. }) if k == kind && gg == group)
            });
            if !ready {
                continue;
            }
            let mut inputs = Vec::new();
            for &x in set {
                if let Some(Instr::Collective { input, .. }) =
                    progs[x as usize].instrs.get(pc[x as usize])
                {
                    inputs.push(backends[x as usize].read_f32(*input).map_err(e)?);
                }
            }
            let n = set.len();
            for (i, &x) in set.iter().enumerate() {
                let Some(Instr::Collective { output, .. }) =
                    progs[x as usize].instrs.get(pc[x as usize])
                else {
                    continue;
                };
                let result: Vec<f32> = match kind {
                    CollectiveKind::AllReduce { op } => {
                        let mut acc = inputs[0].clone();
                        for other in &inputs[1..] {
                            for (a, b) in acc.iter_mut().zip(other) {
                                *a = match op {
                                    ReduceOp::Sum => *a + *b,
                                    ReduceOp::Max => a.max(*b),
                                };
                            }
                        }
                        acc
                    }
                    CollectiveKind::AllGather => inputs.concat(),
                    CollectiveKind::ReduceScatter => {
                        let chunk = inputs[0].len() / n;
                        let mut acc = inputs[0][i * chunk..(i + 1) * chunk].to_vec();
                        for other in &inputs[1..] {
                            for (a, b) in acc.iter_mut().zip(&other[i * chunk..(i + 1) * chunk]) {
                                *a += *b;
                            }
                        }
                        acc
                    }
                    CollectiveKind::Broadcast { root } => inputs[*root as usize].clone(),
                };
                backends[x as usize]
                    .write_f32(*output, &result)
                    .map_err(e)?;
            }
            for &x in set {
                pc[x as usize] += 1;
            }
            progressed = true;
        }
        for r in 0..world {
            if pending[r].is_some() {
                continue;
            }
            let me = r as u32;
            let ops: Vec<Pending> = match progs[r].instrs.get(pc[r]) {
                Some(Instr::Send { peer, buffer, tag }) => {
                    vec![(true, plan.peer_rank(me, *peer), *tag, *buffer)]
                }
                Some(Instr::Recv { peer, buffer, tag }) => {
                    vec![(false, plan.peer_rank(me, *peer), *tag, *buffer)]
                }
                Some(Instr::P2p { ops }) => ops
                    .iter()
                    .map(|op| match op {
                        P2pOp::Send { peer, buffer, tag } => {
                            (true, plan.peer_rank(me, *peer), *tag, *buffer)
                        }
                        P2pOp::Recv { peer, buffer, tag } => {
                            (false, plan.peer_rank(me, *peer), *tag, *buffer)
                        }
                    })
                    .collect(),
                _ => continue,
            };
            pending[r] = Some(ops);
        }
        for r in 0..world {
            let Some(mine) = pending[r].clone() else {
                continue;
            };
            for (is_send, peer, tag, buf) in mine {
                if !is_send {
                    continue;
                }
                let p = peer as usize;
                let Some(pos) = pending[p]
                    .as_ref()
                    .and_then(|t| t.iter().position(|o| !o.0 && o.1 == r as u32 && o.2 == tag))
                else {
                    continue;
                };
                let dst = pending[p].as_ref().map(|t| t[pos].3).ok_or("lost recv")?;
                let data = backends[r].read_f32(buf).map_err(e)?;
                backends[p].write_f32(dst, &data).map_err(e)?;
                if let Some(t) = pending[p].as_mut() {
                    t.remove(pos);
                }
                if let Some(t) = pending[r].as_mut() {
                    t.retain(|o| !(o.0 && o.1 == peer && o.2 == tag));
                }
                progressed = true;
            }
        }
        for r in 0..world {
            if pending[r].as_ref().is_some_and(Vec::is_empty) {
                pending[r] = None;
                pc[r] += 1;
                progressed = true;
            }
        }
        if (0..world).all(|r| pc[r] >= progs[r].instrs.len()) {
            return Ok(());
        }
        if !progressed {
            return Err("deadlock".to_string());
        }
    }
}
