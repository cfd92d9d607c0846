//! The stable text form of a [`Plan`] (`parc plan --emit text`, golden tests). Same plan →
//! byte-identical text: everything is printed in arena order, floats with Rust's shortest
//! round-trip formatting.
//!
//! ```text
//! plan world 2, mesh dp 1 × pp 1 × cp 1 × tp 2, micro_batch 2 × 4 microbatches, seq 16, report rank 0
//! param p0 embed.weight [256, 64] normal(0.02) decay
//! group g0 tp over tp: [0 1]
//! program 0 (pp 0 cp 0 tp 0) ranks [0]
//!   buffer b0 embed.weight [128, 64] f32 param
//!   local p0 master b0 state [b5 b6] tp dim 0 part 0/2
//!   loss b7 grad_sumsq b8
//!   0000 alloc b9
//!   0001 load mb 0 [0+16] tokens b9 targets -
//!   0002 fwd Embedding { vocab_start: 0, vocab_local: 128, dim: 64 } (b9 b0) -> (b10) @embed
//!   0003 all_reduce sum g0 b10 -> b10 @embed
//! ```
//! Compute ops print with their `Debug` form (field order fixed by `op.rs`); nodes print by
//! name when the plan is printed with [`PlanText::with_names`].

use super::op::Segment;
use super::program::{
    CollectiveKind, Init, Instr, LocalParam, P2pOp, Peer, Plan, ProgramId, ReduceOp,
};
use super::BufferId;
use crate::spec::NodeId;
use std::fmt::{self, Write};

/// Display adapter: a whole plan, or one rank's program (`--rank`), optionally naming nodes.
pub struct PlanText<'a> {
    plan: &'a Plan,
    only: Option<ProgramId>,
    node_names: Option<&'a [String]>,
    /// The id the first program is printed with (a plan holding one program of a larger one).
    first_id: u32,
}

impl<'a> PlanText<'a> {
    pub fn new(plan: &'a Plan) -> PlanText<'a> {
        PlanText {
            plan,
            only: None,
            node_names: None,
            first_id: 0,
        }
    }
    /// Number the programs from `id`: for a plan that holds one program of a larger plan
    /// (`parc plan --rank R` lowers that rank's alone), printed under its id there.
    pub fn first_id(mut self, id: u32) -> PlanText<'a> {
        self.first_id = id;
        self
    }
    /// Print only this program (header, params and groups still printed).
    pub fn only(mut self, program: ProgramId) -> PlanText<'a> {
        self.only = Some(program);
        self
    }
    /// Print `@name` instead of `@nN` for nodes (index = `NodeId`).
    pub fn with_names(mut self, names: &'a [String]) -> PlanText<'a> {
        self.node_names = Some(names);
        self
    }

    fn node(&self, node: Option<NodeId>) -> String {
        match node {
            None => String::new(),
            Some(n) => match self.node_names.and_then(|names| names.get(n.0 as usize)) {
                Some(name) => format!(" @{name}"),
                None => format!(" @n{}", n.0),
            },
        }
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        PlanText::new(self).fmt(f)
    }
}

fn buffers(ids: &[BufferId]) -> String {
    ids.iter()
        .map(|b| format!("b{}", b.0))
        .collect::<Vec<_>>()
        .join(" ")
}

fn opt_buffer(id: Option<BufferId>) -> String {
    id.map(|b| format!("b{}", b.0))
        .unwrap_or_else(|| "-".to_string())
}

fn segments(segs: &[Segment]) -> String {
    let parts: Vec<String> = segs
        .iter()
        .map(|s| format!("{}+{}", s.start, s.len))
        .collect();
    format!("[{}]", parts.join(" "))
}

fn peer(p: Peer) -> String {
    format!("{} {}", p.axis.name(), p.coord)
}

fn shape(dims: &[u64]) -> String {
    let parts: Vec<String> = dims.iter().map(u64::to_string).collect();
    format!("[{}]", parts.join(", "))
}

fn local_param(l: &LocalParam) -> String {
    let mut s = format!("local p{} master b{}", l.param.0, l.master.0);
    if let Some(w) = l.working {
        let _ = write!(s, " working b{}", w.0);
    }
    let _ = write!(s, " state [{}]", buffers(&l.state));
    if let Some(tp) = l.tp {
        let _ = write!(s, " tp dim {} part {}/{}", tp.dim, tp.index, tp.parts);
        if let Some(sections) = tp.sections {
            let _ = write!(s, " of each of sections {}", shape(&sections));
        }
    }
    if let Some(z) = l.zero {
        let _ = write!(s, " zero {} × {} over g{}", z.parts, z.shard_len, z.group.0);
    }
    s
}

impl fmt::Display for PlanText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plan = self.plan;
        let mesh: Vec<String> = plan
            .mesh
            .axes
            .iter()
            .map(|(a, n)| format!("{} {}", a.name(), n))
            .collect();
        writeln!(
            f,
            "plan world {}, mesh {}, micro_batch {} × {} microbatches, seq {}, report rank {}",
            plan.world,
            mesh.join(" × "),
            plan.micro_batch,
            plan.microbatches,
            plan.seq,
            plan.report_rank
        )?;
        for (i, p) in plan.params.params.iter().enumerate() {
            let init = match p.init {
                Init::Normal { std } => format!("normal({std})"),
                Init::Zeros => "zeros".to_string(),
                Init::Ones => "ones".to_string(),
            };
            let decay = if p.decay { " decay" } else { "" };
            writeln!(f, "param p{i} {} {} {init}{decay}", p.name, shape(&p.shape))?;
        }
        for (i, g) in plan.groups.iter().enumerate() {
            let axes: Vec<&str> = g.axes.iter().map(|a| a.name()).collect();
            let sets: Vec<String> = g
                .sets
                .iter()
                .map(|s| {
                    let r: Vec<String> = s.iter().map(u32::to_string).collect();
                    format!("[{}]", r.join(" "))
                })
                .collect();
            writeln!(
                f,
                "group g{i} {} over {}: {}",
                g.name,
                axes.join("+"),
                sets.join(" ")
            )?;
        }
        for (pi, prog) in plan.programs.iter().enumerate() {
            let id = ProgramId(pi as u32);
            if self.only.is_some_and(|o| o != id) {
                continue;
            }
            let ranks: Vec<String> = plan.ranks_of(id).iter().map(u32::to_string).collect();
            writeln!(
                f,
                "program {} ({}) ranks [{}]",
                pi as u32 + self.first_id,
                prog.role,
                ranks.join(" ")
            )?;
            for (bi, b) in prog.buffers.iter().enumerate() {
                writeln!(
                    f,
                    "  buffer b{bi} {} {} {} {}",
                    b.name,
                    shape(&b.shape),
                    b.dtype.name(),
                    b.kind.name()
                )?;
            }
            for l in &prog.params {
                writeln!(f, "  {}", local_param(l))?;
            }
            writeln!(
                f,
                "  loss {} grad_sumsq {}",
                opt_buffer(prog.loss),
                opt_buffer(prog.grad_sumsq)
            )?;
            for (ii, instr) in prog.instrs.iter().enumerate() {
                writeln!(f, "  {ii:04} {}", self.instr(instr))?;
            }
        }
        Ok(())
    }
}

impl PlanText<'_> {
    fn instr(&self, instr: &Instr) -> String {
        match instr {
            Instr::Compute { .. } => instr
                .as_compute()
                .map(|c| {
                    format!(
                        "{} {:?} ({}) -> ({}){}",
                        c.phase.name(),
                        c.op,
                        buffers(c.inputs),
                        buffers(c.outputs),
                        self.node(c.node)
                    )
                })
                .unwrap_or_default(),
            Instr::Collective {
                kind,
                group,
                input,
                output,
                node,
            } => {
                let kind = match kind {
                    CollectiveKind::AllReduce { op: ReduceOp::Sum } => "all_reduce sum".to_string(),
                    CollectiveKind::AllReduce { op: ReduceOp::Max } => "all_reduce max".to_string(),
                    CollectiveKind::AllGather => "all_gather".to_string(),
                    CollectiveKind::ReduceScatter => "reduce_scatter".to_string(),
                    CollectiveKind::Broadcast { root } => format!("broadcast root {root}"),
                };
                format!(
                    "{kind} g{} b{} -> b{}{}",
                    group.0,
                    input.0,
                    output.0,
                    self.node(*node)
                )
            }
            Instr::Send {
                peer: p,
                buffer,
                tag,
            } => {
                format!("send b{} to {} tag {tag}", buffer.0, peer(*p))
            }
            Instr::Recv {
                peer: p,
                buffer,
                tag,
            } => {
                format!("recv b{} from {} tag {tag}", buffer.0, peer(*p))
            }
            Instr::P2p { ops } => {
                let parts: Vec<String> = ops
                    .iter()
                    .map(|op| match op {
                        P2pOp::Send {
                            peer: p,
                            buffer,
                            tag,
                        } => format!("send b{} to {} tag {tag}", buffer.0, peer(*p)),
                        P2pOp::Recv {
                            peer: p,
                            buffer,
                            tag,
                        } => format!("recv b{} from {} tag {tag}", buffer.0, peer(*p)),
                    })
                    .collect();
                format!("p2p {{ {} }}", parts.join("; "))
            }
            Instr::LoadBatch {
                microbatch,
                positions,
                tokens,
                targets,
            } => format!(
                "load mb {microbatch} {} tokens {} targets {}",
                segments(positions),
                opt_buffer(*tokens),
                opt_buffer(*targets)
            ),
            Instr::Alloc { buffer } => format!("alloc b{}", buffer.0),
            Instr::Free { buffer } => format!("free b{}", buffer.0),
        }
    }
}
