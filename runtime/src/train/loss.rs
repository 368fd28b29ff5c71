//! The policy loss of GRPO and PPO-clip, with its gradient w.r.t. the per-token log-probs.
//!
//! Definitions follow veRL (`core_algos.py`), so that numbers can be compared with it:
//!
//! - **GRPO advantages** ([`grpo_advantages`]): for each group of G consecutive samples,
//!   `A = (r - mean) / (std + 1e-6)` with the *unbiased* std (Bessel), or `A = r - mean` when
//!   `norm_adv_by_std` is false; a group of one sample has mean 0 and std 1.
//! - **Ratio**: `ρ = exp(clamp(logp - old, -20, 20))` per token; with
//!   [`RatioLevel::Sequence`] (GSPO) every token of sequence `i` takes the sequence's ratio
//!   `s_i = exp(clamp(mean_t(logp - old), -20, 20))` (mean over its masked tokens) as its value,
//!   and its derivative w.r.t. the token's own `logp` is `s_i` (the paper's GSPO-token form
//!   `sg[s_i] · π(y_t) / sg[π(y_t)]`): the clip and the dual clip below act on `s_i`.
//! - **Clipped surrogate** per token: `l = max(-A ρ, -A clamp(ρ, 1 - clip_low, 1 + clip_high))`;
//!   with dual clip `c > 1` and `A < 0`: `l = min(l, -A c)`.
//! - **KL to the reference** per token, with `d = logp - ref_logp`:
//!   k1 `= d`; k2 `= d² / 2`; k3 `= clamp(exp(-d') + d' - 1, -10, 10)` with `d' = clamp(d, -20, 20)`
//!   (that is `exp(ref - logp) - (ref - logp) - 1`).
//! - **Aggregation** of a per-token quantity `x` over the response mask `m`, with the
//!   *mini-batch* normaliser ([`Normaliser`]) of N tokens and S sequences:
//!   token_mean `Σ m x / N`; seq_mean_token_mean `Σ_s (Σ_t m x / n_s) / S`;
//!   seq_mean_token_sum `Σ_s Σ_t m x / S`; seq_mean_token_sum_norm (Dr. GRPO)
//!   `Σ_s Σ_t m x / (H S)` with `H` the maximum response length ([`LossConfig::horizon`]).
//!   A sequence with no response token adds 0.
//! - **Loss** `= agg(l) + kl_coef · agg(kl)`.
//!
//! PPO-clip with given advantages is the same code path ([`policy_loss`] takes per-token
//! advantages; GRPO broadcasts each sample's scalar with [`broadcast_advantages`]).
//!
//! Invariant (micro-batch additivity): the normaliser counts the whole mini-batch (one optimizer
//! step), so the losses, gradients and metrics of its micro-batches *add up* to those of the
//! mini-batch computed at once. Sums run in f64, in token order; results are deterministic.
//!
//! Gradients at the non-differentiable points follow torch's autograd: `clamp` passes the
//! gradient on its closed interval, `maximum`/`minimum` split it in half at exact ties.

use rollplex_kernels::cpu::seq_log_ratio;
use rollplex_plan::spec::{KlEstimator, LossAgg, PolicyLoss, RatioLevel};

use super::{check_len, Result, TrainError};

/// The epsilon added to the group std (veRL's default).
pub const ADV_EPS: f64 = 1e-6;
/// Bound of the log-ratio before `exp` (veRL clamps to keep the ratio finite).
pub const LOG_RATIO_CLAMP: f64 = 20.0;
/// Bound of the k3 estimator's value (veRL's `low_var_kl` clamp).
pub const K3_CLAMP: f64 = 10.0;

/// GRPO group-normalised advantages, one per sample.
///
/// `rewards` holds whole groups of `group_size` consecutive samples. Computed in f64.
pub fn grpo_advantages(
    rewards: &[f32],
    group_size: usize,
    norm_adv_by_std: bool,
) -> Result<Vec<f32>> {
    if group_size == 0 {
        return Err(TrainError::Invalid(
            "grpo_advantages: group_size must be at least 1".into(),
        ));
    }
    if !rewards.len().is_multiple_of(group_size) {
        return Err(TrainError::Invalid(format!(
            "grpo_advantages: {} rewards do not split into groups of {group_size}",
            rewards.len()
        )));
    }
    let mut out = Vec::with_capacity(rewards.len());
    for group in rewards.chunks(group_size) {
        let g = group.len() as f64;
        let (mean, std) = if group.len() == 1 {
            (0.0, 1.0)
        } else {
            let mean = group.iter().map(|&r| r as f64).sum::<f64>() / g;
            let var = group
                .iter()
                .map(|&r| (r as f64 - mean).powi(2))
                .sum::<f64>()
                / (g - 1.0);
            (mean, var.sqrt())
        };
        for &r in group {
            let a = r as f64 - mean;
            out.push(if norm_adv_by_std {
                a / (std + ADV_EPS)
            } else {
                a
            } as f32);
        }
    }
    Ok(out)
}

/// The variance floor of [`reinforce_baseline_advantages`]' whitening (OpenRLHF's clamp).
pub const WHITEN_VAR_MIN: f64 = 1e-8;

/// REINFORCE++ with a baseline (OpenRLHF's `reinforce_baseline`, with γ = 1 and the KL as a
/// loss term rather than folded into the reward): `c = r - mean_group(r)` per sample, then
/// whitened over the response tokens of the samples in `whiten` (the trained ones):
/// `A = (c - μ) / sqrt(max(σ², 1e-8))` with `μ = Σ n_s c_s / N` and `σ² = Σ n_s (c_s - μ)² / N`
/// token-weighted (`n_s = lens[s]` response tokens, `N = Σ n_s`; every token of a sample carries
/// its sample's advantage, so this is OpenRLHF's masked mean and biased variance over tokens).
/// Samples outside `whiten` are shifted and scaled the same way. With no tokens to whiten over,
/// `A = c`. Computed in f64, summed in sample order.
pub fn reinforce_baseline_advantages(
    rewards: &[f32],
    group_size: usize,
    lens: &[usize],
    whiten: &[usize],
) -> Result<Vec<f32>> {
    check_len(
        "response lengths (one per sample)",
        rewards.len(),
        lens.len(),
    )?;
    let centred = grpo_advantages(rewards, group_size, false)?;
    if let Some(&s) = whiten.iter().find(|&&s| s >= rewards.len()) {
        return Err(TrainError::Invalid(format!(
            "reinforce_baseline_advantages: sample {s} of {} to whiten over",
            rewards.len()
        )));
    }
    let n: usize = whiten.iter().map(|&s| lens[s]).sum();
    if n == 0 {
        return Ok(centred);
    }
    let mu = whiten
        .iter()
        .map(|&s| lens[s] as f64 * centred[s] as f64)
        .sum::<f64>()
        / n as f64;
    let var = whiten
        .iter()
        .map(|&s| lens[s] as f64 * (centred[s] as f64 - mu).powi(2))
        .sum::<f64>()
        / n as f64;
    let rstd = 1.0 / var.max(WHITEN_VAR_MIN).sqrt();
    Ok(centred
        .iter()
        .map(|&c| ((c as f64 - mu) * rstd) as f32)
        .collect())
}

/// Truncated importance sampling (veRL's `tis_imp_ratio_cap`): the weight
/// `min(exp(old - sampler), cap)` of one token's policy-gradient term, a constant of the loss
/// (no gradient). The policy-gradient term is linear in the advantage and the weight is
/// positive, so the runtime applies it by scaling the token's advantage.
pub fn tis_weight(old_logp: f32, sampler_logp: f32, cap: f64) -> f64 {
    let d = (old_logp as f64 - sampler_logp as f64).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP);
    d.exp().min(cap)
}

/// Repeats each sequence's advantage over its tokens (`offsets` as in [`LossBatch`]).
pub fn broadcast_advantages(per_seq: &[f32], offsets: &[usize]) -> Result<Vec<f32>> {
    check_offsets(offsets)?;
    check_len(
        "advantages (one per sequence)",
        offsets.len() - 1,
        per_seq.len(),
    )?;
    let mut out = Vec::with_capacity(*offsets.last().unwrap_or(&0));
    for (s, &a) in per_seq.iter().enumerate() {
        out.extend(std::iter::repeat_n(a, offsets[s + 1] - offsets[s]));
    }
    Ok(out)
}

/// What the loss needs besides the data: the spec's [`PolicyLoss`] plus the dual-clip bound.
#[derive(Clone, Debug, PartialEq)]
pub struct LossConfig {
    pub clip_low: f64,
    pub clip_high: f64,
    /// Dual-clip constant `c` (> 1; veRL's `clip_ratio_c`, default 3): caps the loss of
    /// negative-advantage tokens at `-A c`. `None` disables it.
    pub dual_clip: Option<f64>,
    pub kl_coef: f64,
    pub kl_estimator: KlEstimator,
    pub agg: LossAgg,
    /// Token or sequence (GSPO) importance ratio.
    pub ratio: RatioLevel,
    /// The maximum response length, `seq_mean_token_sum_norm`'s constant (Dr. GRPO); unused by
    /// the other aggregations.
    pub horizon: usize,
}

impl LossConfig {
    /// The loss of `spec` for responses of at most `horizon` tokens.
    pub fn from_spec(spec: &PolicyLoss, dual_clip: Option<f64>, horizon: usize) -> Result<Self> {
        let cfg = LossConfig {
            clip_low: spec.clip_low,
            clip_high: spec.clip_high,
            dual_clip,
            kl_coef: spec.kl_coef,
            kl_estimator: spec.kl_estimator,
            agg: spec.loss_agg,
            ratio: spec.ratio,
            horizon,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        if self.agg == LossAgg::SeqMeanTokenSumNorm && self.horizon == 0 {
            return Err(TrainError::Invalid(
                "loss_agg = seq_mean_token_sum_norm divides by the maximum response length, which is 0".into(),
            ));
        }
        if !(self.clip_low >= 0.0 && self.clip_low < 1.0) {
            return Err(TrainError::Invalid(format!(
                "clip_low = {} must lie in [0, 1) (the ratio's lower bound is 1 - clip_low)",
                self.clip_low
            )));
        }
        if !(self.clip_high >= 0.0 && self.clip_high.is_finite()) {
            return Err(TrainError::Invalid(format!(
                "clip_high = {} must be finite and >= 0",
                self.clip_high
            )));
        }
        if let Some(c) = self.dual_clip {
            if !(c > 1.0 && c.is_finite()) {
                return Err(TrainError::Invalid(format!(
                    "dual clip constant {c} must be finite and > 1"
                )));
            }
        }
        if !(self.kl_coef >= 0.0 && self.kl_coef.is_finite()) {
            return Err(TrainError::Invalid(format!(
                "kl_coef = {} must be finite and >= 0",
                self.kl_coef
            )));
        }
        Ok(())
    }
}

/// Per-token inputs of one micro-batch. Sequence `s` owns tokens `offsets[s]..offsets[s+1]`
/// of every per-token array (response tokens only, in order).
#[derive(Clone, Copy, Debug)]
pub struct LossBatch<'a, T = f32> {
    pub offsets: &'a [usize],
    /// Log-probs of the current policy (what the gradient is taken with respect to).
    pub logp: &'a [T],
    /// Log-probs of the policy that sampled the responses.
    pub old_logp: &'a [T],
    /// Log-probs of the reference model; required when `kl_coef > 0`.
    pub ref_logp: Option<&'a [T]>,
    /// Per-token advantages.
    pub advantages: &'a [T],
    /// Response mask: true where the token counts.
    pub mask: &'a [bool],
    /// Per-token entropy of the current policy, only reported.
    pub entropy: Option<&'a [T]>,
}

/// The denominators of the aggregation: response tokens and sequences of the whole mini-batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Normaliser {
    pub tokens: usize,
    pub seqs: usize,
}

impl Normaliser {
    /// Counts the masked tokens and the sequences of one micro-batch.
    pub fn of(offsets: &[usize], mask: &[bool]) -> Result<Self> {
        check_offsets(offsets)?;
        check_len("mask", *offsets.last().unwrap_or(&0), mask.len())?;
        Ok(Normaliser {
            tokens: mask.iter().filter(|&&m| m).count(),
            seqs: offsets.len() - 1,
        })
    }

    /// The normaliser of two micro-batches together.
    pub fn merge(self, other: Normaliser) -> Normaliser {
        Normaliser {
            tokens: self.tokens + other.tokens,
            seqs: self.seqs + other.seqs,
        }
    }
}

/// Metrics of one micro-batch, each normalised by the mini-batch [`Normaliser`], so that the
/// metrics of the mini-batch are the sum ([`LossMetrics::add`]) of its micro-batches'.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossMetrics {
    /// `pg_loss + kl_coef * kl`.
    pub loss: f64,
    /// Aggregated clipped surrogate.
    pub pg_loss: f64,
    /// Aggregated KL estimate (before `kl_coef`); 0 without a reference.
    pub kl: f64,
    /// Token mean of "the clipped branch was taken" (`-A clip(ρ) > -A ρ`).
    pub clip_frac: f64,
    /// Token mean of "the dual clip bound was taken" (A < 0 only).
    pub clip_frac_lower: f64,
    /// Token mean of `old_logp - logp` (veRL's `ppo_kl`).
    pub approx_kl: f64,
    /// Aggregated entropy (same mode as the loss), when the batch carried it.
    pub entropy: Option<f64>,
}

impl LossMetrics {
    pub fn add(&mut self, o: &LossMetrics) {
        self.loss += o.loss;
        self.pg_loss += o.pg_loss;
        self.kl += o.kl;
        self.clip_frac += o.clip_frac;
        self.clip_frac_lower += o.clip_frac_lower;
        self.approx_kl += o.approx_kl;
        self.entropy = match (self.entropy, o.entropy) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
    }
}

/// The loss of one micro-batch and its gradient.
#[derive(Clone, Debug)]
pub struct LossOutput<T = f32> {
    /// This micro-batch's share of the mini-batch loss.
    pub loss: f64,
    /// `d loss / d logp` per token (0 on masked-out tokens).
    pub dlogp: Vec<T>,
    pub metrics: LossMetrics,
}

/// The policy loss (f32 inputs, f64 arithmetic, f32 gradient). See the module doc.
pub fn policy_loss(
    cfg: &LossConfig,
    batch: &LossBatch<'_, f32>,
    norm: Normaliser,
) -> Result<LossOutput<f32>> {
    let out = policy_loss_f64(cfg, batch, norm)?;
    Ok(LossOutput {
        loss: out.loss,
        dlogp: out.dlogp.iter().map(|&g| g as f32).collect(),
        metrics: out.metrics,
    })
}

/// The policy loss on inputs of any float type, everything in f64 (also the test reference).
pub fn policy_loss_f64<T: Copy + Into<f64>>(
    cfg: &LossConfig,
    b: &LossBatch<'_, T>,
    norm: Normaliser,
) -> Result<LossOutput<f64>> {
    cfg.validate()?;
    check_offsets(b.offsets)?;
    let n = *b.offsets.last().unwrap_or(&0);
    check_len("logp", n, b.logp.len())?;
    check_len("old_logp", n, b.old_logp.len())?;
    check_len("advantages", n, b.advantages.len())?;
    check_len("mask", n, b.mask.len())?;
    if let Some(r) = b.ref_logp {
        check_len("ref_logp", n, r.len())?;
    }
    if let Some(e) = b.entropy {
        check_len("entropy", n, e.len())?;
    }
    if cfg.kl_coef > 0.0 && b.ref_logp.is_none() {
        return Err(TrainError::Invalid(format!(
            "kl_coef = {} needs reference log-probs, but the batch has none (score the reference, or set kl_coef = 0)",
            cfg.kl_coef
        )));
    }
    let own = Normaliser::of(b.offsets, b.mask)?;
    if own.tokens > norm.tokens || own.seqs > norm.seqs {
        return Err(TrainError::Invalid(format!(
            "the mini-batch normaliser ({} tokens, {} sequences) is smaller than this micro-batch ({} tokens, {} sequences); \
             it must count the whole mini-batch",
            norm.tokens, norm.seqs, own.tokens, own.seqs
        )));
    }
    let inv = |d: usize| if d == 0 { 0.0 } else { 1.0 / d as f64 };
    let inv_tokens = inv(norm.tokens);
    let inv_seqs = inv(norm.seqs);

    let mut dlogp = vec![0.0f64; n];
    let mut m = LossMetrics {
        entropy: b.entropy.map(|_| 0.0),
        ..Default::default()
    };
    for s in 0..b.offsets.len() - 1 {
        let range = b.offsets[s]..b.offsets[s + 1];
        let len = b.mask[range.clone()].iter().filter(|&&x| x).count();
        // Weight of one masked token of this sequence in the aggregate.
        let w = match cfg.agg {
            LossAgg::TokenMean => inv_tokens,
            LossAgg::SeqMeanTokenMean => inv(len) * inv_seqs,
            LossAgg::SeqMeanTokenSum => inv_seqs,
            // one rounding, as the device computes it (the token-sum weight of H S sequences)
            LossAgg::SeqMeanTokenSumNorm => inv(norm.seqs * cfg.horizon),
        };
        // GSPO: the sequence's mean log-ratio over its masked tokens, summed in token order
        // (the device's sequence pass computes the same bits).
        let seq_lr = (cfg.ratio == RatioLevel::Sequence).then(|| {
            let r = range.clone();
            seq_log_ratio(&b.logp[r.clone()], &b.old_logp[r.clone()], &b.mask[r])
        });
        for t in range {
            if !b.mask[t] {
                continue;
            }
            let logp: f64 = b.logp[t].into();
            let old: f64 = b.old_logp[t].into();
            let a: f64 = b.advantages[t].into();
            let raw = seq_lr.unwrap_or(logp - old);
            let tok = token_terms(cfg, raw, a, b.ref_logp.map(|r| (logp, r[t].into())));
            m.pg_loss += w * tok.pg;
            m.kl += w * tok.kl;
            m.clip_frac += inv_tokens * tok.clipped as u8 as f64;
            m.clip_frac_lower += inv_tokens * tok.clipped_lower as u8 as f64;
            m.approx_kl += inv_tokens * -(logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP);
            if let (Some(e), Some(acc)) = (b.entropy, m.entropy.as_mut()) {
                *acc += w * e[t].into();
            }
            dlogp[t] = w * (tok.dpg + cfg.kl_coef * tok.dkl);
        }
    }
    m.loss = m.pg_loss + cfg.kl_coef * m.kl;
    Ok(LossOutput {
        loss: m.loss,
        dlogp,
        metrics: m,
    })
}

/// One token's loss terms and their derivatives w.r.t. logp.
struct TokenTerms {
    pg: f64,
    dpg: f64,
    kl: f64,
    dkl: f64,
    clipped: bool,
    clipped_lower: bool,
}

/// `raw` is the unclamped log-ratio the token's ratio is taken of (its own `logp - old`, or its
/// sequence's mean under GSPO); its derivative w.r.t. the token's `logp` is 1 either way.
/// `kl_of`: the token's `(logp, ref_logp)` when the reference is scored.
fn token_terms(cfg: &LossConfig, raw: f64, a: f64, kl_of: Option<(f64, f64)>) -> TokenTerms {
    let log_ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP);
    let dlog_ratio = if raw.abs() <= LOG_RATIO_CLAMP {
        1.0
    } else {
        0.0
    };
    let ratio = log_ratio.exp();
    let dratio = ratio * dlog_ratio;

    let (lo, hi) = (1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
    let clamped = ratio.clamp(lo, hi);
    let dclamped = if ratio >= lo && ratio <= hi { 1.0 } else { 0.0 };
    let l1 = -a * ratio;
    let l2 = -a * clamped;
    let d1 = -a * dratio;
    let d2 = -a * dclamped * dratio;
    let (mut pg, mut dpg) = max_with_grad(l1, d1, l2, d2);
    let clipped = l2 > l1;
    let mut clipped_lower = false;
    if let Some(c) = cfg.dual_clip {
        if a < 0.0 {
            let l3 = -a * c;
            clipped_lower = pg > l3;
            (pg, dpg) = min_with_grad(l3, 0.0, pg, dpg);
        }
    }

    let (kl, dkl) = match kl_of {
        None => (0.0, 0.0),
        Some((logp, r)) => kl_term(cfg.kl_estimator, logp, r),
    };
    TokenTerms {
        pg,
        dpg,
        kl,
        dkl,
        clipped,
        clipped_lower,
    }
}

/// A KL estimator's value and its derivative w.r.t. `logp`.
pub fn kl_term(est: KlEstimator, logp: f64, ref_logp: f64) -> (f64, f64) {
    let d = logp - ref_logp;
    match est {
        KlEstimator::K1 => (d, 1.0),
        KlEstimator::K2 => (0.5 * d * d, d),
        KlEstimator::K3 => {
            let raw = ref_logp - logp;
            let x = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP);
            let dx = if raw.abs() <= LOG_RATIO_CLAMP {
                -1.0
            } else {
                0.0
            };
            let e = x.exp();
            let v = e - x - 1.0;
            let dv = (e - 1.0) * dx;
            let vc = v.clamp(-K3_CLAMP, K3_CLAMP);
            (vc, if v.abs() <= K3_CLAMP { dv } else { 0.0 })
        }
    }
}

/// `max(x, y)` with torch's gradient rule (ties split the gradient in half).
fn max_with_grad(x: f64, dx: f64, y: f64, dy: f64) -> (f64, f64) {
    if x > y {
        (x, dx)
    } else if y > x {
        (y, dy)
    } else {
        (x, 0.5 * (dx + dy))
    }
}

fn min_with_grad(x: f64, dx: f64, y: f64, dy: f64) -> (f64, f64) {
    if x < y {
        (x, dx)
    } else if y < x {
        (y, dy)
    } else {
        (x, 0.5 * (dx + dy))
    }
}

fn check_offsets(offsets: &[usize]) -> Result<()> {
    if offsets.is_empty() || offsets[0] != 0 {
        return Err(TrainError::Invalid(
            "sequence offsets must start with 0 and have one entry per sequence plus one".into(),
        ));
    }
    if let Some(w) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(TrainError::Invalid(format!(
            "sequence offsets must not decrease (offsets[{}] = {} > offsets[{}] = {})",
            w,
            offsets[w],
            w + 1,
            offsets[w + 1]
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random numbers for tests (splitmix64).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f64 {
            self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
            z ^= z >> 31;
            (z >> 11) as f64 / (1u64 << 53) as f64
        }
        fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
            lo + (hi - lo) * self.next()
        }
    }

    fn cfg(agg: LossAgg, est: KlEstimator, dual: Option<f64>) -> LossConfig {
        LossConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            dual_clip: dual,
            kl_coef: 0.05,
            kl_estimator: est,
            agg,
            ratio: RatioLevel::Token,
            horizon: 0,
        }
    }

    #[test]
    fn grpo_advantages_match_hand_computation() {
        // Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3).
        let a = grpo_advantages(&[1.0, 0.0, 0.0, 1.0, 2.0], 1, true).unwrap();
        // veRL: a group of one has mean 0 and std 1, so A = r / (1 + eps).
        let want = [1.0, 0.0, 0.0, 1.0, 2.0].map(|r: f64| (r / (1.0 + ADV_EPS)) as f32);
        assert_eq!(
            a,
            want.to_vec(),
            "groups of one keep the reward (over 1 + eps)"
        );
        let a = grpo_advantages(&[1.0, 0.0, 0.0, 1.0], 4, true).unwrap();
        let s = (1.0f64 / 3.0).sqrt();
        let want = 0.5 / (s + ADV_EPS);
        assert!(
            (a[0] as f64 - want).abs() < 1e-6 && (a[1] as f64 + want).abs() < 1e-6,
            "{a:?}"
        );
        let a = grpo_advantages(&[3.0, 1.0], 2, false).unwrap();
        assert_eq!(a, vec![1.0, -1.0]);
        // All-equal rewards give zero advantages, not NaN.
        let a = grpo_advantages(&[0.7; 3], 3, true).unwrap();
        assert_eq!(a, vec![0.0; 3]);
        assert!(grpo_advantages(&[1.0; 5], 2, true).is_err());
    }

    #[test]
    fn small_case_by_hand() {
        // Two sequences: [t0, t1] and [t2 (masked out), t3].
        let offsets = [0, 2, 4];
        let logp = [0.0f64, (1.5f64).ln(), -1.0, (0.5f64).ln()];
        let old = [0.0f64, 0.0, -1.0, 0.0];
        let adv = [1.0f64, 1.0, 5.0, -2.0];
        let mask = [true, true, false, true];
        let c = LossConfig {
            clip_low: 0.2,
            clip_high: 0.2,
            dual_clip: None,
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K1,
            agg: LossAgg::TokenMean,
            ratio: RatioLevel::Token,
            horizon: 0,
        };
        let b = LossBatch {
            offsets: &offsets,
            logp: &logp,
            old_logp: &old,
            ref_logp: None,
            advantages: &adv,
            mask: &mask,
            entropy: None,
        };
        let out = policy_loss_f64(&c, &b, Normaliser::of(&offsets, &mask).unwrap()).unwrap();
        // t0: ratio 1, l = -1. t1: ratio 1.5 clipped to 1.2 with A > 0: l = -1.2, grad 0.
        // t3: ratio 0.5, A = -2: max(1.0, 2 * 0.8 = 1.6) = 1.6 (clipped), grad 0.
        let want = (-1.0 - 1.2 + 1.6) / 3.0;
        assert!((out.loss - want).abs() < 1e-12, "{} vs {want}", out.loss);
        assert!((out.dlogp[0] - (-1.0 / 3.0)).abs() < 1e-12);
        assert_eq!(&out.dlogp[1..], &[0.0, 0.0, 0.0]);
        assert!((out.metrics.clip_frac - 2.0 / 3.0).abs() < 1e-12);
        let approx = -(1.5f64.ln() + 0.5f64.ln()) / 3.0;
        assert!((out.metrics.approx_kl - approx).abs() < 1e-12);

        // Dual clip: ratio 4 with A = -2 gives l1 = 8 > l2 = 2.56; c = 1.5 caps it at -A c = 3.
        let logp2 = [(4.0f64).ln()];
        let b2 = LossBatch {
            offsets: &[0, 1],
            logp: &logp2,
            old_logp: &[0.0],
            ref_logp: None,
            advantages: &[-2.0],
            mask: &[true],
            entropy: None,
        };
        let c2 = LossConfig {
            dual_clip: Some(1.5),
            ..c.clone()
        };
        let out2 = policy_loss_f64(&c2, &b2, Normaliser { tokens: 1, seqs: 1 }).unwrap();
        assert!(
            (out2.loss - 3.0).abs() < 1e-12
                && out2.dlogp[0] == 0.0
                && out2.metrics.clip_frac_lower == 1.0
        );
        let out3 = policy_loss_f64(&c, &b2, Normaliser { tokens: 1, seqs: 1 }).unwrap();
        assert!((out3.loss - 8.0).abs() < 1e-12 && (out3.dlogp[0] - 8.0).abs() < 1e-12);
    }

    #[test]
    fn kl_estimators_by_hand() {
        let (k1, d1) = kl_term(KlEstimator::K1, -1.0, -1.5);
        assert_eq!((k1, d1), (0.5, 1.0));
        let (k2, d2) = kl_term(KlEstimator::K2, -1.0, -1.5);
        assert_eq!((k2, d2), (0.125, 0.5));
        let (k3, d3) = kl_term(KlEstimator::K3, -1.0, -1.5);
        let x = -0.5f64;
        assert!((k3 - (x.exp() - x - 1.0)).abs() < 1e-15 && (d3 - (1.0 - x.exp())).abs() < 1e-15);
        // k3 is clamped at 10: no gradient beyond.
        let (k3, d3) = kl_term(KlEstimator::K3, -20.0, -5.0);
        assert_eq!((k3, d3), (10.0, 0.0));
    }

    /// d loss / d logp against central differences in f64, for every mode and estimator.
    #[test]
    fn gradient_matches_finite_differences() {
        let mut rng = Rng(7);
        let lens = [5usize, 1, 7, 0, 4];
        let mut offsets = vec![0];
        for l in lens {
            offsets.push(offsets.last().unwrap() + l);
        }
        let n = *offsets.last().unwrap();
        let old: Vec<f64> = (0..n).map(|_| rng.uniform(-3.0, -0.1)).collect();
        // Ratios spread over both sides of the clip range.
        let logp: Vec<f64> = old.iter().map(|&o| o + rng.uniform(-0.6, 0.6)).collect();
        let refl: Vec<f64> = logp.iter().map(|&l| l + rng.uniform(-1.0, 1.0)).collect();
        let adv: Vec<f64> = (0..n).map(|_| rng.uniform(-2.0, 2.0)).collect();
        let ent: Vec<f64> = (0..n).map(|_| rng.uniform(0.0, 3.0)).collect();
        let mask: Vec<bool> = (0..n).map(|i| i % 4 != 2).collect();
        let norm = Normaliser::of(&offsets, &mask)
            .unwrap()
            .merge(Normaliser { tokens: 3, seqs: 1 });
        let h = 1e-6;
        let mut checked = 0;
        for agg in [
            LossAgg::TokenMean,
            LossAgg::SeqMeanTokenMean,
            LossAgg::SeqMeanTokenSum,
        ] {
            for est in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3] {
                for dual in [None, Some(3.0), Some(1.1)] {
                    let c = cfg(agg, est, dual);
                    let eval = |lp: &[f64]| {
                        let b = LossBatch {
                            offsets: &offsets,
                            logp: lp,
                            old_logp: &old,
                            ref_logp: Some(&refl),
                            advantages: &adv,
                            mask: &mask,
                            entropy: Some(&ent),
                        };
                        policy_loss_f64(&c, &b, norm).unwrap()
                    };
                    let base = eval(&logp);
                    for t in 0..n {
                        let (mut p, mut q) = (logp.clone(), logp.clone());
                        p[t] += h;
                        q[t] -= h;
                        let fd = (eval(&p).loss - eval(&q).loss) / (2.0 * h);
                        let err = (fd - base.dlogp[t]).abs();
                        assert!(
                            err < 1e-7 * (1.0 + fd.abs()),
                            "{agg:?} {est:?} {dual:?} token {t}: fd {fd} vs {}",
                            base.dlogp[t]
                        );
                        checked += 1;
                    }
                    // The gradient is not trivially zero.
                    assert!(base.dlogp.iter().filter(|g| g.abs() > 1e-6).count() > n / 2);
                }
            }
        }
        assert_eq!(checked, 27 * n);
    }

    /// Splitting a mini-batch into micro-batches adds up to the whole (the normaliser is global).
    #[test]
    fn micro_batches_add_up_to_the_mini_batch() {
        let mut rng = Rng(11);
        const OFFSETS: &[usize] = &[0, 3, 8, 10, 16];
        let offsets = OFFSETS;
        let n = 16;
        let v = |rng: &mut Rng, lo, hi| {
            (0..n)
                .map(|_| rng.uniform(lo, hi) as f32)
                .collect::<Vec<f32>>()
        };
        let old = v(&mut rng, -2.0, -0.5);
        let logp: Vec<f32> = old
            .iter()
            .map(|&o| o + rng.uniform(-0.4, 0.4) as f32)
            .collect();
        let refl = v(&mut rng, -2.5, -0.5);
        let adv = v(&mut rng, -1.0, 1.0);
        let mask: Vec<bool> = (0..n).map(|i| i % 5 != 0).collect();
        for agg in [
            LossAgg::TokenMean,
            LossAgg::SeqMeanTokenMean,
            LossAgg::SeqMeanTokenSum,
        ] {
            let c = cfg(agg, KlEstimator::K3, Some(3.0));
            let norm = Normaliser::of(offsets, &mask).unwrap();
            let batch = |o: &'static [usize], a: usize, b: usize| LossBatch {
                offsets: o,
                logp: &logp[a..b],
                old_logp: &old[a..b],
                ref_logp: Some(&refl[a..b]),
                advantages: &adv[a..b],
                mask: &mask[a..b],
                entropy: None,
            };
            let whole = policy_loss(&c, &batch(offsets, 0, n), norm).unwrap();
            let first = policy_loss(&c, &batch(&[0, 3, 8], 0, 8), norm).unwrap();
            let second = policy_loss(&c, &batch(&[0, 2, 8], 8, 16), norm).unwrap();
            let mut m = first.metrics.clone();
            m.add(&second.metrics);
            assert!((m.loss - whole.loss).abs() < 1e-12, "{agg:?}");
            assert!((m.clip_frac - whole.metrics.clip_frac).abs() < 1e-12);
            let split: Vec<f32> = first.dlogp.iter().chain(&second.dlogp).copied().collect();
            assert_eq!(
                split, whole.dlogp,
                "per-token gradients do not depend on the split"
            );
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let c = cfg(LossAgg::TokenMean, KlEstimator::K1, None);
        let z = [0.0f32; 2];
        let b = LossBatch {
            offsets: &[0, 2],
            logp: &z,
            old_logp: &z,
            ref_logp: None,
            advantages: &z,
            mask: &[true, true],
            entropy: None,
        };
        let e = policy_loss(&c, &b, Normaliser { tokens: 2, seqs: 1 })
            .unwrap_err()
            .to_string();
        assert!(e.contains("reference"), "{e}");
        let c0 = LossConfig {
            kl_coef: 0.0,
            ..c.clone()
        };
        assert!(policy_loss(&c0, &b, Normaliser { tokens: 1, seqs: 1 })
            .unwrap_err()
            .to_string()
            .contains("normaliser"));
        let short = LossBatch { logp: &z[..1], ..b };
        assert!(policy_loss(&c0, &short, Normaliser { tokens: 2, seqs: 1 })
            .unwrap_err()
            .to_string()
            .contains("logp"));
        let bad = LossConfig {
            clip_low: 1.5,
            ..c0
        };
        assert!(policy_loss(&bad, &b, Normaliser { tokens: 2, seqs: 1 }).is_err());
    }

    /// One-token-per-value batch helper: `seqs` lists each sequence's (logp - old) per token.
    fn batch_of(seqs: &[&[f64]]) -> (Vec<usize>, Vec<f64>, Vec<f64>) {
        let mut offsets = vec![0];
        let (mut logp, mut old) = (Vec::new(), Vec::new());
        for d in seqs {
            for &x in *d {
                old.push(-1.0);
                logp.push(-1.0 + x);
            }
            offsets.push(logp.len());
        }
        (offsets, logp, old)
    }

    #[test]
    fn dr_grpo_by_hand() {
        // No std: group [1, 0, 0, 0] has mean 0.25, advantages r - 0.25.
        let a = grpo_advantages(&[1.0, 0.0, 0.0, 0.0], 4, false).unwrap();
        assert_eq!(a, vec![0.75, -0.25, -0.25, -0.25]);
        // Two sequences of 1 and 3 tokens, ratio 1, A = 1 and -0.5, H = 4, S = 2:
        // loss = (-1 * 1 + 0.5 * 3) / (4 * 2) = 0.0625, dlogp = -A / 8 per token, whatever
        // the sequence's length (token_sum_norm weighs no sequence by its own length).
        let (offsets, logp, old) = batch_of(&[&[0.0], &[0.0, 0.0, 0.0]]);
        let adv = [1.0, -0.5, -0.5, -0.5];
        let mask = [true; 4];
        let c = LossConfig {
            agg: LossAgg::SeqMeanTokenSumNorm,
            horizon: 4,
            kl_coef: 0.0,
            ..cfg(LossAgg::TokenMean, KlEstimator::K1, None)
        };
        let b = LossBatch {
            offsets: &offsets,
            logp: &logp,
            old_logp: &old,
            ref_logp: None,
            advantages: &adv,
            mask: &mask,
            entropy: None,
        };
        let out = policy_loss_f64(&c, &b, Normaliser::of(&offsets, &mask).unwrap()).unwrap();
        assert!((out.loss - 0.0625).abs() < 1e-15, "{}", out.loss);
        assert_eq!(out.dlogp, vec![-0.125, 0.0625, 0.0625, 0.0625]);
        let no_horizon = LossConfig { horizon: 0, ..c };
        assert!(no_horizon
            .validate()
            .unwrap_err()
            .to_string()
            .contains("maximum response length"));
    }

    #[test]
    fn gspo_by_hand() {
        // Sequence 0: log-ratios [0.1, -0.3], mean -0.1, s = e^-0.1 = 0.904837 inside
        // [0.8, 1.2], A = 2: each token's term -A s = -1.809675, gradient -A s.
        // Sequence 1: log-ratios [0.5, 0.3], mean 0.4, s = e^0.4 = 1.491825 above 1.2 with
        // A = 1 > 0: clipped to -1.2, no gradient. seq_mean_token_mean over S = 2 sequences of
        // 2 tokens: w = 1/4 per token. loss = 2 w (-1.809675) + 2 w (-1.2) = -1.504837;
        // dlogp = w (-2 s) = -0.452419 on sequence 0, 0 on sequence 1; clip_frac 2/4.
        let (offsets, logp, old) = batch_of(&[&[0.1, -0.3], &[0.5, 0.3]]);
        let adv = [2.0, 2.0, 1.0, 1.0];
        let mask = [true; 4];
        let c = LossConfig {
            clip_low: 0.2,
            clip_high: 0.2,
            kl_coef: 0.0,
            ratio: RatioLevel::Sequence,
            ..cfg(LossAgg::SeqMeanTokenMean, KlEstimator::K1, None)
        };
        let b = LossBatch {
            offsets: &offsets,
            logp: &logp,
            old_logp: &old,
            ref_logp: None,
            advantages: &adv,
            mask: &mask,
            entropy: None,
        };
        let out = policy_loss_f64(&c, &b, Normaliser::of(&offsets, &mask).unwrap()).unwrap();
        let s0 = (-0.1f64).exp();
        let want = 0.5 * (-2.0 * s0) + 0.5 * -1.2;
        assert!((out.loss - want).abs() < 1e-12, "{} vs {want}", out.loss);
        assert!((want + 1.504837).abs() < 1e-6);
        for t in 0..2 {
            assert!(
                (out.dlogp[t] - 0.25 * -2.0 * s0).abs() < 1e-12,
                "{:?}",
                out.dlogp
            );
        }
        assert_eq!(&out.dlogp[2..], &[0.0, 0.0]);
        assert!((out.metrics.clip_frac - 0.5).abs() < 1e-15);
        // The same tokens under the token ratio differ: sequence 1's tokens clip one by one
        // (e^0.5, e^0.3 both above 1.2), sequence 0's keep their own ratios.
        let tok = policy_loss_f64(
            &LossConfig {
                ratio: RatioLevel::Token,
                ..c.clone()
            },
            &b,
            Normaliser::of(&offsets, &mask).unwrap(),
        )
        .unwrap();
        assert!((tok.dlogp[0] - 0.25 * -2.0 * 0.1f64.exp()).abs() < 1e-12);
        // With one advantage per sequence and no clipping, the GSPO-token gradient is the
        // gradient of the sequence-level objective: central differences agree.
        let h = 1e-6;
        let loss_at = |lp: &[f64]| {
            let b = LossBatch { logp: lp, ..b };
            policy_loss_f64(&c, &b, Normaliser::of(&offsets, &mask).unwrap())
                .unwrap()
                .loss
        };
        for t in 0..2 {
            let (mut p, mut q) = (logp.clone(), logp.clone());
            p[t] += h;
            q[t] -= h;
            let fd = (loss_at(&p) - loss_at(&q)) / (2.0 * h);
            assert!(
                (fd - out.dlogp[t]).abs() < 1e-8,
                "token {t}: {fd} vs {}",
                out.dlogp[t]
            );
        }
    }

    #[test]
    fn reinforce_baseline_by_hand() {
        // Groups [1, 0] and [1, 1] with 1, 3, 2, 2 response tokens. Centred: [0.5, -0.5, 0, 0].
        // Token mean mu = (0.5 - 1.5) / 8 = -0.125; variance (1 * 0.625^2 + 3 * 0.375^2 +
        // 4 * 0.125^2) / 8 = 0.109375; std 0.330719.
        let a =
            reinforce_baseline_advantages(&[1.0, 0.0, 1.0, 1.0], 2, &[1, 3, 2, 2], &[0, 1, 2, 3])
                .unwrap();
        let sd = 0.109375f64.sqrt();
        let want = [0.625 / sd, -0.375 / sd, 0.125 / sd, 0.125 / sd];
        for (x, w) in a.iter().zip(want) {
            assert!((*x as f64 - w).abs() < 1e-6, "{a:?} vs {want:?}");
        }
        assert!((want[0] - 1.889822).abs() < 1e-6);
        // Whitened over the first group only: mu = -0.25 (1 * 0.5 - 3 * 0.5 over 4 tokens),
        // variance (0.75^2 + 3 * 0.25^2) / 4 = 0.1875; the second group is shifted the same way.
        let a = reinforce_baseline_advantages(&[1.0, 0.0, 1.0, 1.0], 2, &[1, 3, 2, 2], &[0, 1])
            .unwrap();
        let sd = 0.1875f64.sqrt();
        assert!((a[0] as f64 - 0.75 / sd).abs() < 1e-6 && (a[2] as f64 - 0.25 / sd).abs() < 1e-6);
        // No tokens: the centred rewards.
        let a = reinforce_baseline_advantages(&[1.0, 0.0], 2, &[0, 0], &[0, 1]).unwrap();
        assert_eq!(a, vec![0.5, -0.5]);
        assert!(reinforce_baseline_advantages(&[1.0, 0.0], 2, &[1], &[0]).is_err());
        assert!(reinforce_baseline_advantages(&[1.0, 0.0], 2, &[1, 1], &[2]).is_err());
    }

    #[test]
    fn tis_weight_by_hand() {
        // pi_old / pi_sampler = e^(-1 + 1.5) = e^0.5 = 1.648721, under a cap of 2, capped at 1.5.
        assert!((tis_weight(-1.0, -1.5, 2.0) - 0.5f64.exp()).abs() < 1e-12);
        assert_eq!(tis_weight(-1.0, -1.5, 1.5), 1.5);
        assert_eq!(tis_weight(-2.0, -2.0, 1.0), 1.0);
    }
}
