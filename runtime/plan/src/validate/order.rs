//! The ordering rules over the task graph: `deps` (every dependency points backwards, so the
//! graph is acyclic), `weights` (the weight-version rule between actor ops, decode windows and
//! optimizer steps) and `deadlock` (no decode window waits on a task that waits for decode);
//! and [`HappensBefore`], the closure the later rules query.

use super::Checker;
use crate::ids::{GpuId, TaskId};
use crate::plan::{GpuRole, Op, Plan};

/// Reflexive-transitive closure of deps and stream order, as one bitset of ancestors per task.
pub struct HappensBefore {
    words: usize,
    anc: Vec<u64>,
}

impl HappensBefore {
    /// Requires that every dep points backwards (checked by the `deps` rule).
    pub fn new(plan: &Plan) -> Self {
        let n = plan.tasks.len();
        let words = n.div_ceil(64).max(1);
        let mut anc = vec![0u64; n * words];
        let mut last_on_stream: Vec<Option<usize>> = vec![None; plan.streams.len()];
        for (i, t) in plan.tasks.iter().enumerate() {
            let mut preds: Vec<usize> = t
                .deps
                .iter()
                .map(|d| d.index())
                .filter(|&d| d < i)
                .collect();
            if let Some(slot) = last_on_stream.get_mut(t.stream.index()) {
                if let Some(p) = *slot {
                    preds.push(p);
                }
                *slot = Some(i);
            }
            for p in preds {
                let (lo, hi) = anc.split_at_mut(i * words);
                let src = &lo[p * words..(p + 1) * words];
                let dst = &mut hi[..words];
                for (d, s) in dst.iter_mut().zip(src) {
                    *d |= *s;
                }
                dst[p / 64] |= 1 << (p % 64);
            }
        }
        HappensBefore { words, anc }
    }

    /// Whether `a` happens before `b` (or `a == b`).
    pub fn before_or_same(&self, a: TaskId, b: TaskId) -> bool {
        a == b || self.strictly_before(a, b)
    }

    /// Whether `a` finishes before `b` starts.
    pub fn strictly_before(&self, a: TaskId, b: TaskId) -> bool {
        let (a, b) = (a.index(), b.index());
        match self.anc.get(b * self.words + a / 64) {
            Some(w) => w & (1 << (a % 64)) != 0,
            None => false,
        }
    }
}

impl Checker<'_> {
    pub(super) fn deps(&mut self) {
        for (i, t) in self.plan.tasks.iter().enumerate() {
            for d in &t.deps {
                if d.index() >= i {
                    self.err(
                        "deps",
                        format!(
                            "{} `{}` depends on {d}, which is not earlier in the task list",
                            t.id, t.name
                        ),
                    );
                }
            }
        }
    }

    pub(super) fn weights(&mut self, hb: &HappensBefore) {
        let p = self.plan;
        for g in 0..p.gpus.len() {
            let gpu = GpuId::from_index(g);
            let colocated = p.gpus[g].role == GpuRole::Colocated;
            let on_gpu: Vec<&crate::plan::Task> = p.tasks.iter().filter(|t| t.gpu == gpu).collect();
            let steps: Vec<(u32, TaskId)> = on_gpu
                .iter()
                .filter_map(|t| match t.op {
                    Op::OptimizerStep { step } => Some((step, t.id)),
                    _ => None,
                })
                .collect();
            for w in steps.windows(2) {
                if w[1].0 != w[0].0 + 1 || !hb.strictly_before(w[0].1, w[1].1) {
                    self.err(
                        "weights",
                        format!(
                            "optimizer steps {} ({}) and {} ({}) are out of order",
                            w[0].0, w[0].1, w[1].0, w[1].1
                        ),
                    );
                }
            }
            let step_task = |s: u32| steps.iter().find(|(k, _)| *k == s).map(|(_, t)| *t);
            for t in &on_gpu {
                if let Some(v) = t.op.actor_weight_version() {
                    if t.window.is_some() && v != 0 {
                        self.err("weights", format!("{} `{}` uses actor weights v{v} inside a decode window; only v0 work (old log-probs, the first step) may run there", t.id, t.name));
                    }
                    if v > 0 {
                        match step_task(v - 1) {
                            Some(s) if hb.strictly_before(s, t.id) => {}
                            Some(s) => self.err("weights", format!("{} `{}` uses weights v{v} but does not wait for optimizer step {} ({s})", t.id, t.name, v - 1)),
                            None => self.err("weights", format!("{} `{}` uses weights v{v} but optimizer step {} does not exist", t.id, t.name, v - 1)),
                        }
                    }
                    for &(s, st) in &steps {
                        if s >= v && !hb.strictly_before(t.id, st) {
                            self.err("weights", format!("optimizer step {s} ({st}) may overwrite the weights v{v} that {} `{}` reads", t.id, t.name));
                        }
                    }
                }
                if colocated && matches!(t.op, Op::DecodeWindow { .. }) {
                    for &(s, st) in &steps {
                        if !hb.strictly_before(t.id, st) {
                            self.err("weights", format!("optimizer step {s} ({st}) may run while decode {} `{}` still reads the weights", t.id, t.name));
                        }
                    }
                }
            }
        }
    }

    pub(super) fn deadlock(&mut self, hb: &HappensBefore) {
        let p = self.plan;
        let waiting: Vec<TaskId> = p
            .tasks
            .iter()
            .filter(|t| waits_for_groups(&t.op))
            .map(|t| t.id)
            .collect();
        for d in p
            .tasks
            .iter()
            .filter(|t| matches!(t.op, Op::DecodeWindow { .. }))
        {
            for &w in &waiting {
                if p.tasks[w.index()].gpu == d.gpu && hb.strictly_before(w, d.id) {
                    self.err("deadlock", format!("decode {} `{}` waits for {w} `{}`, which waits for decode to finish groups", d.id, d.name, p.tasks[w.index()].name));
                }
            }
        }
    }
}

/// Ops that wait until decode has finished particular groups (they name slots).
pub fn waits_for_groups(op: &Op) -> bool {
    matches!(
        op,
        Op::RefSuffix { .. }
            | Op::ActorSuffix { .. }
            | Op::Reward { .. }
            | Op::Advantages { .. }
            | Op::TrainMicroBatch { .. }
            | Op::ActorPrefix {
                groups: crate::ids::Groups::Slots(_),
                ..
            }
    )
}
