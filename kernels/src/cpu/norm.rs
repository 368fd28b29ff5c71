//! RMSNorm (`Qwen2_5_VLRMSNorm`): `y = w * (x * rsqrt(mean(x^2) + eps))`, row by row.
//!
//! The mean of squares is summed in f64 in index order (deterministic, exact enough that the
//! f32 result is the correctly rounded one in practice); the rest is f32 in the order Hugging
//! Face writes it: first `x * r`, then `w * (x * r)`.

use rayon::prelude::*;

use crate::{check_len, Result};

/// `y[rows, d] = w[d] * (x * rsqrt(mean_j x[r, j]^2 + eps))`.
/// `rstd[rows]`, when given, receives `rsqrt(mean + eps)` per row (what backward needs).
pub fn rmsnorm_fwd(
    y: &mut [f32],
    rstd: Option<&mut [f32]>,
    x: &[f32],
    w: &[f32],
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "rmsnorm_fwd";
    check_len(OP, "x", x.len(), rows * d)?;
    check_len(OP, "y", y.len(), rows * d)?;
    check_len(OP, "w", w.len(), d)?;
    if rows == 0 || d == 0 {
        return Ok(());
    }
    let row = |(yr, xr): (&mut [f32], &[f32])| -> f32 {
        let ss: f64 = xr.iter().map(|v| (*v as f64) * (*v as f64)).sum();
        let var = (ss / d as f64) as f32;
        let r = 1.0 / (var + eps).sqrt();
        for ((o, xv), wv) in yr.iter_mut().zip(xr).zip(w) {
            *o = wv * (xv * r);
        }
        r
    };
    match rstd {
        Some(rs) => {
            check_len(OP, "rstd", rs.len(), rows)?;
            y.par_chunks_mut(d)
                .zip(x.par_chunks(d))
                .zip(rs.par_iter_mut())
                .for_each(|(p, r)| *r = row(p));
        }
        None => y.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|p| {
            row(p);
        }),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{rand_vec, rel_err};

    #[test]
    fn rmsnorm_matches_f64_reference() {
        for &(rows, d, eps) in &[(1, 1, 1e-6f32), (7, 33, 1e-6), (64, 1280, 1e-5)] {
            let x = rand_vec(rows * d, 3);
            let w = rand_vec(d, 4);
            let mut y = vec![0f32; rows * d];
            let mut rs = vec![0f32; rows];
            rmsnorm_fwd(&mut y, Some(&mut rs), &x, &w, rows, d, eps).unwrap();
            let mut want = vec![0f64; rows * d];
            let mut want_r = vec![0f64; rows];
            for r in 0..rows {
                let xr = &x[r * d..(r + 1) * d];
                let ms = xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
                let inv = 1.0 / (ms + eps as f64).sqrt();
                want_r[r] = inv;
                for j in 0..d {
                    want[r * d + j] = w[j] as f64 * xr[j] as f64 * inv;
                }
            }
            assert!(rel_err(&y, &want) < 1e-6, "({rows},{d})");
            assert!(rel_err(&rs, &want_r) < 1e-6);
        }
        let mut y = vec![0f32; 6];
        assert!(rmsnorm_fwd(&mut y, None, &[0.0; 6], &[1.0; 4], 2, 3, 1e-6).is_err());
    }
}
