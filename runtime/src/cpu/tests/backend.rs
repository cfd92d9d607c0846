//! Buffer storage (planned and unplanned placement, zero-fill, lifecycle), error reporting for lowering bugs (counts,
//! dtypes, lengths: errors, never panics), in-place ops, and bit-identical results across
//! thread counts.
use super::*;
use crate::error::RuntimeError;
use parc_compiler::ir::op::Act;
use parc_compiler::ir::op::{
    ActAttrs, AttentionAttrs, EmbeddingAttrs, PositionAttrs, RopeAttrs, RopeScaling,
};
use parc_compiler::ir::{Buffer, BufferKind, Instr, Program};
use parc_compiler::memplan::{plan_program, Placement};

#[test]
fn buffers_are_zeroed_and_their_lifecycle_is_checked() {
    let mut b = CpuBackend::new();
    b.alloc(BufferId(3), &[2, 2], DType::F32).unwrap();
    assert_eq!(b.f32(BufferId(3)).unwrap(), &[0.0; 4]);
    assert!(b.alloc(BufferId(3), &[1], DType::F32).is_err());
    assert_eq!(b.allocated_bytes(), 16);
    assert!(b.f32(BufferId(0)).is_err());
    assert!(b.i32(BufferId(3)).is_err());
    // Writes of the wrong length into f32, i32 and bf16 buffers name both lengths.
    b.alloc(BufferId(4), &[2], DType::I32).unwrap();
    b.alloc(BufferId(5), &[2], DType::Bf16).unwrap();
    let written = [
        b.write_f32(BufferId(3), &[1.0; 3]),
        b.write_i32(BufferId(4), &[1; 3]),
        b.write_f32(BufferId(5), &[1.0; 3]),
    ];
    for (result, holds) in written.into_iter().zip([4, 2, 2]) {
        let text = result.unwrap_err().to_string();
        assert!(
            text.contains(&format!("holds {holds} elements, cannot write 3")),
            "{text}"
        );
    }
    b.free(BufferId(3)).unwrap();
    assert!(b.free(BufferId(3)).is_err());
    assert!(!b.is_allocated(BufferId(3)));
}

/// Buffers `b0` (persistent, 2 floats), `b1` and `b2` (transient, 64 floats, alive one after
/// the other) and `b3` (i32, alive with both).
fn planned_program() -> Program {
    let buffer = |name: &str, n: u64, dtype, kind| Buffer {
        name: name.into(),
        shape: vec![n],
        dtype,
        kind,
    };
    let (alloc, free) = (
        |b: u32| Instr::Alloc {
            buffer: BufferId(b),
        },
        |b: u32| Instr::Free {
            buffer: BufferId(b),
        },
    );
    Program::new(
        "test",
        vec![
            buffer("w", 2, DType::F32, BufferKind::Param),
            buffer("x", 64, DType::F32, BufferKind::Activation),
            buffer("y", 64, DType::F32, BufferKind::Activation),
            buffer("ids", 8, DType::I32, BufferKind::Input),
        ],
        vec![alloc(3), alloc(1), free(1), alloc(2), free(2), free(3)],
    )
}

#[test]
fn planned_buffers_reuse_their_planned_bytes_zeroed() {
    let program = planned_program();
    let mut layout = plan_program(&program).unwrap();
    // Nothing uses x or y, so the plan exempts them from zeroing; make y a buffer that needs it.
    assert!(!layout.needs_zero(BufferId(2)));
    layout.needs_zero[2] = true;
    assert_eq!(
        layout.placement(BufferId(1)),
        layout.placement(BufferId(2)),
        "x and y are never alive together"
    );
    assert!(matches!(
        layout.placement(BufferId(0)),
        Placement::Persistent(0)
    ));
    let mut b = CpuBackend::new();
    b.prepare(&program, &layout).unwrap();
    assert_eq!(b.reserved_bytes(), layout.total_bytes());
    b.alloc(BufferId(0), &[2], DType::F32).unwrap();
    b.write_f32(BufferId(0), &[5.0, 6.0]).unwrap();
    b.alloc(BufferId(3), &[8], DType::I32).unwrap();
    b.write_i32(BufferId(3), &[7; 8]).unwrap();
    b.alloc(BufferId(1), &[64], DType::F32).unwrap();
    b.write_f32(BufferId(1), &[1.5; 64]).unwrap();
    b.free(BufferId(1)).unwrap();
    b.alloc(BufferId(2), &[64], DType::F32).unwrap();
    // y took x's bytes: zeroed again; the others are untouched.
    assert_eq!(b.f32(BufferId(2)).unwrap(), &[0.0; 64]);
    assert_eq!(b.f32(BufferId(0)).unwrap(), &[5.0, 6.0]);
    assert_eq!(b.i32(BufferId(3)).unwrap(), &[7; 8]);
    // Ops read and write planned buffers like any others.
    b.compute(
        &Op::Scale { factor: 2.0 },
        &[BufferId(0)],
        &[BufferId(0)],
        &SCALARS,
    )
    .unwrap();
    assert_eq!(b.f32(BufferId(0)).unwrap(), &[10.0, 12.0]);
    assert_eq!(b.reserved_bytes(), layout.total_bytes(), "no growth");
    // A plan comes before any allocation.
    assert!(b.prepare(&program, &layout).is_err());
}

#[test]
fn buffers_the_plan_exempts_from_zeroing_are_poisoned_with_nan() {
    let program = planned_program();
    let layout = plan_program(&program).unwrap();
    assert!(
        layout.needs_zero(BufferId(0)),
        "persistent buffers start at zero"
    );
    assert!(!layout.needs_zero(BufferId(1)) && !layout.needs_zero(BufferId(3)));
    let mut b = CpuBackend::new();
    b.prepare(&program, &layout).unwrap();
    b.alloc(BufferId(0), &[2], DType::F32).unwrap();
    assert_eq!(b.f32(BufferId(0)).unwrap(), &[0.0; 2]);
    b.alloc(BufferId(1), &[64], DType::F32).unwrap();
    assert!(b.f32(BufferId(1)).unwrap().iter().all(|x| x.is_nan()));
    b.alloc(BufferId(3), &[8], DType::I32).unwrap();
    assert!(b.i32(BufferId(3)).unwrap().iter().all(|&id| id > 1 << 30));
    // Without a plan every buffer is zeroed.
    let mut unplanned = CpuBackend::new();
    unplanned.alloc(BufferId(1), &[64], DType::F32).unwrap();
    assert_eq!(unplanned.f32(BufferId(1)).unwrap(), &[0.0; 64]);
}

#[test]
fn unplanned_buffers_reuse_freed_space_first_fit() {
    let mut b = CpuBackend::new();
    b.alloc(BufferId(0), &[16], DType::F32).unwrap();
    b.alloc(BufferId(1), &[16], DType::F32).unwrap();
    b.free(BufferId(0)).unwrap();
    b.alloc(BufferId(2), &[8], DType::I32).unwrap();
    assert_eq!(b.reserved_bytes(), 128, "b2 went into b0's freed bytes");
    assert_eq!(b.i32(BufferId(2)).unwrap(), &[0; 8]);
    b.alloc(BufferId(3), &[32], DType::F32).unwrap();
    assert_eq!(b.reserved_bytes(), 256);
    // Inputs and outputs of one op are disjoint views, repeated inputs allowed.
    b.write_f32(BufferId(1), &[2.0; 16]).unwrap();
    b.alloc(BufferId(4), &[16], DType::F32).unwrap();
    b.compute(
        &Op::Add,
        &[BufferId(1), BufferId(1)],
        &[BufferId(4)],
        &SCALARS,
    )
    .unwrap();
    assert_eq!(b.f32(BufferId(4)).unwrap(), &[4.0; 16]);
}

fn error_text(result: Result<Vec<Vec<f32>>>) -> String {
    match result {
        Err(RuntimeError::Op { op, what }) => format!("{op}: {what}"),
        other => panic!("expected an op error, got {other:?}"),
    }
}

#[test]
fn lowering_mistakes_are_clear_errors_naming_op_role_and_buffer() {
    let mut h = Harness::new();
    // Runs `op` on `inputs` into zeroed outputs of `out_lens`, which must fail with an op
    // error whose text contains every one of `wanted`.
    let mut expect = |op: &Op, inputs: &[Input], out_lens: &[usize], wanted: &[&str]| {
        let outputs: Vec<Vec<f32>> = out_lens.iter().map(|&n| vec![0.0; n]).collect();
        let text = error_text(h.run(op, inputs, &outputs, &SCALARS));
        for w in wanted {
            assert!(text.contains(w), "{text}");
        }
    };
    let f = |n: usize| Input::F(vec![0.0; n]);
    let matmul = |bias: bool| Op::Matmul {
        in_dim: 4,
        out_dim: 3,
        bias,
        act: None,
        residual: false,
        swiglu: false,
        fp8: None,
    };
    // Wrong output length.
    let wanted = ["matmul", "output 0 (y, buffer 2) holds 5 elements"];
    expect(&matmul(false), &[f(8), f(12)], &[5], &wanted);
    // Wrong input count (bias declared, not bound).
    let wanted = ["takes 3 inputs (x, w, b), got 2"];
    expect(&matmul(true), &[f(8), f(12)], &[6], &wanted);
    // Wrong dtype.
    let embedding = Op::Embedding(EmbeddingAttrs {
        vocab_start: 0,
        vocab_local: 2,
        dim: 2,
    });
    let wanted = ["input 0 (ids, buffer", "expected i32"];
    expect(&embedding, &[f(2), f(4)], &[4], &wanted);
    // Positions that do not match the buffer.
    let rope = Op::Rope(RopeAttrs {
        batch: 2,
        heads: 1,
        head_dim: 2,
        theta: 1e4,
        scaling: RopeScaling::None,
        positions: vec![seg(0, 3)],
        rotary_dim: None,
    });
    expect(
        &rope,
        &[f(8)],
        &[8],
        &["input 0 (x, buffer", "expected [6, 2]"],
    );
    // Zero and absurd dimensions, and attributes no shape holds.
    let wanted = ["(logits, buffer", "dimension attribute is 0"];
    expect(&Op::CeMax { vocab_local: 0 }, &[f(2)], &[2], &wanted);
    let attention = |batch: u64, heads: u64, head_dim: u64| {
        Op::Attention(AttentionAttrs {
            batch,
            heads,
            kv_heads: 2,
            head_dim,
            causal: true,
            scale: 1.0,
            q_positions: vec![seg(0, 1)],
            kv_positions: vec![seg(0, 1)],
            packed: false,
        })
    };
    let huge = attention(1 << 40, 1 << 30, 1 << 30);
    expect(&huge, &[f(4), f(4), f(4)], &[4, 1], &["overflows"]);
    let wanted = ["heads = 3 is not a multiple of kv_heads = 2"];
    expect(&attention(1, 3, 1), &[f(3), f(2), f(2)], &[3, 3], &wanted);
    let norm = Op::RmsNorm { dim: 2, eps: -1.0 };
    expect(
        &norm,
        &[f(4), f(2)],
        &[4, 2],
        &["eps = -1 must be non-negative"],
    );
    // Out-of-range copy and position past the table.
    let copy = Op::CopyRange {
        src_offset: 2,
        dst_offset: 0,
        len: 2,
    };
    expect(
        &copy,
        &[f(3)],
        &[3],
        &["src range 2..2+2 is outside its 3 elements"],
    );
    let position = Op::PositionAdd(PositionAttrs {
        batch: 1,
        dim: 1,
        positions: vec![seg(4, 1)],
    });
    expect(
        &position,
        &[f(1), f(4)],
        &[1],
        &["position 4 is past the 4 rows"],
    );
    // Step 0 for Adam and duplicate outputs.
    let adam = Op::AdamW {
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let zero_step = StepScalars {
        lr: 0.1,
        step: 0,
        loss_scale: None,
    };
    let states = [vec![0.0], vec![0.0], vec![0.0]];
    let text = error_text(h.run(&adam, &[f(1), f(1)], &states, &zero_step));
    assert!(text.contains("1-based"), "{text}");
    let x = h.f32(&[1.0]);
    let err = h
        .backend
        .compute(&Op::SwiGluBwd, &[x, x, x], &[x, x], &SCALARS);
    assert!(err
        .unwrap_err()
        .to_string()
        .contains("bound to two outputs"));
}

#[test]
fn an_output_that_is_also_an_input_reads_the_value_from_before_the_op() {
    let mut h = Harness::new();
    let a = h.f32(&[1.0, 2.0]);
    let b = h.f32(&[10.0, 20.0]);
    h.backend
        .compute(&Op::Add, &[a, b], &[a], &SCALARS)
        .unwrap();
    assert_eq!(h.backend.f32(a).unwrap(), &[11.0, 22.0]);
    h.backend
        .compute(&Op::Scale { factor: 0.5 }, &[b], &[b], &SCALARS)
        .unwrap();
    assert_eq!(h.backend.f32(b).unwrap(), &[5.0, 10.0]);
}

/// Run a small training-like sequence of ops and return every output's bits.
fn op_sequence_bits(backend: CpuBackend) -> Vec<Vec<u32>> {
    let mut h = Harness::with_backend(backend);
    let (rows, dim, hidden) = (96usize, 64usize, 256usize);
    let x = Input::F(values(rows * dim, 70, 1.0));
    let w1 = Input::F(values(hidden * dim, 71, 0.2));
    let b1 = Input::F(values(hidden, 72, 0.2));
    let mut outputs = Vec::new();
    let mut run = |op: Op, inputs: Vec<Input>, lens: Vec<usize>| {
        let initial: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.5; n]).collect();
        let out = h.run(&op, &inputs, &initial, &SCALARS).unwrap();
        outputs.extend(out.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()));
        out
    };
    let ln = run(
        Op::LayerNorm {
            dim: dim as u64,
            eps: 1e-5,
            bias: false,
        },
        vec![x.clone(), Input::F(vec![1.0; dim])],
        vec![rows * dim, rows, rows],
    );
    let y = run(
        Op::Matmul {
            in_dim: dim as u64,
            out_dim: hidden as u64,
            bias: true,
            act: None,
            residual: false,
            swiglu: false,
            fp8: None,
        },
        vec![Input::F(ln[0].clone()), w1.clone(), b1],
        vec![rows * hidden],
    );
    run(
        Op::Activation(ActAttrs { act: Act::Gelu }),
        vec![Input::F(y[0].clone())],
        vec![rows * hidden],
    );
    let dy = Input::F(values(rows * hidden, 73, 1.0));
    run(
        Op::MatmulBwdWeight {
            in_dim: dim as u64,
            out_dim: hidden as u64,
            bias: true,
            accumulate_param_grad: true,
            fp8: None,
        },
        vec![dy.clone(), Input::F(ln[0].clone())],
        vec![hidden * dim, hidden],
    );
    run(
        Op::MatmulBwdData {
            in_dim: dim as u64,
            out_dim: hidden as u64,
            accumulate: false,
            act_grad: None,
            swiglu: false,
            fp8: None,
        },
        vec![dy, w1],
        vec![rows * dim],
    );
    run(
        Op::LayerNormBwd {
            dim: dim as u64,
            bias: false,
            accumulate: false,
            accumulate_param_grad: true,
        },
        vec![
            Input::F(values(rows * dim, 74, 1.0)),
            x,
            Input::F(vec![1.0; dim]),
            Input::F(ln[1].clone()),
            Input::F(ln[2].clone()),
        ],
        vec![rows * dim, dim],
    );
    let (batch, heads, d, seq) = (4u64, 4u64, 16u64, 24u64);
    let attention = |bwd: bool| {
        let attrs = AttentionAttrs {
            batch,
            heads,
            kv_heads: 2,
            head_dim: d,
            causal: true,
            scale: 0.25,
            q_positions: vec![seg(0, 24)],
            kv_positions: vec![seg(0, 24)],
            packed: false,
        };
        attention_op(bwd, attrs)
    };
    let q_len = (seq * batch * heads * d) as usize;
    let (q, k, v) = (
        values(q_len, 75, 1.0),
        values(q_len / 2, 76, 1.0),
        values(q_len / 2, 77, 1.0),
    );
    let fwd = run(
        attention(false),
        vec![
            Input::F(q.clone()),
            Input::F(k.clone()),
            Input::F(v.clone()),
        ],
        vec![q_len, (batch * heads * seq) as usize],
    );
    run(
        attention(true),
        vec![
            Input::F(values(q_len, 78, 1.0)),
            Input::F(q),
            Input::F(k),
            Input::F(v),
            Input::F(fwd[0].clone()),
            Input::F(fwd[1].clone()),
        ],
        vec![q_len, q_len / 2, q_len / 2],
    );
    run(
        Op::SumSquares,
        vec![Input::F(values(100_000, 79, 1.0))],
        vec![1],
    );
    outputs
}

#[test]
fn results_are_bit_identical_for_any_thread_count() {
    let one = op_sequence_bits(CpuBackend::with_threads(1).unwrap());
    let four = op_sequence_bits(CpuBackend::with_threads(4).unwrap());
    let global = op_sequence_bits(CpuBackend::new());
    assert_eq!(one.len(), four.len());
    for (i, (a, b)) in one.iter().zip(&four).enumerate() {
        assert!(a == b, "output {i} differs between 1 and 4 threads");
    }
    assert!(one == global, "global pool differs from 1 thread");
}

#[test]
fn dense_products_do_not_depend_on_whether_they_run_on_the_pool() {
    use crate::cpu::dense::Threads;
    use crate::cpu::linear::matmul;
    // Above gemm's threading threshold, so the pool run really splits.
    let (rows, in_dim, out_dim) = (128usize, 96usize, 160usize);
    let x = values(rows * in_dim, 80, 1.0);
    let w = values(out_dim * in_dim, 81, 1.0);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    let run = |threads| {
        let mut y = vec![f32::NAN; rows * out_dim];
        pool.install(|| matmul("matmul", threads, in_dim, out_dim, &x, &w, None, &mut y))
            .unwrap();
        y.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
    };
    assert!(run(Threads::Pool) == run(Threads::Caller));
}
