//! The host-side record of one iteration, kept the same way by every backend that trains
//! (`cpu`, `cuda`): sampled tokens and their rollout log-probs, which samples stopped, the
//! completion slots (groups in (finish step, group) order), reference and old log-probs,
//! rewards (with DAPO's overlong shaping), advantages (GRPO, Dr. GRPO, REINFORCE++ baseline),
//! dynamic sampling's pick of the trained groups, the training inputs of a micro-batch (with
//! the truncated importance-sampling weight) and its normaliser, and the agreement between the
//! sampler's log-probs and the trainer's.
//!
//! The backends differ in where the model runs; everything decided on the host (when a sample
//! stops, which group a slot names, rewards, advantages, the loss normaliser) is decided here,
//! once, so both backends give each plan op the same meaning.
//!
//! Invariant: every value recorded here is a function of the sampled tokens and the plan's
//! spec, never of the order in which the walker ran tasks: slots are bound in (finish step,
//! group) order within a decode window, and a window's steps run in step order.

use rollplex_plan::plan::{OldLogProbSource, Plan};
use rollplex_plan::spec::{pick_trained_groups, AdvantageEstimator, JobSpec};
use rollplex_plan::{Groups, Span};

use super::cpu::RewardFn;
use super::rewards::GroupKey;
use super::{Agreement, ExecError, IterationMetrics, IterationResult, PromptData};
use crate::model::SamplingParams;
use crate::train::backward::{MicroBatchOutput, ResponseBatch};
use crate::train::loss::{grpo_advantages, reinforce_baseline_advantages, tis_weight, Normaliser};

/// One response's training inputs, owned (borrowed views: [`TrainInputs::batch`]).
#[derive(Clone, Debug)]
pub struct TrainInputs {
    pub sample: usize,
    /// `None`: the plan has no old-log-prob pass, the training forward's own log-probs are the
    /// old ones ([`ResponseBatch::old_logp`]).
    pub old_logp: Option<Vec<f32>>,
    pub advantages: Vec<f32>,
    pub ref_logp: Option<Vec<f32>>,
    pub mask: Vec<bool>,
}

impl TrainInputs {
    /// The response as the trainers take it.
    pub fn batch<'a>(&'a self, tokens: &'a [u32]) -> ResponseBatch<'a> {
        ResponseBatch {
            tokens,
            old_logp: self.old_logp.as_deref(),
            ref_logp: self.ref_logp.as_deref(),
            advantages: &self.advantages,
            mask: &self.mask,
        }
    }
}

/// What a `TrainMicroBatch` op trains: its groups in slot order, their inputs and the
/// normaliser of its mini-batch.
pub struct MicroBatchInputs {
    pub groups: Vec<usize>,
    /// Per group, per member.
    pub inputs: Vec<Vec<TrainInputs>>,
    pub norm: Normaliser,
}

/// The host-side state of one iteration (see the module docs).
pub struct Book<'a, 'r> {
    pub spec: &'a JobSpec,
    pub iteration: u32,
    pub group_size: usize,
    pub prompts: &'a [PromptData],
    pub sampling: SamplingParams,
    /// The job's reward: told when a group has finished decoding (it may start scoring it on
    /// host threads then), asked at the group's `Reward` op.
    reward: &'a mut RewardFn<'r>,
    stop_ids: Vec<u32>,
    /// Per-sample stop length when the job forces lengths (benchmarks with random weights).
    forced_len: Option<Vec<u32>>,
    pub tokens: Vec<Vec<u32>>,
    pub rollout_logp: Vec<Vec<f32>>,
    pub stopped: Vec<bool>,
    /// Step at which each group's last sample stopped.
    group_done: Vec<Option<u32>>,
    /// Slot -> group, in binding order.
    slot_groups: Vec<u32>,
    /// Groups that finished in the running decode window: (finish step, group).
    newly_done: Vec<(u32, u32)>,
    pub ref_logp: Vec<Option<Vec<f32>>>,
    /// Per sample: the old-log-prob pass's log-probs or, without one, the training forward's
    /// (recorded once its micro-batch ran).
    pub old_logp: Vec<Option<Vec<f32>>>,
    /// Where the loss's old log-probs come from (the plan's decision).
    old_source: OldLogProbSource,
    rewards: Vec<Option<f32>>,
    advantages: Vec<Option<f32>>,
    /// Groups each training replica trains (all of them unless dynamic sampling).
    trained: usize,
    /// Dynamic sampling: training slot -> group, once every reward is in.
    picked: Option<Vec<usize>>,
    /// Per sample: the sampler's log-probs against the old-log-prob pass or, without one, the
    /// training forward (summed in sample order at the end).
    agreement: Vec<Option<Agreement>>,
    pub metrics: IterationMetrics,
}

impl<'a, 'r> Book<'a, 'r> {
    /// An empty record for `prompts` (one per group) of iteration `iteration` of `plan`, scored
    /// by `reward`.
    pub fn new(
        plan: &'a Plan,
        iteration: u32,
        prompts: &'a [PromptData],
        reward: &'a mut RewardFn<'r>,
    ) -> Result<Self, ExecError> {
        let spec = &plan.spec;
        let g = spec.rollout.group_size as usize;
        let groups = prompts.len();
        if groups as u32 != plan.parallel.prompts_per_rollout_replica {
            return Err(ExecError::Data(format!(
                "{} prompts given for an iteration of {} groups",
                groups, plan.parallel.prompts_per_rollout_replica
            )));
        }
        let samples = groups * g;
        let mut stop_ids = spec.actor.tokens.eos_token_ids.clone();
        stop_ids.extend(&spec.rollout.sampling.stop_token_ids);
        let forced_len = spec.rollout.sampling.forced_lengths.then(|| {
            (0..samples as u32)
                .map(|s| super::forced_length(spec, iteration, s))
                .collect()
        });
        Ok(Book {
            spec,
            iteration,
            group_size: g,
            prompts,
            sampling: SamplingParams::from_spec(&spec.rollout.sampling),
            reward,
            stop_ids,
            forced_len,
            tokens: vec![Vec::new(); samples],
            rollout_logp: vec![Vec::new(); samples],
            stopped: vec![false; samples],
            group_done: vec![None; groups],
            slot_groups: Vec::new(),
            newly_done: Vec::new(),
            ref_logp: vec![None; samples],
            old_logp: vec![None; samples],
            old_source: plan.old_logprobs,
            rewards: vec![None; samples],
            advantages: vec![None; samples],
            trained: plan.parallel.trained_groups_per_train_replica as usize,
            picked: None,
            agreement: vec![None; samples],
            metrics: IterationMetrics::default(),
        })
    }

    pub fn samples(&self) -> usize {
        self.tokens.len()
    }

    pub fn groups(&self) -> usize {
        self.prompts.len()
    }

    /// The temperature log-probs are taken at (1 for greedy sampling).
    pub fn temperature(&self) -> f32 {
        if self.sampling.temperature > 0.0 {
            self.sampling.temperature
        } else {
            1.0
        }
    }

    /// Whether vision tower and merger are frozen (their output is then shared by the rollout,
    /// the reference and the actor).
    pub fn frozen_tower(&self) -> bool {
        self.spec.train.freeze_vision && self.spec.train.freeze_merger
    }

    /// Completion slots bound so far.
    pub fn slots_bound(&self) -> u32 {
        self.slot_groups.len() as u32
    }

    pub fn group_of_slot(&self, slot: u32) -> Result<usize, ExecError> {
        self.slot_groups
            .get(slot as usize)
            .map(|&g| g as usize)
            .ok_or_else(|| {
                ExecError::Plan(format!(
                    "slot {slot} used before its group finished decoding"
                ))
            })
    }

    /// Whether more groups are rolled out than trained (dynamic sampling).
    pub fn dynamic_sampling(&self) -> bool {
        self.trained < self.groups()
    }

    /// The group training slot `k` names: completion slot `k`, or under dynamic sampling the
    /// `k`-th picked group (see `rollplex_plan::plan`'s indexing conventions).
    pub fn group_of_train_slot(&self, k: u32) -> Result<usize, ExecError> {
        if !self.dynamic_sampling() {
            return self.group_of_slot(k);
        }
        let picked = self.picked.as_ref().ok_or_else(|| {
            ExecError::Plan(format!(
                "training slot {k} used before every group's reward was in (dynamic sampling \
                 picks the trained groups then)"
            ))
        })?;
        picked.get(k as usize).copied().ok_or_else(|| {
            ExecError::Plan(format!(
                "training slot {k} of {} trained groups",
                picked.len()
            ))
        })
    }

    /// The groups of an `ActorPrefix` op: prompts, or training slots.
    pub fn groups_of(&self, groups: &Groups) -> Result<Vec<usize>, ExecError> {
        match groups {
            Groups::Prompts(s) => Ok(range(*s).collect()),
            Groups::Slots(s) => range(*s)
                .map(|k| self.group_of_train_slot(k as u32))
                .collect(),
        }
    }

    /// Samples `g * G .. (g + 1) * G` of group `g`.
    pub fn members(&self, g: usize) -> std::ops::Range<usize> {
        g * self.group_size..(g + 1) * self.group_size
    }

    /// Whether any sample is still decoding.
    pub fn any_active(&self) -> bool {
        self.stopped.iter().any(|s| !s)
    }

    /// Checks that sample `s` is at decode step `step` (a window out of order is a plan bug).
    pub fn check_step(&self, s: usize, step: u32) -> Result<(), ExecError> {
        if self.tokens[s].len() as u32 != step {
            return Err(ExecError::Plan(format!(
                "decode step {step} out of order for sample {s}"
            )));
        }
        Ok(())
    }

    /// The stop rule: the token ids that stop a sample, and each sample's forced length when
    /// lengths are forced (then tokens stop nothing). A backend that decides stops on the device
    /// applies exactly this rule ([`Book::push_token`] checks it again).
    pub fn stop_rule(&self) -> (&[u32], Option<&[u32]>) {
        (&self.stop_ids, self.forced_len.as_deref())
    }

    fn stop_at(&self, s: usize, tok: u32, len: u32) -> bool {
        if let Some(f) = &self.forced_len {
            return len >= f[s];
        }
        self.stop_ids.contains(&tok) || len >= self.spec.rollout.max_new_tokens
    }

    /// Records token `tok` (log-prob `lp`) drawn at `step` for sample `s`; returns whether the
    /// sample continues (is fed to the next decode step). A group whose last sample stops here
    /// is queued for binding at the end of the window ([`Book::end_window`]), and its reward
    /// is started ([`GroupReward::start`](super::rewards::GroupReward::start)): its responses
    /// are final from here on.
    pub fn push_token(&mut self, s: usize, tok: u32, lp: f32, step: u32) -> bool {
        self.tokens[s].push(tok);
        self.rollout_logp[s].push(lp);
        if self.stop_at(s, tok, step + 1) {
            self.stopped[s] = true;
            let g = s / self.group_size;
            if self.members(g).all(|m| self.stopped[m]) {
                self.group_done[g] = Some(step);
                self.newly_done.push((step, g as u32));
                let responses = views(&self.tokens[self.members(g)]);
                self.reward
                    .start(self.group_key(g), &self.prompts[g], &responses);
            }
            false
        } else {
            true
        }
    }

    /// Notes that decode step `step` ran (for the metrics).
    pub fn step_done(&mut self, step: u32) {
        self.metrics.decode_steps = self.metrics.decode_steps.max(step + 1);
    }

    /// Binds the groups that finished in the window to slots, in (finish step, group) order.
    pub fn end_window(&mut self) {
        let mut done = std::mem::take(&mut self.newly_done);
        done.sort();
        self.slot_groups.extend(done.into_iter().map(|(_, g)| g));
    }

    pub fn responses(&self, g: usize) -> Vec<&[u32]> {
        views(&self.tokens[self.members(g)])
    }

    /// Stores group `g`'s reference log-probs (one per member, in order).
    pub fn set_ref_logp(&mut self, g: usize, lps: Vec<Vec<f32>>) {
        for (m, lp) in lps.into_iter().enumerate() {
            self.ref_logp[g * self.group_size + m] = Some(lp);
        }
    }

    /// Stores group `g`'s old log-probs (one per member, in order) and their agreement with
    /// the sampler's.
    pub fn set_old_logp(&mut self, g: usize, lps: Vec<Vec<f32>>) {
        for (m, lp) in lps.into_iter().enumerate() {
            let s = g * self.group_size + m;
            self.agreement[s] = Some(Agreement::of(&self.rollout_logp[s], &lp));
            self.old_logp[s] = Some(lp);
        }
    }

    /// Group `g` of this iteration, as the reward knows it.
    fn group_key(&self, g: usize) -> GroupKey {
        GroupKey {
            iteration: self.iteration,
            group: g as u32,
        }
    }

    /// The `Reward` op: scores the group in `slot` (joins the scoring its end of decode
    /// started, or scores it now).
    pub fn reward(&mut self, slot: u32) -> Result<(), ExecError> {
        let g = self.group_of_slot(slot)?;
        let key = self.group_key(g);
        let responses = views(&self.tokens[self.members(g)]);
        let rewards = self.reward.score(key, &self.prompts[g], &responses)?;
        if rewards.len() != self.group_size || rewards.iter().any(|r| !r.is_finite()) {
            return Err(ExecError::Reward(format!(
                "expected {} finite rewards for group {g}, got {rewards:?}",
                self.group_size
            )));
        }
        let overlong = self.spec.train.algorithm.loss().overlong;
        let max_len = self.spec.rollout.max_new_tokens;
        for (m, r) in rewards.into_iter().enumerate() {
            let s = g * self.group_size + m;
            let shaped = match overlong {
                Some(o) => (r as f64 + o.shaping(self.tokens[s].len() as u32, max_len)) as f32,
                None => r,
            };
            self.rewards[s] = Some(shaped);
        }
        Ok(())
    }

    /// Whether a group's advantages depend on other groups' rewards (REINFORCE++'s batch
    /// whitening, dynamic sampling's pick): the plan then runs every `Advantages` op after
    /// every `Reward` op, and the first one computes them all.
    fn batch_level(&self) -> bool {
        self.dynamic_sampling()
            || self.spec.train.algorithm.loss().advantage == AdvantageEstimator::ReinforceBaseline
    }

    /// The rewards of samples `samples`, each required.
    fn rewards_of(&self, samples: impl Iterator<Item = usize>) -> Result<Vec<f32>, ExecError> {
        samples
            .map(|s| {
                self.rewards[s].ok_or_else(|| {
                    ExecError::Plan(format!("advantage of sample {s} before its reward"))
                })
            })
            .collect()
    }

    /// Every group's advantages at once, and dynamic sampling's pick (see [`Book::batch_level`]).
    fn batch_advantages(&mut self) -> Result<(), ExecError> {
        let loss = self.spec.train.algorithm.loss();
        let rewards = self.rewards_of(0..self.samples())?;
        let trained: Vec<usize> = if self.dynamic_sampling() {
            let per_group: Vec<Vec<f32>> = rewards
                .chunks(self.group_size)
                .map(<[f32]>::to_vec)
                .collect();
            let varied = per_group
                .iter()
                .filter(|r| r.iter().any(|&x| x != r[0]))
                .count();
            let picked = pick_trained_groups(&per_group, self.trained);
            self.metrics.groups_with_variance = Some(varied as u32);
            self.picked = Some(picked.clone());
            picked
        } else {
            (0..self.groups()).collect()
        };
        let adv = match loss.advantage {
            AdvantageEstimator::Group => {
                grpo_advantages(&rewards, self.group_size, loss.norm_adv_by_std)?
            }
            AdvantageEstimator::ReinforceBaseline => {
                let lens: Vec<usize> = self.tokens.iter().map(Vec::len).collect();
                let whiten: Vec<usize> = trained.iter().flat_map(|&g| self.members(g)).collect();
                reinforce_baseline_advantages(&rewards, self.group_size, &lens, &whiten)?
            }
        };
        for (s, a) in adv.into_iter().enumerate() {
            self.advantages[s] = Some(a);
        }
        Ok(())
    }

    /// The `Advantages` op: the advantages of the group in `slot` (of every group, the first
    /// time, when they depend on the whole batch).
    pub fn advantages(&mut self, slot: u32) -> Result<(), ExecError> {
        let g = self.group_of_slot(slot)?;
        if self.batch_level() {
            if self.advantages[g * self.group_size].is_none() {
                self.batch_advantages()?;
            }
            return Ok(());
        }
        let rewards = self.rewards_of(self.members(g))?;
        let norm_std = self.spec.train.algorithm.loss().norm_adv_by_std;
        let adv = grpo_advantages(&rewards, self.group_size, norm_std)?;
        for (s, a) in self.members(g).zip(adv) {
            self.advantages[s] = Some(a);
        }
        Ok(())
    }

    /// What the `TrainMicroBatch` op (`step`, `micro_batch`, `samples`) trains. `backend` names
    /// the backend in errors.
    pub fn micro_batch(
        &self,
        backend: &str,
        step: u32,
        micro_batch: u32,
        samples: Span,
    ) -> Result<MicroBatchInputs, ExecError> {
        if step != self.metrics.optimizer_steps {
            return Err(ExecError::Plan(format!(
                "micro-batch {micro_batch} of optimizer step {step} runs after {} optimizer steps of this iteration",
                self.metrics.optimizer_steps
            )));
        }
        let g = self.group_size as u32;
        if !samples.start.is_multiple_of(g) || !samples.len().is_multiple_of(g) {
            return Err(ExecError::Unsupported(format!(
                "the {backend} backend trains whole GRPO groups per micro-batch; micro-batch {micro_batch} covers samples {}..{} with groups of {g} (set micro_batch to a multiple of the group size)",
                samples.start, samples.end
            )));
        }
        let mini = self.spec.train.mini_batch;
        let mb_start = samples.start / mini * mini;
        let norm = self.mini_batch_normaliser(Span::new(mb_start, mb_start + mini))?;
        let groups: Vec<usize> = (samples.start / g..samples.end / g)
            .map(|k| self.group_of_train_slot(k))
            .collect::<Result<_, _>>()?;
        let tis_cap = self.spec.train.algorithm.loss().tis_cap;
        let mut inputs = Vec::with_capacity(groups.len());
        for &grp in &groups {
            let mut rs = Vec::with_capacity(self.group_size);
            for s in self.members(grp) {
                let n = self.tokens[s].len();
                let adv = self.advantages[s].ok_or_else(|| {
                    ExecError::Plan(format!("sample {s} trained before its advantage"))
                })?;
                // With an old-log-prob pass its log-probs are the ratio's denominator; without
                // one the training forward's own are (the loss takes them, detached).
                let old_logp = match self.old_source {
                    OldLogProbSource::Pass => Some(self.old_logp[s].clone().ok_or_else(|| {
                        ExecError::Plan(format!(
                            "sample {s} trained before its old log-probs were scored"
                        ))
                    })?),
                    OldLogProbSource::TrainForward => None,
                };
                // Truncated importance sampling weighs each token's policy-gradient term by
                // min(pi_old / pi_sampler, cap): a positive constant, applied to the advantage.
                // It needs the old log-probs before the loss: the plan has the pass then.
                let advantages = match (tis_cap, &old_logp) {
                    (Some(cap), Some(old)) => old
                        .iter()
                        .zip(&self.rollout_logp[s])
                        .map(|(&o, &r)| (adv as f64 * tis_weight(o, r, cap)) as f32)
                        .collect(),
                    (Some(_), None) => {
                        return Err(ExecError::Plan(
                            "truncated importance sampling (`tis_cap`) needs the old-log-prob \
                             pass, which the plan leaves out: recompile the plan"
                                .into(),
                        ))
                    }
                    (None, _) => vec![adv; n],
                };
                rs.push(TrainInputs {
                    sample: s,
                    old_logp,
                    advantages,
                    ref_logp: self.ref_logp[s].clone(),
                    mask: vec![true; n],
                });
            }
            inputs.push(rs);
        }
        Ok(MicroBatchInputs {
            groups,
            inputs,
            norm,
        })
    }

    /// Records what a `TrainMicroBatch` op of optimizer step `step` produced: its loss metrics
    /// and, in an iteration without an old-log-prob pass (one step), the training forward's
    /// log-probs as the old ones and their agreement with the sampler's.
    pub fn micro_batch_done(&mut self, step: u32, mb: &MicroBatchInputs, out: &MicroBatchOutput) {
        self.metrics.loss.add(&out.metrics);
        self.metrics.micro_batches += 1;
        if step != 0 || self.old_source != OldLogProbSource::TrainForward {
            return;
        }
        let samples = mb.inputs.iter().flatten().map(|r| r.sample);
        for (s, lp) in samples.zip(&out.logp) {
            self.agreement[s] = Some(Agreement::of(&self.rollout_logp[s], lp));
            self.old_logp[s] = Some(lp.clone());
        }
    }

    /// Response views of a micro-batch's inputs, per group.
    pub fn batches<'b>(&'b self, mb: &'b MicroBatchInputs) -> Vec<Vec<ResponseBatch<'b>>> {
        mb.inputs
            .iter()
            .map(|rs| rs.iter().map(|r| r.batch(&self.tokens[r.sample])).collect())
            .collect()
    }

    fn mini_batch_normaliser(&self, samples: Span) -> Result<Normaliser, ExecError> {
        let g = self.group_size as u32;
        let mut tokens = 0usize;
        for k in samples.start / g..samples.end / g {
            let grp = self.group_of_train_slot(k)?;
            for s in self.members(grp) {
                tokens += self.tokens[s].len();
            }
        }
        Ok(Normaliser {
            tokens,
            seqs: samples.len() as usize,
        })
    }

    /// Results of the iteration, for metrics, tests and the bitwise invariant.
    pub fn finish(mut self) -> IterationResult {
        self.metrics.groups_trained = self.trained as u32;
        self.metrics.rollout_agreement = self
            .agreement
            .iter()
            .flatten()
            .fold(None, |acc: Option<Agreement>, a| {
                Some(acc.map_or(*a, |x| x.merge(a)))
            });
        IterationResult {
            tokens: self.tokens,
            rollout_logp: self.rollout_logp,
            ref_logp: self.ref_logp,
            old_logp: self.old_logp,
            rewards: self.rewards.iter().map(|r| r.unwrap_or(f32::NAN)).collect(),
            advantages: self
                .advantages
                .iter()
                .map(|a| a.unwrap_or(f32::NAN))
                .collect(),
            trained_groups: match &self.picked {
                Some(p) => p.iter().map(|&g| g as u32).collect(),
                None => self
                    .slot_groups
                    .iter()
                    .take(self.trained)
                    .copied()
                    .collect(),
            },
            slot_groups: self.slot_groups,
            group_size: self.group_size as u32,
            metrics: self.metrics,
        }
    }
}

/// Slices of `tokens`, one per response (borrows only the tokens, so the book's reward can be
/// called with them).
fn views(tokens: &[Vec<u32>]) -> Vec<&[u32]> {
    tokens.iter().map(Vec::as_slice).collect()
}

pub fn range(s: Span) -> std::ops::Range<usize> {
    s.start as usize..s.end as usize
}
