//! Measured profiles: what a GPU really does, as per-kind efficiency curves plus the raw
//! measurements they were fitted from.
//!
//! A profile is YAML (`cost/profiles/h200.yaml` is the shipped one; `rollplex-run --profile`
//! writes new ones). It keeps the points it was fitted from, so a profile can be refitted,
//! reviewed and extended; [`Profile::fit`] turns points into curves.
//!
//! Efficiencies are fractions of the peaks of [`Profile::gpu`] (the GPU the points were measured
//! on). On that same GPU the cost model reproduces the measured absolute speeds even if the job
//! declares other peak numbers; on another GPU the fractions carry over to its peaks.
//!
//! Three kinds of measurement: `points` (a task alone on its SMs), `corun_points` (two tasks
//! started together on disjoint partitions, each also timed alone on its partition: what the
//! bench measures) and `beside_points` (one task timed while work of another kind ran on the
//! rest of the GPU the whole time, its time alone on that partition not measured: what one run
//! of an overlap plan measures, `rollplex-run --profile`). [`Profile::merge`] fits one profile
//! to the measurements of several.
//!
//! Host <-> device bandwidth, per direction: `host_bw` (host -> device: reloads, and the host
//! bytes of every task that is not an offload) and `host_bw_to_host` (device -> host:
//! offloads; absent, `host_bw`'s figure), each absent for the GPU spec's `host_bw`. A runtime's
//! profile measures them: `host_copies` holds, per direction, the copy tasks of the run, their
//! bytes and their times, and the rate is bytes over seconds (`rollplex-run --profile`, the
//! plan's `Offload` and `Reload` tasks). Older profiles without these fields read as before.
//!
//! Invariants checked by [`Profile::validate`] (run by `from_yaml` and `fit`): every curve is
//! inside [`crate::curve::Bounds`], slowdowns are finite and >= 1, points have positive times
//! and SM counts within the GPU, a beside point leaves SMs for the work beside it, bandwidths
//! are positive, and a direction with measured copies states their rate.

use std::collections::BTreeMap;

use rollplex_plan::spec::GpuSpec;
use rollplex_plan::work::{Work, WorkKind};
use serde::{Deserialize, Serialize};

use crate::curve::KindCurve;
use crate::defaults::kind_name;

/// Errors of reading, checking and fitting profiles.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("profile is not valid YAML for this format: {0}")]
    Yaml(String),
    #[error("profile is inconsistent: {0}")]
    Invalid(String),
    #[error("cannot fit a profile: {0}")]
    Fit(String),
}

/// A measured GPU profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// The GPU the points were measured on; efficiencies are fractions of its peaks.
    pub gpu: GpuSpec,
    /// Where the numbers come from (tool, date, versions).
    #[serde(default)]
    pub source: String,
    /// Host -> device bandwidth, bytes/s: a reload's copy, and the host bytes of every task
    /// that is not an offload (else the GPU spec's `host_bw`). Measured where `host_copies`
    /// has copies to the device (then it is their rate), else set by hand.
    #[serde(default)]
    pub host_bw: Option<f64>,
    /// Device -> host bandwidth, bytes/s: an offload's copy (else `host_bw`'s figure).
    /// Measured where `host_copies` has copies to the host (then it is their rate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_bw_to_host: Option<f64>,
    /// The host <-> device copies the measured rates come from, per direction.
    #[serde(default, skip_serializing_if = "HostCopies::is_empty")]
    pub host_copies: HostCopies,
    /// Measured GPU <-> GPU bandwidth, bytes/s per direction (else the cluster's, else none).
    #[serde(default)]
    pub net_bw: Option<f64>,
    /// Slowdown of co-running GPU work for pairs `corun` does not list.
    pub default_corun: f64,
    /// Fitted curve per kind; kinds not listed use the datasheet defaults.
    pub kinds: BTreeMap<WorkKind, KindCurve>,
    /// Fitted slowdown of `kind` while `other` runs beside it.
    #[serde(default)]
    pub corun: Vec<CorunEntry>,
    /// Measurements of one task running alone.
    #[serde(default)]
    pub points: Vec<Point>,
    /// Measurements of two tasks co-running on disjoint SM partitions.
    #[serde(default)]
    pub corun_points: Vec<CorunPoint>,
    /// Measurements of one task while work of another kind ran beside it the whole time.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub beside_points: Vec<BesidePoint>,
    /// How the fit treated the per-step latency (a refit or merge keeps the rule).
    #[serde(default, skip_serializing_if = "LatencyFit::is_shared")]
    pub latency: LatencyFit,
}

/// Host <-> device copies of a run, per direction: what a profile's measured host rates come
/// from (`rollplex-run --profile`: the plan's `Offload` and `Reload` tasks). A direction's rate
/// is its bytes over its seconds; [`Profile::merge`] adds the sums, so several runs combine
/// weighted by the bytes each moved.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostCopies {
    /// Host -> device (reloads).
    #[serde(default, skip_serializing_if = "CopySum::is_empty")]
    pub to_device: CopySum,
    /// Device -> host (offloads).
    #[serde(default, skip_serializing_if = "CopySum::is_empty")]
    pub to_host: CopySum,
}

/// Copies of one direction: how many copy tasks were measured, the host bytes they move (one
/// run of each) and the sum of their times (each task's median run), seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CopySum {
    pub transfers: u32,
    pub bytes: f64,
    pub seconds: f64,
}

impl CopySum {
    pub fn is_empty(&self) -> bool {
        self.transfers == 0
    }

    /// The measured rate, bytes/s (`None` without copies).
    pub fn rate(&self) -> Option<f64> {
        (self.transfers > 0 && self.bytes > 0.0 && self.seconds > 0.0)
            .then(|| self.bytes / self.seconds)
    }

    /// One more copy task of `bytes` whose median run took `seconds`.
    pub fn add(&mut self, bytes: f64, seconds: f64) {
        self.transfers += 1;
        self.bytes += bytes;
        self.seconds += seconds;
    }

    /// Both sums together.
    pub fn plus(&self, o: &CopySum) -> CopySum {
        CopySum {
            transfers: self.transfers + o.transfers,
            bytes: self.bytes + o.bytes,
            seconds: self.seconds + o.seconds,
        }
    }

    /// `GB/s from N copies (G GB in S ms)`, or `none measured`.
    fn describe(&self, what: &str) -> String {
        match self.rate() {
            Some(r) => format!(
                "{:.2} GB/s from {} {what} ({:.3} GB in {:.3} ms)",
                r / 1e9,
                self.transfers,
                self.bytes / 1e9,
                self.seconds * 1e3
            ),
            None => "none measured".to_string(),
        }
    }
}

impl HostCopies {
    pub fn is_empty(&self) -> bool {
        self.to_device.is_empty() && self.to_host.is_empty()
    }

    /// Both runs' copies together.
    pub fn plus(&self, o: &HostCopies) -> HostCopies {
        HostCopies {
            to_device: self.to_device.plus(&o.to_device),
            to_host: self.to_host.plus(&o.to_host),
        }
    }

    /// One line for a file's header: each direction's rate and what it came from.
    pub fn describe(&self) -> String {
        format!(
            "host -> device {}; device -> host {}",
            self.to_device.describe("reloads"),
            self.to_host.describe("offloads")
        )
    }
}

/// How [`Profile::fit_all`] fits each kind's per-step latency (`step_overhead_s`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LatencyFit {
    /// One value, measured where it shows (the kind that spends the largest share of its time
    /// in it), for every kind it does not contradict: the bench's rule, whose two model widths
    /// cannot tell a lower GEMM rate from a fixed cost per layer (`crate::fit`'s module doc).
    #[default]
    Shared,
    /// Each kind its own: a runtime's profile of one model, where each kind's fixed costs per
    /// layer pass (launches, host work inside the task) are its own and task sizes of several
    /// runs (with and without prefix dedup) tell them from the rate.
    PerKind,
}

impl LatencyFit {
    pub fn is_shared(&self) -> bool {
        *self == LatencyFit::Shared
    }
}

/// `kind` runs `slowdown` times slower while `other` runs beside it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorunEntry {
    pub kind: WorkKind,
    pub other: WorkKind,
    pub slowdown: f64,
}

/// One measurement: `work` of `kind` alone on `sms` SMs took `seconds`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Point {
    pub kind: WorkKind,
    pub sms: u32,
    pub work: Work,
    pub seconds: f64,
    /// Provenance (file and field), free text.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
}

/// One co-run measurement: `a` and `b` started together on disjoint partitions and both were
/// done after `seconds`. Each side also carries its time alone on its partition.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorunPoint {
    pub a: Point,
    pub b: Point,
    pub seconds: f64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
}

/// One side of a co-run whose other side was not timed alone: `work` of `kind` on `sms` SMs
/// took `seconds` while work of kind `beside` ran on (some of) the other SMs the whole time.
/// It is a point of the model's time alone times its slowdown beside `beside`
/// ([`crate::CostModel::corun_slowdown`]): the fit turns it into that ordered slowdown, never
/// into a curve. `rollplex-run --profile` of an overlap plan measures them: a decode window's
/// steps while side tasks run, and the side tasks themselves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BesidePoint {
    pub kind: WorkKind,
    pub sms: u32,
    pub work: Work,
    pub seconds: f64,
    pub beside: WorkKind,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
}

impl BesidePoint {
    /// The measurement as a point (kind, SMs, work, seconds), for the checks points share.
    pub fn as_point(&self) -> Point {
        Point {
            kind: self.kind,
            sms: self.sms,
            work: self.work.clone(),
            seconds: self.seconds,
            note: self.note.clone(),
        }
    }
}

/// Whether `x` is a positive number (false for NaN).
fn positive(x: f64) -> bool {
    x > 0.0
}

impl Profile {
    /// Parses and validates a profile.
    pub fn from_yaml(text: &str) -> Result<Self, ProfileError> {
        let p: Profile =
            serde_yaml::from_str(text).map_err(|e| ProfileError::Yaml(e.to_string()))?;
        p.validate()?;
        Ok(p)
    }

    /// The YAML form (deterministic: kinds in declaration order, lists as stored).
    pub fn to_yaml(&self) -> String {
        // Serialising plain data with string keys cannot fail.
        serde_yaml::to_string(self).unwrap_or_else(|e| format!("# cannot serialise: {e}\n"))
    }

    /// The slowdown of `kind` beside `other`, if the profile lists it.
    pub fn corun_of(&self, kind: WorkKind, other: WorkKind) -> Option<f64> {
        self.corun
            .iter()
            .find(|e| e.kind == kind && e.other == other)
            .map(|e| e.slowdown)
    }

    /// Sets the measured host copies and the rates they give: `host_bw` from the copies to
    /// the device, `host_bw_to_host` from those to the host; a direction without copies keeps
    /// the profile's figure (set by hand, or none).
    pub fn set_host_copies(&mut self, copies: HostCopies) {
        if let Some(r) = copies.to_device.rate() {
            self.host_bw = Some(r);
        }
        if let Some(r) = copies.to_host.rate() {
            self.host_bw_to_host = Some(r);
        }
        self.host_copies = copies;
    }

    /// Checks the invariants listed in the module doc.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let bad = |m: String| Err(ProfileError::Invalid(m));
        let gpu = &self.gpu;
        if gpu.sms == 0 || !positive(gpu.hbm_bw) || !positive(gpu.bf16_flops) {
            return bad(format!(
                "gpu {}: sms, hbm_bw and bf16_flops must be positive (got {}, {}, {})",
                gpu.name, gpu.sms, gpu.hbm_bw, gpu.bf16_flops
            ));
        }
        for (kind, c) in &self.kinds {
            c.validate(kind_name(*kind), gpu.hbm_bw, gpu.sms)
                .map_err(ProfileError::Invalid)?;
        }
        let slow_ok = |s: f64| s.is_finite() && (1.0..=10.0).contains(&s);
        if !slow_ok(self.default_corun) {
            return bad(format!(
                "default_corun = {} must be in [1, 10]",
                self.default_corun
            ));
        }
        for e in &self.corun {
            if !slow_ok(e.slowdown) {
                return bad(format!(
                    "corun {} beside {}: slowdown {} must be in [1, 10]",
                    kind_name(e.kind),
                    kind_name(e.other),
                    e.slowdown
                ));
            }
        }
        for bw in [self.host_bw, self.host_bw_to_host, self.net_bw]
            .into_iter()
            .flatten()
        {
            if !(positive(bw) && bw.is_finite()) {
                return bad(format!(
                    "host_bw/host_bw_to_host/net_bw = {bw} must be positive"
                ));
            }
        }
        for (what, sum, field, rate) in [
            (
                "to_device",
                &self.host_copies.to_device,
                "host_bw",
                self.host_bw,
            ),
            (
                "to_host",
                &self.host_copies.to_host,
                "host_bw_to_host",
                self.host_bw_to_host,
            ),
        ] {
            if sum.is_empty() {
                if sum.bytes != 0.0 || sum.seconds != 0.0 {
                    return bad(format!(
                        "host_copies.{what}: bytes and seconds of no transfers must be 0"
                    ));
                }
                continue;
            }
            let Some(measured) = sum.rate().filter(|r| r.is_finite()) else {
                return bad(format!(
                    "host_copies.{what}: {} transfers need positive, finite bytes and seconds (got {}, {})",
                    sum.transfers, sum.bytes, sum.seconds
                ));
            };
            // the rate the file states is the one its copies give (edit one, drop the other)
            if !rate.is_some_and(|r| (r / measured - 1.0).abs() <= 1e-9) {
                let stated = rate.map_or("null".to_string(), |r| r.to_string());
                return bad(format!(
                    "{field} = {stated}, but host_copies.{what} measured {measured} bytes/s \
                     ({} bytes in {} s): a measured rate is its copies' (to set one by hand, \
                     remove host_copies.{what})",
                    sum.bytes, sum.seconds
                ));
            }
        }
        let check_point = |p: &Point, what: &str| -> Result<(), ProfileError> {
            if p.sms == 0 || p.sms > gpu.sms {
                return bad(format!(
                    "{what} ({}): sms = {} must be in 1..={}",
                    kind_name(p.kind),
                    p.sms,
                    gpu.sms
                ));
            }
            if !(positive(p.seconds) && p.seconds.is_finite()) {
                return bad(format!(
                    "{what} ({}): seconds = {} must be positive",
                    kind_name(p.kind),
                    p.seconds
                ));
            }
            let w = &p.work;
            for v in w.amounts() {
                if !(v >= 0.0 && v.is_finite()) {
                    return bad(format!(
                        "{what} ({}): work amounts must be >= 0",
                        kind_name(p.kind)
                    ));
                }
            }
            Ok(())
        };
        for (i, p) in self.points.iter().enumerate() {
            check_point(p, &format!("point {i}"))?;
        }
        for (i, c) in self.corun_points.iter().enumerate() {
            check_point(&c.a, &format!("corun point {i} side a"))?;
            check_point(&c.b, &format!("corun point {i} side b"))?;
            if c.a.sms + c.b.sms > gpu.sms {
                return bad(format!(
                    "corun point {i}: partitions {} + {} exceed the GPU's {} SMs",
                    c.a.sms, c.b.sms, gpu.sms
                ));
            }
            if !(positive(c.seconds) && c.seconds.is_finite()) {
                return bad(format!("corun point {i}: seconds must be positive"));
            }
        }
        for (i, b) in self.beside_points.iter().enumerate() {
            let what = format!("beside point {i}");
            check_point(&b.as_point(), &what)?;
            if b.sms >= gpu.sms {
                return bad(format!(
                    "{what} ({} beside {}): sms = {} leaves none of the GPU's {} SMs for the work beside it",
                    kind_name(b.kind),
                    kind_name(b.beside),
                    b.sms,
                    gpu.sms
                ));
            }
        }
        Ok(())
    }
}
