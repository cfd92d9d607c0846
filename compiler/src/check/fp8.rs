//! `train.fp8`: the FP8 recipe as written. What it means for the plan (which layers, whether
//! its scale groups stay within a rank, the GPU and precision it needs) is `crate::fp8`'s.
//!
//! ```text
//! fp8 = blockwise                                   // 128-element blocks, E4M3 gradients
//! fp8 = blockwise { block_size: 64, grad: e5m2 }
//! fp8 = rowwise { bf16: [head, blocks.0], fp8: [MLP] }
//! fp8 = tensorwise { scaling: current }             // this step's amaxes (the default)
//! fp8 = tensorwise { scaling: delayed, history: 16 } // amax history of 16 steps (E1205)
//! fp8 = tensorwise { quantize: per_gemm }          // each GEMM quantizes its operands (compare)
//! fp8 = none                                        // bf16 GEMMs (the default)
//! ```

use super::sections::{Reader, SVal};
use crate::diag::Diagnostic;
use crate::ir::fp8::{Fp8Format, Fp8Scaling, DEFAULT_HISTORY, MAX_BLOCK, MAX_HISTORY, MIN_BLOCK};
use crate::spec::{Fp8, Pin};

const PATH: &str = "train.fp8";

/// The recipe, when `train.fp8` is written and is not `none` (bf16 GEMMs throughout, as
/// without it: what `--set train.fp8=none` turns a recipe off with).
pub fn fp8(r: &mut Reader) -> Option<Fp8> {
    let first = r.span(PATH)?;
    let (recipe, span) = r.word(PATH, &["none", "tensorwise", "rowwise", "blockwise"])?;
    let common = ["grad", "bf16", "fp8"];
    let mut history = None;
    let mut shared_quantization = false;
    let scaling = match recipe.as_str() {
        "none" => {
            r.reject_fields(PATH, &[], "none");
            return None;
        }
        "blockwise" => {
            r.reject_fields(PATH, &[&common[..], &["block_size"]].concat(), "blockwise");
            Fp8Scaling::Blockwise { block: block(r)? }
        }
        "tensorwise" => {
            r.reject_fields(
                PATH,
                &[&common[..], &["scaling", "history", "quantize"]].concat(),
                "tensorwise",
            );
            history = delayed_history(r)?;
            shared_quantization = shared(r)?;
            Fp8Scaling::Tensorwise
        }
        _ => {
            r.reject_fields(PATH, &common, "rowwise");
            Fp8Scaling::Rowwise
        }
    };
    // Transformer Engine's hybrid recipe gives tensorwise gradients E5M2's range; the rowwise
    // and blockwise recipes (torchao, DeepSeek-V3) keep E4M3 throughout.
    let default_grad = match scaling {
        Fp8Scaling::Tensorwise => Fp8Format::E5m2,
        _ => Fp8Format::E4m3,
    };
    let grad = match r.word(&format!("{PATH}.grad"), &["e4m3", "e5m2"]) {
        Some((w, _)) if w == "e5m2" => Fp8Format::E5m2,
        Some(_) => Fp8Format::E4m3,
        None if r.span(&format!("{PATH}.grad")).is_some() => return None,
        None => default_grad,
    };
    Some(Fp8 {
        scaling,
        grad,
        history,
        keep_bf16: layers(r, "bf16")?,
        force_fp8: layers(r, "fp8")?,
        shared_quantization,
        span: first.to(span),
    })
}

/// `quantize: shared` (the default) or `quantize: per_gemm`.
fn shared(r: &mut Reader) -> Option<bool> {
    let path = format!("{PATH}.quantize");
    match r.word(&path, &["shared", "per_gemm"]) {
        Some((w, _)) => Some(w == "shared"),
        None if r.span(&path).is_some() => None,
        None => Some(true),
    }
}

/// `block_size: N`, a power of two in [MIN_BLOCK, MAX_BLOCK] (default 128, DeepSeek-V3's).
fn block(r: &mut Reader) -> Option<u64> {
    let path = format!("{PATH}.block_size");
    let Some(at) = r.span(&path) else {
        return Some(128);
    };
    let n = r.count(&path, 1)?;
    if !n.is_power_of_two() || !(MIN_BLOCK..=MAX_BLOCK).contains(&n) {
        r.diags.push(
            Diagnostic::error(
                "E0903",
                format!("an FP8 block of {n} elements is not supported"),
            )
            .label(at, "block size")
            .help(format!(
                "use a power of two from {MIN_BLOCK} to {MAX_BLOCK}; 128 is DeepSeek-V3's"
            )),
        );
        return None;
    }
    Some(n)
}

/// `scaling: current` (the default: None) or `scaling: delayed` with its `history: H` (default
/// [`DEFAULT_HISTORY`]); a history without delayed scaling, or one outside 1..=[`MAX_HISTORY`],
/// is E1205.
fn delayed_history(r: &mut Reader) -> Option<Option<u32>> {
    let path = format!("{PATH}.scaling");
    let delayed = match r.word(&path, &["current", "delayed"]) {
        Some((w, _)) => w == "delayed",
        None if r.span(&path).is_some() => return None,
        None => false,
    };
    let hpath = format!("{PATH}.history");
    let Some(at) = r.span(&hpath) else {
        return Some(delayed.then_some(DEFAULT_HISTORY));
    };
    let n = r.count(&hpath, 1)?;
    let problem = if !delayed {
        Some((
            "an amax history needs delayed scaling".to_string(),
            "write `scaling: delayed` beside it, or drop `history` (current scaling keeps none)"
                .to_string(),
        ))
    } else if n > u64::from(MAX_HISTORY) {
        Some((
            format!("an amax history of {n} steps is too long"),
            format!("use 1 to {MAX_HISTORY} steps; {DEFAULT_HISTORY} (the default) follows a shrinking amax within {DEFAULT_HISTORY} steps"),
        ))
    } else {
        None
    };
    if let Some((message, help)) = problem {
        r.diags.push(
            Diagnostic::error("E1205", message)
                .label(at, "amax history")
                .help(help),
        );
        return None;
    }
    Some(Some(n as u32))
}

/// A pin list `bf16: [...]` or `fp8: [...]`: layer kinds or paths, as `recompute` takes.
fn layers(r: &mut Reader, field: &str) -> Option<Vec<Pin>> {
    let path = format!("{PATH}.{field}");
    let mut out = Vec::new();
    match r.value(&path) {
        None => {}
        Some(SVal::Word(name, span) | SVal::Str(name, span)) => out.push(Pin { name, span }),
        Some(SVal::List(xs, _)) => {
            for x in xs {
                match x {
                    SVal::Word(name, span) | SVal::Str(name, span) => out.push(Pin { name, span }),
                    other => {
                        r.wrong(&other, "a layer kind or path");
                        return None;
                    }
                }
            }
        }
        Some(other) => {
            r.wrong(
                &other,
                "a list of layer kinds or paths, like `[head, blocks.0]`",
            );
            return None;
        }
    }
    Some(out)
}
