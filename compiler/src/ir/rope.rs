//! RoPE's rotation frequencies: pair `i` of a head of `head_dim` features turns by
//! `pos · inv_freq(i)`, where `inv_freq(i) = theta^(−2i/head_dim)` scaled as a published
//! config says ([`RopeScaling`]). [`inv_freq`] is the one definition: the CPU kernels (`Rope`,
//! `RopeBwd`, `RopeTable`, whose table the fused kernels read) call it, and the CUDA kernels
//! (`runtime/src/cuda/kernels/elementwise.cu`, `rope_inv_freq`) repeat its double-precision
//! operations one for one, which `tests/cuda_ops` compares against the CPU.
//!
//! Unscaled RoPE ([`RopeScaling::None`]) is exactly `theta.powf(−2i/head_dim)`, the value parc
//! computed before scaling existed, so plain models keep their numbers bit for bit.
use serde::Serialize;
use std::f64::consts::TAU;
use std::fmt;

/// How RoPE's frequencies are scaled to reach positions past those a model was trained on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RopeScaling {
    /// Plain RoPE: `theta^(−2i/head_dim)`.
    #[default]
    None,
    /// Position interpolation (Chen et al. 2023; transformers' `rope_type: linear`): every
    /// frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1's rule (Meta's reference `apply_scaling`, transformers' `rope_type: llama3`):
    /// with `wavelen = 2π / f` and `L = original_max_position`, a frequency whose wavelength is
    /// under `L / high_freq_factor` is kept, one whose wavelength is over
    /// `L / low_freq_factor` is divided by `factor`, and one between is blended:
    /// `smooth = (L / wavelen − low_freq_factor) / (high_freq_factor − low_freq_factor)`,
    /// `f · ((1 − smooth) / factor + smooth)` (computed as `(1 − smooth) · f / factor +
    /// smooth · f`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: u64,
    },
}

impl RopeScaling {
    /// Whether this is plain RoPE (what the IR's JSON and text forms leave out).
    pub fn is_none(&self) -> bool {
        matches!(self, RopeScaling::None)
    }

    /// The name the language and transformers' `rope_type` give it.
    pub fn name(self) -> &'static str {
        match self {
            RopeScaling::None => "none",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
        }
    }

    /// The scaled frequency of the plain one `base`.
    pub fn apply(self, base: f64) -> f64 {
        match self {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base / factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position,
            } => {
                let original = original_max_position as f64;
                let wavelen = TAU / base;
                if wavelen < original / high {
                    base
                } else if wavelen > original / low {
                    base / factor
                } else {
                    let smooth = (original / wavelen - low) / (high - low);
                    (1.0 - smooth) * base / factor + smooth * base
                }
            }
        }
    }

    /// Why these parameters define no frequencies, if they do not: a factor that is not a
    /// positive finite number, `low_freq_factor` not positive or not below
    /// `high_freq_factor`, an `original_max_position` of 0. (The checker reports each with
    /// its own diagnostic; a backend refuses an op that carries one.)
    pub fn problem(self) -> Option<String> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        match self {
            RopeScaling::None => None,
            RopeScaling::Linear { factor } => {
                (!positive(factor)).then(|| format!("linear factor = {factor} must be positive"))
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position,
            } => {
                if !positive(factor) {
                    Some(format!("llama3 factor = {factor} must be positive"))
                } else if !positive(low) || !high.is_finite() || low >= high {
                    Some(format!(
                        "llama3 low_freq_factor = {low} must be positive and below \
                         high_freq_factor = {high}"
                    ))
                } else if original_max_position == 0 {
                    Some("llama3 original_max_position must be at least 1".into())
                } else {
                    None
                }
            }
        }
    }
}

/// The language's spelling: `none`, `linear { factor: 4 }`, `llama3 { factor: 32, … }`.
impl fmt::Display for RopeScaling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RopeScaling::None => f.write_str("none"),
            RopeScaling::Linear { factor } => write!(f, "linear {{ factor: {factor} }}"),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => write!(
                f,
                "llama3 {{ factor: {factor}, low_freq_factor: {low_freq_factor}, \
                 high_freq_factor: {high_freq_factor}, original_max_position: \
                 {original_max_position} }}"
            ),
        }
    }
}

/// Why a rotation of heads of `head_dim` features, the first `rotary` of them turning at base
/// `theta` scaled by `scaling`, is undefined, if it is: `rotary` not an even number of at most
/// `head_dim`, `theta` not positive, the scaling's own [`RopeScaling::problem`]. Each backend's
/// rope kernels refuse such an op with this.
pub fn rotation_problem(
    theta: f64,
    scaling: RopeScaling,
    head_dim: u64,
    rotary: u64,
) -> Option<String> {
    if !rotary.is_multiple_of(2) || rotary == 0 || rotary > head_dim {
        Some(format!(
            "the {rotary} turned features of a head of {head_dim} must be an even number of at \
             most head_dim, to rotate pairs (i, i + rotary/2)"
        ))
    } else if theta.is_nan() || theta <= 0.0 {
        Some(format!("theta = {theta} must be positive"))
    } else {
        scaling.problem()
    }
}

/// The inverse frequency of pair `i` (`i < head_dim / 2`) of a head: `theta^(−2i/head_dim)`,
/// computed in f64, then scaled by `scaling`.
pub fn inv_freq(theta: f64, head_dim: u64, i: u64, scaling: RopeScaling) -> f64 {
    let base = theta.powf(-2.0 * i as f64 / head_dim as f64);
    scaling.apply(base)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::LLAMA3_2_SCALING as LLAMA3_2;

    /// Relative difference.
    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs()
    }

    #[test]
    fn unscaled_is_the_plain_power_bit_for_bit() {
        for i in 0..32 {
            let plain = 500000f64.powf(-2.0 * i as f64 / 64.0);
            assert_eq!(
                inv_freq(500000.0, 64, i, RopeScaling::None).to_bits(),
                plain.to_bits()
            );
        }
    }

    #[test]
    fn linear_divides_every_frequency() {
        let s = RopeScaling::Linear { factor: 4.0 };
        assert_eq!(inv_freq(10000.0, 8, 0, s), 0.25);
        assert_eq!(inv_freq(10000.0, 8, 2, s), 0.01 / 4.0);
    }

    /// Head dim 64, theta 500000, Llama 3.2's scaling, against values worked by hand:
    /// `f_i = 500000^(−i/32)`, wavelength `2π / f_i`; kept under 8192 / 4 = 2048, divided by 32
    /// over 8192 / 1 = 8192, blended between.
    #[test]
    fn llama3_keeps_high_divides_low_and_blends_between() {
        let f = |i: u64| inv_freq(500000.0, 64, i, LLAMA3_2);
        // i = 0: f = 1, wavelength 2π ≈ 6.28, far under 2048: kept.
        assert_eq!(f(0), 1.0);
        // i = 10: f = 500000^(−10/32) = 0.0165604…, wavelength ≈ 379.4 < 2048: kept.
        assert!((f(10) - 0.016560440081).abs() < 1e-12, "{}", f(10));
        // i = 16: f = 500000^(−1/2) = 1/707.1068 = 0.0014142136, wavelength ≈ 4442.9: between
        // 2048 and 8192, smooth = (8192 / 4442.88 − 1) / 3 = 0.2812826…,
        // f · ((1 − 0.2812826) / 32 + 0.2812826) = 0.0014142136 · 0.3037425… = 0.000429557….
        let (f16, wavelen) = (500000f64.powf(-0.5), TAU * 500000f64.sqrt());
        let smooth = (8192.0 / wavelen - 1.0) / 3.0;
        assert!((smooth - 0.2812826).abs() < 1e-7, "smooth {smooth}");
        assert!(close(f(16), f16 * ((1.0 - smooth) / 32.0 + smooth)));
        assert!((f(16) - 0.000429557).abs() < 1e-9, "{}", f(16));
        // i = 20: f = 500000^(−20/32) = 0.000274248…, wavelength ≈ 22911 > 8192: divided by 32.
        assert!(close(f(20), 500000f64.powf(-20.0 / 32.0) / 32.0));
        assert!((f(20) - 0.0002742482 / 32.0).abs() < 1e-12, "{}", f(20));
        // i = 31, the lowest frequency: divided by 32.
        assert!(close(f(31), 500000f64.powf(-31.0 / 32.0) / 32.0));
    }

    /// The band's edges: a wavelength of exactly `L / high` or `L / low` is blended (as
    /// transformers' `is_medium_freq`), which there equals keeping it and dividing it.
    #[test]
    fn llama3_band_edges_meet_the_kept_and_divided_values() {
        // A base whose wavelength is exactly 2048 (= 8192 / 4): smooth = 1, the value kept.
        let kept = TAU / 2048.0;
        assert!(close(LLAMA3_2.apply(kept), kept));
        // Exactly 8192 (= 8192 / 1): smooth = 0, the value divided.
        let divided = TAU / 8192.0;
        assert!(close(LLAMA3_2.apply(divided), divided / 32.0));
    }

    #[test]
    fn bad_parameters_are_named() {
        let bad = |s: RopeScaling| s.problem().unwrap_or_default();
        assert!(bad(RopeScaling::Linear { factor: 0.0 }).contains("factor"));
        let l3 = |factor, low, high, original| RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position: original,
        };
        assert!(bad(l3(-1.0, 1.0, 4.0, 8192)).contains("factor"));
        assert!(bad(l3(8.0, 4.0, 4.0, 8192)).contains("low_freq_factor"));
        assert!(bad(l3(8.0, 0.0, 4.0, 8192)).contains("low_freq_factor"));
        assert!(bad(l3(8.0, 1.0, 4.0, 0)).contains("original_max_position"));
        assert_eq!(LLAMA3_2.problem(), None);
        assert_eq!(RopeScaling::None.problem(), None);
    }

    #[test]
    fn displays_as_the_language_writes_it() {
        assert_eq!(
            LLAMA3_2.to_string(),
            "llama3 { factor: 32, low_freq_factor: 1, high_freq_factor: 4, \
             original_max_position: 8192 }"
        );
        assert_eq!(
            RopeScaling::Linear { factor: 2.5 }.to_string(),
            "linear { factor: 2.5 }"
        );
        assert_eq!(RopeScaling::None.to_string(), "none");
    }
}
