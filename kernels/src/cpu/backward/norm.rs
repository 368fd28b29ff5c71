//! `rmsnorm_bwd`: the backward of `rmsnorm_fwd`.

use rayon::prelude::*;

use super::column_sums_add;
use crate::{check_len, Result};

/// Backward of `rmsnorm_fwd` (`y = w * (x * r)`, `r = rsqrt(mean(x²) + eps)` per row).
///
/// `rstd` `[rows]` is the forward's `r`. `dx` `[rows, d]` receives `r (g - x̂ mean(g x̂))` with
/// `x̂ = x r`, `g = dy w` (added if `accumulate_dx`); `dw` `[d]` += `Σ_rows dy x̂` (f64, row order).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_bwd(
    dx: &mut [f32],
    dw: Option<&mut [f32]>,
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    rows: usize,
    d: usize,
    accumulate_dx: bool,
) -> Result<()> {
    const OP: &str = "rmsnorm_bwd";
    check_len(OP, "dx", dx.len(), rows * d)?;
    check_len(OP, "dy", dy.len(), rows * d)?;
    check_len(OP, "x", x.len(), rows * d)?;
    check_len(OP, "w", w.len(), d)?;
    check_len(OP, "rstd", rstd.len(), rows)?;
    if rows == 0 || d == 0 {
        return Ok(());
    }
    dx.par_chunks_mut(d).enumerate().for_each(|(r, dxr)| {
        let (xr, dyr, rs) = (&x[r * d..(r + 1) * d], &dy[r * d..(r + 1) * d], rstd[r]);
        let mut c = 0f64;
        for j in 0..d {
            c += (dyr[j] as f64 * w[j] as f64) * (xr[j] * rs) as f64;
        }
        let c = (c / d as f64) as f32;
        for j in 0..d {
            let xhat = xr[j] * rs;
            let v = rs * (dyr[j] * w[j] - xhat * c);
            if accumulate_dx {
                dxr[j] += v;
            } else {
                dxr[j] = v;
            }
        }
    });
    if let Some(dw) = dw {
        check_len(OP, "dw", dw.len(), d)?;
        column_sums_add(
            dw,
            |r, j| dy[r * d + j] as f64 * (x[r * d + j] * rstd[r]) as f64,
            rows,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::backward::fd::{dotc, fd, to64};
    use crate::cpu::rmsnorm_fwd;
    use crate::cpu::testutil::{rand_vec, rel_err};

    #[test]
    fn rmsnorm_bwd_matches_finite_differences() {
        let eps = 1e-6f32;
        for &(rows, d) in &[(1usize, 1usize), (5, 7), (9, 130)] {
            let (x, w, c) = (
                rand_vec(rows * d, 21),
                rand_vec(d, 22),
                rand_vec(rows * d, 23),
            );
            let f = |xx: &[f64], ww: &[f64]| {
                let mut y = vec![0.0; rows * d];
                for r in 0..rows {
                    let ms = (0..d).map(|j| xx[r * d + j].powi(2)).sum::<f64>() / d as f64;
                    let inv = 1.0 / (ms + eps as f64).sqrt();
                    for j in 0..d {
                        y[r * d + j] = ww[j] * xx[r * d + j] * inv;
                    }
                }
                dotc(&c, &y)
            };
            let mut y = vec![0f32; rows * d];
            let mut rs = vec![0f32; rows];
            rmsnorm_fwd(&mut y, Some(&mut rs), &x, &w, rows, d, eps).unwrap();
            let mut dx = vec![0f32; rows * d];
            let mut dw = vec![0f32; d];
            rmsnorm_bwd(&mut dx, Some(&mut dw), &c, &x, &w, &rs, rows, d, false).unwrap();
            let (x64, w64) = (to64(&x), to64(&w));
            let gx = fd(&x64, |xx| f(xx, &w64));
            let gw = fd(&w64, |ww| f(&x64, ww));
            // d = 1: dx is exactly 0 up to eps; compare absolutely there.
            let ex = rel_err(&dx, &gx);
            assert!(
                ex < 1e-4 || gx.iter().all(|g| g.abs() < 1e-6),
                "dx ({rows},{d}): {ex}"
            );
            assert!(rel_err(&dw, &gw) < 1e-5, "dw ({rows},{d})");
        }
    }
}
