//! Tests of the device policy loss against the CPU's [`policy_loss`], called per GRPO group and
//! its metrics added, exactly as the CUDA trainer's host path does today.
//!
//! Host-only (no GPU): the tables ([`LossTables`]) and the config mapping.
//! On a CUDA device (each test prints "skipped: no CUDA device" and passes where none is
//! usable): random micro-batches of several groups with their sequences laid out in shuffled
//! row order, masked tokens, an empty sequence, an all-masked sequence, a group of equal rewards
//! (zero advantages), ratios inside and outside the clip range, log-ratios exactly at and beyond
//! the ±20 clamp, reference log-probs at and beyond k3's clamps; every estimator x every
//! aggregation x dual clip on/off x kl_coef 0 / > 0, with each token's ratio and with GSPO's
//! sequence ratio. `dlogp` must be within [`MAX_ULPS`] f32 ulps of the CPU's (the count of
//! bitwise-equal tokens is printed), every metric within [`METRIC_RTOL`] relative.

use std::sync::{Arc, OnceLock};

use rollplex_kernels::cuda::{test_gpu, CudaSlice, Gpu, PolicyLossAcc, PolicyLossInputs};
use rollplex_plan::spec::{KlEstimator, LossAgg, RatioLevel};

use super::*;
use crate::gpu::{download, upload};
use crate::train::loss::{grpo_advantages, policy_loss, LossBatch};

/// CUDA's double `exp` and the host's libm may differ in the last f64 bit; after the f32
/// rounding of `dlogp` that is at most one ulp, so two is "a few".
const MAX_ULPS: u32 = 2;
/// The metrics are f64 sums in another order than the CPU's: rounding only.
const METRIC_RTOL: f64 = 1e-6;

// ---------------------------------------------------------------- random data

/// Deterministic pseudo-random numbers (splitmix64), as the CPU loss tests.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next()
    }
    fn below(&mut self, n: usize) -> usize {
        ((self.next() * n as f64) as usize).min(n.saturating_sub(1))
    }
}

/// One response's per-token values.
#[derive(Clone, Debug, Default)]
struct Seq {
    logp: Vec<f32>,
    old: Vec<f32>,
    refl: Vec<f32>,
    adv: Vec<f32>,
    mask: Vec<bool>,
    ent: Vec<f32>,
}

/// A micro-batch: groups of responses, and where each response's tokens lie in the device rows.
struct Batch {
    groups: Vec<Vec<Seq>>,
    has_ref: bool,
    has_entropy: bool,
    /// First device row of each response, in (group, response) order.
    starts: Vec<usize>,
    rows: usize,
}

impl Batch {
    fn seqs(&self) -> impl Iterator<Item = &Seq> {
        self.groups.iter().flatten()
    }
    /// The micro-batch's own normaliser.
    fn normaliser(&self) -> Normaliser {
        Normaliser {
            tokens: self
                .seqs()
                .map(|s| s.mask.iter().filter(|&&m| m).count())
                .sum(),
            seqs: self.seqs().count(),
        }
    }
}

/// One token's (old, logp): mostly ratios around the clip range, some far out (dual clip), some
/// exactly 1, some log-ratios exactly ±20 (the clamp's closed bound) or beyond, some on a
/// 1/64 grid (so that the reference can sit exactly ±20 or ±30 away, below).
fn draw_token(rng: &mut Rng) -> (f32, f32, bool) {
    let k = rng.next();
    let old = rng.uniform(-4.0, -0.05) as f32;
    if k < 0.62 {
        (old, old + rng.uniform(-0.6, 0.6) as f32, false)
    } else if k < 0.76 {
        (old, old + rng.uniform(-3.0, 3.0) as f32, false)
    } else if k < 0.82 {
        (old, old, false)
    } else if k < 0.86 {
        // exactly ±20: both values and their difference are exact
        if rng.next() < 0.5 {
            (-22.5, -2.5, true)
        } else {
            (-2.5, -22.5, true)
        }
    } else if k < 0.89 {
        if rng.next() < 0.5 {
            (-27.75, -2.25, true)
        } else {
            (-2.25, -27.75, true)
        }
    } else {
        let o = -((4 + rng.below(250)) as f32) / 64.0;
        let l = o + (rng.below(81) as f32 - 40.0) / 64.0;
        (o, l, true)
    }
}

/// The reference log-prob of a token: near logp, or far (k3's ±10 clamp), or equal, or (on the
/// grid) exactly ±20 / ±30 from it.
fn draw_ref(rng: &mut Rng, logp: f32, on_grid: bool) -> f32 {
    let k = rng.next();
    if on_grid && k < 0.5 {
        let d = [20.0f32, -20.0, 30.0, -30.0][rng.below(4)];
        let r = logp + d;
        assert_eq!(r as f64 - logp as f64, d as f64, "grid values are exact");
        return r;
    }
    if k < 0.6 {
        logp + rng.uniform(-1.0, 1.0) as f32
    } else if k < 0.85 {
        logp + rng.uniform(-5.0, 5.0) as f32
    } else if k < 0.92 {
        logp
    } else {
        logp + rng.uniform(-12.0, 12.0) as f32
    }
}

#[derive(Clone, Copy)]
struct Shape {
    groups: usize,
    group_size: usize,
    max_len: usize,
    /// Per-token advantages (PPO) instead of GRPO's per-sequence ones.
    per_token_adv: bool,
    has_ref: bool,
    has_entropy: bool,
}

const SHAPE: Shape = Shape {
    groups: 3,
    group_size: 4,
    max_len: 48,
    per_token_adv: false,
    has_ref: true,
    has_entropy: true,
};

fn random_batch(rng: &mut Rng, sh: Shape) -> Batch {
    let mut groups = Vec::with_capacity(sh.groups);
    for g in 0..sh.groups {
        let rewards: Vec<f32> = if g == 1 {
            vec![0.5; sh.group_size] // equal rewards: advantages 0 (ties of max)
        } else {
            (0..sh.group_size)
                .map(|_| rng.uniform(0.0, 1.0) as f32)
                .collect()
        };
        let seq_adv = grpo_advantages(&rewards, sh.group_size, true).unwrap();
        let mut seqs = Vec::with_capacity(sh.group_size);
        for (r, &a_seq) in seq_adv.iter().enumerate() {
            let len = if g == 0 && r == 1 {
                0 // an empty sequence
            } else {
                1 + rng.below(sh.max_len)
            };
            let mut s = Seq::default();
            for _ in 0..len {
                let (old, logp, on_grid) = draw_token(rng);
                s.old.push(old);
                s.logp.push(logp);
                s.refl.push(draw_ref(rng, logp, on_grid));
                s.adv.push(if sh.per_token_adv {
                    if rng.next() < 0.05 {
                        0.0
                    } else {
                        rng.uniform(-2.0, 2.0) as f32
                    }
                } else {
                    a_seq
                });
                // group 2's third response is masked out entirely
                s.mask.push(!(g == 2 && r == 2) && rng.next() < 0.85);
                s.ent.push(rng.uniform(0.0, 5.0) as f32);
            }
            seqs.push(s);
        }
        groups.push(seqs);
    }
    // lay the responses out in a shuffled order of rows
    let lens: Vec<usize> = groups.iter().flatten().map(|s| s.logp.len()).collect();
    let mut order: Vec<usize> = (0..lens.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut starts = vec![0; lens.len()];
    let mut row = 0;
    for &s in &order {
        starts[s] = row;
        row += lens[s];
    }
    Batch {
        groups,
        has_ref: sh.has_ref,
        has_entropy: sh.has_entropy,
        starts,
        rows: row,
    }
}

// ---------------------------------------------------------------- CPU reference and device run

/// The CPU loss group by group (the trainer's host path): dlogp per device row, metrics summed.
fn cpu_loss(cfg: &LossConfig, b: &Batch, norm: Normaliser) -> (Vec<f32>, LossMetrics) {
    let mut dlogp = vec![0f32; b.rows];
    let mut metrics = LossMetrics::default();
    let mut k = 0;
    for g in &b.groups {
        let mut offsets = vec![0usize];
        let (mut logp, mut old, mut refl, mut adv, mut mask, mut ent) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        for s in g {
            logp.extend_from_slice(&s.logp);
            old.extend_from_slice(&s.old);
            refl.extend_from_slice(&s.refl);
            adv.extend_from_slice(&s.adv);
            mask.extend_from_slice(&s.mask);
            ent.extend_from_slice(&s.ent);
            offsets.push(logp.len());
        }
        let batch = LossBatch {
            offsets: &offsets,
            logp: &logp,
            old_logp: &old,
            ref_logp: b.has_ref.then_some(&refl[..]),
            advantages: &adv,
            mask: &mask,
            entropy: b.has_entropy.then_some(&ent[..]),
        };
        let out = policy_loss(cfg, &batch, norm).unwrap();
        metrics.add(&out.metrics);
        for (r, s) in g.iter().enumerate() {
            let a = b.starts[k + r];
            dlogp[a..a + s.logp.len()].copy_from_slice(&out.dlogp[offsets[r]..offsets[r + 1]]);
        }
        k += g.len();
    }
    (dlogp, metrics)
}

/// The batch on the device, in its row layout.
struct DeviceBatch {
    logp: CudaSlice<f32>,
    old: CudaSlice<f32>,
    refl: CudaSlice<f32>,
    adv: CudaSlice<f32>,
    ent: CudaSlice<f32>,
    mask: CudaSlice<u8>,
    seq: CudaSlice<u32>,
    seq_tokens: CudaSlice<u32>,
    spans: CudaSlice<u32>,
    rows: usize,
    seqs: usize,
    has_ref: bool,
    has_entropy: bool,
}

impl DeviceBatch {
    fn upload(s: &Arc<CudaStream>, b: &Batch) -> DeviceBatch {
        let mut rows = vec![vec![0f32; b.rows]; 5];
        let mut spans = Vec::new();
        for (k, q) in b.seqs().enumerate() {
            let a = b.starts[k];
            for (dst, src) in rows
                .iter_mut()
                .zip([&q.logp, &q.old, &q.refl, &q.adv, &q.ent])
            {
                dst[a..a + src.len()].copy_from_slice(src);
            }
            spans.push((a, &q.mask[..]));
        }
        let t = LossTables::new(b.rows, &spans).unwrap();
        assert_eq!(t.normaliser(), b.normaliser());
        DeviceBatch {
            logp: upload(s, &rows[0]).unwrap(),
            old: upload(s, &rows[1]).unwrap(),
            refl: upload(s, &rows[2]).unwrap(),
            adv: upload(s, &rows[3]).unwrap(),
            ent: upload(s, &rows[4]).unwrap(),
            mask: upload(s, &t.mask).unwrap(),
            seq: upload(s, &t.seq).unwrap(),
            seq_tokens: upload(s, &t.seq_tokens).unwrap(),
            spans: upload(s, &t.spans).unwrap(),
            rows: b.rows,
            seqs: t.seq_tokens.len(),
            has_ref: b.has_ref,
            has_entropy: b.has_entropy,
        }
    }

    fn inputs(&self) -> PolicyLossInputs<'_> {
        PolicyLossInputs {
            tokens: self.rows,
            logp: &self.logp,
            old_logp: &self.old,
            ref_logp: self
                .has_ref
                .then_some(&self.refl as &dyn cudarc::driver::DevicePtr<f32>),
            advantages: &self.adv,
            mask: &self.mask,
            entropy: self
                .has_entropy
                .then_some(&self.ent as &dyn cudarc::driver::DevicePtr<f32>),
            seq: &self.seq,
            seqs: self.seqs,
            seq_tokens: &self.seq_tokens,
            seq_spans: Some(&self.spans),
        }
    }
}

/// One device call: dlogp (NaN-poisoned first, so an unwritten row fails) added metrics in `acc`.
fn device_loss(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    cfg: &LossConfig,
    d: &DeviceBatch,
    norm: Normaliser,
    acc: &mut PolicyLossAcc,
) -> Vec<f32> {
    let mut dlogp = upload(s, &vec![f32::NAN; d.rows.max(1)]).unwrap();
    policy_loss_device(gpu, s, cfg, norm, &d.inputs(), &mut dlogp, acc).unwrap();
    let mut v = download(s, &dlogp).unwrap();
    v.truncate(d.rows);
    v
}

// ---------------------------------------------------------------- comparisons

/// Distance in f32 ulps (+0 and -0 are 0 apart; NaN is infinitely far from anything).
fn ulps(a: f32, b: f32) -> u32 {
    if a.is_nan() || b.is_nan() {
        return u32::MAX;
    }
    let key = |x: f32| {
        let b = x.to_bits();
        if b & 0x8000_0000 != 0 {
            -((b & 0x7fff_ffff) as i64)
        } else {
            b as i64
        }
    };
    (key(a) - key(b)).unsigned_abs().min(u32::MAX as u64) as u32
}

/// Asserts dlogp within MAX_ULPS (row named) and returns how many rows are bitwise equal.
fn check_dlogp(what: &str, gpu: &[f32], cpu: &[f32]) -> usize {
    assert_eq!(gpu.len(), cpu.len(), "{what}: rows");
    let mut bitwise = 0;
    for (r, (&g, &c)) in gpu.iter().zip(cpu).enumerate() {
        let u = ulps(g, c);
        assert!(
            u <= MAX_ULPS,
            "{what}: row {r}: device dlogp {g:e} vs CPU {c:e} ({u} ulps)"
        );
        bitwise += (g.to_bits() == c.to_bits()) as usize;
    }
    bitwise
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= METRIC_RTOL * b.abs().max(1e-9)
}

fn check_metrics(what: &str, gpu: &LossMetrics, cpu: &LossMetrics) {
    let fields = [
        ("loss", gpu.loss, cpu.loss),
        ("pg_loss", gpu.pg_loss, cpu.pg_loss),
        ("kl", gpu.kl, cpu.kl),
        ("clip_frac", gpu.clip_frac, cpu.clip_frac),
        ("clip_frac_lower", gpu.clip_frac_lower, cpu.clip_frac_lower),
        ("approx_kl", gpu.approx_kl, cpu.approx_kl),
    ];
    for (name, g, c) in fields {
        assert!(close(g, c), "{what}: {name}: device {g:e} vs CPU {c:e}");
    }
    match (gpu.entropy, cpu.entropy) {
        (Some(g), Some(c)) => assert!(close(g, c), "{what}: entropy: device {g:e} vs CPU {c:e}"),
        (None, None) => {}
        (g, c) => panic!("{what}: entropy: device {g:?} vs CPU {c:?}"),
    }
}

/// Runs `cfg` on `b` on both sides (one device call) and compares; returns bitwise rows.
fn compare(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    what: &str,
    cfg: &LossConfig,
    b: &Batch,
    norm: Normaliser,
) -> usize {
    let (cpu_d, cpu_m) = cpu_loss(cfg, b, norm);
    let d = DeviceBatch::upload(s, b);
    let mut acc = PolicyLossAcc::new(gpu, s).unwrap();
    let gpu_d = device_loss(gpu, s, cfg, &d, norm, &mut acc);
    let sums = acc.read(s).unwrap();
    assert_eq!(sums.calls, 1, "{what}");
    assert_eq!(
        sums.tokens as usize,
        b.normaliser().tokens,
        "{what}: masked tokens"
    );
    let bitwise = check_dlogp(what, &gpu_d, &cpu_d);
    check_metrics(what, &loss_metrics(&sums), &cpu_m);
    bitwise
}

/// Device 0, opened once for every test here, or a printed skip (a failure with
/// `ROLLPLEX_REQUIRE_GPU=1`).
fn gpu_or_skip() -> Option<&'static Gpu> {
    static GPU: OnceLock<Option<Gpu>> = OnceLock::new();
    let g = GPU.get_or_init(test_gpu);
    if g.is_none() {
        println!("skipped: no CUDA device");
    }
    g.as_ref()
}

const AGGS: [LossAgg; 3] = [
    LossAgg::TokenMean,
    LossAgg::SeqMeanTokenMean,
    LossAgg::SeqMeanTokenSum,
];
const ESTS: [KlEstimator; 3] = [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3];

fn config(agg: LossAgg, est: KlEstimator, dual: Option<f64>, kl_coef: f64) -> LossConfig {
    LossConfig {
        clip_low: 0.2,
        clip_high: 0.28,
        dual_clip: dual,
        kl_coef,
        kl_estimator: est,
        agg,
        ratio: RatioLevel::Token,
        horizon: 0,
    }
}

/// `cfg` with GSPO's sequence ratio.
fn gspo(cfg: LossConfig) -> LossConfig {
    LossConfig {
        ratio: RatioLevel::Sequence,
        ..cfg
    }
}

/// The mini-batch normaliser of a micro-batch that is one of several (others add tokens and
/// sequences), so the weights are not the micro-batch's own.
fn mini_batch_norm(b: &Batch) -> Normaliser {
    b.normaliser().merge(Normaliser {
        tokens: 37,
        seqs: 5,
    })
}

// ---------------------------------------------------------------- host-only tests

#[test]
fn tables_map_rows_to_sequences_in_any_order() {
    // sequence 0 at rows 3..5, sequence 1 empty, sequence 2 at rows 0..3 (one masked out)
    let t = LossTables::new(
        5,
        &[(3, &[true, true]), (9, &[]), (0, &[true, false, true])],
    )
    .unwrap();
    assert_eq!(t.seq, vec![2, 2, 2, 0, 0]);
    assert_eq!(t.mask, vec![1, 0, 1, 1, 1]);
    assert_eq!(t.seq_tokens, vec![2, 0, 2]);
    assert_eq!(t.spans, vec![3, 5, 0, 0, 0, 3]);
    assert_eq!(t.normaliser(), Normaliser { tokens: 4, seqs: 3 });
    let empty = LossTables::new(0, &[(0, &[])]).unwrap();
    assert_eq!((empty.seq_tokens, empty.spans), (vec![0], vec![0, 0]));
}

#[test]
fn tables_refuse_overlaps_gaps_and_rows_past_the_end() {
    let m = [true, true];
    type Spans<'a> = &'a [(usize, &'a [bool])];
    let cases: [(usize, Spans, &str); 4] = [
        (4, &[(0, &m), (1, &m)], "row 1 belongs to sequences 0 and 1"),
        (3, &[(0, &m)], "row 2 belongs to no sequence"),
        (
            4,
            &[(0, &m), (3, &m)],
            "sequence 1 (rows 3..3+2) ends past the 4 rows",
        ),
        (4, &[(usize::MAX, &m)], "ends past"),
    ];
    for (rows, seqs, want) in cases {
        let e = LossTables::new(rows, seqs).unwrap_err().to_string();
        assert!(e.contains(want), "{seqs:?}: {e}");
    }
}

#[test]
fn kernel_params_carry_the_config_and_the_normaliser() {
    use rollplex_kernels::cuda::{KlKind, LossAggKind, PolicyLossParams, RatioKind};
    let norm = Normaliser {
        tokens: 17,
        seqs: 3,
    };
    for (est, kl) in ESTS.into_iter().zip([KlKind::K1, KlKind::K2, KlKind::K3]) {
        for (agg, ka) in AGGS.into_iter().zip([
            LossAggKind::TokenMean,
            LossAggKind::SeqMeanTokenMean,
            LossAggKind::SeqMeanTokenSum,
        ]) {
            let p = kernel_params(&config(agg, est, Some(3.0), 0.05), norm);
            assert_eq!((p.kl, p.agg, p.ratio), (kl, ka, RatioKind::Token));
            let q = kernel_params(&gspo(config(agg, est, Some(3.0), 0.05)), norm);
            assert_eq!(
                q,
                PolicyLossParams {
                    ratio: RatioKind::Sequence,
                    ..p
                }
            );
            assert_eq!(
                (p.clip_low, p.clip_high, p.dual_clip, p.kl_coef),
                (0.2, 0.28, Some(3.0), 0.05)
            );
            assert_eq!((p.norm_tokens, p.norm_seqs), (17, 3));
        }
    }
    // the CPU's refusals are the kernel's
    let bad = LossConfig {
        clip_low: 1.0,
        ..config(LossAgg::TokenMean, KlEstimator::K1, None, 0.0)
    };
    assert!(bad.validate().is_err() && kernel_params(&bad, norm).validate().is_err());
}

/// Dr. GRPO's `seq_mean_token_sum_norm` reaches the kernel as the token-sum weight over
/// `horizon x S` sequences, and the CPU loss gives the same bits either way, with either ratio.
#[test]
fn dr_grpo_is_the_token_sum_over_horizon_times_sequences() {
    use rollplex_kernels::cuda::LossAggKind;
    let norm = Normaliser {
        tokens: 17,
        seqs: 3,
    };
    let dr = LossConfig {
        horizon: 7,
        ..config(LossAgg::SeqMeanTokenSumNorm, KlEstimator::K3, None, 0.05)
    };
    let p = kernel_params(&dr, norm);
    assert_eq!(p.agg, LossAggKind::SeqMeanTokenSum);
    assert_eq!((p.norm_tokens, p.norm_seqs), (17, 21));
    let b = random_batch(&mut Rng(0xD2_6290), SHAPE);
    let norm = mini_batch_norm(&b);
    let (d1, m1) = cpu_loss(&dr, &b, norm);
    let sum = config(LossAgg::SeqMeanTokenSum, KlEstimator::K3, None, 0.05);
    let (d2, m2) = cpu_loss(
        &sum,
        &b,
        Normaliser {
            seqs: norm.seqs * 7,
            ..norm
        },
    );
    assert_eq!(d1, d2);
    assert_eq!((m1.loss, m1.pg_loss, m1.kl), (m2.loss, m2.pg_loss, m2.kl));
    assert!(m1.loss != 0.0);
    let sum_norm = Normaliser {
        seqs: norm.seqs * 7,
        ..norm
    };
    let (g1, n1) = cpu_loss(&gspo(dr), &b, norm);
    let (g2, n2) = cpu_loss(&gspo(sum), &b, sum_norm);
    assert_eq!(g1, g2);
    assert_eq!((n1.loss, n1.pg_loss, n1.kl), (n2.loss, n2.pg_loss, n2.kl));
    assert!(g1 != d1, "the sequence ratio changes the gradient");
}

// ---------------------------------------------------------------- GPU tests

/// Dr. GRPO on the device against the CPU (the mapping above, through the kernel).
#[test]
fn device_loss_matches_cpu_for_dr_grpo() {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let b = random_batch(&mut Rng(0xD2_6291), SHAPE);
    let cfg = LossConfig {
        horizon: 9,
        ..config(
            LossAgg::SeqMeanTokenSumNorm,
            KlEstimator::K3,
            Some(3.0),
            0.05,
        )
    };
    compare(gpu, &s, "dr_grpo", &cfg, &b, mini_batch_norm(&b));
}

/// Every estimator x aggregation x dual clip (off, 3, 1.5) x kl_coef (0, 0.05), each on a fresh
/// random micro-batch of several groups (GRPO advantages; per-token ones on odd cases).
#[test]
fn device_loss_matches_cpu_for_every_estimator_aggregation_and_clip() {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let mut rng = Rng(0x5EED_1055);
    let (mut cases, mut rows, mut bitwise) = (0, 0, 0);
    for agg in AGGS {
        for est in ESTS {
            for dual in [None, Some(3.0), Some(1.5)] {
                for kl_coef in [0.0, 0.05] {
                    let sh = Shape {
                        per_token_adv: cases % 2 == 1,
                        ..SHAPE
                    };
                    let b = random_batch(&mut rng, sh);
                    let cfg = config(agg, est, dual, kl_coef);
                    let what = format!("{agg:?} {est:?} dual {dual:?} kl_coef {kl_coef}");
                    bitwise += compare(gpu, &s, &what, &cfg, &b, mini_batch_norm(&b));
                    rows += b.rows;
                    cases += 1;
                }
            }
        }
    }
    println!("{cases} cases, {rows} rows, {bitwise} dlogp bitwise equal to the CPU's");
}

/// No reference (kl_coef 0: the KL metric is 0) and no entropy (the metric is None).
#[test]
fn device_loss_without_reference_or_entropy() {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let mut rng = Rng(77);
    for agg in AGGS {
        for dual in [None, Some(3.0)] {
            let b = random_batch(
                &mut rng,
                Shape {
                    has_ref: false,
                    has_entropy: false,
                    ..SHAPE
                },
            );
            let cfg = config(agg, KlEstimator::K3, dual, 0.0);
            compare(
                gpu,
                &s,
                &format!("{agg:?} dual {dual:?} no ref"),
                &cfg,
                &b,
                b.normaliser(),
            );
        }
    }
}

/// GSPO's sequence ratio: every estimator x aggregation (Dr. GRPO's too) x dual clip x
/// kl_coef, with the usual clip range and GSPO's narrow one (most sequences clipped), on fresh
/// random micro-batches (sequences of 1 to 48 tokens, an empty and an all-masked one, sequence
/// means at and beyond the ±20 clamp from single-token sequences); then ties: a group whose
/// tokens all have logp == old has mean log-ratio 0 and ratio 1, on both bounds of a clip range
/// of the point 1.
#[test]
fn device_gspo_matches_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let mut rng = Rng(0x65_5930);
    let (mut cases, mut rows, mut bitwise) = (0, 0, 0);
    let aggs = AGGS.into_iter().chain([LossAgg::SeqMeanTokenSumNorm]);
    for agg in aggs {
        for est in ESTS {
            for dual in [None, Some(3.0)] {
                for kl_coef in [0.0, 0.05] {
                    for (clip_low, clip_high) in [(0.2, 0.28), (3e-4, 4e-4)] {
                        let sh = Shape {
                            per_token_adv: cases % 2 == 1,
                            ..SHAPE
                        };
                        let b = random_batch(&mut rng, sh);
                        let cfg = LossConfig {
                            clip_low,
                            clip_high,
                            horizon: SHAPE.max_len,
                            ..gspo(config(agg, est, dual, kl_coef))
                        };
                        let what = format!(
                            "gspo {agg:?} {est:?} dual {dual:?} kl_coef {kl_coef} clip \
                             {clip_low}/{clip_high}"
                        );
                        bitwise += compare(gpu, &s, &what, &cfg, &b, mini_batch_norm(&b));
                        rows += b.rows;
                        cases += 1;
                    }
                }
            }
        }
    }
    println!("{cases} cases, {rows} rows, {bitwise} dlogp bitwise equal to the CPU's");
    let mut tied = 0;
    for agg in AGGS {
        let mut b = random_batch(&mut rng, SHAPE);
        for q in &mut b.groups[0] {
            q.logp = q.old.clone();
            tied += q.mask.iter().filter(|&&m| m).count();
        }
        let cfg = LossConfig {
            clip_low: 0.0,
            clip_high: 0.0,
            ..gspo(config(agg, KlEstimator::K3, Some(3.0), 0.05))
        };
        compare(
            gpu,
            &s,
            &format!("gspo ties {agg:?}"),
            &cfg,
            &b,
            b.normaliser(),
        );
    }
    assert!(tied > 0);
}

/// Ties: with clip_low = clip_high = 0 the clip range is the point 1, and a token with
/// logp == old has ratio exactly 1 on both sides (exp(0) = 1), so it sits on both clamp
/// bounds and the two surrogates tie: torch's rule (the clamp passes the gradient on its closed
/// interval, max splits it at a tie) gives the full gradient -A w. Zero advantages tie too.
#[test]
fn ties_at_the_clip_bounds_follow_torch() {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let mut rng = Rng(4242);
    let mut on_bound = 0;
    for agg in AGGS {
        for est in ESTS {
            for dual in [None, Some(3.0)] {
                for kl_coef in [0.0, 0.05] {
                    let b = random_batch(&mut rng, SHAPE);
                    let cfg = LossConfig {
                        clip_low: 0.0,
                        clip_high: 0.0,
                        ..config(agg, est, dual, kl_coef)
                    };
                    let what = format!("ties {agg:?} {est:?} dual {dual:?} kl_coef {kl_coef}");
                    let norm = mini_batch_norm(&b);
                    compare(gpu, &s, &what, &cfg, &b, norm);
                    if agg != LossAgg::TokenMean || kl_coef != 0.0 {
                        continue;
                    }
                    // by hand: dlogp = (-A) / N on every counted ratio-1 token
                    let d = DeviceBatch::upload(&s, &b);
                    let mut acc = PolicyLossAcc::new(gpu, &s).unwrap();
                    let got = device_loss(gpu, &s, &cfg, &d, norm, &mut acc);
                    for (k, q) in b.seqs().enumerate() {
                        for t in 0..q.logp.len() {
                            if q.mask[t] && q.logp[t] == q.old[t] {
                                let want = (-(q.adv[t] as f64) * (1.0 / norm.tokens as f64)) as f32;
                                let g = got[b.starts[k] + t];
                                assert_eq!(g, want, "{what}: tie token (seq {k}, t {t})");
                                on_bound += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(on_bound > 20, "only {on_bound} tokens on the clip bounds");
    println!("{on_bound} tokens on both clip bounds took the full gradient");
}

/// A batch of one sequence whose tokens all have log-ratio exactly +20 (the clamp's bound:
/// ratio `exp(20)`, full gradient) with the given advantages, all counted.
fn ratio_bound_batch(adv: &[f32]) -> Batch {
    let n = adv.len();
    let seq = Seq {
        logp: vec![-2.5; n],
        old: vec![-22.5; n],
        refl: vec![-2.5; n],
        adv: adv.to_vec(),
        mask: vec![true; n],
        ent: vec![1.0; n],
    };
    Batch {
        groups: vec![vec![seq]],
        has_ref: false,
        has_entropy: false,
        starts: vec![0],
        rows: n,
    }
}

/// The dual clip's tie: `min(-A c, -A ρ)` with `c` equal to the ratio splits the gradient in
/// half (torch) and does not count as clipped. `c` is set to the device's own `exp(20)`, read
/// back bitwise through the pg metric of a one-token call (so the tie holds on the device
/// whatever the last bit of its `exp`); the gradient is checked against the formula with that
/// ratio, and against the CPU as well when the host's `exp(20)` has the same bits.
#[test]
fn dual_clip_tie_splits_the_gradient() {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let cfg = config(LossAgg::TokenMean, KlEstimator::K1, None, 0.0);
    // probe: A = -1, N = 1: pg = -A * ratio * 1 = ratio, summed with zeros only
    let probe = ratio_bound_batch(&[-1.0]);
    let mut acc = PolicyLossAcc::new(gpu, &s).unwrap();
    device_loss(
        gpu,
        &s,
        &cfg,
        &DeviceBatch::upload(&s, &probe),
        probe.normaliser(),
        &mut acc,
    );
    let ratio = acc.read(&s).unwrap().pg_loss;
    assert!(
        (ratio / 20f64.exp() - 1.0).abs() < 1e-15,
        "device exp(20) = {ratio}"
    );
    let host_agrees = ratio.to_bits() == 20f64.exp().to_bits();

    let adv = [-1.0f32, -0.5, -2.0, -0.3, 0.7, -1.5];
    let b = ratio_bound_batch(&adv);
    let tie = LossConfig {
        dual_clip: Some(ratio),
        ..cfg.clone()
    };
    let norm = b.normaliser();
    let d = DeviceBatch::upload(&s, &b);
    let mut acc = PolicyLossAcc::new(gpu, &s).unwrap();
    let got = device_loss(gpu, &s, &tie, &d, norm, &mut acc);
    let sums = acc.read(&s).unwrap();
    let w = 1.0 / norm.tokens as f64;
    for (t, &a) in adv.iter().enumerate() {
        let a = a as f64;
        // A < 0: the surrogate is -A ρ (gradient -A ρ), tied with -A c: half of it;
        // A > 0: the clipped branch -A (1 + clip_high) wins, gradient (-A * 0) ρ
        let dpg = if a < 0.0 {
            0.5 * (0.0 + -a * ratio)
        } else {
            -a * 0.0 * ratio
        };
        let want = (w * (dpg + 0.0 * 0.0)) as f32;
        assert_eq!(got[t].to_bits(), want.to_bits(), "token {t} (A = {a})");
    }
    assert_eq!(
        sums.clip_frac_lower, 0.0,
        "a tie is not the dual clip taken"
    );
    assert_eq!(
        sums.clip_frac, w,
        "only the positive advantage takes the clipped branch"
    );
    if host_agrees {
        compare(gpu, &s, "dual clip tie", &tie, &b, norm);
    }
    println!(
        "device exp(20) {} the host's",
        if host_agrees {
            "equals"
        } else {
            "differs from"
        }
    );
}

/// Two micro-batches of one mini-batch into one accumulator: the sums are the CPU's metrics of
/// both added, each call's dlogp the CPU's; a call of empty sequences adds nothing but a call.
#[test]
fn micro_batches_accumulate_to_the_mini_batch() {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let mut rng = Rng(99);
    let ratios = [RatioLevel::Token, RatioLevel::Sequence];
    for (agg, ratio) in AGGS.into_iter().flat_map(|a| ratios.map(|r| (a, r))) {
        let cfg = LossConfig {
            ratio,
            ..config(agg, KlEstimator::K3, Some(3.0), 0.05)
        };
        let (b1, b2) = (random_batch(&mut rng, SHAPE), random_batch(&mut rng, SHAPE));
        let norm = b1.normaliser().merge(b2.normaliser());
        let empty = Batch {
            groups: vec![vec![Seq::default(), Seq::default()]],
            has_ref: true,
            has_entropy: true,
            starts: vec![0, 0],
            rows: 0,
        };
        let mut acc = PolicyLossAcc::new(gpu, &s).unwrap();
        let mut cpu_m = LossMetrics::default();
        for (i, b) in [&b1, &empty, &b2].into_iter().enumerate() {
            let (cpu_d, m) = cpu_loss(&cfg, b, norm);
            cpu_m.add(&m);
            let d = DeviceBatch::upload(&s, b);
            let gpu_d = device_loss(gpu, &s, &cfg, &d, norm, &mut acc);
            check_dlogp(
                &format!("{agg:?} {ratio:?} micro-batch {i}"),
                &gpu_d,
                &cpu_d,
            );
        }
        let sums = acc.read(&s).unwrap();
        assert_eq!((sums.calls, sums.tokens as usize), (3, norm.tokens));
        check_metrics(
            &format!("{agg:?} {ratio:?} mini-batch"),
            &loss_metrics(&sums),
            &cpu_m,
        );
        // reset starts the next step at zero
        acc.reset(&s).unwrap();
        let z = acc.read(&s).unwrap();
        assert_eq!((z.calls, z.loss, z.entropy), (0, 0.0, None));
    }
}

/// A large call (more than 256 blocks of partial sums, so the reduction's threads each sum
/// several; 1280 sequences, five blocks of the sequence pass) twice, with each ratio: the same
/// bits in dlogp and in every accumulator slot, and the CPU's numbers.
#[test]
fn two_runs_give_the_same_bits() {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let mut rng = Rng(1234);
    let b = random_batch(
        &mut rng,
        Shape {
            groups: 160,
            group_size: 8,
            max_len: 600,
            ..SHAPE
        },
    );
    assert!(b.rows > 256 * rollplex_kernels::cuda::policy_loss::TOKENS_PER_BLOCK);
    let norm = b.normaliser();
    let d = DeviceBatch::upload(&s, &b);
    for ratio in [RatioLevel::Token, RatioLevel::Sequence] {
        let cfg = LossConfig {
            ratio,
            ..config(LossAgg::SeqMeanTokenMean, KlEstimator::K3, Some(3.0), 0.05)
        };
        same_bits_twice(gpu, &s, &cfg, &b, &d, norm);
    }
}

fn same_bits_twice(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    cfg: &LossConfig,
    b: &Batch,
    d: &DeviceBatch,
    norm: Normaliser,
) {
    let what = format!("large, {:?} ratio", cfg.ratio);
    let (mut a1, mut a2) = (
        PolicyLossAcc::new(gpu, s).unwrap(),
        PolicyLossAcc::new(gpu, s).unwrap(),
    );
    let g1 = device_loss(gpu, s, cfg, d, norm, &mut a1);
    let g2 = device_loss(gpu, s, cfg, d, norm, &mut a2);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&g1) == bits(&g2),
        "{what}: dlogp differs between two runs"
    );
    let (s1, s2) = (
        download(s, a1.slots()).unwrap(),
        download(s, a2.slots()).unwrap(),
    );
    let b64 = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        b64(&s1),
        b64(&s2),
        "{what}: metric sums differ between two runs"
    );
    let (cpu_d, cpu_m) = cpu_loss(cfg, b, norm);
    let bitwise = check_dlogp(&what, &g1, &cpu_d);
    check_metrics(&what, &loss_metrics(&a1.read(s).unwrap()), &cpu_m);
    println!(
        "{what}: {} rows, {bitwise} dlogp bitwise equal to the CPU's",
        b.rows
    );
}

/// Refusals: on the host (lengths, config, missing reference, normaliser sequences, the sequence
/// ratio without row spans) before any launch; on the device (a sequence index out of range,
/// counts that do not add up, more masked tokens than the normaliser, a row span that is not its
/// sequence's rows) when the accumulator is read. Errors, never panics.
#[test]
fn bad_inputs_are_errors_not_panics() {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let mut rng = Rng(5);
    let b = random_batch(&mut rng, SHAPE);
    let d = DeviceBatch::upload(&s, &b);
    let norm = b.normaliser();
    let cfg = config(LossAgg::TokenMean, KlEstimator::K1, None, 0.05);
    let mut dlogp = upload(&s, &vec![0f32; b.rows]).unwrap();
    let mut acc = PolicyLossAcc::new(gpu, &s).unwrap();
    let run = |cfg: &LossConfig,
               x: &PolicyLossInputs<'_>,
               norm: Normaliser,
               dlogp: &mut CudaSlice<f32>,
               acc: &mut PolicyLossAcc| {
        policy_loss_device(gpu, &s, cfg, norm, x, dlogp, acc)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let short = upload(&s, &vec![0f32; b.rows - 1]).unwrap();
    let x = d.inputs();
    let e = run(
        &cfg,
        &PolicyLossInputs {
            old_logp: &short,
            ..x
        },
        norm,
        &mut dlogp,
        &mut acc,
    )
    .unwrap_err();
    assert!(e.contains("old_logp"), "{e}");
    let e = run(
        &cfg,
        &PolicyLossInputs {
            ref_logp: None,
            ..x
        },
        norm,
        &mut dlogp,
        &mut acc,
    )
    .unwrap_err();
    assert!(e.contains("reference"), "{e}");
    let bad = LossConfig {
        dual_clip: Some(0.5),
        ..cfg.clone()
    };
    assert!(run(&bad, &x, norm, &mut dlogp, &mut acc)
        .unwrap_err()
        .contains("dual clip"));
    let few = Normaliser {
        seqs: x.seqs - 1,
        ..norm
    };
    assert!(run(&cfg, &x, few, &mut dlogp, &mut acc)
        .unwrap_err()
        .contains("normaliser"));
    let short_st = upload(&s, &vec![0u32; x.seqs - 1]).unwrap();
    let e = run(
        &cfg,
        &PolicyLossInputs {
            seq_tokens: &short_st,
            ..x
        },
        norm,
        &mut dlogp,
        &mut acc,
    )
    .unwrap_err();
    assert!(e.contains("seq_tokens"), "{e}");
    let seq_cfg = gspo(cfg.clone());
    let e = run(
        &seq_cfg,
        &PolicyLossInputs {
            seq_spans: None,
            ..x
        },
        norm,
        &mut dlogp,
        &mut acc,
    )
    .unwrap_err();
    assert!(e.contains("seq_spans"), "{e}");
    let short_spans = upload(&s, &vec![0u32; 2 * x.seqs - 1]).unwrap();
    let e = run(
        &seq_cfg,
        &PolicyLossInputs {
            seq_spans: Some(&short_spans),
            ..x
        },
        norm,
        &mut dlogp,
        &mut acc,
    )
    .unwrap_err();
    assert!(e.contains("seq_spans"), "{e}");
    // none of the refused calls reached the accumulator
    assert_eq!(acc.read(&s).unwrap().calls, 0);

    // found on the device, refused on reading
    let seq_host: Vec<u32> = (0..b.rows as u32)
        .map(|r| if r == 3 { 999 } else { 0 })
        .collect();
    let bad_seq = upload(&s, &seq_host).unwrap();
    let mut acc = PolicyLossAcc::new(gpu, &s).unwrap();
    run(
        &cfg,
        &PolicyLossInputs { seq: &bad_seq, ..x },
        norm,
        &mut dlogp,
        &mut acc,
    )
    .unwrap();
    let e = acc.read(&s).unwrap_err().to_string();
    assert!(e.contains("sequence index"), "{e}");
    let nan = download(&s, &dlogp).unwrap();
    assert!(nan[3].is_nan(), "the bad row's dlogp is NaN");

    let zeros = upload(&s, &vec![0u32; x.seqs]).unwrap();
    let mut acc = PolicyLossAcc::new(gpu, &s).unwrap();
    run(
        &cfg,
        &PolicyLossInputs {
            seq_tokens: &zeros,
            ..x
        },
        norm,
        &mut dlogp,
        &mut acc,
    )
    .unwrap();
    let e = acc.read(&s).unwrap_err().to_string();
    assert!(e.contains("add up"), "{e}");

    let mut acc = PolicyLossAcc::new(gpu, &s).unwrap();
    let small = Normaliser {
        tokens: norm.tokens - 1,
        ..norm
    };
    run(&cfg, &x, small, &mut dlogp, &mut acc).unwrap();
    let e = acc.read(&s).unwrap_err().to_string();
    assert!(e.contains("normaliser"), "{e}");

    // a span reaching into the next sequence's rows, one past the rows, one reversed: refused on
    // reading, the sequence's counted rows NaN
    let seqs: Vec<&Seq> = b.seqs().collect();
    let k = (0..seqs.len())
        .find(|&k| {
            let end = b.starts[k] + seqs[k].logp.len();
            !seqs[k].logp.is_empty() && end < b.rows && seqs[k].mask.contains(&true)
        })
        .expect("a counted sequence before the last rows");
    let spans = LossTables::new(
        b.rows,
        &(0..seqs.len())
            .map(|k| (b.starts[k], &seqs[k].mask[..]))
            .collect::<Vec<_>>(),
    )
    .unwrap()
    .spans;
    let (first, end) = (spans[2 * k], spans[2 * k + 1]);
    for (lo, hi, why) in [
        (first, end + 1, "into the next sequence"),
        (first, b.rows as u32 + 1, "past the rows"),
        (end, first, "reversed"),
    ] {
        let mut bad = spans.clone();
        (bad[2 * k], bad[2 * k + 1]) = (lo, hi);
        let bad = upload(&s, &bad).unwrap();
        let mut acc = PolicyLossAcc::new(gpu, &s).unwrap();
        run(
            &seq_cfg,
            &PolicyLossInputs {
                seq_spans: Some(&bad),
                ..x
            },
            norm,
            &mut dlogp,
            &mut acc,
        )
        .unwrap();
        let e = acc.read(&s).unwrap_err().to_string();
        assert!(e.contains("row spans"), "{why}: {e}");
        let got = download(&s, &dlogp).unwrap();
        for (t, &m) in seqs[k].mask.iter().enumerate() {
            let g = got[b.starts[k] + t];
            assert!(!m || g.is_nan(), "{why}: counted row {t} has dlogp {g}");
        }
    }
}
