//! Backward of the elementwise activations and of the embedding gather: `swiglu_bwd`,
//! `gelu_bwd`, `gelu_tanh_bwd`, `embedding_bwd`.

use rayon::prelude::*;

use super::{COL_CHUNK, PAR_CHUNK};
use crate::{check_len, shape_err, Result};

/// Backward of `swiglu_fwd` (`out = silu(gate) * up`): `dgate = dout up silu'(gate)`,
/// `dup = dout silu(gate)`, with `silu'(g) = σ(g) (1 + g (1 - σ(g)))`.
pub fn swiglu_bwd(
    dgate: &mut [f32],
    dup: &mut [f32],
    dout: &[f32],
    gate: &[f32],
    up: &[f32],
) -> Result<()> {
    const OP: &str = "swiglu_bwd";
    let n = dout.len();
    check_len(OP, "dgate", dgate.len(), n)?;
    check_len(OP, "dup", dup.len(), n)?;
    check_len(OP, "gate", gate.len(), n)?;
    check_len(OP, "up", up.len(), n)?;
    dgate
        .par_chunks_mut(PAR_CHUNK)
        .zip(dup.par_chunks_mut(PAR_CHUNK))
        .enumerate()
        .for_each(|(c, (dg, du))| {
            let o = c * PAR_CHUNK;
            for i in 0..dg.len() {
                let (g, u, d) = (gate[o + i], up[o + i], dout[o + i]);
                let sig = 1.0 / (1.0 + (-g).exp());
                let silu = g * sig;
                dg[i] = d * u * (sig * (1.0 + g * (1.0 - sig)));
                du[i] = d * silu;
            }
        });
    Ok(())
}

/// Backward of `gelu_fwd` (exact erf GELU): `dx = dy (Φ(x) + x φ(x))`, evaluated in f64.
pub fn gelu_bwd(dx: &mut [f32], dy: &[f32], x: &[f32]) -> Result<()> {
    const OP: &str = "gelu_bwd";
    check_len(OP, "dy", dy.len(), dx.len())?;
    check_len(OP, "x", x.len(), dx.len())?;
    let inv_sqrt_2pi = 1.0 / (2.0 * std::f64::consts::PI).sqrt();
    dx.par_chunks_mut(PAR_CHUNK).enumerate().for_each(|(c, o)| {
        let b = c * PAR_CHUNK;
        for (i, o) in o.iter_mut().enumerate() {
            let v = x[b + i] as f64;
            let cdf = 0.5 * (1.0 + libm::erf(v * std::f64::consts::FRAC_1_SQRT_2));
            let pdf = (-0.5 * v * v).exp() * inv_sqrt_2pi;
            *o = (dy[b + i] as f64 * (cdf + v * pdf)) as f32;
        }
    });
    Ok(())
}

/// Backward of the tanh-approximated GELU (`0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`,
/// PyTorch's `gelu(approximate='tanh')`): with `u = √(2/π) (x + κ x³)`, `t = tanh(u)`,
/// `dx = dy (0.5 (1 + t) + 0.5 x (1 - t²) √(2/π) (1 + 3 κ x²))`, evaluated in f64. (The model's
/// forward has only the exact form, `gelu_fwd`; this is the CPU twin of the CUDA kernel's tanh
/// mode.)
pub fn gelu_tanh_bwd(dx: &mut [f32], dy: &[f32], x: &[f32]) -> Result<()> {
    const OP: &str = "gelu_tanh_bwd";
    check_len(OP, "dy", dy.len(), dx.len())?;
    check_len(OP, "x", x.len(), dx.len())?;
    let k = (2.0 / std::f64::consts::PI).sqrt();
    const KAPPA: f64 = 0.044715;
    dx.par_chunks_mut(PAR_CHUNK).enumerate().for_each(|(c, o)| {
        let b = c * PAR_CHUNK;
        for (i, o) in o.iter_mut().enumerate() {
            let v = x[b + i] as f64;
            let t = (k * (v + KAPPA * v * v * v)).tanh();
            let d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * KAPPA * v * v);
            *o = (dy[b + i] as f64 * d) as f32;
        }
    });
    Ok(())
}

/// Backward of `embedding_fwd`: `dtable[ids[t], :] += dout[t, :]`, tokens in order (parallel
/// over column blocks, so each table row sums its tokens in a fixed order).
pub fn embedding_bwd(dtable: &mut [f32], dout: &[f32], ids: &[u32], d: usize) -> Result<()> {
    const OP: &str = "embedding_bwd";
    check_len(OP, "dout", dout.len(), ids.len() * d)?;
    if d == 0 {
        return Ok(());
    }
    let vocab = dtable.len() / d;
    check_len(OP, "dtable", dtable.len(), vocab * d)?;
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(shape_err(
            OP,
            format!("token id {bad} outside the vocabulary of {vocab}"),
        ));
    }
    let blocks = d.div_ceil(COL_CHUNK);
    // Each task owns columns [j0, j1) of every table row.
    struct Ptr(*mut f32);
    // SAFETY: tasks write disjoint column ranges of the table (see below).
    unsafe impl Sync for Ptr {}
    let p = Ptr(dtable.as_mut_ptr());
    (0..blocks).into_par_iter().for_each(|b| {
        let p = &p;
        let (j0, j1) = (b * COL_CHUNK, ((b + 1) * COL_CHUNK).min(d));
        for (t, &id) in ids.iter().enumerate() {
            let (src, dst) = (&dout[t * d + j0..t * d + j1], id as usize * d + j0);
            for (jj, s) in src.iter().enumerate() {
                // SAFETY: dst + jj < vocab * d (id checked above, jj < j1 - j0 <= d - j0), and
                // column j0 + jj belongs to this task only.
                unsafe { *p.0.add(dst + jj) += s };
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
    fn activations_match_finite_differences() {
        let n = 300;
        let gate: Vec<f32> = rand_vec(n, 41).iter().map(|v| v * 8.0).collect();
        let up = rand_vec(n, 42);
        let c = rand_vec(n, 43);
        let (mut dg, mut du) = (vec![0f32; n], vec![0f32; n]);
        swiglu_bwd(&mut dg, &mut du, &c, &gate, &up).unwrap();
        let silu = |g: f64| g / (1.0 + (-g).exp());
        let up64 = to64(&up);
        let g64 = to64(&gate);
        let gg = fd(&g64, |g| {
            g.iter()
                .zip(&up64)
                .zip(&c)
                .map(|((g, u), c)| silu(*g) * u * *c as f64)
                .sum()
        });
        let gu = fd(&up64, |u| {
            g64.iter()
                .zip(u)
                .zip(&c)
                .map(|((g, u), c)| silu(*g) * u * *c as f64)
                .sum()
        });
        assert!(rel_err(&dg, &gg) < 1e-5 && rel_err(&du, &gu) < 1e-5);

        let x: Vec<f32> = rand_vec(n, 44).iter().map(|v| v * 5.0).collect();
        let mut dx = vec![0f32; n];
        gelu_bwd(&mut dx, &c, &x).unwrap();
        let gelu = |v: f64| 0.5 * v * (1.0 + libm::erf(v / 2f64.sqrt()));
        let gx = fd(&to64(&x), |xx| {
            xx.iter().zip(&c).map(|(v, c)| gelu(*v) * *c as f64).sum()
        });
        assert!(rel_err(&dx, &gx) < 1e-6);
        assert!(gelu_bwd(&mut dx, &c[..3], &x).is_err());

        gelu_tanh_bwd(&mut dx, &c, &x).unwrap();
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let gelu_t = |v: f64| 0.5 * v * (1.0 + (k * (v + 0.044715 * v * v * v)).tanh());
        let gt = fd(&to64(&x), |xx| {
            xx.iter().zip(&c).map(|(v, c)| gelu_t(*v) * *c as f64).sum()
        });
        assert!(rel_err(&dx, &gt) < 1e-6);
        // the two forms differ (by up to ~1e-3 of the derivative): the test sees which one ran
        assert!(rel_err(&dx, &gx) > 1e-5);
        assert!(gelu_tanh_bwd(&mut dx, &c, &x[..3]).is_err());
    }

    #[test]
    fn embedding_bwd_accumulates_repeated_ids() {
        let d = 70;
        let ids = [2u32, 0, 2, 1, 2];
        let dout = rand_vec(ids.len() * d, 51);
        let mut table = vec![1.0f32; 4 * d];
        embedding_bwd(&mut table, &dout, &ids, d).unwrap();
        for j in 0..d {
            assert_eq!(table[j], 1.0 + dout[d + j]);
            assert_eq!(table[d + j], 1.0 + dout[3 * d + j]);
            assert_eq!(
                table[2 * d + j],
                ((1.0 + dout[j]) + dout[2 * d + j]) + dout[4 * d + j]
            );
            assert_eq!(table[3 * d + j], 1.0);
        }
        assert!(embedding_bwd(&mut table, &dout, &[4, 0, 0, 0, 0], d).is_err());
    }
}
