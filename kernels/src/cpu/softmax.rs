//! Row-wise reductions over the vocabulary: `softmax`, `logprobs_fwd` (log-softmax gathered at
//! given token ids, plus entropy), `argmax`.
//!
//! Sums over a row run in f64 in index order: deterministic, and accurate for vocabularies of
//! 150k entries, where an f32 running sum would lose about four digits.

use rayon::prelude::*;

use crate::{check_len, shape_err, Result};

/// Row-wise `out[r, :] = softmax(x[r, :] / temperature)`; `x`, `out` are `[rows, cols]`.
pub fn softmax(
    out: &mut [f32],
    x: &[f32],
    rows: usize,
    cols: usize,
    temperature: f32,
) -> Result<()> {
    const OP: &str = "softmax";
    check_len(OP, "x", x.len(), rows * cols)?;
    check_len(OP, "out", out.len(), rows * cols)?;
    check_temperature(OP, temperature)?;
    if cols == 0 {
        return Ok(());
    }
    out.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .for_each(|(o, xr)| {
            let lse = row_lse(xr, temperature);
            for (o, v) in o.iter_mut().zip(xr) {
                *o = ((*v as f64 / temperature as f64) - lse).exp() as f32;
            }
        });
    Ok(())
}

fn check_temperature(op: &'static str, t: f32) -> Result<()> {
    if !(t > 0.0 && t.is_finite()) {
        return Err(shape_err(
            op,
            format!("temperature must be positive and finite, got {t}"),
        ));
    }
    Ok(())
}

/// `log sum_j exp(x_j / t)` in f64.
fn row_lse(xr: &[f32], t: f32) -> f64 {
    let t = t as f64;
    let m = xr
        .iter()
        .fold(f64::NEG_INFINITY, |m, v| m.max(*v as f64 / t));
    if m == f64::NEG_INFINITY {
        return m;
    }
    let s: f64 = xr.iter().map(|v| (*v as f64 / t - m).exp()).sum();
    m + s.ln()
}

/// Per-token log-probabilities of given targets, with entropy.
///
/// `logits` `[rows, vocab]`, `targets` `[rows]`; with `z = logits / temperature`:
/// `logp[r] = z[r, targets[r]] - lse_r`, `entropy[r] = lse_r - sum_j p_j z_j`,
/// `lse[r] = log sum_j exp z[r, j]` (for backward: `d logp / d z = onehot - exp(z - lse)`).
#[allow(clippy::too_many_arguments)]
pub fn logprobs_fwd(
    logp: &mut [f32],
    entropy: Option<&mut [f32]>,
    lse: Option<&mut [f32]>,
    logits: &[f32],
    targets: &[u32],
    rows: usize,
    vocab: usize,
    temperature: f32,
) -> Result<()> {
    const OP: &str = "logprobs_fwd";
    check_len(OP, "logits", logits.len(), rows * vocab)?;
    check_len(OP, "targets", targets.len(), rows)?;
    check_len(OP, "logp", logp.len(), rows)?;
    check_temperature(OP, temperature)?;
    if let Some(bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(shape_err(
            OP,
            format!("target id {bad} outside the vocabulary of {vocab}"),
        ));
    }
    let mut ent_tmp = Vec::new();
    let entropy = match entropy {
        Some(e) => {
            check_len(OP, "entropy", e.len(), rows)?;
            e
        }
        None => {
            ent_tmp.resize(rows, 0.0);
            &mut ent_tmp[..]
        }
    };
    let mut lse_tmp = Vec::new();
    let lse = match lse {
        Some(l) => {
            check_len(OP, "lse", l.len(), rows)?;
            l
        }
        None => {
            lse_tmp.resize(rows, 0.0);
            &mut lse_tmp[..]
        }
    };
    if vocab == 0 {
        return Ok(());
    }
    let t = temperature as f64;
    logp.par_iter_mut()
        .zip(entropy.par_iter_mut())
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each(|(r, ((lp, ent), ls))| {
            let xr = &logits[r * vocab..(r + 1) * vocab];
            let l = row_lse(xr, temperature);
            let pz: f64 = xr
                .iter()
                .map(|v| {
                    let z = *v as f64 / t;
                    (z - l).exp() * z
                })
                .sum();
            *lp = (xr[targets[r] as usize] as f64 / t - l) as f32;
            *ent = (l - pz) as f32;
            *ls = l as f32;
        });
    Ok(())
}

/// `out[r] = argmax_j x[r, j]`, the first index on ties (as `torch.argmax`); `x` is `[rows, cols]`.
/// NaN entries never win.
pub fn argmax(out: &mut [u32], x: &[f32], rows: usize, cols: usize) -> Result<()> {
    const OP: &str = "argmax";
    check_len(OP, "x", x.len(), rows * cols)?;
    check_len(OP, "out", out.len(), rows)?;
    if cols == 0 {
        return Err(shape_err(OP, "argmax of an empty row".into()));
    }
    out.par_iter_mut()
        .zip(x.par_chunks(cols))
        .for_each(|(o, xr)| {
            let mut best = 0usize;
            let mut bv = f32::NEG_INFINITY;
            for (j, v) in xr.iter().enumerate() {
                if *v > bv {
                    bv = *v;
                    best = j;
                }
            }
            *o = best as u32;
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{rand_vec, rel_err};

    #[test]
    fn softmax_and_logprobs_match_f64_reference() {
        let (rows, vocab) = (6, 1003);
        let x: Vec<f32> = rand_vec(rows * vocab, 11).iter().map(|v| v * 9.0).collect();
        let targets: Vec<u32> = (0..rows as u32).map(|r| (r * 157) % vocab as u32).collect();
        for &t in &[1.0f32, 0.7] {
            let mut sm = vec![0f32; rows * vocab];
            softmax(&mut sm, &x, rows, vocab, t).unwrap();
            let (mut lp, mut ent, mut lse) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
            logprobs_fwd(
                &mut lp,
                Some(&mut ent),
                Some(&mut lse),
                &x,
                &targets,
                rows,
                vocab,
                t,
            )
            .unwrap();
            let mut w_sm = vec![0f64; rows * vocab];
            let (mut w_lp, mut w_ent, mut w_lse) =
                (vec![0f64; rows], vec![0f64; rows], vec![0f64; rows]);
            for r in 0..rows {
                let z: Vec<f64> = x[r * vocab..(r + 1) * vocab]
                    .iter()
                    .map(|v| *v as f64 / t as f64)
                    .collect();
                let l = z.iter().map(|v| v.exp()).sum::<f64>().ln();
                for j in 0..vocab {
                    w_sm[r * vocab + j] = (z[j] - l).exp();
                }
                w_lp[r] = z[targets[r] as usize] - l;
                w_ent[r] = -z.iter().map(|v| (v - l).exp() * (v - l)).sum::<f64>();
                w_lse[r] = l;
            }
            assert!(rel_err(&sm, &w_sm) < 1e-6);
            assert!(rel_err(&lp, &w_lp) < 1e-6);
            assert!(rel_err(&ent, &w_ent) < 1e-6);
            assert!(rel_err(&lse, &w_lse) < 1e-6);
        }
        let mut lp = vec![0f32; 1];
        assert!(logprobs_fwd(
            &mut lp,
            None,
            None,
            &x[..vocab],
            &[vocab as u32],
            1,
            vocab,
            1.0
        )
        .is_err());
        assert!(logprobs_fwd(&mut lp, None, None, &x[..vocab], &[0], 1, vocab, 0.0).is_err());
    }

    #[test]
    fn argmax_first_of_ties() {
        let x = vec![1.0, 3.0, 3.0, 0.0, f32::NAN, -1.0, -2.0, -1.0];
        let mut o = vec![9u32; 2];
        argmax(&mut o, &x, 2, 4).unwrap();
        assert_eq!(o, vec![1, 1]);
        let x = rand_vec(3 * 50, 4);
        let mut o = vec![0u32; 3];
        argmax(&mut o, &x, 3, 50).unwrap();
        for r in 0..3 {
            let row = &x[r * 50..(r + 1) * 50];
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(row[o[r] as usize], m);
        }
    }
}
