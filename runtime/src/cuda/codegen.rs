//! The CUDA C emitter of generated kernels (`Op::Fused`): one CUDA C source per expanded
//! `kir::Kernel` and storage type of each operand, which NVRTC compiles (`fused`). It follows
//! the generated-kernel ABI every emitter shares (docs/cuda.md, "Generated kernels"):
//! - entry point `parc_fused(inputs…, outputs…, long long rows)`: one pointer per operand, an
//!   `Elem` operand's element type fixed by its dtype (f32 or bf16 bits), every other operand
//!   f32;
//! - arithmetic exactly `kir::prim`: `__fadd_rn` and friends (never contracted), correctly
//!   rounded division and square root, sign, exponent and mantissa by bit operations; bf16
//!   widened exactly on load and rounded to nearest-even on store (a vector by one
//!   `cvt.rn.bf16x2.f32` a pair where none of its values is NaN, else by bit operations that
//!   keep a NaN's payload);
//! - correct for any grid (grid-stride loops). A kernel without row sums works for any block
//!   size: it walks 16-byte vectors of elements where every pointer is 16-byte aligned (checked
//!   in the kernel: one branch, the same in every thread) and elements one at a time otherwise.
//!   A kernel with row sums takes a row per warp (rows grid-strided over every warp of the
//!   grid; any block of whole warps). It sums in `kir`'s order (`REDUCE_LANES` lanes: lane `l`
//!   sums columns `l, l + LANES, …` in order from 0, then the halving tree `p[i] += p[i + s]`)
//!   with warp lane `t` holding the order's lanes `t · LANE_COLS + k`, `k < LANE_COLS`: it
//!   reads its `LANE_COLS` columns of every `REDUCE_LANES`-column chunk as one 16-byte vector
//!   of bf16 (two of f32) where the widths and pointers allow (else element by element), the
//!   tree's steps of `LANE_COLS` lanes and more are shuffles and the smaller ones the lane's
//!   own sums, so every backend still sums in the same order. Loads a later pass over the row
//!   reads again (a variance after its mean, the normalisation after its sum) stay in
//!   registers when the row is short enough ([`KEEP_WORDS`]), so the row is read once.
//!
//! Each node becomes one `const` C variable (`v<id>`, or `v<id>_<k>` for element `k` of a
//! vector); nodes that do not vary along the row (constants, row inputs, row sums and what is
//! computed from them) are computed once per row or vector.
use parc_compiler::ir::DType;
use parc_compiler::kir::REDUCE_LANES;
use parc_compiler::kir::{Access, Bin, Cmp, ColMap, Kernel, Level, Node, NodeId, Un};

/// The generated kernel's entry point (the ABI's).
pub(crate) const ENTRY: &str = "parc_fused";

/// Elements of the vectors a flat kernel walks (16 bytes of bf16; two float4 of f32).
const FLAT_VECTOR: u64 = 8;

/// Threads of a warp: a row-sum kernel sums a row per warp.
const WARP: u64 = 32;

/// Columns a warp lane of a row-sum kernel takes from each `REDUCE_LANES`-column chunk of its
/// row (the order's lanes `t · LANE_COLS + k`): one 16-byte vector of bf16.
const LANE_COLS: u64 = REDUCE_LANES as u64 / WARP;

/// The most 32-bit registers per thread a row-sum kernel keeps loaded row values in between
/// its passes (the rest is read again): a 2048-column row of f32, or of bf16 with a second
/// input.
const KEEP_WORDS: u64 = 64;

/// The helpers every generated source starts with: bf16 conversions (the rounding of
/// kernels/common.cuh's `round_bf16`) and the bit-level primitives of `kir::prim`.
const PRELUDE: &str = r#"#define PARC_LANES LANES_VALUE
#define PARC_LANE_COLS LANE_COLS_VALUE
#define PARC_FULL_MASK 0xffffffffu
__device__ __forceinline__ float parc_widen(unsigned short h) {
    return __uint_as_float((unsigned int)h << 16);
}
__device__ __forceinline__ unsigned short parc_round(float x) {
    unsigned int u = __float_as_uint(x);
    if (x != x) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ unsigned int parc_pack(float a, float b) {
    return (unsigned int)parc_round(a) | ((unsigned int)parc_round(b) << 16);
}
// parc_pack by one cvt.rn.bf16x2.f32 (sm_80 on; a in the low half): the same bits for every
// value but NaN, which the instruction gives bits of its own: a caller that finds a NaN among
// the values passes the word through parc_fix_nan.
__device__ __forceinline__ unsigned int parc_pack_rn(float a, float b) {
#if __CUDA_ARCH__ >= 800
    unsigned int w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(b), "f"(a));
    return w;
#else
    return parc_pack(a, b);
#endif
}
// parc_pack_rn(a, b)'s word w with the half of each NaN value replaced by parc_round's quiet
// NaN (the value's top 16 bits, quiet bit set): parc_pack(a, b).
__device__ __forceinline__ unsigned int parc_fix_nan(unsigned int w, float a, float b) {
    if (a != a) w = __byte_perm(__float_as_uint(a), w, 0x7632) | 0x40u;
    if (b != b) w = __byte_perm(w, __float_as_uint(b), 0x7610) | 0x400000u;
    return w;
}
__device__ __forceinline__ float parc_neg(float x) {
    return __uint_as_float(__float_as_uint(x) ^ 0x80000000u);
}
__device__ __forceinline__ float parc_abs(float x) {
    return __uint_as_float(__float_as_uint(x) & 0x7fffffffu);
}
// kir's exp2i: k truncated to an integer (NaN to 0: cvt.rzi.s32.f32 gives 0 for NaN and
// saturates ±inf), clamped to [-126, 127], as the exponent of a power of two.
__device__ __forceinline__ float parc_exp2i(float k) {
    const int i = max(min(__float2int_rz(k), 127), -126);
    return __uint_as_float((unsigned int)(i + 127) << 23);
}
// kir's exp2bits: the low 9 bits of x as sign and exponent.
__device__ __forceinline__ float parc_exp2bits(float x) {
    return __uint_as_float(__float_as_uint(x) << 23);
}
__device__ __forceinline__ float parc_exponent(float x) {
    return (float)((int)((__float_as_uint(x) >> 23) & 0xffu) - 127);
}
__device__ __forceinline__ float parc_mantissa(float x) {
    return __uint_as_float((__float_as_uint(x) & 0x807fffffu) | 0x3f800000u);
}
// The sum of a row in the halving-tree order of kir::REDUCE_LANES, given to every lane of the
// warp that holds it: lane t holds p[k], the partial sum of the order's lane
// t * PARC_LANE_COLS + k. The order's steps of PARC_LANE_COLS lanes and more pair warp lanes t
// and t + s / PARC_LANE_COLS (shuffles), the smaller ones a lane's own sums.
__device__ __forceinline__ float parc_warp_total(float* p) {
#pragma unroll
    for (int s = PARC_LANES / 2 / PARC_LANE_COLS; s > 0; s >>= 1) {
#pragma unroll
        for (int k = 0; k < PARC_LANE_COLS; ++k) p[k] = __fadd_rn(p[k], __shfl_down_sync(PARC_FULL_MASK, p[k], s));
    }
#pragma unroll
    for (int s = PARC_LANE_COLS / 2; s > 0; s >>= 1) {
#pragma unroll
        for (int k = 0; k < s; ++k) p[k] = __fadd_rn(p[k], p[k + s]);
    }
    return __shfl_sync(PARC_FULL_MASK, p[0], 0);
}
"#;

/// How the kernel walks its domain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// Every operand is `[rows, cols]` read and written at the same element: one flat index
    /// over `rows · cols` elements, vectors of [`FLAT_VECTOR`] and a scalar tail.
    Flat,
    /// Elementwise over `(row, column)`, vectors of this many columns (1: scalar only) that
    /// every width, offset and column map keeps together.
    Rows(u64),
    /// Has row sums: a warp per row.
    Reduce,
}

/// The shape a kernel is generated in.
pub(crate) fn shape(kernel: &Kernel) -> Shape {
    let nodes = kernel.graph.nodes();
    if nodes.iter().any(|n| matches!(n, Node::RowSum(_))) {
        return Shape::Reduce;
    }
    let same = |a: &Access| *a == Access::Elem { width: kernel.cols };
    let plain_loads = nodes.iter().all(|n| match *n {
        Node::Load {
            col_offset, map, ..
        } => col_offset == 0 && map == ColMap::Id,
        _ => true,
    });
    if kernel.inputs.iter().chain(&kernel.outputs).all(same) && plain_loads {
        return Shape::Flat;
    }
    Shape::Rows(
        [8, 4, 2]
            .into_iter()
            .find(|&v| vectors_fit(kernel, v))
            .unwrap_or(1),
    )
}

/// Whether vectors of `v` columns stay together under every width, offset and column map of
/// `kernel` (a vector never straddles a row, a block or a rotation).
fn vectors_fit(kernel: &Kernel, v: u64) -> bool {
    let nodes = kernel.graph.nodes();
    let widths = kernel
        .inputs
        .iter()
        .chain(&kernel.outputs)
        .all(|a| match *a {
            Access::Elem { width } | Access::PerPosition { width, .. } => width.is_multiple_of(v),
            Access::Row | Access::Col => true,
        });
    let loads = nodes.iter().all(|n| match *n {
        Node::Load {
            col_offset, map, ..
        } => {
            col_offset.is_multiple_of(v)
                && match map {
                    ColMap::Id => true,
                    ColMap::Periodic(p) => p.max(1).is_multiple_of(v),
                    ColMap::RotateHalf(hd) => hd.is_multiple_of(2) && (hd / 2).is_multiple_of(v),
                    // Every vector lies in one of the first half of the turned columns, their
                    // second half and the kept ones, so its partners are contiguous too.
                    ColMap::RotatePart { head, rot } => {
                        head.is_multiple_of(v)
                            && rot.is_multiple_of(2)
                            && (rot / 2).is_multiple_of(v)
                    }
                }
        }
        _ => true,
    });
    let stores = kernel.stores.iter().all(|s| s.col_offset.is_multiple_of(v));
    kernel.cols.is_multiple_of(v) && widths && loads && stores
}

/// The CUDA C source of `kernel` (expanded and valid) with `dtypes` the storage type of each
/// operand, inputs then outputs: an `Elem` operand's f32 or bf16, every other operand's f32.
pub(crate) fn source(kernel: &Kernel, dtypes: &[DType]) -> Result<String, String> {
    check(kernel, dtypes)?;
    let e = Emitter::new(kernel, dtypes);
    let mut out = format!("// parc generated kernel: {kernel}\n");
    let prelude = PRELUDE.replace("LANE_COLS_VALUE", &LANE_COLS.to_string());
    out.push_str(&prelude.replace("LANES_VALUE", &REDUCE_LANES.to_string()));
    out.push_str(&e.signature());
    out.push_str(" {\n");
    match shape(kernel) {
        Shape::Flat => e.flat(&mut out),
        Shape::Rows(v) => e.rows(&mut out, v),
        Shape::Reduce => e.reduce(&mut out),
    }
    out.push_str("}\n");
    Ok(out)
}

/// What the ABI asks of the kernel and its operand types.
fn check(kernel: &Kernel, dtypes: &[DType]) -> Result<(), String> {
    if !kernel.is_expanded() {
        return Err("the kernel has composite ops: expand it first (kir::expand)".into());
    }
    kernel.validate()?;
    let accesses: Vec<&Access> = kernel.inputs.iter().chain(&kernel.outputs).collect();
    if accesses.len() != dtypes.len() {
        return Err(format!(
            "{} operand types for a kernel of {} operands",
            dtypes.len(),
            accesses.len()
        ));
    }
    for (i, (access, dtype)) in accesses.iter().zip(dtypes).enumerate() {
        let ok = match access {
            Access::Elem { .. } => matches!(dtype, DType::F32 | DType::Bf16),
            _ => *dtype == DType::F32,
        };
        if !ok {
            return Err(format!(
                "operand {i} ({access:?}) cannot be stored as {}",
                dtype.name()
            ));
        }
    }
    Ok(())
}

/// Where a loop body is: the C names of its index variables.
#[derive(Clone, Copy)]
enum At {
    /// Flat element index `e` (the first of the vector).
    Flat,
    /// Row `r`, column `c` (the first of the vector).
    RowCol,
}

/// How a row-sum kernel's column pass treats a load it keeps in registers for a later pass.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// Not kept: read from global memory.
    No,
    /// The first pass that reads it: from global memory, then into `keep<id>[j]`.
    Save,
    /// A later pass: from `keep<id>[j]`.
    Reuse,
}

/// What a row-sum kernel's column pass computes per element: vectors of `LANE_COLS` columns
/// (element `k` in `v<id>_<k>`) or one column (`v<id>_0`, element `k` of the lane's columns
/// in the C variable `k`).
#[derive(Clone, Copy)]
enum Lanes {
    Vector,
    Scalar,
}

struct Emitter<'a> {
    k: &'a Kernel,
    dtypes: &'a [DType],
    levels: Vec<Level>,
}

impl<'a> Emitter<'a> {
    fn new(k: &'a Kernel, dtypes: &'a [DType]) -> Emitter<'a> {
        Emitter {
            k,
            dtypes,
            levels: k.levels(),
        }
    }

    fn elem_bytes(&self, operand: usize) -> u64 {
        if self.is_bf16(operand) {
            2
        } else {
            4
        }
    }

    fn n_inputs(&self) -> usize {
        self.k.inputs.len()
    }

    fn is_bf16(&self, operand: usize) -> bool {
        self.dtypes.get(operand) == Some(&DType::Bf16)
    }

    fn elem_type(&self, operand: usize) -> &'static str {
        if self.is_bf16(operand) {
            "unsigned short"
        } else {
            "float"
        }
    }

    /// `extern "C" __global__ void parc_fused(…)`.
    fn signature(&self) -> String {
        let mut params = Vec::new();
        for i in 0..self.n_inputs() {
            params.push(format!("const {}* __restrict__ in{i}", self.elem_type(i)));
        }
        for o in 0..self.k.outputs.len() {
            let t = self.elem_type(self.n_inputs() + o);
            params.push(format!("{t}* __restrict__ out{o}"));
        }
        params.push("long long rows".into());
        format!(
            "extern \"C\" __global__ void {ENTRY}({})",
            params.join(", ")
        )
    }

    /// Whether a node's value is the same along the row (computed once per row or vector).
    fn uniform(&self, id: NodeId) -> bool {
        matches!(self.levels[id.index()], Level::Const | Level::Row)
    }

    fn var(&self, id: NodeId, k: u64) -> String {
        if self.uniform(id) {
            format!("v{}", id.0)
        } else {
            format!("v{}_{k}", id.0)
        }
    }

    /// The nodes `roots` need, through every operand except those `stop` says are given.
    fn closure(&self, roots: &[NodeId], stop: impl Fn(NodeId) -> bool) -> Vec<bool> {
        let mut need = vec![false; self.k.graph.len()];
        for r in roots {
            need[r.index()] = true;
        }
        for i in (0..need.len()).rev() {
            let id = NodeId(i as u32);
            if need[i] && !stop(id) {
                for op in self.k.graph.node(id).operands() {
                    need[op.index()] = true;
                }
            }
        }
        need
    }

    /// The element index a load of `input` at `offset` through `map` reads at the loop's
    /// position (the vector's first element).
    fn load_index(&self, input: u32, offset: u64, map: ColMap, at: At) -> String {
        let access = self.k.inputs[input as usize];
        if let At::Flat = at {
            return "e".into();
        }
        let col = match map {
            ColMap::Id => "c".to_string(),
            ColMap::Periodic(p) => format!("(c % {}LL)", p.max(1)),
            ColMap::RotateHalf(hd) => {
                let (hd, h) = (hd.max(1), hd / 2);
                format!("(c % {hd}LL < {h}LL ? c + {h}LL : c - {h}LL)")
            }
            ColMap::RotatePart { head, rot } => {
                let (hd, h) = (head.max(1), rot / 2);
                format!("(c % {hd}LL < {h}LL ? c + {h}LL : c % {hd}LL < {rot}LL ? c - {h}LL : c)")
            }
        };
        match access {
            Access::Elem { width } => format!("r * {width}LL + {offset}LL + {col}"),
            Access::PerPosition { batch, width } => {
                format!("(r / {batch}LL) * {width}LL + {offset}LL + {col}")
            }
            Access::Row => "r".into(),
            Access::Col => "c".into(),
        }
    }

    /// Loads `v` elements of input `input` from index `idx` into `v<id>_0 … v<id>_{v-1}`; a
    /// kept vector of `LANE_COLS` from or also into `keep<id>[j]` (see [`Keep`]).
    fn vector_load(&self, out: &mut String, id: NodeId, input: u32, idx: &str, v: u64, keep: Keep) {
        let ptr = format!("in{input}");
        let names: Vec<String> = (0..v).map(|k| self.var(id, k)).collect();
        if self.is_bf16(input as usize) {
            let (ty, words) = match v {
                8 => ("uint4", vec!["x", "y", "z", "w"]),
                4 => ("uint2", vec!["x", "y"]),
                2 => ("unsigned int", vec![""]),
                _ => ("", vec![]),
            };
            if ty.is_empty() {
                out.push_str(&format!(
                    "        const float {} = parc_widen({ptr}[{idx}]);\n",
                    names[0]
                ));
                return;
            }
            let q = format!("q{}", id.0);
            out.push_str(&match keep {
                Keep::Reuse => format!("        const {ty} {q} = keep{}[j];\n", id.0),
                _ => format!("        const {ty} {q} = *(const {ty}*)({ptr} + ({idx}));\n"),
            });
            if keep == Keep::Save {
                out.push_str(&format!("        keep{}[j] = {q};\n", id.0));
            }
            for (w, field) in words.iter().enumerate() {
                let word = match *field {
                    "" => q.clone(),
                    f => format!("{q}.{f}"),
                };
                out.push_str(&format!(
                    "        const float {} = __uint_as_float({word} << 16);\n",
                    names[2 * w]
                ));
                out.push_str(&format!(
                    "        const float {} = __uint_as_float({word} & 0xffff0000u);\n",
                    names[2 * w + 1]
                ));
            }
            return;
        }
        let (ty, lanes): (&str, &[&str]) = match v {
            8 | 4 => ("float4", &["x", "y", "z", "w"]),
            2 => ("float2", &["x", "y"]),
            _ => ("", &[]),
        };
        if ty.is_empty() {
            out.push_str(&format!(
                "        const float {} = {ptr}[{idx}];\n",
                names[0]
            ));
            return;
        }
        let parts = v / lanes.len() as u64;
        for part in 0..parts {
            let q = format!("q{}_{part}", id.0);
            let at = part * lanes.len() as u64;
            let slot = format!("keep{}[{parts} * j + {part}]", id.0);
            out.push_str(&match keep {
                Keep::Reuse => format!("        const {ty} {q} = {slot};\n"),
                _ => format!("        const {ty} {q} = *(const {ty}*)({ptr} + ({idx}) + {at});\n"),
            });
            if keep == Keep::Save {
                out.push_str(&format!("        {slot} = {q};\n"));
            }
            for (j, lane) in lanes.iter().enumerate() {
                out.push_str(&format!(
                    "        const float {} = {q}.{lane};\n",
                    names[at as usize + j]
                ));
            }
        }
    }

    /// Stores `v` elements `vals` to output `output` from index `idx` (bf16 vectors by
    /// [`Emitter::bf16_vector_store`]).
    fn vector_store(&self, out: &mut String, output: u32, idx: &str, vals: &[String]) {
        let ptr = format!("out{output}");
        let operand = self.n_inputs() + output as usize;
        let v = vals.len();
        if v == 1 {
            let value = if self.is_bf16(operand) {
                format!("parc_round({})", vals[0])
            } else {
                vals[0].clone()
            };
            out.push_str(&format!("        {ptr}[{idx}] = {value};\n"));
            return;
        }
        if self.is_bf16(operand) {
            return self.bf16_vector_store(out, &ptr, idx, vals);
        }
        let (ty, ctor, lanes) = match v {
            2 => ("float2", "make_float2", 2),
            _ => ("float4", "make_float4", 4),
        };
        for (part, chunk) in vals.chunks(lanes).enumerate() {
            let at = part * lanes;
            out.push_str(&format!(
                "        *({ty}*)({ptr} + ({idx}) + {at}) = {ctor}({});\n",
                chunk.join(", ")
            ));
        }
    }

    /// Stores the bf16 vector `vals` (2, 4 or 8 elements) at `ptr + idx`: each pair rounded
    /// and packed by one `cvt.rn.bf16x2.f32` (`parc_pack_rn`), and where a value is NaN (one
    /// test of the vector, a branch not taken for numbers) its half made `parc_round`'s NaN.
    fn bf16_vector_store(&self, out: &mut String, ptr: &str, idx: &str, vals: &[String]) {
        let (ty, ctor, fields): (&str, &str, &[&str]) = match vals.len() {
            8 => ("uint4", "make_uint4", &[".x", ".y", ".z", ".w"]),
            4 => ("uint2", "make_uint2", &[".x", ".y"]),
            _ => ("unsigned int", "", &[""]),
        };
        let pairs = || vals.chunks(2).zip(fields.iter());
        let packed: Vec<String> = pairs()
            .map(|(p, _)| format!("parc_pack_rn({}, {})", p[0], p[1]))
            .collect();
        let fixed: Vec<String> = pairs()
            .map(|(p, f)| format!("parc_fix_nan(w{f}, {}, {})", p[0], p[1]))
            .collect();
        let numbers: Vec<String> = vals.iter().map(|x| format!("{x} == {x}")).collect();
        out.push_str(&format!(
            "        {{\n        {ty} w = {ctor}({});\n        if (__builtin_expect(!({}), 0)) w = {ctor}({});\n        *({ty}*)({ptr} + ({idx})) = w;\n        }}\n",
            packed.join(", "),
            numbers.join(" && "),
            fixed.join(", ")
        ));
    }

    /// The C expression of an arithmetic node for vector element `k`.
    fn expr(&self, node: Node, k: u64) -> String {
        let v = |id: NodeId| self.var(id, k);
        match node {
            Node::Const(bits) => format!("__uint_as_float(0x{bits:08x}u)"),
            Node::Un(op, a) => {
                let f = match op {
                    Un::Neg => "parc_neg",
                    Un::Abs => "parc_abs",
                    Un::Sqrt => "__fsqrt_rn",
                    Un::Floor => "floorf",
                    Un::Exp2i => "parc_exp2i",
                    Un::Exp2Bits => "parc_exp2bits",
                    Un::Exponent => "parc_exponent",
                    Un::Mantissa => "parc_mantissa",
                    // `check` refused unexpanded kernels.
                    _ => "__parc_composite_op_not_expanded",
                };
                format!("{f}({})", v(a))
            }
            Node::Bin(op, a, b) => {
                let f = match op {
                    Bin::Add => "__fadd_rn",
                    Bin::Sub => "__fsub_rn",
                    Bin::Mul => "__fmul_rn",
                    Bin::Div => "__fdiv_rn",
                    _ => "__parc_composite_op_not_expanded",
                };
                format!("{f}({}, {})", v(a), v(b))
            }
            Node::Cmp(op, a, b) => {
                let c = match op {
                    Cmp::Lt => "<",
                    Cmp::Le => "<=",
                    Cmp::Gt => ">",
                    Cmp::Ge => ">=",
                    Cmp::Eq => "==",
                    Cmp::Ne => "!=",
                };
                format!("({} {c} {})", v(a), v(b))
            }
            Node::Select(c, a, b) => format!("({} ? {} : {})", v(c), v(a), v(b)),
            Node::Fma(a, b, c) => format!("__fmaf_rn({}, {}, {})", v(a), v(b), v(c)),
            // Loads, row sums and parameters are never expressions (see `nodes`).
            Node::Load { .. } | Node::RowSum(_) | Node::Param(_) => {
                "__parc_not_an_expression".into()
            }
        }
    }

    /// The statements computing every node `need` marks that `emit` accepts, in id order:
    /// loads as vectors of `v` (`keep` says which a row-sum kernel keeps), uniform nodes once,
    /// the others once per vector element.
    fn nodes(
        &self,
        out: &mut String,
        need: &[bool],
        emit: impl Fn(NodeId) -> bool,
        at: At,
        v: u64,
        keep: impl Fn(NodeId) -> Keep,
    ) {
        for (i, node) in self.k.graph.nodes().iter().enumerate() {
            let id = NodeId(i as u32);
            if !need[i] || !emit(id) {
                continue;
            }
            match *node {
                Node::Load {
                    input,
                    col_offset,
                    map,
                } => {
                    let idx = self.load_index(input, col_offset, map, at);
                    match self.k.inputs[input as usize] {
                        Access::Row => out.push_str(&format!(
                            "        const float {} = in{input}[{idx}];\n",
                            self.var(id, 0)
                        )),
                        _ => self.vector_load(out, id, input, &idx, v, keep(id)),
                    }
                }
                Node::RowSum(_) => {}
                _ => {
                    let ty = if matches!(node, Node::Cmp(..)) {
                        "bool"
                    } else {
                        "float"
                    };
                    let lanes = if self.uniform(id) { 1 } else { v };
                    for k in 0..lanes {
                        out.push_str(&format!(
                            "        const {ty} {} = {};\n",
                            self.var(id, k),
                            self.expr(*node, k)
                        ));
                    }
                }
            }
        }
    }

    /// The element index a store to `output` at `offset` writes at the loop's position.
    fn store_index(&self, output: u32, offset: u64, at: At) -> String {
        match (at, self.k.outputs[output as usize]) {
            (At::Flat, _) => "e".into(),
            (At::RowCol, Access::Elem { width }) => format!("r * {width}LL + {offset}LL + c"),
            (At::RowCol, _) => "r".into(),
        }
    }

    /// The stores of `v`-element vectors at the loop's position; a row output's once per row
    /// (at column 0, by `row_guard`).
    fn stores(&self, out: &mut String, at: At, v: u64, row_guard: &str) {
        for s in &self.k.stores {
            let idx = self.store_index(s.output, s.col_offset, at);
            match self.k.outputs[s.output as usize] {
                Access::Elem { .. } => {
                    let vals: Vec<String> = (0..v).map(|k| self.var(s.value, k)).collect();
                    self.vector_store(out, s.output, &idx, &vals);
                }
                _ => out.push_str(&format!(
                    "        if ({row_guard}) out{}[{idx}] = {};\n",
                    s.output,
                    self.var(s.value, 0)
                )),
            }
        }
    }

    fn store_roots(&self) -> Vec<NodeId> {
        self.k.stores.iter().map(|s| s.value).collect()
    }

    /// `(p0 | p1 | …) & 15 == 0`: every operand 16-byte aligned.
    fn aligned(&self) -> String {
        let mut ptrs: Vec<String> = (0..self.n_inputs()).map(|i| format!("in{i}")).collect();
        ptrs.extend((0..self.k.outputs.len()).map(|o| format!("out{o}")));
        let ors: Vec<String> = ptrs
            .iter()
            .map(|p| format!("(unsigned long long){p}"))
            .collect();
        format!("(({}) & 15ull) == 0", ors.join(" | "))
    }

    /// A flat kernel: vectors of 8 elements where aligned, then the scalar rest.
    fn flat(&self, out: &mut String) {
        let need = self.closure(&self.store_roots(), |_| false);
        let v = FLAT_VECTOR;
        out.push_str(&format!(
            "    const long long n = rows * {}LL;\n    const long long stride = (long long)gridDim.x * blockDim.x;\n",
            self.k.cols
        ));
        out.push_str(&format!(
            "    const long long nv = ({}) ? n / {v} : 0;\n",
            self.aligned()
        ));
        out.push_str("    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < nv; j += stride) {\n");
        out.push_str(&format!("        const long long e = j * {v};\n"));
        self.nodes(out, &need, |_| true, At::Flat, v, |_| Keep::No);
        self.stores(out, At::Flat, v, "true");
        out.push_str("    }\n");
        out.push_str(&format!("    for (long long e = nv * {v} + blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += stride) {{\n"));
        self.nodes(out, &need, |_| true, At::Flat, 1, |_| Keep::No);
        self.stores(out, At::Flat, 1, "true");
        out.push_str("    }\n");
    }

    /// An elementwise kernel over (row, column): vectors of `v` columns where aligned, else
    /// one element at a time.
    fn rows(&self, out: &mut String, v: u64) {
        let need = self.closure(&self.store_roots(), |_| false);
        let cols = self.k.cols;
        out.push_str("    const long long stride = (long long)gridDim.x * blockDim.x;\n");
        out.push_str(
            "    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n",
        );
        let mut scalar_guard = String::new();
        if v > 1 {
            let per_row = cols / v;
            out.push_str(&format!("    const bool vec = {};\n", self.aligned()));
            out.push_str(&format!(
                "    if (vec) for (long long j = first; j < rows * {per_row}LL; j += stride) {{\n"
            ));
            out.push_str(&format!(
                "        const long long r = j / {per_row}LL;\n        const long long c = (j - r * {per_row}LL) * {v}LL;\n"
            ));
            self.nodes(out, &need, |_| true, At::RowCol, v, |_| Keep::No);
            self.stores(out, At::RowCol, v, "c == 0");
            out.push_str("    }\n");
            scalar_guard = "if (!vec) ".into();
        }
        out.push_str(&format!(
            "    {scalar_guard}for (long long i = first; i < rows * {cols}LL; i += stride) {{\n"
        ));
        out.push_str(&format!(
            "        const long long r = i / {cols}LL;\n        const long long c = i - r * {cols}LL;\n"
        ));
        self.nodes(out, &need, |_| true, At::RowCol, 1, |_| Keep::No);
        self.stores(out, At::RowCol, 1, "c == 0");
        out.push_str("    }\n");
    }

    /// Each node's row-sum depth: how many nested row sums its value needs.
    fn depths(&self) -> Vec<usize> {
        let mut depth: Vec<usize> = Vec::with_capacity(self.k.graph.len());
        for node in self.k.graph.nodes() {
            let below = node
                .operands()
                .map(|id| depth[id.index()])
                .max()
                .unwrap_or(0);
            depth.push(match node {
                Node::RowSum(_) => below + 1,
                _ => below,
            });
        }
        depth
    }

    /// A kernel with row sums: a row per warp (rows strided over every warp of the grid); per
    /// row, each depth of row sums in turn (a column pass, then the warp's total), then a
    /// column pass of the stores.
    fn reduce(&self, out: &mut String) {
        let need = self.closure(&self.store_roots(), |_| false);
        let depths = self.depths();
        let depth = &depths;
        let max_depth = depth.iter().copied().max().unwrap_or(0);
        let uniform_at = |d: usize| move |id: NodeId| self.uniform(id) && depth[id.index()] == d;
        let sums_at = |d: usize| -> Vec<(NodeId, NodeId)> {
            (self.k.graph.nodes().iter().enumerate())
                .filter_map(|(i, n)| match *n {
                    Node::RowSum(a) if need[i] && depth[i] == d => Some((NodeId(i as u32), a)),
                    _ => None,
                })
                .collect()
        };
        let elem_roots: Vec<NodeId> = (self.k.stores.iter())
            .filter(|s| matches!(self.k.outputs[s.output as usize], Access::Elem { .. }))
            .map(|s| s.value)
            .collect();
        let vector = vectors_fit(self.k, LANE_COLS);
        let mut passes: Vec<Vec<NodeId>> = (1..=max_depth)
            .map(|d| sums_at(d).iter().map(|(_, a)| *a).collect())
            .collect();
        passes.push(elem_roots.clone());
        let kept = match vector {
            true => self.keep_plan(&passes),
            false => vec![None; self.k.graph.len()],
        };
        let keep_in = |pass: usize| {
            let kept = &kept;
            move |id: NodeId| match kept[id.index()] {
                Some(first) if first == pass => Keep::Save,
                Some(first) if first < pass => Keep::Reuse,
                _ => Keep::No,
            }
        };
        out.push_str("    if ((blockDim.x & 31u) != 0u) __trap();\n");
        out.push_str("    const int lane = threadIdx.x & 31;\n");
        out.push_str("    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);\n");
        if vector {
            out.push_str(&format!("    const bool vec = {};\n", self.aligned()));
        }
        out.push_str("    for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {\n");
        self.keep_declarations(out, &kept);
        for d in 1..=max_depth {
            self.nodes(out, &need, uniform_at(d - 1), At::RowCol, 1, |_| Keep::No);
            let sums = sums_at(d);
            for (s, _) in &sums {
                out.push_str(&format!(
                    "        float acc{}[PARC_LANE_COLS] = {{}};\n",
                    s.0
                ));
            }
            let roots: Vec<NodeId> = sums.iter().map(|(_, a)| *a).collect();
            self.column_pass(out, &roots, vector, keep_in(d - 1), |out, lanes| {
                self.accumulate(out, &sums, lanes)
            });
            for (s, _) in &sums {
                out.push_str(&format!(
                    "        const float v{0} = parc_warp_total(acc{0});\n",
                    s.0
                ));
            }
        }
        self.nodes(out, &need, uniform_at(max_depth), At::RowCol, 1, |_| {
            Keep::No
        });
        self.column_pass(
            out,
            &elem_roots,
            vector,
            keep_in(max_depth),
            |out, lanes| self.element_stores(out, lanes),
        );
        for s in &self.k.stores {
            if self.k.outputs[s.output as usize] == Access::Row {
                out.push_str(&format!(
                    "        if (lane == 0) out{}[r] = {};\n",
                    s.output,
                    self.var(s.value, 0)
                ));
            }
        }
        out.push_str("    }\n");
    }

    /// A row-sum kernel's column pass adding each of `sums`' operands (sum, operand) into its
    /// lane's accumulators: all `PARC_LANE_COLS` of them from vectors, or column `k`.
    fn accumulate(&self, out: &mut String, sums: &[(NodeId, NodeId)], lanes: Lanes) {
        for (s, a) in sums {
            match lanes {
                Lanes::Vector => {
                    for k in 0..LANE_COLS {
                        out.push_str(&format!(
                            "        acc{0}[{k}] = __fadd_rn(acc{0}[{k}], {1});\n",
                            s.0,
                            self.var(*a, k)
                        ));
                    }
                }
                Lanes::Scalar => out.push_str(&format!(
                    "        acc{0}[k] = __fadd_rn(acc{0}[k], {1});\n",
                    s.0,
                    self.var(*a, 0)
                )),
            }
        }
    }

    /// A row-sum kernel's last column pass storing each elementwise output: a vector of
    /// `PARC_LANE_COLS` columns, or column `c` alone.
    fn element_stores(&self, out: &mut String, lanes: Lanes) {
        let n = match lanes {
            Lanes::Vector => LANE_COLS,
            Lanes::Scalar => 1,
        };
        for s in &self.k.stores {
            if let Access::Elem { width } = self.k.outputs[s.output as usize] {
                let idx = format!("r * {width}LL + {}LL + c", s.col_offset);
                let vals: Vec<String> = (0..n).map(|k| self.var(s.value, k)).collect();
                self.vector_store(out, s.output, &idx, &vals);
            }
        }
    }

    /// Which loads a row-sum kernel keeps in registers, and the pass (index into `passes`,
    /// each pass's roots) that first reads each: every load a later pass reads again, in id
    /// order while they fit in [`KEEP_WORDS`].
    fn keep_plan(&self, passes: &[Vec<NodeId>]) -> Vec<Option<usize>> {
        let n = self.k.graph.len();
        let (mut first, mut again) = (vec![None; n], vec![false; n]);
        for (p, roots) in passes.iter().enumerate() {
            let need = self.closure(roots, |id| self.uniform(id));
            for (i, node) in self.k.graph.nodes().iter().enumerate() {
                let varying_load =
                    matches!(node, Node::Load { .. }) && !self.uniform(NodeId(i as u32));
                if need[i] && varying_load {
                    match first[i] {
                        None => first[i] = Some(p),
                        Some(_) => again[i] = true,
                    }
                }
            }
        }
        let mut words = 0;
        let mut plan = vec![None; n];
        for i in 0..n {
            let Some(words_per_chunk) = self.keep_words(NodeId(i as u32)) else {
                continue;
            };
            let w = self.chunks() * words_per_chunk;
            if again[i] && words + w <= KEEP_WORDS {
                words += w;
                plan[i] = first[i];
            }
        }
        plan
    }

    /// 32-bit words a kept load takes per chunk: a 16-byte vector of bf16, two of f32 (None:
    /// not a load).
    fn keep_words(&self, id: NodeId) -> Option<u64> {
        match self.k.graph.node(id) {
            Node::Load { input, .. } => Some(LANE_COLS * self.elem_bytes(input as usize) / 4),
            _ => None,
        }
    }

    /// `REDUCE_LANES`-column chunks of a row (the last may be partial).
    fn chunks(&self) -> u64 {
        self.k.cols.div_ceil(REDUCE_LANES as u64)
    }

    /// The register arrays of the kept loads (`keep<id>[chunk]`).
    fn keep_declarations(&self, out: &mut String, kept: &[Option<usize>]) {
        let chunks = self.chunks();
        for (i, first) in kept.iter().enumerate() {
            let Node::Load { input, .. } = self.k.graph.node(NodeId(i as u32)) else {
                continue;
            };
            if first.is_none() {
                continue;
            }
            let decl = match self.is_bf16(input as usize) {
                true => format!("uint4 keep{i}[{chunks}]"),
                false => format!("float4 keep{i}[{}]", 2 * chunks),
            };
            out.push_str(&format!("        {decl};\n"));
        }
    }

    /// A pass over the row: warp lane `t` takes columns `t · LANE_COLS + k` of every chunk
    /// `j` (`c`, the first, in the C variable `c`), computing what `roots` need along the row,
    /// then `body`. As vectors (`Lanes::Vector`, unrolled so kept loads stay in registers)
    /// where `vector` and every pointer is 16-byte aligned (`vec`), else a column at a time.
    fn column_pass(
        &self,
        out: &mut String,
        roots: &[NodeId],
        vector: bool,
        keep: impl Fn(NodeId) -> Keep,
        body: impl Fn(&mut String, Lanes),
    ) {
        let need = self.closure(roots, |id| self.uniform(id));
        let varying = |id: NodeId| !self.uniform(id);
        let (chunks, cols) = (self.chunks(), self.k.cols);
        let first = format!("j * {REDUCE_LANES}LL + lane * {LANE_COLS}LL");
        let indented = |out: &mut String, inner: &str, by: &str| {
            for line in inner.lines() {
                out.push_str(by);
                out.push_str(line);
                out.push('\n');
            }
        };
        if vector {
            let unroll = if chunks <= 16 { "" } else { " 4" };
            out.push_str(&format!(
                "        if (vec) {{\n#pragma unroll{unroll}\n        for (int j = 0; j < {chunks}; ++j) {{\n            const long long c = {first};\n            if (c < {cols}LL) {{\n"
            ));
            let mut inner = String::new();
            self.nodes(&mut inner, &need, varying, At::RowCol, LANE_COLS, &keep);
            body(&mut inner, Lanes::Vector);
            indented(out, &inner, "        ");
            out.push_str("            }\n        }\n        } else {\n");
        }
        out.push_str(&format!(
            "#pragma unroll 1\n        for (int j = 0; j < {chunks}; ++j) {{\n#pragma unroll\n        for (int k = 0; k < PARC_LANE_COLS; ++k) {{\n            const long long c = {first} + k;\n            if (c < {cols}LL) {{\n"
        ));
        let mut inner = String::new();
        self.nodes(&mut inner, &need, varying, At::RowCol, 1, |_| Keep::No);
        body(&mut inner, Lanes::Scalar);
        indented(out, &inner, "        ");
        out.push_str("            }\n        }\n        }\n");
        if vector {
            out.push_str("        }\n");
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
