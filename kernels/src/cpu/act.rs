//! Elementwise ops: `swiglu_fwd` (SiLU-gated MLP), `gelu_fwd` (exact erf GELU, `nn.GELU()`),
//! `add_fwd` (residual), `embedding_fwd` (row gather).

use rayon::prelude::*;

use crate::{check_len, shape_err, Result};

const PAR_CHUNK: usize = 1 << 14;

/// `silu(g) = g * sigmoid(g)` in f32, written as `g / (1 + exp(-g))`.
#[inline]
pub fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// `out[n] = silu(gate[n]) * up[n]`.
pub fn swiglu_fwd(out: &mut [f32], gate: &[f32], up: &[f32]) -> Result<()> {
    check_len("swiglu_fwd", "gate", gate.len(), out.len())?;
    check_len("swiglu_fwd", "up", up.len(), out.len())?;
    out.par_chunks_mut(PAR_CHUNK)
        .zip(gate.par_chunks(PAR_CHUNK).zip(up.par_chunks(PAR_CHUNK)))
        .for_each(|(o, (g, u))| {
            for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                *o = silu(*g) * u;
            }
        });
    Ok(())
}

/// `out[n] = 0.5 x (1 + erf(x / sqrt 2))`, evaluated in f64 and rounded once.
pub fn gelu_fwd(out: &mut [f32], x: &[f32]) -> Result<()> {
    check_len("gelu_fwd", "x", x.len(), out.len())?;
    out.par_chunks_mut(PAR_CHUNK)
        .zip(x.par_chunks(PAR_CHUNK))
        .for_each(|(o, x)| {
            for (o, x) in o.iter_mut().zip(x) {
                let v = *x as f64;
                *o = (0.5 * v * (1.0 + libm::erf(v * std::f64::consts::FRAC_1_SQRT_2))) as f32;
            }
        });
    Ok(())
}

/// In place `y[n] += x[n]` (residual connection).
pub fn add_fwd(y: &mut [f32], x: &[f32]) -> Result<()> {
    check_len("add_fwd", "x", x.len(), y.len())?;
    y.par_chunks_mut(PAR_CHUNK)
        .zip(x.par_chunks(PAR_CHUNK))
        .for_each(|(y, x)| {
            for (y, x) in y.iter_mut().zip(x) {
                *y += x;
            }
        });
    Ok(())
}

/// `out[t, d] = table[ids[t], d]`; `table` is `[vocab, d]`. Fails on an id outside the table.
pub fn embedding_fwd(out: &mut [f32], table: &[f32], ids: &[u32], d: usize) -> Result<()> {
    const OP: &str = "embedding_fwd";
    check_len(OP, "out", out.len(), ids.len() * d)?;
    if d == 0 {
        return Ok(());
    }
    let vocab = table.len() / d;
    check_len(OP, "table", table.len(), vocab * d)?;
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(shape_err(
            OP,
            format!("token id {bad} outside the vocabulary of {vocab}"),
        ));
    }
    out.par_chunks_mut(d)
        .zip(ids.par_iter())
        .for_each(|(o, &i)| {
            o.copy_from_slice(&table[i as usize * d..(i as usize + 1) * d]);
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{rand_vec, rel_err};

    #[test]
    fn swiglu_matches_f64_reference() {
        let g: Vec<f32> = rand_vec(1000, 1).iter().map(|v| v * 12.0).collect();
        let u = rand_vec(1000, 2);
        let mut o = vec![0f32; 1000];
        swiglu_fwd(&mut o, &g, &u).unwrap();
        let want: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| *g as f64 / (1.0 + (-*g as f64).exp()) * *u as f64)
            .collect();
        assert!(rel_err(&o, &want) < 1e-6);
        assert!(swiglu_fwd(&mut o, &g[..3], &u).is_err());
    }

    /// erf by its Maclaurin series (exact to f64 for |x| <= 3) and the continued fraction above.
    fn erf_ref(x: f64) -> f64 {
        if x.abs() > 3.0 {
            // erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + 1/2/(x + 1/(x + 3/2/(x + ...))))
            let a = x.abs();
            let mut f = a;
            for k in (1..60).rev() {
                f = a + (k as f64 / 2.0) / f;
            }
            let erfc = (-a * a).exp() / std::f64::consts::PI.sqrt() / f;
            return x.signum() * (1.0 - erfc);
        }
        let mut term = x;
        let mut sum = x;
        for n in 1..200 {
            term *= -x * x / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn gelu_matches_series_reference() {
        let x: Vec<f32> = rand_vec(2000, 5).iter().map(|v| v * 6.0).collect();
        let mut o = vec![0f32; x.len()];
        gelu_fwd(&mut o, &x).unwrap();
        let want: Vec<f64> = x
            .iter()
            .map(|v| 0.5 * *v as f64 * (1.0 + erf_ref(*v as f64 / 2f64.sqrt())))
            .collect();
        assert!(rel_err(&o, &want) < 1e-6);
    }

    #[test]
    fn add_and_embedding() {
        let mut y = vec![1.0f32, 2.0];
        add_fwd(&mut y, &[0.5, -2.0]).unwrap();
        assert_eq!(y, vec![1.5, 0.0]);
        let table: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let mut o = vec![0f32; 6];
        embedding_fwd(&mut o, &table, &[2, 0, 3], 2).unwrap();
        assert_eq!(o, vec![4.0, 5.0, 0.0, 1.0, 6.0, 7.0]);
        assert!(embedding_fwd(&mut o, &table, &[2, 0, 6], 2).is_err());
    }
}
