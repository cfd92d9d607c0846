//! The per-position layers: embeddings and learned positions, layer and RMS norms, rotary
//! embeddings, each forward and backward, with f32 buffers and with bf16 storage.
use crate::harness::{
    check, check_on, check_variant, seg, Case, Data, Rng, BF16_STORED, ELEMENTWISE, REDUCTION,
};
use parc_compiler::ir::op::Op;
use parc_compiler::ir::op::{EmbeddingAttrs, PositionAttrs, RopeAttrs, RopeScaling};
use parc_compiler::spec::Precision;
use parc_runtime::cpu::CpuBackend;

#[test]
fn embeddings_and_positions() {
    let mut r = Rng::new("embeddings_and_positions");
    check("embeddings_and_positions", &embedding_cases(&mut r));
}

#[test]
fn norms() {
    let mut r = Rng::new("norms");
    check("norms", &norm_cases(&mut r, &NORM_SHAPES));
}

#[test]
fn rope() {
    let mut r = Rng::new("rope");
    check("rope", &rope_cases(&mut r));
}

/// RoPE with Llama 3.2's published scaling (and linear scaling, backward), beside the plain
/// cases above, and the rotation table fused kernels read. Head dim 16 at theta 500000 has
/// wavelengths from 6 to 608000: Llama 3's rule keeps pairs 0–3 (under 2048), blends pair 4
/// (4443) and divides pairs 5–7 by 32; at positions near 1000 each of the three differs from
/// plain RoPE by far more than the tolerance, so a kernel that ignored the scaling, or any one
/// branch of it, fails here.
#[test]
fn scaled_rope() {
    let mut r = Rng::new("scaled_rope");
    check("scaled_rope", &scaled_rope_cases(&mut r));
}

fn scaled_rope_cases(r: &mut Rng) -> Vec<Case> {
    let llama3 = RopeScaling::Llama3 {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192,
    };
    let attrs = |heads, scaling| RopeAttrs {
        batch: 2,
        heads,
        head_dim: 16,
        theta: 500000.0,
        scaling,
        positions: vec![seg(0, 5), seg(1000, 5)],
        rotary_dim: None,
    };
    let n = 10 * 2 * 3 * 16;
    let linear = RopeScaling::Linear { factor: 4.0 };
    // A partial RoPE: the first 4 of each head's 16 features turn, the other 12 are copied.
    let partial = |heads, scaling| RopeAttrs {
        rotary_dim: Some(4),
        ..attrs(heads, scaling)
    };
    let rotations = [
        ("rope llama3", Op::Rope(attrs(3, llama3))),
        ("rope_bwd llama3", Op::RopeBwd(attrs(3, llama3))),
        ("rope_bwd linear", Op::RopeBwd(attrs(3, linear))),
        ("rope partial", Op::Rope(partial(3, RopeScaling::None))),
        ("rope_bwd partial llama3", Op::RopeBwd(partial(3, llama3))),
    ];
    let mut cases: Vec<Case> = rotations
        .into_iter()
        .map(|(name, op)| {
            let x = vec![Data::F32(r.vec(n, 1.0))];
            Case::new(name, op, x, vec![r.vec(n, 1.0)], ELEMENTWISE)
        })
        .collect();
    // The table: 10 positions × 2 · head_dim columns, no inputs.
    let table = Op::RopeTable(attrs(1, llama3));
    cases.push(Case::new(
        "rope_table llama3",
        table,
        Vec::new(),
        vec![r.vec(10 * 32, 1.0)],
        ELEMENTWISE,
    ));
    cases.push(Case::new(
        "rope_table partial",
        Op::RopeTable(partial(1, RopeScaling::None)),
        Vec::new(),
        vec![r.vec(10 * 32, 1.0)],
        ELEMENTWISE,
    ));
    cases
}

/// Every layer op with its float operands (activations, their gradients) stored in bf16 on
/// both backends (tables too, as a bf16 run keeps them): embedding and position-add forwards only round what both compute the same
/// way (exact); gradients into fp32 tables keep the reduction tolerance; norms and RoPE
/// within one bf16 step.
#[test]
fn layers_bf16_storage() {
    let mut r = Rng::new("layers_bf16_storage");
    let mut all: Vec<Case> = Vec::new();
    for case in embedding_cases(&mut r) {
        let tol = if case.name().ends_with("_bwd") {
            REDUCTION
        } else {
            0.0
        };
        all.push(case.stored_bf16(tol));
    }
    let rest = norm_cases(&mut r, &NORM_SHAPES)
        .into_iter()
        .chain(rope_cases(&mut r));
    all.extend(rest.map(|case| case.stored_bf16(BF16_STORED)));
    check_on("layers_bf16_storage", &all, Precision::Bf16);
}

fn embedding_cases(r: &mut Rng) -> Vec<Case> {
    let (rows, dim, vocab_start, vocab_local) = (37, 24, 5u64, 20u64);
    let ids = r.ids(rows, 30);
    let table = r.vec(vocab_local as usize * dim, 1.0);
    let emb = Op::Embedding(EmbeddingAttrs {
        vocab_start,
        vocab_local,
        dim: dim as u64,
    });
    let emb_bwd = Op::EmbeddingBwd(EmbeddingAttrs {
        vocab_start,
        vocab_local,
        dim: dim as u64,
    });
    // Context-parallel-like chunk: two segments of the global sequence, batch 3.
    let positions = vec![seg(0, 4), seg(12, 4)];
    let (batch, seq_table) = (3usize, 16usize);
    let prow = 8 * batch;
    let pos_add = Op::PositionAdd(PositionAttrs {
        batch: batch as u64,
        dim: dim as u64,
        positions: positions.clone(),
    });
    let pos_bwd = Op::PositionAddBwd {
        pos: PositionAttrs {
            batch: batch as u64,
            dim: dim as u64,
            positions,
        },
        accumulate_param_grad: true,
    };
    vec![
        Case::new(
            "embedding",
            emb,
            vec![Data::I32(ids.clone()), Data::F32(table.clone())],
            vec![r.vec(rows * dim, 1.0)],
            ELEMENTWISE,
        ),
        Case::new(
            "embedding_bwd",
            emb_bwd,
            vec![Data::I32(ids), Data::F32(r.vec(rows * dim, 1.0))],
            vec![r.vec(table.len(), 1.0)],
            REDUCTION,
        ),
        Case::new(
            "position_add",
            pos_add,
            vec![
                Data::F32(r.vec(prow * dim, 1.0)),
                Data::F32(r.vec(seq_table * dim, 1.0)),
            ],
            vec![r.vec(prow * dim, 1.0)],
            ELEMENTWISE,
        ),
        Case::new(
            "position_add_bwd",
            pos_bwd.clone(),
            vec![Data::F32(r.vec(prow * dim, 1.0))],
            vec![r.vec(seq_table * dim, 1.0)],
            REDUCTION,
        ),
        // A first contribution overwrites the random table (rows at no position: zero).
        Case::new(
            "position_add_bwd overwrite",
            pos_bwd.with_param_grad_accumulation(false),
            vec![Data::F32(r.vec(prow * dim, 1.0))],
            vec![r.vec(seq_table * dim, 1.0)],
            REDUCTION,
        ),
    ]
}

/// (rows, dim) of the norm tests: the default kernels take dims that are multiples of 8 up to
/// 8,192 (1000 leaves some lanes without a last vector; 1040 is split over two warps a row,
/// some threads without a last vector), the `warp` kernels 20 (their scalar loops); 300, 600
/// and 33,000 rows split the weight gradient into several row bands (33,000: all 128, of 258
/// rows). Qwen3's per-head q/k norms run rows of head_dim, one per head and token: 4,100 rows
/// of 128 (half of each warp's lanes hold a vector; the shared weight's gradient summed
/// over 128 bands).
const NORM_SHAPES: [(usize, usize); 7] = [
    (13, 96),
    (5, 1000),
    (300, 20),
    (600, 64),
    (40, 1040),
    (33_000, 8),
    (4_100, 128),
];

/// NORM_SHAPES, GPT-2's widths and Llama's for the norm variants (`norm_variants`). One warp a
/// row: 768 and 1024 with odd row counts, so the fused backward's bands of rows end mid-band
/// and mid-warp (4,099 rows: 125 bands of 33, the last of 7), and 1000 gives lanes without a
/// last vector. Split over a row group of W warps (the `*_wide` kernels, rows past 1,024):
/// 1536 and 2048 (W 2, 4 rows a block: 37 rows leave the last block one), 3000 (W 3, 375
/// vectors over 96 threads: some without a last one), 4096 (W 4) and 8192 (W 8, one row a
/// block); in the backward 1,031 × 1536 gives bands of 9 rows over 4 groups (3, 2, 2, 2 rows,
/// so a group prefetches its next row; the last band 5) and 133 × 8192 bands of 2 over one
/// group (the last of 1). 20 (odd multiple of 4) and 8200 (too wide) take the `warp` kernels.
const VARIANT_SHAPES: [(usize, usize); 18] = [
    (13, 96),
    (5, 1000),
    (300, 20),
    (600, 64),
    (40, 1040),
    (33_000, 8),
    (4_100, 128),
    (37, 768),
    (1537, 768),
    (4099, 1024),
    (37, 1536),
    (1031, 1536),
    (37, 2048),
    (37, 3000),
    (11, 4096),
    (5, 8192),
    (133, 8192),
    (3, 8200),
];

/// The norm kernel variants (PARC_NORM_FWD_KERNEL=multirow, PARC_NORM_BWD_KERNEL=fused)
/// against the CPU on every norm case, f32 and bf16-stored, with the `norms` and
/// `layers_bf16_storage` tolerances.
#[test]
fn norm_variants() {
    for variant in [("norm_fwd", "multirow"), ("norm_bwd", "fused")] {
        let test = format!("norm_variants {}={}", variant.0, variant.1);
        let mut r = Rng::new(&test);
        check_variant(
            &test,
            &norm_cases(&mut r, &VARIANT_SHAPES),
            Precision::Fp32,
            variant,
        );
        let bf16: Vec<Case> = norm_cases(&mut r, &VARIANT_SHAPES)
            .into_iter()
            .map(|case| case.stored_bf16(BF16_STORED))
            .collect();
        check_variant(&format!("{test} bf16"), &bf16, Precision::Bf16, variant);
    }
}

fn norm_cases(r: &mut Rng, shapes: &[(usize, usize)]) -> Vec<Case> {
    let mut cases = Vec::new();
    for &(rows, dim) in shapes {
        let x = r.vec(rows * dim, 2.0);
        let w = r.vec(dim, 1.0);
        let bias = r.vec(dim, 1.0);
        let dy = r.vec(rows * dim, 1.0);
        for with_bias in [false, true] {
            let mut ins = vec![Data::F32(x.clone()), Data::F32(w.clone())];
            if with_bias {
                ins.push(Data::F32(bias.clone()));
            }
            let ln = Op::LayerNorm {
                dim: dim as u64,
                eps: 1e-5,
                bias: with_bias,
            };
            let outs = vec![r.vec(rows * dim, 1.0), r.vec(rows, 1.0), r.vec(rows, 1.0)];
            let fwd = Case::new(
                format!("layer_norm {rows}x{dim} bias={with_bias}"),
                ln.clone(),
                ins.clone(),
                outs,
                REDUCTION,
            );
            // The backward takes mean/rstd from the CPU forward.
            let stats = fwd.run(&mut CpuBackend::new());
            let bwd_ins = vec![
                Data::F32(dy.clone()),
                Data::F32(x.clone()),
                Data::F32(w.clone()),
                Data::F32(stats[1].clone()),
                Data::F32(stats[2].clone()),
            ];
            cases.push(fwd);
            // dx, dw, db start random: accumulate adds into dx, accumulate_param_grad into
            // dw and db; otherwise they are overwritten.
            for (accumulate, param) in [(false, true), (true, true), (false, false), (true, false)]
            {
                let mut bwd_outs = vec![r.vec(rows * dim, 1.0), r.vec(dim, 1.0)];
                if with_bias {
                    bwd_outs.push(r.vec(dim, 1.0));
                }
                cases.push(Case::new(
                    format!(
                        "layer_norm_bwd {rows}x{dim} bias={with_bias} accumulate={accumulate} \
                         accumulate_param_grad={param}"
                    ),
                    Op::LayerNormBwd {
                        dim: dim as u64,
                        bias: with_bias,
                        accumulate,
                        accumulate_param_grad: param,
                    },
                    bwd_ins.clone(),
                    bwd_outs,
                    REDUCTION,
                ));
            }
        }
        let rms = Case::new(
            format!("rms_norm {rows}x{dim}"),
            Op::RmsNorm {
                dim: dim as u64,
                eps: 1e-6,
            },
            vec![Data::F32(x.clone()), Data::F32(w.clone())],
            vec![r.vec(rows * dim, 1.0), r.vec(rows, 1.0)],
            REDUCTION,
        );
        let rstd = rms.run(&mut CpuBackend::new())[1].clone();
        cases.push(rms);
        for (accumulate, param) in [(false, true), (true, true), (false, false), (true, false)] {
            let ins = [&dy, &x, &w, &rstd].map(|v| Data::F32(v.clone()));
            cases.push(Case::new(
                format!(
                    "rms_norm_bwd {rows}x{dim} accumulate={accumulate} \
                     accumulate_param_grad={param}"
                ),
                Op::RmsNormBwd {
                    dim: dim as u64,
                    accumulate,
                    accumulate_param_grad: param,
                },
                ins.to_vec(),
                vec![r.vec(rows * dim, 1.0), r.vec(dim, 1.0)],
                REDUCTION,
            ));
        }
    }
    cases
}

fn rope_cases(r: &mut Rng) -> Vec<Case> {
    let positions = vec![seg(0, 5), seg(1000, 5)];
    let (batch, heads, head_dim) = (2u64, 3u64, 16u64);
    let n = (10 * batch * heads * head_dim) as usize;
    let fwd = Op::Rope(RopeAttrs {
        batch,
        heads,
        head_dim,
        theta: 10000.0,
        scaling: RopeScaling::None,
        positions: positions.clone(),
        rotary_dim: None,
    });
    let bwd = Op::RopeBwd(RopeAttrs {
        batch,
        heads,
        head_dim,
        theta: 500000.0,
        scaling: RopeScaling::None,
        positions,
        rotary_dim: None,
    });
    vec![
        Case::new(
            "rope",
            fwd,
            vec![Data::F32(r.vec(n, 1.0))],
            vec![r.vec(n, 1.0)],
            ELEMENTWISE,
        ),
        Case::new(
            "rope_bwd",
            bwd,
            vec![Data::F32(r.vec(n, 1.0))],
            vec![r.vec(n, 1.0)],
            ELEMENTWISE,
        ),
    ]
}
