//! Malformed op calls (wrong lengths, counts, dtypes, ranges, buffer ids) on the GPU are
//! errors, never a crash.
use crate::harness::{gpu, SCALARS};
use parc_compiler::ir::op::Op;
use parc_compiler::ir::{BufferId, DType};

/// A lowering bug (wrong lengths, counts, dtypes) is an error on the GPU too, never a crash.
#[test]
fn bad_programs_are_errors() {
    let Some(mut b) = gpu() else { return };
    b.alloc(BufferId(0), &[6], DType::F32).unwrap();
    b.alloc(BufferId(1), &[7], DType::F32).unwrap();
    b.alloc(BufferId(2), &[4], DType::F32).unwrap();
    b.alloc(BufferId(3), &[4], DType::I32).unwrap();
    let matmul = Op::Matmul {
        in_dim: 2,
        out_dim: 2,
        bias: false,
        act: None,
        residual: false,
        swiglu: false,
        fp8: None,
    };
    let err = b
        .compute(
            &matmul,
            &[BufferId(0), BufferId(1)],
            &[BufferId(2)],
            &SCALARS,
        )
        .unwrap_err();
    // The op table's name and the operand's role and buffer (`runtime/src/bind.rs`).
    let text = err.to_string();
    assert!(
        text.contains("matmul") && text.contains("(w, buffer 1)"),
        "{err}"
    );
    let err = b
        .compute(&Op::Add, &[BufferId(0)], &[BufferId(2)], &SCALARS)
        .unwrap_err();
    assert!(err.to_string().contains("inputs"), "{err}");
    // An i32 buffer where a float (f32 or bf16) operand belongs.
    let err = b
        .compute(&Op::Copy, &[BufferId(3)], &[BufferId(2)], &SCALARS)
        .unwrap_err();
    assert!(err.to_string().contains("expected f32 or bf16"), "{err}");
    let range = Op::CopyRange {
        src_offset: 5,
        dst_offset: 0,
        len: 3,
    };
    let err = b
        .compute(&range, &[BufferId(0)], &[BufferId(2)], &SCALARS)
        .unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    assert!(b.alloc(BufferId(0), &[1], DType::F32).is_err());
    assert!(b.read_f32(BufferId(3)).is_err());
    assert!(b.write_f32(BufferId(2), &[1.0; 3]).is_err());
    b.free(BufferId(0)).unwrap();
    assert!(b.free(BufferId(0)).is_err());
    println!("bad_programs_are_errors: every mistake was an error");
}
