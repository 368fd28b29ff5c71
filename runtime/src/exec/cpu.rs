//! The CPU backend: executes each plan op with the CPU model engine (f32), one task at a time,
//! in the order the [`walker`](super::walker) picks.
//!
//! What each op does here (the plan's `Op` docs say what it means):
//! - `EncodeMedia`: vision tower + merger over the groups' media with the actor's weights (the
//!   rollout's); a frozen tower's output is reused by the reference and the actor.
//! - `Prefill`: the groups' prompt prefill with the actor's weights; the prefix KV is copied
//!   once per group into the iteration's KV arena `[group prefixes | sample suffixes]`.
//! - `DecodeWindow`: steps of every unfinished sample; token `s` of a sample is drawn with the
//!   Philox key (seed, iteration, sample, s), so it does not depend on the window split. Groups
//!   that finished in the window are bound to completion slots in (finish step, group) order.
//! - `RefPrefix` / `RefSuffix`: the reference model's prefix state per group, then per-token
//!   log-probs of the slot's responses.
//! - `ActorPrefix{OldLogProb}` / `ActorSuffix`: the same with the actor's rollout weights.
//!   `ActorPrefix{Train}`: on this backend the micro-batch's forward recomputes its prefix (the
//!   forward is deterministic, so the numbers are those of a kept prefix); the task is counted.
//! - `Reward`, `Advantages`: per slot. `TrainMicroBatch`: forward + loss + backward of whole
//!   groups in slot order, accumulated in micro-batch order; `OptimizerStep`: AdamW.
//! - `WeightSync`: rollout reads the trainer's weights in place (one layout, TP 1): nothing
//!   to copy. `Reshard`, `Offload`, `Reload`: no data moves in a single address space.
//!
//! Invariant: every number this engine produces is a function of (plan spec, seed, iteration,
//! data), never of the order the walker ran tasks in; `tests/tests/serial_overlap.rs` checks
//! serial and overlap plans bitwise.

use rollplex_kernels::cpu::logprobs_fwd;
use rollplex_plan::plan::{Op, Plan, Purpose, Task};
use rollplex_plan::spec::JobSpec;
use rollplex_plan::{Groups, Span};

use super::walker::TaskRunner;
use super::{ExecError, IterationMetrics, PromptData};
use crate::model::{
    sample_token, DecodeSlot, EncodedMedia, KvArena, KvSpan, MediaInput, PrefixState, Prompt,
    Qwen25VL, SampleKey, SamplingParams,
};
use crate::train::backward::{GroupBatch, ResponseBatch, TrainConfig};
use crate::train::loss::{grpo_advantages, Normaliser};
use crate::train::step::Trainer;

/// Scores responses: the reward function the loop was given.
/// Scores the responses of one group (one reward per response, in order).
pub type RewardFn<'a> = dyn FnMut(&PromptData, &[&[u32]]) -> Result<Vec<f32>, ExecError> + 'a;

/// The models and optimizer that live across iterations.
pub struct CpuModels {
    pub trainer: Trainer,
    /// The frozen reference (initial actor weights); `None` when the job scores no reference.
    pub reference: Option<Qwen25VL>,
}

/// One iteration's state on the CPU backend.
pub struct CpuIteration<'a, 'r> {
    spec: &'a JobSpec,
    models: &'a mut CpuModels,
    reward: &'a mut RewardFn<'r>,
    iteration: u32,
    group_size: usize,
    prompts: &'a [PromptData],
    sampling: SamplingParams,
    stop_ids: Vec<u32>,
    /// Per-sample stop length when the job forces lengths (benchmarks with random weights).
    forced_len: Option<Vec<u32>>,
    encoded: Vec<Option<Vec<EncodedMedia>>>,
    ref_encoded: Vec<Option<Vec<EncodedMedia>>>,
    prefixes: Vec<Option<PrefixState>>,
    ref_prefixes: Vec<Option<PrefixState>>,
    old_prefixes: Vec<Option<PrefixState>>,
    arena: KvArena,
    prefix_spans: Vec<Option<KvSpan>>,
    slots: Vec<DecodeSlot>,
    next_logits: Vec<Vec<f32>>,
    tokens: Vec<Vec<u32>>,
    rollout_logp: Vec<Vec<f32>>,
    stopped: Vec<bool>,
    /// Step at which each group's last sample stopped.
    group_done: Vec<Option<u32>>,
    /// Slot -> group, in binding order.
    slot_groups: Vec<u32>,
    ref_logp: Vec<Option<Vec<f32>>>,
    old_logp: Vec<Option<Vec<f32>>>,
    rewards: Vec<Option<f32>>,
    advantages: Vec<Option<f32>>,
    /// Normaliser of the mini-batch being accumulated (set by its first micro-batch).
    pub metrics: IterationMetrics,
}

impl<'a, 'r> CpuIteration<'a, 'r> {
    pub fn new(
        plan: &'a Plan,
        models: &'a mut CpuModels,
        reward: &'a mut RewardFn<'r>,
        iteration: u32,
        prompts: &'a [PromptData],
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
        let max_new = spec.rollout.max_new_tokens;
        let prefix_rows: u64 = prompts.iter().map(|p| p.ids.len() as u64).sum();
        let cap = prefix_rows + samples as u64 * max_new as u64;
        let cap =
            u32::try_from(cap).map_err(|_| ExecError::Data("KV arena over 2^32 rows".into()))?;
        let arena = KvArena::for_model(models.trainer.model(), cap);
        let mut stop_ids = spec.actor.tokens.eos_token_ids.clone();
        stop_ids.extend(&spec.rollout.sampling.stop_token_ids);
        let forced_len = spec.rollout.sampling.forced_lengths.then(|| {
            (0..samples as u32)
                .map(|s| super::forced_length(spec, iteration, s))
                .collect()
        });
        Ok(CpuIteration {
            spec,
            models,
            reward,
            iteration,
            group_size: g,
            prompts,
            sampling: SamplingParams::from_spec(&spec.rollout.sampling),
            stop_ids,
            forced_len,
            encoded: vec![None; groups],
            ref_encoded: vec![None; groups],
            prefixes: vec![None; groups],
            ref_prefixes: vec![None; groups],
            old_prefixes: vec![None; groups],
            arena,
            prefix_spans: vec![None; groups],
            slots: Vec::new(),
            next_logits: vec![Vec::new(); samples],
            tokens: vec![Vec::new(); samples],
            rollout_logp: vec![Vec::new(); samples],
            stopped: vec![false; samples],
            group_done: vec![None; groups],
            slot_groups: Vec::new(),
            ref_logp: vec![None; samples],
            old_logp: vec![None; samples],
            rewards: vec![None; groups * g],
            advantages: vec![None; groups * g],
            metrics: IterationMetrics::default(),
        })
    }

    fn temperature(&self) -> f32 {
        if self.sampling.temperature > 0.0 {
            self.sampling.temperature
        } else {
            1.0
        }
    }

    fn frozen_tower(&self) -> bool {
        self.spec.train.freeze_vision && self.spec.train.freeze_merger
    }

    fn group_of_slot(&self, slot: u32) -> Result<usize, ExecError> {
        self.slot_groups
            .get(slot as usize)
            .map(|&g| g as usize)
            .ok_or_else(|| {
                ExecError::Plan(format!(
                    "slot {slot} used before its group finished decoding"
                ))
            })
    }

    fn groups_of(&self, groups: &Groups) -> Result<Vec<usize>, ExecError> {
        match groups {
            Groups::Prompts(s) => Ok(range(*s).collect()),
            Groups::Slots(s) => range(*s).map(|k| self.group_of_slot(k as u32)).collect(),
        }
    }

    fn media_inputs(p: &PromptData) -> Vec<MediaInput<'_>> {
        p.media
            .iter()
            .map(|m| MediaInput {
                kind: m.kind,
                pixels: &m.pixels,
                grid: m.grid,
            })
            .collect()
    }

    fn encode(
        model: &Qwen25VL,
        p: &PromptData,
        copies: u32,
    ) -> Result<Vec<EncodedMedia>, ExecError> {
        let inputs = Self::media_inputs(p);
        let mut out = model.encode_media(&inputs, None)?;
        // Without prefix dedup every sample encodes its own copy (the ablation's cost); the
        // copies are identical by determinism, so one is kept.
        for _ in 1..copies {
            out = model.encode_media(&inputs, None)?;
        }
        Ok(out)
    }

    fn prefill_one(
        model: &Qwen25VL,
        p: &PromptData,
        media: &[EncodedMedia],
        copies: u32,
    ) -> Result<PrefixState, ExecError> {
        let refs: Vec<&EncodedMedia> = media.iter().collect();
        let prompt = Prompt {
            ids: &p.ids,
            media: &refs,
        };
        let mut state = model.prefill(&[prompt], None)?;
        for _ in 1..copies {
            state = model.prefill(&[prompt], None)?;
        }
        state
            .pop()
            .ok_or_else(|| ExecError::Plan("prefill returned no state".into()))
    }

    fn actor_media(&mut self, g: usize, copies: u32) -> Result<Vec<EncodedMedia>, ExecError> {
        match &self.encoded[g] {
            Some(m) => Ok(m.clone()),
            None => Self::encode(self.models.trainer.model(), &self.prompts[g], copies),
        }
    }

    fn ref_media(&mut self, g: usize, copies: u32) -> Result<Vec<EncodedMedia>, ExecError> {
        if self.frozen_tower() {
            if let Some(m) = &self.encoded[g] {
                return Ok(m.clone());
            }
        }
        if let Some(m) = &self.ref_encoded[g] {
            return Ok(m.clone());
        }
        let reference = self.models.reference.as_ref().ok_or_else(|| {
            ExecError::Plan("the plan scores a reference, but the job has none".into())
        })?;
        let m = Self::encode(reference, &self.prompts[g], copies)?;
        self.ref_encoded[g] = Some(m.clone());
        Ok(m)
    }

    fn run_prefill(&mut self, groups: Span, copies: u32) -> Result<(), ExecError> {
        for g in range(groups) {
            let media = self.actor_media(g, copies)?;
            let state = Self::prefill_one(
                self.models.trainer.model(),
                &self.prompts[g],
                &media,
                copies,
            )?;
            self.prefixes[g] = Some(state);
        }
        // Lay out the arena once every group's prefix is known: prefixes first (in group
        // order), then each sample's suffix of max_new_tokens rows.
        if self.prefixes.iter().all(Option::is_some) && self.slots.is_empty() {
            let mut off = 0u32;
            for g in 0..self.prefixes.len() {
                let p = self.prefixes[g].as_ref().expect("checked above");
                self.prefix_spans[g] = Some(self.arena.store_prefix(off, p)?);
                off += p.len;
            }
            let max_new = self.spec.rollout.max_new_tokens;
            for s in 0..self.tokens.len() {
                let g = s / self.group_size;
                let p = self.prefixes[g].as_ref().expect("checked above");
                self.slots.push(DecodeSlot::new(
                    self.prefix_spans[g].expect("stored"),
                    p.rope_delta,
                    off,
                    max_new,
                ));
                self.next_logits[s] = p.last_logits.clone();
                off += max_new;
            }
        }
        Ok(())
    }

    fn stop_at(&self, s: usize, tok: u32, len: u32) -> bool {
        if let Some(f) = &self.forced_len {
            return len >= f[s];
        }
        self.stop_ids.contains(&tok) || len >= self.spec.rollout.max_new_tokens
    }

    fn run_decode(
        &mut self,
        first_step: u32,
        steps: u32,
        until_done: bool,
    ) -> Result<(), ExecError> {
        if self.slots.is_empty() {
            return Err(ExecError::Plan(
                "decode before every group's prefill".into(),
            ));
        }
        let v = self.spec.actor.text.vocab_size as usize;
        let temp = self.temperature();
        let mut step = first_step;
        let mut newly_done: Vec<(u32, u32)> = Vec::new();
        while (until_done || step < first_step + steps) && self.stopped.iter().any(|s| !s) {
            let mut feed_slots = Vec::new();
            let mut feed_tokens = Vec::new();
            let mut feed_samples = Vec::new();
            for s in 0..self.tokens.len() {
                if self.stopped[s] {
                    continue;
                }
                if self.tokens[s].len() as u32 != step {
                    return Err(ExecError::Plan(format!(
                        "decode step {step} out of order for sample {s}"
                    )));
                }
                let key = SampleKey {
                    seed: self.spec.seed,
                    iteration: self.iteration,
                    sample: s as u32,
                    step,
                };
                let row = &self.next_logits[s];
                let tok = sample_token(row, &self.sampling, key)?;
                let mut lp = [0f32];
                logprobs_fwd(&mut lp, None, None, row, &[tok], 1, v, temp)?;
                self.tokens[s].push(tok);
                self.rollout_logp[s].push(lp[0]);
                if self.stop_at(s, tok, step + 1) {
                    self.stopped[s] = true;
                    let g = s / self.group_size;
                    let members = g * self.group_size..(g + 1) * self.group_size;
                    if members.clone().all(|m| self.stopped[m]) {
                        self.group_done[g] = Some(step);
                        newly_done.push((step, g as u32));
                    }
                } else {
                    feed_slots.push(self.slots[s]);
                    feed_tokens.push(tok);
                    feed_samples.push(s);
                }
            }
            if !feed_samples.is_empty() {
                let mut logits = vec![0f32; feed_samples.len() * v];
                self.models.trainer.model().decode_step(
                    &mut self.arena,
                    &mut feed_slots,
                    &feed_tokens,
                    &mut logits,
                )?;
                for (i, &s) in feed_samples.iter().enumerate() {
                    self.slots[s] = feed_slots[i];
                    self.next_logits[s] = logits[i * v..(i + 1) * v].to_vec();
                }
            }
            step += 1;
            self.metrics.decode_steps = self.metrics.decode_steps.max(step);
        }
        newly_done.sort();
        self.slot_groups
            .extend(newly_done.into_iter().map(|(_, g)| g));
        Ok(())
    }

    fn responses(&self, g: usize) -> Vec<&[u32]> {
        (g * self.group_size..(g + 1) * self.group_size)
            .map(|s| self.tokens[s].as_slice())
            .collect()
    }

    fn score_into(
        model: &Qwen25VL,
        prefix: &PrefixState,
        responses: &[&[u32]],
        temp: f32,
    ) -> Result<Vec<Vec<f32>>, ExecError> {
        Ok(model
            .score(prefix, responses, temp, None)?
            .into_iter()
            .map(|s| s.logp)
            .collect())
    }

    fn run_train_micro_batch(
        &mut self,
        step: u32,
        micro_batch: u32,
        samples: Span,
    ) -> Result<(), ExecError> {
        if step != self.metrics.optimizer_steps {
            return Err(ExecError::Plan(format!(
                "micro-batch {micro_batch} of optimizer step {step} runs after {} optimizer steps of this iteration",
                self.metrics.optimizer_steps
            )));
        }
        let g = self.group_size as u32;
        if !samples.start.is_multiple_of(g) || !samples.len().is_multiple_of(g) {
            return Err(ExecError::Unsupported(format!(
                "the CPU backend trains whole GRPO groups per micro-batch; micro-batch {micro_batch} covers samples {}..{} with groups of {g} (set micro_batch to a multiple of the group size)",
                samples.start, samples.end
            )));
        }
        let mini = self.spec.train.mini_batch;
        let mb_start = samples.start / mini * mini;
        let norm = self.mini_batch_normaliser(Span::new(mb_start, mb_start + mini))?;
        let slots: Vec<u32> = (samples.start / g..samples.end / g).collect();
        let groups: Vec<usize> = slots
            .iter()
            .map(|&k| self.group_of_slot(k))
            .collect::<Result<_, _>>()?;
        // owned per-response inputs, then borrowed views
        let mut owned: Vec<Vec<(Vec<f32>, Vec<f32>, Option<Vec<f32>>, Vec<bool>)>> = Vec::new();
        for &grp in &groups {
            let mut rs = Vec::new();
            for s in grp * self.group_size..(grp + 1) * self.group_size {
                let n = self.tokens[s].len();
                let adv = self.advantages[s].ok_or_else(|| {
                    ExecError::Plan(format!("sample {s} trained before its advantage"))
                })?;
                let old = self.old_logp[s]
                    .clone()
                    .unwrap_or_else(|| self.rollout_logp[s].clone());
                rs.push((old, vec![adv; n], self.ref_logp[s].clone(), vec![true; n]));
            }
            owned.push(rs);
        }
        let media: Vec<Vec<MediaInput<'_>>> = groups
            .iter()
            .map(|&grp| Self::media_inputs(&self.prompts[grp]))
            .collect();
        let responses: Vec<Vec<ResponseBatch<'_>>> = groups
            .iter()
            .zip(&owned)
            .map(|(&grp, rs)| {
                rs.iter()
                    .enumerate()
                    .map(|(m, (old, adv, rf, mask))| ResponseBatch {
                        tokens: &self.tokens[grp * self.group_size + m],
                        old_logp: old,
                        ref_logp: rf.as_deref(),
                        advantages: adv,
                        mask,
                    })
                    .collect()
            })
            .collect();
        let batch: Vec<GroupBatch<'_>> = groups
            .iter()
            .enumerate()
            .map(|(i, &grp)| GroupBatch {
                prompt_ids: &self.prompts[grp].ids,
                media: &media[i],
                responses: &responses[i],
            })
            .collect();
        let out = self.models.trainer.micro_batch(micro_batch, &batch, norm)?;
        self.metrics.loss.add(&out.metrics);
        self.metrics.micro_batches += 1;
        Ok(())
    }

    fn mini_batch_normaliser(&self, samples: Span) -> Result<Normaliser, ExecError> {
        let g = self.group_size as u32;
        let mut tokens = 0usize;
        for k in samples.start / g..samples.end / g {
            let grp = self.group_of_slot(k)?;
            for s in grp * self.group_size..(grp + 1) * self.group_size {
                tokens += self.tokens[s].len();
            }
        }
        Ok(Normaliser {
            tokens,
            seqs: samples.len() as usize,
        })
    }

    /// Results of the iteration, for metrics, tests and the bitwise invariant.
    pub fn finish(self) -> super::IterationResult {
        let g = self.group_size;
        super::IterationResult {
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
            slot_groups: self.slot_groups,
            group_size: g as u32,
            metrics: self.metrics,
        }
    }
}

fn range(s: Span) -> std::ops::Range<usize> {
    s.start as usize..s.end as usize
}

impl TaskRunner for CpuIteration<'_, '_> {
    type Error = ExecError;

    fn slots_bound(&self) -> u32 {
        self.slot_groups.len() as u32
    }

    fn run(&mut self, task: &Task) -> Result<(), ExecError> {
        let temp = self.temperature();
        match &task.op {
            Op::EncodeMedia { groups, copies } => {
                for g in range(*groups) {
                    self.encoded[g] = Some(Self::encode(
                        self.models.trainer.model(),
                        &self.prompts[g],
                        *copies,
                    )?);
                }
            }
            Op::Prefill { groups, copies } => self.run_prefill(*groups, *copies)?,
            Op::DecodeWindow {
                first_step,
                steps,
                until_done,
            } => self.run_decode(*first_step, *steps, *until_done)?,
            Op::RefPrefix { groups, copies } => {
                for g in range(*groups) {
                    let media = self.ref_media(g, *copies)?;
                    let reference = self.models.reference.as_ref().ok_or_else(|| {
                        ExecError::Plan("the plan scores a reference, but the job has none".into())
                    })?;
                    self.ref_prefixes[g] = Some(Self::prefill_one(
                        reference,
                        &self.prompts[g],
                        &media,
                        *copies,
                    )?);
                }
            }
            Op::RefSuffix { slot } => {
                let g = self.group_of_slot(*slot)?;
                let prefix = self.ref_prefixes[g].as_ref().ok_or_else(|| {
                    ExecError::Plan(format!("ref suffix of group {g} before its prefix"))
                })?;
                let reference = self
                    .models
                    .reference
                    .as_ref()
                    .ok_or_else(|| ExecError::Plan("no reference model".into()))?;
                let lps = Self::score_into(reference, prefix, &self.responses(g), temp)?;
                for (m, lp) in lps.into_iter().enumerate() {
                    self.ref_logp[g * self.group_size + m] = Some(lp);
                }
            }
            Op::ActorPrefix {
                groups,
                copies,
                purpose,
            } => match purpose {
                Purpose::OldLogProb => {
                    for g in self.groups_of(groups)? {
                        let media = self.actor_media(g, *copies)?;
                        self.old_prefixes[g] = Some(Self::prefill_one(
                            self.models.trainer.model(),
                            &self.prompts[g],
                            &media,
                            *copies,
                        )?);
                    }
                }
                Purpose::Train { .. } => self.metrics.train_prefix_tasks += 1,
            },
            Op::ActorSuffix { slot, purpose } => {
                if *purpose != Purpose::OldLogProb {
                    return Err(ExecError::Unsupported(
                        "actor suffix forward for training outside a micro-batch".into(),
                    ));
                }
                let g = self.group_of_slot(*slot)?;
                let prefix = self.old_prefixes[g].as_ref().ok_or_else(|| {
                    ExecError::Plan(format!(
                        "old-log-prob suffix of group {g} before its prefix"
                    ))
                })?;
                let lps = Self::score_into(
                    self.models.trainer.model(),
                    prefix,
                    &self.responses(g),
                    temp,
                )?;
                for (m, lp) in lps.into_iter().enumerate() {
                    self.old_logp[g * self.group_size + m] = Some(lp);
                }
            }
            Op::Reward { slot } => {
                let g = self.group_of_slot(*slot)?;
                let members = g * self.group_size..(g + 1) * self.group_size;
                let responses: Vec<&[u32]> =
                    self.tokens[members].iter().map(Vec::as_slice).collect();
                let rewards = (self.reward)(&self.prompts[g], &responses)?;
                if rewards.len() != self.group_size || rewards.iter().any(|r| !r.is_finite()) {
                    return Err(ExecError::Reward(format!(
                        "expected {} finite rewards for group {g}, got {rewards:?}",
                        self.group_size
                    )));
                }
                for (m, r) in rewards.into_iter().enumerate() {
                    self.rewards[g * self.group_size + m] = Some(r);
                }
            }
            Op::Advantages { slot } => {
                let g = self.group_of_slot(*slot)?;
                let members = g * self.group_size..(g + 1) * self.group_size;
                let rewards: Vec<f32> = members
                    .clone()
                    .map(|s| {
                        self.rewards[s].ok_or_else(|| {
                            ExecError::Plan(format!("advantage of sample {s} before its reward"))
                        })
                    })
                    .collect::<Result<_, _>>()?;
                let norm_std = self.spec.train.algorithm.loss().norm_adv_by_std;
                let adv = grpo_advantages(&rewards, self.group_size, norm_std)?;
                for (s, a) in members.zip(adv) {
                    self.advantages[s] = Some(a);
                }
            }
            Op::TrainMicroBatch {
                step,
                micro_batch,
                samples,
                ..
            } => self.run_train_micro_batch(*step, *micro_batch, *samples)?,
            Op::OptimizerStep { .. } => {
                let report = self.models.trainer.optimizer_step()?;
                self.metrics.grad_norm = report.step.grad_norm;
                self.metrics.optimizer_steps += 1;
            }
            Op::WeightSync { .. } | Op::Reshard { .. } | Op::Offload { .. } | Op::Reload { .. } => {
            }
        }
        self.metrics.tasks += 1;
        Ok(())
    }
}

/// Builds the training config the trainer runs with.
pub fn train_config(spec: &JobSpec) -> Result<TrainConfig, ExecError> {
    let t = spec.rollout.sampling.temperature as f32;
    Ok(TrainConfig::from_spec(
        &spec.train,
        if t > 0.0 { t } else { 1.0 },
        None,
    )?)
}
