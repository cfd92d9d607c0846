//! One group's kernel: its members' fragments (`ops`) emitted in program order over one
//! domain, a read of a buffer an earlier member wrote becoming that member's value (at the
//! rotate-half partner column where a rope reads it so: the value rebuilt with its loads
//! rotated), every other read a load of a kernel input, and a store for every written buffer
//! that is read outside the group. The domain's columns are the gcd of the members' widths.
//!
//! [`build`] refuses ([`Refusal::Cannot`]) a group that one kernel cannot compute: rows that
//! differ, a head that does not divide the domain, a member writing what another read or
//! wrote, more operands than an op holds. A kernel that fails `Kernel::validate` after
//! passing those checks is a bug of this pass ([`Refusal::Bug`]): it is reported, never
//! emitted.
use super::graph;
use super::ops::{self, Env, Fragment};
use crate::ir::op::{RopeAttrs, RopeScaling, Segment};
use crate::ir::operands::MAX_OUTPUTS;
use crate::ir::BufferId;
use crate::kir::{Access, ColMap, Graph, Kernel, Node, NodeId, Store};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The most inputs a generated kernel reads: six, as the op table allowed every op when the
/// emitters and their GPU tests were built (an instruction now holds eight, for quantized FP8
/// GEMMs; wider kernels would need their own measurement first).
pub const MAX_KERNEL_INPUTS: usize = 6;

/// Where a kernel input comes from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Source {
    Buffer(BufferId),
    /// The rotation table of a rope (`Op::RopeTable`), made once per step.
    Table(Arc<TableKey>),
}

/// What distinguishes one rotation table from another.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct TableKey {
    pub theta_bits: u64,
    pub scaling: ScalingKey,
    pub head_dim: u64,
    pub rotary_dim: Option<u64>,
    pub batch: u64,
    pub positions: Vec<Segment>,
}

impl TableKey {
    pub fn of(a: &RopeAttrs) -> TableKey {
        TableKey {
            theta_bits: a.theta.to_bits(),
            scaling: ScalingKey::of(a.scaling),
            head_dim: a.head_dim,
            rotary_dim: a.rotary_dim,
            batch: a.batch,
            positions: a.positions.clone(),
        }
    }

    /// The attributes of the `Op::RopeTable` that makes it (one head: the table serves all).
    pub fn attrs(&self) -> RopeAttrs {
        RopeAttrs {
            batch: self.batch,
            heads: 1,
            head_dim: self.head_dim,
            theta: f64::from_bits(self.theta_bits),
            scaling: self.scaling.scaling(),
            positions: self.positions.clone(),
            rotary_dim: self.rotary_dim,
        }
    }

    /// How a kernel reads the table.
    fn access(&self) -> Access {
        Access::PerPosition {
            batch: self.batch,
            width: self.head_dim.saturating_mul(2),
        }
    }
}

/// A frequency scaling as a table key: its parameters' bits (`RopeScaling` holds floats, which
/// are neither `Eq` nor `Hash`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum ScalingKey {
    None,
    Linear {
        factor: u64,
    },
    Llama3 {
        factor: u64,
        low: u64,
        high: u64,
        original: u64,
    },
}

impl ScalingKey {
    fn of(s: RopeScaling) -> ScalingKey {
        match s {
            RopeScaling::None => ScalingKey::None,
            RopeScaling::Linear { factor } => ScalingKey::Linear {
                factor: factor.to_bits(),
            },
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => ScalingKey::Llama3 {
                factor: factor.to_bits(),
                low: low_freq_factor.to_bits(),
                high: high_freq_factor.to_bits(),
                original: original_max_position,
            },
        }
    }

    fn scaling(self) -> RopeScaling {
        match self {
            ScalingKey::None => RopeScaling::None,
            ScalingKey::Linear { factor } => RopeScaling::Linear {
                factor: f64::from_bits(factor),
            },
            ScalingKey::Llama3 {
                factor,
                low,
                high,
                original,
            } => RopeScaling::Llama3 {
                factor: f64::from_bits(factor),
                low_freq_factor: f64::from_bits(low),
                high_freq_factor: f64::from_bits(high),
                original_max_position: original,
            },
        }
    }
}

/// Why a group has no kernel.
#[derive(Debug)]
pub(super) enum Refusal {
    /// One kernel cannot compute these members (the group stays as it is); why, for tests and
    /// debugging.
    #[allow(dead_code)]
    Cannot(String),
    /// The pass built a kernel that does not validate: a compiler bug.
    Bug(String),
}

/// A group's kernel and what it binds.
#[derive(Clone, Debug)]
pub(super) struct Built {
    /// Shared by every group of the same shape.
    pub kernel: Arc<Kernel>,
    /// What it computes, for people: the ops it replaces, each once (`split_columns+rope`).
    pub name: Arc<str>,
    pub inputs: Vec<Source>,
    pub outputs: Vec<BufferId>,
    /// Buffers only the members use: no store, no allocation.
    pub internal: Vec<BufferId>,
    pub rows: u64,
    /// Whether a member's attributes fix the rows.
    pub fixes_rows: bool,
}

/// The kernel of `members` (in program order); `internal(b)` says whether every use of `b`
/// is a member's.
pub(super) fn build(
    members: &[&Fragment],
    internal: &dyn Fn(BufferId) -> bool,
) -> Result<Built, Refusal> {
    let cannot = Refusal::Cannot;
    let rows = members.first().map(|m| m.rows).unwrap_or(0);
    if members.iter().any(|m| m.rows != rows) {
        return Err(cannot("the members' rows differ".into()));
    }
    let cols = members
        .iter()
        .flat_map(|m| m.granules.iter().copied())
        .fold(0, gcd);
    if cols == 0 {
        return Err(cannot("no columns".into()));
    }
    if let Some(p) = members
        .iter()
        .flat_map(|m| m.periods.iter())
        .find(|p| **p == 0 || !cols.is_multiple_of(**p))
    {
        return Err(cannot(format!(
            "a head of {p} does not divide {cols} columns"
        )));
    }
    let mut state = State::new(cols);
    let mut g = Graph::new();
    for (i, m) in members.iter().enumerate() {
        let mut env = MemberEnv {
            st: &mut state,
            member: i,
            fragment: m,
        };
        ops::emit(m, cols, &mut g, &mut env).map_err(cannot)?;
    }
    let fixes_rows = members.iter().any(|m| m.fixes_rows);
    state.finish(g, (rows, fixes_rows), &name(members), internal)
}

/// The names of the ops `members` are, each once, joined by `+`.
fn name(members: &[&Fragment]) -> String {
    let mut names: Vec<&str> = Vec::new();
    for m in members {
        let name = match m.op {
            crate::ir::op::Op::Fused(a) => a.name.as_str(),
            other => other.opcode().name(),
        };
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names.join("+")
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// What the members built so far.
struct State {
    cols: u64,
    inputs: Vec<(Source, Access)>,
    /// The value each member stored, by (buffer, column offset).
    values: HashMap<(BufferId, u64), NodeId>,
    /// Which member wrote each buffer.
    writer: HashMap<BufferId, usize>,
    /// Buffers written, with their widths, in order of first write.
    written: Vec<(BufferId, u64)>,
    /// Buffers loaded from outside the group.
    loaded: HashSet<BufferId>,
    /// Values already rebuilt at their rotate-half partner, by (value, rotation).
    rotated: HashMap<(NodeId, ColMap), NodeId>,
}

impl State {
    fn new(cols: u64) -> State {
        State {
            cols,
            inputs: Vec::new(),
            values: HashMap::new(),
            writer: HashMap::new(),
            written: Vec::new(),
            loaded: HashSet::new(),
            rotated: HashMap::new(),
        }
    }

    /// The index of the kernel input `source`, added if new.
    fn input(&mut self, source: Source, access: Access) -> Result<u32, String> {
        match self.inputs.iter().position(|(s, _)| *s == source) {
            Some(i) if self.inputs[i].1 == access => Ok(i as u32),
            Some(_) => Err(format!("{source:?} is read with two shapes")),
            None => {
                self.inputs.push((source, access));
                Ok(self.inputs.len() as u32 - 1)
            }
        }
    }

    /// `value` evaluated at the rotate-half partner column of `rotation` (a `ColMap`
    /// rotation: `RotateHalf` or `RotatePart`).
    fn rotate(&mut self, g: &mut Graph, value: NodeId, rotation: ColMap) -> Result<NodeId, String> {
        if let Some(&r) = self.rotated.get(&(value, rotation)) {
            return Ok(r);
        }
        let nodes = graph::reachable(g, &[value]);
        let inputs = &self.inputs;
        let map = graph::rebuild(&nodes, g, &mut |g, node| match node {
            Node::Load {
                input,
                col_offset,
                map,
            } if matches!(inputs.get(input as usize), Some((_, Access::Elem { .. }))) => {
                // A rotation is its own inverse: the partner's partner is the column itself.
                let map = match map {
                    ColMap::Id => rotation,
                    same if same == rotation => ColMap::Id,
                    other => return Err(format!("cannot rotate a load through {other:?}")),
                };
                Ok(g.load_mapped(input, col_offset, map))
            }
            other => Err(format!("cannot rotate {other:?}")),
        })?;
        let r = map
            .get(&value)
            .copied()
            .ok_or_else(|| "a rotated value was not copied".to_string())?;
        self.rotated.insert((value, rotation), r);
        Ok(r)
    }

    /// The kernel: a store per block of every written buffer that is not internal, the graph
    /// pruned to what the stores use, the inputs to what it loads.
    fn finish(
        self,
        g: Graph,
        (rows, fixes_rows): (u64, bool),
        name: &str,
        internal: &dyn Fn(BufferId) -> bool,
    ) -> Result<Built, Refusal> {
        let (kept, internal): (Vec<_>, Vec<_>) =
            self.written.iter().partition(|(b, _)| !internal(*b));
        let mut stores = Vec::new();
        for (o, (b, width)) in kept.iter().enumerate() {
            for block in (0..width / self.cols).map(|k| k * self.cols) {
                let value = *self.values.get(&(*b, block)).ok_or_else(|| {
                    Refusal::Bug(format!("buffer {} has no value at column {block}", b.0))
                })?;
                stores.push(Store {
                    output: o as u32,
                    col_offset: block,
                    value,
                });
            }
        }
        let (graph, stores, used) = prune(&g, stores).map_err(Refusal::Bug)?;
        let inputs: Vec<(Source, Access)> = used
            .iter()
            .filter_map(|&i| self.inputs.get(i as usize).cloned())
            .collect();
        if inputs.len() > MAX_KERNEL_INPUTS || kept.len() > MAX_OUTPUTS {
            return Err(Refusal::Cannot(format!(
                "{} inputs and {} outputs are more than a generated kernel takes",
                inputs.len(),
                kept.len()
            )));
        }
        let kernel = Kernel {
            cols: self.cols,
            inputs: inputs.iter().map(|(_, a)| *a).collect(),
            outputs: kept
                .iter()
                .map(|(_, w)| Access::Elem { width: *w })
                .collect(),
            graph,
            stores,
        };
        kernel
            .validate()
            .map_err(|e| Refusal::Bug(format!("the fused kernel `{kernel}` is invalid: {e}")))?;
        Ok(Built {
            kernel: Arc::new(kernel),
            name: name.into(),
            inputs: inputs.into_iter().map(|(s, _)| s).collect(),
            outputs: kept.iter().map(|(b, _)| *b).collect(),
            internal: internal.iter().map(|(b, _)| *b).collect(),
            rows,
            fixes_rows,
        })
    }
}

/// The graph of only the nodes `stores` use, its loads renumbered to the inputs they use; the
/// stores on it and the old index of each input kept, in order.
fn prune(g: &Graph, stores: Vec<Store>) -> Result<(Graph, Vec<Store>, Vec<u32>), String> {
    let roots: Vec<NodeId> = stores.iter().map(|s| s.value).collect();
    let nodes = graph::reachable(g, &roots);
    let mut used: Vec<u32> = nodes
        .iter()
        .filter_map(|(_, n)| match n {
            Node::Load { input, .. } => Some(*input),
            _ => None,
        })
        .collect();
    used.sort_unstable();
    used.dedup();
    let mut out = Graph::new();
    let map = graph::rebuild(&nodes, &mut out, &mut |out, node| match node {
        Node::Load {
            input,
            col_offset,
            map,
        } => {
            let i = used
                .binary_search(&input)
                .map_err(|_| "a load lost its input")?;
            Ok(out.load_mapped(i as u32, col_offset, map))
        }
        other => Err(format!("a kernel holds {other:?}")),
    })?;
    let stores = stores
        .into_iter()
        .map(|s| {
            let value = map
                .get(&s.value)
                .copied()
                .ok_or("a stored value was not copied")?;
            Ok(Store { value, ..s })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok((out, stores, used))
}

/// One member's view of the group while its fragment is emitted.
struct MemberEnv<'s, 'f> {
    st: &'s mut State,
    member: usize,
    fragment: &'s Fragment<'f>,
}

impl Env for MemberEnv<'_, '_> {
    fn read(
        &mut self,
        g: &mut Graph,
        input: usize,
        offset: u64,
        map: ColMap,
    ) -> Result<NodeId, String> {
        let (b, access) = match (
            self.fragment.reads.get(input),
            self.fragment.inputs.get(input),
        ) {
            (Some(b), Some(a)) => (*b, *a),
            _ => return Err(format!("the op has no input {input}")),
        };
        if !self.st.writer.contains_key(&b) {
            self.st.loaded.insert(b);
            let i = self.st.input(Source::Buffer(b), access)?;
            return Ok(g.load_mapped(i, offset, map));
        }
        let value = self
            .st
            .values
            .get(&(b, offset))
            .copied()
            .ok_or_else(|| format!("buffer {} has no value at column {offset}", b.0))?;
        match map {
            ColMap::Id => Ok(value),
            ColMap::RotateHalf(_) | ColMap::RotatePart { .. } => self.st.rotate(g, value, map),
            other => Err(format!("cannot read a fused value through {other:?}")),
        }
    }

    fn table(&mut self, g: &mut Graph, attrs: &RopeAttrs, offset: u64) -> Result<NodeId, String> {
        let key = TableKey::of(attrs);
        let access = key.access();
        let i = self.st.input(Source::Table(Arc::new(key)), access)?;
        Ok(g.load_mapped(i, offset, ColMap::Periodic(attrs.head_dim)))
    }

    fn store(&mut self, output: usize, offset: u64, value: NodeId) -> Result<(), String> {
        let (b, width) = match (
            self.fragment.writes.get(output),
            self.fragment.outputs.get(output),
        ) {
            (Some(b), Some(w)) => (*b, *w),
            _ => return Err(format!("the op has no output {output}")),
        };
        if self.st.loaded.contains(&b) {
            return Err(format!("buffer {} is written after a member read it", b.0));
        }
        match self.st.writer.get(&b) {
            Some(&m) if m != self.member => {
                return Err(format!("buffer {} is written by two members", b.0))
            }
            Some(_) => {}
            None => {
                self.st.writer.insert(b, self.member);
                self.st.written.push((b, width));
            }
        }
        if self.st.values.insert((b, offset), value).is_some() {
            return Err(format!(
                "column {offset} of buffer {} is written twice",
                b.0
            ));
        }
        Ok(())
    }
}
