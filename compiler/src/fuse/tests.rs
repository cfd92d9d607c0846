//! Why `kernel::build` refuses a group, and the Llama rope chain's kernel. (Fused against
//! unfused values, plans and training: `tests/fusion.rs`.)
use super::kernel::{build, Refusal};
use super::ops::{fragment, Fragment};
use crate::ir::op::{Op, RopeAttrs, RopeScaling, Segment};
use crate::ir::{Buffer, BufferId, BufferKind, DType, Instr, Program};

fn program(shapes: &[(u64, u64)], instrs: Vec<Instr>) -> Program {
    let buffers = shapes
        .iter()
        .enumerate()
        .map(|(i, &(r, c))| Buffer {
            name: format!("b{i}"),
            shape: vec![r, c],
            dtype: DType::F32,
            kind: BufferKind::Activation,
        })
        .collect();
    Program::new("test", buffers, instrs)
}

fn rope(head_dim: u64, heads: u64) -> Op {
    Op::Rope(RopeAttrs {
        batch: 1,
        heads,
        head_dim,
        theta: 10000.0,
        scaling: RopeScaling::None,
        positions: vec![Segment { start: 0, len: 4 }],
        rotary_dim: None,
    })
}

fn fragments(p: &Program) -> Vec<Fragment<'_>> {
    p.instrs
        .iter()
        .filter_map(|i| fragment(p, &i.as_compute()?))
        .collect()
}

fn cannot(result: Result<super::kernel::Built, Refusal>) -> String {
    match result {
        Err(Refusal::Cannot(why)) => why,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_head_wider_than_the_domain_is_refused() {
    // Concatenating 4-wide parts makes a 4-column domain; a rope of 8-wide heads needs 8.
    let p = program(
        &[(4, 4), (4, 4), (4, 8), (4, 8)],
        vec![
            Instr::compute(Op::ConcatColumns { widths: vec![4, 4] }, &[0, 1], &[2]),
            Instr::compute(rope(8, 1), &[2], &[3]),
        ],
    );
    let f = fragments(&p);
    let why = cannot(build(&[&f[0], &f[1]], &|_| true));
    assert!(why.contains("head of 8"), "{why}");
}

#[test]
fn writing_what_an_earlier_member_read_is_refused() {
    // b1 = 2·b0, then b0 = b1 + b2: the kernel would read and write b0 at once.
    let p = program(
        &[(4, 4); 3],
        vec![
            Instr::compute(Op::Scale { factor: 2.0 }, &[0], &[1]),
            Instr::compute(Op::Add, &[1, 2], &[0]),
        ],
    );
    let f = fragments(&p);
    let why = cannot(build(&[&f[0], &f[1]], &|_| false));
    assert!(why.contains("after a member read it"), "{why}");
}

#[test]
fn split_and_ropes_become_one_kernel_over_whole_heads() {
    let p = program(
        &[(4, 24), (4, 8), (4, 8), (4, 8), (4, 8), (4, 8)],
        vec![
            Instr::compute(
                Op::SplitColumns {
                    widths: vec![8, 8, 8],
                },
                &[0],
                &[1, 2, 3],
            ),
            Instr::compute(rope(4, 2), &[1], &[4]),
            Instr::compute(rope(4, 2), &[2], &[5]),
        ],
    );
    let f = fragments(&p);
    let internal = |b: BufferId| b.0 == 1 || b.0 == 2;
    let built = build(&[&f[0], &f[1], &f[2]], &internal).unwrap();
    assert_eq!(built.kernel.cols, 8);
    assert_eq!(built.outputs, vec![BufferId(3), BufferId(4), BufferId(5)]);
    assert_eq!(built.internal, vec![BufferId(1), BufferId(2)]);
    assert_eq!(&*built.name, "split_columns+rope");
    // qkv and one rotation table, shared by both ropes.
    assert_eq!(built.inputs.len(), 2);
    assert_eq!(
        built.kernel.to_string(),
        "y0 = x0[+16]; y1 = (x0 * x1[c%4]) + (x0[rot4] * x1[c%4+4]); \
         y2 = (x0[+8] * x1[c%4]) + (x0[rot4+8] * x1[c%4+4])"
    );
}
