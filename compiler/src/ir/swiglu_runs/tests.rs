use super::*;
use crate::ir::fp8::{Fp8Format, Fp8HistoryAttrs, Fp8QuantizeAttrs};
use crate::ir::Plan;
use crate::ir::{Buffer, BufferKind, DType};

/// tiny-llama in bf16 with every attention and MLP GEMM in tensorwise FP8 of `fields`.
fn tiny_llama(fields: &str) -> Plan {
    crate::timeline::calibrated::tests::tiny_llama_tensorwise(fields).1
}

fn op_at(program: &Program, at: usize) -> &Op {
    program.instrs[at].op().expect("a compute instruction")
}

/// Under delayed scaling every SwiGLU GEMM heads a run: a forward's one quantization of the
/// gated product, a data gradient's two of dgate and dup (both layouts), each with the record
/// riding on it, right after the GEMM; every quantization of an epilogue's output is in one.
#[test]
fn delayed_scaling_puts_every_quantization_of_a_swiglu_epilogue_in_its_run() {
    let plan = tiny_llama("scaling: delayed");
    let program = &plan.programs[0];
    let runs = find_swiglu_runs(program);
    let producers = (program.instrs.iter())
        .filter(|i| !epilogue_outputs(i).is_empty())
        .count();
    assert!(producers > 0);
    assert_eq!(runs.len(), producers, "every SwiGLU GEMM heads a run");
    for run in &runs {
        let expect = match op_at(program, run.producer) {
            Op::Matmul { .. } => 1,
            _ => 2,
        };
        assert_eq!(run.quantizes.len(), expect, "{run:?}");
        assert_eq!(run.records.len(), expect, "{run:?}");
        let all = run.instructions();
        assert_eq!(
            all,
            (run.producer..run.producer + all.len()).collect::<Vec<_>>()
        );
        for &q in &run.quantizes {
            assert!(matches!(op_at(program, q), Op::Fp8Quantize(_)));
        }
    }
    let absorbed: Vec<usize> = runs.iter().flat_map(|r| r.quantizes.clone()).collect();
    for (at, c) in program.computes() {
        let reads_epilogue = |p: &Instr| {
            c.inputs
                .first()
                .is_some_and(|x| epilogue_outputs(p).contains(x))
        };
        if matches!(*c.op, Op::Fp8Quantize(_))
            && program.instrs[..at]
                .iter()
                .rev()
                .take(8)
                .any(reads_epilogue)
        {
            assert!(
                absorbed.contains(&at),
                "quantization {at} of an epilogue's output is in no run"
            );
        }
    }
}

/// Current scaling computes each scale from the tensor itself, and per-GEMM quantization has no
/// quantize ops: neither forms runs.
#[test]
fn current_scaling_and_per_gemm_quantization_form_no_runs() {
    for fields in ["scaling: current", "scaling: delayed, quantize: per_gemm"] {
        let plan = tiny_llama(fields);
        assert!(find_swiglu_runs(&plan.programs[0]).is_empty(), "{fields}");
    }
}

/// Buffers: 0 x, 1 w, 2 gate; the forward's outputs 7 u and 3 a; 4 a scale amax, 5 a history,
/// 6 q.
fn forward(members: Vec<Instr>) -> Program {
    let buffer = |n: u64, dtype| Buffer {
        name: format!("b{n}"),
        shape: vec![n],
        dtype,
        kind: BufferKind::Activation,
    };
    let buffers = vec![
        buffer(64, DType::F32),
        buffer(64, DType::F32),
        buffer(64, DType::F32),
        buffer(64, DType::F32),
        buffer(1, DType::F32),
        buffer(17, DType::F32),
        buffer(64, DType::Fp8(Fp8Format::E4m3)),
        buffer(64, DType::F32),
    ];
    let gemm = Op::Matmul {
        in_dim: 8,
        out_dim: 8,
        bias: false,
        act: None,
        residual: false,
        swiglu: true,
        fp8: None,
    };
    let mut instrs = vec![Instr::compute(gemm, &[0, 1, 2], &[7, 3])];
    instrs.extend(members);
    Program::new("test", buffers, instrs)
}

fn quantize(x: u32, amax: u32, q: u32) -> Instr {
    let attrs = Fp8QuantizeAttrs {
        format: Fp8Format::E4m3,
        rows: None,
        cols: 8,
        direct: true,
        transposed: false,
    };
    Instr::compute(Op::Fp8Quantize(attrs), &[x, amax], &[q])
}

fn record(x: u32, history: u32) -> Instr {
    let attrs = Fp8HistoryAttrs {
        history: 16,
        rows: None,
        cols: 8,
    };
    Instr::compute(Op::Fp8AmaxRecord(attrs), &[x, history], &[history])
}

/// A quantization of the gated product right after the GEMM is a run with its record; one of
/// the GEMM's plain output, one after another instruction, or one whose scale amax the GEMM
/// writes is not.
#[test]
fn only_quantizations_of_the_epilogue_right_after_it_join() {
    let run = find_swiglu_runs(&forward(vec![record(3, 5), quantize(3, 4, 6)]));
    let expect = SwigluRun {
        producer: 0,
        quantizes: vec![2],
        records: vec![1],
    };
    assert_eq!(run, vec![expect]);
    assert!(find_swiglu_runs(&forward(vec![quantize(7, 4, 6)])).is_empty());
    let between = vec![Instr::compute(Op::Zero, &[], &[0]), quantize(3, 4, 6)];
    assert!(find_swiglu_runs(&forward(between)).is_empty());
    assert!(find_swiglu_runs(&forward(vec![quantize(3, 2, 6)])).is_empty());
    // A record riding on no quantization of the run stays out of it.
    let trailing = find_swiglu_runs(&forward(vec![quantize(3, 4, 6), record(3, 5)]));
    assert_eq!(trailing[0].records, Vec::<usize>::new());
}

/// On tiny-llama under delayed scaling, dgate and dup (a data gradient's epilogue) are read,
/// besides their run, only by quantized FP8 GEMMs at a GEMM operand (the gate and up
/// projections' data and weight gradients). The gated product (a forward's) is too only where
/// the backward's weight gradient is near enough to share the forward's quantization (the last
/// layer); elsewhere the backward quantizes it again, transposed.
#[test]
fn dgate_and_dup_of_tiny_llama_are_read_only_by_quantized_gemms() {
    let plan = tiny_llama("scaling: delayed");
    let program = &plan.programs[0];
    let runs = find_swiglu_runs(program);
    assert!(!runs.is_empty());
    for run in &runs {
        let outputs = epilogue_outputs(&program.instrs[run.producer]);
        let readers = quantized_readers(program, run);
        assert_eq!(readers.len(), outputs.len(), "{run:?}");
        let forward = matches!(op_at(program, run.producer), Op::Matmul { .. });
        for (y, gemms) in outputs.iter().zip(&readers) {
            let Some(gemms) = gemms else {
                assert!(forward, "{y:?} of {run:?} has other readers");
                continue;
            };
            assert!(gemms.len() >= 2, "{y:?}: {gemms:?}");
            for &g in gemms {
                let op = op_at(program, g);
                assert!(op.fp8().is_some_and(|f| f.quantized), "{g}: {op:?}");
            }
        }
    }
}

/// A reader other than a quantized GEMM operand keeps the tensor: any other op, or a GEMM that
/// reads it exactly (unquantized, or as a bias gradient's dy).
#[test]
fn any_other_reader_keeps_an_epilogue_output() {
    let run = |extra: Instr| {
        let program = forward(vec![record(3, 5), quantize(3, 4, 6), extra]);
        let runs = find_swiglu_runs(&program);
        quantized_readers(&program, &runs[0])
    };
    assert_eq!(run(Instr::compute(Op::Zero, &[], &[0])), vec![Some(vec![])]);
    assert_eq!(run(Instr::compute(Op::Copy, &[3], &[0])), vec![None]);
    let weight_grad = |bias: bool, fp8: Option<crate::ir::fp8::Fp8Gemm>| Op::MatmulBwdWeight {
        in_dim: 8,
        out_dim: 8,
        bias,
        accumulate_param_grad: false,
        fp8,
    };
    let plain = Instr::compute(weight_grad(false, None), &[3, 0], &[1]);
    assert_eq!(run(plain), vec![None]);
}
