//! The policy loss on the device: [`crate::train::loss::policy_loss`]'s twin
//! (`rollplex_kernels::cuda::policy_loss_f32`) driven by the CPU loss's own types, so that a
//! trainer whose log-probs are on the device computes `dlogp` there and reads the metrics once
//! per optimizer step instead of downloading log-probs and uploading `dlogp` per micro-batch.
//!
//! - [`kernel_params`]: a [`LossConfig`] and the mini-batch [`Normaliser`] as the kernel's
//!   arguments (Dr. GRPO's `seq_mean_token_sum_norm` as the token sum over `horizon x S`
//!   sequences; GSPO's sequence ratio as the kernel's sequence pass); [`loss_metrics`]: the
//!   device sums as a [`LossMetrics`].
//! - [`LossTables`]: the host tables the kernel reads besides the per-token values (each row's
//!   sequence index and mask byte, each sequence's masked token count and row span), built from
//!   where each sequence's tokens lie in the per-token buffers (sequences in any order, as the
//!   trainer's head rows; each sequence's tokens in consecutive rows).
//! - [`policy_loss_device`]: one call (a micro-batch of any number of GRPO groups).
//!
//! What the CPU does per GRPO group (`policy_loss` per group, metrics added) the device does in
//! one call over all groups: each token's gradient depends only on its own values, its
//! sequence's masked count (and, under GSPO, its sequence's mean log-ratio, summed in the
//! CPU's order) and the normaliser, so `dlogp` is the same (bitwise up to the last bit
//! of `exp`, see the kernel's doc) and the metrics agree to rounding (~1e-15 relative).
//! One difference: the reference log-probs are given for all tokens of a call or for none; the
//! CPU, with `kl_coef = 0`, also reports the KL of the groups that happen to carry them.

use std::sync::Arc;

use rollplex_kernels::cuda::{
    policy_loss_f32, CudaStream, Gpu, KlKind, LossAggKind, PolicyLossAcc, PolicyLossInputs,
    PolicyLossParams, PolicyLossSums, RatioKind,
};
use rollplex_plan::spec::{KlEstimator, LossAgg, RatioLevel};

use super::{GpuError, Result};
use crate::train::loss::{LossConfig, LossMetrics, Normaliser};

/// The kernel's arguments for `cfg` over the mini-batch normaliser `norm` (the configuration is
/// checked by the kernel's host side with the CPU's rules).
pub fn kernel_params(cfg: &LossConfig, norm: Normaliser) -> PolicyLossParams {
    PolicyLossParams {
        clip_low: cfg.clip_low,
        clip_high: cfg.clip_high,
        dual_clip: cfg.dual_clip,
        kl_coef: cfg.kl_coef,
        kl: match cfg.kl_estimator {
            KlEstimator::K1 => KlKind::K1,
            KlEstimator::K2 => KlKind::K2,
            KlEstimator::K3 => KlKind::K3,
        },
        agg: match cfg.agg {
            LossAgg::TokenMean => LossAggKind::TokenMean,
            LossAgg::SeqMeanTokenMean => LossAggKind::SeqMeanTokenMean,
            LossAgg::SeqMeanTokenSum | LossAgg::SeqMeanTokenSumNorm => LossAggKind::SeqMeanTokenSum,
        },
        ratio: match cfg.ratio {
            RatioLevel::Token => RatioKind::Token,
            RatioLevel::Sequence => RatioKind::Sequence,
        },
        norm_tokens: norm.tokens,
        // Dr. GRPO's `1 / (H S)` is the token-sum weight `1 / S'` with `S' = H S` sequences.
        norm_seqs: match cfg.agg {
            LossAgg::SeqMeanTokenSumNorm => norm.seqs * cfg.horizon,
            _ => norm.seqs,
        },
    }
}

/// The device sums as the CPU's metrics (the sum of its micro-batches' `LossMetrics`).
pub fn loss_metrics(s: &PolicyLossSums) -> LossMetrics {
    LossMetrics {
        loss: s.loss,
        pg_loss: s.pg_loss,
        kl: s.kl,
        clip_frac: s.clip_frac,
        clip_frac_lower: s.clip_frac_lower,
        approx_kl: s.approx_kl,
        entropy: s.entropy,
    }
}

/// The host tables of one call, to upload beside the per-token values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LossTables {
    /// Per row: the index of the sequence that owns it.
    pub seq: Vec<u32>,
    /// Per row: 1 where the token counts, else 0.
    pub mask: Vec<u8>,
    /// Per sequence: its counted tokens `n_s`.
    pub seq_tokens: Vec<u32>,
    /// Per sequence `s`: its rows `spans[2 s] .. spans[2 s + 1]` (`0 .. 0` when empty), what
    /// the sequence ratio (GSPO) reads.
    pub spans: Vec<u32>,
}

impl LossTables {
    /// The tables of `rows` per-token rows holding sequences given in order as
    /// `(first row, mask)`: sequence `s` owns rows `first .. first + mask.len()` (an empty
    /// sequence owns none, its first row is not looked at). Every row must belong to exactly one
    /// sequence.
    pub fn new(rows: usize, seqs: &[(usize, &[bool])]) -> Result<Self> {
        if u32::try_from(seqs.len()).is_err() || u32::try_from(rows).is_err() {
            return Err(GpuError::Input(format!(
                "policy loss tables: {rows} rows / {} sequences do not fit in 32 bits",
                seqs.len()
            )));
        }
        let mut seq = vec![u32::MAX; rows];
        let mut mask = vec![0u8; rows];
        let mut seq_tokens = Vec::with_capacity(seqs.len());
        let mut spans = Vec::with_capacity(2 * seqs.len());
        for (s, &(first, m)) in seqs.iter().enumerate() {
            if m.is_empty() {
                seq_tokens.push(0);
                spans.extend([0, 0]);
                continue;
            }
            let end = first.checked_add(m.len()).filter(|&e| e <= rows);
            let Some(end) = end else {
                return Err(GpuError::Input(format!(
                    "policy loss tables: sequence {s} (rows {first}..{first}+{}) ends past the \
                     {rows} rows",
                    m.len()
                )));
            };
            for (r, &keep) in (first..end).zip(m) {
                if seq[r] != u32::MAX {
                    return Err(GpuError::Input(format!(
                        "policy loss tables: row {r} belongs to sequences {} and {s}",
                        seq[r]
                    )));
                }
                seq[r] = s as u32;
                mask[r] = keep as u8;
            }
            seq_tokens.push(m.iter().filter(|&&k| k).count() as u32);
            // both fit: end <= rows, which fits in 32 bits (checked above)
            spans.extend([first as u32, end as u32]);
        }
        if let Some(r) = seq.iter().position(|&s| s == u32::MAX) {
            return Err(GpuError::Input(format!(
                "policy loss tables: row {r} belongs to no sequence"
            )));
        }
        Ok(LossTables {
            seq,
            mask,
            seq_tokens,
            spans,
        })
    }

    /// The normaliser of these sequences alone (a micro-batch's share of the mini-batch's).
    pub fn normaliser(&self) -> Normaliser {
        Normaliser {
            tokens: self.seq_tokens.iter().map(|&n| n as usize).sum(),
            seqs: self.seq_tokens.len(),
        }
    }
}

/// The policy loss of one call on the device: `dlogp` for the first `x.tokens` rows and the
/// call's metrics added into `acc` (read them with [`PolicyLossAcc::read`] and
/// [`loss_metrics`]). `norm` counts the whole mini-batch, as on the CPU. Nothing synchronises.
pub fn policy_loss_device(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    cfg: &LossConfig,
    norm: Normaliser,
    x: &PolicyLossInputs<'_>,
    dlogp: &mut impl cudarc::driver::DevicePtrMut<f32>,
    acc: &mut PolicyLossAcc,
) -> Result<()> {
    policy_loss_f32(gpu, stream, dlogp, acc, x, &kernel_params(cfg, norm))?;
    Ok(())
}

#[cfg(test)]
#[path = "loss_tests.rs"]
mod tests;
