//! The sequence-level pass of the policy loss under GSPO's sequence ratio: one sequence's mean
//! log-ratio over its counted tokens. The CPU loss (`runtime::train::loss`) takes it from here,
//! and the device's `policy_loss_seq_ratio_f64` computes the same bits (the same f64 operations
//! in the same order).

/// The mean of `logp - old_logp` over the tokens where `mask` is set: the differences in f64,
/// summed in token order, times `1 / n` (`n` the counted tokens; 0 when none counts).
///
/// The three slices are one sequence's tokens, of equal length (callers check the lengths
/// against the batch; a mismatch here is a bug and panics).
pub fn seq_log_ratio<T: Copy + Into<f64>>(logp: &[T], old_logp: &[T], mask: &[bool]) -> f64 {
    assert!(
        logp.len() == old_logp.len() && logp.len() == mask.len(),
        "seq_log_ratio: {} log-probs, {} old log-probs, {} mask entries",
        logp.len(),
        old_logp.len(),
        mask.len()
    );
    let (mut sum, mut n) = (0.0f64, 0usize);
    for ((&lp, &old), &m) in logp.iter().zip(old_logp).zip(mask) {
        if m {
            let (lp, old): (f64, f64) = (lp.into(), old.into());
            sum += lp - old;
            n += 1;
        }
    }
    let inv_n = if n == 0 { 0.0 } else { 1.0 / n as f64 };
    sum * inv_n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_over_counted_tokens_in_token_order() {
        // counted: 0.5 - (-0.25) = 0.75 and -1 - 0 = -1; the masked-out token is not read
        let lp = [0.5f32, f32::NAN, -1.0];
        let old = [-0.25f32, 3.0, 0.0];
        let m = seq_log_ratio(&lp, &old, &[true, false, true]);
        assert_eq!(m, (0.75f64 + -1.0) * (1.0 / 2.0));
        assert_eq!(seq_log_ratio(&lp, &old, &[false; 3]), 0.0);
        assert_eq!(seq_log_ratio::<f32>(&[], &[], &[]), 0.0);
        // one token: its own log-ratio
        assert_eq!(seq_log_ratio(&[-2.0f64], &[-2.5], &[true]), 0.5);
        // the sum runs left to right: 1e16 + 1 + -1e16 is 0 in that order, not 1
        let lp = [1e16f64, 1.0, -1e16];
        assert_eq!(seq_log_ratio(&lp, &[0.0; 3], &[true; 3]), 0.0);
    }

    #[test]
    #[should_panic(expected = "seq_log_ratio")]
    fn unequal_lengths_are_a_bug() {
        seq_log_ratio(&[0.0f32; 2], &[0.0f32; 3], &[true; 2]);
    }
}
