//! The rules on what an iteration's ops cover: `ranges` (groups, slots and samples inside the
//! replica's counts), `old_logprobs` (the old log-probs come from where the plan says),
//! `train_prefix` (so do the kept prompt forwards) and `activations` (the kept activation
//! layers agree with `recompute`).

use super::{Checker, HappensBefore};
use crate::ids::{GpuId, Groups, TaskId};
use crate::plan::{BufferRole, GpuRole, OldLogProbSource, Op, Purpose, TrainPrefixSource};
use crate::spec::OldLogProbPass;
use std::collections::BTreeMap;

impl Checker<'_> {
    pub(super) fn ranges(&mut self) {
        let p = self.plan;
        let par = &p.parallel;
        let g = par.group_size;
        if par.trained_groups_per_train_replica == 0
            || par.trained_groups_per_train_replica > par.prompts_per_train_replica
        {
            self.err(
                "ranges",
                format!(
                    "a training replica trains {} of its {} groups (at least 1, at most all)",
                    par.trained_groups_per_train_replica, par.prompts_per_train_replica
                ),
            );
        }
        for t in &p.tasks {
            let role = p.gpus[t.gpu.index()].role;
            let rollout_side = matches!(t.op, Op::EncodeMedia { .. } | Op::Prefill { .. });
            let groups = if rollout_side || role == GpuRole::Rollout {
                par.prompts_per_rollout_replica
            } else {
                par.prompts_per_train_replica
            };
            let trained = par.trained_groups_per_train_replica;
            let bad = match &t.op {
                Op::EncodeMedia { groups: s, copies }
                | Op::Prefill { groups: s, copies }
                | Op::RefPrefix { groups: s, copies } => {
                    s.is_empty() || s.end > groups || (*copies != 1 && *copies != g)
                }
                Op::ActorPrefix {
                    groups: gs, copies, ..
                } => {
                    let s = gs.span();
                    // training slots count only the trained groups
                    let n = match gs {
                        Groups::Slots(_) if !rollout_side && role != GpuRole::Rollout => trained,
                        _ => groups,
                    };
                    s.is_empty() || s.end > n || (*copies != 1 && *copies != g)
                }
                Op::RefSuffix { slot }
                | Op::ActorSuffix { slot, .. }
                | Op::Reward { slot }
                | Op::Advantages { slot } => *slot >= groups,
                Op::TrainMicroBatch {
                    samples,
                    prefix_bwd_slots,
                    ..
                } => {
                    samples.is_empty()
                        || samples.end as u64 > trained as u64 * g as u64
                        || prefix_bwd_slots.end > trained
                }
                _ => false,
            };
            if bad {
                self.err(
                    "ranges",
                    format!(
                        "{} `{}`: {:?} is outside the replica's {groups} groups of {g}",
                        t.id, t.name, t.op
                    ),
                );
            }
        }
    }

    pub(super) fn activations(&mut self) {
        let p = self.plan;
        let layers = p.spec.actor.text.num_layers;
        let recompute = p.spec.train.recompute;
        for (field, kept) in [
            ("kept_act_layers", p.kept_act_layers),
            ("kept_prompt_layers", p.kept_prompt_layers),
        ] {
            if kept > layers {
                self.err(
                    "activations",
                    format!("{field} {kept} is more than the actor's {layers} text layers"),
                );
            }
            if let Some(fixed) = recompute.kept_layers(layers) {
                if kept != fixed {
                    let name = if fixed == 0 { "full" } else { "none" };
                    self.err(
                        "activations",
                        format!("{field} {kept}, but `recompute = {name}` keeps {fixed} of {layers} layers"),
                    );
                }
            }
        }
    }

    pub(super) fn train_prefix(&mut self, hb: &HappensBefore) {
        let p = self.plan;
        if p.train_prefix != TrainPrefixSource::Rollout {
            return;
        }
        let reason = "the plan keeps the rollout's prompt forwards for training";
        let colocated = p.gpus.iter().all(|g| g.role == GpuRole::Colocated);
        // one step: a task of a later step is reported below, by name
        let why_not = TrainPrefixSource::why_not_rollout(&p.spec, colocated, &p.parallel, 1);
        for w in why_not {
            self.err("train_prefix", format!("{w}, yet {reason}"));
        }
        let prefills: Vec<_> = p
            .tasks
            .iter()
            .filter(|f| matches!(f.op, Op::Prefill { .. }))
            .collect();
        for t in &p.tasks {
            match t.op {
                Op::ActorPrefix {
                    purpose: Purpose::Train { .. },
                    ..
                } => self.err(
                    "train_prefix",
                    format!("{} `{}` is a training prompt forward, yet {reason}", t.id, t.name),
                ),
                Op::TrainMicroBatch { step, .. } | Op::OptimizerStep { step } if step != 0 => {
                    self.err(
                        "train_prefix",
                        format!(
                            "{} `{}` trains at optimizer step {step}, after the rollout's weights moved, yet {reason}",
                            t.id, t.name
                        ),
                    )
                }
                Op::TrainMicroBatch { .. } => {
                    let early = prefills
                        .iter()
                        .find(|f| f.gpu == t.gpu && !hb.strictly_before(f.id, t.id));
                    if let Some(f) = early {
                        self.err(
                            "train_prefix",
                            format!(
                                "{} `{}` does not happen after the prefill {} `{}` that keeps its prompt forwards",
                                t.id, t.name, f.id, f.name
                            ),
                        );
                    }
                }
                _ => {}
            }
        }
    }

    pub(super) fn old_logprobs(&mut self, hb: &HappensBefore) {
        let p = self.plan;
        let is_old = |op: &Op| {
            matches!(
                op,
                Op::ActorPrefix {
                    purpose: Purpose::OldLogProb,
                    ..
                } | Op::ActorSuffix {
                    purpose: Purpose::OldLogProb,
                    ..
                }
            )
        };
        match p.old_logprobs {
            OldLogProbSource::TrainForward => {
                let reason = "the plan takes the old log-probs from the training forward";
                for t in p.tasks.iter().filter(|t| is_old(&t.op)) {
                    self.err(
                        "old_logprobs",
                        format!(
                            "{} `{}` is an old-log-prob pass, but {reason}",
                            t.id, t.name
                        ),
                    );
                }
                for b in &p.buffers {
                    if matches!(b.role, BufferRole::OldLogProbs | BufferRole::OldPrefixKv) {
                        self.err(
                            "old_logprobs",
                            format!(
                                "{} `{}` holds old-log-prob state, but {reason}",
                                b.id, b.name
                            ),
                        );
                    }
                }
                for t in &p.tasks {
                    if let Op::TrainMicroBatch { step, .. } | Op::OptimizerStep { step } = t.op {
                        if step != 0 {
                            self.err(
                                "old_logprobs",
                                format!(
                                    "{} `{}` trains at optimizer step {step}: after the first step the weights are no longer the rollout's, yet {reason}",
                                    t.id, t.name
                                ),
                            );
                        }
                    }
                }
                let train = &p.spec.train;
                if train.algorithm.loss().tis_cap.is_some() {
                    self.err(
                        "old_logprobs",
                        format!("truncated importance sampling (`tis_cap`) weighs tokens by the old log-probs before the loss, yet {reason}"),
                    );
                }
                if train.old_logprobs == OldLogProbPass::Recompute {
                    self.err(
                        "old_logprobs",
                        format!("the job asks for the old-log-prob pass (`old_logprobs = recompute`), yet {reason}"),
                    );
                }
            }
            OldLogProbSource::Pass => {
                let par = &p.parallel;
                let (g, scored) = (par.group_size.max(1), par.prompts_per_train_replica);
                let dynamic = par.trained_groups_per_train_replica < scored;
                let mut suffixes: BTreeMap<(GpuId, u32), Vec<TaskId>> = BTreeMap::new();
                for o in &p.tasks {
                    if let Op::ActorSuffix {
                        slot,
                        purpose: Purpose::OldLogProb,
                    } = o.op
                    {
                        suffixes.entry((o.gpu, slot)).or_default().push(o.id);
                    }
                }
                for t in &p.tasks {
                    let Op::TrainMicroBatch { samples, .. } = t.op else {
                        continue;
                    };
                    // the completion slots whose old log-probs the micro-batch reads (under
                    // dynamic sampling its training slots may be any of them)
                    let (first, end) = if dynamic {
                        (0, scored)
                    } else {
                        (samples.start / g, samples.end.div_ceil(g).min(scored))
                    };
                    // a slot is scored when one of its suffixes on this program happens before;
                    // counted over the suffixes that exist, so a broken plan's huge ranges
                    // cost nothing
                    let done: Vec<u32> = suffixes
                        .range((t.gpu, first)..(t.gpu, end.max(first)))
                        .filter(|(_, os)| os.iter().any(|&o| hb.strictly_before(o, t.id)))
                        .map(|(&(_, k), _)| k)
                        .collect();
                    let wanted = end.saturating_sub(first);
                    if done.len() as u64 != u64::from(wanted) {
                        let missing = (first..end)
                            .find(|k| done.binary_search(k).is_err())
                            .unwrap_or(first);
                        self.err(
                            "old_logprobs",
                            format!(
                                "{} `{}` trains on the old log-probs of slots {first}..{end}, but {} of them (slot {missing} first) have no old-log-prob suffix before it",
                                t.id,
                                t.name,
                                wanted as usize - done.len()
                            ),
                        );
                    }
                }
            }
        }
    }
}
