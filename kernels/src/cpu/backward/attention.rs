//! `attention_bwd`: the backward of `attention_fwd`, recomputing probabilities from the
//! forward's log-sum-exp in two passes (query-centric for `dq`, key-centric for `dk`/`dv`).

use rayon::prelude::*;

use crate::cpu::attention::{AttnDims, AttnMask, AttnSeq};
use crate::{check_len, shape_err, Result};

/// The same 8-lane dot product as the forward (so recomputed scores are bitwise the forward's).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; 8];
    let chunks = n / 8;
    for c in 0..chunks {
        let (a8, b8) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += a8[l] * b8[l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..n {
        tail += a[i] * b[i];
    }
    (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) + tail
}

#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Backward of `attention_fwd` (same arguments, plus the forward's `out` and `lse`).
///
/// Writes `dq` `[T, heads*hd]`, `dk`, `dv` `[T, kv_heads*hd]` (rows of no sequence get zeros);
/// adds the prefix keys' gradients into `dprefix_k`, `dprefix_v` `[P, kv_heads*hd]`: a prefix
/// row shared by several sequences (the G samples of a group) gathers all their gradients.
/// With `S = q kᵀ scale`, `P = exp(S - lse)`, `D_i = Σ dout_i out_i`:
/// `dv_j = Σ_i P_ij dout_i`, `dS_ij = P_ij (dout_i · v_j - D_i)`, `dq_i = scale Σ_j dS_ij k_j`,
/// `dk_j = scale Σ_i dS_ij q_i` (GQA: a kv head sums over its query heads).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dprefix_k: &mut [f32],
    dprefix_v: &mut [f32],
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    prefix_k: &[f32],
    prefix_v: &[f32],
    out: &[f32],
    lse: &[f32],
    seqs: &[AttnSeq],
    dims: AttnDims,
    mask: AttnMask,
    scale: f32,
) -> Result<()> {
    const OP: &str = "attention_bwd";
    if dims.num_heads == 0
        || dims.num_kv_heads == 0
        || !dims.num_heads.is_multiple_of(dims.num_kv_heads)
    {
        return Err(shape_err(
            OP,
            format!(
                "{} query heads is not a multiple of {} kv heads",
                dims.num_heads, dims.num_kv_heads
            ),
        ));
    }
    let (qw, kvw, hd, nh) = (
        dims.q_width(),
        dims.kv_width(),
        dims.head_dim,
        dims.num_heads,
    );
    let rep = dims.num_heads / dims.num_kv_heads;
    let t = q.len() / qw.max(1);
    for (name, buf, want) in [
        ("q", q.len(), t * qw),
        ("dq", dq.len(), t * qw),
        ("out", out.len(), t * qw),
        ("dout", dout.len(), t * qw),
        ("k", k.len(), t * kvw),
        ("v", v.len(), t * kvw),
        ("dk", dk.len(), t * kvw),
        ("dv", dv.len(), t * kvw),
        ("lse", lse.len(), t * nh),
    ] {
        check_len(OP, name, buf, want)?;
    }
    let p = prefix_k.len() / kvw.max(1);
    check_len(OP, "prefix_k", prefix_k.len(), p * kvw)?;
    check_len(OP, "prefix_v", prefix_v.len(), p * kvw)?;
    check_len(OP, "dprefix_k", dprefix_k.len(), p * kvw)?;
    check_len(OP, "dprefix_v", dprefix_v.len(), p * kvw)?;
    let mut owner = vec![u32::MAX; t];
    for (si, s) in seqs.iter().enumerate() {
        let (a, b) = (s.start as usize, s.start as usize + s.len as usize);
        if b > t {
            return Err(shape_err(
                OP,
                format!("sequence {si} ends at row {b}, past the {t} rows of q"),
            ));
        }
        if s.prefix_start as usize + s.prefix_len as usize > p {
            return Err(shape_err(
                OP,
                format!("sequence {si}'s prefix ends past the {p} prefix rows"),
            ));
        }
        for o in &mut owner[a..b] {
            if *o != u32::MAX {
                return Err(shape_err(
                    OP,
                    format!("sequence {si} overlaps sequence {o}"),
                ));
            }
            *o = si as u32;
        }
    }
    if t == 0 {
        return Ok(());
    }
    // D[i, h] = dout_i,h . out_i,h
    let mut dd = vec![0f32; t * nh];
    dd.par_chunks_mut(nh).enumerate().for_each(|(i, di)| {
        for (h, d) in di.iter_mut().enumerate() {
            let r = i * qw + h * hd..i * qw + (h + 1) * hd;
            *d = dot(&dout[r.clone()], &out[r]);
        }
    });
    let dd = &dd;
    // Contribution of query (row i, head h) to key row j of (kk, vv): returns (P, dS).
    let probs = |i: usize, h: usize, kk: &[f32], vv: &[f32], j: usize| -> (f32, f32) {
        let koff = j * kvw + (h / rep) * hd;
        let qh = &q[i * qw + h * hd..i * qw + (h + 1) * hd];
        let s = dot(qh, &kk[koff..koff + hd]) * scale;
        let pr = (s - lse[i * nh + h]).exp();
        let dp = dot(
            &dout[i * qw + h * hd..i * qw + (h + 1) * hd],
            &vv[koff..koff + hd],
        );
        (pr, pr * (dp - dd[i * nh + h]))
    };
    // Own keys visible to query index `qi` of a sequence of length `len`.
    let own_keys = |qi: usize, len: usize| match mask {
        AttnMask::Causal => qi + 1,
        AttnMask::Full => len,
    };

    // dq: query-centric.
    dq.par_chunks_mut(qw).enumerate().for_each(|(i, dqi)| {
        dqi.fill(0.0);
        let si = owner[i];
        if si == u32::MAX {
            return;
        }
        let s = seqs[si as usize];
        let own = own_keys(i - s.start as usize, s.len as usize);
        for h in 0..nh {
            let koff = (h / rep) * hd;
            let dqh = &mut dqi[h * hd..(h + 1) * hd];
            for j in s.prefix_start as usize..(s.prefix_start + s.prefix_len) as usize {
                let (_, ds) = probs(i, h, prefix_k, prefix_v, j);
                axpy(
                    dqh,
                    ds * scale,
                    &prefix_k[j * kvw + koff..j * kvw + koff + hd],
                );
            }
            for j in s.start as usize..s.start as usize + own {
                let (_, ds) = probs(i, h, k, v, j);
                axpy(dqh, ds * scale, &k[j * kvw + koff..j * kvw + koff + hd]);
            }
        }
    });

    // dk, dv of own keys: key-centric; key row j sums over the queries that see it.
    let qrange = |s: &AttnSeq, kj: usize| -> std::ops::Range<usize> {
        let (a, len) = (s.start as usize, s.len as usize);
        match mask {
            AttnMask::Causal => a + kj..a + len,
            AttnMask::Full => a..a + len,
        }
    };
    dk.par_chunks_mut(kvw)
        .zip(dv.par_chunks_mut(kvw))
        .enumerate()
        .for_each(|(j, (dkj, dvj))| {
            dkj.fill(0.0);
            dvj.fill(0.0);
            let si = owner[j];
            if si == u32::MAX {
                return;
            }
            let s = seqs[si as usize];
            let queries = qrange(&s, j - s.start as usize);
            for h in 0..nh {
                let koff = (h / rep) * hd;
                for i in queries.clone() {
                    let (pr, ds) = probs(i, h, k, v, j);
                    axpy(
                        &mut dvj[koff..koff + hd],
                        pr,
                        &dout[i * qw + h * hd..i * qw + (h + 1) * hd],
                    );
                    axpy(
                        &mut dkj[koff..koff + hd],
                        ds * scale,
                        &q[i * qw + h * hd..i * qw + (h + 1) * hd],
                    );
                }
            }
        });

    // Shared prefix keys: every query of every sequence whose prefix span holds the row.
    if p > 0 && seqs.iter().any(|s| s.prefix_len > 0) {
        dprefix_k
            .par_chunks_mut(kvw)
            .zip(dprefix_v.par_chunks_mut(kvw))
            .enumerate()
            .for_each(|(j, (dkj, dvj))| {
                let mut gk = vec![0f32; kvw];
                let mut gv = vec![0f32; kvw];
                let mut any = false;
                for s in seqs {
                    let (pa, pb) = (
                        s.prefix_start as usize,
                        (s.prefix_start + s.prefix_len) as usize,
                    );
                    if j < pa || j >= pb {
                        continue;
                    }
                    any = true;
                    for h in 0..nh {
                        let koff = (h / rep) * hd;
                        for i in s.start as usize..(s.start + s.len) as usize {
                            let (pr, ds) = probs(i, h, prefix_k, prefix_v, j);
                            axpy(
                                &mut gv[koff..koff + hd],
                                pr,
                                &dout[i * qw + h * hd..i * qw + (h + 1) * hd],
                            );
                            axpy(
                                &mut gk[koff..koff + hd],
                                ds * scale,
                                &q[i * qw + h * hd..i * qw + (h + 1) * hd],
                            );
                        }
                    }
                }
                if any {
                    for (d, g) in dkj.iter_mut().zip(&gk) {
                        *d += g;
                    }
                    for (d, g) in dvj.iter_mut().zip(&gv) {
                        *d += g;
                    }
                }
            });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::attention_fwd;
    use crate::cpu::backward::fd::{dotc, fd, to64};
    use crate::cpu::testutil::{rand_vec, rel_err};

    /// f64 attention forward: returns `out`, same semantics as `attention_fwd`.
    #[allow(clippy::too_many_arguments)]
    fn attention64(
        q: &[f64],
        k: &[f64],
        v: &[f64],
        pk: &[f64],
        pv: &[f64],
        seqs: &[AttnSeq],
        dims: AttnDims,
        mask: AttnMask,
        scale: f64,
    ) -> Vec<f64> {
        let (qw, kvw, hd) = (dims.q_width(), dims.kv_width(), dims.head_dim);
        let rep = dims.num_heads / dims.num_kv_heads;
        let mut out = vec![0.0; q.len()];
        for s in seqs {
            for qi in 0..s.len as usize {
                let i = s.start as usize + qi;
                let own = match mask {
                    AttnMask::Causal => qi + 1,
                    AttnMask::Full => s.len as usize,
                };
                let mut keys: Vec<(&[f64], &[f64], usize)> = Vec::new();
                for j in s.prefix_start as usize..(s.prefix_start + s.prefix_len) as usize {
                    keys.push((pk, pv, j));
                }
                for j in s.start as usize..s.start as usize + own {
                    keys.push((k, v, j));
                }
                for h in 0..dims.num_heads {
                    let koff = (h / rep) * hd;
                    let qh = &q[i * qw + h * hd..i * qw + (h + 1) * hd];
                    let sc: Vec<f64> = keys
                        .iter()
                        .map(|(kk, _, j)| {
                            (0..hd).map(|d| qh[d] * kk[j * kvw + koff + d]).sum::<f64>() * scale
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for (n, (_, vv, j)) in keys.iter().enumerate() {
                        for d in 0..hd {
                            out[i * qw + h * hd + d] += e[n] / sum * vv[j * kvw + koff + d];
                        }
                    }
                }
            }
        }
        out
    }

    /// GQA, causal and full masks, varlen, and a shared prefix seen by three sequences (whose
    /// prefix gradient must gather all three).
    #[test]
    fn attention_bwd_matches_finite_differences() {
        let dims = AttnDims {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 4,
        };
        let (qw, kvw) = (dims.q_width(), dims.kv_width());
        let scale = 1.0 / (dims.head_dim as f32).sqrt();
        let cases: Vec<(Vec<AttnSeq>, usize, usize, AttnMask)> = vec![
            // (seqs, T, P, mask): plain varlen causal (a row of no sequence at the end)
            (AttnSeq::from_cu_seqlens(&[0, 3, 7]), 8, 0, AttnMask::Causal),
            // vision-style full-attention windows
            (AttnSeq::from_cu_seqlens(&[0, 4, 6]), 6, 0, AttnMask::Full),
            // a GRPO group: 3 suffixes over one 5-row prefix, and one sequence over rows 1..3 of it
            (
                vec![
                    AttnSeq {
                        start: 0,
                        len: 3,
                        prefix_start: 0,
                        prefix_len: 5,
                    },
                    AttnSeq {
                        start: 3,
                        len: 1,
                        prefix_start: 0,
                        prefix_len: 5,
                    },
                    AttnSeq {
                        start: 4,
                        len: 2,
                        prefix_start: 0,
                        prefix_len: 5,
                    },
                    AttnSeq {
                        start: 6,
                        len: 2,
                        prefix_start: 1,
                        prefix_len: 2,
                    },
                ],
                8,
                5,
                AttnMask::Causal,
            ),
        ];
        for (ci, (seqs, t, p, mask)) in cases.into_iter().enumerate() {
            let s = 100 + ci as u64 * 10;
            let q: Vec<f32> = rand_vec(t * qw, s).iter().map(|v| v * 2.0).collect();
            let k: Vec<f32> = rand_vec(t * kvw, s + 1).iter().map(|v| v * 2.0).collect();
            let v = rand_vec(t * kvw, s + 2);
            let pk: Vec<f32> = rand_vec(p * kvw, s + 3).iter().map(|v| v * 2.0).collect();
            let pv = rand_vec(p * kvw, s + 4);
            let c = rand_vec(t * qw, s + 5);
            let mut out = vec![0f32; t * qw];
            let mut lse = vec![0f32; t * dims.num_heads];
            attention_fwd(
                &mut out,
                Some(&mut lse),
                &q,
                &k,
                &v,
                &pk,
                &pv,
                &seqs,
                dims,
                mask,
                scale,
            )
            .unwrap();
            let (mut dq, mut dk, mut dv) =
                (vec![9f32; t * qw], vec![9f32; t * kvw], vec![9f32; t * kvw]);
            let (mut dpk, mut dpv) = (vec![0f32; p * kvw], vec![0f32; p * kvw]);
            attention_bwd(
                &mut dq, &mut dk, &mut dv, &mut dpk, &mut dpv, &c, &q, &k, &v, &pk, &pv, &out,
                &lse, &seqs, dims, mask, scale,
            )
            .unwrap();
            let (q64, k64, v64, pk64, pv64) = (to64(&q), to64(&k), to64(&v), to64(&pk), to64(&pv));
            let sc = scale as f64;
            let l = |q: &[f64], k: &[f64], v: &[f64], pk: &[f64], pv: &[f64]| {
                dotc(&c, &attention64(q, k, v, pk, pv, &seqs, dims, mask, sc))
            };
            let checks = [
                ("dq", &dq, fd(&q64, |x| l(x, &k64, &v64, &pk64, &pv64))),
                ("dk", &dk, fd(&k64, |x| l(&q64, x, &v64, &pk64, &pv64))),
                ("dv", &dv, fd(&v64, |x| l(&q64, &k64, x, &pk64, &pv64))),
                (
                    "dprefix_k",
                    &dpk,
                    fd(&pk64, |x| l(&q64, &k64, &v64, x, &pv64)),
                ),
                (
                    "dprefix_v",
                    &dpv,
                    fd(&pv64, |x| l(&q64, &k64, &v64, &pk64, x)),
                ),
            ];
            for (name, got, want) in checks {
                if want.is_empty() {
                    continue;
                }
                let e = rel_err(got, &want);
                assert!(e < 1e-5, "case {ci} {name}: rel err {e}");
            }
            // The unowned row 7 of case 0 has zero gradients (not the 9s it started with).
            if ci == 0 {
                assert!(
                    dq[7 * qw..].iter().all(|&g| g == 0.0)
                        && dk[7 * kvw..].iter().all(|&g| g == 0.0)
                );
            }
        }
    }

    /// The prefix gradient of a group scored together is the ordered sum over its sequences,
    /// and scoring one sequence alone gives bitwise its own dq/dk/dv (batch independence).
    #[test]
    fn attention_bwd_is_batch_independent() {
        let dims = AttnDims {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
        };
        let (qw, kvw) = (dims.q_width(), dims.kv_width());
        let (t, p) = (7, 4);
        let seqs = vec![
            AttnSeq {
                start: 0,
                len: 3,
                prefix_start: 0,
                prefix_len: p as u32,
            },
            AttnSeq {
                start: 3,
                len: 4,
                prefix_start: 0,
                prefix_len: p as u32,
            },
        ];
        let (q, k, v) = (
            rand_vec(t * qw, 1),
            rand_vec(t * kvw, 2),
            rand_vec(t * kvw, 3),
        );
        let (pk, pv, c) = (
            rand_vec(p * kvw, 4),
            rand_vec(p * kvw, 5),
            rand_vec(t * qw, 6),
        );
        let run = |seqs: &[AttnSeq], r: std::ops::Range<usize>| {
            let n = r.len();
            let (qs, ks, vs, cs) = (
                &q[r.start * qw..r.end * qw],
                &k[r.start * kvw..r.end * kvw],
                &v[r.start * kvw..r.end * kvw],
                &c[r.start * qw..r.end * qw],
            );
            let mut out = vec![0f32; n * qw];
            let mut lse = vec![0f32; n * 2];
            attention_fwd(
                &mut out,
                Some(&mut lse),
                qs,
                ks,
                vs,
                &pk,
                &pv,
                seqs,
                dims,
                AttnMask::Causal,
                0.3,
            )
            .unwrap();
            let (mut dq, mut dk, mut dv) =
                (vec![0f32; n * qw], vec![0f32; n * kvw], vec![0f32; n * kvw]);
            let (mut dpk, mut dpv) = (vec![0f32; p * kvw], vec![0f32; p * kvw]);
            attention_bwd(
                &mut dq,
                &mut dk,
                &mut dv,
                &mut dpk,
                &mut dpv,
                cs,
                qs,
                ks,
                vs,
                &pk,
                &pv,
                &out,
                &lse,
                seqs,
                dims,
                AttnMask::Causal,
                0.3,
            )
            .unwrap();
            (dq, dk, dv, dpk, dpv)
        };
        let both = run(&seqs, 0..t);
        let first = run(
            &[AttnSeq {
                start: 0,
                ..seqs[0]
            }],
            0..3,
        );
        let second = run(
            &[AttnSeq {
                start: 0,
                ..seqs[1]
            }],
            3..7,
        );
        assert_eq!(&both.0[..3 * qw], &first.0[..]);
        assert_eq!(&both.0[3 * qw..], &second.0[..]);
        assert_eq!(&both.1[..3 * kvw], &first.1[..]);
        assert_eq!(&both.1[3 * kvw..], &second.1[..]);
        assert_eq!(&both.2[..3 * kvw], &first.2[..]);
        let sum: Vec<f32> = first.3.iter().zip(&second.3).map(|(a, b)| a + b).collect();
        for (a, b) in both.3.iter().zip(&sum) {
            assert!(
                (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                "prefix grad is the sum over sequences"
            );
        }
    }
}
