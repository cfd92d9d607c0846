//! Pipeline schedules: the order of forward/backward units on each stage, and when each
//! point-to-point transfer happens.
//!
//! Orders (chunk `c` of `p·v` lives on stage `c mod p`, virtual index `c / p`):
//! - GPipe: every microbatch's forward, then every backward, in microbatch order.
//! - 1F1B: `min(p − s − 1, m)` warm-up forwards on stage `s`, then alternate one forward and one
//!   backward, then the remaining backwards (so stage `s` holds at most `p − s` microbatches).
//! - Interleaved 1F1B (Narayanan et al. 2021, as Megatron-LM): `m·v` units per stage; forward
//!   unit `k` runs chunk `(k mod pv) / p` of microbatch `(k / pv)·p + k mod p`, backward unit `k`
//!   the chunk `v − 1 − (k mod pv) / p` of the same microbatch; warm-up `(p − s − 1)·2 + (v − 1)·p`
//!   forwards (capped at `m·v`), then 1F1B. Needs `m mod p = 0`. 1F1B is the case `v = 1`.
//!
//! Transfers: every unit takes one tick in a global simulation where each stage runs its order
//! and a unit starts once its producer unit has finished. A transfer produced by a unit ending
//! at tick `t` is issued by both stages in one grouped p2p at tick `t` (after the units that end
//! by `t`, before those that start from `t`). Every stage issues its groups in increasing tick
//! order and a group at tick `t` only needs partners' groups at tick `t`, so by induction on `t`
//! no program can deadlock under rendezvous semantics.

use crate::spec::PipelineSchedule;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dir {
    Forward,
    Backward,
}

/// One forward or backward pass of one microbatch through one model chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Unit {
    pub dir: Dir,
    pub microbatch: u32,
    /// Global chunk index (`virtual · p + stage`).
    pub chunk: u32,
}

/// The per-stage unit orders and each unit's start tick.
pub struct Timetable {
    /// `orders[stage]` = units in program order with their start ticks.
    pub orders: Vec<Vec<(Unit, u64)>>,
}

/// Unit order of one stage.
pub fn stage_order(
    schedule: PipelineSchedule,
    stages: u32,
    virtual_stages: u32,
    microbatches: u32,
    stage: u32,
) -> Vec<Unit> {
    let (p, v, m, s) = (stages, virtual_stages, microbatches, stage);
    let mut out = Vec::new();
    match schedule {
        PipelineSchedule::Gpipe => {
            for dir in [Dir::Forward, Dir::Backward] {
                for mb in 0..m {
                    for vi in 0..v {
                        let vi = if dir == Dir::Forward { vi } else { v - 1 - vi };
                        out.push(Unit {
                            dir,
                            microbatch: mb,
                            chunk: vi * p + s,
                        });
                    }
                }
            }
        }
        PipelineSchedule::OneFOneB | PipelineSchedule::Interleaved { .. } => {
            let total = m * v;
            let warmup = if v == 1 {
                (p - s - 1).min(total)
            } else {
                ((p - s - 1) * 2 + (v - 1) * p).min(total)
            };
            let unit = |k: u32, dir: Dir| {
                let group = p * v;
                let vi = (k % group) / p;
                let vi = if dir == Dir::Forward { vi } else { v - 1 - vi };
                Unit {
                    dir,
                    microbatch: (k / group) * p + k % p,
                    chunk: vi * p + s,
                }
            };
            for k in 0..warmup {
                out.push(unit(k, Dir::Forward));
            }
            for i in 0..(total - warmup) {
                out.push(unit(warmup + i, Dir::Forward));
                out.push(unit(i, Dir::Backward));
            }
            for i in (total - warmup)..total {
                out.push(unit(i, Dir::Backward));
            }
        }
    }
    out
}

/// Simulate every stage with unit-length ticks. `None` if the orders deadlock (a unit waits
/// on one that can never run), which a correct schedule never does.
pub fn simulate(orders: Vec<Vec<Unit>>, chunks: u32) -> Option<Timetable> {
    use std::collections::HashMap;
    let stages = orders.len();
    let mut finish: HashMap<Unit, u64> = HashMap::new();
    let mut next = vec![0usize; stages];
    let mut clock = vec![0u64; stages];
    let mut timed: Vec<Vec<(Unit, u64)>> = vec![Vec::new(); stages];
    let total: usize = orders.iter().map(Vec::len).sum();
    let mut done = 0;
    while done < total {
        let mut progressed = false;
        for s in 0..stages {
            while let Some(&u) = orders[s].get(next[s]) {
                let dep = match u.dir {
                    Dir::Forward if u.chunk > 0 => Some(Unit {
                        chunk: u.chunk - 1,
                        ..u
                    }),
                    Dir::Forward => None,
                    Dir::Backward if u.chunk + 1 < chunks => Some(Unit {
                        chunk: u.chunk + 1,
                        ..u
                    }),
                    Dir::Backward => Some(Unit {
                        dir: Dir::Forward,
                        ..u
                    }),
                };
                let ready = match dep {
                    None => 0,
                    Some(d) => match finish.get(&d) {
                        Some(&t) => t,
                        None => break,
                    },
                };
                let start = clock[s].max(ready);
                clock[s] = start + 1;
                finish.insert(u, start + 1);
                timed[s].push((u, start));
                next[s] += 1;
                done += 1;
                progressed = true;
            }
        }
        if !progressed {
            return None;
        }
    }
    Some(Timetable { orders: timed })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_flight_peak(order: &[Unit]) -> u32 {
        let (mut live, mut peak) = (0i64, 0i64);
        for u in order {
            live += if u.dir == Dir::Forward { 1 } else { -1 };
            peak = peak.max(live);
        }
        peak as u32
    }

    #[test]
    fn one_f_one_b_holds_p_minus_s_microbatches() {
        for p in [2u32, 4] {
            for s in 0..p {
                let order = stage_order(PipelineSchedule::OneFOneB, p, 1, 8, s);
                assert_eq!(order.len(), 16);
                assert_eq!(in_flight_peak(&order), p - s);
            }
        }
    }

    #[test]
    fn every_schedule_completes_and_runs_each_unit_once() {
        let cases = [
            (PipelineSchedule::Gpipe, 4, 1, 6),
            (PipelineSchedule::OneFOneB, 4, 1, 6),
            (PipelineSchedule::OneFOneB, 3, 1, 2),
            (PipelineSchedule::Interleaved { virtual_stages: 2 }, 2, 2, 4),
            (PipelineSchedule::Interleaved { virtual_stages: 3 }, 4, 3, 8),
        ];
        for (sched, p, v, m) in cases {
            let orders: Vec<Vec<Unit>> = (0..p).map(|s| stage_order(sched, p, v, m, s)).collect();
            for o in &orders {
                assert_eq!(o.len() as u32, 2 * m * v);
            }
            let t = simulate(orders, p * v).expect("schedule must not deadlock");
            assert_eq!(t.orders.len() as u32, p);
        }
    }

    #[test]
    fn gpipe_holds_all_microbatches() {
        let order = stage_order(PipelineSchedule::Gpipe, 4, 1, 6, 3);
        assert_eq!(in_flight_peak(&order), 6);
    }
}
