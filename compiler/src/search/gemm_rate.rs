//! How much slower than the GPU's peak a calibration profile runs a candidate's GEMMs: the
//! factor the search scales the formulas' compute by before it orders the candidates. The
//! formulas price compute at the peak, so on their own they favour plans of small GEMMs (one
//! sample a micro batch, sequences cut by cp, wide tp) that the calibrated timeline then finds
//! slow, and a search that lowers only the first few in their order misses the fastest plans.
use crate::fp8::{gemms, GemmPrices};
use crate::ir::fp8::Fp8Scaling;
use crate::spec::Spec;
use std::cell::RefCell;
use std::collections::HashMap;

/// A GEMM's local shape: rows, input and output columns.
type Shape = (u64, u64, u64);

/// The profile's GEMM prices, remembered by shape (a search meets the same few shapes in
/// thousands of candidates).
pub(super) struct GemmRates<'a> {
    prices: Option<&'a dyn GemmPrices>,
    /// Each shape's measured seconds over its three layouts, None where the profile has none.
    seen: RefCell<HashMap<Shape, Option<f64>>>,
}

impl<'a> GemmRates<'a> {
    pub(super) fn new(prices: Option<&'a dyn GemmPrices>) -> Self {
        GemmRates {
            prices,
            seen: RefCell::new(HashMap::new()),
        }
    }

    /// The candidate `spec`'s GEMMs (every linear layer's forward and both gradients, at its
    /// local shapes) at the profile's rates over the same at the GPU's peak: at least 1, and 1
    /// without a profile. A GEMM the profile cannot price counts at the peak.
    pub(super) fn slowdown(&self, spec: &Spec) -> f64 {
        let Some(prices) = self.prices else {
            return 1.0;
        };
        let peak = spec.cluster.gpu.peak_for(spec.train.precision).max(1.0);
        let (mut measured, mut at_peak) = (0.0, 0.0);
        for node in &spec.model.nodes {
            for g in gemms(spec, node) {
                let shape = (g.rows, g.in_dim, g.out_dim);
                let ideal = 6.0 * (g.rows * g.in_dim * g.out_dim) as f64 / peak;
                let priced = *(self.seen.borrow_mut().entry(shape)).or_insert_with(|| {
                    let p = prices.layer_gemm(spec, &g, Fp8Scaling::Tensorwise)?;
                    Some(p.bf16_s.0.iter().sum())
                });
                measured += priced.unwrap_or(ideal);
                at_peak += ideal;
            }
        }
        match at_peak > 0.0 {
            true => (measured / at_peak).max(1.0),
            false => 1.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::testspec::{build, Dims, Plan};
    use crate::fp8::{Gemm, PerLayout, Priced, Pricing};

    /// Prices every GEMM at `times` its time at the GPU's peak.
    struct Slow {
        times: f64,
    }

    impl GemmPrices for Slow {
        fn layer_gemm(&self, spec: &Spec, g: &Gemm, _: Fp8Scaling) -> Option<Priced> {
            let peak = spec.cluster.gpu.peak_for(spec.train.precision);
            let layout = 2.0 * (g.rows * g.in_dim * g.out_dim) as f64 / peak;
            Some(Priced {
                bf16_s: PerLayout::splat(self.times * layout),
                fp8_s: PerLayout::splat(f64::INFINITY),
                priced_by: Pricing::Measured,
            })
        }
    }

    #[test]
    fn gemms_at_a_profiles_rates_scale_the_compute_and_none_leaves_it() {
        let spec = build(&Dims::gpt2_124m(), &Plan::default());
        let slow = Slow { times: 1.7 };
        let rates = GemmRates::new(Some(&slow));
        assert!((rates.slowdown(&spec) - 1.7).abs() < 1e-9);
        // Remembered by shape: the same again.
        assert!((rates.slowdown(&spec) - 1.7).abs() < 1e-9);
        assert_eq!(GemmRates::new(None).slowdown(&spec), 1.0);
        // Faster than the peak is taken as the peak.
        let fast = Slow { times: 0.5 };
        assert_eq!(GemmRates::new(Some(&fast)).slowdown(&spec), 1.0);
    }
}
