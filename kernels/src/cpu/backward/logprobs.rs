//! `logprobs_bwd`: the backward of `logprobs_fwd`.

use rayon::prelude::*;

use crate::{check_len, shape_err, Result};

/// Backward of `logprobs_fwd`: `dlogits[rows, vocab]` (written) from `dlogp[rows]` and, when
/// given, `dentropy[rows]`. With `z = logits / T`, `p = softmax(z)`:
/// `dz_j = dlogp (1[j = target] - p_j) - dentropy p_j (z_j - Σ_k p_k z_k)`, `dlogits = dz / T`.
/// The row's log-sum-exp and `Σ p z` are recomputed in f64 (as the forward sums them).
#[allow(clippy::too_many_arguments)]
pub fn logprobs_bwd(
    dlogits: &mut [f32],
    dlogp: &[f32],
    dentropy: Option<&[f32]>,
    logits: &[f32],
    targets: &[u32],
    rows: usize,
    vocab: usize,
    temperature: f32,
) -> Result<()> {
    const OP: &str = "logprobs_bwd";
    check_len(OP, "dlogits", dlogits.len(), rows * vocab)?;
    check_len(OP, "logits", logits.len(), rows * vocab)?;
    check_len(OP, "dlogp", dlogp.len(), rows)?;
    check_len(OP, "targets", targets.len(), rows)?;
    if let Some(de) = dentropy {
        check_len(OP, "dentropy", de.len(), rows)?;
    }
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(shape_err(
            OP,
            format!("temperature must be positive and finite, got {temperature}"),
        ));
    }
    if let Some(bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(shape_err(
            OP,
            format!("target id {bad} outside the vocabulary of {vocab}"),
        ));
    }
    if vocab == 0 {
        return Ok(());
    }
    let t = temperature as f64;
    dlogits
        .par_chunks_mut(vocab)
        .enumerate()
        .for_each(|(r, dr)| {
            let xr = &logits[r * vocab..(r + 1) * vocab];
            let m = xr
                .iter()
                .fold(f64::NEG_INFINITY, |m, v| m.max(*v as f64 / t));
            let s: f64 = xr.iter().map(|v| (*v as f64 / t - m).exp()).sum();
            let lse = m + s.ln();
            let gl = dlogp[r] as f64;
            let ge = dentropy.map_or(0.0, |d| d[r] as f64);
            let ez = if ge != 0.0 {
                xr.iter()
                    .map(|v| {
                        let z = *v as f64 / t;
                        (z - lse).exp() * z
                    })
                    .sum::<f64>()
            } else {
                0.0
            };
            for (j, (o, v)) in dr.iter_mut().zip(xr).enumerate() {
                let z = *v as f64 / t;
                let p = (z - lse).exp();
                let onehot = if j == targets[r] as usize { 1.0 } else { 0.0 };
                let dz = gl * (onehot - p) - ge * p * (z - ez);
                *o = (dz / t) as f32;
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::backward::fd::{fd, to64};
    use crate::cpu::logprobs_fwd;
    use crate::cpu::testutil::{rand_vec, rel_err};

    #[test]
    fn logprobs_bwd_matches_finite_differences() {
        let (rows, vocab) = (4, 37);
        let logits: Vec<f32> = rand_vec(rows * vocab, 61).iter().map(|v| v * 4.0).collect();
        let targets = [3u32, 0, 36, 17];
        let (cl, ce) = (rand_vec(rows, 62), rand_vec(rows, 63));
        for temp in [1.0f32, 0.7] {
            let f = |z: &[f64]| {
                let mut s = 0.0;
                for r in 0..rows {
                    let zr: Vec<f64> = z[r * vocab..(r + 1) * vocab]
                        .iter()
                        .map(|v| v / temp as f64)
                        .collect();
                    let m = zr.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let lse = m + zr.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                    let logp = zr[targets[r] as usize] - lse;
                    let ent = lse - zr.iter().map(|v| (v - lse).exp() * v).sum::<f64>();
                    s += cl[r] as f64 * logp + ce[r] as f64 * ent;
                }
                s
            };
            let mut dl = vec![0f32; rows * vocab];
            logprobs_bwd(
                &mut dl,
                &cl,
                Some(&ce),
                &logits,
                &targets,
                rows,
                vocab,
                temp,
            )
            .unwrap();
            assert!(rel_err(&dl, &fd(&to64(&logits), f)) < 1e-6, "T = {temp}");
            // Without entropy: only the logp term.
            let f1 = |z: &[f64]| {
                let mut s = 0.0;
                for r in 0..rows {
                    let zr: Vec<f64> = z[r * vocab..(r + 1) * vocab]
                        .iter()
                        .map(|v| v / temp as f64)
                        .collect();
                    let m = zr.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let lse = m + zr.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                    s += cl[r] as f64 * (zr[targets[r] as usize] - lse);
                }
                s
            };
            logprobs_bwd(&mut dl, &cl, None, &logits, &targets, rows, vocab, temp).unwrap();
            assert!(rel_err(&dl, &fd(&to64(&logits), f1)) < 1e-6);
        }
        let mut lp = vec![0f32; rows];
        logprobs_fwd(&mut lp, None, None, &logits, &targets, rows, vocab, 1.0).unwrap();
        let mut dl = vec![0f32; rows * vocab];
        assert!(logprobs_bwd(
            &mut dl,
            &cl,
            None,
            &logits,
            &[0, 0, 0, 37],
            rows,
            vocab,
            1.0
        )
        .is_err());
    }
}
