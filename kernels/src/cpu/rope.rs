//! Rotary position embedding, rotate-half form (`apply_rotary_pos_emb` in Hugging Face):
//! `x' = x * cos + rotate_half(x) * sin`, with `rotate_half([x1, x2]) = [-x2, x1]`.
//!
//! The caller builds the per-token `cos`/`sin` tables (`[tokens, head_dim]`, the two halves equal
//! for 1D RoPE; assembled from the temporal/height/width sections for M-RoPE; from (h, w) for the
//! vision tower's 2D RoPE), so one op serves all three. The arithmetic is the same f32 sequence
//! as Hugging Face's (two products, one sum), so the result is bitwise theirs for equal tables.

use rayon::prelude::*;

use crate::{check_len, shape_err, Result};

/// In place: `x[tokens, heads, head_dim]` rotated with `cos[tokens, head_dim]`,
/// `sin[tokens, head_dim]` (every head of a token uses the token's row). `head_dim` is even.
pub fn rope_fwd(
    x: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
) -> Result<()> {
    const OP: &str = "rope_fwd";
    if !head_dim.is_multiple_of(2) {
        return Err(shape_err(OP, format!("head_dim {head_dim} is odd")));
    }
    check_len(OP, "x", x.len(), tokens * heads * head_dim)?;
    check_len(OP, "cos", cos.len(), tokens * head_dim)?;
    check_len(OP, "sin", sin.len(), tokens * head_dim)?;
    if tokens == 0 || heads == 0 || head_dim == 0 {
        return Ok(());
    }
    let half = head_dim / 2;
    x.par_chunks_mut(heads * head_dim)
        .enumerate()
        .for_each(|(t, xt)| {
            let c = &cos[t * head_dim..(t + 1) * head_dim];
            let s = &sin[t * head_dim..(t + 1) * head_dim];
            for xh in xt.chunks_mut(head_dim) {
                for i in 0..half {
                    let (x1, x2) = (xh[i], xh[i + half]);
                    xh[i] = x1 * c[i] + (-x2) * s[i];
                    xh[i + half] = x2 * c[i + half] + x1 * s[i + half];
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{rand_vec, rel_err};

    #[test]
    fn rope_matches_f64_reference() {
        let (t, h, d) = (5, 3, 16);
        let x0 = rand_vec(t * h * d, 1);
        // genuine angle tables: cos/sin of one angle per (token, i) (halves may differ: M-RoPE)
        let ang: Vec<f64> = rand_vec(t * d, 2)
            .iter()
            .map(|v| *v as f64 * 40.0)
            .collect();
        let cos: Vec<f32> = ang.iter().map(|a| a.cos() as f32).collect();
        let sin: Vec<f32> = ang.iter().map(|a| a.sin() as f32).collect();
        let mut x = x0.clone();
        rope_fwd(&mut x, &cos, &sin, t, h, d).unwrap();
        let mut want = vec![0f64; x.len()];
        for ti in 0..t {
            for hi in 0..h {
                let base = (ti * h + hi) * d;
                for i in 0..d {
                    let rot = if i < d / 2 {
                        -(x0[base + i + d / 2] as f64)
                    } else {
                        x0[base + i - d / 2] as f64
                    };
                    want[base + i] =
                        x0[base + i] as f64 * cos[ti * d + i] as f64 + rot * sin[ti * d + i] as f64;
                }
            }
        }
        assert!(rel_err(&x, &want) < 1e-6);
        assert!(rope_fwd(&mut x, &cos, &sin, t, h, 15).is_err());
    }
}
