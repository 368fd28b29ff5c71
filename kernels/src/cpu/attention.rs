//! Attention on the CPU: `attention_fwd` (a variable-length batch of sequences; causal, or full
//! within blocks as the vision tower's windows; optionally every sequence also sees a shared
//! prefix KV in full) and `attention_decode` (one query per sequence over a KV arena whose
//! prefix part is shared by the samples of a group).
//!
//! Both ops run the same per-query core, `attend_row`: for one query row and each head, the
//! scores of the visible keys in a fixed order (prefix keys first, then the sequence's own keys,
//! both ascending), `softmax` in f32 (max, `exp(s - max)`, sequential sum, `e / sum`), and the
//! probability-weighted sum of values in the same key order. Nothing in a query's arithmetic
//! depends on other queries, on the batch, or on the thread count; so a query attended by
//! `attention_decode` over `[prefix | suffix]` gives bitwise the output of the same query in
//! `attention_fwd` with the same keys. GQA: query head `h` reads KV head `h / (heads / kv_heads)`
//! (`repeat_kv` in Hugging Face).
//!
//! Layouts (row-major): `q`/`out` `[tokens, heads * head_dim]`, `k`/`v`
//! `[tokens, kv_heads * head_dim]`, `lse` `[tokens, heads]` (natural-log sum of exp of the scaled
//! scores, what a flash-style backward needs).

use rayon::prelude::*;

use crate::{check_len, check_min_len, shape_err, Result};

/// Head counts and width of one attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnDims {
    pub fn q_width(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    /// Query heads per kv head, at least 1 (for sizing work before the dims are checked).
    pub fn heads_per_kv(&self) -> usize {
        (self.num_heads / self.num_kv_heads.max(1)).max(1)
    }
    fn check(&self, op: &'static str) -> Result<()> {
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return Err(shape_err(
                op,
                format!(
                    "{} query heads is not a multiple of {} kv heads",
                    self.num_heads, self.num_kv_heads
                ),
            ));
        }
        Ok(())
    }
}

/// One sequence of a variable-length batch in `attention_fwd`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttnSeq {
    /// First row of the sequence in `q`, `k`, `v` and `out`.
    pub start: u32,
    pub len: u32,
    /// First row, in `prefix_k`/`prefix_v`, of the prefix that every query of the sequence sees.
    pub prefix_start: u32,
    /// Prefix rows (0: no prefix).
    pub prefix_len: u32,
}

impl AttnSeq {
    /// Sequences without prefix from cumulative lengths `[0, l0, l0+l1, ...]` (`cu_seqlens`).
    pub fn from_cu_seqlens(cu: &[u32]) -> Vec<AttnSeq> {
        cu.windows(2)
            .map(|w| AttnSeq {
                start: w[0],
                len: w[1].saturating_sub(w[0]),
                prefix_start: 0,
                prefix_len: 0,
            })
            .collect()
    }
}

/// Which of its own keys a query sees (the prefix, if any, is always seen in full).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnMask {
    /// Query `i` of a sequence sees its keys `0..=i` (text decoder).
    Causal,
    /// Every query sees every key of its sequence (vision windows, block-diagonal).
    Full,
}

/// One sequence of `attention_decode`: where its keys lie in the KV arena.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeSeq {
    /// First arena row of the (shared) prefix.
    pub prefix_offset: u32,
    pub prefix_len: u32,
    /// First arena row of this sample's own suffix.
    pub suffix_offset: u32,
    /// Suffix rows to attend, including the current token (already written to the arena).
    pub suffix_len: u32,
}

/// A contiguous run of keys: rows `start..start + len` of `k`/`v` (`[rows, kv_width]`).
#[derive(Clone, Copy)]
struct KeyRange<'a> {
    k: &'a [f32],
    v: &'a [f32],
    start: usize,
    len: usize,
}

/// Dot product with 8 fixed lanes and a fixed reduction tree (deterministic, vectorisable).
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

/// One query row, all heads: `out_row[h] = softmax(q_h . K^T * scale) V` over `ranges` in order.
fn attend_row(
    out_row: &mut [f32],
    lse_row: &mut [f32],
    q_row: &[f32],
    ranges: &[KeyRange<'_>],
    dims: AttnDims,
    scale: f32,
    scores: &mut Vec<f32>,
) {
    let hd = dims.head_dim;
    let kvw = dims.kv_width();
    let rep = dims.num_heads / dims.num_kv_heads;
    let n: usize = ranges.iter().map(|r| r.len).sum();
    scores.clear();
    scores.resize(n, 0.0);
    for h in 0..dims.num_heads {
        let qh = &q_row[h * hd..(h + 1) * hd];
        let koff = (h / rep) * hd;
        let oh = &mut out_row[h * hd..(h + 1) * hd];
        oh.fill(0.0);
        if n == 0 {
            lse_row[h] = f32::NEG_INFINITY;
            continue;
        }
        let mut idx = 0;
        let mut max = f32::NEG_INFINITY;
        for r in ranges {
            for j in r.start..r.start + r.len {
                let s = dot(qh, &r.k[j * kvw + koff..j * kvw + koff + hd]) * scale;
                scores[idx] = s;
                max = max.max(s);
                idx += 1;
            }
        }
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        idx = 0;
        for r in ranges {
            for j in r.start..r.start + r.len {
                let p = scores[idx] / sum;
                idx += 1;
                let vj = &r.v[j * kvw + koff..j * kvw + koff + hd];
                for (o, vv) in oh.iter_mut().zip(vj) {
                    *o += p * vv;
                }
            }
        }
        lse_row[h] = max + sum.ln();
    }
}

/// Variable-length attention over a packed batch.
///
/// Shapes: `out`, `q` `[T, heads*hd]`; `k`, `v` `[T, kv_heads*hd]`; `prefix_k`, `prefix_v`
/// `[P, kv_heads*hd]` (empty when no sequence has a prefix); `lse` `[T, heads]` if given.
/// Query `i` of sequence `s` sees prefix rows `s.prefix_start..+s.prefix_len` in full, then its
/// own rows `s.start..s.start + (i + 1)` (`Causal`) or `..s.start + s.len` (`Full`).
/// Rows that belong to no sequence are left untouched; sequences must not overlap.
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd(
    out: &mut [f32],
    lse: Option<&mut [f32]>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    prefix_k: &[f32],
    prefix_v: &[f32],
    seqs: &[AttnSeq],
    dims: AttnDims,
    mask: AttnMask,
    scale: f32,
) -> Result<()> {
    const OP: &str = "attention_fwd";
    dims.check(OP)?;
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    let t = q.len() / qw;
    check_len(OP, "q", q.len(), t * qw)?;
    check_len(OP, "out", out.len(), t * qw)?;
    check_len(OP, "k", k.len(), t * kvw)?;
    check_len(OP, "v", v.len(), t * kvw)?;
    let p = prefix_k.len() / kvw;
    check_len(OP, "prefix_k", prefix_k.len(), p * kvw)?;
    check_len(OP, "prefix_v", prefix_v.len(), p * kvw)?;
    // row -> (sequence, index in sequence)
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
    let mut lse_tmp;
    let lse = match lse {
        Some(l) => {
            check_len(OP, "lse", l.len(), t * dims.num_heads)?;
            l
        }
        None => {
            lse_tmp = vec![0f32; t * dims.num_heads];
            &mut lse_tmp[..]
        }
    };
    out.par_chunks_mut(qw)
        .zip(lse.par_chunks_mut(dims.num_heads))
        .enumerate()
        .for_each_init(Vec::new, |scores, (row, (out_row, lse_row))| {
            let si = owner[row];
            if si == u32::MAX {
                return;
            }
            let s = seqs[si as usize];
            let i = row - s.start as usize;
            let own = match mask {
                AttnMask::Causal => i + 1,
                AttnMask::Full => s.len as usize,
            };
            let ranges = [
                KeyRange {
                    k: prefix_k,
                    v: prefix_v,
                    start: s.prefix_start as usize,
                    len: s.prefix_len as usize,
                },
                KeyRange {
                    k,
                    v,
                    start: s.start as usize,
                    len: own,
                },
            ];
            attend_row(
                out_row,
                lse_row,
                &q[row * qw..(row + 1) * qw],
                &ranges,
                dims,
                scale,
                scores,
            );
        });
    Ok(())
}

/// Decode attention: one query per sequence over a KV arena.
///
/// Shapes: `out`, `q` `[B, heads*hd]`; `k_cache`, `v_cache` `[S, kv_heads*hd]` (the arena of one
/// layer; S >= every span's end); `seqs` `[B]`; `lse` `[B, heads]` if given. Query `b` sees arena
/// rows `prefix_offset..+prefix_len` then `suffix_offset..+suffix_len`, in that order.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode(
    out: &mut [f32],
    lse: Option<&mut [f32]>,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    seqs: &[DecodeSeq],
    dims: AttnDims,
    scale: f32,
) -> Result<()> {
    const OP: &str = "attention_decode";
    dims.check(OP)?;
    let (qw, kvw) = (dims.q_width(), dims.kv_width());
    let b = seqs.len();
    check_len(OP, "q", q.len(), b * qw)?;
    check_len(OP, "out", out.len(), b * qw)?;
    let s_rows = k_cache.len() / kvw;
    check_len(OP, "v_cache", v_cache.len(), k_cache.len())?;
    for (i, s) in seqs.iter().enumerate() {
        let end = (s.prefix_offset as usize + s.prefix_len as usize)
            .max(s.suffix_offset as usize + s.suffix_len as usize);
        check_min_len(OP, &format!("k_cache rows (sequence {i})"), s_rows, end)?;
    }
    let mut lse_tmp;
    let lse = match lse {
        Some(l) => {
            check_len(OP, "lse", l.len(), b * dims.num_heads)?;
            l
        }
        None => {
            lse_tmp = vec![0f32; b * dims.num_heads];
            &mut lse_tmp[..]
        }
    };
    out.par_chunks_mut(qw)
        .zip(lse.par_chunks_mut(dims.num_heads))
        .enumerate()
        .for_each_init(Vec::new, |scores, (i, (out_row, lse_row))| {
            let s = seqs[i];
            let ranges = [
                KeyRange {
                    k: k_cache,
                    v: v_cache,
                    start: s.prefix_offset as usize,
                    len: s.prefix_len as usize,
                },
                KeyRange {
                    k: k_cache,
                    v: v_cache,
                    start: s.suffix_offset as usize,
                    len: s.suffix_len as usize,
                },
            ];
            attend_row(
                out_row,
                lse_row,
                &q[i * qw..(i + 1) * qw],
                &ranges,
                dims,
                scale,
                scores,
            );
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{rand_vec, rel_err};

    /// f64 attention of one query over explicit key rows (row indices into k/v).
    fn naive_row(
        q: &[f32],
        keys: &[(&[f32], &[f32], usize)],
        dims: AttnDims,
        scale: f64,
    ) -> (Vec<f64>, Vec<f64>) {
        let (hd, kvw) = (dims.head_dim, dims.kv_width());
        let rep = dims.num_heads / dims.num_kv_heads;
        let mut out = vec![0f64; dims.q_width()];
        let mut lse = vec![0f64; dims.num_heads];
        for h in 0..dims.num_heads {
            let kh = (h / rep) * hd;
            let s: Vec<f64> = keys
                .iter()
                .map(|(k, _, j)| {
                    (0..hd)
                        .map(|d| q[h * hd + d] as f64 * k[j * kvw + kh + d] as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            lse[h] = m + z.ln();
            for (x, (_, v, j)) in s.iter().zip(keys) {
                let p = (x - m).exp() / z;
                for d in 0..hd {
                    out[h * hd + d] += p * v[j * kvw + kh + d] as f64;
                }
            }
        }
        (out, lse)
    }

    fn case(dims: AttnDims, lens: &[u32], prefix: &[(u32, u32)], mask: AttnMask, seed: u64) {
        let t: u32 = lens.iter().sum();
        let p: u32 = prefix.iter().map(|(s, l)| s + l).max().unwrap_or(0);
        let (qw, kvw) = (dims.q_width(), dims.kv_width());
        let q = rand_vec(t as usize * qw, seed);
        let k = rand_vec(t as usize * kvw, seed + 1);
        let v = rand_vec(t as usize * kvw, seed + 2);
        let pk = rand_vec(p as usize * kvw, seed + 3);
        let pv = rand_vec(p as usize * kvw, seed + 4);
        let mut seqs = Vec::new();
        let mut start = 0;
        for (i, &l) in lens.iter().enumerate() {
            let (ps, pl) = prefix.get(i).copied().unwrap_or((0, 0));
            seqs.push(AttnSeq {
                start,
                len: l,
                prefix_start: ps,
                prefix_len: pl,
            });
            start += l;
        }
        let scale = 1.0 / (dims.head_dim as f32).sqrt();
        let mut out = vec![0f32; t as usize * qw];
        let mut lse = vec![0f32; t as usize * dims.num_heads];
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
        let mut want = vec![0f64; out.len()];
        let mut want_lse = vec![0f64; lse.len()];
        for s in &seqs {
            for i in 0..s.len as usize {
                let row = s.start as usize + i;
                let mut keys: Vec<(&[f32], &[f32], usize)> = (0..s.prefix_len as usize)
                    .map(|j| (&pk[..], &pv[..], s.prefix_start as usize + j))
                    .collect();
                let own = if mask == AttnMask::Causal {
                    i + 1
                } else {
                    s.len as usize
                };
                keys.extend((0..own).map(|j| (&k[..], &v[..], s.start as usize + j)));
                let (o, l) = naive_row(&q[row * qw..(row + 1) * qw], &keys, dims, scale as f64);
                want[row * qw..(row + 1) * qw].copy_from_slice(&o);
                want_lse[row * dims.num_heads..(row + 1) * dims.num_heads].copy_from_slice(&l);
            }
        }
        let e = rel_err(&out, &want);
        assert!(e < 1e-5, "{dims:?} {lens:?} {mask:?}: rel err {e}");
        assert!(rel_err(&lse, &want_lse) < 1e-6);
    }

    #[test]
    fn attention_fwd_matches_f64_reference() {
        for (i, &(h, kv)) in [(4usize, 4usize), (4, 2), (8, 2), (3, 1)]
            .iter()
            .enumerate()
        {
            let dims = AttnDims {
                num_heads: h,
                num_kv_heads: kv,
                head_dim: 12,
            };
            let s = i as u64 * 10;
            case(dims, &[5, 1, 9], &[], AttnMask::Causal, s + 1);
            case(dims, &[4, 4, 7], &[], AttnMask::Full, s + 2);
            // shared prefix: three suffixes over one prefix of 6 rows, one over another of 3
            case(
                dims,
                &[3, 1, 5, 2],
                &[(0, 6), (0, 6), (0, 6), (6, 3)],
                AttnMask::Causal,
                s + 3,
            );
        }
    }

    #[test]
    fn decode_equals_fwd_bitwise() {
        // A query decoded over [prefix | suffix] in an arena equals the last row of attention_fwd
        // over prefix + causal suffix, bit for bit.
        let dims = AttnDims {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
        };
        let (qw, kvw) = (dims.q_width(), dims.kv_width());
        let (p, l) = (7usize, 5usize);
        let q = rand_vec(l * qw, 1);
        let k = rand_vec(l * kvw, 2);
        let v = rand_vec(l * kvw, 3);
        let pk = rand_vec(p * kvw, 4);
        let pv = rand_vec(p * kvw, 5);
        let seq = [AttnSeq {
            start: 0,
            len: l as u32,
            prefix_start: 0,
            prefix_len: p as u32,
        }];
        let mut out = vec![0f32; l * qw];
        attention_fwd(
            &mut out,
            None,
            &q,
            &k,
            &v,
            &pk,
            &pv,
            &seq,
            dims,
            AttnMask::Causal,
            0.25,
        )
        .unwrap();
        // arena: 3 junk rows, prefix at 3, junk, suffix at 12
        let rows = 12 + l;
        let mut kc = rand_vec(rows * kvw, 9);
        let mut vc = rand_vec(rows * kvw, 10);
        kc[3 * kvw..(3 + p) * kvw].copy_from_slice(&pk);
        vc[3 * kvw..(3 + p) * kvw].copy_from_slice(&pv);
        kc[12 * kvw..].copy_from_slice(&k);
        vc[12 * kvw..].copy_from_slice(&v);
        for i in 0..l {
            let ds = [DecodeSeq {
                prefix_offset: 3,
                prefix_len: p as u32,
                suffix_offset: 12,
                suffix_len: i as u32 + 1,
            }];
            let mut o = vec![0f32; qw];
            attention_decode(
                &mut o,
                None,
                &q[i * qw..(i + 1) * qw],
                &kc,
                &vc,
                &ds,
                dims,
                0.25,
            )
            .unwrap();
            assert_eq!(&o[..], &out[i * qw..(i + 1) * qw], "row {i}");
        }
        let bad = [DecodeSeq {
            prefix_offset: 3,
            prefix_len: p as u32,
            suffix_offset: 12,
            suffix_len: l as u32 + 1,
        }];
        let mut o = vec![0f32; qw];
        assert!(attention_decode(&mut o, None, &q[..qw], &kc, &vc, &bad, dims, 0.25).is_err());
    }

    #[test]
    fn rejects_bad_inputs() {
        let dims = AttnDims {
            num_heads: 3,
            num_kv_heads: 2,
            head_dim: 4,
        };
        let mut o = vec![0f32; 12];
        assert!(attention_fwd(
            &mut o,
            None,
            &[0.0; 12],
            &[0.0; 8],
            &[0.0; 8],
            &[],
            &[],
            &[],
            dims,
            AttnMask::Causal,
            1.0
        )
        .is_err());
        let dims = AttnDims {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
        };
        let seqs = [
            AttnSeq {
                start: 0,
                len: 2,
                ..Default::default()
            },
            AttnSeq {
                start: 1,
                len: 1,
                ..Default::default()
            },
        ];
        let mut o = vec![0f32; 16];
        let r = attention_fwd(
            &mut o,
            None,
            &[0.0; 16],
            &[0.0; 8],
            &[0.0; 8],
            &[],
            &[],
            &seqs,
            dims,
            AttnMask::Causal,
            1.0,
        );
        assert!(r.unwrap_err().to_string().contains("overlaps"));
    }
}
