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
use rollplex_plan::Span;

use super::book::{range, Book};
use super::walker::TaskRunner;
use super::{ExecError, IterationMetrics, PromptData};
use crate::model::{
    sample_token, DecodeSlot, EncodedMedia, KvArena, KvSpan, MediaInput, PrefixState, Prompt,
    Qwen25VL, SampleKey,
};
use crate::train::backward::{GroupBatch, TrainConfig};
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
    models: &'a mut CpuModels,
    reward: &'a mut RewardFn<'r>,
    book: Book<'a>,
    encoded: Vec<Option<Vec<EncodedMedia>>>,
    ref_encoded: Vec<Option<Vec<EncodedMedia>>>,
    prefixes: Vec<Option<PrefixState>>,
    ref_prefixes: Vec<Option<PrefixState>>,
    old_prefixes: Vec<Option<PrefixState>>,
    arena: KvArena,
    prefix_spans: Vec<Option<KvSpan>>,
    slots: Vec<DecodeSlot>,
    next_logits: Vec<Vec<f32>>,
}

impl<'a, 'r> CpuIteration<'a, 'r> {
    pub fn new(
        plan: &'a Plan,
        models: &'a mut CpuModels,
        reward: &'a mut RewardFn<'r>,
        iteration: u32,
        prompts: &'a [PromptData],
    ) -> Result<Self, ExecError> {
        let book = Book::new(plan, iteration, prompts)?;
        let groups = book.groups();
        let samples = book.samples();
        let max_new = plan.spec.rollout.max_new_tokens;
        let prefix_rows: u64 = prompts.iter().map(|p| p.ids.len() as u64).sum();
        let cap = prefix_rows + samples as u64 * max_new as u64;
        let cap =
            u32::try_from(cap).map_err(|_| ExecError::Data("KV arena over 2^32 rows".into()))?;
        let arena = KvArena::for_model(models.trainer.model(), cap);
        Ok(CpuIteration {
            models,
            reward,
            book,
            encoded: vec![None; groups],
            ref_encoded: vec![None; groups],
            prefixes: vec![None; groups],
            ref_prefixes: vec![None; groups],
            old_prefixes: vec![None; groups],
            arena,
            prefix_spans: vec![None; groups],
            slots: Vec::new(),
            next_logits: vec![Vec::new(); samples],
        })
    }

    /// What the iteration measured so far.
    pub fn metrics(&self) -> &IterationMetrics {
        &self.book.metrics
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
            None => Self::encode(self.models.trainer.model(), &self.book.prompts[g], copies),
        }
    }

    fn ref_media(&mut self, g: usize, copies: u32) -> Result<Vec<EncodedMedia>, ExecError> {
        if self.book.frozen_tower() {
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
        let m = Self::encode(reference, &self.book.prompts[g], copies)?;
        self.ref_encoded[g] = Some(m.clone());
        Ok(m)
    }

    fn run_prefill(&mut self, groups: Span, copies: u32) -> Result<(), ExecError> {
        for g in range(groups) {
            let media = self.actor_media(g, copies)?;
            let state = Self::prefill_one(
                self.models.trainer.model(),
                &self.book.prompts[g],
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
            let max_new = self.book.spec.rollout.max_new_tokens;
            for s in 0..self.book.samples() {
                let g = s / self.book.group_size;
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
        let v = self.book.spec.actor.text.vocab_size as usize;
        let temp = self.book.temperature();
        let mut step = first_step;
        while (until_done || step < first_step + steps) && self.book.any_active() {
            let mut feed_slots = Vec::new();
            let mut feed_tokens = Vec::new();
            let mut feed_samples = Vec::new();
            for s in 0..self.book.samples() {
                if self.book.stopped[s] {
                    continue;
                }
                self.book.check_step(s, step)?;
                let key = SampleKey {
                    seed: self.book.spec.seed,
                    iteration: self.book.iteration,
                    sample: s as u32,
                    step,
                };
                let row = &self.next_logits[s];
                let tok = sample_token(row, &self.book.sampling, key)?;
                let mut lp = [0f32];
                logprobs_fwd(&mut lp, None, None, row, &[tok], 1, v, temp)?;
                if self.book.push_token(s, tok, lp[0], step) {
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
            self.book.step_done(step);
            step += 1;
        }
        self.book.end_window();
        Ok(())
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
        let mb = self.book.micro_batch("CPU", step, micro_batch, samples)?;
        let media: Vec<Vec<MediaInput<'_>>> = mb
            .groups
            .iter()
            .map(|&grp| Self::media_inputs(&self.book.prompts[grp]))
            .collect();
        let responses = self.book.batches(&mb);
        let batch: Vec<GroupBatch<'_>> = mb
            .groups
            .iter()
            .enumerate()
            .map(|(i, &grp)| GroupBatch {
                prompt_ids: &self.book.prompts[grp].ids,
                media: &media[i],
                responses: &responses[i],
            })
            .collect();
        let out = self
            .models
            .trainer
            .micro_batch(micro_batch, &batch, mb.norm)?;
        self.book.metrics.loss.add(&out.metrics);
        self.book.metrics.micro_batches += 1;
        Ok(())
    }

    /// Results of the iteration, for metrics, tests and the bitwise invariant.
    pub fn finish(self) -> super::IterationResult {
        self.book.finish()
    }
}

impl TaskRunner for CpuIteration<'_, '_> {
    type Error = ExecError;

    fn slots_bound(&self) -> u32 {
        self.book.slots_bound()
    }

    fn run(&mut self, task: &Task) -> Result<(), ExecError> {
        let temp = self.book.temperature();
        match &task.op {
            Op::EncodeMedia { groups, copies } => {
                for g in range(*groups) {
                    self.encoded[g] = Some(Self::encode(
                        self.models.trainer.model(),
                        &self.book.prompts[g],
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
                        &self.book.prompts[g],
                        &media,
                        *copies,
                    )?);
                }
            }
            Op::RefSuffix { slot } => {
                let g = self.book.group_of_slot(*slot)?;
                let prefix = self.ref_prefixes[g].as_ref().ok_or_else(|| {
                    ExecError::Plan(format!("ref suffix of group {g} before its prefix"))
                })?;
                let reference = self
                    .models
                    .reference
                    .as_ref()
                    .ok_or_else(|| ExecError::Plan("no reference model".into()))?;
                let lps = Self::score_into(reference, prefix, &self.book.responses(g), temp)?;
                self.book.set_ref_logp(g, lps);
            }
            Op::ActorPrefix {
                groups,
                copies,
                purpose,
            } => match purpose {
                Purpose::OldLogProb => {
                    for g in self.book.groups_of(groups)? {
                        let media = self.actor_media(g, *copies)?;
                        self.old_prefixes[g] = Some(Self::prefill_one(
                            self.models.trainer.model(),
                            &self.book.prompts[g],
                            &media,
                            *copies,
                        )?);
                    }
                }
                Purpose::Train { .. } => self.book.metrics.train_prefix_tasks += 1,
            },
            Op::ActorSuffix { slot, purpose } => {
                if *purpose != Purpose::OldLogProb {
                    return Err(ExecError::Unsupported(
                        "actor suffix forward for training outside a micro-batch".into(),
                    ));
                }
                let g = self.book.group_of_slot(*slot)?;
                let prefix = self.old_prefixes[g].as_ref().ok_or_else(|| {
                    ExecError::Plan(format!(
                        "old-log-prob suffix of group {g} before its prefix"
                    ))
                })?;
                let lps = Self::score_into(
                    self.models.trainer.model(),
                    prefix,
                    &self.book.responses(g),
                    temp,
                )?;
                self.book.set_old_logp(g, lps);
            }
            Op::Reward { slot } => self.book.reward(*slot, self.reward)?,
            Op::Advantages { slot } => self.book.advantages(*slot)?,
            Op::TrainMicroBatch {
                step,
                micro_batch,
                samples,
                ..
            } => self.run_train_micro_batch(*step, *micro_batch, *samples)?,
            Op::OptimizerStep { .. } => {
                let report = self.models.trainer.optimizer_step()?;
                self.book.metrics.grad_norm = report.step.grad_norm;
                self.book.metrics.optimizer_steps += 1;
            }
            Op::WeightSync { .. } | Op::Reshard { .. } | Op::Offload { .. } | Op::Reload { .. } => {
            }
        }
        self.book.metrics.tasks += 1;
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
