//! Fitting a [`Profile`] from measurements.
//!
//! Per kind, the six curve parameters minimise the mean squared log error of the predicted
//! times of that kind's points (alone points plus both sides of every co-run point, each with
//! its time alone), plus a weak pull towards the datasheet default that only matters for
//! parameters the points cannot see (a kind measured only while compute-bound says nothing of
//! its memory roof). The search is Nelder-Mead over an unconstrained vector mapped into
//! [`Bounds`], restarted from several sharpness values; it is deterministic.
//!
//! The per-step latency (`step_overhead_s`: kernel launches and tails of one layer pass) is
//! fitted by one of two rules ([`LatencyFit`]).
//!
//! [`LatencyFit::Shared`] (the bench, [`Profile::fit`]): two workload shapes of two model widths
//! cannot tell it from efficiency: a free fit of prefill on the bench explains the 3B model's
//! lower GEMM rate with 0.4 ms per layer, which would then be charged to every small forward
//! pass. So it is fitted freely first; the kind where it takes the largest share of the time
//! (decode: many short steps) fixes it, if that share is at least 5%, and the other kinds are
//! refitted with it. Only a kind with at least `MIN_LEADER_TIME` of the measured time may lead
//! (in a runtime's profile the advantages, microseconds of pure latency, would otherwise set
//! every kind's latency). Kinds whose points have no flops and no bytes (a reward's steps, a
//! no-op sync: what the runtime's own profiles measure) are pure latency: they keep their own
//! fit and cannot lead (their share is 1 by construction). A kind whose points the shared
//! latency misses by more than `MAX_SHARED_ERR` (where its own fit does better) keeps its own
//! fit: the shared value contradicts what it measured.
//!
//! [`LatencyFit::PerKind`] (`rollplex-run --profile`, merges of such profiles): every kind keeps
//! its free fit. One model's tasks of several sizes (a micro-batch backpropagating into one
//! prompt copy or eight) tell a kind's fixed cost per layer pass from its rate: on the H200 the
//! 3B forward and backward kinds fit 260-340 us per layer pass, decode 67 us per step, and the
//! shared value missed the micro-batches of one size 10% slow and of the other 10% fast.
//!
//! Co-run slowdowns: one value per unordered pair of kinds, fitted by golden-section search
//! against the co-run makespans given the *measured* times alone (so curve errors do not leak
//! into it). The reference measurements (`cost/profiles/reference/`) do not separate who slows whom, so both orders
//! get the same value.
//!
//! Beside points (one side of a co-run, its time alone not measured: what a run of an overlap
//! plan gives, [`crate::BesidePoint`]) give *ordered* slowdowns: for each (kind, beside) pair, the
//! geometric mean of measured / the fitted curve's time alone on the same SMs, at least 1. The
//! curves are fitted first and without them (a slowed time is not a time alone), so here the
//! curve's error at that partition does leak into the slowdown: that product is what the
//! planner multiplies, and what the run measured. Where a pair has both, the beside points'
//! value wins for its order (they were measured on the runtime that runs the plans; the
//! bench's symmetric value stays for the other order). `default_corun`, the slowdown of pairs
//! no measurement covers, is the mean of all fitted entries.

use std::collections::BTreeMap;

use rollplex_plan::spec::GpuSpec;
use rollplex_plan::work::WorkKind;

use crate::curve::{Bounds, KindCurve};
use crate::defaults::{default_curve, is_host, kind_index, kind_name, ALL_KINDS, DEFAULT_CORUN};
use crate::profile::{
    BesidePoint, CorunEntry, CorunPoint, HostCopies, LatencyFit, Point, Profile, ProfileError,
};
use crate::{corun_pair_time, CostModel};

/// Weight of the pull towards the default curve (in mapped-parameter units squared).
const PRIOR: f64 = 1e-4;

/// How a merged profile's `source` starts; the list of its inputs follows.
const MERGED: &str = "merged fit of: ";

/// A kind refitted with the shared per-step latency keeps its own fit instead when the shared
/// one misses its points by more than this (root mean square of the log errors; 0.25: ~28%):
/// the shared value contradicts what the kind measured (on the CPU backend a decode step's
/// fixed costs are not a forward pass's).
const MAX_SHARED_ERR: f64 = 0.25;

/// A kind whose points spend at least this share of their time in per-step latency fixes the
/// latency for every kind.
const MIN_OVERHEAD_SHARE: f64 = 0.05;

/// A kind whose points hold less than this share of all points' measured time cannot fix the
/// shared latency.
const MIN_LEADER_TIME: f64 = 0.01;

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn logit(y: f64) -> f64 {
    let y = y.clamp(1e-9, 1.0 - 1e-9);
    (y / (1.0 - y)).ln()
}

/// Maps between a curve and an unconstrained vector (sm_bw on a log scale).
struct Mapping {
    unit_bw: f64,
}

impl Mapping {
    fn lin(x: f64, (lo, hi): (f64, f64)) -> f64 {
        lo + (hi - lo) * sigmoid(x)
    }
    fn unlin(v: f64, (lo, hi): (f64, f64)) -> f64 {
        logit((v - lo) / (hi - lo))
    }
    fn to_curve(&self, x: &[f64]) -> KindCurve {
        let (lo, hi) = Bounds::SM_BW_REL;
        let rel = (lo.ln() + (hi.ln() - lo.ln()) * sigmoid(x[3])).exp();
        KindCurve {
            eff_compute: Self::lin(x[0], Bounds::EFF),
            eff_memory: Self::lin(x[1], Bounds::EFF),
            compute_exponent: Self::lin(x[2], Bounds::EXPONENT),
            sm_bw: rel * self.unit_bw,
            sharpness: Self::lin(x[4], Bounds::SHARPNESS),
            step_overhead_s: Self::lin(x[5], Bounds::OVERHEAD_S),
        }
    }
    fn curve_to_vec(&self, c: &KindCurve) -> Vec<f64> {
        let (lo, hi) = Bounds::SM_BW_REL;
        let rel = (c.sm_bw / self.unit_bw).clamp(lo, hi);
        vec![
            Self::unlin(c.eff_compute, Bounds::EFF),
            Self::unlin(c.eff_memory, Bounds::EFF),
            Self::unlin(c.compute_exponent, Bounds::EXPONENT),
            logit((rel.ln() - lo.ln()) / (hi.ln() - lo.ln())),
            Self::unlin(c.sharpness, Bounds::SHARPNESS),
            Self::unlin(c.step_overhead_s, Bounds::OVERHEAD_S),
        ]
    }
}

/// Nelder-Mead minimisation of `f` from `x0` (standard coefficients), `iters` evaluations max.
fn nelder_mead(f: &dyn Fn(&[f64]) -> f64, x0: &[f64], step: f64, iters: usize) -> (Vec<f64>, f64) {
    let n = x0.len();
    let mut simplex: Vec<(Vec<f64>, f64)> = Vec::with_capacity(n + 1);
    simplex.push((x0.to_vec(), f(x0)));
    for i in 0..n {
        let mut x = x0.to_vec();
        x[i] += step;
        let v = f(&x);
        simplex.push((x, v));
    }
    let mut evals = n + 1;
    let order = |s: &mut Vec<(Vec<f64>, f64)>| s.sort_by(|a, b| a.1.total_cmp(&b.1));
    while evals < iters {
        order(&mut simplex);
        let spread = simplex[n].1 - simplex[0].1;
        if spread.abs() < 1e-14 {
            break;
        }
        let centroid: Vec<f64> = (0..n)
            .map(|j| simplex[..n].iter().map(|p| p.0[j]).sum::<f64>() / n as f64)
            .collect();
        let along = |t: f64| -> Vec<f64> {
            centroid
                .iter()
                .zip(&simplex[n].0)
                .map(|(c, w)| c + t * (w - c))
                .collect()
        };
        let xr = along(-1.0);
        let fr = f(&xr);
        evals += 1;
        if fr < simplex[0].1 {
            let xe = along(-2.0);
            let fe = f(&xe);
            evals += 1;
            simplex[n] = if fe < fr { (xe, fe) } else { (xr, fr) };
        } else if fr < simplex[n - 1].1 {
            simplex[n] = (xr, fr);
        } else {
            let xc = if fr < simplex[n].1 {
                along(-0.5)
            } else {
                along(0.5)
            };
            let fc = f(&xc);
            evals += 1;
            if fc < fr.min(simplex[n].1) {
                simplex[n] = (xc, fc);
            } else {
                let best = simplex[0].0.clone();
                for p in simplex.iter_mut().skip(1) {
                    p.0 = best
                        .iter()
                        .zip(&p.0)
                        .map(|(b, x)| b + 0.5 * (x - b))
                        .collect();
                    p.1 = f(&p.0);
                    evals += 1;
                }
            }
        }
    }
    order(&mut simplex);
    simplex.swap_remove(0)
}

/// Golden-section minimisation of a unimodal `f` on `[lo, hi]`.
fn golden(f: &dyn Fn(f64) -> f64, mut lo: f64, mut hi: f64) -> f64 {
    let r = (5f64.sqrt() - 1.0) / 2.0;
    let (mut c, mut d) = (hi - r * (hi - lo), lo + r * (hi - lo));
    let (mut fc, mut fd) = (f(c), f(d));
    for _ in 0..100 {
        if fc < fd {
            hi = d;
            d = c;
            fd = fc;
            c = hi - r * (hi - lo);
            fc = f(c);
        } else {
            lo = c;
            c = d;
            fc = fd;
            d = lo + r * (hi - lo);
            fd = f(d);
        }
    }
    (lo + hi) / 2.0
}

/// Every kind's curve, by [`kind_index`]: `fitted` where given, else the default. What the
/// parts of a point's work ([`rollplex_plan::work::Work::parts`]) are priced with.
fn curves_of(gpu: &GpuSpec, fitted: &BTreeMap<WorkKind, KindCurve>) -> Vec<KindCurve> {
    ALL_KINDS
        .iter()
        .map(|k| {
            fitted
                .get(k)
                .cloned()
                .unwrap_or_else(|| default_curve(gpu, *k))
        })
        .collect()
}

/// Fits one kind's curve to its points; `overhead` fixes the per-step latency; `others` prices
/// the points' parts.
fn fit_kind(
    gpu: &GpuSpec,
    map: &Mapping,
    kind: WorkKind,
    pts: &[&Point],
    overhead: Option<f64>,
    others: &[KindCurve],
) -> Result<KindCurve, ProfileError> {
    let mut x0 = map.curve_to_vec(&default_curve(gpu, kind));
    if let Some(o) = overhead {
        x0[5] = Mapping::unlin(o, Bounds::OVERHEAD_S);
    }
    let curve_of = |x: &[f64]| {
        let mut c = map.to_curve(x);
        if let Some(o) = overhead {
            c.step_overhead_s = o;
        }
        c
    };
    let objective = |x: &[f64]| {
        let c = curve_of(x);
        let fit: f64 = pts
            .iter()
            .map(|p| log_err(predict(gpu, &c, others, p), p.seconds).powi(2))
            .sum::<f64>()
            / pts.len() as f64;
        let prior: f64 = x.iter().zip(&x0).map(|(a, b)| (a - b).powi(2)).sum();
        fit + PRIOR * prior
    };
    let mut best: Option<(Vec<f64>, f64)> = None;
    for sharp in [1.0, 2.0, 4.0, 8.0] {
        let mut start = x0.clone();
        start[4] = Mapping::unlin(sharp, Bounds::SHARPNESS);
        let mut cur = nelder_mead(&objective, &start, 0.5, 4000);
        for _ in 0..3 {
            cur = nelder_mead(&objective, &cur.0, 0.2, 3000);
        }
        if best.as_ref().is_none_or(|b| cur.1 < b.1) {
            best = Some(cur);
        }
    }
    let (x, _) = best.ok_or_else(|| ProfileError::Fit("empty search".into()))?;
    let c = curve_of(&x);
    c.validate(kind_name(kind), gpu.hbm_bw, gpu.sms)
        .map_err(ProfileError::Fit)?;
    Ok(c)
}

/// Predicted time of a point under `curve` on `gpu`, its parts under `others` (the same terms
/// as [`CostModel::time`]).
fn predict(gpu: &GpuSpec, curve: &KindCurve, others: &[KindCurve], p: &Point) -> f64 {
    let curve_of = |k: WorkKind| &others[kind_index(k)];
    crate::time_parts(
        gpu,
        curve,
        &curve_of,
        gpu.host_bw,
        gpu.host_bw,
        p.kind,
        &p.work,
        p.sms,
    )
    .total()
}

/// Root mean square of the log errors of `curve` on `pts`.
fn rms_log_err(gpu: &GpuSpec, curve: &KindCurve, others: &[KindCurve], pts: &[&Point]) -> f64 {
    let n = pts.len().max(1) as f64;
    (pts.iter()
        .map(|p| log_err(predict(gpu, curve, others, p), p.seconds).powi(2))
        .sum::<f64>()
        / n)
        .sqrt()
}

fn log_err(pred: f64, meas: f64) -> f64 {
    if pred > 0.0 && pred.is_finite() {
        (pred / meas).ln()
    } else {
        1e3
    }
}

/// Ordered slowdowns from beside points: per (kind, beside) pair, the geometric mean of the
/// measured time over `curves`' time alone on the same SMs (the default curve for a kind
/// without one), at least 1, rounded to 1e-4. Pairs with host work are skipped: the model
/// never slows it nor lets it slow anything. In (kind, beside) order.
fn beside_slowdowns(
    gpu: &GpuSpec,
    curves: &BTreeMap<WorkKind, KindCurve>,
    beside: &[BesidePoint],
) -> Vec<CorunEntry> {
    let mut logs: BTreeMap<(WorkKind, WorkKind), Vec<f64>> = BTreeMap::new();
    let others = curves_of(gpu, curves);
    for b in beside {
        if is_host(b.kind) || is_host(b.beside) {
            continue;
        }
        let curve = curves
            .get(&b.kind)
            .cloned()
            .unwrap_or_else(|| default_curve(gpu, b.kind));
        let alone = predict(gpu, &curve, &others, &b.as_point());
        if alone > 0.0 && alone.is_finite() {
            logs.entry((b.kind, b.beside))
                .or_default()
                .push((b.seconds / alone).ln());
        }
    }
    logs.into_iter()
        .map(|((kind, other), l)| {
            let mean = l.iter().sum::<f64>() / l.len() as f64;
            let s = mean.exp().clamp(1.0, 10.0);
            CorunEntry {
                kind,
                other,
                slowdown: (s * 1e4).round() / 1e4,
            }
        })
        .collect()
}

/// One row of [`Profile::residuals`].
#[derive(Clone, Debug, PartialEq)]
pub struct Residual {
    /// `kind@sms` or `kind@sms || kind@sms` for a co-run.
    pub what: String,
    pub note: String,
    pub measured_s: f64,
    pub predicted_s: f64,
}

impl Residual {
    /// predicted / measured - 1.
    pub fn rel_err(&self) -> f64 {
        self.predicted_s / self.measured_s - 1.0
    }
}

impl Profile {
    /// Fits curves and co-run slowdowns to measurements taken on `gpu` (see the module doc).
    /// Kinds without points are left out (the cost model uses their defaults).
    pub fn fit(
        gpu: &GpuSpec,
        points: Vec<Point>,
        corun_points: Vec<CorunPoint>,
    ) -> Result<Profile, ProfileError> {
        Profile::fit_all(gpu, points, corun_points, Vec::new(), LatencyFit::Shared)
    }

    /// [`Profile::fit`] with beside points too (ordered slowdowns) and the per-step latency
    /// fitted by `latency` (see the module doc). Host bytes are priced at the GPU spec's rate
    /// ([`Profile::refit`] a profile with measured host rates).
    pub fn fit_all(
        gpu: &GpuSpec,
        points: Vec<Point>,
        corun_points: Vec<CorunPoint>,
        beside_points: Vec<BesidePoint>,
        latency: LatencyFit,
    ) -> Result<Profile, ProfileError> {
        Profile::unfitted(gpu, points, corun_points, beside_points, latency).refit()
    }

    /// A profile of these measurements on `gpu`, not fitted yet (no curves, no slowdowns, the
    /// GPU spec's host rate): set what else it knows (its measured host copies,
    /// [`Profile::set_host_copies`]), then [`Profile::refit`].
    pub fn unfitted(
        gpu: &GpuSpec,
        points: Vec<Point>,
        corun_points: Vec<CorunPoint>,
        beside_points: Vec<BesidePoint>,
        latency: LatencyFit,
    ) -> Profile {
        Profile {
            gpu: gpu.clone(),
            source: String::new(),
            host_bw: None,
            host_bw_to_host: None,
            host_copies: HostCopies::default(),
            net_bw: None,
            default_corun: DEFAULT_CORUN,
            kinds: BTreeMap::new(),
            corun: Vec::new(),
            points,
            corun_points,
            beside_points,
            latency,
        }
    }

    /// Fits the curves and slowdowns again from the profile's own measurements (points,
    /// co-run and beside points, by its latency rule), keeping its GPU, source, host and link
    /// rates: the points' host bytes are priced at the profile's host -> device rate (the
    /// rate the cost model gives them: a point carries no direction, and the runtime writes no
    /// point of a host copy, whose time gives the measured rates instead).
    pub fn refit(self) -> Result<Profile, ProfileError> {
        if self.points.is_empty() && self.corun_points.is_empty() && self.beside_points.is_empty() {
            return Err(ProfileError::Fit("no measurements were given".into()));
        }
        let mut profile = Profile {
            default_corun: DEFAULT_CORUN,
            kinds: BTreeMap::new(),
            corun: Vec::new(),
            ..self
        };
        profile.validate()?;
        // what the fit prices the points with: the spec, its host link at the profile's rate
        // (the default curves do not depend on it)
        let gpu = &GpuSpec {
            host_bw: profile.host_bw.unwrap_or(profile.gpu.host_bw),
            ..profile.gpu.clone()
        };
        let latency = profile.latency;

        let mut by_kind: BTreeMap<WorkKind, Vec<&Point>> = BTreeMap::new();
        for p in profile
            .points
            .iter()
            .chain(profile.corun_points.iter().flat_map(|c| [&c.a, &c.b]))
        {
            by_kind.entry(p.kind).or_default().push(p);
        }
        let map = Mapping {
            unit_bw: gpu.hbm_bw / gpu.sms.max(1) as f64,
        };
        // Kinds that are parts of other kinds' work (the vision tower inside a prefix or a
        // micro-batch) are fitted first, from their own points, so that the kinds holding them
        // are fitted to what is left of their measured times.
        let part_kinds: Vec<WorkKind> = by_kind
            .values()
            .flatten()
            .flat_map(|p| p.work.parts.iter().map(|q| q.kind))
            .collect();
        let order: Vec<WorkKind> = by_kind
            .keys()
            .filter(|k| part_kinds.contains(k))
            .chain(by_kind.keys().filter(|k| !part_kinds.contains(k)))
            .copied()
            .collect();
        let mut kinds = BTreeMap::new();
        for kind in &order {
            let others = curves_of(gpu, &kinds);
            kinds.insert(
                *kind,
                fit_kind(gpu, &map, *kind, &by_kind[kind], None, &others)?,
            );
        }
        // The per-step latency is measured where it shows: the kind whose points spend the
        // largest share of their time in it. Every other kind reuses that value instead of
        // letting it absorb differences in efficiency (see the module doc).
        let fitted = curves_of(gpu, &kinds);
        let share = |kind: &WorkKind, pts: &[&Point]| {
            let c = &kinds[kind];
            pts.iter()
                .map(|p| p.work.steps as f64 * c.step_overhead_s / predict(gpu, c, &fitted, p))
                .sum::<f64>()
                / pts.len() as f64
        };
        // (validated: work amounts are finite and >= 0)
        let latency_only = |pts: &[&Point]| {
            pts.iter()
                .all(|p| p.work.total_flops() <= 0.0 && p.work.total_bytes() <= 0.0)
        };
        let total: f64 = by_kind.values().flatten().map(|p| p.seconds).sum();
        let measured = |pts: &[&Point]| pts.iter().map(|p| p.seconds).sum::<f64>();
        let leader = by_kind
            .iter()
            .filter(|_| latency == LatencyFit::Shared)
            .filter(|(_, pts)| !latency_only(pts) && measured(pts) >= MIN_LEADER_TIME * total)
            .map(|(k, pts)| (*k, share(k, pts)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        if let Some((lead, s)) = leader {
            if s >= MIN_OVERHEAD_SHARE {
                let overhead = kinds[&lead].step_overhead_s;
                for kind in &order {
                    let pts = &by_kind[kind];
                    if *kind != lead && !latency_only(pts) {
                        let others = curves_of(gpu, &kinds);
                        let shared = fit_kind(gpu, &map, *kind, pts, Some(overhead), &others)?;
                        let (e_shared, e_own) = (
                            rms_log_err(gpu, &shared, &others, pts),
                            rms_log_err(gpu, &kinds[kind], &others, pts),
                        );
                        if e_shared <= MAX_SHARED_ERR || e_shared <= e_own {
                            kinds.insert(*kind, shared);
                        }
                    }
                }
            }
        }
        profile.kinds = kinds;

        let mut pairs: BTreeMap<(WorkKind, WorkKind), Vec<&CorunPoint>> = BTreeMap::new();
        for c in &profile.corun_points {
            let key = if c.a.kind <= c.b.kind {
                (c.a.kind, c.b.kind)
            } else {
                (c.b.kind, c.a.kind)
            };
            pairs.entry(key).or_default().push(c);
        }
        let mut corun = Vec::new();
        for ((k1, k2), cps) in &pairs {
            let err = |s: f64| -> f64 {
                cps.iter()
                    .map(|c| {
                        log_err(corun_pair_time(c.a.seconds, c.b.seconds, s, s), c.seconds).powi(2)
                    })
                    .sum()
            };
            let s = (golden(&err, 1.0, 3.0) * 1e4).round() / 1e4;
            corun.push(CorunEntry {
                kind: *k1,
                other: *k2,
                slowdown: s,
            });
            if k1 != k2 {
                corun.push(CorunEntry {
                    kind: *k2,
                    other: *k1,
                    slowdown: s,
                });
            }
        }
        for e in beside_slowdowns(gpu, &profile.kinds, &profile.beside_points) {
            match corun
                .iter_mut()
                .find(|c| c.kind == e.kind && c.other == e.other)
            {
                Some(c) => c.slowdown = e.slowdown,
                None => corun.push(e),
            }
        }
        if !corun.is_empty() {
            let mean = corun.iter().map(|e| e.slowdown).sum::<f64>() / corun.len() as f64;
            profile.default_corun = (mean * 1e4).round() / 1e4;
        }
        profile.corun = corun;
        profile.validate()?;
        Ok(profile)
    }

    /// One profile fitted to the measurements of several (`rollplexc merge-profiles`): e.g.
    /// runs of a serial and an overlap plan, with and without prefix dedup, each of which
    /// covers only its own task sizes and partitions. Every input must have been measured on
    /// the same GPU (name and peaks); the names label the inputs in errors and in `source`.
    /// Measured host rates combine by bytes: per direction, every input's copies' bytes over
    /// their seconds ([`HostCopies`]); a direction no input measured keeps the first input's
    /// figure set by hand, as does the link bandwidth. The latency is fitted per kind when
    /// every input was, else shared.
    pub fn merge(inputs: &[(String, Profile)]) -> Result<Profile, ProfileError> {
        let Some((_, first)) = inputs.first() else {
            return Err(ProfileError::Fit("no profiles to merge".into()));
        };
        let gpu = first.gpu.clone();
        let (mut points, mut corun, mut beside) = (Vec::new(), Vec::new(), Vec::new());
        let mut sources = Vec::new();
        for (name, p) in inputs {
            if p.gpu != gpu {
                return Err(ProfileError::Invalid(format!(
                    "{name} was measured on {} ({} SMs, {:.3e} B/s, {:.3e} FLOP/s), {} on {}                      ({} SMs, {:.3e} B/s, {:.3e} FLOP/s): merge only profiles of one GPU",
                    p.gpu.name,
                    p.gpu.sms,
                    p.gpu.hbm_bw,
                    p.gpu.bf16_flops,
                    inputs[0].0,
                    gpu.name,
                    gpu.sms,
                    gpu.hbm_bw,
                    gpu.bf16_flops
                )));
            }
            // a merged input contributes its own inputs, so merging merges stays one flat list
            sources.push(match p.source.strip_prefix(MERGED) {
                Some(inner) => inner.to_string(),
                None if p.source.is_empty() => name.clone(),
                None => format!("{name} ({})", p.source),
            });
            points.extend(p.points.iter().cloned());
            corun.extend(p.corun_points.iter().cloned());
            beside.extend(p.beside_points.iter().cloned());
        }
        let latency = if inputs.iter().all(|(_, p)| p.latency == LatencyFit::PerKind) {
            LatencyFit::PerKind
        } else {
            LatencyFit::Shared
        };
        // Measured host rates: each direction's copies of every input together (a rate
        // weighted by the bytes each run moved); a direction no input measured keeps the
        // first figure set by hand.
        let copies = inputs
            .iter()
            .fold(HostCopies::default(), |a, (_, p)| a.plus(&p.host_copies));
        let mut merged = Profile::unfitted(&gpu, points, corun, beside, latency);
        merged.source = format!("{MERGED}{}", sources.join("; "));
        merged.host_bw = inputs
            .iter()
            .filter(|(_, p)| p.host_copies.to_device.is_empty())
            .find_map(|(_, p)| p.host_bw);
        merged.host_bw_to_host = inputs
            .iter()
            .filter(|(_, p)| p.host_copies.to_host.is_empty())
            .find_map(|(_, p)| p.host_bw_to_host);
        merged.net_bw = inputs.iter().find_map(|(_, p)| p.net_bw);
        merged.set_host_copies(copies);
        merged.refit()
    }

    /// Each stored measurement next to what this profile's model predicts for it (co-runs with
    /// the model's own times alone, as a planner would see them; a beside point as its time
    /// alone times its slowdown).
    pub fn residuals(&self) -> Vec<Residual> {
        let model = CostModel::new(&self.gpu, Some(self));
        let mut out = Vec::new();
        let at = |p: &Point| format!("{}@{}", kind_name(p.kind), p.sms);
        for p in self
            .points
            .iter()
            .chain(self.corun_points.iter().flat_map(|c| [&c.a, &c.b]))
        {
            out.push(Residual {
                what: at(p),
                note: p.note.clone(),
                measured_s: p.seconds,
                predicted_s: model.time(p.kind, &p.work, p.sms),
            });
        }
        for b in &self.beside_points {
            out.push(Residual {
                what: format!("{} beside {}", at(&b.as_point()), kind_name(b.beside)),
                note: b.note.clone(),
                measured_s: b.seconds,
                predicted_s: model.time(b.kind, &b.work, b.sms)
                    * model.corun_slowdown(b.kind, b.beside),
            });
        }
        for c in &self.corun_points {
            out.push(Residual {
                what: format!("{} || {}", at(&c.a), at(&c.b)),
                note: c.note.clone(),
                measured_s: c.seconds,
                predicted_s: model.corun_time(
                    (c.a.kind, &c.a.work, c.a.sms),
                    (c.b.kind, &c.b.work, c.b.sms),
                ),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::defaults::datasheet;
    use rollplex_plan::work::Work;

    /// A point of 1 TFLOP of `kind` on `sms` SMs that took `seconds`.
    fn pt(kind: WorkKind, sms: u32, seconds: f64) -> Point {
        Point {
            kind,
            sms,
            work: Work {
                flops: 1e12,
                ..Work::default()
            },
            seconds,
            note: String::new(),
        }
    }

    #[test]
    fn nelder_mead_finds_a_quadratic_minimum() {
        let f = |x: &[f64]| (x[0] - 1.0).powi(2) + 3.0 * (x[1] + 2.0).powi(2);
        let (x, v) = nelder_mead(&f, &[0.0, 0.0], 0.5, 2000);
        assert!(
            v < 1e-10 && (x[0] - 1.0).abs() < 1e-4 && (x[1] + 2.0).abs() < 1e-4,
            "{x:?}"
        );
    }

    #[test]
    fn golden_finds_a_minimum() {
        let x = golden(&|s| (s - 1.37).powi(2), 1.0, 3.0);
        assert!((x - 1.37).abs() < 1e-6);
    }

    #[test]
    fn mapping_round_trips() {
        let gpu = datasheet("H200").unwrap();
        let map = Mapping {
            unit_bw: gpu.hbm_bw / 132.0,
        };
        let c = default_curve(&gpu, WorkKind::Decode);
        let back = map.to_curve(&map.curve_to_vec(&c));
        for (a, b) in [
            (c.eff_compute, back.eff_compute),
            (c.eff_memory, back.eff_memory),
            (c.compute_exponent, back.compute_exponent),
            (c.sm_bw, back.sm_bw),
            (c.sharpness, back.sharpness),
            (c.step_overhead_s, back.step_overhead_s),
        ] {
            assert!((a - b).abs() <= 1e-6 * a.abs().max(1e-9), "{a} vs {b}");
        }
    }

    /// Points generated by a known curve are fitted back to (nearly) the same times, on SM
    /// counts the fit never saw.
    #[test]
    fn fit_recovers_a_synthetic_curve() {
        let gpu = datasheet("H200").unwrap();
        let truth = KindCurve {
            eff_compute: 0.45,
            eff_memory: 0.8,
            compute_exponent: 0.9,
            sm_bw: 55e9,
            sharpness: 3.0,
            step_overhead_s: 25e-6,
        };
        let work = |b: f64, f: f64, steps: u32| Work {
            flops: f,
            bytes: b,
            steps,
            ..Work::default()
        };
        let shapes = [
            work(16e9 * 100.0, 0.8e12 * 100.0, 2800),
            work(6e9 * 150.0, 0.1e12 * 150.0, 5400),
        ];
        let mut points = Vec::new();
        for w in &shapes {
            for sms in [16, 32, 48, 64, 96, 132] {
                let p = Point {
                    kind: WorkKind::Decode,
                    sms,
                    work: w.clone(),
                    seconds: 1.0,
                    note: String::new(),
                };
                let seconds = predict(&gpu, &truth, &[], &p);
                points.push(Point { seconds, ..p });
            }
        }
        let prof = Profile::fit(&gpu, points, vec![]).unwrap();
        let fitted = &prof.kinds[&WorkKind::Decode];
        for w in &shapes {
            for sms in [24, 40, 56, 80, 120] {
                let p = Point {
                    kind: WorkKind::Decode,
                    sms,
                    work: w.clone(),
                    seconds: 1.0,
                    note: String::new(),
                };
                let (a, b) = (
                    predict(&gpu, &truth, &[], &p),
                    predict(&gpu, fitted, &[], &p),
                );
                assert!(
                    (b / a - 1.0).abs() < 0.02,
                    "sms {sms}: truth {a} fitted {b}"
                );
            }
        }
    }

    /// A kind whose points hold a part of another kind (a micro-batch with the vision tower's
    /// backward inside) is fitted to what the part leaves: the part kind's own points fix its
    /// rate, and the holder's fitted curve predicts its own work alone as the truth does.
    /// Pricing the part at the holder's rate (what the fit did before parts) misses by > 10%.
    #[test]
    fn fit_subtracts_the_parts_of_a_kind() {
        use rollplex_plan::work::WorkPart;
        let gpu = datasheet("H200").unwrap();
        let curve = |eff_compute: f64| KindCurve {
            eff_compute,
            eff_memory: 0.7,
            compute_exponent: 1.0,
            sm_bw: 50e9,
            sharpness: 2.0,
            step_overhead_s: 300e-6,
        };
        let (vision, bwd) = (curve(0.25), curve(0.55));
        let mut truth = curves_of(&gpu, &BTreeMap::new());
        truth[kind_index(WorkKind::VisionEncode)] = vision.clone();
        truth[kind_index(WorkKind::ActorBwd)] = bwd.clone();
        let work = |f: f64, steps: u32| Work {
            flops: f,
            bytes: f / 400.0,
            steps,
            ..Work::default()
        };
        let mut points = Vec::new();
        let mut point = |kind: WorkKind, work: Work| {
            let c = truth[kind_index(kind)].clone();
            let p = Point {
                kind,
                sms: 132,
                work,
                seconds: 1.0,
                note: String::new(),
            };
            let seconds = predict(&gpu, &c, &truth, &p);
            points.push(Point { seconds, ..p });
        };
        for items in [1.0, 2.0, 4.0, 8.0] {
            point(WorkKind::VisionEncode, work(20e12 * items, 32));
        }
        // micro-batches of one or eight prompt copies, each with one group's tower backward
        for (copies, groups) in [(1.0, 1.0), (1.0, 2.0), (8.0, 1.0), (8.0, 2.0), (4.0, 1.0)] {
            let mut w = work(150e12 * copies * groups + 100e12, 72);
            w.parts.push(WorkPart {
                kind: WorkKind::VisionEncode,
                work: work(60e12 * groups, 64),
            });
            point(WorkKind::ActorBwd, w);
        }
        let prof = Profile::fit_all(&gpu, points, vec![], vec![], LatencyFit::PerKind).unwrap();
        let plain = Point {
            kind: WorkKind::ActorBwd,
            sms: 132,
            work: work(600e12, 72),
            seconds: 1.0,
            note: String::new(),
        };
        let fitted = curves_of(&gpu, &prof.kinds);
        let (want, got) = (
            predict(&gpu, &bwd, &truth, &plain),
            predict(
                &gpu,
                &fitted[kind_index(WorkKind::ActorBwd)],
                &fitted,
                &plain,
            ),
        );
        assert!(
            (got / want - 1.0).abs() < 0.03,
            "fitted {got} vs truth {want}"
        );
        // the same points with the part folded into the holder's own work
        let folded: Vec<Point> = prof
            .points
            .iter()
            .map(|p| {
                let mut w = p.work.clone();
                for q in std::mem::take(&mut w.parts) {
                    w.flops += q.work.flops;
                    w.bytes += q.work.bytes;
                    w.steps += q.work.steps;
                }
                Point {
                    work: w,
                    ..p.clone()
                }
            })
            .collect();
        let prof = Profile::fit_all(&gpu, folded, vec![], vec![], LatencyFit::PerKind).unwrap();
        let fitted = curves_of(&gpu, &prof.kinds);
        let got = predict(
            &gpu,
            &fitted[kind_index(WorkKind::ActorBwd)],
            &fitted,
            &plain,
        );
        assert!(
            (got / want - 1.0).abs() > 0.10,
            "folded {got} vs truth {want}"
        );
    }

    #[test]
    fn fit_recovers_a_corun_slowdown() {
        let gpu = datasheet("H200").unwrap();
        let corun: Vec<CorunPoint> = [(40, 0.6, 0.5), (64, 0.45, 0.7), (80, 0.42, 0.9)]
            .into_iter()
            .map(|(s, d, p)| CorunPoint {
                seconds: corun_pair_time(d, p, 1.2, 1.2),
                a: pt(WorkKind::Decode, s, d),
                b: pt(WorkKind::Prefill, 132 - s, p),
                note: String::new(),
            })
            .collect();
        let prof = Profile::fit(&gpu, vec![], corun).unwrap();
        let s = prof.corun_of(WorkKind::Decode, WorkKind::Prefill).unwrap();
        assert!((s - 1.2).abs() < 1e-3, "{s}");
        assert_eq!(prof.corun_of(WorkKind::Prefill, WorkKind::Decode), Some(s));
    }

    /// A kind with only steps (a host reward) keeps its own latency; the GPU kind leads; a kind
    /// the shared latency would make 50x too slow keeps its own fit.
    #[test]
    fn latency_only_kinds_keep_their_own_overhead() {
        let gpu = datasheet("H200").unwrap();
        let pt = |kind, work: Work, seconds| Point {
            kind,
            sms: 132,
            work,
            seconds,
            note: String::new(),
        };
        let steps = |n| Work {
            steps: n,
            ..Work::default()
        };
        let decode = |b: f64, n| Work {
            bytes: b,
            steps: n,
            ..Work::default()
        };
        // advantage: 8 cheap steps in 3 us, which decode's 20 us per step would make 160 us
        let adv = |b: f64| Work {
            bytes: b,
            steps: 8,
            ..Work::default()
        };
        let points = vec![
            pt(WorkKind::Advantage, adv(1e6), 3.0e-6),
            pt(WorkKind::Advantage, adv(2e6), 3.4e-6),
            pt(WorkKind::Reward, steps(1), 40e-6),
            pt(WorkKind::Reward, steps(2), 80e-6),
            pt(WorkKind::WeightSync, steps(1), 1e-7),
            pt(WorkKind::Decode, decode(1e9, 100), 0.3e-3 + 100.0 * 20e-6),
            pt(WorkKind::Decode, decode(4e9, 400), 1.2e-3 + 400.0 * 20e-6),
        ];
        let prof = Profile::fit(&gpu, points, vec![]).unwrap();
        for r in prof.residuals() {
            assert!(r.rel_err().abs() < 0.05, "{} {r:?}", r.what);
        }
        assert!((prof.kinds[&WorkKind::Reward].step_overhead_s / 40e-6 - 1.0).abs() < 0.05);
    }

    /// Points of `kind` timed under `truth` on `sms` (work: bytes and steps).
    fn timed(gpu: &GpuSpec, truth: &KindCurve, kind: WorkKind, sms: u32, gb: f64) -> Point {
        let p = Point {
            kind,
            sms,
            work: Work {
                flops: gb * 40e9,
                bytes: gb * 1e9,
                steps: 100,
                ..Work::default()
            },
            seconds: 1.0,
            note: String::new(),
        };
        Point {
            seconds: predict(gpu, truth, &[], &p),
            ..p
        }
    }

    fn beside(p: &Point, slowdown: f64, beside: WorkKind) -> BesidePoint {
        BesidePoint {
            kind: p.kind,
            sms: p.sms,
            work: p.work.clone(),
            seconds: p.seconds * slowdown,
            beside,
            note: String::new(),
        }
    }

    /// A run of an overlap plan: decode alone on the whole GPU and on its partition, decode's
    /// steps beside the side work 1.5x slower, the side work on its partition 1.25x slower than
    /// the curve says. The fit gives back both ordered slowdowns, and the beside points leave
    /// the curves as the points alone fit them.
    #[test]
    fn beside_points_give_ordered_slowdowns_and_leave_the_curves() {
        let gpu = datasheet("H200").unwrap();
        let truth = KindCurve {
            eff_compute: 0.5,
            eff_memory: 0.6,
            compute_exponent: 1.0,
            sm_bw: 40e9,
            sharpness: 2.0,
            step_overhead_s: 20e-6,
        };
        let (d, r) = (WorkKind::Decode, WorkKind::RefPrefix);
        let mut alone = Vec::new();
        for gb in [200.0, 300.0, 400.0] {
            for sms in [64, 132] {
                alone.push(timed(&gpu, &truth, d, sms, gb));
            }
            alone.push(timed(&gpu, &truth, r, 132, gb / 10.0));
        }
        let side = [
            beside(&timed(&gpu, &truth, d, 64, 250.0), 1.5, r),
            beside(&timed(&gpu, &truth, d, 64, 150.0), 1.5, r),
            beside(&timed(&gpu, &truth, r, 68, 25.0), 1.25, d),
        ];
        let without = Profile::fit(&gpu, alone.clone(), vec![]).unwrap();
        let with =
            Profile::fit_all(&gpu, alone, vec![], side.to_vec(), LatencyFit::Shared).unwrap();
        assert_eq!(with.kinds, without.kinds);
        let got = |k, o| with.corun_of(k, o).unwrap();
        // The fit saw decode alone on its partition: its slowdown is the measured one.
        assert!((got(d, r) / 1.5 - 1.0).abs() < 0.01, "{}", got(d, r));
        // ref_prefix was seen alone only on the whole GPU: its slowdown carries the curve's
        // error on 68 SMs, so that the product is what was measured.
        let model = CostModel::new(&gpu, Some(&with));
        let b = &side[2];
        let alone = model.time(r, &b.work, 68);
        assert!((got(r, d) * alone / b.seconds - 1.0).abs() < 1e-3);
        assert!(got(r, d) > 1.0);
        assert!((with.default_corun - (got(d, r) + got(r, d)) / 2.0).abs() < 1e-4);
        assert_eq!(model.corun_slowdown(d, r), got(d, r));
        for res in with.residuals() {
            assert!(res.rel_err().abs() < 0.02, "{res:?}");
        }
        assert!(with
            .residuals()
            .iter()
            .any(|res| res.what == "decode@64 beside ref_prefix"));
    }

    /// A beside point faster than the curve alone gives no speed-up (slowdowns are >= 1); a
    /// pair with host work is not fitted (the model never slows it).
    #[test]
    fn beside_slowdowns_are_at_least_one_and_skip_host_work() {
        let gpu = datasheet("H200").unwrap();
        let truth = default_curve(&gpu, WorkKind::Decode);
        let p = timed(&gpu, &truth, WorkKind::Decode, 132, 100.0);
        let fast = beside(
            &timed(&gpu, &truth, WorkKind::Decode, 64, 100.0),
            0.8,
            WorkKind::Prefill,
        );
        let host = beside(
            &timed(&gpu, &truth, WorkKind::Decode, 64, 100.0),
            2.0,
            WorkKind::Reward,
        );
        let prof =
            Profile::fit_all(&gpu, vec![p], vec![], vec![fast, host], LatencyFit::Shared).unwrap();
        assert_eq!(
            prof.corun_of(WorkKind::Decode, WorkKind::Prefill),
            Some(1.0)
        );
        assert_eq!(prof.corun_of(WorkKind::Decode, WorkKind::Reward), None);
    }

    /// The bench's symmetric value stays for the order the runtime did not measure.
    #[test]
    fn beside_slowdown_replaces_the_bench_value_for_its_order_only() {
        let gpu = datasheet("H200").unwrap();
        let corun = vec![CorunPoint {
            seconds: corun_pair_time(0.6, 0.5, 1.2, 1.2),
            a: pt(WorkKind::Decode, 64, 0.6),
            b: pt(WorkKind::Prefill, 68, 0.5),
            note: String::new(),
        }];
        let curve_only = Profile::fit(&gpu, vec![], corun.clone()).unwrap();
        let model = CostModel::new(&gpu, Some(&curve_only));
        let alone = model.time(WorkKind::Decode, &pt(WorkKind::Decode, 64, 1.0).work, 64);
        let b = BesidePoint {
            kind: WorkKind::Decode,
            sms: 64,
            work: pt(WorkKind::Decode, 64, 1.0).work,
            seconds: alone * 1.6,
            beside: WorkKind::Prefill,
            note: String::new(),
        };
        let prof = Profile::fit_all(&gpu, vec![], corun, vec![b], LatencyFit::Shared).unwrap();
        let s = |k, o| prof.corun_of(k, o).unwrap();
        assert!((s(WorkKind::Decode, WorkKind::Prefill) - 1.6).abs() < 1e-3);
        assert!((s(WorkKind::Prefill, WorkKind::Decode) - 1.2).abs() < 1e-3);
    }

    #[test]
    fn merge_fits_every_input_and_refuses_another_gpu() {
        let gpu = datasheet("H200").unwrap();
        let truth = default_curve(&gpu, WorkKind::Decode);
        let a = Profile::fit(
            &gpu,
            vec![timed(&gpu, &truth, WorkKind::Decode, 132, 100.0)],
            vec![],
        )
        .unwrap();
        let side = beside(
            &timed(&gpu, &truth, WorkKind::Decode, 64, 100.0),
            1.4,
            WorkKind::RefPrefix,
        );
        let b = Profile::fit_all(
            &gpu,
            vec![timed(&gpu, &truth, WorkKind::Decode, 64, 50.0)],
            vec![],
            vec![side],
            LatencyFit::PerKind,
        )
        .unwrap();
        assert_eq!(b.latency, LatencyFit::PerKind);
        let m =
            Profile::merge(&[("a.yaml".into(), a.clone()), ("b.yaml".into(), b.clone())]).unwrap();
        assert_eq!((m.points.len(), m.beside_points.len()), (2, 1));
        assert!(m.source.starts_with("merged fit of: a.yaml") && m.source.contains("b.yaml"));
        // a merge of merges lists the inputs of each, not one merge inside another
        let mm =
            Profile::merge(&[("m.yaml".into(), m.clone()), ("c.yaml".into(), a.clone())]).unwrap();
        assert_eq!(
            mm.source.matches("merged fit of").count(),
            1,
            "{}",
            mm.source
        );
        assert!(mm.source.starts_with(&m.source) && mm.source.contains("c.yaml"));
        assert!(!mm.source.contains("m.yaml"));
        assert!(m.corun_of(WorkKind::Decode, WorkKind::RefPrefix).unwrap() > 1.3);
        // per kind only when every input was fitted so
        assert_eq!(m.latency, LatencyFit::Shared);
        let both = Profile::merge(&[("b.yaml".into(), b.clone()), ("b2.yaml".into(), b)]).unwrap();
        assert_eq!(both.latency, LatencyFit::PerKind);

        let mut other = a.clone();
        other.gpu = datasheet("H800").unwrap();
        let e = Profile::merge(&[("a.yaml".into(), a), ("h800.yaml".into(), other)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("h800.yaml was measured on H800") && e.contains("a.yaml on H200"),
            "{e}"
        );
        assert!(Profile::merge(&[]).is_err());
    }

    #[test]
    fn a_beside_point_must_leave_sms_for_the_work_beside_it() {
        let gpu = datasheet("H200").unwrap();
        let truth = default_curve(&gpu, WorkKind::Decode);
        let whole = beside(
            &timed(&gpu, &truth, WorkKind::Decode, 132, 100.0),
            1.4,
            WorkKind::RefPrefix,
        );
        let e = Profile::fit_all(&gpu, vec![], vec![], vec![whole], LatencyFit::Shared)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("beside point 0") && e.contains("leaves none"),
            "{e}"
        );
    }

    /// A runtime's profile: micro-batches of two sizes with 300 us per layer pass of fixed cost,
    /// decode with 60 us, and advantages of a few microseconds of pure latency. Per kind, each
    /// latency comes back and every point is fitted; shared, the advantages may not lead (they
    /// hold a negligible share of the time) and the micro-batches take decode's latency, which
    /// misses their two sizes in opposite directions.
    #[test]
    fn per_kind_latency_tells_fixed_costs_from_the_rate() {
        let gpu = datasheet("H200").unwrap();
        let c = |o: f64| KindCurve {
            eff_compute: 0.6,
            eff_memory: 0.7,
            compute_exponent: 1.0,
            sm_bw: 50e9,
            sharpness: 2.0,
            step_overhead_s: o,
        };
        let at = |kind, curve: &KindCurve, flops: f64, bytes: f64, steps: u32| {
            let p = Point {
                kind,
                sms: 132,
                work: Work {
                    flops,
                    bytes,
                    steps,
                    ..Work::default()
                },
                seconds: 1.0,
                note: String::new(),
            };
            Point {
                seconds: predict(&gpu, curve, &[], &p),
                ..p
            }
        };
        let (bwd, dec) = (c(300e-6), c(60e-6));
        let mut pts = Vec::new();
        for _ in 0..4 {
            pts.push(at(WorkKind::ActorBwd, &bwd, 80e12, 1e11, 180));
            pts.push(at(WorkKind::ActorBwd, &bwd, 228e12, 2e11, 180));
        }
        for gb in [400.0, 450.0, 500.0] {
            pts.push(at(WorkKind::Decode, &dec, 1e12, gb * 1e9, 2304));
        }
        pts.push(at(WorkKind::Advantage, &c(3e-6), 80.0, 128.0, 1));
        let own = Profile::fit_all(&gpu, pts.clone(), vec![], vec![], LatencyFit::PerKind).unwrap();
        for r in own.residuals() {
            assert!(r.rel_err().abs() < 0.01, "{r:?}");
        }
        let o = own.kinds[&WorkKind::ActorBwd].step_overhead_s;
        assert!((o / 300e-6 - 1.0).abs() < 0.1, "{o}");
        let shared = Profile::fit(&gpu, pts, vec![]).unwrap();
        let o = shared.kinds[&WorkKind::ActorBwd].step_overhead_s;
        assert_eq!(o, shared.kinds[&WorkKind::Decode].step_overhead_s);
        assert!(o < 100e-6, "{o}");
        let worst = shared
            .residuals()
            .iter()
            .filter(|r| r.what.starts_with("actor_bwd"))
            .map(|r| r.rel_err().abs())
            .fold(0.0, f64::max);
        assert!(worst > 0.05, "{worst}");
    }

    #[test]
    fn fit_without_points_is_an_error() {
        let gpu = datasheet("H200").unwrap();
        let e = Profile::fit(&gpu, vec![], vec![]).unwrap_err();
        assert!(e.to_string().contains("no measurements"), "{e}");
    }
}
