//! `linear_bwd`: the backward of `linear_fwd`.

use super::column_sums_add;
use crate::cpu::matmul::{matmul, Gemm};
use crate::{check_len, Result};

/// Backward of `linear_fwd` (`y[m, n] = x[m, k] w[n, k]^T + b[n]`).
///
/// `dx` `[m, k]` receives `dy w` (added if `accumulate_dx`); `dw` `[n, k]` += `dyᵀ x`;
/// `db` `[n]` += the column sums of `dy` (in row order, f64). Any of the three may be skipped.
#[allow(clippy::too_many_arguments)]
pub fn linear_bwd(
    dx: Option<&mut [f32]>,
    dw: Option<&mut [f32]>,
    db: Option<&mut [f32]>,
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    accumulate_dx: bool,
) -> Result<()> {
    const OP: &str = "linear_bwd";
    check_len(OP, "dy", dy.len(), m * n)?;
    check_len(OP, "x", x.len(), m * k)?;
    check_len(OP, "w", w.len(), n * k)?;
    if let Some(dx) = dx {
        check_len(OP, "dx", dx.len(), m * k)?;
        let g = Gemm::nn(m, n, k);
        matmul(dx, dy, w, if accumulate_dx { g.accumulate() } else { g })?;
    }
    if let Some(dw) = dw {
        check_len(OP, "dw", dw.len(), n * k)?;
        // dW[n, k] += dy[m, n]^T x[m, k]
        matmul(dw, dy, x, Gemm::tn(n, m, k).accumulate())?;
    }
    if let Some(db) = db {
        check_len(OP, "db", db.len(), n)?;
        column_sums_add(db, |r, j| dy[r * n + j] as f64, m);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::backward::fd::{dotc, fd, to64};
    use crate::cpu::testutil::{rand_vec, rel_err};

    fn linear64(x: &[f64], w: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = b[j] + (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum::<f64>();
            }
        }
        y
    }

    #[test]
    fn linear_bwd_matches_finite_differences() {
        for (seed, &(m, k, n)) in [(3usize, 5usize, 4usize), (9, 17, 6), (70, 40, 33)]
            .iter()
            .enumerate()
        {
            let s = seed as u64 * 10;
            let (x, w, b, c) = (
                rand_vec(m * k, s + 1),
                rand_vec(n * k, s + 2),
                rand_vec(n, s + 3),
                rand_vec(m * n, s + 4),
            );
            let (x64, w64, b64) = (to64(&x), to64(&w), to64(&b));
            let mut dx = vec![0f32; m * k];
            let dw0 = rand_vec(n * k, s + 5);
            let mut dw = dw0.clone();
            let mut db = vec![0.5f32; n];
            linear_bwd(
                Some(&mut dx),
                Some(&mut dw),
                Some(&mut db),
                &c,
                &x,
                &w,
                m,
                k,
                n,
                false,
            )
            .unwrap();
            let gx = fd(&x64, |xx| dotc(&c, &linear64(xx, &w64, &b64, m, k, n)));
            let gw = fd(&w64, |ww| dotc(&c, &linear64(&x64, ww, &b64, m, k, n)));
            let gb = fd(&b64, |bb| dotc(&c, &linear64(&x64, &w64, bb, m, k, n)));
            assert!(
                rel_err(&dx, &gx) < 1e-5,
                "dx ({m},{k},{n}): {}",
                rel_err(&dx, &gx)
            );
            let dw_new: Vec<f32> = dw.iter().zip(&dw0).map(|(a, b)| a - b).collect();
            assert!(rel_err(&dw_new, &gw) < 1e-5, "dw accumulates");
            let db_new: Vec<f32> = db.iter().map(|v| v - 0.5).collect();
            assert!(rel_err(&db_new, &gb) < 1e-5, "db accumulates");
            // accumulate_dx adds
            let mut dx2 = vec![1.0f32; m * k];
            linear_bwd(Some(&mut dx2), None, None, &c, &x, &w, m, k, n, true).unwrap();
            assert!(dx2.iter().zip(&dx).all(|(a, b)| (a - 1.0 - b).abs() < 1e-5));
        }
        assert!(
            linear_bwd(None, None, None, &[0.0; 5], &[0.0; 4], &[0.0; 6], 2, 2, 3, false).is_err()
        );
    }
}
