//! Cost model: how long a task takes as a function of its SM share.
//!
//! A roofline whose roofs bend with the SM share (see [`curve`]), per [`WorkKind`], plus fixed
//! per-step latency and host/network transfer terms:
//!
//! ```text
//! time = max(flops / compute_rate(kind, sms), bytes / memory_rate(kind, sms))
//!      + steps * step_overhead(kind) + host_bytes / host_bw(dir) + net_bytes / net_bw
//! ```
//!
//! `host_bw(dir)` is the host link's rate in the direction of the task's host bytes
//! ([`HostDir`]: device -> host for an offload, host -> device otherwise), the profile's
//! measured rates where it has them ([`Profile::host_bw`], [`Profile::host_bw_to_host`]), else
//! the GPU spec's `host_bw` both ways. [`CostModel::time`] prices host bytes host -> device;
//! [`CostModel::time_dir`] takes the direction (the plan's [`rollplex_plan::Op::host_dir`]).
//!
//! Without a profile the rates come from the [`GpuSpec`]'s datasheet peaks and the documented
//! defaults of [`defaults`]; with a [`Profile`] (e.g. `cost/profiles/h200.yaml`) from curves
//! fitted to measurements. Co-running two tasks on disjoint partitions slows each by
//! [`CostModel::corun_slowdown`].
//!
//! `Work::steps` counts sequential layer passes (a chain of dependent kernels): for a window of
//! decode steps it is `decode steps x layers`; for a forward or backward pass
//! `layers x micro-batches`. The per-step overhead is fitted per layer pass.
//!
//! Invariants (property-tested): `time` never grows when SMs are added and never shrinks when
//! any work amount grows; slowdowns are >= 1; nothing here panics on any input (zero SMs give
//! an infinite time for work that needs the GPU).
//!
//! This crate knows the plan's [`Work`] and [`GpuSpec`] types and nothing else of the plan.

pub mod bound;
pub mod curve;
pub mod defaults;
pub mod fit;
pub mod h200;
pub mod profile;

use rollplex_plan::spec::{ClusterSpec, GpuSpec};
use rollplex_plan::work::{Work, WorkKind};

pub use curve::KindCurve;
pub use profile::{
    BesidePoint, CopySum, CorunEntry, CorunPoint, HostCopies, LatencyFit, Point, Profile,
    ProfileError,
};
pub use rollplex_plan::work::HostDir;

use defaults::{default_curve, is_host, kind_index, ALL_KINDS, DEFAULT_CORUN};

const NK: usize = ALL_KINDS.len();

/// The time of one task split into its terms, seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TimeParts {
    /// flops / compute rate.
    pub compute_s: f64,
    /// bytes / memory rate.
    pub memory_s: f64,
    /// steps x per-step latency.
    pub overhead_s: f64,
    /// host_bytes / host bandwidth (in the task's direction).
    pub host_s: f64,
    /// net_bytes / link bandwidth.
    pub net_s: f64,
    /// The work's parts of other kinds ([`Work::parts`]), each at its own kind's time.
    pub parts_s: f64,
}

impl TimeParts {
    /// The task's time: the larger roof plus the additive terms.
    pub fn total(&self) -> f64 {
        self.compute_s.max(self.memory_s)
            + self.overhead_s
            + self.host_s
            + self.net_s
            + self.parts_s
    }

    /// Whether the memory roof is the binding one.
    pub fn memory_bound(&self) -> bool {
        self.memory_s >= self.compute_s
    }
}

/// Time of tasks on one GPU model (see the crate doc).
#[derive(Clone, Debug)]
pub struct CostModel {
    gpu: GpuSpec,
    curves: Vec<KindCurve>,
    corun: [[f64; NK]; NK],
    /// Host -> device bytes/s.
    host_bw: f64,
    /// Device -> host bytes/s.
    host_bw_to_host: f64,
    net_bw: Option<f64>,
    source: String,
}

impl CostModel {
    /// A model of `gpu`, calibrated by `profile` when given (kinds the profile does not list
    /// keep the datasheet defaults). If the profile was measured on a GPU of the same name, its
    /// measured absolute rates are kept even where `gpu` declares other peaks (and another host
    /// link); on another GPU its efficiencies apply to `gpu`'s peaks and its host rates, as
    /// fractions of its own GPU's `host_bw`, to `gpu`'s.
    pub fn new(gpu: &GpuSpec, profile: Option<&Profile>) -> Self {
        let mut curves: Vec<KindCurve> = ALL_KINDS.iter().map(|&k| default_curve(gpu, k)).collect();
        let mut corun = [[DEFAULT_CORUN; NK]; NK];
        let mut host_bw = gpu.host_bw;
        let mut host_bw_to_host = None;
        let mut net_bw = None;
        let mut source = format!("datasheet defaults for {}", gpu.name);
        if let Some(p) = profile {
            let same_gpu = p.gpu.name.eq_ignore_ascii_case(&gpu.name);
            let (fscale, bscale) = if same_gpu && gpu.bf16_flops > 0.0 && gpu.hbm_bw > 0.0 {
                (p.gpu.bf16_flops / gpu.bf16_flops, p.gpu.hbm_bw / gpu.hbm_bw)
            } else {
                (1.0, 1.0)
            };
            for (kind, c) in &p.kinds {
                let mut c = c.clone();
                c.eff_compute *= fscale;
                c.eff_memory *= bscale;
                curves[kind_index(*kind)] = c;
            }
            corun = [[p.default_corun; NK]; NK];
            for e in &p.corun {
                corun[kind_index(e.kind)][kind_index(e.other)] = e.slowdown;
            }
            // host rates as the curves: absolute on a GPU of the same name, else the same
            // fraction of the job's host link as of the profile GPU's
            let hscale = if same_gpu || !(p.gpu.host_bw > 0.0 && gpu.host_bw > 0.0) {
                1.0
            } else {
                gpu.host_bw / p.gpu.host_bw
            };
            if let Some(bw) = p.host_bw {
                host_bw = bw * hscale;
            }
            host_bw_to_host = p.host_bw_to_host.map(|bw| bw * hscale);
            net_bw = p.net_bw;
            source = format!(
                "profile measured on {}{}{}",
                p.gpu.name,
                if p.source.is_empty() { "" } else { ": " },
                abridged(&p.source)
            );
        }
        for &k in &ALL_KINDS {
            for &o in &ALL_KINDS {
                if is_host(k) || is_host(o) {
                    corun[kind_index(k)][kind_index(o)] = 1.0;
                }
            }
        }
        CostModel {
            gpu: gpu.clone(),
            curves,
            corun,
            host_bw,
            host_bw_to_host: host_bw_to_host.unwrap_or(host_bw),
            net_bw,
            source,
        }
    }

    /// The model a job on `cluster` is planned and simulated with: its GPU, calibrated by
    /// `profile`, with the intra-node link as the GPU <-> GPU bandwidth (the compiler and the
    /// simulator must agree on this; cross-node slowdowns are already in each task's work).
    pub fn for_cluster(cluster: &ClusterSpec, profile: Option<&Profile>) -> Self {
        CostModel::new(&cluster.gpu, profile).with_net_bw(cluster.intra_node_bw)
    }

    /// The GPU <-> GPU bandwidth set by [`CostModel::with_net_bw`] or the profile, if any.
    pub fn explicit_net_bw(&self) -> Option<f64> {
        self.net_bw
    }

    /// Sets the GPU <-> GPU bandwidth (bytes/s per direction, e.g. the cluster's intra-node
    /// link). Without it, a profile's `net_bw` is used, else the host link (PCIe) bandwidth.
    pub fn with_net_bw(mut self, bw: f64) -> Self {
        if bw > 0.0 && bw.is_finite() {
            self.net_bw = Some(bw);
        }
        self
    }

    /// Seconds for `work` of `kind` running alone on `sms` SMs of one GPU, its host bytes
    /// going host -> device ([`CostModel::time_dir`] for an offload's).
    pub fn time(&self, kind: WorkKind, work: &Work, sms: u32) -> f64 {
        self.time_dir(kind, work, sms, HostDir::ToDevice)
    }

    /// [`CostModel::time`] with the host bytes going `dir` (a plan task's `op.host_dir()`).
    pub fn time_dir(&self, kind: WorkKind, work: &Work, sms: u32, dir: HostDir) -> f64 {
        self.time_parts_dir(kind, work, sms, dir).total()
    }

    /// [`CostModel::time`] split into its terms.
    pub fn time_parts(&self, kind: WorkKind, work: &Work, sms: u32) -> TimeParts {
        self.time_parts_dir(kind, work, sms, HostDir::ToDevice)
    }

    /// [`CostModel::time_dir`] split into its terms.
    pub fn time_parts_dir(&self, kind: WorkKind, work: &Work, sms: u32, dir: HostDir) -> TimeParts {
        let c = &self.curves[kind_index(kind)];
        let curve_of = |k: WorkKind| &self.curves[kind_index(k)];
        time_parts(
            &self.gpu,
            c,
            &curve_of,
            self.host_bw_of(dir),
            self.net_bw(),
            kind,
            work,
            sms,
        )
    }

    /// Multiplier (>= 1) on a task's time while it co-runs with a task of kind `other` on the
    /// rest of the GPU. Host work (reward) neither slows nor is slowed.
    pub fn corun_slowdown(&self, kind: WorkKind, other: WorkKind) -> f64 {
        self.corun[kind_index(kind)][kind_index(other)].max(1.0)
    }

    /// Allowed SM partition sizes: what either side of a two-way split can get. One side is a
    /// multiple of the granularity, the other the remainder (132 SMs, granularity 8: 8, 16, ...,
    /// 128 and 4, 12, ..., 124), plus the whole GPU. Sorted, no duplicates.
    pub fn sm_options(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .split_options()
            .into_iter()
            .flat_map(|(a, b)| [a, b])
            .collect();
        v.push(self.gpu.sms.max(1));
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The two-way splits a green-context partition allows: `(a, all - a)` with `a` a positive
    /// multiple of the granularity and `all - a > 0`.
    pub fn split_options(&self) -> Vec<(u32, u32)> {
        let all = self.gpu.sms;
        let g = self.gpu.sm_granularity.max(1);
        (1..)
            .map(|i| i * g)
            .take_while(|&a| a < all)
            .map(|a| (a, all - a))
            .collect()
    }

    pub fn gpu(&self) -> &GpuSpec {
        &self.gpu
    }

    /// Replaces the curve of `kind` (what-if studies, sensitivity analysis, fitting).
    pub fn set_curve(&mut self, kind: WorkKind, curve: KindCurve) {
        self.curves[kind_index(kind)] = curve;
    }

    /// Replaces the co-run slowdown of `kind` beside `other` (values below 1 count as 1).
    pub fn set_corun_slowdown(&mut self, kind: WorkKind, other: WorkKind, slowdown: f64) {
        if slowdown.is_finite() {
            self.corun[kind_index(kind)][kind_index(other)] = slowdown.max(1.0);
        }
    }

    /// The curve the model uses for `kind`.
    pub fn curve(&self, kind: WorkKind) -> &KindCurve {
        &self.curves[kind_index(kind)]
    }

    /// Host -> device bandwidth in use, bytes/s.
    pub fn host_bw(&self) -> f64 {
        self.host_bw
    }

    /// Device -> host bandwidth in use, bytes/s.
    pub fn host_bw_to_host(&self) -> f64 {
        self.host_bw_to_host
    }

    /// Host link bandwidth in use in direction `dir`, bytes/s.
    pub fn host_bw_of(&self, dir: HostDir) -> f64 {
        match dir {
            HostDir::ToDevice => self.host_bw,
            HostDir::ToHost => self.host_bw_to_host,
        }
    }

    /// GPU <-> GPU bandwidth in use, bytes/s (falls back to the host link, host -> device).
    pub fn net_bw(&self) -> f64 {
        self.net_bw.unwrap_or(self.host_bw)
    }

    /// Where the numbers come from, one line (for `--stats` and plan headers).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Time until both of two tasks that start together on disjoint partitions are done.
    pub fn corun_time(&self, a: (WorkKind, &Work, u32), b: (WorkKind, &Work, u32)) -> f64 {
        corun_pair_time(
            self.time(a.0, a.1, a.2),
            self.time(b.0, b.1, b.2),
            self.corun_slowdown(a.0, b.0),
            self.corun_slowdown(b.0, a.0),
        )
    }
}

/// The terms of [`CostModel::time`] for one curve `c` of the task's kind, its parts priced
/// with `curve_of` their kinds (shared with the fitter).
#[allow(clippy::too_many_arguments)]
pub(crate) fn time_parts<'a>(
    gpu: &GpuSpec,
    c: &KindCurve,
    curve_of: &dyn Fn(WorkKind) -> &'a KindCurve,
    host_bw: f64,
    net_bw: f64,
    kind: WorkKind,
    work: &Work,
    sms: u32,
) -> TimeParts {
    let parts_s = work
        .parts
        .iter()
        .map(|p| {
            let pc = curve_of(p.kind);
            time_parts(gpu, pc, curve_of, host_bw, net_bw, p.kind, &p.work, sms).total()
        })
        .sum();
    let total = gpu.sms.max(1);
    // Host work does not run on SMs: it sees the whole device for its (small) GPU part.
    let s = if is_host(kind) { total } else { sms.min(total) };
    let div = |amount: f64, rate: f64| {
        // NaN and negative amounts count as none.
        let amount = if amount > 0.0 { amount } else { 0.0 };
        if amount == 0.0 {
            0.0
        } else if rate > 0.0 {
            amount / rate
        } else {
            f64::INFINITY
        }
    };
    TimeParts {
        compute_s: div(work.flops, c.compute_rate(gpu.bf16_flops, s, total)),
        memory_s: div(work.bytes, c.memory_rate(gpu.hbm_bw, s, total)),
        overhead_s: work.steps as f64 * c.step_overhead_s,
        host_s: div(work.host_bytes, host_bw),
        net_s: div(work.net_bytes, net_bw),
        parts_s,
    }
}

/// Makespan of two tasks that start together, take `a` and `b` seconds alone, and run
/// `slow_a` / `slow_b` times slower while both run; the one left finishes at full speed.
pub fn corun_pair_time(a: f64, b: f64, slow_a: f64, slow_b: f64) -> f64 {
    let (sa, sb) = (slow_a.max(1.0), slow_b.max(1.0));
    // NaN and non-positive times count as none
    if a.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
        || b.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
    {
        return a.max(b).max(0.0);
    }
    if a * sa <= b * sb {
        let t1 = a * sa;
        t1 + (b - t1 / sb)
    } else {
        let t1 = b * sb;
        t1 + (a - t1 / sa)
    }
}

/// Time of a task that takes `alone` seconds alone while side work runs beside it from its
/// start: side piece `i` lasts `side[i].0` seconds (its own, slowed time) and slows the task
/// `side[i].1` times while it runs; the pieces run one after another, and once they are done
/// (or once the task is) the task runs at full speed. With one piece that ends first it is
/// [`corun_pair_time`]'s makespan; with side work longer than the slowed task, `alone` times the
/// slowdown. How the planner prices a decode window with side tasks in it.
pub fn beside_time(alone: f64, side: &[(f64, f64)]) -> f64 {
    if alone.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        return 0.0;
    }
    let (mut left, mut elapsed) = (alone, 0.0);
    for &(t, slow) in side {
        let slow = if slow.is_finite() { slow.max(1.0) } else { 1.0 };
        // NaN and non-positive times count as none
        if t.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            continue;
        }
        if left * slow <= t {
            return elapsed + left * slow;
        }
        elapsed += t;
        left -= t / slow;
    }
    elapsed + left
}

/// A profile's `source` for one line of a report: a merge of many runs lists every input, so
/// past [`SOURCE_CHARS`] characters it is cut (the profile file keeps all of it).
fn abridged(source: &str) -> String {
    match source.char_indices().nth(SOURCE_CHARS) {
        None => source.to_string(),
        Some((end, _)) => format!(
            "{} ... (the profile's `source` lists the rest)",
            &source[..end]
        ),
    }
}

/// Characters of a profile's `source` a report line shows ([`abridged`]).
const SOURCE_CHARS: usize = 240;

#[cfg(test)]
mod tests;
