//! The free bound of overlap from a serial run's measurements: what the iteration would shrink
//! to if every task that may run inside a decode window (uses the rollout's weights and does not
//! need the whole batch) ran there free of charge, capped by the decode time it would hide in.
//! `total / (total - min(movable, decode))`. It counts neither the slowdown decode suffers beside
//! side work nor the SMs it gives up, so measured overlap stays below it; a goal above it is out
//! of reach for this split of the work, whatever the planner does.
//!
//! Input: the profile `rollplex-run --profile` writes for one run of a *serial* plan (every task
//! alone on the whole GPU, one point per task); a profile with co-run measurements (an overlap
//! run, or a merge) is refused.

use std::collections::BTreeMap;

use rollplex_plan::work::WorkKind;

use crate::defaults::kind_name;
use crate::{Profile, ProfileError};

/// Kinds whose tasks the overlap planner may move into decode windows: the reference's and the
/// actor's work over the rollout's weights (prefixes; suffixes, rewards and advantages of groups
/// already done).
pub const MOVABLE: [WorkKind; 6] = [
    WorkKind::RefPrefix,
    WorkKind::RefSuffix,
    WorkKind::ActorPrefixFwd,
    WorkKind::ActorSuffixFwd,
    WorkKind::Reward,
    WorkKind::Advantage,
];

/// A serial run's split of time, seconds (sums of the tasks' measured medians).
#[derive(Clone, Debug, PartialEq)]
pub struct FreeBound {
    pub total: f64,
    pub movable: f64,
    pub decode: f64,
    /// Seconds per kind (every kind with a task).
    pub by_kind: BTreeMap<&'static str, f64>,
}

impl FreeBound {
    /// The speedup if the movable work ran free inside decode.
    pub fn speedup(&self) -> f64 {
        self.total / (self.total - self.movable.min(self.decode))
    }

    /// The share of the bound's headroom that overlap captured, given its measured speedup over
    /// serial (serial time / overlap time): `(1 - 1/measured) / (1 - 1/bound)`, the time overlap
    /// saved over the time the bound saves. 1: all of it; at or below 0: none (overlap no faster
    /// than serial). `None` when the bound leaves no headroom (nothing movable or no decode).
    pub fn captured(&self, measured: f64) -> Option<f64> {
        let headroom = 1.0 - 1.0 / self.speedup();
        (headroom > 0.0 && measured > 0.0).then(|| (1.0 - 1.0 / measured) / headroom)
    }
}

/// [`FreeBound`] of a serial run's profile (see the module doc).
pub fn free_bound(p: &Profile) -> Result<FreeBound, ProfileError> {
    if !p.beside_points.is_empty() || !p.corun_points.is_empty() {
        return Err(ProfileError::Invalid(format!(
            "the profile has co-run measurements ({} beside, {} co-run points): the free bound \
             needs one run of a serial plan, where every task ran alone",
            p.beside_points.len(),
            p.corun_points.len()
        )));
    }
    if p.points.is_empty() {
        return Err(ProfileError::Invalid(
            "the profile has no task measurements".into(),
        ));
    }
    let mut b = FreeBound {
        total: 0.0,
        movable: 0.0,
        decode: 0.0,
        by_kind: BTreeMap::new(),
    };
    for pt in &p.points {
        b.total += pt.seconds;
        *b.by_kind.entry(kind_name(pt.kind)).or_default() += pt.seconds;
        if MOVABLE.contains(&pt.kind) {
            b.movable += pt.seconds;
        }
        if pt.kind == WorkKind::Decode {
            b.decode += pt.seconds;
        }
    }
    Ok(b)
}
