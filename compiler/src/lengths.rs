//! The response-length distribution as the planner uses it: how many samples still decode at
//! each step, when groups finish, and the moments of a response's length.
//!
//! Conventions: a response of length `L` (tokens, `1 <= L <= max_new_tokens`) gets its first
//! token from prefill and the rest from `L - 1` decode steps; it is active in decode step `s`
//! (0-based) iff `L >= s + 2`. A GRPO group finishes after `max(L_i) - 1` steps.
//!
//! Completion slots (see `rollplex_plan::plan`): with `n` groups, the planner expects slot `k`
//! to finish at the `(k + 1) / (n + 1)` quantile of the distribution of a group's finish step
//! (the expected position of the `k`-th order statistic), so the last slot sets the planned
//! number of decode steps. Everything here is deterministic and pure.

use rollplex_plan::spec::LengthDist;

/// A response-length distribution truncated to `1..=max` tokens.
#[derive(Clone, Debug)]
pub struct Lengths {
    /// `pmf[l]` = P(L = l), l in 0..=max (pmf[0] = 0).
    pmf: Vec<f64>,
    /// `cdf[l]` = P(L <= l).
    cdf: Vec<f64>,
}

impl Lengths {
    pub fn new(dist: &LengthDist, max: u32) -> Lengths {
        let max = max.max(1) as usize;
        let mut cdf_raw = vec![0.0f64; max + 1];
        for (l, c) in cdf_raw.iter_mut().enumerate().skip(1) {
            *c = match *dist {
                LengthDist::Fixed { tokens } => {
                    if l >= tokens.clamp(1, max as u32) as usize {
                        1.0
                    } else {
                        0.0
                    }
                }
                LengthDist::Uniform { min, max: hi } => {
                    let (lo, hi) = (min.max(1) as f64, hi.max(min.max(1)) as f64);
                    ((l as f64 - lo + 1.0) / (hi - lo + 1.0)).clamp(0.0, 1.0)
                }
                LengthDist::LogNormal { median, sigma } => {
                    // Continuous lengths rounded up: P(L <= l) = P(X <= l).
                    if median <= 0.0 || sigma <= 0.0 {
                        if (l as f64) >= median {
                            1.0
                        } else {
                            0.0
                        }
                    } else {
                        normal_cdf(((l as f64).ln() - median.ln()) / sigma)
                    }
                }
            };
        }
        // Everything above max is cut to max.
        cdf_raw[max] = 1.0;
        let mut pmf = vec![0.0; max + 1];
        let mut prev = 0.0;
        for l in 1..=max {
            let c = cdf_raw[l].max(prev);
            pmf[l] = c - prev;
            prev = c;
        }
        let mut cdf = vec![0.0; max + 1];
        let mut acc = 0.0;
        for l in 1..=max {
            acc += pmf[l];
            cdf[l] = acc.min(1.0);
        }
        cdf[max] = 1.0;
        Lengths { pmf, cdf }
    }

    pub fn max(&self) -> u32 {
        (self.pmf.len() - 1) as u32
    }

    /// E[L].
    pub fn mean(&self) -> f64 {
        self.pmf.iter().enumerate().map(|(l, p)| l as f64 * p).sum()
    }

    /// E[L^2].
    pub fn mean_sq(&self) -> f64 {
        self.pmf
            .iter()
            .enumerate()
            .map(|(l, p)| (l as f64).powi(2) * p)
            .sum()
    }

    /// P(L <= l).
    pub fn cdf(&self, l: u32) -> f64 {
        self.cdf.get(l as usize).copied().unwrap_or(1.0)
    }

    /// P(a sample is active in decode step `s`) = P(L >= s + 2).
    pub fn active(&self, step: u32) -> f64 {
        1.0 - self.cdf(step + 1)
    }

    /// E[sum over active samples of their KV length beyond the prompt] per sample at step `s`:
    /// an active sample has `s + 1` response tokens cached.
    pub fn active_kv(&self, step: u32) -> f64 {
        self.active(step) * (step as f64 + 1.0)
    }

    /// P(a group of `g` samples needs at most `n` decode steps) = P(max L <= n + 1).
    pub fn group_done(&self, g: u32, n: u32) -> f64 {
        self.cdf(n + 1).powi(g as i32)
    }

    /// The smallest number of decode steps `n` such that a group of `g` samples is done after
    /// `n` steps with probability at least `q`.
    pub fn group_finish_quantile(&self, g: u32, q: f64) -> u32 {
        let last = self.max().saturating_sub(1);
        (0..last)
            .find(|&n| self.group_done(g, n) >= q)
            .unwrap_or(last)
    }

    /// Planned finish (decode steps needed) of each of `n` groups in completion order.
    pub fn slot_finish_steps(&self, n: u32, g: u32) -> Vec<u32> {
        (0..n)
            .map(|k| self.group_finish_quantile(g, (k as f64 + 1.0) / (n as f64 + 1.0)))
            .collect()
    }
}

/// Standard normal CDF (Abramowitz & Stegun 7.1.26 for erf, |error| < 1.5e-7).
pub fn normal_cdf(x: f64) -> f64 {
    let z = x / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.3275911 * z.abs());
    let y = 1.0
        - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
            + 0.254829592)
            * t
            * (-z * z).exp();
    let erf = if z >= 0.0 { y } else { -y };
    0.5 * (1.0 + erf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lognormal_median_and_cap() {
        let l = Lengths::new(
            &LengthDist::LogNormal {
                median: 256.0,
                sigma: 0.6,
            },
            512,
        );
        assert!((l.cdf(256) - 0.5).abs() < 0.01, "{}", l.cdf(256));
        assert_eq!(l.cdf(512), 1.0);
        // P(X > 512) = 1 - Phi(ln 2 / 0.6) = 0.124: that mass sits at the cap.
        assert!((l.cdf(511) - 0.876).abs() < 0.01, "{}", l.cdf(511));
        let mean = l.mean();
        assert!(mean > 250.0 && mean < 300.0, "{mean}");
    }

    #[test]
    fn fixed_lengths_finish_together() {
        let l = Lengths::new(&LengthDist::Fixed { tokens: 100 }, 512);
        assert_eq!(l.mean(), 100.0);
        assert_eq!(l.active(98), 1.0);
        assert_eq!(l.active(99), 0.0);
        assert_eq!(l.slot_finish_steps(3, 8), vec![99, 99, 99]);
    }

    #[test]
    fn slots_finish_in_order_and_by_the_cap() {
        let l = Lengths::new(
            &LengthDist::LogNormal {
                median: 256.0,
                sigma: 0.6,
            },
            512,
        );
        let f = l.slot_finish_steps(16, 8);
        assert!(f.windows(2).all(|w| w[0] <= w[1]));
        assert!(*f.last().unwrap() <= 511);
        // A group of 8 reaches the cap with probability 1 - 0.876^8 = 0.65: most groups end there.
        assert_eq!(*f.last().unwrap(), 511);
        assert!(f[0] < 511);
    }

    #[test]
    fn normal_cdf_known_values() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.96) - 0.975).abs() < 1e-4);
        assert!((normal_cdf(-1.0) - 0.158655).abs() < 1e-5);
    }
}
