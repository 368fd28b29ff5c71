//! `rope_bwd`: the backward of `rope_fwd` (the transposed rotation, in place).

use rayon::prelude::*;

use crate::{check_len, shape_err, Result};

/// Backward of `rope_fwd`, in place: `dx[tokens, heads, head_dim]` holds `dy` on entry and the
/// gradient of the unrotated input on exit (`dx1 = dy1 c1 + dy2 s2`, `dx2 = dy2 c2 - dy1 s1`).
pub fn rope_bwd(
    dx: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
) -> Result<()> {
    const OP: &str = "rope_bwd";
    if !head_dim.is_multiple_of(2) {
        return Err(shape_err(OP, format!("head_dim {head_dim} is odd")));
    }
    check_len(OP, "dx", dx.len(), tokens * heads * head_dim)?;
    check_len(OP, "cos", cos.len(), tokens * head_dim)?;
    check_len(OP, "sin", sin.len(), tokens * head_dim)?;
    if tokens == 0 || heads == 0 || head_dim == 0 {
        return Ok(());
    }
    let half = head_dim / 2;
    dx.par_chunks_mut(heads * head_dim)
        .enumerate()
        .for_each(|(t, xt)| {
            let c = &cos[t * head_dim..(t + 1) * head_dim];
            let s = &sin[t * head_dim..(t + 1) * head_dim];
            for xh in xt.chunks_mut(head_dim) {
                for i in 0..half {
                    let (d1, d2) = (xh[i], xh[i + half]);
                    xh[i] = d1 * c[i] + d2 * s[i + half];
                    xh[i + half] = d2 * c[i + half] - d1 * s[i];
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::backward::fd::{fd, to64};
    use crate::cpu::testutil::{rand_vec, rel_err};

    #[test]
    fn rope_bwd_matches_finite_differences() {
        let (t, h, d) = (4, 3, 8);
        let x = rand_vec(t * h * d, 31);
        let c = rand_vec(t * h * d, 32);
        let ang: Vec<f64> = rand_vec(t * d, 33)
            .iter()
            .map(|v| *v as f64 * 9.0)
            .collect();
        let cos: Vec<f32> = ang.iter().map(|a| a.cos() as f32).collect();
        let sin: Vec<f32> = ang.iter().map(|a| a.sin() as f32).collect();
        let f = |xx: &[f64]| {
            let mut s = 0.0;
            for ti in 0..t {
                for hi in 0..h {
                    let b = (ti * h + hi) * d;
                    for i in 0..d {
                        let rot = if i < d / 2 {
                            -xx[b + i + d / 2]
                        } else {
                            xx[b + i - d / 2]
                        };
                        let y = xx[b + i] * cos[ti * d + i] as f64 + rot * sin[ti * d + i] as f64;
                        s += c[b + i] as f64 * y;
                    }
                }
            }
            s
        };
        let mut g = c.clone();
        rope_bwd(&mut g, &cos, &sin, t, h, d).unwrap();
        assert!(rel_err(&g, &fd(&to64(&x), f)) < 1e-6);
        assert!(rope_bwd(&mut g, &cos, &sin, t, h, 7).is_err());
    }
}
