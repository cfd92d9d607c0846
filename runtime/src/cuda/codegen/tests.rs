#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::{shape, source, Shape};
use parc_compiler::ir::DType;
use parc_compiler::kir::{Access, Kernel};

pub(crate) use crate::cpu::fused::tests::fixtures;

/// The operand types of `kernel` with every `Elem` operand `elem`.
pub(crate) fn dtypes(kernel: &Kernel, elem: DType) -> Vec<DType> {
    let of = |a: &Access| match a {
        Access::Elem { .. } => elem,
        _ => DType::F32,
    };
    kernel
        .inputs
        .iter()
        .chain(&kernel.outputs)
        .map(of)
        .collect()
}

#[test]
fn fixtures_are_valid_expanded_kernels() {
    for (cols, hd) in [(64, 16), (42, 14)] {
        for (name, k) in fixtures::primitive(cols, hd) {
            assert_eq!(k.validate(), Ok(()), "{name} {cols}");
            assert!(k.is_expanded(), "{name}");
        }
    }
}

#[test]
fn shapes_follow_the_accesses_and_widths() {
    assert_eq!(shape(&fixtures::arith(37)), Shape::Flat);
    assert_eq!(shape(&fixtures::copy(64)), Shape::Flat);
    assert_eq!(shape(&fixtures::columns(64)), Shape::Rows(8));
    assert_eq!(shape(&fixtures::columns(44)), Shape::Rows(4));
    assert_eq!(shape(&fixtures::columns(42)), Shape::Rows(2));
    assert_eq!(shape(&fixtures::columns(37)), Shape::Rows(1));
    assert_eq!(shape(&fixtures::rope(64, 16)), Shape::Rows(8));
    // Half a head of 7 columns: vectors would straddle the rotation.
    assert_eq!(shape(&fixtures::rope(42, 14)), Shape::Rows(1));
    // Turned halves of 4 columns in heads of 16: vectors of 4 lie in one region each.
    assert_eq!(shape(&fixtures::partial_rope(64, 16)), Shape::Rows(4));
    // Of 3 (6 of 14 turn): a vector would straddle the rotation.
    assert_eq!(shape(&fixtures::partial_rope(42, 14)), Shape::Rows(1));
    assert_eq!(shape(&fixtures::row_col(64)), Shape::Rows(8));
    assert_eq!(shape(&fixtures::rms(64)), Shape::Reduce);
    assert_eq!(shape(&fixtures::layer(64)), Shape::Reduce);
}

#[test]
fn sources_follow_the_abi() {
    let k = fixtures::arith(64);
    let src = source(&k, &dtypes(&k, DType::Bf16)).unwrap();
    assert!(src.contains(
        "extern \"C\" __global__ void parc_fused(const unsigned short* __restrict__ in0, \
         const unsigned short* __restrict__ in1, unsigned short* __restrict__ out0, \
         unsigned short* __restrict__ out1, long long rows)"
    ));
    // 16-byte vectors of bf16 where aligned; rounded once, correctly.
    assert!(src.contains("uint4"), "{src}");
    for f in [
        "__fadd_rn",
        "__fsub_rn",
        "__fmul_rn",
        "__fdiv_rn",
        "__fsqrt_rn",
        "floorf",
    ] {
        assert!(src.contains(f), "{f} missing:\n{src}");
    }
    let k = fixtures::row_col(64);
    let src = source(&k, &dtypes(&k, DType::F32)).unwrap();
    assert!(src.contains("const float* __restrict__ in1"), "{src}");
    assert!(src.contains("if (c == 0) out1[r]"), "{src}");
    // Row sums: a row per warp, the lane's 8 columns of each 256-column chunk as 16-byte
    // vectors where aligned (else one at a time), the warp's total in kir's order.
    let k = fixtures::layer(64);
    let src = source(&k, &dtypes(&k, DType::F32)).unwrap();
    assert_eq!(src.matches("parc_warp_total(acc").count(), 2, "{src}");
    assert!(src.contains("r += warps"), "{src}");
    assert!(
        src.contains("const long long c = j * 256LL + lane * 8LL;"),
        "{src}"
    );
    assert!(src.contains("if (vec) {"), "{src}");
    assert!(
        src.contains("float4 q0_1 = *(const float4*)(in0 + (r * 64LL + 0LL + c) + 4);"),
        "{src}"
    );
    // Both inputs are read again by the second sum and the stores: kept in registers (2
    // inputs × 1 chunk × 8 words), saved by the first pass and reused by the later ones.
    assert!(
        src.contains("float4 keep0[2];") && src.contains("float4 keep1[2];"),
        "{src}"
    );
    assert_eq!(src.matches("keep0[2 * j + 1] = q0_1;").count(), 1, "{src}");
    assert_eq!(
        src.matches("const float4 q0_1 = keep0[2 * j + 1];").count(),
        2,
        "{src}"
    );
    // 2048 bf16 columns: the row kept (8 chunks of one uint4), its loads unrolled.
    let k = fixtures::rms(2048);
    let src = source(&k, &dtypes(&k, DType::Bf16)).unwrap();
    assert!(
        src.contains("uint4 keep0[8];") && src.contains("const uint4 q0 = keep0[j];"),
        "{src}"
    );
    assert!(
        src.contains("#pragma unroll\n        for (int j = 0; j < 8; ++j)"),
        "{src}"
    );
    // Too wide to keep (9000 f32 columns: 36 chunks): read again, partly unrolled; 9000 is a
    // multiple of 8, so vectors; 42 columns are not, so one column at a time only.
    let k = fixtures::rms(9000);
    let src = source(&k, &dtypes(&k, DType::F32)).unwrap();
    assert!(!src.contains("keep"), "{src}");
    assert!(src.contains("#pragma unroll 4\n"), "{src}");
    let k = fixtures::rms(42);
    let src = source(&k, &dtypes(&k, DType::Bf16)).unwrap();
    assert!(!src.contains("vec") && !src.contains("keep"), "{src}");
    assert!(
        src.contains("const long long c = j * 256LL + lane * 8LL + k;"),
        "{src}"
    );
}

#[test]
fn bad_kernels_and_operand_types_are_refused() {
    let k = fixtures::swiglu(64);
    let e = source(&k, &dtypes(&k, DType::F32)).unwrap_err();
    assert!(e.contains("expand"), "{e}");
    let k = fixtures::row_col(64);
    let mut d = dtypes(&k, DType::F32);
    d[1] = DType::Bf16;
    let e = source(&k, &d).unwrap_err();
    assert!(e.contains("operand 1") && e.contains("bf16"), "{e}");
    let e = source(&k, &d[1..]).unwrap_err();
    assert!(e.contains("operand types"), "{e}");
    let mut bad = fixtures::arith(64);
    bad.stores.pop();
    let e = source(&bad, &dtypes(&bad, DType::F32)).unwrap_err();
    assert!(e.contains("output 1"), "{e}");
}

#[test]
fn bf16_vectors_are_packed_by_cvt_with_nans_rounded_exactly() {
    // A flat kernel's vector of 8: a cvt.rn.bf16x2 a pair; the NaN test of all 8 values guards
    // the exact rounding of a NaN's half; the scalar tail rounds exactly.
    let k = fixtures::copy(64);
    let src = source(&k, &dtypes(&k, DType::Bf16)).unwrap();
    assert!(
        src.contains("asm(\"cvt.rn.bf16x2.f32 %0, %1, %2;\" : \"=r\"(w) : \"f\"(b), \"f\"(a));"),
        "{src}"
    );
    assert!(
        src.contains(
            "uint4 w = make_uint4(parc_pack_rn(v0_0, v0_1), parc_pack_rn(v0_2, v0_3), \
             parc_pack_rn(v0_4, v0_5), parc_pack_rn(v0_6, v0_7));"
        ),
        "{src}"
    );
    assert!(
        src.contains(
            "if (__builtin_expect(!(v0_0 == v0_0 && v0_1 == v0_1 && v0_2 == v0_2 && \
             v0_3 == v0_3 && v0_4 == v0_4 && v0_5 == v0_5 && v0_6 == v0_6 && v0_7 == v0_7), 0)) \
             w = make_uint4(parc_fix_nan(w.x, v0_0, v0_1), parc_fix_nan(w.y, v0_2, v0_3), \
             parc_fix_nan(w.z, v0_4, v0_5), parc_fix_nan(w.w, v0_6, v0_7));"
        ),
        "{src}"
    );
    assert!(src.contains("out0[e] = parc_round(v0_0);"), "{src}");
    // Row kernels' vectors of 4 and 2 columns: two words, one.
    let k = fixtures::columns(44);
    let src = source(&k, &dtypes(&k, DType::Bf16)).unwrap();
    assert!(src.contains("uint2 w = make_uint2(parc_pack_rn("), "{src}");
    assert!(src.contains("w = make_uint2(parc_fix_nan(w.x, "), "{src}");
    let k = fixtures::columns(42);
    let src = source(&k, &dtypes(&k, DType::Bf16)).unwrap();
    assert!(src.contains("unsigned int w = (parc_pack_rn("), "{src}");
    assert!(src.contains("w = (parc_fix_nan(w, "), "{src}");
    // f32 outputs are stored as they are.
    let k = fixtures::copy(64);
    let src = source(&k, &dtypes(&k, DType::F32)).unwrap();
    assert!(!src.contains("parc_pack_rn(v"), "{src}");
}
