//! One iteration of the plan on one rank of the CPU backend: each plan op with the CPU model
//! engine (f32), one task at a time, in the order the [`walker`](super::super::walker) picks.
//!
//! What each op does here (the plan's `Op` docs say what it means):
//! - `EncodeMedia`: vision tower + merger over the groups' media with the rollout's weights; a
//!   frozen tower's output is reused by the reference and the actor.
//! - `Prefill`: the groups' prompt prefill with the rollout's weights; the prefix KV is copied
//!   once per group into the iteration's KV arena `[group prefixes | sample suffixes]`.
//! - `DecodeWindow`: steps of every unfinished sample; token `s` of a sample is drawn with the
//!   Philox key (seed, iteration, sample, s), so it does not depend on the window split. Groups
//!   that finished in the window are bound to completion slots in (finish step, group) order.
//! - `RefPrefix` / `RefSuffix`: the reference model's prefix state per group, then per-token
//!   log-probs of the slot's responses.
//! - `ActorPrefix{OldLogProb}` / `ActorSuffix`: the same with the actor's weights.
//!   `ActorPrefix{Train}`: on this backend the micro-batch's forward recomputes its prefix (the
//!   forward is deterministic, so the numbers are those of a kept prefix); the task is counted.
//! - `Reward`, `Advantages`: per slot. `TrainMicroBatch`: forward + loss + backward of whole
//!   groups in slot order, accumulated in micro-batch order (in a plan without an
//!   old-log-prob pass the loss takes the forward's own log-probs, detached, as the old ones);
//!   `OptimizerStep`: AdamW with the global grad-norm clip; where the plan streams the
//!   optimizer state (`Plan::optimizer_stream`), the state stays in the optimizer's own buffers
//!   (the host copy) and each chunk is copied into a staging slot, updated there and written
//!   back in the plan's order (bitwise the in-HBM step).
//! - `WeightSync`: colocated, rollout reads the trainer's weights in place: nothing to copy.
//!   Disaggregated (rollout on one GPU program, scoring and training on another), the rollout's
//!   own copy of the actor ([`CpuModels::rollout`](super::CpuModels::rollout)) is replaced by the
//!   trainer's weights: what the training GPUs send the rollout GPUs after each step.
//!   `Reshard`, `Offload`, `Reload`: no data moves in a single address space; the reloads and
//!   offloads are followed ([`HostResidency`]) and a task that reads state the plan has on the
//!   host at that point is refused.
//!
//! The iteration is generic over a [`CpuEngine`] (the model calls an op makes); [`Book`]
//! decides stops, slots, rewards and advantages from replicated data, so every rank decides
//! the same.
//!
//! Invariant: every number this engine produces is a function of (plan spec, seed, iteration,
//! data, TP degree), never of the order the walker ran tasks in; `tests/tests/serial_overlap.rs`
//! checks serial and overlap plans bitwise.

use rollplex_plan::plan::{Op, OptimizerStream, Plan, Purpose, Task};
use rollplex_plan::Span;

use super::super::book::{range, Book};
use super::super::residency::HostResidency;
use super::super::walker::TaskRunner;
use super::super::{ExecError, IterationMetrics, IterationResult, PromptData};
use super::engine::{no_reference, CpuEngine, Role};
use crate::model::{
    DecodeSlot, EncodedMedia, KvArena, KvSpan, MediaInput, PrefixState, Prompt, SampleKey,
};
use crate::train::backward::GroupBatch;

/// Scores the responses of one group (one reward per response, in order): the reward the loop
/// was given ([`GroupReward`](super::super::rewards::GroupReward); a closure is one).
pub type RewardFn<'a> = dyn super::super::rewards::GroupReward + 'a;

/// One iteration's state on one rank of the CPU backend, over engine `E` (a rank's models and
/// its communicator: [`super::RankEngine`]).
pub struct CpuIteration<'a, 'r, E: CpuEngine> {
    models: &'a mut E,
    book: Book<'a, 'r>,
    encoded: Vec<Option<Vec<EncodedMedia>>>,
    ref_encoded: Vec<Option<Vec<EncodedMedia>>>,
    prefixes: Vec<Option<PrefixState>>,
    ref_prefixes: Vec<Option<PrefixState>>,
    old_prefixes: Vec<Option<PrefixState>>,
    arena: KvArena,
    prefix_spans: Vec<Option<KvSpan>>,
    slots: Vec<DecodeSlot>,
    next_logits: Vec<Vec<f32>>,
    /// Where the state the plan keeps on the host between uses is (`exec::residency`).
    residency: HostResidency,
    /// The plan's streamed optimizer step, if it has one.
    stream: Option<OptimizerStream>,
}

impl<'a, 'r, E: CpuEngine> CpuIteration<'a, 'r, E> {
    pub fn new(
        plan: &'a Plan,
        models: &'a mut E,
        reward: &'a mut RewardFn<'r>,
        iteration: u32,
        prompts: &'a [PromptData],
    ) -> Result<Self, ExecError> {
        let book = Book::new(plan, iteration, prompts, reward)?;
        let groups = book.groups();
        let samples = book.samples();
        let max_new = plan.spec.rollout.max_new_tokens;
        let prefix_rows: u64 = prompts.iter().map(|p| p.ids.len() as u64).sum();
        let cap = prefix_rows + samples as u64 * max_new as u64;
        let cap =
            u32::try_from(cap).map_err(|_| ExecError::Data("KV arena over 2^32 rows".into()))?;
        let arena = models.kv_arena(cap);
        Ok(CpuIteration {
            models,
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
            residency: HostResidency::of(plan),
            stream: plan.optimizer_stream.clone(),
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
        models: &E,
        role: Role,
        p: &PromptData,
        copies: u32,
    ) -> Result<Vec<EncodedMedia>, ExecError> {
        let inputs = Self::media_inputs(p);
        let mut out = models.encode(role, &inputs)?;
        // Without prefix dedup every sample encodes its own copy (the ablation's cost); the
        // copies are identical by determinism, so one is kept.
        for _ in 1..copies {
            out = models.encode(role, &inputs)?;
        }
        Ok(out)
    }

    fn prefill_one(
        models: &E,
        role: Role,
        p: &PromptData,
        media: &[EncodedMedia],
        copies: u32,
    ) -> Result<PrefixState, ExecError> {
        let refs: Vec<&EncodedMedia> = media.iter().collect();
        let prompt = Prompt {
            ids: &p.ids,
            media: &refs,
        };
        let mut state = models.prefill(role, prompt)?;
        for _ in 1..copies {
            state = models.prefill(role, prompt)?;
        }
        Ok(state)
    }

    fn actor_media(&mut self, g: usize, copies: u32) -> Result<Vec<EncodedMedia>, ExecError> {
        match &self.encoded[g] {
            Some(m) => Ok(m.clone()),
            None => Self::encode(self.models, Role::Actor, &self.book.prompts[g], copies),
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
        if !self.models.has_reference() {
            return Err(no_reference());
        }
        let m = Self::encode(self.models, Role::Reference, &self.book.prompts[g], copies)?;
        self.ref_encoded[g] = Some(m.clone());
        Ok(m)
    }

    fn run_prefill(&mut self, groups: Span, copies: u32) -> Result<(), ExecError> {
        for g in range(groups) {
            let media = self.actor_media(g, copies)?;
            let state = Self::prefill_one(
                self.models,
                Role::Rollout,
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
        let temp = self.book.temperature();
        let mut step = first_step;
        while (until_done || step < first_step + steps) && self.book.any_active() {
            let mut active = Vec::new();
            let mut keys = Vec::new();
            for s in 0..self.book.samples() {
                if self.book.stopped[s] {
                    continue;
                }
                self.book.check_step(s, step)?;
                active.push(s);
                keys.push(SampleKey {
                    seed: self.book.spec.seed,
                    iteration: self.book.iteration,
                    sample: s as u32,
                    step,
                });
            }
            let rows: Vec<&[f32]> = active
                .iter()
                .map(|&s| self.next_logits[s].as_slice())
                .collect();
            let drawn = self.models.draw(&rows, &keys, &self.book.sampling, temp)?;
            let mut feed_slots = Vec::new();
            let mut feed_tokens = Vec::new();
            let mut feed_samples = Vec::new();
            for (&s, (tok, lp)) in active.iter().zip(drawn) {
                if self.book.push_token(s, tok, lp, step) {
                    feed_slots.push(self.slots[s]);
                    feed_tokens.push(tok);
                    feed_samples.push(s);
                }
            }
            if !feed_samples.is_empty() {
                let logits =
                    self.models
                        .decode_step(&mut self.arena, &mut feed_slots, &feed_tokens)?;
                let v = logits.len() / feed_samples.len();
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
        let out = self.models.micro_batch(micro_batch, &batch, mb.norm)?;
        drop(batch);
        drop(responses);
        self.book.micro_batch_done(step, &mb, &out);
        Ok(())
    }

    /// Results of the iteration, for metrics, tests and the bitwise invariant.
    pub fn finish(self) -> IterationResult {
        self.book.finish()
    }
}

impl<E: CpuEngine> TaskRunner for CpuIteration<'_, '_, E> {
    type Error = ExecError;

    fn slots_bound(&self) -> u32 {
        self.book.slots_bound()
    }

    fn run(&mut self, task: &Task) -> Result<(), ExecError> {
        self.residency.step(task)?;
        let temp = self.book.temperature();
        match &task.op {
            Op::EncodeMedia { groups, copies } => {
                for g in range(*groups) {
                    self.encoded[g] = Some(Self::encode(
                        self.models,
                        Role::Rollout,
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
                    self.ref_prefixes[g] = Some(Self::prefill_one(
                        self.models,
                        Role::Reference,
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
                let lps =
                    self.models
                        .score(Role::Reference, prefix, &self.book.responses(g), temp)?;
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
                            self.models,
                            Role::Actor,
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
                let lps = self
                    .models
                    .score(Role::Actor, prefix, &self.book.responses(g), temp)?;
                self.book.set_old_logp(g, lps);
            }
            Op::Reward { slot } => self.book.reward(*slot)?,
            Op::Advantages { slot } => self.book.advantages(*slot)?,
            Op::TrainMicroBatch {
                step,
                micro_batch,
                samples,
                ..
            } => self.run_train_micro_batch(*step, *micro_batch, *samples)?,
            Op::OptimizerStep { .. } => {
                // streamed: the state here (the host copy) stays the source of truth and each
                // chunk goes through a staging slot, in the plan's order
                let stream = self.stream.as_ref().filter(|st| st.gpu == task.gpu);
                self.book.metrics.grad_norm = self.models.optimizer_step(stream)?;
                self.book.metrics.optimizer_steps += 1;
            }
            Op::WeightSync { .. } => self.models.weight_sync()?,
            Op::Reshard { .. } | Op::Offload { .. } | Op::Reload { .. } => {}
        }
        self.book.metrics.tasks += 1;
        Ok(())
    }
}
