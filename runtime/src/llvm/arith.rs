//! The primitive ops of `kir::prim` as LLVM instructions, each exactly its Rust definition:
//! IEEE f32 instructions without fast-math flags (so the NVPTX backend emits `add.rn`-style
//! rounding, `div.rn.f32`, `sqrt.rn.f32`, no contraction into `fma`, no flush to zero), the
//! IR's own fused multiply-add as `llvm.fma.f32` (`fma.rn.f32`, rounded once, as
//! `f32::mul_add`), the bit-level ops (`exp2i`, `exp2bits`, `exponent`, `mantissa`) as integer
//! arithmetic on the bits, and bf16 storage as integer ops (widen: shift left 16; round:
//! nearest-even as `round_bf16` of runtime/src/cuda/kernels/common.cuh), so no PTX bf16
//! instruction is needed.
use super::{Ir, Llvm};
use crate::error::{Result, RuntimeError};
use inkwell::intrinsics::Intrinsic;
use inkwell::types::BasicTypeEnum;
use inkwell::values::{BasicMetadataValueEnum, BasicValueEnum, FloatValue, IntValue};
use inkwell::{FloatPredicate, IntPredicate};
use parc_compiler::kir::{Bin, Cmp, Un};

impl<'ctx> Ir<'_, 'ctx> {
    /// The f32 constant with these bits (NaN payloads included).
    pub fn f32_bits(&self, bits: u32) -> Result<FloatValue<'ctx>> {
        self.float_of_bits(self.i32(bits))
    }

    pub fn f32(&self, value: f32) -> Result<FloatValue<'ctx>> {
        self.f32_bits(value.to_bits())
    }

    pub fn i32(&self, value: u32) -> IntValue<'ctx> {
        self.ctx.i32_type().const_int(u64::from(value), false)
    }

    pub fn i64(&self, value: u64) -> IntValue<'ctx> {
        self.ctx.i64_type().const_int(value, false)
    }

    /// `kir::prim::un`.
    pub fn un(&self, op: Un, x: FloatValue<'ctx>) -> Result<FloatValue<'ctx>> {
        let b = self.b;
        match op {
            Un::Neg => b.build_float_neg(x, "neg").llvm(),
            Un::Abs => self.float_intrinsic("llvm.fabs", x),
            Un::Sqrt => self.float_intrinsic("llvm.sqrt", x),
            Un::Floor => self.float_intrinsic("llvm.floor", x),
            Un::Exp2i => self.exp2i(x),
            Un::Exp2Bits => {
                let bits = b.build_left_shift(self.bits(x)?, self.i32(23), "e").llvm()?;
                self.float_of_bits(bits)
            }
            Un::Exponent => {
                let field = b.build_right_shift(self.bits(x)?, self.i32(23), false, "e").llvm()?;
                let field = b.build_and(field, self.i32(0xff), "e").llvm()?;
                let e = b.build_int_sub(field, self.i32(127), "e").llvm()?;
                b.build_signed_int_to_float(e, self.ctx.f32_type(), "exponent").llvm()
            }
            Un::Mantissa => {
                let m = b.build_and(self.bits(x)?, self.i32(0x807f_ffff), "m").llvm()?;
                self.float_of_bits(b.build_or(m, self.i32(0x3f80_0000), "mantissa").llvm()?)
            }
            composite => Err(RuntimeError::Unsupported(format!(
                "the LLVM emitter implements primitive ops only; `{}` must be expanded first (kir::expand)",
                composite.name()
            ))),
        }
    }

    /// `kir::prim::exp2i`: Rust's `k.clamp(-126, 127) as i32` (NaN stays NaN through the clamp
    /// and converts to 0, as the saturating conversion does), then the exponent field.
    fn exp2i(&self, k: FloatValue<'ctx>) -> Result<FloatValue<'ctx>> {
        let b = self.b;
        let (lo, hi) = (self.f32(-126.0)?, self.f32(127.0)?);
        let below = b
            .build_float_compare(FloatPredicate::OLT, k, lo, "below")
            .llvm()?;
        let k = b.build_select(below, lo, k, "k").llvm()?.into_float_value();
        let above = b
            .build_float_compare(FloatPredicate::OGT, k, hi, "above")
            .llvm()?;
        let k = b.build_select(above, hi, k, "k").llvm()?;
        let i32_ty = self.ctx.i32_type();
        let fptosi = Intrinsic::find("llvm.fptosi.sat")
            .ok_or_else(|| missing("llvm.fptosi.sat"))?
            .get_declaration(self.module, &[i32_ty.into(), self.ctx.f32_type().into()])
            .ok_or_else(|| missing("llvm.fptosi.sat.i32.f32"))?;
        let k = self.call(fptosi, &[k.into()])?.into_int_value();
        let biased = b.build_int_add(k, self.i32(127), "biased").llvm()?;
        self.float_of_bits(b.build_left_shift(biased, self.i32(23), "exp2i").llvm()?)
    }

    /// `kir::prim::bin`.
    pub fn bin(
        &self,
        op: Bin,
        x: FloatValue<'ctx>,
        y: FloatValue<'ctx>,
    ) -> Result<FloatValue<'ctx>> {
        let b = self.b;
        match op {
            Bin::Add => b.build_float_add(x, y, "add").llvm(),
            Bin::Sub => b.build_float_sub(x, y, "sub").llvm(),
            Bin::Mul => b.build_float_mul(x, y, "mul").llvm(),
            Bin::Div => b.build_float_div(x, y, "div").llvm(),
            composite => Err(RuntimeError::Unsupported(format!(
                "the LLVM emitter implements primitive ops only; `{}` must be expanded first (kir::expand)",
                composite.name()
            ))),
        }
    }

    /// `kir::prim::cmp`: Rust's comparisons, ordered except `!=` (true when either is NaN).
    pub fn cmp(&self, op: Cmp, x: FloatValue<'ctx>, y: FloatValue<'ctx>) -> Result<IntValue<'ctx>> {
        let predicate = match op {
            Cmp::Lt => FloatPredicate::OLT,
            Cmp::Le => FloatPredicate::OLE,
            Cmp::Gt => FloatPredicate::OGT,
            Cmp::Ge => FloatPredicate::OGE,
            Cmp::Eq => FloatPredicate::OEQ,
            Cmp::Ne => FloatPredicate::UNE,
        };
        self.b
            .build_float_compare(predicate, x, y, op.name())
            .llvm()
    }

    /// The f32 value of a bf16 bit pattern (an i16): exact.
    pub fn widen_bf16(&self, h: IntValue<'ctx>) -> Result<FloatValue<'ctx>> {
        let b = self.b;
        let wide = b.build_int_z_extend(h, self.ctx.i32_type(), "h").llvm()?;
        self.float_of_bits(b.build_left_shift(wide, self.i32(16), "widened").llvm()?)
    }

    /// `x` rounded to the nearest bf16, ties to even, as an i16 bit pattern: NaN stays a quiet
    /// NaN, `(u + 0x7fff + ((u >> 16) & 1)) >> 16` otherwise (common.cuh's `round_bf16`).
    pub fn round_bf16(&self, x: FloatValue<'ctx>) -> Result<IntValue<'ctx>> {
        let b = self.b;
        let u = self.bits(x)?;
        let magnitude = b.build_and(u, self.i32(0x7fff_ffff), "mag").llvm()?;
        let nan = b
            .build_int_compare(IntPredicate::UGT, magnitude, self.i32(0x7f80_0000), "nan")
            .llvm()?;
        let high = b.build_right_shift(u, self.i32(16), false, "high").llvm()?;
        let quiet = b.build_or(high, self.i32(0x40), "quiet").llvm()?;
        let odd = b.build_and(high, self.i32(1), "odd").llvm()?;
        let bias = b.build_int_add(odd, self.i32(0x7fff), "bias").llvm()?;
        let sum = b.build_int_add(u, bias, "biased").llvm()?;
        let rounded = b
            .build_right_shift(sum, self.i32(16), false, "rounded")
            .llvm()?;
        let bits = b
            .build_select(nan, quiet, rounded, "bf16")
            .llvm()?
            .into_int_value();
        b.build_int_truncate(bits, self.ctx.i16_type(), "bf16")
            .llvm()
    }

    fn bits(&self, x: FloatValue<'ctx>) -> Result<IntValue<'ctx>> {
        let bits = self
            .b
            .build_bit_cast(x, self.ctx.i32_type(), "bits")
            .llvm()?;
        Ok(bits.into_int_value())
    }

    fn float_of_bits(&self, bits: IntValue<'ctx>) -> Result<FloatValue<'ctx>> {
        let x = self
            .b
            .build_bit_cast(bits, self.ctx.f32_type(), "f")
            .llvm()?;
        Ok(x.into_float_value())
    }

    /// An overloaded f32 intrinsic of one operand (`llvm.sqrt`, `llvm.fabs`, `llvm.floor`).
    fn float_intrinsic(&self, name: &str, x: FloatValue<'ctx>) -> Result<FloatValue<'ctx>> {
        let f32_ty: BasicTypeEnum = self.ctx.f32_type().into();
        let f = Intrinsic::find(name)
            .ok_or_else(|| missing(name))?
            .get_declaration(self.module, &[f32_ty])
            .ok_or_else(|| missing(name))?;
        Ok(self.call(f, &[x.into()])?.into_float_value())
    }

    /// `a · b + c` rounded once (`llvm.fma.f32`: `fma.rn.f32` in PTX; `kir::prim::fma`).
    pub fn fma(
        &self,
        a: FloatValue<'ctx>,
        b: FloatValue<'ctx>,
        c: FloatValue<'ctx>,
    ) -> Result<FloatValue<'ctx>> {
        let f32_ty: BasicTypeEnum = self.ctx.f32_type().into();
        let name = "llvm.fma";
        let f = Intrinsic::find(name)
            .ok_or_else(|| missing(name))?
            .get_declaration(self.module, &[f32_ty])
            .ok_or_else(|| missing(name))?;
        Ok(self
            .call(f, &[a.into(), b.into(), c.into()])?
            .into_float_value())
    }

    /// A call that returns a value.
    pub fn call(
        &self,
        f: inkwell::values::FunctionValue<'ctx>,
        args: &[BasicMetadataValueEnum<'ctx>],
    ) -> Result<BasicValueEnum<'ctx>> {
        match self
            .b
            .build_call(f, args, "call")
            .llvm()?
            .try_as_basic_value()
        {
            inkwell::values::ValueKind::Basic(v) => Ok(v),
            inkwell::values::ValueKind::Instruction(_) => Err(super::llvm_error(format!(
                "{} returns nothing",
                f.get_name().to_string_lossy()
            ))),
        }
    }
}

fn missing(name: &str) -> RuntimeError {
    super::llvm_error(format!("LLVM 19 has no intrinsic {name}"))
}
