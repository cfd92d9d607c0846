//! The kernel function `parc_fused`: its parameters, the point loops (a grid-stride loop, or
//! one block per row for row sums), the evaluation of the graph at a point, loads and stores
//! with their index maps (`ColMap`, `Access`) and storage types, and the row-sum reduction.
use super::plan::{reachable, Plan};
use super::{llvm_error, Ir, Llvm};
use crate::error::Result;
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::intrinsics::Intrinsic;
use inkwell::module::Linkage;
use inkwell::types::BasicType;
use inkwell::values::{FloatValue, FunctionValue, GlobalValue, IntValue, PointerValue};
use inkwell::{AddressSpace, IntPredicate};
use parc_compiler::kir::{Access, ColMap, Kernel, Node, NodeId, Store, REDUCE_LANES};

/// LLVM's calling convention number of a PTX kernel entry (`CallingConv::PTX_Kernel`).
const PTX_KERNEL: u32 = 71;
const GLOBAL: u16 = 1;
const SHARED: u16 = 3;

/// Builds `parc_fused` for `kernel` into the module; `bf16[i]`: operand `i` (inputs then
/// outputs) is stored as bf16.
pub fn kernel(ir: &Ir<'_, '_>, kernel: &Kernel, bf16: &[bool]) -> Result<()> {
    let e = Emit::declare(ir, kernel, bf16)?;
    let plan = Plan::of(kernel);
    if plan.has_row_sums() {
        e.row_blocks(&plan)?;
    } else {
        e.grid_stride()?;
    }
    ir.b.build_return(None).llvm()?;
    Ok(())
}

struct Operand<'ctx> {
    ptr: PointerValue<'ctx>,
    access: Access,
    bf16: bool,
}

/// A point of the domain: row and column, i64.
#[derive(Clone, Copy)]
struct Point<'ctx> {
    r: IntValue<'ctx>,
    c: IntValue<'ctx>,
}

/// A node's value: a number, or a comparison's i1.
#[derive(Clone, Copy)]
enum Val<'ctx> {
    Num(FloatValue<'ctx>),
    Bool(IntValue<'ctx>),
}

struct Emit<'a, 'ctx> {
    ir: &'a Ir<'a, 'ctx>,
    kernel: &'a Kernel,
    function: FunctionValue<'ctx>,
    inputs: Vec<Operand<'ctx>>,
    outputs: Vec<Operand<'ctx>>,
    rows: IntValue<'ctx>,
}

impl<'a, 'ctx> Emit<'a, 'ctx> {
    /// The function with the ABI's parameters, positioned at its entry block.
    fn declare(ir: &'a Ir<'a, 'ctx>, kernel: &'a Kernel, bf16: &[bool]) -> Result<Self> {
        let ctx = ir.ctx;
        let ptr = ctx.ptr_type(AddressSpace::from(GLOBAL));
        let operands = kernel.inputs.len() + kernel.outputs.len();
        let mut params: Vec<_> = vec![ptr.into(); operands];
        params.push(ctx.i64_type().into());
        let function =
            ir.module
                .add_function("parc_fused", ctx.void_type().fn_type(&params, false), None);
        function.set_call_conventions(PTX_KERNEL);
        // The operands are distinct buffers (an op's output that is also an input is copied
        // first), as the NVRTC kernel's `__restrict__` says; inputs are only read.
        for i in 0..operands {
            attribute(ir, function, i, "noalias");
            if i < kernel.inputs.len() {
                attribute(ir, function, i, "readonly");
            }
        }
        ir.b.position_at_end(ctx.append_basic_block(function, "entry"));
        let param = |i: usize| {
            function
                .get_nth_param(i as u32)
                .ok_or_else(|| llvm_error(format!("parc_fused has no parameter {i}")))
        };
        let accesses = kernel.inputs.iter().chain(&kernel.outputs);
        let mut all = Vec::with_capacity(operands);
        for (i, access) in accesses.enumerate() {
            all.push(Operand {
                ptr: param(i)?.into_pointer_value(),
                access: *access,
                bf16: bf16.get(i).copied().unwrap_or(false),
            });
        }
        let outputs = all.split_off(kernel.inputs.len());
        Ok(Emit {
            ir,
            kernel,
            function,
            inputs: all,
            outputs,
            rows: param(operands)?.into_int_value(),
        })
    }

    /// Every point `i = r * cols + c` in a grid-stride loop (no row sums).
    fn grid_stride(&self) -> Result<()> {
        let b = self.ir.b;
        let (block, threads) = (self.sreg("ctaid.x")?, self.sreg("ntid.x")?);
        let first = b.build_int_add(
            b.build_int_nuw_mul(block, threads, "base").llvm()?,
            self.sreg("tid.x")?,
            "first",
        );
        let stride = b
            .build_int_nuw_mul(self.sreg("nctaid.x")?, threads, "stride")
            .llvm()?;
        let cols = self.ir.i64(self.kernel.cols);
        let total = b.build_int_nuw_mul(self.rows, cols, "total").llvm()?;
        self.counted_loop("point", first.llvm()?, total, stride, &[], |i, _| {
            let r = b.build_int_unsigned_div(i, cols, "r").llvm()?;
            let c = b.build_int_unsigned_rem(i, cols, "c").llvm()?;
            self.stores(Point { r, c }, &[], Some(c))?;
            Ok(vec![])
        })?;
        Ok(())
    }

    /// One block of `REDUCE_LANES` threads per row, striding over rows by the grid: the passes
    /// of row sums, then the stores.
    fn row_blocks(&self, plan: &Plan) -> Result<()> {
        let b = self.ir.b;
        let widest = plan.passes.iter().map(Vec::len).max().unwrap_or(0);
        let shared = self.shared(widest)?;
        let lane = self.sreg("tid.x")?;
        let (first, step) = (self.sreg("ctaid.x")?, self.sreg("nctaid.x")?);
        self.counted_loop("row", first, self.rows, step, &[], |r, _| {
            let mut known: Vec<(NodeId, FloatValue<'ctx>)> = Vec::new();
            for pass in &plan.passes {
                let totals = self.reduce(pass, &known, shared, lane, r)?;
                known.extend(pass.iter().copied().zip(totals));
            }
            let lanes = self.ir.i64(REDUCE_LANES as u64);
            let cols = self.ir.i64(self.kernel.cols);
            let elem: Vec<Store> = self.stores_to(|a| !matches!(a, Access::Row));
            if !elem.is_empty() {
                self.counted_loop("col", lane, cols, lanes, &[], |c, _| {
                    self.store_all(&elem, Point { r, c }, &known)?;
                    Ok(vec![])
                })?;
            }
            let row: Vec<Store> = self.stores_to(|a| matches!(a, Access::Row));
            if !row.is_empty() {
                let lane0 = b
                    .build_int_compare(IntPredicate::EQ, lane, self.ir.i64(0), "lane0")
                    .llvm()?;
                self.when(lane0, "row_store", || {
                    let c = self.ir.i64(0);
                    self.store_all(&row, Point { r, c }, &known)
                })?;
            }
            Ok(vec![])
        })?;
        Ok(())
    }

    /// One pass over row `r`: each lane sums its columns of every sum in `pass` (from 0.0, in
    /// column order), then the lanes combine in the halving tree; every lane gets the totals.
    fn reduce(
        &self,
        pass: &[NodeId],
        known: &[(NodeId, FloatValue<'ctx>)],
        shared: GlobalValue<'ctx>,
        lane: IntValue<'ctx>,
        r: IntValue<'ctx>,
    ) -> Result<Vec<FloatValue<'ctx>>> {
        let b = self.ir.b;
        let terms = pass
            .iter()
            .map(|&id| match self.kernel.graph.node(id) {
                Node::RowSum(term) => Ok(term),
                other => Err(llvm_error(format!(
                    "node {} ({other:?}) is no row sum",
                    id.0
                ))),
            })
            .collect::<Result<Vec<NodeId>>>()?;
        let zeros = vec![self.ir.f32(0.0)?; terms.len()];
        let (lanes, cols) = (
            self.ir.i64(REDUCE_LANES as u64),
            self.ir.i64(self.kernel.cols),
        );
        let partials = self.counted_loop("sum", lane, cols, lanes, &zeros, |c, acc| {
            let values = self.eval(&terms, known, Point { r, c })?;
            terms
                .iter()
                .zip(acc)
                .map(|(t, &a)| b.build_float_add(a, num(&values, *t)?, "partial").llvm())
                .collect()
        })?;
        let slot = |k: usize, at: IntValue<'ctx>| self.shared_slot(shared, k, at);
        for (k, &p) in partials.iter().enumerate() {
            b.build_store(slot(k, lane)?, p).llvm()?;
        }
        self.barrier()?;
        let mut s = REDUCE_LANES / 2;
        while s >= 1 {
            let active = b
                .build_int_compare(IntPredicate::ULT, lane, self.ir.i64(s as u64), "active")
                .llvm()?;
            self.when(active, "tree", || {
                let partner = b
                    .build_int_add(lane, self.ir.i64(s as u64), "partner")
                    .llvm()?;
                for k in 0..terms.len() {
                    let mine = self.load_f32(slot(k, lane)?)?;
                    let theirs = self.load_f32(slot(k, partner)?)?;
                    let sum = b.build_float_add(mine, theirs, "tree").llvm()?;
                    b.build_store(slot(k, lane)?, sum).llvm()?;
                }
                Ok(())
            })?;
            self.barrier()?;
            s /= 2;
        }
        let totals = (0..terms.len())
            .map(|k| self.load_f32(slot(k, self.ir.i64(0))?))
            .collect::<Result<Vec<_>>>()?;
        self.barrier()?;
        Ok(totals)
    }

    /// Every store of the kernel at `p`; the `Row` outputs' only where `col0` is column 0.
    fn stores(
        &self,
        p: Point<'ctx>,
        known: &[(NodeId, FloatValue<'ctx>)],
        col0: Option<IntValue<'ctx>>,
    ) -> Result<()> {
        let elem = self.stores_to(|a| !matches!(a, Access::Row));
        self.store_all(&elem, p, known)?;
        let row = self.stores_to(|a| matches!(a, Access::Row));
        if let (Some(c), false) = (col0, row.is_empty()) {
            let first = self
                .ir
                .b
                .build_int_compare(IntPredicate::EQ, c, self.ir.i64(0), "col0")
                .llvm()?;
            self.when(first, "row_store", || self.store_all(&row, p, known))?;
        }
        Ok(())
    }

    /// The kernel's stores to outputs whose access satisfies `which`.
    fn stores_to(&self, which: impl Fn(&Access) -> bool) -> Vec<Store> {
        let outputs = &self.kernel.outputs;
        self.kernel
            .stores
            .iter()
            .filter(|s| outputs.get(s.output as usize).is_some_and(&which))
            .copied()
            .collect()
    }

    fn store_all(
        &self,
        stores: &[Store],
        p: Point<'ctx>,
        known: &[(NodeId, FloatValue<'ctx>)],
    ) -> Result<()> {
        let roots: Vec<NodeId> = stores.iter().map(|s| s.value).collect();
        let values = self.eval(&roots, known, p)?;
        for s in stores {
            self.store(s, num(&values, s.value)?, p)?;
        }
        Ok(())
    }

    /// The values of `roots` and the nodes they need at `p` (indexed by node id), with the
    /// `known` nodes' values given.
    fn eval(
        &self,
        roots: &[NodeId],
        known: &[(NodeId, FloatValue<'ctx>)],
        p: Point<'ctx>,
    ) -> Result<Vec<Option<Val<'ctx>>>> {
        let g = &self.kernel.graph;
        let known_ids: Vec<NodeId> = known.iter().map(|k| k.0).collect();
        let needed = reachable(self.kernel, roots, &known_ids);
        let mut values: Vec<Option<Val<'ctx>>> = vec![None; g.len()];
        for &(id, v) in known {
            values[id.index()] = Some(Val::Num(v));
        }
        for (i, node) in g.nodes().iter().enumerate() {
            if needed[i] && values[i].is_none() {
                values[i] = Some(self.node(i, node, &values, p)?);
            }
        }
        Ok(values)
    }

    fn node(
        &self,
        i: usize,
        node: &Node,
        values: &[Option<Val<'ctx>>],
        p: Point<'ctx>,
    ) -> Result<Val<'ctx>> {
        let ir = self.ir;
        let n = |id: NodeId| num(values, id);
        Ok(match *node {
            Node::Load {
                input,
                col_offset,
                map,
            } => Val::Num(self.load(input, col_offset, map, p)?),
            Node::Const(bits) => Val::Num(ir.f32_bits(bits)?),
            Node::Un(op, a) => Val::Num(ir.un(op, n(a)?)?),
            Node::Bin(op, a, b) => Val::Num(ir.bin(op, n(a)?, n(b)?)?),
            Node::Cmp(op, a, b) => Val::Bool(ir.cmp(op, n(a)?, n(b)?)?),
            Node::Fma(a, b, c) => Val::Num(ir.fma(n(a)?, n(b)?, n(c)?)?),
            Node::Select(c, a, b) => {
                let cond = match values.get(c.index()).copied().flatten() {
                    Some(Val::Bool(cond)) => cond,
                    _ => return Err(llvm_error(format!("node {i}: select without a comparison"))),
                };
                let v = ir.b.build_select(cond, n(a)?, n(b)?, "select").llvm()?;
                Val::Num(v.into_float_value())
            }
            Node::Param(_) | Node::RowSum(_) => {
                return Err(llvm_error(format!(
                    "node {i} ({node:?}) has no value at a point (a parameter, or a row sum \
                     outside its pass)"
                )))
            }
        })
    }

    /// Input `input` at `p`, column `offset + map(c)` (see `Access`).
    fn load(
        &self,
        input: u32,
        offset: u64,
        map: ColMap,
        p: Point<'ctx>,
    ) -> Result<FloatValue<'ctx>> {
        let b = self.ir.b;
        let operand = self
            .inputs
            .get(input as usize)
            .ok_or_else(|| llvm_error(format!("a load of input {input}, which does not exist")))?;
        let index = match operand.access {
            Access::Elem { width } => {
                let row = b.build_int_nuw_mul(p.r, self.ir.i64(width), "row").llvm()?;
                b.build_int_add(row, self.column(map, offset, p.c)?, "at")
                    .llvm()?
            }
            Access::Row => p.r,
            Access::Col => p.c,
            Access::PerPosition { batch, width } => {
                let pos = b
                    .build_int_unsigned_div(p.r, self.ir.i64(batch.max(1)), "pos")
                    .llvm()?;
                let row = b.build_int_nuw_mul(pos, self.ir.i64(width), "row").llvm()?;
                b.build_int_add(row, self.column(map, offset, p.c)?, "at")
                    .llvm()?
            }
        };
        if operand.bf16 {
            let h = self.gep(self.ir.ctx.i16_type(), operand.ptr, index)?;
            let h = b.build_load(self.ir.ctx.i16_type(), h, "h").llvm()?;
            self.ir.widen_bf16(h.into_int_value())
        } else {
            self.load_f32(self.gep(self.ir.ctx.f32_type(), operand.ptr, index)?)
        }
    }

    /// Column `c`'s rotate-half partner in heads of `head` columns whose first `rot` turn:
    /// `c ± rot/2` in the turned columns' halves, `c` past them (`ColMap::apply`; a whole
    /// head's rotation, `rot = head`, needs no third case).
    fn partner(&self, c: IntValue<'ctx>, head: u64, rot: u64) -> Result<IntValue<'ctx>> {
        let b = self.ir.b;
        let half = self.ir.i64(rot / 2);
        let within = b
            .build_int_unsigned_rem(c, self.ir.i64(head.max(1)), "within")
            .llvm()?;
        let first = b
            .build_int_compare(IntPredicate::ULT, within, half, "first")
            .llvm()?;
        let up = b.build_int_add(c, half, "up").llvm()?;
        let down = b.build_int_sub(c, half, "down").llvm()?;
        let second = if rot == head {
            down
        } else {
            let turned = b
                .build_int_compare(IntPredicate::ULT, within, self.ir.i64(rot), "turned")
                .llvm()?;
            b.build_select(turned, down, c, "second")
                .llvm()?
                .into_int_value()
        };
        Ok(b.build_select(first, up, second, "rotated")
            .llvm()?
            .into_int_value())
    }

    /// The column `offset + map(c)` (`ColMap::apply`).
    fn column(&self, map: ColMap, offset: u64, c: IntValue<'ctx>) -> Result<IntValue<'ctx>> {
        let b = self.ir.b;
        let mapped = match map {
            ColMap::Id => c,
            ColMap::Periodic(period) => b
                .build_int_unsigned_rem(c, self.ir.i64(period.max(1)), "periodic")
                .llvm()?,
            ColMap::RotateHalf(_) | ColMap::RotatePart { .. } => {
                let (head, rot) = map.rotated().unwrap_or_default();
                self.partner(c, head, rot)?
            }
        };
        b.build_int_add(mapped, self.ir.i64(offset), "col").llvm()
    }

    /// `value` stored to its output at `p` (an `Elem` output's column `offset + c`, a `Row`
    /// output's row), rounded to bf16 where the output is bf16.
    fn store(&self, s: &Store, value: FloatValue<'ctx>, p: Point<'ctx>) -> Result<()> {
        let b = self.ir.b;
        let operand = self.outputs.get(s.output as usize).ok_or_else(|| {
            llvm_error(format!(
                "a store to output {}, which does not exist",
                s.output
            ))
        })?;
        let index = match operand.access {
            Access::Elem { width } => {
                let row = b.build_int_nuw_mul(p.r, self.ir.i64(width), "row").llvm()?;
                let col = b
                    .build_int_add(p.c, self.ir.i64(s.col_offset), "col")
                    .llvm()?;
                b.build_int_add(row, col, "at").llvm()?
            }
            Access::Row => p.r,
            other => {
                return Err(llvm_error(format!(
                    "output {} is {other:?}: kernels write rows",
                    s.output
                )))
            }
        };
        if operand.bf16 {
            let h = self.ir.round_bf16(value)?;
            b.build_store(self.gep(self.ir.ctx.i16_type(), operand.ptr, index)?, h)
                .llvm()?;
        } else {
            b.build_store(self.gep(self.ir.ctx.f32_type(), operand.ptr, index)?, value)
                .llvm()?;
        }
        Ok(())
    }

    fn gep(
        &self,
        ty: impl BasicType<'ctx>,
        ptr: PointerValue<'ctx>,
        index: IntValue<'ctx>,
    ) -> Result<PointerValue<'ctx>> {
        // SAFETY: builds an address; every index is inside its operand for the rows the
        // launcher passes (the binding checks the buffers against the kernel's shapes).
        unsafe { self.ir.b.build_in_bounds_gep(ty, ptr, &[index], "p") }.llvm()
    }

    fn load_f32(&self, ptr: PointerValue<'ctx>) -> Result<FloatValue<'ctx>> {
        let v = self
            .ir
            .b
            .build_load(self.ir.ctx.f32_type(), ptr, "x")
            .llvm()?;
        Ok(v.into_float_value())
    }

    /// The block's shared scratch: `sums` rows of `REDUCE_LANES` f32.
    fn shared(&self, sums: usize) -> Result<GlobalValue<'ctx>> {
        let ty = self
            .ir
            .ctx
            .f32_type()
            .array_type((sums.max(1) * REDUCE_LANES) as u32);
        let g = self
            .ir
            .module
            .add_global(ty, Some(AddressSpace::from(SHARED)), "parc_partials");
        g.set_linkage(Linkage::Internal);
        g.set_initializer(&ty.get_undef());
        g.set_alignment(16);
        Ok(g)
    }

    /// Sum `k`'s slot for lane `at` in the shared scratch.
    fn shared_slot(
        &self,
        shared: GlobalValue<'ctx>,
        k: usize,
        at: IntValue<'ctx>,
    ) -> Result<PointerValue<'ctx>> {
        let base = self.ir.i64((k * REDUCE_LANES) as u64);
        let index = self.ir.b.build_int_add(base, at, "slot").llvm()?;
        self.gep(self.ir.ctx.f32_type(), shared.as_pointer_value(), index)
    }

    /// `llvm.nvvm.read.ptx.sreg.<name>`, widened to i64.
    fn sreg(&self, name: &str) -> Result<IntValue<'ctx>> {
        let full = format!("llvm.nvvm.read.ptx.sreg.{name}");
        let f = Intrinsic::find(&full)
            .and_then(|i| i.get_declaration(self.ir.module, &[]))
            .ok_or_else(|| llvm_error(format!("LLVM 19 has no intrinsic {full}")))?;
        let v = self.ir.call(f, &[])?.into_int_value();
        self.ir
            .b
            .build_int_z_extend(v, self.ir.ctx.i64_type(), name)
            .llvm()
    }

    fn barrier(&self) -> Result<()> {
        let f = Intrinsic::find("llvm.nvvm.barrier0")
            .and_then(|i| i.get_declaration(self.ir.module, &[]))
            .ok_or_else(|| llvm_error("LLVM 19 has no intrinsic llvm.nvvm.barrier0"))?;
        self.ir.b.build_call(f, &[], "").llvm()?;
        Ok(())
    }

    /// `body` under `cond`, then continues after it.
    fn when(
        &self,
        cond: IntValue<'ctx>,
        name: &str,
        body: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let (ctx, b) = (self.ir.ctx, self.ir.b);
        let then = ctx.append_basic_block(self.function, name);
        let join = ctx.append_basic_block(self.function, "join");
        b.build_conditional_branch(cond, then, join).llvm()?;
        b.position_at_end(then);
        body()?;
        b.build_unconditional_branch(join).llvm()?;
        b.position_at_end(join);
        Ok(())
    }

    /// `for (i = start; i < end; i += step)` carrying f32 values (`body` gets `i` and the
    /// carried values and returns their next values); the carried values after the loop.
    fn counted_loop(
        &self,
        name: &str,
        start: IntValue<'ctx>,
        end: IntValue<'ctx>,
        step: IntValue<'ctx>,
        init: &[FloatValue<'ctx>],
        body: impl FnOnce(IntValue<'ctx>, &[FloatValue<'ctx>]) -> Result<Vec<FloatValue<'ctx>>>,
    ) -> Result<Vec<FloatValue<'ctx>>> {
        let (ctx, b) = (self.ir.ctx, self.ir.b);
        let pre = b
            .get_insert_block()
            .ok_or_else(|| llvm_error("the builder has no block"))?;
        let header = ctx.append_basic_block(self.function, name);
        let inside = ctx.append_basic_block(self.function, &format!("{name}_body"));
        let exit = ctx.append_basic_block(self.function, &format!("{name}_end"));
        b.build_unconditional_branch(header).llvm()?;
        b.position_at_end(header);
        let i = b.build_phi(ctx.i64_type(), name).llvm()?;
        i.add_incoming(&[(&start, pre)]);
        let mut carried = Vec::with_capacity(init.len());
        for v in init {
            let phi = b.build_phi(ctx.f32_type(), "carried").llvm()?;
            phi.add_incoming(&[(v, pre)]);
            carried.push(phi);
        }
        let index = i.as_basic_value().into_int_value();
        let values: Vec<FloatValue<'ctx>> = carried
            .iter()
            .map(|phi| phi.as_basic_value().into_float_value())
            .collect();
        let go = b
            .build_int_compare(IntPredicate::SLT, index, end, "more")
            .llvm()?;
        b.build_conditional_branch(go, inside, exit).llvm()?;
        b.position_at_end(inside);
        let next = body(index, &values)?;
        let latch = b
            .get_insert_block()
            .ok_or_else(|| llvm_error("the builder has no block"))?;
        let following = b.build_int_add(index, step, "next").llvm()?;
        b.build_unconditional_branch(header).llvm()?;
        i.add_incoming(&[(&following, latch)]);
        for (phi, v) in carried.iter().zip(&next) {
            phi.add_incoming(&[(v, latch)]);
        }
        b.position_at_end(exit);
        Ok(values)
    }
}

/// The attribute `name` on parameter `i`.
fn attribute(ir: &Ir<'_, '_>, function: FunctionValue<'_>, i: usize, name: &str) {
    let kind = Attribute::get_named_enum_kind_id(name);
    function.add_attribute(
        AttributeLoc::Param(i as u32),
        ir.ctx.create_enum_attribute(kind, 0),
    );
}

/// A node's number from an evaluation.
fn num<'ctx>(values: &[Option<Val<'ctx>>], id: NodeId) -> Result<FloatValue<'ctx>> {
    match values.get(id.index()).copied().flatten() {
        Some(Val::Num(v)) => Ok(v),
        Some(Val::Bool(_)) => Err(llvm_error(format!(
            "node {} is a comparison, not a number",
            id.0
        ))),
        None => Err(llvm_error(format!("node {} was not evaluated", id.0))),
    }
}
