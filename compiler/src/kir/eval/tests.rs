use super::*;
use crate::kir::expand::expand;
use crate::kir::{Graph, Store};

/// The fixed reduction order written out: lanes over strided columns, then a halving tree.
fn reference_row_sum(v: &[f32]) -> f32 {
    let mut lanes = vec![0.0f32; REDUCE_LANES];
    for (c, &x) in v.iter().enumerate() {
        lanes[c % REDUCE_LANES] += x;
    }
    let mut width = REDUCE_LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    lanes[0]
}

#[test]
fn row_sums_follow_the_fixed_lane_order() {
    // Large values that cancel between lanes: the order shows in the result.
    let v: Vec<f32> = (0..1000)
        .map(|c| match c % 7 {
            0 => 1e8,
            3 => -1e8,
            _ => 1.0 + c as f32 * 1e-3,
        })
        .collect();
    let sequential: f32 = v.iter().sum();
    assert_eq!(row_sum(&v), reference_row_sum(&v));
    assert_ne!(
        row_sum(&v),
        sequential,
        "the input does not tell orders apart"
    );
}

/// y0 = x0 * w[c] * rstd[r] + table[pos(r), rot(c)] + per[c % 4]; y1 = row_sum(x0 * x0).
/// Inputs: x0 Elem 8, w Col, rstd Row, table PerPosition(batch 2, width 8), per Elem 12 at +8.
fn mixed_kernel() -> Kernel {
    let mut g = Graph::new();
    let x = g.load(0, 0);
    let w = g.load(1, 0);
    let rstd = g.load(2, 0);
    let t = g.load_mapped(3, 0, ColMap::RotateHalf(4));
    let p = g.load_mapped(4, 8, ColMap::Periodic(4));
    let xw = g.bin(Bin::Mul, x, w);
    let xwr = g.bin(Bin::Mul, xw, rstd);
    let plus_t = g.bin(Bin::Add, xwr, t);
    let y0 = g.bin(Bin::Add, plus_t, p);
    let sq = g.bin(Bin::Mul, x, x);
    let y1 = g.row_sum(sq);
    let neg = g.un(Un::Neg, y0);
    Kernel {
        cols: 8,
        inputs: vec![
            Access::Elem { width: 8 },
            Access::Col,
            Access::Row,
            Access::PerPosition { batch: 2, width: 8 },
            Access::Elem { width: 12 },
        ],
        outputs: vec![Access::Elem { width: 16 }, Access::Row],
        graph: g,
        stores: vec![
            Store {
                output: 0,
                col_offset: 0,
                value: y0,
            },
            Store {
                output: 0,
                col_offset: 8,
                value: neg,
            },
            Store {
                output: 1,
                col_offset: 0,
                value: y1,
            },
        ],
    }
}

struct Data {
    x: Vec<f32>,
    w: Vec<f32>,
    rstd: Vec<f32>,
    table: Vec<f32>,
    per: Vec<f32>,
}

fn data(rows: usize) -> Data {
    let f = |n: usize, s: f32| (0..n).map(|i| (i as f32 * s).sin() * 3.0).collect();
    Data {
        x: f(rows * 8, 0.37),
        w: f(8, 1.1),
        rstd: f(rows, 0.7),
        table: f(rows.div_ceil(2) * 8, 0.13),
        per: f(rows * 12, 0.29),
    }
}

#[test]
fn every_access_reads_and_writes_where_its_docs_say() {
    let rows = 5;
    let d = data(rows);
    let k = mixed_kernel();
    let mut y0 = vec![0.0f32; rows * 16];
    let mut y1 = vec![0.0f32; rows];
    let inputs: [&[f32]; 5] = [&d.x, &d.w, &d.rstd, &d.table, &d.per];
    run(&k, 0, rows, &inputs, &mut [&mut y0, &mut y1]).unwrap();
    for r in 0..rows {
        let mut sq = vec![0.0f32; 8];
        for c in 0..8 {
            let x = d.x[r * 8 + c];
            let rot = if c % 4 < 2 { c + 2 } else { c - 2 };
            let want =
                x * d.w[c] * d.rstd[r] + d.table[(r / 2) * 8 + rot] + d.per[r * 12 + 8 + c % 4];
            assert_eq!(y0[r * 16 + c], want, "row {r} col {c}");
            assert_eq!(y0[r * 16 + 8 + c], -want);
            sq[c] = x * x;
        }
        assert_eq!(y1[r], reference_row_sum(&sq));
    }
}

#[test]
fn a_block_of_rows_gives_the_rows_of_a_whole_run() {
    let rows = 6;
    let d = data(rows);
    let k = mixed_kernel();
    let inputs: [&[f32]; 5] = [&d.x, &d.w, &d.rstd, &d.table, &d.per];
    let mut y0 = vec![0.0f32; rows * 16];
    let mut y1 = vec![0.0f32; rows];
    run(&k, 0, rows, &inputs, &mut [&mut y0, &mut y1]).unwrap();

    let (first, n) = (3, 2);
    let block: [&[f32]; 5] = [
        &d.x[first * 8..(first + n) * 8],
        &d.w,
        &d.rstd[first..first + n],
        &d.table,
        &d.per[first * 12..(first + n) * 12],
    ];
    let mut b0 = vec![0.0f32; n * 16];
    let mut b1 = vec![0.0f32; n];
    run(&k, first, n, &block, &mut [&mut b0, &mut b1]).unwrap();
    assert_eq!(b0, y0[first * 16..(first + n) * 16]);
    assert_eq!(b1, y1[first..first + n]);
}

#[test]
fn unexpanded_invalid_or_mismatched_kernels_are_errors() {
    let rows = 2;
    let d = data(rows);
    let inputs: [&[f32]; 5] = [&d.x, &d.w, &d.rstd, &d.table, &d.per];
    let mut y0 = vec![0.0f32; rows * 16];
    let mut y1 = vec![0.0f32; rows];

    let mut k = mixed_kernel();
    let x = k.graph.load(0, 0);
    let e = k.graph.un(Un::Exp, x);
    k.stores[2].value = k.graph.row_sum(e);
    let err = run(&k, 0, rows, &inputs, &mut [&mut y0, &mut y1]).unwrap_err();
    assert!(err.contains("expand it first"), "{err}");
    assert!(run(&expand(&k), 0, rows, &inputs, &mut [&mut y0, &mut y1]).is_ok());

    let mut k = mixed_kernel();
    k.outputs[0] = Access::Elem { width: 24 };
    let err = run(&k, 0, rows, &inputs, &mut [&mut y0, &mut y1]).unwrap_err();
    assert!(err.contains("invalid kernel"), "{err}");

    let k = mixed_kernel();
    let short: [&[f32]; 5] = [&d.x[..8], &d.w, &d.rstd, &d.table, &d.per];
    let err = run(&k, 0, rows, &short, &mut [&mut y0, &mut y1]).unwrap_err();
    assert!(err.contains("input 0"), "{err}");
    // The table has rows / 2 positions: rows 2..4 need a second one it does not have.
    let err = run(&k, 2, rows, &inputs, &mut [&mut y0, &mut y1]).unwrap_err();
    assert!(err.contains("input 3"), "{err}");
    let err = run(&k, 0, rows, &inputs, &mut [&mut y0]).unwrap_err();
    assert!(err.contains("output slices"), "{err}");
    let mut long = vec![0.0f32; rows + 1];
    let err = run(&k, 0, rows, &inputs, &mut [&mut y0, &mut long]).unwrap_err();
    assert!(err.contains("output 1"), "{err}");
}

#[test]
fn f64_evaluation_computes_composites_in_double_precision() {
    let mut g = Graph::new();
    let x = g.param(0);
    let y = g.param(1);
    let e = g.un(Un::Erf, x);
    let p = g.bin(Bin::Pow, y, x);
    let lt = g.cmp(Cmp::Lt, x, y);
    let s = g.select(lt, e, p);
    let want = libm::erf(0.3);
    assert_eq!(eval_f64(&g, s, &[0.3, 2.0]), want);
    assert_eq!(eval_f64(&g, s, &[3.0, 2.0]), 8.0);
    assert!(eval_f64(&g, NodeId(99), &[]).is_nan());
    assert!(eval_f64(&g, s, &[0.3]).is_nan());
}

/// Throughput of the evaluator on SwiGLU's forward (expanded: sigmoid is ~40 primitives), for
/// the CPU backend's budget: `cargo test --release -p parc-compiler --lib throughput -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement; run in release"]
fn throughput_of_an_expanded_swiglu() {
    let cols = 4096u64;
    let rows = 256usize;
    let mut g = Graph::new();
    let gate = g.load(0, 0);
    let up = g.load(1, 0);
    let s = g.un(Un::Sigmoid, gate);
    let silu = g.bin(Bin::Mul, gate, s);
    let y = g.bin(Bin::Mul, silu, up);
    let k = expand(&Kernel {
        cols,
        inputs: vec![Access::Elem { width: cols }; 2],
        outputs: vec![Access::Elem { width: cols }],
        graph: g,
        stores: vec![Store {
            output: 0,
            col_offset: 0,
            value: y,
        }],
    });
    let n = rows * cols as usize;
    let a: Vec<f32> = (0..n).map(|i| (i as f32 * 1e-3).sin() * 4.0).collect();
    let b: Vec<f32> = (0..n).map(|i| (i as f32 * 7e-4).cos()).collect();
    let mut out = vec![0.0f32; n];
    let start = std::time::Instant::now();
    let reps = 5;
    for _ in 0..reps {
        run(&k, 0, rows, &[&a, &b], &mut [&mut out]).unwrap();
    }
    let per = start.elapsed().as_secs_f64() / (reps * n) as f64;
    println!(
        "swiglu: {} nodes, {:.2} ns per element ({:.2} ns per node-element)",
        k.graph.len(),
        per * 1e9,
        per * 1e9 / k.graph.len() as f64
    );
}

#[test]
#[ignore = "a measurement; run in release"]
fn throughput_per_op() {
    let cols = 4096u64;
    let rows = 64usize;
    let n = rows * cols as usize;
    let a: Vec<f32> = (0..n).map(|i| (i as f32 * 1e-3).sin() * 4.0).collect();
    for op in ["add", "div", "floor", "exp2i", "cmp", "select"] {
        let mut g = Graph::new();
        let mut x = g.load(0, 0);
        let first = x;
        for i in 0..40 {
            let c = g.constant(1.0 + i as f32 * 1e-3);
            x = match op {
                "add" => g.bin(Bin::Add, x, c),
                "div" => g.bin(Bin::Div, x, c),
                "floor" => {
                    let f = g.un(Un::Floor, x);
                    g.bin(Bin::Add, f, c)
                }
                "exp2i" => {
                    let f = g.un(Un::Exp2i, x);
                    g.bin(Bin::Add, f, c)
                }
                _ => {
                    let cmp = g.cmp(Cmp::Lt, x, c);
                    let s = g.select(cmp, x, first);
                    g.bin(Bin::Add, s, c)
                }
            };
        }
        let k = Kernel {
            cols,
            inputs: vec![Access::Elem { width: cols }],
            outputs: vec![Access::Elem { width: cols }],
            graph: g,
            stores: vec![Store {
                output: 0,
                col_offset: 0,
                value: x,
            }],
        };
        let mut out = vec![0.0f32; n];
        let start = std::time::Instant::now();
        run(&k, 0, rows, &[&a], &mut [&mut out]).unwrap();
        let per = start.elapsed().as_secs_f64() / (n * k.graph.len()) as f64;
        println!("{op}: {:.3} ns per node-element", per * 1e9);
    }
}

#[test]
fn the_vectorizable_floor_exp2i_and_exp2bits_give_the_primitives_bits() {
    let mut xs: Vec<f32> = (0..=u32::MAX).step_by(65_537).map(f32::from_bits).collect();
    xs.extend([
        -0.0,
        0.0,
        -0.5,
        0.5,
        -1.0,
        1.0,
        -1.5,
        8_388_607.5,
        -8_388_607.5,
        8_388_608.0,
        -8_388_609.0,
        1e30,
        -1e30,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -126.5,
        127.5,
        200.0,
        -300.0,
    ]);
    for x in xs {
        let exp2bits = {
            let mut out = [0.0f32];
            un(&mut out, Un::Exp2Bits, &[x]);
            out[0]
        };
        let ops = [
            (Un::Floor, floor(x)),
            (Un::Exp2i, exp2i(x)),
            (Un::Exp2Bits, exp2bits),
        ];
        for (op, got) in ops {
            let want = prim::un(op, x);
            let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            assert!(same, "{}({x}) = {got}, prim {want}", op.name());
        }
    }
}
