//! GPU tests of the policy loss's sequence ratio (GSPO): the sequence pass
//! (`policy_loss_seq_ratio_f64`) against its CPU twin `cpu::seq_log_ratio` bitwise, and the whole
//! loss under it (`policy_loss_f32` with `RatioKind::Sequence`) against the sequence-level
//! formula, on sequences of 0 to 4099 tokens (length 1, all masked, masked tokens inside, padding
//! rows at the end) laid out in shuffled row order, outputs poisoned first. The full loss of
//! every configuration is compared with the CPU loss in the runtime's tests (`gpu::loss`). Each
//! test prints "skipped: no CUDA device" and passes where no GPU is present.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use rollplex_kernels::cpu;
use rollplex_kernels::cuda::*;

#[macro_use]
mod common;
use common::*;

/// One call's host inputs: sequences in shuffled row order, each in consecutive rows.
struct Layout {
    logp: Vec<f32>,
    old: Vec<f32>,
    adv: Vec<f32>,
    mask: Vec<u8>,
    seq: Vec<u32>,
    seq_tokens: Vec<u32>,
    /// Per sequence: first and end row.
    spans: Vec<u32>,
    rows: usize,
}

impl Layout {
    /// Sequence `s` has `lens[s]` rows; sequence 1 (when present) is all masked, others have
    /// about 15% masked rows and every third up to 4 masked padding rows at its end.
    fn new(lens: &[usize], seed: u64) -> Layout {
        let rows: usize = lens.iter().sum();
        // four values per row, then per sequence one for the shuffle, its advantage, its bias
        let u = rand_vec(4 * rows + 3 * lens.len(), seed);
        // sequences in a shuffled order of rows
        let mut order: Vec<usize> = (0..lens.len()).collect();
        for i in (1..order.len()).rev() {
            let j = ((u[4 * rows + i] as f64 + 1.0) / 2.0 * (i + 1) as f64) as usize;
            order.swap(i, j.min(i));
        }
        let mut l = Layout {
            logp: vec![0.0; rows],
            old: vec![0.0; rows],
            adv: vec![0.0; rows],
            mask: vec![0; rows],
            seq: vec![0; rows],
            seq_tokens: vec![0; lens.len()],
            spans: vec![0; 2 * lens.len()],
            rows,
        };
        let mut row = 0;
        for &s in &order {
            let len = lens[s];
            let pad = if s % 3 == 0 { (s % 5).min(len) } else { 0 };
            // one advantage per sequence, as GRPO's
            let a = u[4 * rows + lens.len() + s] * 2.0;
            // a log-ratio bias per sequence, so that some sequences' means clip
            let bias = 0.35 * u[4 * rows + 2 * lens.len() + s];
            for t in 0..len {
                let r = row + t;
                let (x, y, z) = (u[4 * r], u[4 * r + 1], u[4 * r + 2]);
                l.old[r] = -2.0 + 1.9 * x;
                // log-ratios mostly within the clip range's reach, some far
                let d = bias + if z > 0.9 { 3.0 * y } else { 0.4 * y };
                l.logp[r] = l.old[r] + d;
                l.adv[r] = a;
                let counted = s != 1 && t < len - pad && u[4 * r + 3] > -0.7;
                l.mask[r] = counted as u8;
                l.seq[r] = s as u32;
            }
            l.seq_tokens[s] = l.mask[row..row + len].iter().map(|&m| m as u32).sum();
            l.spans[2 * s] = if len == 0 { 0 } else { row as u32 };
            l.spans[2 * s + 1] = if len == 0 { 0 } else { (row + len) as u32 };
            row += len;
        }
        l
    }

    fn seqs(&self) -> usize {
        self.seq_tokens.len()
    }

    fn span(&self, s: usize) -> std::ops::Range<usize> {
        self.spans[2 * s] as usize..self.spans[2 * s + 1] as usize
    }

    /// The CPU twin of sequence `s`'s mean log-ratio.
    fn cpu_lr(&self, s: usize) -> f64 {
        let r = self.span(s);
        let m: Vec<bool> = self.mask[r.clone()].iter().map(|&m| m != 0).collect();
        cpu::seq_log_ratio(&self.logp[r.clone()], &self.old[r], &m)
    }

    fn counted(&self) -> usize {
        self.mask.iter().filter(|&&m| m != 0).count()
    }
}

/// The layout on the device.
struct Dev {
    logp: CudaSlice<f32>,
    old: CudaSlice<f32>,
    adv: CudaSlice<f32>,
    mask: CudaSlice<u8>,
    seq: CudaSlice<u32>,
    seq_tokens: CudaSlice<u32>,
    spans: CudaSlice<u32>,
    rows: usize,
    seqs: usize,
}

impl Dev {
    fn up(s: &Arc<CudaStream>, l: &Layout) -> Dev {
        Dev {
            logp: up(s, &l.logp),
            old: up(s, &l.old),
            adv: up(s, &l.adv),
            mask: up(s, &l.mask),
            seq: up(s, &l.seq),
            seq_tokens: up(s, &l.seq_tokens),
            spans: up(s, &l.spans),
            rows: l.rows,
            seqs: l.seqs(),
        }
    }

    fn inputs(&self) -> PolicyLossInputs<'_> {
        PolicyLossInputs {
            tokens: self.rows,
            logp: &self.logp,
            old_logp: &self.old,
            ref_logp: None,
            advantages: &self.adv,
            mask: &self.mask,
            entropy: None,
            seq: &self.seq,
            seqs: self.seqs,
            seq_tokens: &self.seq_tokens,
            seq_spans: Some(&self.spans),
        }
    }
}

/// Short and long sequences, 0 and 1 tokens among them, then enough short ones for three blocks
/// of the sequence pass (600 sequences).
fn lens(seed: u64) -> Vec<usize> {
    let mut v = vec![1, 1, 2, 0, 3, 7, 8, 9, 16, 33, 300, 1000, 4099, 1];
    let u = rand_vec(600, seed ^ 0x5EED);
    while v.len() < 600 {
        v.push(1 + ((u[v.len()] + 1.0) * 20.0) as usize);
    }
    v
}

/// The sequence pass: each sequence's mean log-ratio, poisoned outputs (NaN, u32::MAX), equal to
/// the CPU twin's bits; a call over the first sequences alone (one block) gives the same bits.
#[test]
fn seq_ratio_matches_cpu_bitwise() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let seed = fresh_seed();
    let l = Layout::new(&lens(seed), seed);
    let d = Dev::up(&s, &l);
    let n = l.seqs();
    let mut lr = up(&s, &vec![f64::NAN; n]);
    let mut bad = up(&s, &vec![u32::MAX; n]);
    policy_loss_seq_ratio_f64(g, &s, &mut lr, &mut bad, &d.inputs()).unwrap();
    let (got, flags) = (down(&s, &lr), down(&s, &bad));
    let mut nonzero = 0;
    for k in 0..n {
        let want = l.cpu_lr(k);
        assert_eq!(
            flags[k],
            0,
            "sequence {k} ({} rows) flagged",
            l.span(k).len()
        );
        assert_eq!(
            got[k].to_bits(),
            want.to_bits(),
            "sequence {k} ({} rows, {} counted): device {:e} vs CPU {want:e}",
            l.span(k).len(),
            l.seq_tokens[k],
            got[k]
        );
        nonzero += (want != 0.0) as usize;
    }
    assert!(nonzero > n / 2, "only {nonzero} nonzero means");
    // fewer sequences, one block: the first ones' bits do not change
    let few = 37;
    let mut lr2 = up(&s, &vec![f64::NAN; few]);
    let mut bad2 = up(&s, &vec![u32::MAX; few]);
    let x = PolicyLossInputs {
        seqs: few,
        ..d.inputs()
    };
    policy_loss_seq_ratio_f64(g, &s, &mut lr2, &mut bad2, &x).unwrap();
    let got2 = down(&s, &lr2);
    for k in 0..few {
        assert_eq!(got2[k].to_bits(), got[k].to_bits(), "sequence {k} alone");
    }
    assert!(down(&s, &bad2).iter().all(|&b| b == 0));
}

/// A span into the next sequence's rows, past the rows, reversed, or with a count other than
/// its counted rows: that sequence alone is flagged, its mean NaN. Spans missing or short are
/// refused before any launch.
#[test]
fn seq_ratio_flags_spans_that_are_not_their_sequences_rows() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let seed = fresh_seed();
    let l = Layout::new(&[5, 4, 6, 3], seed);
    let d = Dev::up(&s, &l);
    let n = l.seqs();
    // a sequence whose rows do not end the call
    let k = (0..n)
        .find(|&k| l.spans[2 * k + 1] < l.rows as u32)
        .unwrap();
    let (first, end) = (l.spans[2 * k], l.spans[2 * k + 1]);
    let rows = l.rows as u32;
    let cases: [(u32, u32, i64, &str); 4] = [
        (first, end + 1, 0, "into the next sequence"),
        (first, rows + 1, 0, "past the rows"),
        (end, first, 0, "reversed"),
        (first, end, 1, "a count one too many"),
    ];
    for (lo, hi, extra, why) in cases {
        let mut spans = l.spans.clone();
        (spans[2 * k], spans[2 * k + 1]) = (lo, hi);
        let mut counts = l.seq_tokens.clone();
        counts[k] = (counts[k] as i64 + extra) as u32;
        let (spans, counts) = (up(&s, &spans), up(&s, &counts));
        let x = PolicyLossInputs {
            seq_spans: Some(&spans),
            seq_tokens: &counts,
            ..d.inputs()
        };
        let mut lr = up(&s, &vec![0f64; n]);
        let mut bad = up(&s, &vec![7u32; n]);
        policy_loss_seq_ratio_f64(g, &s, &mut lr, &mut bad, &x).unwrap();
        let (got, flags) = (down(&s, &lr), down(&s, &bad));
        for j in 0..n {
            if j == k {
                assert!(
                    flags[j] == 1 && got[j].is_nan(),
                    "{why}: {} {}",
                    flags[j],
                    got[j]
                );
            } else {
                assert_eq!(flags[j], 0, "{why}: sequence {j} flagged");
                assert_eq!(
                    got[j].to_bits(),
                    l.cpu_lr(j).to_bits(),
                    "{why}: sequence {j}"
                );
            }
        }
    }
    let (mut lr, mut bad) = (up(&s, &vec![0f64; n]), up(&s, &vec![0u32; n]));
    let e = policy_loss_seq_ratio_f64(
        g,
        &s,
        &mut lr,
        &mut bad,
        &PolicyLossInputs {
            seq_spans: None,
            ..d.inputs()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("seq_spans"), "{e}");
    let short = up(&s, &vec![0u32; 2 * n - 1]);
    let e = policy_loss_seq_ratio_f64(
        g,
        &s,
        &mut lr,
        &mut bad,
        &PolicyLossInputs {
            seq_spans: Some(&short),
            ..d.inputs()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("seq_spans"), "{e}");
}

/// The whole loss under the sequence ratio (token mean, no KL, no dual clip) against the
/// sequence-level formula in f64: every counted token of sequence `s` takes
/// `ρ = exp(m_s)` (`m_s` the twin's mean), loss `max(-A ρ, -A clamp(ρ, lo, hi)) / N` and
/// gradient `-A ρ / N` unless the clipped branch wins (then 0); masked-out rows 0. Also the
/// metrics (pg_loss, clip_frac over tokens, approx_kl of each token's own log-ratio).
#[test]
fn gspo_loss_matches_the_sequence_formula() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let seed = fresh_seed();
    let l = Layout::new(&lens(seed), seed);
    let d = Dev::up(&s, &l);
    let big_n = l.counted();
    let p = PolicyLossParams {
        clip_low: 0.2,
        clip_high: 0.28,
        dual_clip: None,
        kl_coef: 0.0,
        kl: KlKind::K1,
        agg: LossAggKind::TokenMean,
        ratio: RatioKind::Sequence,
        norm_tokens: big_n,
        norm_seqs: l.seqs(),
    };
    let (lo, hi) = (1.0 - p.clip_low, 1.0 + p.clip_high);
    let w = 1.0 / big_n as f64;
    let mut want = vec![0f64; l.rows];
    let (mut pg, mut clip, mut approx) = (0f64, 0f64, 0f64);
    let mut seqs_clipped = 0;
    for k in 0..l.seqs() {
        let m = l.cpu_lr(k);
        assert!(m.abs() < 20.0, "the formula below leaves out the ±20 clamp");
        let rho = m.exp();
        let mut any = false;
        for r in l.span(k).filter(|&r| l.mask[r] != 0) {
            let a = l.adv[r] as f64;
            let (l1, l2) = (-a * rho, -a * rho.clamp(lo, hi));
            let clipped = l2 > l1;
            pg += w * l1.max(l2);
            clip += w * clipped as u8 as f64;
            approx += w * -(l.logp[r] as f64 - l.old[r] as f64);
            want[r] = if clipped { 0.0 } else { w * -a * rho };
            any |= clipped;
        }
        seqs_clipped += any as usize;
    }
    assert!(
        seqs_clipped > 10 && seqs_clipped < l.seqs() - 10,
        "{seqs_clipped} of {} sequences clipped: the data should clip some, not all",
        l.seqs()
    );
    let mut dlogp = poison_f32(&s, l.rows);
    let mut acc = PolicyLossAcc::new(g, &s).unwrap();
    policy_loss_f32(g, &s, &mut dlogp, &mut acc, &d.inputs(), &p).unwrap();
    let got = down(&s, &dlogp);
    for (r, (&x, &y)) in got.iter().zip(&want).enumerate() {
        if l.mask[r] == 0 || y == 0.0 {
            assert_eq!(
                x, 0.0,
                "row {r} (sequence {}): dlogp {x:e}, want 0",
                l.seq[r]
            );
        } else {
            let e = (x as f64 - y).abs() / y.abs();
            assert!(
                e < 1e-6,
                "row {r} (sequence {}): dlogp {x:e} vs {y:e} (rel {e:.1e})",
                l.seq[r]
            );
        }
    }
    let m = acc.read(&s).unwrap();
    assert_eq!((m.calls, m.tokens as usize), (1, big_n));
    // f64 sums in another order: rounding only
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 + 1e-9 * b.abs();
    assert!(close(m.pg_loss, pg), "pg_loss {} vs {pg}", m.pg_loss);
    assert!(close(m.loss, pg), "loss {} vs {pg}", m.loss);
    assert!(
        close(m.clip_frac, clip),
        "clip_frac {} vs {clip}",
        m.clip_frac
    );
    assert!(
        close(m.approx_kl, approx),
        "approx_kl {} vs {approx}",
        m.approx_kl
    );
    assert_eq!((m.kl, m.clip_frac_lower, m.entropy), (0.0, 0.0, None));

    // the same call with each token's own ratio gives other gradients
    let mut tok = poison_f32(&s, l.rows);
    let mut acc = PolicyLossAcc::new(g, &s).unwrap();
    let pt = PolicyLossParams {
        ratio: RatioKind::Token,
        ..p
    };
    policy_loss_f32(g, &s, &mut tok, &mut acc, &d.inputs(), &pt).unwrap();
    let tok = down(&s, &tok);
    let differ = tok.iter().zip(&got).filter(|(a, b)| a != b).count();
    assert!(
        differ > big_n / 2,
        "only {differ} rows differ from the token ratio's"
    );

    // a span that is not its sequence's rows is refused when the accumulator is read
    let mut spans = l.spans.clone();
    let k = (0..l.seqs()).find(|&k| !l.span(k).is_empty()).unwrap();
    spans[2 * k + 1] = l.rows as u32 + 1;
    let spans = up(&s, &spans);
    let mut acc = PolicyLossAcc::new(g, &s).unwrap();
    let x = PolicyLossInputs {
        seq_spans: Some(&spans),
        ..d.inputs()
    };
    policy_loss_f32(g, &s, &mut dlogp, &mut acc, &x, &p).unwrap();
    let e = acc.read(&s).unwrap_err().to_string();
    assert!(e.contains("row spans"), "{e}");
}
