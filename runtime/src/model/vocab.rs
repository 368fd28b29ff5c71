//! The vocab-parallel lm head's reductions on one rank: log-softmax statistics without
//! gathering logits ([`RankModel::vocab_logprobs`]), the greedy token
//! ([`RankModel::greedy`]) and full logit rows when a caller needs them
//! ([`RankModel::gather_logits`]). A rank holds the logits of its vocabulary range
//! `[n, V_rank]`; over `SoloComm` that is the whole vocabulary and every collective is a no-op.

use super::text::input;
use super::{ModelError, RankModel};
use crate::tp::{all_gather_uneven, Communicator, ReduceOp};

/// Log-probs `[n]`, entropies `[n]` and each row's log-sum-exp of `logits / T` (f64) `[n]`.
pub(crate) type LogprobsLse = (Vec<f32>, Vec<f32>, Vec<f64>);

impl RankModel<'_> {
    /// Vocab-parallel log-softmax at given targets: this rank's logits `[n, V_rank]`, global
    /// target ids `[n]` -> (log p(target), entropy), both `[n]`, equal on every rank.
    ///
    /// With `z = logits / temperature`, as `logprobs_fwd` computes it: `m = max z` (all-reduce
    /// Max), `s = sum exp(z - m)` in f64 (all-reduce Sum), `lse = m + ln s`; then
    /// `sum exp(z - lse) z` in f64 and the target's `z` (owning rank; others add 0) in one
    /// all-reduce Sum. At degree 1 every number is bitwise the kernel's.
    pub fn vocab_logprobs<C: Communicator>(
        &self,
        comm: &C,
        logits: &[f32],
        targets: &[u32],
        temperature: f32,
    ) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let (logp, ent, _) = self.vocab_logprobs_lse(comm, logits, targets, temperature)?;
        Ok((logp, ent))
    }

    /// [`RankModel::vocab_logprobs`] plus each row's global log-sum-exp of `z` (f64, what the
    /// backward reads).
    pub(crate) fn vocab_logprobs_lse<C: Communicator>(
        &self,
        comm: &C,
        logits: &[f32],
        targets: &[u32],
        temperature: f32,
    ) -> Result<LogprobsLse, ModelError> {
        let n = targets.len();
        let range = self.dims.vocab.clone();
        let vl = range.len();
        if logits.len() != n * vl {
            return Err(input(format!(
                "vocab_logprobs: {} logits for {n} rows of this rank's {vl} vocabulary entries",
                logits.len()
            )));
        }
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(input(format!(
                "temperature must be positive and finite, got {temperature}"
            )));
        }
        if let Some(bad) = targets.iter().find(|&&x| x as usize >= self.vocab()) {
            return Err(input(format!(
                "target id {bad} outside the vocabulary of {}",
                self.vocab()
            )));
        }
        let tt = temperature as f64;
        let rows = |r: usize| &logits[r * vl..(r + 1) * vl];
        let mut m: Vec<f64> = (0..n)
            .map(|r| {
                rows(r)
                    .iter()
                    .fold(f64::NEG_INFINITY, |m, v| m.max(*v as f64 / tt))
            })
            .collect();
        comm.all_reduce(&mut m, ReduceOp::Max)?;
        let mut s: Vec<f64> = (0..n)
            .map(|r| {
                if m[r] == f64::NEG_INFINITY {
                    return 0.0;
                }
                rows(r).iter().map(|v| (*v as f64 / tt - m[r]).exp()).sum()
            })
            .collect();
        comm.all_reduce_sum(&mut s)?;
        let lse: Vec<f64> = (0..n)
            .map(|r| {
                if m[r] == f64::NEG_INFINITY {
                    m[r]
                } else {
                    m[r] + s[r].ln()
                }
            })
            .collect();
        // [pz_0, zt_0, pz_1, zt_1, ...]
        let mut pz = vec![0f64; 2 * n];
        for r in 0..n {
            pz[2 * r] = rows(r)
                .iter()
                .map(|v| {
                    let z = *v as f64 / tt;
                    (z - lse[r]).exp() * z
                })
                .sum();
            let tg = targets[r] as usize;
            if range.contains(&tg) {
                pz[2 * r + 1] = rows(r)[tg - range.start] as f64 / tt;
            }
        }
        comm.all_reduce_sum(&mut pz)?;
        let logp = (0..n).map(|r| (pz[2 * r + 1] - lse[r]) as f32).collect();
        let ent = (0..n).map(|r| (lse[r] - pz[2 * r]) as f32).collect();
        Ok((logp, ent, lse))
    }

    /// Greedy tokens of rows of this rank's logits `[n, V_rank]`: the first index of the
    /// largest logit over the whole vocabulary (NaN never wins; as `argmax`). Equal on every
    /// rank.
    pub fn greedy<C: Communicator>(
        &self,
        comm: &C,
        logits: &[f32],
    ) -> Result<Vec<u32>, ModelError> {
        let range = self.dims.vocab.clone();
        let vl = range.len();
        if vl == 0 || !logits.len().is_multiple_of(vl) {
            return Err(input(format!(
                "greedy: {} logits are not rows of this rank's {vl} vocabulary entries",
                logits.len()
            )));
        }
        let n = logits.len() / vl;
        // (value, global index) per row; f64 holds both exactly
        let mut mine = vec![0f64; 2 * n];
        for (r, row) in logits.chunks(vl).enumerate() {
            let mut best = 0usize;
            let mut bv = f32::NEG_INFINITY;
            for (j, v) in row.iter().enumerate() {
                if *v > bv {
                    bv = *v;
                    best = j;
                }
            }
            mine[2 * r] = bv as f64;
            mine[2 * r + 1] = (range.start + best) as f64;
        }
        let w = comm.world();
        let mut all = vec![0f64; 2 * n * w];
        comm.all_gather(&mine, &mut all)?;
        Ok((0..n)
            .map(|r| {
                // ranks own ascending ranges: a strictly larger value on a later rank wins
                let mut bv = all[2 * r];
                let mut bi = all[2 * r + 1];
                for k in 1..w {
                    let v = all[k * 2 * n + 2 * r];
                    if v > bv {
                        bv = v;
                        bi = all[k * 2 * n + 2 * r + 1];
                    }
                }
                bi as u32
            })
            .collect())
    }

    /// Full logit rows `[n, V]` from every rank's `[n, V_rank]` (an all-gather, then each row
    /// assembled in vocabulary order).
    pub fn gather_logits<C: Communicator>(
        &self,
        comm: &C,
        logits: &[f32],
    ) -> Result<Vec<f32>, ModelError> {
        let counts = self.vocab_counts();
        let vl = counts[self.rank];
        if vl == 0 || !logits.len().is_multiple_of(vl) {
            return Err(input(format!(
                "gather_logits: {} logits are not rows of this rank's {vl} vocabulary entries",
                logits.len()
            )));
        }
        let n = logits.len() / vl;
        let all_counts: Vec<usize> = counts.iter().map(|c| c * n).collect();
        let all = all_gather_uneven(comm, logits, &all_counts)?;
        let v = self.vocab();
        let mut out = vec![0f32; n * v];
        let (mut off, mut col) = (0, 0);
        for &c in &counts {
            for r in 0..n {
                out[r * v + col..r * v + col + c]
                    .copy_from_slice(&all[off + r * c..off + (r + 1) * c]);
            }
            off += c * n;
            col += c;
        }
        Ok(out)
    }
}
