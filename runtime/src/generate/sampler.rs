//! Choosing the next token from logits: greedy (temperature 0: the most likely token, the
//! lowest id among equals), or a draw from `softmax(logits / temperature)` over the `top_k`
//! most likely tokens. Draws are counter-based, as the runtime's other randomness
//! (`data::source::mix64`): the `i`-th token of a sample under seed `s` uses a uniform number
//! that is a pure function of `(s, i)`, so a sample repeats exactly with its seed.
use crate::data::source::mix64;
use crate::error::{Result, RuntimeError};

/// How tokens are chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampler {
    /// 0: greedy; otherwise the softmax temperature (finite, positive).
    pub temperature: f64,
    /// Draw from this many most likely tokens only (None: from all).
    pub top_k: Option<u64>,
    pub seed: u64,
}

/// `x` as short as it reads back: plain where that is short (`0.8`, `1`, `0.001`, `1500`),
/// else in scientific notation (`1e300`, `1e-7`), where plain would print every digit.
pub fn compact(x: f64) -> String {
    let (plain, scientific) = (format!("{x}"), format!("{x:e}"));
    if plain.len() <= scientific.len() + 2 {
        plain
    } else {
        scientific
    }
}

/// Keeps this generator's numbers apart from other uses of `mix64` with the same seed.
const SALT: u64 = 0x5a3b_1e5a_3b1e_0000;

/// The uniform number in `[0, 1)` of draw `index` under `seed`.
fn uniform(seed: u64, index: u64) -> f64 {
    let bits = mix64(mix64(seed ^ SALT) ^ index);
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

impl Sampler {
    /// Greedy choice.
    pub fn greedy() -> Sampler {
        Sampler {
            temperature: 0.0,
            top_k: None,
            seed: 0,
        }
    }

    /// Fails unless the temperature is finite and non-negative and `top_k` at least 1.
    pub fn check(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(RuntimeError::Unsupported(format!(
                "temperature = {} must be a number ≥ 0 (0 picks the most likely token)",
                compact(self.temperature)
            )));
        }
        if self.top_k == Some(0) {
            return Err(RuntimeError::Unsupported(
                "top-k = 0 leaves no token to choose; give 1 or more".to_string(),
            ));
        }
        Ok(())
    }

    /// The token for draw `index` from `logits`, among ids below `allowed` (the tokenizer's
    /// vocabulary, when the model's is padded past it).
    pub fn choose(&self, logits: &[f32], allowed: usize, index: u64) -> Result<u32> {
        let logits = &logits[..allowed.min(logits.len())];
        if let Some(bad) = logits.iter().position(|l| !l.is_finite()) {
            return Err(RuntimeError::Unsupported(format!(
                "the model's logit for token {bad} is {}: the parameters are not usable \
                 (a diverged run?)",
                logits[bad]
            )));
        }
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        // Most likely first; equal logits by id, so the order is total.
        order.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        let Some(&best) = order.first() else {
            return Err(RuntimeError::Unsupported(
                "the model has no tokens to choose from".to_string(),
            ));
        };
        if self.temperature == 0.0 {
            return Ok(best);
        }
        let k = self
            .top_k
            .map_or(order.len(), |k| k as usize)
            .min(order.len());
        let top = f64::from(logits[best as usize]);
        let weights: Vec<f64> = order[..k]
            .iter()
            .map(|&id| ((f64::from(logits[id as usize]) - top) / self.temperature).exp())
            .collect();
        let mut left = uniform(self.seed, index) * weights.iter().sum::<f64>();
        for (&id, &w) in order.iter().zip(&weights) {
            if left < w {
                return Ok(id);
            }
            left -= w;
        }
        Ok(order[k - 1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_as_short_as_they_read_back() {
        let shown: Vec<String> = [0.8, 1.0, 0.001, 1500.0, 1e300, -1e300, 1e-7, 2.5e10]
            .into_iter()
            .map(compact)
            .collect();
        let want = [
            "0.8", "1", "0.001", "1500", "1e300", "-1e300", "1e-7", "2.5e10",
        ];
        assert_eq!(shown, want);
    }

    #[test]
    fn greedy_takes_the_largest_and_the_lowest_id_of_equals() {
        let g = Sampler::greedy();
        assert_eq!(g.choose(&[0.0, 3.0, 1.0, 3.0], 4, 0).unwrap(), 1);
        // Ids past `allowed` (padding) are never chosen.
        assert_eq!(g.choose(&[0.0, 1.0, 9.0], 2, 0).unwrap(), 1);
    }

    #[test]
    fn draws_follow_the_softmax_and_repeat_with_their_seed() {
        let s = Sampler {
            temperature: 1.0,
            top_k: None,
            seed: 7,
        };
        let logits = [0.0f32, 3.0f32.ln(), -1e30];
        let draws: Vec<u32> = (0..4000)
            .map(|i| s.choose(&logits, 3, i).unwrap())
            .collect();
        let ones = draws.iter().filter(|&&t| t == 1).count() as f64 / draws.len() as f64;
        assert!(
            (ones - 0.75).abs() < 0.03,
            "token 1 drawn {ones} of the time"
        );
        assert!(!draws.contains(&2));
        let again: Vec<u32> = (0..4000)
            .map(|i| s.choose(&logits, 3, i).unwrap())
            .collect();
        assert_eq!(draws, again);
        let other = Sampler { seed: 8, ..s };
        let differ = (0..4000).any(|i| other.choose(&logits, 3, i).unwrap() != draws[i as usize]);
        assert!(differ, "another seed draws other tokens");
    }

    #[test]
    fn top_k_keeps_the_most_likely() {
        let s = Sampler {
            temperature: 10.0,
            top_k: Some(2),
            seed: 1,
        };
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        for i in 0..500 {
            let t = s.choose(&logits, 4, i).unwrap();
            assert!(t == 1 || t == 2, "drew {t}");
        }
    }

    #[test]
    fn bad_settings_and_logits_are_errors() {
        let bad = Sampler {
            temperature: -1.0,
            ..Sampler::greedy()
        };
        assert!(bad.check().is_err());
        let none = Sampler {
            top_k: Some(0),
            ..Sampler::greedy()
        };
        assert!(none.check().is_err());
        let err = Sampler::greedy()
            .choose(&[0.0, f32::NAN], 2, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("token 1"), "{err}");
    }
}
