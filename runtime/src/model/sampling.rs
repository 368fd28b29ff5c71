//! Token sampling: temperature, top-k, top-p (the order of Hugging Face's logits warpers), with
//! one uniform number per token from Philox4x32-10 keyed by the job seed at counter
//! `(iteration, sample, step)`. A token therefore depends only on its logits, the sampling
//! parameters and its key: never on batch composition, other samples or schedule order.

use rollplex_plan::spec::SamplingSpec;

use super::ModelError;
use rollplex_kernels::cpu::{philox4x32_10, uniform_open01};

/// Sampling parameters. `temperature == 0` is greedy (argmax, first index on ties).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the `top_k` largest logits (ties at the k-th value kept, as HF); 0 disables.
    pub top_k: u32,
    /// Keep the smallest head of the distribution whose mass exceeds `top_p`; 1 disables.
    pub top_p: f32,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }
    pub fn from_spec(s: &SamplingSpec) -> Self {
        SamplingParams {
            temperature: s.temperature as f32,
            top_k: s.top_k,
            top_p: s.top_p as f32,
        }
    }
    fn validate(&self) -> Result<(), ModelError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(ModelError::Input(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::Input(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// The address of one sampled token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SampleKey {
    pub seed: u64,
    pub iteration: u32,
    /// Global sample index within the iteration (prompt * group_size + member).
    pub sample: u32,
    /// Response position (0 = first generated token).
    pub step: u32,
}

impl SampleKey {
    /// The uniform in (0, 1) this key draws.
    pub fn uniform(&self) -> f64 {
        let r = philox4x32_10(
            [self.iteration, self.sample, self.step, 0x5A4D_504C],
            [self.seed as u32, (self.seed >> 32) as u32],
        );
        uniform_open01(r[0], r[1])
    }
}

/// Draws one token from `logits [vocab]`.
pub fn sample_token(logits: &[f32], p: &SamplingParams, key: SampleKey) -> Result<u32, ModelError> {
    p.validate()?;
    if logits.is_empty() {
        return Err(ModelError::Input("sample_token: empty logits".into()));
    }
    if p.temperature == 0.0 {
        let mut best = 0usize;
        for (j, v) in logits.iter().enumerate() {
            if *v > logits[best] {
                best = j;
            }
        }
        return Ok(best as u32);
    }
    let z: Vec<f32> = logits.iter().map(|v| v / p.temperature).collect();
    // candidates in a fixed order: index order when nothing is filtered, else by (z desc, id asc)
    let filtered = p.top_k > 0 || p.top_p < 1.0;
    let mut cand: Vec<u32> = (0..z.len() as u32)
        .filter(|&i| !z[i as usize].is_nan())
        .collect();
    if cand.is_empty() {
        return Err(ModelError::Input("sample_token: every logit is NaN".into()));
    }
    if filtered {
        let cmp = |a: &u32, b: &u32| z[*b as usize].total_cmp(&z[*a as usize]).then(a.cmp(b));
        if p.top_k > 0 && (p.top_k as usize) < cand.len() {
            let k = p.top_k as usize;
            cand.select_nth_unstable_by(k - 1, cmp);
            let kth = z[cand[k - 1] as usize];
            let (mut head, tail): (Vec<u32>, Vec<u32>) =
                cand.into_iter().partition(|&i| z[i as usize] >= kth);
            head.sort_by(cmp);
            let _ = tail;
            cand = head;
        } else {
            cand.sort_by(cmp);
        }
    }
    let max = cand
        .iter()
        .map(|&i| z[i as usize])
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut w: Vec<f64> = cand
        .iter()
        .map(|&i| (z[i as usize] as f64 - max).exp())
        .collect();
    if p.top_p < 1.0 {
        // HF: sort ascending, drop tokens whose ascending cumulative mass is <= 1 - top_p, keep
        // at least the most likely one. In descending order: drop position d when the mass of
        // positions >= d is <= 1 - top_p.
        let total: f64 = w.iter().sum();
        let mut tail = 0f64;
        let mut keep = w.len();
        for d in (1..w.len()).rev() {
            tail += w[d] / total;
            if tail <= 1.0 - p.top_p as f64 {
                keep = d;
            } else {
                break;
            }
        }
        w.truncate(keep);
        cand.truncate(keep);
    }
    let total: f64 = w.iter().sum();
    let u = key.uniform() * total;
    let mut acc = 0f64;
    for (i, wi) in w.iter().enumerate() {
        acc += wi;
        if u < acc {
            return Ok(cand[i]);
        }
    }
    Ok(*cand.last().expect("candidates are not empty"))
}

/// Why a sample stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// It produced a stop token (kept as the last token of the response).
    StopToken,
    /// It reached `max_new_tokens`.
    MaxLength,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(step: u32) -> SampleKey {
        SampleKey {
            seed: 7,
            iteration: 1,
            sample: 3,
            step,
        }
    }

    #[test]
    fn greedy_and_determinism() {
        let logits = vec![0.1, 2.0, 2.0, -1.0];
        assert_eq!(
            sample_token(&logits, &SamplingParams::greedy(), key(0)).unwrap(),
            1
        );
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        };
        let a: Vec<u32> = (0..50)
            .map(|s| sample_token(&logits, &p, key(s)).unwrap())
            .collect();
        let b: Vec<u32> = (0..50)
            .map(|s| sample_token(&logits, &p, key(s)).unwrap())
            .collect();
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&t| t != a[0]),
            "50 draws from a spread distribution are not all equal"
        );
        let other = SampleKey {
            sample: 4,
            ..key(0)
        };
        assert_ne!(other.uniform(), key(0).uniform());
    }

    #[test]
    fn top_k_and_top_p_restrict_support() {
        let logits: Vec<f32> = (0..20).map(|i| i as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 3,
            top_p: 1.0,
        };
        for s in 0..200 {
            let t = sample_token(&logits, &p, key(s)).unwrap();
            assert!(t >= 17, "top-3 drew {t}");
        }
        // probabilities 0.6, 0.3, 0.1: top_p 0.8 keeps the first two (tail mass 0.1 <= 0.2)
        let logits = vec![(0.6f32).ln(), (0.3f32).ln(), (0.1f32).ln()];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.8,
        };
        let draws: Vec<u32> = (0..300)
            .map(|s| sample_token(&logits, &p, key(s)).unwrap())
            .collect();
        assert!(!draws.contains(&2));
        let ones = draws.iter().filter(|&&t| t == 1).count() as f64 / 300.0;
        assert!(
            (ones - 1.0 / 3.0).abs() < 0.1,
            "token 1 drawn with frequency {ones}"
        );
        assert!(sample_token(&logits, &SamplingParams { top_p: 0.0, ..p }, key(0)).is_err());
    }
}
