//! A branch-free f32 exponential the compiler can inline and vectorise (the system `expf` is an
//! opaque call per element), used by softmax, cross-entropy and the sigmoid-based activations.
//! Cody–Waite range reduction `x = n·ln2 + r`, `|r| ≤ ln2/2`, then a degree-7 Taylor polynomial
//! (truncation below 1e-8 relative) scaled by `2^n` built from its exponent bits: relative error
//! below `f32::EPSILON` over the whole finite range.

const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split so that `n · LN2_HI` is exact for the |n| ≤ 128 used here.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Adding then subtracting 1.5·2^23 rounds an f32 of magnitude < 2^22 to the nearest integer.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// Above this `e^x` overflows f32; below `MIN_ARG` the result is under 2^-126 and flushed to 0.
const MAX_ARG: f32 = 88.722_83;
const MIN_ARG: f32 = -87.336_54;

/// `e^x` in f32 (+inf above ~88.72, 0 below ~-87.34, NaN for NaN).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let clamped = x.clamp(MIN_ARG, MAX_ARG);
    let n = (clamped * LOG2_E + ROUND_MAGIC) - ROUND_MAGIC;
    let r = (clamped - n * LN2_HI) - n * LN2_LO;
    let poly = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
    // n ∈ [-126, 128]: split 2^n into two normal factors so n = 128 does not overflow early.
    let n = n as i32;
    let half = n >> 1;
    let scale_a = f32::from_bits(((half + 127) as u32) << 23);
    let scale_b = f32::from_bits(((n - half + 127) as u32) << 23);
    let value = poly * scale_a * scale_b;
    if x > MAX_ARG {
        f32::INFINITY
    } else if x < MIN_ARG {
        0.0
    } else {
        value
    }
}

#[cfg(test)]
mod tests {
    use super::exp;

    #[test]
    fn exp_is_within_one_epsilon_of_the_f64_exponential() {
        let mut worst = 0.0f64;
        let steps = 400_000;
        for i in 0..=steps {
            let x = -87.0 + 175.0 * i as f32 / steps as f32;
            let expected = f64::from(x).exp();
            let epsilon = f64::from(f32::EPSILON) * expected;
            worst = worst.max((f64::from(exp(x)) - expected).abs() / epsilon);
        }
        assert!(worst <= 1.0, "worst relative error {worst} epsilons");
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn exp_saturates_and_propagates_nan() {
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(-88.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(88.7).is_finite() && exp(88.7) > 3.0e38);
    }
}
